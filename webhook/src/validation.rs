//! The pure validating decision: does a node (or any candidate node) have the TEE keys a pod requests,
//! what to answer in `enforce` and `warn` mode, and whether a pod carries cgroup-limit annotations that
//! teeguard did not write. No I/O: the handler passes the reports, ledger figures and lookups in.
//!
//! Free keys of a node = the report's `free` − keys this replica reserved there for pods the report does
//! not show yet (see [`crate::ledger`]). A report is unknown when it is missing, has no heartbeat, or its
//! heartbeat is older than `admission.staleReportAfter`; `admission.staleReportPolicy` says whether an
//! unknown report refuses (`deny`) or admits with a warning (`allow`). A report without figures for a
//! kind means the host has no keys of that kind.
//!
//! Modes: `enforce` answers a refusal with a denial; `warn` allows with a Kubernetes warning carrying the
//! same message. In warn mode a refused pod reserves nothing (there is no key to reserve); an admitted
//! one reserves as in enforce mode, so later warnings stay accurate. The cgroup-limit annotation check
//! denies in both modes: it is a security check, and a namespace label must not switch it off.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::ControlFlow;
use std::time::Duration;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::Pod;
use teeguard_shared::config::{AdmissionConfig, Mode, StalePolicy};
use teeguard_shared::crd::TeeCapacityStatus;
use teeguard_shared::pod::{KeyRequests, PodName, pod_display_name};
use teeguard_shared::{Config, TeeKind, names};

use crate::metrics::ValidationOutcome;
use crate::mutation::{MutationDecision, wanted_annotations};

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

/// The report if it is current, or why it is unknown.
pub fn current_report(
    status: Option<&TeeCapacityStatus>,
    now: Timestamp,
    stale_after: Duration,
) -> Result<&TeeCapacityStatus, Unknown> {
    let status = status.ok_or(Unknown::NoReport)?;
    let hb = status.heartbeat_time.as_ref().ok_or(Unknown::NoHeartbeat)?;
    let age = now.duration_since(hb.0);
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
        /// Keys this replica admitted that the report does not show yet.
        reserved: u64,
    },
    /// The current report has no figures for the kind: the host has none of these keys.
    NoKeys,
    /// The report is missing or stale.
    Unknown(Unknown),
}

