//! The agent's DRA driver through the kubelet's real protocol (gRPC over its unix sockets, called with a
//! tonic client as the kubelet calls it), with claims from the test kit's API server: registration
//! info, preparing (the re-check, idempotence, a device another claim holds, a deleted claim),
//! unpreparing (idempotent, unknown claims), and the checkpoint across a restart.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::kubelet::{PREPARE, UNPREPARE, call};
use serde_json::json;
use teeguard_agent::decide::attribution::KindFigures;
use teeguard_agent::decide::claimed::ClaimedKeys;
use teeguard_agent::decide::dra::{AllocatedDevice, PreparedClaim};
use teeguard_agent::dra::{Dra, DraOptions};
use teeguard_agent::kubelet::PluginPaths;
use teeguard_agent::kubelet::proto::*;
use teeguard_agent::metrics::Metrics;
use teeguard_shared::TeeKind;
use teeguard_tests::fakeapi::FakeApiServer;
use tokio_util::sync::CancellationToken;

const NODE: &str = "node-a";

fn claim_object(uid: &str, name: &str, device: &str, pod: &str) -> serde_json::Value {
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": "vms", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "container-0-request-0",
            "exactly": {"deviceClassName": "tdx.tee.teeguard.dev"}}]}},
        "status": {
            "allocation": {"devices": {"results": [{"request": "container-0-request-0",
                "driver": "tee.teeguard.dev", "pool": NODE, "device": device}]}},
            "reservedFor": [{"resource": "pods", "name": pod, "uid": pod}]
        }
    })
}

/// The claim `claim_object` describes, as the driver records it.
fn prepared(name: &str, device: &str, pod: &str) -> PreparedClaim {
    PreparedClaim {
        namespace: "vms".into(),
        name: name.into(),
        pods: vec![pod.into()],
        devices: vec![AllocatedDevice {
            request: "container-0-request-0".into(),
            pool: NODE.into(),
            device: device.into(),
        }],
    }
}

fn claim(uid: &str, name: &str) -> Claim {
    Claim {
        namespace: "vms".into(),
        uid: uid.into(),
        name: name.into(),
    }
}

async fn prepare(socket: &Path, claims: Vec<Claim>) -> NodePrepareResourcesResponse {
    call(socket, PREPARE, NodePrepareResourcesRequest { claims }).await
}

async fn unprepare(socket: &Path, claims: Vec<Claim>) -> NodeUnprepareResourcesResponse {
    call(socket, UNPREPARE, NodeUnprepareResourcesRequest { claims }).await
}

fn start(api: &FakeApiServer, dir: &Path, shutdown: &CancellationToken, metrics: &Metrics) -> Dra {
    Dra::start(
        api.client(),
        DraOptions {
            node_name: NODE.into(),
            kubelet_dir: dir.to_path_buf(),
            api_timeout: Duration::from_secs(5),
        },
        metrics.clone(),
        shutdown.clone(),
    )
    .expect("the driver starts")
}

