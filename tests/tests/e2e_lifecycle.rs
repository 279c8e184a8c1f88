//! Lifecycle scenarios with the real binaries (issue #20): a rolling restart of two webhook replicas
//! under a steady stream of reviews, and an API server outage of a minute.
//!
//! Both run `teeguard-webhook` and `teeguard-agent` as processes against the fake API server served on
//! 127.0.0.1 and a simulated host (see `teeguard_tests::e2e`); the test plays kube-apiserver, KubeVirt,
//! the scheduler, the kubelet and, for the rollout, the webhook Service as kube-proxy routes it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, header};
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::{Value, json};
use teeguard_shared::TeeKind;
use teeguard_tests::e2e::{E2eEnv, NODE, WebhookProcess, World};
use teeguard_tests::fixtures::{self, AdmissionReviewBuilder, TDX_KEYS, Tee};
use teeguard_tests::host::{SimHost, TDX};
use teeguard_tests::prom::Scrape;
use teeguard_tests::standalone::client::client_config;
use teeguard_tests::standalone::cluster::{KATA_NODE_LABEL, http_get};
use teeguard_tests::standalone::{ApiServerDriver, Decision, ReviewReply, VmiSpec};
use tokio_util::sync::CancellationToken;

/// Every log line of a process that panicked contains this.
const PANIC: &str = "panicked at";

fn key(pod: &Pod) -> (String, String) {
    (
        pod.metadata.namespace.clone().expect("namespace"),
        pod.metadata.name.clone().expect("name"),
    )
}

/// SIGTERM, as the kubelet sends it to a terminating pod's container.
fn sigterm(w: &WebhookProcess) {
    assert!(w.proc.pid().is_some(), "the replica is running");
    w.proc.sigterm().expect("kill -TERM");
}

fn assert_no_panic(what: &str, log: &str) {
    assert!(!log.contains(PANIC), "{what} panicked; its log:\n{log}");
}

// ------------------------------------------------------------------------------------------------
// 1. Rolling restart of two replicas under a steady stream of reviews
// ------------------------------------------------------------------------------------------------

/// Fast agent; holds of pods deleted before the agent counted them end after 5 s.
const ROLLOUT_CONFIG: &str =
    "agent:\n  pollInterval: 100ms\n  heartbeatInterval: 1s\nadmission:\n  ledgerTtl: 5s\n";

/// The replicas' shutdown: serve 3 s after SIGTERM (while the endpoint removal propagates), then up
/// to 5 s of drain. The chart uses 10 s and 20 s; what matters is grace > propagation.
const REPLICA_FLAGS: &[&str] = &["--shutdown-grace", "3s", "--drain-timeout", "5s"];
const SHUTDOWN_GRACE: Duration = Duration::from_secs(3);
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// How long kube-proxy on the API server's node keeps routing new connections to an endpoint after the
/// endpoint controller removed it.
const PROPAGATION: Duration = Duration::from_millis(1500);

/// Concurrent request streams (the API server's concurrent admission calls).
const STREAMS: usize = 4;

/// Keys on the node: far more than the streams ever hold at once, so every review must be admitted.
const ROLLOUT_KEYS: u64 = 32;

/// The webhook Service as kube-proxy on the API server's node sees it: each new connection goes to one
/// of the endpoints (round robin); endpoint changes reach kube-proxy [`PROPAGATION`] late, so an
/// endpoint the endpoint controller removed keeps receiving new connections that long. Established
/// connections are never re-routed.
#[derive(Debug, Default)]
struct Service {
    /// (address, routed from, removed at)
    endpoints: Mutex<Vec<(SocketAddr, Instant, Option<Instant>)>>,
    next: AtomicUsize,
}

impl Service {
    /// A ready pod's endpoint: kube-proxy routes to it [`PROPAGATION`] later.
    fn add(&self, addr: SocketAddr) {
        self.endpoints
            .lock()
            .expect("lock")
            .push((addr, Instant::now() + PROPAGATION, None));
    }

