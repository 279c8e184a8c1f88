//! DRA mode on the real node: the agent is the DRA driver `tee.teeguard.dev`, the real scheduler
//! allocates its devices through the DeviceClass's `extendedResourceName` (KEP-5004), the real kubelet
//! registers the driver and calls NodePrepareResources before it starts a pod.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::Api;
use kube::api::{ListParams, PostParams};
use serde_json::{Value, json};
use teeguard_shared::TeeCapacity;
use teeguard_tests::fixtures::Tee;
use teeguard_tests::node::pods;
use teeguard_tests::prom::Scrape;

use super::scenarios::DEADLINE;
use super::scenarios::limits;
use super::{NodeWorld, Options, unguarded_namespace};
use teeguard_tests::node::Runtime;
use teeguard_tests::realcluster::{Cluster, advertise, create_or_keep, within};

/// The TDX key resource.
pub const TDX_KEYS: &str = "tdx.intel.com/keys";
/// The DeviceClass the chart creates for TDX (its `extendedResourceName` is [`TDX_KEYS`]).
pub const TDX_CLASS: &str = "tdx.tee.teeguard.dev";

/// One DRA scenario as a test: a world named `test` with `options` on `runtime`, the scenario, then
/// [`end`]; skipped as the world is.
pub async fn run(
    runtime: Runtime,
    test: &str,
    options: Options,
    scenario: impl AsyncFnOnce(&mut NodeWorld),
) {
    within(DEADLINE, async {
        let Some(mut w) = NodeWorld::start(runtime, test, options).await else {
            return;
        };
        scenario(&mut w).await;
        end(&w).await;
    })
    .await;
}

/// End a DRA scenario: delete the node's pods while the agent (the driver) still runs, so the
/// kubelet can unprepare their claims, and wait until they are gone.
pub async fn end(w: &NodeWorld) {
    let pods: Api<Pod> = Api::all(w.cluster.client.clone());
    let on_node = ListParams::default().fields(&format!("spec.nodeName={}", w.turn.name));
    // The test's pods still Pending first: each freed key would let the scheduler bind one.
    let [(label, test)] = w.selector();
    let ours = |p: &Pod| {
        p.spec.as_ref().is_some_and(|s| {
            s.node_name.as_deref() == Some(w.turn.name.as_str())
                || s.node_selector
                    .as_ref()
                    .is_some_and(|n| n.get(label).map(String::as_str) == Some(test))
        })
    };
    let all = pods.list(&ListParams::default()).await.expect("pods").items;
    let (pending, bound): (Vec<Pod>, Vec<Pod>) = all
        .into_iter()
        .filter(ours)
        .partition(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_none()));
    for p in pending.into_iter().chain(bound) {
        let ns = p.metadata.namespace.clone().unwrap_or_default();
        let name = p.metadata.name.clone().unwrap_or_default();
        let _ = w
            .pods_in(&ns)
            .delete(&name, &kube::api::DeleteParams::default().grace_period(1))
            .await;
    }
    let gone = w
        .cluster
        .wait_none_listed(
            "the node's pods gone",
            Duration::from_secs(120),
            &pods,
            &on_node,
        )
        .await;
    if let Err(e) = gone {
        panic!("{e}\n{}", w.diagnostics());
    }
}

/// Create (or keep) the TDX DeviceClass exactly as the chart renders it in DRA mode.
pub async fn ensure_device_class(cluster: &Cluster) {
    let rendered =
        crate::chart_support::render_for(crate::chart_support::DRA_KUBE_VERSION, "dra", &[]);
    let class: k8s_openapi::api::resource::v1::DeviceClass = serde_json::from_value(
        crate::chart_support::find(&rendered, "DeviceClass", TDX_CLASS).clone(),
    )
    .expect("the chart's DeviceClass");
    let classes: Api<k8s_openapi::api::resource::v1::DeviceClass> =
        Api::all(cluster.client.clone());
    create_or_keep(&classes, &class)
        .await
        .unwrap_or_else(|e| panic!("create DeviceClass: {e}"));
}

