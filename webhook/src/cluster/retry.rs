//! Retrying the VMIs whose launcher pods teeguard refused, as soon as a key is free for them
//! (`admission.retryRefusedVmis`, on by default).
//!
//! virt-controller retries a refused pod CREATE with a doubling backoff (5 ms up to 1000 s): measured on
//! KubeVirt v1.9.0's controller, a VMI that had waited 120 s started 44 s after a key freed. This task
//! wakes when a VMI starts waiting or a report is stored (and every [`BACKSTOP`] in case a wake-up was
//! missed, or the webhook itself was down while keys freed), lets a burst of changes [`SETTLE`], asks
//! [`crate::decide::retry::plan`] which waiting VMIs the available keys can serve (oldest first), and
//! writes the annotation [`names::RETRIED_ANNOTATION`] on each: the change makes virt-controller sync the
//! VMI at once, and the key is promised to it ([`Promises`]) so another VMI's own retry cannot take it
//! first. Each retry logs a line, counts `teeguard_webhook_vmi_retries_total` and records a
//! `TEEKeyFree` Event on the VMI. Needs `patch` on `virtualmachineinstances` (the chart grants it).

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use jiff::Timestamp;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use teeguard_shared::pod::KeyRequests;
use teeguard_shared::{Config, TeeKind, VirtualMachineInstance, names};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::cluster::caches::{Caches, Lookups};
use crate::cluster::events::{EventSink, VmiEvent, VmiEventKind, vmi_reference};
use crate::decide::ledger::{Ledger, ReportMark};
use crate::decide::retry::{FreeNode, Promises, Retry, plan};
use crate::decide::validation::{Report, current_report, human};
use crate::metrics::{Metrics, RetryResult};

/// A pass runs at least this often, even without a wake-up.
pub const BACKSTOP: Duration = Duration::from_secs(10);
/// After a wake-up, wait this long for related changes (a report freeing keys on several nodes, the
/// VMIs it frees) before planning.
pub const SETTLE: Duration = Duration::from_millis(100);

/// What the task needs.
#[derive(Clone, Debug)]
pub struct Retrier {
    /// The caches (waiting VMIs, reports, Node labels, agent Leases) and the client.
    pub caches: Caches,
    /// This replica's admission ledger: keys admitted that no report counts yet are not free.
    pub ledger: Arc<Ledger>,
    /// The configuration (`admission.staleReportAfter`).
    pub config: Arc<Config>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Where the `TEEKeyFree` Events go.
    pub events: EventSink,
    /// The keys promised to the VMIs retried, which the validating webhook holds for them.
    pub promises: Arc<Promises>,
    /// Longest one annotation write may take.
    pub api_timeout: Duration,
}

