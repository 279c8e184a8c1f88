//! Shared reservations through the API server: the node's `TeeReservation` is read from the watch
//! cache and written with a `resourceVersion` precondition (`PUT`, or `create` for the first), so
//! replicas racing for a node's last key serialize in etcd. On 409 Conflict (or AlreadyExists) the
//! object is read again with a GET and the decision made again; the decisions themselves are
//! [`crate::decide::reservations`].
//!
//! Only admitted TEE bindings (and pod CREATEs with `spec.nodeName`) come here: one cache read and one
//! write each, all bounded together by the API timeout. When the API server cannot be reached the
//! caller decides with its own ledger and the stale-report policy ([`Outcome::Unavailable`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Api;
use kube::api::PostParams;
use teeguard_shared::pod::KeyRequests;
use teeguard_shared::reservation::{KeyReservation, TeeReservation, TeeReservationSpec};

use super::caches::Caches;
use crate::decide::ledger::{Ledger, ReportMark};
use crate::decide::reservations::{Liveness, Step, held, live, step};
use crate::decide::validation::Decision;
use crate::metrics::{Metrics, SharedResult};

/// Writes tried per admission before giving up (each lost race means another pod got a key, so a
/// node with few keys decides within two or three).
pub const MAX_ATTEMPTS: u32 = 8;

/// What the shared step decided.
#[derive(Debug)]
pub enum Outcome {
    /// The pod's keys are in the node's `TeeReservation`.
    Reserved,
    /// The pod already had an entry (a retried binding).
    AlreadyHeld,
    /// With every replica's reservations there is no key for the pod: this decision instead.
    Refused(Decision),
    /// The API server could not be reached (or kept conflicting): why.
    Unavailable(String),
}

/// One admission's shared step.
#[derive(Debug)]
pub struct Request<'a> {
    /// The node.
    pub node: &'a str,
    /// The pod's entry.
    pub candidate: KeyReservation,
    /// The node report's `countedPods`.
    pub counted_pods: &'a [String],
    /// This replica's ledger entries on the node (others than the pod).
    pub local: Vec<(String, KeyRequests)>,
    /// This replica's ledger: an entry of a pod whose reservations ended (a report counted it, or it
    /// was deleted) holds nothing, whichever replica wrote it.
    pub ledger: &'a Ledger,
}

/// The shared reservations of every replica. Cheap to clone.
#[derive(Clone)]
pub struct SharedReservations {
    api: Api<TeeReservation>,
    nodes: Api<Node>,
    caches: Caches,
    ttl: Duration,
    api_timeout: Duration,
    replica: String,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for SharedReservations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedReservations")
            .field("replica", &self.replica)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

enum WriteError {
    Conflict,
    Other(String),
}

impl SharedReservations {
    /// Shared reservations through `caches`' client and its `TeeReservation` cache.
    pub fn new(
        caches: Caches,
        ttl: Duration,
        api_timeout: Duration,
        replica: String,
        metrics: Arc<Metrics>,
    ) -> SharedReservations {
        let client = caches.client().clone();
        SharedReservations {
            api: Api::all(client.clone()),
            nodes: Api::all(client),
            caches,
            ttl,
            api_timeout,
            replica,
            metrics,
        }
    }

    /// The replica name written into entries.
    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// Decide with every replica's reservations and, when admitted, record the pod's. `decide` makes
    /// the node decision from the keys held by other pods.
    pub async fn reserve(
        &self,
        req: Request<'_>,
        decide: impl Fn(&KeyRequests) -> Decision,
    ) -> Outcome {
        let started = Instant::now();
        let outcome = tokio::time::timeout(self.api_timeout, self.attempts(&req, &decide))
            .await
            .unwrap_or_else(|_| {
                Outcome::Unavailable(format!(
                    "the API server did not answer within {:?}",
                    self.api_timeout
                ))
            });
        self.metrics.observe_shared_reservation(started.elapsed());
        self.metrics.shared_reservation(match &outcome {
            Outcome::Reserved => SharedResult::Reserved,
            Outcome::AlreadyHeld => SharedResult::AlreadyHeld,
            Outcome::Refused(_) => SharedResult::Refused,
            Outcome::Unavailable(_) => SharedResult::Fallback,
        });
        outcome
    }

