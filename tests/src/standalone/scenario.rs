//! The standalone's story: a TDX host fills up with KubeVirt VMs, a Kata pod and VMs outside
//! Kubernetes; teeguard's webhook refuses what cannot get a key, and admits it again once a key is
//! free. Every decision shown comes from the webhook over HTTPS; every "free" figure from the agent's
//! published `TeeCapacity` after it has caught up with the simulated kernel.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;
use teeguard_shared::TeeKind;
use teeguard_shared::crd::KindStatus;

use super::client::{Decision, ReviewReply};
use super::cluster::{Standalone, TEE_NODE};
use super::driver::{CreatedVmi, PodAdmission, SimKubelet, VmiSpec};
use super::table::{Row, StepTable};
use crate::fixtures::{KataTee, Tee, kata_pod};
use crate::host::{SANDBOX, TDX};
use crate::{Error, Result};

/// How long a step waits for the agent's report to catch up with the host.
pub const REPORT_DEADLINE: Duration = Duration::from_secs(15);
/// How long to wait for an event the webhook records.
pub const EVENT_DEADLINE: Duration = Duration::from_secs(3);

/// What the scenario did, for the summary and for tests.
#[derive(Clone, Debug, Default)]
pub struct ScenarioReport {
    /// Every row printed.
    pub rows: Vec<Row>,
    /// Pods `/mutate` patched.
    pub patched: usize,
    /// Pod CREATEs `/validate` refused.
    pub pod_denials: usize,
    /// Bindings `/validate` refused.
    pub binding_denials: usize,
    /// VMs the kernel refused a key when they started (teeguard exists to keep this at zero).
    pub failed_starts: usize,
    /// Highest kernel usage seen after any step.
    pub peak_used: u64,
    /// The host's capacity.
    pub capacity: u64,
    /// The last settled figures.
    pub last: Option<KindStatus>,
    /// Events the webhook recorded on VMIs (`reason: message`).
    pub vmi_events: Vec<String>,
    /// The `misc.max` the agent set on a running VM's pod cgroup (`tdx 1`), when it did.
    pub pod_limit: Option<String>,
    /// A second key charged in that pod was refused by the kernel.
    pub over_limit_refused: bool,
}

struct Runner<'a, W: Write> {
    sa: &'a Standalone,
    out: &'a mut W,
    table: StepTable,
    step: usize,
    report: ScenarioReport,
    vms: BTreeMap<String, (CreatedVmi, Option<Pod>)>,
}

/// How one pod's admission ended.
enum Admitted {
    /// Persisted, waiting for the scheduler.
    Pod(Box<Pod>),
    /// Refused.
    Refused,
}

impl<'a, W: Write> Runner<'a, W> {
    fn emit(&mut self, row: Row) -> Result<()> {
        let text = self.table.row(&row);
        self.out
            .write_all(text.as_bytes())
            .and_then(|()| self.out.flush())
            .map_err(|source| Error::Io {
                component: "standalone",
                what: "write the table to stdout".into(),
                source,
            })?;
        self.report.rows.push(row);
        Ok(())
    }

    fn next_step(&mut self) -> String {
        self.step += 1;
        self.step.to_string()
    }

