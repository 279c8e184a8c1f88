//! One test's world with KubeVirt's own virt-controller (`teeguard_tests::kubevirt`) and two real nodes
//! (`teeguard_tests::node`, kubelet + containerd each): one labelled as virt-handler labels an Intel
//! TDX host, one as an AMD SEV-SNP host, each with the `devices.kubevirt.io/*` resources virt-handler
//! would advertise, KubeVirt's images (stand-ins), a simulated TEE host and its own `teeguard-agent`
//! (NRI plugin on that node's containerd). The real `teeguard-webhook` is registered by URL with the
//! chart's webhook configurations for the test's namespace. VMIs are created as a user writes them and
//! defaulted by virt-api's code (the stand-in webhook); the launcher pods are virt-controller's own.

#![allow(dead_code)]

use kube::ResourceExt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, DynamicObject, ListParams};
use serde_json::{Value, json};
use teeguard_shared::TeeCapacity;
use teeguard_shared::crd::TeeCapacityStatus;
use teeguard_tests::e2e::{
    AgentProcess, Backends, ProcessEnv, WebhookProcess, balance, last_lines,
};
use teeguard_tests::fixtures::Tee;
use teeguard_tests::host::{SEV, SEV_ES, SimHost, TDX};
use teeguard_tests::kubevirt::{self, KubeVirt, vmis};
use teeguard_tests::node::{NodeTurn, RealNode, Recorded, Runtime};
use teeguard_tests::patch::MergePatch;
use teeguard_tests::prom::Scrape;
use teeguard_tests::realcluster::{Cluster, advertise_kubevirt_devices};

use crate::chart_support;

/// Longest a launcher pod may take from its VMI's CREATE to Running (two kubelets, virt-controller,
/// the scheduler and the API server share two cores).
pub const RUN_DEADLINE: Duration = Duration::from_secs(120);
/// The agents' poll interval.
pub const POLL: Duration = Duration::from_millis(250);

/// Every TEE label virt-handler may put on a node (removed first: the node may have been the other kind
/// in an earlier test of the binary).
const TEE_LABELS: [&str; 4] = [
    "kubevirt.io/tdx",
    "kubevirt.io/sev",
    "kubevirt.io/sev-es",
    "kubevirt.io/sev-snp",
];

/// How a world is set up.
#[derive(Clone, Copy, Debug)]
pub struct Options {
    /// TDX keys of the TDX node's (simulated) host.
    pub tdx_keys: u64,
    /// SEV-ES keys (SNP guests are charged as `sev_es`) of the SNP node's host.
    pub snp_keys: u64,
    /// Plain SEV keys of the SNP node's host (an EPYC host has both ASID pools).
    pub sev_keys: u64,
    /// teeguard in the path: the webhook registered and the agents' NRI plugins (`false`: the agents
    /// still report, nothing of teeguard admits or limits anything: a cluster without teeguard).
    pub teeguard: bool,
    /// Extra configuration YAML appended to the agents' and the webhook's file.
    pub extra_config: &'static str,
    /// The nodes in DRA mode: each agent is the node's DRA driver, the scheduler allocates keys
    /// through the chart's DeviceClasses.
    pub dra: bool,
    /// Webhook replicas (the chart's 2 by default), behind one balancer.
    pub replicas: usize,
}

impl Options {
    /// `tdx` TDX keys and `snp` SEV-ES/SNP keys (and as many plain SEV keys), teeguard in the path.
    pub fn keys(tdx: u64, snp: u64) -> Options {
        Options {
            tdx_keys: tdx,
            snp_keys: snp,
            sev_keys: snp,
            teeguard: true,
            extra_config: "",
            dra: false,
            replicas: 2,
        }
    }
}

/// One of the two nodes, with its agent. Fields drop in order: the agent stops before the node is
/// handed on.
pub struct TeeNode {
    /// The kind of TEE host it is.
    pub tee: Tee,
    pub agent: AgentProcess,
    /// Its simulated cgroup tree (the host's TEE keys).
    pub host: SimHost,
    /// The agent's extra arguments (to start it again).
    agent_args: Vec<String>,
    /// The agent's processes' environment (its configuration names this node's NRI socket).
    pub env: ProcessEnv,
    pub turn: NodeTurn,
}

