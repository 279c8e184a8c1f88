//! `teeguard-agent scan` as a binary on a simulated host: table, JSON and YAML output, pods files,
//! exit codes.

use std::process::{Command, Output};

use serde_json::{Value, json};
use teeguard_tests::host::{QosClass, SimHost, TDX};

const BIN: &str = env!("CARGO_BIN_EXE_teeguard-agent");
const VM1: &str = "0f5a3c1e-8a8b-4c3e-9e59-1d2f3a4b5c6d";
const VM2: &str = "1f5a3c1e-8a8b-4c3e-9e59-1d2f3a4b5c6d";

fn scan(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("scan")
        .args(args)
        .env_remove("NODE_NAME")
        .env_remove("TEEGUARD_CONFIG")
        .env_remove("TEEGUARD_CGROUP_ROOT")
        .output()
        .expect("run teeguard-agent")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn host() -> SimHost {
    let host = SimHost::builder().capacity(TDX, 16).build().expect("host");
    for uid in [VM1, VM2] {
        host.add_pod(uid, QosClass::Burstable, &["compute"])
            .expect("pod");
        host.start_vm(uid, "compute", TDX).expect("vm");
    }
    host.add_external("outside", TDX, 2).expect("external");
    host
}

fn pods_file(dir: &std::path::Path) -> std::path::PathBuf {
    let pod = |name: &str, uid: &str, phase: &str| {
        json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "vms", "uid": uid},
            "spec": {"nodeName": "node01", "containers": [{"name": "compute", "resources": {"requests": {"tdx.intel.com/keys": "1"}}}]},
            "status": {"phase": phase}
        })
    };
    let list = json!({"apiVersion": "v1", "kind": "PodList", "items": [
        pod("virt-launcher-a", VM1, "Running"),
        pod("virt-launcher-b", VM2, "Running"),
        pod("virt-launcher-c", "2f5a3c1e-8a8b-4c3e-9e59-1d2f3a4b5c6d", "Pending"),
    ]});
    let path = dir.join("pods.json");
    std::fs::write(&path, serde_json::to_string_pretty(&list).expect("json")).expect("write");
    path
}

#[test]
fn table_output() {
    let host = host();
    let dir = tempfile::tempdir().expect("tempdir");
    let pods = pods_file(dir.path());
    let root = host.root().display().to_string();
    let out = scan(&[
        "--cgroup-root",
        &root,
        "--pods",
        &pods.display().to_string(),
    ]);
    assert!(out.status.success(), "{out:?}");
    let text = stdout(&out);
    let row = text
        .lines()
        .find(|l| l.starts_with("tdx "))
        .unwrap_or_else(|| panic!("no tdx row in\n{text}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    // KIND RESOURCE CAPACITY USED PODS EXTERNAL PENDING FREE ADVERTISE REFUSED
    assert_eq!(
        cols,
        [
            "tdx",
            "tdx.intel.com/keys",
            "16",
            "4",
            "2",
            "2",
            "1",
            "11",
            "14",
            "-"
        ],
        "\n{text}"
    );
    assert!(text.contains("cgroup v2"), "{text}");
    assert!(text.contains("systemd driver"), "{text}");
    assert!(text.contains("vms/virt-launcher-a"), "{text}");
    assert!(text.contains("KernelReadable"), "{text}");
    assert!(text.contains("MiscControllerDelegated"), "{text}");
}

#[test]
fn json_and_yaml_output() {
    let host = host();
    let root = host.root().display().to_string();
    let out = scan(&["--cgroup-root", &root, "-o", "json"]);
    assert!(out.status.success(), "{out:?}");
    let v: Value = serde_json::from_str(&stdout(&out)).expect("valid JSON");
    let tdx = &v["status"]["tdx"];
    // Without pods, every key is external.
    assert_eq!(tdx["capacity"], 16);
    assert_eq!(tdx["kernelUsed"], 4);
    assert_eq!(tdx["podsUsed"], 0);
    assert_eq!(tdx["external"], 4);
    assert_eq!(tdx["free"], 12);
    assert_eq!(v["cgroupVersion"], "v2");
    assert_eq!(v["driver"], "systemd");
    let holds: Vec<&Value> = v["pods"]
        .as_array()
        .expect("pods")
        .iter()
        .map(|p| &p["holds"]["tdx"])
        .collect();
    assert_eq!(holds, [&json!(1), &json!(1)], "{v:#}");

    let out = scan(&["--cgroup-root", &root, "--output", "yaml"]);
    assert!(out.status.success(), "{out:?}");
    let y: serde_yaml::Value = serde_yaml::from_str(&stdout(&out)).expect("valid YAML");
    assert_eq!(y["status"]["tdx"]["external"], serde_yaml::Value::from(4));
}

#[test]
fn broken_host_exits_nonzero_but_still_reports() {
    let host = host();
    host.write_garbage("misc.current").expect("garbage");
    let root = host.root().display().to_string();
    let out = scan(&["--cgroup-root", &root, "-o", "json"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let v: Value = serde_json::from_str(&stdout(&out)).expect("valid JSON");
    let kr = v["status"]["conditions"]
        .as_array()
        .expect("conditions")
        .iter()
        .find(|c| c["type"] == "KernelReadable")
        .expect("KernelReadable");
    assert_eq!(kr["status"], "False");
    assert!(
        kr["message"]
            .as_str()
            .expect("msg")
            .contains("misc.current"),
        "{kr}"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("scan failed"),
        "{out:?}"
    );
}

#[test]
fn no_controller_and_bad_arguments() {
    let empty = tempfile::tempdir().expect("tempdir");
    let out = scan(&["--cgroup-root", &empty.path().display().to_string()]);
    assert!(out.status.success(), "{out:?}");
    let text = stdout(&out);
    assert!(text.contains("no TEE key capacity"), "{text}");
    assert!(text.contains("NoTeeHardware"), "{text}");

    let out = scan(&["--pods", "/nonexistent/pods.yaml"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("pods file /nonexistent/pods.yaml"),
        "{out:?}"
    );

    let out = scan(&["-o", "xml"]);
    assert!(!out.status.success());

    let out = Command::new(BIN)
        .args(["run"])
        .env_remove("NODE_NAME")
        .output()
        .expect("run");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--node-name"),
        "{out:?}"
    );
}
