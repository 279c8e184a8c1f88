//! The Helm chart renders, lints and validates for every value set in `tests/chart/`; its CRD is the one
//! generated from the Rust type; its ConfigMap is a configuration file the real loader accepts; webhook
//! configurations and workloads are wired the way the binaries and the API server need.
//!
//! Needs `TEEGUARD_HELM` and `TEEGUARD_KUBERNETES_VALIDATE` (set by `scripts/chart-tools.sh`, which
//! `scripts/test.sh` sources).

mod chart_support;

use std::time::Duration;

use chart_support::*;
use serde_json::{Value, json};
use teeguard_shared::config::{CrioAnnotation, Mode};
use teeguard_shared::{Config, TeeKind};

#[test]
fn helm_lint_passes_for_every_values_file() {
    for stem in VALUES_FILES {
        assert_lints(KUBE_VERSION, stem);
    }
}

#[test]
fn rendered_manifests_validate_against_the_kubernetes_schemas() {
    for stem in VALUES_FILES {
        let docs = render(stem, &["--include-crds"]);
        let (third_party, core): (Vec<Value>, Vec<Value>) =
            docs.into_iter().partition(is_cert_manager);
        if stem == "cert-manager" {
            let mut kinds: Vec<&str> = third_party
                .iter()
                .map(|d| d["kind"].as_str().expect("kind"))
                .collect();
            kinds.sort_unstable();
            assert_eq!(kinds, ["Certificate", "Certificate", "Issuer", "Issuer"]);
        } else {
            assert!(
                third_party.is_empty(),
                "{stem}: cert-manager objects without certManager.enabled"
            );
        }
        validate(&format!("tests/chart/{stem}.yaml"), &core);
    }
}

#[test]
fn kubernetes_validate_rejects_an_invalid_manifest() {
    // The schema check above can fail: an unknown field in a Service is refused in strict mode.
    let bad = json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "x"},
        "spec": {"ports": [{"port": 443}], "selectr": {}},
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bad.yaml");
    std::fs::write(&path, serde_yaml::to_string(&bad).expect("yaml")).expect("write");
    let out = kubernetes_validate_file(KUBE_VERSION, &path);
    assert!(!out.success, "accepted an invalid Service: {}", out.stdout);
    assert!(out.stdout.contains("selectr"), "{}", out.stdout);
}

#[test]
fn chart_crd_is_the_one_generated_from_the_rust_type() {
    let generated = teeguard_shared::crd::crd_yaml().expect("generate the CRD");
    let path = repo_root().join(teeguard_shared::crd::CRD_CHART_PATH);
    let committed = std::fs::read_to_string(&path).expect("read the chart's CRD");
    assert!(
        committed == generated,
        "{} differs from teeguard_shared::crd::crd_yaml(); run \
         `TEEGUARD_REGENERATE=1 cargo test -p teeguard-shared --test crd_drift`",
        path.display()
    );
    // And helm installs exactly that object.
    let docs = render("default", &["--include-crds"]);
    let crd = find(
        &docs,
        "CustomResourceDefinition",
        "teecapacities.teeguard.dev",
    );
    let expected: Value = serde_yaml::from_str(&generated).expect("generated CRD is YAML");
    assert_eq!(crd, &expected);
    // Without --include-crds the CRD is not a template (Helm installs crds/ itself, once).
    assert!(all(&render("default", &[]), "CustomResourceDefinition").is_empty());
}

fn rendered_config(stem: &str, extra: &[&str]) -> (String, Config) {
    let docs = render(stem, extra);
    let cm = only(&docs, "ConfigMap");
    let text = str_at(cm, "/data/config.yaml").to_string();
    let cfg = Config::from_yaml(&text).unwrap_or_else(|e| {
        panic!(
            "the ConfigMap rendered with tests/chart/{stem}.yaml is not a valid config: {e}\n{text}"
        )
    });
    (text, cfg)
}

#[test]
fn config_map_parses_with_the_real_loader_for_every_values_file() {
    for stem in VALUES_FILES {
        rendered_config(stem, &[]);
    }
}

