//! The chart gives the agent what its enforcement mode (`config.enforcement.mode`) needs and nothing
//! more: the NRI socket's directory for `auto`/`nri`, a writable host cgroup tree for `auto`/`cgroup`,
//! root (still without any capability) whenever it enforces, and the read-only non-root agent with `off`.
//! The config file the agent reads carries the mode, and the schema refuses bad enforcement values.
//!
//! Needs `TEEGUARD_HELM` and `TEEGUARD_KUBERNETES_VALIDATE` (set by `scripts/chart-tools.sh`).

mod chart_support;

use std::path::Path;

use chart_support::*;
use serde_json::{Value, json};
use teeguard_shared::Config;
use teeguard_shared::config::EnforcementMode;

/// What one mode must render.
#[derive(Debug)]
struct Expect {
    mode: &'static str,
    parsed: EnforcementMode,
    nri_mount: bool,
    cgroup_writable: bool,
    root: bool,
}

const MODES: [Expect; 4] = [
    Expect {
        mode: "auto",
        parsed: EnforcementMode::Auto,
        nri_mount: true,
        cgroup_writable: true,
        root: true,
    },
    Expect {
        mode: "nri",
        parsed: EnforcementMode::Nri,
        nri_mount: true,
        cgroup_writable: false,
        root: true,
    },
    Expect {
        mode: "cgroup",
        parsed: EnforcementMode::Cgroup,
        nri_mount: false,
        cgroup_writable: true,
        root: true,
    },
    Expect {
        mode: "off",
        parsed: EnforcementMode::Off,
        nri_mount: false,
        cgroup_writable: false,
        root: false,
    },
];

/// The config file as the agent reads it: the ConfigMap's `config.yaml`, parsed by the real loader.
fn agent_config(docs: &[Value]) -> Config {
    let text = str_at(only(docs, "ConfigMap"), "/data/config.yaml");
    Config::from_yaml(text).unwrap_or_else(|e| panic!("not a valid config: {e}\n{text}"))
}

#[test]
fn each_enforcement_mode_gets_exactly_the_mounts_and_user_it_needs() {
    for want in &MODES {
        let set = format!("config.enforcement.mode={}", want.mode);
        let docs = render("default", &["--set", &set]);
        let ds = find(&docs, "DaemonSet", "teeguard-agent");
        let mode = want.mode;

        // Root only when enforcing; every capability dropped in all modes.
        assert_hardened(ds, if want.root { 0 } else { 65532 });

        let (cgroup, _) = mount(ds, "host-cgroup");
        assert_eq!(cgroup["mountPath"], "/host/sys/fs/cgroup", "{mode}");
        assert_eq!(
            cgroup["readOnly"], !want.cgroup_writable,
            "{mode}: host cgroup tree readOnly"
        );

        let cfg = agent_config(&docs);
        assert_eq!(cfg.enforcement.mode, want.parsed, "{mode}");
        assert!(!cfg.enforcement.strict, "{mode}");
        assert_eq!(cfg.enforcement.nri_plugin_index, "50", "{mode}");
        assert_eq!(
            cfg.enforcement.nri_socket,
            Path::new("/var/run/nri/nri.sock"),
            "{mode}"
        );
        if want.nri_mount {
            let (m, v) = mount(ds, "nri");
            assert_eq!(m["mountPath"], "/var/run/nri", "{mode}");
            assert!(
                cfg.enforcement
                    .nri_socket
                    .starts_with(str_at(m, "/mountPath")),
                "{mode}: the configured socket is not inside the mount"
            );
            assert_eq!(
                v["hostPath"],
                json!({"path": "/var/run/nri", "type": "DirectoryOrCreate"}),
                "{mode}"
            );
        } else {
            assert!(try_mount(ds, "nri").is_none(), "{mode}: NRI mounted");
            let volumes = ds["spec"]["template"]["spec"]["volumes"]
                .as_array()
                .expect("volumes");
            assert!(
                volumes.iter().all(|v| v["name"] != "nri"),
                "{mode}: NRI volume without a mount"
            );
        }
        // Only the config and the cgroup tree (and the NRI directory) come from outside the image.
        let mounts = container(ds)["volumeMounts"]
            .as_array()
            .expect("volumeMounts")
            .len();
        assert_eq!(mounts, if want.nri_mount { 3 } else { 2 }, "{mode}");

        validate(&format!("--set {set}"), &docs);
    }
}

