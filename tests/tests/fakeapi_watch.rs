//! Watches, reflectors and watch-related faults of the fake API server, through the real kube client.

use kube::ResourceExt;
use std::time::Duration;

use futures::{Stream, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::core::PartialObjectMeta;
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, Event, watcher};
use serde_json::json;
use teeguard_tests::fakeapi::{FakeApiOptions, FakeApiServer, FaultRule, RequestFilter, Verb};
use teeguard_tests::wait::eventually;

const T: Duration = Duration::from_secs(10);

fn pod(name: &str, labels: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "labels": labels},
        "spec": {"containers": [{"name": "compute", "image": "virt-launcher"}]}
    }))
    .expect("valid pod")
}

async fn next<K>(s: &mut (impl Stream<Item = watcher::Result<Event<K>>> + Unpin)) -> Event<K> {
    tokio::time::timeout(T, s.next())
        .await
        .expect("a watcher event within the timeout")
        .expect("the stream does not end")
        .expect("no watcher error")
}

/// Skips the initial listing and returns the objects it delivered.
async fn until_init_done<K>(
    s: &mut (impl Stream<Item = watcher::Result<Event<K>>> + Unpin),
) -> Vec<K> {
    let mut objs = Vec::new();
    loop {
        match next(s).await {
            Event::Init => {}
            Event::InitApply(o) => objs.push(o),
            Event::InitDone => return objs,
            Event::Apply(_) | Event::Delete(_) => panic!("live event before InitDone"),
        }
    }
}

fn names(store: &Store<Pod>) -> Vec<String> {
    let mut v: Vec<String> = store
        .state()
        .iter()
        .map(|p| p.metadata.name.clone().unwrap_or_default())
        .collect();
    v.sort();
    v
}

/// Runs a reflector in the background; returns its store.
fn spawn_reflector(
    api: Api<Pod>,
    config: watcher::Config,
) -> (Store<Pod>, tokio::task::JoinHandle<()>) {
    let (reader, writer) = reflector::store::<Pod>();
    let stream = reflector::reflector(writer, watcher(api, config)).default_backoff();
    let task = tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while stream.next().await.is_some() {}
    });
    (reader, task)
}

