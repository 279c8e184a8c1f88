//! The Helm chart against a real kube-apiserver, kube-controller-manager and kubectl (see
//! `teeguard_tests::controlplane`): `helm install` is accepted without a single warning, the agent's
//! own-node ValidatingAdmissionPolicy type-checks clean and holds an agent to its own node, its
//! report, Node and heartbeat Lease (checked by impersonating the agent's ServiceAccount), `kubectl get teecapacities` prints the CRD's
//! columns, and `helm uninstall` leaves only what the README says. Skipped (one line) without
//! control plane binaries, unless `CI=true`.

mod chart_support;

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use chart_support::helm_on;
use kube::Api;
use kube::api::DynamicObject;
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::{Value, json};
use teeguard_shared::TeeKind;
use teeguard_tests::controlplane::ControlPlane;
use teeguard_tests::fixtures::ReportBuilder;
use teeguard_tests::realcluster::{Cluster, within};

/// The release every test but the uninstall one uses, installed once per control plane.
const RELEASE: &str = "teeguard";
const NAMESPACE: &str = "teeguard";
const DEADLINE: Duration = Duration::from_secs(120);

/// What `helm install` said.
#[derive(Debug)]
struct Installed {
    stdout: String,
    stderr: String,
}

fn kubectl(cp: &ControlPlane, args: &[&str], extra_env: &[(&str, &str)]) -> chart_support::Run {
    let bin = std::env::var_os("TEEGUARD_KUBECTL").map(PathBuf::from).expect(
        "TEEGUARD_KUBECTL is not set: run scripts/test.sh, or `source scripts/chart-tools.sh` first",
    );
    let out = std::process::Command::new(bin)
        .args(args)
        .env("KUBECONFIG", &cp.kubeconfig)
        .envs(extra_env.iter().copied())
        .output()
        .expect("kubectl runs");
    chart_support::Run {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// `helm install` of the chart as `release` into namespace `ns` (created), with `extra` arguments.
fn helm_install(cp: &ControlPlane, release: &str, ns: &str, extra: &[&str]) -> chart_support::Run {
    let chart = chart_support::chart_dir().display().to_string();
    let mut args = vec![
        "install",
        release,
        &chart,
        "--namespace",
        ns,
        "--create-namespace",
    ];
    args.extend(extra);
    helm_on(cp, &args)
}

/// `helm install` of the chart with its defaults, once per control plane (the CRD comes from the
/// chart: nothing else installs it in this test binary).
fn installed(cp: &'static ControlPlane) -> &'static Installed {
    static ONCE: OnceLock<Installed> = OnceLock::new();
    ONCE.get_or_init(|| {
        let out = helm_install(cp, RELEASE, NAMESPACE, &[]);
        assert!(out.success, "helm install failed:\n{}", out.stderr);
        Installed {
            stdout: out.stdout,
            stderr: out.stderr,
        }
    })
}

/// kubectl's table output, read by column position (an empty cell is blank, not a word).
struct Table {
    header: Vec<String>,
    starts: Vec<usize>,
    rows: Vec<String>,
}

impl Table {
    fn parse(text: &str) -> Table {
        let mut lines = text.lines();
        let head = lines.next().unwrap_or("");
        let mut header = Vec::new();
        let mut starts = Vec::new();
        let mut prev = ' ';
        for (i, ch) in head.char_indices() {
            if ch != ' ' && prev == ' ' {
                starts.push(i);
                header.push(head[i..].split(' ').next().unwrap_or("").to_string());
            }
            prev = ch;
        }
        Table {
            header,
            starts,
            rows: lines.map(str::to_string).collect(),
        }
    }

    fn cell(&self, row: usize, col: &str) -> &str {
        let Some(i) = self.header.iter().position(|h| h == col) else {
            return "<no such column>";
        };
        let line = self.rows.get(row).map(String::as_str).unwrap_or("");
        let start = self.starts[i].min(line.len());
        let end = self
            .starts
            .get(i + 1)
            .copied()
            .unwrap_or(line.len())
            .min(line.len());
        line[start..end].trim()
    }
}

/// A connection without the harness's CRD installation (the chart brings the CRD here).
async fn connect() -> Option<Cluster> {
    let cp = ControlPlane::shared()?;
    let client = cp.client().await.expect("client");
    Some(Cluster { cp, client })
}

/// Waits until kube-controller-manager has type-checked ValidatingAdmissionPolicy `name`'s current
/// generation (its CEL against the real schemas), and asserts it found no problem.
async fn assert_type_checked(c: &Cluster, name: &str) {
    let api = policy_api(c);
    let checked = c
        .wait_for(&format!("policy {name} to be type-checked"), || async {
            let p = api.get(name).await.ok()?;
            let status = p.data.get("status")?;
            (status.get("observedGeneration").and_then(Value::as_i64) == p.metadata.generation)
                .then(|| status.clone())
        })
        .await
        .expect("type-checked");
    assert_eq!(
        checked.get("typeChecking"),
        Some(&json!({})),
        "type checking found problems: {checked}"
    );
}

fn policy_api(c: &Cluster) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "admissionregistration.k8s.io",
        "v1",
        "ValidatingAdmissionPolicy",
    ));
    Api::all_with(c.client.clone(), &ar)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_install_is_accepted_with_zero_warnings_and_the_policy_type_checks_clean() {
    within(DEADLINE, async {
        let Some(c) = connect().await else { return };
        let out = installed(c.cp);
        // The API server's warnings (deprecated fields, unknown formats, ...) reach helm's stderr.
        assert!(
            !out.stderr.to_lowercase().contains("warning"),
            "helm install printed warnings:\n{}",
            out.stderr
        );
        assert!(out.stdout.contains("STATUS: deployed"), "{}", out.stdout);

        // kube-controller-manager type-checks the policy's CEL against the real schemas.
        assert_type_checked(&c, &format!("{RELEASE}-agent-own-node")).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_get_teecapacities_prints_the_report_columns() {
    within(DEADLINE, async {
        let Some(c) = connect().await else { return };
        installed(c.cp);
        c.wait_for("the TeeCapacity CRD to be served", || async {
            let api: Api<teeguard_shared::TeeCapacity> = Api::all(c.client.clone());
            api.list(&Default::default()).await.ok().map(|_| ())
        })
        .await
        .expect("CRD served");
        c.report(
            &ReportBuilder::new("columns-node")
                .kind_with_external(TeeKind::Tdx, 31, 27, 3)
                .kind(TeeKind::SevEs, 100, 40),
        )
        .await
        .expect("report");
        let out = kubectl(c.cp, &["get", "teecapacities", "columns-node"], &[]);
        assert!(out.success, "{}", out.stderr);
        let table = Table::parse(&out.stdout);
        assert_eq!(
            table.header,
            [
                "NAME",
                "TDX-FREE",
                "SEV-FREE",
                "SEV-ES-FREE",
                "ACCOUNTING",
                "TDX-DEVICES",
                "PUBLISHED",
                "AGE"
            ],
            "{}",
            out.stdout
        );
        let cells: Vec<&str> = ["NAME", "TDX-FREE", "SEV-FREE", "SEV-ES-FREE", "TDX-DEVICES"]
            .iter()
            .map(|col| table.cell(0, col))
            .collect();
        assert_eq!(
            cells,
            ["columns-node", "27", "", "40", ""],
            "{}",
            out.stdout
        );
        let wide = kubectl(c.cp, &["get", "teecap", "columns-node", "-o", "wide"], &[]);
        assert!(wide.success, "{}", wide.stderr);
        let table = Table::parse(&wide.stdout);
        assert_eq!(
            (table.cell(0, "TDX-CAP"), table.cell(0, "EXTERNAL")),
            ("31", "3"),
            "{}",
            wide.stdout
        );
        // A DRA node's report: its accounting and the devices of its slices.
        let patch = json!({"status": {
            "accounting": "dra",
            "tdx": {"devices": {"published": 24, "allocated": 4, "withheld": 3}},
        }})
        .to_string();
        let patched = kubectl(
            c.cp,
            &[
                "patch",
                "teecapacity",
                "columns-node",
                "--subresource=status",
                "--type=merge",
                "-p",
                &patch,
            ],
            &[],
        );
        assert!(patched.success, "{}", patched.stderr);
        let wide = kubectl(c.cp, &["get", "teecap", "columns-node", "-o", "wide"], &[]);
        assert!(wide.success, "{}", wide.stderr);
        let table = Table::parse(&wide.stdout);
        let cells: Vec<&str> = ["ACCOUNTING", "TDX-DEVICES", "TDX-ALLOCATED"]
            .iter()
            .map(|col| table.cell(0, col))
            .collect();
        assert_eq!(cells, ["dra", "24", "4"], "{}", wide.stdout);
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn own_node_policy_lets_an_agent_write_only_its_own_node() {
    within(DEADLINE, async {
        let Some(c) = connect().await else { return };
        installed(c.cp);
        let agent = format!("system:serviceaccount:{NAMESPACE}:{RELEASE}-agent");
        let dir = tempfile::tempdir().expect("tmp");
        let manifest = dir.path().join("report.yaml");
        std::fs::write(
            &manifest,
            "apiVersion: teeguard.dev/v1alpha1\nkind: TeeCapacity\nmetadata: {name: node-own}\n\
             spec: {nodeName: node-own}\n",
        )
        .expect("manifest");
        let file = manifest.display().to_string();
        // The policy is enforced as soon as the API server has loaded it: retry briefly.
        let create_as = |node: Option<&str>| {
            let mut args = vec![
                "create".to_string(),
                "-f".into(),
                file.clone(),
                "--dry-run=server".into(),
                format!("--as={agent}"),
            ];
            if let Some(n) = node {
                args.push(format!("--as-user-extra=authentication.kubernetes.io/node-name={n}"));
            }
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            kubectl(c.cp, &args, &[])
        };
        let other = c
            .wait_for("the own-node policy to be enforced", || async {
                let out = create_as(Some("node-other"));
                (!out.success && out.stderr.contains("own-node")).then_some(out)
            })
            .await
            .expect("another node's report refused");
        assert!(
            other
                .stderr
                .contains("the teeguard agent on node node-other may write only its own node, not teecapacities node-own"),
            "{}",
            other.stderr
        );
        let own = create_as(Some("node-own"));
        assert!(own.success, "its own node's report is allowed: {}", own.stderr);
        // A token without any `extra` (an old token, or a user impersonating without it): the
        // policy's own message, not a CEL evaluation error.
        let none = create_as(None);
        assert!(!none.success);
        assert!(
            none.stderr.contains("carries no node name") && !none.stderr.contains("no such key"),
            "{}",
            none.stderr
        );
        // Heartbeat Leases too: RBAC lets the agent write Leases in the release namespace, the
        // policy only its own node's.
        let lease = |name: &str| {
            let manifest = dir.path().join(format!("lease-{name}.yaml"));
            std::fs::write(
                &manifest,
                format!(
                    "apiVersion: coordination.k8s.io/v1\nkind: Lease\nmetadata: {{name: {name}, namespace: {NAMESPACE}}}\n\
                     spec: {{holderIdentity: {name}}}\n"
                ),
            )
            .expect("manifest");
            let file = manifest.display().to_string();
            kubectl(
                c.cp,
                &[
                    "create",
                    "-f",
                    &file,
                    "--dry-run=server",
                    &format!("--as={agent}"),
                    "--as-user-extra=authentication.kubernetes.io/node-name=node-own",
                ],
                &[],
            )
        };
        let own_lease = lease("node-own");
        assert!(own_lease.success, "its own node's Lease is allowed: {}", own_lease.stderr);
        let other_lease = lease("node-other");
        assert!(
            !other_lease.success
                && other_lease
                    .stderr
                    .contains("may write only its own node, not leases node-other"),
            "{}",
            other_lease.stderr
        );
        let webhook = format!("system:serviceaccount:{NAMESPACE}:{RELEASE}-webhook");
        for verb in ["list", "watch"] {
            let can = kubectl(
                c.cp,
                &["auth", "can-i", verb, "leases.coordination.k8s.io", "-n", NAMESPACE, &format!("--as={webhook}")],
                &[],
            );
            assert_eq!(can.stdout.trim(), "yes", "the webhook may {verb} the agents' Leases: {}", can.stderr);
        }
        // Nodes too: patching another node's Node is refused.
        c.node(&teeguard_tests::fixtures::NodeBuilder::new("node-elsewhere"))
            .await
            .expect("node");
        // (kubectl reads the Node first, which the agent may not: a raw PATCH as the agent.)
        let patch = http::Request::patch("/api/v1/nodes/node-elsewhere?dryRun=All")
            .header("content-type", "application/merge-patch+json")
            .header("Impersonate-User", &agent)
            .header(
                "Impersonate-Extra-authentication.kubernetes.io%2fnode-name",
                "node-own",
            )
            .body(br#"{"metadata":{"annotations":{"example.com/touched":"yes"}}}"#.to_vec())
            .expect("request");
        let refused = c
            .client
            .request_text(patch)
            .await
            .expect_err("another node's Node is refused");
        assert!(
            refused
                .to_string()
                .contains("may write only its own node, not nodes node-elsewhere"),
            "{refused}"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn helm_uninstall_removes_everything_but_the_crd() {
    within(DEADLINE, async {
        let Some(c) = connect().await else { return };
        installed(c.cp); // the CRD, from the first release
        let (release, ns) = ("tg-uninstall", "tg-uninstall");
        let out = helm_install(c.cp, release, ns, &[]);
        assert!(out.success, "{}", out.stderr);
        let manifest = helm_on(c.cp, &["get", "manifest", release, "--namespace", ns]);
        assert!(manifest.success, "{}", manifest.stderr);
        let objects = chart_support::parse_documents(&manifest.stdout);
        assert!(objects.len() > 10, "{} objects", objects.len());
        let out = helm_on(c.cp, &["uninstall", release, "--namespace", ns, "--wait"]);
        assert!(out.success, "{}", out.stderr);
        // Every object of the release is gone (namespaced ones: deleted, or going with finalizers).
        for obj in &objects {
            let kind = obj["kind"].as_str().unwrap_or("");
            let name = obj["metadata"]["name"].as_str().unwrap_or("");
            let namespaced = obj["metadata"]["namespace"].as_str();
            let mut args = vec!["get", kind, name, "--ignore-not-found", "-o", "name"];
            if let Some(n) = namespaced {
                args.extend(["--namespace", n]);
            }
            let left = kubectl(c.cp, &args, &[]);
            assert!(left.success, "{}", left.stderr);
            assert!(
                left.stdout.trim().is_empty(),
                "{kind} {name} is left after helm uninstall"
            );
        }
        // What the README says stays: the CRD (Helm never deletes CRDs) and with it the reports.
        let crd = kubectl(
            c.cp,
            &["get", "crd", "teecapacities.teeguard.dev", "-o", "name"],
            &[],
        );
        assert!(crd.success && crd.stdout.contains("teecapacities.teeguard.dev"));
    })
    .await;
}

/// After uninstalling, `teeguard-agent cleanup` against the real API server removes the extended
/// resource the agent advertised and its annotation from a Node, and the node's report, and leaves
/// what NFD owns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_removes_what_the_agent_added_to_a_real_node() {
    within(DEADLINE, async {
        let Some(c) = connect().await else { return };
        installed(c.cp); // the TeeCapacity CRD
        let name = "node-cleanup";
        c.node(&teeguard_tests::fixtures::NodeBuilder::new(name).tdx(4))
            .await
            .expect("node");
        let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(c.client.clone());
        let pp = kube::api::PatchParams::default();
        nodes
            .patch(
                name,
                &pp,
                &kube::api::Patch::Merge(json!({"metadata": {"annotations": {
                    "teeguard.dev/extended-resources": "tdx.intel.com/keys",
                    "nfd.node.kubernetes.io/extended-resources": "sev-snp.amd.com/esids"}}})),
            )
            .await
            .expect("annotations");
        nodes
            .patch_status(
                name,
                &pp,
                &kube::api::Patch::Merge(json!({"status": {
                    "capacity": {"tdx.intel.com/keys": "3", "sev-snp.amd.com/esids": "10"},
                    "allocatable": {"tdx.intel.com/keys": "3", "sev-snp.amd.com/esids": "10"}}})),
            )
            .await
            .expect("advertised resources");
        c.wait_for("the TeeCapacity CRD to be served", || async {
            let api: Api<teeguard_shared::TeeCapacity> = Api::all(c.client.clone());
            api.list(&Default::default()).await.ok().map(|_| ())
        })
        .await
        .expect("CRD served");
        c.report(&ReportBuilder::new(name).kind(TeeKind::Tdx, 4, 1))
            .await
            .expect("report");
        // Its heartbeat Lease, in the client's namespace (the agent's, in a cluster).
        let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
            Api::default_namespaced(c.client.clone());
        leases
            .create(
                &Default::default(),
                &serde_json::from_value(json!({
                    "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": name, "labels": {"teeguard.dev/agent-heartbeat": "true"}},
                    "spec": {"holderIdentity": name},
                }))
                .expect("lease"),
            )
            .await
            .expect("lease created");

        let cleaned = teeguard_agent::cluster::cleanup::cleanup(
            c.client.clone(),
            name,
            &teeguard_shared::config::ResourcesConfig::default(),
        )
        .await
        .expect("cleanup");
        assert_eq!(cleaned.resources, ["tdx.intel.com/keys"]);
        assert!(
            cleaned.annotation && cleaned.report && cleaned.lease,
            "{cleaned:?}"
        );
        assert!(
            leases.get_opt(name).await.expect("get").is_none(),
            "the Lease is deleted"
        );
        let n = nodes.get(name).await.expect("the Node stays");
        let status = n.status.expect("status");
        for map in [
            status.capacity.expect("capacity"),
            status.allocatable.expect("allocatable"),
        ] {
            assert!(!map.contains_key("tdx.intel.com/keys"), "{map:?}");
            assert!(
                map.contains_key("sev-snp.amd.com/esids"),
                "NFD's stays: {map:?}"
            );
        }
        let annotations = n.metadata.annotations.unwrap_or_default();
        assert!(!annotations.contains_key("teeguard.dev/extended-resources"));
        assert!(annotations.contains_key("nfd.node.kubernetes.io/extended-resources"));
        let reports: Api<teeguard_shared::TeeCapacity> = Api::all(c.client.clone());
        assert!(reports.get_opt(name).await.expect("get").is_none());
        let again = teeguard_agent::cluster::cleanup::cleanup(
            c.client.clone(),
            name,
            &teeguard_shared::config::ResourcesConfig::default(),
        )
        .await
        .expect("cleanup");
        assert_eq!(again, teeguard_agent::cluster::cleanup::Cleaned::default());
    })
    .await;
}

/// DRA mode (`tests/chart/dra.yaml`, docs/dra.md) on the real v1.36 API server: installed without a
/// warning; the DeviceClasses kept with their `extendedResourceName` (a server without the feature
/// would drop the field) and their CEL compiled; the agent's RBAC grants the driver's calls and no
/// more; its own-node-slices policy type-checks clean and lets an agent write only its own node's
/// slices of its own driver.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dra_mode_installs_and_holds_the_agent_to_its_own_nodes_slices() {
    within(DEADLINE, async {
        let Some(c) = connect().await else { return };
        installed(c.cp); // the CRDs, from the first release
        let (release, ns) = ("tg-dra", "tg-dra");
        let server = c.client.apiserver_version().await.expect("the API server's version");
        let minor: u32 = server.minor.trim_end_matches('+').parse().unwrap_or(0);
        if minor < 34 {
            // An older cluster (TEEGUARD_KUBE_VERSION): DRA mode is refused with what it needs.
            let values = chart_support::values_file("dra").display().to_string();
            let out = helm_install(c.cp, release, ns, &["--values", &values]);
            assert!(!out.success, "helm installed DRA mode on {}", server.git_version);
            assert!(
                out.stderr.contains(&format!(
                    "config.agent.accounting=dra needs Kubernetes >= 1.34 (resource.k8s.io/v1 DeviceClasses; \
                     their extendedResourceName is on by default from 1.36), this is {}",
                    server.git_version
                )),
                "{}",
                out.stderr
            );
            return;
        }
        let values = chart_support::values_file("dra").display().to_string();
        let out = helm_install(
            c.cp,
            release,
            ns,
            &[
                "--values",
                &values,
                "--set",
                "fullnameOverride=tg-dra",
                "--set",
                "config.resources.sevEs.resourceName=example.com/snp-asids",
            ],
        );
        assert!(
            out.success,
            "helm install (DRA mode) failed:\n{}",
            out.stderr
        );
        assert!(
            !out.stderr.to_lowercase().contains("warning"),
            "helm install printed warnings:\n{}",
            out.stderr
        );

        // The DeviceClasses as the API server stored them.
        for (class, name) in [
            ("tdx.tee.teeguard.dev", "tdx.intel.com/keys"),
            ("sev.tee.teeguard.dev", "sev.amd.com/asids"),
            ("sev-es.tee.teeguard.dev", "example.com/snp-asids"),
        ] {
            let got = kubectl(c.cp, &["get", "deviceclass", class, "-o", "json"], &[]);
            assert!(got.success, "{class}: {}", got.stderr);
            let stored: Value = serde_json::from_str(&got.stdout).expect("json");
            assert_eq!(
                stored["spec"]["extendedResourceName"], name,
                "{class}: {}",
                got.stdout
            );
            let kind = class.trim_end_matches(".tee.teeguard.dev");
            assert_eq!(
                stored["spec"]["selectors"][0]["cel"]["expression"],
                format!(
                    "device.driver == \"tee.teeguard.dev\" && \
                     device.attributes[\"tee.teeguard.dev\"].kind == \"{kind}\""
                ),
                "{class}"
            );
        }

        // The policy's CEL against the real ResourceSlice schema.
        assert_type_checked(&c, "tg-dra-agent-own-node-slices").await;

        // RBAC: the driver's calls, and no more.
        let agent = format!("system:serviceaccount:{ns}:tg-dra-agent");
        let can = |verb: &str, resource: &str, all_namespaces: bool| {
            let mut args = vec!["auth", "can-i", verb, resource];
            if all_namespaces {
                args.push("--all-namespaces");
            }
            let who = format!("--as={agent}");
            args.push(&who);
            // `yes` or `no` (exit code 1); anything else is a failed check, not an answer.
            let out = kubectl(c.cp, &args, &[]);
            match out.stdout.trim() {
                "yes" => true,
                "no" => false,
                other => panic!(
                    "kubectl auth can-i {verb} {resource}: {other:?} {}",
                    out.stderr
                ),
            }
        };
        for verb in ["list", "watch", "create", "patch", "delete"] {
            assert!(
                can(verb, "resourceslices.resource.k8s.io", false),
                "{verb} resourceslices"
            );
        }
        for verb in ["get", "update", "deletecollection"] {
            assert!(
                !can(verb, "resourceslices.resource.k8s.io", false),
                "{verb} resourceslices"
            );
        }
        assert!(
            can("get", "resourceclaims.resource.k8s.io", true),
            "get resourceclaims"
        );
        for verb in ["list", "watch", "update", "patch"] {
            assert!(
                !can(verb, "resourceclaims.resource.k8s.io", true),
                "{verb} resourceclaims"
            );
        }
        assert!(
            !can("create", "deviceclasses.resource.k8s.io", false),
            "create deviceclasses"
        );

        // The policy, impersonating the agent of node-own (server-side dry runs).
        let dir = tempfile::tempdir().expect("tmp");
        let slice = |file: &str, driver: &str, node: &str| {
            let path = dir.path().join(file);
            std::fs::write(
                &path,
                format!(
                    "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\n\
                     metadata: {{generateName: {node}-slice-}}\n\
                     spec:\n  driver: {driver}\n  nodeName: {node}\n\
                     \x20 pool: {{name: {node}, generation: 1, resourceSliceCount: 1}}\n\
                     \x20 devices:\n  - name: tdx-0\n    attributes:\n      kind: {{string: tdx}}\n"
                ),
            )
            .expect("manifest");
            path.display().to_string()
        };
        let as_agent = |args: &[&str]| {
            let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
            all.push(format!("--as={agent}"));
            all.push("--as-user-extra=authentication.kubernetes.io/node-name=node-own".into());
            let all: Vec<&str> = all.iter().map(String::as_str).collect();
            kubectl(c.cp, &all, &[])
        };
        let own = slice("own.yaml", "tee.teeguard.dev", "node-own");
        let created = c
            .wait_for(
                "the own-node-slices policy to admit the agent's own slice",
                || async {
                    let out = as_agent(&["create", "-f", &own, "--dry-run=server"]);
                    out.success.then_some(out)
                },
            )
            .await;
        assert!(created.is_ok(), "its own node's slice is allowed");
        let other_node = as_agent(&[
            "create",
            "-f",
            &slice("other-node.yaml", "tee.teeguard.dev", "node-other"),
            "--dry-run=server",
        ]);
        assert!(
            !other_node.success
                && other_node.stderr.contains(
                    "the teeguard agent on node node-own may write only ResourceSlices of its own \
                     node, not one with spec.nodeName node-other"
                ),
            "{}",
            other_node.stderr
        );
        let other_driver = as_agent(&[
            "create",
            "-f",
            &slice("other-driver.yaml", "gpu.example.com", "node-own"),
            "--dry-run=server",
        ]);
        assert!(
            !other_driver.success
                && other_driver.stderr.contains(
                    "may write only ResourceSlices of its driver tee.teeguard.dev, not \
                     gpu.example.com"
                ),
            "{}",
            other_driver.stderr
        );
        // Server-side apply, as the agent writes its slices: its own node's allowed (RBAC `patch`, and
        // `create` for a new slice), another node's refused by the policy.
        let apply = |file: &str, node: &str| {
            let path = dir.path().join(file);
            std::fs::write(
                &path,
                format!(
                    "apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\n\
                     metadata: {{name: {node}-teeguard-0}}\n\
                     spec:\n  driver: tee.teeguard.dev\n  nodeName: {node}\n\
                     \x20 pool: {{name: {node}, generation: 1, resourceSliceCount: 1}}\n\
                     \x20 devices:\n  - name: tdx-0\n    attributes:\n      kind: {{string: tdx}}\n"
                ),
            )
            .expect("manifest");
            let file = path.display().to_string();
            as_agent(&[
                "apply",
                "--server-side",
                "--field-manager=teeguard-agent",
                "-f",
                &file,
                "--dry-run=server",
            ])
        };
        let own_apply = apply("apply-own.yaml", "node-own");
        assert!(own_apply.success, "{}", own_apply.stderr);
        let other_apply = apply("apply-other.yaml", "node-other");
        assert!(
            !other_apply.success
                && other_apply
                    .stderr
                    .contains("may write only ResourceSlices of its own node"),
            "{}",
            other_apply.stderr
        );
        // Deleting: another node's slice is refused, its own allowed.
        for (node, allowed) in [("node-other", false), ("node-own", true)] {
            let file = slice(&format!("delete-{node}.yaml"), "tee.teeguard.dev", node);
            let made = kubectl(c.cp, &["create", "-f", &file, "-o", "name"], &[]);
            assert!(made.success, "{}", made.stderr);
            let name = made.stdout.trim().to_string();
            let out = as_agent(&["delete", &name, "--dry-run=server"]);
            assert_eq!(
                out.success, allowed,
                "delete {node}'s slice as node-own's agent: {}",
                out.stderr
            );
            if !allowed {
                assert!(
                    out.stderr
                        .contains("may write only ResourceSlices of its own node"),
                    "{}",
                    out.stderr
                );
            }
            let gone = kubectl(c.cp, &["delete", &name], &[]);
            assert!(gone.success, "{}", gone.stderr);
        }
    })
    .await;
}
