//! Tests of the decisions for nodes in DRA mode (`accounting: dra` in their report): the scheduler
//! allocates their keys, so a pod not bound yet may wait there and a binding there is admitted; a pod
//! created with `spec.nodeName` (no claim) is still checked against the report.

use super::tests::{STALE, kind, now, report, tdx};
use super::*;
use pretty_assertions::assert_eq;

/// A current report of a full node (`free: 0`), in DRA mode or not.
fn full(dra: bool, age_secs: i64) -> TeeCapacityStatus {
    let mut r = report(Some(kind(1, 0, 0)), age_secs);
    r.accounting = Some(if dra { "dra" } else { "extendedResource" }.into());
    r
}

fn assess(status: &TeeCapacityStatus, requests: &KeyRequests) -> NodeAssessment {
    NodeAssessment::new("n1", requests, Some(status), &tdx(0), now(), STALE)
}

fn reason(v: &Verdict) -> &'static str {
    match v {
        Verdict::Admit { reason, .. } | Verdict::Refuse { reason, .. } => reason,
    }
}

#[test]
fn a_pod_not_bound_yet_may_wait_on_a_full_dra_node_but_not_on_a_full_extended_resource_node() {
    let dra = decide_candidates(
        &tdx(1),
        vec![assess(&full(true, 0), &tdx(1))],
        StalePolicy::Deny,
    );
    assert_eq!(reason(&dra), reason::SCHEDULER_ALLOCATED, "{dra:?}");
    assert!(matches!(dra, Verdict::Admit { .. }));
    let er = decide_candidates(
        &tdx(1),
        vec![assess(&full(false, 0), &tdx(1))],
        StalePolicy::Deny,
    );
    assert_eq!(reason(&er), reason::INSUFFICIENT_KEYS, "{er:?}");
    // The streaming scan agrees.
    let requests = tdx(1);
    let mut scan = CandidateScan::new(&requests);
    assert!(
        scan.offer("n1", Some(&full(true, 0)), &tdx(0), now(), STALE)
            .is_break()
    );
    assert_eq!(
        reason(&scan.verdict(StalePolicy::Deny)),
        reason::SCHEDULER_ALLOCATED
    );
}

#[test]
fn a_binding_onto_a_dra_node_is_the_schedulers_allocation_and_is_admitted() {
    let a = assess(&full(true, 0), &tdx(1));
    let v = decide_on_node(Trigger::Binding, &tdx(1), &a, StalePolicy::Deny);
    assert_eq!(reason(&v), reason::SCHEDULER_ALLOCATED, "{v:?}");
}

#[test]
fn a_pod_created_on_a_full_dra_node_with_spec_node_name_is_still_refused() {
    let a = assess(&full(true, 0), &tdx(1));
    let v = decide_on_node(Trigger::PodCreate, &tdx(1), &a, StalePolicy::Deny);
    assert_eq!(reason(&v), reason::INSUFFICIENT_KEYS, "{v:?}");
}

#[test]
fn a_dra_node_counts_only_with_a_current_report_that_has_the_kind() {
    // Stale: unknown, as for any node.
    let stale = assess(&full(true, 3600), &tdx(1));
    assert!(!stale.scheduler_allocates);
    // The node has no SEV-ES keys: the scheduler cannot place such a pod there.
    let sev_es = KeyRequests::from([(TeeKind::SevEs, 1)]);
    let a = assess(&full(true, 0), &sev_es);
    assert!(!a.scheduler_allocates);
    let v = decide_candidates(&sev_es, vec![a], StalePolicy::Deny);
    assert!(matches!(v, Verdict::Refuse { .. }), "{v:?}");
}
