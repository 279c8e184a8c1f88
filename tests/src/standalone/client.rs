//! An HTTPS client for the webhook that behaves like kube-apiserver's: it trusts only the webhook's CA,
//! checks the server name, keeps one HTTP/1.1 connection alive between reviews, and retries a request
//! once on a fresh connection when a kept-alive connection turns out to be closed (Go's transport does
//! the same for requests that were not answered at all).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::prelude::BASE64_STANDARD;
use bytes::Bytes;
use http::{Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;
use tokio::sync::Mutex;

use crate::{Error, Result};

/// Time limit of one review round trip (the API server's default webhook timeout).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// An HTTPS client for one webhook address.
pub struct WebhookClient {
    addr: SocketAddr,
    server_name: ServerName<'static>,
    tls: tokio_rustls::TlsConnector,
    conn: Mutex<Option<SendRequest<Full<Bytes>>>>,
    timeout: Duration,
}

impl std::fmt::Debug for WebhookClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebhookClient")
            .field("addr", &self.addr)
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

/// The name of a method this client sends, for errors.
fn method_name(method: &http::Method) -> &'static str {
    if method == http::Method::GET {
        "GET"
    } else {
        "POST"
    }
}

/// A rustls client configuration trusting only `ca` (ring provider, HTTP/1.1 ALPN).
pub fn client_config(ca: CertificateDer<'static>) -> Result<Arc<rustls::ClientConfig>> {
    let tls_err = |reason: String| Error::Startup {
        what: "webhook client TLS configuration",
        reason,
    };
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(ca)
        .map_err(|e| tls_err(format!("the CA certificate is not usable: {e}")))?;
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| tls_err(e.to_string()))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

impl WebhookClient {
    /// A client for the webhook at `addr` whose certificate must chain to `ca` and name `localhost`.
    pub fn new(addr: SocketAddr, ca: CertificateDer<'static>) -> Result<Self> {
        Ok(WebhookClient {
            addr,
            server_name: ServerName::try_from("localhost").map_err(|e| Error::Startup {
                what: "webhook client",
                reason: e.to_string(),
            })?,
            tls: tokio_rustls::TlsConnector::from(client_config(ca)?),
            conn: Mutex::new(None),
            timeout: DEFAULT_TIMEOUT,
        })
    }

    /// A client trusting the PEM CA certificate `ca_pem`.
    pub fn from_ca_pem(addr: SocketAddr, ca_pem: &str) -> Result<Self> {
        use rustls::pki_types::pem::PemObject as _;
        let ca = CertificateDer::from_pem_slice(ca_pem.as_bytes()).map_err(|e| Error::Startup {
            what: "webhook client",
            reason: format!("the CA certificate is not PEM: {e}"),
        })?;
        Self::new(addr, ca)
    }

