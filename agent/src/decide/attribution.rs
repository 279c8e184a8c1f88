//! Who holds the host's TEE keys: pure attribution of kernel usage to the pods that request the
//! resources, to external consumers, and to pods still waiting for their key. No I/O here.
//!
//! Per kind, with `kernel` = root `misc.current` and `capacity` = `misc.capacity`:
//!
//! - **per-pod accounting** (the misc controller is delegated to pod cgroups): for every pod that
//!   requests the kind and is not terminated, `held = min(pod cgroup usage, request)` counts as
//!   `podsUsed` and `request − held` as `pending`. Keys a pod holds beyond its request are not known
//!   to the scheduler and count as external.
//! - **running-pod fallback** (no per-pod files): `podsUsed = min(kernel, Σ requests of Running pods)`,
//!   `pending = Σ requests of Pending pods`.
//!
//! Then `podsUsed` is capped at `kernel`, `external = kernel − podsUsed` and
//! `free = capacity − kernel − pending` (never below zero). Succeeded and Failed pods hold nothing and
//! are not pending.

use std::borrow::Borrow;
use std::collections::{BTreeMap, HashMap, HashSet};

use k8s_openapi::api::core::v1::Pod;
use serde::{Deserialize, Serialize};
use teeguard_shared::TeeKind;
use teeguard_shared::config::ResourcesConfig;

use super::counts::KindCounts;

/// A pod's lifecycle phase, as far as key accounting cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PodPhase {
    /// Accepted by the node, not all containers running yet (also used when the phase is not set).
    Pending,
    /// Bound and running.
    Running,
    /// All containers terminated successfully: holds nothing.
    Succeeded,
    /// All containers terminated, at least one failed: holds nothing.
    Failed,
    /// The node lost track of the pod; counted like a running pod.
    Unknown,
}

impl PodPhase {
    /// From `status.phase` (absent means Pending: the pod was just created).
    pub fn parse(phase: Option<&str>) -> PodPhase {
        match phase {
            None | Some("Pending") => PodPhase::Pending,
            Some("Running") => PodPhase::Running,
            Some("Succeeded") => PodPhase::Succeeded,
            Some("Failed") => PodPhase::Failed,
            Some(_) => PodPhase::Unknown,
        }
    }

    /// Succeeded or Failed: the pod holds no keys and will not get one.
    pub fn is_terminated(self) -> bool {
        matches!(self, PodPhase::Succeeded | PodPhase::Failed)
    }
}

/// What attribution needs to know about one pod bound to the node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodSummary {
    /// `metadata.uid`.
    pub uid: String,
    /// `namespace/name`, for messages and tables.
    pub name: String,
    /// Lifecycle phase.
    pub phase: PodPhase,
    /// Keys requested per kind (containers, init containers and `spec.overhead`).
    pub requests: KindCounts,
    /// The scheduler allocated the pod's keys through a DRA claim (`status.extendedResourceClaimStatus`
    /// or `spec.resourceClaims`): in DRA mode its keys are the claim's devices, not withheld.
    pub dra_claim: bool,
}

impl PodSummary {
    /// Summarise a pod. Pods without a UID are skipped (`None`); a pod whose TEE quantities cannot be
    /// parsed is an error (the API server rejects such pods, so this is rare).
    pub fn from_pod(
        pod: &Pod,
        resources: &ResourcesConfig,
    ) -> Result<Option<PodSummary>, teeguard_shared::Error> {
        let Some(uid) = pod.metadata.uid.as_deref().filter(|u| !u.is_empty()) else {
            return Ok(None);
        };
        let requests = teeguard_shared::pod::key_requests(pod, resources)?;
        Ok(Some(PodSummary {
            uid: uid.to_string(),
            name: teeguard_shared::pod::pod_display_name(pod),
            phase: PodPhase::parse(pod.status.as_ref().and_then(|s| s.phase.as_deref())),
            requests: KindCounts::from_pairs(requests),
            dra_claim: has_dra_claim(pod),
        }))
    }

