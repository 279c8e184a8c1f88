//! The scanner and the attribution pipeline (`scan::scan_report`, the code `run` uses too) against the
//! simulated host: every cgroup layout, delegation mode and broken file.

use k8s_openapi::api::core::v1::Pod;
use serde_json::json;
use teeguard_agent::decide::attribution::Accounting;
use teeguard_agent::decide::attribution::Uids;
use teeguard_agent::decide::counts::KindCounts;
use teeguard_agent::decide::host::{Driver, HostScan, HostState, Interest};
use teeguard_agent::kernel::Scanner;
use teeguard_agent::scan::scan_report;
use teeguard_shared::names::{conditions as ct, reasons};
use teeguard_shared::{Config, KindStatus, TeeKind};
use teeguard_tests::host::{
    CgroupDriver, CgroupVersion, MiscDelegation, QosClass, SANDBOX, SEV_ES, SimHost, TDX,
    WriteMode, docker_container_cgroup,
};

const NODE: &str = "node01";

fn uid(n: u32) -> String {
    format!("{n:08x}-1111-4222-8333-444444444444")
}

/// A bound pod requesting `keys` TDX keys (through a container request, or `overhead` for Kata).
fn pod(n: u32, phase: &str, keys: u32, via_overhead: bool) -> Pod {
    let resources = if via_overhead || keys == 0 {
        json!({})
    } else {
        json!({"requests": {"tdx.intel.com/keys": keys.to_string()}, "limits": {"tdx.intel.com/keys": keys.to_string()}})
    };
    let mut spec =
        json!({"nodeName": NODE, "containers": [{"name": "compute", "resources": resources}]});
    if via_overhead {
        spec["overhead"] = json!({"tdx.intel.com/keys": keys.to_string(), "cpu": "250m"});
    }
    serde_json::from_value(json!({
        "metadata": {"name": format!("pod-{n}"), "namespace": "ns", "uid": uid(n)},
        "spec": spec,
        "status": {"phase": phase}
    }))
    .expect("pod")
}

fn scanned(state: HostState) -> HostScan {
    match state {
        HostState::Scanned(s) => s,
        other => panic!("expected a scan, got {other:?}"),
    }
}

fn tdx(report: &teeguard_agent::scan::ScanReport) -> KindStatus {
    report.status.tdx.clone().expect("tdx figures")
}

fn condition<'a>(
    report: &'a teeguard_agent::scan::ScanReport,
    t: &str,
) -> &'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    report.status.condition(t).expect("condition")
}

#[test]
fn every_layout_attributes_per_pod() {
    for version in [CgroupVersion::V2, CgroupVersion::V1] {
        for driver in [CgroupDriver::Systemd, CgroupDriver::Cgroupfs] {
            let host = SimHost::builder()
                .version(version)
                .driver(driver)
                .capacity(TDX, 16)
                .build()
                .expect("host");
            let qos = [
                QosClass::Burstable,
                QosClass::Guaranteed,
                QosClass::BestEffort,
            ];
            let mut pods = Vec::new();
            for n in 0..3u32 {
                host.add_pod(&uid(n), qos[n as usize], &["compute"])
                    .expect("pod");
                host.start_vm(&uid(n), "compute", TDX).expect("vm");
                pods.push(pod(n, "Running", 1, false));
            }
            host.add_external("outside", TDX, 2).expect("external");
            let what = format!("{version:?}/{driver:?}");

            // Every pod read at every scan: this test is about finding the files.
            let mut scanner = Scanner::new(host.root()).full_read_every(1);
            let scan = scanned(scanner.scan(Interest::All).expect(&what));
            let p = scan.pods.as_ref().expect("pods");
            assert_eq!(
                p.accounting,
                Accounting::PerPod,
                "{what}: {}",
                p.accounting_reason
            );
            assert_eq!(
                p.driver,
                Some(match driver {
                    CgroupDriver::Systemd => Driver::Systemd,
                    CgroupDriver::Cgroupfs => Driver::Cgroupfs,
                }),
                "{what}"
            );
            assert_eq!(p.usage.len(), 3, "{what}: {:?}", p.usage);

            // Agent mode reads the same figures by constructed paths (plus a pod with no cgroup yet).
            let mut interest: Uids = (0..3).map(uid).collect();
            interest.insert(uid(99));
            for _ in 0..2 {
                let only = scanned(scanner.scan(Interest::Only(&interest)).expect(&what));
                let o = only.pods.expect("pods");
                assert_eq!(o.usage, p.usage, "{what}");
                assert_eq!(o.pods_read, 3, "{what}");
                assert_eq!(o.accounting, Accounting::PerPod, "{what}");
            }
            // A remembered place that goes away (the pod is re-created in another QoS class).
            host.remove_pod(&uid(0)).expect("remove");
            host.add_pod(&uid(0), QosClass::BestEffort, &["compute"])
                .expect("re-add");
            host.start_vm(&uid(0), "compute", TDX).expect("vm");
            let only = scanned(scanner.scan(Interest::Only(&interest)).expect(&what));
            assert_eq!(
                only.pods.expect("pods").usage,
                p.usage,
                "{what}: found again"
            );

            let report = scan_report(host.root(), &Config::default(), &pods, Some(NODE));
            let t = tdx(&report);
            assert_eq!(
                (
                    t.capacity,
                    t.kernel_used,
                    t.pods_used,
                    t.external,
                    t.pending,
                    t.free,
                    t.advertised
                ),
                (16, 5, 3, 2, 0, 11, Some(14)),
                "{what}"
            );
        }
    }
}

