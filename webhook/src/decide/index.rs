//! The admission state of one replica, in one index: everything the key decisions read, applied to
//! by each watched kind (Nodes, `TeeCapacity` reports, the agents' Leases, `TeeReservation`s,
//! virt-launcher pods, VMIs) and by this replica's own writes and refusals. Pure: no lock, no clock, no
//! I/O. `crate::cluster::index` keeps it behind one lock, feeds it and passes the time in.
//!
//! What it answers:
//! - [`Index::end`]: the one end rule of a hold ([`crate::decide::holds`]);
//! - [`Index::held`]: the keys held on a node for claimants other than the one asking;
//! - [`Index::waiting`]: the VMIs waiting for a key, in turn order, without a live hold or a launcher
//!   pod (the pod watch tells first: virt-controller writes the VMI's status seconds later when busy);
//! - the nodes, their labels and reports ([`Index::scan_nodes`], [`Index::report`]).
//!
//! Memories (each bounded by time): pods and VMIs seen deleted, pods a report counted, and when this
//! replica first saw each hold (a hold lasts at least [`crate::decide::holds::POD_GRACE`] from there, so a writer's clock
//! behind this replica's never ends a hold before its pod could be counted).

use std::collections::{BTreeMap, HashMap};
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::PodSpec;
use teeguard_shared::TeeKind;
use teeguard_shared::crd::TeeCapacityStatus;
use teeguard_shared::reservation::{HoldReason, KeyReservation, TeeReservation};

use super::holds::{Claimant, HeldKeys};
use super::queue::{self, Waiting};
use super::validation::Report;

/// A node's labels.
pub type Labels = BTreeMap<String, String>;

/// How long a deletion (or a count by a report) is remembered at least: longer than any hold lives.
fn memory(ttl: Duration) -> Duration {
    ttl.saturating_mul(2).max(Duration::from_secs(60))
}

/// What the index knows of one node.
#[derive(Clone, Debug, Default)]
pub struct NodeState {
    /// The Node's labels (`None`: no Node seen).
    pub labels: Option<Labels>,
    /// Its report's status (`None`: no report).
    pub report: Option<Arc<TeeCapacityStatus>>,
    /// The report's `resourceVersion`.
    report_version: Option<u64>,
    /// When its agent last renewed its heartbeat Lease.
    pub lease: Option<Timestamp>,
    /// Its `TeeReservation` (`None`: none yet).
    pub holds: Option<Arc<TeeReservation>>,
    /// When this replica first saw each of its entries (same order).
    seen: Vec<Timestamp>,
    /// When this replica last saw the object change (written by anyone).
    changed: Timestamp,
    /// Holds this replica admitted here that its write-behind has not written yet.
    local: Vec<(KeyReservation, Timestamp)>,
}

impl NodeState {
    fn is_empty(&self) -> bool {
        self.labels.is_none()
            && self.report.is_none()
            && self.lease.is_none()
            && self.holds.is_none()
            && self.local.is_empty()
    }

    /// When this replica last saw the node's `TeeReservation` change.
    pub fn changed(&self) -> Timestamp {
        self.changed
    }

    /// The recorded holds (the `TeeReservation`'s entries).
    pub fn recorded(&self) -> &[KeyReservation] {
        self.holds
            .as_deref()
            .map_or(&[][..], |o| o.spec.reservations.as_slice())
    }

    /// Every hold, recorded then local, with when this replica first saw it.
    fn seen_holds(&self) -> impl Iterator<Item = (&KeyReservation, &Timestamp)> {
        let recorded = self.recorded().iter().zip(&self.seen);
        recorded.chain(self.local.iter().map(|(e, at)| (e, at)))
    }
}

/// What the index knows of a virt-launcher pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodState {
    /// The node it is bound to.
    pub node: Option<String>,
    /// It ended (`Succeeded`, `Failed`).
    pub ended: bool,
    /// It requests TEE keys.
    pub keys: bool,
    /// Its VMI's UID (its controller owner).
    pub vmi: Option<String>,
}

