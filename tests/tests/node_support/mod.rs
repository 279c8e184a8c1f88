//! One test's world on a real node (`teeguard_tests::node`): the node taken for the test, the real
//! `teeguard-agent` on it (NRI plugin on the runtime's socket; the machine's own `/sys/fs/cgroup` or a
//! simulated delegated cgroup tree), the real `teeguard-webhook` registered by URL with the chart's
//! webhook configurations for the test's namespace, and helpers to create pods through the API server
//! and wait for the kubelet to run them. Shared by the `node_*` test binaries and the `node_start` bench.

#![allow(dead_code)]

pub mod dra;
pub mod faults;
pub mod scenarios;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::Api;
use kube::api::PostParams;
use serde_json::json;
use teeguard_shared::TeeCapacity;
use teeguard_tests::e2e::{AgentProcess, ProcessEnv, WebhookProcess, balance, last_lines};
use teeguard_tests::fixtures::Tee;
use teeguard_tests::host::{SEV_ES, SimHost, TDX};
use teeguard_tests::node::{NodeTurn, RealNode, Recorded, Runtime, pods};
use teeguard_tests::patch::MergePatch;
use teeguard_tests::realcluster::{Cluster, TEST_LABEL, advertise_kubevirt_devices, event_line};

use crate::chart_support;

/// Longest a pod may take from CREATE to Running on the node.
pub const RUN_DEADLINE: Duration = Duration::from_secs(60);
/// The agent's poll interval in these tests.
pub const POLL: Duration = Duration::from_millis(250);

/// The cgroup tree the agent reads.
#[derive(Clone, Copy, Debug)]
pub enum AgentHost {
    /// A simulated host with the misc controller delegated to pod cgroups: `tdx` TDX keys, `sev_es`
    /// SEV-ES/SNP keys.
    Simulated { tdx: u64, sev_es: u64 },
    /// The machine's own `/sys/fs/cgroup`.
    Machine,
}

/// How a world is set up.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// The agent's cgroup tree.
    pub host: AgentHost,
    /// `enforcement.mode` (`nri`: the agent registers with the node's runtime; `off`: it does not).
    pub mode: &'static str,
    /// `enforcement.strict`.
    pub strict: bool,
    /// `enforcement.crioAnnotation`.
    pub crio_annotation: &'static str,
    /// `agent.accounting: dra` (the agent is the node's DRA driver; `--kubelet-dir` is the node's).
    pub dra: bool,
    /// Extra configuration YAML appended to the file (e.g. `admission:` settings).
    pub extra_config: &'static str,
    /// Webhook processes (replicas), behind a TCP round-robin proxy (as a Service spreads
    /// connections) when more than one; they share reservations through `TeeReservation`s.
    pub webhook_replicas: usize,
    /// Extra `helm template` arguments for the webhook configurations registered (the chart renders
    /// some entries only for some values, e.g. `config.admission.teeRuntimeClasses`).
    pub chart_args: &'static [&'static str],
}

impl Options {
    /// A simulated host with 4 TDX and 4 SEV-ES keys, NRI, strict mode off, no CRI-O annotation.
    pub fn simulated() -> Options {
        Options {
            host: AgentHost::Simulated { tdx: 4, sev_es: 4 },
            mode: "nri",
            strict: false,
            crio_annotation: "none",
            dra: false,
            extra_config: "",
            chart_args: &[],
            webhook_replicas: 1,
        }
    }

    /// [`Options::simulated`] in DRA mode with `tdx` TDX keys and no SEV-ES.
    pub fn dra(tdx: u64) -> Options {
        Options {
            host: AgentHost::Simulated { tdx, sev_es: 0 },
            dra: true,
            ..Options::simulated()
        }
    }
}

/// One test's world. Fields drop in order: the agent and the webhook stop first, the node is handed
/// to the next test last.
pub struct NodeWorld {
    pub agent: AgentProcess,
    /// Webhook replicas beyond [`NodeWorld::webhook`] (`Options::webhook_replicas`).
    pub replicas: Vec<WebhookProcess>,
    /// The agent's extra command-line arguments (DRA mode: `--kubelet-dir`).
    pub agent_args: Vec<String>,
    /// The cgroup tree the agent reads.
    pub agent_root: PathBuf,
    pub webhook: WebhookProcess,
    pub env: ProcessEnv,
    pub host: Option<SimHost>,
    pub cluster: Cluster,
    pub test: String,
    pub ns: String,
    pub turn: NodeTurn,
}

