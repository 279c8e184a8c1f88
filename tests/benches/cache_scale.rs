//! Cache scale: the real `teeguard-webhook serve` process (release build) against the fake API server
//! served on 127.0.0.1 (kubeconfig), once with nearly empty caches and once with 50 000 VMIs,
//! 100 000 pods (50 000 virt-launcher pods) and 5 000 nodes with their TeeCapacity reports.
//! Printed: time from spawn to `/readyz` 200, the webhook's RSS (VmRSS when ready and after the
//! reviews, VmHWM peak) read from /proc, and client-side review latency over one keep-alive HTTPS
//! connection, at empty vs full caches. The fake API server lives in this bench process (several
//! GB for the full set), which is why the webhook runs as a separate process. Both webhooks (empty and
//! full caches, each with its own fake API server) run side by side and take turns in alternating
//! rounds of reviews, so that the comparison is not one process measured at a calmer moment than the
//! other (single runs of one process after the other differed by ±30 % in either direction).
//!
//! `cargo bench -p teeguard-tests --bench cache_scale` (quick: `TEEGUARD_BENCH_QUICK=1`). The
//! webhook binary is built first with this bench's own feature set (see `support::release_binary`; a
//! no-op when up to date) and taken from the same `target/release` as this bench.

mod support;
#[path = "../tests/robust_support/mod.rs"]
mod webhook_support;

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde_json::{Value, json};
use support::{Stats, admission_histogram, fmt_dur, proc_status_kib, release_binary, section};
use teeguard_shared::TeeKind;
use teeguard_tests::fakeapi::{FakeApiOptions, FakeApiServer};
use teeguard_tests::fixtures::{
    self, NodeBuilder, ReportBuilder, Tee, VirtLauncherPod, Vmi, owned_by,
};
use teeguard_tests::ports::free_ports;
use webhook_support::{
    Expected, H1, SecretDir, admin_get, ca_and_leaf, check_mutate, client_config,
};

struct Scale {
    vmis: usize,
    other_pods: usize,
    nodes: usize,
    namespaces: usize,
}

fn report(node: &str, free: u64) -> Value {
    ReportBuilder::new(node)
        .kind(TeeKind::Tdx, 64, free)
        .to_value()
}

/// The objects the measured reviews need: namespace, the TDX VMI, one TDX node with a report.
fn seed_base(api: &FakeApiServer) -> String {
    api.create(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}}))
        .expect("namespace");
    let vmi = api
        .create(&Vmi::new("tdx-vm").tee(Tee::Tdx).build())
        .expect("VMI");
    api.create(&NodeBuilder::new("node-base").tdx(64).to_value())
        .expect("node");
    api.create(&report("node-base", 64)).expect("report");
    vmi["metadata"]["uid"].as_str().expect("uid").to_string()
}

/// The bulk: VMIs with their running virt-launcher pods, other pods, nodes and reports.
fn seed_bulk(api: &FakeApiServer, s: &Scale) {
    let t = Instant::now();
    api.create_many((0..s.namespaces).map(|i| {
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": format!("ns-{i}")}})
    }))
    .expect("namespaces");
    let kinds = [Tee::Tdx, Tee::Sev, Tee::SevEs, Tee::Snp, Tee::None];
    const BATCH: usize = 5_000;
    for start in (0..s.vmis).step_by(BATCH) {
        let end = (start + BATCH).min(s.vmis);
        let vmis: Vec<Value> = (start..end)
            .map(|i| {
                Vmi::new(&format!("vm-{i}"))
                    .namespace(&format!("ns-{}", i % s.namespaces))
                    .node(&format!("node-{}", i % s.nodes))
                    .tee(kinds[i % kinds.len()])
                    .build()
            })
            .collect();
        api.create_many(vmis).expect("VMIs");
        let pods: Vec<Value> = (start..end)
            .map(|i| {
                VirtLauncherPod::for_tee(&format!("vm-{i}"), kinds[i % kinds.len()])
                    .namespace(&format!("ns-{}", i % s.namespaces))
                    .running_on(&format!("node-{}", i % s.nodes))
                    .to_value()
            })
            .collect();
        api.create_many(pods).expect("launcher pods");
    }
    for start in (0..s.other_pods).step_by(BATCH) {
        let end = (start + BATCH).min(s.other_pods);
        let pods: Vec<Value> = (start..end)
            .map(|i| {
                let mut p = fixtures::to_value(&fixtures::kata_pod(
                    &format!("app-{i}"),
                    if i % 2 == 0 {
                        fixtures::KataTee::Tdx
                    } else {
                        fixtures::KataTee::Snp
                    },
                ));
                p["metadata"]["namespace"] = json!(format!("ns-{}", i % s.namespaces));
                p
            })
            .collect();
        api.create_many(pods).expect("other pods");
    }
    api.create_many((0..s.nodes).map(|i| {
        let name = format!("node-{i}");
        match i % 3 {
            0 => NodeBuilder::new(&name).tdx(64).to_value(),
            _ => NodeBuilder::new(&name).sev(16, 500).to_value(),
        }
    }))
    .expect("nodes");
    api.create_many((0..s.nodes).map(|i| report(&format!("node-{i}"), (i % 5) as u64)))
        .expect("reports");
    println!(
        "seeded {} VMIs, {} pods, {} nodes (+ reports), {} namespaces in {:.1} s",
        api.count("virtualmachineinstances"),
        api.count("pods"),
        api.count("nodes"),
        api.count("namespaces"),
        t.elapsed().as_secs_f64()
    );
}

