//! The real-node scenarios that run the same on every runtime (each `node_<runtime>` binary calls them):
//! what the runtime hands runc for each container, as the agent's NRI answers made it.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Api;
use kube::api::PostParams;
use serde_json::json;
use teeguard_tests::e2e::json_log_line;
use teeguard_tests::fixtures::{TDX_KEYS, Tee};
use teeguard_tests::node::{ContainerKind, Recorded, RecordedUpdate, Runtime, pods};
use teeguard_tests::patch::MergePatch;

use super::{AgentHost, NodeWorld, Options, unguarded_namespace};

/// teeguard's annotation on the `compute` container.
pub const ANNOTATION: &str = "misc-max.teeguard.dev/compute";
/// The SEV-ES/SNP key resource.
pub const ESIDS: &str = "sev-snp.amd.com/esids";
/// The longest a scenario may take.
pub const DEADLINE: Duration = Duration::from_secs(240);

pub use teeguard_tests::node::limits;

fn expected(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
        .collect()
}

/// Scenario 1: TDX and SEV-SNP VMs' virt-launcher pods, mutated by the webhook, run; the `compute`
/// container's OCI config carries `tdx 1` / `sev_es 1`, the sidecar, the init container and the
/// sandbox nothing; a pod whose annotation disagrees with its request (created past the webhook) gets
/// the request, the mismatch metric and the Event.
/// At registration each side told the other its NRI release: the runtime logs the plugin's (not
/// "unknown"), the agent logs the runtime's.
fn nri_versions_exchanged(w: &NodeWorld, runtime: Runtime) {
    let said = format!(
        "(with NRI version {})",
        teeguard_agent::runtime::wire::NRI_VERSION
    );
    let log = w.turn.log(runtime.name());
    assert!(
        log.lines()
            .any(|l| l.contains("teeguard") && l.contains(&said)),
        "{}'s log says the plugin registered {said}:\n{}",
        runtime.name(),
        log.lines()
            .filter(|l| l.contains("registered as"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let registered = w
        .agent
        .proc
        .log()
        .lines()
        .find_map(|l| json_log_line(l, "NRI plugin registered"))
        .expect("the agent logged its registration");
    let theirs = registered
        .pointer("/fields/runtime_nri_version")
        .or_else(|| registered.get("runtime_nri_version"))
        .and_then(serde_json::Value::as_str)
        .unwrap_or_default();
    assert!(
        theirs.starts_with("v0."),
        "the agent logs the runtime's NRI release: {registered}"
    );
    eprintln!(
        "{}: the runtime logged the plugin's NRI {}, the agent the runtime's {theirs}",
        runtime.name(),
        teeguard_agent::runtime::wire::NRI_VERSION
    );
}

pub async fn launchers(runtime: Runtime) {
    let Some(w) = NodeWorld::start(runtime, "launchers", Options::simulated()).await else {
        return;
    };
    w.wait_allocatable(TDX_KEYS, "4", Duration::from_secs(20))
        .await;
    w.wait_allocatable(ESIDS, "4", Duration::from_secs(20))
        .await;
    nri_versions_exchanged(&w, runtime);
    for (vm, tee, resource, want) in [
        ("tdx-vm", Tee::Tdx, TDX_KEYS, "tdx 1"),
        ("snp-vm", Tee::Snp, ESIDS, "sev_es 1"),
    ] {
        let pod = w
            .create_vm(vm, tee)
            .await
            .unwrap_or_else(|e| panic!("{vm} refused: {e}\n{}", w.diagnostics()));
        let annotations = pod.metadata.annotations.clone().unwrap_or_default();
        assert_eq!(annotations.get(ANNOTATION).map(String::as_str), Some(want));
        let compute = &pod.spec.as_ref().expect("spec").containers[0];
        let requests = compute.resources.as_ref().and_then(|r| r.requests.clone());
        assert_eq!(
            requests.and_then(|r| r.get(resource).map(|q| q.0.clone())),
            Some("1".into()),
            "the webhook added the key request to compute"
        );
        let pod = w.wait_running(&pod).await;
        let records = w.records(&pod).await;
        assert_eq!(
            limits(&records),
            expected(&[
                ("compute", want),
                ("container-disk-binary", "-"),
                ("guest-console-log", "-"),
            ]),
            "{vm}: misc.max per container as the runtime handed it to runc"
        );
    }

    // Past the webhook: the annotation claims 2 keys, the container requests 1.
    let ns = unguarded_namespace(&w.cluster, "launchers-unguarded").await;
    let mut pod = pods::plain(
        &ns,
        "mismatch",
        &[("compute", &[(TDX_KEYS, "1")])],
        &w.selector(),
    );
    pod.metadata
        .annotations
        .get_or_insert_default()
        .insert(ANNOTATION.into(), "tdx 2".into());
    let pod = w.run(&pod).await;
    assert_eq!(
        limits(&w.records(&pod).await),
        expected(&[("compute", "tdx 1")]),
        "the request, not the annotation"
    );
    let metrics = w.agent.metrics().await;
    assert!(
        metrics.contains("teeguard_agent_limit_mismatches_total{mechanism=\"nri\"} 1"),
        "{metrics}"
    );
    w.event_message(
        &ns,
        "mismatch",
        "TEEKeyLimitMismatch",
        &["container compute", "misc.max tdx 1 applied"],
    )
    .await;
}

/// Scenario 3: the agent on the machine's own cgroup tree (cgroup v1, no misc controller) with strict
/// mode on: the report says why nothing is enforced, the agent adjusts no container, and every pod
/// starts, also one carrying teeguard's annotation without a key (strict mode's `0` candidate); a
/// TDX VM is refused by the webhook with the report's figures.
pub async fn machine_without_misc(runtime: Runtime) {
    let options = Options {
        host: AgentHost::Machine,
        strict: true,
        ..Options::simulated()
    };
    let Some(w) = NodeWorld::start(runtime, "machine", options).await else {
        return;
    };
    let hardware = w.condition("TeeHardware").await;
    assert_eq!(hardware.status, "False", "{hardware:?}");
    let enforcing = w.condition("Enforcing").await;
    assert_eq!(
        (enforcing.status.as_str(), enforcing.reason.as_str()),
        ("False", "NoTeeHardware"),
        "{enforcing:?}"
    );
    // A previous test's agent may have advertised keys on this Node: this one takes them back.
    w.cluster
        .wait_for("the Node without TDX keys", || async {
            w.allocatable(TDX_KEYS).await.is_none().then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", w.diagnostics()));

    let refused = w.create_vm("tdx-vm", Tee::Tdx).await.expect_err("refused");
    assert!(
        refused.to_string().contains("no node can host this TDX VM"),
        "{refused}"
    );
    let plain = pods::plain(&w.ns, "plain", &[("main", &[])], &w.selector());
    let ns = unguarded_namespace(&w.cluster, "machine-unguarded").await;
    let mut annotated = pods::plain(&ns, "annotated", &[("compute", &[])], &w.selector());
    annotated
        .metadata
        .annotations
        .get_or_insert_default()
        .insert(ANNOTATION.into(), "tdx 1".into());
    let mut started: Vec<Pod> = Vec::new();
    for pod in [plain, annotated] {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let created = w
            .pods_in(&ns)
            .create(&PostParams::default(), &pod)
            .await
            .expect("created");
        started.push(w.wait_running(&created).await);
    }
    for pod in &started {
        let records = w.records(pod).await;
        assert!(
            records.iter().all(|r| r.unified.is_empty()),
            "no adjustment on a host without the misc controller: {:?}",
            limits(&records)
        );
    }
    let metrics = w.agent.metrics().await;
    assert!(
        !metrics.contains("teeguard_agent_limits_applied_total{"),
        "{metrics}"
    );
}

/// Scenario 5: a TEE VM whose containers were created while no plugin was registered (the agent was
/// down) gets its limit when the agent registers: NRI's `Synchronize` lists the running containers,
/// the agent answers with an update of the `compute` container only, and the runtime asks runc to
/// apply it. On a cgroup v1 host runc cannot (no `unified`): the update is refused, the runtime
/// ignores the failure as the agent asks, the pod keeps running and the plugin stays registered.
pub async fn synchronize(runtime: Runtime) {
    let Some(mut w) = NodeWorld::start(runtime, "synchronize", Options::simulated()).await else {
        return;
    };
    w.wait_allocatable(TDX_KEYS, "4", Duration::from_secs(20))
        .await;
    w.agent.proc.kill();
    let pod = w
        .create_vm("early-vm", Tee::Tdx)
        .await
        .unwrap_or_else(|e| panic!("refused: {e}\n{}", w.diagnostics()));
    let pod = w.wait_running(&pod).await;
    let records = w.records(&pod).await;
    assert_eq!(
        limits(&records).get("compute").map(String::as_str),
        Some("-"),
        "created while no plugin was registered: no limit at creation"
    );
    let compute = records
        .iter()
        .find(|r| r.container == "compute")
        .expect("compute recorded")
        .id
        .clone();

    // Updates an earlier test on this node asked for are not this test's.
    let since = std::time::SystemTime::now();
    w.restart_agent().await;
    let update = runc_update(
        &w,
        &compute,
        "runc asked to update compute's misc.max",
        |u| u.exit_code.is_some(),
    )
    .await;
    assert_eq!(update.misc_max(), Some("tdx 1"), "{update:?}");
    let others: Vec<_> = w
        .turn
        .updates()
        .into_iter()
        .filter(|u| u.at >= since && u.container_id != compute && u.misc_max().is_some())
        .collect();
    assert!(others.is_empty(), "only compute gets a limit: {others:?}");
    let log = w.turn.log(runtime.name());
    let said: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.to_lowercase().contains("update")
                && (l.contains(&compute) || l.contains("level=error"))
        })
        .collect();
    eprintln!(
        "{}: Synchronize update of compute asked runc for {}; runc answered {:?}: {}; the runtime logged: {said:#?}",
        runtime.name(),
        update.resources,
        update.exit_code,
        update.stderr.trim()
    );
    if std::path::Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        assert_eq!(update.exit_code, Some(0), "{update:?}");
    } else {
        assert_ne!(
            update.exit_code,
            Some(0),
            "cgroup v1 has no unified: {update:?}"
        );
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let again = w
        .pods_in(&w.ns)
        .get(pod.metadata.name.as_deref().unwrap_or_default())
        .await;
    assert!(again.as_ref().is_ok_and(super::running), "{again:?}");
    let metrics = w.agent.metrics().await;
    assert!(
        metrics.contains("teeguard_agent_nri_connected 1"),
        "{metrics}"
    );
}

/// A TEE `compute` container the runtime created while the agent was away and started after the agent
/// registered again: `Synchronize` lists it as created, not running. containerd applies the agent's
/// update to the container's stored spec only, which its start uses unless `runc create` is already
/// under way, as it is when the registration falls inside the start (held here: the runc wrapper waits
/// in that container's `runc create` while the agent registers); CRI-O runs `runc update` on the created
/// container. Either way the agent asks again once the container runs (NRI `PostStartContainer` →
/// `UpdateContainers`), and runc is asked for `tdx 1` after the start. Driven through `crictl` with the
/// kubelet stopped: the kubelet starts a container right after creating it and kills a pod it does not
/// know.
pub async fn created_while_away_started_after(runtime: Runtime) {
    let Some(mut w) = NodeWorld::start(runtime, "created-then-started", Options::simulated()).await
    else {
        return;
    };
    w.wait_allocatable(TDX_KEYS, "4", Duration::from_secs(20))
        .await;
    w.turn.stop_kubelet().await;
    w.agent.proc.kill();
    let dir = tempfile::tempdir().expect("tempdir");
    let uid = format!("created-then-started-{}", std::process::id());
    let marker = format!("TEEGUARD_HOLD={uid}");
    let sandbox = dir.path().join("sandbox.json");
    let container = dir.path().join("container.json");
    std::fs::write(
        &sandbox,
        serde_json::json!({
            "metadata": {"name": "early-start", "namespace": w.ns, "uid": uid, "attempt": 0},
            "annotations": {ANNOTATION: "tdx 1"},
            "log_directory": dir.path().join("logs"),
            "linux": {}
        })
        .to_string(),
    )
    .expect("write the sandbox config");
    std::fs::write(
        &container,
        serde_json::json!({
            "metadata": {"name": "compute"},
            "image": {"image": teeguard_tests::node::BUSYBOX},
            "command": ["/bin/sleep", "3600"],
            "envs": [{"key": "TEEGUARD_HOLD", "value": uid}],
            "log_path": "compute.log",
            "linux": {}
        })
        .to_string(),
    )
    .expect("write the container config");
    let path = |p: &std::path::Path| p.display().to_string();
    fn crictl(w: &NodeWorld, args: &[&str]) -> String {
        w.turn
            .crictl(args)
            .map(|out| out.trim().to_string())
            .unwrap_or_else(|e| panic!("crictl {args:?}: {e}\n{}", w.diagnostics()))
    }
    let pod_id = crictl(&w, &["runp", &path(&sandbox)]);
    let id = crictl(&w, &["create", &pod_id, &path(&container), &path(&sandbox)]);

    let since = match runtime {
        Runtime::Containerd => {
            // containerd runs `runc create` at the start: hold it there while the agent registers.
            w.turn.hold_create(&marker).expect("hold runc create");
            let start = std::thread::spawn({
                let node = w.turn.node();
                let id = id.clone();
                move || node.crictl(&["start", &id])
            });
            w.cluster
                .wait_for("containerd's runc create of compute to be held", || async {
                    w.turn.create_held().then_some(())
                })
                .await
                .unwrap_or_else(|e| panic!("{e}\n{}", w.diagnostics()));
            w.restart_agent().await;
            // The agent answers Synchronize with compute's update (it logs that just before).
            w.agent
                .proc
                .wait_for_log("its Synchronize answer", Duration::from_secs(15), |l| {
                    json_log_line(
                        l,
                        "misc.max asked for containers that already run (NRI Synchronize)",
                    )
                    .map(|_| ())
                })
                .await
                .unwrap_or_else(|e| panic!("{e}\n{}", w.diagnostics()));
            let since = std::time::SystemTime::now();
            w.turn.release_create();
            start
                .join()
                .expect("crictl start")
                .unwrap_or_else(|e| panic!("crictl start: {e}\n{}", w.diagnostics()));
            since
        }
        Runtime::Crio => {
            // CRI-O ran `runc create` at the creation, and updates the created container itself.
            w.restart_agent().await;
            runc_update(&w, &id, "CRI-O's runc update of the created compute", |u| {
                u.exit_code.is_some()
            })
            .await;
            let since = std::time::SystemTime::now();
            crictl(&w, &["start", &id]);
            since
        }
    };
    let update = w
        .cluster
        .wait_for(
            "runc asked to update compute's misc.max after its start",
            || async {
                w.turn
                    .updates()
                    .into_iter()
                    .find(|u| u.container_id == id && u.at >= since && u.exit_code.is_some())
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", w.diagnostics()));
    assert_eq!(update.misc_max(), Some("tdx 1"), "{update:?}");
    let config = w
        .turn
        .recorded_config(&id)
        .expect("compute's OCI config recorded");
    assert_eq!(
        config.pointer("/linux/resources/unified/misc.max"),
        None,
        "compute's OCI config, written before the agent's answer could reach it, has no limit"
    );
    eprintln!(
        "{}: compute created while the agent was away, started after it registered: runc asked for {} \
         {:?} after the start began (runc answered {:?}: {})",
        runtime.name(),
        update.resources,
        update.at.duration_since(since).unwrap_or_default(),
        update.exit_code,
        update.stderr.trim()
    );
    crictl(&w, &["stopp", &pod_id]);
    crictl(&w, &["rmp", &pod_id]);
    w.turn
        .start_kubelet()
        .await
        .expect("the kubelet starts again");
}

/// Scenario 2: strict mode on a host with one kind (TDX): a pod that requested no key gets `tdx 0` on
/// each of its containers; a pod labelled exempt, and a pod in a namespace labelled exempt, get nothing;
/// a TDX VM gets `tdx 1` on compute and nothing elsewhere. A namespace's exempt label added later (also
/// while the agent is away) lifts its running containers' zeros; removed, gives them the zero.
pub async fn strict(runtime: Runtime) {
    let options = Options {
        host: AgentHost::Simulated { tdx: 4, sev_es: 0 },
        strict: true,
        ..Options::simulated()
    };
    let Some(mut w) = NodeWorld::start(runtime, "strict", options).await else {
        return;
    };
    w.wait_allocatable(TDX_KEYS, "4", Duration::from_secs(20))
        .await;
    let exempt_ns = w
        .cluster
        .namespace(&w.test, "strict-exempt", &[(EXEMPT, "true")])
        .await
        .expect("exempt namespace");
    let two = [("main", &[][..]), ("sidecar", &[][..])];
    let plain = pods::plain(&w.ns, "no-key", &two, &w.selector());
    let mut labelled = pods::plain(&w.ns, "exempt-pod", &two, &w.selector());
    labelled
        .metadata
        .labels
        .get_or_insert_default()
        .insert(EXEMPT.into(), "true".into());
    let in_exempt_ns = pods::plain(&exempt_ns, "in-exempt-ns", &two, &w.selector());
    let (mut zeroed, mut born_exempt) = (Vec::new(), Vec::new());
    for (pod, want) in [(plain, "tdx 0"), (labelled, "-"), (in_exempt_ns, "-")] {
        let name = pod.metadata.name.clone().unwrap_or_default();
        let running = w.run(&pod).await;
        let records = w.records(&running).await;
        assert_eq!(
            limits(&records),
            expected(&[("main", want), ("sidecar", want)]),
            "{name}"
        );
        let containers = records
            .into_iter()
            .filter(|r| r.kind == ContainerKind::Container);
        match want {
            "tdx 0" => zeroed.extend(containers),
            _ if name == "in-exempt-ns" => born_exempt.extend(containers),
            _ => {}
        }
    }
    // A static pod (a manifest in the kubelet's staticPodPath) runs under its configuration hash, not
    // its mirror pod's UID: zeroed as any other pod.
    let static_ns = w
        .cluster
        .namespace(&w.test, "strict-static", &[])
        .await
        .expect("namespace");
    let mirror = w
        .run_static_pod(&pods::plain(&static_ns, "static", &two, &[]))
        .await;
    assert_eq!(
        limits(&w.records(&mirror).await),
        expected(&[("main", "tdx 0"), ("sidecar", "tdx 0")]),
        "the static pod"
    );
    w.remove_static_pod(&mirror).await;
    let vm = w.create_vm("tdx-vm", Tee::Tdx).await.expect("admitted");
    let vm = w.wait_running(&vm).await;
    assert_eq!(
        limits(&w.records(&vm).await),
        expected(&[
            ("compute", "tdx 1"),
            ("container-disk-binary", "-"),
            ("guest-console-log", "-"),
        ])
    );
    // A namespace labelled exempt later: the agent lifts the zeros of its running containers (`tdx
    // max`), and the runtime asks runc to update each (this machine's runc then refuses `unified` on
    // cgroup v1: the request is the evidence, as for the container created while the agent was away).
    // Labelled while the agent is away: the zero shows in the runtime's Synchronize, lifted in the
    // answer; labelled while it runs: lifted through UpdateContainers. Then the label of the namespace
    // exempt from the start removed: its containers get the zero through UpdateContainers.
    let away_ns = w
        .cluster
        .namespace(&w.test, "strict-away", &[])
        .await
        .expect("namespace");
    let away = pods::plain(&away_ns, "zeroed-away", &two, &w.selector());
    let away = w.run(&away).await;
    let away: Vec<_> = w
        .records(&away)
        .await
        .into_iter()
        .filter(|r| r.kind == ContainerKind::Container)
        .collect();
    assert_eq!(
        limits(&away),
        expected(&[("main", "tdx 0"), ("sidecar", "tdx 0")])
    );
    let namespaces: Api<Namespace> = Api::all(w.cluster.client.clone());
    let label_exempt = |ns: &str| {
        let (namespaces, ns) = (namespaces.clone(), ns.to_string());
        async move {
            namespaces
                .merge_patch(&ns, json!({"metadata": {"labels": {EXEMPT: "true"}}}))
                .await
                .expect("label the namespace exempt");
        }
    };
    w.agent.proc.kill();
    label_exempt(&away_ns).await;
    w.restart_agent().await;
    label_exempt(&w.ns).await;
    for container in away.iter().chain(&zeroed) {
        let update = runc_updated(&w, container, "tdx max").await;
        eprintln!(
            "{}: {}'s zero lifted once its namespace was labelled exempt: runc asked for {}",
            runtime.name(),
            container.container,
            update.resources
        );
    }
    namespaces
        .merge_patch(&exempt_ns, json!({"metadata": {"labels": {EXEMPT: null}}}))
        .await
        .expect("remove the namespace's exempt label");
    for container in &born_exempt {
        let update = runc_updated(&w, container, "tdx 0").await;
        eprintln!(
            "{}: {} zeroed once its namespace's exempt label was removed: runc asked for {}",
            runtime.name(),
            container.container,
            update.resources
        );
    }
}

/// The runtime's request to runc to update `container` to `misc.max` `to`, once it comes.
async fn runc_updated(w: &NodeWorld, container: &Recorded, to: &str) -> RecordedUpdate {
    let what = format!("runc asked to update {} to {to}", container.container);
    runc_update(w, &container.id, &what, |u| u.misc_max() == Some(to)).await
}

/// The first update runc was asked for (`what`) of container `id` that `matches`, once there is one.
async fn runc_update(
    w: &NodeWorld,
    id: &str,
    what: &str,
    matches: impl Fn(&RecordedUpdate) -> bool,
) -> RecordedUpdate {
    w.cluster
        .wait_for(what, || async {
            w.turn
                .updates()
                .into_iter()
                .find(|u| u.container_id == id && matches(u))
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", w.diagnostics()))
}

/// teeguard's exemption label.
const EXEMPT: &str = "teeguard.dev/exempt";

/// Scenario 6: the node's key resource as the kubelet sees it. A pod asking more keys than the agent
/// advertises stays Pending with the scheduler's `Insufficient` message; one bound directly
/// (`spec.nodeName`, past the scheduler and the webhook) is rejected by the kubelet's admission with
/// `OutOf<resource>`, the message the user sees in its status.
pub async fn kubelet_admission(runtime: Runtime) {
    let Some(w) = NodeWorld::start(runtime, "admission", Options::simulated()).await else {
        return;
    };
    w.wait_allocatable(TDX_KEYS, "4", Duration::from_secs(20))
        .await;
    let greedy = pods::plain(
        &w.ns,
        "five-keys",
        &[("main", &[(TDX_KEYS, "5")])],
        &w.selector(),
    );
    w.create(&greedy).await.expect("created");
    let insufficient = format!("Insufficient {TDX_KEYS}");
    let message = w
        .event_message(&w.ns, "five-keys", "FailedScheduling", &[&insufficient])
        .await;
    eprintln!("{}: the scheduler said: {message}", runtime.name());

    let ns = unguarded_namespace(&w.cluster, "admission-unguarded").await;
    let mut bound = pods::plain(&ns, "bound-five-keys", &[("main", &[(TDX_KEYS, "5")])], &[]);
    bound.spec.as_mut().expect("spec").node_name = Some(w.turn.name.clone());
    w.create(&bound).await.expect("created");
    let api = w.pods_in(&ns);
    let status = w
        .cluster
        .wait_for("the kubelet to reject bound-five-keys", || async {
            let s = api.get("bound-five-keys").await.ok()?.status?;
            (s.phase.as_deref() == Some("Failed")).then_some(s)
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", w.diagnostics()));
    let (reason, message) = (
        status.reason.unwrap_or_default(),
        status.message.unwrap_or_default(),
    );
    eprintln!("{}: the kubelet said: {reason}: {message}", runtime.name());
    assert_eq!(reason, format!("OutOf{TDX_KEYS}"));
    assert!(
        message.contains(TDX_KEYS)
            && message.contains("requested: 5")
            && message.contains("capacity: 4"),
        "{message}"
    );
}
