//! Pods of a TEE RuntimeClass (`config.admission.teeRuntimeClasses`) against a real kube-apiserver (see
//! `teeguard_tests::controlplane`): the webhook process reads the configuration the chart's ConfigMap
//! renders for a listed `kata-qemu-tdx`, and is registered by URL with the webhook configurations the
//! chart renders for it (the RuntimeClass entries' objectSelector and CEL matchConditions evaluated by
//! the API server itself). What is checked is what the API server stores and answers: a Kata pod gets
//! its key as a request of its first container, the validating webhook then refuses it on a node whose
//! report shows no free key, a RuntimeClass that still puts the key in `overhead.podFixed` gets a
//! warning, and pods of other RuntimeClasses or labelled exempt never reach the webhook.
//! Skipped (one line) without control plane binaries, unless `CI=true`.

mod chart_support;

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::node::v1::RuntimeClass;
use kube::Api;
use kube::api::PostParams;
use serde_json::{Value, json};
use teeguard_shared::TeeKind;
use teeguard_tests::e2e::{ProcessEnv, WebhookProcess};
use teeguard_tests::fixtures::{NodeBuilder, ReportBuilder, TDX_KEYS};
use teeguard_tests::prom::Scrape;
use teeguard_tests::realcluster::{Cluster, Created, TEST_LABEL, create_or_keep, within};

const DEADLINE: Duration = Duration::from_secs(120);

/// Listed, no overhead: what a RuntimeClass looks like once DRA mode is set up.
const CLASS: &str = "kata-qemu-tdx";
/// Listed, with the key in `overhead.podFixed`: kata-deploy's RuntimeClass, not updated.
const OVERHEAD_CLASS: &str = "kata-qemu-tdx-overhead";
/// Not listed.
const OTHER_CLASS: &str = "kata-qemu";

/// One test's world: the cluster, the webhook process and the namespace its webhooks apply to.
struct World {
    cluster: Cluster,
    ns: String,
    webhook: WebhookProcess,
    _env: ProcessEnv,
}

/// Create a RuntimeClass unless it exists (RuntimeClasses are cluster-scoped; the tests share them).
async fn runtime_class(c: &Cluster, name: &str, overhead: Option<Value>) {
    let mut v = json!({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
        "metadata": {"name": name}, "handler": name});
    if let Some(o) = overhead {
        v["overhead"] = json!({ "podFixed": o });
    }
    let rc: RuntimeClass = serde_json::from_value(v).expect("RuntimeClass");
    create_or_keep(&Api::all(c.client.clone()), &rc)
        .await
        .unwrap_or_else(|e| panic!("create RuntimeClass {name}: {e}"));
}

/// A pod of `class` as a user writes it: two containers, no key anywhere, its nodes chosen by `spec`.
fn pod(ns: &str, class: &str, spec: Value) -> Pod {
    let mut v = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": "kata-", "namespace": ns, "labels": {"app": "kata"}},
        "spec": {
            "runtimeClassName": class,
            "containers": [
                {"name": "app", "image": "registry.k8s.io/pause:3.10",
                 "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}},
                {"name": "sidecar", "image": "registry.k8s.io/pause:3.10"}
            ]
        }
    });
    for (k, val) in spec.as_object().expect("spec fields") {
        v["spec"][k] = val.clone();
    }
    serde_json::from_value(v).expect("pod")
}

/// The amounts of `resource` the container at `idx` requests and limits.
fn keys_of(p: &Pod, idx: usize, resource: &str) -> (Option<String>, Option<String>) {
    let c = &p.spec.as_ref().expect("spec").containers[idx];
    let get = |m: Option<
        &std::collections::BTreeMap<
            String,
            k8s_openapi::apimachinery::pkg::api::resource::Quantity,
        >,
    >| { m.and_then(|m| m.get(resource)).map(|q| q.0.clone()) };
    let r = c.resources.as_ref();
    (
        get(r.and_then(|r| r.requests.as_ref())),
        get(r.and_then(|r| r.limits.as_ref())),
    )
}

