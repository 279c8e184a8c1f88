//! The agent's `run` loop end to end: the simulated host, the fake API server and the real kube client.

mod common;

use std::time::Duration;

use common::{
    Agent, NODE, WAIT, config, kata_tdx, node_allocatable, node_capacity, pending_tdx_pod, tdx_vm,
};
use teeguard_shared::names::{
    AGENT_EXTENDED_RESOURCES_ANNOTATION, AGENT_FIELD_MANAGER, conditions as ct, reasons,
};
use teeguard_shared::{TeeCapacity, TeeCapacityStatus};
use teeguard_tests::fakeapi::{FakeApiServer, FaultRule, RequestFilter, Verb};
use teeguard_tests::fixtures::{TDX_KEYS, tdx_node};
use teeguard_tests::host::{MiscDelegation, QosClass, SimHost, TDX};
use teeguard_tests::wait::eventually;

fn cond<'a>(s: &'a TeeCapacityStatus, t: &str) -> (&'a str, &'a str, &'a str) {
    let c = s
        .condition(t)
        .unwrap_or_else(|| panic!("no {t} condition in {s:#?}"));
    (c.status.as_str(), c.reason.as_str(), c.message.as_str())
}

fn tdx_is(s: &TeeCapacityStatus, f: impl Fn(&teeguard_shared::KindStatus) -> bool) -> bool {
    s.tdx.as_ref().is_some_and(f)
}

/// 16 keys, 4 KubeVirt VMs, 2 keys outside Kubernetes.
fn busy_host(api: &FakeApiServer) -> (SimHost, Vec<String>) {
    let host = SimHost::builder().capacity(TDX, 16).build().expect("host");
    let uids = (1..=4)
        .map(|i| tdx_vm(api, &host, &format!("vm{i}"), true))
        .collect();
    host.add_external("outside", TDX, 2).expect("external");
    (host, uids)
}

#[tokio::test]
async fn publishes_report_and_advertises_capacity_minus_external() {
    let api = FakeApiServer::new();
    let node = api.create(&tdx_node(NODE, 16, false)).expect("node");
    let (host, _) = busy_host(&api);
    let agent = Agent::start(&api, host.root(), config(""));

    let s = agent
        .wait_status("16 keys, 4 VMs, 2 external", |s| {
            tdx_is(s, |t| t.kernel_used == 6 && t.pods_used == 4)
        })
        .await;
    let t = s.tdx.clone().expect("tdx");
    assert_eq!(
        (
            t.capacity,
            t.kernel_used,
            t.pods_used,
            t.external,
            t.pending,
            t.free
        ),
        (16, 6, 4, 2, 0, 10)
    );
    assert_eq!(t.resource_name, TDX_KEYS);
    assert_eq!(t.advertised, Some(14));
    assert_eq!(s.agent_version.as_deref(), Some(env!("CARGO_PKG_VERSION")));
    assert!(s.heartbeat_time.is_some());
    assert_eq!(cond(&s, ct::KERNEL_READABLE).0, "True");
    assert_eq!(cond(&s, ct::TEE_HARDWARE).0, "True");
    assert_eq!(cond(&s, ct::PER_POD_ACCOUNTING).1, reasons::MISC_DELEGATED);
    assert_eq!(cond(&s, ct::ADVERTISING).1, reasons::ADVERTISED);

    // The Node advertises capacity − external, in capacity and allocatable, and records ownership.
    let n = agent
        .wait_node("tdx.intel.com/keys = 14", |n| {
            node_capacity(n, TDX_KEYS).as_deref() == Some("14")
        })
        .await;
    assert_eq!(node_allocatable(&n, TDX_KEYS).as_deref(), Some("14"));
    assert_eq!(
        n.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(AGENT_EXTENDED_RESOURCES_ANNOTATION))
            .map(String::as_str),
        Some(TDX_KEYS)
    );

    // The object: cluster-scoped, named after the node, owned by the Node, applied by our manager.
    let obj = api
        .get_typed::<TeeCapacity>(None, NODE)
        .expect("typed")
        .expect("exists");
    assert_eq!(obj.spec.node_name, NODE);
    let owner = &obj.metadata.owner_references.as_ref().expect("owners")[0];
    assert_eq!(
        (
            owner.api_version.as_str(),
            owner.kind.as_str(),
            owner.name.as_str()
        ),
        ("v1", "Node", NODE)
    );
    assert_eq!(Some(owner.uid.as_str()), node["metadata"]["uid"].as_str());
    let status_applies = api.requests_matching(
        &RequestFilter::new()
            .verb(Verb::Patch)
            .resource("teecapacities")
            .subresource("status")
            .field_manager(AGENT_FIELD_MANAGER),
    );
    assert!(!status_applies.is_empty());
    assert!(
        status_applies
            .iter()
            .all(|r| r.content_type.as_deref() == Some("application/apply-patch+yaml")),
        "server-side apply"
    );
    // The node status was changed with a JSON patch on the status subresource.
    let node_patches = api.requests_matching(
        &RequestFilter::new()
            .verb(Verb::Patch)
            .resource("nodes")
            .subresource("status"),
    );
    assert!(
        !node_patches.is_empty()
            && node_patches.iter().all(|r| {
                r.content_type.as_deref() == Some("application/json-patch+json")
                    && r.field_manager.as_deref() == Some(AGENT_FIELD_MANAGER)
            }),
        "{node_patches:?}"
    );

    // Readiness and metrics.
    assert!(
        agent.readiness.is_ready(),
        "{:?}",
        agent.readiness.pending()
    );
    assert_eq!(
        agent.metric("teeguard_agent_external_keys", &[("kind", "tdx")]),
        2.0
    );
    assert_eq!(
        agent.metric("teeguard_agent_free_keys", &[("kind", "tdx")]),
        10.0
    );
    assert!(agent.metric("teeguard_agent_publishes_total", &[]) >= 1.0);
    assert!(agent.metric("teeguard_agent_scan_duration_seconds_count", &[]) >= 1.0);
    agent.stop().await;
}