/// The devices of teeguard's slices for this node, sorted.
pub async fn published(w: &NodeWorld) -> Vec<String> {
    published_on(&w.cluster, &w.turn.name).await
}

/// The devices of teeguard's slices for Node `node`, sorted.
pub async fn published_on(cluster: &Cluster, node: &str) -> Vec<String> {
    let api: Api<ResourceSlice> = Api::all(cluster.client.clone());
    let lp = ListParams::default().fields(&format!(
        "spec.nodeName={node},spec.driver=tee.teeguard.dev"
    ));
    let mut names: Vec<String> = api
        .list(&lp)
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .flat_map(|s| s.spec.devices.unwrap_or_default())
        .map(|d| d.name)
        .collect();
    names.sort();
    names
}

/// The UIDs of teeguard's slices for this node (a slice deleted and applied again has a new one).
pub async fn slice_uids(w: &NodeWorld) -> std::collections::BTreeSet<String> {
    let api: Api<ResourceSlice> = Api::all(w.cluster.client.clone());
    let lp = ListParams::default().fields(&format!(
        "spec.nodeName={},spec.driver=tee.teeguard.dev",
        w.turn.name
    ));
    api.list(&lp)
        .await
        .map(|l| l.items)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|s| s.metadata.uid)
        .collect()
}

/// Wait until the node's slices publish exactly `want` devices.
pub async fn wait_published(w: &NodeWorld, want: usize, timeout: Duration) -> Duration {
    let started = Instant::now();
    let what = format!("{} publishing {want} devices", w.turn.name);
    let got = w
        .cluster
        .wait_for_within(&what, timeout, || async {
            (published(w).await.len() == want).then_some(())
        })
        .await;
    if let Err(e) = got {
        panic!("{e} (now {:?})\n{}", published(w).await, w.diagnostics());
    }
    started.elapsed()
}

/// Wait until the report's condition `type_` is True; returns it.
pub async fn wait_condition_true(
    w: &NodeWorld,
    type_: &str,
    timeout: Duration,
) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    let api: Api<TeeCapacity> = Api::all(w.cluster.client.clone());
    let node = w.turn.name.clone();
    w.cluster
        .wait_for_within(&format!("{type_} True"), timeout, || async {
            let r = api.get(&node).await.ok()?;
            r.status?
                .conditions
                .into_iter()
                .find(|c| c.type_ == type_ && c.status == "True")
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", w.diagnostics()))
}

/// Wait until the report says the kubelet registered the driver.
pub async fn wait_driver_ready(w: &NodeWorld) {
    wait_condition_true(w, "DraDriverReady", Duration::from_secs(30)).await;
}

/// The report's DRA figures for TDX: (published, allocated, withheld).
pub async fn tdx_devices(w: &NodeWorld) -> Option<(u64, u64, u64)> {
    let api: Api<TeeCapacity> = Api::all(w.cluster.client.clone());
    let r = api.get(&w.turn.name).await.ok()?;
    let d = r.status?.tdx?.devices?;
    Some((d.published, d.allocated, d.withheld))
}

/// Wait until the report's TDX device figures are `want`.
pub async fn wait_tdx_devices(w: &NodeWorld, want: (u64, u64, u64)) {
    let got = w
        .cluster
        .wait_for_within(
            &format!("report tdx devices {want:?}"),
            Duration::from_secs(20),
            || async { (tdx_devices(w).await == Some(want)).then_some(()) },
        )
        .await;
    if let Err(e) = got {
        panic!("{e} (now {:?})\n{}", tdx_devices(w).await, w.diagnostics());
    }
}

/// A plain pod in `ns` whose `compute` container requests `n` TDX keys.
pub fn key_pod(w: &NodeWorld, ns: &str, name: &str, n: &str) -> Pod {
    pods::plain(ns, name, &[("compute", &[(TDX_KEYS, n)])], &w.selector())
}

/// The claim the scheduler created for `pod` (from its `status.extendedResourceClaimStatus`).
pub async fn claim_of(w: &NodeWorld, pod: &Pod) -> ResourceClaim {
    let ns = pod.metadata.namespace.clone().expect("namespace");
    let name = pod
        .status
        .as_ref()
        .and_then(|s| s.extended_resource_claim_status.as_ref())
        .map(|s| s.resource_claim_name.clone())
        .unwrap_or_else(|| panic!("pod {:?} has no extended resource claim", pod.metadata.name));
    let claims: Api<ResourceClaim> = Api::namespaced(w.cluster.client.clone(), &ns);
    claims.get(&name).await.expect("the pod's claim")
}

/// The devices a claim's allocation names.
pub fn claim_devices(claim: &ResourceClaim) -> Vec<String> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|r| r.device)
        .collect()
}

