//! The KubeVirt scenarios: VMIs as users write them, KubeVirt's own controller rendering their launcher
//! pods, teeguard admitting, the scheduler placing and the real kubelets and containerd starting them.

use kube::ResourceExt;
use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use teeguard_tests::fixtures::Tee;
use teeguard_tests::kubevirt::vmis::Size;

use super::{KubeVirtWorld, Options, TeeNode};

/// The longest a scenario may take.
pub const DEADLINE: Duration = Duration::from_secs(600);

/// The extended resource and `misc.max` line teeguard gives a VM of kind `tee`.
pub fn key_of(tee: Tee) -> (&'static str, &'static str) {
    match tee {
        Tee::Tdx => ("tdx.intel.com/keys", "tdx 1"),
        Tee::Sev => ("sev.amd.com/asids", "sev 1"),
        _ => ("sev-snp.amd.com/esids", "sev_es 1"),
    }
}

pub use teeguard_tests::node::limits;

/// The amount of `resource` the pod's `compute` container requests.
pub fn compute_request(pod: &Pod, resource: &str) -> Option<String> {
    pod.spec
        .as_ref()?
        .containers
        .iter()
        .find(|c| c.name == "compute")?
        .resources
        .as_ref()?
        .requests
        .as_ref()?
        .get(resource)
        .map(|q| q.0.clone())
}

/// `got` (each container's `misc.max` as handed to runc, `-` for none) has `line` on `compute` and
/// nothing on any other container.
pub fn assert_only_compute_limited(got: &BTreeMap<String, String>, line: &str, what: &str) {
    let want: BTreeMap<String, String> = got
        .keys()
        .map(|c| {
            let l = if c == "compute" { line } else { "-" };
            (c.clone(), l.to_string())
        })
        .collect();
    assert!(got.contains_key("compute"), "{what}: {got:?}");
    assert_eq!(got, &want, "{what}: misc.max per container handed to runc");
}

/// A VMI of each kind (`vmi-<kind>`, of `size`), created together; each launcher pod, once running,
/// with its VMI's name, kind and node, after checking that it runs on the node of its kind with one
/// key requested on `compute` (teeguard's patch).
pub async fn one_of_each_kind_running(
    w: &KubeVirtWorld,
    size: Size,
) -> Vec<(String, Tee, &TeeNode, Pod)> {
    let kinds = [Tee::Tdx, Tee::Snp, Tee::SevEs, Tee::Sev];
    for tee in kinds {
        w.create_vmi(&format!("vmi-{}", tee.slug()), tee, size)
            .await;
    }
    let mut running = Vec::new();
    for tee in kinds {
        let name = format!("vmi-{}", tee.slug());
        let pod = w.wait_running(&name).await;
        let node = w.node_for(tee);
        assert_eq!(
            pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
            Some(node.name()),
            "{name} ran on the node of its kind"
        );
        assert_eq!(
            compute_request(&pod, key_of(tee).0).as_deref(),
            Some("1"),
            "{name}: teeguard added one key to compute"
        );
        running.push((name, tee, node, pod));
    }
    running
}

/// Wait until `node`'s report counts the pod of VMI `name`.
pub async fn wait_counted(w: &KubeVirtWorld, node: &TeeNode, name: &str, pod: &Pod) {
    let uid = pod.metadata.uid.clone().expect("uid");
    w.wait_report(
        node,
        &format!("counts {name}'s pod"),
        Duration::from_secs(30),
        |r| r.counted_pods.contains(&uid),
    )
    .await;
}

/// Scenario 1 (extended resources): a TDX, an SNP, an SEV-ES and a plain SEV VMI each become
/// virt-controller's launcher pod, get their key request from teeguard, are placed on the node of their
/// kind and started there with `misc.max` of one key on `compute` only; each node's report counts its
/// pods.
pub async fn each_kind_runs_limited_on_its_node() {
    let Some(w) = KubeVirtWorld::start("kv-each-kind", Options::keys(2, 2)).await else {
        return;
    };
    for (name, tee, node, pod) in one_of_each_kind_running(&w, Size::SAMPLE).await {
        let got = limits(&w.records(node, &pod).await);
        let want: BTreeMap<String, String> = [
            ("compute", key_of(tee).1),
            ("guest-console-log", "-"),
            ("volumecontainerdisk", "-"),
        ]
        .into_iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
        assert_eq!(
            got, want,
            "{name}: misc.max per container as containerd handed it to runc"
        );
        wait_counted(&w, node, &name, &pod).await;
    }
}

