//! The fake API server served on 127.0.0.1: a kube client built from a kubeconfig file, watches over TCP,
//! and a stop/restart on the same port that a reflector survives.

use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Config};
use serde_json::json;
use teeguard_tests::fakeapi::{FakeApiServer, RequestFilter, Verb};
use teeguard_tests::wait::eventually;

const T: Duration = Duration::from_secs(10);

fn pod(name: &str) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
        "spec": {"containers": [{"name": "compute", "image": "x"}]}
    }))
    .expect("valid pod")
}

fn names(store: &Store<Pod>) -> Vec<String> {
    let mut v: Vec<String> = store
        .state()
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    v.sort();
    v
}

#[tokio::test]
async fn kubeconfig_client_over_tcp_survives_a_restart() {
    let server = FakeApiServer::new();
    let mut served = server.serve().await.expect("serve");
    assert!(served.url().starts_with("http://127.0.0.1:"));
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("kubeconfig");
    served.write_kubeconfig(&path).expect("write kubeconfig");

    // Exactly what a separate process does with KUBECONFIG.
    let kc = Kubeconfig::read_from(&path).expect("read kubeconfig");
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
        .await
        .expect("config");
    assert_eq!(config.default_namespace, "default");
    let client = Client::try_from(config).expect("client");
    let pods: Api<Pod> = Api::default_namespaced(client.clone());
    pods.create(&PostParams::default(), &pod("a"))
        .await
        .expect("create over TCP");
    assert!(server.get("pods", Some("default"), "a").is_some());
    let create = server
        .requests_matching(&RequestFilter::new().verb(Verb::Create))
        .remove(0);
    assert_eq!(create.path, "/api/v1/namespaces/default/pods");
    assert_eq!(create.response_code, Some(201));

    let (store, writer) = reflector::store::<Pod>();
    let stream = reflector::reflector(writer, watcher(pods.clone(), watcher::Config::default()))
        .default_backoff();
    let task = tokio::spawn(async move {
        let mut s = std::pin::pin!(stream);
        while s.next().await.is_some() {}
    });
    eventually("initial list over TCP", async || names(&store) == ["a"]).await;
    server.create(&pod("b")).expect("programmatic create");
    eventually("watch event over TCP", async || names(&store) == ["a", "b"]).await;

    // Stop: connections (including the watch) are cut and new ones are refused.
    served.stop().await;
    assert!(!served.is_running());
    assert!(
        tokio::time::timeout(T, pods.list(&ListParams::default()))
            .await
            .expect("fails fast")
            .is_err()
    );
    server
        .create(&pod("c"))
        .expect("state changes while the server is down");
    served.restart().await.expect("restart on the same port");
    eventually("reflector recovers after the restart", async || {
        names(&store) == ["a", "b", "c"]
    })
    .await;
    pods.get("c").await.expect("served again");

    // A second client from the helper.
    let helper_client = served
        .client()
        .await
        .expect("client from the generated kubeconfig");
    let l = Api::<Pod>::default_namespaced(helper_client)
        .list(&ListParams::default())
        .await
        .expect("list");
    assert_eq!(l.items.len(), 3);
    task.abort();
    drop(served);
}
