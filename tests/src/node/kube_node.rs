//! The node's Node object and pods, through the API: waiting for the kubelet's registration and
//! lifting its not-ready taint (no node-lifecycle controller runs in the test control plane), and
//! removing the pods a previous test left on the node.

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, ListParams};
use kube::{Api, Client};
use serde_json::json;

use super::{KIT, READY_DEADLINE, RealNode};
use crate::error::{self, Error, Result};
use crate::patch::MergePatch;

/// The taint the API server gives every new Node (`TaintNodesByCondition`).
const NOT_READY: &str = "node.kubernetes.io/not-ready";

fn api_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    error::failed(format!("real node: {}", what.into()))
}

fn not_ready(node: &RealNode, what: String) -> Error {
    Error::NotReady {
        component: KIT.name,
        what,
        logs: node.dir.join("log"),
    }
}

/// Wait until the Node exists and is Ready, then lift the not-ready taint.
pub(super) async fn wait_registered(node: &RealNode, client: &Client) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let deadline = Instant::now() + READY_DEADLINE;
    let found = loop {
        let got = nodes
            .get_opt(&node.name)
            .await
            .map_err(api_err(format!("get Node {}", node.name)))?;
        let ready = got.as_ref().is_some_and(|n| {
            n.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
        });
        if ready && let Some(n) = got {
            break n;
        }
        if Instant::now() >= deadline {
            return Err(not_ready(
                node,
                format!(
                    "the kubelet did not register a Ready Node {} within {READY_DEADLINE:?} (found: {})",
                    node.name,
                    got.is_some()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let taints = found
        .spec
        .and_then(|s| s.taints)
        .unwrap_or_default()
        .into_iter()
        .filter(|t| t.key != NOT_READY)
        .collect::<Vec<_>>();
    nodes
        .merge_patch(&node.name, json!({"spec": {"taints": taints}}))
        .await
        .map_err(api_err(format!(
            "lift the not-ready taint of Node {}",
            node.name
        )))?;
    Ok(())
}

/// How long a pod may stay Terminating with no container left before it is force-deleted.
const FORCE_AFTER: Duration = Duration::from_secs(10);

/// Delete every pod bound to the node (grace 1 s) and wait until the API and the runtime have none
/// running.
pub(super) async fn delete_pods(node: &RealNode, client: &Client) -> Result<()> {
    let pods: Api<Pod> = Api::all(client.clone());
    let on_node = ListParams::default().fields(&format!("spec.nodeName={}", node.name));
    let started = Instant::now();
    let deadline = started + READY_DEADLINE;
    loop {
        let list = pods
            .list(&on_node)
            .await
            .map_err(api_err(format!("list the pods of {}", node.name)))?;
        for p in list
            .items
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
        {
            let ns = p.metadata.namespace.clone().unwrap_or_default();
            let name = p.metadata.name.clone().unwrap_or_default();
            let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
            match api
                .delete(&name, &DeleteParams::default().grace_period(1))
                .await
            {
                Ok(_) | Err(kube::Error::Api(_)) => {}
                Err(e) => return Err(api_err(format!("delete pod {ns}/{name}"))(e)),
            }
        }
        let running = node.crictl(&["ps", "-q"]).unwrap_or_default();
        if list.items.is_empty() && running.trim().is_empty() {
            return Ok(());
        }
        // A pod whose containers are gone but whose DRA claim the kubelet cannot unprepare (the test
        // that ran the driver ended) stays Terminating: after a while, remove it from the API.
        if running.trim().is_empty() && started.elapsed() >= FORCE_AFTER {
            for p in &list.items {
                let ns = p.metadata.namespace.clone().unwrap_or_default();
                let name = p.metadata.name.clone().unwrap_or_default();
                let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
                let _ = api
                    .delete(&name, &DeleteParams::default().grace_period(0))
                    .await;
            }
        }
        if Instant::now() >= deadline {
            return Err(not_ready(
                node,
                format!(
                    "pods left on {} by a previous test are not gone: {} in the API, containers running: {}",
                    node.name,
                    list.items.len(),
                    running.split_whitespace().count()
                ),
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
