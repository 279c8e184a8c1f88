//! The pure validating decision: does a node (or any candidate node) have the TEE keys a pod requests,
//! what to answer in `enforce` and `warn` mode, and whether a pod carries cgroup-limit annotations that
//! teeguard did not write. No I/O: the handler passes the reports, held figures and lookups in.
//!
//! Free keys of a node = the report's `free` − keys held there for other pods the report does not
//! count yet − keys kept for VMIs (promised to retried VMIs, and for a launcher pod not bound yet, those
//! the VMIs that waited longer are served from): the caller works them out ([`crate::decide::admit`])
//! and hands them in as [`Held`]. A report is unknown when it is missing, has no heartbeat, or its
//! heartbeat is older than `admission.staleReportAfter`, its heartbeat being the newer of its own
//! `heartbeatTime` and its agent's Lease renewal ([`Report`]); `admission.staleReportPolicy` says whether an
//! unknown report refuses (`deny`) or admits with a warning (`allow`). A report without figures for a
//! kind means the host has no keys of that kind.
//!
//! Modes: `enforce` answers a refusal with a denial; `warn` allows with a Kubernetes warning carrying the
//! same message. In warn mode a refused pod reserves nothing (there is no key to reserve); an admitted
//! one reserves as in enforce mode, so later warnings stay accurate. The cgroup-limit annotation check
//! ([`limits`]) denies in both modes: it is a security check, and a namespace label must not switch it
//! off. [`candidates`] scans the candidate nodes of a pod not bound yet.

use std::collections::BTreeMap;
use std::time::Duration;

use jiff::Timestamp;
use teeguard_shared::config::{AdmissionConfig, Mode, StalePolicy};
use teeguard_shared::crd::TeeCapacityStatus;
use teeguard_shared::pod::KeyRequests;
use teeguard_shared::{TeeKind, names};

pub mod candidates;
#[cfg(test)]
mod dra_tests;
#[cfg(test)]
mod held_tests;
pub mod limits;
#[cfg(test)]
mod tests;

pub use candidates::CandidateScan;
pub use limits::{
    ExpectedLimits, check_created_limits, check_updated_limits, expected_limits,
    has_limit_annotations, limit_annotations,
};

/// How a validating review ended (the metrics layer turns it into a label).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum ValidationOutcome {
    /// Allowed: enough keys (or nothing to check).
    Admitted,
    /// Allowed with a warning (warn mode, or an unknown report allowed by policy).
    Warned,
    /// Denied.
    Denied,
    /// Not ours: left alone without a decision (not a TEE pod, exempt, other kinds).
    Skipped,
}

/// How many nodes a refusal message lists before "and N more".
pub const MAX_LISTED_NODES: usize = 5;

/// What to do about a refusal, appended to every capacity message.
pub const HINT: &str =
    "free a key or add capacity; `kubectl get teecapacities` shows free keys per node";

const AGENT_HINT: &str = "a node needs a running teeguard agent to report its keys";

/// The request being validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Trigger {
    /// `CREATE pods`.
    PodCreate,
    /// The scheduler's `CREATE pods/binding`.
    Binding,
}

impl Trigger {
    /// The configured policy for unknown reports on this request.
    pub fn stale_policy(self, cfg: &AdmissionConfig) -> StalePolicy {
        match self {
            Trigger::PodCreate => cfg.stale_on_pod_create,
            Trigger::Binding => cfg.stale_on_binding,
        }
    }

    fn policy_field(self) -> &'static str {
        match self {
            Trigger::PodCreate => "admission.staleReportPolicy.podCreate",
            Trigger::Binding => "admission.staleReportPolicy.binding",
        }
    }
}

/// Why a node's figures are unknown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unknown {
    /// No `TeeCapacity` for the node.
    NoReport,
    /// The report has no `heartbeatTime`.
    NoHeartbeat,
    /// The heartbeat is older than `admission.staleReportAfter`.
    Stale {
        /// Time since the heartbeat.
        age: Duration,
    },
}

impl Unknown {
    fn describe(&self) -> String {
        match self {
            Unknown::NoReport => "has no TeeCapacity report".into(),
            Unknown::NoHeartbeat => "report has no heartbeat".into(),
            Unknown::Stale { age } => {
                format!("report is stale (last heartbeat {} ago)", human(*age))
            }
        }
    }
}