impl TeeNode {
    /// The Node's name.
    pub fn name(&self) -> &str {
        &self.turn.name
    }
}

/// One test's world. Fields drop in order: the webhook and the agents stop first, the nodes are handed
/// to the next test last.
pub struct KubeVirtWorld {
    /// The webhook replicas (`None`: one stopped).
    pub webhooks: Vec<Option<WebhookProcess>>,
    /// Where the API servers' webhook calls go: a connection-level balancer over the replicas, as a
    /// Service spreads them (a stopped replica has no address).
    pub webhook_backends: Backends,
    pub tdx: TeeNode,
    pub snp: TeeNode,
    pub kv: &'static KubeVirt,
    pub cluster: Cluster,
    pub test: String,
    /// The test's namespace (teeguard's webhooks are called for it).
    pub ns: String,
}

/// Nodes whose runtime already has the stand-in images.
static IMAGES: Mutex<Vec<String>> = Mutex::new(Vec::new());

impl KubeVirtWorld {
    /// Take both nodes, start their agents and the webhook for test `test`; `None` when the test
    /// should skip (no KubeVirt kit or no real node here).
    pub async fn start(test: &str, options: Options) -> Option<KubeVirtWorld> {
        let asked = Instant::now();
        let (kv, cluster, [tdx_turn, snp_turn]) = kubevirt_to_this_test().await?;
        let acquired = Instant::now();
        for turn in [&tdx_turn, &snp_turn] {
            stand_in_images(turn);
        }
        let ns = cluster.namespace(test, test, &[]).await.expect("namespace");
        let tdx = TeeNode::start(&cluster, tdx_turn, Tee::Tdx, options).await;
        let snp = TeeNode::start(&cluster, snp_turn, Tee::Snp, options).await;
        let webhook_backends = Arc::new(Mutex::new(Vec::new()));
        let mut webhooks = Vec::new();
        if options.teeguard {
            for i in 0..options.replicas {
                let webhook = start_replica(&cluster, &tdx.env, i).await;
                webhook_backends
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(Some(webhook.https));
                webhooks.push(Some(webhook));
            }
            // Through a balancer, as through a Service: each new connection to the next replica up.
            let proxy = balance(webhook_backends.clone()).await;
            let rendered = chart_support::render("default", &[]);
            cluster
                .register_webhooks(test, &rendered, proxy, &tdx.env.ca.ca_bundle_base64())
                .await
                .expect("webhooks registered");
            if let Err(e) = webhooks_called(&cluster, &ns).await {
                panic!(
                    "the API server calls the webhooks: {e}\n{}",
                    tdx.env.all_logs()
                );
            }
            let probed = Instant::now();
            remove_vmis(&cluster, &ns).await;
            eprintln!(
                "{test}: the probe VMI gone {:.1?} after the webhooks were called",
                probed.elapsed()
            );
        }
        let world = KubeVirtWorld {
            webhooks,
            webhook_backends,
            tdx,
            snp,
            kv,
            cluster,
            test: test.to_string(),
            ns,
        };
        // Every key free (the probe's, an earlier test's pods gone) before the test begins.
        let all_free = |k: Option<&teeguard_shared::crd::KindStatus>, n: u64| {
            n == 0 || k.is_some_and(|k| k.capacity == n && k.free == n)
        };
        world
            .wait_report(&world.tdx, "every key free", Duration::from_secs(60), |r| {
                all_free(r.tdx.as_ref(), options.tdx_keys)
            })
            .await;
        world
            .wait_report(&world.snp, "every key free", Duration::from_secs(60), |r| {
                all_free(r.sev_es.as_ref(), options.snp_keys)
                    && all_free(r.sev.as_ref(), options.sev_keys)
            })
            .await;
        // Where a slow run's time went (the nodes are taken by one world at a time).
        eprintln!(
            "{test}: the nodes taken after {:.1?}, the world ready {:.1?} later",
            acquired - asked,
            acquired.elapsed()
        );
        Some(world)
    }

