//! Object verbs of the fake API server through the real kube client: CRUD semantics, patches of every type,
//! server-side apply, subresources, selectors, pagination, metadata-only lists, discovery, events, faults.

use kube::ResourceExt;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Binding, Event as CoreEvent, Node, ObjectReference, Pod};
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams,
    WatchParams,
};
use kube::core::PartialObjectMeta;
use kube::discovery::{Discovery, Scope};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client};
use serde_json::{Value, json};
use teeguard_tests::fakeapi::{FakeApiServer, FaultRule, PatchType, RequestFilter, Verb};
use teeguard_tests::patch::MergePatch;
use tower::ServiceExt;

fn code(e: &kube::Error) -> u16 {
    match e {
        kube::Error::Api(s) => s.code,
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn pod(name: &str, labels: Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "labels": labels},
        "spec": {"containers": [{"name": "compute", "image": "virt-launcher"}]}
    }))
    .expect("valid pod")
}

fn node(name: &str) -> Value {
    json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"kubevirt.io/tdx": "true"}},
           "status": {"capacity": {"cpu": "64"}, "allocatable": {"cpu": "63"},
                      "conditions": [{"type": "Ready", "status": "True"}]}})
}

fn teecap_resource() -> ApiResource {
    ApiResource {
        group: "teeguard.dev".into(),
        version: "v1alpha1".into(),
        api_version: "teeguard.dev/v1alpha1".into(),
        kind: "TeeCapacity".into(),
        plural: "teecapacities".into(),
    }
}

fn teecap(name: &str, body: Value) -> DynamicObject {
    let mut v = json!({"apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeCapacity", "metadata": {"name": name}});
    if let (Value::Object(m), Value::Object(b)) = (&mut v, body) {
        m.extend(b);
    }
    serde_json::from_value(v).expect("valid dynamic object")
}

#[tokio::test]
async fn create_get_update_conflicts_and_generate_name() {
    let server = FakeApiServer::new();
    let api: Api<Pod> = Api::namespaced(server.client(), "ns");
    let created = api
        .create(&PostParams::default(), &pod("a", json!({})))
        .await
        .expect("create");
    let meta = &created.metadata;
    assert!(meta.uid.as_deref().is_some_and(|u| u.len() == 36));
    assert!(meta.creation_timestamp.is_some());
    assert_eq!(meta.generation, Some(1));
    assert_eq!(
        created.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Pending")
    );
    assert_eq!(
        code(
            &api.create(&PostParams::default(), &pod("a", json!({})))
                .await
                .expect_err("exists")
        ),
        409
    );

    let mut fresh = api.get("a").await.expect("get");
    fresh.spec.as_mut().expect("spec").node_selector =
        Some([("kubevirt.io/tdx".to_string(), "true".to_string())].into());
    let updated = api
        .replace("a", &PostParams::default(), &fresh)
        .await
        .expect("replace");
    assert_eq!(updated.metadata.generation, Some(2));
    assert_ne!(
        updated.metadata.resource_version,
        created.metadata.resource_version
    );
    // `fresh` still carries the old resourceVersion: a stale update.
    let e = api
        .replace("a", &PostParams::default(), &fresh)
        .await
        .expect_err("stale update");
    assert_eq!(code(&e), 409);
    let kube::Error::Api(s) = e else {
        unreachable!()
    };
    assert_eq!(s.reason, "Conflict");
    assert_eq!(code(&api.get("missing").await.expect_err("missing")), 404);

    let mut gen_pod = pod("", json!({}));
    gen_pod.metadata.name = None;
    gen_pod.metadata.generate_name = Some("virt-launcher-vm1-".into());
    let g = api
        .create(&PostParams::default(), &gen_pod)
        .await
        .expect("generateName");
    let name = g.metadata.name.expect("generated name");
    assert!(
        name.starts_with("virt-launcher-vm1-") && name.len() == "virt-launcher-vm1-".len() + 5,
        "{name}"
    );
    assert!(
        name["virt-launcher-vm1-".len()..]
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
    );

    let mut nameless = pod("", json!({}));
    nameless.metadata.name = None;
    assert_eq!(
        code(
            &api.create(&PostParams::default(), &nameless)
                .await
                .expect_err("no name")
        ),
        422
    );

    // dryRun validates but does not persist.
    let dry = PostParams {
        dry_run: true,
        ..Default::default()
    };
    api.create(&dry, &pod("dry", json!({})))
        .await
        .expect("dry-run create");
    assert!(server.get("pods", Some("ns"), "dry").is_none());
    assert_eq!(
        code(
            &api.create(&dry, &pod("a", json!({})))
                .await
                .expect_err("dry-run still validates")
        ),
        409
    );
}

