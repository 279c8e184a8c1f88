//! A container's OCI config as a real runtime wrote it (containerd or CRI-O on the real node,
//! `crate::node`'s `runc-record`), made runnable by the kit's runc in a guest, everything the kernel
//! enforces unchanged: `linux.resources` (with `unified["misc.max"]`), `linux.cgroupsPath`, the
//! namespaces' types, the process's user, capabilities and limits, seccomp, masked and read-only paths.
//!
//! What cannot carry over is replaced: the root is the guest's small busybox tree; the process is the
//! "VM" (`holdkeys`); bind mounts of the node's files (`/etc/hosts`, the kubelet's volumes) and the
//! paths of namespaces the sandbox holds on the node go (a new namespace of each type instead); hooks,
//! AppArmor and SELinux labels go (the guest has neither). `/dev/fake_tee` is handed in the way a
//! device plugin hands `/dev/kvm` to KubeVirt's `compute` container: a device node and a cgroup device
//! rule. A kind the guest's kernel does not know (`tdx`: neither Debian kernel has the type) is mapped
//! to one it does.

use serde_json::{Value, json};

/// The kinds of a `misc.max` value mapped for a kernel without them (`tdx 1` → `sev 1`).
pub fn map_kinds(misc_max: &str, map: &[(&str, &str)]) -> String {
    let mut parts = misc_max.splitn(2, ' ');
    let kind = parts.next().unwrap_or("");
    let rest = parts.next().unwrap_or("");
    let kind = map
        .iter()
        .find(|(from, _)| *from == kind)
        .map_or(kind, |(_, to)| to);
    format!("{kind} {rest}")
}

/// `recorded` made runnable in a guest (see the module documentation): the process asks for `keys`
/// keys of `kind` and keeps them; `fake_tee_minor` is the device's minor number in the guest
/// (`/sys/class/misc/fake_tee/dev`); kinds in `map` are renamed in `unified["misc.max"]`.
pub fn runnable_in_guest(
    recorded: &Value,
    kind: &str,
    keys: u32,
    fake_tee_minor: u32,
    map: &[(&str, &str)],
) -> Value {
    let mut c = recorded.clone();
    let get = |v: &Value, p: &str| v.pointer(p).cloned();
    let mut process = json!({
        "terminal": false,
        "args": ["/bin/holdkeys", kind, keys.to_string(), "hold"],
        "env": ["PATH=/bin"],
        "cwd": "/",
    });
    for field in [
        "user",
        "capabilities",
        "rlimits",
        "noNewPrivileges",
        "oomScoreAdj",
    ] {
        if let Some(v) = get(recorded, &format!("/process/{field}")) {
            process[field] = v;
        }
    }
    c["process"] = process;
    c["root"] = json!({"path": "rootfs", "readonly": get(recorded, "/root/readonly").unwrap_or(json!(false))});
    let mounts: Vec<Value> = recorded["mounts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| {
            let bind = m["type"] == "bind"
                || m["options"]
                    .as_array()
                    .is_some_and(|o| o.iter().any(|x| x == "bind" || x == "rbind"));
            !bind
        })
        .cloned()
        .collect();
    c["mounts"] = json!(mounts);
    if let Some(o) = c.as_object_mut() {
        o.remove("hooks");
    }
    let linux = c
        .get_mut("linux")
        .and_then(Value::as_object_mut)
        .expect("an OCI config has linux");
    linux.remove("mountLabel");
    let namespaces: Vec<Value> = linux
        .get("namespaces")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|n| n.get("type").cloned())
        .map(|t| json!({"type": t}))
        .collect();
    linux.insert("namespaces".into(), json!(namespaces));
    linux.insert(
        "devices".into(),
        json!([{"path": "/dev/fake_tee", "type": "c", "major": 10, "minor": fake_tee_minor,
                "fileMode": 438, "uid": 0, "gid": 0}]),
    );
    let resources = linux
        .entry("resources")
        .or_insert_with(|| json!({}))
        .as_object_mut()
        .expect("resources is an object");
    let mut devices: Vec<Value> = resources
        .get("devices")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    devices.push(
        json!({"allow": true, "type": "c", "major": 10, "minor": fake_tee_minor, "access": "rw"}),
    );
    resources.insert("devices".into(), json!(devices));
    if let Some(value) = resources
        .get_mut("unified")
        .and_then(|u| u.get_mut("misc.max"))
    {
        let mapped = map_kinds(value.as_str().unwrap_or(""), map);
        *value = json!(mapped);
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recorded_config_keeps_its_cgroup_resources_and_loses_the_nodes_files() {
        let recorded = json!({
            "ociVersion": "1.2.1",
            "process": {"args": ["/bin/sleep", "3600"], "user": {"uid": 0, "gid": 0},
                        "apparmorProfile": "cri-containerd.apparmor.d", "noNewPrivileges": true},
            "root": {"path": "/run/containerd/.../rootfs"},
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/etc/hosts", "type": "bind", "source": "/var/lib/kubelet/pods/x/etc-hosts",
                 "options": ["rbind", "rprivate", "rw"]},
            ],
            "hooks": {"createRuntime": [{"path": "/bin/true"}]},
            "linux": {
                "cgroupsPath": "/kubepods/besteffort/pod1/abc",
                "namespaces": [{"type": "pid"}, {"type": "network", "path": "/proc/42/ns/net"}],
                "resources": {"devices": [{"allow": false, "access": "rwm"}],
                              "unified": {"misc.max": "tdx 1"}}
            }
        });
        let c = runnable_in_guest(&recorded, "sev", 2, 60, &[("tdx", "sev")]);
        assert_eq!(
            c["process"]["args"],
            json!(["/bin/holdkeys", "sev", "2", "hold"])
        );
        assert_eq!(c["process"]["noNewPrivileges"], json!(true));
        assert!(c["process"].get("apparmorProfile").is_none());
        assert_eq!(c["linux"]["cgroupsPath"], "/kubepods/besteffort/pod1/abc");
        assert_eq!(c["linux"]["resources"]["unified"]["misc.max"], "sev 1");
        assert_eq!(
            c["linux"]["namespaces"],
            json!([{"type": "pid"}, {"type": "network"}])
        );
        assert_eq!(c["mounts"].as_array().map(Vec::len), Some(1));
        assert!(c.get("hooks").is_none());
        assert_eq!(
            c["linux"]["resources"]["devices"][1],
            json!({"allow": true, "type": "c", "major": 10, "minor": 60, "access": "rw"})
        );
        assert_eq!(map_kinds("sev_es 1", &[("tdx", "sev")]), "sev_es 1");
    }
}