/// Exploration: what a user sees on a full node today, and how long a waiting VMI takes to start once
/// the key frees.
pub async fn explore_full_node() {
    let Some(w) = KubeVirtWorld::start("kv-explore", Options::keys(1, 1)).await else {
        return;
    };
    w.create_vmi("vm-a", Tee::Tdx, Size::SAMPLE).await;
    w.wait_running("vm-a").await;
    w.create_vmi("vm-b", Tee::Tdx, Size::SAMPLE).await;
    let wait = std::env::var("EXPLORE_WAIT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    tokio::time::sleep(Duration::from_secs(wait)).await;
    eprintln!("=== after {wait}s:\n{}", w.describe("vm-b").await);
    let vmi = w.vmi("vm-b").await.expect("vmi");
    eprintln!(
        "=== vmi status: {}",
        serde_json::to_string_pretty(&vmi.data["status"]).unwrap_or_default()
    );
    let a = w.launchers("vm-a").await;
    let pods: kube::Api<Pod> = kube::Api::namespaced(w.cluster.client.clone(), &w.ns);
    for p in a {
        pods.delete(
            p.metadata.name.as_deref().unwrap_or(""),
            &Default::default(),
        )
        .await
        .ok();
    }
    let vmis =
        teeguard_tests::kubevirt::vmis::api(&w.cluster.client, &w.ns, "VirtualMachineInstance");
    vmis.delete("vm-a", &Default::default()).await.ok();
    let t = std::time::Instant::now();
    w.wait_report(&w.tdx, "a free key", Duration::from_secs(60), |r| {
        r.tdx.as_ref().is_some_and(|k| k.free == 1)
    })
    .await;
    let free_at = t.elapsed();
    w.wait_running("vm-b").await;
    eprintln!(
        "=== key free after {free_at:?}, vm-b running after {:?}",
        t.elapsed()
    );
    eprintln!("=== finally:\n{}", w.describe("vm-b").await);
}

/// Exploration: what happens to launcher pods when their VMIs are deleted.
pub async fn explore_deletion() {
    let Some(w) = KubeVirtWorld::start("kv-explore-del", Options::keys(2, 2)).await else {
        return;
    };
    for n in ["d-0", "d-1"] {
        w.create_vmi(n, Tee::Tdx, Size::SMALL).await;
    }
    for n in ["d-0", "d-1"] {
        w.wait_running(n).await;
    }
    let vmis =
        teeguard_tests::kubevirt::vmis::api(&w.cluster.client, &w.ns, "VirtualMachineInstance");
    for n in ["d-0", "d-1"] {
        vmis.delete(n, &Default::default()).await.ok();
    }
    let t = std::time::Instant::now();
    let pods: kube::Api<Pod> = kube::Api::namespaced(w.cluster.client.clone(), &w.ns);
    let mut last = String::new();
    while t.elapsed() < Duration::from_secs(90) {
        let list = match pods.list(&Default::default()).await {
            Ok(l) => l
                .items
                .iter()
                .map(|p| {
                    format!(
                        "{}:{:?}:{}",
                        p.metadata.name.as_deref().unwrap_or(""),
                        p.status.as_ref().and_then(|s| s.phase.clone()),
                        p.metadata.deletion_timestamp.is_some()
                    )
                })
                .collect::<Vec<_>>()
                .join(" "),
            Err(e) => format!("ERR {e}"),
        };
        let v: Vec<String> = vmis
            .list(&Default::default())
            .await
            .map(|l| {
                l.items
                    .iter()
                    .map(|v| {
                        format!(
                            "{}:{}",
                            v.metadata.name.as_deref().unwrap_or(""),
                            v.data["status"]["phase"]
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let r = w
            .report(&w.tdx)
            .await
            .and_then(|r| r.tdx)
            .map(|k| format!("free {} pending {} used {}", k.free, k.pending, k.pods_used))
            .unwrap_or_default();
        let line = format!("pods [{list}] vmis {v:?} report {r}");
        if line != last {
            eprintln!("{:>6.1}s {line}", t.elapsed().as_secs_f64());
            last = line;
        }
        if list.is_empty() && v.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Scenario 5: KubeVirt's `defaultRuntimeClass` names a RuntimeClass whose `overhead.podFixed` carries
/// the TDX key (as kata-deploy renders them). The API server copies it into the launcher pod's
/// `spec.overhead` before any webhook; teeguard takes it as the VM's key: no second request on
/// `compute`, the annotation says one key, `compute` gets `misc.max` `tdx 1`, the node's report counts
/// one key, and with one key on the node a second VMI is refused.
pub async fn overhead_key_is_counted_once() {
    let Some(w) = KubeVirtWorld::start("kv-overhead", Options::keys(1, 0)).await else {
        return;
    };
    w.ensure_kata_runtime_class().await;
    w.kv.configure(
        &w.cluster.client,
        serde_json::json!({"defaultRuntimeClass": super::full::KATA_TDX}),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    runs_with_the_overhead_key_only(&w, "vmi-kata-rc").await;
    w.create_vmi("vmi-second", Tee::Tdx, Size::SMALL).await;
    w.wait_refused("vmi-second", 1).await;
    assert!(w.launchers("vmi-second").await.is_empty());
}

/// With `defaultRuntimeClass` naming [`super::full::KATA_TDX`] (its key in the overhead): TDX VMI
/// `name` runs with that key as its only one (none on `compute`, the annotation and `misc.max` say one
/// key) and the TDX node's report counts one key for it.
pub async fn runs_with_the_overhead_key_only(w: &KubeVirtWorld, name: &str) {
    w.create_vmi(name, Tee::Tdx, Size::SMALL).await;
    let pod = w.wait_running(name).await;
    let spec = pod.spec.as_ref().expect("spec");
    assert_eq!(
        spec.runtime_class_name.as_deref(),
        Some(super::full::KATA_TDX)
    );
    assert_eq!(
        spec.overhead
            .as_ref()
            .and_then(|o| o.get("tdx.intel.com/keys"))
            .map(|q| q.0.as_str()),
        Some("1"),
        "the RuntimeClass's key is in the pod overhead"
    );
    assert_eq!(
        compute_request(&pod, "tdx.intel.com/keys"),
        None,
        "no second key on compute"
    );
    assert_eq!(
        pod.annotations()
            .get("misc-max.teeguard.dev/compute")
            .map(String::as_str),
        Some("tdx 1")
    );
    let got = limits(&w.records(&w.tdx, &pod).await);
    assert_only_compute_limited(&got, "tdx 1", "the VM");
    let uid = pod.metadata.uid.clone().expect("uid");
    let report = w
        .wait_report(&w.tdx, "counts the pod", Duration::from_secs(30), |r| {
            r.counted_pods.contains(&uid)
        })
        .await;
    let tdx = report.tdx.expect("tdx figures");
    assert_eq!(
        (tdx.pending + tdx.pods_used, tdx.free),
        (1, 0),
        "one key counted for the VM"
    );
}

/// Scenario 1 in DRA mode: the nodes' agents are their DRA drivers; the scheduler allocates the key
/// teeguard's mutation requests through the chart's DeviceClasses (their `extendedResourceName`), the
/// kubelet has the agent prepare it, and `compute` gets `misc.max` from the allocation. A TDX and an SNP
/// VMI run on the node of their kind, each with its claim's device, and end cleanly (the kubelet
/// unprepares the claims while the drivers run).
pub async fn each_kind_runs_with_a_dra_allocated_key() {
    let options = Options {
        dra: true,
        ..Options::keys(2, 2)
    };
    let Some(w) = KubeVirtWorld::start("kv-dra", options).await else {
        return;
    };
    let classes = w.create_device_classes().await;
    for tee in [Tee::Tdx, Tee::Snp] {
        w.create_vmi(&format!("vmi-{}", tee.slug()), tee, Size::SMALL)
            .await;
    }
    for tee in [Tee::Tdx, Tee::Snp] {
        let name = format!("vmi-{}", tee.slug());
        let pod = w.wait_running(&name).await;
        let node = w.node_for(tee);
        assert_eq!(
            pod.spec.as_ref().and_then(|s| s.node_name.as_deref()),
            Some(node.name())
        );
        let claim = pod
            .status
            .as_ref()
            .and_then(|s| s.extended_resource_claim_status.as_ref())
            .map(|c| c.resource_claim_name.clone());
        assert!(
            claim.is_some(),
            "{name}: the scheduler allocated the key through a claim: {:?}",
            pod.status
        );
        let (_, line) = key_of(tee);
        let got = limits(&w.records(node, &pod).await);
        assert_only_compute_limited(&got, line, &name);
    }
    w.end_dra(&classes).await;
}
