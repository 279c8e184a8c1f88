//! Pods of a TEE RuntimeClass (`admission.teeRuntimeClasses`: Kata's `kata-qemu-tdx`, ...): teeguard
//! adds the kind's key as a request (and limit) of the pod's first container.
//!
//! Kata pods used to ask for their key only through the RuntimeClass's `overhead.podFixed`. A key in the
//! pod overhead is counted on nodes that advertise the extended resource, but not served on nodes where
//! the scheduler allocates keys through DRA (a DeviceClass with `extendedResourceName`): such a pod never
//! schedules there. A container request is served on both. A pod that already asks for a key anywhere
//! (a container or init container request or limit, or the overhead) gets nothing added; one whose
//! overhead carries a key (its RuntimeClass was not updated) gets a warning saying what to change, since
//! adding a container request too would count two keys on extended-resource nodes.
//!
//! Virt-launcher pods (any pod with a `kubevirt.io` label) never take this path: [`super::decide_mutation`]
//! decides them.

use std::collections::BTreeMap;

use json_patch::Patch;
use k8s_openapi::api::core::v1::{Container, Pod};
use teeguard_shared::names;
use teeguard_shared::{Config, TeeKind};

use super::is_exempt;
use super::patch::request_ops;

/// Why a pod of (or claiming) a TEE RuntimeClass is left untouched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RuntimeClassSkip {
    /// The pod carries `teeguard.dev/exempt: "true"`.
    ExemptPod,
    /// A KubeVirt pod (`kubevirt.io` label): the virt-launcher rules decide it.
    KubeVirtPod,
    /// No `spec.runtimeClassName`, or one not in `admission.teeRuntimeClasses`.
    NotListed,
    /// The namespace carries `teeguard.dev/exempt: "true"`.
    ExemptNamespace,
    /// A container or init container already requests or limits a TEE key resource.
    KeyAlreadyRequested,
    /// The pod has no container to charge the key to (the API server refuses such a pod anyway).
    NoContainer,
}

impl RuntimeClassSkip {
    /// Short machine-readable code, used in audit annotations.
    pub fn code(&self) -> &'static str {
        match self {
            RuntimeClassSkip::ExemptPod => "exempt-pod",
            RuntimeClassSkip::KubeVirtPod => "kubevirt-pod",
            RuntimeClassSkip::NotListed => "runtime-class-not-listed",
            RuntimeClassSkip::ExemptNamespace => "exempt-namespace",
            RuntimeClassSkip::KeyAlreadyRequested => "key-already-requested",
            RuntimeClassSkip::NoContainer => "no-container",
        }
    }
}

/// The key request added to the first container of a TEE RuntimeClass pod.
#[derive(Clone, Debug, PartialEq)]
pub struct RuntimeClassInjection {
    /// The pod's RuntimeClass.
    pub runtime_class: String,
    /// Its TEE kind.
    pub kind: TeeKind,
    /// The extended resource requested (`resources.<kind>.resourceName`).
    pub resource: String,
    /// Keys requested (`resources.<kind>.keysPerVm`).
    pub keys: u32,
    /// The container charged (the first of `spec.containers`).
    pub container: String,
    /// The RFC 6902 patch adding the request and the limit.
    pub patch: Patch,
}

/// A TEE RuntimeClass pod whose overhead already carries a key: allowed untouched, with a warning.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OverheadKey {
    /// The pod's RuntimeClass.
    pub runtime_class: String,
    /// Its TEE kind.
    pub kind: TeeKind,
    /// The TEE key resources found in `spec.overhead`.
    pub resources: Vec<String>,
    /// The admission warning (names the RuntimeClass and what to change).
    pub warning: String,
}

/// The outcome of [`decide_runtime_class`].
#[derive(Clone, Debug, PartialEq)]
pub enum RuntimeClassDecision {
    /// Allowed untouched.
    Skip(RuntimeClassSkip),
    /// Allowed with the patch.
    Inject(RuntimeClassInjection),
    /// Allowed untouched, with a warning.
    OverheadKey(OverheadKey),
}

