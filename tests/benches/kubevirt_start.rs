//! What a KubeVirt user feels: a VMI created → its launcher pod running, with and without teeguard, in
//! one run on the same two real nodes (`teeguard_tests::node`: kubelet v1.36 on containerd v2.4) and
//! KubeVirt v1.9.0's own virt-controller (`teeguard_tests::kubevirt`).
//!
//! - with teeguard: the webhook registered with the chart's configurations (mutation adds the key
//!   request, validation checks the node reports), each node's agent reporting and answering NRI with
//!   the VM's `misc.max`; the nodes have a key for every VMI (nothing is refused);
//! - without: no webhook registered, the agents' enforcement off (they only report, which nothing reads).
//!
//! VMIs (half TDX, half SEV-SNP, KubeVirt's sample shape at 1 vCPU / 128 MiB) are created in batches of
//! 10, the two sides alternating batch by batch (and which goes first alternating round by round), so
//! drift on the machine falls on both. Figures per side, p50 / p99: VMI CREATE answered → launcher pod
//! created (virt-controller, admission), and → the pod running with every container started (the
//! scheduler, the kubelet, containerd, NRI); polled every 25 ms. The ratios (with / without) are the
//! figures: goal p50 and p99 <= 1.05.
//!
//! Needs the KubeVirt kit, the real node, the control plane and helm; without them it says so and exits.
//! `cargo bench -p teeguard-tests --bench kubevirt_start` (30 VMIs per side; quick:
//! `TEEGUARD_BENCH_QUICK=1`, 10).

#[path = "../tests/chart_support/mod.rs"]
mod chart_support;
#[path = "../tests/kubevirt_support/mod.rs"]
mod kubevirt_support;
mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use kubevirt_support::{KubeVirtWorld, Options, running};
use support::{Stats, fmt_dur, section};
use teeguard_tests::fixtures::Tee;
use teeguard_tests::kubevirt::vmis::Size;

const BATCH: usize = 10;
/// Pause before each batch (the previous batch's deletion settled).
const SETTLE: Duration = Duration::from_secs(2);
const TARGET_RATIO: f64 = 1.05;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Side {
    With,
    Without,
}

impl Side {
    fn label(self) -> &'static str {
        match self {
            Side::With => "with teeguard",
            Side::Without => "without",
        }
    }
}

/// Per side: VMI created → pod created, and → pod running.
#[derive(Default)]
struct Samples {
    pod_created: Vec<Duration>,
    running: Vec<Duration>,
}

fn main() {
    let full = support::run_mode("kubevirt_start");
    let per_side = if full { 30 } else { 10 };
    support::runtime(2).block_on(run(per_side));
}

