//! Scheduling TEE pods on the real scheduler, DRA mode against extended-resource mode, in one run
//! (`teeguard_tests::node`: kubelet v1.36 on containerd v2.4 and the real control plane).
//!
//! For each mode a fresh world (the agent in that mode on a simulated host with as many TDX keys as
//! pods), then N pods each requesting `tdx.intel.com/keys: 1` created at once (past the webhook, so
//! only the scheduler decides): throughput = N / (first CREATE sent → last pod bound, as a pod watch
//! sees `spec.nodeName` appear). In DRA mode the scheduler allocates a device through a claim it
//! creates per pod; in extended-resource mode it counts the Node's allocatable. Target: DRA ≥ 0.8× the
//! extended-resource throughput. Then, in DRA mode, the kubelet's NodePrepareResources calls as the
//! agent measured them (its `teeguard_agent_dra_prepare_seconds` histogram: p50 / p99 bucket bounds).
//! And a control: DRA mode again with the agent stopped once its slices are published, to tell
//! teeguard's share of DRA's time from the scheduler's.
//!
//! Needs the real node and the control plane; without them it says so and exits.
//! `cargo bench -p teeguard-tests --bench dra_scheduling` (200 pods per mode, as the issue asks; quick: 30).

#[path = "../tests/chart_support/mod.rs"]
mod chart_support;
#[path = "../tests/node_support/mod.rs"]
mod node_support;
mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::{WatchStreamExt, watcher};
use node_support::{NodeWorld, Options, dra, unguarded_namespace};
use support::{fmt_dur, section};
use teeguard_tests::node::Runtime;

const TARGET_RATIO: f64 = 0.8;

fn main() {
    let full = support::run_mode("dra_scheduling");
    // The test node's kubelet runs up to 250 pods (maxPods; the default is 110).
    let pods = if full { 200 } else { 30 };
    support::runtime(2).block_on(run(pods));
}

struct Figures {
    elapsed: Duration,
    per_second: f64,
}

async fn run(pods: usize) {
    section(&format!(
        "scheduling {pods} TEE pods on the real scheduler (kubelet v1.36 on containerd): extended resource vs DRA"
    ));
    let Some(er) = measure(false, pods).await else {
        println!(
            "dra_scheduling: no real node on this machine (see the line above); nothing measured"
        );
        return;
    };
    let Some(dra_fig) = measure(true, pods).await else {
        return;
    };
    // The control: the same DRA run with teeguard's agent stopped once its slices are published (they
    // stay, and the scheduler reads nothing else of teeguard's): what the scheduler does alone.
    let Some(alone) = measure_with(true, true, pods).await else {
        return;
    };
    let ratio = dra_fig.per_second / er.per_second;
    println!(
        "extended resource: {pods} bound in {} ({:.1} pods/s)",
        fmt_dur(er.elapsed),
        er.per_second
    );
    println!(
        "DRA:               {pods} bound in {} ({:.1} pods/s)",
        fmt_dur(dra_fig.elapsed),
        dra_fig.per_second
    );
    println!(
        "DRA, agent stopped: {pods} bound in {} ({:.1} pods/s): teeguard's share of DRA's time {:+.0} %",
        fmt_dur(alone.elapsed),
        alone.per_second,
        (dra_fig.elapsed.as_secs_f64() / alone.elapsed.as_secs_f64() - 1.0) * 100.0
    );
    println!(
        "DRA / extended resource throughput: {ratio:.2} (target >= {TARGET_RATIO}) {}",
        if ratio >= TARGET_RATIO {
            "ok"
        } else {
            "BELOW TARGET"
        }
    );
}

/// One mode: a fresh world, `n` pods at once, the time until all are bound.
async fn measure(dra_mode: bool, n: usize) -> Option<Figures> {
    measure_with(dra_mode, false, n).await
}

