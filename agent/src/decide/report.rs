//! Building the node's `TeeCapacity` status from what the agent knows, and deciding when to publish
//! it. Pure: no I/O, time is an input.
//!
//! Conditions:
//!
//! | type | True | False / Unknown |
//! |---|---|---|
//! | `KernelReadable` | `Scanned` | `ScanFailed` (the error; the figures are from the last good scan) |
//! | `TeeHardware` | `TeeCapacityFound` | `NoTeeHardware` (empty `misc.capacity`, or no misc controller: the error) |
//! | `PerPodAccounting` | `MiscControllerDelegated` | `MiscControllerNotDelegated` (running pods are counted) |
//! | `Advertising` | `Advertised` | `AdvertisingDisabled`, `OwnedByAnotherManager`, `NoTeeHardware` |
//! | `Enforcing` | `NriPlugin`, `CgroupWriter` | `EnforcementOff`, `NriUnavailable`, `MiscControllerNotDelegated`, `NoTeeHardware` (see `enforce`) |
//!
//! A condition's `lastTransitionTime` changes only when its status flips.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use teeguard_shared::TeeKind;
use teeguard_shared::config::ResourcesConfig;
use teeguard_shared::crd::{
    DeviceCounts, KindStatus, MAX_COUNTED_PODS, RefusedCharges, TeeCapacityStatus,
};

pub mod conditions;

pub use conditions::{
    ConditionSpec, HANDOVER_SECTION, conditions, merge_conditions, owned_by_other,
};

use super::advertise::AdvertiseOutcome;
use super::attribution::{
    Accounting, AttributionInput, CountedPod, KindFigures, PodSummary, PodsView, attribute, counted,
};
use super::counts::KindCounts;
use super::host::{HostState, UsageSource};
use crate::error::Error;

/// The agent's version, reported as `agentVersion`.
pub const AGENT_VERSION: &str = env!("CARGO_PKG_VERSION");

/// What the agent knows about the kernel: the last successful scan and the latest error.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KernelView {
    /// The last scan that succeeded.
    pub last_good: Option<HostState>,
    /// The error of the latest scan, when it failed.
    pub error: Option<String>,
}

impl KernelView {
    /// Record the result of a scan: success replaces the figures, failure keeps them.
    pub fn record(&mut self, result: Result<HostState, Error>) {
        match result {
            Ok(state) => {
                self.last_good = Some(state);
                self.error = None;
            }
            Err(e) => self.error = Some(e.to_string()),
        }
    }

    /// Attribute the last good scan's usage to `pods`.
    pub fn figures(&self, pods: &[PodSummary]) -> BTreeMap<TeeKind, KindFigures> {
        self.with_input(pods, attribute).unwrap_or_default()
    }

    /// The failed charges of `kind` the last good scan found, where they were counted; `None` when
    /// none was.
    pub fn refused(&self, kind: TeeKind) -> Option<RefusedCharges> {
        let Some(HostState::Scanned(scan)) = &self.last_good else {
            return None;
        };
        let r = &scan.refusals;
        let pods = r.in_pods().get(kind);
        let refused = RefusedCharges {
            pods,
            kubepods: r.kubepods.get(kind).saturating_sub(pods),
            outside: r.outside_total().get(kind),
        };
        (refused != RefusedCharges::default()).then_some(refused)
    }

    /// The pods whose keys [`KernelView::figures`] counts (see [`counted`]).
    pub fn counted(&self, pods: &[PodSummary]) -> Vec<CountedPod> {
        self.with_input(pods, counted).unwrap_or_default()
    }

