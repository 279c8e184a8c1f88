//! Full nodes as a KubeVirt user meets them: what `kubectl get vmi` and `kubectl describe vmi` show for a
//! VMI refused for lack of a key, and the waiting VMI starting by itself once a key frees, whatever
//! freed it (an outside VM stopping, a VMI deleted, a Kata pod ending) and however long it waited.

use std::time::{Duration, Instant};
use teeguard_tests::realcluster::create_or_keep;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::node::v1::RuntimeClass;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::json;
use teeguard_tests::fixtures::Tee;
use teeguard_tests::host::TDX;
use teeguard_tests::kubevirt::vmis::{self, Size};
use teeguard_tests::node::pods;

use super::{KubeVirtWorld, Options, vmi_of};

/// Longest a waiting VMI may take from the moment its key frees to a running launcher pod. The goal is
/// 5 s (measured: 2-4 s here); two kubelets, containerd, virt-controller, the control plane and the
/// agents share two cores, so the bound has 4x slack. Without teeguard's retry the VMI waits for
/// virt-controller's backoff, past 40 s once it has been refused [`LONG_WAIT`] times, so the bound still
/// tells the two apart.
pub const START_BOUND: Duration = Duration::from_secs(20);

/// Refusals after which virt-controller's backoff is past 20 s (it doubles from 5 ms: the 13th retry
/// comes 41 s after the first refusal, the next one 41 s after that).
pub const LONG_WAIT: i32 = 13;

/// The RuntimeClass kata-deploy renders for TDX: the key in `overhead.podFixed`; the handler here is
/// runc (no Kata runtime on the test node).
pub const KATA_TDX: &str = "kata-qemu-tdx";

/// The end of every refusal message of a VMI's pod.
pub const WILL_START: &str = "teeguard starts this VM by itself as soon as a key is free for it";

impl KubeVirtWorld {
    /// The refusals virt-controller recorded for VMI `name` (the `FailedCreate` Events' counts).
    pub async fn failed_creates(&self, name: &str) -> i32 {
        self.events(name)
            .await
            .iter()
            .filter(|e| e.reason.as_deref() == Some("FailedCreate"))
            .map(|e| e.count.unwrap_or(1))
            .sum()
    }

    /// Wait until virt-controller has been refused `times` times for VMI `name`'s pod (its own count
    /// of its retries); panics with what `kubectl describe vmi` shows after two minutes.
    pub async fn wait_refused(&self, name: &str, times: i32) {
        let got = self
            .cluster
            .wait_for_within(
                &format!("{times} refusals of VMI {name}'s pod"),
                Duration::from_secs(120),
                || async { (self.failed_creates(name).await >= times).then_some(()) },
            )
            .await;
        if let Err(e) = got {
            panic!("{e}\n{}", self.describe(name).await);
        }
    }

