//! The decider's Lease: read and written every `retry` by each replica,
//! decided by [`crate::decide::lead::Elector`]; the result is shared as a [`Leadership`] that the
//! admission handlers ask where a review that takes a key goes, and the planner whether it may plan.
//!
//! The Lease is `coordination.k8s.io/v1`, in the webhook's namespace; the holder writes its address
//! for forwarded reviews into the annotation [`ADDRESS_ANNOTATION`]. Writes carry the
//! `resourceVersion` read, so two replicas taking an expired Lease over at once cannot both succeed.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Api;
use kube::api::PostParams;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::bounded;
use super::holds::{ApiHolds, HoldStore, WriteError};
use super::index::{Clock, KeyIndex, Sink};
use crate::decide::lead::{Elector, Record, Route, Step};
use crate::error::Error;

/// Where the holder takes forwarded reviews (`https://ip:port`).
pub const ADDRESS_ANNOTATION: &str = "teeguard.dev/decider-address";

/// The Lease's default name.
pub const LEASE_NAME: &str = "teeguard-webhook-decider";

/// The election as the handlers see it. Cheap to clone.
#[derive(Clone)]
pub struct Leadership {
    elector: Arc<RwLock<Elector>>,
    clock: Clock,
    /// The term in which this replica listed the holds after taking the Lease
    /// ([`Leadership::catch_up`]): it decides nothing before.
    caught_up: Arc<AtomicU64>,
    /// The term in which this replica found no orphan launcher pods (`Index::orphans`): from then on
    /// it decides CREATEs without looking again.
    settled: Arc<AtomicU64>,
    /// Told when this replica starts deciding (the planner plans at once).
    became: Arc<tokio::sync::Notify>,
    /// At a stop, keep the Lease rather than give it up: the last holds could not be written.
    keep_at_stop: Arc<AtomicBool>,
    /// Asks [`Leadership::run`] for a round now (a review found no decider).
    kick: Arc<tokio::sync::Notify>,
    /// Counts the rounds done.
    rounds: Arc<tokio::sync::watch::Sender<u64>>,
}

/// How soon after a review asked for it the Lease is read again: reviews that find no decider at once
/// (a burst) share one read.
const KICK_SPACING: Duration = Duration::from_millis(50);

/// How often a CREATE waiting for a new decider's orphans looks at the index again.
const ORPHAN_POLL: Duration = Duration::from_millis(25);

impl std::fmt::Debug for Leadership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leadership").finish_non_exhaustive()
    }
}

