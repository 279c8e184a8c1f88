//! Exhaustive tests of the limit decisions.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use teeguard_shared::TeeKind;
use teeguard_shared::config::ResourcesConfig;
use teeguard_tests::fixtures::{self as fx, KataTee, Tee, VirtLauncherPod};

use super::*;

const TDX_KEYS: &str = "tdx.intel.com/keys";
const ESIDS: &str = "sev-snp.amd.com/esids";
const ANNOTATION: &str = "misc-max.teeguard.dev/compute";
/// Extended-resource mode: the agent prepares no claim.
static NO_CLAIMS: ClaimedKeys = ClaimedKeys::NONE;

fn tdx(keys: u64) -> Limit {
    Limit {
        kind: TeeKind::Tdx,
        keys,
    }
}

fn sev_es(keys: u64) -> Limit {
    Limit {
        kind: TeeKind::SevEs,
        keys,
    }
}

fn admitted(tee: Tee, resource: &str, annotation: Option<&str>) -> Pod {
    let mut b = VirtLauncherPod::for_tee("vm", tee).request(resource, "1");
    if let Some(a) = annotation {
        b = b.annotation(ANNOTATION, a);
    }
    b.running_on("node-a").build()
}

fn annotations(pod: &Pod) -> BTreeMap<String, String> {
    pod.metadata.annotations.clone().unwrap_or_default()
}

fn decide(
    pod: Option<&Pod>,
    ann: &BTreeMap<String, String>,
    container: &str,
    host: &[TeeKind],
    strict: bool,
) -> ContainerLimit {
    let resources = ResourcesConfig::default();
    container_limit(
        PodFacts {
            pod,
            annotations: ann,
            namespace_exempt: false,
            claimed: &NO_CLAIMS,
        },
        container,
        Policy {
            resources: &resources,
            host_kinds: host,
            strict,
        },
    )
}

fn set(limit: Limit) -> ContainerLimit {
    ContainerLimit::Set {
        limit,
        mismatch: None,
    }
}

#[test]
fn limit_lines_parse_and_print_as_the_kernel_writes_them() {
    assert_eq!(Limit::parse("tdx 1"), Some(tdx(1)));
    assert_eq!(Limit::parse("  sev_es   2 "), Some(sev_es(2)));
    for bad in ["", "tdx", "tdx x", "tdx -1", "snp 1", "tdx 1 2", "tdx=1"] {
        assert_eq!(Limit::parse(bad), None, "{bad:?}");
    }
    assert_eq!(tdx(1).to_string(), "tdx 1");
    assert_eq!(sev_es(0).to_string(), "sev_es 0");
}

#[test]
fn a_tdx_compute_container_gets_tdx_1() {
    let pod = admitted(Tee::Tdx, TDX_KEYS, Some("tdx 1"));
    let ann = annotations(&pod);
    assert_eq!(
        decide(Some(&pod), &ann, "compute", &[TeeKind::Tdx], false),
        set(tdx(1))
    );
}

#[test]
fn an_snp_compute_container_gets_sev_es_1() {
    let pod = admitted(Tee::Snp, ESIDS, Some("sev_es 1"));
    let ann = annotations(&pod);
    assert_eq!(
        decide(
            Some(&pod),
            &ann,
            "compute",
            &[TeeKind::Sev, TeeKind::SevEs],
            false
        ),
        set(sev_es(1))
    );
}

#[test]
fn other_containers_of_a_tee_pod_are_left_alone() {
    let pod = admitted(Tee::Tdx, TDX_KEYS, Some("tdx 1"));
    let ann = annotations(&pod);
    assert_eq!(
        decide(
            Some(&pod),
            &ann,
            "guest-console-log",
            &[TeeKind::Tdx],
            false
        ),
        ContainerLimit::Unlimited
    );
}

