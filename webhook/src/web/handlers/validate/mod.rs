//! `POST /validate`: the validating webhook for pod CREATE and UPDATE and the scheduler's
//! `CREATE pods/binding`.
//!
//! Envelope and lookups only; the decisions are the pure functions of [`crate::decide::validation`],
//! [`crate::decide::affinity`] and [`crate::decide::admit`] (through [`crate::cluster::admission`]).
//!
//! - **pods/binding**: only bindings of pods named `virt-launcher-*` are ours; any other is allowed at
//!   once, without an API call. The pod is looked up in the virt-launcher pod cache, else by one GET
//!   (the binding follows the pod's creation within milliseconds, usually before the watch has it). The
//!   target node must have the keys available to the pod; a pod holding none there yet then holds
//!   them (`keys::check`).
//! - **pod CREATE**: classify (the cgroup-limit annotations: only exactly what the mutating webhook
//!   writes is accepted, denied in every mode; then which pods are ours) → requests (a virt-launcher
//!   pod or a TEE RuntimeClass pod requesting keys as mutated) → check (with `spec.nodeName` as a
//!   binding; otherwise a node its node selector and required affinity allow must have the keys
//!   available to it, and a virt-launcher pod then holds them there) → answer (a refusal note, the
//!   VMI's placement for the queue, an Event).
//! - **pod UPDATE**: cgroup-limit annotations must not change. Everything else, DELETE, other kinds and
//!   subresources are allowed untouched.
//!
//! Exemptions (`teeguard.dev/exempt: "true"`): a namespace exempts everything; a pod or VMI exempts the
//! capacity check but not the annotation check (a pod's and a VMI's labels are in the user's hands, and
//! teeguard writes no limit annotation on exempt pods anyway). Dry-run requests are decided normally but
//! reserve nothing and record no Event. Denials for lack of keys in enforce mode record an
//! `InsufficientTEEKeys` Event on the VMI (off the hot path, see [`crate::cluster::events`]).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::Response;
use k8s_openapi::api::core::v1::{Pod, PodSpec};
use teeguard_shared::config::Mode;
use teeguard_shared::pod::{KeyRequests, PodName, key_requests};
use teeguard_shared::{Config, names};

use super::{Reviewed, serve_review};
use crate::cluster::admission::{Checker, FitHints, Target, check};
use crate::cluster::caches::{Lookups, PodLookup};
use crate::cluster::events::{EventSink, VmiEvent, VmiEventKind, vmi_reference};
use crate::decide::admit::Ask;
use crate::decide::holds::Claimant;
use crate::decide::mutation::{
    MutationDecision, SkipReason, VmiLookup, VmiRef, classify_pod, decide_mutation, is_exempt,
    runtime_class::tee_runtime_class,
};
use crate::decide::queue;
use crate::decide::validation::{
    Decision, Trigger, check_created_limits, check_updated_limits, expected_limits,
    has_limit_annotations, mode_name, namespace_mode, reason,
};
use crate::error::Result;
use crate::metrics::{Metrics, Outcome, ValidationOutcome};
use crate::web::admission::{Operation, ReviewResponse, audit};
use crate::web::admitted::AdmittedReview;
use crate::web::state::AppState;

mod decider;

pub use decider::Decider;
use decider::{Verdict, elsewhere, forward, unforwarded};

/// Endpoint name in metrics and logs.
pub const ENDPOINT: &str = crate::metrics::endpoint::VALIDATE;

/// Everything a validating review uses besides the lookups (which hold the admission index).
#[derive(Clone, Copy, Debug)]
pub struct ValidationContext<'a> {
    /// The configuration.
    pub config: &'a Config,
    /// Where to put Events (`None`: record none, as in the offline `review`).
    pub events: Option<&'a EventSink>,
    /// Metrics (`None` offline).
    pub metrics: Option<&'a Metrics>,
    /// The node that last fitted a pod of each kind.
    pub hints: &'a FitHints,
    /// This replica's name, written into its holds.
    pub replica: &'a str,
    /// Who decides, and how reviews reach it (`None`: this process decides alone, as the offline
    /// `review`).
    pub decider: Option<Decider<'a>>,
}

/// The axum handler.
pub async fn handle(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let s = &state;
    let forwarded = req
        .headers()
        .contains_key(crate::web::forward::FORWARDED_HEADER);
    serve_review(s, ENDPOINT, req, |body| async move {
        let v = &s.validation;
        let decider = Some(Decider {
            leadership: &v.leadership,
            forwarder: &v.forwarder,
            forwarded,
        });
        let ctx = ValidationContext {
            config: &s.config,
            events: v.events.as_ref(),
            metrics: Some(&s.metrics),
            hints: &v.hints,
            replica: &v.replica,
            decider,
        };
        review_validation(&body, &s.caches, &ctx).await
    })
    .await
}