/// What the index knows of a VMI.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct VmiState {
    /// It has no launcher pod yet (phase `Pending`).
    pub pending: bool,
    /// It waits for a key because teeguard refused its pod ([`queue::waiting`]).
    pub waiting: Option<Waiting>,
}

/// The index. See the module.
#[derive(Clone, Debug, Default)]
pub struct Index {
    ttl: Duration,
    synced: bool,
    /// By name, in name order: scans visit nodes alike in every replica and run.
    nodes: BTreeMap<String, NodeState>,
    pods: HashMap<String, PodState>,
    /// When this replica first saw each pod of `pods`.
    pods_seen: HashMap<String, Timestamp>,
    gone_pods: HashMap<String, Timestamp>,
    vmis: HashMap<String, VmiState>,
    gone_vmis: HashMap<String, Timestamp>,
    /// Where a VMI's last refused pod could go (VMI UID → its node selector and affinity).
    placements: HashMap<String, PodSpec>,
    /// Pods a report listed in `countedPods`, with when first seen so.
    counted: HashMap<String, Timestamp>,
    /// The nodes with a hold (live or not) naming each pod or VMI UID.
    located: HashMap<String, Vec<String>>,
    /// VMI UID → its launcher pods not ended (in `pods`).
    launched: HashMap<String, usize>,
}

impl Index {
    /// An empty index whose holds last at most `ttl` (`admission.ledgerTtl`).
    pub fn new(ttl: Duration) -> Self {
        Index {
            ttl,
            ..Index::default()
        }
    }

    // ---- applied by the watches ----

    /// Every watched kind has been listed once: a virt-launcher pod or VMI missing now is really
    /// missing.
    pub fn set_synced(&mut self) {
        self.synced = true;
    }

    fn node_mut(&mut self, name: &str) -> &mut NodeState {
        self.nodes.entry(name.to_string()).or_default()
    }

    fn drop_if_empty(&mut self, name: &str) {
        if self.nodes.get(name).is_some_and(NodeState::is_empty) {
            self.nodes.remove(name);
        }
    }

    /// A Node's labels (`None`: the Node was deleted).
    pub fn apply_node(&mut self, name: &str, labels: Option<Labels>) {
        self.node_mut(name).labels = labels;
        self.drop_if_empty(name);
    }

    /// A node's report (`None`: deleted) at `version` (its `resourceVersion`, a number). Its
    /// `countedPods` are remembered as counted. A report older than the one held is ignored: a new
    /// decider lists the reports ([`crate::cluster::lead::Leadership::catch_up`]) before its watch may
    /// deliver older ones.
    pub fn apply_report(
        &mut self,
        name: &str,
        status: Option<Arc<TeeCapacityStatus>>,
        version: Option<u64>,
        now: Timestamp,
    ) {
        let held = self.nodes.get(name).and_then(|n| n.report_version);
        if status.is_some() && older(version, held) {
            return;
        }
        self.node_mut(name).report_version = version.filter(|_| status.is_some());
        if let Some(s) = &status {
            for uid in &s.counted_pods {
                self.counted.entry(uid.clone()).or_insert(now);
            }
        }
        self.node_mut(name).report = status;
        self.drop_if_empty(name);
    }

    /// When a node's agent last renewed its Lease (`None`: deleted, or never renewed).
    pub fn apply_lease(&mut self, name: &str, renewed: Option<Timestamp>) {
        self.node_mut(name).lease = renewed;
        self.drop_if_empty(name);
    }

