//! The slim admission decode ([`AdmittedPod`]) against the full k8s-openapi `Pod`: on the committed
//! admission fixtures and on generated pods covering every field the decisions read, the slim pod must
//! equal the full pod projected onto the admitted fields, and every decision (classification, mutation
//! with its patch, key requests, node matching, cgroup-limit checks, display name) must be the same
//! whichever decode it was given. A decision that starts reading a field the slim type drops fails here.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use k8s_openapi::api::core::v1::{Affinity, Container, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde_json::{Value, json};
use teeguard_shared::Config;
use teeguard_shared::pod::{key_requests, pod_display_name};
use teeguard_shared::vmi::VirtualMachineInstance;
use teeguard_tests::fixtures::{self, KataTee, Tee, VirtLauncherPod};
use teeguard_webhook::decide::affinity::node_matches;
use teeguard_webhook::decide::mutation::runtime_class::{decide_runtime_class, tee_runtime_class};
use teeguard_webhook::decide::mutation::{VmiLookup, classify_pod, decide_mutation};
use teeguard_webhook::decide::validation::{
    check_created_limits, check_updated_limits, expected_limits, limit_annotations,
};
use teeguard_webhook::pods::admitted::AdmittedPod;
use teeguard_webhook::pods::decode::{read_annotation, read_label, read_resource};

fn slim(value: &Value) -> Pod {
    serde_json::from_value::<AdmittedPod>(value.clone())
        .expect("slim decode")
        .into_pod()
}

fn full(value: &Value) -> Pod {
    serde_json::from_value(value.clone()).expect("full decode")
}

