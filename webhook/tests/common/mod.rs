//! Shared helpers for the webhook's integration tests: a Secret-volume-shaped certificate directory,
//! an in-process webhook against the fake API server, and an HTTPS client (HTTP/1.1 or HTTP/2) that
//! trusts only the test CA.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use clap::Parser;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;
use teeguard_certs::{CertificateAuthority, ServingCert, ServingCertRequest};
use teeguard_tests::fakeapi::FakeApiServer;
use teeguard_tests::wait::eventually;
use teeguard_webhook::app::{Running, start};
use teeguard_webhook::cli::{Cli, Command, ServeArgs};
use tokio_util::sync::CancellationToken;

/// Every async wait in these tests is bounded by this.
pub const WAIT: Duration = Duration::from_secs(10);

/// Run `fut` with the [`WAIT`] timeout, failing the test with `what` when it expires.
pub async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, fut)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

/// The kubelet-style Secret volume layout (`..data` symlink swaps) from the test kit.
pub use teeguard_tests::e2e::SecretDir;

/// A CA and a localhost serving certificate from teeguard-certs.
pub fn ca_and_leaf() -> (CertificateAuthority, ServingCert) {
    let ca = CertificateAuthority::generate("teeguard-test-ca", 30).expect("CA");
    let leaf = ca.issue(&ServingCertRequest::localhost()).expect("leaf");
    (ca, leaf)
}

/// `serve` flags for an in-process test webhook on ephemeral localhost ports.
pub fn serve_args(cert_dir: &Path, extra: &[&str]) -> ServeArgs {
    let mut argv = vec![
        "teeguard-webhook".to_string(),
        "serve".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--admin-listen".into(),
        "127.0.0.1:0".into(),
        "--cert-dir".into(),
        cert_dir.display().to_string(),
        "--cert-check-interval".into(),
        "30s".into(),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    match Cli::try_parse_from(argv).expect("serve args").command {
        Command::Serve(a) => a,
        Command::Review(_) => unreachable!("serve parsed as review"),
    }
}

/// A webhook running in-process against a fake API server.
pub struct Harness {
    pub api: FakeApiServer,
    pub ca: CertificateAuthority,
    pub certs: SecretDir,
    pub running: Option<Running>,
    pub https: SocketAddr,
    pub admin: SocketAddr,
    pub token: CancellationToken,
    _config_dir: tempfile::TempDir,
}

impl Harness {
    /// Start with default configuration and wait until ready.
    pub async fn start() -> Harness {
        Self::start_with(FakeApiServer::new(), None, &[]).await
    }

    /// Start against `api` with an optional configuration file and extra flags; wait until ready.
    pub async fn start_with(
        api: FakeApiServer,
        config_yaml: Option<&str>,
        extra: &[&str],
    ) -> Harness {
        teeguard_webhook::web::tls::install_crypto_provider();
        let (ca, leaf) = ca_and_leaf();
        let certs = SecretDir::temporary(leaf.cert_pem(), leaf.key_pem()).expect("secret dir");
        let config_dir = tempfile::tempdir().expect("tempdir");
        let mut flags: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        if let Some(yaml) = config_yaml {
            let p = config_dir.path().join("config.yaml");
            std::fs::write(&p, yaml).expect("write config");
            flags.push("--config".into());
            flags.push(p.display().to_string());
        }
        let flag_refs: Vec<&str> = flags.iter().map(String::as_str).collect();
        let args = serve_args(certs.path(), &flag_refs);
        let token = CancellationToken::new();
        let running = start(&args, api.client(), token.clone())
            .await
            .expect("webhook starts");
        let readiness = running.readiness.clone();
        eventually("webhook ready", async || readiness.is_ready()).await;
        Harness {
            api,
            ca,
            certs,
            https: running.https_addr,
            admin: running.admin_addr,
            running: Some(running),
            token,
            _config_dir: config_dir,
        }
    }

    pub fn ca_der(&self) -> CertificateDer<'static> {
        self.ca.cert_der()
    }

    /// A new HTTP/1.1 connection.
    pub async fn connect(&self) -> Conn {
        Conn::connect(self.https, self.ca_der(), Proto::Http1).await
    }

    /// Post an AdmissionReview on a fresh HTTP/1.1 connection.
    pub async fn review(&self, review: &Value) -> (StatusCode, Value) {
        let body = serde_json::to_vec(review).expect("review json");
        self.connect().await.post("/mutate", body).await
    }

    /// Post an AdmissionReview to `/validate` on a fresh HTTP/1.1 connection.
    pub async fn validate(&self, review: &Value) -> (StatusCode, Value) {
        let body = serde_json::to_vec(review).expect("review json");
        self.connect().await.post("/validate", body).await
    }

    /// The running webhook's caches.
    pub fn caches(&self) -> teeguard_webhook::cluster::caches::Caches {
        self.running.as_ref().expect("running").caches.clone()
    }

    /// Wait until `/metrics` shows `line` (gauges the retry planner publishes at its next pass).
    pub async fn wait_metric(&self, line: &str) {
        teeguard_tests::wait::eventually(line, async || {
            self.admin_get("/metrics").await.1.contains(line)
        })
        .await;
    }

    /// GET a path on the admin port (plain HTTP).
    pub async fn admin_get(&self, path: &str) -> (StatusCode, String) {
        let stream = tokio::net::TcpStream::connect(self.admin)
            .await
            .expect("admin connect");
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("admin handshake");
        tokio::spawn(conn);
        let req = Request::get(path)
            .header(header::HOST, "localhost")
            .body(Full::new(Bytes::new()))
            .expect("request");
        let resp = bounded("admin response", sender.send_request(req))
            .await
            .expect("admin response");
        let status = resp.status();
        let body = resp.into_body().collect().await.expect("body").to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    /// Wait until the VMI cache holds `n` objects.
    pub async fn wait_vmis(&self, n: usize) {
        let caches = self.running.as_ref().expect("running").caches.clone();
        eventually("VMI cache", async || caches.vmis.len() == n).await;
    }

    /// Shut down and wait for the drain.
    pub async fn stop(mut self) {
        self.token.cancel();
        if let Some(r) = self.running.take() {
            bounded("webhook stop", r.wait()).await.expect("clean stop");
        }
    }
}

/// HTTP version of a test connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    Http1,
    Http2,
}

