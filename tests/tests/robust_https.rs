//! Bad input over real HTTPS against an in-process webhook (`app::start`, certificates from
//! teeguard-certs, caches from the fake API server), with short connection timeouts so slow clients
//! are cut off within seconds. Every test runs a well-behaved client ([`Prober`]) throughout and
//! asserts it got only correct answers: misbehaving clients get a clear 4xx (or a closed
//! connection) and never stall anyone else.

mod robust_support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use robust_support::{H1, Prober, Webhook, bounded, tdx_webhook, tls_connect};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Short timeouts: handshake 1 s, headers 1 s, whole request 2 s, drain 2 s.
const FLAGS: &[&str] = &[
    "--handshake-timeout",
    "1s",
    "--header-read-timeout",
    "1s",
    "--request-timeout",
    "2s",
    "--drain-timeout",
    "2s",
];

fn review_with(request: Value) -> Bytes {
    Bytes::from(
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": request
        }))
        .expect("json"),
    )
}

async fn assert_prober_clean(prober: Prober, min_ok: usize) {
    let report = prober.finish_after(min_ok).await;
    assert!(
        report.failures.is_empty(),
        "the well-behaved client saw failures: {:?}",
        report.failures
    );
    assert!(
        report.ok >= min_ok,
        "the well-behaved client got only {} answers",
        report.ok
    );
    assert!(
        report.max_latency < Duration::from_secs(1),
        "the well-behaved client waited {:?} for an answer",
        report.max_latency
    );
}

