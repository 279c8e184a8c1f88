//! In-memory caches of the cluster objects reviews need, so the hot path makes no API call.
//!
//! Every cache is fed by a kube `watcher` (jittered backoff capped at 5 s) started through
//! [`CacheBuilder`], which strips `managedFields` (and `kubectl`'s last-applied annotation) from every
//! object, keeps an object-count gauge and registers the watch for [`Caches::wait_synced`].
//!
//! Two kinds of watch:
//! - lookups, each a [`NamedStore`] (by namespace and name: borrowed lookups): VMIs and Namespace
//!   labels (mutation and validation) and virt-launcher pods (label `kubevirt.io=virt-launcher`,
//!   reduced to [`CachedLauncherPod`], for bindings); VMIs and launcher pods also apply to the
//!   admission index (a hold ends when its pod is deleted; a VMI waits for a key);
//! - the admission state only, applied to the [`KeyIndex`] and kept nowhere else: Nodes (labels),
//!   `TeeCapacity` reports, `TeeReservation`s and the agents' heartbeat Leases (in the webhook's
//!   namespace: a report's age is that of the newer of its heartbeat and its agent's Lease renewal).
//!
//! Memory: everything not read is dropped when the object arrives (see [`slim_vmi`],
//! [`CachedLauncherPod`]; the index keeps a report's figures, a Node's labels, a Lease's renewal).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::core::PartialObjectMeta;
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use teeguard_shared::reservation::TeeReservation;
use teeguard_shared::{TeeCapacity, VirtualMachineInstance, names};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::index::KeyIndex;
use crate::decide::index::{PodState, VmiState};
use crate::decide::mutation::{VmiLookup, VmiRef};
use crate::decide::queue;
use crate::metrics::{Cache, LookupResult, Metrics};
use crate::pods::{CachedLauncherPod, LauncherPod};

mod store;
#[cfg(test)]
mod tests;

pub use store::{CacheBuilder, NamedStore, Observer};

/// A virt-launcher pod's node, end and VMI, for the index (a hold ends when its pod is deleted or
/// ended; a VMI with a pod waits no more).
impl Observer<CachedLauncherPod> for KeyIndex {
    fn stored(&self, pod: &CachedLauncherPod) {
        let Some(uid) = pod.uid.as_deref() else {
            return;
        };
        let key = |list: &[(String, _)]| list.iter().any(|(n, _)| self.is_key_resource(n));
        let keys = key(&pod.overhead)
            || pod
                .containers
                .iter()
                .chain(pod.init_containers.iter())
                .any(|c| key(&c.requests) || key(&c.limits));
        let vmi = pod
            .owner
            .as_ref()
            .filter(|o| o.kind == "VirtualMachineInstance")
            .map(|o| o.uid.clone());
        let state = PodState {
            node: pod.node_name.clone().filter(|n| !n.is_empty()),
            ended: pod.ended,
            keys,
            vmi,
        };
        self.update(|ix, now| ix.apply_pod(uid, Some(state), now));
    }

    fn removed(&self, pod: &CachedLauncherPod) {
        if let Some(uid) = pod.uid.as_deref() {
            self.update(|ix, now| ix.apply_pod(uid, None, now));
        }
    }
}

/// A VMI's phase and whether it waits for a key, for the index.
impl Observer<VirtualMachineInstance> for KeyIndex {
    fn stored(&self, vmi: &VirtualMachineInstance) {
        let Some(uid) = vmi.metadata.uid.as_deref() else {
            return;
        };
        let state = VmiState {
            pending: queue::pending(vmi),
            waiting: queue::waiting(vmi),
        };
        self.update(|ix, now| ix.apply_vmi(uid, Some(state), now));
    }

    fn removed(&self, vmi: &VirtualMachineInstance) {
        if let Some(uid) = vmi.metadata.uid.as_deref() {
            self.update(|ix, now| ix.apply_vmi(uid, None, now));
        }
    }
}

