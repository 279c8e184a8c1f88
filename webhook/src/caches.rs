//! In-memory caches of the cluster objects reviews need, so the hot path makes no API call.
//!
//! Every cache is fed by a kube `watcher` (with `default_backoff`) started through
//! [`CacheBuilder::watch`], which strips `managedFields` (and `kubectl`'s last-applied annotation) from
//! every object, reduces it to what decisions read, keeps an object-count gauge and registers the cache
//! for [`Caches::wait_synced`]. Each cache is a [`NamedStore`] (by namespace and name: borrowed
//! lookups and allocation-free scans).
//!
//! Caches: VMIs and Namespace labels (mutation and validation), TeeCapacity reports, Node labels
//! (node selection for pod CREATE) and virt-launcher pods (label `kubevirt.io=virt-launcher`, reduced to
//! [`CachedLauncherPod`], for bindings). Memory: everything not read is dropped when the object arrives
//! (see [`slim_vmi`], [`CachedLauncherPod`], [`slim_report`]).
//!
//! Adding a cache: add a field to [`Caches`], create it in [`Caches::start`] with one
//! `builder.watch(...)` call, and add a lookup method (cache first, one GET on a miss if a miss can be a
//! race).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Debug;
use std::hash::Hash;
use std::ops::ControlFlow;
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::core::PartialObjectMeta;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use teeguard_shared::{TeeCapacity, VirtualMachineInstance, names};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::metrics::{LookupResult, Metrics};
use crate::mutation::{VmiLookup, VmiRef};
use crate::pods::{CachedLauncherPod, LauncherPod, slim_meta};

/// Name of the VMI cache (metrics label).
pub const VMI_CACHE: &str = "vmis";
/// Name of the Namespace cache (metrics label).
pub const NAMESPACE_CACHE: &str = "namespaces";
/// Name of the TeeCapacity cache (metrics label).
pub const TEE_CAPACITY_CACHE: &str = "teecapacities";
/// Name of the Node metadata cache (metrics label).
pub const NODE_CACHE: &str = "nodes";
/// Name of the virt-launcher pod cache (metrics label).
pub const LAUNCHER_POD_CACHE: &str = "virt_launcher_pods";

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

/// An object's labels, as the node and namespace caches keep them.
pub type Labels = BTreeMap<String, String>;

/// A node-selection predicate: node name and labels.
pub type NodeFilter<'a> = &'a (dyn Fn(&str, &BTreeMap<String, String>) -> bool + Sync);

const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Where a review looks up the objects it needs. The server answers from its caches (with one GET
/// on a miss); the offline `review` command answers from files. Both run the same decision code.
pub trait Lookups: Send + Sync {
    /// Labels of a namespace: `Ok(None)` if it does not exist, `Err` if it could not be asked.
    fn namespace_labels(
        &self,
        namespace: &str,
    ) -> impl Future<Output = Result<Option<BTreeMap<String, String>>, String>> + Send;

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

    /// The node's `TeeCapacity` report, if any (cache only: reports are cluster-scoped and cached).
    fn tee_capacity(&self, node: &str) -> Option<Arc<TeeCapacity>>;

    /// Call `visit` with the name of each known node for which `filter(name, labels)` holds, until
    /// `visit` breaks: `first` (when it is a known node) before the others, then in no particular order,
    /// each node once. Allocates nothing per node.
    fn scan_nodes(
        &self,
        filter: NodeFilter<'_>,
        first: Option<&str>,
        visit: &mut dyn FnMut(&str) -> ControlFlow<()>,
    );
}

/// Spawns reflectors and collects what [`Caches::wait_synced`] waits for.
pub struct CacheBuilder {
    metrics: Arc<Metrics>,
    shutdown: CancellationToken,
    tasks: JoinSet<()>,
    ready: Vec<BoxFuture<'static, ()>>,
}

impl Debug for CacheBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CacheBuilder")
            .field("caches", &self.ready.len())
            .finish()
    }
}

