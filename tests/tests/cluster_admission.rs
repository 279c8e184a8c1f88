//! Admission against a real kube-apiserver (see `teeguard_tests::controlplane`): the webhook process
//! registered by URL with the webhook configurations the chart renders, pods created through the API
//! server. What is checked is what the API server stores and answers, not what the webhook returns.
//! Skipped (one line) without control plane binaries, unless `CI=true`.

mod chart_support;

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use serde_json::json;
use teeguard_shared::{TeeKind, names};
use teeguard_tests::e2e::{ProcessEnv, WebhookProcess};
use teeguard_tests::fixtures::{self, NodeBuilder, ReportBuilder, Tee, VirtLauncherPod};
use teeguard_tests::patch::MergePatch;
use teeguard_tests::realcluster::{Cluster, Created, TEST_LABEL, within};
use teeguard_tests::standalone::driver::strip_server_fields;

const DEADLINE: Duration = Duration::from_secs(120);

/// One test's world: the cluster, the webhook process and the namespace its webhooks apply to.
struct World {
    cluster: Cluster,
    ns: String,
    webhook: WebhookProcess,
    _env: ProcessEnv,
}

/// Connect, start the webhook, register the chart's webhook configurations for `test`, make a
/// namespace of the test (extra `labels`), and wait until the API server calls the webhook there.
async fn world(test: &str, labels: &[(&str, &str)]) -> Option<World> {
    let cluster = Cluster::connect().await?;
    let env = cluster.process_env("").expect("process env");
    let ns = cluster
        .namespace(test, test, labels)
        .await
        .expect("namespace");
    let webhook = chart_support::serve_default_webhooks(&cluster, &env, test, &ns).await;
    Some(World {
        cluster,
        ns,
        webhook,
        _env: env,
    })
}

/// A TDX Node of the test's own whose report has 4 free keys.
async fn tdx_node(w: &World) {
    let c = &w.cluster;
    let node = c
        .node(&NodeBuilder::new(&format!("{}-tdx", w.ns)).tdx(4))
        .await
        .expect("node");
    let node = node.metadata.name.expect("name");
    c.report(&ReportBuilder::new(&node).kind(TeeKind::Tdx, 4, 4))
        .await
        .expect("report");
}

fn annotations(p: &Pod) -> std::collections::BTreeMap<String, String> {
    p.metadata.annotations.clone().unwrap_or_default()
}

/// The API server refused `got` with 403 Forbidden: a webhook's denial.
fn assert_forbidden<T: std::fmt::Debug>(got: kube::Result<T>, what: &str) {
    let refused = got.expect_err(what);
    assert!(
        matches!(&refused, kube::Error::Api(s) if s.code == 403),
        "{what}: {refused}"
    );
}

/// A TDX VM of the test (its VMI, and its launcher pod admitted with teeguard's limit); the pod's name.
async fn tdx_vm_pod(w: &World) -> String {
    let (_, created) = w
        .cluster
        .create_vm(&w.ns, "vm-tdx", Tee::Tdx, &[])
        .await
        .expect("VMI");
    let stored = created.expect("TDX pod admitted");
    stored.metadata.name.expect("name")
}

/// Pod `name`'s `compute` limit annotation, as stored now.
async fn compute_limit(pods: &Api<Pod>, name: &str) -> Option<String> {
    let now = pods.get(name).await.expect("pod");
    annotations(&now)
        .get(&names::misc_max_annotation("compute"))
        .cloned()
}

fn requests_of(p: &Pod, container: &str) -> std::collections::BTreeMap<String, String> {
    p.spec
        .as_ref()
        .into_iter()
        .flat_map(|s| s.containers.iter())
        .find(|c| c.name == container)
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.requests.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|(k, q)| (k, q.0))
        .collect()
}

fn tee_resources(p: &Pod) -> Vec<String> {
    let wanted = ["tdx.intel.com/keys", "sev-snp.amd.com/esids", "amd.com/sev"];
    p.spec
        .as_ref()
        .into_iter()
        .flat_map(|s| s.containers.iter())
        .filter_map(|c| c.resources.as_ref()?.requests.as_ref())
        .flat_map(|r| r.keys())
        .filter(|k| wanted.iter().any(|w| k.contains(w)) || k.ends_with("/keys"))
        .cloned()
        .collect()
}

