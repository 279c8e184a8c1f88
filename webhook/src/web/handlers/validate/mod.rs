//! `POST /validate`: the validating webhook for pod CREATE and UPDATE and the scheduler's
//! `CREATE pods/binding`.
//!
//! Envelope and lookups only; the decisions are the pure functions of [`crate::decide::validation`],
//! [`crate::decide::affinity`] and [`crate::decide::ledger`].
//!
//! - **pods/binding**: only bindings of pods named `virt-launcher-*` are ours; any other is allowed at
//!   once, without an API call. The pod is looked up in the virt-launcher pod cache, else by one GET
//!   (the binding follows the pod's creation within milliseconds, usually before the watch has it). The
//!   target node's report, minus this replica's ledger, must have the keys; check and reservation are
//!   atomic.
//! - **pod CREATE**: first the cgroup-limit annotations (only exactly what the mutating webhook writes
//!   is accepted; denied in every mode). Then, for a virt-launcher pod or a TEE RuntimeClass pod (no
//!   Event) requesting keys as mutated: with `spec.nodeName` the same check and reservation as a
//!   binding (`node`); otherwise a node matching its node selector and required affinity must have the
//!   keys (no reservation: no node is chosen yet; the last fit is looked at first,
//!   [`Ledger::fit_hint`]), less, for a virt-launcher pod, those kept for VMIs that waited longer
//!   ([`retry::ahead_of`]).
//! - **pod UPDATE**: cgroup-limit annotations must not change. Everything else, DELETE, other kinds and
//!   subresources are allowed untouched.
//!
//! Exemptions (`teeguard.dev/exempt: "true"`): a namespace exempts everything; a pod or VMI exempts the
//! capacity check but not the annotation check (a pod's and a VMI's labels are in the user's hands, and
//! teeguard writes no limit annotation on exempt pods anyway). Dry-run requests are decided normally but
//! reserve nothing and record no Event. Denials for lack of keys in enforce mode record an
//! `InsufficientTEEKeys` Event on the VMI (off the hot path, see [`crate::cluster::events`]).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::response::Response;
use jiff::Timestamp;
use k8s_openapi::api::core::v1::PodSpec;
use teeguard_shared::config::Mode;
use teeguard_shared::pod::{KeyRequests, PodName, key_requests};
use teeguard_shared::{Config, names};

use super::{Reviewed, serve_review};
use crate::cluster::caches::{Lookups, PodLookup, WaitingVmis};
use crate::cluster::events::{EventSink, VmiEvent, VmiEventKind, vmi_reference};
use crate::cluster::reservations::SharedReservations;
use crate::decide::affinity::node_matches;
use crate::decide::ledger::{Ledger, ReportMark};
use crate::decide::mutation::{
    MutationDecision, SkipReason, VmiLookup, VmiRef, classify_pod, decide_mutation,
    namespace_exempt, runtime_class::tee_runtime_class,
};
use crate::decide::retry::{self, Promises};
use crate::decide::validation::{
    CandidateScan, Decision, Held, Report, Trigger, apply_mode, check_created_limits,
    check_updated_limits, expected_limits, has_limit_annotations, mode_name, namespace_mode,
    reason,
};
use crate::error::Result;
use crate::metrics::{Metrics, Outcome, ValidationOutcome};
use crate::web::admission::{Operation, ReviewResponse, audit};
use crate::web::admitted::AdmittedReview;
use crate::web::state::AppState;

mod node;

use node::{NodeCheck, check_node};

/// Endpoint name in metrics and logs.
pub const ENDPOINT: &str = crate::metrics::endpoint::VALIDATE;

/// Everything a validating review uses besides the lookups.
#[derive(Clone, Copy, Debug)]
pub struct ValidationContext<'a> {
    /// The configuration.
    pub config: &'a Config,
    /// This replica's admission ledger.
    pub ledger: &'a Ledger,
    /// Where to put Events (`None`: record none, as in the offline `review`).
    pub events: Option<&'a EventSink>,
    /// Metrics (`None` offline).
    pub metrics: Option<&'a Metrics>,
    /// Reservations shared by every replica (`None`: this replica's ledger only, as offline).
    pub shared: Option<&'a SharedReservations>,
    /// Keys promised to retried VMIs (`None` offline).
    pub promises: Option<&'a Promises>,
    /// The VMIs waiting on teeguard, whose turn comes before a newer VMI's (`None` offline, or with
    /// `admission.retryRefusedVmis` off: nothing would then serve them promptly).
    pub waiting: Option<&'a WaitingVmis>,
}