#[test]
fn kubevirt_vms_kata_external_and_pending() {
    let host = SimHost::builder().capacity(TDX, 16).build().expect("host");
    let mut pods = Vec::new();
    // 4 KubeVirt VMs.
    for n in 0..4 {
        host.add_pod(&uid(n), QosClass::Burstable, &["compute"])
            .expect("pod");
        host.start_vm(&uid(n), "compute", TDX).expect("vm");
        pods.push(pod(n, "Running", 1, false));
    }
    // A Kata pod: the key comes from the RuntimeClass overhead, the VMM runs in the sandbox cgroup.
    host.add_pod(&uid(10), QosClass::Burstable, &["app"])
        .expect("kata pod");
    host.start_vm(&uid(10), SANDBOX, TDX).expect("kata vm");
    pods.push(pod(10, "Running", 1, true));
    // Bound but not started: pending.
    pods.push(pod(20, "Pending", 1, false));
    // Finished: holds nothing, not pending.
    pods.push(pod(21, "Succeeded", 1, false));
    // A pod that does not request keys but whose cgroup holds one (a misconfigured runtime).
    host.add_pod(&uid(30), QosClass::BestEffort, &["c"])
        .expect("pod");
    host.start_vm(&uid(30), "c", TDX).expect("vm");
    pods.push(pod(30, "Running", 0, false));
    // 2 keys held outside Kubernetes.
    host.add_external(&docker_container_cgroup("abc"), TDX, 2)
        .expect("external");

    let report = scan_report(host.root(), &Config::default(), &pods, Some(NODE));
    let t = tdx(&report);
    assert_eq!(t.kernel_used, 8);
    assert_eq!(t.pods_used, 5, "4 VMs + the Kata pod");
    assert_eq!(t.external, 3, "docker 2 + the pod that requests nothing");
    assert_eq!(t.pending, 1);
    assert_eq!(t.free, 16 - 8 - 1);
    assert_eq!(t.advertised, Some(13));
    let kata = report
        .pods
        .iter()
        .find(|p| p.uid == uid(10))
        .expect("kata row");
    assert_eq!(kata.requests.get(&TeeKind::Tdx), Some(&1));
    assert_eq!(kata.holds.get(&TeeKind::Tdx), Some(&1));
}

#[test]
fn pods_of_other_nodes_are_ignored() {
    let host = SimHost::builder().capacity(TDX, 4).build().expect("host");
    let mut other = pod(1, "Pending", 1, false);
    other.spec.as_mut().expect("spec").node_name = Some("elsewhere".into());
    let report = scan_report(host.root(), &Config::default(), &[other], Some(NODE));
    assert_eq!(tdx(&report).pending, 0);
}

