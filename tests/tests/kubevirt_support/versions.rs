//! The older KubeVirt releases teeguard supports (v1.7.4 and v1.8.4, the first with TDX and SNP
//! `launchSecurity`), each with its own virt-controller and virt-api code, one per test binary: their
//! launcher pods differ where teeguard looks (a TDX pod has no `devices.kubevirt.io/tdx` and no
//! QGS annotation, only the `kubevirt.io/tdx` node selector; `volumecontainerdisk` is a second container
//! beside `compute`, with two init containers more).

use teeguard_tests::fixtures::{DEFAULT_NAMESPACE, Tee};
use teeguard_tests::kubevirt::vmis::Size;
use teeguard_tests::kubevirt::{self, KubeVirt, Version, rendered};
use teeguard_tests::realcluster::Cluster;

use super::full::{KATA_TDX, WILL_START};
use super::scenarios::{
    assert_only_compute_limited, compute_request, key_of, limits, one_of_each_kind_running,
    wait_counted,
};
use super::{KubeVirtWorld, Options};

/// Step 1 of [`older_release_renders_runs_limited_refuses_and_starts`] alone: `version`'s own code
/// renders the committed objects (rewritten with [`teeguard_tests::fixtures::regenerate`]). `false`
/// when the test skips (no KubeVirt kit or control plane).
pub async fn older_release_renders_the_committed_objects(version: Version) -> bool {
    kubevirt::choose(version);
    teeguard_tests::controlplane::want_two_api_servers();
    let Some(kv) = KubeVirt::shared() else {
        return false;
    };
    let Some(cluster) = Cluster::connect().await else {
        return false;
    };
    if let Err(e) = rendered::compare_with_committed(kv, &cluster, DEFAULT_NAMESPACE).await {
        panic!("{e}");
    }
    true
}

/// One release, in order:
/// 1. its own code renders the committed objects (`tests/fixtures/kubevirt-<release>/`), before any
///    node is labelled for a launcher pod (the pods stay unscheduled);
/// 2. a VMI of each kind (TDX, SNP, SEV-ES, SEV) runs on the node of its kind with one key on `compute`
///    (`misc.max` in `compute`'s OCI config as containerd handed it to runc, none in
///    `volumecontainerdisk` or any other container), the node's report counting it;
/// 3. on the full TDX node (one key) a second TDX VMI is refused with teeguard's message, and starts by
///    itself once the first is deleted;
/// 4. with `defaultRuntimeClass` naming a RuntimeClass whose overhead carries the key, a TDX VMI runs
///    with that one key: none more on `compute`, `misc.max` `tdx 1`, one key counted.
pub async fn older_release_renders_runs_limited_refuses_and_starts(version: Version) {
    if !older_release_renders_the_committed_objects(version).await
        || teeguard_tests::fixtures::regenerate()
    {
        return;
    }
    let test = format!("kv-{}", version.tag().replace('.', "-"));
    let Some(w) = KubeVirtWorld::start(&test, Options::keys(1, 2)).await else {
        return;
    };

    // 2. Each kind, limited on compute only.
    for (name, tee, node, pod) in one_of_each_kind_running(&w, Size::SMALL).await {
        let spec = pod.spec.as_ref().expect("spec");
        let line = key_of(tee).1;
        assert_eq!(
            compute_request(&pod, "devices.kubevirt.io/tdx"),
            None,
            "{name}: KubeVirt {version} requests no TDX device"
        );
        let names: Vec<&str> = spec.containers.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(
            names,
            ["compute", "volumecontainerdisk"],
            "{name}: KubeVirt {version}'s containers"
        );
        let got = limits(&w.records(node, &pod).await);
        assert!(got.contains_key("volumecontainerdisk"), "{name}: {got:?}");
        assert_only_compute_limited(&got, line, &name);
        wait_counted(&w, node, &name, &pod).await;
    }

    // 3. The TDX node is full: refused with the message, started by itself once a key frees.
    w.create_vmi("vmi-tdx-next", Tee::Tdx, Size::SMALL).await;
    w.wait_refused("vmi-tdx-next", 1).await;
    let message = w.failed_create("vmi-tdx-next").await;
    assert!(
        message.contains(&format!("{} 0/1 free", w.tdx.name())) && message.ends_with(WILL_START),
        "teeguard's refusal: {message}"
    );
    w.delete_vmi("vmi-tdx").await;
    w.wait_running("vmi-tdx-next").await;

    // 4. The key in the RuntimeClass overhead is the VM's only key.
    w.delete_vmi("vmi-tdx-next").await;
    w.wait_tdx_free(1).await;
    w.ensure_kata_runtime_class().await;
    w.kv.configure(
        &w.cluster.client,
        serde_json::json!({"defaultRuntimeClass": KATA_TDX}),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    super::scenarios::runs_with_the_overhead_key_only(&w, "vmi-kata-rc").await;
}