    fn with_input<T>(
        &self,
        pods: &[PodSummary],
        f: impl FnOnce(&AttributionInput<'_>) -> T,
    ) -> Option<T> {
        let scan = ScanInputs::of(self)?;
        let empty = HashMap::new();
        let (accounting, usage) = match &scan.pods {
            Some((accounting, usage)) => (&**accounting, &**usage),
            None => (&Accounting::PerPod, &empty),
        };
        let kernel_used = match scan.usage_source {
            // The kernel shows no usage at all: the keys of running pods that request them are held
            // for certain (a floor; keys held outside Kubernetes cannot be seen).
            UsageSource::Hidden => {
                let mut floor = scan.kernel_used;
                let mut running = KindCounts::ZERO;
                for p in pods.iter().filter(|p| {
                    matches!(
                        p.phase,
                        super::attribution::PodPhase::Running
                            | super::attribution::PodPhase::Unknown
                    )
                }) {
                    running.add(&p.requests);
                }
                for kind in TeeKind::ALL {
                    floor.set(kind, floor.get(kind).max(running.get(kind)));
                }
                floor
            }
            UsageSource::Root | UsageSource::TopLevel => scan.kernel_used,
        };
        Some(f(&AttributionInput {
            capacity: &scan.capacity,
            kernel_used: &kernel_used,
            accounting,
            pod_usage: usage,
            pods,
        }))
    }
}

/// Which counted pods a report lists in `countedPods`: every pod whose keys its figures count (pending
/// or held), newest first (since when each has been counted, on the agent's own clock), at most
/// [`MAX_COUNTED_PODS`]. The webhook ends a hold once a report lists its pod, also a webhook replica
/// that started after the pod did; a node with more TEE pods than that leaves its oldest out (their
/// holds then end by the webhook's TTL).
#[derive(Clone, Debug, Default)]
pub struct CountedPods {
    since: HashMap<String, Instant>,
}

impl CountedPods {
    /// Record the pods counted now and return the UIDs to list. Pods no longer counted are forgotten.
    pub fn update(&mut self, counted: &[CountedPod], now: Instant) -> Vec<String> {
        let mut since = HashMap::with_capacity(counted.len());
        let mut listed = Vec::new();
        for c in counted {
            let first = self.since.get(&c.uid).copied().unwrap_or(now);
            since.insert(c.uid.clone(), first);
            listed.push((first, c.uid.as_str()));
        }
        self.since = since;
        listed.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
        listed
            .into_iter()
            .take(MAX_COUNTED_PODS)
            .map(|(_, uid)| uid.to_string())
            .collect()
    }
}

/// The figures ([`KernelView::figures`]) and the pods to list ([`CountedPods::update`]), worked out
/// again only when what they come from changed: the last good scan's capacity, usage and pod readings,
/// or the pods (a new [`PodsView`], told apart by its `Arc`). On a steady host neither changes between
/// polls; attributing 500 pods every poll was about a fifth of the agent's CPU.
#[derive(Debug, Default)]
pub struct Attributed {
    counted: CountedPods,
    from: Option<(Option<ScanInputs<'static>>, Arc<PodsView>)>,
    figures: BTreeMap<TeeKind, KindFigures>,
    listed: Vec<String>,
}

/// What attribution reads from the last good scan (not the scan's counters of files read): the one
/// list [`KernelView::with_input`] reads and [`Attributed`] compares, borrowed from the scan or, kept
/// by [`Attributed`], owned.
#[derive(Clone, Debug, PartialEq)]
struct ScanInputs<'a> {
    capacity: KindCounts,
    kernel_used: KindCounts,
    usage_source: UsageSource,
    pods: Option<(Cow<'a, Accounting>, Cow<'a, PodUsage>)>,
}

/// Per-pod usage by pod UID ([`crate::decide::host::PodScan::usage`]).
type PodUsage = HashMap<String, KindCounts>;

impl ScanInputs<'_> {
    fn of(kernel: &KernelView) -> Option<ScanInputs<'_>> {
        let Some(HostState::Scanned(scan)) = &kernel.last_good else {
            return None;
        };
        Some(ScanInputs {
            capacity: scan.capacity,
            kernel_used: scan.kernel_used,
            usage_source: scan.usage_source,
            pods: scan
                .pods
                .as_ref()
                .map(|p| (Cow::Borrowed(&p.accounting), Cow::Borrowed(&p.usage))),
        })
    }

    fn into_owned(self) -> ScanInputs<'static> {
        ScanInputs {
            pods: self
                .pods
                .map(|(a, u)| (Cow::Owned(a.into_owned()), Cow::Owned(u.into_owned()))),
            ..self
        }
    }
}

impl Attributed {
    /// Bring the figures and the pods to list up to `kernel`'s last good scan and `pods`.
    pub fn update(&mut self, kernel: &KernelView, pods: &Arc<PodsView>, now: Instant) {
        let inputs = ScanInputs::of(kernel);
        let current = self
            .from
            .as_ref()
            .is_some_and(|(from, view)| Arc::ptr_eq(view, pods) && *from == inputs);
        if !current {
            self.figures = kernel.figures(&pods.pods);
            self.listed = self.counted.update(&kernel.counted(&pods.pods), now);
            self.from = Some((inputs.map(ScanInputs::into_owned), pods.clone()));
        }
    }