/// Pods of `ns` by phase, and the PodScheduled message of the pending ones.
pub async fn phases(w: &NodeWorld, ns: &str) -> (BTreeMap<String, usize>, Vec<String>) {
    let list = w
        .pods_in(ns)
        .list(&ListParams::default())
        .await
        .expect("list pods");
    let mut by_phase = BTreeMap::new();
    let mut messages = Vec::new();
    for p in list.items {
        let status = p.status.unwrap_or_default();
        let phase = status.phase.unwrap_or_default();
        *by_phase.entry(phase.clone()).or_insert(0) += 1;
        if phase == "Pending" {
            messages.extend(
                status
                    .conditions
                    .unwrap_or_default()
                    .into_iter()
                    .filter(|c| c.type_ == "PodScheduled" && c.status == "False")
                    .filter_map(|c| c.message),
            );
        }
    }
    (by_phase, messages)
}

/// Wait until exactly `n` pods of `ns` are Pending, each with the scheduler's message that their
/// claim cannot be allocated (a pod merely not looked at yet is Pending too, without the message).
pub async fn wait_unschedulable(w: &NodeWorld, ns: &str, n: usize) {
    wait_placed(w, ns, None, n, Duration::from_secs(30)).await;
}

/// [`wait_unschedulable`] within `timeout`, and with exactly `running` pods of `ns` Running when given.
pub async fn wait_placed(
    w: &NodeWorld,
    ns: &str,
    running: Option<usize>,
    n: usize,
    timeout: Duration,
) {
    let what = match running {
        Some(r) => format!("{r} Running, {n} Pending: cannot allocate all claims"),
        None => format!("{n} pods Pending: cannot allocate all claims"),
    };
    let got = w
        .cluster
        .wait_for_within(&what, timeout, || async {
            let (by_phase, messages) = phases(w, ns).await;
            let refused = messages
                .iter()
                .filter(|m| m.contains("cannot allocate all claims"))
                .count();
            let running_ok = running.is_none_or(|r| by_phase.get("Running") == Some(&r));
            (running_ok && by_phase.get("Pending") == Some(&n) && refused == n).then_some(())
        })
        .await;
    if let Err(e) = got {
        panic!("{e} (now {:?})\n{}", phases(w, ns).await, w.diagnostics());
    }
}

