//! What every admission handler shares.

use std::sync::Arc;
use std::time::Duration;

use teeguard_shared::Config;

use crate::cluster::caches::Caches;
use crate::cluster::events::EventSink;
use crate::decide::ledger::Ledger;
use crate::metrics::Metrics;

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

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits {
            max_body_bytes: DEFAULT_MAX_BODY_BYTES,
            request_timeout: Duration::from_secs(30),
        }
    }
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
    /// The validating webhook's ledger and Event sink.
    pub validation: ValidationState,
}

/// What the validating webhook keeps between requests. Cheap to clone.
#[derive(Clone, Debug)]
pub struct ValidationState {
    /// Keys admitted onto nodes and not in their reports yet (this replica only).
    pub ledger: Arc<Ledger>,
    /// Where `InsufficientTEEKeys` Events go (`None`: none are recorded).
    pub events: Option<EventSink>,
    /// Reservations shared by every replica (`None`: `admission.sharedReservations` off).
    pub shared: Option<crate::cluster::reservations::SharedReservations>,
    /// Keys promised to the VMIs the retry task retried (`admission.retryRefusedVmis`).
    pub promises: Arc<crate::decide::retry::Promises>,
}
