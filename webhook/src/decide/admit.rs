//! The admission decisions on the [`Index`] (pure): the keys a node has available to a claimant (one
//! definition for the launcher pod CREATE, the binding and the retry planner), the verdicts, and the
//! holds each admission adds ([`Write`]: the node's `TeeReservation` entries after them).
//!
//! Keys available on a node to a claimant = the report's `free` − the live holds of other claimants
//! there ([`Index::held`]) − for a virt-launcher pod not bound yet (with `admission.retryRefusedVmis`
//! on), the keys the VMIs that waited longer than its own are served from there ([`queue::serve`]).
//!
//! The decider makes each decision and keeps its holds under the index's write lock
//! (`crate::cluster::holds::hold`), so no two claimants are ever given one key; it writes them behind
//! into the node's object with the `resourceVersion` its index holds (`crate::cluster::holds::write_node`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use teeguard_shared::TeeKind;
use teeguard_shared::config::{Mode, StalePolicy};
use teeguard_shared::pod::KeyRequests;
use teeguard_shared::reservation::{HoldReason, KeyReservation, TeeReservation};

use super::affinity::node_matches;
use super::holds::{Claimant, HeldKeys, NewHold};
use super::index::{Index, Labels};
use super::queue::{self, Waiting};
use super::validation::{
    CandidateScan, Decision, Held, NodeAssessment, Trigger, apply_mode, current_report,
    decide_on_node, reason,
};

/// A write of one node's `TeeReservation`: the entries it should hold, on the version the decision
/// was made on.
#[derive(Clone, Debug, PartialEq)]
pub struct Write {
    /// The node.
    pub node: String,
    /// The object the decision read (`None`: the node has none yet; the write creates it).
    pub base: Option<Arc<TeeReservation>>,
    /// Every entry after the write.
    pub entries: Vec<KeyReservation>,
}

/// The node's entries after `added` are held there: those still holding or counted (a replica whose
/// report does not count the pod yet still counts its hold), less the earlier holds of the claimants
/// of `added`, plus `added`.
pub fn write(ix: &Index, node: &str, added: Vec<KeyReservation>, now: Timestamp) -> Write {
    let base = ix.node(node).and_then(|n| n.holds.clone());
    let replaced = |e: &KeyReservation| {
        added.iter().any(|a| {
            Claimant {
                pod_uid: &a.pod_uid,
                vmi_uid: &a.vmi_uid,
            }
            .owns(e)
        })
    };
    let mut entries: Vec<KeyReservation> = base
        .as_deref()
        .map_or(&[][..], |o| o.spec.reservations.as_slice())
        .iter()
        .filter(|e| ix.end(node, e, now).is_none_or(|end| !end.trimmed()) && !replaced(e))
        .cloned()
        .collect();
    entries.extend(added);
    Write {
        node: node.to_string(),
        base,
        entries,
    }
}

/// The nodes whose objects hold entries that ended for good (pod gone, VMI done, moved, expired) and
/// have not changed for `quiet`: the planner writes them trimmed, so that `kubectl get
/// teereservations` shows what holds and a replica that starts later does not count them for the pod
/// grace. Every hold write trims them too, so a node taking admissions is left to those: a separate
/// trim would race them for the object's `resourceVersion` (measured: with a trim per deleted pod,
/// a third of the launcher CREATEs' writes conflicted and the `/validate` p99 tripled).
pub fn untidy(ix: &Index, now: Timestamp, quiet: Duration) -> Vec<String> {
    ix.nodes()
        .filter(|(name, state)| {
            now.duration_since(state.changed()).unsigned_abs() >= quiet
                && state
                    .recorded()
                    .iter()
                    .any(|e| ix.end(name, e, now).is_some_and(|end| end.trimmed()))
        })
        .map(|(name, _)| name.to_string())
        .collect()
}

/// The write of `node`'s object without its entries that ended for good (`None`: none did).
pub fn tidy(ix: &Index, node: &str, now: Timestamp) -> Option<Write> {
    let w = write(ix, node, Vec::new(), now);
    let before = w.base.as_ref().map_or(0, |o| o.spec.reservations.len());
    (w.entries.len() < before).then_some(w)
}

