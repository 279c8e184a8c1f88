//! The agent's `run` in a guest, against the real control plane on the host
//! (`teeguard_tests::controlplane`): the guest reaches the API server only through QEMU's user-mode
//! network (`restrict=on`, one `guestfwd` from `10.0.2.100:6443` to the API server's port on the host's
//! 127.0.0.1), with a kubeconfig naming `localhost` as the TLS server name (the API server's
//! certificate is for `localhost` and 127.0.0.1). Pods are created through the API server, bound to
//! the test's Node (no kubelet: the test plays it, creating their cgroups in the guest).

use std::time::Duration;

use base64::Engine as _;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use serde_json::{Value, json};
use teeguard_shared::TeeCapacity;
use teeguard_tests::e2e::last_lines;
use teeguard_tests::fixtures::NodeBuilder;
use teeguard_tests::realcluster::Cluster;
use teeguard_tests::teevm::{AGENT, API_ADDRESS, Guest, GuestOptions, Kernel, Kit, Spawned};

use super::{boot, ok, pod};

/// The agent's poll interval in these tests.
pub const POLL: Duration = Duration::from_millis(500);
/// How long the agent may take to publish what a scan showed: two polls, and slack for a guest
/// emulated on a busy 2-core machine (its scans, the TLS round trips through QEMU's network).
pub const REPORT_WITHIN: Duration = Duration::from_secs(30);

/// One test's world: a guest with `fake_tee` loaded and the agent running in it, the test's Node and
/// namespace on the control plane.
pub struct AgentWorld {
    /// The agent's process in the guest.
    pub agent: Spawned,
    /// The guest.
    pub guest: Guest,
    /// The control plane.
    pub cluster: Cluster,
    /// The Node the agent reports for.
    pub node: String,
    /// The test's namespace.
    pub ns: String,
}

