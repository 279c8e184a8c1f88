//! Which `misc.max` each pod and container gets: pure decisions from the pod's requests (what the
//! scheduler counted), teeguard's annotation and the host's TEE kinds.
//!
//! The request is the authority: the annotation the mutating webhook adds
//! (`misc-max.teeguard.dev/<container>: "tdx 1"`) is checked against it, and a disagreement applies the
//! request-derived value and is reported as a mismatch (defence in depth: an annotation that slipped
//! past admission can never raise a limit above what the scheduler counted).
//!
//! - Container level (NRI `CreateContainer`): the container's own request of one kind (for a
//!   virt-launcher pod's `compute`, plus the keys its RuntimeClass put in the pod overhead: the VM runs
//!   there). `unified` is a map, so one container gets one `misc.max` line: a container requesting
//!   several kinds gets the first (kernel order) and the rest is reported.
//! - Pod level (the cgroup writer): every kind the pod requests, with `spec.overhead` (Kata's VMM runs
//!   in the pod sandbox cgroup, which container adjustments do not reach).
//! - DRA mode: the keys a container or pod holds through claims the agent prepared count too, and an
//!   extended-resource request a claim serves is counted through the claim's devices
//!   ([`super::claimed`]): the allocation, not the request, sets the limit.
//! - Never a kind the host has no capacity for (`misc.capacity` lacks it): the kernel refuses such a
//!   `misc.max` line (`EINVAL`) and runc then refuses to start the container (seen on Linux 6.1 and
//!   6.12, `tests/tests/kernel_runc.rs`). [`unavailable_kinds`] / [`pod_unavailable_kinds`] name what
//!   was left out, for the `Enforcing` condition and an Event.
//! - Strict mode: a pod that holds no key of a kind the host has (no request, no prepared claim) gets
//!   `<kind> 0` for it, so an unaccounted KVM user fails at the kernel instead of taking a key the
//!   scheduler gave to someone else. Exempt pods (label `teeguard.dev/exempt: "true"` on the pod or
//!   on its namespace, as the webhook honours it) are left alone.

use std::collections::BTreeMap;
use std::fmt;

use k8s_openapi::api::core::v1::Pod;
use teeguard_shared::TeeKind;
use teeguard_shared::config::ResourcesConfig;
use teeguard_shared::names::{
    COMPUTE_CONTAINER, EXEMPT_LABEL, KUBEVIRT_LABEL, VIRT_LAUNCHER, misc_max_annotation,
};
use teeguard_shared::pod::{container_amount, key_requests, parse_keys};

use super::claimed::{self, ClaimedKeys};

/// One `misc.max` line: at most `keys` keys of `kind`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Limit {
    /// The key kind.
    pub kind: TeeKind,
    /// The most keys the cgroup may hold.
    pub keys: u64,
}

impl Limit {
    /// Parse `"<kernel name> <n>"` (teeguard's annotation value; extra spaces tolerated).
    pub fn parse(value: &str) -> Option<Limit> {
        let mut parts = value.split_whitespace();
        let kind = TeeKind::from_kernel_name(parts.next()?)?;
        let keys = parts.next()?.parse().ok()?;
        parts.next().is_none().then_some(Limit { kind, keys })
    }
}

impl fmt::Display for Limit {
    /// The kernel's `misc.max` line: `tdx 1`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.kind.kernel_name(), self.keys)
    }
}

/// What the annotation said when it disagreed with the requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mismatch {
    /// The annotation names another kind or count than the container requests.
    Differs {
        /// The annotation's value as written.
        annotated: String,
    },
    /// The annotation cannot be parsed (`"<kind> <n>"`).
    Malformed {
        /// The annotation's value as written.
        annotated: String,
    },
    /// The container requests keys of several kinds; one `misc.max` line holds one.
    SeveralKinds {
        /// The kinds beyond the one applied.
        unapplied: Vec<TeeKind>,
    },
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Mismatch::Differs { annotated } => write!(
                f,
                "the annotation says {annotated:?}, which is not what the container requests"
            ),
            Mismatch::Malformed { annotated } => write!(
                f,
                "the annotation {annotated:?} is not \"<tdx|sev|sev_es> <keys>\""
            ),
            Mismatch::SeveralKinds { unapplied } => {
                let names: Vec<&str> = unapplied.iter().map(|k| k.kernel_name()).collect();
                write!(
                    f,
                    "the container requests several kinds; one misc.max line holds one, so {} stay unlimited",
                    names.join(", ")
                )
            }
        }
    }
}