/// The axum handler.
pub async fn handle(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let s = &state;
    serve_review(s, ENDPOINT, req, |body| async move {
        let ctx = ValidationContext {
            config: &s.config,
            ledger: &s.validation.ledger,
            events: s.validation.events.as_ref(),
            metrics: Some(&s.metrics),
            shared: s.validation.shared.as_ref(),
            promises: Some(&s.validation.promises),
            waiting: s
                .config
                .admission
                .retry_refused_vmis
                .then_some(&*s.caches.waiting),
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
pub async fn review_validation<L: Lookups>(
    body: &[u8],
    lookups: &L,
    ctx: &ValidationContext<'_>,
) -> Result<Reviewed> {
    let mut review = AdmittedReview::parse(body)?;
    let req = &review.request;
    let pods = req.resource.group.is_empty() && req.resource.resource == "pods";
    let answer = match (pods, req.sub_resource.as_str(), req.operation) {
        (true, "", Operation::Create) => pod_create(&mut review, lookups, ctx).await?,
        (true, "", Operation::Update) => pod_update(&mut review, lookups).await?,
        (true, "binding", Operation::Create) => binding(&mut review, lookups, ctx).await?,
        (true, "", Operation::Delete) => Answer::skip("other", "pod-delete"),
        _ => Answer::skip("other", "not-validated"),
    };
    if let Some(m) = ctx.metrics {
        m.validation(answer.request, answer.kind, answer.outcome);
    }
    Ok(respond(review.request.uid, answer))
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
) -> Result<Answer> {
    const REQ: &str = "pod_create";
    let mut pod = review.pod()?;
    let req = &review.request;
    if pod.metadata.name.as_deref().is_none_or(str::is_empty) && !req.name.is_empty() {
        pod.metadata.name = Some(req.name.clone());
    }
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let (ns_labels, mut warnings) = namespace(lookups, &ns).await;
    if namespace_exempt(ns_labels.as_ref()) {
        return Ok(Answer::skip(REQ, "exempt-namespace"));
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
        return Ok(Answer::deny(
            REQ,
            kind,
            reason::FORGED_LIMIT_ANNOTATION,
            msg,
        ));
    }

    let vmi_ref = match class {
        Ok(r) => Some(r),
        Err(SkipReason::NotKubeVirt) if tee_runtime_class(&pod, config).is_some() => None, // no VMI
        Err(skip) => return Ok(Answer::skip(REQ, skip.code())),
    };
    if matches!(mutation, MutationDecision::Skip(SkipReason::ExemptVmi)) {
        return Ok(Answer::skip(REQ, SkipReason::ExemptVmi.code()));
    }
    let requests = match key_requests(&pod, &config.resources) {
        Ok(r) => r,
        Err(e) => {
            return Ok(Answer::deny(REQ, "none", "bad-quantity", e.to_string()));
        }
    };
    if requests.is_empty() {
        return Ok(Answer::skip(REQ, "no-key-request"));
    }
    let kind = primary_kind(&requests);
    let (mode, mode_warning) = namespace_mode(config.admission.mode, ns_labels.as_ref());
    warnings.extend(mode_warning);
    // Formatted only when needed: a reservation (spec.nodeName), a pod without a uid, a log line.
    let pod_name = PodName(&pod);
    let uid: Cow<'_, str> = match pod.metadata.uid.as_deref() {
        Some(uid) => Cow::Borrowed(uid),
        None => Cow::Owned(pod_name.to_string()),
    };
    let policy = Trigger::PodCreate.stale_policy(&config.admission);
    let no_spec = PodSpec::default();
    let spec = pod.spec.as_ref().unwrap_or(&no_spec);

    let answer = match spec.node_name.as_deref().filter(|n| !n.is_empty()) {
        Some(node) => {
            let d = check_node(
                Trigger::PodCreate,
                node,
                &requests,
                NodeCheck {
                    uid: &uid,
                    pod: &pod_name.to_string(),
                    mode,
                    policy,
                    dry_run: req.dry_run,
                },
                lookups,
                ctx,
            )
            .await;
            Answer::from_decision(REQ, kind, d, Some(node.to_string()), mode)
        }
        None => {
            let now = Timestamp::now();
            let mono = Instant::now();
            let filter =
                |name: &str, labels: &BTreeMap<String, String>| node_matches(spec, name, labels);
            // Stops at the first node that fits; otherwise keeps counts and the few nodes a refusal
            // lists. Nothing is allocated per node (the ledger only for nodes holding reservations).
            let mut scan = CandidateScan::new(&requests);
            // The node that fitted last time is looked at first; the one that fits now is remembered.
            let primary = requests.keys().next().copied();
            let hint = primary.and_then(|k| ctx.ledger.fit_hint(k));
            let mut fitted = None;
            let mut fit_node = None;
            // A launcher pod waits its turn behind the VMIs of its kind that waited longer.
            let waiting = match (ctx.waiting, &vmi_ref) {
                (Some(w), Some(_)) => w.snapshot(),
                _ => Vec::new(),
            };
            let ahead = match (&vmi_ref, primary) {
                (Some(v), Some(kind)) => retry::ahead_of(&waiting, kind, &v.uid, |uid| {
                    ctx.promises.is_some_and(|p| p.is_promised(uid, mono))
                }),
                _ => Vec::new(),
            };
            let mut queued = KeyRequests::new();
            lookups.scan_nodes(&filter, hint.as_deref(), &mut |node, labels| {
                let cap = lookups.tee_capacity(node);
                let report = Report {
                    status: cap.as_ref().and_then(|c| c.status.as_ref()),
                    lease_renewed: lookups.agent_lease(node),
                };
                let m = ReportMark::of(cap.as_deref());
                let mut held = ctx.ledger.held(node, m, mono, &uid);
                let vmi = vmi_ref.as_ref().map_or("", |v| v.uid.as_str());
                Promises::add_held(ctx.promises, &mut held, node, m.counted_pods, vmi, mono);
                if let (Some(kind), false) = (primary, ahead.is_empty()) {
                    queued.insert(kind, retry::queued_on(&ahead, node, labels));
                }
                let held = Held {
                    reserved: &held,
                    queued: &queued,
                };
                let flow = scan.offer(node, report, held, now, config.admission.stale_report_after);
                if flow.is_break() {
                    if hint.as_deref() != Some(node) {
                        fitted = Some(node.to_string());
                    }
                    fit_node = Some(node.to_string());
                }
                flow
            });
            if let (Some(kind), Some(node)) = (primary, fitted) {
                ctx.ledger.remember_fit(kind, &node);
            }
            let d = apply_mode(scan.verdict(policy), mode);
            let answer = Answer::from_decision(REQ, kind, d, None, mode);
            // Admitted: the key is promised to its VMI until the binding (`admitted` below: this pod).
            let admitted = answer.message.is_none() && !req.dry_run;
            if let (Some(p), Some(v), Some(node), Some(kind), true) =
                (ctx.promises, &vmi_ref, &fit_node, primary, admitted)
            {
                p.promise(node, kind, &v.uid, mono);
            }
            answer
        }
    };
    if let (Some(p), Some(v), None) = (ctx.promises, &vmi_ref, &answer.message) {
        p.admitted(&v.uid, &uid);
    }
    let mut answer = answer;
    // The retry task starts the VM when a key frees (crate::cluster::retry), unless it was bound.
    let unbound = spec.node_name.as_deref().is_none_or(str::is_empty);
    if vmi_ref.is_some() && unbound && config.admission.retry_refused_vmis {
        retry::note_refusal(answer.reason, answer.message.as_mut());
    }
    // Where this VMI's pods may go, exactly, for the retry task and the queue.
    let refused_for_keys = answer.message.is_some() && reason::ends_when_a_key_frees(answer.reason);
    if let (Some(w), Some(v)) = (ctx.waiting, &vmi_ref)
        && unbound
        && refused_for_keys
        && !req.dry_run
    {
        w.refused(v, spec);
    }
    record_event(&answer, vmi_ref.as_ref(), req.dry_run, ctx);
    log_decision(&answer, pod_name);
    Ok(answer.with_warnings(warnings))
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
) -> Result<Answer> {
    const REQ: &str = "binding";
    // The chart's matchConditions already narrow calls to these names; anything else is not ours.
    if !review
        .request
        .name
        .starts_with(names::VIRT_LAUNCHER_NAME_PREFIX)
    {
        return Ok(Answer::skip(REQ, "not-virt-launcher"));
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
        PodLookup::NotFound => return Ok(Answer::skip(REQ, "pod-not-found")),
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
            return Ok(a);
        }
    };
    let vmi_ref = match classify_pod(&pod) {
        Ok(r) => r,
        Err(skip) => return Ok(Answer::skip(REQ, skip.code())),
    };
    let (ns_labels, mut warnings) = namespace(lookups, &ns).await;
    if namespace_exempt(ns_labels.as_ref()) {
        return Ok(Answer::skip(REQ, "exempt-namespace"));
    }
    if let VmiLookup::Found(v) = lookups.vmi(&vmi_ref).await
        && namespace_exempt(v.metadata.labels.as_ref())
    {
        return Ok(Answer::skip(REQ, SkipReason::ExemptVmi.code()));
    }
    let config = ctx.config;
    let requests = match key_requests(&pod, &config.resources) {
        Ok(r) => r,
        Err(e) => return Ok(Answer::deny(REQ, "none", "bad-quantity", e.to_string())),
    };
    if requests.is_empty() {
        return Ok(Answer::skip(REQ, "no-key-request"));
    }
    let (mode, mode_warning) = namespace_mode(config.admission.mode, ns_labels.as_ref());
    warnings.extend(mode_warning);
    let pod_name = format!("{ns}/{}", req.name);
    let uid = pod.metadata.uid.clone().unwrap_or_else(|| pod_name.clone());
    let d = check_node(
        Trigger::Binding,
        node,
        &requests,
        NodeCheck {
            uid: &uid,
            pod: &pod_name,
            mode,
            policy: Trigger::Binding.stale_policy(&config.admission),
            dry_run: req.dry_run,
        },
        lookups,
        ctx,
    )
    .await;
    let answer = Answer::from_decision(
        REQ,
        primary_kind(&requests),
        d,
        Some(node.to_string()),
        mode,
    );
    // The ledger holds the key from now on: the promise made at the pod's CREATE ends.
    if let (Some(p), false) = (ctx.promises, req.dry_run) {
        p.pod_ended(&uid);
    }
    record_event(&answer, Some(&vmi_ref), req.dry_run, ctx);
    log_decision(&answer, &pod_name);
    Ok(answer.with_warnings(warnings))
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
    if namespace_exempt(ns_labels.as_ref()) {
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