impl CacheBuilder {
    /// A builder whose reflectors stop when `shutdown` is cancelled.
    pub fn new(metrics: Arc<Metrics>, shutdown: CancellationToken) -> Self {
        CacheBuilder {
            metrics,
            shutdown,
            tasks: JoinSet::new(),
            ready: Vec::new(),
        }
    }

    /// Start a cache over `api` holding `reduce(object)` by namespace and name (after `managedFields`
    /// and the last-applied annotation are stripped). Use `Api<PartialObjectMeta<K>>` for a
    /// metadata-only watch.
    pub fn watch<K, T>(
        &mut self,
        name: &'static str,
        api: Api<K>,
        config: watcher::Config,
        reduce: fn(K) -> T,
    ) -> NamedStore<T>
    where
        K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
        K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
        T: Send + Sync + 'static,
    {
        let (store, mut writer) = NamedStore::new(reduce);
        let mut ready = store.ready.clone();
        self.ready.push(Box::pin(async move {
            // Only fails if the writer is dropped, i.e. the cache is shutting down.
            let _ = ready.wait_for(|r| *r).await;
        }));
        let stream = watcher(api, config)
            .default_backoff()
            .modify(move |o: &mut K| {
                o.managed_fields_mut().clear();
                o.annotations_mut().remove(LAST_APPLIED);
            });
        let metrics = self.metrics.clone();
        let shutdown = self.shutdown.clone();
        self.tasks.spawn(async move {
            let mut stream = std::pin::pin!(stream);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    event = stream.next() => match event {
                        Some(Ok(event)) => {
                            writer.apply(event);
                            metrics.set_cache_objects(name, writer.len());
                        }
                        Some(Err(e)) => tracing::warn!(cache = name, error = %e, "watch failed; retrying with backoff"),
                        None => break,
                    }
                }
            }
        });
        store
    }

    fn finish(self) -> (CacheTasks, Vec<BoxFuture<'static, ()>>) {
        (CacheTasks { tasks: self.tasks }, self.ready)
    }
}

/// Objects by namespace (`""` for cluster-scoped kinds), then name: a namespace's name is stored once
/// for all its objects, and lookups take `&str`s.
#[derive(Debug)]
struct Objects<T> {
    by_namespace: HashMap<String, HashMap<String, Arc<T>>>,
    len: usize,
}

impl<T> Default for Objects<T> {
    fn default() -> Self {
        Objects {
            by_namespace: HashMap::new(),
            len: 0,
        }
    }
}

impl<T> Objects<T> {
    fn get(&self, namespace: &str, name: &str) -> Option<&Arc<T>> {
        self.by_namespace.get(namespace)?.get(name)
    }

    fn insert(&mut self, namespace: &str, name: String, value: Arc<T>) {
        if !self.by_namespace.contains_key(namespace) {
            self.by_namespace
                .insert(namespace.to_string(), HashMap::new());
        }
        let Some(names) = self.by_namespace.get_mut(namespace) else {
            return;
        };
        if names.insert(name, value).is_none() {
            self.len += 1;
        }
    }

    fn remove(&mut self, namespace: &str, name: &str) {
        let Some(names) = self.by_namespace.get_mut(namespace) else {
            return;
        };
        if names.remove(name).is_some() {
            self.len -= 1;
        }
        if names.is_empty() {
            self.by_namespace.remove(namespace);
        }
    }
}

/// A cache of objects by namespace and name, each reduced to a `T` when it arrives (kube's reflector
/// `Store` keeps the whole object, keyed by an `ObjectRef` holding four more strings). Cheap to clone.
///
/// Lookups take `&str`s (no key to build) and [`NamedStore::scan`] visits the entries under the read
/// lock without cloning them.
pub struct NamedStore<T> {
    map: Arc<RwLock<Objects<T>>>,
    ready: tokio::sync::watch::Receiver<bool>,
}

impl<T> Clone for NamedStore<T> {
    fn clone(&self) -> Self {
        NamedStore {
            map: self.map.clone(),
            ready: self.ready.clone(),
        }
    }
}

