//! [`NriRuntime`]: a fake container runtime playing containerd's NRI side for one plugin at a time.
//!
//! It listens on a Unix socket and, for each accepted plugin connection (a new one replaces the
//! previous plugin), does what containerd's NRI adaptation does: serves the `Runtime` service on
//! logical connection 2 and waits for `RegisterPlugin` (empty name or an index that is not two digits is
//! refused, and the plugin closed); calls `Configure` on connection 1 and records the event mask (0
//! means every event; unknown bits are refused); calls `Synchronize` with the pods and containers set by
//! [`NriRuntime::set_existing`], under NRI's sync lock ([`NriRuntime::hold_sync_lock`]); only then is
//! the plugin registered ([`NriRuntime::wait_registered`]).
//! The test then drives calls: [`NriRuntime::create_container`] (skipped, answering `{}`, when the plugin
//! did not subscribe to `CREATE_CONTAINER`), [`NriRuntime::start_container`] (the post-start event) and
//! [`NriRuntime::call`]; the plugin's `UpdateContainers` calls are recorded and answered with success
//! ([`NriRuntime::wait_updates`]). A call not answered within the
//! request timeout fails with [`Error::RequestTimeout`] and, as containerd does, closes the plugin;
//! [`NriRuntime::create_container_as_runtime`] gives what the container then gets (no adjustment).
//!
//! Messages are JSON in the form of [`crate::proto`], encoded with the upstream `api.proto`.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::runtime_conn::{PluginConn, accept_loop};
use crate::error::{self, Error, Result};
use crate::proto::Schema;

/// `ConfigureRequest.runtime_name`.
pub const RUNTIME_NAME: &str = "teeguard-test-runtime";
/// `ConfigureRequest.runtime_version`.
pub const RUNTIME_VERSION: &str = "0";
/// `ConfigureRequest.NRI_version`.
pub const NRI_VERSION: &str = "v0.10.0";
/// How long a connected plugin has to call `RegisterPlugin`.
pub const REGISTRATION_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the plugin has to answer each call.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// A plugin that completed register, configure and synchronize.
#[derive(Clone, Debug, PartialEq)]
pub struct Registration {
    /// `RegisterPluginRequest.plugin_name`.
    pub plugin_name: String,
    /// `RegisterPluginRequest.plugin_idx`.
    pub plugin_idx: String,
    /// `RegisterPluginRequest.NRI_version` (empty when not sent).
    pub nri_version: String,
    /// `ConfigureResponse.events` as answered: bit `event - 1` per subscribed event, 0 meaning all.
    pub events: i32,
    /// The plugin's `SynchronizeResponse` (JSON).
    pub synchronize: Value,
    /// When synchronization completed.
    pub registered_at: Instant,
    /// Registrations completed by this runtime so far, this one included.
    pub count: u64,
}

impl Registration {
    /// Whether the plugin gets the event numbered `event` (an `Event` enum value), as containerd decides.
    pub fn subscribes(&self, event: i32) -> bool {
        self.events == 0 || (self.events & event_bit(event)) != 0
    }
}

/// The event-mask bit of the event numbered `event` (NRI's `EventMask.Set`: `1 << (event - 1)`).
/// 0 for numbers outside `1..=31`.
pub fn event_bit(event: i32) -> i32 {
    if (1..=31).contains(&event) {
        1 << (event - 1)
    } else {
        0
    }
}

/// `adjust.linux.resources.unified["misc.max"]` of a `CreateContainerResponse` (JSON).
pub fn misc_max(response: &Value) -> Option<&str> {
    response
        .pointer("/adjust/linux/resources/unified/misc.max")?
        .as_str()
}

/// The fake runtime. Dropping it (or [`NriRuntime::shutdown`]) stops its tasks and removes the socket.
pub struct NriRuntime {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for NriRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NriRuntime")
            .field("socket", &self.inner.socket)
            .field("registration", &*self.inner.registered.borrow())
            .finish()
    }
}