/// The full pod with every field the slim type does not carry cleared.
fn project(pod: &Pod) -> Pod {
    let m = &pod.metadata;
    let resource_list = |l: &Option<BTreeMap<String, Quantity>>| {
        l.as_ref().map(|l| {
            l.iter()
                .filter(|(k, _)| read_resource(k))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
    };
    let container = |c: &Container| Container {
        name: c.name.clone(),
        resources: c.resources.as_ref().map(|r| ResourceRequirements {
            requests: resource_list(&r.requests),
            limits: resource_list(&r.limits),
            claims: None,
        }),
        restart_policy: c.restart_policy.clone(),
        ..Container::default()
    };
    Pod {
        metadata: ObjectMeta {
            name: m.name.clone(),
            generate_name: m.generate_name.clone(),
            namespace: m.namespace.clone(),
            uid: m.uid.clone(),
            labels: m.labels.as_ref().map(|l| {
                l.iter()
                    .filter(|(k, _)| read_label(k))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            }),
            annotations: m.annotations.as_ref().map(|a| {
                a.iter()
                    .filter(|(k, _)| read_annotation(k))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect()
            }),
            owner_references: m.owner_references.clone(),
            ..ObjectMeta::default()
        },
        spec: pod.spec.as_ref().map(|s| PodSpec {
            node_name: s.node_name.clone(),
            node_selector: s.node_selector.clone(),
            affinity: s.affinity.as_ref().map(|a| Affinity {
                node_affinity: a.node_affinity.clone(),
                ..Affinity::default()
            }),
            containers: s.containers.iter().map(container).collect(),
            init_containers: s
                .init_containers
                .as_ref()
                .map(|v| v.iter().map(container).collect()),
            overhead: resource_list(&s.overhead),
            runtime_class_name: s.runtime_class_name.clone(),
            ..PodSpec::default()
        }),
        status: None,
    }
}

fn vmi_lookups() -> Vec<Option<VmiLookup>> {
    let mut out = vec![
        None,
        Some(VmiLookup::NotFound),
        Some(VmiLookup::Failed("boom".into())),
    ];
    for tee in Tee::ALL {
        let vmi: VirtualMachineInstance =
            serde_json::from_value(fixtures::vmi(tee)).expect("fixture VMI decodes");
        out.push(Some(VmiLookup::Found(Arc::new(vmi))));
    }
    out
}

fn node_label_sets() -> Vec<(&'static str, BTreeMap<String, String>)> {
    let labels = |pairs: &[(&str, &str)]| {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect::<BTreeMap<_, _>>()
    };
    vec![
        ("node-a", labels(&[])),
        (
            "node-b",
            labels(&[
                ("intel.feature.node.kubernetes.io/tdx", "true"),
                ("zone", "a"),
            ]),
        ),
        (
            "node-c",
            labels(&[
                ("amd.feature.node.kubernetes.io/sev", "true"),
                ("amd.feature.node.kubernetes.io/snp", "true"),
                ("zone", "b"),
            ]),
        ),
    ]
}

/// Every decision on `value`, decoded fully and slim, must agree.
fn assert_same_decisions(what: &str, value: &Value) {
    let f = full(value);
    let s = slim(value);
    assert_eq!(
        project(&f),
        s,
        "{what}: slim decode differs from the projection"
    );
    let config = Config::default();
    assert_eq!(classify_pod(&f), classify_pod(&s), "{what}: classify_pod");
    assert_eq!(pod_display_name(&f), pod_display_name(&s), "{what}: name");
    assert_eq!(
        key_requests(&f, &config.resources).map_err(|e| e.to_string()),
        key_requests(&s, &config.resources).map_err(|e| e.to_string()),
        "{what}: key_requests"
    );
    assert_eq!(
        limit_annotations(&f),
        limit_annotations(&s),
        "{what}: limits"
    );
    assert_eq!(check_updated_limits(&f, &f), check_updated_limits(&s, &s));
    let ns_labels = [
        None,
        Some(BTreeMap::from([("team".to_string(), "a".to_string())])),
    ];
    for vmi in vmi_lookups() {
        for labels in &ns_labels {
            let df = decide_mutation(&f, vmi.as_ref(), labels.as_ref(), &config);
            let ds = decide_mutation(&s, vmi.as_ref(), labels.as_ref(), &config);
            assert_eq!(df, ds, "{what}: decide_mutation with {vmi:?}");
            let ef = expected_limits(&f, &df, &config);
            let es = expected_limits(&s, &ds, &config);
            assert_eq!(ef, es, "{what}: expected_limits");
            assert_eq!(
                check_created_limits(&f, &ef),
                check_created_limits(&s, &es),
                "{what}: check_created_limits"
            );
        }
    }
    // Pods of a TEE RuntimeClass (Kata's classes listed, as an operator would).
    let kata = Config::from_yaml(
        "admission:\n  teeRuntimeClasses:\n    kata-qemu-tdx: tdx\n    kata-qemu-snp: sevEs\n",
    )
    .expect("config");
    assert_eq!(
        tee_runtime_class(&f, &kata),
        tee_runtime_class(&s, &kata),
        "{what}: tee_runtime_class"
    );
    for labels in &ns_labels {
        assert_eq!(
            decide_runtime_class(&f, labels.as_ref(), &kata),
            decide_runtime_class(&s, labels.as_ref(), &kata),
            "{what}: decide_runtime_class"
        );
    }
    let empty = PodSpec::default();
    let (sf, ss) = (
        f.spec.as_ref().unwrap_or(&empty),
        s.spec.as_ref().unwrap_or(&empty),
    );
    for (name, labels) in node_label_sets() {
        assert_eq!(
            node_matches(sf, name, &labels),
            node_matches(ss, name, &labels),
            "{what}: node_matches {name}"
        );
    }
}

#[test]
fn committed_admission_fixtures_decide_the_same() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/admission");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("fixtures dir") {
        let path = entry.expect("entry").path();
        let review: Value =
            serde_json::from_slice(&std::fs::read(&path).expect("read fixture")).expect("json");
        let request = &review["request"];
        if request["kind"]["kind"] != "Pod" {
            continue;
        }
        for field in ["object", "oldObject"] {
            if request[field].is_object() {
                assert_same_decisions(&format!("{} {field}", path.display()), &request[field]);
                seen += 1;
            }
        }
    }
    assert!(seen >= 15, "only {seen} pod objects in {}", dir.display());
}

