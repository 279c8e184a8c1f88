//! The queue of VMIs waiting for a key (pure): which VMIs wait because teeguard refused their
//! launcher pods, in which order their turns come, and which of them the keys a set of nodes has can
//! serve, first come, first served.
//!
//! - [`waiting`]: a VMI waits on teeguard when virt-controller's `Synchronized` condition is `False`
//!   with reason `FailedCreate` and quotes a teeguard webhook (`admission webhook "….teeguard.dev" denied
//!   the request`, or `failed calling webhook "….teeguard.dev"` while the webhook was down), the VMI is
//!   `Pending` (no pod yet) and is a TEE VM. A denial counts only when a free key ends it (the webhook
//!   ends those with [`REFUSAL_NOTE`]): one for anything else (forged limit annotations, a VMI asking
//!   for another number of keys) stays until the VMI changes, and serving it would hold a key from
//!   every other VMI, again and again.
//! - [`turn`]: oldest refusal first (the condition's `lastTransitionTime`, which virt-controller sets
//!   at the first refusal: the same for every replica), then by name.
//! - [`serve`]: which VMIs a set of free keys serves. Each VMI in turn is served when the VMIs served
//!   before it can all still be served with it (augmenting paths): a VMI that waited less never takes
//!   a key a VMI that waited longer needs, and no key stays idle that a later VMI could use. The retry
//!   planner promises keys by it, and a launcher pod CREATE counts the keys it gives the VMIs ahead of
//!   the pod's own as taken: the two decide alike.

use jiff::Timestamp;
use k8s_openapi::api::core::v1::PodSpec;
use teeguard_shared::vmi::LaunchSecurity;
use teeguard_shared::{TeeKind, VirtualMachineInstance, names};

use super::mutation::VmiRef;

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
    /// Where its launcher pod may go, as KubeVirt renders it: the VMI's node selector with the labels
    /// of its kind, and its affinity.
    pub placement: PodSpec,
}

/// How the API server quotes a webhook's denial, and a call to it that failed.
const DENIED_BY: &str = "admission webhook \"";
const FAILED_CALL: &str = "failed calling webhook \"";

/// Whether `message` has `lead` followed by the name of a teeguard webhook (one whose name ends in
/// [`names::WEBHOOK_NAME_SUFFIX`]).
fn quotes_teeguard(message: &str, lead: &str) -> bool {
    message.match_indices(lead).any(|(at, _)| {
        let rest = &message[at + lead.len()..];
        rest.split('"')
            .next()
            .is_some_and(|name| name.ends_with(names::WEBHOOK_NAME_SUFFIX))
    })
}

/// Whether a teeguard refusal quoted in a condition ends by itself: a call that failed (it ends when a
/// replica answers again), or a denial a free key ends (it carries [`REFUSAL_NOTE`]).
pub fn ends_by_itself(message: &str) -> bool {
    quotes_teeguard(message, FAILED_CALL)
        || (quotes_teeguard(message, DENIED_BY)
            && message.contains(REFUSAL_NOTE.trim_start_matches("; ")))
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

/// The condition saying teeguard refused the VMI's pod until a key frees (or could not be called), if
/// any.
fn teeguard_refusal(vmi: &VirtualMachineInstance) -> Option<&teeguard_shared::vmi::VmiCondition> {
    vmi.status.as_ref()?.conditions.iter().find(|c| {
        c.type_ == SYNCHRONIZED
            && c.status == "False"
            && c.reason.as_deref() == Some(FAILED_CREATE)
            && c.message.as_deref().is_some_and(ends_by_itself)
    })
}

/// Whether `vmi` has no launcher pod yet: phase `Pending` (or none yet).
pub fn pending(vmi: &VirtualMachineInstance) -> bool {
    let phase = vmi.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(phase, None | Some("") | Some("Pending"))
}

/// Whether `vmi` waits for its launcher pod because teeguard refused it (see the module), and what
/// the queue needs to know of it.
pub fn waiting(vmi: &VirtualMachineInstance) -> Option<Waiting> {
    let meta = &vmi.metadata;
    if meta.deletion_timestamp.is_some() {
        return None;
    }
    if !pending(vmi) {
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
        placement: PodSpec {
            node_selector: Some(selector),
            affinity: vmi.spec.affinity.clone(),
            ..PodSpec::default()
        },
    })
}

/// A waiting VMI's place in the queue: oldest refusal first; a VMI whose refusal time is unknown goes
/// last; then by name, so every replica orders the VMIs alike.
pub fn turn(w: &Waiting) -> (bool, Option<Timestamp>, &str, &str) {
    (w.since.is_none(), w.since, &w.vmi.namespace, &w.vmi.name)
}

/// First come, first served: `capacity[s]` VMIs can be served from slot `s`, and `fits(v, s)` says
/// whether VMI `v` (an index in turn order) may use slot `s`. Each VMI in turn is served when every VMI
/// served before it can still be served with it (moving earlier ones to other slots they may use,
/// along an augmenting path). Returns the slot serving each VMI (`None`: no key left for it).
/// Deterministic: free capacity in slot order first, then the moves in slot order.
pub fn serve(
    vmis: usize,
    capacity: &[u64],
    fits: impl Fn(usize, usize) -> bool,
) -> Vec<Option<usize>> {
    let mut at: Vec<Option<usize>> = vec![None; vmis];
    let mut served: Vec<Vec<usize>> = vec![Vec::new(); capacity.len()];
    // `fits` may be costly (node selectors and affinity): ask once per pair.
    let table: Vec<Vec<bool>> = (0..vmis)
        .map(|v| (0..capacity.len()).map(|s| fits(v, s)).collect())
        .collect();
    for v in 0..vmis {
        let mut visited = vec![false; capacity.len()];
        augment(v, capacity, &table, &mut served, &mut at, &mut visited);
    }
    at
}

fn augment(
    v: usize,
    capacity: &[u64],
    table: &[Vec<bool>],
    served: &mut [Vec<usize>],
    at: &mut [Option<usize>],
    visited: &mut [bool],
) -> bool {
    for s in 0..capacity.len() {
        if table[v][s] && (served[s].len() as u64) < capacity[s] {
            served[s].push(v);
            at[v] = Some(s);
            return true;
        }
    }
    for s in 0..capacity.len() {
        if !table[v][s] || visited[s] {
            continue;
        }
        visited[s] = true;
        for i in 0..served[s].len() {
            let u = served[s][i];
            if augment(u, capacity, table, served, at, visited) {
                // `u` moved to another slot (its entry there is new); `v` takes its place here.
                served[s][i] = v;
                at[v] = Some(s);
                return true;
            }
        }
    }
    false
}

#[cfg(test)]
mod tests;
