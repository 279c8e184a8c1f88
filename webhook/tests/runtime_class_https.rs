//! Pods of a TEE RuntimeClass (`admission.teeRuntimeClasses`) through the real stack: HTTPS to an
//! in-process webhook whose caches watch the in-process fake API server. `/mutate` adds the key request
//! to the first container (or warns about a key in the overhead), the patch is applied as the API
//! server would, and `/validate` then sees the mutated pod: on a node whose report shows no free key the
//! pod is refused because of the request the mutation added.

mod common;

use std::time::Duration;

use common::{Harness, apply_to_object, response_patch};
use http::StatusCode;
use serde_json::{Value, json};
use teeguard_shared::TeeKind;
use teeguard_tests::fakeapi::FakeApiServer;
use teeguard_tests::fixtures::{
    self, AdmissionReviewBuilder, KataTee, NodeBuilder, ReportBuilder, TDX_KEYS, kata_pod,
};
use teeguard_tests::wait::eventually;

const CONFIG: &str =
    "admission:\n  teeRuntimeClasses:\n    kata-qemu-tdx: tdx\n    kata-qemu-snp: sevEs\n";
const ESIDS: &str = "sev-snp.amd.com/esids";
const KATA_NODE_LABEL: &str = "katacontainers.io/kata-runtime";

/// A Kata pod whose RuntimeClass carries no key in its overhead any more (the API server's RuntimeClass
/// admission copied `overhead.podFixed` without it).
fn updated_class_pod(name: &str, tee: KataTee) -> Value {
    let mut v = fixtures::to_value(&kata_pod(name, tee));
    v["spec"]["overhead"]
        .as_object_mut()
        .expect("overhead")
        .remove(tee.key_resource());
    v
}

fn create_review(pod: Value) -> Value {
    AdmissionReviewBuilder::create(pod).build()
}

fn audit<'a>(resp: &'a Value, key: &str) -> &'a Value {
    &resp["response"]["auditAnnotations"][key]
}

fn warnings(resp: &Value) -> Vec<String> {
    resp["response"]["warnings"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|w| w.as_str().expect("warning").to_string())
        .collect()
}

/// `/mutate` one pod; the response and the pod as the API server stores it (patch applied).
async fn mutate(h: &Harness, pod: Value) -> (Value, Value) {
    let review = create_review(pod.clone());
    let (status, resp) = h.review(&review).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    let stored = match response_patch(&resp) {
        Some(patch) => apply_to_object(&review, &patch).0,
        None => pod,
    };
    (resp, stored)
}

/// The first container's amount of `resource` in `requests` and `limits`.
fn first_container_keys(pod: &Value, resource: &str) -> (Value, Value) {
    let r = &pod["spec"]["containers"][0]["resources"];
    (
        r["requests"][resource].clone(),
        r["limits"][resource].clone(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tee_runtime_class_pods_get_a_container_key_request() {
    let api = FakeApiServer::new();
    api.create(&json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "exempt-ns", "labels": {"teeguard.dev/exempt": "true"}}}))
        .expect("namespace");
    let h = Harness::start_with(api, Some(CONFIG), &[]).await;
    let c = h.caches();
    eventually("namespace cached", async move || c.namespaces.len() == 1).await;

    // A TDX pod of the listed class: the key in requests and limits of its first container, its own
    // requests and limits kept.
    let pod = updated_class_pod("web-tdx", KataTee::Tdx);
    let (resp, stored) = mutate(&h, pod.clone()).await;
    assert_eq!(audit(&resp, "decision"), "patched", "{resp}");
    assert_eq!(audit(&resp, "runtime-class"), "kata-qemu-tdx");
    assert_eq!(audit(&resp, "tee-kind"), "tdx");
    assert_eq!(audit(&resp, "resource"), TDX_KEYS);
    assert!(warnings(&resp).is_empty(), "{resp}");
    assert_eq!(
        first_container_keys(&stored, TDX_KEYS),
        (json!("1"), json!("1"))
    );
    let (before, after) = (
        &pod["spec"]["containers"][0]["resources"],
        &stored["spec"]["containers"][0]["resources"],
    );
    for field in ["requests", "limits"] {
        for (k, v) in before[field].as_object().expect("map") {
            assert_eq!(&after[field][k], v, "{field} {k} kept");
        }
    }
    // Reinvoked (reinvocationPolicy IfNeeded) on the mutated pod: nothing more.
    let (resp, again) = mutate(&h, stored.clone()).await;
    assert!(response_patch(&resp).is_none(), "{resp}");
    assert_eq!(audit(&resp, "reason"), "key-already-requested");
    assert_eq!(again, stored);

    // An SNP pod gets its kind's resource.
    let (resp, stored) = mutate(&h, updated_class_pod("web-snp", KataTee::Snp)).await;
    assert_eq!(audit(&resp, "tee-kind"), "sev_es", "{resp}");
    assert_eq!(
        first_container_keys(&stored, ESIDS),
        (json!("1"), json!("1"))
    );

    // The RuntimeClass still puts the key in the overhead: untouched, with a warning saying what to do.
    let overhead = fixtures::to_value(&kata_pod("web-overhead", KataTee::Tdx));
    let (resp, stored) = mutate(&h, overhead.clone()).await;
    assert!(response_patch(&resp).is_none(), "{resp}");
    assert_eq!(stored, overhead);
    assert_eq!(audit(&resp, "reason"), "key-in-overhead");
    let w = warnings(&resp);
    assert_eq!(w.len(), 1, "{resp}");
    assert!(
        w[0].contains("RuntimeClass kata-qemu-tdx")
            && w[0].contains("overhead.podFixed")
            && w[0].contains("DRA")
            && w[0]
                .contains("teeguard then adds the key as a request of the pod's first container"),
        "{}",
        w[0]
    );

    // A class not listed, and a listed one in an exempt namespace: untouched.
    let mut unlisted = updated_class_pod("web-runc", KataTee::Tdx);
    unlisted["spec"]["runtimeClassName"] = json!("kata-qemu");
    let (resp, stored) = mutate(&h, unlisted.clone()).await;
    assert!(response_patch(&resp).is_none(), "{resp}");
    assert_eq!(audit(&resp, "reason"), "not-kubevirt");
    assert_eq!(stored, unlisted);
    let mut exempt = updated_class_pod("web-exempt", KataTee::Tdx);
    exempt["metadata"]["namespace"] = json!("exempt-ns");
    let (resp, _) = mutate(&h, exempt).await;
    assert!(response_patch(&resp).is_none(), "{resp}");
    assert_eq!(audit(&resp, "reason"), "exempt-namespace");

    // Counted in the mutation metrics.
    let (status, metrics) = h.admin_get("/metrics").await;
    assert_eq!(status, StatusCode::OK);
    for want in [
        r#"teeguard_webhook_runtime_class_mutations_total{kind="tdx",result="patched"} 1"#,
        r#"teeguard_webhook_runtime_class_mutations_total{kind="sev_es",result="patched"} 1"#,
        r#"teeguard_webhook_runtime_class_mutations_total{kind="tdx",result="already_requested"} 1"#,
        r#"teeguard_webhook_runtime_class_mutations_total{kind="tdx",result="overhead_key"} 1"#,
        r#"teeguard_webhook_runtime_class_mutations_total{kind="tdx",result="skipped"} 1"#,
        r#"teeguard_webhook_admission_requests_total{endpoint="mutate",outcome="patched"} 2"#,
    ] {
        assert!(metrics.contains(want), "{want} missing from\n{metrics}");
    }
    h.stop().await;
}

