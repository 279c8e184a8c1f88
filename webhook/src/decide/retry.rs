//! Retrying the VMIs whose launcher pods teeguard refused, once a key is free for them (pure).
//!
//! virt-controller retries a refused pod CREATE with a doubling backoff (5 ms up to 1000 s): a VM that
//! waited minutes for a key would wait minutes more after one frees. Any change to the VMI makes
//! virt-controller sync it at once, so the webhook writes [`names::RETRIED_ANNOTATION`] on the VMIs
//! this module picks:
//!
//! - [`waiting`]: a VMI waits on teeguard when virt-controller's `Synchronized` condition is `False`
//!   with reason `FailedCreate` and quotes a teeguard webhook (`admission webhook "….teeguard.dev" denied
//!   the request`, or `failed calling webhook "….teeguard.dev"` while the webhook was down), the VMI is
//!   `Pending` (no pod yet) and is a TEE VM.
//! - [`plan`]: per free key, the VMI that has waited longest among those whose launcher pod could go to
//!   the node (KubeVirt's node selector for its kind, its own node selector and required affinity). A VMI
//!   retried within [`MIN_RETRY_INTERVAL`] is not retried again but keeps its key in the plan (its pod is
//!   on its way), so two VMIs never race for one key.
//!
//! Every replica plans from the same caches, so replicas retry the same VMIs; virt-controller's queue
//! folds the duplicates.

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::PodSpec;
use teeguard_shared::pod::KeyRequests;
use teeguard_shared::vmi::LaunchSecurity;
use teeguard_shared::{TeeKind, VirtualMachineInstance, names};

use super::affinity::node_matches;
use super::mutation::VmiRef;

/// A VMI is not retried again sooner than this after teeguard retried it (its pod may be on its way).
pub const MIN_RETRY_INTERVAL: Duration = Duration::from_secs(5);

/// What a refusal of a virt-launcher pod ends with when refused VMIs are retried.
pub const REFUSAL_NOTE: &str =
    "; teeguard starts this VM by itself as soon as a key is free for it";

/// The condition virt-controller sets when it cannot create a VMI's pod.
pub const SYNCHRONIZED: &str = "Synchronized";
/// Its reason then.
const FAILED_CREATE: &str = "FailedCreate";

/// Add [`REFUSAL_NOTE`] to the message of a refusal a freed key ends (see
/// [`super::validation::reason::ends_when_a_key_frees`]).
pub fn note_refusal(reason: &str, message: Option<&mut String>) {
    if let Some(m) = message.filter(|_| super::validation::reason::ends_when_a_key_frees(reason)) {
        m.push_str(REFUSAL_NOTE);
    }
}

/// A VMI waiting for its launcher pod because teeguard refused it (or could not be called).
#[derive(Clone, Debug, PartialEq)]
pub struct Waiting {
    /// The VMI.
    pub vmi: VmiRef,
    /// The kind of key it needs.
    pub kind: TeeKind,
    /// When its pod was first refused (the condition's `lastTransitionTime`).
    pub since: Option<Timestamp>,
    /// When teeguard last retried it ([`names::RETRIED_ANNOTATION`]).
    pub retried: Option<Timestamp>,
    /// Where its launcher pod may go, as KubeVirt renders it: the VMI's node selector with the labels
    /// of its kind, and its affinity.
    pub placement: PodSpec,
}

/// Whether an API server answer quoted in a condition comes from a teeguard webhook: a denial or a
/// failed call of a webhook whose name ends in [`names::WEBHOOK_NAME_SUFFIX`].
pub fn refused_by_teeguard(message: &str) -> bool {
    ["admission webhook \"", "failed calling webhook \""]
        .iter()
        .any(|lead| {
            message.match_indices(lead).any(|(at, _)| {
                let rest = &message[at + lead.len()..];
                rest.split('"')
                    .next()
                    .is_some_and(|name| name.ends_with(names::WEBHOOK_NAME_SUFFIX))
            })
        })
}

/// The labels KubeVirt v1.9 puts in a launcher pod's node selector for a launchSecurity (virt-handler
/// labels TEE hosts with them).
fn kind_labels(ls: &LaunchSecurity) -> Vec<&'static str> {
    let mut labels = Vec::new();
    if ls.tdx.is_some() {
        labels.push("kubevirt.io/tdx");
    }
    if ls.snp.is_some() {
        labels.extend(["kubevirt.io/sev", "kubevirt.io/sev-snp"]);
    }
    if let Some(sev) = &ls.sev {
        labels.push("kubevirt.io/sev");
        if sev
            .policy
            .as_ref()
            .and_then(|p| p.encrypted_state)
            .unwrap_or(false)
        {
            labels.push("kubevirt.io/sev-es");
        }
    }
    labels
}

