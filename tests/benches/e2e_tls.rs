//! End to end over TLS: a load generator (hyper HTTP/1.1 client over tokio-rustls, N keep-alive
//! connections each sending requests back to back) against the real webhook (`app::start`, caches
//! warm from the in-process fake API server) and, in the same run, against a floor: a minimal axum +
//! rustls server with the webhook's own TLS configuration (same certificate, ring, TLS 1.3, same
//! hyper-util connection builder) that parses the same body to get the uid and answers "allowed".
//!
//! Each point measures the floor and teeguard in alternating windows (`ROUNDS` of each, pooled), so a
//! drift of this shared machine during the point weighs on both sides alike.
//!
//! Printed per endpoint and concurrency: p50/p99 latency and throughput of both, the teeguard/floor
//! ratios, and the webhook's server-side latency from its `/metrics` histogram (body read to response;
//! bucket bounds 50/100/250/500 µs/1 ms..., interpolated), and the on-CPU time per review of the server
//! threads and of the load generator's threads (`/proc/self/task/*/schedstat`). A last section serves
//! the floor's handler through the webhook's own `serve_https` too, which splits teeguard's extra server
//! CPU per review into what the server stack adds and what the admission handler adds.
//!
//! The load generator and both servers share
//! this machine's cores: on a 2-core box the client costs as much CPU as the server, so absolute
//! throughput is a lower bound of what a dedicated core pair would serve.
//!
//! `cargo bench -p teeguard-tests --bench e2e_tls` (quick: `TEEGUARD_BENCH_QUICK=1`; one point only,
//! e.g. to profile it: `TEEGUARD_BENCH_POINTS=validate:16`).

/// The allocator of the `teeguard-webhook` binary (webhook/src/main.rs): both servers (teeguard and
/// the floor) and the load generator allocate as the shipped server does.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod support;
#[path = "../tests/robust_support/mod.rs"]
mod webhook_support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use serde_json::json;
use support::floor::{Stack, start_floor};
use support::{Stats, admission_histogram, fmt_dur, section, threads_cpu};
use teeguard_shared::TeeKind;
use teeguard_tests::fakeapi::FakeApiServer;
use teeguard_tests::fixtures::{NodeBuilder, ReportBuilder, Tee, VirtLauncherPod, Vmi, seed_vmi};
use webhook_support::{H1, Webhook, launcher_review};

const CONCURRENCY: [usize; 4] = [1, 4, 16, 64];
/// Connections for the server-CPU breakdown (saturated: CPU per review is what limits throughput).
const BREAKDOWN_CONNECTIONS: usize = 16;

/// One load run's figures.
struct Run {
    stats: Stats,
    /// Reviews per second.
    rate: f64,
    /// On-CPU time of the server threads per review (TLS, HTTP and the handler).
    server_cpu: Duration,
    /// On-CPU time of the load generator's threads per review.
    client_cpu: Duration,
}

/// What one measured window collected, before it is pooled with the other rounds of the same point.
struct Window {
    samples: Vec<Duration>,
    measured: Duration,
    server_cpu: Duration,
    client_cpu: Duration,
}

impl Run {
    /// Pool the windows of one server at one point.
    fn pool(windows: Vec<Window>) -> Run {
        let mut samples = Vec::new();
        let (mut measured, mut server, mut client) =
            (Duration::ZERO, Duration::ZERO, Duration::ZERO);
        for w in windows {
            samples.extend(w.samples);
            measured += w.measured;
            server += w.server_cpu;
            client += w.client_cpu;
        }
        let n = samples.len().max(1) as u32;
        Run {
            rate: samples.len() as f64 / measured.as_secs_f64(),
            stats: Stats::from_samples(&mut samples),
            server_cpu: server / n,
            client_cpu: client / n,
        }
    }
}

/// Rounds per point: the floor and teeguard are measured in alternating windows (floor, teeguard,
/// floor, teeguard, ...) and each side's samples pooled, so that a drift of the machine during the
/// point (another tenant of the VM host, frequency changes) weighs on both sides alike. Six windows of
/// 0.5 s rather than three of 1 s: on this 2-core VM a window can settle in a slower state (how the
/// scheduler places the four busy threads), and with three windows one such window moved a point's
/// p99 ratio by up to ±0.3 between runs; with six, five runs in a row stayed within 1.12-1.46.
const ROUNDS: usize = 6;

