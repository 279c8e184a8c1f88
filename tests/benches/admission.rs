//! Cost of one admission review in the handler, without HTTP or TLS: `review_mutation` (parse the
//! AdmissionReview, decode the pod (slim), look up namespace and VMI, decide, build the patch) and
//! `review_validation` (the same parse, the cgroup-limit check, the node reports and the holds), plus
//! `ReviewResponse::to_json` (what the server sends), for a realistic virt-launcher pod (~6 KB
//! review) and a large one (~20 KB), per TEE kind. Lookups go through the webhook's real `Caches`
//! (kube reflector stores), warmed from the in-process fake API server with 2 000 VMIs and 20 TEE
//! nodes with reports: exactly what the server calls.
//!
//! `cargo bench -p teeguard-tests --bench admission` (quick: `TEEGUARD_BENCH_QUICK=1`).

/// The allocator of the `teeguard-webhook` binary (webhook/src/main.rs): the handlers and the floor's
/// parse allocate as in the shipped server.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use support::{Stats, fmt_dur, section};
use teeguard_shared::{Config, TeeKind};
use teeguard_tests::fakeapi::{FakeApiServer, Verb};
use teeguard_tests::fixtures::{
    AdmissionReviewBuilder, NodeBuilder, ReportBuilder, Tee, VirtLauncherPod, Vmi, owned_by,
};
use teeguard_webhook::cluster::admission::FitHints;
use teeguard_webhook::cluster::caches::Caches;
use teeguard_webhook::cluster::index::{KeyIndex, wall_clock};
use teeguard_webhook::metrics::{Metrics, Outcome};
use teeguard_webhook::web::admission::ReviewRequest;
use teeguard_webhook::web::admitted::AdmittedReview;
use teeguard_webhook::web::handlers::mutate::review_mutation;
use teeguard_webhook::web::handlers::validate::{ValidationContext, review_validation};
use tokio_util::sync::CancellationToken;

const FILLER_VMIS: usize = 2_000;
const NODES: usize = 20;

/// A fresh report with plenty of free keys of every kind.
fn report(node: &str) -> Value {
    TeeKind::ALL
        .iter()
        .fold(ReportBuilder::new(node), |r, kind| {
            r.kind(*kind, 1_000_000, 1_000_000)
        })
        .to_value()
}

/// (extended resource, misc.max annotation value) the mutating webhook gives a pod of `tee`.
fn key_of(tee: Tee) -> (&'static str, &'static str) {
    match tee {
        Tee::Tdx => ("tdx.intel.com/keys", "tdx 1"),
        Tee::Sev => ("sev.amd.com/asids", "sev 1"),
        _ => ("sev-snp.amd.com/esids", "sev_es 1"),
    }
}

/// Bytes swept before each call of [`measure_cold`]: well past the per-core L1 and L2 caches.
const EVICT_BYTES: usize = 8 << 20;

/// Like [`measure`], but the CPU caches are evicted (a sweep over [`EVICT_BYTES`]) before each timed
/// call, outside the timing. A server reaches its handler this way: between two reviews the core has
/// run TLS, HTTP and other connections, so the handler's code and data are no longer in L1/L2. A hot
/// loop hides that cost; the difference is how much code and memory a review touches.
fn measure_cold<F: FnMut()>(iterations: usize, mut f: F) -> Stats {
    let mut junk = vec![0u8; EVICT_BYTES];
    let mut samples = Vec::with_capacity(iterations);
    for i in 0..iterations {
        for b in junk.iter_mut().step_by(64) {
            *b = b.wrapping_add(i as u8 | 1);
        }
        let t = Instant::now();
        f();
        samples.push(t.elapsed());
    }
    std::hint::black_box(&junk);
    Stats::from_samples(&mut samples)
}

/// One line of the handler table: case, body size, latency figures and the rate of the whole series.
fn print_row(name: &str, body_bytes: usize, stats: &Stats, iterations: usize, wall: Duration) {
    println!(
        "{:<32} {:>6.1} KB {:>10} {:>10} {:>10} {:>12.0}",
        name,
        body_bytes as f64 / 1024.0,
        fmt_dur(stats.mean),
        fmt_dur(stats.p50),
        fmt_dur(stats.p99),
        iterations as f64 / wall.as_secs_f64()
    );
}

