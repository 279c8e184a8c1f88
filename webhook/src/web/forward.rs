//! Forwarding a review that takes a key to the deciding replica: the
//! same AdmissionReview body, `POST /validate` over HTTPS at the address the decider's Lease gives,
//! marked with [`FORWARDED_HEADER`] so it is never forwarded twice; the decider's answer is returned as
//! it is. One HTTP/2 connection per decider address, made on first use and again after it fails.
//!
//! Trust: replicas serve one certificate (the chart's Secret), so a replica talks to a peer that
//! presents the very certificate it serves itself, or (while a renewed certificate reaches the
//! replicas one by one: the kubelet refreshes each pod's Secret volume on its own sync, up to a
//! minute or two apart) one that the CA beside it (`ca.crt`) issued for a name its own certificate
//! names. The peer's handshake signature is checked as usual.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio::sync::Mutex;

use crate::web::tls::{CA_FILE, CertStore};

/// Set on a forwarded review: its receiver decides it or refuses it, never forwards it again.
pub const FORWARDED_HEADER: &str = "x-teeguard-forwarded";

/// The server name asked for in the handshake (the certificate is pinned, not matched by name).
const SERVER_NAME: &str = "teeguard-webhook";

/// The open connection: the decider's address and the HTTP/2 handle to it.
type Connection = (String, http2::SendRequest<Full<Bytes>>);

/// Forwards reviews to the decider. Cheap to clone.
#[derive(Clone)]
pub struct Forwarder {
    tls: Arc<ClientConfig>,
    name: ServerName<'static>,
    conn: Arc<Mutex<Option<Connection>>>,
    within: Duration,
}

impl std::fmt::Debug for Forwarder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forwarder").finish_non_exhaustive()
    }
}

impl Forwarder {
    /// A forwarder trusting the certificate `served` serves and those the CA in `cert_dir` issued
    /// alike (see the module), giving up after `within` per review.
    pub fn new(
        served: Arc<CertStore>,
        cert_dir: &Path,
        within: Duration,
    ) -> crate::error::Result<Forwarder> {
        let provider = crate::web::tls::provider();
        let verifier = Arc::new(Peer {
            served,
            ca_file: cert_dir.join(CA_FILE),
            provider: provider.clone(),
        });
        let mut tls = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| crate::error::Error::TlsConfig(e.to_string()))?
            .dangerous()
            .with_custom_certificate_verifier(verifier)
            .with_no_client_auth();
        tls.alpn_protocols = vec![b"h2".to_vec()];
        let name = ServerName::try_from(SERVER_NAME)
            .map_err(|e| crate::error::Error::TlsConfig(e.to_string()))?;
        Ok(Forwarder {
            tls: Arc::new(tls),
            name,
            conn: Arc::new(Mutex::new(None)),
            within,
        })
    }

    /// Send `body` to the decider at `address` (`https://host:port`) and return its answer's body.
    /// Errors say what failed, for the refusal the caller makes of it.
    pub async fn forward(&self, address: &str, body: Bytes) -> crate::error::Result<Bytes> {
        let failed = |reason: String| crate::error::Error::Forward {
            address: address.to_string(),
            reason,
        };
        match tokio::time::timeout(self.within, self.send(address, body)).await {
            Ok(r) => r.map_err(failed),
            Err(_) => {
                self.conn.lock().await.take();
                Err(failed(format!("no answer within {:?}", self.within)))
            }
        }
    }

    /// Send `body`; `Err`: what failed, for [`crate::error::Error::Forward`].
    async fn send(&self, address: &str, body: Bytes) -> Result<Bytes, String> {
        let mut sender = self.connection(address).await?;
        let req = hyper::Request::post(format!("{address}/validate"))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(FORWARDED_HEADER, "1")
            .body(Full::new(body))
            .map_err(|e| format!("building the request: {e}"))?;
        let answer = match sender.send_request(req).await {
            Ok(a) => a,
            Err(e) => {
                self.conn.lock().await.take();
                return Err(format!("sending: {e}"));
            }
        };
        let status = answer.status();
        let bytes = answer
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("reading its answer: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!(
                "it answered {status}: {}",
                String::from_utf8_lossy(&bytes)
            ));
        }
        Ok(bytes)
    }

    /// The connection to `address`, made when there is none (or one to another address).
    async fn connection(&self, address: &str) -> Result<http2::SendRequest<Full<Bytes>>, String> {
        let mut slot = self.conn.lock().await;
        if let Some((at, sender)) = slot.as_ref()
            && at == address
            && !sender.is_closed()
        {
            return Ok(sender.clone());
        }
        let authority = address
            .strip_prefix("https://")
            .ok_or_else(|| "the address is not https://host:port".to_string())?;
        let tcp = tokio::net::TcpStream::connect(authority)
            .await
            .map_err(|e| format!("connecting: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let tls = tokio_rustls::TlsConnector::from(self.tls.clone())
            .connect(self.name.clone(), tcp)
            .await
            .map_err(|e| format!("TLS: {e}"))?;
        let (sender, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .map_err(|e| format!("HTTP/2: {e}"))?;
        let at = address.to_string();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(decider = at, error = %e, "the connection to the deciding replica ended");
            }
        });
        *slot = Some((address.to_string(), sender.clone()));
        Ok(sender)
    }
}

