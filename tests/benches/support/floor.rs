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
    floor_answer(&body, None)
}

/// Allow the review in `body`, with `patch` (base64 JSON Patch) when given.
fn floor_answer(body: &[u8], patch: Option<&str>) -> Response {
    match serde_json::from_slice::<FloorReview<'_>>(body) {
        Ok(r) => {
            let mut response = json!({"uid": r.request.uid, "allowed": true});
            if let Some(p) = patch {
                response["patchType"] = json!("JSONPatch");
                response["patch"] = json!(p);
            }
            (
                [(header::CONTENT_TYPE, "application/json")],
                json!({
                    "apiVersion": "admission.k8s.io/v1",
                    "kind": "AdmissionReview",
                    "response": response
                })
                .to_string(),
            )
                .into_response()
        }
        Err(e) => (axum::http::StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    }
}

/// A floor whose `/mutate` answers every review with the same JSON Patch (`patch_b64`): what the API
/// server spends applying a patch, without any decision behind it.
pub async fn start_patching_floor(cert_dir: &std::path::Path, patch_b64: String) -> SocketAddr {
    let patch: Arc<str> = patch_b64.into();
    let router = Router::new()
        .route(
            "/mutate",
            post(move |body: Bytes| {
                let patch = patch.clone();
                async move { floor_answer(&body, Some(&patch)) }
            }),
        )
        .route("/validate", post(floor_allow));
    serve(cert_dir, router, Stack::Bare).await
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
    let router = Router::new()
        .route("/mutate", post(floor_allow))
        .route("/validate", post(floor_allow));
    serve(cert_dir, router, stack).await
}

/// Serve `router` over HTTPS on a free port of 127.0.0.1 with `stack`, until the process exits.
async fn serve(cert_dir: &std::path::Path, router: Router, stack: Stack) -> SocketAddr {
    let pair = teeguard_webhook::web::tls::load_pair(cert_dir).expect("certificate pair");
    let store = Arc::new(teeguard_webhook::web::tls::CertStore::new(pair.key));
    let tls = teeguard_webhook::web::tls::server_config(store).expect("TLS config");
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
