//! The pure mutation decision: which pods get a TEE key request and misc.max annotations, and the
//! JSON Patch that adds them. No I/O: the caller looks the VMI and namespace up and passes them in.
//!
//! The handler calls [`classify_pod`] first to learn whether (and which) VMI to look up, then
//! [`decide_mutation`] with the lookup result. `decide_mutation` re-applies the pod rules itself,
//! so it is correct on its own for any input. [`patch`] builds the JSON Patch and the annotation values.
//!
//! Pods of a TEE RuntimeClass (`admission.teeRuntimeClasses`, Kata's) are not KubeVirt pods:
//! [`runtime_class::decide_runtime_class`] decides them (a container key request, or a warning when the
//! RuntimeClass overhead already carries the key).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use json_patch::Patch;
use k8s_openapi::api::core::v1::Pod;
use teeguard_shared::names;
use teeguard_shared::{Config, TeeKind, VirtualMachineInstance};

pub mod patch;
pub mod runtime_class;
#[cfg(test)]
mod tests;

use patch::injection_patch;
pub use patch::{crio_unified_value, misc_max_value, wanted_annotations};

/// The VMI a virt-launcher pod belongs to (its controller owner).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct VmiRef {
    /// Namespace (the pod's).
    pub namespace: String,
    /// VMI name.
    pub name: String,
    /// VMI UID from the owner reference; empty if the reference carries none.
    pub uid: String,
}

impl fmt::Display for VmiRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What looking the VMI up gave.
#[derive(Clone, Debug)]
pub enum VmiLookup {
    /// Found (in the cache or by a GET).
    Found(Arc<VirtualMachineInstance>),
    /// Not in the cache and the API server says 404.
    NotFound,
    /// The API server could not be asked (the message says why).
    Failed(String),
}

/// Why a pod is left untouched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SkipReason {
    /// The pod carries `teeguard.dev/exempt: "true"`.
    ExemptPod,
    /// The pod has no `kubevirt.io` label: not a KubeVirt pod.
    NotKubeVirt,
    /// A KubeVirt pod of another role (the `kubevirt.io` label value).
    NotVirtLauncher(String),
    /// A hotplug volume pod (`kubevirt.io: hotplug-disk`).
    Hotplug,
    /// A VM export pod (`kubevirt.io: virt-exporter`).
    Export,
    /// The temporary storage-binding pod (`kubevirt.io/ephemeral-provisioning: "true"`).
    StorageBinding,
    /// No controller owner reference to a `kubevirt.io` VirtualMachineInstance.
    NoVmiOwner,
    /// The namespace carries `teeguard.dev/exempt: "true"`.
    ExemptNamespace,
    /// The VMI carries `teeguard.dev/exempt: "true"`.
    ExemptVmi,
    /// The VMI has no `launchSecurity`: an ordinary VM.
    NotTee,
    /// `launchSecurity` names no TEE teeguard manages (`{}` is s390x Secure Execution).
    UnmanagedLaunchSecurity,
}

impl SkipReason {
    /// Short machine-readable code, used in audit annotations.
    pub fn code(&self) -> &'static str {
        match self {
            SkipReason::ExemptPod => "exempt-pod",
            SkipReason::NotKubeVirt => "not-kubevirt",
            SkipReason::NotVirtLauncher(_) => "not-virt-launcher",
            SkipReason::Hotplug => "hotplug-pod",
            SkipReason::Export => "export-pod",
            SkipReason::StorageBinding => "storage-binding-pod",
            SkipReason::NoVmiOwner => "no-vmi-owner",
            SkipReason::ExemptNamespace => "exempt-namespace",
            SkipReason::ExemptVmi => "exempt-vmi",
            SkipReason::NotTee => "not-tee",
            SkipReason::UnmanagedLaunchSecurity => "unmanaged-launch-security",
        }
    }
}

