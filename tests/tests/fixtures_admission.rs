//! AdmissionReview fixtures deserialise with kube's admission types and carry what the API server sends.

use k8s_openapi::api::core::v1::Pod;
use kube::core::DynamicObject;
use kube::core::admission::{AdmissionRequest, AdmissionReview, Operation};
use serde_json::Value;
use teeguard_tests::fixtures::{
    self, AdmissionReviewBuilder as RequestBuilder, Tee, VirtLauncherPod, sample_files, to_value,
    users,
};

fn dynamic(review: &Value) -> AdmissionRequest<DynamicObject> {
    let review: AdmissionReview<DynamicObject> = serde_json::from_value(review.clone())
        .unwrap_or_else(|e| panic!("not an AdmissionReview: {e}"));
    review.try_into().expect("review carries a request")
}

fn typed(review: &Value) -> AdmissionRequest<Pod> {
    let review: AdmissionReview<Pod> = serde_json::from_value(review.clone()).expect("pod review");
    review.try_into().expect("review carries a request")
}

#[test]
fn every_sample_review_converts_to_an_admission_request() {
    let mut count = 0;
    for (path, content) in sample_files() {
        if !path.starts_with("admission/") {
            continue;
        }
        let value: Value = serde_json::from_str(&content).expect("sample is JSON");
        let req = dynamic(&value);
        assert!(!req.uid.is_empty(), "{path}");
        assert!(req.namespace.is_some(), "{path}");
        assert!(req.options.is_some(), "{path}");
        assert!(req.object.is_some() || req.old_object.is_some(), "{path}");
        count += 1;
    }
    assert!(count >= 18, "only {count} admission samples");
}