    /// The `status` of condition `type_` of VMI `name`: `(status, reason, message)`.
    pub async fn vmi_condition(&self, name: &str, type_: &str) -> Option<(String, String, String)> {
        let vmi = self.vmi(name).await?;
        let c = vmi.data["status"]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == type_)?
            .clone();
        let s = |k: &str| c[k].as_str().unwrap_or("").to_string();
        Some((s("status"), s("reason"), s("message")))
    }

    /// The message of VMI `name`'s `Synchronized` condition, which must say its launcher pod's CREATE
    /// failed (`False`, reason `FailedCreate`: a webhook refused it, or could not be called).
    pub async fn failed_create(&self, name: &str) -> String {
        let (status, reason, message) = self
            .vmi_condition(name, "Synchronized")
            .await
            .unwrap_or_else(|| panic!("{name}: no Synchronized condition"));
        assert_eq!(
            (status.as_str(), reason.as_str()),
            ("False", "FailedCreate"),
            "{name}: {message}"
        );
        message
    }

    /// Delete VMI `name` (its pod goes with it).
    pub async fn delete_vmi(&self, name: &str) {
        vmis::api(&self.cluster.client, &self.ns, "VirtualMachineInstance")
            .delete(name, &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("delete VMI {name}: {e}"));
    }

    /// Wait until VMI `name`'s pod runs; how long it took from `since`, which must be within
    /// [`START_BOUND`].
    pub async fn starts_within_bound(&self, name: &str, since: Instant, what: &str) -> Duration {
        self.wait_running(name).await;
        let took = since.elapsed();
        assert!(
            took <= START_BOUND,
            "{name} ran {took:?} after {what}, past {START_BOUND:?}\n{}",
            self.describe(name).await
        );
        took
    }

    /// The Kata RuntimeClass [`KATA_TDX`], created once.
    pub async fn ensure_kata_runtime_class(&self) {
        let rcs: Api<RuntimeClass> = Api::all(self.cluster.client.clone());
        let rc: RuntimeClass = serde_json::from_value(json!({
            "apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
            "metadata": {"name": KATA_TDX}, "handler": "runc",
            "overhead": {"podFixed": {"tdx.intel.com/keys": "1"}}
        }))
        .expect("RuntimeClass");
        create_or_keep(&rcs, &rc)
            .await
            .unwrap_or_else(|e| panic!("create RuntimeClass {KATA_TDX}: {e}"));
    }

    /// A Kata TDX pod (its key in the overhead) on the TDX node; runs.
    pub async fn kata_pod(&self, name: &str) -> Pod {
        self.ensure_kata_runtime_class().await;
        let mut pod = pods::plain(
            &self.ns,
            name,
            &[("app", &[])],
            &[("kubernetes.io/hostname", self.tdx.name())],
        );
        pod.spec.as_mut().expect("spec").runtime_class_name = Some(KATA_TDX.into());
        let api: Api<Pod> = Api::namespaced(self.cluster.client.clone(), &self.ns);
        api.create(&PostParams::default(), &pod)
            .await
            .unwrap_or_else(|e| panic!("create Kata pod {name}: {e}"));
        self.cluster
            .wait_for_within(
                &format!("Kata pod {name} Running"),
                Duration::from_secs(60),
                || async { api.get(name).await.ok().filter(super::running) },
            )
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", self.diagnostics()))
    }

    /// Wait until the TDX node's report shows `free` free TDX keys.
    pub async fn wait_tdx_free(&self, free: u64) {
        self.wait_report(
            &self.tdx,
            &format!("{free} free TDX keys"),
            Duration::from_secs(60),
            |r| r.tdx.as_ref().is_some_and(|k| k.free == free),
        )
        .await;
    }
}