/// The agent's extra arguments: in DRA mode the node's kubelet root directory.
fn agent_args(turn: &NodeTurn, dra: bool) -> Vec<String> {
    if dra {
        vec![
            "--kubelet-dir".into(),
            turn.kubelet_root().display().to_string(),
        ]
    } else {
        Vec::new()
    }
}

impl NodeWorld {
    /// Take the node of `runtime`, start the agent and the webhook for test `test`; `None` when the
    /// test should skip (no node on this machine, see `RealNode::shared`).
    pub async fn start(runtime: Runtime, test: &str, options: Options) -> Option<NodeWorld> {
        let node = RealNode::shared(runtime)?;
        let turn = node.acquire().await;
        let cluster = Cluster::connect().await?;
        let config = format!(
            "agent:\n  pollInterval: {}ms\n  heartbeatInterval: 5s\n  accounting: {}\nenforcement:\n  \
             mode: {}\n  nriSocket: {}\n  strict: {}\n  crioAnnotation: {}\n{}",
            POLL.as_millis(),
            if options.dra {
                "dra"
            } else {
                "extendedResource"
            },
            options.mode,
            turn.nri_socket().display(),
            options.strict,
            options.crio_annotation,
            options.extra_config,
        );
        let env = cluster.process_env(&config).expect("process env");
        let ns = cluster.namespace(test, test, &[]).await.expect("namespace");
        prepare_node(&cluster, &turn, test).await;
        let host = match options.host {
            AgentHost::Simulated { tdx, sev_es } => {
                let mut b = SimHost::builder();
                for (resource, n) in [(TDX, tdx), (SEV_ES, sev_es)] {
                    if n > 0 {
                        b = b.capacity(resource, n);
                    }
                }
                Some(b.build().expect("simulated host"))
            }
            AgentHost::Machine => None,
        };
        let root: PathBuf = host
            .as_ref()
            .map_or_else(|| "/sys/fs/cgroup".into(), |h| h.root().to_path_buf());
        let agent_args = agent_args(&turn, options.dra);
        let mut agent = env
            .start_agent_with(&turn.name, &root, &agent_args)
            .await
            .expect("agent starts");
        if options.mode == "nri" {
            wait_registered(&mut agent).await;
        }
        let agent_root = root;
        let webhook = env.start_webhook(&[]).await.expect("webhook starts");
        let mut replicas = Vec::new();
        for _ in 1..options.webhook_replicas {
            replicas.push(
                env.start_webhook(&[])
                    .await
                    .expect("webhook replica starts"),
            );
        }
        let address = if replicas.is_empty() {
            webhook.https
        } else {
            let backends = std::iter::once(webhook.https)
                .chain(replicas.iter().map(|r| r.https))
                .map(Some)
                .collect();
            balance(std::sync::Arc::new(std::sync::Mutex::new(backends))).await
        };
        let rendered = chart_support::render("default", options.chart_args);
        let ca = env.ca.ca_bundle_base64();
        cluster
            .serve_webhooks(test, &ns, &rendered, address, &ca)
            .await
            .expect("the API server calls the webhooks");
        Some(NodeWorld {
            agent,
            replicas,
            agent_args,
            agent_root,
            webhook,
            env,
            host,
            cluster,
            test: test.to_string(),
            ns,
            turn,
        })
    }

    /// Start a new agent process in place of the current one (killed first, if it still runs) and
    /// wait until it has registered with the runtime.
    pub async fn restart_agent(&mut self) {
        self.agent.proc.kill();
        self.agent = self
            .env
            .start_agent_with(&self.turn.name, &self.agent_root, &self.agent_args)
            .await
            .expect("agent starts again");
        wait_registered(&mut self.agent).await;
    }

