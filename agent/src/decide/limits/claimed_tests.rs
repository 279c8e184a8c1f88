//! DRA mode: the limits follow what the prepared claims hold.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};
use teeguard_shared::TeeKind;
use teeguard_shared::config::ResourcesConfig;

use super::*;
use crate::decide::claimed::ClaimedKeys;
use crate::decide::claimed::tests::prepared;

fn tdx(keys: u64) -> Limit {
    Limit {
        kind: TeeKind::Tdx,
        keys,
    }
}

fn pod(spec: Value, status: Value, annotations: Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "vms", "uid": "pod-1", "annotations": annotations},
        "spec": spec,
        "status": status,
    }))
    .expect("pod")
}

fn claims(name: &str, devices: &[(&str, &str)]) -> ClaimedKeys {
    ClaimedKeys::from_prepared(&[prepared(name, devices)])
}

fn decide(pod: &Pod, container: &str, claimed: &ClaimedKeys, strict: bool) -> ContainerLimit {
    let resources = ResourcesConfig::default();
    let annotations: BTreeMap<String, String> =
        pod.metadata.annotations.clone().unwrap_or_default();
    container_limit(
        PodFacts {
            pod: Some(pod),
            annotations: &annotations,
            namespace_exempt: false,
            claimed,
        },
        container,
        Policy {
            resources: &resources,
            host_kinds: &[TeeKind::Tdx],
            strict,
        },
    )
}

fn pod_level(pod: &Pod, claimed: &ClaimedKeys, strict: bool) -> Vec<Limit> {
    let resources = ResourcesConfig::default();
    pod_limits(
        pod,
        false,
        claimed,
        Policy {
            resources: &resources,
            host_kinds: &[TeeKind::Tdx],
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

/// A pod holding keys only through a claim of its own (a ResourceClaimTemplate of the DeviceClass).
fn own_claim_pod() -> Pod {
    pod(
        json!({
            "resourceClaims": [{"name": "key", "resourceClaimTemplateName": "tdx-key"}],
            "containers": [
                {"name": "compute", "resources": {"claims": [{"name": "key"}]}},
                {"name": "sidecar"},
            ],
        }),
        json!({"resourceClaimStatuses": [{"name": "key", "resourceClaimName": "p-key-abcde"}]}),
        json!({}),
    )
}

#[test]
fn a_pod_holding_keys_only_through_its_own_claim_is_limited_to_the_claims_devices() {
    let held = claims("p-key-abcde", &[("tdx", "tdx-0")]);
    let pod = own_claim_pod();
    for strict in [false, true] {
        assert_eq!(decide(&pod, "compute", &held, strict), set(tdx(1)));
        assert_eq!(pod_level(&pod, &held, strict), vec![tdx(1)]);
        // The sidecar uses no claim: no limit of its own (never zeroed: the pod holds a claim); the
        // pod cgroup's limit bounds it.
        assert_eq!(
            decide(&pod, "sidecar", &held, strict),
            ContainerLimit::Unlimited
        );
    }
    // A claim not prepared by the agent (another driver's): nothing to set (strict mode: below).
    assert_eq!(
        decide(&pod, "compute", &ClaimedKeys::NONE, false),
        ContainerLimit::Unlimited
    );
    assert_eq!(pod_level(&pod, &ClaimedKeys::NONE, false), vec![]);
}

/// A launcher whose `compute` requests `request` TDX keys, served by the scheduler's claim.
fn extended_resource_pod(request: &str) -> Pod {
    pod(
        json!({"containers": [
            {"name": "compute", "resources": {"requests": {"tdx.intel.com/keys": request}}},
        ]}),
        json!({"extendedResourceClaimStatus": {
            "resourceClaimName": "p-extended-resources-x7",
            "requestMappings": [{"containerName": "compute", "resourceName": "tdx.intel.com/keys",
                                 "requestName": "container-0-request-0"}],
        }}),
        json!({"misc-max.teeguard.dev/compute": format!("tdx {request}")}),
    )
}

#[test]
fn an_extended_resource_served_by_a_claim_is_limited_by_the_allocation_not_the_request() {
    let pod = extended_resource_pod("1");
    let one = claims(
        "p-extended-resources-x7",
        &[("container-0-request-0", "tdx-4")],
    );
    assert_eq!(decide(&pod, "compute", &one, false), set(tdx(1)));
    assert_eq!(pod_level(&pod, &one, false), vec![tdx(1)]);
    // An allocation that differs from the request (not what the scheduler does, one device per
    // unit): the allocation is applied, and the annotation's disagreement reported.
    let two = claims(
        "p-extended-resources-x7",
        &[
            ("container-0-request-0", "tdx-4"),
            ("container-0-request-0", "tdx-5"),
        ],
    );
    assert_eq!(
        decide(&pod, "compute", &two, false),
        ContainerLimit::Set {
            limit: tdx(2),
            mismatch: Some(Mismatch::Differs {
                annotated: "tdx 1".into()
            })
        }
    );
    assert_eq!(pod_level(&pod, &two, false), vec![tdx(2)]);
}

#[test]
fn an_extended_resource_whose_claim_is_not_prepared_here_falls_back_to_the_request() {
    let pod = extended_resource_pod("1");
    let other = claims("another-claim", &[("r", "tdx-0")]);
    assert_eq!(decide(&pod, "compute", &other, false), set(tdx(1)));
    assert_eq!(pod_level(&pod, &other, false), vec![tdx(1)]);
}

#[test]
fn strict_mode_holds_a_pod_with_claims_to_what_the_agent_prepared_for_it() {
    let pod = own_claim_pod();
    // Its claim prepared: the allocation, and the container that uses no claim is not zeroed (the
    // pod holds keys; its cgroup's limit bounds every container).
    let held = claims("p-key-abcde", &[("tdx", "tdx-0")]);
    assert_eq!(
        decide(&pod, "sidecar", &held, true),
        ContainerLimit::Unlimited
    );
    assert_eq!(pod_level(&pod, &held, true), vec![tdx(1)]);
    // Its claims are none of the agent's (another driver's devices; or extended-resource mode, where
    // no claim holds keys): zeroed like any pod holding no key, since the kubelet has the driver
    // prepare a pod's claims before it creates the pod's containers.
    for other in [ClaimedKeys::NONE, claims("gpu-claim", &[("gpu", "tdx-7")])] {
        assert_eq!(decide(&pod, "compute", &other, true), set(tdx(0)));
        assert_eq!(decide(&pod, "sidecar", &other, true), set(tdx(0)));
        assert_eq!(pod_level(&pod, &other, true), vec![tdx(0)]);
        assert_eq!(pod_level(&pod, &other, false), vec![]);
    }
}
