//! The keys available to a claimant, the CREATE, binding and planner decisions, and their writes.

use std::collections::BTreeMap;

use teeguard_shared::reservation::HoldReason::{Admitted, Bound, Promised};

use super::*;
use crate::decide::index::PodState;
use crate::decide::testkit::{STALE, World, at, hold, t0, tdx};

fn ask<'a>(pod_uid: &'a str, vmi_uid: &'a str, requests: &'a KeyRequests) -> Ask<'a> {
    Ask {
        claimant: Claimant { pod_uid, vmi_uid },
        pod: pod_uid,
        vmi: vmi_uid,
        requests,
        mode: Mode::Enforce,
        policy: StalePolicy::Deny,
        dry_run: false,
        stale_after: STALE,
        replica: "r1",
    }
}

fn any(_: &str, _: &Labels) -> bool {
    true
}

/// A pod CREATE of a virt-launcher pod (`queue`: it waits its turn) that may go to any node.
fn create(ix: &Index, a: &Ask<'_>, queue: bool) -> Planned {
    let placement = Placement {
        fits: &any,
        hint: None,
        queue: queue.then_some(1),
    };
    at_create(ix, a, placement, t0())
}

fn added(p: &Planned) -> Vec<(String, String, HoldReason)> {
    let node = p.node.clone().unwrap_or_default();
    p.hold
        .iter()
        .map(|e| (node.clone(), e.pod_uid.clone(), e.reason()))
        .collect()
}

/// The write-behind's write of `p`'s hold.
fn written(ix: &Index, p: Planned) -> Write {
    let node = p.node.expect("node");
    write(ix, &node, vec![p.hold.expect("hold")], t0())
}

#[test]
fn a_binding_takes_a_free_key_and_holds_it_as_bound() {
    let ix = World::default().node("n1", 2, 1).ix;
    let one = tdx(1);
    let p = on_node(&ix, Trigger::Binding, "n1", &ask("p1", "v1", &one), t0());
    assert!(p.decision.allowed);
    assert_eq!(added(&p), [("n1".into(), "p1".into(), Bound)]);
    let w = written(&ix, p);
    assert_eq!(
        (w.base, w.entries.len()),
        (None, 1),
        "the node's first object"
    );
}

#[test]
fn keys_held_for_others_refuse_a_binding_and_the_message_says_why() {
    let ix = World::default()
        .node("n1", 2, 2)
        .holds(
            "n1",
            vec![hold("p0", "v0", Admitted), hold("", "v9", Promised)],
        )
        .ix;
    let one = tdx(1);
    let p = on_node(&ix, Trigger::Binding, "n1", &ask("p1", "v1", &one), t0());
    assert!(!p.decision.allowed && p.hold.is_none());
    assert_eq!(
        p.decision.message.as_deref(),
        Some(
            "node n1 cannot host this TDX VM: 0/2 free (1 just admitted, not in the report yet, \
             1 kept for VMs waiting longer); free a key or add capacity; `kubectl get teecapacities` \
             shows free keys per node"
        )
    );
    // p0's own binding: its hold is its own, and it holds already (no write).
    let p = on_node(&ix, Trigger::Binding, "n1", &ask("p0", "v0", &one), t0());
    assert!(p.decision.allowed && p.hold.is_none());
}

#[test]
fn a_binding_of_a_pod_the_report_counts_writes_nothing() {
    let mut ix = World::default().node("n1", 2, 2).ix;
    ix.apply_report(
        "n1",
        Some(crate::decide::testkit::report(2, 1, &["p1"])),
        None,
        t0(),
    );
    let one = tdx(1);
    let p = on_node(&ix, Trigger::Binding, "n1", &ask("p1", "v1", &one), t0());
    assert!(p.decision.allowed && p.hold.is_none());
}

#[test]
fn a_launcher_pod_create_holds_its_key_on_the_node_that_fitted_and_other_pods_hold_none() {
    let ix = World::default().node("n1", 1, 1).ix;
    let one = tdx(1);
    let p = create(&ix, &ask("p1", "v1", &one), true);
    assert!(p.decision.allowed);
    assert_eq!(added(&p), [("n1".into(), "p1".into(), Admitted)]);
    // A Kata pod (no VMI) is checked, and holds nothing until it is bound.
    let p = create(&ix, &ask("kata", "", &one), false);
    assert!(p.decision.allowed && p.hold.is_none());
    // A dry run decides and holds nothing.
    let dry = Ask {
        dry_run: true,
        ..ask("p2", "v2", &one)
    };
    assert!(create(&ix, &dry, true).hold.is_none());
    // Warn mode admits a refused pod with a warning and holds nothing.
    let full = World::default().node("n1", 1, 0).ix;
    let warn = Ask {
        mode: Mode::Warn,
        ..ask("p3", "v3", &one)
    };
    let p = create(&full, &warn, true);
    assert!(p.decision.allowed && !p.decision.warnings.is_empty() && p.hold.is_none());
}

