//! The command lines the chart renders parse with the binaries' real command-line definitions, and the
//! parsed addresses, directories and files match the container ports and volume mounts around them.
//!
//! Needs `TEEGUARD_HELM` (set by `scripts/chart-tools.sh`, which `scripts/test.sh` sources).

mod chart_support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use chart_support::*;
use clap::Parser;
use serde_json::Value;
use teeguard_shared::ops::LogFormat;

/// command + args of the workload's only container, with `$(NODE_NAME)` expanded as the kubelet does.
fn command_line(workload: &Value, node: &str) -> Vec<String> {
    let c = &workload["spec"]["template"]["spec"]["containers"][0];
    let mut line: Vec<String> = Vec::new();
    for field in ["command", "args"] {
        for a in c[field].as_array().expect(field) {
            line.push(a.as_str().expect("string").replace("$(NODE_NAME)", node));
        }
    }
    line
}

fn container_port(workload: &Value, name: &str) -> u16 {
    let ports = workload["spec"]["template"]["spec"]["containers"][0]["ports"]
        .as_array()
        .expect("ports");
    let p = ports
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no container port {name}"));
    u16::try_from(p["containerPort"].as_u64().expect("port")).expect("port fits u16")
}

fn mount_path(workload: &Value, volume: &str) -> PathBuf {
    let mounts = workload["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
        .as_array()
        .expect("volumeMounts");
    let m = mounts
        .iter()
        .find(|m| m["name"] == volume)
        .unwrap_or_else(|| panic!("no mount of volume {volume}"));
    PathBuf::from(m["mountPath"].as_str().expect("mountPath"))
}

fn assert_binary(line: &[String], name: &str) {
    assert_eq!(
        Path::new(&line[0]).file_name().and_then(|n| n.to_str()),
        Some(name),
        "{line:?}"
    );
}

/// tests/chart/custom.yaml sets webhook.logFormat=text; everything else keeps the default json.
fn webhook_log_format(stem: &str) -> LogFormat {
    if stem == "custom" {
        LogFormat::Text
    } else {
        LogFormat::Json
    }
}

#[test]
fn webhook_command_line_parses_and_matches_ports_and_mounts() {
    for stem in VALUES_FILES {
        let docs = render(stem, &[]);
        let d = only(&docs, "Deployment");
        let line = command_line(d, "node-a");
        assert_binary(&line, "teeguard-webhook");
        let cli = teeguard_webhook::cli::Cli::try_parse_from(&line).unwrap_or_else(|e| {
            panic!("{stem}: teeguard-webhook rejects the chart's command line {line:?}:\n{e}")
        });
        assert_eq!(cli.log_format, webhook_log_format(stem), "{stem}");
        let teeguard_webhook::cli::Command::Serve(serve) = cli.command else {
            panic!("{stem}: the chart must run `teeguard-webhook serve`: {line:?}");
        };
        let https: SocketAddr = serve.listen;
        assert_eq!(https.port(), container_port(d, "https"), "{stem}");
        assert_eq!(
            serve.admin_listen.port(),
            container_port(d, "admin"),
            "{stem}"
        );
        assert_eq!(serve.cert_dir, mount_path(d, "tls"), "{stem}");
        assert_eq!(
            serve.config,
            Some(mount_path(d, "config").join("config.yaml")),
            "{stem}"
        );
    }
}

#[test]
fn agent_command_line_parses_and_matches_ports_and_mounts() {
    for stem in VALUES_FILES {
        let docs = render(stem, &[]);
        let ds = only(&docs, "DaemonSet");
        let line = command_line(ds, "node-a");
        assert_binary(&line, "teeguard-agent");
        let cli = teeguard_agent::cli::Cli::try_parse_from(&line).unwrap_or_else(|e| {
            panic!("{stem}: teeguard-agent rejects the chart's command line {line:?}:\n{e}")
        });
        let teeguard_agent::cli::Command::Run(run) = cli.command else {
            panic!("{stem}: the chart must run `teeguard-agent run`: {line:?}");
        };
        assert_eq!(
            run.node_name, "node-a",
            "{stem}: --node-name must come from NODE_NAME"
        );
        assert_eq!(run.admin_addr.port(), container_port(ds, "admin"), "{stem}");
        assert_eq!(
            run.common.cgroup_root,
            mount_path(ds, "host-cgroup"),
            "{stem}"
        );
        assert_eq!(
            run.common.config,
            Some(mount_path(ds, "config").join("config.yaml")),
            "{stem}"
        );
        assert_eq!(run.common.log_format, LogFormat::Json, "{stem}");
    }
}

/// The kubelet sends SIGKILL `terminationGracePeriodSeconds` after SIGTERM: the webhook's own shutdown
/// (serving through the grace, then draining) must end before that, or a rollout cuts requests off.
fn assert_termination_covers_shutdown(d: &Value, what: &str) -> (u64, std::time::Duration) {
    let line = command_line(d, "node-a");
    let cli = teeguard_webhook::cli::Cli::try_parse_from(&line)
        .unwrap_or_else(|e| panic!("{what}: {line:?}:\n{e}"));
    let teeguard_webhook::cli::Command::Serve(serve) = cli.command else {
        panic!("{what}: not `serve`: {line:?}");
    };
    let termination = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        .as_u64()
        .unwrap_or_else(|| panic!("{what}: no terminationGracePeriodSeconds"));
    let shutdown = serve.shutdown_grace + serve.drain_timeout;
    assert!(
        shutdown + std::time::Duration::from_secs(5) <= std::time::Duration::from_secs(termination),
        "{what}: grace {:?} + drain {:?} leaves less than 5 s before SIGKILL at {termination} s",
        serve.shutdown_grace,
        serve.drain_timeout
    );
    assert!(
        !serve.shutdown_grace.is_zero(),
        "{what}: the chart must keep serving after SIGTERM while the endpoint removal propagates"
    );
    (termination, serve.shutdown_grace)
}

#[test]
fn webhook_termination_grace_covers_the_shutdown_grace_and_the_drain() {
    for stem in VALUES_FILES {
        let docs = render(stem, &[]);
        assert_termination_covers_shutdown(only(&docs, "Deployment"), stem);
    }
    let docs = render("default", &[]);
    let (termination, grace) =
        assert_termination_covers_shutdown(only(&docs, "Deployment"), "default");
    assert_eq!(
        (termination, grace),
        (35, std::time::Duration::from_secs(10))
    );
    let docs = render(
        "default",
        &[
            "--set",
            "webhook.shutdownGraceSeconds=30",
            "--set",
            "webhook.drainTimeoutSeconds=60",
        ],
    );
    let (termination, grace) =
        assert_termination_covers_shutdown(only(&docs, "Deployment"), "grace 30, drain 60");
    assert_eq!(
        (termination, grace),
        (95, std::time::Duration::from_secs(30))
    );
}
