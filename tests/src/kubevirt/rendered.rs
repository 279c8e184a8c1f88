//! What KubeVirt itself produced, committed under `tests/fixtures/kubevirt-<release>/` (v1.7.4, v1.8.4,
//! v1.9.0): for each
//! TEE kind, the VMI as virt-api stores it (`kvtool default-vmi`) and the virt-launcher pod
//! virt-controller renders for it, as teeguard's mutating webhook receives it (no name yet, no status).
//! [`compare_with_committed`] renders them again with the real controller (`tests/tests/kubevirt_nodes.rs`
//! for v1.9.0, `kubevirt_v1_7.rs` and `kubevirt_v1_8.rs` for the others) and fails when they drift;
//! `scripts/kubevirt-fixtures.sh` rewrites them.
//!
//! The objects are made deterministic: the VMI's UID (in the pod's labels, owner reference and
//! arguments) is [`crate::fixtures::Vmi`]'s UID for the same namespace and name, so they combine with
//! the test kit's other fixtures.

use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

use super::Version;
use crate::fixtures::Tee;

/// The directory under `tests/fixtures/` of `version`'s objects (`kubevirt-v1.8.4`).
pub fn dir(version: Version) -> String {
    format!("kubevirt-{}", version.tag())
}

/// The kinds rendered: KubeVirt's sample VMIs (`../shared/kubevirt/vmis/`).
pub const KINDS: [Tee; 5] = [Tee::Tdx, Tee::Snp, Tee::SevEs, Tee::Sev, Tee::None];

/// The name of the VMI of kind `tee` the files hold (`tdx-vm`), in [`crate::fixtures::DEFAULT_NAMESPACE`].
pub fn vmi_name(tee: Tee) -> String {
    format!("{}-vm", tee.slug())
}

/// The committed file of one release (a literal tag), object (`pod` or `vmi`) and kind.
macro_rules! committed {
    ($tag:literal, $what:literal, $tee:expr) => {
        match $tee {
            Tee::Tdx => include_str!(concat!(
                "../../fixtures/kubevirt-",
                $tag,
                "/tdx-",
                $what,
                ".json"
            )),
            Tee::Snp => include_str!(concat!(
                "../../fixtures/kubevirt-",
                $tag,
                "/snp-",
                $what,
                ".json"
            )),
            Tee::SevEs => {
                include_str!(concat!(
                    "../../fixtures/kubevirt-",
                    $tag,
                    "/sev-es-",
                    $what,
                    ".json"
                ))
            }
            Tee::Sev => include_str!(concat!(
                "../../fixtures/kubevirt-",
                $tag,
                "/sev-",
                $what,
                ".json"
            )),
            _ => include_str!(concat!(
                "../../fixtures/kubevirt-",
                $tag,
                "/plain-",
                $what,
                ".json"
            )),
        }
    };
}

/// `version`'s committed launcher pod of kind `tee` (one of [`KINDS`]) as JSON.
pub fn launcher_pod_value_of(version: Version, tee: Tee) -> Value {
    let text = match version {
        Version::V1_7_4 => committed!("v1.7.4", "pod", tee),
        Version::V1_8_4 => committed!("v1.8.4", "pod", tee),
        Version::V1_9_0 => committed!("v1.9.0", "pod", tee),
    };
    serde_json::from_str(text).unwrap_or(Value::Null)
}

/// `version`'s committed VMI of kind `tee` (as virt-api stores it) as JSON.
pub fn vmi_value_of(version: Version, tee: Tee) -> Value {
    let text = match version {
        Version::V1_7_4 => committed!("v1.7.4", "vmi", tee),
        Version::V1_8_4 => committed!("v1.8.4", "vmi", tee),
        Version::V1_9_0 => committed!("v1.9.0", "vmi", tee),
    };
    serde_json::from_str(text).unwrap_or(Value::Null)
}

/// `version`'s committed launcher pod of kind `tee`.
pub fn launcher_pod_of(version: Version, tee: Tee) -> Pod {
    serde_json::from_value(launcher_pod_value_of(version, tee)).unwrap_or_default()
}

