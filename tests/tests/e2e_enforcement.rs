//! Kernel enforcement end to end: the real `teeguard-agent` (and webhook) processes, the fake API
//! server, a simulated host whose `misc.max` files behave like the kernel's, and a fake container
//! runtime speaking NRI's real wire protocol (multiplexed ttrpc over a Unix socket).

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use teeguard_tests::e2e::{AgentProcess, E2eEnv, NODE, World, json_log_line};
use teeguard_tests::fakeapi::Verb;
use teeguard_tests::fixtures::{self, SNP_ESIDS, TDX_KEYS, Tee, VirtLauncherPod};
use teeguard_tests::host::{MiscDelegation, QosClass, SEV, SEV_ES, SimHost, TDX};
use teeguard_tests::nri::{NriRuntime, Registration, misc_max};
use teeguard_tests::standalone::VmiSpec;
use teeguard_tests::wait::eventually;

const TEST_DEADLINE: Duration = Duration::from_secs(120);
const ANNOTATION: &str = "misc-max.teeguard.dev/compute";
const ESIDS: &str = "sev-snp.amd.com/esids";

async fn bounded<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_DEADLINE, f)
        .await
        .expect("the scenario finished within its deadline");
}

fn enforcing(env: &E2eEnv, node: &str) -> Option<(String, String, String)> {
    let status = env.report(node)?;
    let c = status.conditions.iter().find(|c| c.type_ == "Enforcing")?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// Store a Node (no kubelet) so the agent can publish.
fn seed_node(env: &E2eEnv, node: &str) {
    env.api
        .create(&json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "default", "labels": {"kubernetes.io/metadata.name": "default"}}
        }))
        .expect("namespace");
    let mut n = fixtures::NodeBuilder::new(node).to_value();
    teeguard_tests::standalone::driver::strip_server_fields(&mut n);
    env.api.create(&n).expect("node");
}

/// Store a pod bound to `node` and return it as stored (with its UID).
fn store_pod(env: &E2eEnv, pod: &k8s_openapi::api::core::v1::Pod) -> Value {
    let mut v = serde_json::to_value(pod).expect("pod json");
    teeguard_tests::standalone::driver::strip_server_fields(&mut v);
    env.api.create(&v).expect("pod stored")
}

fn uid(v: &Value) -> String {
    v.pointer("/metadata/uid")
        .and_then(Value::as_str)
        .expect("uid")
        .to_string()
}

/// The `PodSandbox` and `Container` the runtime sends at `CreateContainer`.
fn nri_request(pod: &Value, container: &str) -> (Value, Value) {
    let meta = &pod["metadata"];
    let sandbox = json!({
        "id": format!("sandbox-{}", uid(pod)),
        "name": meta["name"],
        "uid": meta["uid"],
        "namespace": meta["namespace"],
        "labels": meta.get("labels").cloned().unwrap_or(json!({})),
        "annotations": meta.get("annotations").cloned().unwrap_or(json!({})),
        "runtime_handler": "",
        "linux": {"cgroup_parent": format!("kubepods-burstable-pod{}.slice", uid(pod).replace('-', "_"))}
    });
    let ctr = json!({
        "id": format!("{container}-{}", uid(pod)),
        "pod_sandbox_id": sandbox["id"],
        "name": container,
        "state": 1,
        "args": ["/usr/bin/virt-launcher"]
    });
    (sandbox, ctr)
}

/// NRI mode on `socket`, with `enforcement` lines after the mode's (e.g. `  strict: true\n`).
fn nri_config(socket: &std::path::Path, enforcement: &str) -> String {
    format!(
        "agent:\n  pollInterval: 100ms\n  heartbeatInterval: 1s\nenforcement:\n  mode: nri\n  nriSocket: {}\n{enforcement}",
        socket.display()
    )
}

fn launcher(tee: Tee, resource: &str, annotation: &str) -> k8s_openapi::api::core::v1::Pod {
    VirtLauncherPod::for_tee(&format!("{}-vm", tee.slug()), tee)
        .request(resource, "1")
        .annotation(ANNOTATION, annotation)
        .running_on(NODE)
        .build()
}

/// The agent process in NRI mode against a fake runtime listening on a socket of its own, on `host`,
/// registered. Fields drop in order: the agent first, the socket's directory last.
struct NriWorld {
    agent: AgentProcess,
    runtime: NriRuntime,
    env: E2eEnv,
    _host: SimHost,
    _sock_dir: tempfile::TempDir,
}

async fn nri_world(host: SimHost) -> (NriWorld, Registration) {
    nri_world_with(host, "", |_| (Vec::new(), Vec::new())).await
}

/// [`nri_world`] where the runtime already has the pods and containers `existing` makes (once the API
/// server is up) when the agent registers: Synchronize lists them; `enforcement` as in [`nri_config`].
async fn nri_world_with(
    host: SimHost,
    enforcement: &str,
    existing: impl FnOnce(&E2eEnv) -> (Vec<Value>, Vec<Value>),
) -> (NriWorld, Registration) {
    let sock_dir = tempfile::tempdir().expect("socket dir");
    let socket = sock_dir.path().join("nri.sock");
    let runtime = NriRuntime::start(&socket).await.expect("runtime listens");
    let env = E2eEnv::new(&nri_config(&socket, enforcement))
        .await
        .expect("env");
    seed_node(&env, NODE);
    let (pods, containers) = existing(&env);
    runtime.set_existing(pods, containers);
    let agent = env.start_agent(NODE, &host).await.expect("agent starts");
    let reg = runtime
        .wait_registered(Duration::from_secs(10))
        .await
        .expect("the agent registers with the runtime");
    let w = NriWorld {
        agent,
        runtime,
        env,
        _host: host,
        _sock_dir: sock_dir,
    };
    (w, reg)
}

