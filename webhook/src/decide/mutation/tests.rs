//! Tests of the mutation decision and its patch.

use super::patch::ptr;
use super::*;
use json_patch::jsonptr::PointerBuf;
use json_patch::{Patch, PatchOperation};
use pretty_assertions::assert_eq;
use serde_json::Value;
use serde_json::json;
use teeguard_shared::config::CrioAnnotation;

fn base_pod() -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": "virt-launcher-vm1-",
            "namespace": "ns",
            "labels": {
                "kubevirt.io": "virt-launcher",
                "kubevirt.io/created-by": "vmi-uid-1",
                "vm.kubevirt.io/name": "vm1"
            },
            "annotations": {"kubevirt.io/domain": "vm1"},
            "ownerReferences": [{
                "apiVersion": "kubevirt.io/v1",
                "kind": "VirtualMachineInstance",
                "name": "vm1",
                "uid": "vmi-uid-1",
                "controller": true,
                "blockOwnerDeletion": true
            }]
        },
        "spec": {
            "containers": [
                {"name": "compute", "image": "virt-launcher", "resources": {
                    "requests": {"cpu": "100m", "memory": "2Gi", "devices.kubevirt.io/tdx": "1"},
                    "limits": {"devices.kubevirt.io/tdx": "1"}
                }},
                {"name": "guest-console-log", "image": "virt-launcher"}
            ]
        }
    })
}

fn pod_from(v: &Value) -> Pod {
    serde_json::from_value(v.clone()).expect("pod")
}

fn vmi(launch_security: Value, labels: Value) -> Arc<VirtualMachineInstance> {
    let mut v = json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": "vm1", "namespace": "ns", "uid": "vmi-uid-1", "labels": labels},
        "spec": {"domain": {"devices": {}}}
    });
    if !launch_security.is_null() {
        v["spec"]["domain"]["launchSecurity"] = launch_security;
    }
    Arc::new(VirtualMachineInstance::from_json(v).expect("vmi"))
}

fn tdx() -> VmiLookup {
    VmiLookup::Found(vmi(json!({"tdx": {}}), json!({})))
}

fn apply(pod: &Value, patch: &Patch) -> Value {
    let mut doc = pod.clone();
    json_patch::patch(&mut doc, &patch.0).expect("patch applies");
    doc
}

fn decide(pod: &Value, vmi: Option<&VmiLookup>, cfg: &Config) -> MutationDecision {
    decide_mutation(&pod_from(pod), vmi, None, cfg)
}

fn injected(d: MutationDecision) -> Injection {
    match d {
        MutationDecision::Inject(i) => i,
        other => panic!("expected injection, got {other:?}"),
    }
}

fn skipped(d: MutationDecision) -> SkipReason {
    match d {
        MutationDecision::Skip(s) => s,
        other => panic!("expected skip, got {other:?}"),
    }
}

fn denied(d: MutationDecision) -> Denial {
    match d {
        MutationDecision::Deny(x) => x,
        other => panic!("expected denial, got {other:?}"),
    }
}