#[test]
fn generated_pods_decide_the_same() {
    let mut pods: Vec<(String, Value)> = Vec::new();
    for tee in Tee::ALL {
        let vmi = format!("{}-vm", tee.slug());
        pods.push((
            format!("{tee:?}"),
            VirtLauncherPod::for_tee(&vmi, tee).to_value(),
        ));
        pods.push((
            format!("{tee:?} large on a node with keys"),
            VirtLauncherPod::for_tee(&vmi, tee)
                .large()
                .node_name("node-b")
                .request("tdx.intel.com/keys", "1")
                .to_value(),
        ));
        pods.push((
            format!("{tee:?} migration target"),
            VirtLauncherPod::for_tee(&vmi, tee)
                .migration_target("node-a")
                .to_value(),
        ));
        pods.push((
            format!("{tee:?} exempt, forged limit"),
            VirtLauncherPod::for_tee(&vmi, tee)
                .exempt()
                .annotation("misc-max.teeguard.dev/compute", "1")
                .to_value(),
        ));
        pods.push((
            format!("{tee:?} storage binding"),
            fixtures::to_value(&fixtures::storage_binding_pod(&vmi, tee)),
        ));
    }
    pods.push((
        "hotplug".into(),
        fixtures::to_value(&fixtures::hotplug_pod("tdx-vm", "node-a")),
    ));
    pods.push((
        "export".into(),
        fixtures::to_value(&fixtures::export_pod("disk")),
    ));
    for tee in [KataTee::Tdx, KataTee::Snp] {
        pods.push((
            format!("kata {tee:?}"),
            fixtures::to_value(&fixtures::kata_pod("kata", tee)),
        ));
        // The RuntimeClass without the key in its overhead: the webhook adds a container request.
        let mut updated = fixtures::to_value(&fixtures::kata_pod("kata", tee));
        updated["spec"]["overhead"] = json!({"cpu": "1", "memory": "2Gi"});
        pods.push((
            format!("kata {tee:?}, no key in the overhead"),
            updated.clone(),
        ));
        // Its first container without resources, another with a key in an init container.
        let mut bare = updated.clone();
        bare["spec"]["containers"][0]
            .as_object_mut()
            .expect("container")
            .remove("resources");
        pods.push((format!("kata {tee:?}, no resources"), bare));
        let mut init = updated;
        init["spec"]["initContainers"] = json!([{"name": "init", "image": "i", "resources": {"limits": {tee.key_resource(): "1"}}}]);
        pods.push((format!("kata {tee:?}, key in an init container"), init));
    }
    // Selector, required node affinity (expressions and fields), init and sidecar containers,
    // overhead, explicit nulls: the scheduling and key-request fields the fixtures leave out.
    let mut custom = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx).to_value();
    custom["spec"]["nodeSelector"] = json!({"zone": "a"});
    custom["spec"]["affinity"] = json!({
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "intel.feature.node.kubernetes.io/tdx", "operator": "In", "values": ["true"]}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-c"]}]}
        ]}},
        "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
            {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "x"}}}
        ]}
    });
    custom["spec"]["initContainers"] = json!([
        {"name": "init", "image": "i", "resources": {"limits": {"tdx.intel.com/keys": "1"}}},
        {"name": "sidecar", "image": "s", "restartPolicy": "Always",
         "resources": {"requests": {"tdx.intel.com/keys": "1"}, "limits": {"tdx.intel.com/keys": "1"}}}
    ]);
    custom["spec"]["overhead"] = json!({"tdx.intel.com/keys": "1", "memory": "160Mi"});
    custom["metadata"]["managedFields"] = json!([{"manager": "virt-controller", "operation": "Update",
        "apiVersion": "v1", "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:labels": {}}}}]);
    pods.push(("selector, affinity, init, overhead".into(), custom.clone()));
    let mut nulls = custom;
    nulls["spec"]["nodeSelector"] = Value::Null;
    nulls["spec"]["affinity"] = Value::Null;
    nulls["spec"]["initContainers"] = Value::Null;
    nulls["metadata"]["annotations"] = Value::Null;
    pods.push(("explicit nulls".into(), nulls));
    pods.push(("no spec".into(), json!({"metadata": {"name": "bare"}})));
    for (what, value) in &pods {
        assert_same_decisions(what, value);
    }
}

