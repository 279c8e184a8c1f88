//! Holds: the decider decides and holds under the index's write lock ([`hold`]), and writes its
//! holds behind into each node's `TeeReservation` ([`write_behind`]), with the `resourceVersion` its
//! index read (`PUT`; `create` for the node's first), so every replica counts them and a successor
//! starts from them. On 409 (Conflict, or AlreadyExists) the object is read again with a GET,
//! applied to the index, and the write made again on it ([`write_node`]). The decisions are
//! `crate::decide::admit`; the store is a trait ([`HoldStore`]) so the deterministic simulation drives
//! the same loop with an API server of its own.

use std::future::Future;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::Api;
use kube::api::PostParams;
use teeguard_shared::TeeCapacity;
use teeguard_shared::reservation::{TeeReservation, TeeReservationSpec};

use super::bounded;
use super::index::KeyIndex;
use crate::decide::admit::Write;
use crate::error::{Error, Result};
use crate::metrics::{HoldWriteResult, Metrics};

/// Holds a decision takes on one node: the node and its holds.
pub type NodeHolds = (String, Vec<teeguard_shared::reservation::KeyReservation>);

/// Writes tried per node before giving up (a conflict means the object changed under the write: a
/// decider taking over, the planner's trim).
pub const MAX_ATTEMPTS: u32 = 8;

/// Why a write (of a node's holds, or of the decider Lease) did not go through.
#[derive(Debug)]
pub enum WriteError {
    /// Another write came first (409): read again and decide again.
    Conflict,
    /// The API server could not be asked, refused, or did not answer in time.
    Failed(Error),
}

/// Where holds are recorded: the API server ([`ApiHolds`]), or the simulation's.
pub trait HoldStore: Send + Sync {
    /// Write `w.entries` into node `w.node`'s object, on `w.base`'s `resourceVersion` (create it when
    /// `w.base` is `None`), within `within`.
    fn write(
        &self,
        w: &Write,
        within: Duration,
    ) -> impl Future<Output = Result<TeeReservation, WriteError>> + Send;

    /// Read node `node`'s object (`None`: there is none) within `within`.
    fn read(
        &self,
        node: &str,
        within: Duration,
    ) -> impl Future<Output = Result<Option<TeeReservation>>> + Send;

    /// Every node's holds and report as the API server has them now (consistent reads), within
    /// `within` each.
    fn list(&self, within: Duration) -> impl Future<Output = Result<Listed>> + Send;
}

/// What a replica that takes the Lease lists before it decides
/// ([`crate::cluster::lead::Leadership::catch_up`]): the holds its predecessor wrote, and the reports
/// by which its predecessor ended the holds it trimmed.
#[derive(Clone, Debug, Default)]
pub struct Listed {
    /// Every node's `TeeReservation`.
    pub holds: Vec<TeeReservation>,
    /// Every node's `TeeCapacity` report.
    pub reports: Vec<TeeCapacity>,
}

/// Decide with `plan` on the index and keep its holds there, under one write lock: two reviews on
/// the decider never both take one last key. `plan` returns its answer and the holds it takes on a
/// node (`None`: none); returns the answer (the holds are written behind soon after,
/// [`write_behind`]).
pub fn hold<T>(
    index: &KeyIndex,
    plan: impl FnOnce(&crate::decide::index::Index, jiff::Timestamp) -> (T, Option<NodeHolds>),
) -> T {
    let (answer, held) = index.update(|ix, now| {
        let (answer, holds) = plan(ix, now);
        let held = holds.is_some_and(|(node, holds)| {
            for hold in holds {
                ix.hold_locally(&node, hold, now);
            }
            true
        });
        (answer, held)
    });
    if held {
        index.wake_write_behind();
    }
    answer
}