impl<T> Debug for NamedStore<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NamedStore")
            .field("len", &self.len())
            .field("ready", &*self.ready.borrow())
            .finish()
    }
}

impl<T: Send + Sync + 'static> NamedStore<T> {
    /// An empty store and the writer that fills it from watch events of `K`.
    fn new<K: Resource + Send + 'static>(reduce: fn(K) -> T) -> (Self, NamedWriter<K, T>) {
        let map = Arc::new(RwLock::new(Objects::default()));
        let (tx, rx) = tokio::sync::watch::channel(false);
        (
            NamedStore {
                map: map.clone(),
                ready: rx,
            },
            NamedWriter {
                map,
                buffer: None,
                reduce,
                ready: tx,
            },
        )
    }
}

impl<T> NamedStore<T> {
    fn read(&self) -> RwLockReadGuard<'_, Objects<T>> {
        // Writers never panic half-way through a change: a poisoned lock still holds a consistent map.
        self.map.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The cluster-scoped object named `name`.
    pub fn get(&self, name: &str) -> Option<Arc<T>> {
        self.read().get("", name).cloned()
    }

    /// The object `namespace/name`.
    pub fn get_namespaced(&self, namespace: &str, name: &str) -> Option<Arc<T>> {
        self.read().get(namespace, name).cloned()
    }

    /// Number of objects.
    pub fn len(&self) -> usize {
        self.read().len
    }

    /// Whether the store is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the initial list has been stored.
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }

    /// Visit every object (name and value), in no particular order, until `visit` breaks. The read
    /// lock is held throughout: keep `visit` short and never write to this store from it.
    pub fn scan(&self, visit: impl FnMut(&str, &T) -> ControlFlow<()>) {
        self.scan_from(None, visit);
    }

    /// [`NamedStore::scan`], visiting the cluster-scoped object `first` (when stored) before the
    /// others, and each object once.
    pub fn scan_from(
        &self,
        first: Option<&str>,
        mut visit: impl FnMut(&str, &T) -> ControlFlow<()>,
    ) {
        let objects = self.read();
        if let Some((name, value)) = first.and_then(|f| Some((f, objects.get("", f)?)))
            && visit(name, value).is_break()
        {
            return;
        }
        for (namespace, names) in &objects.by_namespace {
            for (name, value) in names {
                if namespace.is_empty() && Some(name.as_str()) == first {
                    continue;
                }
                if visit(name, value).is_break() {
                    return;
                }
            }
        }
    }
}

/// Fills a [`NamedStore`] from watch events (the initial list is buffered and swapped in whole, like
/// kube's reflector).
struct NamedWriter<K, T> {
    map: Arc<RwLock<Objects<T>>>,
    buffer: Option<Objects<T>>,
    reduce: fn(K) -> T,
    ready: tokio::sync::watch::Sender<bool>,
}

impl<K, T> NamedWriter<K, T> {
    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Objects<T>> {
        self.map.write().unwrap_or_else(PoisonError::into_inner)
    }
}

fn key<K: Resource>(o: &K) -> (String, String) {
    let m = o.meta();
    (
        m.namespace.clone().unwrap_or_default(),
        m.name.clone().unwrap_or_default(),
    )
}

impl<K: Resource, T> NamedWriter<K, T> {
    /// Apply one watch event.
    fn apply(&mut self, event: watcher::Event<K>) {
        match event {
            watcher::Event::Apply(o) => {
                let (namespace, name) = key(&o);
                let value = Arc::new((self.reduce)(o));
                self.write().insert(&namespace, name, value);
            }
            watcher::Event::Delete(o) => {
                let m = o.meta();
                let (namespace, name) = (
                    m.namespace.as_deref().unwrap_or_default(),
                    m.name.as_deref().unwrap_or_default(),
                );
                self.write().remove(namespace, name);
            }
            watcher::Event::Init => self.buffer = Some(Objects::default()),
            watcher::Event::InitApply(o) => {
                let (namespace, name) = key(&o);
                let value = Arc::new((self.reduce)(o));
                self.buffer
                    .get_or_insert_default()
                    .insert(&namespace, name, value);
            }
            watcher::Event::InitDone => {
                let fresh = self.buffer.take().unwrap_or_default();
                let old = std::mem::replace(&mut *self.write(), fresh);
                // The old map is dropped after the lock is released.
                drop(old);
                self.ready.send_replace(true);
            }
        }
    }
    /// Number of objects stored.
    fn len(&self) -> usize {
        self.map.read().unwrap_or_else(PoisonError::into_inner).len
    }
}

