//! Tests of the rule that no `misc.max` line names a kind the host has no capacity for: the kernel
//! refuses such a line with `EINVAL` and runc then refuses to start the container (issue 37's NRI
//! defect: an SEV-ES request on a host with `sev` only, e.g. `sev_es` ASIDs disabled in firmware while
//! NFD still advertises them).

use std::collections::BTreeMap;

use teeguard_shared::TeeKind;
use teeguard_shared::config::ResourcesConfig;
use teeguard_tests::fixtures::{Tee, VirtLauncherPod};

use super::*;

const ESIDS: &str = "sev-snp.amd.com/esids";
const ASIDS: &str = "sev.amd.com/asids";
const ANNOTATION: &str = "misc-max.teeguard.dev/compute";
static NO_CLAIMS: ClaimedKeys = ClaimedKeys::NONE;
const SEV_ONLY: &[TeeKind] = &[TeeKind::Sev];

fn policy<'a>(
    resources: &'a ResourcesConfig,
    host: &'static [TeeKind],
    strict: bool,
) -> Policy<'a> {
    Policy {
        resources,
        host_kinds: host,
        strict,
    }
}

fn facts<'a>(pod: Option<&'a Pod>, ann: &'a BTreeMap<String, String>) -> PodFacts<'a> {
    PodFacts {
        pod,
        annotations: ann,
        namespace_exempt: false,
        claimed: &NO_CLAIMS,
    }
}

fn snp_vm() -> Pod {
    VirtLauncherPod::for_tee("vm", Tee::Snp)
        .request(ESIDS, "1")
        .annotation(ANNOTATION, "sev_es 1")
        .running_on("node-a")
        .build()
}

#[test]
fn an_sev_es_container_on_a_host_with_sev_only_gets_no_line_and_the_kind_is_named() {
    let resources = ResourcesConfig::default();
    let pod = snp_vm();
    let ann = pod.metadata.annotations.clone().unwrap_or_default();
    for strict in [false, true] {
        let p = policy(&resources, SEV_ONLY, strict);
        assert_eq!(
            container_limit(facts(Some(&pod), &ann), "compute", p),
            ContainerLimit::Unlimited,
            "strict {strict}: no sev_es line (EINVAL), and no strict sev 0 for a pod asking for keys"
        );
        assert_eq!(
            unavailable_kinds(facts(Some(&pod), &ann), "compute", p),
            vec![TeeKind::SevEs]
        );
        assert_eq!(
            unavailable_kinds(facts(Some(&pod), &ann), "guest-console-log", p),
            vec![]
        );
    }
    // The same pod on a host with sev_es capacity: its line, nothing unavailable.
    let both = policy(&resources, &[TeeKind::Sev, TeeKind::SevEs], false);
    assert_eq!(
        container_limit(facts(Some(&pod), &ann), "compute", both),
        ContainerLimit::Set {
            limit: Limit {
                kind: TeeKind::SevEs,
                keys: 1
            },
            mismatch: None
        }
    );
    assert_eq!(
        unavailable_kinds(facts(Some(&pod), &ann), "compute", both),
        vec![]
    );
}

#[test]
fn an_unknown_pods_annotation_for_a_kind_without_capacity_sets_no_line() {
    let resources = ResourcesConfig::default();
    let ann = BTreeMap::from([(ANNOTATION.to_string(), "sev_es 1".to_string())]);
    let p = policy(&resources, SEV_ONLY, true);
    assert_eq!(
        container_limit(facts(None, &ann), "compute", p),
        ContainerLimit::Unlimited
    );
    assert_eq!(
        unavailable_kinds(facts(None, &ann), "compute", p),
        vec![TeeKind::SevEs]
    );
}

#[test]
fn a_container_asking_for_an_available_and_an_unavailable_kind_gets_the_available_one() {
    let resources = ResourcesConfig::default();
    let pod = VirtLauncherPod::for_tee("vm", Tee::Snp)
        .request(ESIDS, "1")
        .request(ASIDS, "2")
        .running_on("node-a")
        .build();
    let ann = BTreeMap::new();
    let p = policy(&resources, SEV_ONLY, false);
    assert_eq!(
        container_limit(facts(Some(&pod), &ann), "compute", p),
        ContainerLimit::Set {
            limit: Limit {
                kind: TeeKind::Sev,
                keys: 2
            },
            mismatch: None
        },
        "the kind it cannot have is not reported as several kinds on one line"
    );
    assert_eq!(
        unavailable_kinds(facts(Some(&pod), &ann), "compute", p),
        vec![TeeKind::SevEs]
    );
}

#[test]
fn the_pod_cgroup_writer_names_the_kinds_it_leaves_out() {
    let resources = ResourcesConfig::default();
    let pod = snp_vm();
    let p = policy(&resources, SEV_ONLY, false);
    assert_eq!(
        pod_limits(&pod, false, &NO_CLAIMS, p),
        vec![],
        "no sev_es line"
    );
    assert_eq!(
        pod_unavailable_kinds(&pod, &NO_CLAIMS, p),
        vec![TeeKind::SevEs]
    );
    // Strict mode limits the kinds it does not ask for, per kind, as for any pod: sev 0 is a line the
    // kernel accepts.
    let strict = policy(&resources, SEV_ONLY, true);
    assert_eq!(
        pod_limits(&pod, false, &NO_CLAIMS, strict),
        vec![Limit {
            kind: TeeKind::Sev,
            keys: 0
        }]
    );
    assert_eq!(
        pod_unavailable_kinds(&pod, &NO_CLAIMS, strict),
        vec![TeeKind::SevEs]
    );
    let both = policy(&resources, &[TeeKind::Sev, TeeKind::SevEs], true);
    assert_eq!(pod_unavailable_kinds(&pod, &NO_CLAIMS, both), vec![]);
}