/// What looking a pod up gave.
#[derive(Clone, Debug)]
pub enum PodLookup {
    /// Found (in the cache or by a GET); only metadata and container resources are filled in.
    Found(Arc<Pod>),
    /// Not cached and the API server says 404 (or the pod of that name has another UID now).
    NotFound,
    /// The API server could not be asked (the message says why).
    Failed(String),
}

/// An object's labels, as the namespace cache keeps them.
pub type Labels = BTreeMap<String, String>;

const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Where a review looks up the objects it needs. The server answers from its caches (with one GET
/// on a miss); the offline `review` command answers from files. Both run the same decision code.
pub trait Lookups: Send + Sync {
    /// Labels of a namespace: `Ok(None)` if it does not exist, `Err` if it could not be asked.
    fn namespace_labels(
        &self,
        namespace: &str,
    ) -> impl Future<Output = crate::error::Result<Option<BTreeMap<String, String>>>> + Send;

    /// The admission state the decisions read (nodes, reports, holds, waiting VMIs).
    fn index(&self) -> &KeyIndex;

    /// Whether the nodes' labels are known (the offline `review` without node files knows only the
    /// reported nodes: each is then a candidate, whatever the pod's node selector).
    fn node_labels_known(&self) -> bool {
        true
    }

    /// The VMI a pod belongs to.
    fn vmi(&self, vmi: &VmiRef) -> impl Future<Output = VmiLookup> + Send;

    /// A pod by name for a binding (`uid`: the Binding's, empty if unknown): cache first, one GET on a
    /// miss or when the cached pod has another UID.
    fn launcher_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> impl Future<Output = PodLookup> + Send;
}

/// What teeguard keeps of a namespace's labels: the two it reads (exemption and mode). Namespaces carry
/// many others (`kubernetes.io/metadata.name`, Pod Security levels, mesh and team labels) that every
/// review would otherwise copy out of the cache.
pub fn namespace_labels(labels: Option<Labels>) -> Labels {
    let mut labels = labels.unwrap_or_default();
    labels.retain(|k, _| k == names::EXEMPT_LABEL || k == names::MODE_LABEL);
    labels
}

/// What the VMI cache keeps of a VMI: identity, its deletion, the exemption label, the controller
/// owner and `launchSecurity` (the type reads nothing else of the spec).
pub fn slim_vmi(vmi: &mut VirtualMachineInstance) {
    let old = std::mem::take(&mut vmi.metadata);
    let exempt = old.labels.and_then(|l| {
        let value = l.get(names::EXEMPT_LABEL)?.clone();
        Some(BTreeMap::from([(names::EXEMPT_LABEL.to_string(), value)]))
    });
    let owners: Vec<_> = old
        .owner_references
        .into_iter()
        .flatten()
        .filter(|o| o.controller == Some(true))
        .collect();
    vmi.metadata = k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
        name: old.name,
        namespace: old.namespace,
        uid: old.uid,
        resource_version: old.resource_version,
        deletion_timestamp: old.deletion_timestamp,
        labels: exempt,
        owner_references: (!owners.is_empty()).then_some(owners),
        ..Default::default()
    };
    // Where its pod may go, and why it has none, matter only while it waits on teeguard.
    if queue::waiting(vmi).is_some() {
        if let Some(status) = vmi.status.as_mut() {
            status.conditions.retain(|c| c.type_ == queue::SYNCHRONIZED);
        }
    } else {
        vmi.spec.node_selector = None;
        vmi.spec.affinity = None;
        if let Some(status) = vmi.status.as_mut() {
            status.conditions = Vec::new();
        }
    }
}

/// How long a mutation waits for a VMI that is not cached yet to arrive through the watch before it
/// asks the API server (well inside the webhook's timeout and `--api-timeout`).
pub const VMI_WATCH_WAIT: Duration = Duration::from_millis(250);

