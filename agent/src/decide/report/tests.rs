//! The report: conditions, status and transition times, when to write, heartbeat slots, counted pods.

use super::*;
use crate::decide::advertise::{KindAdvert, Manager};
use crate::decide::attribution::PodPhase;
use crate::decide::host::{Driver, HostScan, PodScan, Refusals};
use pretty_assertions::assert_eq;
use std::path::PathBuf;
use teeguard_shared::misc::CgroupLayout;
use teeguard_shared::names::{conditions as ct, reasons};

pub(super) fn scan(
    capacity: &[(TeeKind, u64)],
    kernel: &[(TeeKind, u64)],
    accounting: Accounting,
) -> HostState {
    HostState::Scanned(HostScan {
        misc_dir: PathBuf::from("/host/sys/fs/cgroup"),
        layout: CgroupLayout::V2,
        capacity: KindCounts::from_pairs(capacity.iter().copied()),
        kernel_used: KindCounts::from_pairs(kernel.iter().copied()),
        usage_source: UsageSource::Root,
        refusals: Refusals::default(),
        pods: Some(PodScan {
            kubepods: Some(PathBuf::from("/host/sys/fs/cgroup/kubepods.slice")),
            driver: Some(Driver::Systemd),
            accounting_reason: match accounting {
                Accounting::PerPod => "pod cgroups carry misc.current".into(),
                Accounting::RunningPods => "kubepods.slice/misc.current does not exist".into(),
            },
            accounting,
            usage: HashMap::from([(
                "vm1".to_string(),
                KindCounts::from_pairs([(TeeKind::Tdx, 1)]),
            )]),
            pods_read: 1,
            pods_unchanged: 0,
            skipped: vec![],
            skipped_count: 0,
            problems: vec![],
            problem_count: 0,
        }),
    })
}

pub(super) fn ts(s: i64) -> Timestamp {
    Timestamp::from_second(s).expect("ts")
}

pub(super) fn outcome(per_kind: &[(TeeKind, KindAdvert)]) -> AdvertiseOutcome {
    AdvertiseOutcome {
        enabled: true,
        per_kind: per_kind.iter().cloned().collect(),
        error: None,
    }
}

pub(super) fn find<'a>(s: &'a [ConditionSpec], t: &str) -> Option<&'a ConditionSpec> {
    s.iter().find(|c| c.type_ == t)
}

