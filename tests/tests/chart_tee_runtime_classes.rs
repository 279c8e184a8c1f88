//! The chart's webhook entries for pods of a TEE RuntimeClass (`config.admission.teeRuntimeClasses`):
//! rendered only when the list is not empty, one mutating and one validating entry that reach exactly
//! the non-KubeVirt, non-exempt pods of a listed RuntimeClass (objectSelector and a matchConditions CEL
//! expression), with the same policies, timeouts, namespaces and client as the virt-launcher entries.
//! The API server's own check of the CEL expression is in `cluster_runtime_classes.rs`.

mod chart_support;

use chart_support::{all, only, render, str_at, validate};
use serde_json::{Value, json};
use teeguard_shared::{Config, TeeKind};

const MUTATE: &str = "mutate.runtimeclass-pods.teeguard.dev";
const VALIDATE: &str = "validate.runtimeclass-pods.teeguard.dev";
const CLASSES: &str =
    r#"config.admission.teeRuntimeClasses={"kata-qemu-tdx":"tdx","kata-qemu-snp":"sevEs"}"#;

fn webhook<'a>(config: &'a Value, name: &str) -> Option<&'a Value> {
    config["webhooks"]
        .as_array()
        .expect("webhooks")
        .iter()
        .find(|w| w["name"] == name)
}

fn names(config: &Value) -> Vec<&str> {
    config["webhooks"]
        .as_array()
        .expect("webhooks")
        .iter()
        .map(|w| w["name"].as_str().expect("name"))
        .collect()
}

#[test]
fn no_runtime_class_entries_without_listed_classes() {
    for extra in [
        &[][..],
        &["--set-json", "config.admission.teeRuntimeClasses={}"][..],
    ] {
        let docs = render("default", extra);
        let mutating = only(&docs, "MutatingWebhookConfiguration");
        let validating = only(&docs, "ValidatingWebhookConfiguration");
        assert_eq!(names(mutating), ["mutate.pods.teeguard.dev"], "{extra:?}");
        assert!(
            webhook(validating, VALIDATE).is_none(),
            "{extra:?}: {:?}",
            names(validating)
        );
    }
}

#[test]
fn listed_classes_get_a_mutating_and_a_validating_entry() {
    let docs = render("default", &["--set-json", CLASSES]);
    validate("default values with teeRuntimeClasses", &docs);
    let mutating = only(&docs, "MutatingWebhookConfiguration");
    let validating = only(&docs, "ValidatingWebhookConfiguration");
    assert_eq!(names(mutating), ["mutate.pods.teeguard.dev", MUTATE]);
    assert_eq!(
        names(validating),
        [
            "validate.pods.teeguard.dev",
            VALIDATE,
            "validate.limits.teeguard.dev",
            "validate.bindings.teeguard.dev"
        ]
    );
    let selector = json!({"matchExpressions": [
        {"key": "kubevirt.io", "operator": "DoesNotExist"},
        {"key": "teeguard.dev/exempt", "operator": "NotIn", "values": ["true"]},
    ]});
    // The class names sorted, as a CEL list of strings.
    let condition = json!([{
        "name": "tee-runtime-class",
        "expression": r#"has(object.spec.runtimeClassName) && object.spec.runtimeClassName in ["kata-qemu-snp","kata-qemu-tdx"]"#,
    }]);
    for (config, name, like, path) in [
        (mutating, MUTATE, "mutate.pods.teeguard.dev", "/mutate"),
        (
            validating,
            VALIDATE,
            "validate.pods.teeguard.dev",
            "/validate",
        ),
    ] {
        let w = webhook(config, name).expect("entry");
        let vl = webhook(config, like).expect("virt-launcher entry");
        assert_eq!(str_at(w, "/clientConfig/service/path"), path, "{name}");
        // Same client, policies and namespaces as the virt-launcher entry.
        for field in [
            "admissionReviewVersions",
            "sideEffects",
            "failurePolicy",
            "timeoutSeconds",
            "matchPolicy",
            "clientConfig",
            "rules",
            "namespaceSelector",
            "reinvocationPolicy",
        ] {
            assert_eq!(w.get(field), vl.get(field), "{name}: {field}");
        }
        assert_eq!(
            w["rules"],
            json!([{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                    "resources": ["pods"], "scope": "Namespaced"}]),
            "{name}"
        );
        assert_eq!(w["objectSelector"], selector, "{name}");
        assert_eq!(w["matchConditions"], condition, "{name}");
    }
    assert_eq!(
        webhook(mutating, MUTATE).expect("entry")["reinvocationPolicy"],
        "IfNeeded"
    );

    // The webhook reads the same list from the ConfigMap.
    let cm = only(&docs, "ConfigMap");
    let cfg = Config::from_yaml(str_at(cm, "/data/config.yaml")).expect("config");
    let classes: Vec<(&str, TeeKind)> = cfg
        .admission
        .tee_runtime_classes
        .iter()
        .map(|(k, v)| (k.as_str(), *v))
        .collect();
    assert_eq!(
        classes,
        [
            ("kata-qemu-snp", TeeKind::SevEs),
            ("kata-qemu-tdx", TeeKind::Tdx)
        ]
    );
}

#[test]
fn runtime_class_entries_follow_the_webhook_values() {
    // custom.yaml: mutating failurePolicy Ignore, timeouts 10/7, more excluded namespaces; plus a URL.
    let docs = render(
        "custom",
        &[
            "--set-json",
            CLASSES,
            "--set",
            "webhook.url=https://10.0.0.7:9443",
        ],
    );
    let mutating = only(&docs, "MutatingWebhookConfiguration");
    let validating = only(&docs, "ValidatingWebhookConfiguration");
    let m = webhook(mutating, MUTATE).expect("mutating entry");
    let v = webhook(validating, VALIDATE).expect("validating entry");
    assert_eq!(m["failurePolicy"], "Ignore");
    assert_eq!(m["timeoutSeconds"], 10);
    assert_eq!(v["timeoutSeconds"], 7);
    assert_eq!(m["clientConfig"]["url"], "https://10.0.0.7:9443/mutate");
    assert_eq!(v["clientConfig"]["url"], "https://10.0.0.7:9443/validate");
    for (w, like) in [
        (m, webhook(mutating, "mutate.pods.teeguard.dev")),
        (v, webhook(validating, "validate.pods.teeguard.dev")),
    ] {
        let like = like.expect("virt-launcher entry");
        assert_eq!(w["namespaceSelector"], like["namespaceSelector"]);
        assert_eq!(w["failurePolicy"], like["failurePolicy"]);
    }
    assert_eq!(all(&docs, "MutatingWebhookConfiguration").len(), 1);
}