    /// Switch the agent to `agent.accounting: dra` (`dra`) or back to `extendedResource`, as a rolling
    /// update of the chart does on a node: the same configuration file with the other accounting, a
    /// new agent process.
    pub async fn switch_accounting(&mut self, dra: bool) {
        let (from, to) = if dra {
            ("accounting: extendedResource", "accounting: dra")
        } else {
            ("accounting: dra", "accounting: extendedResource")
        };
        let text = std::fs::read_to_string(&self.env.config_path).expect("read the config");
        assert!(text.contains(from), "{text}");
        std::fs::write(&self.env.config_path, text.replace(from, to)).expect("write the config");
        // The kubelet's directory either way: switched back, the agent still unprepares the claims
        // it prepared (as the chart's `dra.drain` mounts it).
        self.agent_args = agent_args(&self.turn, true);
        self.restart_agent().await;
    }

    /// The node selector of this test's pods (the Node carries the test's label while it is taken).
    pub fn selector(&self) -> [(&str, &str); 1] {
        [(TEST_LABEL, self.test.as_str())]
    }

    /// The pods of namespace `ns`.
    pub fn pods_in(&self, ns: &str) -> Api<Pod> {
        Api::namespaced(self.cluster.client.clone(), ns)
    }

    /// Create a VM of kind `tee` (its VMI, then its virt-launcher pod, runnable here) through the API
    /// server and teeguard's webhooks; returns the API server's answer to the pod CREATE.
    pub async fn create_vm(&self, name: &str, tee: Tee) -> kube::Result<Pod> {
        self.create_vm_with(name, tee, |_| {}).await
    }

    /// [`NodeWorld::create_vm`] with the virt-launcher pod changed by `edit` before its CREATE.
    pub async fn create_vm_with(
        &self,
        name: &str,
        tee: Tee,
        edit: impl FnOnce(&mut Pod),
    ) -> kube::Result<Pod> {
        let uid = self
            .cluster
            .create_vmi(&self.ns, name, tee)
            .await
            .expect("VMI");
        let pod = Cluster::launcher_pod(&self.ns, name, &uid, tee, &self.selector()).expect("pod");
        let mut pod = pods::runnable(&pod);
        edit(&mut pod);
        self.pods_in(&self.ns)
            .create(&PostParams::default(), &pod)
            .await
    }

    /// Create `pod` (in its own namespace) through the API server.
    pub async fn create(&self, pod: &Pod) -> kube::Result<Pod> {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        self.pods_in(&ns).create(&PostParams::default(), pod).await
    }

    /// Create `pod` and wait until it runs with every container started (a refusal panics, with the
    /// world's diagnostics).
    pub async fn run(&self, pod: &Pod) -> Pod {
        let created = self
            .create(pod)
            .await
            .unwrap_or_else(|e| panic!("pod refused: {e}\n{}", self.diagnostics()));
        self.wait_running(&created).await
    }

