//! The simulated host's directory layout: cgroup v1/v2, both kubelet drivers, both runtimes, delegation
//! modes and kernel feature sets.

use std::fs;
use std::path::Path;

use teeguard_tests::Error;
use teeguard_tests::host::{
    CgroupDriver, CgroupVersion, ContainerRuntime, KernelFeatures, MiscDelegation, QosClass,
    SANDBOX, SEV, SEV_ES, SimHost, TDX, container_id,
};

const UID: &str = "8f0c6b1e-4d2a-4e7b-9a55-0c1d2e3f4a5b";
const UID2: &str = "1a2b3c4d-5e6f-4a1b-8c2d-3e4f5a6b7c8d";

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

fn misc_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .expect("read dir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("misc."))
        .collect();
    names.sort();
    names
}

#[test]
fn v2_systemd_containerd_layout_and_root_files() {
    let host = SimHost::builder()
        .capacity(TDX, 31)
        .capacity("sgx_epc", 5)
        .build()
        .expect("host");
    let root = host.root();
    assert_eq!(host.misc_root(), root);
    assert_eq!(read(&root.join("misc.capacity")), "tdx 31\nsgx_epc 5\n");
    assert_eq!(read(&root.join("misc.current")), "tdx 0\nsgx_epc 0\n");
    assert_eq!(read(&root.join("misc.peak")), "tdx 0\nsgx_epc 0\n");
    assert!(
        read(&root.join("cgroup.controllers"))
            .split_whitespace()
            .any(|c| c == "misc")
    );
    assert!(
        read(&root.join("cgroup.subtree_control"))
            .split_whitespace()
            .any(|c| c == "misc")
    );
    // The root has no misc.max / misc.events, like the kernel.
    assert_eq!(
        misc_files(root),
        ["misc.capacity", "misc.current", "misc.peak"]
    );

    let pod = host
        .add_pod(UID, QosClass::Burstable, &["compute", "guest-console-log"])
        .expect("pod");
    let uid_ = UID.replace('-', "_");
    assert_eq!(
        pod,
        root.join(format!(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice"
        ))
    );
    assert_eq!(host.pod_cgroup_path(UID), Some(pod.clone()));
    let compute = host
        .container_cgroup_path(UID, "compute")
        .expect("compute cgroup");
    assert_eq!(
        compute,
        pod.join(format!(
            "cri-containerd-{}.scope",
            container_id(UID, "compute")
        ))
    );
    assert_eq!(container_id(UID, "compute").len(), 64);
    assert!(
        container_id(UID, "compute")
            .chars()
            .all(|c| c.is_ascii_hexdigit())
    );
    assert!(
        host.container_cgroup_path(UID, SANDBOX)
            .expect("sandbox")
            .is_dir()
    );
    assert_eq!(
        misc_files(&compute),
        [
            "misc.current",
            "misc.events",
            "misc.events.local",
            "misc.max",
            "misc.peak"
        ]
    );
    assert_eq!(read(&compute.join("misc.current")), "tdx 0\nsgx_epc 0\n");
    assert_eq!(read(&compute.join("misc.max")), "tdx max\nsgx_epc max\n");
    assert_eq!(
        read(&compute.join("misc.events")),
        "tdx.max 0\nsgx_epc.max 0\n"
    );
    assert_eq!(read(&compute.join("cgroup.subtree_control")), "\n");

    let guaranteed = host
        .add_pod(UID2, QosClass::Guaranteed, &["compute"])
        .expect("pod");
    assert_eq!(
        guaranteed,
        root.join(format!(
            "kubepods.slice/kubepods-pod{}.slice",
            UID2.replace('-', "_")
        ))
    );
    let besteffort = host.pod_cgroup_rel_for("x-y", QosClass::BestEffort);
    assert_eq!(
        besteffort,
        "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-podx_y.slice"
    );
    assert_eq!(host.pod_uids(), [UID2.to_owned(), UID.to_owned()]);
}

#[test]
fn v2_cgroupfs_layouts_for_both_runtimes() {
    for (runtime, dir) in [
        (ContainerRuntime::Containerd, container_id(UID, "compute")),
        (
            ContainerRuntime::CriO,
            format!("crio-{}", container_id(UID, "compute")),
        ),
    ] {
        let host = SimHost::builder()
            .driver(CgroupDriver::Cgroupfs)
            .runtime(runtime)
            .capacity(SEV, 99)
            .capacity(SEV_ES, 410)
            .build()
            .expect("host");
        let root = host.root();
        assert_eq!(host.kubepods_path(), root.join("kubepods"));
        let pod = host
            .add_pod(UID, QosClass::Burstable, &["compute"])
            .expect("pod");
        assert_eq!(pod, root.join(format!("kubepods/burstable/pod{UID}")));
        assert_eq!(
            host.container_cgroup_path(UID, "compute"),
            Some(pod.join(&dir))
        );
        let g = host
            .add_pod(UID2, QosClass::Guaranteed, &["compute"])
            .expect("pod");
        assert_eq!(g, root.join(format!("kubepods/pod{UID2}")));
        // Kernel order: sev before sev_es.
        assert_eq!(read(&root.join("misc.capacity")), "sev 99\nsev_es 410\n");
        assert_eq!(read(&pod.join("misc.current")), "sev 0\nsev_es 0\n");
    }
}

