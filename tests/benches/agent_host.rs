//! The real `teeguard-agent run` process (release build) on a simulated host with 500 pod cgroups
//! (16 of them TDX VMs, plus keys held outside Kubernetes), against the fake API server served on
//! 127.0.0.1 holding the same 500 pods bound to the node. Printed: time to `/readyz` 200, RSS
//! (VmRSS, VmHWM) and the process's CPU per second over the run (at the default 1 s poll interval,
//! that is the CPU per scan + attribution + publish), from /proc. The per-scan cost alone is the
//! agent's own bench: `cargo bench -p teeguard-agent --bench scan`.
//!
//! `cargo bench -p teeguard-tests --bench agent_host` (quick: `TEEGUARD_BENCH_QUICK=1`). The agent
//! binary is built first with `cargo build --release -p teeguard-agent` (a no-op when up to date), or
//! taken from `TEEGUARD_AGENT_BIN` when set.

mod support;

use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use support::{fmt_dur, proc_cpu, proc_status_kib, release_binary, section};
use teeguard_tests::fakeapi::{FakeApiOptions, FakeApiServer};
use teeguard_tests::fixtures::{self, KataTee, NodeBuilder, Tee, VirtLauncherPod};
use teeguard_tests::host::{CgroupDriver, CgroupVersion, QosClass, SimHost, TDX};
use teeguard_tests::ports::free_ports;
use teeguard_tests::prom::Scrape;

const NODE: &str = "node01";

/// GET `path` on the admin endpoint: the body when the answer is 2xx.
async fn admin_get(admin: SocketAddr, path: &str) -> Option<String> {
    use http_body_util::BodyExt;
    let stream = tokio::net::TcpStream::connect(admin).await.ok()?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .ok()?;
    tokio::spawn(conn);
    let req = http::Request::get(path)
        .header(http::header::HOST, "localhost")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("request");
    let resp = sender.send_request(req).await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    Some(String::from_utf8_lossy(&body).into_owned())
}

/// On-CPU time of all of `pid`'s threads from `/proc/<pid>/task/*/schedstat` (nanoseconds; exact for
/// threads not running at that instant, unlike the 10 ms ticks of `/proc/<pid>/stat`). Threads that
/// end between two samples are lost: the agent's threads live as long as it does.
fn tasks_cpu(pid: u32) -> Option<Duration> {
    let mut ns = 0u64;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let text = std::fs::read_to_string(task.ok()?.path().join("schedstat")).ok()?;
        ns += text.split_whitespace().next()?.parse::<u64>().ok()?;
    }
    Some(Duration::from_nanos(ns))
}

async fn readyz(admin: SocketAddr) -> bool {
    admin_get(admin, "/readyz").await.is_some()
}

/// `(sum in seconds, count)` of the agent's scan-duration histogram.
async fn scan_histogram(admin: SocketAddr) -> Option<(f64, u64)> {
    let scrape = Scrape::parse(&admin_get(admin, "/metrics").await?);
    Some((
        scrape.get("teeguard_agent_scan_duration_seconds_sum", &[])?,
        scrape.get("teeguard_agent_scan_duration_seconds_count", &[])? as u64,
    ))
}