/// Namespace `late` with `labels`.
fn late_namespace(labels: Value) -> Value {
    json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "late", "labels": labels}})
}

/// Create `container` until the plugin answers strict mode's `tdx 0` (once the agent has the pod
/// and has listed the exempt namespaces).
async fn zeroed_eventually(runtime: &NriRuntime, sandbox: &Value, container: &Value) {
    eventually("tdx 0 for a keyless container", async || {
        let resp = runtime
            .create_container(sandbox.clone(), container.clone())
            .await
            .ok()?;
        (misc_max(&resp) == Some("tdx 0")).then_some(())
    })
    .await;
}

/// Label namespace `late` exempt: the plugin's first `UpdateContainers` lifts the zero of `container`
/// (`tdx max`), the only zeroed container of that namespace.
async fn lifted_when_exempt(w: &NriWorld, container: &Value) {
    w.env
        .api
        .insert(&late_namespace(
            json!({teeguard_shared::names::EXEMPT_LABEL: "true"}),
        ))
        .expect("namespace labelled exempt");
    let updates = w
        .runtime
        .wait_updates(1, Duration::from_secs(10))
        .await
        .expect("an UpdateContainers call once the namespace is exempt");
    let update = &updates[0]["update"][0];
    assert_eq!(update["container_id"], container["id"], "{updates:?}");
    assert_eq!(
        update.pointer("/linux/resources/unified/misc.max"),
        Some(&json!("tdx max")),
        "{updates:?}"
    );
}

// Fast layer of the real-node launchers test (node_containerd, node_crio; docs/records/real-node.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nri_plugin_registers_and_sets_misc_max_for_tee_compute_containers_only() {
    bounded(async {
        let host = SimHost::builder().capacity(TDX, 8).build().expect("host");
        let (NriWorld { agent, runtime, env, _host, _sock_dir }, reg) = nri_world(host).await;
        assert_eq!((reg.plugin_name.as_str(), reg.plugin_idx.as_str()), ("teeguard", "50"));
        assert_eq!(reg.nri_version, "v0.12.2", "the NRI release of the api.proto the plugin follows");
        assert!(reg.subscribes(4), "subscribed to CREATE_CONTAINER: events {:#b}", reg.events);
        assert!(!reg.subscribes(1), "not to RUN_POD_SANDBOX: events {:#b}", reg.events);

        // A TDX VM's compute container: tdx 1.
        let vm = store_pod(&env, &launcher(Tee::Tdx, TDX_KEYS, "tdx 1"));
        let (sandbox, compute) = nri_request(&vm, "compute");
        let resp = runtime.create_container(sandbox.clone(), compute).await.expect("answered");
        assert_eq!(misc_max(&resp), Some("tdx 1"), "{resp}");
        // Another container of the same pod: no adjustment.
        let (_, other) = nri_request(&vm, "guest-console-log");
        let resp = runtime.create_container(sandbox, other).await.expect("answered");
        assert_eq!(misc_max(&resp), None, "{resp}");
        // An unrelated pod the agent knows nothing about: no adjustment, answered at once.
        let stranger = json!({"metadata": {"name": "web-1", "namespace": "default", "uid": "5b7e3f1a-1c2d-4e5f-8a9b-0c1d2e3f4a5b"}});
        let (sandbox, ctr) = nri_request(&stranger, "nginx");
        let started = Instant::now();
        let resp = runtime.create_container(sandbox, ctr).await.expect("answered");
        assert_eq!(misc_max(&resp), None, "{resp}");
        assert!(started.elapsed() < Duration::from_millis(200), "{:?}", started.elapsed());

        // The condition says NRI, and the counter moved.
        let (status, reason, message) = eventually("Enforcing=True", async || {
            enforcing(&env, NODE).filter(|c| c.0 == "True")
        })
        .await;
        assert_eq!((status.as_str(), reason.as_str()), ("True", "NriPlugin"), "{message}");
        assert!(message.contains("mechanism nri"), "{message}");
        let metrics = agent.metrics().await;
        assert!(
            metrics.contains("teeguard_agent_limits_applied_total{mechanism=\"nri\",kind=\"tdx\"} 1"),
            "{metrics}"
        );
        assert!(metrics.contains("teeguard_agent_nri_connected 1"), "{metrics}");
        drop(agent);
    })
    .await;
}