#[test]
fn v2_systemd_crio_scope_names() {
    let host = SimHost::builder()
        .runtime(ContainerRuntime::CriO)
        .capacity(TDX, 4)
        .build()
        .expect("host");
    host.add_pod(UID, QosClass::Burstable, &["compute"])
        .expect("pod");
    let compute = host.container_cgroup_path(UID, "compute").expect("compute");
    assert_eq!(
        compute.file_name().and_then(|n| n.to_str()),
        Some(format!("crio-{}.scope", container_id(UID, "compute")).as_str())
    );
}

#[test]
fn v1_misc_hierarchy_under_misc() {
    let host = SimHost::builder()
        .version(CgroupVersion::V1)
        .capacity(TDX, 15)
        .build()
        .expect("host");
    let misc = host.root().join("misc");
    assert_eq!(host.misc_root(), misc);
    assert_eq!(read(&misc.join("misc.capacity")), "tdx 15\n");
    assert_eq!(read(&misc.join("misc.current")), "tdx 0\n");
    assert!(misc.join("tasks").is_file());
    assert!(misc.join("cgroup.sane_behavior").is_file());
    assert!(!misc.join("cgroup.controllers").exists());
    assert!(!host.root().join("misc.capacity").exists());
    let pod = host
        .add_pod(UID, QosClass::Burstable, &["compute"])
        .expect("pod");
    assert!(pod.starts_with(&misc));
    assert!(pod.ends_with(format!(
        "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice",
        UID.replace('-', "_")
    )));
    host.start_vm(UID, "compute", TDX).expect("charge");
    assert_eq!(read(&pod.join("misc.current")), "tdx 1\n");
    assert_eq!(read(&misc.join("misc.current")), "tdx 1\n");
    assert_eq!(read(&misc.join("kubepods.slice/misc.current")), "tdx 1\n");
}

#[test]
fn v1_rejects_delegation_settings() {
    let err = SimHost::builder()
        .version(CgroupVersion::V1)
        .misc_delegation(MiscDelegation::NotBelowKubepods)
        .build()
        .expect_err("v1 has no delegation");
    assert!(matches!(err, Error::Unsupported(_)), "{err}");
}

#[test]
fn misc_not_delegated_below_kubepods() {
    let host = SimHost::builder()
        .misc_delegation(MiscDelegation::NotBelowKubepods)
        .capacity(TDX, 8)
        .build()
        .expect("host");
    let kubepods = host.kubepods_path();
    assert!(
        kubepods.join("misc.current").is_file(),
        "kubepods itself still has the controller"
    );
    let subtree = read(&kubepods.join("cgroup.subtree_control"));
    assert!(
        !subtree.split_whitespace().any(|c| c == "misc"),
        "{subtree}"
    );
    let pod = host
        .add_pod(UID, QosClass::Burstable, &["compute"])
        .expect("pod");
    let compute = host.container_cgroup_path(UID, "compute").expect("compute");
    for dir in [&pod, &compute, &kubepods.join("kubepods-burstable.slice")] {
        assert!(
            misc_files(dir).is_empty(),
            "{} has misc files",
            dir.display()
        );
        assert!(
            !read(&dir.join("cgroup.controllers"))
                .split_whitespace()
                .any(|c| c == "misc")
        );
    }
    assert!(read(&host.root().join("system.slice/cgroup.controllers")).contains("misc"));
    // Charges land on the nearest cgroup with the controller.
    host.start_vm(UID, "compute", TDX).expect("charge");
    assert_eq!(read(&kubepods.join("misc.current")), "tdx 1\n");
    assert_eq!(read(&host.root().join("misc.current")), "tdx 1\n");
    assert_eq!(host.pod_usage(UID, TDX), 0);
    assert_eq!(host.usage(TDX), 1);
    let err = host
        .set_max(&host.pod_cgroup_rel(UID).expect("rel"), TDX, Some(1))
        .expect_err("not delegated");
    assert!(matches!(err, Error::MiscNotEnabled(_)), "{err}");
    // Removing the pod still releases its key.
    host.remove_pod(UID).expect("remove");
    assert_eq!(read(&host.root().join("misc.current")), "tdx 0\n");
    assert_eq!(read(&kubepods.join("misc.current")), "tdx 0\n");
}