/// One webhook process and what was measured on it.
struct Webhook {
    child: Child,
    pid: u32,
    https: SocketAddr,
    admin: SocketAddr,
    ready: Duration,
    rss_ready_kib: u64,
}

/// Both endpoints' (sum of seconds, count) of the webhook's `admission_duration_seconds`, from its
/// `/metrics`.
async fn server_totals(admin: SocketAddr) -> [(f64, u64); 2] {
    let (_, metrics) = admin_get(admin, "/metrics").await;
    ["mutate", "validate"].map(|endpoint| {
        let h = admission_histogram(&metrics, endpoint);
        (h.sum, h.count as u64)
    })
}

async fn wait_ready(admin: SocketAddr, child: &mut Child) -> Duration {
    let t = Instant::now();
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("teeguard-webhook exited early: {status}");
        }
        if let Ok(Ok(stream)) = tokio::time::timeout(
            Duration::from_millis(200),
            tokio::net::TcpStream::connect(admin),
        )
        .await
        {
            drop(stream);
            let (status, _) = admin_get(admin, "/readyz").await;
            if status.is_success() {
                return t.elapsed();
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(600),
            "not ready after 10 min"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Spawn `teeguard-webhook serve` against `kubeconfig` and wait until it is ready.
async fn start_webhook(binary: &Path, kubeconfig: &Path, certs: &SecretDir) -> Webhook {
    let [https, admin] = free_ports().expect("free ports");
    let spawned = Instant::now();
    let mut child = Command::new(binary)
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{https}"),
            "--admin-listen",
            &format!("127.0.0.1:{admin}"),
            "--cert-dir",
            &certs.path().display().to_string(),
        ])
        .env("KUBECONFIG", kubeconfig)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn teeguard-webhook");
    let pid = child.id();
    let admin: SocketAddr = ([127, 0, 0, 1], admin).into();
    let _ = wait_ready(admin, &mut child).await;
    Webhook {
        ready: spawned.elapsed(),
        rss_ready_kib: proc_status_kib(pid, "VmRSS").unwrap_or(0),
        child,
        pid,
        https: ([127, 0, 0, 1], https).into(),
        admin,
    }
}

/// Send `n` copies of `review` on `conn`, checking each answer; the client-side latencies.
async fn send(conn: &mut H1, review: &(Value, Bytes, &'static str), n: usize) -> Vec<Duration> {
    let (review, body, path) = review;
    let mut took = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let (status, resp) = conn.post(path, body.clone()).await.expect("review");
        took.push(t.elapsed());
        if *path == "/mutate" {
            check_mutate(review, status, &resp, &Expected::for_tee(Tee::Tdx)).expect("answer");
        } else {
            let v: Value = serde_json::from_slice(&resp).expect("json");
            assert_eq!(v["response"]["allowed"], true, "{v}");
        }
    }
    took
}

/// Rounds in which the two webhooks take turns (empty caches, full caches, ...; the order flips every
/// round), so that a drift of this shared machine weighs on both alike.
const ROUNDS: usize = 10;