    /// Stop every webhook replica (the API servers' calls then fail).
    pub fn stop_webhook(&mut self) {
        for i in 0..self.webhooks.len() {
            self.stop_replica(i);
        }
    }

    /// Start every webhook replica again and send the API servers' calls to them once each is ready.
    pub async fn start_webhook(&mut self) {
        for i in 0..self.webhooks.len() {
            self.start_replica(i).await;
        }
    }

    /// Kill replica `i` (its connections break; the balancer sends new ones to the others).
    pub fn stop_replica(&mut self, i: usize) {
        self.webhook_backends
            .lock()
            .unwrap_or_else(|e| e.into_inner())[i] = None;
        if let Some(mut w) = self.webhooks[i].take() {
            w.proc.kill();
        }
    }

    /// Stop replica `i` as a rolling update does: out of the balancer, SIGTERM, and wait until it
    /// has exited (it drains, writes its last holds and gives the Lease up, which a successor takes at
    /// once). The bound is the drain timeout (25 s) with the slack of a loaded machine.
    pub async fn terminate_replica(&mut self, i: usize) {
        self.webhook_backends
            .lock()
            .unwrap_or_else(|e| e.into_inner())[i] = None;
        if let Some(mut w) = self.webhooks[i].take() {
            w.proc.sigterm().expect("kill -TERM");
            let ended = w.proc.wait_exit(Duration::from_secs(60)).await;
            let ended = ended.unwrap_or_else(|e| panic!("webhook replica {i} stops: {e}"));
            assert!(
                ended.contains("exit status: 0"),
                "webhook replica {i} ended {ended}; its log:\n{}",
                w.proc.log()
            );
        }
    }

    /// Start replica `i` again (a new process, its caches listed anew).
    pub async fn start_replica(&mut self, i: usize) {
        let webhook = start_replica(&self.cluster, &self.tdx.env, i).await;
        self.webhook_backends
            .lock()
            .unwrap_or_else(|e| e.into_inner())[i] = Some(webhook.https);
        self.webhooks[i] = Some(webhook);
    }

    /// The running replicas that decide now (their `teeguard_webhook_decider` gauge is 1).
    async fn deciders(&self) -> Vec<usize> {
        let mut out = Vec::new();
        for (i, r) in self.webhooks.iter().enumerate() {
            let Some(r) = r else { continue };
            let text = r.metrics().await;
            if Scrape::parse(&text).sum("teeguard_webhook_decider", &[]) == 1.0 {
                out.push(i);
            }
        }
        out
    }

    /// The running replica that decides now, if exactly one does.
    pub async fn decider(&self) -> Option<usize> {
        match self.deciders().await[..] {
            [one] => Some(one),
            _ => None,
        }
    }

    /// Wait until exactly one running replica decides (its `teeguard_webhook_decider` gauge is 1):
    /// after a decider dies, a successor takes the Lease over at most `deciderLease` (15 s) after
    /// the last renewal; the bound is four times that for a loaded machine.
    pub async fn one_decider(&self) {
        let bound = self.tdx.env.config.admission.decider_lease * 4;
        let decided = self
            .cluster
            .wait_for_within("one webhook replica decides", bound, || async {
                self.decider().await.map(|_| ())
            })
            .await;
        assert!(decided.is_ok(), "{decided:?}\n{}", self.diagnostics());
    }

    /// Start the agent of the node of kind `tee` again (after its process was killed) and wait for
    /// its NRI registration.
    pub async fn restart_agent(&mut self, tee: Tee) {
        let node = if tee == Tee::Tdx {
            &mut self.tdx
        } else {
            &mut self.snp
        };
        node.agent.proc.kill();
        let args = node.agent_args.clone();
        let mut agent = node
            .env
            .start_agent_with(&node.turn.name, node.host.root(), &args)
            .await
            .expect("the agent starts again");
        // containerd synchronizes a new plugin once none of its container operations holds NRI's
        // lock: a sandbox teardown stuck on its CNI plugin (a 30 s context) held it in one chaos run.
        agent
            .wait_nri_registered(Duration::from_secs(90))
            .await
            .expect("the agent registers with the runtime again");
        node.agent = agent;
    }

