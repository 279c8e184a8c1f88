//! Decoding only what admission decisions read: the label, annotation and extended-resource keys
//! kept ([`read_label`], [`read_annotation`], [`read_resource`]) and the serde functions that skip every
//! other key while scanning, without allocating it. Shared by the pod under review
//! ([`super::admitted`]) and the pod cache ([`super::launcher`]).

use std::collections::BTreeMap;
use std::marker::PhantomData;

use k8s_openapi::api::core::v1::ResourceRequirements;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};
use teeguard_shared::names;

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
pub(crate) fn decode_annotations<'de, D: Deserializer<'de>>(
    d: D,
) -> Result<Option<BTreeMap<String, String>>, D::Error> {
    d.deserialize_option(KeptMap::new(read_annotation))
}

/// `metadata.labels` keeping only [`read_label`] keys.
pub(crate) fn decode_labels<'de, D: Deserializer<'de>>(
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
