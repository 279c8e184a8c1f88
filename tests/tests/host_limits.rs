//! Limits written into `misc.max` by another process (the agent's enforcement), the way it does on a real
//! host: open without `O_CREAT`, write `"<resource> <n>"`. The simulated host takes them in like the kernel
//! (refusing what the kernel would refuse) and shows its full view of the file again afterwards.

use std::fs;
use std::io::{ErrorKind, Write as _};
use std::path::Path;

use teeguard_tests::Error;
use teeguard_tests::host::{
    CgroupDriver, CgroupVersion, MiscDelegation, QosClass, SEV, SEV_ES, SimHost, TDX, WriteMode,
};

const A: &str = "0a0a0a0a-1111-4222-8333-444455556666";
const B: &str = "0b0b0b0b-1111-4222-8333-444455556666";

fn read(path: &Path) -> String {
    fs::read_to_string(path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()))
}

/// Write like the agent (and a runtime) does: the file must exist (no `O_CREAT`), one write call.
fn write_max(path: &Path, line: &str) -> std::io::Result<()> {
    let mut file = fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)?;
    file.write_all(line.as_bytes())
}

fn write_max_ok(path: &Path, line: &str) {
    write_max(path, line).unwrap_or_else(|e| panic!("write {line:?} into {}: {e}", path.display()));
}

fn host(version: CgroupVersion, driver: CgroupDriver, mode: WriteMode) -> SimHost {
    SimHost::builder()
        .version(version)
        .driver(driver)
        .write_mode(mode)
        .capacity(TDX, 8)
        .capacity(SEV_ES, 4)
        .build()
        .expect("host")
}

/// A host of every layout (cgroup version, driver, write mode) with the Burstable pod `A` (container
/// `compute`), with the layout's version, driver and name (for assertion messages).
fn hosts_with_pod_a() -> Vec<(CgroupVersion, CgroupDriver, String, SimHost)> {
    let mut out = Vec::new();
    for version in [CgroupVersion::V2, CgroupVersion::V1] {
        for driver in [CgroupDriver::Systemd, CgroupDriver::Cgroupfs] {
            for mode in [WriteMode::Atomic, WriteMode::InPlace] {
                let host = host(version, driver, mode);
                host.add_pod(A, QosClass::Burstable, &["compute"])
                    .expect("pod");
                out.push((
                    version,
                    driver,
                    format!("{version:?}/{driver:?}/{mode:?}"),
                    host,
                ));
            }
        }
    }
    out
}

#[test]
fn a_limit_written_into_a_pod_misc_max_refuses_its_second_charge_with_the_kernels_events() {
    for (version, driver, ctx, host) in hosts_with_pod_a() {
        let pod = host.pod_cgroup_rel(A).expect("pod rel");
        let compute = host.container_cgroup_rel(A, "compute").expect("compute");
        let file = host.path(&pod).join("misc.max");
        if version == CgroupVersion::V1 {
            assert!(file.starts_with(host.root().join("misc")), "{ctx}");
        }
        assert_eq!(read(&file), "sev_es max\ntdx max\n", "{ctx}");
        write_max_ok(&file, "tdx 1");

        // No call into the simulator between the write and the charges: the charge itself takes it in.
        host.start_vm(A, "compute", TDX)
            .expect("the first key fits");
        let err = host
            .start_vm(A, "compute", TDX)
            .expect_err("the written limit refuses the second key");
        assert_eq!(
            err.refusal(),
            Some((pod.as_str(), 2, 1)),
            "{ctx}: refused at the pod: {err}"
        );
        assert_eq!(host.usage(TDX), 1, "{ctx}");
        // The file shows the kernel's full view again.
        assert_eq!(read(&file), "sev_es max\ntdx 1\n", "{ctx}");
        assert_eq!(host.pod_max(A, TDX), Some(Some(1)), "{ctx}");
        assert_eq!(host.pod_max(A, SEV_ES), Some(None), "{ctx}");

        // misc.events: the refusing pod and every ancestor; misc.events.local: the pod only.
        let events = |rel: &str, file: &str| read(&host.path(rel).join(file));
        assert_eq!(
            events(&pod, "misc.events"),
            "sev_es.max 0\ntdx.max 1\n",
            "{ctx}"
        );
        assert_eq!(
            events(&pod, "misc.events.local"),
            "sev_es.max 0\ntdx.max 1\n",
            "{ctx}"
        );
        assert_eq!(
            events(&compute, "misc.events"),
            "sev_es.max 0\ntdx.max 0\n",
            "{ctx}"
        );
        let kubepods = match driver {
            CgroupDriver::Systemd => "kubepods.slice",
            CgroupDriver::Cgroupfs => "kubepods",
        };
        let qos = match driver {
            CgroupDriver::Systemd => "kubepods.slice/kubepods-burstable.slice",
            CgroupDriver::Cgroupfs => "kubepods/burstable",
        };
        for ancestor in [kubepods, qos] {
            assert_eq!(host.events(ancestor, TDX), 1, "{ctx}: {ancestor}");
            assert_eq!(host.events_local(ancestor, TDX), 0, "{ctx}: {ancestor}");
            assert_eq!(
                events(ancestor, "misc.events"),
                "sev_es.max 0\ntdx.max 1\n",
                "{ctx}: {ancestor}"
            );
        }

        // Another pod is not limited; lifting the limit by a write lets the pod grow again.
        host.add_pod(B, QosClass::Burstable, &["compute"])
            .expect("pod b");
        host.start_vm(B, "compute", TDX).expect("pod b unlimited");
        host.start_vm(B, "compute", TDX).expect("pod b unlimited");
        write_max_ok(&file, "tdx max\n");
        host.start_vm(A, "compute", TDX).expect("limit lifted");
        assert_eq!(read(&file), "sev_es max\ntdx max\n", "{ctx}");
    }
}

