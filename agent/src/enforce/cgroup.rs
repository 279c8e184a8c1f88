//! The cgroup writer (no NRI): the agent writes each TEE pod's limits into the pod cgroup's own
//! `misc.max` as soon as the cgroup appears — before QEMU or a Kata VMM in it can charge a key.
//!
//! - Appearing cgroups are seen through inotify on the kubepods directory and its QoS directories
//!   (`notify`; the kubelet's `mkdir` of a pod cgroup is an `IN_CREATE` there), with a sweep at every
//!   poll as the backstop for missed events and pods the agent learned of after their cgroup appeared.
//! - One resource per write (the kernel parses one `name value` per write), opened without `O_CREAT`:
//!   a pod cgroup without `misc.max` has no misc controller (not delegated), and nothing is created.
//!   Each write is read back; a value that did not stick is retried at the next sweep.
//! - Pod level covers both KubeVirt (QEMU in the `compute` container, below the pod cgroup) and Kata
//!   (the VMM in the sandbox cgroup), and the pod's total equals what the scheduler counted.

use std::collections::{BTreeMap, HashMap};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use notify::Watcher as _;
use teeguard_shared::misc::{MiscLimit, parse_max};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::HostFacts;
use super::events::{EventSink, PodRef, REASON_FAILED};
use super::limits::Limit;
use crate::metrics::Metrics;
use crate::scan::{Driver, pod_cgroup_candidates, pod_uid_of_dir, qos_dirs};

const MECHANISM: &str = "cgroup";

/// A pod cgroup found without `misc.max` is looked at again after this long.
const RECHECK_AFTER: Duration = Duration::from_millis(5);
/// ... and reported not delegated once it has had no `misc.max` for this long.
const NOT_DELEGATED_AFTER: Duration = Duration::from_secs(2);

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// A pod the writer should limit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DesiredPod {
    /// The pod (for logs and Events).
    pub pod: PodRef,
    /// Its limits (from [`super::limits::pod_limits`]).
    pub limits: Vec<Limit>,
}

/// Desired limits by pod UID.
pub type Desired = Arc<BTreeMap<String, DesiredPod>>;

/// What writing a pod's limits did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Every limit is in `misc.max` (read back).
    Written(PathBuf),
    /// The pod has no cgroup (yet).
    NoCgroup,
    /// The pod cgroup has no `misc.max`: the misc controller is not delegated to it.
    NotDelegated(PathBuf),
    /// A write or the read-back failed.
    Failed(String),
}

/// Write `limits` into `<dir>/misc.max`, one line per write, and read them back.
pub fn write_limits(dir: &Path, limits: &[Limit]) -> WriteOutcome {
    let path = dir.join("misc.max");
    for limit in limits {
        let line = limit.to_string();
        let opened = std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&path);
        let mut file = match opened {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return if dir.is_dir() {
                    WriteOutcome::NotDelegated(dir.to_path_buf())
                } else {
                    WriteOutcome::NoCgroup
                };
            }
            Err(e) => return WriteOutcome::Failed(format!("cannot open {}: {e}", path.display())),
        };
        if let Err(e) = file.write_all(line.as_bytes()) {
            return WriteOutcome::Failed(format!(
                "writing {line:?} to {} failed: {e}",
                path.display()
            ));
        }
    }
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => return WriteOutcome::Failed(format!("cannot read back {}: {e}", path.display())),
    };
    let now = match parse_max(&path, &text) {
        Ok(m) => m,
        Err(e) => return WriteOutcome::Failed(e.to_string()),
    };
    for limit in limits {
        if now.get(limit.kind.kernel_name()) != Some(&MiscLimit::Value(limit.keys)) {
            return WriteOutcome::Failed(format!(
                "{} does not show {limit} after writing it",
                path.display()
            ));
        }
    }
    WriteOutcome::Written(dir.to_path_buf())
}

/// Find the pod's cgroup and write its limits there.
pub fn apply(kubepods: &Path, driver: Driver, uid: &str, limits: &[Limit]) -> WriteOutcome {
    for dir in pod_cgroup_candidates(kubepods, driver, uid) {
        if dir.is_dir() {
            return write_limits(&dir, limits);
        }
    }
    WriteOutcome::NoCgroup
}

/// What the writer reports for the `Enforcing` condition.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WriterStatus {
    /// Pods whose limits are in place.
    pub applied: usize,
    /// Pods waiting for their cgroup.
    pub waiting: usize,
    /// The last pod cgroup found without the misc controller.
    pub not_delegated: Option<String>,
    /// The last failure.
    pub last_failure: Option<String>,
}

/// The writer's inputs.
#[derive(Debug)]
pub struct Writer {
    /// Host facts from the poll loop (kubepods directory, driver, delegation).
    pub host: watch::Receiver<HostFacts>,
    /// Desired limits, from the poll loop.
    pub desired: watch::Receiver<Desired>,
    /// Where the writer's status goes.
    pub status: watch::Sender<WriterStatus>,
    /// Metrics.
    pub metrics: Metrics,
    /// Events.
    pub events: EventSink,
    /// Backstop sweep period (the poll interval).
    pub sweep_every: Duration,
}

/// Why a pod could not be limited, remembered so that a failure is logged and evented once.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Done {
    Applied(Vec<Limit>),
    NotDelegated,
}

