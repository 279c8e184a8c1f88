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
//! A field not listed here reads as absent in the decisions. Adding logic that reads another pod field
//! means adding that field here; the equivalence test at the bottom compares every decision on the
//! committed fixtures decoded both ways, and fails when the two disagree.

use std::collections::BTreeMap;
use std::marker::PhantomData;

use k8s_openapi::api::core::v1::{
    Affinity, Binding, NodeAffinity, ObjectReference, Pod, PodSpec, ResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use teeguard_shared::names;

use crate::admission::ReviewRequest;
use crate::error::{Error, Result};
use crate::pods::ContainerResources;

/// Whether the admission decisions read the pod annotation `key`: the cgroup-limit annotations (the
/// patch and the forged-limit checks) and KubeVirt's storage-binding marker. Everything else (network
/// status, tracking ids: often most of a pod's metadata) is skipped while decoding.
pub fn read_annotation(key: &str) -> bool {
    names::is_limit_annotation(key) || key == names::EPHEMERAL_PROVISIONING_ANNOTATION
}

/// Whether the admission decisions read the pod label `key`: KubeVirt's component label and the
/// exemption label (the webhook's pod cache keeps the same two).
pub fn read_label(key: &str) -> bool {
    key == names::KUBEVIRT_LABEL || key == names::EXEMPT_LABEL
}

/// A map key, owned only when `keep` accepts it: a skipped key is checked in place (borrowed from
/// the body, or from the parser's scratch buffer when it had escapes) and never allocated.
struct KeptKey(fn(&str) -> bool);

impl<'de> de::DeserializeSeed<'de> for KeptKey {
    type Value = Option<String>;

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> Visitor<'de> for KeptKey {
    type Value = Option<String>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a string key")
    }
    fn visit_str<E: de::Error>(self, key: &str) -> Result<Self::Value, E> {
        Ok((self.0)(key).then(|| key.to_owned()))
    }
}

/// Whether the admission decisions may read the resource `name` of a container's `requests` or
/// `limits`, or of the pod's `overhead`: extended resources (`<domain>/<name>`) outside KubeVirt's
/// device-plugin domain. Every TEE resource name the configuration accepts is one
/// ([`teeguard_shared::config::validate_resource_name`]); `cpu`, `memory`, `ephemeral-storage`,
/// `hugepages-*` and the `devices.kubevirt.io/*` devices every virt-launcher pod requests (`kvm`,
/// `tun`, `vhost-net`, ...) are skipped while decoding.
pub fn read_resource(name: &str) -> bool {
    name.split_once('/')
        .is_some_and(|(domain, _)| domain != names::KUBEVIRT_DEVICE_DOMAIN)
}

/// A map (`metadata.labels`, `metadata.annotations`, resource lists) keeping only the keys `keep`
/// accepts, with values of type `V`; `null` or absent is `None`, any map (even one whose keys were
/// all skipped) is `Some`: the patch's shape depends on whether a map exists, not on what it holds.
struct KeptMap<V>(fn(&str) -> bool, PhantomData<V>);

impl<V> KeptMap<V> {
    fn new(keep: fn(&str) -> bool) -> Self {
        KeptMap(keep, PhantomData)
    }
}

impl<'de, V: Deserialize<'de>> Visitor<'de> for KeptMap<V> {
    type Value = Option<BTreeMap<String, V>>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a map")
    }
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = BTreeMap::new();
        while let Some(key) = map.next_key_seed(KeptKey(self.0))? {
            match key {
                Some(key) => {
                    out.insert(key, map.next_value::<V>()?);
                }
                None => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(Some(out))
    }
}

/// `metadata.annotations` keeping only [`read_annotation`] keys.
fn decode_annotations<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    d.deserialize_option(KeptMap::new(read_annotation))
}

/// `metadata.labels` keeping only [`read_label`] keys.
fn decode_labels<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    d.deserialize_option(KeptMap::new(read_label))
}

/// A resource list (`overhead`, `requests`, `limits`) keeping only [`read_resource`] names.
pub(crate) fn decode_resource_list<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, Quantity>>, D::Error> {
    d.deserialize_option(KeptMap::new(read_resource))
}

