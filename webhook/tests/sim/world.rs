//! The simulated world: an API server's truth (VMIs, launcher pods, the nodes' reports and
//! `TeeReservation`s), webhook replicas each with its own admission index fed by its own watches
//! (late and out of step), virt-controller, the scheduler, kubelets charging keys in the kernel, the
//! node agents reporting them. The replicas run the webhook's own code: the index and its watch
//! adapters (`cluster::index`), the check (`cluster::admission::check`), the election
//! (`cluster::lead::Leadership`), the write-behind with an API server of the simulation's own
//! (`cluster::holds::HoldStore`), the planner (`cluster::retry::promise`).
//!
//! Everything that happens is an [`Action`]; the drivers decide which comes next (by time and a
//! seed, or every order: `explore`).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::PodSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use serde_json::json;
use teeguard_shared::config::Config;
use teeguard_shared::crd::{KindStatus, TeeCapacitySpec, TeeCapacityStatus};
use teeguard_shared::pod::KeyRequests;
use teeguard_shared::reservation::{TeeReservation, TeeReservationSpec};
use teeguard_shared::{TeeCapacity, TeeKind, VirtualMachineInstance};
use teeguard_webhook::cluster::admission::{Checker, FitHints, Target, check};
use teeguard_webhook::cluster::caches::{Observer, slim_vmi};
use teeguard_webhook::cluster::holds::{HoldStore, Listed, WriteError, write_behind_once};
use teeguard_webhook::cluster::index::{Clock, KeyIndex, Sink};
use teeguard_webhook::cluster::lead::Leadership;
use teeguard_webhook::cluster::retry::{promise, tidy, withdraw};
use teeguard_webhook::decide::admit::{Ask, Write};
use teeguard_webhook::decide::holds::Claimant;
use teeguard_webhook::decide::lead::{Elector, Record, Route, Terms};
use teeguard_webhook::decide::queue::{self, note_refusal};
use teeguard_webhook::decide::validation::Trigger;
use teeguard_webhook::decide::validation::reason;
use teeguard_webhook::error::Error;
use teeguard_webhook::pods::{CachedLauncherPod, LauncherPod};

/// The simulation's start, as wall-clock time.
pub fn epoch() -> Timestamp {
    Timestamp::from_second(1_800_000_000).expect("epoch")
}

/// The wall-clock time `ms` after [`epoch`].
pub fn at(ms: u64) -> Timestamp {
    epoch()
        .checked_add(SignedDuration::from_millis(ms as i64))
        .expect("time")
}

/// A node of the world.
#[derive(Clone, Copy, Debug)]
pub struct NodeSpec {
    /// Its name.
    pub name: &'static str,
    /// The kind of keys its host has.
    pub kind: TeeKind,
    /// `misc.capacity`.
    pub capacity: u64,
    /// Keys held by VMs outside Kubernetes.
    pub external: u64,
}

/// The shape of a world.
#[derive(Clone, Debug)]
pub struct Spec {
    /// Webhook replicas behind the balancer.
    pub replicas: usize,
    /// The nodes.
    pub nodes: Vec<NodeSpec>,
    /// A defect to plant (to show the checks catch it).
    pub defect: Defect,
}

/// A defect planted on purpose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Defect {
    /// None.
    #[default]
    None,
    /// A decider that has just taken over admits CREATEs at once, without waiting for the launcher
    /// pods admitted before whose holds it never saw.
    NoOrphanGate,
    /// A replica takes the Lease over as soon as it sees it, without waiting the lease duration.
    NoLeaseWait,
    /// The decider never writes its holds behind.
    NoWriteBehind,
    /// Every replica decides on its own index (no election): each keeps its own holds.
    EveryReplicaDecides,
    /// A replica that takes the Lease decides at once on what its watches delivered, without listing
    /// the holds and the reports first (the API server's lists show it nothing).
    NoCatchUp,
}

/// The four watched kinds, one watch (and queue) each per replica.
pub const KINDS: usize = 4;
/// `TeeReservation`s.
pub const HOLDS: usize = 0;
/// `TeeCapacity` reports.
pub const REPORTS: usize = 1;
/// virt-launcher pods.
pub const PODS: usize = 2;
/// VMIs.
pub const VMIS: usize = 3;

/// One change a watch delivers.
#[derive(Clone, Debug)]
pub enum Change {
    /// A node's `TeeReservation` (`None`: deleted).
    Holds(String, Option<TeeReservation>),
    /// A node's report.
    Report(Box<TeeCapacity>),
    /// A launcher pod stored, or deleted (`uid`, `None`).
    Pod(String, Option<LauncherPod>),
    /// A VMI stored, or deleted.
    Vmi(String, Option<VirtualMachineInstance>),
}

impl Change {
    fn kind(&self) -> usize {
        match self {
            Change::Holds(..) => HOLDS,
            Change::Report(_) => REPORTS,
            Change::Pod(..) => PODS,
            Change::Vmi(..) => VMIS,
        }
    }

    /// Apply to `index` through the webhook's own watch adapters.
    pub fn apply(&self, index: &KeyIndex) {
        match self {
            Change::Holds(_, Some(obj)) => Sink::apply(index, obj.clone()),
            Change::Holds(node, None) => Sink::<TeeReservation>::delete(index, node),
            Change::Report(cap) => Sink::apply(index, (**cap).clone()),
            Change::Pod(_, Some(pod)) => {
                Observer::stored(index, &CachedLauncherPod::from(pod.clone()))
            }
            Change::Pod(uid, None) => {
                let gone = CachedLauncherPod {
                    uid: Some(uid.clone()),
                    ..CachedLauncherPod::default()
                };
                Observer::removed(index, &gone);
            }
            Change::Vmi(_, Some(vmi)) => {
                let mut v = vmi.clone();
                slim_vmi(&mut v);
                Observer::stored(index, &v);
            }
            Change::Vmi(uid, None) => {
                let mut v = VirtualMachineInstance::from_json(json!({
                    "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                    "metadata": {"name": "gone", "namespace": "vms", "uid": uid},
                    "spec": {"domain": {}}
                }))
                .expect("VMI");
                slim_vmi(&mut v);
                Observer::removed(index, &v);
            }
        }
    }
}

/// A node as the API server and its host know it.
#[derive(Clone, Debug)]
pub struct NodeTruth {
    /// The spec.
    pub spec: NodeSpec,
    /// The report the agent last published.
    pub published: Option<TeeCapacityStatus>,
    /// Its `resourceVersion`.
    pub published_rev: u64,
    /// The node's `TeeReservation`.
    pub holds: Option<TeeReservation>,
    /// When the agent first counted each pod.
    pub first_counted: BTreeMap<String, u64>,
    /// Keys charged by pods in the kernel.
    pub charged: BTreeSet<String>,
}

/// A launcher pod as the API server knows it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PodTruth {
    /// Its name.
    pub name: String,
    /// Its VMI's UID.
    pub vmi: String,
    /// The kind of key it requests.
    pub kind: TeeKind,
    /// The node it is bound to.
    pub node: Option<String>,
    /// Its VMI was deleted: the pod is terminating.
    pub deleting: bool,
    /// The scheduler found no node for it (`Insufficient`).
    pub unschedulable: bool,
    /// Bindings the webhook refused.
    pub refused_bindings: u32,
    /// When its CREATE was admitted.
    pub admitted_at: u64,
}