#[test]
fn each_kind_gets_its_resource_and_annotation() {
    let cfg = Config::default();
    let cases = [
        (
            json!({"tdx": {}}),
            TeeKind::Tdx,
            "tdx.intel.com/keys",
            "tdx 1",
        ),
        (
            json!({"sev": {}}),
            TeeKind::Sev,
            "sev.amd.com/asids",
            "sev 1",
        ),
        (
            json!({"sev": {"policy": {"encryptedState": true}}}),
            TeeKind::SevEs,
            "sev-snp.amd.com/esids",
            "sev_es 1",
        ),
        (
            json!({"snp": {}}),
            TeeKind::SevEs,
            "sev-snp.amd.com/esids",
            "sev_es 1",
        ),
    ];
    for (ls, kind, resource, misc) in cases {
        let pod = base_pod();
        let lookup = VmiLookup::Found(vmi(ls.clone(), json!({})));
        let inj = injected(decide(&pod, Some(&lookup), &cfg));
        assert_eq!(inj.kind, kind, "{ls}");
        assert_eq!(inj.resource, resource);
        assert_eq!(inj.keys, 1);
        assert_eq!(inj.vmi.name, "vm1");
        let out = apply(&pod, &inj.patch);
        let c = &out["spec"]["containers"][0]["resources"];
        assert_eq!(c["requests"][resource], "1", "{ls}");
        assert_eq!(c["limits"][resource], "1", "{ls}");
        // Existing requests are preserved.
        assert_eq!(c["requests"]["cpu"], "100m");
        assert_eq!(c["requests"]["memory"], "2Gi");
        assert_eq!(c["requests"]["devices.kubevirt.io/tdx"], "1");
        assert_eq!(
            out["metadata"]["annotations"]["misc-max.teeguard.dev/compute"],
            misc
        );
        assert_eq!(out["metadata"]["annotations"]["kubevirt.io/domain"], "vm1");
        // The other container is untouched.
        assert_eq!(out["spec"]["containers"][1], pod["spec"]["containers"][1]);
        // The result is still a valid Pod.
        let _: Pod = serde_json::from_value(out).expect("patched pod");
    }
}

#[test]
fn patch_paths_escape_slashes() {
    let inj = injected(decide(&base_pod(), Some(&tdx()), &Config::default()));
    let json = serde_json::to_value(&inj.patch).expect("patch json");
    assert_eq!(
        json,
        json!([
            {"op": "add", "path": "/spec/containers/0/resources/requests/tdx.intel.com~1keys", "value": "1"},
            {"op": "add", "path": "/spec/containers/0/resources/limits/tdx.intel.com~1keys", "value": "1"},
            {"op": "add", "path": "/metadata/annotations/misc-max.teeguard.dev~1compute", "value": "tdx 1"}
        ])
    );
    // `~` is escaped as `~0`, `/` as `~1`, as jsonptr escapes them.
    for tokens in [
        &["metadata", "annotations", "a~b/c"][..],
        &["a~~b", "//", "~1", "~", "/", "", "x/y~z/"][..],
        &[][..],
        &[""][..],
    ] {
        assert_eq!(
            ptr(tokens),
            PointerBuf::from_tokens(tokens.iter().copied()),
            "{tokens:?}"
        );
    }
    assert_eq!(
        ptr(&["metadata", "annotations", "a~b/c"]).to_string(),
        "/metadata/annotations/a~0b~1c"
    );
}

#[test]
fn absent_maps_are_added_whole() {
    let cfg = Config::default();
    let mut pod = base_pod();
    pod["metadata"]
        .as_object_mut()
        .expect("meta")
        .remove("annotations");
    pod["spec"]["containers"][0]
        .as_object_mut()
        .expect("container")
        .remove("resources");
    let inj = injected(decide(&pod, Some(&tdx()), &cfg));
    assert_eq!(
        serde_json::to_value(&inj.patch).expect("json"),
        json!([
            {"op": "add", "path": "/spec/containers/0/resources", "value": {
                "requests": {"tdx.intel.com/keys": "1"}, "limits": {"tdx.intel.com/keys": "1"}}},
            {"op": "add", "path": "/metadata/annotations", "value": {"misc-max.teeguard.dev/compute": "tdx 1"}}
        ])
    );
    apply(&pod, &inj.patch);

    // resources present but requests/limits absent.
    let mut pod = base_pod();
    pod["spec"]["containers"][0]["resources"] = json!({"limits": {"memory": "1Gi"}});
    let inj = injected(decide(&pod, Some(&tdx()), &cfg));
    let out = apply(&pod, &inj.patch);
    assert_eq!(
        out["spec"]["containers"][0]["resources"],
        json!({"requests": {"tdx.intel.com/keys": "1"}, "limits": {"memory": "1Gi", "tdx.intel.com/keys": "1"}})
    );

    // Empty maps take single keys.
    let mut pod = base_pod();
    pod["spec"]["containers"][0]["resources"] = json!({"requests": {}, "limits": {}});
    pod["metadata"]["annotations"] = json!({});
    let inj = injected(decide(&pod, Some(&tdx()), &cfg));
    let out = apply(&pod, &inj.patch);
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["limits"]["tdx.intel.com/keys"],
        "1"
    );
    assert_eq!(
        out["metadata"]["annotations"],
        json!({"misc-max.teeguard.dev/compute": "tdx 1"})
    );
}