/// The decision for one container being created.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ContainerLimit {
    /// Leave the container's `misc.max` alone.
    Unlimited,
    /// Set `misc.max` to this value.
    Set {
        /// The value applied.
        limit: Limit,
        /// Why the annotation (or the requests) did not simply agree, when they did not.
        mismatch: Option<Mismatch>,
    },
}

/// The pod facts a decision needs: the pod as the agent caches or fetched it (requests, overhead,
/// container names, labels), and the annotations the runtime passed (the pod's own).
#[derive(Clone, Copy, Debug)]
pub struct PodFacts<'a> {
    /// The pod, when the agent knows it. `None`: only the runtime's annotations are known.
    pub pod: Option<&'a Pod>,
    /// The pod's annotations (from the runtime, or the pod).
    pub annotations: &'a BTreeMap<String, String>,
    /// The pod's namespace carries `teeguard.dev/exempt: "true"`.
    pub namespace_exempt: bool,
    /// The claims the agent prepared (DRA mode; empty otherwise).
    pub claimed: &'a ClaimedKeys,
}

/// Settings that do not change per pod.
#[derive(Clone, Copy, Debug)]
pub struct Policy<'a> {
    /// Resource names per kind.
    pub resources: &'a ResourcesConfig,
    /// Kinds with capacity on this host.
    pub host_kinds: &'a [TeeKind],
    /// Strict mode.
    pub strict: bool,
}

/// Whether a pod carries teeguard's annotation for any container (worth an API lookup when unknown).
pub fn has_limit_annotation(annotations: &BTreeMap<String, String>) -> bool {
    annotations
        .keys()
        .any(|k| k.starts_with(teeguard_shared::names::MISC_MAX_ANNOTATION_PREFIX))
}

/// Whether the pod is exempt from teeguard: label `teeguard.dev/exempt: "true"` on the pod, or on its
/// namespace (`namespace_exempt`, from the agent's watch of exempt namespaces).
pub fn is_exempt(pod: &Pod, namespace_exempt: bool) -> bool {
    namespace_exempt
        || pod
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(EXEMPT_LABEL))
            .is_some_and(|v| v == "true")
}

/// Strict mode's zero for `container` that its namespace's label alone decides (the container's
/// limit unless the namespace is labelled exempt, none if it is); `None` for any other container, whose
/// limit does not depend on that label. The NRI plugin gives or lifts such zeros as the label changes.
pub fn namespace_zero(facts: PodFacts<'_>, container: &str, policy: Policy<'_>) -> Option<Limit> {
    let limit = |namespace_exempt| {
        let facts = PodFacts {
            namespace_exempt,
            ..facts
        };
        container_limit(facts, container, policy)
    };
    match (limit(false), limit(true)) {
        (ContainerLimit::Set { limit, .. }, ContainerLimit::Unlimited) => Some(limit),
        _ => None,
    }
}