    /// Change the per-request time limit (default [`DEFAULT_TIMEOUT`]).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The webhook's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    async fn connect(&self) -> Result<SendRequest<Full<Bytes>>> {
        let tcp = tokio::net::TcpStream::connect(self.addr)
            .await
            .map_err(|source| Error::Connect {
                addr: self.addr,
                source,
            })?;
        let _ = tcp.set_nodelay(true);
        let tls = self
            .tls
            .connect(self.server_name.clone(), tcp)
            .await
            .map_err(|source| Error::Tls {
                addr: self.addr,
                source,
            })?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| Error::Http {
                method: "POST",
                url: format!("https://{}", self.addr),
                reason: format!("HTTP/1.1 handshake: {e}"),
            })?;
        tokio::spawn(async move {
            // Ends when the server closes the connection or the sender is dropped.
            let _ = conn.await;
        });
        Ok(sender)
    }

    fn request(&self, path: &str, body: &[u8]) -> Result<Request<Full<Bytes>>> {
        self.request_with(http::Method::POST, path, body)
    }

    fn request_with(
        &self,
        method: http::Method,
        path: &str,
        body: &[u8],
    ) -> Result<Request<Full<Bytes>>> {
        let name = method_name(&method);
        Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, format!("localhost:{}", self.addr.port()))
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "application/json, */*")
            .body(Full::new(Bytes::copy_from_slice(body)))
            .map_err(|e| Error::Http {
                method: name,
                url: self.url(path),
                reason: e.to_string(),
            })
    }

    fn url(&self, path: &str) -> String {
        format!("https://{}{path}", self.addr)
    }

    /// POST `body` to `path` on the kept-alive connection (opened on first use). A request that fails
    /// on a reused connection before any answer arrives is retried once on a new connection.
    pub async fn post(&self, path: &str, body: &[u8]) -> Result<(StatusCode, Bytes)> {
        let work = async {
            let mut slot = self.conn.lock().await;
            let mut reused = true;
            loop {
                let sender = match slot.as_mut() {
                    Some(s) if !s.is_closed() => s,
                    _ => {
                        reused = false;
                        slot.insert(self.connect().await?)
                    }
                };
                let sent = match sender.ready().await {
                    Ok(()) => sender.send_request(self.request(path, body)?).await,
                    Err(e) => Err(e),
                };
                match sent {
                    Ok(resp) => return self.read(resp, "POST", path).await,
                    Err(e) if reused && (e.is_closed() || e.is_canceled()) => {
                        // The server closed the idle connection as we reused it: nothing was
                        // answered, so the request is sent again on a fresh connection.
                        *slot = None;
                    }
                    Err(e) => {
                        *slot = None;
                        return Err(Error::Http {
                            method: "POST",
                            url: self.url(path),
                            reason: e.to_string(),
                        });
                    }
                }
            }
        };
        match tokio::time::timeout(self.timeout, work).await {
            Ok(r) => r,
            Err(_) => {
                // A connection in an unknown state is not reused.
                *self.conn.lock().await = None;
                Err(Error::Timeout {
                    log: None,
                    what: format!("the webhook to answer POST {path}"),
                    after: self.timeout,
                })
            }
        }
    }

    /// The status and whole body of the answer to `method path`.
    async fn read(
        &self,
        resp: http::Response<hyper::body::Incoming>,
        method: &'static str,
        path: &str,
    ) -> Result<(StatusCode, Bytes)> {
        let status = resp.status();
        let body = resp.into_body().collect().await;
        let bytes = body.map_err(|e| Error::Http {
            method,
            url: self.url(path),
            reason: format!("reading the response body: {e}"),
        })?;
        Ok((status, bytes.to_bytes()))
    }

    /// POST `body` to `path` on a new connection that is closed afterwards.
    pub async fn post_fresh(&self, path: &str, body: &[u8]) -> Result<(StatusCode, Bytes)> {
        self.send_fresh(http::Method::POST, path, body).await
    }

    /// GET `path` on a new connection that is closed afterwards (a component's health or leader
    /// endpoint).
    pub async fn get(&self, path: &str) -> Result<(StatusCode, Bytes)> {
        self.send_fresh(http::Method::GET, path, &[]).await
    }

    async fn send_fresh(
        &self,
        method: http::Method,
        path: &str,
        body: &[u8],
    ) -> Result<(StatusCode, Bytes)> {
        let name = method_name(&method);
        let work = async {
            let mut sender = self.connect().await?;
            let resp = sender
                .send_request(self.request_with(method.clone(), path, body)?)
                .await
                .map_err(|e| Error::Http {
                    method: name,
                    url: self.url(path),
                    reason: e.to_string(),
                })?;
            self.read(resp, name, path).await
        };
        match tokio::time::timeout(self.timeout, work).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                log: None,
                what: format!("an answer to {name} {path} on a new connection"),
                after: self.timeout,
            }),
        }
    }

    /// Send an AdmissionReview to `path` (`/mutate`, `/validate`) and parse the answer, checking that it
    /// echoes the request's UID.
    pub async fn review(&self, path: &str, review: &Value) -> Result<ReviewReply> {
        let body = serde_json::to_vec(review).map_err(|e| Error::Failed {
            what: "AdmissionReview".into(),
            reason: e.to_string(),
        })?;
        let (status, bytes) = self.post(path, &body).await?;
        ReviewReply::from_http(path, status, &bytes, review)
    }
}

/// Send `reviews` to `path` all at once (released together by one barrier), each on a new connection,
/// spread over `clients` in turn: the replies, in order, as racing API servers would get them.
pub async fn review_together(
    clients: &[Arc<WebhookClient>],
    path: &str,
    reviews: Vec<Value>,
) -> Result<Vec<ReviewReply>> {
    let barrier = Arc::new(tokio::sync::Barrier::new(reviews.len()));
    let mut tasks = Vec::new();
    for (i, review) in reviews.into_iter().enumerate() {
        let client = clients[i % clients.len()].clone();
        let (barrier, path) = (barrier.clone(), path.to_owned());
        tasks.push(tokio::spawn(async move {
            let body =
                serde_json::to_vec(&review).map_err(|e| Error::failed("AdmissionReview", e))?;
            barrier.wait().await;
            let (status, bytes) = client.post_fresh(&path, &body).await?;
            ReviewReply::from_http(&path, status, &bytes, &review)
        }));
    }
    let mut replies = Vec::new();
    for t in tasks {
        replies.push(t.await.map_err(|e| Error::failed("a racing review", e))??);
    }
    Ok(replies)
}