/// A VMI as the API server knows it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct VmiTruth {
    /// Its name.
    pub name: String,
    /// Its kind.
    pub kind: TeeKind,
    /// When its pod was first refused (the `Synchronized` condition's `lastTransitionTime`).
    pub refused_at: Option<u64>,
    /// The condition's message.
    pub message: Option<String>,
    /// Its pod.
    pub pod: Option<String>,
    /// The pod virt-controller has written into the VMI's status (phase, `Synchronized`) so far: it
    /// writes it after the CREATE, seconds later when busy.
    pub status_pod: Option<String>,
    /// Deleted (when).
    pub deleted_at: Option<u64>,
    /// Times teeguard retried it (`TEEKeyFree` Events).
    pub retried: u32,
    /// Refused pod CREATEs so far (virt-controller's backoff).
    pub refusals: u32,
    /// When it was created.
    pub created_at: u64,
    /// Pods created for it so far, and CREATEs admitted but not persisted (its next pod's UID: the
    /// same whatever teeguard refused before).
    pub pods: u32,
}

/// What the API server holds.
#[derive(Clone, Debug)]
pub struct Truth {
    /// Its revision counter (`resourceVersion`s).
    pub rev: u64,
    /// Nodes.
    pub nodes: BTreeMap<String, NodeTruth>,
    /// Launcher pods by UID (deleted ones leave).
    pub pods: BTreeMap<String, PodTruth>,
    /// When each deleted pod left.
    pub gone_pods: BTreeMap<String, u64>,
    /// VMIs by UID (deleted ones stay, marked).
    pub vmis: BTreeMap<String, VmiTruth>,
    /// Writes refused (an API server outage).
    pub api_down: bool,
    /// The decider Lease.
    pub lease: Option<Record>,
    /// Lists of the holds show nothing (the defect [`Defect::NoCatchUp`]).
    pub blind_lists: bool,
    /// Changes not yet handed to the watches.
    pub outbox: Vec<Change>,
    next: u64,
}

/// The decider Lease's duration (`admission.deciderLease`'s default).
const LEASE: Duration = Duration::from_secs(15);

/// Replica `r`'s name in the decider Lease.
fn identity(r: usize) -> String {
    format!("replica-{r}")
}

/// A call while the simulation's API server is down: it does not answer.
fn down(action: String, within: Duration) -> Error {
    Error::ApiTimeout { action, within }
}

/// The simulation's API server, as the webhook's hold store.
#[derive(Debug)]
pub struct SimStore<'a>(pub &'a Mutex<Truth>);

impl HoldStore for SimStore<'_> {
    async fn write(&self, w: &Write, within: Duration) -> Result<TeeReservation, WriteError> {
        let mut t = lock(self.0);
        if t.api_down {
            let action = format!("writing TeeReservation {}", w.node);
            return Err(WriteError::Failed(down(action, within)));
        }
        let node = t.nodes.get(&w.node).expect("a node of the world");
        let current = node
            .holds
            .as_ref()
            .and_then(|o| o.metadata.resource_version.clone());
        let base = w
            .base
            .as_ref()
            .and_then(|o| o.metadata.resource_version.clone());
        if current != base {
            return Err(WriteError::Conflict);
        }
        t.rev += 1;
        let obj = TeeReservation {
            metadata: ObjectMeta {
                name: Some(w.node.clone()),
                resource_version: Some(t.rev.to_string()),
                ..ObjectMeta::default()
            },
            spec: TeeReservationSpec {
                node_name: w.node.clone(),
                // As the API server keeps it: `admittedAt` (a `metav1.Time`) to the second.
                reservations: w
                    .entries
                    .iter()
                    .cloned()
                    .map(|mut e| {
                        let second = e.admitted_at.0.as_second();
                        e.admitted_at.0 = jiff::Timestamp::from_second(second).expect("a time");
                        e
                    })
                    .collect(),
            },
        };
        t.nodes.get_mut(&w.node).expect("node").holds = Some(obj.clone());
        t.outbox
            .push(Change::Holds(w.node.clone(), Some(obj.clone())));
        Ok(obj)
    }

    async fn read(&self, node: &str, within: Duration) -> Result<Option<TeeReservation>, Error> {
        let t = lock(self.0);
        if t.api_down {
            return Err(down(format!("reading TeeReservation {node}"), within));
        }
        Ok(t.nodes.get(node).and_then(|n| n.holds.clone()))
    }

    async fn list(&self, within: Duration) -> Result<Listed, Error> {
        let t = lock(self.0);
        if t.api_down {
            return Err(down("listing the TeeReservations".into(), within));
        }
        if t.blind_lists {
            return Ok(Listed::default());
        }
        let reports = t.nodes.iter().filter_map(|(name, n)| {
            let status = n.published.as_ref()?;
            Some(report_object(name, status, n.published_rev))
        });
        Ok(Listed {
            holds: t.nodes.values().filter_map(|n| n.holds.clone()).collect(),
            reports: reports.collect(),
        })
    }
}

fn lock(m: &Mutex<Truth>) -> MutexGuard<'_, Truth> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A webhook replica.
pub struct Replica {
    /// Its admission index.
    pub index: KeyIndex,
    hints: FitHints,
    /// Running.
    pub alive: bool,
    /// Per kind: changes on their way (due time, change).
    pub queues: [VecDeque<(u64, Change)>; KINDS],
    /// Per kind: the watch is down (re-lists when it comes back).
    pub dropped: [bool; KINDS],
    /// Listed once since its start.
    pub synced: bool,
    /// When it started (ms).
    pub started_at: u64,
    /// Per kind: when its watch last listed (its start, or a re-list after a drop).
    pub listed_at: [u64; KINDS],
    /// Its side of the decider election (leader mode).
    pub leadership: Leadership,
    /// Stopped cleanly (the model checker leaves it stopped: a rolling update's replica replaced).
    pub stopped: bool,
}

/// Everything that can happen.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Action {
    /// A client creates a VMI of `kind`.
    NewVmi(TeeKind),
    /// virt-controller creates the VMI's pod; the API server calls replica `replica`.
    Create(String, usize),
    /// virt-controller writes the VMI's status after creating its pod (phase, `Synchronized`).
    VmiStatus(String),
    /// The scheduler binds a pod; replica `replica` reviews the binding.
    Bind(String, usize),
    /// The kubelet starts the pod: QEMU charges its key.
    Start(String),
    /// The node's agent reads the kernel and publishes its report if it changed.
    Publish(String),
    /// A replica's planner pass.
    Plan(usize),
    /// A replica's watch of a kind delivers its next change.
    Deliver(usize, usize),
    /// A replica's watch of a kind delivers every change on its way (the model checker's step).
    CatchUp(usize, usize),
    /// A client deletes a VMI.
    DeleteVmi(String),
    /// A deleted VMI's pod stops and leaves.
    Reap(String),
    /// A replica crashes.
    Crash(usize),
    /// A replica stops cleanly (a rolling upgrade): it writes its holds behind once more, gives the
    /// Lease up if it decided (a successor takes it at once), and is gone.
    Stop(usize),
    /// A replica starts again and lists everything.
    Restart(usize),
    /// A replica's watch of a kind is dropped.
    DropWatch(usize, usize),
    /// It comes back with a re-list.
    Relist(usize, usize),
    /// A replica reads the decider Lease and renews or takes it when it may (leader mode).
    Renew(usize),
    /// The decider Lease's holder is gone (it crashed): the lease duration passes, in which the agents
    /// publish and the live watches deliver, so any replica may take it over (the model checker's one
    /// step of time; the timed runs let the clock run).
    LeaseRunsOut,
    /// The decider writes its holds behind (leader mode).
    WriteBehind(usize),
    /// The API server refuses every write.
    ApiDown,
    /// It takes writes again.
    ApiUp,
}