/// The container's limit: see the module documentation. Never a kind the host has no capacity for
/// (not in `policy.host_kinds`): the kernel answers `EINVAL` to such a `misc.max` line, and runc then
/// refuses to start the container ([`unavailable_kinds`] says which kinds were left out).
pub fn container_limit(facts: PodFacts<'_>, container: &str, policy: Policy<'_>) -> ContainerLimit {
    let on_host = |kind: &TeeKind| policy.host_kinds.contains(kind);
    let annotated = facts.annotations.get(&misc_max_annotation(container));
    let Some(pod) = facts.pod else {
        // Unknown pod (not cached, lookup failed): the annotation, checked at admission, is all there is.
        return match annotated.map(|a| (a, Limit::parse(a))) {
            Some((_, Some(limit))) if on_host(&limit.kind) => ContainerLimit::Set {
                limit,
                mismatch: None,
            },
            _ => ContainerLimit::Unlimited,
        };
    };
    let requested = requested_keys(pod, container, facts, policy);
    let mut kinds = requested.iter().filter(|(k, n)| **n > 0 && on_host(k));
    let first = kinds.next().map(|(k, n)| Limit { kind: *k, keys: *n });
    let unapplied: Vec<TeeKind> = kinds.map(|(k, _)| *k).collect();

    let requests_elsewhere = requested.values().any(|n| *n > 0);
    let derived = match (first, annotated) {
        (Some(limit), _) => Some(limit),
        // Only kinds this host lacks: no line at all.
        (None, _) if requests_elsewhere => return ContainerLimit::Unlimited,
        // The annotation names a kind the container does not request: its request of that kind is 0.
        (None, Some(a)) => Limit::parse(a).filter(|l| on_host(&l.kind)).map(|l| Limit {
            kind: l.kind,
            keys: 0,
        }),
        (None, None) => None,
    };
    let Some(limit) = derived else {
        return strict_zero(pod, facts, policy);
    };
    let mismatch = match annotated {
        Some(a) => match Limit::parse(a) {
            None => Some(Mismatch::Malformed {
                annotated: a.clone(),
            }),
            Some(l) if l != limit => Some(Mismatch::Differs {
                annotated: a.clone(),
            }),
            Some(_) => None,
        },
        None => None,
    };
    let mismatch = mismatch
        .or_else(|| (!unapplied.is_empty()).then_some(Mismatch::SeveralKinds { unapplied }));
    ContainerLimit::Set { limit, mismatch }
}

/// The keys of each kind the container requests or holds through a prepared claim (kernel order).
fn requested_keys(
    pod: &Pod,
    container: &str,
    facts: PodFacts<'_>,
    policy: Policy<'_>,
) -> BTreeMap<TeeKind, u64> {
    let held = claimed::container_claimed(pod, container, facts.claimed, policy.resources);
    container_requests(pod, container, policy.resources)
        .into_iter()
        .map(|(k, n)| (k, held.total(k, n)))
        .collect()
}

/// The kinds a container asks for (its requests and prepared claims, or, for a pod the agent does not
/// know, teeguard's annotation) that this host has no capacity for: [`container_limit`] sets no line
/// for them, and the report and an Event say so.
pub fn unavailable_kinds(facts: PodFacts<'_>, container: &str, policy: Policy<'_>) -> Vec<TeeKind> {
    let missing = |kind: &TeeKind| !policy.host_kinds.contains(kind);
    match facts.pod {
        None => facts
            .annotations
            .get(&misc_max_annotation(container))
            .and_then(|a| Limit::parse(a))
            .filter(|l| l.keys > 0 && missing(&l.kind))
            .map(|l| vec![l.kind])
            .unwrap_or_default(),
        Some(pod) => requested_keys(pod, container, facts, policy)
            .into_iter()
            .filter(|(k, n)| *n > 0 && missing(k))
            .map(|(k, _)| k)
            .collect(),
    }
}

/// The kinds a pod requests (with overhead) or holds through prepared claims that this host has no
/// capacity for: [`pod_limits`] sets no line for them (the cgroup writer), and the report and an Event
/// say so.
pub fn pod_unavailable_kinds(pod: &Pod, claims: &ClaimedKeys, policy: Policy<'_>) -> Vec<TeeKind> {
    let Ok(requests) = key_requests(pod, policy.resources) else {
        return Vec::new();
    };
    let held = claimed::pod_claimed(pod, claims, policy.resources);
    TeeKind::ALL
        .into_iter()
        .filter(|k| !policy.host_kinds.contains(k))
        .filter(|k| held.total(*k, requests.get(k).copied().unwrap_or(0)) > 0)
        .collect()
}

