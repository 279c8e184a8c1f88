//! DRA mode's costs, each measured on its own (issue 38), on the real control plane (v1.36):
//!
//! 1. **The scheduler alone.** No kubelet: a Node created through the API (Ready, as a kubelet would
//!    report it) and teeguard's agent for it in simulated mode (a simulated cgroup tree with as many
//!    TDX keys as pods), which publishes the ResourceSlices (DRA mode) or the Node's
//!    `tdx.intel.com/keys` (extended-resource mode). N pods each requesting `tdx.intel.com/keys: 1`
//!    created at once, past the webhook; per pod, the time from its CREATE answered to its binding
//!    seen by a pod watch (p50 / p99), at the scheduler's client limits 50/100 (its defaults),
//!    500/1000 and 5000/5000 (`--kube-api-qps/--kube-api-burst`). With the scheduler's own metrics
//!    (`rest_client_requests_total` by verb, `rest_client_rate_limiter_duration_seconds`, the PreBind
//!    and Bind extension points, DynamicResources' PreBind) and the API server's
//!    (`apiserver_request_total` by resource and verb) saying how many writes a pod costs.
//! 2. **NodePrepareResources** at 10 and 100 concurrent calls: the agent's DRA socket called directly
//!    (one connection shared, one claim per call, as the kubelet calls per pod) for claims allocated
//!    the agent's devices; per-call latency p50 / p99, measured by the caller.
//! 3. **teeguard's share of a pod's start** (needs the real node, kubelet v1.36 on containerd): time
//!    from CREATE to Running per pod with the agent as the DRA driver, against the same pods with a
//!    stand-in driver that answers every prepare at once (`teeguard_tests::dra::StandInDriver`).
//!
//! `cargo bench -p teeguard-tests --bench dra_scheduling` (part 3 as root; 200 pods per run in part 1,
//! 100 in part 3; quick: 30 and 10).

#[path = "../tests/chart_support/mod.rs"]
mod chart_support;
#[path = "../tests/node_support/mod.rs"]
mod node_support;
mod support;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::runtime::watcher;
use node_support::{NodeWorld, Options, dra, unguarded_namespace};
use serde_json::json;
use support::{Stats, fmt_dur, section};
use teeguard_agent::kubelet::PluginPaths;
use teeguard_agent::kubelet::proto::{
    Claim, NodePrepareResourcesRequest, NodePrepareResourcesResponse,
    NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse,
};
use teeguard_tests::dra::{PREPARE, PluginClient, StandInDriver, UNPREPARE};
use teeguard_tests::e2e::{AgentProcess, ProcessEnv};
use teeguard_tests::fixtures::NodeBuilder;
use teeguard_tests::host::{SimHost, TDX};
use teeguard_tests::node::{Runtime, pods};
use teeguard_tests::patch::MergePatch;
use teeguard_tests::prom::{Scrape, delta_by, mean_delta};
use teeguard_tests::realcluster::{Cluster, advertise};

/// The scheduler's client limits measured: its defaults, then ten and a hundred times more.
const CLIENT_LIMITS: [(u32, u32); 3] = [(50, 100), (500, 1000), (5000, 5000)];
/// The label that pins the bench's pods to the bench's Node.
const PIN: &str = "bench.teeguard.dev/node";
/// Longest a run may take; only a broken cluster reaches it.
const RUN_DEADLINE: Duration = Duration::from_secs(300);

fn main() {
    let full = support::run_mode("dra_scheduling");
    let (pods, started) = if full { (200, 100) } else { (30, 10) };
    support::runtime(2).block_on(run(pods, started, full));
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    ExtendedResource,
    Dra,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::ExtendedResource => "extended resource",
            Mode::Dra => "DRA",
        }
    }
}

