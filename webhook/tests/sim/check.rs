//! The invariants, checked after every step, and the figures a run reports.
//!
//! - I1: per node, pods bound there (not gone) + keys held outside Kubernetes ≤ capacity: no VM is
//!   ever sent where the kernel has no key for it.
//! - I2: no launcher pod is admitted at its CREATE without a hold recorded for it on some node (in
//!   the leader mode: in the decider's index); and, at every step, per kind, the launcher pods admitted
//!   and not bound yet (less than the TTL ago) fit in the keys the nodes of that kind have left after
//!   the pods bound there: no key promised at CREATE is given to another pod (a decider that crashed
//!   before writing its holds behind must not lose them).
//! - I6 (leader mode): at most one replica decides at a time.
//! - I3: a VMI a free key serves (first come, first served, as [`admit::promises`] hands keys out on
//!   the truth) holds a key within [`RETRY_BOUND`] while the webhook is up (a decider with its
//!   watches, no orphan to wait for, started at least `POD_GRACE` ago); in the model checker, no
//!   state without a next step leaves one waiting.
//! - I4: a VMI that gets a key never takes one a VMI refused before it needed (the earlier VMIs the
//!   free keys serve are as many after as before).
//! - I5: every hold ends: none is live for a pod or VMI deleted longer than the watches take to tell,
//!   and none at all once the world is quiet.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet};

use teeguard_shared::TeeKind;
use teeguard_webhook::cluster::index::KeyIndex;
use teeguard_webhook::decide::admit;
use teeguard_webhook::decide::affinity::node_matches;
use teeguard_webhook::decide::holds::{Claimant, POD_GRACE};
use teeguard_webhook::decide::index::{Index, VmiState};
use teeguard_webhook::decide::queue;

use super::world::{Action, HOLDS, Happened, PODS, VMIS, World};

/// How long a VMI a free key serves may wait for its hold while the webhook is up (simulated ms).
pub const RETRY_BOUND: u64 = 1_000;

/// What a run saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Figures {
    /// Pods that started (their key charged).
    pub started: u64,
    /// Pod CREATEs teeguard refused.
    pub refused: u64,
    /// `TEEKeyFree` Events (one per retry).
    pub retried: u64,
    /// The longest time from a key free for a VMI to the VMI holding it (ms).
    pub longest_to_hold: u64,
    /// The longest time from a key free for a VMI to its pod bound (ms).
    pub longest_to_bound: u64,
    /// I1 violations (a pod bound where the kernel had no key).
    pub overcommits: u64,
    /// I3 violations (a VMI left waiting beside a free key).
    pub left_waiting: u64,
    /// Holds still live at the end.
    pub holds_left: u64,
    /// Launcher pods the scheduler found no node for (`Insufficient`).
    pub insufficient: u64,
}

/// The checker of one run.
#[derive(Debug, Default)]
pub struct Checks {
    /// What was broken, first first.
    pub violations: Vec<String>,
    /// The figures.
    pub figures: Figures,
    /// When a free key started serving each waiting VMI.
    servable: BTreeMap<String, u64>,
    /// When each VMI got its hold (for the bound latency).
    held_at: BTreeMap<String, u64>,
    healthy_since: Option<u64>,
    started: BTreeSet<String>,
    insufficient: BTreeSet<String>,
    /// The VMIs a free key serves, as of `oracle_at` changes.
    serves: BTreeSet<String>,
    oracle_at: Option<(u64, u64)>,
}

impl Checks {
    fn fail(&mut self, what: String) {
        if self.violations.len() < 20 {
            self.violations.push(what);
        }
    }

    /// Check the world after `action` did `happened`. `timed`: the clock means something (the
    /// seeded runs); the model checker's worlds have no time.
    pub fn after(&mut self, w: &World, action: &Action, happened: &Happened, timed: bool) {
        self.capacity(w);
        self.no_overbooking(w);
        {
            let deciding: Vec<usize> = (0..w.replicas.len())
                .filter(|r| w.replicas[*r].alive && w.replicas[*r].leadership.deciding())
                .collect();
            if deciding.len() > 1 {
                self.fail(format!(
                    "I6: replicas {deciding:?} decide at once ({action:?})"
                ));
            }
        }
        if let Some((pod, false)) = &happened.admitted {
            self.fail(format!(
                "I2: pod {pod} admitted at its CREATE ({action:?}) with no hold recorded for it"
            ));
        }
        for vmi in &happened.served {
            // A replica whose VMI watch is down (or listed again only a moment ago) cannot know which
            // VMIs wait: first come, first served holds for what the replicas know.
            let blind = happened.decided_by.is_some_and(|r| {
                let rep = &w.replicas[r];
                rep.dropped[VMIS] || rep.listed_at[VMIS] + w.max_delay + 100 > w.now
            });
            if timed && blind {
                continue;
            }
            let (index, visible) = match (timed, happened.decided_by) {
                (true, _) => (&w.oracle, w.max_delay + 100),
                (false, Some(r)) => (&w.replicas[r].index, 0),
                (false, None) => continue,
            };
            self.first_come(w, index, vmi, visible, action);
        }
        if timed {
            self.timely(w);
            self.no_hold_for_the_gone(w);
        }
        let t = w.truth();
        for uid in t.nodes.values().flat_map(|n| n.charged.iter()) {
            self.started.insert(uid.clone());
        }
        for (uid, p) in &t.pods {
            if p.unschedulable {
                self.insufficient.insert(uid.clone());
            }
        }
        self.figures.started = self.started.len() as u64;
        self.figures.insufficient = self.insufficient.len() as u64;
        self.figures.refused = t.vmis.values().map(|v| u64::from(v.refusals)).sum();
        self.figures.retried = t.vmis.values().map(|v| u64::from(v.retried)).sum();
    }

