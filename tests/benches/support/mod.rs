//! What every bench shares: run mode, latency statistics, process RSS/CPU from /proc, printing.
//!
//! Full figures only under `cargo bench` (which passes `--bench`); `TEEGUARD_BENCH_QUICK=1` makes even
//! that a short smoke run. Without `--bench` (e.g. `cargo test --benches`) every bench is a smoke run.

#![allow(dead_code)]

pub mod floor;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use teeguard_tests::prom::{Histogram, Scrape};

/// True for a full run: `--bench` given and `TEEGUARD_BENCH_QUICK` unset (or `0`).
pub fn full_run() -> bool {
    let quick = std::env::var("TEEGUARD_BENCH_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    std::env::args().any(|a| a == "--bench") && !quick
}

/// [`full_run`], saying so when it is a quick run and how to get the full figures of bench `bench`.
pub fn run_mode(bench: &str) -> bool {
    let full = full_run();
    if !full {
        println!("quick run (full figures: `cargo bench -p teeguard-tests --bench {bench}`)");
    }
    full
}

/// Latency statistics of one measured series.
#[derive(Clone, Copy, Debug)]
pub struct Stats {
    pub count: usize,
    pub mean: Duration,
    pub p50: Duration,
    pub p99: Duration,
    pub max: Duration,
}

impl Stats {
    /// From raw samples (sorted in place). Panics on an empty series.
    pub fn from_samples(samples: &mut [Duration]) -> Stats {
        assert!(!samples.is_empty(), "no samples");
        samples.sort_unstable();
        let n = samples.len();
        let total: Duration = samples.iter().sum();
        let at = |q: f64| samples[((n as f64 * q).ceil() as usize).clamp(1, n) - 1];
        Stats {
            count: n,
            mean: total / n as u32,
            p50: at(0.50),
            p99: at(0.99),
            max: samples[n - 1],
        }
    }
}

/// Items per batch of an A/B bench on real components that alternates the sides batch by batch
/// (`kubevirt_start`, `node_start`).
pub const BATCH: usize = 10;
/// The pause before each batch.
pub const SETTLE: Duration = Duration::from_secs(2);
/// Their goal: with / without, at p50 and p99.
pub const TARGET_RATIO: f64 = 1.05;

/// The two sides of an A/B bench on real components: with teeguard's part, and without.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Side {
    With,
    Without,
}

impl Side {
    /// The order of round `round`: which side goes first alternates, so drift falls on both.
    pub fn order(round: usize) -> [Side; 2] {
        if round.is_multiple_of(2) {
            [Side::With, Side::Without]
        } else {
            [Side::Without, Side::With]
        }
    }
}

/// Prints each side's p50/p99/max of `samples` under `what` (`labels`: with, without) and the ratio
/// with/without against `target`, followed by `extra` of the two p50s when given.
pub fn report_sides(
    what: &str,
    samples: &mut std::collections::HashMap<Side, Vec<Duration>>,
    labels: [&str; 2],
    target: f64,
    extra: Option<fn(Duration, Duration) -> String>,
) {
    println!("  {what}:");
    let mut stats = std::collections::HashMap::new();
    for (side, label) in [Side::With, Side::Without].into_iter().zip(labels) {
        let Some(v) = samples.get_mut(&side).filter(|v| !v.is_empty()) else {
            println!("    {label:16} no samples");
            continue;
        };
        let s = Stats::from_samples(v);
        println!(
            "    {label:16} n={:3}  p50 {:>10}  p99 {:>10}  max {:>10}",
            s.count,
            fmt_dur(s.p50),
            fmt_dur(s.p99),
            fmt_dur(s.max)
        );
        stats.insert(side, s);
    }
    if let (Some(a), Some(b)) = (stats.get(&Side::With), stats.get(&Side::Without)) {
        let ratio = |x: Duration, y: Duration| x.as_secs_f64() / y.as_secs_f64();
        println!(
            "    ratio with/without: p50 {:.3}, p99 {:.3} (goal <= {target}){}",
            ratio(a.p50, b.p50),
            ratio(a.p99, b.p99),
            extra
                .map(|f| format!("; {}", f(a.p50, b.p50)))
                .unwrap_or_default()
        );
    }
}

/// A multi-threaded Tokio runtime with `workers` threads (most benches: 2, the machine's cores).
pub fn runtime(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("runtime")
}

/// A multi-threaded Tokio runtime with `workers` threads named `name` (to tell two runtimes' CPU apart).
pub fn named_runtime(workers: usize, name: &str) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .thread_name(name)
        .enable_all()
        .build()
        .expect("runtime")
}

/// A single-threaded Tokio runtime (for measuring one review at a time without cross-thread wakeups).
pub fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// `12.3 µs` / `1.23 ms` / `1.23 s`.
pub fn fmt_dur(d: Duration) -> String {
    let us = d.as_secs_f64() * 1e6;
    if us < 1_000.0 {
        format!("{us:.1} µs")
    } else if us < 1_000_000.0 {
        format!("{:.2} ms", us / 1e3)
    } else {
        format!("{:.2} s", us / 1e6)
    }
}

