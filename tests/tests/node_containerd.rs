//! The agent under a real kubelet on containerd v2.4 (`teeguard_tests::node`): pods created through the
//! real API server, webhook and scheduler, started by the kubelet through containerd, which asks the
//! agent over NRI; each container's OCI config as containerd handed it to runc is the evidence. Skipped
//! (one line) without the node's binaries or root, unless `CI=true`.

mod chart_support;
mod node_support;

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
