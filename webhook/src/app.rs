//! `serve`: wire configuration, TLS, caches, the admission router, the admin port and shutdown.
//!
//! Start-up order: configuration, then the certificate pair (a bad pair fails here, before any port is
//! bound), then both ports, then caches and the servers. `/readyz` turns ready once every cache has
//! synced (TLS is loaded by then) and not ready again as soon as shutdown starts.
//!
//! Shutdown (SIGTERM): `/readyz` turns not ready at once; the HTTPS server keeps serving for
//! `--shutdown-grace`, then stops accepting and drains for up to `--drain-timeout` (see
//! [`crate::web::server`]). The caches, the Event sink, the index sweep, the retry planner
//! ([`crate::cluster::retry`]) and the certificate reloader
//! keep running until the HTTPS server has stopped, so answers during the grace and the drain are made
//! from live caches; the admin port stops last.

use std::net::SocketAddr;
use std::sync::Arc;

use kube::{Api, Client};
use prometheus_client::registry::Registry;
use teeguard_shared::Config;
use teeguard_shared::ops::{Readiness, admin_router, bind_admin, cancel_on_signal, serve_admin};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::cli::ServeArgs;
use crate::cluster::caches::Caches;
use crate::cluster::events::EventSink;
use crate::cluster::holds::ApiHolds;
use crate::cluster::index::{KeyIndex, wall_clock};
use crate::cluster::lead::{Leadership, LeaseApis, Round};
use crate::cluster::retry::Retrier;
use crate::decide::lead::Elector;
use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::web::forward::Forwarder;
use crate::web::server::{ServerSettings, serve_https};
use crate::web::state::{AppState, RequestLimits, ValidationState};
use crate::web::tls::{CertReloader, install_crypto_provider, server_config};

/// Readiness check: every cache has synced.
pub const READY_CACHES: &str = "caches";
/// Readiness check: the serving certificate is loaded.
pub const READY_TLS: &str = "tls";
/// Readiness check: the decider Lease has been read once, so the replica
/// knows whether it decides or where to forward.
pub const READY_DECIDER: &str = "decider";
/// Readiness check: the server accepts connections (false once shutdown starts).
pub const READY_ACCEPTING: &str = "accepting";

/// A started webhook.
#[derive(Debug)]
pub struct Running {
    /// The bound HTTPS address.
    pub https_addr: SocketAddr,
    /// The bound admin address.
    pub admin_addr: SocketAddr,
    /// Readiness, as `/readyz` reports it.
    pub readiness: Readiness,
    /// The caches.
    pub caches: Caches,
    shutdown: CancellationToken,
    task: JoinHandle<Result<()>>,
}

impl Running {
    /// Start shutting down (what SIGTERM does).
    pub fn shutdown(&self) {
        self.shutdown.cancel();
    }

    /// Wait until the webhook has stopped (after shutdown and drain).
    pub async fn wait(self) -> Result<()> {
        match self.task.await {
            Ok(r) => r,
            Err(e) => Err(Error::Task {
                what: "webhook",
                reason: e.to_string(),
            }),
        }
    }
}