/// The answer to one review, before it is rendered.
#[derive(Debug)]
struct Answer {
    request: &'static str,
    kind: &'static str,
    outcome: ValidationOutcome,
    reason: &'static str,
    message: Option<String>,
    warnings: Vec<String>,
    node: Option<String>,
    mode: Option<Mode>,
}

impl Answer {
    fn skip(request: &'static str, reason: &'static str) -> Self {
        Answer {
            request,
            kind: "none",
            outcome: ValidationOutcome::Skipped,
            reason,
            message: None,
            warnings: Vec::new(),
            node: None,
            mode: None,
        }
    }

    fn deny(request: &'static str, kind: &'static str, reason: &'static str, msg: String) -> Self {
        Answer {
            request,
            kind,
            outcome: ValidationOutcome::Denied,
            reason,
            message: Some(msg),
            warnings: Vec::new(),
            node: None,
            mode: None,
        }
    }

    fn from_decision(
        request: &'static str,
        kind: &'static str,
        d: Decision,
        node: Option<String>,
        mode: Mode,
    ) -> Self {
        Answer {
            request,
            kind,
            outcome: d.outcome,
            reason: d.reason,
            message: if d.allowed { None } else { d.message },
            warnings: d.warnings,
            node,
            mode: Some(mode),
        }
    }

    /// A refusal made before any check (no decider): in warn mode, admitted with its reason as a
    /// warning, as the check's own refusals are.
    fn in_mode(mut self, mode: Mode) -> Self {
        self.mode = Some(mode);
        if mode == Mode::Warn
            && let Some(message) = self.message.take()
        {
            self.outcome = ValidationOutcome::Warned;
            self.warnings.push(message);
        }
        self
    }

    fn with_warnings(mut self, mut warnings: Vec<String>) -> Self {
        warnings.append(&mut self.warnings);
        self.warnings = warnings;
        self
    }
}

fn primary_kind(requests: &KeyRequests) -> &'static str {
    requests.keys().next().map_or("none", |k| k.kernel_name())
}

/// Decide one validating review from its raw body: the same code serves HTTPS and the offline
/// `review` command. Errors are malformed reviews (HTTP 400).
///
/// With an elected decider, a review that finds nobody deciding, or whose decider cannot be reached,
/// waits once for a decider (one Lease read; a decider that stopped cleanly gave the Lease up) and
/// is reviewed again: a rolling restart refuses nothing.
pub async fn review_validation<L: Lookups>(
    body: &[u8],
    lookups: &L,
    ctx: &ValidationContext<'_>,
) -> Result<Reviewed> {
    let mut waited = false;
    loop {
        let mut review = AdmittedReview::parse(body)?;
        let req = &review.request;
        let pods = req.resource.group.is_empty() && req.resource.resource == "pods";
        let verdict = match (pods, req.sub_resource.as_str(), req.operation) {
            (true, "", Operation::Create) => pod_create(&mut review, lookups, ctx).await?,
            (true, "", Operation::Update) => {
                Verdict::Answer(pod_update(&mut review, lookups).await?)
            }
            (true, "binding", Operation::Create) => binding(&mut review, lookups, ctx).await?,
            (true, "", Operation::Delete) => Verdict::Answer(Answer::skip("other", "pod-delete")),
            _ => Verdict::Answer(Answer::skip("other", "not-validated")),
        };
        let uid = review.request.uid;
        let answer = match verdict {
            Verdict::Answer(a) => a,
            Verdict::Decline(why) => return Err(crate::error::Error::NotDeciding(why)),
            Verdict::Nobody { create, .. }
                if !waited && decider::await_decider(ctx, lookups.index(), None, create).await =>
            {
                waited = true;
                continue;
            }
            Verdict::Nobody { refusal, .. } => refusal,
            Verdict::Forward(address) => match forward(body, &address, ctx).await {
                Ok(answer) => return Ok(answer),
                Err(_)
                    if !waited
                        && decider::await_decider(ctx, lookups.index(), Some(&address), false)
                            .await =>
                {
                    waited = true;
                    continue;
                }
                Err(why) => return Ok(unforwarded(&address, why, ctx, uid)),
            },
        };
        if let Some(m) = ctx.metrics {
            m.validation(answer.request, answer.kind, answer.outcome);
        }
        return Ok(respond(uid, answer));
    }
}

