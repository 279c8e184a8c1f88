//! The NRI plugin's connection: connect to the runtime's socket, register, serve the `Plugin` service,
//! and reconnect when the runtime restarts. The decisions come from a [`Containers`] implementation.
//!
//! The runtime fails a container's creation when a plugin is slow, so `CreateContainer` is answered on
//! the read loop from memory ([`Containers::decide`], no I/O); only a pod carrying teeguard's
//! annotation that the agent's pod cache does not know yet is looked up, in its own task, bounded by
//! half the runtime's request timeout (at most [`MAX_LOOKUP`]).
//!
//! A container the runtime *created* while the plugin was away but had not started when it registered
//! is listed in `Synchronize` and answered with its update like the others, but containerd does not
//! apply an update to a container that is not running (its created task keeps the old resources). So
//! the plugin also subscribes to `POST_START_CONTAINER` and, when such a container starts, asks the
//! runtime to update it (`UpdateContainers`, `ignore_failure`).
//!
//! The plugin's own `UpdateContainers` calls are followed by [`super::updates`] (their answers and
//! the ones left unanswered logged).
//!
//! Strict mode: a keyless container (one whose `<kind> 0` its namespace's exempt label alone decides)
//! follows that label while it runs, as the cgroup writer's pod cgroups do: labelled exempt later (or
//! seen so only after the container, the namespace watch being apart from the pod watch), its zero is
//! lifted (`<kind> max`, `UpdateContainers`); the label removed, the zero is given again. The plugin
//! remembers these containers (at `CreateContainer` and `Synchronize`) until the runtime removes them
//! (`REMOVE_CONTAINER`); a label changed while the plugin's connection was down shows in
//! `Synchronize` (the container's resources against the label) and is followed in its answer.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::io::AsyncWriteExt as _;
use tokio::net::UnixStream;
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::{Mutex, mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::sync::{ExistingContainer, SynchronizeRequest, live_containers, synchronize_response};
use super::transport::{self as t, Demux};
use super::updates::Unanswered;
use super::wire::{
    self, CONTAINER_CREATED, ContainerEvent, CreateContainer, EVENT_CREATE_CONTAINER,
    EVENT_POST_START_CONTAINER, EVENT_REMOVE_CONTAINER,
};
use super::zeros::Zeros;
use crate::decide::enforcing::NriState;

/// The plugin's registered name.
pub const PLUGIN_NAME: &str = "teeguard";
/// The longest a lookup of an unknown pod may delay a container's creation.
pub const MAX_LOOKUP: Duration = Duration::from_secs(1);
/// The ttrpc stream of the plugin's `RegisterPlugin` call; its later calls (`UpdateContainers`) take
/// the next odd numbers, as a ttrpc client's streams do.
const REGISTER_STREAM: u32 = 1;
/// The runtime must answer `RegisterPlugin` within this. Once it has, the plugin waits for `Configure`
/// and `Synchronize` as long as the connection stays open, as NRI's own plugin stub does: containerd
/// synchronizes a new plugin only when no container operation holds NRI's lock (a sandbox teardown
/// stuck on its CNI plugin held it 30 s on a loaded node), and a plugin that gave up and reconnected
/// would queue behind the same lock again.
pub const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);
/// First reconnect delay; doubles up to [`RECONNECT_MAX`].
pub const RECONNECT_INITIAL: Duration = Duration::from_millis(100);
/// Longest reconnect delay (a restarted runtime is found again within about a second).
pub const RECONNECT_MAX: Duration = Duration::from_secs(1);

/// What the plugin answers for one container.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decision {
    /// `misc.max` to set, or none.
    pub value: Option<String>,
    /// Strict mode's zero for the container unless its namespace is labelled exempt (e.g. `tdx 0`;
    /// `None`: its limit does not depend on the label).
    pub zero: Option<String>,
}

/// The answer for one container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// Answer now.
    Now(Decision),
    /// The pod is unknown and its limit needs it (teeguard's annotation, a prepared claim, strict
    /// mode's zero): look it up first.
    Lookup,
}

