//! The NRI plugin's decisions: the container's limit from the agent's pod cache (or one GET for a pod
//! the cache does not know yet whose limit needs it: annotated, holding a prepared claim, or any pod in
//! strict mode) and the claims the DRA driver prepared, the host facts the poll loop keeps current,
//! metrics, logs and Events.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt as _;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client};
use teeguard_shared::config::ResourcesConfig;
use tokio::sync::watch;

use crate::cluster::cached::{CachedPod, runtime_uid};
use crate::cluster::events::{EventSink, PodRef, REASON_KIND_UNAVAILABLE, REASON_MISMATCH};
use crate::cluster::watch::ExemptNamespaces;
use crate::decide::claimed::ClaimedKeys;
use crate::decide::enforcing::{HostFacts, unavailable_note};
use crate::decide::limits::{self, ContainerLimit, PodFacts, Policy};
use crate::metrics::Metrics;
use crate::runtime::plugin::{Answer, Containers, Decision};
use crate::runtime::wire::CreateContainer;

const MECHANISM: &str = "nri";

/// Decides container limits for the NRI plugin.
#[derive(Clone)]
pub struct NriContainers {
    /// The node's pods, as the agent's watch caches them.
    pub pods: Store<CachedPod>,
    /// For pods the cache does not know yet.
    pub client: Option<Client>,
    /// What the poll loop knows about the host.
    pub host: watch::Receiver<HostFacts>,
    /// Resource names.
    pub resources: Arc<ResourcesConfig>,
    /// Strict mode.
    pub strict: bool,
    /// Namespaces labelled exempt (strict mode leaves their pods alone).
    pub exempt_namespaces: ExemptNamespaces,
    /// The claims the DRA driver prepared (DRA mode; the kubelet prepares a pod's claims before
    /// it creates its containers).
    pub claims: watch::Receiver<Arc<ClaimedKeys>>,
    /// Metrics.
    pub metrics: Metrics,
    /// Warning Events.
    pub events: EventSink,
    /// The last container given no line for a kind without capacity here (the `Enforcing` condition).
    pub unavailable: watch::Sender<Option<String>>,
}

impl std::fmt::Debug for NriContainers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NriContainers")
            .field("strict", &self.strict)
            .finish_non_exhaustive()
    }
}

impl NriContainers {
    fn cached(&self, req: &CreateContainer) -> Option<Pod> {
        let key = ObjectRef::new(&req.pod_name).within(&req.pod_namespace);
        let cached = self.pods.get(&key)?;
        let pod = cached.to_pod();
        (pod.metadata.uid.as_deref() == Some(req.pod_uid.as_str())).then_some(pod)
    }

    /// Decide with `decide(facts, policy)` (`None` when no limit can be set on this host).
    fn with_facts<T>(
        &self,
        req: &CreateContainer,
        pod: Option<&Pod>,
        decide: impl FnOnce(PodFacts<'_>, Policy<'_>) -> T,
    ) -> Option<T> {
        let host = self.host.borrow().clone();
        if !host.limits_possible() {
            return None;
        }
        let claims = self.claims.borrow().clone();
        let facts = PodFacts {
            pod,
            annotations: &req.annotations,
            namespace_exempt: self.exempt_namespaces.contains(&req.pod_namespace),
            claimed: &claims,
        };
        let policy = Policy {
            resources: &self.resources,
            host_kinds: &host.kinds,
            strict: self.strict,
        };
        Some(decide(facts, policy))
    }

    /// Strict mode's zero for the container of the cached `pod` unless its namespace is labelled
    /// exempt ([`limits::namespace_zero`]); none out of strict mode (nothing to decide then).
    fn namespace_zero(&self, req: &CreateContainer, pod: &Pod) -> Option<String> {
        if !self.strict {
            return None;
        }
        self.with_facts(req, Some(pod), |facts, policy| {
            limits::namespace_zero(facts, &req.container_name, policy)
        })
        .flatten()
        .map(|limit| limit.to_string())
    }

    /// The answer for a container of `pod` (`None`: unknown, its annotation is all there is).
    fn decision(&self, req: &CreateContainer, pod: Option<&Pod>) -> Decision {
        Decision {
            value: self.answer(req, pod),
            zero: pod.and_then(|pod| self.namespace_zero(req, pod)),
        }
    }

    /// The value to answer, with metrics, logs and Events.
    fn answer(&self, req: &CreateContainer, pod: Option<&Pod>) -> Option<String> {
        self.with_facts(req, pod, |facts, policy| {
            self.answer_with(req, facts, policy)
        })
        .flatten()
    }

