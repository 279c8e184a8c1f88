//! The pure mutation decision: which pods get a TEE key request and misc.max annotations, and the
//! JSON Patch that adds them. No I/O: the caller looks the VMI and namespace up and passes them in.
//!
//! The handler calls [`classify_pod`] first to learn whether (and which) VMI to look up, then
//! [`decide_mutation`] with the lookup result. `decide_mutation` re-applies the pod rules itself,
//! so it is correct on its own for any input.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation, ReplaceOperation};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Map, Value};
use teeguard_shared::config::CrioAnnotation;
use teeguard_shared::names;
use teeguard_shared::pod::parse_whole_quantity;
use teeguard_shared::{Config, TeeKind, VirtualMachineInstance};

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

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SkipReason::ExemptPod => write!(f, "pod is labelled {}=true", names::EXEMPT_LABEL),
            SkipReason::NotKubeVirt => write!(f, "not a KubeVirt pod"),
            SkipReason::NotVirtLauncher(role) => {
                write!(f, "KubeVirt pod of role {role:?}, not a virt-launcher")
            }
            SkipReason::Hotplug => write!(f, "hotplug volume pod"),
            SkipReason::Export => write!(f, "VM export pod"),
            SkipReason::StorageBinding => write!(f, "temporary storage-binding pod"),
            SkipReason::NoVmiOwner => write!(
                f,
                "no controller owner reference to a kubevirt.io VirtualMachineInstance"
            ),
            SkipReason::ExemptNamespace => {
                write!(f, "namespace is labelled {}=true", names::EXEMPT_LABEL)
            }
            SkipReason::ExemptVmi => write!(f, "VMI is labelled {}=true", names::EXEMPT_LABEL),
            SkipReason::NotTee => write!(f, "VMI has no launchSecurity"),
            SkipReason::UnmanagedLaunchSecurity => write!(
                f,
                "VMI launchSecurity names no TDX/SEV/SNP (e.g. s390x Secure Execution)"
            ),
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

fn is_exempt(labels: Option<&BTreeMap<String, String>>) -> bool {
    labels
        .and_then(|l| l.get(names::EXEMPT_LABEL))
        .is_some_and(|v| v == "true")
}

/// Whether namespace labels exempt the namespace.
pub fn namespace_exempt(labels: Option<&BTreeMap<String, String>>) -> bool {
    is_exempt(labels)
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
    decide(pod, vmi, namespace_labels, config, Patching::Build)
}

/// [`decide_mutation`] without building the patch: the same decision, with an empty
/// [`Injection::patch`]. The validating webhook re-runs the decision only for the kind, key count and
/// refusals, to know which cgroup-limit annotations the pod may carry.
pub fn decide_mutation_unpatched(
    pod: &Pod,
    vmi: Option<&VmiLookup>,
    namespace_labels: Option<&BTreeMap<String, String>>,
    config: &Config,
) -> MutationDecision {
    decide(pod, vmi, namespace_labels, config, Patching::Skip)
}

/// Whether [`injection_patch`] builds the patch or only makes its refusals.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Patching {
    Build,
    Skip,
}