#[test]
fn only_pods_of_interest_are_read() {
    let host = SimHost::builder().capacity(TDX, 16).build().expect("host");
    for n in 0..5 {
        host.add_pod(&uid(n), QosClass::Burstable, &["compute"])
            .expect("pod");
        host.start_vm(&uid(n), "compute", TDX).expect("vm");
    }
    let interest: Uids = [uid(1), uid(3)].into_iter().collect();
    let scan = scanned(
        Scanner::new(host.root())
            .scan(Interest::Only(&interest))
            .expect("scan"),
    );
    let p = scan.pods.expect("pods");
    assert_eq!(p.pods_read, 2);
    assert_eq!(
        p.usage.keys().cloned().collect::<Uids>(),
        interest,
        "only the pods of interest"
    );
    assert_eq!(
        scan.kernel_used,
        KindCounts::from_pairs([(TeeKind::Tdx, 5)])
    );
}

/// The agent keeps the pods' `misc.current` open between scans and re-reads them at offset 0. The
/// simulated host replaces files by rename (`WriteMode::Atomic`, the default) or rewrites them in place
/// (`WriteMode::InPlace`, like the kernel): either way every scan must read what a new scanner, opening
/// every file, reads.
#[test]
fn kept_open_pod_files_track_the_simulated_host() {
    let qos = [
        QosClass::Burstable,
        QosClass::Guaranteed,
        QosClass::BestEffort,
        QosClass::Burstable,
    ];
    for mode in [WriteMode::Atomic, WriteMode::InPlace] {
        for (version, driver) in [
            (CgroupVersion::V2, CgroupDriver::Systemd),
            (CgroupVersion::V1, CgroupDriver::Cgroupfs),
        ] {
            let what = format!("{mode:?} {version:?}/{driver:?}");
            let host = SimHost::builder()
                .version(version)
                .driver(driver)
                .write_mode(mode)
                .capacity(TDX, 16)
                .build()
                .expect("host");
            for n in 0..4u32 {
                host.add_pod(&uid(n), qos[n as usize], &["compute", "second"])
                    .expect("pod");
                host.start_vm(&uid(n), "compute", TDX).expect("vm");
            }
            let interest: Uids = (0..4).map(uid).collect();
            // Every pod read at every scan: this test is about the kept files (the first change below,
            // one pod charging while another releases, is one the kubepods total cannot show).
            let mut scanner = Scanner::new(host.root()).full_read_every(1);
            let check = |scanner: &mut Scanner, expected: &[(u32, u64)]| {
                let kept = scanner.scan(Interest::Only(&interest)).expect("scan");
                let fresh = Scanner::new(host.root())
                    .scan(Interest::Only(&interest))
                    .expect("fresh scan");
                assert_eq!(
                    kept, fresh,
                    "{what}: kept-open files and a fresh scan disagree"
                );
                let pods = scanned(kept).pods.expect("pods");
                let want: std::collections::HashMap<String, KindCounts> = expected
                    .iter()
                    .map(|(n, keys)| (uid(*n), KindCounts::from_pairs([(TeeKind::Tdx, *keys)])))
                    .collect();
                assert_eq!(pods.usage, want, "{what}");
                pods
            };
            check(&mut scanner, &[(0, 1), (1, 1), (2, 1), (3, 1)]);
            assert_eq!(scanner.open_pod_files(), 4, "{what}");

            // Usage changes: a second VM in pod 0, pod 1's VM stops.
            host.start_vm(&uid(0), "second", TDX).expect("vm");
            host.stop_vm(&uid(1), "compute", TDX).expect("stop");
            check(&mut scanner, &[(0, 2), (2, 1), (3, 1)]);
            assert_eq!(scanner.open_pod_files(), 4, "{what}");

            // Pod 2 removed: its keys are released and it is no longer read.
            host.remove_pod(&uid(2)).expect("remove");
            let pods = check(&mut scanner, &[(0, 2), (3, 1)]);
            assert_eq!(pods.pods_read, 3, "{what}");
            assert_eq!(scanner.open_pod_files(), 3, "{what}");
            // Recreated with the same UID and QoS class: the same path, new files.
            host.add_pod(&uid(2), qos[2], &["compute", "second"])
                .expect("pod");
            host.start_vm(&uid(2), "compute", TDX).expect("vm");
            host.start_vm(&uid(2), "second", TDX).expect("vm");
            check(&mut scanner, &[(0, 2), (2, 2), (3, 1)]);
            assert_eq!(scanner.open_pod_files(), 4, "{what}");

            // Broken after being kept open: unreadable (a directory) and garbage (replaced by rename;
            // not UTF-8, so a read error too). Reported as a fresh scan reports them; not kept open.
            let broken = host.break_pod_misc_current(&uid(3)).expect("break");
            let pod0 = host.pod_cgroup_path(&uid(0)).expect("pod 0");
            host.write_garbage(pod0.join("misc.current"))
                .expect("garbage");
            let pods = check(&mut scanner, &[(2, 2)]);
            assert_eq!(pods.problem_count, 2, "{what}: {:?}", pods.problems);
            assert!(
                pods.problems
                    .iter()
                    .any(|p| p.contains(&broken.display().to_string())),
                "{what}: {:?}",
                pods.problems
            );
            assert_eq!(scanner.open_pod_files(), 2, "{what}");
            // One at a time: `heal_all` in `WriteMode::InPlace` would rewrite the directory put in place of
            // a file before removing it.
            host.heal(&broken).expect("heal");
            host.heal(pod0.join("misc.current")).expect("heal");
            let pods = check(&mut scanner, &[(0, 2), (2, 2), (3, 1)]);
            assert_eq!(pods.problem_count, 0, "{what}: {:?}", pods.problems);
            assert_eq!(scanner.open_pod_files(), 4, "{what}");

            // Fewer pods of interest: the others' files are closed.
            let one: Uids = [uid(0)].into_iter().collect();
            scanner.scan(Interest::Only(&one)).expect("scan");
            assert_eq!(scanner.open_pod_files(), 1, "{what}");
        }
    }
}

