//! Attribution: the figures per accounting mode, counted pods, pod summaries.

use super::*;
use pretty_assertions::assert_eq;
use serde_json::json;
use teeguard_shared::Config;

const TDX: TeeKind = TeeKind::Tdx;
const SEV: TeeKind = TeeKind::Sev;
const ES: TeeKind = TeeKind::SevEs;

fn counts(pairs: &[(TeeKind, u64)]) -> KindCounts {
    KindCounts::from_pairs(pairs.iter().copied())
}

fn pod(uid: &str, phase: PodPhase, req: &[(TeeKind, u64)]) -> PodSummary {
    PodSummary {
        uid: uid.into(),
        name: format!("ns/{uid}"),
        phase,
        requests: counts(req),
        dra_claim: false,
    }
}

fn figures(
    capacity: u64,
    kernel_used: u64,
    pods_used: u64,
    pending: u64,
    free: u64,
) -> KindFigures {
    KindFigures {
        capacity,
        kernel_used,
        pods_used,
        external: kernel_used - pods_used,
        pending,
        free,
    }
}

struct Case {
    name: &'static str,
    capacity: &'static [(TeeKind, u64)],
    kernel: &'static [(TeeKind, u64)],
    accounting: Accounting,
    usage: &'static [(&'static str, &'static [(TeeKind, u64)])],
    pods: Vec<PodSummary>,
    want: Vec<(TeeKind, KindFigures)>,
}

fn run(case: &Case) -> BTreeMap<TeeKind, KindFigures> {
    let usage: HashMap<String, KindCounts> = case
        .usage
        .iter()
        .map(|(uid, c)| (uid.to_string(), counts(c)))
        .collect();
    attribute(&AttributionInput {
        capacity: &counts(case.capacity),
        kernel_used: &counts(case.kernel),
        accounting: &case.accounting,
        pod_usage: &usage,
        pods: &case.pods,
    })
}

