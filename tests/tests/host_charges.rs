//! Charges in the simulated host: hierarchical sums at every level, capacity and misc.max refusals with
//! the kernel's misc.events accounting, VM/external helpers, capacity changes.

use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::sync::Arc;

use teeguard_tests::Error;
use teeguard_tests::host::{
    CgroupDriver, CgroupVersion, QosClass, SANDBOX, SEV, SEV_ES, SimHost, TDX,
    docker_container_cgroup, parse_misc,
};

const A: &str = "0a0a0a0a-1111-4222-8333-444455556666";
const B: &str = "0b0b0b0b-1111-4222-8333-444455556666";
const C: &str = "0c0c0c0c-1111-4222-8333-444455556666";

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn misc(path: &Path) -> BTreeMap<String, u64> {
    parse_misc(&read(path)).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Walk the on-disk tree; for every cgroup with `misc.current`, check it equals the sum of its children
/// (all charges in these tests are made in leaves). Returns the number of cgroups checked.
fn assert_hierarchy(dir: &Path, resources: &[&str]) -> usize {
    let mut checked = 0;
    let mut sums: BTreeMap<String, u64> = BTreeMap::new();
    let mut has_children = false;
    for entry in fs::read_dir(dir).expect("read dir") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            checked += assert_hierarchy(&path, resources);
            let current = path.join("misc.current");
            if current.is_file() {
                has_children = true;
                for (k, v) in misc(&current) {
                    *sums.entry(k).or_default() += v;
                }
            }
        }
    }
    let current = dir.join("misc.current");
    if current.is_file() && has_children {
        let own = misc(&current);
        for r in resources {
            assert_eq!(
                own.get(*r).copied().unwrap_or(0),
                sums.get(*r).copied().unwrap_or(0),
                "{} {r} is not the sum of its children",
                dir.display()
            );
        }
        checked += 1;
    }
    checked
}

fn busy_host(version: CgroupVersion, driver: CgroupDriver) -> SimHost {
    let host = SimHost::builder()
        .version(version)
        .driver(driver)
        .capacity(TDX, 10)
        .capacity(SEV, 5)
        .capacity(SEV_ES, 5)
        .build()
        .expect("host");
    host.add_pod(A, QosClass::Burstable, &["compute", "guest-console-log"])
        .expect("pod a");
    host.add_pod(B, QosClass::Guaranteed, &["compute"])
        .expect("pod b");
    host.add_pod(C, QosClass::BestEffort, &["compute"])
        .expect("pod c");
    host.start_vm(A, "compute", TDX).expect("a");
    host.start_vm(A, "compute", TDX).expect("a again");
    host.start_vm(B, "compute", TDX).expect("b");
    host.start_vm(B, "compute", SEV_ES).expect("b es");
    host.start_vm(C, SANDBOX, SEV).expect("kata-like sandbox");
    host.add_external("legacy-td", TDX, 3).expect("libvirt vm");
    host.add_external(&docker_container_cgroup("deadbeef"), SEV_ES, 1)
        .expect("docker");
    host
}

#[test]
fn hierarchical_sums_hold_at_every_level_in_all_layouts() {
    for version in [CgroupVersion::V2, CgroupVersion::V1] {
        for driver in [CgroupDriver::Systemd, CgroupDriver::Cgroupfs] {
            let host = busy_host(version, driver);
            let checked = assert_hierarchy(host.misc_root(), &[TDX, SEV, SEV_ES]);
            assert!(
                checked >= 8,
                "{version:?}/{driver:?}: only {checked} cgroups checked"
            );
            let root = misc(&host.misc_root().join("misc.current"));
            assert_eq!(root.get(TDX), Some(&6));
            assert_eq!(root.get(SEV), Some(&1));
            assert_eq!(root.get(SEV_ES), Some(&2));
            assert_eq!(
                (host.usage(TDX), host.usage(SEV), host.usage(SEV_ES)),
                (6, 1, 2)
            );
            assert_eq!(host.pod_usage(A, TDX), 2);
            assert_eq!(host.pod_usage(B, TDX), 1);
            assert_eq!(host.pod_usage(B, SEV_ES), 1);
            assert_eq!(host.pod_usage(C, SEV), 1);
            assert_eq!(host.free(TDX), 4);
            // Per-pod file agrees with the model.
            let pod = host.pod_cgroup_path(A).expect("a");
            assert_eq!(read(&pod.join("misc.current")), "sev 0\nsev_es 0\ntdx 2\n");

            host.stop_vm(A, "compute", TDX).expect("stop");
            host.remove_pod(B).expect("remove b");
            host.remove_external("legacy-td").expect("remove external");
            assert!(host.pod_cgroup_path(B).is_none());
            assert_hierarchy(host.misc_root(), &[TDX, SEV, SEV_ES]);
            let root = misc(&host.misc_root().join("misc.current"));
            assert_eq!(root.get(TDX), Some(&1));
            assert_eq!(root.get(SEV_ES), Some(&1));
        }
    }
}