    /// The endpoint controller removes a terminating pod's endpoint at once.
    fn remove(&self, addr: SocketAddr) {
        for (a, _, removed) in self.endpoints.lock().expect("lock").iter_mut() {
            if *a == addr && removed.is_none() {
                *removed = Some(Instant::now());
            }
        }
    }

    /// Where kube-proxy sends a new connection.
    fn pick(&self) -> SocketAddr {
        let routed: Vec<SocketAddr> = self
            .endpoints
            .lock()
            .expect("lock")
            .iter()
            .filter(|(_, from, removed)| {
                *from <= Instant::now() && removed.is_none_or(|t| t.elapsed() < PROPAGATION)
            })
            .map(|(a, _, _)| *a)
            .collect();
        assert!(!routed.is_empty(), "the Service has no endpoint");
        routed[self.next.fetch_add(1, Ordering::Relaxed) % routed.len()]
    }
}

/// One of kube-apiserver's connections to the webhook Service: HTTP/1.1 kept alive, opened through
/// [`Service::pick`] whenever the previous one was closed. A request that fails on a reused connection
/// before any answer (the server closed it as it was reused) is sent again on a new connection, as Go's
/// transport does; anything else is a failed admission.
struct ServiceConn {
    service: Arc<Service>,
    tls: tokio_rustls::TlsConnector,
    conn: Option<(SocketAddr, SendRequest<Full<Bytes>>)>,
}

impl ServiceConn {
    fn new(service: Arc<Service>, ca: CertificateDer<'static>) -> Self {
        ServiceConn {
            service,
            tls: tokio_rustls::TlsConnector::from(client_config(ca).expect("client TLS")),
            conn: None,
        }
    }

    async fn connect(&self, addr: SocketAddr) -> Result<SendRequest<Full<Bytes>>, String> {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect {addr}: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let name = ServerName::try_from("localhost").expect("server name");
        let tls = self
            .tls
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS with {addr}: {e}"))?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| format!("HTTP/1.1 handshake with {addr}: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(sender)
    }

    /// POST `review` to `path`; the replica that answered and its parsed, checked answer.
    async fn review(
        &mut self,
        path: &str,
        review: &Value,
    ) -> (SocketAddr, Result<ReviewReply, String>) {
        let body = Bytes::from(serde_json::to_vec(review).expect("json"));
        let mut retried = false;
        loop {
            let reused = match &self.conn {
                Some((_, s)) if !s.is_closed() => true,
                _ => {
                    let addr = self.service.pick();
                    match self.connect(addr).await {
                        Ok(s) => self.conn = Some((addr, s)),
                        Err(e) => return (addr, Err(e)),
                    }
                    false
                }
            };
            let Some((addr, sender)) = self.conn.as_mut() else {
                unreachable!("connected above");
            };
            let addr = *addr;
            let request = Request::post(path)
                .header(header::HOST, "localhost")
                .header(header::CONTENT_TYPE, "application/json")
                .body(Full::new(body.clone()))
                .expect("request");
            let sent = tokio::time::timeout(Duration::from_secs(10), async {
                sender.ready().await?;
                let resp = sender.send_request(request).await?;
                let status = resp.status();
                let bytes = resp.into_body().collect().await?.to_bytes();
                Ok::<_, hyper::Error>((status, bytes))
            })
            .await;
            match sent {
                Ok(Ok((status, bytes))) => {
                    return (
                        addr,
                        ReviewReply::from_http(path, status, &bytes, review)
                            .map_err(|e| e.to_string()),
                    );
                }
                Ok(Err(e)) if reused && !retried && (e.is_closed() || e.is_canceled()) => {
                    self.conn = None;
                    retried = true;
                }
                Ok(Err(e)) => {
                    self.conn = None;
                    return (addr, Err(format!("POST {path} to {addr}: {e}")));
                }
                Err(_) => {
                    self.conn = None;
                    return (
                        addr,
                        Err(format!("POST {path} to {addr}: no answer within 10 s")),
                    );
                }
            }
        }
    }
}

