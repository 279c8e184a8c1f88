//! The ledger's guarantees, one test each.

use super::*;
use std::sync::Arc;
use teeguard_shared::TeeKind;

const TTL: Duration = Duration::from_secs(30);

fn res(uid: &str, keys: u64, mono: Instant) -> Reservation {
    Reservation {
        pod_uid: uid.into(),
        pod: format!("ns/{uid}"),
        keys: KeyRequests::from([(TeeKind::Tdx, keys)]),
        admitted: mono,
    }
}

fn uids(list: &[&str]) -> Vec<String> {
    list.iter().map(|u| u.to_string()).collect()
}

fn counting(pods: &[String]) -> ReportMark<'_> {
    ReportMark { counted_pods: pods }
}

/// Admit when `free − held ≥ 1` (the shape of the real decision).
fn admit_if_free(free: u64) -> impl FnOnce(&KeyRequests) -> (bool, bool) {
    move |held| {
        let ok = free.saturating_sub(held.get(&TeeKind::Tdx).copied().unwrap_or(0)) >= 1;
        (ok, ok)
    }
}

#[test]
fn release_drops_only_that_pods_reservation_and_held_entries_list_the_others() {
    let ledger = Ledger::new(TTL);
    let t0 = Instant::now();
    for uid in ["a", "b", "c"] {
        ledger.check_and_reserve(
            "n1",
            ReportMark::default(),
            t0,
            res(uid, 1, t0),
            admit_if_free(8),
        );
    }
    assert_eq!(ledger.len(), 3);
    ledger.release("b");
    assert_eq!(ledger.len(), 2);
    ledger.release("nope");
    assert_eq!(ledger.len(), 2);
    let others: Vec<String> = ledger
        .held_entries("n1", ReportMark::default(), t0, "a")
        .into_iter()
        .map(|(uid, _)| uid)
        .collect();
    assert_eq!(others, ["c"]);
}

#[test]
fn a_report_counts_a_reservation_only_when_it_lists_its_pod() {
    let r = res("a", 1, Instant::now());
    assert!(!r.counted_in(ReportMark::default()), "no report");
    assert!(!r.counted_in(counting(&uids(&[]))));
    assert!(!r.counted_in(counting(&uids(&["b", "c"]))));
    assert!(
        !r.counted_in(counting(&uids(&["ab", "A"]))),
        "whole UIDs only"
    );
    assert!(r.counted_in(counting(&uids(&["b", "a"]))));
}

#[test]
fn released_by_the_first_report_that_counts_the_pod() {
    let ledger = Ledger::new(TTL);
    let t0 = Instant::now();
    let before = uids(&["older"]);
    let (ok, _) = ledger.check_and_reserve(
        "n1",
        counting(&before),
        t0,
        res("a", 1, t0),
        admit_if_free(2),
    );
    assert!(ok);
    // A report that does not list the pod (any number of them: heartbeats, other pods' changes)
    // keeps the reservation.
    let others = uids(&["older", "b"]);
    assert_eq!(
        ledger.held("n1", counting(&others), t0, ""),
        KeyRequests::from([(TeeKind::Tdx, 1)])
    );
    // The report that counts it, published at once (no settle time), releases it: its `free`
    // includes the pod now.
    let with_a = uids(&["a", "older"]);
    assert!(ledger.held("n1", counting(&with_a), t0, "").is_empty());
    assert!(ledger.is_empty());
    // A later report that no longer lists it (the pod aged out of the list) holds nothing back.
    assert!(ledger.held("n1", counting(&others), t0, "").is_empty());
}

#[test]
fn released_by_the_ttl_when_the_pod_never_appears() {
    let ledger = Ledger::new(TTL);
    let t0 = Instant::now();
    let none: Vec<String> = Vec::new();
    ledger.check_and_reserve("n1", counting(&none), t0, res("a", 1, t0), admit_if_free(1));
    let later = t0 + TTL - Duration::from_millis(1);
    assert_eq!(ledger.held("n1", counting(&none), later, "").len(), 1);
    assert_eq!(ledger.prune_expired(later), 1);
    assert!(ledger.held("n1", counting(&none), t0 + TTL, "").is_empty());
    assert!(ledger.is_empty());
}

#[test]
fn a_report_counting_the_pod_at_check_time_holds_nothing_back() {
    // The pod is already in the report (a retried binding after the agent saw the first one):
    // its keys are in `free`, so nothing is reserved for it.
    let ledger = Ledger::new(TTL);
    let t0 = Instant::now();
    let with_a = uids(&["a"]);
    let (ok, r) = ledger.check_and_reserve(
        "n1",
        counting(&with_a),
        t0,
        res("a", 1, t0),
        admit_if_free(1),
    );
    assert!(ok);
    assert_eq!(r, Reserved::Counted);
    assert!(ledger.is_empty());
    let (ok, _) = ledger.check_and_reserve(
        "n1",
        counting(&with_a),
        t0,
        res("b", 1, t0),
        admit_if_free(1),
    );
    assert!(ok, "a's key is counted once, in the report's free");
}