fn measure<F: FnMut()>(iterations: usize, mut f: F) -> (Stats, Duration) {
    for _ in 0..iterations / 10 + 10 {
        f();
    }
    let mut samples = Vec::with_capacity(iterations);
    let t0 = Instant::now();
    for _ in 0..iterations {
        let t = Instant::now();
        f();
        samples.push(t.elapsed());
    }
    let wall = t0.elapsed();
    (Stats::from_samples(&mut samples), wall)
}

/// The floor of the end-to-end bench: find the uid, skip the rest; the uid's length.
#[inline(never)]
fn floor_parse(body: &[u8]) -> usize {
    #[derive(serde::Deserialize)]
    struct Floor<'a> {
        #[serde(borrow)]
        request: FloorRequest<'a>,
    }
    #[derive(serde::Deserialize)]
    struct FloorRequest<'a> {
        #[serde(borrow)]
        uid: std::borrow::Cow<'a, str>,
    }
    let floor: Floor<'_> = serde_json::from_slice(body).expect("floor parse");
    floor.request.uid.len()
}

/// Names one case (`mutate tdx default`, `validate sev binding large`, ...): the bench then runs only
/// that review [`PROFILE_ITERATIONS`] times and prints nothing else, for a profiler (`floor <case>`:
/// the end-to-end floor's parse of that case's body instead):
/// `TEEGUARD_BENCH_PROFILE='mutate tdx default' valgrind --tool=callgrind target/release/deps/admission-*`.
const PROFILE_VAR: &str = "TEEGUARD_BENCH_PROFILE";
const PROFILE_ITERATIONS: usize = 20_000;

/// Run the case named `case` in a loop (`run(body, validating)`); unknown names list the known ones.
#[inline(never)]
fn profile(
    case: &str,
    mutations: &[(String, Vec<u8>)],
    validations: &[(String, Vec<u8>)],
    mut run: impl FnMut(&[u8], bool),
) {
    let (floor, case) = match case.strip_prefix("floor ") {
        Some(rest) => (true, rest),
        None => (false, case),
    };
    let found = mutations
        .iter()
        .map(|(n, b)| (n, b, false))
        .chain(validations.iter().map(|(n, b)| (n, b, true)))
        .find(|(n, _, _)| n.as_str() == case);
    let Some((_, body, validating)) = found else {
        let known: Vec<&str> = mutations
            .iter()
            .chain(validations)
            .map(|(n, _)| n.as_str())
            .collect();
        eprintln!("{PROFILE_VAR}={case:?} names no case; known: {known:?}");
        std::process::exit(2);
    };
    for _ in 0..PROFILE_ITERATIONS {
        if floor {
            std::hint::black_box(floor_parse(body));
        } else {
            run(body, validating);
        }
    }
    println!("{case}: {PROFILE_ITERATIONS} reviews");
}

