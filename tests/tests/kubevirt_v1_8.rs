//! KubeVirt v1.8.4's own virt-controller and virt-api code (`../shared/kubevirt/versions/v1.8.4/`): what
//! this release renders is the committed objects (`tests/fixtures/kubevirt-v1.8.4/`, on which the
//! webhook's mutation is tested with every release's, `webhook/tests/mutate_https.rs`). Its launcher
//! pods differ from v1.7.4's only in the launcher's arguments and image, where teeguard does not look,
//! so the scenario on the two real nodes (limited, refused on a full node, started when a key frees;
//! `kubevirt_support::versions`) runs in CI for v1.7.4 and v1.9.0, and for this release on demand
//! (`--ignored`). Skipped (one line) without the KubeVirt kit, the node's binaries or root, unless
//! `CI=true`.

mod chart_support;
mod kubevirt_support;

use kubevirt_support::scenarios::DEADLINE;
use kubevirt_support::versions;
use teeguard_tests::kubevirt::Version;
use teeguard_tests::realcluster::within;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubevirt_v1_8_renders_the_committed_objects() {
    within(DEADLINE, async {
        versions::older_release_renders_the_committed_objects(Version::V1_8_4).await;
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the v1.7.4 scenario's twin (their pods differ only where teeguard does not look); run with --ignored"]
async fn kubevirt_v1_8_renders_the_committed_objects_and_its_vmis_run_limited_wait_and_start() {
    within(
        DEADLINE,
        versions::older_release_renders_runs_limited_refuses_and_starts(Version::V1_8_4),
    )
    .await;
}
