//! Publishing the node's `TeeCapacity` with server-side apply (field manager `teeguard-agent`).
//!
//! The object (cluster-scoped, named after the node) is applied first with `spec.nodeName` and an owner
//! reference to the Node, so it is garbage-collected with the Node; then `status` is applied on the
//! status subresource. Each apply is tried without `force` first; on a 409 conflict (another field
//! manager owns some of the fields) it is re-applied with `force`, since the agent is the only writer
//! these fields should have. A 404 on the status apply means the object was deleted: it is re-created
//! on the next attempt.

use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client, Resource, ResourceExt};
use serde_json::{Value, json};
use teeguard_shared::crd::{TeeCapacity, TeeCapacityStatus};
use teeguard_shared::names::AGENT_FIELD_MANAGER;

use crate::error::{Error, Result};

/// Applies the node's `TeeCapacity`.
#[derive(Clone)]
pub struct Publisher {
    api: Api<TeeCapacity>,
    node_name: String,
    ensured_for_uid: Option<String>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("node_name", &self.node_name)
            .field("ensured_for_uid", &self.ensured_for_uid)
            .finish()
    }
}

impl Publisher {
    /// A publisher for `node_name`'s report.
    pub fn new(client: Client, node_name: impl Into<String>) -> Self {
        Publisher {
            api: Api::all(client),
            node_name: node_name.into(),
            ensured_for_uid: None,
        }
    }

    /// True once the object has been applied for the current Node.
    pub fn is_ensured(&self) -> bool {
        self.ensured_for_uid.is_some()
    }

    /// Apply the object (spec and owner reference) unless already done for this Node's UID. Returns
    /// the status the object had on the server (to keep condition transition times across restarts).
    pub async fn ensure(&mut self, node: &Node) -> Result<Option<TeeCapacityStatus>> {
        let uid = node.uid().unwrap_or_default();
        if uid.is_empty() {
            return Err(Error::NodeNotFound {
                node: self.node_name.clone(),
            });
        }
        if self.ensured_for_uid.as_deref() == Some(uid.as_str()) {
            return Ok(None);
        }
        let body = json!({
            "apiVersion": TeeCapacity::api_version(&()),
            "kind": TeeCapacity::kind(&()),
            "metadata": {
                "name": self.node_name,
                "ownerReferences": [{
                    "apiVersion": "v1",
                    "kind": "Node",
                    "name": self.node_name,
                    "uid": uid,
                }],
            },
            "spec": {"nodeName": self.node_name},
        });
        let obj = self.apply("apply TeeCapacity", false, body).await?;
        self.ensured_for_uid = Some(uid);
        Ok(obj.status)
    }

    /// Apply `status`. Requires [`Publisher::ensure`] first.
    pub async fn publish(&mut self, status: &TeeCapacityStatus) -> Result<()> {
        let body = json!({
            "apiVersion": TeeCapacity::api_version(&()),
            "kind": TeeCapacity::kind(&()),
            "metadata": {"name": self.node_name},
            "status": status,
        });
        let result = self.apply("apply TeeCapacity status", true, body).await;
        if let Err(e) = &result
            && e.api_code() == Some(404)
        {
            tracing::warn!(node = %self.node_name, "TeeCapacity was deleted; re-creating it");
            self.ensured_for_uid = None;
        }
        result.map(|_| ())
    }

    async fn apply(
        &self,
        operation: &'static str,
        status: bool,
        body: Value,
    ) -> Result<TeeCapacity> {
        let patch = Patch::Apply(body);
        let pp = PatchParams::apply(AGENT_FIELD_MANAGER);
        match self.call(status, &pp, &patch).await {
            Ok(o) => Ok(o),
            Err(kube::Error::Api(s)) if s.code == 409 => {
                tracing::warn!(
                    node = %self.node_name,
                    message = %s.message,
                    "{operation}: conflict with another field manager; re-applying with force"
                );
                self.call(status, &pp.force(), &patch)
                    .await
                    .map_err(|e| Error::kube(operation, e))
            }
            Err(e) => Err(Error::kube(operation, e)),
        }
    }

    async fn call(
        &self,
        status: bool,
        pp: &PatchParams,
        patch: &Patch<Value>,
    ) -> kube::Result<TeeCapacity> {
        if status {
            self.api.patch_status(&self.node_name, pp, patch).await
        } else {
            self.api.patch(&self.node_name, pp, patch).await
        }
    }
}
