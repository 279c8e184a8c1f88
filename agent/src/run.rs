//! The agent's loops: one task that scans, attributes, advertises and publishes, woken by the poll
//! tick, `misc.events` changes (a failed charge), pod and Node cache changes, heartbeat and retry
//! deadlines, and shutdown. API calls happen inline, bounded by a timeout, so a shutdown request lets
//! the in-flight publish finish.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client, ResourceExt};
use notify::Watcher;
use teeguard_shared::Config;
use teeguard_shared::crd::TeeCapacityStatus;
use teeguard_shared::ops::Readiness;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::advertise::{self, AdvertiseOutcome, Desired};
use crate::enforce::{Enforcement, StartOptions};
use crate::error::{Error, Result};
use crate::lease::HeartbeatLease;
use crate::metrics::Metrics;
use crate::pods::{self, Backoff, CachedPod, PodsView, Watched};
use crate::publish::Publisher;
use crate::report::{self, CountedPods, KernelView, StatusInput, Write};
use crate::scan::{HostState, Interest, Scanner};

/// Readiness check: the first scan succeeded.
pub const READY_SCAN: &str = "scan";
/// Readiness check: the pod cache is synced.
pub const READY_PODS: &str = "pods";

/// Settings of [`run`].
#[derive(Clone, Debug)]
pub struct AgentOptions {
    /// The Kubernetes node this agent runs on.
    pub node_name: String,
    /// Where the host's cgroup tree is mounted.
    pub cgroup_root: PathBuf,
    /// The shared configuration (`agent` and `resources` sections are used).
    pub config: Config,
    /// First retry delay after a failed API call.
    pub backoff_initial: Duration,
    /// Longest retry delay (±20 % jitter). It bounds how long after an API server outage the agent
    /// publishes again and its pod and Node watches resume, since each waits out its last delay.
    pub backoff_max: Duration,
    /// Time limit of one API call.
    pub api_timeout: Duration,
    /// How often the set of watched `misc.events` files is refreshed.
    pub events_refresh: Duration,
}

impl AgentOptions {
    /// Options with production defaults (retry 500 ms doubling to 5 s, 10 s API timeout). A longer cap
    /// would leave the report (and the Node's extended resources) behind the host for up to that long
    /// after an outage; 5 s per node is about a kubelet's own status traffic while the API server is
    /// away.
    pub fn new(
        node_name: impl Into<String>,
        cgroup_root: impl Into<PathBuf>,
        config: Config,
    ) -> Self {
        AgentOptions {
            node_name: node_name.into(),
            cgroup_root: cgroup_root.into(),
            config,
            backoff_initial: Duration::from_millis(500),
            backoff_max: Duration::from_secs(5),
            api_timeout: Duration::from_secs(10),
            events_refresh: Duration::from_secs(30),
        }
    }

    fn backoff(&self) -> Backoff {
        Backoff::new(self.backoff_initial, self.backoff_max)
    }
}

/// Run the agent until `shutdown` is cancelled. Returns an error only for set-up failures; everything
/// at run time (unreadable files, API outages) is logged, counted, reported and retried.
pub async fn run(
    client: Client,
    opts: AgentOptions,
    metrics: Metrics,
    readiness: Readiness,
    shutdown: CancellationToken,
) -> Result<()> {
    let pods = pods::watch_pods(
        client.clone(),
        &opts.node_name,
        &opts.config.resources,
        opts.backoff(),
        metrics.clone(),
        shutdown.clone(),
    );
    let node = pods::watch_node(
        client.clone(),
        &opts.node_name,
        opts.backoff(),
        metrics.clone(),
        shutdown.clone(),
    );
    let events = EventsWatch::new();
    // Strict mode leaves the pods of exempt namespaces alone: only then are those namespaces watched.
    let strict = opts.config.enforcement.strict
        && opts.config.enforcement.mode != teeguard_shared::config::EnforcementMode::Off;
    let (exempt_namespaces, _exempt_watch) = if strict {
        let (exempt, watched) = pods::watch_exempt_namespaces(
            client.clone(),
            opts.backoff(),
            metrics.clone(),
            shutdown.clone(),
        );
        (exempt, Some(watched))
    } else {
        (pods::ExemptNamespaces::default(), None)
    };
    let enforcement = Enforcement::start(
        StartOptions {
            config: opts.config.enforcement.clone(),
            resources: opts.config.resources.clone(),
            pods: pods.store.clone(),
            exempt_namespaces,
            client: Some(client.clone()),
            node_name: opts.node_name.clone(),
            poll_interval: opts.config.agent.poll_interval,
            metrics: metrics.clone(),
        },
        shutdown.clone(),
    );
    let mut agent = Agent {
        enforcement,
        publisher: Publisher::new(client.clone(), opts.node_name.clone()),
        lease: Some(HeartbeatLease::new(
            client.clone(),
            opts.node_name.clone(),
            opts.config.admission.stale_report_after,
        )),
        nodes: Api::all(client),
        scanner: Some(Scanner::new(opts.cgroup_root.clone())),
        kernel: KernelView::default(),
        counted_pods: CountedPods::default(),
        pods_view: PodsView::default(),
        pods_view_synced: false,
        patched_node: None,
        advertiser: advertise::Advertiser::default(),
        interest: Arc::new(HashSet::new()),
        last_published: None,
        seeded_previous: None,
        publish_backoff: opts.backoff(),
        publish_retry_at: None,
        node_backoff: opts.backoff(),
        node_retry_at: None,
        advertise_error: None,
        warned_pods: HashSet::new(),
        warned_node_missing: false,
        events_refresh_at: Instant::now(),
        opts,
        metrics,
        readiness,
        pods,
        node,
        events,
    };
    agent.readiness.set(READY_SCAN, false);
    agent.readiness.set(READY_PODS, false);
    agent.run(shutdown).await
}