#[test]
fn compute_is_found_by_name_not_index() {
    let mut pod = base_pod();
    let containers = pod["spec"]["containers"].as_array_mut().expect("array");
    containers.reverse();
    let inj = injected(decide(&pod, Some(&tdx()), &Config::default()));
    let out = apply(&pod, &inj.patch);
    assert_eq!(out["spec"]["containers"][1]["name"], "compute");
    assert_eq!(
        out["spec"]["containers"][1]["resources"]["limits"]["tdx.intel.com/keys"],
        "1"
    );
    assert!(out["spec"]["containers"][0].get("resources").is_none());
}

#[test]
fn reinvocation_is_idempotent() {
    for crio in [
        CrioAnnotation::None,
        CrioAnnotation::Legacy,
        CrioAnnotation::Current,
    ] {
        let mut cfg = Config::default();
        cfg.enforcement.crio_annotation = crio;
        let pod = base_pod();
        let first = injected(decide(&pod, Some(&tdx()), &cfg));
        assert!(!first.patch.0.is_empty());
        let patched = apply(&pod, &first.patch);
        let second = injected(decide(&patched, Some(&tdx()), &cfg));
        assert!(second.patch.0.is_empty(), "{crio:?}: {:?}", second.patch);
    }
}

#[test]
fn crio_annotations() {
    let mut cfg = Config::default();
    cfg.enforcement.crio_annotation = CrioAnnotation::Legacy;
    let out = apply(
        &base_pod(),
        &injected(decide(&base_pod(), Some(&tdx()), &cfg)).patch,
    );
    assert_eq!(
        out["metadata"]["annotations"]["io.kubernetes.cri-o.UnifiedCgroup.compute"],
        "misc.max=tdx 1"
    );
    assert_eq!(
        out["metadata"]["annotations"]["misc-max.teeguard.dev/compute"],
        "tdx 1"
    );

    cfg.enforcement.crio_annotation = CrioAnnotation::Current;
    cfg.enforcement.misc_max_annotation = false;
    let mut pod = base_pod();
    // Another unified entry is kept; a user-set misc.max is overwritten.
    pod["metadata"]["annotations"]["unified-cgroup.crio.io/compute"] =
        json!("memory.high=1073741824;misc.max=tdx 9");
    let inj = injected(decide(&pod, Some(&tdx()), &cfg));
    assert!(matches!(
        inj.patch.0.last(),
        Some(PatchOperation::Replace(_))
    ));
    let out = apply(&pod, &inj.patch);
    assert_eq!(
        out["metadata"]["annotations"]["unified-cgroup.crio.io/compute"],
        "memory.high=1073741824;misc.max=tdx 1"
    );
    assert!(
        out["metadata"]["annotations"]
            .get("misc-max.teeguard.dev/compute")
            .is_none()
    );
}

#[test]
fn user_set_misc_max_annotation_is_replaced() {
    let mut pod = base_pod();
    pod["metadata"]["annotations"]["misc-max.teeguard.dev/compute"] = json!("tdx 100");
    let inj = injected(decide(&pod, Some(&tdx()), &Config::default()));
    let out = apply(&pod, &inj.patch);
    assert_eq!(
        out["metadata"]["annotations"]["misc-max.teeguard.dev/compute"],
        "tdx 1"
    );
}

#[test]
fn crio_value_merging() {
    assert_eq!(crio_unified_value(None, "tdx 1"), "misc.max=tdx 1");
    assert_eq!(crio_unified_value(Some(""), "tdx 1"), "misc.max=tdx 1");
    assert_eq!(
        crio_unified_value(Some("a=1; misc.max=sev 3 ;b=2;misc.max=x;"), "tdx 1"),
        "a=1;misc.max=tdx 1;b=2"
    );
}