#[test]
fn updated_limits_compare_the_same() {
    let old = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
        .annotation("misc-max.teeguard.dev/compute", "1")
        .to_value();
    let new = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
        .annotation("misc-max.teeguard.dev/compute", "4")
        .to_value();
    let by_full = check_updated_limits(&full(&old), &full(&new));
    assert!(by_full.is_some(), "changing a limit annotation is refused");
    assert_eq!(by_full, check_updated_limits(&slim(&old), &slim(&new)));
}

#[test]
fn bad_objects_are_errors_in_both_decodes() {
    for bad in [
        json!({"metadata": {"labels": ["not", "a", "map"]}}),
        json!({"metadata": {"name": 5}}),
        json!({"metadata": {"annotations": ["a"]}}),
        json!({"metadata": {"annotations": {"misc-max.teeguard.dev/compute": 1}}}),
        json!({"spec": {"containers": [{"name": "compute", "resources": {"limits": {"example.com/x": {}}}}]}}),
        json!({"spec": {"overhead": {"example.com/x": []}}}),
        json!({"spec": {"containers": "compute"}}),
        json!({"spec": {"nodeSelector": {"zone": 1}}}),
        json!([1, 2]),
    ] {
        assert!(serde_json::from_value::<Pod>(bad.clone()).is_err(), "{bad}");
        assert!(
            serde_json::from_value::<AdmittedPod>(bad.clone()).is_err(),
            "{bad}"
        );
    }
}

/// Resource lists keep extended resources outside KubeVirt's device-plugin domain: the TEE key names
/// (whatever the configuration says, since it cannot name a `devices.kubevirt.io` resource) and
/// anything else under a vendor domain; the device plugins' devices every virt-launcher pod requests
/// are skipped with `cpu` and `memory`.
#[test]
fn resource_lists_keep_extended_resources_outside_kubevirt_devices() {
    let pod: AdmittedPod = serde_json::from_value(json!({"spec": {
        "containers": [{"name": "compute", "resources": {
            "requests": {"cpu": "1", "memory": "1Gi", "devices.kubevirt.io/kvm": "1",
                         "devices.kubevirt.io/tdx": "1", "tdx.intel.com/keys": "1", "example.com/x": "2"},
            "limits": {"devices.kubevirt.io/vhost-net": "1"}}}],
        "overhead": {"memory": "160Mi", "sev-snp.amd.com/esids": "1", "devices.kubevirt.io/sev": "1"}
    }}))
    .expect("decode");
    let spec = pod.spec.expect("spec");
    let res = spec.containers[0].resources.as_ref().expect("resources");
    let keys = |m: &Option<BTreeMap<String, Quantity>>| -> Vec<String> {
        m.iter().flatten().map(|(k, _)| k.clone()).collect()
    };
    assert_eq!(keys(&res.requests), ["example.com/x", "tdx.intel.com/keys"]);
    assert_eq!(
        keys(&res.limits),
        Vec::<String>::new(),
        "a map, even emptied"
    );
    assert!(res.limits.is_some());
    assert_eq!(keys(&spec.overhead), ["sev-snp.amd.com/esids"]);
    for (name, kept) in [
        ("tdx.intel.com/keys", true),
        ("kubevirt.io/keys", true),
        ("devices.kubevirt.io/tdx", false),
        ("cpu", false),
        ("hugepages-2Mi", false),
    ] {
        assert_eq!(read_resource(name), kept, "{name}");
    }
}

/// Fields and keys the decisions never read are skipped without being interpreted (the API server
/// decodes objects into typed structs before admission, so it never sends such values).
#[test]
fn unread_keys_are_not_interpreted() {
    for odd in [
        json!({"metadata": {"labels": {"app": 1}}}),
        json!({"metadata": {"annotations": {"other": []}}}),
        json!({"spec": {"containers": [{"name": "compute", "resources": {"limits": {"cpu": {}}, "claims": 7}}]}}),
        json!({"spec": {"overhead": {"memory": null}}}),
    ] {
        assert!(
            serde_json::from_value::<AdmittedPod>(odd.clone()).is_ok(),
            "{odd}"
        );
    }
}