/// Write what `plan` makes of the index into a node's `TeeReservation`, on the version the index
/// holds: on a conflict, read the object again and plan again (at most [`MAX_ATTEMPTS`] times, all
/// within `within`). `plan` returns `None` when there is nothing to write. `Err`: why it could not
/// be written.
pub async fn write_node<S: HoldStore>(
    index: &KeyIndex,
    store: &S,
    within: Duration,
    metrics: Option<&Metrics>,
    plan: impl Fn(&crate::decide::index::Index, jiff::Timestamp) -> Option<Write>,
) -> Result<()> {
    let started = Instant::now();
    let count = |r: HoldWriteResult| {
        if let Some(m) = metrics {
            m.hold_write(r);
        }
    };
    let mut attempt = 0;
    loop {
        attempt += 1;
        let Some(write) = plan(&index.read(), index.now()) else {
            return Ok(());
        };
        let left = within.saturating_sub(started.elapsed());
        let result = store.write(&write, left).await;
        if let Some(m) = metrics {
            m.observe_hold_write(started.elapsed());
        }
        let why = match result {
            Ok(obj) => {
                count(HoldWriteResult::Written);
                index.update(|ix, now| ix.apply_holds(&write.node, Some(obj.into()), now));
                return Ok(());
            }
            Err(WriteError::Failed(why)) => why,
            Err(WriteError::Conflict) if attempt >= MAX_ATTEMPTS => Error::Conflicts {
                node: write.node.clone(),
                attempts: MAX_ATTEMPTS,
            },
            Err(WriteError::Conflict) => {
                count(HoldWriteResult::Conflict);
                tracing::debug!(
                    node = write.node,
                    "TeeReservation changed under us; reading it again"
                );
                let left = within.saturating_sub(started.elapsed());
                match store.read(&write.node, left).await {
                    Ok(fresh) => {
                        index.update(|ix, now| {
                            ix.apply_holds(&write.node, fresh.map(Into::into), now)
                        });
                        continue;
                    }
                    Err(why) => why,
                }
            }
        };
        count(HoldWriteResult::Failed);
        return Err(why);
    }
}

/// How long the write-behind gathers holds before writing them.
pub const BEHIND_BATCH: Duration = Duration::from_millis(250);

/// How often the write-behind looks for holds to write even without a wake-up (a write that failed).
pub const BEHIND_RETRY: Duration = Duration::from_millis(250);

/// The decider's write-behind: the holds it admitted in memory, written
/// into their nodes' `TeeReservation`s soon after, so every replica counts them and a successor
/// starts from them. Each node's write carries all its unwritten holds (a burst is one write), on the
/// version read; a conflict reads again ([`write_node`]). Runs until `shutdown`, whoever decides: holds
/// a replica admitted are real whichever replica decides next; at `shutdown` it writes what is left
/// once more (the Lease is given up after, so a successor that takes it at once starts from them),
/// and returns whether that wrote them all.
pub async fn write_behind<S: HoldStore>(
    index: KeyIndex,
    store: S,
    within: Duration,
    metrics: std::sync::Arc<Metrics>,
    shutdown: tokio_util::sync::CancellationToken,
) -> bool {
    loop {
        let failed = write_behind_once(&index, &store, within, Some(&metrics)).await;
        let again = if failed {
            BEHIND_RETRY
        } else {
            Duration::from_secs(5)
        };
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = index.held_locally() => {}
            _ = tokio::time::sleep(again) => {}
        }
        // One write for the holds of a burst: each write costs the API server about what a review's
        // whole call costs, and nobody decides from the written holds while this replica decides.
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(BEHIND_BATCH) => {}
        }
    }
    !write_behind_once(&index, &store, within, Some(&metrics)).await
}

/// One pass of [`write_behind`]: every node's unwritten live holds, one write each. Returns whether
/// some write failed.
pub async fn write_behind_once<S: HoldStore>(
    index: &KeyIndex,
    store: &S,
    within: Duration,
    metrics: Option<&Metrics>,
) -> bool {
    let pending = {
        let ix = index.read();
        ix.unwritten(index.now())
    };
    let mut failed = false;
    for (node, _) in pending {
        let written = write_node(index, store, within, metrics, |ix, now| {
            let live = ix
                .unwritten(now)
                .into_iter()
                .find(|(n, _)| *n == node)
                .map(|(_, live)| live);
            live.map(|live| crate::decide::admit::write(ix, &node, live, now))
        })
        .await;
        if let Err(why) = written {
            failed = true;
            tracing::warn!(node, error = %why, "cannot write the decider's holds behind; trying again shortly");
        }
    }
    failed
}

/// The holds in the API server: one `TeeReservation` per node, owned by its Node.
#[derive(Clone)]
pub struct ApiHolds {
    api: Api<TeeReservation>,
    nodes: Api<Node>,
    reports: Api<TeeCapacity>,
}

impl std::fmt::Debug for ApiHolds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiHolds").finish_non_exhaustive()
    }
}

impl ApiHolds {
    /// Holds through `client`.
    pub fn new(client: kube::Client) -> ApiHolds {
        ApiHolds {
            api: Api::all(client.clone()),
            nodes: Api::all(client.clone()),
            reports: Api::all(client),
        }
    }

