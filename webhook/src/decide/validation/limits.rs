//! The cgroup-limit annotation checks: a pod may carry only exactly the limit annotations the
//! mutating webhook writes for it, and an UPDATE may not change them (CRI-O had a CVE in this area).
//! Denied in every mode.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Pod;
use teeguard_shared::pod::{PodName, pod_display_name};
use teeguard_shared::{Config, TeeKind, names};

use crate::decide::mutation::{MutationDecision, wanted_annotations};

/// A pod's cgroup-limit annotations ([`names::is_limit_annotation`]).
pub fn limit_annotations(pod: &Pod) -> BTreeMap<&str, &str> {
    pod.metadata
        .annotations
        .iter()
        .flatten()
        .filter(|(k, _)| names::is_limit_annotation(k))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

/// Whether a pod carries any cgroup-limit annotation (without collecting them).
pub fn has_limit_annotations(pod: &Pod) -> bool {
    pod.metadata
        .annotations
        .iter()
        .flatten()
        .any(|(k, _)| names::is_limit_annotation(k))
}

/// The cgroup-limit annotations the mutating webhook writes on a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExpectedLimits {
    /// Exactly these (empty: none), for a VM of this kind and key count when it is a TEE pod.
    Exactly {
        /// Key and value of each.
        annotations: Vec<(String, String)>,
        /// The TEE kind and keys, when teeguard writes any.
        tee: Option<(TeeKind, u32)>,
    },
    /// The mutation decision refused the pod, so the annotations cannot be checked (the reason).
    Unverifiable(String),
}

/// What the mutating webhook writes for this pod, from its decision (re-run on the pod as validated).
/// For a TEE pod's CRI-O annotation the value keeps the pod's other `key=value` entries, exactly as the
/// mutation merges them; only the `misc.max` entry must be teeguard's.
pub fn expected_limits(pod: &Pod, mutation: &MutationDecision, config: &Config) -> ExpectedLimits {
    match mutation {
        MutationDecision::Inject(inj) => ExpectedLimits::Exactly {
            annotations: wanted_annotations(pod, inj.kind, inj.keys, config),
            tee: Some((inj.kind, inj.keys)),
        },
        MutationDecision::Skip(_) => ExpectedLimits::Exactly {
            annotations: Vec::new(),
            tee: None,
        },
        MutationDecision::Deny(d) => ExpectedLimits::Unverifiable(d.message.clone()),
    }
}

const WHY_LIMITS: &str = "cgroup-limit annotations (misc-max.teeguard.dev/*, io.kubernetes.cri-o.UnifiedCgroup.*, \
     unified-cgroup.crio.io/*) are written only by teeguard's mutating webhook, so that a pod cannot raise its own \
     TEE key limit; remove it (KubeVirt copies a VirtualMachineInstance's annotations onto its pod)";

/// On CREATE: the denial message when the pod carries a cgroup-limit annotation other than exactly what
/// the mutating webhook writes; `None` when it is clean.
pub fn check_created_limits(pod: &Pod, expected: &ExpectedLimits) -> Option<String> {
    let present = limit_annotations(pod);
    if present.is_empty() {
        return None;
    }
    let name = PodName(pod);
    let (annotations, tee) = match expected {
        ExpectedLimits::Unverifiable(why) => {
            let keys: Vec<&str> = present.keys().copied().collect();
            return Some(format!(
                "pod {name}: cannot check annotation {} against what teeguard writes: {why}",
                keys.join(", ")
            ));
        }
        ExpectedLimits::Exactly { annotations, tee } => (annotations, tee),
    };
    let mut problems = Vec::new();
    for (k, v) in &present {
        match annotations.iter().find(|(ek, _)| ek == k) {
            Some((_, ev)) if ev == v => {}
            Some((_, ev)) => {
                let (kind, keys) = tee.unwrap_or((TeeKind::Tdx, 0));
                problems.push(format!(
                    "annotation {k}={v:?} differs from what teeguard writes for a {} VM with {keys} key{} ({ev:?})",
                    kind.display_name(),
                    if keys == 1 { "" } else { "s" }
                ));
            }
            None if annotations.is_empty() => problems.push(format!(
                "annotation {k}={v:?} is not allowed: teeguard writes no cgroup-limit annotation on this pod \
                 (only on virt-launcher pods of TEE VMs that are not exempt)"
            )),
            None => {
                let allowed: Vec<&str> = annotations.iter().map(|(k, _)| k.as_str()).collect();
                problems.push(format!(
                    "annotation {k}={v:?} is not allowed: teeguard writes only {} on this pod",
                    allowed.join(", ")
                ));
            }
        }
    }
    if problems.is_empty() {
        None
    } else {
        Some(format!("pod {name}: {}; {WHY_LIMITS}", problems.join("; ")))
    }
}