    /// I1.
    fn capacity(&mut self, w: &World) {
        let t = w.truth();
        let mut broken = Vec::new();
        for (name, n) in &t.nodes {
            let bound = t
                .pods
                .values()
                .filter(|p| p.node.as_deref() == Some(name.as_str()))
                .count() as u64;
            if bound + n.spec.external > n.spec.capacity {
                broken.push(format!(
                    "I1: node {name}: {bound} pods bound + {} held outside Kubernetes > {} keys",
                    n.spec.external, n.spec.capacity
                ));
            }
        }
        drop(t);
        for b in broken {
            self.figures.overcommits += 1;
            self.fail(b);
        }
    }

    /// I2 over time (see the module).
    fn no_overbooking(&mut self, w: &World) {
        let ttl = w.config.admission.ledger_ttl.as_millis() as u64;
        let t = w.truth();
        let mut broken = Vec::new();
        for kind in kinds(w) {
            let (mut keys, mut bound) = (0u64, 0u64);
            for (name, n) in t.nodes.iter().filter(|(_, n)| n.spec.kind == kind) {
                keys += n.spec.capacity.saturating_sub(n.spec.external);
                bound += t
                    .pods
                    .values()
                    .filter(|p| p.node.as_deref() == Some(name.as_str()))
                    .count() as u64;
            }
            let waiting: Vec<&String> = t
                .pods
                .iter()
                .filter(|(_, p)| {
                    p.kind == kind && p.node.is_none() && !p.deleting && w.now < p.admitted_at + ttl
                })
                .map(|(u, _)| u)
                .collect();
            if bound + waiting.len() as u64 > keys {
                broken.push(format!(
                    "I2: {kind:?}: {} pods admitted and not bound yet ({waiting:?}) + {bound} bound > \
                     {keys} keys",
                    waiting.len()
                ));
            }
        }
        drop(t);
        for b in broken {
            self.fail(b);
        }
    }

    /// I4: `vmi` just got a key (seen through `index`); VMIs refused before it, at least `visible` ms
    /// ago, are served as well after as before.
    fn first_come(
        &mut self,
        w: &World,
        index: &KeyIndex,
        vmi: &str,
        visible: u64,
        action: &Action,
    ) {
        let now = index.now();
        let read = index.read();
        let ix = as_truth(w, &read, now);
        let stale = w.config.admission.stale_report_after;
        // Its place in the queue, from the API server (its pod is created by now: it waits no more):
        // the time of its first refusal, or after every VMI refused when it never was.
        let (kind, own_turn) = {
            let t = w.truth();
            let Some(v) = t.vmis.get(vmi) else {
                return;
            };
            let since = v.refused_at.map(super::world::at);
            (
                v.kind,
                (since.is_none(), since, "vms".to_string(), v.name.clone()),
            )
        };
        let Some(node) = ix
            .own_hold(
                Claimant {
                    pod_uid: "",
                    vmi_uid: vmi,
                },
                now,
            )
            .map(|(n, _)| n.to_string())
            .or_else(|| {
                let t = w.truth();
                t.vmis[vmi].pod.clone().and_then(|p| {
                    ix.own_hold(
                        Claimant {
                            pod_uid: &p,
                            vmi_uid: vmi,
                        },
                        now,
                    )
                    .map(|(n, _)| n.to_string())
                })
            })
        else {
            return;
        };
        let refused_at = |uid: &str| w.truth().vmis.get(uid).and_then(|v| v.refused_at);
        let earlier: Vec<queue::Waiting> = ix
            .waiting(Some(kind), now)
            .into_iter()
            .filter(|u| {
                let (a, b, c, d) = queue::turn(u);
                (a, b, c.to_string(), d.to_string()) < own_turn
            })
            .filter(|u| refused_at(&u.vmi.uid).is_some_and(|at| at + visible <= w.now))
            .cloned()
            .collect();
        if earlier.is_empty() {
            return;
        }
        let slots = admit::slots(&ix, kind, 1, Claimant::NONE, stale, now);
        let mut nodes: Vec<(String, std::collections::BTreeMap<String, String>, u64)> = slots
            .iter()
            .map(|s| (s.node.to_string(), s.labels.clone(), s.vmis))
            .collect();
        let served = |nodes: &[(String, std::collections::BTreeMap<String, String>, u64)]| {
            let cap: Vec<u64> = nodes.iter().map(|n| n.2).collect();
            queue::serve(earlier.len(), &cap, |v, s| {
                node_matches(&earlier[v].placement, &nodes[s].0, &nodes[s].1)
            })
            .iter()
            .filter(|s| s.is_some())
            .count()
        };
        let after = served(&nodes);
        match nodes.iter_mut().find(|n| n.0 == node) {
            Some(n) => n.2 += 1,
            None => {
                let labels = ix
                    .node(&node)
                    .and_then(|s| s.labels.clone())
                    .unwrap_or_default();
                nodes.push((node.clone(), labels, 1));
                nodes.sort_by(|a, b| a.0.cmp(&b.0));
            }
        }
        let before = served(&nodes);
        if after < before {
            let names: Vec<&str> = earlier.iter().map(|u| u.vmi.name.as_str()).collect();
            drop(ix);
            drop(read);
            self.fail(format!(
                "I4: {vmi} took the key on {node} ({action:?}) that a VMI refused before it needed: {names:?}"
            ));
        }
    }

