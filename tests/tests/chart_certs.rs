//! The webhook's serving certificate as the chart renders it: Helm-generated, user-supplied, an existing
//! Secret, or cert-manager. The leaf must verify against the CA for every DNS name of the Service (checked
//! with rustls' WebPKI verifier and a real in-memory TLS handshake, which also proves the key matches), and
//! the caBundle of both webhook configurations must be the Secret's ca.crt.
//!
//! Needs `TEEGUARD_HELM` (set by `scripts/chart-tools.sh`, which `scripts/test.sh` sources).

mod chart_support;

use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::sync::Arc;

use chart_support::*;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig, ServerConnection};
use serde_json::Value;

const SERVICE: &str = "teeguard-webhook";
const SECRET: &str = "teeguard-webhook-tls";

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certs(pem: &[u8]) -> Vec<CertificateDer<'static>> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .expect("PEM certificates");
    assert!(
        !certs.is_empty(),
        "no certificate in {}",
        String::from_utf8_lossy(pem)
    );
    certs
}

fn roots(ca_pem: &[u8]) -> Arc<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for c in certs(ca_pem) {
        roots
            .add(c)
            .expect("CA certificate is a usable trust anchor");
    }
    Arc::new(roots)
}

/// rustls' WebPKI verification of the leaf for one DNS name against the CA.
fn verify(ca_pem: &[u8], leaf_pem: &[u8], name: &str) -> Result<(), rustls::Error> {
    let verifier = WebPkiServerVerifier::builder_with_provider(roots(ca_pem), provider())
        .build()
        .expect("verifier");
    let chain = certs(leaf_pem);
    let server_name = ServerName::try_from(name.to_string()).expect("DNS name");
    verifier
        .verify_server_cert(&chain[0], &chain[1..], &server_name, &[], UnixTime::now())
        .map(|_| ())
}

/// A full TLS handshake in memory (server: the rendered certificate and key; client: trusts only the
/// rendered CA, connects to `name`), then one message each way.
fn handshake(ca_pem: &[u8], crt_pem: &[u8], key_pem: &[u8], name: &str) -> Result<(), String> {
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| format!("key: {e}"))?;
    let server_config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(certs(crt_pem), key)
        .map_err(|e| format!("server certificate/key: {e}"))?;
    let client_config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots(ca_pem))
        .with_no_client_auth();
    let server_name = ServerName::try_from(name.to_string()).map_err(|e| e.to_string())?;
    let mut client = rustls::Connection::from(
        ClientConnection::new(Arc::new(client_config), server_name).map_err(|e| e.to_string())?,
    );
    let mut server = rustls::Connection::from(
        ServerConnection::new(Arc::new(server_config)).map_err(|e| e.to_string())?,
    );

    client
        .writer()
        .write_all(b"ping")
        .map_err(|e| e.to_string())?;
    let mut got = Vec::new();
    for _ in 0..32 {
        flight(&mut client, &mut server, "server")?;
        flight(&mut server, &mut client, "client")?;
        let mut chunk = [0u8; 16];
        match server.reader().read(&mut chunk) {
            Ok(n) => got.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e.to_string()),
        }
        if got == b"ping" && !client.is_handshaking() && !server.is_handshaking() {
            return Ok(());
        }
    }
    Err(format!(
        "handshake did not complete; server received {got:?}"
    ))
}

/// Everything `from` has to send, read and processed by `to` (named in errors).
fn flight(
    from: &mut rustls::Connection,
    to: &mut rustls::Connection,
    to_name: &str,
) -> Result<(), String> {
    let mut buf = Vec::new();
    while from.wants_write() {
        from.write_tls(&mut buf).map_err(|e| e.to_string())?;
    }
    let mut slice = &buf[..];
    while !slice.is_empty() {
        to.read_tls(&mut slice).map_err(|e| e.to_string())?;
        to.process_new_packets()
            .map_err(|e| format!("{to_name}: {e}"))?;
    }
    Ok(())
}

fn san_dns_names(pem: &[u8]) -> BTreeSet<String> {
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem).expect("PEM");
    let cert = pem.parse_x509().expect("X.509");
    let san = cert
        .subject_alternative_name()
        .expect("well-formed SAN")
        .expect("a subjectAltName extension");
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            x509_parser::extensions::GeneralName::DNSName(d) => Some(d.to_string()),
            _ => None,
        })
        .collect()
}

fn is_ca(pem: &[u8]) -> bool {
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem).expect("PEM");
    pem.parse_x509().expect("X.509").is_ca()
}

fn validity_days(pem: &[u8]) -> i64 {
    let (_, pem) = x509_parser::pem::parse_x509_pem(pem).expect("PEM");
    let cert = pem.parse_x509().expect("X.509");
    let v = cert.validity();
    (v.not_after.timestamp() - v.not_before.timestamp()) / 86_400
}

/// The three PEMs of the rendered Secret.
struct Rendered {
    crt: Vec<u8>,
    key: Vec<u8>,
    ca: Vec<u8>,
    ca_b64: String,
}

