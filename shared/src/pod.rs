//! How many TEE keys a pod asks the scheduler for, by kind.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

#[doc(hidden)]
pub use k8s_openapi::NamespaceResourceScope as __NamespaceResourceScope;
#[doc(hidden)]
pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta as __ObjectMeta;
#[doc(hidden)]
pub use kube::Resource as __Resource;

use crate::config::ResourcesConfig;
use crate::error::{Error, Result};
use crate::tee::TeeKind;

/// Keys requested per kind; kinds with zero keys are absent.
pub type KeyRequests = BTreeMap<TeeKind, u64>;

/// The keys of each kind a pod requests, computed the way the scheduler computes a pod's effective
/// request for an extended resource:
/// `max(max over init containers, sum over containers + restartable (sidecar) init containers) + overhead`.
///
/// A container's amount is its request, or its limit when no request is set (Kubernetes defaults
/// extended-resource requests to limits). `spec.overhead` counts, so Kata pods whose RuntimeClass
/// carries `tdx.intel.com/keys: 1` are counted too.
pub fn key_requests(pod: &Pod, resources: &ResourcesConfig) -> Result<KeyRequests> {
    let mut out = KeyRequests::new();
    let Some(spec) = &pod.spec else {
        return Ok(out);
    };
    for kind in TeeKind::ALL {
        let name = resources.get(kind).resource_name.as_str();
        let mut sum = 0u64;
        for c in &spec.containers {
            sum = sum.saturating_add(container_amount(pod, c, name)?);
        }
        let mut init_max = 0u64;
        if let Some(inits) = &spec.init_containers {
            for c in inits {
                let amount = container_amount(pod, c, name)?;
                if c.restart_policy.as_deref() == Some("Always") {
                    sum = sum.saturating_add(amount);
                } else {
                    init_max = init_max.max(amount);
                }
            }
        }
        let mut total = sum.max(init_max);
        if let Some(q) = spec.overhead.as_ref().and_then(|o| o.get(name)) {
            total = total.saturating_add(parse_keys(pod, name, q)?);
        }
        if total > 0 {
            out.insert(kind, total);
        }
    }
    Ok(out)
}

/// The amount of `resource` a container asks for: its request, else its limit, else 0.
pub fn container_amount(pod: &Pod, container: &Container, resource: &str) -> Result<u64> {
    let Some(res) = &container.resources else {
        return Ok(0);
    };
    let q = res
        .requests
        .as_ref()
        .and_then(|r| r.get(resource))
        .or_else(|| res.limits.as_ref().and_then(|l| l.get(resource)));
    match q {
        Some(q) => parse_keys(pod, resource, q),
        None => Ok(0),
    }
}

/// Parse an extended-resource quantity as a whole number of keys (`"1"`, `"2"`, `"1k"`); fractional,
/// negative or malformed quantities are an error naming the pod and resource.
pub fn parse_keys(pod: &Pod, resource: &str, q: &Quantity) -> Result<u64> {
    parse_whole_quantity(&q.0).ok_or_else(|| Error::BadQuantity {
        pod: pod_display_name(pod),
        resource: resource.to_string(),
        quantity: q.0.clone(),
    })
}

/// Parse a Kubernetes quantity that must be a whole, non-negative number (decimal or binary SI suffix).
pub fn parse_whole_quantity(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '+'))
        .unwrap_or(s.len());
    let (digits, suffix) = s.split_at(split);
    let digits = digits.strip_prefix('+').unwrap_or(digits);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    let mult: u64 = match suffix {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        _ => return None,
    };
    n.checked_mul(mult)
}

/// `namespace/name` of a pod, or `namespace/<generateName>*` before the name is generated.
pub fn pod_display_name(pod: &Pod) -> String {
    PodName(pod).to_string()
}

/// A pod shown as [`pod_display_name`] shows it, formatted only when displayed (for log fields that are
/// usually filtered out).
#[derive(Clone, Copy, Debug)]
pub struct PodName<'a>(pub &'a Pod);

impl std::fmt::Display for PodName<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let meta = &self.0.metadata;
        let ns = meta.namespace.as_deref().unwrap_or("");
        match (&meta.name, &meta.generate_name) {
            (Some(n), _) if !n.is_empty() => write!(f, "{ns}/{n}"),
            (_, Some(g)) => write!(f, "{ns}/{g}*"),
            _ => write!(f, "{ns}/<unnamed>"),
        }
    }
}

