//! The agent's DRA driver through the kubelet's real protocol (gRPC over its unix sockets, called with a
//! tonic client as the kubelet calls it), with claims from the test kit's API server: registration
//! info, preparing (the re-check, idempotence, a device another claim holds, a deleted claim),
//! unpreparing (idempotent, unknown claims), and the checkpoint across a restart.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::kubelet::call;
use serde_json::json;
use teeguard_agent::decide::attribution::KindFigures;
use teeguard_agent::decide::claimed::ClaimedKeys;
use teeguard_agent::decide::dra::{AllocatedDevice, PreparedClaim};
use teeguard_agent::dra::{Dra, DraOptions};
use teeguard_agent::kubelet::PluginPaths;
use teeguard_agent::kubelet::proto::*;
use teeguard_agent::metrics::Metrics;
use teeguard_shared::TeeKind;
use teeguard_tests::dra::{PREPARE, UNPREPARE};
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

/// A FIFO at `path` opened read-write and filled until the kernel refuses more: whoever opens it
/// next to write blocks in `write` until the FIFO is read, as a write to a hung disk blocks.
struct HungDisk {
    path: PathBuf,
    fifo: std::fs::File,
}

impl HungDisk {
    fn at(path: &Path) -> HungDisk {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let made = std::process::Command::new("mkfifo")
            .arg(path)
            .status()
            .expect("run mkfifo");
        assert!(made.success(), "mkfifo {path:?}");
        let mut fifo = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .expect("open the FIFO");
        let chunk = [b'x'; 4096];
        // Full when the kernel answers EAGAIN (WouldBlock).
        while fifo.write(&chunk).is_ok() {}
        HungDisk {
            path: path.to_path_buf(),
            fifo,
        }
    }

    /// How many open files of this process are the FIFO (1: only ours).
    fn openers(&self) -> usize {
        std::fs::read_dir("/proc/self/fd")
            .expect("/proc/self/fd")
            .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
            .filter(|target| *target == self.path)
            .count()
    }

    /// Read whatever is written (returns at once when nothing is there).
    fn drain(&mut self) {
        use std::io::Read;
        let mut buf = [0u8; 65536];
        while matches!(self.fifo.read(&mut buf), Ok(n) if n > 0) {}
    }
}