#[test]
fn table() {
    use PodPhase::*;
    let cases = vec![
        Case {
            name: "no hardware: no kinds",
            capacity: &[],
            kernel: &[],
            accounting: Accounting::PerPod,
            usage: &[],
            pods: vec![pod("a", Running, &[(TDX, 1)])],
            want: vec![],
        },
        Case {
            name: "idle host",
            capacity: &[(TDX, 16)],
            kernel: &[],
            accounting: Accounting::PerPod,
            usage: &[],
            pods: vec![],
            want: vec![(TDX, figures(16, 0, 0, 0, 16))],
        },
        Case {
            name: "16 keys, 4 KubeVirt VMs, 2 external keys",
            capacity: &[(TDX, 16)],
            kernel: &[(TDX, 6)],
            accounting: Accounting::PerPod,
            usage: &[
                ("vm1", &[(TDX, 1)]),
                ("vm2", &[(TDX, 1)]),
                ("vm3", &[(TDX, 1)]),
                ("vm4", &[(TDX, 1)]),
            ],
            pods: vec![
                pod("vm1", Running, &[(TDX, 1)]),
                pod("vm2", Running, &[(TDX, 1)]),
                pod("vm3", Running, &[(TDX, 1)]),
                pod("vm4", Running, &[(TDX, 1)]),
                pod("web", Running, &[]),
            ],
            want: vec![(TDX, figures(16, 6, 4, 0, 10))],
        },
        Case {
            name: "bound pod not started yet is pending",
            capacity: &[(TDX, 16)],
            kernel: &[(TDX, 1)],
            accounting: Accounting::PerPod,
            usage: &[("vm1", &[(TDX, 1)])],
            pods: vec![
                pod("vm1", Running, &[(TDX, 1)]),
                pod("vm2", Pending, &[(TDX, 1)]),
            ],
            want: vec![(TDX, figures(16, 1, 1, 1, 14))],
        },
        Case {
            name: "running pod whose VM has not charged yet is pending",
            capacity: &[(TDX, 4)],
            kernel: &[],
            accounting: Accounting::PerPod,
            usage: &[],
            pods: vec![pod("vm1", Running, &[(TDX, 1)])],
            want: vec![(TDX, figures(4, 0, 0, 1, 3))],
        },
        Case {
            name: "terminated pods hold nothing and are not pending; their leftover usage is external",
            capacity: &[(TDX, 8)],
            kernel: &[(TDX, 1)],
            accounting: Accounting::PerPod,
            usage: &[("done", &[(TDX, 1)])],
            pods: vec![
                pod("done", Succeeded, &[(TDX, 1)]),
                pod("failed", Failed, &[(TDX, 2)]),
            ],
            want: vec![(TDX, figures(8, 1, 0, 0, 7))],
        },
        Case {
            name: "usage of a pod that does not request the kind is external",
            capacity: &[(TDX, 8)],
            kernel: &[(TDX, 2)],
            accounting: Accounting::PerPod,
            usage: &[("plain", &[(TDX, 2)])],
            pods: vec![pod("plain", Running, &[(SEV, 1)])],
            want: vec![(TDX, figures(8, 2, 0, 0, 6))],
        },
        Case {
            name: "keys beyond the request are external",
            capacity: &[(TDX, 8)],
            kernel: &[(TDX, 3)],
            accounting: Accounting::PerPod,
            usage: &[("kata", &[(TDX, 3)])],
            pods: vec![pod("kata", Running, &[(TDX, 1)])],
            want: vec![(TDX, figures(8, 3, 1, 0, 5))],
        },
        Case {
            name: "partially charged multi-key pod",
            capacity: &[(TDX, 8)],
            kernel: &[(TDX, 1)],
            accounting: Accounting::PerPod,
            usage: &[("multi", &[(TDX, 1)])],
            pods: vec![pod("multi", Running, &[(TDX, 3)])],
            want: vec![(TDX, figures(8, 1, 1, 2, 5))],
        },
        Case {
            name: "pod reads racing ahead of the root read are capped at kernel usage",
            capacity: &[(TDX, 8)],
            kernel: &[(TDX, 1)],
            accounting: Accounting::PerPod,
            usage: &[("a", &[(TDX, 1)]), ("b", &[(TDX, 1)])],
            pods: vec![
                pod("a", Running, &[(TDX, 1)]),
                pod("b", Running, &[(TDX, 1)]),
            ],
            want: vec![(TDX, figures(8, 1, 1, 0, 7))],
        },
        Case {
            name: "free saturates at zero when overcommitted",
            capacity: &[(TDX, 2)],
            kernel: &[(TDX, 2)],
            accounting: Accounting::PerPod,
            usage: &[],
            pods: vec![pod("late", Pending, &[(TDX, 1)])],
            want: vec![(TDX, figures(2, 2, 0, 1, 0))],
        },
        Case {
            name: "kernel usage above capacity (garbage) does not underflow",
            capacity: &[(TDX, 2)],
            kernel: &[(TDX, 5)],
            accounting: Accounting::PerPod,
            usage: &[],
            pods: vec![],
            want: vec![(TDX, figures(2, 5, 0, 0, 0))],
        },
        Case {
            name: "AMD host: kinds are independent",
            capacity: &[(SEV, 99), (ES, 410)],
            kernel: &[(SEV, 3), (ES, 5)],
            accounting: Accounting::PerPod,
            usage: &[
                ("snp1", &[(ES, 1)]),
                ("snp2", &[(ES, 1)]),
                ("sev1", &[(SEV, 1)]),
            ],
            pods: vec![
                pod("snp1", Running, &[(ES, 1)]),
                pod("snp2", Running, &[(ES, 1)]),
                pod("sev1", Running, &[(SEV, 1)]),
                pod("snp3", Pending, &[(ES, 1)]),
            ],
            want: vec![
                (SEV, figures(99, 3, 1, 0, 96)),
                (ES, figures(410, 5, 2, 1, 404)),
            ],
        },
        Case {
            name: "requests for a kind the host lacks are ignored",
            capacity: &[(TDX, 4)],
            kernel: &[],
            accounting: Accounting::PerPod,
            usage: &[],
            pods: vec![pod("snp", Pending, &[(ES, 1)])],
            want: vec![(TDX, figures(4, 0, 0, 0, 4))],
        },
        Case {
            name: "not delegated: running pods counted, capped at kernel usage",
            capacity: &[(TDX, 16)],
            kernel: &[(TDX, 6)],
            accounting: Accounting::RunningPods,
            usage: &[("ignored", &[(TDX, 9)])],
            pods: vec![
                pod("vm1", Running, &[(TDX, 1)]),
                pod("vm2", Running, &[(TDX, 1)]),
                pod("vm3", Running, &[(TDX, 1)]),
                pod("vm4", Running, &[(TDX, 1)]),
                pod("vm5", Pending, &[(TDX, 1)]),
                pod("gone", Succeeded, &[(TDX, 1)]),
            ],
            want: vec![(TDX, figures(16, 6, 4, 1, 9))],
        },
        Case {
            name: "not delegated: more running requests than kernel usage",
            capacity: &[(TDX, 16)],
            kernel: &[(TDX, 1)],
            accounting: Accounting::RunningPods,
            usage: &[],
            pods: vec![
                pod("vm1", Running, &[(TDX, 1)]),
                pod("vm2", Unknown, &[(TDX, 1)]),
            ],
            want: vec![(TDX, figures(16, 1, 1, 0, 15))],
        },
    ];
    for case in &cases {
        let got = run(case);
        let want: BTreeMap<_, _> = case.want.iter().copied().collect();
        assert_eq!(got, want, "case: {}", case.name);
        for f in got.values() {
            assert_eq!(
                f.external + f.pods_used,
                f.kernel_used,
                "invariant, case {}",
                case.name
            );
            assert!(f.free <= f.capacity, "case {}", case.name);
        }
    }
}