/// On UPDATE: the denial message when a cgroup-limit annotation was added, changed or removed (they are
/// written once, at creation); `None` when they are unchanged.
pub fn check_updated_limits(old: &Pod, new: &Pod) -> Option<String> {
    let before = limit_annotations(old);
    let after = limit_annotations(new);
    if before == after {
        return None;
    }
    let keys: BTreeSet<&str> = before.keys().chain(after.keys()).copied().collect();
    let mut problems = Vec::new();
    for k in keys {
        match (before.get(k), after.get(k)) {
            (None, Some(v)) => problems.push(format!("annotation {k}={v:?} cannot be added")),
            (Some(o), None) => problems.push(format!("annotation {k}={o:?} cannot be removed")),
            (Some(o), Some(v)) if o != v => problems.push(format!(
                "annotation {k} cannot be changed from {o:?} to {v:?}"
            )),
            _ => {}
        }
    }
    Some(format!(
        "pod {}: {} after creation; cgroup-limit annotations are written once, at creation, by teeguard's \
         mutating webhook, so that a pod cannot raise its own TEE key limit",
        pod_display_name(new),
        problems.join("; ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;
    use serde_json::json;
    use std::sync::Arc;
    use teeguard_shared::config::CrioAnnotation;

    use crate::decide::mutation::{VmiLookup, decide_mutation};

    fn launcher(annotations: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": "virt-launcher-vm1-abcde", "namespace": "ns",
                "labels": {"kubevirt.io": "virt-launcher"},
                "annotations": annotations,
                "ownerReferences": [{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                    "name": "vm1", "uid": "vmi-uid", "controller": true}]
            },
            "spec": {"containers": [{"name": "compute", "resources": {
                "requests": {"tdx.intel.com/keys": "1"}, "limits": {"tdx.intel.com/keys": "1"}}}]}
        }))
        .expect("pod")
    }

    fn vmi(ls: serde_json::Value, labels: serde_json::Value) -> VmiLookup {
        let mut v = json!({"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "vm1", "namespace": "ns", "uid": "vmi-uid", "labels": labels},
            "spec": {"domain": {}}});
        if !ls.is_null() {
            v["spec"]["domain"]["launchSecurity"] = ls;
        }
        VmiLookup::Found(Arc::new(
            teeguard_shared::VirtualMachineInstance::from_json(v).expect("vmi"),
        ))
    }

    fn check(pod: &Pod, lookup: Option<&VmiLookup>, cfg: &Config) -> Option<String> {
        let m = decide_mutation(pod, lookup, None, cfg);
        check_created_limits(pod, &expected_limits(pod, &m, cfg))
    }

    #[test]
    fn mutations_own_annotation_is_accepted_anything_else_denied() {
        let cfg = Config::default();
        let tdx_vmi = vmi(json!({"tdx": {}}), json!({}));
        // Exactly what mutation writes.
        assert_eq!(
            check(
                &launcher(json!({"misc-max.teeguard.dev/compute": "tdx 1"})),
                Some(&tdx_vmi),
                &cfg
            ),
            None
        );
        // No limit annotation at all is not a forgery.
        assert_eq!(
            check(&launcher(json!({"a": "b"})), Some(&tdx_vmi), &cfg),
            None
        );

        // (annotations, VMI, config, expected fragment)
        let mut crio_cfg = Config::default();
        crio_cfg.enforcement.crio_annotation = CrioAnnotation::Legacy;
        let sev_vmi = vmi(json!({"sev": {}}), json!({}));
        let plain_vmi = vmi(serde_json::Value::Null, json!({}));
        let exempt_vmi = vmi(json!({"tdx": {}}), json!({"teeguard.dev/exempt": "true"}));
        let cases: Vec<(serde_json::Value, &VmiLookup, &Config, &str)> = vec![
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 5"}),
                &tdx_vmi,
                &cfg,
                "annotation misc-max.teeguard.dev/compute=\"tdx 5\" differs from what teeguard writes for a TDX VM with 1 key (\"tdx 1\")",
            ),
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 1"}),
                &sev_vmi,
                &cfg,
                "differs from what teeguard writes for a SEV VM with 1 key (\"sev 1\")",
            ),
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 1", "misc-max.teeguard.dev/guest-console-log": "tdx 1"}),
                &tdx_vmi,
                &cfg,
                "annotation misc-max.teeguard.dev/guest-console-log=\"tdx 1\" is not allowed: teeguard writes only misc-max.teeguard.dev/compute",
            ),
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 1", "io.kubernetes.cri-o.UnifiedCgroup.compute": "misc.max=tdx 1"}),
                &tdx_vmi,
                &cfg,
                "io.kubernetes.cri-o.UnifiedCgroup.compute",
            ),
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 1"}),
                &plain_vmi,
                &cfg,
                "teeguard writes no cgroup-limit annotation on this pod",
            ),
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 1"}),
                &exempt_vmi,
                &cfg,
                "teeguard writes no cgroup-limit annotation",
            ),
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 1", "io.kubernetes.cri-o.UnifiedCgroup.compute": "misc.max=tdx 9"}),
                &tdx_vmi,
                &crio_cfg,
                "differs from what teeguard writes for a TDX VM with 1 key (\"misc.max=tdx 1\")",
            ),
            (
                json!({"unified-cgroup.crio.io/compute": "misc.max=tdx 1"}),
                &tdx_vmi,
                &cfg,
                "unified-cgroup.crio.io/compute",
            ),
        ];
        for (ann, lookup, config, want) in cases {
            let msg = check(&launcher(ann.clone()), Some(lookup), config)
                .unwrap_or_else(|| panic!("{ann} should be denied"));
            assert!(msg.contains(want), "{ann}: {want:?} not in {msg}");
            assert!(msg.starts_with("pod ns/virt-launcher-vm1-abcde: "), "{msg}");
            assert!(msg.contains("cannot raise its own"), "{msg}");
        }
        // The CRI-O annotation as mutation writes it (other entries kept, misc.max ours) is accepted.
        let ok = launcher(json!({
            "misc-max.teeguard.dev/compute": "tdx 1",
            "io.kubernetes.cri-o.UnifiedCgroup.compute": "memory.high=1073741824;misc.max=tdx 1"
        }));
        assert_eq!(check(&ok, Some(&tdx_vmi), &crio_cfg), None);

        // Not a virt-launcher pod, and an exempt pod: teeguard writes nothing there.
        let mut other = launcher(json!({"misc-max.teeguard.dev/compute": "tdx 1"}));
        other.metadata.labels = None;
        assert!(check(&other, None, &cfg).is_some_and(|m| m.contains("writes no cgroup-limit")));
        let mut exempt = launcher(json!({"misc-max.teeguard.dev/compute": "tdx 1"}));
        exempt.metadata.labels = Some(BTreeMap::from([
            ("kubevirt.io".to_string(), "virt-launcher".to_string()),
            ("teeguard.dev/exempt".to_string(), "true".to_string()),
        ]));
        assert!(check(&exempt, Some(&tdx_vmi), &cfg).is_some());

        // The VMI cannot be found: unverifiable, denied with the reason.
        let msg = check(
            &launcher(json!({"misc-max.teeguard.dev/compute": "tdx 1"})),
            Some(&VmiLookup::NotFound),
            &cfg,
        )
        .expect("denied");
        assert!(
            msg.contains("cannot check annotation") && msg.contains("not found yet"),
            "{msg}"
        );
    }

    #[test]
    fn has_limit_annotations_agrees_with_the_collected_ones() {
        for annotations in [
            json!({}),
            json!({"x": "1", "kubevirt.io/domain": "vm"}),
            json!({"misc-max.teeguard.dev/compute": "tdx 1"}),
            json!({"x": "1", "io.kubernetes.cri-o.UnifiedCgroup.compute": "misc.max=tdx 1"}),
            json!({"unified-cgroup.crio.io/compute": "misc.max=sev 1"}),
        ] {
            let pod = launcher(annotations.clone());
            assert_eq!(
                has_limit_annotations(&pod),
                !limit_annotations(&pod).is_empty(),
                "{annotations}"
            );
        }
        let mut bare = launcher(json!({}));
        bare.metadata.annotations = None;
        assert!(!has_limit_annotations(&bare));
    }

    #[test]
    fn updates_must_not_touch_limit_annotations() {
        let base = launcher(json!({"misc-max.teeguard.dev/compute": "tdx 1", "x": "1"}));
        let mut other_change = base.clone();
        other_change
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert("x".into(), "2".into());
        assert_eq!(check_updated_limits(&base, &other_change), None);
        assert_eq!(check_updated_limits(&base, &base), None);
        let cases = [
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 9", "x": "1"}),
                "annotation misc-max.teeguard.dev/compute cannot be changed from \"tdx 1\" to \"tdx 9\"",
            ),
            (json!({"x": "1"}), "cannot be removed"),
            (
                json!({"misc-max.teeguard.dev/compute": "tdx 1", "unified-cgroup.crio.io/compute": "misc.max=tdx 9"}),
                "annotation unified-cgroup.crio.io/compute=\"misc.max=tdx 9\" cannot be added",
            ),
        ];
        for (ann, want) in cases {
            let msg = check_updated_limits(&base, &launcher(ann.clone())).expect("denied");
            assert!(msg.contains(want), "{ann}: {msg}");
            assert!(msg.contains("after creation"), "{msg}");
        }
    }
}