/// How long a binding waits for its launcher pod, not cached yet, to arrive through the watch before
/// it asks the API server: the scheduler binds a pod milliseconds after its creation, and the watch
/// usually delivers it within them (it was 0.23 GETs per VM at 5 000 nodes without the wait).
pub const POD_WATCH_WAIT: Duration = Duration::from_millis(250);

/// The running reflector tasks; they end when the shutdown token is cancelled.
#[derive(Debug)]
pub struct CacheTasks {
    tasks: JoinSet<()>,
}

impl CacheTasks {
    /// Wait for every reflector task to end.
    pub async fn join(mut self) {
        while self.tasks.join_next().await.is_some() {}
    }
}

/// Every cache the webhook keeps, plus the client for GETs on a miss. Cheap to clone.
#[derive(Clone)]
pub struct Caches {
    client: Client,
    metrics: Arc<Metrics>,
    api_timeout: Duration,
    /// All VirtualMachineInstances (the few fields teeguard models), reduced by [`slim_vmi`].
    pub vmis: NamedStore<VirtualMachineInstance>,
    /// The labels of every Namespace, by name.
    pub namespaces: NamedStore<Labels>,
    /// Pods labelled `kubevirt.io=virt-launcher`, reduced to what a binding decision reads.
    pub launcher_pods: NamedStore<CachedLauncherPod>,
    /// The admission state (nodes, reports, holds, launcher pods, VMIs).
    pub index: KeyIndex,
    synced: Arc<tokio::sync::watch::Receiver<bool>>,
}

impl Debug for Caches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caches")
            .field("vmis", &self.vmis.len())
            .field("namespaces", &self.namespaces.len())
            .field("launcher_pods", &self.launcher_pods.len())
            .field("synced", &self.is_synced())
            .finish()
    }
}

impl Caches {
    /// Start every watch. `api_timeout` bounds the GET made on a cache miss. The VMI and
    /// virt-launcher pod caches, and the watches of Nodes, reports, Leases and `TeeReservation`s, apply
    /// to `index`, which is marked synced once every watch has listed.
    pub fn start(
        client: Client,
        metrics: Arc<Metrics>,
        api_timeout: Duration,
        index: KeyIndex,
        shutdown: CancellationToken,
    ) -> (Caches, CacheTasks) {
        let mut b = CacheBuilder::new(metrics.clone(), shutdown);
        let vmis = b.watch(
            Cache::Vmis,
            Api::<VirtualMachineInstance>::all(client.clone()),
            watcher::Config::default().any_semantic(),
            |mut v: VirtualMachineInstance| {
                slim_vmi(&mut v);
                v
            },
            Some(Arc::new(index.clone())),
        );
        let namespaces = b.watch(
            Cache::Namespaces,
            Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
            watcher::Config::default().any_semantic(),
            |n: PartialObjectMeta<Namespace>| namespace_labels(n.metadata.labels),
            None,
        );
        let launcher_pods = b.watch(
            Cache::LauncherPods,
            Api::<LauncherPod>::all(client.clone()),
            watcher::Config::default()
                .labels(&format!(
                    "{}={}",
                    names::KUBEVIRT_LABEL,
                    names::VIRT_LAUNCHER
                ))
                .any_semantic(),
            CachedLauncherPod::from,
            Some(Arc::new(index.clone())),
        );
        let sink = Arc::new(index.clone());
        b.watch_into(
            Cache::TeeCapacities,
            Api::<TeeCapacity>::all(client.clone()),
            watcher::Config::default().any_semantic(),
            sink.clone(),
        );
        b.watch_into(
            Cache::Nodes,
            Api::<PartialObjectMeta<Node>>::all(client.clone()),
            watcher::Config::default().any_semantic(),
            sink.clone(),
        );
        b.watch_into(
            Cache::Reservations,
            Api::<TeeReservation>::all(client.clone()),
            watcher::Config::default().any_semantic(),
            sink.clone(),
        );
        b.watch_into(
            Cache::AgentLeases,
            Api::<Lease>::namespaced(client.clone(), client.default_namespace()),
            watcher::Config::default()
                .labels(&format!("{}=true", names::AGENT_LEASE_LABEL))
                .any_semantic(),
            sink,
        );
        let (tasks, ready) = b.finish();
        let (tx, rx) = tokio::sync::watch::channel(false);
        let synced_index = index.clone();
        tokio::spawn(async move {
            futures::future::join_all(ready).await;
            synced_index.update(|ix, _| ix.set_synced());
            let _ = tx.send(true);
        });
        let caches = Caches {
            client,
            metrics,
            api_timeout,
            vmis,
            namespaces,
            launcher_pods,
            index,
            synced: Arc::new(rx),
        };
        (caches, tasks)
    }