/// Implement [`kube::Resource`] as core/v1 `Pod` for a reduced pod type with a
/// `metadata: ObjectMeta` field, so kube's watchers and `Api` read pods into it (skipping what the
/// type does not name while decoding).
///
/// ```
/// #[derive(Clone, Debug, Default, serde::Deserialize)]
/// struct SlimPod {
///     metadata: k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
/// }
/// teeguard_shared::reduced_pod_resource!(SlimPod);
/// assert_eq!(<SlimPod as kube::Resource>::plural(&()), "pods");
/// ```
#[macro_export]
macro_rules! reduced_pod_resource {
    ($ty:ty) => {
        impl $crate::pod::__Resource for $ty {
            type DynamicType = ();
            type Scope = $crate::pod::__NamespaceResourceScope;

            fn kind(_: &()) -> ::std::borrow::Cow<'_, str> {
                ::std::borrow::Cow::Borrowed("Pod")
            }
            fn group(_: &()) -> ::std::borrow::Cow<'_, str> {
                ::std::borrow::Cow::Borrowed("")
            }
            fn version(_: &()) -> ::std::borrow::Cow<'_, str> {
                ::std::borrow::Cow::Borrowed("v1")
            }
            fn plural(_: &()) -> ::std::borrow::Cow<'_, str> {
                ::std::borrow::Cow::Borrowed("pods")
            }
            fn meta(&self) -> &$crate::pod::__ObjectMeta {
                &self.metadata
            }
            fn meta_mut(&mut self) -> &mut $crate::pod::__ObjectMeta {
                &mut self.metadata
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use serde_json::json;

    fn pod(spec: serde_json::Value) -> Pod {
        serde_json::from_value(json!({"metadata": {"name": "p", "namespace": "ns"}, "spec": spec}))
            .expect("pod")
    }

    #[test]
    fn counts_containers_init_and_overhead() {
        let cfg = Config::default();
        let p = pod(json!({
            "containers": [
                {"name": "compute", "resources": {"requests": {"tdx.intel.com/keys": "1"}, "limits": {"tdx.intel.com/keys": "1"}}},
                {"name": "side", "resources": {"limits": {"sev-snp.amd.com/esids": "2"}}}
            ],
            "initContainers": [
                {"name": "init", "resources": {"requests": {"tdx.intel.com/keys": "3"}}},
                {"name": "sidecar", "restartPolicy": "Always", "resources": {"requests": {"sev-snp.amd.com/esids": "1"}}}
            ],
            "overhead": {"tdx.intel.com/keys": "1"}
        }));
        let got = key_requests(&p, &cfg.resources).expect("requests");
        assert_eq!(got.get(&TeeKind::Tdx), Some(&4)); // max(3, 1) + 1 overhead
        assert_eq!(got.get(&TeeKind::SevEs), Some(&3)); // 2 + sidecar 1
        assert_eq!(got.get(&TeeKind::Sev), None);
    }

    #[test]
    fn kata_overhead_only() {
        let cfg = Config::default();
        let p = pod(
            json!({"containers": [{"name": "c"}], "overhead": {"tdx.intel.com/keys": "1", "cpu": "250m"}}),
        );
        assert_eq!(
            key_requests(&p, &cfg.resources).expect("requests"),
            KeyRequests::from([(TeeKind::Tdx, 1)])
        );
    }

    #[test]
    fn bad_quantities_are_errors() {
        let cfg = Config::default();
        for q in ["500m", "-1", "1.5", "abc", "", "1Xi"] {
            let p = pod(
                json!({"containers": [{"name": "c", "resources": {"requests": {"tdx.intel.com/keys": q}}}]}),
            );
            let err = key_requests(&p, &cfg.resources).expect_err(q);
            assert!(err.to_string().contains("ns/p"), "{err}");
        }
    }

    #[test]
    fn whole_quantities() {
        assert_eq!(parse_whole_quantity("1"), Some(1));
        assert_eq!(parse_whole_quantity("+2"), Some(2));
        assert_eq!(parse_whole_quantity("1k"), Some(1000));
        assert_eq!(parse_whole_quantity("1Ki"), Some(1024));
        assert_eq!(parse_whole_quantity("18446744073709551615"), Some(u64::MAX));
        assert_eq!(parse_whole_quantity("18446744073709551616"), None);
        assert_eq!(parse_whole_quantity("20000000000T"), None);
    }
}