/// Scenario: a TDX launcher pod (through the webhook) is allocated a device by the real scheduler,
/// the kubelet has the agent prepare it, the pod runs, its compute container gets `tdx 1`; the report
/// shows the device allocated.
pub async fn launcher_allocated_prepared_limited(w: &mut NodeWorld) {
    ensure_device_class(&w.cluster).await;
    wait_published(w, 2, Duration::from_secs(20)).await;
    wait_driver_ready(w).await;
    assert_eq!(
        w.allocatable(TDX_KEYS).await,
        None,
        "DRA mode advertises no extended resource"
    );
    let pod = w
        .create_vm("dra-vm", Tee::Tdx)
        .await
        .unwrap_or_else(|e| panic!("VM refused: {e}\n{}", w.diagnostics()));
    let pod = w.wait_running(&pod).await;
    let claim = claim_of(w, &pod).await;
    let devices = claim_devices(&claim);
    assert_eq!(devices.len(), 1, "one device for one key: {devices:?}");
    assert!(devices[0].starts_with("tdx-"), "{devices:?}");
    assert_eq!(
        limits(&w.records(&pod).await)
            .get("compute")
            .map(String::as_str),
        Some("tdx 1"),
        "the compute container's misc.max as containerd handed it to runc"
    );
    let log = w.agent.proc.log();
    assert!(
        log.contains("\"prepared\"") || log.contains("prepared"),
        "the kubelet called NodePrepareResources: {log}"
    );
    wait_tdx_devices(w, (2, 1, 0)).await;
}

/// Scenario: a pod holding its key only through a claim of its own (a ResourceClaimTemplate of the
/// chart's DeviceClass, used by `compute`; `sidecar` uses none): the scheduler allocates a device,
/// the agent prepares it, and `compute` gets `misc.max` `tdx 1` from the claim's allocation (there
/// is no key request to take it from); `sidecar` gets none (not even strict mode's zero: the pod
/// holds a key).
pub async fn own_claim_limited_by_its_allocation(w: &mut NodeWorld) {
    ensure_device_class(&w.cluster).await;
    wait_published(w, 2, Duration::from_secs(20)).await;
    wait_driver_ready(w).await;
    let templates: Api<k8s_openapi::api::resource::v1::ResourceClaimTemplate> =
        Api::namespaced(w.cluster.client.clone(), &w.ns);
    let template = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
        "metadata": {"name": "tdx-key", "namespace": w.ns},
        "spec": {"spec": {"devices": {"requests": [
            {"name": "key", "exactly": {"deviceClassName": TDX_CLASS}}
        ]}}}
    }))
    .expect("ResourceClaimTemplate");
    templates
        .create(&PostParams::default(), &template)
        .await
        .expect("create the ResourceClaimTemplate");
    let mut pod = pods::plain(
        &w.ns,
        "own-claim",
        &[("compute", &[]), ("sidecar", &[])],
        &w.selector(),
    );
    let spec = pod.spec.as_mut().expect("spec");
    spec.resource_claims = Some(vec![k8s_openapi::api::core::v1::PodResourceClaim {
        name: "tee".into(),
        resource_claim_template_name: Some("tdx-key".into()),
        ..Default::default()
    }]);
    spec.containers[0].resources.get_or_insert_default().claims =
        Some(vec![k8s_openapi::api::core::v1::ResourceClaim {
            name: "tee".into(),
            request: None,
        }]);
    let pod = w.run(&pod).await;
    let claim_name = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|s| s.iter().find(|c| c.name == "tee"))
        .and_then(|c| c.resource_claim_name.clone())
        .expect("the claim made from the template");
    let claims: Api<ResourceClaim> = Api::namespaced(w.cluster.client.clone(), &w.ns);
    let devices = claim_devices(&claims.get(&claim_name).await.expect("the claim"));
    assert_eq!(devices.len(), 1, "{devices:?}");
    let got = limits(&w.records(&pod).await);
    assert_eq!(
        got.get("compute").map(String::as_str),
        Some("tdx 1"),
        "compute's misc.max comes from its claim's allocation: {got:?}"
    );
    assert_eq!(
        got.get("sidecar").map(String::as_str),
        Some("-"),
        "sidecar uses no claim: {got:?}"
    );
    wait_tdx_devices(w, (2, 1, 0)).await;
}

