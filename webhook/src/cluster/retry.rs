//! Retrying the VMIs whose launcher pods teeguard refused, as soon as a key is free for them
//! (`admission.retryRefusedVmis`, on by default).
//!
//! virt-controller retries a refused pod CREATE with a doubling backoff (5 ms up to 1000 s): measured on
//! KubeVirt v1.9.0's controller, a VMI that had waited 120 s started 44 s after a key freed. The
//! deciding replica runs this planner: it wakes when the admission index changes (a report, a hold, a
//! VMI starting to wait), when a hold may end by time alone (`Index::next_deadline`), when it starts
//! deciding, and every [`BACKSTOP`] besides; lets a burst of changes [`SETTLE`], asks
//! [`crate::decide::admit::promises`] which waiting VMIs the free keys serve (first come, first served),
//! and holds each promise in its index under the lock the reviews decide under ([`promise`]; written
//! behind with the other holds). It annotates each promised VMI [`names::RETRIED_ANNOTATION`] (any
//! change to a VMI makes virt-controller sync it at once), logs a line, counts
//! `teeguard_webhook_vmi_retries_total` and records one `TEEKeyFree` Event; an annotation that fails
//! withdraws its promise. Needs `patch` on `virtualmachineinstances` (the chart grants it).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use jiff::Timestamp;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use teeguard_shared::{Config, TeeKind, VirtualMachineInstance, names};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::holds::{ApiHolds, HoldStore, hold, write_node};
use super::index::KeyIndex;
use super::lead::Leadership;
use crate::cluster::events::{EventSink, VmiEvent, VmiEventKind, vmi_reference};
use crate::decide::admit;
use crate::decide::mutation::VmiRef;
use crate::decide::validation::human;
use crate::metrics::{Metrics, RetryResult};

/// A pass runs at least this often, even without a wake-up.
pub const BACKSTOP: Duration = Duration::from_secs(10);
/// After a wake-up, wait this long for related changes (a report freeing keys on several nodes, the
/// VMIs it frees) before planning.
pub const SETTLE: Duration = Duration::from_millis(100);
/// A pass that could not annotate a VMI or trim a node's holds (the API server unreachable) runs again
/// this soon: a VMI must not wait for the backstop once the API server is back.
pub const AGAIN_AFTER_FAILURE: Duration = Duration::from_millis(250);

/// A key this replica promised to a waiting VMI.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Promised {
    /// The VMI.
    pub vmi: VmiRef,
    /// The kind of its key.
    pub kind: TeeKind,
    /// The node whose key it is.
    pub node: String,
    /// When its pod was first refused.
    pub since: Option<Timestamp>,
}

/// Keys of `kind` one VMI needs.
fn per_vmi(config: &Config) -> impl Fn(TeeKind) -> u64 + '_ {
    |kind| u64::from(config.resources.get(kind).keys_per_vm).max(1)
}

/// Promise the free keys to the VMIs whose turn came, held in the index (see the module): the VMIs
/// to retry.
pub fn promise(index: &KeyIndex, config: &Config, replica: &str) -> Vec<Promised> {
    let stale_after = config.admission.stale_report_after;
    let nodes: BTreeSet<String> = {
        let ix = index.read();
        let now = index.now();
        admit::promises(&ix, per_vmi(config), stale_after, now)
            .into_iter()
            .map(|p| p.node.to_string())
            .collect()
    };
    let mut out = Vec::new();
    for node in nodes {
        let promised = hold(index, |ix, now| {
            let all = admit::promises(ix, per_vmi(config), stale_after, now);
            let here: Vec<&admit::Promise<'_>> = all.iter().filter(|p| p.node == node).collect();
            if here.is_empty() {
                return (Vec::new(), None);
            }
            let promised = here
                .iter()
                .map(|p| Promised {
                    vmi: p.waiting.vmi.clone(),
                    kind: p.waiting.kind,
                    node: node.clone(),
                    since: p.waiting.since,
                })
                .collect();
            let holds = admit::promise_holds(&here, per_vmi(config), replica, now);
            (promised, Some((node.clone(), holds)))
        });
        out.extend(promised);
    }
    out
}

/// How long a node's object must be left alone before the planner trims it ([`tidy`]).
pub const TIDY_AFTER: Duration = Duration::from_secs(5);

/// Write the objects unchanged for `quiet` without the entries that ended for good (see
/// [`crate::decide::admit::untidy`]). Returns whether some write failed.
pub async fn tidy<S: HoldStore>(
    index: &KeyIndex,
    store: &S,
    quiet: Duration,
    within: Duration,
    metrics: Option<&Metrics>,
) -> bool {
    let nodes = {
        let ix = index.read();
        admit::untidy(&ix, index.now(), quiet)
    };
    let mut failed = false;
    for node in nodes {
        let written = write_node(index, store, within, metrics, |ix, now| {
            admit::tidy(ix, &node, now)
        })
        .await;
        failed |= written.is_err();
    }
    failed
}

/// Take back the key promised to `vmi` on `node` (its retry could not be written): from the index,
/// and from the node's object if it was written behind already.
pub async fn withdraw<S: HoldStore>(
    index: &KeyIndex,
    store: &S,
    node: &str,
    vmi_uid: &str,
    within: Duration,
    metrics: Option<&Metrics>,
) -> crate::error::Result<()> {
    index.update(|ix, _| ix.drop_local_promise(node, vmi_uid));
    write_node(index, store, within, metrics, |ix, now| {
        admit::withdraw(ix, node, vmi_uid, now)
    })
    .await
}