impl Leadership {
    /// The election of `elector`, read with `clock`.
    pub fn new(elector: Elector, clock: Clock) -> Leadership {
        Leadership {
            elector: Arc::new(RwLock::new(elector)),
            clock,
            caught_up: Arc::new(AtomicU64::new(0)),
            settled: Arc::new(AtomicU64::new(0)),
            became: Arc::new(tokio::sync::Notify::new()),
            keep_at_stop: Arc::new(AtomicBool::new(false)),
            kick: Arc::new(tokio::sync::Notify::new()),
            rounds: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }

    /// A separate election state holding a copy of this one's, read with `clock` (the simulation's
    /// model checker forks the world, and its clock, at each choice).
    pub fn fork(&self, clock: Clock) -> Leadership {
        let elector = self
            .elector
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        Leadership {
            elector: Arc::new(RwLock::new(elector)),
            clock,
            caught_up: Arc::new(AtomicU64::new(self.caught_up.load(Ordering::Acquire))),
            settled: Arc::new(AtomicU64::new(self.settled.load(Ordering::Acquire))),
            became: Arc::new(tokio::sync::Notify::new()),
            keep_at_stop: Arc::new(AtomicBool::new(self.keep_at_stop.load(Ordering::Acquire))),
            kick: Arc::new(tokio::sync::Notify::new()),
            rounds: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }

    /// Where a review that takes a key goes now.
    pub fn route(&self) -> Route {
        self.routed().0
    }

    /// The route and this replica's term: `Here` only once the term caught up.
    fn routed(&self) -> (Route, u64) {
        let (route, term) = {
            let e = self.elector.read().unwrap_or_else(PoisonError::into_inner);
            (e.route((self.clock)()), e.term())
        };
        match route {
            Route::Here if self.caught_up.load(Ordering::Acquire) != term => (Route::Nobody, term),
            route => (route, term),
        }
    }

    /// A replica that has just taken the Lease lists the holds and the reports through `store` into
    /// `index` before it decides anything: its watches may not have delivered yet the last holds its
    /// predecessor wrote before giving the Lease up (a clean stop is taken over at once), nor the
    /// reports by which its predecessor ended holds (a dropped watch). Nothing to do (`Ok(false)`)
    /// unless it holds the Lease in a term not caught up yet.
    pub async fn catch_up<S: HoldStore>(
        &self,
        index: &KeyIndex,
        store: &S,
        within: Duration,
    ) -> crate::error::Result<bool> {
        let (holds, term) = {
            let e = self.elector.read().unwrap_or_else(PoisonError::into_inner);
            (e.route((self.clock)()) == Route::Here, e.term())
        };
        if !holds || self.caught_up.load(Ordering::Acquire) == term {
            return Ok(false);
        }
        // A listed object older than the one the index has is ignored (`Index::apply_holds`,
        // `Index::apply_report`).
        let listed = store.list(within).await?;
        for obj in listed.holds {
            index.apply(obj);
        }
        for obj in listed.reports {
            index.apply(obj);
        }
        self.caught_up.store(term, Ordering::Release);
        self.became.notify_one();
        Ok(true)
    }

    /// At a stop, keep the Lease rather than give it up: this replica's last holds could not be
    /// written, so its successor must wait the Lease out, as after a crash (by then the reports count
    /// the pods it bound and the caches have the pods it admitted).
    pub fn keep_at_stop(&self) {
        self.keep_at_stop.store(true, Ordering::Release);
    }

    /// Where a pod CREATE that takes a key goes now: like [`Leadership::route`], but a decider that
    /// has just taken over refuses (`Err`, with how many) while `index` has launcher pods admitted
    /// before whose holds it never saw ([`crate::decide::index::Index::orphans`]).
    pub fn route_create(&self, index: &KeyIndex) -> Result<Route, usize> {
        let (route, term) = self.routed();
        if route != Route::Here || self.settled.load(Ordering::Acquire) == term {
            return Ok(route);
        }
        match index.read().orphans(index.now()) {
            0 => {
                self.settled.store(term, Ordering::Release);
                Ok(Route::Here)
            }
            n => Err(n),
        }
    }

    /// Wait, at most one retry period, until a replica decides that is not the one at `failed` (it
    /// could not be reached) and, with `create`, that may admit a CREATE from this replica's index
    /// ([`Leadership::route_create`]): true once one does. Asks for Lease reads meanwhile, so a Lease
    /// given up (a clean stop) is taken over at once.
    pub async fn await_decider(&self, failed: Option<&str>, create: Option<&KeyIndex>) -> bool {
        let within = self.with(|e| e.terms().retry);
        let deadline = tokio::time::Instant::now() + within;
        let mut rounds = self.rounds.subscribe();
        loop {
            match self.route() {
                Route::Here => match create {
                    None => return true,
                    Some(index) if self.route_create(index).is_ok() => return true,
                    // The holds of the decider that gave the Lease up reach the index through its
                    // watch within milliseconds; the index has no change signal, so look again.
                    Some(_) if tokio::time::Instant::now() + ORPHAN_POLL < deadline => {
                        tokio::time::sleep(ORPHAN_POLL).await;
                        continue;
                    }
                    Some(_) => return false,
                },
                Route::Forward(at) if Some(at.as_str()) != failed => return true,
                Route::Forward(_) | Route::Nobody => {}
            }
            rounds.mark_unchanged();
            self.kick.notify_one();
            match tokio::time::timeout_at(deadline, rounds.changed()).await {
                Ok(Ok(())) => {}
                _ => return false,
            }
        }
    }

    /// Whether this replica decides now.
    pub fn deciding(&self) -> bool {
        self.route() == Route::Here
    }

    fn with<R>(&self, f: impl FnOnce(&mut Elector) -> R) -> R {
        f(&mut self.elector.write().unwrap_or_else(PoisonError::into_inner))
    }

    /// Once `synced` resolves (every cache listed: a replica never decides on a partial index), read
    /// and write the Lease every `retry` until `shutdown`, catching up on the holds in each term it
    /// takes; then give the Lease up (a successor need not wait it out after a clean stop) unless
    /// [`Leadership::keep_at_stop`]. `on_round` is told after each round whether the Lease could be
    /// read and whether this replica decides (readiness, the `decider` gauge).
    pub fn run(
        self,
        apis: LeaseApis,
        synced: impl Future<Output = ()> + Send + 'static,
        on_round: impl Fn(Round) + Send + 'static,
        shutdown: CancellationToken,
    ) -> JoinHandle<()> {
        let LeaseApis {
            lease: api,
            name,
            holds,
            index,
            within: api_timeout,
        } = apis;
        tokio::spawn(async move {
            tokio::select! {
                _ = synced => {}
                _ = shutdown.cancelled() => return,
            }
            let retry = self.with(|e| e.terms().retry);
            let mut leading = false;
            loop {
                let mut round = self.leading_now(&api, &name, api_timeout).await;
                if let Err(e) = self.catch_up(&index, &holds, api_timeout).await {
                    tracing::warn!(
                        lease = name,
                        error = %e,
                        "this replica holds the decider Lease but cannot list the holds; it decides once it can"
                    );
                }
                round.deciding = self.deciding();
                on_round(round);
                let now = round.deciding;
                if now != leading {
                    leading = now;
                    if leading {
                        tracing::info!(
                            lease = name,
                            "this replica decides the admissions that take a key"
                        );
                    } else {
                        tracing::info!(lease = name, "this replica no longer decides; it forwards");
                    }
                }
                self.rounds.send_modify(|n| *n += 1);
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(retry) => {}
                    _ = async {
                        self.kick.notified().await;
                        tokio::time::sleep(KICK_SPACING).await;
                    } => {}
                }
            }
            if self.keep_at_stop.load(Ordering::Acquire) {
                self.give_up(None);
                tracing::warn!(
                    lease = name,
                    "kept the decider Lease at this stop: the last holds could not be written; the \
                     next decider waits it out"
                );
            } else {
                self.release(&api, &name, api_timeout).await;
            }
            on_round(Round {
                read: true,
                deciding: false,
            });
        })
    }

    /// The Lease as read now (`None`: there is none): the record to write, when this replica should
    /// renew or take it.
    pub fn round(&self, lease: Option<Record>) -> Option<Record> {
        let now = (self.clock)();
        self.with(|e| {
            e.observe(lease, now);
            match e.step(now) {
                Step::Write(next) => Some(next),
                Step::Wait => None,
            }
        })
    }

    /// The write of `record`, started at `started`, went through.
    pub fn written(&self, record: Record, started: jiff::Timestamp) {
        self.with(|e| e.written(record, started));
    }

    /// How many times this replica started deciding.
    pub fn term(&self) -> u64 {
        self.elector
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .term()
    }

    /// Wait until this replica starts deciding (a start while nobody waited is kept for the next
    /// call).
    pub async fn began_deciding(&self) {
        self.became.notified().await;
    }

    /// One round: read the Lease, write it when the elector says so.
    async fn leading_now(&self, api: &Api<Lease>, name: &str, within: Duration) -> Round {
        let after = |read| Round {
            read,
            deciding: self.deciding(),
        };
        let read = bounded(
            || format!("reading Lease {name}"),
            within,
            api.get_opt(name),
        )
        .await;
        let lease = match read {
            Ok(lease) => lease,
            Err(e) => {
                tracing::warn!(lease = name, error = %e, "cannot read the decider Lease; trying again");
                return after(false);
            }
        };
        let started = (self.clock)();
        let Some(next) = self.round(lease.as_ref().map(record)) else {
            return after(true);
        };
        let duration = self.with(|e| e.terms().lease);
        // A Lease created now had no holder before: no decider admitted anything this one must wait
        // for (`route_create`'s orphans are a crashed predecessor's).
        let first = lease.is_none();
        let written = tokio::time::timeout(within, write(api, name, lease, &next, duration)).await;
        let written = written.unwrap_or_else(|_| {
            let action = format!("writing Lease {name}");
            Err(WriteError::Failed(Error::ApiTimeout { action, within }))
        });
        match written {
            Ok(()) => {
                self.written(next, started);
                if first {
                    self.settled.store(self.term(), Ordering::Release);
                }
            }
            Err(WriteError::Conflict) => {
                tracing::debug!(
                    lease = name,
                    "another replica wrote the decider Lease first"
                );
            }
            Err(WriteError::Failed(e)) => {
                tracing::warn!(lease = name, error = %e, "cannot write the decider Lease; trying again")
            }
        }
        after(true)
    }

    /// Stop deciding. The record that gives the Lease up (empty holder, so a successor takes it at
    /// once), when `lease` (as read now) is in this replica's name.
    pub fn give_up(&self, lease: Option<Record>) -> Option<Record> {
        self.with(|e| {
            e.step_down();
            let mine = lease.filter(|r| r.holder == e.me())?;
            Some(Record {
                holder: String::new(),
                ..mine
            })
        })
    }

    /// Give the Lease up ([`Leadership::give_up`]), having stopped deciding first.
    async fn release(&self, api: &Api<Lease>, name: &str, within: Duration) {
        self.give_up(None);
        let read = bounded(
            || format!("reading Lease {name}"),
            within,
            api.get_opt(name),
        )
        .await;
        let mut lease = match read {
            Ok(Some(lease)) => lease,
            Ok(None) => return,
            Err(e) => {
                tracing::warn!(lease = name, error = %e, "cannot give the decider Lease up; a successor waits it out");
                return;
            }
        };
        if self.give_up(Some(record(&lease))).is_none() {
            return;
        }
        lease
            .spec
            .get_or_insert_with(LeaseSpec::default)
            .holder_identity = None;
        let params = PostParams::default();
        let replace = api.replace(name, &params, &lease);
        match bounded(|| format!("writing Lease {name}"), within, replace).await {
            Ok(_) => tracing::info!(lease = name, "gave up the decider Lease"),
            Err(e) => {
                tracing::warn!(lease = name, error = %e, "cannot give the decider Lease up; a successor waits it out")
            }
        }
    }
}

/// What [`Leadership::run`] reads and writes.
#[derive(Clone, Debug)]
pub struct LeaseApis {
    /// The Leases of the webhook's namespace.
    pub lease: Api<Lease>,
    /// The decider Lease's name.
    pub name: String,
    /// The holds, listed when this replica takes the Lease.
    pub holds: ApiHolds,
    /// The index they are listed into.
    pub index: KeyIndex,
    /// Longest one API call may take.
    pub within: Duration,
}

/// What one round of [`Leadership::run`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Round {
    /// The Lease could be read (the replica knows who decides).
    pub read: bool,
    /// This replica decides now.
    pub deciding: bool,
}