/// Trusts the peer that serves this replica's certificate, or one its CA issued alike (see the
/// module).
#[derive(Debug)]
struct Peer {
    served: Arc<CertStore>,
    ca_file: PathBuf,
    provider: Arc<CryptoProvider>,
}

impl Peer {
    /// Whether `leaf` is one `ca_file`'s CA issued for a name `mine` names (the reason why not).
    fn issued_alike(
        &self,
        mine: &CertificateDer<'_>,
        leaf: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ServerCertVerified, String> {
        let ca = self.ca_file.display();
        let pem =
            std::fs::read(&self.ca_file).map_err(|e| format!("and {ca} cannot be read ({e})"))?;
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let cert = cert.map_err(|e| format!("and {ca} is not valid PEM ({e})"))?;
            roots
                .add(cert)
                .map_err(|e| format!("and {ca} holds no usable CA ({e})"))?;
        }
        let name = name_of(mine).ok_or("and this replica's certificate names no DNS name or IP")?;
        let verifier =
            WebPkiServerVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
                .build()
                .map_err(|e| format!("and {ca} holds no usable CA ({e})"))?;
        verifier
            .verify_server_cert(leaf, intermediates, &name, &[], now)
            .map_err(|e| format!("nor one {ca} issued for {} ({e})", name.to_str()))
    }
}

