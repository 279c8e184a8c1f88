//! What one heartbeat costs a real kube-apiserver and etcd (issue 21, part 2): the API load bench
//! counts requests; this weighs them. The control plane of `../shared/control-plane` (v1.36) takes
//! heartbeats at the rate 5,000 nodes send them (one per node per 30 s: 167/s), with two watchers on
//! the written resource (the two webhook replicas), in three forms:
//!
//! - `apply`: server-side apply of the whole report status (the agent's heartbeat before the Lease);
//! - `merge`: a JSON merge patch of `status.heartbeatTime` only (measured, not adopted: no cheaper);
//! - `lease`: a merge patch of a `coordination.k8s.io/v1` Lease's `spec.renewTime` (the agent's
//!   heartbeat now, as the kubelet's).
//!
//! The figure is the CPU time kube-apiserver and etcd spent per heartbeat (utime + stime from
//! `/proc`), measured over the run. The report status is the one a real agent published for a
//! simulated TDX host (agent run in-process against this control plane first).
//!
//! `source scripts/control-plane.sh; cargo bench -p teeguard-tests --bench heartbeat_cost`
//! (quick: `TEEGUARD_BENCH_QUICK=1`).

mod support;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use support::section;
use teeguard_agent::run::{AgentOptions, READY_PODS, READY_SCAN};
use teeguard_shared::Config;
use teeguard_shared::crd::{TeeCapacity, TeeCapacityStatus};
use teeguard_shared::names::AGENT_FIELD_MANAGER;
use teeguard_shared::ops::Readiness;
use teeguard_tests::fixtures::NodeBuilder;
use teeguard_tests::host::{SimHost, TDX};
use teeguard_tests::patch::MergePatch;
use teeguard_tests::realcluster::Cluster;
use tokio_util::sync::CancellationToken;

/// Heartbeats per second: 5,000 nodes, one every 30 s.
const RATE: f64 = 5000.0 / 30.0;
/// Objects written in turn (one per simulated node).
const OBJECTS: usize = 200;

/// CPU time (user + system) of a process so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command (which may hold spaces) start after the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|i| fields.get(*i).and_then(|f| f.parse::<u64>().ok()))
        .sum();
    // USER_HZ is 100 on Linux.
    Duration::from_millis(ticks * 10)
}

/// The pid of the control plane's `component` (its command line names the control plane's files).
fn pid_of(component: &str, dir: &Path) -> u32 {
    let dir = dir.display().to_string();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let is_component = args
            .first()
            .is_some_and(|a| Path::new(a).file_name().is_some_and(|n| n == component));
        if is_component && args.iter().any(|a| a.contains(&dir)) {
            return pid;
        }
    }
    panic!("no {component} process of the control plane in {dir}")
}

/// The status a real agent publishes for a simulated TDX host with 16 keys.
async fn agent_status(cluster: &Cluster) -> TeeCapacityStatus {
    let node = "heartbeat-template";
    cluster
        .node(&NodeBuilder::new(node).tdx(16))
        .await
        .expect("node");
    let host = SimHost::builder().capacity(TDX, 16).build().expect("host");
    let shutdown = CancellationToken::new();
    let config = Config::from_yaml("enforcement:\n  mode: \"off\"\n").expect("config");
    let agent = tokio::spawn(teeguard_agent::run::run(
        cluster.client.clone(),
        AgentOptions::new(node, host.root(), config),
        teeguard_agent::metrics::Metrics::new(&mut Registry::default()),
        Readiness::new(&[READY_SCAN, READY_PODS]),
        shutdown.child_token(),
    ));
    let api: Api<TeeCapacity> = Api::all(cluster.client.clone());
    let status = cluster
        .wait_for("the agent's first report", || async {
            api.get(node).await.ok()?.status
        })
        .await
        .expect("report");
    shutdown.cancel();
    let _ = agent.await;
    status
}

/// Two watchers on `api`'s resource, as the webhook replicas watch reports.
fn watchers<K>(api: Api<K>, stop: CancellationToken)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    for _ in 0..2 {
        let api = api.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut events = watcher(api, watcher::Config::default()).boxed();
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    e = events.next() => if e.is_none() { return },
                }
            }
        });
    }
}

/// Sends `count` heartbeats at [`RATE`], `write(i)` writing object `i % OBJECTS`; returns the CPU
/// time kube-apiserver and etcd spent meanwhile, per heartbeat.
async fn measure<F, Fut>(pids: (u32, u32), count: usize, write: F) -> (Duration, Duration, usize)
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<(), kube::Error>> + Send + 'static,
{
    // Let the previous form's tail settle.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (api0, etcd0) = (cpu_time(pids.0), cpu_time(pids.1));
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(count);
    for i in 0..count {
        tokio::time::sleep_until(start + Duration::from_secs_f64(i as f64 / RATE)).await;
        tasks.push(tokio::spawn(write(i)));
    }
    let mut failed = 0;
    for t in tasks {
        if !matches!(t.await, Ok(Ok(()))) {
            failed += 1;
        }
    }
    // Watch fan-out and etcd's background work trail the last write a little.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let n = count as u32;
    (
        (cpu_time(pids.0) - api0) / n,
        (cpu_time(pids.1) - etcd0) / n,
        failed,
    )
}

