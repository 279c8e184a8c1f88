//! The one end rule of a hold, the keys held for others, and what the index remembers.

use std::sync::Arc;

use teeguard_shared::reservation::HoldReason::{Admitted, Bound, Promised};

use super::*;
use crate::decide::holds::End;
use crate::decide::testkit::{TTL, World, at, hold, report, t0};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

fn end_of(ix: &Index, node: &str, pod_uid: &str, vmi_uid: &str, now: Timestamp) -> Option<End> {
    let e = ix
        .entries(node)
        .find(|e| e.pod_uid == pod_uid && e.vmi_uid == vmi_uid)
        .cloned()
        .expect("the hold is in the index");
    ix.end(node, &e, now)
}

/// A new decider lists the reports; its watch may deliver an older one afterwards, which must not
/// bring back free keys the listed one no longer shows.
#[test]
fn a_report_older_than_the_one_held_is_ignored() {
    let mut ix = Index::new(TTL);
    ix.apply_report("n1", Some(report(2, 0, &["p1", "p2"])), Some(9), t0());
    ix.apply_report("n1", Some(report(2, 2, &[])), Some(7), at(1));
    let free = |ix: &Index| {
        ix.report("n1")
            .status
            .and_then(|s| s.tdx.as_ref())
            .map(|k| k.free)
    };
    assert_eq!(free(&ix), Some(0), "the older report is ignored");
    ix.apply_report("n1", Some(report(2, 1, &["p1"])), Some(10), at(2));
    assert_eq!(free(&ix), Some(1), "a newer one is applied");
}

#[test]
fn a_hold_ends_when_a_report_counts_its_pod_and_stays_ended_when_the_report_forgets_it() {
    let mut ix = World::default()
        .node("n1", 2, 2)
        .holds("n1", vec![hold("p1", "v1", Bound)])
        .pod("p1", Some("n1"))
        .ix;
    assert_eq!(end_of(&ix, "n1", "p1", "v1", t0()), None);
    ix.apply_report("n1", Some(report(2, 1, &["p1"])), None, at(1));
    assert_eq!(end_of(&ix, "n1", "p1", "v1", at(1)), Some(End::Counted));
    // The pod stopped: the next report lists it no more. Its key is in the figures (free) now.
    ix.apply_report("n1", Some(report(2, 2, &[])), None, at(2));
    assert_eq!(end_of(&ix, "n1", "p1", "v1", at(2)), Some(End::Counted));
    assert!(
        !End::Counted.trimmed(),
        "kept for replicas that have not seen the report yet"
    );
}

#[test]
fn a_hold_ends_when_its_pod_is_deleted_ended_or_never_appears() {
    let w = World::default().node("n1", 4, 4).holds(
        "n1",
        vec![
            hold("deleted", "v1", Admitted),
            hold("ended", "v2", Bound),
            hold("unseen", "v3", Admitted),
            hold("kata", "", Bound),
        ],
    );
    let mut ix = w.pod("deleted", None).pod("ended", Some("n1")).ix;
    ix.apply_pod("deleted", None, at(1));
    ix.apply_pod(
        "ended",
        Some(PodState {
            node: Some("n1".into()),
            ended: true,
            keys: true,
            vmi: None,
        }),
        at(1),
    );
    assert_eq!(
        end_of(&ix, "n1", "deleted", "v1", at(1)),
        Some(End::PodGone)
    );
    assert_eq!(end_of(&ix, "n1", "ended", "v2", at(1)), Some(End::PodGone));
    // Not in the pod cache: only once the caches listed, and the watch had POD_GRACE to deliver it.
    assert_eq!(
        end_of(&ix, "n1", "unseen", "v3", at(10)),
        None,
        "not synced yet"
    );
    ix.set_synced();
    assert_eq!(
        end_of(&ix, "n1", "unseen", "v3", at(4)),
        None,
        "within the grace"
    );
    assert_eq!(end_of(&ix, "n1", "unseen", "v3", at(5)), Some(End::PodGone));
    // A pod the cache does not watch (no VMI: a Kata pod) ends by its count or the TTL only.
    assert_eq!(end_of(&ix, "n1", "kata", "", at(29)), None);
    assert_eq!(end_of(&ix, "n1", "kata", "", at(30)), Some(End::Expired));
}

