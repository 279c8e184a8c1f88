//! The kernel's own answers, scenario 3 (issue 37): the NRI path's output on a real kernel. The OCI
//! configs the real containerd v2.4 and CRI-O 1.37 produced on the real node (`teeguard_tests::node`,
//! recorded by `runc-record`, the agent answering over NRI from a simulated delegated host) for a TDX
//! and an SEV-SNP launcher's `compute` container are run with Debian's runc in guests of Linux 6.1 and
//! 6.12 (`teeguard_tests::teevm::oci` keeps their cgroup resources, `cgroupsPath` and namespaces; `tdx`,
//! a kind neither kernel has, is mapped to `sev`): runc writes `misc.max`, the VM gets its key and no
//! second. Then `sev_es` is disabled as firmware would (the simulated host's capacity, and the guest's)
//! while NFD still advertises the resource: the agent's answer for an SEV-SNP pod sets no `misc.max`
//! (the `Enforcing` condition and an Event say so), and that container starts in the guest, where the
//! kernel itself refuses the VM's key (`EINVAL`); the answer the agent gave before (`sev_es 1`) makes
//! runc refuse to start it (`unable to set unified resource "misc.max"`).
//!
//! containerd itself is not run in the guest: the busybox initramfs has no image store, CNI or shim,
//! and the recorded configs are what containerd hands runc, which is what the kernel sees.
//! Skipped (one line) without the node's binaries, the kit or root, unless `CI=true`.