fn main() {
    let steal = support::StealWatch::start();
    let full = support::run_mode("admission");
    let iterations = if full { 20_000 } else { 200 };
    let rt = support::current_thread_runtime();
    let api = FakeApiServer::new();
    api.create(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}}))
        .expect("namespace");
    let kinds = [Tee::Tdx, Tee::Sev, Tee::SevEs];
    let mut uids = Vec::new();
    for tee in kinds {
        let stored = api
            .create(&Vmi::new(&format!("{}-vm", tee.slug())).tee(tee).build())
            .expect("VMI");
        uids.push(stored["metadata"]["uid"].as_str().expect("uid").to_string());
    }
    let filler = (0..FILLER_VMIS).map(|i| {
        Vmi::new(&format!("filler-{i}"))
            .namespace(&format!("ns-{}", i % 20))
            .tee(Tee::ALL[i % 3 + 1])
            .build()
    });
    api.create_many(filler).expect("filler VMIs");
    for i in 0..NODES {
        let name = format!("node{i:02}");
        let node = match i % 3 {
            0 => NodeBuilder::new(&name).tdx(64),
            _ => NodeBuilder::new(&name).sev(16, 500),
        };
        api.create(&node.to_value()).expect("node");
        api.create(&report(&name)).expect("report");
    }

    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::new(&mut registry));
    let token = CancellationToken::new();
    let config = Config::default();
    let index = KeyIndex::new(config.admission.ledger_ttl, wall_clock());
    let hints = FitHints::default();
    // Keep the reflector tasks alive (dropping `CacheTasks` aborts them).
    let (caches, _cache_tasks) = rt.block_on(async {
        let (caches, tasks) = Caches::start(
            api.client(),
            metrics.clone(),
            Duration::from_secs(2),
            index.clone(),
            token.clone(),
        );
        tokio::time::timeout(Duration::from_secs(60), caches.wait_synced())
            .await
            .expect("caches sync");
        (caches, tasks)
    });
    assert_eq!(caches.vmis.len(), FILLER_VMIS + kinds.len());
    let ctx = ValidationContext {
        config: &config,
        events: None,
        metrics: Some(&metrics),
        hints: &hints,
        replica: "bench",
        decider: None,
    };

    // The mutating reviews: one per kind and size, each checked to be a patch from a cache hit (or the
    // figure is meaningless).
    let mut mutations = Vec::new();
    for (large, size) in [(false, "default"), (true, "large")] {
        for (tee, uid) in kinds.iter().zip(&uids) {
            let mut pod = VirtLauncherPod::for_tee(&format!("{}-vm", tee.slug()), *tee);
            if large {
                pod = pod.large();
            }
            let review = AdmissionReviewBuilder::create(owned_by(&pod.to_value(), uid)).build();
            let body = serde_json::to_vec(&review).expect("json");
            api.clear_requests();
            let reviewed = rt
                .block_on(review_mutation(&body, &caches, &config, None))
                .expect("review");
            assert_eq!(reviewed.outcome, Outcome::Patched, "{tee:?}");
            let gets = api.requests_where(|r| r.verb == Verb::Get);
            assert!(gets.is_empty(), "cache miss: {gets:?}");
            mutations.push((format!("mutate {} {size}", tee.slug()), body));
        }
    }

    // The validating review of the same pods as the API server sends them: mutated (key request and
    // annotation) and named; once without a node (some matching node must have keys) and once as the
    // scheduler's binding to a node (check, and hold the key). The pods exist in the API
    // server, so bindings find them in the webhook's pod cache.
    let mut validations = Vec::new();
    for (large, size) in [(false, "default"), (true, "large")] {
        for (tee, uid) in kinds.iter().zip(&uids) {
            let (resource, misc) = key_of(*tee);
            let mut pod = VirtLauncherPod::for_tee(&format!("{}-vm", tee.slug()), *tee)
                .patched(resource, misc)
                .name(&format!("virt-launcher-{}-vm-{size}", tee.slug()));
            if large {
                pod = pod.large();
            }
            let pod_json = owned_by(&pod.to_value(), uid);
            let create = AdmissionReviewBuilder::create(pod_json.clone()).build();
            let stored = api.create(&pod_json).expect("pod");
            let stored: Pod = serde_json::from_value(stored).expect("pod");
            let node = if *tee == Tee::Tdx { "node00" } else { "node01" };
            let binding = AdmissionReviewBuilder::binding(&stored, node).build();
            for (what, review) in [("create", create), ("binding", binding)] {
                let body = serde_json::to_vec(&review).expect("json");
                validations.push((format!("validate {} {what} {size}", tee.slug()), body));
            }
        }
    }
    // Let the reflectors (on this runtime) take the new pods in.
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(500)).await });
    if let Ok(case) = std::env::var(PROFILE_VAR) {
        profile(&case, &mutations, &validations, |body, validating| {
            let r = if validating {
                rt.block_on(review_validation(body, &caches, &ctx))
            } else {
                rt.block_on(review_mutation(body, &caches, &config, None))
            };
            std::hint::black_box(r.expect("review").response.to_json());
        });
        token.cancel();
        return;
    }

    section(&format!(
        "admission handler: review_mutation / review_validation + response JSON, warm caches ({} VMIs, {NODES} nodes), one thread",
        caches.vmis.len()
    ));
    println!(
        "{:<32} {:>9} {:>10} {:>10} {:>10} {:>12}",
        "case", "body", "mean", "p50", "p99", "reviews/s"
    );
    api.set_recording(false);
    for (name, body) in &mutations {
        let (stats, wall) = measure(iterations, || {
            let r = rt
                .block_on(review_mutation(body, &caches, &config, None))
                .expect("review");
            std::hint::black_box(r.response.to_json());
        });
        print_row(name, body.len(), &stats, iterations, wall);
    }
    api.set_recording(true);
    for (name, body) in &validations {
        api.clear_requests();
        let reviewed = rt
            .block_on(review_validation(body, &caches, &ctx))
            .expect("review");
        assert!(
            reviewed.response.allowed,
            "{name}: {}",
            String::from_utf8_lossy(&reviewed.response.to_json())
        );
        let gets = api.requests_where(|r| r.verb == Verb::Get);
        assert!(gets.is_empty(), "{name}: cache miss: {gets:?}");
        api.set_recording(false);
        let (stats, wall) = measure(iterations, || {
            let r = rt
                .block_on(review_validation(body, &caches, &ctx))
                .expect("review");
            std::hint::black_box(r.response.to_json());
        });
        api.set_recording(true);
        print_row(name, body.len(), &stats, iterations, wall);
    }

    section("where the time goes (tdx, default and large pod)");
    for large in [false, true] {
        let mut pod = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx);
        if large {
            pod = pod.large();
        }
        let review = AdmissionReviewBuilder::create(owned_by(&pod.to_value(), &uids[0])).build();
        let body = serde_json::to_vec(&review).expect("json");
        let label = if large { "large" } else { "default" };
        let envelope_fn = || {
            std::hint::black_box(ReviewRequest::parse(&body).expect("parse"));
        };
        // What the handlers read (envelope and slim pod in one pass) and, for comparison, the
        // envelope followed by the full k8s-openapi Pod (what they read before).
        let decode_fn = || {
            let mut review = AdmittedReview::parse(&body).expect("parse");
            std::hint::black_box(review.pod().expect("pod"));
        };
        let whole_fn = || {
            let r = rt
                .block_on(review_mutation(&body, &caches, &config, None))
                .expect("review");
            std::hint::black_box(r.response.to_json());
        };
        let floor_fn = || {
            std::hint::black_box(floor_parse(&body));
        };
        let (envelope, _) = measure(iterations, envelope_fn);
        let (decode, _) = measure(iterations, decode_fn);
        let (full_decode, _) = measure(iterations, || {
            let req = ReviewRequest::parse(&body).expect("parse");
            std::hint::black_box(req.object::<Pod>().expect("pod"));
        });
        let (whole, _) = measure(iterations, whole_fn);
        let (floor, _) = measure(iterations, floor_fn);
        let cold_iterations = iterations.min(5_000);
        let cold = [
            measure_cold(cold_iterations, envelope_fn),
            measure_cold(cold_iterations, decode_fn),
            measure_cold(cold_iterations, whole_fn),
            measure_cold(cold_iterations, floor_fn),
        ];
        for (caches_state, [envelope, decode, whole, floor]) in
            [("hot ", [envelope, decode, whole, floor]), ("cold", cold)]
        {
            println!(
                "{label:<8} {caches_state} envelope alone {:>9}  + slim pod in the same pass {:>9}  + lookups/decide/patch/response {:>9}  = {:>9} (p50); the floor's parse {:>9}",
                fmt_dur(envelope.p50),
                fmt_dur(decode.p50.saturating_sub(envelope.p50)),
                fmt_dur(whole.p50.saturating_sub(decode.p50)),
                fmt_dur(whole.p50),
                fmt_dur(floor.p50),
            );
        }
        println!(
            "{label:<8} (envelope, then the full k8s-openapi Pod in a second pass: + {:>9} instead, hot)",
            fmt_dur(full_decode.p50.saturating_sub(envelope.p50)),
        );
    }
    println!(
        "hot: the same review back to back; cold: L1/L2 evicted before each call ({} MiB swept), as in a server between reviews.",
        EVICT_BYTES >> 20
    );
    token.cancel();
    steal.report();
}
