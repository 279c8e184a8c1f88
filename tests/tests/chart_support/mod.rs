//! Shared helpers of the Helm chart tests (`tests/tests/chart_*.rs`): run the real `helm` and
//! `kubernetes-validate` binaries that `scripts/chart-tools.sh` installs, and pick objects out of the
//! rendered manifests.

#![allow(dead_code)] // each chart test binary uses a different subset

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;
use serde_json::Value;
use teeguard_tests::controlplane::ControlPlane;
use teeguard_tests::e2e::{ProcessEnv, WebhookProcess};
use teeguard_tests::realcluster::Cluster;

/// Release name every test renders with.
pub const RELEASE: &str = "teeguard";
/// Release namespace every test renders into.
pub const NAMESPACE: &str = "teeguard";
/// Kubernetes version the manifests are rendered for and validated against.
pub const KUBE_VERSION: &str = "1.33.0";
/// Kubernetes version DRA mode (`config.agent.accounting: dra`) is rendered for and validated against:
/// its DeviceClasses are `resource.k8s.io/v1` (1.34 on) with `extendedResourceName` (on by default from
/// 1.36, the version of the real control plane and kubelet the DRA tests run).
pub const DRA_KUBE_VERSION: &str = "1.36.0";
/// The value sets under `tests/chart/`, by file stem.
pub const VALUES_FILES: [&str; 6] = [
    "default",
    "cert-manager",
    "user-certs",
    "existing-secret",
    "advertising-disabled",
    "custom",
];

/// Start a webhook process of `env`, register the default chart's webhook configurations for `test`
/// pointing at it, and wait until the API server calls it in the test's namespace `ns`.
pub async fn serve_default_webhooks(
    cluster: &Cluster,
    env: &ProcessEnv,
    test: &str,
    ns: &str,
) -> WebhookProcess {
    let webhook = env.start_webhook(&[]).await.expect("webhook starts");
    let rendered = render("default", &[]);
    cluster
        .serve_webhooks(
            test,
            ns,
            &rendered,
            webhook.https,
            &env.ca.ca_bundle_base64(),
        )
        .await
        .expect("the API server calls the webhooks");
    webhook
}

/// `kubernetes-validate --strict` of the manifests in `path` against Kubernetes `kube_version`'s
/// schemas.
pub fn kubernetes_validate_file(kube_version: &str, path: &Path) -> Run {
    run(
        &kubernetes_validate(),
        &[
            "--strict".into(),
            "--kubernetes-version".into(),
            kube_version.into(),
            path.display().to_string(),
        ],
    )
}

/// `helm lint --strict` of the chart for Kubernetes `kube_version` with `tests/chart/<stem>.yaml`;
/// panics with helm's output when it fails.
pub fn assert_lints(kube_version: &str, stem: &str) {
    let args: Vec<String> = vec![
        "lint".into(),
        "--strict".into(),
        chart_dir().display().to_string(),
        "--namespace".into(),
        NAMESPACE.into(),
        "--kube-version".into(),
        kube_version.into(),
        "--values".into(),
        values_file(stem).display().to_string(),
    ];
    let out = run(&helm(), &args);
    assert!(
        out.success,
        "helm lint --strict with tests/chart/{stem}.yaml failed:\n{}{}",
        out.stdout, out.stderr
    );
}

/// The CEL expressions of a ValidatingAdmissionPolicy's `validations`, in order.
pub fn validation_expressions(policy: &Value) -> Vec<&str> {
    policy["spec"]["validations"]
        .as_array()
        .expect("validations")
        .iter()
        .map(|v| str_at(v, "/expression"))
        .collect()
}

