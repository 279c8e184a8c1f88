//! What talks to the API server: [`admission`] (a pod's capacity check, decided and held on the
//! index), [`caches`] (watch caches behind the `Lookups` trait, with one GET on a miss), [`index`] (the
//! admission state behind one lock, applied to by the watches), [`holds`] (decided and held under the
//! index's lock; the decider's holds written behind into the nodes' `TeeReservation`s), [`lead`] (the
//! decider Lease), [`retry`] (the decider's planner: free keys promised to waiting VMIs, which are
//! retried) and [`events`] (`InsufficientTEEKeys` and `TEEKeyFree` Events on VMIs, off the hot path).

pub mod admission;
pub mod caches;
pub mod events;
pub mod holds;
pub mod index;
pub mod lead;
pub mod retry;

/// `call` to the API server, bounded by `within`; a failure or no answer in time names `action`.
pub async fn bounded<T>(
    action: impl FnOnce() -> String,
    within: std::time::Duration,
    call: impl std::future::Future<Output = kube::Result<T>>,
) -> crate::error::Result<T> {
    match tokio::time::timeout(within, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(crate::error::Error::api(action(), e)),
        Err(_) => Err(crate::error::Error::ApiTimeout {
            action: action(),
            within,
        }),
    }
}