fn secret(docs: &[Value], name: &str) -> Rendered {
    let s = find(docs, "Secret", name);
    assert_eq!(s["type"], "kubernetes.io/tls");
    let field = |k: &str| str_at(s, &format!("/data/{}", k.replace('/', "~1"))).to_string();
    Rendered {
        crt: b64(&field("tls.crt")),
        key: b64(&field("tls.key")),
        ca: b64(&field("ca.crt")),
        ca_b64: field("ca.crt"),
    }
}

/// Both webhook configurations' caBundles (every webhook in them).
fn ca_bundles(docs: &[Value]) -> Vec<Option<String>> {
    [
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
    ]
    .into_iter()
    .flat_map(|kind| {
        only(docs, kind)["webhooks"]
            .as_array()
            .expect("webhooks")
            .iter()
            .map(|w| w["clientConfig"]["caBundle"].as_str().map(str::to_string))
            .collect::<Vec<_>>()
    })
    .collect()
}

fn assert_serves_the_service(r: &Rendered, namespace: &str) {
    let names = service_dns_names(SERVICE, namespace);
    assert_eq!(
        san_dns_names(&r.crt),
        names.iter().cloned().collect::<BTreeSet<_>>(),
        "the serving certificate must name exactly the Service's DNS names"
    );
    assert!(is_ca(&r.ca), "ca.crt must be a CA certificate");
    assert!(!is_ca(&r.crt), "tls.crt must not be a CA certificate");
    for name in &names {
        verify(&r.ca, &r.crt, name).unwrap_or_else(|e| panic!("{name}: {e}"));
        handshake(&r.ca, &r.crt, &r.key, name).unwrap_or_else(|e| panic!("TLS to {name}: {e}"));
    }
    // The checks can fail: another name is refused.
    assert!(verify(&r.ca, &r.crt, &format!("other.{namespace}.svc")).is_err());
    assert!(handshake(&r.ca, &r.crt, &r.key, "kubernetes.default.svc").is_err());
}