#[test]
fn keys_per_vm_and_resource_names_come_from_config() {
    let cfg = Config::from_yaml(
            "resources:\n  tdx:\n    resourceName: example.com/tdx\n    keysPerVm: 2\nenforcement:\n  crioAnnotation: legacy\n",
        )
        .expect("config");
    let out = apply(
        &base_pod(),
        &injected(decide(&base_pod(), Some(&tdx()), &cfg)).patch,
    );
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["requests"]["example.com/tdx"],
        "2"
    );
    assert_eq!(
        out["metadata"]["annotations"]["misc-max.teeguard.dev/compute"],
        "tdx 2"
    );
    assert_eq!(
        out["metadata"]["annotations"]["io.kubernetes.cri-o.UnifiedCgroup.compute"],
        "misc.max=tdx 2"
    );
}

#[test]
fn existing_equal_request_is_kept_different_is_denied() {
    let cfg = Config::default();
    let mut pod = base_pod();
    pod["spec"]["containers"][0]["resources"]["requests"]["tdx.intel.com/keys"] = json!("1");
    let inj = injected(decide(&pod, Some(&tdx()), &cfg));
    // Only the limit and the annotation are added.
    assert_eq!(inj.patch.0.len(), 2);
    let out = apply(&pod, &inj.patch);
    assert_eq!(
        out["spec"]["containers"][0]["resources"]["limits"]["tdx.intel.com/keys"],
        "1"
    );

    let mut pod = base_pod();
    pod["spec"]["containers"][0]["resources"]["limits"]["tdx.intel.com/keys"] = json!("2");
    let d = denied(decide(&pod, Some(&tdx()), &cfg));
    assert_eq!(d.reason, DenyReason::ConflictingRequest);
    assert!(!d.reason.retryable());
    assert!(
        d.message.contains("limits tdx.intel.com/keys: \"2\"") && d.message.contains("ns/vm1"),
        "{}",
        d.message
    );

    let mut pod = base_pod();
    pod["spec"]["containers"][0]["resources"]["requests"]["tdx.intel.com/keys"] = json!("500m");
    let d = denied(decide(&pod, Some(&tdx()), &cfg));
    assert_eq!(d.reason, DenyReason::BadQuantity);
}

#[test]
fn no_compute_container_is_denied() {
    let mut pod = base_pod();
    pod["spec"]["containers"][0]["name"] = json!("qemu");
    let d = denied(decide(&pod, Some(&tdx()), &Config::default()));
    assert_eq!(d.reason, DenyReason::NoComputeContainer);
    assert!(d.message.contains("\"compute\""), "{}", d.message);
}