/// How many of `replies` allowed.
pub fn admitted(replies: &[ReviewReply]) -> usize {
    replies.iter().filter(|r| r.allowed).count()
}

/// The messages of the refusals among `replies`.
pub fn refusals(replies: &[ReviewReply]) -> Vec<String> {
    replies
        .iter()
        .filter(|r| !r.allowed)
        .map(|r| r.message.clone().unwrap_or_default())
        .collect()
}

/// How a review ended, as a person reads it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Decision {
    /// Allowed with a JSON Patch.
    Patched,
    /// Allowed unchanged.
    Allowed,
    /// Allowed with warnings.
    Warned,
    /// Refused.
    Denied,
}

impl Decision {
    /// Lowercase word for tables.
    pub fn as_str(self) -> &'static str {
        match self {
            Decision::Patched => "patched",
            Decision::Allowed => "allowed",
            Decision::Warned => "warned",
            Decision::Denied => "denied",
        }
    }
}

impl std::fmt::Display for Decision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The webhook's `response`, parsed the way kube-apiserver reads it.
#[derive(Clone, Debug, PartialEq)]
pub struct ReviewReply {
    /// `response.uid` (checked against the request's).
    pub uid: String,
    /// `response.allowed`.
    pub allowed: bool,
    /// `response.status.code` of a denial.
    pub code: Option<u16>,
    /// `response.status.message` of a denial.
    pub message: Option<String>,
    /// `response.status.reason` of a denial.
    pub reason: Option<String>,
    /// The decoded JSON Patch (`patch` as base64 or as an array of byte values, both accepted).
    pub patch: Option<json_patch::Patch>,
    /// `response.warnings`.
    pub warnings: Vec<String>,
    /// `response.auditAnnotations`.
    pub audit: BTreeMap<String, String>,
    /// The whole AdmissionReview answered.
    pub raw: Value,
}

impl ReviewReply {
    /// Parse an HTTP answer to `review` from `path`.
    pub fn from_http(path: &str, status: StatusCode, body: &[u8], review: &Value) -> Result<Self> {
        if !status.is_success() {
            let text = String::from_utf8_lossy(body);
            return Err(Error::HttpStatus {
                path: path.to_string(),
                status: status.as_u16(),
                body: text.trim().chars().take(500).collect(),
            });
        }
        let bad = |reason: String| Error::BadReply {
            path: path.to_string(),
            reason,
        };
        let raw: Value =
            serde_json::from_slice(body).map_err(|e| bad(format!("not JSON ({e})")))?;
        let response = raw
            .get("response")
            .ok_or_else(|| bad("no `response`".into()))?;
        let uid = response["uid"].as_str().unwrap_or_default().to_string();
        let sent_uid = review["request"]["uid"].as_str().unwrap_or_default();
        if uid != sent_uid {
            return Err(bad(format!(
                "response.uid {uid:?} does not echo request.uid {sent_uid:?}"
            )));
        }
        let allowed = response
            .get("allowed")
            .and_then(Value::as_bool)
            .ok_or_else(|| bad("`response.allowed` is missing".into()))?;
        let status = &response["status"];
        let code = status["code"].as_u64().and_then(|c| u16::try_from(c).ok());
        let message = status["message"].as_str().map(str::to_string);
        let reason = status["reason"].as_str().map(str::to_string);
        let patch = match (response.get("patchType"), response.get("patch")) {
            (None, None) => None,
            (Some(t), Some(p)) if t == "JSONPatch" => Some(decode_patch(p).map_err(bad)?),
            (t, p) => {
                return Err(bad(format!(
                    "patchType {t:?} and patch {} must come together, and patchType must be JSONPatch",
                    if p.is_some() { "present" } else { "absent" }
                )));
            }
        };
        if patch.is_some() && !allowed {
            return Err(bad("a denial carries a patch".into()));
        }
        let warnings = response
            .get("warnings")
            .and_then(Value::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        let audit = response
            .get("auditAnnotations")
            .and_then(Value::as_object)
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| v.as_str().map(|v| (k.clone(), v.to_string())))
                    .collect()
            })
            .unwrap_or_default();
        Ok(ReviewReply {
            uid,
            allowed,
            code,
            message,
            reason,
            patch,
            warnings,
            audit,
            raw,
        })
    }

    /// Patched, allowed, warned or denied.
    pub fn decision(&self) -> Decision {
        if !self.allowed {
            Decision::Denied
        } else if self.patch.as_ref().is_some_and(|p| !p.0.is_empty()) {
            Decision::Patched
        } else if !self.warnings.is_empty() {
            Decision::Warned
        } else {
            Decision::Allowed
        }
    }

    /// The denial message, or the warnings joined, or an empty string.
    pub fn explanation(&self) -> String {
        if let Some(m) = &self.message {
            return m.clone();
        }
        self.warnings.join("; ")
    }
}

