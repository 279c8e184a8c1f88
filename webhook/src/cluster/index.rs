//! The admission state behind one lock ([`KeyIndex`]): the pure [`Index`], the clock it is read with,
//! and a wake-up for the retry planner. Each watched kind applies to it, as linkerd2's
//! policy-controller index is applied to: Nodes, `TeeCapacity` reports, the agents' Leases and
//! `TeeReservation`s through [`Sink`]s (nothing else keeps them), virt-launcher pods and VMIs through
//! their caches' observers (`crate::cluster::caches`: the caches serve the reviews' lookups). The admission handlers and the
//! retry planner read it under the read lock and decide with `crate::decide::admit`; their writes'
//! answers apply to it at once (`crate::cluster::holds`).

use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};

use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::core::PartialObjectMeta;
use teeguard_shared::TeeCapacity;
use teeguard_shared::reservation::TeeReservation;
use tokio::sync::Notify;

use crate::decide::index::Index;

/// Where the time comes from: the wall clock in the server, a simulated one in the simulation.
pub type Clock = Arc<dyn Fn() -> Timestamp + Send + Sync>;

/// The wall clock.
pub fn wall_clock() -> Clock {
    Arc::new(Timestamp::now)
}

/// The index behind one lock. Cheap to clone.
#[derive(Clone)]
pub struct KeyIndex {
    inner: Arc<Inner>,
}

struct Inner {
    index: RwLock<Index>,
    changed: Notify,
    /// A hold was kept here only (for the decider's write-behind).
    held_locally: Notify,
    clock: Clock,
    /// The extended resources that are TEE keys (a launcher pod requesting one takes a key).
    key_resources: Vec<String>,
}

impl std::fmt::Debug for KeyIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyIndex").finish_non_exhaustive()
    }
}

impl KeyIndex {
    /// An empty index whose holds last at most `ttl`, read with `clock`.
    pub fn new(ttl: std::time::Duration, clock: Clock) -> KeyIndex {
        let names = teeguard_shared::Config::default()
            .resources
            .resource_names();
        KeyIndex::with_key_resources(ttl, clock, names)
    }

    /// [`KeyIndex::new`] with the configured names of the key resources.
    pub fn with_key_resources(
        ttl: std::time::Duration,
        clock: Clock,
        key_resources: Vec<String>,
    ) -> KeyIndex {
        KeyIndex {
            inner: Arc::new(Inner {
                index: RwLock::new(Index::new(ttl)),
                changed: Notify::new(),
                held_locally: Notify::new(),
                clock,
                key_resources,
            }),
        }
    }

    /// Whether `name` is the extended resource of a TEE key.
    pub fn is_key_resource(&self, name: &str) -> bool {
        self.inner.key_resources.iter().any(|k| k == name)
    }

    /// A separate index holding a copy of this one's state, read with `clock` (the simulation's model
    /// checker forks the world, and its clock, at each choice).
    pub fn fork(&self, clock: Clock) -> KeyIndex {
        let index = self.read().clone();
        KeyIndex {
            inner: Arc::new(Inner {
                index: RwLock::new(index),
                changed: Notify::new(),
                held_locally: Notify::new(),
                clock,
                key_resources: self.inner.key_resources.clone(),
            }),
        }
    }

    /// Now, by the index's clock.
    pub fn now(&self) -> Timestamp {
        (self.inner.clock)()
    }

    /// Read the index (keep the guard short: every writer waits for it).
    pub fn read(&self) -> RwLockReadGuard<'_, Index> {
        // Writers never panic half-way through a change: a poisoned lock still holds a consistent index.
        self.inner
            .index
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Change the index at `now` and wake the retry planner.
    pub fn update<R>(&self, change: impl FnOnce(&mut Index, Timestamp) -> R) -> R {
        let now = self.now();
        let out = {
            let mut ix = self
                .inner
                .index
                .write()
                .unwrap_or_else(PoisonError::into_inner);
            change(&mut ix, now)
        };
        self.inner.changed.notify_one();
        out
    }

    /// Tell the write-behind that holds were kept locally (by [`crate::cluster::holds::hold`]).
    pub fn wake_write_behind(&self) {
        self.inner.held_locally.notify_one();
    }

    /// Wait until a hold is kept locally (one made while nobody waited is kept for the next call).
    pub async fn held_locally(&self) {
        self.inner.held_locally.notified().await;
    }

    /// Forget what the index no longer needs (see [`Index::sweep`]); wakes nobody.
    pub fn sweep(&self) {
        let now = self.now();
        self.inner
            .index
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .sweep(now);
    }

    /// Wait until the index changes (a change while nobody waited is kept for the next call).
    pub async fn changed(&self) {
        self.inner.changed.notified().await;
    }
}

/// Told of one watched kind's objects: stored (added, changed, or listed again) or deleted (also an
/// object a re-list no longer shows).
pub trait Sink<K>: Send + Sync {
    /// `obj` was stored.
    fn apply(&self, obj: K);
    /// The object `name` was deleted.
    fn delete(&self, name: &str);
}

fn name_of<K: kube::Resource>(obj: &K) -> String {
    obj.meta().name.clone().unwrap_or_default()
}

impl Sink<PartialObjectMeta<Node>> for KeyIndex {
    fn apply(&self, obj: PartialObjectMeta<Node>) {
        let name = name_of(&obj);
        let labels = obj.metadata.labels.unwrap_or_default();
        self.update(|ix, _| ix.apply_node(&name, Some(labels)));
    }
    fn delete(&self, name: &str) {
        self.update(|ix, _| ix.apply_node(name, None));
    }
}

impl Sink<TeeCapacity> for KeyIndex {
    fn apply(&self, obj: TeeCapacity) {
        let name = name_of(&obj);
        let version = crate::decide::index::resource_version(&obj.metadata);
        let status = obj.status.map(|mut s| {
            // Conditions and the version are for people; the decisions read the figures.
            s.conditions = Vec::new();
            s.agent_version = None;
            Arc::new(s)
        });
        self.update(|ix, now| ix.apply_report(&name, status, version, now));
    }
    fn delete(&self, name: &str) {
        self.update(|ix, now| ix.apply_report(name, None, None, now));
    }
}

impl Sink<Lease> for KeyIndex {
    fn apply(&self, obj: Lease) {
        let name = name_of(&obj);
        let renewed = obj.spec.and_then(|s| s.renew_time).map(|t| t.0);
        self.update(|ix, _| ix.apply_lease(&name, renewed));
    }
    fn delete(&self, name: &str) {
        self.update(|ix, _| ix.apply_lease(name, None));
    }
}

impl Sink<TeeReservation> for KeyIndex {
    fn apply(&self, obj: TeeReservation) {
        let name = name_of(&obj);
        self.update(|ix, now| ix.apply_holds(&name, Some(Arc::new(obj)), now));
    }
    fn delete(&self, name: &str) {
        self.update(|ix, now| ix.apply_holds(name, None, now));
    }
}
