//! Playing the rest of the cluster around the webhook and the agent: kube-apiserver (admission calls,
//! storing objects), KubeVirt's virt-controller (a VMI's virt-launcher pod), kube-scheduler (choosing a
//! node and binding) and the kubelet (starting a pod's VM on a simulated host).
//!
//! Nothing here decides what teeguard decides: every admission decision comes from the webhook over
//! HTTPS and every key figure from the agent's published `TeeCapacity`.
//!
//! # The API server's order of work, and where the fake differs
//! For a pod CREATE kube-apiserver runs mutating webhooks on the object as sent (a `generateName` pod has
//! no name), applies their patches, assigns the name and UID, runs validating webhooks on the result and
//! only then persists it. The fake API server assigns the name and UID when the object is stored, so
//! [`ApiServerDriver::create_pod`] stores the mutated pod first, sends the stored object (with its real
//! name and UID) to `/validate`, and deletes it again if validation refuses it. The pod is not bound to a
//! node during that window, so the node agents never see it.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use serde_json::{Value, json};
use teeguard_shared::TeeKind;
use teeguard_shared::config::ResourcesConfig;
use teeguard_shared::crd::{KindStatus, TeeCapacityStatus};
use teeguard_shared::pod::{key_requests, parse_whole_quantity};

use super::client::{ReviewReply, WebhookClient};
use crate::fakeapi::FakeApiServer;
use crate::fixtures::{self, AdmissionReviewBuilder, Tee, VirtLauncherPod, Vmi};
use crate::host::{QosClass, SimHost};
use crate::{Error, Result};

/// `POST` path of the mutating webhook.
pub const MUTATE: &str = "/mutate";
/// `POST` path of the validating webhook.
pub const VALIDATE: &str = "/validate";

/// A VMI to create: name, namespace, TEE kind and extra labels (KubeVirt copies VMI labels onto the
/// virt-launcher pod).
#[derive(Clone, Debug)]
pub struct VmiSpec {
    /// Name.
    pub name: String,
    /// Namespace.
    pub namespace: String,
    /// TEE kind.
    pub tee: Tee,
    /// Extra labels (e.g. `teeguard.dev/exempt: "true"`).
    pub labels: Vec<(String, String)>,
}

impl VmiSpec {
    /// A VMI in the `default` namespace.
    pub fn new(name: &str, tee: Tee) -> Self {
        VmiSpec {
            name: name.to_string(),
            namespace: fixtures::DEFAULT_NAMESPACE.to_string(),
            tee,
            labels: Vec::new(),
        }
    }

    /// In another namespace.
    pub fn namespace(mut self, namespace: &str) -> Self {
        self.namespace = namespace.to_string();
        self
    }

    /// With an extra label.
    pub fn label(mut self, key: &str, value: &str) -> Self {
        self.labels.push((key.to_string(), value.to_string()));
        self
    }

    /// Labelled exempt from teeguard.
    pub fn exempt(self) -> Self {
        self.label(fixtures::EXEMPT_LABEL, "true")
    }

    /// The misc cgroup resource its VM is charged (`tdx`, `sev`, `sev_es`), if any.
    pub fn misc_name(&self) -> Option<&'static str> {
        self.tee.misc_names().first().copied()
    }
}

/// A VMI stored in the fake API server.
#[derive(Clone, Debug)]
pub struct CreatedVmi {
    /// What was asked for.
    pub spec: VmiSpec,
    /// The UID the API server assigned.
    pub uid: String,
}

impl CreatedVmi {
    /// `namespace/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.spec.namespace, self.spec.name)
    }
}

/// What happened to a pod CREATE.
#[derive(Clone, Debug)]
pub struct PodAdmission {
    /// The `/mutate` answer.
    pub mutate: ReviewReply,
    /// The `/validate` answer (absent when `/mutate` refused the pod).
    pub validate: Option<ReviewReply>,
    /// The pod as persisted (name and UID assigned), when both webhooks admitted it.
    pub pod: Option<Pod>,
    /// The pod as mutated, whether or not it was persisted.
    pub mutated: Value,
}

impl PodAdmission {
    /// True when the pod was persisted.
    pub fn admitted(&self) -> bool {
        self.pod.is_some()
    }