    /// Run `pod` as a static pod (a manifest in the kubelet's `staticPodPath`): its mirror pod, once
    /// it runs with every container started. [`NodeWorld::remove_static_pod`] ends it.
    pub async fn run_static_pod(&self, pod: &Pod) -> Pod {
        let (ns, name) = ns_name(pod);
        let manifest = self.turn.static_pod_path().join(format!("{name}.json"));
        std::fs::write(
            &manifest,
            serde_json::to_vec(pod).expect("a pod serialises"),
        )
        .unwrap_or_else(|e| panic!("write {}: {e}", manifest.display()));
        let mirror_name = format!("{name}-{}", self.turn.name);
        let mirror = self
            .cluster
            .wait_for_within(
                &format!("the mirror pod {ns}/{mirror_name}"),
                RUN_DEADLINE,
                || async { self.pods_in(&ns).get_opt(&mirror_name).await.ok()? },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", self.diagnostics()));
        self.wait_running(&mirror).await
    }

    /// Remove the manifest of the static pod whose mirror pod is `mirror`, and wait until the
    /// runtime runs none of its containers (a runtime stopping containers answers the agent's next
    /// `Synchronize` only after them).
    pub async fn remove_static_pod(&self, mirror: &Pod) {
        let name = mirror.metadata.name.as_deref().expect("name");
        let static_name = name
            .strip_suffix(&format!("-{}", self.turn.name))
            .expect("a mirror pod's name ends with its node's");
        let manifest = self
            .turn
            .static_pod_path()
            .join(format!("{static_name}.json"));
        std::fs::remove_file(&manifest)
            .unwrap_or_else(|e| panic!("remove {}: {e}", manifest.display()));
        let uid = pods::runtime_uid(mirror).expect("uid");
        let label = format!("io.kubernetes.pod.uid={uid}");
        self.cluster
            .wait_for_within(
                &format!("{name}'s containers stopped"),
                RUN_DEADLINE,
                || async {
                    let running = self.turn.crictl(&["ps", "-q", "--label", &label]).ok()?;
                    running.trim().is_empty().then_some(())
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", self.diagnostics()));
    }

    /// The message of the first Event with `reason` about `ns/name`, waited for (a timeout panics
    /// with the world's diagnostics), which must say each of `says`.
    pub async fn event_message(&self, ns: &str, name: &str, reason: &str, says: &[&str]) -> String {
        let message = self
            .cluster
            .wait_event(ns, name, reason)
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", self.diagnostics()))
            .message
            .unwrap_or_default();
        assert!(
            says.iter().all(|s| message.contains(s)),
            "{reason}: {message}"
        );
        message
    }

    /// Wait until the pod is Running with every container started; panics with its events, the
    /// kubelet's last log lines and the processes' logs when it is not within [`RUN_DEADLINE`].
    pub async fn wait_running(&self, pod: &Pod) -> Pod {
        let (ns, name) = ns_name(pod);
        let api = self.pods_in(&ns);
        let deadline = Instant::now() + RUN_DEADLINE;
        loop {
            let got = api.get(&name).await.ok();
            if let Some(p) = got.as_ref().filter(|p| running(p)) {
                return p.clone();
            }
            if Instant::now() >= deadline {
                panic!(
                    "pod {ns}/{name} not Running within {RUN_DEADLINE:?}: {:?}\nits events: {:?}\n{}",
                    got.and_then(|p| p.status),
                    self.events(&ns, &name).await,
                    self.diagnostics()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The recorded OCI configs of `pod` once every container of its spec has one.
    pub async fn records(&self, pod: &Pod) -> Vec<Recorded> {
        self.turn.records_of_pod(pod, Duration::from_secs(10)).await
    }

    /// `reason: message` of the events about `ns/name`.
    pub async fn events(&self, ns: &str, name: &str) -> Vec<String> {
        let events = self.cluster.events_about(ns, name).await;
        events.iter().map(event_line).collect()
    }

    /// The node's `TeeCapacity` condition `type_`, once the report has one.
    pub async fn condition(&self, type_: &str) -> Condition {
        let api: Api<TeeCapacity> = Api::all(self.cluster.client.clone());
        let node = self.turn.name.clone();
        self.cluster
            .wait_for(
                &format!("{node}'s report with condition {type_}"),
                || async {
                    let r = api.get(&node).await.ok()?;
                    r.status?.conditions.into_iter().find(|c| c.type_ == type_)
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", self.diagnostics()))
    }

    /// The Node's allocatable `resource` (`None` when it has none).
    pub async fn allocatable(&self, resource: &str) -> Option<String> {
        let nodes: Api<Node> = Api::all(self.cluster.client.clone());
        let n = nodes.get(&self.turn.name).await.ok()?;
        teeguard_tests::fixtures::node_resource(&n, resource).1
    }

    /// Wait until the Node's allocatable `resource` is `value`.
    pub async fn wait_allocatable(&self, resource: &str, value: &str, timeout: Duration) {
        let what = format!("{} allocatable {resource}: {value}", self.turn.name);
        let got = self
            .cluster
            .wait_for_within(&what, timeout, || async {
                (self.allocatable(resource).await.as_deref() == Some(value)).then_some(())
            })
            .await;
        if let Err(e) = got {
            let now = self.allocatable(resource).await;
            panic!("{e} (now {now:?})\n{}", self.diagnostics());
        }
    }

    /// The last lines of the kubelet's and the runtime's logs and every process log, for failures.
    pub fn diagnostics(&self) -> String {
        let tail = |c: &str| last_lines(&self.turn.log(c), 30);
        format!(
            "----- kubelet (last lines) -----\n{}\n----- {} (last lines) -----\n{}\n{}",
            tail("kubelet"),
            self.turn.runtime.name(),
            tail(self.turn.runtime.name()),
            self.env.all_logs()
        )
    }
}

/// A namespace whose pods no webhook of any test is called for (it carries no test label): pods go
/// in "past the webhook", as with a broken or bypassed admission.
pub async fn unguarded_namespace(cluster: &Cluster, prefix: &str) -> String {
    let name = teeguard_tests::controlplane::unique_name(prefix);
    let ns: k8s_openapi::api::core::v1::Namespace = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}
    }))
    .expect("namespace");
    Api::<k8s_openapi::api::core::v1::Namespace>::all(cluster.client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("create namespace");
    let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> =
        Api::namespaced(cluster.client.clone(), &name);
    cluster
        .wait_for(&format!("the default ServiceAccount of {name}"), || async {
            sas.get("default").await.ok().map(|_| ())
        })
        .await
        .expect("service account");
    name
}

pub use teeguard_tests::node::pods::running;

/// `(namespace, name)` of a pod.
pub fn ns_name(pod: &Pod) -> (String, String) {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

/// Label the Node for the test (its pods select it) and as a KubeVirt TDX and SEV-SNP node, and
/// advertise KubeVirt's device-plugin resources.
pub async fn prepare_node(cluster: &Cluster, turn: &NodeTurn, test: &str) {
    let nodes: Api<Node> = Api::all(cluster.client.clone());
    let mut labels = serde_json::Map::new();
    labels.insert(TEST_LABEL.into(), json!(test));
    for tee in [Tee::Tdx, Tee::Snp] {
        for l in tee.node_selectors() {
            labels.insert((*l).into(), json!("true"));
        }
    }
    labels.insert("kubevirt.io/schedulable".into(), json!("true"));
    nodes
        .merge_patch(&turn.name, json!({"metadata": {"labels": labels}}))
        .await
        .expect("label the Node");
    // The KubeVirt device-plugin resources a virt-launcher pod requests: virt-handler's device
    // plugins make the kubelet advertise them, here the world does.
    advertise_kubevirt_devices(
        &cluster.client,
        &turn.name,
        &[
            ("devices.kubevirt.io/tdx", json!("1k")),
            ("devices.kubevirt.io/sev", json!("1k")),
        ],
    )
    .await;
}

/// Wait until the agent logs its registration with the runtime's NRI.
pub async fn wait_registered(agent: &mut AgentProcess) {
    agent
        .wait_nri_registered(Duration::from_secs(15))
        .await
        .expect("the agent registers with the runtime");
}

/// The scenarios every runtime runs, one test each in the runtime's binary (`node_containerd`,
/// `node_crio`): `every_runtime_runs!(Runtime::Crio);` at the binary's top level.
#[macro_export]
macro_rules! every_runtime_runs {
    ($runtime:expr) => {
        $crate::every_runtime_runs!(@tests $runtime;
        tdx_and_snp_launchers_run_with_misc_max_on_compute_only_and_a_mismatch_gets_the_request => scenarios::launchers;
        on_the_machines_own_cgroups_without_misc_nothing_is_adjusted_and_every_pod_starts => scenarios::machine_without_misc;
        a_tee_vm_running_before_the_agent_registers_gets_its_limit_through_synchronize => scenarios::synchronize;
        a_tee_container_created_while_the_agent_was_away_gets_its_limit_when_it_starts => scenarios::created_while_away_started_after;
        agent_stopped_while_containers_are_created_delays_none_past_the_request_timeout => faults::agent_stopped;
        agent_killed_and_restarted_while_containers_are_created_harms_none => faults::agent_killed;
        after_a_runtime_restart_the_agent_registers_again_within_two_seconds => faults::runtime_restarted;
        across_a_kubelet_restart_the_node_keeps_the_key_resource => faults::kubelet_restarted;
        a_node_deleted_and_registered_again_gets_the_key_resource_within_one_poll => faults::node_deleted;
        strict_mode_zeroes_keyless_pods_spares_exempt_ones_and_follows_a_namespace_label_changed_later => scenarios::strict;
        more_keys_than_advertised_are_refused_by_the_scheduler_and_the_kubelets_admission => scenarios::kubelet_admission;
        );
    };
    (@tests $runtime:expr; $($name:ident => $($scenario:ident)::+;)+) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                ::teeguard_tests::realcluster::within(
                    $crate::node_support::scenarios::DEADLINE,
                    $crate::node_support::$($scenario)::+($runtime),
                )
                .await;
            }
        )+
    };
}