fn tdx(capacity: u64, external: u64) -> BTreeMap<TeeKind, KindFigures> {
    BTreeMap::from([(
        TeeKind::Tdx,
        KindFigures {
            capacity,
            kernel_used: external,
            external,
            free: capacity - external,
            ..Default::default()
        },
    )])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_driver_registers_prepares_once_per_claim_unprepares_idempotently_and_keeps_its_checkpoint()
 {
    let api = FakeApiServer::new();
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = PluginPaths::under(dir.path());
    let shutdown = CancellationToken::new();
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::new(&mut registry);
    let dra = start(&api, dir.path(), &shutdown, &metrics);

    let info: PluginInfo = call(
        &paths.registration,
        "/pluginregistration.Registration/GetInfo",
        InfoRequest {},
    )
    .await;
    assert_eq!(info.r#type, "DRAPlugin");
    assert_eq!(info.name, "tee.teeguard.dev");
    assert_eq!(PathBuf::from(&info.endpoint), paths.dra);
    assert_eq!(info.supported_versions, ["v1.DRAPlugin"]);

    // Before the first scan nothing is prepared: the kubelet retries.
    api.create(&claim_object("u1", "c1", "tdx-0", "pod-1"))
        .expect("claim");
    let r = prepare(&paths.dra, vec![claim("u1", "c1")]).await;
    assert!(
        r.claims["u1"].error.contains("not read the kernel"),
        "{r:?}"
    );

    dra.observe(&tdx(2, 0), &BTreeMap::new());
    let r = prepare(&paths.dra, vec![claim("u1", "c1")]).await;
    assert_eq!(r.claims["u1"].error, "");
    let devices: Vec<(&str, &str, &[String])> = r.claims["u1"]
        .devices
        .iter()
        .map(|d| {
            (
                d.pool_name.as_str(),
                d.device_name.as_str(),
                d.request_names.as_slice(),
            )
        })
        .collect();
    assert_eq!(
        devices,
        [(NODE, "tdx-0", &["container-0-request-0".to_string()][..])]
    );
    let claims = dra.claims();
    assert_eq!(
        **claims.borrow(),
        ClaimedKeys::from_prepared(&[prepared("c1", "tdx-0", "pod-1")]),
        "enforcement sees the claim as soon as the kubelet hears back"
    );

    // Asked again (a kubelet retry): the same answer.
    let again = prepare(&paths.dra, vec![claim("u1", "c1")]).await;
    assert_eq!(again.claims["u1"], r.claims["u1"]);
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
    for (result, n) in [("refused", 1), ("prepared", 1), ("already", 1)] {
        assert!(
            text.contains(&format!(
                "teeguard_agent_dra_prepare_total{{result=\"{result}\"}} {n}\n"
            )),
            "each claim counted once, by its result: {text}"
        );
    }

    // Another claim allocated the same device, a claim that no longer exists, and a key the kernel
    // no longer has: each refused with its reason, the first one unaffected.
    api.create(&claim_object("u2", "c2", "tdx-0", "pod-2"))
        .expect("claim");
    api.create(&claim_object("u3", "c3", "tdx-1", "pod-3"))
        .expect("claim");
    let r = prepare(
        &paths.dra,
        vec![claim("u2", "c2"), claim("u9", "gone"), claim("u3", "c3")],
    )
    .await;
    assert!(r.claims["u2"].error.contains("already prepared"), "{r:?}");
    assert!(r.claims["u9"].error.contains("no longer exists"), "{r:?}");
    assert_eq!(r.claims["u3"].error, "", "tdx-1 is free: {r:?}");
    let r = prepare(&paths.dra, vec![claim("u3", "c3")]).await;
    assert_eq!(r.claims["u3"].error, "");
    dra.observe(&tdx(2, 1), &BTreeMap::new());
    api.create(&claim_object("u4", "c4", "tdx-1", "pod-4"))
        .expect("claim");
    let unprepared = unprepare(&paths.dra, vec![claim("u3", "c3")]).await;
    assert_eq!(unprepared.claims["u3"].error, "");
    assert!(claims.borrow().holds_for("pod-1"));
    assert!(
        !claims.borrow().holds_for("pod-3"),
        "an unprepared claim is gone from enforcement's view"
    );
    let r = prepare(&paths.dra, vec![claim("u4", "c4")]).await;
    assert!(
        r.claims["u4"].error.contains("no free tdx key"),
        "a VM outside Kubernetes took the other key: {r:?}"
    );

    // Unprepare: unknown claims and repeats are fine.
    let r = unprepare(&paths.dra, vec![claim("u9", "gone"), claim("u3", "c3")]).await;
    assert_eq!(r.claims["u9"].error, "");
    assert_eq!(r.claims["u3"].error, "");

    // Restart: the checkpoint still holds c1; asked again it answers without reading the claim.
    shutdown.cancel();
    drop(dra);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let shutdown = CancellationToken::new();
    let dra = start(&api, dir.path(), &shutdown, &metrics);
    assert_eq!(
        dra.allocated(),
        BTreeMap::from([(TeeKind::Tdx, [0u32].into())]),
        "the checkpoint's claims after a restart"
    );
    assert_eq!(
        **dra.claims().borrow(),
        ClaimedKeys::from_prepared(&[prepared("c1", "tdx-0", "pod-1")]),
        "enforcement knows the checkpoint's claims from the start"
    );
    api.delete("resourceclaims", Some("vms"), "c1")
        .expect("delete claim");
    let r = prepare(&paths.dra, vec![claim("u1", "c1")]).await;
    assert_eq!(r.claims["u1"].error, "", "{r:?}");
    assert_eq!(r.claims["u1"].devices.len(), 1);
    let r = unprepare(&paths.dra, vec![claim("u1", "c1")]).await;
    assert_eq!(r.claims["u1"].error, "", "a deleted claim unprepares");
    assert!(dra.allocated().is_empty());
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switched_back_the_driver_drains_unprepares_what_it_prepared_prepares_nothing_new_then_stops()
 {
    let api = FakeApiServer::new();
    let dir = tempfile::tempdir().expect("dir");
    let paths = PluginPaths::under(dir.path());
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Metrics::new(&mut registry);
    let options = || DraOptions {
        node_name: NODE.into(),
        kubelet_dir: dir.path().to_path_buf(),
        api_timeout: Duration::from_secs(5),
    };
    let shutdown = CancellationToken::new();
    // Never in DRA mode here: nothing to drain, nothing served.
    assert!(
        Dra::start_draining(api.client(), options(), metrics.clone(), shutdown.clone()).is_none()
    );
    assert!(!paths.registration.exists());

    // DRA mode prepares a claim; the node is switched back.
    let dra = start(&api, dir.path(), &shutdown, &metrics);
    dra.observe(&tdx(2, 0), &BTreeMap::new());
    for (uid, name, device, pod) in [
        ("u1", "c1", "tdx-0", "pod-1"),
        ("u2", "c2", "tdx-1", "pod-2"),
    ] {
        api.create(&claim_object(uid, name, device, pod))
            .expect("claim");
    }
    let r = prepare(&paths.dra, vec![claim("u1", "c1")]).await;
    assert_eq!(r.claims["u1"].error, "");
    shutdown.cancel();
    drop(dra);
    tokio::time::sleep(Duration::from_millis(200)).await;

    let shutdown = CancellationToken::new();
    let draining = Dra::start_draining(api.client(), options(), metrics.clone(), shutdown.clone())
        .expect("claims left: draining");
    draining.observe(&tdx(2, 0), &BTreeMap::new());
    let r = prepare(&paths.dra, vec![claim("u2", "c2"), claim("u1", "c1")]).await;
    assert!(
        r.claims["u2"]
            .error
            .contains("extended-resource accounting"),
        "nothing new is prepared: {r:?}"
    );
    assert_eq!(
        r.claims["u1"].error, "",
        "a claim prepared before is answered"
    );
    assert!(!draining.is_empty());
    let r = unprepare(&paths.dra, vec![claim("u1", "c1")]).await;
    assert_eq!(r.claims["u1"].error, "");
    assert!(draining.is_empty());
    draining.stop();
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !paths.registration.exists() && !paths.dra.exists(),
        "stopped: the sockets are gone, so the kubelet drops the plugin"
    );
    assert!(
        Dra::start_draining(api.client(), options(), metrics, shutdown).is_none(),
        "nothing left to drain"
    );
}
