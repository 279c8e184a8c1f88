//! The capacity check of a pod, on one named node (a binding, a pod created with `spec.nodeName`) or
//! over its candidate nodes (a pod CREATE): decided on the admission index by
//! [`crate::decide::admit`] and committed by writing the hold into the node's `TeeReservation`
//! ([`crate::cluster::holds::commit`]); a hold that cannot be written is decided by the stale-report
//! policy.

use k8s_openapi::api::core::v1::PodSpec;

use super::ValidationContext;
use crate::cluster::caches::Lookups;
use crate::cluster::holds::{Committed, commit};
use crate::decide::admit::{self, Ask, Placement, Planned};
use crate::decide::affinity::node_matches;
use crate::decide::validation::{Decision, Trigger};

/// Where the pod goes.
#[derive(Clone, Copy, Debug)]
pub(super) enum Target<'a> {
    /// A named node (a binding, or a pod CREATE with `spec.nodeName`).
    Node(&'a str, Trigger),
    /// One of the nodes its node selector and required affinity allow (a pod CREATE).
    Candidates(&'a PodSpec),
}

/// The decision for `ask` at `target`, its hold written when it takes a key, and the node chosen.
pub(super) async fn check<L: Lookups>(
    lookups: &L,
    ctx: &ValidationContext<'_>,
    ask: &Ask<'_>,
    target: Target<'_>,
) -> (Decision, Option<String>) {
    let index = lookups.index();
    let primary = ask.requests.keys().next().copied();
    let hint = primary.and_then(|k| ctx.hints.get(k));
    let queue = primary
        .filter(|_| ctx.config.admission.retry_refused_vmis && !ask.claimant.vmi_uid.is_empty())
        .map(|k| u64::from(ctx.config.resources.get(k).keys_per_vm).max(1));
    let labels_known = lookups.node_labels_known();
    let (planned, committed) = commit(index, ctx.store, ctx.api_timeout, ctx.metrics, |ix, now| {
        let planned: Planned = match target {
            Target::Node(node, trigger) => admit::on_node(ix, trigger, node, ask, now),
            Target::Candidates(spec) => {
                let fits = |name: &str, labels: &KeyLabels| {
                    !labels_known || node_matches(spec, name, labels)
                };
                let placement = Placement {
                    fits: &fits,
                    hint: hint.as_deref(),
                    queue,
                };
                admit::at_create(ix, ask, placement, now)
            }
        };
        let write = planned.write.clone();
        (planned, write)
    })
    .await;
    if let (Some(kind), Target::Candidates(_), Some(node)) = (primary, target, &planned.node)
        && hint.as_deref() != Some(node.as_str())
    {
        ctx.hints.remember(kind, node);
    }
    let decision = match committed {
        Committed::Failed(why) => {
            let node = planned.node.as_deref().unwrap_or("?");
            tracing::warn!(pod = ask.pod, node, error = %why, "the hold could not be written; deciding by the stale-report policy");
            let d = admit::fallback(planned.decision, &why, node, ask.policy, ask.mode);
            // Admitted all the same: this replica counts the key at least.
            if d.reserve
                && let Some(w) = &planned.write
            {
                index.update(|ix, now| {
                    for hold in &w.added {
                        ix.hold_locally(&w.node, hold.clone(), now);
                    }
                });
            }
            d
        }
        Committed::Nothing | Committed::Written => planned.decision,
    };
    (decision, planned.node)
}

type KeyLabels = std::collections::BTreeMap<String, String>;
