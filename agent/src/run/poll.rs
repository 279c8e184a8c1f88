//! The agent's loop: one task woken by the poll tick, `misc.events` changes (a failed charge), pod and
//! Node cache changes, heartbeat and retry deadlines, and shutdown; each wake-up scans when needed
//! and reconciles (`reconcile`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use super::{Agent, READY_PODS, READY_SCAN, Wake};
use crate::decide::attribution::summarize;
use crate::decide::enforcing::Mechanism;
use crate::decide::host::{HostState, Interest};
use crate::error::{Error, Result};
use crate::kernel::Scanner;

/// Resolves when the watch behind `revision` applied another event; never when there is no such
/// watch (or its reflector is gone: the agent then runs on its tick alone).
async fn changed(revision: Option<&mut tokio::sync::watch::Receiver<u64>>) {
    if let Some(rx) = revision
        && rx.changed().await.is_ok()
    {
        return;
    }
    std::future::pending().await
}

/// A receiver of `revision` that wakes the loop once at once: what the watch applied before the loop
/// subscribed (its first list, often) is read too.
fn subscribe(revision: &tokio::sync::watch::Sender<u64>) -> tokio::sync::watch::Receiver<u64> {
    let mut rx = revision.subscribe();
    rx.mark_changed();
    rx
}

