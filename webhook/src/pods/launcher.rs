//! The few fields of a virt-launcher Pod the validating webhook needs for a binding: [`LauncherPod`],
//! a reduced type for the watch and the GET on a miss, and [`CachedLauncherPod`], what the pod cache
//! keeps.
//!
//! A virt-launcher pod is 5–20 KB of JSON (volumes, env, probes, status); a binding decision needs only
//! the metadata (labels, owner, the storage-binding annotation) and each container's resources. Reading
//! pods into [`LauncherPod`] skips everything else at deserialisation, and the cache keeps only the few
//! labels, annotations and extended resources decisions read, in flat slices, so a cache of tens of
//! thousands of pods stays small.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde::{Deserialize, Serialize};
use teeguard_shared::names;

/// A core/v1 Pod reduced to metadata and container resources.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LauncherPod {
    /// Metadata.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// The parts of `spec` that decide the pod's key requests and its node.
    #[serde(default)]
    pub spec: LauncherPodSpec,
    /// `status.phase` only: a pod that ended holds no key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<LauncherPodStatus>,
}

/// `status`, reduced.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LauncherPodStatus {
    /// `status.phase`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
}

impl LauncherPod {
    /// Whether the pod ended (`Succeeded` or `Failed`): its containers stopped, its keys are free.
    pub fn ended(&self) -> bool {
        let phase = self.status.as_ref().and_then(|s| s.phase.as_deref());
        matches!(phase, Some("Succeeded" | "Failed"))
    }
}

/// `spec`, reduced.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LauncherPodSpec {
    /// `spec.nodeName`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_name: Option<String>,
    /// `spec.containers`, reduced.
    #[serde(default)]
    pub containers: Vec<ContainerResources>,
    /// `spec.initContainers`, reduced.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub init_containers: Vec<ContainerResources>,
    /// `spec.overhead`, extended resources only ([`crate::pods::decode::read_resource`]).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::pods::decode::decode_resource_list"
    )]
    pub overhead: Option<BTreeMap<String, Quantity>>,
}

/// A container's name, resources and restart policy (sidecars count like containers).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerResources {
    /// Name.
    #[serde(default)]
    pub name: String,
    /// Requests and limits, extended resources only ([`crate::pods::decode::read_resource`]).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "crate::pods::decode::decode_resources"
    )]
    pub resources: Option<ResourceRequirements>,
    /// `Always` for a sidecar init container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_policy: Option<String>,
}

teeguard_shared::reduced_pod_resource!(LauncherPod);

impl ContainerResources {
    /// A k8s-openapi [`Container`] carrying exactly these fields (moved).
    pub fn into_container(self) -> Container {
        Container {
            name: self.name,
            resources: self.resources,
            restart_policy: self.restart_policy,
            ..Container::default()
        }
    }
}

/// A virt-launcher pod as the cache keeps it: [`LauncherPod`] reduced to what a binding decision
/// reads (identity, the `kubevirt.io` and exemption labels, the storage-binding and domain
/// annotations, the controller owner, the node, and the extended resources of each container), held
/// in boxed slices: a `BTreeMap` costs a whole B-tree node (about 540 bytes) even for one entry.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CachedLauncherPod {
    /// `metadata.name`.
    pub name: String,
    /// `metadata.namespace`.
    pub namespace: String,
    /// `metadata.uid`.
    pub uid: Option<String>,
    /// The kept labels.
    pub labels: Box<[(String, String)]>,
    /// The kept annotations.
    pub annotations: Box<[(String, String)]>,
    /// The controller owner reference.
    pub owner: Option<OwnerReference>,
    /// `spec.nodeName`.
    pub node_name: Option<String>,
    /// Containers with at least one extended resource (the others ask for no key).
    pub containers: Box<[CachedContainer]>,
    /// Init containers likewise.
    pub init_containers: Box<[CachedContainer]>,
    /// The extended resources of `spec.overhead`.
    pub overhead: Box<[(String, Quantity)]>,
    /// The pod ended (`Succeeded` or `Failed`).
    pub ended: bool,
}

