//! The admission ledger: keys this webhook replica admitted onto a node that the node's `TeeCapacity`
//! report does not show yet.
//!
//! Between the admission of a binding and the node agent's next report there is a window (the API
//! server persists the binding, the agent's pod watch sees it, the agent polls and publishes: typically
//! about a second) in which the report still counts the key as free. Without a ledger, two bindings in
//! that window can both take the last key. With it, a binding is admitted only when
//! `report.free − keys reserved here by other pods ≥ requested`, and the check and the reservation are
//! one atomic step ([`Ledger::check_and_reserve`]: a mutex held only across the pure check and the
//! insert, never across an `await`).
//!
//! A reservation ends, for good, when
//! - a report that **counts the pod** arrives: the agent lists the UIDs of the recently bound pods whose
//!   keys its figures count in `status.countedPods` (every pod still pending, and every pod first
//!   counted within `admission.ledgerTtl`), so from that report on the pod's keys are in `free` and
//!   holding them here too would count them twice ([`Reservation::counted_in`]). The report cache
//!   tells the ledger at the report's arrival ([`Ledger::report_arrived`]), not at the next check on
//!   that node: a pod deleted before any check saw such a report would otherwise be held again once
//!   the report stops listing it. No clocks are compared: skew between the node and the webhook does
//!   not matter; or
//! - its pod is deleted (the pod cache's delete event, also one a re-list reveals:
//!   [`Ledger::pod_deleted`]); or
//! - `admission.ledgerTtl` has passed since the admission: the backstop for pods that never reach the
//!   node (the bind failed) or a node whose agent does not report.
//!
//! An ended reservation never comes back: its pod's UID is remembered for the TTL, and a later
//! binding of the same pod (a retry) is decided but reserves nothing; neither does a binding of a pod
//! the node's current report already counts. Every pod a report counts is remembered so, whichever
//! replica reserved it: the shared reservations' entries of such pods hold nothing either.
//!
//! Reservations are keyed by pod UID: a retried binding of the same pod does not reserve twice; a
//! binding of the same pod to another node moves the reservation.
//!
//! # Guarantee
//! Within one replica, concurrent admissions against one node never admit more keys than the report's
//! `free` (minus what this replica already reserved). Across replicas the ledger is the first step:
//! an admission it allows is then written to the node's shared `TeeReservation` with a
//! `resourceVersion` precondition ([`super::reservations`], `crate::cluster::reservations`), so
//! replicas racing for one last key serialize in etcd and exactly one wins. Only when the API server
//! cannot be reached does a replica decide with its own ledger alone (counted, with a warning).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock};
use std::time::{Duration, Instant};

use teeguard_shared::TeeKind;
use teeguard_shared::pod::KeyRequests;

/// One admitted pod's keys on one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// The pod's UID (or `namespace/name` when it has none).
    pub pod_uid: String,
    /// `namespace/name`, for logs.
    pub pod: String,
    /// Keys per kind.
    pub keys: KeyRequests,
    /// Monotonic admission time, for the TTL.
    pub admitted: Instant,
}

/// The pods the node's cached report counts (its `status.countedPods`; empty without a report).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReportMark<'a> {
    /// UIDs of the pods whose keys the report's figures count.
    pub counted_pods: &'a [String],
}

impl<'a> ReportMark<'a> {
    /// The pods a node's report (`None`: no report) counts.
    pub fn of(report: Option<&'a teeguard_shared::TeeCapacity>) -> Self {
        ReportMark {
            counted_pods: report
                .and_then(|c| c.status.as_ref())
                .map_or(&[], |s| s.counted_pods.as_slice()),
        }
    }
}

impl Reservation {
    /// Whether the TTL has passed.
    pub fn expired(&self, now: Instant, ttl: Duration) -> bool {
        now.saturating_duration_since(self.admitted) >= ttl
    }

    /// Whether the report `mark` counts this pod, so its keys are in the report's `free` already.
    pub fn counted_in(&self, mark: ReportMark<'_>) -> bool {
        mark.counted_pods.contains(&self.pod_uid)
    }
}

