//! End-to-end: Node Feature Discovery arriving after teeguard and leaving again (issue #20). The real
//! `teeguard-agent` and `teeguard-webhook` run as processes against the fake API server; the test plays
//! NFD's nfd-master with the same two writes it makes (a JSON Patch on the Node's status, then one on
//! its annotation) and checks every version of the Node the API server stored in between (a watch
//! replays them all from the server's history), not just the end state. Also from issue #20: the
//! agent's `teeguard_agent_enforcing` gauge, which the `TeeguardEnforcementFailing` alert reads.

use kube::ResourceExt;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{WatchEvent, WatchParams};
use serde_json::{Value, json};
use teeguard_shared::names::{
    AGENT_EXTENDED_RESOURCES_ANNOTATION, NFD_EXTENDED_RESOURCES_ANNOTATION, conditions as ct,
};
use teeguard_tests::e2e::{E2eEnv, NODE, World};
use teeguard_tests::fakeapi::PatchType;
use teeguard_tests::fixtures::{self, KataTee, NodeBuilder, TDX_KEYS, kata_pod};
use teeguard_tests::host::{MiscDelegation, SANDBOX, SimHost, TDX};

/// The agent's poll interval in these tests: the bound on how long the key resource may be missing
/// from the Node when NFD removes its value on leaving.
const POLL: Duration = Duration::from_millis(500);

const CONFIG: &str = "agent:\n  pollInterval: 500ms\n  heartbeatInterval: 1s\n";

/// TDX keys of the host; 3 of them are held by a VM outside Kubernetes, so teeguard advertises 13
/// while kata-deploy's NodeFeatureRule makes NFD advertise all 16.
const KEYS: u64 = 16;
const EXTERNAL: u64 = 3;

const TEST_DEADLINE: Duration = Duration::from_secs(150);
const WAIT: Duration = Duration::from_secs(20);

async fn bounded<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_DEADLINE, f)
        .await
        .expect("the scenario finished within its deadline");
}

/// A world whose host has [`KEYS`] TDX keys, [`EXTERNAL`] of them held outside Kubernetes, with the
/// agent advertising `KEYS − EXTERNAL` on the Node.
async fn world() -> World {
    let w = World::start(KEYS, CONFIG).await.expect("world starts");
    w.host
        .add_external("legacy-vm", TDX, EXTERNAL)
        .expect("a VM outside Kubernetes");
    let s = w.settle().await.expect("settled");
    assert_eq!(s.external, EXTERNAL, "{s:?}");
    wait_node(&w, "the agent advertises 13", |n| {
        values(n) == (Some(13), Some(13))
    })
    .await;
    w
}

fn rv(n: &Node) -> u64 {
    n.metadata
        .resource_version
        .as_deref()
        .and_then(|v| v.parse().ok())
        .expect("resourceVersion")
}

/// The key resource's capacity and allocatable: `None` where absent (or not a whole number).
fn values(n: &Node) -> (Option<u64>, Option<u64>) {
    let (c, a) = fixtures::node_resource(n, TDX_KEYS);
    let whole = |v: Option<String>| v?.parse().ok();
    (whole(c), whole(a))
}

fn listed(n: &Node, annotation: &str) -> BTreeSet<String> {
    n.annotations()
        .get(annotation)
        .map(String::as_str)
        .map(|v| v.split(',').map(str::to_string).collect())
        .unwrap_or_default()
}

async fn wait_node(w: &World, what: &str, pred: impl Fn(&Node) -> bool) -> Node {
    let v = w
        .env
        .api
        .wait_for_object("nodes", None, NODE, WAIT, |v| {
            serde_json::from_value::<Node>(v.clone()).is_ok_and(|n| pred(&n))
        })
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}; node now: {:?}", w.node().status));
    serde_json::from_value(v).expect("node")
}