/// The pod's RuntimeClass and its kind, when `admission.teeRuntimeClasses` lists it.
pub fn tee_runtime_class<'p>(pod: &'p Pod, config: &Config) -> Option<(&'p str, TeeKind)> {
    let name = pod.spec.as_ref()?.runtime_class_name.as_deref()?;
    let kind = config.admission.tee_runtime_classes.get(name)?;
    Some((name, *kind))
}

/// The key resource name of every TEE kind (`resources.<kind>.resourceName`).
fn tee_resources(config: &Config) -> impl Iterator<Item = &str> {
    TeeKind::ALL
        .into_iter()
        .map(|k| config.resources.resource_name(k))
}

fn asks_for_a_key(c: &Container, config: &Config) -> bool {
    let Some(r) = c.resources.as_ref() else {
        return false;
    };
    tee_resources(config).any(|name| {
        r.requests.as_ref().is_some_and(|m| m.contains_key(name))
            || r.limits.as_ref().is_some_and(|m| m.contains_key(name))
    })
}

/// Decide what to do with a pod CREATE that is not a KubeVirt pod. `namespace_labels` are the labels of
/// the pod's namespace, if known. Re-applies every rule itself (exemptions, the `kubevirt.io` label, the
/// listed RuntimeClass), so it is correct for any pod.
pub fn decide_runtime_class(
    pod: &Pod,
    namespace_labels: Option<&BTreeMap<String, String>>,
    config: &Config,
) -> RuntimeClassDecision {
    use RuntimeClassDecision::Skip;
    let labels = pod.metadata.labels.as_ref();
    if is_exempt(labels) {
        return Skip(RuntimeClassSkip::ExemptPod);
    }
    if labels.is_some_and(|l| l.contains_key(names::KUBEVIRT_LABEL)) {
        return Skip(RuntimeClassSkip::KubeVirtPod);
    }
    let Some((class, kind)) = tee_runtime_class(pod, config) else {
        return Skip(RuntimeClassSkip::NotListed);
    };
    if is_exempt(namespace_labels) {
        return Skip(RuntimeClassSkip::ExemptNamespace);
    }
    let Some(spec) = pod.spec.as_ref() else {
        return Skip(RuntimeClassSkip::NoContainer);
    };
    let in_overhead: Vec<String> = tee_resources(config)
        .filter(|name| {
            spec.overhead
                .as_ref()
                .is_some_and(|o| o.contains_key(*name))
        })
        .map(str::to_string)
        .collect();
    if !in_overhead.is_empty() {
        let listed = in_overhead.join(", ");
        let warning = format!(
            "RuntimeClass {class} puts {listed} in the pod overhead (overhead.podFixed), which nodes that \
             allocate TEE keys through DRA cannot serve: this pod can never be scheduled on them. Remove \
             {listed} from the overhead.podFixed of RuntimeClass {class}; teeguard then adds the key as a \
             request of the pod's first container"
        );
        return RuntimeClassDecision::OverheadKey(OverheadKey {
            runtime_class: class.to_string(),
            kind,
            resources: in_overhead,
            warning,
        });
    }
    let inits = spec.init_containers.iter().flatten();
    if spec
        .containers
        .iter()
        .chain(inits)
        .any(|c| asks_for_a_key(c, config))
    {
        return Skip(RuntimeClassSkip::KeyAlreadyRequested);
    }
    let Some(first) = spec.containers.first() else {
        return Skip(RuntimeClassSkip::NoContainer);
    };
    let kind_cfg = config.resources.get(kind);
    RuntimeClassDecision::Inject(RuntimeClassInjection {
        runtime_class: class.to_string(),
        kind,
        resource: kind_cfg.resource_name.clone(),
        keys: kind_cfg.keys_per_vm,
        container: first.name.clone(),
        patch: Patch(request_ops(
            0,
            first.resources.as_ref(),
            &["requests", "limits"],
            &kind_cfg.resource_name,
            kind_cfg.keys_per_vm,
        )),
    })
}

#[cfg(test)]
mod tests;