/// Why a pod is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenyReason {
    /// The VMI is neither cached nor known to the API server (yet).
    VmiNotFound,
    /// The API server could not be asked for the VMI.
    VmiLookupFailed,
    /// The pod's namespace is not cached and the API server could not be asked for it.
    NamespaceLookupFailed,
    /// The VMI sets more than one TEE kind.
    ConflictingTeeKinds,
    /// The pod has no `compute` container to charge the key to.
    NoComputeContainer,
    /// The `compute` container already asks for a different amount of the resource.
    ConflictingRequest,
    /// The `compute` container's amount of the resource is not a whole number.
    BadQuantity,
}

impl DenyReason {
    /// Short machine-readable code, used in audit annotations.
    pub fn code(self) -> &'static str {
        match self {
            DenyReason::VmiNotFound => "vmi-not-found",
            DenyReason::VmiLookupFailed => "vmi-lookup-failed",
            DenyReason::NamespaceLookupFailed => "namespace-lookup-failed",
            DenyReason::ConflictingTeeKinds => "conflicting-tee-kinds",
            DenyReason::NoComputeContainer => "no-compute-container",
            DenyReason::ConflictingRequest => "conflicting-request",
            DenyReason::BadQuantity => "bad-quantity",
        }
    }

    /// Whether retrying the same request later can succeed (KubeVirt retries pod creation).
    pub fn retryable(self) -> bool {
        matches!(
            self,
            DenyReason::VmiNotFound
                | DenyReason::VmiLookupFailed
                | DenyReason::NamespaceLookupFailed
        )
    }
}

/// A refusal: the reason and the message the client sees.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denial {
    /// Why.
    pub reason: DenyReason,
    /// Message for the client (names the pod/VMI and what to do).
    pub message: String,
}

/// A TEE virt-launcher pod: the key request and annotations it must carry, and the patch adding
/// whatever is missing (empty when the pod already has everything, e.g. on reinvocation).
#[derive(Clone, Debug, PartialEq)]
pub struct Injection {
    /// The owning VMI.
    pub vmi: VmiRef,
    /// Its TEE kind.
    pub kind: TeeKind,
    /// The extended resource requested.
    pub resource: String,
    /// Keys requested.
    pub keys: u32,
    /// The RFC 6902 patch; empty when nothing is missing.
    pub patch: Patch,
}

/// The outcome of [`decide_mutation`].
#[derive(Clone, Debug, PartialEq)]
pub enum MutationDecision {
    /// Allowed untouched.
    Skip(SkipReason),
    /// Allowed, with the patch (possibly empty).
    Inject(Injection),
    /// Refused.
    Deny(Denial),
}

/// Whether `labels` (a pod's, a VMI's or a namespace's) carry `teeguard.dev/exempt: "true"`.
pub fn is_exempt(labels: Option<&BTreeMap<String, String>>) -> bool {
    labels
        .and_then(|l| l.get(names::EXEMPT_LABEL))
        .is_some_and(|v| v == "true")
}

/// The pod-only rules: the VMI to look up for a virt-launcher pod, or why the pod is skipped
/// without looking anything up.
pub fn classify_pod(pod: &Pod) -> Result<VmiRef, SkipReason> {
    let meta = &pod.metadata;
    let labels = meta.labels.as_ref();
    if is_exempt(labels) {
        return Err(SkipReason::ExemptPod);
    }
    match labels
        .and_then(|l| l.get(names::KUBEVIRT_LABEL))
        .map(String::as_str)
    {
        None => return Err(SkipReason::NotKubeVirt),
        Some(names::VIRT_LAUNCHER) => {}
        Some(names::HOTPLUG_DISK) => return Err(SkipReason::Hotplug),
        Some(names::VIRT_EXPORTER) => return Err(SkipReason::Export),
        Some(other) => return Err(SkipReason::NotVirtLauncher(other.to_string())),
    }
    if meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(names::EPHEMERAL_PROVISIONING_ANNOTATION))
        .is_some_and(|v| v == "true")
    {
        return Err(SkipReason::StorageBinding);
    }
    let owner = meta
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true))
        .filter(|o| {
            o.kind == "VirtualMachineInstance"
                && o.api_version.split('/').next() == Some("kubevirt.io")
                && !o.name.is_empty()
        })
        .ok_or(SkipReason::NoVmiOwner)?;
    Ok(VmiRef {
        namespace: meta.namespace.clone().unwrap_or_default(),
        name: owner.name.clone(),
        uid: owner.uid.clone(),
    })
}

