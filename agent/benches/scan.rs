//! Scan cost on a host with 500 pod cgroups (simulated tree on tmpfs), measured with std::time and the
//! thread's CPU time from /proc/thread-self/schedstat. Run with `cargo bench -p teeguard-agent --bench
//! scan`; without `--bench` (e.g. `cargo test --benches`) it only does a quick smoke run.
//!
//! Figures printed per scenario: wall and CPU time per scan, and CPU per second of agent time at the
//! default 1 s poll interval (= CPU per scan). Target: far below 1 ms of CPU per second.
//!
//! Agent-mode scenarios: the 16 TEE VMs' pods alone request keys, or half the pods do (250: the 16 VMs
//! and 234 Kata pods holding no key, the mix of `cargo bench -p teeguard-tests --bench agent_host`).
//! The agent keeps those pods' `misc.current` open between scans; the first scan opens them. The
//! 250-pod mix is also timed with 100 ms pauses between scans, closer to the agent's one scan per poll
//! (colder CPU caches than back-to-back scans; its CPU figure also counts one read of the schedstat
//! file, ≈ 0.1 ms).

use std::time::{Duration, Instant};

use teeguard_agent::decide::attribution::Uids;
use teeguard_agent::decide::host::{HostState, Interest};
use teeguard_agent::decide::reuse::FULL_READ_EVERY;
use teeguard_agent::kernel::Scanner;
use teeguard_tests::host::{CgroupDriver, CgroupVersion, QosClass, SimHost, TDX};