async fn run(pods: usize, started: usize, full: bool) {
    let Some(cluster) = Cluster::connect().await else {
        println!("dra_scheduling: no control plane on this machine (see the line above)");
        return;
    };
    dra::ensure_device_class(&cluster).await;

    section(&format!(
        "1. the scheduler alone: {pods} TEE pods at once on one Node without a kubelet"
    ));
    let mut rows = Vec::new();
    for (qps, burst) in CLIENT_LIMITS {
        cluster
            .cp
            .restart_scheduler(&[
                format!("--kube-api-qps={qps}"),
                format!("--kube-api-burst={burst}"),
            ])
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        for mode in [Mode::ExtendedResource, Mode::Dra] {
            let r = scheduler_alone(&cluster, mode, pods).await;
            println!(
                "client {qps}/{burst}, {:<17}: {pods} bound in {} ({:.1} pods/s); per pod p50 {}, p99 {}",
                mode.name(),
                fmt_dur(r.elapsed),
                pods as f64 / r.elapsed.as_secs_f64(),
                fmt_dur(r.per_pod.p50),
                fmt_dur(r.per_pod.p99),
            );
            r.print_costs(pods);
            rows.push((qps, burst, mode, r));
        }
    }
    println!("\nsummary (pods/s; DRA / extended resource):");
    for pair in rows.chunks(2) {
        let [(qps, burst, _, er), (_, _, _, dra_run)] = pair else {
            continue;
        };
        let rate = |r: &Alone| pods as f64 / r.elapsed.as_secs_f64();
        println!(
            "  client {qps:>4}/{burst:<4}: extended resource {:>6.1}, DRA {:>6.1}: {:.2}",
            rate(er),
            rate(dra_run),
            rate(dra_run) / rate(er)
        );
    }

    section("2. NodePrepareResources, the agent's DRA socket called directly (no kubelet)");
    let rounds: &[(usize, usize)] = if full {
        &[(10, 30), (100, 3)]
    } else {
        &[(10, 3), (100, 1)]
    };
    concurrent_prepares(&cluster, rounds).await;

    section(&format!(
        "3. teeguard's share of a pod's start: {started} pods to Running on the real node (kubelet v1.36 on containerd)"
    ));
    driver_share(started).await;
}

/// What one scheduler-alone run measured.
struct Alone {
    elapsed: Duration,
    per_pod: Stats,
    scheduler: (Scrape, Scrape),
    apiserver: (Scrape, Scrape),
}

