//! The misc controller read from real files: cgroup v2 and v1 layouts, missing files, older kernels
//! without a root `misc.current`, garbage.

use std::fs;
use std::path::Path;

use teeguard_shared::TeeKind;
use teeguard_shared::error::Error;
use teeguard_shared::misc::{CgroupLayout, MiscController};

fn write(path: &Path, content: &str) {
    fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    fs::write(path, content).expect("write");
}

#[test]
fn cgroup_v2_layout() {
    let root = tempfile::tempdir().expect("tempdir");
    write(&root.path().join("misc.capacity"), "tdx 31\n");
    write(&root.path().join("misc.current"), "tdx 4\n");
    let misc = MiscController::locate(root.path()).expect("locate v2");
    assert_eq!(misc.layout(), CgroupLayout::V2);
    assert_eq!(misc.dir(), root.path());
    assert_eq!(
        misc.capacity().expect("capacity").get(TeeKind::Tdx),
        Some(31)
    );
    assert_eq!(misc.current().expect("current").get(TeeKind::Tdx), Some(4));
}

#[test]
fn cgroup_v1_layout() {
    let root = tempfile::tempdir().expect("tempdir");
    write(
        &root.path().join("misc/misc.capacity"),
        "sev 99\nsev_es 410\n",
    );
    write(&root.path().join("misc/misc.current"), "sev 1\nsev_es 7\n");
    // Other v1 controllers sit beside it and must not confuse the lookup.
    fs::create_dir_all(root.path().join("memory")).expect("mkdir");
    let misc = MiscController::locate(root.path()).expect("locate v1");
    assert_eq!(misc.layout(), CgroupLayout::V1);
    assert_eq!(misc.dir(), root.path().join("misc"));
    let cur = misc.current().expect("current");
    assert_eq!(cur.get(TeeKind::Sev), Some(1));
    assert_eq!(cur.get(TeeKind::SevEs), Some(7));
}

#[test]
fn missing_controller_is_a_clear_error() {
    let root = tempfile::tempdir().expect("tempdir");
    let err = MiscController::locate(root.path()).expect_err("no misc files");
    assert!(matches!(err, Error::MiscControllerNotFound { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("misc.capacity") && msg.contains("cgroup v1"),
        "{msg}"
    );
}

#[test]
fn capacity_file_missing_the_sev_line() {
    let root = tempfile::tempdir().expect("tempdir");
    write(&root.path().join("misc.capacity"), "sev_es 410\n");
    write(&root.path().join("misc.current"), "sev_es 0\n");
    let misc = MiscController::locate(root.path()).expect("locate");
    let cap = misc.capacity().expect("capacity");
    assert_eq!(cap.get(TeeKind::Sev), None);
    assert_eq!(cap.get(TeeKind::SevEs), Some(410));
}

#[test]
fn older_kernel_sums_top_level_children() {
    let root = tempfile::tempdir().expect("tempdir");
    write(&root.path().join("misc.capacity"), "tdx 16\n");
    write(&root.path().join("kubepods.slice/misc.current"), "tdx 4\n");
    write(
        &root
            .path()
            .join("kubepods.slice/kubepods-burstable.slice/misc.current"),
        "tdx 4\n",
    );
    write(
        &root.path().join("machine.slice/misc.current"),
        "tdx 2\nsgx_epc 5\n",
    );
    fs::create_dir_all(root.path().join("system.slice")).expect("no misc files here");
    let misc = MiscController::locate(root.path()).expect("locate");
    let cur = misc.current().expect("sum of children");
    assert_eq!(
        cur.get(TeeKind::Tdx),
        Some(6),
        "grandchildren are not double counted"
    );
    assert_eq!(cur.get_name("sgx_epc"), Some(5));
}

#[test]
fn garbage_root_file_names_file_and_line() {
    let root = tempfile::tempdir().expect("tempdir");
    write(
        &root.path().join("misc.capacity"),
        "tdx 31\n\u{7f}ELF garbage here\n",
    );
    let misc = MiscController::locate(root.path()).expect("locate");
    let err = misc.capacity().expect_err("garbage");
    let msg = err.to_string();
    assert!(msg.contains("misc.capacity:2:"), "{msg}");
}

#[test]
fn unreadable_current_is_an_io_error_naming_the_file() {
    let root = tempfile::tempdir().expect("tempdir");
    write(&root.path().join("misc.capacity"), "tdx 31\n");
    // A directory where the file should be gives an I/O error even when running as root.
    fs::create_dir_all(root.path().join("misc.current")).expect("mkdir");
    let misc = MiscController::locate(root.path()).expect("locate");
    let err = misc.current().expect_err("directory instead of file");
    assert!(matches!(err, Error::MiscRead { .. }));
    assert!(err.to_string().contains("misc.current"), "{err}");
}

#[test]
fn per_cgroup_files() {
    let root = tempfile::tempdir().expect("tempdir");
    write(&root.path().join("misc.capacity"), "tdx 31\n");
    write(&root.path().join("kubepods/podabc/misc.current"), "tdx 1\n");
    write(
        &root.path().join("kubepods/podabc/misc.events"),
        "tdx.max 3\n",
    );
    let misc = MiscController::locate(root.path()).expect("locate");
    let pod = Path::new("kubepods/podabc");
    assert_eq!(
        misc.cgroup_current(pod)
            .expect("read")
            .expect("present")
            .get(TeeKind::Tdx),
        Some(1)
    );
    assert_eq!(
        misc.cgroup_current(Path::new("kubepods/none"))
            .expect("read"),
        None
    );
    assert_eq!(
        misc.cgroup_events(pod)
            .expect("read")
            .expect("present")
            .get("tdx"),
        Some(&3)
    );
}