struct Agent {
    opts: AgentOptions,
    enforcement: Enforcement,
    metrics: Metrics,
    readiness: Readiness,
    publisher: Publisher,
    /// The heartbeat Lease (`None` once writing it was forbidden: heartbeats re-publish the report).
    lease: Option<HeartbeatLease>,
    nodes: Api<Node>,
    scanner: Option<Scanner>,
    kernel: KernelView,
    /// Since when each pod has been counted (for the report's `countedPods`).
    counted_pods: CountedPods,
    pods: Watched<CachedPod>,
    node: Watched<Node>,
    pods_view: PodsView,
    /// The pods view was computed from a synced cache (before that, nothing is written).
    pods_view_synced: bool,
    patched_node: Option<Arc<Node>>,
    advertiser: advertise::Advertiser,
    interest: Arc<HashSet<String>>,
    /// The last published status and when its heartbeat is due.
    last_published: Option<(TeeCapacityStatus, Instant)>,
    seeded_previous: Option<TeeCapacityStatus>,
    publish_backoff: Backoff,
    publish_retry_at: Option<Instant>,
    node_backoff: Backoff,
    node_retry_at: Option<Instant>,
    advertise_error: Option<String>,
    warned_pods: HashSet<String>,
    warned_node_missing: bool,
    events: EventsWatch,
    events_refresh_at: Instant,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wake {
    Tick,
    Events,
    Pods,
    Node,
    Deadline,
}

impl Agent {
    async fn run(&mut self, shutdown: CancellationToken) -> Result<()> {
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
        let pods_changed = self.pods.changed.clone();
        let node_changed = self.node.changed.clone();
        let events_changed = self.events.notify.clone();
        loop {
            let deadline = self.next_deadline();
            let wake = tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = events_changed.notified() => Wake::Events,
                _ = ticker.tick() => Wake::Tick,
                _ = pods_changed.notified() => Wake::Pods,
                _ = node_changed.notified() => Wake::Node,
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
        [heartbeat, self.publish_retry_at, self.node_retry_at]
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
            tracing::debug!("misc.events changed (a failed charge): re-scanning now");
        }
        if wake == Wake::Pods {
            // Read the flag before the store: once it is set, the store holds the full initial list.
            let synced = self.pods.is_synced();
            let view = pods::summarize(
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
            self.pods_view = view;
            self.pods_view_synced = synced;
            self.update_limits();
            if synced {
                self.readiness.set(READY_PODS, true);
            }
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
        let refresh_events = Instant::now() >= self.events_refresh_at
            || self.events.dirty.swap(false, Ordering::AcqRel);
        let joined = tokio::task::spawn_blocking(move || {
            let started = Instant::now();
            let result = scanner.scan(Interest::Only(&interest));
            let took = started.elapsed();
            let dirs = refresh_events.then(|| scanner.events_dirs());
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
            self.enforcement.observe_scan(state);
            self.update_limits();
        }
        self.kernel.record(result);
    }

    /// The pod cgroups' limits (the cgroup writer) from the pod cache and the host's kinds.
    fn update_limits(&self) {
        if self.enforcement.mechanism() != crate::enforce::Mechanism::Cgroup {
            return;
        }
        let pods: Vec<k8s_openapi::api::core::v1::Pod> =
            self.pods.store.state().iter().map(|p| p.to_pod()).collect();
        self.enforcement.set_pods(&pods);
    }

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

    async fn reconcile(&mut self) {
        let figures = self.kernel.figures(&self.pods_view.pods);
        self.metrics.set_figures(&figures);
        let counted_pods = self.counted_pods.update(
            &self.kernel.counted(&self.pods_view.pods),
            Instant::now(),
            self.opts.config.admission.ledger_ttl,
        );
        let node = self.current_node();
        let desired = Desired::from_figures(self.opts.config.agent.advertise, &figures);
        let ready_to_write = self.pods_view_synced && self.kernel.last_good.is_some();

        let mut outcome = AdvertiseOutcome::without_node(&desired);
        if let (Some(node), true) = (&node, ready_to_write) {
            let plan =
                self.advertiser
                    .plan(node, &desired, &self.opts.config.resources, Instant::now());
            outcome = plan.outcome;
            if !plan.writes.is_empty() && due(self.node_retry_at) {
                let result = with_timeout(
                    self.opts.api_timeout,
                    "patch Node",
                    advertise::apply(&self.nodes, &self.opts.node_name, &plan.writes),
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
                        self.advertise_error = None;
                        self.node_retry_at = None;
                        self.node_backoff.reset();
                    }
                    Err(e) => {
                        self.api_failed(&e);
                        let delay = self.node_backoff.next_delay();
                        tracing::warn!(error = %e, retry_in = ?delay, "cannot update the Node's extended resources");
                        self.advertise_error = Some(e.to_string());
                        self.node_retry_at = Some(Instant::now() + delay);
                    }
                }
            }
        }
        outcome.error = self.advertise_error.clone();

        let node_missing = node.is_none();
        let Some(node) = node.filter(|_| self.pods_view_synced) else {
            if self.node.is_synced() && node_missing && !self.warned_node_missing {
                self.warned_node_missing = true;
                tracing::warn!(error = %Error::NodeNotFound { node: self.opts.node_name.clone() }, "nothing is published until the Node exists");
            }
            return;
        };
        self.warned_node_missing = false;
        let mut status = self.build(&figures, &counted_pods, &outcome);
        let now = Instant::now();
        let last = self.last_published.as_ref().map(|(s, at)| (s, *at));
        let write = report::next_write(last, &status, now);
        if write == Write::Nothing || !due(self.publish_retry_at) {
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
                        status = self.build(&figures, &counted_pods, &outcome);
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
                self.publish_retry_at = None;
                self.publish_backoff.reset();
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
                self.publish_retry_at = None;
                self.publish_backoff.reset();
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
        figures: &std::collections::BTreeMap<
            teeguard_shared::TeeKind,
            crate::attribution::KindFigures,
        >,
        counted_pods: &[String],
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
            counted_pods,
            enforcing: Some(&enforcing),
            previous,
            now: jiff::Timestamp::now(),
        })
    }

    fn api_failed(&self, e: &Error) {
        let op = match e {
            Error::Kube { operation, .. } | Error::KubeTimeout { operation, .. } => operation,
            _ => "other",
        };
        self.metrics.api_error(op);
    }

    fn publish_failed(&mut self, e: &Error) {
        self.api_failed(e);
        let delay = self.publish_backoff.next_delay();
        tracing::warn!(error = %e, retry_in = ?delay, "cannot publish TeeCapacity; scanning goes on");
        self.publish_retry_at = Some(Instant::now() + delay);
    }
}

fn due(retry_at: Option<Instant>) -> bool {
    retry_at.is_none_or(|t| Instant::now() >= t)
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

/// inotify watches on the directories holding `misc.events` files.
struct EventsWatch {
    watcher: Option<notify::RecommendedWatcher>,
    dirs: Vec<PathBuf>,
    notify: Arc<Notify>,
    dirty: Arc<AtomicBool>,
}

impl EventsWatch {
    fn new() -> Self {
        let notify = Arc::new(Notify::new());
        let dirty = Arc::new(AtomicBool::new(false));
        let watcher = {
            let notify = notify.clone();
            let dirty = dirty.clone();
            notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
                let Ok(ev) = res else { return };
                use notify::EventKind;
                use notify::event::{AccessKind, AccessMode};
                let is_events = ev
                    .paths
                    .iter()
                    .any(|p| p.file_name().is_some_and(|n| n == "misc.events"));
                match ev.kind {
                    EventKind::Modify(_)
                    | EventKind::Create(_)
                    | EventKind::Access(AccessKind::Close(AccessMode::Write))
                        if is_events =>
                    {
                        notify.notify_one()
                    }
                    EventKind::Remove(_) => dirty.store(true, Ordering::Release),
                    _ => {}
                }
            })
        };
        let watcher = match watcher {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %Error::Watch(e), "misc.events changes will only be noticed by polling");
                None
            }
        };
        EventsWatch {
            watcher,
            dirs: Vec::new(),
            notify,
            dirty,
        }
    }

    fn refresh(&mut self, dirs: Vec<PathBuf>) {
        let Some(w) = self.watcher.as_mut() else {
            return;
        };
        if dirs == self.dirs {
            return;
        }
        for old in &self.dirs {
            if !dirs.contains(old) {
                let _ = w.unwatch(old);
            }
        }
        let mut watched = Vec::with_capacity(dirs.len());
        for d in dirs {
            if self.dirs.contains(&d) {
                watched.push(d);
                continue;
            }
            match w.watch(&d, notify::RecursiveMode::NonRecursive) {
                Ok(()) => watched.push(d),
                Err(e) => {
                    tracing::debug!(dir = %d.display(), error = %e, "cannot watch misc.events")
                }
            }
        }
        tracing::debug!(dirs = ?watched, "watching misc.events");
        self.dirs = watched;
    }
}