    fn kubelet(&self) -> SimKubelet<'_> {
        SimKubelet {
            node: TEE_NODE.to_string(),
            host: &self.sa.host,
            api: &self.sa.api,
        }
    }

    /// Wait for the agent's report to agree with the host and the API server, then for the webhook's
    /// cache to receive it. Returns the free keys as a table cell.
    async fn settle(&mut self) -> Result<String> {
        let s = self
            .sa
            .driver
            .settle(TEE_NODE, TeeKind::Tdx, &self.sa.host, REPORT_DEADLINE)
            .await?;
        self.report.peak_used = self.report.peak_used.max(self.sa.host.usage(TDX));
        let free = s.free.to_string();
        self.report.last = Some(s);
        Ok(free)
    }

    fn free(&self) -> String {
        self.report
            .last
            .as_ref()
            .map_or_else(|| "?".to_string(), |s| s.free.to_string())
    }

    async fn external_start(&mut self, name: &str, keys: u64) -> Result<()> {
        let step = self.next_step();
        self.sa.host.add_external(name, TDX, keys)?;
        let free = self.settle().await?;
        self.emit(Row {
            step,
            object: name.to_string(),
            who: "host".into(),
            decision: "started".into(),
            free,
            message: format!(
                "a VM outside Kubernetes (libvirt) takes {keys} TDX key{}; the agent reports {} as \
                 external",
                if keys == 1 { "" } else { "s" },
                if keys == 1 { "it" } else { "them" }
            ),
        })
    }

    async fn external_stop(&mut self, name: &str) -> Result<()> {
        let step = self.next_step();
        self.sa.host.remove_external(name)?;
        let free = self.settle().await?;
        self.emit(Row {
            step,
            object: name.to_string(),
            who: "host".into(),
            decision: "stopped".into(),
            free,
            message: "the VM outside Kubernetes exits; its key is free again".into(),
        })
    }

    /// Create the VMI (first try) and run its virt-launcher pod's CREATE through both webhooks.
    async fn create_vm_pod(&mut self, name: &str) -> Result<Admitted> {
        let vmi = match self.vms.get(name) {
            Some((vmi, _)) => vmi.clone(),
            None => {
                let vmi = self.sa.driver.create_vmi(&VmiSpec::new(name, Tee::Tdx))?;
                self.vms.insert(name.to_string(), (vmi.clone(), None));
                vmi
            }
        };
        let step = self.next_step();
        let adm = self.sa.driver.create_launcher_pod(&vmi).await?;
        self.pod_rows(step, &format!("{name} pod"), &adm)?;
        match adm.pod {
            Some(p) => {
                if let Some(entry) = self.vms.get_mut(name) {
                    entry.1 = Some(p.clone());
                }
                Ok(Admitted::Pod(Box::new(p)))
            }
            None => {
                self.vmi_event_row(&vmi).await?;
                Ok(Admitted::Refused)
            }
        }
    }

    fn pod_rows(&mut self, step: String, object: &str, adm: &PodAdmission) -> Result<()> {
        if adm.mutate.decision() == Decision::Patched {
            self.report.patched += 1;
        }
        let free = self.free();
        self.emit(Row {
            step,
            object: object.to_string(),
            who: "/mutate".into(),
            decision: decision_word(&adm.mutate),
            free: free.clone(),
            message: describe_mutation(&adm.mutate),
        })?;
        if let Some(v) = &adm.validate {
            if !v.allowed {
                self.report.pod_denials += 1;
            }
            self.emit(Row {
                step: String::new(),
                object: object.to_string(),
                who: "/validate".into(),
                decision: decision_word(v),
                free,
                message: describe_validation(v),
            })?;
        }
        Ok(())
    }

    /// The event the webhook records on a VMI whose pod or binding it refused.
    async fn vmi_event_row(&mut self, vmi: &CreatedVmi) -> Result<()> {
        let got = self
            .sa
            .driver
            .wait_event(
                &vmi.spec.namespace,
                "VirtualMachineInstance",
                &vmi.spec.name,
                teeguard_shared::names::reasons::INSUFFICIENT_TEE_KEYS,
                EVENT_DEADLINE,
            )
            .await;
        let (decision, message) = match got {
            Ok(e) => {
                let reason = e.get("reason").and_then(Value::as_str).unwrap_or_default();
                let msg = e
                    .get("message")
                    .or_else(|| e.get("note"))
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                self.report.vmi_events.push(format!("{reason}: {msg}"));
                (
                    "event".to_string(),
                    format!(
                        "{} {reason} recorded on the VMI with the same message \
                         (`kubectl describe vmi {}` shows it)",
                        e.get("type").and_then(Value::as_str).unwrap_or("Warning"),
                        vmi.spec.name
                    ),
                )
            }
            Err(_) => (
                "-".to_string(),
                format!(
                    "no {} event was recorded on the VMI within {EVENT_DEADLINE:?}",
                    teeguard_shared::names::reasons::INSUFFICIENT_TEE_KEYS
                ),
            ),
        };
        let free = self.free();
        self.emit(Row {
            step: String::new(),
            object: format!("vmi {}", vmi.spec.name),
            who: "webhook".into(),
            decision,
            free,
            message,
        })
    }

    /// The scheduler's choice for a pod, as a row when it finds none.
    fn schedule(&mut self, object: &str, pod: &Pod) -> Result<Option<String>> {
        match self.sa.driver.schedule(pod) {
            Ok(node) => Ok(Some(node)),
            Err(why) => {
                let free = self.free();
                self.emit(Row {
                    step: String::new(),
                    object: object.to_string(),
                    who: "scheduler".into(),
                    decision: "pending".into(),
                    free,
                    message: why,
                })?;
                Ok(None)
            }
        }
    }

    /// Send the binding through `/validate`, bind, and start the VM (or the Kata sandbox) on the host.
    async fn bind_and_start(
        &mut self,
        object: &str,
        pod: &Pod,
        node: &str,
        containers: &[&str],
        charge_in: &str,
        step: String,
    ) -> Result<bool> {
        let vm = if charge_in == SANDBOX {
            "the Kata sandbox VM"
        } else {
            "the VM"
        };
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let outcome = self.sa.driver.bind(&ns, &name, node).await?;
        if !outcome.bound {
            self.report.binding_denials += 1;
            let free = self.free();
            self.emit(Row {
                step,
                object: object.to_string(),
                who: "/validate".into(),
                decision: decision_word(&outcome.reply),
                free,
                message: format!(
                    "{} (the scheduler records FailedScheduling on the pod and retries)",
                    describe_validation(&outcome.reply)
                ),
            })?;
            return Ok(false);
        }
        // Re-read: the binding set spec.nodeName.
        let pod = self
            .sa
            .api
            .get_typed::<Pod>(Some(&ns), &name)?
            .ok_or_else(|| Error::Failed {
                what: format!("pod {ns}/{name}"),
                reason: "vanished after binding".into(),
            })?;
        let started = self.kubelet().start(&pod, containers, charge_in, Some(TDX));
        let free = self.settle().await?;
        let message = match &started {
            Ok(()) => format!(
                "{}; bound, {vm} started ({} of {} keys in use)",
                describe_validation(&outcome.reply),
                self.sa.host.usage(TDX),
                self.report.capacity
            ),
            Err(e) => {
                self.report.failed_starts += 1;
                format!("bound to {node}, but {vm} failed to start: {e}")
            }
        };
        self.emit(Row {
            step,
            object: object.to_string(),
            who: "/validate".into(),
            decision: if started.is_ok() { "bound" } else { "failed" }.into(),
            free,
            message,
        })?;
        Ok(started.is_ok())
    }

    /// Kernel enforcement: the agent has set the running VM's pod cgroup `misc.max` to its request;
    /// a second TEE VM started in that pod (a process with `/dev/kvm` taking more than it was
    /// scheduled for) is refused by the kernel.
    async fn over_limit(&mut self, name: &str) -> Result<()> {
        let Some(uid) = self
            .vms
            .get(name)
            .and_then(|(_, p)| p.as_ref())
            .and_then(|p| p.metadata.uid.clone())
        else {
            return Ok(());
        };
        let step = self.next_step();
        let deadline = std::time::Instant::now() + REPORT_DEADLINE;
        let limit = loop {
            if let Some(Some(n)) = self.sa.host.pod_max(&uid, TDX) {
                break Some(n);
            }
            if std::time::Instant::now() >= deadline {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let free = self.free();
        let Some(limit) = limit else {
            return self.emit(Row {
                step,
                object: format!("{name} pod"),
                who: "agent".into(),
                decision: "no limit".into(),
                free,
                message: "the pod cgroup's misc.max was not set (see the Enforcing condition)"
                    .into(),
            });
        };
        self.report.pod_limit = Some(format!("{TDX} {limit}"));
        self.emit(Row {
            step,
            object: format!("{name} pod"),
            who: "agent".into(),
            decision: "limited".into(),
            free: free.clone(),
            message: format!(
                "misc.max of its pod cgroup is \"{TDX} {limit}\": the key the scheduler counted, enforced by the kernel"
            ),
        })?;
        let refused = self.sa.host.start_vm(&uid, "compute", TDX);
        self.report.over_limit_refused = refused.is_err();
        let message = match &refused {
            Err(e) => format!("a second TEE VM in the pod: refused by the kernel ({e})"),
            Ok(()) => "a second TEE VM in the pod got a key: the limit did not hold".into(),
        };
        if refused.is_ok() {
            self.sa.host.stop_vm(&uid, "compute", TDX)?;
        }
        self.emit(Row {
            step: String::new(),
            object: format!("{name} pod"),
            who: "kernel".into(),
            decision: if refused.is_err() {
                "refused"
            } else {
                "charged"
            }
            .into(),
            free,
            message,
        })
    }

    /// A TDX VM from VMI creation to a running QEMU; false when a webhook or the scheduler refused it.
    async fn launch_vm(&mut self, name: &str) -> Result<bool> {
        let Admitted::Pod(pod) = self.create_vm_pod(name).await? else {
            return Ok(false);
        };
        let object = format!("{name} binding");
        let Some(node) = self.schedule(&object, &pod)? else {
            return Ok(false);
        };
        self.bind_and_start(&object, &pod, &node, &["compute"], "compute", String::new())
            .await
    }

    async fn launch_kata(&mut self, name: &str) -> Result<bool> {
        let step = self.next_step();
        let pod = kata_pod(name, KataTee::Tdx);
        let adm = self.sa.driver.create_pod(&pod).await?;
        let object = format!("{name} pod");
        self.pod_rows(step, &object, &adm)?;
        let Some(pod) = adm.pod else {
            return Ok(false);
        };
        let object = format!("{name} binding");
        let Some(node) = self.schedule(&object, &pod)? else {
            return Ok(false);
        };
        self.bind_and_start(&object, &pod, &node, &["app"], SANDBOX, String::new())
            .await
    }

    async fn stop_vm(&mut self, name: &str) -> Result<()> {
        let step = self.next_step();
        let Some((vmi, Some(pod))) = self.vms.remove(name) else {
            return Err(Error::Failed {
                what: format!("VM {name}"),
                reason: "not running".into(),
            });
        };
        let pod = self
            .sa
            .api
            .get_typed::<Pod>(
                pod.metadata.namespace.as_deref(),
                pod.metadata.name.as_deref().unwrap_or_default(),
            )?
            .unwrap_or(pod);
        self.sa.driver.delete_vmi(&vmi)?;
        self.kubelet().stop(&pod)?;
        let free = self.settle().await?;
        self.emit(Row {
            step,
            object: name.to_string(),
            who: "KubeVirt".into(),
            decision: "stopped".into(),
            free,
            message: "VMI deleted: QEMU exits and its key returns to the pool".into(),
        })
    }
}

/// The decision as the webhook's audit annotation names it (`patched`, `admitted`, `skipped`, ...),
/// or as the response shows it.
pub fn decision_word(r: &ReviewReply) -> String {
    r.audit
        .get("decision")
        .cloned()
        .unwrap_or_else(|| r.decision().to_string())
}

/// A readable summary of what `/mutate` did.
pub fn describe_mutation(r: &ReviewReply) -> String {
    let mut m = match r.decision() {
        Decision::Denied => return r.explanation(),
        Decision::Patched => r
            .patch
            .as_ref()
            .map_or_else(String::new, |p| format!("added {}", describe_patch(p))),
        _ => match r.audit.get("reason").map(String::as_str) {
            None | Some("") => "left untouched".to_string(),
            Some(code) => format!("left untouched: {}", reason_text(code)),
        },
    };
    if !r.warnings.is_empty() {
        m.push_str(&format!("; warning: {}", r.warnings.join("; ")));
    }
    m
}

/// A readable summary of what `/validate` decided.
pub fn describe_validation(r: &ReviewReply) -> String {
    if !r.allowed {
        return r.explanation();
    }
    let code = r.audit.get("reason").map(String::as_str).unwrap_or("");
    let node = r.audit.get("node");
    let mut m = match (r.audit.get("decision").map(String::as_str), code) {
        (Some("skipped"), code) => format!("not checked: {}", reason_text(code)),
        (_, "enough-keys") => match node {
            Some(n) => format!("{n} has a free key"),
            None => "a node matching the pod's selector has a free key".to_string(),
        },
        (_, "") => "allowed".to_string(),
        (_, code) => format!("allowed ({})", reason_text(code)),
    };
    if !r.warnings.is_empty() {
        m.push_str(&format!("; warning: {}", r.warnings.join("; ")));
    }
    m
}

/// Words for the webhook's audit reason codes.
fn reason_text(code: &str) -> String {
    match code {
        "not-kubevirt" => {
            "not a KubeVirt pod (Kata asks for its key in its RuntimeClass overhead)".to_string()
        }
        "not-virt-launcher" => "not a virt-launcher pod; the scheduler counts its key".to_string(),
        "exempt-namespace" => "the namespace is labelled teeguard.dev/exempt".to_string(),
        "exempt-vmi" => "the VMI is labelled teeguard.dev/exempt".to_string(),
        "exempt-pod" => "the pod is labelled teeguard.dev/exempt".to_string(),
        "not-tee" => "the VMI has no launchSecurity".to_string(),
        other => other.to_string(),
    }
}

/// `tdx.intel.com/keys: 1 (requests, limits); misc-max.teeguard.dev/compute: tdx 1 (annotations)`.
pub fn describe_patch(patch: &json_patch::Patch) -> String {
    let mut items: Vec<(String, String, Vec<String>)> = Vec::new();
    let mut push = |key: String, value: String, place: String| {
        if let Some(it) = items.iter_mut().find(|(k, v, _)| *k == key && *v == value) {
            if !it.2.contains(&place) {
                it.2.push(place);
            }
        } else {
            items.push((key, value, vec![place]));
        }
    };
    for op in &patch.0 {
        let (path, value) = match op {
            json_patch::PatchOperation::Add(a) => (a.path.to_string(), Some(&a.value)),
            json_patch::PatchOperation::Replace(r) => (r.path.to_string(), Some(&r.value)),
            json_patch::PatchOperation::Remove(r) => (r.path.to_string(), None),
            _ => continue,
        };
        let tokens: Vec<String> = path
            .split('/')
            .skip(1)
            .map(|t| t.replace("~1", "/").replace("~0", "~"))
            .collect();
        match value {
            Some(Value::Object(map)) => {
                let place = tokens.last().cloned().unwrap_or_default();
                for (k, v) in map {
                    push(k.clone(), scalar(v), place.clone());
                }
            }
            Some(v) => {
                let key = tokens.last().cloned().unwrap_or_default();
                let place = tokens
                    .len()
                    .checked_sub(2)
                    .and_then(|i| tokens.get(i))
                    .cloned()
                    .unwrap_or_default();
                push(key, scalar(v), place);
            }
            None => push(path.clone(), "removed".into(), String::new()),
        }
    }
    items
        .iter()
        .map(|(k, v, places)| format!("{k}: {v} ({})", places.join(", ")))
        .collect::<Vec<_>>()
        .join("; ")
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Run the scenario on a started [`Standalone`], printing the table to `out` as it goes.
///
/// With `k` TDX keys (at least 4): a VM outside Kubernetes holds 1; VMs `vm-1` .. `vm-<k-4>` and a Kata
/// pod start; two more VMs outside Kubernetes take the last 2 keys; `vm-<k-3>` is refused at pod
/// CREATE; `vm-2` stops and the retry of `vm-<k-3>` is admitted; `vm-3` stops; `vm-<k-2>` passes pod
/// CREATE but, before its binding, a VM outside Kubernetes takes the last key, so the binding is
/// refused; once that VM stops, the scheduler's retry is admitted.
pub async fn run_scenario<W: Write>(sa: &Standalone, out: &mut W) -> Result<ScenarioReport> {
    let capacity = sa.host.capacity(TDX);
    if capacity < 4 {
        return Err(Error::Startup {
            what: "scenario",
            reason: format!("needs at least 4 TDX keys, the host has {capacity}"),
        });
    }
    let table = StepTable::default();
    out.write_all(table.header().as_bytes())
        .map_err(|source| Error::Io {
            component: "standalone",
            what: "write the table to stdout".into(),
            source,
        })?;
    let mut r = Runner {
        sa,
        out,
        table,
        step: 0,
        report: ScenarioReport {
            capacity,
            ..ScenarioReport::default()
        },
        vms: BTreeMap::new(),
    };
    r.settle().await?;

    let fill = capacity - 4;
    r.external_start("legacy-db", 1).await?;
    for i in 1..=fill {
        r.launch_vm(&format!("vm-{i}")).await?;
        if i == 2.min(fill) {
            r.launch_kata("kata-tdx").await?;
        }
    }
    r.external_start("nightly-batch", 2).await?;
    let refused = format!("vm-{}", fill + 1);
    r.launch_vm(&refused).await?;
    r.stop_vm("vm-2").await?;
    r.launch_vm(&refused).await?;
    r.stop_vm("vm-3").await?;

    // A binding race: admitted at pod CREATE with one key free, scheduled onto node-a, but a VM
    // outside Kubernetes takes that key before the binding.
    let racing = format!("vm-{}", fill + 2);
    if let Admitted::Pod(pod) = r.create_vm_pod(&racing).await? {
        let object = format!("{racing} binding");
        if let Some(node) = r.schedule(&object, &pod)? {
            let free = r.free();
            r.emit(Row {
                step: String::new(),
                object: format!("{racing} pod"),
                who: "scheduler".into(),
                decision: "chose".into(),
                free,
                message: format!(
                    "{node}: it has a free key; the binding follows, but before it is sent:"
                ),
            })?;
            r.external_start("backup-vm", 1).await?;
            let step = r.next_step();
            let bound = r
                .bind_and_start(&object, &pod, &node, &["compute"], "compute", step)
                .await?;
            if !bound {
                let vmi = r.vms.get(&racing).map(|(v, _)| v.clone());
                if let Some(vmi) = vmi {
                    r.vmi_event_row(&vmi).await?;
                }
                r.external_stop("backup-vm").await?;
                let step = r.next_step();
                r.bind_and_start(&object, &pod, &node, &["compute"], "compute", step)
                    .await?;
            }
        }
    }
    r.over_limit("vm-1").await?;
    Ok(r.report)
}

/// The summary printed under the table.
pub fn summary(report: &ScenarioReport) -> String {
    let mut out = String::new();
    if let Some(s) = &report.last {
        out.push_str(&format!(
            "{TEE_NODE}: {} TDX keys, {} in use: {} by pods that request them, {} outside Kubernetes; {} free\n",
            s.capacity, s.kernel_used, s.pods_used, s.external, s.free
        ));
    }
    out.push_str(&format!(
        "keys in use never exceeded the capacity (peak {} of {}); VMs that failed to start for lack of a key: {}\n",
        report.peak_used, report.capacity, report.failed_starts
    ));
    if let Some(limit) = &report.pod_limit {
        out.push_str(&format!(
            "enforcement: vm-1's pod cgroup has misc.max \"{limit}\"; a second key in it: {}\n",
            if report.over_limit_refused {
                "refused by the kernel"
            } else {
                "NOT refused"
            }
        ));
    }
    out.push_str(&format!(
        "webhook: {} pods patched, {} pod CREATE{} and {} binding{} refused while no key was free\n",
        report.patched,
        report.pod_denials,
        if report.pod_denials == 1 { "" } else { "s" },
        report.binding_denials,
        if report.binding_denials == 1 { "" } else { "s" },
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn patch_description_groups_requests_and_limits() {
        let patch: json_patch::Patch = serde_json::from_value(json!([
            {"op": "add", "path": "/spec/containers/0/resources/requests/tdx.intel.com~1keys", "value": "1"},
            {"op": "add", "path": "/spec/containers/0/resources/limits/tdx.intel.com~1keys", "value": "1"},
            {"op": "add", "path": "/metadata/annotations/misc-max.teeguard.dev~1compute", "value": "tdx 1"}
        ]))
        .expect("patch");
        assert_eq!(
            describe_patch(&patch),
            "tdx.intel.com/keys: 1 (requests, limits); misc-max.teeguard.dev/compute: tdx 1 (annotations)"
        );
        let whole: json_patch::Patch = serde_json::from_value(json!([
            {"op": "add", "path": "/metadata/annotations", "value": {"a/b": "c"}}
        ]))
        .expect("patch");
        assert_eq!(describe_patch(&whole), "a/b: c (annotations)");
    }
}