/// One measured window: `connections` keep-alive connections sending back to back, `warmup` then
/// `measure`.
async fn window(
    addr: SocketAddr,
    cfg: Arc<rustls::ClientConfig>,
    path: &'static str,
    body: Bytes,
    connections: usize,
    warmup: Duration,
    measure: Duration,
) -> Window {
    let mut conns = Vec::with_capacity(connections);
    for _ in 0..connections {
        conns.push(H1::connect(addr, cfg.clone()).await);
    }
    let start = Instant::now() + Duration::from_millis(20);
    let begin = start + warmup;
    let end = begin + measure;
    let mut tasks = tokio::task::JoinSet::new();
    for mut conn in conns {
        let body = body.clone();
        tasks.spawn(async move {
            tokio::time::sleep_until(start.into()).await;
            let mut samples = Vec::with_capacity(4096);
            loop {
                let t = Instant::now();
                if t >= end {
                    break;
                }
                let (status, resp) = conn.post(path, body.clone()).await.expect("request");
                assert!(status.is_success(), "{status}: {resp:?}");
                if t >= begin {
                    samples.push(t.elapsed());
                }
            }
            samples
        });
    }
    // CPU of both sides over the measured window only.
    let cpu = tokio::spawn(async move {
        tokio::time::sleep_until(begin.into()).await;
        let before = (threads_cpu("server"), threads_cpu("client"));
        tokio::time::sleep_until(end.into()).await;
        (
            threads_cpu("server").saturating_sub(before.0),
            threads_cpu("client").saturating_sub(before.1),
        )
    });
    let mut all = Vec::new();
    while let Some(r) = tasks.join_next().await {
        all.extend(r.expect("load task"));
    }
    let (server, client) = cpu.await.expect("CPU sampler");
    Window {
        samples: all,
        measured: measure,
        server_cpu: server,
        client_cpu: client,
    }
}

struct Target {
    name: &'static str,
    path: &'static str,
    body: Bytes,
}

/// `TEEGUARD_BENCH_POINTS=validate:16,mutate:4`: run only these points (endpoint:connections) and
/// skip the breakdown, to repeat or profile one point. Unset: every point.
fn points_filter() -> Option<Vec<(String, usize)>> {
    let spec = std::env::var("TEEGUARD_BENCH_POINTS").ok()?;
    let points = spec
        .split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let (name, conns) = p.trim().split_once(':').unwrap_or_else(|| {
                panic!("TEEGUARD_BENCH_POINTS: {p:?} is not endpoint:connections")
            });
            let conns = conns.parse().unwrap_or_else(|_| {
                panic!("TEEGUARD_BENCH_POINTS: {conns:?} in {p:?} is not a number")
            });
            (name.to_string(), conns)
        })
        .collect();
    Some(points)
}