/// Scenario: 50 pods requesting one TDX key each, created at once (past any webhook) for a node with
/// one free key: the scheduler allocates exactly one, which runs; 49 stay Pending with the scheduler's
/// message.
pub async fn fifty_pods_one_key(w: &mut NodeWorld) {
    let w = &*w; // shared by the concurrent creates
    ensure_device_class(&w.cluster).await;
    wait_published(w, 1, Duration::from_secs(20)).await;
    wait_driver_ready(w).await;
    let ns = unguarded_namespace(&w.cluster, "dra-fifty").await;
    let creates = (0..50).map(|i| {
        let pod = key_pod(w, &ns, &format!("p{i:02}"), "1");
        async move { w.create(&pod).await }
    });
    for r in futures::future::join_all(creates).await {
        r.expect("created");
    }
    wait_placed(w, &ns, Some(1), 49, Duration::from_secs(60)).await;
    // Still so a few polls later: nothing else was allocated or started.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (by_phase, _) = phases(w, &ns).await;
    assert_eq!(by_phase.get("Running"), Some(&1), "{by_phase:?}");
    let claims: Api<ResourceClaim> = Api::namespaced(w.cluster.client.clone(), &ns);
    let allocated: Vec<ResourceClaim> = claims
        .list(&ListParams::default())
        .await
        .expect("claims")
        .items
        .into_iter()
        .filter(|c| !claim_devices(c).is_empty())
        .collect();
    assert_eq!(allocated.len(), 1, "exactly one claim allocated");
}

/// Scenario: 50 TDX VMs (VMI + launcher pod, through the webhook) at once for a node with one free key:
/// the scheduler allocates one and the others wait with its message; the webhook refuses nothing (the
/// scheduler's allocation decides, not the webhook's reservations).
pub async fn fifty_vms_one_key(w: &mut NodeWorld) {
    let w = &*w; // shared by the concurrent creates
    ensure_device_class(&w.cluster).await;
    wait_published(w, 1, Duration::from_secs(20)).await;
    wait_driver_ready(w).await;
    let creates = (0..50).map(|i| async move { w.create_vm(&format!("vm{i:02}"), Tee::Tdx).await });
    for r in futures::future::join_all(creates).await {
        r.unwrap_or_else(|e| panic!("a VM refused: {e}\n{}", w.diagnostics()));
    }
    wait_placed(w, &w.ns, Some(1), 49, Duration::from_secs(90)).await;
    // Every replica refused nothing. The API server keeps its connections open, so (as behind a
    // Service) the replicas it reaches are those its connections landed on; together they saw every
    // pod CREATE.
    let mut validated = 0.0;
    for (i, webhook) in std::iter::once(&w.webhook).chain(&w.replicas).enumerate() {
        let metrics = webhook.metrics().await;
        assert!(
            !metrics.contains("outcome=\"denied\""),
            "replica {i} refused nothing: {metrics}"
        );
        validated += Scrape::parse(&metrics).sum(
            "teeguard_webhook_admission_requests_total",
            &[("endpoint", "validate")],
        );
    }
    assert!(
        validated >= 50.0,
        "the replicas validated {validated} requests"
    );
}

/// Scenario: a key held outside Kubernetes shrinks the slice and no new pod gets it; when it goes
/// away the key comes back and a waiting pod runs.
pub async fn outside_key_withheld(w: &mut NodeWorld) {
    ensure_device_class(&w.cluster).await;
    wait_published(w, 2, Duration::from_secs(20)).await;
    wait_driver_ready(w).await;
    let host = w.host.as_ref().expect("simulated host");
    host.add_external("outside-vm", "tdx", 1)
        .expect("external VM");
    wait_published(w, 1, Duration::from_secs(10)).await;
    wait_tdx_devices(w, (1, 0, 1)).await;
    let ns = unguarded_namespace(&w.cluster, "dra-outside").await;
    w.run(&key_pod(w, &ns, "first", "1")).await;
    let second = w
        .create(&key_pod(w, &ns, "second", "1"))
        .await
        .expect("second");
    wait_unschedulable(w, &ns, 1).await;
    host.remove_external("outside-vm")
        .expect("external VM gone");
    wait_published(w, 2, Duration::from_secs(10)).await;
    w.wait_running(&second).await;
}

