//! Watching the agent's own Node, the pods bound to it and (strict mode) the exempt namespaces:
//! kube reflectors whose changes wake the agent's loop.

use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node};
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use teeguard_shared::config::ResourcesConfig;
use teeguard_shared::names::{DRA_DRIVER, EXEMPT_LABEL};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::cached::{CachedPod, slim_node};
use crate::metrics::Metrics;

pub use teeguard_shared::ops::Backoff;

/// A running reflector: its store, a revision counting its changes, and whether the initial list
/// completed.
pub struct Watched<K: Resource + 'static>
where
    K::DynamicType: Eq + Hash + Clone,
{
    /// The cache.
    pub store: Store<K>,
    /// Counts the events applied to the store; each waiter (the agent's loop, the NRI plugin)
    /// subscribes a receiver of its own and wakes, coalesced, on the next change.
    pub revision: Arc<watch::Sender<u64>>,
    /// True once the initial list has been applied.
    pub synced: Arc<AtomicBool>,
    /// The reflector task (ends on shutdown).
    pub task: JoinHandle<()>,
}

impl<K: Resource + 'static> Debug for Watched<K>
where
    K::DynamicType: Eq + Hash + Clone,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watched")
            .field("synced", &self.is_synced())
            .finish()
    }
}

impl<K: Resource + 'static> Watched<K>
where
    K::DynamicType: Eq + Hash + Clone,
{
    /// True once the initial list has been applied.
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }
}

/// The namespaces labelled `teeguard.dev/exempt: "true"` (strict mode leaves their pods alone, as the
/// webhook does). Cheap to clone; empty when not watched.
#[derive(Clone, Default)]
pub struct ExemptNamespaces {
    /// `None` when not watched.
    watched: Option<NamespaceWatch>,
}

/// What [`ExemptNamespaces`] reads of its watch.
#[derive(Clone)]
struct NamespaceWatch {
    store: Store<PartialObjectMeta<Namespace>>,
    /// The first list is in.
    synced: Arc<AtomicBool>,
    revision: Arc<watch::Sender<u64>>,
}

impl Debug for ExemptNamespaces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExemptNamespaces")
            .field("watched", &self.watched.is_some())
            .finish()
    }
}

impl ExemptNamespaces {
    /// Whether `namespace` is labelled exempt (as the watch last saw it). Before the watch's first
    /// list every namespace counts as exempt: strict mode zeroes no pod it cannot yet tell is exempt
    /// (a wrong zero would stop a container that should start; a late one only delays strictness).
    pub fn contains(&self, namespace: &str) -> bool {
        let listing = self
            .watched
            .as_ref()
            .is_some_and(|w| !w.synced.load(Ordering::Acquire));
        listing || self.labelled(namespace)
    }

    /// Whether `namespace` is labelled exempt as the watch, once it has listed them, says (unlike
    /// [`ExemptNamespaces::contains`], false until then).
    pub fn labelled(&self, namespace: &str) -> bool {
        self.watched.as_ref().is_some_and(|w| {
            w.synced.load(Ordering::Acquire)
                && w.store.get(&reflector::ObjectRef::new(namespace)).is_some()
        })
    }

    /// Resolves once the watch has listed the namespaces (at once when not watched).
    pub async fn listed(&self) {
        if let Some(w) = &self.watched {
            let mut rx = w.revision.subscribe();
            let _ = rx.wait_for(|_| w.synced.load(Ordering::Acquire)).await;
        }
    }

    /// A receiver that sees every change of the exempt namespaces (`None` when not watched).
    pub fn changes(&self) -> Option<watch::Receiver<u64>> {
        self.watched.as_ref().map(|w| w.revision.subscribe())
    }
}

/// What the agent's watches share: the client, a fresh retry backoff for each, the metrics their
/// failures count in, and shutdown.
#[derive(Clone)]
pub struct Watches {
    /// The API client.
    pub client: Client,
    /// Each watch's retry backoff starts from this one.
    pub backoff: Backoff,
    /// Failed watch calls count here.
    pub metrics: Metrics,
    /// The watches stop when this is cancelled.
    pub shutdown: CancellationToken,
}

impl Debug for Watches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watches").finish_non_exhaustive()
    }
}

