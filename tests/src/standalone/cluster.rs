//! The standalone environment: a fake API server on 127.0.0.1 holding two nodes, a simulated TDX host
//! for `node-a` with the real agent reading it, and the real webhook serving HTTPS with freshly
//! generated certificates. The agent runs through `teeguard_agent::run::run` and the webhook through
//! `teeguard_webhook::app::start`, the entry points the binaries use, with kube clients that talk to
//! the fake API server over TCP like any client built from a kubeconfig. Each client sends its own
//! `User-Agent` ([`WEBHOOK_USER_AGENT`], [`AGENT_USER_AGENT`]), so the request log tells who called what.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser as _;
use k8s_openapi::api::core::v1::Namespace;
use prometheus_client::registry::Registry;
use rustls::pki_types::CertificateDer;
use serde_json::{Value, json};
use teeguard_agent::metrics::Metrics as AgentMetrics;
use teeguard_agent::run::{AgentOptions, READY_PODS, READY_SCAN};
use teeguard_certs::{Bundle, ServingCertRequest};
use teeguard_shared::Config;
use teeguard_shared::ops::Readiness;
use teeguard_webhook::app::Running;
use teeguard_webhook::cli::{Cli, Command};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::client::WebhookClient;
use super::driver::{ApiServerDriver, own_by};
use crate::fakeapi::{FakeApiServer, ServedFakeApi};
use crate::fixtures::{self, NodeBuilder, Tee, Vmi};
use crate::host::{SimHost, TDX};
use crate::{Error, Result};

/// The TDX node the agent runs on.
pub const TEE_NODE: &str = "node-a";
/// A worker without TEE hardware.
pub const PLAIN_NODE: &str = "node-b";
/// Label Kata's RuntimeClasses select nodes by.
pub const KATA_NODE_LABEL: &str = "katacontainers.io/kata-runtime";
/// The committed sample the printed `curl` command sends (relative to the repository root).
pub const SAMPLE_REVIEW: &str = "tests/fixtures/admission/mutate-tdx-pod.json";
/// `User-Agent` of the webhook's kube client, so the fake API server's log tells its calls apart.
pub const WEBHOOK_USER_AGENT: &str = "teeguard-webhook";
/// `User-Agent` of the agent's kube client.
pub const AGENT_USER_AGENT: &str = "teeguard-agent";
/// Every start-up wait is bounded by this.
pub const STARTUP_DEADLINE: Duration = Duration::from_secs(20);

/// Settings of [`Standalone::start`].
#[derive(Clone, Debug)]
pub struct StandaloneOptions {
    /// HTTPS port of the webhook on 127.0.0.1 (0: any free port).
    pub port: u16,
    /// TDX keys of the simulated host.
    pub tdx_keys: u64,
    /// How often the agent reads the kernel's usage.
    pub poll_interval: Duration,
}

impl Default for StandaloneOptions {
    fn default() -> Self {
        StandaloneOptions {
            port: 8443,
            tdx_keys: 8,
            poll_interval: Duration::from_millis(100),
        }
    }
}

/// Where the standalone keeps its files (removed when it stops).
#[derive(Clone, Debug)]
pub struct Paths {
    /// The temporary directory.
    pub dir: PathBuf,
    /// `ca.crt` of the webhook's CA (for `curl --cacert`).
    pub ca_cert: PathBuf,
    /// Directory with `tls.crt`/`tls.key` the webhook serves.
    pub cert_dir: PathBuf,
    /// The configuration file both components read.
    pub config: PathBuf,
    /// A kubeconfig for the fake API server.
    pub kubeconfig: PathBuf,
    /// The sample AdmissionReview with the UID the fake API server gave its VMI.
    pub sample_review: PathBuf,
}

/// A running standalone system.
pub struct Standalone {
    _dir: tempfile::TempDir,
    /// File locations.
    pub paths: Paths,
    /// The fake API server's state.
    pub api: FakeApiServer,
    served: ServedFakeApi,
    /// The simulated host of [`TEE_NODE`].
    pub host: Arc<SimHost>,
    /// The configuration both components read.
    pub config: Config,
    /// The webhook's HTTPS address.
    pub https_addr: SocketAddr,
    /// The webhook's admin address (`/readyz`, `/metrics`).
    pub admin_addr: SocketAddr,
    /// Plays the API server, virt-controller and the scheduler.
    pub driver: ApiServerDriver,
    webhook: Option<Running>,
    agent: Option<JoinHandle<teeguard_agent::Result<()>>>,
    shutdown: CancellationToken,
}