/// [`measure`]; `agent_stopped` (DRA mode): the agent is killed once its slices are published and the
/// kubelet registered it, and started again after the pods are bound (so that they can start and end).
async fn measure_with(dra_mode: bool, agent_stopped: bool, n: usize) -> Option<Figures> {
    let name = match (dra_mode, agent_stopped) {
        (false, _) => "bench-er",
        (true, false) => "bench-dra",
        (true, true) => "bench-dra-alone",
    };
    let options = if dra_mode {
        Options::dra(n as u64)
    } else {
        Options {
            host: node_support::AgentHost::Simulated {
                tdx: n as u64,
                sev_es: 0,
            },
            ..Options::simulated()
        }
    };
    let mut w = NodeWorld::start(Runtime::Containerd, name, options).await?;
    if dra_mode {
        dra::ensure_device_class(&w).await;
        dra::wait_published(&w, n, Duration::from_secs(30)).await;
        dra::wait_driver_ready(&w).await;
        if agent_stopped {
            w.agent.proc.kill();
        }
    } else {
        w.wait_allocatable(dra::TDX_KEYS, &n.to_string(), Duration::from_secs(30))
            .await;
    }
    let ns = unguarded_namespace(&w.cluster, name).await;
    let api: Api<Pod> = w.pods_in(&ns);
    // Watch first, so no binding is missed.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(String, Instant)>();
    let watch = tokio::spawn({
        let api = api.clone();
        async move {
            let stream = watcher(api, watcher::Config::default()).applied_objects();
            let mut stream = std::pin::pin!(stream);
            while let Some(Ok(p)) = stream.next().await {
                if p.spec.as_ref().and_then(|s| s.node_name.as_ref()).is_some() {
                    let _ = tx.send((p.metadata.name.clone().unwrap_or_default(), Instant::now()));
                }
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let started = Instant::now();
    let creates = (0..n).map(|i| {
        let pod = dra::key_pod(&w, &ns, &format!("p{i:03}"), "1");
        let w = &w;
        async move { w.create(&pod).await }
    });
    for r in futures::future::join_all(creates).await {
        r.expect("created");
    }
    let mut bound: HashMap<String, Instant> = HashMap::new();
    let deadline = started + Duration::from_secs(300);
    while bound.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, rx.recv()).await {
            Ok(Some((pod, at))) => {
                bound.entry(pod).or_insert(at);
            }
            _ => panic!(
                "{name}: {} of {n} pods bound within 300 s\n{}",
                bound.len(),
                w.diagnostics()
            ),
        }
    }
    watch.abort();
    let last = bound.values().max().copied().expect("pods");
    let elapsed = last - started;
    if agent_stopped {
        w.restart_agent().await;
    } else if dra_mode {
        prepare_figures(&w, n).await;
    }
    dra::end(&w).await;
    Some(Figures {
        elapsed,
        per_second: n as f64 / elapsed.as_secs_f64(),
    })
}

/// Wait until the kubelet had the agent prepare every claim, then print the p50 / p99 bucket bounds of
/// the agent's NodePrepareResources histogram.
async fn prepare_figures(w: &NodeWorld, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let metrics = w.agent.metrics().await;
        let buckets = histogram(&metrics, "teeguard_agent_dra_prepare_seconds");
        let count = buckets.last().map_or(0.0, |(_, c)| *c);
        if count >= n as f64 || Instant::now() >= deadline {
            let at = |q: f64| {
                buckets
                    .iter()
                    .find(|(_, c)| *c >= q * count)
                    .map_or("-".to_string(), |(le, _)| format!("<= {le}"))
            };
            println!(
                "NodePrepareResources ({count} calls, as the agent timed them): p50 {} s, p99 {} s",
                at(0.5),
                at(0.99)
            );
            return;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `(le, cumulative count)` of an OpenMetrics histogram.
fn histogram(text: &str, name: &str) -> Vec<(String, f64)> {
    let prefix = format!("{name}_bucket{{le=\"");
    text.lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|rest| {
            let (le, value) = rest.split_once("\"} ")?;
            Some((le.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}
