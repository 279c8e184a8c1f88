//! The store behind every cache: [`CacheBuilder`] starts a reflector per cache (reducing each object
//! on arrival, counting objects, registering it for the sync wait), and [`NamedStore`] keeps the
//! objects by namespace and name for borrowed lookups.

use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};
use std::time::Duration;

use futures::StreamExt;
use futures::future::BoxFuture;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use teeguard_shared::ops::Backoff;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::metrics::{Cache, Metrics};

/// First watch retry delay after an error.
pub const WATCH_BACKOFF_INITIAL: Duration = Duration::from_millis(500);
/// Longest watch retry delay.
pub const WATCH_BACKOFF_MAX: Duration = Duration::from_secs(5);

use super::*;

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
    /// and the last-applied annotation are stripped), telling `observer` of every object stored or
    /// removed (after the change, outside the store's lock). Use `Api<PartialObjectMeta<K>>` for a
    /// metadata-only watch.
    pub fn watch<K, T>(
        &mut self,
        cache: Cache,
        api: Api<K>,
        config: watcher::Config,
        reduce: fn(K) -> T,
        observer: Option<Arc<dyn Observer<T>>>,
    ) -> NamedStore<T>
    where
        K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
        K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
        T: Send + Sync + 'static,
    {
        let (store, mut writer) = NamedStore::new(reduce);
        writer.observer = observer;
        let mut ready = store.ready.clone();
        self.ready.push(Box::pin(async move {
            // Only fails if the writer is dropped, i.e. the cache is shutting down.
            let _ = ready.wait_for(|r| *r).await;
        }));
        self.spawn(cache, api, config, move |event| {
            writer.apply(event);
            writer.len()
        });
        store
    }

    /// Start a watch over `api` whose objects go to `sink` only (no store here: the admission index
    /// keeps what it reads of them). A re-list tells `sink` of the objects that vanished meanwhile.
    pub fn watch_into<K>(
        &mut self,
        cache: Cache,
        api: Api<K>,
        config: watcher::Config,
        sink: Arc<dyn crate::cluster::index::Sink<K>>,
    ) where
        K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
        K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
    {
        let (ready_tx, mut ready) = tokio::sync::watch::channel(false);
        self.ready.push(Box::pin(async move {
            let _ = ready.wait_for(|r| *r).await;
        }));
        // The names stored, to tell a re-list which vanished.
        let mut names = std::collections::HashSet::new();
        let mut listed: Option<std::collections::HashSet<String>> = None;
        self.spawn(cache, api, config, move |event| {
            match event {
                watcher::Event::Init => listed = Some(Default::default()),
                watcher::Event::InitApply(o) => {
                    listed.get_or_insert_default().insert(o.name_any());
                    sink.apply(o);
                }
                watcher::Event::InitDone => {
                    let fresh = listed.take().unwrap_or_default();
                    for gone in names.difference(&fresh) {
                        sink.delete(gone);
                    }
                    names = fresh;
                    ready_tx.send_replace(true);
                }
                watcher::Event::Apply(o) => {
                    names.insert(o.name_any());
                    sink.apply(o);
                }
                watcher::Event::Delete(o) => {
                    let gone = o.name_any();
                    names.remove(&gone);
                    sink.delete(&gone);
                }
            }
            names.len()
        });
    }

    /// Run a watch over `api`, handing each event to `apply` (which returns the objects held, for
    /// the gauge), until shutdown. Jittered backoff capped at [`WATCH_BACKOFF_MAX`]: caches are current
    /// again within seconds of an API server outage (kube's default backoff grows to about a minute),
    /// and replicas re-list at different moments.
    fn spawn<K>(
        &mut self,
        cache: Cache,
        api: Api<K>,
        config: watcher::Config,
        mut apply: impl FnMut(watcher::Event<K>) -> usize + Send + 'static,
    ) where
        K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
        K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
    {
        let stream = watcher(api, config)
            .backoff(Backoff::new(WATCH_BACKOFF_INITIAL, WATCH_BACKOFF_MAX))
            .modify(move |o: &mut K| {
                o.managed_fields_mut().clear();
                o.annotations_mut().remove(LAST_APPLIED);
            });
        let metrics = self.metrics.clone();
        let shutdown = self.shutdown.clone();
        self.tasks.spawn(async move {
            let mut stream = std::pin::pin!(stream);
            loop {
                let event = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    event = stream.next() => event,
                };
                match event {
                    Some(Ok(event)) => metrics.set_cache_objects(cache, apply(event)),
                    Some(Err(e)) => {
                        tracing::warn!(cache = cache.as_str(), error = %e, "watch failed; retrying with backoff");
                    }
                    None => break,
                }
            }
        });
    }

    pub(super) fn finish(self) -> (CacheTasks, Vec<BoxFuture<'static, ()>>) {
        (CacheTasks { tasks: self.tasks }, self.ready)
    }
}

/// Told of a cache's changes as they are applied: for state that must follow the cluster at once
/// (the admission index: a hold ends when its pod is deleted).
pub trait Observer<T>: Send + Sync {
    /// `value` was stored (added or changed; also each object of a re-list).
    fn stored(&self, _value: &T) {}
    /// `value` was removed (a delete event, or gone from a re-list).
    fn removed(&self, _value: &T) {}
}

