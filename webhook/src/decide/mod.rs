//! The pure decisions of the webhook: plain functions and types on decoded pods, reports, the
//! configuration and the [`index`] of admission state they are handed, with outcomes as plain enums
//! (the metrics layer maps them to labels). Nothing here does I/O, awaits, locks, reads a clock, logs
//! to a metric or imports a layer above it.
//!
//! - [`mutation`]: which pods get a TEE key request and limit annotations ([`mutation::patch`]
//!   builds the JSON Patch).
//! - [`validation`]: a node's figures, the verdicts and their messages, stale reports, enforce/warn
//!   ([`validation::candidates`]: the scan over candidate nodes; [`validation::limits`]: forged or
//!   changed cgroup-limit annotations).
//! - [`holds`]: the life of a key: a hold, who owns it, why it ends.
//! - [`index`]: one replica's admission state (nodes, reports, holds, launcher pods, VMIs) and the
//!   one end rule of a hold.
//! - [`queue`]: the VMIs waiting for a key, their turns, and which of them free keys serve.
//! - [`admit`]: the keys available to a claimant, the decisions at pod CREATE, at the binding and
//!   for the retry planner, and the hold each admission writes.
//! - [`affinity`]: whether a node matches a pod's node selector and required node affinity.

pub mod admit;
pub mod affinity;
pub mod holds;
pub mod index;
pub mod lead;
pub mod mutation;
pub mod queue;
#[cfg(test)]
pub(crate) mod testkit;
pub mod validation;