#[test]
fn default_values_give_the_default_config() {
    let (text, cfg) = rendered_config("default", &[]);
    assert_eq!(cfg, Config::default(), "{text}");
    // Spelled out in the file, not just left to the defaults.
    for key in [
        "resourceName: tdx.intel.com/keys",
        "advertise: true",
        "mode: enforce",
    ] {
        assert!(text.contains(key), "{key} missing from:\n{text}");
    }
}

#[test]
fn config_values_reach_the_config_file() {
    let (_, cfg) = rendered_config("advertising-disabled", &[]);
    assert!(!cfg.agent.advertise);
    assert_eq!(cfg.agent.poll_interval, Duration::from_secs(2));
    assert_eq!(cfg.agent.heartbeat_interval, Duration::from_secs(30));
    assert_eq!(cfg.admission.mode, Mode::Warn);
    assert_eq!(cfg.admission.stale_report_after, Duration::from_secs(120));
    assert_eq!(cfg.enforcement.crio_annotation, CrioAnnotation::Current);
    assert!(cfg.enforcement.misc_max_annotation);
    assert_eq!(
        [TeeKind::Sev, TeeKind::Tdx].map(|k| cfg.resources.resource_name(k)),
        ["example.com/sev-asids", "tdx.intel.com/keys"]
    );

    let (_, cfg) = rendered_config("custom", &[]);
    assert_eq!(cfg.resources.tdx.keys_per_vm, 2);

    // A key set to null is dropped and the built-in default applies.
    let (text, cfg) = rendered_config(
        "default",
        &[
            "--set",
            "config.agent.pollInterval=null",
            "--set",
            "config.admission.ledgerTtl=45s",
        ],
    );
    assert!(!text.contains("pollInterval"), "{text}");
    assert_eq!(cfg.agent.poll_interval, Duration::from_secs(1));
    assert_eq!(cfg.admission.ledger_ttl, Duration::from_secs(45));
}

#[test]
fn config_change_rolls_both_workloads() {
    let checksum = |extra: &[&str]| {
        let docs = render("default", extra);
        let w = str_at(
            find(&docs, "Deployment", "teeguard-webhook"),
            "/spec/template/metadata/annotations/checksum~1config",
        )
        .to_string();
        let a = str_at(
            find(&docs, "DaemonSet", "teeguard-agent"),
            "/spec/template/metadata/annotations/checksum~1config",
        )
        .to_string();
        assert_eq!(w, a);
        w
    };
    let before = checksum(&[]);
    assert_eq!(before, checksum(&[]), "the checksum must be stable");
    assert_ne!(before, checksum(&["--set", "config.admission.mode=warn"]));
}

#[test]
fn schema_rejects_unknown_keys_and_bad_values() {
    let cases: [(&str, &str); 9] = [
        ("webhook.replica=3", "replica"),
        ("agent.tolerateAll=true", "tolerateAll"),
        ("config.admission.mode=block", "mode"),
        ("config.agent.pollInterval=soon", "pollInterval"),
        ("config.resources.tdx.resourceName=keys", "resourceName"),
        ("config.resources.tdx.keysPerVm=0", "keysPerVm"),
        ("config.unknown=1", "unknown"),
        ("webhook.binding.timeoutSeconds=31", "timeoutSeconds"),
        ("webhook.mutating.failurePolicy=Maybe", "failurePolicy"),
    ];
    for (set, field) in cases {
        let out = helm_template(&["default"], &["--set", set]);
        assert!(!out.success, "--set {set} was accepted");
        assert!(
            out.stderr.contains(field),
            "--set {set}: the error does not name {field}:\n{}",
            out.stderr
        );
    }
}

#[test]
fn chart_refuses_kubernetes_older_than_1_30() {
    let out = helm_template(&["default"], &["--kube-version", "1.29.0"]);
    assert!(!out.success, "rendered for Kubernetes 1.29");
    assert!(out.stderr.contains("kubeVersion"), "{}", out.stderr);
}

fn webhook<'a>(config: &'a Value, name: &str) -> &'a Value {
    config["webhooks"]
        .as_array()
        .expect("webhooks")
        .iter()
        .find(|w| w["name"] == name)
        .unwrap_or_else(|| panic!("no webhook {name} in {config}"))
}

