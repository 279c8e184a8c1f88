//! Scheduling against a real kube-apiserver and kube-scheduler (see `teeguard_tests::controlplane`):
//! the agent process on simulated hosts for Nodes created through the API (no kubelet: pods stay
//! Pending, bound pods count as `pending` keys), the webhook process registered by URL with the
//! chart's webhook configurations, and the real scheduler binding the virt-launcher pods. Skipped
//! (one line) without control plane binaries, unless `CI=true`.

mod chart_support;

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::json;
use teeguard_shared::TeeCapacity;
use teeguard_tests::e2e::{AgentProcess, ProcessEnv, WebhookProcess};
use teeguard_tests::fixtures::{NodeBuilder, TDX_KEYS, Tee};
use teeguard_tests::host::{SimHost, TDX};
use teeguard_tests::patch::MergePatch;
use teeguard_tests::realcluster::{Cluster, TEST_LABEL, advertise, event_line, within};

const DEADLINE: Duration = Duration::from_secs(150);

/// One test's world: its namespace and Nodes (labelled with the test's name, which its pods select),
/// an agent per Node on a simulated host, and the webhook.
struct World {
    cluster: Cluster,
    test: String,
    ns: String,
    hosts: Vec<(String, SimHost)>,
    _agents: Vec<AgentProcess>,
    _webhook: WebhookProcess,
    env: ProcessEnv,
}

impl World {
    /// `nodes`: (suffix, TDX keys). `config`: the teeguard configuration of both processes.
    async fn start(test: &str, nodes: &[(&str, u64)], config: &str) -> Option<World> {
        let cluster = Cluster::connect().await?;
        let env = cluster.process_env(config).expect("process env");
        let ns = cluster.namespace(test, test, &[]).await.expect("namespace");
        let mut hosts = Vec::new();
        let mut agents = Vec::new();
        for (suffix, keys) in nodes {
            let name = format!("{ns}-{suffix}");
            cluster
                .node(&NodeBuilder::new(&name).tdx(*keys).label(TEST_LABEL, test))
                .await
                .expect("node");
            let host = SimHost::builder()
                .capacity(TDX, *keys)
                .build()
                .expect("simulated host");
            agents.push(env.start_agent(&name, &host).await.expect("agent starts"));
            hosts.push((name, host));
        }
        let webhook = chart_support::serve_default_webhooks(&cluster, &env, test, &ns).await;
        Some(World {
            cluster,
            test: test.to_string(),
            ns,
            hosts,
            _agents: agents,
            _webhook: webhook,
            env,
        })
    }

    fn host(&self, node: &str) -> &SimHost {
        &self.hosts.iter().find(|(n, _)| n == node).expect("host").1
    }

    /// A world of one Node of `keys` free keys (default configuration), once its first report is
    /// in; with the Node's name.
    async fn one_node(test: &str, keys: u64) -> Option<(World, String)> {
        let w = World::start(test, &[("a", keys)], "").await?;
        let node = w.node(0);
        w.wait_report(&node, 0, keys).await;
        Some((w, node))
    }

    fn node(&self, i: usize) -> String {
        self.hosts[i].0.clone()
    }

    /// Create a TDX VM (VMI and virt-launcher pod, selecting this test's Nodes).
    async fn create_vm(&self, name: &str) -> kube::Result<Pod> {
        let selector = [(TEST_LABEL, self.test.as_str())];
        self.cluster
            .create_vm(&self.ns, name, Tee::Tdx, &selector)
            .await
            .expect("VMI")
            .1
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(self.cluster.client.clone(), &self.ns)
    }

    /// Wait until the scheduler has bound `pod`; returns the node.
    async fn wait_bound(&self, pod: &Pod, timeout: Duration) -> String {
        let name = pod.metadata.name.clone().expect("name");
        let pods = self.pods();
        let bound = self
            .cluster
            .wait_for_within(&format!("pod {name} to be bound"), timeout, || async {
                pods.get(&name).await.ok()?.spec?.node_name
            })
            .await;
        match bound {
            Ok(node) => node,
            Err(e) => panic!(
                "{e}; its events: {:?}; logs:\n{}",
                self.events_of(&name).await,
                self.env.all_logs()
            ),
        }
    }

    /// `reason: message` of the events about pod `name`.
    async fn events_of(&self, name: &str) -> Vec<String> {
        let events = self.cluster.events_about(&self.ns, name).await;
        events.iter().map(event_line).collect()
    }