impl Retrier {
    /// Run until `shutdown` is cancelled (first waiting for the caches to sync).
    pub fn start(self, shutdown: CancellationToken) -> JoinHandle<()> {
        tokio::spawn(async move {
            tokio::select! {
                _ = self.caches.wait_synced() => {}
                _ = shutdown.cancelled() => return,
            }
            let mut tick = tokio::time::interval(BACKSTOP);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = self.caches.waiting.changed() => {}
                    _ = tick.tick() => {}
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(SETTLE) => {}
                }
                self.pass().await;
            }
        })
    }

    /// One pass: plan and retry.
    pub async fn pass(&self) {
        let counts = self.caches.waiting.counts();
        for kind in TeeKind::ALL {
            self.metrics
                .set_waiting_vmis(kind.kernel_name(), counts.get(&kind).copied().unwrap_or(0));
        }
        let mut waiting = self.caches.waiting.snapshot();
        // A VMI holding a promise has its key (counted in `available` below): nothing to retry.
        let mono = Instant::now();
        waiting.retain(|w| !self.promises.is_promised(&w.vmi.uid, mono));
        if waiting.is_empty() {
            return;
        }
        let now = Timestamp::now();
        let available = self.available(now);
        let labels: Vec<(String, BTreeMap<String, String>)> = available
            .keys()
            .map(|node| {
                let l = self
                    .caches
                    .nodes
                    .get(node)
                    .map(|l| (*l).clone())
                    .unwrap_or_default();
                (node.clone(), l)
            })
            .collect();
        let mut nodes: Vec<FreeNode<'_>> = labels
            .iter()
            .map(|(name, labels)| FreeNode {
                name,
                labels,
                available: available.get(name).cloned().unwrap_or_default(),
            })
            .collect();
        for retry in plan(&waiting, &mut nodes, now) {
            self.retry(&retry, now).await;
        }
    }

    /// Keys available to new pods per node (current reports only): the report's `free` less the keys
    /// this replica admitted there that the report does not count yet, and those it promised.
    fn available(&self, now: Timestamp) -> BTreeMap<String, KeyRequests> {
        let stale_after = self.config.admission.stale_report_after;
        let mono = Instant::now();
        let mut out = BTreeMap::new();
        self.caches.tee_capacities.scan(|node, cap| {
            let report = Report {
                status: cap.status.as_ref(),
                lease_renewed: self.caches.agent_lease(node),
            };
            let Ok(status) = current_report(report, now, stale_after) else {
                return ControlFlow::Continue(());
            };
            if status.accounting.as_deref() == Some("dra") {
                // The scheduler allocates this node's keys: teeguard refuses no pod for them.
                return ControlFlow::Continue(());
            }
            let mark = ReportMark {
                counted_pods: &status.counted_pods,
            };
            let mut held = self.ledger.held(node, mark, mono, "");
            Promises::add_held(
                Some(&self.promises),
                &mut held,
                node,
                &status.counted_pods,
                "",
                mono,
            );
            let free: KeyRequests = TeeKind::ALL
                .into_iter()
                .filter_map(|kind| {
                    let k = status.kind(kind)?;
                    let n = k.free.saturating_sub(held.get(&kind).copied().unwrap_or(0));
                    (n > 0).then_some((kind, n))
                })
                .collect();
            if !free.is_empty() {
                out.insert(node.to_string(), free);
            }
            ControlFlow::Continue(())
        });
        out
    }

    /// Annotate the VMI so virt-controller creates its pod again.
    async fn retry(&self, r: &Retry<'_>, now: Timestamp) {
        let w = r.waiting;
        let api = Api::<VirtualMachineInstance>::namespaced(
            self.caches.client().clone(),
            &w.vmi.namespace,
        );
        let patch =
            json!({"metadata": {"annotations": {names::RETRIED_ANNOTATION: now.to_string()}}});
        let params = PatchParams {
            field_manager: Some(names::WEBHOOK_FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        // Promised first: virt-controller may create the pod before the patch's answer arrives.
        self.promises
            .promise(&r.node, w.kind, &w.vmi.uid, Instant::now());
        let written = tokio::time::timeout(
            self.api_timeout,
            api.patch(&w.vmi.name, &params, &Patch::Merge(&patch)),
        )
        .await;
        let kind = w.kind.kernel_name();
        let waited = w
            .since
            .and_then(|s| Duration::try_from(now.duration_since(s)).ok())
            .map(human)
            .unwrap_or_else(|| "an unknown time".into());
        match written {
            Ok(Ok(_)) => {
                self.caches.waiting.mark_retried(&w.vmi, now);
                self.metrics.vmi_retry(kind, RetryResult::Retried);
                tracing::info!(vmi = %w.vmi, kind, node = r.node, waited, "a key is free: VMI retried");
                self.events.record(VmiEvent {
                    vmi: vmi_reference(&w.vmi),
                    kind: VmiEventKind::KeyFree,
                    message: format!(
                        "a {} key is free (node {}); teeguard had KubeVirt create the VM's pod again after {waited}",
                        w.kind.display_name(),
                        r.node
                    ),
                });
            }
            Ok(Err(e)) => {
                self.promises.forget(&w.vmi.uid);
                self.metrics.vmi_retry(kind, RetryResult::Failed);
                tracing::warn!(vmi = %w.vmi, kind, error = %e, "cannot annotate the VMI to retry it; retried at the next pass");
            }
            Err(_) => {
                self.promises.forget(&w.vmi.uid);
                self.metrics.vmi_retry(kind, RetryResult::Failed);
                tracing::warn!(vmi = %w.vmi, kind, timeout = ?self.api_timeout, "the API server did not answer the VMI annotation in time; retried at the next pass");
            }
        }
    }
}
