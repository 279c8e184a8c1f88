//! The scanner: the root files, the kubepods levels, delegation, walk mode, bad files.

use pretty_assertions::assert_eq;
use teeguard_shared::TeeKind;
use teeguard_shared::misc::CgroupLayout;

use super::*;
use crate::decide::attribution::Uids;

const UID: &str = "0e5d9f8c-3b1a-4c2d-9e8f-123456789abc";
const UID_: &str = "0e5d9f8c_3b1a_4c2d_9e8f_123456789abc";

pub(super) fn write(root: &Path, rel: &str, content: &str) {
    let p = root.join(rel);
    std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
    std::fs::write(p, content).expect("write");
}

pub(super) fn scanned(state: HostState) -> HostScan {
    match state {
        HostState::Scanned(s) => s,
        other => panic!("expected a scan, got {other:?}"),
    }
}

#[test]
fn systemd_v2_per_pod() {
    let d = tempfile::tempdir().expect("tempdir");
    let r = d.path();
    write(r, "misc.capacity", "tdx 16\n");
    write(r, "misc.current", "tdx 3\n");
    write(r, "kubepods.slice/cgroup.controllers", "cpu memory misc\n");
    write(r, "kubepods.slice/misc.current", "tdx 2\n");
    write(
        r,
        "kubepods.slice/kubepods-burstable.slice/misc.current",
        "tdx 1\n",
    );
    write(
        r,
        &format!(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/misc.current"
        ),
        "tdx 1\n",
    );
    write(
        r,
        "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podnot_a_uid.slice/misc.current",
        "tdx 0\n",
    );
    write(
        r,
        "kubepods.slice/kubepods-besteffort.slice/misc.current",
        "tdx 0\n",
    );
    let g = "11111111-2222-3333-4444-555555555555";
    write(
        r,
        &format!(
            "kubepods.slice/kubepods-pod{}.slice/misc.current",
            g.replace('-', "_")
        ),
        "tdx 1\n",
    );
    write(r, "system.slice/misc.events", "tdx.max 0\n");

    let mut s = Scanner::new(r);
    let scan = scanned(s.scan(Interest::All).expect("scan"));
    assert_eq!(scan.layout, CgroupLayout::V2);
    assert_eq!(scan.capacity, KindCounts::from_pairs([(TeeKind::Tdx, 16)]));
    assert_eq!(
        scan.kernel_used,
        KindCounts::from_pairs([(TeeKind::Tdx, 3)])
    );
    let pods = scan.pods.expect("pods");
    assert_eq!(
        pods.accounting,
        Accounting::PerPod,
        "{}",
        pods.accounting_reason
    );
    assert_eq!(pods.driver, Some(Driver::Systemd));
    let one = KindCounts::from_pairs([(TeeKind::Tdx, 1)]);
    assert_eq!(
        pods.usage,
        HashMap::from([(UID.to_string(), one), (g.to_string(), one)])
    );
    assert_eq!(
        pods.skipped,
        vec!["kubepods-burstable-podnot_a_uid.slice".to_string()]
    );

    // Only pods of interest are read.
    let interest: Uids = [g.to_string()].into_iter().collect();
    let pods = scanned(s.scan(Interest::Only(&interest)).expect("scan"))
        .pods
        .expect("pods");
    assert_eq!(pods.usage, HashMap::from([(g.to_string(), one)]));
    assert_eq!(pods.pods_read, 1);

    // Nothing of interest: no pod is read at all.
    let none = Uids::default();
    let pods = scanned(s.scan(Interest::Only(&none)).expect("scan"))
        .pods
        .expect("pods");
    assert_eq!(pods.pods_read, 0);
    assert_eq!(pods.accounting, Accounting::PerPod);

    assert_eq!(s.events_dirs(), vec![r.join("system.slice")]);
}

#[test]
fn cgroupfs_v1_per_pod_and_pruning() {
    let d = tempfile::tempdir().expect("tempdir");
    let r = d.path();
    write(r, "misc/misc.capacity", "sev 99\nsev_es 410\n");
    write(r, "misc/misc.current", "sev 1\nsev_es 2\n");
    write(r, "misc/kubepods/misc.current", "sev_es 1\n");
    write(r, "misc/kubepods/besteffort/misc.current", "sev_es 0\n");
    write(
        r,
        &format!("misc/kubepods/besteffort/pod{UID}/misc.current"),
        "garbage that must not be read\n",
    );
    write(r, "misc/kubepods/burstable/misc.current", "sev_es 1\n");
    let b = "22222222-2222-3333-4444-555555555555";
    write(
        r,
        &format!("misc/kubepods/burstable/pod{b}/misc.current"),
        "sev_es 1\n",
    );
    let mut s = Scanner::new(r);
    let scan = scanned(s.scan(Interest::All).expect("scan"));
    assert_eq!(scan.layout, CgroupLayout::V1);
    let pods = scan.pods.expect("pods");
    assert_eq!(pods.driver, Some(Driver::Cgroupfs));
    assert_eq!(pods.problem_count, 0, "{:?}", pods.problems);
    assert_eq!(
        pods.usage,
        HashMap::from([(b.to_string(), KindCounts::from_pairs([(TeeKind::SevEs, 1)]))])
    );
    assert_eq!(pods.pods_read, 1, "besteffort holds nothing and is skipped");
}

