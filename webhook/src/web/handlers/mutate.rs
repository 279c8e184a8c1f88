//! `POST /mutate`: the mutating webhook for pod CREATE.
//!
//! Envelope only: parse the review once, look up the namespace and VMI (through [`Lookups`]), call
//! the pure [`decide_mutation`], build the response. A pod that is no KubeVirt pod but runs in a TEE
//! RuntimeClass (`admission.teeRuntimeClasses`) is decided by the pure [`decide_runtime_class`]
//! instead (only its namespace is looked up). Non-pod kinds and operations other than CREATE are
//! allowed untouched. Dry-run requests are decided and patched like any other: the patch has no side
//! effects, so `kubectl --dry-run=server` shows exactly what a real CREATE would get.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::Response;
use k8s_openapi::api::core::v1::Pod;
use teeguard_shared::pod::PodName;
use teeguard_shared::{Config, TeeKind};

use super::{Reviewed, serve_review};
use crate::cluster::caches::Lookups;
use crate::decide::mutation::runtime_class::{
    RuntimeClassDecision, RuntimeClassSkip, decide_runtime_class, tee_runtime_class,
};
use crate::decide::mutation::{
    Denial, DenyReason, MutationDecision, SkipReason, classify_pod, decide_mutation, is_exempt,
};
use crate::error::Result;
use crate::metrics::{Metrics, Outcome, RuntimeClassResult};
use crate::web::admission::{Operation, ReviewResponse, audit};
use crate::web::admitted::AdmittedReview;
use crate::web::state::AppState;

/// Endpoint name in metrics and logs.
pub const ENDPOINT: &str = crate::metrics::endpoint::MUTATE;

/// A patch that could not be serialised. Serialising a patch of strings and maps cannot fail;
/// refuse rather than admit a TEE pod without its key request if it ever does.
fn unpatchable(uid: String, pod: &dyn std::fmt::Display, e: &dyn std::fmt::Display) -> Reviewed {
    tracing::error!(pod = %pod, error = %e, "cannot serialise the patch");
    Reviewed {
        response: ReviewResponse::deny(
            uid,
            500,
            format!("teeguard cannot serialise the patch for pod {pod}: {e}"),
        ),
        outcome: Outcome::Denied,
    }
}

/// The axum handler.
pub async fn handle(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let s = &state;
    serve_review(s, ENDPOINT, req, |body| async move {
        review_mutation(&body, &s.caches, &s.config, Some(&s.metrics)).await
    })
    .await
}

/// Decide one mutating review from its raw body: the same code serves HTTPS and the offline
/// `review` command. Decisions on TEE RuntimeClass pods are counted in `metrics` (`None` offline).
/// Errors are malformed reviews (HTTP 400).
pub async fn review_mutation<L: Lookups>(
    body: &[u8],
    lookups: &L,
    config: &Config,
    metrics: Option<&Metrics>,
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
        Err(SkipReason::NotKubeVirt) => match tee_runtime_class(&pod, config) {
            Some(tee) => {
                let decided = runtime_class_decision(&pod, lookups, config).await;
                let rc = RuntimeClassReview {
                    uid: req.uid,
                    dry_run: req.dry_run,
                    class: tee.0,
                    kind: tee.1,
                    metrics,
                };
                return Ok(respond_runtime_class(rc, PodName(&pod), decided));
            }
            None => MutationDecision::Skip(SkipReason::NotKubeVirt),
        },
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
                let lookup = if is_exempt(labels.as_ref()) {
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

/// Decide a pod of a TEE RuntimeClass: look up its namespace (the exemption label), then the pure
/// decision; a failed lookup is the refusal's message.
async fn runtime_class_decision<L: Lookups>(
    pod: &Pod,
    lookups: &L,
    config: &Config,
) -> std::result::Result<RuntimeClassDecision, String> {
    let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
    match lookups.namespace_labels(ns).await {
        Ok(labels) => Ok(decide_runtime_class(pod, labels.as_ref(), config)),
        Err(e) => Err(format!(
            "cannot look up namespace {ns} to check its {} label ({e}), so teeguard cannot decide whether \
             this pod of a TEE RuntimeClass gets its TEE key request; create the pod again",
            teeguard_shared::names::EXEMPT_LABEL
        )),
    }
}

/// What the response to a TEE RuntimeClass pod carries besides its decision.
struct RuntimeClassReview<'a> {
    uid: String,
    dry_run: bool,
    /// The pod's (listed) RuntimeClass and its kind.
    class: &'a str,
    kind: TeeKind,
    metrics: Option<&'a Metrics>,
}

impl RuntimeClassReview<'_> {
    fn count(&self, result: RuntimeClassResult) {
        if let Some(m) = self.metrics {
            m.runtime_class_mutation(self.kind.kernel_name(), result);
        }
    }

    fn allow(&self) -> ReviewResponse {
        ReviewResponse::allow(self.uid.clone())
            .audit(audit::RUNTIME_CLASS, self.class.to_string())
            .audit(audit::TEE_KIND, self.kind.kernel_name())
    }
}