/// The `Advertising` condition of the node's report, once `pred` holds for (status, message).
async fn wait_advertising(w: &World, what: &str, pred: impl Fn(&str, &str) -> bool) -> String {
    let found = w
        .env
        .api
        .wait_for(WAIT, what, |_| {
            let s = w.env.report(NODE)?;
            let c = s.condition(ct::ADVERTISING)?;
            pred(&c.status, &c.message).then(|| c.message.clone())
        })
        .await;
    found.unwrap_or_else(|e| {
        panic!(
            "{what}: {e}; Advertising now: {:?}",
            w.env
                .report(NODE)
                .and_then(|s| s.condition(ct::ADVERTISING).cloned())
        )
    })
}

/// Every version of the Node the API server stored after resourceVersion `after`, oldest first, up
/// to the current one (a watch from `after` replays them from the server's history).
async fn node_versions_since(w: &World, after: u64) -> Vec<Node> {
    let last = rv(&w.node());
    if last <= after {
        return Vec::new();
    }
    let api: Api<Node> = Api::all(w.env.api.client());
    let wp = WatchParams::default()
        .fields(&format!("metadata.name={NODE}"))
        .timeout(10);
    let stream = api
        .watch(&wp, &after.to_string())
        .await
        .expect("watch the Node");
    futures::pin_mut!(stream);
    let mut out = Vec::new();
    while let Some(ev) = stream.try_next().await.expect("watch event") {
        match ev {
            WatchEvent::Added(n) | WatchEvent::Modified(n) => {
                let r = rv(&n);
                out.push(n);
                if r >= last {
                    return out;
                }
            }
            WatchEvent::Error(e) => panic!("watch error: {e:?}"),
            WatchEvent::Deleted(_) | WatchEvent::Bookmark(_) => {}
        }
    }
    panic!("the watch ended before resourceVersion {last}")
}

/// What one pass of the simulated nfd-master wrote: the resourceVersions of its status and
/// annotation writes (`None` where it had nothing to write).
#[derive(Debug, Default)]
struct NfdWrites {
    status: Option<u64>,
    annotation: Option<u64>,
}

/// One pass of NFD's nfd-master over the Node with its rules now producing `wanted` (name, value),
/// written as nfd-master's `updateNodeObject` does (node-feature-discovery `pkg/nfd-master`): first
/// a JSON Patch on the status subresource (`createExtendedResourcePatches`: remove from capacity and
/// allocatable what its annotation lists and no rule produces any more; replace a differing value in
/// both; add a new one to capacity only), then a JSON Patch of the Node for its annotation (the
/// names, sorted; removed when none is left). `between` pauses between the two (back to back in
/// nfd-master).
async fn nfd_master_pass(w: &World, wanted: &[(&str, u64)], between: Duration) -> NfdWrites {
    let n = w.node();
    let ptr = |field: &str, name: &str| format!("/status/{field}/{}", name.replace('/', "~1"));
    let mut status_ops = Vec::new();
    for old in listed(&n, NFD_EXTENDED_RESOURCES_ANNOTATION) {
        let present = n
            .status
            .as_ref()
            .and_then(|s| s.capacity.as_ref())
            .is_some_and(|c| c.contains_key(&old));
        if present && !wanted.iter().any(|(name, _)| *name == old) {
            for field in ["capacity", "allocatable"] {
                status_ops.push(json!({"op": "remove", "path": ptr(field, &old)}));
            }
        }
    }
    for (name, v) in wanted {
        let current = n
            .status
            .as_ref()
            .and_then(|s| s.capacity.as_ref())
            .and_then(|c| c.get(*name));
        match current {
            Some(q) if q.0 == v.to_string() => {}
            Some(_) => {
                for field in ["capacity", "allocatable"] {
                    status_ops.push(
                        json!({"op": "replace", "path": ptr(field, name), "value": v.to_string()}),
                    );
                }
            }
            None => status_ops
                .push(json!({"op": "add", "path": ptr("capacity", name), "value": v.to_string()})),
        }
    }
    let mut writes = NfdWrites::default();
    let api = &w.env.api;
    if !status_ops.is_empty() {
        let stored = api
            .patch(
                "nodes",
                None,
                NODE,
                PatchType::Json,
                &Value::Array(status_ops),
            )
            .expect("nfd-master's status patch applies");
        writes.status = stored
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .and_then(|s| s.parse().ok());
    }
    tokio::time::sleep(between).await;
    let mut names: Vec<&str> = wanted.iter().map(|(name, _)| *name).collect();
    names.sort_unstable();
    let new = names.join(",");
    let old = w
        .node()
        .annotations()
        .get(NFD_EXTENDED_RESOURCES_ANNOTATION)
        .map(String::as_str)
        .map(str::to_string);
    let key = NFD_EXTENDED_RESOURCES_ANNOTATION.replace('/', "~1");
    let op = match (old, new.is_empty()) {
        (None, true) => None,
        (Some(_), true) => {
            Some(json!({"op": "remove", "path": format!("/metadata/annotations/{key}")}))
        }
        (Some(o), false) if o == new => None,
        (Some(_), false) => Some(
            json!({"op": "replace", "path": format!("/metadata/annotations/{key}"), "value": new}),
        ),
        (None, false) => {
            Some(json!({"op": "add", "path": format!("/metadata/annotations/{key}"), "value": new}))
        }
    };
    if let Some(op) = op {
        let stored = api
            .patch("nodes", None, NODE, PatchType::Json, &json!([op]))
            .expect("nfd-master's annotation patch applies");
        writes.annotation = stored
            .pointer("/metadata/resourceVersion")
            .and_then(Value::as_str)
            .and_then(|s| s.parse().ok());
    }
    writes
}