/// Where the plugin's decisions come from.
pub trait Containers: Send + Sync + 'static {
    /// Resolves once decisions can be made (the host and the node's pods are known, or it is time to
    /// register without them): the plugin registers only then, so that `Synchronize` can give the
    /// containers that already run their limits.
    fn ready(&self) -> BoxFuture<'static, ()>;
    /// Decide from memory (no I/O).
    fn decide(&self, req: &CreateContainer) -> Answer;
    /// Decide after looking the pod up (called only after [`Answer::Lookup`]).
    fn decide_after_lookup(&self, req: CreateContainer) -> BoxFuture<'static, Decision>;
    /// Whether `namespace` is labelled exempt, as a watch that has listed them says (strict mode's
    /// zeros there are lifted).
    fn exempt(&self, namespace: &str) -> bool;
    /// Sees every change of what [`Containers::exempt`] reads (`None`: strict mode is off, no zero is
    /// ever given or lifted later).
    fn exempt_changes(&self) -> Option<watch::Receiver<u64>>;
}

/// Plugin settings.
#[derive(Clone, Debug)]
pub struct PluginConfig {
    /// The runtime's NRI socket.
    pub socket: PathBuf,
    /// The plugin index (two digits).
    pub index: String,
}

/// Connect, serve, reconnect until `shutdown`. Never returns an error: every failure is a state.
pub async fn run(
    config: PluginConfig,
    containers: Arc<dyn Containers>,
    state: watch::Sender<NriState>,
    shutdown: CancellationToken,
) {
    tokio::select! {
        () = shutdown.cancelled() => return,
        () = containers.ready() => {}
    }
    let mut delay = RECONNECT_INITIAL;
    loop {
        let outcome = tokio::select! {
            () = shutdown.cancelled() => return,
            r = session(&config, containers.clone(), &state, &shutdown) => r,
        };
        let reason = match outcome {
            Ok(true) => {
                delay = RECONNECT_INITIAL;
                "the runtime closed the connection".to_string()
            }
            Ok(false) => return,
            Err(e) => e,
        };
        let first =
            !matches!(&*state.borrow(), NriState::Disconnected { reason: r } if *r == reason);
        if first {
            tracing::warn!(socket = %config.socket.display(), reason, "NRI plugin not connected; retrying");
        }
        state.send_replace(NriState::Disconnected { reason });
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
        delay = (delay * 2).min(RECONNECT_MAX);
    }
}

type Writer = Arc<Mutex<OwnedWriteHalf>>;

async fn send(writer: &Writer, bytes: &[u8]) -> std::io::Result<()> {
    writer.lock().await.write_all(bytes).await
}

