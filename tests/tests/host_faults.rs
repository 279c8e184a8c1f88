//! Atomic writes and the simulated host's fault helpers.

use std::fs;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use teeguard_tests::error::running_as_root;

use teeguard_tests::host::{QosClass, SEV, SimHost, TDX, WriteMode, parse_misc};

const A: &str = "0a0a0a0a-1111-4222-8333-444455556666";

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

#[test]
fn concurrent_readers_never_see_partial_files() {
    let host = Arc::new(
        SimHost::builder()
            .capacity(TDX, 1000)
            .capacity(SEV, 1000)
            .build()
            .expect("host"),
    );
    host.add_pod(A, QosClass::Burstable, &["compute"])
        .expect("pod");
    let files = [
        host.root().join("misc.current"),
        host.pod_cgroup_path(A).expect("pod").join("misc.current"),
    ];
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = files
        .iter()
        .cloned()
        .map(|file| {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut reads = 0u64;
                while !stop.load(Ordering::Relaxed) || reads == 0 {
                    let text = fs::read_to_string(&file).expect("read never fails mid-rename");
                    let parsed =
                        parse_misc(&text).unwrap_or_else(|e| panic!("torn read {text:?}: {e}"));
                    assert_eq!(parsed.len(), 2, "both lines always present: {text:?}");
                    reads += 1;
                }
                reads
            })
        })
        .collect();
    for i in 0..250 {
        host.start_vm(A, "compute", if i % 2 == 0 { TDX } else { SEV })
            .expect("start");
    }
    for i in 0..250 {
        host.stop_vm(A, "compute", if i % 2 == 0 { TDX } else { SEV })
            .expect("stop");
    }
    stop.store(true, Ordering::Relaxed);
    for reader in readers {
        assert!(reader.join().expect("reader") > 0);
    }
    // No temporary files left behind.
    let leftovers: Vec<_> = fs::read_dir(host.root())
        .expect("dir")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("sim-tmp"))
        .collect();
    assert!(leftovers.is_empty());
}

#[test]
fn atomic_writes_replace_the_inode_and_in_place_writes_keep_it() {
    for (mode, same_inode) in [(WriteMode::Atomic, false), (WriteMode::InPlace, true)] {
        let host = SimHost::builder()
            .write_mode(mode)
            .capacity(TDX, 4)
            .build()
            .expect("host");
        host.add_pod(A, QosClass::Burstable, &["compute"])
            .expect("pod");
        let events = host
            .container_cgroup_path(A, "compute")
            .expect("compute")
            .join("misc.events");
        let before = fs::metadata(&events).expect("meta").ino();
        host.fail_charge_in(A, "compute", TDX).expect("fail");
        assert_eq!(read(&events), "tdx.max 1\n");
        assert_eq!(
            fs::metadata(&events).expect("meta").ino() == before,
            same_inode,
            "{mode:?}"
        );
    }
}

#[test]
fn unchanged_files_are_not_rewritten() {
    let host = SimHost::with_tdx_pod(4, A).expect("host with pod A");
    let events = host.pod_cgroup_path(A).expect("pod").join("misc.events");
    let before = fs::metadata(&events).expect("meta").ino();
    host.start_vm(A, "compute", TDX).expect("start");
    host.stop_vm(A, "compute", TDX).expect("stop");
    assert_eq!(
        fs::metadata(&events).expect("meta").ino(),
        before,
        "misc.events changes only on a failed charge"
    );
}