/// NFD arrives (kata-deploy's NodeFeatureRule advertises all 16 keys) and the agent steps back.
async fn nfd_takes_over(w: &World, between: Duration) -> NfdWrites {
    let writes = nfd_master_pass(w, &[(TDX_KEYS, KEYS)], between).await;
    wait_node(w, "the agent released its claim", |n| {
        !listed(n, AGENT_EXTENDED_RESOURCES_ANNOTATION).contains(TDX_KEYS)
    })
    .await;
    writes
}

/// Start a TDX VM through the webhook, the scheduler and the kubelet; returns its pod.
async fn run_vm(w: &World, name: &str) -> Pod {
    let pod = w.admitted_tdx_vm(name).await;
    start(w, &pod, "compute").await
}

/// Start a Kata TDX pod (the RuntimeClass overhead requests the key; not teeguard's to mutate).
async fn run_kata(w: &World, name: &str) -> Pod {
    let adm = w
        .driver
        .create_pod(&kata_pod(name, KataTee::Tdx))
        .await
        .expect("kata CREATE");
    let pod = adm.pod.expect("kata pod persisted");
    start(w, &pod, SANDBOX).await
}

async fn start(w: &World, pod: &Pod, charge_in: &str) -> Pod {
    assert_eq!(
        w.driver.schedule(pod).as_deref(),
        Ok(NODE),
        "the scheduler fits it"
    );
    let ns = pod.metadata.namespace.clone().expect("namespace");
    let name = pod.metadata.name.clone().expect("name");
    let bound = w.driver.bind(&ns, &name, NODE).await.expect("binding");
    assert!(bound.bound, "{name}: {:?}", bound.reply.raw);
    let stored = w.stored(pod);
    let containers: &[&str] = if charge_in == SANDBOX {
        &["app"]
    } else {
        &["compute"]
    };
    w.kubelet()
        .start(&stored, containers, charge_in, Some(TDX))
        .expect("the kernel gives it its key");
    w.settle().await.expect("settled");
    stored
}

/// Keys the VM and the Kata pod of the hand-over scenarios hold.
const IN_USE: u64 = 2;

/// The start of both hand-over scenarios: NFD owns the name, a VM and a Kata pod run with their keys.
struct HandOver {
    vm: Pod,
    kata: Pod,
    /// The host's usage (the pods' keys and the external ones).
    usage: u64,
    /// The Node's resourceVersion before the hand-over.
    from: u64,
}