/// The agent runs on one thread (main.rs: a current-thread runtime), so a checkpoint write stuck on
/// the disk must stay off it: while one prepare's write hangs, the registration, a repeated prepare, an
/// unprepare and a prepare of the held device are answered; a prepare that needs its own write waits
/// for it; the hung write's claim is refused (the kubelet retries) and nothing else is lost.
#[tokio::test(flavor = "current_thread")]
async fn a_checkpoint_write_hung_on_the_disk_stalls_no_other_call() {
    let api = FakeApiServer::new();
    for (uid, name, device, pod) in [
        ("u1", "c1", "tdx-0", "pod-1"),
        ("u2", "c2", "tdx-1", "pod-2"),
        ("u3", "c3", "tdx-1", "pod-3"),
        ("u4", "c4", "tdx-2", "pod-4"),
    ] {
        api.create(&claim_object(uid, name, device, pod))
            .expect("claim");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let paths = PluginPaths::under(dir.path());
    // The driver on a thread and runtime of its own, as in the agent: when that thread is stuck, the
    // calls below time out instead of hanging the test.
    let stop = CancellationToken::new();
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let driver = std::thread::spawn({
        let (api, dir, stop) = (api.clone(), dir.path().to_path_buf(), stop.clone());
        move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async {
                let mut registry = prometheus_client::registry::Registry::default();
                let dra = start(&api, &dir, &stop, &Metrics::new(&mut registry));
                dra.observe(&tdx(4, 0), &BTreeMap::new());
                ready_tx.send(()).expect("test waits");
                stop.cancelled().await;
            })
        }
    });
    ready_rx.await.expect("the driver started");
    // Answered in milliseconds when nothing stalls; 20 s is slack for a loaded machine, and only a
    // stuck driver thread runs into it.
    async fn answered<T>(what: &str, call: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(20), call)
            .await
            .unwrap_or_else(|_| panic!("{what}: no answer in 20 s while a checkpoint write hangs"))
    }

    let r = answered("prepare c1", prepare(&paths.dra, vec![claim("u1", "c1")])).await;
    assert_eq!(r.claims["u1"].error, "");

    let mut disk = HungDisk::at(&paths.checkpoint.with_extension("json.tmp"));
    let hung = tokio::spawn({
        let socket = paths.dra.clone();
        async move { prepare(&socket, vec![claim("u2", "c2")]).await }
    });
    // The driver opened the checkpoint's temporary file: its write is under way, and stuck.
    while disk.openers() < 2 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let info: PluginInfo = answered(
        "GetInfo",
        call(
            &paths.registration,
            "/pluginregistration.Registration/GetInfo",
            InfoRequest {},
        ),
    )
    .await;
    assert_eq!(info.name, "tee.teeguard.dev");
    let r = answered(
        "prepare c1 again",
        prepare(&paths.dra, vec![claim("u1", "c1")]),
    )
    .await;
    assert_eq!(r.claims["u1"].error, "", "on disk already: answered");
    let r = answered(
        "unprepare",
        unprepare(&paths.dra, vec![claim("u9", "gone")]),
    )
    .await;
    assert_eq!(r.claims["u9"].error, "");
    let r = answered("prepare c3", prepare(&paths.dra, vec![claim("u3", "c3")])).await;
    assert!(
        r.claims["u3"].error.contains("already prepared"),
        "c2, still being written, holds tdx-1: {r:?}"
    );
    let queued = tokio::spawn({
        let socket = paths.dra.clone();
        async move { prepare(&socket, vec![claim("u4", "c4")]).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !queued.is_finished() && !hung.is_finished(),
        "a prepare is answered only once its claim is on disk"
    );

    // The disk comes back, the hung write fails (a FIFO cannot be synced): c2 is refused and
    // forgotten, c4 written, c2's retry prepared.
    std::fs::remove_file(&disk.path).expect("unlink the FIFO");
    while !hung.is_finished() {
        disk.drain();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let r = hung.await.expect("c2 answered");
    assert!(
        r.claims["u2"].error.contains("checkpoint"),
        "the write that failed refuses its claim: {r:?}"
    );
    let r = answered("prepare c4", queued).await.expect("c4 answered");
    assert_eq!(r.claims["u4"].error, "");
    let r = answered(
        "prepare c2 again",
        prepare(&paths.dra, vec![claim("u2", "c2")]),
    )
    .await;
    assert_eq!(r.claims["u2"].error, "", "the kubelet's retry: {r:?}");
    let saved = teeguard_agent::kubelet::checkpoint::Checkpoint::new(&paths.checkpoint)
        .load()
        .expect("the checkpoint");
    assert_eq!(
        saved.keys().map(String::as_str).collect::<Vec<_>>(),
        ["u1", "u2", "u4"]
    );
    stop.cancel();
    driver.join().expect("the driver's thread");
}

/// The kubelet calls a DRA driver with the socket's path percent-encoded as `:authority`, which upstream
/// h2 resets (hyperium/http#861, hyperium/h2#487; `tests/tests/node_dra.rs` says which calls): the
/// workspace patches h2 with `vendor/h2`. A patch cargo does not apply is only listed as
/// `[[patch.unused]]` and builds silently with the upstream crate, so Cargo.lock must resolve the one
/// h2 it holds from that path (a path package has no `source`) and list no unused h2 patch.
#[test]
fn cargo_lock_resolves_h2_from_the_vendored_patch_only() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../Cargo.lock");
    let lock = std::fs::read_to_string(path).expect("read Cargo.lock");
    let mut blocks = lock.split("\n[[").map(|b| b.trim());
    let h2: Vec<(&str, &str)> = blocks
        .by_ref()
        .filter_map(|b| {
            let (kind, body) = b.split_once("]]")?;
            body.lines()
                .any(|l| l.trim() == "name = \"h2\"")
                .then_some((kind, body))
        })
        .collect();
    let packages: Vec<&str> = h2
        .iter()
        .filter(|(kind, _)| *kind == "package")
        .map(|(_, body)| *body)
        .collect();
    assert_eq!(packages.len(), 1, "one h2 in Cargo.lock: {packages:?}");
    assert!(
        !packages[0].contains("source = "),
        "Cargo.lock takes h2 from a registry, not vendor/h2: {}",
        packages[0]
    );
    let unused: Vec<&str> = h2
        .iter()
        .filter(|(kind, _)| kind.starts_with("patch.unused"))
        .map(|(_, body)| *body)
        .collect();
    assert!(unused.is_empty(), "the h2 patch is unused: {unused:?}");
    let vendored = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../vendor/h2/src/server.rs"
    ))
    .expect("read vendor/h2/src/server.rs");
    assert!(
        vendored.contains("teeguard patch"),
        "vendor/h2 lacks the teeguard patch"
    );
}
