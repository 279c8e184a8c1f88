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

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use k8s_openapi::api::core::v1::Pod;
use serde::{Deserialize, Serialize};
use teeguard_shared::TeeKind;
use teeguard_shared::config::ResourcesConfig;
use teeguard_shared::misc::MiscValues;

/// A count per TEE kind (keys, requests, usage). Zero means "none" or "not listed".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KindCounts([u64; 3]);

impl KindCounts {
    /// All zero.
    pub const ZERO: KindCounts = KindCounts([0; 3]);

    fn index(kind: TeeKind) -> usize {
        match kind {
            TeeKind::Tdx => 0,
            TeeKind::Sev => 1,
            TeeKind::SevEs => 2,
        }
    }

    /// Build from `(kind, count)` pairs (later pairs replace earlier ones).
    pub fn from_pairs(pairs: impl IntoIterator<Item = (TeeKind, u64)>) -> Self {
        let mut c = KindCounts::ZERO;
        for (k, v) in pairs {
            c.set(k, v);
        }
        c
    }

    /// The TEE kinds of a parsed misc file (unknown resource names are ignored).
    pub fn from_misc(values: &MiscValues) -> Self {
        KindCounts::from_pairs(values.kinds())
    }

    /// The count for one kind.
    pub fn get(&self, kind: TeeKind) -> u64 {
        self.0[Self::index(kind)]
    }

    /// Set the count for one kind.
    pub fn set(&mut self, kind: TeeKind, value: u64) {
        self.0[Self::index(kind)] = value;
    }

    /// Add another set of counts (saturating).
    pub fn add(&mut self, other: &KindCounts) {
        for i in 0..3 {
            self.0[i] = self.0[i].saturating_add(other.0[i]);
        }
    }

    /// `self - other` per kind, or `None` when `other` is larger for some kind.
    pub fn checked_sub(&self, other: &KindCounts) -> Option<KindCounts> {
        let mut out = KindCounts::ZERO;
        for i in 0..3 {
            out.0[i] = self.0[i].checked_sub(other.0[i])?;
        }
        Some(out)
    }

    /// True when every kind is zero.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 3]
    }

    /// The non-zero kinds with their counts, in [`TeeKind::ALL`] order.
    pub fn nonzero(&self) -> impl Iterator<Item = (TeeKind, u64)> + '_ {
        TeeKind::ALL
            .into_iter()
            .map(|k| (k, self.get(k)))
            .filter(|(_, v)| *v > 0)
    }

    /// As a map of the non-zero kinds (for JSON/YAML output).
    pub fn to_map(&self) -> BTreeMap<TeeKind, u64> {
        self.nonzero().collect()
    }
}

