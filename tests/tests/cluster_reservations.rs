//! Holds against a real kube-apiserver (see `teeguard_tests::controlplane`): bindings racing for a
//! node's last key through two webhook processes (one elected through a real Lease decides, the
//! other forwards), the hold written behind into the node's `TeeReservation`, and that object
//! garbage-collected with its Node by the real kube-controller-manager. Skipped (one line) without
//! control plane binaries, unless `CI=true`.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::json;
use teeguard_shared::TeeKind;
use teeguard_shared::reservation::TeeReservation;
use teeguard_tests::fixtures::{self, NodeBuilder, ReportBuilder, TDX_KEYS, Tee};
use teeguard_tests::realcluster::{Cluster, TEST_LABEL, within};
use teeguard_tests::standalone::client::{admitted, refusals, review_together};

const DEADLINE: Duration = Duration::from_secs(120);

/// A TDX virt-launcher pod as admitted (key request on `compute`) that no node's labels select, so
/// the real scheduler leaves it pending: the test sends the bindings itself.
fn admitted_pod(ns: &str, vmi: &str, vmi_uid: &str) -> Pod {
    let mut pod = Cluster::launcher_pod(ns, vmi, vmi_uid, Tee::Tdx, &[(TEST_LABEL, "nowhere")])
        .expect("launcher pod");
    let mut v = serde_json::to_value(&pod).expect("json");
    let res = &mut v["spec"]["containers"][0]["resources"];
    for part in ["requests", "limits"] {
        res[part][TDX_KEYS] = json!("1");
    }
    pod = serde_json::from_value(v).expect("pod");
    pod
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_take_a_last_key_once_and_the_reservation_goes_with_its_node() {
    let Some(cluster) = Cluster::connect().await else {
        return;
    };
    within(DEADLINE, async {
        let test = "reservations";
        let env = cluster.process_env("").expect("process env");
        let ns = cluster.namespace(test, test, &[]).await.expect("namespace");
        let node = format!("{ns}-n1");
        cluster
            .node(&NodeBuilder::new(&node).tdx(31).label(TEST_LABEL, test))
            .await
            .expect("node");
        cluster
            .report(&ReportBuilder::new(&node).kind_with_external(TeeKind::Tdx, 31, 1, 0))
            .await
            .expect("report");
        let webhooks = [
            env.start_webhook(&[]).await.expect("webhook a"),
            env.start_webhook(&[]).await.expect("webhook b"),
        ];
        let pods_api: Api<Pod> = Api::namespaced(cluster.client.clone(), &ns);
        let mut pods = Vec::new();
        for i in 0..20 {
            let vmi = format!("vm-{i:02}");
            let uid = cluster.create_vmi(&ns, &vmi, Tee::Tdx).await.expect("vmi");
            let created = pods_api
                .create(&PostParams::default(), &admitted_pod(&ns, &vmi, &uid))
                .await
                .expect("pod created");
            pods.push(created);
        }
        // Both replicas' report caches have the node's report.
        for w in &webhooks {
            cluster
                .wait_for("the report in the webhook's cache", || async {
                    w.metrics()
                        .await
                        .contains("teeguard_webhook_cache_objects{cache=\"teecapacities\"}")
                        .then_some(())
                })
                .await
                .expect("cached");
        }
        let clients: Vec<_> = webhooks
            .iter()
            .map(|w| Arc::new(w.client().expect("client")))
            .collect();
        let bindings = pods
            .iter()
            .map(|pod| fixtures::binding_create(pod, &node))
            .collect();
        let replies = review_together(&clients, "/validate", bindings)
            .await
            .expect("answered");
        let (admitted, refused) = (admitted(&replies), refusals(&replies));
        assert!(replies.iter().all(|r| r.warnings.is_empty()), "{replies:?}");
        assert_eq!(
            admitted, 1,
            "exactly one of 20 bindings over two replicas: {refused:?}"
        );
        assert!(
            refused
                .iter()
                .all(|m| m.contains(&format!("node {node} cannot host this TDX VM: 0/31 free"))),
            "{refused:?}"
        );

        // The reservation is written behind, lists the winner, and is owned by the Node.
        let reservations: Api<TeeReservation> = Api::all(cluster.client.clone());
        let res = cluster
            .wait_for("the hold written behind", || async {
                reservations.get_opt(&node).await.ok().flatten()
            })
            .await
            .expect("TeeReservation");
        assert_eq!(
            res.spec.reservations.len(),
            1,
            "{:?}",
            res.spec.reservations
        );
        let nodes: Api<Node> = Api::all(cluster.client.clone());
        let node_uid = nodes.get(&node).await.expect("node").metadata.uid;
        let owner = &res.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!(Some(owner.uid.clone()), node_uid);

        // The Node goes; the garbage collector takes its TeeReservation.
        nodes
            .delete(&node, &DeleteParams::default())
            .await
            .expect("delete node");
        cluster
            .wait_for("the TeeReservation to be garbage-collected", || async {
                reservations
                    .get_opt(&node)
                    .await
                    .ok()?
                    .is_none()
                    .then_some(())
            })
            .await
            .expect("garbage-collected with the Node");
    })
    .await;
}