/// The runtime's shared state; the connection tasks of [`super::runtime_conn`] hold it too.
pub(super) struct Inner {
    pub(super) socket: PathBuf,
    pub(super) schema: Schema,
    pub(super) create_event: i32,
    pub(super) post_start_event: i32,
    /// The `UpdateContainersRequest`s (JSON) received, in order.
    pub(super) updates: watch::Sender<Vec<Value>>,
    /// Leave the plugin's `UpdateContainers` calls unanswered (recorded all the same), as CRI-O was
    /// seen to once.
    pub(super) unanswered_updates: std::sync::atomic::AtomicBool,
    pub(super) valid_events: i32,
    pub(super) state: Mutex<State>,
    pub(super) registered: watch::Sender<Option<Registration>>,
    pub(super) next_conn: AtomicU64,
    /// NRI's lock that containerd's container operations hold while they run, and that synchronizing a
    /// new plugin takes ([`NriRuntime::hold_sync_lock`]).
    pub(super) sync_lock: Arc<tokio::sync::Mutex<()>>,
}

#[derive(Default)]
pub(super) struct State {
    pub(super) pods: Vec<Value>,
    pub(super) containers: Vec<Value>,
    pub(super) listener: Option<JoinHandle<()>>,
    /// The current plugin connection (registered or not).
    pub(super) plugin: Option<Arc<PluginConn>>,
    /// Registrations completed so far.
    pub(super) count: u64,
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl NriRuntime {
    /// Parses the upstream `api.proto`, binds `socket` (removing a stale file, creating its directory)
    /// and accepts plugin connections in the background, on the current tokio runtime.
    pub async fn start(socket: impl Into<PathBuf>) -> Result<NriRuntime> {
        let schema = Schema::nri()?;
        let value = |name: &str| schema.enum_value("Event", name);
        let (create_event, post_start_event, last) = (
            value("CREATE_CONTAINER")?,
            value("POST_START_CONTAINER")?,
            value("LAST")?,
        );
        let inner = Arc::new(Inner {
            socket: socket.into(),
            valid_events: event_bit(last) - 1,
            create_event,
            post_start_event,
            updates: watch::Sender::new(Vec::new()),
            unanswered_updates: std::sync::atomic::AtomicBool::new(false),
            schema,
            state: Mutex::new(State::default()),
            registered: watch::Sender::new(None),
            next_conn: AtomicU64::new(1),
            sync_lock: Arc::default(),
        });
        inner.listen()?;
        Ok(NriRuntime { inner })
    }

    /// The socket plugins connect to.
    pub fn socket(&self) -> &Path {
        &self.inner.socket
    }

    /// The parsed upstream API definition.
    pub fn schema(&self) -> &Schema {
        &self.inner.schema
    }

    /// The pods and containers (`PodSandbox`/`Container` JSON) the next plugin is synchronized with.
    pub fn set_existing(&self, pods: Vec<Value>, containers: Vec<Value>) {
        let mut st = lock(&self.inner.state);
        st.pods = pods;
        st.containers = containers;
    }

    /// Takes NRI's sync lock as a container operation of containerd's does while it runs (until the
    /// guard drops): a plugin that registers meanwhile is configured at once and synchronized only once
    /// the lock is free (NRI's adaptation calls `Synchronize` under it). On a real node a sandbox
    /// teardown stuck on its CNI plugin held it 30 s. Waits for a `Synchronize` in flight.
    pub async fn hold_sync_lock(&self) -> tokio::sync::OwnedMutexGuard<()> {
        self.inner.sync_lock.clone().lock_owned().await
    }

    /// Plugin connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.inner
            .next_conn
            .load(std::sync::atomic::Ordering::Relaxed)
            - 1
    }

    /// The current registration, if a registered plugin is connected.
    pub fn registration(&self) -> Option<Registration> {
        self.inner.registered.borrow().clone()
    }

    /// From now on, leave the plugins' `UpdateContainers` calls unanswered (`true`) or answer them.
    pub fn leave_updates_unanswered(&self, unanswered: bool) {
        self.inner
            .unanswered_updates
            .store(unanswered, std::sync::atomic::Ordering::Relaxed);
    }

