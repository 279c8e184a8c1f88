//! The few fields of a KubeVirt `VirtualMachineInstance` (`kubevirt.io/v1`) teeguard needs.
//!
//! KubeVirt's Go types are not pulled in: everything but `metadata`, `spec.domain.launchSecurity`,
//! `spec.nodeSelector`, `spec.affinity`, `status.phase` and `status.conditions` is ignored when a VMI is read, which also keeps a cache of
//! tens of thousands of VMIs small.

use kube::CustomResource;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::tee::TeeKind;

/// `spec` of a VirtualMachineInstance, reduced to what decides its TEE kind.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "kubevirt.io",
    version = "v1",
    kind = "VirtualMachineInstance",
    plural = "virtualmachineinstances",
    shortname = "vmi",
    namespaced,
    schema = "disabled",
    status = "VirtualMachineInstanceStatus",
    derive = "PartialEq",
    derive = "Default"
)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceSpec {
    /// `spec.domain`.
    #[serde(default)]
    pub domain: DomainSpec,
    /// `spec.nodeSelector` (KubeVirt copies it to the launcher pod's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_selector: Option<std::collections::BTreeMap<String, String>>,
    /// `spec.affinity` (KubeVirt copies it to the launcher pod).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub affinity: Option<k8s_openapi::api::core::v1::Affinity>,
}

/// `status`, reduced to the phase and the conditions (virt-controller says there why a VMI has no
/// launcher pod: `Synchronized` `False`, reason `FailedCreate`, with the API server's answer).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VirtualMachineInstanceStatus {
    /// `Pending`, `Scheduling`, `Scheduled`, `Running`, `Succeeded`, `Failed`; absent before
    /// virt-controller first sees the VMI.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<String>,
    /// The VMI's conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<VmiCondition>,
}

/// One of a VMI's `status.conditions`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct VmiCondition {
    /// `Ready`, `Synchronized`, ...
    #[serde(rename = "type")]
    pub type_: String,
    /// `True`, `False` or `Unknown`.
    pub status: String,
    /// The machine-readable reason (`FailedCreate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// The human-readable message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// When the condition last changed (RFC 3339).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<String>,
}

/// `spec.domain`, reduced to `launchSecurity`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DomainSpec {
    /// `spec.domain.launchSecurity`; absent for ordinary VMs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launch_security: Option<LaunchSecurity>,
}

/// `spec.domain.launchSecurity`. An empty object is IBM Secure Execution on s390x, which uses no key.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LaunchSecurity {
    /// AMD SEV (plain, or SEV-ES when `policy.encryptedState` is true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sev: Option<SevLaunchSecurity>,
    /// AMD SEV-SNP.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snp: Option<Marker>,
    /// Intel TDX.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tdx: Option<Marker>,
}

/// `launchSecurity.sev`; attestation, session and dhCert are ignored.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SevLaunchSecurity {
    /// `launchSecurity.sev.policy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<SevPolicy>,
}

/// `launchSecurity.sev.policy`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SevPolicy {
    /// SEV-ES: the guest's register state is encrypted too; charged as `sev_es`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encrypted_state: Option<bool>,
}

/// A present-but-empty marker object such as `tdx: {}`; its fields, if any, are ignored.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Marker {}

impl LaunchSecurity {
    /// The TEE kinds this launchSecurity asks for, in [`TeeKind::ALL`] order (normally zero or one).
    pub fn kinds(&self) -> Vec<TeeKind> {
        let mut kinds = Vec::with_capacity(1);
        if self.tdx.is_some() {
            kinds.push(TeeKind::Tdx);
        }
        if let Some(sev) = &self.sev {
            let encrypted_state = sev
                .policy
                .as_ref()
                .and_then(|p| p.encrypted_state)
                .unwrap_or(false);
            kinds.push(if encrypted_state {
                TeeKind::SevEs
            } else {
                TeeKind::Sev
            });
        }
        if self.snp.is_some() {
            kinds.push(TeeKind::SevEs);
        }
        kinds.sort();
        kinds
    }
}

impl VirtualMachineInstance {
    /// The TEE kind this VMI needs a key of: `None` for an ordinary VM (no `launchSecurity`) and for
    /// s390x Secure Execution (`launchSecurity: {}`); an error when more than one kind is set.
    ///
    /// `tdx` → `tdx`; `snp` → `sev_es`; `sev` with `policy.encryptedState: true` → `sev_es`;
    /// plain `sev` → `sev`.
    pub fn tee_kind(&self) -> Result<Option<TeeKind>> {
        let Some(ls) = &self.spec.domain.launch_security else {
            return Ok(None);
        };
        let kinds = ls.kinds();
        match kinds.as_slice() {
            [] => Ok(None),
            [kind] => Ok(Some(*kind)),
            _ => Err(Error::ConflictingTeeKinds {
                namespace: self.metadata.namespace.clone().unwrap_or_default(),
                name: self.metadata.name.clone().unwrap_or_default(),
                kinds,
            }),
        }
    }

    /// Parse a VMI from JSON, ignoring every field teeguard does not model.
    pub fn from_json(value: serde_json::Value) -> serde_json::Result<Self> {
        serde_json::from_value(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn vmi(launch_security: serde_json::Value) -> VirtualMachineInstance {
        let mut spec =
            json!({"domain": {"devices": {}, "resources": {"requests": {"memory": "1Gi"}}}});
        if !launch_security.is_null() {
            spec["domain"]["launchSecurity"] = launch_security;
        }
        VirtualMachineInstance::from_json(json!({
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstance",
            "metadata": {"name": "vm", "namespace": "ns"},
            "spec": spec,
            "status": {"phase": "Pending"}
        }))
        .expect("parse VMI")
    }

    #[test]
    fn maps_each_launch_security_to_its_kind() {
        let cases = [
            (json!(null), Ok(None)),
            (json!({}), Ok(None)),
            (json!({"tdx": {}}), Ok(Some(TeeKind::Tdx))),
            (json!({"snp": {}}), Ok(Some(TeeKind::SevEs))),
            (json!({"sev": {}}), Ok(Some(TeeKind::Sev))),
            (
                json!({"sev": {"policy": {"encryptedState": false}}}),
                Ok(Some(TeeKind::Sev)),
            ),
            (
                json!({"sev": {"policy": {"encryptedState": true}, "attestation": {}}}),
                Ok(Some(TeeKind::SevEs)),
            ),
            (json!({"tdx": {}, "snp": {}}), Err(())),
            (json!({"sev": {}, "snp": {}}), Err(())),
        ];
        for (ls, want) in cases {
            let got = vmi(ls.clone()).tee_kind().map_err(|_| ());
            assert_eq!(got, want, "launchSecurity {ls}");
        }
    }

    #[test]
    fn two_kinds_error_names_the_vmi() {
        let err = vmi(json!({"tdx": {}, "snp": {}}))
            .tee_kind()
            .expect_err("two kinds");
        let msg = err.to_string();
        assert!(msg.contains("ns/vm"), "{msg}");
        assert!(msg.contains("Tdx") && msg.contains("SevEs"), "{msg}");
    }
}