#[test]
fn capacity_cannot_be_exceeded_and_a_refusal_at_the_root_leaves_no_trace() {
    let host = SimHost::with_tdx_pod(2, A).expect("host with pod A");
    host.add_pod(B, QosClass::Burstable, &["compute"])
        .expect("b");
    host.start_vm(A, "compute", TDX).expect("first");
    host.add_external("td", TDX, 1).expect("second");
    let err = host.start_vm(B, "compute", TDX).expect_err("host is full");
    assert_eq!(
        err.refusal(),
        Some(("", 3, 2)),
        "refused at the root: {err}"
    );
    assert_eq!(host.usage(TDX), 2);
    assert_eq!(read(&host.root().join("misc.current")), "tdx 2\n");
    // The root has no misc.events; nothing below was over its limit, so every events file stays 0.
    for rel in host.cgroups().into_iter().filter(|r| !r.is_empty()) {
        assert_eq!(host.events(&rel, TDX), 0, "{rel}");
        let events = host.path(&rel).join("misc.events");
        assert_eq!(read(&events), "tdx.max 0\n", "{rel}");
    }
    assert_eq!(
        read(&host.pod_cgroup_path(B).expect("b").join("misc.current")),
        "tdx 0\n"
    );
}

#[test]
fn refusal_below_the_root_bumps_events_up_the_chain() {
    let host = SimHost::with_tdx_pod(8, A).expect("host with pod A");
    let pod = host.pod_cgroup_rel(A).expect("pod rel");
    let compute = host
        .container_cgroup_rel(A, "compute")
        .expect("compute rel");
    host.set_max(&pod, TDX, Some(1)).expect("limit");
    assert_eq!(read(&host.path(&pod).join("misc.max")), "tdx 1\n");
    host.start_vm(A, "compute", TDX).expect("first fits");
    let err = host.start_vm(A, "compute", TDX).expect_err("limit");
    assert!(
        matches!(&err, Error::ChargeRefused { failed_at, .. } if *failed_at == pod),
        "{err}"
    );
    assert_eq!(host.usage(TDX), 1);
    // Events: the refusing cgroup and its ancestors; events.local: the refusing cgroup only.
    assert_eq!(read(&host.path(&pod).join("misc.events")), "tdx.max 1\n");
    assert_eq!(
        read(&host.path(&pod).join("misc.events.local")),
        "tdx.max 1\n"
    );
    assert_eq!(
        read(&host.path(&compute).join("misc.events")),
        "tdx.max 0\n"
    );
    for ancestor in ["kubepods.slice", "kubepods.slice/kubepods-burstable.slice"] {
        assert_eq!(
            read(&host.path(ancestor).join("misc.events")),
            "tdx.max 1\n",
            "{ancestor}"
        );
        assert_eq!(
            read(&host.path(ancestor).join("misc.events.local")),
            "tdx.max 0\n",
            "{ancestor}"
        );
    }
    host.set_max(&pod, TDX, None).expect("unlimit");
    assert_eq!(read(&host.path(&pod).join("misc.max")), "tdx max\n");
    host.start_vm(A, "compute", TDX).expect("fits now");
}