#[test]
fn a_pod_whose_vmi_was_promised_a_key_takes_that_key_in_place() {
    let ix = World::default()
        .node("a", 1, 1)
        .node("b", 1, 1)
        .holds("b", vec![hold("", "v1", Promised)])
        .ix;
    let one = tdx(1);
    let p = create(&ix, &ask("p1", "v1", &one), true);
    assert_eq!(p.node.as_deref(), Some("b"), "the promised node first");
    let w = written(&ix, p);
    assert_eq!(
        w.entries
            .iter()
            .map(|e| (e.pod_uid.as_str(), e.vmi_uid.as_str(), e.reason()))
            .collect::<Vec<_>>(),
        [("p1", "v1", Admitted)],
        "the promise became the pod's hold: one key, not two"
    );
    assert!(w.base.is_some(), "on the version read");
}

#[test]
fn a_newer_vmis_pod_waits_behind_a_vmi_refused_before_it() {
    let ix = World::default()
        .node("n1", 1, 1)
        .vmi("older", Some(0), &[])
        .vmi("newer", Some(5), &[])
        .ix;
    let one = tdx(1);
    let p = create(&ix, &ask("p-new", "uid-newer", &one), true);
    assert!(!p.decision.allowed);
    assert!(
        p.decision
            .message
            .as_deref()
            .is_some_and(|m| m.contains("0/1 free (1 kept for VMs waiting longer)")),
        "{:?}",
        p.decision.message
    );
    // A brand-new VMI comes after every waiting one.
    assert!(
        !create(&ix, &ask("p-x", "uid-brand-new", &one), true)
            .decision
            .allowed
    );
    // The older one's own retry takes the key.
    assert!(
        create(&ix, &ask("p-old", "uid-older", &one), true)
            .decision
            .allowed
    );
    // Without the queue (retryRefusedVmis off) nobody waits a turn.
    assert!(
        create(&ix, &ask("p-new", "uid-newer", &one), false)
            .decision
            .allowed
    );
}

#[test]
fn a_vmi_ahead_that_cannot_use_the_node_or_holds_a_key_keeps_nothing_there() {
    let elsewhere = World::default()
        .node("n1", 1, 1)
        .vmi("older", Some(0), &[("zone", "z-other")])
        .ix;
    let one = tdx(1);
    assert!(
        create(&elsewhere, &ask("p", "uid-newer", &one), true)
            .decision
            .allowed
    );
    let served = World::default()
        .node("n1", 2, 2)
        .node("n2", 1, 0)
        .vmi("older", Some(0), &[])
        .holds("n2", vec![hold("", "uid-older", Promised)])
        .ix;
    assert!(
        create(&served, &ask("p", "uid-newer", &one), true)
            .decision
            .allowed
    );
}

#[test]
fn an_earlier_vmi_that_may_use_another_node_leaves_this_one_to_the_newer_pod() {
    // older may go to a or b; newer's pod only to a: both are served (older from b).
    let ix = World::default()
        .node("a", 1, 1)
        .node("b", 1, 1)
        .vmi("older", Some(0), &[("kubevirt.io/tdx", "true")])
        .ix;
    let one = tdx(1);
    let only_a = |n: &str, _: &Labels| n == "a";
    let placement = Placement {
        fits: &only_a,
        hint: None,
        queue: Some(1),
    };
    let p = at_create(&ix, &ask("p", "uid-newer", &one), placement, t0());
    assert!(p.decision.allowed, "{:?}", p.decision.message);
    assert_eq!(p.node.as_deref(), Some("a"));
}

#[test]
fn a_vmi_with_a_launcher_pod_waits_no_more_though_its_status_lags_and_its_promise_ends() {
    // virt-controller writes a VMI's status seconds after its pod's CREATE when busy: until then the
    // status still says "refused, Pending". The pod (here bound, its key out of the report's free one)
    // is the truth: older neither keeps a key from newer nor holds its old promise beside its pod.
    let mut ix = World::default()
        .node("n1", 2, 1)
        .vmi("older", Some(0), &[])
        .vmi("newer", Some(5), &[])
        .launcher("p-old", "uid-older", Some("n1"))
        .holds("n1", vec![hold("", "uid-older", Promised)])
        .ix;
    let names = |ix: &Index| -> Vec<String> {
        ix.waiting(Some(TeeKind::Tdx), t0())
            .iter()
            .map(|w| w.vmi.name.clone())
            .collect()
    };
    assert_eq!(names(&ix), ["newer"]);
    assert_eq!(ix.waiting_counts()[&TeeKind::Tdx], 1);
    assert!(ix.held("n1", Claimant::NONE, t0()).promised.is_empty());
    let one = tdx(1);
    let p = create(&ix, &ask("p-new", "uid-newer", &one), true);
    assert!(p.decision.allowed, "{:?}", p.decision.message);
    let promised: Vec<(&str, &str)> = promises(&ix, |_| 1, STALE, t0())
        .into_iter()
        .map(|p| (p.waiting.vmi.name.as_str(), p.node))
        .collect();
    assert_eq!(promised, [("newer", "n1")]);
    // Its pod ended, or gone: older has no launcher pod any more.
    let mut ended = PodState {
        node: Some("n1".into()),
        ended: true,
        keys: true,
        vmi: Some("uid-older".into()),
    };
    ix.apply_pod("p-old", Some(ended.clone()), t0());
    assert!(!ix.launched("uid-older"));
    ended.ended = false;
    ix.apply_pod("p-old", Some(ended), t0());
    assert!(ix.launched("uid-older"));
    ix.apply_pod("p-old", None, t0());
    assert!(!ix.launched("uid-older"));
}

