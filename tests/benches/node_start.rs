//! Container start on a real node (`teeguard_tests::node`: kubelet v1.36 on containerd v2.4, or CRI-O
//! with `TEEGUARD_BENCH_RUNTIME=crio`), with and without the agent's NRI plugin registered, in one
//! run: pods are created in batches of 10, the two sides alternating batch by batch (and which goes
//! first alternating round by round) so that drift on the machine falls on both, each batch after
//! the same pause. Without the plugin the agent process is killed (the runtime then has no plugin);
//! with it, a new agent has registered.
//!
//! Figures per side, p50 / p99:
//! - pod start as the runtime sees it: `RunPodSandbox` received → the container's `StartContainer`
//!   returned (the runtime's own log timestamps, ns);
//! - `CreateContainer` in the runtime (request → container ID), which holds the NRI round trip; the
//!   difference of the two sides is the NRI answer time as the runtime pays it (containerd logs
//!   nothing about NRI at info level);
//! - end to end: the pod's CREATE answered by the API server → seen Running (polled every 25 ms).
//!
//! The ratios (with / without) are the figures: target p50 and p99 <= 1.05. The pods are plain
//! busybox pods (the plugin answers them from memory, with no adjustment: what every container on a
//! node costs); a TDX VM's compute container is one extra container per VM.
//!
//! Needs the real node (see `teeguard_tests::node`), the control plane and helm; without them it says
//! so and exits. `cargo bench -p teeguard-tests --bench node_start` (100 pods per side; quick:
//! `TEEGUARD_BENCH_QUICK=1`, 20).

#[path = "../tests/chart_support/mod.rs"]
mod chart_support;
#[path = "../tests/node_support/mod.rs"]
mod node_support;
mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use node_support::{NodeWorld, Options, running};
use support::{BATCH, SETTLE, Side, TARGET_RATIO, fmt_dur, report_sides, section};
use teeguard_tests::node::{Runtime, pods};

const LABELS: [&str; 2] = ["with the plugin", "without"];

fn main() {
    let full = support::run_mode("node_start");
    let per_side = if full { 100 } else { 20 };
    let runtime = match std::env::var("TEEGUARD_BENCH_RUNTIME").as_deref() {
        Ok("crio") => Runtime::Crio,
        _ => Runtime::Containerd,
    };
    support::runtime(2).block_on(run(runtime, per_side));
}

