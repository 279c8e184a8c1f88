//! The life of a key (pure): one table of holds, one end rule, one definition of the keys a node has
//! available to a pod. See docs/life-of-a-key.md for the whole story.
//!
//! A **hold** is a key held on a node for a pod or a VMI that the node's `TeeCapacity` report does
//! not count yet. The table is the nodes' `TeeReservation` objects (one per node, shared by every
//! replica and written with a `resourceVersion` precondition, so a key is held for one claimant only),
//! plus the holds the deciding replica admitted and has not written yet ([`crate::decide::index::Index`]'s
//! local holds, counted by that replica alone until its write-behind writes them). A hold is one [`KeyReservation`]:
//!
//! | reason | for | made when |
//! |---|---|---|
//! | `Admitted` | a virt-launcher pod (and its VMI) | its CREATE is admitted on a node that fits |
//! | `Promised` | a waiting VMI, no pod yet | a key it may use is free and its turn came: teeguard retries it |
//! | `Bound` | a pod | the scheduler's binding is admitted with no hold of the pod on that node, or a pod is created with `spec.nodeName` |
//!
//! One end rule ([`crate::decide::index::Index::end`]), whichever replica asks:
//! - [`End::Counted`]: the node's report lists the pod in `countedPods` (or a report ever did, as far
//!   as this replica saw): its key is in the report's figures now;
//! - [`End::PodGone`]: the pod was deleted, ended, or (a virt-launcher pod) is not in the synced pod
//!   cache [`POD_GRACE`] after the hold was written or first seen here (deleted before this replica
//!   started, or a CREATE another webhook refused after teeguard admitted it);
//! - [`End::VmiDone`]: a promise's VMI was deleted or has a pod now (its own hold holds the key);
//! - [`End::Moved`]: the pod is bound to another node, or (an `Admitted` hold) a `Bound` hold of the
//!   pod exists on another node;
//! - [`End::Expired`]: `admission.ledgerTtl` passed since the hold was written (by the writer's
//!   clock, once this replica has seen it for [`POD_GRACE`]) or since this replica first saw it (the
//!   backstop: a pod that never reaches its node, an agent that does not report).
//!
//! Counted holds stay in the object until another rule ends them (each replica sees the report at
//! its own moment; one whose report does not count the pod yet must still count the hold); the others
//! are trimmed at the node's next write.

use teeguard_shared::pod::KeyRequests;
use teeguard_shared::reservation::{HoldReason, KeyReservation};

use std::time::Duration;

/// How long a virt-launcher pod held for may be missing from the pod cache before its hold ends (the
/// watch delivers a new pod within milliseconds; this covers a slow one).
pub const POD_GRACE: Duration = Duration::from_secs(5);

/// Who asks for keys: a pod and, for a virt-launcher pod, its VMI. A claimant's own holds are not
/// taken from it: the hold of its pod, and a key promised to its VMI.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Claimant<'a> {
    /// The pod's UID (empty: no pod, as for the retry planner).
    pub pod_uid: &'a str,
    /// The VMI's UID (empty: not a virt-launcher pod).
    pub vmi_uid: &'a str,
}

impl<'a> Claimant<'a> {
    /// Nobody: every hold counts.
    pub const NONE: Claimant<'static> = Claimant {
        pod_uid: "",
        vmi_uid: "",
    };

    /// VMI `vmi_uid` before it has a pod: the owner of a key promised to it.
    pub fn promise(vmi_uid: &'a str) -> Claimant<'a> {
        Claimant {
            pod_uid: "",
            vmi_uid,
        }
    }

    /// Whether `hold` is this claimant's own: its pod's, or a key promised to its VMI.
    pub fn owns(&self, hold: &KeyReservation) -> bool {
        if hold.pod_uid.is_empty() {
            !self.vmi_uid.is_empty() && hold.vmi_uid == self.vmi_uid
        } else {
            !self.pod_uid.is_empty() && hold.pod_uid == self.pod_uid
        }
    }
}

/// Why a hold ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum End {
    /// The node's report counts the pod.
    Counted,
    /// The pod was deleted or ended, or never appeared.
    PodGone,
    /// The promise's VMI was deleted or has a pod now.
    VmiDone,
    /// The pod is bound to another node (or holds there as bound).
    Moved,
    /// The TTL passed.
    Expired,
}

impl End {
    /// Whether the entry can leave the object: a counted hold stays until another rule ends it (a
    /// replica whose report does not count the pod yet still counts the hold).
    pub fn trimmed(self) -> bool {
        self != End::Counted
    }
}

/// What a claimant wants held, and for whom, to put in a node's object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewHold<'a> {
    /// The claimant (its pod UID and VMI UID go into the entry).
    pub claimant: Claimant<'a>,
    /// The pod's `namespace/name` (empty for a promise).
    pub pod: &'a str,
    /// The VMI's `namespace/name` (empty for other pods).
    pub vmi: &'a str,
    /// Keys per kind.
    pub keys: &'a KeyRequests,
    /// Why.
    pub reason: HoldReason,
}