/// `v[field]`, an array of strings (panics, naming `v`, when it is not).
pub fn strings(v: &Value, field: &str) -> Vec<String> {
    v[field]
        .as_array()
        .unwrap_or_else(|| panic!("no array {field} in {v}"))
        .iter()
        .map(|s| {
            s.as_str()
                .unwrap_or_else(|| panic!("{field}: {s} is not a string"))
                .to_string()
        })
        .collect()
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// `charts/teeguard`.
pub fn chart_dir() -> PathBuf {
    repo_root().join("charts").join("teeguard")
}

/// `tests/chart/<stem>.yaml`.
pub fn values_file(stem: &str) -> PathBuf {
    repo_root()
        .join("tests")
        .join("chart")
        .join(format!("{stem}.yaml"))
}

fn tool(var: &str, what: &str) -> PathBuf {
    let Some(path) = std::env::var_os(var) else {
        panic!(
            "{var} is not set: the chart tests need {what}. Run scripts/test.sh, which installs helm and \
             kubernetes-validate into ./.tools, or `source scripts/chart-tools.sh` before cargo test."
        );
    };
    let path = PathBuf::from(path);
    assert!(
        path.is_file(),
        "{var}={} does not exist: re-run `source scripts/chart-tools.sh` (scripts/test.sh does)",
        path.display()
    );
    path
}

/// The helm binary (`TEEGUARD_HELM`); panics with instructions when it is not set.
pub fn helm() -> PathBuf {
    tool("TEEGUARD_HELM", "a real helm binary")
}

/// The kubernetes-validate binary (`TEEGUARD_KUBERNETES_VALIDATE`); panics with instructions when unset.
pub fn kubernetes_validate() -> PathBuf {
    tool("TEEGUARD_KUBERNETES_VALIDATE", "kubernetes-validate (PyPI)")
}

/// Output of one tool run.
#[derive(Debug)]
pub struct Run {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Run a tool with arguments, in the repository root, with a private HOME-like cache so helm writes
/// nothing outside a temporary directory.
pub fn run(program: &Path, args: &[String]) -> Run {
    let scratch = tempfile::tempdir().expect("scratch dir for helm caches");
    let out = Command::new(program)
        .args(args)
        .current_dir(repo_root())
        .env("HELM_CACHE_HOME", scratch.path().join("cache"))
        .env("HELM_CONFIG_HOME", scratch.path().join("config"))
        .env("HELM_DATA_HOME", scratch.path().join("data"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    Run {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `helm ARGS --kubeconfig` against the real control plane `cp` (`install`, `upgrade`, `uninstall`,
/// `get manifest`): the one way the tests run helm on a cluster.
pub fn helm_on(cp: &ControlPlane, args: &[impl AsRef<str>]) -> Run {
    let mut all: Vec<String> = args.iter().map(|a| a.as_ref().to_string()).collect();
    all.extend(["--kubeconfig".into(), cp.kubeconfig.display().to_string()]);
    run(&helm(), &all)
}

/// `helm template` of the chart with the given values files and extra arguments.
pub fn helm_template(values: &[&str], extra: &[&str]) -> Run {
    helm_template_in(NAMESPACE, values, extra)
}

/// `helm template` into another namespace.
pub fn helm_template_in(namespace: &str, values: &[&str], extra: &[&str]) -> Run {
    helm_template_for(KUBE_VERSION, namespace, values, extra)
}

/// `helm template` for another Kubernetes version.
pub fn helm_template_for(
    kube_version: &str,
    namespace: &str,
    values: &[&str],
    extra: &[&str],
) -> Run {
    let mut args: Vec<String> = vec![
        "template".into(),
        RELEASE.into(),
        chart_dir().display().to_string(),
        "--namespace".into(),
        namespace.into(),
        "--kube-version".into(),
        kube_version.into(),
    ];
    for v in values {
        args.push("--values".into());
        args.push(values_file(v).display().to_string());
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    run(&helm(), &args)
}

/// Render the chart with one values file (and extra arguments) and parse every object.
pub fn render(values: &str, extra: &[&str]) -> Vec<Value> {
    render_for(KUBE_VERSION, values, extra)
}

/// [`render`] for another Kubernetes version.
pub fn render_for(kube_version: &str, values: &str, extra: &[&str]) -> Vec<Value> {
    let out = helm_template_for(kube_version, NAMESPACE, &[values], extra);
    assert!(
        out.success,
        "helm template (Kubernetes {kube_version}) with tests/chart/{values}.yaml {extra:?} failed:\n{}",
        out.stderr
    );
    parse_documents(&out.stdout)
}

/// Parse a multi-document YAML stream into JSON values, skipping empty documents.
pub fn parse_documents(text: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).expect("helm rendered valid YAML"))
        .filter(|v| !v.is_null())
        .collect()
}

/// Every object of a kind.
pub fn all<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

/// The one object of a kind and name; panics naming what was rendered when it is missing.
pub fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| {
            let rendered: Vec<String> = docs
                .iter()
                .map(|d| format!("{}/{}", d["kind"], d["metadata"]["name"]))
                .collect();
            panic!("no {kind} named {name} in the rendered chart; rendered: {rendered:?}")
        })
}

/// The one object of a kind; panics when there is none or more than one.
pub fn only<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    let found = all(docs, kind);
    assert_eq!(
        found.len(),
        1,
        "expected exactly one {kind}, found {}",
        found.len()
    );
    found[0]
}

/// A string field, panicking with the path when it is absent.
pub fn str_at<'a>(v: &'a Value, pointer: &str) -> &'a str {
    v.pointer(pointer)
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no string at {pointer} in {v}"))
}

/// Decode a base64 field of a Secret or a webhook's caBundle.
pub fn b64(s: &str) -> Vec<u8> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(s)
        .unwrap_or_else(|e| panic!("not base64 ({e}): {s}"))
}

