//! The agent's heartbeat Lease: a `coordination.k8s.io/v1` Lease named after the node, in the agent's
//! namespace, labelled [`AGENT_LEASE_LABEL`], owned by the Node (deleted with it). While the published
//! report is current, each heartbeat renews the Lease instead of re-writing the report, so the report
//! is written only when something changed. The webhook takes a report's age from the newer of its
//! `heartbeatTime` and its agent's Lease `renewTime`. The kubelet's node heartbeat made the same move
//! (KEP-589, node Leases); on kube-apiserver v1.36 a renewal costs about half a report write
//! (`heartbeat_cost` bench).

use jiff::Timestamp;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use teeguard_shared::names::{AGENT_FIELD_MANAGER, AGENT_LEASE_LABEL};

use crate::error::{Error, Result};

/// Renews the node's heartbeat Lease.
#[derive(Clone)]
pub struct HeartbeatLease {
    api: Api<Lease>,
    namespace: String,
    node: String,
    duration: i32,
    applied: bool,
}

impl std::fmt::Debug for HeartbeatLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeartbeatLease")
            .field("namespace", &self.namespace)
            .field("node", &self.node)
            .field("applied", &self.applied)
            .finish()
    }
}

impl HeartbeatLease {
    /// The Lease of `node` in the client's namespace (in a pod: the agent's own, from its service
    /// account), with `leaseDurationSeconds` `duration` (informational: the webhook's
    /// `staleReportAfter` decides).
    pub fn new(client: Client, node: impl Into<String>, duration: std::time::Duration) -> Self {
        let namespace = client.default_namespace().to_string();
        HeartbeatLease {
            api: Api::namespaced(client, &namespace),
            namespace,
            node: node.into(),
            duration: i32::try_from(duration.as_secs()).unwrap_or(i32::MAX),
            applied: false,
        }
    }

    /// The namespace the Lease lives in.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Set `renewTime` to `now`: a merge patch of that one field, or the whole Lease (server-side
    /// apply) the first time and after it was deleted.
    pub async fn renew(&mut self, node: &Node, now: Timestamp) -> Result<()> {
        if self.applied {
            let pp = PatchParams {
                field_manager: Some(AGENT_FIELD_MANAGER.into()),
                ..PatchParams::default()
            };
            let body = json!({"spec": {"renewTime": MicroTime(now)}});
            match self.api.patch(&self.node, &pp, &Patch::Merge(body)).await {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(s)) if s.code == 404 => {
                    tracing::warn!(namespace = %self.namespace, node = %self.node, "the heartbeat Lease was deleted; re-creating it");
                    self.applied = false;
                }
                Err(e) => return Err(Error::kube("renew the heartbeat Lease", e)),
            }
        }
        let uid = node.uid().unwrap_or_default();
        let body = json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.node,
                "namespace": self.namespace,
                "labels": {AGENT_LEASE_LABEL: "true"},
                "ownerReferences": [{
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": self.node,
                    "uid": uid,
                }],
            },
            "spec": {
                "holderIdentity": self.node,
                "leaseDurationSeconds": self.duration,
                "renewTime": MicroTime(now),
            },
        });
        // Forced: the agent is the Lease's only writer, and its merge-patched renewTime is recorded
        // under another operation than this apply.
        let pp = PatchParams::apply(AGENT_FIELD_MANAGER).force();
        self.api
            .patch(&self.node, &pp, &Patch::Apply(body))
            .await
            .map_err(|e| Error::kube("apply the heartbeat Lease", e))?;
        self.applied = true;
        Ok(())
    }
}
