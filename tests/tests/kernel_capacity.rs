//! The kernel's own answers, scenario 5 (issue 37): the capacity moving under running VMs. In a guest
//! of Debian's Linux 6.1 / 6.12 (`teeguard_tests::teevm`) the agent's `run` (cgroup writer) reports to
//! the real control plane while `fake_tee`'s `sev` parameter (the capacity KVM would set) is lowered
//! below the keys in use, to 0, and raised again. What the kernel does: the lowered capacity takes no
//! key back (usage stays above it), a new charge is refused (`EBUSY`, and `EINVAL` once the capacity is
//! 0: the kind is gone from `misc.capacity` and `misc.max`), and the pods' limits come back with the
//! capacity. The report and the Node's extended resource follow each step: no negative figure, nothing
//! left behind.
//! Skipped (one line) without the kit or the control plane, unless `CI=true`.

mod kernel_support;

use k8s_openapi::api::core::v1::Node;
use kernel_support::agent::{AgentWorld, REPORT_WITHIN};
use kernel_support::{ASIDS, DEADLINE, LAYOUTS, PodCgroup, condition, figure, mkpod, ok, value};
use kube::Api;
use serde_json::Value;
use teeguard_tests::host::{QosClass, libvirt_vm_cgroup};
use teeguard_tests::realcluster::within;
use teeguard_tests::teevm::Kernel;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_linux_6_1_the_report_and_the_node_follow_the_capacity_lowered_below_usage_and_raised_again()
 {
    within(DEADLINE, capacity_moves(Kernel::Linux6_1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_linux_6_12_the_report_and_the_node_follow_the_capacity_lowered_below_usage_and_raised_again()
 {
    within(DEADLINE, capacity_moves(Kernel::Linux6_12)).await;
}

const CONFIG: &str = "enforcement:\n  mode: cgroup\n";

/// The Node's allocatable `sev.amd.com/asids` (`None` when absent).
async fn allocatable(w: &AgentWorld) -> Option<String> {
    let nodes: Api<Node> = Api::all(w.cluster.client.clone());
    let n = nodes.get(&w.node).await.ok()?;
    teeguard_tests::fixtures::node_resource(&n, ASIDS).1
}

async fn wait_allocatable(w: &AgentWorld, want: Option<&str>) {
    let deadline = std::time::Instant::now() + REPORT_WITHIN;
    loop {
        let now = allocatable(w).await;
        if now.as_deref() == want {
            return;
        }
        if std::time::Instant::now() >= deadline {
            panic!(
                "the Node's allocatable {ASIDS} is {now:?}, not {want:?}\n{}",
                w.diagnostics()
            );
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// `(capacity, kernelUsed, podsUsed, external, pending, free, advertised)` of `sev`.
fn sev(s: &Value) -> (u64, u64, u64, u64, u64, u64, u64) {
    let f = |n| figure(s, "sev", n);
    (
        f("capacity"),
        f("kernelUsed"),
        f("podsUsed"),
        f("external"),
        f("pending"),
        f("free"),
        f("advertised"),
    )
}

async fn capacity_moves(kernel: Kernel) {
    let Some(w) = AgentWorld::start(kernel, "kernel-capacity", CONFIG, 4, 2).await else {
        return;
    };
    let g = &w.guest;
    let names = LAYOUTS[0];
    let mut cg: Vec<PodCgroup> = Vec::new();
    for name in ["a", "b", "c"] {
        let p = w.create_pod(&w.ns, name, &[(ASIDS, 1)], &[]).await;
        cg.push(mkpod(g, names, QosClass::Burstable, &p.metadata.uid.expect("uid")).await);
    }
    let max = |i: usize| {
        let pod = cg[i].pod.clone();
        async move { ok(g, g.read_cgroup(&pod, "misc.max").await) }
    };
    w.wait_report("the writer's three pods limited", |s| {
        condition(s, "Enforcing")
            .2
            .contains("3 pods limited, 0 waiting")
    })
    .await;
    let outside = libvirt_vm_cgroup(1, "legacy");
    ok(g, g.mkcgroup(&outside).await);
    let mut vms = vec![
        ok(g, g.start_vm("a", &cg[0].compute, "sev", 1).await),
        ok(g, g.start_vm("b", &cg[1].compute, "sev", 1).await),
        ok(g, g.start_vm("legacy", &outside, "sev", 1).await),
    ];
    for vm in &vms {
        assert_eq!(vm.answers, ["ok"], "{vm:?}");
    }
    // capacity 4: a, b and the VM outside Kubernetes hold 3; c waits for one.
    w.wait_report("capacity 4", |s| sev(s) == (4, 3, 2, 1, 1, 0, 3))
        .await;
    wait_allocatable(&w, Some("3")).await;

    // ---- Lowered below the usage: nothing is taken back ----
    ok(g, g.set_capacity("sev", 2).await);
    assert_eq!(
        value(&ok(g, g.read_cgroup("", "misc.capacity").await), "sev"),
        2
    );
    assert_eq!(
        ok(g, g.usage_of("sev").await),
        3,
        "the kernel took no key back"
    );
    let refused = ok(g, g.try_key(&cg[2].compute, "sev").await);
    assert!(refused.starts_with("refused: EBUSY"), "c's VM: {refused}");
    let s = w
        .wait_report("capacity 2 under 3 keys in use", |s| {
            figure(s, "sev", "capacity") == 2
        })
        .await;
    // free and advertised never below 0: capacity − used and capacity − external, floored.
    assert_eq!(sev(&s), (2, 3, 2, 1, 1, 0, 1), "{s:#}");
    wait_allocatable(&w, Some("1")).await;

    // ---- 0: the kind is gone from misc.capacity and misc.max ----
    ok(g, g.set_capacity("sev", 0).await);
    let capacity = ok(g, g.read_cgroup("", "misc.capacity").await);
    assert_eq!(value(&capacity, "sev"), 0, "{capacity}");
    assert_eq!(value(&capacity, "sev_es"), 2, "{capacity}");
    assert!(
        !max(0).await.contains("sev "),
        "no sev line in misc.max: {}",
        max(0).await
    );
    assert_eq!(
        value(
            &ok(g, g.read_cgroup(&cg[0].pod, "misc.current").await),
            "sev"
        ),
        1,
        "a still holds its key"
    );
    let refused = ok(g, g.try_key(&cg[2].compute, "sev").await);
    assert!(refused.starts_with("refused: EINVAL"), "c's VM: {refused}");
    let s = w
        .wait_report("no sev capacity", |s| {
            s.get("sev").is_none_or(Value::is_null)
        })
        .await;
    assert_eq!(figure(&s, "sev_es", "capacity"), 2, "{s:#}");
    let (_, _, message) = condition(&s, "Enforcing");
    assert!(
        message.contains(
            "asks for sev keys, which this host has no capacity for (misc.capacity: sev_es)"
        ),
        "{message}"
    );
    wait_allocatable(&w, None).await;

    // ---- Raised again: everything follows, the limits too ----
    ok(g, g.set_capacity("sev", 6).await);
    for i in 0..3 {
        assert_eq!(
            value(&max(i).await, "sev"),
            1,
            "pod {i}'s limit: {}",
            max(i).await
        );
    }
    let s = w
        .wait_report("capacity 6", |s| {
            s.get("sev").is_some_and(|k| !k.is_null()) && figure(s, "sev", "capacity") == 6
        })
        .await;
    assert_eq!(sev(&s), (6, 3, 2, 1, 1, 2, 5), "{s:#}");
    wait_allocatable(&w, Some("5")).await;
    let s = w
        .wait_report("the condition without the kind", |s| {
            !condition(s, "Enforcing").2.contains("no capacity for")
        })
        .await;
    assert_eq!(condition(&s, "Enforcing").0, "True");
    let c = ok(g, g.start_vm("c", &cg[2].compute, "sev", 2).await);
    assert_eq!(c.answers[0], "ok", "{c:?}");
    assert_eq!(c.refused(), ["EBUSY"], "c's limit is back: {c:?}");
    vms.push(c);
    w.wait_report("c's key", |s| sev(s) == (6, 4, 3, 1, 0, 2, 5))
        .await;
    for vm in &vms {
        ok(g, g.stop_vm(vm).await);
    }
    w.wait_report("every VM stopped", |s| sev(s) == (6, 0, 0, 0, 3, 3, 6))
        .await;
    wait_allocatable(&w, Some("6")).await;
}
