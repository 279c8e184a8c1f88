//! One named node: the check of a pod for it and, when admitted, the reservation of its keys (a
//! binding, or a pod CREATE with `spec.nodeName`).

use std::time::Instant;

use jiff::Timestamp;
use teeguard_shared::config::{Mode, StalePolicy};
use teeguard_shared::pod::KeyRequests;

use super::ValidationContext;
use crate::cluster::caches::Lookups;
use crate::cluster::reservations::{Outcome as SharedOutcome, Request as SharedRequest};
use crate::decide::ledger::{ReportMark, Reservation};
use crate::decide::reservations;
use crate::decide::validation::{
    Decision, NodeAssessment, Report, Trigger, apply_mode, decide_on_node,
};

/// The pod-specific inputs of [`check_node`].
#[derive(Clone, Copy, Debug)]
pub(super) struct NodeCheck<'a> {
    pub(super) uid: &'a str,
    pub(super) pod: &'a str,
    pub(super) mode: Mode,
    pub(super) policy: StalePolicy,
    pub(super) dry_run: bool,
}

/// Check one node for the pod and, when admitted (and not a dry run), reserve its keys: one atomic
/// ledger step, then (with shared reservations) the same decision against every replica's
/// reservations, recorded in the node's `TeeReservation`.
pub(super) async fn check_node<L: Lookups>(
    trigger: Trigger,
    node: &str,
    requests: &KeyRequests,
    p: NodeCheck<'_>,
    lookups: &L,
    ctx: &ValidationContext<'_>,
) -> Decision {
    let now = Timestamp::now();
    let mono = Instant::now();
    let cap = lookups.tee_capacity(node);
    let report = Report {
        status: cap.as_ref().and_then(|c| c.status.as_ref()),
        lease_renewed: lookups.agent_lease(node),
    };
    let m = ReportMark::of(cap.as_deref());
    let candidate = Reservation {
        pod_uid: p.uid.to_string(),
        pod: p.pod.to_string(),
        keys: requests.clone(),
        admitted: mono,
    };
    let stale_after = ctx.config.admission.stale_report_after;
    let decide = |held: &KeyRequests| {
        let a = NodeAssessment::new(node, requests, report, held, now, stale_after);
        apply_mode(decide_on_node(trigger, requests, &a, p.policy), p.mode)
    };
    let (decision, reserved) = ctx
        .ledger
        .check_and_reserve(node, m, mono, candidate, |held| {
            let d = decide(held);
            let reserve = d.reserve && !p.dry_run;
            (d, reserve)
        });
    if let Some(metrics) = ctx.metrics {
        metrics.set_ledger_reservations(ctx.ledger.len());
    }
    tracing::debug!(pod = p.pod, node, ?reserved, "ledger");
    let Some(shared) = ctx.shared.filter(|_| decision.reserve && !p.dry_run) else {
        return decision;
    };
    let request = SharedRequest {
        node,
        candidate: reservations::entry(p.uid, p.pod, requests, now, shared.replica()),
        counted_pods: m.counted_pods,
        local: ctx.ledger.held_entries(node, m, mono, p.uid),
        ledger: ctx.ledger,
    };
    let decision = match shared.reserve(request, decide).await {
        SharedOutcome::Reserved | SharedOutcome::AlreadyHeld => decision,
        SharedOutcome::Refused(d) => {
            ctx.ledger.release(p.uid);
            tracing::info!(
                pod = p.pod,
                node,
                "another replica's reservations took the keys"
            );
            d
        }
        SharedOutcome::Unavailable(why) => {
            tracing::warn!(pod = p.pod, node, error = %why, "shared reservations unavailable; deciding with this replica's ledger and the stale-report policy");
            if p.policy == StalePolicy::Deny {
                ctx.ledger.release(p.uid);
            }
            reservations::fallback(decision, &why, node, p.policy, p.mode)
        }
    };
    if let Some(metrics) = ctx.metrics {
        metrics.set_ledger_reservations(ctx.ledger.len());
    }
    decision
}
