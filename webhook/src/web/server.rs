//! The HTTPS server: a tokio `TcpListener`, a rustls `TlsAcceptor` and hyper-util's auto
//! (HTTP/1.1 keep-alive + HTTP/2) connection builder serving the axum router, with graceful drain.
//!
//! Every connection runs in its own task, so a slow or failing TLS handshake never blocks the accept
//! loop. Concurrent connections are capped with a semaphore (the accept loop waits for a free slot,
//! leaving further clients in the kernel's backlog).
//!
//! Shutdown has two phases, so that a rolling restart fails no admission:
//!
//! 1. **Grace** (`shutdown_grace`, zero by default): the pod's endpoint is being removed from the
//!    Service, but kube-proxy on the API server's node may still send new connections here for a few
//!    seconds, and established keep-alive connections carry on. The server keeps accepting and serving
//!    everything (`/readyz` already says not ready, see `app.rs`), and answers every HTTP/1.1 request
//!    with `Connection: close`, so each client moves off after its next answer without a race: it
//!    reconnects through the Service to a replica that stays.
//! 2. **Drain** (`drain_timeout`): the listener is closed (new connections are refused), in-flight
//!    requests finish, idle keep-alive connections are closed (HTTP/2 ones get a GOAWAY), and whatever
//!    is still running after the drain timeout is aborted.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use http::{HeaderValue, header};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tower::util::MapResponse;

use crate::error::{Error, Result};
use crate::web::stall::WriteStallGuard;

/// Connection-level limits of the HTTPS server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerSettings {
    /// Time allowed for the TLS handshake.
    pub handshake_timeout: Duration,
    /// Time allowed to receive a request's headers (HTTP/1.1).
    pub header_read_timeout: Duration,
    /// Time a response write may make no progress before the connection is closed (a client that
    /// stops reading must not hold its connection slot forever).
    pub write_stall_timeout: Duration,
    /// After shutdown starts, how long the server goes on accepting and serving (while endpoint
    /// removal propagates) before it stops accepting and drains.
    pub shutdown_grace: Duration,
    /// Time allowed for in-flight requests to finish once the listener is closed.
    pub drain_timeout: Duration,
    /// Connections served at once; further clients wait in the listen backlog.
    pub max_connections: usize,
    /// HTTP/2 streams per connection.
    pub max_concurrent_streams: u32,
}

impl Default for ServerSettings {
    fn default() -> Self {
        ServerSettings {
            handshake_timeout: Duration::from_secs(10),
            header_read_timeout: Duration::from_secs(10),
            write_stall_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::ZERO,
            drain_timeout: Duration::from_secs(25),
            max_connections: 1024,
            max_concurrent_streams: 256,
        }
    }
}

/// Bind the HTTPS port.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| Error::Bind { addr, source })
}

fn connection_builder(settings: &ServerSettings) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .keep_alive(true)
        .header_read_timeout(settings.header_read_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_concurrent_streams(settings.max_concurrent_streams)
        .keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10));
    builder
}

/// Resolves `grace` after `shutdown` is cancelled: when the accept loop stops.
async fn stop_accepting(shutdown: CancellationToken, grace: Duration) {
    shutdown.cancelled().await;
    if grace.is_zero() {
        return;
    }
    tracing::info!(
        shutdown_grace_s = grace.as_secs_f64(),
        "shutdown started: /readyz reports not ready; still accepting and serving (HTTP/1.1 answers \
         carry `Connection: close`) for the shutdown grace"
    );
    tokio::time::sleep(grace).await;
}

/// Serve `router` over TLS on `listener` until `shutdown` is cancelled; keep serving for
/// `settings.shutdown_grace`, then stop accepting and drain (see the module documentation).
pub async fn serve_https(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    router: Router,
    settings: ServerSettings,
    shutdown: CancellationToken,
) -> Result<()> {
    let local = listener.local_addr().ok();
    let acceptor = TlsAcceptor::from(tls);
    let builder = connection_builder(&settings);
    let slots = Arc::new(Semaphore::new(settings.max_connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut conns = JoinSet::new();
    tracing::info!(addr = ?local, "serving HTTPS");
    let stop = stop_accepting(shutdown.clone(), settings.shutdown_grace);
    tokio::pin!(stop);

    loop {
        while conns.try_join_next().is_some() {}
        let permit = tokio::select! {
            _ = &mut stop => break,
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let (stream, peer) = tokio::select! {
            _ = &mut stop => break,
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Typically EMFILE: back off briefly instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let acceptor = acceptor.clone();
        let builder = builder.clone();
        let router = router.clone();
        let shutdown = shutdown.clone();
        let watcher = graceful.watcher();
        let handshake_timeout = settings.handshake_timeout;
        let write_stall_timeout = settings.write_stall_timeout;
        conns.spawn(async move {
            let _permit = permit;
            let tls = match tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await {
                Ok(Ok(tls)) => tls,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "TLS handshake timed out");
                    return;
                }
            };
            // Once shutdown has started, an HTTP/1.1 answer closes its connection (HTTP/2 has no
            // `Connection` header; its clients get a GOAWAY when the drain starts).
            let http1 = tls.get_ref().1.alpn_protocol() != Some(b"h2");
            let service = TowerToHyperService::new(MapResponse::new(
                router,
                move |mut response: axum::response::Response| {
                    if http1 && shutdown.is_cancelled() {
                        response
                            .headers_mut()
                            .insert(header::CONNECTION, HeaderValue::from_static("close"));
                    }
                    response
                },
            ));
            let conn = builder
                .serve_connection(
                    TokioIo::new(WriteStallGuard::new(tls, write_stall_timeout)),
                    service,
                )
                .into_owned();
            if let Err(e) = watcher.watch(conn).await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }

    drop(listener);
    tracing::info!(
        connections = conns.len(),
        drain_timeout_s = settings.drain_timeout.as_secs_f64(),
        "HTTPS listener closed; draining connections"
    );
    if tokio::time::timeout(settings.drain_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            connections = conns.len(),
            "drain timeout reached; closing the remaining connections"
        );
        conns.abort_all();
    }
    while conns.join_next().await.is_some() {}
    tracing::info!("HTTPS server stopped");
    Ok(())
}