/// What the planner task needs.
#[derive(Clone)]
pub struct Retrier {
    /// The admission index.
    pub index: KeyIndex,
    /// The client (for the VMI annotations).
    pub client: kube::Client,
    /// Where the holds that ended are trimmed.
    pub store: ApiHolds,
    /// The configuration.
    pub config: Arc<Config>,
    /// This replica's name (written into the promises).
    pub replica: String,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Where the `TEEKeyFree` Events go.
    pub events: EventSink,
    /// Longest one API call may take.
    pub api_timeout: Duration,
    /// The election: only the decider plans.
    pub leadership: Leadership,
}

impl std::fmt::Debug for Retrier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Retrier")
            .field("replica", &self.replica)
            .finish_non_exhaustive()
    }
}

impl Retrier {
    /// Run until `shutdown` is cancelled, once `synced` (the caches listed) resolves.
    pub fn start(
        self,
        synced: impl Future<Output = ()> + Send + 'static,
        shutdown: CancellationToken,
    ) -> JoinHandle<()> {
        tokio::spawn(async move {
            tokio::select! {
                _ = synced => {}
                _ = shutdown.cancelled() => return,
            }
            let mut tick = tokio::time::interval(BACKSTOP);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut failed = false;
            loop {
                // Wake when a hold may end by time alone (its key frees with no event), after a
                // failed write, or at the backstop.
                let now = self.index.now();
                let deadline = self.index.read().next_deadline(now);
                let until = deadline.map_or(BACKSTOP, |t| {
                    Duration::try_from(t.duration_since(now)).unwrap_or_default()
                });
                let again = if failed {
                    AGAIN_AFTER_FAILURE.min(until)
                } else {
                    until
                };
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = self.index.changed() => {}
                    _ = tick.tick() => {}
                    _ = tokio::time::sleep(again) => {}
                    _ = self.leadership.began_deciding() => {}
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(SETTLE) => {}
                }
                failed = self.pass().await;
            }
        })
    }

    /// One pass: publish the gauges, trim the holds that ended, promise the free keys, retry the
    /// promised VMIs. Returns whether some write failed.
    pub async fn pass(&self) -> bool {
        let (waiting, holds) = {
            let ix = self.index.read();
            (ix.waiting_counts(), ix.hold_counts(self.index.now()))
        };
        for kind in TeeKind::ALL {
            let n = waiting.get(&kind).copied().unwrap_or(0);
            self.metrics.set_waiting_vmis(kind.kernel_name(), n);
        }
        for reason in [
            teeguard_shared::reservation::HoldReason::Admitted,
            teeguard_shared::reservation::HoldReason::Promised,
            teeguard_shared::reservation::HoldReason::Bound,
        ] {
            let n = holds.get(&reason).copied().unwrap_or(0);
            self.metrics.set_holds(reason.as_str(), n);
        }
        // Only the decider plans, once it has found no orphan launcher pod (see Index::orphans).
        if self.leadership.route_create(&self.index) != Ok(crate::decide::lead::Route::Here) {
            return false;
        }
        let untidy = tidy(
            &self.index,
            &self.store,
            TIDY_AFTER,
            self.api_timeout,
            Some(&self.metrics),
        )
        .await;
        if !self.config.admission.retry_refused_vmis || waiting.is_empty() {
            return untidy;
        }
        // Decided under the index's lock with the reviews: a review never takes a key promised.
        let promised = promise(&self.index, &self.config, &self.replica);
        let mut unannotated = false;
        for p in &promised {
            unannotated |= !self.retry(p).await;
        }
        untidy || unannotated
    }

    /// Annotate the VMI so virt-controller creates its pod again; withdraw its promise if that fails
    /// (false: the pass is tried again shortly).
    async fn retry(&self, p: &Promised) -> bool {
        let now = self.index.now();
        let api = Api::<VirtualMachineInstance>::namespaced(self.client.clone(), &p.vmi.namespace);
        let patch =
            json!({"metadata": {"annotations": {names::RETRIED_ANNOTATION: now.to_string()}}});
        let params = PatchParams {
            field_manager: Some(names::WEBHOOK_FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        let action = || format!("annotating VMI {} to retry it", p.vmi);
        let patch = Patch::Merge(&patch);
        let written = super::bounded(
            action,
            self.api_timeout,
            api.patch(&p.vmi.name, &params, &patch),
        )
        .await;
        let kind = p.kind.kernel_name();
        if let Err(error) = written {
            self.metrics.vmi_retry(kind, RetryResult::Failed);
            tracing::warn!(vmi = %p.vmi, kind, error = %error, "cannot annotate the VMI to retry it; its promised key is withdrawn and it is retried at the next pass");
            let withdrawn = withdraw(
                &self.index,
                &self.store,
                &p.node,
                &p.vmi.uid,
                self.api_timeout,
                Some(&self.metrics),
            )
            .await;
            if let Err(e) = withdrawn {
                // Gone from the index; the written copy ends by the end rules (at the latest its TTL).
                tracing::warn!(vmi = %p.vmi, node = p.node, error = %e, "cannot withdraw the promise from the node's TeeReservation; it ends by its end rules");
            }
            return false;
        }
        let waited = p
            .since
            .and_then(|s| Duration::try_from(now.duration_since(s)).ok())
            .map(human)
            .unwrap_or_else(|| "an unknown time".into());
        self.metrics.vmi_retry(kind, RetryResult::Retried);
        tracing::info!(vmi = %p.vmi, kind, node = p.node, waited, "a key is free: VMI retried");
        self.events.record(VmiEvent {
            vmi: vmi_reference(&p.vmi),
            kind: VmiEventKind::KeyFree,
            message: format!(
                "a {} key is free (node {}); teeguard had KubeVirt create the VM's pod again after {waited}",
                p.kind.display_name(),
                p.node
            ),
        });
        true
    }
}