/// What teeguard keeps of a namespace's labels: the two it reads (exemption and mode). Namespaces carry
/// many others (`kubernetes.io/metadata.name`, Pod Security levels, mesh and team labels) that every
/// review would otherwise copy out of the cache.
pub fn namespace_labels(labels: Option<Labels>) -> Labels {
    let mut labels = labels.unwrap_or_default();
    labels.retain(|k, _| k == names::EXEMPT_LABEL || k == names::MODE_LABEL);
    labels
}

/// What the VMI cache keeps of a VMI: identity, the exemption label, the controller owner and
/// `launchSecurity` (the type reads nothing else of the spec).
pub fn slim_vmi(vmi: &mut VirtualMachineInstance) {
    slim_meta(&mut vmi.metadata, |k| k == names::EXEMPT_LABEL, |_| false);
}

/// What the report cache keeps of a `TeeCapacity`: name, `resourceVersion` and the status figures
/// and heartbeat (no labels, annotations, owners or conditions).
pub fn slim_report(mut cap: TeeCapacity) -> TeeCapacity {
    let m = &mut cap.metadata;
    m.labels = None;
    m.annotations = None;
    m.owner_references = None;
    m.finalizers = None;
    m.managed_fields = None;
    if let Some(status) = cap.status.as_mut() {
        status.conditions = Vec::new();
        status.agent_version = None;
    }
    cap
}

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
    /// All TeeCapacity reports (named after their node), reduced by [`slim_report`].
    pub tee_capacities: NamedStore<TeeCapacity>,
    /// The labels of every Node (for node selection), by node name.
    pub nodes: NamedStore<Labels>,
    /// Pods labelled `kubevirt.io=virt-launcher`, reduced to what a binding decision reads.
    pub launcher_pods: NamedStore<CachedLauncherPod>,
    synced: Arc<tokio::sync::watch::Receiver<bool>>,
}

impl Debug for Caches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caches")
            .field("vmis", &self.vmis.len())
            .field("namespaces", &self.namespaces.len())
            .field("tee_capacities", &self.tee_capacities.len())
            .field("nodes", &self.nodes.len())
            .field("launcher_pods", &self.launcher_pods.len())
            .field("synced", &self.is_synced())
            .finish()
    }
}

impl Caches {
    /// Start every reflector. `api_timeout` bounds the GET made on a cache miss.
    pub fn start(
        client: Client,
        metrics: Arc<Metrics>,
        api_timeout: Duration,
        shutdown: CancellationToken,
    ) -> (Caches, CacheTasks) {
        let mut b = CacheBuilder::new(metrics.clone(), shutdown);
        let vmis = b.watch(
            VMI_CACHE,
            Api::<VirtualMachineInstance>::all(client.clone()),
            watcher::Config::default().any_semantic(),
            |mut v: VirtualMachineInstance| {
                slim_vmi(&mut v);
                v
            },
        );
        let namespaces = b.watch(
            NAMESPACE_CACHE,
            Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
            watcher::Config::default().any_semantic(),
            |n: PartialObjectMeta<Namespace>| namespace_labels(n.metadata.labels),
        );
        let tee_capacities = b.watch(
            TEE_CAPACITY_CACHE,
            Api::<TeeCapacity>::all(client.clone()),
            watcher::Config::default().any_semantic(),
            slim_report,
        );
        let nodes = b.watch(
            NODE_CACHE,
            Api::<PartialObjectMeta<Node>>::all(client.clone()),
            watcher::Config::default().any_semantic(),
            |n: PartialObjectMeta<Node>| n.metadata.labels.unwrap_or_default(),
        );
        let launcher_pods = b.watch(
            LAUNCHER_POD_CACHE,
            Api::<LauncherPod>::all(client.clone()),
            watcher::Config::default()
                .labels(&format!(
                    "{}={}",
                    names::KUBEVIRT_LABEL,
                    names::VIRT_LAUNCHER
                ))
                .any_semantic(),
            CachedLauncherPod::from,
        );
        let (tasks, ready) = b.finish();
        let (tx, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            futures::future::join_all(ready).await;
            let _ = tx.send(true);
        });
        let caches = Caches {
            client,
            metrics,
            api_timeout,
            vmis,
            namespaces,
            tee_capacities,
            nodes,
            launcher_pods,
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

    async fn get_with_timeout<K, F>(&self, fut: F) -> Result<Option<K>, String>
    where
        F: Future<Output = kube::Result<Option<K>>>,
    {
        match tokio::time::timeout(self.api_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!(
                "the API server did not answer within {:?}",
                self.api_timeout
            )),
        }
    }