/// Decide what to do with a pod CREATE.
///
/// `vmi` is the lookup of the VMI [`classify_pod`] named (`None` if it was not looked up, which is
/// only correct when the pod is skipped before the VMI matters). `namespace_labels` are the labels
/// of the pod's namespace, if known.
pub fn decide_mutation(
    pod: &Pod,
    vmi: Option<&VmiLookup>,
    namespace_labels: Option<&BTreeMap<String, String>>,
    config: &Config,
) -> MutationDecision {
    let vmi_ref = match classify_pod(pod) {
        Ok(r) => r,
        Err(skip) => return MutationDecision::Skip(skip),
    };
    if is_exempt(namespace_labels) {
        return MutationDecision::Skip(SkipReason::ExemptNamespace);
    }
    let vmi = match vmi {
        Some(VmiLookup::Found(v)) => {
            let uid = v.metadata.uid.as_deref().unwrap_or("");
            if !vmi_ref.uid.is_empty() && !uid.is_empty() && uid != vmi_ref.uid {
                return deny(
                    DenyReason::VmiNotFound,
                    format!(
                        "VirtualMachineInstance {vmi_ref} has UID {uid}, but the pod belongs to UID {}; \
                         KubeVirt will retry creating the pod",
                        vmi_ref.uid
                    ),
                );
            }
            v
        }
        Some(VmiLookup::NotFound) => {
            return deny(
                DenyReason::VmiNotFound,
                format!(
                    "VirtualMachineInstance {vmi_ref} not found yet; KubeVirt will retry creating the pod"
                ),
            );
        }
        Some(VmiLookup::Failed(why)) => {
            return deny(
                DenyReason::VmiLookupFailed,
                format!(
                    "cannot look up VirtualMachineInstance {vmi_ref} to decide its TEE key request ({why}); \
                     KubeVirt will retry creating the pod"
                ),
            );
        }
        None => {
            return deny(
                DenyReason::VmiLookupFailed,
                format!(
                    "VirtualMachineInstance {vmi_ref} was not looked up; KubeVirt will retry creating the pod"
                ),
            );
        }
    };
    if is_exempt(vmi.metadata.labels.as_ref()) {
        return MutationDecision::Skip(SkipReason::ExemptVmi);
    }
    let kind = match vmi.tee_kind() {
        Ok(Some(kind)) => kind,
        Ok(None) => {
            return MutationDecision::Skip(if vmi.spec.domain.launch_security.is_some() {
                SkipReason::UnmanagedLaunchSecurity
            } else {
                SkipReason::NotTee
            });
        }
        Err(e) => return deny(DenyReason::ConflictingTeeKinds, e.to_string()),
    };
    let kind_cfg = config.resources.get(kind);
    match injection_patch(
        pod,
        &vmi_ref,
        kind,
        &kind_cfg.resource_name,
        kind_cfg.keys_per_vm,
        config,
    ) {
        Ok(patch) => MutationDecision::Inject(Injection {
            vmi: vmi_ref,
            kind,
            resource: kind_cfg.resource_name.clone(),
            keys: kind_cfg.keys_per_vm,
            patch,
        }),
        Err(denial) => MutationDecision::Deny(denial),
    }
}

fn deny(reason: DenyReason, message: String) -> MutationDecision {
    MutationDecision::Deny(Denial { reason, message })
}