// Fast layer of the real-node launchers test (node_containerd, node_crio; docs/records/real-node.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nri_plugin_gives_snp_sev_es_and_applies_the_requests_when_the_annotation_disagrees() {
    bounded(async {
        let host = SimHost::builder()
            .capacity(SEV, 16)
            .capacity(SEV_ES, 8)
            .build()
            .expect("host");
        let (
            NriWorld {
                agent,
                runtime,
                env,
                _host,
                _sock_dir,
            },
            _,
        ) = nri_world(host).await;

        let snp = store_pod(&env, &launcher(Tee::Snp, ESIDS, "sev_es 1"));
        let (sandbox, compute) = nri_request(&snp, "compute");
        let resp = runtime
            .create_container(sandbox, compute)
            .await
            .expect("answered");
        assert_eq!(misc_max(&resp), Some("sev_es 1"), "{resp}");

        // The annotation claims 3 keys; the pod requests 1: the request wins, and it is counted.
        let mut forged = launcher(Tee::SevEs, ESIDS, "sev_es 3");
        forged.metadata.name = Some("virt-launcher-forged-abcde".into());
        let forged = store_pod(&env, &forged);
        let (sandbox, compute) = nri_request(&forged, "compute");
        let resp = runtime
            .create_container(sandbox, compute)
            .await
            .expect("answered");
        assert_eq!(misc_max(&resp), Some("sev_es 1"), "{resp}");
        let metrics = agent.metrics().await;
        assert!(
            metrics.contains("teeguard_agent_limit_mismatches_total{mechanism=\"nri\"} 1"),
            "{metrics}"
        );
        drop(agent);
    })
    .await;
}

// Fast layer of the real-node runtime-restart test (node_containerd, node_crio; docs/records/real-node.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nri_plugin_registers_again_within_two_seconds_of_a_runtime_restart() {
    bounded(async {
        let host = SimHost::builder().capacity(TDX, 8).build().expect("host");
        let (
            NriWorld {
                agent: _agent,
                runtime,
                env,
                _host,
                _sock_dir,
            },
            first,
        ) = nri_world(host).await;
        for round in 2..=3 {
            let restarted = Instant::now();
            runtime.restart().await.expect("runtime restarts");
            let again = runtime
                .wait_registered_count(first.count + round - 1, Duration::from_secs(2))
                .await
                .expect("the agent registers again within 2 s");
            assert!(
                restarted.elapsed() < Duration::from_secs(2),
                "round {round}: {:?}",
                restarted.elapsed()
            );
            assert_eq!(again.plugin_name, "teeguard");
        }
        // And still answers.
        let vm = store_pod(&env, &launcher(Tee::Tdx, TDX_KEYS, "tdx 1"));
        let (sandbox, compute) = nri_request(&vm, "compute");
        let resp = runtime
            .create_container(sandbox, compute)
            .await
            .expect("answered");
        assert_eq!(misc_max(&resp), Some("tdx 1"), "{resp}");
    })
    .await;
}

// What the 30-minute chaos bench met on the real node (docs/records/performance.md): containerd
// answered a restarted agent's RegisterPlugin at once but synchronized it 30 s later, after a sandbox
// teardown that held NRI's lock; the agent, giving up after its own 5 s, met the late Synchronize with a
// closed connection and queued a new one behind the same lock. The agent keeps the connection whose
// registration the runtime answered, however late the runtime synchronizes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nri_plugin_keeps_a_registered_connection_that_the_runtime_synchronizes_late() {
    bounded(async {
        let host = SimHost::builder().capacity(TDX, 8).build().expect("host");
        let sock_dir = tempfile::tempdir().expect("socket dir");
        let runtime = NriRuntime::start(sock_dir.path().join("nri.sock"))
            .await
            .expect("runtime listens");
        let env = E2eEnv::new(&nri_config(runtime.socket(), "")).await.expect("env");
        seed_node(&env, NODE);
        let held = runtime.hold_sync_lock().await;
        let agent = env.start_agent(NODE, &host).await.expect("agent starts");
        // The agent's own registration timeout (5 s) passes while the lock is held: its log says so,
        // on the connection it opened first (a second connection is the agent giving up).
        let noted = "the runtime accepted the NRI registration but has not synchronized the plugin yet; waiting on this connection (a runtime synchronizes a new plugin once none of its container operations holds NRI's lock)";
        let connections = eventually("the note that synchronization is slow, or a reconnection", async || {
            let log = agent.proc.log();
            let noted = log.lines().any(|l| json_log_line(l, noted).is_some());
            (noted || runtime.connections() > 1).then(|| runtime.connections())
        })
        .await;
        assert_eq!(connections, 1, "the agent gave up on its registered connection");
        assert!(runtime.registration().is_none(), "not synchronized while the lock is held");
        drop(held);
        let reg = runtime
            .wait_registered(Duration::from_secs(10))
            .await
            .expect("the agent is synchronized once the lock frees");
        assert_eq!(
            (runtime.connections(), reg.count),
            (1, 1),
            "one connection, kept through the wait (the agent did not give up and reconnect)"
        );
        let vm = store_pod(&env, &launcher(Tee::Tdx, TDX_KEYS, "tdx 1"));
        let (sandbox, compute) = nri_request(&vm, "compute");
        let resp = runtime.create_container(sandbox, compute).await.expect("answered");
        assert_eq!(misc_max(&resp), Some("tdx 1"), "{resp}");
        drop(agent);
    })
    .await;
}