    /// The API fallback of [`Lookups::namespace_labels`] on a cache miss.
    async fn namespace_from_api(
        &self,
        namespace: &str,
    ) -> Result<Option<BTreeMap<String, String>>, String> {
        let api = Api::<PartialObjectMeta<Namespace>>::all(self.client.clone());
        let got = self.get_with_timeout(api.get_opt(namespace)).await;
        let result = match &got {
            Ok(Some(_)) => LookupResult::ApiFound,
            Ok(None) => LookupResult::ApiNotFound,
            Err(_) => LookupResult::ApiError,
        };
        self.metrics.lookup(NAMESPACE_CACHE, result);
        if let Err(e) = &got {
            tracing::warn!(namespace, error = %e, "namespace not cached and the GET failed");
        }
        got.map(|o| o.map(|ns| namespace_labels(ns.metadata.labels)))
    }

    /// The API fallback of [`Lookups::vmi`] on a cache miss.
    async fn vmi_from_api(&self, vmi: &VmiRef) -> VmiLookup {
        let api = Api::<VirtualMachineInstance>::namespaced(self.client.clone(), &vmi.namespace);
        match self.get_with_timeout(api.get_opt(&vmi.name)).await {
            Ok(Some(mut found)) => {
                self.metrics.lookup(VMI_CACHE, LookupResult::ApiFound);
                tracing::debug!(vmi = %vmi, "VMI not cached yet; found by GET");
                found.managed_fields_mut().clear();
                VmiLookup::Found(Arc::new(found))
            }
            Ok(None) => {
                self.metrics.lookup(VMI_CACHE, LookupResult::ApiNotFound);
                VmiLookup::NotFound
            }
            Err(e) => {
                self.metrics.lookup(VMI_CACHE, LookupResult::ApiError);
                tracing::warn!(vmi = %vmi, error = %e, "VMI not cached and the GET failed");
                VmiLookup::Failed(e)
            }
        }
    }

    /// The API fallback of [`Lookups::launcher_pod`] on a cache miss.
    async fn launcher_pod_from_api(&self, namespace: &str, name: &str, uid: &str) -> PodLookup {
        let api = Api::<LauncherPod>::namespaced(self.client.clone(), namespace);
        match self.get_with_timeout(api.get_opt(name)).await {
            Ok(Some(found)) if uid.is_empty() || found.metadata.uid.as_deref() == Some(uid) => {
                self.metrics
                    .lookup(LAUNCHER_POD_CACHE, LookupResult::ApiFound);
                tracing::debug!(namespace, name, "pod not cached yet; found by GET");
                PodLookup::Found(Arc::new(found.to_pod()))
            }
            Ok(_) => {
                self.metrics
                    .lookup(LAUNCHER_POD_CACHE, LookupResult::ApiNotFound);
                PodLookup::NotFound
            }
            Err(e) => {
                self.metrics
                    .lookup(LAUNCHER_POD_CACHE, LookupResult::ApiError);
                tracing::warn!(namespace, name, error = %e, "pod not cached and the GET failed");
                PodLookup::Failed(e)
            }
        }
    }
}