/// Start the webhook with `client` for the caches; it stops when `shutdown` is cancelled.
pub async fn start(
    args: &ServeArgs,
    client: Client,
    shutdown: CancellationToken,
) -> Result<Running> {
    install_crypto_provider();
    let config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::new(&mut registry));

    let (reloader, served) = CertReloader::load(&args.cert_dir, metrics.clone())?;
    // Watching before the port is served: a rotation right after start-up is not left to the
    // periodic check.
    let cert_watch = reloader.watch(args.cert_check_interval);
    let tls = server_config(served.clone())?;

    let listener = crate::web::server::bind(args.listen).await?;
    let https_addr = listener.local_addr().map_err(|source| Error::Bind {
        addr: args.listen,
        source,
    })?;
    let admin = bind_admin(args.admin_listen).await?;
    let admin_addr = admin.local_addr().map_err(|source| Error::Bind {
        addr: args.admin_listen,
        source,
    })?;

    let readiness = Readiness::new(&[READY_CACHES, READY_TLS, READY_ACCEPTING, READY_DECIDER]);
    readiness.set(READY_TLS, true);
    readiness.set(READY_ACCEPTING, true);

    // Stopped once the HTTPS server has drained, not at SIGTERM: requests are still answered until then.
    let background = CancellationToken::new();
    let index = KeyIndex::with_key_resources(
        config.admission.ledger_ttl,
        wall_clock(),
        config.resources.resource_names(),
    );
    let (caches, cache_tasks) = Caches::start(
        client.clone(),
        metrics.clone(),
        args.api_timeout,
        index.clone(),
        background.clone(),
    );
    let (events, events_task) = EventSink::start(
        client.clone(),
        std::env::var("POD_NAME").ok().filter(|n| !n.is_empty()),
        metrics.clone(),
        args.api_timeout,
        background.clone(),
    );
    let sweep_task = tokio::spawn(sweep(index.clone(), background.clone()));
    {
        let caches = caches.clone();
        let readiness = readiness.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = caches.wait_synced() => {
                    readiness.set(READY_CACHES, true);
                    tracing::info!(
                        vmis = caches.vmis.len(),
                        namespaces = caches.namespaces.len(),
                        nodes = caches.index.read().nodes().count(),
                        launcher_pods = caches.launcher_pods.len(),
                        "caches synced"
                    );
                }
                _ = shutdown.cancelled() => {}
            }
        });
    }
    {
        let readiness = readiness.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            shutdown.cancelled().await;
            readiness.set(READY_ACCEPTING, false);
        });
    }
    let reloader_task =
        tokio::spawn(reloader.run(cert_watch, args.cert_check_interval, background.clone()));

    let admin_shutdown = CancellationToken::new();
    let admin_task = tokio::spawn(serve_admin(
        admin,
        admin_router(readiness.clone(), Arc::new(registry)),
        admin_shutdown.clone(),
    ));

    let replica = replica_name();
    // One replica, elected through the Lease, decides in memory and writes its holds behind into
    // each node's TeeReservation; the others forward (crate::cluster::lead, crate::web::forward).
    let address = decider_address(args, https_addr)?;
    let terms = crate::decide::lead::Terms::of_lease(config.admission.decider_lease);
    // Unique per process, as client-go's `hostname_uuid`: a restarted replica is a new holder.
    let identity = format!(
        "{replica}_{}-{}",
        std::process::id(),
        jiff::Timestamp::now().as_millisecond()
    );
    let leadership = Leadership::new(Elector::new(identity, address, terms), wall_clock());
    let lease_stop = CancellationToken::new();
    let lease = {
        let synced = caches.clone();
        let (ready, gauge) = (readiness.clone(), metrics.clone());
        let apis = LeaseApis {
            lease: Api::namespaced(client.clone(), client.default_namespace()),
            name: args.decider_lease_name.clone(),
            holds: ApiHolds::new(client.clone()),
            index: index.clone(),
            within: args.api_timeout,
        };
        leadership.clone().run(
            apis,
            async move { synced.wait_synced().await },
            move |round: Round| {
                gauge.set_decider(round.deciding);
                if round.read {
                    ready.set(READY_DECIDER, true);
                }
            },
            lease_stop.clone(),
        )
    };
    let behind = tokio::spawn(crate::cluster::holds::write_behind(
        index.clone(),
        ApiHolds::new(client.clone()),
        args.api_timeout,
        metrics.clone(),
        background.clone(),
    ));
    // At a stop, the Lease is given up only once the last holds are written: a successor takes it at
    // once and starts from them.
    let handoff = {
        let leadership = leadership.clone();
        tokio::spawn(async move {
            if !behind.await.unwrap_or(false) {
                leadership.keep_at_stop();
            }
            lease_stop.cancel();
            let _ = lease.await;
        })
    };
    let forwarder = Forwarder::new(served.clone(), &args.cert_dir, args.api_timeout)?;
    let config = Arc::new(config);
    // Promises free keys to the waiting VMIs and retries them (crate::cluster::retry), and publishes
    // the holds and waiting gauges; stopped with the caches.
    let retry_task = {
        let synced = caches.clone();
        Retrier {
            index: index.clone(),
            client: client.clone(),
            store: ApiHolds::new(client.clone()),
            config: config.clone(),
            replica: replica.clone(),
            metrics: metrics.clone(),
            events: events.clone(),
            api_timeout: args.api_timeout,
            leadership: leadership.clone(),
        }
        .start(
            async move { synced.wait_synced().await },
            background.clone(),
        )
    };
    let state = AppState {
        config,
        caches: caches.clone(),
        metrics,
        limits: RequestLimits {
            max_body_bytes: args.max_body_bytes,
            request_timeout: args.request_timeout,
        },
        validation: ValidationState {
            events: Some(events),
            hints: Arc::default(),
            replica,
            leadership,
            forwarder,
        },
    };
    let settings = ServerSettings {
        handshake_timeout: args.handshake_timeout,
        header_read_timeout: args.header_read_timeout,
        write_stall_timeout: args.write_stall_timeout,
        shutdown_grace: args.shutdown_grace,
        drain_timeout: args.drain_timeout,
        max_connections: args.max_connections,
        ..ServerSettings::default()
    };
    let router = crate::web::handlers::router(state);
    let https_shutdown = shutdown.clone();
    let task = tokio::spawn(async move {
        let served = serve_https(listener, tls, router, settings, https_shutdown).await;
        background.cancel();
        // The admin port outlives the drain so probes see "not ready" rather than a refused port.
        admin_shutdown.cancel();
        let admin = admin_task.await;
        cache_tasks.join().await;
        let _ = reloader_task.await;
        let _ = events_task.await;
        let _ = sweep_task.await;
        let _ = retry_task.await;
        let _ = handoff.await;
        served?;
        match admin {
            Ok(r) => r.map_err(Error::from),
            Err(e) => Err(Error::Task {
                what: "admin server",
                reason: e.to_string(),
            }),
        }
    });
    Ok(Running {
        https_addr,
        admin_addr,
        readiness,
        caches,
        shutdown,
        task,
    })
}