#[test]
fn an_annotation_disagreeing_with_the_requests_applies_the_requests() {
    let pod = admitted(Tee::Tdx, TDX_KEYS, Some("tdx 4"));
    let ann = annotations(&pod);
    assert_eq!(
        decide(Some(&pod), &ann, "compute", &[TeeKind::Tdx], false),
        ContainerLimit::Set {
            limit: tdx(1),
            mismatch: Some(Mismatch::Differs {
                annotated: "tdx 4".into()
            })
        }
    );
    // Another kind than requested.
    let pod = admitted(Tee::Tdx, TDX_KEYS, Some("sev_es 1"));
    let ann = annotations(&pod);
    assert!(matches!(
        decide(Some(&pod), &ann, "compute", &[TeeKind::Tdx], false),
        ContainerLimit::Set { limit, mismatch: Some(Mismatch::Differs { .. }) } if limit == tdx(1)
    ));
    // Malformed.
    let pod = admitted(Tee::Tdx, TDX_KEYS, Some("tdx lots"));
    let ann = annotations(&pod);
    assert!(matches!(
        decide(Some(&pod), &ann, "compute", &[TeeKind::Tdx], false),
        ContainerLimit::Set { limit, mismatch: Some(Mismatch::Malformed { .. }) } if limit == tdx(1)
    ));
}

#[test]
fn an_annotation_on_a_container_requesting_nothing_gives_zero_keys() {
    // The annotation claims a key the scheduler never counted: the container may hold none.
    let pod = VirtLauncherPod::for_tee("vm", Tee::Tdx)
        .annotation(ANNOTATION, "tdx 1")
        .running_on("node-a")
        .build();
    let ann = annotations(&pod);
    assert_eq!(
        decide(Some(&pod), &ann, "compute", &[TeeKind::Tdx], false),
        ContainerLimit::Set {
            limit: tdx(0),
            mismatch: Some(Mismatch::Differs {
                annotated: "tdx 1".into()
            })
        }
    );
}

#[test]
fn requests_without_an_annotation_are_still_enforced() {
    let pod = admitted(Tee::Tdx, TDX_KEYS, None);
    assert_eq!(
        decide(
            Some(&pod),
            &BTreeMap::new(),
            "compute",
            &[TeeKind::Tdx],
            false
        ),
        set(tdx(1))
    );
}

#[test]
fn an_unknown_pod_gets_its_valid_annotation_and_nothing_else() {
    let ann = BTreeMap::from([(ANNOTATION.to_string(), "tdx 1".to_string())]);
    assert_eq!(
        decide(None, &ann, "compute", &[TeeKind::Tdx], true),
        set(tdx(1))
    );
    assert_eq!(
        decide(None, &ann, "other", &[TeeKind::Tdx], true),
        ContainerLimit::Unlimited
    );
    let bad = BTreeMap::from([(ANNOTATION.to_string(), "tdx".to_string())]);
    assert_eq!(
        decide(None, &bad, "compute", &[TeeKind::Tdx], false),
        ContainerLimit::Unlimited
    );
    assert_eq!(
        decide(None, &BTreeMap::new(), "compute", &[TeeKind::Tdx], true),
        ContainerLimit::Unlimited
    );
}

#[test]
fn strict_mode_zeroes_containers_of_pods_requesting_nothing_on_single_kind_hosts() {
    let plain = VirtLauncherPod::for_tee("plain", Tee::None)
        .running_on("node-a")
        .build();
    let none = BTreeMap::new();
    assert_eq!(
        decide(Some(&plain), &none, "compute", &[TeeKind::Tdx], true),
        set(tdx(0))
    );
    assert_eq!(
        decide(Some(&plain), &none, "compute", &[TeeKind::Tdx], false),
        ContainerLimit::Unlimited
    );
    // Two kinds do not fit in one misc.max line: the pod-level writer covers them.
    assert_eq!(
        decide(
            Some(&plain),
            &none,
            "compute",
            &[TeeKind::Sev, TeeKind::SevEs],
            true
        ),
        ContainerLimit::Unlimited
    );
    // Exempt pods are left alone.
    let exempt = VirtLauncherPod::for_tee("exempt", Tee::None)
        .exempt()
        .running_on("node-a")
        .build();
    assert_eq!(
        decide(Some(&exempt), &none, "compute", &[TeeKind::Tdx], true),
        ContainerLimit::Unlimited
    );
    // A container of a pod that requests keys elsewhere (a sidecar) is not zeroed: the pod level holds it.
    let tee = admitted(Tee::Tdx, TDX_KEYS, Some("tdx 1"));
    assert_eq!(
        decide(
            Some(&tee),
            &annotations(&tee),
            "sidecar",
            &[TeeKind::Tdx],
            true
        ),
        ContainerLimit::Unlimited
    );
}