#[test]
fn advertisable_is_capacity_minus_external() {
    assert_eq!(figures(16, 6, 4, 0, 10).advertisable(), 14);
    assert_eq!(figures(2, 5, 0, 0, 0).advertisable(), 0);
}

#[test]
fn pod_summary_counts_kata_overhead_and_phase() {
    let cfg = Config::default();
    let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "kata", "namespace": "ns", "uid": "1b4e28ba-2fa1-11d2-883f-0016d3cca427"},
            "spec": {"containers": [{"name": "c"}], "overhead": {"tdx.intel.com/keys": "1"}},
            "status": {"phase": "Running"}
        }))
        .expect("pod");
    let s = PodSummary::from_pod(&p, &cfg.resources)
        .expect("summary")
        .expect("has uid");
    assert_eq!(s.requests, counts(&[(TDX, 1)]));
    assert_eq!(s.phase, PodPhase::Running);
    assert_eq!(s.name, "ns/kata");

    let no_uid: Pod =
        serde_json::from_value(json!({"metadata": {"name": "x"}, "spec": {"containers": []}}))
            .expect("pod");
    assert_eq!(
        PodSummary::from_pod(&no_uid, &cfg.resources).expect("ok"),
        None
    );
}

#[test]
fn phases() {
    assert_eq!(PodPhase::parse(None), PodPhase::Pending);
    assert_eq!(PodPhase::parse(Some("Pending")), PodPhase::Pending);
    assert_eq!(PodPhase::parse(Some("Running")), PodPhase::Running);
    assert_eq!(PodPhase::parse(Some("Succeeded")), PodPhase::Succeeded);
    assert_eq!(PodPhase::parse(Some("Failed")), PodPhase::Failed);
    assert_eq!(PodPhase::parse(Some("Weird")), PodPhase::Unknown);
    assert!(PodPhase::Succeeded.is_terminated() && PodPhase::Failed.is_terminated());
    assert!(!PodPhase::Pending.is_terminated() && !PodPhase::Unknown.is_terminated());
}

#[test]
fn kind_counts_display() {
    assert_eq!(counts(&[(TDX, 2), (ES, 1)]).to_string(), "tdx=2,sev_es=1");
    assert_eq!(KindCounts::ZERO.to_string(), "-");
}