/// The condition saying teeguard refused the VMI's pod, if any.
fn teeguard_refusal(vmi: &VirtualMachineInstance) -> Option<&teeguard_shared::vmi::VmiCondition> {
    vmi.status.as_ref()?.conditions.iter().find(|c| {
        c.type_ == SYNCHRONIZED
            && c.status == "False"
            && c.reason.as_deref() == Some(FAILED_CREATE)
            && c.message.as_deref().is_some_and(refused_by_teeguard)
    })
}

/// Whether `vmi` waits for its launcher pod because teeguard refused it (see the module), and what
/// [`plan`] needs to know of it.
pub fn waiting(vmi: &VirtualMachineInstance) -> Option<Waiting> {
    let meta = &vmi.metadata;
    if meta.deletion_timestamp.is_some() {
        return None;
    }
    let phase = vmi.status.as_ref().and_then(|s| s.phase.as_deref());
    if !matches!(phase, None | Some("") | Some("Pending")) {
        return None;
    }
    let kind = vmi.tee_kind().ok().flatten()?;
    let refusal = teeguard_refusal(vmi)?;
    let parse = |s: Option<&str>| s.and_then(|t| t.parse::<Timestamp>().ok());
    let mut selector = vmi.spec.node_selector.clone().unwrap_or_default();
    if let Some(ls) = &vmi.spec.domain.launch_security {
        for l in kind_labels(ls) {
            selector.insert(l.to_string(), "true".to_string());
        }
    }
    Some(Waiting {
        vmi: VmiRef {
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            uid: meta.uid.clone().unwrap_or_default(),
        },
        kind,
        since: parse(refusal.last_transition_time.as_deref()),
        retried: parse(
            meta.annotations
                .as_ref()
                .and_then(|a| a.get(names::RETRIED_ANNOTATION))
                .map(String::as_str),
        ),
        placement: PodSpec {
            node_selector: Some(selector),
            affinity: vmi.spec.affinity.clone(),
            ..PodSpec::default()
        },
    })
}

/// A node with keys available to new pods (its report's `free` less the keys reserved there).
#[derive(Clone, Debug, PartialEq)]
pub struct FreeNode<'a> {
    /// The node's name.
    pub name: &'a str,
    /// Its labels.
    pub labels: &'a BTreeMap<String, String>,
    /// Keys available per kind.
    pub available: KeyRequests,
}

/// One VMI to retry now, and the node whose free key it is expected to take.
#[derive(Clone, Debug, PartialEq)]
pub struct Retry<'w> {
    /// The VMI.
    pub waiting: &'w Waiting,
    /// The node.
    pub node: String,
}

/// Which of `waiting` to retry at `now` (see the module): oldest first, one per available key of its
/// kind on a node its pod may go to. `nodes` is used up as keys are handed out.
pub fn plan<'w>(
    waiting: &'w [Waiting],
    nodes: &mut [FreeNode<'_>],
    now: Timestamp,
) -> Vec<Retry<'w>> {
    let mut order: Vec<&Waiting> = waiting.iter().collect();
    // Oldest refusal first; a VMI whose refusal time is unknown goes last; then by name, so every
    // replica picks the same VMIs.
    order.sort_by(|a, b| {
        (a.since.is_none(), a.since, &a.vmi.namespace, &a.vmi.name).cmp(&(
            b.since.is_none(),
            b.since,
            &b.vmi.namespace,
            &b.vmi.name,
        ))
    });
    let mut out = Vec::new();
    for w in order {
        let Some(node) = nodes.iter_mut().find(|n| {
            n.available.get(&w.kind).copied().unwrap_or(0) > 0
                && node_matches(&w.placement, n.name, n.labels)
        }) else {
            continue;
        };
        if let Some(slot) = node.available.get_mut(&w.kind) {
            *slot -= 1;
        }
        // A retry time in the future (another replica's clock) counts as recent.
        let recent = w.retried.is_some_and(|t| {
            now.duration_since(t).as_secs_f64() < MIN_RETRY_INTERVAL.as_secs_f64()
        });
        if !recent {
            out.push(Retry {
                waiting: w,
                node: node.name.to_string(),
            });
        }
    }
    out
}

#[cfg(test)]
mod tests;
