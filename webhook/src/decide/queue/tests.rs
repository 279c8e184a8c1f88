//! The retry decisions: which VMIs wait on teeguard, and which a free key retries.

use std::collections::BTreeMap;

use jiff::Timestamp;
use serde_json::{Value, json};
use teeguard_shared::{TeeKind, VirtualMachineInstance};

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
    let w = waiting(&parse(v)).expect("waiting");
    assert_eq!(w.vmi.to_string(), "vms/a");
    assert_eq!(w.vmi.uid, "uid-a");
    assert_eq!(w.kind, TeeKind::Tdx);
    assert_eq!(w.since, Some(t("2026-11-26T10:00:00Z")));
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

#[test]
fn a_waiting_vmi_parsed_from_its_refusal_keeps_its_turn() {
    let early = tdx_waiting("early", "2026-11-26T10:00:00Z");
    let late = tdx_waiting("late", "2026-11-26T10:00:01Z");
    assert!(turn(&early) < turn(&late));
    let mut unknown = tdx_waiting("a-unknown", "not a time");
    unknown.since = None;
    assert!(
        turn(&late) < turn(&unknown),
        "an unknown refusal time goes last"
    );
}

/// `serve` with slots of `capacity` and `fits[v]` the slots VMI `v` may use.
fn served(capacity: &[u64], fits: &[&[usize]]) -> Vec<Option<usize>> {
    serve(fits.len(), capacity, |v, s| fits[v].contains(&s))
}

#[test]
fn one_key_serves_the_vmi_that_waited_longest() {
    assert_eq!(served(&[1], &[&[0], &[0], &[0]]), [Some(0), None, None]);
    assert_eq!(served(&[2], &[&[0], &[0], &[0]]), [Some(0), Some(0), None]);
    assert_eq!(served(&[0], &[&[0]]), [None]);
}

#[test]
fn a_vmi_that_may_use_several_nodes_leaves_the_only_key_another_can_use() {
    // a (x or y) came first; b can use x only. Serving a from x would leave y idle and b waiting.
    assert_eq!(served(&[1, 1], &[&[0, 1], &[0]]), [Some(1), Some(0)]);
    // Moves go along a chain: c needs x; b may use x or y; a may use y or z.
    assert_eq!(
        served(&[1, 1, 1], &[&[1, 2], &[0, 1], &[0]]),
        [Some(2), Some(1), Some(0)]
    );
}

#[test]
fn a_later_vmi_never_takes_a_key_an_earlier_one_needs() {
    // a needs x; b may use x: b gets nothing rather than a.
    assert_eq!(served(&[1], &[&[0], &[0]]), [Some(0), None]);
    // Every VMI served before stays served whatever comes after.
    let fits: &[&[usize]] = &[&[0, 1], &[1], &[0], &[0, 1]];
    let all = served(&[1, 1], fits);
    assert_eq!(all.iter().filter(|s| s.is_some()).count(), 2);
    assert!(all[0].is_some() && all[1].is_some(), "{all:?}");
}