    /// The `UpdateContainersRequest`s (JSON) plugins sent so far.
    pub fn container_updates(&self) -> Vec<Value> {
        self.inner.updates.borrow().clone()
    }

    /// Waits until a plugin has registered (register, configure, synchronize) since the last start or
    /// restart, and is still connected.
    pub async fn wait_registered(&self, timeout: Duration) -> Result<Registration> {
        self.wait_registered_count(1, timeout).await
    }

    /// Like [`NriRuntime::wait_registered`], for registration number `count` or a later one.
    pub async fn wait_registered_count(
        &self,
        count: u64,
        timeout: Duration,
    ) -> Result<Registration> {
        let mut rx = self.inner.registered.subscribe();
        let waited = tokio::time::timeout(
            timeout,
            rx.wait_for(|r| r.as_ref().is_some_and(|r| r.count >= count)),
        )
        .await;
        let found = match waited {
            Ok(Ok(reg)) => reg.clone(),
            _ => None,
        };
        found.ok_or_else(|| Error::RegisterTimeout {
            socket: self.inner.socket.clone(),
        })
    }

    /// Relays `CreateContainer` for `pod` (`PodSandbox` JSON) and `container` (`Container` JSON) and
    /// returns the plugin's `CreateContainerResponse` (JSON); `{}` without calling when the plugin did
    /// not subscribe to `CREATE_CONTAINER`.
    pub async fn create_container(&self, pod: Value, container: Value) -> Result<Value> {
        let (conn, reg) = self.inner.current()?;
        if !reg.subscribes(self.inner.create_event) {
            tracing::debug!(
                events = reg.events,
                "NRI plugin not subscribed to CreateContainer"
            );
            return Ok(json!({}));
        }
        let body = json!({"pod": pod, "container": container});
        self.inner.call(&conn, "CreateContainer", &body).await
    }

    /// What the container's creation gets, as containerd 2.4 and CRI-O 1.37 decide it (seen on the real
    /// node, `tests/tests/node_*.rs`): the plugin's adjustment; `{}` (the container is created without
    /// adjustment) when no plugin is registered, or when the plugin did not answer within the request
    /// timeout: the runtime then closes it, and creates later containers without it until it registers
    /// again. Other errors are returned as they are.
    pub async fn create_container_as_runtime(&self, pod: Value, container: Value) -> Result<Value> {
        match self.create_container(pod, container).await {
            Err(
                Error::NotRegistered { .. }
                | Error::RequestTimeout { .. }
                | Error::Disconnected { .. },
            ) => Ok(json!({})),
            other => other,
        }
    }

    /// Relays that `container` of `pod` started, as the runtime does once it started it: the
    /// post-start event, sent the way NRI's adaptation sends it to a plugin (`StateChange` with
    /// `POST_START_CONTAINER`), only when the plugin subscribed to it. `false`: not subscribed, nothing
    /// sent.
    pub async fn start_container(&self, pod: Value, container: Value) -> Result<bool> {
        let (conn, reg) = self.inner.current()?;
        if !reg.subscribes(self.inner.post_start_event) {
            return Ok(false);
        }
        let body =
            json!({"event": self.inner.post_start_event, "pod": pod, "container": container});
        self.inner
            .request(&conn, "StateChange", "StateChangeEvent", "Empty", &body)
            .await?;
        Ok(true)
    }

    /// Waits until the plugins sent at least `count` `UpdateContainers` calls in all; returns them all.
    /// `None` when they did not within `timeout`.
    pub async fn wait_updates(&self, count: usize, timeout: Duration) -> Option<Vec<Value>> {
        let mut rx = self.inner.updates.subscribe();
        let got = tokio::time::timeout(timeout, rx.wait_for(|u| u.len() >= count))
            .await
            .ok()?
            .ok()?
            .clone();
        Some(got)
    }