/// `42s`, `5m10s`, `3h2m`: whole seconds, two units at most.
pub fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 if s.is_multiple_of(60) => format!("{}m", s / 60),
        60..=3599 => format!("{}m{}s", s / 60, s % 60),
        _ if s % 3600 / 60 == 0 => format!("{}h", s / 3600),
        _ => format!("{}h{}m", s / 3600, s % 3600 / 60),
    }
}

/// What the webhook knows of a node's agent: its report and when it last renewed its heartbeat
/// Lease. The agent renews the Lease instead of re-writing an unchanged report, so the report's age is
/// that of the newer of the two.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Report<'a> {
    /// The report's status (`None`: no report).
    pub status: Option<&'a TeeCapacityStatus>,
    /// When the agent's Lease was last renewed (`None`: no Lease seen).
    pub lease_renewed: Option<Timestamp>,
}

/// A report without a Lease (the tests' shorthand).
#[cfg(test)]
impl<'a> From<Option<&'a TeeCapacityStatus>> for Report<'a> {
    fn from(status: Option<&'a TeeCapacityStatus>) -> Self {
        Report {
            status,
            lease_renewed: None,
        }
    }
}

/// The report if it is current, or why it is unknown.
pub fn current_report<'a>(
    report: impl Into<Report<'a>>,
    now: Timestamp,
    stale_after: Duration,
) -> Result<&'a TeeCapacityStatus, Unknown> {
    let report = report.into();
    let status = report.status.ok_or(Unknown::NoReport)?;
    let hb = status
        .heartbeat_time
        .as_ref()
        .map(|t| t.0)
        .max(report.lease_renewed)
        .ok_or(Unknown::NoHeartbeat)?;
    let age = now.duration_since(hb);
    // A heartbeat in the future (clock skew) is current.
    let age = Duration::try_from(age).unwrap_or(Duration::ZERO);
    if age > stale_after {
        return Err(Unknown::Stale { age });
    }
    Ok(status)
}

/// One kind's figures on one node, as the decision sees them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KindFigures {
    /// From a current report.
    Known {
        /// The report's `free`.
        free: u64,
        /// The report's `capacity`.
        capacity: u64,
        /// Keys held outside Kubernetes (`external`).
        external: u64,
        /// Keys held for other pods admitted or bound that the report does not count yet.
        reserved: u64,
        /// Of the keys left after `reserved`, those kept for VMIs (promised, or waiting longer than the
        /// pod's own).
        queued: u64,
    },
    /// The current report has no figures for the kind: the host has none of these keys.
    NoKeys,
    /// The report is missing or stale.
    Unknown(Unknown),
}

impl KindFigures {
    /// Keys a new pod can get: `free − reserved − queued`; 0 without keys; `None` when unknown.
    pub fn available(&self) -> Option<u64> {
        match self {
            KindFigures::Known {
                free,
                reserved,
                queued,
                ..
            } => Some(free.saturating_sub(*reserved).saturating_sub(*queued)),
            KindFigures::NoKeys => Some(0),
            KindFigures::Unknown(_) => None,
        }
    }
}

/// Whether a node can take the pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fit {
    /// Every requested kind has enough free keys.
    Fits,
    /// Some kind has too few.
    Short,
    /// Not short by what is known, but the report is unknown.
    Unknown,
}

/// Whether the scheduler allocates the requested kinds on a node: its current report says DRA mode and
/// has every requested kind.
fn scheduler_allocates(
    requests: &KeyRequests,
    report: &Result<&TeeCapacityStatus, Unknown>,
) -> bool {
    match report {
        Ok(s) => {
            s.accounting.as_deref() == Some("dra")
                && !requests.is_empty()
                && requests.keys().all(|k| s.kind(*k).is_some())
        }
        Err(_) => false,
    }
}

/// Keys a node's report does not show as taken but a pod cannot have there.
#[derive(Clone, Copy, Debug)]
pub struct Held<'h> {
    /// Held for other pods admitted or bound that the report does not count yet.
    pub reserved: &'h KeyRequests,
    /// Kept for VMIs: promised to retried VMIs, and those the VMIs that waited longer than the pod's
    /// own are served from.
    pub queued: &'h KeyRequests,
}

