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

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use teeguard_shared::TeeKind;
use teeguard_shared::config::ResourcesConfig;
use teeguard_shared::crd::{KindStatus, MAX_COUNTED_PODS, TeeCapacityStatus};
use teeguard_shared::misc::CgroupLayout;
use teeguard_shared::names::{conditions as ct, reasons};

use crate::advertise::{AdvertiseOutcome, KindAdvert, Manager};
use crate::attribution::{
    Accounting, AttributionInput, CountedPod, KindCounts, KindFigures, PodSummary, attribute,
    counted,
};
use crate::error::Error;
use crate::scan::HostState;

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

    /// The pods whose keys [`KernelView::figures`] counts (see [`counted`]).
    pub fn counted(&self, pods: &[PodSummary]) -> Vec<CountedPod> {
        self.with_input(pods, counted).unwrap_or_default()
    }

    fn with_input<T>(
        &self,
        pods: &[PodSummary],
        f: impl FnOnce(&AttributionInput<'_>) -> T,
    ) -> Option<T> {
        let Some(HostState::Scanned(scan)) = &self.last_good else {
            return None;
        };
        let empty = HashMap::new();
        let (accounting, usage) = match &scan.pods {
            Some(p) => (&p.accounting, &p.usage),
            None => (&Accounting::PerPod, &empty),
        };
        Some(f(&AttributionInput {
            capacity: &scan.capacity,
            kernel_used: &scan.kernel_used,
            accounting,
            pod_usage: usage,
            pods,
        }))
    }
}

/// Which counted pods a report lists in `countedPods`: since when each pod has been counted, and the
/// rule that keeps the list short (every pod still pending, and every pod first counted less than
/// `window` ago, newest first, at most [`MAX_COUNTED_PODS`]). `window` is `admission.ledgerTtl`: the
/// webhook holds a reservation no longer than that, so an older pod is of no use to it. Durations on
/// the agent's own clock only: the webhook compares nothing with them.
#[derive(Clone, Debug, Default)]
pub struct CountedPods {
    since: HashMap<String, Instant>,
}

