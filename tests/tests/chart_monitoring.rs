//! The chart's monitoring (off by default): PodMonitors / ServiceMonitors, the PrometheusRule and the
//! Grafana dashboard, checked by the real rule engine. `promtool check rules` parses every alert and
//! its annotation templates; `promtool test rules` runs the unit tests of
//! `tests/monitoring/alerts.test.yaml` (which alerts fire, for which labels, and which do not); every
//! dashboard panel's query is checked as a recording rule; and every metric an alert or panel reads
//! must be one the webhook or the agent exports.
//!
//! promtool comes from the Debian package `prometheus` (scripts/test.sh installs it); `TEEGUARD_PROMTOOL`
//! names another. Without it the promtool tests skip with one line, unless `CI=true`.

mod chart_support;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// Every monitoring object enabled.
const ENABLED: [&str; 8] = [
    "--set",
    "monitoring.podMonitor.enabled=true",
    "--set",
    "monitoring.serviceMonitor.enabled=true",
    "--set",
    "monitoring.prometheusRule.enabled=true",
    "--set",
    "monitoring.dashboard.enabled=true",
];

fn promtool() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TEEGUARD_PROMTOOL") {
        return Some(PathBuf::from(p));
    }
    let found = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join("promtool"))
            .find(|p| p.is_file())
    });
    if found.is_none() {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "promtool not found and CI=true: install the Debian package prometheus (scripts/test.sh does)"
        );
        eprintln!(
            "skipped: promtool not found (Debian package prometheus, or set TEEGUARD_PROMTOOL)"
        );
    }
    found
}

