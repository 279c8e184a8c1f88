//! The pure decisions of the webhook: plain functions and types on decoded pods, reports and the
//! configuration, with outcomes as plain enums (the metrics layer maps them to labels). Nothing here
//! does I/O, awaits, logs to a metric or imports a layer above it.
//!
//! - [`mutation`]: which pods get a TEE key request and limit annotations ([`mutation::patch`]
//!   builds the JSON Patch).
//! - [`validation`]: free keys on a node or any candidate node, stale reports, enforce/warn
//!   ([`validation::candidates`]: the scan over candidate nodes; [`validation::limits`]: forged or
//!   changed cgroup-limit annotations).
//! - [`affinity`]: whether a node matches a pod's node selector and required node affinity.
//! - [`ledger`]: keys admitted onto a node that its report does not count yet (this replica);
//! - [`reservations`]: the same, shared by every replica through a `TeeReservation` per node.
//! - [`retry`]: which VMIs wait because teeguard refused their pods, and which a free key retries.

pub mod affinity;
pub mod ledger;
pub mod mutation;
pub mod reservations;
pub mod retry;
pub mod validation;
