//! Scenario 4: faults on the real node while pods are created throughout. Whatever happens to the
//! agent, the runtime or the kubelet, no pod may fail or wait past the runtime's NRI request timeout
//! because of teeguard (the runtime gives up on a silent plugin at most once, and never on one that is
//! gone), and teeguard comes back by itself: it registers again, the Node keeps (or gets
//! back) its key resource, and a TEE container created meanwhile gets its limit (at creation, or
//! through `Synchronize` when the plugin registers again).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams, PostParams, WatchEvent, WatchParams};
use kube::{Api, Client};
use teeguard_tests::e2e::json_log_line;
use teeguard_tests::fixtures::{TDX_KEYS, Tee};
use teeguard_tests::node::{NRI_REQUEST_TIMEOUT, Runtime, pods};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{NodeWorld, Options, POLL, RUN_DEADLINE, prepare_node, running};

/// How often the stream creates a pod: slower than a loaded 2-core node starts them (each sandbox and
/// start 1-2 s of runc work, on two cores), so a pod's start time says what happened to it, not how
/// long the stream has run. At one every 400 ms the stream outran such a node: its queue grew for as
/// long as the stream ran, pods created 15 s after the stopped agent's one timeout waited longest
/// (9.4 s with two busy loops beside the test, 15 s in CI, against 3-5 s for the calm phase's
/// shorter stream), and the bound blamed teeguard for the queue.
const EVERY: Duration = Duration::from_millis(1000);
/// What a loaded 2-core machine may add to a pod's start on top of the baseline's slowest ([`calm`]),
/// besides one NRI request timeout. The timeout costs a little more than itself on containerd: its
/// NRI calls plugins one at a time, so while it waits for the stopped plugin every other pod's
/// `RunPodSandbox` waits too (all returned within 1 ms of the timeout), and the runtime then catches
/// up with the burst it releases (with two busy loops beside the test: the pods caught in the wait
/// 4-5 s against the calm phase's 2.9 s, those after it back to 2-3 s). The precise check is the
/// runtime's own: how often it gave up waiting for the plugin ([`timeouts`]).
const SLACK: Duration = Duration::from_secs(6);

/// A pod of the stream and how long it took from its CREATE to Running.
#[derive(Debug)]
pub struct Streamed {
    /// Its name.
    pub name: String,
    /// CREATE answered → first seen Running.
    pub took: Duration,
}

/// Plain pods created one every [`EVERY`] in the world's namespace, each watched until it runs.
pub struct PodStream {
    stop: CancellationToken,
    creator: JoinHandle<()>,
    tracker: JoinHandle<()>,
    created: Arc<Mutex<Vec<(String, Instant)>>>,
    ran: Arc<Mutex<HashMap<String, Instant>>>,
}

