//! One plugin connection of [`super::runtime::NriRuntime`]: its tasks (writer, reader, registration
//! driver), the `Runtime` service it serves, and the ttrpc calls it makes on the `Plugin` service.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;

use crate::{Error, Result};

use super::runtime::{
    Inner, NRI_VERSION, REGISTRATION_TIMEOUT, REQUEST_TIMEOUT, RUNTIME_NAME, RUNTIME_VERSION,
    Registration, lock,
};
use super::ttrpc::{
    CODE_INVALID_ARGUMENT, CODE_UNIMPLEMENTED, CODE_UNKNOWN, Demux, MESSAGE_LENGTH_MAX,
    MESSAGE_TYPE_REQUEST, MESSAGE_TYPE_RESPONSE, Message, PLUGIN_SERVICE, PLUGIN_SERVICE_CONN,
    RUNTIME_SERVICE, RUNTIME_SERVICE_CONN, Request, Response, encode_frames, encode_message,
    read_frame,
};

/// What the writer task is asked to do.
#[derive(Debug)]
enum Outgoing {
    /// Write these bytes.
    Bytes(Vec<u8>),
    /// Everything queued before is written: close the connection.
    Close,
}

/// A connected plugin.
#[derive(Debug)]
pub(super) struct PluginConn {
    pub(super) id: u64,
    out: mpsc::UnboundedSender<Outgoing>,
    pending: Mutex<HashMap<u32, oneshot::Sender<Response>>>,
    next_stream: AtomicU32,
    writer: Mutex<Option<AbortHandle>>,
    tasks: Mutex<Vec<AbortHandle>>,
    /// Set once register, configure and synchronize completed.
    pub(super) registration: Mutex<Option<Registration>>,
}

impl Inner {
    pub(super) fn accept(self: &Arc<Self>, stream: UnixStream) {
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        let (read, write) = stream.into_split();
        let (out, out_rx) = mpsc::unbounded_channel();
        let conn = Arc::new(PluginConn {
            id,
            out,
            pending: Mutex::new(HashMap::new()),
            next_stream: AtomicU32::new(1),
            writer: Mutex::new(None),
            tasks: Mutex::new(Vec::new()),
            registration: Mutex::new(None),
        });
        let previous = lock(&self.state).plugin.replace(conn.clone());
        if let Some(previous) = previous {
            tracing::info!(
                conn = id,
                "a new NRI plugin connection replaces the previous plugin"
            );
            previous.abort();
        }
        self.registered.send_replace(None);
        let (reg_tx, reg_rx) = oneshot::channel();
        let writer = tokio::spawn(write_loop(self.clone(), conn.clone(), write, out_rx));
        *lock(&conn.writer) = Some(writer.abort_handle());
        let tasks = [
            tokio::spawn(read_loop(self.clone(), conn.clone(), read, reg_tx)).abort_handle(),
            tokio::spawn(drive(self.clone(), conn.clone(), reg_rx)).abort_handle(),
        ];
        lock(&conn.tasks).extend(tasks);
    }

    /// Answers a call the plugin made on the `Runtime` service.
    fn serve_runtime(
        &self,
        conn: &PluginConn,
        msg: &Message,
        reg_tx: &mut Option<oneshot::Sender<Result<Value, String>>>,
    ) -> Result<()> {
        let req = Request::decode(&msg.payload)?;
        let answer = |rsp: Response| {
            conn.send(
                RUNTIME_SERVICE_CONN,
                encode_message(msg.stream_id, MESSAGE_TYPE_RESPONSE, &rsp.encode()),
            );
        };
        if req.service != RUNTIME_SERVICE {
            tracing::warn!(
                service = req.service,
                "NRI plugin called an unknown service"
            );
            answer(Response::error(
                CODE_UNIMPLEMENTED,
                format!("service {}", req.service),
            ));
            return Ok(());
        }
        let input = match req.method.as_str() {
            "RegisterPlugin" => "RegisterPluginRequest",
            "UpdateContainers" => "UpdateContainersRequest",
            other => {
                tracing::warn!(
                    method = other,
                    "NRI plugin called an unknown Runtime method"
                );
                answer(Response::error(
                    CODE_UNIMPLEMENTED,
                    format!("method {other}"),
                ));
                return Ok(());
            }
        };
        let body = match self.schema.decode(input, &req.payload) {
            Ok(body) => body,
            Err(e) => {
                tracing::warn!(error = %e, "NRI plugin sent an undecodable {input}");
                answer(Response::error(CODE_INVALID_ARGUMENT, e.to_string()));
                return Ok(());
            }
        };
        if req.method == "UpdateContainers" {
            tracing::info!(request = %body, "NRI plugin requested container updates");
            self.updates.send_modify(|u| u.push(body));
            if !self
                .unanswered_updates
                .load(std::sync::atomic::Ordering::Relaxed)
            {
                answer(Response::ok(Vec::new()));
            }
            return Ok(());
        }
        let name = body["plugin_name"].as_str().unwrap_or_default();
        let idx = body["plugin_idx"].as_str().unwrap_or_default();
        let refusal = if name.is_empty() {
            Some("invalid (empty) plugin name".to_string())
        } else if idx.len() != 2 || !idx.bytes().all(|b| b.is_ascii_digit()) {
            Some(format!("invalid plugin index {idx:?}: must be two digits"))
        } else {
            None
        };
        // The answer goes out before the registration proceeds to Configure.
        answer(match &refusal {
            Some(why) => Response::error(CODE_UNKNOWN, why.clone()),
            None => Response::ok(Vec::new()),
        });
        match reg_tx.take() {
            Some(tx) => {
                let _ = tx.send(refusal.map_or(Ok(body), Err));
            }
            None => tracing::warn!(name, idx, "NRI plugin registered twice; ignored"),
        }
        Ok(())
    }
}