fn respond_runtime_class(
    rc: RuntimeClassReview<'_>,
    pod_name: PodName<'_>,
    decided: std::result::Result<RuntimeClassDecision, String>,
) -> Reviewed {
    let decision = match decided {
        Ok(d) => d,
        Err(message) => {
            tracing::info!(pod = %pod_name, runtime_class = rc.class, message, "pod denied");
            rc.count(RuntimeClassResult::Denied);
            return Reviewed {
                response: ReviewResponse::deny(rc.uid, 403, message)
                    .audit(audit::DECISION, "denied")
                    .audit(audit::REASON, DenyReason::NamespaceLookupFailed.code()),
                outcome: Outcome::Denied,
            };
        }
    };
    match decision {
        RuntimeClassDecision::Inject(inj) => {
            let response = match rc
                .allow()
                .audit(audit::RESOURCE, inj.resource.clone())
                .with_patch(&inj.patch)
            {
                Ok(r) => r.audit(audit::DECISION, "patched"),
                Err(e) => {
                    rc.count(RuntimeClassResult::Denied);
                    return unpatchable(rc.uid, &pod_name, &e);
                }
            };
            tracing::debug!(
                pod = %pod_name,
                runtime_class = inj.runtime_class,
                kind = %inj.kind,
                resource = inj.resource,
                keys = inj.keys,
                container = inj.container,
                dry_run = rc.dry_run,
                "TEE key request added to the first container of a TEE RuntimeClass pod"
            );
            rc.count(RuntimeClassResult::Patched);
            Reviewed {
                response,
                outcome: Outcome::Patched,
            }
        }
        RuntimeClassDecision::OverheadKey(o) => {
            tracing::debug!(
                pod = %pod_name,
                runtime_class = o.runtime_class,
                resources = ?o.resources,
                "TEE RuntimeClass pod with a key in its overhead left untouched, with a warning"
            );
            rc.count(RuntimeClassResult::OverheadKey);
            Reviewed {
                response: rc
                    .allow()
                    .audit(audit::DECISION, "skipped")
                    .audit(audit::REASON, "key-in-overhead")
                    .warn(o.warning),
                outcome: Outcome::Allowed,
            }
        }
        RuntimeClassDecision::Skip(skip) => {
            tracing::debug!(
                pod = %pod_name,
                runtime_class = rc.class,
                reason = skip.code(),
                "TEE RuntimeClass pod left untouched"
            );
            rc.count(match skip {
                RuntimeClassSkip::KeyAlreadyRequested => RuntimeClassResult::AlreadyRequested,
                _ => RuntimeClassResult::Skipped,
            });
            Reviewed {
                response: rc
                    .allow()
                    .audit(audit::DECISION, "skipped")
                    .audit(audit::REASON, skip.code()),
                outcome: Outcome::Allowed,
            }
        }
    }
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
                    Err(e) => return unpatchable(uid, &pod_name, &e),
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
