//! DRA mode with the cgroup writer, end to end: the agent's `run` loop against the test kit's API
//! server and a simulated host, its kubelet plugin called over its real gRPC socket as the kubelet
//! calls it. A pod holding its key only through a claim of its own gets its pod cgroup's `misc.max`
//! from the claim's allocation, so the kernel refuses a second key.

mod common;

use common::kubelet::call;
use common::{Agent, NODE, config, create_pod, options};
use k8s_openapi::api::core::v1::Pod;
use serde_json::json;
use teeguard_agent::kubelet::PluginPaths;
use teeguard_agent::kubelet::proto::{
    Claim, NodePrepareResourcesRequest, NodePrepareResourcesResponse,
};
use teeguard_tests::dra::PREPARE;
use teeguard_tests::fakeapi::FakeApiServer;
use teeguard_tests::fixtures::tdx_node;
use teeguard_tests::host::{QosClass, SimHost, TDX};
use teeguard_tests::wait::eventually;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cgroup_writer_limits_a_pod_holding_a_key_through_its_own_claim_to_the_allocation() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 4, false)).expect("node");
    let host = SimHost::builder().capacity(TDX, 4).build().expect("host");
    let kubelet = tempfile::tempdir().expect("kubelet dir");
    let mut opts = options(
        NODE,
        host.root(),
        config("  accounting: dra\nenforcement:\n  mode: cgroup\n"),
    );
    opts.kubelet_dir = kubelet.path().to_path_buf();
    let agent = Agent::start_with(&api, opts);

    // A pod whose `compute` uses a claim made from a template; no key request anywhere.
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "vm", "namespace": "vms"},
        "spec": {
            "nodeName": NODE,
            "resourceClaims": [{"name": "tee", "resourceClaimTemplateName": "tdx-key"}],
            "containers": [{"name": "compute", "resources": {"claims": [{"name": "tee"}]}}],
        },
        "status": {"phase": "Running", "qosClass": "Burstable",
                   "resourceClaimStatuses": [{"name": "tee", "resourceClaimName": "vm-tee-x7"}]},
    }))
    .expect("pod");
    let uid = create_pod(&api, &pod);
    api.create(&json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": "vm-tee-x7", "namespace": "vms", "uid": "claim-1"},
        "spec": {"devices": {"requests": [{"name": "key",
            "exactly": {"deviceClassName": "tdx.tee.teeguard.dev"}}]}},
        "status": {
            "allocation": {"devices": {"results": [{"request": "key",
                "driver": "tee.teeguard.dev", "pool": NODE, "device": "tdx-2"}]}},
            "reservedFor": [{"resource": "pods", "name": "vm", "uid": uid}]
        }
    }))
    .expect("claim");

    // The kubelet prepares the claim before it creates the pod's sandbox (the driver refuses until
    // the agent has read the kernel's keys; the kubelet retries).
    let socket = PluginPaths::under(kubelet.path()).dra;
    eventually("the claim prepared", async || {
        if !socket.exists() {
            return false;
        }
        let r: NodePrepareResourcesResponse = call(
            &socket,
            PREPARE,
            NodePrepareResourcesRequest {
                claims: vec![Claim {
                    namespace: "vms".into(),
                    uid: "claim-1".into(),
                    name: "vm-tee-x7".into(),
                }],
            },
        )
        .await;
        r.claims["claim-1"].error.is_empty()
    })
    .await;

    // The kubelet creates the pod cgroup; the agent writes the claim's one key into it.
    host.add_pod(&uid, QosClass::Burstable, &["compute"])
        .expect("pod cgroup");
    eventually("misc.max tdx 1 in the pod cgroup", async || {
        host.pod_max(&uid, TDX) == Some(Some(1))
    })
    .await;
    host.start_vm(&uid, "compute", TDX).expect("the first key");
    assert!(
        host.start_vm(&uid, "compute", TDX).is_err(),
        "a second key is refused by the kernel"
    );
    assert_eq!(
        agent.metric(
            "teeguard_agent_limits_applied_total",
            &[("mechanism", "cgroup"), ("kind", "tdx")]
        ),
        1.0
    );
    agent.stop().await;
}