/// One connection. `Ok(true)`: the runtime went away (reconnect); `Ok(false)`: shut down.
async fn session(
    config: &PluginConfig,
    containers: Arc<dyn Containers>,
    state: &watch::Sender<NriState>,
    shutdown: &CancellationToken,
) -> Result<bool, String> {
    let stream = UnixStream::connect(&config.socket)
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", config.socket.display()))?;
    let (reader, writer) = stream.into_split();
    let writer: Writer = Arc::new(Mutex::new(writer));
    let register = t::encode_request(
        t::RUNTIME_SERVICE,
        "RegisterPlugin",
        &wire::register_plugin_request(PLUGIN_NAME, &config.index),
        REGISTER_TIMEOUT.as_nanos() as i64,
    );
    send(
        &writer,
        &t::encode_message(t::RUNTIME_CONN, REGISTER_STREAM, t::TYPE_REQUEST, &register),
    )
    .await
    .map_err(|e| format!("cannot send RegisterPlugin: {e}"))?;
    let started = Instant::now();
    let mut exempt = containers.exempt_changes();
    let mut session = Session {
        strict: exempt.is_some(),
        zeroed: Arc::default(),
        containers,
        writer,
        runtime: String::new(),
        runtime_nri: String::new(),
        lookup_timeout: MAX_LOOKUP,
        registered: false,
        synchronized: false,
        sync_pods: Vec::new(),
        sync_containers: Vec::new(),
        update_at_start: Arc::default(),
        update_now: None,
        next_stream: REGISTER_STREAM + 2,
        unanswered: Unanswered::default(),
    };
    let mut demux = Demux::default();
    let (frames_tx, mut frames) = mpsc::channel(8);
    let _reader = t::AbortOnDrop(tokio::spawn(t::read_frames(reader, frames_tx)));
    let mut slow_noted = false;
    loop {
        // Until RegisterPlugin is answered the deadline ends the session; after it, it only notes
        // once that synchronization is slow (see REGISTER_TIMEOUT).
        let deadline = (!session.registered || (!session.synchronized && !slow_noted))
            .then_some(started + REGISTER_TIMEOUT);
        let frame = tokio::select! {
            () = shutdown.cancelled() => return Ok(false),
            () = sleep_until(deadline) => {
                if !session.registered {
                    return Err(format!("the runtime did not answer RegisterPlugin within {REGISTER_TIMEOUT:?}"));
                }
                slow_noted = true;
                tracing::warn!(
                    socket = %config.socket.display(),
                    waited = ?REGISTER_TIMEOUT,
                    "the runtime accepted the NRI registration but has not synchronized the plugin yet; waiting on this connection (a runtime synchronizes a new plugin once none of its container operations holds NRI's lock)"
                );
                continue;
            }
            () = sleep_until(session.unanswered.deadline()) => {
                session.unanswered.note_overdue();
                continue;
            }
            () = changed(&mut exempt) => {
                for (id, value) in session.label_changes() {
                    session
                        .update_container(&id, &value, "its namespace's exempt label changed: strict mode's zero given or lifted")
                        .await?;
                }
                continue;
            }
            frame = frames.recv() => frame,
        };
        let (conn, payload) = match frame {
            Some(Ok(frame)) => frame,
            Some(Err(e)) => return Err(format!("reading from the runtime failed: {e}")),
            None => return Ok(true),
        };
        let messages = demux
            .push(conn, &payload)
            .map_err(|e| format!("the runtime sent a bad frame: {e}"))?;
        for m in messages {
            if session.handle(m, state).await? {
                return Ok(true);
            }
        }
    }
}

/// Resolves when `rx` sees a change; never when there is nothing to watch (or the watch ended).
async fn changed(rx: &mut Option<watch::Receiver<u64>>) {
    if let Some(r) = rx
        && r.changed().await.is_ok()
    {
        return;
    }
    *rx = None;
    std::future::pending::<()>().await;
}

/// What `Synchronize` decided for one container that already runs.
struct Existing {
    id: String,
    namespace: String,
    decision: Decision,
}

/// The decisions for the containers that already run; an unknown pod whose limit needs it is looked
/// up as at `CreateContainer`, within `timeout`.
async fn existing_limits(
    containers: Arc<dyn Containers>,
    existing: Vec<CreateContainer>,
    timeout: Duration,
) -> Vec<Existing> {
    let decided = existing.into_iter().map(|c| {
        let containers = containers.clone();
        async move {
            let (id, namespace) = (c.container_id.clone(), c.pod_namespace.clone());
            let decision = match containers.decide(&c) {
                Answer::Now(decision) => decision,
                Answer::Lookup => {
                    let looked_up = containers.decide_after_lookup(c);
                    tokio::time::timeout(timeout, looked_up)
                        .await
                        .unwrap_or_default()
                }
            };
            Existing {
                id,
                namespace,
                decision,
            }
        }
    });
    futures::future::join_all(decided).await
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.into()).await,
        None => std::future::pending().await,
    }
}

struct Session {
    containers: Arc<dyn Containers>,
    writer: Writer,
    runtime: String,
    /// The NRI release the runtime was built with, as `Configure` said (`unknown` when not said).
    runtime_nri: String,
    lookup_timeout: Duration,
    registered: bool,
    synchronized: bool,
    /// The parts of `Synchronize` received so far.
    sync_pods: Vec<CreateContainer>,
    sync_containers: Vec<ExistingContainer>,
    /// Containers `Synchronize` listed as created, not started, that need a limit: container ID →
    /// `misc.max`, asked for again when they start (see the module documentation).
    update_at_start: Arc<std::sync::Mutex<HashMap<String, String>>>,
    /// An update to ask for once the current call is answered.
    update_now: Option<(String, String)>,
    /// Strict mode's keyless containers this session answered or was told of, until removed.
    zeroed: Arc<Zeros>,
    /// Strict mode is on: zeros are remembered, and removals followed.
    strict: bool,
    /// The stream of the plugin's next call to the runtime.
    next_stream: u32,
    /// `UpdateContainers` calls not answered yet.
    unanswered: Unanswered,
}

