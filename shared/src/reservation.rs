//! The table of holds: one cluster-scoped `TeeReservation` (`teeguard.dev/v1alpha1`) per node, named
//! after the node and owned by it (garbage-collected with the Node), listing the keys the webhook holds
//! on the node that its `TeeCapacity` report does not count yet: for a virt-launcher pod admitted at
//! its CREATE (`Admitted`), for a waiting VMI a freed key was promised to (`Promised`, no pod yet),
//! for a pod the scheduler bound (`Bound`).
//!
//! Every webhook replica reads it from its watch cache and writes it with a `resourceVersion`
//! precondition, so two replicas racing for a node's last key serialize in etcd: one write wins, the
//! other gets 409 Conflict, reads again and decides again. How a hold ends is the webhook's
//! (`teeguard_webhook::decide::holds`); ended entries are trimmed at the next write.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::CustomResource;
use kube::core::crd::CustomResourceExt;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::tee::TeeKind;

/// `spec` of a `TeeReservation`.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "teeguard.dev",
    version = "v1alpha1",
    kind = "TeeReservation",
    plural = "teereservations",
    singular = "teereservation",
    shortname = "teeres",
    category = "teeguard",
    derive = "PartialEq",
    derive = "Default",
    doc = "TEE keys the teeguard webhook holds on one node (for pods admitted or bound, and VMIs a freed key was promised to) that the node's TeeCapacity report does not count yet; shared by every webhook replica.",
    printcolumn = r#"{"name": "Pods", "type": "string", "jsonPath": ".spec.reservations[*].pod", "description": "Pods holding a key"}"#,
    printcolumn = r#"{"name": "VMIs", "type": "string", "jsonPath": ".spec.reservations[*].vmi", "description": "VMIs holding a key"}"#,
    printcolumn = r#"{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct TeeReservationSpec {
    /// The node (the object's name is the node's name too).
    pub node_name: String,
    /// Keys held on the node that its report does not count yet, oldest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reservations: Vec<KeyReservation>,
}

/// Why a key is held.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum HoldReason {
    /// A virt-launcher pod admitted at its CREATE, not bound yet.
    Admitted,
    /// A key freed for a waiting VMI, whose pod does not exist yet (teeguard retried the VMI).
    Promised,
    /// A pod bound to the node (the scheduler's binding, or a pod created with `spec.nodeName`).
    Bound,
}

impl HoldReason {
    /// `Admitted`, `Promised`, `Bound`.
    pub fn as_str(self) -> &'static str {
        match self {
            HoldReason::Admitted => "Admitted",
            HoldReason::Promised => "Promised",
            HoldReason::Bound => "Bound",
        }
    }
}

/// One hold: keys held on the node for a pod, or for a VMI whose pod does not exist yet.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct KeyReservation {
    /// The pod's UID; empty for a key promised to a VMI whose pod does not exist yet. Always written
    /// (older webhooks require it).
    #[serde(default)]
    pub pod_uid: String,
    /// The pod's `namespace/name`, for people; empty for a promise.
    #[serde(default)]
    pub pod: String,
    /// The VMI's UID (a virt-launcher pod's, or the VMI a key is promised to); empty for other pods.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub vmi_uid: String,
    /// The VMI's `namespace/name`, for people.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub vmi: String,
    /// Why the key is held; absent in entries of older webhooks, which held keys from the binding on
    /// (`Bound`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<HoldReason>,
    /// Intel TDX keys.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "int64"))]
    pub tdx: Option<u64>,
    /// AMD SEV ASIDs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "int64"))]
    pub sev: Option<u64>,
    /// AMD SEV-ES/SEV-SNP ASIDs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("format" = "int64"))]
    pub sev_es: Option<u64>,
    /// When the webhook wrote it (wall clock of that replica, for people: each replica counts the TTL
    /// from when it first saw the entry, so clock skew between replicas does not matter).
    pub admitted_at: Time,
    /// The webhook replica that admitted it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub replica: String,
}

impl KeyReservation {
    /// Why the key is held (`Bound` for an older webhook's entry).
    pub fn reason(&self) -> HoldReason {
        self.reason.unwrap_or(HoldReason::Bound)
    }

    /// Keys per kind (kinds with none absent).
    pub fn keys(&self) -> BTreeMap<TeeKind, u64> {
        [
            (TeeKind::Tdx, self.tdx),
            (TeeKind::Sev, self.sev),
            (TeeKind::SevEs, self.sev_es),
        ]
        .into_iter()
        .filter_map(|(k, n)| n.filter(|n| *n > 0).map(|n| (k, n)))
        .collect()
    }

    /// Set the keys from per-kind counts.
    pub fn set_keys(&mut self, keys: &BTreeMap<TeeKind, u64>) {
        self.tdx = keys.get(&TeeKind::Tdx).copied();
        self.sev = keys.get(&TeeKind::Sev).copied();
        self.sev_es = keys.get(&TeeKind::SevEs).copied();
    }
}

/// The `CustomResourceDefinition` for `TeeReservation` as YAML, exactly as committed under
/// `charts/teeguard/crds/`.
pub fn reservation_crd_yaml() -> Result<String> {
    let crd = TeeReservation::crd();
    let body = serde_yaml::to_string(&crd).map_err(|e| Error::Serialize {
        what: "the TeeReservation CustomResourceDefinition",
        reason: e.to_string(),
    })?;
    Ok(format!(
        "# Generated from the Rust type teeguard_shared::reservation::TeeReservation. Do not edit by hand:\n\
         # run `TEEGUARD_REGENERATE=1 cargo test -p teeguard-shared --test crd_drift` to update.\n{body}"
    ))
}

/// Path of the generated CRD inside the repository.
pub const RESERVATION_CRD_CHART_PATH: &str =
    "charts/teeguard/crds/teereservations.teeguard.dev.yaml";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_zero_counts_are_absent() {
        let mut r = KeyReservation {
            pod_uid: "u".into(),
            pod: "ns/p".into(),
            vmi_uid: String::new(),
            vmi: String::new(),
            reason: None,
            tdx: None,
            sev: None,
            sev_es: None,
            admitted_at: Time(jiff::Timestamp::UNIX_EPOCH),
            replica: String::new(),
        };
        r.set_keys(&BTreeMap::from([(TeeKind::SevEs, 1)]));
        assert_eq!(r.sev_es, Some(1));
        assert_eq!(r.keys(), BTreeMap::from([(TeeKind::SevEs, 1)]));
        r.tdx = Some(0);
        assert_eq!(r.keys().len(), 1);
    }
}
