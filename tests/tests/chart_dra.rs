//! DRA mode in the chart (`config.agent.accounting: dra`, docs/dra.md): one DeviceClass per kind whose
//! `extendedResourceName` is the configured resource name and whose CEL selects the driver's devices of
//! that kind; the kubelet plugin's host directories mounted at the same paths, the kubelet directory in
//! `TEEGUARD_KUBELET_DIR`, the agent as root; RBAC for exactly the driver's new calls; the own-node policy
//! for its ResourceSlices. None of it in the default (extended-resource) mode. And
//! `admission.teeRuntimeClasses` reaches the configuration file.
//!
//! DRA renders are for Kubernetes 1.36 ([`DRA_KUBE_VERSION`]), and validated against its schemas.
//! Needs `TEEGUARD_HELM` and `TEEGUARD_KUBERNETES_VALIDATE` (set by `scripts/chart-tools.sh`).

mod chart_support;

use std::collections::BTreeSet;

use chart_support::*;
use clap::CommandFactory;
use serde_json::{Value, json};
use teeguard_shared::config::Accounting;
use teeguard_shared::names::{DRA_DRIVER, dra_device_class};
use teeguard_shared::{Config, TeeKind};

/// The values file of DRA mode (`tests/chart/dra.yaml`).
const DRA: &str = "dra";

/// Each kind: its key under `config.resources`, its device attribute (and DeviceClass prefix), the
/// default resource name.
const KINDS: [(&str, &str, &str); 3] = [
    ("tdx", "tdx", "tdx.intel.com/keys"),
    ("sev", "sev", "sev.amd.com/asids"),
    ("sevEs", "sev-es", "sev-snp.amd.com/esids"),
];

/// The environment variable the agent reads the kubelet's directory from.
const KUBELET_DIR_ENV: &str = "TEEGUARD_KUBELET_DIR";

fn render_dra(extra: &[&str]) -> Vec<Value> {
    render_for(DRA_KUBE_VERSION, DRA, extra)
}

fn config_of(docs: &[Value]) -> Config {
    let text = str_at(only(docs, "ConfigMap"), "/data/config.yaml");
    Config::from_yaml(text).unwrap_or_else(|e| panic!("not a valid config: {e}\n{text}"))
}