    /// A node's `TeeReservation` (`None`: deleted), from the watch, a write's answer or a read after
    /// a conflict. An object older than the one held (both `resourceVersion`s numbers, the new one
    /// smaller) is ignored: a write's answer may arrive before the watch delivers older versions.
    /// Returns whether it was applied.
    pub fn apply_holds(
        &mut self,
        name: &str,
        obj: Option<Arc<TeeReservation>>,
        now: Timestamp,
    ) -> bool {
        let old = self.nodes.get(name).and_then(|n| n.holds.clone());
        if let (Some(old), Some(new)) = (&old, &obj)
            && older(
                resource_version(&new.metadata),
                resource_version(&old.metadata),
            )
        {
            return false;
        }
        let new_entries = obj
            .as_deref()
            .map_or(&[][..], |o| o.spec.reservations.as_slice());
        // When each entry was first seen: kept for those the old object had, now for the others.
        let seen: Vec<Timestamp> = {
            let old_state = self.nodes.get(name);
            let old_entries = old_state.map_or(&[][..], NodeState::recorded);
            new_entries
                .iter()
                .map(|e| {
                    old_entries
                        .iter()
                        .zip(old_state.map_or(&[][..], |s| s.seen.as_slice()))
                        .find(|(o, _)| same_hold(o, e))
                        .map_or(now, |(_, at)| *at)
                })
                .collect()
        };
        self.locate(name, false);
        let state = self.node_mut(name);
        // A hold kept here because its write failed is recorded after all (the write reached the API
        // server late): one hold, not two.
        state
            .local
            .retain(|(l, _)| !new_entries.iter().any(|e| same_hold(e, l)));
        let same = match (&state.holds, &obj) {
            (Some(o), Some(n)) => {
                let held = resource_version(&o.metadata);
                held.is_some() && held == resource_version(&n.metadata)
            }
            (None, None) => true,
            _ => false,
        };
        if !same {
            state.changed = now;
        }
        state.holds = obj;
        state.seen = seen;
        self.locate(name, true);
        self.drop_if_empty(name);
        true
    }

    /// Add `name` to (or remove it from) the located nodes of every UID its holds name.
    fn locate(&mut self, name: &str, add: bool) {
        let Some(state) = self.nodes.get(name) else {
            return;
        };
        let uids: Vec<String> = state
            .recorded()
            .iter()
            .chain(state.local.iter().map(|(e, _)| e))
            .flat_map(|e| [&e.pod_uid, &e.vmi_uid])
            .filter(|u| !u.is_empty())
            .cloned()
            .collect();
        for uid in uids {
            if add {
                let nodes = self.located.entry(uid).or_default();
                if !nodes.iter().any(|n| n == name) {
                    nodes.push(name.to_string());
                }
            } else if let Some(nodes) = self.located.get_mut(&uid) {
                nodes.retain(|n| n != name);
                if nodes.is_empty() {
                    self.located.remove(&uid);
                }
            }
        }
    }

    /// The nodes with a hold naming pod or VMI `uid`.
    fn located(&self, uid: &str) -> &[String] {
        if uid.is_empty() {
            return &[];
        }
        self.located.get(uid).map_or(&[][..], Vec::as_slice)
    }

    /// A virt-launcher pod (`None`: deleted, also one a re-list no longer shows).
    pub fn apply_pod(&mut self, uid: &str, pod: Option<PodState>, now: Timestamp) {
        let old = match pod {
            Some(p) => {
                self.gone_pods.remove(uid);
                self.pods_seen.entry(uid.to_string()).or_insert(now);
                self.launch(&p, true);
                self.pods.insert(uid.to_string(), p)
            }
            None => {
                self.pods_seen.remove(uid);
                self.gone_pods.insert(uid.to_string(), now);
                self.pods.remove(uid)
            }
        };
        if let Some(old) = old {
            self.launch(&old, false);
        }
    }

    /// Count `pod` in (or out of) its VMI's launcher pods, unless it ended.
    fn launch(&mut self, pod: &PodState, add: bool) {
        let Some(vmi) = pod.vmi.as_ref().filter(|_| !pod.ended) else {
            return;
        };
        if add {
            *self.launched.entry(vmi.clone()).or_default() += 1;
        } else if let Some(n) = self.launched.get_mut(vmi) {
            *n -= 1;
            if *n == 0 {
                self.launched.remove(vmi);
            }
        }
    }