// The fast layer of the real-node scenario 5 (`node_*`: ..._gets_its_limit_through_synchronize, which
// also shows what containerd and CRI-O do with the update): containers that run when the plugin
// registers are listed in Synchronize, and the agent answers with an update for the TEE compute
// container only, marked ignore_failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nri_plugin_gives_running_tee_containers_their_limit_at_synchronize() {
    bounded(async {
        let host = SimHost::builder().capacity(TDX, 8).build().expect("host");
        let mut compute = Value::Null;
        let (_w, reg) = nri_world_with(host, "", |env| {
            let vm = store_pod(env, &launcher(Tee::Tdx, TDX_KEYS, "tdx 1"));
            let (sandbox, c) = nri_request(&vm, "compute");
            let (_, console) = nri_request(&vm, "guest-console-log");
            let (_, mut init) = nri_request(&vm, "container-disk-binary");
            init["state"] = json!(4); // CONTAINER_STOPPED
            let running = |mut c: Value| {
                c["state"] = json!(3); // CONTAINER_RUNNING
                c
            };
            compute = c.clone();
            (vec![sandbox], vec![running(c), running(console), init])
        })
        .await;
        let updates = reg.synchronize["update"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert_eq!(updates.len(), 1, "{}", reg.synchronize);
        assert_eq!(
            updates[0]["container_id"], compute["id"],
            "{}",
            reg.synchronize
        );
        assert_eq!(
            updates[0].pointer("/linux/resources/unified/misc.max"),
            Some(&json!("tdx 1")),
            "{}",
            reg.synchronize
        );
        assert_eq!(
            updates[0]["ignore_failure"],
            json!(true),
            "{}",
            reg.synchronize
        );
    })
    .await;
}

// The fast layer of the real-node test ..._created_while_the_agent_was_away_gets_its_limit_when_it_starts
// (which shows why: containerd keeps a Synchronize update of a container it created but did not start
// in the stored spec, unused when the start is under way): the agent answers Synchronize with the
// created TEE container's update and, when the runtime says it started, asks for it again through
// UpdateContainers; a container that ran at Synchronize gets no second update when it is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nri_plugin_updates_a_tee_container_created_before_it_registered_once_it_starts() {
    bounded(async {
        let host = SimHost::builder().capacity(TDX, 8).build().expect("host");
        let in_state = |mut c: Value, state: i64| {
            c["state"] = json!(state);
            c
        };
        let (mut sandbox, mut compute, mut console) = (Value::Null, Value::Null, Value::Null);
        let (w, reg) = nri_world_with(host, "", |env| {
            let vm = store_pod(env, &launcher(Tee::Tdx, TDX_KEYS, "tdx 1"));
            (sandbox, compute) = nri_request(&vm, "compute");
            console = nri_request(&vm, "guest-console-log").1;
            // CONTAINER_CREATED = 1, CONTAINER_RUNNING = 3.
            (
                vec![sandbox.clone()],
                vec![in_state(compute.clone(), 1), in_state(console.clone(), 3)],
            )
        })
        .await;
        let runtime = &w.runtime;
        let at_sync = reg.synchronize["update"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        assert_eq!(at_sync.len(), 1, "{}", reg.synchronize);
        assert_eq!(
            at_sync[0]["container_id"], compute["id"],
            "{}",
            reg.synchronize
        );

        let subscribed = runtime
            .start_container(sandbox.clone(), in_state(console, 3))
            .await
            .expect("the post-start event is answered");
        assert!(subscribed, "the agent subscribes to POST_START_CONTAINER");
        runtime
            .start_container(sandbox, in_state(compute.clone(), 3))
            .await
            .expect("the post-start event is answered");
        let updates = runtime
            .wait_updates(1, Duration::from_secs(10))
            .await
            .expect("an UpdateContainers call after the TEE container started");
        assert_eq!(updates.len(), 1, "{updates:?}");
        let update = &updates[0]["update"][0];
        assert_eq!(update["container_id"], compute["id"], "{updates:?}");
        assert_eq!(
            update.pointer("/linux/resources/unified/misc.max"),
            Some(&json!("tdx 1")),
            "{updates:?}"
        );
        assert_eq!(update["ignore_failure"], json!(true), "{updates:?}");
    })
    .await;
}

