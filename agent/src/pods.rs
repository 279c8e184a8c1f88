//! Watching the agent's own Node and the pods bound to it (kube reflectors), and summarising those pods
//! for attribution.

use std::borrow::Borrow;
use std::collections::{BTreeMap, HashSet};
use std::fmt::Debug;
use std::hash::Hash;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{
    Container, Namespace, Node, NodeStatus, Pod, PodSpec, PodStatus, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::core::PartialObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use teeguard_shared::TeeKind;
use teeguard_shared::config::ResourcesConfig;
use teeguard_shared::names::{
    AGENT_EXTENDED_RESOURCES_ANNOTATION, EXEMPT_LABEL, MISC_MAX_ANNOTATION_PREFIX,
    NFD_EXTENDED_RESOURCES_ANNOTATION,
};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::attribution::PodSummary;
use crate::metrics::Metrics;

/// A pod bound to the node, as the agent caches it: only what attribution and the limits read.
///
/// It is decoded straight from the API server's JSON into these few fields (labels, annotations,
/// managed fields, volumes, env, probes... are skipped by the decoder, never allocated), and the
/// reflector then drops every resource quantity that is not a TEE key. [`CachedPod::to_pod`] rebuilds
/// a `Pod` with just these fields so that the one implementation of the request rules
/// (`teeguard_shared::pod::key_requests`) is used.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct CachedPod {
    /// Name, namespace, generate name, UID, resource version, the exempt label and teeguard's
    /// limit annotations only.
    #[serde(default, deserialize_with = "slim_meta")]
    metadata: ObjectMeta,
    #[serde(default)]
    spec: Option<CachedSpec>,
    #[serde(default)]
    status: Option<CachedStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CachedSpec {
    #[serde(default)]
    containers: Option<Vec<CachedContainer>>,
    #[serde(default)]
    init_containers: Option<Vec<CachedContainer>>,
    #[serde(default)]
    overhead: Option<BTreeMap<String, Quantity>>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CachedContainer {
    /// Kept for the container-level limits (NRI `CreateContainer` names the container).
    #[serde(default)]
    name: String,
    #[serde(default)]
    resources: Option<CachedResources>,
    #[serde(default)]
    restart_policy: Option<String>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
struct CachedResources {
    #[serde(default)]
    requests: Option<BTreeMap<String, Quantity>>,
    #[serde(default)]
    limits: Option<BTreeMap<String, Quantity>>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
struct CachedStatus {
    #[serde(default)]
    phase: Option<String>,
}

#[derive(Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SlimMeta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    generate_name: Option<String>,
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    annotations: Option<BTreeMap<String, String>>,
}

/// Keep only the entries of `map` whose key `keep` accepts; `None` when none is left.
fn keep_only(
    map: Option<BTreeMap<String, String>>,
    keep: impl Fn(&str) -> bool,
) -> Option<BTreeMap<String, String>> {
    let kept: BTreeMap<String, String> = map?.into_iter().filter(|(k, _)| keep(k)).collect();
    (!kept.is_empty()).then_some(kept)
}

fn slim_meta<'de, D: serde::Deserializer<'de>>(d: D) -> Result<ObjectMeta, D::Error> {
    let m = Option::<SlimMeta>::deserialize(d)?.unwrap_or_default();
    Ok(ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        generate_name: m.generate_name,
        uid: m.uid,
        resource_version: m.resource_version,
        // Strict mode leaves exempt pods alone; the limits check teeguard's own annotation.
        labels: keep_only(m.labels, |k| k == EXEMPT_LABEL),
        annotations: keep_only(m.annotations, |k| k.starts_with(MISC_MAX_ANNOTATION_PREFIX)),
        ..ObjectMeta::default()
    })
}

impl CachedPod {
    /// Keep only the quantities named in `names` (the TEE key resources); every other request,
    /// limit and overhead entry is dropped.
    pub fn retain_resources(&mut self, names: &[String]) {
        let keep = |m: &mut Option<BTreeMap<String, Quantity>>| {
            if let Some(map) = m {
                map.retain(|k, _| names.iter().any(|n| n == k));
                if map.is_empty() {
                    *m = None;
                }
            }
        };
        let Some(spec) = &mut self.spec else { return };
        keep(&mut spec.overhead);
        for c in spec
            .containers
            .iter_mut()
            .chain(spec.init_containers.iter_mut())
            .flatten()
        {
            if let Some(r) = &mut c.resources {
                keep(&mut r.requests);
                keep(&mut r.limits);
                if r.requests.is_none() && r.limits.is_none() {
                    c.resources = None;
                }
            }
        }
    }

    /// A `Pod` holding just the cached fields.
    pub fn to_pod(&self) -> Pod {
        let containers = |cs: &Vec<CachedContainer>| -> Vec<Container> {
            cs.iter()
                .map(|c| Container {
                    name: c.name.clone(),
                    resources: c.resources.as_ref().map(|r| ResourceRequirements {
                        requests: r.requests.clone(),
                        limits: r.limits.clone(),
                        ..ResourceRequirements::default()
                    }),
                    restart_policy: c.restart_policy.clone(),
                    ..Container::default()
                })
                .collect()
        };
        Pod {
            metadata: self.metadata.clone(),
            spec: self.spec.as_ref().map(|s| PodSpec {
                containers: s.containers.as_ref().map(containers).unwrap_or_default(),
                init_containers: s.init_containers.as_ref().map(containers),
                overhead: s.overhead.clone(),
                ..PodSpec::default()
            }),
            status: self.status.as_ref().map(|s| PodStatus {
                phase: s.phase.clone(),
                ..PodStatus::default()
            }),
        }
    }
}

teeguard_shared::reduced_pod_resource!(CachedPod);

/// Drop what the agent never reads from its Node: keep name, UID, resource version, the two
/// extended-resource ownership annotations, and `status.capacity` / `status.allocatable`.
pub fn slim_node(node: &mut Node) {
    let meta = &mut node.metadata;
    *meta = ObjectMeta {
        name: meta.name.take(),
        uid: meta.uid.take(),
        resource_version: meta.resource_version.take(),
        annotations: meta.annotations.take().and_then(|mut a| {
            a.retain(|k, _| {
                k == AGENT_EXTENDED_RESOURCES_ANNOTATION || k == NFD_EXTENDED_RESOURCES_ANNOTATION
            });
            (!a.is_empty()).then_some(a)
        }),
        ..ObjectMeta::default()
    };
    node.spec = None;
    node.status = node.status.take().map(|s| NodeStatus {
        capacity: s.capacity,
        allocatable: s.allocatable,
        ..NodeStatus::default()
    });
}

pub use teeguard_shared::ops::Backoff;

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

/// Watch the pods bound to `node_name` (field selector `spec.nodeName=<node>`), caching only what
/// attribution needs (see [`CachedPod`]).
pub fn watch_pods(
    client: Client,
    node_name: &str,
    resources: &ResourcesConfig,
    backoff: Backoff,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> Watched<CachedPod> {
    let cfg = watcher::Config::default().fields(&format!("spec.nodeName={node_name}"));
    let names: Vec<String> = TeeKind::ALL
        .iter()
        .map(|k| resources.resource_name(*k).to_string())
        .collect();
    spawn_reflector(
        Api::all(client),
        cfg,
        move |p: &mut CachedPod| p.retain_resources(&names),
        "watch pods",
        backoff,
        metrics,
        shutdown,
    )
}

/// The namespaces labelled `teeguard.dev/exempt: "true"` (strict mode leaves their pods alone, as the
/// webhook does). Cheap to clone; empty when not watched.
#[derive(Clone, Default)]
pub struct ExemptNamespaces {
    store: Option<Store<PartialObjectMeta<Namespace>>>,
    synced: Option<Arc<AtomicBool>>,
}

impl Debug for ExemptNamespaces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExemptNamespaces")
            .field("watched", &self.store.is_some())
            .finish()
    }
}

impl ExemptNamespaces {
    /// Whether `namespace` is labelled exempt (as the watch last saw it). Before the watch's first
    /// list every namespace counts as exempt: strict mode zeroes no pod it cannot yet tell is exempt
    /// (a wrong zero would stop a container that should start; a late one only delays strictness).
    pub fn contains(&self, namespace: &str) -> bool {
        let Some(store) = &self.store else {
            return false;
        };
        let synced = self
            .synced
            .as_ref()
            .is_some_and(|s| s.load(Ordering::Acquire));
        !synced || store.get(&reflector::ObjectRef::new(namespace)).is_some()
    }
}

/// Watch the namespaces labelled `teeguard.dev/exempt=true` (metadata only; the label selector keeps
/// the watch to those few). A namespace's label added or removed takes effect for containers created
/// from then on and, with the cgroup writer, at the next poll.
pub fn watch_exempt_namespaces(
    client: Client,
    backoff: Backoff,
    metrics: Metrics,
    shutdown: CancellationToken,
) -> (ExemptNamespaces, Watched<PartialObjectMeta<Namespace>>) {
    let cfg = watcher::Config::default().labels(&format!("{EXEMPT_LABEL}=true"));
    let watched = spawn_reflector(
        Api::all(client),
        cfg,
        |_: &mut PartialObjectMeta<Namespace>| {},
        "watch exempt namespaces",
        backoff,
        metrics,
        shutdown,
    );
    let exempt = ExemptNamespaces {
        store: Some(watched.store.clone()),
        synced: Some(watched.synced.clone()),
    };
    (exempt, watched)
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
        slim_node,
        "watch node",
        backoff,
        metrics,
        shutdown,
    )
}