/// A container's `resources`: `requests` and `limits` as [`decode_resource_list`]; `claims` and
/// anything else skipped.
pub(crate) fn decode_resources<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<ResourceRequirements>, D::Error> {
    #[derive(Deserialize)]
    struct Resources {
        #[serde(default, deserialize_with = "decode_resource_list")]
        requests: Option<BTreeMap<String, Quantity>>,
        #[serde(default, deserialize_with = "decode_resource_list")]
        limits: Option<BTreeMap<String, Quantity>>,
    }
    Ok(
        Option::<Resources>::deserialize(d)?.map(|r| ResourceRequirements {
            requests: r.requests,
            limits: r.limits,
            claims: None,
        }),
    )
}

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
    /// `labels`, only those the decisions read ([`read_label`]).
    #[serde(default, deserialize_with = "decode_labels")]
    pub labels: Option<BTreeMap<String, String>>,
    /// `annotations`, only those the decisions read ([`read_annotation`]); present (possibly
    /// empty) exactly when the pod has an annotations map, which decides the shape of the patch.
    #[serde(default, deserialize_with = "decode_annotations")]
    pub annotations: Option<BTreeMap<String, String>>,
    /// `ownerReferences`.
    #[serde(default)]
    pub owner_references: Option<Vec<OwnerReference>>,
}

/// `spec`, reduced: the key requests (containers, init containers, overhead) and the node
/// (`nodeName`, `nodeSelector`, required node affinity).
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
    /// `overhead`, extended resources only ([`read_resource`]).
    #[serde(default, deserialize_with = "decode_resource_list")]
    pub overhead: Option<BTreeMap<String, Quantity>>,
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

/// An AdmissionReview as the handlers read it: the envelope and its objects in one pass over the
/// body. When that pass fails (malformed JSON, a bad envelope, an object of an unexpected shape), the
/// envelope is parsed alone and each object is decoded when asked for, so requests the handler skips
/// are still skipped and errors keep their precise message ([`ReviewRequest::parse`],
/// [`ReviewRequest::object`]).
#[derive(Debug)]
pub struct AdmittedReview<'a> {
    /// The envelope.
    pub request: ReviewRequest<'a>,
    decoded: Option<Objects>,
}

/// `request.object` and `request.oldObject` decoded with the envelope (each taken when asked for).
type Objects = (Option<Box<AdmittedObject>>, Option<Box<AdmittedObject>>);

fn missing(field: &str) -> Error {
    Error::BadReview(format!("request.{field} is missing"))
}

impl<'a> AdmittedReview<'a> {
    /// Parse `body` (errors are [`Error::BadReview`], HTTP 400).
    pub fn parse(body: &'a [u8]) -> Result<Self> {
        match ReviewRequest::parse_decoded::<Box<AdmittedObject>>(body) {
            Ok(d) => Ok(AdmittedReview {
                request: d.request,
                decoded: Some((d.object, d.old_object)),
            }),
            Err(_) => Ok(AdmittedReview {
                request: ReviewRequest::parse(body)?,
                decoded: None,
            }),
        }
    }

    /// `request.object` as a pod (taken: a second call finds it missing). A pod without a namespace
    /// (a CREATE may leave it to the request's) gets the request's.
    ///
    /// Boxed, like the decoded objects: a k8s-openapi `Pod` is over 2 KB, and the handlers hold it
    /// across lookups, so inline it would be part of every handler future the server allocates and
    /// moves per review.
    pub fn pod(&mut self) -> Result<Box<Pod>> {
        let pod = match &mut self.decoded {
            Some((object, _)) => object
                .take()
                .map(|o| Box::new(o.into_pod()))
                .ok_or_else(|| missing("object"))?,
            None => Box::new(self.request.object::<AdmittedPod>()?.into_pod()),
        };
        Ok(self.in_request_namespace(pod))
    }

    /// `request.oldObject` as a pod (taken), its namespace defaulted as in [`AdmittedReview::pod`].
    pub fn old_pod(&mut self) -> Result<Box<Pod>> {
        let pod = match &mut self.decoded {
            Some((_, old)) => old
                .take()
                .map(|o| Box::new(o.into_pod()))
                .ok_or_else(|| missing("oldObject"))?,
            None => Box::new(self.request.old_object::<AdmittedPod>()?.into_pod()),
        };
        Ok(self.in_request_namespace(pod))
    }

    fn in_request_namespace(&self, mut pod: Box<Pod>) -> Box<Pod> {
        if pod.metadata.namespace.as_deref().is_none_or(str::is_empty)
            && !self.request.namespace.is_empty()
        {
            pod.metadata.namespace = Some(self.request.namespace.clone());
        }
        pod
    }

    /// `request.object` as a Binding (taken).
    pub fn binding(&mut self) -> Result<Binding> {
        match &mut self.decoded {
            Some((object, _)) => object
                .take()
                .ok_or_else(|| missing("object"))?
                .into_binding(),
            None => self.request.object::<Binding>(),
        }
    }

    /// Whether the objects were decoded with the envelope (false: the fallback path).
    pub fn single_pass(&self) -> bool {
        self.decoded.is_some()
    }
}