/// Strict mode for a container of a pod holding no key (no request, no prepared claim): `<kind> 0`
/// when the host has exactly one kind (one line per container); with several kinds the pod-level
/// cgroup writer covers them all.
fn strict_zero(pod: &Pod, facts: PodFacts<'_>, policy: Policy<'_>) -> ContainerLimit {
    if !policy.strict
        || is_exempt(pod, facts.namespace_exempt)
        || holds_any(pod, facts.claimed, policy.resources)
    {
        return ContainerLimit::Unlimited;
    }
    match policy.host_kinds {
        [kind] => ContainerLimit::Set {
            limit: Limit {
                kind: *kind,
                keys: 0,
            },
            mismatch: None,
        },
        _ => ContainerLimit::Unlimited,
    }
}

/// The pod cgroup's limits (the cgroup writer): for each kind the host has, the pod's request
/// (with overhead) and the devices of its prepared claims ([`claimed::pod_claimed`]) when it holds
/// keys of that kind; `0` in strict mode otherwise (not for exempt pods, `namespace_exempt`: their
/// namespace is); nothing else. Unparsable quantities give no limit (the report names the pod already).
pub fn pod_limits(
    pod: &Pod,
    namespace_exempt: bool,
    claims: &ClaimedKeys,
    policy: Policy<'_>,
) -> Vec<Limit> {
    let Ok(requests) = key_requests(pod, policy.resources) else {
        return Vec::new();
    };
    let held = claimed::pod_claimed(pod, claims, policy.resources);
    let strict = policy.strict && !is_exempt(pod, namespace_exempt);
    policy
        .host_kinds
        .iter()
        .filter_map(|kind| {
            let requested = requests.get(kind).copied();
            if requested.is_some() || held.keys.contains_key(kind) {
                let keys = held.total(*kind, requested.unwrap_or(0));
                return Some(Limit { kind: *kind, keys });
            }
            strict.then_some(Limit {
                kind: *kind,
                keys: 0,
            })
        })
        .collect()
}

/// The keys of each kind one container requests (kinds in kernel order).
fn container_requests(
    pod: &Pod,
    container: &str,
    resources: &ResourcesConfig,
) -> BTreeMap<TeeKind, u64> {
    let Some(spec) = &pod.spec else {
        return BTreeMap::new();
    };
    let found = spec
        .containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .find(|c| c.name == container);
    let Some(c) = found else {
        return BTreeMap::new();
    };
    // A virt-launcher pod whose RuntimeClass puts the key in `overhead.podFixed` (KubeVirt's
    // `defaultRuntimeClass`) has it counted for the pod, not a container: its VM runs in `compute`.
    let overhead = (container == COMPUTE_CONTAINER && is_virt_launcher(pod))
        .then_some(spec.overhead.as_ref())
        .flatten();
    TeeKind::ALL
        .iter()
        .map(|k| {
            let name = resources.resource_name(*k);
            let amount = container_amount(pod, c, name).unwrap_or(0);
            let in_overhead = overhead
                .and_then(|o| o.get(name))
                .and_then(|q| parse_keys(pod, name, q).ok())
                .unwrap_or(0);
            (*k, amount + in_overhead)
        })
        .collect()
}

/// Whether the pod is a KubeVirt virt-launcher pod (label `kubevirt.io: virt-launcher`).
fn is_virt_launcher(pod: &Pod) -> bool {
    pod.metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(KUBEVIRT_LABEL))
        .is_some_and(|v| v == VIRT_LAUNCHER)
}

/// Whether the pod requests keys or holds some through a claim the agent prepared. An unparsable
/// request still means the pod asked for keys: never zero it. A claim the agent did not prepare holds
/// none of its keys: the kubelet has the driver prepare a pod's claims before it creates the pod's
/// sandbox and containers.
fn holds_any(pod: &Pod, claims: &ClaimedKeys, resources: &ResourcesConfig) -> bool {
    key_requests(pod, resources).map_or(true, |r| !r.is_empty())
        || !claimed::pod_claimed(pod, claims, resources).keys.is_empty()
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod claimed_tests;

#[cfg(test)]
mod unavailable_tests;
