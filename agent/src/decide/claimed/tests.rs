//! What prepared claims give a container and a pod, for every way a pod reaches a claim.

use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};
use teeguard_shared::TeeKind;
use teeguard_shared::config::ResourcesConfig;

use super::*;
use crate::decide::dra::{AllocatedDevice, PreparedClaim};

const NS: &str = "vms";

fn pod(spec: Value, status: Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": NS, "uid": "pod-1"},
        "spec": spec,
        "status": status,
    }))
    .expect("pod")
}

/// A claim of namespace `vms` reserved for `pod-1`, as the driver records it: (request, device) pairs.
pub(crate) fn prepared(name: &str, devices: &[(&str, &str)]) -> PreparedClaim {
    prepared_in(NS, name, devices)
}

/// [`prepared`] in `namespace`.
pub(crate) fn prepared_in(namespace: &str, name: &str, devices: &[(&str, &str)]) -> PreparedClaim {
    PreparedClaim {
        namespace: namespace.into(),
        name: name.into(),
        pods: vec!["pod-1".into()],
        devices: devices
            .iter()
            .map(|(request, device)| AllocatedDevice {
                request: (*request).into(),
                pool: "node-a".into(),
                device: (*device).into(),
            })
            .collect(),
    }
}

fn keys(pairs: &[(TeeKind, u64)]) -> BTreeMap<TeeKind, u64> {
    pairs.iter().copied().collect()
}

/// A launcher whose `compute` requests one TDX key, served by the scheduler's claim (KEP-5004).
fn extended_resource_pod() -> Pod {
    pod(
        json!({"containers": [
            {"name": "compute", "resources": {"requests": {"tdx.intel.com/keys": "1"}}},
            {"name": "sidecar"},
        ]}),
        json!({"extendedResourceClaimStatus": {
            "resourceClaimName": "vm-extended-resources-x7",
            "requestMappings": [{"containerName": "compute", "resourceName": "tdx.intel.com/keys",
                                 "requestName": "container-0-request-0"}],
        }}),
    )
}

#[test]
fn an_extended_resource_served_by_a_prepared_claim_counts_its_devices_for_the_mapped_container() {
    let r = ResourcesConfig::default();
    let claims = ClaimedKeys::from_prepared(&[prepared(
        "vm-extended-resources-x7",
        &[("container-0-request-0", "tdx-1")],
    )]);
    let pod = extended_resource_pod();
    let compute = container_claimed(&pod, "compute", &claims, &r);
    assert_eq!(compute.keys, keys(&[(TeeKind::Tdx, 1)]));
    assert_eq!(compute.served, [TeeKind::Tdx].into());
    assert_eq!(
        compute.total(TeeKind::Tdx, 1),
        1,
        "the request is not counted twice"
    );
    assert_eq!(
        container_claimed(&pod, "sidecar", &claims, &r),
        Claimed::default()
    );
    let whole = pod_claimed(&pod, &claims, &r);
    assert_eq!(whole.keys, keys(&[(TeeKind::Tdx, 1)]));
    assert_eq!(whole.served, [TeeKind::Tdx].into());
    assert!(claims.holds_for("pod-1"));
    assert!(!claims.holds_for("pod-2"));
}

#[test]
fn a_claim_the_agent_did_not_prepare_gives_nothing_and_serves_no_request() {
    let r = ResourcesConfig::default();
    let claims = ClaimedKeys::from_prepared(&[prepared("someone-else", &[("r", "tdx-0")])]);
    let pod = extended_resource_pod();
    let compute = container_claimed(&pod, "compute", &claims, &r);
    assert_eq!(compute, Claimed::default());
    assert_eq!(compute.total(TeeKind::Tdx, 1), 1, "the request stands");
    assert_eq!(pod_claimed(&pod, &claims, &r), Claimed::default());
    assert_eq!(
        container_claimed(&pod, "compute", &ClaimedKeys::NONE, &r),
        Claimed::default()
    );
}

/// A pod with a claim of its own from a template, used by `compute` only.
fn template_pod(reference: Value, status: Value) -> Pod {
    pod(
        json!({
            "resourceClaims": [{"name": "key", "resourceClaimTemplateName": "tdx-key"}],
            "containers": [
                {"name": "compute", "resources": {"claims": [reference]}},
                {"name": "sidecar"},
            ],
        }),
        status,
    )
}