#[test]
fn tdx_0_written_into_a_pod_refuses_its_first_charge() {
    let host = host(CgroupVersion::V2, CgroupDriver::Systemd, WriteMode::Atomic);
    host.add_pod(A, QosClass::Guaranteed, &["compute"])
        .expect("pod");
    let pod = host.pod_cgroup_rel(A).expect("pod rel");
    write_max_ok(&host.path(&pod).join("misc.max"), "tdx 0\n");
    let err = host.start_vm(A, "compute", TDX).expect_err("tdx 0");
    assert!(
        matches!(&err, Error::ChargeRefused { failed_at, limit: 0, .. } if *failed_at == pod),
        "{err}"
    );
    assert_eq!(host.usage(TDX), 0);
    assert_eq!(host.events_local(&pod, TDX), 1);
    assert_eq!(host.events("kubepods.slice", TDX), 1);
    // Only tdx is limited.
    host.start_vm(A, "compute", SEV_ES)
        .expect("sev_es unlimited");
}

#[test]
fn a_limit_written_into_a_container_misc_max_is_honoured_at_the_container() {
    for version in [CgroupVersion::V2, CgroupVersion::V1] {
        let host = host(version, CgroupDriver::Cgroupfs, WriteMode::Atomic);
        host.add_pod(A, QosClass::Burstable, &["compute", "sidecar"])
            .expect("pod");
        let pod = host.pod_cgroup_rel(A).expect("pod rel");
        let compute = host.container_cgroup_rel(A, "compute").expect("compute");
        write_max_ok(&host.path(&compute).join("misc.max"), "sev_es 1");
        host.start_vm(A, "compute", SEV_ES).expect("first");
        let err = host.start_vm(A, "compute", SEV_ES).expect_err("limited");
        assert!(
            matches!(&err, Error::ChargeRefused { failed_at, .. } if *failed_at == compute),
            "{version:?}: {err}"
        );
        assert_eq!(host.events_local(&compute, SEV_ES), 1, "{version:?}");
        assert_eq!(host.events(&pod, SEV_ES), 1, "{version:?}");
        assert_eq!(host.events_local(&pod, SEV_ES), 0, "{version:?}");
        assert_eq!(host.max_of(&compute, SEV_ES), Some(Some(1)), "{version:?}");
        assert_eq!(host.pod_max(A, SEV_ES), Some(None), "{version:?}");
        // The pod's other container is not limited.
        host.start_vm(A, "sidecar", SEV_ES).expect("sidecar");
        host.start_vm(A, "sidecar", SEV_ES).expect("sidecar");
        assert_eq!(host.pod_usage(A, SEV_ES), 3, "{version:?}");
    }
}

