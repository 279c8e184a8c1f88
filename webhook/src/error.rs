//! The webhook crate's one error type, and its HTTP rendering (`{"error": "..."}`).

use std::net::SocketAddr;
use std::path::PathBuf;

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};

/// Result with the webhook's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the webhook. Each message names the thing that failed and, where
/// there is one, what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request body is not a usable `admission.k8s.io/v1` AdmissionReview.
    #[error("malformed AdmissionReview: {0}")]
    BadReview(String),
    /// The request body exceeds the configured limit.
    #[error(
        "request body exceeds the {limit}-byte limit (raise --max-body-bytes / TEEGUARD_MAX_BODY_BYTES if this is legitimate)"
    )]
    PayloadTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The request body could not be read (client went away, protocol error, read timeout).
    #[error("cannot read the request body: {0}")]
    ReadBody(String),
    /// The request was not answered within the request timeout.
    #[error("request not answered within {0:?}")]
    Timeout(std::time::Duration),
    /// A TLS file could not be read.
    #[error("cannot read TLS {what} {path}: {source}")]
    TlsRead {
        /// `certificate` or `private key`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A TLS file was read but is not a usable certificate chain or private key.
    #[error("invalid TLS {what} {path}: {reason}")]
    TlsInvalid {
        /// `certificate` or `private key`.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The private key does not belong to the certificate.
    #[error(
        "TLS private key {key} does not match the certificate {cert}: {reason}; mount a matching tls.crt/tls.key pair"
    )]
    TlsKeyMismatch {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// rustls' explanation.
        reason: String,
    },
    /// The rustls server configuration could not be built.
    #[error("cannot configure TLS: {0}")]
    TlsConfig(String),
    /// A review forwarded to this replica, which does not decide (any more): HTTP 503, and the
    /// replica that forwarded it reads the Lease again.
    #[error(
        "this replica does not decide the admissions that take a key ({0}); ask the Lease again"
    )]
    NotDeciding(String),
    /// The decider's address (where the other replicas forward) is missing or unusable.
    #[error("the decider address: {0}")]
    DeciderAddress(String),
    /// The certificate directory could not be watched.
    #[error("cannot watch the certificate directory {path}: {source}")]
    CertWatch {
        /// The directory.
        path: PathBuf,
        /// notify's error.
        #[source]
        source: notify::Error,
    },
    /// The HTTPS port could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A call to the API server failed (`action` names it: `writing TeeReservation n1`). The
    /// callers retry, or refuse the review with this message.
    #[error("{action}: {source}")]
    Api {
        /// What was asked of the API server.
        action: String,
        /// kube's error (boxed: it is large, and errors travel through every hot path's `Result`).
        #[source]
        source: Box<kube::Error>,
    },
    /// The API server did not answer a call in time (a loaded or unreachable API server).
    #[error("{action}: the API server did not answer within {within:?}")]
    ApiTimeout {
        /// What was asked of the API server.
        action: String,
        /// How long it had.
        within: std::time::Duration,
    },
    /// A node's `TeeReservation` changed under every write tried (deciders taking over, the
    /// planner's trims): the holds stay in the decider's index and the write-behind tries again.
    #[error("TeeReservation {node} kept changing ({attempts} conflicting writes)")]
    Conflicts {
        /// The node.
        node: String,
        /// The writes tried.
        attempts: u32,
    },
    /// A review could not be sent to the deciding replica, or its answer not read: the review waits
    /// once for a decider, then is refused with this message.
    #[error("cannot forward the review to the deciding replica at {address}: {reason}")]
    Forward {
        /// The decider's address (`https://host:port`).
        address: String,
        /// What failed (connecting, TLS, HTTP/2, no answer in time, its answer).
        reason: String,
    },
    /// An error from the domain crate (configuration file, admin server).
    #[error(transparent)]
    Shared(#[from] teeguard_shared::Error),
    /// No Kubernetes client could be built (no kubeconfig / in-cluster service account).
    #[error("cannot create a Kubernetes client: {0}")]
    KubeClient(#[source] kube::Error),
    /// An input file for `review` could not be read.
    #[error("cannot read {path}: {source}")]
    FileRead {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// An input file for `review` is not what was expected.
    #[error("{path}: {reason}")]
    FileParse {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A value could not be serialised.
    #[error("cannot serialise {what}: {reason}")]
    Serialize {
        /// What was being serialised.
        what: &'static str,
        /// The serialiser's message.
        reason: String,
    },
    /// The async runtime could not be started.
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// A background task panicked or was cancelled.
    #[error("the {what} task failed: {reason}")]
    Task {
        /// Which task.
        what: &'static str,
        /// The join error.
        reason: String,
    },
    /// Output could not be written.
    #[error("cannot write output: {0}")]
    Output(#[source] std::io::Error),
}

impl Error {
    /// A failed API call; `action` names it.
    pub fn api(action: impl Into<String>, source: kube::Error) -> Error {
        Error::Api {
            action: action.into(),
            source: Box::new(source),
        }
    }

    /// The HTTP status this error is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Error::BadReview(_) | Error::ReadBody(_) => StatusCode::BAD_REQUEST,
            Error::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Error::Timeout(_) | Error::NotDeciding(_) => StatusCode::SERVICE_UNAVAILABLE,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.to_string() }).to_string();
        (
            self.status(),
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn http_errors_are_json() {
        let resp = Error::PayloadTooLarge { limit: 10 }.into_response();
        assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
        let body = axum::body::to_bytes(resp.into_body(), 4096)
            .await
            .expect("body");
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert!(
            v["error"]
                .as_str()
                .expect("error string")
                .contains("10-byte limit")
        );
        assert_eq!(
            Error::BadReview("x".into()).status(),
            StatusCode::BAD_REQUEST
        );
    }
}