/// The node's entries without the key promised there to VMI `vmi_uid` (its retry could not be
/// written); `None` when there is no such promise.
pub fn withdraw(ix: &Index, node: &str, vmi_uid: &str, now: Timestamp) -> Option<Write> {
    let promise = Claimant::promise(vmi_uid);
    let base = ix.node(node).and_then(|n| n.holds.clone())?;
    if !base.spec.reservations.iter().any(|e| promise.owns(e)) {
        return None;
    }
    let mut w = write(ix, node, Vec::new(), now);
    w.entries.retain(|e| !promise.owns(e));
    Some(w)
}

/// What is asked for: the claimant and what its pod is.
#[derive(Clone, Copy, Debug)]
pub struct Ask<'a> {
    /// Who asks (a pod, and for a virt-launcher pod its VMI).
    pub claimant: Claimant<'a>,
    /// The pod's `namespace/name`.
    pub pod: &'a str,
    /// The VMI's `namespace/name` (empty for other pods).
    pub vmi: &'a str,
    /// Keys per kind.
    pub requests: &'a KeyRequests,
    /// Enforce or warn.
    pub mode: Mode,
    /// What an unknown report does.
    pub policy: StalePolicy,
    /// A dry run decides and holds nothing.
    pub dry_run: bool,
    /// `admission.staleReportAfter`.
    pub stale_after: Duration,
    /// This replica's name, written into the holds.
    pub replica: &'a str,
}

impl Ask<'_> {
    fn hold(&self, reason: HoldReason, now: Timestamp) -> KeyReservation {
        NewHold {
            claimant: self.claimant,
            pod: self.pod,
            vmi: self.vmi,
            keys: self.requests,
            reason,
        }
        .entry(now, self.replica)
    }
}

/// A decision and the write that commits it (none: nothing to hold).
#[derive(Clone, Debug, PartialEq)]
pub struct Planned {
    /// The answer.
    pub decision: Decision,
    /// The node chosen (the named node, or the candidate that fitted).
    pub node: Option<String>,
    /// The hold it takes on `node` (kept in the index, written behind).
    pub hold: Option<KeyReservation>,
}

/// Whether `decision` takes a key teeguard must hold: admitted for real, not a dry run, and not on a
/// node whose keys the scheduler allocates (DRA).
fn takes_a_key(decision: &Decision, dry_run: bool) -> bool {
    decision.reserve && !dry_run && decision.reason != reason::SCHEDULER_ALLOCATED
}

/// The keys held for others, as the messages split them: for pods, and kept for VMIs.
impl<'h> From<&'h HeldKeys> for Held<'h> {
    fn from(h: &'h HeldKeys) -> Self {
        Held {
            reserved: &h.pods,
            queued: &h.promised,
        }
    }
}

/// A pod on one named node: the scheduler's binding, or a pod created with `spec.nodeName`. Admitted
/// when the node's report less the other claimants' holds has the keys; the pod then holds them as
/// `Bound` there, unless it holds them there already or the report counts it.
pub fn on_node(ix: &Index, trigger: Trigger, node: &str, ask: &Ask<'_>, now: Timestamp) -> Planned {
    let held = ix.held(node, ask.claimant, now);
    let a = NodeAssessment::new(
        node,
        ask.requests,
        ix.report(node),
        Held::from(&held),
        now,
        ask.stale_after,
    );
    let decision = apply_mode(
        decide_on_node(trigger, ask.requests, &a, ask.policy),
        ask.mode,
    );
    let hold = (takes_a_key(&decision, ask.dry_run) && !held_here(ix, node, ask.claimant, now))
        .then(|| ask.hold(HoldReason::Bound, now));
    Planned {
        decision,
        node: Some(node.to_string()),
        hold,
    }
}

/// Whether the claimant's pod holds its keys on `node` already: a live hold of the pod there, or a
/// report that counts it (a retried binding, a dry run followed by the real request).
fn held_here(ix: &Index, node: &str, claimant: Claimant<'_>, now: Timestamp) -> bool {
    let uid = claimant.pod_uid;
    !uid.is_empty() && (ix.counted(node, uid) || ix.live(node, now).any(|e| e.pod_uid == uid))
}

