//! What the agent's watches cache of the pods bound to its node and of its Node: only what
//! attribution, the limits and advertising read, decoded straight from the API server's JSON.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Container, Node, NodeStatus, Pod, PodExtendedResourceClaimStatus, PodResourceClaim,
    PodResourceClaimStatus, PodSpec, PodStatus, ResourceClaim as ContainerClaim,
    ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;
use teeguard_shared::names::{
    AGENT_EXTENDED_RESOURCES_ANNOTATION, EXEMPT_LABEL, KUBEVIRT_LABEL, MISC_MAX_ANNOTATION_PREFIX,
    NFD_EXTENDED_RESOURCES_ANNOTATION,
};

/// The annotation of a mirror pod naming its static pod's configuration hash, which the kubelet runs
/// the static pod under as its UID.
pub const MIRROR_POD_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// The UID the node runs `pod` under: a mirror pod's static pod's ([`MIRROR_POD_ANNOTATION`]), or
/// the pod's own.
pub fn runtime_uid(pod: &Pod) -> Option<&str> {
    static_pod_uid(pod.metadata.annotations.as_ref())
        .or(pod.metadata.uid.as_ref())
        .map(String::as_str)
}

/// The UID of a mirror pod's static pod, from the mirror's `annotations`.
pub(crate) fn static_pod_uid(annotations: Option<&BTreeMap<String, String>>) -> Option<&String> {
    annotations?
        .get(MIRROR_POD_ANNOTATION)
        .filter(|hash| !hash.is_empty())
}

/// A pod bound to the node, as the agent caches it: only what attribution and the limits read. Its
/// `metadata.uid` is the UID the node runs it under (a mirror pod's: its static pod's).
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
    /// `spec.resourceClaims` (DRA mode: claims of the pod's own; a few short names each).
    #[serde(default)]
    resource_claims: Option<Vec<PodResourceClaim>>,
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
    /// The pod's claims the container uses (DRA mode).
    #[serde(default)]
    claims: Option<Vec<ContainerClaim>>,
}

