//! Watching the agent's own Node and the pods bound to it (kube reflectors), and summarising those pods
//! for attribution.

use std::collections::HashSet;
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;
use teeguard_shared::config::ResourcesConfig;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::attribution::PodSummary;
use crate::metrics::Metrics;

/// Exponential backoff with jitter for watches and API retries.
#[derive(Clone, Debug)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
    seed: u64,
}

impl Backoff {
    /// Start at `initial`, double up to `max`, with ±20 % jitter.
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x9E37_79B9_7F4A_7C15)
            | 1;
        Backoff {
            initial,
            max: max.max(initial),
            next: initial,
            seed,
        }
    }

    /// The next delay.
    pub fn next_delay(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(self.max);
        // xorshift64: cheap jitter so that a DaemonSet does not retry in lockstep.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let permille = 800 + (self.seed % 401); // 0.8 ..= 1.2
        base.mul_f64(permille as f64 / 1000.0)
    }

    /// Back to the initial delay (after a success).
    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

impl Iterator for Backoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        Some(self.next_delay())
    }
}

impl kube::runtime::utils::Backoff for Backoff {
    fn reset(&mut self) {
        Backoff::reset(self);
    }
}

/// A running reflector: its store, a notification on every change, and whether the initial list
/// completed.
pub struct Watched<K: Resource + 'static>
where
    K::DynamicType: Eq + Hash + Clone,
{
    /// The cache.
    pub store: Store<K>,
    /// Notified (coalesced) whenever an event was applied to the store.
    pub changed: Arc<Notify>,
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

/// Watch the pods bound to `node_name` (field selector `spec.nodeName=<node>`).
pub fn watch_pods(
    client: Client,
    node_name: &str,
    backoff: Backoff,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> Watched<Pod> {
    let cfg = watcher::Config::default().fields(&format!("spec.nodeName={node_name}"));
    spawn_reflector(
        Api::all(client),
        cfg,
        "watch pods",
        backoff,
        metrics,
        shutdown,
    )
}

/// Watch the agent's own Node (field selector `metadata.name=<node>`).
pub fn watch_node(
    client: Client,
    node_name: &str,
    backoff: Backoff,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> Watched<Node> {
    let cfg = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
    spawn_reflector(
        Api::all(client),
        cfg,
        "watch node",
        backoff,
        metrics,
        shutdown,
    )
}

fn spawn_reflector<K>(
    api: Api<K>,
    cfg: watcher::Config,
    operation: &'static str,
    backoff: Backoff,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> Watched<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + Hash + Clone + Send + Sync,
{
    let (store, writer) = reflector::store::<K>();
    let changed = Arc::new(Notify::new());
    let synced = Arc::new(AtomicBool::new(false));
    let stream = watcher(api, cfg)
        .modify(|o: &mut K| o.meta_mut().managed_fields = None)
        .backoff(backoff)
        .reflect(writer);
    let task = {
        let changed = changed.clone();
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
                            changed.notify_one();
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
        changed,
        synced,
        task,
    }
}

/// Pods summarised for attribution.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodsView {
    /// Every pod with a UID.
    pub pods: Vec<PodSummary>,
    /// UIDs of non-terminated pods that request keys: the pod cgroups worth reading.
    pub interest: HashSet<String>,
    /// Pods whose TEE quantities could not be parsed (`namespace/name: error`); counted as requesting
    /// nothing.
    pub errors: Vec<(String, String)>,
}

/// Summarise pods.
pub fn summarize<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    resources: &ResourcesConfig,
) -> PodsView {
    let mut view = PodsView::default();
    for pod in pods {
        match PodSummary::from_pod(pod, resources) {
            Ok(Some(s)) => {
                if s.requests_keys() && !s.phase.is_terminated() {
                    view.interest.insert(s.uid.clone());
                }
                view.pods.push(s);
            }
            Ok(None) => {}
            Err(e) => view
                .errors
                .push((pod.metadata.uid.clone().unwrap_or_default(), e.to_string())),
        }
    }
    view.pods.sort_by(|a, b| a.name.cmp(&b.name));
    view
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attribution::{KindCounts, PodPhase};
    use serde_json::json;
    use teeguard_shared::TeeKind;

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

    #[test]
    fn summarize_interest_and_errors() {
        let res = ResourcesConfig::default();
        let mk = |uid: &str, phase: &str, q: &str| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"name": uid, "namespace": "ns", "uid": uid},
                "spec": {"nodeName": "n1", "containers": [{"name": "compute", "resources": {"requests": {"tdx.intel.com/keys": q}}}]},
                "status": {"phase": phase}
            }))
            .expect("pod")
        };
        let pods = [
            mk("a", "Running", "1"),
            mk("b", "Succeeded", "1"),
            mk("c", "Pending", "0"),
            mk("d", "Running", "1.5"),
        ];
        let v = summarize(pods.iter(), &res);
        assert_eq!(v.interest, HashSet::from(["a".to_string()]));
        assert_eq!(v.pods.len(), 3);
        assert_eq!(
            v.pods[0].requests,
            KindCounts::from_pairs([(TeeKind::Tdx, 1)])
        );
        assert_eq!(v.pods[1].phase, PodPhase::Succeeded);
        assert_eq!(v.errors.len(), 1);
        assert!(v.errors[0].1.contains("ns/d"), "{:?}", v.errors);
    }
}
