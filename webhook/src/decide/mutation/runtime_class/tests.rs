//! Tests of the TEE RuntimeClass decision and its patch.

use super::*;
use pretty_assertions::assert_eq;
use serde_json::{Value, json};

const TDX: &str = "tdx.intel.com/keys";
const ESIDS: &str = "sev-snp.amd.com/esids";
const ASIDS: &str = "sev.amd.com/asids";

fn config(yaml: &str) -> Config {
    Config::from_yaml(yaml).expect("config")
}

/// Kata's three TEE classes listed.
fn kata_config() -> Config {
    config(
        "admission:\n  teeRuntimeClasses:\n    kata-qemu-tdx: tdx\n    kata-qemu-snp: sevEs\n    kata-qemu-sev: sev\n",
    )
}

/// A pod as a Deployment creates it: one app container with cpu/memory, a sidecar, no overhead.
fn kata_pod(class: &str) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"generateName": "web-", "namespace": "ns", "labels": {"app": "web"}},
        "spec": {
            "runtimeClassName": class,
            "containers": [
                {"name": "app", "image": "nginx", "resources": {
                    "requests": {"cpu": "250m", "memory": "128Mi"},
                    "limits": {"cpu": "500m", "memory": "256Mi"}
                }},
                {"name": "sidecar", "image": "envoy"}
            ]
        }
    })
}

fn pod_from(v: &Value) -> Pod {
    serde_json::from_value(v.clone()).expect("pod")
}

fn decide(v: &Value, cfg: &Config) -> RuntimeClassDecision {
    decide_runtime_class(&pod_from(v), None, cfg)
}

fn apply(v: &Value, patch: &Patch) -> Value {
    let mut doc = v.clone();
    json_patch::patch(&mut doc, &patch.0).expect("patch applies");
    doc
}

fn injected(d: RuntimeClassDecision) -> RuntimeClassInjection {
    match d {
        RuntimeClassDecision::Inject(i) => i,
        other => panic!("expected an injection, got {other:?}"),
    }
}