async fn run(runtime: Runtime, per_side: usize) {
    let Some(mut w) = NodeWorld::start(runtime, "bench", Options::simulated()).await else {
        println!("node_start: no real node on this machine (see the line above); nothing measured");
        return;
    };
    section(&format!(
        "container start on a real node ({}; kubelet v1.36), {per_side} pods per side, batches of {BATCH}",
        runtime.name()
    ));
    let api: Api<Pod> = w.pods_in(&w.ns);
    let mut side_of: HashMap<String, Side> = HashMap::new();
    let mut e2e: HashMap<Side, Vec<Duration>> = HashMap::new();
    let mut plugin = true;
    for round in 0..per_side / BATCH {
        for side in Side::order(round) {
            match (side, plugin) {
                (Side::With, false) => w.restart_agent().await,
                (Side::Without, true) => {
                    w.agent.proc.kill();
                    // The runtime sees the connection close at once; let it drop the plugin.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                _ => {}
            }
            plugin = side == Side::With;
            // Both sides start from the same quiet: the previous batch's deletion, and the agent's
            // start or end, settled.
            tokio::time::sleep(SETTLE).await;
            let names: Vec<String> = (0..BATCH)
                .map(|i| format!("r{round}-{side:?}-{i}").to_lowercase())
                .collect();
            let mut created = HashMap::new();
            for name in &names {
                let pod = pods::plain(&w.ns, name, &[("main", &[])], &w.selector());
                api.create(&PostParams::default(), &pod)
                    .await
                    .expect("pod created");
                created.insert(name.clone(), Instant::now());
                side_of.insert(name.clone(), side);
            }
            let ran = wait_running(&api, &names).await;
            e2e.entry(side).or_default().extend(
                names
                    .iter()
                    .map(|n| ran[n].saturating_duration_since(created[n])),
            );
            delete_all(&w, &api).await;
        }
    }

    let log = w.turn.log(runtime.name());
    let parsed = parse_runtime_log(&log);
    let mut start: HashMap<Side, Vec<Duration>> = HashMap::new();
    let mut create: HashMap<Side, Vec<Duration>> = HashMap::new();
    for (name, t) in &parsed {
        let Some(side) = side_of.get(name) else {
            continue;
        };
        if let (Some(s), Some(e)) = (t.sandbox_requested, t.started) {
            start.entry(*side).or_default().push(e - s);
        }
        if let (Some(s), Some(e)) = (t.create_requested, t.created) {
            create.entry(*side).or_default().push(e - s);
        }
    }
    for (what, series) in [
        (
            "pod start in the runtime (RunPodSandbox → StartContainer returned)",
            &mut start,
        ),
        (
            "CreateContainer in the runtime (holds the NRI round trip)",
            &mut create,
        ),
        (
            "end to end (CREATE answered → seen Running, 25 ms polls)",
            &mut e2e,
        ),
    ] {
        report_sides(
            what,
            series,
            LABELS,
            TARGET_RATIO,
            Some(|a, b| format!("p50 difference {}", signed(a, b))),
        );
    }
}

fn signed(a: Duration, b: Duration) -> String {
    if a >= b {
        format!("+{}", fmt_dur(a - b))
    } else {
        format!("-{}", fmt_dur(b - a))
    }
}

/// Poll until every pod of `names` runs; when each was first seen Running.
async fn wait_running(api: &Api<Pod>, names: &[String]) -> HashMap<String, Instant> {
    let deadline = Instant::now() + node_support::RUN_DEADLINE;
    let mut ran = HashMap::new();
    while ran.len() < names.len() {
        assert!(
            Instant::now() < deadline,
            "pods not Running: {names:?} (ran: {ran:?})"
        );
        if let Ok(list) = api.list(&ListParams::default()).await {
            let now = Instant::now();
            for p in list.items.iter().filter(|p| running(p)) {
                let name = p.metadata.name.clone().unwrap_or_default();
                if names.contains(&name) {
                    ran.entry(name).or_insert(now);
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    ran
}

/// Delete every pod of the namespace and wait until the API and the runtime have none left.
async fn delete_all(w: &NodeWorld, api: &Api<Pod>) {
    let dp = DeleteParams::default().grace_period(0);
    let list = api.list(&ListParams::default()).await.expect("list");
    for p in &list.items {
        let _ = api
            .delete(p.metadata.name.as_deref().unwrap_or_default(), &dp)
            .await;
    }
    let deadline = Instant::now() + node_support::RUN_DEADLINE;
    loop {
        let left = api
            .list(&ListParams::default())
            .await
            .map(|l| l.items.len())
            .unwrap_or(1);
        let containers = w.turn.crictl(&["ps", "-q"]).unwrap_or_default();
        if left == 0 && containers.trim().is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "pods not gone: {left} in the API"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The runtime's timestamps for one pod (one container).
#[derive(Debug, Default)]
struct Timeline {
    sandbox_requested: Option<Duration>,
    create_requested: Option<Duration>,
    created: Option<Duration>,
    started: Option<Duration>,
}

/// Per pod name, from containerd's or CRI-O's log: `RunPodSandbox` requested, `CreateContainer`
/// requested and returned, `StartContainer` returned (times since the Unix epoch).
fn parse_runtime_log(log: &str) -> HashMap<String, Timeline> {
    let mut out: HashMap<String, Timeline> = HashMap::new();
    let mut pod_of_sandbox: HashMap<String, String> = HashMap::new();
    let mut pod_of_container: HashMap<String, String> = HashMap::new();
    for line in log.lines() {
        let Some(t) = timestamp(line) else { continue };
        let msg = line.split(" msg=\"").nth(1).unwrap_or_default();
        if let Some(rest) = msg.strip_prefix("RunPodSandbox for name:\\\"") {
            let name = rest.split('\\').next().unwrap_or_default().to_string();
            match quoted_after(msg, "returns sandbox id ") {
                Some(id) => {
                    pod_of_sandbox.insert(id, name);
                }
                None => out.entry(name).or_default().sandbox_requested = Some(t),
            }
        } else if let Some(rest) = msg.strip_prefix("CreateContainer within sandbox \\\"") {
            let sandbox = rest.split('\\').next().unwrap_or_default();
            let Some(pod) = pod_of_sandbox.get(sandbox).cloned() else {
                continue;
            };
            match quoted_after(msg, "returns container id ") {
                Some(id) => {
                    out.entry(pod.clone()).or_default().created = Some(t);
                    pod_of_container.insert(id, pod);
                }
                None => out.entry(pod).or_default().create_requested = Some(t),
            }
        } else if let Some(rest) = msg.strip_prefix("StartContainer for \\\"")
            && msg.contains("returns successfully")
        {
            let id = rest.split('\\').next().unwrap_or_default();
            if let Some(pod) = pod_of_container.get(id) {
                out.entry(pod.clone()).or_default().started = Some(t);
            }
        }
    }
    out
}

/// `time="2026-11-26T01:01:32.584274098Z"` as time since the epoch.
fn timestamp(line: &str) -> Option<Duration> {
    let raw = line.strip_prefix("time=\"")?.split('"').next()?;
    let ts: jiff::Timestamp = raw.parse().ok()?;
    Some(Duration::from_nanos(
        u64::try_from(ts.as_nanosecond()).ok()?,
    ))
}

/// The first `\"...\"`-quoted value after `marker` in a log message.
fn quoted_after(msg: &str, marker: &str) -> Option<String> {
    let rest = msg.split(marker).nth(1)?.strip_prefix("\\\"")?;
    Some(rest.split('\\').next()?.to_string())
}