#[tokio::test]
async fn status_subresource_rules() {
    let server = FakeApiServer::new();
    let pods: Api<Pod> = Api::namespaced(server.client(), "ns");
    pods.create(&PostParams::default(), &pod("a", json!({})))
        .await
        .expect("create");
    // Main-resource patches ignore status; status patches ignore everything else.
    let mut both = json!({"metadata": {"labels": {"l": "1"}}, "status": {"phase": "Running"}});
    let phase = |p: &Pod| p.status.as_ref().and_then(|s| s.phase.clone());
    let p = pods.merge_patch("a", &both).await.expect("patch main");
    assert_eq!(phase(&p).as_deref(), Some("Pending"));
    assert_eq!(p.labels().get("l").map(String::as_str), Some("1"));
    both["metadata"]["labels"]["l"] = json!("2");
    let p = pods
        .merge_patch_status("a", &both)
        .await
        .expect("patch status");
    assert_eq!(phase(&p).as_deref(), Some("Running"));
    assert_eq!(p.labels().get("l").map(String::as_str), Some("1"));
    // Status writes do not bump generation.
    assert_eq!(p.metadata.generation, Some(1));
    assert_eq!(
        code(
            &server
                .client()
                .request::<Value>(
                    http::Request::get("/api/v1/nodes/x/scale")
                        .body(vec![])
                        .expect("req")
                )
                .await
                .expect_err("no such subresource")
        ),
        404
    );
}

#[tokio::test]
async fn patches_of_every_type_on_pod_and_node_status() {
    let server = FakeApiServer::new();
    server.create(&node("n1")).expect("node");
    let nodes: Api<Node> = Api::all(server.client());
    let pp = PatchParams::default();

    // JSON Patch on node status, the way NFD advertises an extended resource.
    let jp: json_patch::Patch = serde_json::from_value(json!([
        {"op": "test", "path": "/status/capacity/cpu", "value": "64"},
        {"op": "add", "path": "/status/capacity/tdx.intel.com~1keys", "value": "31"},
        {"op": "add", "path": "/status/allocatable/tdx.intel.com~1keys", "value": "31"}
    ]))
    .expect("json patch");
    let n = nodes
        .patch_status("n1", &pp, &Patch::<()>::Json(jp))
        .await
        .expect("json patch");
    let cap = n
        .status
        .as_ref()
        .and_then(|s| s.capacity.as_ref())
        .expect("capacity");
    assert_eq!(
        cap.get("tdx.intel.com/keys").map(|q| q.0.as_str()),
        Some("31")
    );
    // A failing test op is rejected like the real server (422) and changes nothing.
    let bad: json_patch::Patch = serde_json::from_value(
        json!([{"op": "test", "path": "/status/capacity/cpu", "value": "1"},
                                      {"op": "remove", "path": "/status/capacity/cpu"}]),
    )
    .expect("json patch");
    let before = server.resource_version();
    assert_eq!(
        code(
            &nodes
                .patch_status("n1", &pp, &Patch::<()>::Json(bad))
                .await
                .expect_err("test fails")
        ),
        422
    );
    assert_eq!(server.resource_version(), before);

    // Merge patch on node status.
    let n = nodes
        .patch_status(
            "n1",
            &pp,
            &Patch::Merge(json!({"status": {"allocatable": {"tdx.intel.com/keys": "30"}}})),
        )
        .await
        .expect("merge patch");
    let alloc = n
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .expect("allocatable");
    assert_eq!(
        alloc.get("tdx.intel.com/keys").map(|q| q.0.as_str()),
        Some("30")
    );
    assert_eq!(alloc.get("cpu").map(|q| q.0.as_str()), Some("63"));

    // Strategic merge: conditions merge by type.
    let n = nodes
        .patch_status(
            "n1",
            &pp,
            &Patch::Strategic(
                json!({"status": {"conditions": [{"type": "TeeKeysAvailable", "status": "True"}]}}),
            ),
        )
        .await
        .expect("strategic patch");
    let types: Vec<String> = n
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .map(|c| c.type_)
        .collect();
    assert_eq!(types, ["Ready", "TeeKeysAvailable"]);

    // Strategic merge on a pod: containers by name, env by name, tolerations replaced.
    let pods: Api<Pod> = Api::namespaced(server.client(), "ns");
    let mut p = pod("a", json!({}));
    p.spec.as_mut().expect("spec").tolerations = Some(vec![
        serde_json::from_value(json!({"key": "a"})).expect("tol"),
    ]);
    pods.create(&PostParams::default(), &p)
        .await
        .expect("create");
    let p = pods
        .patch(
            "a",
            &pp,
            &Patch::Strategic(json!({"spec": {
                "containers": [{"name": "compute", "resources": {"limits": {"tdx.intel.com/keys": "1"}}}],
                "tolerations": [{"key": "b"}]}})),
        )
        .await
        .expect("strategic pod patch");
    let spec = p.spec.expect("spec");
    assert_eq!(spec.containers.len(), 1);
    assert_eq!(spec.containers[0].image.as_deref(), Some("virt-launcher"));
    assert!(
        spec.containers[0]
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .is_some_and(|l| l.contains_key("tdx.intel.com/keys"))
    );
    assert_eq!(spec.tolerations.map(|t| t.len()), Some(1));
    // Pod status: strategic merge of conditions by type.
    pods.patch_status(
        "a",
        &pp,
        &Patch::Strategic(
            json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}}),
        ),
    )
    .await
    .expect("status");
    let p = pods
        .patch_status(
            "a",
            &pp,
            &Patch::Strategic(
                json!({"status": {"conditions": [{"type": "PodScheduled", "status": "True"}]}}),
            ),
        )
        .await
        .expect("status");
    assert_eq!(
        p.status.and_then(|s| s.conditions).map(|c| c.len()),
        Some(2)
    );

    // Strategic merge patch is refused for custom resources.
    let caps: Api<DynamicObject> = Api::all_with(server.client(), &teecap_resource());
    caps.create(
        &PostParams::default(),
        &teecap("n1", json!({"spec": {"nodeName": "n1"}})),
    )
    .await
    .expect("cr");
    let e = caps
        .patch(
            "n1",
            &pp,
            &Patch::Strategic(json!({"spec": {"nodeName": "x"}})),
        )
        .await
        .expect_err("415");
    assert_eq!(code(&e), 415);
    // A merge patch carrying a stale resourceVersion is a conflict.
    let e = caps
        .patch(
            "n1",
            &pp,
            &Patch::Merge(json!({"metadata": {"resourceVersion": "1"}, "spec": {"nodeName": "x"}})),
        )
        .await
        .expect_err("stale rv");
    assert_eq!(code(&e), 409);
    // Programmatic patch helper.
    let v = server
        .patch(
            "nodes",
            None,
            "n1",
            PatchType::Merge,
            &json!({"metadata": {"labels": {"x": "y"}}}),
        )
        .expect("programmatic patch");
    assert_eq!(v["metadata"]["labels"]["x"], "y");
}