impl Session {
    /// Handle one message; `Ok(true)` ends the session (the runtime asked the plugin to shut down).
    async fn handle(
        &mut self,
        m: t::Message,
        state: &watch::Sender<NriState>,
    ) -> Result<bool, String> {
        match (m.conn, m.kind) {
            (t::RUNTIME_CONN, t::TYPE_RESPONSE) if m.stream != REGISTER_STREAM => {
                self.unanswered.answered(m.stream, &m.payload);
                Ok(false)
            }
            (t::RUNTIME_CONN, t::TYPE_RESPONSE) => {
                let resp = t::decode_response(&m.payload)
                    .map_err(|e| format!("bad RegisterPlugin response: {e}"))?;
                if resp.code() != 0 {
                    return Err(format!(
                        "the runtime refused the registration (code {}): {}",
                        resp.code(),
                        resp.message()
                    ));
                }
                self.registered = true;
                Ok(false)
            }
            (t::PLUGIN_CONN, t::TYPE_REQUEST) => {
                let req = t::decode_request(&m.payload)
                    .map_err(|e| format!("bad request from the runtime: {e}"))?;
                let (code, message, body, end) =
                    self.serve(&req.method, &req.payload, m.stream, state)?;
                if let Some(body) = body {
                    self.reply(m.stream, code, &message, &body).await?;
                }
                if let Some((id, value)) = self.update_now.take() {
                    self.update_container(&id, &value, "started after Synchronize")
                        .await?;
                }
                Ok(end)
            }
            _ => {
                tracing::debug!(conn = m.conn, kind = m.kind, "NRI message ignored");
                Ok(false)
            }
        }
    }

