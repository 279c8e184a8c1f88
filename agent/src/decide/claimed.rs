//! DRA mode: which keys a pod and each of its containers hold through the claims the agent prepared,
//! so that enforcement takes their `misc.max` from the allocation, not only from requests.
//!
//! A pod reaches a claim in two ways, and the kubelet has the driver prepare both before the pod's
//! sandbox exists:
//! - **extended resources served by DRA** (KEP-5004): the scheduler creates one claim for the pod,
//!   named in `status.extendedResourceClaimStatus`, with one request per container and resource
//!   (`requestMappings`: container, resource, request name);
//! - **claims of its own**: `spec.resourceClaims` (a `resourceClaimName`, or a template whose claim is
//!   named in `status.resourceClaimStatuses`), which a container uses through `resources.claims`
//!   (the whole claim, or one `request` of it; a result of a sub-request is `request/sub`).
//!
//! A claim the agent did not prepare (not in [`ClaimedKeys`]) contributes nothing, and an extended
//! resource it would serve falls back to the request (equal by construction: one device per unit).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::{Container, Pod, PodExtendedResourceClaimStatus};
use teeguard_shared::TeeKind;
use teeguard_shared::config::ResourcesConfig;

use super::dra::{DeviceName, PreparedClaim};

/// The keys of the claims the agent prepared, indexed by claim for enforcement.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClaimedKeys {
    /// `(namespace, claim name)` → the claim's devices: (the request it serves, its kind).
    claims: BTreeMap<(String, String), Vec<(String, TeeKind)>>,
    /// UIDs of the pods the claims are reserved for.
    pods: BTreeSet<String>,
}

impl ClaimedKeys {
    /// No claim prepared (extended-resource mode).
    pub const NONE: ClaimedKeys = ClaimedKeys {
        claims: BTreeMap::new(),
        pods: BTreeSet::new(),
    };

    /// Index prepared claims (devices whose name does not parse are left out).
    pub fn from_prepared<'a>(claims: impl IntoIterator<Item = &'a PreparedClaim>) -> ClaimedKeys {
        let mut out = ClaimedKeys::default();
        for c in claims {
            let devices = c
                .devices
                .iter()
                .filter_map(|d| Some((d.request.clone(), DeviceName::parse(&d.device)?.kind)))
                .collect();
            out.claims
                .insert((c.namespace.clone(), c.name.clone()), devices);
            out.pods.extend(c.pods.iter().cloned());
        }
        out
    }

    /// Whether a prepared claim is reserved for the pod `uid` (worth an API lookup when the pod is
    /// not cached yet).
    pub fn holds_for(&self, uid: &str) -> bool {
        self.pods.contains(uid)
    }

    /// Whether no claim is prepared.
    pub fn is_empty(&self) -> bool {
        self.claims.is_empty()
    }

    fn devices(&self, namespace: &str, claim: &str) -> Option<&[(String, TeeKind)]> {
        self.claims
            .get(&(namespace.to_string(), claim.to_string()))
            .map(Vec::as_slice)
    }
}

/// What claims give one container or one pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Claimed {
    /// Devices held, per kind.
    pub keys: BTreeMap<TeeKind, u64>,
    /// Kinds whose extended-resource request a prepared claim serves: their requests are counted
    /// through [`Claimed::keys`] and must not be counted again.
    pub served: BTreeSet<TeeKind>,
}

impl Claimed {
    fn add(&mut self, kind: TeeKind) {
        *self.keys.entry(kind).or_insert(0) += 1;
    }

    /// The keys of `kind`: `requested` (the container's or pod's request) unless a claim serves that
    /// request, plus what claims hold.
    pub fn total(&self, kind: TeeKind, requested: u64) -> u64 {
        let from_request = if self.served.contains(&kind) {
            0
        } else {
            requested
        };
        from_request.saturating_add(self.keys.get(&kind).copied().unwrap_or(0))
    }
}

