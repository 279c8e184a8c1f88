//! DRA mode: the node's ResourceSlices (driver `tee.teeguard.dev`, pool = the node) and the
//! ResourceClaims the kubelet asks the agent to prepare.
//!
//! Slices are written with server-side apply (field manager `teeguard-agent`, forced: the agent is the
//! only writer of its pool), owned by the Node so they go with it, named `<node>-teeguard-<i>`. Slices
//! of the pool beyond the wanted count are deleted. The kubelet deletes a node's slices when it starts
//! and 30 s after a driver's plugin goes away; the slices watch wakes the agent, which applies them
//! again.

use std::sync::Arc;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use teeguard_shared::names::AGENT_FIELD_MANAGER;

use crate::error::{Error, Result};

/// Label on the agent's slices (their node), for `kubectl get resourceslices -l`.
pub const SLICE_NODE_LABEL: &str = "teeguard.dev/node";

/// Apply `specs` as the node's slices (`names[i]` for `specs[i]`) and delete the other slices of the
/// pool in `existing`. Returns how many API writes it made.
pub async fn apply(
    client: &Client,
    node: &Node,
    names: &[String],
    specs: &[ResourceSliceSpec],
    existing: &[Arc<ResourceSlice>],
) -> Result<usize> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let node_name = node.name_any();
    let owner = OwnerReference {
        api_version: "v1".into(),
        kind: "Node".into(),
        name: node_name.clone(),
        uid: node.uid().unwrap_or_default(),
        ..OwnerReference::default()
    };
    let params = PatchParams::apply(AGENT_FIELD_MANAGER).force();
    let mut writes = 0;
    for (name, spec) in names.iter().zip(specs) {
        let slice = ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: Some([(SLICE_NODE_LABEL.to_string(), node_name.clone())].into()),
                owner_references: Some(vec![owner.clone()]),
                ..ObjectMeta::default()
            },
            spec: spec.clone(),
        };
        // k8s-openapi writes apiVersion and kind, as an apply body needs.
        api.patch(name, &params, &Patch::Apply(&slice))
            .await
            .map_err(|e| Error::kube("apply ResourceSlice", e))?;
        writes += 1;
    }
    for old in existing.iter().filter(|s| !names.contains(&s.name_any())) {
        writes += usize::from(delete(&api, old).await?);
    }
    Ok(writes)
}

/// Delete one slice; `false` when it was gone already.
async fn delete(api: &Api<ResourceSlice>, slice: &ResourceSlice) -> Result<bool> {
    match api
        .delete(&slice.name_any(), &DeleteParams::default())
        .await
    {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(false),
        Err(e) => Err(Error::kube("delete ResourceSlice", e)),
    }
}

/// Delete every slice in `existing` (cleanup after an uninstall, or leaving DRA mode).
pub async fn delete_all(client: &Client, existing: &[Arc<ResourceSlice>]) -> Result<usize> {
    let api: Api<ResourceSlice> = Api::all(client.clone());
    let mut deleted = 0;
    for old in existing {
        deleted += usize::from(delete(&api, old).await?);
    }
    Ok(deleted)
}

/// Read a ResourceClaim; `Ok(None)` when it no longer exists.
pub async fn get_claim(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<Option<ResourceClaim>> {
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    api.get_opt(name)
        .await
        .map_err(|e| Error::kube("get ResourceClaim", e))
}
