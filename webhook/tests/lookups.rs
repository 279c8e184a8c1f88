//! The caches' lookups on a miss, against the test kit's API server through the real kube client: a
//! launcher pod the scheduler binds a moment after its creation is found through the watch, without a
//! GET; one that never arrives costs the wait and one GET.

use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_client::registry::Registry;
use teeguard_shared::Config;
use teeguard_tests::fakeapi::{FakeApiServer, Verb};
use teeguard_tests::fixtures::{Tee, VirtLauncherPod};
use teeguard_webhook::cluster::caches::{Caches, Lookups, POD_WATCH_WAIT, PodLookup};
use teeguard_webhook::cluster::index::{KeyIndex, wall_clock};
use teeguard_webhook::metrics::Metrics;
use tokio_util::sync::CancellationToken;

fn pod_gets(api: &FakeApiServer) -> usize {
    api.requests_where(|r| r.verb == Verb::Get && r.resource.as_deref() == Some("pods"))
        .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launcher_pod_bound_a_moment_after_its_creation_is_found_through_the_watch_without_a_get()
{
    let api = FakeApiServer::new();
    let mut registry = Registry::default();
    let metrics = Arc::new(Metrics::new(&mut registry));
    let shutdown = CancellationToken::new();
    let index = KeyIndex::new(Config::default().admission.ledger_ttl, wall_clock());
    let (caches, _tasks) = Caches::start(
        api.client(),
        metrics,
        Duration::from_secs(5),
        index,
        shutdown.clone(),
    );
    caches.wait_synced().await;

    // The pod is created 30 ms after the binding asks for it (its watch event is on its way).
    let pod = VirtLauncherPod::for_tee("vm-a", Tee::Tdx).name("virt-launcher-vm-a-x1");
    let uid = pod.uid().expect("named");
    let creator = tokio::spawn({
        let (api, value) = (api.clone(), pod.to_value());
        async move {
            tokio::time::sleep(Duration::from_millis(30)).await;
            api.create(&value).expect("create the pod");
        }
    });
    let found = caches
        .launcher_pod("default", "virt-launcher-vm-a-x1", &uid)
        .await;
    creator.await.expect("creator");
    let PodLookup::Found(found) = found else {
        panic!("the pod was not found: {found:?}");
    };
    assert_eq!(found.metadata.uid.as_deref(), Some(uid.as_str()));
    assert_eq!(pod_gets(&api), 0, "found through the watch: no GET");

    // A pod that never arrives: the wait, then one GET that finds nothing.
    let started = Instant::now();
    let missing = caches
        .launcher_pod("default", "virt-launcher-vm-b-x2", "uid-b")
        .await;
    assert!(matches!(missing, PodLookup::NotFound), "{missing:?}");
    assert!(started.elapsed() >= POD_WATCH_WAIT);
    assert_eq!(pod_gets(&api), 1, "asked the API server once");
    shutdown.cancel();
}