/// At most this many ended reservations are remembered (far more than bindings within a TTL).
const ENDED_KEPT: usize = 65_536;

/// What [`Ledger::check_and_reserve`] did with the candidate reservation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reserved {
    /// The decision did not ask for a reservation.
    No,
    /// The decision admitted the pod, but its keys are counted already: the node's report counts
    /// the pod, or the pod's reservation ended (counted, or the pod deleted) within the TTL.
    Counted,
    /// A new reservation was added.
    Added,
    /// The pod already held a reservation on this node; it was kept as is.
    AlreadyHeld,
    /// The pod's reservation on another node moved here.
    Moved {
        /// The node it was on.
        from: String,
    },
}

#[derive(Debug, Default)]
struct State {
    nodes: HashMap<String, Vec<Reservation>>,
    pods: HashMap<String, String>,
    len: usize,
    /// Pods whose reservation ended (counted by a report, or deleted), with when: no reservation is
    /// made for them again within the TTL.
    ended: HashMap<String, Instant>,
}

impl State {
    fn retain_node(&mut self, node: &str, mut keep: impl FnMut(&Reservation) -> bool) {
        let Some(list) = self.nodes.get_mut(node) else {
            return;
        };
        let before = list.len();
        let pods = &mut self.pods;
        list.retain(|r| {
            let k = keep(r);
            if !k {
                pods.remove(&r.pod_uid);
            }
            k
        });
        self.len -= before - list.len();
        if list.is_empty() {
            self.nodes.remove(node);
        }
    }

    /// Drop the node's reservations that expired or that `mark` counts; the counted ones end for good.
    fn settle(&mut self, node: &str, mark: ReportMark<'_>, now: Instant, ttl: Duration) {
        let mut counted = Vec::new();
        self.retain_node(node, |r| {
            if r.expired(now, ttl) {
                return false;
            }
            if r.counted_in(mark) {
                counted.push(r.pod_uid.clone());
                return false;
            }
            true
        });
        for uid in counted {
            self.end(&uid, now, ttl);
        }
    }

    /// Remember that `uid`'s reservation ended at `now` (bounded: entries older than `ttl` go first).
    fn end(&mut self, uid: &str, now: Instant, ttl: Duration) {
        if self.ended.len() >= ENDED_KEPT {
            self.ended
                .retain(|_, at| now.saturating_duration_since(*at) < ttl);
            if self.ended.len() >= ENDED_KEPT {
                self.ended.clear();
            }
        }
        self.ended.insert(uid.to_string(), now);
    }

    fn has_ended(&self, uid: &str, now: Instant, ttl: Duration) -> bool {
        self.ended
            .get(uid)
            .is_some_and(|at| now.saturating_duration_since(*at) < ttl)
    }

    fn held_except(&self, node: &str, except_uid: &str) -> KeyRequests {
        let mut held = KeyRequests::new();
        for r in self.nodes.get(node).into_iter().flatten() {
            if r.pod_uid == except_uid {
                continue;
            }
            for (kind, n) in &r.keys {
                let slot = held.entry(*kind).or_insert(0);
                *slot = slot.saturating_add(*n);
            }
        }
        held
    }
}

/// The ledger of one webhook replica. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct Ledger {
    ttl: Duration,
    state: Mutex<State>,
    /// The number of reservations, as of the last release of the lock: read without the lock by
    /// [`Ledger::held`] (a scan over the candidate nodes of a pod asks once per node, and usually
    /// nothing is held anywhere) and [`Ledger::len`].
    reserved: AtomicUsize,
    /// Per TEE kind, the node that last fitted a pod not bound yet ([`Ledger::fit_hint`]).
    fit_hints: [RwLock<Option<Arc<str>>>; TeeKind::ALL.len()],
}

/// The locked state; on release, publishes the number of reservations to [`Ledger::reserved`].
struct Locked<'a> {
    state: MutexGuard<'a, State>,
    reserved: &'a AtomicUsize,
}