#[test]
fn reserve_blocks_the_last_key_and_expires() {
    let ledger = Ledger::new(TTL);
    let t0 = Instant::now();
    let m = ReportMark::default();
    let (ok, r) = ledger.check_and_reserve("n1", m, t0, res("a", 1, t0), admit_if_free(1));
    assert!(ok);
    assert_eq!(r, Reserved::Added);
    assert_eq!(ledger.len(), 1);
    // A second pod sees the key held.
    let (ok, r) = ledger.check_and_reserve("n1", m, t0, res("b", 1, t0), admit_if_free(1));
    assert!(!ok);
    assert_eq!(r, Reserved::No);
    assert_eq!(ledger.len(), 1);
    // Another node is unaffected.
    assert!(ledger.held("n2", m, t0, "").is_empty());
    assert_eq!(
        ledger.held("n1", m, t0, ""),
        KeyRequests::from([(TeeKind::Tdx, 1)])
    );
    assert!(
        ledger.held("n1", m, t0, "a").is_empty(),
        "own reservation excluded"
    );
    // Just before the TTL still held; at the TTL gone.
    let later = t0 + TTL - Duration::from_millis(1);
    assert_eq!(ledger.held("n1", m, later, "").len(), 1);
    assert_eq!(ledger.prune_expired(later), 1);
    assert_eq!(ledger.prune_expired(t0 + TTL), 0);
    assert!(ledger.is_empty());
    let (ok, _) =
        ledger.check_and_reserve("n1", m, t0 + TTL, res("b", 1, t0 + TTL), admit_if_free(1));
    assert!(ok);
}

#[test]
fn idempotent_per_pod_and_moves_between_nodes() {
    let ledger = Ledger::new(TTL);
    let t0 = Instant::now();
    let m = ReportMark::default();
    let first = res("a", 1, t0);
    let (_, r) = ledger.check_and_reserve("n1", m, t0, first.clone(), admit_if_free(1));
    assert_eq!(r, Reserved::Added);
    // The scheduler retries the same pod: its own key does not count against it, nothing doubles.
    let retry = res("a", 1, t0 + Duration::from_secs(5));
    let (ok, r) = ledger.check_and_reserve("n1", m, t0, retry, admit_if_free(1));
    assert!(ok);
    assert_eq!(r, Reserved::AlreadyHeld);
    assert_eq!(
        ledger.reservations("n1"),
        vec![first],
        "the original is kept"
    );
    // The same pod bound to another node: moved.
    let (ok, r) = ledger.check_and_reserve("n2", m, t0, res("a", 1, t0), admit_if_free(1));
    assert!(ok);
    assert_eq!(r, Reserved::Moved { from: "n1".into() });
    assert!(ledger.reservations("n1").is_empty());
    assert_eq!(ledger.reservations("n2").len(), 1);
    assert_eq!(ledger.len(), 1);
}

#[test]
fn keys_sum_per_kind() {
    let ledger = Ledger::new(TTL);
    let t0 = Instant::now();
    let m = ReportMark::default();
    for (uid, kind, n) in [
        ("a", TeeKind::Tdx, 2),
        ("b", TeeKind::Tdx, 1),
        ("c", TeeKind::SevEs, 1),
    ] {
        let mut r = res(uid, 0, t0);
        r.keys = KeyRequests::from([(kind, n)]);
        ledger.check_and_reserve("n", m, t0, r, |_| ((), true));
    }
    assert_eq!(
        ledger.held("n", m, t0, "b"),
        KeyRequests::from([(TeeKind::Tdx, 2), (TeeKind::SevEs, 1)])
    );
}

#[test]
fn concurrent_reservations_take_the_last_key_once() {
    let ledger = Arc::new(Ledger::new(TTL));
    let t0 = Instant::now();
    let handles: Vec<_> = (0..16)
        .map(|i| {
            let ledger = ledger.clone();
            std::thread::spawn(move || {
                let r = res(&format!("p{i}"), 1, t0);
                ledger
                    .check_and_reserve("n1", ReportMark::default(), t0, r, admit_if_free(1))
                    .0
            })
        })
        .collect();
    let admitted = handles
        .into_iter()
        .map(|h| h.join().expect("thread"))
        .filter(|ok| *ok)
        .count();
    assert_eq!(admitted, 1);
    assert_eq!(ledger.len(), 1);
}