#[test]
fn a_single_cgroup_over_capacity_is_refused_at_its_own_level() {
    // Like misc_cg_try_charge: the walk starts at the charged cgroup, whose new usage already exceeds
    // the capacity, so that cgroup records the failure.
    let host = SimHost::with_tdx_pod(1, A).expect("host with pod A");
    host.start_vm(A, "compute", TDX).expect("first");
    let compute = host.container_cgroup_rel(A, "compute").expect("rel");
    let err = host.start_vm(A, "compute", TDX).expect_err("over capacity");
    assert!(
        matches!(&err, Error::ChargeRefused { failed_at, .. } if *failed_at == compute),
        "{err}"
    );
    assert_eq!(host.events(&compute, TDX), 1);
    assert_eq!(host.events(&host.pod_cgroup_rel(A).expect("pod"), TDX), 1);
    assert_eq!(
        read(&host.path(&compute).join("misc.events")),
        "tdx.max 1\n"
    );
}

#[test]
fn fail_charge_counts_like_the_kernel() {
    let host = SimHost::builder()
        .capacity(SEV_ES, 4)
        .build()
        .expect("host");
    host.add_pod(A, QosClass::Burstable, &["compute"])
        .expect("a");
    host.fail_charge_in(A, "compute", SEV_ES).expect("fail");
    host.fail_charge_in(A, "compute", SEV_ES).expect("fail");
    let compute = host.container_cgroup_path(A, "compute").expect("compute");
    assert_eq!(read(&compute.join("misc.events")), "sev_es.max 2\n");
    assert_eq!(read(&compute.join("misc.events.local")), "sev_es.max 2\n");
    assert_eq!(
        read(&host.pod_cgroup_path(A).expect("pod").join("misc.events")),
        "sev_es.max 2\n"
    );
    assert_eq!(
        read(
            &host
                .pod_cgroup_path(A)
                .expect("pod")
                .join("misc.events.local")
        ),
        "sev_es.max 0\n"
    );
    assert_eq!(host.usage(SEV_ES), 0);
    assert!(matches!(
        host.fail_charge("", "nope"),
        Err(Error::UnknownMiscResource(_))
    ));
    assert!(matches!(
        host.fail_charge("no/such", SEV_ES),
        Err(Error::UnknownCgroup(_))
    ));
}

#[test]
fn peak_keeps_the_high_watermark() {
    let host = SimHost::with_tdx_pod(8, A).expect("host with pod A");
    for _ in 0..3 {
        host.start_vm(A, "compute", TDX).expect("start");
    }
    host.stop_vm(A, "compute", TDX).expect("stop");
    host.stop_vm(A, "compute", TDX).expect("stop");
    assert_eq!(read(&host.root().join("misc.peak")), "tdx 3\n");
    assert_eq!(read(&host.root().join("misc.current")), "tdx 1\n");
    assert_eq!(
        read(&host.pod_cgroup_path(A).expect("pod").join("misc.peak")),
        "tdx 3\n"
    );
}

#[test]
fn stop_without_start_and_unknown_targets_are_errors() {
    let host = SimHost::with_tdx_pod(8, A).expect("host with pod A");
    assert!(matches!(
        host.stop_vm(A, "compute", TDX),
        Err(Error::NotCharged { charged: 0, .. })
    ));
    assert!(matches!(
        host.start_vm(B, "compute", TDX),
        Err(Error::UnknownPod(_))
    ));
    assert!(matches!(
        host.start_vm(A, "nope", TDX),
        Err(Error::UnknownContainer { .. })
    ));
    assert!(matches!(
        host.add_pod(A, QosClass::Burstable, &[]),
        Err(Error::AlreadyExists(_))
    ));
    assert!(matches!(host.remove_pod(B), Err(Error::UnknownPod(_))));
    assert!(matches!(
        host.remove_external("nope"),
        Err(Error::UnknownCgroup(_))
    ));
    host.add_container(A, "hotplug").expect("container");
    host.start_vm(A, "hotplug", TDX)
        .expect("charge new container");
    assert_eq!(host.pod_usage(A, TDX), 1);
}

