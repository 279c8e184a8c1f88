//! Shared by the `robust_*` tests and the HTTPS benches (`tests/benches/e2e_tls.rs`,
//! `cache_scale.rs` include it by path): a Secret-volume-shaped certificate directory, an in-process
//! webhook against the fake API server, a keep-alive HTTPS client trusting only the test CA, scenario
//! objects, and checks of a response against an answer computed from the scenario definition (not by
//! the webhook's code).

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use base64::prelude::{BASE64_STANDARD, Engine as _};
use bytes::Bytes;
use clap::Parser;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use teeguard_certs::{CertificateAuthority, ServingCert, ServingCertRequest};
use teeguard_tests::fakeapi::FakeApiServer;
use teeguard_tests::fixtures::{self, Tee, VirtLauncherPod, Vmi, owned_by, seed_vmi};
use teeguard_webhook::app::{Running, start};
use teeguard_webhook::cli::{Cli, Command, ServeArgs};
use tokio_util::sync::CancellationToken;

/// Every single wait in these tests is bounded by this.
pub const WAIT: Duration = Duration::from_secs(10);

/// Run `fut` within [`WAIT`], failing with `what` when it expires.
pub async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    match tokio::time::timeout(WAIT, fut).await {
        Ok(v) => v,
        Err(_) => panic!("timed out after {WAIT:?} waiting for {what}"),
    }
}

/// Poll `check` every 10 ms until true; fail after [`WAIT`].
pub async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The kubelet-style Secret volume layout (`..data` symlink swaps) from the test kit.
pub use teeguard_tests::e2e::SecretDir;

/// A CA and a serving certificate for localhost / 127.0.0.1 from teeguard-certs.
pub fn ca_and_leaf() -> (CertificateAuthority, ServingCert) {
    let ca = CertificateAuthority::generate("teeguard-robust-ca", 30).expect("CA");
    let leaf = ca.issue(&ServingCertRequest::localhost()).expect("leaf");
    (ca, leaf)
}

/// `serve` flags (parsed by the real CLI) for a webhook on ephemeral localhost ports.
pub fn serve_args(cert_dir: &Path, extra: &[&str]) -> ServeArgs {
    let mut argv: Vec<String> = vec![
        "teeguard-webhook".into(),
        "serve".into(),
        "--listen".into(),
        "127.0.0.1:0".into(),
        "--admin-listen".into(),
        "127.0.0.1:0".into(),
        "--cert-dir".into(),
        cert_dir.display().to_string(),
    ];
    argv.extend(extra.iter().map(|s| s.to_string()));
    match Cli::try_parse_from(argv).expect("serve args").command {
        Command::Serve(a) => a,
        Command::Review(_) => panic!("serve flags parsed as review"),
    }
}

/// A webhook running in this process (`app::start`) against a fake API server.
pub struct Webhook {
    pub api: FakeApiServer,
    pub ca: CertificateAuthority,
    pub certs: SecretDir,
    pub running: Option<Running>,
    pub https: SocketAddr,
    pub admin: SocketAddr,
    pub token: CancellationToken,
}

impl Webhook {
    /// Start with extra `serve` flags and wait until `/readyz` would say ready.
    pub async fn start(api: FakeApiServer, extra: &[&str]) -> Webhook {
        teeguard_webhook::web::tls::install_crypto_provider();
        let (ca, leaf) = ca_and_leaf();
        let certs = SecretDir::temporary(leaf.cert_pem(), leaf.key_pem()).expect("secret dir");
        let args = serve_args(certs.path(), extra);
        let token = CancellationToken::new();
        let running = start(&args, api.client(), token.clone())
            .await
            .expect("webhook starts");
        let readiness = running.readiness.clone();
        eventually("webhook ready", || readiness.is_ready()).await;
        Webhook {
            api,
            ca,
            certs,
            https: running.https_addr,
            admin: running.admin_addr,
            running: Some(running),
            token,
        }
    }

    /// A TLS client configuration trusting only this webhook's CA, HTTP/1.1.
    pub fn client_config(&self) -> Arc<rustls::ClientConfig> {
        client_config(self.ca.cert_der())
    }

    /// A new keep-alive HTTP/1.1 connection.
    pub async fn connect(&self) -> H1 {
        H1::connect(self.https, self.client_config()).await
    }