#[test]
fn writes_the_kernel_would_refuse_change_nothing_and_the_file_shows_the_model_again() {
    for mode in [WriteMode::Atomic, WriteMode::InPlace] {
        // sev is known to the kernel but the host has none: writing it is EINVAL too.
        let host = SimHost::builder()
            .write_mode(mode)
            .capacity(TDX, 8)
            .capacity(SEV_ES, 4)
            .capacity(SEV, 0)
            .build()
            .expect("host");
        host.add_pod(A, QosClass::Burstable, &["compute"])
            .expect("pod");
        let pod = host.pod_cgroup_rel(A).expect("pod rel");
        let file = host.path(&pod).join("misc.max");
        write_max_ok(&file, "tdx 2\n");
        assert_eq!(host.pod_max(A, TDX), Some(Some(2)), "{mode:?}");
        for refused in [
            "bogus 3",
            "tdx -1",
            "sev 1",
            "tdx",
            "tdx 1 2",
            "tdx  1",
            "tdx\t1",
            "tdx 0x",
            "tdx 08",
            "tdx 1k",
            "tdx 99999999999999999999999",
            "TDX 1",
            // Not "": a write of no bytes never reaches the kernel's handler, and the empty file it
            // leaves here is a writer between its truncate and its write, left alone (see
            // `a_reader_between_a_writers_truncate_and_its_write_loses_no_limit`).
            "\u{fffd}\u{0} garbage",
        ] {
            write_max_ok(&file, refused);
            // A read of the pod takes the write in, refuses it and rewrites the file.
            assert_eq!(host.events(&pod, TDX), 0, "{mode:?} {refused:?}");
            assert_eq!(
                read(&file),
                "sev_es max\ntdx 2\n",
                "{mode:?}: {refused:?} left in the file"
            );
            assert_eq!(host.pod_max(A, TDX), Some(Some(2)), "{mode:?} {refused:?}");
            assert_eq!(host.pod_max(A, SEV_ES), Some(None), "{mode:?} {refused:?}");
            assert_eq!(
                host.pod_max(A, SEV),
                None,
                "{mode:?}: capacity 0 has no line"
            );
        }
        // The refused sev write left no limit behind, even once the host has sev keys.
        host.set_capacity(SEV, 2).expect("sev capacity");
        assert_eq!(host.pod_max(A, SEV), Some(None), "{mode:?}");
        assert_eq!(read(&file), "sev max\nsev_es max\ntdx 2\n", "{mode:?}");
        // Still the limit of 2.
        host.start_vm(A, "compute", TDX).expect("1");
        host.start_vm(A, "compute", TDX).expect("2");
        host.start_vm(A, "compute", TDX)
            .expect_err("3 is over the limit");
    }
}

#[test]
fn numbers_are_read_like_kstrtou64_and_each_line_is_one_write() {
    let host = host(CgroupVersion::V2, CgroupDriver::Systemd, WriteMode::Atomic);
    host.add_pod(A, QosClass::Burstable, &["compute"])
        .expect("pod");
    let file = host.pod_cgroup_path(A).expect("pod").join("misc.max");
    for (written, tdx) in [
        ("  tdx 3 \n", Some(3)),
        ("tdx 0x1f", Some(31)),
        ("tdx +4", Some(4)),
        ("tdx 010", Some(8)),
        ("tdx 0", Some(0)),
        ("tdx 18446744073709551615", None),
        ("tdx 12", Some(12)), // above the capacity: accepted, the capacity still caps
        ("tdx max", None),
    ] {
        write_max_ok(&file, written);
        assert_eq!(host.pod_max(A, TDX), Some(tdx), "{written:?}");
    }
    // Several lines: each is a write of its own; refused lines change nothing.
    write_max_ok(&file, "sev_es 1\nbogus 2\ntdx 5\n");
    assert_eq!(host.pod_max(A, TDX), Some(Some(5)));
    assert_eq!(host.pod_max(A, SEV_ES), Some(Some(1)));
    assert_eq!(read(&file), "sev_es 1\ntdx 5\n");
    // The whole view written back is the same limits.
    write_max_ok(&file, "sev_es 1\ntdx 5\n");
    assert_eq!(host.pod_max(A, TDX), Some(Some(5)));
    // No limit on the root, none on unknown cgroups or resources.
    assert_eq!(host.max_of("", TDX), None);
    assert_eq!(host.max_of("no/such", TDX), None);
    assert_eq!(host.pod_max(A, "bogus"), None);
    assert_eq!(host.pod_max(B, TDX), None);
}