/// A field of `/proc/<pid>/status` in KiB (`VmRSS`, `VmHWM`).
pub fn proc_status_kib(pid: u32, field: &str) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// User + system CPU time of a whole process (all threads), from `/proc/<pid>/stat` (10 ms ticks).
pub fn proc_cpu(pid: u32) -> Option<Duration> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces) start after the last ')'.
    let rest = &text[text.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, i.e. 11 and 12 after the state field.
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(Duration::from_millis((utime + stime) * 10))
}

/// On-CPU time of this process's threads whose name starts with `prefix` (tokio names its workers
/// after the runtime's `thread_name`), from `/proc/self/task/*/schedstat` (nanoseconds, unlike the
/// 10 ms ticks of `stat`). Threads that ended are not counted: sample around a period in which the
/// runtime's threads live.
pub fn threads_cpu(prefix: &str) -> Duration {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Duration::ZERO;
    };
    let mut total = 0u64;
    for task in tasks.flatten() {
        let dir = task.path();
        let named = std::fs::read_to_string(dir.join("comm")).is_ok_and(|c| c.starts_with(prefix));
        if !named {
            continue;
        }
        total += std::fs::read_to_string(dir.join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or(0);
    }
    Duration::from_nanos(total)
}

/// The directory of the bench executable's profile (`target/release`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    // target/release/deps/<bench>-<hash>
    exe.parent()
        .and_then(|deps| deps.parent())
        .map(PathBuf::from)
        .expect("the bench runs from target/<profile>/deps")
}

/// The name of the running bench target (`target/release/deps/<name>-<hash>`).
fn bench_name() -> Option<String> {
    let exe = std::env::current_exe().ok()?;
    let stem = exe.file_stem()?.to_str()?;
    let (name, _hash) = stem.rsplit_once('-')?;
    Some(name.to_string())
}

/// Build `package`'s release binary `bin` with cargo (a no-op when up to date) and return its path.
///
/// The build selects this bench target of `teeguard-tests` along with the binary, so cargo resolves
/// features exactly as the `cargo bench -p teeguard-tests` that built this bench did (dev-dependencies
/// included). Building the binary alone (`cargo build --release -p <package>`) resolves a smaller
/// feature set, and each bench run would then rebuild part of the shared release tree twice. The
/// variables cargo sets for the running bench are removed first (see
/// [`teeguard_tests::e2e::scrub_cargo_run_env`]).
pub fn release_binary(package: &str, bin: &str) -> PathBuf {
    let dir = profile_dir();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = std::process::Command::new(cargo);
    cmd.args([
        "build",
        "--release",
        "-p",
        "teeguard-tests",
        "-p",
        package,
        "--bin",
        bin,
    ]);
    if let Some(bench) = bench_name() {
        cmd.args(["--bench", &bench]);
    }
    teeguard_tests::e2e::scrub_cargo_run_env(&mut cmd);
    // Same target directory as this bench, whatever CARGO_TARGET_DIR says.
    if let Some(target) = dir.parent() {
        cmd.env("CARGO_TARGET_DIR", target);
    }
    let status = cmd.status().expect("run cargo build");
    assert!(status.success(), "{cmd:?} failed");
    let path = dir.join(bin);
    assert!(path.exists(), "{} missing after the build", path.display());
    path
}

/// Print a section title.
pub fn section(title: &str) {
    println!("\n== {title}");
}

/// CPU time the hypervisor ran something else while this VM's vCPUs wanted to run (`steal` of the
/// `cpu` line of `/proc/stat`, 10 ms ticks) since boot; `None` where it cannot be read.
fn host_steal() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = stat.lines().find(|l| l.starts_with("cpu "))?;
    // cpu user nice system idle iowait irq softirq steal ...
    let ticks: u64 = cpu.split_whitespace().nth(8)?.parse().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

/// Counts the CPU time stolen by the VM's host during a bench run, so figures taken while the host was
/// busy are recognisable: on a shared 2-vCPU VM a few seconds of steal skews every timing.
#[derive(Debug)]
pub struct StealWatch {
    start: Option<Duration>,
    began: Instant,
}

impl StealWatch {
    /// Start counting.
    pub fn start() -> Self {
        StealWatch {
            start: host_steal(),
            began: Instant::now(),
        }
    }

    /// Print the steal since [`StealWatch::start`] next to the wall time, with a warning above 1 % of
    /// the machine's CPU time.
    pub fn report(&self) {
        let wall = self.began.elapsed();
        let (Some(start), Some(now)) = (self.start, host_steal()) else {
            println!("host steal: not readable (/proc/stat)");
            return;
        };
        let stolen = now.saturating_sub(start);
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let share = stolen.as_secs_f64() / (wall.as_secs_f64() * cpus as f64).max(1e-9);
        let verdict = if share > 0.01 {
            "above 1 %: the host was busy, timings of this run are skewed; run again"
        } else {
            "ok"
        };
        println!(
            "host steal during the run: {:.2} s over {:.0} s wall on {cpus} CPUs ({:.1} %): {verdict}",
            stolen.as_secs_f64(),
            wall.as_secs_f64(),
            share * 100.0
        );
    }
}

/// The webhook's latency histogram for `endpoint` (summed over outcomes) in a `/metrics` text; empty
/// when not exported yet.
pub fn admission_histogram(metrics: &str, endpoint: &str) -> Histogram {
    Scrape::parse(metrics)
        .histogram(
            "teeguard_webhook_admission_duration_seconds",
            &[("endpoint", endpoint)],
        )
        .unwrap_or_default()
}