#[test]
fn not_delegated_falls_back_to_running_pods() {
    for delegation in [MiscDelegation::NotBelowKubepods, MiscDelegation::RootOnly] {
        for with_usage in [false, true] {
            let host = SimHost::builder()
                .capacity(TDX, 16)
                .misc_delegation(delegation)
                .build()
                .expect("host");
            let mut pods = vec![pod(20, "Pending", 1, false)];
            for n in 0..2 {
                host.add_pod(&uid(n), QosClass::Burstable, &["compute"])
                    .expect("pod");
                if with_usage {
                    host.start_vm(&uid(n), "compute", TDX).expect("vm");
                }
                pods.push(pod(n, "Running", 1, false));
            }
            host.add_external("outside", TDX, 1).expect("external");
            let what = format!("{delegation:?}, usage {with_usage}");
            let report = scan_report(host.root(), &Config::default(), &pods, Some(NODE));
            let c = condition(&report, ct::PER_POD_ACCOUNTING);
            assert_eq!(
                (c.status.as_str(), c.reason.as_str()),
                ("False", reasons::MISC_NOT_DELEGATED),
                "{what}: {}",
                c.message
            );
            let t = tdx(&report);
            let kernel = if with_usage { 3 } else { 1 };
            assert_eq!(t.kernel_used, kernel, "{what}");
            assert_eq!(t.pods_used, kernel.min(2), "{what}");
            assert_eq!(t.pending, 1, "{what}");
        }
    }
}

#[test]
fn old_kernel_and_amd_host() {
    let host = SimHost::builder()
        .old_kernel()
        .capacity("sev", 99)
        .capacity(SEV_ES, 410)
        .build()
        .expect("host");
    host.add_pod(&uid(1), QosClass::Burstable, &["compute"])
        .expect("pod");
    host.start_vm(&uid(1), "compute", SEV_ES).expect("vm");
    host.add_external("legacy-sev", "sev", 3).expect("external");
    let es_pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "snp", "namespace": "ns", "uid": uid(1)},
        "spec": {"nodeName": NODE, "containers": [{"name": "compute", "resources": {"requests": {"sev-snp.amd.com/esids": "1"}}}]},
        "status": {"phase": "Running"}
    }))
    .expect("pod");
    let report = scan_report(host.root(), &Config::default(), &[es_pod], None);
    let es = report.status.sev_es.clone().expect("sev_es");
    assert_eq!(
        (es.capacity, es.kernel_used, es.pods_used, es.free),
        (410, 1, 1, 409)
    );
    let sev = report.status.sev.clone().expect("sev");
    assert_eq!(
        (sev.capacity, sev.kernel_used, sev.external, sev.free),
        (99, 3, 3, 96)
    );
    assert!(report.status.tdx.is_none());
}