#[test]
fn misc_only_at_root() {
    let host = SimHost::builder()
        .misc_delegation(MiscDelegation::RootOnly)
        .capacity(TDX, 8)
        .build()
        .expect("host");
    let subtree = read(&host.root().join("cgroup.subtree_control"));
    assert!(!subtree.split_whitespace().any(|c| c == "misc"));
    assert!(misc_files(&host.kubepods_path()).is_empty());
    assert!(misc_files(&host.root().join("system.slice")).is_empty());
    host.add_pod(UID, QosClass::Burstable, &["compute"])
        .expect("pod");
    host.start_vm(UID, "compute", TDX).expect("charge");
    assert_eq!(read(&host.root().join("misc.current")), "tdx 1\n");
    assert_eq!(host.misc_enabled(""), Some(true));
    assert_eq!(
        host.misc_enabled(&host.pod_cgroup_rel(UID).expect("rel")),
        Some(false)
    );
}

#[test]
fn old_kernel_has_no_root_current_and_children_sum_to_usage() {
    let host = SimHost::builder()
        .old_kernel()
        .capacity(TDX, 8)
        .build()
        .expect("host");
    let root = host.root();
    assert!(!root.join("misc.current").exists());
    assert!(!root.join("misc.peak").exists());
    assert_eq!(read(&root.join("misc.capacity")), "tdx 8\n");
    host.add_pod(UID, QosClass::Burstable, &["compute"])
        .expect("pod");
    host.add_pod(UID2, QosClass::Guaranteed, &["compute"])
        .expect("pod");
    host.start_vm(UID, "compute", TDX).expect("charge");
    host.start_vm(UID2, "compute", TDX).expect("charge");
    host.add_external("legacy-vm", TDX, 2).expect("external");
    let compute = host.container_cgroup_path(UID, "compute").expect("compute");
    assert!(!compute.join("misc.peak").exists());
    assert!(!compute.join("misc.events.local").exists());
    assert!(compute.join("misc.events").is_file());
    // Usage derived the old way: sum over top-level children.
    let mut sum = 0;
    for entry in fs::read_dir(root).expect("root") {
        let path = entry.expect("entry").path();
        let current = path.join("misc.current");
        if path.is_dir() && current.is_file() {
            let rel = path
                .file_name()
                .and_then(|n| n.to_str())
                .expect("name")
                .to_owned();
            sum += host
                .read_misc(&rel, "misc.current")
                .expect("parse")
                .get(TDX)
                .copied()
                .unwrap_or(0);
        }
    }
    assert_eq!(sum, 4);
    assert_eq!(host.usage(TDX), 4);
}

#[test]
fn kernel_features_are_independent() {
    let kernel = KernelFeatures {
        root_current: true,
        peak: false,
        events_local: true,
    };
    let host = SimHost::builder()
        .kernel(kernel)
        .capacity(TDX, 1)
        .build()
        .expect("host");
    assert!(host.root().join("misc.current").is_file());
    assert!(!host.root().join("misc.peak").exists());
    assert!(host.kubepods_path().join("misc.events.local").is_file());
}

#[test]
fn builds_in_a_given_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let target = dir.path().join("sys/fs/cgroup");
    let host = SimHost::builder()
        .in_dir(&target)
        .capacity(TDX, 2)
        .build()
        .expect("host");
    assert_eq!(host.root(), target);
    assert_eq!(read(&target.join("misc.capacity")), "tdx 2\n");
    drop(host);
    assert!(
        target.join("misc.capacity").is_file(),
        "a given directory is left to its owner"
    );
}

#[test]
fn temporary_directory_is_removed_on_drop() {
    let host = SimHost::builder().capacity(TDX, 2).build().expect("host");
    let root = host.root().to_path_buf();
    assert!(root.is_dir());
    drop(host);
    assert!(!root.exists());
}

#[test]
fn unknown_resources_and_zero_capacity() {
    let host = SimHost::builder()
        .capacity(TDX, 0)
        .capacity(SEV_ES, 3)
        .capacity("sgx_epc", 7)
        .build()
        .expect("host");
    // A resource with capacity 0 is absent from every file; unknown names follow the known ones.
    assert_eq!(
        read(&host.root().join("misc.capacity")),
        "sev_es 3\nsgx_epc 7\n"
    );
    assert_eq!(
        read(&host.root().join("misc.current")),
        "sev_es 0\nsgx_epc 0\n"
    );
    host.add_external("enclave", "sgx_epc", 4)
        .expect("external");
    assert_eq!(
        read(&host.root().join("misc.current")),
        "sev_es 0\nsgx_epc 4\n"
    );
    // Capacity 0: the kernel answers EINVAL before counting anything (Linux 6.1 and 6.12).
    let err = host
        .add_external("td", TDX, 1)
        .expect_err("no tdx capacity");
    assert!(matches!(err, Error::Invalid { .. }), "{err}");
    let err = host
        .add_external("other", "bogus", 1)
        .expect_err("unknown resource");
    assert!(matches!(err, Error::UnknownMiscResource(_)), "{err}");
}