/// Scenario: a Kata-style pod (a TEE RuntimeClass, whose key the webhook turns into a container
/// request) and a KubeVirt launcher draw from the same pool of 2; a third TEE pod waits.
pub async fn kata_and_launcher_share_the_pool(w: &mut NodeWorld) {
    ensure_device_class(&w.cluster).await;
    wait_published(w, 2, Duration::from_secs(20)).await;
    wait_driver_ready(w).await;
    let rcs: Api<k8s_openapi::api::node::v1::RuntimeClass> = Api::all(w.cluster.client.clone());
    let rc = serde_json::from_value(json!({
        "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
        "metadata": {"name": "kata-qemu-tdx"}, "handler": "runc"
    }))
    .expect("RuntimeClass");
    create_or_keep(&rcs, &rc)
        .await
        .unwrap_or_else(|e| panic!("create RuntimeClass: {e}"));
    let mut kata = pods::plain(&w.ns, "kata", &[("app", &[])], &w.selector());
    kata.spec.as_mut().expect("spec").runtime_class_name = Some("kata-qemu-tdx".into());
    let kata = w
        .create(&kata)
        .await
        .unwrap_or_else(|e| panic!("kata pod refused: {e}\n{}", w.diagnostics()));
    let requests = kata.spec.as_ref().expect("spec").containers[0]
        .resources
        .as_ref()
        .and_then(|r| r.requests.clone())
        .unwrap_or_default();
    assert_eq!(
        requests.get(TDX_KEYS).map(|q| q.0.as_str()),
        Some("1"),
        "the webhook gave the Kata pod a container key request"
    );
    let kata = w.wait_running(&kata).await;
    assert_eq!(claim_devices(&claim_of(w, &kata).await).len(), 1);
    let vm = w.create_vm("dra-vm", Tee::Tdx).await.expect("VM");
    let vm = w.wait_running(&vm).await;
    assert_eq!(claim_devices(&claim_of(w, &vm).await).len(), 1);
    wait_tdx_devices(w, (2, 2, 0)).await;
    let ns = unguarded_namespace(&w.cluster, "dra-third").await;
    w.create(&key_pod(w, &ns, "third", "1"))
        .await
        .expect("third");
    wait_unschedulable(w, &ns, 1).await;
}

/// Scenario: the kubelet restarted (it deletes the node's slices when it starts): the slices are back
/// within one poll of the deletion, the running pod keeps running. The agent restarted: its prepared
/// claims are still known (the report's allocated count, the checkpoint), and the next pod gets the
/// other key, never the one already held.
pub async fn restarts(w: &mut NodeWorld) {
    ensure_device_class(&w.cluster).await;
    wait_published(w, 2, Duration::from_secs(20)).await;
    wait_driver_ready(w).await;
    let ns = unguarded_namespace(&w.cluster, "dra-restarts").await;
    let first = w.run(&key_pod(w, &ns, "first", "1")).await;
    let first_device = claim_devices(&claim_of(w, &first).await);
    wait_tdx_devices(w, (2, 1, 0)).await;

    let before = slice_uids(w).await;
    assert!(!before.is_empty(), "slices published before the restart");
    w.turn.restart_kubelet().await.expect("kubelet restarted");
    // The kubelet deletes the slices as it starts (possibly after it reports Ready); the agent
    // applies them again: wait for slices that are new objects (other UIDs) with both devices.
    let started = Instant::now();
    let what = "the slices the kubelet deleted published again";
    let back = w
        .cluster
        .wait_for_within(what, Duration::from_secs(30), || async {
            let now = slice_uids(w).await;
            (!now.is_empty() && now.is_disjoint(&before) && published(w).await.len() == 2)
                .then_some(())
        })
        .await;
    if let Err(e) = back {
        panic!(
            "{e} (before {before:?}, now {:?})\n{}",
            slice_uids(w).await,
            w.diagnostics()
        );
    }
    eprintln!(
        "slices back {:?} after the kubelet restart",
        started.elapsed()
    );
    let still = w.pods_in(&ns).get("first").await.expect("first");
    assert_eq!(
        still.status.and_then(|s| s.phase).as_deref(),
        Some("Running"),
        "the running pod is unaffected"
    );

    w.restart_agent().await;
    wait_tdx_devices(w, (2, 1, 0)).await;
    let second = w.run(&key_pod(w, &ns, "second", "1")).await;
    let second_device = claim_devices(&claim_of(w, &second).await);
    assert_ne!(first_device, second_device, "no double allocation");
    wait_tdx_devices(w, (2, 2, 0)).await;
}