/// What a decision did, for the table: the resources and amounts the first container requests and
/// limits after the patch (empty when untouched), the skip code, or the overhead warning.
#[derive(Debug, PartialEq)]
enum Seen {
    Added { requests: Value, limits: Value },
    Skipped(&'static str),
    Warned,
}

fn seen(pod: &Value, d: &RuntimeClassDecision) -> Seen {
    match d {
        RuntimeClassDecision::Inject(i) => {
            let out = apply(pod, &i.patch);
            let _: Pod = serde_json::from_value(out.clone()).expect("the patched pod is a Pod");
            let r = &out["spec"]["containers"][0]["resources"];
            Seen::Added {
                requests: r["requests"].clone(),
                limits: r["limits"].clone(),
            }
        }
        RuntimeClassDecision::Skip(s) => Seen::Skipped(s.code()),
        RuntimeClassDecision::OverheadKey(_) => Seen::Warned,
    }
}

/// The table of the brief: what each kind of pod gets.
#[test]
fn which_pods_get_the_key_request() {
    let cfg = kata_config();
    let none_listed = Config::default();
    let two_keys = config(
        "resources:\n  tdx: {resourceName: tdx.example.com/hkids, keysPerVm: 2}\nadmission:\n  teeRuntimeClasses:\n    kata-qemu-tdx: tdx\n",
    );
    let app_resources = |extra: Value| {
        let mut requests = json!({"cpu": "250m", "memory": "128Mi"});
        let mut limits = json!({"cpu": "500m", "memory": "256Mi"});
        for (k, v) in extra.as_object().expect("map") {
            requests[k] = v.clone();
            limits[k] = v.clone();
        }
        Seen::Added { requests, limits }
    };
    let with = |class: &str, edit: &dyn Fn(&mut Value)| {
        let mut p = kata_pod(class);
        edit(&mut p);
        p
    };
    let cases: Vec<(&str, Value, &Config, Seen)> = vec![
        (
            "listed TDX class, no request: requests and limits added",
            kata_pod("kata-qemu-tdx"),
            &cfg,
            app_resources(json!({TDX: "1"})),
        ),
        (
            "listed SNP class: its own resource",
            kata_pod("kata-qemu-snp"),
            &cfg,
            app_resources(json!({ESIDS: "1"})),
        ),
        (
            "listed plain SEV class: its own resource",
            kata_pod("kata-qemu-sev"),
            &cfg,
            app_resources(json!({ASIDS: "1"})),
        ),
        (
            "keysPerVm 2 and the configured resource name",
            kata_pod("kata-qemu-tdx"),
            &two_keys,
            app_resources(json!({"tdx.example.com/hkids": "2"})),
        ),
        (
            "class not listed",
            kata_pod("kata-qemu"),
            &cfg,
            Seen::Skipped("runtime-class-not-listed"),
        ),
        (
            "no runtimeClassName",
            with("-", &|p| {
                p["spec"]
                    .as_object_mut()
                    .expect("spec")
                    .remove("runtimeClassName");
            }),
            &cfg,
            Seen::Skipped("runtime-class-not-listed"),
        ),
        (
            "nothing listed (the default configuration)",
            kata_pod("kata-qemu-tdx"),
            &none_listed,
            Seen::Skipped("runtime-class-not-listed"),
        ),
        (
            "the first container already requests the key",
            with("kata-qemu-tdx", &|p| {
                p["spec"]["containers"][0]["resources"]["requests"][TDX] = json!("1");
            }),
            &cfg,
            Seen::Skipped("key-already-requested"),
        ),
        (
            "another container only limits the key",
            with("kata-qemu-tdx", &|p| {
                p["spec"]["containers"][1]["resources"] = json!({"limits": {TDX: "1"}});
            }),
            &cfg,
            Seen::Skipped("key-already-requested"),
        ),
        (
            "a container requests another kind's key",
            with("kata-qemu-tdx", &|p| {
                p["spec"]["containers"][1]["resources"] = json!({"requests": {ESIDS: "1"}});
            }),
            &cfg,
            Seen::Skipped("key-already-requested"),
        ),
        (
            "a container requests zero keys (explicitly none)",
            with("kata-qemu-tdx", &|p| {
                p["spec"]["containers"][0]["resources"]["requests"][TDX] = json!("0");
            }),
            &cfg,
            Seen::Skipped("key-already-requested"),
        ),
        (
            "only an init container requests the key",
            with("kata-qemu-tdx", &|p| {
                p["spec"]["initContainers"] = json!([{"name": "init", "image": "busybox", "resources": {"requests": {TDX: "1"}}}]);
            }),
            &cfg,
            Seen::Skipped("key-already-requested"),
        ),
        (
            "an init container without a key does not count",
            with("kata-qemu-tdx", &|p| {
                p["spec"]["initContainers"] = json!([{"name": "init", "image": "busybox"}]);
            }),
            &cfg,
            app_resources(json!({TDX: "1"})),
        ),
        (
            "the overhead carries the key (RuntimeClass not updated)",
            with("kata-qemu-tdx", &|p| {
                p["spec"]["overhead"] = json!({"cpu": "1", "memory": "2Gi", TDX: "1"});
            }),
            &cfg,
            Seen::Warned,
        ),
        (
            "the overhead carries another kind's key",
            with("kata-qemu-tdx", &|p| {
                p["spec"]["overhead"] = json!({ESIDS: "1"});
            }),
            &cfg,
            Seen::Warned,
        ),
        (
            "an overhead without a key does not count",
            with("kata-qemu-tdx", &|p| {
                p["spec"]["overhead"] = json!({"cpu": "1", "memory": "2Gi"});
            }),
            &cfg,
            app_resources(json!({TDX: "1"})),
        ),
        (
            "exempt pod",
            with("kata-qemu-tdx", &|p| {
                p["metadata"]["labels"][names::EXEMPT_LABEL] = json!("true");
            }),
            &cfg,
            Seen::Skipped("exempt-pod"),
        ),
        (
            "exempt label set to something else",
            with("kata-qemu-tdx", &|p| {
                p["metadata"]["labels"][names::EXEMPT_LABEL] = json!("false");
            }),
            &cfg,
            app_resources(json!({TDX: "1"})),
        ),
        (
            "a KubeVirt pod in a listed class: the virt-launcher rules decide it",
            with("kata-qemu-tdx", &|p| {
                p["metadata"]["labels"][names::KUBEVIRT_LABEL] = json!("virt-launcher");
            }),
            &cfg,
            Seen::Skipped("kubevirt-pod"),
        ),
        (
            "no container",
            with("kata-qemu-tdx", &|p| p["spec"]["containers"] = json!([])),
            &cfg,
            Seen::Skipped("no-container"),
        ),
    ];
    for (what, pod, cfg, want) in cases {
        let d = decide(&pod, cfg);
        assert_eq!(seen(&pod, &d), want, "{what}: {d:?}");
        // Only the first container is touched.
        if let RuntimeClassDecision::Inject(i) = &d {
            let out = apply(&pod, &i.patch);
            assert_eq!(
                out["spec"]["containers"][1], pod["spec"]["containers"][1],
                "{what}"
            );
            assert_eq!(out["metadata"], pod["metadata"], "{what}");
            assert_eq!(i.container, "app", "{what}");
        }
    }
}

#[test]
fn injection_names_class_kind_resource_and_keys() {
    let cfg = kata_config();
    let i = injected(decide(&kata_pod("kata-qemu-snp"), &cfg));
    assert_eq!(
        (
            i.runtime_class.as_str(),
            i.kind,
            i.resource.as_str(),
            i.keys
        ),
        ("kata-qemu-snp", TeeKind::SevEs, ESIDS, 1)
    );
}

#[test]
fn overhead_key_warning_names_the_class_and_what_to_do() {
    let cfg = kata_config();
    let mut pod = kata_pod("kata-qemu-tdx");
    pod["spec"]["overhead"] = json!({"cpu": "1", TDX: "1"});
    // Also when a container requests a key: the overhead key is still not served on DRA nodes.
    pod["spec"]["containers"][0]["resources"]["requests"][TDX] = json!("1");
    let RuntimeClassDecision::OverheadKey(o) = decide(&pod, &cfg) else {
        panic!("expected the overhead warning");
    };
    assert_eq!(o.runtime_class, "kata-qemu-tdx");
    assert_eq!(o.kind, TeeKind::Tdx);
    assert_eq!(o.resources, [TDX]);
    for want in [
        "RuntimeClass kata-qemu-tdx",
        "overhead.podFixed",
        "DRA",
        "Remove tdx.intel.com/keys",
        "teeguard then adds the key as a request of the pod's first container",
    ] {
        assert!(o.warning.contains(want), "{want:?} missing: {}", o.warning);
    }
}

#[test]
fn exempt_namespace_is_skipped() {
    let cfg = kata_config();
    let exempt = BTreeMap::from([(names::EXEMPT_LABEL.to_string(), "true".to_string())]);
    let other = BTreeMap::from([("team".to_string(), "a".to_string())]);
    let pod = pod_from(&kata_pod("kata-qemu-tdx"));
    assert_eq!(
        decide_runtime_class(&pod, Some(&exempt), &cfg),
        RuntimeClassDecision::Skip(RuntimeClassSkip::ExemptNamespace)
    );
    injected(decide_runtime_class(&pod, Some(&other), &cfg));
}

/// The patch is a correct RFC 6902 patch whatever maps exist, with `/` in the resource escaped.
#[test]
fn patch_shapes_and_escaping() {
    let cfg = kata_config();
    let cases = [
        (
            "no resources",
            json!({"name": "app", "image": "nginx"}),
            json!([{"op": "add", "path": "/spec/containers/0/resources",
                    "value": {"requests": {TDX: "1"}, "limits": {TDX: "1"}}}]),
        ),
        (
            "empty resources",
            json!({"name": "app", "image": "nginx", "resources": {}}),
            json!([
                {"op": "add", "path": "/spec/containers/0/resources/requests", "value": {TDX: "1"}},
                {"op": "add", "path": "/spec/containers/0/resources/limits", "value": {TDX: "1"}}
            ]),
        ),
        (
            "requests only",
            json!({"name": "app", "image": "nginx", "resources": {"requests": {"cpu": "1"}}}),
            json!([
                {"op": "add", "path": "/spec/containers/0/resources/requests/tdx.intel.com~1keys", "value": "1"},
                {"op": "add", "path": "/spec/containers/0/resources/limits", "value": {TDX: "1"}}
            ]),
        ),
        (
            "limits only",
            json!({"name": "app", "image": "nginx", "resources": {"limits": {"memory": "1Gi"}}}),
            json!([
                {"op": "add", "path": "/spec/containers/0/resources/requests", "value": {TDX: "1"}},
                {"op": "add", "path": "/spec/containers/0/resources/limits/tdx.intel.com~1keys", "value": "1"}
            ]),
        ),
        (
            "both maps",
            json!({"name": "app", "image": "nginx", "resources": {"requests": {"cpu": "1"}, "limits": {"cpu": "1"}}}),
            json!([
                {"op": "add", "path": "/spec/containers/0/resources/requests/tdx.intel.com~1keys", "value": "1"},
                {"op": "add", "path": "/spec/containers/0/resources/limits/tdx.intel.com~1keys", "value": "1"}
            ]),
        ),
    ];
    for (what, container, want) in cases {
        let mut pod = kata_pod("kata-qemu-tdx");
        pod["spec"]["containers"][0] = container;
        let i = injected(decide(&pod, &cfg));
        assert_eq!(
            serde_json::to_value(&i.patch).expect("json"),
            want,
            "{what}"
        );
        let out = apply(&pod, &i.patch);
        let r = &out["spec"]["containers"][0]["resources"];
        assert_eq!(
            (&r["requests"][TDX], &r["limits"][TDX]),
            (&json!("1"), &json!("1")),
            "{what}"
        );
        // Applied once, the pod asks for its key: a reinvocation adds nothing.
        assert_eq!(
            decide(&out, &cfg),
            RuntimeClassDecision::Skip(RuntimeClassSkip::KeyAlreadyRequested),
            "{what}: reinvocation"
        );
    }
}

#[test]
fn tee_runtime_class_reads_the_listed_classes() {
    let cfg = kata_config();
    let pod = pod_from(&kata_pod("kata-qemu-snp"));
    assert_eq!(
        tee_runtime_class(&pod, &cfg),
        Some(("kata-qemu-snp", TeeKind::SevEs))
    );
    assert_eq!(tee_runtime_class(&pod, &Config::default()), None);
    assert_eq!(tee_runtime_class(&pod_from(&kata_pod("runc")), &cfg), None);
}

#[test]
fn skip_codes_are_distinct() {
    let all = [
        RuntimeClassSkip::ExemptPod,
        RuntimeClassSkip::KubeVirtPod,
        RuntimeClassSkip::NotListed,
        RuntimeClassSkip::ExemptNamespace,
        RuntimeClassSkip::KeyAlreadyRequested,
        RuntimeClassSkip::NoContainer,
    ];
    let codes: std::collections::BTreeSet<&str> = all.iter().map(RuntimeClassSkip::code).collect();
    assert_eq!(codes.len(), all.len());
}