/// The DNS names the webhook's serving certificate must carry for a namespace.
pub fn service_dns_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        service.to_string(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// cert-manager's kinds are not in the Kubernetes schemas, and kubernetes-validate has no option to skip
/// unknown kinds (it only warns "Couldn't find schema" and passes). They are filtered out by callers,
/// explicitly, and checked field by field in chart_certs.rs instead; any other unknown kind fails
/// [`validate`].
pub fn is_cert_manager(doc: &Value) -> bool {
    doc["apiVersion"]
        .as_str()
        .is_some_and(|v| v.starts_with("cert-manager.io/"))
}

/// Check rendered objects with `kubernetes-validate --strict` against the Kubernetes schemas of
/// [`KUBE_VERSION`]; every object must have a schema and pass. `what` names the rendering in messages
/// (a values file stem, or the `--set` used).
pub fn validate(what: &str, docs: &[Value]) {
    validate_for(KUBE_VERSION, what, docs);
}

/// [`validate`] against the schemas of another Kubernetes version.
pub fn validate_for(kube_version: &str, what: &str, docs: &[Value]) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("manifests.yaml");
    let text: Vec<String> = docs
        .iter()
        .map(|d| serde_yaml::to_string(d).expect("serialise a manifest"))
        .collect();
    std::fs::write(&path, text.join("---\n")).expect("write manifests");
    let out = kubernetes_validate_file(kube_version, &path);
    let log = format!("{}{}", out.stdout, out.stderr);
    assert!(
        out.success,
        "kubernetes-validate --strict ({kube_version}) rejected the chart rendered with {what}:\n{log}"
    );
    // An unknown kind only gives a warning: make sure every object really was checked.
    assert!(
        !log.contains("Couldn't find schema"),
        "kubernetes-validate has no schema for an object rendered with {what} (add it to the explicit \
         exclusions only if it is a third-party CRD kind):\n{log}"
    );
    let passed = log.matches(" passed for resource ").count();
    assert_eq!(
        passed,
        docs.len(),
        "{what}: expected every one of the {} objects to pass:\n{log}",
        docs.len()
    );
}

/// The one container of a Deployment or DaemonSet.
pub fn container(workload: &Value) -> &Value {
    let containers = workload["spec"]["template"]["spec"]["containers"]
        .as_array()
        .expect("containers");
    assert_eq!(containers.len(), 1);
    &containers[0]
}

/// The workload runs as `uid` (and the same GID; 0 = root, allowed only with `runAsNonRoot: false`),
/// with every capability dropped, no privilege escalation, a read-only root filesystem, the
/// RuntimeDefault seccomp profile, no host network or PID namespace, probes on the admin port and
/// resource requests/limits.
pub fn assert_hardened(workload: &Value, uid: u64) {
    let pod = &workload["spec"]["template"]["spec"];
    let name = &workload["metadata"]["name"];
    let psc = &pod["securityContext"];
    assert_eq!(psc["runAsNonRoot"], uid != 0, "{name}");
    assert_eq!(psc["runAsUser"], uid, "{name}");
    assert_eq!(psc["runAsGroup"], uid, "{name}");
    if uid == 0 {
        assert!(
            psc.get("fsGroup").is_none(),
            "{name}: root needs no fsGroup"
        );
    } else {
        assert_eq!(psc["fsGroup"], uid, "{name}");
    }
    assert_eq!(psc["seccompProfile"]["type"], "RuntimeDefault", "{name}");
    let csc = &container(workload)["securityContext"];
    assert_eq!(csc["allowPrivilegeEscalation"], false, "{name}");
    assert_eq!(csc["readOnlyRootFilesystem"], true, "{name}");
    assert_eq!(csc["privileged"], false, "{name}");
    assert_eq!(
        csc["capabilities"]["drop"],
        serde_json::json!(["ALL"]),
        "{name}"
    );
    assert!(csc["capabilities"].get("add").is_none(), "{name}");
    assert!(
        csc.get("runAsUser").is_none() && csc.get("runAsNonRoot").is_none(),
        "{name}: the container must not override the pod's user"
    );
    assert!(
        pod.get("hostNetwork").is_none() && pod.get("hostPID").is_none(),
        "{name}"
    );
    let c = container(workload);
    for probe in ["livenessProbe", "readinessProbe", "startupProbe"] {
        assert_eq!(c[probe]["httpGet"]["port"], "admin", "{name} {probe}");
    }
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/livez");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert!(c["resources"]["requests"]["cpu"].is_string(), "{name}");
    assert!(c["resources"]["limits"]["memory"].is_string(), "{name}");
}

/// The container's mount of a volume and the volume itself.
pub fn mount<'a>(workload: &'a Value, volume: &str) -> (&'a Value, &'a Value) {
    let m = try_mount(workload, volume).unwrap_or_else(|| panic!("no mount of {volume}"));
    let v = workload["spec"]["template"]["spec"]["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == volume)
        .unwrap_or_else(|| panic!("no volume {volume}"));
    (m, v)
}

/// The container's mount of a volume, if any.
pub fn try_mount<'a>(workload: &'a Value, volume: &str) -> Option<&'a Value> {
    container(workload)["volumeMounts"]
        .as_array()
        .expect("volumeMounts")
        .iter()
        .find(|m| m["name"] == volume)
}