#[test]
fn generated_certificate_verifies_against_its_ca_for_every_service_name() {
    let docs = render("default", &[]);
    let r = secret(&docs, SECRET);
    assert_serves_the_service(&r, NAMESPACE);
    // genSignedCert makes PKCS#1 RSA keys: the webhook's loader must accept them (rustls did above).
    assert!(String::from_utf8_lossy(&r.key).starts_with("-----BEGIN RSA PRIVATE KEY-----"));
    let days = validity_days(&r.crt);
    assert!(
        (3649..=3651).contains(&days),
        "validity {days} days, expected webhook.tls.validityDays=3650"
    );
    assert_eq!(ca_bundles(&docs), vec![Some(r.ca_b64.clone()); 4]);
    // The Deployment mounts that Secret.
    let d = find(&docs, "Deployment", SERVICE);
    let volumes = d["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .expect("volumes");
    assert!(volumes.iter().any(|v| v["secret"]["secretName"] == SECRET));
}

#[test]
fn generated_certificate_follows_the_namespace_and_validity() {
    let out = helm_template_in(
        "tee-system",
        &["default"],
        &["--set", "webhook.tls.validityDays=30"],
    );
    assert!(out.success, "{}", out.stderr);
    let docs = parse_documents(&out.stdout);
    let r = secret(&docs, SECRET);
    assert_serves_the_service(&r, "tee-system");
    assert!((29..=31).contains(&validity_days(&r.crt)));
    assert!(
        verify(&r.ca, &r.crt, &format!("{SERVICE}.{NAMESPACE}.svc")).is_err(),
        "a certificate for tee-system must not be valid for another namespace"
    );
}

#[test]
fn every_render_without_a_cluster_generates_a_new_ca() {
    // helm template has no cluster for `lookup` (the GitOps caveat in the chart README): each render makes
    // a new CA, and a leaf of one render does not verify against the CA of another.
    let a = secret(&render("default", &[]), SECRET);
    let b = secret(&render("default", &[]), SECRET);
    assert_ne!(a.ca, b.ca);
    let name = format!("{SERVICE}.{NAMESPACE}.svc");
    assert!(verify(&b.ca, &a.crt, &name).is_err());
    assert!(handshake(&b.ca, &a.crt, &a.key, &name).is_err());
}

/// The PEMs in tests/chart/user-certs.yaml.
fn user_values() -> (String, String, String) {
    let text = std::fs::read_to_string(values_file("user-certs")).expect("user-certs.yaml");
    let v: Value = serde_yaml::from_str(&text).expect("YAML");
    let tls = &v["webhook"]["tls"];
    (
        str_at(tls, "/crt").to_string(),
        str_at(tls, "/key").to_string(),
        str_at(tls, "/caCrt").to_string(),
    )
}

#[test]
fn user_supplied_certificate_is_used_verbatim() {
    let (crt, key, ca) = user_values();
    let docs = render("user-certs", &[]);
    let r = secret(&docs, SECRET);
    assert_eq!(String::from_utf8_lossy(&r.crt), crt);
    assert_eq!(String::from_utf8_lossy(&r.key), key);
    assert_eq!(String::from_utf8_lossy(&r.ca), ca);
    assert_serves_the_service(&r, NAMESPACE);
    assert_eq!(ca_bundles(&docs), vec![Some(r.ca_b64.clone()); 4]);
}

#[test]
fn incomplete_user_certificate_is_refused_with_a_clear_message() {
    let out = helm_template(&["default"], &["--set", "webhook.tls.crt=abc"]);
    assert!(!out.success);
    assert!(
        out.stderr.contains("set crt, key and caCrt together"),
        "{}",
        out.stderr
    );
    let out = helm_template(&["user-certs"], &["--set", "webhook.tls.existingSecret=x"]);
    assert!(!out.success);
    assert!(out.stderr.contains("not both"), "{}", out.stderr);
}

#[test]
fn existing_secret_is_mounted_and_its_ca_becomes_the_ca_bundle() {
    let (_, _, ca) = user_values();
    let docs = render("existing-secret", &[]);
    assert!(
        all(&docs, "Secret").is_empty(),
        "the chart must not render the user's Secret"
    );
    let d = find(&docs, "Deployment", SERVICE);
    let volumes = d["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .expect("volumes");
    assert!(
        volumes
            .iter()
            .any(|v| v["secret"]["secretName"] == "my-webhook-tls")
    );
    let bundles = ca_bundles(&docs);
    assert_eq!(bundles.len(), 4);
    for b in bundles {
        assert_eq!(b64(&b.expect("caBundle")), ca.as_bytes());
    }
    // Without caCrt, under helm template (no cluster to read the Secret's ca.crt), rendering fails and says
    // what to set.
    let out = helm_template(
        &["default"],
        &["--set", "webhook.tls.existingSecret=my-webhook-tls"],
    );
    assert!(!out.success);
    assert!(out.stderr.contains("webhook.tls.caCrt"), "{}", out.stderr);
}

#[test]
fn cert_manager_issues_the_certificate_and_injects_the_ca() {
    let docs = render("cert-manager", &[]);
    assert!(
        all(&docs, "Secret").is_empty(),
        "cert-manager writes the Secret, not the chart"
    );
    assert!(
        ca_bundles(&docs).iter().all(Option::is_none),
        "no caBundle with cert-manager: its CA injector fills it"
    );
    let issuers = all(&docs, "Issuer");
    let certificates = all(&docs, "Certificate");
    assert_eq!((issuers.len(), certificates.len()), (2, 2));

    // selfsigned Issuer -> CA Certificate -> CA Issuer -> serving Certificate.
    let selfsigned = issuers
        .iter()
        .find(|i| i["spec"].get("selfSigned").is_some())
        .expect("selfSigned Issuer");
    let ca_cert = certificates
        .iter()
        .find(|c| c["spec"]["isCA"] == true)
        .expect("CA Certificate");
    assert_eq!(
        ca_cert["spec"]["issuerRef"]["name"],
        selfsigned["metadata"]["name"]
    );
    assert_eq!(ca_cert["spec"]["issuerRef"]["kind"], "Issuer");
    let ca_issuer = issuers
        .iter()
        .find(|i| i["spec"].get("ca").is_some())
        .expect("CA Issuer");
    assert_eq!(
        ca_issuer["spec"]["ca"]["secretName"],
        ca_cert["spec"]["secretName"]
    );
    let serving = certificates
        .iter()
        .find(|c| c["spec"].get("isCA").is_none())
        .expect("serving Certificate");
    assert_eq!(
        serving["spec"]["issuerRef"]["name"],
        ca_issuer["metadata"]["name"]
    );
    assert_eq!(serving["spec"]["issuerRef"]["kind"], "Issuer");
    assert_eq!(serving["spec"]["duration"], "720h");
    assert_eq!(serving["spec"]["renewBefore"], "168h");
    for obj in issuers.iter().chain(&certificates) {
        assert_eq!(obj["metadata"]["namespace"], NAMESPACE);
        assert_eq!(obj["apiVersion"], "cert-manager.io/v1");
    }
    let dns: Vec<&str> = serving["spec"]["dnsNames"]
        .as_array()
        .expect("dnsNames")
        .iter()
        .map(|v| v.as_str().expect("str"))
        .collect();
    assert_eq!(dns, service_dns_names(SERVICE, NAMESPACE));
    // The webhook mounts the Secret cert-manager writes.
    assert_eq!(serving["spec"]["secretName"], SECRET);
    let d = find(&docs, "Deployment", SERVICE);
    let volumes = d["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .expect("volumes");
    assert!(volumes.iter().any(|v| v["secret"]["secretName"] == SECRET));
    // Both webhook configurations ask the CA injector for that Certificate's CA.
    let expected = format!("{NAMESPACE}/{}", str_at(serving, "/metadata/name"));
    for kind in [
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
    ] {
        assert_eq!(
            only(&docs, kind)["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
            expected.as_str(),
            "{kind}"
        );
    }
    // No certificate checksum rolls the webhook: it reloads renewed certificates itself.
    let annotations = d["spec"]["template"]["metadata"]["annotations"]
        .as_object()
        .expect("annotations");
    assert!(
        annotations
            .keys()
            .all(|k| !k.contains("cert") && !k.contains("tls")),
        "{annotations:?}"
    );
}