/// Issue #28: the report that counts the pod arrives and no check on the node runs while it is the
/// cached one; the pod is then deleted and the next report no longer lists it. The reservation must
/// not count again as "just admitted".
#[test]
fn a_reservation_ended_by_a_report_no_check_saw_is_not_held_again_after_the_pod_is_deleted() {
    let ledger = Ledger::new(TTL);
    let t0 = Instant::now();
    let none: Vec<String> = Vec::new();
    let (ok, _) =
        ledger.check_and_reserve("n1", counting(&none), t0, res("a", 1, t0), admit_if_free(2));
    assert!(ok);
    // The report counting `a` arrives; no check runs.
    ledger.report_arrived("n1", &uids(&["a"]), t0);
    assert!(ledger.is_empty(), "ended at the report's arrival");
    // `a` is deleted; the next report lists nobody. Two new pods fit the two free keys.
    let later = t0 + Duration::from_secs(1);
    for uid in ["b", "c"] {
        let (ok, r) = ledger.check_and_reserve(
            "n1",
            counting(&none),
            later,
            res(uid, 1, later),
            admit_if_free(2),
        );
        assert!(ok, "{uid} refused: a's reservation came back");
        assert_eq!(r, Reserved::Added);
    }
}

#[test]
fn a_report_of_another_node_or_not_listing_the_pod_ends_nothing() {
    let ledger = Ledger::new(TTL);
    let t0 = Instant::now();
    ledger.check_and_reserve(
        "n1",
        ReportMark::default(),
        t0,
        res("a", 1, t0),
        admit_if_free(1),
    );
    ledger.report_arrived("n2", &uids(&["a"]), t0);
    ledger.report_arrived("n1", &uids(&["b"]), t0);
    ledger.report_arrived("n1", &[], t0);
    assert_eq!(ledger.len(), 1);
}

#[test]
fn a_deleted_pods_reservation_ends_at_once_and_a_late_binding_of_it_reserves_nothing() {
    let ledger = Ledger::new(TTL);
    let t0 = Instant::now();
    let m = ReportMark::default();
    ledger.check_and_reserve("n1", m, t0, res("a", 1, t0), admit_if_free(1));
    ledger.pod_deleted("a", t0);
    assert!(ledger.held("n1", m, t0, "").is_empty());
    assert!(ledger.is_empty());
    // A binding of the deleted pod still in flight is decided, but holds no key.
    let (ok, r) = ledger.check_and_reserve("n1", m, t0, res("a", 1, t0), admit_if_free(1));
    assert!(ok);
    assert_eq!(r, Reserved::Counted);
    let (ok, r) = ledger.check_and_reserve("n1", m, t0, res("b", 1, t0), admit_if_free(1));
    assert!(ok, "the key is free for another pod");
    assert_eq!(r, Reserved::Added);
}

#[test]
fn a_retried_binding_after_a_report_counted_the_pod_reserves_nothing() {
    let ledger = Ledger::new(TTL);
    let t0 = Instant::now();
    let none: Vec<String> = Vec::new();
    ledger.check_and_reserve("n1", counting(&none), t0, res("a", 1, t0), admit_if_free(1));
    ledger.report_arrived("n1", &uids(&["a"]), t0);
    // The cached report no longer lists `a` (it aged out of countedPods) when the retry comes.
    let (_, r) =
        ledger.check_and_reserve("n1", counting(&none), t0, res("a", 1, t0), admit_if_free(1));
    assert_eq!(r, Reserved::Counted);
    assert!(ledger.is_empty());
}

#[test]
fn ended_pods_are_forgotten_after_the_ttl() {
    let ledger = Ledger::new(TTL);
    let t0 = Instant::now();
    let m = ReportMark::default();
    ledger.pod_deleted("a", t0);
    ledger.prune_expired(t0 + TTL);
    let (_, r) =
        ledger.check_and_reserve("n1", m, t0 + TTL, res("a", 1, t0 + TTL), admit_if_free(1));
    assert_eq!(r, Reserved::Added);
}

/// The shared reservations ask the ledger whether an entry still holds: a pod another replica
/// reserved, once a report counted it, holds nothing there either, after the report stops listing it
/// (its containers stopped before its object was deleted) as before. (A KubeVirt test's freed keys
/// were refused to the VMI retried for them: "another replica's reservations took the keys", with one
/// replica, for the rest of the TTL.)
#[test]
fn every_pod_a_report_counted_has_ended_whichever_replica_reserved_it() {
    let ledger = Ledger::new(TTL);
    let t0 = Instant::now();
    assert!(!ledger.has_ended("elsewhere", t0));
    ledger.report_arrived("n1", &uids(&["elsewhere"]), t0);
    assert!(ledger.has_ended("elsewhere", t0 + Duration::from_secs(1)));
    assert!(!ledger.has_ended("other", t0));
    assert!(
        !ledger.has_ended("elsewhere", t0 + TTL),
        "remembered for the TTL"
    );
}
