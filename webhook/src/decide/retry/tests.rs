//! The retry decisions: which VMIs wait on teeguard, and which a free key retries.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use serde_json::{Value, json};
use teeguard_shared::{TeeKind, VirtualMachineInstance, names};

use super::*;

const DENIED: &str = "failed to create virtual machine pod: admission webhook \
    \"validate.pods.teeguard.dev\" denied the request: no node can host this TDX VM: node-a 0/1 free; \
    teeguard starts this VM by itself as soon as a key is free for it";

fn t(s: &str) -> Timestamp {
    s.parse().expect("timestamp")
}

/// A VMI of launchSecurity `ls` in phase `phase` with a `Synchronized` condition saying `message`
/// (none when `None`) since `since`.
fn vmi(name: &str, ls: Value, phase: &str, message: Option<&str>, since: &str) -> Value {
    let mut conditions = vec![
        json!({"type": "Ready", "status": "False", "reason": "PodNotExists",
        "message": "virt-launcher pod has not yet been scheduled"}),
    ];
    if let Some(m) = message {
        conditions.push(
            json!({"type": "Synchronized", "status": "False", "reason": "FailedCreate",
            "message": m, "lastTransitionTime": since}),
        );
    }
    json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": "vms", "uid": format!("uid-{name}")},
        "spec": {"domain": {"launchSecurity": ls, "devices": {}}},
        "status": {"phase": phase, "conditions": conditions}
    })
}

fn parse(v: Value) -> VirtualMachineInstance {
    VirtualMachineInstance::from_json(v).expect("VMI")
}

fn tdx_waiting(name: &str, since: &str) -> Waiting {
    waiting(&parse(vmi(
        name,
        json!({"tdx": {}}),
        "Pending",
        Some(DENIED),
        since,
    )))
    .expect("waiting")
}

/// A denial or a failed call of a teeguard webhook.
fn refused_by_teeguard(message: &str) -> bool {
    quotes_teeguard(message, DENIED_BY) || quotes_teeguard(message, FAILED_CALL)
}

#[test]
fn a_denial_or_a_failed_call_of_a_teeguard_webhook_is_teeguards_and_nothing_else_is() {
    let ours = [
        DENIED,
        "Error creating pod: admission webhook \"kv.validate.pods.teeguard.dev\" denied the request: x",
        "failed to create virtual machine pod: Internal error occurred: failed calling webhook \
         \"mutate.pods.teeguard.dev\": failed to call webhook: Post \"https://x/mutate\": dial tcp: connection refused",
    ];
    for m in ours {
        assert!(refused_by_teeguard(m), "{m}");
    }
    let others = [
        "pods \"virt-launcher-x\" is forbidden: ValidatingAdmissionPolicy 'deny' denied request: no",
        "admission webhook \"validate.example.com\" denied the request: teeguard.dev is mentioned",
        "admission webhook \"teeguard.dev.example.com\" denied the request: x",
        "pods \"x\" is forbidden: exceeded quota: compute, requested: cpu=200m",
        "",
    ];
    for m in others {
        assert!(!refused_by_teeguard(m), "{m}");
    }
}

#[test]
fn a_pending_tee_vmi_refused_by_teeguard_waits_with_its_refusal_time_and_placement() {
    let mut v = vmi(
        "a",
        json!({"tdx": {}}),
        "Pending",
        Some(DENIED),
        "2026-11-26T10:00:00Z",
    );
    v["spec"]["nodeSelector"] = json!({"rack": "r1"});
    v["metadata"]["annotations"] = json!({names::RETRIED_ANNOTATION: "2026-11-26T10:05:00Z"});
    let w = waiting(&parse(v)).expect("waiting");
    assert_eq!(w.vmi.to_string(), "vms/a");
    assert_eq!(w.vmi.uid, "uid-a");
    assert_eq!(w.kind, TeeKind::Tdx);
    assert_eq!(w.since, Some(t("2026-11-26T10:00:00Z")));
    assert_eq!(w.retried, Some(t("2026-11-26T10:05:00Z")));
    let selector = w.placement.node_selector.expect("selector");
    let want: BTreeMap<String, String> = [("kubevirt.io/tdx", "true"), ("rack", "r1")]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    assert_eq!(selector, want);
}