impl Alone {
    /// The writes per pod, by the scheduler's own count and the API server's, and where time went.
    fn print_costs(&self, pods: usize) {
        let (sb, sa) = &self.scheduler;
        let by_verb = delta_by(sb, sa, "rest_client_requests_total", "method", &[]);
        let writes: f64 = by_verb
            .iter()
            .filter(|(m, _)| !matches!(m.as_str(), "GET" | "LIST" | "WATCH"))
            .map(|(_, n)| n)
            .sum();
        println!(
            "    scheduler requests by verb {}: {:.2} writes per pod",
            fmt_counts(&by_verb),
            writes / pods as f64
        );
        let waited = delta_by(
            sb,
            sa,
            "rest_client_rate_limiter_duration_seconds_sum",
            "verb",
            &[],
        );
        let waits = delta_by(
            sb,
            sa,
            "rest_client_rate_limiter_duration_seconds_count",
            "verb",
            &[],
        );
        let total_wait: f64 = waited.values().sum();
        println!(
            "    scheduler client rate limiter: {total_wait:.2} s waited over {} requests ({})",
            waits.values().sum::<f64>(),
            waited
                .iter()
                .map(|(v, s)| format!("{v} {s:.2} s"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        for point in ["PreBind", "Bind"] {
            let filter = [("extension_point", point), ("status", "Success")];
            let name = "scheduler_framework_extension_point_duration_seconds";
            if let Some((mean, n)) = mean_delta(sb, sa, name, &filter) {
                println!(
                    "    extension point {point}: mean {} over {n} pods",
                    fmt_dur(mean)
                );
            }
        }
        let filter = [
            ("extension_point", "PreBind"),
            ("plugin", "DynamicResources"),
        ];
        let name = "scheduler_plugin_execution_duration_seconds";
        if let Some((mean, n)) = mean_delta(sb, sa, name, &filter) {
            println!(
                "    DynamicResources PreBind: mean {} ({n} sampled calls)",
                fmt_dur(mean)
            );
        }
        let (ab, aa) = &self.apiserver;
        for resource in ["resourceclaims", "pods", "events"] {
            let by = delta_by_two(ab, aa, resource);
            if !by.is_empty() {
                println!(
                    "    API server {resource} requests (all clients) {}",
                    fmt_counts(&by)
                );
            }
        }
    }
}

/// `apiserver_request_total` for `resource` by `verb` and subresource (`POST binding`).
fn delta_by_two(before: &Scrape, after: &Scrape, resource: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for sub in ["", "binding", "status"] {
        let filter = [("resource", resource), ("subresource", sub)];
        for (verb, n) in delta_by(before, after, "apiserver_request_total", "verb", &filter) {
            if verb == "WATCH" || verb == "LIST" {
                continue;
            }
            let key = if sub.is_empty() {
                verb
            } else {
                format!("{verb} {sub}")
            };
            out.insert(key, n);
        }
    }
    out
}

fn fmt_counts(m: &BTreeMap<String, f64>) -> String {
    let inner: Vec<String> = m.iter().map(|(k, v)| format!("{k} {v}")).collect();
    format!("{{{}}}", inner.join(", "))
}

/// A Node without a kubelet and teeguard's agent for it (simulated host, `keys` TDX keys).
struct BenchNode {
    name: String,
    agent: AgentProcess,
    kubelet_dir: PathBuf,
    _env: ProcessEnv,
    _host: SimHost,
    _dir: tempfile::TempDir,
}

impl BenchNode {
    async fn start(cluster: &Cluster, mode: Mode, keys: usize) -> BenchNode {
        let name = teeguard_tests::controlplane::unique_name("bench-dra");
        cluster
            .node(&NodeBuilder::new(&name).label(PIN, &name))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        // Room for every pod (a kubelet's default is 110).
        advertise(&cluster.client, &name, &[("pods", json!("1000"))])
            .await
            .expect("the Node's pod capacity");
        let host = SimHost::builder()
            .capacity(TDX, keys as u64)
            .build()
            .expect("simulated host");
        let accounting = match mode {
            Mode::Dra => "dra",
            Mode::ExtendedResource => "extendedResource",
        };
        let env = cluster
            .process_env(&format!(
                "agent:\n  pollInterval: 250ms\n  heartbeatInterval: 5s\n  accounting: {accounting}\nenforcement:\n  mode: off\n"
            ))
            .expect("process env");
        let dir = tempfile::tempdir().expect("kubelet dir");
        let agent = env
            .start_agent_with(
                &name,
                host.root(),
                &["--kubelet-dir".into(), dir.path().display().to_string()],
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let what = format!("{name} offering {keys} TDX keys ({})", mode.name());
        let nodes: Api<Node> = Api::all(cluster.client.clone());
        cluster
            .wait_for_within(&what, Duration::from_secs(60), || async {
                let offered = match mode {
                    Mode::Dra => dra::published_on(cluster, &name).await.len(),
                    Mode::ExtendedResource => nodes
                        .get(&name)
                        .await
                        .ok()
                        .and_then(|n| n.status?.allocatable?.get(dra::TDX_KEYS).cloned())
                        .and_then(|q| q.0.parse().ok())
                        .unwrap_or(0),
                };
                (offered == keys).then_some(())
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        BenchNode {
            kubelet_dir: dir.path().to_path_buf(),
            name,
            agent,
            _env: env,
            _host: host,
            _dir: dir,
        }
    }

    fn pod(&self, ns: &str, name: &str) -> Pod {
        pods::plain(
            ns,
            name,
            &[("compute", &[(dra::TDX_KEYS, "1")])],
            &[(PIN, &self.name)],
        )
    }

    /// Force-delete the pods (no kubelet confirms a graceful deletion), stop the agent, delete the
    /// Node.
    async fn end(mut self, cluster: &Cluster, ns: &str) {
        let api: Api<Pod> = Api::namespaced(cluster.client.clone(), ns);
        let _ = api
            .delete_collection(
                &DeleteParams::default().grace_period(0),
                &ListParams::default(),
            )
            .await;
        self.agent.proc.kill();
        let _ = Api::<Node>::all(cluster.client.clone())
            .delete(&self.name, &DeleteParams::default())
            .await;
    }
}

/// Create `pods` at once in `ns`; per pod, the time from its CREATE answered until the watch sees
/// `done` (bound, running); and from the first CREATE sent until the last.
async fn create_and_time(
    api: &Api<Pod>,
    pods: Vec<Pod>,
    done: fn(&Pod) -> bool,
    what: &str,
) -> (Duration, Stats) {
    let n = pods.len();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(String, Instant)>();
    let (synced_tx, synced) = tokio::sync::oneshot::channel::<()>();
    let watch = tokio::spawn({
        let api = api.clone();
        async move {
            let mut synced_tx = Some(synced_tx);
            let stream = watcher(api, watcher::Config::default());
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                match event {
                    Ok(watcher::Event::InitDone) => {
                        if let Some(s) = synced_tx.take() {
                            let _ = s.send(());
                        }
                    }
                    Ok(watcher::Event::Apply(p)) if done(&p) => {
                        let _ =
                            tx.send((p.metadata.name.clone().unwrap_or_default(), Instant::now()));
                    }
                    _ => {}
                }
            }
        }
    });
    // The watch's own signal that it listed and watches: no event is missed after it.
    synced.await.expect("the pod watch starts");
    let started = Instant::now();
    let creates = pods.into_iter().map(|pod| {
        let api = api.clone();
        async move {
            let name = pod.metadata.name.clone().unwrap_or_default();
            api.create(&PostParams::default(), &pod)
                .await
                .unwrap_or_else(|e| panic!("create pod {name}: {e}"));
            (name, Instant::now())
        }
    });
    let created: HashMap<String, Instant> = futures::future::join_all(creates)
        .await
        .into_iter()
        .collect();
    let mut seen: HashMap<String, Instant> = HashMap::new();
    let deadline = started + RUN_DEADLINE;
    while seen.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, rx.recv()).await {
            Ok(Some((pod, at))) => {
                seen.entry(pod).or_insert(at);
            }
            _ => panic!("{what}: {} of {n} pods within {RUN_DEADLINE:?}", seen.len()),
        }
    }
    watch.abort();
    let last = seen.values().max().copied().expect("pods");
    // A pod can be seen done before its CREATE's answer is read back here: that counts as zero.
    let mut per_pod: Vec<Duration> = seen
        .iter()
        .map(|(pod, at)| at.saturating_duration_since(created[pod]))
        .collect();
    (last - started, Stats::from_samples(&mut per_pod))
}

fn bound(p: &Pod) -> bool {
    p.spec.as_ref().is_some_and(|s| s.node_name.is_some())
}

async fn apiserver_metrics(cluster: &Cluster) -> Scrape {
    let req = http::Request::get("/metrics")
        .body(Vec::new())
        .expect("request");
    Scrape::parse(
        &cluster
            .client
            .request_text(req)
            .await
            .expect("the API server's /metrics"),
    )
}

async fn scheduler_metrics(cluster: &Cluster) -> Scrape {
    Scrape::parse(
        &cluster
            .cp
            .scheduler_metrics()
            .await
            .unwrap_or_else(|e| panic!("{e}")),
    )
}

/// Part 1, one mode at the scheduler's current client limits.
async fn scheduler_alone(cluster: &Cluster, mode: Mode, n: usize) -> Alone {
    let node = BenchNode::start(cluster, mode, n).await;
    let ns = unguarded_namespace(cluster, "bench-dra").await;
    let api: Api<Pod> = Api::namespaced(cluster.client.clone(), &ns);
    let pods: Vec<Pod> = (0..n).map(|i| node.pod(&ns, &format!("p{i:03}"))).collect();
    let (sb, ab) = (
        scheduler_metrics(cluster).await,
        apiserver_metrics(cluster).await,
    );
    let (elapsed, per_pod) = create_and_time(&api, pods, bound, mode.name()).await;
    // The watch can see a binding before the scheduler counted it: wait for its own count.
    let scheduled = |s: &Scrape| {
        s.sum(
            "scheduler_schedule_attempts_total",
            &[("result", "scheduled")],
        )
    };
    let counted = cluster
        .wait_for_within(
            "the scheduler counting every pod scheduled",
            Duration::from_secs(30),
            || async {
                let now = scheduler_metrics(cluster).await;
                (scheduled(&now) - scheduled(&sb) >= n as f64).then_some(now)
            },
        )
        .await;
    let sa = counted.unwrap_or_else(|e| panic!("{e}"));
    let aa = apiserver_metrics(cluster).await;
    node.end(cluster, &ns).await;
    Alone {
        elapsed,
        per_pod,
        scheduler: (sb, sa),
        apiserver: (ab, aa),
    }
}

/// Part 2: for each `(concurrency, rounds)`, `rounds` times: `concurrency` claims allocated one key
/// each, prepared by as many concurrent calls, then unprepared and deleted.
async fn concurrent_prepares(cluster: &Cluster, rounds: &[(usize, usize)]) {
    let most = rounds.iter().map(|(c, _)| *c).max().unwrap_or(1);
    let node = BenchNode::start(cluster, Mode::Dra, most).await;
    let ns = unguarded_namespace(cluster, "bench-prepare").await;
    let claims: Api<ResourceClaim> = Api::namespaced(cluster.client.clone(), &ns);
    let socket = PluginPaths::under(&node.kubelet_dir).dra;
    let client = PluginClient::connect(&socket)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    for &(concurrency, times) in rounds {
        let mut samples = Vec::with_capacity(concurrency * times);
        for round in 0..times {
            let mut batch = Vec::with_capacity(concurrency);
            for i in 0..concurrency {
                let name = format!("c{concurrency}-r{round}-{i}");
                batch.push(allocated_claim(&claims, &name, &node.name, i).await);
            }
            let calls = batch.iter().map(|c| {
                let client = client.clone();
                let claim = c.clone();
                async move {
                    let t = Instant::now();
                    let r: NodePrepareResourcesResponse = client
                        .call(
                            PREPARE,
                            NodePrepareResourcesRequest {
                                claims: vec![claim.clone()],
                            },
                        )
                        .await
                        .unwrap_or_else(|e| panic!("{e}"));
                    let took = t.elapsed();
                    let error = r.claims.get(&claim.uid).map(|c| c.error.clone());
                    assert_eq!(
                        error.as_deref(),
                        Some(""),
                        "prepare {}: {error:?}",
                        claim.name
                    );
                    took
                }
            });
            samples.extend(futures::future::join_all(calls).await);
            let undo: NodeUnprepareResourcesResponse = client
                .call(
                    UNPREPARE,
                    NodeUnprepareResourcesRequest {
                        claims: batch.clone(),
                    },
                )
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(
                undo.claims.values().all(|c| c.error.is_empty()),
                "unprepare: {undo:?}"
            );
            let _ = claims
                .delete_collection(&DeleteParams::default(), &ListParams::default())
                .await;
        }
        let s = Stats::from_samples(&mut samples);
        println!(
            "{concurrency:>3} concurrent prepares ({} calls in {times} rounds): p50 {}, p99 {}, max {}",
            s.count,
            fmt_dur(s.p50),
            fmt_dur(s.p99),
            fmt_dur(s.max)
        );
    }
    let metrics = node.agent.metrics().await;
    let scrape = Scrape::parse(&metrics);
    println!(
        "the agent's own count of prepares by result: {}",
        fmt_counts(&scrape.by("teeguard_agent_dra_prepare_total", "result", &[]))
    );
    node.end(cluster, &ns).await;
}

/// A claim asking for one TDX key, allocated device `tdx-<index>` of `node`'s pool (as the scheduler
/// would write it); returned as the kubelet names it to the driver.
async fn allocated_claim(api: &Api<ResourceClaim>, name: &str, node: &str, index: usize) -> Claim {
    let claim: ResourceClaim = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {"requests": [
            {"name": "key", "exactly": {"deviceClassName": dra::TDX_CLASS}}
        ]}}
    }))
    .expect("claim");
    let created = api
        .create(&PostParams::default(), &claim)
        .await
        .unwrap_or_else(|e| panic!("create claim {name}: {e}"));
    let status = json!({"status": {"allocation": {"devices": {"results": [
        {"request": "key", "driver": "tee.teeguard.dev", "pool": node, "device": format!("tdx-{index}")}
    ]}}}});
    api.merge_patch_status(name, status)
        .await
        .unwrap_or_else(|e| panic!("allocate claim {name}: {e}"));
    Claim {
        namespace: created.metadata.namespace.unwrap_or_default(),
        uid: created.metadata.uid.unwrap_or_default(),
        name: name.to_string(),
    }
}

