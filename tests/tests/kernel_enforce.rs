//! The kernel's own answers, scenarios 2 and 4 (issue 37), in one guest per kernel: the agent's `run`
//! (cgroup writer, strict mode) in a guest of Debian's Linux 6.1 / 6.12 (`teeguard_tests::teevm`),
//! reporting to the real control plane on the host through QEMU's user-mode network. The host has
//! `sev` keys and no `sev_es` capacity.
//!
//! - Enforcement: a pod limited to one key gets one and the kernel refuses the second (`EBUSY`); a
//!   keyless pod's VM is refused (strict mode); an exempt pod and a pod of an exempt namespace are
//!   untouched; no line is written for the kind without capacity (an SEV-SNP pod gets none, the
//!   condition and an Event say so, and the kernel itself refuses its VM's `sev_es` key with `EINVAL`).
//! - Failed charges: the agent notices the refusals through `misc.events` (inotify on the real
//!   cgroupfs: its re-scan counter rises) and reports them where the kernel counted them: in the pods
//!   (their Events, the report's `refusedCharges.pods`), in kubepods when the pods together filled the
//!   node (no pod counts that one), and nowhere when the node is full because of a VM outside
//!   Kubernetes (the kernel counts a refusal at the root in no file; the report still shows the node
//!   full and the refused pod pending).
//!
//! The guest reaches the API server only through the forward (checked: no default route, the host's
//! address answers nothing).
//!
//! Skipped (one line) without the kit or the control plane, unless `CI=true`.

mod kernel_support;