impl AgentWorld {
    /// Boot a guest of `kernel` with capacities `sev` / `sev_es`, and start the agent with `config`
    /// (the configuration file's YAML; `agent.pollInterval` is [`POLL`] unless it sets it). `None`
    /// when the test should skip (no kit or no control plane, and `CI` is not `true`).
    pub async fn start(
        kernel: Kernel,
        test: &str,
        config: &str,
        sev: u64,
        sev_es: u64,
    ) -> Option<AgentWorld> {
        Kit::get(kernel)?;
        let cluster = Cluster::connect().await?;
        let node = teeguard_tests::controlplane::unique_name(test);
        cluster
            .node(&NodeBuilder::new(&node))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let ns = cluster
            .namespace(test, test, &[])
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let port: u16 = cluster
            .cp
            .url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("the API server's port");
        let guest = boot(
            kernel,
            GuestOptions {
                agent: true,
                forward_to: Some(port),
                ..GuestOptions::default()
            },
        )
        .await?;
        ok(&guest, guest.load_fake_tee(sev, sev_es).await);
        let kubeconfig = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: host\n  cluster:\n    server: https://{API_ADDRESS}\n    \
             tls-server-name: localhost\n    certificate-authority-data: {}\nusers:\n- name: admin\n  user:\n    \
             token: {}\ncontexts:\n- name: host\n  context: {{cluster: host, user: admin}}\ncurrent-context: host\n",
            base64::engine::general_purpose::STANDARD.encode(&cluster.cp.ca_pem),
            cluster.cp.admin_token
        );
        std::fs::write(guest.share().join("kubeconfig"), kubeconfig).expect("write the kubeconfig");
        let config = if config.contains("pollInterval") {
            config.to_string()
        } else {
            format!(
                "agent:\n  pollInterval: {}ms\n  heartbeatInterval: 5s\n{config}",
                POLL.as_millis()
            )
        };
        std::fs::write(guest.share().join("config.yaml"), config).expect("write the config");
        let agent = ok(
            &guest,
            guest
                .spawn(
                    "agent",
                    &format!(
                        "export KUBECONFIG=/host/kubeconfig NODE_NAME={node}\n\
                         exec {AGENT} run --cgroup-root /sys/fs/cgroup --config /host/config.yaml \
                         --admin-addr 127.0.0.1:8081 --log-format json\n"
                    ),
                )
                .await,
        );
        let world = AgentWorld {
            agent,
            guest,
            cluster,
            node,
            ns,
        };
        world
            .wait_report("the agent's first report", |s| {
                super::condition(s, "KernelReadable").0 == "True"
            })
            .await;
        Some(world)
    }

    /// Create a pod bound to the Node in namespace `ns`: one `compute` container requesting
    /// `requests`, with `labels`; returns it as stored (with its UID).
    pub async fn create_pod(
        &self,
        ns: &str,
        name: &str,
        requests: &[(&str, u64)],
        labels: &[(&str, &str)],
    ) -> Pod {
        let mut v = pod(ns, name, "", "Pending", requests, labels);
        v["spec"]["nodeName"] = json!(self.node);
        let meta = v["metadata"].as_object_mut().expect("metadata");
        meta.remove("uid");
        v.as_object_mut().expect("pod").remove("status");
        let p: Pod = serde_json::from_value(v).expect("pod");
        Api::<Pod>::namespaced(self.cluster.client.clone(), ns)
            .create(&PostParams::default(), &p)
            .await
            .unwrap_or_else(|e| panic!("create pod {ns}/{name}: {e}"))
    }

    /// The report's status as JSON (`Null` before the first).
    pub async fn status(&self) -> Value {
        let api: Api<TeeCapacity> = Api::all(self.cluster.client.clone());
        api.get_opt(&self.node)
            .await
            .ok()
            .flatten()
            .and_then(|r| r.status)
            .map(|s| serde_json::to_value(s).expect("status"))
            .unwrap_or(Value::Null)
    }

    /// Wait (up to [`REPORT_WITHIN`]) until the report satisfies `check`; panics with the report and
    /// the agent's log.
    pub async fn wait_report(&self, what: &str, mut check: impl FnMut(&Value) -> bool) -> Value {
        let deadline = std::time::Instant::now() + REPORT_WITHIN;
        loop {
            let s = self.status().await;
            if !s.is_null() && check(&s) {
                return s;
            }
            if std::time::Instant::now() >= deadline {
                panic!(
                    "{what}: not within {REPORT_WITHIN:?}; the report: {s:#}\n{}",
                    self.diagnostics()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `(reason, message)` of the Events about pod `ns/name`.
    pub async fn events(&self, ns: &str, name: &str) -> Vec<(String, String)> {
        let events = self.cluster.events_about(ns, name).await;
        events
            .into_iter()
            .map(|e| (e.reason.unwrap_or_default(), e.message.unwrap_or_default()))
            .collect()
    }

    /// Wait (up to [`REPORT_WITHIN`]) for an Event with `reason` about pod `ns/name`; its message.
    pub async fn wait_event(&self, ns: &str, name: &str, reason: &str) -> String {
        let deadline = std::time::Instant::now() + REPORT_WITHIN;
        loop {
            let events = self.events(ns, name).await;
            if let Some((_, m)) = events.iter().find(|(r, _)| r == reason) {
                return m.clone();
            }
            if std::time::Instant::now() >= deadline {
                panic!(
                    "no {reason} Event about {ns}/{name} within {REPORT_WITHIN:?}: {events:?}\n{}",
                    self.diagnostics()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The agent's log lines whose message is `message`, as JSON.
    pub fn log_lines(&self, message: &str) -> Vec<Value> {
        self.agent
            .output()
            .lines()
            .filter_map(|l| teeguard_tests::e2e::json_log_line(l, message))
            .collect()
    }

    /// The agent's log (its last lines) and the guest's console, for failures.
    pub fn diagnostics(&self) -> String {
        format!(
            "----- the agent's log (last lines) -----\n{}\n----- the guest's console (last lines) -----\n{}",
            last_lines(&self.agent.output(), 40),
            last_lines(&self.guest.console(), 10)
        )
    }
}