impl std::fmt::Debug for Standalone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Standalone")
            .field("paths", &self.paths)
            .field("https_addr", &self.https_addr)
            .field("api", &self.served.url())
            .finish_non_exhaustive()
    }
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    crate::error::io_at("standalone", op, path)
}

/// The configuration file of the standalone: a fast agent so reports follow each step quickly.
pub fn config_yaml(poll_interval: Duration) -> String {
    format!(
        "# teeguard standalone: one configuration for webhook and agent.\n\
         agent:\n  pollInterval: {}ms\n  heartbeatInterval: 1s\n\
         admission:\n  mode: enforce\n  staleReportAfter: 60s\n",
        poll_interval.as_millis().max(1)
    )
}

impl Standalone {
    /// Start everything and wait until the agent has published its first report and the webhook
    /// answers `/readyz`.
    pub async fn start(opts: &StandaloneOptions) -> Result<Standalone> {
        let dir = crate::error::temp_dir("standalone", "teeguard-standalone-")?;
        let root = dir.path().to_path_buf();

        // Certificates: a fresh CA and a serving certificate for localhost / 127.0.0.1.
        let cert_dir = root.join("certs");
        let bundle: Bundle = teeguard_certs::generate_bundle(&ServingCertRequest::localhost())?;
        let written = bundle.write_to_dir(&cert_dir, false)?;

        let config_text = config_yaml(opts.poll_interval);
        let config_path = root.join("config.yaml");
        std::fs::write(&config_path, &config_text).map_err(io_err("write", &config_path))?;
        let config = Config::from_yaml(&config_text).map_err(|e| Error::Startup {
            what: "configuration",
            reason: e.to_string(),
        })?;

        // The cluster: namespace, two nodes, and the VMI the printed curl sample refers to.
        let api = FakeApiServer::new();
        let served = api.serve().await?;
        let kubeconfig = root.join("kubeconfig");
        served.write_kubeconfig(&kubeconfig)?;
        api.create(&serde_json::from_value::<Namespace>(json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": fixtures::DEFAULT_NAMESPACE, "labels": {"kubernetes.io/metadata.name": fixtures::DEFAULT_NAMESPACE}}
        })).map_err(|e| Error::Startup { what: "namespace", reason: e.to_string() })?)?;
        let node_a = NodeBuilder::new(TEE_NODE)
            .tdx(opts.tdx_keys)
            .label(KATA_NODE_LABEL, "true")
            .to_value();
        api.create(&without_server_fields(node_a))?;
        api.create(&without_server_fields(
            NodeBuilder::new(PLAIN_NODE).to_value(),
        ))?;
        // Seeded with its fixture UID, which the committed sample's pod names as its owner.
        let mut sample_vmi =
            without_server_fields(Vmi::new("tdx-vm").tee(Tee::Tdx).scheduling().build());
        sample_vmi["metadata"]["uid"] = json!(fixtures::object_uid(
            "VirtualMachineInstance",
            fixtures::DEFAULT_NAMESPACE,
            "tdx-vm"
        ));
        let stored = api.create(&sample_vmi)?;
        let sample_uid = stored
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string();
        let committed = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(SAMPLE_REVIEW);
        let sample_review =
            if committed.is_file() && sample_owner_uid(&committed) == Some(sample_uid.clone()) {
                committed
            } else {
                // Run outside a checkout (or the fixture changed): write an equivalent copy.
                let copy = root.join("mutate-tdx-pod.json");
                write_sample_review(&copy, &sample_uid)?;
                copy
            };

        // The simulated host and the agent, in-process, reading it.
        let host = Arc::new(SimHost::builder().capacity(TDX, opts.tdx_keys).build()?);
        let shutdown = CancellationToken::new();
        let agent_client = served.client_with_user_agent(AGENT_USER_AGENT).await?;
        let mut agent_opts = AgentOptions::new(TEE_NODE, host.root(), config.clone());
        agent_opts.backoff_initial = Duration::from_millis(100);
        agent_opts.backoff_max = Duration::from_secs(2);
        agent_opts.api_timeout = Duration::from_secs(5);
        let mut registry = Registry::default();
        let agent_metrics = AgentMetrics::new(&mut registry);
        let agent = tokio::spawn(teeguard_agent::run::run(
            agent_client,
            agent_opts,
            agent_metrics,
            Readiness::new(&[READY_SCAN, READY_PODS]),
            shutdown.child_token(),
        ));

        // The webhook, with exactly the flags a deployment would pass.
        let listen = SocketAddr::from(([127, 0, 0, 1], opts.port));
        let argv = [
            "teeguard-webhook".to_string(),
            "serve".into(),
            "--listen".into(),
            listen.to_string(),
            "--admin-listen".into(),
            "127.0.0.1:0".into(),
            "--cert-dir".into(),
            cert_dir.display().to_string(),
            "--config".into(),
            config_path.display().to_string(),
        ];
        let args = match Cli::try_parse_from(argv) {
            Ok(Cli {
                command: Command::Serve(a),
                ..
            }) => a,
            Ok(_) => {
                return Err(Error::Startup {
                    what: "webhook flags",
                    reason: "`serve` was not parsed as the serve command".into(),
                });
            }
            Err(e) => {
                return Err(Error::Startup {
                    what: "webhook flags",
                    reason: e.to_string(),
                });
            }
        };
        let webhook_client = served.client_with_user_agent(WEBHOOK_USER_AGENT).await?;
        let running =
            match teeguard_webhook::app::start(&args, webhook_client, shutdown.child_token()).await
            {
                Ok(r) => r,
                Err(teeguard_webhook::Error::Bind { addr, source })
                    if source.kind() == std::io::ErrorKind::AddrInUse =>
                {
                    shutdown.cancel();
                    return Err(Error::PortInUse { addr });
                }
                Err(e) => {
                    shutdown.cancel();
                    return Err(e.into());
                }
            };
        let https_addr = running.https_addr;
        let admin_addr = running.admin_addr;

        let ca: CertificateDer<'static> = rustls::pki_types::pem::PemObject::from_pem_slice(
            bundle.ca_pem.as_bytes(),
        )
        .map_err(|e| Error::Startup {
            what: "webhook CA",
            reason: e.to_string(),
        })?;
        let driver = ApiServerDriver::new(
            api.clone(),
            WebhookClient::new(https_addr, ca)?,
            config.resources.clone(),
        )
        .with_ledger_ttl(config.admission.ledger_ttl);
        let mut sa = Standalone {
            _dir: dir,
            paths: Paths {
                dir: root.clone(),
                ca_cert: written.ca_cert,
                cert_dir,
                config: config_path,
                kubeconfig,
                sample_review,
            },
            api,
            served,
            host,
            config,
            https_addr,
            admin_addr,
            driver,
            webhook: Some(running),
            agent: Some(agent),
            shutdown,
        };
        if let Err(e) = sa.wait_started().await {
            sa.stop().await;
            return Err(e);
        }
        Ok(sa)
    }

    async fn wait_started(&mut self) -> Result<()> {
        let deadline = tokio::time::Instant::now() + STARTUP_DEADLINE;
        // The agent's first report.
        let report = self
            .driver
            .wait_report_settled(
                TEE_NODE,
                teeguard_shared::TeeKind::Tdx,
                &self.host,
                STARTUP_DEADLINE,
            )
            .await;
        if let Err(e) = report {
            if let Some(agent) = self.agent.as_mut()
                && agent.is_finished()
            {
                let ended = agent.await;
                self.agent = None;
                return Err(match ended {
                    Ok(Err(e)) => e.into(),
                    Ok(Ok(())) => Error::Startup {
                        what: "agent",
                        reason: "stopped before publishing a report".into(),
                    },
                    Err(e) => Error::Startup {
                        what: "agent",
                        reason: e.to_string(),
                    },
                });
            }
            return Err(e);
        }
        // The webhook's /readyz (caches synced, TLS loaded).
        loop {
            match http_get(self.admin_addr, "/readyz").await {
                Ok((200, _)) => return Ok(()),
                Ok((_, body)) if tokio::time::Instant::now() >= deadline => {
                    return Err(Error::Timeout {
                        log: None,
                        what: format!(
                            "the webhook's /readyz on {} ({})",
                            self.admin_addr,
                            body.trim()
                        ),
                        after: STARTUP_DEADLINE,
                    });
                }
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(Error::Timeout {
                        log: None,
                        what: format!("the webhook's /readyz on {} ({e})", self.admin_addr),
                        after: STARTUP_DEADLINE,
                    });
                }
                _ => tokio::time::sleep(Duration::from_millis(25)).await,
            }
        }
    }

    /// The fake API server's URL.
    pub fn api_url(&self) -> String {
        self.served.url()
    }

    /// The `curl` command that sends the sample AdmissionReview to `/mutate`.
    pub fn curl_command(&self) -> String {
        format!(
            "curl --cacert {} -H 'Content-Type: application/json' --data @{} https://127.0.0.1:{}/mutate",
            self.paths.ca_cert.display(),
            self.paths.sample_review.display(),
            self.https_addr.port()
        )
    }

    /// The webhook's caches (VMIs, namespaces, ...), for waits in tests.
    pub fn webhook(&self) -> Option<&Running> {
        self.webhook.as_ref()
    }

    /// Stop the webhook (graceful drain) and the agent; returns when both have stopped.
    pub async fn stop(&mut self) {
        self.shutdown.cancel();
        if let Some(w) = self.webhook.take()
            && let Err(e) = tokio::time::timeout(Duration::from_secs(30), w.wait())
                .await
                .unwrap_or(Ok(()))
        {
            tracing::warn!(error = %e, "webhook stopped with an error");
        }
        if let Some(a) = self.agent.take() {
            match tokio::time::timeout(Duration::from_secs(10), a).await {
                Ok(Ok(Err(e))) => tracing::warn!(error = %e, "agent stopped with an error"),
                Ok(Err(e)) => tracing::warn!(error = %e, "agent task failed"),
                Err(_) => tracing::warn!("agent did not stop within 10s"),
                Ok(Ok(Ok(()))) => {}
            }
        }
        self.served.stop().await;
    }
}

