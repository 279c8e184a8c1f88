//! Freshness (issue 21, part 1): how long after a VM stops on a full node the scheduler's next binding
//! there is admitted — kernel `misc.current` drops → agent poll → report published → the webhook's
//! report cache → the binding review passes — and the reverse: a VM outside Kubernetes takes a key →
//! the Node's allocatable drops. The real `teeguard-agent` and `teeguard-webhook` processes, the fake
//! API server and a simulated host; the binding is retried every 5 ms (the scheduler retries a refused
//! binding after 1-10 s, so this measures the chain, not the scheduler's backoff).
//!
//! `cargo bench -p teeguard-tests --bench freshness` (quick: `TEEGUARD_BENCH_QUICK=1`).

mod support;

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use support::{Stats, fmt_dur, section};
use teeguard_tests::e2e::{NODE, World};
use teeguard_tests::host::TDX;

fn key(p: &Pod) -> (String, String) {
    (
        p.metadata.namespace.clone().expect("ns"),
        p.metadata.name.clone().expect("name"),
    )
}

fn allocatable(w: &World) -> Option<String> {
    let n: Node = w.env.api.get_typed(None, NODE).ok()??;
    teeguard_tests::fixtures::node_resource(&n, teeguard_tests::fixtures::TDX_KEYS).1
}

async fn run(poll: Duration, events: usize) -> Stats {
    let config = format!("agent:\n  pollInterval: {}ms\n", poll.as_millis());
    let w = World::start(1, &config).await.expect("world");
    // The node's one key held by a running VM.
    // Every VM's pod is created while the node still has its key (a pod CREATE is refused on a full
    // node); they wait unbound, as pods the scheduler keeps retrying do.
    let mut queue = Vec::with_capacity(events);
    for i in 1..=events {
        queue.push(w.admitted_tdx_vm(&format!("vm-{i:03}")).await);
    }
    let mut running = w.admitted_tdx_vm("vm-000").await;
    let (ns, name) = key(&running);
    assert!(w.driver.bind(&ns, &name, NODE).await.expect("bind").bound);
    w.start_tdx_vm(&running).expect("VM starts");
    w.settle().await.expect("settled");

    let mut freed = Vec::with_capacity(events);
    for next in queue {
        let before = w
            .driver
            .review_binding(&next, NODE)
            .await
            .expect("answered");
        assert!(!before.allowed, "the node is full before the VM stops");
        // The VM stops (its pod ends with it).
        let stopped = Instant::now();
        w.kubelet().stop(&w.stored(&running)).expect("stop");
        loop {
            let r = w
                .driver
                .review_binding(&next, NODE)
                .await
                .expect("answered");
            if r.allowed {
                break;
            }
            assert!(
                stopped.elapsed() < Duration::from_secs(30),
                "never admitted"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        freed.push(stopped.elapsed());
        let (nns, nname) = key(&next);
        w.env.api.bind_pod(&nns, &nname, NODE).expect("bound");
        w.start_tdx_vm(&next).expect("VM starts");
        running = next;
        w.settle().await.expect("settled");
    }
    Stats::from_samples(&mut freed)
}

/// A VM outside Kubernetes takes one of a node's two keys: until the Node's allocatable drops to 1.
async fn reverse(poll: Duration, events: usize) -> Stats {
    let config = format!("agent:\n  pollInterval: {}ms\n", poll.as_millis());
    let w = World::start(2, &config).await.expect("world");
    let mut taken = Vec::with_capacity(events);
    for i in 0..events {
        // Start at a different phase of the agent's poll each time (the scheduler of the VM outside
        // Kubernetes knows nothing of it).
        tokio::time::sleep(poll.mul_f64(((i * 37) % 100) as f64 / 100.0)).await;
        let started = Instant::now();
        w.host.add_external("outside", TDX, 1).expect("external VM");
        while allocatable(&w).as_deref() != Some("1") {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "allocatable never dropped"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        taken.push(started.elapsed());
        w.host
            .remove_external("outside")
            .expect("external VM stops");
        let back = Instant::now();
        while allocatable(&w).as_deref() != Some("2") {
            assert!(
                back.elapsed() < Duration::from_secs(30),
                "allocatable never came back"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    Stats::from_samples(&mut taken)
}

fn row(what: &str, s: &Stats, target: Option<Duration>) {
    println!(
        "{what:<58} n={:<4} p50 {:>9}  p99 {:>9}  max {:>9}{}",
        s.count,
        fmt_dur(s.p50),
        fmt_dur(s.p99),
        fmt_dur(s.max),
        target.map_or(String::new(), |t| format!(
            "  target p99 <= {}  {}",
            fmt_dur(t),
            if s.p99 <= t { "met" } else { "NOT MET" }
        ))
    );
}

fn main() {
    let events = if support::run_mode("freshness") {
        30
    } else {
        4
    };
    let rt = support::runtime(2);
    rt.block_on(async {
        section(
            "freshness: a freed key becomes admissible / a taken key leaves the Node's allocatable",
        );
        for poll in [Duration::from_secs(1), Duration::from_millis(250)] {
            let freed = run(poll, events).await;
            let taken = reverse(poll, events).await;
            let target = (poll == Duration::from_secs(1)).then_some(Duration::from_millis(1500));
            row(
                &format!("poll {}: VM stops -> next binding admitted", fmt_dur(poll)),
                &freed,
                target,
            );
            row(
                &format!(
                    "poll {}: external VM takes a key -> Node allocatable drops",
                    fmt_dur(poll)
                ),
                &taken,
                None,
            );
        }
    });
}
