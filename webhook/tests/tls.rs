//! Serving-certificate handling through real TLS: rotation by `..data` symlink swap (as the kubelet
//! updates Secret volumes), unusable pairs keeping the old certificate, start-up failures before any
//! port is bound, and the key formats and chains the loader accepts.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use axum::Router;
use axum::routing::get;
use common::{Harness, bounded, client_config, data_file, tls_connect};
use http::StatusCode;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};
use rustls::pki_types::CertificateDer;
use teeguard_certs::ServingCertRequest;
use teeguard_tests::fixtures::{self, AdmissionReviewBuilder};
use teeguard_tests::wait::{PATIENCE, eventually, until};
use teeguard_webhook::metrics::Metrics;
use teeguard_webhook::web::server::{ServerSettings, serve_https};
use teeguard_webhook::web::tls::{CertReloader, install_crypto_provider, server_config};
use tokio_util::sync::CancellationToken;

/// The certificate a new connection is served.
async fn served_cert(addr: SocketAddr, ca: CertificateDer<'static>) -> CertificateDer<'static> {
    let tls = bounded(
        "TLS connect",
        tls_connect(addr, client_config(ca, &[b"http/1.1"])),
    )
    .await
    .expect("handshake");
    tls.get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .expect("peer certificate")
        .clone()
        .into_owned()
}

async fn wait_for_served(addr: SocketAddr, ca: CertificateDer<'static>, want: &CertificateDer<'_>) {
    eventually("the new certificate served", async || {
        served_cert(addr, ca.clone()).await == *want
    })
    .await;
}

async fn wait_for_metric(h: &Harness, line: &str) {
    let mut metrics = String::new();
    let seen = until(&format!("{line} in /metrics"), PATIENCE, async || {
        metrics = h.admin_get("/metrics").await.1;
        metrics.lines().any(|l| l == line)
    })
    .await;
    if let Err(e) = seen {
        panic!("{e}; the last /metrics:\n{metrics}");
    }
}

fn kata_review() -> Vec<u8> {
    let pod = fixtures::kata_pod("kata", fixtures::KataTee::Tdx);
    serde_json::to_vec(&AdmissionReviewBuilder::create(fixtures::to_value(&pod)).build())
        .expect("json")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_by_symlink_swap_reaches_new_connections_only() {
    let mut h = Harness::start().await;
    let mut old = h.connect().await;
    let first = old.server_cert.clone();
    let (status, _) = old.post("/mutate", kata_review()).await;
    assert_eq!(status, StatusCode::OK);

    let second = h.ca.issue(&ServingCertRequest::localhost()).expect("leaf");
    h.certs
        .rotate(second.cert_pem(), second.key_pem())
        .expect("rotate");
    // The check interval is 30 s: only the directory watch can make this quick.
    wait_for_served(h.https, h.ca_der(), &second.cert_der()).await;
    assert_ne!(first, second.cert_der());
    wait_for_metric(&h, r#"teeguard_webhook_cert_reloads_total{result="ok"} 1"#).await;

    // The keep-alive connection made before the rotation keeps working.
    for _ in 0..2 {
        let (status, resp) = old.post("/mutate", kata_review()).await;
        assert_eq!(status, StatusCode::OK, "{resp}");
        assert_eq!(resp["response"]["allowed"], true);
    }
    assert_eq!(old.server_cert, first);

    let expiry = second
        .not_after()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after epoch")
        .as_secs();
    wait_for_metric(
        &h,
        &format!("teeguard_webhook_cert_expiry_timestamp_seconds {expiry}"),
    )
    .await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unusable_pairs_keep_the_old_certificate() {
    let mut h = Harness::start().await;
    let first = served_cert(h.https, h.ca_der()).await;
    let a =
        h.ca.issue(&ServingCertRequest::localhost())
            .expect("leaf a");
    let b =
        h.ca.issue(&ServingCertRequest::localhost())
            .expect("leaf b");

    // Key does not match the certificate.
    h.certs.rotate(a.cert_pem(), b.key_pem()).expect("rotate");
    wait_for_metric(
        &h,
        r#"teeguard_webhook_cert_reloads_total{result="failed"} 1"#,
    )
    .await;
    assert_eq!(served_cert(h.https, h.ca_der()).await, first);

    // Half-written certificate.
    let half = &a.cert_pem()[..a.cert_pem().len() / 2];
    h.certs.rotate(half, a.key_pem()).expect("rotate");
    wait_for_metric(
        &h,
        r#"teeguard_webhook_cert_reloads_total{result="failed"} 2"#,
    )
    .await;
    assert_eq!(served_cert(h.https, h.ca_der()).await, first);

    // Empty key file.
    h.certs.rotate(a.cert_pem(), "").expect("rotate");
    wait_for_metric(
        &h,
        r#"teeguard_webhook_cert_reloads_total{result="failed"} 3"#,
    )
    .await;
    assert_eq!(served_cert(h.https, h.ca_der()).await, first);

    // A good pair is picked up again.
    h.certs.rotate(a.cert_pem(), a.key_pem()).expect("rotate");
    wait_for_served(h.https, h.ca_der(), &a.cert_der()).await;
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_certificate_fails_start_up_before_binding() {
    install_crypto_provider();
    // Hold the HTTPS port: if the webhook bound before checking TLS, it would report the port instead.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = taken.local_addr().expect("addr").port();
    let (_, leaf) = common::ca_and_leaf();
    let (_, other) = common::ca_and_leaf();
    type Case<'a> = (&'a str, Option<(String, String)>, &'a [&'a str]);
    let cases: Vec<Case> = vec![
        (
            "missing files",
            None,
            &["tls.crt", "cannot read TLS certificate"],
        ),
        (
            "garbage certificate",
            Some(("not a certificate".into(), leaf.key_pem().into())),
            &["tls.crt", "no CERTIFICATE PEM block"],
        ),
        (
            "mismatched key",
            Some((leaf.cert_pem().into(), other.key_pem().into())),
            &["tls.key", "does not match the certificate", "tls.crt"],
        ),
    ];
    for (what, files, wants) in cases {
        let dir = tempfile::tempdir().expect("tempdir");
        if let Some((cert, key)) = files {
            std::fs::write(dir.path().join("tls.crt"), cert).expect("cert");
            std::fs::write(dir.path().join("tls.key"), key).expect("key");
        }
        let port_flag = format!("127.0.0.1:{port}");
        let mut args = common::serve_args(dir.path(), &[]);
        args.listen = port_flag.parse().expect("addr");
        let api = teeguard_tests::fakeapi::FakeApiServer::new();
        let err = teeguard_webhook::app::start(&args, api.client(), CancellationToken::new())
            .await
            .expect_err(what)
            .to_string();
        for want in wants {
            assert!(err.contains(want), "{what}: {want:?} not in {err}");
        }
        assert!(!err.contains("cannot listen"), "{what}: {err}");
    }
    drop(taken);

    // The binary exits non-zero with the same message, before contacting any cluster.
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("tls.crt"), leaf.cert_pem()).expect("cert");
    std::fs::write(dir.path().join("tls.key"), "-----BEGIN PRIVATE KEY-----\n").expect("key");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_teeguard-webhook"))
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .arg("--cert-dir")
        .arg(dir.path())
        .env("KUBECONFIG", dir.path().join("no-such-kubeconfig"))
        .output()
        .expect("run the binary");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains(&dir.path().join("tls.key").display().to_string())
            && stderr.contains("invalid TLS private key"),
        "{stderr}"
    );
}

/// A root CA (rcgen, ECDSA P-256).
fn root_ca() -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    params
        .distinguished_name
        .push(DnType::CommonName, "key-format test root");
    CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("root")
}

