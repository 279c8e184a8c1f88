//! End to end over TLS: a load generator (hyper HTTP/1.1 client over tokio-rustls, N keep-alive
//! connections each sending requests back to back) against the real webhook (`app::start`, caches
//! warm from the in-process fake API server) and, in the same run, against a floor: a minimal axum +
//! rustls server with the webhook's own TLS configuration (same certificate, ring, TLS 1.3, same
//! hyper-util connection builder) that parses the same body to get the uid and answers "allowed".
//!
//! Printed per endpoint and concurrency: p50/p99 latency and throughput of both, the teeguard/floor
//! ratios, and the webhook's server-side latency from its `/metrics` histogram (body read to response;
//! bucket bounds 50/100/250/500 µs/1 ms..., interpolated). The load generator and both servers share
//! this machine's cores: on a 2-core box the client costs as much CPU as the server, so absolute
//! throughput is a lower bound of what a dedicated core pair would serve.
//!
//! `cargo bench -p teeguard-tests --bench e2e_tls` (quick: `TEEGUARD_BENCH_QUICK=1`).

mod support;
#[path = "../tests/robust_support/mod.rs"]
mod webhook_support;

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use serde::Deserialize;
use serde_json::json;
use support::{Stats, fmt_dur, full_run, section};
use teeguard_tests::fakeapi::FakeApiServer;
use teeguard_tests::fixtures::{NodeBuilder, Tee, VirtLauncherPod, Vmi, seed_vmi};
use tokio::net::TcpListener;
use webhook_support::{H1, Webhook, launcher_review};

const CONCURRENCY: [usize; 4] = [1, 4, 16, 64];

#[derive(Deserialize)]
struct FloorReview<'a> {
    #[serde(borrow)]
    request: FloorRequest<'a>,
}

#[derive(Deserialize)]
struct FloorRequest<'a> {
    #[serde(borrow)]
    uid: Cow<'a, str>,
}

/// The floor's handler: parse the review (the whole body, like any webhook) and allow it.
async fn floor_allow(body: Bytes) -> Response {
    match serde_json::from_slice::<FloorReview<'_>>(&body) {
        Ok(r) => (
            [(header::CONTENT_TYPE, "application/json")],
            json!({
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "response": {"uid": r.request.uid, "allowed": true}
            })
            .to_string(),
        )
            .into_response(),
        Err(e) => (axum::http::StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    }
}