#[tokio::test]
async fn kata_overhead_counts_as_pods_used_and_bound_pods_are_pending() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let host = SimHost::builder().capacity(TDX, 16).build().expect("host");
    kata_tdx(&api, &host, "kata-tdx");
    pending_tdx_pod(&api, "waiting");
    let agent = Agent::start(&api, host.root(), config(""));
    let s = agent
        .wait_status("kata used, one pending", |s| {
            tdx_is(s, |t| t.kernel_used == 1 && t.pending == 1)
        })
        .await;
    let t = s.tdx.expect("tdx");
    assert_eq!(
        (t.pods_used, t.external, t.pending, t.free, t.advertised),
        (1, 0, 1, 14, Some(16))
    );

    // The pending pod starts: no longer pending, now used.
    let uid = api
        .list("pods", None)
        .into_iter()
        .find(|p| p["spec"]["nodeName"] == NODE && p["status"]["phase"] == "Pending")
        .and_then(|p| p["metadata"]["uid"].as_str().map(str::to_string))
        .expect("pending pod");
    host.add_pod(&uid, QosClass::Burstable, &["compute"])
        .expect("cgroup");
    host.start_vm(&uid, "compute", TDX).expect("vm");
    let s = agent
        .wait_status("both used", |s| {
            tdx_is(s, |t| t.pods_used == 2 && t.pending == 0)
        })
        .await;
    assert_eq!(s.tdx.expect("tdx").free, 14);
    agent.stop().await;
}