#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(rename_all = "camelCase")]
struct CachedStatus {
    #[serde(default)]
    phase: Option<String>,
    /// The claims made from the pod's templates (DRA mode).
    #[serde(default)]
    resource_claim_statuses: Option<Vec<PodResourceClaimStatus>>,
    /// The claim through which the scheduler allocated the pod's extended resources, per container
    /// (DRA mode).
    #[serde(default)]
    extended_resource_claim_status: Option<PodExtendedResourceClaimStatus>,
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
    // A static pod (a manifest of the kubelet's) runs under the UID its mirror pod's annotation
    // names, not the mirror's own: the UID of its cgroup and of the runtime's NRI requests.
    let uid = static_pod_uid(m.annotations.as_ref()).cloned().or(m.uid);
    Ok(ObjectMeta {
        name: m.name,
        namespace: m.namespace,
        generate_name: m.generate_name,
        uid,
        resource_version: m.resource_version,
        // Strict mode leaves exempt pods alone; a virt-launcher's `compute` holds a key its
        // RuntimeClass put in the overhead; the limits check teeguard's own annotation.
        labels: keep_only(m.labels, |k| k == EXEMPT_LABEL || k == KUBEVIRT_LABEL),
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
                if r.requests.is_none() && r.limits.is_none() && r.claims.is_none() {
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
                        claims: r.claims.clone(),
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
                resource_claims: s.resource_claims.clone(),
                ..PodSpec::default()
            }),
            status: self.status.as_ref().map(|s| PodStatus {
                phase: s.phase.clone(),
                resource_claim_statuses: s.resource_claim_statuses.clone(),
                extended_resource_claim_status: s.extended_resource_claim_status.clone(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::attribution::summarize;
    use kube::Resource;
    use serde_json::json;
    use teeguard_shared::TeeKind;
    use teeguard_shared::config::ResourcesConfig;

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
            {
                // KubeVirt's defaultRuntimeClass with the key in overhead.podFixed.
                let mut v = VirtLauncherPod::for_tee("rc", Tee::Tdx)
                    .annotation("misc-max.teeguard.dev/compute", "tdx 1")
                    .to_value();
                v["spec"]["runtimeClassName"] = json!("kata-qemu-tdx");
                v["spec"]["overhead"] = json!({"tdx.intel.com/keys": "1", "memory": "160Mi"});
                v
            },
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
        // DRA mode: a pod whose extended resource the scheduler allocated through a claim, and one
        // with a claim of its own.
        pods.push(json!({"metadata": {"name": "dra", "namespace": "ns", "uid": "dra-uid"},
            "spec": {"containers": [{"name": "compute", "resources": {"requests": {"tdx.intel.com/keys": "1"}}}]},
            "status": {"phase": "Running", "extendedResourceClaimStatus": {"resourceClaimName": "dra-extended-resources-x",
                "requestMappings": [{"containerName": "compute", "resourceName": "tdx.intel.com/keys", "requestName": "container-0-request-0"}]}}}));
        pods.push(json!({"metadata": {"name": "claims", "namespace": "ns", "uid": "claims-uid"},
            "spec": {"containers": [{"name": "c", "resources": {"claims": [{"name": "key", "request": "tdx"}],
                                                               "requests": {"cpu": "1"}}}],
                     "resourceClaims": [{"name": "key", "resourceClaimTemplateName": "t"}]},
            "status": {"resourceClaimStatuses": [{"name": "key", "resourceClaimName": "claims-key-x"}]}}));
        pods
    }

    #[test]
    fn cached_pods_get_the_limits_of_full_pods_including_those_from_dra_claims() {
        use crate::decide::claimed::ClaimedKeys;
        use crate::decide::claimed::tests::prepared_in;
        use crate::decide::limits::{self, PodFacts, Policy};
        let res = ResourcesConfig::default();
        let names = res.resource_names();
        let claims = ClaimedKeys::from_prepared(&[
            prepared_in(
                "ns",
                "dra-extended-resources-x",
                &[("container-0-request-0", "tdx-0")],
            ),
            prepared_in("ns", "claims-key-x", &[("tdx", "tdx-1")]),
        ]);
        let policy = Policy {
            resources: &res,
            host_kinds: &[TeeKind::Tdx],
            strict: true,
        };
        let none = BTreeMap::new();
        let mut limited = 0;
        for json in pods_json() {
            let full: Pod = serde_json::from_value(json.clone()).expect("pod");
            let mut cached: CachedPod = serde_json::from_value(json).expect("cached pod");
            cached.retain_resources(&names);
            let cached = cached.to_pod();
            let facts = |pod| PodFacts {
                pod: Some(pod),
                annotations: &none,
                namespace_exempt: false,
                claimed: &claims,
            };
            let spec = full.spec.clone().unwrap_or_default();
            for c in spec
                .containers
                .iter()
                .chain(spec.init_containers.iter().flatten())
            {
                let want = limits::container_limit(facts(&full), &c.name, policy);
                assert_eq!(
                    limits::container_limit(facts(&cached), &c.name, policy),
                    want,
                    "{:?} {}",
                    full.metadata.name,
                    c.name
                );
                limited += usize::from(want != limits::ContainerLimit::Unlimited);
            }
            assert_eq!(
                limits::pod_limits(&cached, false, &claims, policy),
                limits::pod_limits(&full, false, &claims, policy),
                "{:?}",
                full.metadata.name
            );
        }
        assert!(limited >= 4, "the fixtures exercise limits: {limited}");
        // The claim of its own is what limits the `claims` pod's container.
        let claims_pod: Pod = serde_json::from_value(pods_json().pop().expect("pod")).expect("pod");
        assert_eq!(
            limits::pod_limits(&claims_pod, false, &claims, policy),
            vec![limits::Limit {
                kind: TeeKind::Tdx,
                keys: 1
            }]
        );
    }

    #[test]
    fn cached_pods_summarize_like_full_pods() {
        let res = ResourcesConfig::default();
        let names = res.resource_names();
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
        assert_eq!(
            want.pods.iter().filter(|p| p.dra_claim).count(),
            2,
            "{want:?}"
        );
    }

    #[test]
    fn cached_pods_keep_identity_and_only_tee_quantities() {
        let res = ResourcesConfig::default();
        let names = res.resource_names();
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
    fn a_mirror_pod_is_cached_under_the_uid_its_static_pod_runs_with() {
        let mirror = json!({
            "metadata": {"name": "proxy-n1", "namespace": "kube-system", "uid": "api-uid",
                         "annotations": {MIRROR_POD_ANNOTATION: "0f3c5e7a", "kubernetes.io/config.source": "file"}},
            "spec": {"containers": [{"name": "proxy"}]}
        });
        let full: Pod = serde_json::from_value(mirror.clone()).expect("a pod");
        assert_eq!(runtime_uid(&full), Some("0f3c5e7a"), "a lookup's pod");
        let cached: CachedPod = serde_json::from_value(mirror).expect("decodes");
        assert_eq!(cached.to_pod().metadata.uid.as_deref(), Some("0f3c5e7a"));
        let plain = json!({"metadata": {"name": "p", "namespace": "ns", "uid": "api-uid",
                                        "annotations": {MIRROR_POD_ANNOTATION: ""}}});
        let cached: CachedPod = serde_json::from_value(plain).expect("decodes");
        assert_eq!(cached.to_pod().metadata.uid.as_deref(), Some("api-uid"));
    }

    #[test]
    fn slim_node_plans_like_the_full_node() {
        use crate::decide::advertise::{Desired, plan};
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
