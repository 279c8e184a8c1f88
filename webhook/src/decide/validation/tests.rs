//! Tests of the node, candidate and mode decisions.

use super::*;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use pretty_assertions::assert_eq;
use teeguard_shared::KindStatus;

pub(super) const STALE: Duration = Duration::from_secs(90);

pub(super) fn now() -> Timestamp {
    Timestamp::from_second(1_750_000_000).expect("now")
}

pub(super) fn kind(capacity: u64, free: u64, external: u64) -> KindStatus {
    KindStatus {
        resource_name: "tdx.intel.com/keys".into(),
        capacity,
        kernel_used: capacity - free,
        pods_used: capacity - free - external,
        external,
        free,
        ..KindStatus::default()
    }
}

pub(super) fn report(tdx: Option<KindStatus>, age_secs: i64) -> TeeCapacityStatus {
    TeeCapacityStatus {
        tdx,
        heartbeat_time: Some(Time(
            now()
                .checked_sub(jiff::SignedDuration::from_secs(age_secs))
                .expect("ts"),
        )),
        ..Default::default()
    }
}

pub(super) fn tdx(n: u64) -> KeyRequests {
    KeyRequests::from([(TeeKind::Tdx, n)])
}

fn assess(node: &str, status: Option<&TeeCapacityStatus>, reserved: u64) -> NodeAssessment {
    NodeAssessment::new(node, &tdx(1), status, &tdx(reserved), now(), STALE)
}