#[test]
fn the_nri_mount_follows_the_configured_socket_and_the_config_carries_every_key() {
    // custom.yaml: mode nri, strict, a containerd-specific socket path, index 07.
    let docs = render("custom", &[]);
    let ds = find(&docs, "DaemonSet", "tg-agent");
    let cfg = agent_config(&docs);
    assert_eq!(cfg.enforcement.mode, EnforcementMode::Nri);
    assert!(cfg.enforcement.strict);
    assert_eq!(cfg.enforcement.nri_plugin_index, "07");
    assert_eq!(
        cfg.enforcement.nri_socket,
        Path::new("/run/containerd/nri/nri.sock")
    );
    let (m, v) = mount(ds, "nri");
    assert_eq!(m["mountPath"], "/run/containerd/nri");
    assert_eq!(
        v["hostPath"],
        json!({"path": "/run/containerd/nri", "type": "DirectoryOrCreate"})
    );
    assert_eq!(mount(ds, "host-cgroup").0["readOnly"], true);
    assert_hardened(ds, 0);

    // Keys set to null fall back to the defaults, in the config and in the DaemonSet alike.
    let docs = render(
        "custom",
        &[
            "--set",
            "config.enforcement.mode=null",
            "--set",
            "config.enforcement.nriSocket=null",
        ],
    );
    let ds = find(&docs, "DaemonSet", "tg-agent");
    let cfg = agent_config(&docs);
    assert_eq!(cfg.enforcement.mode, EnforcementMode::Auto);
    assert_eq!(
        cfg.enforcement.nri_socket,
        Path::new("/var/run/nri/nri.sock")
    );
    assert_eq!(mount(ds, "nri").0["mountPath"], "/var/run/nri");
    assert_eq!(mount(ds, "host-cgroup").0["readOnly"], false);
}

#[test]
fn default_values_spell_out_the_enforcement_defaults() {
    let docs = render("default", &[]);
    let text = str_at(only(&docs, "ConfigMap"), "/data/config.yaml");
    for key in [
        "mode: auto",
        "strict: false",
        "nriSocket: /var/run/nri/nri.sock",
        "nriPluginIndex: \"50\"",
    ] {
        assert!(text.contains(key), "{key} missing from:\n{text}");
    }
    assert_eq!(
        agent_config(&docs).enforcement,
        Config::default().enforcement
    );
}

#[test]
fn schema_rejects_bad_enforcement_values() {
    let cases: [(&str, &str, &str); 5] = [
        ("--set", "config.enforcement.mode=kernel", "mode"),
        (
            "--set-string",
            "config.enforcement.nriPluginIndex=5",
            "nriPluginIndex",
        ),
        (
            "--set-string",
            "config.enforcement.nriPluginIndex=100",
            "nriPluginIndex",
        ),
        (
            "--set",
            "config.enforcement.nriSocket=nri.sock",
            "nriSocket",
        ),
        // Its directory would be the host's root.
        (
            "--set",
            "config.enforcement.nriSocket=/nri.sock",
            "nriSocket",
        ),
    ];
    for (flag, set, field) in cases {
        let out = helm_template(&["default"], &[flag, set]);
        assert!(!out.success, "{flag} {set} was accepted");
        assert!(
            out.stderr.contains(field),
            "{flag} {set}: the error does not name {field}:\n{}",
            out.stderr
        );
    }
    for (flag, set) in [
        ("--set", "config.enforcement.strict=true"),
        ("--set-string", "config.enforcement.nriPluginIndex=07"),
        (
            "--set",
            "config.enforcement.nriSocket=/run/k3s/nri/nri.sock",
        ),
    ] {
        let out = helm_template(&["default"], &[flag, set]);
        assert!(out.success, "{flag} {set} refused:\n{}", out.stderr);
    }
}
