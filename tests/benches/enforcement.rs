//! Kernel enforcement latency, with the real `teeguard-agent` process against the fake API server:
//!
//! 1. NRI: `CreateContainer` round trips through the fake runtime (real wire protocol over the Unix
//!    socket: mux frames, ttrpc, protobuf) — for containers of pods teeguard does not limit (most of a
//!    node's containers) and for TEE `compute` containers; target p99 < 1 ms (the runtime fails a
//!    container whose plugin is slow);
//! 2. cgroup writer: from the kubelet creating a TEE pod's cgroup to `misc.max` holding its limit
//!    (inotify, then one write and a read-back); target p99 < 100 ms (before QEMU starts).
//!
//! `cargo bench -p teeguard-tests --bench enforcement` (quick: `TEEGUARD_BENCH_QUICK=1`; a smoke run
//! under `cargo test --benches`). The binaries come from the same profile (built when missing).

mod support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use support::{Stats, fmt_dur, section};
use teeguard_tests::e2e::E2eEnv;
use teeguard_tests::fixtures::{NodeBuilder, TDX_KEYS, Tee, VirtLauncherPod};
use teeguard_tests::host::{QosClass, SimHost, TDX};
use teeguard_tests::nri::{NriRuntime, misc_max};
use teeguard_tests::standalone::driver::strip_server_fields;

const NODE: &str = "node-a";

fn seed(env: &E2eEnv) {
    env.api
        .create(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}}))
        .expect("namespace");
    let mut n = NodeBuilder::new(NODE).to_value();
    strip_server_fields(&mut n);
    env.api.create(&n).expect("node");
}

fn tee_pod(env: &E2eEnv, i: usize) -> Value {
    let pod = VirtLauncherPod::for_tee(&format!("vm-{i}"), Tee::Tdx)
        .patched(TDX_KEYS, "tdx 1")
        .running_on(NODE)
        .build();
    let mut v = serde_json::to_value(&pod).expect("json");
    strip_server_fields(&mut v);
    env.api.create(&v).expect("pod")
}

fn sandbox(pod: &Value) -> Value {
    let m = &pod["metadata"];
    json!({"id": format!("sb-{}", m["uid"].as_str().unwrap_or("")), "name": m["name"], "uid": m["uid"],
           "namespace": m["namespace"], "annotations": m.get("annotations").cloned().unwrap_or(json!({}))})
}

fn report(what: &str, samples: &mut [Duration], target: Duration) {
    let s = Stats::from_samples(samples);
    println!(
        "{what:<44} n={:<5} p50 {:>9}  p99 {:>9}  max {:>9}  target p99 < {}  {}",
        s.count,
        fmt_dur(s.p50),
        fmt_dur(s.p99),
        fmt_dur(s.max),
        fmt_dur(target),
        if s.p99 < target { "met" } else { "NOT MET" }
    );
}

async fn nri(rounds: usize) {
    section("NRI CreateContainer round trip (fake runtime <-> agent process)");
    let dir = tempfile::tempdir().expect("dir");
    let socket = dir.path().join("nri.sock");
    let runtime = NriRuntime::start(&socket).await.expect("runtime");
    let config = format!(
        "agent:\n  pollInterval: 1s\nenforcement:\n  mode: nri\n  nriSocket: {}\n",
        socket.display()
    );
    let env = E2eEnv::new(&config).await.expect("env");
    seed(&env);
    let host = SimHost::builder().capacity(TDX, 64).build().expect("host");
    let _agent = env.start_agent(NODE, &host).await.expect("agent");
    runtime
        .wait_registered(Duration::from_secs(10))
        .await
        .expect("registered");
    let pods: Vec<Value> = (0..16).map(|i| tee_pod(&env, i)).collect();
    // Let the agent's pod watch take the pods in (the cached path is the one measured).
    tokio::time::sleep(Duration::from_millis(500)).await;

    let mut plain = Vec::with_capacity(rounds);
    let mut tee = Vec::with_capacity(rounds);
    for i in 0..rounds {
        let other = json!({"id": format!("sb-plain-{i}"), "name": format!("web-{i}"), "namespace": "default",
                           "uid": "5b7e3f1a-1c2d-4e5f-8a9b-0c1d2e3f4a5b", "annotations": {"app": "web"}});
        let started = Instant::now();
        let resp = runtime
            .create_container(other, json!({"id": format!("c-{i}"), "name": "nginx"}))
            .await
            .expect("answered");
        plain.push(started.elapsed());
        assert_eq!(misc_max(&resp), None);

        let pod = &pods[i % pods.len()];
        let started = Instant::now();
        let resp = runtime
            .create_container(
                sandbox(pod),
                json!({"id": format!("t-{i}"), "name": "compute"}),
            )
            .await
            .expect("answered");
        tee.push(started.elapsed());
        assert_eq!(misc_max(&resp), Some("tdx 1"));
    }
    report(
        "unrelated container (no adjustment)",
        &mut plain,
        Duration::from_millis(1),
    );
    report(
        "TEE compute container (misc.max tdx 1)",
        &mut tee,
        Duration::from_millis(1),
    );
}

async fn cgroup(pods: usize) {
    section("cgroup writer: pod cgroup created -> misc.max set");
    let env = E2eEnv::new("agent:\n  pollInterval: 1s\nenforcement:\n  mode: cgroup\n")
        .await
        .expect("env");
    seed(&env);
    let host = SimHost::builder()
        .capacity(TDX, 1024)
        .build()
        .expect("host");
    let _agent = env.start_agent(NODE, &host).await.expect("agent");
    let stored: Vec<Value> = (0..pods).map(|i| tee_pod(&env, i)).collect();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut samples = Vec::with_capacity(pods);
    for pod in &stored {
        let uid = pod["metadata"]["uid"].as_str().expect("uid").to_string();
        let started = Instant::now();
        host.add_pod(&uid, QosClass::Burstable, &["compute"])
            .expect("cgroup");
        loop {
            if host.pod_max(&uid, TDX) == Some(Some(1)) {
                break;
            }
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "pod {uid} never limited: its misc.max reads {:?}",
                host.pod_cgroup_path(&uid)
                    .map(|p| std::fs::read_to_string(p.join("misc.max")))
            );
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        samples.push(started.elapsed());
    }
    report(
        "TEE pod cgroup limited after it appeared",
        &mut samples,
        Duration::from_millis(100),
    );
}

fn main() {
    let full = support::run_mode("enforcement");
    let rt = support::runtime(2);
    rt.block_on(async {
        nri(if full { 2000 } else { 50 }).await;
        cgroup(if full { 100 } else { 10 }).await;
    });
}
