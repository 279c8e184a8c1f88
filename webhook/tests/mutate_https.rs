//! `/mutate` through the real stack: HTTPS (rustls, HTTP/1.1 and HTTP/2) to an in-process webhook
//! whose caches watch the in-process fake API server. Each returned patch is applied to the request's
//! pod and the result parsed as a k8s-openapi Pod.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::{Conn, Harness, Proto, apply_to_object, response_patch};
use http::StatusCode;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::{Value, json};
use teeguard_tests::fakeapi::{FakeApiServer, FaultRule, RecordedRequest, Verb};
use teeguard_tests::fixtures::{
    self, AdmissionReviewBuilder, DEFAULT_NAMESPACE, DEFAULT_NODE, Tee, VirtLauncherPod, Vmi,
    owned_by, seed_vmi,
};
use teeguard_tests::kubevirt::Version;
use teeguard_tests::wait::eventually;

fn create_review(pod: Value) -> Value {
    AdmissionReviewBuilder::create(pod).build()
}

fn vmi_gets(api: &FakeApiServer) -> Vec<RecordedRequest> {
    api.requests_where(|r| {
        r.verb == Verb::Get && r.resource.as_deref() == Some("virtualmachineinstances")
    })
}

fn compute(pod: &Pod) -> &k8s_openapi::api::core::v1::Container {
    pod.spec
        .as_ref()
        .expect("spec")
        .containers
        .iter()
        .find(|c| c.name == "compute")
        .expect("compute container")
}

fn requests_of(pod: &Pod) -> BTreeMap<String, Quantity> {
    compute(pod)
        .resources
        .as_ref()
        .and_then(|r| r.requests.clone())
        .unwrap_or_default()
}

fn limits_of(pod: &Pod) -> BTreeMap<String, Quantity> {
    compute(pod)
        .resources
        .as_ref()
        .and_then(|r| r.limits.clone())
        .unwrap_or_default()
}

/// Assert an allowed response that patched; return the patched pod.
fn assert_patched(review: &Value, status: StatusCode, resp: &Value) -> Pod {
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(resp["kind"], "AdmissionReview");
    assert_eq!(
        resp["response"]["uid"], review["request"]["uid"],
        "uid echoed"
    );
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    assert_eq!(resp["response"]["auditAnnotations"]["decision"], "patched");
    let patch = response_patch(resp).expect("a patch");
    apply_to_object(review, &patch).1
}

/// Assert an allowed, unpatched response with the given audit reason.
fn assert_skipped(review: &Value, status: StatusCode, resp: &Value, reason: &str) {
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["response"]["uid"], review["request"]["uid"]);
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    assert!(response_patch(resp).is_none(), "unexpected patch: {resp}");
    assert_eq!(
        resp["response"]["auditAnnotations"]["reason"], reason,
        "{resp}"
    );
}

fn assert_denied(status: StatusCode, resp: &Value, reason: &str) -> String {
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["response"]["allowed"], false, "{resp}");
    assert!(resp["response"].get("patch").is_none());
    assert!(resp["response"].get("patchType").is_none());
    assert_eq!(resp["response"]["status"]["code"], 403);
    assert_eq!(resp["response"]["auditAnnotations"]["decision"], "denied");
    assert_eq!(
        resp["response"]["auditAnnotations"]["reason"], reason,
        "{resp}"
    );
    resp["response"]["status"]["message"]
        .as_str()
        .expect("message")
        .to_string()
}

/// KubeVirt's own objects of each supported release (`tests/fixtures/kubevirt-<release>/`, rendered by
/// its virt-controller from VMIs defaulted by virt-api's code): each TEE kind's launcher pod gets its key
/// request on `compute` and the annotation, nothing else of it changes, and the plain VMI's pod is left
/// alone. v1.7.4's and v1.8.4's TDX pods carry neither `devices.kubevirt.io/tdx` nor the QGS annotation
/// (only the VMI says TDX), and `compute` is not their only container.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubevirt_v1_7_to_v1_9_launcher_pods_of_each_kind_get_their_key_and_annotation() {
    for version in Version::ALL {
        launcher_pods_of_each_kind_get_their_key_and_annotation(version).await;
    }
}