fn refused(v: Verdict) -> (&'static str, String) {
    match v {
        Verdict::Refuse { reason, message } => (reason, message),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn admitted(v: Verdict) -> (&'static str, Vec<String>) {
    match v {
        Verdict::Admit { reason, warnings } => (reason, warnings),
        other => panic!("expected an admission, got {other:?}"),
    }
}

#[test]
fn report_freshness() {
    let fresh = report(Some(kind(31, 1, 0)), 10);
    assert!(current_report(Some(&fresh), now(), STALE).is_ok());
    let edge = report(Some(kind(31, 1, 0)), 90);
    assert!(current_report(Some(&edge), now(), STALE).is_ok());
    let stale = report(Some(kind(31, 1, 0)), 310);
    assert_eq!(
        current_report(Some(&stale), now(), STALE),
        Err(Unknown::Stale {
            age: Duration::from_secs(310)
        })
    );
    let future = report(Some(kind(31, 1, 0)), -30);
    assert!(current_report(Some(&future), now(), STALE).is_ok());
    let mut no_hb = fresh.clone();
    no_hb.heartbeat_time = None;
    assert_eq!(
        current_report(Some(&no_hb), now(), STALE),
        Err(Unknown::NoHeartbeat)
    );
    assert_eq!(current_report(None, now(), STALE), Err(Unknown::NoReport));
}

#[test]
fn a_report_unchanged_for_long_is_current_while_its_agent_renews_its_lease() {
    let old = report(Some(kind(31, 1, 0)), 3600);
    let fresh = report(Some(kind(31, 1, 0)), 10);
    let with = |status, secs| Report {
        status,
        lease_renewed: now()
            .checked_sub(jiff::SignedDuration::from_secs(secs))
            .ok(),
    };
    assert!(current_report(with(Some(&old), 20), now(), STALE).is_ok());
    // The newer of the two counts: an old Lease does not make a fresh report stale, and when both
    // are old the report is stale since the newer one.
    assert!(current_report(with(Some(&fresh), 3600), now(), STALE).is_ok());
    let stale = Err(Unknown::Stale {
        age: Duration::from_secs(400),
    });
    assert_eq!(current_report(with(Some(&old), 400), now(), STALE), stale);
    assert_eq!(
        current_report(with(None, 1), now(), STALE),
        Err(Unknown::NoReport)
    );
    // A node's assessment (and so the candidate scan) sees the same.
    let fits = |r: Report<'_>| NodeAssessment::new("n", &tdx(1), r, &tdx(0), now(), STALE).fit();
    assert_eq!(fits(with(Some(&old), 20)), Fit::Fits);
    assert_eq!(fits(Some(&old).into()), Fit::Unknown);
}

#[test]
fn human_durations() {
    for (s, want) in [
        (0, "0s"),
        (59, "59s"),
        (60, "1m"),
        (310, "5m10s"),
        (3600, "1h"),
        (3725, "1h2m"),
        (86_400, "24h"),
    ] {
        assert_eq!(human(Duration::from_secs(s)), want);
    }
}

#[test]
fn node_figures_and_fit() {
    let full = report(Some(kind(31, 0, 3)), 5);
    let one = report(Some(kind(31, 1, 0)), 5);
    let no_tdx = report(None, 5);
    let stale = report(Some(kind(31, 5, 0)), 600);
    // (assessment, fit, description)
    let cases = [
        (
            assess("a", Some(&full), 0),
            Fit::Short,
            "a 0/31 free (3 held outside Kubernetes)",
        ),
        (assess("b", Some(&one), 0), Fit::Fits, "b 1/31 free"),
        (
            assess("b", Some(&one), 1),
            Fit::Short,
            "b 0/31 free (1 just admitted, not in the report yet)",
        ),
        (
            assess("c", Some(&no_tdx), 0),
            Fit::Short,
            "c has no TDX keys",
        ),
        (
            assess("d", Some(&stale), 0),
            Fit::Unknown,
            "d report is stale (last heartbeat 10m ago)",
        ),
        (
            assess("e", None, 0),
            Fit::Unknown,
            "e has no TeeCapacity report",
        ),
    ];
    for (a, fit, text) in cases {
        assert_eq!(a.fit(), fit, "{a:?}");
        assert_eq!(a.describe(), text);
    }
    // Two keys requested, one free.
    let a = NodeAssessment::new("b", &tdx(2), Some(&one), &tdx(0), now(), STALE);
    assert_eq!(a.fit(), Fit::Short);
    // Several kinds: each is named; one short kind makes the node short.
    let mut both = report(Some(kind(31, 4, 0)), 5);
    both.sev_es = Some(KindStatus {
        resource_name: "sev-snp.amd.com/esids".into(),
        capacity: 10,
        free: 0,
        ..Default::default()
    });
    let req = KeyRequests::from([(TeeKind::Tdx, 1), (TeeKind::SevEs, 1)]);
    let a = NodeAssessment::new("m", &req, Some(&both), &KeyRequests::new(), now(), STALE);
    assert_eq!(a.fit(), Fit::Short);
    assert_eq!(a.describe(), "m TDX 4/31 free, SEV-ES/SNP 0/10 free");
    assert_eq!(kinds_label(&req), "TDX+SEV-ES/SNP");
}

#[test]
fn binding_verdicts() {
    let full = report(Some(kind(31, 0, 3)), 5);
    let one = report(Some(kind(31, 1, 0)), 5);
    let stale = report(Some(kind(31, 5, 0)), 300);
    let req = tdx(1);

    let (r, w) = admitted(decide_on_node(
        Trigger::Binding,
        &req,
        &assess("node-a", Some(&one), 0),
        StalePolicy::Deny,
    ));
    assert_eq!((r, w.len()), (reason::ENOUGH_KEYS, 0));

    let (r, msg) = refused(decide_on_node(
        Trigger::Binding,
        &req,
        &assess("node-a", Some(&full), 0),
        StalePolicy::Allow,
    ));
    assert_eq!(r, reason::INSUFFICIENT_KEYS);
    assert_eq!(
        msg,
        "node node-a cannot host this TDX VM: 0/31 free (3 held outside Kubernetes); \
             free a key or add capacity; `kubectl get teecapacities` shows free keys per node"
    );

    // Stale under both policies, on both triggers.
    for trigger in [Trigger::Binding, Trigger::PodCreate] {
        let a = assess("node-s", Some(&stale), 0);
        let (r, w) = admitted(decide_on_node(trigger, &req, &a, StalePolicy::Allow));
        assert_eq!(r, reason::REPORT_UNKNOWN);
        assert_eq!(w.len(), 1);
        assert_eq!(
            w[0],
            format!(
                "teeguard could not check free TDX keys on node node-s: node-s report is stale \
                     (last heartbeat 5m ago); allowed by {}",
                trigger.policy_field()
            )
        );
        let (r, msg) = refused(decide_on_node(trigger, &req, &a, StalePolicy::Deny));
        assert_eq!(r, reason::REPORT_UNKNOWN);
        assert_eq!(
            msg,
            format!(
                "teeguard cannot tell whether node node-s can host this TDX VM: node-s report is stale \
                     (last heartbeat 5m ago) ({} denies unknown reports); a node needs a running teeguard \
                     agent to report its keys",
                trigger.policy_field()
            )
        );
    }
    // Missing report.
    let (_, msg) = refused(decide_on_node(
        Trigger::Binding,
        &req,
        &assess("node-x", None, 0),
        StalePolicy::Deny,
    ));
    assert!(msg.contains("has no TeeCapacity report"), "{msg}");
    // Two keys are named.
    let a = NodeAssessment::new("n", &tdx(2), Some(&one), &tdx(0), now(), STALE);
    let (_, msg) = refused(decide_on_node(
        Trigger::Binding,
        &tdx(2),
        &a,
        StalePolicy::Deny,
    ));
    assert!(
        msg.starts_with("node n cannot host this TDX VM (2 keys): 1/31 free"),
        "{msg}"
    );
}

#[test]
fn candidate_verdicts_and_message_format() {
    let req = tdx(1);
    let full_ext = report(Some(kind(31, 0, 3)), 5);
    let full = report(Some(kind(31, 0, 0)), 5);
    let one = report(Some(kind(31, 1, 0)), 5);
    let stale = report(Some(kind(31, 9, 0)), 300);

    // The example from the issue.
    let (r, msg) = refused(decide_candidates(
        &req,
        vec![
            assess("node-b", Some(&full), 0),
            assess("node-a", Some(&full_ext), 0),
        ],
        StalePolicy::Deny,
    ));
    assert_eq!(r, reason::INSUFFICIENT_KEYS);
    assert_eq!(
        msg,
        "no node can host this TDX VM: node-a 0/31 free (3 held outside Kubernetes), node-b 0/31 free; \
             free a key or add capacity; `kubectl get teecapacities` shows free keys per node"
    );

    // One candidate with a key admits.
    let (r, _) = admitted(decide_candidates(
        &req,
        vec![assess("a", Some(&full), 0), assess("b", Some(&one), 0)],
        StalePolicy::Deny,
    ));
    assert_eq!(r, reason::ENOUGH_KEYS);
    // ... unless another pod holds it.
    refused(decide_candidates(
        &req,
        vec![assess("a", Some(&full), 0), assess("b", Some(&one), 1)],
        StalePolicy::Deny,
    ));

    // Best first (most free, then name), at most five, "and N more"; stale last.
    let mut candidates = Vec::new();
    for (name, free) in [
        ("n3", 0),
        ("n1", 0),
        ("n2", 0),
        ("n4", 0),
        ("n5", 0),
        ("n6", 0),
    ] {
        let s = report(Some(kind(4, free, 0)), 5);
        candidates.push(NodeAssessment::new(
            name,
            &tdx(2),
            Some(&s),
            &tdx(0),
            now(),
            STALE,
        ));
    }
    let s = report(Some(kind(4, 1, 0)), 5);
    candidates.push(NodeAssessment::new(
        "z",
        &tdx(2),
        Some(&s),
        &tdx(0),
        now(),
        STALE,
    ));
    candidates.push(NodeAssessment::new(
        "a-stale",
        &tdx(2),
        Some(&stale),
        &tdx(0),
        now(),
        STALE,
    ));
    let (_, msg) = refused(decide_candidates(&tdx(2), candidates, StalePolicy::Deny));
    assert_eq!(
        msg,
        "no node can host this TDX VM (2 keys): z 1/4 free, n1 0/4 free, n2 0/4 free, n3 0/4 free, \
             n4 0/4 free and 3 more; free a key or add capacity; `kubectl get teecapacities` shows free keys \
             per node; a node needs a running teeguard agent to report its keys"
    );

    // Stale candidates under both policies.
    let c = || {
        vec![
            assess("full", Some(&full), 0),
            assess("stale", Some(&stale), 0),
        ]
    };
    let (r, w) = admitted(decide_candidates(&req, c(), StalePolicy::Allow));
    assert_eq!(r, reason::REPORT_UNKNOWN);
    assert!(
        w[0].contains("report of stale is missing or stale")
            && w[0].contains("admission.staleReportPolicy.podCreate"),
        "{}",
        w[0]
    );
    let (r, msg) = refused(decide_candidates(&req, c(), StalePolicy::Deny));
    assert_eq!(r, reason::INSUFFICIENT_KEYS);
    assert!(
        msg.contains("full 0/31 free, stale report is stale (last heartbeat 5m ago)"),
        "{msg}"
    );
    let (r, _) = refused(decide_candidates(
        &req,
        vec![assess("gone", None, 0)],
        StalePolicy::Deny,
    ));
    assert_eq!(r, reason::REPORT_UNKNOWN);

    // No candidate at all.
    let (r, msg) = refused(decide_candidates(&req, Vec::new(), StalePolicy::Allow));
    assert_eq!(r, reason::NO_CANDIDATE_NODES);
    assert!(
        msg.starts_with("no node can host this TDX VM: no node matches"),
        "{msg}"
    );
}

/// The candidate verdict as it was computed before [`CandidateScan`]: every candidate assessed,
/// sorted and listed (unknown-report names by name).
fn reference_verdict(
    requests: &KeyRequests,
    mut candidates: Vec<NodeAssessment>,
    policy: StalePolicy,
) -> Verdict {
    let vm = vm_label(requests);
    if candidates.is_empty() {
        return decide_candidates(requests, Vec::new(), policy);
    }
    if candidates.iter().any(|c| c.fit() == Fit::Fits) {
        return Verdict::Admit {
            reason: reason::ENOUGH_KEYS,
            warnings: Vec::new(),
        };
    }
    let rank = |a: &NodeAssessment| {
        a.kinds
            .iter()
            .map(|(_, _, f)| f.available().map_or(0, |a| a + 1))
            .min()
            .unwrap_or(0)
    };
    let mut unknown: Vec<String> = candidates
        .iter()
        .filter(|c| c.fit() == Fit::Unknown)
        .map(|c| c.node.clone())
        .collect();
    unknown.sort();
    let listing = |names: Vec<String>, total: usize| {
        let mut s = names
            .into_iter()
            .take(MAX_LISTED_NODES)
            .collect::<Vec<_>>()
            .join(", ");
        if total > MAX_LISTED_NODES {
            s.push_str(&format!(" and {} more", total - MAX_LISTED_NODES));
        }
        s
    };
    if !unknown.is_empty() && policy == StalePolicy::Allow {
        let n = unknown.len();
        return Verdict::Admit {
            reason: reason::REPORT_UNKNOWN,
            warnings: vec![format!(
                "teeguard could not check free {} keys: no node with a current report has enough, and the report of {} is missing or stale; allowed by admission.staleReportPolicy.podCreate",
                kinds_label(requests),
                listing(unknown, n)
            )],
        };
    }
    candidates.sort_by(|a, b| rank(b).cmp(&rank(a)).then_with(|| a.node.cmp(&b.node)));
    let total = candidates.len();
    let list = listing(
        candidates.iter().map(NodeAssessment::describe).collect(),
        total,
    );
    let hint = if unknown.is_empty() {
        HINT.to_string()
    } else {
        format!("{HINT}; {AGENT_HINT}")
    };
    Verdict::Refuse {
        reason: if unknown.len() == total {
            reason::REPORT_UNKNOWN
        } else {
            reason::INSUFFICIENT_KEYS
        },
        message: format!("no node can host {vm}: {list}; {hint}"),
    }
}

#[test]
fn scan_matches_the_full_sort_in_any_order() {
    let mut rng = fastrand::Rng::with_seed(0x9e37_79b9_7f4a_7c15);
    let both = KeyRequests::from([(TeeKind::Tdx, 1), (TeeKind::SevEs, 2)]);
    for round in 0..2_000 {
        let requests = match round % 3 {
            0 => tdx(1),
            1 => tdx(2),
            _ => both.clone(),
        };
        let n = rng.usize(..14);
        let mut candidates = Vec::new();
        for i in 0..n {
            // Mostly full nodes, so that refusals (and their lists) are common.
            let status = match rng.u64(..8) {
                0 => None,
                1 => Some(report(Some(kind(8, rng.u64(..3), rng.u64(..2))), 600)),
                2 => Some(report(None, 5)),
                _ => {
                    let mut s = report(Some(kind(8, rng.u64(..3), rng.u64(..2))), 5);
                    if rng.u64(..2) == 0 {
                        s.sev_es = Some(kind(16, rng.u64(..4), 0));
                    }
                    Some(s)
                }
            };
            let mut reserved = KeyRequests::new();
            if rng.u64(..4) == 0 {
                reserved.insert(TeeKind::Tdx, rng.u64(..3));
            }
            // Names collide in rank often; a few share prefixes.
            let name = format!("n{}", (i * 7 + round) % 23);
            if candidates.iter().any(|(c, _, _)| *c == name) {
                continue;
            }
            candidates.push((name, status, reserved));
        }
        let assessed: Vec<NodeAssessment> = candidates
            .iter()
            .map(|(n, s, r)| NodeAssessment::new(n, &requests, s.as_ref(), r, now(), STALE))
            .collect();
        for policy in [StalePolicy::Deny, StalePolicy::Allow] {
            let want = reference_verdict(&requests, assessed.clone(), policy);
            // Forward, backward and rotated orders, through both entry points.
            for order in 0..3 {
                let mut cs = candidates.clone();
                match order {
                    0 => {}
                    1 => cs.reverse(),
                    _ => {
                        let by = round % cs.len().max(1);
                        cs.rotate_left(by);
                    }
                }
                let mut scan = CandidateScan::new(&requests);
                for (n, s, r) in &cs {
                    if scan.offer(n, s.as_ref(), r, now(), STALE).is_break() {
                        assert!(scan.fits());
                        break;
                    }
                }
                assert!(scan.offered() <= cs.len());
                assert_eq!(scan.verdict(policy), want, "round {round} order {order}");
            }
            assert_eq!(
                decide_candidates(&requests, assessed.clone(), policy),
                want,
                "round {round}"
            );
        }
    }
}

#[test]
fn scan_stops_at_the_first_fit_and_lists_at_most_five() {
    let req = tdx(1);
    let full = report(Some(kind(31, 0, 0)), 5);
    let one = report(Some(kind(31, 1, 0)), 5);
    let mut scan = CandidateScan::new(&req);
    for i in 0..1_000 {
        let name = format!("node-{i:04}");
        assert!(
            scan.offer(&name, Some(&full), &tdx(0), now(), STALE)
                .is_continue()
        );
    }
    assert_eq!(scan.best.len(), MAX_LISTED_NODES);
    assert!(scan.unknown_names.is_empty());
    let (r, msg) = refused(scan.clone().verdict(StalePolicy::Deny));
    assert_eq!(r, reason::INSUFFICIENT_KEYS);
    assert!(
            msg.starts_with(
                "no node can host this TDX VM: node-0000 0/31 free, node-0001 0/31 free, node-0002 0/31 free, \
                 node-0003 0/31 free, node-0004 0/31 free and 995 more; "
            ),
            "{msg}"
        );
    assert!(
        scan.offer("late", Some(&one), &tdx(0), now(), STALE)
            .is_break()
    );
    assert_eq!(scan.offered(), 1_001);
    admitted(scan.verdict(StalePolicy::Deny));

    // Many unknown reports: the warning names the first five by name and counts the rest.
    let mut scan = CandidateScan::new(&req);
    for i in (0..12).rev() {
        let _ = scan.offer(&format!("gone-{i:02}"), None, &tdx(0), now(), STALE);
    }
    let (r, w) = admitted(scan.verdict(StalePolicy::Allow));
    assert_eq!(r, reason::REPORT_UNKNOWN);
    assert!(
            w[0].contains(
                "the report of gone-00, gone-01, gone-02, gone-03, gone-04 and 7 more is missing or stale"
            ),
            "{}",
            w[0]
        );
}

#[test]
fn modes() {
    let refusal = Verdict::Refuse {
        reason: reason::INSUFFICIENT_KEYS,
        message: "no".into(),
    };
    let d = apply_mode(refusal.clone(), Mode::Enforce);
    assert_eq!(
        (d.allowed, d.message.as_deref(), d.outcome, d.reserve),
        (false, Some("no"), ValidationOutcome::Denied, false)
    );
    let d = apply_mode(refusal, Mode::Warn);
    assert_eq!(
        (d.allowed, d.message, d.warnings, d.outcome, d.reserve),
        (
            true,
            None,
            vec!["no".to_string()],
            ValidationOutcome::Warned,
            false
        )
    );
    for mode in [Mode::Enforce, Mode::Warn] {
        let d = apply_mode(
            Verdict::Admit {
                reason: reason::ENOUGH_KEYS,
                warnings: vec![],
            },
            mode,
        );
        assert_eq!(
            (d.allowed, d.outcome, d.reserve),
            (true, ValidationOutcome::Admitted, true)
        );
        let d = apply_mode(
            Verdict::Admit {
                reason: reason::REPORT_UNKNOWN,
                warnings: vec!["w".into()],
            },
            mode,
        );
        assert_eq!(
            (d.allowed, d.outcome, d.reserve),
            (true, ValidationOutcome::Warned, true)
        );
    }
}

#[test]
fn namespace_mode_override() {
    let labels = |v: &str| BTreeMap::from([(names::MODE_LABEL.to_string(), v.to_string())]);
    let cases = [
        (Mode::Enforce, None, Mode::Enforce, false),
        (Mode::Enforce, Some(labels("warn")), Mode::Warn, false),
        (Mode::Warn, Some(labels("enforce")), Mode::Enforce, false),
        (Mode::Warn, Some(BTreeMap::new()), Mode::Warn, false),
        (Mode::Enforce, Some(labels("Warn")), Mode::Enforce, true),
        (Mode::Warn, Some(labels("off")), Mode::Warn, true),
    ];
    for (global, l, want, warned) in cases {
        let (m, w) = namespace_mode(global, l.as_ref());
        assert_eq!((m, w.is_some()), (want, warned), "{l:?}");
    }
}

// ---- annotations ----