impl Writer {
    /// Run until `shutdown`.
    pub async fn run(mut self, shutdown: CancellationToken) {
        let (tx, mut created) = mpsc::unbounded_channel::<PathBuf>();
        let mut watcher = match notify::recommended_watcher(
            move |res: notify::Result<notify::Event>| {
                let Ok(ev) = res else { return };
                if matches!(ev.kind, notify::EventKind::Create(_)) {
                    for p in ev.paths {
                        let _ = tx.send(p);
                    }
                }
            },
        ) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch for new pod cgroups; limits are written at the next poll");
                None
            }
        };
        let mut watched: Vec<PathBuf> = Vec::new();
        let mut done: HashMap<String, Done> = HashMap::new();
        let mut failures: HashMap<String, String> = HashMap::new();
        // Pods whose cgroup showed no misc.max, since when: a cgroup caught between its mkdir and its
        // files looks the same, so it is looked at again every few milliseconds and reported not
        // delegated only when that lasts NOT_DELEGATED_AFTER (a busy host may take a while).
        let mut suspect: HashMap<String, std::time::Instant> = HashMap::new();
        let mut sweep = tokio::time::interval(self.sweep_every);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // A quick second look at a suspect cgroup (its files were likely still being created).
        let mut recheck: Option<tokio::time::Instant> = None;
        loop {
            let created_dir = tokio::select! {
                () = shutdown.cancelled() => return,
                _ = sweep.tick() => None,
                () = sleep_until(recheck) => { recheck = None; None }
                r = self.desired.changed() => { if r.is_err() { return } None }
                r = self.host.changed() => { if r.is_err() { return } None }
                Some(p) = created.recv() => Some(p),
            };
            let host = self.host.borrow().clone();
            let (Some(kubepods), Some(driver)) = (host.kubepods.clone(), host.driver) else {
                continue;
            };
            if let Some(w) = watcher.as_mut() {
                let want: Vec<PathBuf> = std::iter::once(kubepods.clone())
                    .chain(qos_dirs(&kubepods, driver))
                    .filter(|d| d.is_dir())
                    .collect();
                for d in &want {
                    if !watched.contains(d)
                        && w.watch(d, notify::RecursiveMode::NonRecursive).is_ok()
                    {
                        watched.push(d.clone());
                    }
                }
            }
            if !host.limits_possible() {
                continue;
            }
            let desired = self.desired.borrow().clone();
            done.retain(|uid, _| desired.contains_key(uid));
            failures.retain(|uid, _| desired.contains_key(uid));
            suspect.retain(|uid, _| desired.contains_key(uid));
            // A new pod cgroup: only that pod. Otherwise every pod not limited yet (or whose limits changed).
            let only = created_dir
                .as_deref()
                .and_then(|p| p.file_name()?.to_str().and_then(pod_uid_of_dir));
            if created_dir.is_some() && only.is_none() {
                continue; // a QoS directory or a container: the watch list is refreshed above
            }
            for (uid, want) in desired.iter() {
                if only.as_deref().is_some_and(|o| o != uid) {
                    continue;
                }
                match done.get(uid) {
                    Some(Done::Applied(l)) if *l == want.limits => continue,
                    Some(Done::NotDelegated) => continue,
                    _ => {}
                }
                if want.limits.is_empty() {
                    continue;
                }
                match apply(&kubepods, driver, uid, &want.limits) {
                    WriteOutcome::Written(dir) => {
                        suspect.remove(uid);
                        for l in &want.limits {
                            self.metrics.limit_applied(MECHANISM, l.kind);
                        }
                        let limits: Vec<String> =
                            want.limits.iter().map(ToString::to_string).collect();
                        tracing::info!(pod = %format!("{}/{}", want.pod.namespace, want.pod.name), cgroup = %dir.display(), limits = ?limits, "misc.max written");
                        failures.remove(uid);
                        done.insert(uid.clone(), Done::Applied(want.limits.clone()));
                    }
                    WriteOutcome::NoCgroup => {}
                    WriteOutcome::NotDelegated(_)
                        if suspect
                            .entry(uid.clone())
                            .or_insert_with(std::time::Instant::now)
                            .elapsed()
                            < NOT_DELEGATED_AFTER =>
                    {
                        tracing::debug!(
                            uid,
                            "pod cgroup without misc.max yet; looking again shortly"
                        );
                        recheck = Some(tokio::time::Instant::now() + RECHECK_AFTER);
                    }
                    WriteOutcome::NotDelegated(dir) => {
                        let why = format!(
                            "pod cgroup {} has no misc.max (the misc controller is not delegated to it); limits cannot be applied",
                            dir.display()
                        );
                        tracing::warn!(pod = %format!("{}/{}", want.pod.namespace, want.pod.name), "{why}");
                        self.metrics.limit_failure(MECHANISM);
                        self.events
                            .warn(want.pod.clone(), REASON_FAILED, why.clone());
                        self.status.send_modify(|s| s.not_delegated = Some(why));
                        done.insert(uid.clone(), Done::NotDelegated);
                    }
                    WriteOutcome::Failed(why) => {
                        if failures.get(uid) != Some(&why) {
                            tracing::warn!(pod = %format!("{}/{}", want.pod.namespace, want.pod.name), error = %why, "cannot write the pod's misc.max; retrying at the next poll");
                            self.metrics.limit_failure(MECHANISM);
                            self.events
                                .warn(want.pod.clone(), REASON_FAILED, why.clone());
                            self.status
                                .send_modify(|s| s.last_failure = Some(why.clone()));
                            failures.insert(uid.clone(), why);
                        }
                    }
                }
            }
            let applied = done
                .values()
                .filter(|d| matches!(d, Done::Applied(_)))
                .count();
            let waiting = desired
                .iter()
                .filter(|(uid, d)| !d.limits.is_empty() && !done.contains_key(*uid))
                .count();
            self.status.send_if_modified(|s| {
                let changed = s.applied != applied || s.waiting != waiting;
                s.applied = applied;
                s.waiting = waiting;
                changed
            });
        }
    }
}
