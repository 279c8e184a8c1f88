//! What talks to the API server: [`admission`] (a pod's capacity check, decided on the index and
//! committed by its hold's write), [`caches`] (watch caches behind the `Lookups` trait, with one GET
//! on a miss), [`index`] (the admission state behind one lock, applied to by the watches), [`holds`]
//! (each admission's hold written to the node's `TeeReservation`), [`retry`] (the planner: free keys
//! promised to waiting VMIs, which are retried) and [`events`] (`InsufficientTEEKeys` and `TEEKeyFree`
//! Events on VMIs, off the hot path).

pub mod admission;
pub mod caches;
pub mod events;
pub mod holds;
pub mod index;
pub mod lead;
pub mod retry;