#[test]
fn pod_limits_follow_requests_overhead_and_strict_mode() {
    let resources = ResourcesConfig::default();
    let policy = |host: &'static [TeeKind], strict| Policy {
        resources: &resources,
        host_kinds: host,
        strict,
    };
    let vm = admitted(Tee::Tdx, TDX_KEYS, Some("tdx 1"));
    assert_eq!(
        pod_limits(&vm, false, &NO_CLAIMS, policy(&[TeeKind::Tdx], false)),
        vec![tdx(1)]
    );
    assert_eq!(
        pod_limits(&vm, false, &NO_CLAIMS, policy(&[TeeKind::Tdx], true)),
        vec![tdx(1)]
    );

    // Kata: the key comes from the RuntimeClass overhead.
    let kata = fx::kata_pod("kata", KataTee::Tdx);
    assert_eq!(
        pod_limits(&kata, false, &NO_CLAIMS, policy(&[TeeKind::Tdx], false)),
        vec![tdx(1)]
    );

    let plain = VirtLauncherPod::for_tee("plain", Tee::None)
        .running_on("node-a")
        .build();
    assert_eq!(
        pod_limits(&plain, false, &NO_CLAIMS, policy(&[TeeKind::Tdx], false)),
        vec![]
    );
    assert_eq!(
        pod_limits(
            &plain,
            false,
            &NO_CLAIMS,
            policy(&[TeeKind::Sev, TeeKind::SevEs], true)
        ),
        vec![
            Limit {
                kind: TeeKind::Sev,
                keys: 0
            },
            sev_es(0)
        ]
    );
    // An SNP VM on an AMD host in strict mode: its own kind at its request, the other at 0.
    let snp = admitted(Tee::Snp, ESIDS, Some("sev_es 1"));
    assert_eq!(
        pod_limits(
            &snp,
            false,
            &NO_CLAIMS,
            policy(&[TeeKind::Sev, TeeKind::SevEs], true)
        ),
        vec![
            Limit {
                kind: TeeKind::Sev,
                keys: 0
            },
            sev_es(1)
        ]
    );
    let exempt = VirtLauncherPod::for_tee("exempt", Tee::None)
        .exempt()
        .running_on("node-a")
        .build();
    assert_eq!(
        pod_limits(&exempt, false, &NO_CLAIMS, policy(&[TeeKind::Tdx], true)),
        vec![]
    );
}

#[test]
fn an_unparsable_request_is_never_zeroed() {
    let pod = VirtLauncherPod::for_tee("odd", Tee::Tdx)
        .request(TDX_KEYS, "500m")
        .running_on("node-a")
        .build();
    let resources = ResourcesConfig::default();
    let policy = Policy {
        resources: &resources,
        host_kinds: &[TeeKind::Tdx],
        strict: true,
    };
    assert_eq!(pod_limits(&pod, false, &NO_CLAIMS, policy), vec![]);
    assert_eq!(
        decide(
            Some(&pod),
            &BTreeMap::new(),
            "compute",
            &[TeeKind::Tdx],
            true
        ),
        ContainerLimit::Unlimited
    );
}

#[test]
fn the_annotation_check_sees_only_teeguards_prefix() {
    let mut ann = BTreeMap::from([(
        "unified-cgroup.crio.io/compute".to_string(),
        "misc.max=tdx 1".to_string(),
    )]);
    assert!(!has_limit_annotation(&ann));
    ann.insert(ANNOTATION.into(), "tdx 1".into());
    assert!(has_limit_annotation(&ann));
}

#[test]
fn strict_mode_leaves_the_pods_of_an_exempt_namespace_alone() {
    let resources = ResourcesConfig::default();
    let policy = Policy {
        resources: &resources,
        host_kinds: &[TeeKind::Tdx],
        strict: true,
    };
    let plain = VirtLauncherPod::for_tee("plain", Tee::None)
        .running_on("node-a")
        .build();
    let none = BTreeMap::new();
    let facts = |namespace_exempt| PodFacts {
        pod: Some(&plain),
        annotations: &none,
        namespace_exempt,
        claimed: &NO_CLAIMS,
    };
    assert_eq!(
        container_limit(facts(false), "compute", policy),
        ContainerLimit::Set {
            limit: tdx(0),
            mismatch: None
        },
        "not exempt: zeroed"
    );
    assert_eq!(
        container_limit(facts(true), "compute", policy),
        ContainerLimit::Unlimited
    );
    assert_eq!(pod_limits(&plain, false, &NO_CLAIMS, policy), vec![tdx(0)]);
    assert_eq!(pod_limits(&plain, true, &NO_CLAIMS, policy), vec![]);
    // A pod of an exempt namespace that requests a key is still held to its request (what the
    // scheduler counted): exemption only lifts strict mode's zero.
    let vm = admitted(Tee::Tdx, TDX_KEYS, Some("tdx 1"));
    assert_eq!(pod_limits(&vm, true, &NO_CLAIMS, policy), vec![tdx(1)]);
}

