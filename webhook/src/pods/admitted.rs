//! The pod under review, decoded with only the fields admission decisions read.
//!
//! A virt-launcher pod in an AdmissionReview is 5–20 KB of JSON: volumes, env, probes, security
//! contexts, managed fields. Decoding all of it into k8s-openapi types was most of the webhook's CPU per
//! review. [`AdmittedPod`] names only what the mutating and validating decisions read; serde skips the
//! rest while scanning, without allocating. [`AdmittedPod::into_pod`] moves the fields into a
//! k8s-openapi [`Pod`] so the pure decision functions keep one input type.
//!
//! Labels, annotations and resource lists are filtered while decoding: only [`read_label`],
//! [`read_annotation`] and [`read_resource`] keys are kept, and the others are skipped without being
//! allocated.
//!
//! [`read_label`]: super::decode::read_label
//! [`read_annotation`]: super::decode::read_annotation
//! [`read_resource`]: super::decode::read_resource
//!
//! A field not listed here reads as absent in the decisions. Adding logic that reads another pod field
//! means adding that field here; the equivalence test at the bottom compares every decision on the
//! committed fixtures decoded both ways, and fails when the two disagree.

use k8s_openapi::api::core::v1::{Affinity, Binding, NodeAffinity, ObjectReference, Pod, PodSpec};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde::Deserialize;
use std::collections::BTreeMap;

use super::decode::{decode_annotations, decode_labels, decode_resource_list};
use super::launcher::ContainerResources;
use crate::error::{Error, Result};

/// A core/v1 Pod reduced to what admission decisions read.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct AdmittedPod {
    /// Metadata, without managed fields and the other bookkeeping fields.
    #[serde(default)]
    pub metadata: AdmittedMeta,
    /// `spec`, reduced.
    #[serde(default)]
    pub spec: Option<AdmittedSpec>,
}

/// `metadata`, reduced.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmittedMeta {
    /// `name`.
    #[serde(default)]
    pub name: Option<String>,
    /// `generateName`.
    #[serde(default)]
    pub generate_name: Option<String>,
    /// `namespace`.
    #[serde(default)]
    pub namespace: Option<String>,
    /// `uid`.
    #[serde(default)]
    pub uid: Option<String>,
    /// `labels`, only those the decisions read ([`read_label`](super::decode::read_label)).
    #[serde(default, deserialize_with = "decode_labels")]
    pub labels: Option<BTreeMap<String, String>>,
    /// `annotations`, only those the decisions read
    /// ([`read_annotation`](super::decode::read_annotation)); present (possibly empty) exactly
    /// when the pod has an annotations map, which decides the shape of the patch.
    #[serde(default, deserialize_with = "decode_annotations")]
    pub annotations: Option<BTreeMap<String, String>>,
    /// `ownerReferences`.
    #[serde(default)]
    pub owner_references: Option<Vec<OwnerReference>>,
}

/// `spec`, reduced: the key requests (containers, init containers, overhead), the node (`nodeName`,
/// `nodeSelector`, required node affinity) and the RuntimeClass.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmittedSpec {
    /// `nodeName`.
    #[serde(default)]
    pub node_name: Option<String>,
    /// `nodeSelector`.
    #[serde(default)]
    pub node_selector: Option<BTreeMap<String, String>>,
    /// `affinity`, node affinity only.
    #[serde(default)]
    pub affinity: Option<AdmittedAffinity>,
    /// `containers`, reduced.
    #[serde(default)]
    pub containers: Vec<ContainerResources>,
    /// `initContainers`, reduced.
    #[serde(default)]
    pub init_containers: Option<Vec<ContainerResources>>,
    /// `overhead`, extended resources only ([`read_resource`](super::decode::read_resource)).
    #[serde(default, deserialize_with = "decode_resource_list")]
    pub overhead: Option<BTreeMap<String, Quantity>>,
    /// `runtimeClassName` (a TEE RuntimeClass's pods get a container key request).
    #[serde(default)]
    pub runtime_class_name: Option<String>,
}

/// `affinity`, reduced to node affinity (pod affinity does not decide where keys are free).
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmittedAffinity {
    /// `nodeAffinity`.
    #[serde(default)]
    pub node_affinity: Option<NodeAffinity>,
}

impl AdmittedMeta {
    /// A k8s-openapi [`ObjectMeta`] carrying exactly these fields (moved, not copied).
    pub fn into_meta(self) -> ObjectMeta {
        ObjectMeta {
            name: self.name,
            generate_name: self.generate_name,
            namespace: self.namespace,
            uid: self.uid,
            labels: self.labels,
            annotations: self.annotations,
            owner_references: self.owner_references,
            ..ObjectMeta::default()
        }
    }
}

impl AdmittedPod {
    /// A k8s-openapi [`Pod`] carrying exactly these fields (moved, not copied).
    pub fn into_pod(self) -> Pod {
        Pod {
            metadata: self.metadata.into_meta(),
            spec: self.spec.map(|s| PodSpec {
                node_name: s.node_name,
                node_selector: s.node_selector,
                affinity: s.affinity.map(|a| Affinity {
                    node_affinity: a.node_affinity,
                    ..Affinity::default()
                }),
                containers: s
                    .containers
                    .into_iter()
                    .map(ContainerResources::into_container)
                    .collect(),
                init_containers: s.init_containers.map(|v| {
                    v.into_iter()
                        .map(ContainerResources::into_container)
                        .collect()
                }),
                overhead: s.overhead,
                runtime_class_name: s.runtime_class_name,
                ..PodSpec::default()
            }),
            status: None,
        }
    }
}

/// A review's object as the admission handlers read it, whatever its kind: the fields of
/// [`AdmittedPod`] plus a Binding's `target`. Read in the same pass as the envelope.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct AdmittedObject {
    /// Metadata, reduced as in [`AdmittedPod`].
    #[serde(default)]
    pub metadata: AdmittedMeta,
    /// A pod's `spec`, reduced.
    #[serde(default)]
    pub spec: Option<AdmittedSpec>,
    /// A Binding's `target`.
    #[serde(default)]
    pub target: Option<ObjectReference>,
}

impl AdmittedObject {
    /// The object as a pod.
    pub fn into_pod(self) -> Pod {
        AdmittedPod {
            metadata: self.metadata,
            spec: self.spec,
        }
        .into_pod()
    }

    /// The object as a Binding; without `target` it is not one.
    pub fn into_binding(self) -> Result<Binding> {
        let target = self.target.ok_or_else(|| {
            Error::BadReview("request.object is not a valid Binding: missing field `target`".into())
        })?;
        Ok(Binding {
            metadata: self.metadata.into_meta(),
            target,
        })
    }
}
