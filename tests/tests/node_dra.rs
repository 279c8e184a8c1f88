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

use node_support::scenarios::DEADLINE;
use node_support::{NodeWorld, Options, dra};
use teeguard_tests::node::Runtime;
use teeguard_tests::realcluster::within;

const RUNTIME: Runtime = Runtime::Containerd;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tdx_launcher_is_allocated_a_device_by_the_scheduler_prepared_by_the_agent_and_gets_misc_max()
 {
    within(DEADLINE, async {
        let Some(w) = NodeWorld::start(RUNTIME, "dra-launcher", Options::dra(2)).await else {
            return;
        };
        dra::launcher_allocated_prepared_limited(&w).await;
        dra::end(&w).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_key_pods_for_one_free_key_one_is_allocated_and_runs_49_wait_with_the_schedulers_message()
 {
    within(DEADLINE, async {
        let Some(w) = NodeWorld::start(RUNTIME, "dra-fifty", Options::dra(1)).await else {
            return;
        };
        dra::fifty_pods_one_key(&w).await;
        dra::end(&w).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_tdx_vms_through_the_webhook_for_one_free_key_one_runs_49_wait_and_the_webhook_refuses_none()
 {
    within(DEADLINE, async {
        let Some(w) = NodeWorld::start(RUNTIME, "dra-fifty-vms", Options::dra(1)).await else {
            return;
        };
        dra::fifty_vms_one_key(&w).await;
        dra::end(&w).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_tdx_vms_through_three_webhook_replicas_for_one_free_key_one_runs_49_wait_and_none_is_refused()
 {
    within(DEADLINE, async {
        let options = Options {
            webhook_replicas: 3,
            ..Options::dra(1)
        };
        let Some(w) = NodeWorld::start(RUNTIME, "dra-fifty-3", options).await else {
            return;
        };
        dra::fifty_vms_one_key(&w).await;
        dra::end(&w).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_outside_kubernetes_is_withheld_from_the_slice_and_comes_back_when_freed() {
    within(DEADLINE, async {
        let Some(w) = NodeWorld::start(RUNTIME, "dra-outside", Options::dra(2)).await else {
            return;
        };
        dra::outside_key_withheld(&w).await;
        dra::end(&w).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kata_style_pod_of_a_tee_runtime_class_and_a_kubevirt_launcher_draw_from_the_same_pool() {
    within(DEADLINE, async {
        let options = Options {
            extra_config: "admission:\n  teeRuntimeClasses:\n    kata-qemu-tdx: tdx\n",
            chart_args: &[
                "--set-json",
                r#"config.admission.teeRuntimeClasses={"kata-qemu-tdx":"tdx"}"#,
            ],
            ..Options::dra(2)
        };
        let Some(w) = NodeWorld::start(RUNTIME, "dra-kata", options).await else {
            return;
        };
        dra::kata_and_launcher_share_the_pool(&w).await;
        dra::end(&w).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_holding_a_key_only_through_its_own_claim_gets_misc_max_from_the_allocation_in_strict_mode()
 {
    within(DEADLINE, async {
        // Strict mode on: a pod whose keys come from a claim is held to it, and not zeroed.
        let options = Options {
            strict: true,
            ..Options::dra(2)
        };
        let Some(w) = NodeWorld::start(RUNTIME, "dra-own-claim", options).await else {
            return;
        };
        dra::own_claim_limited_by_its_allocation(&w).await;
        dra::end(&w).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_kubelet_restart_the_slices_come_back_and_after_an_agent_restart_prepared_claims_are_kept()
 {
    within(DEADLINE, async {
        let Some(mut w) = NodeWorld::start(RUNTIME, "dra-restarts", Options::dra(2)).await else {
            return;
        };
        dra::restarts(&mut w).await;
        dra::end(&w).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_switched_to_dra_and_back_keeps_its_pods_running_through_a_kubelet_restart_and_a_dra_allocated_pod_can_still_end()
 {
    within(DEADLINE, async {
        let options = Options {
            dra: false,
            ..Options::dra(2)
        };
        let Some(mut w) = NodeWorld::start(RUNTIME, "dra-switch", options).await else {
            return;
        };
        dra::switch_and_back(&mut w).await;
        dra::end(&w).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_allocatable_still_names_the_key_says_dra_is_bypassed() {
    within(DEADLINE, async {
        let Some(mut w) = NodeWorld::start(RUNTIME, "dra-bypassed", Options::dra(2)).await else {
            return;
        };
        dra::bypassed(&mut w).await;
        dra::end(&w).await;
    })
    .await;
}