#[test]
fn only_strict_modes_zero_of_a_keyless_pod_depends_on_the_namespace_label() {
    let resources = ResourcesConfig::default();
    let policy = |strict| Policy {
        resources: &resources,
        host_kinds: &[TeeKind::Tdx],
        strict,
    };
    let plain = VirtLauncherPod::for_tee("plain", Tee::None)
        .running_on("node-a")
        .build();
    let labelled = VirtLauncherPod::for_tee("labelled", Tee::None)
        .exempt()
        .running_on("node-a")
        .build();
    let vm = admitted(Tee::Tdx, TDX_KEYS, Some("tdx 1"));
    let (none, vm_annotations) = (BTreeMap::new(), annotations(&vm));
    let facts = |pod, annotations, namespace_exempt| PodFacts {
        pod: Some(pod),
        annotations,
        namespace_exempt,
        claimed: &NO_CLAIMS,
    };
    // Whatever the namespace's label is now.
    for namespace_exempt in [false, true] {
        let zero = |pod, annotations, container, strict| {
            namespace_zero(
                facts(pod, annotations, namespace_exempt),
                container,
                policy(strict),
            )
        };
        assert_eq!(zero(&plain, &none, "compute", true), Some(tdx(0)));
        assert_eq!(zero(&plain, &none, "compute", false), None, "strict off");
        assert_eq!(
            zero(&labelled, &none, "compute", true),
            None,
            "the pod itself exempt"
        );
        assert_eq!(zero(&vm, &vm_annotations, "compute", true), None, "its key");
        assert_eq!(
            zero(&vm, &vm_annotations, "sidecar", true),
            None,
            "its pod's key"
        );
    }
    // A zero its annotation gives (a container requesting no key of the kind annotated) does not
    // depend on the label.
    let annotated = BTreeMap::from([(ANNOTATION.to_string(), "tdx 1".to_string())]);
    assert_eq!(
        namespace_zero(facts(&plain, &annotated, true), "compute", policy(true)),
        None
    );
}

#[test]
fn a_launchers_key_in_the_pod_overhead_is_computes_once_and_no_other_containers() {
    // KubeVirt's defaultRuntimeClass with the key in overhead.podFixed: the scheduler counted one key
    // for the pod, and the VM runs in compute.
    let mut pod = VirtLauncherPod::for_tee("vm", Tee::Tdx)
        .annotation(ANNOTATION, "tdx 1")
        .running_on("node-a")
        .build();
    let spec = pod.spec.as_mut().expect("spec");
    spec.runtime_class_name = Some("kata-qemu-tdx".into());
    spec.overhead = Some(BTreeMap::from([(
        TDX_KEYS.to_string(),
        k8s_openapi::apimachinery::pkg::api::resource::Quantity("1".into()),
    )]));
    let ann = annotations(&pod);
    assert_eq!(
        decide(Some(&pod), &ann, "compute", &[TeeKind::Tdx], false),
        set(tdx(1))
    );
    assert_eq!(
        decide(
            Some(&pod),
            &ann,
            "guest-console-log",
            &[TeeKind::Tdx],
            false
        ),
        ContainerLimit::Unlimited
    );
    let resources = ResourcesConfig::default();
    let policy = Policy {
        resources: &resources,
        host_kinds: &[TeeKind::Tdx],
        strict: false,
    };
    assert_eq!(pod_limits(&pod, false, &NO_CLAIMS, policy), vec![tdx(1)]);
    // Not a virt-launcher pod (a Kata pod): its overhead key is the sandbox's, no container's.
    pod.metadata
        .labels
        .as_mut()
        .expect("labels")
        .remove("kubevirt.io");
    assert_eq!(
        decide(
            Some(&pod),
            &BTreeMap::new(),
            "compute",
            &[TeeKind::Tdx],
            false
        ),
        ContainerLimit::Unlimited
    );
}
