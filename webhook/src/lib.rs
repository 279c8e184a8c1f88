//! teeguard's admission webhook.
//!
//! - [`mutation`]: the pure mutating decision (which pods get a TEE key request and misc.max
//!   annotations, and the JSON Patch), tested without any server.
//! - [`admission`]: the AdmissionReview envelope (parse once, respond with a base64 patch).
//! - [`handlers`]: the admission router; [`handlers::mutate`] is `POST /mutate`.
//! - [`caches`]: reflector caches of VMIs and Namespaces ([`caches::Caches`]) behind the
//!   [`caches::Lookups`] trait, with one GET on a miss.
//! - [`tls`]: certificate loading, the hot-swappable resolver and directory watching.
//! - [`server`]: the HTTPS server (rustls, HTTP/1.1 + HTTP/2, graceful drain).
//! - [`app`]: `serve` wiring; [`review`]: the offline `review` command; [`cli`]: flags.
//! - [`metrics`], [`state`], [`error`].

pub mod admission;
pub mod app;
pub mod caches;
pub mod cli;
pub mod error;
pub mod handlers;
pub mod metrics;
pub mod mutation;
pub mod review;
pub mod server;
pub mod state;
pub mod tls;

pub use error::{Error, Result};