fn record(lease: &Lease) -> Record {
    let spec = lease.spec.clone().unwrap_or_default();
    Record {
        holder: spec.holder_identity.unwrap_or_default(),
        address: lease
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ADDRESS_ANNOTATION).cloned())
            .unwrap_or_default(),
        renewed: spec.renew_time.map_or(jiff::Timestamp::UNIX_EPOCH, |t| t.0),
        transitions: spec.lease_transitions.unwrap_or(0),
    }
}

/// Write `next` over `base` (the Lease read; `None`: create it). A conflict: another replica wrote
/// it first.
async fn write(
    api: &Api<Lease>,
    name: &str,
    base: Option<Lease>,
    next: &Record,
    duration: Duration,
) -> Result<(), WriteError> {
    let taking = base
        .as_ref()
        .and_then(|l| l.spec.as_ref())
        .and_then(|s| s.holder_identity.as_deref())
        != Some(next.holder.as_str());
    let mut lease = base.clone().unwrap_or_else(|| Lease {
        metadata: ObjectMeta {
            name: Some(name.to_string()),
            ..ObjectMeta::default()
        },
        spec: None,
    });
    lease
        .metadata
        .annotations
        .get_or_insert_with(Default::default)
        .insert(ADDRESS_ANNOTATION.into(), next.address.clone());
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    spec.holder_identity = Some(next.holder.clone());
    spec.renew_time = Some(MicroTime(next.renewed));
    spec.lease_transitions = Some(next.transitions);
    spec.lease_duration_seconds = Some(i32::try_from(duration.as_secs()).unwrap_or(i32::MAX));
    if taking {
        spec.acquire_time = Some(MicroTime(next.renewed));
    }
    let result = match base {
        Some(_) => api.replace(name, &PostParams::default(), &lease).await,
        None => api.create(&PostParams::default(), &lease).await,
    };
    match result {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Err(WriteError::Conflict),
        Err(e) => Err(WriteError::Failed(Error::api(
            format!("writing Lease {name}"),
            e,
        ))),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
    use teeguard_shared::reservation::{HoldReason, TeeReservation, TeeReservationSpec};

    use super::*;
    use crate::cluster::holds::Listed;
    use crate::decide::admit::Write;
    use crate::decide::lead::Terms;
    use crate::decide::testkit::{hold, t0};

    /// The API server as a new decider lists it: one node's holds.
    struct Listing(Vec<TeeReservation>);

    impl HoldStore for Listing {
        async fn write(&self, _: &Write, _: Duration) -> Result<TeeReservation, WriteError> {
            unreachable!("this test writes nothing")
        }

        async fn read(&self, _: &str, _: Duration) -> crate::error::Result<Option<TeeReservation>> {
            Ok(None)
        }

        async fn list(&self, _: Duration) -> crate::error::Result<Listed> {
            Ok(Listed {
                holds: self.0.clone(),
                reports: Vec::new(),
            })
        }
    }

    /// After a clean stop the Lease is taken over at once, maybe before this replica's watch has
    /// delivered the holds its predecessor wrote last: it decides nothing until it has listed them.
    #[tokio::test]
    async fn a_replica_that_takes_the_lease_decides_only_once_it_has_listed_the_holds() {
        let index = KeyIndex::new(Duration::from_secs(30), Arc::new(t0));
        let terms = Terms::of_lease(Duration::from_secs(15));
        let l = Leadership::new(Elector::new("b", "https://b", terms), Arc::new(t0));
        let released = Record {
            holder: String::new(),
            address: "https://a".into(),
            renewed: t0(),
            transitions: 1,
        };
        let taken = l
            .round(Some(released))
            .expect("a released Lease is taken at once");
        l.written(taken, t0());
        assert_eq!(l.route(), Route::Nobody, "holding the Lease, not caught up");

        let predecessors = TeeReservation {
            metadata: ObjectMeta {
                name: Some("n1".into()),
                resource_version: Some("7".into()),
                ..ObjectMeta::default()
            },
            spec: TeeReservationSpec {
                node_name: "n1".into(),
                reservations: vec![hold("p1", "v1", HoldReason::Bound)],
            },
        };
        let store = Listing(vec![predecessors]);
        let within = Duration::from_secs(1);
        assert!(l.catch_up(&index, &store, within).await.expect("listed"));
        assert_eq!(l.route(), Route::Here);
        assert_eq!(
            index.read().live("n1", t0()).count(),
            1,
            "the predecessor's hold is held"
        );
        assert!(
            !l.catch_up(&index, &store, within).await.expect("listed"),
            "once per term"
        );
    }
}
