//! Shared harness: the agent's `run` loop against the fake API server (real kube client) and a
//! simulated host.
#![allow(dead_code)]

pub mod kubelet;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use prometheus_client::registry::Registry;
use serde_json::{Value, json};
use teeguard_agent::metrics::Metrics;
use teeguard_agent::run::{AgentOptions, READY_PODS, READY_SCAN, run};
use teeguard_shared::ops::Readiness;
use teeguard_shared::{Config, TeeCapacity, TeeCapacityStatus};
use teeguard_tests::fakeapi::FakeApiServer;
use teeguard_tests::fixtures::{KataTee, TDX_KEYS, Tee, VirtLauncherPod, kata_pod};
use teeguard_tests::host::{QosClass, SimHost};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// The node every test runs on.
pub const NODE: &str = "node01";
/// Upper bound of every wait.
pub const WAIT: Duration = Duration::from_secs(15);

/// Configuration with a 50 ms poll interval.
pub fn config(extra_agent: &str) -> Config {
    Config::from_yaml(&format!(
        "agent:\n  pollInterval: 50ms\n  heartbeatInterval: 30s\n{extra_agent}"
    ))
    .expect("config")
}

/// The options of a test agent on `node` reading `root`: short backoffs and API timeout.
pub fn options(node: &str, root: &std::path::Path, config: Config) -> AgentOptions {
    let mut opts = AgentOptions::new(node, root, config);
    opts.backoff_initial = Duration::from_millis(20);
    opts.backoff_max = Duration::from_millis(200);
    opts.api_timeout = Duration::from_secs(5);
    opts
}

/// A running agent.
pub struct Agent {
    pub api: FakeApiServer,
    pub shutdown: CancellationToken,
    pub task: JoinHandle<teeguard_agent::Result<()>>,
    pub readiness: Readiness,
    pub registry: Arc<Registry>,
}

impl Agent {
    /// Start `run` against `api` reading `root`.
    pub fn start(api: &FakeApiServer, root: &std::path::Path, config: Config) -> Agent {
        Self::start_on(api, NODE, root, config)
    }

    /// [`Agent::start`] for another node than [`NODE`].
    pub fn start_on(
        api: &FakeApiServer,
        node: &str,
        root: &std::path::Path,
        config: Config,
    ) -> Agent {
        Self::start_with(api, options(node, root, config))
    }

    /// Start `run` with `opts` (from [`options`]).
    pub fn start_with(api: &FakeApiServer, opts: AgentOptions) -> Agent {
        let mut registry = Registry::default();
        let metrics = Metrics::new(&mut registry);
        let readiness = Readiness::new(&[READY_SCAN, READY_PODS]);
        let shutdown = CancellationToken::new();
        let task = tokio::spawn(run(
            api.client(),
            opts,
            metrics,
            readiness.clone(),
            shutdown.clone(),
        ));
        Agent {
            api: api.clone(),
            shutdown,
            task,
            readiness,
            registry: Arc::new(registry),
        }
    }

    /// The published status, if any.
    pub fn status(&self) -> Option<TeeCapacityStatus> {
        self.api
            .get_typed::<TeeCapacity>(None, NODE)
            .expect("typed TeeCapacity")
            .and_then(|t| t.status)
    }

    /// Wait until the published status satisfies `pred`.
    pub async fn wait_status(
        &self,
        what: &str,
        pred: impl Fn(&TeeCapacityStatus) -> bool,
    ) -> TeeCapacityStatus {
        let got = self
            .api
            .wait_for(WAIT, what, |api| {
                api.get_typed::<TeeCapacity>(None, NODE)
                    .ok()
                    .flatten()
                    .and_then(|t| t.status)
                    .filter(|s| pred(s))
            })
            .await;
        match got {
            Ok(s) => s,
            Err(e) => panic!("{e}; last status: {:#?}", self.status()),
        }
    }

    /// The Node as stored.
    pub fn node(&self) -> Node {
        self.api
            .get_typed::<Node>(None, NODE)
            .expect("typed node")
            .expect("node exists")
    }

