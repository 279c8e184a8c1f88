//! `teeguard-agent scan`: one scan of the host with the same code `run` uses (scan, attribution, the
//! status it would publish), optionally attributed to the pods of a file, printed as tables, JSON or
//! YAML. No cluster is needed.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Pod;
use serde::Serialize;
use teeguard_shared::Config;
use teeguard_shared::TeeKind;
use teeguard_shared::crd::TeeCapacityStatus;
use teeguard_shared::misc::CgroupLayout;
use teeguard_shared::names::conditions as ct;
use teeguard_shared::ops;

use crate::cli::{OutputFormat, ScanArgs, load_config};
use crate::decide::advertise::{AdvertiseOutcome, Desired};
use crate::decide::attribution::{PodPhase, summarize};
use crate::decide::host::{Driver, HostState, Interest};
use crate::decide::report::{self, KernelView, StatusInput};
use crate::error::{Error, Result};
use crate::kernel::Scanner;

/// One row of the pod table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodRow {
    /// Pod UID (from the pods file or the cgroup name).
    pub uid: String,
    /// `namespace/name`, when the pod is in the pods file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Phase, when the pod is in the pods file.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase: Option<PodPhase>,
    /// Keys requested per kind.
    pub requests: BTreeMap<TeeKind, u64>,
    /// Keys its cgroup holds per kind.
    pub holds: BTreeMap<TeeKind, u64>,
    /// Charges the kernel refused in its cgroup per kind (its `misc.events`), when any.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub refused: BTreeMap<TeeKind, u64>,
}

/// What `scan` prints.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ScanReport {
    /// The cgroup root scanned.
    pub cgroup_root: PathBuf,
    /// Where the misc files were found.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub misc_dir: Option<PathBuf>,
    /// `v1` or `v2`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cgroup_version: Option<&'static str>,
    /// The kubepods cgroup.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kubepods: Option<PathBuf>,
    /// The kubelet's cgroup driver.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub driver: Option<Driver>,
    /// The status the agent would publish (advertised values assume nobody else owns the resources).
    pub status: TeeCapacityStatus,
    /// Pods that request keys or whose cgroup holds keys.
    pub pods: Vec<PodRow>,
    /// Pod-like cgroup directories without a valid UID.
    pub skipped_cgroups: Vec<String>,
    /// Pod cgroups that could not be read.
    pub unreadable_cgroups: Vec<String>,
}

impl ScanReport {
    /// True when the kernel files were read.
    pub fn kernel_readable(&self) -> bool {
        self.status
            .condition(ct::KERNEL_READABLE)
            .is_some_and(|c| c.status == "True")
    }
}