impl std::ops::Deref for Locked<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        &self.state
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.state
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        self.reserved.store(self.state.len, Ordering::Release);
    }
}

impl Ledger {
    /// An empty ledger whose reservations last at most `ttl`.
    pub fn new(ttl: Duration) -> Self {
        Ledger {
            ttl,
            state: Mutex::new(State::default()),
            reserved: AtomicUsize::new(0),
            fit_hints: Default::default(),
        }
    }

    fn hint_slot(&self, kind: TeeKind) -> &RwLock<Option<Arc<str>>> {
        let at = TeeKind::ALL.iter().position(|k| *k == kind).unwrap_or(0);
        &self.fit_hints[at]
    }

    /// The node that last fitted a pod requesting `kind` keys before it was bound, to look at first
    /// next time: candidate scans stop at the first node that fits, and when most nodes are full a
    /// scan in no particular order looks at many before finding one, while the last node that fitted
    /// usually still does. Only an order: the verdict is the same whichever node is looked at first.
    pub fn fit_hint(&self, kind: TeeKind) -> Option<Arc<str>> {
        self.hint_slot(kind)
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Remember `node` as the one that fitted a pod requesting `kind` keys.
    pub fn remember_fit(&self, kind: TeeKind, node: &str) {
        let mut hint = self
            .hint_slot(kind)
            .write()
            .unwrap_or_else(PoisonError::into_inner);
        if hint.as_deref() != Some(node) {
            *hint = Some(Arc::from(node));
        }
    }

    /// The TTL.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    fn lock(&self) -> Locked<'_> {
        // The critical sections never panic half-way through a change; a poisoned lock still holds a
        // consistent state.
        Locked {
            state: self.state.lock().unwrap_or_else(PoisonError::into_inner),
            reserved: &self.reserved,
        }
    }

    /// Keys reserved on `node` by pods other than `except_uid`, after dropping the node's expired
    /// reservations and those the report counts.
    ///
    /// With nothing reserved on any node this takes no lock: a reservation made by another review at
    /// the same moment is seen or not, exactly as if that review had taken the lock just after this one.
    /// (A candidate scan reserves nothing; the check that reserves, [`Ledger::check_and_reserve`],
    /// always locks.)
    pub fn held(
        &self,
        node: &str,
        mark: ReportMark<'_>,
        now: Instant,
        except_uid: &str,
    ) -> KeyRequests {
        if self.reserved.load(Ordering::Acquire) == 0 {
            return KeyRequests::new();
        }
        let mut st = self.lock();
        let ttl = self.ttl;
        st.settle(node, mark, now, ttl);
        st.held_except(node, except_uid)
    }

    /// Atomically: drop the node's expired reservations and those the report counts, compute the keys held by other
    /// pods, call `decide` with them (pure, quick: the lock is held), and when it returns `true` reserve
    /// `candidate` on `node`. A pod that already holds a reservation here keeps it (no double
    /// reservation); one held on another node moves here.
    pub fn check_and_reserve<T>(
        &self,
        node: &str,
        mark: ReportMark<'_>,
        now: Instant,
        candidate: Reservation,
        decide: impl FnOnce(&KeyRequests) -> (T, bool),
    ) -> (T, Reserved) {
        let mut st = self.lock();
        let ttl = self.ttl;
        st.settle(node, mark, now, ttl);
        let held = st.held_except(node, &candidate.pod_uid);
        let (out, reserve) = decide(&held);
        if !reserve {
            return (out, Reserved::No);
        }
        if candidate.counted_in(mark) || st.has_ended(&candidate.pod_uid, now, ttl) {
            return (out, Reserved::Counted);
        }
        let reserved = match st.pods.get(&candidate.pod_uid).cloned() {
            Some(existing) if existing == node => Reserved::AlreadyHeld,
            Some(other) => {
                let uid = candidate.pod_uid.clone();
                st.retain_node(&other, |r| r.pod_uid != uid);
                Reserved::Moved { from: other }
            }
            None => Reserved::Added,
        };
        if reserved != Reserved::AlreadyHeld {
            st.pods.insert(candidate.pod_uid.clone(), node.to_string());
            st.nodes
                .entry(node.to_string())
                .or_default()
                .push(candidate);
            st.len += 1;
        }
        (out, reserved)
    }