    /// I3, and the latency figures.
    fn timely(&mut self, w: &World) {
        // The webhook is up when the decider has all its watches and no orphan launcher pod to wait
        // for, and started POD_GRACE ago: a decider that started later keeps the holds it first saw
        // up to POD_GRACE past their TTL (the end rule's guard against a writer's clock far behind),
        // which matters once a clean stop lets a replica just restarted take the Lease at once.
        let grace = POD_GRACE.as_millis() as u64;
        let deciding = |r: &super::world::Replica| {
            r.leadership.deciding()
                && r.index.read().orphans(r.index.now()) == 0
                && w.now >= r.started_at + grace
        };
        let healthy = !w.truth().api_down
            && w.replicas
                .iter()
                .any(|r| r.alive && r.synced && !r.dropped.iter().any(|d| *d) && deciding(r));
        self.healthy_since = match (healthy, self.healthy_since) {
            (true, Some(t)) => Some(t),
            (true, None) => Some(w.now),
            (false, _) => None,
        };
        let ix = w.oracle.read();
        let now = w.oracle.now();
        let stale = w.config.admission.stale_report_after;
        // What the oracle knows changes with the API server's changes and, for the end rule's
        // graces, each second.
        let at = (w.changes, w.now / 1_000);
        if self.oracle_at != Some(at) {
            self.oracle_at = Some(at);
            self.serves = admit::promises(&as_truth(w, &ix, now), |_| 1, stale, now)
                .iter()
                .map(|p| p.waiting.vmi.uid.clone())
                .collect();
        }
        let servable = self.serves.clone();
        let held: BTreeSet<String> = self
            .servable
            .keys()
            .filter(|u| ix.vmi_holds(u, now))
            .cloned()
            .collect();
        drop(ix);
        for uid in &held {
            if let Some(since) = self.servable.remove(uid) {
                self.figures.longest_to_hold = self.figures.longest_to_hold.max(w.now - since);
                self.held_at.insert(uid.clone(), since);
            }
        }
        self.servable.retain(|u, _| servable.contains(u));
        for uid in servable {
            self.servable.entry(uid).or_insert(w.now);
        }
        let t = w.truth();
        for (uid, since) in std::mem::take(&mut self.held_at) {
            let bound = t
                .vmis
                .get(&uid)
                .and_then(|v| v.pod.as_ref())
                .and_then(|p| t.pods.get(p))
                .is_some_and(|p| p.node.is_some());
            if bound {
                self.figures.longest_to_bound = self.figures.longest_to_bound.max(w.now - since);
            } else if t.vmis.get(&uid).is_some_and(|v| v.deleted_at.is_none()) {
                self.held_at.insert(uid, since);
            }
        }
        drop(t);
        let Some(healthy_since) = self.healthy_since else {
            return;
        };
        let late: Vec<(String, u64)> = self
            .servable
            .iter()
            .filter(|(_, since)| w.now - (**since).max(healthy_since) > RETRY_BOUND)
            .map(|(u, s)| (u.clone(), *s))
            .collect();
        for (uid, since) in late {
            self.figures.left_waiting += 1;
            self.fail(format!(
                "I3: VMI {uid} has had a free key since {since} ms and holds none at {} ms",
                w.now
            ));
            self.servable.insert(uid, w.now);
        }
    }