    /// Wait until the Node satisfies `pred`.
    pub async fn wait_node(&self, what: &str, pred: impl Fn(&Node) -> bool) -> Node {
        match self
            .api
            .wait_for(WAIT, what, |api| {
                api.get_typed::<Node>(None, NODE)
                    .ok()
                    .flatten()
                    .filter(|n| pred(n))
            })
            .await
        {
            Ok(n) => n,
            Err(e) => panic!(
                "{e}; node status: {:?}",
                self.node().status.map(|s| s.capacity)
            ),
        }
    }

    /// The metrics text.
    pub fn metrics(&self) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry).expect("encode");
        out
    }

    /// Series `name` summed over the samples whose labels include every `(key, value)` of
    /// `labels` (0 when none is exported).
    pub fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        teeguard_tests::prom::Scrape::parse(&self.metrics()).sum(name, labels)
    }

    /// Stop the agent and check that it returns promptly and cleanly.
    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("agent stops after shutdown")
            .expect("agent task does not panic")
            .expect("agent returns Ok");
    }
}

/// The advertised capacity of a resource on the Node, if any.
pub fn node_capacity(node: &Node, resource: &str) -> Option<String> {
    quantity(
        node.status.as_ref().and_then(|s| s.capacity.as_ref()),
        resource,
    )
}

/// The allocatable value of a resource on the Node, if any.
pub fn node_allocatable(node: &Node, resource: &str) -> Option<String> {
    quantity(
        node.status.as_ref().and_then(|s| s.allocatable.as_ref()),
        resource,
    )
}

/// A resource's quantity in a Node status map, as written.
fn quantity(map: Option<&BTreeMap<String, Quantity>>, resource: &str) -> Option<String> {
    map.and_then(|m| m.get(resource)).map(|q| q.0.clone())
}

/// Create a running virt-launcher pod for `vmi` on [`NODE`] requesting one TDX key, add its cgroup to
/// the host (and start its VM when `start`). Returns the pod's UID.
pub fn tdx_vm(api: &FakeApiServer, host: &SimHost, vmi: &str, start: bool) -> String {
    let pod = VirtLauncherPod::for_tee(vmi, Tee::Tdx)
        .request(TDX_KEYS, "1")
        .running_on(NODE)
        .build();
    let uid = create_pod(api, &pod);
    host.add_pod(&uid, QosClass::Burstable, &["compute"])
        .expect("pod cgroup");
    if start {
        host.start_vm(&uid, "compute", teeguard_tests::host::TDX)
            .expect("vm");
    }
    uid
}

/// A pod bound to [`NODE`] that the kubelet has not started (no cgroup). Returns its UID.
pub fn pending_tdx_pod(api: &FakeApiServer, vmi: &str) -> String {
    let pod = VirtLauncherPod::for_tee(vmi, Tee::Tdx)
        .request(TDX_KEYS, "1")
        .generated_name()
        .node_name(NODE)
        .build();
    create_pod(api, &pod)
}

/// A running Kata TDX pod (key through `spec.overhead`) whose VMM is charged in its sandbox cgroup.
pub fn kata_tdx(api: &FakeApiServer, host: &SimHost, name: &str) -> String {
    let mut v = serde_json::to_value(kata_pod(name, KataTee::Tdx)).expect("json");
    v["spec"]["nodeName"] = json!(NODE);
    v["status"] = json!({"phase": "Running", "qosClass": "Burstable"});
    let pod: Pod = serde_json::from_value(v).expect("pod");
    let uid = create_pod(api, &pod);
    host.add_pod(&uid, QosClass::Burstable, &["app"])
        .expect("cgroup");
    host.start_vm(
        &uid,
        teeguard_tests::host::SANDBOX,
        teeguard_tests::host::TDX,
    )
    .expect("kata vm");
    uid
}

/// Create a pod in the fake server; returns the UID the server gave it.
pub fn create_pod(api: &FakeApiServer, pod: &Pod) -> String {
    let created: Value = api.create(pod).expect("create pod");
    created["metadata"]["uid"]
        .as_str()
        .expect("uid")
        .to_string()
}
