//! The agent under a real kubelet on CRI-O 1.37-dev (`teeguard_tests::node`): pods created through the
//! real API server, webhook and scheduler, started by the kubelet through CRI-O, which asks the agent
//! over NRI; each container's OCI config as CRI-O handed it to runc is the evidence. DRA mode too (the
//! agent as the kubelet's DRA driver; the limits reach runc through CRI-O's NRI). Skipped (one line)
//! without the node's binaries or root, unless `CI=true`.

mod chart_support;
mod node_support;

use std::time::Duration;

use k8s_openapi::api::node::v1::RuntimeClass;
use kube::Api;
use node_support::scenarios::{self, DEADLINE};
use node_support::{NodeWorld, Options, dra};
use serde_json::json;
use teeguard_tests::fixtures::{TDX_KEYS, Tee};
use teeguard_tests::node::{CRIO_UNIFIED_HANDLER, Runtime};
use teeguard_tests::realcluster::{create_or_keep, within};

const RUNTIME: Runtime = Runtime::Crio;

every_runtime_runs!(RUNTIME);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_dra_mode_a_tdx_launcher_is_allocated_prepared_and_gets_misc_max_on_crio() {
    dra::run(
        RUNTIME,
        "crio-dra",
        Options::dra(2),
        dra::launcher_allocated_prepared_limited,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_dra_mode_a_pod_holding_a_key_through_its_own_claim_is_limited_to_it_on_crio() {
    let options = Options {
        strict: true,
        ..Options::dra(2)
    };
    dra::run(
        RUNTIME,
        "crio-dra-claim",
        options,
        dra::own_claim_limited_by_its_allocation,
    )
    .await;
}

/// The RuntimeClass of the CRI-O handler that allows the unified-cgroup annotations.
const UNIFIED_CLASS: &str = "teeguard-crio-unified";

/// `enforcement.crioAnnotation` on the real CRI-O, the agent's enforcement off (so that only CRI-O
/// acts): with the default handler (no allowed annotations) CRI-O ignores the webhook's annotation; in
/// a pod whose runtime handler allows it, the `compute` container's OCI config carries
/// `unified["misc.max"]` = `allowed` (`-`: nothing).
async fn crio_annotation(setting: &'static str, key: &str, allowed: &str) {
    let options = Options {
        mode: "off",
        crio_annotation: setting,
        ..Options::simulated()
    };
    let Some(w) = NodeWorld::start(RUNTIME, &format!("crio-{setting}"), options).await else {
        return;
    };
    let classes: Api<RuntimeClass> = Api::all(w.cluster.client.clone());
    let class: RuntimeClass = serde_json::from_value(json!({
        "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
        "metadata": {"name": UNIFIED_CLASS}, "handler": CRIO_UNIFIED_HANDLER
    }))
    .expect("RuntimeClass");
    create_or_keep(&classes, &class)
        .await
        .unwrap_or_else(|e| panic!("create RuntimeClass {UNIFIED_CLASS}: {e}"));
    w.wait_allocatable(TDX_KEYS, "4", Duration::from_secs(20))
        .await;
    for (vm, class, want) in [
        ("default-handler", None, "-"),
        ("allowing-handler", Some(UNIFIED_CLASS), allowed),
    ] {
        let pod = w
            .create_vm_with(vm, Tee::Tdx, |p| {
                p.spec.as_mut().expect("spec").runtime_class_name = class.map(str::to_string);
            })
            .await
            .unwrap_or_else(|e| panic!("{vm} refused: {e}"));
        let annotations = pod.metadata.annotations.clone().unwrap_or_default();
        assert_eq!(
            annotations.get(key).map(String::as_str),
            Some("misc.max=tdx 1"),
            "the webhook wrote CRI-O's annotation: {annotations:?}"
        );
        let pod = w.wait_running(&pod).await;
        let limits = scenarios::limits(&w.records(&pod).await);
        assert_eq!(
            limits.get("compute").map(String::as_str),
            Some(want),
            "{vm} ({setting}): {limits:?}"
        );
        assert!(
            limits.iter().all(|(c, v)| c == "compute" || v == "-"),
            "{vm} ({setting}): {limits:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crio_applies_the_current_unified_cgroup_annotation_only_where_the_handler_allows_it() {
    within(
        DEADLINE,
        crio_annotation("current", "unified-cgroup.crio.io/compute", "tdx 1"),
    )
    .await;
}

// CRI-O 1.37 reads its deprecated names through the `*.crio.io` ones: a container's legacy
// annotation is looked up as `io.kubernetes.cri-o.UnifiedCgroup/<container>` (found by hand: that form
// is applied), no longer as the documented `io.kubernetes.cri-o.UnifiedCgroup.<container>` that
// `legacy` writes for older CRI-O; so `legacy` does nothing here, even where the handler allows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crio_1_37_ignores_the_legacy_dotted_annotation_even_where_the_handler_allows_it() {
    within(
        DEADLINE,
        crio_annotation("legacy", "io.kubernetes.cri-o.UnifiedCgroup.compute", "-"),
    )
    .await;
}