// Strict mode through NRI follows a namespace's exempt label as the cgroup writer does: a container
// given `tdx 0` before its namespace was labelled exempt gets the zero lifted (`tdx max`,
// UpdateContainers) once the agent sees the label; the label removed, it and a container created
// while the namespace was exempt get `tdx 0`; a container of a namespace never exempt, and one the
// runtime removed, are left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nri_strict_mode_lifts_a_zero_when_the_namespace_is_labelled_exempt_and_gives_it_again_when_the_label_goes()
 {
    bounded(async {
        let (w, reg) = strict_nri_world().await;
        assert!(
            reg.subscribes(11),
            "strict mode follows REMOVE_CONTAINER: events {:#b}",
            reg.events
        );
        w.env
            .api
            .create(&late_namespace(json!({})))
            .expect("namespace");
        // A pod whose container is created while the namespace is exempt (below), stored first: the
        // agent has it once it has the pods stored after it (its watch delivers in order).
        let pod = VirtLauncherPod::for_tee("born-exempt", Tee::None)
            .namespace("late")
            .running_on(NODE)
            .build();
        let (born_sandbox, born) = nri_request(&store_pod(&w.env, &pod), "compute");
        let mut containers = Vec::new();
        for (name, ns) in [
            ("in-late", "late"),
            ("removed", "late"),
            ("in-default", "default"),
        ] {
            let pod = VirtLauncherPod::for_tee(name, Tee::None)
                .namespace(ns)
                .running_on(NODE)
                .build();
            let (sandbox, compute) = nri_request(&store_pod(&w.env, &pod), "compute");
            // Zeroed once the agent has the pod and has listed the exempt namespaces.
            zeroed_eventually(&w.runtime, &sandbox, &compute).await;
            containers.push((sandbox, compute));
        }
        let (sandbox, removed) = &containers[1];
        w.runtime
            .call(
                "RemoveContainer",
                "RemoveContainerRequest",
                "RemoveContainerResponse",
                json!({"pod": sandbox, "container": removed}),
            )
            .await
            .expect("RemoveContainer answered");
        assert!(w.runtime.container_updates().is_empty());
        lifted_when_exempt(&w, &containers[0].1).await;
        // A container created while the namespace is exempt gets no limit.
        let resp = w
            .runtime
            .create_container(born_sandbox, born.clone())
            .await
            .expect("CreateContainer answered");
        assert_eq!(misc_max(&resp), None, "{resp:?}");
        // The label removed: both get the zero (again).
        w.env
            .api
            .insert(&late_namespace(json!({})))
            .expect("namespace label removed");
        let updates = w
            .runtime
            .wait_updates(3, Duration::from_secs(10))
            .await
            .expect("UpdateContainers calls once the namespace is exempt no more");
        let mut zeroed: Vec<(Value, Value)> = updates[1..]
            .iter()
            .map(|u| {
                let u = &u["update"][0];
                let value = u.pointer("/linux/resources/unified/misc.max").cloned();
                (u["container_id"].clone(), value.unwrap_or_default())
            })
            .collect();
        zeroed.sort_by_key(|(id, _)| id.to_string());
        let mut want = vec![
            (containers[0].1["id"].clone(), json!("tdx 0")),
            (born["id"].clone(), json!("tdx 0")),
        ];
        want.sort_by_key(|(id, _)| id.to_string());
        assert_eq!(zeroed, want, "{updates:?}");
        // Nothing else: the removed container and the one in `default` keep theirs. The updates of one
        // change of the namespaces go out together, back to back; 500 ms is a loaded machine's slack.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            w.runtime.container_updates().len(),
            3,
            "{:?}",
            w.runtime.container_updates()
        );
    })
    .await;
}

// Strict mode through NRI across a reconnect: containers zeroed before the agent registered (their
// resources in Synchronize show `tdx 0`) get `tdx max` in the Synchronize answer when their namespace
// was labelled exempt meanwhile, and `tdx 0` again when it was not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nri_strict_mode_lifts_at_synchronize_a_zero_given_before_its_namespace_was_labelled_exempt()
 {
    bounded(async {
        let host = SimHost::builder().capacity(TDX, 8).build().expect("host");
        let zeroed = |mut c: Value| {
            c["state"] = json!(3);
            c["linux"] = json!({"resources": {"unified": {"misc.max": "tdx 0"}}});
            c
        };
        let (mut late, mut default) = (Value::Null, Value::Null);
        let (_w, reg) = nri_world_with(host, "  strict: true\n", |env| {
            env.api
                .create(
                    &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "late",
                    "labels": {teeguard_shared::names::EXEMPT_LABEL: "true"}}}),
                )
                .expect("namespace");
            let mut sandboxes = Vec::new();
            for (name, ns, slot) in [
                ("in-late", "late", &mut late),
                ("in-default", "default", &mut default),
            ] {
                let pod = VirtLauncherPod::for_tee(name, Tee::None)
                    .namespace(ns)
                    .running_on(NODE)
                    .build();
                let (sandbox, compute) = nri_request(&store_pod(env, &pod), "compute");
                sandboxes.push(sandbox);
                *slot = compute;
            }
            (
                sandboxes,
                vec![zeroed(late.clone()), zeroed(default.clone())],
            )
        })
        .await;
        let updates = reg.synchronize["update"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let asked = |c: &Value| {
            updates
                .iter()
                .find(|u| u["container_id"] == c["id"])
                .and_then(|u| u.pointer("/linux/resources/unified/misc.max"))
                .cloned()
        };
        assert_eq!(asked(&late), Some(json!("tdx max")), "{}", reg.synchronize);
        assert_eq!(asked(&default), Some(json!("tdx 0")), "{}", reg.synchronize);
    })
    .await;
}

// A container whose pod the agent's watch has not delivered yet: strict mode looks the pod up before
// it answers instead of letting the container start without its zero, and follows that zero as it
// follows the cached pods'. Here the pod is bound to no node, so the agent's watch never delivers it
// and only the lookup can find it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nri_strict_mode_zeroes_a_keyless_container_whose_pod_the_agent_has_not_cached_yet() {
    bounded(async {
        let (w, _reg) = strict_nri_world().await;
        w.env
            .api
            .create(&late_namespace(json!({})))
            .expect("namespace");
        // A cached pod zeroed first: the agent has listed the namespaces.
        let cached = VirtLauncherPod::for_tee("cached", Tee::None)
            .running_on(NODE)
            .build();
        let (sandbox, compute) = nri_request(&store_pod(&w.env, &cached), "compute");
        zeroed_eventually(&w.runtime, &sandbox, &compute).await;

        let uncached = VirtLauncherPod::for_tee("uncached", Tee::None)
            .namespace("late")
            .build();
        let (sandbox, compute) = nri_request(&store_pod(&w.env, &uncached), "compute");
        let resp = w
            .runtime
            .create_container(sandbox, compute.clone())
            .await
            .expect("CreateContainer answered");
        assert_eq!(misc_max(&resp), Some("tdx 0"), "{resp:?}");

        lifted_when_exempt(&w, &compute).await;
    })
    .await;
}