#[test]
fn garbage_truncation_and_half_writes_stay_until_healed() {
    let host = SimHost::with_tdx_pod(4, A).expect("host with pod A");
    host.start_vm(A, "compute", TDX).expect("start");
    let current = host.root().join("misc.current");

    host.write_garbage("misc.current").expect("garbage");
    let garbage = fs::read(&current).expect("read");
    assert!(
        String::from_utf8(garbage.clone()).is_err()
            || parse_misc(&String::from_utf8_lossy(&garbage)).is_err()
    );
    host.start_vm(A, "compute", TDX).expect("start");
    assert_eq!(fs::read(&current).expect("read"), garbage, "pinned");
    assert_eq!(host.usage(TDX), 2, "the model keeps counting");
    host.heal("misc.current").expect("heal");
    assert_eq!(read(&current), "tdx 2\n");

    host.truncate(&current).expect("truncate");
    assert_eq!(read(&current), "");
    host.heal(&current).expect("heal");

    host.set_capacity("sgx_epc", 3).expect("capacity");
    assert_eq!(read(&current), "tdx 2\nsgx_epc 0\n");
    let half = host.write_half("misc.current").expect("half");
    assert_eq!(half, "tdx 2\nsg");
    assert_eq!(read(&current), "tdx 2\nsg");
    assert!(parse_misc(&read(&current)).is_err());

    host.write_raw("misc.capacity", "tdx 31 \nsev\n")
        .expect("raw");
    assert_eq!(read(&host.root().join("misc.capacity")), "tdx 31 \nsev\n");
    host.write_in_place("kubepods.slice/misc.current", "tdx 1\n")
        .expect("in place");
    assert_eq!(
        read(&host.root().join("kubepods.slice/misc.current")),
        "tdx 1\n"
    );

    host.heal_all().expect("heal all");
    assert_eq!(read(&current), "tdx 2\nsgx_epc 0\n");
    assert_eq!(
        read(&host.root().join("misc.capacity")),
        "tdx 4\nsgx_epc 3\n"
    );
    assert_eq!(
        read(&host.root().join("kubepods.slice/misc.current")),
        "tdx 2\nsgx_epc 0\n"
    );
}

#[test]
fn io_errors_even_as_root() {
    let host = SimHost::with_tdx_pod(4, A).expect("host with pod A");
    let file = host.break_pod_misc_current(A).expect("break");
    let err = fs::read_to_string(&file).expect_err("a directory cannot be read as a file");
    assert!(err.raw_os_error().is_some(), "{err}");
    host.start_vm(A, "compute", TDX)
        .expect("the model still works");
    host.heal(&file).expect("heal");
    assert_eq!(read(&file), "tdx 1\n");

    host.replace_with_dir("misc.capacity").expect("break root");
    assert!(fs::read_to_string(host.root().join("misc.capacity")).is_err());
    host.heal("misc.capacity").expect("heal");
    assert_eq!(read(&host.root().join("misc.capacity")), "tdx 4\n");
}

#[test]
fn unreadable_pod_cgroup() {
    let host = SimHost::with_tdx_pod(4, A).expect("host with pod A");
    let dir = host.make_pod_unreadable(A).expect("chmod");
    assert_eq!(
        fs::metadata(&dir).expect("meta").permissions().mode() & 0o777,
        0
    );
    let read_result = fs::read_to_string(dir.join("misc.current"));
    if running_as_root() {
        assert!(
            read_result.is_ok(),
            "root bypasses permissions: use break_pod_misc_current instead"
        );
    } else {
        assert!(read_result.is_err());
    }
    host.make_pod_readable(A).expect("chmod back");
    assert_eq!(read(&dir.join("misc.current")), "tdx 0\n");
    host.make_pod_unreadable(A).expect("chmod");
    host.remove_pod(A)
        .expect("an unreadable pod can still be removed");
    assert!(!dir.exists());
}

#[test]
fn pod_dir_with_unparsable_uid() {
    let host = SimHost::builder().capacity(TDX, 4).build().expect("host");
    let rel = host
        .add_unparsable_pod_dir(QosClass::Burstable, "not-a-uid")
        .expect("dir");
    assert_eq!(
        rel,
        "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podnot_a_uid.slice"
    );
    assert!(host.path(&rel).join("misc.current").is_file());
    assert!(host.pod_uids().is_empty());
    host.charge(&rel, TDX, 1).expect("something charged in it");
    assert_eq!(read(&host.root().join("misc.current")), "tdx 1\n");
    host.remove_cgroup(&rel).expect("remove");
    assert_eq!(host.usage(TDX), 0);
}

#[test]
fn resync_restores_files_changed_behind_the_simulators_back() {
    let host = SimHost::builder().capacity(TDX, 4).build().expect("host");
    fs::write(host.root().join("misc.current"), "tdx 99\n").expect("tamper");
    host.resync().expect("resync");
    assert_eq!(read(&host.root().join("misc.current")), "tdx 0\n");
}
