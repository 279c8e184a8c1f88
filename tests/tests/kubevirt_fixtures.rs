//! The committed KubeVirt v1.9.0 objects (`tests/fixtures/kubevirt-v1.9.0/`, read by
//! `teeguard_tests::kubevirt::rendered` and the webhook's tests) are what KubeVirt's own code produces:
//! each sample VMI is created through the virt-api stand-in (`kvtool default-vmi`) and rendered into its
//! launcher pod by the real virt-controller (no node: the pod stays unscheduled), both made
//! deterministic, and compared with the committed files. Regenerate with `scripts/kubevirt-fixtures.sh`
//! (`TEEGUARD_REGENERATE_FIXTURES=1`). Skipped (one line) without the KubeVirt kit, unless `CI=true`.

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use teeguard_tests::fixtures::{DEFAULT_NAMESPACE, Vmi, to_pretty_json};
use teeguard_tests::kubevirt::KubeVirt;
use teeguard_tests::kubevirt::rendered::{self, DIR, KINDS};
use teeguard_tests::kubevirt::vmis::{self, Size};
use teeguard_tests::realcluster::{Cluster, within};

fn regenerate() -> bool {
    std::env::var("TEEGUARD_REGENERATE_FIXTURES").is_ok_and(|v| v == "1")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_committed_kubevirt_objects_are_what_kubevirt_v1_9_renders() {
    within(Duration::from_secs(300), async {
        let Some(kv) = KubeVirt::shared() else {
            return;
        };
        let Some(cluster) = Cluster::connect().await else {
            return;
        };
        let ns = DEFAULT_NAMESPACE;
        let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), ns);
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures").join(DIR);
        let mut problems = Vec::new();
        for tee in KINDS {
            let name = rendered::vmi_name(tee);
            let created = vmis::create(&cluster.client, ns, &vmis::vmi(&name, tee, Size::SAMPLE))
                .await
                .unwrap_or_else(|e| panic!("create VMI {name}: {e}"));
            let real = created.metadata.uid.clone().expect("uid");
            let fixture = Vmi::new(&name).namespace(ns).uid();
            let pod = cluster
                .wait_for_within(
                    &format!("virt-controller's pod for {name}"),
                    Duration::from_secs(60),
                    || async {
                        pods.list(
                            &ListParams::default().labels(&format!("kubevirt.io/created-by={real}")),
                        )
                        .await
                        .ok()?
                        .items
                        .into_iter()
                        .next()
                    },
                )
                .await
                .unwrap_or_else(|e| panic!("{e}\n{}", kv.log()));
            let pod = rendered::normalise(serde_json::to_value(&pod).expect("pod"), &real, &fixture);
            let stored = vmis::api(&cluster.client, ns, "VirtualMachineInstance")
                .get(&name)
                .await
                .expect("the VMI");
            let vmi = rendered::normalise(serde_json::to_value(&stored).expect("VMI"), &real, &fixture);
            for (file, value, committed) in [
                (format!("{}-pod.json", tee.slug()), &pod, rendered::launcher_pod_value(tee)),
                (format!("{}-vmi.json", tee.slug()), &vmi, rendered::vmi_value(tee)),
            ] {
                if *value == committed {
                    continue;
                }
                if regenerate() {
                    std::fs::create_dir_all(&dir).expect("create the fixtures directory");
                    std::fs::write(dir.join(&file), to_pretty_json(value)).expect("write");
                } else {
                    problems.push(format!(
                        "{DIR}/{file}: virt-controller renders\n{}",
                        to_pretty_json(value)
                    ));
                }
            }
        }
        assert!(
            problems.is_empty(),
            "KubeVirt renders other objects than the committed ones (run scripts/kubevirt-fixtures.sh):\n{}",
            problems.join("\n")
        );
    })
    .await;
}