fn thread_cpu() -> Option<Duration> {
    // The kernel adds the running thread's time to schedstat at scheduler events only; a yield is one,
    // so the figure includes everything up to now (matters for single scans after a sleep).
    std::thread::yield_now();
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = text.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// One measured scan.
fn scan_once(scanner: &mut Scanner, interest: Interest<'_>) {
    std::hint::black_box(scanner.scan(interest).expect("scan"));
}

fn uid(i: usize) -> String {
    format!("{i:08x}-aaaa-4bbb-8ccc-dddddddddddd")
}

struct Tree {
    host: SimHost,
    tee_pods: Uids,
    /// Half the pods: the TEE pods and as many others (Kata pods, whose keys are not held yet).
    half: Uids,
}

fn build(version: CgroupVersion, driver: CgroupDriver, pods: usize, vms: usize) -> Tree {
    let host = SimHost::builder()
        .version(version)
        .driver(driver)
        .capacity(TDX, 64)
        .build()
        .expect("simulated host");
    let mut tee_pods = Uids::default();
    for i in 0..pods {
        let qos = match i % 10 {
            0 => QosClass::Guaranteed,
            1..=2 => QosClass::BestEffort,
            _ => QosClass::Burstable,
        };
        host.add_pod(&uid(i), qos, &["app", "sidecar"])
            .expect("pod");
    }
    // TEE VMs in burstable pods (virt-launcher pods are burstable).
    for i in (0..pods).filter(|i| i % 10 >= 3).take(vms) {
        host.add_container(&uid(i), "compute").expect("compute");
        host.start_vm(&uid(i), "compute", TDX).expect("vm");
        tee_pods.insert(uid(i));
    }
    host.add_external("outside", TDX, 2).expect("external");
    let mut half = tee_pods.clone();
    half.extend(
        (0..pods)
            .map(uid)
            .filter(|u| !tee_pods.contains(u))
            .take(pods / 2 - vms.min(pods / 2)),
    );
    Tree {
        host,
        tee_pods,
        half,
    }
}

fn measure(name: &str, iterations: u32, mut f: impl FnMut()) {
    f(); // warm the dentry cache
    let cpu0 = thread_cpu();
    let t0 = Instant::now();
    for _ in 0..iterations {
        f();
    }
    let wall = t0.elapsed() / iterations;
    let cpu = match (cpu0, thread_cpu()) {
        (Some(a), Some(b)) => Some((b - a) / iterations),
        _ => None,
    };
    match cpu {
        Some(cpu) => println!(
            "{name:<92} wall {:>8.1} µs/scan  cpu {:>8.1} µs/scan  = {:.3} ms CPU per second at 1 s polls",
            wall.as_secs_f64() * 1e6,
            cpu.as_secs_f64() * 1e6,
            cpu.as_secs_f64() * 1e3,
        ),
        None => println!("{name:<92} wall {:>8.1} µs/scan", wall.as_secs_f64() * 1e6),
    }
}

/// Like [`measure`], but with a pause between scans, as the agent runs (one scan per poll): CPU caches
/// and TLBs are no longer warm from the previous scan. Only the scans are timed.
fn measure_spaced(name: &str, scans: u32, gap: Duration, mut f: impl FnMut()) {
    f();
    let (mut wall, mut cpu) = (Duration::ZERO, Some(Duration::ZERO));
    for _ in 0..scans {
        std::thread::sleep(gap);
        let cpu0 = thread_cpu();
        let t0 = Instant::now();
        f();
        wall += t0.elapsed();
        cpu = match (cpu, cpu0, thread_cpu()) {
            (Some(sum), Some(a), Some(b)) => Some(sum + (b - a)),
            _ => None,
        };
    }
    let wall = wall / scans;
    match cpu.map(|c| c / scans) {
        Some(cpu) => println!(
            "{name:<92} wall {:>8.1} µs/scan  cpu {:>8.1} µs/scan",
            wall.as_secs_f64() * 1e6,
            cpu.as_secs_f64() * 1e6,
        ),
        None => println!("{name:<92} wall {:>8.1} µs/scan", wall.as_secs_f64() * 1e6),
    }
}

fn main() {
    let full = std::env::args().any(|a| a == "--bench");
    let (pods, vms, iterations) = if full { (500, 16, 2000) } else { (20, 4, 3) };
    let (spaced, gap) = if full {
        (30, Duration::from_millis(100))
    } else {
        (3, Duration::from_millis(1))
    };
    if !full {
        println!("smoke run (use `cargo bench -p teeguard-agent --bench scan` for figures)");
    }
    for (version, driver) in [
        (CgroupVersion::V2, CgroupDriver::Systemd),
        (CgroupVersion::V1, CgroupDriver::Cgroupfs),
    ] {
        let tree = build(version, driver, pods, vms);
        let mut scanner = Scanner::new(tree.host.root());
        let check = |state: HostState| match state {
            HostState::Scanned(s) => {
                assert_eq!(
                    s.kernel_used.get(teeguard_shared::TeeKind::Tdx) as usize,
                    vms + 2
                )
            }
            other => panic!("{other:?}"),
        };
        check(scanner.scan(Interest::All).expect("scan"));
        let label = format!("{version:?}/{driver:?}, {pods} pods, {vms} VMs");
        // The agent's scanner by default (a steady host: pods not read while the kubepods total adds
        // up, every pod read every FULL_READ_EVERY-th scan; the figure is the mean over both) and one
        // that reads every pod at every scan (what a poll right after a VM started or stopped costs).
        for (how, every) in [
            (
                format!("full read every {FULL_READ_EVERY} scans, mean"),
                FULL_READ_EVERY,
            ),
            ("every pod read at every scan".to_string(), 1),
        ] {
            let mut scanner = Scanner::new(tree.host.root()).full_read_every(every);
            measure(
                &format!("{label}: agent, {} TEE pods; {how}", tree.tee_pods.len()),
                iterations,
                || scan_once(&mut scanner, Interest::Only(&tree.tee_pods)),
            );
            let mut scanner = Scanner::new(tree.host.root()).full_read_every(every);
            measure(
                &format!(
                    "{label}: agent, {} pods request keys; {how}",
                    tree.half.len()
                ),
                iterations,
                || scan_once(&mut scanner, Interest::Only(&tree.half)),
            );
            measure_spaced(
                &format!(
                    "{label}: agent, {} pods, one scan per {gap:?}; {how}",
                    tree.half.len()
                ),
                spaced,
                gap,
                || scan_once(&mut scanner, Interest::Only(&tree.half)),
            );
        }
        measure(
            &format!("{label}: every pod (`scan` subcommand)"),
            iterations,
            || scan_once(&mut scanner, Interest::All),
        );
        let none = Uids::default();
        measure(&format!("{label}: no TEE pods bound"), iterations, || {
            scan_once(&mut scanner, Interest::Only(&none))
        });
    }
    let idle = build(CgroupVersion::V2, CgroupDriver::Systemd, pods, 0);
    let mut scanner = Scanner::new(idle.host.root());
    measure(
        &format!("V2/Systemd, {pods} pods, idle host (pruned at kubepods)"),
        iterations,
        || scan_once(&mut scanner, Interest::All),
    );
}