fn decide(
    pod: &Pod,
    vmi: Option<&VmiLookup>,
    namespace_labels: Option<&BTreeMap<String, String>>,
    config: &Config,
    patching: Patching,
) -> MutationDecision {
    let vmi_ref = match classify_pod(pod) {
        Ok(r) => r,
        Err(skip) => return MutationDecision::Skip(skip),
    };
    if namespace_exempt(namespace_labels) {
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
        patching,
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

/// The misc.max value for a kind and key count: `"tdx 1"`.
pub fn misc_max_value(kind: TeeKind, keys: u32) -> String {
    format!("{} {keys}", kind.kernel_name())
}

/// The annotations a TEE pod's `compute` container must carry under `config` (the validating webhook
/// compares a pod's cgroup-limit annotations with these). The CRI-O value keeps any other `key=value`
/// entries already in the pod's annotation.
pub fn wanted_annotations(
    pod: &Pod,
    kind: TeeKind,
    keys: u32,
    config: &Config,
) -> Vec<(String, String)> {
    let misc = misc_max_value(kind, keys);
    let mut out = Vec::with_capacity(2);
    if config.enforcement.misc_max_annotation {
        out.push((
            names::misc_max_annotation(names::COMPUTE_CONTAINER),
            misc.clone(),
        ));
    }
    let crio_prefix = match config.enforcement.crio_annotation {
        CrioAnnotation::None => None,
        CrioAnnotation::Legacy => Some(names::CRIO_UNIFIED_LEGACY_PREFIX),
        CrioAnnotation::Current => Some(names::CRIO_UNIFIED_PREFIX),
    };
    if let Some(prefix) = crio_prefix {
        let key = [prefix, names::COMPUTE_CONTAINER].concat();
        let existing = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(&key))
            .map(String::as_str);
        out.push((key, crio_unified_value(existing, &misc)));
    }
    out
}

/// Merge `misc.max=<misc>` into a CRI-O unified-cgroup value (`key=value;key=value`), replacing any
/// `misc.max` entry and keeping the others in order.
pub fn crio_unified_value(existing: Option<&str>, misc: &str) -> String {
    let ours = format!("misc.max={misc}");
    let mut entries: Vec<String> = Vec::new();
    let mut placed = false;
    for entry in existing.unwrap_or("").split(';') {
        let trimmed = entry.trim();
        if trimmed.is_empty() {
            continue;
        }
        let key = trimmed.split('=').next().unwrap_or("").trim();
        if key == "misc.max" {
            if !placed {
                entries.push(ours.clone());
                placed = true;
            }
        } else {
            entries.push(trimmed.to_string());
        }
    }
    if !placed {
        entries.push(ours);
    }
    entries.join(";")
}

/// The JSON Pointer (RFC 6901) to `tokens`: each token escaped (`~` as `~0`, `/` as `~1`) into one
/// pre-sized string. (jsonptr's `from_tokens` makes a `Token` per segment and grows the string as it
/// goes: a third of building a patch.)
fn ptr(tokens: &[&str]) -> PointerBuf {
    let escapes = |t: &&str| t.bytes().filter(|b| matches!(b, b'~' | b'/')).count();
    let len = tokens.iter().map(|t| 1 + t.len() + escapes(t)).sum();
    let mut s = String::with_capacity(len);
    for t in tokens {
        s.push('/');
        for c in t.chars() {
            match c {
                '~' => s.push_str("~0"),
                '/' => s.push_str("~1"),
                c => s.push(c),
            }
        }
    }
    // Escaped as above, the string always parses; jsonptr's own encoding is the fallback.
    PointerBuf::parse(s).unwrap_or_else(|_| PointerBuf::from_tokens(tokens.iter().copied()))
}

fn add(tokens: &[&str], value: Value) -> PatchOperation {
    PatchOperation::Add(AddOperation {
        path: ptr(tokens),
        value,
    })
}

/// The patch adding `<resource>: <keys>` to the `compute` container's requests and limits and the
/// misc.max annotations; empty when all is present. A different amount already requested is a denial.
fn injection_patch(
    pod: &Pod,
    vmi: &VmiRef,
    kind: TeeKind,
    resource: &str,
    keys: u32,
    config: &Config,
    patching: Patching,
) -> Result<Patch, Denial> {
    // Only the refusals below name the pod: format it for them alone.
    let pod_name = || teeguard_shared::pod::pod_display_name(pod);
    let containers = pod
        .spec
        .as_ref()
        .map(|s| s.containers.as_slice())
        .unwrap_or(&[]);
    let Some((idx, compute)) = containers
        .iter()
        .enumerate()
        .find(|(_, c)| c.name == names::COMPUTE_CONTAINER)
    else {
        return Err(Denial {
            reason: DenyReason::NoComputeContainer,
            message: format!(
                "pod {} of {} VirtualMachineInstance {vmi} has no {:?} container to charge the TEE key to",
                pod_name(),
                kind.display_name(),
                names::COMPUTE_CONTAINER
            ),
        });
    };
    let res = compute.resources.as_ref();
    let mut missing: Vec<&'static str> = Vec::with_capacity(2);
    for (field, map) in [
        ("requests", res.and_then(|r| r.requests.as_ref())),
        ("limits", res.and_then(|r| r.limits.as_ref())),
    ] {
        match map.and_then(|m| m.get(resource)) {
            None => missing.push(field),
            Some(q) => match parse_whole_quantity(&q.0) {
                Some(n) if n == u64::from(keys) => {}
                Some(_) => {
                    return Err(Denial {
                        reason: DenyReason::ConflictingRequest,
                        message: format!(
                            "pod {}: container {:?} already sets {field} {resource}: {:?}, but a {} VM holds exactly {keys}; \
                             remove it from the VirtualMachineInstance {vmi} and let teeguard set it",
                            pod_name(),
                            names::COMPUTE_CONTAINER,
                            q.0,
                            kind.display_name()
                        ),
                    });
                }
                None => {
                    return Err(Denial {
                        reason: DenyReason::BadQuantity,
                        message: format!(
                            "pod {}: container {:?} {field} {resource}: {:?} is not a whole number of keys",
                            pod_name(),
                            names::COMPUTE_CONTAINER,
                            q.0
                        ),
                    });
                }
            },
        }
    }
    if patching == Patching::Skip {
        // The refusals are all above; what follows only builds operations.
        return Ok(Patch(Vec::new()));
    }
    let idx = idx.to_string();
    let qty = keys.to_string();
    let mut ops = Vec::with_capacity(4);
    let base = ["spec", "containers", idx.as_str(), "resources"];
    match res {
        None if !missing.is_empty() => {
            let mut obj = Map::new();
            for field in &missing {
                obj.insert(
                    (*field).to_string(),
                    Value::Object(Map::from_iter([(
                        resource.to_string(),
                        Value::String(qty.clone()),
                    )])),
                );
            }
            ops.push(add(&base, Value::Object(obj)));
        }
        _ => {
            for field in &missing {
                let present = match *field {
                    "requests" => res.and_then(|r| r.requests.as_ref()).is_some(),
                    _ => res.and_then(|r| r.limits.as_ref()).is_some(),
                };
                if present {
                    ops.push(add(
                        &[base[0], base[1], base[2], base[3], field, resource],
                        Value::String(qty.clone()),
                    ));
                } else {
                    ops.push(add(
                        &[base[0], base[1], base[2], base[3], field],
                        Value::Object(Map::from_iter([(
                            resource.to_string(),
                            Value::String(qty.clone()),
                        )])),
                    ));
                }
            }
        }
    }

    let annotations = pod.metadata.annotations.as_ref();
    let wanted = wanted_annotations(pod, kind, keys, config);
    match annotations {
        None => {
            if !wanted.is_empty() {
                let obj: Map<String, Value> = wanted
                    .into_iter()
                    .map(|(k, v)| (k, Value::String(v)))
                    .collect();
                ops.push(add(&["metadata", "annotations"], Value::Object(obj)));
            }
        }
        Some(existing) => {
            for (key, value) in wanted {
                match existing.get(&key) {
                    Some(v) if *v == value => {}
                    Some(_) => ops.push(PatchOperation::Replace(ReplaceOperation {
                        path: ptr(&["metadata", "annotations", &key]),
                        value: Value::String(value),
                    })),
                    None => ops.push(add(
                        &["metadata", "annotations", &key],
                        Value::String(value),
                    )),
                }
            }
        }
    }
    Ok(Patch(ops))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;
    use serde_json::json;

    fn base_pod() -> Value {
        json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "generateName": "virt-launcher-vm1-",
                "namespace": "ns",
                "labels": {
                    "kubevirt.io": "virt-launcher",
                    "kubevirt.io/created-by": "vmi-uid-1",
                    "vm.kubevirt.io/name": "vm1"
                },
                "annotations": {"kubevirt.io/domain": "vm1"},
                "ownerReferences": [{
                    "apiVersion": "kubevirt.io/v1",
                    "kind": "VirtualMachineInstance",
                    "name": "vm1",
                    "uid": "vmi-uid-1",
                    "controller": true,
                    "blockOwnerDeletion": true
                }]
            },
            "spec": {
                "containers": [
                    {"name": "compute", "image": "virt-launcher", "resources": {
                        "requests": {"cpu": "100m", "memory": "2Gi", "devices.kubevirt.io/tdx": "1"},
                        "limits": {"devices.kubevirt.io/tdx": "1"}
                    }},
                    {"name": "guest-console-log", "image": "virt-launcher"}
                ]
            }
        })
    }

    fn pod_from(v: &Value) -> Pod {
        serde_json::from_value(v.clone()).expect("pod")
    }

    fn vmi(launch_security: Value, labels: Value) -> Arc<VirtualMachineInstance> {
        let mut v = json!({
            "apiVersion": "kubevirt.io/v1",
            "kind": "VirtualMachineInstance",
            "metadata": {"name": "vm1", "namespace": "ns", "uid": "vmi-uid-1", "labels": labels},
            "spec": {"domain": {"devices": {}}}
        });
        if !launch_security.is_null() {
            v["spec"]["domain"]["launchSecurity"] = launch_security;
        }
        Arc::new(VirtualMachineInstance::from_json(v).expect("vmi"))
    }

    fn tdx() -> VmiLookup {
        VmiLookup::Found(vmi(json!({"tdx": {}}), json!({})))
    }

    fn apply(pod: &Value, patch: &Patch) -> Value {
        let mut doc = pod.clone();
        json_patch::patch(&mut doc, &patch.0).expect("patch applies");
        doc
    }

    fn decide(pod: &Value, vmi: Option<&VmiLookup>, cfg: &Config) -> MutationDecision {
        decide_mutation(&pod_from(pod), vmi, None, cfg)
    }

    fn injected(d: MutationDecision) -> Injection {
        match d {
            MutationDecision::Inject(i) => i,
            other => panic!("expected injection, got {other:?}"),
        }
    }

    fn skipped(d: MutationDecision) -> SkipReason {
        match d {
            MutationDecision::Skip(s) => s,
            other => panic!("expected skip, got {other:?}"),
        }
    }

    fn denied(d: MutationDecision) -> Denial {
        match d {
            MutationDecision::Deny(x) => x,
            other => panic!("expected denial, got {other:?}"),
        }
    }

    #[test]
    fn each_kind_gets_its_resource_and_annotation() {
        let cfg = Config::default();
        let cases = [
            (
                json!({"tdx": {}}),
                TeeKind::Tdx,
                "tdx.intel.com/keys",
                "tdx 1",
            ),
            (
                json!({"sev": {}}),
                TeeKind::Sev,
                "sev.amd.com/asids",
                "sev 1",
            ),
            (
                json!({"sev": {"policy": {"encryptedState": true}}}),
                TeeKind::SevEs,
                "sev-snp.amd.com/esids",
                "sev_es 1",
            ),
            (
                json!({"snp": {}}),
                TeeKind::SevEs,
                "sev-snp.amd.com/esids",
                "sev_es 1",
            ),
        ];
        for (ls, kind, resource, misc) in cases {
            let pod = base_pod();
            let lookup = VmiLookup::Found(vmi(ls.clone(), json!({})));
            let inj = injected(decide(&pod, Some(&lookup), &cfg));
            assert_eq!(inj.kind, kind, "{ls}");
            assert_eq!(inj.resource, resource);
            assert_eq!(inj.keys, 1);
            assert_eq!(inj.vmi.name, "vm1");
            let out = apply(&pod, &inj.patch);
            let c = &out["spec"]["containers"][0]["resources"];
            assert_eq!(c["requests"][resource], "1", "{ls}");
            assert_eq!(c["limits"][resource], "1", "{ls}");
            // Existing requests are preserved.
            assert_eq!(c["requests"]["cpu"], "100m");
            assert_eq!(c["requests"]["memory"], "2Gi");
            assert_eq!(c["requests"]["devices.kubevirt.io/tdx"], "1");
            assert_eq!(
                out["metadata"]["annotations"]["misc-max.teeguard.dev/compute"],
                misc
            );
            assert_eq!(out["metadata"]["annotations"]["kubevirt.io/domain"], "vm1");
            // The other container is untouched.
            assert_eq!(out["spec"]["containers"][1], pod["spec"]["containers"][1]);
            // The result is still a valid Pod.
            let _: Pod = serde_json::from_value(out).expect("patched pod");
        }
    }

    #[test]
    fn patch_paths_escape_slashes() {
        let inj = injected(decide(&base_pod(), Some(&tdx()), &Config::default()));
        let json = serde_json::to_value(&inj.patch).expect("patch json");
        assert_eq!(
            json,
            json!([
                {"op": "add", "path": "/spec/containers/0/resources/requests/tdx.intel.com~1keys", "value": "1"},
                {"op": "add", "path": "/spec/containers/0/resources/limits/tdx.intel.com~1keys", "value": "1"},
                {"op": "add", "path": "/metadata/annotations/misc-max.teeguard.dev~1compute", "value": "tdx 1"}
            ])
        );
        // `~` is escaped as `~0`, `/` as `~1`, as jsonptr escapes them.
        for tokens in [
            &["metadata", "annotations", "a~b/c"][..],
            &["a~~b", "//", "~1", "~", "/", "", "x/y~z/"][..],
            &[][..],
            &[""][..],
        ] {
            assert_eq!(
                ptr(tokens),
                PointerBuf::from_tokens(tokens.iter().copied()),
                "{tokens:?}"
            );
        }
        assert_eq!(
            ptr(&["metadata", "annotations", "a~b/c"]).to_string(),
            "/metadata/annotations/a~0b~1c"
        );
    }

    #[test]
    fn absent_maps_are_added_whole() {
        let cfg = Config::default();
        let mut pod = base_pod();
        pod["metadata"]
            .as_object_mut()
            .expect("meta")
            .remove("annotations");
        pod["spec"]["containers"][0]
            .as_object_mut()
            .expect("container")
            .remove("resources");
        let inj = injected(decide(&pod, Some(&tdx()), &cfg));
        assert_eq!(
            serde_json::to_value(&inj.patch).expect("json"),
            json!([
                {"op": "add", "path": "/spec/containers/0/resources", "value": {
                    "requests": {"tdx.intel.com/keys": "1"}, "limits": {"tdx.intel.com/keys": "1"}}},
                {"op": "add", "path": "/metadata/annotations", "value": {"misc-max.teeguard.dev/compute": "tdx 1"}}
            ])
        );
        apply(&pod, &inj.patch);

        // resources present but requests/limits absent.
        let mut pod = base_pod();
        pod["spec"]["containers"][0]["resources"] = json!({"limits": {"memory": "1Gi"}});
        let inj = injected(decide(&pod, Some(&tdx()), &cfg));
        let out = apply(&pod, &inj.patch);
        assert_eq!(
            out["spec"]["containers"][0]["resources"],
            json!({"requests": {"tdx.intel.com/keys": "1"}, "limits": {"memory": "1Gi", "tdx.intel.com/keys": "1"}})
        );

        // Empty maps take single keys.
        let mut pod = base_pod();
        pod["spec"]["containers"][0]["resources"] = json!({"requests": {}, "limits": {}});
        pod["metadata"]["annotations"] = json!({});
        let inj = injected(decide(&pod, Some(&tdx()), &cfg));
        let out = apply(&pod, &inj.patch);
        assert_eq!(
            out["spec"]["containers"][0]["resources"]["limits"]["tdx.intel.com/keys"],
            "1"
        );
        assert_eq!(
            out["metadata"]["annotations"],
            json!({"misc-max.teeguard.dev/compute": "tdx 1"})
        );
    }

    #[test]
    fn compute_is_found_by_name_not_index() {
        let mut pod = base_pod();
        let containers = pod["spec"]["containers"].as_array_mut().expect("array");
        containers.reverse();
        let inj = injected(decide(&pod, Some(&tdx()), &Config::default()));
        let out = apply(&pod, &inj.patch);
        assert_eq!(out["spec"]["containers"][1]["name"], "compute");
        assert_eq!(
            out["spec"]["containers"][1]["resources"]["limits"]["tdx.intel.com/keys"],
            "1"
        );
        assert!(out["spec"]["containers"][0].get("resources").is_none());
    }

    #[test]
    fn reinvocation_is_idempotent() {
        for crio in [
            CrioAnnotation::None,
            CrioAnnotation::Legacy,
            CrioAnnotation::Current,
        ] {
            let mut cfg = Config::default();
            cfg.enforcement.crio_annotation = crio;
            let pod = base_pod();
            let first = injected(decide(&pod, Some(&tdx()), &cfg));
            assert!(!first.patch.0.is_empty());
            let patched = apply(&pod, &first.patch);
            let second = injected(decide(&patched, Some(&tdx()), &cfg));
            assert!(second.patch.0.is_empty(), "{crio:?}: {:?}", second.patch);
        }
    }

    #[test]
    fn crio_annotations() {
        let mut cfg = Config::default();
        cfg.enforcement.crio_annotation = CrioAnnotation::Legacy;
        let out = apply(
            &base_pod(),
            &injected(decide(&base_pod(), Some(&tdx()), &cfg)).patch,
        );
        assert_eq!(
            out["metadata"]["annotations"]["io.kubernetes.cri-o.UnifiedCgroup.compute"],
            "misc.max=tdx 1"
        );
        assert_eq!(
            out["metadata"]["annotations"]["misc-max.teeguard.dev/compute"],
            "tdx 1"
        );

        cfg.enforcement.crio_annotation = CrioAnnotation::Current;
        cfg.enforcement.misc_max_annotation = false;
        let mut pod = base_pod();
        // Another unified entry is kept; a user-set misc.max is overwritten.
        pod["metadata"]["annotations"]["unified-cgroup.crio.io/compute"] =
            json!("memory.high=1073741824;misc.max=tdx 9");
        let inj = injected(decide(&pod, Some(&tdx()), &cfg));
        assert!(matches!(
            inj.patch.0.last(),
            Some(PatchOperation::Replace(_))
        ));
        let out = apply(&pod, &inj.patch);
        assert_eq!(
            out["metadata"]["annotations"]["unified-cgroup.crio.io/compute"],
            "memory.high=1073741824;misc.max=tdx 1"
        );
        assert!(
            out["metadata"]["annotations"]
                .get("misc-max.teeguard.dev/compute")
                .is_none()
        );
    }

    #[test]
    fn user_set_misc_max_annotation_is_replaced() {
        let mut pod = base_pod();
        pod["metadata"]["annotations"]["misc-max.teeguard.dev/compute"] = json!("tdx 100");
        let inj = injected(decide(&pod, Some(&tdx()), &Config::default()));
        let out = apply(&pod, &inj.patch);
        assert_eq!(
            out["metadata"]["annotations"]["misc-max.teeguard.dev/compute"],
            "tdx 1"
        );
    }

    #[test]
    fn crio_value_merging() {
        assert_eq!(crio_unified_value(None, "tdx 1"), "misc.max=tdx 1");
        assert_eq!(crio_unified_value(Some(""), "tdx 1"), "misc.max=tdx 1");
        assert_eq!(
            crio_unified_value(Some("a=1; misc.max=sev 3 ;b=2;misc.max=x;"), "tdx 1"),
            "a=1;misc.max=tdx 1;b=2"
        );
    }

    #[test]
    fn keys_per_vm_and_resource_names_come_from_config() {
        let cfg = Config::from_yaml(
            "resources:\n  tdx:\n    resourceName: example.com/tdx\n    keysPerVm: 2\nenforcement:\n  crioAnnotation: legacy\n",
        )
        .expect("config");
        let out = apply(
            &base_pod(),
            &injected(decide(&base_pod(), Some(&tdx()), &cfg)).patch,
        );
        assert_eq!(
            out["spec"]["containers"][0]["resources"]["requests"]["example.com/tdx"],
            "2"
        );
        assert_eq!(
            out["metadata"]["annotations"]["misc-max.teeguard.dev/compute"],
            "tdx 2"
        );
        assert_eq!(
            out["metadata"]["annotations"]["io.kubernetes.cri-o.UnifiedCgroup.compute"],
            "misc.max=tdx 2"
        );
    }

    #[test]
    fn existing_equal_request_is_kept_different_is_denied() {
        let cfg = Config::default();
        let mut pod = base_pod();
        pod["spec"]["containers"][0]["resources"]["requests"]["tdx.intel.com/keys"] = json!("1");
        let inj = injected(decide(&pod, Some(&tdx()), &cfg));
        // Only the limit and the annotation are added.
        assert_eq!(inj.patch.0.len(), 2);
        let out = apply(&pod, &inj.patch);
        assert_eq!(
            out["spec"]["containers"][0]["resources"]["limits"]["tdx.intel.com/keys"],
            "1"
        );

        let mut pod = base_pod();
        pod["spec"]["containers"][0]["resources"]["limits"]["tdx.intel.com/keys"] = json!("2");
        let d = denied(decide(&pod, Some(&tdx()), &cfg));
        assert_eq!(d.reason, DenyReason::ConflictingRequest);
        assert!(!d.reason.retryable());
        assert!(
            d.message.contains("limits tdx.intel.com/keys: \"2\"") && d.message.contains("ns/vm1"),
            "{}",
            d.message
        );

        let mut pod = base_pod();
        pod["spec"]["containers"][0]["resources"]["requests"]["tdx.intel.com/keys"] = json!("500m");
        let d = denied(decide(&pod, Some(&tdx()), &cfg));
        assert_eq!(d.reason, DenyReason::BadQuantity);
    }

    #[test]
    fn no_compute_container_is_denied() {
        let mut pod = base_pod();
        pod["spec"]["containers"][0]["name"] = json!("qemu");
        let d = denied(decide(&pod, Some(&tdx()), &Config::default()));
        assert_eq!(d.reason, DenyReason::NoComputeContainer);
        assert!(d.message.contains("\"compute\""), "{}", d.message);
    }

    #[test]
    fn pod_skip_rules() {
        let cfg = Config::default();
        type Edit = Box<dyn Fn(&mut Value)>;
        let cases: Vec<(Edit, SkipReason)> = vec![
            (
                Box::new(|p| p["metadata"]["labels"]["teeguard.dev/exempt"] = json!("true")),
                SkipReason::ExemptPod,
            ),
            (
                Box::new(|p| {
                    p["metadata"]["labels"]
                        .as_object_mut()
                        .expect("labels")
                        .remove("kubevirt.io");
                }),
                SkipReason::NotKubeVirt,
            ),
            (
                Box::new(|p| p["metadata"]["labels"]["kubevirt.io"] = json!("hotplug-disk")),
                SkipReason::Hotplug,
            ),
            (
                Box::new(|p| p["metadata"]["labels"]["kubevirt.io"] = json!("virt-exporter")),
                SkipReason::Export,
            ),
            (
                Box::new(|p| p["metadata"]["labels"]["kubevirt.io"] = json!("virt-handler")),
                SkipReason::NotVirtLauncher("virt-handler".into()),
            ),
            (
                Box::new(|p| {
                    p["metadata"]["annotations"]["kubevirt.io/ephemeral-provisioning"] =
                        json!("true")
                }),
                SkipReason::StorageBinding,
            ),
            (
                Box::new(|p| {
                    p["metadata"]
                        .as_object_mut()
                        .expect("meta")
                        .remove("ownerReferences");
                }),
                SkipReason::NoVmiOwner,
            ),
            (
                Box::new(|p| p["metadata"]["ownerReferences"][0]["controller"] = json!(false)),
                SkipReason::NoVmiOwner,
            ),
            (
                Box::new(|p| p["metadata"]["ownerReferences"][0]["kind"] = json!("ReplicaSet")),
                SkipReason::NoVmiOwner,
            ),
            (
                Box::new(|p| {
                    p["metadata"]["ownerReferences"][0]["apiVersion"] = json!("example.com/v1")
                }),
                SkipReason::NoVmiOwner,
            ),
        ];
        for (mutate, want) in cases {
            let mut pod = base_pod();
            mutate(&mut pod);
            // Skipped before the VMI matters: no lookup needed, even a failed one is ignored.
            assert_eq!(classify_pod(&pod_from(&pod)), Err(want.clone()));
            assert_eq!(skipped(decide(&pod, None, &cfg)), want);
            assert_eq!(
                skipped(decide(&pod, Some(&VmiLookup::Failed("down".into())), &cfg)),
                want
            );
        }
        // A non-"true" exempt value does not exempt; storage binding needs "true" too.
        let mut pod = base_pod();
        pod["metadata"]["labels"]["teeguard.dev/exempt"] = json!("false");
        pod["metadata"]["annotations"]["kubevirt.io/ephemeral-provisioning"] = json!("false");
        injected(decide(&pod, Some(&tdx()), &cfg));
    }

    #[test]
    fn migration_target_gets_the_key() {
        let mut pod = base_pod();
        pod["metadata"]["labels"]["kubevirt.io/migrationJobUID"] = json!("mig-1");
        let inj = injected(decide(&pod, Some(&tdx()), &Config::default()));
        assert!(!inj.patch.0.is_empty());
    }

    #[test]
    fn namespace_and_vmi_exemptions() {
        let cfg = Config::default();
        let pod = pod_from(&base_pod());
        let ns = BTreeMap::from([("teeguard.dev/exempt".to_string(), "true".to_string())]);
        assert_eq!(
            skipped(decide_mutation(&pod, None, Some(&ns), &cfg)),
            SkipReason::ExemptNamespace
        );
        let other = BTreeMap::from([("team".to_string(), "a".to_string())]);
        injected(decide_mutation(&pod, Some(&tdx()), Some(&other), &cfg));
        let exempt_vmi = VmiLookup::Found(vmi(
            json!({"tdx": {}}),
            json!({"teeguard.dev/exempt": "true"}),
        ));
        assert_eq!(
            skipped(decide_mutation(&pod, Some(&exempt_vmi), None, &cfg)),
            SkipReason::ExemptVmi
        );
    }

    #[test]
    fn non_tee_vmis_are_skipped() {
        let cfg = Config::default();
        let plain = VmiLookup::Found(vmi(Value::Null, json!({})));
        assert_eq!(
            skipped(decide(&base_pod(), Some(&plain), &cfg)),
            SkipReason::NotTee
        );
        let s390x = VmiLookup::Found(vmi(json!({}), json!({})));
        assert_eq!(
            skipped(decide(&base_pod(), Some(&s390x), &cfg)),
            SkipReason::UnmanagedLaunchSecurity
        );
        let two = VmiLookup::Found(vmi(json!({"tdx": {}, "snp": {}}), json!({})));
        assert_eq!(
            denied(decide(&base_pod(), Some(&two), &cfg)).reason,
            DenyReason::ConflictingTeeKinds
        );
    }

    #[test]
    fn missing_vmi_is_a_retryable_denial() {
        let cfg = Config::default();
        let d = denied(decide(&base_pod(), Some(&VmiLookup::NotFound), &cfg));
        assert_eq!(d.reason, DenyReason::VmiNotFound);
        assert!(d.reason.retryable());
        assert_eq!(
            d.message,
            "VirtualMachineInstance ns/vm1 not found yet; KubeVirt will retry creating the pod"
        );
        let d = denied(decide(
            &base_pod(),
            Some(&VmiLookup::Failed("timed out".into())),
            &cfg,
        ));
        assert_eq!(d.reason, DenyReason::VmiLookupFailed);
        assert!(
            d.message.contains("timed out") && d.message.contains("retry"),
            "{}",
            d.message
        );
        let d = denied(decide(&base_pod(), None, &cfg));
        assert_eq!(d.reason, DenyReason::VmiLookupFailed);

        // A VMI of the same name but another UID is not the owner.
        let mut other = (*vmi(json!({"tdx": {}}), json!({}))).clone();
        other.metadata.uid = Some("other-uid".into());
        let d = denied(decide(
            &base_pod(),
            Some(&VmiLookup::Found(Arc::new(other))),
            &cfg,
        ));
        assert_eq!(d.reason, DenyReason::VmiNotFound);
        assert!(d.message.contains("other-uid"), "{}", d.message);
    }

    #[test]
    fn codes_are_distinct() {
        let skips = [
            SkipReason::ExemptPod,
            SkipReason::NotKubeVirt,
            SkipReason::NotVirtLauncher(String::new()),
            SkipReason::Hotplug,
            SkipReason::Export,
            SkipReason::StorageBinding,
            SkipReason::NoVmiOwner,
            SkipReason::ExemptNamespace,
            SkipReason::ExemptVmi,
            SkipReason::NotTee,
            SkipReason::UnmanagedLaunchSecurity,
        ];
        let codes: std::collections::BTreeSet<_> = skips.iter().map(|s| s.code()).collect();
        assert_eq!(codes.len(), skips.len());
        for s in &skips {
            assert!(!s.to_string().is_empty());
        }
    }
}