fn main() {
    let count = if support::run_mode("heartbeat_cost") {
        5000
    } else {
        500
    };
    let rt = support::runtime(2);
    rt.block_on(async {
        section(&format!(
            "heartbeat cost on a real kube-apiserver: {count} heartbeats per form at {RATE:.0}/s (5,000 nodes every 30 s), 2 watchers"
        ));
        let Some(cluster) = Cluster::connect().await else {
            println!("skipped: no control plane (source scripts/control-plane.sh)");
            return;
        };
        let pids = (
            pid_of("kube-apiserver", cluster.cp.dir()),
            pid_of("etcd", cluster.cp.dir()),
        );
        let status = agent_status(&cluster).await;
        let status_bytes = serde_json::to_vec(&status).map_or(0, |v| v.len());

        // The reports (object, then status by apply, as the agent does).
        let reports: Api<TeeCapacity> = Api::all(cluster.client.clone());
        let apply = PatchParams::apply(AGENT_FIELD_MANAGER).force();
        for i in 0..OBJECTS {
            let name = format!("hb-{i:04}");
            let body = json!({
                "apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeCapacity",
                "metadata": {"name": name}, "spec": {"nodeName": name},
            });
            reports
                .patch(&name, &apply, &Patch::Apply(body))
                .await
                .expect("report object");
            reports
                .patch_status(&name, &apply, &Patch::Apply(status_body(&name, &status)))
                .await
                .expect("report status");
        }
        let stored = reports.get("hb-0000").await.expect("report");
        let object_bytes = serde_json::to_vec(&stored).map_or(0, |v| v.len());
        // The leases.
        let namespace = cluster
            .namespace("heartbeat_cost", "heartbeats", &[])
            .await
            .expect("namespace");
        let leases: Api<Lease> = Api::namespaced(cluster.client.clone(), &namespace);
        for i in 0..OBJECTS {
            let lease: Lease = serde_json::from_value(json!({
                "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                "metadata": {"name": format!("hb-{i:04}")},
                "spec": {"holderIdentity": format!("hb-{i:04}"), "leaseDurationSeconds": 40,
                         "renewTime": now_micro()},
            }))
            .expect("lease");
            leases
                .create(&PostParams::default(), &lease)
                .await
                .expect("lease");
        }
        let stop = CancellationToken::new();
        watchers(reports.clone(), stop.clone());
        watchers(leases.clone(), stop.clone());
        tokio::time::sleep(Duration::from_secs(2)).await;

        let status = Arc::new(status);
        let forms: Vec<(&str, (Duration, Duration, usize))> = vec![
            ("apply: whole status, server-side apply", {
                let (reports, status) = (reports.clone(), status.clone());
                measure(pids, count, move |i| {
                    let (reports, status) = (reports.clone(), status.clone());
                    async move {
                        let name = format!("hb-{:04}", i % OBJECTS);
                        let mut s = (*status).clone();
                        s.heartbeat_time = Some(Time(jiff::Timestamp::now()));
                        let pp = PatchParams::apply(AGENT_FIELD_MANAGER).force();
                        reports
                            .patch_status(&name, &pp, &Patch::Apply(status_body(&name, &s)))
                            .await
                            .map(|_| ())
                    }
                })
                .await
            }),
            ("merge: status.heartbeatTime, merge patch", {
                let reports = reports.clone();
                measure(pids, count, move |i| {
                    let reports = reports.clone();
                    async move {
                        let name = format!("hb-{:04}", i % OBJECTS);
                        let pp = PatchParams {
                            field_manager: Some(AGENT_FIELD_MANAGER.into()),
                            ..PatchParams::default()
                        };
                        let body = json!({"status": {"heartbeatTime": now_seconds()}});
                        reports
                            .patch_status(&name, &pp, &Patch::Merge(body))
                            .await
                            .map(|_| ())
                    }
                })
                .await
            }),
            ("lease: Lease spec.renewTime, merge patch", {
                let leases = leases.clone();
                measure(pids, count, move |i| {
                    let leases = leases.clone();
                    async move {
                        let name = format!("hb-{:04}", i % OBJECTS);
                        let body = json!({"spec": {"renewTime": now_micro()}});
                        leases
                            .merge_patch(&name, body)
                            .await
                            .map(|_| ())
                    }
                })
                .await
            }),
        ];
        stop.cancel();
        println!(
            "report status {status_bytes} bytes, stored report {object_bytes} bytes (with managedFields)"
        );
        let base = forms[0].1.0 + forms[0].1.1;
        for (form, (api, etcd, failed)) in &forms {
            let total = *api + *etcd;
            println!(
                "{form:<44} kube-apiserver {:>6.0} µs  etcd {:>5.0} µs  per heartbeat; {:>5.2} cores at 5,000 nodes; {:>3.0} % of apply{}",
                api.as_secs_f64() * 1e6,
                etcd.as_secs_f64() * 1e6,
                total.as_secs_f64() * RATE,
                100.0 * total.as_secs_f64() / base.as_secs_f64().max(1e-9),
                if *failed > 0 { format!("  ({failed} failed)") } else { String::new() }
            );
        }
    });
}

fn status_body(name: &str, status: &TeeCapacityStatus) -> Value {
    json!({
        "apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeCapacity",
        "metadata": {"name": name}, "status": status,
    })
}

fn now_seconds() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Second)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

fn now_micro() -> String {
    jiff::Timestamp::now()
        .round(jiff::Unit::Microsecond)
        .map(|t| t.strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string())
        .unwrap_or_default()
}
