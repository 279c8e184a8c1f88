//! A stand-in for virt-api's VMI mutating webhook: every VMI CREATE the API server admits goes through
//! `kvtool default-vmi`, which runs virt-api's own `ApplyNewVMIMutations`, adds its finalizer and runs
//! its create validation (KubeVirt v1.9.0's code, built into `kvtool`). The webhook answers with a JSON
//! Patch that makes the stored VMI what kvtool printed (spec, labels, annotations, finalizers), or
//! refuses the VMI with kvtool's causes, as virt-api would.
//!
//! kvtool is a process, and each run spends about 4 s of CPU on KubeVirt's package initialisation (virt-api,
//! a server, pays it once): the stand-in remembers its answer per VMI shape (`State::defaulted`).
//!
//! It serves HTTPS on 127.0.0.1 from its own thread (it outlives every test's runtime), is registered
//! as the MutatingWebhookConfiguration `teeguard-tests-virt-api` for `kubevirt.io/v1`
//! `virtualmachineinstances` CREATE, and logs one line per review to `log/virt-api.log`.

use std::collections::HashMap;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine as _;
use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Api, Client};
use serde_json::{Value, json};
use teeguard_certs::{CertificateAuthority, ServingCertRequest};

use super::KIT;
use crate::controlplane::unique_name;
use crate::realcluster::create_or_keep;
use crate::{Error, Result};

/// The webhook's path.
const PATH: &str = "/virtualmachineinstances-mutate";
/// The MutatingWebhookConfiguration's name.
const CONFIGURATION: &str = "teeguard-tests-virt-api";

/// The running stand-in.
#[derive(Debug)]
pub struct VirtApi {
    addr: SocketAddr,
    ca_bundle: String,
    counts: Arc<Counts>,
}

/// What the stand-in did so far.
#[derive(Debug, Default)]
struct Counts {
    defaulted: AtomicU64,
    refused: AtomicU64,
}

/// The shared state of the server.
#[derive(Debug)]
struct State {
    kvtool: PathBuf,
    cr_file: PathBuf,
    log: Mutex<std::fs::File>,
    counts: Arc<Counts>,
    /// kvtool's answers by VMI shape ([`State::defaulted`]).
    remembered: Mutex<HashMap<String, Value>>,
}

impl VirtApi {
    /// Serve on a free 127.0.0.1 port, with a certificate of a CA of its own.
    pub(super) fn start(kvtool: &Path, cr_file: &Path, log_dir: &Path) -> Result<VirtApi> {
        let ca = CertificateAuthority::generate("teeguard-test-virt-api", 7)?;
        let cert = ca.issue(&ServingCertRequest::localhost())?;
        let tls = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .and_then(|b| {
            b.with_no_client_auth()
                .with_single_cert(vec![cert.cert_der()], cert.key_der())
        })
        .map_err(|e| Error::Failed {
            what: "the virt-api stand-in's TLS configuration".into(),
            reason: e.to_string(),
        })?;
        let listener = std::net::TcpListener::bind("127.0.0.1:0")
            .map_err(KIT.io("bind the virt-api stand-in"))?;
        listener
            .set_nonblocking(true)
            .map_err(KIT.io("configure the virt-api stand-in's socket"))?;
        let addr = listener
            .local_addr()
            .map_err(KIT.io("read the virt-api stand-in's address"))?;
        let log = std::fs::File::create(log_dir.join("virt-api.log"))
            .map_err(KIT.io("create log/virt-api.log"))?;
        let counts = Arc::new(Counts::default());
        let state = Arc::new(State {
            kvtool: kvtool.to_path_buf(),
            cr_file: cr_file.to_path_buf(),
            log: Mutex::new(log),
            counts: counts.clone(),
            remembered: Mutex::new(HashMap::new()),
        });
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
        std::thread::Builder::new()
            .name("virt-api-stand-in".into())
            .spawn(move || serve(listener, acceptor, state))
            .map_err(KIT.io("start the virt-api stand-in's thread"))?;
        Ok(VirtApi {
            addr,
            ca_bundle: ca.ca_bundle_base64(),
            counts,
        })
    }

    /// VMIs defaulted so far.
    pub fn defaulted(&self) -> u64 {
        self.counts.defaulted.load(Ordering::Relaxed)
    }

    /// VMIs refused so far (kvtool's validation failed).
    pub fn refused(&self) -> u64 {
        self.counts.refused.load(Ordering::Relaxed)
    }

