//! After every wake-up: bring the Node's extended resources to what the figures allow, and publish
//! the report when it changed, newly counts a pod or its heartbeat is due (renewing the Lease instead
//! while the published report is current). API calls happen inline, bounded by a timeout, so a
//! shutdown request lets the in-flight publish finish; failures are retried with backoff.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;
use teeguard_shared::TeeKind;
use teeguard_shared::crd::TeeCapacityStatus;

use super::Agent;
use crate::cluster::node;
use crate::decide::advertise::{AdvertiseOutcome, Desired};
use crate::decide::attribution::KindFigures;
use crate::decide::report::{self, StatusInput, Write};
use crate::error::{Error, Result};

impl Agent {
    /// The freshest view of the Node: the watch cache, or the API server's answer to our last patch
    /// when the cache has not caught up with it yet.
    fn current_node(&self) -> Option<Arc<Node>> {
        let cached = self
            .node
            .store
            .find(|n| n.name_any() == self.opts.node_name);
        match (cached, &self.patched_node) {
            (Some(c), Some(p)) if rv(p) > rv(&c) => Some(p.clone()),
            (Some(c), _) => Some(c),
            (None, p) => p.clone(),
        }
    }

    /// Advertise, then publish or heartbeat, as due.
    pub(super) async fn reconcile(&mut self) {
        self.attributed
            .update(&self.kernel, &self.pods_view, Instant::now());
        let figures = self.attributed.figures().clone();
        self.metrics.set_figures(&figures);
        let node = self.current_node();
        // DRA mode advertises nothing (and removes what the agent advertised): a Node showing the
        // resource makes the scheduler bypass DRA on it.
        let desired = Desired::from_figures(
            self.opts.config.agent.advertise && self.dra.is_none(),
            &figures,
        );
        let ready_to_write = self.pods_view_synced && self.kernel.last_good.is_some();

        let mut outcome = AdvertiseOutcome::without_node(&desired);
        if let (Some(node), true) = (&node, ready_to_write) {
            let plan =
                self.advertiser
                    .plan(node, &desired, &self.opts.config.resources, Instant::now());
            outcome = plan.outcome;
            if !plan.writes.is_empty() && self.node_resources.due() {
                let result = with_timeout(
                    self.opts.api_timeout,
                    "patch Node",
                    node::apply(&self.nodes, &self.opts.node_name, &plan.writes),
                )
                .await;
                match result {
                    Ok(updated) => {
                        self.advertiser.applied();
                        self.metrics.node_patches.inc_by(plan.writes.len() as u64);
                        tracing::info!(node = %self.opts.node_name, writes = ?plan.writes, "updated the Node's extended resources");
                        if let Some(n) = updated {
                            self.patched_node = Some(Arc::new(n));
                        }
                        self.node_resources.written();
                    }
                    Err(e) => {
                        self.api_failed(&e);
                        let delay = self.node_resources.failed(&e);
                        tracing::warn!(error = %e, retry_in = ?delay, "cannot update the Node's extended resources");
                    }
                }
            }
        }
        outcome.error = self.node_resources.error().map(str::to_owned);
        self.drain_dra().await;
        if self.dra.is_some() {
            self.reconcile_dra(node.as_ref(), &figures, ready_to_write)
                .await;
        }

        let node_missing = node.is_none();
        let Some(node) = node.filter(|_| self.pods_view_synced) else {
            if self.node.is_synced() && node_missing && !self.warned_node_missing {
                self.warned_node_missing = true;
                tracing::warn!(error = %Error::NodeNotFound { node: self.opts.node_name.clone() }, "nothing is published until the Node exists");
            }
            return;
        };
        self.warned_node_missing = false;
        let mut status = self.build(&figures, &outcome);
        let now = Instant::now();
        let last = self.last_published.as_ref().map(|(s, at)| (s, *at));
        let write = report::next_write(last, &status, now);
        if write == Write::Nothing || !self.report.due() {
            return;
        }
        if write == Write::Heartbeat && self.lease.is_some() {
            self.renew_lease(&node).await;
            return;
        }
        let changed = last.is_none_or(|(prev, _)| report::content_differs(prev, &status));
        if !self.publisher.is_ensured() {
            match with_timeout(
                self.opts.api_timeout,
                "apply TeeCapacity",
                self.publisher.ensure(&node),
            )
            .await
            {
                Ok(existing) => {
                    if self.last_published.is_none() && existing.is_some() {
                        self.seeded_previous = existing;
                        status = self.build(&figures, &outcome);
                    }
                }
                Err(e) => {
                    self.publish_failed(&e);
                    return;
                }
            }
        }
        match with_timeout(
            self.opts.api_timeout,
            "apply TeeCapacity status",
            self.publisher.publish(&status),
        )
        .await
        {
            Ok(()) => {
                self.metrics.publishes.inc();
                self.metrics
                    .last_publish
                    .set(jiff::Timestamp::now().as_second());
                if changed {
                    tracing::info!(node = %self.opts.node_name, figures = %report::describe(&figures), "published TeeCapacity");
                } else {
                    tracing::debug!(node = %self.opts.node_name, "heartbeat published");
                }
                self.last_published = Some((status, self.heartbeat_due()));
                self.report.written();
            }
            Err(e) => self.publish_failed(&e),
        }
    }

