//! Tests of [`NriRuntime`] against a minimal in-test plugin written with this module's codec and
//! framing (no agent involved).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use super::runtime::{NRI_VERSION, NriRuntime, RUNTIME_NAME, event_bit, misc_max};
use super::ttrpc::{
    CODE_UNIMPLEMENTED, Demux, MESSAGE_TYPE_REQUEST, MESSAGE_TYPE_RESPONSE, PLUGIN_SERVICE_CONN,
    RUNTIME_SERVICE, RUNTIME_SERVICE_CONN, Request, Response, Status, encode_frames,
    encode_message, read_frame,
};
use crate::Error;
use crate::proto::Schema;

const CREATE_CONTAINER: i32 = 4;
const START_CONTAINER: i32 = 6;
const WAIT: Duration = Duration::from_secs(5);

/// How the in-test plugin behaves.
#[derive(Clone, Debug)]
struct Behaviour {
    name: &'static str,
    idx: &'static str,
    events: i32,
    adjust: Value,
    /// Never answer CreateContainer.
    hang_on_create: bool,
    /// Answer CreateContainer with this failed status.
    fail_create: Option<(i32, &'static str)>,
    /// Runtime-service calls made right after registering, all in one frame.
    runtime_calls: Vec<(&'static str, Value)>,
}

impl Behaviour {
    fn new(events: i32) -> Self {
        Behaviour {
            name: "teeguard",
            idx: "50",
            events,
            adjust: json!({"linux": {"resources": {"unified": {"misc.max": "sev 1"}}}}),
            hang_on_create: false,
            fail_create: None,
            runtime_calls: Vec::new(),
        }
    }
}

/// What the in-test plugin saw.
#[derive(Debug, Default)]
struct Seen {
    /// `(method, decoded request)` of every Plugin call.
    calls: Vec<(String, Value)>,
    /// Statuses of its Runtime-service calls, by stream id order.
    statuses: Vec<Status>,
}

impl Seen {
    fn methods(&self) -> Vec<&str> {
        self.calls.iter().map(|(m, _)| m.as_str()).collect()
    }

    fn request(&self, method: &str) -> Value {
        self.calls
            .iter()
            .find(|(m, _)| m == method)
            .map(|(_, v)| v.clone())
            .unwrap_or_else(|| panic!("the plugin got no {method}"))
    }
}

fn schema() -> Arc<Schema> {
    Arc::new(Schema::nri().expect("the upstream NRI api.proto compiles"))
}

async fn connect(socket: &Path) -> UnixStream {
    let deadline = Instant::now() + WAIT;
    loop {
        match UnixStream::connect(socket).await {
            Ok(stream) => return stream,
            Err(e) if Instant::now() > deadline => {
                panic!("connecting to {}: {e}", socket.display())
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Runs a plugin until the runtime closes the connection.
async fn run_plugin(socket: PathBuf, b: Behaviour, seen: Arc<Mutex<Seen>>) {
    let schema = schema();
    let stream = connect(&socket).await;
    let (mut rd, mut wr) = stream.into_split();
    let register = schema
        .encode(
            "RegisterPluginRequest",
            &json!({"plugin_name": b.name, "plugin_idx": b.idx, "NRI_version": "v0.10.0"}),
        )
        .expect("encodes");
    let request = |stream_id, method: &str, payload| {
        let req = Request {
            service: RUNTIME_SERVICE.into(),
            method: method.into(),
            payload,
            ..Request::default()
        };
        encode_message(stream_id, MESSAGE_TYPE_REQUEST, &req.encode())
    };
    // The registration is cut into three frames at arbitrary points: the runtime must reassemble.
    let msg = request(1, "RegisterPlugin", register);
    let mut bytes = encode_frames(RUNTIME_SERVICE_CONN, &msg[..3]);
    bytes.extend(encode_frames(RUNTIME_SERVICE_CONN, &msg[3..13]));
    bytes.extend(encode_frames(RUNTIME_SERVICE_CONN, &msg[13..]));
    wr.write_all(&bytes).await.expect("writes");
    let mut demux = Demux::default();
    let mut registered = false;
    while let Ok(Some((cid, payload))) = read_frame(&mut rd).await {
        demux.push(cid, &payload);
        while let Some(msg) = demux.next_message(cid).expect("well-formed ttrpc") {
            if cid == RUNTIME_SERVICE_CONN && msg.kind == MESSAGE_TYPE_RESPONSE {
                let rsp = Response::decode(&msg.payload).expect("a response");
                seen.lock().expect("lock").statuses.push(rsp.status());
                if !registered {
                    registered = true;
                    // Several requests sharing one frame.
                    let mut all = Vec::new();
                    for (i, (method, body)) in b.runtime_calls.iter().enumerate() {
                        let input = format!("{method}Request");
                        let payload = schema.encode(&input, body).unwrap_or_default();
                        all.extend(request(3 + 2 * i as u32, method, payload));
                    }
                    if !all.is_empty() {
                        wr.write_all(&encode_frames(RUNTIME_SERVICE_CONN, &all))
                            .await
                            .expect("writes");
                    }
                }
                continue;
            }
            assert_eq!((cid, msg.kind), (PLUGIN_SERVICE_CONN, MESSAGE_TYPE_REQUEST));
            let req = Request::decode(&msg.payload).expect("a request");
            let rpc = schema
                .methods("Plugin")
                .expect("service Plugin")
                .into_iter()
                .find(|(name, _, _)| *name == req.method);
            let body = rpc
                .as_ref()
                .map(|(_, input, _)| schema.decode(input, &req.payload).expect("decodes"));
            seen.lock()
                .expect("lock")
                .calls
                .push((req.method.clone(), body.clone().unwrap_or(Value::Null)));
            let rsp = match (req.method.as_str(), rpc) {
                ("Configure", _) => Response::ok(
                    schema
                        .encode("ConfigureResponse", &json!({"events": b.events}))
                        .expect("encodes"),
                ),
                ("CreateContainer", _) if b.hang_on_create => continue,
                ("CreateContainer", _) if b.fail_create.is_some() => {
                    let (code, message) = b.fail_create.unwrap_or_default();
                    Response::error(code, message)
                }
                ("CreateContainer", _) => Response::ok(
                    schema
                        .encode("CreateContainerResponse", &json!({"adjust": b.adjust}))
                        .expect("encodes"),
                ),
                (_, Some((_, _, output))) => {
                    Response::ok(schema.encode(&output, &json!({})).expect("encodes"))
                }
                (other, None) => Response::error(CODE_UNIMPLEMENTED, format!("method {other}")),
            };
            let out = encode_message(msg.stream_id, MESSAGE_TYPE_RESPONSE, &rsp.encode());
            if wr
                .write_all(&encode_frames(PLUGIN_SERVICE_CONN, &out))
                .await
                .is_err()
            {
                return;
            }
        }
    }
}

fn spawn_plugin(socket: &Path, b: Behaviour) -> (tokio::task::JoinHandle<()>, Arc<Mutex<Seen>>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let task = tokio::spawn(run_plugin(socket.to_path_buf(), b, seen.clone()));
    (task, seen)
}

/// A plugin that subscribes to `CreateContainer` and never answers it, once registered with `rt`.
async fn hung_plugin(rt: &NriRuntime, socket: &Path) -> tokio::task::JoinHandle<()> {
    let mut b = Behaviour::new(event_bit(CREATE_CONTAINER));
    b.hang_on_create = true;
    let (task, _) = spawn_plugin(socket, b);
    rt.wait_registered(WAIT).await.expect("registers");
    task
}

fn pod(name: &str) -> Value {
    json!({
        "id": format!("sandbox-{name}"), "name": name, "uid": format!("uid-{name}"), "namespace": "default",
        "labels": {"app": name}, "annotations": {"teeguard.dev/tee": "sev"},
        "linux": {"cgroup_parent": format!("/kubepods/pod{name}")},
    })
}

fn container(name: &str) -> Value {
    json!({"id": format!("ctr-{name}"), "pod_sandbox_id": format!("sandbox-{name}"), "name": name, "state": 1})
}

async fn runtime() -> (tempfile::TempDir, PathBuf, NriRuntime) {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let socket = dir.path().join("run/nri/nri.sock");
    let rt = NriRuntime::start(&socket)
        .await
        .expect("the fake runtime starts");
    (dir, socket, rt)
}

#[tokio::test]
async fn registers_configures_synchronizes_and_relays_create_container() {
    let (_dir, socket, rt) = runtime().await;
    rt.set_existing(vec![pod("old")], vec![container("old")]);
    let mut b = Behaviour::new(event_bit(CREATE_CONTAINER) | event_bit(START_CONTAINER));
    b.runtime_calls = vec![
        (
            "UpdateContainers",
            json!({"update": [{"container_id": "ctr-old", "ignore_failure": true}]}),
        ),
        ("Bogus", json!(null)),
    ];
    let (_task, seen) = spawn_plugin(&socket, b);
    let reg = rt
        .wait_registered(WAIT)
        .await
        .expect("the plugin registers");
    assert_eq!(
        (reg.plugin_name.as_str(), reg.plugin_idx.as_str()),
        ("teeguard", "50")
    );
    assert_eq!(reg.nri_version, "v0.10.0");
    assert_eq!((reg.events, reg.count), (0b10_1000, 1));
    assert!(reg.subscribes(CREATE_CONTAINER) && !reg.subscribes(5));
    assert_eq!(reg.synchronize, json!({}));
    {
        let seen = seen.lock().expect("lock");
        assert_eq!(seen.methods(), ["Configure", "Synchronize"]);
        assert_eq!(
            seen.request("Configure"),
            json!({"runtime_name": RUNTIME_NAME, "runtime_version": "0", "registration_timeout": 5000,
                   "request_timeout": 2000, "NRI_version": NRI_VERSION})
        );
        assert_eq!(
            seen.request("Synchronize"),
            json!({"pods": [pod("old")], "containers": [container("old")]})
        );
    }
    let rsp = rt
        .create_container(pod("new"), container("new"))
        .await
        .expect("CreateContainer is answered");
    assert_eq!(misc_max(&rsp), Some("sev 1"));
    assert_eq!(
        seen.lock().expect("lock").request("CreateContainer"),
        json!({"pod": pod("new"), "container": container("new")})
    );
    assert_eq!(
        rt.call("Shutdown", "Empty", "Empty", json!({}))
            .await
            .expect("Shutdown"),
        json!({})
    );
    let err = rt
        .call("Nope", "Empty", "Empty", json!({}))
        .await
        .expect_err("unknown method");
    assert!(
        matches!(
            err,
            Error::Status {
                code: CODE_UNIMPLEMENTED,
                ..
            }
        ),
        "{err}"
    );
    // The plugin's own calls on the Runtime service: registration, UpdateContainers, an unknown method.
    let codes: Vec<i32> = seen
        .lock()
        .expect("lock")
        .statuses
        .iter()
        .map(|s| s.code)
        .collect();
    assert_eq!(codes, [0, 0, CODE_UNIMPLEMENTED]);
    assert_eq!(
        rt.container_updates(),
        [json!({"update": [{"container_id": "ctr-old", "ignore_failure": true}]})]
    );
    rt.shutdown().await;
    assert!(!socket.exists(), "shutdown removes the socket");
}

#[tokio::test]
async fn a_plugin_not_subscribed_to_create_container_is_not_called() {
    let (_dir, socket, rt) = runtime().await;
    let (_task, seen) = spawn_plugin(&socket, Behaviour::new(event_bit(START_CONTAINER)));
    rt.wait_registered(WAIT)
        .await
        .expect("the plugin registers");
    let rsp = rt
        .create_container(pod("p"), container("c"))
        .await
        .expect("no call, no error");
    assert_eq!((rsp.clone(), misc_max(&rsp)), (json!({}), None));
    assert!(
        !seen
            .lock()
            .expect("lock")
            .methods()
            .contains(&"CreateContainer")
    );
}

#[tokio::test]
async fn restart_makes_the_plugin_register_again() {
    let (_dir, socket, rt) = runtime().await;
    // Events 0 subscribes to everything, as in containerd.
    let (first, _) = spawn_plugin(&socket, Behaviour::new(0));
    let one = rt.wait_registered(WAIT).await.expect("first registration");
    assert_eq!(one.count, 1);
    assert!(one.subscribes(CREATE_CONTAINER));
    rt.restart().await.expect("restarts");
    assert_eq!(rt.registration(), None);
    assert!(matches!(
        rt.create_container(pod("p"), container("c")).await,
        Err(Error::NotRegistered { .. })
    ));
    tokio::time::timeout(WAIT, first)
        .await
        .expect("the first plugin sees its connection closed")
        .expect("the plugin task does not panic");
    let (_second, seen) = spawn_plugin(&socket, Behaviour::new(event_bit(CREATE_CONTAINER)));
    let two = rt.wait_registered(WAIT).await.expect("registers again");
    assert_eq!(two.count, 2);
    assert!(two.registered_at > one.registered_at);
    let rsp = rt
        .create_container(pod("p"), container("c"))
        .await
        .expect("answered");
    assert_eq!(misc_max(&rsp), Some("sev 1"));
    assert_eq!(
        seen.lock().expect("lock").methods(),
        ["Configure", "Synchronize", "CreateContainer"]
    );
}

/// Sends `bytes` on a new connection and expects the runtime to close it.
async fn expect_closed(socket: &Path, bytes: &[u8]) {
    let mut stream = connect(socket).await;
    stream.write_all(bytes).await.expect("writes");
    // Half-close: a runtime waiting for the rest of a frame sees the end of the stream.
    stream.shutdown().await.expect("shuts down writing");
    let mut buf = [0u8; 4096];
    let closed = tokio::time::timeout(WAIT, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the runtime closes a connection sending {bytes:02x?}"
    );
}

#[tokio::test]
async fn garbage_from_a_plugin_closes_its_connection_only() {
    let (_dir, socket, rt) = runtime().await;
    // A frame announcing more than 10 + 4 MiB.
    expect_closed(&socket, &[0, 0, 0, 2, 0xff, 0xff, 0xff, 0xff, 1, 2, 3]).await;
    // A ttrpc message announcing more than 4 MiB.
    let huge = [0x7f, 0, 0, 0, 0, 0, 0, 1, MESSAGE_TYPE_REQUEST, 0];
    expect_closed(&socket, &encode_frames(RUNTIME_SERVICE_CONN, &huge)).await;
    // A request whose envelope is not protobuf.
    let bad = encode_message(1, MESSAGE_TYPE_REQUEST, &[0xff, 0xff, 0xff]);
    expect_closed(&socket, &encode_frames(RUNTIME_SERVICE_CONN, &bad)).await;
    // A connection that ends inside a frame.
    expect_closed(&socket, &[0, 0, 0, 2, 0, 0, 0, 50, 1]).await;
    // An invalid plugin index is refused (status 2) and the plugin closed.
    let mut b = Behaviour::new(0);
    b.idx = "5";
    let (task, seen) = spawn_plugin(&socket, b);
    tokio::time::timeout(WAIT, task)
        .await
        .expect("closed")
        .expect("no panic");
    assert_eq!(
        seen.lock().expect("lock").statuses.first().map(|s| s.code),
        Some(2)
    );
    assert_eq!(rt.registration(), None);
    // The runtime still works for the next plugin.
    let (_task, _) = spawn_plugin(&socket, Behaviour::new(event_bit(CREATE_CONTAINER)));
    let reg = rt
        .wait_registered(WAIT)
        .await
        .expect("a good plugin registers");
    assert_eq!(reg.count, 1);
    let rsp = rt
        .create_container(pod("p"), container("c"))
        .await
        .expect("answered");
    assert_eq!(misc_max(&rsp), Some("sev 1"));
}

#[tokio::test]
async fn a_plugin_that_never_answers_times_out_after_the_request_timeout() {
    let (_dir, socket, rt) = runtime().await;
    let task = hung_plugin(&rt, &socket).await;
    let started = Instant::now();
    let err = rt
        .create_container(pod("p"), container("c"))
        .await
        .expect_err("no answer");
    let took = started.elapsed();
    assert!(matches!(err, Error::RequestTimeout { .. }), "{err}");
    assert!(err.to_string().contains("CreateContainer"), "{err}");
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(3),
        "{took:?}"
    );
    // As containerd does, the runtime closes a plugin that timed out.
    assert_eq!(rt.registration(), None);
    tokio::time::timeout(WAIT, task)
        .await
        .expect("closed")
        .expect("no panic");
}

// As the real containerd and CRI-O do (real-node scenario 4, agent stopped): a plugin that does not
// answer delays the container by the request timeout once, then the container is created without
// adjustment, and so is the next one, until a plugin registers again.
#[tokio::test]
async fn as_the_runtime_a_hung_or_missing_plugin_leaves_containers_unadjusted() {
    let (_dir, socket, rt) = runtime().await;
    let _task = hung_plugin(&rt, &socket).await;
    let started = Instant::now();
    let first = rt
        .create_container_as_runtime(pod("p"), container("c"))
        .await
        .expect("created");
    assert_eq!(first, json!({}));
    assert!(
        started.elapsed() >= Duration::from_millis(1900),
        "{:?}",
        started.elapsed()
    );
    let started = Instant::now();
    let next = rt
        .create_container_as_runtime(pod("p"), container("d"))
        .await
        .expect("created");
    assert_eq!(next, json!({}));
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "no plugin left to wait for"
    );
}

#[tokio::test]
async fn failed_status_and_missing_plugin_are_reported() {
    let (_dir, socket, rt) = runtime().await;
    let err = rt
        .wait_registered(Duration::from_millis(100))
        .await
        .expect_err("nobody connects");
    assert_eq!(
        err.to_string(),
        format!(
            "timed out waiting for the plugin to register on {}",
            socket.display()
        )
    );
    let mut b = Behaviour::new(event_bit(CREATE_CONTAINER));
    b.fail_create = Some((9, "no TEE keys left"));
    let (_task, _) = spawn_plugin(&socket, b);
    rt.wait_registered(WAIT).await.expect("registers");
    let err = rt
        .create_container(pod("p"), container("c"))
        .await
        .expect_err("refused");
    assert_eq!(
        err.to_string(),
        "plugin answered CreateContainer with ttrpc status 9: no TEE keys left"
    );
    assert!(
        rt.registration().is_some(),
        "a refusal does not close the plugin"
    );
}