#[test]
fn pod_create_with_generate_name() {
    let pod = fixtures::virt_launcher_pod(Tee::Tdx);
    let review = fixtures::pod_create(&pod);
    assert_eq!(review["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(review["kind"], "AdmissionReview");
    assert!(
        review["request"].get("name").is_none(),
        "no name for a generateName pod"
    );
    let req = dynamic(&review);
    assert_eq!(req.operation, Operation::Create);
    assert_eq!(req.name, "");
    assert_eq!(req.namespace.as_deref(), Some("default"));
    assert_eq!(
        (
            req.kind.group.as_str(),
            req.kind.version.as_str(),
            req.kind.kind.as_str()
        ),
        ("", "v1", "Pod")
    );
    assert_eq!(req.resource.resource, "pods");
    assert_eq!(
        req.request_kind.as_ref().map(|k| k.kind.as_str()),
        Some("Pod")
    );
    assert_eq!(
        req.request_resource.as_ref().map(|r| r.resource.as_str()),
        Some("pods")
    );
    assert_eq!(req.sub_resource, None);
    assert!(!req.dry_run);
    assert!(req.old_object.is_none());
    assert_eq!(
        req.user_info.username.as_deref(),
        Some("system:serviceaccount:kubevirt:kubevirt-controller")
    );
    let options =
        serde_json::to_value(req.options.as_ref().expect("options")).expect("options json");
    assert_eq!(options["kind"], "CreateOptions");
    let object = req.object.expect("object");
    assert_eq!(
        object.metadata.generate_name.as_deref(),
        Some("virt-launcher-tdx-vm-")
    );
    // The typed view is the very pod the review was built from.
    let typed = typed(&review);
    assert_eq!(typed.object.as_ref(), Some(&pod));
}

#[test]
fn pod_create_with_node_name_dry_run_and_validating_stage() {
    let on_node = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
        .node_name("node01")
        .build();
    let req = typed(&fixtures::pod_create(&on_node));
    assert_eq!(
        req.object
            .and_then(|p| p.spec)
            .and_then(|s| s.node_name)
            .as_deref(),
        Some("node01")
    );

    let review = fixtures::pod_create_dry_run(&fixtures::virt_launcher_pod(Tee::Tdx));
    let req = dynamic(&review);
    assert!(req.dry_run);
    assert_eq!(
        review["request"]["options"]["dryRun"],
        serde_json::json!(["All"])
    );
    assert_ne!(
        req.uid,
        dynamic(&fixtures::pod_create(&fixtures::virt_launcher_pod(
            Tee::Tdx
        )))
        .uid
    );

    let named = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
        .generated_name()
        .build();
    let req = dynamic(&fixtures::pod_create(&named));
    assert_eq!(
        Some(req.name.clone()),
        named.metadata.name,
        "validating webhooks see the generated name"
    );
}

#[test]
fn binding_from_the_scheduler() {
    let pod = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
        .generated_name()
        .build();
    let pod_name = pod.metadata.name.clone().expect("name");
    let review = fixtures::binding_create(&pod, "node04");
    let req = dynamic(&review);
    assert_eq!(req.operation, Operation::Create);
    assert_eq!(req.name, pod_name);
    assert_eq!(req.sub_resource.as_deref(), Some("binding"));
    assert_eq!(req.request_sub_resource.as_deref(), Some("binding"));
    assert_eq!(req.resource.resource, "pods");
    assert_eq!(req.kind.kind, "Binding");
    assert_eq!(
        req.user_info.username.as_deref(),
        Some("system:kube-scheduler")
    );
    let object = req.object.expect("binding object");
    assert_eq!(
        object.types.as_ref().map(|t| t.kind.as_str()),
        Some("Binding")
    );
    assert_eq!(object.metadata.name.as_deref(), Some(pod_name.as_str()));
    assert_eq!(object.metadata.uid, pod.metadata.uid);
    assert!(
        object.metadata.labels.is_none(),
        "a Binding carries no labels"
    );
    assert_eq!(object.data["target"]["kind"], "Node");
    assert_eq!(object.data["target"]["name"], "node04");
}

#[test]
fn update_and_delete() {
    let old = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
        .running_on("node01")
        .build();
    let new = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
        .running_on("node01")
        .label("x", "y")
        .build();
    let req = typed(&fixtures::pod_update(&old, &new));
    assert_eq!(req.operation, Operation::Update);
    assert_eq!(req.old_object.as_ref(), Some(&old));
    assert_eq!(req.object.as_ref(), Some(&new));
    assert_eq!(req.name, old.metadata.name.clone().expect("name"));

    let review = fixtures::pod_delete(&old);
    assert!(review["request"]["object"].is_null());
    let req = typed(&review);
    assert_eq!(req.operation, Operation::Delete);
    assert!(req.object.is_none());
    assert_eq!(req.old_object.as_ref(), Some(&old));
    let options = serde_json::to_value(req.options.as_ref().expect("options")).expect("json");
    assert_eq!(options["kind"], "DeleteOptions");
}

#[test]
fn generic_builder_for_any_object() {
    let vmi = fixtures::vmi(Tee::Snp);
    let review = RequestBuilder::create(vmi.clone())
        .user(users::admin())
        .build();
    let req = dynamic(&review);
    assert_eq!(req.kind.group, "kubevirt.io");
    assert_eq!(req.resource.resource, "virtualmachineinstances");
    assert_eq!(req.user_info.username.as_deref(), Some("kubernetes-admin"));

    let node = to_value(&fixtures::tdx_node("node01", 31, false));
    let review = RequestBuilder::update(node.clone(), node)
        .sub_resource("status")
        .user(users::node_agent("node01"))
        .uid("11111111-2222-4333-8444-555555555555")
        .build();
    let req = dynamic(&review);
    assert_eq!(req.uid, "11111111-2222-4333-8444-555555555555");
    assert_eq!(req.resource.resource, "nodes");
    assert_eq!(req.sub_resource.as_deref(), Some("status"));
    assert_eq!(req.namespace, None);
    let extra = req.user_info.extra.expect("extra");
    assert_eq!(
        extra.get("authentication.kubernetes.io/node-name"),
        Some(&vec!["node01".to_owned()])
    );

    let kata = fixtures::kata_pod("k", fixtures::KataTee::Tdx);
    let req = dynamic(&fixtures::pod_create(&kata));
    assert_eq!(
        req.user_info.username.as_deref(),
        Some("kubernetes-admin"),
        "not a KubeVirt pod"
    );
}
