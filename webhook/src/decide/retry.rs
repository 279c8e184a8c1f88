//! Retrying the VMIs whose launcher pods teeguard refused, once a key is free for them (pure).
//!
//! virt-controller retries a refused pod CREATE with a doubling backoff (5 ms up to 1000 s): a VM that
//! waited minutes for a key would wait minutes more after one frees. Any change to the VMI makes
//! virt-controller sync it at once, so the webhook writes [`names::RETRIED_ANNOTATION`] on the VMIs
//! this module picks:
//!
//! - [`waiting`]: a VMI waits on teeguard when virt-controller's `Synchronized` condition is `False`
//!   with reason `FailedCreate` and quotes a teeguard webhook (`admission webhook "….teeguard.dev" denied
//!   the request`, or `failed calling webhook "….teeguard.dev"` while the webhook was down), the VMI is
//!   `Pending` (no pod yet) and is a TEE VM. A denial counts only when a free key ends it (the webhook
//!   ends those with [`REFUSAL_NOTE`]): one for anything else (forged limit annotations, a VMI asking
//!   for another number of keys) stays until the VMI changes, and retrying it would hold a key from
//!   every other VMI, again and again.
//! - [`plan`]: per free key, the VMI that has waited longest among those whose launcher pod could go to
//!   the node (KubeVirt's node selector for its kind, its own node selector and required affinity). A VMI
//!   retried within [`MIN_RETRY_INTERVAL`] is not retried again but keeps its key in the plan (its pod is
//!   on its way), so two VMIs never race for one key.
//!
//! Every replica plans from the same caches, so replicas retry the same VMIs; virt-controller's queue
//! folds the duplicates.
//!
//! virt-controller keeps retrying every waiting VMI on its own backoff, so when a key frees, some other
//! VMI's retry may land first and take it. A retried VMI therefore holds a [`Promises`] entry on the
//! node for [`PROMISE_TTL`]: the validating webhook counts the promised key as taken for every other
//! VMI's pod, until the promised VMI's pod is admitted and the node's report counts it.
//!
//! The same entry covers the moment between a launcher pod's admission and its binding: a pod CREATE
//! carries no node, so the webhook admits it against the first node with a free key without reserving
//! it (the binding does). Two VMIs' pods created together could both be admitted for the last key,
//! and one would then wait in the scheduler's queue (`Insufficient …`) instead of with teeguard's
//! refusal and retry. So an admitted launcher pod's VMI is promised the key on the node that fitted
//! ([`Promises::promise`], then [`Promises::admitted`]) until its binding is reviewed
//! ([`Promises::pod_ended`]; the ledger then holds the key on the node the scheduler chose), the report
//! counts the pod, the pod or the VMI is deleted (the caches' delete events), or [`PROMISE_TTL`].
//!
//! A promise is made only once the planner has run, about 100 ms after the report showing a key free;
//! a natural retry landing in between would take the key from a VMI that waited longer. So a launcher
//! pod CREATE also counts as taken, on each node, one key per VMI of the kind that waits ahead of the
//! pod's own VMI without a promise ([`ahead_of`], [`queued_on`]): the freed keys go to the VMIs that
//! waited longest, whichever retry lands first.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use k8s_openapi::api::core::v1::PodSpec;
use teeguard_shared::pod::KeyRequests;
use teeguard_shared::vmi::LaunchSecurity;
use teeguard_shared::{TeeKind, VirtualMachineInstance, names};

use super::affinity::node_matches;
use super::mutation::VmiRef;

/// A VMI is not retried again sooner than this after teeguard retried it (its pod may be on its way).
pub const MIN_RETRY_INTERVAL: Duration = Duration::from_secs(5);

/// How long a key stays promised to a retried VMI at most (its pod created, bound, started and counted
/// by the node's report usually takes 1-3 s).
pub const PROMISE_TTL: Duration = Duration::from_secs(10);

/// What a refusal of a virt-launcher pod ends with when refused VMIs are retried.
pub const REFUSAL_NOTE: &str =
    "; teeguard starts this VM by itself as soon as a key is free for it";

/// The condition virt-controller sets when it cannot create a VMI's pod.
pub const SYNCHRONIZED: &str = "Synchronized";
/// Its reason then.
const FAILED_CREATE: &str = "FailedCreate";