#[test]
fn pod_skip_rules() {
    let cfg = Config::default();
    type Edit = Box<dyn Fn(&mut Value)>;
    let cases: Vec<(Edit, SkipReason)> = vec![
        (
            Box::new(|p| p["metadata"]["labels"]["teeguard.dev/exempt"] = json!("true")),
            SkipReason::ExemptPod,
        ),
        (
            Box::new(|p| {
                p["metadata"]["labels"]
                    .as_object_mut()
                    .expect("labels")
                    .remove("kubevirt.io");
            }),
            SkipReason::NotKubeVirt,
        ),
        (
            Box::new(|p| p["metadata"]["labels"]["kubevirt.io"] = json!("hotplug-disk")),
            SkipReason::Hotplug,
        ),
        (
            Box::new(|p| p["metadata"]["labels"]["kubevirt.io"] = json!("virt-exporter")),
            SkipReason::Export,
        ),
        (
            Box::new(|p| p["metadata"]["labels"]["kubevirt.io"] = json!("virt-handler")),
            SkipReason::NotVirtLauncher("virt-handler".into()),
        ),
        (
            Box::new(|p| {
                p["metadata"]["annotations"]["kubevirt.io/ephemeral-provisioning"] = json!("true")
            }),
            SkipReason::StorageBinding,
        ),
        (
            Box::new(|p| {
                p["metadata"]
                    .as_object_mut()
                    .expect("meta")
                    .remove("ownerReferences");
            }),
            SkipReason::NoVmiOwner,
        ),
        (
            Box::new(|p| p["metadata"]["ownerReferences"][0]["controller"] = json!(false)),
            SkipReason::NoVmiOwner,
        ),
        (
            Box::new(|p| p["metadata"]["ownerReferences"][0]["kind"] = json!("ReplicaSet")),
            SkipReason::NoVmiOwner,
        ),
        (
            Box::new(|p| {
                p["metadata"]["ownerReferences"][0]["apiVersion"] = json!("example.com/v1")
            }),
            SkipReason::NoVmiOwner,
        ),
    ];
    for (mutate, want) in cases {
        let mut pod = base_pod();
        mutate(&mut pod);
        // Skipped before the VMI matters: no lookup needed, even a failed one is ignored.
        assert_eq!(classify_pod(&pod_from(&pod)), Err(want.clone()));
        assert_eq!(skipped(decide(&pod, None, &cfg)), want);
        assert_eq!(
            skipped(decide(&pod, Some(&VmiLookup::Failed("down".into())), &cfg)),
            want
        );
    }
    // A non-"true" exempt value does not exempt; storage binding needs "true" too.
    let mut pod = base_pod();
    pod["metadata"]["labels"]["teeguard.dev/exempt"] = json!("false");
    pod["metadata"]["annotations"]["kubevirt.io/ephemeral-provisioning"] = json!("false");
    injected(decide(&pod, Some(&tdx()), &cfg));
}

#[test]
fn migration_target_gets_the_key() {
    let mut pod = base_pod();
    pod["metadata"]["labels"]["kubevirt.io/migrationJobUID"] = json!("mig-1");
    let inj = injected(decide(&pod, Some(&tdx()), &Config::default()));
    assert!(!inj.patch.0.is_empty());
}

#[test]
fn namespace_and_vmi_exemptions() {
    let cfg = Config::default();
    let pod = pod_from(&base_pod());
    let ns = BTreeMap::from([("teeguard.dev/exempt".to_string(), "true".to_string())]);
    assert_eq!(
        skipped(decide_mutation(&pod, None, Some(&ns), &cfg)),
        SkipReason::ExemptNamespace
    );
    let other = BTreeMap::from([("team".to_string(), "a".to_string())]);
    injected(decide_mutation(&pod, Some(&tdx()), Some(&other), &cfg));
    let exempt_vmi = VmiLookup::Found(vmi(
        json!({"tdx": {}}),
        json!({"teeguard.dev/exempt": "true"}),
    ));
    assert_eq!(
        skipped(decide_mutation(&pod, Some(&exempt_vmi), None, &cfg)),
        SkipReason::ExemptVmi
    );
}

#[test]
fn non_tee_vmis_are_skipped() {
    let cfg = Config::default();
    let plain = VmiLookup::Found(vmi(Value::Null, json!({})));
    assert_eq!(
        skipped(decide(&base_pod(), Some(&plain), &cfg)),
        SkipReason::NotTee
    );
    let s390x = VmiLookup::Found(vmi(json!({}), json!({})));
    assert_eq!(
        skipped(decide(&base_pod(), Some(&s390x), &cfg)),
        SkipReason::UnmanagedLaunchSecurity
    );
    let two = VmiLookup::Found(vmi(json!({"tdx": {}, "snp": {}}), json!({})));
    assert_eq!(
        denied(decide(&base_pod(), Some(&two), &cfg)).reason,
        DenyReason::ConflictingTeeKinds
    );
}

