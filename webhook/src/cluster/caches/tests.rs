//! Tests of the caches' stores and reductions.

use super::*;
use crate::cluster::index::{Sink, wall_clock};
use crate::decide::holds::End;
use k8s_openapi::api::core::v1::PodSpec;
use kube::api::ObjectMeta;

fn index() -> KeyIndex {
    KeyIndex::new(Duration::from_secs(30), wall_clock())
}

fn node(name: &str, zone: &str) -> PartialObjectMeta<Node> {
    PartialObjectMeta {
        types: None,
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some(BTreeMap::from([("zone".to_string(), zone.to_string())])),
            ..ObjectMeta::default()
        },
        _phantom: std::marker::PhantomData,
    }
}

/// The stored names among `a`..`g` (what the tests store), and the store's count agrees.
fn names(store: &NamedStore<Labels>) -> Vec<&'static str> {
    let out: Vec<_> = ["a", "b", "c", "d", "e", "f", "g"]
        .into_iter()
        .filter(|n| store.get(n).is_some())
        .collect();
    assert_eq!(out.len(), store.len());
    out
}

#[test]
fn named_store_follows_watch_events() {
    let (store, mut w) =
        NamedStore::new(|n: PartialObjectMeta<Node>| n.metadata.labels.unwrap_or_default());
    assert!(!store.is_ready() && store.is_empty());
    w.apply(watcher::Event::Init);
    w.apply(watcher::Event::InitApply(node("a", "z1")));
    w.apply(watcher::Event::InitApply(node("b", "z2")));
    // The initial list is not visible until it is complete.
    assert!(store.is_empty() && !store.is_ready());
    w.apply(watcher::Event::InitDone);
    assert!(store.is_ready());
    assert_eq!(names(&store), ["a", "b"]);
    assert_eq!(
        store.get("b").and_then(|l| l.get("zone").cloned()),
        Some("z2".into())
    );
    w.apply(watcher::Event::Apply(node("b", "z3")));
    w.apply(watcher::Event::Apply(node("c", "z1")));
    w.apply(watcher::Event::Delete(node("a", "z1")));
    assert_eq!(names(&store), ["b", "c"]);
    assert_eq!(
        store.get("b").and_then(|l| l.get("zone").cloned()),
        Some("z3".into())
    );
    assert_eq!(w.len(), 2);
    // A relist replaces everything at once; objects gone meanwhile disappear.
    w.apply(watcher::Event::Init);
    w.apply(watcher::Event::InitApply(node("d", "z1")));
    assert_eq!(names(&store), ["b", "c"]);
    w.apply(watcher::Event::InitDone);
    assert_eq!(names(&store), ["d"]);
}

#[test]
fn reports_keep_only_what_decisions_read() {
    let cap: TeeCapacity = serde_json::from_value(serde_json::json!({
        "apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeCapacity",
        "metadata": {"name": "n1", "resourceVersion": "7", "labels": {"a": "b"},
            "annotations": {"x": "y"}},
        "spec": {"nodeName": "n1"},
        "status": {"tdx": {"resourceName": "tdx.intel.com/keys", "capacity": 4, "kernelUsed": 1,
            "podsUsed": 1, "external": 0, "pending": 0, "free": 3},
            "heartbeatTime": "2025-01-01T00:00:00Z", "agentVersion": "0.1.0",
            "conditions": [{"type": "Ready", "status": "True", "reason": "Ok", "message": "m",
                "lastTransitionTime": "2025-01-01T00:00:00Z"}]}
    }))
    .expect("report");
    let ix = index();
    Sink::apply(&ix, cap.clone());
    let full = cap.status.expect("status");
    let read = ix.read();
    let slim = read.report("n1").status.expect("kept");
    assert!(slim.conditions.is_empty() && !full.conditions.is_empty());
    assert_eq!(slim.agent_version, None);
    assert_eq!(slim.tdx, full.tdx);
    assert_eq!(slim.heartbeat_time, full.heartbeat_time);
    drop(read);
    Sink::<TeeCapacity>::delete(&ix, "n1");
    assert!(ix.read().report("n1").status.is_none());
}