    /// The reply to one `Plugin` call: `(code, message, body, end session)`; `body: None` when a task
    /// answers later.
    #[allow(clippy::type_complexity)]
    fn serve(
        &mut self,
        method: &str,
        payload: &[u8],
        stream: u32,
        state: &watch::Sender<NriState>,
    ) -> Result<(i32, String, Option<Vec<u8>>, bool), String> {
        let ok = |body: Vec<u8>| Ok((0, String::new(), Some(body), false));
        match method {
            "Configure" => {
                let req = <wire::ConfigureRequest as prost::Message>::decode(payload)
                    .map_err(|e| format!("bad Configure request: {e}"))?;
                self.runtime = format!("{} {}", req.runtime_name, req.runtime_version)
                    .trim()
                    .to_string();
                self.runtime_nri = if req.nri_version.is_empty() {
                    "unknown".to_string()
                } else {
                    req.nri_version
                };
                if req.request_timeout > 0 {
                    let half = Duration::from_millis(req.request_timeout as u64) / 2;
                    self.lookup_timeout = half.min(MAX_LOOKUP);
                }
                let mut events = vec![EVENT_CREATE_CONTAINER, EVENT_POST_START_CONTAINER];
                if self.strict {
                    events.push(EVENT_REMOVE_CONTAINER);
                }
                ok(wire::configure_response(wire::event_mask(&events)))
            }
            "Synchronize" => {
                let req = SynchronizeRequest::decode(
                    payload,
                    teeguard_shared::names::MISC_MAX_ANNOTATION_PREFIX,
                )
                .map_err(|e| format!("bad Synchronize request: {e}"))?;
                self.sync_pods.extend(req.pods);
                self.sync_containers.extend(req.containers);
                if req.more {
                    return ok(synchronize_response(true, &[]));
                }
                self.synchronized = true;
                tracing::info!(
                    runtime = %self.runtime,
                    runtime_nri_version = %self.runtime_nri,
                    plugin_nri_version = wire::NRI_VERSION,
                    registered = self.registered,
                    "NRI plugin registered"
                );
                state.send_replace(NriState::Registered {
                    runtime: self.runtime.clone(),
                });
                let created: HashSet<String> = self
                    .sync_containers
                    .iter()
                    .filter(|c| c.state == CONTAINER_CREATED)
                    .map(|c| c.id.clone())
                    .collect();
                let current: HashMap<String, String> = self
                    .sync_containers
                    .iter()
                    .filter_map(|c| Some((c.id.clone(), c.misc_max.clone()?)))
                    .collect();
                let existing = live_containers(
                    &std::mem::take(&mut self.sync_pods),
                    &std::mem::take(&mut self.sync_containers),
                );
                let (containers, writer) = (self.containers.clone(), self.writer.clone());
                let timeout = self.lookup_timeout;
                let update_at_start = self.update_at_start.clone();
                let zeroed = self.zeroed.clone();
                tokio::spawn(async move {
                    let decided = existing_limits(containers.clone(), existing, timeout).await;
                    // Strict mode's keyless containers, each as it will be once answered (or as its
                    // resources show it: a zero given before this connection), then given or lifted
                    // at once when its namespace's label changed meanwhile.
                    for c in &decided {
                        let now = c.decision.value.as_ref().or_else(|| current.get(&c.id));
                        zeroed.note(
                            &c.id,
                            &c.namespace,
                            c.decision.zero.as_deref(),
                            now.map(String::as_str),
                        );
                    }
                    let mut updates: Vec<(String, String)> = decided
                        .into_iter()
                        .filter_map(|c| Some((c.id, c.decision.value?)))
                        .collect();
                    for (id, value) in zeroed.follow(|ns| containers.exempt(ns)) {
                        tracing::info!(container = %id, misc_max = %value, "its namespace's exempt label changed while the plugin was away: strict mode's zero given or lifted");
                        updates.retain(|(u, _)| *u != id);
                        updates.push((id, value));
                    }
                    if !updates.is_empty() {
                        tracing::info!(
                            containers = updates.len(),
                            "misc.max asked for containers that already run (NRI Synchronize)"
                        );
                    }
                    // Recorded before the answer: the runtime starts none of them before it has it.
                    {
                        let mut at_start =
                            update_at_start.lock().unwrap_or_else(|e| e.into_inner());
                        for (id, value) in updates.iter().filter(|(id, _)| created.contains(id)) {
                            tracing::info!(container = %id, misc_max = %value, "created but not started: misc.max asked for again when it starts");
                            at_start.insert(id.clone(), value.clone());
                        }
                    }
                    let body = synchronize_response(false, &updates);
                    let resp = t::encode_response(0, "", &body);
                    let frame = t::encode_message(t::PLUGIN_CONN, stream, t::TYPE_RESPONSE, &resp);
                    if let Err(e) = send(&writer, &frame).await {
                        tracing::warn!(error = %e, "cannot answer Synchronize");
                    }
                });
                Ok((0, String::new(), None, false))
            }
            "CreateContainer" => {
                let req = match CreateContainer::decode(
                    payload,
                    teeguard_shared::names::MISC_MAX_ANNOTATION_PREFIX,
                ) {
                    Ok(r) => r,
                    Err(e) => {
                        // Never fail a container over a message we cannot read: answer without adjustment.
                        tracing::warn!(error = %e, "CreateContainer request not understood; no limit applied");
                        return ok(wire::create_container_response(None));
                    }
                };
                match self.containers.decide(&req) {
                    Answer::Now(decision) => {
                        let (id, namespace) = (&req.container_id, &req.pod_namespace);
                        let Decision { value, zero } = decision;
                        self.zeroed
                            .note(id, namespace, zero.as_deref(), value.as_deref());
                        ok(wire::create_container_response(value.as_deref()))
                    }
                    Answer::Lookup => {
                        let containers = self.containers.clone();
                        let writer = self.writer.clone();
                        let zeroed = self.zeroed.clone();
                        let timeout = self.lookup_timeout;
                        tokio::spawn(async move {
                            let (id, namespace) =
                                (req.container_id.clone(), req.pod_namespace.clone());
                            let decision = tokio::time::timeout(timeout, containers.decide_after_lookup(req))
                                .await
                                .unwrap_or_else(|_| {
                                    tracing::warn!("looking up a pod took longer than {timeout:?}; no limit applied");
                                    Decision::default()
                                });
                            let Decision { value, zero } = decision;
                            zeroed.note(&id, &namespace, zero.as_deref(), value.as_deref());
                            let body = wire::create_container_response(value.as_deref());
                            let resp = t::encode_response(0, "", &body);
                            let frame =
                                t::encode_message(t::PLUGIN_CONN, stream, t::TYPE_RESPONSE, &resp);
                            if let Err(e) = send(&writer, &frame).await {
                                tracing::warn!(error = %e, "cannot answer CreateContainer");
                            }
                        });
                        Ok((0, String::new(), None, false))
                    }
                }
            }
            "PostStartContainer" | "RemoveContainer" | "StateChange" => {
                let mut at_start = self
                    .update_at_start
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                match wire::container_event(method, payload) {
                    Ok(Some(ContainerEvent::Started(id))) => {
                        self.update_now = at_start.remove(&id).map(|value| (id, value));
                    }
                    Ok(Some(ContainerEvent::Removed(id))) => {
                        at_start.remove(&id);
                        self.zeroed.forget(&id);
                    }
                    Ok(None) => {}
                    Err(e) => tracing::warn!(method, error = %e, "NRI event not understood"),
                }
                ok(Vec::new())
            }
            "Shutdown" => Ok((0, String::new(), Some(Vec::new()), true)),
            // Events the plugin did not subscribe to; answer them empty.
            "RunPodSandbox"
            | "StopPodSandbox"
            | "RemovePodSandbox"
            | "PostCreateContainer"
            | "StartContainer"
            | "UpdateContainer"
            | "PostUpdateContainer"
            | "StopContainer"
            | "UpdatePodSandbox"
            | "PostUpdatePodSandbox" => ok(Vec::new()),
            other => Ok((
                t::CODE_UNIMPLEMENTED,
                format!("method {other} is not implemented by the teeguard plugin"),
                Some(Vec::new()),
                false,
            )),
        }
    }

