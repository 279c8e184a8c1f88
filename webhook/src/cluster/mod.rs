//! What talks to the API server: [`caches`] (reflector caches behind the `Lookups` trait, with one
//! GET on a miss), [`events`] (`InsufficientTEEKeys` and `TEEKeyFree` Events on VMIs, off the hot
//! path), [`reservations`] (shared by replicas) and [`retry`] (refused VMIs retried once a key frees).

pub mod caches;
pub mod events;
pub mod reservations;
pub mod retry;