#[tokio::test]
async fn a_stopping_vm_frees_its_key_within_a_poll_interval() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let (host, uids) = busy_host(&api);
    let agent = Agent::start(&api, host.root(), config(""));
    agent
        .wait_status("4 VMs", |s| tdx_is(s, |t| t.pods_used == 4))
        .await;

    // The VM stops: its key is free in the kernel, the report shows it within a poll interval. The
    // pod still exists and still requests the key, so it counts as pending until it goes away.
    host.stop_vm(&uids[0], "compute", TDX).expect("stop");
    let stopped = std::time::Instant::now();
    // (SimHost rewrites the root file before the pod's, so a scan may briefly see the root without
    // the pod's change; wait for the settled figures.)
    let s = agent
        .wait_status("key freed", |s| {
            tdx_is(s, |t| t.kernel_used == 5 && t.pods_used == 3)
        })
        .await;
    // One poll is 50 ms; the bound only shows it is the poll, not the 30 s heartbeat.
    assert!(
        stopped.elapsed() < Duration::from_secs(5),
        "{:?}",
        stopped.elapsed()
    );
    let t = s.tdx.expect("tdx");
    assert_eq!((t.pods_used, t.external, t.pending, t.free), (3, 2, 1, 10));

    // The kubelet removes the cgroup and the pod goes away: nothing pending any more.
    host.remove_pod(&uids[0]).expect("cgroup gone");
    let pod_name = api
        .list("pods", None)
        .into_iter()
        .find(|p| p["metadata"]["uid"] == uids[0].as_str())
        .and_then(|p| p["metadata"]["name"].as_str().map(str::to_string))
        .expect("pod");
    api.delete("pods", Some("default"), &pod_name)
        .expect("delete");
    let s = agent
        .wait_status("pod gone", |s| tdx_is(s, |t| t.pending == 0))
        .await;
    let t = s.tdx.expect("tdx");
    assert_eq!(
        (t.kernel_used, t.pods_used, t.external, t.free),
        (5, 3, 2, 11)
    );

    // A VM stopping while its pod stays (the pod still requests the key): it becomes pending.
    host.stop_vm(&uids[1], "compute", TDX).expect("stop");
    agent
        .wait_status("stopped VM's pod pending", |s| {
            tdx_is(s, |t| t.kernel_used == 4 && t.pending == 1 && t.free == 11)
        })
        .await;
    agent.stop().await;
}

#[tokio::test]
async fn a_failed_charge_triggers_an_immediate_rescan() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let host = SimHost::builder().capacity(TDX, 16).build().expect("host");
    let uid = tdx_vm(&api, &host, "vm1", true);
    // Poll only every 20 s: only misc.events can explain a prompt update.
    let cfg = teeguard_shared::Config::from_yaml("agent:\n  pollInterval: 20s\n").expect("cfg");
    let agent = Agent::start(&api, host.root(), cfg);
    agent
        .wait_status("first scan", |s| {
            tdx_is(s, |t| t.kernel_used == 1 && t.pods_used == 1)
        })
        .await;
    // Usage changes silently (the kernel never notifies misc.current) ...
    host.add_external("outside", TDX, 3).expect("external");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(tdx_is(&agent.status().expect("status"), |t| t.kernel_used == 1));
    // ... then a charge fails in the pod: misc.events changes up the hierarchy.
    host.fail_charge_in(&uid, "compute", TDX)
        .expect("failed charge");
    let s = agent
        .wait_status("rescan after misc.events", |s| {
            tdx_is(s, |t| t.kernel_used == 4)
        })
        .await;
    assert_eq!(s.tdx.expect("tdx").external, 3);
    assert!(agent.metric("teeguard_agent_events_rescans_total", &[]) >= 1.0);
    agent.stop().await;
}

#[tokio::test]
async fn a_failed_charge_reads_every_pod_again_so_changes_that_cancelled_out_are_seen() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 2, false)).expect("node");
    let host = SimHost::builder().capacity(TDX, 2).build().expect("host");
    let vm1 = tdx_vm(&api, &host, "vm1", true);
    // A pod cgroup no pod of interest owns (an exempt VM's, say): its keys count as external.
    let other = "6f1d2c3b-4a59-4e8f-9b7a-1c2d3e4f5a6b";
    host.add_pod(other, QosClass::Burstable, &["compute"])
        .expect("pod cgroup");
    // Poll only every 20 s (the next full read is 10 polls away): only misc.events explains an update.
    let cfg = teeguard_shared::Config::from_yaml("agent:\n  pollInterval: 20s\n").expect("cfg");
    let agent = Agent::start(&api, host.root(), cfg);
    agent
        .wait_status("first scan", |s| {
            tdx_is(s, |t| t.pods_used == 1 && t.free == 1)
        })
        .await;
    // vm1's VM stops as the other cgroup's starts: kubepods holds 1 key before and after, so the
    // readings of the pods of interest would be reused. vm1's pod lives on and still counts as
    // pending (its key is kept for it): nothing is free.
    host.stop_vm(&vm1, "compute", TDX).expect("stop");
    host.start_vm(other, "compute", TDX).expect("start");
    host.fail_charge_in(other, "compute", TDX)
        .expect("failed charge");
    let s = agent
        .wait_status("every pod read after the failed charge", |s| {
            tdx_is(s, |t| t.pods_used == 0)
        })
        .await;
    let t = s.tdx.expect("tdx");
    assert_eq!((t.external, t.pending, t.free), (1, 1, 0), "{t:?}");
    agent.stop().await;
}