#[test]
fn no_tee_hardware() {
    // A misc controller without TEE resources.
    let host = SimHost::builder()
        .capacity("sgx_epc", 0)
        .build()
        .expect("host");
    let report = scan_report(host.root(), &Config::default(), &[], None);
    assert!(report.status.kinds().next().is_none());
    let c = condition(&report, ct::TEE_HARDWARE);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", reasons::NO_TEE_HARDWARE)
    );
    assert!(report.kernel_readable());

    // No misc controller at all: the message says where the agent looked.
    let empty = tempfile::tempdir().expect("tempdir");
    let report = scan_report(empty.path(), &Config::default(), &[], None);
    let c = condition(&report, ct::TEE_HARDWARE);
    assert_eq!(
        (c.status.as_str(), c.reason.as_str()),
        ("False", reasons::NO_TEE_HARDWARE)
    );
    assert!(
        c.message.contains("no misc cgroup controller")
            && c.message.contains(&empty.path().display().to_string()),
        "{}",
        c.message
    );
}

#[test]
fn broken_root_files_fail_the_scan_with_the_file_named() {
    let host = SimHost::builder().capacity(TDX, 16).build().expect("host");
    let mut scanner = Scanner::new(host.root());
    for (file, breaker) in [
        ("misc.capacity", "garbage"),
        ("misc.current", "garbage"),
        ("misc.current", "half"),
        ("misc.current", "dir"),
    ] {
        match breaker {
            "garbage" => host.write_garbage(file).expect("garbage"),
            "half" => {
                host.write_raw(file, "tdx").expect("truncated line");
            }
            _ => host.replace_with_dir(file).expect("dir"),
        }
        let err = scanner
            .scan(Interest::All)
            .expect_err(&format!("{file} {breaker}"));
        assert!(err.to_string().contains(file), "{file} {breaker}: {err}");
        host.heal_all().expect("heal");
        scanned(scanner.scan(Interest::All).expect("healed"));
    }
}

#[test]
fn truncated_current_files_are_tolerated_when_empty() {
    // An empty misc.current (a reader racing an in-place rewrite) parses as "no usage", like the kernel
    // file of a cgroup holding nothing; a half line is an error (tested above).
    let host = SimHost::builder().capacity(TDX, 16).build().expect("host");
    host.add_pod(&uid(1), QosClass::Burstable, &["compute"])
        .expect("pod");
    host.start_vm(&uid(1), "compute", TDX).expect("vm");
    host.truncate("misc.current").expect("truncate");
    let scan = scanned(Scanner::new(host.root()).scan(Interest::All).expect("scan"));
    assert!(scan.kernel_used.is_zero());
}

#[test]
fn bad_pod_cgroups_do_not_break_the_scan() {
    let host = SimHost::builder().capacity(TDX, 16).build().expect("host");
    for n in 0..3 {
        host.add_pod(&uid(n), QosClass::Burstable, &["compute"])
            .expect("pod");
        host.start_vm(&uid(n), "compute", TDX).expect("vm");
    }
    // Unreadable: misc.current is a directory (EISDIR, also for root).
    let broken = host.break_pod_misc_current(&uid(0)).expect("break");
    // Garbage in another pod's file.
    let pod1 = host.pod_cgroup_path(&uid(1)).expect("pod1");
    host.write_garbage(pod1.join("misc.current"))
        .expect("garbage");
    // A pod-looking directory without a valid UID, holding a key.
    let bogus = host
        .add_unparsable_pod_dir(QosClass::Burstable, "not_a_uid")
        .expect("bogus");
    host.charge(&bogus, TDX, 1).expect("charge");

    let pods: Vec<Pod> = (0..3).map(|n| pod(n, "Running", 1, false)).collect();
    let report = scan_report(host.root(), &Config::default(), &pods, Some(NODE));
    assert!(report.kernel_readable());
    let c = condition(&report, ct::KERNEL_READABLE);
    assert!(
        c.message.contains("2 pod cgroup(s) could not be read"),
        "{}",
        c.message
    );
    assert!(
        report
            .unreadable_cgroups
            .iter()
            .any(|u| u.contains(&broken.display().to_string())),
        "{:?}",
        report.unreadable_cgroups
    );
    assert_eq!(
        report.skipped_cgroups.len(),
        1,
        "{:?}",
        report.skipped_cgroups
    );
    let t = tdx(&report);
    // Kernel: 3 VMs + the bogus dir. Only pod 2 could be attributed; the unreadable pods' requests
    // count as pending and their keys (and the bogus dir's) as external: conservative both ways.
    assert_eq!(
        (t.kernel_used, t.pods_used, t.external, t.pending, t.free),
        (4, 1, 3, 2, 10)
    );
}