#[test]
fn missing_vmi_is_a_retryable_denial() {
    let cfg = Config::default();
    let d = denied(decide(&base_pod(), Some(&VmiLookup::NotFound), &cfg));
    assert_eq!(d.reason, DenyReason::VmiNotFound);
    assert!(d.reason.retryable());
    assert_eq!(
        d.message,
        "VirtualMachineInstance ns/vm1 not found yet; KubeVirt will retry creating the pod"
    );
    let d = denied(decide(
        &base_pod(),
        Some(&VmiLookup::Failed("timed out".into())),
        &cfg,
    ));
    assert_eq!(d.reason, DenyReason::VmiLookupFailed);
    assert!(
        d.message.contains("timed out") && d.message.contains("retry"),
        "{}",
        d.message
    );
    let d = denied(decide(&base_pod(), None, &cfg));
    assert_eq!(d.reason, DenyReason::VmiLookupFailed);

    // A VMI of the same name but another UID is not the owner.
    let mut other = (*vmi(json!({"tdx": {}}), json!({}))).clone();
    other.metadata.uid = Some("other-uid".into());
    let d = denied(decide(
        &base_pod(),
        Some(&VmiLookup::Found(Arc::new(other))),
        &cfg,
    ));
    assert_eq!(d.reason, DenyReason::VmiNotFound);
    assert!(d.message.contains("other-uid"), "{}", d.message);
}

#[test]
fn codes_are_distinct() {
    let skips = [
        SkipReason::ExemptPod,
        SkipReason::NotKubeVirt,
        SkipReason::NotVirtLauncher(String::new()),
        SkipReason::Hotplug,
        SkipReason::Export,
        SkipReason::StorageBinding,
        SkipReason::NoVmiOwner,
        SkipReason::ExemptNamespace,
        SkipReason::ExemptVmi,
        SkipReason::NotTee,
        SkipReason::UnmanagedLaunchSecurity,
    ];
    let codes: std::collections::BTreeSet<_> = skips.iter().map(|s| s.code()).collect();
    assert_eq!(codes.len(), skips.len());
}

#[test]
fn a_key_in_the_pod_overhead_is_the_vms_key_and_compute_gets_only_the_annotation() {
    let cfg = Config::default();
    let mut pod = base_pod();
    pod["spec"]["runtimeClassName"] = json!("kata-qemu-tdx");
    pod["spec"]["overhead"] = json!({"tdx.intel.com/keys": "1", "memory": "160Mi"});
    let inj = injected(decide(&pod, Some(&tdx()), &cfg));
    assert_eq!((inj.kind, inj.keys), (TeeKind::Tdx, 1));
    let out = apply(&pod, &inj.patch);
    assert_eq!(
        out["spec"]["containers"][0]["resources"], pod["spec"]["containers"][0]["resources"],
        "no second key on compute"
    );
    assert_eq!(
        out["metadata"]["annotations"]["misc-max.teeguard.dev/compute"],
        "tdx 1"
    );
    let again = injected(decide(&out, Some(&tdx()), &cfg));
    assert!(again.patch.0.is_empty(), "reinvocation adds nothing");
}

#[test]
fn an_overhead_key_of_another_amount_or_beside_a_compute_request_is_denied() {
    let cfg = Config::default();
    let mut two = base_pod();
    two["spec"]["runtimeClassName"] = json!("kata-qemu-tdx");
    two["spec"]["overhead"] = json!({"tdx.intel.com/keys": "2"});
    let d = denied(decide(&two, Some(&tdx()), &cfg));
    assert_eq!(d.reason, DenyReason::ConflictingRequest);
    assert!(
        d.message
            .contains("\"kata-qemu-tdx\" puts tdx.intel.com/keys: 2 in the pod overhead")
            && d.message.contains("counted once"),
        "{}",
        d.message
    );
    let mut both = base_pod();
    both["spec"]["overhead"] = json!({"tdx.intel.com/keys": "1"});
    both["spec"]["containers"][0]["resources"]["requests"]["tdx.intel.com/keys"] = json!("1");
    let d = denied(decide(&both, Some(&tdx()), &cfg));
    assert_eq!(d.reason, DenyReason::ConflictingRequest);
    assert!(
        d.message.contains("container \"compute\" requests another"),
        "{}",
        d.message
    );
    let mut half = base_pod();
    half["spec"]["overhead"] = json!({"tdx.intel.com/keys": "500m"});
    assert_eq!(
        denied(decide(&half, Some(&tdx()), &cfg)).reason,
        DenyReason::BadQuantity
    );
}
