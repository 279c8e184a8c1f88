//! The older KubeVirt releases teeguard supports (v1.7.4 and v1.8.4, the first with TDX and SNP
//! `launchSecurity`), each with its own virt-controller and virt-api code, one per test binary: their
//! launcher pods differ where teeguard looks (a TDX pod has no `devices.kubevirt.io/tdx` and no
//! QGS annotation, only the `kubevirt.io/tdx` node selector; `volumecontainerdisk` is a second container
//! beside `compute`, with two init containers more).

use std::collections::BTreeMap;
use std::time::Duration;

use teeguard_tests::fixtures::{DEFAULT_NAMESPACE, Tee};
use teeguard_tests::kubevirt::vmis::Size;
use teeguard_tests::kubevirt::{self, KubeVirt, Version, rendered};
use teeguard_tests::realcluster::Cluster;

use super::full::{KATA_TDX, WILL_START};
use super::scenarios::{compute_request, key_of, limits};
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
    let kinds = [Tee::Tdx, Tee::Snp, Tee::SevEs, Tee::Sev];
    for tee in kinds {
        w.create_vmi(&format!("vmi-{}", tee.slug()), tee, Size::SMALL)
            .await;
    }
    for tee in kinds {
        let name = format!("vmi-{}", tee.slug());
        let pod = w.wait_running(&name).await;
        let node = w.node_for(tee);
        let spec = pod.spec.as_ref().expect("spec");
        assert_eq!(spec.node_name.as_deref(), Some(node.name()), "{name}");
        let (resource, line) = key_of(tee);
        assert_eq!(
            compute_request(&pod, resource).as_deref(),
            Some("1"),
            "{name}: teeguard added one key to compute"
        );
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
        let want: BTreeMap<String, String> = got
            .keys()
            .map(|c| {
                let l = if c == "compute" { line } else { "-" };
                (c.clone(), l.to_string())
            })
            .collect();
        assert!(
            got.contains_key("compute") && got.contains_key("volumecontainerdisk"),
            "{name}: {got:?}"
        );
        assert_eq!(got, want, "{name}: misc.max per container handed to runc");
        let uid = pod.metadata.uid.clone().expect("uid");
        w.wait_report(
            node,
            &format!("counts {name}'s pod"),
            Duration::from_secs(30),
            |r| r.counted_pods.contains(&uid),
        )
        .await;
    }

    // 3. The TDX node is full: refused with the message, started by itself once a key frees.
    w.create_vmi("vmi-tdx-next", Tee::Tdx, Size::SMALL).await;
    w.wait_refused("vmi-tdx-next", 1).await;
    let (_, reason, message) = w
        .vmi_condition("vmi-tdx-next", "Synchronized")
        .await
        .expect("Synchronized condition");
    assert_eq!(reason, "FailedCreate");
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