impl fmt::Display for KindCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (k, v) in self.nonzero() {
            if !first {
                f.write_str(",")?;
            }
            first = false;
            write!(f, "{k}={v}")?;
        }
        if first {
            f.write_str("-")?;
        }
        Ok(())
    }
}

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
        }))
    }

    /// True when the pod requests at least one key of any kind.
    pub fn requests_keys(&self) -> bool {
        !self.requests.is_zero()
    }
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
        out.insert(
            kind,
            KindFigures {
                capacity,
                kernel_used,
                pods_used,
                external: kernel_used - pods_used,
                pending,
                free: capacity.saturating_sub(kernel_used).saturating_sub(pending),
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

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;
    use serde_json::json;
    use teeguard_shared::Config;

    const TDX: TeeKind = TeeKind::Tdx;
    const SEV: TeeKind = TeeKind::Sev;
    const ES: TeeKind = TeeKind::SevEs;

    fn counts(pairs: &[(TeeKind, u64)]) -> KindCounts {
        KindCounts::from_pairs(pairs.iter().copied())
    }

    fn pod(uid: &str, phase: PodPhase, req: &[(TeeKind, u64)]) -> PodSummary {
        PodSummary {
            uid: uid.into(),
            name: format!("ns/{uid}"),
            phase,
            requests: counts(req),
        }
    }

    fn figures(
        capacity: u64,
        kernel_used: u64,
        pods_used: u64,
        pending: u64,
        free: u64,
    ) -> KindFigures {
        KindFigures {
            capacity,
            kernel_used,
            pods_used,
            external: kernel_used - pods_used,
            pending,
            free,
        }
    }

    struct Case {
        name: &'static str,
        capacity: &'static [(TeeKind, u64)],
        kernel: &'static [(TeeKind, u64)],
        accounting: Accounting,
        usage: &'static [(&'static str, &'static [(TeeKind, u64)])],
        pods: Vec<PodSummary>,
        want: Vec<(TeeKind, KindFigures)>,
    }

    fn run(case: &Case) -> BTreeMap<TeeKind, KindFigures> {
        let usage: HashMap<String, KindCounts> = case
            .usage
            .iter()
            .map(|(uid, c)| (uid.to_string(), counts(c)))
            .collect();
        attribute(&AttributionInput {
            capacity: &counts(case.capacity),
            kernel_used: &counts(case.kernel),
            accounting: &case.accounting,
            pod_usage: &usage,
            pods: &case.pods,
        })
    }

    #[test]
    fn table() {
        use PodPhase::*;
        let cases = vec![
            Case {
                name: "no hardware: no kinds",
                capacity: &[],
                kernel: &[],
                accounting: Accounting::PerPod,
                usage: &[],
                pods: vec![pod("a", Running, &[(TDX, 1)])],
                want: vec![],
            },
            Case {
                name: "idle host",
                capacity: &[(TDX, 16)],
                kernel: &[],
                accounting: Accounting::PerPod,
                usage: &[],
                pods: vec![],
                want: vec![(TDX, figures(16, 0, 0, 0, 16))],
            },
            Case {
                name: "16 keys, 4 KubeVirt VMs, 2 external keys",
                capacity: &[(TDX, 16)],
                kernel: &[(TDX, 6)],
                accounting: Accounting::PerPod,
                usage: &[
                    ("vm1", &[(TDX, 1)]),
                    ("vm2", &[(TDX, 1)]),
                    ("vm3", &[(TDX, 1)]),
                    ("vm4", &[(TDX, 1)]),
                ],
                pods: vec![
                    pod("vm1", Running, &[(TDX, 1)]),
                    pod("vm2", Running, &[(TDX, 1)]),
                    pod("vm3", Running, &[(TDX, 1)]),
                    pod("vm4", Running, &[(TDX, 1)]),
                    pod("web", Running, &[]),
                ],
                want: vec![(TDX, figures(16, 6, 4, 0, 10))],
            },
            Case {
                name: "bound pod not started yet is pending",
                capacity: &[(TDX, 16)],
                kernel: &[(TDX, 1)],
                accounting: Accounting::PerPod,
                usage: &[("vm1", &[(TDX, 1)])],
                pods: vec![
                    pod("vm1", Running, &[(TDX, 1)]),
                    pod("vm2", Pending, &[(TDX, 1)]),
                ],
                want: vec![(TDX, figures(16, 1, 1, 1, 14))],
            },
            Case {
                name: "running pod whose VM has not charged yet is pending",
                capacity: &[(TDX, 4)],
                kernel: &[],
                accounting: Accounting::PerPod,
                usage: &[],
                pods: vec![pod("vm1", Running, &[(TDX, 1)])],
                want: vec![(TDX, figures(4, 0, 0, 1, 3))],
            },
            Case {
                name: "terminated pods hold nothing and are not pending; their leftover usage is external",
                capacity: &[(TDX, 8)],
                kernel: &[(TDX, 1)],
                accounting: Accounting::PerPod,
                usage: &[("done", &[(TDX, 1)])],
                pods: vec![
                    pod("done", Succeeded, &[(TDX, 1)]),
                    pod("failed", Failed, &[(TDX, 2)]),
                ],
                want: vec![(TDX, figures(8, 1, 0, 0, 7))],
            },
            Case {
                name: "usage of a pod that does not request the kind is external",
                capacity: &[(TDX, 8)],
                kernel: &[(TDX, 2)],
                accounting: Accounting::PerPod,
                usage: &[("plain", &[(TDX, 2)])],
                pods: vec![pod("plain", Running, &[(SEV, 1)])],
                want: vec![(TDX, figures(8, 2, 0, 0, 6))],
            },
            Case {
                name: "keys beyond the request are external",
                capacity: &[(TDX, 8)],
                kernel: &[(TDX, 3)],
                accounting: Accounting::PerPod,
                usage: &[("kata", &[(TDX, 3)])],
                pods: vec![pod("kata", Running, &[(TDX, 1)])],
                want: vec![(TDX, figures(8, 3, 1, 0, 5))],
            },
            Case {
                name: "partially charged multi-key pod",
                capacity: &[(TDX, 8)],
                kernel: &[(TDX, 1)],
                accounting: Accounting::PerPod,
                usage: &[("multi", &[(TDX, 1)])],
                pods: vec![pod("multi", Running, &[(TDX, 3)])],
                want: vec![(TDX, figures(8, 1, 1, 2, 5))],
            },
            Case {
                name: "pod reads racing ahead of the root read are capped at kernel usage",
                capacity: &[(TDX, 8)],
                kernel: &[(TDX, 1)],
                accounting: Accounting::PerPod,
                usage: &[("a", &[(TDX, 1)]), ("b", &[(TDX, 1)])],
                pods: vec![
                    pod("a", Running, &[(TDX, 1)]),
                    pod("b", Running, &[(TDX, 1)]),
                ],
                want: vec![(TDX, figures(8, 1, 1, 0, 7))],
            },
            Case {
                name: "free saturates at zero when overcommitted",
                capacity: &[(TDX, 2)],
                kernel: &[(TDX, 2)],
                accounting: Accounting::PerPod,
                usage: &[],
                pods: vec![pod("late", Pending, &[(TDX, 1)])],
                want: vec![(TDX, figures(2, 2, 0, 1, 0))],
            },
            Case {
                name: "kernel usage above capacity (garbage) does not underflow",
                capacity: &[(TDX, 2)],
                kernel: &[(TDX, 5)],
                accounting: Accounting::PerPod,
                usage: &[],
                pods: vec![],
                want: vec![(TDX, figures(2, 5, 0, 0, 0))],
            },
            Case {
                name: "AMD host: kinds are independent",
                capacity: &[(SEV, 99), (ES, 410)],
                kernel: &[(SEV, 3), (ES, 5)],
                accounting: Accounting::PerPod,
                usage: &[
                    ("snp1", &[(ES, 1)]),
                    ("snp2", &[(ES, 1)]),
                    ("sev1", &[(SEV, 1)]),
                ],
                pods: vec![
                    pod("snp1", Running, &[(ES, 1)]),
                    pod("snp2", Running, &[(ES, 1)]),
                    pod("sev1", Running, &[(SEV, 1)]),
                    pod("snp3", Pending, &[(ES, 1)]),
                ],
                want: vec![
                    (SEV, figures(99, 3, 1, 0, 96)),
                    (ES, figures(410, 5, 2, 1, 404)),
                ],
            },
            Case {
                name: "requests for a kind the host lacks are ignored",
                capacity: &[(TDX, 4)],
                kernel: &[],
                accounting: Accounting::PerPod,
                usage: &[],
                pods: vec![pod("snp", Pending, &[(ES, 1)])],
                want: vec![(TDX, figures(4, 0, 0, 0, 4))],
            },
            Case {
                name: "not delegated: running pods counted, capped at kernel usage",
                capacity: &[(TDX, 16)],
                kernel: &[(TDX, 6)],
                accounting: Accounting::RunningPods,
                usage: &[("ignored", &[(TDX, 9)])],
                pods: vec![
                    pod("vm1", Running, &[(TDX, 1)]),
                    pod("vm2", Running, &[(TDX, 1)]),
                    pod("vm3", Running, &[(TDX, 1)]),
                    pod("vm4", Running, &[(TDX, 1)]),
                    pod("vm5", Pending, &[(TDX, 1)]),
                    pod("gone", Succeeded, &[(TDX, 1)]),
                ],
                want: vec![(TDX, figures(16, 6, 4, 1, 9))],
            },
            Case {
                name: "not delegated: more running requests than kernel usage",
                capacity: &[(TDX, 16)],
                kernel: &[(TDX, 1)],
                accounting: Accounting::RunningPods,
                usage: &[],
                pods: vec![
                    pod("vm1", Running, &[(TDX, 1)]),
                    pod("vm2", Unknown, &[(TDX, 1)]),
                ],
                want: vec![(TDX, figures(16, 1, 1, 0, 15))],
            },
        ];
        for case in &cases {
            let got = run(case);
            let want: BTreeMap<_, _> = case.want.iter().copied().collect();
            assert_eq!(got, want, "case: {}", case.name);
            for f in got.values() {
                assert_eq!(
                    f.external + f.pods_used,
                    f.kernel_used,
                    "invariant, case {}",
                    case.name
                );
                assert!(f.free <= f.capacity, "case {}", case.name);
            }
        }
    }

    #[test]
    fn advertisable_is_capacity_minus_external() {
        assert_eq!(figures(16, 6, 4, 0, 10).advertisable(), 14);
        assert_eq!(figures(2, 5, 0, 0, 0).advertisable(), 0);
    }

    #[test]
    fn pod_summary_counts_kata_overhead_and_phase() {
        let cfg = Config::default();
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "kata", "namespace": "ns", "uid": "1b4e28ba-2fa1-11d2-883f-0016d3cca427"},
            "spec": {"containers": [{"name": "c"}], "overhead": {"tdx.intel.com/keys": "1"}},
            "status": {"phase": "Running"}
        }))
        .expect("pod");
        let s = PodSummary::from_pod(&p, &cfg.resources)
            .expect("summary")
            .expect("has uid");
        assert_eq!(s.requests, counts(&[(TDX, 1)]));
        assert_eq!(s.phase, PodPhase::Running);
        assert_eq!(s.name, "ns/kata");

        let no_uid: Pod =
            serde_json::from_value(json!({"metadata": {"name": "x"}, "spec": {"containers": []}}))
                .expect("pod");
        assert_eq!(
            PodSummary::from_pod(&no_uid, &cfg.resources).expect("ok"),
            None
        );
    }

    #[test]
    fn phases() {
        assert_eq!(PodPhase::parse(None), PodPhase::Pending);
        assert_eq!(PodPhase::parse(Some("Pending")), PodPhase::Pending);
        assert_eq!(PodPhase::parse(Some("Running")), PodPhase::Running);
        assert_eq!(PodPhase::parse(Some("Succeeded")), PodPhase::Succeeded);
        assert_eq!(PodPhase::parse(Some("Failed")), PodPhase::Failed);
        assert_eq!(PodPhase::parse(Some("Weird")), PodPhase::Unknown);
        assert!(PodPhase::Succeeded.is_terminated() && PodPhase::Failed.is_terminated());
        assert!(!PodPhase::Pending.is_terminated() && !PodPhase::Unknown.is_terminated());
    }

    #[test]
    fn kind_counts_display() {
        assert_eq!(counts(&[(TDX, 2), (ES, 1)]).to_string(), "tdx=2,sev_es=1");
        assert_eq!(KindCounts::ZERO.to_string(), "-");
    }

    fn counted_of(
        accounting: Accounting,
        kernel: &[(TeeKind, u64)],
        usage: &[(&str, &[(TeeKind, u64)])],
        pods: &[PodSummary],
    ) -> Vec<(String, bool)> {
        let usage: HashMap<String, KindCounts> = usage
            .iter()
            .map(|(uid, c)| (uid.to_string(), counts(c)))
            .collect();
        counted(&AttributionInput {
            capacity: &counts(&[(TDX, 4), (ES, 4)]),
            kernel_used: &counts(kernel),
            accounting: &accounting,
            pod_usage: &usage,
            pods,
        })
        .into_iter()
        .map(|c| (c.uid, c.pending))
        .collect()
    }

    #[test]
    fn per_pod_accounting_counts_every_live_pod_and_marks_those_still_waiting() {
        let pods = [
            pod("waiting", PodPhase::Pending, &[(TDX, 1)]),
            pod("holding", PodPhase::Running, &[(TDX, 1)]),
            pod("half", PodPhase::Running, &[(TDX, 1), (ES, 1)]),
            pod("done", PodPhase::Succeeded, &[(TDX, 1)]),
            pod("no-keys", PodPhase::Running, &[]),
            pod("other-kind", PodPhase::Pending, &[(SEV, 1)]),
        ];
        let usage: &[(&str, &[(TeeKind, u64)])] =
            &[("holding", &[(TDX, 1)]), ("half", &[(TDX, 1)])];
        assert_eq!(
            counted_of(Accounting::PerPod, &[(TDX, 2)], usage, &pods),
            [
                ("waiting".to_string(), true),
                ("holding".to_string(), false),
                ("half".to_string(), true),
            ]
        );
    }

    #[test]
    fn running_pod_fallback_counts_running_pods_only_once_the_kernel_shows_their_keys() {
        let pods = [
            pod("a", PodPhase::Running, &[(TDX, 1)]),
            pod("b", PodPhase::Running, &[(TDX, 1)]),
            pod("c", PodPhase::Pending, &[(TDX, 1)]),
            pod("d", PodPhase::Failed, &[(TDX, 1)]),
            pod("e", PodPhase::Unknown, &[(ES, 1)]),
        ];
        // Both running TDX pods' keys are in the kernel's usage: counted as holding them.
        assert_eq!(
            counted_of(Accounting::RunningPods, &[(TDX, 2), (ES, 1)], &[], &pods),
            [
                ("a".to_string(), false),
                ("b".to_string(), false),
                ("c".to_string(), true),
                ("e".to_string(), false),
            ]
        );
        // One running pod's key is not charged yet: which one cannot be told, so neither is listed;
        // the Pending pod is (its key is in `pending`), and so is the SEV-ES pod.
        assert_eq!(
            counted_of(Accounting::RunningPods, &[(TDX, 1), (ES, 1)], &[], &pods),
            [("c".to_string(), true), ("e".to_string(), false)]
        );
    }
}