/// Connect, render the chart with the listed classes, start the webhook with the ConfigMap's
/// configuration, register the rendered webhook configurations for `test`, make the RuntimeClasses and
/// a namespace, and wait until the API server calls the RuntimeClass webhook there.
async fn world(test: &str) -> Option<World> {
    let cluster = Cluster::connect().await?;
    let classes = format!(
        r#"config.admission.teeRuntimeClasses={{"{CLASS}":"tdx","{OVERHEAD_CLASS}":"tdx"}}"#
    );
    let rendered = chart_support::render("default", &["--set-json", &classes]);
    let config = chart_support::str_at(
        chart_support::only(&rendered, "ConfigMap"),
        "/data/config.yaml",
    );
    let env = cluster.process_env(config).expect("process env");
    assert_eq!(
        env.config.admission.tee_runtime_classes.get(CLASS),
        Some(&TeeKind::Tdx),
        "the ConfigMap lists {CLASS}"
    );
    let webhook = env.start_webhook(&[]).await.expect("webhook starts");
    cluster
        .register_webhooks(test, &rendered, webhook.https, &env.ca.ca_bundle_base64())
        .await
        .expect("webhook configurations registered (the API server compiles their CEL)");
    runtime_class(&cluster, CLASS, None).await;
    runtime_class(
        &cluster,
        OVERHEAD_CLASS,
        Some(json!({"cpu": "250m", TDX_KEYS: "1"})),
    )
    .await;
    runtime_class(&cluster, OTHER_CLASS, None).await;
    let ns = cluster.namespace(test, test, &[]).await.expect("namespace");
    // Dry-run CREATEs until the API server calls both RuntimeClass entries (the webhook's own request
    // counts, whatever it decides: the tests below check what it decided).
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), &ns);
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let probe = pod(&ns, CLASS, json!({}));
    cluster
        .wait_for("the RuntimeClass webhooks to be called", || async {
            let _ = pods.create(&dry, &probe).await;
            let text = webhook.metrics().await;
            (reviews(&text, "mutate") > 0 && reviews(&text, "validate") > 0).then_some(())
        })
        .await
        .expect("the RuntimeClass webhooks are called");
    Some(World {
        cluster,
        ns,
        webhook,
        _env: env,
    })
}

/// A TDX node of the test (labelled with its namespace, so candidate scans and the scheduler see only
/// the test's nodes) whose report shows `free` of `capacity` keys free.
async fn node(w: &World, suffix: &str, capacity: u64, free: u64) -> String {
    let c = &w.cluster;
    let name = format!("{}-{suffix}", w.ns);
    c.node(
        &NodeBuilder::new(&name)
            .tdx(capacity)
            .label(TEST_LABEL, &w.ns),
    )
    .await
    .expect("node");
    c.report(&ReportBuilder::new(&name).kind(TeeKind::Tdx, capacity, free))
        .await
        .expect("report");
    name
}

/// `teeguard_webhook_admission_requests_total` of `endpoint` in a `/metrics` text, every outcome.
fn reviews(metrics: &str, endpoint: &str) -> u64 {
    Scrape::parse(metrics).sum(
        "teeguard_webhook_admission_requests_total",
        &[("endpoint", endpoint)],
    ) as u64
}