impl CountedPods {
    /// Record the pods counted now and return the UIDs to list. Pods no longer counted are forgotten.
    pub fn update(
        &mut self,
        counted: &[CountedPod],
        now: Instant,
        window: Duration,
    ) -> Vec<String> {
        let mut since = HashMap::with_capacity(counted.len());
        let mut listed = Vec::new();
        for c in counted {
            let first = self.since.get(&c.uid).copied().unwrap_or(now);
            since.insert(c.uid.clone(), first);
            if c.pending || now.saturating_duration_since(first) < window {
                listed.push((first, c.uid.as_str()));
            }
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

/// A condition before timestamps are applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConditionSpec {
    /// Condition type.
    pub type_: &'static str,
    /// `True`, `False` or `Unknown`.
    pub status: &'static str,
    /// CamelCase reason.
    pub reason: &'static str,
    /// Human-readable message.
    pub message: String,
}

fn cond(type_: &'static str, ok: bool, reason: &'static str, message: String) -> ConditionSpec {
    ConditionSpec {
        type_,
        status: if ok { "True" } else { "False" },
        reason,
        message,
    }
}

/// The conditions for the current state, in a fixed order.
pub fn conditions(
    kernel: &KernelView,
    figures: &BTreeMap<TeeKind, KindFigures>,
    advertising: &AdvertiseOutcome,
    resources: &ResourcesConfig,
) -> Vec<ConditionSpec> {
    let mut out = Vec::with_capacity(4);
    out.push(match (&kernel.error, &kernel.last_good) {
        (Some(e), Some(_)) => cond(
            ct::KERNEL_READABLE,
            false,
            reasons::SCAN_FAILED,
            format!("{e}; the figures are from the last successful scan"),
        ),
        (Some(e), None) => cond(ct::KERNEL_READABLE, false, reasons::SCAN_FAILED, e.clone()),
        (None, Some(HostState::NoController { .. })) => cond(
            ct::KERNEL_READABLE,
            true,
            reasons::SCANNED,
            "the cgroup root was read; it has no misc controller".into(),
        ),
        (None, Some(HostState::Scanned(scan))) => {
            let layout = match scan.layout {
                CgroupLayout::V2 => "cgroup v2",
                CgroupLayout::V1 => "cgroup v1",
            };
            let mut msg = format!(
                "read the misc files in {} ({layout})",
                scan.misc_dir.display()
            );
            if let Some(p) = scan.pods.as_ref().filter(|p| p.problem_count > 0) {
                msg.push_str(&format!(
                    "; {} pod cgroup(s) could not be read and count as holding no key: {}",
                    p.problem_count,
                    p.problems.first().map(String::as_str).unwrap_or("")
                ));
            }
            cond(ct::KERNEL_READABLE, true, reasons::SCANNED, msg)
        }
        (None, None) => ConditionSpec {
            type_: ct::KERNEL_READABLE,
            status: "Unknown",
            reason: reasons::SCAN_FAILED,
            message: "the misc files have not been read yet".into(),
        },
    });

    out.push(match &kernel.last_good {
        None => ConditionSpec {
            type_: ct::TEE_HARDWARE,
            status: "Unknown",
            reason: reasons::SCAN_FAILED,
            message: "the misc files have not been read successfully yet".into(),
        },
        Some(HostState::NoController { message }) => cond(
            ct::TEE_HARDWARE,
            false,
            reasons::NO_TEE_HARDWARE,
            message.clone(),
        ),
        Some(HostState::Scanned(scan)) if scan.capacity.is_zero() => cond(
            ct::TEE_HARDWARE,
            false,
            reasons::NO_TEE_HARDWARE,
            format!(
                "{}/misc.capacity lists no tdx, sev or sev_es capacity",
                scan.misc_dir.display()
            ),
        ),
        Some(HostState::Scanned(scan)) => cond(
            ct::TEE_HARDWARE,
            true,
            reasons::TEE_CAPACITY_FOUND,
            scan.capacity
                .nonzero()
                .map(|(k, v)| format!("{k}: {v} keys"))
                .collect::<Vec<_>>()
                .join(", "),
        ),
    });

    if let Some(HostState::Scanned(scan)) = &kernel.last_good
        && let Some(pods) = &scan.pods
    {
        out.push(match pods.accounting {
            Accounting::PerPod => cond(
                ct::PER_POD_ACCOUNTING,
                true,
                reasons::MISC_DELEGATED,
                pods.accounting_reason.clone(),
            ),
            Accounting::RunningPods => cond(
                ct::PER_POD_ACCOUNTING,
                false,
                reasons::MISC_NOT_DELEGATED,
                format!(
                    "{}; counting Running pods that request the resources as holding them",
                    pods.accounting_reason
                ),
            ),
        });
    }

    out.push(if kernel.last_good.is_none() {
        ConditionSpec {
            type_: ct::ADVERTISING,
            status: "Unknown",
            reason: reasons::SCAN_FAILED,
            message: "nothing is advertised or removed until the misc files have been read".into(),
        }
    } else {
        advertising_condition(figures, advertising, resources)
    });
    out
}

fn advertising_condition(
    figures: &BTreeMap<TeeKind, KindFigures>,
    advertising: &AdvertiseOutcome,
    resources: &ResourcesConfig,
) -> ConditionSpec {
    if !advertising.enabled {
        return cond(
            ct::ADVERTISING,
            false,
            reasons::ADVERTISING_DISABLED,
            "agent.advertise is false: the agent does not advertise extended resources on the Node"
                .into(),
        );
    }
    if figures.is_empty() {
        return cond(
            ct::ADVERTISING,
            false,
            reasons::NO_TEE_HARDWARE,
            "nothing to advertise: the host has no TEE key capacity".into(),
        );
    }
    let mut advertised = Vec::new();
    let mut foreign = Vec::new();
    for (kind, a) in &advertising.per_kind {
        let name = resources.resource_name(*kind);
        match a {
            KindAdvert::Advertised(v) => advertised.push(format!("{name}={v}")),
            KindAdvert::OwnedByOther { manager, value } => {
                foreign.push(owned_by_other(name, *manager, *value, figures.get(kind)))
            }
            KindAdvert::Disabled => {}
        }
    }
    let mut msg = if foreign.is_empty() {
        format!("advertising {}", advertised.join(", "))
    } else if advertised.is_empty() {
        foreign.join("; ")
    } else {
        format!(
            "{}; advertising {}",
            foreign.join("; "),
            advertised.join(", ")
        )
    };
    if let Some(e) = &advertising.error {
        msg.push_str(&format!(" (updating the Node failed, retrying: {e})"));
    }
    if foreign.is_empty() {
        cond(ct::ADVERTISING, true, reasons::ADVERTISED, msg)
    } else {
        cond(ct::ADVERTISING, false, reasons::OWNED_BY_OTHER, msg)
    }
}

/// README section that tells how to hand a name NFD holds to teeguard.
pub const HANDOVER_SECTION: &str = "Handing the key resources to teeguard";

/// What a resource someone else manages means for the scheduler, with the numbers: the value on the
/// Node against what teeguard would advertise (`capacity − external`), and what to do about it.
pub fn owned_by_other(
    name: &str,
    manager: Manager,
    value: Option<u64>,
    figures: Option<&KindFigures>,
) -> String {
    let shown = match value {
        Some(v) => format!("value {v}"),
        None => "no value on the Node".to_string(),
    };
    let mut msg = format!(
        "{name} is managed by {manager} ({}; {shown})",
        manager.evidence()
    );
    if let Some(f) = figures {
        let would = f.advertisable();
        msg.push_str(&format!(
            "; teeguard would advertise {would} (capacity {} − {} held outside Kubernetes)",
            f.capacity, f.external
        ));
        msg.push_str(&match value {
            Some(v) if v > would => {
                ": the scheduler may place pods on keys that are not free".to_string()
            }
            Some(v) if v == would => ": the same for now, but keys taken outside Kubernetes later stay invisible to the scheduler".to_string(),
            Some(v) => format!(": the scheduler leaves {} usable keys idle", would - v),
            None => ": the scheduler places no pod that needs it on this node".to_string(),
        });
    }
    match manager {
        Manager::Nfd => msg.push_str(&format!(
            ". Hand the name to teeguard: see README '{HANDOVER_SECTION}'"
        )),
        Manager::Other => msg.push_str(
            ". To have teeguard advertise it, stop whatever sets it and remove it from the Node's status",
        ),
        Manager::Overwritten => {}
    }
    msg
}

/// Apply timestamps: keep a previous condition's `lastTransitionTime` when its status is unchanged.
pub fn merge_conditions(
    previous: &[Condition],
    specs: Vec<ConditionSpec>,
    now: Timestamp,
) -> Vec<Condition> {
    specs
        .into_iter()
        .map(|s| {
            let last_transition_time = previous
                .iter()
                .find(|c| c.type_ == s.type_ && c.status == s.status)
                .map(|c| c.last_transition_time.clone())
                .unwrap_or_else(|| Time(now));
            Condition {
                type_: s.type_.to_string(),
                status: s.status.to_string(),
                reason: s.reason.to_string(),
                message: s.message,
                last_transition_time,
                observed_generation: None,
            }
        })
        .collect()
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
        });
    }
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
    let strip = |s: &TeeCapacityStatus| TeeCapacityStatus {
        heartbeat_time: None,
        counted_pods: Vec::new(),
        ..s.clone()
    };
    strip(a) != strip(b)
}