/// A container's extended resources (names with a `/`: every TEE key resource is one).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CachedContainer {
    /// Name.
    pub name: String,
    /// `Always` for a sidecar init container.
    pub restart_policy: Option<String>,
    /// Extended-resource requests.
    pub requests: Box<[(String, Quantity)]>,
    /// Extended-resource limits.
    pub limits: Box<[(String, Quantity)]>,
}

/// A resource list as a flat slice. Only extended resources are in it already: container resources and
/// overhead are decoded through [`crate::pods::decode::decode_resource_list`].
fn extended(m: Option<BTreeMap<String, Quantity>>) -> Box<[(String, Quantity)]> {
    m.into_iter().flatten().collect()
}

fn kept(
    m: Option<BTreeMap<String, String>>,
    keep: impl Fn(&str) -> bool,
) -> Box<[(String, String)]> {
    m.into_iter()
        .flatten()
        .filter(|(k, _)| keep(k.as_str()))
        .collect()
}

fn to_map<V: Clone>(pairs: &[(String, V)]) -> Option<BTreeMap<String, V>> {
    (!pairs.is_empty()).then(|| pairs.iter().cloned().collect())
}

impl CachedContainer {
    fn reduce(c: ContainerResources) -> Option<Self> {
        let r = c.resources?;
        let (requests, limits) = (extended(r.requests), extended(r.limits));
        (!requests.is_empty() || !limits.is_empty()).then_some(CachedContainer {
            name: c.name,
            restart_policy: c.restart_policy,
            requests,
            limits,
        })
    }

    fn to_container(&self) -> Container {
        Container {
            name: self.name.clone(),
            resources: Some(ResourceRequirements {
                requests: to_map(&self.requests[..]),
                limits: to_map(&self.limits[..]),
                claims: None,
            }),
            restart_policy: self.restart_policy.clone(),
            ..Container::default()
        }
    }
}

impl From<LauncherPod> for CachedLauncherPod {
    fn from(p: LauncherPod) -> Self {
        let ended = p.ended();
        let m = p.metadata;
        CachedLauncherPod {
            name: m.name.unwrap_or_default(),
            namespace: m.namespace.unwrap_or_default(),
            uid: m.uid,
            labels: kept(m.labels, crate::pods::decode::read_label),
            annotations: kept(m.annotations, |k| {
                k == names::EPHEMERAL_PROVISIONING_ANNOTATION || k == names::DOMAIN_ANNOTATION
            }),
            owner: m
                .owner_references
                .into_iter()
                .flatten()
                .find(|o| o.controller == Some(true)),
            node_name: p.spec.node_name,
            containers: p
                .spec
                .containers
                .into_iter()
                .filter_map(CachedContainer::reduce)
                .collect(),
            init_containers: p
                .spec
                .init_containers
                .into_iter()
                .filter_map(CachedContainer::reduce)
                .collect(),
            overhead: extended(p.spec.overhead),
            ended,
        }
    }
}

impl CachedLauncherPod {
    /// A k8s-openapi Pod carrying exactly these fields, for the shared pod functions
    /// (`classify_pod`, `key_requests`): they decide as on the full pod.
    pub fn to_pod(&self) -> Pod {
        let containers = |cs: &[CachedContainer]| -> Vec<Container> {
            cs.iter().map(CachedContainer::to_container).collect()
        };
        Pod {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                namespace: (!self.namespace.is_empty()).then(|| self.namespace.clone()),
                uid: self.uid.clone(),
                labels: to_map(&self.labels[..]),
                annotations: to_map(&self.annotations[..]),
                owner_references: self.owner.clone().map(|o| vec![o]),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: self.node_name.clone(),
                containers: containers(&self.containers[..]),
                init_containers: (!self.init_containers.is_empty())
                    .then(|| containers(&self.init_containers[..])),
                overhead: to_map(&self.overhead[..]),
                ..PodSpec::default()
            }),
            status: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::Resource;
    use serde_json::json;
    use teeguard_shared::config::Config;
    use teeguard_shared::pod::key_requests;
    use teeguard_shared::{TeeKind, pod::KeyRequests};

