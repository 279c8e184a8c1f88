//! The agent under a real kubelet on containerd v2.4 (`teeguard_tests::node`): pods created through the
//! real API server, webhook and scheduler, started by the kubelet through containerd, which asks the
//! agent over NRI; each container's OCI config as containerd handed it to runc is the evidence. Skipped
//! (one line) without the node's binaries or root, unless `CI=true`.

mod chart_support;
mod node_support;

use node_support::faults;
use node_support::scenarios::{self, DEADLINE};
use teeguard_tests::node::Runtime;
use teeguard_tests::realcluster::within;

const RUNTIME: Runtime = Runtime::Containerd;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tdx_and_snp_launchers_run_with_misc_max_on_compute_only_and_a_mismatch_gets_the_request() {
    within(DEADLINE, scenarios::launchers(RUNTIME)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_machines_own_cgroups_without_misc_nothing_is_adjusted_and_every_pod_starts() {
    within(DEADLINE, scenarios::machine_without_misc(RUNTIME)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tee_vm_running_before_the_agent_registers_gets_its_limit_through_synchronize() {
    within(DEADLINE, scenarios::synchronize(RUNTIME)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tee_container_created_while_the_agent_was_away_gets_its_limit_when_it_starts() {
    within(
        DEADLINE,
        scenarios::created_while_away_started_after(RUNTIME),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_stopped_while_containers_are_created_delays_none_past_the_request_timeout() {
    within(DEADLINE, faults::agent_stopped(RUNTIME)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_killed_and_restarted_while_containers_are_created_harms_none() {
    within(DEADLINE, faults::agent_killed(RUNTIME)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_runtime_restart_the_agent_registers_again_within_two_seconds() {
    within(DEADLINE, faults::runtime_restarted(RUNTIME)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn across_a_kubelet_restart_the_node_keeps_the_key_resource() {
    within(DEADLINE, faults::kubelet_restarted(RUNTIME)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_deleted_and_registered_again_gets_the_key_resource_within_one_poll() {
    within(DEADLINE, faults::node_deleted(RUNTIME)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_mode_gives_keyless_pods_tdx_0_and_exempt_pods_nothing() {
    within(DEADLINE, scenarios::strict(RUNTIME)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_keys_than_advertised_are_refused_by_the_scheduler_and_the_kubelets_admission() {
    within(DEADLINE, scenarios::kubelet_admission(RUNTIME)).await;
}