fn env_value(workload: &Value, name: &str) -> Option<String> {
    container(workload)["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
        .map(|e| e["value"].as_str().expect("a plain value").to_string())
}

fn volume_names(workload: &Value) -> Vec<String> {
    workload["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .map(|v| v["name"].as_str().expect("name").to_string())
        .collect()
}

/// Every (verb, group, resource) a rendered role grants (`resource#name` for a rule with
/// `resourceNames`).
fn grants(role: &Value) -> BTreeSet<(String, String, String)> {
    let mut set = BTreeSet::new();
    for rule in role["rules"].as_array().expect("rules") {
        let names = match rule.get("resourceNames") {
            Some(_) => strings(rule, "resourceNames")
                .into_iter()
                .map(|n| format!("#{n}"))
                .collect(),
            None => vec![String::new()],
        };
        for group in strings(rule, "apiGroups") {
            for resource in strings(rule, "resources") {
                for verb in strings(rule, "verbs") {
                    for name in &names {
                        set.insert((verb.clone(), group.clone(), format!("{resource}{name}")));
                    }
                }
            }
        }
    }
    set
}

fn grant(verb: &str, group: &str, resource: &str) -> (String, String, String) {
    (verb.into(), group.into(), resource.into())
}

#[test]
fn the_default_mode_renders_nothing_of_dra() {
    for stem in VALUES_FILES {
        let docs = render(stem, &[]);
        assert!(all(&docs, "DeviceClass").is_empty(), "{stem}: DeviceClass");
        let policies: Vec<&str> = all(&docs, "ValidatingAdmissionPolicy")
            .iter()
            .map(|p| str_at(p, "/metadata/name"))
            .collect();
        assert!(
            policies.iter().all(|p| !p.ends_with("-own-node-slices")),
            "{stem}: {policies:?}"
        );
        for role in all(&docs, "ClusterRole")
            .into_iter()
            .chain(all(&docs, "Role"))
        {
            assert!(
                grants(role).iter().all(|(_, g, _)| g != "resource.k8s.io"),
                "{stem}: {} grants resource.k8s.io",
                role["metadata"]["name"]
            );
        }
        let ds = only(&docs, "DaemonSet");
        let volumes = volume_names(ds);
        assert!(
            !volumes.iter().any(|v| v.starts_with("kubelet")),
            "{stem}: {volumes:?}"
        );
        let paths: Vec<&Value> = ds["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .expect("volumes")
            .iter()
            .filter_map(|v| v["hostPath"].get("path"))
            .collect();
        assert!(
            paths
                .iter()
                .all(|p| !p.as_str().unwrap_or("").contains("kubelet")),
            "{stem}: {paths:?}"
        );
        assert_eq!(env_value(ds, KUBELET_DIR_ENV), None, "{stem}");
        assert_eq!(
            config_of(&docs).agent.accounting,
            Accounting::ExtendedResource,
            "{stem}"
        );
    }
    // Spelled out in the default file.
    let docs = render("default", &[]);
    let text = str_at(only(&docs, "ConfigMap"), "/data/config.yaml");
    assert!(text.contains("accounting: extendedResource"), "{text}");
}

#[test]
fn dra_mode_lints_and_validates_against_the_kubernetes_1_36_schemas() {
    assert_lints(DRA_KUBE_VERSION, DRA);
    let docs = render_dra(&["--include-crds"]);
    assert!(docs.iter().all(|d| !is_cert_manager(d)));
    validate_for(DRA_KUBE_VERSION, "tests/chart/dra.yaml", &docs);
    // With every other knob away from its default too.
    let docs = render_for(
        DRA_KUBE_VERSION,
        "custom",
        &[
            "--values",
            &values_file(DRA).display().to_string(),
            "--set",
            "agent.kubeletDir=/data/kubelet",
        ],
    );
    validate_for(DRA_KUBE_VERSION, "custom.yaml + dra.yaml", &docs);
}

#[test]
fn dra_mode_needs_kubernetes_1_34() {
    let out = helm_template_for(KUBE_VERSION, NAMESPACE, &[DRA], &[]);
    assert!(
        !out.success,
        "rendered DRA mode for Kubernetes {KUBE_VERSION}"
    );
    assert!(
        out.stderr
            .contains("config.agent.accounting=dra needs Kubernetes >= 1.34"),
        "{}",
        out.stderr
    );
    let out = helm_template_for("1.34.0", NAMESPACE, &[DRA], &[]);
    assert!(out.success, "{}", out.stderr);
}

#[test]
fn one_device_class_per_kind_selects_the_drivers_devices_of_that_kind() {
    assert_eq!(DRA_DRIVER, "tee.teeguard.dev");
    let docs = render_dra(&[]);
    let classes = all(&docs, "DeviceClass");
    assert_eq!(classes.len(), 3, "one DeviceClass per kind");
    for (key, attribute, resource_name) in KINDS {
        let name = dra_device_class(attribute);
        assert_eq!(name, format!("{attribute}.tee.teeguard.dev"));
        let class = find(&docs, "DeviceClass", &name);
        assert_eq!(class["apiVersion"], "resource.k8s.io/v1", "{name}");
        assert!(
            class["metadata"].get("namespace").is_none(),
            "{name}: cluster-scoped"
        );
        assert_eq!(
            class["spec"],
            json!({
                "selectors": [{"cel": {"expression": format!(
                    "device.driver == \"tee.teeguard.dev\" && \
                     device.attributes[\"tee.teeguard.dev\"].kind == \"{attribute}\""
                )}}],
                "extendedResourceName": resource_name,
            }),
            "{name} (config.resources.{key})"
        );
    }
    // The names the webhook and agent use are the ones the classes serve.
    let cfg = config_of(&docs);
    for (kind, (_, attribute, _)) in TeeKind::ALL.into_iter().zip(KINDS) {
        let class = find(&docs, "DeviceClass", &dra_device_class(attribute));
        assert_eq!(
            class["spec"]["extendedResourceName"],
            cfg.resources.resource_name(kind),
            "{kind}"
        );
    }
}

#[test]
fn overridden_resource_names_flow_into_the_device_classes() {
    let docs = render_dra(&[
        "--set",
        "config.resources.tdx.resourceName=example.com/tdx-hkids",
        "--set",
        "config.resources.sevEs.resourceName=example.com/snp-asids",
        "--set",
        "config.resources.sev.resourceName=null",
    ]);
    let served = |attribute: &str| {
        find(&docs, "DeviceClass", &dra_device_class(attribute))["spec"]["extendedResourceName"]
            .clone()
    };
    assert_eq!(served("tdx"), "example.com/tdx-hkids");
    assert_eq!(served("sev-es"), "example.com/snp-asids");
    // A name set to null falls back to the built-in default, as in the config file.
    assert_eq!(served("sev"), "sev.amd.com/asids");
    let cfg = config_of(&docs);
    assert_eq!(
        [TeeKind::Tdx, TeeKind::Sev, TeeKind::SevEs].map(|k| cfg.resources.resource_name(k)),
        [
            "example.com/tdx-hkids",
            "sev.amd.com/asids",
            "example.com/snp-asids"
        ]
    );

    // Managed elsewhere: none created, everything else stays.
    let docs = render_dra(&["--set", "dra.deviceClasses.create=false"]);
    assert!(all(&docs, "DeviceClass").is_empty());
    assert_eq!(config_of(&docs).agent.accounting, Accounting::Dra);
}

#[test]
fn the_agent_gets_the_kubelet_plugin_directories_at_their_host_paths() {
    for (extra, kubelet_dir) in [
        (vec![], "/var/lib/kubelet"),
        (
            vec!["--set", "agent.kubeletDir=/data/kubelet/"],
            "/data/kubelet",
        ),
    ] {
        let docs = render_dra(&extra);
        let ds = find(&docs, "DaemonSet", "teeguard-agent");
        assert_eq!(
            env_value(ds, KUBELET_DIR_ENV).as_deref(),
            Some(kubelet_dir),
            "{extra:?}"
        );
        for (volume, path) in [
            (
                "kubelet-plugins-registry",
                format!("{kubelet_dir}/plugins_registry"),
            ),
            (
                "kubelet-plugin",
                format!("{kubelet_dir}/plugins/{DRA_DRIVER}"),
            ),
        ] {
            let (m, v) = mount(ds, volume);
            // The kubelet dials the socket path the plugin reports: the same inside and outside.
            assert_eq!(m["mountPath"], path.as_str(), "{volume}");
            assert!(
                m.get("readOnly").is_none_or(|r| r == false),
                "{volume}: the agent creates its sockets there"
            );
            assert_eq!(
                v["hostPath"],
                json!({"path": path, "type": "DirectoryOrCreate"}),
                "{volume}"
            );
        }
        // The config, the cgroup tree, the NRI directory (mode auto) and the two plugin directories.
        let mounts = container(ds)["volumeMounts"]
            .as_array()
            .expect("volumeMounts")
            .len();
        assert_eq!(mounts, 5, "{extra:?}");
        // Root (the kubelet's directories are root's), still without any capability.
        assert_hardened(ds, 0);
    }
    // Root in DRA mode even without enforcement, which alone would run it as agent.runAsUser.
    let docs = render_dra(&["--set", "config.enforcement.mode=off"]);
    let ds = find(&docs, "DaemonSet", "teeguard-agent");
    assert_hardened(ds, 0);
    assert_eq!(mount(ds, "host-cgroup").0["readOnly"], true);
    assert!(try_mount(ds, "nri").is_none());
    assert!(try_mount(ds, "kubelet-plugin").is_some());
}

#[test]
fn switching_back_with_dra_drain_keeps_only_the_kubelet_plugin_mounts() {
    for extra in [
        vec!["--set", "dra.drain=true"],
        vec![
            "--set",
            "dra.drain=true",
            "--set",
            "config.enforcement.mode=off",
        ],
    ] {
        let docs = render("default", &extra);
        let ds = find(&docs, "DaemonSet", "teeguard-agent");
        assert_eq!(
            env_value(ds, KUBELET_DIR_ENV).as_deref(),
            Some("/var/lib/kubelet"),
            "{extra:?}"
        );
        for volume in ["kubelet-plugins-registry", "kubelet-plugin"] {
            assert!(try_mount(ds, volume).is_some(), "{extra:?}: {volume}");
        }
        // Root: the agent serves the kubelet's sockets in root's directories.
        assert_hardened(ds, 0);
        // Nothing else of DRA: extended-resource accounting, no DeviceClass, no resource.k8s.io call
        // (draining unprepares from the checkpoint and reads nothing).
        assert_eq!(
            config_of(&docs).agent.accounting,
            Accounting::ExtendedResource
        );
        assert!(all(&docs, "DeviceClass").is_empty());
        for role in all(&docs, "ClusterRole")
            .into_iter()
            .chain(all(&docs, "Role"))
        {
            assert!(grants(role).iter().all(|(_, g, _)| g != "resource.k8s.io"));
        }
    }
}

#[test]
fn the_agents_kubelet_dir_flag_reads_the_variable_the_chart_sets() {
    // The agent takes the kubelet's directory from `--kubelet-dir` or TEEGUARD_KUBELET_DIR; the chart
    // sets only the variable.
    let command = teeguard_agent::cli::Cli::command();
    let run = command
        .get_subcommands()
        .find(|c| c.get_name() == "run")
        .expect("teeguard-agent run");
    let arg = run
        .get_arguments()
        .find(|a| a.get_long() == Some("kubelet-dir"))
        .expect("teeguard-agent run --kubelet-dir");
    assert_eq!(
        arg.get_env().and_then(|e| e.to_str()),
        Some(KUBELET_DIR_ENV),
        "teeguard-agent run --kubelet-dir must read {KUBELET_DIR_ENV}, which the chart sets"
    );
    assert_eq!(
        arg.get_default_values(),
        [std::ffi::OsStr::new("/var/lib/kubelet")],
        "the agent's default must be the chart's agent.kubeletDir default"
    );
    // And the chart's command line in DRA mode still parses.
    let docs = render_dra(&[]);
    let ds = find(&docs, "DaemonSet", "teeguard-agent");
    let mut line: Vec<String> = container(ds)["command"]
        .as_array()
        .expect("command")
        .iter()
        .chain(container(ds)["args"].as_array().expect("args"))
        .map(|s| {
            s.as_str()
                .expect("string")
                .replace("$(NODE_NAME)", "node-a")
        })
        .collect();
    line[0] = "teeguard-agent".into();
    if let Err(e) = <teeguard_agent::cli::Cli as clap::Parser>::try_parse_from(&line) {
        panic!("teeguard-agent rejects the chart's DRA command line {line:?}:\n{e}");
    }
}

#[test]
fn dra_mode_grants_the_agent_exactly_the_drivers_calls() {
    let before = render("default", &[]);
    let after = render_dra(&[]);
    let role = |docs: &[Value], kind: &str, name: &str| grants(find(docs, kind, name));
    let added: BTreeSet<_> = role(&after, "ClusterRole", "teeguard-agent")
        .difference(&role(&before, "ClusterRole", "teeguard-agent"))
        .cloned()
        .collect();
    // What agent/src/cluster/{watch,slices}.rs call: a reflector on the node's slices, server-side
    // apply (patch; create when it creates), delete; a GET of each claim the kubelet names.
    let mut expected: BTreeSet<_> = ["list", "watch", "create", "patch", "delete"]
        .into_iter()
        .map(|verb| grant(verb, "resource.k8s.io", "resourceslices"))
        .collect();
    expected.insert(grant("get", "resource.k8s.io", "resourceclaims"));
    assert_eq!(added, expected);
    // Nothing taken away, and nothing else changed.
    assert!(
        role(&before, "ClusterRole", "teeguard-agent").is_subset(&role(
            &after,
            "ClusterRole",
            "teeguard-agent"
        ))
    );
    for (kind, name) in [
        ("ClusterRole", "teeguard-webhook"),
        ("Role", "teeguard-webhook"),
        ("Role", "teeguard-agent"),
    ] {
        assert_eq!(
            role(&before, kind, name),
            role(&after, kind, name),
            "{kind} {name}"
        );
    }
    assert_eq!(all(&after, "ClusterRole").len(), 2);
}

#[test]
fn the_own_node_policy_holds_the_agent_to_its_nodes_slices() {
    let docs = render_dra(&[]);
    let policy = find(
        &docs,
        "ValidatingAdmissionPolicy",
        "teeguard-agent-own-node-slices",
    );
    let binding = find(
        &docs,
        "ValidatingAdmissionPolicyBinding",
        "teeguard-agent-own-node-slices",
    );
    assert_eq!(
        binding["spec"]["policyName"],
        "teeguard-agent-own-node-slices"
    );
    assert_eq!(binding["spec"]["validationActions"], json!(["Deny"]));
    assert_eq!(policy["spec"]["failurePolicy"], "Fail");
    assert_eq!(
        policy["spec"]["matchConstraints"]["resourceRules"],
        json!([{
            "apiGroups": ["resource.k8s.io"],
            "apiVersions": ["*"],
            "operations": ["CREATE", "UPDATE", "DELETE"],
            "resources": ["resourceslices"],
        }])
    );
    assert_eq!(
        policy["spec"]["matchConditions"][0]["expression"],
        format!("request.userInfo.username == 'system:serviceaccount:{NAMESPACE}:teeguard-agent'")
    );
    let validations = validation_expressions(policy);
    assert!(
        validations.iter().any(|v| v.contains(&format!(
            "variables.after.spec.driver == '{DRA_DRIVER}' && variables.before.spec.driver == '{DRA_DRIVER}'"
        ))),
        "{validations:?}"
    );
    assert!(
        validations.iter().any(|v| {
            v.contains("variables.after.spec.?nodeName.orValue('') == variables.tokenNode")
                && v.contains("variables.before.spec.?nodeName.orValue('') == variables.tokenNode")
        }),
        "{validations:?}"
    );
    // The extended-resource policy is still there, unchanged in what it matches.
    find(
        &docs,
        "ValidatingAdmissionPolicy",
        "teeguard-agent-own-node",
    );
    // Off with the policy switch.
    let docs = render_dra(&["--set", "agent.ownNodePolicy.enabled=false"]);
    assert!(all(&docs, "ValidatingAdmissionPolicy").is_empty());
    assert!(all(&docs, "ValidatingAdmissionPolicyBinding").is_empty());
}

#[test]
fn tee_runtime_classes_and_the_accounting_reach_the_config_file() {
    let cfg = config_of(&render_dra(&[]));
    assert_eq!(cfg.agent.accounting, Accounting::Dra);
    assert_eq!(
        cfg.admission
            .tee_runtime_classes
            .into_iter()
            .collect::<Vec<_>>(),
        [
            ("kata-qemu-snp".to_string(), TeeKind::SevEs),
            ("kata-qemu-tdx".to_string(), TeeKind::Tdx),
        ]
    );
    // Without DRA too (the webhook adds the request in both modes).
    let docs = render(
        "default",
        &[
            "--set",
            "config.admission.teeRuntimeClasses.kata-qemu-sev=sev",
        ],
    );
    let cfg = config_of(&docs);
    assert_eq!(cfg.agent.accounting, Accounting::ExtendedResource);
    assert_eq!(
        cfg.admission.tee_runtime_classes.get("kata-qemu-sev"),
        Some(&TeeKind::Sev)
    );
    assert!(
        config_of(&render("default", &[]))
            .admission
            .tee_runtime_classes
            .is_empty()
    );
}

#[test]
fn schema_rejects_bad_dra_values() {
    for (set, field) in [
        ("config.agent.accounting=plugin", "accounting"),
        ("config.admission.teeRuntimeClasses.kata=sgx", "kata"),
        ("agent.kubeletDir=var/lib/kubelet", "kubeletDir"),
        ("dra.deviceClasses.create=maybe", "create"),
        ("dra.classes=1", "classes"),
    ] {
        let out = helm_template_for(DRA_KUBE_VERSION, NAMESPACE, &["default"], &["--set", set]);
        assert!(!out.success, "--set {set} was accepted");
        assert!(
            out.stderr.contains(field),
            "--set {set}: the error does not name {field}:\n{}",
            out.stderr
        );
    }
}