impl Lookups for Caches {
    // A cache hit answers without awaiting anything; a miss awaits the API fallback boxed, so the
    // kube client's request future (several KB) is not inlined into every admission handler's
    // future, which the server allocates and moves on every review.

    async fn namespace_labels(
        &self,
        namespace: &str,
    ) -> Result<Option<BTreeMap<String, String>>, String> {
        if let Some(labels) = self.namespaces.get(namespace) {
            self.metrics.lookup(NAMESPACE_CACHE, LookupResult::CacheHit);
            return Ok(Some((*labels).clone()));
        }
        Box::pin(self.namespace_from_api(namespace)).await
    }

    async fn vmi(&self, vmi: &VmiRef) -> VmiLookup {
        if let Some(found) = self.vmis.get_namespaced(&vmi.namespace, &vmi.name) {
            let uid = found.metadata.uid.as_deref().unwrap_or("");
            // A cached VMI of the same name but another UID may be a deleted predecessor: ask.
            if vmi.uid.is_empty() || uid == vmi.uid {
                self.metrics.lookup(VMI_CACHE, LookupResult::CacheHit);
                return VmiLookup::Found(found);
            }
        }
        Box::pin(self.vmi_from_api(vmi)).await
    }

    async fn launcher_pod(&self, namespace: &str, name: &str, uid: &str) -> PodLookup {
        if let Some(found) = self.launcher_pods.get_namespaced(namespace, name) {
            // A cached pod of the same name but another UID is a deleted predecessor: ask.
            if uid.is_empty() || found.uid.as_deref() == Some(uid) {
                self.metrics
                    .lookup(LAUNCHER_POD_CACHE, LookupResult::CacheHit);
                return PodLookup::Found(Arc::new(found.to_pod()));
            }
        }
        Box::pin(self.launcher_pod_from_api(namespace, name, uid)).await
    }

    fn tee_capacity(&self, node: &str) -> Option<Arc<TeeCapacity>> {
        self.tee_capacities.get(node)
    }