    /// The node's report, once it shows `pending` keys and `free`.
    async fn wait_report(&self, node: &str, pending: u64, free: u64) -> TeeCapacity {
        let api: Api<TeeCapacity> = Api::all(self.cluster.client.clone());
        self.cluster
            .wait_for(
                &format!("{node}'s report: pending {pending}, free {free}"),
                || async {
                    let r = api.get(node).await.ok()?;
                    let tdx = r.status.as_ref()?.tdx.as_ref()?;
                    (tdx.pending == pending && tdx.free == free).then_some(r)
                },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}; logs:\n{}", self.env.all_logs()))
    }
}

fn tdx_allocatable(n: &Node) -> Option<String> {
    n.status
        .as_ref()?
        .allocatable
        .as_ref()?
        .get(TDX_KEYS)
        .map(|q| q.0.clone())
}

// The bug of the days of the per-replica ledger, as seen on a real cluster: VM 1 and VM 2 created back to back onto a node with 2
// free keys are both bound within 2 s; VM 3 is refused with the report's own figures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_to_back_vms_are_both_bound_and_a_third_is_refused_with_the_reports_figures() {
    within(DEADLINE, async {
        let Some(w) = World::start("ledger", &[("a", 2)], "").await else {
            return;
        };
        let node = w.node(0);
        // The agent published the report and the Node's allocatable keys.
        let nodes: Api<Node> = Api::all(w.cluster.client.clone());
        let allocatable = w
            .cluster
            .wait_for("the Node's allocatable TDX keys", || async {
                tdx_allocatable(&nodes.get(&node).await.ok()?)
            })
            .await
            .expect("advertised");
        assert_eq!(allocatable, "2");

        let vm1 = w.create_vm("vm-1").await.expect("vm-1 admitted");
        let started = Instant::now();
        assert_eq!(w.wait_bound(&vm1, Duration::from_secs(20)).await, node);
        // The agent's report counts vm-1 (its immediate publish, not a heartbeat).
        let report = w.wait_report(&node, 1, 1).await;
        let uid1 = vm1.metadata.uid.clone().expect("uid");
        assert!(
            report
                .status
                .as_ref()
                .is_some_and(|s| s.counted_pods.contains(&uid1)),
            "{report:?}"
        );
        let vm2 = w
            .create_vm("vm-2")
            .await
            .unwrap_or_else(|e| panic!("vm-2 refused right after vm-1: {e}"));
        assert_eq!(w.wait_bound(&vm2, Duration::from_secs(20)).await, node);
        let gap = started.elapsed();
        assert!(
            gap < Duration::from_secs(2),
            "vm-2 bound {gap:?} after vm-1"
        );

        w.wait_report(&node, 2, 0).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let refused = w.create_vm("vm-3").await.expect_err("vm-3 refused");
        let msg = refused.to_string();
        assert!(
            msg.contains("no node can host this TDX VM")
                && msg.contains(&format!("{node} 0/2 free"))
                && !msg.contains("just admitted"),
            "{msg}"
        );
    })
    .await;
}

// A node the scheduler still counts as having room (its extended resource was advertised once, as
// Kata's NFD rule does, with teeguard's advertising off) but whose keys are taken outside
// Kubernetes: teeguard refuses the binding, the pod shows FailedScheduling with teeguard's message,
// and once a key is freed the scheduler's retry binds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_node_refuses_the_binding_until_a_key_is_freed() {
    within(DEADLINE, async {
        let config = "agent:\n  advertise: false\n";
        let Some(w) = World::start("full", &[("a", 2), ("b", 2)], config).await else {
            return;
        };
        let (full, cordoned) = (w.node(0), w.node(1));
        let nodes: Api<Node> = Api::all(w.cluster.client.clone());
        for n in [&full, &cordoned] {
            advertise(&w.cluster.client, n, &[(TDX_KEYS, json!("2"))])
                .await
                .expect("advertise the total, as NFD does");
        }
        // Node b has free keys but takes no pods: teeguard's check at pod CREATE (some node of the
        // pod's selector can host it) passes, and the scheduler can only try node a.
        nodes
            .merge_patch(&cordoned, json!({"spec": {"unschedulable": true}}))
            .await
            .expect("cordon");
        w.host(&full)
            .add_external("legacy-vm", TDX, 2)
            .expect("VMs outside Kubernetes take both keys");
        w.wait_report(&full, 0, 0).await;
        tokio::time::sleep(Duration::from_millis(300)).await;

        let vm = w.create_vm("vm-1").await.expect("admitted at CREATE");
        let name = vm.metadata.name.clone().expect("name");
        let event = w
            .cluster
            .wait_for("FailedScheduling with teeguard's message", || async {
                let events = w.cluster.events_about(&w.ns, &name).await;
                events.into_iter().find(|e| {
                    e.reason.as_deref() == Some("FailedScheduling")
                        && e.message.as_deref().is_some_and(|m| {
                            m.contains(&format!("node {full} cannot host this TDX VM"))
                        })
                })
            })
            .await
            .unwrap_or_else(|e| panic!("{e}; logs:\n{}", w.env.all_logs()));
        let msg = event.message.unwrap_or_default();
        assert!(
            msg.contains("0/2 free (2 held outside Kubernetes)"),
            "{msg}"
        );
        assert_eq!(
            w.pods()
                .get(&name)
                .await
                .expect("pod")
                .spec
                .and_then(|s| s.node_name),
            None,
            "not bound while the node is full"
        );

        // A key is freed: the scheduler's next retry (backoff up to 10 s) is admitted.
        w.host(&full).remove_external("legacy-vm").expect("stop");
        w.host(&full)
            .add_external("legacy-vm-2", TDX, 1)
            .expect("one key stays outside");
        w.wait_report(&full, 0, 1).await;
        assert_eq!(w.wait_bound(&vm, Duration::from_secs(40)).await, full);
    })
    .await;
}