async fn hand_over_start(w: &World) -> HandOver {
    nfd_takes_over(w, Duration::ZERO).await;
    let vm = run_vm(w, "vm-1").await;
    let kata = run_kata(w, "kata-1").await;
    let usage = w.host.usage(TDX);
    assert_eq!(usage, IN_USE + EXTERNAL);
    HandOver {
        vm,
        kata,
        usage,
        from: rv(&w.node()),
    }
}

/// The end of both: the pods kept their keys and run, and the agent's `Advertising` is True with 13.
async fn hand_over_end(w: &World, h: &HandOver) {
    assert_eq!(w.host.usage(TDX), h.usage, "the pods keep their keys");
    assert!(running(w, &h.vm) && running(w, &h.kata));
    wait_advertising(w, "Advertising is True again", |status, m| {
        status == "True" && m.contains(&format!("{TDX_KEYS}=13"))
    })
    .await;
}

fn running(w: &World, pod: &Pod) -> bool {
    let p = w.stored(pod);
    p.status.and_then(|s| s.phase).as_deref() == Some("Running")
}

// NFD arrives after teeguard. nfd-master first replaces the value (capacity and allocatable), then
// lists the name in its annotation; here 300 ms apart, far longer than the agent takes to react to a
// Node change, so an agent that wrote its own value back at once would be caught. The agent steps
// back without ever writing the resource again: every stored version of the Node has a non-zero
// value, NFD's 16 from its first write on. The report says what NFD's figure means, with the numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nfd_arriving_after_teeguard_keeps_its_value_and_the_agent_steps_back_without_a_gap() {
    bounded(async {
        let w = world().await;
        let from = rv(&w.node());
        let from_seq = w.env.api.requests().last().map_or(0, |r| r.seq);

        let nfd = nfd_takes_over(&w, Duration::from_millis(300)).await;
        let nfd_status = nfd.status.expect("nfd-master replaced the value");
        let message = wait_advertising(&w, "the report names NFD and the numbers", |status, m| {
            status == "False" && m.contains("node-feature-discovery")
        })
        .await;
        // Several polls later, still nothing written over NFD's value.
        tokio::time::sleep(POLL * 3).await;

        let end = w.node();
        assert_eq!(values(&end), (Some(16), Some(16)));
        assert!(listed(&end, NFD_EXTENDED_RESOURCES_ANNOTATION).contains(TDX_KEYS));
        assert!(!listed(&end, AGENT_EXTENDED_RESOURCES_ANNOTATION).contains(TDX_KEYS));
        let versions = node_versions_since(&w, from).await;
        assert!(versions.len() >= 3, "NFD's two writes and the agent's release: {}", versions.len());
        for n in &versions {
            let (c, a) = values(n);
            assert!(
                c.is_some_and(|v| v > 0) && a.is_some_and(|v| v > 0),
                "rv {}: capacity {c:?} allocatable {a:?}",
                rv(n)
            );
            if rv(n) >= nfd_status {
                assert_eq!((c, a), (Some(16), Some(16)), "rv {}: NFD's value was overwritten", rv(n));
            }
        }
        let agent_status_writes: Vec<_> = w
            .env
            .api
            .requests_where(|r| {
                r.seq > from_seq
                    && r.resource.as_deref() == Some("nodes")
                    && r.subresource.as_deref() == Some("status")
                    && r.method != "GET"
            })
            .into_iter()
            .map(|r| r.body.map(|b| b.to_string()).unwrap_or_default())
            .collect();
        assert!(agent_status_writes.is_empty(), "the agent wrote the Node's status: {agent_status_writes:?}");

        assert!(
            message.contains(&format!(
                "{TDX_KEYS} is managed by node-feature-discovery (its {NFD_EXTENDED_RESOURCES_ANNOTATION} annotation lists it; value 16)"
            )),
            "{message}"
        );
        assert!(
            message.contains("teeguard would advertise 13 (capacity 16 − 3 held outside Kubernetes): the scheduler may place pods on keys that are not free"),
            "{message}"
        );
        assert!(
            message.contains("see README 'Handing the key resources to teeguard'"),
            "{message}"
        );
        let s = w.env.report(NODE).and_then(|s| s.tdx).expect("tdx figures");
        assert_eq!((s.capacity, s.external, s.advertised), (16, 3, None), "{s:?}");
        // The README's section exists under that name.
        let readme = std::fs::read_to_string(teeguard_tests::e2e::workspace_root().join("README.md"))
            .expect("README");
        assert!(readme.contains("### Handing the key resources to teeguard"));
    })
    .await;
}

