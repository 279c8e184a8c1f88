//! What the kernel tests share (`tests/tests/kernel_*.rs`): booting a guest of the tee-vm kit
//! (`teeguard_tests::teevm`), pods as the agent reads them, pod-shaped cgroups in the kubelet's two
//! layouts with "VMs" in their containers, and the kernel's own figures to hold the agent's against.

#![allow(dead_code)]

pub mod agent;

use std::time::Duration;

use serde_json::{Value, json};
use teeguard_tests::Result;
use teeguard_tests::host::{CgroupDriver, ContainerRuntime, KubeletNames, QosClass, container_id};
use teeguard_tests::teevm::shell::{misc_lines, misc_value};
use teeguard_tests::teevm::{AGENT, Guest, GuestOptions, Kernel, Kit};

/// The Node name the guest's agent reports for.
pub const NODE: &str = "tee-vm";
/// Plain SEV ASIDs (`sev`).
pub const ASIDS: &str = "sev.amd.com/asids";
/// SEV-ES/SNP ASIDs (`sev_es`).
pub const ESIDS: &str = "sev-snp.amd.com/esids";
/// The longest one kernel test may take (boots under TCG on a busy 2-core machine included).
pub const DEADLINE: Duration = Duration::from_secs(600);

/// The kubelet's cgroupfs layout with containerd's container names, and its systemd layout with
/// CRI-O's: both driver layouts and both runtimes' names.
pub const LAYOUTS: [KubeletNames; 2] = [
    KubeletNames {
        driver: CgroupDriver::Cgroupfs,
        runtime: ContainerRuntime::Containerd,
    },
    KubeletNames {
        driver: CgroupDriver::Systemd,
        runtime: ContainerRuntime::CriO,
    },
];

/// Boot a guest of `kernel`; `None` (after one line) when the kit is missing and `CI` is not `true`.
pub async fn boot(kernel: Kernel, options: GuestOptions) -> Option<Guest> {
    let kit = Kit::get(kernel)?;
    let guest = Guest::boot(&kit, options)
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!(
        "tee-vm: {kernel} ({}) booted with {} in {:?}",
        kit.kver, guest.accel, guest.booted_in
    );
    Some(guest)
}

/// Unwrap a guest operation, with the guest's console tail on failure.
pub fn ok<T>(guest: &Guest, r: Result<T>) -> T {
    r.unwrap_or_else(|e| {
        panic!(
            "{e}\n----- console (last lines) -----\n{}",
            teeguard_tests::e2e::last_lines(&guest.console(), 20)
        )
    })
}

/// A pod bound to [`NODE`] as the API server would list it: one `compute` container requesting
/// `requests` (resource name, keys), in `phase`, with `labels`.
pub fn pod(
    namespace: &str,
    name: &str,
    uid: &str,
    phase: &str,
    requests: &[(&str, u64)],
    labels: &[(&str, &str)],
) -> Value {
    let quantities: serde_json::Map<String, Value> = requests
        .iter()
        .map(|(r, n)| ((*r).to_string(), json!(n.to_string())))
        .collect();
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| ((*k).to_string(), json!(v)))
        .collect();
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "labels": labels},
        "spec": {
            "nodeName": NODE,
            "containers": [{
                "name": "compute",
                "image": "busybox",
                "resources": {"requests": quantities.clone(), "limits": quantities}
            }]
        },
        "status": {"phase": phase}
    })
}

/// A UID of the form the API server gives (`n` makes it unique in a test).
pub fn uid(n: u32) -> String {
    format!("{n:08x}-7e57-4a11-8c9d-5eed0000{n:04x}")
}

/// A pod's cgroup and its `compute` container's, relative to the cgroup root.
#[derive(Clone, Debug)]
pub struct PodCgroup {
    /// The pod cgroup.
    pub pod: String,
    /// The `compute` container's cgroup.
    pub compute: String,
}

/// Create the cgroups of pod `uid` in `qos` as the kubelet (`names.driver`) and the runtime
/// (`names.runtime`) lay them out, the misc controller enabled down to the container.
pub async fn mkpod(guest: &Guest, names: KubeletNames, qos: QosClass, uid: &str) -> PodCgroup {
    let pod = names.pod(qos, uid);
    let compute = format!(
        "{pod}/{}",
        names.container_dir(&container_id(uid, "compute"))
    );
    ok(guest, guest.mkcgroup(&compute).await);
    PodCgroup { pod, compute }
}

/// A number from a misc file's text (0 when the kind has no line).
pub fn value(text: &str, kind: &str) -> u64 {
    misc_value(text, kind).unwrap_or(0)
}

/// The sum of `misc.current` of `kind` over the root's direct children: what a kernel without a root
/// `misc.current` shows of its usage.
pub async fn top_level_usage(guest: &Guest, kind: &str) -> u64 {
    let out = ok(
        guest,
        guest
            .sh("for d in /sys/fs/cgroup/*/; do [ -f \"$d/misc.current\" ] && cat \"$d/misc.current\"; done; true")
            .await,
    );
    misc_lines(&out)
        .into_iter()
        .filter(|(k, _)| k == kind)
        .filter_map(|(_, v)| v.parse::<u64>().ok())
        .sum()
}

/// `status.<kind>.<field>` of a report (or a scan's `status`) as a number; panics with the report.
pub fn figure(status: &Value, kind: &str, field: &str) -> u64 {
    let key = match kind {
        "sev" => "sev",
        "sev_es" => "sevEs",
        other => other,
    };
    status[key][field]
        .as_u64()
        .unwrap_or_else(|| panic!("no {key}.{field} in {status:#}"))
}

/// A condition of a report's status: `(status, reason, message)`.
pub fn condition(status: &Value, type_: &str) -> (String, String, String) {
    let c = status["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == type_))
        .unwrap_or_else(|| panic!("no condition {type_} in {status:#}"));
    let s = |f: &str| c[f].as_str().unwrap_or_default().to_string();
    (s("status"), s("reason"), s("message"))
}

/// `teeguard-agent scan -o json` in the guest on its `/sys/fs/cgroup`, with `pods` as the pods file.
pub async fn scan(guest: &Guest, pods: &[Value]) -> Value {
    let file = guest.share().join("pods.json");
    std::fs::write(&file, json!({"kind": "PodList", "items": pods}).to_string())
        .expect("write the pods file");
    let out = ok(
        guest,
        guest
            .run(&format!(
                "{AGENT} scan --cgroup-root /sys/fs/cgroup --pods /host/pods.json --node-name {NODE} -o json 2>/host/p/scan.err"
            ))
            .await,
    );
    assert_eq!(
        out.status,
        0,
        "teeguard-agent scan failed: {}\n{}",
        out.text,
        std::fs::read_to_string(guest.share().join("p/scan.err")).unwrap_or_default()
    );
    serde_json::from_str(&out.text)
        .unwrap_or_else(|e| panic!("scan output is not JSON ({e}): {}", out.text))
}
