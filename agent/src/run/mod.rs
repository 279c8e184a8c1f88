//! The agent's loops: one task that scans, attributes, advertises and publishes, woken by the poll
//! tick, `misc.events` changes (a failed charge), pod and Node cache changes, heartbeat and retry
//! deadlines, and shutdown. API calls happen inline, bounded by a timeout, so a shutdown request lets
//! the in-flight publish finish.
//!
//! - this module: the options, the start (watches, enforcement, the state below);
//! - `poll`: the loop: what wakes it, scanning, the pod view and the limits;
//! - `reconcile`: after every wake-up: advertise on the Node, publish the report or renew the Lease;
//! - `output`: each thing the loop keeps written (report, Node, ResourceSlices) and its retry after a
//!   failure;
//! - `dra`: DRA mode's ResourceSlices and the driver.

mod dra;
mod output;
mod poll;
mod reconcile;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Node};
use kube::core::PartialObjectMeta;
use kube::{Api, Client};
use teeguard_shared::Config;
use teeguard_shared::config::Accounting;
use teeguard_shared::crd::TeeCapacityStatus;
use teeguard_shared::ops::Readiness;
use tokio_util::sync::CancellationToken;

use crate::cluster::cached::CachedPod;
use crate::cluster::lease::HeartbeatLease;
use crate::cluster::publish::Publisher;
use crate::cluster::watch::{Backoff, ExemptNamespaces, Watched, Watches};
use crate::decide::advertise::Advertiser;
use crate::decide::attribution::{PodsView, Uids};
use crate::decide::report::{Attributed, KernelView};
use crate::dra::{Dra, DraOptions};
use crate::enforce::{Enforcement, StartOptions};
use crate::error::Result;
use crate::kernel::Scanner;
use crate::kernel::misc_events::EventsWatch;
use crate::metrics::Metrics;
use output::Output;

/// Readiness check: the first scan succeeded.
pub const READY_SCAN: &str = "scan";
/// Readiness check: the pod cache is synced.
pub const READY_PODS: &str = "pods";

/// The kubelet's default root directory.
pub const DEFAULT_KUBELET_DIR: &str = "/var/lib/kubelet";

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
    /// The kubelet's root directory (DRA mode: the plugin sockets and the checkpoint live under it).
    pub kubelet_dir: PathBuf,
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
            kubelet_dir: PathBuf::from(DEFAULT_KUBELET_DIR),
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
    let watches = Watches {
        client: client.clone(),
        backoff: opts.backoff(),
        metrics: metrics.clone(),
        shutdown: shutdown.clone(),
    };
    let pods = watches.pods(&opts.node_name, &opts.config.resources);
    let node = watches.node(&opts.node_name);
    let events = EventsWatch::new();
    // Strict mode leaves the pods of exempt namespaces alone: only then are those namespaces watched.
    let strict = opts.config.enforcement.strict
        && opts.config.enforcement.mode != teeguard_shared::config::EnforcementMode::Off;
    let (exempt_namespaces, exempt_watch) = if strict {
        let (exempt, watched) = watches.exempt_namespaces();
        (exempt, Some(watched))
    } else {
        (ExemptNamespaces::default(), None)
    };
    // The driver first: enforcement reads the claims it prepares.
    let dra_options = DraOptions {
        node_name: opts.node_name.clone(),
        kubelet_dir: opts.kubelet_dir.clone(),
        api_timeout: opts.api_timeout,
    };
    let dra = if opts.config.agent.accounting == Accounting::Dra {
        let driver = Dra::start(
            client.clone(),
            dra_options.clone(),
            metrics.clone(),
            shutdown.clone(),
        )?;
        Some(dra::DraMode {
            driver,
            slices: watches.slices(&opts.node_name),
            slices_output: Output::new(opts.backoff()),
            view: Default::default(),
        })
    } else {
        None
    };
    // Extended-resource accounting with claims left from DRA mode: the kubelet must unprepare them
    // before their pods can end.
    let draining = if dra.is_none() {
        Dra::start_draining(
            client.clone(),
            dra_options,
            metrics.clone(),
            shutdown.clone(),
        )
    } else {
        None
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
            claims: match (&dra, &draining) {
                (Some(d), _) => d.driver.claims(),
                (None, Some(d)) => d.claims(),
                (None, None) => crate::enforce::no_claims(),
            },
            metrics: metrics.clone(),
        },
        shutdown.clone(),
    );
    let mut agent = Agent {
        client: client.clone(),
        dra,
        draining,
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
        attributed: Attributed::default(),
        pods_view: Arc::default(),
        pods_view_synced: false,
        patched_node: None,
        advertiser: Advertiser::default(),
        interest: Arc::default(),
        last_published: None,
        seeded_previous: None,
        report: Output::new(opts.backoff()),
        node_resources: Output::new(opts.backoff()),
        warned_pods: HashSet::new(),
        warned_node_missing: false,
        events_refresh_at: Instant::now(),
        opts,
        metrics,
        readiness,
        pods,
        node,
        exempt_watch,
        events,
    };
    agent.readiness.set(READY_SCAN, false);
    agent.readiness.set(READY_PODS, false);
    agent.run(shutdown).await
}

struct Agent {
    opts: AgentOptions,
    client: Client,
    /// DRA mode (`agent.accounting: dra`).
    dra: Option<dra::DraMode>,
    /// Extended-resource accounting with claims prepared in DRA mode still held: the driver serves
    /// the kubelet's unprepare calls until none is left ([`Dra::start_draining`]).
    draining: Option<Dra>,
    enforcement: Enforcement,
    metrics: Metrics,
    readiness: Readiness,
    publisher: Publisher,
    /// The heartbeat Lease (`None` once writing it was forbidden: heartbeats re-publish the report).
    lease: Option<HeartbeatLease>,
    nodes: Api<Node>,
    scanner: Option<Scanner>,
    kernel: KernelView,
    /// The figures and the report's `countedPods`, from `kernel` and `pods_view`.
    attributed: Attributed,
    pods: Watched<CachedPod>,
    node: Watched<Node>,
    /// Strict mode: the namespaces labelled exempt (a change recomputes the pods' limits).
    exempt_watch: Option<Watched<PartialObjectMeta<Namespace>>>,
    pods_view: Arc<PodsView>,
    /// The pods view was computed from a synced cache (before that, nothing is written).
    pods_view_synced: bool,
    patched_node: Option<Arc<Node>>,
    advertiser: Advertiser,
    interest: Arc<Uids>,
    /// The last published status and when its heartbeat is due.
    last_published: Option<(TeeCapacityStatus, Instant)>,
    seeded_previous: Option<TeeCapacityStatus>,
    /// The TeeCapacity report (and its heartbeat Lease).
    report: Output,
    /// The Node's extended resources.
    node_resources: Output,
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
    Dra,
    Namespaces,
}