/// Keys held for other pods, none kept for VMIs (the tests' shorthand).
#[cfg(test)]
impl<'h> From<&'h KeyRequests> for Held<'h> {
    fn from(reserved: &'h KeyRequests) -> Self {
        Held {
            reserved,
            queued: {
                static NONE: KeyRequests = KeyRequests::new();
                &NONE
            },
        }
    }
}

/// One kind's figures on a node from its report (or why the report is unknown).
fn kind_figures(
    kind: TeeKind,
    report: &Result<&TeeCapacityStatus, Unknown>,
    held: Held<'_>,
) -> KindFigures {
    match report {
        Err(u) => KindFigures::Unknown(u.clone()),
        Ok(s) => match s.kind(kind) {
            None => KindFigures::NoKeys,
            Some(k) => {
                let reserved = held.reserved.get(&kind).copied().unwrap_or(0);
                let queued = held.queued.get(&kind).copied().unwrap_or(0);
                KindFigures::Known {
                    free: k.free,
                    capacity: k.capacity,
                    external: k.external,
                    reserved,
                    // Of the keys left, those the VMIs ahead take (the message counts no more).
                    queued: queued.min(k.free.saturating_sub(reserved)),
                }
            }
        },
    }
}

/// Whether a node fits, and its sort rank (most available keys of the scarcest requested kind + 1;
/// 0 when unknown), from `(keys wanted, figures)` per requested kind. Allocates nothing.
fn fit_and_rank(kinds: impl Iterator<Item = (u64, KindFigures)>) -> (Fit, u64) {
    let mut short = false;
    let mut unknown = false;
    let mut rank = u64::MAX;
    let mut any = false;
    for (want, f) in kinds {
        any = true;
        let avail = f.available();
        match avail {
            Some(a) if a < want => short = true,
            Some(_) => {}
            None => unknown = true,
        }
        rank = rank.min(avail.map_or(0, |a| a.saturating_add(1)));
    }
    let fit = if short {
        Fit::Short
    } else if unknown {
        Fit::Unknown
    } else {
        Fit::Fits
    };
    (fit, if any { rank } else { 0 })
}

/// One node assessed against the pod's requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeAssessment {
    /// Node name.
    pub node: String,
    /// Per requested kind: keys requested and the node's figures.
    pub kinds: Vec<(TeeKind, u64, KindFigures)>,
    /// The node's current report says DRA mode (`accounting: dra`) and it has every requested kind:
    /// the scheduler allocates its keys from the node's ResourceSlices, so a pod not bound yet may wait
    /// for one there (Pending), and a binding the scheduler made is its allocation.
    pub scheduler_allocates: bool,
}

impl NodeAssessment {
    /// Assess `node` for `requests` from its report (`None`: no report) and the keys `held` there for
    /// other pods and VMIs (a `&KeyRequests`: those reserved by other pods).
    pub fn new<'a, 'h>(
        node: &str,
        requests: &KeyRequests,
        report: impl Into<Report<'a>>,
        held: impl Into<Held<'h>>,
        now: Timestamp,
        stale_after: Duration,
    ) -> Self {
        let report = current_report(report, now, stale_after);
        let held = held.into();
        let kinds = requests
            .iter()
            .map(|(kind, n)| (*kind, *n, kind_figures(*kind, &report, held)))
            .collect();
        NodeAssessment {
            node: node.to_string(),
            kinds,
            scheduler_allocates: scheduler_allocates(requests, &report),
        }
    }

    /// Whether the pod fits.
    pub fn fit(&self) -> Fit {
        fit_and_rank(self.kinds.iter().map(|(_, want, f)| (*want, f.clone()))).0
    }

    fn unknown(&self) -> Option<&Unknown> {
        self.kinds.iter().find_map(|(_, _, f)| match f {
            KindFigures::Unknown(u) => Some(u),
            _ => None,
        })
    }