/// True when `new` lists a pod in `countedPods` that `prev` did not (a pod leaving the list is no
/// news: it waits for the next heartbeat).
pub fn lists_new_pods(prev: &TeeCapacityStatus, new: &TeeCapacityStatus) -> bool {
    new.counted_pods
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
    /// is due (the agent renews its Lease, see [`crate::lease`]).
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
mod tests {
    use super::*;
    use crate::attribution::PodPhase;
    use crate::scan::{HostScan, PodScan};
    use pretty_assertions::assert_eq;
    use std::path::PathBuf;

    fn scan(
        capacity: &[(TeeKind, u64)],
        kernel: &[(TeeKind, u64)],
        accounting: Accounting,
    ) -> HostState {
        HostState::Scanned(HostScan {
            misc_dir: PathBuf::from("/host/sys/fs/cgroup"),
            layout: CgroupLayout::V2,
            capacity: KindCounts::from_pairs(capacity.iter().copied()),
            kernel_used: KindCounts::from_pairs(kernel.iter().copied()),
            pods: Some(PodScan {
                kubepods: Some(PathBuf::from("/host/sys/fs/cgroup/kubepods.slice")),
                driver: Some(crate::scan::Driver::Systemd),
                accounting_reason: match accounting {
                    Accounting::PerPod => "pod cgroups carry misc.current".into(),
                    Accounting::RunningPods => "kubepods.slice/misc.current does not exist".into(),
                },
                accounting,
                usage: HashMap::from([(
                    "vm1".to_string(),
                    KindCounts::from_pairs([(TeeKind::Tdx, 1)]),
                )]),
                pods_read: 1,
                pods_unchanged: 0,
                skipped: vec![],
                skipped_count: 0,
                problems: vec![],
                problem_count: 0,
            }),
        })
    }

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(s).expect("ts")
    }

    fn outcome(per_kind: &[(TeeKind, KindAdvert)]) -> AdvertiseOutcome {
        AdvertiseOutcome {
            enabled: true,
            per_kind: per_kind.iter().cloned().collect(),
            error: None,
        }
    }

    fn find<'a>(s: &'a [ConditionSpec], t: &str) -> Option<&'a ConditionSpec> {
        s.iter().find(|c| c.type_ == t)
    }

    #[test]
    fn conditions_table() {
        let res = ResourcesConfig::default();
        let pods = vec![PodSummary {
            uid: "vm1".into(),
            name: "ns/vm1".into(),
            phase: PodPhase::Running,
            requests: KindCounts::from_pairs([(TeeKind::Tdx, 1)]),
        }];
        struct Case {
            name: &'static str,
            kernel: KernelView,
            advertising: AdvertiseOutcome,
            want: Vec<(&'static str, &'static str, &'static str)>,
            message_contains: Vec<(&'static str, &'static str)>,
        }
        let tdx_adv = outcome(&[(TeeKind::Tdx, KindAdvert::Advertised(15))]);
        let cases = vec![
            Case {
                name: "healthy TDX host",
                kernel: KernelView {
                    last_good: Some(scan(
                        &[(TeeKind::Tdx, 16)],
                        &[(TeeKind::Tdx, 1)],
                        Accounting::PerPod,
                    )),
                    error: None,
                },
                advertising: tdx_adv.clone(),
                want: vec![
                    (ct::KERNEL_READABLE, "True", reasons::SCANNED),
                    (ct::TEE_HARDWARE, "True", reasons::TEE_CAPACITY_FOUND),
                    (ct::PER_POD_ACCOUNTING, "True", reasons::MISC_DELEGATED),
                    (ct::ADVERTISING, "True", reasons::ADVERTISED),
                ],
                message_contains: vec![
                    (ct::TEE_HARDWARE, "tdx: 16 keys"),
                    (ct::ADVERTISING, "tdx.intel.com/keys=15"),
                ],
            },
            Case {
                name: "no misc controller",
                kernel: KernelView {
                    last_good: Some(HostState::NoController {
                        message: "no misc cgroup controller under /x".into(),
                    }),
                    error: None,
                },
                advertising: outcome(&[]),
                want: vec![
                    (ct::KERNEL_READABLE, "True", reasons::SCANNED),
                    (ct::TEE_HARDWARE, "False", reasons::NO_TEE_HARDWARE),
                    (ct::ADVERTISING, "False", reasons::NO_TEE_HARDWARE),
                ],
                message_contains: vec![(ct::TEE_HARDWARE, "no misc cgroup controller under /x")],
            },
            Case {
                name: "empty capacity",
                kernel: KernelView {
                    last_good: Some(HostState::Scanned(HostScan {
                        misc_dir: "/r".into(),
                        layout: CgroupLayout::V1,
                        capacity: KindCounts::ZERO,
                        kernel_used: KindCounts::ZERO,
                        pods: None,
                    })),
                    error: None,
                },
                advertising: outcome(&[]),
                want: vec![
                    (ct::KERNEL_READABLE, "True", reasons::SCANNED),
                    (ct::TEE_HARDWARE, "False", reasons::NO_TEE_HARDWARE),
                    (ct::ADVERTISING, "False", reasons::NO_TEE_HARDWARE),
                ],
                message_contains: vec![(ct::TEE_HARDWARE, "/r/misc.capacity lists no")],
            },
            Case {
                name: "scan failed after a good one",
                kernel: KernelView {
                    last_good: Some(scan(&[(TeeKind::Tdx, 16)], &[], Accounting::PerPod)),
                    error: Some("/r/misc.current:1: bad".into()),
                },
                advertising: tdx_adv.clone(),
                want: vec![
                    (ct::KERNEL_READABLE, "False", reasons::SCAN_FAILED),
                    (ct::TEE_HARDWARE, "True", reasons::TEE_CAPACITY_FOUND),
                    (ct::PER_POD_ACCOUNTING, "True", reasons::MISC_DELEGATED),
                    (ct::ADVERTISING, "True", reasons::ADVERTISED),
                ],
                message_contains: vec![(
                    ct::KERNEL_READABLE,
                    "/r/misc.current:1: bad; the figures are from the last successful scan",
                )],
            },
            Case {
                name: "scan never succeeded",
                kernel: KernelView {
                    last_good: None,
                    error: Some("boom".into()),
                },
                advertising: outcome(&[]),
                want: vec![
                    (ct::KERNEL_READABLE, "False", reasons::SCAN_FAILED),
                    (ct::TEE_HARDWARE, "Unknown", reasons::SCAN_FAILED),
                    (ct::ADVERTISING, "Unknown", reasons::SCAN_FAILED),
                ],
                message_contains: vec![(ct::KERNEL_READABLE, "boom")],
            },
            Case {
                name: "not delegated, NFD owns the resource",
                kernel: KernelView {
                    last_good: Some(scan(&[(TeeKind::Tdx, 16)], &[], Accounting::RunningPods)),
                    error: None,
                },
                advertising: outcome(&[(
                    TeeKind::Tdx,
                    KindAdvert::OwnedByOther {
                        manager: Manager::Nfd,
                        value: Some(16),
                    },
                )]),
                want: vec![
                    (ct::KERNEL_READABLE, "True", reasons::SCANNED),
                    (ct::TEE_HARDWARE, "True", reasons::TEE_CAPACITY_FOUND),
                    (ct::PER_POD_ACCOUNTING, "False", reasons::MISC_NOT_DELEGATED),
                    (ct::ADVERTISING, "False", reasons::OWNED_BY_OTHER),
                ],
                message_contains: vec![
                    (ct::PER_POD_ACCOUNTING, "counting Running pods"),
                    (
                        ct::ADVERTISING,
                        "tdx.intel.com/keys is managed by node-feature-discovery",
                    ),
                ],
            },
            Case {
                name: "advertising disabled",
                kernel: KernelView {
                    last_good: Some(scan(&[(TeeKind::Tdx, 16)], &[], Accounting::PerPod)),
                    error: None,
                },
                advertising: AdvertiseOutcome {
                    enabled: false,
                    per_kind: [(TeeKind::Tdx, KindAdvert::Disabled)].into_iter().collect(),
                    error: None,
                },
                want: vec![
                    (ct::KERNEL_READABLE, "True", reasons::SCANNED),
                    (ct::TEE_HARDWARE, "True", reasons::TEE_CAPACITY_FOUND),
                    (ct::PER_POD_ACCOUNTING, "True", reasons::MISC_DELEGATED),
                    (ct::ADVERTISING, "False", reasons::ADVERTISING_DISABLED),
                ],
                message_contains: vec![],
            },
        ];
        for case in cases {
            let figures = case.kernel.figures(&pods);
            let specs = conditions(&case.kernel, &figures, &case.advertising, &res);
            let got: Vec<_> = specs
                .iter()
                .map(|c| (c.type_, c.status, c.reason))
                .collect();
            assert_eq!(got, case.want, "case: {}", case.name);
            for (t, m) in case.message_contains {
                let c = find(&specs, t).expect("condition");
                assert!(
                    c.message.contains(m),
                    "case {}: {t} message {:?} lacks {m:?}",
                    case.name,
                    c.message
                );
            }
        }
    }

    #[test]
    fn status_figures_and_transition_times() {
        let res = ResourcesConfig::default();
        let pods = vec![PodSummary {
            uid: "vm1".into(),
            name: "ns/vm1".into(),
            phase: PodPhase::Running,
            requests: KindCounts::from_pairs([(TeeKind::Tdx, 1)]),
        }];
        let mut kernel = KernelView {
            last_good: Some(scan(
                &[(TeeKind::Tdx, 16)],
                &[(TeeKind::Tdx, 3)],
                Accounting::PerPod,
            )),
            error: None,
        };
        let adv = outcome(&[(TeeKind::Tdx, KindAdvert::Advertised(14))]);
        let figures = kernel.figures(&pods);
        let s1 = build_status(&StatusInput {
            kernel: &kernel,
            figures: &figures,
            advertising: &adv,
            resources: &res,
            counted_pods: &["vm1".to_string()],
            enforcing: None,
            previous: None,
            now: Timestamp::from_millisecond(100_500).expect("ts"),
        });
        let tdx = s1.tdx.clone().expect("tdx");
        assert_eq!(
            tdx,
            KindStatus {
                resource_name: "tdx.intel.com/keys".into(),
                capacity: 16,
                kernel_used: 3,
                pods_used: 1,
                external: 2,
                pending: 0,
                free: 13,
                advertised: Some(14),
            }
        );
        assert_eq!(s1.heartbeat_time, Some(Time(ts(100))));
        assert_eq!(s1.counted_pods, ["vm1"]);
        assert_eq!(s1.agent_version.as_deref(), Some(AGENT_VERSION));
        assert!(
            s1.conditions
                .iter()
                .all(|c| c.last_transition_time == Time(ts(100)))
        );

        // Same state later: only the heartbeat moves; not a content change.
        let s2 = build_status(&StatusInput {
            kernel: &kernel,
            figures: &figures,
            advertising: &adv,
            resources: &res,
            counted_pods: &[],
            enforcing: None,
            previous: Some(&s1),
            now: ts(130),
        });
        assert_eq!(s2.heartbeat_time, Some(Time(ts(130))));
        assert!(
            !content_differs(&s1, &s2),
            "a pod leaving countedPods is no news"
        );
        assert!(!lists_new_pods(&s1, &s2) && lists_new_pods(&s2, &s1));
        assert!(
            s2.conditions
                .iter()
                .all(|c| c.last_transition_time == Time(ts(100)))
        );

        // A scan fails: KernelReadable flips (new time), the others keep theirs, figures stay.
        kernel.record(Err(Error::Task("disk on fire".into())));
        let s3 = build_status(&StatusInput {
            kernel: &kernel,
            figures: &kernel.figures(&pods),
            advertising: &adv,
            resources: &res,
            counted_pods: &[],
            enforcing: None,
            previous: Some(&s2),
            now: ts(140),
        });
        assert!(content_differs(&s2, &s3));
        assert_eq!(s3.tdx, s2.tdx);
        let kr = s3.condition(ct::KERNEL_READABLE).expect("kr");
        assert_eq!(
            (kr.status.as_str(), kr.last_transition_time.clone()),
            ("False", Time(ts(140)))
        );
        let hw = s3.condition(ct::TEE_HARDWARE).expect("hw");
        assert_eq!(hw.last_transition_time, Time(ts(100)));
    }

    #[test]
    fn write_decision() {
        let t0 = Instant::now();
        let due = t0 + Duration::from_secs(30);
        let a = TeeCapacityStatus {
            heartbeat_time: Some(Time(ts(1))),
            ..Default::default()
        };
        let b = TeeCapacityStatus {
            heartbeat_time: Some(Time(ts(2))),
            ..Default::default()
        };
        let mut c = b.clone();
        c.agent_version = Some("other".into());
        assert_eq!(next_write(None, &a, t0), Write::Report);
        assert_eq!(
            next_write(Some((&a, due)), &b, due - Duration::from_millis(1)),
            Write::Nothing
        );
        assert_eq!(next_write(Some((&a, due)), &b, due), Write::Heartbeat);
        assert_eq!(next_write(Some((&a, due)), &c, t0), Write::Report);
        assert_eq!(next_write(Some((&a, due)), &c, due), Write::Report);
        // A newly counted pod is published at once; one leaving the list waits for the heartbeat.
        let mut listed = b.clone();
        listed.counted_pods = vec!["vm2".into()];
        assert_eq!(next_write(Some((&a, due)), &listed, t0), Write::Report);
        assert_eq!(next_write(Some((&listed, due)), &b, t0), Write::Nothing);
        assert_eq!(next_write(Some((&listed, due)), &b, due), Write::Report);
    }

    #[test]
    fn heartbeats_in_steady_state_are_exactly_one_interval_apart_at_the_nodes_offset() {
        let hb = Duration::from_secs(30);
        let offset = Duration::from_millis(12_345);
        // Published late in a slot's second (the write took 40 ms): the next slot, not the one after.
        let mut at = Duration::from_secs(1_700_000_000);
        let mut beats = Vec::new();
        for _ in 0..5 {
            let due = next_heartbeat(at, hb, offset);
            assert_eq!(due.as_millis() % hb.as_millis(), offset.as_millis());
            beats.push(due);
            at = due + Duration::from_millis(40);
        }
        for pair in beats.windows(2) {
            assert_eq!(pair[1] - pair[0], hb);
        }
    }

    #[test]
    fn after_a_change_the_next_heartbeat_is_half_to_one_and_a_half_intervals_later() {
        let hb = Duration::from_secs(30);
        for offset_ms in [0, 1, 7_500, 15_000, 29_999] {
            for change_ms in (0..60_000).step_by(997) {
                let change = Duration::from_secs(1_700_000_000) + Duration::from_millis(change_ms);
                let due = next_heartbeat(change, hb, Duration::from_millis(offset_ms));
                let gap = due - change;
                assert!(
                    gap >= hb / 2 && gap < hb * 3 / 2,
                    "offset {offset_ms} ms, change at +{change_ms} ms: next heartbeat after {gap:?}"
                );
            }
        }
    }

    #[test]
    fn five_thousand_nodes_heartbeats_are_spread_evenly_over_the_interval() {
        let hb = Duration::from_secs(30);
        let mut buckets = [0usize; 10];
        for i in 0..5000 {
            let offset = heartbeat_offset(&format!("node-{i:05}"), hb);
            assert!(offset < hb);
            buckets[(offset.as_millis() * 10 / hb.as_millis()) as usize] += 1;
        }
        // 500 per tenth of the interval; lockstep would put all 5,000 in one.
        for (i, n) in buckets.iter().enumerate() {
            assert!(
                (400..=600).contains(n),
                "tenth {i} of the interval holds {n} of 5,000 nodes' heartbeats: {buckets:?}"
            );
        }
        assert_eq!(
            heartbeat_offset("node-a", hb),
            heartbeat_offset("node-a", hb),
            "a restarted agent keeps its place"
        );
    }

    fn counted_pod(uid: &str, pending: bool) -> CountedPod {
        CountedPod {
            uid: uid.into(),
            pending,
        }
    }

    #[test]
    fn counted_pods_lists_pending_and_recent_pods_newest_first() {
        let window = Duration::from_secs(30);
        let t0 = Instant::now();
        let mut tracker = CountedPods::default();
        let listed = tracker.update(&[counted_pod("a", false)], t0, window);
        assert_eq!(listed, ["a"]);
        let s = |n| t0 + Duration::from_secs(n);
        // b arrives later: listed first.
        let listed = tracker.update(
            &[counted_pod("a", false), counted_pod("b", true)],
            s(10),
            window,
        );
        assert_eq!(listed, ["b", "a"]);
        // Past the window, a holder drops out; a pod still pending stays however old.
        let listed = tracker.update(
            &[counted_pod("a", false), counted_pod("b", true)],
            s(45),
            window,
        );
        assert_eq!(listed, ["b"]);
        let listed = tracker.update(
            &[counted_pod("a", false), counted_pod("b", false)],
            s(45),
            window,
        );
        assert!(listed.is_empty(), "{listed:?}");
        // A pod no longer counted is forgotten: counted again, it is new again.
        tracker.update(&[counted_pod("b", false)], s(46), window);
        let listed = tracker.update(
            &[counted_pod("a", false), counted_pod("b", false)],
            s(47),
            window,
        );
        assert_eq!(listed, ["a"]);
    }

    #[test]
    fn counted_pods_list_is_bounded_and_keeps_the_newest() {
        let window = Duration::from_secs(30);
        let t0 = Instant::now();
        let mut tracker = CountedPods::default();
        let old: Vec<String> = (0..MAX_COUNTED_PODS)
            .map(|i| format!("old-{i:03}"))
            .collect();
        let pods: Vec<CountedPod> = old.iter().map(|u| counted_pod(u, true)).collect();
        tracker.update(&pods, t0, window);
        let mut all = pods.clone();
        all.push(counted_pod("new", true));
        let listed = tracker.update(&all, t0 + Duration::from_secs(1), window);
        assert_eq!(listed.len(), MAX_COUNTED_PODS);
        assert_eq!(listed[0], "new");
        assert_eq!(listed[1..], old[..MAX_COUNTED_PODS - 1]);
    }

    fn tdx_figures(capacity: u64, external: u64) -> KindFigures {
        KindFigures {
            capacity,
            kernel_used: external + 1,
            pods_used: 1,
            external,
            pending: 0,
            free: capacity - external - 1,
        }
    }

    #[test]
    fn advertising_condition_says_nfd_advertises_keys_held_outside_kubernetes_with_the_numbers() {
        let res = ResourcesConfig::default();
        // The host: 16 TDX keys, a VM pod holding 1, 3 held outside Kubernetes; NFD shows 16.
        let kernel = KernelView {
            last_good: Some(scan(
                &[(TeeKind::Tdx, 16)],
                &[(TeeKind::Tdx, 4)],
                Accounting::PerPod,
            )),
            error: None,
        };
        let pods = vec![PodSummary {
            uid: "vm1".into(),
            name: "ns/vm1".into(),
            phase: PodPhase::Running,
            requests: KindCounts::from_pairs([(TeeKind::Tdx, 1)]),
        }];
        let figures = kernel.figures(&pods);
        let adv = outcome(&[(
            TeeKind::Tdx,
            KindAdvert::OwnedByOther {
                manager: Manager::Nfd,
                value: Some(16),
            },
        )]);
        let specs = conditions(&kernel, &figures, &adv, &res);
        let c = find(&specs, ct::ADVERTISING).expect("Advertising");
        assert_eq!((c.status, c.reason), ("False", reasons::OWNED_BY_OTHER));
        assert_eq!(
            c.message,
            "tdx.intel.com/keys is managed by node-feature-discovery (its \
             nfd.node.kubernetes.io/extended-resources annotation lists it; value 16); teeguard \
             would advertise 13 (capacity 16 − 3 held outside Kubernetes): the scheduler may place \
             pods on keys that are not free. Hand the name to teeguard: see README 'Handing the key \
             resources to teeguard'"
        );
    }

    #[test]
    fn owned_by_other_message_tells_what_the_value_means_for_the_scheduler() {
        let name = "tdx.intel.com/keys";
        let f = tdx_figures(16, 3);
        /// (manager, value on the Node, figures, the message has, the message lacks)
        type Case<'a> = (
            Manager,
            Option<u64>,
            Option<&'a KindFigures>,
            Vec<&'a str>,
            Vec<&'a str>,
        );
        let cases: Vec<Case<'_>> = vec![
            (
                Manager::Nfd,
                Some(13),
                Some(&f),
                vec![
                    "(its nfd.node.kubernetes.io/extended-resources annotation lists it; value 13)",
                    "would advertise 13 (capacity 16 − 3 held outside Kubernetes): the same for now, but keys taken outside Kubernetes later stay invisible to the scheduler",
                    "see README 'Handing the key resources to teeguard'",
                ],
                vec!["not free"],
            ),
            (
                Manager::Nfd,
                Some(10),
                Some(&f),
                vec!["value 10", "the scheduler leaves 3 usable keys idle"],
                vec!["not free"],
            ),
            (
                Manager::Nfd,
                None,
                Some(&f),
                vec![
                    "(its nfd.node.kubernetes.io/extended-resources annotation lists it; no value on the Node)",
                    "the scheduler places no pod that needs it on this node",
                ],
                vec![],
            ),
            (
                Manager::Other,
                Some(16),
                Some(&f),
                vec![
                    "is managed by another manager (the Node had it and teeguard did not add it; value 16)",
                    "the scheduler may place pods on keys that are not free",
                    "stop whatever sets it and remove it from the Node's status",
                ],
                vec!["README"],
            ),
            (
                Manager::Overwritten,
                Some(20),
                Some(&f),
                vec![
                    "is managed by an unknown writer (it just replaced teeguard's value; teeguard writes its own back within 5 s unless NFD lists the name; value 20)",
                    "would advertise 13",
                ],
                vec!["README", "remove it"],
            ),
            (
                Manager::Nfd,
                Some(16),
                None,
                vec!["value 16). Hand the name to teeguard"],
                vec!["would advertise"],
            ),
        ];
        for (manager, value, figures, has, lacks) in cases {
            let msg = owned_by_other(name, manager, value, figures);
            assert!(
                msg.starts_with("tdx.intel.com/keys is managed by "),
                "{msg}"
            );
            for part in has {
                assert!(
                    msg.contains(part),
                    "{manager:?} {value:?}: {msg:?} lacks {part:?}"
                );
            }
            for part in lacks {
                assert!(
                    !msg.contains(part),
                    "{manager:?} {value:?}: {msg:?} has {part:?}"
                );
            }
        }
    }
}