    /// True when the pod requests at least one key of any kind.
    pub fn requests_keys(&self) -> bool {
        !self.requests.is_zero()
    }
}

/// Whether the scheduler allocated devices to the pod through a claim.
pub fn has_dra_claim(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .is_some_and(|s| s.extended_resource_claim_status.is_some())
        || pod
            .spec
            .as_ref()
            .and_then(|s| s.resource_claims.as_ref())
            .is_some_and(|c| !c.is_empty())
}

/// Keys of each kind held or awaited by pods that have no DRA claim (not terminated): in DRA mode the
/// scheduler does not know them, so the node withholds as many devices.
pub fn claimless_keys(pods: &[PodSummary]) -> BTreeMap<TeeKind, u64> {
    let mut out = BTreeMap::new();
    for p in pods
        .iter()
        .filter(|p| !p.dra_claim && !p.phase.is_terminated())
    {
        for (kind, n) in p.requests.nonzero() {
            *out.entry(kind).or_insert(0) += n;
        }
    }
    out
}

/// How usage can be attributed on this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Accounting {
    /// Pod cgroups carry `misc.current`: usage is read per pod.
    PerPod,
    /// The misc controller is not delegated to pod cgroups: running pods that request a kind are
    /// assumed to hold it.
    RunningPods,
}

/// The inputs of [`attribute`].
#[derive(Clone, Copy, Debug)]
pub struct AttributionInput<'a> {
    /// `misc.capacity` (kinds with capacity 0 are absent from the host).
    pub capacity: &'a KindCounts,
    /// Root `misc.current`.
    pub kernel_used: &'a KindCounts,
    /// Per-pod or running-pod accounting.
    pub accounting: &'a Accounting,
    /// Usage read from pod cgroups, by pod UID (ignored for [`Accounting::RunningPods`]; pods absent
    /// from the map hold nothing).
    pub pod_usage: &'a HashMap<String, KindCounts>,
    /// The pods bound to the node.
    pub pods: &'a [PodSummary],
}

/// The figures for one kind. `external = kernel_used − pods_used`; `free = capacity − kernel_used −
/// pending` (never below zero).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct KindFigures {
    /// `misc.capacity`.
    pub capacity: u64,
    /// Root `misc.current`.
    pub kernel_used: u64,
    /// Keys held by pods that request the kind.
    pub pods_used: u64,
    /// Keys held by anything else.
    pub external: u64,
    /// Keys requested by bound pods that the kernel does not show yet.
    pub pending: u64,
    /// Keys a new VM can still get.
    pub free: u64,
}

impl KindFigures {
    /// What the node should advertise to the scheduler: the keys Kubernetes pods can really get,
    /// `capacity − external`.
    pub fn advertisable(&self) -> u64 {
        self.capacity.saturating_sub(self.external)
    }
}

/// Attribute kernel usage for every kind the host has capacity for, in [`TeeKind::ALL`] order.
pub fn attribute(input: &AttributionInput<'_>) -> BTreeMap<TeeKind, KindFigures> {
    let mut out = BTreeMap::new();
    for kind in TeeKind::ALL {
        let capacity = input.capacity.get(kind);
        if capacity == 0 {
            continue;
        }
        let kernel_used = input.kernel_used.get(kind);
        let (claimed, pending) = match input.accounting {
            Accounting::PerPod => per_pod(kind, input.pods, input.pod_usage),
            Accounting::RunningPods => running_pods(kind, input.pods),
        };
        let pods_used = claimed.min(kernel_used);
        let external = kernel_used - pods_used;
        let free = capacity.saturating_sub(kernel_used).saturating_sub(pending);
        out.insert(
            kind,
            KindFigures {
                capacity,
                kernel_used,
                pods_used,
                external,
                pending,
                free,
            },
        );
    }
    out
}