/// How a pod not bound yet is placed.
#[derive(Clone, Copy)]
pub struct Placement<'a> {
    /// Whether the pod may go to a node (its node selector and required affinity).
    pub fits: &'a (dyn Fn(&str, &Labels) -> bool + Sync),
    /// The node to look at first (the one that fitted last time: most candidate scans then stop at
    /// the first node).
    pub hint: Option<&'a str>,
    /// The pod is a virt-launcher pod that waits its turn behind the VMIs refused before its own
    /// (`admission.retryRefusedVmis` on), each needing this many keys of the pod's kind.
    pub queue: Option<u64>,
}

impl std::fmt::Debug for Placement<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Placement")
            .field("hint", &self.hint)
            .field("queue", &self.queue)
            .finish_non_exhaustive()
    }
}

/// A pod not bound yet (a CREATE without `spec.nodeName`): admitted when a node it may go to has the
/// keys available to it. A virt-launcher pod then holds them there (`Admitted`) until its binding;
/// a key promised to its VMI is taken first. Other pods hold nothing until they are bound.
pub fn at_create(ix: &Index, ask: &Ask<'_>, placement: Placement<'_>, now: Timestamp) -> Planned {
    let claimant = ask.claimant;
    let own = ix.own_hold(claimant, now).map(|(node, _)| node);
    let primary = ask.requests.keys().next().copied();
    // The VMIs ahead take their keys first; a VMI that holds one already has had its turn.
    let ahead = match (placement.queue, primary, own) {
        (Some(per_vmi), Some(kind), None) if !claimant.vmi_uid.is_empty() => {
            queued_ahead(ix, kind, per_vmi, ask, placement.fits, now)
        }
        _ => HashMap::new(),
    };
    let mut scan = CandidateScan::new(ask.requests);
    let mut fitted = None;
    let first = own.or(placement.hint);
    ix.scan_nodes(placement.fits, first, &mut |node, _| {
        let mut held = ix.held(node, claimant, now);
        if let (Some(kind), Some(n)) = (primary, ahead.get(node)) {
            *held.promised.entry(kind).or_insert(0) += n;
        }
        let flow = scan.offer(node, ix.report(node), &held, now, ask.stale_after);
        if flow.is_break() {
            fitted = Some(node.to_string());
        }
        flow
    });
    let decision = apply_mode(scan.verdict(ask.policy), ask.mode);
    let holds = !claimant.vmi_uid.is_empty() && decision.reason == reason::ENOUGH_KEYS;
    let hold = match &fitted {
        Some(node) if holds && takes_a_key(&decision, ask.dry_run) => {
            (!held_here(ix, node, claimant, now)).then(|| ask.hold(HoldReason::Admitted, now))
        }
        _ => None,
    };
    Planned {
        decision,
        node: fitted,
        hold,
    }
}

/// A node with keys of one kind to hand out to waiting VMIs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot<'a> {
    /// The node.
    pub node: &'a str,
    /// Its labels.
    pub labels: &'a Labels,
    /// How many VMIs it can serve (keys available / keys per VMI).
    pub vmis: u64,
}

/// The nodes with at least `per_vmi` keys of `kind` available to `claimant` (current reports, not in
/// DRA mode, where the scheduler allocates), by name: every replica lists them alike.
pub fn slots<'i>(
    ix: &'i Index,
    kind: TeeKind,
    per_vmi: u64,
    claimant: Claimant<'_>,
    stale_after: Duration,
    now: Timestamp,
) -> Vec<Slot<'i>> {
    let per_vmi = per_vmi.max(1);
    let mut out = Vec::new();
    for (name, state) in ix.nodes() {
        let (Some(labels), Ok(status)) = (
            state.labels.as_ref(),
            current_report(ix.report(name), now, stale_after),
        ) else {
            continue;
        };
        if status.accounting.as_deref() == Some("dra") {
            continue;
        }
        let Some(free) = status.kind(kind).map(|k| k.free) else {
            continue;
        };
        if free < per_vmi {
            continue;
        }
        let h = ix.held(name, claimant, now);
        let held = [&h.pods, &h.promised]
            .iter()
            .map(|m| m.get(&kind).copied().unwrap_or(0))
            .sum::<u64>();
        let vmis = free.saturating_sub(held) / per_vmi;
        if vmis > 0 {
            out.push(Slot {
                node: name,
                labels,
                vmis,
            });
        }
    }
    out.sort_by(|a, b| a.node.cmp(b.node));
    out
}