fn main() {
    let steal = support::StealWatch::start();
    let full = support::run_mode("cache_scale");
    let scale = if full {
        Scale {
            vmis: 50_000,
            other_pods: 50_000,
            nodes: 5_000,
            namespaces: 500,
        }
    } else {
        Scale {
            vmis: 500,
            other_pods: 500,
            nodes: 50,
            namespaces: 10,
        }
    };
    let iterations = if full { 2_000 } else { 100 };
    let binary = release_binary("teeguard-webhook", "teeguard-webhook");
    let rt = support::runtime(2);
    teeguard_webhook::web::tls::install_crypto_provider();
    let (ca, leaf) = ca_and_leaf();
    let certs = SecretDir::temporary(leaf.cert_pem(), leaf.key_pem()).expect("secret dir");
    let dir = tempfile::tempdir().expect("tempdir");

    section(&format!(
        "webhook processes ({}) against fake API servers over TCP; {} reviews per endpoint and process \
         in {ROUNDS} alternating rounds, one keep-alive connection each",
        binary.display(),
        iterations
    ));
    // Both webhooks run side by side, one per fake API server: started one after the other (so
    // each start is timed alone), then measured in alternating rounds.
    let mut sides = Vec::new();
    for bulk in [false, true] {
        // A big watch history would only cost memory here.
        let api = FakeApiServer::with_options(FakeApiOptions {
            history_limit: 1_000,
            record_requests: false,
            ..FakeApiOptions::default()
        });
        let uid = seed_base(&api);
        if bulk {
            seed_bulk(&api, &scale);
        }
        let mutate_pod = owned_by(
            &VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx).to_value(),
            &uid,
        );
        let validate_pod = owned_by(
            &VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
                .patched("tdx.intel.com/keys", "tdx 1")
                .generated_name()
                .to_value(),
            &uid,
        );
        let reviews: Vec<(Value, Bytes, &'static str)> =
            [(mutate_pod, "/mutate"), (validate_pod, "/validate")]
                .into_iter()
                .map(|(pod, path)| {
                    let review = fixtures::AdmissionReviewBuilder::create(pod)
                        .uid("scale")
                        .build();
                    let body = Bytes::from(serde_json::to_vec(&review).expect("json"));
                    (review, body, path)
                })
                .collect();
        let (served, webhook) = rt.block_on(async {
            let served = api.serve().await.expect("serve fake API");
            let kubeconfig = dir.path().join(format!("kubeconfig-{bulk}"));
            served.write_kubeconfig(&kubeconfig).expect("kubeconfig");
            let webhook = start_webhook(&binary, &kubeconfig, &certs).await;
            (served, webhook)
        });
        let label = if bulk {
            format!(
                "{} VMIs, {} pods, {} nodes",
                scale.vmis + 1,
                scale.vmis + scale.other_pods,
                scale.nodes + 1
            )
        } else {
            "1 VMI, 0 pods, 1 node".to_string()
        };
        sides.push((label, api, served, webhook, reviews));
    }

    let per_round = (iterations / ROUNDS).max(1);
    let measured = rt.block_on(async {
        let mut conns = Vec::new();
        for (_, _, _, webhook, reviews) in &sides {
            let mut conn = H1::connect(webhook.https, client_config(ca.cert_der())).await;
            // Warm-up, not measured: TLS session, first use of each code path and series.
            for review in reviews {
                send(&mut conn, review, per_round).await;
            }
            conns.push(conn);
        }
        let mut before = Vec::new();
        for (_, _, _, webhook, _) in &sides {
            before.push(server_totals(webhook.admin).await);
        }
        // samples[side][endpoint]
        let mut samples = vec![vec![Vec::new(), Vec::new()]; sides.len()];
        for round in 0..ROUNDS {
            let order: Vec<usize> = if round % 2 == 0 {
                (0..sides.len()).collect()
            } else {
                (0..sides.len()).rev().collect()
            };
            for i in order {
                for (e, review) in sides[i].4.iter().enumerate() {
                    let took = send(&mut conns[i], review, per_round).await;
                    samples[i][e].extend(took);
                }
            }
        }
        let mut server = Vec::new();
        for (i, (_, _, _, webhook, _)) in sides.iter().enumerate() {
            let after = server_totals(webhook.admin).await;
            server.push([0, 1].map(|e| {
                let (sum, count) = (
                    after[e].0 - before[i][e].0,
                    after[e].1.saturating_sub(before[i][e].1),
                );
                (count > 0).then(|| Duration::from_secs_f64(sum / count as f64))
            }));
        }
        (samples, server)
    });
    let (mut samples, server) = measured;

    println!(
        "{:<34} {:>9} {:>10} {:>10} {:>10} | {:>10} {:>10} {:>10} | {:>10} {:>10} {:>10}",
        "caches",
        "ready",
        "RSS ready",
        "RSS after",
        "RSS peak",
        "mutate p50",
        "p99",
        "server",
        "valid. p50",
        "p99",
        "server"
    );
    let mean = |d: Option<Duration>| d.map_or("n/a".to_string(), fmt_dur);
    for (i, (label, _, _, webhook, _)) in sides.iter_mut().enumerate() {
        let rss_after_kib = proc_status_kib(webhook.pid, "VmRSS").unwrap_or(0);
        let hwm_kib = proc_status_kib(webhook.pid, "VmHWM").unwrap_or(0);
        let _ = webhook.child.kill();
        let _ = webhook.child.wait();
        let mutate = Stats::from_samples(&mut samples[i][0]);
        let validate = Stats::from_samples(&mut samples[i][1]);
        println!(
            "{:<34} {:>9} {:>7} MiB {:>7} MiB {:>7} MiB | {:>10} {:>10} {:>10} | {:>10} {:>10} {:>10}",
            label,
            fmt_dur(webhook.ready),
            webhook.rss_ready_kib / 1024,
            rss_after_kib / 1024,
            hwm_kib / 1024,
            fmt_dur(mutate.p50),
            fmt_dur(mutate.p99),
            mean(server[i][0]),
            fmt_dur(validate.p50),
            fmt_dur(validate.p99),
            mean(server[i][1]),
        );
    }
    drop(sides);
    println!(
        "p50/p99: seen by the client (the bench process, which also serves the fake API servers and \
         their watches); server: the webhook's mean from its own histogram (body read to response), \
         over the measured reviews."
    );
    println!(
        "target: RSS under 300 MiB with full caches; no review latency growth from empty to full."
    );
    steal.report();
}