fn leaf_params() -> CertificateParams {
    let mut params = CertificateParams::new(vec!["localhost".to_string()]).expect("params");
    params
        .subject_alt_names
        .push(SanType::IpAddress([127, 0, 0, 1].into()));
    params
}

/// Serve the pair in `dir` with a trivial router; return the address and the stop token.
async fn serve_dir(dir: &Path) -> (SocketAddr, CancellationToken, tokio::task::JoinHandle<()>) {
    install_crypto_provider();
    let metrics = Arc::new(Metrics::new(&mut Default::default()));
    let (_, store) = CertReloader::load(dir, metrics).expect("the pair loads");
    let tls = server_config(store).expect("server config");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let token = CancellationToken::new();
    let router = Router::new().route("/ok", get(|| async { "ok" }));
    let stop = token.clone();
    let task = tokio::spawn(async move {
        serve_https(listener, tls, router, ServerSettings::default(), stop)
            .await
            .expect("serve");
    });
    (addr, token, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pkcs1_pkcs8_and_sec1_keys_and_chains_load() {
    let root = root_ca();
    let root_der = root.der().clone();
    // (key file served, PKCS#8 form used to sign its certificate, expected PEM label)
    let cases = [
        ("rsa-pkcs1.key", "rsa-pkcs8.key", "BEGIN RSA PRIVATE KEY"),
        ("rsa-pkcs8.key", "rsa-pkcs8.key", "BEGIN PRIVATE KEY"),
        ("ec-sec1.key", "ec-pkcs8.key", "BEGIN EC PRIVATE KEY"),
        ("ec-pkcs8.key", "ec-pkcs8.key", "BEGIN PRIVATE KEY"),
    ];
    for (served, pkcs8, label) in cases {
        let key_pem = std::fs::read_to_string(data_file(served)).expect("key file");
        assert!(key_pem.contains(label), "{served} is not {label}");
        let pkcs8_pem = std::fs::read_to_string(data_file(pkcs8)).expect("pkcs8 file");
        let public = KeyPair::from_pem(&pkcs8_pem).expect("rcgen reads the PKCS#8 key");
        let cert = leaf_params().signed_by(&public, &root).expect("sign");
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("tls.crt"), cert.pem()).expect("cert");
        std::fs::write(dir.path().join("tls.key"), &key_pem).expect("key");

        let (addr, token, task) = serve_dir(dir.path()).await;
        assert_eq!(
            served_cert(addr, root_der.clone()).await,
            *cert.der(),
            "{served}"
        );
        token.cancel();
        bounded("server stop", task).await.expect("join");
    }

    // A chain: leaf + intermediate in tls.crt, the client trusts only the root.
    let mut inter_params = CertificateParams::new(Vec::<String>::new()).expect("params");
    inter_params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    inter_params.key_usages = vec![KeyUsagePurpose::KeyCertSign];
    inter_params
        .distinguished_name
        .push(DnType::CommonName, "intermediate");
    let inter_key = KeyPair::generate().expect("key");
    let inter_cert = inter_params
        .signed_by(&inter_key, &root)
        .expect("intermediate");
    let inter = Issuer::new(inter_params, inter_key);
    let leaf_key = KeyPair::generate().expect("key");
    let leaf = leaf_params().signed_by(&leaf_key, &inter).expect("leaf");
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(
        dir.path().join("tls.crt"),
        format!("{}{}", leaf.pem(), inter_cert.pem()),
    )
    .expect("chain");
    std::fs::write(dir.path().join("tls.key"), leaf_key.serialize_pem()).expect("key");
    let (addr, token, task) = serve_dir(dir.path()).await;
    let tls = bounded(
        "TLS connect",
        tls_connect(addr, client_config(root_der, &[b"http/1.1"])),
    )
    .await
    .expect("the chain verifies against the root");
    let chain = tls.get_ref().1.peer_certificates().expect("certs").to_vec();
    assert_eq!(chain.len(), 2);
    assert_eq!(chain[1], *inter_cert.der());
    drop(tls);
    token.cancel();
    bounded("server stop", task).await.expect("join");
}