    /// Issue a new serving certificate from the same CA and swap it in like the kubelet does.
    pub fn rotate_certificate(&mut self) {
        let leaf = self
            .ca
            .issue(&ServingCertRequest::localhost())
            .expect("leaf");
        self.certs
            .rotate(leaf.cert_pem(), leaf.key_pem())
            .expect("rotate certificates");
    }

    /// Wait until the VMI cache holds `n` objects.
    pub async fn wait_vmis(&self, n: usize) {
        let caches = self.running.as_ref().expect("running").caches.clone();
        eventually("VMI cache", || caches.vmis.len() == n).await;
    }

    /// GET a path on the admin port.
    pub async fn admin_get(&self, path: &str) -> (StatusCode, String) {
        admin_get(self.admin, path).await
    }

    /// Shut down and wait for the drain.
    pub async fn stop(mut self) {
        self.token.cancel();
        if let Some(r) = self.running.take() {
            bounded("webhook stop", r.wait()).await.expect("clean stop");
        }
    }
}

/// GET `path` on a plain-HTTP admin port.
pub async fn admin_get(addr: SocketAddr, path: &str) -> (StatusCode, String) {
    let stream = bounded("admin connect", tokio::net::TcpStream::connect(addr))
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
    let body = bounded("admin body", resp.into_body().collect())
        .await
        .expect("admin body")
        .to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

/// A rustls client (ring) trusting only `ca`, ALPN `http/1.1`.
pub fn client_config(ca: CertificateDer<'static>) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca).expect("add CA");
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Arc::new(cfg)
}

/// TLS-connect to `addr` as `localhost`.
pub async fn tls_connect(
    addr: SocketAddr,
    cfg: Arc<rustls::ClientConfig>,
) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let connector = tokio_rustls::TlsConnector::from(cfg);
    let name = ServerName::try_from("localhost").expect("server name");
    connector.connect(name, tcp).await
}

/// One keep-alive HTTP/1.1 connection over TLS.
pub struct H1 {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
}

impl H1 {
    /// Connect (bounded by [`WAIT`]); panics if the handshake fails.
    pub async fn connect(addr: SocketAddr, cfg: Arc<rustls::ClientConfig>) -> H1 {
        match Self::try_connect(addr, cfg).await {
            Ok(c) => c,
            Err(e) => panic!("connecting to {addr}: {e}"),
        }
    }

    /// Connect, returning the error instead of panicking.
    pub async fn try_connect(
        addr: SocketAddr,
        cfg: Arc<rustls::ClientConfig>,
    ) -> Result<H1, String> {
        let tls = tokio::time::timeout(WAIT, tls_connect(addr, cfg))
            .await
            .map_err(|_| "TLS connect timed out".to_string())?
            .map_err(|e| format!("TLS connect: {e}"))?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| format!("HTTP handshake: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(H1 { sender })
    }

    /// POST `body` to `path`; (status, body bytes). Errors are transport errors.
    pub async fn post(&mut self, path: &str, body: Bytes) -> Result<(StatusCode, Bytes), String> {
        tokio::time::timeout(WAIT, self.sender.ready())
            .await
            .map_err(|_| "connection not ready in time".to_string())?
            .map_err(|e| format!("connection closed: {e}"))?;
        let req = Request::post(path)
            .header(header::HOST, "localhost")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(WAIT, self.sender.send_request(req))
            .await
            .map_err(|_| format!("no response to POST {path} within {WAIT:?}"))?
            .map_err(|e| format!("POST {path}: {e}"))?;
        let status = resp.status();
        let body = tokio::time::timeout(WAIT, resp.into_body().collect())
            .await
            .map_err(|_| "response body timed out".to_string())?
            .map_err(|e| format!("response body: {e}"))?
            .to_bytes();
        Ok((status, body))
    }

    /// Whether the connection can take another request.
    pub fn is_closed(&self) -> bool {
        self.sender.is_closed()
    }
}

// -------------------------------------------------------------------------------------------------
// Scenario objects and expected answers
// -------------------------------------------------------------------------------------------------

/// What a correct webhook answers, derived from the scenario (README's configuration table: the
/// default resource names and the `misc-max.teeguard.dev/compute` annotation), not from its code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Expected {
    /// Allowed with a patch adding `resource: "1"` to compute's requests and limits and the
    /// annotation `misc-max.teeguard.dev/compute: "<misc> 1"`.
    Key {
        /// Extended resource.
        resource: &'static str,
        /// Kernel misc resource name.
        misc: &'static str,
    },
    /// Allowed, no patch.
    Untouched,
    /// Refused with HTTP-like code 403.
    Denied,
}

