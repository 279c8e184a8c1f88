//! Forwarding a review that takes a key to the deciding replica: the
//! same AdmissionReview body, `POST /validate` over HTTPS at the address the decider's Lease gives,
//! marked with [`FORWARDED_HEADER`] so it is never forwarded twice; the decider's answer is returned as
//! it is. One HTTP/2 connection per decider address, made on first use and again after it fails.
//!
//! Trust: replicas serve one certificate (the chart's Secret), so a replica talks only to a peer that
//! presents the very certificate it serves itself; the peer's handshake signature is checked as usual.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use tokio::sync::Mutex;

use crate::web::tls::CertStore;

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
    /// A forwarder trusting the certificate `served` serves, giving up after `within` per review.
    pub fn new(served: Arc<CertStore>, within: Duration) -> crate::error::Result<Forwarder> {
        let provider = crate::web::tls::provider();
        let verifier = Arc::new(SameCertificate {
            served,
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
    pub async fn forward(&self, address: &str, body: Bytes) -> Result<Bytes, String> {
        match tokio::time::timeout(self.within, self.send(address, body)).await {
            Ok(r) => r,
            Err(_) => {
                self.conn.lock().await.take();
                Err(format!(
                    "the deciding replica at {address} did not answer within {:?}",
                    self.within
                ))
            }
        }
    }

    async fn send(&self, address: &str, body: Bytes) -> Result<Bytes, String> {
        let mut sender = self.connection(address).await?;
        let req = hyper::Request::post(format!("{address}/validate"))
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .header(FORWARDED_HEADER, "1")
            .body(Full::new(body))
            .map_err(|e| format!("building the forwarded request: {e}"))?;
        let answer = match sender.send_request(req).await {
            Ok(a) => a,
            Err(e) => {
                self.conn.lock().await.take();
                return Err(format!(
                    "forwarding to the deciding replica at {address}: {e}"
                ));
            }
        };
        let status = answer.status();
        let bytes = answer
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("reading the deciding replica's answer from {address}: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!(
                "the deciding replica at {address} answered {status}: {}",
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
            .ok_or_else(|| format!("the decider's address {address:?} is not https://host:port"))?;
        let tcp = tokio::net::TcpStream::connect(authority)
            .await
            .map_err(|e| format!("connecting to the deciding replica at {address}: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let tls = tokio_rustls::TlsConnector::from(self.tls.clone())
            .connect(self.name.clone(), tcp)
            .await
            .map_err(|e| format!("TLS with the deciding replica at {address}: {e}"))?;
        let (sender, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
            .await
            .map_err(|e| format!("HTTP/2 with the deciding replica at {address}: {e}"))?;
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

/// Trusts exactly the leaf certificate this replica serves.
#[derive(Debug)]
struct SameCertificate {
    served: Arc<CertStore>,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for SameCertificate {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let served = self.served.current();
        match served.cert.first() {
            Some(mine) if mine.as_ref() == end_entity.as_ref() => Ok(ServerCertVerified::assertion()),
            _ => Err(rustls::Error::General(
                "the peer does not serve this replica's certificate (a rotation in progress, or not a \
                 teeguard replica)"
                    .into(),
            )),
        }
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