    /// Register the webhook and wait until the API server calls it: a dry-run CREATE of a bare VMI
    /// comes back with virt-api's finalizer.
    pub(super) async fn register(&self, client: &Client) -> Result<()> {
        let config = json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": CONFIGURATION},
            "webhooks": [{
                // virt-api's own webhook name.
                "name": "virtualmachineinstances-mutator.kubevirt.io",
                "clientConfig": {"url": format!("https://{}{PATH}", self.addr), "caBundle": self.ca_bundle},
                "rules": [{"apiGroups": ["kubevirt.io"], "apiVersions": ["v1"],
                    "operations": ["CREATE"], "resources": ["virtualmachineinstances"]}],
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                // virt-api answers in milliseconds; a new shape costs this stand-in one kvtool run
                // (~4 s of CPU), past 10 s on a busy 2-core machine (6 KubeVirt tests failed so):
                // the longest timeout the API allows.
                "timeoutSeconds": 30
            }]
        });
        let ar = ApiResource {
            group: "admissionregistration.k8s.io".into(),
            version: "v1".into(),
            api_version: "admissionregistration.k8s.io/v1".into(),
            kind: "MutatingWebhookConfiguration".into(),
            plural: "mutatingwebhookconfigurations".into(),
        };
        let configs: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
        let obj: DynamicObject = serde_json::from_value(config).map_err(|e| Error::Failed {
            what: "the virt-api stand-in's configuration".into(),
            reason: e.to_string(),
        })?;
        create_or_keep(&configs, &obj)
            .await
            .map_err(super::api("register the virt-api stand-in"))?;

        let ns = unique_name("virt-api-probe");
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}}))
            .map_err(|e| Error::Failed {
                what: "a probe namespace".into(),
                reason: e.to_string(),
            })?;
        namespaces
            .create(&PostParams::default(), &namespace)
            .await
            .map_err(super::api("create the virt-api probe's namespace"))?;
        let vmis = vmi_api(client, &ns);
        let probe: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "probe"},
            "spec": {"domain": {"devices": {}, "memory": {"guest": "64Mi"}}}
        }))
        .map_err(|e| Error::Failed {
            what: "the probe VMI".into(),
            reason: e.to_string(),
        })?;
        let dry = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        let mut last = String::new();
        for _ in 0..600 {
            match vmis.create(&dry, &probe).await {
                Ok(v)
                    if v.metadata
                        .finalizers
                        .as_ref()
                        .is_some_and(|f| !f.is_empty()) =>
                {
                    return Ok(());
                }
                Ok(_) => last = "stored without virt-api's finalizer".into(),
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(Error::Failed {
            what: "wait for the API server to call the virt-api stand-in".into(),
            reason: last,
        })
    }
}

/// The VMI API of a namespace.
fn vmi_api(client: &Client, ns: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "kubevirt.io",
        "v1",
        "VirtualMachineInstance",
    ));
    Api::namespaced_with(client.clone(), ns, &ar)
}

/// `kvtool default-vmi CR < vmi`: the VMI as virt-api would store it, or the causes it is refused for
/// ([`Error::Command`] with kvtool's exit status 2).
pub fn default_vmi(kvtool: &Path, cr_file: &Path, vmi: &Value) -> Result<Value> {
    let mut child = Command::new(kvtool)
        .arg("default-vmi")
        .arg(cr_file)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(KIT.io("run kvtool default-vmi"))?;
    let input = serde_json::to_vec(vmi).map_err(|e| Error::Failed {
        what: "serialise a VMI for kvtool".into(),
        reason: e.to_string(),
    })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(&input)
            .map_err(KIT.io("write the VMI to kvtool"))?;
    }
    let out = child
        .wait_with_output()
        .map_err(KIT.io("wait for kvtool default-vmi"))?;
    if !out.status.success() {
        return Err(Error::Command {
            command: "kvtool default-vmi".into(),
            status: out
                .status
                .code()
                .map_or("a signal".into(), |c| c.to_string()),
            output: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    serde_json::from_slice(&out.stdout).map_err(|e| Error::Failed {
        what: "parse kvtool default-vmi's output".into(),
        reason: e.to_string(),
    })
}

/// The JSON Patch that turns `original` into what kvtool printed (`defaulted`).
fn patch(original: &Value, defaulted: &Value) -> Vec<Value> {
    let mut ops = vec![json!({"op": "add", "path": "/spec", "value": defaulted["spec"]})];
    for field in ["labels", "annotations", "finalizers"] {
        let want = &defaulted["metadata"][field];
        if !want.is_null() && *want != original["metadata"][field] {
            ops.push(json!({"op": "add", "path": format!("/metadata/{field}"), "value": want}));
        }
    }
    ops
}

/// The AdmissionReview answer for one request.
fn answer(state: &State, review: &Value) -> Value {
    let uid = review["request"]["uid"].clone();
    let object = &review["request"]["object"];
    let name = format!(
        "{}/{}",
        review["request"]["namespace"].as_str().unwrap_or(""),
        object["metadata"]["name"]
            .as_str()
            .or_else(|| object["metadata"]["generateName"].as_str())
            .unwrap_or("")
    );
    let response = match state.defaulted(object) {
        Ok((defaulted, remembered)) => {
            state.counts.defaulted.fetch_add(1, Ordering::Relaxed);
            let ops = patch(object, &defaulted);
            let how = if remembered { " (remembered)" } else { "" };
            state.log(&format!("defaulted {name}{how}"));
            json!({
                "uid": uid, "allowed": true, "patchType": "JSONPatch",
                "patch": base64::engine::general_purpose::STANDARD
                    .encode(serde_json::to_vec(&ops).unwrap_or_default())
            })
        }
        Err(e) => {
            state.counts.refused.fetch_add(1, Ordering::Relaxed);
            state.log(&format!("refused {name}: {e}"));
            let code = match &e {
                Error::Command { status, .. } if status == "2" => 422,
                _ => 500,
            };
            json!({"uid": uid, "allowed": false, "status": {"code": code, "message": e.to_string()}})
        }
    };
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response})
}