/// `/validate` sees the mutated pod: created with `spec.nodeName` on a node whose report shows no free
/// key, it is refused because of the request the mutation added; the same pod without it would pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn validation_refuses_the_mutated_pod_on_a_full_node() {
    let api = FakeApiServer::new();
    for (node, free) in [("kata-full", 0), ("kata-free", 4)] {
        api.create(
            &ReportBuilder::new(node)
                .kind_with_external(TeeKind::Tdx, 4, free, 0)
                .heartbeat_age(Duration::from_secs(1))
                .to_value(),
        )
        .expect("report");
        api.create(
            &NodeBuilder::new(node)
                .tdx(4)
                .label(KATA_NODE_LABEL, "true")
                .build(),
        )
        .expect("node");
    }
    let h = Harness::start_with(api, Some(CONFIG), &[]).await;
    let c = h.caches();
    eventually("reports and nodes cached", async move || {
        let ix = c.index.read();
        ix.nodes().filter(|(_, n)| n.report.is_some()).count() == 2
            && ix.nodes().filter(|(_, n)| n.labels.is_some()).count() == 2
    })
    .await;

    let on = |node: &str| {
        let mut p = updated_class_pod(&format!("web-on-{node}"), KataTee::Tdx);
        p["spec"]["nodeName"] = json!(node);
        p
    };
    let (resp, mutated) = mutate(&h, on("kata-full")).await;
    assert_eq!(audit(&resp, "decision"), "patched", "{resp}");

    let (status, resp) = h.validate(&create_review(mutated)).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["response"]["allowed"], false, "{resp}");
    assert_eq!(resp["response"]["status"]["code"], 403);
    assert_eq!(audit(&resp, "reason"), "insufficient-keys", "{resp}");
    assert_eq!(audit(&resp, "node"), "kata-full");
    let msg = resp["response"]["status"]["message"]
        .as_str()
        .expect("message");
    assert!(
        msg.contains("kata-full") && msg.contains("0/4 free"),
        "{msg}"
    );

    // Without the mutation's request the pod would ask for no key at all.
    let (status, resp) = h.validate(&create_review(on("kata-full"))).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    assert_eq!(audit(&resp, "reason"), "no-key-request");

    // On a node with free keys, and without a node (some Kata node has a key): admitted.
    let (_, mutated) = mutate(&h, on("kata-free")).await;
    let (_, resp) = h.validate(&create_review(mutated)).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    assert_eq!(audit(&resp, "node"), "kata-free");
    let (_, mutated) = mutate(&h, updated_class_pod("web-anywhere", KataTee::Tdx)).await;
    let (_, resp) = h.validate(&create_review(mutated)).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    assert_eq!(audit(&resp, "tee-kind"), "tdx", "{resp}");

    // A pod of a class not listed is not teeguard's to check.
    let mut unlisted = on("kata-full");
    unlisted["spec"]["runtimeClassName"] = json!("kata-qemu");
    unlisted["spec"]["containers"][0]["resources"]["requests"][TDX_KEYS] = json!("1");
    let (_, resp) = h.validate(&create_review(unlisted)).await;
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    assert_eq!(audit(&resp, "reason"), "not-kubevirt");

    let (_, metrics) = h.admin_get("/metrics").await;
    let want =
        r#"teeguard_webhook_validations_total{request="pod_create",kind="tdx",outcome="denied"} 1"#;
    assert!(metrics.contains(want), "{want} missing from\n{metrics}");
    h.stop().await;
}
