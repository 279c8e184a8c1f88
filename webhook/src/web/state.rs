//! What every admission handler shares.

use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use teeguard_shared::{Config, TeeKind};

use crate::cluster::caches::Caches;
use crate::cluster::events::EventSink;
use crate::cluster::holds::ApiHolds;
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
    /// What the validating webhook writes with.
    pub validation: ValidationState,
}

/// What the validating webhook writes with (the admission state itself is the caches' index).
#[derive(Clone, Debug)]
pub struct ValidationState {
    /// Where `InsufficientTEEKeys` Events go (`None`: none are recorded).
    pub events: Option<EventSink>,
    /// Where holds are written (`None`: `admission.sharedReservations` off, each replica's own).
    pub store: Option<ApiHolds>,
    /// The node that last fitted a pod of each kind.
    pub hints: Arc<FitHints>,
    /// This replica's name, written into its holds.
    pub replica: String,
    /// Longest the writes of one review may take (`--api-timeout`).
    pub api_timeout: Duration,
}

/// Per TEE kind, the node that last fitted a pod not bound yet: candidate scans stop at the first node
/// that fits, and when most nodes are full a scan in no particular order looks at many before finding
/// one, while the last node that fitted usually still does. Only an order: the verdict is the same
/// whichever node is looked at first.
#[derive(Debug, Default)]
pub struct FitHints {
    nodes: [RwLock<Option<Arc<str>>>; TeeKind::ALL.len()],
}

impl FitHints {
    fn slot(&self, kind: TeeKind) -> &RwLock<Option<Arc<str>>> {
        let at = TeeKind::ALL.iter().position(|k| *k == kind).unwrap_or(0);
        &self.nodes[at]
    }

    /// The node that last fitted a pod of `kind`.
    pub fn get(&self, kind: TeeKind) -> Option<Arc<str>> {
        self.slot(kind)
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Remember `node` as the one that fitted a pod of `kind`.
    pub fn remember(&self, kind: TeeKind, node: &str) {
        *self
            .slot(kind)
            .write()
            .unwrap_or_else(PoisonError::into_inner) = Some(Arc::from(node));
    }
}