/// The first DNS name (else IP address) of `cert`'s subject alternative names.
fn name_of(cert: &CertificateDer<'_>) -> Option<ServerName<'static>> {
    use x509_parser::extensions::GeneralName;
    let (_, parsed) = x509_parser::parse_x509_certificate(cert).ok()?;
    let sans = parsed.subject_alternative_name().ok()??;
    let names = &sans.value.general_names;
    let dns = names.iter().find_map(|n| match n {
        GeneralName::DNSName(d) => ServerName::try_from(d.to_string()).ok(),
        _ => None,
    });
    dns.or_else(|| {
        names.iter().find_map(|n| match n {
            GeneralName::IPAddress(ip) => match ip.len() {
                4 => Some(std::net::IpAddr::from(<[u8; 4]>::try_from(*ip).ok()?)),
                16 => Some(std::net::IpAddr::from(<[u8; 16]>::try_from(*ip).ok()?)),
                _ => None,
            }
            .map(ServerName::from),
            _ => None,
        })
    })
}

impl ServerCertVerifier for Peer {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let served = self.served.current();
        let Some(mine) = served.cert.first() else {
            return Err(rustls::Error::General(
                "this replica serves no certificate".into(),
            ));
        };
        if mine.as_ref() == end_entity.as_ref() {
            return Ok(ServerCertVerified::assertion());
        }
        self.issued_alike(mine, end_entity, intermediates, now)
            .map_err(|why| {
                rustls::Error::General(format!(
                    "the peer does not serve this replica's certificate {why}"
                ))
            })
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::web::tls::{CERT_FILE, KEY_FILE, install_crypto_provider, load_pair};
    use teeguard_certs::{CertificateAuthority, ServingCert, ServingCertRequest};

    fn leaf(ca: &CertificateAuthority) -> ServingCert {
        ca.issue(&ServingCertRequest::localhost()).expect("leaf")
    }

    /// The verifier of a replica serving `mine`, with `ca` (if any) as its `ca.crt`.
    fn replica(mine: &ServingCert, ca: Option<&CertificateAuthority>) -> (tempfile::TempDir, Peer) {
        install_crypto_provider();
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join(CERT_FILE), mine.cert_pem()).expect("cert");
        std::fs::write(dir.path().join(KEY_FILE), mine.key_pem()).expect("key");
        if let Some(ca) = ca {
            std::fs::write(dir.path().join(CA_FILE), ca.cert_pem()).expect("ca");
        }
        let pair = load_pair(dir.path()).expect("pair");
        let peer = Peer {
            served: Arc::new(CertStore::new(pair.key)),
            ca_file: dir.path().join(CA_FILE),
            provider: crate::web::tls::provider(),
        };
        (dir, peer)
    }

    fn verify(peer: &Peer, theirs: &ServingCert) -> Result<ServerCertVerified, rustls::Error> {
        let name = ServerName::try_from(SERVER_NAME).expect("name");
        peer.verify_server_cert(&theirs.cert_der(), &[], &name, &[], UnixTime::now())
    }

    #[test]
    fn a_peer_is_trusted_with_this_replicas_certificate_or_another_of_its_ca_only() {
        let ca = CertificateAuthority::generate("teeguard-ca", 30).expect("ca");
        let other_ca = CertificateAuthority::generate("someone-else", 30).expect("ca");
        let (mine, renewed, foreign) = (leaf(&ca), leaf(&ca), leaf(&other_ca));

        let (_dir, peer) = replica(&mine, Some(&ca));
        assert!(verify(&peer, &mine).is_ok(), "the same certificate");
        assert!(verify(&peer, &renewed).is_ok(), "a renewal of the same CA");
        let err = verify(&peer, &foreign)
            .expect_err("another CA's")
            .to_string();
        assert!(err.contains("nor one") && err.contains(CA_FILE), "{err}");

        // Without ca.crt (an existing Secret that has none): only the same certificate.
        let (_dir, pinned) = replica(&mine, None);
        assert!(verify(&pinned, &mine).is_ok());
        let err = verify(&pinned, &renewed)
            .expect_err("no CA to check it")
            .to_string();
        assert!(err.contains("cannot be read"), "{err}");
    }

    #[test]
    fn a_certificate_with_ip_addresses_only_is_checked_against_its_first_ip() {
        let ca = CertificateAuthority::generate("teeguard-ca", 30).expect("ca");
        let for_ips = |ips: &[&str]| {
            let request = ServingCertRequest {
                extra_ips: ips.iter().map(|ip| ip.parse().expect("ip")).collect(),
                ..ServingCertRequest::default()
            };
            ca.issue(&request).expect("leaf")
        };
        for first in ["10.96.0.17", "fd00::17"] {
            let mine = for_ips(&[first, "192.0.2.1"]);
            let (_dir, peer) = replica(&mine, Some(&ca));
            assert!(
                verify(&peer, &for_ips(&[first])).is_ok(),
                "a renewal naming {first}"
            );
            let err = verify(&peer, &for_ips(&["192.0.2.1"]))
                .expect_err("a certificate for another address of the CA's")
                .to_string();
            assert!(err.contains("nor one"), "{err}");
        }
    }
}