fn respond(uid: String, a: Answer) -> Reviewed {
    let (mut response, outcome) = match a.message {
        Some(msg) => (ReviewResponse::deny(uid, 403, msg), Outcome::Denied),
        None => (ReviewResponse::allow(uid), Outcome::Allowed),
    };
    response = response
        .audit(audit::DECISION, a.outcome.as_str())
        .audit(audit::REASON, a.reason);
    if a.kind != "none" {
        response = response.audit(audit::TEE_KIND, a.kind);
    }
    if let Some(node) = a.node {
        response = response.audit(audit::NODE, node);
    }
    if let Some(mode) = a.mode {
        response = response.audit(audit::MODE, mode_name(mode));
    }
    for w in a.warnings {
        response = response.warn(w);
    }
    Reviewed { response, outcome }
}

/// Namespace labels; a failed lookup is treated as an unlabelled namespace, with a warning.
async fn namespace<L: Lookups>(
    lookups: &L,
    namespace: &str,
) -> (Option<BTreeMap<String, String>>, Vec<String>) {
    match lookups.namespace_labels(namespace).await {
        Ok(labels) => (labels, Vec::new()),
        Err(e) => (
            None,
            vec![format!(
                "teeguard could not read namespace {namespace} ({e}); its {} and {} labels were not applied",
                names::EXEMPT_LABEL,
                names::MODE_LABEL
            )],
        ),
    }
}

async fn pod_create<L: Lookups>(
    review: &mut AdmittedReview<'_>,
    lookups: &L,
    ctx: &ValidationContext<'_>,
) -> Result<Verdict> {
    const REQ: &str = "pod_create";
    let mut pod = review.pod()?;
    let req = &review.request;
    if pod.metadata.name.as_deref().is_none_or(str::is_empty) && !req.name.is_empty() {
        pod.metadata.name = Some(req.name.clone());
    }
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let (ns_labels, warnings) = namespace(lookups, &ns).await;
    if is_exempt(ns_labels.as_ref()) {
        return Ok(Verdict::Answer(Answer::skip(REQ, "exempt-namespace")));
    }
    let config = ctx.config;
    let class = classify_pod(&pod);
    let vmi = match &class {
        Ok(r) => Some(lookups.vmi(r).await),
        Err(_) => None,
    };
    let mutation = decide_mutation(&pod, vmi.as_ref(), ns_labels.as_ref(), config);

    let forged = if !has_limit_annotations(&pod) {
        None
    } else {
        check_created_limits(&pod, &expected_limits(&pod, &mutation, config))
    };
    if let Some(msg) = forged {
        tracing::info!(
            pod = %PodName(&pod),
            message = msg,
            "pod denied: cgroup-limit annotation"
        );
        let kind = match &mutation {
            MutationDecision::Inject(i) => i.kind.kernel_name(),
            _ => "none",
        };
        return Ok(Verdict::Answer(Answer::deny(
            REQ,
            kind,
            reason::FORGED_LIMIT_ANNOTATION,
            msg,
        )));
    }

    let vmi_ref = match class {
        Ok(r) => Some(r),
        Err(SkipReason::NotKubeVirt) if tee_runtime_class(&pod, config).is_some() => None, // no VMI
        Err(skip) => return Ok(Verdict::Answer(Answer::skip(REQ, skip.code()))),
    };
    if matches!(mutation, MutationDecision::Skip(SkipReason::ExemptVmi)) {
        return Ok(Verdict::Answer(Answer::skip(
            REQ,
            SkipReason::ExemptVmi.code(),
        )));
    }
    let requests = match requests(&pod, config, REQ) {
        Ok(r) => r,
        Err(answer) => return Ok(Verdict::Answer(*answer)),
    };
    let no_spec = PodSpec::default();
    let spec = pod.spec.as_ref().unwrap_or(&no_spec);
    let bound = spec.node_name.as_deref().filter(|n| !n.is_empty());
    let target = match bound {
        Some(node) => Target::Node(node, Trigger::PodCreate),
        None => Target::Candidates(spec),
    };
    let pod_name = PodName(&pod).to_string();
    // The planner starts the VM when a key frees (crate::cluster::retry), unless it was bound.
    let retried = vmi_ref.is_some() && bound.is_none() && config.admission.retry_refused_vmis;
    let keys = KeyCheck {
        request: REQ,
        pod_uid: pod.metadata.uid.as_deref().unwrap_or(&pod_name),
        pod: &pod_name,
        vmi: vmi_ref.as_ref(),
        requests: &requests,
        ns_labels: ns_labels.as_ref(),
        target,
        dry_run: req.dry_run,
        retried,
        warnings,
    };
    Ok(check_keys(keys, lookups, ctx))
}