#[tokio::test]
async fn binding_subresource() {
    let server = FakeApiServer::new();
    let pods: Api<Pod> = Api::namespaced(server.client(), "ns");
    pods.create(&PostParams::default(), &pod("a", json!({})))
        .await
        .expect("create");
    let binding: Binding = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Binding", "metadata": {"name": "a", "namespace": "ns"},
        "target": {"apiVersion": "v1", "kind": "Node", "name": "node-1"}
    }))
    .expect("binding");
    let status: kube::core::Status = pods
        .create_subresource("binding", "a", &PostParams::default(), &binding)
        .await
        .expect("bind");
    assert!(status.is_success());
    let p = pods.get("a").await.expect("get");
    assert_eq!(p.spec.and_then(|s| s.node_name).as_deref(), Some("node-1"));
    let scheduled = p.status.and_then(|s| s.conditions).unwrap_or_default();
    assert!(
        scheduled
            .iter()
            .any(|c| c.type_ == "PodScheduled" && c.status == "True")
    );
    let e = pods
        .create_subresource::<_, kube::core::Status>(
            "binding",
            "a",
            &PostParams::default(),
            &binding,
        )
        .await
        .expect_err("already bound");
    assert_eq!(code(&e), 409);
    let recorded = server.requests_matching(
        &RequestFilter::new()
            .verb(Verb::Create)
            .resource("pods")
            .subresource("binding"),
    );
    assert_eq!(recorded.len(), 2);
    assert_eq!(
        recorded[0]
            .body
            .as_ref()
            .map(|b| b["target"]["name"].clone()),
        Some(json!("node-1"))
    );
    assert_eq!(recorded[1].response_code, Some(409));
    // Programmatic binding.
    server.create(&pod("b", json!({}))).expect("pod b");
    server.bind_pod("ns", "b", "node-2").expect("bind b");
    assert_eq!(
        server
            .bind_pod("ns", "b", "node-3")
            .expect_err("bound")
            .code(),
        Some(409)
    );
    let b = server.set_pod_phase("ns", "b", "Running").expect("phase");
    assert_eq!(b["status"]["phase"], "Running");
}