/// A fixture pod moved into `ns`, as a client would send it.
fn into_namespace(pod: Pod, ns: &str) -> Pod {
    let mut v = serde_json::to_value(pod).expect("pod json");
    strip_server_fields(&mut v);
    if let Some(o) = v.as_object_mut() {
        o.remove("status");
    }
    v["metadata"]["namespace"] = json!(ns);
    if let Some(m) = v["metadata"].as_object_mut() {
        m.remove("ownerReferences");
    }
    serde_json::from_value(v).expect("pod")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tee_vm_pods_created_through_the_api_server_carry_the_mutation() {
    within(DEADLINE, async {
        let Some(w) = world("mutation", &[]).await else {
            return;
        };
        let c = &w.cluster;
        let tdx = c
            .node(&NodeBuilder::new(&format!("{}-tdx", w.ns)).tdx(8))
            .await
            .expect("TDX node");
        let sev = c
            .node(&NodeBuilder::new(&format!("{}-sev", w.ns)).sev(16, 16))
            .await
            .expect("SEV node");
        let (tdx, sev) = (
            tdx.metadata.name.expect("name"),
            sev.metadata.name.expect("name"),
        );
        c.report(&ReportBuilder::new(&tdx).kind(TeeKind::Tdx, 8, 8))
            .await
            .expect("TDX report");
        c.report(
            &ReportBuilder::new(&sev)
                .kind(TeeKind::Sev, 16, 16)
                .kind(TeeKind::SevEs, 16, 16),
        )
        .await
        .expect("SEV report");

        // (VM, TEE, resource requested by `compute`, limit annotation)
        let cases = [
            ("vm-tdx", Tee::Tdx, "tdx.intel.com/keys", "tdx 1"),
            ("vm-snp", Tee::Snp, "sev-snp.amd.com/esids", "sev_es 1"),
            ("vm-sev-es", Tee::SevEs, "sev-snp.amd.com/esids", "sev_es 1"),
        ];
        for (vm, tee, resource, limit) in cases {
            let (_, created) = c.create_vm(&w.ns, vm, tee, &[]).await.expect("VMI");
            let created = created.unwrap_or_else(|e| panic!("{vm}: pod CREATE refused: {e}"));
            // What the API server stored, read back.
            let stored = Api::<Pod>::namespaced(c.client.clone(), &w.ns)
                .get(created.metadata.name.as_deref().expect("generated name"))
                .await
                .expect("stored pod");
            assert_eq!(
                requests_of(&stored, "compute")
                    .get(resource)
                    .map(String::as_str),
                Some("1"),
                "{vm}: {:?}",
                requests_of(&stored, "compute")
            );
            assert_eq!(
                annotations(&stored)
                    .get(&names::misc_max_annotation("compute"))
                    .map(String::as_str),
                Some(limit),
                "{vm}"
            );
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_tee_storage_hotplug_and_export_pods_are_stored_untouched() {
    within(DEADLINE, async {
        let Some(w) = world("untouched", &[]).await else {
            return;
        };
        let c = &w.cluster;
        let uid = c
            .create_vmi(&w.ns, "vm-plain", Tee::None)
            .await
            .expect("VMI");
        let plain = Cluster::launcher_pod(&w.ns, "vm-plain", &uid, Tee::None, &[]).expect("pod");
        let storage = {
            let v = VirtLauncherPod::for_tee("vm-disk", Tee::Tdx)
                .namespace(&w.ns)
                .ephemeral_provisioning()
                .build();
            into_namespace(v, &w.ns)
        };
        let hotplug = into_namespace(fixtures::hotplug_pod("vm-plain", "nowhere"), &w.ns);
        let export = into_namespace(fixtures::export_pod("disk-export"), &w.ns);
        let pods = Api::<Pod>::namespaced(c.client.clone(), &w.ns);
        for (what, pod) in [
            ("non-TEE VM", plain),
            ("storage-binding", storage),
            ("hotplug", hotplug),
            ("export", export),
        ] {
            let created = pods
                .create(&PostParams::default(), &pod)
                .await
                .unwrap_or_else(|e| panic!("{what} pod refused: {e}"));
            let stored = pods
                .get(created.metadata.name.as_deref().expect("name"))
                .await
                .expect("stored");
            assert!(
                !annotations(&stored)
                    .keys()
                    .any(|k| names::is_limit_annotation(k)),
                "{what}: {:?}",
                annotations(&stored)
            );
            assert!(
                tee_resources(&stored).is_empty(),
                "{what}: {:?}",
                tee_resources(&stored)
            );
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_or_changed_limit_annotations_are_denied_by_the_api_server() {
    within(DEADLINE, async {
        let Some(w) = world("forged", &[]).await else {
            return;
        };
        let c = &w.cluster;
        tdx_node(&w).await;
        let pods = Api::<Pod>::namespaced(c.client.clone(), &w.ns);

        // A non-TEE VM's pod that carries a limit annotation of its own.
        let uid = c
            .create_vmi(&w.ns, "vm-forger", Tee::None)
            .await
            .expect("VMI");
        let mut forged =
            Cluster::launcher_pod(&w.ns, "vm-forger", &uid, Tee::None, &[]).expect("pod");
        forged
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(names::misc_max_annotation("compute"), "tdx 5".into());
        assert_forbidden(
            pods.create(&PostParams::default(), &forged).await,
            "a forged limit annotation is refused",
        );

        // A TDX VM's pod, stored with teeguard's limit; changing the limit afterwards is refused.
        let name = tdx_vm_pod(&w).await;
        let key = names::misc_max_annotation("compute");
        let patch = json!({"metadata": {"annotations": {key: "tdx 9"}}});
        assert_forbidden(
            pods.merge_patch(&name, &patch).await,
            "a changed limit annotation is refused",
        );
        assert_eq!(compute_limit(&pods, &name).await.as_deref(), Some("tdx 1"));
    })
    .await;
}

// virt-controller patches launcher pods' labels as their VMIs change. With every webhook replica down
// those patches must still go through (the limits webhook's failurePolicy is Fail), while a limit
// annotation removed or changed is refused: by the webhook when it is up, by the Fail policy when not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launcher_update_leaving_its_limits_alone_needs_no_webhook_and_a_removed_limit_is_refused()
 {
    within(DEADLINE, async {
        let Some(mut w) = world("limits-update", &[]).await else {
            return;
        };
        let c = &w.cluster;
        tdx_node(&w).await;
        let pods = Api::<Pod>::namespaced(c.client.clone(), &w.ns);
        let name = tdx_vm_pod(&w).await;
        let key = names::misc_max_annotation("compute");
        let remove = json!({"metadata": {"annotations": {key.clone(): null}}});
        assert_forbidden(
            pods.merge_patch(&name, &remove).await,
            "a removed limit annotation is refused",
        );

        w.webhook.proc.kill();
        let relabel =
            json!({"metadata": {"labels": {"kubevirt.io/created-by-test": "relabelled"}}});
        pods.merge_patch(&name, &relabel)
            .await
            .expect("a label patch needs no webhook");
        let change = json!({"metadata": {"annotations": {key: "tdx 9"}}});
        pods.merge_patch(&name, &change)
            .await
            .expect_err("with the webhook down, a changed limit is still refused");
        assert_eq!(compute_limit(&pods, &name).await.as_deref(), Some("tdx 1"));
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warn_mode_warning_reaches_the_client() {
    within(DEADLINE, async {
        let Some(w) = world("warn", &[(names::MODE_LABEL, "warn")]).await else {
            return;
        };
        let c = &w.cluster;
        // No node of this test has TDX keys: enforce mode would refuse; warn mode admits and warns.
        let uid = c
            .create_vmi(&w.ns, "vm-nowhere", Tee::Tdx)
            .await
            .expect("VMI");
        let selector = [(TEST_LABEL, "no-such-node")];
        let pod =
            Cluster::launcher_pod(&w.ns, "vm-nowhere", &uid, Tee::Tdx, &selector).expect("pod");
        let Created {
            status, warnings, ..
        } = c.create_pod_with_warnings(&w.ns, &pod).await;
        assert_eq!(status, 201, "created in warn mode: {warnings:?}");
        assert!(
            warnings
                .iter()
                .any(|w| w.contains("no node can host this TDX VM")),
            "{warnings:?}"
        );
    })
    .await;
}