    /// Strict mode's keyless containers whose namespace's exempt label changed: `(ID, misc.max)`,
    /// the zero lifted or given again ([`Zeros::follow`]). Each is also asked for again when it starts
    /// (a runtime that does not update a created container keeps it until then).
    fn label_changes(&self) -> Vec<(String, String)> {
        let changed = self.zeroed.follow(|ns| self.containers.exempt(ns));
        let mut at_start = self
            .update_at_start
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for (id, value) in &changed {
            at_start.insert(id.clone(), value.clone());
        }
        changed
    }

    /// Ask the runtime to set `misc.max` of the running container `id` (`why`, for the log; its answer
    /// is logged by [`updated`]).
    async fn update_container(&mut self, id: &str, value: &str, why: &str) -> Result<(), String> {
        tracing::info!(container = %id, misc_max = %value, "{why}: misc.max asked for (NRI UpdateContainers)");
        let req = t::encode_request(
            t::RUNTIME_SERVICE,
            "UpdateContainers",
            &wire::update_containers_request(id, value),
            REGISTER_TIMEOUT.as_nanos() as i64,
        );
        let stream = self.next_stream;
        self.next_stream += 2;
        self.unanswered.sent(stream, id, value);
        send(
            &self.writer,
            &t::encode_message(t::RUNTIME_CONN, stream, t::TYPE_REQUEST, &req),
        )
        .await
        .map_err(|e| format!("cannot send UpdateContainers: {e}"))
    }

    async fn reply(
        &self,
        stream: u32,
        code: i32,
        message: &str,
        body: &[u8],
    ) -> Result<(), String> {
        let resp = t::encode_response(code, message, body);
        send(
            &self.writer,
            &t::encode_message(t::PLUGIN_CONN, stream, t::TYPE_RESPONSE, &resp),
        )
        .await
        .map_err(|e| format!("cannot answer the runtime: {e}"))
    }
}
