//! `teeguard-webhook review` run as a binary on fixture files.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::{Value, json};
use teeguard_tests::fixtures::{self, Tee, VirtLauncherPod};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_teeguard-webhook"))
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).expect("write fixture");
    p
}

fn run(args: &[&std::ffi::OsStr]) -> Output {
    bin().arg("review").args(args).output().expect("run review")
}

fn stdout_json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "exit {:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

#[test]
fn reviews_an_admission_review_with_a_vmi() {
    let dir = tempfile::tempdir().expect("tempdir");
    let review = fixtures::pod_create(&fixtures::virt_launcher_pod(Tee::Tdx));
    let input = write(
        dir.path(),
        "review.json",
        &fixtures::to_pretty_json(&review),
    );
    // Multi-document VMI file: the pod's VMI and another.
    let vmis = write(
        dir.path(),
        "vmis.yaml",
        &format!(
            "{}---\n{}",
            fixtures::to_yaml(&fixtures::vmi(Tee::Tdx)),
            fixtures::to_yaml(&fixtures::vmi(Tee::Snp))
        ),
    );
    let out = run(&[
        input.as_os_str(),
        "--vmi".as_ref(),
        vmis.as_os_str(),
        "-o".as_ref(),
        "json".as_ref(),
    ]);
    let doc = stdout_json(&out);
    let resp = &doc["review"]["response"];
    assert_eq!(doc["review"]["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(resp["uid"], review["request"]["uid"]);
    assert_eq!(resp["allowed"], true);
    assert_eq!(resp["patchType"], "JSONPatch");
    assert!(resp["patch"].is_string(), "base64 patch: {resp}");
    assert!(doc["patch"].as_array().is_some_and(|p| !p.is_empty()));
    let pod: k8s_openapi::api::core::v1::Pod =
        serde_json::from_value(doc["patchedObject"].clone()).expect("patched pod");
    let compute = pod
        .spec
        .as_ref()
        .expect("spec")
        .containers
        .iter()
        .find(|c| c.name == "compute")
        .expect("compute");
    let res = compute.resources.as_ref().expect("resources");
    assert_eq!(
        res.requests.as_ref().expect("requests")["tdx.intel.com/keys"].0,
        "1"
    );
    assert_eq!(
        res.limits.as_ref().expect("limits")["tdx.intel.com/keys"].0,
        "1"
    );
    assert_eq!(
        pod.metadata.annotations.expect("annotations")["misc-max.teeguard.dev/compute"],
        "tdx 1"
    );
}

#[test]
fn bare_pod_yaml_output_config_namespace_and_tee_capacity() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pod = VirtLauncherPod::for_tee("snp-vm", Tee::Snp).build();
    let input = write(
        dir.path(),
        "pod.yaml",
        &fixtures::to_yaml(&fixtures::to_value(&pod)),
    );
    let vmi = write(
        dir.path(),
        "vmi.yaml",
        &fixtures::to_yaml(&fixtures::vmi(Tee::Snp)),
    );
    let config = write(
        dir.path(),
        "config.yaml",
        "enforcement:\n  crioAnnotation: current\n",
    );
    let cap = write(
        dir.path(),
        "cap.yaml",
        "apiVersion: teeguard.dev/v1alpha1\nkind: TeeCapacity\nmetadata:\n  name: node01\nspec:\n  nodeName: node01\n",
    );
    let out = run(&[
        input.as_os_str(),
        "--vmi".as_ref(),
        vmi.as_os_str(),
        "--config".as_ref(),
        config.as_os_str(),
        "--tee-capacity".as_ref(),
        cap.as_os_str(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: Value = serde_yaml::from_slice(&out.stdout).expect("YAML output");
    assert_eq!(doc["review"]["response"]["allowed"], true);
    assert_eq!(
        doc["patchedObject"]["metadata"]["annotations"]["unified-cgroup.crio.io/compute"],
        "misc.max=sev_es 1"
    );
    assert_eq!(
        doc["patchedObject"]["spec"]["containers"][0]["resources"]["limits"]["sev-snp.amd.com/esids"],
        "1"
    );

    // The same pod in a namespace labelled exempt: left alone.
    let ns = write(
        dir.path(),
        "ns.yaml",
        &fixtures::to_yaml(&json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "default", "labels": {"teeguard.dev/exempt": "true"}}
        })),
    );
    let out = run(&[
        input.as_os_str(),
        "--vmi".as_ref(),
        vmi.as_os_str(),
        "--namespace-file".as_ref(),
        ns.as_os_str(),
        "-o".as_ref(),
        "json".as_ref(),
    ]);
    let doc = stdout_json(&out);
    assert_eq!(doc["review"]["response"]["allowed"], true);
    assert_eq!(
        doc["review"]["response"]["auditAnnotations"]["reason"],
        "exempt-namespace"
    );
    assert!(doc.get("patch").is_none());
    assert_eq!(doc["patchedObject"], fixtures::to_value(&pod));
}

#[test]
fn missing_vmi_is_a_denial_not_an_error() {
    let dir = tempfile::tempdir().expect("tempdir");
    let input = write(
        dir.path(),
        "review.json",
        &fixtures::to_pretty_json(&fixtures::pod_create(&fixtures::virt_launcher_pod(
            Tee::Tdx,
        ))),
    );
    let doc = stdout_json(&run(&[input.as_os_str(), "-o".as_ref(), "json".as_ref()]));
    assert_eq!(doc["review"]["response"]["allowed"], false);
    assert!(
        doc["review"]["response"]["status"]["message"]
            .as_str()
            .expect("message")
            .contains("not found yet")
    );
    assert!(doc.get("patchedObject").is_none());
}

#[test]
fn bad_input_files_are_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let review = write(
        dir.path(),
        "review.json",
        &fixtures::to_pretty_json(&fixtures::pod_create(&fixtures::virt_launcher_pod(
            Tee::Tdx,
        ))),
    );
    let pod_as_vmi = write(
        dir.path(),
        "wrong-kind.yaml",
        &fixtures::to_yaml(&fixtures::to_value(&fixtures::virt_launcher_pod(Tee::Tdx))),
    );
    let broken = write(dir.path(), "broken.yaml", "kind: [unclosed\n");
    let bad_cap = write(
        dir.path(),
        "bad-cap.yaml",
        "apiVersion: teeguard.dev/v1alpha1\nkind: TeeCapacity\nmetadata:\n  name: n\nspec:\n  nodeName: 7\n",
    );
    let bad_config = write(
        dir.path(),
        "config.yaml",
        "enforcement:\n  crioAnnotation: sometimes\n",
    );
    let missing = dir.path().join("nope.json");
    let deployment = write(
        dir.path(),
        "deploy.yaml",
        "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: d\n",
    );
    let cases: Vec<(Vec<&std::ffi::OsStr>, &Path, &str)> = vec![
        (vec![missing.as_os_str()], &missing, "cannot read"),
        (vec![broken.as_os_str()], &broken, "invalid YAML"),
        (
            vec![deployment.as_os_str()],
            &deployment,
            "expected an AdmissionReview or a Pod",
        ),
        (
            vec![review.as_os_str(), "--vmi".as_ref(), pod_as_vmi.as_os_str()],
            &pod_as_vmi,
            "expected VirtualMachineInstance",
        ),
        (
            vec![review.as_os_str(), "--vmi".as_ref(), broken.as_os_str()],
            &broken,
            "invalid YAML",
        ),
        (
            vec![
                review.as_os_str(),
                "--tee-capacity".as_ref(),
                bad_cap.as_os_str(),
            ],
            &bad_cap,
            "not a valid TeeCapacity",
        ),
        (
            vec![
                review.as_os_str(),
                "--config".as_ref(),
                bad_config.as_os_str(),
            ],
            &bad_config,
            "enforcement.crioAnnotation",
        ),
    ];
    for (args, file, want) in cases {
        let out = run(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
        assert!(
            stderr.contains(&file.display().to_string()) && stderr.contains(want),
            "{args:?}: expected {file:?} and {want:?} in {stderr}"
        );
    }
}

/// The committed sample files of the test kit (`tests/fixtures/`), each reviewed with every sample VMI.
#[test]
fn committed_sample_files() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    let mut vmi_args: Vec<std::ffi::OsString> = Vec::new();
    for entry in std::fs::read_dir(root.join("vmis")).expect("vmis dir") {
        vmi_args.push("--vmi".into());
        vmi_args.push(entry.expect("entry").path().into_os_string());
    }
    // (file, expected audit decision, expected reason or key resource)
    let cases = [
        ("mutate-tdx-pod", "patched", "tdx.intel.com/keys"),
        ("mutate-sev-pod", "patched", "sev.amd.com/asids"),
        ("mutate-sev-es-pod", "patched", "sev-snp.amd.com/esids"),
        ("mutate-snp-pod", "patched", "sev-snp.amd.com/esids"),
        ("mutate-tdx-pod-dry-run", "patched", "tdx.intel.com/keys"),
        (
            "mutate-tdx-pod-with-node-name",
            "patched",
            "tdx.intel.com/keys",
        ),
        ("mutate-tdx-pod-with-keys", "patched", "tdx.intel.com/keys"),
        (
            "mutate-tdx-migration-target-pod",
            "patched",
            "tdx.intel.com/keys",
        ),
        ("mutate-plain-pod", "skipped", "not-tee"),
        ("mutate-tdx-pod-exempt", "skipped", "exempt-pod"),
        (
            "mutate-storage-binding-pod",
            "skipped",
            "storage-binding-pod",
        ),
        ("mutate-hotplug-pod", "skipped", "hotplug-pod"),
        ("mutate-export-pod", "skipped", "export-pod"),
        ("mutate-kata-tdx-pod", "skipped", "not-kubevirt"),
        ("mutate-kata-snp-pod", "skipped", "not-kubevirt"),
        ("validate-binding", "skipped", "not-pod-create"),
        ("validate-pod-update", "skipped", "not-pod-create"),
        ("validate-pod-delete", "skipped", "not-pod-create"),
    ];
    for (name, decision, detail) in cases {
        let file = root.join(format!("admission/{name}.json"));
        let mut args: Vec<&std::ffi::OsStr> =
            vec![file.as_os_str(), "-o".as_ref(), "json".as_ref()];
        args.extend(vmi_args.iter().map(|a| a.as_os_str()));
        let doc = stdout_json(&run(&args));
        let resp = &doc["review"]["response"];
        assert_eq!(resp["allowed"], true, "{name}: {resp}");
        assert_eq!(
            resp["auditAnnotations"]["decision"], decision,
            "{name}: {resp}"
        );
        if decision == "patched" {
            assert_eq!(resp["auditAnnotations"]["resource"], detail, "{name}");
            let compute = doc["patchedObject"]["spec"]["containers"]
                .as_array()
                .expect("containers")
                .iter()
                .find(|c| c["name"] == "compute")
                .expect("compute")
                .clone();
            assert_eq!(compute["resources"]["requests"][detail], "1", "{name}");
            assert_eq!(compute["resources"]["limits"][detail], "1", "{name}");
        } else {
            assert_eq!(resp["auditAnnotations"]["reason"], detail, "{name}");
            assert!(doc.get("patch").is_none(), "{name}");
        }
    }
}