/// Scenario 2: VMI N+1 on a full TDX node (one key). What the user sees, word for word: `kubectl get
/// vmi` says `Pending`; `kubectl describe vmi` shows virt-controller's `Synchronized` condition and its
/// `FailedCreate` Event quoting teeguard's refusal (what is full, what to do, that the VM starts by
/// itself), and teeguard's own `InsufficientTEEKeys` Event. Then the key frees three ways and each time
/// the waiting VMI runs within [`START_BOUND`]: the outside VM stops after the VMI has been refused long
/// enough for virt-controller's backoff to pass 40 s (so teeguard's retry starts it, with a `TEEKeyFree`
/// Event saying why); a VMI is deleted, and a Kata pod ends, each after one refusal (the key is counted
/// while they hold it, and freed when they go). That every way a key frees wakes teeguard's retry is
/// the simulation's I3; the thirty-VMI test shows it for deleted VMIs on the real chain. Two more
/// 40 s backoffs here would prove it again at 80 s of CI time.
pub async fn full_node_vmi_waits_and_starts_when_a_key_frees() {
    let Some(w) = KubeVirtWorld::start("kv-full", Options::keys(1, 0)).await else {
        return;
    };
    let node = w.tdx.name().to_string();

    // 1. A VM outside Kubernetes holds the only key.
    w.tdx
        .host
        .add_external("outside-vm", TDX, 1)
        .expect("outside VM");
    w.wait_report(
        &w.tdx,
        "the key held outside",
        Duration::from_secs(30),
        |r| {
            r.tdx
                .as_ref()
                .is_some_and(|k| k.external == 1 && k.free == 0)
        },
    )
    .await;
    w.create_vmi("vm-a", Tee::Tdx, Size::SMALL).await;
    w.wait_refused("vm-a", LONG_WAIT).await;
    let vmi = w.vmi("vm-a").await.expect("vm-a");
    assert_eq!(vmi.data["status"]["phase"], "Pending", "kubectl get vmi");
    let refusal = format!(
        "no node can host this TDX VM: {node} 0/1 free (1 held outside Kubernetes); free a key or add \
         capacity; `kubectl get teecapacities` shows free keys per node; {WILL_START}"
    );
    assert_eq!(
        w.failed_create("vm-a").await,
        format!(
            "failed to create virtual machine pod: admission webhook \"kv-full.validate.pods.teeguard.dev\" \
             denied the request: {refusal}"
        )
    );
    let events = w.events("vm-a").await;
    let ours: Vec<_> = events
        .iter()
        .filter(|e| e.reason.as_deref() == Some("InsufficientTEEKeys"))
        .collect();
    assert_eq!(ours.len(), 1, "one teeguard Event, however many refusals");
    assert_eq!(ours[0].type_.as_deref(), Some("Warning"));
    assert_eq!(ours[0].message.as_deref(), Some(refusal.as_str()));
    let failed: Vec<_> = events
        .iter()
        .filter(|e| e.reason.as_deref() == Some("FailedCreate"))
        .collect();
    assert_eq!(
        failed.len(),
        1,
        "virt-controller's refusals fold into one Event line (the message never changes)"
    );
    eprintln!(
        "what `kubectl describe vmi vm-a` shows after {} refusals:\n{}",
        w.failed_creates("vm-a").await,
        w.describe("vm-a").await
    );
    let freed = Instant::now();
    w.tdx
        .host
        .remove_external("outside-vm")
        .expect("stop the outside VM");
    let took = w
        .starts_within_bound("vm-a", freed, "the outside VM stopped")
        .await;
    eprintln!("vm-a ran {took:?} after the outside VM stopped");
    let key_free = w
        .events("vm-a")
        .await
        .into_iter()
        .find(|e| e.reason.as_deref() == Some("TEEKeyFree"))
        .expect("a TEEKeyFree Event");
    assert_eq!(key_free.type_.as_deref(), Some("Normal"));
    assert!(
        key_free
            .message
            .as_deref()
            .is_some_and(|m| m.starts_with(&format!("a TDX key is free (node {node})"))),
        "{key_free:?}"
    );

    // 2. vm-a holds the key; vm-b waits until vm-a is deleted.
    w.create_vmi("vm-b", Tee::Tdx, Size::SMALL).await;
    w.wait_refused("vm-b", 1).await;
    let freed = Instant::now();
    w.delete_vmi("vm-a").await;
    let took = w
        .starts_within_bound("vm-b", freed, "vm-a was deleted")
        .await;
    eprintln!("vm-b ran {took:?} after vm-a was deleted");

    // 3. A Kata pod holds the key; vm-c waits until it ends.
    w.delete_vmi("vm-b").await;
    w.wait_tdx_free(1).await;
    w.kata_pod("kata").await;
    w.wait_tdx_free(0).await;
    w.create_vmi("vm-c", Tee::Tdx, Size::SMALL).await;
    w.wait_refused("vm-c", 1).await;
    let freed = Instant::now();
    let pods: Api<Pod> = Api::namespaced(w.cluster.client.clone(), &w.ns);
    pods.delete("kata", &DeleteParams::default())
        .await
        .expect("end the Kata pod");
    let took = w
        .starts_within_bound("vm-c", freed, "the Kata pod was deleted")
        .await;
    eprintln!("vm-c ran {took:?} after the Kata pod was deleted");
}