fn main() {
    let steal = support::StealWatch::start();
    let full = support::run_mode("agent_host");
    let (pods, vms, run_for) = if full {
        (500, 16, Duration::from_secs(20))
    } else {
        (50, 4, Duration::from_secs(3))
    };
    // TEEGUARD_AGENT_BIN measures a given binary instead (to compare builds side by side).
    let binary = match std::env::var_os("TEEGUARD_AGENT_BIN") {
        Some(path) => std::path::PathBuf::from(path),
        None => release_binary("teeguard-agent", "teeguard-agent"),
    };
    let rt = support::runtime(1);

    let host = SimHost::builder()
        .version(CgroupVersion::V2)
        .driver(CgroupDriver::Systemd)
        .capacity(TDX, 64)
        .build()
        .expect("simulated host");
    let api = FakeApiServer::with_options(FakeApiOptions {
        record_requests: false,
        ..FakeApiOptions::default()
    });
    api.create(&NodeBuilder::new(NODE).tdx(64).to_value())
        .expect("node");
    // Pods bound to the node: every tenth a TDX virt-launcher pod (key requested), the rest Kata
    // and ordinary pods. The API server assigns the UIDs; the cgroups follow them.
    let mut tee = 0;
    let mut requesting = 0; // pods that request keys: the agent reads their cgroups every poll
    for i in 0..pods {
        let launcher = i % 10 == 3 && tee < vms;
        let mut pod = if launcher {
            tee += 1;
            requesting += 1;
            VirtLauncherPod::for_tee(&format!("vm-{i}"), Tee::Tdx)
                .request("tdx.intel.com/keys", "1")
                .running_on(NODE)
                .to_value()
        } else {
            let mut p = fixtures::to_value(&fixtures::kata_pod(&format!("app-{i}"), KataTee::Tdx));
            p["spec"]["nodeName"] = json!(NODE);
            p["status"] = json!({"phase": "Running"});
            if i % 2 == 0 {
                // An ordinary pod: no runtime class, no key request.
                p["spec"]["runtimeClassName"] = serde_json::Value::Null;
                p["spec"]["overhead"] = serde_json::Value::Null;
            } else {
                requesting += 1;
            }
            p
        };
        pod["metadata"]["uid"] = serde_json::Value::Null;
        let stored = api.create(&pod).expect("pod");
        let uid = stored["metadata"]["uid"].as_str().expect("uid").to_string();
        let qos = if launcher {
            QosClass::Burstable
        } else {
            match i % 10 {
                0 => QosClass::Guaranteed,
                1 | 2 => QosClass::BestEffort,
                _ => QosClass::Burstable,
            }
        };
        if launcher {
            host.add_pod(&uid, qos, &["compute", "volumerootdisk"])
                .expect("pod cgroup");
            host.start_vm(&uid, "compute", TDX).expect("vm");
        } else {
            host.add_pod(&uid, qos, &["app", "sidecar"])
                .expect("pod cgroup");
        }
    }
    host.add_external("outside", TDX, 2).expect("external");

    let dir = tempfile::tempdir().expect("tempdir");
    let [admin_port] = free_ports().expect("a free port");
    let admin: SocketAddr = ([127, 0, 0, 1], admin_port).into();
    let (ready, samples, hwm, published) = rt.block_on(async {
        let served = api.serve().await.expect("serve");
        let kubeconfig = dir.path().join("kubeconfig");
        served.write_kubeconfig(&kubeconfig).expect("kubeconfig");
        let t0 = Instant::now();
        let mut child = Command::new(&binary)
            .args([
                "run",
                "--node-name",
                NODE,
                "--cgroup-root",
                &host.root().display().to_string(),
                "--admin-addr",
                &admin.to_string(),
            ])
            .env("KUBECONFIG", &kubeconfig)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn teeguard-agent");
        let pid = child.id();
        while !readyz(admin).await {
            if let Ok(Some(s)) = child.try_wait() {
                panic!("teeguard-agent exited: {s}");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "agent not ready in 60 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let ready = t0.elapsed();
        // Settle a few polls, then sample RSS and CPU once a second.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let cpu0 = proc_cpu(pid).expect("cpu");
        let precise0 = tasks_cpu(pid);
        let scans0 = scan_histogram(admin).await.expect("scan metrics");
        let t1 = Instant::now();
        let mut rss = Vec::new();
        while t1.elapsed() < run_for {
            tokio::time::sleep(Duration::from_secs(1)).await;
            rss.push(proc_status_kib(pid, "VmRSS").unwrap_or(0));
        }
        let cpu = proc_cpu(pid).expect("cpu") - cpu0;
        let precise = tasks_cpu(pid)
            .zip(precise0)
            .map(|(b, a)| b.saturating_sub(a));
        let scans1 = scan_histogram(admin).await.expect("scan metrics");
        let scans = (scans1.0 - scans0.0, scans1.1 - scans0.1);
        let wall = t1.elapsed();
        let hwm = proc_status_kib(pid, "VmHWM").unwrap_or(0);
        // Where the resident memory is: heap and stacks (anonymous) versus the binary's pages.
        let split = ["RssAnon", "RssFile", "Threads"].map(|f| proc_status_kib(pid, f).unwrap_or(0));
        let _ = child.kill();
        let _ = child.wait();
        let published = api
            .get("teecapacities", None, NODE)
            .map(|c| c["status"]["tdx"].clone())
            .unwrap_or_default();
        (
            (ready, cpu, wall, scans, precise),
            rss,
            (hwm, split),
            published,
        )
    });
    let (ready, cpu, wall, (scan_secs, scan_count), precise) = ready;
    let (hwm, [anon, file, threads]) = hwm;
    section(&format!(
        "teeguard-agent run: {pods} pod cgroups ({vms} TDX VMs), v2/systemd, 1 s polls, {:.0} s sampled",
        wall.as_secs_f64()
    ));
    let max_rss = samples.iter().copied().max().unwrap_or(0);
    println!("ready after          {}", fmt_dur(ready));
    println!(
        "RSS                  {:.1} MiB (max sampled), peak VmHWM {:.1} MiB",
        max_rss as f64 / 1024.0,
        hwm as f64 / 1024.0
    );
    println!(
        "RSS split at the end {:.1} MiB anonymous (heap, stacks) + {:.1} MiB file-backed (the binary); {threads} threads",
        anon as f64 / 1024.0,
        file as f64 / 1024.0
    );
    println!(
        "CPU                  {:.2} ms per second of run (≈ per poll; /proc ticks are 10 ms, {} ms over {:.0} s)",
        cpu.as_secs_f64() * 1e3 / wall.as_secs_f64(),
        cpu.as_millis(),
        wall.as_secs_f64()
    );
    if let Some(precise) = precise {
        println!(
            "CPU (schedstat)      {:.2} ms per second of run, {:.2} ms per scan (all threads: scan, attribution, publish, watches)",
            precise.as_secs_f64() * 1e3 / wall.as_secs_f64(),
            precise.as_secs_f64() * 1e3 / scan_count.max(1) as f64,
        );
    }
    println!(
        "scans                {scan_count} over the run, mean {} wall each (the agent's own histogram); each reads the root, kubepods and QoS-level files, and the misc.current of every pod that requests keys ({} here) only when the totals moved or every 10th scan",
        fmt_dur(Duration::from_secs_f64(
            scan_secs / scan_count.max(1) as f64
        )),
        requesting
    );
    println!("published TDX status {published}");
    assert_eq!(
        published["kernelUsed"],
        json!(vms + 2),
        "the agent did not publish the host's usage"
    );
    println!("targets: well under 1 ms CPU per scan, RSS under 20 MiB.");
    steal.report();
}