    /// A VMI as its watch shows it (`None`: deleted).
    pub fn apply_vmi(&mut self, uid: &str, vmi: Option<VmiState>, now: Timestamp) {
        match vmi {
            Some(mut v) => {
                self.gone_vmis.remove(uid);
                if let (Some(w), Some(p)) = (v.waiting.as_mut(), self.placements.get(uid)) {
                    w.placement = p.clone();
                }
                if !v.pending {
                    self.placements.remove(uid);
                }
                self.vmis.insert(uid.to_string(), v);
            }
            None => {
                self.vmis.remove(uid);
                self.placements.remove(uid);
                self.gone_vmis.insert(uid.to_string(), now);
            }
        }
    }

    /// teeguard refused a launcher pod of VMI `vmi_uid` whose node selector and affinity are in
    /// `pod`: where the VMI's pods may go from now on. virt-controller adds more to the pod than the
    /// VMI says (the architecture, `kubevirt.io/schedulable`, CPU model labels): a VMI whose pod can
    /// never use a node's key must not be served there.
    pub fn refused(&mut self, vmi_uid: &str, pod: &PodSpec) {
        let placement = PodSpec {
            node_selector: pod.node_selector.clone(),
            affinity: pod.affinity.clone(),
            ..PodSpec::default()
        };
        if let Some(w) = self.vmis.get_mut(vmi_uid).and_then(|v| v.waiting.as_mut()) {
            w.placement = placement.clone();
        }
        self.placements.insert(vmi_uid.to_string(), placement);
    }

    /// A hold this replica admitted on `node`, counted here until it is written (behind) into the
    /// node's object; ended by the same rule.
    pub fn hold_locally(&mut self, node: &str, hold: KeyReservation, now: Timestamp) {
        self.change_local(node, |local| {
            let claimant = Claimant {
                pod_uid: &hold.pod_uid,
                vmi_uid: &hold.vmi_uid,
            };
            local.retain(|(e, _)| !claimant.owns(e));
            local.push((hold, now));
        });
    }

    /// Forget the key promised to VMI `vmi_uid` on `node` that this replica keeps (not written yet).
    pub fn drop_local_promise(&mut self, node: &str, vmi_uid: &str) {
        let promise = Claimant::promise(vmi_uid);
        self.change_local(node, |local| local.retain(|(e, _)| !promise.owns(e)));
    }

    /// Change `node`'s local holds, keeping where each UID is held in step.
    fn change_local(
        &mut self,
        node: &str,
        change: impl FnOnce(&mut Vec<(KeyReservation, Timestamp)>),
    ) {
        self.locate(node, false);
        change(&mut self.node_mut(node).local);
        self.locate(node, true);
        self.drop_if_empty(node);
    }

    /// Live holds kept here that no `TeeReservation` records yet, per node (written behind).
    pub fn unwritten(&self, now: Timestamp) -> Vec<(String, Vec<KeyReservation>)> {
        self.nodes
            .iter()
            .filter(|(_, n)| !n.local.is_empty())
            .map(|(name, n)| {
                let live = n
                    .local
                    .iter()
                    .map(|(e, _)| e)
                    .filter(|e| self.end(name, e, now).is_none())
                    .cloned()
                    .collect::<Vec<_>>();
                (name.clone(), live)
            })
            .filter(|(_, live)| !live.is_empty())
            .collect()
    }

    /// Forget what is older than every hold can live, and local holds that ended.
    pub fn sweep(&mut self, now: Timestamp) {
        let keep = memory(self.ttl);
        let fresh = |at: &Timestamp| age(now, *at) < keep;
        self.gone_pods.retain(|_, at| fresh(at));
        self.gone_vmis.retain(|_, at| fresh(at));
        self.counted.retain(|_, at| fresh(at));
        let ended: Vec<(String, usize)> = self
            .nodes
            .iter()
            .flat_map(|(name, n)| {
                n.local
                    .iter()
                    .enumerate()
                    .filter(|(_, (e, _))| self.end(name, e, now).is_some())
                    .map(|(i, _)| (name.clone(), i))
                    .collect::<Vec<_>>()
            })
            .collect();
        for (name, i) in ended.into_iter().rev() {
            self.change_local(&name, |local| {
                local.remove(i);
            });
        }
    }

