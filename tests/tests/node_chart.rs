//! The chart's own pods on a real node (issue #30): the images `scripts/images.sh` built
//! (`TEEGUARD_IMAGES`) imported into the node's containerd, `helm install` of the chart on the real
//! control plane (images and API server address overridden, host network, the webhook configurations
//! called by URL: `webhook.url`, as the API server here reaches no Service), and then, all through the chart's objects: the
//! agent DaemonSet's pod runs on the kubelet's node with the chart's securityContext and mounts,
//! authenticates with its projected ServiceAccount token, publishes the node's report, renews its
//! Lease and registers with containerd's NRI; the webhook becomes Ready and mutates a TDX VM's pod,
//! which gets `misc.max tdx 1` from the chart's agent; no API call of either is refused (a 403 would
//! mean the chart's RBAC is wrong); `helm upgrade` to another image rolls the agent without the Node's
//! key resource ever dropping; `helm uninstall` and `teeguard-agent cleanup` leave the Node as before.
//! And the same chart in DRA mode (`config.agent.accounting: dra`): the kubelet registers the agent's
//! pod as the DRA driver, which publishes the node's keys as devices and prepares a TDX VM's claim;
//! switched back with `dra.drain`, the VM's pod can still end (the agent unprepares its claim).
//! Skipped (one line) without the node, the control plane or the images, unless `CI=true`.

mod chart_support;
mod node_support;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use chart_support::helm_on;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::{DeviceClass, ResourceSlice};
use kube::api::{ListParams, PostParams};
use kube::{Api, ResourceExt};
use teeguard_certs::{CertificateAuthority, ServingCertRequest};
use teeguard_shared::TeeCapacity;
use teeguard_tests::controlplane::{ControlPlane, unique_name};
use teeguard_tests::fixtures::{self, TDX_KEYS, Tee};
use teeguard_tests::host::{SimHost, TDX};
use teeguard_tests::node::{ContainerKind, NodeTurn, RealNode, Runtime, built_images, pods};
use teeguard_tests::ports::free_ports;
use teeguard_tests::realcluster::{Cluster, TEST_LABEL, within};

const DEADLINE: Duration = Duration::from_secs(420);
const VERSION: &str = env!("CARGO_PKG_VERSION");
const WEBHOOK_IMAGE: &str = "ghcr.io/teeguard/teeguard-webhook";
const AGENT_IMAGE: &str = "ghcr.io/teeguard/teeguard-agent";

fn set(pairs: &[(&str, String)]) -> Vec<String> {
    pairs
        .iter()
        .flat_map(|(k, v)| ["--set".to_string(), format!("{k}={v}")])
        .collect()
}

/// The Node's key resource (capacity, allocatable) and teeguard's annotation.
type Marks = (Option<String>, Option<String>, Option<String>);

/// [`Marks`] of Node `n`, to compare before/after.
fn teeguard_marks(n: &Node) -> Marks {
    let (capacity, allocatable) = fixtures::node_resource(n, TDX_KEYS);
    (
        capacity,
        allocatable,
        n.annotations()
            .get(teeguard_shared::names::AGENT_EXTENDED_RESOURCES_ANNOTATION)
            .cloned(),
    )
}

/// The release's pods of one component on the node, once one is Ready (all containers ready).
async fn ready_pod(cluster: &Cluster, ns: &str, component: &str, image: &str) -> Pod {
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), ns);
    let selector = format!("app.kubernetes.io/component={component}");
    cluster
        .wait_for_within(
            &format!("a Ready {component} pod running {image}"),
            Duration::from_secs(120),
            || async {
                let list = pods
                    .list(&ListParams::default().labels(&selector))
                    .await
                    .ok()?;
                list.items.into_iter().find(|p| {
                    let spec_image = p.spec.as_ref().map(|s| s.containers[0].image.clone());
                    let ready = p
                        .status
                        .as_ref()
                        .and_then(|s| s.conditions.as_ref())
                        .is_some_and(|c| {
                            c.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                        });
                    ready
                        && p.metadata.deletion_timestamp.is_none()
                        && spec_image.flatten().as_deref() == Some(image)
                })
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

/// Everything the pod's containers logged so far (the kubelet's pod log files).
fn pod_logs(node: &RealNode, pod: &Pod) -> String {
    let (ns, name, uid) = (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
        pod.metadata.uid.clone().unwrap_or_default(),
    );
    let dir = node
        .dir()
        .join("kubelet")
        .join("pod-logs")
        .join(format!("{ns}_{name}_{uid}"));
    let mut out = String::new();
    for entry in walk(&dir) {
        out.push_str(&std::fs::read_to_string(entry).unwrap_or_default());
    }
    out
}

fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            files.extend(walk(&p));
        } else {
            files.push(p);
        }
    }
    files
}