/// Add [`REFUSAL_NOTE`] to the message of a refusal a freed key ends (see
/// [`super::validation::reason::ends_when_a_key_frees`]).
pub fn note_refusal(reason: &str, message: Option<&mut String>) {
    if let Some(m) = message.filter(|_| super::validation::reason::ends_when_a_key_frees(reason)) {
        m.push_str(REFUSAL_NOTE);
    }
}

/// A VMI waiting for its launcher pod because teeguard refused it (or could not be called).
#[derive(Clone, Debug, PartialEq)]
pub struct Waiting {
    /// The VMI.
    pub vmi: VmiRef,
    /// The kind of key it needs.
    pub kind: TeeKind,
    /// When its pod was first refused (the condition's `lastTransitionTime`).
    pub since: Option<Timestamp>,
    /// When teeguard last retried it ([`names::RETRIED_ANNOTATION`]).
    pub retried: Option<Timestamp>,
    /// Where its launcher pod may go, as KubeVirt renders it: the VMI's node selector with the labels
    /// of its kind, and its affinity.
    pub placement: PodSpec,
}

/// How the API server quotes a webhook's denial, and a call to it that failed.
const DENIED_BY: &str = "admission webhook \"";
const FAILED_CALL: &str = "failed calling webhook \"";

/// Whether `message` has `lead` followed by the name of a teeguard webhook (one whose name ends in
/// [`names::WEBHOOK_NAME_SUFFIX`]).
fn quotes_teeguard(message: &str, lead: &str) -> bool {
    message.match_indices(lead).any(|(at, _)| {
        let rest = &message[at + lead.len()..];
        rest.split('"')
            .next()
            .is_some_and(|name| name.ends_with(names::WEBHOOK_NAME_SUFFIX))
    })
}

/// Whether a teeguard refusal quoted in a condition ends by itself: a call that failed (it ends when a
/// replica answers again), or a denial a free key ends (it carries [`REFUSAL_NOTE`]).
pub fn ends_by_itself(message: &str) -> bool {
    quotes_teeguard(message, FAILED_CALL)
        || (quotes_teeguard(message, DENIED_BY)
            && message.contains(REFUSAL_NOTE.trim_start_matches("; ")))
}

/// The labels KubeVirt v1.9 puts in a launcher pod's node selector for a launchSecurity (virt-handler
/// labels TEE hosts with them).
fn kind_labels(ls: &LaunchSecurity) -> Vec<&'static str> {
    let mut labels = Vec::new();
    if ls.tdx.is_some() {
        labels.push("kubevirt.io/tdx");
    }
    if ls.snp.is_some() {
        labels.extend(["kubevirt.io/sev", "kubevirt.io/sev-snp"]);
    }
    if let Some(sev) = &ls.sev {
        labels.push("kubevirt.io/sev");
        if sev
            .policy
            .as_ref()
            .and_then(|p| p.encrypted_state)
            .unwrap_or(false)
        {
            labels.push("kubevirt.io/sev-es");
        }
    }
    labels
}

/// The condition saying teeguard refused the VMI's pod until a key frees (or could not be called), if
/// any.
fn teeguard_refusal(vmi: &VirtualMachineInstance) -> Option<&teeguard_shared::vmi::VmiCondition> {
    vmi.status.as_ref()?.conditions.iter().find(|c| {
        c.type_ == SYNCHRONIZED
            && c.status == "False"
            && c.reason.as_deref() == Some(FAILED_CREATE)
            && c.message.as_deref().is_some_and(ends_by_itself)
    })
}

/// Whether `vmi` has no launcher pod yet: phase `Pending` (or none yet).
pub fn pending(vmi: &VirtualMachineInstance) -> bool {
    let phase = vmi.status.as_ref().and_then(|s| s.phase.as_deref());
    matches!(phase, None | Some("") | Some("Pending"))
}