fn spawn_reflector<K>(
    api: Api<K>,
    cfg: watcher::Config,
    modify: impl FnMut(&mut K) + Send + 'static,
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
        .modify(modify)
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
pub fn summarize(
    pods: impl IntoIterator<Item = impl Borrow<Pod>>,
    resources: &ResourcesConfig,
) -> PodsView {
    let mut view = PodsView::default();
    for pod in pods {
        let pod = pod.borrow();
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
    use std::time::Duration;
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

    /// Full pods (as the API server sends them) and the cached form give the same summaries.
    fn pods_json() -> Vec<serde_json::Value> {
        use teeguard_tests::fixtures::{self as fx, KataTee, Tee, VirtLauncherPod};
        let mut pods = vec![
            VirtLauncherPod::for_tee("a", Tee::Tdx)
                .request("tdx.intel.com/keys", "1")
                .running_on("n1")
                .to_value(),
            VirtLauncherPod::for_tee("b", Tee::SevEs)
                .request("sev-snp.amd.com/esids", "1")
                .large()
                .to_value(),
            VirtLauncherPod::for_tee("c", Tee::Sev)
                .generated_name()
                .to_value(),
            fx::to_value(&fx::kata_pod("k", KataTee::Tdx)),
            fx::to_value(&fx::storage_binding_pod("d", Tee::Tdx)),
            fx::to_value(&fx::hotplug_pod("e", "n1")),
        ];
        for (i, p) in pods.iter_mut().enumerate() {
            p["metadata"]["uid"] = json!(format!("uid-{i}"));
        }
        pods.push(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "inits", "namespace": "ns", "uid": "uid-inits", "labels": {"x": "y"},
                         "managedFields": [{"manager": "kubelet"}]},
            "spec": {
                "containers": [{"name": "c", "resources": {"limits": {"tdx.intel.com/keys": "1", "cpu": "1"}}}],
                "initContainers": [
                    {"name": "i", "resources": {"requests": {"tdx.intel.com/keys": "3"}}},
                    {"name": "s", "restartPolicy": "Always", "resources": {"requests": {"tdx.intel.com/keys": "1"}}}
                ],
                "overhead": {"tdx.intel.com/keys": "1", "memory": "100Mi"}
            },
            "status": {"phase": "Pending", "conditions": [{"type": "Ready", "status": "False"}]}
        }));
        pods.push(json!({"metadata": {"name": "bad", "namespace": "ns", "uid": "uid-bad"},
            "spec": {"containers": [{"name": "c", "resources": {"requests": {"tdx.intel.com/keys": "0.5"}}}]}}));
        pods.push(json!({"metadata": {"name": "nulls", "namespace": "ns", "uid": "uid-nulls", "labels": null},
            "spec": {"containers": [{"name": "c", "resources": null}], "initContainers": null, "overhead": null},
            "status": null}));
        pods.push(
            json!({"metadata": {"name": "no-uid", "namespace": "ns"}, "spec": {"containers": []}}),
        );
        pods
    }

    #[test]
    fn cached_pods_summarize_like_full_pods() {
        let res = ResourcesConfig::default();
        let names: Vec<String> = TeeKind::ALL
            .iter()
            .map(|k| res.resource_name(*k).to_string())
            .collect();
        let json = pods_json();
        let full: Vec<Pod> = json
            .iter()
            .map(|p| serde_json::from_value(p.clone()).expect("pod"))
            .collect();
        let cached: Vec<CachedPod> = json
            .iter()
            .map(|p| {
                let mut c: CachedPod = serde_json::from_value(p.clone()).expect("cached pod");
                c.retain_resources(&names);
                c
            })
            .collect();
        let want = summarize(full.iter(), &res);
        let got = summarize(cached.iter().map(CachedPod::to_pod), &res);
        pretty_assertions::assert_eq!(got, want);
        // The fixtures exercise what matters: key requests, pods without, errors, pods without UID.
        assert!(want.interest.len() >= 3, "{want:?}");
        assert!(want.pods.iter().any(|p| !p.requests_keys()), "{want:?}");
        assert_eq!(want.errors.len(), 1, "{want:?}");
        assert_eq!(want.pods.len(), json.len() - 2);
    }

    #[test]
    fn cached_pods_keep_identity_and_only_tee_quantities() {
        let res = ResourcesConfig::default();
        let names: Vec<String> = TeeKind::ALL
            .iter()
            .map(|k| res.resource_name(*k).to_string())
            .collect();
        let json = pods_json();
        let inits = json
            .iter()
            .find(|p| p["metadata"]["name"] == "inits")
            .expect("inits pod");
        let mut c: CachedPod = serde_json::from_value(inits.clone()).expect("cached pod");
        c.retain_resources(&names);
        assert_eq!(c.meta().name.as_deref(), Some("inits"));
        assert_eq!(c.meta().uid.as_deref(), Some("uid-inits"));
        assert_eq!(c.meta().labels, None);
        assert_eq!(c.meta().managed_fields, None);
        let pod = c.to_pod();
        let spec = pod.spec.expect("spec");
        let limits = spec.containers[0]
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .expect("limits");
        assert_eq!(limits.keys().collect::<Vec<_>>(), ["tdx.intel.com/keys"]);
        let overhead = spec.overhead.expect("overhead");
        assert_eq!(overhead.keys().collect::<Vec<_>>(), ["tdx.intel.com/keys"]);
        let inits = spec.init_containers.expect("init containers");
        assert_eq!(inits[1].restart_policy.as_deref(), Some("Always"));
        assert_eq!(pod.status.and_then(|s| s.phase).as_deref(), Some("Pending"));
        // A pod with no TEE quantity at all keeps no resources.
        let mut plain: CachedPod = serde_json::from_value(json!({
            "metadata": {"name": "p", "uid": "u"},
            "spec": {"containers": [{"name": "c", "resources": {"requests": {"cpu": "1"}}}]}
        }))
        .expect("plain pod");
        plain.retain_resources(&names);
        assert_eq!(
            plain.to_pod().spec.expect("spec").containers[0].resources,
            None
        );
        // Kubernetes' resource coordinates.
        assert_eq!(
            CachedPod::url_path(&(), Some("ns")),
            Pod::url_path(&(), Some("ns"))
        );
        assert_eq!(CachedPod::api_version(&()), Pod::api_version(&()));
        assert_eq!(CachedPod::kind(&()), Pod::kind(&()));
    }

    #[test]
    fn slim_node_plans_like_the_full_node() {
        use crate::advertise::{Desired, plan};
        use teeguard_tests::fixtures::NodeBuilder;
        let res = ResourcesConfig::default();
        for builder in [
            NodeBuilder::new("n1").tdx(64),
            NodeBuilder::new("n1")
                .sev(509, 100)
                .nfd_extended_resource(true),
            NodeBuilder::new("n1")
                .tdx(64)
                .annotation(AGENT_EXTENDED_RESOURCES_ANNOTATION, "tdx.intel.com/keys")
                .label("zone", "a"),
        ] {
            let mut value = builder.to_value();
            value["metadata"]["uid"] = json!("node-uid");
            value["metadata"]["resourceVersion"] = json!("42");
            value["status"]["images"] = json!([{"names": ["registry/img:1"], "sizeBytes": 1}]);
            let full: Node = serde_json::from_value(value).expect("node");
            let mut slim = full.clone();
            slim_node(&mut slim);
            assert_eq!(slim.metadata.uid.as_deref(), Some("node-uid"));
            assert_eq!(slim.metadata.resource_version.as_deref(), Some("42"));
            assert_eq!(slim.metadata.labels, None);
            assert_eq!(slim.status.as_ref().and_then(|s| s.images.as_ref()), None);
            for (enabled, tdx) in [(true, 60), (true, 64), (false, 1)] {
                let desired = Desired {
                    enabled,
                    values: BTreeMap::from([(TeeKind::Tdx, tdx), (TeeKind::Sev, 500)]),
                };
                pretty_assertions::assert_eq!(
                    plan(&slim, &desired, &res),
                    plan(&full, &desired, &res)
                );
            }
        }
    }
}