    /// The figures without the node name: `0/31 free (3 held outside Kubernetes)`, `has no TDX keys`,
    /// `report is stale (last heartbeat 5m ago)`; several kinds are listed by name.
    pub fn figures(&self) -> String {
        if let Some(u) = self.unknown() {
            return u.describe();
        }
        let multi = self.kinds.len() > 1;
        let mut parts = Vec::with_capacity(self.kinds.len());
        for (kind, _, f) in &self.kinds {
            let name = kind.display_name();
            let text = match f {
                KindFigures::Known {
                    capacity,
                    external,
                    reserved,
                    queued,
                    ..
                } => {
                    let mut notes = Vec::new();
                    if *external > 0 {
                        notes.push(format!("{external} held outside Kubernetes"));
                    }
                    if *reserved > 0 {
                        notes.push(format!("{reserved} just admitted, not in the report yet"));
                    }
                    if *queued > 0 {
                        notes.push(format!("{queued} kept for VMs waiting longer"));
                    }
                    let avail = f.available().unwrap_or(0);
                    let notes = if notes.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", notes.join(", "))
                    };
                    if multi {
                        format!("{name} {avail}/{capacity} free{notes}")
                    } else {
                        format!("{avail}/{capacity} free{notes}")
                    }
                }
                KindFigures::NoKeys if multi => format!("no {name} keys"),
                KindFigures::NoKeys => format!("has no {name} keys"),
                KindFigures::Unknown(u) => u.describe(),
            };
            parts.push(text);
        }
        parts.join(", ")
    }

    /// `node-a 0/31 free (3 held outside Kubernetes)`.
    pub fn describe(&self) -> String {
        format!("{} {}", self.node, self.figures())
    }
}

/// `TDX`, or `TDX+SEV-ES/SNP` for a pod requesting several kinds.
pub fn kinds_label(requests: &KeyRequests) -> String {
    let names: Vec<&str> = requests.keys().map(|k| k.display_name()).collect();
    names.join("+")
}

fn vm_label(requests: &KeyRequests) -> String {
    let total: u64 = requests.values().sum();
    let label = kinds_label(requests);
    if total > 1 {
        format!("this {label} VM ({total} keys)")
    } else {
        format!("this {label} VM")
    }
}

/// The capacity verdict before the mode is applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Admit, with warnings (an unknown report allowed by policy).
    Admit {
        /// Audit reason code.
        reason: &'static str,
        /// Warnings for the client.
        warnings: Vec<String>,
    },
    /// Refuse.
    Refuse {
        /// Audit reason code.
        reason: &'static str,
        /// The message (names the kind, the nodes and what to do).
        message: String,
    },
}

/// Reason codes (audit annotations).
pub mod reason {
    /// The node (or a candidate) has enough free keys.
    pub const ENOUGH_KEYS: &str = "enough-keys";
    /// Too few free keys.
    pub const INSUFFICIENT_KEYS: &str = "insufficient-keys";
    /// The report is missing or stale (admitted or refused by policy).
    pub const REPORT_UNKNOWN: &str = "report-unknown";
    /// No node matches the pod's node selector and required affinity.
    pub const NO_CANDIDATE_NODES: &str = "no-candidate-nodes";
    /// DRA mode: the scheduler allocates the node's keys (a binding it made, or a node a pod not
    /// bound yet may wait on).
    pub const SCHEDULER_ALLOCATED: &str = "scheduler-allocated";
    /// A cgroup-limit annotation teeguard did not write.
    pub const FORGED_LIMIT_ANNOTATION: &str = "forged-limit-annotation";
    /// No replica decides right now (an election, a new decider taking over, a decider that cannot
    /// renew its Lease) or the decider could not be reached.
    pub const NO_DECIDER: &str = "no-decider";

    /// Whether a refusal for `reason` is for lack of keys (or of a current report): what a freed key
    /// (or a report) ends. Such refusals put an Event on the VMI, and the VMI is retried.
    pub fn ends_when_a_key_frees(reason: &str) -> bool {
        matches!(
            reason,
            INSUFFICIENT_KEYS | REPORT_UNKNOWN | NO_CANDIDATE_NODES | NO_DECIDER
        )
    }
}

