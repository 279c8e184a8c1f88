//! Errors of the standalone mode and the API-server driver.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::fakeapi::FakeApiError;
use crate::host::HostError;

/// Errors of [`crate::standalone`]. Messages name what failed and, where there is one, what to do.
#[derive(Debug, thiserror::Error)]
pub enum StandaloneError {
    /// The webhook's port could not be reached.
    #[error("cannot connect to the webhook at {addr}: {source}")]
    Connect {
        /// Where.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The TLS handshake with the webhook failed (wrong CA, wrong name, server gone).
    #[error("TLS handshake with the webhook at {addr} failed: {source}")]
    Tls {
        /// Where.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An HTTP exchange failed below the application level.
    #[error("HTTP {method} {url} failed: {reason}")]
    Http {
        /// Method.
        method: &'static str,
        /// Target.
        url: String,
        /// Why.
        reason: String,
    },
    /// The webhook answered with an HTTP error instead of an AdmissionReview.
    #[error("the webhook answered POST {path} with HTTP {status}: {body}")]
    HttpStatus {
        /// Endpoint.
        path: String,
        /// HTTP status.
        status: u16,
        /// Response body (trimmed).
        body: String,
    },
    /// The webhook's answer is not a usable AdmissionReview.
    #[error("the webhook's answer on {path} is not a valid AdmissionReview response: {reason}")]
    BadReply {
        /// Endpoint.
        path: String,
        /// Why.
        reason: String,
    },
    /// The patch returned by `/mutate` does not apply to the object it was computed for.
    #[error("the JSON patch from /mutate does not apply to pod {pod}: {reason}")]
    Patch {
        /// Pod (namespace/name or generateName).
        pod: String,
        /// Why.
        reason: String,
    },
    /// An object did not have the shape the driver expects.
    #[error("{what}: {reason}")]
    Object {
        /// Which object.
        what: String,
        /// Why.
        reason: String,
    },
    /// The fake API server refused a write or a lookup.
    #[error(transparent)]
    Api(#[from] FakeApiError),
    /// The simulated host refused a change.
    #[error(transparent)]
    Host(#[from] HostError),
    /// A wait passed its deadline.
    #[error("timed out after {after:?} waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// Deadline.
        after: Duration,
    },
    /// A file or directory operation failed.
    #[error("cannot {op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A port the standalone needs is taken.
    #[error(
        "cannot listen on {addr}: the port is in use (another teeguard-standalone?). \
         Pick another one with --port <N>, or --port 0 for any free port"
    )]
    PortInUse {
        /// The address.
        addr: SocketAddr,
    },
    /// The webhook failed to start or stopped with an error.
    #[error("webhook: {0}")]
    Webhook(#[from] teeguard_webhook::Error),
    /// The agent failed to start or stopped with an error.
    #[error("agent: {0}")]
    Agent(#[from] teeguard_agent::Error),
    /// Certificate generation failed.
    #[error("certificates: {0}")]
    Certs(#[from] teeguard_certs::Error),
    /// Start-up of a component failed for another reason.
    #[error("{what}: {reason}")]
    Startup {
        /// Which component.
        what: &'static str,
        /// Why.
        reason: String,
    },
}

/// Result alias of [`crate::standalone`].
pub type Result<T, E = StandaloneError> = std::result::Result<T, E>;