#[test]
fn namespaces_keep_only_the_labels_teeguard_reads() {
    let labels = |pairs: &[(&str, &str)]| -> Labels {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    let all = labels(&[
        ("kubernetes.io/metadata.name", "vms"),
        ("pod-security.kubernetes.io/enforce", "privileged"),
        (names::EXEMPT_LABEL, "true"),
        (names::MODE_LABEL, "warn"),
    ]);
    assert_eq!(
        namespace_labels(Some(all)),
        labels(&[(names::EXEMPT_LABEL, "true"), (names::MODE_LABEL, "warn")])
    );
    // A namespace without labels, or without teeguard's, is still a namespace: an empty map.
    assert_eq!(namespace_labels(None), Labels::new());
    assert_eq!(
        namespace_labels(Some(labels(&[("team", "a")]))),
        Labels::new()
    );
}

/// Records what an observed cache tells.
#[derive(Default)]
struct Seen(std::sync::Mutex<Vec<String>>);

impl Observer<Labels> for Seen {
    fn stored(&self, v: &Labels) {
        let zone = v.get("zone").cloned().unwrap_or_default();
        self.0.lock().expect("lock").push(format!("+{zone}"));
    }
    fn removed(&self, v: &Labels) {
        let zone = v.get("zone").cloned().unwrap_or_default();
        self.0.lock().expect("lock").push(format!("-{zone}"));
    }
}

#[test]
fn an_observer_is_told_of_stores_deletions_and_what_a_relist_brings_or_drops() {
    let (_store, mut w) =
        NamedStore::new(|n: PartialObjectMeta<Node>| n.metadata.labels.unwrap_or_default());
    let seen = Arc::new(Seen::default());
    w.observer = Some(seen.clone());
    let take = || std::mem::take(&mut *seen.0.lock().expect("lock"));
    w.apply(watcher::Event::Apply(node("a", "z1")));
    w.apply(watcher::Event::Apply(node("b", "z2")));
    w.apply(watcher::Event::Delete(node("a", "z1-at-deletion")));
    // The deleted value is the stored one.
    assert_eq!(take(), ["+z1", "+z2", "-z1"]);
    // Deleted without ever being stored: the deleted object itself.
    w.apply(watcher::Event::Delete(node("x", "zx")));
    assert_eq!(take(), ["-zx"]);
    // A relist: `b` vanished (removed), `c` arrived (stored).
    w.apply(watcher::Event::Init);
    w.apply(watcher::Event::InitApply(node("c", "z3")));
    assert!(take().is_empty(), "nothing before the list is complete");
    w.apply(watcher::Event::InitDone);
    assert_eq!(take(), ["-z2", "+z3"]);
}

fn report(node: &str, counted: &[&str]) -> TeeCapacity {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeCapacity",
        "metadata": {"name": node},
        "spec": {"nodeName": node},
        "status": {"countedPods": counted}
    }))
    .expect("report")
}

fn holds(node: &str, entries: serde_json::Value) -> TeeReservation {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeReservation",
        "metadata": {"name": node, "resourceVersion": "1"},
        "spec": {"nodeName": node, "reservations": entries}
    }))
    .expect("reservation")
}

fn hold(pod_uid: &str, vmi_uid: &str, reason: &str) -> serde_json::Value {
    serde_json::json!({"podUid": pod_uid, "pod": "", "vmiUid": vmi_uid, "tdx": 1,
        "reason": reason, "admittedAt": "2026-11-26T10:00:00Z"})
}

/// Issue #28: a hold ends when the report counting its pod arrives, with no check on the node in
/// between; and when the pod's deletion arrives (a pod deleted before its binding held its key for a
/// TTL: a KubeVirt test flaked).
#[test]
fn the_watches_end_holds_as_reports_and_deletions_arrive() {
    let ix = index();
    Sink::apply(
        &ix,
        holds(
            "n1",
            serde_json::json!([
                hold("uid-a", "vmi-a", "Admitted"),
                hold("uid-b", "vmi-b", "Admitted")
            ]),
        ),
    );
    let ended = |uid: &str| {
        let r = ix.read();
        let e = r
            .entries("n1")
            .find(|e| e.pod_uid == uid)
            .cloned()
            .expect("entry");
        r.end("n1", &e, ix.now())
    };
    assert_eq!((ended("uid-a"), ended("uid-b")), (None, None));
    Sink::apply(&ix, report("n1", &["uid-a"]));
    assert_eq!(
        ended("uid-a"),
        Some(End::Counted),
        "a's ended at the report's arrival"
    );
    // A report that no longer lists a (the pod stopped, its object not deleted yet) does not hold it again.
    Sink::apply(&ix, report("n1", &[]));
    assert_eq!(ended("uid-a"), Some(End::Counted));
    let pod = |uid: &str| -> LauncherPod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "virt-launcher-b", "namespace": "ns", "uid": uid}
        }))
        .expect("pod")
    };
    let (_pods, mut w) = NamedStore::new(CachedLauncherPod::from);
    w.observer = Some(Arc::new(ix.clone()));
    w.apply(watcher::Event::Apply(pod("uid-b")));
    assert_eq!(ended("uid-b"), None, "a stored pod ends nothing");
    w.apply(watcher::Event::Delete(pod("uid-b")));
    assert_eq!(
        ended("uid-b"),
        Some(End::PodGone),
        "b's ended at its deletion, before its binding"
    );
}