fn main() {
    let steal = support::StealWatch::start();
    let full = support::run_mode("e2e_tls");
    let (warmup, measure) = if full {
        (Duration::from_millis(250), Duration::from_secs(3))
    } else {
        (Duration::from_millis(100), Duration::from_millis(300))
    };
    // The servers get their own 2-worker runtime, the load generator another: both compete for the
    // same cores, as they would on one 2-core box.
    let server_rt = support::named_runtime(2, "server");
    let client_rt = support::named_runtime(2, "client");

    let (webhook, floor, targets) = server_rt.block_on(async {
        let api = FakeApiServer::new();
        api.create(
            &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}}),
        )
        .expect("namespace");
        let uid = seed_vmi(&api, &Vmi::new("tdx-vm").tee(Tee::Tdx));
        // A TDX node whose fresh report has plenty of free keys, for /validate.
        api.create(&NodeBuilder::new("node01").tdx(1_000_000).to_value())
            .expect("node");
        api.create(
            &ReportBuilder::new("node01")
                .kind(TeeKind::Tdx, 1_000_000, 1_000_000)
                .to_value(),
        )
        .expect("report");
        api.set_recording(false);
        let webhook = Webhook::start(api, &[]).await;
        webhook.wait_vmis(1).await;
        let floor = start_floor(webhook.certs.path(), Stack::Bare).await;
        let floor_on_stack = start_floor(webhook.certs.path(), Stack::Webhook).await;
        let (_, mutate) = launcher_review(
            &VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx),
            &uid,
            "bench-mutate",
        );
        // What the API server sends /validate for the same pod: mutated and named.
        let mutated = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
            .patched("tdx.intel.com/keys", "tdx 1")
            .generated_name();
        let (_, validate) = launcher_review(&mutated, &uid, "bench-validate");
        let targets = vec![
            Target {
                name: "mutate",
                path: "/mutate",
                body: mutate,
            },
            Target {
                name: "validate",
                path: "/validate",
                body: validate,
            },
        ];
        (webhook, (floor, floor_on_stack), targets)
    });
    let (floor, floor_on_stack) = floor;
    let cfg = webhook.client_config();
    let admin = webhook.admin;

    section(&format!(
        "HTTPS keep-alive, HTTP/1.1, loopback; {} s per point and server in {ROUNDS} alternating windows (floor, teeguard, ...), each after {} ms warm-up; client and servers share {} cores",
        measure.as_secs_f64(),
        warmup.as_millis(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));
    println!(
        "{:<9} {:>5} | {:>9} {:>9} {:>8} | {:>9} {:>9} {:>8} | {:>6} {:>6} {:>6} | {:>13} {:>13} | {:>12}",
        "endpoint",
        "conns",
        "floor p50",
        "p99",
        "rev/s",
        "tg p50",
        "p99",
        "rev/s",
        "p50 x",
        "p99 x",
        "tput x",
        "srv CPU µs",
        "client CPU µs",
        "server p99"
    );
    let only = points_filter();
    for target in &targets {
        for conns in CONCURRENCY {
            if only
                .as_ref()
                .is_some_and(|o| !o.contains(&(target.name.to_string(), conns)))
            {
                continue;
            }
            // Only teeguard's windows reach the webhook, so its histogram between the two scrapes
            // holds exactly those reviews.
            let before = client_rt
                .block_on(webhook_support::admin_get(admin, "/metrics"))
                .1;
            let (mut floor_windows, mut tg_windows) = (Vec::new(), Vec::new());
            for _ in 0..ROUNDS {
                for (addr, windows) in [
                    (floor, &mut floor_windows),
                    (webhook.https, &mut tg_windows),
                ] {
                    windows.push(client_rt.block_on(window(
                        addr,
                        cfg.clone(),
                        target.path,
                        target.body.clone(),
                        conns,
                        warmup,
                        measure / ROUNDS as u32,
                    )));
                }
            }
            let (floor_run, tg_run) = (Run::pool(floor_windows), Run::pool(tg_windows));
            let after = client_rt
                .block_on(webhook_support::admin_get(admin, "/metrics"))
                .1;
            let between = admission_histogram(&after, target.name)
                .minus(&admission_histogram(&before, target.name));
            let server = between.quantile(0.99).map_or("n/a".to_string(), |(v, le)| {
                format!("{} (≤{})", fmt_dur(v), fmt_dur(le))
            });
            let server_mean = between.mean().unwrap_or_default();
            let (f_stats, t_stats) = (floor_run.stats, tg_run.stats);
            println!(
                "{:<9} {:>5} | {:>9} {:>9} {:>8.0} | {:>9} {:>9} {:>8.0} | {:>6.2} {:>6.2} {:>6.2} | {:>5.1} / {:>5.1} {:>5.1} / {:>5.1} | {} mean {}",
                target.name,
                conns,
                fmt_dur(f_stats.p50),
                fmt_dur(f_stats.p99),
                floor_run.rate,
                fmt_dur(t_stats.p50),
                fmt_dur(t_stats.p99),
                tg_run.rate,
                t_stats.p50.as_secs_f64() / f_stats.p50.as_secs_f64(),
                t_stats.p99.as_secs_f64() / f_stats.p99.as_secs_f64(),
                tg_run.rate / floor_run.rate,
                floor_run.server_cpu.as_secs_f64() * 1e6,
                tg_run.server_cpu.as_secs_f64() * 1e6,
                floor_run.client_cpu.as_secs_f64() * 1e6,
                tg_run.client_cpu.as_secs_f64() * 1e6,
                server,
                fmt_dur(server_mean),
            );
        }
    }
    println!(
        "x = teeguard / floor (latency: lower is better, 1.00 = as fast as the floor; throughput: higher is better)."
    );
    println!(
        "CPU µs/review: on-CPU time of the server threads (TLS, HTTP, handler) and of the load generator's \
         threads per review, floor / teeguard."
    );
    println!("targets on 2 cores: p99 ratio ≤ 1.5, server-side p99 < 1 ms, ≥ 5 000 reviews/s.");

    if only.is_some() {
        server_rt.block_on(webhook.stop());
        steal.report();
        return;
    }
    // Where teeguard's extra server CPU goes: the same floor handler on the bare stack and on the
    // webhook's `serve_https`, then teeguard itself; the steps are the stack's and the handler's cost.
    section(&format!(
        "server CPU per review at {BREAKDOWN_CONNECTIONS} connections: floor handler on a bare stack, on the webhook's serve_https, teeguard"
    ));
    println!(
        "{:<9} | {:>10} {:>10} {:>10} | {:>12} {:>12}",
        "endpoint", "bare floor", "on stack", "teeguard", "stack adds", "handler adds"
    );
    for target in &targets {
        let cpu = |addr| {
            let w = client_rt.block_on(window(
                addr,
                cfg.clone(),
                target.path,
                target.body.clone(),
                BREAKDOWN_CONNECTIONS,
                warmup,
                measure,
            ));
            Run::pool(vec![w]).server_cpu.as_secs_f64() * 1e6
        };
        let (bare, stacked, teeguard) = (cpu(floor), cpu(floor_on_stack), cpu(webhook.https));
        println!(
            "{:<9} | {:>7.1} µs {:>7.1} µs {:>7.1} µs | {:>+9.1} µs {:>+9.1} µs",
            target.name,
            bare,
            stacked,
            teeguard,
            stacked - bare,
            teeguard - stacked
        );
    }
    server_rt.block_on(webhook.stop());
    steal.report();
}