#[tokio::test]
async fn selectors_pagination_and_metadata_lists() {
    let server = FakeApiServer::new();
    for (i, app) in ["web", "db", "web", "cache", "web"].iter().enumerate() {
        server
            .create(&pod(
                &format!("p{i}"),
                json!({"app": app, "idx": i.to_string()}),
            ))
            .expect("seed");
    }
    server.bind_pod("ns", "p0", "n1").expect("bind");
    server.bind_pod("ns", "p1", "n1").expect("bind");
    let mut other = pod("q", json!({"app": "web"}));
    other.metadata.namespace = Some("other".into());
    server.create(&other).expect("other ns");
    let pods: Api<Pod> = Api::namespaced(server.client(), "ns");
    let names = |l: Vec<Pod>| {
        l.into_iter()
            .map(|p| p.metadata.name.unwrap_or_default())
            .collect::<Vec<_>>()
    };

    let l = pods
        .list(&ListParams::default().labels("app=web"))
        .await
        .expect("list");
    assert_eq!(names(l.items), ["p0", "p2", "p4"]);
    let l = pods
        .list(&ListParams::default().labels("app in (db,cache),!missing"))
        .await
        .expect("list");
    assert_eq!(names(l.items), ["p1", "p3"]);
    let l = pods
        .list(
            &ListParams::default()
                .labels("app!=web")
                .fields("spec.nodeName=n1"),
        )
        .await
        .expect("list");
    assert_eq!(names(l.items), ["p1"]);
    let l = pods
        .list(&ListParams::default().fields("metadata.name!=p0,spec.nodeName==n1"))
        .await
        .expect("list");
    assert_eq!(names(l.items), ["p1"]);
    let e = pods
        .list(&ListParams::default().fields("spec.containers=x"))
        .await
        .expect_err("unsupported field");
    assert_eq!(code(&e), 400);
    let e = pods
        .list(&ListParams::default().labels("app in web"))
        .await
        .expect_err("bad selector");
    assert_eq!(code(&e), 400);

    let all: Api<Pod> = Api::all(server.client());
    let l = all
        .list(&ListParams::default().labels("app=web"))
        .await
        .expect("all namespaces");
    assert_eq!(names(l.items), ["p0", "p2", "p4", "q"]);

    // Pagination with an opaque continue token.
    let mut seen = Vec::new();
    let mut lp = ListParams::default().limit(2);
    loop {
        let page = all.list(&lp).await.expect("page");
        seen.extend(names(page.items));
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => lp = lp.continue_token(&c),
            _ => break,
        }
    }
    assert_eq!(seen, ["p0", "p1", "p2", "p3", "p4", "q"]);
    assert_eq!(
        server
            .requests_matching(&RequestFilter::new().verb(Verb::List))
            .iter()
            .filter(|r| r.query_param("limit") == Some("2"))
            .count(),
        3
    );

    // Metadata-only list.
    let meta = pods
        .list_metadata(&ListParams::default().labels("app=db"))
        .await
        .expect("metadata list");
    assert_eq!(meta.items.len(), 1);
    assert_eq!(meta.items[0].metadata.name.as_deref(), Some("p1"));
    assert_eq!(
        meta.items[0].types.as_ref().map(|t| t.kind.as_str()),
        Some("PartialObjectMetadata")
    );
    let one = pods.get_metadata("p1").await.expect("metadata get");
    assert_eq!(one.labels().get("app").map(String::as_str), Some("db"));
    let pom: Api<PartialObjectMeta<Pod>> = Api::namespaced(server.client(), "ns");
    assert_eq!(
        pom.list(&ListParams::default())
            .await
            .expect("typed metadata list")
            .items
            .len(),
        5
    );

    // The programmatic API agrees.
    assert_eq!(
        server
            .list_selected("pods", None, "app=web", "spec.nodeName=n1")
            .expect("select")
            .len(),
        1
    );
    assert_eq!(server.count("pods"), 6);
    assert_eq!(
        server
            .list_typed::<Pod>(Some("other"))
            .expect("typed")
            .len(),
        1
    );
}

#[tokio::test]
async fn delete_finalizers_and_preconditions() {
    let server = FakeApiServer::new();
    let pods: Api<Pod> = Api::namespaced(server.client(), "ns");
    let mut p = pod("f", json!({}));
    p.metadata.finalizers = Some(vec!["teeguard.dev/keys".into()]);
    pods.create(&PostParams::default(), &p)
        .await
        .expect("create");
    let out = pods
        .delete("f", &DeleteParams::background())
        .await
        .expect("delete");
    let pending = out.left().expect("pods answer with the object");
    assert!(pending.metadata.deletion_timestamp.is_some());
    assert!(server.get("pods", Some("ns"), "f").is_some());
    pods.merge_patch("f", json!({"metadata": {"finalizers": null}}))
        .await
        .expect("remove finalizer");
    assert!(server.get("pods", Some("ns"), "f").is_none());

    pods.create(&PostParams::default(), &pod("g", json!({})))
        .await
        .expect("create");
    let wrong_uid = DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: Some("nope".into()),
            resource_version: None,
        }),
        ..Default::default()
    };
    assert_eq!(
        code(
            &pods
                .delete("g", &wrong_uid)
                .await
                .expect_err("precondition")
        ),
        409
    );
    let dry = DeleteParams {
        dry_run: true,
        ..Default::default()
    };
    pods.delete("g", &dry).await.expect("dry-run delete");
    assert!(server.get("pods", Some("ns"), "g").is_some());
    pods.delete("g", &DeleteParams::foreground())
        .await
        .expect("delete");
    assert_eq!(
        code(
            &pods
                .delete("g", &DeleteParams::default())
                .await
                .expect_err("gone")
        ),
        404
    );

    // Non-pod resources answer DELETE with a Status.
    server.create(&node("n1")).expect("node");
    let nodes: Api<Node> = Api::all(server.client());
    let out = nodes
        .delete("n1", &DeleteParams::default())
        .await
        .expect("delete node");
    assert!(out.right().is_some_and(|s| s.is_success()));
    // deletecollection with a selector.
    for i in 0..3 {
        server
            .create(&pod(
                &format!("c{i}"),
                json!({"batch": if i < 2 { "x" } else { "y" }}),
            ))
            .expect("seed");
    }
    pods.delete_collection(
        &DeleteParams::default(),
        &ListParams::default().labels("batch=x"),
    )
    .await
    .expect("deletecollection");
    assert_eq!(
        server
            .list_selected("pods", Some("ns"), "batch", "")
            .expect("list")
            .len(),
        1
    );
}

