//! The JSON Patch that gives a TEE pod's `compute` container its key request and limit
//! annotations, and the annotation values themselves (also what the validating webhook expects).

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch, PatchOperation, ReplaceOperation};
use k8s_openapi::api::core::v1::{Pod, ResourceRequirements};
use serde_json::{Map, Value};
use teeguard_shared::config::CrioAnnotation;
use teeguard_shared::names;
use teeguard_shared::pod::parse_whole_quantity;
use teeguard_shared::{Config, TeeKind};

use super::*;

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
pub(super) fn ptr(tokens: &[&str]) -> PointerBuf {
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

/// The operations adding `<resource>: <keys>` to the `fields` (`requests`, `limits`) of container
/// `idx`, whose resources are `res`: a whole `resources`, `requests` or `limits` map where it is
/// missing, else one entry.
pub(super) fn request_ops(
    idx: usize,
    res: Option<&ResourceRequirements>,
    fields: &[&str],
    resource: &str,
    keys: u32,
) -> Vec<PatchOperation> {
    let idx = idx.to_string();
    let base = ["spec", "containers", idx.as_str(), "resources"];
    let qty = Value::String(keys.to_string());
    let one = || Value::Object(Map::from_iter([(resource.to_string(), qty.clone())]));
    let Some(res) = res else {
        if fields.is_empty() {
            return Vec::new();
        }
        let whole = fields.iter().map(|f| (f.to_string(), one())).collect();
        return vec![add(&base, Value::Object(whole))];
    };
    let ops = fields.iter().map(|&field| {
        let present = match field {
            "requests" => res.requests.is_some(),
            _ => res.limits.is_some(),
        };
        if present {
            add(
                &[base[0], base[1], base[2], base[3], field, resource],
                qty.clone(),
            )
        } else {
            add(&[base[0], base[1], base[2], base[3], field], one())
        }
    });
    ops.collect()
}

pub(super) fn add(tokens: &[&str], value: Value) -> PatchOperation {
    PatchOperation::Add(AddOperation {
        path: ptr(tokens),
        value,
    })
}

/// The key amount `spec.overhead` carries for `resource` (the API server's RuntimeClass admission
/// copies the RuntimeClass's `overhead.podFixed` there before any webhook runs), or the quantity when it
/// is not a whole number.
fn overhead_key(pod: &Pod, resource: &str) -> Result<Option<u64>, String> {
    let Some(q) = pod
        .spec
        .as_ref()
        .and_then(|s| s.overhead.as_ref())
        .and_then(|o| o.get(resource))
    else {
        return Ok(None);
    };
    parse_whole_quantity(&q.0)
        .map(Some)
        .ok_or_else(|| q.0.clone())
}

/// The patch adding `<resource>: <keys>` to the `compute` container's requests and limits and the
/// misc.max annotations; empty when all is present. A different amount already requested is a denial.
/// When the pod overhead carries the key (a RuntimeClass's), only the annotations are added.
pub(super) fn injection_patch(
    pod: &Pod,
    vmi: &VmiRef,
    kind: TeeKind,
    resource: &str,
    keys: u32,
    config: &Config,
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
    // A RuntimeClass's `overhead.podFixed` may already carry the key (kata-deploy renders its TEE
    // RuntimeClasses that way; KubeVirt's `defaultRuntimeClass` can name one): the scheduler counts it
    // for the pod, so it is the VM's key and `compute` gets no second one.
    let in_overhead = overhead_key(pod, resource).map_err(|q| Denial {
        reason: DenyReason::BadQuantity,
        message: format!(
            "pod {}: spec.overhead {resource}: {q:?} (from its RuntimeClass) is not a whole number of keys",
            pod_name()
        ),
    })?;
    let mut missing: Vec<&'static str> = Vec::with_capacity(2);
    for (field, map) in [
        ("requests", res.and_then(|r| r.requests.as_ref())),
        ("limits", res.and_then(|r| r.limits.as_ref())),
    ] {
        if let Some(n) = in_overhead {
            if n != u64::from(keys) || map.is_some_and(|m| m.contains_key(resource)) {
                return Err(Denial {
                    reason: DenyReason::ConflictingRequest,
                    message: format!(
                        "pod {}: its RuntimeClass {:?} puts {resource}: {n} in the pod overhead{}, but a {} VM \
                         holds exactly {keys} key; fix overhead.podFixed of the RuntimeClass (or KubeVirt's \
                         defaultRuntimeClass) so the VM's key is counted once",
                        pod_name(),
                        pod.spec
                            .as_ref()
                            .and_then(|s| s.runtime_class_name.as_deref())
                            .unwrap_or(""),
                        if map.is_some_and(|m| m.contains_key(resource)) {
                            format!(
                                " and container {:?} {field} another",
                                names::COMPUTE_CONTAINER
                            )
                        } else {
                            String::new()
                        },
                        kind.display_name()
                    ),
                });
            }
            continue;
        }
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
    let mut ops = request_ops(idx, res, &missing, resource, keys);
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