    #[test]
    fn reads_only_what_it_needs_and_counts_keys_the_same() {
        let full = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "virt-launcher-vm-abcde", "namespace": "ns", "uid": "u1",
                "labels": {"kubevirt.io": "virt-launcher"},
                "annotations": {"kubevirt.io/domain": "vm", "pre.hook.backup.velero.io/command": "x"}},
            "spec": {
                "nodeName": "node01",
                "volumes": [{"name": "v", "emptyDir": {}}],
                "containers": [
                    {"name": "compute", "image": "i", "env": [{"name": "A", "value": "b"}],
                     "resources": {"requests": {"tdx.intel.com/keys": "1"}, "limits": {"tdx.intel.com/keys": "1"}}},
                    {"name": "side", "image": "i"}
                ],
                "initContainers": [{"name": "init", "restartPolicy": "Always",
                    "resources": {"requests": {"tdx.intel.com/keys": "1"}}}],
                "overhead": {"tdx.intel.com/keys": "1"}
            },
            "status": {"phase": "Pending"}
        });
        let cfg = Config::default();
        let pod: Pod = serde_json::from_value(full.clone()).expect("pod");
        let lp: LauncherPod = serde_json::from_value(full).expect("launcher pod");
        assert_eq!(lp.spec.node_name.as_deref(), Some("node01"));
        let want = KeyRequests::from([(TeeKind::Tdx, 3)]);
        assert_eq!(key_requests(&pod, &cfg.resources).expect("keys"), want);
        assert_eq!(
            LauncherPod::url_path(&(), Some("ns")),
            "/api/v1/namespaces/ns/pods"
        );
        // The cache's reduction keeps the decision inputs and drops the rest.
        let json = json!({
            "metadata": {"name": "virt-launcher-vm-abcde", "namespace": "ns", "uid": "u1",
                "resourceVersion": "9", "generateName": "virt-launcher-vm-",
                "labels": {"kubevirt.io": "virt-launcher", "kubevirt.io/vm": "vm",
                    "teeguard.dev/exempt": "false"},
                "annotations": {"kubevirt.io/domain": "vm", "x": "y"},
                "finalizers": ["f"],
                "ownerReferences": [
                    {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance", "name": "vm",
                     "uid": "vmi-uid", "controller": true},
                    {"apiVersion": "v1", "kind": "ConfigMap", "name": "c", "uid": "c"}]},
            "spec": {"containers": [
                {"name": "compute", "resources": {
                    "requests": {"cpu": "2", "memory": "1Gi", "tdx.intel.com/keys": "1"},
                    "limits": {"memory": "1Gi", "tdx.intel.com/keys": "1"}}},
                {"name": "side", "resources": {"requests": {"cpu": "100m"}}}],
                "overhead": {"cpu": "1"}}
        });
        let before: Pod = serde_json::from_value(json.clone()).expect("pod");
        let cached = CachedLauncherPod::from(
            serde_json::from_value::<LauncherPod>(json).expect("launcher pod"),
        );
        let after = cached.to_pod();
        assert_eq!(
            key_requests(&after, &cfg.resources).expect("keys"),
            key_requests(&before, &cfg.resources).expect("keys")
        );
        // (That the mutation classifies both alike: tests/admitted.rs, a layer above.)
        let m = &after.metadata;
        assert_eq!(
            (
                m.uid.as_deref(),
                m.namespace.as_deref(),
                m.generate_name.as_deref()
            ),
            (Some("u1"), Some("ns"), None)
        );
        assert_eq!(m.labels.as_ref().map(BTreeMap::len), Some(2));
        assert_eq!(m.annotations.as_ref().map(BTreeMap::len), Some(1));
        assert_eq!(m.owner_references.as_ref().map(Vec::len), Some(1));
        assert_eq!(cached.containers.len(), 1, "the sidecar asks for no key");
        assert!(cached.overhead.is_empty());
        assert_eq!(
            &*cached.containers[0].requests,
            &[("tdx.intel.com/keys".to_string(), Quantity("1".to_string()))]
        );
        // The full fixture: the same keys through the cached form.
        assert_eq!(
            key_requests(
                &CachedLauncherPod::from(lp.clone()).to_pod(),
                &cfg.resources
            )
            .expect("keys"),
            want
        );

        // A minimal object still parses.
        let bare: LauncherPod =
            serde_json::from_value(json!({"metadata": {"name": "p"}})).expect("bare");
        let bare = CachedLauncherPod::from(bare).to_pod();
        assert!(bare.spec.expect("spec").containers.is_empty());
    }
}