#[tokio::test]
async fn wait_for_returns_an_object_the_watch_delivers_within_the_wait_and_none_after_it() {
    let (store, mut w) =
        NamedStore::new(|n: PartialObjectMeta<Node>| n.metadata.labels.unwrap_or_default());
    let zone = |l: &Labels| l.get("zone").cloned();
    let writer = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(30)).await;
        w.apply(watcher::Event::Apply(node("a", "z0")));
        tokio::time::sleep(Duration::from_millis(30)).await;
        w.apply(watcher::Event::Apply(node("a", "z1")));
        w
    });
    // Only the change that makes `accept` hold ends the wait.
    let found = store
        .wait_for("", "a", Duration::from_secs(5), |l| {
            zone(l).as_deref() == Some("z1")
        })
        .await;
    assert_eq!(found.and_then(|l| zone(&l)).as_deref(), Some("z1"));
    let _w = writer.await.expect("writer");
    let started = std::time::Instant::now();
    let none = store
        .wait_for("", "b", Duration::from_millis(50), |_| true)
        .await;
    assert!(none.is_none());
    assert!(started.elapsed() >= Duration::from_millis(50));
}

/// A TDX VMI in `phase`, its pod refused by teeguard when `refused`.
fn vmi(name: &str, phase: &str, refused: bool) -> VirtualMachineInstance {
    let mut conditions = vec![serde_json::json!({"type": "Ready", "status": "False"})];
    if refused {
        conditions.push(serde_json::json!({
            "type": "Synchronized", "status": "False", "reason": "FailedCreate",
            "lastTransitionTime": "2026-11-26T10:00:00Z",
            "message": "failed to create virtual machine pod: admission webhook \"validate.pods.teeguard.dev\" denied the request: no node can host this TDX VM; teeguard starts this VM by itself as soon as a key is free for it"
        }));
    }
    VirtualMachineInstance::from_json(serde_json::json!({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": "vms", "uid": format!("uid-{name}"),
            "labels": {"app": "x"},
            "annotations": {names::RETRIED_ANNOTATION: "2026-11-26T10:05:00Z", "other": "y"}},
        "spec": {"domain": {"launchSecurity": {"tdx": {}}}, "nodeSelector": {"rack": "r1"},
            "affinity": {"nodeAffinity": {}}},
        "status": {"phase": phase, "conditions": conditions}
    }))
    .expect("VMI")
}

#[test]
fn a_waiting_vmi_keeps_what_its_retry_needs_and_any_other_vmi_drops_it() {
    let mut w = vmi("a", "Pending", true);
    w.metadata.deletion_timestamp = None;
    slim_vmi(&mut w);
    assert_eq!(w.metadata.annotations, None);
    assert_eq!(w.metadata.labels, None);
    assert!(w.spec.node_selector.is_some() && w.spec.affinity.is_some());
    let conditions = &w.status.as_ref().expect("status").conditions;
    assert_eq!(conditions.len(), 1, "only the refusal is kept");
    assert!(
        crate::decide::queue::waiting(&w).is_some(),
        "still waiting once slimmed"
    );

    let mut running = vmi("b", "Scheduled", true);
    slim_vmi(&mut running);
    assert_eq!(running.spec.node_selector, None);
    assert_eq!(running.spec.affinity, None);
    assert!(
        running
            .status
            .as_ref()
            .expect("status")
            .conditions
            .is_empty()
    );
    assert_eq!(
        running.status.and_then(|s| s.phase).as_deref(),
        Some("Scheduled")
    );
}