#[test]
fn conditions_table() {
    let res = ResourcesConfig::default();
    let pods = vec![PodSummary {
        uid: "vm1".into(),
        name: "ns/vm1".into(),
        phase: PodPhase::Running,
        requests: KindCounts::from_pairs([(TeeKind::Tdx, 1)]),
        dra_claim: false,
    }];
    struct Case {
        name: &'static str,
        kernel: KernelView,
        advertising: AdvertiseOutcome,
        want: Vec<(&'static str, &'static str, &'static str)>,
        message_contains: Vec<(&'static str, &'static str)>,
    }
    let tdx_adv = outcome(&[(TeeKind::Tdx, KindAdvert::Advertised(15))]);
    let cases = vec![
        Case {
            name: "healthy TDX host",
            kernel: KernelView {
                last_good: Some(scan(
                    &[(TeeKind::Tdx, 16)],
                    &[(TeeKind::Tdx, 1)],
                    Accounting::PerPod,
                )),
                error: None,
            },
            advertising: tdx_adv.clone(),
            want: vec![
                (ct::KERNEL_READABLE, "True", reasons::SCANNED),
                (ct::TEE_HARDWARE, "True", reasons::TEE_CAPACITY_FOUND),
                (ct::PER_POD_ACCOUNTING, "True", reasons::MISC_DELEGATED),
                (ct::ADVERTISING, "True", reasons::ADVERTISED),
            ],
            message_contains: vec![
                (ct::TEE_HARDWARE, "tdx: 16 keys"),
                (ct::ADVERTISING, "tdx.intel.com/keys=15"),
            ],
        },
        Case {
            name: "no misc controller",
            kernel: KernelView {
                last_good: Some(HostState::NoController {
                    message: "no misc cgroup controller under /x".into(),
                }),
                error: None,
            },
            advertising: outcome(&[]),
            want: vec![
                (ct::KERNEL_READABLE, "True", reasons::SCANNED),
                (ct::TEE_HARDWARE, "False", reasons::NO_TEE_HARDWARE),
                (ct::ADVERTISING, "False", reasons::NO_TEE_HARDWARE),
            ],
            message_contains: vec![(ct::TEE_HARDWARE, "no misc cgroup controller under /x")],
        },
        Case {
            name: "empty capacity",
            kernel: KernelView {
                last_good: Some(HostState::Scanned(HostScan {
                    misc_dir: "/r".into(),
                    layout: CgroupLayout::V1,
                    capacity: KindCounts::ZERO,
                    kernel_used: KindCounts::ZERO,
                    usage_source: UsageSource::Root,
                    refusals: Refusals::default(),
                    pods: None,
                })),
                error: None,
            },
            advertising: outcome(&[]),
            want: vec![
                (ct::KERNEL_READABLE, "True", reasons::SCANNED),
                (ct::TEE_HARDWARE, "False", reasons::NO_TEE_HARDWARE),
                (ct::ADVERTISING, "False", reasons::NO_TEE_HARDWARE),
            ],
            message_contains: vec![(ct::TEE_HARDWARE, "/r/misc.capacity lists no")],
        },
        Case {
            name: "scan failed after a good one",
            kernel: KernelView {
                last_good: Some(scan(&[(TeeKind::Tdx, 16)], &[], Accounting::PerPod)),
                error: Some("/r/misc.current:1: bad".into()),
            },
            advertising: tdx_adv.clone(),
            want: vec![
                (ct::KERNEL_READABLE, "False", reasons::SCAN_FAILED),
                (ct::TEE_HARDWARE, "True", reasons::TEE_CAPACITY_FOUND),
                (ct::PER_POD_ACCOUNTING, "True", reasons::MISC_DELEGATED),
                (ct::ADVERTISING, "True", reasons::ADVERTISED),
            ],
            message_contains: vec![(
                ct::KERNEL_READABLE,
                "/r/misc.current:1: bad; the figures are from the last successful scan",
            )],
        },
        Case {
            name: "scan never succeeded",
            kernel: KernelView {
                last_good: None,
                error: Some("boom".into()),
            },
            advertising: outcome(&[]),
            want: vec![
                (ct::KERNEL_READABLE, "False", reasons::SCAN_FAILED),
                (ct::TEE_HARDWARE, "Unknown", reasons::SCAN_FAILED),
                (ct::ADVERTISING, "Unknown", reasons::SCAN_FAILED),
            ],
            message_contains: vec![(ct::KERNEL_READABLE, "boom")],
        },
        Case {
            name: "not delegated, NFD owns the resource",
            kernel: KernelView {
                last_good: Some(scan(&[(TeeKind::Tdx, 16)], &[], Accounting::RunningPods)),
                error: None,
            },
            advertising: outcome(&[(
                TeeKind::Tdx,
                KindAdvert::OwnedByOther {
                    manager: Manager::Nfd,
                    value: Some(16),
                },
            )]),
            want: vec![
                (ct::KERNEL_READABLE, "True", reasons::SCANNED),
                (ct::TEE_HARDWARE, "True", reasons::TEE_CAPACITY_FOUND),
                (ct::PER_POD_ACCOUNTING, "False", reasons::MISC_NOT_DELEGATED),
                (ct::ADVERTISING, "False", reasons::OWNED_BY_OTHER),
            ],
            message_contains: vec![
                (ct::PER_POD_ACCOUNTING, "counting Running pods"),
                (
                    ct::ADVERTISING,
                    "tdx.intel.com/keys is managed by node-feature-discovery",
                ),
            ],
        },
        Case {
            name: "advertising disabled",
            kernel: KernelView {
                last_good: Some(scan(&[(TeeKind::Tdx, 16)], &[], Accounting::PerPod)),
                error: None,
            },
            advertising: AdvertiseOutcome {
                enabled: false,
                per_kind: [(TeeKind::Tdx, KindAdvert::Disabled)].into_iter().collect(),
                error: None,
            },
            want: vec![
                (ct::KERNEL_READABLE, "True", reasons::SCANNED),
                (ct::TEE_HARDWARE, "True", reasons::TEE_CAPACITY_FOUND),
                (ct::PER_POD_ACCOUNTING, "True", reasons::MISC_DELEGATED),
                (ct::ADVERTISING, "False", reasons::ADVERTISING_DISABLED),
            ],
            message_contains: vec![],
        },
    ];
    for case in cases {
        let figures = case.kernel.figures(&pods);
        let specs = conditions(&case.kernel, &figures, &case.advertising, &res);
        let got: Vec<_> = specs
            .iter()
            .map(|c| (c.type_, c.status, c.reason))
            .collect();
        assert_eq!(got, case.want, "case: {}", case.name);
        for (t, m) in case.message_contains {
            let c = find(&specs, t).expect("condition");
            assert!(
                c.message.contains(m),
                "case {}: {t} message {:?} lacks {m:?}",
                case.name,
                c.message
            );
        }
    }
}

#[test]
fn status_figures_and_transition_times() {
    let res = ResourcesConfig::default();
    let pods = vec![PodSummary {
        uid: "vm1".into(),
        name: "ns/vm1".into(),
        phase: PodPhase::Running,
        requests: KindCounts::from_pairs([(TeeKind::Tdx, 1)]),
        dra_claim: false,
    }];
    let mut kernel = KernelView {
        last_good: Some(scan(
            &[(TeeKind::Tdx, 16)],
            &[(TeeKind::Tdx, 3)],
            Accounting::PerPod,
        )),
        error: None,
    };
    let adv = outcome(&[(TeeKind::Tdx, KindAdvert::Advertised(14))]);
    let figures = kernel.figures(&pods);
    let s1 = build_status(&StatusInput {
        kernel: &kernel,
        figures: &figures,
        advertising: &adv,
        resources: &res,
        counted_pods: &["vm1".to_string()],
        enforcing: None,
        previous: None,
        dra: None,
        now: Timestamp::from_millisecond(100_500).expect("ts"),
    });
    let tdx = s1.tdx.clone().expect("tdx");
    assert_eq!(
        tdx,
        KindStatus {
            resource_name: "tdx.intel.com/keys".into(),
            capacity: 16,
            kernel_used: 3,
            pods_used: 1,
            external: 2,
            pending: 0,
            free: 13,
            advertised: Some(14),
            devices: None,
            refused: None,
        }
    );
    assert_eq!(s1.heartbeat_time, Some(Time(ts(100))));
    assert_eq!(s1.counted_pods, ["vm1"]);
    assert_eq!(s1.agent_version.as_deref(), Some(AGENT_VERSION));
    assert!(
        s1.conditions
            .iter()
            .all(|c| c.last_transition_time == Time(ts(100)))
    );

    // Same state later: only the heartbeat moves; not a content change.
    let s2 = build_status(&StatusInput {
        kernel: &kernel,
        figures: &figures,
        advertising: &adv,
        resources: &res,
        counted_pods: &[],
        enforcing: None,
        previous: Some(&s1),
        dra: None,
        now: ts(130),
    });
    assert_eq!(s2.heartbeat_time, Some(Time(ts(130))));
    assert!(
        !content_differs(&s1, &s2),
        "a pod leaving countedPods is no news"
    );
    assert!(!lists_new_pods(&s1, &s2) && lists_new_pods(&s2, &s1));
    assert!(
        s2.conditions
            .iter()
            .all(|c| c.last_transition_time == Time(ts(100)))
    );

    // A scan fails: KernelReadable flips (new time), the others keep theirs, figures stay.
    kernel.record(Err(Error::Task("disk on fire".into())));
    let s3 = build_status(&StatusInput {
        kernel: &kernel,
        figures: &kernel.figures(&pods),
        advertising: &adv,
        resources: &res,
        counted_pods: &[],
        enforcing: None,
        previous: Some(&s2),
        dra: None,
        now: ts(140),
    });
    assert!(content_differs(&s2, &s3));
    assert_eq!(s3.tdx, s2.tdx);
    let kr = s3.condition(ct::KERNEL_READABLE).expect("kr");
    assert_eq!(
        (kr.status.as_str(), kr.last_transition_time.clone()),
        ("False", Time(ts(140)))
    );
    let hw = s3.condition(ct::TEE_HARDWARE).expect("hw");
    assert_eq!(hw.last_transition_time, Time(ts(100)));
}

#[test]
fn write_decision() {
    let t0 = Instant::now();
    let due = t0 + Duration::from_secs(30);
    let a = TeeCapacityStatus {
        heartbeat_time: Some(Time(ts(1))),
        ..Default::default()
    };
    let b = TeeCapacityStatus {
        heartbeat_time: Some(Time(ts(2))),
        ..Default::default()
    };
    let mut c = b.clone();
    c.agent_version = Some("other".into());
    assert_eq!(next_write(None, &a, t0), Write::Report);
    assert_eq!(
        next_write(Some((&a, due)), &b, due - Duration::from_millis(1)),
        Write::Nothing
    );
    assert_eq!(next_write(Some((&a, due)), &b, due), Write::Heartbeat);
    assert_eq!(next_write(Some((&a, due)), &c, t0), Write::Report);
    assert_eq!(next_write(Some((&a, due)), &c, due), Write::Report);
    // A newly counted pod is published at once; one leaving the list waits for the heartbeat.
    let mut listed = b.clone();
    listed.counted_pods = vec!["vm2".into()];
    assert_eq!(next_write(Some((&a, due)), &listed, t0), Write::Report);
    assert_eq!(next_write(Some((&listed, due)), &b, t0), Write::Nothing);
    assert_eq!(next_write(Some((&listed, due)), &b, due), Write::Report);
}

#[test]
fn heartbeats_in_steady_state_are_exactly_one_interval_apart_at_the_nodes_offset() {
    let hb = Duration::from_secs(30);
    let offset = Duration::from_millis(12_345);
    // Published late in a slot's second (the write took 40 ms): the next slot, not the one after.
    let mut at = Duration::from_secs(1_700_000_000);
    let mut beats = Vec::new();
    for _ in 0..5 {
        let due = next_heartbeat(at, hb, offset);
        assert_eq!(due.as_millis() % hb.as_millis(), offset.as_millis());
        beats.push(due);
        at = due + Duration::from_millis(40);
    }
    for pair in beats.windows(2) {
        assert_eq!(pair[1] - pair[0], hb);
    }
}

#[test]
fn after_a_change_the_next_heartbeat_is_half_to_one_and_a_half_intervals_later() {
    let hb = Duration::from_secs(30);
    for offset_ms in [0, 1, 7_500, 15_000, 29_999] {
        for change_ms in (0..60_000).step_by(997) {
            let change = Duration::from_secs(1_700_000_000) + Duration::from_millis(change_ms);
            let due = next_heartbeat(change, hb, Duration::from_millis(offset_ms));
            let gap = due - change;
            assert!(
                gap >= hb / 2 && gap < hb * 3 / 2,
                "offset {offset_ms} ms, change at +{change_ms} ms: next heartbeat after {gap:?}"
            );
        }
    }
}

#[test]
fn five_thousand_nodes_heartbeats_are_spread_evenly_over_the_interval() {
    let hb = Duration::from_secs(30);
    let mut buckets = [0usize; 10];
    for i in 0..5000 {
        let offset = heartbeat_offset(&format!("node-{i:05}"), hb);
        assert!(offset < hb);
        buckets[(offset.as_millis() * 10 / hb.as_millis()) as usize] += 1;
    }
    // 500 per tenth of the interval; lockstep would put all 5,000 in one.
    for (i, n) in buckets.iter().enumerate() {
        assert!(
            (400..=600).contains(n),
            "tenth {i} of the interval holds {n} of 5,000 nodes' heartbeats: {buckets:?}"
        );
    }
    assert_eq!(
        heartbeat_offset("node-a", hb),
        heartbeat_offset("node-a", hb),
        "a restarted agent keeps its place"
    );
}

fn counted_pod(uid: &str, pending: bool) -> CountedPod {
    CountedPod {
        uid: uid.into(),
        pending,
    }
}

#[test]
fn counted_pods_lists_every_counted_pod_newest_first_however_old() {
    let t0 = Instant::now();
    let mut tracker = CountedPods::default();
    let listed = tracker.update(&[counted_pod("a", false)], t0);
    assert_eq!(listed, ["a"]);
    let s = |n| t0 + Duration::from_secs(n);
    // b arrives later: listed first.
    let listed = tracker.update(&[counted_pod("a", false), counted_pod("b", true)], s(10));
    assert_eq!(listed, ["b", "a"]);
    // Hours later, both still counted, both still listed: a webhook replica that starts now sees
    // that their holds are counted.
    let listed = tracker.update(&[counted_pod("a", false), counted_pod("b", false)], s(7200));
    assert_eq!(listed, ["b", "a"]);
    // A pod no longer counted is forgotten: counted again, it is new again.
    tracker.update(&[counted_pod("b", false)], s(7201));
    let listed = tracker.update(&[counted_pod("a", false), counted_pod("b", false)], s(7202));
    assert_eq!(listed, ["a", "b"]);
}

#[test]
fn counted_pods_list_is_bounded_and_keeps_the_newest() {
    let t0 = Instant::now();
    let mut tracker = CountedPods::default();
    let old: Vec<String> = (0..MAX_COUNTED_PODS)
        .map(|i| format!("old-{i:03}"))
        .collect();
    let pods: Vec<CountedPod> = old.iter().map(|u| counted_pod(u, true)).collect();
    tracker.update(&pods, t0);
    let mut all = pods.clone();
    all.push(counted_pod("new", true));
    let listed = tracker.update(&all, t0 + Duration::from_secs(1));
    assert_eq!(listed.len(), MAX_COUNTED_PODS);
    assert_eq!(listed[0], "new");
    assert_eq!(listed[1..], old[..MAX_COUNTED_PODS - 1]);
}

#[test]
fn attributed_figures_follow_every_change_of_the_scan_or_the_pods() {
    let t0 = Instant::now();
    let pod = |uid: &str| PodSummary {
        uid: uid.into(),
        name: format!("ns/{uid}"),
        phase: PodPhase::Running,
        requests: KindCounts::from_pairs([(TeeKind::Tdx, 1)]),
        dra_claim: false,
    };
    let tdx = |a: &Attributed| a.figures()[&TeeKind::Tdx];
    // A scan of capacity 4 whose kernel shows `used` keys, its pod readings changed by `edit`.
    let scan_of = |used: u64, edit: fn(&mut PodScan)| {
        let mut s = scan(
            &[(TeeKind::Tdx, 4)],
            &[(TeeKind::Tdx, used)],
            Accounting::PerPod,
        );
        if let HostState::Scanned(HostScan { pods: Some(p), .. }) = &mut s {
            edit(p);
        }
        s
    };
    let mut kernel = KernelView::default();
    kernel.record(Ok(scan_of(1, |_| {})));
    let one = Arc::new(PodsView {
        pods: vec![pod("vm1")],
        ..PodsView::default()
    });
    let mut a = Attributed::default();
    a.update(&kernel, &one, t0);
    assert_eq!((tdx(&a).pods_used, tdx(&a).free), (1, 3));
    assert_eq!(a.listed(), ["vm1"]);

    // Another scan with the same readings (only its counters differ): the same figures.
    kernel.record(Ok(scan_of(1, |p| (p.pods_read, p.pods_unchanged) = (0, 1))));
    a.update(&kernel, &one, t0);
    assert_eq!((tdx(&a).pods_used, tdx(&a).free), (1, 3));

    // The pod's cgroup reads empty: its key is pending, not held.
    kernel.record(Ok(scan_of(1, |p| p.usage.clear())));
    a.update(&kernel, &one, t0);
    let f = tdx(&a);
    assert_eq!((f.pods_used, f.external, f.pending, f.free), (0, 1, 1, 2));

    // The kernel's total moves alone: the key outside Kubernetes is gone.
    kernel.record(Ok(scan_of(0, |p| p.usage.clear())));
    a.update(&kernel, &one, t0);
    assert_eq!((tdx(&a).external, tdx(&a).free), (0, 3));

    // A new pods view: a second pod is counted and listed first (newer).
    let two = Arc::new(PodsView {
        pods: vec![pod("vm1"), pod("vm2")],
        ..PodsView::default()
    });
    a.update(&kernel, &two, t0 + Duration::from_secs(1));
    assert_eq!(tdx(&a).pending, 2);
    assert_eq!(a.listed(), ["vm2", "vm1"]);

    // The host loses its controller: nothing to attribute.
    kernel.record(Ok(HostState::NoController {
        message: "gone".into(),
    }));
    a.update(&kernel, &two, t0);
    assert!(a.figures().is_empty() && a.listed().is_empty());
}