// ---- one pass over the body (AdmittedReview) vs the envelope then the object ----

fn body(review: &Value) -> Vec<u8> {
    serde_json::to_vec(review).expect("json")
}

/// The objects of every committed fixture, read in one pass, equal the two-pass reading.
#[test]
fn single_pass_reads_the_same_objects_as_two_passes() {
    use teeguard_webhook::web::admission::ReviewRequest;
    use teeguard_webhook::web::admitted::AdmittedReview;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/admission");
    let mut bindings = 0;
    for entry in std::fs::read_dir(&dir).expect("fixtures dir") {
        let path = entry.expect("entry").path();
        let bytes = std::fs::read(&path).expect("read fixture");
        let mut one = AdmittedReview::parse(&bytes).expect("one pass");
        assert!(one.single_pass(), "{}", path.display());
        let two = ReviewRequest::parse(&bytes).expect("two passes");
        assert_eq!(one.request.uid, two.uid);
        assert_eq!(one.request.operation, two.operation);
        assert_eq!(one.request.name, two.name);
        assert_eq!(one.request.sub_resource, two.sub_resource);
        let what = path.display().to_string();
        if two.sub_resource == "binding" {
            bindings += 1;
            let b = one.binding().expect("binding");
            let want: k8s_openapi::api::core::v1::Binding = two.object().expect("binding");
            assert_eq!(b.target, want.target, "{what}");
            assert_eq!(b.metadata.name, want.metadata.name, "{what}");
            assert_eq!(b.metadata.uid, want.metadata.uid, "{what}");
            continue;
        }
        if two.raw_object().is_some() {
            let want = two.object::<AdmittedPod>().expect("pod").into_pod();
            assert_eq!(*one.pod().expect("pod"), want, "{what}");
        } else {
            assert!(one.pod().is_err(), "{what}");
        }
        if let Ok(old) = two.old_object::<AdmittedPod>() {
            assert_eq!(*one.old_pod().expect("old pod"), old.into_pod(), "{what}");
        }
    }
    assert!(bindings > 0, "no binding fixture");
}

/// When the one pass fails, the envelope alone is parsed: errors keep the two-pass message, and an
/// object of another shape does not fail a request that never reads it.
#[test]
fn fallback_keeps_precise_errors_and_skips() {
    use teeguard_webhook::web::admitted::AdmittedReview;
    let pod = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx).to_value();
    let review = |object: Value| {
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
            "uid": "u1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": "CREATE", "object": object}})
    };
    // A pod whose container list is not a list: the one pass fails, the message names the object.
    let mut bad = pod.clone();
    bad["spec"]["containers"] = json!("compute");
    let b = body(&review(bad));
    let mut r = AdmittedReview::parse(&b).expect("envelope still parses");
    assert!(!r.single_pass());
    let err = r.pod().expect_err("bad pod").to_string();
    assert!(err.contains("request.object is not a valid Pod"), "{err}");
    // Missing object: same message in both paths.
    let none = review(Value::Null);
    let b = body(&none);
    let mut r = AdmittedReview::parse(&b).expect("parse");
    assert!(r.single_pass());
    assert!(
        r.pod()
            .expect_err("missing")
            .to_string()
            .contains("request.object is missing")
    );
    // An object of another kind with an odd `spec` still parses (its envelope is good).
    let mut crd = review(json!({"metadata": {"name": "x"}, "spec": {"containers": {"a": 1}}}));
    crd["request"]["resource"]["resource"] = json!("widgets");
    let b = body(&crd);
    let r = AdmittedReview::parse(&b).expect("parse");
    assert!(!r.single_pass());
    assert_eq!(r.request.resource.resource, "widgets");
    // A binding without target.
    let mut binding = review(json!({"metadata": {"name": "virt-launcher-x"}}));
    binding["request"]["subResource"] = json!("binding");
    let b = body(&binding);
    let mut r = AdmittedReview::parse(&b).expect("parse");
    let err = r.binding().expect_err("no target").to_string();
    assert!(
        err.contains("not a valid Binding") && err.contains("target"),
        "{err}"
    );
    // Bad envelopes are still the envelope's errors.
    for (bad, want) in [
        (b"{".to_vec(), "invalid JSON"),
        (
            br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{}}"#
                .to_vec(),
            "v1beta1",
        ),
        (
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#.to_vec(),
            "request is missing",
        ),
    ] {
        let err = AdmittedReview::parse(&bad)
            .expect_err("bad envelope")
            .to_string();
        assert!(err.contains(want), "{err}");
    }
}