/// Every second, forget what the index no longer needs (deletions and counts older than any hold
/// lives, local holds that ended).
async fn sweep(index: KeyIndex, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tick.tick() => index.sweep(),
        }
    }
}

/// `teeguard-webhook serve`: start with the in-cluster (or kubeconfig) client and run until SIGTERM.
pub async fn run(args: ServeArgs) -> Result<()> {
    install_crypto_provider();
    // Fail on a bad configuration file or certificate before trying to reach the cluster.
    if let Some(path) = &args.config {
        Config::load(path)?;
    }
    crate::web::tls::load_pair(&args.cert_dir)?;
    let client = Client::try_default().await.map_err(Error::KubeClient)?;
    let shutdown = CancellationToken::new();
    let running = start(&args, client, shutdown.clone()).await?;
    tracing::info!(https = %running.https_addr, admin = %running.admin_addr, "teeguard-webhook started");
    tokio::spawn(cancel_on_signal(shutdown));
    running.wait().await
}

/// Where the other replicas reach this one: `--decider-address`, else `https://$POD_IP:<port>`, else
/// the listen address when it names one host.
fn decider_address(args: &ServeArgs, https: SocketAddr) -> Result<String> {
    if let Some(a) = args.decider_address.as_ref().filter(|a| !a.is_empty()) {
        return Ok(a.clone());
    }
    let ip = match std::env::var("POD_IP").ok().filter(|ip| !ip.is_empty()) {
        Some(ip) => ip.parse::<std::net::IpAddr>().map_err(|e| {
            Error::DeciderAddress(format!(
                "POD_IP={ip:?} is not an IP address ({e}); set --decider-address"
            ))
        })?,
        None if !https.ip().is_unspecified() => https.ip(),
        // A pod without an IP (hostNetwork on a Node that lists no address): it still serves and
        // may decide, alone; another replica cannot forward to it and refuses those reviews.
        None => {
            tracing::warn!(
                "no address for the other replicas to forward to this one: set POD_IP (the chart \
                 does) or --decider-address; while this replica decides, the others refuse the \
                 reviews that take a key"
            );
            return Ok(String::new());
        }
    };
    Ok(format!("https://{}", SocketAddr::new(ip, https.port())))
}

/// This replica's name in its holds: the pod's name (`POD_NAME`, from the downward API), else
/// the host name.
fn replica_name() -> String {
    std::env::var("POD_NAME")
        .ok()
        .filter(|n| !n.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|n| !n.is_empty()))
        .unwrap_or_else(|| "teeguard-webhook".into())
}