/// Delete `pod` (no grace: no kubelet runs here to confirm a graceful stop).
async fn delete_now(w: &World, pod: &Pod) {
    let name = pod.metadata.name.clone().expect("name");
    w.pods()
        .delete(&name, &DeleteParams::default().grace_period(0))
        .await
        .expect("pod deleted");
}

// Issue #28: a VM bound, counted by the agent's report (no other admission runs meanwhile), then
// deleted; the next two VMs both fit the node's two free keys. With reservations ended only by a
// check that sees the counting report, vm-1's came back once the report stopped listing it, and
// vm-3 was refused as "1 just admitted, not in the report yet" for the rest of ledgerTtl (30 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_vms_reservation_does_not_come_back_and_the_next_two_vms_fit() {
    within(DEADLINE, async {
        let Some((w, node)) = World::one_node("deleted", 2).await else {
            return;
        };
        let vm1 = w.create_vm("vm-1").await.expect("vm-1 admitted");
        assert_eq!(w.wait_bound(&vm1, Duration::from_secs(20)).await, node);
        // The report counts vm-1; no check on the node runs while it is the cached one.
        w.wait_report(&node, 1, 1).await;
        delete_now(&w, &vm1).await;
        w.wait_report(&node, 0, 2).await;
        tokio::time::sleep(Duration::from_millis(300)).await;

        let vm2 = w.create_vm("vm-2").await.expect("vm-2 admitted");
        assert_eq!(w.wait_bound(&vm2, Duration::from_secs(20)).await, node);
        let vm3 = w
            .create_vm("vm-3")
            .await
            .unwrap_or_else(|e| panic!("vm-3 refused although vm-2 holds the only key taken: {e}"));
        assert_eq!(w.wait_bound(&vm3, Duration::from_secs(20)).await, node);
        w.wait_report(&node, 2, 0).await;
    })
    .await;
}