// An UpdateContainers the runtime never answers (CRI-O was seen to leave one so once; the container
// keeps its old limit) is said in the agent's log, with the container and the limit asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nri_an_update_the_runtime_leaves_unanswered_is_logged() {
    bounded(async {
        let (mut w, _reg) = strict_nri_world().await;
        w.env
            .api
            .create(&late_namespace(json!({})))
            .expect("namespace");
        let pod = VirtLauncherPod::for_tee("lifted", Tee::None)
            .namespace("late")
            .running_on(NODE)
            .build();
        let (sandbox, compute) = nri_request(&store_pod(&w.env, &pod), "compute");
        zeroed_eventually(&w.runtime, &sandbox, &compute).await;
        w.runtime.leave_updates_unanswered(true);
        lifted_when_exempt(&w, &compute).await;
        let id = compute["id"].as_str().expect("container id").to_string();
        // Said after the plugin's 10 s wait for an answer; the bound is hang protection only.
        let line = w
            .agent
            .proc
            .wait_for_log(
                "the unanswered UpdateContainers",
                Duration::from_secs(60),
                |l| {
                    (l.contains("has not answered UpdateContainers") && l.contains(&id))
                        .then(|| l.to_string())
                },
            )
            .await
            .expect("the agent says the runtime left the update unanswered");
        assert!(line.contains("tdx max"), "{line}");
    })
    .await;
}

/// NRI in strict mode on a host of 8 TDX keys, no container running yet.
async fn strict_nri_world() -> (NriWorld, Registration) {
    let host = SimHost::builder().capacity(TDX, 8).build().expect("host");
    nri_world_with(host, "  strict: true\n", |_| (Vec::new(), Vec::new())).await
}

/// A static pod's hash: the kubelet runs a manifest of its own under it as the pod's UID (its cgroup,
/// the runtime's requests), and its API object, the mirror pod, names it in
/// `kubernetes.io/config.mirror` under a UID of its own.
const STATIC_POD_UID: &str = "6d1b9e0c2f4a8b3e5c7d9f1a2b4c6e8f";

/// The mirror pod of a keyless static pod `name` on [`NODE`], stored.
fn store_mirror_pod(env: &E2eEnv, name: &str) -> Value {
    store_mirror(env, VirtLauncherPod::for_tee(name, Tee::None))
}

/// `pod` as the mirror pod of a static pod on [`NODE`] (run under [`STATIC_POD_UID`]), stored.
fn store_mirror(env: &E2eEnv, pod: VirtLauncherPod) -> Value {
    let mut mirror = pod.running_on(NODE).build();
    mirror.metadata.annotations.get_or_insert_default().extend([
        ("kubernetes.io/config.mirror".into(), STATIC_POD_UID.into()),
        ("kubernetes.io/config.source".into(), "file".into()),
    ]);
    store_pod(env, &mirror)
}

// Strict mode holds static pods too: the agent knows a mirror pod by the UID its static pod runs
// under, so the runtime's requests for its containers find it cached (no lookup: before, every one was
// a GET that found a pod of another UID, and the container started without its zero).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nri_strict_mode_zeroes_a_static_pods_keyless_container_from_its_cached_mirror_pod() {
    bounded(async {
        let (w, _reg) = strict_nri_world().await;
        let mirror = store_mirror_pod(&w.env, "static-proxy");
        let (mut sandbox, compute) = nri_request(&mirror, "compute");
        sandbox["uid"] = json!(STATIC_POD_UID);
        let name = mirror["metadata"]["name"].as_str();
        let lookups = || {
            w.env
                .api
                .requests()
                .iter()
                .filter(|r| r.verb == Verb::Get && r.name.as_deref() == name)
                .count()
        };
        // Once the agent's watch has delivered the mirror pod, the zero comes from the cache.
        eventually(
            "tdx 0 for the static pod's container, without a GET",
            async || {
                let before = lookups();
                let resp = w
                    .runtime
                    .create_container(sandbox.clone(), compute.clone())
                    .await
                    .ok()?;
                (misc_max(&resp) == Some("tdx 0") && lookups() == before).then_some(())
            },
        )
        .await;
    })
    .await;
}

// The cgroup writer finds a static pod's cgroup (named by its hash, not by the mirror pod's UID) and
// zeroes it in strict mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_mode_zeroes_the_cgroup_of_a_static_pod() {
    bounded(async {
        let w = strict_cgroup_world().await;
        store_mirror_pod(&w.env, "static-proxy");
        w.host
            .add_pod(STATIC_POD_UID, QosClass::Burstable, &["compute"])
            .expect("the static pod's cgroup");
        eventually("misc.max tdx 0 for the static pod", async || {
            w.host.pod_max(STATIC_POD_UID, TDX) == Some(Some(0))
        })
        .await;
    })
    .await;
}