#[tokio::test]
async fn the_vmi_cache_keeps_the_waiting_vmis_wakes_the_planner_and_ends_a_deleted_vmis_promise() {
    let ix = index();
    let (_vmis, mut w) = NamedStore::new(|mut v: VirtualMachineInstance| {
        slim_vmi(&mut v);
        v
    });
    w.observer = Some(Arc::new(ix.clone()));
    let waiting = || ix.read().waiting_counts().values().sum::<usize>();
    w.apply(watcher::Event::Apply(vmi("other", "Pending", false)));
    assert_eq!(waiting(), 0, "not refused by teeguard");
    // Drain the wake-ups so far, then one VMI starts waiting.
    let _ = tokio::time::timeout(Duration::from_millis(10), ix.changed()).await;
    w.apply(watcher::Event::Apply(vmi("a", "Pending", true)));
    assert_eq!(
        ix.read()
            .waiting_counts()
            .get(&teeguard_shared::TeeKind::Tdx),
        Some(&1)
    );
    tokio::time::timeout(Duration::from_secs(1), ix.changed())
        .await
        .expect("a VMI that starts waiting wakes the planner");
    w.apply(watcher::Event::Apply(vmi("a", "Scheduling", false)));
    assert_eq!(waiting(), 0, "its pod was created");
    // A key promised to b; b is deleted before its pod is created.
    w.apply(watcher::Event::Apply(vmi("b", "Pending", true)));
    Sink::apply(
        &ix,
        holds("n1", serde_json::json!([hold("", "uid-b", "Promised")])),
    );
    let promise_end = || {
        let r = ix.read();
        let e = r.entries("n1").next().cloned().expect("promise");
        r.end("n1", &e, ix.now())
    };
    assert_eq!(promise_end(), None);
    w.apply(watcher::Event::Delete(vmi("b", "Pending", true)));
    assert_eq!(waiting(), 0, "deleted");
    assert_eq!(
        promise_end(),
        Some(End::VmiDone),
        "a deleted VMI's promise ends with it"
    );
}

/// A refused launcher pod's own node selector (virt-controller adds labels the VMI does not carry)
/// replaces the one read from the VMI, whether the refusal comes before the VMI's status says it
/// waits (as usual) or after; it is forgotten once the VMI's pod is created.
#[test]
fn a_waiting_vmi_goes_where_its_refused_pod_could_go() {
    let ix = index();
    let (_vmis, mut w) = NamedStore::new(|mut v: VirtualMachineInstance| {
        slim_vmi(&mut v);
        v
    });
    w.observer = Some(Arc::new(ix.clone()));
    let pod = PodSpec {
        node_selector: Some(BTreeMap::from([
            ("kubevirt.io/tdx".to_string(), "true".to_string()),
            ("kubevirt.io/schedulable".to_string(), "true".to_string()),
        ])),
        ..PodSpec::default()
    };
    let selector_of = |name: &str| {
        ix.read()
            .vmis()
            .filter_map(|(_, v)| v.waiting.clone())
            .find(|x| x.vmi.name == name)
            .and_then(|x| x.placement.node_selector)
    };
    let refused = |name: &str| ix.update(|i, _| i.refused(&format!("uid-{name}"), &pod));
    // Refused first, then the VMI's status says so.
    refused("a");
    w.apply(watcher::Event::Apply(vmi("a", "Pending", true)));
    assert_eq!(selector_of("a"), pod.node_selector);
    // Waiting first (read from the VMI: its own selector and its kind's label), then refused again.
    w.apply(watcher::Event::Apply(vmi("b", "Pending", true)));
    assert_eq!(
        selector_of("b").map(|s| s.keys().cloned().collect::<Vec<_>>()),
        Some(vec!["kubevirt.io/tdx".to_string(), "rack".to_string()])
    );
    refused("b");
    assert_eq!(selector_of("b"), pod.node_selector);
    // a's pod is created: a no longer waits, and waits again later with the VMI's selector only.
    w.apply(watcher::Event::Apply(vmi("a", "Scheduling", false)));
    w.apply(watcher::Event::Apply(vmi("a", "Pending", true)));
    assert_ne!(selector_of("a"), pod.node_selector);
}