fn excluded_namespaces(w: &Value) -> Vec<String> {
    let exprs = w["namespaceSelector"]["matchExpressions"]
        .as_array()
        .expect("namespaceSelector.matchExpressions");
    assert!(
        exprs.contains(
            &json!({"key": "teeguard.dev/exempt", "operator": "NotIn", "values": ["true"]})
        ),
        "exempt namespaces must be skipped: {exprs:?}"
    );
    let by_name = exprs
        .iter()
        .find(|e| e["key"] == "kubernetes.io/metadata.name")
        .expect("a kubernetes.io/metadata.name expression");
    assert_eq!(by_name["operator"], "NotIn");
    chart_support::strings(by_name, "values")
}

#[test]
fn webhook_configurations_match_the_webhook_service() {
    let docs = render("default", &[]);
    let service = find(&docs, "Service", "teeguard-webhook");
    assert_eq!(service["spec"]["ports"][0]["port"], 443);
    assert_eq!(service["spec"]["ports"][0]["targetPort"], "https");
    let deployment = find(&docs, "Deployment", "teeguard-webhook");
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    assert!(
        container["ports"]
            .as_array()
            .expect("ports")
            .contains(&json!({"name": "https", "containerPort": 8443, "protocol": "TCP"}))
    );
    // The Service selects exactly the webhook pods.
    let selector = service["spec"]["selector"].as_object().expect("selector");
    let pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
    for (k, v) in selector {
        assert_eq!(&pod_labels[k], v, "pod label {k}");
    }
    assert_eq!(selector["app.kubernetes.io/component"], "webhook");

    let mutating = only(&docs, "MutatingWebhookConfiguration");
    let validating = only(&docs, "ValidatingWebhookConfiguration");
    assert_eq!(mutating["webhooks"].as_array().expect("list").len(), 1);
    assert_eq!(validating["webhooks"].as_array().expect("list").len(), 3);

    let virt_launcher_selector = json!({"matchExpressions": [
        {"key": "kubevirt.io", "operator": "In", "values": ["virt-launcher"]},
        {"key": "teeguard.dev/exempt", "operator": "NotIn", "values": ["true"]},
    ]});
    let cases = [
        (
            mutating,
            "mutate.pods.teeguard.dev",
            "/mutate",
            "pods",
            "Fail",
            5,
        ),
        (
            validating,
            "validate.pods.teeguard.dev",
            "/validate",
            "pods",
            "Fail",
            5,
        ),
        (
            validating,
            "validate.bindings.teeguard.dev",
            "/validate",
            "pods/binding",
            "Ignore",
            3,
        ),
    ];
    for (config, name, path, resource, failure_policy, timeout) in cases {
        let w = webhook(config, name);
        assert_eq!(w["admissionReviewVersions"], json!(["v1"]), "{name}");
        assert_eq!(w["sideEffects"], "None", "{name}");
        assert_eq!(w["failurePolicy"], failure_policy, "{name}");
        assert_eq!(w["timeoutSeconds"], timeout, "{name}");
        let svc = &w["clientConfig"]["service"];
        assert_eq!(svc["name"], "teeguard-webhook", "{name}");
        assert_eq!(svc["namespace"], NAMESPACE, "{name}");
        assert_eq!(svc["port"], 443, "{name}");
        assert_eq!(svc["path"], path, "{name}");
        assert_eq!(
            w["rules"],
            json!([{"operations": ["CREATE"], "apiGroups": [""], "apiVersions": ["v1"],
                    "resources": [resource], "scope": "Namespaced"}]),
            "{name}"
        );
        assert_eq!(excluded_namespaces(w), [NAMESPACE], "{name}");
        let conditions = w["matchConditions"].as_array().expect("matchConditions");
        assert_eq!(conditions.len(), 1, "{name}");
        if resource == "pods/binding" {
            // A Binding has no labels: an objectSelector would never match it.
            assert!(
                w.get("objectSelector").is_none(),
                "{name} must have no objectSelector"
            );
            assert_eq!(
                conditions[0]["expression"],
                "request.name.startsWith('virt-launcher-')"
            );
        } else {
            assert_eq!(w["objectSelector"], virt_launcher_selector, "{name}");
            let expr = conditions[0]["expression"].as_str().expect("expression");
            assert!(
                expr.contains("'kubevirt.io/ephemeral-provisioning'") && expr.contains("!= 'true'"),
                "{name} must skip the storage-binding pod: {expr}"
            );
        }
    }
    assert_eq!(
        webhook(mutating, "mutate.pods.teeguard.dev")["reinvocationPolicy"],
        "IfNeeded"
    );
}