#[test]
fn a_hold_moves_with_its_pods_binding() {
    let ix = World::default()
        .node("a", 1, 1)
        .node("b", 1, 1)
        .holds(
            "a",
            vec![hold("p1", "v1", Admitted), hold("p2", "v2", Admitted)],
        )
        .holds("b", vec![hold("p1", "v1", Bound)])
        .pod("p2", Some("b"))
        .ix;
    assert_eq!(
        end_of(&ix, "a", "p1", "v1", t0()),
        Some(End::Moved),
        "its binding to b holds it there"
    );
    assert_eq!(end_of(&ix, "b", "p1", "v1", t0()), None);
    assert_eq!(
        end_of(&ix, "a", "p2", "v2", t0()),
        Some(End::Moved),
        "the pod cache shows it bound to b"
    );
}

#[test]
fn a_promise_ends_when_its_vmi_has_a_pod_or_is_gone() {
    let mut ix = World::default()
        .node("n1", 3, 3)
        .holds(
            "n1",
            vec![
                hold("", "uid-a", Promised),
                hold("", "uid-b", Promised),
                hold("", "uid-c", Promised),
            ],
        )
        .vmi("a", Some(0), &[])
        .vmi("b", Some(0), &[])
        .ix;
    assert_eq!(end_of(&ix, "n1", "", "uid-a", t0()), None);
    ix.apply_vmi(
        "uid-a",
        Some(VmiState {
            pending: false,
            waiting: None,
        }),
        at(1),
    );
    ix.apply_vmi("uid-b", None, at(1));
    assert_eq!(end_of(&ix, "n1", "", "uid-a", at(1)), Some(End::VmiDone));
    assert_eq!(end_of(&ix, "n1", "", "uid-b", at(1)), Some(End::VmiDone));
    ix.set_synced();
    assert_eq!(end_of(&ix, "n1", "", "uid-c", at(4)), None);
    assert_eq!(
        end_of(&ix, "n1", "", "uid-c", at(5)),
        Some(End::VmiDone),
        "a VMI the cache never had"
    );
}

#[test]
fn the_ttl_counts_from_the_write_but_a_hold_lasts_the_grace_after_this_replica_saw_it() {
    let written_at = |secs| k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at(secs));
    let mut ahead = hold("ahead", "", Bound);
    ahead.admitted_at = written_at(3600);
    let mut behind = hold("behind", "", Bound);
    behind.admitted_at = written_at(-3600);
    let mut old = hold("old", "", Bound);
    old.admitted_at = written_at(-20);
    let ix = World::default()
        .node("n1", 3, 3)
        .holds("n1", vec![ahead, behind, old])
        .ix;
    // A writer's clock ahead ends nothing early: the TTL from first sight.
    assert_eq!(end_of(&ix, "n1", "ahead", "", at(29)), None);
    assert_eq!(end_of(&ix, "n1", "ahead", "", at(30)), Some(End::Expired));
    // Far behind (or a replica that started long after the write): the grace, no less.
    assert_eq!(end_of(&ix, "n1", "behind", "", at(4)), None);
    assert_eq!(end_of(&ix, "n1", "behind", "", at(5)), Some(End::Expired));
    // Written 20 s before this replica saw it: 10 s more.
    assert_eq!(end_of(&ix, "n1", "old", "", at(9)), None);
    assert_eq!(end_of(&ix, "n1", "old", "", at(10)), Some(End::Expired));
}