mod chart_support;
mod kernel_support;
mod node_support;

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kernel_support::{DEADLINE, boot, ok};
use kube::Api;
use node_support::scenarios::ESIDS;
use node_support::{NodeWorld, Options, unguarded_namespace};
use serde_json::{Value, json};
use teeguard_shared::TeeCapacity;
use teeguard_tests::fixtures::{TDX_KEYS, Tee};
use teeguard_tests::host::SEV_ES;
use teeguard_tests::node::{ContainerKind, Recorded, Runtime, pods};
use teeguard_tests::patch::MergePatch;
use teeguard_tests::realcluster::{advertise, within};
use teeguard_tests::teevm::oci::runnable_in_guest;
use teeguard_tests::teevm::shell::misc_lines;
use teeguard_tests::teevm::{Guest, GuestOptions, Kernel};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn containerds_launcher_configs_give_each_vm_one_key_on_linux_6_1_and_6_12_and_never_a_line_runc_cannot_write()
 {
    within(DEADLINE, nri_output(Runtime::Containerd)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cri_os_launcher_configs_give_each_vm_one_key_on_linux_6_1_and_6_12_and_never_a_line_runc_cannot_write()
 {
    within(DEADLINE, nri_output(Runtime::Crio)).await;
}

/// The configs one runtime produced.
struct Configs {
    tdx: Value,
    snp: Value,
    /// An SEV-SNP pod's `compute` on the host whose `sev_es` is disabled, as the agent answered.
    disabled: Value,
}

fn compute(records: &[Recorded]) -> &Recorded {
    records
        .iter()
        .find(|r| r.kind == ContainerKind::Container && r.container == "compute")
        .unwrap_or_else(|| panic!("no compute config in {records:?}"))
}

async fn nri_output(runtime: Runtime) {
    // A kit is needed as much as the node: check it first.
    if teeguard_tests::teevm::Kit::get(Kernel::Linux6_1).is_none() {
        return;
    }
    let Some(configs) = record(runtime).await else {
        return;
    };
    for kernel in Kernel::ALL {
        run_in_guest(kernel, runtime, &configs).await;
    }
}

/// On the real node: the two launchers, then `sev_es` disabled and an SEV-SNP pod past the webhook.
async fn record(runtime: Runtime) -> Option<Configs> {
    // One test name per runtime: a test's pods select the Node labelled with it.
    let test = format!("kernel-runc-{}", runtime.name());
    let w = NodeWorld::start(runtime, &test, Options::simulated()).await?;
    w.wait_allocatable(TDX_KEYS, "4", Duration::from_secs(20))
        .await;
    w.wait_allocatable(ESIDS, "4", Duration::from_secs(20))
        .await;
    let mut launched = Vec::new();
    for (vm, tee, want) in [
        ("tdx-vm", Tee::Tdx, "tdx 1"),
        ("snp-vm", Tee::Snp, "sev_es 1"),
    ] {
        let pod = w
            .create_vm(vm, tee)
            .await
            .unwrap_or_else(|e| panic!("{vm} refused: {e}\n{}", w.diagnostics()));
        let pod = w.wait_running(&pod).await;
        let c = compute(&w.records(&pod).await).clone();
        assert_eq!(c.misc_max(), Some(want), "{vm}'s compute");
        launched.push(c.config);
    }

    // sev_es ASIDs disabled in firmware: the capacity goes; NFD still advertises the resource.
    w.host
        .as_ref()
        .expect("a simulated host")
        .set_capacity(SEV_ES, 0)
        .expect("sev_es capacity 0");
    let reports: Api<TeeCapacity> = Api::all(w.cluster.client.clone());
    w.cluster
        .wait_for("the report without sev_es", || async {
            let s = reports.get(&w.turn.name).await.ok()?.status?;
            s.sev_es.is_none().then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", w.diagnostics()));
    w.cluster
        .wait_for("the agent's esids gone from the Node", || async {
            w.allocatable(ESIDS).await.is_none().then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", w.diagnostics()));
    let nodes: Api<Node> = Api::all(w.cluster.client.clone());
    nodes
        .merge_patch(
            &w.turn.name,
            json!({"metadata": {"annotations": {
                "nfd.node.kubernetes.io/extended-resources": ESIDS}}}),
        )
        .await
        .expect("NFD's annotation");
    advertise(&w.cluster.client, &w.turn.name, &[(ESIDS, json!("4"))])
        .await
        .expect("NFD's value");
    w.wait_allocatable(ESIDS, "4", Duration::from_secs(20))
        .await;
    // Past the webhook (it would refuse an SEV-SNP VM on a node reporting no sev_es capacity).
    let ns = unguarded_namespace(&w.cluster, "kernel-runc-nfd").await;
    let pod = pods::plain(
        &ns,
        "snp-nfd",
        &[("compute", &[(ESIDS, "1")])],
        &w.selector(),
    );
    let pod = w.run(&pod).await;
    let disabled = compute(&w.records(&pod).await).clone();
    assert_eq!(
        disabled.misc_max(),
        None,
        "no misc.max line for sev_es on a host without sev_es capacity: {:?}",
        disabled.unified
    );
    w.event_message(
        &ns,
        "snp-nfd",
        "TEEKeyKindUnavailable",
        &["container compute", "asks for sev_es keys"],
    )
    .await;
    let enforcing = w.condition("Enforcing").await;
    assert!(
        enforcing
            .message
            .contains("asks for sev_es keys, which this host has no capacity for"),
        "{}",
        enforcing.message
    );
    let mut launched = launched.into_iter();
    Some(Configs {
        tdx: launched.next().expect("tdx"),
        snp: launched.next().expect("snp"),
        disabled: disabled.config,
    })
}

/// The container cgroup's misc file on one line (`sev 1;sev_es max`).
async fn line(g: &Guest, cgroup: &str, file: &str) -> String {
    misc_lines(&ok(g, g.read_cgroup(cgroup, file).await))
        .into_iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(";")
}

async fn run_in_guest(kernel: Kernel, runtime: Runtime, configs: &Configs) {
    let what = format!("{} on {kernel}", runtime.name());
    let Some(g) = boot(
        kernel,
        GuestOptions {
            runc: true,
            ..GuestOptions::default()
        },
    )
    .await
    else {
        return;
    };
    ok(&g, g.load_fake_tee(4, 2).await);
    let minor = ok(&g, g.fake_tee_minor().await);
    for (name, recorded, kind, max) in [
        ("tdx", &configs.tdx, "sev", "sev 1;sev_es max"),
        ("snp", &configs.snp, "sev_es", "sev max;sev_es 1"),
    ] {
        let config = runnable_in_guest(recorded, kind, 2, minor, &[("tdx", "sev")]);
        let c = ok(&g, g.runc_run(name, &config).await);
        assert_eq!(c.vm.answers[0], "ok", "{what}, {name}: {:?}", c.vm);
        assert_eq!(c.vm.refused(), ["EBUSY"], "{what}, {name}: the second key");
        assert_eq!(
            line(&g, &c.vm.cgroup, "misc.max").await,
            max,
            "{what}, {name}: runc wrote misc.max"
        );
        let events = line(&g, &c.vm.cgroup, "misc.events").await;
        assert!(
            events.contains(&format!("{kind}.max 1")),
            "{what}, {name}: {events}"
        );
        ok(&g, g.runc_stop(&c).await);
        assert_eq!(
            ok(&g, g.usage_of(kind).await),
            0,
            "{what}, {name}: the key given back"
        );
    }

    // sev_es disabled: the agent's answer starts, the kernel refuses the VM's key itself.
    ok(&g, g.set_capacity("sev_es", 0).await);
    let config = runnable_in_guest(&configs.disabled, "sev_es", 1, minor, &[]);
    let c = ok(&g, g.runc_run("disabled", &config).await);
    assert_eq!(
        c.vm.refused(),
        ["EINVAL"],
        "{what}: no sev_es capacity: {:?}",
        c.vm
    );
    ok(&g, g.runc_stop(&c).await);
    // The answer the agent gave before it kept to the host's kinds: runc cannot start the container.
    let mut before = config.clone();
    before["linux"]["resources"]["unified"] = json!({"misc.max": "sev_es 1"});
    let out = ok(&g, g.runc_refuses("disabled-before", &before).await);
    assert!(
        // runc logs it quoted: `msg="… unable to set unified resource \"misc.max\": … invalid argument"`
        out.contains(r#"unable to set unified resource \"misc.max\""#)
            && out.contains("invalid argument"),
        "{what}: {out}"
    );
}