#[test]
fn the_simulators_own_changes_keep_limits_written_by_others() {
    let host = host(CgroupVersion::V2, CgroupDriver::Systemd, WriteMode::Atomic);
    host.add_pod(A, QosClass::Burstable, &["compute"])
        .expect("pod");
    let pod = host.pod_cgroup_rel(A).expect("pod rel");
    let file = host.path(&pod).join("misc.max");

    write_max_ok(&file, "sev_es 1");
    host.set_max(&pod, TDX, Some(3)).expect("set_max");
    assert_eq!(
        read(&file),
        "sev_es 1\ntdx 3\n",
        "set_max kept the written sev_es"
    );

    write_max_ok(&file, "tdx 2");
    host.resync().expect("resync");
    assert_eq!(
        read(&file),
        "sev_es 1\ntdx 2\n",
        "resync kept the written tdx"
    );

    write_max_ok(&file, "tdx 1");
    host.set_capacity(TDX, 16).expect("capacity");
    assert_eq!(
        host.pod_max(A, TDX),
        Some(Some(1)),
        "taken in before the change"
    );

    write_max_ok(&file, "tdx max");
    host.add_container(A, "sidecar").expect("container");
    assert_eq!(
        read(&file),
        "sev_es 1\ntdx max\n",
        "rewrite of the pod took it in"
    );

    // A pinned fault is not a write: healing restores the model without taking it in.
    host.write_raw(&file, "tdx 0\n").expect("fault");
    host.start_vm(A, "compute", TDX)
        .expect("a pinned fault sets no limit");
    host.heal(&file).expect("heal");
    assert_eq!(host.pod_max(A, TDX), Some(None));
    assert_eq!(read(&file), "sev_es 1\ntdx max\n");
}

/// A writer opens `misc.max` with `O_TRUNC` and writes after: a reader that looks in between (the test
/// polling `pod_max` while the agent writes) finds the file empty. The simulator must not take that in
/// and rewrite the file, or the write that lands next goes into the replaced file and is lost (the
/// enforcement bench's cgroup writer lost 1 pod in 3 runs so).
#[test]
fn a_reader_between_a_writers_truncate_and_its_write_loses_no_limit() {
    for (_, _, ctx, host) in hosts_with_pod_a() {
        let file = host.pod_cgroup_path(A).expect("pod").join("misc.max");
        let mut writer = fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&file)
            .expect("open");
        assert_eq!(
            host.pod_max(A, TDX),
            Some(None),
            "{ctx}: nothing written yet"
        );
        writer.write_all(b"tdx 1").expect("write");
        drop(writer);
        assert_eq!(
            host.pod_max(A, TDX),
            Some(Some(1)),
            "{ctx}: the write counts"
        );
        assert_eq!(read(&file), "sev_es max\ntdx 1\n", "{ctx}");
    }
}

#[test]
fn without_the_misc_controller_there_is_no_misc_max_to_open() {
    for delegation in [MiscDelegation::NotBelowKubepods, MiscDelegation::RootOnly] {
        let host = SimHost::builder()
            .capacity(TDX, 8)
            .misc_delegation(delegation)
            .build()
            .expect("host");
        host.add_pod(A, QosClass::Burstable, &["compute"])
            .expect("pod");
        let pod = host.pod_cgroup_path(A).expect("pod");
        let compute = host.container_cgroup_path(A, "compute").expect("compute");
        for file in [pod.join("misc.max"), compute.join("misc.max")] {
            let err = write_max(&file, "tdx 1").expect_err("no misc.max without the controller");
            assert_eq!(err.kind(), ErrorKind::NotFound, "{delegation:?}: {err}");
            host.start_vm(A, "compute", TDX)
                .expect("charged on an ancestor");
            assert!(
                !file.exists(),
                "{delegation:?}: the simulator created {file:?}"
            );
        }
        assert_eq!(host.pod_max(A, TDX), None, "{delegation:?}");
        assert!(matches!(
            host.set_max(&host.pod_cgroup_rel(A).expect("rel"), TDX, Some(1)),
            Err(Error::MiscNotEnabled(_))
        ));
    }

    // Not delegated below kubepods: the kubepods limit is the one that holds every pod.
    let host = SimHost::builder()
        .capacity(TDX, 8)
        .misc_delegation(MiscDelegation::NotBelowKubepods)
        .build()
        .expect("host");
    host.add_pod(A, QosClass::Burstable, &["compute"])
        .expect("pod a");
    host.add_pod(B, QosClass::Burstable, &["compute"])
        .expect("pod b");
    write_max_ok(&host.kubepods_path().join("misc.max"), "tdx 1");
    host.start_vm(A, "compute", TDX).expect("first");
    let err = host
        .start_vm(B, "compute", TDX)
        .expect_err("kubepods limit");
    assert!(
        matches!(&err, Error::ChargeRefused { failed_at, .. } if failed_at == "kubepods.slice"),
        "{err}"
    );
    assert_eq!(host.events_local("kubepods.slice", TDX), 1);
}