    /// Every running replica's log, concatenated.
    pub fn webhook_logs(&self) -> String {
        self.webhooks
            .iter()
            .flatten()
            .map(|w| w.proc.log())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// The node of kind `tee` (TDX, or the SNP node for every SEV kind).
    pub fn node_for(&self, tee: Tee) -> &TeeNode {
        if tee == Tee::Tdx {
            &self.tdx
        } else {
            &self.snp
        }
    }

    /// Create VMI `name` of kind `tee` in the test's namespace as a user writes it; returns it as
    /// stored (defaulted by virt-api's code).
    pub async fn create_vmi(&self, name: &str, tee: Tee, size: vmis::Size) -> DynamicObject {
        vmis::create(&self.cluster.client, &self.ns, &vmis::vmi(name, tee, size))
            .await
            .unwrap_or_else(|e| panic!("create VMI {name}: {e}"))
    }

    /// The VMI `name` as stored now.
    pub async fn vmi(&self, name: &str) -> Option<DynamicObject> {
        vmis::api(&self.cluster.client, &self.ns, "VirtualMachineInstance")
            .get_opt(name)
            .await
            .ok()
            .flatten()
    }

    /// The launcher pods of VMI `name` (virt-controller labels them `kubevirt.io/created-by=<uid>`).
    pub async fn launchers(&self, name: &str) -> Vec<Pod> {
        let Some(uid) = self.vmi(name).await.and_then(|v| v.metadata.uid) else {
            return Vec::new();
        };
        let pods: Api<Pod> = Api::namespaced(self.cluster.client.clone(), &self.ns);
        pods.list(&ListParams::default().labels(&format!("kubevirt.io/created-by={uid}")))
            .await
            .map(|l| l.items)
            .unwrap_or_default()
    }

    /// Wait until VMI `name`'s launcher pod runs with every container started; the pod. Panics with
    /// what `kubectl describe vmi` would show when it does not within [`RUN_DEADLINE`].
    pub async fn wait_running(&self, name: &str) -> Pod {
        let deadline = Instant::now() + RUN_DEADLINE;
        loop {
            if let Some(p) = self.launchers(name).await.into_iter().find(running) {
                return p;
            }
            if Instant::now() >= deadline {
                panic!(
                    "VMI {name}'s launcher pod is not Running within {RUN_DEADLINE:?}\n{}",
                    self.describe(name).await
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The recorded OCI configs of `pod` once each of its containers has one (node `node`).
    pub async fn records(&self, node: &TeeNode, pod: &Pod) -> Vec<Recorded> {
        node.turn.records_of_pod(pod, Duration::from_secs(30)).await
    }

    /// The node's `TeeCapacity` status, if published.
    pub async fn report(&self, node: &TeeNode) -> Option<TeeCapacityStatus> {
        let api: Api<TeeCapacity> = Api::all(self.cluster.client.clone());
        api.get(node.name()).await.ok()?.status
    }

    /// Wait until `check` holds for `node`'s report; the report. Panics after `timeout`.
    pub async fn wait_report(
        &self,
        node: &TeeNode,
        what: &str,
        timeout: Duration,
        check: impl Fn(&TeeCapacityStatus) -> bool,
    ) -> TeeCapacityStatus {
        let got = self
            .cluster
            .wait_for_within(
                &format!("{}'s report: {what}", node.name()),
                timeout,
                || async { self.report(node).await.filter(|r| check(r)) },
            )
            .await;
        match got {
            Ok(r) => r,
            Err(e) => panic!(
                "{e}\nthe report now: {:?}\n{}",
                self.report(node).await,
                self.diagnostics()
            ),
        }
    }

    /// Events about the object `name` in the test's namespace, oldest first.
    pub async fn events(&self, name: &str) -> Vec<Event> {
        let mut got = self.cluster.events_about(&self.ns, name).await;
        got.sort_by_key(|e| {
            e.last_timestamp
                .as_ref()
                .map(|t| t.0)
                .or_else(|| e.event_time.as_ref().map(|t| t.0))
        });
        got
    }

    /// What `kubectl describe vmi` shows of VMI `name`: phase, conditions and events.
    pub async fn describe(&self, name: &str) -> String {
        let Some(vmi) = self.vmi(name).await else {
            return format!("VMI {}/{name}: not found", self.ns);
        };
        let status = &vmi.data["status"];
        let mut out = format!(
            "VMI {}/{name}: phase {}\n  conditions:\n",
            self.ns,
            status["phase"].as_str().unwrap_or("")
        );
        for c in status["conditions"].as_array().into_iter().flatten() {
            out.push_str(&format!(
                "    {} {} {}: {}\n",
                c["type"].as_str().unwrap_or(""),
                c["status"].as_str().unwrap_or(""),
                c["reason"].as_str().unwrap_or(""),
                c["message"].as_str().unwrap_or("")
            ));
        }
        out.push_str("  events:\n");
        let events = self.events(name).await;
        for e in events {
            out.push_str(&format!(
                "    {} {} (x{}): {}\n",
                e.type_.unwrap_or_default(),
                e.reason.unwrap_or_default(),
                e.count.unwrap_or(1),
                e.message.unwrap_or_default()
            ));
        }
        out.push_str("  every launcher pod:\n");
        let pods: Api<Pod> = Api::all(self.cluster.client.clone());
        match pods
            .list(&ListParams::default().labels("kubevirt.io=virt-launcher"))
            .await
        {
            Err(e) => out.push_str(&format!("    cannot list pods: {e}\n")),
            Ok(l) => {
                for p in l.items {
                    let status = p.status.as_ref();
                    let scheduled = status
                        .and_then(|s| s.conditions.as_ref())
                        .and_then(|c| c.iter().find(|c| c.type_ == "PodScheduled"))
                        .and_then(|c| c.message.clone())
                        .unwrap_or_default();
                    out.push_str(&format!(
                        "    {} on {:?}: {:?}{} {scheduled}\n",
                        p.metadata.name.as_deref().unwrap_or(""),
                        p.spec.as_ref().and_then(|s| s.node_name.as_deref()),
                        status.and_then(|s| s.phase.as_deref()),
                        if p.metadata.deletion_timestamp.is_some() {
                            " (terminating)"
                        } else {
                            ""
                        }
                    ));
                }
            }
        }
        out
    }

    /// Logs for a failure: virt-controller's last lines, both kubelets', every process.
    pub fn diagnostics(&self) -> String {
        let tail = |log: String, n| last_lines(&log, n);
        format!(
            "----- virt-controller (last lines) -----\n{}\n----- kubelet {} -----\n{}\n----- kubelet {} -----\n{}\n{}\n{}",
            tail(self.kv.log(), 20),
            self.tdx.name(),
            tail(self.tdx.turn.log("kubelet"), 15),
            self.snp.name(),
            tail(self.snp.turn.log("kubelet"), 15),
            self.tdx.env.all_logs(),
            self.snp.env.all_logs()
        )
    }
}

impl TeeNode {
    async fn start(cluster: &Cluster, turn: NodeTurn, tee: Tee, options: Options) -> TeeNode {
        let capacities: &[(&str, u64)] = if tee == Tee::Tdx {
            &[(TDX, options.tdx_keys)]
        } else {
            &[(SEV, options.sev_keys), (SEV_ES, options.snp_keys)]
        };
        label_node(cluster, &turn, tee, options.tdx_keys).await;
        let mut b = SimHost::builder();
        for (resource, keys) in capacities {
            if *keys > 0 {
                b = b.capacity(resource, *keys);
            }
        }
        let host = b.build().expect("simulated host");
        let config = format!(
            "agent:\n  pollInterval: {}ms\n  heartbeatInterval: 5s\n  accounting: {}\nenforcement:\n  \
             mode: {}\n  nriSocket: {}\n{}",
            POLL.as_millis(),
            if options.dra {
                "dra"
            } else {
                "extendedResource"
            },
            if options.teeguard { "nri" } else { "off" },
            turn.nri_socket().display(),
            options.extra_config,
        );
        let env = cluster.process_env(&config).expect("process env");
        let args: Vec<String> = if options.dra {
            vec![
                "--kubelet-dir".into(),
                turn.kubelet_root().display().to_string(),
            ]
        } else {
            Vec::new()
        };
        let mut agent = env
            .start_agent_with(&turn.name, host.root(), &args)
            .await
            .expect("agent starts");
        if options.teeguard {
            agent
                .wait_nri_registered(Duration::from_secs(30))
                .await
                .expect("the agent registers with the runtime");
        }
        TeeNode {
            tee,
            agent,
            host,
            agent_args: args,
            env,
            turn,
        }
    }
}

/// The KubeVirt cluster to this test alone: both nodes taken (every KubeVirt test takes both, so
/// holding them this test is the only one running), the earlier tests' VirtualMachines and VMIs removed
/// (they would start again on the nodes), KubeVirt's `defaultRuntimeClass` reset (a test may have set
/// it). Two API servers on one etcd: calls to the webhook really spread (virt-controller's pod CREATEs
/// through the first, the scheduler's bindings through the second). `None` when the test should skip
/// (no KubeVirt kit or no real node here).
async fn kubevirt_to_this_test() -> Option<(&'static KubeVirt, Cluster, [NodeTurn; 2])> {
    teeguard_tests::controlplane::want_two_api_servers();
    let kv = KubeVirt::shared()?;
    let first = RealNode::shared_nth(Runtime::Containerd, 0)?;
    let second = RealNode::shared_nth(Runtime::Containerd, 1)?;
    let cluster = Cluster::connect().await?;
    let turns = [first.acquire().await, second.acquire().await];
    remove_kubevirt_objects(&cluster).await;
    kv.configure(&cluster.client, json!({"defaultRuntimeClass": null}))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    Some((kv, cluster, turns))
}

/// KubeVirt's rendering of the sample VMIs compared with the committed objects
/// ([`kubevirt::rendered`]), in the binary of the node tests to share their control plane and
/// virt-controller. It holds both nodes as a world does (the other tests change KubeVirt's
/// configuration and delete VMIs everywhere) and takes `kubevirt.io/schedulable` off them, so the pods
/// stay unscheduled as on a cluster no world has labelled; the next world labels them again.
pub async fn committed_objects_are_what_kubevirt_renders() {
    let Some((kv, cluster, turns)) = kubevirt_to_this_test().await else {
        return;
    };
    let nodes: Api<Node> = Api::all(cluster.client.clone());
    for turn in &turns {
        let unlabel = json!({"metadata": {"labels": {"kubevirt.io/schedulable": null}}});
        nodes
            .merge_patch(&turn.name, unlabel)
            .await
            .expect("take kubevirt.io/schedulable off the Node");
    }
    let namespace = teeguard_tests::fixtures::DEFAULT_NAMESPACE;
    if let Err(e) = kubevirt::rendered::compare_with_committed(kv, &cluster, namespace).await {
        panic!("{e}");
    }
}

/// Label and equip the Node as virt-handler does on a host of kind `tee` with `keys` keys: the TEE
/// labels, `kubevirt.io/schedulable`, the q35 machine type, the device-plugin resources (KubeVirt v1.9
/// sizes `devices.kubevirt.io/tdx` from `misc.capacity`; `devices.kubevirt.io/sev` is a fixed 1000).
async fn label_node(cluster: &Cluster, turn: &NodeTurn, tee: Tee, keys: u64) {
    let nodes: Api<Node> = Api::all(cluster.client.clone());
    let mut labels = serde_json::Map::new();
    for l in TEE_LABELS {
        labels.insert(l.into(), Value::Null);
    }
    let tee_labels: &[&str] = if tee == Tee::Tdx {
        &["kubevirt.io/tdx"]
    } else {
        &[
            "kubevirt.io/sev",
            "kubevirt.io/sev-es",
            "kubevirt.io/sev-snp",
        ]
    };
    for l in tee_labels {
        labels.insert((*l).into(), json!("true"));
    }
    labels.insert("kubevirt.io/schedulable".into(), json!("true"));
    labels.insert("machine-type.node.kubevirt.io/q35".into(), json!("true"));
    nodes
        .merge_patch(&turn.name, json!({"metadata": {"labels": labels}}))
        .await
        .expect("label the Node");
    let (tdx, sev) = ("devices.kubevirt.io/tdx", "devices.kubevirt.io/sev");
    let devices = if tee == Tee::Tdx {
        [(tdx, json!(keys.to_string())), (sev, Value::Null)]
    } else {
        [(sev, json!("1k")), (tdx, Value::Null)]
    };
    advertise_kubevirt_devices(&cluster.client, &turn.name, &devices).await;
}

/// Import the stand-in KubeVirt images into the node's runtime, once per node.
fn stand_in_images(turn: &NodeTurn) {
    let mut done = IMAGES.lock().unwrap_or_else(|e| e.into_inner());
    if done.iter().any(|n| n == &turn.name) {
        return;
    }
    let dir: PathBuf = turn.dir().join("kubevirt-images");
    kubevirt::images::import_stand_ins(turn, &dir).expect("stand-in KubeVirt images");
    done.push(turn.name.clone());
}

/// Delete every VirtualMachine and VMI of the cluster (an earlier test's), waiting until the VMIs are
/// gone (virt-controller removes their finalizers once their pods are).
async fn remove_kubevirt_objects(cluster: &Cluster) {
    for kind in ["VirtualMachine", "VirtualMachineInstance"] {
        let ar = kube::core::ApiResource::from_gvk(&kube::core::GroupVersionKind::gvk(
            "kubevirt.io",
            "v1",
            kind,
        ));
        let all: Api<DynamicObject> = Api::all_with(cluster.client.clone(), &ar);
        let items = all
            .list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default();
        for o in items {
            let ns = o.metadata.namespace.clone().unwrap_or_default();
            let name = o.metadata.name.clone().unwrap_or_default();
            let _ = vmis::api(&cluster.client, &ns, kind)
                .delete(&name, &DeleteParams::default())
                .await;
        }
        cluster
            .wait_none_listed(
                &format!("every {kind} of earlier tests gone"),
                Duration::from_secs(120),
                &all,
                &ListParams::default(),
            )
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    }
}

/// A TCP proxy on 127.0.0.1 to `backend` (TLS passes through); a connection is closed at once while
/// there is none, as a Service without endpoints does. Runs until the test process ends.
/// Whether the launcher pod of VMI `vmi` among `pods` runs with every container started.
pub fn running_named(pods: &[Pod], vmi: &str) -> bool {
    pods.iter().any(|p| vmi_of(p) == vmi && running(p))
}

/// The name of the VMI a launcher pod runs (KubeVirt's `kubevirt.io/domain` annotation; empty when
/// it has none).
pub fn vmi_of(pod: &Pod) -> &str {
    pod.annotations()
        .get("kubevirt.io/domain")
        .map_or("", String::as_str)
}

/// Start webhook replica `i`: even ones watch and write through the first API server, odd ones
/// through the second (when the control plane has one), as replicas of a Deployment reach the API
/// servers behind the `kubernetes` Service.
async fn start_replica(cluster: &Cluster, env: &ProcessEnv, i: usize) -> WebhookProcess {
    let kubeconfig = match &cluster.cp.second {
        Some(second) if i % 2 == 1 => second.kubeconfig.clone(),
        _ => env.kubeconfig.clone(),
    };
    let pod_name = format!("POD_NAME=teeguard-webhook-{i}");
    env.start_webhook_via(&[], &kubeconfig, &[pod_name.as_str()])
        .await
        .unwrap_or_else(|e| panic!("webhook replica {i} starts: {e}"))
}

/// Wait until the API server calls teeguard's webhooks for namespace `ns`: a TDX VMI's launcher pod
/// is created with teeguard's annotation, or refused by teeguard (virt-controller's condition says
/// which). The probe VMI is left for the caller to delete. Its node selector matches no node, so its
/// pod (when admitted) is never bound: deleting it needs no kubelet (one CI run, with the pod on a
/// node, waited over 60 s for the VMI to go).
async fn webhooks_called(cluster: &Cluster, ns: &str) -> Result<(), String> {
    let mut probe = vmis::vmi("webhook-probe", Tee::Tdx, vmis::Size::SMALL);
    probe["spec"]["nodeSelector"] = json!({"teeguard.test/probe": "no-such-node"});
    vmis::create(&cluster.client, ns, &probe)
        .await
        .map_err(|e| format!("create the probe VMI: {e}"))?;
    let api = vmis::api(&cluster.client, ns, "VirtualMachineInstance");
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), ns);
    cluster
        .wait_for_within(
            &format!("teeguard's webhooks called for {ns}"),
            Duration::from_secs(60),
            || async {
                let vmi = api.get("webhook-probe").await.ok()?;
                let refused = vmi.data["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|c| c["message"].as_str())
                    .any(|m| m.contains(".teeguard.dev\" denied"));
                let uid = vmi.metadata.uid?;
                let mutated = pods
                    .list(&ListParams::default().labels(&format!("kubevirt.io/created-by={uid}")))
                    .await
                    .ok()?
                    .items
                    .iter()
                    .any(|p| {
                        p.metadata
                            .annotations
                            .as_ref()
                            .is_some_and(|a| a.contains_key("misc-max.teeguard.dev/compute"))
                    });
                (refused || mutated).then_some(())
            },
        )
        .await
        .map_err(|e| e.to_string())
}

/// Delete every VMI of namespace `ns` and wait until they are gone: virt-controller removes a
/// VMI's finalizer once its launcher pod is gone, and the kubelet ends that pod (its scripts exit on
/// SIGTERM). The bound only keeps a stuck deletion from hanging the test: 180 s, because on a loaded
/// 2-core machine a pod deleted while its containers are still being created waits for the kubelet to
/// finish creating them first. On a timeout the panic says what is left.
pub(crate) async fn remove_vmis(cluster: &Cluster, ns: &str) {
    let api = vmis::api(&cluster.client, ns, "VirtualMachineInstance");
    let _ = api
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let gone = cluster
        .wait_none_listed(
            &format!("the VMIs of {ns} gone"),
            Duration::from_secs(180),
            &api,
            &ListParams::default(),
        )
        .await;
    if let Err(e) = gone {
        panic!("{e}; left: {}", leftovers(cluster, ns).await);
    }
}

/// What keeps the VMIs of `ns` from going: each VMI's phase, deletion and finalizers, each pod's
/// phase and deletion.
async fn leftovers(cluster: &Cluster, ns: &str) -> String {
    fn each<T>(list: kube::Result<kube::api::ObjectList<T>>, line: impl Fn(&T) -> String) -> String
    where
        T: Clone,
    {
        match list {
            Ok(l) => l.items.iter().map(line).collect::<Vec<_>>().join("; "),
            Err(e) => format!("cannot list: {e}"),
        }
    }
    let params = ListParams::default();
    let vmis = vmis::api(&cluster.client, ns, "VirtualMachineInstance");
    let vmis = each(vmis.list(&params).await, |v| {
        let deleted = v.metadata.deletion_timestamp.as_ref().map(|t| t.0);
        let phase = &v.data["status"]["phase"];
        format!(
            "VMI {} phase {phase} deleted {deleted:?} finalizers {:?}",
            v.name_any(),
            v.finalizers()
        )
    });
    let pods = Api::<Pod>::namespaced(cluster.client.clone(), ns);
    let pods = each(pods.list(&params).await, |p| {
        let deleted = p.metadata.deletion_timestamp.as_ref().map(|t| t.0);
        let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
        format!("pod {} phase {phase:?} deleted {deleted:?}", p.name_any())
    });
    format!("{vmis}; {pods}")
}

pub use teeguard_tests::node::pods::running;

pub mod chaos;
pub mod dra;
pub mod full;
pub mod lifecycle;
pub mod scenarios;
pub mod versions;