impl Watches {
    /// Watch the pods bound to `node_name` (field selector `spec.nodeName=<node>`), caching only what
    /// attribution needs (see [`CachedPod`]).
    pub fn pods(&self, node_name: &str, resources: &ResourcesConfig) -> Watched<CachedPod> {
        let cfg = watcher::Config::default().fields(&format!("spec.nodeName={node_name}"));
        let names = resources.resource_names();
        self.spawn(
            cfg,
            move |p: &mut CachedPod| p.retain_resources(&names),
            "watch pods",
        )
    }

    /// Watch the agent's own Node (field selector `metadata.name=<node>`).
    pub fn node(&self, node_name: &str) -> Watched<Node> {
        let cfg = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
        self.spawn(cfg, slim_node, "watch node")
    }

    /// Watch the node's ResourceSlices of teeguard's DRA driver (DRA mode; field selectors
    /// `spec.nodeName` and `spec.driver`): the kubelet deletes them when it starts.
    pub fn slices(&self, node_name: &str) -> Watched<ResourceSlice> {
        let cfg = watcher::Config::default().fields(&format!(
            "spec.nodeName={node_name},spec.driver={DRA_DRIVER}"
        ));
        self.spawn(cfg, |_: &mut ResourceSlice| {}, "watch resourceslices")
    }

    /// Watch the namespaces labelled `teeguard.dev/exempt=true` (metadata only; the label selector
    /// keeps the watch to those few). A namespace's label added or removed takes effect for
    /// containers created from then on; a label added also lifts strict mode's zeros (the cgroup
    /// writer at the next poll, the NRI plugin through `UpdateContainers`).
    pub fn exempt_namespaces(&self) -> (ExemptNamespaces, Watched<PartialObjectMeta<Namespace>>) {
        let cfg = watcher::Config::default().labels(&format!("{EXEMPT_LABEL}=true"));
        let watched = self.spawn(
            cfg,
            |_: &mut PartialObjectMeta<Namespace>| {},
            "watch exempt namespaces",
        );
        let exempt = ExemptNamespaces {
            watched: Some(NamespaceWatch {
                store: watched.store.clone(),
                synced: watched.synced.clone(),
                revision: watched.revision.clone(),
            }),
        };
        (exempt, watched)
    }

    /// A reflector of every object `cfg` selects, `modify` applied to each before it is stored.
    fn spawn<K>(
        &self,
        cfg: watcher::Config,
        modify: impl FnMut(&mut K) + Send + 'static,
        operation: &'static str,
    ) -> Watched<K>
    where
        K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
        K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
    {
        let (store, writer) = reflector::store::<K>();
        let revision = Arc::new(watch::Sender::new(0));
        let synced = Arc::new(AtomicBool::new(false));
        let stream = watcher(Api::all(self.client.clone()), cfg)
            .modify(modify)
            .backoff(self.backoff.clone())
            .reflect(writer);
        let metrics = self.metrics.clone();
        let shutdown = self.shutdown.clone();
        let task = {
            let revision = revision.clone();
            let synced = synced.clone();
            tokio::spawn(async move {
                let mut stream = std::pin::pin!(stream);
                loop {
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        ev = stream.next() => match ev {
                            Some(Ok(event)) => {
                                if matches!(event, watcher::Event::InitDone) && !synced.swap(true, Ordering::AcqRel) {
                                    tracing::info!(operation, "cache synced");
                                }
                                revision.send_modify(|r| *r += 1);
                            }
                            Some(Err(e)) => {
                                metrics.api_error(operation);
                                tracing::warn!(operation, error = %e, "watch failed; retrying with backoff");
                            }
                            None => break,
                        }
                    }
                }
            })
        };
        Watched {
            store,
            revision,
            synced,
            task,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn backoff_grows_to_the_cap_with_jitter_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(400));
        let d: Vec<_> = (0..5).map(|_| b.next_delay()).collect();
        for (got, base) in d.iter().zip([100u64, 200, 400, 400, 400]) {
            let base = Duration::from_millis(base);
            assert!(
                *got >= base.mul_f64(0.8) && *got <= base.mul_f64(1.2),
                "{got:?} vs {base:?}"
            );
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(120));
    }
}