/// What a binding came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// Bound to its node.
    Yes,
    /// The webhook refused it (FailedScheduling with teeguard's message).
    Refused,
    /// The scheduler found no node with room (`Insufficient`).
    NoRoom,
}

/// What happened that the checks and the drivers look at.
#[derive(Clone, Debug, Default)]
pub struct Happened {
    /// A launcher pod admitted at CREATE (its UID) and whether a hold is recorded for it.
    pub admitted: Option<(String, bool)>,
    /// A pod CREATE refused.
    pub refused: bool,
    /// What a binding came to.
    pub bound: Option<Bound>,
    /// VMIs the planner retried.
    pub retried: Vec<String>,
    /// The planner could not write some promise.
    pub plan_failed: bool,
    /// The replica that decided.
    pub decided_by: Option<usize>,
    /// VMIs that got a key (a hold of their own) with this action.
    pub served: Vec<String>,
    /// The write-behind could not write some node's holds.
    pub behind_failed: bool,
    /// The VMI a client created.
    pub new_vmi: Option<String>,
    /// A VMI whose pod was created and whose status virt-controller writes later.
    pub status_due: Option<String>,
}

/// The world.
pub struct World {
    /// The shape.
    pub spec: Spec,
    /// Now, in milliseconds since [`epoch`].
    pub now: u64,
    clock: Arc<AtomicI64>,
    /// The API server.
    pub truth: Arc<Mutex<Truth>>,
    /// The webhook replicas.
    pub replicas: Vec<Replica>,
    /// An index fed at once with every change: what a replica would know with instant watches.
    pub oracle: KeyIndex,
    /// The configuration every replica runs with.
    pub config: Arc<Config>,
    /// Watch delays are random within this (ms); the drivers set it.
    pub max_delay: u64,
    /// virt-controller writes a VMI's status after its pod's CREATE within this (ms; 0: at once, in
    /// the same step); the drivers set it.
    pub status_lag: u64,
    /// Changes the API server made so far (what the oracle knows changes only with them).
    pub changes: u64,
    /// Kinds whose watches deliver at once (the model checker keeps some kinds in step to stay
    /// small).
    pub instant: [bool; KINDS],
    /// The model checker's world: no oracle (it builds one from the truth when it needs one), and
    /// decisions known to come out the same are not made again.
    pub model: bool,
    /// Per (VMI or pod, replica): the replica's index (fingerprint) when it last refused it: the
    /// same index refuses it again, so the model checker skips that step.
    pub refused_with: BTreeMap<(String, usize), u64>,
    rng: u64,
}

/// One VMI's pod spec: KubeVirt's node selector for its kind.
pub fn placement(kind: TeeKind) -> PodSpec {
    PodSpec {
        node_selector: Some(BTreeMap::from([(
            kind_label(kind).to_string(),
            "true".to_string(),
        )])),
        ..PodSpec::default()
    }
}

fn kind_label(kind: TeeKind) -> &'static str {
    match kind {
        TeeKind::Tdx => "kubevirt.io/tdx",
        TeeKind::Sev => "kubevirt.io/sev",
        TeeKind::SevEs => "kubevirt.io/sev-es",
    }
}

impl World {
    /// A world of `spec`, seeded with `seed`; every replica synced.
    pub fn new(spec: Spec, seed: u64) -> World {
        let clock = Arc::new(AtomicI64::new(0));
        let config = Config::default();
        let truth = Truth {
            rev: 0,
            nodes: spec
                .nodes
                .iter()
                .map(|n| {
                    let truth = NodeTruth {
                        spec: *n,
                        published: None,
                        published_rev: 0,
                        holds: None,
                        first_counted: BTreeMap::new(),
                        charged: BTreeSet::new(),
                    };
                    (n.name.to_string(), truth)
                })
                .collect(),
            pods: BTreeMap::new(),
            gone_pods: BTreeMap::new(),
            vmis: BTreeMap::new(),
            api_down: false,
            lease: None,
            blind_lists: spec.defect == Defect::NoCatchUp,
            outbox: Vec::new(),
            next: 0,
        };
        let mut w = World {
            now: 0,
            oracle: KeyIndex::new(config.admission.ledger_ttl, sim_clock(&clock)),
            clock,
            truth: Arc::new(Mutex::new(truth)),
            replicas: Vec::new(),
            config: Arc::new(config),
            spec,
            max_delay: 0,
            status_lag: 0,
            changes: 0,
            instant: [false; KINDS],
            model: false,
            refused_with: BTreeMap::new(),
            rng: seed ^ 0x9e37_79b9_7f4a_7c15,
        };
        for n in &w.spec.nodes {
            w.oracle
                .update(|ix, _| ix.apply_node(n.name, Some(node_labels(n))));
        }
        for i in 0..w.spec.replicas {
            let r = w.fresh_replica(i);
            w.replicas.push(r);
        }
        // The agents' first reports.
        let nodes: Vec<String> = w.spec.nodes.iter().map(|n| n.name.to_string()).collect();
        for n in nodes {
            w.publish(&n);
        }
        w.distribute();
        for r in &mut w.replicas {
            deliver_all(r);
        }
        w.oracle.update(|ix, _| ix.set_synced());
        w
    }

    fn fresh_replica(&self, i: usize) -> Replica {
        let index = KeyIndex::new(self.config.admission.ledger_ttl, sim_clock(&self.clock));
        let terms = match self.spec.defect {
            // Takes over as soon as it sees a record (and keeps deciding as long as the holder).
            Defect::NoLeaseWait => Terms {
                lease: Duration::from_millis(1),
                renew_deadline: Duration::from_secs(60),
                retry: Duration::from_secs(2),
            },
            _ => Terms::of_lease(LEASE),
        };
        let leadership = Leadership::new(
            Elector::new(identity(i), i.to_string(), terms),
            sim_clock(&self.clock),
        );
        // Every Node exists, labelled as virt-handler labels its kind.
        for n in &self.spec.nodes {
            index.update(|ix, _| ix.apply_node(n.name, Some(node_labels(n))));
        }
        let mut r = Replica {
            index,
            hints: FitHints::default(),
            alive: true,
            queues: Default::default(),
            dropped: [false; KINDS],
            synced: true,
            started_at: self.now,
            listed_at: [self.now; KINDS],
            leadership,
            stopped: false,
        };
        // A fresh replica lists every object.
        for c in self.snapshot(None) {
            c.apply(&r.index);
        }
        r.index.update(|ix, _| ix.set_synced());
        r.synced = true;
        r.queues = Default::default();
        r
    }

    /// The truth as changes (`kind`: of one kind only).
    fn snapshot(&self, kind: Option<usize>) -> Vec<Change> {
        let t = lock(&self.truth);
        let mut out = Vec::new();
        for (name, n) in &t.nodes {
            out.push(Change::Holds(name.clone(), n.holds.clone()));
            if let Some(p) = &n.published {
                let report = report_object(name, p, n.published_rev);
                out.push(Change::Report(Box::new(report)));
            }
        }
        for (uid, p) in &t.pods {
            out.push(Change::Pod(uid.clone(), Some(pod_object(uid, p))));
        }
        for (uid, v) in &t.vmis {
            let obj = v.deleted_at.is_none().then(|| vmi_object(uid, v, self.now));
            out.push(Change::Vmi(uid.clone(), obj));
        }
        for uid in t.gone_pods.keys() {
            out.push(Change::Pod(uid.clone(), None));
        }
        out.retain(|c| kind.is_none_or(|k| c.kind() == k));
        out
    }