    /// The persisted pod of a VM `/mutate` patched (its key request) and both webhooks admitted;
    /// panics, naming `vm` and quoting the answers, otherwise (for tests).
    pub fn expect_patched_pod(self, vm: &str) -> Pod {
        assert_eq!(
            self.mutate.decision(),
            crate::standalone::Decision::Patched,
            "{vm}: {:?}",
            self.mutate.raw
        );
        self.pod
            .unwrap_or_else(|| panic!("{vm} admitted at CREATE: {:?}", self.validate))
    }

    /// The refusal message, if refused.
    pub fn refusal(&self) -> Option<String> {
        if !self.mutate.allowed {
            return Some(self.mutate.explanation());
        }
        self.validate
            .as_ref()
            .filter(|v| !v.allowed)
            .map(ReviewReply::explanation)
    }
}

/// What happened to a binding.
#[derive(Clone, Debug)]
pub struct BindOutcome {
    /// The `/validate` answer to the `pods/binding` review.
    pub reply: ReviewReply,
    /// The node asked for.
    pub node: String,
    /// True when the pod was bound.
    pub bound: bool,
}

/// A binding `/validate` admitted: the webhook holds its keys (a hold) until the node's report
/// counts the pod (lists its UID in `countedPods`), or until `admission.ledgerTtl`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    /// The node.
    pub node: String,
    /// `namespace/name` of the pod.
    pub pod: String,
    /// The pod's UID (as the webhook keys the reservation).
    pub uid: String,
    /// When the admission was answered (no earlier than the webhook's own admission time).
    pub at: std::time::Instant,
}

/// Plays kube-apiserver, virt-controller and kube-scheduler against one webhook and one fake API
/// server.
#[derive(Debug)]
pub struct ApiServerDriver {
    api: FakeApiServer,
    webhook: WebhookClient,
    resources: ResourcesConfig,
    ledger_ttl: Duration,
    watch_grace: Duration,
    admissions: std::sync::Mutex<Vec<Admission>>,
}

/// Default time allowed for a stored object to reach the webhook's watch caches (see
/// [`ApiServerDriver::with_watch_grace`]).
pub const DEFAULT_WATCH_GRACE: Duration = Duration::from_millis(150);