/// How long a freed key may stay unused while a VMI waits for it: from the report showing it free to the
/// waiting VMI's pod bound (the goal of issue 42).
pub const BIND_BOUND: Duration = Duration::from_secs(5);

/// When each node's report showed keys free, and when each launcher pod was bound, as two watches saw
/// them (every change, not samples).
#[derive(Debug, Default)]
struct Timeline {
    /// (when, node, free keys of the node's kind).
    reports: Vec<(Instant, String, u64)>,
    /// (when, VMI, node): a launcher pod's first sight with a node.
    bound: Vec<(Instant, String, String)>,
}

fn watch_timeline(
    w: &KubeVirtWorld,
) -> (
    std::sync::Arc<std::sync::Mutex<Timeline>>,
    tokio::task::JoinHandle<()>,
) {
    use futures::StreamExt;
    use kube::runtime::watcher;
    let line = std::sync::Arc::new(std::sync::Mutex::new(Timeline::default()));
    let reports: Api<teeguard_shared::TeeCapacity> = Api::all(w.cluster.client.clone());
    let pods: Api<Pod> = Api::namespaced(w.cluster.client.clone(), &w.ns);
    let l = line.clone();
    enum Seen {
        Report(Box<Result<watcher::Event<teeguard_shared::TeeCapacity>, watcher::Error>>),
        Pod(Box<Result<watcher::Event<Pod>, watcher::Error>>),
    }
    let task = tokio::spawn(async move {
        let r = watcher(reports, watcher::Config::default()).map(|e| Seen::Report(Box::new(e)));
        let p = watcher(
            pods,
            watcher::Config::default().labels("kubevirt.io=virt-launcher"),
        )
        .map(|e| Seen::Pod(Box::new(e)));
        let mut both = std::pin::pin!(futures::stream::select(r, p));
        while let Some(e) = both.next().await {
            let now = Instant::now();
            let mut t = l.lock().unwrap_or_else(|e| e.into_inner());
            match e {
                Seen::Report(e) => {
                    let (Ok(watcher::Event::Apply(c)) | Ok(watcher::Event::InitApply(c))) = *e
                    else {
                        continue;
                    };
                    let node = c.metadata.name.clone().unwrap_or_default();
                    let free = c.status.as_ref().map_or(0, |s| {
                        [
                            teeguard_shared::TeeKind::Tdx,
                            teeguard_shared::TeeKind::SevEs,
                        ]
                        .iter()
                        .filter_map(|k| s.kind(*k).map(|k| k.free))
                        .sum()
                    });
                    t.reports.push((now, node, free));
                }
                Seen::Pod(e) => {
                    let (Ok(watcher::Event::Apply(p)) | Ok(watcher::Event::InitApply(p))) = *e
                    else {
                        continue;
                    };
                    let vmi = vmi_of(&p).to_string();
                    let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
                    if let Some(node) = node
                        && !t.bound.iter().any(|(_, v, _)| *v == vmi)
                    {
                        t.bound.push((now, vmi, node));
                    }
                }
            }
        }
    });
    (line, task)
}

/// For each VMI of `vmis` bound after `since`: the time from the key it took showing free in its node's
/// report to its pod bound. Keys free in the order the reports show them, and the VMIs bound on a node
/// take them in the order they were bound.
fn free_to_bound(t: &Timeline, vmis: &[String], since: Instant) -> Vec<(String, Duration)> {
    let mut out = Vec::new();
    let nodes: std::collections::BTreeSet<&String> = t.reports.iter().map(|(_, n, _)| n).collect();
    for node in nodes {
        let mut freed: Vec<Instant> = Vec::new();
        let mut last: Option<u64> = None;
        for (at, _, free) in t.reports.iter().filter(|(_, n, _)| n == node) {
            if *at >= since
                && let Some(before) = last
            {
                for _ in before..*free {
                    freed.push(*at);
                }
            }
            last = Some(*free);
        }
        let mut binds: Vec<&(Instant, String, String)> = t
            .bound
            .iter()
            .filter(|(at, v, n)| n == node && *at >= since && vmis.contains(v))
            .collect();
        binds.sort_by_key(|(at, _, _)| *at);
        for (i, (at, vmi, _)) in binds.into_iter().enumerate() {
            let free_at = freed.get(i).copied().unwrap_or(since);
            out.push((vmi.clone(), at.saturating_duration_since(free_at)));
        }
    }
    out
}

