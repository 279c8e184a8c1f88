//! Graceful drain: after shutdown starts, new connections are refused and /readyz turns 503, while a
//! request already in flight completes; a request that never completes is cut at the drain timeout.

mod common;

use std::time::Duration;

use common::{Harness, bounded, client_config, tls_connect};
use http::StatusCode;
use teeguard_tests::fakeapi::FakeApiServer;
use teeguard_tests::fixtures::{self, AdmissionReviewBuilder};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn review_body() -> Vec<u8> {
    let pod = fixtures::kata_pod("kata", fixtures::KataTee::Tdx);
    serde_json::to_vec(&AdmissionReviewBuilder::create(fixtures::to_value(&pod)).build())
        .expect("json")
}

/// Start a raw HTTP/1.1 request over TLS: headers and the first half of the body.
async fn start_request(
    h: &Harness,
    body: &[u8],
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let mut tls = bounded(
        "connect",
        tls_connect(h.https, client_config(h.ca_der(), &[b"http/1.1"])),
    )
    .await
    .expect("handshake");
    let head = format!(
        "POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    tls.write_all(head.as_bytes()).await.expect("head");
    tls.write_all(&body[..body.len() / 2])
        .await
        .expect("half body");
    tls.flush().await.expect("flush");
    tls
}

async fn wait_refused(addr: std::net::SocketAddr) {
    let deadline = tokio::time::Instant::now() + common::WAIT;
    loop {
        match tokio::net::TcpStream::connect(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return,
            _ => {}
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "new connections are still accepted after shutdown"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_request_completes_new_connections_refused() {
    let mut h = Harness::start().await;
    let body = review_body();
    let mut tls = start_request(&h, &body).await;
    // Give the server time to read the head and start waiting for the body.
    tokio::time::sleep(Duration::from_millis(50)).await;

    h.token.cancel();
    wait_refused(h.https).await;
    let (code, text) = h.admin_get("/readyz").await;
    assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE, "{text}");
    assert!(text.contains("accepting"), "{text}");

    tls.write_all(&body[body.len() / 2..])
        .await
        .expect("rest of body");
    tls.flush().await.expect("flush");
    let mut response = Vec::new();
    bounded("response", tls.read_to_end(&mut response))
        .await
        .expect("read response");
    let text = String::from_utf8_lossy(&response);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("\"allowed\":true"), "{text}");

    let running = h.running.take().expect("running");
    bounded("webhook stops after the drain", running.wait())
        .await
        .expect("clean stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stuck_request_is_cut_at_the_drain_timeout() {
    let mut h =
        Harness::start_with(FakeApiServer::new(), None, &["--drain-timeout", "300ms"]).await;
    let mut tls = start_request(&h, &review_body()).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = tokio::time::Instant::now();
    h.token.cancel();
    let running = h.running.take().expect("running");
    bounded("webhook stops at the drain timeout", running.wait())
        .await
        .expect("clean stop");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(250),
        "stopped after {took:?}: did not wait for the drain"
    );
    // The stuck connection was closed: reading ends (EOF or reset) instead of hanging.
    let mut buf = Vec::new();
    let read = bounded("stuck connection closed", tls.read_to_end(&mut buf)).await;
    assert!(read.is_err() || !String::from_utf8_lossy(&buf).contains("200 OK"));
}