/// One answered (or failed) review of the stream.
#[derive(Debug)]
struct Answer {
    at: Instant,
    replica: SocketAddr,
    what: String,
    failure: Option<String>,
}

/// A replica of the rollout and when it was told to stop.
struct Replica {
    process: WebhookProcess,
    terminated_at: Option<Instant>,
}

/// The objects every world starts with: the `default` namespace and the TDX node.
fn seed(env: &E2eEnv, keys: u64) {
    env.api
        .create(&json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "default", "labels": {"kubernetes.io/metadata.name": "default"}}
        }))
        .expect("namespace");
    let mut node = fixtures::NodeBuilder::new(NODE)
        .tdx(keys)
        .label(KATA_NODE_LABEL, "true")
        .to_value();
    if let Some(m) = node.get_mut("metadata").and_then(Value::as_object_mut) {
        for k in ["uid", "resourceVersion", "creationTimestamp"] {
            m.remove(k);
        }
    }
    env.api.create(&node).expect("node");
}

/// One stream: VMI → pod CREATE through `/mutate` and `/validate` → the scheduler's binding through
/// `/validate` → bound; the pod and VMI are deleted half a second later (the VM never starts, so the
/// node's keys are only ever pending). Every review must be answered 200 with the right decision.
async fn stream(
    id: usize,
    driver: Arc<ApiServerDriver>,
    mut conn: ServiceConn,
    answers: Arc<Mutex<Vec<Answer>>>,
    stop: CancellationToken,
) {
    let mut n = 0;
    let record = |replica: SocketAddr, what: String, failure: Option<String>| {
        answers.lock().expect("lock").push(Answer {
            at: Instant::now(),
            replica,
            what,
            failure,
        });
    };
    while !stop.is_cancelled() {
        n += 1;
        let name = format!("roll-{id}-{n}");
        let vmi = driver
            .create_vmi(&VmiSpec::new(&name, Tee::Tdx))
            .expect("VMI stored");
        let pod = driver.launcher_pod(&vmi).expect("launcher pod");
        let mut value = fixtures::to_value(&pod);
        let review = AdmissionReviewBuilder::create(value.clone()).build();
        let (replica, got) = conn.review("/mutate", &review).await;
        let patch = match got {
            Ok(r) if r.decision() == Decision::Patched => r.patch,
            Ok(r) => {
                record(
                    replica,
                    format!("{name} mutate"),
                    Some(format!("not patched: {:?}", r.raw)),
                );
                None
            }
            Err(e) => {
                record(replica, format!("{name} mutate"), Some(e));
                None
            }
        };
        let created = match patch {
            Some(p) => {
                record(replica, format!("{name} mutate"), None);
                json_patch::patch(&mut value, &p).expect("patch applies");
                // As kube-apiserver: name and UID are set before the validating webhooks are
                // called, and the pod is stored only once they admitted it.
                value["metadata"]["name"] = json!(format!("virt-launcher-{name}"));
                value["metadata"]["uid"] = json!(format!("{id:08x}-0000-4000-8000-{n:012x}"));
                Some(value.clone())
            }
            None => None,
        };
        if let Some(created) = created {
            let pod: Pod = serde_json::from_value(created.clone()).expect("typed pod");
            let (ns, pod_name) = key(&pod);
            let review = AdmissionReviewBuilder::create(created.clone()).build();
            let (replica, got) = conn.review("/validate", &review).await;
            let admitted = match got {
                Ok(r) if r.decision() == Decision::Allowed => {
                    driver.api().create(&created).expect("pod stored");
                    true
                }
                Ok(r) => {
                    record(
                        replica,
                        format!("{name} validate"),
                        Some(format!("not admitted: {:?}", r.raw)),
                    );
                    false
                }
                Err(e) => {
                    record(replica, format!("{name} validate"), Some(e));
                    false
                }
            };
            if admitted {
                record(replica, format!("{name} validate"), None);
                let review = AdmissionReviewBuilder::binding(&pod, NODE).build();
                let (replica, got) = conn.review("/validate", &review).await;
                match got {
                    Ok(r) if r.decision() == Decision::Allowed => {
                        record(replica, format!("{name} binding"), None);
                        driver.api().bind_pod(&ns, &pod_name, NODE).expect("bound");
                    }
                    Ok(r) => record(
                        replica,
                        format!("{name} binding"),
                        Some(format!("not admitted: {:?}", r.raw)),
                    ),
                    Err(e) => record(replica, format!("{name} binding"), Some(e)),
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            let _ = driver.api().delete("pods", Some(&ns), &pod_name);
        }
        let _ = driver.delete_vmi(&vmi);
    }
}

/// Wait until the replica's `/readyz` stops answering 200 (SIGTERM turns it not ready at once).
async fn wait_not_ready(admin: SocketAddr) -> Duration {
    let started = Instant::now();
    loop {
        if !matches!(http_get(admin, "/readyz").await, Ok((200, _))) {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the replica still reports ready 2 s after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Two webhook replicas behind a Service, a steady stream of reviews from four concurrent API server
/// connections, and two complete rolling restarts (maxSurge 1, maxUnavailable 0: start a new replica,
/// wait until it is ready, then SIGTERM an old one, whose endpoint keeps receiving new connections for
/// 1.5 s). Every review is answered 200 with the right decision (keys are free throughout), every old
/// replica exits 0 after its grace and drain, and terminating replicas did answer reviews (the window
/// the grace exists for was exercised).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rolling_restarts_of_two_replicas_fail_no_review() {
    tokio::time::timeout(Duration::from_secs(120), async {
        let env = E2eEnv::new(ROLLOUT_CONFIG).await.expect("environment");
        seed(&env, ROLLOUT_KEYS);
        let host = SimHost::builder()
            .capacity(TDX, ROLLOUT_KEYS)
            .build()
            .expect("host");
        let agent = env.start_agent(NODE, &host).await.expect("agent");
        let service = Arc::new(Service::default());
        let mut replicas = Vec::new();
        for _ in 0..2 {
            let process = env.start_webhook(REPLICA_FLAGS).await.expect("replica starts");
            service.add(process.https);
            replicas.push(Replica {
                process,
                terminated_at: None,
            });
        }
        let driver = Arc::new(env.driver(&replicas[0].process).expect("driver"));
        tokio::time::sleep(PROPAGATION).await;

        let answers = Arc::new(Mutex::new(Vec::new()));
        let stop = CancellationToken::new();
        let streams: Vec<_> = (0..STREAMS)
            .map(|id| {
                tokio::spawn(stream(
                    id,
                    driver.clone(),
                    ServiceConn::new(service.clone(), env.ca.cert_der()),
                    answers.clone(),
                    stop.clone(),
                ))
            })
            .collect();
        tokio::time::sleep(Duration::from_secs(1)).await;

        // Two complete rollouts of a 2-replica Deployment.
        for round in 1..=2 {
            for _ in 0..2 {
                let process = env.start_webhook(REPLICA_FLAGS).await.expect("new replica ready");
                service.add(process.https);
                // The Deployment controller moves on as soon as the new pod is ready; give this
                // one a second, so that traffic reaches it before the old one goes.
                tokio::time::sleep(Duration::from_secs(1)).await;
                let old = replicas
                    .iter_mut()
                    .find(|r| r.terminated_at.is_none())
                    .expect("an old replica");
                service.remove(old.process.https);
                sigterm(&old.process);
                old.terminated_at = Some(Instant::now());
                let took = wait_not_ready(old.process.admin).await;
                eprintln!("round {round}: replaced {} (not ready after {took:?})", old.process.https);
                replicas.push(Replica {
                    process,
                    terminated_at: None,
                });
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
        // The last replica's grace ends under the stream too.
        tokio::time::sleep(SHUTDOWN_GRACE + Duration::from_secs(1)).await;
        stop.cancel();
        for s in streams {
            s.await.expect("stream task");
        }

        // Every terminated replica drained and exited 0, in time, without a panic.
        for r in replicas.iter_mut().filter(|r| r.terminated_at.is_some()) {
            let terminated = r.terminated_at.expect("terminated");
            let limit = SHUTDOWN_GRACE + DRAIN_TIMEOUT + Duration::from_secs(2);
            let status = loop {
                if let Some(s) = r.process.proc.exit_status() {
                    break s;
                }
                assert!(
                    terminated.elapsed() < limit,
                    "{} still running {limit:?} after SIGTERM",
                    r.process.https
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            };
            assert_eq!(status, "exit status: 0", "{}:\n{}", r.process.https, r.process.proc.log());
            assert_no_panic("a replica", &r.process.proc.log());
        }
        for r in replicas.iter_mut().filter(|r| r.terminated_at.is_none()) {
            assert_eq!(r.process.proc.exit_status(), None, "the new replicas run on");
            assert_no_panic("a replica", &r.process.proc.log());
        }

        let answers = std::mem::take(&mut *answers.lock().expect("lock"));
        let failures: Vec<String> = answers
            .iter()
            .filter_map(|a| {
                let f = a.failure.as_ref()?;
                Some(format!("{} sent to {}: {f}", a.what, a.replica))
            })
            .collect();
        assert!(
            failures.is_empty(),
            "{} of {} reviews failed during the rollouts, e.g.:\n{}",
            failures.len(),
            answers.len(),
            failures[..failures.len().min(10)].join("\n")
        );
        assert!(answers.len() >= 100, "a steady stream: only {} reviews", answers.len());
        // Reviews answered by replicas after their SIGTERM: kube-proxy still routed to them, or a
        // kept-alive connection carried on. Without the shutdown grace these are the failures.
        let after_sigterm = answers
            .iter()
            .filter(|a| {
                replicas.iter().any(|r| {
                    r.process.https == a.replica && r.terminated_at.is_some_and(|t| a.at > t)
                })
            })
            .count();
        let per_replica: Vec<(SocketAddr, usize)> = replicas
            .iter()
            .map(|r| {
                let n = answers.iter().filter(|a| a.replica == r.process.https).count();
                (r.process.https, n)
            })
            .collect();
        eprintln!(
            "{} reviews, {after_sigterm} answered by terminating replicas; per replica: {per_replica:?}",
            answers.len()
        );
        assert!(
            after_sigterm >= 4,
            "only {after_sigterm} reviews reached a terminating replica: the test did not exercise \
             the propagation window"
        );

        // The keys are all free again: nothing was lost or double-counted across the rollouts.
        let s = driver
            .wait_report_settled(NODE, TeeKind::Tdx, &host, Duration::from_secs(20))
            .await
            .expect("report settles");
        assert_eq!((s.kernel_used, s.pending, s.free), (0, 0, ROLLOUT_KEYS), "{s:?}");
        assert_no_panic("the agent", &agent.proc.log());
    })
    .await
    .expect("the scenario finished within 120 s");
}

// ------------------------------------------------------------------------------------------------
// 2. The API server unreachable for a minute
// ------------------------------------------------------------------------------------------------

/// Fast agent.
const OUTAGE_CONFIG: &str = "agent:\n  pollInterval: 100ms\n  heartbeatInterval: 1s\n";
const OUTAGE: Duration = Duration::from_secs(60);
/// The decider stops deciding this long after its last renewal (2/3 of the default 15 s Lease).
const RENEW_DEADLINE: Duration = Duration::from_secs(10);

/// A gauge or counter of a `/metrics` text, summed over the series with `labels`.
fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    Scrape::parse(text).get(name, labels)
}

/// The API server is unreachable for 60 s. Throughout, both processes keep running and the webhook
/// stays ready, answering from its caches: the decider admits launcher pod CREATEs and bindings while
/// its Lease holds (its renew deadline after its last renewal), holding their keys in memory; after
/// that nobody decides and reviews that take a key are refused (`no-decider`: KubeVirt and the
/// scheduler try again). The agent keeps scanning the host (its metrics follow a VM started during
/// the outage). Within a few seconds of the API server's return the report shows that VM, and the
/// report's figures and the Node's extended resources are right; the webhook then decides again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_outage_of_a_minute_decided_while_the_lease_holds_then_recovery() {
    tokio::time::timeout(Duration::from_secs(120), async {
        let mut w = World::start(4, OUTAGE_CONFIG).await.expect("world starts");
        // vm-1 runs; vm-2 and vm-3 are admitted, not bound; vm-4 exists as a VMI only (its pod is the
        // CREATE probe).
        let mut admitted = Vec::new();
        for name in ["vm-1", "vm-2", "vm-3"] {
            let (_, adm) = w
                .driver
                .create_vm(&VmiSpec::new(name, Tee::Tdx))
                .await
                .expect("VMI stored, its pod reviewed");
            let refusal = adm.refusal();
            admitted.push(
                adm.pod
                    .unwrap_or_else(|| panic!("{name} admitted: {refusal:?}")),
            );
        }
        let (ns1, name1) = key(&admitted[0]);
        assert!(w.driver.bind(&ns1, &name1, NODE).await.expect("bind").bound);
        w.start_tdx_vm(&admitted[0]).expect("vm-1 starts");
        let vmi4 = w
            .driver
            .create_vmi(&VmiSpec::new("vm-4", Tee::Tdx))
            .expect("VMI");
        w.settle_before_outage().await.expect("settled");

        let scans_before = metric(
            &w.agent.as_ref().expect("agent").metrics().await,
            "teeguard_agent_scan_duration_seconds_count",
            &[],
        )
        .expect("scan count");
        w.env.served.stop().await;
        let down = Instant::now();

        let launcher = w.driver.launcher_pod(&vmi4).expect("probe pod");
        let (mut decided, mut undecided, mut probes) = (0, 0, 0);
        let mut bound = false;
        while down.elapsed() < OUTAGE {
            probes += 1;
            let sent = down.elapsed();
            // The mutating webhook answers from the VMI cache (it must patch); the validating webhook
            // decides a pod CREATE from the cached report while it decides.
            let v = w
                .driver
                .review_create(
                    &launcher,
                    &format!("virt-launcher-vm-4-p{probes}"),
                    &format!("00000000-0000-4000-8000-{probes:012}"),
                )
                .await
                .expect("mutated and validated");
            let nobody = v
                .explanation()
                .contains("no teeguard replica decides right now");
            if nobody {
                undecided += 1;
            } else {
                // Decided (the first probe takes vm-4's key, the next find that pod holding it) only
                // while the decider's Lease holds: its renew deadline after its last renewal, which
                // came before the outage.
                assert!(
                    sent < RENEW_DEADLINE
                        && (v.allowed || v.explanation().contains("no node can host")),
                    "CREATE {sent:?} into the outage: {:?}",
                    v.raw
                );
                decided += 1;
            }
            let (ns2, name2) = key(&admitted[1]);
            let (ns3, name3) = key(&admitted[2]);
            if !bound {
                // The scheduler binds vm-2 and vm-3 (decided by the decider from its caches), and the
                // kubelet starts vm-2's VM while the API is down.
                for (ns, name) in [(&ns2, &name2), (&ns3, &name3)] {
                    let b = w
                        .driver
                        .bind(ns, name, NODE)
                        .await
                        .expect("binding answered");
                    assert!(b.bound && b.reply.allowed, "{:?}", b.reply.raw);
                }
                w.start_tdx_vm(&admitted[1])
                    .expect("vm-2 starts during the outage");
                bound = true;
            } else if sent > RENEW_DEADLINE {
                // Past its renew deadline nobody decides: a binding is refused too (the scheduler
                // tries it again later).
                let b = w
                    .driver
                    .review(
                        "/validate",
                        &AdmissionReviewBuilder::binding(&admitted[2], NODE).build(),
                    )
                    .await
                    .expect("binding answered");
                assert!(
                    !b.allowed
                        && b.explanation()
                            .contains("no teeguard replica decides right now"),
                    "binding {sent:?} into the outage: {:?}",
                    b.raw
                );
            }
            // Neither process exits or restarts, and the webhook stays in its Service (were every
            // replica to turn unready, every admission would fail).
            assert!(
                matches!(http_get(w.webhook.admin, "/readyz").await, Ok((200, _))),
                "the webhook stays ready during the outage"
            );
            assert_eq!(
                w.webhook.proc.exit_status(),
                None,
                "the webhook keeps running"
            );
            let agent = w.agent.as_mut().expect("agent");
            assert_eq!(agent.proc.exit_status(), None, "the agent keeps running");
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        assert!(decided >= 1, "CREATEs admitted by the decider: {decided}");
        assert!(
            undecided >= 5,
            "CREATEs refused with nobody deciding: {undecided}"
        );

        // The agent kept scanning the host: its metrics show vm-2's key although nothing was published.
        let agent = w.agent.as_ref().expect("agent");
        let text = agent.metrics().await;
        let scans =
            metric(&text, "teeguard_agent_scan_duration_seconds_count", &[]).expect("scans");
        assert!(
            scans >= scans_before + 100.0,
            "the agent scanned {} times in a minute",
            scans - scans_before
        );
        assert_eq!(
            metric(&text, "teeguard_agent_used_keys", &[("kind", "tdx")]),
            Some(2.0),
            "the kernel's usage as the agent last read it:\n{text}"
        );
        assert!(
            w.env
                .report(NODE)
                .is_some_and(|s| s.kind(TeeKind::Tdx).is_some_and(|k| k.kernel_used == 1)),
            "nothing was published during the outage"
        );

        w.env.served.restart().await.expect("API server back");
        let back = Instant::now();
        // vm-1 and vm-2 hold a key each, vm-3 is bound and waits for its key.
        let s = w
            .driver
            .wait_report_settled(NODE, TeeKind::Tdx, &w.host, Duration::from_secs(30))
            .await
            .expect("the agent publishes after the outage");
        let took = back.elapsed();
        eprintln!("the report showed the outage's changes {took:?} after the API server returned");
        assert_eq!(
            (
                s.capacity,
                s.kernel_used,
                s.pods_used,
                s.external,
                s.pending,
                s.free
            ),
            (4, 2, 2, 0, 1, 1),
            "{s:?}"
        );
        assert!(
            took <= Duration::from_secs(8),
            "the report followed the outage's changes only {took:?} after the API server returned"
        );
        let n = w.node();
        let four = Some("4".to_string());
        assert_eq!(fixtures::node_resource(&n, TDX_KEYS), (four.clone(), four));

        // The webhook decides from fresh reports again: a CREATE fits the last free key.
        w.webhook
            .wait_ready(Duration::from_secs(20))
            .await
            .expect("webhook ready");
        // The webhook's caches re-watch with a jittered backoff capped at 5 s, so fresh reports are
        // back within seconds of the API server's return (kube's default backoff took up to a minute).
        let deadline = back + Duration::from_secs(15);
        loop {
            let v = w
                .driver
                .review_create(
                    &launcher,
                    "virt-launcher-vm-4-after",
                    "00000000-0000-4000-8000-afterafter00",
                )
                .await
                .expect("mutated and validated");
            if v.allowed {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "still refused 15 s after the API server returned: {}",
                v.explanation()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        eprintln!(
            "the webhook admitted from fresh reports {:?} after the API server returned",
            back.elapsed()
        );

        for (what, log) in [
            ("the webhook", w.webhook.proc.log()),
            ("the agent", w.agent.as_ref().expect("agent").proc.log()),
        ] {
            assert_no_panic(what, &log);
        }
        assert_eq!(w.webhook.proc.exit_status(), None);
        assert_eq!(w.agent.as_mut().expect("agent").proc.exit_status(), None);
    })
    .await
    .expect("the scenario finished within its deadline");
}