/// The keys of `kind` the VMIs waiting ahead of `ask`'s (every waiting VMI when its own does not
/// wait) are served from, per node, when each is served in turn with `ask`'s pod served last.
fn queued_ahead(
    ix: &Index,
    kind: TeeKind,
    per_vmi: u64,
    ask: &Ask<'_>,
    fits: &(dyn Fn(&str, &Labels) -> bool + Sync),
    now: Timestamp,
) -> HashMap<String, u64> {
    let waiting = ix.waiting(Some(kind), now);
    if waiting.is_empty() {
        return HashMap::new();
    }
    let own = waiting
        .iter()
        .find(|w| w.vmi.uid == ask.claimant.vmi_uid)
        .map(|w| queue::turn(w));
    let ahead: Vec<&Waiting> = waiting
        .iter()
        .copied()
        .filter(|w| w.vmi.uid != ask.claimant.vmi_uid && own.is_none_or(|t| queue::turn(w) < t))
        .collect();
    if ahead.is_empty() {
        return HashMap::new();
    }
    let slots = slots(ix, kind, per_vmi, ask.claimant, ask.stale_after, now);
    let capacity: Vec<u64> = slots.iter().map(|s| s.vmis).collect();
    let served = queue::serve(ahead.len() + 1, &capacity, |v, s| {
        let slot = &slots[s];
        match ahead.get(v) {
            Some(w) => node_matches(&w.placement, slot.node, slot.labels),
            None => fits(slot.node, slot.labels),
        }
    });
    let mut out = HashMap::new();
    for s in served.iter().take(ahead.len()).flatten() {
        *out.entry(slots[*s].node.to_string()).or_insert(0) += per_vmi.max(1);
    }
    out
}

/// A key promised to a waiting VMI by the retry planner.
#[derive(Clone, Debug, PartialEq)]
pub struct Promise<'i> {
    /// The VMI.
    pub waiting: &'i Waiting,
    /// The node whose key it is promised.
    pub node: &'i str,
}

/// Which waiting VMIs the keys available now serve, first come, first served, per kind
/// (`per_vmi(kind)` keys each), and on which node: the VMIs to promise a key to and retry.
pub fn promises<'i>(
    ix: &'i Index,
    per_vmi: impl Fn(TeeKind) -> u64,
    stale_after: Duration,
    now: Timestamp,
) -> Vec<Promise<'i>> {
    let mut out = Vec::new();
    for kind in TeeKind::ALL {
        let waiting = ix.waiting(Some(kind), now);
        if waiting.is_empty() {
            continue;
        }
        let slots = slots(ix, kind, per_vmi(kind), Claimant::NONE, stale_after, now);
        if slots.is_empty() {
            continue;
        }
        let capacity: Vec<u64> = slots.iter().map(|s| s.vmis).collect();
        let served = queue::serve(waiting.len(), &capacity, |v, s| {
            node_matches(&waiting[v].placement, slots[s].node, slots[s].labels)
        });
        for (w, s) in waiting.iter().zip(served) {
            if let Some(s) = s {
                out.push(Promise {
                    waiting: w,
                    node: slots[s].node,
                });
            }
        }
    }
    out
}

/// The holds of `promises` (all on one node), `per_vmi(kind)` keys each, written `now` by `replica`.
pub fn promise_holds(
    promises: &[&Promise<'_>],
    per_vmi: impl Fn(TeeKind) -> u64,
    replica: &str,
    now: Timestamp,
) -> Vec<KeyReservation> {
    promises
        .iter()
        .map(|p| {
            let w = p.waiting;
            let keys = KeyRequests::from([(w.kind, per_vmi(w.kind).max(1))]);
            NewHold {
                claimant: Claimant::promise(&w.vmi.uid),
                pod: "",
                vmi: &format!("{}/{}", w.vmi.namespace, w.vmi.name),
                keys: &keys,
                reason: HoldReason::Promised,
            }
            .entry(now, replica)
        })
        .collect()
}

#[cfg(test)]
mod tests;