/// Scenario 4: 30 VMIs (15 TDX, 15 SNP), created in one burst, for 4 keys over the two nodes (2 TDX,
/// 2 SEV-ES), the webhook as the chart's 2 replicas behind a balancer, called by two API servers:
/// exactly 2 of each run, TDX ones only on the TDX node, SNP ones only on the SNP node; the other 26
/// wait with teeguard's refusal, none in the scheduler's queue (a launcher pod is admitted only with a
/// key held for it, whichever replica admits it). Deleting the running ones lets the 4 that waited
/// longest (2 of each kind) take their place, without anyone touching them, each bound within
/// [`BIND_BOUND`] of its key showing free.
///
/// The freed keys go to the VMIs refused first (by the refusal's time, then name), although every
/// waiting VMI's own backoff retry may land before teeguard's retry, at either replica: a launcher pod
/// CREATE counts the keys the VMIs waiting ahead of its own are served from as taken.
pub async fn thirty_vmis_for_four_keys_run_by_kind_and_the_longest_waiting_take_freed_places() {
    let Some(w) = KubeVirtWorld::start("kv-thirty", Options::keys(2, 2)).await else {
        return;
    };
    let (timeline, watching) = watch_timeline(&w);
    let names: Vec<(String, Tee)> = (0..30)
        .map(|i| {
            let tee = if i % 2 == 0 { Tee::Tdx } else { Tee::Snp };
            (format!("vmi-{i:02}-{}", tee.slug()), tee)
        })
        .collect();
    for (name, tee) in &names {
        w.create_vmi(name, *tee, Size::SMALL).await;
    }
    let wait_placed = |expect: usize, gone: Vec<String>| {
        let w = &w;
        let names = &names;
        async move {
            let last = std::sync::Mutex::new(String::new());
            let got = w
                .cluster
                .wait_for_within(
                    &format!("{expect} launcher pods running and every other VMI waiting"),
                    Duration::from_secs(180),
                    || async {
                        let p = placement(w, names).await;
                        let done = p.running.len() == expect
                            && p.others.is_empty()
                            && p.running.iter().all(|(n, _, _)| !gone.contains(n));
                        *last.lock().unwrap_or_else(|e| e.into_inner()) = format!("{p:?}");
                        done.then_some(p)
                    },
                )
                .await;
            match got {
                Ok(g) => g,
                Err(e) => panic!(
                    "{e}; last seen: {}\n{}",
                    last.lock().unwrap_or_else(|e| e.into_inner()),
                    w.diagnostics()
                ),
            }
        }
    };
    let first = wait_placed(4, Vec::new()).await;
    let check = |p: &Placement, waiting: usize| {
        assert_eq!(
            (p.waiting, p.queued),
            (waiting, 0),
            "every other VMI waits with teeguard's refusal, none in the scheduler's queue: {p:?}"
        );
        for (name, tee, node) in &p.running {
            assert_eq!(
                node,
                w.node_for(*tee).name(),
                "{name} on the node of its kind"
            );
        }
        let per_kind = |tee: Tee| p.running.iter().filter(|(_, t, _)| *t == tee).count();
        assert_eq!((per_kind(Tee::Tdx), per_kind(Tee::Snp)), (2, 2), "{p:?}");
    };
    check(&first, 26);

    // The VMIs refused first of each kind (by the refusal's time, then name: teeguard's order).
    let mut refused = Vec::new();
    for (name, tee) in &names {
        if first.running.iter().any(|(r, _, _)| r == name) {
            continue;
        }
        let vmi = w.vmi(name).await.expect("waiting VMI");
        let since = vmi.data["status"]["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "Synchronized"))
            .and_then(|c| c["lastTransitionTime"].as_str())
            .unwrap_or("")
            .to_string();
        refused.push((since, name.clone(), *tee));
    }
    refused.sort_by(|a, b| (&a.0, &a.1).cmp(&(&b.0, &b.1)));
    let mut next: Vec<String> = [Tee::Tdx, Tee::Snp]
        .into_iter()
        .flat_map(|tee| {
            refused
                .iter()
                .filter(move |(_, _, t)| *t == tee)
                .take(2)
                .map(|(_, n, _)| n.clone())
        })
        .collect();
    next.sort();
    let deleted: Vec<String> = first.running.iter().map(|(n, _, _)| n.clone()).collect();
    for name in &deleted {
        w.delete_vmi(name).await;
    }
    let freed = Instant::now();
    let then = wait_placed(4, deleted).await;
    let took = freed.elapsed();
    check(&then, 22);
    let mut got: Vec<String> = then.running.iter().map(|(n, _, _)| n.clone()).collect();
    got.sort();
    eprintln!(
        "thirty VMIs: first {} waited with teeguard's refusal and {} in the scheduler's queue; four \
         others ran {took:?} after the four running ones were deleted: {got:?} (refused first: \
         {next:?})",
        first.waiting, first.queued,
    );
    assert_eq!(
        got, next,
        "the freed keys go to the VMIs refused first, whichever retry lands first"
    );
    let waits = {
        let t = timeline.lock().unwrap_or_else(|e| e.into_inner());
        free_to_bound(&t, &got, freed)
    };
    watching.abort();
    eprintln!("thirty VMIs: from a freed key to its VMI's pod bound: {waits:?}");
    assert_eq!(waits.len(), 4, "{waits:?}");
    for (vmi, took) in &waits {
        assert!(
            *took <= BIND_BOUND,
            "{vmi} was bound {took:?} after its key showed free (at most {BIND_BOUND:?}): {waits:?}"
        );
    }
}

/// Where a set of VMIs stands: running (name, kind, node), waiting with teeguard's refusal, waiting in
/// the scheduler's queue (a launcher pod `Pending` for `Insufficient` keys), and any other (name and
/// what `kubectl describe vmi` shows).
#[derive(Debug)]
struct Placement {
    running: Vec<(String, Tee, String)>,
    waiting: usize,
    queued: usize,
    others: Vec<String>,
}

async fn placement(w: &KubeVirtWorld, names: &[(String, Tee)]) -> Placement {
    let mut p = Placement {
        running: Vec::new(),
        waiting: 0,
        queued: 0,
        others: Vec::new(),
    };
    for (name, tee) in names {
        if w.vmi(name).await.is_none() {
            continue;
        }
        let pods = w.launchers(name).await;
        if let Some(node) = pods
            .iter()
            .find(|p| super::running(p))
            .and_then(|p| p.spec.as_ref()?.node_name.clone())
        {
            p.running.push((name.clone(), *tee, node));
        } else if pods.is_empty()
            && w.vmi_condition(name, "Synchronized")
                .await
                .is_some_and(|(_, _, m)| m.ends_with(WILL_START))
        {
            p.waiting += 1;
        } else if pods.len() == 1 && insufficient(&pods[0]) {
            p.queued += 1;
        } else {
            p.others.push(w.describe(name).await);
        }
    }
    p
}

/// A pod the scheduler holds back for lack of a key: `Pending`, unbound, `PodScheduled` `False`
/// (`Unschedulable`) saying `Insufficient`.
fn insufficient(pod: &Pod) -> bool {
    let unbound = pod
        .spec
        .as_ref()
        .is_none_or(|s| s.node_name.as_deref().is_none_or(str::is_empty));
    unbound
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| {
                c.iter().any(|c| {
                    c.type_ == "PodScheduled"
                        && c.status == "False"
                        && c.message
                            .as_deref()
                            .is_some_and(|m| m.contains("Insufficient"))
                })
            })
}