impl ApiServerDriver {
    /// A driver storing objects in `api` and sending reviews through `webhook`. `resources` names the
    /// extended resources (for reading reports).
    pub fn new(api: FakeApiServer, webhook: WebhookClient, resources: ResourcesConfig) -> Self {
        ApiServerDriver {
            api,
            webhook,
            resources,
            ledger_ttl: teeguard_shared::config::AdmissionConfig::default().ledger_ttl,
            watch_grace: DEFAULT_WATCH_GRACE,
            admissions: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Time allowed for a stored object (a new report) to reach the webhook's watch caches before
    /// [`ApiServerDriver::settle`] returns. The webhook exposes no cache version to wait on; watch
    /// delivery on one machine takes milliseconds, so the default is [`DEFAULT_WATCH_GRACE`].
    pub fn with_watch_grace(mut self, grace: Duration) -> Self {
        self.watch_grace = grace;
        self
    }

    /// Use the webhook's configured `admission.ledgerTtl` (default 30 s) when tracking admissions.
    pub fn with_ledger_ttl(mut self, ttl: Duration) -> Self {
        self.ledger_ttl = ttl;
        self
    }

    /// The fake API server.
    pub fn api(&self) -> &FakeApiServer {
        &self.api
    }

    /// The webhook client.
    pub fn webhook(&self) -> &WebhookClient {
        &self.webhook
    }

    /// Send one AdmissionReview to `path` (like kube-apiserver calling a webhook).
    pub async fn review(&self, path: &str, review: &Value) -> Result<ReviewReply> {
        self.webhook.review(path, review).await
    }

    /// The `/validate` review of the scheduler's binding of `pod` to `node`, without binding it.
    pub async fn review_binding(&self, pod: &Pod, node: &str) -> Result<ReviewReply> {
        let review = AdmissionReviewBuilder::binding(pod, node).build();
        self.review("/validate", &review).await
    }

    /// The reviews kube-apiserver sends for a CREATE of `pod`, without storing it: `/mutate` (which
    /// must patch it), then `/validate` of the patched pod under `name` and `uid`; the validating answer.
    pub async fn review_create(&self, pod: &Pod, name: &str, uid: &str) -> Result<ReviewReply> {
        let mut created = fixtures::to_value(pod);
        let review = AdmissionReviewBuilder::create(created.clone()).build();
        let m = self.review("/mutate", &review).await?;
        let patch = m.patch.as_ref().ok_or_else(|| {
            Error::failed(
                format!("/mutate of {name}"),
                format!("not patched: {:?}", m.raw),
            )
        })?;
        json_patch::patch(&mut created, patch).map_err(|e| Error::Patch {
            pod: name.to_string(),
            reason: e.to_string(),
        })?;
        created["metadata"]["name"] = json!(name);
        created["metadata"]["uid"] = json!(uid);
        let review = AdmissionReviewBuilder::create(created).build();
        self.review("/validate", &review).await
    }

    /// Store a VMI like `kubectl create` would (phase `Scheduling`, no node yet).
    pub fn create_vmi(&self, spec: &VmiSpec) -> Result<CreatedVmi> {
        let mut b = Vmi::new(&spec.name)
            .namespace(&spec.namespace)
            .tee(spec.tee)
            .scheduling();
        for (k, v) in &spec.labels {
            b = b.label(k, v);
        }
        let mut value = b.build();
        strip_server_fields(&mut value);
        let stored = self.api.create(&value)?;
        let uid = stored
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::Failed {
                what: format!("VMI {}/{}", spec.namespace, spec.name),
                reason: "stored without a UID".into(),
            })?
            .to_string();
        Ok(CreatedVmi {
            spec: spec.clone(),
            uid,
        })
    }

    /// Delete a VMI (its pods are not garbage-collected by the fake server: delete them separately).
    pub fn delete_vmi(&self, vmi: &CreatedVmi) -> Result<()> {
        self.api.delete(
            "virtualmachineinstances",
            Some(&vmi.spec.namespace),
            &vmi.spec.name,
        )?;
        Ok(())
    }

    /// The virt-launcher pod virt-controller renders for `vmi`, owned by its real UID, at mutating
    /// admission (only a `generateName`).
    pub fn launcher_pod(&self, vmi: &CreatedVmi) -> Result<Pod> {
        let mut b =
            VirtLauncherPod::for_tee(&vmi.spec.name, vmi.spec.tee).namespace(&vmi.spec.namespace);
        for (k, v) in &vmi.spec.labels {
            b = b.label(k, v);
        }
        let mut value = b.to_value();
        own_by(&mut value, &vmi.uid);
        typed_pod(value)
    }

    /// virt-controller's CREATE of `vmi`'s virt-launcher pod ([`Driver::launcher_pod`], then
    /// [`Driver::create_pod`]); again after a refusal, as virt-controller retries.
    pub async fn create_launcher_pod(&self, vmi: &CreatedVmi) -> Result<PodAdmission> {
        self.create_pod(&self.launcher_pod(vmi)?).await
    }

    /// A VM as `kubectl create` and virt-controller make it: the VMI stored, then its launcher pod's
    /// CREATE reviewed ([`Driver::create_launcher_pod`]).
    pub async fn create_vm(&self, spec: &VmiSpec) -> Result<(CreatedVmi, PodAdmission)> {
        let vmi = self.create_vmi(spec)?;
        let adm = self.create_launcher_pod(&vmi).await?;
        Ok((vmi, adm))
    }

    /// A pod CREATE as kube-apiserver runs it: `/mutate` on the pod as sent, the patch applied, the
    /// pod persisted (name and UID assigned), `/validate` on the persisted pod, and the pod deleted
    /// again when `/validate` refuses it. See the module documentation for the order.
    pub async fn create_pod(&self, pod: &Pod) -> Result<PodAdmission> {
        let mut value = serde_json::to_value(pod).map_err(|e| Error::Failed {
            what: "pod".into(),
            reason: e.to_string(),
        })?;
        let display = teeguard_shared::pod::pod_display_name(pod);
        let review = AdmissionReviewBuilder::create(value.clone()).build();
        let mutate = self.webhook.review(MUTATE, &review).await?;
        if !mutate.allowed {
            return Ok(PodAdmission {
                mutate,
                validate: None,
                pod: None,
                mutated: value,
            });
        }
        if let Some(patch) = &mutate.patch {
            json_patch::patch(&mut value, patch).map_err(|e| Error::Patch {
                pod: display.clone(),
                reason: e.to_string(),
            })?;
        }
        let stored = self.api.create(&value)?;
        let (ns, name) = name_of(&stored)?;
        let review = AdmissionReviewBuilder::create(stored.clone()).build();
        let validate = match self.webhook.review(VALIDATE, &review).await {
            Ok(v) => v,
            Err(e) => {
                // An error is a refusal (failurePolicy: Fail): the pod is not kept.
                let _ = self.api.delete("pods", Some(&ns), &name);
                return Err(e);
            }
        };
        if !validate.allowed {
            self.api.delete("pods", Some(&ns), &name)?;
            return Ok(PodAdmission {
                mutate,
                validate: Some(validate),
                pod: None,
                mutated: value,
            });
        }
        let pod = typed_pod(stored)?;
        Ok(PodAdmission {
            mutate,
            validate: Some(validate),
            pod: Some(pod),
            mutated: value,
        })
    }

    /// The scheduler's bind of a stored pod to `node`: the `pods/binding` review to `/validate`, then
    /// the binding when allowed, or a `FailedScheduling` event on the pod carrying the webhook's
    /// message when refused (the scheduler then retries with backoff).
    pub async fn bind(&self, namespace: &str, name: &str, node: &str) -> Result<BindOutcome> {
        let pod = self
            .api
            .get_typed::<Pod>(Some(namespace), name)?
            .ok_or_else(|| Error::Failed {
                what: format!("pod {namespace}/{name}"),
                reason: "not found; create it first".into(),
            })?;
        let review = AdmissionReviewBuilder::binding(&pod, node).build();
        let reply = self.webhook.review(VALIDATE, &review).await?;
        if reply.allowed {
            self.note_admission(node, &format!("{namespace}/{name}"));
            self.api.bind_pod(namespace, name, node)?;
        } else {
            self.record_failed_scheduling(&pod, &reply.explanation())?;
        }
        Ok(BindOutcome {
            reply,
            node: node.to_string(),
            bound: is_bound(&self.api, namespace, name, node),
        })
    }

    fn lock_admissions(&self) -> std::sync::MutexGuard<'_, Vec<Admission>> {
        self.admissions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Remember that the webhook admitted a pod onto `node` now (done by [`ApiServerDriver::bind`]; call
    /// it for admissions made with [`ApiServerDriver::review`] directly). `pod` is `namespace/name` of a
    /// stored pod, whose UID the webhook keys its reservation by.
    pub fn note_admission(&self, node: &str, pod: &str) {
        let (ns, name) = pod.split_once('/').unwrap_or(("", pod));
        let uid = self
            .api
            .get("pods", Some(ns), name)
            .and_then(|p| {
                p.pointer("/metadata/uid")
                    .and_then(Value::as_str)
                    .map(str::to_string)
            })
            .unwrap_or_else(|| pod.to_string());
        self.lock_admissions().push(Admission {
            node: node.to_string(),
            pod: pod.to_string(),
            uid,
            at: std::time::Instant::now(),
        });
    }

    /// Admissions onto `node` the webhook may still hold keys for: the node's report does not
    /// list the pod in `countedPods` yet, and `ledgerTtl` has not passed.
    pub fn outstanding_admissions(&self, node: &str) -> Vec<Admission> {
        let counted = self
            .report(node)
            .map(|s| s.counted_pods)
            .unwrap_or_default();
        let mut all = self.lock_admissions();
        all.retain(|a| {
            let caught_up = a.node == node && counted.contains(&a.uid);
            !caught_up && a.at.elapsed() < self.ledger_ttl
        });
        all.iter().filter(|a| a.node == node).cloned().collect()
    }

    /// Wait until the webhook holds nothing for `node` (see
    /// [`ApiServerDriver::outstanding_admissions`]); the agent's first report after it sees the binding
    /// ends the reservation, so this takes about one agent poll after the last admission.
    pub async fn wait_admissions_settled(&self, node: &str, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let left = self.outstanding_admissions(node);
            if left.is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::Timeout {
                    log: None,
                    what: format!(
                        "node {node}'s report to catch up with {} admitted pod(s) ({})",
                        left.len(),
                        left.iter()
                            .map(|a| a.pod.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    after: timeout,
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn record_failed_scheduling(&self, pod: &Pod, message: &str) -> Result<()> {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let now = jiff::Timestamp::now().to_string();
        let event = json!({
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": format!("{name}."), "namespace": ns},
            "involvedObject": {
                "apiVersion": "v1", "kind": "Pod", "name": name, "namespace": ns,
                "uid": pod.metadata.uid.clone().unwrap_or_default()
            },
            "reason": "FailedScheduling",
            "message": format!("running PreBind plugin: admission webhook denied the request: {message}"),
            "type": "Warning",
            "source": {"component": "default-scheduler"},
            "reportingComponent": "default-scheduler",
            "firstTimestamp": now, "lastTimestamp": now, "count": 1
        });
        self.api.create(&event)?;
        Ok(())
    }

    /// kube-scheduler's filter for `pod`: nodes whose labels match its `nodeSelector` and whose
    /// allocatable extended resources (names with a `/`) cover its requests on top of what the pods
    /// already bound there request. Returns the fitting node with the most of the pod's TEE resource
    /// left, or the scheduler's "0/N nodes are available" message.
    pub fn schedule(&self, pod: &Pod) -> std::result::Result<String, String> {
        let nodes: Vec<Node> = self.api.list_typed::<Node>(None).unwrap_or_default();
        let pods: Vec<Pod> = self.api.list_typed::<Pod>(None).unwrap_or_default();
        let wanted = extended_requests(pod);
        let selector = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_selector.clone())
            .unwrap_or_default();
        let mut best: Option<(u64, String)> = None;
        let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
        for node in &nodes {
            let name = node.metadata.name.clone().unwrap_or_default();
            let labels = node.metadata.labels.clone().unwrap_or_default();
            if selector.iter().any(|(k, v)| labels.get(k) != Some(v)) {
                *reasons
                    .entry("node(s) didn't match Pod's node affinity/selector".into())
                    .or_default() += 1;
                continue;
            }
            let allocatable = node
                .status
                .as_ref()
                .and_then(|s| s.allocatable.clone())
                .unwrap_or_default();
            let mut used: BTreeMap<String, u64> = BTreeMap::new();
            for p in pods.iter().filter(|p| bound_to(p, &name) && !terminated(p)) {
                for (r, n) in extended_requests(p) {
                    *used.entry(r).or_default() += n;
                }
            }
            let mut fits = true;
            let mut tee_left = 0;
            for (resource, n) in &wanted {
                let have = allocatable
                    .get(resource)
                    .and_then(|q| parse_whole_quantity(&q.0))
                    .unwrap_or(0);
                let left = have.saturating_sub(used.get(resource).copied().unwrap_or(0));
                if left < *n {
                    fits = false;
                    *reasons
                        .entry(format!("Insufficient {resource}"))
                        .or_default() += 1;
                    break;
                }
                if self.resources.kind_of_resource(resource).is_some() {
                    tee_left = tee_left.max(left - n);
                }
            }
            if fits && best.as_ref().is_none_or(|(l, _)| tee_left > *l) {
                best = Some((tee_left, name));
            }
        }
        match best {
            Some((_, node)) => Ok(node),
            None => {
                let why: Vec<String> = reasons.iter().map(|(r, n)| format!("{n} {r}")).collect();
                Err(format!(
                    "0/{} nodes are available: {}.",
                    nodes.len(),
                    why.join(", ")
                ))
            }
        }
    }

    /// The `TeeCapacity` status of `node`, if published.
    pub fn report(&self, node: &str) -> Option<TeeCapacityStatus> {
        self.api.tee_capacity_status(node)
    }

    /// When `node`'s report was last confirmed current: the newer of its `heartbeatTime` and its
    /// agent's heartbeat Lease renewal (Leases in the client namespace, `default`), as the webhook sees it.
    pub fn last_heartbeat(&self, node: &str) -> Option<jiff::Timestamp> {
        let report = self
            .report(node)
            .and_then(|s| s.heartbeat_time)
            .map(|t| t.0);
        let lease = self
            .api
            .get_typed::<k8s_openapi::api::coordination::v1::Lease>(Some("default"), node)
            .ok()
            .flatten()
            .and_then(|l| l.spec?.renew_time)
            .map(|t| t.0);
        report.max(lease)
    }

    /// The figures of one kind in `node`'s report.
    pub fn kind_report(&self, node: &str, kind: TeeKind) -> Option<KindStatus> {
        self.report(node).and_then(|s| s.kind(kind).cloned())
    }

    /// Keys of `kind` requested by the pods bound to `node` that have not terminated.
    pub fn bound_requests(&self, node: &str, kind: TeeKind) -> u64 {
        self.api
            .list_typed::<Pod>(None)
            .unwrap_or_default()
            .iter()
            .filter(|p| bound_to(p, node) && !terminated(p))
            .filter_map(|p| key_requests(p, &self.resources).ok())
            .filter_map(|r| r.get(&kind).copied())
            .sum()
    }

    /// The figures `node`'s agent should publish for `kind`, computed the agent's way from the host's
    /// cgroup files and the pods bound to the node: `(kernelUsed, podsUsed, pending)`.
    ///
    /// Per-pod accounting (pod cgroups carry misc files): a pod holds `min(its cgroup's usage,
    /// request)` and the rest of its request is pending. Without it: Running pods hold their requests
    /// up to the kernel's usage, Pending pods are pending.
    pub fn expected_figures(&self, node: &str, kind: TeeKind, host: &SimHost) -> (u64, u64, u64) {
        let res = kind.kernel_name();
        let kernel = host.usage(res);
        let (mut held, mut pending, mut running) = (0u64, 0u64, 0u64);
        for p in self.api.list_typed::<Pod>(None).unwrap_or_default() {
            if !bound_to(&p, node) || terminated(&p) {
                continue;
            }
            let want = key_requests(&p, &self.resources)
                .ok()
                .and_then(|r| r.get(&kind).copied())
                .unwrap_or(0);
            if want == 0 {
                continue;
            }
            let uid = p.metadata.uid.clone().unwrap_or_default();
            let per_pod = host
                .pod_cgroup_rel(&uid)
                .and_then(|rel| host.misc_enabled(&rel))
                .unwrap_or(
                    host.misc_enabled(&host.pod_cgroup_rel_for(&uid, QosClass::Burstable))
                        .unwrap_or(true),
                );
            if per_pod {
                let h = host.pod_usage(&uid, res).min(want);
                held += h;
                pending += want - h;
            } else if p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running") {
                running += want;
            } else {
                pending += want;
            }
        }
        (kernel, (held + running).min(kernel), pending)
    }

    /// Wait until `node`'s report shows exactly [`ApiServerDriver::expected_figures`] for `kind` (the
    /// agent has seen the host's last change and the pods' last binding). Returns the figures.
    pub async fn wait_report_settled(
        &self,
        node: &str,
        kind: TeeKind,
        host: &SimHost,
        timeout: Duration,
    ) -> Result<KindStatus> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let (kernel, pods, pending) = self.expected_figures(node, kind, host);
            let got = self.kind_report(node, kind);
            if let Some(s) = &got
                && (s.kernel_used, s.pods_used, s.pending) == (kernel, pods, pending)
            {
                return Ok(s.clone());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::Timeout {
                    log: None,
                    what: format!(
                        "node {node}'s TeeCapacity to show {kind} kernelUsed={kernel} podsUsed={pods} \
                         pending={pending} (last: {got:?})"
                    ),
                    after: timeout,
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Wait until the next review sees the current state: `node`'s report shows what the host and the
    /// bound pods imply ([`ApiServerDriver::wait_report_settled`]); when pods admitted recently could
    /// still be held by the webhook and that could decide the next review (a key is free, but
    /// no more than are held), until the reports count those pods; then the
    /// watch grace. Returns the report's figures.
    pub async fn settle(
        &self,
        node: &str,
        kind: TeeKind,
        host: &SimHost,
        timeout: Duration,
    ) -> Result<KindStatus> {
        let mut s = self.wait_report_settled(node, kind, host, timeout).await?;
        let held = self.outstanding_admissions(node).len() as u64;
        if s.free > 0 && s.free <= held {
            self.wait_admissions_settled(node, timeout).await?;
            if let Some(now) = self.kind_report(node, kind) {
                s = now;
            }
        }
        tokio::time::sleep(self.watch_grace).await;
        Ok(s)
    }

    /// Events about an object (any reason), oldest first.
    pub fn events_for(&self, namespace: &str, kind: &str, name: &str) -> Vec<Value> {
        self.api
            .list("events", Some(namespace))
            .into_iter()
            .filter(|e| {
                e.pointer("/involvedObject/kind").and_then(Value::as_str) == Some(kind)
                    && e.pointer("/involvedObject/name").and_then(Value::as_str) == Some(name)
            })
            .collect()
    }

    /// Wait for an event with `reason` about an object; returns it.
    pub async fn wait_event(
        &self,
        namespace: &str,
        kind: &str,
        name: &str,
        reason: &str,
        timeout: Duration,
    ) -> Result<Value> {
        let what = format!("a {reason} event on {kind} {namespace}/{name}");
        self.api
            .wait_for(timeout, &what, |_| {
                self.events_for(namespace, kind, name)
                    .into_iter()
                    .find(|e| e.get("reason").and_then(Value::as_str) == Some(reason))
            })
            .await
    }
}

fn is_bound(api: &FakeApiServer, ns: &str, name: &str, node: &str) -> bool {
    api.get("pods", Some(ns), name)
        .and_then(|p| {
            p.pointer("/spec/nodeName")
                .and_then(Value::as_str)
                .map(|n| n == node)
        })
        .unwrap_or(false)
}

/// Plays the kubelet of one node whose host is a [`SimHost`]: creates pod cgroups, starts and stops
/// the TEE VM in them, reports phases.
#[derive(Debug)]
pub struct SimKubelet<'a> {
    /// The node's name.
    pub node: String,
    /// Its host.
    pub host: &'a SimHost,
    /// The API server.
    pub api: &'a FakeApiServer,
}

impl SimKubelet<'_> {
    /// Start a bound pod: create its cgroups (containers `containers`), charge one key of `resource`
    /// (a kernel name such as `tdx`) in `charge_in` (the container whose process creates the VM:
    /// `compute` for KubeVirt, [`crate::host::SANDBOX`] for Kata), and report it Running.
    ///
    /// If the kernel refuses the charge (the host is full) the VM does not start: the pod is reported
    /// Failed and the error returned.
    pub fn start(
        &self,
        pod: &Pod,
        containers: &[&str],
        charge_in: &str,
        resource: Option<&str>,
    ) -> Result<()> {
        let (ns, name) = pod_key(pod)?;
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        self.host.add_pod(&uid, QosClass::Burstable, containers)?;
        if let Some(r) = resource
            && let Err(e) = self.host.start_vm(&uid, charge_in, r)
        {
            self.api.set_pod_phase(&ns, &name, "Failed")?;
            self.host.remove_pod(&uid)?;
            return Err(e);
        }
        self.api.set_pod_phase(&ns, &name, "Running")?;
        Ok(())
    }

    /// Stop a pod: its VM exits (the keys are released with its cgroup), the pod is deleted.
    pub fn stop(&self, pod: &Pod) -> Result<()> {
        let (ns, name) = pod_key(pod)?;
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        if self.host.pod_cgroup_rel(&uid).is_some() {
            self.host.remove_pod(&uid)?;
        }
        self.api.delete("pods", Some(&ns), &name)?;
        Ok(())
    }
}

fn pod_key(pod: &Pod) -> Result<(String, String)> {
    match (&pod.metadata.namespace, &pod.metadata.name) {
        (Some(ns), Some(n)) => Ok((ns.clone(), n.clone())),
        _ => Err(Error::Failed {
            what: teeguard_shared::pod::pod_display_name(pod),
            reason: "pod has no name or namespace yet (store it first)".into(),
        }),
    }
}

fn name_of(v: &Value) -> Result<(String, String)> {
    let get = |p: &str| v.pointer(p).and_then(Value::as_str).map(str::to_string);
    match (get("/metadata/namespace"), get("/metadata/name")) {
        (Some(ns), Some(n)) => Ok((ns, n)),
        _ => Err(Error::Failed {
            what: "stored object".into(),
            reason: "no namespace/name".into(),
        }),
    }
}

fn typed_pod(v: Value) -> Result<Pod> {
    serde_json::from_value(v).map_err(|e| Error::Failed {
        what: "stored pod".into(),
        reason: e.to_string(),
    })
}

/// Remove what only the API server sets (UID, resourceVersion, timestamps) so a fixture can be created.
pub fn strip_server_fields(v: &mut Value) {
    if let Some(m) = v.get_mut("metadata").and_then(Value::as_object_mut) {
        for k in ["uid", "resourceVersion", "creationTimestamp", "generation"] {
            m.remove(k);
        }
    }
}

/// Point a virt-launcher pod's `kubevirt.io/created-by` label and controller reference at `uid`.
pub fn own_by(pod: &mut Value, uid: &str) {
    if let Some(refs) = pod
        .pointer_mut("/metadata/ownerReferences")
        .and_then(Value::as_array_mut)
    {
        for r in refs {
            if r.get("kind").and_then(Value::as_str) == Some("VirtualMachineInstance") {
                r["uid"] = json!(uid);
            }
        }
    }
    if let Some(labels) = pod
        .pointer_mut("/metadata/labels")
        .and_then(Value::as_object_mut)
        && labels.contains_key(teeguard_shared::names::CREATED_BY_LABEL)
    {
        labels.insert(
            teeguard_shared::names::CREATED_BY_LABEL.to_string(),
            json!(uid),
        );
    }
}

fn bound_to(pod: &Pod, node: &str) -> bool {
    pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node)
}

fn terminated(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// Extended resources (names with a `/`) a pod asks the scheduler for:
/// `max(max over init containers, sum over containers) + overhead`, requests falling back to limits.
pub fn extended_requests(pod: &Pod) -> BTreeMap<String, u64> {
    let mut out: BTreeMap<String, u64> = BTreeMap::new();
    let Some(spec) = &pod.spec else {
        return out;
    };
    let amounts = |c: &k8s_openapi::api::core::v1::Container| -> BTreeMap<String, u64> {
        let Some(res) = &c.resources else {
            return BTreeMap::new();
        };
        let mut m = BTreeMap::new();
        for src in [res.limits.as_ref(), res.requests.as_ref()]
            .into_iter()
            .flatten()
        {
            for (k, q) in src {
                if k.contains('/')
                    && let Some(n) = parse_whole_quantity(&q.0)
                {
                    m.insert(k.clone(), n);
                }
            }
        }
        m
    };
    for c in &spec.containers {
        for (k, n) in amounts(c) {
            *out.entry(k).or_default() += n;
        }
    }
    for c in spec.init_containers.iter().flatten() {
        for (k, n) in amounts(c) {
            let e = out.entry(k).or_default();
            *e = (*e).max(n);
        }
    }
    for (k, q) in spec.overhead.iter().flatten() {
        if k.contains('/')
            && let Some(n) = parse_whole_quantity(&q.0)
        {
            *out.entry(k.clone()).or_default() += n;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{KataTee, kata_pod};

    #[test]
    fn extended_requests_count_containers_and_overhead() {
        let pod = VirtLauncherPod::for_tee("vm", Tee::Tdx)
            .request(fixtures::TDX_KEYS, "1")
            .build();
        let r = extended_requests(&pod);
        assert_eq!(r.get(fixtures::TDX_KEYS), Some(&1));
        assert_eq!(r.get("devices.kubevirt.io/tdx"), Some(&1));
        assert_eq!(r.get("cpu"), None);
        let kata = extended_requests(&kata_pod("k", KataTee::Tdx));
        assert_eq!(kata.get(fixtures::TDX_KEYS), Some(&1));
    }

    #[test]
    fn own_by_rewrites_label_and_owner() {
        let mut v = VirtLauncherPod::for_tee("vm", Tee::Tdx).to_value();
        own_by(&mut v, "real-uid");
        assert_eq!(
            v["metadata"]["labels"]["kubevirt.io/created-by"],
            "real-uid"
        );
        assert_eq!(v["metadata"]["ownerReferences"][0]["uid"], "real-uid");
    }
}
