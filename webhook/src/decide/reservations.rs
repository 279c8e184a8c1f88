//! Shared reservations (pure): which entries of a node's `TeeReservation` still hold keys, what they
//! hold together with this replica's ledger, and what the object should say after admitting a pod.
//! The I/O (watch cache, write with a `resourceVersion` precondition, retry on conflict) is
//! `crate::cluster::reservations`.

use std::collections::BTreeSet;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use teeguard_shared::config::{Mode, StalePolicy};
use teeguard_shared::pod::KeyRequests;
use teeguard_shared::reservation::KeyReservation;

use super::ledger::ReportMark;
use super::validation::{Decision, Verdict, apply_mode, reason};

/// The entry recording `uid`'s keys, admitted `now` by `replica`.
pub fn entry(
    uid: &str,
    pod: &str,
    keys: &KeyRequests,
    now: Timestamp,
    replica: &str,
) -> KeyReservation {
    let mut e = KeyReservation {
        pod_uid: uid.to_string(),
        pod: pod.to_string(),
        tdx: None,
        sev: None,
        sev_es: None,
        admitted_at: Time(now),
        replica: replica.to_string(),
    };
    e.set_keys(keys);
    e
}

/// The API server cannot be reached for the shared reservations (`why`): the stale-report policy
/// decides — `allow` keeps this replica's ledger `decision` with a warning saying so, `deny` refuses
/// (the caller releases the ledger's reservation).
pub fn fallback(
    decision: Decision,
    why: &str,
    node: &str,
    policy: StalePolicy,
    mode: Mode,
) -> Decision {
    let note = format!(
        "teeguard could not record the reservation shared by its replicas for node {node} ({why})"
    );
    match policy {
        StalePolicy::Allow => {
            let mut d = decision;
            d.warnings.push(format!(
                "{note}; decided with this replica's ledger only: a concurrent admission by another replica may take the same key"
            ));
            d
        }
        StalePolicy::Deny => apply_mode(
            Verdict::Refuse {
                reason: reason::REPORT_UNKNOWN,
                message: format!(
                    "{note}; the stale-report policy denies; retry when the API server answers"
                ),
            },
            mode,
        ),
    }
}

/// What decides whether an entry still holds keys.
#[derive(Clone, Copy, Debug)]
pub struct Liveness<'a> {
    /// The node's report (its `countedPods`).
    pub mark: ReportMark<'a>,
    /// Now (wall clock: entries come from every replica).
    pub now: Timestamp,
    /// `admission.ledgerTtl`.
    pub ttl: Duration,
}

impl Liveness<'_> {
    /// Whether `entry` still holds its keys: not listed by the report, not past the TTL, and its pod
    /// not known to be gone.
    pub fn holds(
        &self,
        entry: &KeyReservation,
        pod_gone: &dyn Fn(&KeyReservation) -> bool,
    ) -> bool {
        let age = self.now.duration_since(entry.admitted_at.0);
        let within_ttl =
            age.is_negative() || Duration::try_from(age).is_ok_and(|age| age < self.ttl);
        within_ttl && !self.mark.counted_pods.contains(&entry.pod_uid) && !pod_gone(entry)
    }
}

/// The entries that still hold keys (the rest is trimmed at the next write).
pub fn live(
    entries: &[KeyReservation],
    liveness: Liveness<'_>,
    pod_gone: &dyn Fn(&KeyReservation) -> bool,
) -> Vec<KeyReservation> {
    entries
        .iter()
        .filter(|e| liveness.holds(e, pod_gone))
        .cloned()
        .collect()
}

/// Keys held on the node by pods other than `except_uid`: the shared entries, plus this replica's
/// ledger entries the shared object does not list (a reservation whose shared write failed). A pod
/// in both counts once.
pub fn held(
    shared: &[KeyReservation],
    local: &[(String, KeyRequests)],
    except_uid: &str,
) -> KeyRequests {
    let mut out = KeyRequests::new();
    let mut seen = BTreeSet::new();
    let mut add = |uid: &str, keys: &KeyRequests| {
        if uid == except_uid || !seen.insert(uid.to_string()) {
            return;
        }
        for (kind, n) in keys {
            let slot = out.entry(*kind).or_insert(0);
            *slot = slot.saturating_add(*n);
        }
    };
    for e in shared {
        add(&e.pod_uid, &e.keys());
    }
    for (uid, keys) in local {
        add(uid, keys);
    }
    out
}

/// What to do with a node's reservation object for one admission.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// The pod already holds a live entry (a retried binding): nothing to write.
    AlreadyHeld,
    /// The decision refused the pod: nothing to write.
    Refused,
    /// Write these entries (the live ones plus the pod's).
    Write(Vec<KeyReservation>),
}

