//! Admission latency as kube-apiserver sees it: the `teeguard-webhook` process and a no-op webhook
//! (the floor of the `e2e_tls` bench: parse the review, allow), both registered by URL with the
//! webhook configurations the chart renders, each for its own namespace, and pod CREATEs sent at a
//! steady rate to both namespaces in turn. The figures are the API server's own
//! `apiserver_admission_webhook_admission_duration_seconds` per webhook (its `/metrics`): mean
//! (sum / count, exact) and p50/p99 interpolated in its buckets (5 ms, 25 ms, 100 ms, ...: coarse, so
//! the mean is the figure to compare), and the teeguard/no-op ratios. Target: ratio <= 1.2. A third
//! side, a no-op that returns teeguard's own patch for the pod, separates the API server's work of
//! applying a patch (counted in a mutating webhook's duration) from teeguard's.
//!
//! The pods are TDX virt-launcher pods whose node (with a report of free keys) is cordoned, so the
//! webhooks admit them at CREATE and the scheduler never binds them (no binding reviews mixed in).
//!
//! Needs a control plane (`TEEGUARD_CONTROL_PLANE`, see `teeguard_tests::controlplane`) and helm
//! (`TEEGUARD_HELM`); without them it says so and exits. `cargo bench -p teeguard-tests --bench
//! cluster_latency` (quick: `TEEGUARD_BENCH_QUICK=1`).

#[path = "../tests/chart_support/mod.rs"]
mod chart_support;
mod support;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::PostParams;
use serde_json::json;
use support::floor::{Stack, start_floor, start_patching_floor};
use support::section;
use teeguard_shared::TeeKind;
use teeguard_tests::controlplane::ControlPlane;
use teeguard_tests::fixtures::{AdmissionReviewBuilder, NodeBuilder, ReportBuilder, Tee};
use teeguard_tests::patch::MergePatch;
use teeguard_tests::prom::{Histogram, Scrape};
use teeguard_tests::realcluster::{Cluster, TEST_LABEL};

const METRIC: &str = "apiserver_admission_webhook_admission_duration_seconds";
const TARGET_RATIO: f64 = 1.2;

/// The admission-duration histograms of the webhooks whose name starts with `prefix`, by webhook
/// name, each summed over its label sets.
fn histograms(metrics: &str, prefix: &str) -> BTreeMap<String, Histogram> {
    let mut all = Scrape::parse(metrics).histograms_by(METRIC, "name", &[]);
    all.retain(|name, _| name.starts_with(prefix));
    all
}

/// The mean of `h`; zero when nothing was observed.
fn mean(h: &Histogram) -> Duration {
    h.mean().unwrap_or_default()
}

/// Quantile `q` of `h` (interpolated in its bucket); zero when nothing was observed.
fn quantile(h: &Histogram, q: f64) -> Duration {
    h.quantile(q)
        .map_or(Duration::ZERO, |(estimate, _)| estimate)
}

fn main() {
    let Some(cp) = ControlPlane::shared() else {
        println!("cluster_latency: skipped (no control plane; see above)");
        return;
    };
    if std::env::var_os("TEEGUARD_HELM").is_none() {
        println!(
            "cluster_latency: skipped: TEEGUARD_HELM is not set (source scripts/chart-tools.sh)"
        );
        return;
    }
    let rt = support::runtime(2);
    rt.block_on(run(cp));
}