#[test]
fn a_claim_of_its_own_from_a_template_gives_its_devices_to_the_containers_that_use_it() {
    let r = ResourcesConfig::default();
    let claims = ClaimedKeys::from_prepared(&[prepared(
        "p-key-abcde",
        &[("tdx", "tdx-0"), ("tdx", "tdx-3")],
    )]);
    let status =
        json!({"resourceClaimStatuses": [{"name": "key", "resourceClaimName": "p-key-abcde"}]});
    let pod = template_pod(json!({"name": "key"}), status.clone());
    let compute = container_claimed(&pod, "compute", &claims, &r);
    assert_eq!(compute.keys, keys(&[(TeeKind::Tdx, 2)]));
    assert!(compute.served.is_empty(), "no extended resource is served");
    assert_eq!(
        container_claimed(&pod, "sidecar", &claims, &r),
        Claimed::default()
    );
    assert_eq!(
        pod_claimed(&pod, &claims, &r).keys,
        keys(&[(TeeKind::Tdx, 2)])
    );
    // The template's claim not named in the status yet: nothing known.
    let unnamed = template_pod(json!({"name": "key"}), json!({}));
    assert_eq!(
        container_claimed(&unnamed, "compute", &claims, &r),
        Claimed::default()
    );
    assert_eq!(pod_claimed(&unnamed, &claims, &r), Claimed::default());
}

#[test]
fn a_container_naming_one_request_gets_that_requests_devices_and_its_sub_requests() {
    let r = ResourcesConfig::default();
    let claims = ClaimedKeys::from_prepared(&[prepared(
        "p-key-abcde",
        &[
            ("a", "tdx-0"),
            ("ab", "tdx-1"),
            ("c/large", "sev-es-4"),
            ("c", "sev-es-5"),
        ],
    )]);
    let status =
        json!({"resourceClaimStatuses": [{"name": "key", "resourceClaimName": "p-key-abcde"}]});
    let only = |request: &str| {
        let pod = template_pod(json!({"name": "key", "request": request}), status.clone());
        container_claimed(&pod, "compute", &claims, &r).keys
    };
    assert_eq!(
        only("a"),
        keys(&[(TeeKind::Tdx, 1)]),
        "`ab` is another request"
    );
    assert_eq!(only("c"), keys(&[(TeeKind::SevEs, 2)]), "`c/large` is c's");
    assert_eq!(only("missing"), keys(&[]));
    let pod = template_pod(json!({"name": "key", "request": "a"}), status);
    assert_eq!(
        pod_claimed(&pod, &claims, &r).keys,
        keys(&[(TeeKind::Tdx, 2), (TeeKind::SevEs, 2)]),
        "the pod holds every device of the claim"
    );
}

#[test]
fn a_named_claim_shared_by_two_containers_counts_for_each_and_once_for_the_pod() {
    let r = ResourcesConfig::default();
    let claims = ClaimedKeys::from_prepared(&[prepared("shared-key", &[("key", "sev-2")])]);
    let pod = pod(
        json!({
            "resourceClaims": [{"name": "key", "resourceClaimName": "shared-key"}],
            "initContainers": [{"name": "setup", "resources": {"claims": [{"name": "key"}]}}],
            "containers": [{"name": "vmm", "resources": {"claims": [{"name": "key"}]}}],
        }),
        json!({}),
    );
    for c in ["setup", "vmm"] {
        assert_eq!(
            container_claimed(&pod, c, &claims, &r).keys,
            keys(&[(TeeKind::Sev, 1)]),
            "{c}"
        );
    }
    assert_eq!(
        pod_claimed(&pod, &claims, &r).keys,
        keys(&[(TeeKind::Sev, 1)])
    );
}

#[test]
fn a_pod_with_both_an_extended_resource_claim_and_one_of_its_own_holds_both() {
    let r = ResourcesConfig::default();
    let claims = ClaimedKeys::from_prepared(&[
        prepared(
            "vm-extended-resources-x7",
            &[("container-0-request-0", "tdx-0")],
        ),
        prepared("p-key-abcde", &[("tdx", "tdx-1")]),
    ]);
    let pod = pod(
        json!({
            "resourceClaims": [{"name": "key", "resourceClaimTemplateName": "tdx-key"}],
            "containers": [{"name": "compute", "resources": {
                "requests": {"tdx.intel.com/keys": "1"}, "claims": [{"name": "key"}]}}],
        }),
        json!({
            "resourceClaimStatuses": [{"name": "key", "resourceClaimName": "p-key-abcde"}],
            "extendedResourceClaimStatus": {
                "resourceClaimName": "vm-extended-resources-x7",
                "requestMappings": [{"containerName": "compute", "resourceName": "tdx.intel.com/keys",
                                     "requestName": "container-0-request-0"}],
            },
        }),
    );
    let compute = container_claimed(&pod, "compute", &claims, &r);
    assert_eq!(compute.total(TeeKind::Tdx, 1), 2);
    assert_eq!(pod_claimed(&pod, &claims, &r).total(TeeKind::Tdx, 1), 2);
}

#[test]
fn devices_whose_names_do_not_parse_are_left_out() {
    let claims = ClaimedKeys::from_prepared(&[prepared("c", &[("r", "gpu-0"), ("r", "tdx-0")])]);
    let pod = pod(
        json!({
            "resourceClaims": [{"name": "c", "resourceClaimName": "c"}],
            "containers": [{"name": "x", "resources": {"claims": [{"name": "c"}]}}],
        }),
        json!({}),
    );
    assert_eq!(
        container_claimed(&pod, "x", &claims, &ResourcesConfig::default()).keys,
        keys(&[(TeeKind::Tdx, 1)])
    );
}