/// With reports (and nodes, pods) the validating response is printed too, from the same code path.
#[test]
fn validates_with_reports_nodes_and_pods() {
    let dir = tempfile::tempdir().expect("tempdir");
    let report = |name: &str, free: u64| {
        fixtures::to_yaml(&json!({
            "apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeCapacity",
            "metadata": {"name": name}, "spec": {"nodeName": name},
            "status": {
                "heartbeatTime": jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
                "tdx": {"resourceName": "tdx.intel.com/keys", "capacity": 31, "kernelUsed": 31 - free,
                    "podsUsed": 28 - free, "external": 3, "pending": 0, "free": free}
            }
        }))
    };
    let full = write(dir.path(), "full.yaml", &report("node-a", 0));
    let vmi = write(
        dir.path(),
        "vmi.yaml",
        &fixtures::to_yaml(&fixtures::vmi(Tee::Tdx)),
    );
    let named = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx).generated_name();
    let input = write(
        dir.path(),
        "create.json",
        &fixtures::to_pretty_json(&fixtures::pod_create(&named.build())),
    );

    // Pod CREATE: mutated, then validated against the reports (every reported node is a candidate).
    let doc = stdout_json(&run(&[
        input.as_os_str(),
        "--vmi".as_ref(),
        vmi.as_os_str(),
        "--tee-capacity".as_ref(),
        full.as_os_str(),
        "-o".as_ref(),
        "json".as_ref(),
    ]));
    assert_eq!(doc["review"]["response"]["allowed"], true);
    let v = &doc["validation"]["response"];
    assert_eq!(v["allowed"], false, "{doc}");
    assert_eq!(v["auditAnnotations"]["reason"], "insufficient-keys");
    assert_eq!(
        v["status"]["message"],
        "no node can host this TDX VM: node-a 0/31 free (3 held outside Kubernetes); free a key or add \
         capacity; `kubectl get teecapacities` shows free keys per node; teeguard starts this VM by \
         itself as soon as a key is free for it"
    );

    // With Node files, labels decide the candidates: a node without the TDX label is no candidate.
    let plain_node = write(
        dir.path(),
        "node.yaml",
        &fixtures::to_yaml(&fixtures::to_value(&fixtures::node("node-a"))),
    );
    let doc = stdout_json(&run(&[
        input.as_os_str(),
        "--vmi".as_ref(),
        vmi.as_os_str(),
        "--tee-capacity".as_ref(),
        full.as_os_str(),
        "--node".as_ref(),
        plain_node.as_os_str(),
        "-o".as_ref(),
        "json".as_ref(),
    ]));
    assert_eq!(
        doc["validation"]["response"]["auditAnnotations"]["reason"],
        "no-candidate-nodes"
    );

    // A binding, with the pod from a file: admitted on a node with a free key.
    let free = write(dir.path(), "free.yaml", &report("node-b", 1));
    let pod_file = write(
        dir.path(),
        "pod.yaml",
        &fixtures::to_yaml(&fixtures::to_value(
            &named.clone().request("tdx.intel.com/keys", "1").build(),
        )),
    );
    let bind = write(
        dir.path(),
        "bind.json",
        &fixtures::to_pretty_json(&fixtures::binding_create(&named.build(), "node-b")),
    );
    let doc = stdout_json(&run(&[
        bind.as_os_str(),
        "--pod".as_ref(),
        pod_file.as_os_str(),
        "--tee-capacity".as_ref(),
        free.as_os_str(),
        "-o".as_ref(),
        "json".as_ref(),
    ]));
    assert_eq!(
        doc["review"]["response"]["auditAnnotations"]["reason"],
        "not-pod-create"
    );
    let v = &doc["validation"]["response"];
    assert_eq!(v["allowed"], true, "{doc}");
    assert_eq!(v["auditAnnotations"]["reason"], "enough-keys");
    assert_eq!(v["auditAnnotations"]["node"], "node-b");

    // Without report, node or pod files there is no validating response.
    let doc = stdout_json(&run(&[
        input.as_os_str(),
        "--vmi".as_ref(),
        vmi.as_os_str(),
        "-o".as_ref(),
        "json".as_ref(),
    ]));
    assert!(doc.get("validation").is_none());
}