    // ---- what the decisions read ----

    /// Every hold on `node`, recorded and local.
    pub fn entries<'a>(&'a self, node: &str) -> impl Iterator<Item = &'a KeyReservation> + 'a {
        let state = self.nodes.get(node);
        state.map_or(&[][..], NodeState::recorded).iter().chain(
            state
                .into_iter()
                .flat_map(|n| n.local.iter().map(|(e, _)| e)),
        )
    }

    /// The live holds on `node`.
    pub fn live<'a>(
        &'a self,
        node: &'a str,
        now: Timestamp,
    ) -> impl Iterator<Item = &'a KeyReservation> + 'a {
        self.entries(node)
            .filter(move |e| self.end(node, e, now).is_none())
    }

    /// Keys held on `node` for claimants other than `claimant`, at `now`.
    pub fn held(&self, node: &str, claimant: Claimant<'_>, now: Timestamp) -> HeldKeys {
        let mut held = HeldKeys::default();
        for e in self.live(node, now).filter(|e| !claimant.owns(e)) {
            held.add(e);
        }
        held
    }

    /// A live hold of `claimant`'s own, and its node: its pod's, else a key promised to its VMI.
    pub fn own_hold(
        &self,
        claimant: Claimant<'_>,
        now: Timestamp,
    ) -> Option<(&str, &KeyReservation)> {
        let mut promise = None;
        for uid in [claimant.pod_uid, claimant.vmi_uid] {
            for name in self.located(uid) {
                for e in self.live(name, now).filter(|e| claimant.owns(e)) {
                    if !e.pod_uid.is_empty() {
                        return Some((name.as_str(), e));
                    }
                    promise = Some((name.as_str(), e));
                }
            }
        }
        promise
    }

    /// Whether VMI `vmi_uid` has a live hold anywhere (a key promised to it, or its pod's).
    pub fn vmi_holds(&self, vmi_uid: &str, now: Timestamp) -> bool {
        self.located(vmi_uid)
            .iter()
            .any(|name| self.live(name, now).any(|e| e.vmi_uid == vmi_uid))
    }

    /// Whether VMI `vmi_uid` has a launcher pod that has not ended: it waits no more, whatever its
    /// status says until virt-controller writes it.
    pub fn launched(&self, vmi_uid: &str) -> bool {
        self.launched.contains_key(vmi_uid)
    }

    /// The VMIs waiting for a key by their status ([`queue::waiting`]) and without a launcher pod.
    fn waiting_vmis(&self) -> impl Iterator<Item = &Waiting> {
        self.vmis
            .values()
            .filter_map(|v| v.waiting.as_ref())
            .filter(|w| !self.launched(&w.vmi.uid))
    }

    /// The VMIs waiting for a key of `kind` (every kind: `None`) that hold none, in turn order.
    pub fn waiting(&self, kind: Option<TeeKind>, now: Timestamp) -> Vec<&Waiting> {
        let mut out: Vec<&Waiting> = self
            .waiting_vmis()
            .filter(|w| kind.is_none_or(|k| w.kind == k))
            .filter(|w| !self.vmi_holds(&w.vmi.uid, now))
            .collect();
        out.sort_by(|a, b| queue::turn(a).cmp(&queue::turn(b)));
        out
    }

    /// How many VMIs wait, per kind (with or without a hold).
    pub fn waiting_counts(&self) -> BTreeMap<TeeKind, usize> {
        let mut counts = BTreeMap::new();
        for w in self.waiting_vmis() {
            *counts.entry(w.kind).or_default() += 1;
        }
        counts
    }

    /// Launcher pods requesting keys, admitted, unbound, uncounted, holding no key, first seen under
    /// the TTL ago: a crashed decider's, holds never written. A new decider admits no CREATE while
    /// any exist (their bindings hold their keys), so it gives away no key admitted for one.
    pub fn orphans(&self, now: Timestamp) -> usize {
        self.orphans_seen(now).count()
    }

    /// When this replica first saw each orphan launcher pod (see [`Index::orphans`]): each stops
    /// being one the TTL after.
    pub(super) fn orphans_seen(&self, now: Timestamp) -> impl Iterator<Item = Timestamp> + '_ {
        self.pods.iter().filter_map(move |(uid, p)| {
            let seen = *self.pods_seen.get(uid)?;
            let orphan = p.keys
                && p.node.is_none()
                && !p.ended
                && !self.counted.contains_key(uid)
                && !self
                    .located(uid)
                    .iter()
                    .any(|n| self.live(n, now).any(|e| e.pod_uid == *uid))
                && age(now, seen) < self.ttl;
            orphan.then_some(seen)
        })
    }

    /// Every VMI the index knows, by UID.
    pub fn vmis(&self) -> impl Iterator<Item = (&str, &VmiState)> {
        self.vmis.iter().map(|(u, v)| (u.as_str(), v))
    }

    /// The node `name`'s report and Lease.
    pub fn report(&self, name: &str) -> Report<'_> {
        let n = self.nodes.get(name);
        Report {
            status: n.and_then(|n| n.report.as_deref()),
            lease_renewed: n.and_then(|n| n.lease),
        }
    }

    /// The node `name`'s state.
    pub fn node(&self, name: &str) -> Option<&NodeState> {
        self.nodes.get(name)
    }

    /// Call `visit` with each node with labels (a Node exists) for which `filter(name, labels)` holds,
    /// until it breaks: `first` (when such a node) before the others, each once, in no set order.
    pub fn scan_nodes(
        &self,
        filter: &dyn Fn(&str, &Labels) -> bool,
        first: Option<&str>,
        visit: &mut dyn FnMut(&str, &Labels) -> ControlFlow<()>,
    ) {
        let mut look = |name: &str, state: &NodeState| match &state.labels {
            Some(labels) if filter(name, labels) => visit(name, labels),
            _ => ControlFlow::Continue(()),
        };
        if let Some((name, state)) = first.and_then(|f| self.nodes.get_key_value(f))
            && look(name, state).is_break()
        {
            return;
        }
        for (name, state) in &self.nodes {
            if Some(name.as_str()) == first {
                continue;
            }
            if look(name, state).is_break() {
                return;
            }
        }
    }

    /// Every node the index knows, with its state.
    pub fn nodes(&self) -> impl Iterator<Item = (&str, &NodeState)> {
        self.nodes.iter().map(|(n, s)| (n.as_str(), s))
    }

    /// Live holds per reason, over every node (for the metrics).
    pub fn hold_counts(&self, now: Timestamp) -> BTreeMap<HoldReason, usize> {
        let mut counts = BTreeMap::new();
        for name in self.nodes.keys() {
            for e in self.live(name, now) {
                *counts.entry(e.reason()).or_default() += 1;
            }
        }
        counts
    }
}

/// `now − then`, zero when `then` is ahead.
pub fn age(now: Timestamp, then: Timestamp) -> Duration {
    Duration::try_from(now.duration_since(then)).unwrap_or(Duration::ZERO)
}

/// Whether `a` and `b` are one hold: the same holder, admitted at the same moment (to the second the
/// API server keeps). A holder's later hold (its pod bound after its admission ended) is another
/// hold, with a life of its own.
fn same_hold(a: &KeyReservation, b: &KeyReservation) -> bool {
    a.pod_uid == b.pod_uid
        && (!a.pod_uid.is_empty() || a.vmi_uid == b.vmi_uid)
        && a.admitted_at.0.as_second() == b.admitted_at.0.as_second()
}

mod end;
mod fingerprint;
mod version;

use version::older;
pub use version::resource_version;

#[cfg(test)]
mod tests;
