//! `teeguard-agent cleanup --node-name N`: after `helm uninstall`, remove from one Node what teeguard's
//! agent added and nothing else: the extended resources listed in its `teeguard.dev/extended-resources`
//! annotation (from `status.capacity` and `status.allocatable`), that annotation, the node's
//! `TeeCapacity` report (if the CRD is still installed) and its heartbeat Lease (in the client's
//! namespace, only if it carries teeguard's label) and, from DRA mode, the node's ResourceSlices of
//! teeguard's driver (`spec.driver=tee.teeguard.dev`). Resources another manager owns (NFD's, or
//! ones the Node had before teeguard) are left alone, exactly as the running agent leaves them: the
//! writes are [`advertise::plan`]'s with advertising switched off. Running it twice changes nothing the
//! second time.
//!
//! Pods already bound keep running (the kubelet does not evict for a resource that disappears); the
//! scheduler just stops counting the keys, as before teeguard.

use std::collections::BTreeMap;

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::ResourceSlice;
use kube::api::{DeleteParams, ListParams};
use kube::{Api, Client, ResourceExt};
use teeguard_shared::TeeCapacity;
use teeguard_shared::config::ResourcesConfig;
use teeguard_shared::names::{AGENT_LEASE_LABEL, DRA_DRIVER};

use super::node;
use crate::decide::advertise::{self, Desired, NodeWrite};
use crate::error::{Error, Result};

/// What [`cleanup`] changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Cleaned {
    /// Extended resources removed from the Node's status.
    pub resources: Vec<String>,
    /// Whether the `teeguard.dev/extended-resources` annotation was removed or rewritten.
    pub annotation: bool,
    /// Whether the node's `TeeCapacity` was deleted.
    pub report: bool,
    /// Whether the node's heartbeat Lease was deleted.
    pub lease: bool,
    /// ResourceSlices of teeguard's DRA driver deleted (DRA mode).
    pub slices: usize,
}

impl std::fmt::Display for Cleaned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.resources.is_empty()
            && !self.annotation
            && !self.report
            && !self.lease
            && self.slices == 0
        {
            return f.write_str("nothing of teeguard's was left on the node");
        }
        let mut parts = Vec::new();
        if !self.resources.is_empty() {
            parts.push(format!(
                "removed the extended resources {}",
                self.resources.join(", ")
            ));
        }
        if self.annotation {
            parts.push("removed the teeguard.dev/extended-resources annotation".into());
        }
        if self.report {
            parts.push("deleted its TeeCapacity".into());
        }
        if self.lease {
            parts.push("deleted its heartbeat Lease".into());
        }
        if self.slices > 0 {
            parts.push(format!("deleted its {} ResourceSlices", self.slices));
        }
        f.write_str(&parts.join("; "))
    }
}

/// Remove what the agent added to `node` (see the module docs).
pub async fn cleanup(client: Client, node: &str, resources: &ResourcesConfig) -> Result<Cleaned> {
    let nodes: Api<Node> = Api::all(client.clone());
    let current = nodes
        .get(node)
        .await
        .map_err(|e| Error::kube("get the Node to clean up", e))?;
    let off = Desired {
        enabled: false,
        values: BTreeMap::new(),
    };
    let plan = advertise::plan(&current, &off, resources);
    let mut cleaned = Cleaned::default();
    for w in &plan.writes {
        match w {
            NodeWrite::Annotation(_) => cleaned.annotation = true,
            NodeWrite::Status(patch) => {
                for op in &patch.0 {
                    if let json_patch::PatchOperation::Remove(r) = op
                        && let Some(name) = r.path.tokens().last()
                    {
                        let name = name.decoded().into_owned();
                        if !cleaned.resources.contains(&name) {
                            cleaned.resources.push(name);
                        }
                    }
                }
            }
        }
    }
    if !plan.writes.is_empty() {
        node::apply(&nodes, node, &plan.writes).await?;
    }
    let reports: Api<TeeCapacity> = Api::all(client.clone());
    match reports.delete(node, &DeleteParams::default()).await {
        Ok(_) => cleaned.report = true,
        // Gone already, or the CRD was removed with everything else.
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => return Err(Error::kube("delete the node's TeeCapacity", e)),
    }
    // DRA mode's slices (an API server without resource.k8s.io/v1 has none).
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let ours =
        ListParams::default().fields(&format!("spec.nodeName={node},spec.driver={DRA_DRIVER}"));
    match slices.list(&ours).await {
        Ok(list) => {
            let existing: Vec<std::sync::Arc<ResourceSlice>> =
                list.items.into_iter().map(std::sync::Arc::new).collect();
            cleaned.slices = super::slices::delete_all(&client, &existing).await?;
        }
        Err(kube::Error::Api(s)) if s.code == 404 => {}
        Err(e) => return Err(Error::kube("list the node's ResourceSlices", e)),
    }
    // The Lease of that name is teeguard's only if it carries teeguard's label.
    let leases: Api<Lease> = Api::default_namespaced(client);
    let lease = leases
        .get_opt(node)
        .await
        .map_err(|e| Error::kube("get the node's heartbeat Lease", e))?;
    if lease.is_some_and(|l| {
        l.labels()
            .get(AGENT_LEASE_LABEL)
            .is_some_and(|v| v == "true")
    }) {
        match leases.delete(node, &DeleteParams::default()).await {
            Ok(_) => cleaned.lease = true,
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(Error::kube("delete the node's heartbeat Lease", e)),
        }
    }
    Ok(cleaned)
}