impl PluginConn {
    fn send(&self, conn: u32, message: Vec<u8>) -> bool {
        self.out
            .send(Outgoing::Bytes(encode_frames(conn, &message)))
            .is_ok()
    }

    /// One ttrpc call on the `Plugin` service; the answer's payload.
    pub(super) async fn call(
        &self,
        method: &str,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>> {
        let request = Request {
            service: PLUGIN_SERVICE.to_string(),
            method: method.to_string(),
            payload,
            timeout_nano: i64::try_from(timeout.as_nanos()).unwrap_or(i64::MAX),
            metadata: Vec::new(),
        }
        .encode();
        if request.len() > MESSAGE_LENGTH_MAX {
            return Err(Error::TooLarge {
                method: method.to_string(),
                len: request.len(),
            });
        }
        let stream_id = self.next_stream.fetch_add(2, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(stream_id, tx);
        let message = encode_message(stream_id, MESSAGE_TYPE_REQUEST, &request);
        let disconnected = || Error::Disconnected {
            method: method.to_string(),
        };
        if !self.send(PLUGIN_SERVICE_CONN, message) {
            lock(&self.pending).remove(&stream_id);
            return Err(disconnected());
        }
        tracing::debug!(conn = self.id, stream_id, method, "NRI call sent");
        let response = match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(response)) => response,
            Ok(Err(_)) => return Err(disconnected()),
            Err(_) => {
                lock(&self.pending).remove(&stream_id);
                return Err(Error::RequestTimeout {
                    method: method.to_string(),
                    timeout,
                });
            }
        };
        let status = response.status();
        if status.code != 0 {
            return Err(Error::Status {
                method: method.to_string(),
                code: status.code,
                message: status.message,
            });
        }
        Ok(response.payload)
    }

    /// Closes the connection once what is queued is written; pending calls fail at once.
    pub(super) fn close(&self) {
        lock(&self.pending).clear();
        let _ = self.out.send(Outgoing::Close);
        for task in lock(&self.tasks).drain(..) {
            task.abort();
        }
    }

    /// Closes the connection at once, dropping what is queued.
    pub(super) fn abort(&self) {
        self.close();
        if let Some(writer) = lock(&self.writer).take() {
            writer.abort();
        }
    }
}