#[test]
fn each_kind_gets_kubevirts_node_labels() {
    let cases = [
        (json!({"tdx": {}}), TeeKind::Tdx, vec!["kubevirt.io/tdx"]),
        (
            json!({"snp": {}}),
            TeeKind::SevEs,
            vec!["kubevirt.io/sev", "kubevirt.io/sev-snp"],
        ),
        (
            json!({"sev": {"policy": {"encryptedState": true}}}),
            TeeKind::SevEs,
            vec!["kubevirt.io/sev", "kubevirt.io/sev-es"],
        ),
        (json!({"sev": {}}), TeeKind::Sev, vec!["kubevirt.io/sev"]),
    ];
    for (ls, kind, labels) in cases {
        let w = waiting(&parse(vmi(
            "a",
            ls.clone(),
            "Pending",
            Some(DENIED),
            "2026-11-26T10:00:00Z",
        )))
        .expect("waiting");
        assert_eq!(w.kind, kind, "{ls}");
        let got: Vec<String> = w
            .placement
            .node_selector
            .expect("selector")
            .into_keys()
            .collect();
        assert_eq!(got, labels, "{ls}");
    }
}

// A VMI whose pod teeguard refuses for something a free key does not end (here a limit annotation of
// its own, which KubeVirt copies to the pod) would be retried at every pass and hold a promised key
// from every other VMI: it does not wait on teeguard. A failed call does (it ends with the webhook).
#[test]
fn only_refusals_a_free_key_or_the_webhooks_return_ends_make_a_vmi_wait() {
    let since = "2026-11-26T10:00:00Z";
    let forged = "failed to create virtual machine pod: admission webhook \"validate.pods.teeguard.dev\" \
        denied the request: pod vms/virt-launcher-a-x: annotation misc-max.teeguard.dev/compute=\"tdx 5\" \
        is not one teeguard writes for it; cgroup-limit annotations are written only by teeguard's \
        mutating webhook";
    let down = "failed to create virtual machine pod: Internal error occurred: failed calling webhook \
        \"mutate.pods.teeguard.dev\": failed to call webhook: connection refused";
    let waits = |m: &str| {
        waiting(&parse(vmi(
            "a",
            json!({"tdx": {}}),
            "Pending",
            Some(m),
            since,
        )))
        .is_some()
    };
    assert!(!waits(forged), "a permanent denial");
    assert!(waits(down), "the webhook could not be called");
    assert!(waits(DENIED), "no key free");
    assert!(ends_by_itself(DENIED) && ends_by_itself(down) && !ends_by_itself(forged));
}

#[test]
fn vmis_that_do_not_wait_on_teeguard_are_not_waiting() {
    let since = "2026-11-26T10:00:00Z";
    let other = "failed to create virtual machine pod: pods is forbidden: exceeded quota";
    let cases = [
        (
            "scheduled already",
            vmi("a", json!({"tdx": {}}), "Scheduling", Some(DENIED), since),
        ),
        (
            "no refusal",
            vmi("a", json!({"tdx": {}}), "Pending", None, since),
        ),
        (
            "refused by someone else",
            vmi("a", json!({"tdx": {}}), "Pending", Some(other), since),
        ),
        (
            "not a TEE VM",
            vmi("a", json!(null), "Pending", Some(DENIED), since),
        ),
        (
            "Secure Execution",
            vmi("a", json!({}), "Pending", Some(DENIED), since),
        ),
        (
            "two kinds",
            vmi(
                "a",
                json!({"tdx": {}, "snp": {}}),
                "Pending",
                Some(DENIED),
                since,
            ),
        ),
    ];
    for (why, v) in cases {
        assert!(waiting(&parse(v)).is_none(), "{why}");
    }
    let mut deleted = vmi("a", json!({"tdx": {}}), "Pending", Some(DENIED), since);
    deleted["metadata"]["deletionTimestamp"] = json!("2026-11-26T10:01:00Z");
    assert!(waiting(&parse(deleted)).is_none(), "being deleted");
    let mut unset = vmi("a", json!({"tdx": {}}), "Pending", Some(DENIED), since);
    unset["status"]
        .as_object_mut()
        .expect("status")
        .remove("phase");
    assert!(waiting(&parse(unset)).is_some(), "no phase yet still waits");
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn free<'a>(
    name: &'a str,
    labels: &'a BTreeMap<String, String>,
    kind: TeeKind,
    n: u64,
) -> FreeNode<'a> {
    FreeNode {
        name,
        labels,
        available: [(kind, n)].into_iter().collect(),
    }
}

