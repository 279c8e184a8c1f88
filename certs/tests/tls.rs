//! Generated certificates used through a real TLS handshake (tokio-rustls, ring) and
//! inspected with x509-parser.

use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::{CertificateError, ClientConfig, RootCertStore, ServerConfig};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer, X509Certificate};
use x509_parser::public_key::PublicKey;

use teeguard_certs::{
    Bundle, CertificateAuthority, Error, ServingCertRequest, SubjectAltName, generate_bundle,
};

const SVC: &str = "teeguard-webhook";
const NS: &str = "teeguard";
const STEP: Duration = Duration::from_secs(10);

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn server_config(cert_pem: &str, key_pem: &str) -> Arc<ServerConfig> {
    let certs = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .expect("tls.crt parses");
    let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).expect("tls.key parses");
    Arc::new(
        ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .expect("key matches certificate"),
    )
}

/// A client that trusts only the CA(s) in `ca_pem`.
fn client_config(ca_pem: &str) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots
            .add(cert.expect("ca.crt parses"))
            .expect("CA accepted");
    }
    assert_eq!(roots.len(), 1, "exactly one trust anchor");
    Arc::new(
        ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("protocol versions")
            .with_root_certificates(roots)
            .with_no_client_auth(),
    )
}

/// Serves one connection on 127.0.0.1 that answers "ping" with "pong"; connects with
/// `server_name` and returns the client-side outcome.
async fn ping(
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
    server_name: &str,
) -> io::Result<()> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let acceptor = TlsAcceptor::from(server);
    let server_task = tokio::spawn(async move {
        let (tcp, _) = listener.accept().await?;
        let mut tls = acceptor.accept(tcp).await?;
        let mut buf = [0u8; 4];
        tls.read_exact(&mut buf).await?;
        assert_eq!(&buf, b"ping");
        tls.write_all(b"pong").await?;
        tls.shutdown().await?;
        Ok::<_, io::Error>(())
    });

    let name = ServerName::try_from(server_name.to_owned()).expect("valid server name");
    let client_result = tokio::time::timeout(STEP, async {
        let tcp = TcpStream::connect(addr).await?;
        let mut tls = TlsConnector::from(client).connect(name, tcp).await?;
        tls.write_all(b"ping").await?;
        let mut buf = [0u8; 4];
        tls.read_exact(&mut buf).await?;
        assert_eq!(&buf, b"pong");
        Ok::<_, io::Error>(())
    })
    .await
    .expect("client finished in time");

    let server_result = tokio::time::timeout(STEP, server_task)
        .await
        .expect("server finished in time")
        .expect("server task did not panic");
    if client_result.is_ok() {
        server_result.expect("server side succeeded too");
    }
    client_result
}

/// The certificate error inside a failed handshake.
fn certificate_error(err: &io::Error) -> CertificateError {
    match err
        .get_ref()
        .and_then(|e| e.downcast_ref::<rustls::Error>())
    {
        Some(rustls::Error::InvalidCertificate(cert_err)) => cert_err.clone(),
        other => panic!("expected a certificate error, got {other:?} ({err})"),
    }
}

fn written_bundle(dir: &Path) -> (Bundle, Arc<ServerConfig>, Arc<ClientConfig>) {
    let req = ServingCertRequest::for_service(SVC, NS);
    let bundle = generate_bundle(&req).expect("generate");
    let files = bundle.write_to_dir(dir, false).expect("write");
    let server = server_config(&read(&files.tls_cert), &read(&files.tls_key));
    let client = client_config(&read(&files.ca_cert));
    (bundle, server, client)
}

#[tokio::test]
async fn handshake_succeeds_for_service_name_with_only_generated_ca_trusted() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, server, client) = written_bundle(dir.path());
    for name in [
        "teeguard-webhook.teeguard.svc",
        "teeguard-webhook.teeguard.svc.cluster.local",
        "teeguard-webhook.teeguard",
        "teeguard-webhook",
    ] {
        ping(server.clone(), client.clone(), name)
            .await
            .unwrap_or_else(|e| panic!("handshake as {name}: {e}"));
    }
}

#[tokio::test]
async fn handshake_fails_for_a_name_not_in_the_certificate() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, server, client) = written_bundle(dir.path());
    for name in [
        "other.default.svc",
        "teeguard-webhook.default.svc",
        "127.0.0.1",
    ] {
        let err = ping(server.clone(), client.clone(), name)
            .await
            .expect_err("name must not verify");
        assert!(
            matches!(
                certificate_error(&err),
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. }
            ),
            "{name}: {err}"
        );
    }
}