// README "Handing the key resources to teeguard", as most people will do it: edit kata-deploy's
// NodeFeatureRule. A VM and a Kata pod run on the node while NFD owns the name; nfd-master then
// removes its value (capacity and allocatable) and the name from its annotation, back to back. The
// agent claims the name and writes its own value within one poll interval of NFD's first write (the
// only moment the Node lacks the resource, and NFD's doing), both pods keep running with their keys,
// and no version of the Node the agent wrote shows fewer keys than the pods hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handing_the_keys_to_teeguard_by_editing_the_rule_keeps_running_pods_and_restores_within_a_poll()
 {
    bounded(async {
        let w = world().await;
        let h = hand_over_start(&w).await;

        let started = Instant::now();
        let nfd = nfd_master_pass(&w, &[], Duration::ZERO).await;
        let restored = wait_node(&w, "the agent advertises its value again", |n| {
            values(n) == (Some(13), Some(13))
        })
        .await;
        let gap = started.elapsed();
        eprintln!("the key resource was missing from the Node for at most {gap:?}");
        assert!(
            gap < POLL,
            "restored {gap:?} after NFD removed it (poll interval {POLL:?})"
        );
        assert!(listed(&restored, AGENT_EXTENDED_RESOURCES_ANNOTATION).contains(TDX_KEYS));
        assert!(!listed(&restored, NFD_EXTENDED_RESOURCES_ANNOTATION).contains(TDX_KEYS));

        let nfd_removal = nfd.status.expect("nfd-master removed its value");
        let nfd_annotation = nfd.annotation.expect("nfd-master dropped its annotation");
        let versions = node_versions_since(&w, h.from).await;
        let mut missing = Vec::new();
        for n in &versions {
            let (r, (c, a)) = (rv(n), values(n));
            if r == nfd_removal || r == nfd_annotation {
                continue;
            }
            // The agent's writes: its claim (the value still missing, right after NFD's writes) and
            // its value.
            match (c, a) {
                (Some(c), Some(a)) => assert!(c >= IN_USE && a >= IN_USE, "rv {r}: {c}/{a}"),
                _ => missing.push(r),
            }
        }
        assert!(
            missing.len() <= 1,
            "only the agent's claim precedes its value: {missing:?}"
        );

        w.settle().await.expect("settled");
        // The report's `advertised` follows the agent's Node write in its next pass (woken by the
        // Node's watch event), a moment after the kernel figures settle.
        let s = w
            .env
            .api
            .wait_for(WAIT, "the report to show advertised 13", |_| {
                w.env.report(NODE)?.tdx.filter(|t| t.advertised == Some(13))
            })
            .await
            .unwrap_or_else(|e| panic!("{e}; report: {:?}", w.env.report(NODE)));
        assert_eq!(
            (s.pods_used, s.external, s.advertised),
            (IN_USE, EXTERNAL, Some(13)),
            "{s:?}"
        );
        let uid = |p: &Pod| p.metadata.uid.clone().expect("uid");
        assert_eq!(w.host.pod_usage(&uid(&h.vm), TDX), 1);
        assert_eq!(w.host.pod_usage(&uid(&h.kata), TDX), 1);
        hand_over_end(&w, &h).await;
    })
    .await;
}