/// Forged cgroup-limit annotations are checked on any pod, CREATE and UPDATE, but only a CREATE that
/// carries one or an UPDATE that changes them reaches the webhook (a label patch does not, so it does
/// not fail while the webhook is down), and virt-launcher CREATEs are left to validate.pods.
#[test]
fn limit_annotation_webhook_covers_every_pod_with_a_limit_annotation() {
    let docs = render("default", &[]);
    let validating = only(&docs, "ValidatingWebhookConfiguration");
    let w = webhook(validating, "validate.limits.teeguard.dev");
    assert_eq!(w["clientConfig"]["service"]["path"], "/validate");
    assert_eq!(
        w["rules"],
        json!([{"operations": ["CREATE", "UPDATE"], "apiGroups": [""], "apiVersions": ["v1"],
                "resources": ["pods"], "scope": "Namespaced"}])
    );
    assert_eq!(
        w["objectSelector"],
        json!({"matchExpressions": [{"key": "teeguard.dev/exempt", "operator": "NotIn", "values": ["true"]}]})
    );
    assert_eq!(excluded_namespaces(w), [NAMESPACE]);
    let exprs: Vec<&str> = w["matchConditions"]
        .as_array()
        .expect("matchConditions")
        .iter()
        .map(|c| c["expression"].as_str().expect("expression"))
        .collect();
    for prefix in teeguard_shared::names::LIMIT_ANNOTATION_PREFIXES {
        assert!(
            exprs[0].contains(&format!("k.startsWith('{prefix}')")),
            "{prefix}: {}",
            exprs[0]
        );
    }
    assert!(
        exprs[0].contains("oldObject.metadata.annotations[k] != object.metadata.annotations[k]")
            && exprs[0].contains("!(k in object.metadata.annotations)"),
        "an UPDATE reaches the webhook only when a limit annotation changed or went: {}",
        exprs[0]
    );
    assert!(
        exprs[1].contains("request.operation == 'UPDATE'"),
        "{}",
        exprs[1]
    );
    assert!(exprs[1].contains("'virt-launcher'"), "{}", exprs[1]);
}

#[test]
fn webhook_policies_and_scope_follow_the_values() {
    let docs = render("custom", &[]);
    let mutating = only(&docs, "MutatingWebhookConfiguration");
    let validating = only(&docs, "ValidatingWebhookConfiguration");
    let m = webhook(mutating, "mutate.pods.teeguard.dev");
    assert_eq!(m["failurePolicy"], "Ignore");
    assert_eq!(m["timeoutSeconds"], 10);
    assert_eq!(m["clientConfig"]["service"]["name"], "tg-webhook");
    let v = webhook(validating, "validate.pods.teeguard.dev");
    assert_eq!(v["timeoutSeconds"], 7);
    assert_eq!(
        excluded_namespaces(v),
        [NAMESPACE, "kube-system", "teeguard-ci"]
    );
    // webhook.binding.enabled=false drops the pods/binding webhook.
    assert_eq!(validating["webhooks"].as_array().expect("list").len(), 2);
    // The container ports follow webhook.port / adminPort and the Service still targets them by name.
    let deployment = find(&docs, "Deployment", "tg-webhook");
    let c = &deployment["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = c["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| a.as_str().expect("str"))
        .collect();
    assert!(args.contains(&"--listen=[::]:9443"), "{args:?}");
    assert!(args.contains(&"--admin-listen=[::]:9090"), "{args:?}");
    assert!(args.contains(&"--max-connections=512"), "{args:?}");
    assert_eq!(c["livenessProbe"]["httpGet"]["port"], "admin");
    assert!(
        c["ports"]
            .as_array()
            .expect("ports")
            .contains(&json!({"name": "admin", "containerPort": 9090, "protocol": "TCP"}))
    );
    assert_eq!(
        c["image"],
        "ghcr.io/teeguard/teeguard-webhook@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
    );
    assert_eq!(deployment["spec"]["replicas"], 3);
    assert_eq!(
        deployment["spec"]["template"]["spec"]["priorityClassName"],
        "system-cluster-critical"
    );
    assert_eq!(
        find(&docs, "PodDisruptionBudget", "tg-webhook")["spec"]["maxUnavailable"],
        "34%"
    );
    assert!(
        find(&docs, "PodDisruptionBudget", "tg-webhook")["spec"]
            .get("minAvailable")
            .is_none()
    );
    // Labels from commonLabels reach every object.
    for d in &docs {
        assert_eq!(
            d["metadata"]["labels"]["team"], "confidential-vms",
            "{}",
            d["kind"]
        );
    }
}