#[test]
fn external_consumers() {
    let host = SimHost::builder().capacity(TDX, 4).build().expect("host");
    let vm = host.add_external("vm", TDX, 2).expect("vm");
    assert_eq!(
        vm,
        host.root()
            .join("machine.slice/machine-qemu\\x2d1\\x2dvm.scope")
    );
    assert_eq!(read(&vm.join("misc.current")), "tdx 2\n");
    assert_eq!(
        read(&host.root().join("machine.slice/misc.current")),
        "tdx 2\n"
    );
    assert!(matches!(
        host.add_external("vm", TDX, 1),
        Err(Error::AlreadyExists(_))
    ));
    let docker = host
        .add_external(&docker_container_cgroup("abc"), TDX, 1)
        .expect("docker");
    assert_eq!(docker, host.root().join("system.slice/docker-abc.scope"));
    assert_eq!(host.usage(TDX), 3);
    // Over capacity: refused, and the cgroup it would have created is gone again.
    let err = host.add_external("big", TDX, 2).expect_err("full");
    assert!(matches!(err, Error::ChargeRefused { .. }), "{err}");
    assert!(
        !host
            .root()
            .join("machine.slice/machine-qemu\\x2d2\\x2dbig.scope")
            .exists()
    );
    host.remove_external("vm").expect("remove");
    assert!(!vm.exists());
    assert_eq!(read(&host.root().join("misc.current")), "tdx 1\n");
    let second = host.add_external("vm2", TDX, 1).expect("vm2");
    assert_ne!(second, vm, "VM numbers are not reused");
}

#[test]
fn capacity_changes_and_resource_removal() {
    let host = SimHost::builder()
        .capacity(TDX, 4)
        .capacity(SEV, 2)
        .build()
        .expect("host");
    host.add_pod(A, QosClass::Burstable, &["compute"])
        .expect("a");
    host.start_vm(A, "compute", SEV).expect("sev");
    host.set_capacity(TDX, 16).expect("grow");
    assert_eq!(read(&host.root().join("misc.capacity")), "sev 2\ntdx 16\n");
    assert_eq!(host.capacity(TDX), 16);
    host.set_capacity(SEV, 0).expect("zero");
    // Capacity 0 leaves misc.capacity, but usage still shows while keys are held.
    assert_eq!(read(&host.root().join("misc.capacity")), "tdx 16\n");
    assert_eq!(read(&host.root().join("misc.current")), "sev 1\ntdx 0\n");
    assert_eq!(
        read(&host.pod_cgroup_path(A).expect("pod").join("misc.max")),
        "tdx max\n"
    );
    host.remove_resource(SEV).expect("remove");
    let pod = host.pod_cgroup_path(A).expect("pod");
    for file in [
        host.root().join("misc.current"),
        pod.join("misc.current"),
        pod.join("misc.peak"),
    ] {
        assert_eq!(read(&file), "tdx 0\n", "{}", file.display());
    }
    assert_eq!(read(&pod.join("misc.events")), "tdx.max 0\n");
    assert_eq!(host.usage(SEV), 0);
    assert!(matches!(
        host.start_vm(A, "compute", SEV),
        Err(Error::UnknownMiscResource(_))
    ));
}

#[test]
fn shared_between_threads() {
    let host = Arc::new(SimHost::builder().capacity(TDX, 160).build().expect("host"));
    let uids: Vec<String> = (0..8)
        .map(|i| format!("00000000-0000-4000-8000-00000000000{i}"))
        .collect();
    for uid in &uids {
        host.add_pod(uid, QosClass::Burstable, &["compute"])
            .expect("pod");
    }
    let handles: Vec<_> = uids
        .iter()
        .cloned()
        .map(|uid| {
            let host = Arc::clone(&host);
            std::thread::spawn(move || {
                for _ in 0..20 {
                    host.start_vm(&uid, "compute", TDX).expect("start");
                }
                for _ in 0..12 {
                    host.stop_vm(&uid, "compute", TDX).expect("stop");
                }
            })
        })
        .collect();
    for handle in handles {
        handle.join().expect("thread");
    }
    assert_eq!(host.usage(TDX), 64);
    assert_eq!(read(&host.root().join("misc.current")), "tdx 64\n");
    assert_hierarchy(host.root(), &[TDX]);
}