impl PodStream {
    /// Start creating pods named `<prefix>-<n>`.
    pub fn start(w: &NodeWorld, prefix: &str) -> PodStream {
        let stop = CancellationToken::new();
        let created = Arc::new(Mutex::new(Vec::new()));
        let ran = Arc::new(Mutex::new(HashMap::new()));
        let api: Api<Pod> = w.pods_in(&w.ns);
        let (ns, test, prefix) = (w.ns.clone(), w.test.clone(), prefix.to_string());
        let creator = tokio::spawn({
            let (stop, created, api) = (stop.clone(), created.clone(), api.clone());
            async move {
                for n in 0.. {
                    let name = format!("{prefix}-{n}");
                    let selector = [(teeguard_tests::realcluster::TEST_LABEL, test.as_str())];
                    let mut pod = pods::plain(&ns, &name, &[("main", &[])], &selector);
                    // A container whose start a runtime restart cut short is started again.
                    if let Some(spec) = pod.spec.as_mut() {
                        spec.restart_policy = Some("Always".into());
                    }
                    match api.create(&PostParams::default(), &pod).await {
                        Ok(_) => lock(&created).push((name, Instant::now())),
                        Err(e) => panic!("the API server refused pod {name}: {e}"),
                    }
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(EVERY) => {}
                    }
                }
            }
        });
        // Runs until `finish` has seen every pod run (and aborts it).
        let tracker = tokio::spawn({
            let ran = ran.clone();
            async move {
                loop {
                    if let Ok(list) = api.list(&ListParams::default()).await {
                        let now = Instant::now();
                        let mut ran = lock(&ran);
                        for p in list.items.iter().filter(|p| running(p)) {
                            let name = p.metadata.name.clone().unwrap_or_default();
                            ran.entry(name).or_insert(now);
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        });
        PodStream {
            stop,
            creator,
            tracker,
            created,
            ran,
        }
    }

    /// Stop creating; wait until every pod created runs (panics naming those that do not within
    /// [`RUN_DEADLINE`]); how long each took.
    pub async fn finish(self, w: &NodeWorld) -> Vec<Streamed> {
        self.stop.cancel();
        let _ = self.creator.await;
        let deadline = Instant::now() + RUN_DEADLINE;
        let out = loop {
            let created = lock(&self.created).clone();
            let ran = lock(&self.ran).clone();
            let waiting: Vec<&String> = created
                .iter()
                .filter(|(n, _)| !ran.contains_key(n))
                .map(|(n, _)| n)
                .collect();
            if waiting.is_empty() {
                break created
                    .iter()
                    .map(|(name, at)| Streamed {
                        name: name.clone(),
                        took: ran[name].saturating_duration_since(*at),
                    })
                    .collect();
            }
            if Instant::now() >= deadline {
                let mut events = Vec::new();
                for n in &waiting {
                    events.push((n.to_string(), w.events(&w.ns, n).await));
                }
                panic!(
                    "pods not Running within {RUN_DEADLINE:?}: {events:#?}\n{}",
                    w.diagnostics()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        self.tracker.abort();
        out
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The slowest pod of the fault phases' shape without the fault, for comparison: the stream with a
/// TDX VM started in it, the agent running. The VM's start is what slows the pods beside it: on a
/// loaded 2-core machine (with the stream at one pod every 400 ms), pods started beside a VM took
/// 4.3-8.2 s with the agent running throughout and 4.0-6.7 s with it stopped (calm pods without a VM:
/// 1.9-3.2 s), so a baseline without the VM blamed the agent for the VM's share (issue 43's
/// "10-33 s" under CI load).
async fn calm(w: &NodeWorld) -> Duration {
    let stream = PodStream::start(w, "calm");
    let vm = w.create_vm("calm-vm", Tee::Tdx).await.expect("admitted");
    w.wait_running(&vm).await;
    tokio::time::sleep(EVERY * 3).await;
    let calm = stream.finish(w).await;
    calm.iter().map(|s| s.took).max().unwrap_or_default()
}

/// The runtime's log so far, from byte `since` on.
fn runtime_log_since(w: &NodeWorld, since: usize) -> String {
    let log = w.turn.log(w.turn.runtime.name());
    log.get(since..).unwrap_or_default().to_string()
}

/// How often the runtime gave up waiting for the plugin (its request timeout) in `log`: containerd and
/// CRI-O both log `closing plugin 50-teeguard, failed to handle <Request>: context deadline exceeded`.
/// After giving up it closes the plugin, so each time is one container's single wait.
fn timeouts(log: &str) -> usize {
    log.lines()
        .filter(|l| l.contains("closing plugin") && l.contains("deadline exceeded"))
        .count()
}

/// Every pod ran, none later than the calm pods' slowest plus one NRI request timeout (and slack for
/// a loaded machine), and no Warning Event in the namespace names NRI or a plugin.
async fn assert_no_harm(w: &NodeWorld, fault: &str, calm: Duration, streamed: &[Streamed]) {
    let bound = calm + NRI_REQUEST_TIMEOUT + SLACK;
    let slowest = streamed.iter().map(|s| s.took).max().unwrap_or_default();
    eprintln!("{fault}: slowest pod {slowest:?}, baseline's slowest {calm:?}, bound {bound:?}");
    let late: Vec<&Streamed> = streamed.iter().filter(|s| s.took > bound).collect();
    assert!(
        late.is_empty(),
        "{fault}: pods waited longer than {bound:?} (calm pods' slowest {calm:?} + the {NRI_REQUEST_TIMEOUT:?} \
         NRI request timeout + {SLACK:?}): {late:?}\n{}",
        w.diagnostics()
    );
    let events: Api<k8s_openapi::api::core::v1::Event> =
        Api::namespaced(w.cluster.client.clone(), &w.ns);
    let warnings: Vec<String> = events
        .list(&ListParams::default())
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.type_.as_deref() == Some("Warning"))
        .map(|e| {
            format!(
                "{} {}: {}",
                e.involved_object.name.unwrap_or_default(),
                e.reason.unwrap_or_default(),
                e.message.unwrap_or_default()
            )
        })
        .filter(|m| {
            let m = m.to_lowercase();
            m.contains("nri") || m.contains("plugin")
        })
        .collect();
    assert!(
        warnings.is_empty(),
        "{fault}: Warning Events about NRI: {warnings:#?}"
    );
}

/// A TDX VM that ran before the plugin came back ends up with `tdx 1` on its running `compute`
/// container: in the OCI config at creation, or asked of runc through `Synchronize`.
/// After a `fault` the runtime must not have waited for the plugin in (it was gone, or the runtime
/// itself was): no pod harmed ([`assert_no_harm`] with `calm`), no plugin timeout in the runtime's log
/// since `since`, and the VM started before still limited to its key.
async fn assert_unharmed_without_a_wait(
    w: &NodeWorld,
    fault: &str,
    calm: Duration,
    streamed: &[Streamed],
    since: usize,
    vm: &Pod,
) {
    assert_no_harm(w, fault, calm, streamed).await;
    assert_eq!(
        timeouts(&runtime_log_since(w, since)),
        0,
        "{fault}: the runtime never waits for the plugin"
    );
    assert_vm_limited(w, fault, vm).await;
}

async fn assert_vm_limited(w: &NodeWorld, fault: &str, vm: &Pod) {
    let vm = w.wait_running(vm).await;
    let records = w.records(&vm).await;
    let running_id = vm
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.iter().find(|c| c.name == "compute"))
        .and_then(|c| c.container_id.as_deref())
        .and_then(|id| id.rsplit_once("://").map(|(_, id)| id.to_string()))
        .expect("compute's container ID");
    let compute = records
        .iter()
        .find(|r| r.id == running_id)
        .unwrap_or_else(|| panic!("{fault}: no config recorded for compute {running_id}"));
    if compute.misc_max() == Some("tdx 1") {
        return;
    }
    w.cluster
        .wait_for(
            &format!("{fault}: compute's limit through Synchronize"),
            || async {
                w.turn
                    .updates()
                    .into_iter()
                    .any(|u| u.container_id == running_id && u.misc_max() == Some("tdx 1"))
                    .then_some(())
            },
        )
        .await
        .unwrap_or_else(|e| {
            let agent: Vec<String> = w
                .agent
                .proc
                .log()
                .lines()
                .filter(|l| l.contains("NRI") || l.contains("misc.max"))
                .map(str::to_string)
                .collect();
            panic!(
                "{e}: compute {running_id} was created with {:?}; the agent said {agent:#?}\n{}",
                compute.unified,
                w.diagnostics()
            )
        });
}

/// The agent's registrations so far (its log lines).
fn registrations(w: &NodeWorld) -> usize {
    w.agent
        .proc
        .log()
        .lines()
        .filter(|l| json_log_line(l, "NRI plugin registered").is_some())
        .count()
}

fn signal(pid: u32, sig: &str) {
    let status = std::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {sig} {pid}: {status}");
}

async fn world(runtime: Runtime, test: &str) -> Option<NodeWorld> {
    let w = NodeWorld::start(runtime, test, Options::simulated()).await?;
    w.wait_allocatable(TDX_KEYS, "4", Duration::from_secs(20))
        .await;
    Some(w)
}

/// The agent stopped (SIGSTOP) while containers are created, then resumed: the runtime gives up on
/// it after its request timeout (once) and creates the containers without it; it registers again
/// when resumed, and gives the TDX VM that started meanwhile its limit through `Synchronize`.
pub async fn agent_stopped(runtime: Runtime) {
    let Some(w) = world(runtime, "agent-stopped").await else {
        return;
    };
    let calm = calm(&w).await;
    let before = registrations(&w);
    let since = w.turn.log(runtime.name()).len();
    let pid = w.agent.proc.pid().expect("agent runs");
    let stream = PodStream::start(&w, "stopped");
    signal(pid, "-STOP");
    let vm = w.create_vm("vm", Tee::Tdx).await.expect("admitted");
    let vm = w.wait_running(&vm).await;
    signal(pid, "-CONT");
    let resumed = Instant::now();
    w.cluster
        .wait_for("the agent to register again", || async {
            (registrations(&w) > before).then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", w.diagnostics()));
    eprintln!(
        "{}: agent resumed, registered again after {:?}",
        runtime.name(),
        resumed.elapsed()
    );
    tokio::time::sleep(EVERY * 3).await;
    let streamed = stream.finish(&w).await;
    assert_no_harm(&w, "agent stopped", calm, &streamed).await;
    let log = runtime_log_since(&w, since);
    assert_eq!(
        timeouts(&log),
        1,
        "the runtime waits for the stopped plugin once, then drops it: {:#?}",
        log.lines()
            .filter(|l| l.contains("plugin"))
            .collect::<Vec<_>>()
    );
    assert_vm_limited(&w, "agent stopped", &vm).await;
}

/// The agent killed and started again while containers are created; the TDX VM that started
/// meanwhile gets its limit through `Synchronize`.
pub async fn agent_killed(runtime: Runtime) {
    let Some(mut w) = world(runtime, "agent-killed").await else {
        return;
    };
    let calm = calm(&w).await;
    let since = w.turn.log(runtime.name()).len();
    let stream = PodStream::start(&w, "killed");
    tokio::time::sleep(EVERY * 2).await;
    w.agent.proc.kill();
    let vm = w.create_vm("vm", Tee::Tdx).await.expect("admitted");
    let vm = w.wait_running(&vm).await;
    w.restart_agent().await;
    tokio::time::sleep(EVERY * 3).await;
    let streamed = stream.finish(&w).await;
    assert_unharmed_without_a_wait(&w, "agent killed", calm, &streamed, since, &vm).await;
}

/// The runtime restarted while containers are created: the agent registers again within 2 s of the
/// NRI socket's return.
pub async fn runtime_restarted(runtime: Runtime) {
    let Some(w) = world(runtime, "runtime-restarted").await else {
        return;
    };
    let before = registrations(&w);
    let since = w.turn.log(runtime.name()).len();
    let stream = PodStream::start(&w, "restart");
    tokio::time::sleep(EVERY * 2).await;
    let back = w.turn.restart_runtime().await.expect("runtime restarts");
    let registered = loop {
        if registrations(&w) > before {
            break back.elapsed();
        }
        assert!(
            back.elapsed() < Duration::from_secs(10),
            "the agent did not register again\n{}",
            w.diagnostics()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    eprintln!(
        "{}: NRI socket back, the agent registered again {registered:?} later",
        runtime.name()
    );
    assert!(
        registered <= Duration::from_secs(2),
        "registered again {registered:?} after the NRI socket's return\n{}",
        w.diagnostics()
    );
    let vm = w.create_vm("vm", Tee::Tdx).await.expect("admitted");
    tokio::time::sleep(EVERY * 3).await;
    let streamed = stream.finish(&w).await;
    // Pods wait for the runtime while it is down (not teeguard's doing): only their running counts.
    assert_unharmed_without_a_wait(&w, "runtime restarted", RUN_DEADLINE, &streamed, since, &vm)
        .await;
}

/// The Node's allocatable `resource` in every version of the Node the API server stores from now
/// until stopped (a watch from the current version; the first entry is the current one).
async fn watch_allocatable(
    client: Client,
    node: String,
    resource: &'static str,
) -> (CancellationToken, JoinHandle<Vec<Option<String>>>) {
    let nodes: Api<Node> = Api::all(client);
    let value = |n: &Node| {
        n.status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get(resource).map(|q| q.0.clone()))
    };
    let current = nodes.get(&node).await.expect("the Node");
    let version = current
        .metadata
        .resource_version
        .clone()
        .unwrap_or_default();
    let params = WatchParams::default().fields(&format!("metadata.name={node}"));
    let mut events = nodes
        .watch(&params, &version)
        .await
        .expect("watch the Node")
        .boxed();
    let stop = CancellationToken::new();
    let task = tokio::spawn({
        let stop = stop.clone();
        async move {
            let mut seen = vec![value(&current)];
            loop {
                tokio::select! {
                    () = stop.cancelled() => return seen,
                    event = events.next() => match event {
                        Some(Ok(WatchEvent::Added(n) | WatchEvent::Modified(n))) => seen.push(value(&n)),
                        Some(Ok(WatchEvent::Deleted(_))) => seen.push(None),
                        Some(Ok(_)) => {}
                        Some(Err(e)) => panic!("watching the Node: {e}"),
                        None => return seen,
                    },
                }
            }
        }
    });
    (stop, task)
}

/// The kubelet restarted while containers are created: the Node keeps the key resource in every
/// version the API server stores meanwhile.
pub async fn kubelet_restarted(runtime: Runtime) {
    let Some(w) = world(runtime, "kubelet-restarted").await else {
        return;
    };
    let (stop, versions) =
        watch_allocatable(w.cluster.client.clone(), w.turn.name.clone(), TDX_KEYS).await;
    let since = w.turn.log(runtime.name()).len();
    let stream = PodStream::start(&w, "kubelet");
    tokio::time::sleep(EVERY * 2).await;
    w.turn.restart_kubelet().await.expect("kubelet restarts");
    let vm = w.create_vm("vm", Tee::Tdx).await.expect("admitted");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let streamed = stream.finish(&w).await;
    stop.cancel();
    let seen = versions.await.expect("watch");
    assert!(
        !seen.is_empty() && seen.iter().all(|v| v.as_deref() == Some("4")),
        "the Node's {TDX_KEYS} in each version stored across the kubelet's restart: {seen:?}"
    );
    // Pods wait for the kubelet while it is down (not teeguard's doing): only their running counts.
    assert_unharmed_without_a_wait(&w, "kubelet restarted", RUN_DEADLINE, &streamed, since, &vm)
        .await;
}

/// The Node deleted and registered again by the kubelet (restarted, as after a reboot): the agent
/// gives the new Node its key resource within one poll.
pub async fn node_deleted(runtime: Runtime) {
    let Some(w) = world(runtime, "node-deleted").await else {
        return;
    };
    let nodes: Api<Node> = Api::all(w.cluster.client.clone());
    let old_uid = nodes
        .get(&w.turn.name)
        .await
        .expect("Node")
        .metadata
        .uid
        .unwrap_or_default();
    nodes
        .delete(&w.turn.name, &DeleteParams::default())
        .await
        .expect("delete the Node");
    w.turn.restart_kubelet().await.expect("kubelet restarts");
    let registered = w
        .cluster
        .wait_for("the kubelet to register a new Node", || async {
            let n = nodes.get(&w.turn.name).await.ok()?;
            (n.metadata.uid.as_deref() != Some(old_uid.as_str())).then(Instant::now)
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", w.diagnostics()));
    w.wait_allocatable(TDX_KEYS, "4", Duration::from_secs(10))
        .await;
    let restored = registered.elapsed();
    eprintln!(
        "{}: new Node registered, the agent's {TDX_KEYS} on it {restored:?} later",
        runtime.name()
    );
    assert!(
        restored <= POLL + Duration::from_millis(500),
        "the agent restored its resource {restored:?} after the Node's return (poll {POLL:?})\n{}",
        w.diagnostics()
    );
    w.turn
        .wait_registered(&w.cluster.client)
        .await
        .expect("Node untainted");
    prepare_node(&w.cluster, &w.turn, &w.test).await;
    let vm = w.create_vm("vm", Tee::Tdx).await.expect("admitted");
    assert_vm_limited(&w, "node deleted", &vm).await;
}