/// Scenario: another writer puts the key resource in the Node's allocatable: the report's `DraBypassed`
/// condition says DRA is bypassed on this node, and the metric too.
pub async fn bypassed(w: &mut NodeWorld) {
    wait_published(w, 2, Duration::from_secs(20)).await;
    advertise(&w.cluster.client, &w.turn.name, &[(TDX_KEYS, json!("2"))])
        .await
        .expect("another writer advertises the key");
    let got = wait_condition_true(w, "DraBypassed", Duration::from_secs(15)).await;
    assert!(got.message.contains(TDX_KEYS), "{}", got.message);
    assert!(got.message.contains("another writer"), "{}", got.message);
    let metrics = w.agent.metrics().await;
    assert!(
        metrics.contains("teeguard_agent_dra_bypassed{kind=\"tdx\"} 1"),
        "{metrics}"
    );
    advertise(&w.cluster.client, &w.turn.name, &[(TDX_KEYS, Value::Null)])
        .await
        .expect("the writer stops");

    // `teeguard-agent cleanup` after an uninstall removes the node's slices and its report.
    w.agent.proc.kill();
    let cleaned = teeguard_agent::cluster::cleanup::cleanup(
        w.cluster.client.clone(),
        &w.turn.name,
        &teeguard_shared::config::ResourcesConfig::default(),
    )
    .await
    .expect("cleanup");
    assert_eq!(cleaned.slices, 1, "{cleaned}");
    assert!(published(w).await.is_empty(), "no slice left");
}

/// Whether a pod is Running and was never refused by the kubelet (a pod the kubelet no longer admits
/// fails with reason `UnexpectedAdmissionError` or `OutOf<resource>`).
fn still_running(p: &Pod) -> Result<(), String> {
    let status = p.status.clone().unwrap_or_default();
    match (status.phase.as_deref(), status.reason.as_deref()) {
        (Some("Running"), None) => Ok(()),
        (phase, reason) => Err(format!(
            "{:?}: phase {phase:?}, reason {reason:?}, message {:?}",
            p.metadata.name, status.message
        )),
    }
}