    fn scan_nodes(
        &self,
        filter: NodeFilter<'_>,
        first: Option<&str>,
        visit: &mut dyn FnMut(&str) -> ControlFlow<()>,
    ) {
        self.nodes.scan_from(first, |name, labels| {
            if filter(name, labels) {
                visit(name)
            } else {
                ControlFlow::Continue(())
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;

    fn node(name: &str, zone: &str) -> PartialObjectMeta<Node> {
        PartialObjectMeta {
            types: None,
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(BTreeMap::from([("zone".to_string(), zone.to_string())])),
                ..ObjectMeta::default()
            },
            _phantom: std::marker::PhantomData,
        }
    }

    fn names(store: &NamedStore<Labels>) -> Vec<String> {
        let mut out = Vec::new();
        store.scan(|name, _| {
            out.push(name.to_string());
            ControlFlow::Continue(())
        });
        out.sort();
        out
    }

    #[test]
    fn named_store_follows_watch_events() {
        let (store, mut w) =
            NamedStore::new(|n: PartialObjectMeta<Node>| n.metadata.labels.unwrap_or_default());
        assert!(!store.is_ready() && store.is_empty());
        w.apply(watcher::Event::Init);
        w.apply(watcher::Event::InitApply(node("a", "z1")));
        w.apply(watcher::Event::InitApply(node("b", "z2")));
        // The initial list is not visible until it is complete.
        assert!(store.is_empty() && !store.is_ready());
        w.apply(watcher::Event::InitDone);
        assert!(store.is_ready());
        assert_eq!(names(&store), ["a", "b"]);
        assert_eq!(
            store.get("b").and_then(|l| l.get("zone").cloned()),
            Some("z2".into())
        );
        w.apply(watcher::Event::Apply(node("b", "z3")));
        w.apply(watcher::Event::Apply(node("c", "z1")));
        w.apply(watcher::Event::Delete(node("a", "z1")));
        assert_eq!(names(&store), ["b", "c"]);
        assert_eq!(
            store.get("b").and_then(|l| l.get("zone").cloned()),
            Some("z3".into())
        );
        assert_eq!(w.len(), 2);
        // A relist replaces everything at once; objects gone meanwhile disappear.
        w.apply(watcher::Event::Init);
        w.apply(watcher::Event::InitApply(node("d", "z1")));
        assert_eq!(names(&store), ["b", "c"]);
        w.apply(watcher::Event::InitDone);
        assert_eq!(names(&store), ["d"]);
        // A scan stops when told to.
        w.apply(watcher::Event::Apply(node("e", "z1")));
        let mut seen = 0;
        store.scan(|_, _| {
            seen += 1;
            ControlFlow::Break(())
        });
        assert_eq!(seen, 1);
        // A scan from a given object visits it first and every object once; an unknown first is
        // just not visited.
        for name in ["a", "b", "c", "d", "e", "f", "g"] {
            w.apply(watcher::Event::Apply(node(name, "z1")));
        }
        for first in ["e", "a", "g", "unknown"] {
            let mut order = Vec::new();
            store.scan_from(Some(first), |name, _| {
                order.push(name.to_string());
                ControlFlow::Continue(())
            });
            if first != "unknown" {
                assert_eq!(order[0], first);
            }
            order.sort();
            assert_eq!(order, ["a", "b", "c", "d", "e", "f", "g"], "from {first}");
        }
        let mut seen = Vec::new();
        store.scan_from(Some("f"), |name, _| {
            seen.push(name.to_string());
            ControlFlow::Break(())
        });
        assert_eq!(seen, ["f"]);
    }

    #[test]
    fn reports_keep_only_what_decisions_read() {
        let cap: TeeCapacity = serde_json::from_value(serde_json::json!({
            "apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeCapacity",
            "metadata": {"name": "n1", "resourceVersion": "7", "labels": {"a": "b"},
                "annotations": {"x": "y"}},
            "spec": {"nodeName": "n1"},
            "status": {"tdx": {"resourceName": "tdx.intel.com/keys", "capacity": 4, "kernelUsed": 1,
                "podsUsed": 1, "external": 0, "pending": 0, "free": 3},
                "heartbeatTime": "2025-01-01T00:00:00Z", "agentVersion": "0.1.0",
                "conditions": [{"type": "Ready", "status": "True", "reason": "Ok", "message": "m",
                    "lastTransitionTime": "2025-01-01T00:00:00Z"}]}
        }))
        .expect("report");
        let slim = slim_report(cap.clone());
        assert_eq!(slim.metadata.name.as_deref(), Some("n1"));
        assert_eq!(slim.metadata.resource_version.as_deref(), Some("7"));
        assert!(slim.metadata.labels.is_none() && slim.metadata.annotations.is_none());
        let (full, slim) = (cap.status.expect("status"), slim.status.expect("status"));
        assert!(slim.conditions.is_empty() && !full.conditions.is_empty());
        assert_eq!(slim.tdx, full.tdx);
        assert_eq!(slim.heartbeat_time, full.heartbeat_time);
    }

    #[test]
    fn namespaces_keep_only_the_labels_teeguard_reads() {
        let labels = |pairs: &[(&str, &str)]| -> Labels {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        let all = labels(&[
            ("kubernetes.io/metadata.name", "vms"),
            ("pod-security.kubernetes.io/enforce", "privileged"),
            (names::EXEMPT_LABEL, "true"),
            (names::MODE_LABEL, "warn"),
        ]);
        assert_eq!(
            namespace_labels(Some(all)),
            labels(&[(names::EXEMPT_LABEL, "true"), (names::MODE_LABEL, "warn")])
        );
        // A namespace without labels, or without teeguard's, is still a namespace: an empty map.
        assert_eq!(namespace_labels(None), Labels::new());
        assert_eq!(
            namespace_labels(Some(labels(&[("team", "a")]))),
            Labels::new()
        );
    }
}