async fn run(cp: &'static ControlPlane) {
    let (pods_per_side, rate) = if support::run_mode("cluster_latency") {
        (300, 20.0)
    } else {
        (20, 20.0)
    };
    let cluster = Cluster::connect().await.expect("control plane");
    // TEEGUARD_LATENCY_CALLS=follower: two replicas, the API server calling the one that does not
    // decide (every review that takes a key forwarded to the decider); else one, which decides.
    let env = cluster.process_env("").expect("process env");
    let mut webhook = env.start_webhook(&[]).await.expect("webhook starts");
    let _second = if std::env::var("TEEGUARD_LATENCY_CALLS").is_ok_and(|c| c == "follower") {
        webhook
            .proc
            .wait_for_log("the first replica decides", Duration::from_secs(60), |l| {
                l.contains("this replica decides").then_some(())
            })
            .await
            .expect("decider elected");
        let follower = env.start_webhook(&[]).await.expect("second replica starts");
        println!("the API server calls the follower: every review that takes a key is forwarded");
        Some(std::mem::replace(&mut webhook, follower))
    } else {
        None
    };
    let noop = start_floor(env.certs.path(), Stack::Bare).await;
    let rendered = chart_support::render("default", &[]);
    let bundle = env.ca.ca_bundle_base64();
    let (tg, floor, patching) = ("lat-teeguard", "lat-noop", "lat-patch");
    cluster
        .register_webhooks(tg, &rendered, webhook.https, &bundle)
        .await
        .expect("teeguard registered");
    cluster
        .register_webhooks(floor, &rendered, noop, &bundle)
        .await
        .expect("no-op registered");

    // One TDX node with plenty of free keys, cordoned: admitted at CREATE, never bound.
    let node = format!("{tg}-node");
    cluster
        .node(&NodeBuilder::new(&node).tdx(4096).label(TEST_LABEL, tg))
        .await
        .expect("node");
    Api::<Node>::all(cluster.client.clone())
        .merge_patch(&node, json!({"spec": {"unschedulable": true}}))
        .await
        .expect("cordon");
    cluster
        .report(&ReportBuilder::new(&node).kind(TeeKind::Tdx, 4096, 4096))
        .await
        .expect("report");
    let ns_tg = cluster.namespace(tg, tg, &[]).await.expect("namespace");
    let ns_floor = cluster
        .namespace(floor, floor, &[])
        .await
        .expect("namespace");
    let ns_patch = cluster
        .namespace(patching, patching, &[])
        .await
        .expect("namespace");
    cluster
        .wait_webhooks_called(&ns_tg)
        .await
        .expect("teeguard called");

    // One VMI per side: every pod is a launcher pod of it (the webhook looks the VMI up in its cache).
    let selector = [(TEST_LABEL, tg)];
    let mut templates = Vec::new();
    for ns in [&ns_tg, &ns_floor, &ns_patch] {
        let uid = cluster.create_vmi(ns, "vm", Tee::Tdx).await.expect("VMI");
        let pod = Cluster::launcher_pod(ns, "vm", &uid, Tee::Tdx, &selector).expect("pod");
        templates.push((ns.clone(), pod));
    }
    // The third side returns teeguard's own patch for this pod from a floor: the API server's cost of
    // applying a patch, without teeguard's decision.
    let review =
        AdmissionReviewBuilder::create(serde_json::to_value(&templates[0].1).expect("pod")).build();
    let reply = webhook
        .client()
        .expect("client")
        .review("/mutate", &review)
        .await
        .expect("teeguard's patch");
    let patch = reply.raw["response"]["patch"]
        .as_str()
        .expect("a base64 patch")
        .to_string();
    let patcher = start_patching_floor(env.certs.path(), patch).await;
    cluster
        .register_webhooks(patching, &rendered, patcher, &bundle)
        .await
        .expect("patching no-op registered");
    cluster
        .wait_webhooks_called(&ns_patch)
        .await
        .expect("patching no-op called");
    let metrics = || async {
        let req = http::Request::get("/metrics")
            .body(Vec::new())
            .expect("request");
        cluster
            .client
            .request_text(req)
            .await
            .expect("API server metrics")
    };
    // What one TeeReservation write costs on its own, from this process's client (a probe object of
    // a node that does not exist, so no replica reads it): the floor of teeguard's hold write.
    {
        use teeguard_shared::reservation::{TeeReservation, TeeReservationSpec};
        let api = Api::<TeeReservation>::all(cluster.client.clone());
        let mut obj = api
            .create(
                &PostParams::default(),
                &TeeReservation::new(
                    "lat-probe",
                    TeeReservationSpec {
                        node_name: "lat-probe".into(),
                        reservations: Vec::new(),
                    },
                ),
            )
            .await
            .expect("probe TeeReservation");
        let mut took = Vec::new();
        for _ in 0..50 {
            let t = Instant::now();
            obj = api
                .replace("lat-probe", &PostParams::default(), &obj)
                .await
                .expect("probe replace");
            took.push(t.elapsed());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        took.sort();
        println!(
            "one TeeReservation PUT from the bench's client, 50 in a row: p50 {:.2?}, max {:.2?}",
            took[25], took[49]
        );
    }
    // Warm-up (connections to both webhooks, caches), then the measured run.
    send(&cluster, &templates, 10, rate).await;
    let before = metrics().await;
    let webhook_before = webhook.metrics().await;
    let started = Instant::now();
    send(&cluster, &templates, pods_per_side, rate).await;
    let took = started.elapsed();
    let after = metrics().await;
    let webhook_after = webhook.metrics().await;

    section(&format!(
        "Admission latency seen by kube-apiserver ({} {}): {pods_per_side} pod CREATEs per side at \
         {rate}/s per side, alternating, in {:.1} s",
        cp.url,
        "v1.36",
        took.as_secs_f64()
    ));
    println!(
        "{:<34} {:>7} {:>10} {:>10} {:>10}",
        "webhook", "calls", "mean", "p50", "p99"
    );
    let mut by_role = BTreeMap::new();
    for (prefix, side) in [(tg, "teeguard"), (floor, "no-op"), (patching, "patch")] {
        let (b, a) = (histograms(&before, prefix), histograms(&after, prefix));
        for (name, h) in &a {
            let h = h.minus(&b.get(name).cloned().unwrap_or_default());
            let hook = name.trim_start_matches(&format!("{prefix}.")).to_string();
            println!(
                "{:<34} {:>7} {:>10} {:>10} {:>10}",
                format!("{side}: {hook}"),
                h.count,
                format!("{:.2?}", mean(&h)),
                format!("{:.2?}", quantile(&h, 0.50)),
                format!("{:.2?}", quantile(&h, 0.99)),
            );
            by_role.insert((hook, side), h);
        }
    }
    // The part of teeguard's /validate that is its hold's write (one per TEE launcher CREATE), as the
    // webhook itself measures it.
    let write = |m: &str| {
        Scrape::parse(m)
            .histogram("teeguard_webhook_hold_write_duration_seconds", &[])
            .unwrap_or_default()
    };
    let writes = write(&webhook_after).minus(&write(&webhook_before));
    println!(
        "teeguard's hold writes (its own histogram): {} writes, mean {:.2?}, p50 {:.2?}, p99 {:.2?}",
        writes.count,
        mean(&writes),
        quantile(&writes, 0.50),
        quantile(&writes, 0.99)
    );
    for hook in ["mutate.pods.teeguard.dev", "validate.pods.teeguard.dev"] {
        let (Some(t), Some(f)) = (
            by_role.get(&(hook.to_string(), "teeguard")),
            by_role.get(&(hook.to_string(), "no-op")),
        ) else {
            println!("{hook}: no calls recorded on one side");
            continue;
        };
        let ratio = mean(t).as_secs_f64() / mean(f).as_secs_f64().max(1e-9);
        if let Some(p) = by_role.get(&(hook.to_string(), "patch")) {
            let ratio = mean(t).as_secs_f64() / mean(p).as_secs_f64().max(1e-9);
            println!(
                "{hook}: teeguard / a no-op returning teeguard's patch: mean {ratio:.2} (the API \
                 server's own patch work on both sides)"
            );
        }
        let p99 = quantile(t, 0.99).as_secs_f64() / quantile(f, 0.99).as_secs_f64().max(1e-9);
        println!(
            "{hook}: teeguard/no-op mean {ratio:.2}, p99 {p99:.2} (target <= {TARGET_RATIO}: {})",
            if ratio <= TARGET_RATIO {
                "met"
            } else {
                "NOT met"
            }
        );
    }
}

/// Create `n` pods per side from `templates`, alternating sides, at `rate` per second per side. Each
/// pod is deleted once created (on every side alike), as a launcher pod is once its VM ends: teeguard's
/// hold of a deleted pod ends, so its node's `TeeReservation` holds the few keys of the pods in flight,
/// not the whole run's (300 pods never bound would hold 300 keys for the TTL, and each write would
/// rewrite them all).
async fn send(cluster: &Cluster, templates: &[(String, Pod)], n: usize, rate: f64) {
    let interval = Duration::from_secs_f64(1.0 / (rate * templates.len() as f64));
    let mut tick = tokio::time::interval(interval);
    let mut deletions = tokio::task::JoinSet::new();
    for _ in 0..n {
        for (ns, pod) in templates {
            tick.tick().await;
            let api = Api::<Pod>::namespaced(cluster.client.clone(), ns);
            let created = api
                .create(&PostParams::default(), pod)
                .await
                .unwrap_or_else(|e| panic!("pod CREATE in {ns}: {e}"));
            let name = created.metadata.name.expect("a created pod has a name");
            deletions.spawn(async move {
                api.delete(&name, &kube::api::DeleteParams::default().grace_period(0))
                    .await
                    .map(|_| ())
            });
        }
    }
    while let Some(done) = deletions.join_next().await {
        done.expect("deletion task").expect("pod DELETE");
    }
}