/// Whether `vmi` waits for its launcher pod because teeguard refused it (see the module), and what
/// [`plan`] needs to know of it.
pub fn waiting(vmi: &VirtualMachineInstance) -> Option<Waiting> {
    let meta = &vmi.metadata;
    if meta.deletion_timestamp.is_some() {
        return None;
    }
    if !pending(vmi) {
        return None;
    }
    let kind = vmi.tee_kind().ok().flatten()?;
    let refusal = teeguard_refusal(vmi)?;
    let parse = |s: Option<&str>| s.and_then(|t| t.parse::<Timestamp>().ok());
    let mut selector = vmi.spec.node_selector.clone().unwrap_or_default();
    if let Some(ls) = &vmi.spec.domain.launch_security {
        for l in kind_labels(ls) {
            selector.insert(l.to_string(), "true".to_string());
        }
    }
    Some(Waiting {
        vmi: VmiRef {
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            uid: meta.uid.clone().unwrap_or_default(),
        },
        kind,
        since: parse(refusal.last_transition_time.as_deref()),
        retried: parse(
            meta.annotations
                .as_ref()
                .and_then(|a| a.get(names::RETRIED_ANNOTATION))
                .map(String::as_str),
        ),
        placement: PodSpec {
            node_selector: Some(selector),
            affinity: vmi.spec.affinity.clone(),
            ..PodSpec::default()
        },
    })
}

/// A node with keys available to new pods (its report's `free` less the keys reserved there).
#[derive(Clone, Debug, PartialEq)]
pub struct FreeNode<'a> {
    /// The node's name.
    pub name: &'a str,
    /// Its labels.
    pub labels: &'a BTreeMap<String, String>,
    /// Keys available per kind.
    pub available: KeyRequests,
}

/// One VMI to retry now, and the node whose free key it is expected to take.
#[derive(Clone, Debug, PartialEq)]
pub struct Retry<'w> {
    /// The VMI.
    pub waiting: &'w Waiting,
    /// The node.
    pub node: String,
}

/// A waiting VMI's place in the queue: oldest refusal first; a VMI whose refusal time is unknown goes
/// last; then by name, so every replica orders the VMIs alike.
fn turn(w: &Waiting) -> (bool, Option<Timestamp>, &str, &str) {
    (w.since.is_none(), w.since, &w.vmi.namespace, &w.vmi.name)
}

/// The waiting VMIs of `kind` whose turn comes before the VMI `vmi_uid`'s, in [`plan`]'s order (every
/// one of them when that VMI does not wait), leaving out those `promised` a key (their keys are held
/// already): the VMIs a freed key goes to first. A launcher pod CREATE counts them as taking the keys
/// on the nodes their pods may go to ([`queued_on`]), so a VMI that waited less, retried by
/// virt-controller's own backoff, does not take a key the retry task is about to hand to one that
/// waited longer.
pub fn ahead_of<'w>(
    waiting: &'w [Waiting],
    kind: TeeKind,
    vmi_uid: &str,
    promised: impl Fn(&str) -> bool,
) -> Vec<&'w Waiting> {
    let own = waiting.iter().find(|w| w.vmi.uid == vmi_uid).map(turn);
    waiting
        .iter()
        .filter(|w| {
            w.kind == kind
                && w.vmi.uid != vmi_uid
                && own.is_none_or(|own| turn(w) < own)
                && !promised(&w.vmi.uid)
        })
        .collect()
}

/// How many of `ahead` may take a key on node `name` with `labels`. A VMI whose pod may go to several
/// nodes counts on each: a newcomer may be refused on a node the VMI ahead will not take, and then
/// waits for the next pass of the retry task, which hands the keys out exactly.
pub fn queued_on(ahead: &[&Waiting], name: &str, labels: &BTreeMap<String, String>) -> u64 {
    ahead
        .iter()
        .filter(|w| node_matches(&w.placement, name, labels))
        .count() as u64
}

/// Which of `waiting` to retry at `now` (see the module): oldest first, one per available key of its
/// kind on a node its pod may go to. `nodes` is used up as keys are handed out.
pub fn plan<'w>(
    waiting: &'w [Waiting],
    nodes: &mut [FreeNode<'_>],
    now: Timestamp,
) -> Vec<Retry<'w>> {
    let mut order: Vec<&Waiting> = waiting.iter().collect();
    order.sort_by_key(|w| turn(w));
    let mut out = Vec::new();
    for w in order {
        let Some(node) = nodes.iter_mut().find(|n| {
            n.available.get(&w.kind).copied().unwrap_or(0) > 0
                && node_matches(&w.placement, n.name, n.labels)
        }) else {
            continue;
        };
        if let Some(slot) = node.available.get_mut(&w.kind) {
            *slot -= 1;
        }
        // A retry time in the future (another replica's clock) counts as recent.
        let recent = w.retried.is_some_and(|t| {
            now.duration_since(t).as_secs_f64() < MIN_RETRY_INTERVAL.as_secs_f64()
        });
        if !recent {
            out.push(Retry {
                waiting: w,
                node: node.name.to_string(),
            });
        }
    }
    out
}