    /// The attributed figures per kind.
    pub fn figures(&self) -> &BTreeMap<TeeKind, KindFigures> {
        &self.figures
    }

    /// The pods to list in `countedPods`.
    pub fn listed(&self) -> &[String] {
        &self.listed
    }
}

/// Everything [`build_status`] needs.
#[derive(Clone, Copy, Debug)]
pub struct StatusInput<'a> {
    /// The kernel figures and scan error.
    pub kernel: &'a KernelView,
    /// Attributed figures per kind (from [`KernelView::figures`]).
    pub figures: &'a BTreeMap<TeeKind, KindFigures>,
    /// How each kind is advertised.
    pub advertising: &'a AdvertiseOutcome,
    /// Resource names per kind.
    pub resources: &'a ResourcesConfig,
    /// The pods to list in `countedPods` (from [`CountedPods::update`]).
    pub counted_pods: &'a [String],
    /// The `Enforcing` condition (the agent's kernel enforcement), when the agent enforces.
    pub enforcing: Option<&'a ConditionSpec>,
    /// The status last published (for condition transition times).
    pub previous: Option<&'a TeeCapacityStatus>,
    /// DRA mode's view (`None` in extended-resource mode).
    pub dra: Option<&'a crate::decide::dra::DraView>,
    /// The current time.
    pub now: Timestamp,
}

/// Build the full status (figures, heartbeat, version, conditions). Times are whole seconds, as the
/// API server stores them.
pub fn build_status(input: &StatusInput<'_>) -> TeeCapacityStatus {
    let now = whole_seconds(input.now);
    let mut status = TeeCapacityStatus::default();
    for (kind, f) in input.figures {
        *status.kind_mut(*kind) = Some(KindStatus {
            resource_name: input.resources.resource_name(*kind).to_string(),
            capacity: f.capacity,
            kernel_used: f.kernel_used,
            pods_used: f.pods_used,
            external: f.external,
            pending: f.pending,
            free: f.free,
            advertised: input.advertising.advertised(*kind),
            devices: input
                .dra
                .and_then(|d| d.plan.get(kind))
                .map(|d| DeviceCounts {
                    published: d.published.len() as u64,
                    allocated: d.allocated,
                    withheld: d.withheld,
                }),
            refused: input.kernel.refused(*kind),
        });
    }
    status.accounting = Some(
        if input.dra.is_some() {
            "dra"
        } else {
            "extendedResource"
        }
        .to_string(),
    );
    status.counted_pods = input.counted_pods.to_vec();
    status.heartbeat_time = Some(Time(now));
    status.agent_version = Some(AGENT_VERSION.to_string());
    let mut specs = conditions(
        input.kernel,
        input.figures,
        input.advertising,
        input.resources,
    );
    specs.extend(input.enforcing.cloned());
    if let Some(dra) = input.dra {
        for c in specs
            .iter_mut()
            .filter(|c| c.type_ == teeguard_shared::names::conditions::ADVERTISING)
        {
            *c = ConditionSpec {
                type_: c.type_,
                status: "False",
                reason: teeguard_shared::names::reasons::DRA_MODE,
                message:
                    "agent.accounting is dra: the scheduler allocates the keys from the node's \
                          ResourceSlices, so the agent advertises no extended resource"
                        .into(),
            };
        }
        specs.extend(conditions::dra_conditions(dra));
    }
    let previous = input
        .previous
        .map(|p| p.conditions.as_slice())
        .unwrap_or(&[]);
    status.conditions = merge_conditions(previous, specs, now);
    status
}

/// Truncate to whole seconds.
pub fn whole_seconds(t: Timestamp) -> Timestamp {
    Timestamp::from_second(t.as_second()).unwrap_or(t)
}

/// True when two statuses differ in anything but the heartbeat time and `countedPods`.
pub fn content_differs(a: &TeeCapacityStatus, b: &TeeCapacityStatus) -> bool {
    // Every field named (a new one must be placed here), compared in place: called every poll.
    let TeeCapacityStatus {
        tdx,
        sev,
        sev_es,
        heartbeat_time: _,
        accounting,
        agent_version,
        counted_pods: _,
        conditions,
    } = a;
    (tdx, sev, sev_es, accounting, agent_version, conditions)
        != (
            &b.tdx,
            &b.sev,
            &b.sev_es,
            &b.accounting,
            &b.agent_version,
            &b.conditions,
        )
}