    /// A pseudo-random number below `n` (SplitMix64).
    pub fn rand(&mut self, n: u64) -> u64 {
        self.rng = self.rng.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) % n.max(1)
    }

    /// Move the clock to `ms`.
    pub fn advance(&mut self, ms: u64) {
        self.now = self.now.max(ms);
        self.clock.store(self.now as i64, Ordering::SeqCst);
    }

    /// The truth, locked.
    pub fn truth(&self) -> MutexGuard<'_, Truth> {
        lock(&self.truth)
    }

    /// Hand the changes the API server made to every watch: the oracle at once, each replica's queue
    /// with a delay (in order per kind).
    pub fn distribute(&mut self) {
        let changes = std::mem::take(&mut self.truth().outbox);
        self.changes += changes.len() as u64;
        for c in changes {
            if !self.model {
                c.apply(&self.oracle);
            }
            for i in 0..self.replicas.len() {
                let delay = if self.max_delay == 0 {
                    0
                } else {
                    1 + self.rand(self.max_delay)
                };
                let r = &mut self.replicas[i];
                if !r.alive || r.dropped[c.kind()] {
                    continue;
                }
                if self.instant[c.kind()] {
                    c.apply(&r.index);
                    continue;
                }
                let q = &mut r.queues[c.kind()];
                let due = q.back().map_or(0, |(d, _)| *d).max(self.now + delay);
                q.push_back((due, c.clone()));
            }
        }
    }

    /// The balancer's choice of a live replica for a webhook call (`None`: every replica is down).
    pub fn pick_replica(&mut self) -> Option<usize> {
        let alive: Vec<usize> = (0..self.replicas.len())
            .filter(|i| self.replicas[*i].alive)
            .collect();
        if alive.is_empty() {
            return None;
        }
        let at = self.rand(alive.len() as u64) as usize;
        Some(alive[at])
    }

    /// Do `a`; what the checks need to know of it.
    pub fn act(&mut self, a: &Action) -> Happened {
        let mut happened = Happened::default();
        // Only these give a VMI a key.
        let serves = matches!(a, Action::Create(..) | Action::Plan(_) | Action::Bind(..));
        // The VMIs that may get a key: those without a pod yet.
        let podless: Vec<String> = if serves {
            let t = self.truth();
            t.vmis
                .iter()
                .filter(|(_, v)| v.deleted_at.is_none() && v.pod.is_none())
                .map(|(u, _)| u.clone())
                .collect()
        } else {
            Vec::new()
        };
        let judge = match a {
            Action::Create(_, r) | Action::Plan(r) | Action::Bind(_, r) if self.model => Some(*r),
            _ => None,
        };
        let before = self.served_vmis(&podless, judge);
        match a {
            Action::NewVmi(kind) => happened.new_vmi = Some(self.new_vmi(*kind)),
            Action::Create(vmi, r) => self.create(vmi, *r, &mut happened),
            Action::VmiStatus(vmi) => self.write_status(vmi),
            Action::Bind(pod, r) => happened.bound = self.bind(pod, *r),
            Action::Start(pod) => self.start(pod),
            Action::Publish(node) => self.publish(node),
            Action::Plan(r) => {
                (happened.retried, happened.plan_failed) = self.plan(*r);
                happened.decided_by = Some(*r);
            }
            Action::Deliver(r, k) => {
                let rep = &mut self.replicas[*r];
                if let Some((_, c)) = rep.queues[*k].pop_front() {
                    c.apply(&rep.index);
                }
            }
            Action::CatchUp(r, k) => self.catch_up(*r, *k),
            Action::DeleteVmi(vmi) => self.delete_vmi(vmi),
            Action::Reap(pod) => self.reap(pod),
            Action::Crash(r) => {
                let rep = &mut self.replicas[*r];
                rep.alive = false;
                rep.queues = Default::default();
            }
            Action::Stop(r) => self.stop(*r),
            Action::Restart(r) => self.replicas[*r] = self.fresh_replica(*r),
            Action::Renew(r) => self.renew(*r),
            Action::LeaseRunsOut => self.lease_runs_out(),
            Action::WriteBehind(r) => happened.behind_failed = self.write_behind(*r),
            Action::DropWatch(r, k) => {
                let rep = &mut self.replicas[*r];
                rep.dropped[*k] = true;
                rep.queues[*k].clear();
            }
            Action::Relist(r, k) => self.relist(*r, *k),
            Action::ApiDown => self.truth().api_down = true,
            Action::ApiUp => self.truth().api_down = false,
        }
        self.distribute();
        if serves {
            let after = self.served_vmis(&podless, judge);
            happened.served = after.difference(&before).cloned().collect();
        }
        happened
    }

    /// Those of `vmis` with a live hold of their own, as the oracle sees them (the model checker:
    /// as replica `judge` does).
    fn served_vmis(&self, vmis: &[String], judge: Option<usize>) -> BTreeSet<String> {
        let index = match judge {
            Some(r) if r < self.replicas.len() => &self.replicas[r].index,
            _ => &self.oracle,
        };
        let ix = index.read();
        let now = index.now();
        vmis.iter()
            .filter(|uid| ix.vmi_holds(uid, now))
            .cloned()
            .collect()
    }

    fn relist(&mut self, r: usize, k: usize) {
        let changes = self.snapshot(Some(k));
        let now = self.now;
        let rep = &mut self.replicas[r];
        rep.dropped[k] = false;
        rep.listed_at[k] = now;
        rep.queues[k].clear();
        // The objects the replica held that the list no longer shows were deleted meanwhile.
        if k == HOLDS {
            let listed: BTreeSet<String> = changes
                .iter()
                .filter_map(|c| match c {
                    Change::Holds(n, Some(_)) => Some(n.clone()),
                    _ => None,
                })
                .collect();
            let known: Vec<String> = rep
                .index
                .read()
                .nodes()
                .filter(|(_, s)| s.holds.is_some())
                .map(|(n, _)| n.to_string())
                .collect();
            for n in known.into_iter().filter(|n| !listed.contains(n)) {
                Change::Holds(n, None).apply(&rep.index);
            }
        }
        for c in changes {
            c.apply(&rep.index);
        }
    }

    fn new_vmi(&mut self, kind: TeeKind) -> String {
        let now = self.now;
        let mut t = self.truth();
        t.next += 1;
        let uid = format!("vmi-{:04}", t.next);
        let v = VmiTruth {
            name: uid.clone(),
            kind,
            refused_at: None,
            message: None,
            pod: None,
            status_pod: None,
            deleted_at: None,
            retried: 0,
            refusals: 0,
            created_at: now,
            pods: 0,
        };
        let obj = vmi_object(&uid, &v, now);
        t.vmis.insert(uid.clone(), v);
        t.outbox.push(Change::Vmi(uid.clone(), Some(obj)));
        uid
    }

    /// virt-controller creates `vmi`'s pod; replica `r` reviews it (`r` past the replicas: the
    /// balancer's pick).
    fn create(&mut self, vmi: &str, r: usize, happened: &mut Happened) {
        let (kind, name) = {
            let t = self.truth();
            let Some(v) = t.vmis.get(vmi) else {
                return;
            };
            if v.deleted_at.is_some() || v.pod.is_some() {
                return;
            }
            (v.kind, v.name.clone())
        };
        let r = if r < self.replicas.len() && self.replicas[r].alive {
            Some(r)
        } else {
            self.pick_replica()
        };
        let pod_uid = {
            let t = self.truth();
            format!("{vmi}-pod-{}", t.vmis[vmi].pods + 1)
        };
        let Some(r) = r else {
            // Every replica down: the API server cannot call the webhook (failurePolicy Fail).
            let msg = "failed to create virtual machine pod: Internal error occurred: failed calling webhook \"validate.pods.teeguard.dev\": connection refused".to_string();
            self.refuse(vmi, msg);
            happened.refused = true;
            return;
        };
        let r = match self.decider(r, true) {
            Ok(d) => d,
            Err(why) => {
                let mut message = format!("{why}; {}", teeguard_webhook::decide::validation::HINT);
                note_refusal(reason::NO_DECIDER, Some(&mut message));
                let quoted = format!(
                    "failed to create virtual machine pod: admission webhook \"validate.pods.teeguard.dev\" denied the request: {message}"
                );
                self.refuse(vmi, quoted);
                happened.refused = true;
                return;
            }
        };
        happened.decided_by = Some(r);
        let requests = KeyRequests::from([(kind, 1)]);
        let spec = placement(kind);
        let pod_name = format!("vms/virt-launcher-{name}");
        let vmi_name = format!("vms/{name}");
        let ask = Ask {
            claimant: Claimant {
                pod_uid: &pod_uid,
                vmi_uid: vmi,
            },
            pod: &pod_name,
            vmi: &vmi_name,
            requests: &requests,
            mode: teeguard_shared::config::Mode::Enforce,
            policy: Trigger::PodCreate.stale_policy(&self.config.admission),
            dry_run: false,
            stale_after: self.config.admission.stale_report_after,
            replica: &format!("replica-{r}"),
        };
        let rep = &self.replicas[r];
        let checker = Checker {
            index: &rep.index,
            hints: &rep.hints,
            config: &self.config,
            labels_known: true,
        };
        let decision = check(&checker, &ask, Target::Candidates(&spec));
        if !decision.allowed {
            if self.model {
                let fp = self.index_fingerprint(r);
                self.refused_with.insert((vmi.to_string(), r), fp);
            }
            let mut message = decision.message.unwrap_or_default();
            note_refusal(decision.reason, Some(&mut message));
            let quoted = format!(
                "failed to create virtual machine pod: admission webhook \"validate.pods.teeguard.dev\" denied the request: {message}"
            );
            self.refuse(vmi, quoted);
            happened.refused = true;
            return;
        }
        if self.truth().api_down {
            // The pod cannot be persisted; the next CREATE is another request, with another UID.
            self.truth().vmis.get_mut(vmi).expect("vmi").pods += 1;
            happened.refused = true;
            return;
        }
        let now = self.now;
        // Held where nobody else decides, in the decider's index.
        let held_by_decider = {
            let ix = &self.replicas[r].index;
            let claimant = Claimant {
                pod_uid: &pod_uid,
                vmi_uid: vmi,
            };
            ix.read()
                .own_hold(claimant, ix.now())
                .is_some_and(|(_, e)| e.pod_uid == pod_uid)
        };
        let mut t = self.truth();
        let recorded = held_by_decider
            || t.nodes.values().any(|n| {
                n.holds
                    .as_ref()
                    .is_some_and(|o| o.spec.reservations.iter().any(|e| e.pod_uid == pod_uid))
            });
        let pod = PodTruth {
            name: format!("virt-launcher-{name}"),
            vmi: vmi.to_string(),
            kind,
            node: None,
            deleting: false,
            unschedulable: false,
            refused_bindings: 0,
            admitted_at: now,
        };
        t.outbox.push(Change::Pod(
            pod_uid.clone(),
            Some(pod_object(&pod_uid, &pod)),
        ));
        t.pods.insert(pod_uid.clone(), pod);
        let v = t.vmis.get_mut(vmi).expect("vmi");
        v.pod = Some(pod_uid.clone());
        v.pods += 1;
        drop(t);
        if self.status_lag == 0 {
            self.write_status(vmi);
        } else {
            happened.status_due = Some(vmi.to_string());
        }
        happened.admitted = Some((pod_uid, recorded));
    }

    /// The replica that decides a review replica `r` received (itself, or the holder it forwards
    /// to), or why nobody does.
    fn decider(&self, r: usize, create: bool) -> Result<usize, String> {
        if self.spec.defect == Defect::EveryReplicaDecides {
            return Ok(r);
        }
        let route = |i: usize| -> Result<Route, String> {
            let rep = &self.replicas[i];
            if create && self.spec.defect != Defect::NoOrphanGate {
                rep.leadership.route_create(&rep.index).map_err(|n| {
                    format!("the new decider waits for {n} launcher pod(s) admitted before it")
                })
            } else {
                Ok(rep.leadership.route())
            }
        };
        match route(r)? {
            Route::Here => Ok(r),
            Route::Nobody => Err("no teeguard replica decides right now".into()),
            Route::Forward(address) => {
                let h: usize = address
                    .parse()
                    .expect("the simulation's addresses are indexes");
                if h >= self.replicas.len() || !self.replicas[h].alive {
                    return Err(format!("the deciding replica {h} did not answer"));
                }
                match route(h)? {
                    Route::Here => Ok(h),
                    _ => Err(format!(
                        "replica {h} was sent the review but does not decide"
                    )),
                }
            }
        }
    }

    /// Replica `r` reads the Lease and writes it when its elector says so; in a term it has just
    /// taken, it lists the holds before it decides (`Leadership::catch_up`, as `Leadership::run`).
    fn renew(&mut self, r: usize) {
        if !self.replicas[r].alive {
            return;
        }
        let mut t = lock(&self.truth);
        if t.api_down {
            return;
        }
        let rep = &self.replicas[r];
        if let Some(next) = rep.leadership.round(t.lease.clone()) {
            t.lease = Some(next.clone());
            rep.leadership.written(next, at(self.now));
        }
        drop(t);
        let store = SimStore(&self.truth);
        // A failed list (the API server down) is tried again at the next round.
        let _ = futures::executor::block_on(rep.leadership.catch_up(
            &rep.index,
            &store,
            Duration::from_secs(2),
        ));
    }

    /// Whether replica `r` may take the Lease if it read it now: it is alive and does not decide, and
    /// the Lease was given up (or never taken) or its holder does not decide (it crashed, or restarted:
    /// the Lease is taken once it has run out, [`Action::LeaseRunsOut`]). The model checker's renewals.
    pub fn may_take_lease(&self, r: usize) -> bool {
        let rep = &self.replicas[r];
        if !rep.alive || rep.leadership.deciding() {
            return false;
        }
        self.holder_gone() != Some(false)
    }

    /// Whether the Lease's holder is gone: `Some(true)` when it names a replica that does not decide
    /// (crashed, or restarted and waiting its own old Lease out), `None` when it names nobody.
    pub fn holder_gone(&self) -> Option<bool> {
        let t = self.truth();
        let holder = t
            .lease
            .as_ref()
            .map(|l| l.holder.as_str())
            .filter(|h| !h.is_empty())?;
        let deciding = (0..self.replicas.len()).any(|r| {
            let rep = &self.replicas[r];
            identity(r) == holder && rep.alive && rep.leadership.deciding()
        });
        Some(!deciding)
    }

    /// [`Action::LeaseRunsOut`]: the lease duration (15 s) passes in an otherwise healthy cluster. The
    /// agents publish what changed (they poll every second: a bound pod is counted as `pending`), the
    /// live replicas' watches deliver everything on its way, and every replica reads the Lease (it
    /// counts the lease duration from there); then the clock moves on by that duration.
    fn lease_runs_out(&mut self) {
        let nodes: Vec<String> = self.truth().nodes.keys().cloned().collect();
        for n in nodes {
            self.publish(&n);
        }
        self.distribute();
        for r in 0..self.replicas.len() {
            if self.replicas[r].alive {
                for k in 0..KINDS {
                    self.catch_up(r, k);
                }
            }
            self.renew(r);
        }
        self.advance(self.now + LEASE.as_millis() as u64);
    }

    /// Replica `r`'s watch of kind `k` delivers everything on its way.
    fn catch_up(&mut self, r: usize, k: usize) {
        let rep = &mut self.replicas[r];
        while let Some((_, c)) = rep.queues[k].pop_front() {
            c.apply(&rep.index);
        }
    }

    /// Replica `r` stops as the webhook does (`app.rs`): its last reviews answered, the write-behind's
    /// last pass, then the Lease given up.
    fn stop(&mut self, r: usize) {
        if !self.replicas[r].alive {
            return;
        }
        // The Lease is kept when the last holds could not be written (`Leadership::keep_at_stop`).
        let failed = self.write_behind(r);
        let mut t = lock(&self.truth);
        let released = self.replicas[r].leadership.give_up(t.lease.clone());
        if let Some(record) = released.filter(|_| !t.api_down && !failed) {
            t.lease = Some(record);
        }
        drop(t);
        let rep = &mut self.replicas[r];
        rep.alive = false;
        rep.stopped = true;
        rep.queues = Default::default();
    }

    /// The decider writes its holds behind; whether a write failed.
    fn write_behind(&mut self, r: usize) -> bool {
        if !self.replicas[r].alive || self.spec.defect == Defect::NoWriteBehind {
            return false;
        }
        let store = SimStore(&self.truth);
        futures::executor::block_on(write_behind_once(
            &self.replicas[r].index,
            &store,
            Duration::from_secs(2),
            None,
        ))
    }

    /// virt-controller writes what it did into the VMI's status: its pod, the refusal condition gone.
    fn write_status(&mut self, vmi: &str) {
        let now = self.now;
        let mut t = self.truth();
        let Some(v) = t.vmis.get_mut(vmi) else {
            return;
        };
        if v.deleted_at.is_some() || v.status_pod == v.pod {
            return;
        }
        v.status_pod = v.pod.clone();
        v.message = None;
        let obj = vmi_object(vmi, v, now);
        t.outbox.push(Change::Vmi(vmi.to_string(), Some(obj)));
    }

    fn refuse(&mut self, vmi: &str, message: String) {
        let now = self.now;
        let mut t = self.truth();
        let v = t.vmis.get_mut(vmi).expect("vmi");
        v.refusals += 1;
        let first = v.refused_at.is_none();
        if first {
            v.refused_at = Some(now);
        }
        if first || v.message.as_deref() != Some(message.as_str()) {
            v.message = Some(message);
            let obj = vmi_object(vmi, v, now);
            t.outbox.push(Change::Vmi(vmi.to_string(), Some(obj)));
        }
    }

    /// The node the scheduler picks for `pod`: a node of its kind whose static capacity (as NFD or
    /// KubeVirt's device plugin advertises it, blind to keys held outside Kubernetes) still has room
    /// for the pods bound there.
    pub fn schedulable(&self, pod: &str) -> Vec<String> {
        let t = self.truth();
        let Some(p) = t.pods.get(pod) else {
            return Vec::new();
        };
        t.nodes
            .values()
            .filter(|n| n.spec.kind == p.kind)
            .filter(|n| {
                let bound = t
                    .pods
                    .values()
                    .filter(|q| q.node.as_deref() == Some(n.spec.name))
                    .count() as u64;
                bound < n.spec.capacity
            })
            .map(|n| n.spec.name.to_string())
            .collect()
    }

    fn bind(&mut self, pod: &str, r: usize) -> Option<Bound> {
        let nodes = self.schedulable(pod);
        let (unbound, deleting) = {
            let t = self.truth();
            match t.pods.get(pod) {
                Some(p) => (p.node.is_none(), p.deleting),
                None => return None,
            }
        };
        if !unbound || deleting {
            return None;
        }
        if nodes.is_empty() {
            let mut t = self.truth();
            t.pods.get_mut(pod).expect("pod").unschedulable = true;
            return Some(Bound::NoRoom);
        }
        let node = nodes[self.rand(nodes.len() as u64) as usize].clone();
        let r = if r < self.replicas.len() && self.replicas[r].alive {
            Some(r)
        } else {
            self.pick_replica()
        };
        let allowed = match r {
            // Every replica down: the binding webhook's failurePolicy is Ignore.
            None => true,
            Some(r) => match self.decider(r, false) {
                Err(_) => false,
                Ok(r) => {
                    let (vmi, name) = {
                        let t = self.truth();
                        let p = &t.pods[pod];
                        (p.vmi.clone(), p.name.clone())
                    };
                    let kind = self.truth().pods[pod].kind;
                    let requests = KeyRequests::from([(kind, 1)]);
                    let pod_name = format!("vms/{name}");
                    let ask = Ask {
                        claimant: Claimant {
                            pod_uid: pod,
                            vmi_uid: &vmi,
                        },
                        pod: &pod_name,
                        vmi: &vmi,
                        requests: &requests,
                        mode: teeguard_shared::config::Mode::Enforce,
                        policy: Trigger::Binding.stale_policy(&self.config.admission),
                        dry_run: false,
                        stale_after: self.config.admission.stale_report_after,
                        replica: &format!("replica-{r}"),
                    };
                    let rep = &self.replicas[r];
                    let checker = Checker {
                        index: &rep.index,
                        hints: &rep.hints,
                        config: &self.config,
                        labels_known: true,
                    };
                    let target = Target::Node(&node, Trigger::Binding);
                    check(&checker, &ask, target).allowed
                }
            },
        };
        let mut t = self.truth();
        if t.api_down {
            // The binding cannot be persisted either.
            return Some(Bound::Refused);
        }
        let p = t.pods.get_mut(pod).expect("pod");
        if !allowed {
            p.refused_bindings += 1;
            drop(t);
            if let (true, Some(r)) = (self.model, r) {
                let fp = self.index_fingerprint(r);
                self.refused_with.insert((pod.to_string(), r), fp);
            }
            return Some(Bound::Refused);
        }
        p.node = Some(node);
        p.unschedulable = false;
        let obj = pod_object(pod, p);
        t.outbox.push(Change::Pod(pod.to_string(), Some(obj)));
        Some(Bound::Yes)
    }

    fn start(&mut self, pod: &str) {
        let mut t = self.truth();
        let Some(node) = t.pods.get(pod).and_then(|p| p.node.clone()) else {
            return;
        };
        let n = t.nodes.get_mut(&node).expect("node");
        // The kernel charges the key whatever it is asked: the checks count what it holds.
        n.charged.insert(pod.to_string());
    }

    /// The agent's report of `node` now.
    pub fn report_now(&self, node: &str) -> TeeCapacityStatus {
        let now = self.now;
        let t = self.truth();
        let n = &t.nodes[node];
        let bound: Vec<&String> = t
            .pods
            .iter()
            .filter(|(_, p)| p.node.as_deref() == Some(node))
            .map(|(u, _)| u)
            .collect();
        let used = n.charged.len() as u64 + n.spec.external;
        let pending = bound.iter().filter(|u| !n.charged.contains(**u)).count() as u64;
        // As the agent: every pod it counts (pending or charged), newest first, at most 64.
        let mut counted: Vec<(u64, String)> = bound
            .iter()
            .map(|u| {
                (
                    n.first_counted.get(*u).copied().unwrap_or(now),
                    (*u).clone(),
                )
            })
            .collect();
        counted.sort_by(|a, b| b.cmp(a));
        let mut status = TeeCapacityStatus {
            heartbeat_time: None,
            counted_pods: counted.into_iter().take(64).map(|(_, u)| u).collect(),
            ..TeeCapacityStatus::default()
        };
        *status.kind_mut(n.spec.kind) = Some(KindStatus {
            resource_name: "keys".into(),
            capacity: n.spec.capacity,
            kernel_used: used.min(n.spec.capacity),
            pods_used: n.charged.len() as u64,
            external: n.spec.external,
            pending,
            free: n.spec.capacity.saturating_sub(used + pending),
            ..KindStatus::default()
        });
        status
    }

    /// Whether the agent of `node` has news to publish.
    pub fn report_changed(&self, node: &str) -> bool {
        let fresh = self.report_now(node);
        self.truth().nodes[node].published.as_ref() != Some(&fresh)
    }

    fn publish(&mut self, node: &str) {
        let mut status = self.report_now(node);
        let now = self.now;
        let mut t = self.truth();
        if t.nodes[node].published.as_ref() == Some(&status) {
            return;
        }
        let n = t.nodes.get_mut(node).expect("node");
        for uid in &status.counted_pods {
            n.first_counted.entry(uid.clone()).or_insert(now);
        }
        n.published = Some(status.clone());
        t.rev += 1;
        let rev = t.rev;
        t.nodes.get_mut(node).expect("node").published_rev = rev;
        // Current for as long as the simulation runs (staleness is not what this tests).
        status.heartbeat_time = Some(Time(
            epoch()
                .checked_add(SignedDuration::from_hours(24 * 365))
                .expect("t"),
        ));
        t.outbox
            .push(Change::Report(Box::new(report_object(node, &status, rev))));
    }

    fn plan(&mut self, r: usize) -> (Vec<String>, bool) {
        if !self.replicas[r].alive {
            return (Vec::new(), false);
        }
        // Only the decider plans, once it found no orphan launcher pod.
        if self.spec.defect != Defect::EveryReplicaDecides {
            let rep = &self.replicas[r];
            let route = if self.spec.defect == Defect::NoOrphanGate {
                Ok(rep.leadership.route())
            } else {
                rep.leadership.route_create(&rep.index)
            };
            if route != Ok(Route::Here) {
                return (Vec::new(), false);
            }
        }
        let store = SimStore(&self.truth);
        let rep = &self.replicas[r];
        // The model checker has no time: its planner may trim at any step (every order of it).
        let quiet = if self.model {
            Duration::ZERO
        } else {
            teeguard_webhook::cluster::retry::TIDY_AFTER
        };
        let untidy = futures::executor::block_on(tidy(
            &rep.index,
            &store,
            quiet,
            Duration::from_secs(2),
            None,
        ));
        // The decider keeps its promises in its index, written behind (as the product's Retrier).
        let promised = promise(&rep.index, &self.config, &format!("replica-{r}"));
        let now = self.now;
        let mut retried = Vec::new();
        // A promise whose VMI could not be annotated is withdrawn and the pass tried again shortly.
        let mut unannotated = false;
        for p in promised {
            // The annotation: one TEEKeyFree Event; virt-controller syncs the VMI at once (the
            // drivers schedule its CREATE). A VMI deleted meanwhile cannot be annotated: the promise
            // is withdrawn, as the planner does.
            let annotated = {
                let mut t = self.truth();
                let down = t.api_down;
                match t.vmis.get_mut(&p.vmi.uid) {
                    Some(v) if v.deleted_at.is_none() && !down => {
                        v.retried += 1;
                        let obj = vmi_object(&p.vmi.uid, v, now);
                        t.outbox.push(Change::Vmi(p.vmi.uid.clone(), Some(obj)));
                        true
                    }
                    _ => false,
                }
            };
            if annotated {
                retried.push(p.vmi.uid.clone());
            } else {
                unannotated = true;
                let rep = &self.replicas[r];
                let _ = futures::executor::block_on(withdraw(
                    &rep.index,
                    &store,
                    &p.node,
                    &p.vmi.uid,
                    Duration::from_secs(2),
                    None,
                ));
            }
        }
        (retried, untidy || unannotated)
    }

    fn delete_vmi(&mut self, vmi: &str) {
        let now = self.now;
        let mut t = self.truth();
        let Some(v) = t.vmis.get_mut(vmi) else {
            return;
        };
        if v.deleted_at.is_some() {
            return;
        }
        v.deleted_at = Some(now);
        let pod = v.pod.clone();
        t.outbox.push(Change::Vmi(vmi.to_string(), None));
        if let Some(p) = pod.and_then(|p| t.pods.get_mut(&p)) {
            p.deleting = true;
        }
    }

    fn reap(&mut self, pod: &str) {
        let now = self.now;
        let mut t = self.truth();
        let Some(p) = t.pods.remove(pod) else {
            return;
        };
        if let Some(node) = &p.node {
            t.nodes.get_mut(node).expect("node").charged.remove(pod);
        }
        t.gone_pods.insert(pod.to_string(), now);
        t.outbox.push(Change::Pod(pod.to_string(), None));
    }

    /// A hash of the whole state, for the model checker: what decides what happens next, not how it
    /// came about (no `resourceVersion` numbers, only whether a replica's copy of a node's object is
    /// the current one; no retry counts; a watch's undelivered changes only as "behind").
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fx(0);
        let t = self.truth();
        t.api_down.hash(&mut h);
        t.lease.as_ref().map(|l| l.holder.is_empty()).hash(&mut h);
        // The model checker's clock moves only when a crashed decider's Lease runs out.
        self.now.hash(&mut h);
        for (name, n) in &t.nodes {
            name.hash(&mut h);
            if let Some(p) = &n.published {
                for kind in TeeKind::ALL {
                    p.kind(kind).map(|k| (k.free, k.pending)).hash(&mut h);
                }
                p.counted_pods.hash(&mut h);
            }
            if let Some(o) = &n.holds {
                for e in &o.spec.reservations {
                    (&e.pod_uid, &e.vmi_uid, e.reason, e.tdx, e.sev, e.sev_es).hash(&mut h);
                }
            }
            n.charged.hash(&mut h);
            n.first_counted.hash(&mut h);
        }
        for (uid, p) in &t.pods {
            (uid, &p.vmi, &p.node, p.deleting, p.unschedulable).hash(&mut h);
        }
        t.gone_pods.hash(&mut h);
        for (uid, v) in &t.vmis {
            let waits = v.message.as_deref().is_some_and(queue::ends_by_itself);
            (
                uid,
                v.refused_at.is_some(),
                waits,
                &v.pod,
                &v.status_pod,
                v.deleted_at,
                v.pods,
            )
                .hash(&mut h);
        }
        // Replicas are alike: the world is the same whichever holds which view.
        let mut replicas: Vec<u64> = Vec::new();
        for r in &self.replicas {
            let mut h = Fx(0);
            r.alive.hash(&mut h);
            if !r.alive {
                replicas.push(h.finish());
                continue;
            }
            r.index.read().fingerprint(&mut h);
            // Whether it decides, and whether it has caught up (a decider lists before it decides).
            let route = r.leadership.route();
            (route == Route::Here, route == Route::Nobody).hash(&mut h);
            for (name, n) in &t.nodes {
                let current = n
                    .holds
                    .as_ref()
                    .and_then(|o| o.metadata.resource_version.clone());
                let seen = r
                    .index
                    .read()
                    .node(name)
                    .and_then(|s| s.holds.as_ref()?.metadata.resource_version.clone());
                (current == seen).hash(&mut h);
            }
            for q in &r.queues {
                q.is_empty().hash(&mut h);
            }
            r.dropped.hash(&mut h);
            replicas.push(h.finish());
        }
        replicas.sort_unstable();
        replicas.hash(&mut h);
        h.finish()
    }

    /// The fingerprint of replica `r`'s index.
    pub fn index_fingerprint(&self, r: usize) -> u64 {
        let mut h = Fx(0);
        self.replicas[r].index.read().fingerprint(&mut h);
        // Holds end by time too (the model checker's clock moves when a Lease runs out).
        self.now.hash(&mut h);
        h.finish()
    }

    /// An index of the API server's truth as it is (the model checker's oracle, built when needed).
    pub fn truth_index(&self) -> KeyIndex {
        let ix = KeyIndex::new(self.config.admission.ledger_ttl, self.oracle_clock());
        for n in &self.spec.nodes {
            ix.update(|i, _| i.apply_node(n.name, Some(node_labels(n))));
        }
        for c in self.snapshot(None) {
            c.apply(&ix);
        }
        ix.update(|i, _| i.set_synced());
        ix
    }

    fn oracle_clock(&self) -> Clock {
        sim_clock(&self.clock)
    }

    /// What each part of the world holds now, for a failure's report.
    pub fn describe(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!("lease: {:?}\n", self.truth().lease));
        let stale = self.config.admission.stale_report_after;
        for (who, index) in std::iter::once(("oracle".to_string(), &self.oracle)).chain(
            self.replicas
                .iter()
                .enumerate()
                .filter(|(_, r)| r.alive)
                .map(|(i, r)| {
                    let lead = format!(", routes {:?}", r.leadership.route());
                    (
                        format!("replica {i} (dropped {:?}{lead})", r.dropped),
                        &r.index,
                    )
                }),
        ) {
            let ix = index.read();
            let now = index.now();
            out.push_str(&format!("{who}:\n"));
            for (node, n) in ix.nodes() {
                let free = n.report.as_deref().map(|r| {
                    TeeKind::ALL
                        .iter()
                        .filter_map(|k| r.kind(*k).map(|s| s.free))
                        .sum::<u64>()
                });
                let live: Vec<String> = ix
                    .live(node, now)
                    .map(|e| format!("{:?}:{}/{}", e.reason(), e.pod_uid, e.vmi_uid))
                    .collect();
                out.push_str(&format!("  {node}: free {free:?}, live holds {live:?}\n"));
            }
            let waiting: Vec<&str> = ix
                .waiting(None, now)
                .iter()
                .map(|w| w.vmi.uid.as_str())
                .collect();
            let plan: Vec<String> =
                teeguard_webhook::decide::admit::promises(&ix, |_| 1, stale, now)
                    .iter()
                    .map(|p| format!("{}->{}", p.waiting.vmi.uid, p.node))
                    .collect();
            out.push_str(&format!("  waiting {waiting:?}; plan {plan:?}\n"));
        }
        out
    }

    /// A copy of the world to explore another order from.
    pub fn fork(&self) -> World {
        let clock = Arc::new(AtomicI64::new(self.now as i64));
        World {
            spec: self.spec.clone(),
            now: self.now,
            truth: Arc::new(Mutex::new(self.truth().clone())),
            replicas: self
                .replicas
                .iter()
                .map(|r| Replica {
                    index: r.index.fork(sim_clock(&clock)),
                    hints: FitHints::default(),
                    alive: r.alive,
                    queues: r.queues.clone(),
                    dropped: r.dropped,
                    synced: r.synced,
                    started_at: r.started_at,
                    listed_at: r.listed_at,
                    leadership: r.leadership.fork(sim_clock(&clock)),
                    stopped: r.stopped,
                })
                .collect(),
            oracle: if self.model {
                self.oracle.clone()
            } else {
                self.oracle.fork(sim_clock(&clock))
            },
            config: self.config.clone(),
            max_delay: self.max_delay,
            status_lag: self.status_lag,
            changes: self.changes,
            instant: self.instant,
            model: self.model,
            refused_with: self.refused_with.clone(),
            rng: self.rng,
            clock,
        }
    }
}