async fn run(per_side: usize) {
    section(&format!(
        "VMI created → launcher pod running (KubeVirt v1.9.0's virt-controller, two real nodes), {per_side} VMIs per side, batches of {BATCH}"
    ));
    let mut samples: HashMap<Side, Samples> = HashMap::new();
    for round in 0..per_side / BATCH {
        let order = if round % 2 == 0 {
            [Side::With, Side::Without]
        } else {
            [Side::Without, Side::With]
        };
        for side in order {
            let options = Options {
                teeguard: side == Side::With,
                ..Options::keys(BATCH as u64, BATCH as u64)
            };
            let test = format!("bench-{side:?}-{round}").to_lowercase();
            let Some(w) = KubeVirtWorld::start(&test, options).await else {
                println!(
                    "kubevirt_start: no KubeVirt or real node here (see the line above); nothing measured"
                );
                return;
            };
            if round == 0 && side == order[0] {
                warm_up(&w).await;
            }
            tokio::time::sleep(SETTLE).await;
            let s = samples.entry(side).or_default();
            batch(&w, round, side, s).await;
        }
    }
    for (what, pick) in [
        (
            "VMI CREATE answered → launcher pod created",
            (|s: &mut Samples| &mut s.pod_created) as fn(&mut Samples) -> &mut Vec<Duration>,
        ),
        (
            "VMI CREATE answered → launcher pod running, every container started",
            |s: &mut Samples| &mut s.running,
        ),
    ] {
        println!("  {what}:");
        let mut stats = HashMap::new();
        for side in [Side::With, Side::Without] {
            let Some(v) = samples.get_mut(&side).map(pick).filter(|v| !v.is_empty()) else {
                println!("    {:14} no samples", side.label());
                continue;
            };
            let st = Stats::from_samples(v);
            println!(
                "    {:14} n={:3}  p50 {:>10}  p99 {:>10}  max {:>10}",
                side.label(),
                st.count,
                fmt_dur(st.p50),
                fmt_dur(st.p99),
                fmt_dur(st.max)
            );
            stats.insert(side, st);
        }
        if let (Some(a), Some(b)) = (stats.get(&Side::With), stats.get(&Side::Without)) {
            let ratio = |x: Duration, y: Duration| x.as_secs_f64() / y.as_secs_f64();
            println!(
                "    ratio with/without: p50 {:.3}, p99 {:.3} (goal <= {TARGET_RATIO})",
                ratio(a.p50, b.p50),
                ratio(a.p99, b.p99)
            );
        }
    }
}

/// One VMI of each shape, run and deleted before anything is timed: the virt-api stand-in runs kvtool
/// once per VMI shape (about 4 s of CPU each), which virt-api, a server, would not.
async fn warm_up(w: &KubeVirtWorld) {
    for (name, tee) in [("warm-tdx", Tee::Tdx), ("warm-snp", Tee::Snp)] {
        w.create_vmi(name, tee, Size::SMALL).await;
        w.wait_running(name).await;
        w.delete_vmi(name).await;
    }
}

/// Create [`BATCH`] VMIs (alternating TDX and SNP) and wait until each one's launcher pod runs.
async fn batch(w: &KubeVirtWorld, round: usize, side: Side, s: &mut Samples) {
    let mut created = HashMap::new();
    for i in 0..BATCH {
        let tee = if i % 2 == 0 { Tee::Tdx } else { Tee::Snp };
        let name = format!("r{round}-{side:?}-{i}").to_lowercase();
        let vmi = w.create_vmi(&name, tee, Size::SMALL).await;
        created.insert(
            vmi.metadata.uid.clone().unwrap_or_default(),
            (name, Instant::now()),
        );
    }
    let pods: Api<Pod> = Api::namespaced(w.cluster.client.clone(), &w.ns);
    let mut seen: HashMap<String, Instant> = HashMap::new();
    let mut ran: HashMap<String, Instant> = HashMap::new();
    let deadline = Instant::now() + kubevirt_support::RUN_DEADLINE;
    while ran.len() < created.len() {
        assert!(
            Instant::now() < deadline,
            "{} of {} launcher pods running after {:?}\n{}",
            ran.len(),
            created.len(),
            kubevirt_support::RUN_DEADLINE,
            w.diagnostics()
        );
        let list = match pods
            .list(&ListParams::default().labels("kubevirt.io=virt-launcher"))
            .await
        {
            Ok(l) => l.items,
            Err(e) => {
                eprintln!("list launcher pods: {e}");
                Vec::new()
            }
        };
        let now = Instant::now();
        for p in &list {
            let Some(vmi) = p
                .metadata
                .labels
                .as_ref()
                .and_then(|l| l.get("kubevirt.io/created-by"))
            else {
                continue;
            };
            seen.entry(vmi.clone()).or_insert(now);
            if running(p) {
                ran.entry(vmi.clone()).or_insert(now);
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    for (uid, (_, at)) in &created {
        if let Some(t) = seen.get(uid) {
            s.pod_created.push(t.saturating_duration_since(*at));
        }
        if let Some(t) = ran.get(uid) {
            s.running.push(t.saturating_duration_since(*at));
        }
    }
}
