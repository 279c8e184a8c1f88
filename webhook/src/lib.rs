//! teeguard's admission webhook.
//!
//! - [`mutation`]: the pure mutating decision (which pods get a TEE key request and misc.max
//!   annotations, and the JSON Patch), tested without any server.
//! - [`validation`]: the pure validating decision (free keys on a node or on any candidate node,
//!   stale reports, enforce/warn, forged cgroup-limit annotations); [`affinity`]: node selection by
//!   node selector and required node affinity; [`ledger`]: keys admitted but not reported yet.
//! - [`admission`]: the AdmissionReview envelope (parse once, respond with a base64 patch).
//! - [`handlers`]: the admission router; [`handlers::mutate`] is `POST /mutate`,
//!   [`handlers::validate`] is `POST /validate`.
//! - [`caches`]: reflector caches of VMIs, Namespaces, TeeCapacities, Nodes and virt-launcher pods
//!   ([`caches::Caches`]) behind the [`caches::Lookups`] trait, with one GET on a miss; [`pods`]: the
//!   reduced pod type of the pod cache.
//! - [`events`]: `InsufficientTEEKeys` Events on VMIs, off the hot path.
//! - [`tls`]: certificate loading, the hot-swappable resolver and directory watching.
//! - [`server`]: the HTTPS server (rustls, HTTP/1.1 + HTTP/2, graceful drain).
//! - [`app`]: `serve` wiring; [`review`]: the offline `review` command; [`cli`]: flags.
//! - [`metrics`], [`state`], [`error`].

pub mod admission;
pub mod admitted;
pub mod affinity;
pub mod app;
pub mod caches;
pub mod cli;
pub mod error;
pub mod events;
pub mod handlers;
pub mod ledger;
pub mod metrics;
pub mod mutation;
pub mod pods;
pub mod review;
pub mod server;
pub mod stall;
pub mod state;
pub mod tls;
pub mod validation;

pub use error::{Error, Result};
