//! The node report: one cluster-scoped `TeeCapacity` (`teeguard.dev/v1alpha1`) per node, named after the
//! node, written by that node's agent and read by the webhook.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use kube::core::crd::CustomResourceExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::tee::TeeKind;

/// `spec` of a `TeeCapacity`: which node it describes (the object's name is the node's name too).
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "teeguard.dev",
    version = "v1alpha1",
    kind = "TeeCapacity",
    plural = "teecapacities",
    singular = "teecapacity",
    shortname = "teecap",
    category = "teeguard",
    status = "TeeCapacityStatus",
    derive = "PartialEq",
    derive = "Default",
    doc = "TEE key capacity and usage of one node, as its teeguard agent reads them from the kernel.",
    printcolumn = r#"{"name": "TDX-Free", "type": "integer", "jsonPath": ".status.tdx.free", "description": "TDX keys free for new VMs"}"#,
    printcolumn = r#"{"name": "TDX-Cap", "type": "integer", "jsonPath": ".status.tdx.capacity", "description": "TDX keys on the host", "priority": 1}"#,
    printcolumn = r#"{"name": "SEV-Free", "type": "integer", "jsonPath": ".status.sev.free", "description": "SEV ASIDs free for new VMs"}"#,
    printcolumn = r#"{"name": "SEV-ES-Free", "type": "integer", "jsonPath": ".status.sevEs.free", "description": "SEV-ES/SNP ASIDs free for new VMs"}"#,
    printcolumn = r#"{"name": "Accounting", "type": "string", "jsonPath": ".status.accounting", "description": "How the scheduler learns the free keys: extendedResource (advertised on the Node) or dra (devices in ResourceSlices)"}"#,
    printcolumn = r#"{"name": "TDX-Devices", "type": "integer", "jsonPath": ".status.tdx.devices.published", "description": "DRA mode: TDX key devices published in the node's ResourceSlices"}"#,
    printcolumn = r#"{"name": "TDX-Allocated", "type": "integer", "jsonPath": ".status.tdx.devices.allocated", "description": "DRA mode: TDX key devices the kubelet had the agent prepare for pods", "priority": 1}"#,
    printcolumn = r#"{"name": "External", "type": "integer", "jsonPath": ".status.tdx.external", "description": "TDX keys held outside Kubernetes pods that request them", "priority": 1}"#,
    printcolumn = r#"{"name": "Published", "type": "date", "jsonPath": ".status.heartbeatTime", "description": "When the agent last wrote this status (between changes it renews its heartbeat Lease instead)"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct TeeCapacitySpec {
    /// The node this report describes.
    pub node_name: String,
}

/// What the agent observed on its node.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TeeCapacityStatus {
    /// Intel TDX keys (HKIDs); absent when the host has no TDX capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tdx: Option<KindStatus>,
    /// AMD SEV ASIDs; absent when the host has no SEV capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sev: Option<KindStatus>,
    /// AMD SEV-ES/SEV-SNP ASIDs; absent when the host has no SEV-ES capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sev_es: Option<KindStatus>,
    /// When the agent last published this status. Between changes the agent renews its heartbeat
    /// Lease (named after the node, in teeguard's namespace) instead of re-writing the status; a report
    /// whose newer of the two is older than the webhook's `admission.staleReportAfter` counts as
    /// unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_time: Option<Time>,
    /// How the scheduler learns this node's free keys: `extendedResource` (the agent advertises them on
    /// the Node) or `dra` (the agent publishes one device per usable key in a ResourceSlice).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accounting: Option<String>,
    /// Version of the agent that wrote the report.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_version: Option<String>,
    /// UIDs of the pods whose keys this report counts (as `pending` or as held), newest first, at most
    /// 64 (`MAX_COUNTED_PODS`). The webhook ends its hold for a pod as soon as a report lists it, so an
    /// admitted key is never counted twice.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("maxItems" = MAX_COUNTED_PODS))]
    pub counted_pods: Vec<String>,
    /// `KernelReadable`, `TeeHardware`, `PerPodAccounting`, `Advertising`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// The most pod UIDs a report lists in `countedPods` (about 2.5 KB): on a host with more TEE pods only
/// the newest are listed, and a hold of a pod left out ends by `admission.ledgerTtl` (a node looks
/// fuller than it is, never emptier).
pub const MAX_COUNTED_PODS: usize = 64;