impl Expected {
    /// The answer for a virt-launcher pod of a VMI of `tee` (not exempt).
    pub fn for_tee(tee: Tee) -> Expected {
        match tee {
            Tee::Tdx => Expected::Key {
                resource: "tdx.intel.com/keys",
                misc: "tdx",
            },
            Tee::Sev => Expected::Key {
                resource: "sev.amd.com/asids",
                misc: "sev",
            },
            Tee::SevEs | Tee::Snp => Expected::Key {
                resource: "sev-snp.amd.com/esids",
                misc: "sev_es",
            },
            Tee::None | Tee::SecureExecution => Expected::Untouched,
            Tee::TdxAndSnp => Expected::Denied,
        }
    }
}

/// The whole answer (status, body) to `review`, once it is a 200 whose `response.uid` is the
/// request's; `Err` says what is wrong.
pub fn answer_to(review: &Value, status: StatusCode, body: &[u8]) -> Result<Value, String> {
    if status != StatusCode::OK {
        return Err(format!(
            "status {status}: {}",
            String::from_utf8_lossy(body)
        ));
    }
    let resp: Value = serde_json::from_slice(body).map_err(|e| format!("response JSON: {e}"))?;
    let r = &resp["response"];
    if r["uid"] != review["request"]["uid"] {
        return Err(format!(
            "uid {} answered for {}",
            r["uid"], review["request"]["uid"]
        ));
    }
    Ok(resp)
}

/// Check a `/mutate` answer (status, body) to `review` against `expected`; `Err` says what is wrong.
pub fn check_mutate(
    review: &Value,
    status: StatusCode,
    body: &[u8],
    expected: &Expected,
) -> Result<(), String> {
    let resp = answer_to(review, status, body)?;
    let r = &resp["response"];
    let patch = match r.get("patch").and_then(Value::as_str) {
        Some(b64) => {
            if r["patchType"] != "JSONPatch" {
                return Err(format!("patch without patchType JSONPatch: {resp}"));
            }
            let bytes = BASE64_STANDARD
                .decode(b64)
                .map_err(|e| format!("patch base64: {e}"))?;
            Some(
                serde_json::from_slice::<json_patch::Patch>(&bytes)
                    .map_err(|e| format!("patch JSON: {e}"))?,
            )
        }
        None if r.get("patchType").is_some() => {
            return Err(format!("patchType without patch: {resp}"));
        }
        None => None,
    };
    match expected {
        Expected::Denied => {
            if r["allowed"] != false || patch.is_some() || r["status"]["code"] != 403 {
                return Err(format!("expected a 403 denial: {resp}"));
            }
        }
        Expected::Untouched => {
            if r["allowed"] != true || patch.is_some() {
                return Err(format!("expected allowed without patch: {resp}"));
            }
        }
        Expected::Key { resource, misc } => {
            if r["allowed"] != true {
                return Err(format!("expected allowed: {resp}"));
            }
            let patch = patch.ok_or_else(|| format!("expected a patch: {resp}"))?;
            let mut pod = review["request"]["object"].clone();
            json_patch::patch(&mut pod, &patch.0).map_err(|e| format!("patch applies: {e}"))?;
            let compute = pod["spec"]["containers"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["name"] == "compute"))
                .ok_or("no compute container after the patch")?;
            for part in ["requests", "limits"] {
                let q = &compute["resources"][part][*resource];
                if q != "1" {
                    return Err(format!("compute {part}[{resource}] is {q}, expected \"1\""));
                }
            }
            let ann = &pod["metadata"]["annotations"]["misc-max.teeguard.dev/compute"];
            if *ann != json!(format!("{misc} 1")) {
                return Err(format!(
                    "misc-max annotation is {ann}, expected \"{misc} 1\""
                ));
            }
        }
    }
    Ok(())
}