fn args(workload: &Value) -> Vec<String> {
    chart_support::strings(container(workload), "args")
}

#[test]
fn webhook_deployment_is_hardened_spread_and_wired() {
    let docs = render("default", &[]);
    let d = find(&docs, "Deployment", "teeguard-webhook");
    assert_hardened(d, 65532);
    assert_eq!(d["spec"]["replicas"], 2);
    let pod = &d["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "teeguard-webhook");
    assert!(pod.get("priorityClassName").is_none());
    assert_eq!(
        pod["topologySpreadConstraints"][0]["topologyKey"],
        "kubernetes.io/hostname"
    );
    assert_eq!(
        pod["topologySpreadConstraints"][0]["whenUnsatisfiable"],
        "ScheduleAnyway"
    );
    let anti =
        &pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0];
    assert_eq!(
        anti["podAffinityTerm"]["topologyKey"],
        "kubernetes.io/hostname"
    );
    assert_eq!(
        anti["podAffinityTerm"]["labelSelector"]["matchLabels"],
        d["spec"]["selector"]["matchLabels"]
    );
    let pdb = find(&docs, "PodDisruptionBudget", "teeguard-webhook");
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    assert_eq!(pdb["spec"]["selector"], d["spec"]["selector"]);

    let a = args(d);
    assert_eq!(a[0], "serve");
    let (tls_mount, tls_volume) = mount(d, "tls");
    assert_eq!(tls_mount["readOnly"], true);
    assert!(
        a.contains(&format!("--cert-dir={}", str_at(tls_mount, "/mountPath"))),
        "{a:?}"
    );
    assert_eq!(tls_volume["secret"]["secretName"], "teeguard-webhook-tls");
    let (cfg_mount, cfg_volume) = mount(d, "config");
    assert!(
        a.contains(&format!(
            "--config={}/config.yaml",
            str_at(cfg_mount, "/mountPath")
        )),
        "{a:?}"
    );
    assert_eq!(cfg_volume["configMap"]["name"], "teeguard-config");
    assert!(a.contains(&"--listen=0.0.0.0:8443".to_string()), "{a:?}");
    assert!(
        a.contains(&"--admin-listen=0.0.0.0:8080".to_string()),
        "{a:?}"
    );
    assert_eq!(
        container(d)["command"],
        json!(["/usr/local/bin/teeguard-webhook"])
    );
}