/// A pod whose keys the figures of [`attribute`] count.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CountedPod {
    /// Its UID.
    pub uid: String,
    /// Still waiting for some of its keys (counted in `pending`), rather than holding them all.
    pub pending: bool,
}

/// The pods whose requested keys the figures of [`attribute`] fully account for, in `pods` order:
///
/// - per-pod accounting: every pod not terminated that requests a kind the host has (what it holds
///   counts in the kernel's usage, the rest in `pending`);
/// - running-pod fallback: Pending pods (in `pending`), and Running or Unknown pods only while the
///   kernel shows at least the keys all running pods request of each of their kinds (otherwise some
///   running pod's key is in no figure yet, and which one cannot be told).
///
/// The webhook ends a reservation when the report lists its pod, so a pod is listed only once its
/// keys are in the report's `free`.
pub fn counted(input: &AttributionInput<'_>) -> Vec<CountedPod> {
    let on_host = |pod: &PodSummary| {
        pod.requests
            .nonzero()
            .any(|(kind, _)| input.capacity.get(kind) > 0)
    };
    let mut running = KindCounts::ZERO;
    if *input.accounting == Accounting::RunningPods {
        for pod in input.pods {
            if matches!(pod.phase, PodPhase::Running | PodPhase::Unknown) {
                running.add(&pod.requests);
            }
        }
    }
    let running_in_kernel = |pod: &PodSummary| {
        pod.requests
            .nonzero()
            .all(|(kind, _)| running.get(kind) <= input.kernel_used.get(kind))
    };
    let mut out = Vec::new();
    for pod in input.pods.iter().filter(|p| on_host(p)) {
        let pending = match (input.accounting, pod.phase) {
            (_, PodPhase::Succeeded | PodPhase::Failed) => continue,
            (Accounting::PerPod, _) => {
                let held = input.pod_usage.get(&pod.uid).copied().unwrap_or_default();
                pod.requests
                    .nonzero()
                    .any(|(kind, want)| held.get(kind) < want)
            }
            (Accounting::RunningPods, PodPhase::Pending) => true,
            (Accounting::RunningPods, _) if running_in_kernel(pod) => false,
            (Accounting::RunningPods, _) => continue,
        };
        out.push(CountedPod {
            uid: pod.uid.clone(),
            pending,
        });
    }
    out
}

fn per_pod(kind: TeeKind, pods: &[PodSummary], usage: &HashMap<String, KindCounts>) -> (u64, u64) {
    let mut used = 0u64;
    let mut pending = 0u64;
    for pod in pods {
        let request = pod.requests.get(kind);
        if request == 0 || pod.phase.is_terminated() {
            continue;
        }
        let held = usage.get(&pod.uid).map_or(0, |u| u.get(kind)).min(request);
        used = used.saturating_add(held);
        pending = pending.saturating_add(request - held);
    }
    (used, pending)
}

fn running_pods(kind: TeeKind, pods: &[PodSummary]) -> (u64, u64) {
    let mut running = 0u64;
    let mut waiting = 0u64;
    for pod in pods {
        let request = pod.requests.get(kind);
        match pod.phase {
            PodPhase::Running | PodPhase::Unknown => running = running.saturating_add(request),
            PodPhase::Pending => waiting = waiting.saturating_add(request),
            PodPhase::Succeeded | PodPhase::Failed => {}
        }
    }
    (running, waiting)
}

/// A set of pod UIDs, hashed with foldhash: the scanner looks up every pod of interest at every poll,
/// and SipHash (the std default) was a third of its instructions. UIDs come from the API server.
pub type Uids = HashSet<String, foldhash::fast::RandomState>;

/// Pods summarised for attribution.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodsView {
    /// Every pod with a UID.
    pub pods: Vec<PodSummary>,
    /// UIDs of non-terminated pods that request keys: the pod cgroups worth reading.
    pub interest: Uids,
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
mod tests;