impl NewHold<'_> {
    /// The entry, written `now` by `replica` (its `admittedAt` the next whole second, [`second_up`]).
    pub fn entry(&self, now: jiff::Timestamp, replica: &str) -> KeyReservation {
        let mut e = KeyReservation {
            pod_uid: self.claimant.pod_uid.to_string(),
            pod: self.pod.to_string(),
            vmi_uid: self.claimant.vmi_uid.to_string(),
            vmi: self.vmi.to_string(),
            reason: Some(self.reason),
            tdx: None,
            sev: None,
            sev_es: None,
            admitted_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(second_up(now)),
            replica: replica.to_string(),
        };
        e.set_keys(self.keys);
        e
    }
}

/// `t` in whole seconds, rounded up: the API server keeps `admittedAt` (a `metav1.Time`) to the
/// second, and a hold's TTL counts from it, so it must never seem older than it is (a hold ending
/// early gives its key to a second pod while the first still waits for its binding).
pub fn second_up(t: jiff::Timestamp) -> jiff::Timestamp {
    let second = t.as_second() + i64::from(t.subsec_nanosecond() > 0);
    jiff::Timestamp::from_second(second).unwrap_or(t)
}

/// Keys held on a node for claimants other than the one asking, by what they are for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HeldKeys {
    /// For pods admitted or bound (`Admitted`, `Bound`).
    pub pods: KeyRequests,
    /// Promised to waiting VMIs (`Promised`).
    pub promised: KeyRequests,
}

impl HeldKeys {
    /// Add `hold`'s keys.
    pub fn add(&mut self, hold: &KeyReservation) {
        let into = match hold.reason() {
            HoldReason::Promised => &mut self.promised,
            HoldReason::Admitted | HoldReason::Bound => &mut self.pods,
        };
        for (kind, n) in hold.keys() {
            let slot = into.entry(kind).or_insert(0);
            *slot = slot.saturating_add(n);
        }
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.pods.is_empty() && self.promised.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use teeguard_shared::TeeKind;

    use super::*;

    fn hold(pod_uid: &str, vmi_uid: &str) -> KeyReservation {
        NewHold {
            claimant: Claimant { pod_uid, vmi_uid },
            pod: "",
            vmi: "",
            keys: &KeyRequests::from([(TeeKind::Tdx, 1)]),
            reason: if pod_uid.is_empty() {
                HoldReason::Promised
            } else {
                HoldReason::Admitted
            },
        }
        .entry(jiff::Timestamp::UNIX_EPOCH, "r")
    }

    #[test]
    fn a_claimant_owns_its_pods_hold_and_its_vmis_promise_only() {
        let c = Claimant {
            pod_uid: "p1",
            vmi_uid: "v1",
        };
        assert!(c.owns(&hold("p1", "v1")));
        assert!(c.owns(&hold("", "v1")), "a key promised to its VMI");
        assert!(
            !c.owns(&hold("p0", "v1")),
            "another pod of its VMI (a migration source, a predecessor) is not its own"
        );
        assert!(!c.owns(&hold("", "v2")));
        assert!(!Claimant::NONE.owns(&hold("", "")));
        assert!(!Claimant::NONE.owns(&hold("p1", "v1")));
    }

    #[test]
    fn held_keys_are_split_between_pods_and_promises() {
        let mut h = HeldKeys::default();
        h.add(&hold("p1", "v1"));
        h.add(&hold("", "v2"));
        h.add(&hold("", "v3"));
        assert_eq!(h.pods, KeyRequests::from([(TeeKind::Tdx, 1)]));
        assert_eq!(h.promised, KeyRequests::from([(TeeKind::Tdx, 2)]));
    }

    #[test]
    fn a_holds_admission_time_is_kept_whole_by_the_api_server_and_never_seems_older() {
        let at = |ms: i64| jiff::Timestamp::from_millisecond(1_800_000_000_000 + ms).expect("time");
        let e = NewHold {
            claimant: Claimant {
                pod_uid: "p1",
                vmi_uid: "v1",
            },
            pod: "vms/virt-launcher-a",
            vmi: "vms/a",
            keys: &KeyRequests::from([(TeeKind::Tdx, 1)]),
            reason: HoldReason::Admitted,
        }
        .entry(at(10_300), "r");
        assert_eq!(e.admitted_at.0, at(11_000), "rounded up, not down");
        let json = serde_json::to_value(&e).expect("json");
        let back: KeyReservation = serde_json::from_value(json).expect("back");
        assert_eq!(back, e, "the API server keeps it as written");
        assert_eq!(second_up(at(11_000)), at(11_000));
    }

    #[test]
    fn only_a_counted_hold_stays_in_the_object() {
        assert!(!End::Counted.trimmed());
        for e in [End::PodGone, End::VmiDone, End::Moved, End::Expired] {
            assert!(e.trimmed());
        }
    }
}