// README "Handing the key resources to teeguard", without any gap: first drop the name from NFD's
// annotation on the node (NFD's value stays), then edit the rule. The agent claims the name and
// replaces NFD's 16 by its 13 in place; nfd-master's next pass then has nothing to remove (its
// annotation no longer lists the name) and writes nothing. Every version of the Node in between has
// the resource, never fewer than the keys the running VM and Kata pod hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handing_the_keys_to_teeguard_annotation_first_never_leaves_the_node_without_the_resource()
{
    bounded(async {
        let w = world().await;
        let h = hand_over_start(&w).await;

        // `kubectl annotate node node-a nfd.node.kubernetes.io/extended-resources-` (the only name).
        let key = NFD_EXTENDED_RESOURCES_ANNOTATION.replace('/', "~1");
        w.env
            .api
            .patch(
                "nodes",
                None,
                NODE,
                PatchType::Json,
                &json!([{"op": "remove", "path": format!("/metadata/annotations/{key}")}]),
            )
            .expect("annotation removed");
        let taken = wait_node(&w, "the agent took the name back", |n| {
            listed(n, AGENT_EXTENDED_RESOURCES_ANNOTATION).contains(TDX_KEYS)
                && values(n) == (Some(13), Some(13))
        })
        .await;
        // Then the rule is edited: nfd-master has nothing left to do on this node.
        let nfd = nfd_master_pass(&w, &[], Duration::ZERO).await;
        assert_eq!((nfd.status, nfd.annotation), (None, None), "{nfd:?}");
        tokio::time::sleep(POLL * 2).await;
        assert_eq!(rv(&w.node()), rv(&taken), "nothing wrote the Node since");

        let versions = node_versions_since(&w, h.from).await;
        assert!(versions.len() >= 3, "{}", versions.len());
        for n in &versions {
            let (c, a) = values(n);
            assert!(
                c.is_some_and(|v| v >= IN_USE) && a.is_some_and(|v| v >= IN_USE),
                "rv {}: capacity {c:?} allocatable {a:?}",
                rv(n)
            );
        }
        hand_over_end(&w, &h).await;
    })
    .await;
}

/// The agent's `teeguard_agent_enforcing` sample, once its report's `Enforcing` condition is `status`.
async fn enforcing_gauge_when(
    env: &E2eEnv,
    agent: &teeguard_tests::e2e::AgentProcess,
    status: &str,
) -> String {
    env.api
        .wait_for(WAIT, &format!("Enforcing={status}"), |_| {
            let c = env.report(NODE)?.condition(ct::ENFORCING)?.clone();
            (c.status == status).then_some(())
        })
        .await
        .expect("the Enforcing condition");
    let metrics = agent.metrics().await;
    metrics
        .lines()
        .find(|l| l.starts_with("teeguard_agent_enforcing "))
        .unwrap_or_else(|| panic!("no teeguard_agent_enforcing in\n{metrics}"))
        .to_string()
}

// The gauge the TeeguardEnforcementFailing alert reads is 1 while the agent's Enforcing condition is
// True (the cgroup writer on a host with the misc controller delegated to pod cgroups) and 0 while it
// is False (the same agent on a host where it is not delegated).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_enforcing_gauge_follows_the_agents_enforcing_condition() {
    bounded(async {
        let w = World::start(KEYS, CONFIG).await.expect("world starts");
        let agent = w.agent.as_ref().expect("agent");
        assert_eq!(
            enforcing_gauge_when(&w.env, agent, "True").await,
            "teeguard_agent_enforcing 1"
        );

        let env = E2eEnv::new(CONFIG).await.expect("env");
        let mut n = NodeBuilder::new(NODE).tdx(KEYS).to_value();
        if let Some(m) = n.get_mut("metadata").and_then(Value::as_object_mut) {
            for k in ["uid", "resourceVersion", "creationTimestamp"] {
                m.remove(k);
            }
        }
        env.api.create(&n).expect("node");
        let host = SimHost::builder()
            .capacity(TDX, KEYS)
            .misc_delegation(MiscDelegation::NotBelowKubepods)
            .build()
            .expect("host");
        let agent = env.start_agent(NODE, &host).await.expect("agent starts");
        assert_eq!(
            enforcing_gauge_when(&env, &agent, "False").await,
            "teeguard_agent_enforcing 0"
        );
    })
    .await;
}