// An Event about a static pod is on its mirror pod, the API object whose UID `kubectl describe pod`
// lists Events by, not on the hash the node runs the static pod under.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_about_a_static_pod_is_on_its_mirror_pod() {
    bounded(async {
        let w = World::start(4, CGROUP_CONFIG).await.expect("world starts");
        // An SEV-SNP key on a TDX host: the agent sets no limit for it, and says so on the pod.
        let pod = VirtLauncherPod::for_tee("static-snp", Tee::Snp).request(SNP_ESIDS, "1");
        let mirror = store_mirror(&w.env, pod);
        let (ns, name) = (
            mirror["metadata"]["namespace"].as_str().expect("namespace"),
            mirror["metadata"]["name"].as_str().expect("name"),
        );
        let event = w
            .driver
            .wait_event(
                ns,
                "Pod",
                name,
                "TEEKeyKindUnavailable",
                Duration::from_secs(30),
            )
            .await
            .expect("an Event about the static pod");
        assert_eq!(
            event.pointer("/involvedObject/uid"),
            mirror.pointer("/metadata/uid"),
            "{event}"
        );
    })
    .await;
}

/// A world of 4 TDX keys whose agent writes pod cgroups' limits in strict mode.
async fn strict_cgroup_world() -> World {
    let config = format!("{CGROUP_CONFIG}  strict: true\n");
    World::start(4, &config).await.expect("world starts")
}

const CGROUP_CONFIG: &str =
    "agent:\n  pollInterval: 100ms\n  heartbeatInterval: 1s\nenforcement:\n  mode: cgroup\n";