    /// True once every cache has completed its initial list.
    pub fn is_synced(&self) -> bool {
        *self.synced.borrow()
    }

    /// Wait until every cache has completed its initial list.
    pub async fn wait_synced(&self) {
        let mut rx = (*self.synced).clone();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// A GET of what `action` names (`GET namespace a`), which `cache` misses, bounded by the API
    /// timeout and counted.
    async fn get_with_timeout<K, F>(
        &self,
        cache: Cache,
        action: impl FnOnce() -> String,
        fut: F,
    ) -> crate::error::Result<Option<K>>
    where
        F: Future<Output = kube::Result<Option<K>>>,
    {
        let got = crate::cluster::bounded(action, self.api_timeout, fut).await;
        let result = match &got {
            Ok(Some(_)) => LookupResult::ApiFound,
            Ok(None) => LookupResult::ApiNotFound,
            Err(_) => LookupResult::ApiError,
        };
        self.metrics.lookup(cache, result);
        got
    }

    /// The API fallback of [`Lookups::namespace_labels`] on a cache miss.
    async fn namespace_from_api(
        &self,
        namespace: &str,
    ) -> crate::error::Result<Option<BTreeMap<String, String>>> {
        let api = Api::<PartialObjectMeta<Namespace>>::all(self.client.clone());
        let what = || format!("GET namespace {namespace}");
        let got = self
            .get_with_timeout(Cache::Namespaces, what, api.get_opt(namespace))
            .await;
        if let Err(e) = &got {
            tracing::warn!(namespace, error = %e, "namespace not cached and the GET failed");
        }
        got.map(|o| o.map(|ns| namespace_labels(ns.metadata.labels)))
    }

    /// A VMI not cached yet: virt-controller creates it a moment before its pod, so the watch usually
    /// delivers it within milliseconds; wait for that (at most [`VMI_WATCH_WAIT`]) before the GET.
    async fn vmi_after_wait(
        &self,
        vmi: &VmiRef,
        same: impl Fn(&VirtualMachineInstance) -> bool,
    ) -> VmiLookup {
        if self.vmis.is_ready()
            && let Some(found) = self
                .vmis
                .wait_for(&vmi.namespace, &vmi.name, VMI_WATCH_WAIT, same)
                .await
        {
            self.metrics.lookup(Cache::Vmis, LookupResult::WatchHit);
            return VmiLookup::Found(found);
        }
        self.vmi_from_api(vmi).await
    }

    /// The API fallback of [`Lookups::vmi`] on a cache miss.
    async fn vmi_from_api(&self, vmi: &VmiRef) -> VmiLookup {
        let api = Api::<VirtualMachineInstance>::namespaced(self.client.clone(), &vmi.namespace);
        match self
            .get_with_timeout(
                Cache::Vmis,
                || format!("GET VMI {vmi}"),
                api.get_opt(&vmi.name),
            )
            .await
        {
            Ok(Some(mut found)) => {
                tracing::debug!(vmi = %vmi, "VMI not cached yet; found by GET");
                found.managed_fields_mut().clear();
                VmiLookup::Found(Arc::new(found))
            }
            Ok(None) => VmiLookup::NotFound,
            Err(e) => {
                tracing::warn!(vmi = %vmi, error = %e, "VMI not cached and the GET failed");
                VmiLookup::Failed(e.to_string())
            }
        }
    }

    /// A launcher pod not cached yet (or cached with another UID: a deleted predecessor): wait for the
    /// watch to deliver it (at most [`POD_WATCH_WAIT`]) before the GET.
    async fn launcher_pod_after_wait(&self, namespace: &str, name: &str, uid: &str) -> PodLookup {
        if self.launcher_pods.is_ready()
            && let Some(found) = self
                .launcher_pods
                .wait_for(namespace, name, POD_WATCH_WAIT, |p| {
                    uid.is_empty() || p.uid.as_deref() == Some(uid)
                })
                .await
        {
            self.metrics
                .lookup(Cache::LauncherPods, LookupResult::WatchHit);
            return PodLookup::Found(Arc::new(found.to_pod()));
        }
        self.launcher_pod_from_api(namespace, name, uid).await
    }

    /// The API fallback of [`Lookups::launcher_pod`] on a cache miss.
    async fn launcher_pod_from_api(&self, namespace: &str, name: &str, uid: &str) -> PodLookup {
        let api = Api::<LauncherPod>::namespaced(self.client.clone(), namespace);
        // A pod of that name with another UID (a deleted predecessor) is not the one asked for.
        let get = async {
            let got = api.get_opt(name).await?;
            Ok(got.filter(|p| uid.is_empty() || p.metadata.uid.as_deref() == Some(uid)))
        };
        let what = || format!("GET pod {namespace}/{name}");
        match self.get_with_timeout(Cache::LauncherPods, what, get).await {
            Ok(Some(found)) => {
                tracing::debug!(namespace, name, "pod not cached yet; found by GET");
                PodLookup::Found(Arc::new(CachedLauncherPod::from(found).to_pod()))
            }
            Ok(None) => PodLookup::NotFound,
            Err(e) => {
                tracing::warn!(namespace, name, error = %e, "pod not cached and the GET failed");
                PodLookup::Failed(e.to_string())
            }
        }
    }
}

impl Lookups for Caches {
    fn index(&self) -> &KeyIndex {
        &self.index
    }