#[test]
fn free_keys_are_promised_first_come_first_served_to_vmis_whose_pods_may_use_them() {
    let ix = World::default()
        .node("a", 2, 1)
        .node("b", 1, 1)
        .vmi("third", Some(30), &[])
        .vmi("first", Some(10), &[("zone", "z-b")])
        .vmi("second", Some(20), &[])
        .ix;
    let got: BTreeMap<&str, &str> = promises(&ix, |_| 1, STALE, t0())
        .into_iter()
        .map(|p| (p.waiting.vmi.name.as_str(), p.node))
        .collect();
    assert_eq!(got, BTreeMap::from([("first", "b"), ("second", "a")]));
    // A key held for another pod is not free.
    let held = World::default()
        .node("a", 1, 1)
        .vmi("first", Some(10), &[])
        .holds("a", vec![hold("p0", "v0", Bound)])
        .ix;
    assert!(promises(&held, |_| 1, STALE, t0()).is_empty());
}

#[test]
fn a_write_trims_ended_holds_keeps_counted_ones_and_replaces_the_claimants_own() {
    let mut ix = World::default()
        .node("n1", 4, 4)
        .holds(
            "n1",
            vec![
                hold("gone", "vg", Admitted),
                hold("counted", "vc", Bound),
                hold("live", "vl", Bound),
                hold("", "v1", Promised),
            ],
        )
        .pod("live", Some("n1"))
        .pod("counted", Some("n1"))
        .ix;
    ix.apply_pod("gone", None, t0());
    ix.apply_report(
        "n1",
        Some(crate::decide::testkit::report(4, 3, &["counted"])),
        None,
        t0(),
    );
    let w = write(&ix, "n1", vec![hold("p1", "v1", Admitted)], t0());
    let kept: Vec<&str> = w.entries.iter().map(|e| e.pod_uid.as_str()).collect();
    assert_eq!(kept, ["counted", "live", "p1"]);
    // Withdrawing a promise removes it alone.
    let ix = World::default()
        .node("n1", 2, 2)
        .holds(
            "n1",
            vec![hold("", "v1", Promised), hold("", "v2", Promised)],
        )
        .ix;
    let w = withdraw(&ix, "n1", "v1", t0()).expect("a promise to withdraw");
    assert_eq!(w.entries.len(), 1);
    assert_eq!(w.entries[0].vmi_uid, "v2");
    assert!(withdraw(&ix, "n1", "v9", t0()).is_none());
}

#[test]
fn slots_list_nodes_with_whole_vmis_worth_of_keys_by_name() {
    let ix = World::default()
        .node("b", 5, 3)
        .node("a", 5, 1)
        .node("c", 5, 0)
        .ix;
    let s = slots(&ix, TeeKind::Tdx, 2, Claimant::NONE, STALE, t0());
    assert_eq!(
        s.iter().map(|s| (s.node, s.vmis)).collect::<Vec<_>>(),
        [("b", 1)]
    );
}

#[test]
fn a_node_is_trimmed_by_the_planner_only_once_its_object_was_left_alone_for_the_quiet_time() {
    let quiet = std::time::Duration::from_secs(5);
    let mut ix = World::default()
        .node("n1", 2, 2)
        .holds("n1", vec![hold("gone", "vg", Admitted)])
        .synced()
        .ix;
    ix.apply_pod("gone", None, t0());
    // Written at t0 (the world's object): the next admission's write trims it, not the planner.
    assert!(untidy(&ix, at(4), quiet).is_empty());
    assert_eq!(untidy(&ix, at(5), quiet), ["n1"]);
    assert!(tidy(&ix, "n1", at(5)).is_some_and(|w| w.entries.is_empty()));
    // Nothing ended: nothing to trim, however long the object was left alone.
    let ix = World::default()
        .node("n1", 2, 2)
        .holds("n1", vec![hold("", "uid-v1", Promised)])
        .vmi("v1", Some(0), &[])
        .ix;
    assert!(untidy(&ix, at(6), quiet).is_empty());
}