/// Read pods from a file: a `PodList` (or any object with `items`), a YAML/JSON list of pods, or one
/// or more YAML documents each holding a pod or a list.
pub fn read_pods_file(path: &Path) -> Result<Vec<Pod>> {
    let err = |reason: String| Error::PodsFile {
        path: path.to_path_buf(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    let mut out = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(&text).enumerate() {
        let value = <serde_yaml::Value as serde::Deserialize>::deserialize(doc)
            .map_err(|e| err(format!("document {}: {e}", i + 1)))?;
        let items: Vec<serde_yaml::Value> = match value {
            serde_yaml::Value::Null => continue,
            serde_yaml::Value::Sequence(s) => s,
            serde_yaml::Value::Mapping(m) => match m.get("items") {
                Some(serde_yaml::Value::Sequence(s)) => s.clone(),
                Some(serde_yaml::Value::Null) => Vec::new(),
                Some(_) => return Err(err(format!("document {}: `items` is not a list", i + 1))),
                None => vec![serde_yaml::Value::Mapping(m)],
            },
            other => {
                return Err(err(format!(
                    "document {}: expected a PodList, a list of pods or a pod, found {other:?}",
                    i + 1
                )));
            }
        };
        for (j, item) in items.into_iter().enumerate() {
            let pod: Pod = serde_yaml::from_value(item)
                .map_err(|e| err(format!("document {}, pod {}: {e}", i + 1, j + 1)))?;
            out.push(pod);
        }
    }
    Ok(out)
}

/// Scan once with the same code as `run` (scan, attribution, status) and build the report.
pub fn scan_report(
    cgroup_root: &Path,
    config: &Config,
    pods: &[Pod],
    node_name: Option<&str>,
) -> ScanReport {
    let bound: Vec<&Pod> = pods
        .iter()
        .filter(|p| match node_name {
            Some(n) => p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(n),
            None => true,
        })
        .collect();
    let view = summarize(bound.iter().copied(), &config.resources);
    for (_, e) in &view.errors {
        tracing::warn!(error = %e, "pod's TEE quantity is not a whole number; counting it as requesting none");
    }
    let mut scanner = Scanner::new(cgroup_root);
    let mut kernel = KernelView::default();
    kernel.record(scanner.scan(Interest::All));
    if let Some(e) = &kernel.error {
        tracing::error!(error = %e, "scan failed");
    }
    let figures = kernel.figures(&view.pods);
    let desired = Desired::from_figures(config.agent.advertise, &figures);
    let advertising = AdvertiseOutcome::without_node(&desired);
    let counted_pods = report::CountedPods::default()
        .update(&kernel.counted(&view.pods), std::time::Instant::now());
    let status = report::build_status(&StatusInput {
        kernel: &kernel,
        figures: &figures,
        advertising: &advertising,
        resources: &config.resources,
        counted_pods: &counted_pods,
        // `scan` applies no limit.
        enforcing: None,
        previous: None,
        dra: None,
        now: jiff::Timestamp::now(),
    });

    let mut report = ScanReport {
        cgroup_root: cgroup_root.to_path_buf(),
        misc_dir: None,
        cgroup_version: None,
        kubepods: None,
        driver: None,
        status,
        pods: Vec::new(),
        skipped_cgroups: Vec::new(),
        unreadable_cgroups: Vec::new(),
    };
    let mut uids = BTreeSet::new();
    let mut refused: BTreeMap<String, BTreeMap<TeeKind, u64>> = BTreeMap::new();
    if let Some(HostState::Scanned(scan)) = &kernel.last_good {
        for (uid, counts) in &scan.refusals.pods {
            refused.insert(uid.clone(), counts.to_map());
        }
        uids.extend(scan.refusals.pods.keys().cloned());
        report.misc_dir = Some(scan.misc_dir.clone());
        report.cgroup_version = Some(match scan.layout {
            CgroupLayout::V1 => "v1",
            CgroupLayout::V2 => "v2",
        });
        if let Some(p) = &scan.pods {
            report.kubepods = p.kubepods.clone();
            report.driver = p.driver;
            report.skipped_cgroups = p.skipped.clone();
            report.unreadable_cgroups = p.problems.clone();
            uids.extend(p.usage.keys().cloned());
        }
    }
    uids.extend(
        view.pods
            .iter()
            .filter(|p| p.requests_keys())
            .map(|p| p.uid.clone()),
    );
    for uid in uids {
        let pod = view.pods.iter().find(|p| p.uid == uid);
        report.pods.push(PodRow {
            name: pod.map(|p| p.name.clone()),
            phase: pod.map(|p| p.phase),
            requests: pod.map(|p| p.requests.to_map()).unwrap_or_default(),
            holds: report::pod_usage(&kernel, &uid).to_map(),
            refused: refused.remove(&uid).unwrap_or_default(),
            uid,
        });
    }
    report.pods.sort_by(|a, b| {
        (a.name.is_none(), &a.name, &a.uid).cmp(&(b.name.is_none(), &b.name, &b.uid))
    });
    report
}

/// Render a report.
pub fn render(report: &ScanReport, format: OutputFormat) -> Result<String> {
    match format {
        OutputFormat::Json => serde_json::to_string_pretty(report)
            .map(|s| s + "\n")
            .map_err(|e| Error::Render {
                what: "the scan report as JSON",
                reason: e.to_string(),
            }),
        OutputFormat::Yaml => serde_yaml::to_string(report).map_err(|e| Error::Render {
            what: "the scan report as YAML",
            reason: e.to_string(),
        }),
        OutputFormat::Table => Ok(render_table(report)),
    }
}

fn render_table(r: &ScanReport) -> String {
    let mut out = String::new();
    let mut where_ = format!("cgroup root {}", r.cgroup_root.display());
    if let (Some(dir), Some(v)) = (&r.misc_dir, r.cgroup_version) {
        where_.push_str(&format!(": cgroup {v}, misc files in {}", dir.display()));
    }
    if let (Some(k), Some(d)) = (&r.kubepods, r.driver) {
        let d = match d {
            Driver::Systemd => "systemd",
            Driver::Cgroupfs => "cgroupfs",
        };
        where_.push_str(&format!(", pods under {} ({d} driver)", k.display()));
    }
    out.push_str(&where_);
    out.push_str("\n\n");

    let kinds: Vec<_> = r.status.kinds().collect();
    if kinds.is_empty() {
        out.push_str("no TEE key capacity on this host\n");
    } else {
        let mut rows = vec![
            [
                "KIND",
                "RESOURCE",
                "CAPACITY",
                "USED",
                "PODS",
                "EXTERNAL",
                "PENDING",
                "FREE",
                "ADVERTISE",
                "REFUSED",
            ]
            .map(String::from)
            .to_vec(),
        ];
        for (kind, s) in kinds {
            rows.push(vec![
                kind.to_string(),
                s.resource_name.clone(),
                s.capacity.to_string(),
                s.kernel_used.to_string(),
                s.pods_used.to_string(),
                s.external.to_string(),
                s.pending.to_string(),
                s.free.to_string(),
                s.advertised
                    .map_or_else(|| "-".to_string(), |v| v.to_string()),
                s.refused.as_ref().map_or_else(
                    || "-".to_string(),
                    |r| {
                        format!(
                            "pods={},kubepods={},outside={}",
                            r.pods, r.kubepods, r.outside
                        )
                    },
                ),
            ]);
        }
        out.push_str(&table(&rows));
    }

    if !r.pods.is_empty() {
        out.push('\n');
        let mut rows = vec![
            ["POD", "UID", "PHASE", "REQUESTS", "HOLDS", "REFUSED"]
                .map(String::from)
                .to_vec(),
        ];
        let counts = |m: &BTreeMap<TeeKind, u64>| {
            if m.is_empty() {
                "-".to_string()
            } else {
                m.iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",")
            }
        };
        for p in &r.pods {
            rows.push(vec![
                p.name
                    .clone()
                    .unwrap_or_else(|| "(not in pods file)".into()),
                p.uid.clone(),
                p.phase
                    .map_or_else(|| "-".to_string(), |ph| format!("{ph:?}")),
                counts(&p.requests),
                counts(&p.holds),
                counts(&p.refused),
            ]);
        }
        out.push_str(&table(&rows));
    }

    out.push('\n');
    let mut rows = vec![
        ["CONDITION", "STATUS", "REASON", "MESSAGE"]
            .map(String::from)
            .to_vec(),
    ];
    for c in &r.status.conditions {
        rows.push(vec![
            c.type_.clone(),
            c.status.clone(),
            c.reason.clone(),
            c.message.clone(),
        ]);
    }
    out.push_str(&table(&rows));
    if !r.skipped_cgroups.is_empty() {
        out.push_str(&format!(
            "\npod cgroups without a valid UID (their keys count as external): {}\n",
            r.skipped_cgroups.join(", ")
        ));
    }
    if !r.unreadable_cgroups.is_empty() {
        out.push_str("\nunreadable pod cgroups:\n");
        for u in &r.unreadable_cgroups {
            out.push_str(&format!("  {u}\n"));
        }
    }
    out
}

fn table(rows: &[Vec<String>]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..cols)
        .map(|i| {
            rows.iter()
                .filter_map(|r| r.get(i))
                .map(|c| c.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (i, cell) in row.iter().enumerate() {
            if i + 1 == row.len() {
                line.push_str(cell);
            } else {
                line.push_str(cell);
                line.push_str(&" ".repeat(widths[i] - cell.chars().count() + 2));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// `teeguard-agent scan`: print one scan. Returns whether the kernel files were readable (the exit
/// status is 1 when they were not).
pub fn scan_command(args: &ScanArgs, out: &mut impl Write) -> Result<bool> {
    ops::init_tracing(args.common.log_format);
    let config = load_config(args.common.config.as_deref())?;
    let pods = match &args.pods {
        Some(p) => read_pods_file(p)?,
        None => Vec::new(),
    };
    let report = scan_report(
        &args.common.cgroup_root,
        &config,
        &pods,
        args.node_name.as_deref(),
    );
    let text = render(&report, args.output)?;
    out.write_all(text.as_bytes()).map_err(|e| Error::Render {
        what: "the scan report to stdout",
        reason: e.to_string(),
    })?;
    Ok(report.kernel_readable())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pods_file_shapes() {
        let d = tempfile::tempdir().expect("tempdir");
        let pod = |n: &str| {
            format!(
                "{{\"apiVersion\": \"v1\", \"kind\": \"Pod\", \"metadata\": {{\"name\": \"{n}\", \"uid\": \"{n}\"}}}}"
            )
        };
        let cases = [
            (
                format!(
                    "{{\"kind\": \"PodList\", \"items\": [{}, {}]}}",
                    pod("a"),
                    pod("b")
                ),
                2,
            ),
            (format!("[{}]", pod("a")), 1),
            (format!("{}\n---\n{}\n---\n", pod("a"), pod("b")), 2),
            ("kind: PodList\nitems: []\n".to_string(), 0),
        ];
        for (i, (text, n)) in cases.iter().enumerate() {
            let p = d.path().join(format!("p{i}"));
            std::fs::write(&p, text).expect("write");
            assert_eq!(read_pods_file(&p).expect(text).len(), *n, "{text}");
        }
        for bad in ["42\n", "items: 3\n", "[1, 2]\n", "{"] {
            let p = d.path().join("bad");
            std::fs::write(&p, bad).expect("write");
            let e = read_pods_file(&p).expect_err(bad);
            assert!(e.to_string().starts_with("pods file"), "{e}");
        }
    }
}