/// Admit and bind a VM through the webhook; returns the stored pod's UID.
async fn admit_and_bind(w: &World, name: &str, tee: Tee) -> String {
    let (_, adm) = w
        .driver
        .create_vm(&VmiSpec::new(name, tee))
        .await
        .expect("VMI stored, its pod reviewed");
    let pod = adm
        .pod
        .unwrap_or_else(|| panic!("{name} admitted: {:?}", adm.validate));
    let (ns, pod_name) = (
        pod.metadata.namespace.clone().expect("ns"),
        pod.metadata.name.clone().expect("name"),
    );
    let b = w.driver.bind(&ns, &pod_name, NODE).await.expect("binding");
    assert!(b.bound, "{name} bound: {:?}", b.reply.raw);
    pod.metadata.uid.clone().expect("uid")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cgroup_writer_limits_a_tdx_vm_so_the_kernel_refuses_its_second_key() {
    bounded(async {
        let w = World::start(4, CGROUP_CONFIG).await.expect("world starts");
        let uid = admit_and_bind(&w, "vm-1", Tee::Tdx).await;
        // The kubelet creates the pod cgroup; the agent writes misc.max into it.
        let created = Instant::now();
        w.host
            .add_pod(&uid, QosClass::Burstable, &["compute"])
            .expect("pod cgroup");
        eventually("misc.max tdx 1 in the pod cgroup", async || {
            w.host.pod_max(&uid, TDX) == Some(Some(1))
        })
        .await;
        let took = created.elapsed();
        eprintln!("pod cgroup limited {took:?} after it appeared");
        // QEMU takes its key; a second TEE VM in the same pod is refused by the kernel.
        w.host.start_vm(&uid, "compute", TDX).expect("first key");
        assert!(
            w.host.start_vm(&uid, "compute", TDX).is_err(),
            "the second key is refused"
        );
        let pod_cgroup = w.host.pod_cgroup_rel(&uid).expect("pod cgroup");
        assert_eq!(
            w.host.events(&pod_cgroup, TDX),
            1,
            "the refusal counts in misc.events"
        );
        assert_eq!(w.host.usage(TDX), 1);

        let (status, reason, message) = eventually("Enforcing=True", async || {
            enforcing(&w.env, NODE).filter(|c| c.0 == "True" && c.2.contains("1 pods limited"))
        })
        .await;
        assert_eq!(
            (status.as_str(), reason.as_str()),
            ("True", "CgroupWriter"),
            "{message}"
        );
        let metrics = w.agent.as_ref().expect("agent").metrics().await;
        assert!(
            metrics.contains(
                "teeguard_agent_limits_applied_total{mechanism=\"cgroup\",kind=\"tdx\"} 1"
            ),
            "{metrics}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_mode_makes_a_charge_by_a_pod_that_requested_no_key_fail() {
    bounded(async {
        let w = strict_cgroup_world().await;
        // An ordinary VM (no launchSecurity) requests no key: strict mode gives its pod tdx 0.
        let uid = admit_and_bind(&w, "plain", Tee::None).await;
        w.host
            .add_pod(&uid, QosClass::Burstable, &["compute"])
            .expect("pod cgroup");
        eventually("misc.max tdx 0 in the pod cgroup", async || {
            w.host.pod_max(&uid, TDX) == Some(Some(0))
        })
        .await;
        assert!(
            w.host.start_vm(&uid, "compute", TDX).is_err(),
            "an unaccounted TEE VM fails at the kernel"
        );
        assert_eq!(w.host.usage(TDX), 0);
        // A TEE VM in the same world still gets its key.
        let tee = admit_and_bind(&w, "vm-1", Tee::Tdx).await;
        w.host
            .add_pod(&tee, QosClass::Burstable, &["compute"])
            .expect("pod cgroup");
        eventually("misc.max tdx 1", async || {
            w.host.pod_max(&tee, TDX) == Some(Some(1))
        })
        .await;
        w.host
            .start_vm(&tee, "compute", TDX)
            .expect("the TEE VM starts");
        let (_, _, message) = eventually("Enforcing=True", async || {
            enforcing(&w.env, NODE).filter(|c| c.0 == "True")
        })
        .await;
        assert!(message.contains("strict on"), "{message}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_without_misc_delegation_reports_enforcing_false_and_writes_nothing() {
    bounded(async {
        let env = E2eEnv::new(CGROUP_CONFIG).await.expect("env");
        seed_node(&env, NODE);
        let host = SimHost::builder()
            .capacity(TDX, 4)
            .misc_delegation(MiscDelegation::NotBelowKubepods)
            .build()
            .expect("host");
        let agent = env.start_agent(NODE, &host).await.expect("agent starts");
        let vm = store_pod(&env, &launcher(Tee::Tdx, TDX_KEYS, "tdx 1"));
        let uid = uid(&vm);
        host.add_pod(&uid, QosClass::Burstable, &["compute"])
            .expect("pod cgroup");
        let (status, reason, message) =
            eventually("Enforcing=False", async || enforcing(&env, NODE)).await;
        assert_eq!(
            (status.as_str(), reason.as_str()),
            ("False", "MiscControllerNotDelegated"),
            "{message}"
        );
        assert!(message.contains("subtree_control"), "{message}");
        // Give the writer a few polls: nothing is created or written.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let dir = host.pod_cgroup_path(&uid).expect("pod dir");
        assert!(
            !dir.join("misc.max").exists(),
            "no misc.max created in {}",
            dir.display()
        );
        assert!(!agent.proc.log().contains("misc.max written"));
        host.start_vm(&uid, "compute", TDX)
            .expect("the VM starts unlimited");
    })
    .await;
}

// Issue #32: strict mode honours the namespace label `teeguard.dev/exempt: "true"` as the webhook does:
// a pod of such a namespace that requested no key is left alone, while the same pod elsewhere gets
// `tdx 0`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_mode_leaves_the_pods_of_an_exempt_namespace_alone() {
    bounded(async {
        let w = strict_cgroup_world().await;
        w.env
            .api
            .create(&json!({
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": "lab", "labels": {teeguard_shared::names::EXEMPT_LABEL: "true"}}
            }))
            .expect("exempt namespace");
        let plain = |name: &str, ns: &str| {
            VirtLauncherPod::for_tee(name, Tee::None)
                .namespace(ns)
                .running_on(NODE)
                .build()
        };
        let exempt = uid(&store_pod(&w.env, &plain("in-lab", "lab")));
        let strict = uid(&store_pod(&w.env, &plain("in-default", "default")));
        for uid in [&exempt, &strict] {
            w.host
                .add_pod(uid, QosClass::Burstable, &["compute"])
                .expect("pod cgroup");
        }
        eventually(
            "misc.max tdx 0 for the pod outside the exempt namespace",
            async || w.host.pod_max(&strict, TDX) == Some(Some(0)),
        )
        .await;
        // Both pods were known when the first was limited; give the writer a few more sweeps.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_ne!(
            w.host.pod_max(&exempt, TDX),
            Some(Some(0)),
            "the exempt namespace's pod was zeroed"
        );
        w.host
            .start_vm(&exempt, "compute", TDX)
            .expect("a VM of the exempt namespace takes a key");
    })
    .await;
}

// Strict mode: a pod limited to `tdx 0` before its namespace was labelled exempt (a label added later,
// or the namespace watch behind the pod watch) gets the limit lifted once the agent sees the label, so
// the VM it starts takes its key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_mode_lifts_the_zero_of_a_pod_whose_namespace_is_labelled_exempt_later() {
    bounded(async {
        let w = strict_cgroup_world().await;
        w.env
            .api
            .create(&late_namespace(json!({})))
            .expect("namespace");
        let pod = VirtLauncherPod::for_tee("in-late", Tee::None)
            .namespace("late")
            .running_on(NODE)
            .build();
        let uid = uid(&store_pod(&w.env, &pod));
        w.host
            .add_pod(&uid, QosClass::Burstable, &["compute"])
            .expect("pod cgroup");
        eventually(
            "misc.max tdx 0 while the namespace is not exempt",
            async || w.host.pod_max(&uid, TDX) == Some(Some(0)),
        )
        .await;
        w.env
            .api
            .insert(&late_namespace(
                json!({teeguard_shared::names::EXEMPT_LABEL: "true"}),
            ))
            .expect("namespace labelled exempt");
        eventually("the pod's tdx limit lifted", async || {
            w.host.pod_max(&uid, TDX) == Some(None)
        })
        .await;
        w.host
            .start_vm(&uid, "compute", TDX)
            .expect("the VM takes a key once its namespace is exempt");
    })
    .await;
}