#[test]
fn keys_held_for_others_leave_out_the_claimants_own_and_split_pods_from_promises() {
    let ix = World::default()
        .node("n1", 4, 4)
        .holds(
            "n1",
            vec![
                hold("p1", "v1", Admitted),
                hold("", "v2", Promised),
                hold("p3", "v3", Bound),
            ],
        )
        .ix;
    let c = |pod_uid, vmi_uid| Claimant { pod_uid, vmi_uid };
    let all = ix.held("n1", Claimant::NONE, t0());
    assert_eq!(
        (all.pods[&TeeKind::Tdx], all.promised[&TeeKind::Tdx]),
        (2, 1)
    );
    let p1 = ix.held("n1", c("p1", "v1"), t0());
    assert_eq!(p1.pods[&TeeKind::Tdx], 1, "its own hold is its own");
    let v2 = ix.held("n1", c("new-pod", "v2"), t0());
    assert!(
        !v2.promised.contains_key(&TeeKind::Tdx),
        "the key promised to its VMI is its own"
    );
    assert_eq!(
        ix.own_hold(c("new-pod", "v2"), t0()).map(|(n, _)| n),
        Some("n1")
    );
    assert_eq!(ix.own_hold(c("x", "v9"), t0()), None);
}

#[test]
fn an_older_object_does_not_replace_a_newer_one() {
    let w = World::default().node("n1", 1, 1).holds("n1", vec![]);
    let mut ix = w.holds("n1", vec![hold("p1", "", Bound)]).ix; // version 2
    let mut old = (*ix.node("n1").and_then(|n| n.holds.clone()).expect("object")).clone();
    old.metadata.resource_version = Some("1".into());
    old.spec.reservations.clear();
    assert!(!ix.apply_holds("n1", Some(Arc::new(old)), at(1)));
    assert_eq!(ix.entries("n1").count(), 1);
}

#[test]
fn a_local_hold_ends_by_the_same_rule_and_is_swept() {
    let mut ix = World::default().node("n1", 1, 1).synced().ix;
    ix.hold_locally("n1", hold("p1", "v1", Bound), t0());
    assert_eq!(ix.held("n1", Claimant::NONE, t0()).pods[&TeeKind::Tdx], 1);
    assert_eq!(
        ix.own_hold(
            Claimant {
                pod_uid: "p1",
                vmi_uid: "v1"
            },
            t0()
        )
        .map(|(n, _)| n),
        Some("n1")
    );
    ix.sweep(at(4));
    assert_eq!(ix.entries("n1").count(), 1);
    ix.sweep(at(5));
    assert_eq!(ix.entries("n1").count(), 0, "its pod never appeared");
}

#[test]
fn the_waiting_vmis_come_in_turn_order_without_those_holding_a_key() {
    let ix = World::default()
        .node("n1", 1, 0)
        .vmi("late", Some(20), &[])
        .vmi("early", Some(10), &[])
        .vmi("held", Some(0), &[])
        .vmi("running", None, &[])
        .holds("n1", vec![hold("", "uid-held", Promised)])
        .ix;
    let names: Vec<&str> = ix
        .waiting(Some(TeeKind::Tdx), t0())
        .iter()
        .map(|w| w.vmi.name.as_str())
        .collect();
    assert_eq!(names, ["early", "late"]);
    assert_eq!(ix.waiting_counts()[&TeeKind::Tdx], 3);
    assert!(ix.waiting(Some(TeeKind::Sev), t0()).is_empty());
}

#[test]
fn scan_nodes_visits_first_then_the_rest_once_each_with_labels_only() {
    let mut ix = World::default()
        .node("a", 1, 1)
        .node("b", 1, 1)
        .node("c", 1, 1)
        .ix;
    ix.apply_report("unlabelled", Some(report(1, 1, &[])), None, t0());
    let scan = |first: Option<&str>, keep: &dyn Fn(&str) -> bool| {
        let mut seen = Vec::new();
        ix.scan_nodes(&|n, _| keep(n), first, &mut |n, _| {
            seen.push(n.to_string());
            std::ops::ControlFlow::Continue(())
        });
        seen
    };
    let all = scan(Some("c"), &|_| true);
    assert_eq!(all[0], "c");
    let mut sorted = all.clone();
    sorted.sort();
    assert_eq!(
        sorted,
        ["a", "b", "c"],
        "a node without a Node object is no candidate"
    );
    assert!(!scan(Some("b"), &|n| n != "b").contains(&"b".to_string()));
}