    async fn attempts(
        &self,
        req: &Request<'_>,
        decide: &impl Fn(&KeyRequests) -> Decision,
    ) -> Outcome {
        let mut current = self.caches.reservations.get(req.node).map(|o| (*o).clone());
        for _ in 0..MAX_ATTEMPTS {
            let liveness = Liveness {
                mark: ReportMark {
                    counted_pods: req.counted_pods,
                },
                now: Timestamp::now(),
                ttl: self.ttl,
            };
            let entries = current
                .as_ref()
                .map_or(&[][..], |o| o.spec.reservations.as_slice());
            let mono = Instant::now();
            let gone =
                |e: &KeyReservation| req.ledger.has_ended(&e.pod_uid, mono) || self.pod_gone(e);
            let live_entries = live(entries, liveness, &gone);
            let held_keys = held(&live_entries, &req.local, &req.candidate.pod_uid);
            let decision = decide(&held_keys);
            let admits = decision.reserve;
            match step(live_entries, req.candidate.clone(), admits) {
                Step::AlreadyHeld => return Outcome::AlreadyHeld,
                Step::Refused => return Outcome::Refused(decision),
                Step::Write(entries) => match self.write(req.node, current.as_ref(), entries).await
                {
                    Ok(()) => return Outcome::Reserved,
                    Err(WriteError::Other(e)) => return Outcome::Unavailable(e),
                    Err(WriteError::Conflict) => {
                        self.metrics.shared_reservation(SharedResult::Conflict);
                        tracing::debug!(
                            node = req.node,
                            "TeeReservation changed under us; reading it again"
                        );
                        current = match self.api.get_opt(req.node).await {
                            Ok(o) => o,
                            Err(e) => {
                                return Outcome::Unavailable(format!(
                                    "reading TeeReservation {}: {e}",
                                    req.node
                                ));
                            }
                        };
                    }
                },
            }
        }
        Outcome::Unavailable(format!(
            "TeeReservation {} kept changing ({MAX_ATTEMPTS} conflicting writes)",
            req.node
        ))
    }

    /// A virt-launcher pod that is gone: its deletion was seen, or the cache does not have it although
    /// it was admitted long enough ago that the cache would (a deleted pod's keys are released).
    fn pod_gone(&self, e: &KeyReservation) -> bool {
        let Some((ns, name)) = e.pod.split_once('/') else {
            return false;
        };
        let pods = &self.caches.launcher_pods;
        if !pods.is_ready() {
            return false;
        }
        let absent = pods
            .get_namespaced(ns, name)
            .is_none_or(|p| p.uid.as_deref() != Some(e.pod_uid.as_str()));
        let settled = Timestamp::now()
            .duration_since(e.admitted_at.0)
            .is_positive_and_at_least(POD_CACHE_GRACE);
        absent && (settled || pods.was_removed(ns, name))
    }

    async fn write(
        &self,
        node: &str,
        current: Option<&TeeReservation>,
        entries: Vec<KeyReservation>,
    ) -> Result<(), WriteError> {
        let result = match current {
            Some(obj) => {
                let mut obj = obj.clone();
                obj.spec.reservations = entries;
                // The object's resourceVersion is the precondition: a stale one gets 409.
                self.api
                    .replace(node, &PostParams::default(), &obj)
                    .await
                    .map(drop)
            }
            None => {
                let owner = match self.nodes.get_metadata_opt(node).await {
                    Ok(Some(n)) => n.metadata.uid.map(|uid| OwnerReference {
                        api_version: "v1".into(),
                        kind: "Node".into(),
                        name: node.to_string(),
                        uid,
                        ..OwnerReference::default()
                    }),
                    Ok(None) => None,
                    Err(e) => return Err(WriteError::Other(format!("reading Node {node}: {e}"))),
                };
                let obj = TeeReservation {
                    metadata: ObjectMeta {
                        name: Some(node.to_string()),
                        owner_references: owner.map(|o| vec![o]),
                        ..ObjectMeta::default()
                    },
                    spec: TeeReservationSpec {
                        node_name: node.to_string(),
                        reservations: entries,
                    },
                };
                self.api
                    .create(&PostParams::default(), &obj)
                    .await
                    .map(drop)
            }
        };
        match result {
            Ok(()) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => Err(WriteError::Conflict),
            Err(e) => Err(WriteError::Other(format!(
                "writing TeeReservation {node}: {e}"
            ))),
        }
    }
}

/// How long after an admission a pod missing from the virt-launcher cache counts as deleted (the
/// watch delivers a new pod within milliseconds; this covers a slow one).
pub const POD_CACHE_GRACE: Duration = Duration::from_secs(5);

trait SpanExt {
    fn is_positive_and_at_least(&self, d: Duration) -> bool;
}

impl SpanExt for jiff::SignedDuration {
    fn is_positive_and_at_least(&self, d: Duration) -> bool {
        Duration::try_from(*self).is_ok_and(|s| s >= d)
    }
}