/// Start the floor server with the webhook's TLS configuration, serving `cert_dir`'s pair.
async fn start_floor(cert_dir: &std::path::Path) -> SocketAddr {
    let pair = teeguard_webhook::tls::load_pair(cert_dir).expect("certificate pair");
    let store = Arc::new(teeguard_webhook::tls::CertStore::new(pair.key));
    let tls = teeguard_webhook::tls::server_config(store).expect("TLS config");
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let router = Router::new()
        .route("/mutate", post(floor_allow))
        .route("/validate", post(floor_allow));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind floor");
    let addr = listener.local_addr().expect("floor addr");
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let acceptor = acceptor.clone();
            let service = TowerToHyperService::new(router.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(stream).await else {
                    return;
                };
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    addr
}

/// One load run: (latency stats, reviews per second).
async fn load(
    addr: SocketAddr,
    cfg: Arc<rustls::ClientConfig>,
    path: &'static str,
    body: Bytes,
    connections: usize,
    warmup: Duration,
    measure: Duration,
) -> (Stats, f64) {
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
    let mut all = Vec::new();
    while let Some(r) = tasks.join_next().await {
        all.extend(r.expect("load task"));
    }
    let rate = all.len() as f64 / measure.as_secs_f64();
    (Stats::from_samples(&mut all), rate)
}

/// Cumulative bucket counts (upper bound in seconds → count) of the webhook's latency histogram for
/// `endpoint`, summed over outcomes, plus the sum of observed seconds and the count.
fn histogram(metrics: &str, endpoint: &str) -> (Vec<(f64, u64)>, f64, u64) {
    let mut buckets: Vec<(f64, u64)> = Vec::new();
    let (mut sum, mut count) = (0.0, 0u64);
    let label = format!("endpoint=\"{endpoint}\"");
    for line in metrics.lines() {
        if !line.starts_with("teeguard_webhook_admission_duration_seconds")
            || !line.contains(&label)
        {
            continue;
        }
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let value: f64 = value.parse().unwrap_or(0.0);
        if series.starts_with("teeguard_webhook_admission_duration_seconds_bucket") {
            let le = series
                .split("le=\"")
                .nth(1)
                .and_then(|s| s.split('"').next())
                .map(|s| {
                    if s == "+Inf" {
                        f64::INFINITY
                    } else {
                        s.parse().unwrap_or(0.0)
                    }
                })
                .unwrap_or(0.0);
            match buckets.iter_mut().find(|(b, _)| *b == le) {
                Some(slot) => slot.1 += value as u64,
                None => buckets.push((le, value as u64)),
            }
        } else if series.starts_with("teeguard_webhook_admission_duration_seconds_sum") {
            sum += value;
        } else if series.starts_with("teeguard_webhook_admission_duration_seconds_count") {
            count += value as u64;
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    (buckets, sum, count)
}

/// Quantile `q` of the observations between two scrapes, linearly interpolated within its bucket.
fn server_quantile(
    before: &(Vec<(f64, u64)>, f64, u64),
    after: &(Vec<(f64, u64)>, f64, u64),
    q: f64,
) -> Option<(f64, f64)> {
    let diff: Vec<(f64, u64)> = after
        .0
        .iter()
        .map(|(le, n)| {
            let prev = before
                .0
                .iter()
                .find(|(b, _)| b == le)
                .map_or(0, |(_, m)| *m);
            (*le, n - prev)
        })
        .collect();
    let total = diff.last()?.1;
    if total == 0 {
        return None;
    }
    let rank = (total as f64 * q).ceil() as u64;
    let mut lower = (0.0, 0u64);
    for (le, n) in &diff {
        if *n >= rank {
            if le.is_infinite() {
                return Some((lower.0, lower.0));
            }
            let frac = (rank - lower.1) as f64 / (n - lower.1).max(1) as f64;
            return Some((lower.0 + (le - lower.0) * frac, *le));
        }
        lower = (*le, *n);
    }
    None
}

struct Target {
    name: &'static str,
    path: &'static str,
    body: Bytes,
}

fn main() {
    let full = full_run();
    let (warmup, measure) = if full {
        (Duration::from_millis(500), Duration::from_secs(3))
    } else {
        println!("quick run (full figures: `cargo bench -p teeguard-tests --bench e2e_tls`)");
        (Duration::from_millis(100), Duration::from_millis(300))
    };
    // The servers get their own 2-worker runtime, the load generator another: both compete for the
    // same cores, as they would on one 2-core box.
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("server")
        .enable_all()
        .build()
        .expect("server runtime");
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("client")
        .enable_all()
        .build()
        .expect("client runtime");

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
        api.create(&json!({
            "apiVersion": "teeguard.dev/v1alpha1",
            "kind": "TeeCapacity",
            "metadata": {"name": "node01"},
            "spec": {"nodeName": "node01"},
            "status": {
                "tdx": {"resourceName": "tdx.intel.com/keys", "capacity": 1_000_000, "kernelUsed": 0,
                        "podsUsed": 0, "external": 0, "pending": 0, "free": 1_000_000},
                "heartbeatTime": jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
            }
        }))
        .expect("report");
        api.set_recording(false);
        let webhook = Webhook::start(api, &[]).await;
        webhook.wait_vmis(1).await;
        let floor = start_floor(webhook.certs.path()).await;
        let (_, mutate) = launcher_review(
            &VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx),
            &uid,
            "bench-mutate",
        );
        // What the API server sends /validate for the same pod: mutated and named.
        let mutated = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
            .request("tdx.intel.com/keys", "1")
            .annotation("misc-max.teeguard.dev/compute", "tdx 1")
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
        (webhook, floor, targets)
    });
    let cfg = webhook.client_config();
    let admin = webhook.admin;

    section(&format!(
        "HTTPS keep-alive, HTTP/1.1, loopback; {} s per point after {} ms warm-up; client and servers share {} cores",
        measure.as_secs_f64(),
        warmup.as_millis(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    ));
    println!(
        "{:<9} {:>5} | {:>9} {:>9} {:>8} | {:>9} {:>9} {:>8} | {:>6} {:>6} {:>6} | {:>12}",
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
        "server p99"
    );
    for target in &targets {
        for conns in CONCURRENCY {
            let (f_stats, f_rate) = client_rt.block_on(load(
                floor,
                cfg.clone(),
                target.path,
                target.body.clone(),
                conns,
                warmup,
                measure,
            ));
            let before = client_rt
                .block_on(webhook_support::admin_get(admin, "/metrics"))
                .1;
            let (t_stats, t_rate) = client_rt.block_on(load(
                webhook.https,
                cfg.clone(),
                target.path,
                target.body.clone(),
                conns,
                warmup,
                measure,
            ));
            let after = client_rt
                .block_on(webhook_support::admin_get(admin, "/metrics"))
                .1;
            let (hb, ha) = (
                histogram(&before, target.name),
                histogram(&after, target.name),
            );
            let server = server_quantile(&hb, &ha, 0.99).map_or("n/a".to_string(), |(v, le)| {
                format!(
                    "{} (≤{})",
                    fmt_dur(Duration::from_secs_f64(v)),
                    fmt_dur(Duration::from_secs_f64(le))
                )
            });
            let server_mean = if ha.2 > hb.2 {
                (ha.1 - hb.1) / (ha.2 - hb.2) as f64
            } else {
                0.0
            };
            println!(
                "{:<9} {:>5} | {:>9} {:>9} {:>8.0} | {:>9} {:>9} {:>8.0} | {:>6.2} {:>6.2} {:>6.2} | {} mean {}",
                target.name,
                conns,
                fmt_dur(f_stats.p50),
                fmt_dur(f_stats.p99),
                f_rate,
                fmt_dur(t_stats.p50),
                fmt_dur(t_stats.p99),
                t_rate,
                t_stats.p50.as_secs_f64() / f_stats.p50.as_secs_f64(),
                t_stats.p99.as_secs_f64() / f_stats.p99.as_secs_f64(),
                t_rate / f_rate,
                server,
                fmt_dur(Duration::from_secs_f64(server_mean)),
            );
        }
    }
    println!(
        "x = teeguard / floor (latency: lower is better, 1.00 = as fast as the floor; throughput: higher is better)."
    );
    println!("targets on 2 cores: p99 ratio ≤ 1.5, server-side p99 < 1 ms, ≥ 5 000 reviews/s.");
    server_rt.block_on(webhook.stop());
}