/// The keys `pod` requests, or the answer when there are none (skipped) or a quantity is bad (denied).
fn requests(pod: &Pod, config: &Config, request: &'static str) -> Result<KeyRequests, Box<Answer>> {
    match key_requests(pod, &config.resources) {
        Ok(r) if !r.is_empty() => Ok(r),
        Ok(_) => Err(Box::new(Answer::skip(request, "no-key-request"))),
        Err(e) => Err(Box::new(Answer::deny(
            request,
            "none",
            "bad-quantity",
            e.to_string(),
        ))),
    }
}

/// A pod whose keys are checked, whichever request brought it.
struct KeyCheck<'a> {
    request: &'static str,
    pod_uid: &'a str,
    /// `namespace/name`.
    pod: &'a str,
    vmi: Option<&'a VmiRef>,
    requests: &'a KeyRequests,
    ns_labels: Option<&'a BTreeMap<String, String>>,
    target: Target<'a>,
    dry_run: bool,
    /// A refusal for lack of keys says that teeguard starts the VM when a key frees.
    retried: bool,
    warnings: Vec<String>,
}

/// Check → answer: decided here, forwarded to the decider or refused while nobody decides
/// ([`elsewhere`]); a refusal for lack of keys records an Event on the VMI.
fn check_keys<L: Lookups>(k: KeyCheck<'_>, lookups: &L, ctx: &ValidationContext<'_>) -> Verdict {
    let config = ctx.config;
    let (mode, mode_warning) = namespace_mode(config.admission.mode, k.ns_labels);
    let mut warnings = k.warnings;
    warnings.extend(mode_warning);
    let kind = primary_kind(k.requests);
    let (trigger, node) = match k.target {
        Target::Node(node, trigger) => (trigger, Some(node.to_string())),
        Target::Candidates(_) => (Trigger::PodCreate, None),
    };
    let note = |a: &mut Answer| {
        if k.retried {
            queue::note_refusal(a.reason, a.message.as_mut());
        }
    };
    // Nobody decides: a refusal like one for lack of keys (the VMI waits its turn), or in warn mode
    // an admission with the reason as a warning.
    let refused = |mut a: Answer| {
        note(&mut a);
        a.in_mode(mode).with_warnings(warnings.clone())
    };
    let unbound = node.is_none();
    if let Some(v) = elsewhere(ctx, lookups.index(), unbound, (k.request, kind), refused) {
        return v;
    }
    let vmi_name = k.vmi.map(VmiRef::to_string).unwrap_or_default();
    let ask = Ask {
        claimant: Claimant {
            pod_uid: k.pod_uid,
            vmi_uid: k.vmi.map_or("", |v| v.uid.as_str()),
        },
        pod: k.pod,
        vmi: &vmi_name,
        requests: k.requests,
        mode,
        policy: trigger.stale_policy(&config.admission),
        dry_run: k.dry_run,
        stale_after: config.admission.stale_report_after,
        replica: ctx.replica,
    };
    let decision = check(&checker(lookups, ctx), &ask, k.target);
    let mut answer = Answer::from_decision(k.request, kind, decision, node, mode);
    note(&mut answer);
    record_event(&answer, k.vmi, k.dry_run, ctx);
    log_decision(&answer, k.pod);
    Verdict::Answer(answer.with_warnings(warnings))
}

fn checker<'a, L: Lookups>(lookups: &'a L, ctx: &ValidationContext<'a>) -> Checker<'a> {
    Checker {
        index: lookups.index(),
        hints: ctx.hints,
        config: ctx.config,
        labels_known: lookups.node_labels_known(),
    }
}

/// In enforce mode, a refusal for lack of keys (not a dry run) puts an Event on the VMI.
fn record_event(answer: &Answer, vmi: Option<&VmiRef>, dry_run: bool, ctx: &ValidationContext<'_>) {
    let capacity_reason = reason::ends_when_a_key_frees(answer.reason);
    let (Some(vmi), Some(events), Some(message)) = (vmi, ctx.events, answer.message.as_ref())
    else {
        return;
    };
    if dry_run || !capacity_reason {
        return;
    }
    events.record(VmiEvent {
        vmi: vmi_reference(vmi),
        kind: VmiEventKind::InsufficientKeys,
        message: message.clone(),
    });
}