impl KindFigures {
    /// Keys a new pod can get: `free − reserved`; 0 without keys; `None` when unknown.
    pub fn available(&self) -> Option<u64> {
        match self {
            KindFigures::Known { free, reserved, .. } => Some(free.saturating_sub(*reserved)),
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

/// One kind's figures on a node from its report (or why the report is unknown).
fn kind_figures(
    kind: TeeKind,
    report: &Result<&TeeCapacityStatus, Unknown>,
    reserved: &KeyRequests,
) -> KindFigures {
    match report {
        Err(u) => KindFigures::Unknown(u.clone()),
        Ok(s) => match s.kind(kind) {
            None => KindFigures::NoKeys,
            Some(k) => KindFigures::Known {
                free: k.free,
                capacity: k.capacity,
                external: k.external,
                reserved: reserved.get(&kind).copied().unwrap_or(0),
            },
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
}

impl NodeAssessment {
    /// Assess `node` for `requests` from its report (`None`: no report) and the keys `reserved` there by
    /// other pods.
    pub fn new(
        node: &str,
        requests: &KeyRequests,
        status: Option<&TeeCapacityStatus>,
        reserved: &KeyRequests,
        now: Timestamp,
        stale_after: Duration,
    ) -> Self {
        let report = current_report(status, now, stale_after);
        let kinds = requests
            .iter()
            .map(|(kind, n)| (*kind, *n, kind_figures(*kind, &report, reserved)))
            .collect();
        NodeAssessment {
            node: node.to_string(),
            kinds,
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
                    ..
                } => {
                    let mut notes = Vec::new();
                    if *external > 0 {
                        notes.push(format!("{external} held outside Kubernetes"));
                    }
                    if *reserved > 0 {
                        notes.push(format!("{reserved} just admitted, not in the report yet"));
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
    /// A cgroup-limit annotation teeguard did not write.
    pub const FORGED_LIMIT_ANNOTATION: &str = "forged-limit-annotation";
}

/// The verdict for a pod bound to one node (a binding, or a pod created with `spec.nodeName`).
pub fn decide_on_node(
    trigger: Trigger,
    requests: &KeyRequests,
    node: &NodeAssessment,
    policy: StalePolicy,
) -> Verdict {
    let vm = || vm_label(requests);
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
/// and required affinity) has the keys. The same as feeding each candidate to a [`CandidateScan`].
pub fn decide_candidates(
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

/// The candidate nodes of a pod not bound yet, folded one at a time in any order.
///
/// [`CandidateScan::offer`] says [`ControlFlow::Break`] at the first node that fits (the verdict is then
/// an admission and the rest need not be looked at). Until then the scan keeps only counts, the best
/// [`MAX_LISTED_NODES`] nodes for the refusal message (most available keys, then name) and the first
/// [`MAX_LISTED_NODES`] names (by name) of nodes with unknown reports, so a scan over thousands of nodes
/// allocates only for the few it may list. The verdict is the same whatever the order of the offers.
#[derive(Clone, Debug)]
pub struct CandidateScan<'r> {
    requests: &'r KeyRequests,
    total: usize,
    unknown: usize,
    fits: bool,
    /// Sorted best first: rank descending, then name.
    best: Vec<(u64, NodeAssessment)>,
    /// Sorted by name.
    unknown_names: Vec<String>,
}

impl<'r> CandidateScan<'r> {
    /// An empty scan for a pod requesting `requests`.
    pub fn new(requests: &'r KeyRequests) -> Self {
        CandidateScan {
            requests,
            total: 0,
            unknown: 0,
            fits: false,
            best: Vec::new(),
            unknown_names: Vec::new(),
        }
    }

    /// Offer the candidate `node` with its report (`None`: no report) and the keys `reserved` there by
    /// other pods (see [`NodeAssessment::new`]). Allocates only when the node joins the listed few.
    pub fn offer(
        &mut self,
        node: &str,
        status: Option<&TeeCapacityStatus>,
        reserved: &KeyRequests,
        now: Timestamp,
        stale_after: Duration,
    ) -> ControlFlow<()> {
        let report = current_report(status, now, stale_after);
        let requests = self.requests;
        let (fit, rank) = fit_and_rank(
            requests
                .iter()
                .map(|(kind, n)| (*n, kind_figures(*kind, &report, reserved))),
        );
        self.add(fit, rank, node, || {
            NodeAssessment::new(node, requests, status, reserved, now, stale_after)
        })
    }

    /// Offer an already assessed candidate (for `requests` of this scan).
    pub fn offer_assessed(&mut self, a: NodeAssessment) -> ControlFlow<()> {
        let (fit, rank) = fit_and_rank(a.kinds.iter().map(|(_, want, f)| (*want, f.clone())));
        let node = a.node.clone();
        self.add(fit, rank, &node, || a)
    }

    fn add(
        &mut self,
        fit: Fit,
        rank: u64,
        node: &str,
        assess: impl FnOnce() -> NodeAssessment,
    ) -> ControlFlow<()> {
        self.total += 1;
        match fit {
            Fit::Fits => {
                self.fits = true;
                return ControlFlow::Break(());
            }
            Fit::Unknown => {
                self.unknown += 1;
                let at = self.unknown_names.partition_point(|n| n.as_str() < node);
                if at < MAX_LISTED_NODES {
                    self.unknown_names.insert(at, node.to_string());
                    self.unknown_names.truncate(MAX_LISTED_NODES);
                }
            }
            Fit::Short => {}
        }
        // Best first: higher rank, then smaller name.
        let at = self
            .best
            .partition_point(|(r, a)| *r > rank || (*r == rank && a.node.as_str() < node));
        if at < MAX_LISTED_NODES {
            self.best.insert(at, (rank, assess()));
            self.best.truncate(MAX_LISTED_NODES);
        }
        ControlFlow::Continue(())
    }

    /// Candidates offered so far.
    pub fn offered(&self) -> usize {
        self.total
    }

    /// Whether some offered candidate fits.
    pub fn fits(&self) -> bool {
        self.fits
    }

    /// The verdict over every candidate offered (or up to the first that fits).
    pub fn verdict(self, policy: StalePolicy) -> Verdict {
        let requests = self.requests;
        if self.fits {
            return Verdict::Admit {
                reason: reason::ENOUGH_KEYS,
                warnings: Vec::new(),
            };
        }
        let vm = vm_label(requests);
        if self.total == 0 {
            return Verdict::Refuse {
                reason: reason::NO_CANDIDATE_NODES,
                message: format!(
                    "no node can host {vm}: no node matches the pod's nodeSelector and required node affinity; \
                     check the VirtualMachineInstance's nodeSelector/affinity and the nodes' labels"
                ),
            };
        }
        if self.unknown > 0 && policy == StalePolicy::Allow {
            let shown = list_more(self.unknown_names.join(", "), self.unknown);
            return Verdict::Admit {
                reason: reason::REPORT_UNKNOWN,
                warnings: vec![format!(
                    "teeguard could not check free {} keys: no node with a current report has enough, and the report of {shown} is missing or stale; allowed by {}",
                    kinds_label(requests),
                    Trigger::PodCreate.policy_field()
                )],
            };
        }
        let listed: Vec<String> = self.best.iter().map(|(_, a)| a.describe()).collect();
        let list = list_more(listed.join(", "), self.total);
        let hint = if self.unknown == 0 {
            HINT.to_string()
        } else {
            format!("{HINT}; {AGENT_HINT}")
        };
        Verdict::Refuse {
            reason: if self.unknown == self.total {
                reason::REPORT_UNKNOWN
            } else {
                reason::INSUFFICIENT_KEYS
            },
            message: format!("no node can host {vm}: {list}; {hint}"),
        }
    }
}

/// `list`, followed by ` and N more` when `total` exceeds [`MAX_LISTED_NODES`].
fn list_more(mut list: String, total: usize) -> String {
    if total > MAX_LISTED_NODES {
        list.push_str(&format!(" and {} more", total - MAX_LISTED_NODES));
    }
    list
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
    /// Whether the pod's keys should be reserved in the ledger (admitted for real).
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

// ---- cgroup-limit annotations ----

/// A pod's cgroup-limit annotations ([`names::is_limit_annotation`]).
pub fn limit_annotations(pod: &Pod) -> BTreeMap<&str, &str> {
    pod.metadata
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| names::is_limit_annotation(k))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

/// Whether a pod carries any cgroup-limit annotation (without collecting them).
pub fn has_limit_annotations(pod: &Pod) -> bool {
    pod.metadata
        .annotations
        .iter()
        .flatten()
        .any(|(k, _)| names::is_limit_annotation(k))
}

/// The cgroup-limit annotations the mutating webhook writes on a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExpectedLimits {
    /// Exactly these (empty: none), for a VM of this kind and key count when it is a TEE pod.
    Exactly {
        /// Key and value of each.
        annotations: Vec<(String, String)>,
        /// The TEE kind and keys, when teeguard writes any.
        tee: Option<(TeeKind, u32)>,
    },
    /// The mutation decision refused the pod, so the annotations cannot be checked (the reason).
    Unverifiable(String),
}

/// What the mutating webhook writes for this pod, from its decision (re-run on the pod as validated).
/// For a TEE pod's CRI-O annotation the value keeps the pod's other `key=value` entries, exactly as the
/// mutation merges them; only the `misc.max` entry must be teeguard's.
pub fn expected_limits(pod: &Pod, mutation: &MutationDecision, config: &Config) -> ExpectedLimits {
    match mutation {
        MutationDecision::Inject(inj) => ExpectedLimits::Exactly {
            annotations: wanted_annotations(pod, inj.kind, inj.keys, config),
            tee: Some((inj.kind, inj.keys)),
        },
        MutationDecision::Skip(_) => ExpectedLimits::Exactly {
            annotations: Vec::new(),
            tee: None,
        },
        MutationDecision::Deny(d) => ExpectedLimits::Unverifiable(d.message.clone()),
    }
}

const WHY_LIMITS: &str = "cgroup-limit annotations (misc-max.teeguard.dev/*, io.kubernetes.cri-o.UnifiedCgroup.*, \
     unified-cgroup.crio.io/*) are written only by teeguard's mutating webhook, so that a pod cannot raise its own \
     TEE key limit; remove it (KubeVirt copies a VirtualMachineInstance's annotations onto its pod)";

/// On CREATE: the denial message when the pod carries a cgroup-limit annotation other than exactly what
/// the mutating webhook writes; `None` when it is clean.
pub fn check_created_limits(pod: &Pod, expected: &ExpectedLimits) -> Option<String> {
    let present = limit_annotations(pod);
    if present.is_empty() {
        return None;
    }
    let name = PodName(pod);
    let (annotations, tee) = match expected {
        ExpectedLimits::Unverifiable(why) => {
            let keys: Vec<&str> = present.keys().copied().collect();
            return Some(format!(
                "pod {name}: cannot check annotation {} against what teeguard writes: {why}",
                keys.join(", ")
            ));
        }
        ExpectedLimits::Exactly { annotations, tee } => (annotations, tee),
    };
    let mut problems = Vec::new();
    for (k, v) in &present {
        match annotations.iter().find(|(ek, _)| ek == k) {
            Some((_, ev)) if ev == v => {}
            Some((_, ev)) => {
                let (kind, keys) = tee.unwrap_or((TeeKind::Tdx, 0));
                problems.push(format!(
                    "annotation {k}={v:?} differs from what teeguard writes for a {} VM with {keys} key{} ({ev:?})",
                    kind.display_name(),
                    if keys == 1 { "" } else { "s" }
                ));
            }
            None if annotations.is_empty() => problems.push(format!(
                "annotation {k}={v:?} is not allowed: teeguard writes no cgroup-limit annotation on this pod \
                 (only on virt-launcher pods of TEE VMs that are not exempt)"
            )),
            None => {
                let allowed: Vec<&str> = annotations.iter().map(|(k, _)| k.as_str()).collect();
                problems.push(format!(
                    "annotation {k}={v:?} is not allowed: teeguard writes only {} on this pod",
                    allowed.join(", ")
                ));
            }
        }
    }
    if problems.is_empty() {
        None
    } else {
        Some(format!("pod {name}: {}; {WHY_LIMITS}", problems.join("; ")))
    }
}

/// On UPDATE: the denial message when a cgroup-limit annotation was added, changed or removed (they are
/// written once, at creation); `None` when they are unchanged.
pub fn check_updated_limits(old: &Pod, new: &Pod) -> Option<String> {
    let before = limit_annotations(old);
    let after = limit_annotations(new);
    if before == after {
        return None;
    }
    let keys: BTreeSet<&str> = before.keys().chain(after.keys()).copied().collect();
    let mut problems = Vec::new();
    for k in keys {
        match (before.get(k), after.get(k)) {
            (None, Some(v)) => problems.push(format!("annotation {k}={v:?} cannot be added")),
            (Some(o), None) => problems.push(format!("annotation {k}={o:?} cannot be removed")),
            (Some(o), Some(v)) if o != v => problems.push(format!(
                "annotation {k} cannot be changed from {o:?} to {v:?}"
            )),
            _ => {}
        }
    }
    Some(format!(
        "pod {}: {} after creation; cgroup-limit annotations are written once, at creation, by teeguard's \
         mutating webhook, so that a pod cannot raise its own TEE key limit",
        pod_display_name(new),
        problems.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use pretty_assertions::assert_eq;
    use serde_json::json;
    use std::sync::Arc;
    use teeguard_shared::KindStatus;
    use teeguard_shared::config::CrioAnnotation;

    use crate::mutation::{VmiLookup, decide_mutation};

    const STALE: Duration = Duration::from_secs(90);

    fn now() -> Timestamp {
        Timestamp::from_second(1_750_000_000).expect("now")
    }

    fn kind(capacity: u64, free: u64, external: u64) -> KindStatus {
        KindStatus {
            resource_name: "tdx.intel.com/keys".into(),
            capacity,
            kernel_used: capacity - free,
            pods_used: capacity - free - external,
            external,
            pending: 0,
            free,
            advertised: None,
        }
    }

    fn report(tdx: Option<KindStatus>, age_secs: i64) -> TeeCapacityStatus {
        TeeCapacityStatus {
            tdx,
            heartbeat_time: Some(Time(
                now()
                    .checked_sub(jiff::SignedDuration::from_secs(age_secs))
                    .expect("ts"),
            )),
            ..Default::default()
        }
    }

    fn tdx(n: u64) -> KeyRequests {
        KeyRequests::from([(TeeKind::Tdx, n)])
    }

    fn assess(node: &str, status: Option<&TeeCapacityStatus>, reserved: u64) -> NodeAssessment {
        NodeAssessment::new(node, &tdx(1), status, &tdx(reserved), now(), STALE)
    }

    fn refused(v: Verdict) -> (&'static str, String) {
        match v {
            Verdict::Refuse { reason, message } => (reason, message),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    fn admitted(v: Verdict) -> (&'static str, Vec<String>) {
        match v {
            Verdict::Admit { reason, warnings } => (reason, warnings),
            other => panic!("expected an admission, got {other:?}"),
        }
    }

    #[test]
    fn report_freshness() {
        let fresh = report(Some(kind(31, 1, 0)), 10);
        assert!(current_report(Some(&fresh), now(), STALE).is_ok());
        let edge = report(Some(kind(31, 1, 0)), 90);
        assert!(current_report(Some(&edge), now(), STALE).is_ok());
        let stale = report(Some(kind(31, 1, 0)), 310);
        assert_eq!(
            current_report(Some(&stale), now(), STALE),
            Err(Unknown::Stale {
                age: Duration::from_secs(310)
            })
        );
        let future = report(Some(kind(31, 1, 0)), -30);
        assert!(current_report(Some(&future), now(), STALE).is_ok());
        let mut no_hb = fresh.clone();
        no_hb.heartbeat_time = None;
        assert_eq!(
            current_report(Some(&no_hb), now(), STALE),
            Err(Unknown::NoHeartbeat)
        );
        assert_eq!(current_report(None, now(), STALE), Err(Unknown::NoReport));
    }

    #[test]
    fn human_durations() {
        for (s, want) in [
            (0, "0s"),
            (59, "59s"),
            (60, "1m"),
            (310, "5m10s"),
            (3600, "1h"),
            (3725, "1h2m"),
            (86_400, "24h"),
        ] {
            assert_eq!(human(Duration::from_secs(s)), want);
        }
    }

    #[test]
    fn node_figures_and_fit() {
        let full = report(Some(kind(31, 0, 3)), 5);
        let one = report(Some(kind(31, 1, 0)), 5);
        let no_tdx = report(None, 5);
        let stale = report(Some(kind(31, 5, 0)), 600);
        // (assessment, fit, description)
        let cases = [
            (
                assess("a", Some(&full), 0),
                Fit::Short,
                "a 0/31 free (3 held outside Kubernetes)",
            ),
            (assess("b", Some(&one), 0), Fit::Fits, "b 1/31 free"),
            (
                assess("b", Some(&one), 1),
                Fit::Short,
                "b 0/31 free (1 just admitted, not in the report yet)",
            ),
            (
                assess("c", Some(&no_tdx), 0),
                Fit::Short,
                "c has no TDX keys",
            ),
            (
                assess("d", Some(&stale), 0),
                Fit::Unknown,
                "d report is stale (last heartbeat 10m ago)",
            ),
            (
                assess("e", None, 0),
                Fit::Unknown,
                "e has no TeeCapacity report",
            ),
        ];
        for (a, fit, text) in cases {
            assert_eq!(a.fit(), fit, "{a:?}");
            assert_eq!(a.describe(), text);
        }
        // Two keys requested, one free.
        let a = NodeAssessment::new("b", &tdx(2), Some(&one), &tdx(0), now(), STALE);
        assert_eq!(a.fit(), Fit::Short);
        // Several kinds: each is named; one short kind makes the node short.
        let mut both = report(Some(kind(31, 4, 0)), 5);
        both.sev_es = Some(KindStatus {
            resource_name: "sev-snp.amd.com/esids".into(),
            capacity: 10,
            free: 0,
            ..Default::default()
        });
        let req = KeyRequests::from([(TeeKind::Tdx, 1), (TeeKind::SevEs, 1)]);
        let a = NodeAssessment::new("m", &req, Some(&both), &KeyRequests::new(), now(), STALE);
        assert_eq!(a.fit(), Fit::Short);
        assert_eq!(a.describe(), "m TDX 4/31 free, SEV-ES/SNP 0/10 free");
        assert_eq!(kinds_label(&req), "TDX+SEV-ES/SNP");
    }

    #[test]
    fn binding_verdicts() {
        let full = report(Some(kind(31, 0, 3)), 5);
        let one = report(Some(kind(31, 1, 0)), 5);
        let stale = report(Some(kind(31, 5, 0)), 300);
        let req = tdx(1);

        let (r, w) = admitted(decide_on_node(
            Trigger::Binding,
            &req,
            &assess("node-a", Some(&one), 0),
            StalePolicy::Deny,
        ));
        assert_eq!((r, w.len()), (reason::ENOUGH_KEYS, 0));

        let (r, msg) = refused(decide_on_node(
            Trigger::Binding,
            &req,
            &assess("node-a", Some(&full), 0),
            StalePolicy::Allow,
        ));
        assert_eq!(r, reason::INSUFFICIENT_KEYS);
        assert_eq!(
            msg,
            "node node-a cannot host this TDX VM: 0/31 free (3 held outside Kubernetes); \
             free a key or add capacity; `kubectl get teecapacities` shows free keys per node"
        );

        // Stale under both policies, on both triggers.
        for trigger in [Trigger::Binding, Trigger::PodCreate] {
            let a = assess("node-s", Some(&stale), 0);
            let (r, w) = admitted(decide_on_node(trigger, &req, &a, StalePolicy::Allow));
            assert_eq!(r, reason::REPORT_UNKNOWN);
            assert_eq!(w.len(), 1);
            assert_eq!(
                w[0],
                format!(
                    "teeguard could not check free TDX keys on node node-s: node-s report is stale \
                     (last heartbeat 5m ago); allowed by {}",
                    trigger.policy_field()
                )
            );
            let (r, msg) = refused(decide_on_node(trigger, &req, &a, StalePolicy::Deny));
            assert_eq!(r, reason::REPORT_UNKNOWN);
            assert_eq!(
                msg,
                format!(
                    "teeguard cannot tell whether node node-s can host this TDX VM: node-s report is stale \
                     (last heartbeat 5m ago) ({} denies unknown reports); a node needs a running teeguard \
                     agent to report its keys",
                    trigger.policy_field()
                )
            );
        }
        // Missing report.
        let (_, msg) = refused(decide_on_node(
            Trigger::Binding,
            &req,
            &assess("node-x", None, 0),
            StalePolicy::Deny,
        ));
        assert!(msg.contains("has no TeeCapacity report"), "{msg}");
        // Two keys are named.
        let a = NodeAssessment::new("n", &tdx(2), Some(&one), &tdx(0), now(), STALE);
        let (_, msg) = refused(decide_on_node(
            Trigger::Binding,
            &tdx(2),
            &a,
            StalePolicy::Deny,
        ));
        assert!(
            msg.starts_with("node n cannot host this TDX VM (2 keys): 1/31 free"),
            "{msg}"
        );
    }

    #[test]
    fn candidate_verdicts_and_message_format() {
        let req = tdx(1);
        let full_ext = report(Some(kind(31, 0, 3)), 5);
        let full = report(Some(kind(31, 0, 0)), 5);
        let one = report(Some(kind(31, 1, 0)), 5);
        let stale = report(Some(kind(31, 9, 0)), 300);

        // The example from the issue.
        let (r, msg) = refused(decide_candidates(
            &req,
            vec![
                assess("node-b", Some(&full), 0),
                assess("node-a", Some(&full_ext), 0),
            ],
            StalePolicy::Deny,
        ));
        assert_eq!(r, reason::INSUFFICIENT_KEYS);
        assert_eq!(
            msg,
            "no node can host this TDX VM: node-a 0/31 free (3 held outside Kubernetes), node-b 0/31 free; \
             free a key or add capacity; `kubectl get teecapacities` shows free keys per node"
        );

        // One candidate with a key admits.
        let (r, _) = admitted(decide_candidates(
            &req,
            vec![assess("a", Some(&full), 0), assess("b", Some(&one), 0)],
            StalePolicy::Deny,
        ));
        assert_eq!(r, reason::ENOUGH_KEYS);
        // ... unless the ledger holds it.
        refused(decide_candidates(
            &req,
            vec![assess("a", Some(&full), 0), assess("b", Some(&one), 1)],
            StalePolicy::Deny,
        ));

        // Best first (most free, then name), at most five, "and N more"; stale last.
        let mut candidates = Vec::new();
        for (name, free) in [
            ("n3", 0),
            ("n1", 0),
            ("n2", 0),
            ("n4", 0),
            ("n5", 0),
            ("n6", 0),
        ] {
            let s = report(Some(kind(4, free, 0)), 5);
            candidates.push(NodeAssessment::new(
                name,
                &tdx(2),
                Some(&s),
                &tdx(0),
                now(),
                STALE,
            ));
        }
        let s = report(Some(kind(4, 1, 0)), 5);
        candidates.push(NodeAssessment::new(
            "z",
            &tdx(2),
            Some(&s),
            &tdx(0),
            now(),
            STALE,
        ));
        candidates.push(NodeAssessment::new(
            "a-stale",
            &tdx(2),
            Some(&stale),
            &tdx(0),
            now(),
            STALE,
        ));
        let (_, msg) = refused(decide_candidates(&tdx(2), candidates, StalePolicy::Deny));
        assert_eq!(
            msg,
            "no node can host this TDX VM (2 keys): z 1/4 free, n1 0/4 free, n2 0/4 free, n3 0/4 free, \
             n4 0/4 free and 3 more; free a key or add capacity; `kubectl get teecapacities` shows free keys \
             per node; a node needs a running teeguard agent to report its keys"
        );

        // Stale candidates under both policies.
        let c = || {
            vec![
                assess("full", Some(&full), 0),
                assess("stale", Some(&stale), 0),
            ]
        };
        let (r, w) = admitted(decide_candidates(&req, c(), StalePolicy::Allow));
        assert_eq!(r, reason::REPORT_UNKNOWN);
        assert!(
            w[0].contains("report of stale is missing or stale")
                && w[0].contains("admission.staleReportPolicy.podCreate"),
            "{}",
            w[0]
        );
        let (r, msg) = refused(decide_candidates(&req, c(), StalePolicy::Deny));
        assert_eq!(r, reason::INSUFFICIENT_KEYS);
        assert!(
            msg.contains("full 0/31 free, stale report is stale (last heartbeat 5m ago)"),
            "{msg}"
        );
        let (r, _) = refused(decide_candidates(
            &req,
            vec![assess("gone", None, 0)],
            StalePolicy::Deny,
        ));
        assert_eq!(r, reason::REPORT_UNKNOWN);

        // No candidate at all.
        let (r, msg) = refused(decide_candidates(&req, Vec::new(), StalePolicy::Allow));
        assert_eq!(r, reason::NO_CANDIDATE_NODES);
        assert!(
            msg.starts_with("no node can host this TDX VM: no node matches"),
            "{msg}"
        );
    }

    /// The candidate verdict as it was computed before [`CandidateScan`]: every candidate assessed,
    /// sorted and listed (unknown-report names by name).
    fn reference_verdict(
        requests: &KeyRequests,
        mut candidates: Vec<NodeAssessment>,
        policy: StalePolicy,
    ) -> Verdict {
        let vm = vm_label(requests);
        if candidates.is_empty() {
            return decide_candidates(requests, Vec::new(), policy);
        }
        if candidates.iter().any(|c| c.fit() == Fit::Fits) {
            return Verdict::Admit {
                reason: reason::ENOUGH_KEYS,
                warnings: Vec::new(),
            };
        }
        let rank = |a: &NodeAssessment| {
            a.kinds
                .iter()
                .map(|(_, _, f)| f.available().map_or(0, |a| a + 1))
                .min()
                .unwrap_or(0)
        };
        let mut unknown: Vec<String> = candidates
            .iter()
            .filter(|c| c.fit() == Fit::Unknown)
            .map(|c| c.node.clone())
            .collect();
        unknown.sort();
        let listing = |names: Vec<String>, total: usize| {
            let mut s = names
                .into_iter()
                .take(MAX_LISTED_NODES)
                .collect::<Vec<_>>()
                .join(", ");
            if total > MAX_LISTED_NODES {
                s.push_str(&format!(" and {} more", total - MAX_LISTED_NODES));
            }
            s
        };
        if !unknown.is_empty() && policy == StalePolicy::Allow {
            let n = unknown.len();
            return Verdict::Admit {
                reason: reason::REPORT_UNKNOWN,
                warnings: vec![format!(
                    "teeguard could not check free {} keys: no node with a current report has enough, and the report of {} is missing or stale; allowed by admission.staleReportPolicy.podCreate",
                    kinds_label(requests),
                    listing(unknown, n)
                )],
            };
        }
        candidates.sort_by(|a, b| rank(b).cmp(&rank(a)).then_with(|| a.node.cmp(&b.node)));
        let total = candidates.len();
        let list = listing(
            candidates.iter().map(NodeAssessment::describe).collect(),
            total,
        );
        let hint = if unknown.is_empty() {
            HINT.to_string()
        } else {
            format!("{HINT}; {AGENT_HINT}")
        };
        Verdict::Refuse {
            reason: if unknown.len() == total {
                reason::REPORT_UNKNOWN
            } else {
                reason::INSUFFICIENT_KEYS
            },
            message: format!("no node can host {vm}: {list}; {hint}"),
        }
    }

    /// A small deterministic generator (xorshift), so the property test needs no extra crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }
    }

    #[test]
    fn scan_matches_the_full_sort_in_any_order() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let both = KeyRequests::from([(TeeKind::Tdx, 1), (TeeKind::SevEs, 2)]);
        for round in 0..2_000 {
            let requests = match round % 3 {
                0 => tdx(1),
                1 => tdx(2),
                _ => both.clone(),
            };
            let n = rng.next(14) as usize;
            let mut candidates = Vec::new();
            for i in 0..n {
                // Mostly full nodes, so that refusals (and their lists) are common.
                let status = match rng.next(8) {
                    0 => None,
                    1 => Some(report(Some(kind(8, rng.next(3), rng.next(2))), 600)),
                    2 => Some(report(None, 5)),
                    _ => {
                        let mut s = report(Some(kind(8, rng.next(3), rng.next(2))), 5);
                        if rng.next(2) == 0 {
                            s.sev_es = Some(kind(16, rng.next(4), 0));
                        }
                        Some(s)
                    }
                };
                let mut reserved = KeyRequests::new();
                if rng.next(4) == 0 {
                    reserved.insert(TeeKind::Tdx, rng.next(3));
                }
                // Names collide in rank often; a few share prefixes.
                let name = format!("n{}", (i * 7 + round) % 23);
                if candidates.iter().any(|(c, _, _)| *c == name) {
                    continue;
                }
                candidates.push((name, status, reserved));
            }
            let assessed: Vec<NodeAssessment> = candidates
                .iter()
                .map(|(n, s, r)| NodeAssessment::new(n, &requests, s.as_ref(), r, now(), STALE))
                .collect();
            for policy in [StalePolicy::Deny, StalePolicy::Allow] {
                let want = reference_verdict(&requests, assessed.clone(), policy);
                // Forward, backward and rotated orders, through both entry points.
                for order in 0..3 {
                    let mut cs = candidates.clone();
                    match order {
                        0 => {}
                        1 => cs.reverse(),
                        _ => {
                            let by = round % cs.len().max(1);
                            cs.rotate_left(by);
                        }
                    }
                    let mut scan = CandidateScan::new(&requests);
                    for (n, s, r) in &cs {
                        if scan.offer(n, s.as_ref(), r, now(), STALE).is_break() {
                            assert!(scan.fits());
                            break;
                        }
                    }
                    assert!(scan.offered() <= cs.len());
                    assert_eq!(scan.verdict(policy), want, "round {round} order {order}");
                }
                assert_eq!(
                    decide_candidates(&requests, assessed.clone(), policy),
                    want,
                    "round {round}"
                );
            }
        }
    }

    #[test]
    fn scan_stops_at_the_first_fit_and_lists_at_most_five() {
        let req = tdx(1);
        let full = report(Some(kind(31, 0, 0)), 5);
        let one = report(Some(kind(31, 1, 0)), 5);
        let mut scan = CandidateScan::new(&req);
        for i in 0..1_000 {
            let name = format!("node-{i:04}");
            assert!(
                scan.offer(&name, Some(&full), &tdx(0), now(), STALE)
                    .is_continue()
            );
        }
        assert_eq!(scan.best.len(), MAX_LISTED_NODES);
        assert!(scan.unknown_names.is_empty());
        let (r, msg) = refused(scan.clone().verdict(StalePolicy::Deny));
        assert_eq!(r, reason::INSUFFICIENT_KEYS);
        assert!(
            msg.starts_with(
                "no node can host this TDX VM: node-0000 0/31 free, node-0001 0/31 free, node-0002 0/31 free, \
                 node-0003 0/31 free, node-0004 0/31 free and 995 more; "
            ),
            "{msg}"
        );
        assert!(
            scan.offer("late", Some(&one), &tdx(0), now(), STALE)
                .is_break()
        );
        assert_eq!(scan.offered(), 1_001);
        admitted(scan.verdict(StalePolicy::Deny));

        // Many unknown reports: the warning names the first five by name and counts the rest.
        let mut scan = CandidateScan::new(&req);
        for i in (0..12).rev() {
            let _ = scan.offer(&format!("gone-{i:02}"), None, &tdx(0), now(), STALE);
        }
        let (r, w) = admitted(scan.verdict(StalePolicy::Allow));
        assert_eq!(r, reason::REPORT_UNKNOWN);
        assert!(
            w[0].contains(
                "the report of gone-00, gone-01, gone-02, gone-03, gone-04 and 7 more is missing or stale"
            ),
            "{}",
            w[0]
        );
    }

    #[test]
    fn modes() {
        let refusal = Verdict::Refuse {
            reason: reason::INSUFFICIENT_KEYS,
            message: "no".into(),
        };
        let d = apply_mode(refusal.clone(), Mode::Enforce);
        assert_eq!(
            (d.allowed, d.message.as_deref(), d.outcome, d.reserve),
            (false, Some("no"), ValidationOutcome::Denied, false)
        );
        let d = apply_mode(refusal, Mode::Warn);
        assert_eq!(
            (d.allowed, d.message, d.warnings, d.outcome, d.reserve),
            (
                true,
                None,
                vec!["no".to_string()],
                ValidationOutcome::Warned,
                false
            )
        );
        for mode in [Mode::Enforce, Mode::Warn] {
            let d = apply_mode(
                Verdict::Admit {
                    reason: reason::ENOUGH_KEYS,
                    warnings: vec![],
                },
                mode,
            );
            assert_eq!(
                (d.allowed, d.outcome, d.reserve),
                (true, ValidationOutcome::Admitted, true)
            );
            let d = apply_mode(
                Verdict::Admit {
                    reason: reason::REPORT_UNKNOWN,
                    warnings: vec!["w".into()],
                },
                mode,
            );
            assert_eq!(
                (d.allowed, d.outcome, d.reserve),
                (true, ValidationOutcome::Warned, true)
            );
        }
    }

    #[test]
    fn namespace_mode_override() {
        let labels = |v: &str| BTreeMap::from([(names::MODE_LABEL.to_string(), v.to_string())]);
        let cases = [
            (Mode::Enforce, None, Mode::Enforce, false),
            (Mode::Enforce, Some(labels("warn")), Mode::Warn, false),
            (Mode::Warn, Some(labels("enforce")), Mode::Enforce, false),
            (Mode::Warn, Some(BTreeMap::new()), Mode::Warn, false),
            (Mode::Enforce, Some(labels("Warn")), Mode::Enforce, true),
            (Mode::Warn, Some(labels("off")), Mode::Warn, true),
        ];
        for (global, l, want, warned) in cases {
            let (m, w) = namespace_mode(global, l.as_ref());
            assert_eq!((m, w.is_some()), (want, warned), "{l:?}");
        }
    }

    // ---- annotations ----

    fn launcher(annotations: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": "virt-launcher-vm1-abcde", "namespace": "ns",
                "labels": {"kubevirt.io": "virt-launcher"},
                "annotations": annotations,
                "ownerReferences": [{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                    "name": "vm1", "uid": "vmi-uid", "controller": true}]
            },
            "spec": {"containers": [{"name": "compute", "resources": {
                "requests": {"tdx.intel.com/keys": "1"}, "limits": {"tdx.intel.com/keys": "1"}}}]}
        }))
        .expect("pod")
    }

    fn vmi(ls: serde_json::Value, labels: serde_json::Value) -> VmiLookup {
        let mut v = json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "vm1", "namespace": "ns", "uid": "vmi-uid", "labels": labels},
            "spec": {"domain": {}}});
        if !ls.is_null() {
            v["spec"]["domain"]["launchSecurity"] = ls;
        }
        VmiLookup::Found(Arc::new(
            teeguard_shared::VirtualMachineInstance::from_json(v).expect("vmi"),
        ))
    }

    fn check(pod: &Pod, lookup: Option<&VmiLookup>, cfg: &Config) -> Option<String> {
        let m = decide_mutation(pod, lookup, None, cfg);
        check_created_limits(pod, &expected_limits(pod, &m, cfg))
    }

    #[test]
    fn mutations_own_annotation_is_accepted_anything_else_denied() {
        let cfg = Config::default();
        let tdx_vmi = vmi(json!({"tdx": {}}), json!({}));
        // Exactly what mutation writes.
        assert_eq!(
            check(
                &launcher(json!({"misc-max.teeguard.dev/compute": "tdx 1"})),
                Some(&tdx_vmi),
                &cfg
            ),
            None
        );
        // No limit annotation at all is not a forgery.
        assert_eq!(
            check(&launcher(json!({"a": "b"})), Some(&tdx_vmi), &cfg),
            None
        );

        // (annotations, VMI, config, expected fragment)
        let mut crio_cfg = Config::default();
        crio_cfg.enforcement.crio_annotation = CrioAnnotation::Legacy;
        let sev_vmi = vmi(json!({"sev": {}}), json!({}));
        let plain_vmi = vmi(serde_json::Value::Null, json!({}));
        let exempt_vmi = vmi(json!({"tdx": {}}), json!({"teeguard.dev/exempt": "true"}));
        let cases: Vec<(serde_json::Value, &VmiLookup, &Config, &str)> = vec![
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 5"}),
                &tdx_vmi,
                &cfg,
                "annotation misc-max.teeguard.dev/compute=\"tdx 5\" differs from what teeguard writes for a TDX VM with 1 key (\"tdx 1\")",
            ),
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 1"}),
                &sev_vmi,
                &cfg,
                "differs from what teeguard writes for a SEV VM with 1 key (\"sev 1\")",
            ),
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 1", "misc-max.teeguard.dev/guest-console-log": "tdx 1"}),
                &tdx_vmi,
                &cfg,
                "annotation misc-max.teeguard.dev/guest-console-log=\"tdx 1\" is not allowed: teeguard writes only misc-max.teeguard.dev/compute",
            ),
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 1", "io.kubernetes.cri-o.UnifiedCgroup.compute": "misc.max=tdx 1"}),
                &tdx_vmi,
                &cfg,
                "io.kubernetes.cri-o.UnifiedCgroup.compute",
            ),
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 1"}),
                &plain_vmi,
                &cfg,
                "teeguard writes no cgroup-limit annotation on this pod",
            ),
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 1"}),
                &exempt_vmi,
                &cfg,
                "teeguard writes no cgroup-limit annotation",
            ),
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 1", "io.kubernetes.cri-o.UnifiedCgroup.compute": "misc.max=tdx 9"}),
                &tdx_vmi,
                &crio_cfg,
                "differs from what teeguard writes for a TDX VM with 1 key (\"misc.max=tdx 1\")",
            ),
            (
                json!({"unified-cgroup.crio.io/compute": "misc.max=tdx 1"}),
                &tdx_vmi,
                &cfg,
                "unified-cgroup.crio.io/compute",
            ),
        ];
        for (ann, lookup, config, want) in cases {
            let msg = check(&launcher(ann.clone()), Some(lookup), config)
                .unwrap_or_else(|| panic!("{ann} should be denied"));
            assert!(msg.contains(want), "{ann}: {want:?} not in {msg}");
            assert!(msg.starts_with("pod ns/virt-launcher-vm1-abcde: "), "{msg}");
            assert!(msg.contains("cannot raise its own"), "{msg}");
        }
        // The CRI-O annotation as mutation writes it (other entries kept, misc.max ours) is accepted.
        let ok = launcher(json!({
            "misc-max.teeguard.dev/compute": "tdx 1",
            "io.kubernetes.cri-o.UnifiedCgroup.compute": "memory.high=1073741824;misc.max=tdx 1"
        }));
        assert_eq!(check(&ok, Some(&tdx_vmi), &crio_cfg), None);

        // Not a virt-launcher pod, and an exempt pod: teeguard writes nothing there.
        let mut other = launcher(json!({"misc-max.teeguard.dev/compute": "tdx 1"}));
        other.metadata.labels = None;
        assert!(check(&other, None, &cfg).is_some_and(|m| m.contains("writes no cgroup-limit")));
        let mut exempt = launcher(json!({"misc-max.teeguard.dev/compute": "tdx 1"}));
        exempt.metadata.labels = Some(BTreeMap::from([
            ("kubevirt.io".to_string(), "virt-launcher".to_string()),
            ("teeguard.dev/exempt".to_string(), "true".to_string()),
        ]));
        assert!(check(&exempt, Some(&tdx_vmi), &cfg).is_some());

        // The VMI cannot be found: unverifiable, denied with the reason.
        let msg = check(
            &launcher(json!({"misc-max.teeguard.dev/compute": "tdx 1"})),
            Some(&VmiLookup::NotFound),
            &cfg,
        )
        .expect("denied");
        assert!(
            msg.contains("cannot check annotation") && msg.contains("not found yet"),
            "{msg}"
        );
    }

    #[test]
    fn has_limit_annotations_agrees_with_the_collected_ones() {
        for annotations in [
            json!({}),
            json!({"x": "1", "kubevirt.io/domain": "vm"}),
            json!({"misc-max.teeguard.dev/compute": "tdx 1"}),
            json!({"x": "1", "io.kubernetes.cri-o.UnifiedCgroup.compute": "misc.max=tdx 1"}),
            json!({"unified-cgroup.crio.io/compute": "misc.max=sev 1"}),
        ] {
            let pod = launcher(annotations.clone());
            assert_eq!(
                has_limit_annotations(&pod),
                !limit_annotations(&pod).is_empty(),
                "{annotations}"
            );
        }
        let mut bare = launcher(json!({}));
        bare.metadata.annotations = None;
        assert!(!has_limit_annotations(&bare));
    }

    #[test]
    fn updates_must_not_touch_limit_annotations() {
        let base = launcher(json!({"misc-max.teeguard.dev/compute": "tdx 1", "x": "1"}));
        let mut other_change = base.clone();
        other_change
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert("x".into(), "2".into());
        assert_eq!(check_updated_limits(&base, &other_change), None);
        assert_eq!(check_updated_limits(&base, &base), None);
        let cases = [
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 9", "x": "1"}),
                "annotation misc-max.teeguard.dev/compute cannot be changed from \"tdx 1\" to \"tdx 9\"",
            ),
            (json!({"x": "1"}), "cannot be removed"),
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 1", "unified-cgroup.crio.io/compute": "misc.max=tdx 9"}),
                "annotation unified-cgroup.crio.io/compute=\"misc.max=tdx 9\" cannot be added",
            ),
        ];
        for (ann, want) in cases {
            let msg = check_updated_limits(&base, &launcher(ann.clone())).expect("denied");
            assert!(msg.contains(want), "{ann}: {msg}");
            assert!(msg.contains("after creation"), "{msg}");
        }
    }
}