/// Part 3: the same pods to Running with the agent as the driver, then with the stand-in.
async fn driver_share(n: usize) {
    let mut results = Vec::new();
    for stand_in in [false, true] {
        let name = if stand_in {
            "bench-dra-stand-in"
        } else {
            "bench-dra-agent"
        };
        let Some(mut w) = NodeWorld::start(Runtime::Containerd, name, Options::dra(n as u64)).await
        else {
            println!("no real node on this machine (see the line above); part 3 not measured");
            return;
        };
        dra::ensure_device_class(&w.cluster).await;
        dra::wait_published(&w, n, Duration::from_secs(30)).await;
        dra::wait_driver_ready(&w).await;
        let driver = if stand_in {
            // The agent stops (its slices stay); the stand-in takes its sockets and the kubelet
            // registers it again.
            w.agent.proc.kill();
            let mut s =
                StandInDriver::start(&w.turn.kubelet_root()).unwrap_or_else(|e| panic!("{e}"));
            s.wait_registered(Duration::from_secs(60))
                .await
                .unwrap_or_else(|e| panic!("{e}"));
            dra::wait_published(&w, n, Duration::from_secs(30)).await;
            Some(s)
        } else {
            None
        };
        let ns = unguarded_namespace(&w.cluster, name).await;
        let api = w.pods_in(&ns);
        let pods: Vec<Pod> = (0..n)
            .map(|i| dra::key_pod(&w, &ns, &format!("p{i:03}"), "1"))
            .collect();
        let (elapsed, per_pod) = create_and_time(&api, pods, pods::running, name).await;
        let who = if let Some(s) = &driver {
            format!(
                "stand-in driver (answered {} prepares at once)",
                s.prepared()
            )
        } else {
            "teeguard's agent".to_string()
        };
        println!(
            "{who}: {n} Running in {}; per pod p50 {}, p99 {}",
            fmt_dur(elapsed),
            fmt_dur(per_pod.p50),
            fmt_dur(per_pod.p99)
        );
        results.push(per_pod);
        dra::end(&w).await;
        if let Some(s) = driver {
            drop(s);
            w.restart_agent().await;
        }
    }
    if let [agent, stand_in] = results.as_slice() {
        let share = |a: Duration, b: Duration| (a.as_secs_f64() / b.as_secs_f64() - 1.0) * 100.0;
        println!(
            "teeguard's share of the time to Running: p50 {:+.0} %, p99 {:+.0} %",
            share(agent.p50, stand_in.p50),
            share(agent.p99, stand_in.p99)
        );
    }
}