#[tokio::test]
async fn nfd_owned_resource_is_left_alone() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, true)).expect("node");
    let (host, _) = busy_host(&api);
    let agent = Agent::start(&api, host.root(), config(""));
    let s = agent
        .wait_status("report", |s| tdx_is(s, |t| t.kernel_used == 6))
        .await;
    let (status, reason, message) = cond(&s, ct::ADVERTISING);
    assert_eq!((status, reason), ("False", reasons::OWNED_BY_OTHER));
    assert!(
        message.contains(TDX_KEYS) && message.contains("node-feature-discovery"),
        "{message}"
    );
    assert_eq!(s.tdx.expect("tdx").advertised, None);
    // Let a few more polls pass, then check that nothing wrote the Node.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let node_writes = api.requests_where(|r| {
        r.resource.as_deref() == Some("nodes")
            && matches!(r.verb, Verb::Patch | Verb::Update | Verb::Create)
    });
    assert!(node_writes.is_empty(), "{node_writes:#?}");
    let n = agent.node();
    assert_eq!(node_capacity(&n, TDX_KEYS).as_deref(), Some("16"));
    agent.stop().await;
}

#[tokio::test]
async fn advertising_switched_off_removes_only_what_the_agent_added() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let (host, _) = busy_host(&api);
    let agent = Agent::start(&api, host.root(), config(""));
    agent
        .wait_node("advertised", |n| {
            node_capacity(n, TDX_KEYS).as_deref() == Some("14")
        })
        .await;
    agent.stop().await;

    // The agent does not remove anything on shutdown.
    assert_eq!(
        node_capacity(&api.get_typed(None, NODE).expect("n").expect("n"), TDX_KEYS).as_deref(),
        Some("14")
    );

    // Restart with advertising off: the resource and the annotation go.
    let agent = Agent::start(&api, host.root(), config("  advertise: false\n"));
    let n = agent
        .wait_node("removed", |n| {
            node_capacity(n, TDX_KEYS).is_none()
                && n.metadata
                    .annotations
                    .as_ref()
                    .is_none_or(|a| !a.contains_key(AGENT_EXTENDED_RESOURCES_ANNOTATION))
        })
        .await;
    assert_eq!(node_allocatable(&n, TDX_KEYS), None);
    assert_eq!(
        node_capacity(&n, "cpu").as_deref(),
        Some("64"),
        "other resources untouched"
    );
    let s = agent
        .wait_status("disabled", |s| {
            cond(s, ct::ADVERTISING).1 == reasons::ADVERTISING_DISABLED
        })
        .await;
    assert_eq!(s.tdx.expect("tdx").advertised, None);
    agent.stop().await;
}

#[tokio::test]
async fn a_kind_that_disappears_is_unadvertised() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let (host, _) = busy_host(&api);
    let agent = Agent::start(&api, host.root(), config(""));
    agent
        .wait_node("advertised", |n| node_capacity(n, TDX_KEYS).is_some())
        .await;
    host.remove_resource(TDX).expect("remove");
    let s = agent.wait_status("no kinds", |s| s.tdx.is_none()).await;
    assert_eq!(cond(&s, ct::TEE_HARDWARE).1, reasons::NO_TEE_HARDWARE);
    agent
        .wait_node("unadvertised", |n| node_capacity(n, TDX_KEYS).is_none())
        .await;
    agent.stop().await;
}

#[tokio::test]
async fn api_outage_keeps_scanning_and_publishes_when_back() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let (host, uids) = busy_host(&api);
    let agent = Agent::start(&api, host.root(), config(""));
    agent
        .wait_status("first publish", |s| tdx_is(s, |t| t.kernel_used == 6))
        .await;

    api.set_unavailable(true);
    let scans = agent.metric("teeguard_agent_scan_duration_seconds_count", &[]);
    host.stop_vm(&uids[0], "compute", TDX).expect("stop");
    // Scanning goes on during the outage.
    eventually("five scans during the outage", async || {
        agent.metric("teeguard_agent_scan_duration_seconds_count", &[]) >= scans + 5.0
    })
    .await;
    assert!(
        tdx_is(&agent.status().expect("status"), |t| t.kernel_used == 6),
        "nothing published while down"
    );
    assert!(
        agent.metric("teeguard_agent_api_errors_total", &[]) >= 1.0,
        "{}",
        agent.metrics()
    );

    // The polls after the VM stopped read every pod once, then take their readings unchanged while
    // the kubepods total matches them (agent/src/decide/reuse.rs).
    assert!(
        agent.metric("teeguard_agent_pod_files_read_total", &[]) >= 4.0,
        "{}",
        agent.metrics()
    );
    assert!(
        agent.metric("teeguard_agent_pod_readings_reused_total", &[]) >= 4.0,
        "{}",
        agent.metrics()
    );

    api.set_unavailable(false);
    agent
        .wait_status("published after the outage", |s| {
            tdx_is(s, |t| t.kernel_used == 5)
        })
        .await;
    assert!(!agent.task.is_finished());
    agent.stop().await;
}