/// The verdict for a pod bound to one node (a binding, or a pod created with `spec.nodeName`).
pub fn decide_on_node(
    trigger: Trigger,
    requests: &KeyRequests,
    node: &NodeAssessment,
    policy: StalePolicy,
) -> Verdict {
    let vm = || vm_label(requests);
    if trigger == Trigger::Binding && node.scheduler_allocates {
        // The scheduler bound the pod after allocating its keys from the node's published devices;
        // the agent re-checks the kernel when the kubelet has it prepare them.
        return Verdict::Admit {
            reason: reason::SCHEDULER_ALLOCATED,
            warnings: Vec::new(),
        };
    }
    match node.fit() {
        Fit::Fits => Verdict::Admit {
            reason: reason::ENOUGH_KEYS,
            warnings: Vec::new(),
        },
        Fit::Short => Verdict::Refuse {
            reason: reason::INSUFFICIENT_KEYS,
            message: format!(
                "node {} cannot host {}: {}; {HINT}",
                node.node,
                vm(),
                node.figures()
            ),
        },
        Fit::Unknown => match policy {
            StalePolicy::Allow => Verdict::Admit {
                reason: reason::REPORT_UNKNOWN,
                warnings: vec![format!(
                    "teeguard could not check free {} keys on node {}: {}; allowed by {}",
                    kinds_label(requests),
                    node.node,
                    node.describe(),
                    trigger.policy_field()
                )],
            },
            StalePolicy::Deny => Verdict::Refuse {
                reason: reason::REPORT_UNKNOWN,
                message: format!(
                    "teeguard cannot tell whether node {} can host {}: {} ({} denies unknown reports); {AGENT_HINT}",
                    node.node,
                    vm(),
                    node.describe(),
                    trigger.policy_field()
                ),
            },
        },
    }
}

/// The verdict for a pod not bound yet: admitted when some candidate node (matching its node selector
/// and required affinity) has the keys. The same as feeding each candidate to a [`CandidateScan`]
/// (the tests' way to state a scan's verdict).
#[cfg(test)]
pub(crate) fn decide_candidates(
    requests: &KeyRequests,
    candidates: Vec<NodeAssessment>,
    policy: StalePolicy,
) -> Verdict {
    let mut scan = CandidateScan::new(requests);
    for c in candidates {
        if scan.offer_assessed(c).is_break() {
            break;
        }
    }
    scan.verdict(policy)
}

/// The mode for a namespace: its `teeguard.dev/mode` label, else the global mode. An unknown label value
/// keeps the global mode and yields a warning.
pub fn namespace_mode(
    global: Mode,
    namespace_labels: Option<&BTreeMap<String, String>>,
) -> (Mode, Option<String>) {
    match namespace_labels.and_then(|l| l.get(names::MODE_LABEL)) {
        None => (global, None),
        Some(v) => match v.parse::<Mode>() {
            Ok(m) => (m, None),
            Err(_) => (
                global,
                Some(format!(
                    "namespace label {}={v:?} is neither enforce nor warn; teeguard uses the global mode {}",
                    names::MODE_LABEL,
                    mode_name(global)
                )),
            ),
        },
    }
}

/// `enforce` or `warn`.
pub fn mode_name(mode: Mode) -> &'static str {
    match mode {
        Mode::Enforce => "enforce",
        Mode::Warn => "warn",
    }
}

/// The answer after the mode is applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Whether the request is allowed.
    pub allowed: bool,
    /// The denial message (only when denied).
    pub message: Option<String>,
    /// Warnings for the client.
    pub warnings: Vec<String>,
    /// Admitted, warned or denied.
    pub outcome: ValidationOutcome,
    /// Audit reason code.
    pub reason: &'static str,
    /// Whether the pod was admitted for real (not only by warn mode): its keys are held.
    pub reserve: bool,
}

/// Apply `mode` to a verdict: `warn` turns a refusal into an allow with the message as a warning.
pub fn apply_mode(verdict: Verdict, mode: Mode) -> Decision {
    match verdict {
        Verdict::Admit { reason, warnings } => Decision {
            allowed: true,
            message: None,
            outcome: if warnings.is_empty() {
                ValidationOutcome::Admitted
            } else {
                ValidationOutcome::Warned
            },
            warnings,
            reason,
            reserve: true,
        },
        Verdict::Refuse { reason, message } => match mode {
            Mode::Enforce => Decision {
                allowed: false,
                message: Some(message),
                warnings: Vec::new(),
                outcome: ValidationOutcome::Denied,
                reason,
                reserve: false,
            },
            Mode::Warn => Decision {
                allowed: true,
                message: None,
                warnings: vec![message],
                outcome: ValidationOutcome::Warned,
                reason,
                reserve: false,
            },
        },
    }
}