fn run_promtool(promtool: &Path, args: &[&str]) -> String {
    let out = Command::new(promtool)
        .args(args)
        .output()
        .expect("promtool runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

fn rendered() -> Vec<Value> {
    chart_support::render("default", &ENABLED)
}

/// The PrometheusRule's `spec` (its rule groups), as promtool reads a rules file.
fn rule_groups(docs: &[Value]) -> Value {
    let rule = docs
        .iter()
        .find(|d| d["kind"] == "PrometheusRule")
        .expect("a PrometheusRule");
    rule["spec"].clone()
}

/// The dashboard JSON, from the rendered ConfigMap (so what the chart ships is what is checked).
fn dashboard(docs: &[Value]) -> Value {
    let cm = docs
        .iter()
        .find(|d| d["kind"] == "ConfigMap" && d["metadata"]["labels"]["grafana_dashboard"] == "1")
        .expect("the dashboard ConfigMap with grafana_dashboard: \"1\"");
    serde_json::from_str(
        cm["data"]["teeguard.json"]
            .as_str()
            .expect("dashboard JSON"),
    )
    .expect("the dashboard parses")
}

fn panel_queries(dash: &Value) -> Vec<(String, String)> {
    dash["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .flat_map(|p| {
            let title = p["title"].as_str().unwrap_or("").to_string();
            p["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .map(move |t| (title.clone(), t["expr"].as_str().unwrap_or("").to_string()))
        })
        .collect()
}

fn alert_exprs(groups: &Value) -> Vec<(String, String)> {
    groups["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules").iter())
        .map(|r| {
            (
                r["alert"].as_str().unwrap_or("").to_string(),
                r["expr"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

fn write_yaml(path: &Path, value: &Value) {
    std::fs::write(path, serde_yaml::to_string(value).expect("yaml")).expect("write");
}

#[test]
fn monitoring_objects_render_only_when_enabled() {
    let off = chart_support::render("default", &[]);
    for kind in ["PodMonitor", "ServiceMonitor", "PrometheusRule"] {
        assert!(
            off.iter().all(|d| d["kind"] != kind),
            "{kind} rendered by default"
        );
    }
    assert!(
        off.iter()
            .all(|d| d["metadata"]["labels"]["grafana_dashboard"].is_null()),
        "dashboard rendered by default"
    );
    let on = rendered();
    let count = |kind: &str| on.iter().filter(|d| d["kind"] == kind).count();
    assert_eq!(count("PodMonitor"), 2, "webhook and agent");
    assert_eq!(count("ServiceMonitor"), 2, "webhook and agent");
    assert_eq!(count("PrometheusRule"), 1);
    // Every monitor scrapes the admin port and labels series with the node and a fixed job.
    for m in on
        .iter()
        .filter(|d| d["kind"] == "PodMonitor" || d["kind"] == "ServiceMonitor")
    {
        let endpoints = m["spec"]["podMetricsEndpoints"]
            .as_array()
            .or(m["spec"]["endpoints"].as_array())
            .expect("endpoints");
        let e = &endpoints[0];
        assert_eq!(
            (e["port"].as_str(), e["path"].as_str()),
            (Some("admin"), Some("/metrics"))
        );
        let relabel = serde_json::to_string(&e["relabelings"]).expect("json");
        assert!(
            relabel.contains("__meta_kubernetes_pod_node_name"),
            "{relabel}"
        );
        assert!(
            relabel.contains("teeguard-webhook") || relabel.contains("teeguard-agent"),
            "{relabel}"
        );
    }
    dashboard(&on);
}

#[test]
fn alerts_pass_promtool_and_their_unit_tests() {
    let Some(promtool) = promtool() else { return };
    let groups = rule_groups(&rendered());
    let dir = tempfile::tempdir().expect("tmp");
    // As rendered, annotations included: promtool checks the PromQL and every template.
    let full = dir.path().join("full-rules.yaml");
    write_yaml(&full, &groups);
    let out = run_promtool(&promtool, &["check", "rules", full.to_str().expect("path")]);
    assert!(out.contains("SUCCESS"), "{out}");
    // The unit tests compare annotations verbatim: they run on the rules without them.
    let mut bare = groups.clone();
    for g in bare["groups"].as_array_mut().expect("groups") {
        for r in g["rules"].as_array_mut().expect("rules") {
            r.as_object_mut().expect("rule").remove("annotations");
        }
    }
    write_yaml(&dir.path().join("rules.yaml"), &bare);
    let tests = chart_support::repo_root().join("tests/monitoring/alerts.test.yaml");
    let copy = dir.path().join("alerts.test.yaml");
    std::fs::copy(&tests, &copy).expect("copy the unit tests");
    let out = run_promtool(&promtool, &["test", "rules", copy.to_str().expect("path")]);
    assert!(out.contains("SUCCESS"), "{out}");
    // Every alert has a unit test.
    let unit = std::fs::read_to_string(&tests).expect("read");
    for (alert, _) in alert_exprs(&groups) {
        assert!(
            unit.contains(&format!("alertname: {alert}")),
            "{alert} has no unit test"
        );
    }
}

#[test]
fn dashboard_queries_are_valid_promql() {
    let Some(promtool) = promtool() else { return };
    let queries = panel_queries(&dashboard(&rendered()));
    assert!(queries.len() >= 10, "{} panels", queries.len());
    let rules: Vec<Value> = queries
        .iter()
        .enumerate()
        .map(|(i, (_, expr))| serde_json::json!({"record": format!("teeguard:dashboard:panel_{i}"), "expr": expr}))
        .collect();
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("dashboard-rules.yaml");
    write_yaml(
        &file,
        &serde_json::json!({"groups": [{"name": "dashboard", "rules": rules}]}),
    );
    let out = run_promtool(&promtool, &["check", "rules", file.to_str().expect("path")]);
    assert!(
        out.contains(&format!("SUCCESS: {} rules found", queries.len())),
        "{out}"
    );
}

#[test]
fn enforcement_alert_is_rendered_unless_enforcement_is_off() {
    let failing = |docs: &[Value]| {
        alert_exprs(&rule_groups(docs))
            .into_iter()
            .filter(|(alert, _)| alert == "TeeguardEnforcementFailing")
            .map(|(_, expr)| expr)
            .collect::<Vec<_>>()
    };
    let on = failing(&rendered());
    assert_eq!(on.len(), 2, "not enforcing, and limit failures: {on:#?}");
    assert!(on.iter().any(|e| e.contains("teeguard_agent_enforcing")));
    assert!(
        on.iter()
            .any(|e| e.contains("teeguard_agent_limit_failures_total"))
    );
    for mode in ["nri", "cgroup"] {
        let mut args = ENABLED.to_vec();
        let set = format!("config.enforcement.mode={mode}");
        args.extend(["--set", set.as_str()]);
        assert_eq!(
            failing(&chart_support::render("default", &args)).len(),
            2,
            "{mode}"
        );
    }
    let mut off = ENABLED.to_vec();
    off.extend(["--set", "config.enforcement.mode=off"]);
    let docs = chart_support::render("default", &off);
    assert!(
        failing(&docs).is_empty(),
        "enforcement off: nothing to alert on"
    );
    assert!(
        alert_exprs(&rule_groups(&docs))
            .iter()
            .any(|(a, _)| a == "TeeguardAgentDown"),
        "the other alerts stay"
    );
}

/// The series names the webhook and the agent export (counters with `_total`, histograms with
/// `_bucket`, `_sum`, `_count`), read from their registries' text encoding after one count in every
/// labelled family (a family shows in the encoding only once it has a series).
fn exported() -> BTreeSet<String> {
    use teeguard_webhook::metrics::{Cache, EventResult, LookupResult, Outcome, ReloadResult};
    let mut registry = prometheus_client::registry::Registry::default();
    let webhook = teeguard_webhook::metrics::Metrics::new(&mut registry);
    webhook.observe_request(
        "mutate",
        Outcome::Patched,
        std::time::Duration::from_micros(10),
    );
    webhook.validation(
        "binding",
        "tdx",
        teeguard_webhook::metrics::ValidationOutcome::Denied,
    );
    webhook.lookup(Cache::Vmis, LookupResult::CacheHit);
    webhook.set_cache_objects(Cache::Vmis, 1);
    webhook.cert_reload(ReloadResult::Ok);
    webhook.vmi_event(EventResult::Recorded);
    let agent = teeguard_agent::metrics::Metrics::new(&mut registry);
    agent.set_figures(&[(teeguard_shared::TeeKind::Tdx, Default::default())].into());
    agent.api_error("publish");
    agent.limit_applied("nri", teeguard_shared::TeeKind::Tdx);
    agent.limit_mismatch("nri");
    agent.limit_failure("cgroup");
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
    let mut names = BTreeSet::new();
    for line in text.lines() {
        let mut parts = line.split_whitespace();
        if parts.next() != Some("#") || parts.next() != Some("TYPE") {
            continue;
        }
        let (Some(name), Some(kind)) = (parts.next(), parts.next()) else {
            continue;
        };
        match kind {
            "counter" => {
                names.insert(format!("{name}_total"));
            }
            "histogram" => {
                for suffix in ["_bucket", "_sum", "_count"] {
                    names.insert(format!("{name}{suffix}"));
                }
            }
            _ => {
                names.insert(name.to_string());
            }
        }
    }
    names
}

fn referenced(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("teeguard_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.insert(tail[..end].to_string());
        rest = &tail[end..];
    }
    out
}

#[test]
fn every_metric_in_the_alerts_and_the_dashboard_is_exported() {
    let docs = rendered();
    let exported = exported();
    assert!(
        exported.contains("teeguard_agent_free_keys"),
        "{exported:?}"
    );
    assert!(
        exported.contains("teeguard_webhook_validations_total"),
        "{exported:?}"
    );
    let mut uses: Vec<(String, String)> = alert_exprs(&rule_groups(&docs));
    uses.extend(panel_queries(&dashboard(&docs)));
    let mut missing = Vec::new();
    for (what, expr) in &uses {
        for name in referenced(expr) {
            if !exported.contains(&name) {
                missing.push(format!("{what}: {name}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not exported by the webhook or the agent: {missing:#?}"
    );
    // The checker itself notices a name that does not exist.
    assert!(
        referenced("rate(teeguard_webhook_no_such_thing_total[5m])")
            .iter()
            .any(|n| !exported.contains(n))
    );
}