#[tokio::test]
async fn api_unavailable_at_start() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let (host, _) = busy_host(&api);
    api.set_unavailable(true);
    let agent = Agent::start(&api, host.root(), config(""));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !agent.readiness.is_ready(),
        "the pod cache cannot be synced"
    );
    assert!(agent.readiness.pending().contains(&"pods"));
    api.set_unavailable(false);
    agent
        .wait_status("published once the API is back", |s| {
            tdx_is(s, |t| t.external == 2)
        })
        .await;
    assert!(agent.readiness.is_ready());
    agent.stop().await;
}

#[tokio::test]
async fn conflict_on_status_apply_is_reapplied_with_force() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let (host, _) = busy_host(&api);
    api.add_fault(
        FaultRule::respond(409)
            .verb(Verb::Patch)
            .resource("teecapacities")
            .subresource("status")
            .message("Apply failed with 1 conflict: conflict with \"kubectl\": .status.tdx.free")
            .times(1),
    );
    let agent = Agent::start(&api, host.root(), config(""));
    agent
        .wait_status("published despite the conflict", |s| {
            tdx_is(s, |t| t.free == 10)
        })
        .await;
    let applies = api.requests_matching(
        &RequestFilter::new()
            .verb(Verb::Patch)
            .resource("teecapacities")
            .subresource("status"),
    );
    assert!(applies.len() >= 2, "{applies:#?}");
    assert_eq!(applies[0].response_code, Some(409));
    assert_eq!(applies[0].query_param("force"), None);
    assert_eq!(applies[1].query_param("force"), Some("true"));
    assert_eq!(applies[1].response_code, Some(200));
    agent.stop().await;
}

#[tokio::test]
async fn server_errors_are_retried() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let (host, _) = busy_host(&api);
    api.add_fault(
        FaultRule::respond(500)
            .verb(Verb::Patch)
            .resource("teecapacities")
            .times(3),
    );
    api.add_fault(
        FaultRule::respond(500)
            .verb(Verb::Patch)
            .resource("nodes")
            .times(2),
    );
    let agent = Agent::start(&api, host.root(), config(""));
    agent
        .wait_status("published after 500s", |s| tdx_is(s, |t| t.free == 10))
        .await;
    agent
        .wait_node("advertised after 500s", |n| {
            node_capacity(n, TDX_KEYS).as_deref() == Some("14")
        })
        .await;
    assert!(agent.metric("teeguard_agent_api_errors_total", &[]) >= 2.0);
    agent.stop().await;
}

#[tokio::test]
async fn deleted_report_is_recreated() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let (host, uids) = busy_host(&api);
    let agent = Agent::start(&api, host.root(), config(""));
    agent.wait_status("published", |s| s.tdx.is_some()).await;
    api.delete("teecapacities", None, NODE).expect("delete");
    host.stop_vm(&uids[0], "compute", TDX)
        .expect("change something");
    let s = agent
        .wait_status("re-created", |s| tdx_is(s, |t| t.kernel_used == 5))
        .await;
    assert!(s.heartbeat_time.is_some());
    agent.stop().await;
}

