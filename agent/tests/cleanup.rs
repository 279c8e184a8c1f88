//! `teeguard-agent cleanup`: through the kube client against the fake API server, it removes from a
//! Node exactly what the agent added (its extended resources and their annotation), the node's
//! TeeCapacity and its heartbeat Lease, leaves what others own (NFD's resource, cpu, other annotations,
//! a Lease of the same name without teeguard's label), and is idempotent.

use k8s_openapi::api::core::v1::Node;
use serde_json::{Value, json};
use teeguard_agent::cluster::cleanup::{Cleaned, cleanup};
use teeguard_shared::config::ResourcesConfig;
use teeguard_shared::names::{
    AGENT_EXTENDED_RESOURCES_ANNOTATION, AGENT_LEASE_LABEL, NFD_EXTENDED_RESOURCES_ANNOTATION,
};
use teeguard_shared::{TeeCapacity, TeeKind};
use teeguard_tests::fakeapi::FakeApiServer;
use teeguard_tests::fixtures::{NodeBuilder, ReportBuilder};

const TDX: &str = "tdx.intel.com/keys";
const ESIDS: &str = "sev-snp.amd.com/esids";

/// A node on which the agent advertised TDX keys and NFD owns the SEV-SNP resource.
fn node() -> Value {
    let mut v = NodeBuilder::new("node-a").tdx(4).to_value();
    if let Some(m) = v["metadata"].as_object_mut() {
        for k in ["uid", "resourceVersion", "creationTimestamp"] {
            m.remove(k);
        }
    }
    v["metadata"]["annotations"][AGENT_EXTENDED_RESOURCES_ANNOTATION] = json!(TDX);
    v["metadata"]["annotations"][NFD_EXTENDED_RESOURCES_ANNOTATION] = json!(ESIDS);
    v["metadata"]["annotations"]["example.com/keep"] = json!("yes");
    for field in ["capacity", "allocatable"] {
        v["status"][field][TDX] = json!("3");
        v["status"][field][ESIDS] = json!("10");
    }
    v
}

#[tokio::test]
async fn cleanup_removes_only_what_the_agent_added_and_is_idempotent() {
    let api = FakeApiServer::new();
    api.create(&node()).expect("node");
    api.create(
        &ReportBuilder::new("node-a")
            .kind(TeeKind::Tdx, 4, 1)
            .to_value(),
    )
    .expect("report");
    api.create(&lease("node-a", true)).expect("lease");
    let res = ResourcesConfig::default();

    let cleaned = cleanup(api.client(), "node-a", &res)
        .await
        .expect("cleanup");
    assert_eq!(
        cleaned,
        Cleaned {
            resources: vec![TDX.to_string()],
            annotation: true,
            report: true,
            lease: true,
            slices: 0,
        }
    );
    assert!(
        api.get("leases", Some("default"), "node-a").is_none(),
        "the heartbeat Lease is deleted"
    );
    let n: Node = api
        .get_typed(None, "node-a")
        .expect("typed")
        .expect("the Node stays");
    let status = n.status.expect("status");
    for map in [
        status.capacity.expect("capacity"),
        status.allocatable.expect("allocatable"),
    ] {
        assert!(!map.contains_key(TDX), "{map:?}");
        assert_eq!(
            map.get(ESIDS).map(|q| q.0.as_str()),
            Some("10"),
            "NFD's stays"
        );
        assert!(map.contains_key("cpu"));
    }
    let annotations = n.metadata.annotations.expect("annotations");
    assert!(!annotations.contains_key(AGENT_EXTENDED_RESOURCES_ANNOTATION));
    assert_eq!(
        annotations
            .get(NFD_EXTENDED_RESOURCES_ANNOTATION)
            .map(String::as_str),
        Some(ESIDS)
    );
    assert_eq!(
        annotations.get("example.com/keep").map(String::as_str),
        Some("yes")
    );
    assert!(
        api.get_typed::<TeeCapacity>(None, "node-a")
            .expect("typed")
            .is_none(),
        "the report is deleted"
    );

    // A second run finds nothing and changes nothing.
    let again = cleanup(api.client(), "node-a", &res)
        .await
        .expect("cleanup");
    assert_eq!(again, Cleaned::default());
    assert_eq!(
        again.to_string(),
        "nothing of teeguard's was left on the node"
    );
}

/// A Lease named after the node in the client's namespace, with or without teeguard's label.
fn lease(node: &str, teeguards: bool) -> Value {
    let mut v = json!({
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": node, "namespace": "default"},
        "spec": {"holderIdentity": node},
    });
    if teeguards {
        v["metadata"]["labels"] = json!({AGENT_LEASE_LABEL: "true"});
    }
    v
}

#[tokio::test]
async fn cleanup_leaves_a_lease_of_the_same_name_that_is_not_teeguards() {
    let api = FakeApiServer::new();
    api.create(&node()).expect("node");
    api.create(&lease("node-a", false))
        .expect("someone else's lease");
    let cleaned = cleanup(api.client(), "node-a", &ResourcesConfig::default())
        .await
        .expect("cleanup");
    assert!(!cleaned.lease, "{cleaned:?}");
    assert!(api.get("leases", Some("default"), "node-a").is_some());
}

#[tokio::test]
async fn cleanup_of_a_missing_node_says_which() {
    let api = FakeApiServer::new();
    let err = cleanup(api.client(), "ghost", &ResourcesConfig::default())
        .await
        .expect_err("no such node");
    let msg = err.to_string();
    assert!(msg.contains("get the Node to clean up"), "{msg}");
}