    /// This replica's live reservations on `node` as `(pod UID, keys)`, except `except_uid` (for the
    /// shared reservations, which add the ones their object does not list).
    pub fn held_entries(
        &self,
        node: &str,
        mark: ReportMark<'_>,
        now: Instant,
        except_uid: &str,
    ) -> Vec<(String, KeyRequests)> {
        if self.reserved.load(Ordering::Acquire) == 0 {
            return Vec::new();
        }
        let mut st = self.lock();
        let ttl = self.ttl;
        st.settle(node, mark, now, ttl);
        st.nodes
            .get(node)
            .into_iter()
            .flatten()
            .filter(|r| r.pod_uid != except_uid)
            .map(|r| (r.pod_uid.clone(), r.keys.clone()))
            .collect()
    }

    /// A report of `node` arrived listing `counted_pods`: their reservations there end now, for good,
    /// and so does every other reservation of those pods (another replica's entries in the node's
    /// shared `TeeReservation`: [`Ledger::has_ended`]). Once a report counted a pod, its keys are in
    /// the report's figures for as long as it holds them, and free after: a report that stops listing
    /// it (the pod stopped, its object not deleted yet) must not make its reservation hold again.
    pub fn report_arrived(&self, node: &str, counted_pods: &[String], now: Instant) {
        if counted_pods.is_empty() {
            return;
        }
        let mark = ReportMark { counted_pods };
        let mut st = self.lock();
        st.settle(node, mark, now, self.ttl);
        for uid in counted_pods {
            st.end(uid, now, self.ttl);
        }
    }

    /// Whether pod `pod_uid`'s reservations ended within the TTL: a report counted it, or it was
    /// deleted.
    pub fn has_ended(&self, pod_uid: &str, now: Instant) -> bool {
        self.lock().has_ended(pod_uid, now, self.ttl)
    }

    /// The pod `pod_uid` was deleted: its reservation ends now, and none is made for it again.
    pub fn pod_deleted(&self, pod_uid: &str, now: Instant) {
        let mut st = self.lock();
        if let Some(node) = st.pods.get(pod_uid).cloned() {
            st.retain_node(&node, |r| r.pod_uid != pod_uid);
        }
        st.end(pod_uid, now, self.ttl);
    }

    /// Drop the pod's reservation wherever it is (the shared reservation refused what this replica's
    /// ledger admitted).
    pub fn release(&self, pod_uid: &str) {
        let mut st = self.lock();
        if let Some(node) = st.pods.get(pod_uid).cloned() {
            st.retain_node(&node, |r| r.pod_uid != pod_uid);
        }
    }

    /// Drop every reservation past the TTL (the periodic sweep; reports are checked per node on use).
    /// Returns how many remain.
    pub fn prune_expired(&self, now: Instant) -> usize {
        let mut st = self.lock();
        let ttl = self.ttl;
        let nodes: Vec<String> = st.nodes.keys().cloned().collect();
        for node in nodes {
            st.retain_node(&node, |r| !r.expired(now, ttl));
        }
        st.ended
            .retain(|_, at| now.saturating_duration_since(*at) < ttl);
        st.len
    }

    /// Reservations held (as of the last change; no lock).
    pub fn len(&self) -> usize {
        self.reserved.load(Ordering::Acquire)
    }

    /// True when nothing is reserved.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The reservations on one node (for tests and diagnostics).
    pub fn reservations(&self, node: &str) -> Vec<Reservation> {
        self.lock().nodes.get(node).cloned().unwrap_or_default()
    }
}

#[cfg(test)]
mod tests;