/// What Linux 6.1 and 6.12 did with `fake_tee` (`tests/tests/kernel_capacity.rs`,
/// `kernel_enforce.rs`), the simulator does too: the capacity lowered below the usage takes nothing
/// back; at 0 the resource leaves `misc.capacity` and `misc.max` (usage and events still show), a
/// charge and a `misc.max` write are `EINVAL` and counted nowhere; a limit set before comes back with
/// the capacity; a refusal because the pods together fill the node is counted in kubepods, not in the
/// refused pod.
#[test]
fn capacity_zero_is_einval_counted_nowhere_and_a_full_node_counts_in_kubepods_as_on_linux_6_1_and_6_12()
 {
    for kernel in [
        teeguard_tests::host::KernelFeatures::old(),
        teeguard_tests::host::KernelFeatures::modern(),
    ] {
        let ctx = format!("{kernel:?}");
        let host = SimHost::builder()
            .kernel(kernel)
            .driver(CgroupDriver::Cgroupfs)
            .capacity(SEV, 4)
            .capacity(SEV_ES, 2)
            .build()
            .expect("host");
        for uid in [A, B] {
            host.add_pod(uid, QosClass::Burstable, &["compute"])
                .expect("pod");
        }
        let pod_a = host.pod_cgroup_rel(A).expect("pod a");
        let pod_b = host.pod_cgroup_rel(B).expect("pod b");
        write_max_ok(&host.path(&pod_a).join("misc.max"), "sev 1");
        host.start_vm(A, "compute", SEV).expect("a's key");

        host.set_capacity(SEV, 0).expect("capacity 0");
        assert_eq!(
            read(&host.misc_root().join("misc.capacity")),
            "sev_es 2\n",
            "{ctx}"
        );
        assert_eq!(
            read(&host.path(&pod_a).join("misc.max")),
            "sev_es max\n",
            "{ctx}"
        );
        assert_eq!(
            read(&host.path(&pod_a).join("misc.current")),
            "sev 1\nsev_es 0\n",
            "{ctx}: the key stays"
        );
        let err = host.start_vm(B, "compute", SEV).expect_err("no capacity");
        assert!(matches!(err, Error::Invalid { .. }), "{ctx}: {err}");
        let err = host.set_max(&pod_b, SEV, Some(1)).expect_err("no capacity");
        assert!(matches!(err, Error::Invalid { .. }), "{ctx}: {err}");
        assert_eq!(
            host.events("kubepods", SEV),
            0,
            "{ctx}: EINVAL is counted nowhere"
        );

        host.set_capacity(SEV, 2).expect("capacity back");
        assert_eq!(
            read(&host.path(&pod_a).join("misc.max")),
            "sev 1\nsev_es max\n",
            "{ctx}: the limit comes back"
        );
        host.start_vm(B, "compute", SEV).expect("b's key");
        // The node is full of pods' keys: a third pod's charge is refused at burstable, counted there
        // and in kubepods, not in the pod.
        const C: &str = "0c0c0c0c-1111-4222-8333-444455556666";
        host.add_pod(C, QosClass::Burstable, &["compute"])
            .expect("pod c");
        let err = host.start_vm(C, "compute", SEV).expect_err("full");
        assert!(
            matches!(&err, Error::ChargeRefused { failed_at, .. } if failed_at == "kubepods/burstable"),
            "{ctx}: {err}"
        );
        assert_eq!(
            host.events(&host.pod_cgroup_rel(C).expect("c"), SEV),
            0,
            "{ctx}"
        );
        assert_eq!(host.events("kubepods", SEV), 1, "{ctx}");
    }
}