    fn answer_with(
        &self,
        req: &CreateContainer,
        facts: PodFacts<'_>,
        policy: Policy<'_>,
    ) -> Option<String> {
        let decision = limits::container_limit(facts, &req.container_name, policy);
        let pod_name = format!("{}/{}", req.pod_namespace, req.pod_name);
        let missing = limits::unavailable_kinds(facts, &req.container_name, policy);
        if !missing.is_empty() {
            let note = unavailable_note(
                &pod_name,
                Some(&req.container_name),
                &missing,
                policy.host_kinds,
            );
            tracing::warn!(pod = %pod_name, container = %req.container_name, "{note}");
            self.events.warn(
                PodRef {
                    namespace: req.pod_namespace.clone(),
                    name: req.pod_name.clone(),
                    uid: req.pod_uid.clone(),
                },
                REASON_KIND_UNAVAILABLE,
                note.clone(),
            );
            self.unavailable.send_replace(Some(format!("last: {note}")));
        }
        let ContainerLimit::Set { limit, mismatch } = decision else {
            return None;
        };
        if let Some(m) = mismatch {
            self.metrics.limit_mismatch(MECHANISM);
            tracing::warn!(pod = %pod_name, container = %req.container_name, applied = %limit, "{m}");
            self.events.warn(
                PodRef {
                    namespace: req.pod_namespace.clone(),
                    name: req.pod_name.clone(),
                    uid: req.pod_uid.clone(),
                },
                REASON_MISMATCH,
                format!(
                    "container {}: {m}; misc.max {limit} applied from the pod's requests",
                    req.container_name
                ),
            );
        }
        self.metrics.limit_applied(MECHANISM, limit.kind);
        tracing::info!(pod = %pod_name, container = %req.container_name, limit = %limit, "misc.max set through NRI");
        Some(limit.to_string())
    }
}

/// Longest the plugin waits for the first scan and pod list before it registers anyway.
pub const READY_WAIT: Duration = Duration::from_secs(10);

impl Containers for NriContainers {
    fn ready(&self) -> BoxFuture<'static, ()> {
        let (mut host, pods) = (self.host.clone(), self.pods.clone());
        let namespaces = self.exempt_namespaces.clone();
        async move {
            // Strict mode: the exempt namespaces too, so `Synchronize` zeroes and lifts rightly.
            let all = async {
                let _ = host.changed().await;
                let _ = pods.wait_until_ready().await;
                namespaces.listed().await;
            };
            if tokio::time::timeout(READY_WAIT, all).await.is_err() {
                tracing::warn!(
                    "registering with the runtime before the first scan and the pod (and, strict, namespace) lists: containers that already run get no limit now"
                );
            }
        }
        .boxed()
    }

    fn decide(&self, req: &CreateContainer) -> Answer {
        if !self.host.borrow().limits_possible() {
            return Answer::Now(Decision::default());
        }
        match self.cached(req) {
            Some(pod) => Answer::Now(self.decision(req, Some(&pod))),
            // Worth one GET: a pod admitted with teeguard's annotation, one holding a claim the
            // driver prepared, or any pod in strict mode (whether it gets the zero depends on its
            // requests and labels, which only the pod has).
            None if self.client.is_some()
                && (self.strict
                    || limits::has_limit_annotation(&req.annotations)
                    || self.claims.borrow().holds_for(&req.pod_uid)) =>
            {
                Answer::Lookup
            }
            None => Answer::Now(self.decision(req, None)),
        }
    }

    fn exempt(&self, namespace: &str) -> bool {
        self.exempt_namespaces.labelled(namespace)
    }

    fn exempt_changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.strict
            .then(|| self.exempt_namespaces.changes())
            .flatten()
    }

    fn decide_after_lookup(&self, req: CreateContainer) -> BoxFuture<'static, Decision> {
        let this = self.clone();
        async move {
            let pod = match &this.client {
                Some(client) => {
                    let api: Api<Pod> = Api::namespaced(client.clone(), &req.pod_namespace);
                    match api.get_opt(&req.pod_name).await {
                        Ok(pod) => pod.filter(|p| runtime_uid(p) == Some(req.pod_uid.as_str())),
                        Err(e) => {
                            this.metrics.api_error("get pod for its key limit");
                            tracing::warn!(pod = %format!("{}/{}", req.pod_namespace, req.pod_name), error = %e, "cannot look the pod up; applying its annotation as admitted");
                            None
                        }
                    }
                }
                None => None,
            };
            this.decision(&req, pod.as_ref())
        }
        .boxed()
    }
}

/// The annotations teeguard reads from a pod (for tests and the cgroup writer).
pub fn limit_annotations(pod: &Pod) -> BTreeMap<String, String> {
    pod.metadata
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| k.starts_with(teeguard_shared::names::MISC_MAX_ANNOTATION_PREFIX))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}