#[test]
fn a_local_hold_whose_write_arrived_late_counts_once() {
    let ix = World::default()
        .node("n1", 2, 2)
        .local("n1", hold("p1", "v1", Bound))
        .holds("n1", vec![hold("p1", "v1", Bound)])
        .ix;
    assert_eq!(ix.entries("n1").count(), 1);
    assert_eq!(ix.held("n1", Claimant::NONE, t0()).pods[&TeeKind::Tdx], 1);
}

/// `node`'s `TeeReservation` at `version` holding `entries`.
fn object(node: &str, version: u64, entries: Vec<KeyReservation>) -> Option<Arc<TeeReservation>> {
    let mut obj = TeeReservation::new(node, Default::default());
    obj.metadata.resource_version = Some(version.to_string());
    obj.spec.node_name = node.into();
    obj.spec.reservations = entries;
    Some(Arc::new(obj))
}

#[test]
fn a_pods_later_hold_lives_its_own_life_not_ended_by_its_earlier_holds_age() {
    // p1 was admitted at t0 (its hold expired at 30: the scheduler bound it nowhere); its binding,
    // admitted at 40, holds a key again, on the node whose object still has the expired hold.
    let mut bound = hold("p1", "v1", Bound);
    let half = jiff::SignedDuration::from_millis(500);
    bound.admitted_at = Time(at(40).checked_add(half).expect("time"));
    let mut ix = World::default()
        .node("n1", 2, 1)
        .launcher("p1", "v1", None)
        .synced()
        .holds("n1", vec![hold("p1", "v1", Admitted)])
        .ix;
    assert_eq!(end_of(&ix, "n1", "p1", "v1", at(30)), Some(End::Expired));
    ix.hold_locally("n1", bound.clone(), at(40));
    let held = |ix: &Index, secs| {
        let held = ix.held("n1", Claimant::NONE, at(secs));
        held.pods.get(&TeeKind::Tdx).copied()
    };
    assert_eq!(held(&ix, 40), Some(1), "the new hold holds");
    // The watch brings the object again (a re-list) before the new hold is written: still held.
    ix.apply_holds(
        "n1",
        object("n1", 1, vec![hold("p1", "v1", Admitted)]),
        at(40),
    );
    assert_eq!(held(&ix, 41), Some(1), "the unwritten hold is kept");
    // Written behind (the API server keeps whole seconds): one hold, its TTL from its own write.
    bound.admitted_at = Time(at(40));
    ix.apply_holds("n1", object("n1", 2, vec![bound]), at(41));
    assert_eq!(ix.entries("n1").count(), 1, "written, it is one hold");
    assert_eq!(held(&ix, 69), Some(1));
    assert_eq!(end_of(&ix, "n1", "p1", "v1", at(70)), Some(End::Expired));
}

#[test]
fn an_orphan_launcher_pod_wakes_the_planner_when_it_stops_holding_admissions_back() {
    // A launcher pod admitted by a decider that crashed before writing its hold: the new decider
    // admits nothing while it may still be bound. The moment it stops counting is a deadline, so
    // the planner retries the waiting VMIs then, not at its backstop.
    let mut ix = World::default().node("n1", 1, 1).pod("orphan", None).ix;
    ix.set_synced();
    assert_eq!(ix.orphans(at(1)), 1);
    assert_eq!(ix.next_deadline(at(1)), Some(at(TTL.as_secs() as i64)));
    assert_eq!(ix.orphans(at(TTL.as_secs() as i64)), 0);
    assert_eq!(ix.next_deadline(at(TTL.as_secs() as i64)), None);
}