fn server_names(server: &FakeApiServer) -> Vec<String> {
    server
        .list("pods", Some("ns"))
        .iter()
        .map(|p| {
            p["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect()
}

#[tokio::test]
async fn watcher_sees_creates_updates_deletes_in_order() {
    let server = FakeApiServer::new();
    server.create(&pod("pre", json!({}))).expect("seed");
    let api: Api<Pod> = Api::namespaced(server.client(), "ns");
    let mut events = std::pin::pin!(watcher(api.clone(), watcher::Config::default()));
    let initial = until_init_done(&mut events).await;
    assert_eq!(initial.len(), 1);

    let created = api
        .create(&PostParams::default(), &pod("a", json!({"app": "web"})))
        .await
        .expect("create");
    let mut changed = created.clone();
    changed
        .metadata
        .labels
        .get_or_insert_default()
        .insert("tier".into(), "front".into());
    let replaced = api
        .replace("a", &PostParams::default(), &changed)
        .await
        .expect("replace");
    api.delete("a", &DeleteParams::default())
        .await
        .expect("delete");

    match next(&mut events).await {
        Event::Apply(p) => assert_eq!(
            p.metadata.resource_version,
            created.metadata.resource_version
        ),
        other => panic!("expected Apply(create), got {other:?}"),
    }
    match next(&mut events).await {
        Event::Apply(p) => {
            assert_eq!(
                p.metadata.resource_version,
                replaced.metadata.resource_version
            );
            assert_eq!(p.labels().get("tier").map(String::as_str), Some("front"));
        }
        other => panic!("expected Apply(update), got {other:?}"),
    }
    match next(&mut events).await {
        Event::Delete(p) => assert_eq!(p.metadata.name.as_deref(), Some("a")),
        other => panic!("expected Delete, got {other:?}"),
    }

    // The reflector over the same server ends consistent with it.
    let (store, task) = spawn_reflector(api.clone(), watcher::Config::default());
    server
        .create(&pod("b", json!({})))
        .expect("programmatic create");
    eventually("reflector has pre and b", async || {
        names(&store) == ["b", "pre"]
    })
    .await;
    server
        .delete("pods", Some("ns"), "pre")
        .expect("programmatic delete");
    eventually("reflector dropped pre", async || names(&store) == ["b"]).await;
    task.abort();
}

#[tokio::test]
async fn too_old_resource_version_is_410_and_reflector_relists() {
    let server = FakeApiServer::with_options(FakeApiOptions {
        history_limit: 5,
        ..Default::default()
    });
    let api: Api<Pod> = Api::namespaced(server.client(), "ns");
    let first = server.create(&pod("p0", json!({}))).expect("seed");
    let old_rv = first["metadata"]["resourceVersion"]
        .as_str()
        .expect("rv")
        .to_string();
    for i in 1..10 {
        server
            .create(&pod(&format!("p{i}"), json!({})))
            .expect("seed");
    }
    let mut raw = api
        .watch(&WatchParams::default(), &old_rv)
        .await
        .expect("watch starts")
        .boxed();
    match tokio::time::timeout(T, raw.try_next())
        .await
        .expect("event in time")
        .expect("no transport error")
    {
        Some(WatchEvent::Error(e)) => {
            assert_eq!(e.code, 410);
            assert_eq!(e.reason, "Expired");
        }
        other => panic!("expected a 410 ERROR event, got {other:?}"),
    }
    assert!(
        tokio::time::timeout(T, raw.next())
            .await
            .expect("stream closes")
            .is_none()
    );

    // A reflector that misses more than the history while its watch is down must re-list.
    let (store, task) = spawn_reflector(api.clone(), watcher::Config::default());
    eventually("initial list", async || names(&store).len() == 10).await;
    let lists_before = server
        .requests_matching(&RequestFilter::new().verb(Verb::List).resource("pods"))
        .len();
    let refuse = server.add_fault(FaultRule::respond(503).verb(Verb::Watch));
    server.drop_watches();
    for i in 0..5 {
        server
            .delete("pods", Some("ns"), &format!("p{i}"))
            .expect("delete");
    }
    for i in 10..15 {
        server
            .create(&pod(&format!("p{i}"), json!({})))
            .expect("create");
    }
    server.remove_fault(refuse);
    eventually("reflector consistent with the server", async || {
        names(&store) == server_names(&server)
    })
    .await;
    let gone_watches =
        server.requests_where(|r| r.verb == Verb::Watch && r.response_code == Some(200));
    assert!(gone_watches.len() >= 2, "re-watched after the fault");
    let lists_after = server
        .requests_matching(&RequestFilter::new().verb(Verb::List).resource("pods"))
        .len();
    assert!(
        lists_after > lists_before,
        "the 410 made the watcher re-list"
    );
    task.abort();
}

#[tokio::test]
async fn expired_watches_make_the_reflector_relist() {
    let server = FakeApiServer::new();
    let api: Api<Pod> = Api::namespaced(server.client(), "ns");
    server.create(&pod("a", json!({}))).expect("seed");
    let (store, task) = spawn_reflector(api, watcher::Config::default());
    eventually("initial list", async || names(&store) == ["a"]).await;
    server
        .wait_for(T, "the watch to be open", |s| {
            (s.open_watches() == 1).then_some(())
        })
        .await
        .expect("watch");
    let lists = || {
        server
            .requests_matching(&RequestFilter::new().verb(Verb::List))
            .len()
    };
    let before = lists();
    server.expire_watches();
    server.create(&pod("b", json!({}))).expect("create");
    eventually("re-list after 410", async || {
        lists() > before && names(&store) == ["a", "b"]
    })
    .await;
    task.abort();
}

#[tokio::test]
async fn dropped_watch_resumes_without_losing_events() {
    let server = FakeApiServer::new();
    let api: Api<Pod> = Api::namespaced(server.client(), "ns");
    let (store, task) = spawn_reflector(api, watcher::Config::default());
    server
        .wait_for(T, "the watch to be open", |s| {
            (s.open_watches() == 1).then_some(())
        })
        .await
        .expect("watch");
    for round in 0..3 {
        server.drop_watches();
        server
            .create(&pod(&format!("d{round}"), json!({})))
            .expect("create");
        server
            .modify("pods", Some("ns"), &format!("d{round}"), |p| {
                p["metadata"]["labels"] = json!({"x": "y"})
            })
            .expect("modify");
    }
    eventually("all objects seen", async || {
        names(&store) == ["d0", "d1", "d2"]
    })
    .await;
    eventually("labels seen", async || {
        store.state().iter().all(|p| {
            p.metadata
                .labels
                .as_ref()
                .is_some_and(|l| l.contains_key("x"))
        })
    })
    .await;
    task.abort();
}

#[tokio::test]
async fn streaming_list_sends_initial_events_then_bookmark() {
    let server = FakeApiServer::new();
    for n in ["a", "b", "c"] {
        server.create(&pod(n, json!({}))).expect("seed");
    }
    let api: Api<Pod> = Api::namespaced(server.client(), "ns");
    let mut events = std::pin::pin!(watcher(
        api.clone(),
        watcher::Config::default().streaming_lists()
    ));
    let initial = until_init_done(&mut events).await;
    assert_eq!(initial.len(), 3);
    let req = server
        .requests_matching(&RequestFilter::new().verb(Verb::Watch))
        .into_iter()
        .next()
        .expect("a watch request");
    assert_eq!(req.query_param("sendInitialEvents"), Some("true"));
    assert!(
        server
            .requests_matching(&RequestFilter::new().verb(Verb::List))
            .is_empty()
    );
    server.create(&pod("d", json!({}))).expect("create");
    match next(&mut events).await {
        Event::Apply(p) => assert_eq!(p.metadata.name.as_deref(), Some("d")),
        other => panic!("expected Apply, got {other:?}"),
    }
}

#[tokio::test]
async fn selector_watch_reports_objects_leaving_the_selection() {
    let server = FakeApiServer::new();
    server
        .create(&pod("a", json!({"app": "web"})))
        .expect("seed");
    let api: Api<Pod> = Api::namespaced(server.client(), "ns");
    let mut events = std::pin::pin!(watcher(api, watcher::Config::default().labels("app=web")));
    assert_eq!(until_init_done(&mut events).await.len(), 1);
    server
        .create(&pod("other", json!({"app": "db"})))
        .expect("not selected");
    server
        .modify("pods", Some("ns"), "a", |p| {
            p["metadata"]["labels"]["app"] = json!("db")
        })
        .expect("relabel");
    match next(&mut events).await {
        Event::Delete(p) => assert_eq!(p.metadata.name.as_deref(), Some("a")),
        other => panic!("expected Delete for the object leaving the selection, got {other:?}"),
    }
    server
        .modify("pods", Some("ns"), "other", |p| {
            p["metadata"]["labels"]["app"] = json!("web")
        })
        .expect("relabel");
    match next(&mut events).await {
        Event::Apply(p) => assert_eq!(p.metadata.name.as_deref(), Some("other")),
        other => panic!("expected Apply for the object entering the selection, got {other:?}"),
    }
}

#[tokio::test]
async fn field_selector_watch_on_node_name() {
    let server = FakeApiServer::new();
    server.create(&pod("a", json!({}))).expect("seed");
    server.create(&pod("b", json!({}))).expect("seed");
    let api: Api<Pod> = Api::all(server.client());
    let mut events = std::pin::pin!(watcher(
        api,
        watcher::Config::default().fields("spec.nodeName=node-1")
    ));
    assert!(until_init_done(&mut events).await.is_empty());
    server.bind_pod("ns", "b", "node-2").expect("bind b");
    server.bind_pod("ns", "a", "node-1").expect("bind a");
    match next(&mut events).await {
        Event::Apply(p) => assert_eq!(p.metadata.name.as_deref(), Some("a")),
        other => panic!("expected Apply(a), got {other:?}"),
    }
}

#[tokio::test]
async fn metadata_watcher_gets_partial_objects() {
    let server = FakeApiServer::new();
    server.create(&pod("a", json!({"k": "v"}))).expect("seed");
    let api: Api<PartialObjectMeta<Pod>> = Api::namespaced(server.client(), "ns");
    let mut events = std::pin::pin!(watcher(api, watcher::Config::default()));
    let initial = until_init_done(&mut events).await;
    assert_eq!(initial.len(), 1);
    assert_eq!(initial[0].labels().get("k").map(String::as_str), Some("v"));
    assert_eq!(
        initial[0].types.as_ref().map(|t| t.kind.as_str()),
        Some("PartialObjectMetadata")
    );
    server.create(&pod("b", json!({}))).expect("create");
    match next(&mut events).await {
        Event::Apply(p) => assert_eq!(p.metadata.name.as_deref(), Some("b")),
        other => panic!("expected Apply, got {other:?}"),
    }
    let list_req = server
        .requests_matching(&RequestFilter::new().verb(Verb::List))
        .remove(0);
    assert!(
        list_req
            .accept
            .as_deref()
            .unwrap_or("")
            .contains("as=PartialObjectMetadataList")
    );
}

#[tokio::test]
async fn bookmarks_and_timeout() {
    let server = FakeApiServer::with_options(FakeApiOptions {
        bookmark_interval: Duration::from_millis(30),
        ..Default::default()
    });
    let api: Api<Node> = Api::all(server.client());
    let rv = server.resource_version().to_string();
    let mut stream = api
        .watch(&WatchParams::default().timeout(1), &rv)
        .await
        .expect("watch")
        .boxed();
    server
        .create(&json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1"}}))
        .expect("node");
    let mut saw_added = false;
    let mut saw_bookmark = false;
    let started = std::time::Instant::now();
    while let Some(ev) = tokio::time::timeout(T, stream.next())
        .await
        .expect("event or end")
    {
        match ev.expect("event") {
            WatchEvent::Added(n) => saw_added = n.metadata.name.as_deref() == Some("n1"),
            WatchEvent::Bookmark(b) => {
                saw_bookmark = true;
                assert!(b.metadata.resource_version.parse::<u64>().is_ok());
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(saw_added && saw_bookmark);
    assert!(
        started.elapsed() >= Duration::from_millis(900),
        "the watch ends at timeoutSeconds"
    );
}

#[tokio::test]
async fn a_quiet_node_scoped_watch_resumes_from_its_bookmark_after_the_history_moved_on() {
    // A watch of one node sees none of the other nodes' changes; its bookmarks must still carry the
    // store's progress, or resuming from them once the history has moved on is answered 410 Gone and
    // every such watcher re-lists (5,000 agents' node watches, in the API load bench).
    let server = FakeApiServer::with_options(FakeApiOptions {
        bookmark_interval: Duration::from_millis(30),
        history_limit: 20,
        ..Default::default()
    });
    let node = |name: &str| json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}});
    server.create(&node("quiet")).expect("node");
    let api: Api<Node> = Api::all(server.client());
    let rv = server.resource_version().to_string();
    let params = WatchParams::default()
        .fields("metadata.name=quiet")
        .timeout(1);
    let mut stream = api.watch(&params, &rv).await.expect("watch").boxed();
    for i in 0..50 {
        server
            .create(&node(&format!("busy-{i}")))
            .expect("other node");
    }
    let mut resume = None;
    while let Some(ev) = tokio::time::timeout(T, stream.next())
        .await
        .expect("event or end")
    {
        match ev.expect("event") {
            WatchEvent::Bookmark(b) => resume = Some(b.metadata.resource_version),
            other => panic!("the quiet node's watch got {other:?}"),
        }
    }
    let resume = resume.expect("bookmarks");
    assert_eq!(
        resume,
        server.resource_version().to_string(),
        "the store's progress"
    );
    let mut again = api.watch(&params, &resume).await.expect("resumed").boxed();
    server
        .patch(
            "nodes",
            None,
            "quiet",
            teeguard_tests::fakeapi::PatchType::Merge,
            &json!({"metadata": {"labels": {"touched": "yes"}}}),
        )
        .expect("patched");
    match tokio::time::timeout(T, again.next()).await.expect("event") {
        Some(Ok(WatchEvent::Modified(n))) => assert_eq!(n.metadata.name.as_deref(), Some("quiet")),
        other => panic!("resumed without 410 and got the change: {other:?}"),
    }
}

#[tokio::test]
async fn patch_events_reach_watchers_once() {
    let server = FakeApiServer::new();
    let api: Api<Pod> = Api::namespaced(server.client(), "ns");
    let mut events = std::pin::pin!(watcher(api.clone(), watcher::Config::default()));
    until_init_done(&mut events).await;
    api.create(&PostParams::default(), &pod("a", json!({})))
        .await
        .expect("create");
    // The second patch changes nothing: it produces no event.
    for x in ["1", "1", "2"] {
        api.patch(
            "a",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"x": x}}})),
        )
        .await
        .expect("patch");
    }
    let mut seen = Vec::new();
    for _ in 0..3 {
        match next(&mut events).await {
            Event::Apply(p) => seen.push(p.metadata.labels.and_then(|l| l.get("x").cloned())),
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(seen, [None, Some("1".to_string()), Some("2".to_string())]);
    assert!(
        tokio::time::timeout(Duration::from_millis(100), events.next())
            .await
            .is_err(),
        "no extra event"
    );
}

// A watch request in flight when the test drops the watches (here held by a delay) ends as soon as it
// starts, as an API server restart ends it; before, one that started after the drop stayed open, so
// a test that refused and dropped watches could keep a client watching.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_in_flight_when_the_watches_are_dropped_ends_as_it_starts() {
    let server = FakeApiServer::new();
    let api: Api<Node> = Api::all(server.client());
    let rv = server.resource_version().to_string();
    server.add_fault(
        FaultRule::delay(Duration::from_millis(300))
            .verb(Verb::Watch)
            .times(1),
    );
    let watch = tokio::spawn(async move {
        api.watch(&WatchParams::default(), &rv)
            .await
            .map(|s| s.boxed())
    });
    eventually("the watch request held by the delay", async || {
        !server.requests_where(|r| r.verb == Verb::Watch).is_empty()
    })
    .await;
    server.drop_watches();
    let mut stream = watch.await.expect("join").expect("watch starts");
    let end = tokio::time::timeout(T, stream.try_next())
        .await
        .expect("the watch ends instead of staying open")
        .expect("no transport error");
    assert!(end.is_none(), "{end:?}");
}
