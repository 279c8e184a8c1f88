//! The floor every latency bench compares teeguard with: a minimal axum + rustls server with the
//! webhook's own TLS configuration (same certificate, ring, TLS 1.3, same hyper-util connection
//! builder) whose handler parses the review to get the uid and answers "allowed".

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use serde::Deserialize;
use serde_json::json;
use teeguard_webhook::web::server::ServerSettings;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

#[derive(Deserialize)]
struct FloorReview<'a> {
    #[serde(borrow)]
    request: FloorRequest<'a>,
}

#[derive(Deserialize)]
struct FloorRequest<'a> {
    #[serde(borrow)]
    uid: Cow<'a, str>,
}

/// The floor's handler: parse the review (the whole body, like any webhook) and allow it.
async fn floor_allow(body: Bytes) -> Response {
    match serde_json::from_slice::<FloorReview<'_>>(&body) {
        Ok(r) => (
            [(header::CONTENT_TYPE, "application/json")],
            json!({
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "response": {"uid": r.request.uid, "allowed": true}
            })
            .to_string(),
        )
            .into_response(),
        Err(e) => (axum::http::StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    }
}

/// Which server stack serves the floor's handler.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Stack {
    /// A bare accept loop: tokio-rustls and hyper-util's auto builder, nothing else.
    Bare,
    /// The webhook's own `serve_https` (connection limit, handshake / header-read / write-stall
    /// timeouts, graceful drain): tells the cost of those from the cost of the handler.
    Webhook,
}

/// Start the floor server with the webhook's TLS configuration, serving `cert_dir`'s pair.
pub async fn start_floor(cert_dir: &std::path::Path, stack: Stack) -> SocketAddr {
    let pair = teeguard_webhook::web::tls::load_pair(cert_dir).expect("certificate pair");
    let store = Arc::new(teeguard_webhook::web::tls::CertStore::new(pair.key));
    let tls = teeguard_webhook::web::tls::server_config(store).expect("TLS config");
    let router = Router::new()
        .route("/mutate", post(floor_allow))
        .route("/validate", post(floor_allow));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind floor");
    let addr = listener.local_addr().expect("floor addr");
    if stack == Stack::Webhook {
        // Runs until the bench process exits (the token is never cancelled).
        tokio::spawn(teeguard_webhook::web::server::serve_https(
            listener,
            tls,
            router,
            ServerSettings::default(),
            CancellationToken::new(),
        ));
        return addr;
    }
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let acceptor = acceptor.clone();
            let service = TowerToHyperService::new(router.clone());
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(stream).await else {
                    return;
                };
                let _ = auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
    addr
}
