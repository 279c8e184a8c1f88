//! The committed KubeVirt v1.9.0 objects (`tests/fixtures/kubevirt-v1.9.0/`, read by
//! `teeguard_tests::kubevirt::rendered` and the webhook's tests) are what KubeVirt's own code produces:
//! each sample VMI is created through the virt-api stand-in (`kvtool default-vmi`) and rendered into its
//! launcher pod by the real virt-controller (no node: the pod stays unscheduled), both made
//! deterministic, and compared with the committed files. Regenerate with `scripts/kubevirt-fixtures.sh`
//! (`TEEGUARD_REGENERATE_FIXTURES=1`). v1.7.4's and v1.8.4's are checked by `kubevirt_v1_7.rs` and
//! `kubevirt_v1_8.rs`. Skipped (one line) without the KubeVirt kit, unless `CI=true`.

use std::time::Duration;

use teeguard_tests::fixtures::DEFAULT_NAMESPACE;
use teeguard_tests::kubevirt::{KubeVirt, rendered};
use teeguard_tests::realcluster::{Cluster, within};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_committed_kubevirt_objects_are_what_kubevirt_v1_9_renders() {
    within(Duration::from_secs(300), async {
        let Some(kv) = KubeVirt::shared() else {
            return;
        };
        let Some(cluster) = Cluster::connect().await else {
            return;
        };
        if let Err(e) = rendered::compare_with_committed(kv, &cluster, DEFAULT_NAMESPACE).await {
            panic!("{e}");
        }
    })
    .await;
}