/// Capacity and usage of one kind of TEE key on one node. Counts are declared `int64` in the schema
/// (`format: uint64`, schemars' default for `u64`, is not an OpenAPI format the API server knows and
/// draws a warning on every install); `minimum: 0` still rules out negatives.
///
/// `free = capacity − kernelUsed − pending` (never below zero); `external = kernelUsed − podsUsed`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KindStatus {
    /// The extended resource pods request for this kind (`tdx.intel.com/keys`).
    pub resource_name: String,
    /// Keys the kernel can hand out (`misc.capacity`).
    #[schemars(extend("format" = "int64"))]
    pub capacity: u64,
    /// Keys the kernel has handed out (`misc.current` at the root).
    #[schemars(extend("format" = "int64"))]
    pub kernel_used: u64,
    /// Keys held by pods that request the resource (KubeVirt VMs, Kata pods).
    #[schemars(extend("format" = "int64"))]
    pub pods_used: u64,
    /// Keys held by anything that does not request the resource: other runtimes, VMs outside Kubernetes.
    #[schemars(extend("format" = "int64"))]
    pub external: u64,
    /// Keys requested by pods bound to the node that the kernel does not show yet.
    #[schemars(extend("format" = "int64"))]
    pub pending: u64,
    /// Keys a new VM can still get.
    #[schemars(extend("format" = "int64"))]
    pub free: u64,
    /// What the agent advertises as the node's capacity of the extended resource
    /// (`capacity − external`); absent when it does not advertise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "int64"))]
    pub advertised: Option<u64>,
    /// DRA mode only: the node's devices of this kind (one per key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<DeviceCounts>,
    /// Charges of this kind the kernel refused, where its `misc.events` files counted them; absent
    /// when none was counted. A charge refused at the root cgroup itself (the node full while keys are
    /// held outside kubepods) is counted in no file, on any kernel.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<RefusedCharges>,
}

/// Failed charges of one kind, as the kernel counted them in `misc.events` (since each cgroup was
/// created). The kernel counts a refusal in the cgroup whose `misc.max` or the capacity stopped it and
/// in every ancestor, so each refusal is in exactly one of these figures.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RefusedCharges {
    /// In the cgroups of the node's pods: a VM asked for more than its pod's `misc.max` (teeguard's
    /// limit at work), or one pod held the whole capacity.
    #[schemars(extend("format" = "int64"))]
    pub pods: u64,
    /// In kubepods but in no pod cgroup present now: the capacity was reached by the pods together
    /// (the node was full of pods), or the pod that counted it has ended since.
    #[schemars(extend("format" = "int64"))]
    pub kubepods: u64,
    /// In cgroups outside kubepods: VMs and runtimes outside Kubernetes.
    #[schemars(extend("format" = "int64"))]
    pub outside: u64,
}

/// The DRA view of one kind on one node (DRA mode).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeviceCounts {
    /// Devices in the node's ResourceSlices: the keys Kubernetes pods can be allocated.
    #[schemars(extend("format" = "int64"))]
    pub published: u64,
    /// Devices the kubelet had the agent prepare for pods on this node (their claims' allocations).
    #[schemars(extend("format" = "int64"))]
    pub allocated: u64,
    /// Keys held by something no DRA claim accounts for (VMs outside Kubernetes, other runtimes, pods
    /// started before the switch to DRA): not published, so the scheduler never hands them out.
    #[schemars(extend("format" = "int64"))]
    pub withheld: u64,
}

impl TeeCapacityStatus {
    /// The figures for one kind, if the host has it.
    pub fn kind(&self, kind: TeeKind) -> Option<&KindStatus> {
        match kind {
            TeeKind::Tdx => self.tdx.as_ref(),
            TeeKind::Sev => self.sev.as_ref(),
            TeeKind::SevEs => self.sev_es.as_ref(),
        }
    }

    /// Mutable slot for one kind.
    pub fn kind_mut(&mut self, kind: TeeKind) -> &mut Option<KindStatus> {
        match kind {
            TeeKind::Tdx => &mut self.tdx,
            TeeKind::Sev => &mut self.sev,
            TeeKind::SevEs => &mut self.sev_es,
        }
    }

    /// The kinds present, in [`TeeKind::ALL`] order.
    pub fn kinds(&self) -> impl Iterator<Item = (TeeKind, &KindStatus)> {
        TeeKind::ALL
            .into_iter()
            .filter_map(|k| self.kind(k).map(|s| (k, s)))
    }

    /// The condition of the given type, if present.
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.type_ == type_)
    }
}

/// The `CustomResourceDefinition` for `TeeCapacity` as YAML, exactly as committed under
/// `charts/teeguard/crds/`.
pub fn crd_yaml() -> Result<String> {
    let crd = TeeCapacity::crd();
    let body = serde_yaml::to_string(&crd).map_err(|e| Error::Serialize {
        what: "the TeeCapacity CustomResourceDefinition",
        reason: e.to_string(),
    })?;
    Ok(format!(
        "# Generated from the Rust type teeguard_shared::crd::TeeCapacity. Do not edit by hand:\n\
         # run `TEEGUARD_REGENERATE=1 cargo test -p teeguard-shared --test crd_drift` to update.\n{body}"
    ))
}

/// Path of the generated CRD inside the repository.
pub const CRD_CHART_PATH: &str = "charts/teeguard/crds/teecapacities.teeguard.dev.yaml";
