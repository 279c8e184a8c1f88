//! Writing the agent's Node: the planned writes (`decide::advertise`) of its extended resources and
//! their ownership annotation, in order.

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use teeguard_shared::names::{AGENT_EXTENDED_RESOURCES_ANNOTATION, AGENT_FIELD_MANAGER};

use crate::decide::advertise::NodeWrite;
use crate::error::{Error, Result};

/// Perform the writes in order. Returns the Node as the API server returned it after the last write
/// (newer than any watch cache), or `None` when there was nothing to do.
pub async fn apply(api: &Api<Node>, node_name: &str, writes: &[NodeWrite]) -> Result<Option<Node>> {
    let pp = PatchParams {
        field_manager: Some(AGENT_FIELD_MANAGER.to_string()),
        ..PatchParams::default()
    };
    let mut last = None;
    for w in writes {
        let node = match w {
            NodeWrite::Annotation(value) => {
                let patch = json!({"metadata": {"annotations": {AGENT_EXTENDED_RESOURCES_ANNOTATION: value}}});
                api.patch(node_name, &pp, &Patch::Merge(&patch))
                    .await
                    .map_err(|e| Error::kube("patch Node annotation", e))?
            }
            NodeWrite::Status(p) => api
                .patch_status(node_name, &pp, &Patch::Json::<()>(p.clone()))
                .await
                .map_err(|e| Error::kube("patch Node status (extended resources)", e))?,
        };
        last = Some(node);
    }
    Ok(last)
}