/// No API call of the pod was refused: a 403 means the chart's RBAC (or the own-node policy) is wrong.
fn assert_no_refused_api_calls(node: &RealNode, pod: &Pod, what: &str) {
    let logs = pod_logs(node, pod);
    assert!(
        !logs.is_empty(),
        "{what}: no pod logs found under the kubelet's pod-logs"
    );
    for line in logs.lines() {
        // kube's errors read `... Forbidden ... code: 403` / `Unauthorized ... code: 401`.
        let l = line.to_ascii_lowercase();
        let refused = [
            "forbidden",
            "unauthorized",
            "code: 403",
            "code: 401",
            "\"code\":403",
        ]
        .iter()
        .any(|w| l.contains(w));
        assert!(!refused, "{what}: an API call was refused:\n{line}");
    }
}

/// The chart images and the containerd node, or `None` (the test skips) without them.
fn images_and_node() -> Option<(PathBuf, &'static RealNode)> {
    let images = built_images()?;
    Some((images, RealNode::shared(Runtime::Containerd)?))
}

/// Where both chart tests start: the node acquired and prepared for the test, the control plane, the
/// Nodes, and teeguard's marks on the Node before the chart is installed.
async fn start(node: &'static RealNode, test: &str) -> (NodeTurn, Cluster, Api<Node>, Marks) {
    let turn = node.acquire().await;
    let cluster = Cluster::connect().await.expect("control plane");
    node_support::prepare_node(&cluster, &turn, test).await;
    let nodes: Api<Node> = Api::all(cluster.client.clone());
    let before = teeguard_marks(&nodes.get(&turn.name).await.expect("node"));
    (turn, cluster, nodes, before)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_charts_pods_run_on_a_real_node_guard_a_tdx_vm_upgrade_without_a_gap_and_uninstall_cleanly()
 {
    let Some((images, node)) = images_and_node() else {
        return;
    };
    within(DEADLINE, async move {
        let test = "chart";
        let (turn, cluster, nodes, before) = start(node, test).await;
        let cp = cluster.cp;

        let host = SharedHost::new(4);
        let release = install(
            cp,
            &turn,
            &images,
            &host.host,
            &[("config.enforcement.mode", "nri".into())],
        );
        let ns = release.ns.clone();

        // The agent's pod: on this node, the chart's securityContext and mounts, Ready.
        let agent = ready_pod(&cluster, &ns, "agent", &format!("{AGENT_IMAGE}:{VERSION}")).await;
        let spec = agent.spec.as_ref().expect("spec");
        assert_eq!(spec.node_name.as_deref(), Some(turn.name.as_str()));
        assert_eq!(spec.host_network, Some(true));
        let sc = spec.containers[0]
            .security_context
            .as_ref()
            .expect("securityContext");
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(sc.allow_privilege_escalation, Some(false));
        let mounts: Vec<&str> = spec.containers[0]
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| m.mount_path.as_str())
            .collect();
        assert!(mounts.contains(&"/host/sys/fs/cgroup"), "{mounts:?}");
        assert!(
            mounts
                .iter()
                .any(|m| m.ends_with("kube-api-access") || m.contains("serviceaccount")),
            "projected ServiceAccount token mounted: {mounts:?}"
        );

        // Its work, through its own ServiceAccount: the report, the Lease, the Node, NRI.
        let reports: Api<TeeCapacity> = Api::all(cluster.client.clone());
        cluster
            .wait_for(
                "the chart's agent to publish the node's report with 4 TDX keys",
                || async {
                    let r = reports.get(&turn.name).await.ok()?;
                    (r.status?.tdx?.capacity == 4).then_some(())
                },
            )
            .await
            .expect("report");
        let leases: Api<Lease> = Api::namespaced(cluster.client.clone(), &ns);
        let first = cluster
            .wait_for("the agent's heartbeat Lease", || async {
                leases.get(&turn.name).await.ok()?.spec?.renew_time
            })
            .await
            .expect("lease");
        cluster
            .wait_for_within("the Lease renewed", Duration::from_secs(30), || async {
                let now = leases.get(&turn.name).await.ok()?.spec?.renew_time?;
                (now.0 > first.0).then_some(())
            })
            .await
            .expect("renewed");
        cluster
            .wait_for("tdx.intel.com/keys: 4 on the Node", || async {
                let n = nodes.get(&turn.name).await.ok()?;
                (teeguard_marks(&n).1.as_deref() == Some("4")).then_some(())
            })
            .await
            .expect("advertised");
        cluster
            .wait_for(
                "the agent's NRI plugin registered with containerd",
                || async { turn.log("containerd").contains("teeguard").then_some(()) },
            )
            .await
            .expect("registered");

        // The webhook's pod is Ready and answers admission: a TDX VM's pod is mutated by it and gets
        // its limit from the chart's agent.
        let webhook = ready_pod(
            &cluster,
            &ns,
            "webhook",
            &format!("{WEBHOOK_IMAGE}:{VERSION}"),
        )
        .await;
        let vm = run_tdx_vm(&cluster, &turn, &webhook, test).await;
        assert_eq!(
            vm.compute_limit.as_deref(),
            Some("tdx 1"),
            "misc.max from the chart's agent"
        );

        assert_no_refused_api_calls(&turn, &agent, "agent");
        assert_no_refused_api_calls(&turn, &webhook, "webhook");

        // helm upgrade to another image: the agent rolls, the Node's key resource never drops.
        turn.tag_image(
            &format!("{AGENT_IMAGE}:{VERSION}"),
            &format!("{AGENT_IMAGE}:{VERSION}-upgrade"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let watching = Arc::new(AtomicBool::new(true));
        let gaps = {
            let (nodes, name, watching) = (nodes.clone(), turn.name.clone(), watching.clone());
            tokio::spawn(async move {
                let mut gaps = Vec::new();
                while watching.load(Ordering::Acquire) {
                    if let Ok(n) = nodes.get(&name).await {
                        let marks = teeguard_marks(&n);
                        if marks.1.as_deref() != Some("4") {
                            gaps.push(format!("{:?}", marks));
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                gaps
            })
        };
        let upgrade_started = Instant::now();
        release.upgrade(cp, &[("agent.image.tag", format!("{VERSION}-upgrade"))]);
        let upgraded = ready_pod(
            &cluster,
            &ns,
            "agent",
            &format!("{AGENT_IMAGE}:{VERSION}-upgrade"),
        )
        .await;
        let renewed_by_new = cluster
            .wait_for_within(
                "the upgraded agent renewing the Lease",
                Duration::from_secs(30),
                || async {
                    let t = leases.get(&turn.name).await.ok()?.spec?.renew_time?;
                    let started = upgraded.status.as_ref()?.start_time.as_ref()?.0;
                    (t.0 > started).then_some(())
                },
            )
            .await;
        watching.store(false, Ordering::Release);
        let gaps = gaps.await.expect("watcher");
        renewed_by_new.expect("the new agent works");
        assert!(
            gaps.is_empty(),
            "the Node's key resource dropped during the upgrade: {gaps:?}"
        );
        eprintln!("agent upgraded in {:?}", upgrade_started.elapsed());
        assert_no_refused_api_calls(&turn, &upgraded, "upgraded agent");

        // helm uninstall, then `teeguard-agent cleanup`: the Node as it was before the install.
        vm.pods
            .delete(&vm.name, &Default::default())
            .await
            .expect("delete the VM's pod");
        release.uninstall_and_clean_up(cp, &turn);
        let after = teeguard_marks(&nodes.get(&turn.name).await.expect("node"));
        assert_eq!(after, before, "the Node after uninstall and cleanup");
        assert!(
            reports.get_opt(&turn.name).await.expect("get").is_none(),
            "report left"
        );
        assert!(
            leases.get_opt(&turn.name).await.expect("get").is_none(),
            "Lease left"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_dra_mode_the_charts_agent_is_the_kubelets_dra_driver_a_tdx_vm_is_allocated_prepared_and_limited_and_ends_after_switching_back()
 {
    let Some((images, node)) = images_and_node() else {
        return;
    };
    within(DEADLINE, async move {
        let test = "chart-dra";
        let (turn, cluster, nodes, before) = start(node, test).await;
        let cp = cluster.cp;
        // The chart creates the DeviceClasses: drop copies other tests made by hand (not the chart's).
        let classes: Api<DeviceClass> = Api::all(cluster.client.clone());
        for kind in ["tdx", "sev", "sev-es"] {
            let name = format!("{kind}.tee.teeguard.dev");
            if let Ok(c) = classes.get(&name).await
                && c.labels()
                    .get("app.kubernetes.io/managed-by")
                    .map(String::as_str)
                    != Some("Helm")
            {
                let _ = classes.delete(&name, &Default::default()).await;
            }
        }
        let host = SharedHost::new(2);
        let kubelet_dir = turn.kubelet_root().display().to_string();
        let release = install(
            cp,
            &turn,
            &images,
            &host.host,
            &[
                ("config.enforcement.mode", "nri".into()),
                ("config.agent.accounting", "dra".into()),
                ("agent.kubeletDir", kubelet_dir.clone()),
            ],
        );
        let ns = release.ns.clone();

        // The agent's pod: root without capabilities, the kubelet's plugin directories mounted at
        // their host paths.
        let agent = ready_pod(&cluster, &ns, "agent", &format!("{AGENT_IMAGE}:{VERSION}")).await;
        let spec = agent.spec.as_ref().expect("spec");
        assert_eq!(
            spec.security_context.as_ref().and_then(|s| s.run_as_user),
            Some(0),
            "DRA mode: the agent runs as root to serve the kubelet's sockets"
        );
        let mounts: Vec<&str> = spec.containers[0]
            .volume_mounts
            .iter()
            .flatten()
            .map(|m| m.mount_path.as_str())
            .collect();
        for dir in [
            format!("{kubelet_dir}/plugins_registry"),
            format!("{kubelet_dir}/plugins/tee.teeguard.dev"),
        ] {
            assert!(mounts.contains(&dir.as_str()), "{dir} in {mounts:?}");
        }

        // The kubelet registers the driver; the agent publishes the node's 2 keys as devices and
        // advertises no extended resource.
        let reports: Api<TeeCapacity> = Api::all(cluster.client.clone());
        cluster
            .wait_for_within(
                "the report: accounting dra, DraDriverReady True, 2 TDX devices published",
                Duration::from_secs(90),
                || async {
                    let s = reports.get(&turn.name).await.ok()?.status?;
                    let ready = s
                        .condition("DraDriverReady")
                        .is_some_and(|c| c.status == "True");
                    let published = s.tdx.as_ref()?.devices.as_ref()?.published;
                    (s.accounting.as_deref() == Some("dra") && ready && published == 2)
                        .then_some(())
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}\nkubelet:\n{}", tail(&turn.log("kubelet"))));
        let slices: Api<ResourceSlice> = Api::all(cluster.client.clone());
        let on_node = ListParams::default().fields(&format!(
            "spec.nodeName={},spec.driver=tee.teeguard.dev",
            turn.name
        ));
        let devices: usize = slices
            .list(&on_node)
            .await
            .expect("slices")
            .items
            .iter()
            .map(|s| s.spec.devices.as_ref().map_or(0, Vec::len))
            .sum();
        assert_eq!(devices, 2);
        assert_eq!(
            teeguard_marks(&nodes.get(&turn.name).await.expect("node")).1,
            None,
            "DRA mode advertises no tdx.intel.com/keys"
        );

        // A TDX VM through the chart's webhook: the scheduler allocates a device through the chart's
        // DeviceClass, the kubelet has the chart's agent prepare it, the pod runs with tdx 1.
        let webhook = ready_pod(
            &cluster,
            &ns,
            "webhook",
            &format!("{WEBHOOK_IMAGE}:{VERSION}"),
        )
        .await;
        let vm = run_tdx_vm(&cluster, &turn, &webhook, test).await;
        assert_eq!(vm.compute_limit.as_deref(), Some("tdx 1"));
        assert!(
            vm.pod
                .status
                .as_ref()
                .and_then(|s| s.extended_resource_claim_status.as_ref())
                .is_some(),
            "the key was allocated through a claim"
        );
        cluster
            .wait_for("the report counting 1 device allocated", || async {
                let s = reports.get(&turn.name).await.ok()?.status?;
                (s.tdx?.devices?.allocated == 1).then_some(())
            })
            .await
            .expect("allocated");
        assert_no_refused_api_calls(&turn, &agent, "agent");
        assert_no_refused_api_calls(&turn, &webhook, "webhook");

        // Switched back to extended resources with `dra.drain`, the VM still running: the agent
        // advertises again, the DeviceClasses go; the VM's pod, deleted, ends (the draining agent
        // unprepares its claim), and the kubelet then deletes the driver's slices.
        release.upgrade(
            cp,
            &[
                ("config.agent.accounting", "extendedResource".into()),
                ("dra.drain", "true".into()),
            ],
        );
        cluster
            .wait_for_within(
                "the switched-back agent advertising tdx.intel.com/keys: 2",
                Duration::from_secs(90),
                || async {
                    let r = reports.get(&turn.name).await.ok()?.status?;
                    let n = nodes.get(&turn.name).await.ok()?;
                    (r.accounting.as_deref() == Some("extendedResource")
                        && teeguard_marks(&n).1.as_deref() == Some("2"))
                    .then_some(())
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}\nkubelet:\n{}", tail(&turn.log("kubelet"))));
        assert!(
            classes
                .get_opt("tdx.tee.teeguard.dev")
                .await
                .expect("get")
                .is_none(),
            "the DeviceClass is gone with DRA mode"
        );
        let still = vm.pods.get(&vm.name).await.expect("the VM's pod");
        assert_eq!(
            still.status.and_then(|s| s.phase).as_deref(),
            Some("Running"),
            "the VM keeps running through the switch back"
        );
        vm.pods
            .delete(&vm.name, &Default::default())
            .await
            .expect("delete the VM's pod");
        cluster
            .wait_for_within(
                "the DRA-allocated VM's pod gone (its claim unprepared by the draining agent)",
                Duration::from_secs(60),
                || async {
                    vm.pods
                        .get_opt(&vm.name)
                        .await
                        .ok()?
                        .is_none()
                        .then_some(())
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}\nkubelet:\n{}", tail(&turn.log("kubelet"))));
        cluster
            .wait_for_within(
                "the kubelet deleting the driver's slices once the plugin stopped",
                Duration::from_secs(90),
                || async {
                    let l = slices.list(&on_node).await.ok()?;
                    l.items.is_empty().then_some(())
                },
            )
            .await
            .expect("slices deleted");
        release.uninstall_and_clean_up(cp, &turn);
        assert!(
            slices
                .list(&on_node)
                .await
                .expect("slices")
                .items
                .is_empty(),
            "slices left after cleanup"
        );
        assert!(
            reports.get_opt(&turn.name).await.expect("get").is_none(),
            "report left"
        );
        let after = teeguard_marks(&nodes.get(&turn.name).await.expect("node"));
        assert_eq!(after, before, "the Node after uninstall and cleanup");
    })
    .await;
}

/// The images `scripts/images.sh` built, imported into the node's runtime under the chart's names.
fn import_images(turn: &NodeTurn, images: &std::path::Path) {
    for (image, file) in [
        (WEBHOOK_IMAGE, "teeguard-webhook"),
        (AGENT_IMAGE, "teeguard-agent"),
    ] {
        turn.import_image(
            &images.join(format!("{file}.tar")),
            &format!("{image}:{VERSION}"),
        )
        .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// A release of the chart installed by [`install`].
struct Release {
    name: String,
    ns: String,
}

impl Release {
    /// `helm upgrade --reuse-values` with `values` set on top.
    fn upgrade(&self, cp: &ControlPlane, values: &[(&str, String)]) {
        let mut args: Vec<String> = vec![
            "upgrade".into(),
            self.name.clone(),
            chart_support::chart_dir().display().to_string(),
            "--namespace".into(),
            self.ns.clone(),
            "--reuse-values".into(),
        ];
        args.extend(set(values));
        let out = helm_on(cp, &args);
        assert!(
            out.success,
            "helm upgrade {values:?} failed:\n{}",
            out.stderr
        );
    }

    /// `helm uninstall --wait`, then `teeguard-agent cleanup` for the node.
    fn uninstall_and_clean_up(&self, cp: &ControlPlane, turn: &NodeTurn) {
        let out = helm_on(
            cp,
            &["uninstall", &self.name, "--namespace", &self.ns, "--wait"],
        );
        assert!(out.success, "helm uninstall failed:\n{}", out.stderr);
        let bins = teeguard_tests::e2e::binaries().expect("teeguard binaries");
        let cleanup = std::process::Command::new(&bins.agent)
            .args([
                "cleanup",
                "--node-name",
                &turn.name,
                "--namespace",
                &self.ns,
            ])
            .env("KUBECONFIG", &cp.kubeconfig)
            .output()
            .expect("run teeguard-agent cleanup");
        assert!(
            cleanup.status.success(),
            "teeguard-agent cleanup failed: {}{}",
            String::from_utf8_lossy(&cleanup.stdout),
            String::from_utf8_lossy(&cleanup.stderr)
        );
    }
}

/// `helm install` of the chart on the real control plane for this node: the images built here
/// (`images`, imported into the node's runtime), host network, the webhook called by URL with a
/// certificate of a fresh CA, the agent reading `host`, plus `extra` values.
fn install(
    cp: &ControlPlane,
    turn: &NodeTurn,
    images: &std::path::Path,
    host: &SimHost,
    extra: &[(&str, String)],
) -> Release {
    import_images(turn, images);
    let release = unique_name("tg");
    let ns = release.clone();
    let [webhook_port, webhook_admin, agent_admin] = free_ports().expect("free ports");
    let ca = CertificateAuthority::generate("teeguard-node-chart-ca", 2).expect("CA");
    let leaf = ca
        .issue(&ServingCertRequest::localhost())
        .expect("serving certificate");
    let dir = tempfile::tempdir().expect("temp dir");
    let (crt, key, ca_crt) = (
        dir.path().join("tls.crt"),
        dir.path().join("tls.key"),
        dir.path().join("ca.crt"),
    );
    std::fs::write(&crt, leaf.cert_pem()).expect("write");
    std::fs::write(&key, leaf.key_pem()).expect("write");
    std::fs::write(&ca_crt, ca.cert_pem()).expect("write");
    let api_port = cp.url.rsplit(':').next().expect("port").to_string();
    let mut args: Vec<String> = vec![
        "install".into(),
        release.clone(),
        chart_support::chart_dir().display().to_string(),
        "--namespace".into(),
        ns.clone(),
        "--create-namespace".into(),
    ];
    args.extend(set(&[
        ("apiServer.host", "127.0.0.1".into()),
        ("apiServer.port", api_port),
        ("webhook.replicas", "1".into()),
        ("webhook.hostNetwork", "true".into()),
        ("webhook.port", webhook_port.to_string()),
        ("webhook.adminPort", webhook_admin.to_string()),
        ("webhook.image.pullPolicy", "Never".into()),
        ("webhook.podDisruptionBudget.enabled", "false".into()),
        // The API server here reaches no Service: it calls the host-network pod by URL.
        ("webhook.url", format!("https://127.0.0.1:{webhook_port}")),
        ("agent.hostNetwork", "true".into()),
        ("agent.adminPort", agent_admin.to_string()),
        ("agent.image.pullPolicy", "Never".into()),
        ("agent.hostCgroupRoot", host.root().display().to_string()),
        (
            "config.enforcement.nriSocket",
            turn.nri_socket().display().to_string(),
        ),
        ("config.agent.pollInterval", "250ms".into()),
        ("config.agent.heartbeatInterval", "5s".into()),
    ]));
    args.extend(set(extra));
    for (k, f) in [
        ("webhook.tls.crt", &crt),
        ("webhook.tls.key", &key),
        ("webhook.tls.caCrt", &ca_crt),
    ] {
        args.extend(["--set-file".into(), format!("{k}={}", f.display())]);
    }
    let out = helm_on(cp, &args);
    assert!(out.success, "helm install failed:\n{}", out.stderr);
    Release { name: release, ns }
}

/// A TDX VM's launcher pod, created through the chart's webhook and running on the node.
struct RunningVm {
    pods: Api<Pod>,
    name: String,
    /// Its `compute` container's `misc.max` as containerd handed it to runc.
    compute_limit: Option<String>,
    pod: Pod,
}

/// Create a TDX VM (VMI + launcher pod) through the webhook, check the webhook mutated the pod, wait
/// until it runs and its compute container's OCI config is recorded.
/// Create a TDX VM's launcher pod through the chart's `webhook` pod and wait until it runs; a refusal
/// or a wait that fails prints the webhook's log (its pod's files go with the release).
async fn run_tdx_vm(cluster: &Cluster, turn: &NodeTurn, webhook: &Pod, test: &str) -> RunningVm {
    let webhook_log = || tail(&pod_logs(turn, webhook));
    let vm_ns = cluster
        .namespace("chart-vms", test, &[])
        .await
        .expect("namespace");
    let uid = cluster
        .create_vmi(&vm_ns, "tdx-vm", Tee::Tdx)
        .await
        .expect("VMI");
    let pod = Cluster::launcher_pod(&vm_ns, "tdx-vm", &uid, Tee::Tdx, &[(TEST_LABEL, test)])
        .expect("pod");
    let pods_api: Api<Pod> = Api::namespaced(cluster.client.clone(), &vm_ns);
    // The webhook admits a VM only on a node whose report its index has, taken from its watch, which
    // on a busy machine may lag the agent's write (a refused KubeVirt VM is retried by teeguard; this
    // bare pod is not): wait until a dry run of the pod is admitted (the webhook's own answer).
    let dry = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    cluster
        .wait_for(
            "the webhook to admit the TDX VM's pod in a dry run",
            || async { pods_api.create(&dry, &pods::runnable(&pod)).await.ok() },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\nwebhook:\n{}", webhook_log()));
    let created = pods_api
        .create(&PostParams::default(), &pods::runnable(&pod))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "the TDX VM's pod was refused: {e}\nwebhook:\n{}",
                webhook_log()
            )
        });
    let compute = &created.spec.as_ref().expect("spec").containers[0];
    assert_eq!(
        compute
            .resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .and_then(|r| r.get(TDX_KEYS))
            .map(|q| q.0.as_str()),
        Some("1"),
        "mutated by the chart's webhook"
    );
    let pod_uid = created.metadata.uid.clone().expect("uid");
    let name = created.metadata.name.clone().expect("name");
    cluster
        .wait_for_within(
            "the TDX VM's pod Running",
            Duration::from_secs(90),
            || async {
                let p = pods_api.get(&name).await.ok()?;
                (p.status?.phase.as_deref() == Some("Running")).then_some(())
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\nkubelet:\n{}", tail(&turn.log("kubelet"))));
    let compute_limit = cluster
        .wait_for("the compute container's recorded config", || async {
            turn.records_of(&pod_uid)
                .into_iter()
                .find(|r| r.kind == ContainerKind::Container && r.container == "compute")
                .map(|r| r.misc_max().map(str::to_string))
        })
        .await
        .expect("recorded");

    let pod = pods_api.get(&name).await.expect("the VM's pod");
    RunningVm {
        pods: pods_api,
        name,
        compute_limit,
        pod,
    }
}

/// The simulated host the chart's agent reads (`tdx` TDX keys, the misc controller delegated: this
/// machine's own tree has no misc controller), on a shared mount: the chart mounts the cgroup tree
/// with HostToContainer propagation, which the runtime allows only from a shared (or slave) mount, as
/// /sys/fs/cgroup is on a systemd host.
struct SharedHost {
    // Unmounted before the host's tree is removed (fields drop in order).
    _mount: SharedMount,
    host: SimHost,
}

impl SharedHost {
    fn new(tdx: u64) -> SharedHost {
        let host = SimHost::builder()
            .capacity(TDX, tdx)
            .build()
            .expect("simulated host");
        SharedHost {
            _mount: SharedMount::new(host.root()),
            host,
        }
    }
}

/// `path` bind-mounted onto itself and made a shared mount, unmounted on drop.
struct SharedMount(PathBuf);

impl SharedMount {
    fn new(path: &std::path::Path) -> SharedMount {
        for args in [&["--bind"][..], &["--make-shared"][..]] {
            let status = std::process::Command::new("mount")
                .args(args)
                .args(if args[0] == "--bind" {
                    vec![path, path]
                } else {
                    vec![path]
                })
                .status()
                .expect("run mount");
            assert!(status.success(), "mount {args:?} {}", path.display());
        }
        SharedMount(path.to_path_buf())
    }
}

impl Drop for SharedMount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}