/// One key promised to a retried VMI on a node.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Promise {
    node: String,
    kind: TeeKind,
    vmi_uid: String,
    /// The VMI's pod admitted against the promise: the promise ends when the report counts it.
    pod_uid: Option<String>,
    at: Instant,
}

/// The keys this replica promised to the VMIs it retried (see the module). Cheap to share behind an
/// `Arc`; time is an input.
#[derive(Debug, Default)]
pub struct Promises {
    list: Mutex<Vec<Promise>>,
}

impl Promises {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Promise>> {
        self.list.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Promise one `kind` key on `node` to the VMI `vmi_uid` (replacing its earlier promise).
    pub fn promise(&self, node: &str, kind: TeeKind, vmi_uid: &str, now: Instant) {
        let mut list = self.lock();
        list.retain(|p| p.vmi_uid != vmi_uid && now.saturating_duration_since(p.at) < PROMISE_TTL);
        list.push(Promise {
            node: node.to_string(),
            kind,
            vmi_uid: vmi_uid.to_string(),
            pod_uid: None,
            at: now,
        });
    }

    /// The promise made for pod `pod_uid` ends: its binding was reviewed (the ledger holds its key from
    /// then on, when the binding was admitted), or the pod was deleted.
    pub fn pod_ended(&self, pod_uid: &str) {
        self.lock()
            .retain(|p| p.pod_uid.as_deref() != Some(pod_uid));
    }

    /// Drop the promise to VMI `vmi_uid` (its retry could not be written, or the VMI was deleted).
    pub fn forget(&self, vmi_uid: &str) {
        self.lock().retain(|p| p.vmi_uid != vmi_uid);
    }

    /// The pod `pod_uid` of VMI `vmi_uid` was admitted: its promise lasts until the report counts it.
    pub fn admitted(&self, vmi_uid: &str, pod_uid: &str) {
        for p in self.lock().iter_mut().filter(|p| p.vmi_uid == vmi_uid) {
            p.pod_uid = Some(pod_uid.to_string());
        }
    }

    /// Whether the VMI `vmi_uid` holds a promise at `now`.
    pub fn is_promised(&self, vmi_uid: &str, now: Instant) -> bool {
        self.lock()
            .iter()
            .any(|p| p.vmi_uid == vmi_uid && now.saturating_duration_since(p.at) < PROMISE_TTL)
    }

    /// Add to `held` the keys `promises` (when given) holds on `node` for VMIs other than `except_vmi`
    /// (see [`Promises::held`]): what a pod of another VMI cannot have.
    pub fn add_held(
        promises: Option<&Promises>,
        held: &mut KeyRequests,
        node: &str,
        counted_pods: &[String],
        except_vmi: &str,
        now: Instant,
    ) {
        for (kind, n) in promises
            .map(|p| p.held(node, counted_pods, except_vmi, now))
            .unwrap_or_default()
        {
            *held.entry(kind).or_insert(0) += n;
        }
    }

    /// The keys promised on `node` to VMIs other than `except_vmi`, at `now`, leaving out those whose
    /// pods the node's report counts (`counted_pods`).
    pub fn held(
        &self,
        node: &str,
        counted_pods: &[String],
        except_vmi: &str,
        now: Instant,
    ) -> KeyRequests {
        let mut held = KeyRequests::new();
        let list = self.lock();
        for p in list.iter().filter(|p| {
            p.node == node
                && p.vmi_uid != except_vmi
                && now.saturating_duration_since(p.at) < PROMISE_TTL
                && !p.pod_uid.as_ref().is_some_and(|u| counted_pods.contains(u))
        }) {
            *held.entry(p.kind).or_insert(0) += 1;
        }
        held
    }
}

#[cfg(test)]
mod tests;