/// Objects by namespace (`""` for cluster-scoped kinds), then name: a namespace's name is stored once
/// for all its objects, and lookups take `&str`s.
#[derive(Debug)]
pub(super) struct Objects<T> {
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

    fn remove(&mut self, namespace: &str, name: &str) -> Option<Arc<T>> {
        let names = self.by_namespace.get_mut(namespace)?;
        let removed = names.remove(name);
        if removed.is_some() {
            self.len -= 1;
        }
        if names.is_empty() {
            self.by_namespace.remove(namespace);
        }
        removed
    }
}

/// A cache of objects by namespace and name, each reduced to a `T` when it arrives (kube's reflector
/// `Store` keeps the whole object, keyed by an `ObjectRef` holding four more strings). Cheap to clone.
///
/// Lookups take `&str`s (no key to build).
pub struct NamedStore<T> {
    map: Arc<RwLock<Objects<T>>>,
    ready: tokio::sync::watch::Receiver<bool>,
    /// Woken after every change (for [`NamedStore::wait_for`]).
    changed: Arc<tokio::sync::Notify>,
}

impl<T> Clone for NamedStore<T> {
    fn clone(&self) -> Self {
        NamedStore {
            map: self.map.clone(),
            ready: self.ready.clone(),
            changed: self.changed.clone(),
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
    pub(super) fn new<K: Resource + Send + 'static>(
        reduce: fn(K) -> T,
    ) -> (Self, NamedWriter<K, T>) {
        let map = Arc::new(RwLock::new(Objects::default()));
        let (tx, rx) = tokio::sync::watch::channel(false);
        let changed = Arc::new(tokio::sync::Notify::new());
        (
            NamedStore {
                map: map.clone(),
                ready: rx,
                changed: changed.clone(),
            },
            NamedWriter {
                map,
                buffer: None,
                reduce,
                ready: tx,
                observer: None,
                changed,
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

    /// The object `namespace/name` for which `accept` holds, waiting at most `wait` for the watch to
    /// deliver it (an object created a moment ago, e.g. the VMI virt-controller created just before
    /// its pod). `None` when it did not arrive in time.
    pub async fn wait_for(
        &self,
        namespace: &str,
        name: &str,
        wait: Duration,
        accept: impl Fn(&T) -> bool,
    ) -> Option<Arc<T>> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            // Registered before the look, so a change between the look and the wait still wakes it.
            let notified = self.changed.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if let Some(found) = self.get_namespaced(namespace, name).filter(|v| accept(v)) {
                return Some(found);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return None;
            }
        }
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
}

/// Fills a [`NamedStore`] from watch events (the initial list is buffered and swapped in whole, like
/// kube's reflector).
pub(super) struct NamedWriter<K, T> {
    map: Arc<RwLock<Objects<T>>>,
    buffer: Option<Objects<T>>,
    reduce: fn(K) -> T,
    ready: tokio::sync::watch::Sender<bool>,
    pub(super) observer: Option<Arc<dyn Observer<T>>>,
    changed: Arc<tokio::sync::Notify>,
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
    pub(super) fn apply(&mut self, event: watcher::Event<K>) {
        match event {
            watcher::Event::Apply(o) => {
                let (namespace, name) = key(&o);
                let value = Arc::new((self.reduce)(o));
                self.write().insert(&namespace, name, value.clone());
                self.changed.notify_waiters();
                if let Some(observer) = &self.observer {
                    observer.stored(&value);
                }
            }
            watcher::Event::Delete(o) => {
                let (namespace, name) = key(&o);
                let gone = self.write().remove(&namespace, &name);
                if let Some(observer) = &self.observer {
                    // The stored value, or (never stored here) the deleted object itself.
                    let value = gone.unwrap_or_else(|| Arc::new((self.reduce)(o)));
                    observer.removed(&value);
                }
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
                self.changed.notify_waiters();
                // Objects that vanished while the watch was down were deleted too.
                let mut vanished = Vec::new();
                {
                    let map = self.map.read().unwrap_or_else(PoisonError::into_inner);
                    for (namespace, names) in &old.by_namespace {
                        for (name, value) in names {
                            if map.get(namespace, name).is_none() {
                                vanished.push(value.clone());
                            }
                        }
                    }
                }
                // The old map is dropped after the lock is released.
                drop(old);
                if let Some(observer) = &self.observer {
                    for value in &vanished {
                        observer.removed(value);
                    }
                    let stored: Vec<Arc<T>> = {
                        let map = self.map.read().unwrap_or_else(PoisonError::into_inner);
                        map.by_namespace
                            .values()
                            .flat_map(|names| names.values().cloned())
                            .collect()
                    };
                    for value in &stored {
                        observer.stored(value);
                    }
                }
                self.ready.send_replace(true);
            }
        }
    }
    /// Number of objects stored.
    pub(super) fn len(&self) -> usize {
        self.map.read().unwrap_or_else(PoisonError::into_inner).len
    }
}