fn log_decision(answer: &Answer, pod: impl std::fmt::Display) {
    match answer.outcome {
        ValidationOutcome::Denied => tracing::info!(
            pod = %pod,
            request = answer.request,
            reason = answer.reason,
            node = answer.node.as_deref(),
            message = answer.message.as_deref(),
            "denied"
        ),
        ValidationOutcome::Warned => tracing::info!(
            pod = %pod,
            request = answer.request,
            reason = answer.reason,
            node = answer.node.as_deref(),
            warnings = ?answer.warnings,
            "allowed with a warning"
        ),
        _ => tracing::debug!(
            pod = %pod,
            request = answer.request,
            reason = answer.reason,
            node = answer.node.as_deref(),
            "admitted"
        ),
    }
}

async fn binding<L: Lookups>(
    review: &mut AdmittedReview<'_>,
    lookups: &L,
    ctx: &ValidationContext<'_>,
) -> Result<Verdict> {
    const REQ: &str = "binding";
    // The chart's matchConditions already narrow calls to these names; anything else is not ours.
    if !review
        .request
        .name
        .starts_with(names::VIRT_LAUNCHER_NAME_PREFIX)
    {
        return Ok(Verdict::Answer(Answer::skip(REQ, "not-virt-launcher")));
    }
    let b = review.binding()?;
    let req = &review.request;
    let Some(node) = b.target.name.as_deref().filter(|n| !n.is_empty()) else {
        return Err(crate::error::Error::BadReview(
            "the Binding has no target.name".into(),
        ));
    };
    let ns = if req.namespace.is_empty() {
        b.metadata.namespace.clone().unwrap_or_default()
    } else {
        req.namespace.clone()
    };
    let uid = b.metadata.uid.clone().unwrap_or_default();
    let pod = match lookups.launcher_pod(&ns, &req.name, &uid).await {
        PodLookup::Found(p) => p,
        PodLookup::NotFound => return Ok(Verdict::Answer(Answer::skip(REQ, "pod-not-found"))),
        PodLookup::Failed(e) => {
            // Fail open, like the binding webhook's failurePolicy Ignore: the scheduler's own
            // accounting still applies.
            let mut a = Answer::skip(REQ, "pod-lookup-failed");
            a.outcome = ValidationOutcome::Warned;
            a.node = Some(node.to_string());
            a.warnings.push(format!(
                "teeguard could not look up pod {ns}/{} to check free TEE keys on node {node} ({e})",
                req.name
            ));
            return Ok(Verdict::Answer(a));
        }
    };
    let vmi_ref = match classify_pod(&pod) {
        Ok(r) => r,
        Err(skip) => return Ok(Verdict::Answer(Answer::skip(REQ, skip.code()))),
    };
    let (ns_labels, warnings) = namespace(lookups, &ns).await;
    if is_exempt(ns_labels.as_ref()) {
        return Ok(Verdict::Answer(Answer::skip(REQ, "exempt-namespace")));
    }
    if let VmiLookup::Found(v) = lookups.vmi(&vmi_ref).await
        && is_exempt(v.metadata.labels.as_ref())
    {
        return Ok(Verdict::Answer(Answer::skip(
            REQ,
            SkipReason::ExemptVmi.code(),
        )));
    }
    let requests = match requests(&pod, ctx.config, REQ) {
        Ok(r) => r,
        Err(answer) => return Ok(Verdict::Answer(*answer)),
    };
    let pod_name = format!("{ns}/{}", req.name);
    let keys = KeyCheck {
        request: REQ,
        pod_uid: pod.metadata.uid.as_deref().unwrap_or(&pod_name),
        pod: &pod_name,
        vmi: Some(&vmi_ref),
        requests: &requests,
        ns_labels: ns_labels.as_ref(),
        target: Target::Node(node, Trigger::Binding),
        dry_run: req.dry_run,
        retried: false,
        warnings,
    };
    Ok(check_keys(keys, lookups, ctx))
}

async fn pod_update<L: Lookups>(review: &mut AdmittedReview<'_>, lookups: &L) -> Result<Answer> {
    const REQ: &str = "pod_update";
    let new = review.pod()?;
    let old = review.old_pod()?;
    let Some(msg) = check_updated_limits(&old, &new) else {
        return Ok(Answer::skip(REQ, "limits-unchanged"));
    };
    let ns = new.metadata.namespace.clone().unwrap_or_default();
    let (ns_labels, _) = namespace(lookups, &ns).await;
    if is_exempt(ns_labels.as_ref()) {
        return Ok(Answer::skip(REQ, "exempt-namespace"));
    }
    tracing::info!(
        pod = %PodName(&new),
        message = msg,
        "pod update denied: cgroup-limit annotation"
    );
    Ok(Answer::deny(
        REQ,
        "none",
        reason::FORGED_LIMIT_ANNOTATION,
        msg,
    ))
}
