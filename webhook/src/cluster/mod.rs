//! What talks to the API server: [`caches`] (reflector caches behind the `Lookups` trait, with one
//! GET on a miss) and [`events`] (`InsufficientTEEKeys` Events on VMIs, off the hot path).

pub mod caches;
pub mod events;
pub mod reservations;