enum Sender {
    H1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    H2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

/// One TLS connection to the webhook, reusable for several requests (keep-alive).
pub struct Conn {
    sender: Sender,
    /// The leaf certificate the server presented.
    pub server_cert: CertificateDer<'static>,
    /// The ALPN protocol negotiated.
    pub alpn: Option<Vec<u8>>,
}

/// A rustls client trusting only `ca`.
pub fn client_config(ca: CertificateDer<'static>, alpn: &[&[u8]]) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca).expect("add CA");
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Arc::new(cfg)
}

/// TLS-connect to `addr` as `localhost`.
pub async fn tls_connect(
    addr: SocketAddr,
    cfg: Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let connector = tokio_rustls::TlsConnector::from(cfg);
    let name = ServerName::try_from("localhost").expect("server name");
    connector.connect(name, tcp).await
}

impl Conn {
    pub async fn connect(addr: SocketAddr, ca: CertificateDer<'static>, proto: Proto) -> Conn {
        let alpn: &[&[u8]] = match proto {
            Proto::Http1 => &[b"http/1.1"],
            Proto::Http2 => &[b"h2"],
        };
        let tls = bounded("TLS connect", tls_connect(addr, client_config(ca, alpn)))
            .await
            .expect("TLS handshake with the webhook");
        let (_, session) = tls.get_ref();
        let server_cert = session
            .peer_certificates()
            .and_then(|c| c.first())
            .expect("server certificate")
            .clone()
            .into_owned();
        let alpn = session.alpn_protocol().map(<[u8]>::to_vec);
        let io = TokioIo::new(tls);
        let sender = match proto {
            Proto::Http1 => {
                let (s, conn) = hyper::client::conn::http1::handshake(io)
                    .await
                    .expect("HTTP/1.1 handshake");
                tokio::spawn(conn);
                Sender::H1(s)
            }
            Proto::Http2 => {
                let (s, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                    .await
                    .expect("HTTP/2 handshake");
                tokio::spawn(conn);
                Sender::H2(s)
            }
        };
        Conn {
            sender,
            server_cert,
            alpn,
        }
    }

    /// POST `body` to `path`; returns the status and the JSON body.
    pub async fn post(&mut self, path: &str, body: Vec<u8>) -> (StatusCode, Value) {
        let resp = bounded("response", self.send(path, body)).await;
        let resp = resp.expect("response");
        let status = resp.status();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        let v = serde_json::from_slice(&bytes).unwrap_or_else(|e| {
            panic!(
                "response body is not JSON ({e}): {}",
                String::from_utf8_lossy(&bytes)
            )
        });
        (status, v)
    }

    /// Send a request; the raw result.
    pub async fn send(
        &mut self,
        path: &str,
        body: Vec<u8>,
    ) -> hyper::Result<http::Response<hyper::body::Incoming>> {
        let uri = match self.sender {
            Sender::H1(_) => path.to_string(),
            Sender::H2(_) => format!("https://localhost{path}"),
        };
        let req = Request::post(uri)
            .header(header::HOST, "localhost")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .expect("request");
        match &mut self.sender {
            Sender::H1(s) => {
                s.ready().await?;
                s.send_request(req).await
            }
            Sender::H2(s) => {
                s.ready().await?;
                s.send_request(req).await
            }
        }
    }
}

/// Decode the base64 patch of an AdmissionReview response (None when there is none), checking that
/// `patchType` is present exactly when the patch is.
pub fn response_patch(review: &Value) -> Option<json_patch::Patch> {
    use base64::prelude::{BASE64_STANDARD, Engine as _};
    let resp = &review["response"];
    match resp.get("patch").and_then(Value::as_str) {
        Some(b64) => {
            assert_eq!(resp["patchType"], "JSONPatch", "{review}");
            let bytes = BASE64_STANDARD.decode(b64).expect("base64 patch");
            Some(serde_json::from_slice(&bytes).expect("patch JSON"))
        }
        None => {
            assert!(
                resp.get("patchType").is_none(),
                "patchType without patch: {review}"
            );
            None
        }
    }
}

/// Apply a patch to the request's object and parse the result as a Pod.
pub fn apply_to_object(
    review_request: &Value,
    patch: &json_patch::Patch,
) -> (Value, k8s_openapi::api::core::v1::Pod) {
    let mut obj = review_request["request"]["object"].clone();
    json_patch::patch(&mut obj, &patch.0).expect("patch applies to the request's pod");
    let pod = serde_json::from_value(obj.clone()).expect("patched object is a valid Pod");
    (obj, pod)
}

/// Where a test data file lives.
pub fn data_file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}