/// Whether a result for `result_request` serves a container's reference to `wanted` (the whole
/// claim when `None`; a request, or any of its sub-requests `request/sub`).
fn serves(result_request: &str, wanted: Option<&str>) -> bool {
    match wanted {
        None => true,
        Some(w) => {
            result_request == w
                || result_request
                    .strip_prefix(w)
                    .is_some_and(|rest| rest.starts_with('/'))
        }
    }
}

/// The claim a pod-level claim entry `name` stands for: its `resourceClaimName`, or the claim made
/// from its template (`status.resourceClaimStatuses`).
fn claim_name<'a>(pod: &'a Pod, name: &str) -> Option<&'a str> {
    let direct = pod
        .spec
        .as_ref()?
        .resource_claims
        .iter()
        .flatten()
        .find(|c| c.name == name)?
        .resource_claim_name
        .as_deref();
    direct.or_else(|| {
        pod.status
            .as_ref()?
            .resource_claim_statuses
            .iter()
            .flatten()
            .find(|s| s.name == name)?
            .resource_claim_name
            .as_deref()
    })
}

/// The scheduler's claim for the pod's extended resources and its devices, when the agent prepared it.
fn extended_resource_claim<'a>(
    pod: &'a Pod,
    namespace: &str,
    claims: &'a ClaimedKeys,
) -> Option<(&'a PodExtendedResourceClaimStatus, &'a [(String, TeeKind)])> {
    let ext = pod
        .status
        .as_ref()?
        .extended_resource_claim_status
        .as_ref()?;
    Some((ext, claims.devices(namespace, &ext.resource_claim_name)?))
}

fn find_container<'a>(pod: &'a Pod, name: &str) -> Option<&'a Container> {
    let spec = pod.spec.as_ref()?;
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .find(|c| c.name == name)
}

/// What prepared claims give the container `container` of `pod`.
pub fn container_claimed(
    pod: &Pod,
    container: &str,
    claims: &ClaimedKeys,
    resources: &ResourcesConfig,
) -> Claimed {
    let mut out = Claimed::default();
    if claims.is_empty() {
        return out;
    }
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    if let Some((ext, devices)) = extended_resource_claim(pod, namespace, claims) {
        for m in ext
            .request_mappings
            .iter()
            .filter(|m| m.container_name == container)
        {
            if let Some(kind) = resources.kind_of_resource(&m.resource_name) {
                out.served.insert(kind);
            }
            for (_, kind) in devices.iter().filter(|(r, _)| *r == m.request_name) {
                out.add(*kind);
            }
        }
    }
    let Some(c) = find_container(pod, container) else {
        return out;
    };
    for reference in c
        .resources
        .as_ref()
        .and_then(|r| r.claims.as_ref())
        .into_iter()
        .flatten()
    {
        let Some(devices) =
            claim_name(pod, &reference.name).and_then(|n| claims.devices(namespace, n))
        else {
            continue;
        };
        for (_, kind) in devices
            .iter()
            .filter(|(r, _)| serves(r, reference.request.as_deref()))
        {
            out.add(*kind);
        }
    }
    out
}

/// What prepared claims give the whole pod: every device of each claim it refers to, once.
pub fn pod_claimed(pod: &Pod, claims: &ClaimedKeys, resources: &ResourcesConfig) -> Claimed {
    let mut out = Claimed::default();
    if claims.is_empty() {
        return out;
    }
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    let mut names: BTreeSet<&str> = BTreeSet::new();
    if let Some((ext, _)) = extended_resource_claim(pod, namespace, claims) {
        names.insert(&ext.resource_claim_name);
        out.served.extend(
            ext.request_mappings
                .iter()
                .filter_map(|m| resources.kind_of_resource(&m.resource_name)),
        );
    }
    for entry in pod
        .spec
        .as_ref()
        .and_then(|s| s.resource_claims.as_ref())
        .into_iter()
        .flatten()
    {
        names.extend(claim_name(pod, &entry.name));
    }
    for name in names {
        for (_, kind) in claims.devices(namespace, name).unwrap_or_default() {
            out.add(*kind);
        }
    }
    out
}

#[cfg(test)]
pub(crate) mod tests;