use kernel_support::agent::AgentWorld;
use kernel_support::{ASIDS, DEADLINE, ESIDS, LAYOUTS, PodCgroup, condition, figure, mkpod, ok};
use serde_json::Value;
use teeguard_tests::host::{QosClass, libvirt_vm_cgroup};
use teeguard_tests::realcluster::within;
use teeguard_tests::teevm::shell::{Vm, misc_lines};
use teeguard_tests::teevm::{Guest, Kernel};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_linux_6_1_the_agent_limits_pods_strictly_spares_exempt_ones_and_reports_refusals_where_counted()
 {
    within(DEADLINE, enforcement_and_refusals(Kernel::Linux6_1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_linux_6_12_the_agent_limits_pods_strictly_spares_exempt_ones_and_reports_refusals_where_counted()
 {
    within(DEADLINE, enforcement_and_refusals(Kernel::Linux6_12)).await;
}

const CONFIG: &str = "agent:\n  pollInterval: 2s\n  heartbeatInterval: 5s\nenforcement:\n  mode: cgroup\n  strict: true\n";
/// `sev` keys; the host has no `sev_es` capacity.
const SEV: u64 = 4;

/// The guest's view of a pod cgroup's `misc.max`, on one line (`sev 1`).
async fn misc_max(g: &Guest, cg: &PodCgroup) -> String {
    let text = ok(g, g.read_cgroup(&cg.pod, "misc.max").await);
    misc_lines(&text)
        .into_iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(";")
}

/// Wait until the pod cgroup's `misc.max` is `want` (the cgroup writer's work, seen in the kernel).
async fn wait_misc_max(w: &AgentWorld, cg: &PodCgroup, want: &str) {
    let deadline = std::time::Instant::now() + kernel_support::agent::REPORT_WITHIN;
    loop {
        let now = misc_max(&w.guest, cg).await;
        if now == want {
            return;
        }
        if std::time::Instant::now() >= deadline {
            panic!(
                "{}/misc.max is {now:?}, not {want:?}\n{}",
                cg.pod,
                w.diagnostics()
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// The report's `refusedCharges` of `sev` as `(pods, kubepods, outside)`.
fn refused(status: &Value) -> (u64, u64, u64) {
    let r = &status["sev"]["refused"];
    let n = |f: &str| r[f].as_u64().unwrap_or(0);
    (n("pods"), n("kubepods"), n("outside"))
}

/// `teeguard_agent_events_rescans_total` from the agent's admin port in the guest.
async fn rescans(w: &AgentWorld) -> u64 {
    let out = ok(
        &w.guest,
        w.guest
            .sh("wget -qO- http://127.0.0.1:8081/metrics | grep '^teeguard_agent_events_rescans_total '; true")
            .await,
    );
    out.split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

async fn enforcement_and_refusals(kernel: Kernel) {
    let Some(w) = AgentWorld::start(kernel, "kernel-enforce", CONFIG, SEV, 0).await else {
        return;
    };
    let g = &w.guest;
    // The guest's only way out is the forward to the API server: no default route, and the API
    // server's port on the host is not reachable at QEMU's host address (`restrict=on`).
    let routes = ok(g, g.sh("ip route").await);
    assert!(
        !routes.contains("default") && routes.lines().count() == 1,
        "{routes}"
    );
    let port = w.cluster.cp.url.rsplit(':').next().unwrap_or_default();
    let direct = ok(
        g,
        g.sh(&format!(
            "nc -w 3 10.0.2.2 {port} </dev/null >/dev/null 2>&1 && echo reached || echo not reached"
        ))
        .await,
    );
    assert_eq!(direct.trim(), "not reached", "10.0.2.2:{port}");
    // The writer on 6.1 with the kubelet's cgroupfs layout, on 6.12 with its systemd layout.
    let names = match kernel {
        Kernel::Linux6_1 => LAYOUTS[0],
        Kernel::Linux6_12 => LAYOUTS[1],
    };
    let exempt_ns = w
        .cluster
        .namespace(
            "kernel-enforce",
            "kernel-enforce-exempt",
            &[("teeguard.dev/exempt", "true")],
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let ns = w.ns.clone();
    let pods = [
        (ns.as_str(), "vm", vec![(ASIDS, 1)], vec![]),
        (ns.as_str(), "keyless", vec![], vec![]),
        (
            ns.as_str(),
            "exempt",
            vec![],
            vec![("teeguard.dev/exempt", "true")],
        ),
        (exempt_ns.as_str(), "other", vec![], vec![]),
        (ns.as_str(), "snp", vec![(ESIDS, 1)], vec![]),
        (ns.as_str(), "filler", vec![(ASIDS, 1)], vec![]),
        (ns.as_str(), "late", vec![(ASIDS, 1)], vec![]),
    ];
    let mut cgroups = std::collections::BTreeMap::new();
    for (pod_ns, name, requests, labels) in &pods {
        let p = w.create_pod(pod_ns, name, requests, labels).await;
        let uid = p.metadata.uid.clone().expect("uid");
        // The kubelet creates the pod's cgroup, then the runtime the container's.
        cgroups.insert(*name, mkpod(g, names, QosClass::Burstable, &uid).await);
    }
    let cg = |name: &str| cgroups[name].clone();

    // ---- Enforcement ----
    // The writer's work, seen in the kernel's files: the request, strict mode's 0 (the host's kind
    // only: sev_es has no capacity, so no line), and nothing for the exempt pods.
    for (name, want) in [
        ("vm", "sev 1"),
        ("keyless", "sev 0"),
        ("snp", "sev 0"),
        ("filler", "sev 1"),
        ("late", "sev 1"),
    ] {
        wait_misc_max(&w, &cg(name), want).await;
    }
    let status = w
        .wait_report("the writer's five pods limited", |s| {
            condition(s, "Enforcing")
                .2
                .contains("5 pods limited, 0 waiting")
        })
        .await;
    for name in ["exempt", "other"] {
        assert_eq!(misc_max(g, &cg(name)).await, "sev max", "{name}: untouched");
    }
    let (enforcing, reason, message) = condition(&status, "Enforcing");
    assert_eq!(
        (enforcing.as_str(), reason.as_str()),
        ("True", "CgroupWriter"),
        "{message}"
    );
    assert!(
        message.contains(
            "/snp asks for sev_es keys, which this host has no capacity for (misc.capacity: sev)"
        ),
        "{message}"
    );
    assert!(
        !message.contains("last failure"),
        "no line the kernel refused: {message}"
    );
    let note = w.wait_event(&ns, "snp", "TEEKeyKindUnavailable").await;
    assert!(note.contains("no misc.max line is set for them"), "{note}");
    for (pod_ns, name, _, _) in &pods {
        let events = w.events(pod_ns, name).await;
        assert!(
            !events.iter().any(|(r, _)| r == "TEEKeyLimitFailed"),
            "{name}: {events:?}"
        );
    }
    assert!(
        w.log_lines("cannot write the pod's misc.max; retrying at the next poll")
            .is_empty(),
        "{}",
        w.diagnostics()
    );

    // The VMs: the kernel's answers.
    let vm = ok(g, g.start_vm("vm", &cg("vm").compute, "sev", 2).await);
    assert_eq!(vm.answers[0], "ok", "{vm:?}");
    assert_eq!(vm.refused(), ["EBUSY"], "the second key: {vm:?}");
    let keyless = ok(
        g,
        g.start_vm("keyless", &cg("keyless").compute, "sev", 1)
            .await,
    );
    assert_eq!(keyless.refused(), ["EBUSY"], "strict mode: {keyless:?}");
    let exempt = ok(
        g,
        g.start_vm("exempt", &cg("exempt").compute, "sev", 1).await,
    );
    assert_eq!(exempt.answers, ["ok"], "{exempt:?}");
    let other = ok(g, g.start_vm("other", &cg("other").compute, "sev", 1).await);
    assert_eq!(other.answers, ["ok"], "{other:?}");
    let snp = ok(g, g.start_vm("snp", &cg("snp").compute, "sev_es", 1).await);
    assert_eq!(snp.refused(), ["EINVAL"], "no sev_es capacity: {snp:?}");

    // ---- Refusals in pods: counted in their cgroups ----
    // vm's second key and keyless's key were refused at those pods' limits.
    w.wait_report("the pods' refusals, vm's, exempt's and other's keys", |s| {
        refused(s) == (2, 0, 0) && figure(s, "sev", "kernelUsed") == 3
    })
    .await;
    assert!(
        rescans(&w).await >= 1,
        "inotify on the real misc.events woke the agent\n{}",
        w.diagnostics()
    );
    for name in ["vm", "keyless"] {
        let m = w.wait_event(&ns, name, "TEEKeyRefused").await;
        assert!(m.contains("the kernel refused 1 sev key(s)"), "{name}: {m}");
        let events = ok(g, g.read_cgroup(&cg(name).pod, "misc.events").await);
        assert_eq!(
            kernel_support::value(&events, "sev.max"),
            1,
            "{name}: {events}"
        );
    }

    // ---- The node full of pods: counted in kubepods, in no pod ----
    let filler = ok(
        g,
        g.start_vm("filler", &cg("filler").compute, "sev", 1).await,
    );
    assert_eq!(filler.answers, ["ok"]);
    let late = ok(g, g.start_vm("late", &cg("late").compute, "sev", 1).await);
    assert_eq!(late.refused(), ["EBUSY"], "the node is full: {late:?}");
    let late_events = ok(g, g.read_cgroup(&cg("late").pod, "misc.events").await);
    assert_eq!(
        kernel_support::value(&late_events, "sev.max"),
        0,
        "not counted in the pod"
    );
    let kubepods_events = ok(g, g.read_cgroup(&names.kubepods(), "misc.events").await);
    assert_eq!(
        kernel_support::value(&kubepods_events, "sev.max"),
        3,
        "{kubepods_events}"
    );
    let status = w
        .wait_report("the node-full refusal", |s| refused(s) == (2, 1, 0))
        .await;
    assert_eq!(
        (
            figure(&status, "sev", "kernelUsed"),
            figure(&status, "sev", "free")
        ),
        (SEV, 0),
        "{status:#}"
    );

    // ---- The node full because of a VM outside Kubernetes: counted in no file ----
    ok(g, g.stop_vm(&filler).await);
    let outside = libvirt_vm_cgroup(1, "legacy");
    ok(g, g.mkcgroup(&outside).await);
    let legacy = ok(g, g.start_vm("legacy", &outside, "sev", 1).await);
    assert_eq!(legacy.answers, ["ok"]);
    let late2 = ok(g, g.start_vm("late2", &cg("late").compute, "sev", 1).await);
    assert_eq!(late2.refused(), ["EBUSY"], "the node is full: {late2:?}");
    let kubepods_events = ok(g, g.read_cgroup(&names.kubepods(), "misc.events").await);
    assert_eq!(
        kernel_support::value(&kubepods_events, "sev.max"),
        3,
        "refused at the root: not counted in kubepods ({kubepods_events})"
    );
    let status = w
        .wait_report("the node full with a key held outside Kubernetes", |s| {
            // exempt's, other's (they request none) and legacy's keys
            figure(s, "sev", "external") == 3 && figure(s, "sev", "free") == 0
        })
        .await;
    assert_eq!(
        refused(&status),
        (2, 1, 0),
        "no file counted it: {status:#}"
    );
    assert_eq!(
        figure(&status, "sev", "pending"),
        2,
        "filler and late wait for their keys: {status:#}"
    );
    for vm in [&vm, &keyless, &exempt, &other, &snp, &late, &late2, &legacy] {
        stop(g, vm).await;
    }
}

async fn stop(g: &Guest, vm: &Vm) {
    ok(g, g.stop_vm(vm).await);
}
