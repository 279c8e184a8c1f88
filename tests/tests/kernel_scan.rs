//! The kernel's own answers, scenario 1 (issue 37): `teeguard-agent scan` on a real misc cgroup
//! controller (Debian's Linux 6.1 and 6.12 under QEMU, `teeguard_tests::teevm`). Pod-shaped cgroups in
//! the kubelet's cgroupfs layout (containerd's container names) and systemd layout (CRI-O's) hold keys
//! through `holdkeys`, as QEMU in a pod's `compute` container would; a VM outside Kubernetes holds one
//! in a cgroup of its own and a process in the root cgroup one more. The scan's capacity, kernel usage,
//! per-pod attribution, external keys and free keys are held against `fake_tee`'s `usage` (the root's
//! usage, whatever the files show) and the cgroups' own files. Then the misc controller is taken away
//! from below the root (a host whose init does not delegate it): every key is charged to the root.
//! Skipped (one line) without the kit, unless `CI=true`.

mod kernel_support;

use kernel_support::{
    ASIDS, DEADLINE, ESIDS, LAYOUTS, PodCgroup, boot, condition, figure, mkpod, ok, pod, scan,
    top_level_usage, uid, value,
};
use serde_json::Value;
use teeguard_tests::host::{KubeletNames, QosClass, libvirt_vm_cgroup};
use teeguard_tests::realcluster::within;
use teeguard_tests::teevm::shell::Vm;
use teeguard_tests::teevm::{Guest, GuestOptions, Kernel};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scan_on_linux_6_1_gives_the_kernels_figures_per_pod_and_says_the_root_cgroups_keys_are_unseen()
 {
    within(DEADLINE, truth(Kernel::Linux6_1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scan_on_linux_6_12_gives_the_kernels_figures_per_pod_the_root_cgroups_keys_included() {
    within(DEADLINE, truth(Kernel::Linux6_12)).await;
}

/// Capacities `fake_tee` sets.
const SEV: u64 = 6;
const SEV_ES: u64 = 3;

async fn truth(kernel: Kernel) {
    let Some(g) = boot(
        kernel,
        GuestOptions {
            agent: true,
            ..GuestOptions::default()
        },
    )
    .await
    else {
        return;
    };
    ok(&g, g.load_fake_tee(SEV, SEV_ES).await);
    // A process in the root cgroup holding one sev key for the whole test.
    let root_vm = ok(&g, g.start_vm("root-vm", "", "sev", 1).await);
    assert_eq!(root_vm.answers, ["ok"], "the root cgroup's VM");

    for (i, names) in LAYOUTS.into_iter().enumerate() {
        layout(&g, kernel, names, 10 * (i as u32 + 1)).await;
    }
    not_delegated(&g, kernel).await;
}

/// One kubelet layout: four pods and a VM outside Kubernetes, scanned and held against the kernel.
async fn layout(g: &Guest, kernel: Kernel, names: KubeletNames, n: u32) {
    let what = format!("{kernel}, {names:?}");
    let (a, b, c, d) = (uid(n), uid(n + 1), uid(n + 2), uid(n + 3));
    // a: a plain SEV VM (requests one sev key, holds it); b: an SNP VM, Guaranteed (sev_es);
    // c: requests a sev key, its VM not started yet (pending); d: requests nothing, yet its container
    // holds a sev key (the scheduler never counted it: external).
    let pa = mkpod(g, names, QosClass::Burstable, &a).await;
    let pb = mkpod(g, names, QosClass::Guaranteed, &b).await;
    let pc = mkpod(g, names, QosClass::BestEffort, &c).await;
    let pd = mkpod(g, names, QosClass::Burstable, &d).await;
    let outside = libvirt_vm_cgroup(1, "legacy");
    ok(g, g.mkcgroup(&outside).await);
    let vms: Vec<Vm> = vec![
        ok(g, g.start_vm(&format!("a{n}"), &pa.compute, "sev", 1).await),
        ok(
            g,
            g.start_vm(&format!("b{n}"), &pb.compute, "sev_es", 1).await,
        ),
        ok(g, g.start_vm(&format!("d{n}"), &pd.compute, "sev", 1).await),
        ok(g, g.start_vm(&format!("x{n}"), &outside, "sev", 1).await),
    ];
    for vm in &vms {
        assert_eq!(vm.answers, ["ok"], "{what}: VM in {}", vm.cgroup);
    }
    let pods = vec![
        pod("vms", "a", &a, "Running", &[(ASIDS, 1)], &[]),
        pod("vms", "b", &b, "Running", &[(ESIDS, 1)], &[]),
        pod("vms", "c", &c, "Pending", &[(ASIDS, 1)], &[]),
        pod("vms", "d", &d, "Running", &[], &[]),
    ];
    let report = scan(g, &pods).await;
    let status = &report["status"];
    let requests: [(&PodCgroup, &str, &str, u64); 3] = [
        (&pa, a.as_str(), "sev", 1),
        (&pb, b.as_str(), "sev_es", 1),
        (&pc, c.as_str(), "sev", 1),
    ];
    for kind in ["sev", "sev_es"] {
        check_kind(g, kernel, status, kind, &requests, &what).await;
    }
    // The figures the kernel's files give, spelled out: four sev keys are held (a, d, the VM outside
    // Kubernetes and the root cgroup's process), one sev_es key (b); c waits for one sev key.
    let sev = |f| figure(status, "sev", f);
    let got = (
        sev("kernelUsed"),
        sev("podsUsed"),
        sev("external"),
        sev("pending"),
        sev("free"),
    );
    // On 6.1 the root cgroup's key is in no file: one key fewer is seen used, one more free.
    let want = if kernel.root_current() {
        (4, 1, 3, 1, 1)
    } else {
        (3, 1, 2, 1, 2)
    };
    assert_eq!(got, want, "{what}: {status:#}");
    let es = |f| figure(status, "sev_es", f);
    assert_eq!(
        (
            es("kernelUsed"),
            es("podsUsed"),
            es("external"),
            es("pending"),
            es("free")
        ),
        (1, 1, 0, 0, 2),
        "{what}: {status:#}"
    );
    // Per pod: what each pod cgroup's misc.current says, the pods that request nothing included.
    for (cg, uid) in [(&pa, &a), (&pb, &b), (&pc, &c), (&pd, &d)] {
        let current = ok(g, g.read_cgroup(&cg.pod, "misc.current").await);
        let row = pod_row(&report, uid);
        for kind in ["sev", "sev_es"] {
            let held = row["holds"][kind].as_u64().unwrap_or(0);
            assert_eq!(
                held,
                value(&current, kind),
                "{what}: pod {uid} {kind}: {row}"
            );
        }
    }
    assert_eq!(pod_row(&report, &d)["holds"]["sev"], 1, "{what}");
    assert_eq!(
        pod_row(&report, &d)["requests"],
        serde_json::json!({}),
        "{what}"
    );
    let (status_, reason, message) = condition(status, "KernelReadable");
    assert_eq!(status_, "True", "{what}");
    if kernel.root_current() {
        assert_eq!(reason, "Scanned", "{what}: {message}");
    } else {
        assert_eq!(reason, "RootUsageNotShown", "{what}: {message}");
        assert!(
            message.contains("keys held by processes in the root cgroup itself are not counted"),
            "{what}: {message}"
        );
    }
    let (per_pod, _, message) = condition(status, "PerPodAccounting");
    assert_eq!(per_pod, "True", "{what}: {message}");

    for vm in &vms {
        ok(g, g.stop_vm(vm).await);
    }
    ok(g, g.rm_cgroup_tree(&names.kubepods()).await);
    ok(g, g.rm_cgroup_tree("machine.slice").await);
}

/// Per kind: the scan against the kernel's files and `fake_tee`'s usage, by the report's definitions
/// (`external = kernelUsed − podsUsed`, `free = capacity − kernelUsed − pending`).
async fn check_kind(
    g: &Guest,
    kernel: Kernel,
    status: &Value,
    kind: &str,
    requests: &[(&PodCgroup, &str, &str, u64)],
    what: &str,
) {
    let what = format!("{what}, {kind}");
    let capacity = value(&ok(g, g.read_cgroup("", "misc.capacity").await), kind);
    assert_eq!(figure(status, kind, "capacity"), capacity, "{what}");
    let truth = ok(g, g.usage_of(kind).await);
    let root_files = ok(g, g.misc_files("").await);
    let seen = if kernel.root_current() {
        assert_eq!(
            root_files,
            ["misc.capacity", "misc.current", "misc.peak"],
            "{what}: the root's misc files"
        );
        let root = value(&ok(g, g.read_cgroup("", "misc.current").await), kind);
        assert_eq!(
            root, truth,
            "{what}: the root's misc.current is fake_tee's usage"
        );
        root
    } else {
        assert_eq!(
            root_files,
            ["misc.capacity"],
            "{what}: the root's misc files"
        );
        let top = top_level_usage(g, kind).await;
        let in_root = if kind == "sev" { 1 } else { 0 };
        assert_eq!(
            top,
            truth - in_root,
            "{what}: the top-level cgroups hold all but the root cgroup's keys"
        );
        top
    };
    assert_eq!(
        figure(status, kind, "kernelUsed"),
        seen,
        "{what}: {status:#}"
    );
    let mut held = 0;
    let mut pending = 0;
    for (cg, _, request_kind, request) in requests {
        if *request_kind != kind {
            continue;
        }
        let current = value(&ok(g, g.read_cgroup(&cg.pod, "misc.current").await), kind);
        held += current.min(*request);
        pending += request - current.min(*request);
    }
    assert_eq!(figure(status, kind, "podsUsed"), held, "{what}: {status:#}");
    assert_eq!(
        figure(status, kind, "pending"),
        pending,
        "{what}: {status:#}"
    );
    assert_eq!(
        figure(status, kind, "external"),
        seen - held,
        "{what}: {status:#}"
    );
    assert_eq!(
        figure(status, kind, "free"),
        capacity.saturating_sub(seen).saturating_sub(pending),
        "{what}: {status:#}"
    );
    assert_eq!(
        figure(status, kind, "advertised"),
        capacity - (seen - held),
        "{what}: {status:#}"
    );
}

/// The scan's row for pod `uid`.
fn pod_row<'a>(report: &'a Value, uid: &str) -> &'a Value {
    report["pods"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["uid"] == uid))
        .unwrap_or_else(|| panic!("no row for pod {uid} in {:#}", report["pods"]))
}