#[tokio::test]
async fn handshake_fails_when_client_trusts_a_different_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, server, _) = written_bundle(dir.path());
    let stranger = CertificateAuthority::generate("someone else", 30).expect("ca");
    let err = ping(
        server,
        client_config(stranger.cert_pem()),
        "teeguard-webhook.teeguard.svc",
    )
    .await
    .expect_err("unknown issuer");
    assert_eq!(
        certificate_error(&err),
        CertificateError::UnknownIssuer,
        "{err}"
    );
}

#[tokio::test]
async fn localhost_leaf_serves_ip_and_localhost() {
    let ca = CertificateAuthority::generate("loopback ca", 1).expect("ca");
    let leaf = ca.issue(&ServingCertRequest::localhost()).expect("leaf");
    let server = Arc::new(
        ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(vec![leaf.cert_der()], leaf.key_der())
            .expect("der accessors work with rustls"),
    );
    let client = client_config(ca.cert_pem());
    for name in ["127.0.0.1", "localhost"] {
        ping(server.clone(), client.clone(), name)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

#[tokio::test]
async fn reissued_leaf_from_loaded_ca_verifies_against_original_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = CertificateAuthority::generate("rotation ca", 30).expect("ca");
    let first = ca
        .bundle(&ServingCertRequest::for_service(SVC, NS))
        .expect("first leaf");
    let files = first
        .write_to_dir_with_ca_key(dir.path(), &ca.key_pem(), false)
        .expect("write");
    let ca_key = files.ca_key.as_deref().expect("ca.key written");

    let loaded = CertificateAuthority::from_pem_files(&files.ca_cert, ca_key).expect("load CA");
    let second = loaded
        .bundle(&ServingCertRequest::for_service(SVC, NS))
        .expect("second leaf");
    assert_eq!(second.ca_pem, first.ca_pem, "same CA certificate");
    assert_ne!(second.cert_pem, first.cert_pem);
    assert_ne!(second.key_pem, first.key_pem);
    second
        .write_to_dir(dir.path(), true)
        .expect("rotate on disk");

    let (old_der, new_der) = (pem_der(&first.cert_pem), pem_der(&second.cert_pem));
    let (_, old_leaf) = X509Certificate::from_der(&old_der).expect("x509");
    let (_, new_leaf) = X509Certificate::from_der(&new_der).expect("x509");
    assert_ne!(old_leaf.raw_serial(), new_leaf.raw_serial(), "fresh serial");

    // The client trusts only the CA file written the first time.
    let client = client_config(&first.ca_pem);
    let server = server_config(&read(&files.tls_cert), &read(&files.tls_key));
    assert_eq!(
        read(&files.tls_cert),
        second.cert_pem,
        "disk holds the new leaf"
    );
    ping(server, client, "teeguard-webhook.teeguard.svc")
        .await
        .expect("re-issued leaf verifies against the original CA");
}

#[tokio::test]
async fn expired_leaf_is_rejected_by_the_client() {
    let ca = CertificateAuthority::generate("expiry ca", 30).expect("ca");
    let ten_days_ago = SystemTime::now() - Duration::from_secs(10 * 86_400);
    let leaf = ca
        .issue(
            &ServingCertRequest::localhost()
                .with_not_before(ten_days_ago)
                .with_validity_days(1),
        )
        .expect("leaf");
    let server = server_config(leaf.cert_pem(), leaf.key_pem());
    let err = ping(server, client_config(ca.cert_pem()), "localhost")
        .await
        .expect_err("expired");
    assert!(
        matches!(
            certificate_error(&err),
            CertificateError::Expired | CertificateError::ExpiredContext { .. }
        ),
        "{err}"
    );
}

fn pem_der(pem: &str) -> Vec<u8> {
    CertificateDer::from_pem_slice(pem.as_bytes())
        .expect("pem")
        .to_vec()
}

#[test]
fn certificate_contents() {
    let req = ServingCertRequest::for_service(SVC, NS)
        .with_dns("webhook.example.com")
        .with_ip(IpAddr::V4(Ipv4Addr::new(10, 96, 0, 7)))
        .with_validity_days(30);
    let bundle = generate_bundle(&req).expect("generate");
    assert!(
        bundle.key_pem.starts_with("-----BEGIN PRIVATE KEY-----\n"),
        "PKCS#8"
    );

    let leaf_der = pem_der(&bundle.cert_pem);
    let (_, leaf) = X509Certificate::from_der(&leaf_der).expect("leaf parses");
    let san = leaf
        .subject_alternative_name()
        .expect("san parses")
        .expect("san present");
    let mut dns = Vec::new();
    let mut ips = Vec::new();
    for name in &san.value.general_names {
        match name {
            GeneralName::DNSName(d) => dns.push(d.to_string()),
            GeneralName::IPAddress(ip) => ips.push(ip.to_vec()),
            other => panic!("unexpected SAN {other:?}"),
        }
    }
    assert_eq!(
        dns,
        [
            "teeguard-webhook",
            "teeguard-webhook.teeguard",
            "teeguard-webhook.teeguard.svc",
            "teeguard-webhook.teeguard.svc.cluster.local",
            "webhook.example.com",
        ]
    );
    assert_eq!(ips, [vec![10, 96, 0, 7]]);

    let eku = leaf
        .extended_key_usage()
        .expect("eku")
        .expect("eku present");
    assert!(eku.value.server_auth);
    assert!(!eku.value.client_auth);
    let bc = leaf.basic_constraints().expect("bc").expect("bc present");
    assert!(!bc.value.ca, "leaf is not a CA");
    let ku = leaf.key_usage().expect("ku").expect("ku present");
    assert!(ku.value.digital_signature());
    assert!(!ku.value.key_cert_sign());
    match leaf.public_key().parsed().expect("spki") {
        PublicKey::EC(ec) => assert_eq!(ec.key_size(), 256, "P-256"),
        other => panic!("expected an EC key, got {other:?}"),
    }
    let cn = leaf.subject().iter_common_name().next().expect("cn");
    assert_eq!(cn.as_str().expect("utf8"), "teeguard-webhook.teeguard.svc");
    let lifetime = leaf.validity().not_after.timestamp() - leaf.validity().not_before.timestamp();
    assert_eq!(
        lifetime,
        30 * 86_400 + 3_600,
        "30 days plus one hour back-dating"
    );

    let ca_der = pem_der(&bundle.ca_pem);
    let (_, ca) = X509Certificate::from_der(&ca_der).expect("ca parses");
    let bc = ca.basic_constraints().expect("bc").expect("bc present");
    assert!(bc.value.ca);
    assert_eq!(bc.value.path_len_constraint, Some(0));
    let ku = ca.key_usage().expect("ku").expect("ku present");
    assert!(ku.value.key_cert_sign());
    assert!(ku.value.crl_sign());
    assert!(ca.subject_alternative_name().expect("san").is_none());
    assert_eq!(leaf.issuer().as_raw(), ca.subject().as_raw());
    leaf.verify_signature(Some(ca.public_key()))
        .expect("leaf is signed by the CA");
}

#[test]
fn issued_sans_are_reported() {
    let ca = CertificateAuthority::generate("sans", 1).expect("ca");
    let leaf = ca
        .issue(&ServingCertRequest::default().with_dns("localhost"))
        .expect("extra names only");
    assert_eq!(leaf.sans(), [SubjectAltName::Dns("localhost".to_owned())]);
    let err = ca
        .issue(&ServingCertRequest::default())
        .expect_err("nothing to name");
    assert!(matches!(err, Error::NoSubjectNames), "{err}");
}

/// CAs made by OpenSSL with keys in PKCS#1 (RSA, as Helm's genCA writes) and SEC1 (EC, as
/// OpenSSL and cert-manager write) form: loading them, issuing and verifying end to end.
#[tokio::test]
async fn existing_openssl_cas_with_pkcs1_and_sec1_keys_issue_verifiable_leaves() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for (cert, key) in [
        ("rsa-ca.crt", "rsa-ca-pkcs1.key"),
        ("ec-ca.crt", "ec-ca-sec1.key"),
    ] {
        let ca = CertificateAuthority::from_pem_files(&fixtures.join(cert), &fixtures.join(key))
            .unwrap_or_else(|e| panic!("{cert}: {e}"));
        assert_eq!(
            ca.cert_pem(),
            read(&fixtures.join(cert)),
            "{cert} kept as is"
        );
        assert!(
            ca.key_pem().starts_with("-----BEGIN PRIVATE KEY-----"),
            "re-encoded as PKCS#8"
        );
        let leaf = ca
            .issue(&ServingCertRequest::for_service(SVC, NS))
            .unwrap_or_else(|e| panic!("{cert}: {e}"));
        let server = server_config(leaf.cert_pem(), leaf.key_pem());
        ping(
            server,
            client_config(ca.cert_pem()),
            "teeguard-webhook.teeguard.svc",
        )
        .await
        .unwrap_or_else(|e| panic!("{cert}: {e}"));
    }
    // The key of one CA does not fit the other.
    let err = CertificateAuthority::from_pem_files(
        &fixtures.join("ec-ca.crt"),
        &fixtures.join("rsa-ca-pkcs1.key"),
    )
    .expect_err("mismatch");
    assert!(matches!(err, Error::CaKeyMismatch { .. }), "{err}");
}