fn counted_of(
    accounting: Accounting,
    kernel: &[(TeeKind, u64)],
    usage: &[(&str, &[(TeeKind, u64)])],
    pods: &[PodSummary],
) -> Vec<(String, bool)> {
    let usage: HashMap<String, KindCounts> = usage
        .iter()
        .map(|(uid, c)| (uid.to_string(), counts(c)))
        .collect();
    counted(&AttributionInput {
        capacity: &counts(&[(TDX, 4), (ES, 4)]),
        kernel_used: &counts(kernel),
        accounting: &accounting,
        pod_usage: &usage,
        pods,
    })
    .into_iter()
    .map(|c| (c.uid, c.pending))
    .collect()
}

#[test]
fn per_pod_accounting_counts_every_live_pod_and_marks_those_still_waiting() {
    let pods = [
        pod("waiting", PodPhase::Pending, &[(TDX, 1)]),
        pod("holding", PodPhase::Running, &[(TDX, 1)]),
        pod("half", PodPhase::Running, &[(TDX, 1), (ES, 1)]),
        pod("done", PodPhase::Succeeded, &[(TDX, 1)]),
        pod("no-keys", PodPhase::Running, &[]),
        pod("other-kind", PodPhase::Pending, &[(SEV, 1)]),
    ];
    let usage: &[(&str, &[(TeeKind, u64)])] = &[("holding", &[(TDX, 1)]), ("half", &[(TDX, 1)])];
    assert_eq!(
        counted_of(Accounting::PerPod, &[(TDX, 2)], usage, &pods),
        [
            ("waiting".to_string(), true),
            ("holding".to_string(), false),
            ("half".to_string(), true),
        ]
    );
}

#[test]
fn running_pod_fallback_counts_running_pods_only_once_the_kernel_shows_their_keys() {
    let pods = [
        pod("a", PodPhase::Running, &[(TDX, 1)]),
        pod("b", PodPhase::Running, &[(TDX, 1)]),
        pod("c", PodPhase::Pending, &[(TDX, 1)]),
        pod("d", PodPhase::Failed, &[(TDX, 1)]),
        pod("e", PodPhase::Unknown, &[(ES, 1)]),
    ];
    // Both running TDX pods' keys are in the kernel's usage: counted as holding them.
    assert_eq!(
        counted_of(Accounting::RunningPods, &[(TDX, 2), (ES, 1)], &[], &pods),
        [
            ("a".to_string(), false),
            ("b".to_string(), false),
            ("c".to_string(), true),
            ("e".to_string(), false),
        ]
    );
    // One running pod's key is not charged yet: which one cannot be told, so neither is listed;
    // the Pending pod is (its key is in `pending`), and so is the SEV-ES pod.
    assert_eq!(
        counted_of(Accounting::RunningPods, &[(TDX, 1), (ES, 1)], &[], &pods),
        [("c".to_string(), true), ("e".to_string(), false)]
    );
}

#[test]
fn summarize_interest_and_errors() {
    let res = ResourcesConfig::default();
    let mk = |uid: &str, phase: &str, q: &str| -> Pod {
        serde_json::from_value(json!({
                "metadata": {"name": uid, "namespace": "ns", "uid": uid},
                "spec": {"nodeName": "n1", "containers": [{"name": "compute", "resources": {"requests": {"tdx.intel.com/keys": q}}}]},
                "status": {"phase": phase}
            }))
            .expect("pod")
    };
    let pods = [
        mk("a", "Running", "1"),
        mk("b", "Succeeded", "1"),
        mk("c", "Pending", "0"),
        mk("d", "Running", "1.5"),
    ];
    let v = summarize(pods.iter(), &res);
    assert_eq!(v.interest, Uids::from_iter(["a".to_string()]));
    assert_eq!(v.pods.len(), 3);
    assert_eq!(
        v.pods[0].requests,
        KindCounts::from_pairs([(TeeKind::Tdx, 1)])
    );
    assert_eq!(v.pods[1].phase, PodPhase::Succeeded);
    assert_eq!(v.errors.len(), 1);
    assert!(v.errors[0].1.contains("ns/d"), "{:?}", v.errors);
}