#[test]
fn a_resource_that_disappears() {
    let host = SimHost::builder()
        .capacity(TDX, 16)
        .capacity(SEV_ES, 8)
        .build()
        .expect("host");
    let mut scanner = Scanner::new(host.root());
    let scan = scanned(scanner.scan(Interest::All).expect("scan"));
    assert_eq!(scan.capacity.nonzero().count(), 2);
    host.remove_resource(TDX).expect("remove");
    let scan = scanned(scanner.scan(Interest::All).expect("scan"));
    assert_eq!(
        scan.capacity.nonzero().collect::<Vec<_>>(),
        vec![(TeeKind::SevEs, 8)]
    );
    // A pod cgroup vanishing between listing and reading is just gone.
    host.add_pod(&uid(1), QosClass::Burstable, &["compute"])
        .expect("pod");
    host.start_vm(&uid(1), "compute", SEV_ES).expect("vm");
    host.remove_pod(&uid(1)).expect("remove pod");
    let scan = scanned(scanner.scan(Interest::All).expect("scan"));
    assert!(scan.pods.expect("pods").usage.is_empty());
}

/// On a host whose totals add up (the simulated host updates every level, as the kernel does), the
/// agent reads no pod while the kubepods total matches its last readings, and every pod again when a
/// VM starts or stops or a pod goes away; its figures always equal a fresh scan's.
#[test]
fn unchanged_key_holders_are_not_read_again() {
    for (version, driver) in [
        (CgroupVersion::V2, CgroupDriver::Systemd),
        (CgroupVersion::V1, CgroupDriver::Cgroupfs),
    ] {
        let what = format!("{version:?}/{driver:?}");
        let host = SimHost::builder()
            .version(version)
            .driver(driver)
            .write_mode(WriteMode::InPlace)
            .capacity(TDX, 16)
            .build()
            .expect("host");
        for n in 0..4u32 {
            host.add_pod(&uid(n), QosClass::Burstable, &["compute"])
                .expect("pod");
        }
        for n in 0..3u32 {
            host.start_vm(&uid(n), "compute", TDX).expect("vm");
        }
        let interest: Uids = (0..4).map(uid).collect();
        let mut scanner = Scanner::new(host.root());
        // (pods read, pods taken as unchanged), and the usage equals a fresh scan's.
        let scan = |scanner: &mut Scanner| {
            let kept = scanned(scanner.scan(Interest::Only(&interest)).expect("scan"))
                .pods
                .expect("pods");
            let fresh = scanned(
                Scanner::new(host.root())
                    .scan(Interest::Only(&interest))
                    .expect("fresh scan"),
            )
            .pods
            .expect("pods");
            assert_eq!(kept.usage, fresh.usage, "{what}");
            (kept.pods_read, kept.pods_unchanged)
        };
        assert_eq!(scan(&mut scanner), (4, 0), "{what}: first scan");
        assert_eq!(scan(&mut scanner), (0, 4), "{what}: steady");
        host.start_vm(&uid(3), "compute", TDX).expect("vm");
        assert_eq!(scan(&mut scanner), (4, 0), "{what}: a VM started");
        assert_eq!(scan(&mut scanner), (0, 4), "{what}: steady");
        host.stop_vm(&uid(1), "compute", TDX).expect("stop");
        assert_eq!(scan(&mut scanner), (4, 0), "{what}: a VM stopped");
        host.remove_pod(&uid(2)).expect("remove");
        // Pod 2's cgroup is gone: looked for, not read.
        assert_eq!(scan(&mut scanner), (3, 0), "{what}: a pod removed");
        assert_eq!(scan(&mut scanner), (0, 3), "{what}: steady");
    }
}
