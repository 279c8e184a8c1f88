//! The one end rule of a hold (see [`crate::decide::holds`]), and when a hold may end by time alone.

use std::time::Duration;

use jiff::Timestamp;
use teeguard_shared::reservation::{HoldReason, KeyReservation};

use super::{Index, age, same_hold};
use crate::decide::holds::{End, POD_GRACE};

impl Index {
    /// The one end rule (see [`crate::decide::holds`]): why the hold `e` on `node` ended at `now`, or
    /// `None` while it holds.
    pub fn end(&self, node: &str, e: &KeyReservation, now: Timestamp) -> Option<End> {
        let seen = self.first_seen(node, e).unwrap_or(now);
        let held_for = age(now, seen);
        let written = age(now, e.admitted_at.0);
        // A pod (or a promise's VMI) the synced cache does not have, POD_GRACE after the hold was
        // written (its writer's clock, within the grace of this replica's) or first seen here: it
        // would be in the cache if it existed (its creation follows the hold's write by milliseconds).
        // A replica that starts after a pod was deleted thus ends its hold at once, not POD_GRACE later.
        let unseen_long = self.synced && (held_for >= POD_GRACE || written >= POD_GRACE);
        if e.pod_uid.is_empty() {
            // A key promised to a VMI: until the VMI has a pod (whose own hold holds the key) or is gone.
            if self.gone_vmis.contains_key(&e.vmi_uid) || self.launched(&e.vmi_uid) {
                return Some(End::VmiDone);
            }
            match self.vmis.get(&e.vmi_uid) {
                Some(v) if !v.pending => return Some(End::VmiDone),
                None if unseen_long => return Some(End::VmiDone),
                _ => {}
            }
        } else {
            if self.counted(node, &e.pod_uid) {
                return Some(End::Counted);
            }
            if self.gone_pods.contains_key(&e.pod_uid) {
                return Some(End::PodGone);
            }
            match self.pods.get(&e.pod_uid) {
                Some(p) if p.ended => return Some(End::PodGone),
                Some(p) if p.node.as_deref().is_some_and(|n| n != node) => {
                    return Some(End::Moved);
                }
                // Only virt-launcher pods are watched: another pod's hold ends by its count or the TTL.
                None if !e.vmi_uid.is_empty() && unseen_long => {
                    return Some(End::PodGone);
                }
                _ => {}
            }
            if e.reason() != HoldReason::Bound && self.bound_elsewhere(&e.pod_uid, node) {
                return Some(End::Moved);
            }
        }
        // The TTL counts from the write (the writer's clock: a replica that started after it, or saw
        // it late, ends it as the others do) but never sooner than POD_GRACE after this replica first
        // saw it (a writer's clock far behind ends nothing early); and at the latest from then.
        let expired = held_for >= self.ttl || (written >= self.ttl && held_for >= POD_GRACE);
        expired.then_some(End::Expired)
    }

    /// Whether a node other than `node` has a `Bound` hold of pod `uid`.
    fn bound_elsewhere(&self, uid: &str, node: &str) -> bool {
        self.located(uid).iter().filter(|n| *n != node).any(|n| {
            self.entries(n)
                .any(|e| e.pod_uid == uid && e.reason() == HoldReason::Bound)
        })
    }

    fn first_seen(&self, node: &str, e: &KeyReservation) -> Option<Timestamp> {
        let n = self.nodes.get(node)?;
        n.seen_holds()
            .find(|(l, _)| same_hold(l, e))
            .map(|(_, at)| *at)
    }

    /// Whether a report counts pod `uid`: `node`'s current one, or any this replica saw.
    pub fn counted(&self, node: &str, uid: &str) -> bool {
        self.counted.contains_key(uid)
            || self
                .nodes
                .get(node)
                .and_then(|n| n.report.as_deref())
                .is_some_and(|r| r.counted_pods.iter().any(|c| c == uid))
    }

    /// The next moment after `now` at which a live hold may end by time alone (its grace or its TTL),
    /// or an orphan launcher pod stops holding the new decider's admissions back: nothing else tells
    /// the planner that a key frees.
    pub fn next_deadline(&self, now: Timestamp) -> Option<Timestamp> {
        let after = |d: Duration, from: Timestamp| from.checked_add(d).ok().filter(|t| *t > now);
        let holds = self.nodes.iter().flat_map(|(name, state)| {
            state
                .seen_holds()
                .filter(move |(e, _)| self.end(name, e, now).is_none())
                .flat_map(move |(e, seen)| {
                    let written =
                        after(self.ttl, e.admitted_at.0).map(|t| t.max(*seen + POD_GRACE));
                    [
                        after(POD_GRACE, *seen),
                        after(POD_GRACE, e.admitted_at.0),
                        after(self.ttl, *seen),
                        written,
                    ]
                })
        });
        // A new decider admits again once no orphan launcher pod is left: the keys waiting VMIs
        // could not be given meanwhile are theirs then.
        let orphans = self.orphans_seen(now).map(|seen| after(self.ttl, seen));
        holds.chain(orphans).flatten().min()
    }
}