    /// Calls any `Plugin` method on the registered plugin, whatever it subscribed to.
    pub async fn call(
        &self,
        method: &str,
        request_message: &str,
        response_message: &str,
        body: Value,
    ) -> Result<Value> {
        let (conn, _) = self.inner.current()?;
        self.inner
            .request(&conn, method, request_message, response_message, &body)
            .await
    }

    /// Simulates a runtime restart: closes the plugin connection and the listener, removes the socket,
    /// waits 100 ms, listens again. The registration is reset; the count goes on.
    pub async fn restart(&self) -> Result<()> {
        tracing::info!(socket = %self.inner.socket.display(), "fake NRI runtime restarting");
        self.inner.teardown();
        tokio::time::sleep(Duration::from_millis(100)).await;
        self.inner.listen()
    }

    /// Stops the runtime: closes the plugin connection and the listener, removes the socket.
    pub async fn shutdown(self) {
        self.inner.teardown();
        tokio::task::yield_now().await;
    }
}

impl Drop for NriRuntime {
    fn drop(&mut self) {
        self.inner.teardown();
    }
}

impl Inner {
    fn listen(self: &Arc<Self>) -> Result<()> {
        let io = |what| error::io_at("NRI runtime", what, &self.socket);
        if let Some(dir) = self.socket.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io("creating the directory of"))?;
        }
        match std::fs::remove_file(&self.socket) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(io("removing the stale socket")(e));
            }
            _ => {}
        }
        let listener = UnixListener::bind(&self.socket).map_err(io("binding"))?;
        tracing::info!(socket = %self.socket.display(), "fake NRI runtime listening");
        let task = tokio::spawn(accept_loop(Arc::downgrade(self), listener));
        if let Some(old) = lock(&self.state).listener.replace(task) {
            old.abort();
        }
        Ok(())
    }

    fn teardown(&self) {
        let (listener, plugin) = {
            let mut st = lock(&self.state);
            (st.listener.take(), st.plugin.take())
        };
        if let Some(listener) = listener {
            listener.abort();
        }
        if let Some(plugin) = plugin {
            plugin.abort();
        }
        self.registered.send_replace(None);
        let _ = std::fs::remove_file(&self.socket);
    }

    /// The connected, registered plugin.
    fn current(&self) -> Result<(Arc<PluginConn>, Registration)> {
        let st = lock(&self.state);
        st.plugin
            .as_ref()
            .and_then(|p| Some((p.clone(), lock(&p.registration).clone()?)))
            .ok_or_else(|| Error::NotRegistered {
                socket: self.socket.clone(),
            })
    }

    /// Forgets `conn` if it is the current plugin, and closes it.
    pub(super) fn disconnect(&self, conn: &PluginConn, reason: &str) {
        {
            let mut st = lock(&self.state);
            if st.plugin.as_ref().is_some_and(|p| p.id == conn.id) {
                st.plugin = None;
                self.registered.send_replace(None);
            }
        }
        tracing::info!(
            conn = conn.id,
            reason,
            "fake NRI runtime closing the plugin connection"
        );
        conn.close();
    }

    /// Call the plugin's `method` with `body`, a `<method>Request`; its `<method>Response`.
    pub(super) async fn call(
        &self,
        conn: &PluginConn,
        method: &str,
        body: &Value,
    ) -> Result<Value> {
        let (request, response) = (format!("{method}Request"), format!("{method}Response"));
        self.request(conn, method, &request, &response, body).await
    }

    pub(super) async fn request(
        &self,
        conn: &PluginConn,
        method: &str,
        request_message: &str,
        response_message: &str,
        body: &Value,
    ) -> Result<Value> {
        let payload = self.schema.encode(request_message, body)?;
        match conn.call(method, payload, REQUEST_TIMEOUT).await {
            Ok(bytes) => Ok(self.schema.decode(response_message, &bytes)?),
            Err(e) => {
                if matches!(e, Error::RequestTimeout { .. }) {
                    self.disconnect(conn, &e.to_string());
                }
                Err(e)
            }
        }
    }
}