    // A cache hit answers without awaiting anything; a miss awaits the API fallback boxed, so the
    // kube client's request future (several KB) is not inlined into every admission handler's
    // future, which the server allocates and moves on every review.

    async fn namespace_labels(
        &self,
        namespace: &str,
    ) -> crate::error::Result<Option<BTreeMap<String, String>>> {
        if let Some(labels) = self.namespaces.get(namespace) {
            self.metrics
                .lookup(Cache::Namespaces, LookupResult::CacheHit);
            return Ok(Some((*labels).clone()));
        }
        Box::pin(self.namespace_from_api(namespace)).await
    }

    async fn vmi(&self, vmi: &VmiRef) -> VmiLookup {
        // A cached VMI of the same name but another UID may be a deleted predecessor: not this one.
        let same = |found: &VirtualMachineInstance| {
            vmi.uid.is_empty() || found.metadata.uid.as_deref().unwrap_or("") == vmi.uid
        };
        if let Some(found) = self
            .vmis
            .get_namespaced(&vmi.namespace, &vmi.name)
            .filter(|f| same(f))
        {
            self.metrics.lookup(Cache::Vmis, LookupResult::CacheHit);
            return VmiLookup::Found(found);
        }
        Box::pin(self.vmi_after_wait(vmi, same)).await
    }

    async fn launcher_pod(&self, namespace: &str, name: &str, uid: &str) -> PodLookup {
        if let Some(found) = self.launcher_pods.get_namespaced(namespace, name) {
            // A cached pod of the same name but another UID is a deleted predecessor: ask.
            if uid.is_empty() || found.uid.as_deref() == Some(uid) {
                self.metrics
                    .lookup(Cache::LauncherPods, LookupResult::CacheHit);
                return PodLookup::Found(Arc::new(found.to_pod()));
            }
        }
        Box::pin(self.launcher_pod_after_wait(namespace, name, uid)).await
    }
}