async fn launcher_pods_of_each_kind_get_their_key_and_annotation(version: Version) {
    use teeguard_tests::kubevirt::rendered;
    let api = FakeApiServer::new();
    let mut uids = Vec::new();
    for tee in rendered::KINDS {
        let stored = api
            .create(&rendered::vmi_value_of(version, tee))
            .expect("seed the VMI");
        uids.push(stored["metadata"]["uid"].as_str().expect("uid").to_string());
    }
    let h = Harness::start_with(api, None, &[]).await;
    h.wait_vmis(rendered::KINDS.len()).await;
    for (tee, uid) in rendered::KINDS.into_iter().zip(&uids) {
        let original = rendered::launcher_pod_of(version, tee);
        let review = create_review(owned_by(&original, uid));
        let (status, resp) = h.review(&review).await;
        let Some((resource, misc)) = (match tee {
            Tee::Tdx => Some(("tdx.intel.com/keys", "tdx 1")),
            Tee::Sev => Some(("sev.amd.com/asids", "sev 1")),
            Tee::SevEs | Tee::Snp => Some(("sev-snp.amd.com/esids", "sev_es 1")),
            _ => None,
        }) else {
            assert_skipped(&review, status, &resp, "not-tee");
            continue;
        };
        let pod = assert_patched(&review, status, &resp);
        let (mut want_req, mut want_lim) = (requests_of(&original), limits_of(&original));
        want_req.insert(resource.to_string(), Quantity("1".into()));
        want_lim.insert(resource.to_string(), Quantity("1".into()));
        assert_eq!(requests_of(&pod), want_req, "{version} {tee:?}");
        assert_eq!(limits_of(&pod), want_lim, "{version} {tee:?}");
        assert_eq!(
            pod.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("misc-max.teeguard.dev/compute")),
            Some(&misc.to_string()),
            "{version} {tee:?}"
        );
        let spec = pod.spec.as_ref().expect("spec");
        let before = original.spec.as_ref().expect("spec");
        assert_eq!(
            spec.init_containers, before.init_containers,
            "{version} {tee:?}"
        );
        assert_eq!(spec.containers.len(), before.containers.len(), "{version}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_tee_kind_gets_its_key_and_annotation() {
    let api = FakeApiServer::new();
    let cases = [
        (Tee::Tdx, "tdx.intel.com/keys", "tdx 1"),
        (Tee::Sev, "sev.amd.com/asids", "sev 1"),
        (Tee::SevEs, "sev-snp.amd.com/esids", "sev_es 1"),
        (Tee::Snp, "sev-snp.amd.com/esids", "sev_es 1"),
    ];
    let mut uids = Vec::new();
    for (tee, _, _) in cases {
        uids.push(seed_vmi(
            &api,
            &Vmi::new(&format!("{}-vm", tee.slug())).tee(tee),
        ));
    }
    let h = Harness::start_with(api, None, &[]).await;
    h.wait_vmis(cases.len()).await;
    h.api.clear_requests();

    for ((tee, resource, misc), uid) in cases.iter().zip(&uids) {
        let original = VirtLauncherPod::for_tee(&format!("{}-vm", tee.slug()), *tee).build();
        let review = create_review(owned_by(&original, uid));
        let (status, resp) = h.review(&review).await;
        let pod = assert_patched(&review, status, &resp);
        let requests = requests_of(&pod);
        let limits = limits_of(&pod);
        assert_eq!(
            requests.get(*resource),
            Some(&Quantity("1".into())),
            "{tee:?}"
        );
        assert_eq!(
            limits.get(*resource),
            Some(&Quantity("1".into())),
            "{tee:?}"
        );
        // Every existing request and limit is preserved; only the key resource is added.
        let (mut before_req, mut before_lim) = (requests_of(&original), limits_of(&original));
        before_req.insert(resource.to_string(), Quantity("1".into()));
        before_lim.insert(resource.to_string(), Quantity("1".into()));
        assert_eq!(requests, before_req, "{tee:?}");
        assert_eq!(limits, before_lim, "{tee:?}");
        let annotations = pod.metadata.annotations.clone().unwrap_or_default();
        assert_eq!(
            annotations
                .get("misc-max.teeguard.dev/compute")
                .map(String::as_str),
            Some(*misc),
            "{tee:?}"
        );
        // Existing annotations are kept.
        for (k, v) in original.metadata.annotations.clone().unwrap_or_default() {
            assert_eq!(annotations.get(&k), Some(&v), "annotation {k}");
        }
        assert_eq!(
            resp["response"]["auditAnnotations"]["tee-kind"],
            teeguard_shared::TeeKind::ALL
                .into_iter()
                .find(|k| misc.starts_with(&format!("{} ", k.kernel_name())))
                .expect("kind")
                .kernel_name()
        );
    }
    // Cache hits only: the hot path made no API call.
    assert!(vmi_gets(&h.api).is_empty(), "{:?}", vmi_gets(&h.api));

    // Migration targets get the key too; so do dry-run creates.
    let target = fixtures::migration_target_pod("tdx-vm", Tee::Tdx, DEFAULT_NODE);
    let review = create_review(owned_by(&target, &uids[0]));
    let (status, resp) = h.review(&review).await;
    let pod = assert_patched(&review, status, &resp);
    assert_eq!(
        requests_of(&pod).get("tdx.intel.com/keys"),
        Some(&Quantity("1".into()))
    );
    let tdx = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx).build();
    let review = AdmissionReviewBuilder::create(owned_by(&tdx, &uids[0]))
        .dry_run(true)
        .build();
    let (status, resp) = h.review(&review).await;
    assert_patched(&review, status, &resp);

    let (code, readyz) = h.admin_get("/readyz").await;
    assert_eq!(code, StatusCode::OK, "{readyz}");
    let (_, metrics) = h.admin_get("/metrics").await;
    for want in [
        r#"teeguard_webhook_admission_requests_total{endpoint="mutate",outcome="patched"} 6"#,
        r#"teeguard_webhook_cache_objects{cache="vmis"} 4"#,
        r#"teeguard_webhook_cache_lookups_total{cache="vmis",result="cache_hit"} 6"#,
        "teeguard_webhook_cert_expiry_timestamp_seconds ",
    ] {
        assert!(metrics.contains(want), "{want} missing from\n{metrics}");
    }
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reinvocation_yields_no_patch() {
    let api = FakeApiServer::new();
    let uid = seed_vmi(&api, &Vmi::new("tdx-vm").tee(Tee::Tdx));
    let h = Harness::start_with(api, None, &[]).await;
    h.wait_vmis(1).await;
    let review = create_review(owned_by(&fixtures::virt_launcher_pod(Tee::Tdx), &uid));
    let (status, resp) = h.review(&review).await;
    let (patched, _) = apply_to_object(&review, &response_patch(&resp).expect("patch"));
    assert_eq!(status, StatusCode::OK);

    // reinvocationPolicy: IfNeeded sends the mutated pod again.
    let again = create_review(patched);
    let (status, resp) = h.review(&again).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(resp["response"]["allowed"], true);
    assert!(response_patch(&resp).is_none(), "{resp}");
    assert_eq!(
        resp["response"]["auditAnnotations"]["decision"],
        "unchanged"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_that_must_not_get_a_key_are_left_alone() {
    let api = FakeApiServer::new();
    let plain = seed_vmi(&api, &Vmi::new("plain-vm"));
    let s390x = seed_vmi(&api, &Vmi::new("s390x-vm").tee(Tee::SecureExecution));
    let tdx = seed_vmi(&api, &Vmi::new("tdx-vm").tee(Tee::Tdx));
    let h = Harness::start_with(api, None, &[]).await;
    h.wait_vmis(3).await;

    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "non-TEE VMI",
            owned_by(&VirtLauncherPod::new("plain-vm").build(), &plain),
            "not-tee",
        ),
        (
            "s390x launchSecurity: {}",
            owned_by(
                &VirtLauncherPod::for_tee("s390x-vm", Tee::SecureExecution).build(),
                &s390x,
            ),
            "unmanaged-launch-security",
        ),
        (
            "storage-binding pod",
            owned_by(&fixtures::storage_binding_pod("tdx-vm", Tee::Tdx), &tdx),
            "storage-binding-pod",
        ),
        (
            "hotplug pod",
            fixtures::to_value(&fixtures::hotplug_pod("tdx-vm", DEFAULT_NODE)),
            "hotplug-pod",
        ),
        (
            "export pod",
            fixtures::to_value(&fixtures::export_pod("tdx-vm-export")),
            "export-pod",
        ),
        (
            "Kata TDX pod (not a virt-launcher pod)",
            fixtures::to_value(&fixtures::kata_pod("kata-tdx", fixtures::KataTee::Tdx)),
            "not-kubevirt",
        ),
        (
            "pod labelled virt-launcher by someone else, no VMI owner",
            json!({
                "apiVersion": "v1", "kind": "Pod",
                "metadata": {"name": "impostor", "namespace": DEFAULT_NAMESPACE, "labels": {"kubevirt.io": "virt-launcher"}},
                "spec": {"containers": [{"name": "compute", "image": "busybox"}]}
            }),
            "no-vmi-owner",
        ),
    ];
    for (what, pod, reason) in cases {
        let review = create_review(pod);
        let (status, resp) = h.review(&review).await;
        assert_skipped(&review, status, &resp, reason);
        assert_eq!(
            resp["response"]["auditAnnotations"]["decision"], "skipped",
            "{what}"
        );
    }

    // Not a pod CREATE: UPDATE, DELETE and bindings are allowed untouched.
    let named = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
        .generated_name()
        .build();
    for review in [
        fixtures::pod_update(&named, &named),
        fixtures::pod_delete(&named),
        fixtures::binding_create(&named, DEFAULT_NODE),
    ] {
        let (status, resp) = h.review(&review).await;
        assert_skipped(&review, status, &resp, "not-pod-create");
    }
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exemptions_by_namespace_vmi_and_pod_label() {
    let api = FakeApiServer::new();
    api.create(&json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "exempt-ns", "labels": {"teeguard.dev/exempt": "true"}}
    }))
    .expect("namespace");
    api.create(
        &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": DEFAULT_NAMESPACE}}),
    )
    .expect("namespace");
    let in_exempt_ns = seed_vmi(
        &api,
        &Vmi::new("tdx-vm").namespace("exempt-ns").tee(Tee::Tdx),
    );
    let exempt_vmi = seed_vmi(&api, &Vmi::new("exempt-vm").tee(Tee::Tdx).exempt());
    let tdx = seed_vmi(&api, &Vmi::new("tdx-vm").tee(Tee::Tdx));
    let h = Harness::start_with(api, None, &[]).await;
    h.wait_vmis(3).await;
    let namespaces = h
        .running
        .as_ref()
        .expect("running")
        .caches
        .namespaces
        .clone();
    eventually("namespaces cached", async || namespaces.len() == 2).await;
    h.api.clear_requests();

    let review = create_review(owned_by(
        &VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
            .namespace("exempt-ns")
            .build(),
        &in_exempt_ns,
    ));
    let (status, resp) = h.review(&review).await;
    assert_skipped(&review, status, &resp, "exempt-namespace");

    // The VMI is exempt, the pod (deliberately) does not carry the copied label.
    let review = create_review(owned_by(
        &VirtLauncherPod::for_tee("exempt-vm", Tee::Tdx).build(),
        &exempt_vmi,
    ));
    let (status, resp) = h.review(&review).await;
    assert_skipped(&review, status, &resp, "exempt-vmi");

    let review = create_review(owned_by(
        &VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
            .exempt()
            .build(),
        &tdx,
    ));
    let (status, resp) = h.review(&review).await;
    assert_skipped(&review, status, &resp, "exempt-pod");

    // All answered from the caches.
    let gets = h.api.requests_where(|r| r.verb == Verb::Get);
    assert!(gets.is_empty(), "{gets:?}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_miss_is_served_by_one_get() {
    let h = Harness::start().await;
    // Keep the VMI out of the cache: lists and watches of VMIs fail from now on.
    for verb in [Verb::List, Verb::Watch] {
        h.api.add_fault(
            FaultRule::respond(503)
                .verb(verb)
                .resource("virtualmachineinstances"),
        );
    }
    h.api.clear_requests();
    h.api.drop_watches();
    // Wait until the reflector's old watch has ended and its new one was refused.
    let api = h.api.clone();
    eventually("VMI watch refused", async || {
        !api.requests_where(|r| {
            r.is(Verb::Watch, "virtualmachineinstances") && r.response_code == Some(503)
        })
        .is_empty()
    })
    .await;
    let uid = seed_vmi(&h.api, &Vmi::new("late-vm").tee(Tee::Snp));
    h.api.clear_requests();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        h.running.as_ref().expect("running").caches.vmis.len(),
        0,
        "the VMI must not be cached for this test"
    );

    let review = create_review(owned_by(
        &VirtLauncherPod::for_tee("late-vm", Tee::Snp).build(),
        &uid,
    ));
    let (status, resp) = h.review(&review).await;
    let pod = assert_patched(&review, status, &resp);
    assert_eq!(
        limits_of(&pod).get("sev-snp.amd.com/esids"),
        Some(&Quantity("1".into()))
    );
    let gets = vmi_gets(&h.api);
    assert_eq!(gets.len(), 1, "{gets:?}");
    assert_eq!(gets[0].name.as_deref(), Some("late-vm"));
    assert_eq!(gets[0].namespace.as_deref(), Some(DEFAULT_NAMESPACE));
    h.api.clear_faults();
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_vmi_and_api_errors_are_retryable_denials() {
    let h = Harness::start().await;
    h.api.clear_requests();
    let pod = VirtLauncherPod::for_tee("ghost-vm", Tee::Tdx).build();
    let review = create_review(fixtures::to_value(&pod));
    let (status, resp) = h.review(&review).await;
    let msg = assert_denied(status, &resp, "vmi-not-found");
    assert_eq!(
        msg,
        "VirtualMachineInstance default/ghost-vm not found yet; KubeVirt will retry creating the pod"
    );
    assert_eq!(vmi_gets(&h.api).len(), 1);

    h.api.add_fault(
        FaultRule::respond(500)
            .verb(Verb::Get)
            .resource("virtualmachineinstances"),
    );
    let (status, resp) = h.review(&review).await;
    let msg = assert_denied(status, &resp, "vmi-lookup-failed");
    assert!(
        msg.contains("default/ghost-vm") && msg.contains("KubeVirt will retry"),
        "{msg}"
    );
    h.api.clear_faults();
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_existing_request_is_denied() {
    let api = FakeApiServer::new();
    let uid = seed_vmi(&api, &Vmi::new("tdx-vm").tee(Tee::Tdx));
    let h = Harness::start_with(api, None, &[]).await;
    h.wait_vmis(1).await;
    let pod = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
        .request("tdx.intel.com/keys", "2")
        .build();
    let review = create_review(owned_by(&pod, &uid));
    let (status, resp) = h.review(&review).await;
    let msg = assert_denied(status, &resp, "conflicting-request");
    assert!(
        msg.contains("tdx.intel.com/keys")
            && msg.contains("\"2\"")
            && msg.contains("default/tdx-vm"),
        "{msg}"
    );

    // The same amount already requested is fine: only the annotation is added.
    let pod = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
        .request("tdx.intel.com/keys", "1")
        .build();
    let review = create_review(owned_by(&pod, &uid));
    let (status, resp) = h.review(&review).await;
    let patched = assert_patched(&review, status, &resp);
    assert_eq!(response_patch(&resp).expect("patch").0.len(), 1);
    assert_eq!(
        patched.metadata.annotations.expect("annotations")["misc-max.teeguard.dev/compute"],
        "tdx 1"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crio_annotation_and_resource_names_from_config() {
    let api = FakeApiServer::new();
    let uid = seed_vmi(&api, &Vmi::new("tdx-vm").tee(Tee::Tdx));
    let h = Harness::start_with(
        api,
        Some("resources:\n  tdx:\n    resourceName: example.com/tdx-keys\nenforcement:\n  crioAnnotation: legacy\n"),
        &[],
    )
    .await;
    h.wait_vmis(1).await;
    let review = create_review(owned_by(&fixtures::virt_launcher_pod(Tee::Tdx), &uid));
    let (status, resp) = h.review(&review).await;
    let pod = assert_patched(&review, status, &resp);
    assert_eq!(
        requests_of(&pod).get("example.com/tdx-keys"),
        Some(&Quantity("1".into()))
    );
    let annotations = pod.metadata.annotations.expect("annotations");
    assert_eq!(
        annotations["io.kubernetes.cri-o.UnifiedCgroup.compute"],
        "misc.max=tdx 1"
    );
    assert_eq!(annotations["misc-max.teeguard.dev/compute"], "tdx 1");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_reviews_get_400_json() {
    let h = Harness::start().await;
    let good = create_review(fixtures::to_value(&fixtures::virt_launcher_pod(Tee::Tdx)));
    let mut wrong_version = good.clone();
    wrong_version["apiVersion"] = json!("admission.k8s.io/v1beta1");
    let mut no_uid = good.clone();
    no_uid["request"]
        .as_object_mut()
        .expect("request")
        .remove("uid");
    let mut no_request = good.clone();
    no_request
        .as_object_mut()
        .expect("review")
        .remove("request");
    let mut bad_pod = good.clone();
    bad_pod["request"]["object"]["spec"]["containers"] = json!("not a list");
    // The good review with one more top-level field holding a byte that is not UTF-8.
    let mut not_utf8 = serde_json::to_vec(&good).expect("json");
    assert_eq!(not_utf8.pop(), Some(b'}'));
    not_utf8.extend_from_slice(b",\"x\":\"\xff\"}");
    let bodies: Vec<(Vec<u8>, &str)> = vec![
        (b"{\"apiVersion\":".to_vec(), "invalid JSON"),
        (b"".to_vec(), "invalid JSON"),
        (serde_json::to_vec(&wrong_version).expect("json"), "v1beta1"),
        (serde_json::to_vec(&no_uid).expect("json"), "uid is missing"),
        (
            serde_json::to_vec(&no_request).expect("json"),
            "request is missing",
        ),
        (
            serde_json::to_vec(&bad_pod).expect("json"),
            "not a valid Pod",
        ),
        // JSON is UTF-8: a body that is not, even inside a string no decision reads, is refused.
        (not_utf8, "not UTF-8"),
    ];
    let mut conn = h.connect().await;
    for (body, want) in bodies {
        // One keep-alive connection serves them all: errors do not break it.
        let (status, resp) = conn.post("/mutate", body).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{resp}");
        let err = resp["error"].as_str().expect("error string");
        assert!(err.contains(want), "{want:?} not in {err:?}");
    }
    let (status, resp) = conn.post("/nope", b"{}".to_vec()).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(resp["error"].as_str().expect("error").contains("/nope"));
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_body_gets_413_json() {
    let h = Harness::start().await;
    let big = vec![b' '; 8 * 1024 * 1024];
    for proto in [Proto::Http1, Proto::Http2] {
        let mut conn = Conn::connect(h.https, h.ca_der(), proto).await;
        let (status, resp) = conn.post("/mutate", big.clone()).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{proto:?}: {resp}");
        assert!(
            resp["error"]
                .as_str()
                .expect("error")
                .contains("7340032-byte limit"),
            "{resp}"
        );
    }
    // A review just under the limit (padded with whitespace) is still served.
    let mut review = serde_json::to_vec(&create_review(fixtures::to_value(&fixtures::kata_pod(
        "k",
        fixtures::KataTee::Tdx,
    ))))
    .expect("json");
    review.resize(7 * 1024 * 1024 - 16, b' ');
    let (status, resp) = h.connect().await.post("/mutate", review).await;
    assert_eq!(status, StatusCode::OK, "{resp}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_works() {
    let api = FakeApiServer::new();
    let uid = seed_vmi(&api, &Vmi::new("tdx-vm").tee(Tee::Tdx));
    let h = Harness::start_with(api, None, &[]).await;
    h.wait_vmis(1).await;
    let mut conn = Conn::connect(h.https, h.ca_der(), Proto::Http2).await;
    assert_eq!(conn.alpn.as_deref(), Some(&b"h2"[..]));
    let review = create_review(owned_by(&fixtures::virt_launcher_pod(Tee::Tdx), &uid));
    for _ in 0..3 {
        let (status, resp) = conn
            .post("/mutate", serde_json::to_vec(&review).expect("json"))
            .await;
        let pod = assert_patched(&review, status, &resp);
        assert_eq!(
            limits_of(&pod).get("tdx.intel.com/keys"),
            Some(&Quantity("1".into()))
        );
    }
    // HTTP/1.1 keep-alive on one connection, too.
    let mut conn = h.connect().await;
    assert_eq!(conn.alpn.as_deref(), Some(&b"http/1.1"[..]));
    for _ in 0..3 {
        let (status, resp) = conn
            .post("/mutate", serde_json::to_vec(&review).expect("json"))
            .await;
        assert_patched(&review, status, &resp);
    }
    h.stop().await;
}