/// Remove what only the API server sets so a fixture can be created.
fn without_server_fields(mut v: Value) -> Value {
    if let Some(m) = v.get_mut("metadata").and_then(Value::as_object_mut) {
        for k in ["uid", "resourceVersion", "creationTimestamp", "generation"] {
            m.remove(k);
        }
    }
    v
}

/// The owner VMI UID of the pod in a sample AdmissionReview file.
fn sample_owner_uid(path: &Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let review: Value = serde_json::from_str(&text).ok()?;
    review
        .pointer("/request/object/metadata/ownerReferences/0/uid")
        .and_then(Value::as_str)
        .map(str::to_string)
}

/// Write the sample (`mutate-tdx-pod.json`) with its pod owned by `vmi_uid`, for when the committed
/// file is not at hand: the webhook refuses a pod whose owner UID names another VMI.
fn write_sample_review(path: &Path, vmi_uid: &str) -> Result<()> {
    let pod = fixtures::virt_launcher_pod(Tee::Tdx);
    let mut object = fixtures::to_value(&pod);
    own_by(&mut object, vmi_uid);
    let review = fixtures::AdmissionReviewBuilder::create(object).build();
    std::fs::write(path, fixtures::to_pretty_json(&review)).map_err(io_err("write", path))
}

/// A plain-HTTP GET (the admin port); returns the status code and body.
pub async fn http_get(addr: SocketAddr, path: &str) -> std::result::Result<(u16, String), String> {
    use http_body_util::{BodyExt, Empty};
    let work = async {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let req = http::Request::get(path)
            .header(http::header::HOST, addr.to_string())
            .body(Empty::<bytes::Bytes>::new())
            .map_err(|e| e.to_string())?;
        let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    };
    match tokio::time::timeout(Duration::from_secs(5), work).await {
        Ok(r) => r,
        Err(_) => Err(format!("GET http://{addr}{path} not answered within 5s")),
    }
}
