//! The agent under a real kubelet on CRI-O 1.37-dev (`teeguard_tests::node`): pods created through the
//! real API server, webhook and scheduler, started by the kubelet through CRI-O, which asks the agent
//! over NRI; each container's OCI config as CRI-O handed it to runc is the evidence. Skipped (one line)
//! without the node's binaries or root, unless `CI=true`.

mod chart_support;
mod node_support;

use node_support::scenarios::{self, DEADLINE};
use teeguard_tests::node::Runtime;
use teeguard_tests::realcluster::within;

const RUNTIME: Runtime = Runtime::Crio;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tdx_and_snp_launchers_run_with_misc_max_on_compute_only_and_a_mismatch_gets_the_request() {
    within(DEADLINE, scenarios::launchers(RUNTIME)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_the_machines_own_cgroups_without_misc_nothing_is_adjusted_and_every_pod_starts() {
    within(DEADLINE, scenarios::machine_without_misc(RUNTIME)).await;
}
