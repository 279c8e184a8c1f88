//! Process plumbing both binaries share: structured logging, the plain-HTTP admin port
//! (`/livez`, `/readyz`, `/metrics`) and shutdown on SIGTERM / Ctrl-C.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Install the global `tracing` subscriber. The filter comes from `RUST_LOG` (default `info`).
/// Calling it twice is harmless (the second call does nothing), which keeps tests simple.
pub fn init_tracing(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

/// Named readiness checks; the process is ready when every check is true.
#[derive(Clone, Debug, Default)]
pub struct Readiness {
    checks: Arc<Mutex<BTreeMap<&'static str, bool>>>,
}

impl Readiness {
    /// Readiness with the given checks, all initially false.
    pub fn new(checks: &[&'static str]) -> Self {
        let map = checks.iter().map(|c| (*c, false)).collect();
        Readiness {
            checks: Arc::new(Mutex::new(map)),
        }
    }

    /// Set one check (adding it if unknown).
    pub fn set(&self, check: &'static str, ready: bool) {
        self.lock().insert(check, ready);
    }

    /// True when every check is true.
    pub fn is_ready(&self) -> bool {
        self.lock().values().all(|v| *v)
    }

    /// The checks that are not ready yet.
    pub fn pending(&self) -> Vec<&'static str> {
        self.lock()
            .iter()
            .filter(|(_, v)| !**v)
            .map(|(k, _)| *k)
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<&'static str, bool>> {
        // A poisoned lock only means a panic elsewhere while holding it; the map is still valid.
        self.checks.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Clone)]
struct AdminState {
    readiness: Readiness,
    registry: Arc<Registry>,
}

/// The admin router: `/livez` (always 200 while the process serves), `/readyz` (200 when every
/// readiness check passes, else 503 naming the pending ones) and `/metrics` (OpenMetrics text).
pub fn admin_router(readiness: Readiness, registry: Arc<Registry>) -> Router {
    Router::new()
        .route("/livez", get(|| async { "ok\n" }))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(AdminState {
            readiness,
            registry,
        })
}

async fn readyz(State(s): State<AdminState>) -> Response {
    let pending = s.readiness.pending();
    if pending.is_empty() {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: waiting for {}\n", pending.join(", ")),
        )
            .into_response()
    }
}

async fn metrics(State(s): State<AdminState>) -> Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, &s.registry) {
        Ok(()) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode metrics: {e}\n"),
        )
            .into_response(),
    }
}

/// Bind the admin port. Binding is separate from serving so start-up fails early on a taken port.
pub async fn bind_admin(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| Error::AdminServer {
            addr: addr.to_string(),
            source,
        })
}

/// Serve the admin router until `shutdown` is cancelled.
pub async fn serve_admin(
    listener: TcpListener,
    router: Router,
    shutdown: CancellationToken,
) -> Result<()> {
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "admin listener".into());
    axum::serve(listener, router)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
        .map_err(|source| Error::AdminServer { addr, source })
}

/// Resolve when the process is asked to stop (SIGTERM, SIGINT or Ctrl-C), then cancel `token`.
pub async fn cancel_on_signal(token: CancellationToken) {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
        _ = token.cancelled() => {}
    }
    tracing::info!("shutdown requested");
    token.cancel();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn admin_endpoints_over_http() {
        let readiness = Readiness::new(&["caches", "tls"]);
        let mut registry = Registry::default();
        let counter = prometheus_client::metrics::counter::Counter::<u64>::default();
        registry.register("teeguard_test_events", "Test events", counter.clone());
        counter.inc();
        let listener = bind_admin("127.0.0.1:0".parse().expect("addr"))
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let token = CancellationToken::new();
        let server = tokio::spawn(serve_admin(
            listener,
            admin_router(readiness.clone(), Arc::new(registry)),
            token.clone(),
        ));

        let get = |path: &'static str| async move {
            let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            stream
                .write_all(
                    format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                        .as_bytes(),
                )
                .await
                .expect("write");
            let mut out = String::new();
            stream.read_to_string(&mut out).await.expect("read");
            out
        };
        assert!(get("/livez").await.starts_with("HTTP/1.1 200"));
        let r = get("/readyz").await;
        assert!(
            r.starts_with("HTTP/1.1 503") && r.contains("caches, tls"),
            "{r}"
        );
        readiness.set("caches", true);
        readiness.set("tls", true);
        assert!(get("/readyz").await.starts_with("HTTP/1.1 200"));
        let m = get("/metrics").await;
        assert!(m.contains("teeguard_test_events_total 1"), "{m}");

        token.cancel();
        tokio::time::timeout(std::time::Duration::from_secs(5), server)
            .await
            .expect("admin server stops on cancel")
            .expect("join")
            .expect("serve");
    }
}

/// Exponential backoff with ±20 % jitter for watches and API retries (both binaries): many agents or
/// replicas never retry in lockstep after an API server restart.
#[derive(Clone, Debug)]
pub struct Backoff {
    initial: Duration,
    max: Duration,
    next: Duration,
    seed: u64,
}

impl Backoff {
    /// Start at `initial`, double up to `max`, with ±20 % jitter.
    pub fn new(initial: Duration, max: Duration) -> Backoff {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0x9E37_79B9_7F4A_7C15)
            | 1;
        Backoff {
            initial,
            max: max.max(initial),
            next: initial,
            seed,
        }
    }

    /// The next delay.
    pub fn next_delay(&mut self) -> Duration {
        let base = self.next;
        self.next = (self.next * 2).min(self.max);
        // xorshift64: cheap jitter so that a DaemonSet does not retry in lockstep.
        self.seed ^= self.seed << 13;
        self.seed ^= self.seed >> 7;
        self.seed ^= self.seed << 17;
        let permille = 800 + (self.seed % 401); // 0.8 ..= 1.2
        base.mul_f64(permille as f64 / 1000.0)
    }

    /// Back to the initial delay (after a success).
    pub fn reset(&mut self) {
        self.next = self.initial;
    }
}

impl Iterator for Backoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        Some(self.next_delay())
    }
}

impl kube::runtime::utils::Backoff for Backoff {
    fn reset(&mut self) {
        Backoff::reset(self);
    }
}
