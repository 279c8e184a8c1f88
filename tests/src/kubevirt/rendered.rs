//! What KubeVirt v1.9.0 itself produced, committed under `tests/fixtures/kubevirt-v1.9.0/`: for each
//! TEE kind, the VMI as virt-api stores it (`kvtool default-vmi`) and the virt-launcher pod
//! virt-controller renders for it, as teeguard's mutating webhook receives it (no name yet, no status).
//! `tests/tests/kubevirt_fixtures.rs` renders them again with the real controller and fails when they
//! drift; `scripts/kubevirt-fixtures.sh` rewrites them.
//!
//! The objects are made deterministic: the VMI's UID (in the pod's labels, owner reference and
//! arguments) is [`crate::fixtures::Vmi`]'s UID for the same namespace and name, so they combine with
//! the test kit's other fixtures.

use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

use crate::fixtures::Tee;

/// The directory under `tests/fixtures/`.
pub const DIR: &str = "kubevirt-v1.9.0";

/// The kinds rendered: KubeVirt's sample VMIs (`../shared/kubevirt/vmis/`).
pub const KINDS: [Tee; 5] = [Tee::Tdx, Tee::Snp, Tee::SevEs, Tee::Sev, Tee::None];

/// The name of the VMI of kind `tee` the files hold (`tdx-vm`), in [`crate::fixtures::DEFAULT_NAMESPACE`].
pub fn vmi_name(tee: Tee) -> String {
    format!("{}-vm", tee.slug())
}

/// The committed launcher pod of kind `tee` (one of [`KINDS`]) as JSON.
pub fn launcher_pod_value(tee: Tee) -> Value {
    let text = match tee {
        Tee::Tdx => include_str!("../../fixtures/kubevirt-v1.9.0/tdx-pod.json"),
        Tee::Snp => include_str!("../../fixtures/kubevirt-v1.9.0/snp-pod.json"),
        Tee::SevEs => include_str!("../../fixtures/kubevirt-v1.9.0/sev-es-pod.json"),
        Tee::Sev => include_str!("../../fixtures/kubevirt-v1.9.0/sev-pod.json"),
        _ => include_str!("../../fixtures/kubevirt-v1.9.0/plain-pod.json"),
    };
    serde_json::from_str(text).unwrap_or(Value::Null)
}

/// The committed launcher pod of kind `tee`.
pub fn launcher_pod(tee: Tee) -> Pod {
    serde_json::from_value(launcher_pod_value(tee)).unwrap_or_default()
}

/// The committed VMI of kind `tee` (as virt-api stores it) as JSON.
pub fn vmi_value(tee: Tee) -> Value {
    let text = match tee {
        Tee::Tdx => include_str!("../../fixtures/kubevirt-v1.9.0/tdx-vmi.json"),
        Tee::Snp => include_str!("../../fixtures/kubevirt-v1.9.0/snp-vmi.json"),
        Tee::SevEs => include_str!("../../fixtures/kubevirt-v1.9.0/sev-es-vmi.json"),
        Tee::Sev => include_str!("../../fixtures/kubevirt-v1.9.0/sev-vmi.json"),
        _ => include_str!("../../fixtures/kubevirt-v1.9.0/plain-vmi.json"),
    };
    serde_json::from_str(text).unwrap_or(Value::Null)
}

/// What the API server adds to an object, and the real UID of its VMI replaced by `fixture_uid`:
/// the object as a webhook receives it on CREATE, the same at every rendering.
pub fn normalise(mut object: Value, real_uid: &str, fixture_uid: &str) -> Value {
    if let Some(meta) = object.get_mut("metadata").and_then(Value::as_object_mut) {
        for field in [
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "managedFields",
            "generation",
        ] {
            meta.remove(field);
        }
        if meta.contains_key("generateName") {
            meta.remove("name");
        }
    }
    if let Some(o) = object.as_object_mut() {
        o.remove("status");
    }
    if let Some(spec) = object.get_mut("spec").and_then(Value::as_object_mut) {
        spec.remove("nodeName");
    }
    if let Some(uuid) = object.pointer_mut("/spec/domain/firmware/uuid") {
        *uuid = Value::String(fixture_uid.to_string());
    }
    for c in object
        .pointer_mut("/spec/containers")
        .and_then(Value::as_array_mut)
        .into_iter()
        .flatten()
    {
        let Some(command) = c.get_mut("command").and_then(Value::as_array_mut) else {
            continue;
        };
        if let Some(at) = command.iter().position(|a| a == "--qemu-timeout")
            && let Some(v) = command.get_mut(at + 1)
        {
            *v = Value::String("240s".into());
        }
    }
    let text = serde_json::to_string(&object)
        .unwrap_or_default()
        .replace(real_uid, fixture_uid);
    crate::fixtures::canonical(serde_json::from_str(&text).unwrap_or(Value::Null))
}