    async fn write_now(&self, w: &Write) -> Result<TeeReservation, WriteError> {
        let result = match &w.base {
            Some(base) => {
                let mut obj = (**base).clone();
                obj.spec.reservations = w.entries.clone();
                // The object's resourceVersion is the precondition: a stale one gets 409.
                self.api
                    .replace(&w.node, &PostParams::default(), &obj)
                    .await
            }
            None => {
                let owner = match self.nodes.get_metadata_opt(&w.node).await {
                    Ok(Some(n)) => n.metadata.uid.map(|uid| OwnerReference {
                        api_version: "v1".into(),
                        kind: "Node".into(),
                        name: w.node.clone(),
                        uid,
                        ..OwnerReference::default()
                    }),
                    Ok(None) => None,
                    Err(e) => {
                        return Err(WriteError::Failed(Error::api(
                            format!("reading Node {}", w.node),
                            e,
                        )));
                    }
                };
                let obj = TeeReservation {
                    metadata: ObjectMeta {
                        name: Some(w.node.clone()),
                        owner_references: owner.map(|o| vec![o]),
                        ..ObjectMeta::default()
                    },
                    spec: TeeReservationSpec {
                        node_name: w.node.clone(),
                        reservations: w.entries.clone(),
                    },
                };
                self.api.create(&PostParams::default(), &obj).await
            }
        };
        match result {
            Ok(obj) => Ok(obj),
            Err(kube::Error::Api(s)) if s.code == 409 => Err(WriteError::Conflict),
            Err(e) => Err(WriteError::Failed(Error::api(
                format!("writing TeeReservation {}", w.node),
                e,
            ))),
        }
    }
}

impl HoldStore for ApiHolds {
    async fn write(&self, w: &Write, within: Duration) -> Result<TeeReservation, WriteError> {
        tokio::time::timeout(within, self.write_now(w))
            .await
            .unwrap_or_else(|_| {
                Err(WriteError::Failed(Error::ApiTimeout {
                    action: format!("writing TeeReservation {}", w.node),
                    within,
                }))
            })
    }

    async fn read(&self, node: &str, within: Duration) -> Result<Option<TeeReservation>> {
        let action = || format!("reading TeeReservation {node}");
        bounded(action, within, self.api.get_opt(node)).await
    }

    async fn list(&self, within: Duration) -> Result<Listed> {
        Ok(Listed {
            holds: list_all(&self.api, "TeeReservations", within).await?,
            reports: list_all(&self.reports, "TeeCapacity reports", within).await?,
        })
    }
}

/// Every object of `api`, read from etcd (no `resourceVersion`: it has every write that completed
/// before), within `within`.
async fn list_all<K>(api: &Api<K>, what: &str, within: Duration) -> Result<Vec<K>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let params = kube::api::ListParams::default();
    let listed = bounded(|| format!("listing the {what}"), within, api.list(&params)).await?;
    Ok(listed.items)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::decide::testkit::{hold as entry, t0};
    use teeguard_shared::reservation::HoldReason;

    /// Two reviews deciding at once on the decider take a node's one key once: the second plans after the first's hold is in the index. Each plan waits
    /// up to 200 ms for the other to be planning too: with plans made under a shared lock, both saw
    /// the key free and both held it (found by the leader e2e test under load).
    #[test]
    fn two_reviews_deciding_at_once_take_one_key_once() {
        let index = KeyIndex::new(Duration::from_secs(30), Arc::new(t0));
        let planning = AtomicUsize::new(0);
        let taken = std::thread::scope(|s| {
            let reviews: Vec<_> = (0..2)
                .map(|i| {
                    let (index, planning) = (&index, &planning);
                    s.spawn(move || {
                        hold(index, |ix, now| {
                            planning.fetch_add(1, Ordering::SeqCst);
                            let waiting = Instant::now();
                            while planning.load(Ordering::SeqCst) < 2
                                && waiting.elapsed() < Duration::from_millis(200)
                            {
                                std::thread::yield_now();
                            }
                            let free = ix.live("n1", now).count() == 0;
                            let holds = free.then(|| {
                                let hold = entry(&format!("p{i}"), "v", HoldReason::Bound);
                                ("n1".to_string(), vec![hold])
                            });
                            (free, holds)
                        })
                    })
                })
                .collect();
            reviews
                .into_iter()
                .map(|r| r.join().expect("review thread"))
                .filter(|took| *took)
                .count()
        });
        assert_eq!(taken, 1);
        assert_eq!(index.read().live("n1", t0()).count(), 1);
    }
}