// Issue #28: a VM deleted and re-created at once on a full node, as KubeVirt does when a VMI is
// restarted: the new launcher pod is admitted as soon as the agent's report shows the key free
// (virt-controller retries a refused pod CREATE; so does the test, every 100 ms).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_deleted_and_recreated_at_once_on_a_full_node_is_admitted_when_the_key_is_free() {
    within(DEADLINE, async {
        let Some((w, node)) = World::one_node("recreate", 1).await else {
            return;
        };
        let vm1 = w.create_vm("vm-1").await.expect("vm-1 admitted");
        assert_eq!(w.wait_bound(&vm1, Duration::from_secs(20)).await, node);
        w.wait_report(&node, 1, 0).await;

        delete_now(&w, &vm1).await;
        let deleted = Instant::now();
        let selector = [(TEST_LABEL, w.test.as_str())];
        let uid = w
            .cluster
            .create_vmi(&w.ns, "vm-1-restarted", Tee::Tdx)
            .await
            .expect("VMI");
        let pod = Cluster::launcher_pod(&w.ns, "vm-1-restarted", &uid, Tee::Tdx, &selector)
            .expect("launcher pod");
        let mut refusals = 0;
        let created = loop {
            match w.pods().create(&PostParams::default(), &pod).await {
                Ok(p) => break p,
                Err(e) => {
                    refusals += 1;
                    assert!(
                        deleted.elapsed() < Duration::from_secs(10),
                        "the re-created VM is still refused {:?} after the deletion \
                         ({refusals} tries): {e}; logs:\n{}",
                        deleted.elapsed(),
                        w.env.all_logs()
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        let admitted = deleted.elapsed();
        eprintln!("re-created VM admitted {admitted:?} after the deletion ({refusals} refusals)");
        assert_eq!(w.wait_bound(&created, Duration::from_secs(20)).await, node);
        w.wait_report(&node, 1, 0).await;
    })
    .await;
}

// The benches read kube-scheduler's own metrics (`ControlPlane::scheduler_metrics`): its secure port
// answers the admin with the scheduler's count of pods scheduled, which a binding raises.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_schedulers_own_metrics_count_a_pod_it_bound() {
    let Some(cluster) = Cluster::connect().await else {
        return;
    };
    let scheduled = |text: &str| {
        teeguard_tests::prom::Scrape::parse(text).sum(
            "scheduler_schedule_attempts_total",
            &[("result", "scheduled")],
        )
    };
    let before = scheduled(&cluster.cp.scheduler_metrics().await.expect("metrics"));
    let node = teeguard_tests::controlplane::unique_name("metrics");
    cluster
        .node(&NodeBuilder::new(&node).label(TEST_LABEL, &node))
        .await
        .expect("node");
    let ns = cluster
        .namespace(&node, &node, &[])
        .await
        .expect("namespace");
    let pod = teeguard_tests::node::pods::plain(&ns, "p", &[("c", &[])], &[(TEST_LABEL, &node)]);
    let pods: Api<Pod> = Api::namespaced(cluster.client.clone(), &ns);
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("pod");
    cluster
        .wait_for("the pod bound", || async {
            pods.get("p").await.ok()?.spec?.node_name.map(|_| ())
        })
        .await
        .expect("bound");
    let counted = cluster
        .wait_for("the scheduler counting it", || async {
            let now = scheduled(&cluster.cp.scheduler_metrics().await.ok()?);
            (now > before).then_some(now)
        })
        .await;
    assert!(counted.is_ok(), "{counted:?}");
    let _ = pods
        .delete("p", &DeleteParams::default().grace_period(0))
        .await;
}

// A launcher pod admitted at its CREATE holds its key for other VMIs' pods until its binding is
// reviewed (two pods created together cannot both be admitted for a last key). Deleted before any
// binding, it holds nothing: the pod cache's delete event ends the promise. Before, the key stayed
// promised for PROMISE_TTL (10 s) and the next VM was refused as "1 just admitted, not in the report
// yet" (a KubeVirt test's probe VMI, deleted at once, gave the next test's first refusal that note).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launcher_pod_deleted_before_its_binding_leaves_its_key_to_the_next_vm_at_once() {
    within(DEADLINE, async {
        let Some((w, _)) = World::one_node("unbound", 1).await else {
            return;
        };
        let selector = [(TEST_LABEL, w.test.as_str())];
        // Pods no scheduler binds: they stay between their CREATE and a binding.
        let unbound = |vmi: &str, uid: &str| {
            let mut pod =
                Cluster::launcher_pod(&w.ns, vmi, uid, Tee::Tdx, &selector).expect("launcher pod");
            if let Some(spec) = pod.spec.as_mut() {
                spec.scheduler_name = Some("no-such-scheduler".into());
            }
            pod
        };
        let uid_a = w
            .cluster
            .create_vmi(&w.ns, "vm-a", Tee::Tdx)
            .await
            .expect("VMI");
        let admitted = Instant::now();
        let pod_a = w
            .pods()
            .create(&PostParams::default(), &unbound("vm-a", &uid_a))
            .await
            .expect("vm-a's pod admitted: the node's key is free");
        let uid_b = w
            .cluster
            .create_vmi(&w.ns, "vm-b", Tee::Tdx)
            .await
            .expect("VMI");
        let pod_b = unbound("vm-b", &uid_b);
        let refused = w
            .pods()
            .create(&PostParams::default(), &pod_b)
            .await
            .expect_err("vm-b refused while vm-a's pod, not bound yet, holds the only key");
        assert!(
            refused.to_string().contains("0/1 free (1 just admitted"),
            "{refused}"
        );

        delete_now(&w, &pod_a).await;
        let deleted = Instant::now();
        // The webhook sees the deletion through its pod watch, within milliseconds. Before, the key
        // stayed promised until 10 s after vm-a's admission (PROMISE_TTL): admitted within 9 s of it
        // tells the two apart with seconds of slack for a loaded machine.
        let bound = Duration::from_secs(9);
        let mut refusals = 0;
        loop {
            match w.pods().create(&PostParams::default(), &pod_b).await {
                Ok(_) => break,
                Err(e) => {
                    refusals += 1;
                    assert!(
                        admitted.elapsed() < bound,
                        "vm-b still refused {:?} after vm-a's pod was deleted, {:?} after its \
                         admission ({refusals} tries): {e}; logs:\n{}",
                        deleted.elapsed(),
                        admitted.elapsed(),
                        w.env.all_logs()
                    );
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        eprintln!(
            "vm-b admitted {:?} after vm-a's pod was deleted ({refusals} refusals)",
            deleted.elapsed()
        );
    })
    .await;
}