/// The webhook's `/mutate` reviews so far.
async fn mutate_reviews(w: &World) -> u64 {
    reviews(&w.webhook.metrics().await, "mutate")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kata_pod_gets_its_key_as_a_request_of_its_first_container() {
    within(DEADLINE, async {
        let Some(w) = world("rc-mutation").await else {
            return;
        };
        node(&w, "tdx", 4, 4).await;
        let pods = Api::<Pod>::namespaced(w.cluster.client.clone(), &w.ns);
        let selector = json!({"nodeSelector": {TEST_LABEL: w.ns}});
        let created = pods
            .create(&PostParams::default(), &pod(&w.ns, CLASS, selector.clone()))
            .await
            .expect("Kata pod created");
        // What the API server stored, read back.
        let stored = pods
            .get(created.metadata.name.as_deref().expect("generated name"))
            .await
            .expect("stored pod");
        assert_eq!(
            keys_of(&stored, 0, TDX_KEYS),
            (Some("1".into()), Some("1".into())),
            "{:?}",
            stored.spec.as_ref().map(|s| &s.containers[0].resources)
        );
        assert_eq!(keys_of(&stored, 1, TDX_KEYS), (None, None), "sidecar");
        assert_eq!(
            stored.spec.as_ref().and_then(|s| s.overhead.clone()),
            None,
            "the class has no overhead"
        );
        let app = &stored.spec.as_ref().expect("spec").containers[0];
        let requests = app.resources.as_ref().and_then(|r| r.requests.clone());
        assert_eq!(
            requests.and_then(|r| r.get("cpu").cloned()).map(|q| q.0),
            Some("10m".into()),
            "its own requests kept"
        );

        // A pod of a class not listed, and an exempt pod of the listed class: the API server does not
        // call the webhook for them (matchConditions, objectSelector), and stores them as sent.
        let before = mutate_reviews(&w).await;
        let mut exempt = pod(&w.ns, CLASS, selector.clone());
        exempt
            .metadata
            .labels
            .get_or_insert_with(Default::default)
            .insert(teeguard_shared::names::EXEMPT_LABEL.into(), "true".into());
        for (what, p) in [
            ("other class", pod(&w.ns, OTHER_CLASS, selector.clone())),
            ("exempt", exempt),
        ] {
            let stored = pods
                .create(&PostParams::default(), &p)
                .await
                .unwrap_or_else(|e| panic!("{what}: {e}"));
            assert_eq!(keys_of(&stored, 0, TDX_KEYS), (None, None), "{what}");
        }
        assert_eq!(mutate_reviews(&w).await, before, "the webhook was called");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kata_pod_on_a_full_node_is_refused_for_the_key_the_mutation_added() {
    within(DEADLINE, async {
        let Some(w) = world("rc-full").await else {
            return;
        };
        let full = node(&w, "full", 1, 0).await;
        let pods = Api::<Pod>::namespaced(w.cluster.client.clone(), &w.ns);
        // Created directly on the node (no scheduler, no binding): the pod CREATE check decides.
        let refused = pods
            .create(
                &PostParams::default(),
                &pod(&w.ns, CLASS, json!({"nodeName": full})),
            )
            .await
            .expect_err("refused: the node has no free key");
        let kube::Error::Api(s) = &refused else {
            panic!("{refused}");
        };
        assert_eq!(s.code, 403, "{refused}");
        assert!(
            s.message.contains(&full) && s.message.contains("0/1 free"),
            "{}",
            s.message
        );
        // A pod of a class not listed asks for no key and is not checked: created on the same node.
        pods.create(
            &PostParams::default(),
            &pod(&w.ns, OTHER_CLASS, json!({"nodeName": full})),
        )
        .await
        .expect("a pod without a key is created");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_class_with_the_key_in_its_overhead_gets_a_warning_and_no_second_key() {
    within(DEADLINE, async {
        let Some(w) = world("rc-overhead").await else {
            return;
        };
        node(&w, "tdx", 4, 4).await;
        let p = pod(
            &w.ns,
            OVERHEAD_CLASS,
            json!({"nodeSelector": {TEST_LABEL: w.ns}}),
        );
        let Created {
            status,
            warnings,
            body,
        } = w.cluster.create_pod_with_warnings(&w.ns, &p).await;
        assert_eq!(status, 201, "{warnings:?}");
        assert!(
            warnings
                .iter()
                .any(|w| w.contains(&format!("RuntimeClass {OVERHEAD_CLASS}"))
                    && w.contains("overhead.podFixed")
                    && w.contains("DRA")),
            "{warnings:?}"
        );
        let stored: Pod = serde_json::from_slice(&body).expect("stored pod");
        // The RuntimeClass admission put the key in the overhead; teeguard added none.
        let overhead = stored.spec.as_ref().and_then(|s| s.overhead.clone());
        assert_eq!(
            overhead.and_then(|o| o.get(TDX_KEYS).cloned()).map(|q| q.0),
            Some("1".into())
        );
        assert_eq!(keys_of(&stored, 0, TDX_KEYS), (None, None));
    })
    .await;
}