pub(super) async fn accept_loop(inner: Weak<Inner>, listener: UnixListener) {
    loop {
        match listener.accept().await {
            Ok((stream, _)) => match inner.upgrade() {
                Some(inner) => inner.accept(stream),
                None => return,
            },
            Err(e) => {
                tracing::warn!(error = %e, "fake NRI runtime: accept failed");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

async fn write_loop(
    inner: Arc<Inner>,
    conn: Arc<PluginConn>,
    mut write: OwnedWriteHalf,
    mut out: mpsc::UnboundedReceiver<Outgoing>,
) {
    while let Some(Outgoing::Bytes(bytes)) = out.recv().await {
        let written = tokio::time::timeout(REQUEST_TIMEOUT, write.write_all(&bytes)).await;
        let failure = match written {
            Ok(Ok(())) => continue,
            Ok(Err(e)) => format!("writing to the plugin failed: {e}"),
            Err(_) => format!("the plugin read nothing for {REQUEST_TIMEOUT:?}"),
        };
        inner.disconnect(&conn, &failure);
        return;
    }
    let _ = write.shutdown().await;
}

async fn read_loop(
    inner: Arc<Inner>,
    conn: Arc<PluginConn>,
    mut read: OwnedReadHalf,
    reg_tx: oneshot::Sender<Result<Value, String>>,
) {
    let mut reg_tx = Some(reg_tx);
    let mut demux = Demux::default();
    let reason = 'conn: loop {
        let (cid, payload) = match read_frame(&mut read).await {
            Ok(Some(frame)) => frame,
            Ok(None) => break "the plugin closed the connection".to_string(),
            Err(e) => break format!("bad data from the plugin: {e}"),
        };
        if cid != PLUGIN_SERVICE_CONN && cid != RUNTIME_SERVICE_CONN {
            tracing::warn!(
                cid,
                "NRI frame for a connection id NRI does not use; dropped"
            );
            continue;
        }
        demux.push(cid, &payload);
        loop {
            let msg = match demux.next_message(cid) {
                Ok(Some(msg)) => msg,
                Ok(None) => break,
                Err(e) => break 'conn format!("bad data from the plugin: {e}"),
            };
            let handled =
                match (cid, msg.kind) {
                    (RUNTIME_SERVICE_CONN, MESSAGE_TYPE_REQUEST) => {
                        inner.serve_runtime(&conn, &msg, &mut reg_tx)
                    }
                    (PLUGIN_SERVICE_CONN, MESSAGE_TYPE_RESPONSE) => Response::decode(&msg.payload)
                        .map(|rsp| match lock(&conn.pending).remove(&msg.stream_id) {
                            Some(tx) => {
                                let _ = tx.send(rsp);
                            }
                            None => tracing::debug!(
                                stream_id = msg.stream_id,
                                "NRI response for no pending call (late or unknown); dropped"
                            ),
                        }),
                    (cid, kind) => {
                        tracing::warn!(
                            cid,
                            kind,
                            "unexpected ttrpc message type from the plugin; ignored"
                        );
                        Ok(())
                    }
                };
            if let Err(e) = handled {
                break 'conn format!("bad data from the plugin: {e}");
            }
        }
    };
    tracing::warn!(conn = conn.id, reason, "NRI plugin connection ends");
    inner.disconnect(&conn, &reason);
}

/// Register → Configure → Synchronize, then publish the registration.
async fn drive(
    inner: Arc<Inner>,
    conn: Arc<PluginConn>,
    reg_rx: oneshot::Receiver<Result<Value, String>>,
) {
    match register(&inner, &conn, reg_rx).await {
        Ok(mut reg) => {
            let mut st = lock(&inner.state);
            if st.plugin.as_ref().is_none_or(|p| p.id != conn.id) {
                return;
            }
            st.count += 1;
            reg.count = st.count;
            *lock(&conn.registration) = Some(reg.clone());
            tracing::info!(
                name = reg.plugin_name,
                idx = reg.plugin_idx,
                events = reg.events,
                count = reg.count,
                "NRI plugin registered"
            );
            inner.registered.send_replace(Some(reg));
        }
        Err(reason) => inner.disconnect(&conn, &reason),
    }
}

async fn register(
    inner: &Inner,
    conn: &PluginConn,
    reg_rx: oneshot::Receiver<Result<Value, String>>,
) -> Result<Registration, String> {
    let body = match tokio::time::timeout(REGISTRATION_TIMEOUT, reg_rx).await {
        Err(_) => return Err("plugin registration timed out".into()),
        Ok(Err(_)) => return Err("connection closed before the plugin registered".into()),
        Ok(Ok(Err(refused))) => return Err(format!("registration refused: {refused}")),
        Ok(Ok(Ok(body))) => body,
    };
    let text = |key: &str| body[key].as_str().unwrap_or_default().to_string();
    let configure = json!({
        "config": "",
        "runtime_name": RUNTIME_NAME,
        "runtime_version": RUNTIME_VERSION,
        "registration_timeout": REGISTRATION_TIMEOUT.as_millis() as i64,
        "request_timeout": REQUEST_TIMEOUT.as_millis() as i64,
        "NRI_version": NRI_VERSION,
    });
    let step = |what: &str, e: Error| format!("{what} failed: {e}");
    let configured = inner
        .call(conn, "Configure", &configure)
        .await
        .map_err(|e| step("Configure", e))?;
    let events = configured["events"].as_i64().unwrap_or(0) as i32;
    if events & !inner.valid_events != 0 {
        return Err(format!(
            "invalid plugin events: 0x{:x}",
            events & !inner.valid_events
        ));
    }
    let _sync_lock = inner.sync_lock.clone().lock_owned().await;
    let (pods, containers) = {
        let st = lock(&inner.state);
        (st.pods.clone(), st.containers.clone())
    };
    let sync = json!({"pods": pods, "containers": containers, "more": false});
    let synchronize = inner
        .call(conn, "Synchronize", &sync)
        .await
        .map_err(|e| step("Synchronize", e))?;
    Ok(Registration {
        plugin_name: text("plugin_name"),
        plugin_idx: text("plugin_idx"),
        nri_version: text("NRI_version"),
        events,
        synchronize,
        registered_at: Instant::now(),
        count: 0,
    })
}
