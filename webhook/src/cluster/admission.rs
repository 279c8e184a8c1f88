//! The capacity check of a pod, on one named node (a binding, a pod created with `spec.nodeName`) or
//! over its candidate nodes (a pod CREATE): decided on the admission index by
//! [`crate::decide::admit`] and held in the decider's index under the same lock
//! ([`crate::cluster::holds::hold`]; written behind into the node's `TeeReservation`). The validating
//! handler and the deterministic simulation both call [`check`].

use std::sync::{Arc, PoisonError, RwLock};

use k8s_openapi::api::core::v1::PodSpec;
use teeguard_shared::{Config, TeeKind};

use super::holds::hold;
use super::index::KeyIndex;
use crate::decide::admit::{self, Ask, Placement, Planned};
use crate::decide::affinity::node_matches;
use crate::decide::index::Labels;
use crate::decide::validation::{Decision, Trigger, reason};

/// Per TEE kind, the node that last fitted a pod not bound yet: candidate scans stop at the first node
/// that fits, and when most nodes are full a scan in no particular order looks at many before finding
/// one, while the last node that fitted usually still does. Only an order: the verdict is the same
/// whichever node is looked at first.
#[derive(Debug, Default)]
pub struct FitHints {
    nodes: [RwLock<Option<Arc<str>>>; TeeKind::ALL.len()],
}

impl FitHints {
    fn slot(&self, kind: TeeKind) -> &RwLock<Option<Arc<str>>> {
        let at = TeeKind::ALL.iter().position(|k| *k == kind).unwrap_or(0);
        &self.nodes[at]
    }

    /// The node that last fitted a pod of `kind`.
    pub fn get(&self, kind: TeeKind) -> Option<Arc<str>> {
        self.slot(kind)
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Remember `node` as the one that fitted a pod of `kind`.
    pub fn remember(&self, kind: TeeKind, node: &str) {
        *self
            .slot(kind)
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some(Arc::from(node));
    }
}

/// What a check uses besides the pod.
#[derive(Debug)]
pub struct Checker<'a> {
    /// The admission index.
    pub index: &'a KeyIndex,
    /// The node that last fitted a pod of each kind.
    pub hints: &'a FitHints,
    /// The configuration (`admission.retryRefusedVmis`, keys per VM).
    pub config: &'a Config,
    /// Whether the nodes' labels are known (the offline `review` without node files: every reported
    /// node is a candidate).
    pub labels_known: bool,
}

/// Where the pod goes.
#[derive(Clone, Copy, Debug)]
pub enum Target<'a> {
    /// A named node (a binding, or a pod CREATE with `spec.nodeName`).
    Node(&'a str, Trigger),
    /// One of the nodes its node selector and required affinity allow (a pod CREATE).
    Candidates(&'a PodSpec),
}

/// The decision for `ask` at `target`, its hold kept when it takes a key. A
/// virt-launcher pod not bound yet that is refused for lack of keys leaves where it could go (its node
/// selector and affinity) in the index, for the queue and the retry planner.
pub fn check(c: &Checker<'_>, ask: &Ask<'_>, target: Target<'_>) -> Decision {
    let index = c.index;
    let primary = ask.requests.keys().next().copied();
    let hint = primary.and_then(|k| c.hints.get(k));
    let retry = c.config.admission.retry_refused_vmis;
    let queue = primary
        .filter(|_| retry && !ask.claimant.vmi_uid.is_empty())
        .map(|k| u64::from(c.config.resources.get(k).keys_per_vm).max(1));
    let labels_known = c.labels_known;
    let planned = hold(index, |ix, now| {
        let planned: Planned = match target {
            Target::Node(node, trigger) => admit::on_node(ix, trigger, node, ask, now),
            Target::Candidates(spec) => {
                let fits =
                    |name: &str, labels: &Labels| !labels_known || node_matches(spec, name, labels);
                let placement = Placement {
                    fits: &fits,
                    hint: hint.as_deref(),
                    queue,
                };
                admit::at_create(ix, ask, placement, now)
            }
        };
        let holds = planned.node.clone().zip(planned.hold.clone());
        (planned, holds.map(|(node, hold)| (node, vec![hold])))
    });
    if let (Some(kind), Target::Candidates(_), Some(node)) = (primary, target, &planned.node)
        && hint.as_deref() != Some(node.as_str())
    {
        c.hints.remember(kind, node);
    }
    let decision = planned.decision;
    let for_keys = !decision.allowed && reason::ends_when_a_key_frees(decision.reason);
    if let Target::Candidates(spec) = target
        && retry
        && for_keys
        && !ask.dry_run
        && !ask.claimant.vmi_uid.is_empty()
    {
        index.update(|ix, _| ix.refused(ask.claimant.vmi_uid, spec));
    }
    decision
}
