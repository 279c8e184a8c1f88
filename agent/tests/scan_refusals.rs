//! What the scan says about what the kernel hides or refuses, against the simulated host kept to the
//! real kernels' answers (`tests/tests/kernel_*.rs`): failed charges where `misc.events` counted them,
//! and the usage of kernels without a root `misc.current`.

use k8s_openapi::api::core::v1::Pod;
use serde_json::json;
use teeguard_agent::scan::scan_report;
use teeguard_shared::Config;
use teeguard_shared::crd::RefusedCharges;
use teeguard_shared::names::conditions as ct;
use teeguard_tests::host::{MiscDelegation, QosClass, SimHost, TDX};

const NODE: &str = "node01";

fn uid(n: u32) -> String {
    format!("{n:08x}-1111-4222-8333-444444444444")
}

/// A running pod requesting `keys` TDX keys.
fn pod(n: u32, keys: u32) -> Pod {
    let resources = if keys == 0 {
        json!({})
    } else {
        json!({"requests": {"tdx.intel.com/keys": keys.to_string()}})
    };
    serde_json::from_value(json!({
        "metadata": {"name": format!("pod-{n}"), "namespace": "ns", "uid": uid(n)},
        "spec": {"nodeName": NODE, "containers": [{"name": "compute", "resources": resources}]},
        "status": {"phase": "Running"}
    }))
    .expect("pod")
}

#[test]
fn refusals_are_reported_where_the_kernel_counted_them_in_pods_in_kubepods_and_outside() {
    let host = SimHost::builder().capacity(TDX, 2).build().expect("host");
    for n in 0..3 {
        host.add_pod(&uid(n), QosClass::Burstable, &["compute"])
            .expect("pod");
    }
    let pod0 = host.pod_cgroup_rel(&uid(0)).expect("pod 0");
    host.set_max(&pod0, TDX, Some(1)).expect("limit");
    let pods = [pod(0, 1), pod(1, 1), pod(2, 0)];
    let refused = |host: &SimHost| {
        scan_report(host.root(), &Config::default(), &pods, Some(NODE))
            .status
            .tdx
            .expect("tdx")
            .refused
    };
    assert_eq!(refused(&host), None, "nothing refused yet");

    // Pod 0's second key: its limit.
    host.start_vm(&uid(0), "compute", TDX).expect("first");
    host.start_vm(&uid(0), "compute", TDX)
        .expect_err("the pod's limit");
    // The node full of pods' keys: pod 2's charge is refused at burstable, in no pod.
    host.start_vm(&uid(1), "compute", TDX)
        .expect("the last key");
    host.start_vm(&uid(2), "compute", TDX)
        .expect_err("the node is full");
    // A VM outside Kubernetes, limited in its own cgroup.
    host.add_external("legacy", TDX, 0).expect("external");
    let outside = teeguard_tests::host::libvirt_vm_cgroup(1, "legacy");
    host.set_max(&outside, TDX, Some(0)).expect("limit");
    host.charge(&outside, TDX, 1).expect_err("its limit");
    assert_eq!(
        refused(&host),
        Some(RefusedCharges {
            pods: 1,
            kubepods: 1,
            outside: 1
        })
    );
    let report = scan_report(host.root(), &Config::default(), &pods, Some(NODE));
    let row = |n: u32| {
        report
            .pods
            .iter()
            .find(|r| r.uid == uid(n))
            .map(|r| r.refused.clone())
            .unwrap_or_default()
    };
    assert_eq!(row(0).get(&teeguard_shared::TeeKind::Tdx), Some(&1));
    assert!(row(2).is_empty(), "the node-full refusal is not the pod's");
}

#[test]
fn without_a_root_current_the_report_says_what_it_cannot_see_and_counts_running_pods_when_nothing_shows()
 {
    // Delegated: the top-level cgroups show every key charged below them.
    let host = SimHost::builder()
        .old_kernel()
        .capacity(TDX, 8)
        .build()
        .expect("host");
    host.add_pod(&uid(0), QosClass::Burstable, &["compute"])
        .expect("pod");
    host.start_vm(&uid(0), "compute", TDX).expect("vm");
    let report = scan_report(host.root(), &Config::default(), &[pod(0, 1)], Some(NODE));
    let c = report
        .status
        .condition(ct::KERNEL_READABLE)
        .expect("KernelReadable");
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("True", "RootUsageNotShown")
    );
    assert!(
        c.message.contains("root cgroup itself are not counted"),
        "{}",
        c.message
    );
    assert_eq!(report.status.tdx.expect("tdx").kernel_used, 1);

    // Not enabled below the root: every key lands on the root, which shows nothing on this kernel.
    let host = SimHost::builder()
        .old_kernel()
        .misc_delegation(MiscDelegation::RootOnly)
        .capacity(TDX, 8)
        .build()
        .expect("host");
    for n in 0..2 {
        host.add_pod(&uid(n), QosClass::Burstable, &["compute"])
            .expect("pod");
        host.start_vm(&uid(n), "compute", TDX).expect("vm");
    }
    host.add_external("legacy", TDX, 3).expect("external");
    let report = scan_report(
        host.root(),
        &Config::default(),
        &[pod(0, 1), pod(1, 1)],
        Some(NODE),
    );
    let c = report
        .status
        .condition(ct::KERNEL_READABLE)
        .expect("KernelReadable");
    assert_eq!(c.reason, "UsageNotShown", "{}", c.message);
    let tdx = report.status.tdx.expect("tdx");
    assert_eq!(
        (tdx.kernel_used, tdx.pods_used, tdx.external, tdx.free),
        (2, 2, 0, 6),
        "the running pods' keys, a floor: the 3 held outside are not seen"
    );
}