/// The step for `candidate` given the live entries and whether the decision (made with [`held`])
/// admits it.
pub fn step(live: Vec<KeyReservation>, candidate: KeyReservation, admits: bool) -> Step {
    if live.iter().any(|e| e.pod_uid == candidate.pod_uid) {
        return Step::AlreadyHeld;
    }
    if !admits {
        return Step::Refused;
    }
    let mut entries = live;
    entries.push(candidate);
    Step::Write(entries)
}

#[cfg(test)]
mod tests {
    use teeguard_shared::TeeKind;

    use super::*;

    fn entry(uid: &str, tdx: u64, at: Timestamp) -> KeyReservation {
        KeyReservation {
            pod_uid: uid.into(),
            pod: format!("vms/{uid}"),
            tdx: Some(tdx),
            sev: None,
            sev_es: None,
            admitted_at: Time(at),
            replica: "webhook-a".into(),
        }
    }

    fn t(secs: i64) -> Timestamp {
        Timestamp::from_second(1_800_000_000 + secs).expect("time")
    }

    const TTL: Duration = Duration::from_secs(30);

    #[test]
    fn entries_end_when_counted_expired_or_gone() {
        let counted = vec!["counted".to_string()];
        let l = Liveness {
            mark: ReportMark {
                counted_pods: &counted,
            },
            now: t(100),
            ttl: TTL,
        };
        let entries = vec![
            entry("fresh", 1, t(90)),
            entry("counted", 1, t(95)),
            entry("old", 1, t(70)),
            entry("deleted", 1, t(99)),
            entry("future", 1, t(105)),
        ];
        let gone = |e: &KeyReservation| e.pod_uid == "deleted";
        let kept: Vec<String> = live(&entries, l, &gone)
            .into_iter()
            .map(|e| e.pod_uid)
            .collect();
        // A clock ahead on another replica does not end an entry early.
        assert_eq!(kept, ["fresh", "future"]);
        // Exactly at the TTL it has ended.
        assert!(!l.holds(&entry("edge", 1, t(70)), &|_| false));
        assert!(l.holds(&entry("edge", 1, t(71)), &|_| false));
    }

    #[test]
    fn held_counts_each_pod_once_across_shared_and_local() {
        let shared = vec![entry("a", 1, t(0)), entry("b", 2, t(0))];
        let local = vec![
            ("b".to_string(), KeyRequests::from([(TeeKind::Tdx, 2)])),
            ("c".to_string(), KeyRequests::from([(TeeKind::Tdx, 1)])),
        ];
        assert_eq!(held(&shared, &local, "x")[&TeeKind::Tdx], 4);
        assert_eq!(held(&shared, &local, "b")[&TeeKind::Tdx], 2);
        assert!(held(&[], &[], "x").is_empty());
    }

    #[test]
    fn a_pod_is_written_once_and_only_when_admitted() {
        let live_entries = vec![entry("a", 1, t(0))];
        assert_eq!(
            step(live_entries.clone(), entry("a", 1, t(5)), true),
            Step::AlreadyHeld
        );
        assert_eq!(
            step(live_entries.clone(), entry("b", 1, t(5)), false),
            Step::Refused
        );
        match step(live_entries, entry("b", 1, t(5)), true) {
            Step::Write(e) => assert_eq!(
                e.iter().map(|e| e.pod_uid.as_str()).collect::<Vec<_>>(),
                ["a", "b"]
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_unreachable_api_server_follows_the_stale_policy_and_says_so() {
        let admitted = apply_mode(
            Verdict::Admit {
                reason: reason::ENOUGH_KEYS,
                warnings: Vec::new(),
            },
            Mode::Enforce,
        );
        let d = fallback(
            admitted.clone(),
            "connection refused",
            "node-a",
            StalePolicy::Allow,
            Mode::Enforce,
        );
        assert!(d.allowed && d.reserve);
        assert!(
            d.warnings[0].contains("node node-a (connection refused)"),
            "{:?}",
            d.warnings
        );
        let d = fallback(
            admitted.clone(),
            "timed out",
            "node-a",
            StalePolicy::Deny,
            Mode::Enforce,
        );
        assert!(!d.allowed && !d.reserve);
        assert!(
            d.message
                .as_deref()
                .is_some_and(|m| m.contains("stale-report policy denies"))
        );
        let d = fallback(
            admitted,
            "timed out",
            "node-a",
            StalePolicy::Deny,
            Mode::Warn,
        );
        assert!(
            d.allowed && !d.reserve,
            "warn mode turns the refusal into a warning"
        );
    }

    #[test]
    fn an_entry_carries_the_pods_keys_and_the_replica() {
        let e = super::entry(
            "u1",
            "vms/p",
            &KeyRequests::from([(TeeKind::SevEs, 1)]),
            t(0),
            "webhook-b",
        );
        assert_eq!(
            (e.sev_es, e.tdx, e.replica.as_str()),
            (Some(1), None, "webhook-b")
        );
    }
}