#[test]
fn not_delegated_variants() {
    // No misc files under kubepods.
    let d = tempfile::tempdir().expect("tempdir");
    let r = d.path();
    write(r, "misc.capacity", "tdx 16\n");
    write(r, "misc.current", "tdx 2\n");
    write(r, "kubepods.slice/cgroup.controllers", "cpu memory\n");
    let mut s = Scanner::new(r);
    let pods = scanned(s.scan(Interest::All).expect("scan"))
        .pods
        .expect("pods");
    assert_eq!(pods.accounting, Accounting::RunningPods);
    assert!(
        pods.accounting_reason.contains("cgroup.controllers"),
        "{}",
        pods.accounting_reason
    );

    // Controller listed but subtree_control not enabling it further down.
    std::fs::write(r.join("kubepods.slice/cgroup.controllers"), "cpu misc\n").expect("write");
    write(r, "kubepods.slice/misc.current", "tdx 1\n");
    std::fs::create_dir_all(r.join("kubepods.slice/kubepods-burstable.slice")).expect("mkdir");
    let pods = scanned(s.scan(Interest::All).expect("scan"))
        .pods
        .expect("pods");
    assert_eq!(pods.accounting, Accounting::RunningPods);
    assert!(
        pods.accounting_reason
            .contains("kubepods-burstable.slice/misc.current"),
        "{}",
        pods.accounting_reason
    );

    // A pod cgroup without misc.current.
    write(
        r,
        "kubepods.slice/kubepods-burstable.slice/misc.current",
        "tdx 1\n",
    );
    std::fs::create_dir_all(r.join(format!(
        "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
    )))
    .expect("mkdir");
    let pods = scanned(s.scan(Interest::All).expect("scan"))
        .pods
        .expect("pods");
    assert_eq!(pods.accounting, Accounting::RunningPods);
    assert!(
        pods.accounting_reason.contains("has no misc.current"),
        "{}",
        pods.accounting_reason
    );

    // No kubepods at all.
    let d2 = tempfile::tempdir().expect("tempdir");
    write(d2.path(), "misc.capacity", "tdx 16\n");
    let pods = scanned(Scanner::new(d2.path()).scan(Interest::All).expect("scan"))
        .pods
        .expect("pods");
    assert_eq!(pods.accounting, Accounting::RunningPods);
}

#[test]
fn bad_files() {
    let d = tempfile::tempdir().expect("tempdir");
    let r = d.path();
    let mut s = Scanner::new(r);

    // No controller at all: not an error.
    match s
        .scan(Interest::All)
        .expect("no controller is not an error")
    {
        HostState::NoController { message } => {
            assert!(message.contains("no misc cgroup controller"), "{message}")
        }
        other => panic!("{other:?}"),
    }

    // Empty capacity: no kinds, nothing else read.
    write(r, "misc.capacity", "");
    write(r, "misc.current", "garbage garbage garbage\n");
    let scan = scanned(s.scan(Interest::All).expect("empty capacity"));
    assert!(scan.capacity.is_zero() && scan.pods.is_none());

    // Garbage capacity and truncated current are errors naming the file.
    write(r, "misc.capacity", "tdx sixteen\n");
    let e = s.scan(Interest::All).expect_err("garbage capacity");
    assert!(e.to_string().contains("misc.capacity:1"), "{e}");
    write(r, "misc.capacity", "tdx 16\n");
    write(r, "misc.current", "tdx\n");
    let e = s.scan(Interest::All).expect_err("truncated current");
    assert!(e.to_string().contains("misc.current:1"), "{e}");

    // An unreadable pod cgroup (misc.current is a directory) and a malformed one are problems.
    write(r, "misc.current", "tdx 2\n");
    write(r, "kubepods/misc.current", "tdx 2\n");
    std::fs::create_dir_all(r.join(format!("kubepods/pod{UID}/misc.current"))).expect("mkdir");
    let other = "33333333-2222-3333-4444-555555555555";
    write(r, &format!("kubepods/pod{other}/misc.current"), "tdx one\n");
    let pods = scanned(s.scan(Interest::All).expect("scan"))
        .pods
        .expect("pods");
    assert_eq!(pods.accounting, Accounting::PerPod);
    assert_eq!(pods.problem_count, 2, "{:?}", pods.problems);
    assert!(pods.usage.is_empty());
    assert!(
        pods.problems.iter().any(|p| p.contains(UID)),
        "{:?}",
        pods.problems
    );
}

#[test]
fn old_kernel_without_root_current_sums_children() {
    let d = tempfile::tempdir().expect("tempdir");
    let r = d.path();
    write(r, "misc.capacity", "tdx 16\n");
    write(r, "kubepods/misc.current", "tdx 2\n");
    write(r, "machine.slice/misc.current", "tdx 3\n");
    let scan = scanned(Scanner::new(r).scan(Interest::All).expect("scan"));
    assert_eq!(
        scan.kernel_used,
        KindCounts::from_pairs([(TeeKind::Tdx, 5)])
    );
}