impl State {
    /// kvtool's answer for `vmi`: remembered per VMI shape (spec, labels, annotations) and KubeVirt CR,
    /// since each kvtool run spends about 4 s of CPU on KubeVirt's package initialisation where virt-api,
    /// a long-running server, pays it once. The firmware UUID, which virt-api draws at random for each
    /// VMI, is drawn again for a remembered answer. Whether the answer was remembered.
    fn defaulted(&self, vmi: &Value) -> Result<(Value, bool)> {
        let cr = std::fs::read_to_string(&self.cr_file).unwrap_or_default();
        let key = serde_json::to_string(&json!([
            cr,
            vmi["spec"],
            vmi["metadata"]["labels"],
            vmi["metadata"]["annotations"]
        ]))
        .unwrap_or_default();
        let known = self
            .remembered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            .cloned();
        if let Some(mut defaulted) = known {
            if let Some(uuid) = defaulted.pointer_mut("/spec/domain/firmware/uuid") {
                *uuid = Value::String(crate::fixtures::random_uid());
            }
            return Ok((defaulted, true));
        }
        let defaulted = default_vmi(&self.kvtool, &self.cr_file, vmi)?;
        self.remembered
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, defaulted.clone());
        Ok((defaulted, false))
    }

    fn log(&self, line: &str) {
        let mut f = self.log.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(f, "{} {line}", jiff::Timestamp::now());
    }
}

/// The server's thread: accept TLS connections and answer reviews until the process ends.
fn serve(listener: std::net::TcpListener, acceptor: tokio_rustls::TlsAcceptor, state: Arc<State>) {
    let Ok(rt) = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
    else {
        return;
    };
    rt.block_on(async move {
        let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
            return;
        };
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            let state = state.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let service = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let state = state.clone();
                    async move { Ok::<_, std::convert::Infallible>(handle(state, req).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(tls), service)
                    .await;
            });
        }
    });
}

async fn handle(state: Arc<State>, req: Request<hyper::body::Incoming>) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: Vec<u8>| {
        let mut r = Response::new(Full::new(Bytes::from(body)));
        *r.status_mut() = status;
        r.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        r
    };
    if req.uri().path() != PATH {
        return reply(StatusCode::NOT_FOUND, b"{}".to_vec());
    }
    let Ok(body) = req.into_body().collect().await else {
        return reply(StatusCode::BAD_REQUEST, b"{}".to_vec());
    };
    let Ok(review) = serde_json::from_slice::<Value>(&body.to_bytes()) else {
        return reply(StatusCode::BAD_REQUEST, b"{}".to_vec());
    };
    // kvtool is a process: run it off the runtime's thread.
    let answered = tokio::task::spawn_blocking(move || answer(&state, &review)).await;
    match answered {
        Ok(v) => reply(StatusCode::OK, serde_json::to_vec(&v).unwrap_or_default()),
        Err(_) => reply(StatusCode::INTERNAL_SERVER_ERROR, b"{}".to_vec()),
    }
}
