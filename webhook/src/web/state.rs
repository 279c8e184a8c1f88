//! What every admission handler shares.

use std::sync::Arc;
use std::time::Duration;

use teeguard_shared::Config;

use crate::cluster::admission::FitHints;
use crate::cluster::caches::Caches;
use crate::cluster::events::EventSink;
use crate::cluster::lead::Leadership;
use crate::metrics::Metrics;
use crate::web::forward::Forwarder;

/// Default request body limit: 7 MiB (the API server sends at most 3 MiB objects, twice in an
/// UPDATE review, plus the envelope).
pub const DEFAULT_MAX_BODY_BYTES: usize = 7 * 1024 * 1024;

/// Per-request limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestLimits {
    /// Largest request body accepted; larger ones get 413.
    pub max_body_bytes: usize,
    /// Time from the request head to the response (body read included).
    pub request_timeout: Duration,
}

/// State of the admission router: configuration, caches, metrics and limits. Cheap to clone.
#[derive(Clone, Debug)]
pub struct AppState {
    /// The shared configuration (resource names, enforcement, admission policy).
    pub config: Arc<Config>,
    /// The object caches (and the client for GETs on a miss).
    pub caches: Caches,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Body size and time limits.
    pub limits: RequestLimits,
    /// What the validating webhook writes with.
    pub validation: ValidationState,
}

/// What the validating webhook writes with (the admission state itself is the caches' index).
#[derive(Clone, Debug)]
pub struct ValidationState {
    /// Where `InsufficientTEEKeys` Events go (`None`: none are recorded).
    pub events: Option<EventSink>,
    /// The node that last fitted a pod of each kind.
    pub hints: Arc<FitHints>,
    /// This replica's name, written into its holds.
    pub replica: String,
    /// The election of the replica that decides the reviews that take a key.
    pub leadership: Leadership,
    /// The connection to the deciding replica.
    pub forwarder: Forwarder,
}