/// v1.9.0's committed launcher pod of kind `tee` (one of [`KINDS`]) as JSON.
pub fn launcher_pod_value(tee: Tee) -> Value {
    launcher_pod_value_of(Version::V1_9_0, tee)
}

/// v1.9.0's committed launcher pod of kind `tee`.
pub fn launcher_pod(tee: Tee) -> Pod {
    launcher_pod_of(Version::V1_9_0, tee)
}

/// v1.9.0's committed VMI of kind `tee` (as virt-api stores it) as JSON.
pub fn vmi_value(tee: Tee) -> Value {
    vmi_value_of(Version::V1_9_0, tee)
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

/// Render each sample VMI of [`KINDS`] with the running KubeVirt (`kv`: its virt-api stand-in defaults
/// the VMI, its virt-controller renders the pod, which stays unscheduled while no node is labelled for
/// it) in `namespace`, compare both objects with `kv`'s release's committed files, and delete the VMIs.
/// `Err` lists every drifted file with what KubeVirt renders; with [`crate::fixtures::regenerate`] the files are
/// rewritten instead.
pub async fn compare_with_committed(
    kv: &super::KubeVirt,
    cluster: &crate::realcluster::Cluster,
    namespace: &str,
) -> Result<(), String> {
    use std::time::Duration;

    use k8s_openapi::api::core::v1::Pod;
    use kube::Api;
    use kube::api::ListParams;

    use super::vmis::{self, Size};
    use crate::fixtures::{Vmi, regenerate, to_pretty_json};

    let version = kv.version;
    let files = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(dir(version));
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), namespace);
    let vmi_api = vmis::api(&cluster.client, namespace, "VirtualMachineInstance");
    let mut problems = Vec::new();
    for tee in KINDS {
        let name = vmi_name(tee);
        let created = vmis::create(
            &cluster.client,
            namespace,
            &vmis::vmi(&name, tee, Size::SAMPLE),
        )
        .await
        .map_err(|e| format!("KubeVirt {version}: create VMI {name}: {e}"))?;
        let real = created.metadata.uid.clone().unwrap_or_default();
        let fixture = Vmi::new(&name).namespace(namespace).uid();
        let pod = cluster
            .wait_for_within(
                &format!("KubeVirt {version}'s pod for {name}"),
                Duration::from_secs(60),
                || async {
                    pods.list(
                        &ListParams::default().labels(&format!("kubevirt.io/created-by={real}")),
                    )
                    .await
                    .ok()?
                    .items
                    .into_iter()
                    .next()
                },
            )
            .await
            .map_err(|e| format!("{e}\n{}", kv.log()))?;
        let stored = vmi_api
            .get(&name)
            .await
            .map_err(|e| format!("KubeVirt {version}: get VMI {name}: {e}"))?;
        let pod = normalise(
            serde_json::to_value(&pod).unwrap_or_default(),
            &real,
            &fixture,
        );
        let vmi = normalise(
            serde_json::to_value(&stored).unwrap_or_default(),
            &real,
            &fixture,
        );
        vmi_api
            .delete(&name, &Default::default())
            .await
            .map_err(|e| format!("KubeVirt {version}: delete VMI {name}: {e}"))?;
        for (file, value, committed) in [
            (
                format!("{}-pod.json", tee.slug()),
                &pod,
                launcher_pod_value_of(version, tee),
            ),
            (
                format!("{}-vmi.json", tee.slug()),
                &vmi,
                vmi_value_of(version, tee),
            ),
        ] {
            if *value == committed {
                continue;
            }
            if regenerate() {
                std::fs::create_dir_all(&files)
                    .and_then(|()| std::fs::write(files.join(&file), to_pretty_json(value)))
                    .map_err(|e| format!("write {}: {e}", files.join(&file).display()))?;
            } else {
                problems.push(format!(
                    "{}/{file}: virt-controller {version} renders\n{}",
                    dir(version),
                    to_pretty_json(value)
                ));
            }
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "KubeVirt {version} renders other objects than the committed ones (run \
             scripts/kubevirt-fixtures.sh):\n{}",
            problems.join("\n")
        ))
    }
}