#[tokio::test]
async fn server_side_apply_round_trips_teecapacity_status() {
    let server = FakeApiServer::new();
    let caps: Api<DynamicObject> = Api::all_with(server.client(), &teecap_resource());
    let agent = PatchParams::apply("teeguard-agent");

    // Apply to a missing object creates it.
    let created = caps
        .patch(
            "node-1",
            &agent,
            &Patch::Apply(teecap("node-1", json!({"spec": {"nodeName": "node-1"}}))),
        )
        .await
        .expect("apply creates");
    assert_eq!(created.data["spec"]["nodeName"], "node-1");
    // Status on the main resource is ignored; /status applies only status.
    let status1 = teecap(
        "node-1",
        json!({"status": {
        "tdx": {"resourceName": "tdx.intel.com/keys", "capacity": 31, "free": 29, "external": 1},
        "heartbeatTime": "2025-01-01T00:00:00Z",
        "conditions": [
            {"type": "KernelReadable", "status": "True", "reason": "Read", "message": "", "lastTransitionTime": "2025-01-01T00:00:00Z"},
            {"type": "Advertising", "status": "True", "reason": "On", "message": "", "lastTransitionTime": "2025-01-01T00:00:00Z"}
        ]}}),
    );
    let s = caps
        .patch_status("node-1", &agent, &Patch::Apply(&status1))
        .await
        .expect("apply status");
    assert_eq!(s.data["status"]["tdx"]["free"], 29);
    assert_eq!(s.data["spec"]["nodeName"], "node-1");
    let rv1 = s.metadata.resource_version.clone();
    // Re-applying the same configuration is a no-op.
    let again = caps
        .patch_status("node-1", &agent, &Patch::Apply(&status1))
        .await
        .expect("re-apply");
    assert_eq!(again.metadata.resource_version, rv1);
    let managers: Vec<(String, String, Option<String>)> = again
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .map(|m| {
            (
                m.manager.unwrap_or_default(),
                m.operation.unwrap_or_default(),
                m.subresource,
            )
        })
        .collect();
    assert!(
        managers.contains(&(
            "teeguard-agent".into(),
            "Apply".into(),
            Some("status".into())
        )),
        "{managers:?}"
    );

    // Re-apply without `external`, `heartbeatTime` and the Advertising condition: they are removed.
    let status2 = teecap(
        "node-1",
        json!({"status": {
        "tdx": {"resourceName": "tdx.intel.com/keys", "capacity": 31, "free": 28},
        "conditions": [{"type": "KernelReadable", "status": "True", "reason": "Read", "message": "", "lastTransitionTime": "2025-01-01T00:00:00Z"}]}}),
    );
    let s = caps
        .patch_status("node-1", &agent, &Patch::Apply(&status2))
        .await
        .expect("re-apply");
    assert_eq!(
        s.data["status"]["tdx"],
        json!({"resourceName": "tdx.intel.com/keys", "capacity": 31, "free": 28})
    );
    assert!(s.data["status"].get("heartbeatTime").is_none());
    assert_eq!(
        s.data["status"]["conditions"].as_array().map(Vec::len),
        Some(1)
    );

    // Another manager changing an owned field conflicts; with force it takes the field over.
    let intruder = PatchParams::apply("intruder");
    let other = teecap("node-1", json!({"status": {"tdx": {"free": 99}}}));
    let e = caps
        .patch_status("node-1", &intruder, &Patch::Apply(&other))
        .await
        .expect_err("conflict");
    let kube::Error::Api(st) = &e else {
        panic!("{e:?}")
    };
    assert_eq!((st.code, st.reason.as_str()), (409, "Conflict"));
    assert!(
        st.message.contains("conflict with \"teeguard-agent\"")
            && st.message.contains(".status.tdx.free"),
        "{}",
        st.message
    );
    let forced = caps
        .patch_status("node-1", &intruder.clone().force(), &Patch::Apply(&other))
        .await
        .expect("forced apply");
    assert_eq!(forced.data["status"]["tdx"]["free"], 99);
    // The agent now conflicts in turn.
    let e = caps
        .patch_status("node-1", &agent, &Patch::Apply(&status2))
        .await
        .expect_err("agent conflicts");
    assert_eq!(code(&e), 409);

    // A merge patch by another manager takes ownership too (Update entry).
    let pp = PatchParams {
        field_manager: Some("kubectl-edit".into()),
        ..Default::default()
    };
    caps.patch_status(
        "node-1",
        &pp,
        &Patch::Merge(json!({"status": {"tdx": {"capacity": 32}}})),
    )
    .await
    .expect("merge");
    let e = caps
        .patch_status("node-1", &agent.clone(), &Patch::Apply(&status2))
        .await
        .expect_err("conflict with updater");
    let kube::Error::Api(st) = &e else {
        panic!("{e:?}")
    };
    assert!(st.message.contains("kubectl-edit"), "{}", st.message);

    // The programmatic view agrees, and apply requests were recorded with their field manager.
    let stored = server.get("teecapacities", None, "node-1").expect("stored");
    assert_eq!(stored["status"]["tdx"]["capacity"], 32);
    let applies = server.requests_matching(
        &RequestFilter::new()
            .verb(Verb::Patch)
            .field_manager("teeguard-agent"),
    );
    assert!(
        applies
            .iter()
            .all(|r| r.patch_type() == Some(PatchType::Apply))
    );
    assert_eq!(applies.len(), 6);
    let sent = applies[1].body.as_ref().expect("body recorded");
    assert_eq!(sent["status"]["tdx"]["free"], 29);
}