/// Scenario: a node switched from extended-resource accounting to DRA and back, with pods running
/// across it. A pod admitted before the switch (no claim) keeps running, its key withheld from the
/// slice; the kubelet restarted in DRA mode re-admits it (the Node no longer advertises the key); a new
/// pod is allocated the other device. Switched back: the agent advertises again and both pods keep
/// running. The pod allocated through DRA can end: the kubelet must unprepare its claim first, which
/// the agent, back in extended-resource accounting, still serves (draining) until no claim is left;
/// then it stops serving the plugin and the kubelet deletes the driver's slices.
pub async fn switch_and_back(w: &mut NodeWorld) {
    ensure_device_class(&w.cluster).await;
    w.wait_allocatable(TDX_KEYS, "2", Duration::from_secs(20))
        .await;
    let ns = unguarded_namespace(&w.cluster, "dra-switch").await;
    let before = w.run(&key_pod(w, &ns, "before", "1")).await;
    assert!(
        before
            .status
            .as_ref()
            .and_then(|s| s.extended_resource_claim_status.as_ref())
            .is_none(),
        "a node that advertises the key bypasses DRA: no claim"
    );

    w.switch_accounting(true).await;
    let gone = w
        .cluster
        .wait_for_within(
            "the key gone from the Node's allocatable",
            Duration::from_secs(20),
            || async { w.allocatable(TDX_KEYS).await.is_none().then_some(()) },
        )
        .await;
    gone.unwrap_or_else(|e| panic!("{e}\n{}", w.diagnostics()));
    wait_published(w, 1, Duration::from_secs(20)).await;
    wait_tdx_devices(w, (1, 0, 1)).await;

    // The kubelet restarted while the pre-switch pod runs: it must admit it again.
    w.turn.restart_kubelet().await.expect("kubelet restarted");
    wait_driver_ready(w).await;
    wait_published(w, 1, Duration::from_secs(30)).await;
    let after = w.run(&key_pod(w, &ns, "after", "1")).await;
    assert_eq!(claim_devices(&claim_of(w, &after).await).len(), 1);
    let now = w.pods_in(&ns).get("before").await.expect("before");
    still_running(&now).unwrap_or_else(|e| {
        panic!(
            "the pre-switch pod after a kubelet restart in DRA mode: {e}\n{}",
            w.diagnostics()
        )
    });
    w.create(&key_pod(w, &ns, "third", "1"))
        .await
        .expect("third");
    wait_unschedulable(w, &ns, 1).await;
    // Gone before a device frees: allocated through DRA later, it could not end after the switch.
    w.pods_in(&ns)
        .delete("third", &kube::api::DeleteParams::default().grace_period(0))
        .await
        .expect("delete third");

    // Back to extended resources: the agent advertises again, both pods keep running.
    w.switch_accounting(false).await;
    w.wait_allocatable(TDX_KEYS, "2", Duration::from_secs(20))
        .await;
    for name in ["before", "after"] {
        let p = w.pods_in(&ns).get(name).await.expect("pod");
        still_running(&p).unwrap_or_else(|e| panic!("after switching back: {e}"));
    }
    // The pod allocated through DRA ends: the kubelet unprepares its claim through the draining
    // driver, which then stops serving the plugin.
    let started = Instant::now();
    w.pods_in(&ns)
        .delete("after", &kube::api::DeleteParams::default().grace_period(1))
        .await
        .expect("delete");
    let ended = w
        .cluster
        .wait_for_within(
            "the DRA-allocated pod gone after switching back",
            Duration::from_secs(60),
            || async {
                w.pods_in(&ns)
                    .get_opt("after")
                    .await
                    .ok()?
                    .is_none()
                    .then_some(())
            },
        )
        .await;
    ended.unwrap_or_else(|e| panic!("{e}\n{}", w.diagnostics()));
    eprintln!(
        "the DRA-allocated pod ended {:?} after its deletion",
        started.elapsed()
    );
    let stopped = w
        .cluster
        .wait_for_within(
            "the draining driver stopping",
            Duration::from_secs(20),
            || async {
                w.agent
                    .proc
                    .log()
                    .contains("the kubelet plugin stops")
                    .then_some(())
            },
        )
        .await;
    stopped.unwrap_or_else(|e| panic!("{e}\n{}", w.diagnostics()));
    let started = Instant::now();
    let wiped = w
        .cluster
        .wait_for_within(
            "the kubelet deleting the driver's slices",
            Duration::from_secs(90),
            || async { published(w).await.is_empty().then_some(()) },
        )
        .await;
    wiped.unwrap_or_else(|e| panic!("{e}\n{}", w.diagnostics()));
    eprintln!(
        "slices deleted {:?} after the plugin stopped",
        started.elapsed()
    );
    let p = w.pods_in(&ns).get("before").await.expect("before");
    still_running(&p).unwrap_or_else(|e| panic!("at the end: {e}"));
}
