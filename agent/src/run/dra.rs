//! DRA mode in the loop: after each reconcile, tell the plugin the kernel's figures, plan the devices,
//! bring the node's ResourceSlices to the plan (bumping the pool's generation when their content
//! changes), and collect the report's DRA view.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceSlice, ResourceSliceSpec};
use kube::ResourceExt;
use teeguard_shared::TeeKind;

use super::Agent;
use crate::cluster::slices;
use crate::cluster::watch::Watched;
use crate::decide::attribution::{KindFigures, claimless_keys};
use crate::decide::dra::{self, DraView};
use crate::dra::Dra;
use crate::error::Error;

/// How long a prepared claim may have no pod on the node before the agent forgets it.
const ORPHAN_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// The loop's DRA state.
pub(super) struct DraMode {
    pub(super) driver: Dra,
    pub(super) slices: Watched<ResourceSlice>,
    /// The node's ResourceSlices.
    pub(super) slices_output: super::output::Output,
    /// The view for the next report.
    pub(super) view: DraView,
}

impl DraMode {
    /// The node's pool as the watch last saw it, ordered by slice name.
    fn published(&self, node: &str) -> Vec<Arc<ResourceSlice>> {
        let mut s: Vec<Arc<ResourceSlice>> = self
            .slices
            .store
            .state()
            .into_iter()
            .filter(|s| s.spec.pool.name == node)
            .collect();
        s.sort_by_key(|s| s.name_any());
        s
    }
}

impl Agent {
    /// Plan the devices and publish the slices when they changed. Returns the view for the report.
    pub(super) async fn reconcile_dra(
        &mut self,
        node: Option<&Arc<Node>>,
        figures: &BTreeMap<TeeKind, KindFigures>,
        ready_to_write: bool,
    ) {
        let node_name = self.opts.node_name.clone();
        let resources = self.opts.config.resources.clone();
        let api_timeout = self.opts.api_timeout;
        let claimless = claimless_keys(&self.pods_view.pods);
        let pods_synced = self.pods_view_synced;
        let pods_on_node: std::collections::HashSet<&str> =
            self.pods_view.pods.iter().map(|p| p.uid.as_str()).collect();
        let Some(mode) = self.dra.as_mut() else {
            return;
        };
        if pods_synced {
            mode.driver
                .forget_orphans(&pods_on_node, Instant::now(), ORPHAN_GRACE)
                .await;
        }
        mode.driver.observe(figures, &claimless);
        let plan = dra::plan(figures, &claimless, &mode.driver.allocated());
        for (kind, d) in &plan {
            self.metrics
                .set_dra_devices(*kind, d.published.len() as u64, d.allocated, d.withheld);
        }
        let bypassed = node
            .map(|n| dra::bypasses(n, figures.keys().copied(), &resources))
            .unwrap_or_default();
        for kind in figures.keys() {
            self.metrics
                .set_dra_bypassed(*kind, bypassed.iter().any(|b| b.kind == *kind));
        }
        let published = mode.published(&node_name);
        let current: Vec<ResourceSliceSpec> = published.iter().map(|s| s.spec.clone()).collect();
        let mut wanted = dra::slice_specs(&node_name, &plan, 0);
        let in_sync = dra::same_content(&current, &wanted)
            && current
                .iter()
                .all(|s| s.pool.generation == current[0].pool.generation);
        let can_write = ready_to_write && mode.slices.is_synced() && !figures.is_empty();
        let mut failed = None;
        if let (Some(node), false, true) = (node, in_sync, can_write)
            && mode.slices_output.due()
        {
            let generation = current.iter().map(|s| s.pool.generation).max().unwrap_or(0) + 1;
            for spec in &mut wanted {
                spec.pool.generation = generation;
            }
            let specs = &wanted;
            let names: Vec<String> = (0..specs.len())
                .map(|i| dra::slice_name(&node_name, i))
                .collect();
            let client = self.client.clone();
            let result = match tokio::time::timeout(
                api_timeout,
                slices::apply(&client, node, &names, specs, &published),
            )
            .await
            {
                Ok(r) => r,
                Err(_) => Err(Error::KubeTimeout {
                    operation: "apply ResourceSlice",
                    after: api_timeout,
                }),
            };
            match result {
                Ok(writes) => {
                    self.metrics.dra_slice_writes.inc_by(writes as u64);
                    tracing::info!(
                        node = %node_name,
                        generation,
                        slices = specs.len(),
                        devices = %describe(&plan),
                        "published the node's ResourceSlices"
                    );
                    mode.slices_output.written();
                }
                Err(e) => {
                    let delay = mode.slices_output.failed(&e);
                    tracing::warn!(error = %e, retry_in = ?delay, "cannot publish the node's ResourceSlices");
                    failed = Some(e);
                }
            }
        }
        mode.view = DraView {
            plan,
            bypassed,
            registered: mode.driver.registration().map(|s| {
                if s.plugin_registered {
                    Ok(())
                } else {
                    Err(s.error)
                }
            }),
            publish_error: mode.slices_output.error().map(str::to_owned),
            slices: wanted.len(),
        };
        if let Some(e) = failed {
            self.api_failed(&e);
        }
    }

    /// Extended-resource accounting with claims left from DRA mode: forget those whose pods are
    /// gone, and stop serving the kubelet plugin once none is left.
    pub(super) async fn drain_dra(&mut self) {
        let Some(driver) = self.draining.as_ref() else {
            return;
        };
        if self.pods_view_synced {
            let pods_on_node: std::collections::HashSet<&str> =
                self.pods_view.pods.iter().map(|p| p.uid.as_str()).collect();
            driver
                .forget_orphans(&pods_on_node, Instant::now(), ORPHAN_GRACE)
                .await;
        }
        if driver.is_empty()
            && let Some(driver) = self.draining.take()
        {
            tracing::info!(
                "every claim prepared in DRA mode was unprepared: the kubelet plugin stops (the kubelet deletes the driver's ResourceSlices 30 s later)"
            );
            driver.stop();
        }
    }
}

fn describe(plan: &BTreeMap<TeeKind, dra::KindDevices>) -> String {
    plan.iter()
        .map(|(k, d)| {
            format!(
                "{k}: {} published, {} allocated, {} withheld",
                d.published.len(),
                d.allocated,
                d.withheld
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}