#[tokio::test]
async fn failed_scan_keeps_figures_and_says_why() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let (host, _) = busy_host(&api);
    let agent = Agent::start(&api, host.root(), config(""));
    agent
        .wait_status("published", |s| tdx_is(s, |t| t.free == 10))
        .await;

    host.write_garbage("misc.current").expect("garbage");
    let s = agent
        .wait_status("KernelReadable False", |s| {
            cond(s, ct::KERNEL_READABLE).0 == "False"
        })
        .await;
    let (_, reason, message) = cond(&s, ct::KERNEL_READABLE);
    assert_eq!(reason, reasons::SCAN_FAILED);
    assert!(message.contains("misc.current"), "{message}");
    let t = s.tdx.clone().expect("figures kept");
    assert_eq!((t.kernel_used, t.free), (6, 10));
    assert!(agent.metric("teeguard_agent_scan_errors_total", &[]) >= 1.0);

    host.heal_all().expect("heal");
    let s2 = agent
        .wait_status("readable again", |s| {
            cond(s, ct::KERNEL_READABLE).0 == "True"
        })
        .await;
    // Transition times move only for the condition that flipped.
    let ltt =
        |s: &TeeCapacityStatus, t: &str| s.condition(t).expect("c").last_transition_time.clone();
    assert_eq!(ltt(&s, ct::TEE_HARDWARE), ltt(&s2, ct::TEE_HARDWARE));
    agent.stop().await;
}

#[tokio::test]
async fn unreadable_pod_cgroup_and_unparsable_names() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let (host, uids) = busy_host(&api);
    host.break_pod_misc_current(&uids[0]).expect("break");
    let bogus = host
        .add_unparsable_pod_dir(QosClass::Burstable, "garbage_uid")
        .expect("bogus");
    host.charge(&bogus, TDX, 1).expect("charge");
    let agent = Agent::start(&api, host.root(), config(""));
    let s = agent
        .wait_status("report", |s| tdx_is(s, |t| t.kernel_used == 7))
        .await;
    let t = s.tdx.clone().expect("tdx");
    // 3 VMs attributed; the unreadable pod's key and the bogus cgroup's key are external, the
    // unreadable pod's request is pending.
    assert_eq!((t.pods_used, t.external, t.pending, t.free), (3, 4, 1, 8));
    let (status, _, message) = cond(&s, ct::KERNEL_READABLE);
    assert_eq!(status, "True");
    assert!(message.contains("could not be read"), "{message}");
    assert!(agent.metric("teeguard_agent_pod_cgroup_errors_total", &[]) >= 1.0);
    agent.stop().await;
}

#[tokio::test]
async fn not_delegated_host_counts_running_pods() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let host = SimHost::builder()
        .capacity(TDX, 16)
        .misc_delegation(MiscDelegation::NotBelowKubepods)
        .build()
        .expect("host");
    for i in 0..2 {
        tdx_vm(&api, &host, &format!("vm{i}"), true);
    }
    host.add_external("outside", TDX, 1).expect("external");
    pending_tdx_pod(&api, "later");
    let agent = Agent::start(&api, host.root(), config(""));
    let s = agent
        .wait_status("fallback", |s| {
            tdx_is(s, |t| t.kernel_used == 3 && t.pending == 1)
        })
        .await;
    let (status, reason, message) = cond(&s, ct::PER_POD_ACCOUNTING);
    assert_eq!((status, reason), ("False", reasons::MISC_NOT_DELEGATED));
    assert!(message.contains("cgroup.subtree_control"), "{message}");
    let t = s.tdx.expect("tdx");
    assert_eq!((t.pods_used, t.external, t.free), (2, 1, 12));
    agent.stop().await;
}

#[tokio::test]
async fn host_without_tee_hardware_keeps_running() {
    let api = FakeApiServer::new();
    api.create(&teeguard_tests::fixtures::node(NODE))
        .expect("node");
    let empty = tempfile::tempdir().expect("tempdir");
    let agent = Agent::start(&api, empty.path(), config(""));
    let s = agent
        .wait_status("no hardware", |s| s.condition(ct::TEE_HARDWARE).is_some())
        .await;
    let (status, reason, message) = cond(&s, ct::TEE_HARDWARE);
    assert_eq!((status, reason), ("False", reasons::NO_TEE_HARDWARE));
    assert!(message.contains("no misc cgroup controller"), "{message}");
    assert!(s.kinds().next().is_none());
    assert!(
        agent.readiness.is_ready(),
        "{:?}",
        agent.readiness.pending()
    );

    // Hardware shows up later (the controller gets mounted): picked up by the next polls.
    let host = SimHost::builder()
        .capacity(TDX, 8)
        .in_dir(empty.path())
        .build()
        .expect("host");
    agent
        .wait_status("hardware found", |s| tdx_is(s, |t| t.capacity == 8))
        .await;
    assert!(!agent.task.is_finished());
    drop(host);
    agent.stop().await;
}