/// The server decodes from bytes, where a key with escapes is handed over from the parser's scratch
/// buffer instead of borrowed: kept keys must still be kept (unescaped), skipped ones dropped, and
/// kept values may carry escapes too.
#[test]
fn escaped_label_and_annotation_keys_decode_from_bytes() {
    let body = br#"{"metadata": {
        "labels": {"kubevirt\u002eio": "virt-\u006cauncher", "app\u002fname": "x", "teeguard.dev/exempt": "true"},
        "annotations": {"misc-max.teeguard.dev\/compute": "tdx 1", "k8s.v1.cni\u002ecncf.io/network-status": "[]"}
    }}"#;
    let pod = serde_json::from_slice::<AdmittedPod>(body)
        .expect("slim decode")
        .into_pod();
    let labels = pod.metadata.labels.expect("labels");
    assert_eq!(
        labels,
        BTreeMap::from([
            ("kubevirt.io".to_string(), "virt-launcher".to_string()),
            ("teeguard.dev/exempt".to_string(), "true".to_string()),
        ])
    );
    let annotations = pod.metadata.annotations.expect("annotations");
    assert_eq!(
        annotations,
        BTreeMap::from([(
            "misc-max.teeguard.dev/compute".to_string(),
            "tdx 1".to_string()
        )])
    );
    // A map whose keys were all skipped is still a map (the patch's shape depends on it).
    let only_skipped = br#"{"metadata": {"labels": {"a": "b"}, "annotations": {"c": "d"}}}"#;
    let meta = serde_json::from_slice::<AdmittedPod>(only_skipped)
        .expect("slim decode")
        .metadata;
    assert_eq!(meta.labels, Some(BTreeMap::new()));
    assert_eq!(meta.annotations, Some(BTreeMap::new()));
    // A kept key with a non-string value is an error, a skipped one is not read.
    let bad = br#"{"metadata": {"labels": {"kubevirt.io": 7}}}"#;
    assert!(serde_json::from_slice::<AdmittedPod>(bad).is_err());
    let skipped = br#"{"metadata": {"labels": {"other": 7}}}"#;
    assert!(serde_json::from_slice::<AdmittedPod>(skipped).is_ok());
}

/// The pod cache's reduction (`CachedLauncherPod`) keeps what the mutation's classification reads: a
/// cached virt-launcher pod classifies as the full one.
#[test]
fn cached_launcher_pods_classify_as_the_full_pod() {
    let json = serde_json::json!({
        "metadata": {"name": "virt-launcher-vm-abcde", "namespace": "ns", "uid": "u1",
            "resourceVersion": "9", "generateName": "virt-launcher-vm-",
            "labels": {"kubevirt.io": "virt-launcher", "kubevirt.io/vm": "vm",
                "teeguard.dev/exempt": "false"},
            "annotations": {"kubevirt.io/domain": "vm", "x": "y"},
            "ownerReferences": [
                {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "name": "vm",
                 "uid": "vmi-uid", "controller": true}]},
        "spec": {"containers": [
            {"name": "compute", "resources": {"requests": {"tdx.intel.com/keys": "1"}}}]}
    });
    let before: Pod = serde_json::from_value(json.clone()).expect("pod");
    let full: teeguard_webhook::pods::LauncherPod =
        serde_json::from_value(json).expect("launcher pod");
    let after = teeguard_webhook::pods::CachedLauncherPod::from(full).to_pod();
    let classified = teeguard_webhook::decide::mutation::classify_pod(&after);
    assert!(classified.is_ok(), "{classified:?}");
    assert_eq!(
        classified,
        teeguard_webhook::decide::mutation::classify_pod(&before)
    );
}
