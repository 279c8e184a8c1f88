//! `POST /mutate`: the mutating webhook for pod CREATE.
//!
//! Envelope only: parse the review once, look up the namespace and VMI (through [`Lookups`]), call
//! the pure [`decide_mutation`], build the response. Non-pod kinds and operations other than CREATE
//! are allowed untouched. Dry-run requests are decided and patched like any other: the patch has no
//! side effects, so `kubectl --dry-run=server` shows exactly what a real CREATE would get.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::Response;
use teeguard_shared::Config;
use teeguard_shared::pod::PodName;

use super::{Reviewed, serve_review};
use crate::cluster::caches::Lookups;
use crate::decide::mutation::{
    Denial, DenyReason, MutationDecision, classify_pod, decide_mutation, namespace_exempt,
};
use crate::error::Result;
use crate::metrics::Outcome;
use crate::web::admission::{Operation, ReviewResponse};
use crate::web::admitted::AdmittedReview;
use crate::web::state::AppState;

/// Endpoint name in metrics and logs.
pub const ENDPOINT: &str = crate::metrics::endpoint::MUTATE;

/// Audit annotation keys (the API server prefixes them with the webhook's name).
pub mod audit {
    /// `patched`, `unchanged`, `skipped` or `denied`.
    pub const DECISION: &str = "decision";
    /// Why (a skip or deny code).
    pub const REASON: &str = "reason";
    /// The TEE kind of the VMI (`tdx`, `sev`, `sev_es`).
    pub const TEE_KIND: &str = "tee-kind";
    /// The extended resource requested.
    pub const RESOURCE: &str = "resource";
}

/// The axum handler.
pub async fn handle(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let s = &state;
    serve_review(s, ENDPOINT, req, |body| async move {
        review_mutation(&body, &s.caches, &s.config).await
    })
    .await
}

/// Decide one mutating review from its raw body: the same code serves HTTPS and the offline
/// `review` command. Errors are malformed reviews (HTTP 400).
pub async fn review_mutation<L: Lookups>(
    body: &[u8],
    lookups: &L,
    config: &Config,
) -> Result<Reviewed> {
    let mut review = AdmittedReview::parse(body)?;
    if review.request.operation != Operation::Create || !review.request.is_resource("", "pods") {
        return Ok(Reviewed {
            response: ReviewResponse::allow(review.request.uid)
                .audit(audit::DECISION, "skipped")
                .audit(audit::REASON, "not-pod-create"),
            outcome: Outcome::Allowed,
        });
    }
    let pod = review.pod()?;
    let req = review.request;
    let decision = match classify_pod(&pod) {
        Err(skip) => MutationDecision::Skip(skip),
        Ok(vmi_ref) => match lookups.namespace_labels(&vmi_ref.namespace).await {
            Err(e) => MutationDecision::Deny(Denial {
                reason: DenyReason::NamespaceLookupFailed,
                message: format!(
                    "cannot look up namespace {} to check its {} label ({e}); KubeVirt will retry creating the pod",
                    vmi_ref.namespace,
                    teeguard_shared::names::EXEMPT_LABEL
                ),
            }),
            Ok(labels) => {
                let lookup = if namespace_exempt(labels.as_ref()) {
                    None
                } else {
                    Some(lookups.vmi(&vmi_ref).await)
                };
                decide_mutation(&pod, lookup.as_ref(), labels.as_ref(), config)
            }
        },
    };
    let pod_name = PodName(&pod);
    Ok(respond(req.uid, pod_name, req.dry_run, decision))
}

fn respond(
    uid: String,
    pod_name: PodName<'_>,
    dry_run: bool,
    decision: MutationDecision,
) -> Reviewed {
    match decision {
        MutationDecision::Skip(reason) => {
            tracing::debug!(
                uid,
                pod = %pod_name,
                reason = reason.code(),
                "pod left untouched"
            );
            Reviewed {
                response: ReviewResponse::allow(uid)
                    .audit(audit::DECISION, "skipped")
                    .audit(audit::REASON, reason.code()),
                outcome: Outcome::Allowed,
            }
        }
        MutationDecision::Inject(inj) => {
            let patched = !inj.patch.0.is_empty();
            let base = ReviewResponse::allow(uid)
                .audit(audit::TEE_KIND, inj.kind.kernel_name())
                .audit(audit::RESOURCE, inj.resource.clone());
            let response = if patched {
                let uid = base.uid.clone();
                match base.with_patch(&inj.patch) {
                    Ok(r) => r.audit(audit::DECISION, "patched"),
                    // Serialising a patch of strings and maps cannot fail; refuse rather than
                    // admit a TEE pod without its key request if it ever does.
                    Err(e) => {
                        tracing::error!(pod = %pod_name, error = %e, "cannot serialise the patch");
                        return Reviewed {
                            response: ReviewResponse::deny(
                                uid,
                                500,
                                format!(
                                    "teeguard cannot serialise the patch for pod {pod_name}: {e}"
                                ),
                            ),
                            outcome: Outcome::Denied,
                        };
                    }
                }
            } else {
                base.audit(audit::DECISION, "unchanged")
                    .audit(audit::REASON, "already-injected")
            };
            tracing::debug!(
                pod = %pod_name,
                vmi = %inj.vmi,
                kind = %inj.kind,
                resource = inj.resource,
                patched,
                dry_run,
                "TEE key request injected"
            );
            Reviewed {
                response,
                outcome: if patched {
                    Outcome::Patched
                } else {
                    Outcome::Allowed
                },
            }
        }
        MutationDecision::Deny(d) => {
            tracing::info!(
                pod = %pod_name,
                reason = d.reason.code(),
                retryable = d.reason.retryable(),
                message = d.message,
                "pod denied"
            );
            Reviewed {
                response: ReviewResponse::deny(uid, 403, d.message)
                    .audit(audit::DECISION, "denied")
                    .audit(audit::REASON, d.reason.code()),
                outcome: Outcome::Denied,
            }
        }
    }
}