#[tokio::test]
async fn heartbeats_renew_the_lease_and_leave_the_unchanged_report_untouched() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let (host, _) = busy_host(&api);
    let cfg = teeguard_shared::Config::from_yaml(
        "agent:\n  pollInterval: 50ms\n  heartbeatInterval: 200ms\n",
    )
    .expect("cfg");
    let agent = Agent::start(&api, host.root(), cfg);
    let first = agent.wait_status("published", |s| s.tdx.is_some()).await;
    let renewed = |api: &FakeApiServer| {
        api.get_typed::<k8s_openapi::api::coordination::v1::Lease>(Some("default"), NODE)
            .ok()
            .flatten()
            .and_then(|l| l.spec?.renew_time)
    };
    let one = api
        .wait_for(WAIT, "the heartbeat Lease", |api| renewed(api))
        .await
        .expect("lease");
    api.wait_for(WAIT, "the Lease renewed again", |api| {
        renewed(api).filter(|t| t.0 > one.0)
    })
    .await
    .expect("renewed");
    assert_eq!(
        agent.status().expect("report"),
        first,
        "the report (its heartbeatTime and conditions' transition times) is not re-written"
    );
    agent.stop().await;
}

#[tokio::test]
async fn shutdown_finishes_the_in_flight_publish() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let (host, uids) = busy_host(&api);
    let agent = Agent::start(&api, host.root(), config(""));
    agent
        .wait_status("published", |s| tdx_is(s, |t| t.kernel_used == 6))
        .await;

    // Slow down status applies, change a figure, and ask to stop while the apply is in flight.
    api.add_fault(
        FaultRule::delay(Duration::from_millis(700))
            .verb(Verb::Patch)
            .resource("teecapacities")
            .subresource("status"),
    );
    api.clear_requests();
    host.stop_vm(&uids[0], "compute", TDX).expect("stop");
    let in_flight = api
        .wait_for(WAIT, "a status apply in flight", |api| {
            api.requests_where(|r| {
                r.verb == Verb::Patch
                    && r.resource.as_deref() == Some("teecapacities")
                    && r.response_code.is_none()
            })
            .into_iter()
            .next()
        })
        .await
        .expect("in flight");
    agent.shutdown.cancel();
    tokio::time::timeout(WAIT, agent.task)
        .await
        .expect("stops")
        .expect("no panic")
        .expect("ok");
    let answered = api
        .requests_where(|r| r.seq == in_flight.seq)
        .pop()
        .expect("recorded");
    assert_eq!(
        answered.response_code,
        Some(200),
        "the in-flight publish completed"
    );
    let s = api
        .get_typed::<TeeCapacity>(None, NODE)
        .expect("typed")
        .and_then(|t| t.status)
        .expect("status");
    assert_eq!(s.tdx.expect("tdx").kernel_used, 5);
}

#[tokio::test]
async fn a_wiped_extended_resource_is_restored() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let (host, _) = busy_host(&api);
    let agent = Agent::start(&api, host.root(), config(""));
    agent
        .wait_node("advertised", |n| {
            node_capacity(n, TDX_KEYS).as_deref() == Some("14")
        })
        .await;
    // The kubelet re-registers the node and drops extended resources it does not manage.
    api.modify("nodes", None, NODE, |n| {
        for field in ["capacity", "allocatable"] {
            if let Some(m) = n["status"][field].as_object_mut() {
                m.remove(TDX_KEYS);
            }
        }
    })
    .expect("wipe");
    agent
        .wait_node("restored", |n| {
            node_capacity(n, TDX_KEYS).as_deref() == Some("14")
                && node_allocatable(n, TDX_KEYS).as_deref() == Some("14")
        })
        .await;
    agent.stop().await;
}

#[tokio::test]
async fn nothing_is_published_for_a_missing_node_until_it_appears() {
    let api = FakeApiServer::new();
    let (host, _) = busy_host(&api);
    let agent = Agent::start(&api, host.root(), config(""));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(agent.status().is_none());
    assert_eq!(api.count("teecapacities"), 0);
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    agent
        .wait_status("published once the Node exists", |s| {
            tdx_is(s, |t| t.free == 10)
        })
        .await;
    agent.stop().await;
}