/// Read until EOF or error; returns what was read and how long it took (bounded).
async fn read_until_closed<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> (Vec<u8>, Duration) {
    let t = Instant::now();
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    bounded("the server to close the connection", async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => out.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    (out, t.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_reviews_get_clear_400s() {
    let (wh, review, body, expected) = tdx_webhook(FLAGS).await;
    let prober = Prober::start(wh.https, wh.client_config(), review.clone(), body, expected);
    let mut conn = wh.connect().await;
    let pod = review["request"]["object"].clone();
    let cases: Vec<(&str, Bytes, &str)> = vec![
        ("not JSON", Bytes::from_static(b"{not json"), "invalid JSON"),
        ("empty body", Bytes::new(), "invalid JSON"),
        ("binary", Bytes::from(vec![0xff; 2048]), "invalid JSON"),
        (
            "wrong apiVersion",
            Bytes::from(
                serde_json::to_vec(
                    &json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview",
                    "request": {"uid": "u", "operation": "CREATE"}}),
                )
                .expect("json"),
            ),
            "v1beta1",
        ),
        (
            "wrong kind",
            Bytes::from(
                serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1", "kind": "Pod"}))
                    .expect("json"),
            ),
            "kind",
        ),
        ("no request", review_with(Value::Null), "request is missing"),
        (
            "no uid",
            review_with(json!({"operation": "CREATE", "object": pod})),
            "uid",
        ),
        (
            "no operation",
            review_with(json!({"uid": "u", "object": pod})),
            "operation",
        ),
        (
            "pod CREATE without object",
            review_with(json!({"uid": "u", "operation": "CREATE",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"}})),
            "object",
        ),
        (
            "object of the wrong type",
            review_with(json!({"uid": "u", "operation": "CREATE",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "object": {"spec": {"containers": "compute"}}})),
            "not a valid Pod",
        ),
        (
            "uid of the wrong type",
            review_with(json!({"uid": 42, "operation": "CREATE"})),
            "invalid JSON",
        ),
    ];
    for (name, body, want) in cases {
        let (status, resp) = conn.post("/mutate", body).await.expect(name);
        assert_eq!(status, StatusCode::BAD_REQUEST, "{name}: {resp:?}");
        let text = String::from_utf8_lossy(&resp);
        let v: Value = serde_json::from_slice(&resp)
            .unwrap_or_else(|e| panic!("{name}: error body is not JSON ({e}): {text}"));
        assert!(
            v.to_string().contains(want),
            "{name}: {want:?} not in the error {text}"
        );
    }
    // The same keep-alive connection still serves a correct review after all that.
    let (status, _) = conn
        .post(
            "/mutate",
            Bytes::from(serde_json::to_vec(&review).expect("json")),
        )
        .await
        .expect("good review");
    assert_eq!(status, StatusCode::OK);
    // Unknown paths are a JSON 404.
    let (status, resp) = conn
        .post("/nope", Bytes::from_static(b"{}"))
        .await
        .expect("404");
    assert_eq!(status, StatusCode::NOT_FOUND, "{resp:?}");
    assert_prober_clean(prober, 3).await;
    wh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_10_mib_body_is_refused_with_413() {
    let (wh, review, body, expected) = tdx_webhook(FLAGS).await;
    let prober = Prober::start(wh.https, wh.client_config(), review, body, expected);
    // 10 MiB of a syntactically plausible review: more than the 7 MiB default limit.
    let mut big = br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{"uid":"big","operation":"CREATE","object":{"metadata":{"annotations":{"a":""#.to_vec();
    big.resize(10 * 1024 * 1024, b'x');
    big.extend_from_slice(br#""}}}}}"#);
    let mut conn = wh.connect().await;
    match conn.post("/mutate", Bytes::from(big)).await {
        Ok((status, resp)) => {
            assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{resp:?}");
            let v: Value = serde_json::from_slice(&resp).expect("JSON error body");
            assert!(
                v.to_string().contains("7340032") || v.to_string().to_lowercase().contains("large"),
                "{v}"
            );
        }
        // Closing the connection is also a clean refusal.
        Err(e) => assert!(
            e.contains("closed") || e.contains("reset") || e.contains("POST"),
            "{e}"
        ),
    }
    assert_prober_clean(prober, 10).await;
    wh.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_silent_clients_are_cut_off() {
    let (wh, review, body, expected) = tdx_webhook(FLAGS).await;
    let prober = Prober::start(wh.https, wh.client_config(), review, body.clone(), expected);
    let cfg = wh.client_config();
    let addr = wh.https;

    // Headers one byte per second: closed by the 1 s header-read timeout.
    let slow_headers = tokio::spawn({
        let cfg = cfg.clone();
        async move {
            let mut tls = tls_connect(addr, cfg).await.expect("TLS");
            let t = Instant::now();
            let head = b"POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n\r\n{}";
            for b in head {
                if tls.write_all(&[*b]).await.is_err() || tls.flush().await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                if t.elapsed() > Duration::from_secs(8) {
                    panic!("the server kept a one-byte-per-second client for 8 s");
                }
            }
            let (answer, _) = read_until_closed(&mut tls).await;
            // Either a 408 or a plain close: never a 200.
            let text = String::from_utf8_lossy(&answer);
            assert!(!text.contains(" 200 "), "{text}");
            t.elapsed()
        }
    });

    // Complete headers, body one byte per second: the 2 s request timeout answers 503.
    let slow_body = tokio::spawn({
        let cfg = cfg.clone();
        let body = body.clone();
        async move {
            let mut tls = tls_connect(addr, cfg).await.expect("TLS");
            let t = Instant::now();
            let head = format!(
                "POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            tls.write_all(head.as_bytes()).await.expect("head");
            let (mut rd, mut wr) = tokio::io::split(tls);
            let dribble = tokio::spawn(async move {
                for b in body.iter() {
                    if wr.write_all(&[*b]).await.is_err() || wr.flush().await.is_err() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            });
            let (answer, _) = read_until_closed(&mut rd).await;
            dribble.abort();
            let text = String::from_utf8_lossy(&answer).into_owned();
            (text, t.elapsed())
        }
    });

    // TCP connected, nothing sent: closed by the 1 s handshake timeout.
    let silent = tokio::spawn(async move {
        let mut tcp = tokio::net::TcpStream::connect(addr).await.expect("tcp");
        read_until_closed(&mut tcp).await.1
    });

    // Half a ClientHello, then silence.
    let half_hello = tokio::spawn(async move {
        let mut tcp = tokio::net::TcpStream::connect(addr).await.expect("tcp");
        tcp.write_all(&[
            0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03,
        ])
        .await
        .expect("partial hello");
        read_until_closed(&mut tcp).await.1
    });

    // Plain HTTP on the TLS port: the handshake fails at once.
    let plaintext = tokio::spawn(async move {
        let mut tcp = tokio::net::TcpStream::connect(addr).await.expect("tcp");
        tcp.write_all(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
            .await
            .expect("plaintext");
        read_until_closed(&mut tcp).await.1
    });

    // Fifty more half-open connections at once.
    let mut crowd = Vec::new();
    for _ in 0..50 {
        crowd.push(tokio::net::TcpStream::connect(addr).await.expect("tcp"));
    }

    let header_time = bounded("slow-headers client", slow_headers)
        .await
        .expect("task");
    assert!(
        header_time < Duration::from_secs(5),
        "slow headers held {header_time:?}"
    );
    let (text, body_time) = bounded("slow-body client", slow_body).await.expect("task");
    assert!(
        body_time < Duration::from_secs(5),
        "slow body held {body_time:?}"
    );
    assert!(
        text.is_empty() || text.starts_with("HTTP/1.1 503") || text.starts_with("HTTP/1.1 408"),
        "slow body answered: {text}"
    );
    for (what, t) in [
        ("silent TCP", bounded("silent", silent).await.expect("task")),
        (
            "half ClientHello",
            bounded("half hello", half_hello).await.expect("task"),
        ),
        (
            "plaintext",
            bounded("plaintext", plaintext).await.expect("task"),
        ),
    ] {
        assert!(t < Duration::from_secs(4), "{what} held for {t:?}");
    }
    for mut tcp in crowd {
        let (_, t) = read_until_closed(&mut tcp).await;
        assert!(
            t < Duration::from_secs(4),
            "a half-open connection held for {t:?}"
        );
    }
    assert_prober_clean(prober, 50).await;
    wh.stop().await;
}

/// A TLS connection whose socket has a 4 KiB receive buffer, so a client that stops reading makes the
/// server's writes block after a few answers (instead of megabytes of loopback buffering).
async fn small_buffer_tls(wh: &Webhook) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let tcp = socket.connect(wh.https).await.expect("connect");
    let connector = tokio_rustls::TlsConnector::from(wh.client_config());
    let name = rustls::pki_types::ServerName::try_from("localhost").expect("name");
    bounded("TLS handshake", connector.connect(name, tcp))
        .await
        .expect("TLS")
}

/// A request whose answer is large and cheap: a 404 naming an 8 KB path.
fn big_answer_request() -> Vec<u8> {
    format!(
        "POST /{} HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n",
        "a".repeat(8_000)
    )
    .into_bytes()
}

/// Send one review on a raw TLS connection and never read the answer.
async fn one_unread_request(wh: &Webhook, body: &Bytes) -> tokio::task::JoinHandle<()> {
    let mut tls = small_buffer_tls(wh).await;
    let mut req = format!(
        "POST /mutate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    tokio::spawn(async move {
        if tls.write_all(&req).await.is_ok() {
            std::future::pending::<()>().await;
        }
    })
}

/// Pipeline requests with large answers without reading, until the server stops reading because its
/// own writes are blocked (our write has made no progress for 300 ms); then keep the connection open
/// and idle. Returns once stalled.
async fn stalled_writer(
    mut tls: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
) -> tokio::task::JoinHandle<()> {
    let req = big_answer_request();
    let (stalled_tx, stalled_rx) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        loop {
            match tokio::time::timeout(Duration::from_millis(300), tls.write_all(&req)).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return,
                Err(_) => break,
            }
        }
        let _ = stalled_tx.send(());
        std::future::pending::<()>().await;
    });
    bounded(
        "the server to stop reading a client that never reads",
        stalled_rx,
    )
    .await
    .expect("stalled");
    task
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_never_read_do_not_block_others() {
    let (wh, review, body, expected) = tdx_webhook(FLAGS).await;
    let prober = Prober::start(
        wh.https,
        wh.client_config(),
        review.clone(),
        body.clone(),
        expected.clone(),
    );
    // Thirty connections that send one review and never read the answer, and three that pipeline
    // requests without reading until the server is blocked writing to them.
    let mut stalled = Vec::new();
    for _ in 0..30 {
        stalled.push(one_unread_request(&wh, &body).await);
    }
    for _ in 0..3 {
        stalled.push(stalled_writer(small_buffer_tls(&wh).await).await);
    }
    // One that reads its first answer, then stops reading mid-stream.
    let mut tls = small_buffer_tls(&wh).await;
    tls.write_all(&big_answer_request()).await.expect("request");
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = bounded("first answer", tls.read(&mut buf))
            .await
            .expect("read");
        assert!(n > 0, "closed before answering");
        got.extend_from_slice(&buf[..n]);
    }
    stalled.push(stalled_writer(tls).await);
    // Meanwhile fresh connections are served correctly and promptly.
    for i in 0..10 {
        let t = Instant::now();
        let mut c = wh.connect().await;
        let (status, resp) = c.post("/mutate", body.clone()).await.expect("fresh client");
        robust_support::check_mutate(&review, status, &resp, &expected)
            .unwrap_or_else(|e| panic!("fresh client {i}: {e}"));
        assert!(
            t.elapsed() < Duration::from_secs(1),
            "fresh client {i} took {:?}",
            t.elapsed()
        );
    }
    assert_prober_clean(prober, 20).await;
    for s in stalled {
        s.abort();
    }
    wh.stop().await;
}

/// A client that pipelines requests and never reads leaves the server blocked writing an answer: hyper
/// is not reading a new request head then, so the header-read timeout does not apply, and the request
/// timeout covers only the body read and the review. The write-stall timeout closes such a connection,
/// so with `--max-connections 1` a well-behaved client still gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_readers_cannot_exhaust_connection_slots() {
    let mut flags = FLAGS.to_vec();
    flags.extend(["--max-connections", "1", "--write-stall-timeout", "1s"]);
    let (wh, review, body, expected) = tdx_webhook(&flags).await;
    let stalled = stalled_writer(small_buffer_tls(&wh).await).await;
    // Longer than every configured timeout (handshake 1 s, headers 1 s, request 2 s).
    tokio::time::sleep(Duration::from_secs(3)).await;
    let answer = tokio::time::timeout(Duration::from_secs(5), async {
        let mut c = H1::try_connect(wh.https, wh.client_config()).await?;
        c.post("/mutate", body.clone()).await
    })
    .await;
    stalled.abort();
    match answer {
        Ok(Ok((status, resp))) => {
            robust_support::check_mutate(&review, status, &resp, &expected).expect("answer")
        }
        Ok(Err(e)) => panic!("a well-behaved client failed: {e}"),
        Err(_) => panic!(
            "a well-behaved client was locked out for 5 s by one client that never reads (max-connections 1)"
        ),
    }
    wh.stop().await;
}