    /// A heartbeat while the published report is current: renew the Lease. Without permission to
    /// write Leases (an RBAC left from an older chart), heartbeats re-publish the report instead.
    async fn renew_lease(&mut self, node: &Node) {
        let Some(lease) = self.lease.as_mut() else {
            return;
        };
        let result = with_timeout(
            self.opts.api_timeout,
            "renew the heartbeat Lease",
            lease.renew(node, jiff::Timestamp::now()),
        )
        .await;
        match result {
            Ok(()) => {
                self.metrics.lease_renewals.inc();
                self.metrics
                    .last_publish
                    .set(jiff::Timestamp::now().as_second());
                tracing::debug!(node = %self.opts.node_name, "heartbeat: Lease renewed");
                let due = self.heartbeat_due();
                if let Some((_, at)) = self.last_published.as_mut() {
                    *at = due;
                }
                self.report.written();
            }
            Err(e) if e.api_code() == Some(403) => {
                tracing::warn!(
                    error = %e,
                    namespace = %lease.namespace(),
                    "not allowed to write the heartbeat Lease (grant leases create and patch in this \
                     namespace, as the chart's Role does); heartbeats re-publish the report instead"
                );
                self.api_failed(&e);
                self.lease = None;
            }
            Err(e) => self.publish_failed(&e),
        }
    }

    /// When the heartbeat after a publish completing now is due ([`report::next_heartbeat`]): at the
    /// node's own place in the interval, so the nodes of a cluster do not heartbeat together.
    fn heartbeat_due(&self) -> Instant {
        let interval = self.opts.config.agent.heartbeat_interval;
        let now = Instant::now();
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let offset = report::heartbeat_offset(&self.opts.node_name, interval);
        now + report::next_heartbeat(wall, interval, offset).saturating_sub(wall)
    }

    fn build(
        &self,
        figures: &BTreeMap<TeeKind, KindFigures>,
        outcome: &AdvertiseOutcome,
    ) -> TeeCapacityStatus {
        let previous = self
            .last_published
            .as_ref()
            .map(|(s, _)| s)
            .or(self.seeded_previous.as_ref());
        let enforcing = self.enforcement.condition();
        self.metrics.set_enforcing(&enforcing);
        report::build_status(&StatusInput {
            kernel: &self.kernel,
            figures,
            advertising: outcome,
            resources: &self.opts.config.resources,
            counted_pods: self.attributed.listed(),
            enforcing: Some(&enforcing),
            previous,
            dra: self.dra.as_ref().map(|d| &d.view),
            now: jiff::Timestamp::now(),
        })
    }

    pub(super) fn api_failed(&self, e: &Error) {
        let op = match e {
            Error::Kube { operation, .. } | Error::KubeTimeout { operation, .. } => operation,
            _ => "other",
        };
        self.metrics.api_error(op);
    }

    fn publish_failed(&mut self, e: &Error) {
        self.api_failed(e);
        let delay = self.report.failed(e);
        tracing::warn!(error = %e, retry_in = ?delay, "cannot publish TeeCapacity; scanning goes on");
    }
}

fn rv(n: &Node) -> u64 {
    n.metadata
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

async fn with_timeout<T>(
    limit: Duration,
    operation: &'static str,
    fut: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r,
        Err(_) => Err(Error::KubeTimeout {
            operation,
            after: limit,
        }),
    }
}