impl Agent {
    /// Run until `shutdown`; then wait (briefly) for the watches to stop.
    pub(super) async fn run(&mut self, shutdown: CancellationToken) -> Result<()> {
        let poll = self.opts.config.agent.poll_interval;
        // Scan once now; the ticker then fires every poll interval from here.
        self.scan().await;
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + poll, poll);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tracing::info!(
            node = %self.opts.node_name,
            cgroup_root = %self.opts.cgroup_root.display(),
            poll_interval = ?poll,
            heartbeat_interval = ?self.opts.config.agent.heartbeat_interval,
            advertise = self.opts.config.agent.advertise,
            "agent started"
        );
        let mut pods_changed = subscribe(&self.pods.revision);
        let mut node_changed = subscribe(&self.node.revision);
        let events_changed = self.events.changed();
        // DRA mode: a claim prepared or unprepared, or the node's slices changed (the kubelet deletes
        // them when it starts).
        let dra_changed = self
            .dra
            .as_ref()
            .map(|d| d.driver.changed())
            .or_else(|| self.draining.as_ref().map(crate::dra::Dra::changed));
        let mut slices_changed = self.dra.as_ref().map(|d| subscribe(&d.slices.revision));
        let mut namespaces_changed = self.exempt_watch.as_ref().map(|w| subscribe(&w.revision));
        loop {
            let deadline = self.next_deadline();
            let wake = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = events_changed.notified() => Wake::Events,
                _ = ticker.tick() => Wake::Tick,
                _ = changed(Some(&mut pods_changed)) => Wake::Pods,
                _ = changed(Some(&mut node_changed)) => Wake::Node,
                _ = async {
                    match &dra_changed {
                        Some(d) => d.notified().await,
                        None => std::future::pending().await,
                    }
                } => Wake::Dra,
                _ = changed(slices_changed.as_mut()) => Wake::Dra,
                _ = changed(namespaces_changed.as_mut()) => Wake::Namespaces,
                _ = tokio::time::sleep_until(deadline.into()) => Wake::Deadline,
            };
            self.step(wake).await;
        }
        tracing::info!("shutting down: loops stopped, the last publish has completed");
        for task in [&mut self.pods.task, &mut self.node.task] {
            let _ = tokio::time::timeout(Duration::from_secs(5), task).await;
        }
        Ok(())
    }

    /// The next heartbeat or retry time still ahead. Times already passed are not waited for (the
    /// poll tick re-evaluates them), so a blocked publish never turns into a busy loop.
    fn next_deadline(&self) -> Instant {
        let now = Instant::now();
        let heartbeat = self.last_published.as_ref().map(|(_, due)| *due);
        [
            heartbeat,
            self.report.retry_at(),
            self.node_resources.retry_at(),
        ]
        .into_iter()
        .flatten()
        .filter(|t| *t > now)
        .min()
        .unwrap_or(now + Duration::from_secs(3600))
    }

    async fn step(&mut self, wake: Wake) {
        tracing::trace!(?wake, "woken");
        let mut scan = matches!(wake, Wake::Tick | Wake::Events);
        if wake == Wake::Events {
            self.metrics.events_rescans.inc();
            tracing::debug!("misc.events changed (a failed charge): re-reading every pod now");
            if let Some(s) = self.scanner.as_mut() {
                s.read_every_pod_next();
            }
        }
        if wake == Wake::Pods {
            // Read the flag before the store: once it is set, the store holds the full initial list.
            let synced = self.pods.is_synced();
            let view = summarize(
                self.pods.store.state().iter().map(|p| p.to_pod()),
                &self.opts.config.resources,
            );
            for (uid, err) in &view.errors {
                if self.warned_pods.insert(uid.clone()) {
                    tracing::warn!(error = %err, "pod's TEE resource quantity is not a whole number; counting it as requesting none");
                }
            }
            // A new pod that requests keys must be read now, not at the next tick.
            if view.interest != *self.interest {
                self.interest = Arc::new(view.interest.clone());
                scan = true;
            }
            self.pods_view = Arc::new(view);
            self.pods_view_synced = synced;
            self.update_limits();
            if synced {
                self.readiness.set(READY_PODS, true);
            }
        }
        if matches!(wake, Wake::Dra | Wake::Namespaces) {
            // A claim prepared or unprepared, or a namespace labelled exempt or no longer: the pod
            // cgroups' limits follow the claims' devices and, in strict mode, the namespaces.
            self.update_limits();
        }
        if scan {
            self.scan().await;
        }
        self.reconcile().await;
    }

    async fn scan(&mut self) {
        let Some(mut scanner) = self.scanner.take() else {
            return;
        };
        let interest = self.interest.clone();
        let refresh_events = Instant::now() >= self.events_refresh_at || self.events.dirty();
        let joined = tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let result = scanner.scan(Interest::Only(&interest));
            let took = started.elapsed();
            // A scan of a host with TEE capacity read every top-level misc.events: watch those
            // (a cgroup created since, kubepods after a kubelet restart, is watched at once).
            let dirs = match &result {
                Ok(HostState::Scanned(s)) if !s.capacity.is_zero() => Some(s.refusals.dirs.clone()),
                _ => refresh_events.then(|| scanner.events_dirs()),
            };
            (scanner, result, took, dirs)
        })
        .await;
        let (scanner, result, took, dirs) = match joined {
            Ok(v) => v,
            Err(e) => {
                // The scanner is lost with the panicked task: start a fresh one.
                self.scanner = Some(Scanner::new(self.opts.cgroup_root.clone()));
                self.kernel.record(Err(Error::Task(e.to_string())));
                self.metrics.scan_errors.inc();
                return;
            }
        };
        self.scanner = Some(scanner);
        self.metrics.observe_scan(took);
        if let Some(dirs) = dirs {
            self.events.refresh(dirs);
            self.events_refresh_at = Instant::now() + self.opts.events_refresh;
        }
        match &result {
            Ok(state) => {
                if let HostState::Scanned(s) = state
                    && let Some(p) = &s.pods
                {
                    self.metrics.pod_files_read.inc_by(p.pods_read as u64);
                    self.metrics
                        .pod_readings_reused
                        .inc_by(p.pods_unchanged as u64);
                    if p.problem_count > 0 {
                        self.metrics
                            .pod_cgroup_errors
                            .inc_by(p.problem_count as u64);
                    }
                }
                if self.kernel.error.is_some() {
                    tracing::info!("the misc files are readable again");
                }
                self.readiness.set(READY_SCAN, true);
            }
            Err(e) => {
                self.metrics.scan_errors.inc();
                if self.kernel.error.as_deref() != Some(&e.to_string()) {
                    tracing::error!(error = %e, "scan failed; keeping the figures of the last successful scan");
                }
            }
        }
        if let Ok(state) = &result {
            let host_changed = self.enforcement.observe_scan(state);
            if let HostState::Scanned(s) = state {
                self.enforcement
                    .observe_refusals(&s.refusals, &self.pods_view);
            }
            // The limits follow the host's facts (its kinds, its kubepods), not its usage: recomputed
            // only when those changed (for 500 pods, ~2 ms of CPU per poll otherwise).
            if host_changed {
                self.update_limits();
            }
        }
        self.kernel.record(result);
    }

    /// The pod cgroups' limits (the cgroup writer) from the pod cache and the host's kinds.
    fn update_limits(&self) {
        if self.enforcement.mechanism() != Mechanism::Cgroup {
            return;
        }
        let pods: Vec<k8s_openapi::api::core::v1::Pod> =
            self.pods.store.state().iter().map(|p| p.to_pod()).collect();
        self.enforcement.set_pods(&pods);
    }
}
