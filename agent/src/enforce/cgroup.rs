//! The cgroup writer (no NRI): the agent writes each TEE pod's limits into the pod cgroup's own
//! `misc.max` as soon as the cgroup appears — before QEMU or a Kata VMM in it can charge a key.
//!
//! - Appearing cgroups are seen through inotify on the kubepods directory and its QoS directories
//!   ([`DirWatch`]; the kubelet's `mkdir` of a pod cgroup is an `IN_CREATE` there), with a sweep at every
//!   poll as the backstop for missed events and pods the agent learned of after their cgroup appeared.
//! - One resource per write, opened without `O_CREAT`, read back ([`crate::kernel::misc_max`]); a
//!   value that did not stick is retried at the next sweep.
//! - Pod level covers both KubeVirt (QEMU in the `compute` container, below the pod cgroup) and Kata
//!   (the VMM in the sandbox cgroup), and the pod's total equals what the scheduler counted.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use inotify::{EventMask, WatchMask};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::cluster::events::{EventSink, PodRef, REASON_FAILED};
use crate::decide::cgroup_names::{pod_uid_of_dir, qos_dirs};
use crate::decide::enforcing::{HostFacts, WriterStatus};
use crate::decide::limits::Limit;
use crate::error::Error;
use crate::kernel::dir_watch::DirWatch;
use crate::kernel::misc_max::{WriteOutcome, apply, lift};
use crate::metrics::Metrics;

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
    /// Its limits (from [`crate::decide::limits::pod_limits`]).
    pub limits: Vec<Limit>,
}

/// Desired limits by pod UID.
pub type Desired = Arc<BTreeMap<String, DesiredPod>>;

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
        let (tx, mut created) = mpsc::unbounded_channel::<String>();
        let mut watcher = match DirWatch::new(WatchMask::CREATE, move |name, mask| {
            if let Some(name) = name.filter(|_| mask.contains(EventMask::ISDIR)) {
                let _ = tx.send(name.to_string_lossy().into_owned());
            }
        }) {
            Ok(w) => Some(w),
            Err(e) => {
                let e = Error::Watch {
                    what: "new pod cgroups",
                    source: e,
                };
                tracing::warn!(error = %e, "limits are written at the next poll");
                None
            }
        };
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
            let (created_dir, swept) = tokio::select! {
                () = shutdown.cancelled() => return,
                _ = sweep.tick() => (None, true),
                () = sleep_until(recheck) => { recheck = None; (None, false) }
                r = self.desired.changed() => { if r.is_err() { return } (None, false) }
                r = self.host.changed() => { if r.is_err() { return } (None, false) }
                Some(p) = created.recv() => (Some(p), false),
            };
            // The sweep is the backstop for pods still waiting for their limits; with none waiting it
            // has nothing to do (for 500 pods it would clone and walk them all every poll).
            if swept && self.status.borrow().waiting == 0 {
                continue;
            }
            let host = self.host.borrow().clone();
            let (Some(kubepods), Some(driver)) = (host.kubepods.clone(), host.driver) else {
                continue;
            };
            if let Some(w) = watcher.as_mut() {
                let want: Vec<PathBuf> = std::iter::once(kubepods.clone())
                    .chain(qos_dirs(&kubepods, driver))
                    .filter(|d| d.is_dir())
                    .collect();
                // Each pass adds them again: a QoS directory removed and made anew is watched anew.
                for (d, e) in w.watch_exactly(&want) {
                    tracing::debug!(dir = %d.display(), error = %e, "cannot watch for new pod cgroups");
                }
            }
            if !host.limits_possible() {
                continue;
            }
            let desired = self.desired.borrow().clone();
            // A pod limited before that needs no limit now (its namespace was found exempt in strict
            // mode, or it ended): its limits are lifted, or a VM it starts would still be refused.
            for (uid, d) in &done {
                if let (false, Done::Applied(limits)) = (desired.contains_key(uid), d) {
                    let kinds: Vec<_> = limits.iter().map(|l| l.kind).collect();
                    if let WriteOutcome::Written(dir) = lift(&kubepods, driver, uid, &kinds) {
                        tracing::info!(cgroup = %dir.display(), kinds = ?kinds, "misc.max lifted: the pod needs no limit any more");
                    }
                }
            }
            done.retain(|uid, _| desired.contains_key(uid));
            failures.retain(|uid, _| desired.contains_key(uid));
            suspect.retain(|uid, _| desired.contains_key(uid));
            // A new pod cgroup: only that pod. Otherwise every pod not limited yet (or whose limits changed).
            let only = created_dir.as_deref().and_then(pod_uid_of_dir);
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