/// Sends a raw request to the in-process router.
async fn raw(
    server: &FakeApiServer,
    method: &str,
    uri: &str,
    content_type: &str,
    body: &str,
) -> (u16, Value) {
    let req = http::Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", content_type)
        .body(axum::body::Body::from(body.to_string()))
        .expect("request");
    let resp = server.router().oneshot(req).await.expect("infallible");
    let code = resp.status().as_u16();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .expect("body");
    (code, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

#[tokio::test]
async fn apply_protocol_details() {
    let server = FakeApiServer::new();
    let yaml = "apiVersion: teeguard.dev/v1alpha1\nkind: TeeCapacity\nmetadata:\n  name: n1\nspec:\n  nodeName: n1\n";
    let uri = "/apis/teeguard.dev/v1alpha1/teecapacities/n1";
    let (code, body) = raw(&server, "PATCH", uri, "application/apply-patch+yaml", yaml).await;
    assert_eq!(code, 422, "fieldManager is required: {body}");
    assert_eq!(body["kind"], "Status");
    assert!(
        body["message"]
            .as_str()
            .unwrap_or("")
            .contains("fieldManager")
    );
    let (code, body) = raw(
        &server,
        "PATCH",
        &format!("{uri}?fieldManager=m"),
        "application/apply-patch+yaml",
        yaml,
    )
    .await;
    assert_eq!(code, 201, "{body}");
    assert_eq!(body["spec"]["nodeName"], "n1");
    let (code, _) = raw(
        &server,
        "PATCH",
        &format!("{uri}?fieldManager=m"),
        "application/apply-patch+yaml",
        yaml,
    )
    .await;
    assert_eq!(code, 200);
    let (code, body) = raw(
        &server,
        "PATCH",
        &format!("{uri}?fieldManager=m"),
        "text/plain",
        "{}",
    )
    .await;
    assert_eq!(
        (code, body["reason"].clone()),
        (415, json!("UnsupportedMediaType"))
    );
    let (code, _) = raw(
        &server,
        "PATCH",
        &format!("{uri}/status?fieldManager=m"),
        "application/apply-patch+yaml",
        "apiVersion: teeguard.dev/v1alpha1\nkind: TeeCapacity\nmetadata:\n  name: other\n",
    )
    .await;
    assert_eq!(code, 400, "name mismatch");
    let (code, _) = raw(
        &server,
        "PATCH",
        "/apis/teeguard.dev/v1alpha1/teecapacities/nope/status?fieldManager=m",
        "application/apply-patch+yaml",
        "apiVersion: teeguard.dev/v1alpha1\nkind: TeeCapacity\nmetadata:\n  name: nope\n",
    )
    .await;
    assert_eq!(code, 404, "apply to the status of a missing object");
    let (code, body) = raw(&server, "GET", "/apis/nope.io/v1/things", "", "").await;
    assert_eq!((code, body["reason"].clone()), (404, json!("NotFound")));
    let (code, _) = raw(&server, "PUT", "/apis/teeguard.dev/v1alpha1/teecapacities/n1", "application/json",
        r#"{"apiVersion":"teeguard.dev/v1alpha1","kind":"TeeCapacity","metadata":{"name":"n1"},"spec":{"nodeName":"x"}}"#).await;
    assert_eq!(
        code, 422,
        "custom resources need a resourceVersion on update"
    );
    let (code, _) = raw(
        &server,
        "POST",
        "/api/v1/namespaces/ns/pods",
        "application/vnd.kubernetes.protobuf",
        "x",
    )
    .await;
    assert_eq!(code, 415);
    let (code, _) = raw(&server, "POST", "/api/v1/pods", "application/json", "{}").await;
    assert_eq!(code, 405);
}

#[tokio::test]
async fn discovery_describes_the_resources() {
    let server = FakeApiServer::new();
    let client: Client = server.client();
    for discovery in [
        Discovery::new(client.clone())
            .run()
            .await
            .expect("discovery"),
        Discovery::new(client.clone())
            .run_aggregated()
            .await
            .expect("aggregated discovery"),
    ] {
        let (ar, caps) = discovery
            .groups()
            .flat_map(|g| g.recommended_resources())
            .find(|(ar, _)| ar.kind == "TeeCapacity")
            .expect("TeeCapacity discovered");
        assert_eq!(ar.plural, "teecapacities");
        assert_eq!(caps.scope, Scope::Cluster);
        assert!(
            caps.subresources
                .iter()
                .any(|(s, _)| s.plural == "teecapacities/status" || s.plural == "status"),
            "{:?}",
            caps.subresources
        );
        let (vmi, vcaps) = discovery
            .groups()
            .flat_map(|g| g.recommended_resources())
            .find(|(ar, _)| ar.kind == "VirtualMachineInstance")
            .expect("VMIs discovered");
        assert_eq!(vmi.group, "kubevirt.io");
        assert_eq!(vcaps.scope, Scope::Namespaced);
        assert!(
            discovery
                .groups()
                .any(|g| g.name() == "coordination.k8s.io")
        );
    }
    let v = client.apiserver_version().await.expect("version");
    assert_eq!(v.major, "1");
}

#[tokio::test]
async fn events_are_visible_in_both_apis() {
    let server = FakeApiServer::new();
    let client = server.client();
    server
        .create(&pod("virt-launcher-vm-abcde", json!({})))
        .expect("pod");
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "teeguard-webhook".into(),
            instance: None,
        },
    );
    let reference = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some("virt-launcher-vm-abcde".into()),
        namespace: Some("ns".into()),
        ..Default::default()
    };
    let ev = Event {
        type_: EventType::Warning,
        reason: "NoTeeKeys".into(),
        note: Some("no TDX keys left on node-1".into()),
        action: "Scheduling".into(),
        secondary: None,
    };
    recorder.publish(&ev, &reference).await.expect("publish");
    recorder
        .publish(&ev, &reference)
        .await
        .expect("publish again (series patch)");
    let core: Api<CoreEvent> = Api::namespaced(client.clone(), "ns");
    let list = core
        .list(
            &ListParams::default()
                .fields("involvedObject.name=virt-launcher-vm-abcde,reason=NoTeeKeys"),
        )
        .await
        .expect("core events");
    assert_eq!(list.items.len(), 1);
    let e = &list.items[0];
    assert_eq!(e.message.as_deref(), Some("no TDX keys left on node-1"));
    assert_eq!(e.reporting_component.as_deref(), Some("teeguard-webhook"));
    assert_eq!(e.type_.as_deref(), Some("Warning"));
    let v1: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(client, "ns");
    let l = v1
        .list(&ListParams::default().fields("regarding.name=virt-launcher-vm-abcde"))
        .await
        .expect("v1 events");
    assert_eq!(l.items.len(), 1);
    assert_eq!(l.items[0].series.as_ref().map(|s| s.count), Some(2));
    assert_eq!(server.list("events", Some("ns")).len(), 1);
}

