//! DRA mode under the real scheduler and kubelet v1.36.2 on containerd v2.4 (`teeguard_tests::node`):
//! the agent is the node's DRA driver; the scheduler allocates its devices to pods requesting
//! `tdx.intel.com/keys` (DeviceClass `extendedResourceName`); the kubelet registers the driver and has
//! it prepare each claim; the agent's NRI plugin gives the compute container its `misc.max`. Skipped
//! (one line) without the node's binaries or root, unless `CI=true`.
//!
//! Every gRPC call the kubelet makes to the agent here (the plugin watcher's `GetInfo` and
//! `NotifyRegistrationStatus` on the registration socket, then `NodePrepareResources` /
//! `NodeUnprepareResources` on the DRA socket) carries the socket's path percent-encoded as its
//! `:authority` (grpc-go dialling `unix:///var/lib/kubelet/...`); upstream h2 resets those streams, the
//! vendored h2 (`vendor/h2`, hyperium/h2#487) serves them: without it the driver never registers and
//! no pod here starts. `agent/tests/dra_plugin.rs` checks that Cargo.lock uses that copy.

mod chart_support;
mod node_support;

use node_support::{Options, dra};
use teeguard_tests::node::Runtime;

const RUNTIME: Runtime = Runtime::Containerd;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tdx_launcher_is_allocated_a_device_by_the_scheduler_prepared_by_the_agent_and_gets_misc_max()
 {
    dra::run(
        RUNTIME,
        "dra-launcher",
        Options::dra(2),
        dra::launcher_allocated_prepared_limited,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_key_pods_for_one_free_key_one_is_allocated_and_runs_49_wait_with_the_schedulers_message()
 {
    dra::run(
        RUNTIME,
        "dra-fifty",
        Options::dra(1),
        dra::fifty_pods_one_key,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_tdx_vms_through_the_webhook_for_one_free_key_one_runs_49_wait_and_the_webhook_refuses_none()
 {
    dra::run(
        RUNTIME,
        "dra-fifty-vms",
        Options::dra(1),
        dra::fifty_vms_one_key,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_tdx_vms_through_three_webhook_replicas_for_one_free_key_one_runs_49_wait_and_none_is_refused()
 {
    let options = Options {
        webhook_replicas: 3,
        ..Options::dra(1)
    };
    dra::run(RUNTIME, "dra-fifty-3", options, dra::fifty_vms_one_key).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_outside_kubernetes_is_withheld_from_the_slice_and_comes_back_when_freed() {
    dra::run(
        RUNTIME,
        "dra-outside",
        Options::dra(2),
        dra::outside_key_withheld,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kata_style_pod_of_a_tee_runtime_class_and_a_kubevirt_launcher_draw_from_the_same_pool() {
    let options = Options {
        extra_config: "admission:\n  teeRuntimeClasses:\n    kata-qemu-tdx: tdx\n",
        chart_args: &[
            "--set-json",
            r#"config.admission.teeRuntimeClasses={"kata-qemu-tdx":"tdx"}"#,
        ],
        ..Options::dra(2)
    };
    dra::run(
        RUNTIME,
        "dra-kata",
        options,
        dra::kata_and_launcher_share_the_pool,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_holding_a_key_only_through_its_own_claim_gets_misc_max_from_the_allocation_in_strict_mode()
 {
    // Strict mode on: a pod whose keys come from a claim is held to it, and not zeroed.
    let options = Options {
        strict: true,
        ..Options::dra(2)
    };
    dra::run(
        RUNTIME,
        "dra-own-claim",
        options,
        dra::own_claim_limited_by_its_allocation,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_kubelet_restart_the_slices_come_back_and_after_an_agent_restart_prepared_claims_are_kept()
 {
    dra::run(RUNTIME, "dra-restarts", Options::dra(2), dra::restarts).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_switched_to_dra_and_back_keeps_its_pods_running_through_a_kubelet_restart_and_a_dra_allocated_pod_can_still_end()
 {
    let options = Options {
        dra: false,
        ..Options::dra(2)
    };
    dra::run(RUNTIME, "dra-switch", options, dra::switch_and_back).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_allocatable_still_names_the_key_says_dra_is_bypassed() {
    dra::run(RUNTIME, "dra-bypassed", Options::dra(2), dra::bypassed).await;
}