fn names_of(plan: &[Retry<'_>]) -> Vec<String> {
    plan.iter().map(|r| r.waiting.vmi.name.clone()).collect()
}

#[test]
fn one_free_key_retries_the_vmi_that_waited_longest_and_no_other() {
    let tdx = labels(&[("kubevirt.io/tdx", "true")]);
    let waiting = [
        tdx_waiting("b", "2026-11-26T10:02:00Z"),
        tdx_waiting("a", "2026-11-26T10:01:00Z"),
        tdx_waiting("c", "2026-11-26T10:03:00Z"),
    ];
    let mut nodes = [free("node-a", &tdx, TeeKind::Tdx, 1)];
    let now = t("2026-11-26T11:00:00Z");
    let plan = plan(&waiting, &mut nodes, now);
    assert_eq!(names_of(&plan), ["a"]);
    assert_eq!(plan[0].node, "node-a");
    assert_eq!(
        nodes[0].available[&TeeKind::Tdx],
        0,
        "the key is handed out"
    );
}

/// An SNP VMI waiting since 09:00.
fn snp_waiting() -> Waiting {
    waiting(&parse(vmi(
        "snp-vm",
        json!({"snp": {}}),
        "Pending",
        Some(DENIED),
        "2026-11-26T09:00:00Z",
    )))
    .expect("waiting")
}

/// A TDX VMI waiting since 10:00 whose pod must go to rack r1.
fn rack1_waiting() -> Waiting {
    let mut rack1 = tdx_waiting("rack1-vm", "2026-11-26T10:00:00Z");
    rack1
        .placement
        .node_selector
        .as_mut()
        .expect("selector")
        .insert("rack".into(), "r1".into());
    rack1
}

#[test]
fn keys_go_only_to_vmis_of_their_kind_whose_pods_may_go_to_the_node() {
    let tdx = labels(&[("kubevirt.io/tdx", "true")]);
    let tdx_rack2 = labels(&[("kubevirt.io/tdx", "true"), ("rack", "r2")]);
    let rack1 = rack1_waiting();
    let snp = snp_waiting();
    let waiting = [rack1, snp, tdx_waiting("any", "2026-11-26T10:30:00Z")];
    let mut nodes = [
        free("plain-tdx", &tdx, TeeKind::Tdx, 0),
        free("rack2", &tdx_rack2, TeeKind::Tdx, 1),
    ];
    let plan = plan(&waiting, &mut nodes, t("2026-11-26T11:00:00Z"));
    assert_eq!(
        names_of(&plan),
        ["any"],
        "the SNP VMI has no SNP key and the rack-1 VMI cannot go to rack 2"
    );
}

#[test]
fn a_vmi_retried_moments_ago_keeps_its_key_and_is_not_retried_again_until_the_interval_passed() {
    let tdx = labels(&[("kubevirt.io/tdx", "true")]);
    let mut first = tdx_waiting("first", "2026-11-26T10:00:00Z");
    first.retried = Some(t("2026-11-26T11:00:00Z"));
    let waiting = [first, tdx_waiting("second", "2026-11-26T10:01:00Z")];
    let soon = t("2026-11-26T11:00:03Z");
    let mut nodes = [free("node-a", &tdx, TeeKind::Tdx, 1)];
    assert!(
        plan(&waiting, &mut nodes, soon).is_empty(),
        "the first VMI's pod is on its way: the key is not offered to the second"
    );
    let later = t("2026-11-26T11:00:00Z") + MIN_RETRY_INTERVAL;
    let mut nodes = [free("node-a", &tdx, TeeKind::Tdx, 1)];
    assert_eq!(names_of(&plan(&waiting, &mut nodes, later)), ["first"]);
    let mut nodes = [free("node-a", &tdx, TeeKind::Tdx, 2)];
    assert_eq!(
        names_of(&plan(&waiting, &mut nodes, soon)),
        ["second"],
        "a second key goes to the next VMI"
    );
}

#[test]
fn a_retry_time_ahead_of_this_clock_counts_as_recent() {
    let tdx = labels(&[("kubevirt.io/tdx", "true")]);
    let mut w = tdx_waiting("a", "2026-11-26T10:00:00Z");
    w.retried = Some(t("2026-11-26T11:00:10Z"));
    let mut nodes = [free("node-a", &tdx, TeeKind::Tdx, 1)];
    assert!(plan(&[w], &mut nodes, t("2026-11-26T11:00:00Z")).is_empty());
}

#[test]
fn vmis_without_a_refusal_time_come_last_and_ties_go_by_name() {
    let tdx = labels(&[("kubevirt.io/tdx", "true")]);
    let mut unknown = tdx_waiting("a-unknown", "2026-11-26T10:00:00Z");
    unknown.since = None;
    let waiting = [
        unknown,
        tdx_waiting("z", "2026-11-26T10:00:00Z"),
        tdx_waiting("m", "2026-11-26T10:00:00Z"),
    ];
    let mut nodes = [free("node-a", &tdx, TeeKind::Tdx, 3)];
    assert_eq!(
        names_of(&plan(&waiting, &mut nodes, t("2026-11-26T11:00:00Z"))),
        ["m", "z", "a-unknown"]
    );
}

#[test]
fn keys_on_several_nodes_retry_as_many_vmis() {
    let tdx = labels(&[("kubevirt.io/tdx", "true")]);
    let waiting: Vec<Waiting> = (0..5)
        .map(|i| tdx_waiting(&format!("vm-{i}"), &format!("2026-11-26T10:0{i}:00Z")))
        .collect();
    let mut nodes = [
        free("node-a", &tdx, TeeKind::Tdx, 1),
        free("node-b", &tdx, TeeKind::Tdx, 2),
    ];
    let plan = plan(&waiting, &mut nodes, t("2026-11-26T11:00:00Z"));
    assert_eq!(names_of(&plan), ["vm-0", "vm-1", "vm-2"]);
    let on: Vec<&str> = plan.iter().map(|r| r.node.as_str()).collect();
    assert_eq!(on, ["node-a", "node-b", "node-b"]);
}

#[test]
fn a_promised_key_is_held_for_other_vmis_until_the_promised_vmis_pod_is_counted_or_it_expires() {
    let p = Promises::default();
    let t0 = Instant::now();
    p.promise("node-a", TeeKind::Tdx, "vmi-a", t0);
    let held =
        |counted: &[String], except: &str, at: Instant| p.held("node-a", counted, except, at);
    assert_eq!(
        held(&[], "vmi-b", t0).get(&TeeKind::Tdx),
        Some(&1),
        "held for another VMI"
    );
    assert!(
        held(&[], "vmi-a", t0).is_empty(),
        "not for the promised VMI's own pod"
    );
    assert!(
        p.held("node-b", &[], "vmi-b", t0).is_empty(),
        "only on its node"
    );
    p.admitted("vmi-a", "pod-a");
    let t1 = t0 + Duration::from_secs(2);
    assert_eq!(
        held(&["other-pod".into()], "vmi-b", t1).get(&TeeKind::Tdx),
        Some(&1),
        "admitted, not counted yet"
    );
    assert!(
        held(&["pod-a".into()], "vmi-b", t1).is_empty(),
        "the report counts the pod: the key is in its figures now"
    );
    assert!(held(&[], "vmi-b", t0 + PROMISE_TTL).is_empty(), "expired");
    p.promise("node-a", TeeKind::Tdx, "vmi-c", t1);
    p.promise("node-a", TeeKind::Tdx, "vmi-c", t1);
    assert_eq!(
        held(&[], "vmi-b", t1).get(&TeeKind::Tdx),
        Some(&2),
        "a VMI promised twice holds one key"
    );
    p.forget("vmi-c");
    let mut into = KeyRequests::from([(TeeKind::Tdx, 3)]);
    Promises::add_held(Some(&p), &mut into, "node-a", &[], "vmi-b", t1);
    assert_eq!(into.get(&TeeKind::Tdx), Some(&4), "added to the ledger's");
}

#[test]
fn an_admitted_launcher_pod_holds_its_key_for_other_vmis_until_its_binding_is_reviewed() {
    let p = Promises::default();
    let t0 = Instant::now();
    p.promise("node-a", TeeKind::Sev, "vmi-a", t0);
    p.admitted("vmi-a", "pod-a");
    assert_eq!(
        p.held("node-a", &[], "vmi-b", t0).get(&TeeKind::Sev),
        Some(&1),
        "a second VMI's pod, created before the first is bound, sees the key taken"
    );
    p.pod_ended("pod-other");
    assert_eq!(
        p.held("node-a", &[], "vmi-b", t0).len(),
        1,
        "another pod's binding"
    );
    p.pod_ended("pod-a");
    assert!(
        p.held("node-a", &[], "vmi-b", t0).is_empty(),
        "bound: the ledger holds the key on the node the scheduler chose"
    );
}

fn uids(ahead: &[&Waiting]) -> Vec<String> {
    let mut u: Vec<String> = ahead.iter().map(|w| w.vmi.uid.clone()).collect();
    u.sort();
    u
}

#[test]
fn the_vmis_ahead_of_a_pod_are_those_of_its_kind_that_waited_longer_without_a_promise() {
    let snp = snp_waiting();
    let waiting = [
        tdx_waiting("a", "2026-11-26T10:01:00Z"),
        tdx_waiting("b", "2026-11-26T10:02:00Z"),
        tdx_waiting("b2", "2026-11-26T10:02:00Z"),
        tdx_waiting("c", "2026-11-26T10:03:00Z"),
        snp,
    ];
    let none = |_: &str| false;
    assert_eq!(
        uids(&ahead_of(&waiting, TeeKind::Tdx, "uid-new", none)),
        ["uid-a", "uid-b", "uid-b2", "uid-c"],
        "a VMI that does not wait comes after every waiting VMI of its kind"
    );
    assert_eq!(
        uids(&ahead_of(&waiting, TeeKind::Tdx, "uid-c", none)),
        ["uid-a", "uid-b", "uid-b2"]
    );
    assert_eq!(
        uids(&ahead_of(&waiting, TeeKind::Tdx, "uid-b2", none)),
        ["uid-a", "uid-b"],
        "refused in the same second: by name, as the planner orders them"
    );
    assert!(ahead_of(&waiting, TeeKind::Tdx, "uid-a", none).is_empty());
    assert_eq!(
        uids(&ahead_of(&waiting, TeeKind::Tdx, "uid-c", |u| u == "uid-a")),
        ["uid-b", "uid-b2"],
        "a promised VMI's key is held already"
    );
    assert_eq!(
        uids(&ahead_of(&waiting, TeeKind::SevEs, "uid-new", none)),
        ["uid-snp-vm"]
    );
}

#[test]
fn a_vmi_ahead_counts_on_each_node_its_pod_may_go_to() {
    let tdx = labels(&[("kubevirt.io/tdx", "true")]);
    let tdx_rack1 = labels(&[("kubevirt.io/tdx", "true"), ("rack", "r1")]);
    let rack1 = rack1_waiting();
    let waiting = [rack1, tdx_waiting("any", "2026-11-26T10:01:00Z")];
    let ahead = ahead_of(&waiting, TeeKind::Tdx, "uid-new", |_| false);
    assert_eq!(queued_on(&ahead, "in-rack1", &tdx_rack1), 2);
    assert_eq!(queued_on(&ahead, "elsewhere", &tdx), 1);
    assert_eq!(queued_on(&ahead, "no-tdx", &labels(&[])), 0);
}

#[test]
fn a_promise_is_held_until_it_expires_or_is_forgotten() {
    let p = Promises::default();
    let t0 = Instant::now();
    assert!(!p.is_promised("vmi-a", t0));
    p.promise("node-a", TeeKind::Tdx, "vmi-a", t0);
    assert!(p.is_promised("vmi-a", t0 + Duration::from_secs(1)));
    assert!(!p.is_promised("vmi-b", t0));
    assert!(!p.is_promised("vmi-a", t0 + PROMISE_TTL), "expired");
    p.forget("vmi-a");
    assert!(!p.is_promised("vmi-a", t0));
}