/// The misc controller taken away from below the root (its `cgroup.subtree_control`): the pods' and
/// the outside VM's keys are charged to the root cgroup. 6.12 still shows them in the root's
/// `misc.current`; 6.1 shows them nowhere, and the scan counts the running pods' keys as a floor.
async fn not_delegated(g: &Guest, kernel: Kernel) {
    let what = format!("{kernel}, misc not delegated");
    ok(
        g,
        g.sh("echo -misc >/sys/fs/cgroup/cgroup.subtree_control")
            .await,
    );
    let names = LAYOUTS[0];
    let a = uid(90);
    let compute = format!(
        "{}/{}",
        names.pod(QosClass::Burstable, &a),
        names.container_dir(&teeguard_tests::host::container_id(&a, "compute"))
    );
    ok(g, g.mkcgroup_plain(&compute).await);
    let outside = libvirt_vm_cgroup(2, "legacy");
    ok(g, g.mkcgroup_plain(&outside).await);
    let vms = [
        ok(g, g.start_vm("a90", &compute, "sev", 1).await),
        ok(g, g.start_vm("x90", &outside, "sev", 1).await),
    ];
    for vm in &vms {
        assert_eq!(vm.answers, ["ok"], "{what}: VM in {}", vm.cgroup);
    }
    assert!(
        ok(g, g.misc_files(&compute).await).is_empty(),
        "{what}: no misc files below the root"
    );
    let report = scan(g, &[pod("vms", "a", &a, "Running", &[(ASIDS, 1)], &[])]).await;
    let status = &report["status"];
    let truth = ok(g, g.usage_of("sev").await);
    assert_eq!(
        truth, 3,
        "{what}: the pod's, the outside VM's and the root process's keys"
    );
    let sev = |f| figure(status, "sev", f);
    let (_, reason, message) = condition(status, "KernelReadable");
    let (per_pod, _, _) = condition(status, "PerPodAccounting");
    assert_eq!(per_pod, "False", "{what}: {status:#}");
    if kernel.root_current() {
        assert_eq!(reason, "Scanned", "{what}: {message}");
        assert_eq!(
            (
                sev("kernelUsed"),
                sev("podsUsed"),
                sev("external"),
                sev("free")
            ),
            (truth, 1, truth - 1, SEV - truth),
            "{what}: {status:#}"
        );
    } else {
        assert_eq!(reason, "UsageNotShown", "{what}: {message}");
        assert!(
            message.contains("no file shows the usage"),
            "{what}: {message}"
        );
        // The running pod's key is counted; the rest cannot be seen.
        assert_eq!(
            (
                sev("kernelUsed"),
                sev("podsUsed"),
                sev("external"),
                sev("free")
            ),
            (1, 1, 0, SEV - 1),
            "{what}: {status:#}"
        );
    }
    for vm in &vms {
        ok(g, g.stop_vm(vm).await);
    }
}