#[tokio::test]
async fn scripted_faults_and_request_log() {
    let server = FakeApiServer::new();
    server.create(&node("n1")).expect("node");
    let nodes: Api<Node> = Api::all(server.client());

    // A 500 for one request, then normal service.
    server.add_fault(
        FaultRule::respond(500)
            .verb(Verb::Get)
            .resource("nodes")
            .times(1),
    );
    let e = nodes.get("n1").await.expect_err("injected 500");
    let kube::Error::Api(s) = &e else {
        panic!("{e:?}")
    };
    assert_eq!((s.code, s.reason.as_str()), (500, "InternalError"));
    nodes.get("n1").await.expect("served again");

    // A 409 on status patches of one node only.
    let id = server.add_fault(
        FaultRule::respond(409)
            .verb(Verb::Patch)
            .resource("nodes")
            .name("n1")
            .subresource("status"),
    );
    let pp = PatchParams::default();
    let merge = Patch::Merge(json!({"status": {"allocatable": {"x": "1"}}}));
    assert_eq!(
        code(
            &nodes
                .patch_status("n1", &pp, &merge)
                .await
                .expect_err("409")
        ),
        409
    );
    nodes
        .patch(
            "n1",
            &pp,
            &Patch::Merge(json!({"metadata": {"labels": {"a": "b"}}})),
        )
        .await
        .expect("main resource unaffected");
    server.remove_fault(id);
    nodes
        .patch_status("n1", &pp, &merge)
        .await
        .expect("fault removed");

    // A hang: the client's own timeout fires; clearing releases the request, which then completes.
    server.add_fault(FaultRule::hang().verb(Verb::Get).resource("nodes"));
    assert!(
        tokio::time::timeout(Duration::from_millis(100), nodes.get("n1"))
            .await
            .is_err(),
        "hung"
    );
    let hung = tokio::spawn({
        let nodes = nodes.clone();
        async move { nodes.get("n1").await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!hung.is_finished());
    server.clear_faults();
    tokio::time::timeout(Duration::from_secs(5), hung)
        .await
        .expect("released")
        .expect("join")
        .expect("served");

    // A bounded hang and a delay.
    server.add_fault(
        FaultRule::hang_for(Duration::from_millis(150))
            .verb(Verb::List)
            .times(1),
    );
    let t = std::time::Instant::now();
    nodes
        .list(&ListParams::default())
        .await
        .expect("list after the hang");
    assert!(t.elapsed() >= Duration::from_millis(150));
    server.add_fault(
        FaultRule::delay(Duration::from_millis(50))
            .verb(Verb::List)
            .times(1),
    );
    let t = std::time::Instant::now();
    nodes
        .list(&ListParams::default())
        .await
        .expect("delayed list");
    assert!(t.elapsed() >= Duration::from_millis(50));
    assert_eq!(server.armed_faults(), 0);

    // Whole-server outage.
    server.set_unavailable(true);
    assert_eq!(code(&nodes.get("n1").await.expect_err("503")), 503);
    assert_eq!(
        code(
            &nodes
                .watch(&WatchParams::default(), "0")
                .await
                .err()
                .expect("503 watch")
        ),
        503
    );
    server.set_unavailable(false);
    nodes.get("n1").await.expect("back");

    // The request log.
    let gets = server.requests_matching(
        &RequestFilter::new()
            .verb(Verb::Get)
            .resource("nodes")
            .name("n1"),
    );
    assert!(gets.len() >= 5);
    assert_eq!(gets[0].response_code, Some(500));
    assert_eq!(gets[0].path, "/api/v1/nodes/n1");
    let patch = server
        .requests_where(|r| r.verb == Verb::Patch && r.subresource.as_deref() == Some("status"))
        .pop()
        .expect("status patch recorded");
    assert_eq!(patch.patch_type(), Some(PatchType::Merge));
    assert_eq!(
        patch.body,
        Some(json!({"status": {"allocatable": {"x": "1"}}}))
    );
    assert_eq!(patch.response_code, Some(200));
    server.clear_requests();
    assert!(server.requests().is_empty());
    let waiter = {
        let server = server.clone();
        tokio::spawn(async move {
            server
                .wait_for_request(
                    &RequestFilter::new().verb(Verb::Delete).resource("nodes"),
                    Duration::from_secs(5),
                )
                .await
        })
    };
    nodes
        .delete("n1", &DeleteParams::default())
        .await
        .expect("delete");
    let r = waiter.await.expect("join").expect("seen");
    assert_eq!(r.name.as_deref(), Some("n1"));
    server
        .wait_for(Duration::from_secs(1), "node gone", |s| {
            s.get("nodes", None, "n1").is_none().then_some(())
        })
        .await
        .expect("gone");
    assert!(
        server
            .wait_for(Duration::from_millis(50), "never", |_| None::<()>)
            .await
            .is_err()
    );
}

#[tokio::test]
async fn programmatic_api_and_registered_resources() {
    let server = FakeApiServer::new();
    let created = server.create(&node("n1")).expect("create");
    assert_eq!(
        created["status"]["capacity"]["cpu"], "64",
        "programmatic create keeps status"
    );
    let typed: Node = server
        .get_typed(None, "n1")
        .expect("deserialises")
        .expect("present");
    assert_eq!(
        typed.metadata.uid.as_deref(),
        created["metadata"]["uid"].as_str()
    );

    // insert replaces without a resourceVersion check and keeps uid/creationTimestamp.
    let mut changed = node("n1");
    changed["metadata"]["labels"] = json!({"replaced": "yes"});
    let replaced = server.insert(&changed).expect("insert over existing");
    assert_eq!(replaced["metadata"]["uid"], created["metadata"]["uid"]);
    assert_eq!(replaced["metadata"]["labels"], json!({"replaced": "yes"}));
    // update checks the resourceVersion it carries.
    assert_eq!(
        server.update(&created).expect_err("stale").code(),
        Some(409)
    );
    let v = server.update(&replaced).expect("fresh update");
    assert_eq!(
        v["metadata"]["resourceVersion"], replaced["metadata"]["resourceVersion"],
        "no-op update keeps the version"
    );
    let v = server
        .patch_status(
            "nodes",
            None,
            "n1",
            &json!({"status": {"capacity": {"tdx.intel.com/keys": "31"}}}),
        )
        .expect("patch_status");
    assert_eq!(
        v["status"]["capacity"],
        json!({"cpu": "64", "tdx.intel.com/keys": "31"})
    );
    assert!(
        server
            .patch_status("nodes", None, "n1", &json!({"capacity": {}}))
            .is_err(),
        "needs a status key"
    );
    assert!(
        server.create(&json!({"kind": "Node"})).is_err(),
        "objects need apiVersion and kind"
    );
    assert!(server.get("widgets", None, "x").is_none());
    assert_eq!(server.count("widgets"), 0);

    // Programmatic server-side apply plays another field manager.
    let cap = json!({"apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeCapacity", "metadata": {"name": "n1"},
                     "status": {"tdx": {"free": 1}}});
    server.apply(&json!({"apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeCapacity", "metadata": {"name": "n1"},
                         "spec": {"nodeName": "n1"}}), None, "scenario", false).expect("apply create");
    server
        .apply(&cap, Some("status"), "scenario", false)
        .expect("apply status");
    let caps: Api<DynamicObject> = Api::all_with(server.client(), &teecap_resource());
    let other = teecap("n1", json!({"status": {"tdx": {"free": 2}}}));
    let e = caps
        .patch_status("n1", &PatchParams::apply("agent"), &Patch::Apply(&other))
        .await
        .expect_err("conflict");
    assert_eq!(code(&e), 409);

    // A resource registered by the test is served like the built-ins, discovery included.
    server.register_resource(teeguard_tests::fakeapi::ResourceDef::new(
        "",
        "v1",
        "configmaps",
        "ConfigMap",
        true,
    ));
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> = Api::namespaced(server.client(), "ns");
    let cm: k8s_openapi::api::core::v1::ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "c"}, "data": {"k": "v"}})).expect("cm");
    cms.create(&PostParams::default(), &cm)
        .await
        .expect("create configmap");
    assert_eq!(
        server.get("configmaps", Some("ns"), "c").expect("stored")["data"]["k"],
        "v"
    );
    let d = Discovery::new(server.client())
        .run()
        .await
        .expect("discovery");
    assert!(
        d.groups()
            .flat_map(|g| g.recommended_resources())
            .any(|(ar, _)| ar.kind == "ConfigMap")
    );
    // Core kinds, Events (both APIs), Leases, VMIs, TeeCapacities, TeeReservations, ResourceClaims,
    // ResourceSlices.
    assert_eq!(server.resources().len(), 12);
}