/// The default (enforcement mode auto) runs the agent as root without capabilities and mounts the host
/// cgroup tree writable; chart_enforcement.rs covers every mode.
#[test]
fn agent_daemonset_mounts_the_host_cgroup_tree_and_runs_hardened() {
    let docs = render("default", &[]);
    let ds = find(&docs, "DaemonSet", "teeguard-agent");
    assert_hardened(ds, 0);
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(pod["serviceAccountName"], "teeguard-agent");
    assert_eq!(pod["nodeSelector"], json!({"kubernetes.io/os": "linux"}));
    assert_eq!(pod["tolerations"], json!([{"operator": "Exists"}]));
    let (m, v) = mount(ds, "host-cgroup");
    assert_eq!(m["mountPath"], "/host/sys/fs/cgroup");
    assert_eq!(m["readOnly"], false, "the cgroup writer sets misc.max");
    assert_eq!(m["mountPropagation"], "HostToContainer");
    assert_eq!(
        v["hostPath"],
        json!({"path": "/sys/fs/cgroup", "type": "Directory"})
    );
    let env = container(ds)["env"].as_array().expect("env");
    let node_name = env
        .iter()
        .find(|e| e["name"] == "NODE_NAME")
        .expect("NODE_NAME");
    assert_eq!(
        node_name["valueFrom"]["fieldRef"]["fieldPath"],
        "spec.nodeName"
    );
    let a = args(ds);
    assert_eq!(a[0], "run");
    assert!(
        a.contains(&"--cgroup-root=/host/sys/fs/cgroup".to_string()),
        "{a:?}"
    );
    assert!(a.contains(&"--node-name=$(NODE_NAME)".to_string()), "{a:?}");
    assert!(
        a.contains(&"--admin-addr=0.0.0.0:8081".to_string()),
        "{a:?}"
    );
    let (cfg_mount, _) = mount(ds, "config");
    assert!(
        a.contains(&format!(
            "--config={}/config.yaml",
            str_at(cfg_mount, "/mountPath")
        )),
        "{a:?}"
    );
    assert_eq!(
        container(ds)["command"],
        json!(["/usr/local/bin/teeguard-agent"])
    );

    // Without enforcement: read-only and non-root.
    let docs = render("default", &["--set", "config.enforcement.mode=off"]);
    let ds = find(&docs, "DaemonSet", "teeguard-agent");
    assert_hardened(ds, 65532);
    assert_eq!(mount(ds, "host-cgroup").0["readOnly"], true);

    // Custom placement: no blanket toleration, the given node selector and host path, OnDelete updates.
    // custom.yaml enforces through NRI only: root, cgroup tree read-only.
    let docs = render("custom", &[]);
    let ds = find(&docs, "DaemonSet", "tg-agent");
    assert_hardened(ds, 0);
    assert_eq!(mount(ds, "host-cgroup").0["readOnly"], true);
    let off = render("custom", &["--set", "config.enforcement.mode=off"]);
    assert_hardened(find(&off, "DaemonSet", "tg-agent"), 10001);
    let pod = &ds["spec"]["template"]["spec"];
    assert_eq!(
        pod["tolerations"],
        json!([{"key": "tee", "operator": "Equal", "value": "true", "effect": "NoSchedule"}])
    );
    assert_eq!(
        pod["nodeSelector"]["feature.node.kubernetes.io/cpu-security.tdx.enabled"],
        "true"
    );
    assert_eq!(pod["serviceAccountName"], "existing-agent-sa");
    assert_eq!(
        mount(ds, "host-cgroup").1["hostPath"]["path"],
        "/host-cgroup"
    );
    assert_eq!(ds["spec"]["updateStrategy"], json!({"type": "OnDelete"}));
    assert_eq!(
        container(ds)["image"],
        "ghcr.io/teeguard/teeguard-agent:0.2.0-rc1"
    );
    assert!(
        all(&docs, "ServiceAccount")
            .iter()
            .all(|sa| sa["metadata"]["name"] != "existing-agent-sa"),
        "serviceAccount.create=false must not create the agent's ServiceAccount"
    );
}

#[test]
fn own_node_policy_restricts_the_agent_to_its_node() {
    let docs = render("default", &[]);
    let policy = find(
        &docs,
        "ValidatingAdmissionPolicy",
        "teeguard-agent-own-node",
    );
    let binding = find(
        &docs,
        "ValidatingAdmissionPolicyBinding",
        "teeguard-agent-own-node",
    );
    assert_eq!(binding["spec"]["policyName"], "teeguard-agent-own-node");
    assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));
    assert_eq!(policy["spec"]["failurePolicy"], "Fail");
    let resources: Vec<&str> = policy["spec"]["matchConstraints"]["resourceRules"]
        .as_array()
        .expect("rules")
        .iter()
        .flat_map(|r| r["resources"].as_array().expect("resources"))
        .map(|r| r.as_str().expect("str"))
        .collect();
    assert_eq!(
        resources,
        [
            "teecapacities",
            "teecapacities/status",
            "nodes",
            "nodes/status",
            "leases"
        ]
    );
    assert_eq!(
        policy["spec"]["matchConditions"][0]["expression"],
        format!("request.userInfo.username == 'system:serviceaccount:{NAMESPACE}:teeguard-agent'")
    );
    let token_node = policy["spec"]["variables"]
        .as_array()
        .expect("variables")
        .iter()
        .find(|v| v["name"] == "tokenNode")
        .expect("tokenNode");
    assert!(
        str_at(token_node, "/expression")
            .contains("request.userInfo.extra[?'authentication.kubernetes.io/node-name']"),
        "{token_node}"
    );
    let validations = validation_expressions(policy);
    assert!(
        validations.contains(&"variables.objectName == variables.tokenNode"),
        "{validations:?}"
    );
    assert!(
        validations
            .iter()
            .any(|v| v.contains("object.spec.nodeName == variables.tokenNode"))
    );

    // The agent ServiceAccount the policy names is the one the DaemonSet runs as.
    let ds = find(&docs, "DaemonSet", "teeguard-agent");
    assert_eq!(
        ds["spec"]["template"]["spec"]["serviceAccountName"],
        "teeguard-agent"
    );

    let docs = render("custom", &[]);
    assert!(all(&docs, "ValidatingAdmissionPolicy").is_empty());
    assert!(all(&docs, "ValidatingAdmissionPolicyBinding").is_empty());
}