/// Decode `response.patch`: base64 of the JSON array (documented), or an array of byte values (what
/// kube's own types send); kube-apiserver accepts both.
fn decode_patch(p: &Value) -> std::result::Result<json_patch::Patch, String> {
    let bytes = match p {
        Value::String(s) => BASE64_STANDARD
            .decode(s)
            .map_err(|e| format!("`patch` is not base64: {e}"))?,
        Value::Array(items) => items
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|n| u8::try_from(n).ok())
                    .ok_or_else(|| "`patch` array holds a non-byte value".to_string())
            })
            .collect::<std::result::Result<Vec<u8>, String>>()?,
        other => return Err(format!("`patch` is neither base64 nor bytes: {other}")),
    };
    serde_json::from_slice(&bytes)
        .map_err(|e| format!("`patch` is not an RFC 6902 JSON Patch: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn review() -> Value {
        json!({"request": {"uid": "u1"}})
    }

    /// The reply read from an HTTP 200 on `path` with `body`, to the review with UID `u1`.
    fn reply(path: &str, body: &Value) -> Result<ReviewReply> {
        ReviewReply::from_http(
            path,
            StatusCode::OK,
            &serde_json::to_vec(body).expect("json"),
            &review(),
        )
    }

    #[test]
    fn parses_patch_as_base64_and_as_bytes() {
        let patch = r#"[{"op":"add","path":"/metadata/labels","value":{}}]"#;
        for p in [
            json!(BASE64_STANDARD.encode(patch)),
            json!(patch.as_bytes().to_vec()),
        ] {
            let body = json!({"response": {"uid": "u1", "allowed": true, "patchType": "JSONPatch", "patch": p}});
            let r = reply("/mutate", &body).expect("reply");
            assert_eq!(r.decision(), Decision::Patched);
            assert_eq!(r.patch.expect("patch").0.len(), 1);
        }
    }

    #[test]
    fn rejects_mismatched_uid_and_half_patches() {
        for body in [
            json!({"response": {"uid": "other", "allowed": true}}),
            json!({"response": {"uid": "u1", "allowed": true, "patchType": "JSONPatch"}}),
            json!({"response": {"uid": "u1", "allowed": true, "patch": "W10="}}),
            json!({"response": {"uid": "u1"}}),
            json!({"apiVersion": "admission.k8s.io/v1"}),
        ] {
            let err = reply("/mutate", &body).expect_err("invalid reply");
            assert!(matches!(err, Error::BadReply { .. }), "{err}");
        }
        let err = ReviewReply::from_http("/validate", StatusCode::NOT_FOUND, b"{}", &review())
            .expect_err("404");
        assert!(err.to_string().contains("HTTP 404"), "{err}");
    }

    #[test]
    fn denial_and_warning_decisions() {
        let deny = json!({"response": {"uid": "u1", "allowed": false, "status": {"code": 403, "message": "no keys", "reason": "Forbidden"}}});
        let r = reply("/validate", &deny).expect("reply");
        assert_eq!(
            (r.decision(), r.code, r.explanation().as_str()),
            (Decision::Denied, Some(403), "no keys")
        );
        let warn = json!({"response": {"uid": "u1", "allowed": true, "warnings": ["stale"]}});
        let r = reply("/validate", &warn).expect("reply");
        assert_eq!(
            (r.decision(), r.explanation().as_str()),
            (Decision::Warned, "stale")
        );
    }
}
