//! KubeVirt v1.9.0's own virt-controller (`teeguard_tests::kubevirt`) on two real nodes (kubelet +
//! containerd each; one a TDX host, one an SEV-SNP host, each with its own agent): VMIs as users write
//! them become the controller's launcher pods, go through teeguard's webhook (the chart's 2 replicas
//! behind a connection-level balancer, called by two API servers on one etcd), the scheduler, the
//! kubelet and containerd, which asks the agent over NRI. And the committed KubeVirt v1.9.0 objects
//! (`tests/fixtures/kubevirt-v1.9.0/`, read by `teeguard_tests::kubevirt::rendered` and the webhook's
//! tests) are what KubeVirt's own code renders (regenerate with `scripts/kubevirt-fixtures.sh`). Skipped (one line) without the KubeVirt kit, the
//! node's binaries or root, unless `CI=true`.

mod chart_support;
mod kubevirt_support;

use kubevirt_support::scenarios::{self, DEADLINE};
use kubevirt_support::{chaos, full, lifecycle};
use teeguard_tests::realcluster::within;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_committed_kubevirt_objects_are_what_kubevirt_v1_9_renders() {
    within(
        DEADLINE,
        kubevirt_support::committed_objects_are_what_kubevirt_renders(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vmis_of_each_kind_run_on_the_node_of_their_kind_with_one_key_on_compute() {
    within(DEADLINE, scenarios::each_kind_runs_limited_on_its_node()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn explore_full_node() {
    within(DEADLINE, scenarios::explore_full_node()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vmi_on_a_full_node_says_why_and_starts_by_itself_soon_after_a_key_frees() {
    within(
        DEADLINE,
        full::full_node_vmi_waits_and_starts_when_a_key_frees(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_vmis_for_four_keys_run_by_kind_and_the_longest_waiting_take_freed_places() {
    within(
        DEADLINE,
        full::thirty_vmis_for_four_keys_run_by_kind_and_the_longest_waiting_take_freed_places(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn explore_deletion() {
    within(DEADLINE, scenarios::explore_deletion()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_the_runtime_class_overhead_is_the_vms_only_key() {
    within(DEADLINE, scenarios::overhead_key_is_counted_once()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_cycled_on_a_full_node_is_never_refused_with_a_free_key_nor_counted_twice() {
    within(
        DEADLINE,
        lifecycle::vm_cycles_on_a_full_node_never_refused_with_a_free_key_never_two_keys(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_webhook_down_a_vmi_waits_and_starts_when_it_is_back_losing_nothing() {
    within(DEADLINE, lifecycle::webhook_down_and_back_loses_nothing()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vmis_come_and_go_while_replicas_an_agent_and_an_api_server_restart_with_no_key_given_twice()
 {
    within(
        // Set-up, the chaos itself (3 minutes in CI, 30 as a bench) and the settling after it.
        DEADLINE + chaos::duration() + std::time::Duration::from_secs(420),
        chaos::vmis_come_and_go_while_replicas_an_agent_and_an_api_server_restart(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_dra_mode_vmis_of_each_kind_run_with_a_key_the_scheduler_allocated() {
    within(
        DEADLINE,
        scenarios::each_kind_runs_with_a_dra_allocated_key(),
    )
    .await;
}