/// True when `new` lists a pod in `countedPods` that `prev` did not (a pod leaving the list is no
/// news: it waits for the next heartbeat).
pub fn lists_new_pods(prev: &TeeCapacityStatus, new: &TeeCapacityStatus) -> bool {
    // The same list (every steady poll) is answered without the quadratic search.
    new.counted_pods != prev.counted_pods
        && new
            .counted_pods
            .iter()
            .any(|uid| !prev.counted_pods.contains(uid))
}

/// What a reconcile writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    /// Nothing: the published report is current and its heartbeat is not due.
    Nothing,
    /// The report: the first time, when its content changed, or when it newly counts a pod (the
    /// webhook holds that pod's keys until it sees that).
    Report,
    /// A heartbeat: the published report is still current (to its `countedPods`) and the heartbeat
    /// is due (the agent renews its Lease, `cluster::lease`).
    Heartbeat,
}

/// What to write for `new`, given `last`: the last published status and when its heartbeat is due
/// (see [`next_heartbeat`]).
pub fn next_write(
    last: Option<(&TeeCapacityStatus, Instant)>,
    new: &TeeCapacityStatus,
    now: Instant,
) -> Write {
    match last {
        None => Write::Report,
        Some((prev, _)) if content_differs(prev, new) || lists_new_pods(prev, new) => Write::Report,
        // Pods that left `countedPods` are no news: they go out with the next heartbeat.
        Some((prev, heartbeat_due)) if now >= heartbeat_due => {
            if prev.counted_pods == new.counted_pods {
                Write::Heartbeat
            } else {
                Write::Report
            }
        }
        Some(_) => Write::Nothing,
    }
}

/// Where in each heartbeat interval `node`'s heartbeats fall: a hash of its name (FNV-1a), so the
/// nodes of a cluster are spread evenly over the interval, and a restarted agent keeps its place.
pub fn heartbeat_offset(node: &str, interval: Duration) -> Duration {
    let hash = node.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let interval_ms = interval.as_millis().max(1);
    Duration::from_millis((u128::from(hash) % interval_ms) as u64)
}

/// When the heartbeat after a publish at `last` (time since the UNIX epoch) is due: the node's first
/// slot at least half an interval after it. A node's slots are `interval` apart, `offset` into each
/// interval of the UNIX clock ([`heartbeat_offset`]). In steady state a node's heartbeats are thus
/// exactly one interval apart, and many nodes started (or brought back after an API server outage)
/// together do not heartbeat together: each goes back to its own slot. After a publish of a change
/// the next heartbeat comes half an interval to one and a half intervals later.
pub fn next_heartbeat(last: Duration, interval: Duration, offset: Duration) -> Duration {
    let interval_ms = interval.as_millis().max(1);
    let offset_ms = offset.as_millis() % interval_ms;
    let earliest = (last + interval / 2).as_millis();
    let slots = earliest.saturating_sub(offset_ms).div_ceil(interval_ms);
    let due = offset_ms + slots * interval_ms;
    Duration::from_millis(u64::try_from(due).unwrap_or(u64::MAX))
}

/// The per-kind usage map's kinds, for logs.
pub fn describe(figures: &BTreeMap<TeeKind, KindFigures>) -> String {
    if figures.is_empty() {
        return "no TEE capacity".into();
    }
    figures
        .iter()
        .map(|(k, f)| {
            format!(
                "{k}: capacity={} used={} pods={} external={} pending={} free={}",
                f.capacity, f.kernel_used, f.pods_used, f.external, f.pending, f.free
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Usage a pod's cgroup showed, for tables: zero when the pod was not read or holds nothing.
pub fn pod_usage(kernel: &KernelView, uid: &str) -> KindCounts {
    match &kernel.last_good {
        Some(HostState::Scanned(scan)) => scan
            .pods
            .as_ref()
            .and_then(|p| p.usage.get(uid))
            .copied()
            .unwrap_or_default(),
        _ => KindCounts::ZERO,
    }
}

#[cfg(test)]
mod tests;
