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

use kube::ResourceExt;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use kubevirt_support::{KubeVirtWorld, Options, running};
use support::{BATCH, SETTLE, Side, TARGET_RATIO, report_sides, section};
use teeguard_tests::fixtures::Tee;
use teeguard_tests::kubevirt::vmis::Size;

const LABELS: [&str; 2] = ["with teeguard", "without"];

/// Per side: VMI created → pod created, and → pod running.
#[derive(Default)]
struct Samples {
    pod_created: HashMap<Side, Vec<Duration>>,
    running: HashMap<Side, Vec<Duration>>,
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
    let mut samples = Samples::default();
    for round in 0..per_side / BATCH {
        let order = Side::order(round);
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
            batch(&w, round, side, &mut samples).await;
        }
    }
    let what = "VMI CREATE answered → launcher pod";
    report_sides(
        &format!("{what} created"),
        &mut samples.pod_created,
        LABELS,
        TARGET_RATIO,
        None,
    );
    report_sides(
        &format!("{what} running, every container started"),
        &mut samples.running,
        LABELS,
        TARGET_RATIO,
        None,
    );
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
            let Some(vmi) = p.labels().get("kubevirt.io/created-by").map(String::as_str) else {
                continue;
            };
            seen.entry(vmi.to_string()).or_insert(now);
            if running(p) {
                ran.entry(vmi.to_string()).or_insert(now);
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    for (uid, (_, at)) in &created {
        if let Some(t) = seen.get(uid) {
            s.pod_created
                .entry(side)
                .or_default()
                .push(t.saturating_duration_since(*at));
        }
        if let Some(t) = ran.get(uid) {
            s.running
                .entry(side)
                .or_default()
                .push(t.saturating_duration_since(*at));
        }
    }
}
