//! What sharing reservations between webhook replicas costs (issue 19): the latency of an admitted TEE
//! binding with `admission.sharedReservations` on (one watch-cache read and one write of the node's
//! `TeeReservation` through the API server) and off (this replica's ledger only), in the same run, and
//! the cost of a review that is not a TEE binding (unchanged: it never reaches the shared step).
//!
//! The real `teeguard-webhook` process against the fake API server on 127.0.0.1, one HTTPS connection
//! per review (the API server's pattern). `cargo bench -p teeguard-tests --bench shared_reservations`
//! (quick: `TEEGUARD_BENCH_QUICK=1`).

mod support;

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use support::{Stats, fmt_dur, section};
use teeguard_tests::e2e::{E2eEnv, WebhookProcess};
use teeguard_tests::fixtures;

async fn wait_cached(w: &WebhookProcess, pods: usize) {
    let want = format!("teeguard_webhook_cache_objects{{cache=\"virt_launcher_pods\"}} {pods}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !w.metrics().await.contains(&want) {
        assert!(Instant::now() < deadline, "pods never cached");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn run(shared: bool, n: usize) -> (Stats, Stats) {
    let config = format!("admission:\n  sharedReservations: {shared}\n  ledgerTtl: 10m\n");
    let env = E2eEnv::new(&config).await.expect("env");
    // Ten bindings per node, as a node filling up sees them (an object of a few entries).
    let nodes: Vec<String> = (0..n.div_ceil(10))
        .map(|i| format!("node-{i:03}"))
        .collect();
    for node in &nodes {
        fixtures::seed_tdx_node(&env.api, node, 64, 64);
    }
    let pods: Vec<Pod> = (0..n)
        .map(|i| fixtures::seed_admitted_tdx_vm(&env.api, &format!("vm{i:05}")))
        .collect();
    let webhook = env.start_webhook(&[]).await.expect("webhook");
    wait_cached(&webhook, n).await;
    let want = format!(
        "teeguard_webhook_cache_objects{{cache=\"teecapacities\"}} {}",
        nodes.len()
    );
    while !webhook.metrics().await.contains(&want) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let client = webhook.client().expect("client");
    let mut tee = Vec::with_capacity(n);
    let mut other = Vec::with_capacity(n);
    for (i, pod) in pods.iter().enumerate() {
        let node = &nodes[i % nodes.len()];
        let body = serde_json::to_vec(&fixtures::binding_create(pod, node)).expect("json");
        let started = Instant::now();
        let (status, resp) = client
            .post_fresh("/validate", &body)
            .await
            .expect("answered");
        tee.push(started.elapsed());
        assert_eq!(status, 200);
        assert!(String::from_utf8_lossy(&resp).contains("\"allowed\":true"));
        // Not a TEE binding (any other pod's binding): skipped before any lookup.
        let mut plain = pod.clone();
        plain.metadata.name = Some(format!(
            "web-{}",
            pod.metadata.name.as_deref().unwrap_or("")
        ));
        let body = serde_json::to_vec(&fixtures::binding_create(&plain, node)).expect("json");
        let started = Instant::now();
        client
            .post_fresh("/validate", &body)
            .await
            .expect("answered");
        other.push(started.elapsed());
    }
    (
        Stats::from_samples(&mut tee),
        Stats::from_samples(&mut other),
    )
}

fn row(what: &str, s: &Stats) {
    println!(
        "{what:<52} n={:<5} p50 {:>9}  p99 {:>9}  max {:>9}",
        s.count,
        fmt_dur(s.p50),
        fmt_dur(s.p99),
        fmt_dur(s.max)
    );
}

fn main() {
    let n = if support::run_mode("shared_reservations") {
        1000
    } else {
        30
    };
    let rt = support::runtime(2);
    rt.block_on(async {
        section("admitted TEE binding, new HTTPS connection per review");
        let (off_tee, off_other) = run(false, n).await;
        let (on_tee, on_other) = run(true, n).await;
        row(
            "TEE binding, ledger only (sharedReservations: false)",
            &off_tee,
        );
        row("TEE binding, shared TeeReservation (default)", &on_tee);
        println!(
            "added by the shared reservation: p50 {}  p99 {}",
            fmt_dur(on_tee.p50.saturating_sub(off_tee.p50)),
            fmt_dur(on_tee.p99.saturating_sub(off_tee.p99))
        );
        row("other binding, sharing off", &off_other);
        row("other binding, sharing on (unchanged)", &on_other);
    });
}