#[test]
fn host_network_and_the_api_server_override_reach_both_workloads() {
    let env_of = |workload: &Value, name: &str| -> Option<String> {
        workload["spec"]["template"]["spec"]["containers"][0]["env"]
            .as_array()?
            .iter()
            .find(|e| e["name"] == name)
            .and_then(|e| e["value"].as_str().map(str::to_string))
    };
    let docs = render("default", &[]);
    for (kind, name) in [
        ("Deployment", "teeguard-webhook"),
        ("DaemonSet", "teeguard-agent"),
    ] {
        let w = find(&docs, kind, name);
        assert!(
            w["spec"]["template"]["spec"]["hostNetwork"].is_null(),
            "{name}: default pod network"
        );
        assert_eq!(
            env_of(w, "KUBERNETES_SERVICE_HOST"),
            None,
            "{name}: default API address"
        );
    }
    let docs = render(
        "default",
        &[
            "--set",
            "agent.hostNetwork=true",
            "--set",
            "webhook.hostNetwork=true",
            "--set",
            "apiServer.host=10.1.2.3",
            "--set",
            "apiServer.port=6443",
        ],
    );
    for (kind, name) in [
        ("Deployment", "teeguard-webhook"),
        ("DaemonSet", "teeguard-agent"),
    ] {
        let w = find(&docs, kind, name);
        let spec = &w["spec"]["template"]["spec"];
        assert_eq!(spec["hostNetwork"], true, "{name}");
        assert_eq!(spec["dnsPolicy"], "ClusterFirstWithHostNet", "{name}");
        assert_eq!(
            env_of(w, "KUBERNETES_SERVICE_HOST").as_deref(),
            Some("10.1.2.3"),
            "{name}"
        );
        assert_eq!(
            env_of(w, "KUBERNETES_SERVICE_PORT").as_deref(),
            Some("6443"),
            "{name}"
        );
    }
    // The schema refuses a port that is not a number.
    let out = chart_support::helm_template(&["default"], &["--set", "apiServer.port=https"]);
    assert!(!out.success, "apiServer.port=https was accepted");
}

#[test]
fn webhook_url_replaces_the_service_in_every_webhook_configuration() {
    let hooks = |docs: &[Value]| -> Vec<Value> {
        [
            "MutatingWebhookConfiguration",
            "ValidatingWebhookConfiguration",
        ]
        .iter()
        .flat_map(|k| chart_support::all(docs, k))
        .flat_map(|c| c["webhooks"].as_array().cloned().unwrap_or_default())
        .map(|h| h["clientConfig"].clone())
        .collect()
    };
    for c in hooks(&render("default", &[])) {
        assert!(
            c["url"].is_null() && c["service"]["path"].is_string(),
            "{c}"
        );
    }
    let with_url = hooks(&render(
        "default",
        &["--set", "webhook.url=https://10.0.0.7:9443/"],
    ));
    assert!(!with_url.is_empty());
    for c in with_url {
        let url = c["url"].as_str().unwrap_or_default();
        assert!(
            url == "https://10.0.0.7:9443/mutate" || url == "https://10.0.0.7:9443/validate",
            "{c}"
        );
        assert!(c["service"].is_null() && c["caBundle"].is_string(), "{c}");
    }
    let out = chart_support::helm_template(&["default"], &["--set", "webhook.url=http://x"]);
    assert!(!out.success, "a plain-HTTP webhook URL was accepted");
}