/// A fast hasher (FxHash's): the model checker hashes every state it reaches.
struct Fx(u64);

impl Hasher for Fx {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(u64::from(*b));
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

fn sim_clock(ms: &Arc<AtomicI64>) -> Clock {
    let ms = ms.clone();
    Arc::new(move || {
        epoch()
            .checked_add(SignedDuration::from_millis(ms.load(Ordering::SeqCst)))
            .expect("time")
    })
}

fn deliver_all(r: &mut Replica) {
    for q in &mut r.queues {
        while let Some((_, c)) = q.pop_front() {
            c.apply(&r.index);
        }
    }
}

fn node_labels(n: &NodeSpec) -> BTreeMap<String, String> {
    BTreeMap::from([(kind_label(n.kind).to_string(), "true".to_string())])
}

fn report_object(node: &str, status: &TeeCapacityStatus, rev: u64) -> TeeCapacity {
    let mut status = status.clone();
    status.heartbeat_time = Some(Time(
        epoch()
            .checked_add(SignedDuration::from_hours(24 * 365))
            .expect("t"),
    ));
    TeeCapacity {
        metadata: ObjectMeta {
            name: Some(node.into()),
            resource_version: Some(rev.to_string()),
            ..ObjectMeta::default()
        },
        spec: TeeCapacitySpec {
            node_name: node.into(),
        },
        status: Some(status),
    }
}

fn pod_object(uid: &str, p: &PodTruth) -> LauncherPod {
    let key = Config::default()
        .resources
        .resource_name(p.kind)
        .to_string();
    serde_json::from_value(json!({
        "metadata": {"name": p.name, "namespace": "vms", "uid": uid,
            "ownerReferences": [{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                "name": p.name, "uid": p.vmi, "controller": true}]},
        "spec": {"nodeName": p.node, "containers": [{"name": "compute", "resources": {
            "requests": {key.clone(): "1"}, "limits": {key: "1"}}}]},
        "status": {"phase": if p.node.is_some() { "Running" } else { "Pending" }}
    }))
    .expect("pod")
}

fn vmi_object(uid: &str, v: &VmiTruth, now: u64) -> VirtualMachineInstance {
    let ls = match v.kind {
        TeeKind::Tdx => json!({"tdx": {}}),
        TeeKind::SevEs => json!({"snp": {}}),
        TeeKind::Sev => json!({"sev": {}}),
    };
    let at = |ms: u64| {
        epoch()
            .checked_add(SignedDuration::from_millis(ms as i64))
            .expect("time")
            .to_string()
    };
    let mut conditions = Vec::new();
    if let (Some(since), Some(message), None) = (v.refused_at, &v.message, &v.status_pod) {
        conditions.push(json!({"type": "Synchronized", "status": "False",
            "reason": "FailedCreate", "message": message, "lastTransitionTime": at(since)}));
    }
    let phase = if v.status_pod.is_some() {
        "Scheduling"
    } else {
        "Pending"
    };
    let _ = now;
    VirtualMachineInstance::from_json(json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": v.name, "namespace": "vms", "uid": uid,
            "annotations": {"teeguard.dev/retried": v.retried.to_string()}},
        "spec": {"domain": {"launchSecurity": ls}},
        "status": {"phase": phase, "conditions": conditions}
    }))
    .expect("VMI")
}
