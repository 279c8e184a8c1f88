//! The few fields of a virt-launcher Pod the validating webhook needs for a binding, as a reduced type
//! for the pod cache and the GET on a miss.
//!
//! A virt-launcher pod is 5–20 KB of JSON (volumes, env, probes, status); a binding decision needs only
//! the metadata (labels, owner, the storage-binding annotation) and each container's resources. Reading
//! pods into [`LauncherPod`] skips everything else at deserialisation, and the cache additionally drops
//! annotations it does not need ([`slim_annotations`]), so a cache of thousands of pods stays small.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec, ResourceRequirements};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
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
    /// `spec.overhead`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overhead: Option<BTreeMap<String, Quantity>>,
}

/// A container's name, resources and restart policy (sidecars count like containers).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerResources {
    /// Name.
    #[serde(default)]
    pub name: String,
    /// Requests and limits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// `Always` for a sidecar init container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restart_policy: Option<String>,
}

impl Resource for LauncherPod {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("Pod")
    }
    fn group(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn version(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("v1")
    }
    fn plural(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("pods")
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

impl ContainerResources {
    fn to_container(&self) -> Container {
        Container {
            name: self.name.clone(),
            resources: self.resources.clone(),
            restart_policy: self.restart_policy.clone(),
            ..Container::default()
        }
    }
}

impl LauncherPod {
    /// A k8s-openapi Pod carrying exactly these fields, for the shared pod functions
    /// (`classify_pod`, `key_requests`).
    pub fn to_pod(&self) -> Pod {
        Pod {
            metadata: self.metadata.clone(),
            spec: Some(PodSpec {
                node_name: self.spec.node_name.clone(),
                containers: self
                    .spec
                    .containers
                    .iter()
                    .map(ContainerResources::to_container)
                    .collect(),
                init_containers: if self.spec.init_containers.is_empty() {
                    None
                } else {
                    Some(
                        self.spec
                            .init_containers
                            .iter()
                            .map(ContainerResources::to_container)
                            .collect(),
                    )
                },
                overhead: self.spec.overhead.clone(),
                ..PodSpec::default()
            }),
            status: None,
        }
    }
}

/// Keep only the annotations a binding decision reads (the storage-binding marker and the VMI name).
pub fn slim_annotations(meta: &mut ObjectMeta) {
    if let Some(a) = meta.annotations.as_mut() {
        a.retain(|k, _| {
            k == names::EPHEMERAL_PROVISIONING_ANNOTATION || k == names::DOMAIN_ANNOTATION
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let mut lp: LauncherPod = serde_json::from_value(full).expect("launcher pod");
        assert_eq!(lp.spec.node_name.as_deref(), Some("node01"));
        let want = KeyRequests::from([(TeeKind::Tdx, 3)]);
        assert_eq!(key_requests(&pod, &cfg.resources).expect("keys"), want);
        assert_eq!(
            key_requests(&lp.to_pod(), &cfg.resources).expect("keys"),
            want
        );
        slim_annotations(&mut lp.metadata);
        assert_eq!(
            lp.metadata.annotations,
            Some(BTreeMap::from([(
                "kubevirt.io/domain".to_string(),
                "vm".to_string()
            )]))
        );
        assert_eq!(
            LauncherPod::url_path(&(), Some("ns")),
            "/api/v1/namespaces/ns/pods"
        );
        // A minimal object still parses.
        let bare: LauncherPod =
            serde_json::from_value(json!({"metadata": {"name": "p"}})).expect("bare");
        assert!(bare.to_pod().spec.expect("spec").containers.is_empty());
    }
}