    /// I5, step by step: no replica that has heard of a deletion holds a key for the deleted pod or
    /// VMI.
    fn no_hold_for_the_gone(&mut self, w: &World) {
        let bound = w.max_delay + 1;
        let told = |at: Option<&u64>| at.is_some_and(|at| at + bound < w.now);
        let mut broken = Vec::new();
        {
            let t = w.truth();
            for (i, r) in w.replicas.iter().enumerate() {
                if !r.alive || r.dropped[PODS] || r.dropped[VMIS] || r.dropped[HOLDS] {
                    continue;
                }
                let ix = r.index.read();
                let now = r.index.now();
                for (node, _) in ix.nodes() {
                    for e in ix.live(node, now) {
                        let gone = if e.pod_uid.is_empty() {
                            told(t.vmis.get(&e.vmi_uid).and_then(|v| v.deleted_at.as_ref()))
                        } else {
                            told(t.gone_pods.get(&e.pod_uid))
                        };
                        if gone {
                            broken.push(format!(
                                "I5: replica {i} still holds a key on {node} for a deleted pod or VMI: {e:?}"
                            ));
                        }
                    }
                }
            }
        }
        for b in broken {
            self.fail(b);
        }
    }

    /// At the end, the world quiet: no hold left anywhere, no VMI left beside a free key.
    pub fn finish(&mut self, w: &World) {
        let mut left = Vec::new();
        for (who, index) in std::iter::once(("oracle".to_string(), &w.oracle)).chain(
            w.replicas
                .iter()
                .enumerate()
                .filter(|(_, r)| r.alive)
                .map(|(i, r)| (format!("replica {i}"), &r.index)),
        ) {
            let ix = index.read();
            let now = index.now();
            for (node, _) in ix.nodes() {
                for e in ix.live(node, now) {
                    left.push(format!(
                        "I5: {who} holds a key on {node} for pod {:?} VMI {:?} at the end",
                        e.pod_uid, e.vmi_uid
                    ));
                }
            }
        }
        self.figures.holds_left = left.len() as u64;
        for l in left {
            self.fail(l);
        }
    }

    /// In the model checker's quiet states (nothing left to do): no VMI a free key serves still
    /// waits (I3), and no hold is live for a deleted pod or VMI (I5).
    pub fn quiet(&mut self, w: &World) {
        let oracle = w.truth_index();
        let ix = oracle.read();
        let now = oracle.now();
        let stale = w.config.admission.stale_report_after;
        let waiting: Vec<String> = admit::promises(&ix, |_| 1, stale, now)
            .iter()
            .map(|p| p.waiting.vmi.name.clone())
            .collect();
        drop(ix);
        if !waiting.is_empty() {
            self.fail(format!(
                "I3: nothing left to do, yet {waiting:?} wait beside a free key"
            ));
        }
        let t = w.truth();
        let mut broken = Vec::new();
        for (i, r) in w.replicas.iter().enumerate().filter(|(_, r)| r.alive) {
            let ix = r.index.read();
            let now = r.index.now();
            for (node, _) in ix.nodes() {
                for e in ix.live(node, now) {
                    let gone = t.gone_pods.contains_key(&e.pod_uid)
                        || (e.pod_uid.is_empty()
                            && t.vmis
                                .get(&e.vmi_uid)
                                .is_some_and(|v| v.deleted_at.is_some()));
                    if gone {
                        broken.push(format!(
                            "I5: replica {i} holds a key on {node} for deleted {:?}/{:?}",
                            e.pod_uid, e.vmi_uid
                        ));
                    }
                }
            }
        }
        drop(t);
        for b in broken {
            self.fail(b);
        }
    }
}

/// The kinds of the nodes of a world.
pub fn kinds(w: &World) -> BTreeSet<TeeKind> {
    w.spec.nodes.iter().map(|n| n.kind).collect()
}

/// `ix` as it would be if virt-controller wrote each VMI's status as it created the pod: a VMI whose
/// pod the API server has neither waits nor is pending, whatever its lagging status still says. The
/// checks judge who waits by the API server's pods, not by what the webhook reads.
fn as_truth<'a>(w: &World, ix: &'a Index, now: jiff::Timestamp) -> Cow<'a, Index> {
    let t = w.truth();
    let lagging: Vec<&String> = t
        .vmis
        .iter()
        .filter(|(_, v)| v.deleted_at.is_none() && v.pod.is_some() && v.status_pod != v.pod)
        .map(|(uid, _)| uid)
        .collect();
    if lagging.is_empty() {
        return Cow::Borrowed(ix);
    }
    let mut view = ix.clone();
    for uid in lagging {
        let launched = VmiState {
            pending: false,
            waiting: None,
        };
        view.apply_vmi(uid, Some(launched), now);
    }
    Cow::Owned(view)
}