/// The AdmissionReview (request uid `uid`) for a virt-launcher pod owned by the VMI with `vmi_uid`,
/// as JSON and bytes.
pub fn launcher_review(pod: &VirtLauncherPod, vmi_uid: &str, uid: &str) -> (Value, Bytes) {
    let review = fixtures::AdmissionReviewBuilder::create(owned_by(&pod.to_value(), vmi_uid))
        .uid(uid)
        .build();
    let bytes = Bytes::from(serde_json::to_vec(&review).expect("review JSON"));
    (review, bytes)
}

/// What a [`Prober`] saw.
#[derive(Debug, Default)]
pub struct ProbeReport {
    /// Correct answers.
    pub ok: usize,
    /// Wrong answers and transport failures.
    pub failures: Vec<String>,
    /// Slowest correct answer.
    pub max_latency: Duration,
}

/// A well-behaved client sending one review every few milliseconds over keep-alive while a test
/// misbehaves elsewhere; every answer is checked against the expected one.
pub struct Prober {
    stop: CancellationToken,
    answers: Arc<std::sync::atomic::AtomicUsize>,
    task: tokio::task::JoinHandle<ProbeReport>,
}

impl Prober {
    /// Start probing `addr` with `review` (expecting `expected` from `/mutate`).
    pub fn start(
        addr: SocketAddr,
        cfg: Arc<rustls::ClientConfig>,
        review: Value,
        body: Bytes,
        expected: Expected,
    ) -> Prober {
        let stop = CancellationToken::new();
        let token = stop.clone();
        let answers = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = answers.clone();
        let task = tokio::spawn(async move {
            let mut report = ProbeReport::default();
            let mut conn: Option<H1> = None;
            while !token.is_cancelled() {
                if conn.as_ref().is_none_or(H1::is_closed) {
                    match H1::try_connect(addr, cfg.clone()).await {
                        Ok(c) => conn = Some(c),
                        Err(e) => {
                            report.failures.push(format!("connect: {e}"));
                            tokio::time::sleep(Duration::from_millis(20)).await;
                            continue;
                        }
                    }
                }
                let Some(c) = conn.as_mut() else { continue };
                let t = std::time::Instant::now();
                match c.post("/mutate", body.clone()).await {
                    Ok((status, resp)) => match check_mutate(&review, status, &resp, &expected) {
                        Ok(()) => {
                            report.ok += 1;
                            counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            report.max_latency = report.max_latency.max(t.elapsed());
                        }
                        Err(e) => report.failures.push(e),
                    },
                    Err(e) => {
                        report.failures.push(e);
                        conn = None;
                    }
                }
                tokio::select! {
                    _ = token.cancelled() => {}
                    _ = tokio::time::sleep(Duration::from_millis(5)) => {}
                }
            }
            report
        });
        Prober {
            stop,
            answers,
            task,
        }
    }

    /// Stop and return the report.
    pub async fn finish(self) -> ProbeReport {
        self.finish_after(0).await
    }

    /// Keep probing until at least `min_ok` correct answers arrived (at most 10 s, so a server that
    /// stopped answering fails the caller's check instead of hanging), then stop and return the report.
    /// How many answers fit in a test body depends on how fast it runs, not on the server.
    pub async fn finish_after(self, min_ok: usize) -> ProbeReport {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while self.answers.load(std::sync::atomic::Ordering::Relaxed) < min_ok
            && tokio::time::Instant::now() < deadline
            && !self.task.is_finished()
        {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.stop.cancel();
        bounded("prober stop", self.task)
            .await
            .expect("prober task")
    }
}

/// A default webhook for robustness tests: the `default` namespace and a TDX VMI exist; returns the
/// webhook and a correct review for the VMI's launcher pod with its expected answer.
pub async fn tdx_webhook(extra: &[&str]) -> (Webhook, Value, Bytes, Expected) {
    let api = FakeApiServer::new();
    api.create(&json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "default"}}))
        .expect("namespace");
    let uid = seed_vmi(&api, &Vmi::new("tdx-vm").tee(Tee::Tdx));
    let wh = Webhook::start(api, extra).await;
    wh.wait_vmis(1).await;
    let (review, body) =
        launcher_review(&VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx), &uid, "probe");
    (wh, review, body, Expected::for_tee(Tee::Tdx))
}
