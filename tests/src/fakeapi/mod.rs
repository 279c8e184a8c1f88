//! An in-process, stateful fake Kubernetes API server for tests.
//!
//! [`FakeApiServer`] is a cheap-to-clone handle on one server state. Code under test talks to it through
//! the real kube client, either in-process ([`FakeApiServer::client`], an [`axum::Router`] handed to
//! [`kube::Client::new`]; no sockets) or over TCP ([`FakeApiServer::serve`] → [`ServedFakeApi`], plain
//! HTTP on `127.0.0.1`, with [`ServedFakeApi::write_kubeconfig`] for child processes using `KUBECONFIG`).
//! Tests and scenario drivers play the rest of the cluster through the programmatic API ([`create`],
//! [`get`], [`modify`], [`patch_status`], [`bind_pod`], [`delete`], [`wait_for`], ...); those writes go
//! through the same store and emit the same watch events.
//!
//! # Served resources
//! core/v1 `pods` (`status`, `binding`), `nodes` (`status`), `namespaces` (`status`), `events`;
//! `events.k8s.io/v1` `events` (the same objects as core events, converted); `coordination.k8s.io/v1`
//! `leases`; `kubevirt.io/v1` `virtualmachineinstances` (namespaced, `status`); `teeguard.dev/v1alpha1`
//! `teecapacities` (cluster-scoped, `status`, `status.conditions` a list-map keyed by `type`). More via
//! [`FakeApiServer::register_resource`]. Discovery (`/api`, `/apis`, `/api/v1`, `/apis/<g>/<v>`, aggregated
//! discovery v2, `/version`) describes them.
//!
//! # Semantics (as the real server)
//! - One global `resourceVersion` counter, bumped by every write; a no-op write does not bump it.
//! - Create sets `uid`, `creationTimestamp`, `generation: 1`; `generateName` appends 5 random characters;
//!   an existing name is 409 `AlreadyExists`; invalid names are 422. HTTP create drops `.status` of custom
//!   resources with a status subresource, sets Pods to `phase: Pending` and Namespaces to `Active`.
//!   Namespaces are not required to exist. There is no garbage collection of owned objects.
//! - Update (PUT) with a stale `metadata.resourceVersion` is 409 `Conflict`; custom resources need one
//!   (422 without). `generation` is bumped when anything outside `metadata`/`status` changes.
//! - Patches: JSON Patch (failed `test` → 422), merge patch, strategic merge patch (merge keys:
//!   containers/initContainers/ephemeralContainers/env/volumes/imagePullSecrets by `name`, conditions and
//!   node addresses by `type`, ownerReferences by `uid`, volumeMounts by `mountPath`, finalizers as a set;
//!   everything else, e.g. tolerations, replaced; `$patch`, `$deleteFromPrimitiveList`, `$retainKeys`
//!   honoured; refused with 415 for custom resources), server-side apply (`fieldManager` required, `force`,
//!   conflicts → 409 naming manager and field, re-apply removes fields the manager no longer sets, apply to
//!   a missing object creates it, apply to `/status` touches only `.status`). Managed fields are recorded
//!   for every HTTP write (`Update` and `Apply` entries in `metadata.managedFields`, `FieldsV1`);
//!   programmatic writes keep them untouched. Client-sent `managedFields` are ignored.
//! - Main-resource PUT/PATCH ignore `.status` changes of resources with a status subresource; PUT/PATCH on
//!   `/status` change only `.status`.
//! - `dryRun=All` validates without persisting. DELETE honours `preconditions`, accepts
//!   `propagationPolicy`; with finalizers it sets `deletionTimestamp` and the object goes when the last
//!   finalizer is removed. Pods answer DELETE with the object, other resources with a `Status`.
//! - Lists: `<Kind>List` sorted by namespace/name, label selectors (`=`, `==`, `!=`, `in`, `notin`, exists,
//!   `!key`, `>`, `<`), field selectors (`=`, `==`, `!=`; restricted to the fields the real server
//!   supports per resource, 400 otherwise), `limit`/`continue` (token expires with 410 once the history
//!   moves past its snapshot), `resourceVersion(Match)` accepted.
//! - Watches: replay from a bounded history ([`FakeApiOptions::history_limit`]),
//!   410 `ERROR` for too-old versions, bookmarks, `timeoutSeconds`, `sendInitialEvents`, selector
//!   transitions as `ADDED`/`DELETED`.
//! - `Accept: application/json;as=PartialObjectMetadata(List);g=meta.k8s.io;v=v1` gets metadata-only objects,
//!   lists and watch events.
//! - Errors are `metav1.Status` bodies with the real codes and reasons.
//!
//! # Faults and observation
//! [`FaultRule`]s (respond with a code, hang, delay; by verb/resource/namespace/name/subresource; for N
//! requests, a duration, or until cleared), [`FakeApiServer::drop_watches`], [`FakeApiServer::expire_watches`],
//! [`FakeApiServer::refuse_watches_for`], [`FakeApiServer::set_unavailable`], [`ServedFakeApi::stop`] /
//! [`ServedFakeApi::restart`]. Every request is recorded ([`RecordedRequest`], [`FakeApiServer::requests`]).
//!
//! [`create`]: FakeApiServer::create
//! [`get`]: FakeApiServer::get
//! [`modify`]: FakeApiServer::modify
//! [`patch_status`]: FakeApiServer::patch_status
//! [`bind_pod`]: FakeApiServer::bind_pod
//! [`delete`]: FakeApiServer::delete
//! [`wait_for`]: FakeApiServer::wait_for

mod apply;
mod dispatch;
mod error;
mod faults;
mod patch;
mod record;
mod resources;
mod routes;
mod select;
mod serve;
mod store;
mod watch;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use tokio::sync::watch as tokio_watch;

pub use error::{ApiStatus, StatusCause, StatusDetails, reason_for_code};
pub use faults::{FaultAction, FaultId, FaultRule, FaultTimes, Verb};
pub use patch::PatchType;
pub use record::{RecordedRequest, RequestFilter};
pub use resources::{CreateStatus, ListKind, ResourceDef};
pub use select::{FieldSelector, LabelSelector};
pub use serve::ServedFakeApi;

use crate::{Error, Result};
use faults::FaultPlan;
use record::RequestLog;
use select::Selectors;
use store::{Deleted, Store, WriteOpts};
use watch::DropMode;

/// Tunables of a [`FakeApiServer`].
#[derive(Clone, Debug)]
pub struct FakeApiOptions {
    /// Change events kept for watch resumption; older resourceVersions get 410 Gone. Default 10 000.
    pub history_limit: usize,
    /// Interval of `BOOKMARK` events on watches that allow them. Default 5 s.
    pub bookmark_interval: Duration,
    /// Watch length when the client sends no `timeoutSeconds`. Default 30 min.
    pub default_watch_timeout: Duration,
    /// Largest accepted request body. Default 3 MiB (the real server's limit).
    pub max_body_bytes: usize,
    /// Events buffered per watcher before a slow watcher is closed (it then resumes). Default 65 536.
    pub watch_buffer: usize,
    /// Record requests from the start. Default true.
    pub record_requests: bool,
}

impl Default for FakeApiOptions {
    fn default() -> Self {
        Self {
            history_limit: 10_000,
            bookmark_interval: Duration::from_secs(5),
            default_watch_timeout: Duration::from_secs(1800),
            max_body_bytes: 3 * 1024 * 1024,
            watch_buffer: 65_536,
            record_requests: true,
        }
    }
}

/// Shared state behind every handle, router and served listener.
pub(crate) struct Inner {
    pub store: Store,
    pub faults: Mutex<FaultPlan>,
    pub fault_epoch: tokio_watch::Sender<u64>,
    pub drops: tokio_watch::Sender<(u64, DropMode)>,
    pub open_watches: AtomicUsize,
    pub log: Mutex<RequestLog>,
    pub log_tx: tokio_watch::Sender<u64>,
    pub unavailable: AtomicBool,
    pub recording: AtomicBool,
    pub options: FakeApiOptions,
}

impl Inner {
    pub fn lock_faults(&self) -> MutexGuard<'_, FaultPlan> {
        self.faults.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn lock_log(&self) -> MutexGuard<'_, RequestLog> {
        self.log.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn record(&self, r: RecordedRequest) -> u64 {
        let seq = self.lock_log().push(r);
        self.log_tx.send_replace(seq);
        seq
    }

    pub fn set_response_code(&self, seq: u64, code: u16) {
        self.lock_log().set_code(seq, code);
        self.log_tx.send_modify(|_| {});
    }

    /// Waits until the hanging rule is released (removed or all faults cleared) or `max` elapsed.
    pub async fn hang(&self, id: u64, generation: u64, max: Option<Duration>) {
        let mut rx = self.fault_epoch.subscribe();
        let deadline = max.map(|d| tokio::time::Instant::now() + d);
        loop {
            if self.lock_faults().is_released(id, generation) {
                return;
            }
            let changed = match deadline {
                Some(d) => match tokio::time::timeout_at(d, rx.changed()).await {
                    Ok(r) => r,
                    Err(_) => return,
                },
                None => rx.changed().await,
            };
            if changed.is_err() {
                return;
            }
        }
    }

    fn drop_watches(&self, mode: DropMode) {
        self.drops.send_modify(|(n, m)| {
            *n += 1;
            *m = mode;
        });
    }
}

/// The fake API server: a clonable handle (`Arc`) on one store, fault plan and request log.
#[derive(Clone)]
pub struct FakeApiServer {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for FakeApiServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeApiServer")
            .field("resource_version", &self.resource_version())
            .field("open_watches", &self.open_watches())
            .finish_non_exhaustive()
    }
}

impl Default for FakeApiServer {
    fn default() -> Self {
        Self::new()
    }
}

fn to_value<T: Serialize + ?Sized>(obj: &T) -> Result<Value> {
    serde_json::to_value(obj).map_err(|e| Error::InvalidObject(e.to_string()))
}

impl FakeApiServer {
    /// A server with default options and the built-in resources, empty.
    pub fn new() -> Self {
        Self::with_options(FakeApiOptions::default())
    }

    /// A server with these options.
    pub fn with_options(options: FakeApiOptions) -> Self {
        let (fault_epoch, _) = tokio_watch::channel(0);
        let (drops, _) = tokio_watch::channel((0, DropMode::Close));
        let (log_tx, _) = tokio_watch::channel(0);
        Self {
            inner: Arc::new(Inner {
                store: Store::new(options.history_limit, options.watch_buffer),
                faults: Mutex::new(FaultPlan::default()),
                fault_epoch,
                drops,
                open_watches: AtomicUsize::new(0),
                log: Mutex::new(RequestLog::default()),
                log_tx,
                unavailable: AtomicBool::new(false),
                recording: AtomicBool::new(options.record_requests),
                options,
            }),
        }
    }

    /// The HTTP router (a `tower::Service`), usable with [`kube::Client::new`] or any hyper server.
    pub fn router(&self) -> axum::Router {
        routes::router(self.inner.clone())
    }

    /// A kube client talking to this server in-process (default namespace `default`). Needs a Tokio runtime.
    pub fn client(&self) -> kube::Client {
        kube::Client::new(self.router(), "default")
    }

    /// [`FakeApiServer::client`] sending `user_agent` (so the request log tells clients apart), for
    /// running many in-process clients without a socket each.
    pub fn client_as(&self, user_agent: &str) -> Result<kube::Client> {
        let value = http::HeaderValue::from_str(user_agent).map_err(|e| {
            Error::Kubeconfig(format!(
                "user agent {user_agent:?} is not a header value: {e}"
            ))
        })?;
        let service = tower::ServiceBuilder::new()
            .map_request(move |mut req: http::Request<kube::client::Body>| {
                req.headers_mut()
                    .insert(http::header::USER_AGENT, value.clone());
                req
            })
            .service(self.router());
        Ok(kube::Client::new(service, "default"))
    }

    /// Serves on `127.0.0.1` on an ephemeral port.
    pub async fn serve(&self) -> Result<ServedFakeApi> {
        self.serve_on(SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    /// Serves on `addr`.
    pub async fn serve_on(&self, addr: SocketAddr) -> Result<ServedFakeApi> {
        ServedFakeApi::start(self.clone(), addr).await
    }

    /// Adds (or replaces, by group/version/plural) a resource.
    pub fn register_resource(&self, def: ResourceDef) {
        self.inner
            .store
            .write(|st| st.register(def, None, resources::View::Identity));
    }

    /// The resources served.
    pub fn resources(&self) -> Vec<ResourceDef> {
        self.inner
            .store
            .read()
            .resources
            .iter()
            .map(|r| r.def.clone())
            .collect()
    }

    fn rid(&self, resource: &str) -> Result<usize> {
        self.inner
            .store
            .read()
            .resolve(resource)
            .ok_or_else(|| Error::UnknownResource(resource.to_string()))
    }

    /// The resource, namespace and name of `obj`, which `op` needs a `metadata.name` for.
    fn identity(&self, obj: &Value, op: &str) -> Result<(usize, Option<String>, String)> {
        let rid = self.rid_of(obj)?;
        let ns = obj
            .pointer("/metadata/namespace")
            .and_then(Value::as_str)
            .map(str::to_string);
        let name = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .ok_or_else(|| Error::InvalidObject(format!("{op} needs metadata.name")))?
            .to_string();
        Ok((rid, ns, name))
    }

    fn rid_of(&self, obj: &Value) -> Result<usize> {
        let av = obj.get("apiVersion").and_then(Value::as_str);
        let kind = obj.get("kind").and_then(Value::as_str);
        let (Some(av), Some(kind)) = (av, kind) else {
            return Err(Error::InvalidObject(
                "the object has no apiVersion/kind".into(),
            ));
        };
        self.inner
            .store
            .read()
            .find_kind(av, kind)
            .ok_or_else(|| Error::UnknownResource(format!("{av} {kind}")))
    }

    fn rid_typed<K: kube::Resource<DynamicType = ()>>(&self) -> Result<usize> {
        let (g, v, p) = (K::group(&()), K::version(&()), K::plural(&()));
        self.inner
            .store
            .read()
            .find(&g, &v, &p)
            .ok_or_else(|| Error::UnknownResource(format!("{p}.{g}/{v}")))
    }

    // ---- programmatic object access ----

    /// Creates an object (any `Serialize` with `apiVersion`/`kind`: k8s-openapi types, `DynamicObject`
    /// with types, `serde_json::Value`). Status, and a non-empty `metadata.uid`, are kept as given (fixtures
    /// carry deterministic UIDs that owner references name); over HTTP the server assigns the UID.
    /// Returns the stored object.
    pub fn create<T: Serialize + ?Sized>(&self, obj: &T) -> Result<Value> {
        let v = to_value(obj)?;
        let rid = self.rid_of(&v)?;
        Ok(self
            .inner
            .store
            .write(|st| st.create(rid, None, v, &WriteOpts::programmatic()))?)
    }

    /// Creates many objects under one lock (for large fixtures); returns how many were created.
    pub fn create_many<T: Serialize>(&self, objs: impl IntoIterator<Item = T>) -> Result<usize> {
        let values = objs
            .into_iter()
            .map(|o| {
                let v = to_value(&o)?;
                Ok((self.rid_of(&v)?, v))
            })
            .collect::<Result<Vec<_>>>()?;
        self.inner.store.write(|st| {
            let mut n = 0;
            for (rid, v) in values {
                st.create(rid, None, v, &WriteOpts::programmatic())?;
                n += 1;
            }
            Ok(n)
        })
    }

    /// Creates the object, or replaces it if it exists (no resourceVersion check; uid and creation time
    /// are kept).
    pub fn insert<T: Serialize + ?Sized>(&self, obj: &T) -> Result<Value> {
        let mut v = to_value(obj)?;
        let rid = self.rid_of(&v)?;
        Ok(self.inner.store.write(|st| {
            let ns = v
                .pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .map(str::to_string);
            let name = v
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            let ns = ns.as_deref().or(Some("default"));
            if !name.is_empty() && st.get(rid, ns, &name).is_some() {
                if let Some(m) = v.get_mut("metadata").and_then(Value::as_object_mut) {
                    m.remove("resourceVersion");
                }
                st.update(rid, ns, &name, None, v, &WriteOpts::programmatic())
            } else {
                st.create(rid, None, v, &WriteOpts::programmatic())
            }
        })?)
    }

    /// Replaces an object (status included); checked against its `metadata.resourceVersion` if set.
    pub fn update<T: Serialize + ?Sized>(&self, obj: &T) -> Result<Value> {
        let v = to_value(obj)?;
        let (rid, ns, name) = self.identity(&v, "update")?;
        Ok(self.inner.store.write(|st| {
            st.update(
                rid,
                ns.as_deref(),
                &name,
                None,
                v,
                &WriteOpts::programmatic(),
            )
        })?)
    }

    /// Atomically reads, changes (`f`) and writes back an object. Status included.
    pub fn modify(
        &self,
        resource: &str,
        namespace: Option<&str>,
        name: &str,
        f: impl FnOnce(&mut Value),
    ) -> Result<Value> {
        let rid = self.rid(resource)?;
        Ok(self.inner.store.write(|st| {
            let reg = st.resources[rid].clone();
            let cur = st
                .get(rid, namespace, name)
                .ok_or_else(|| ApiStatus::not_found(&reg.def.group, &reg.def.plural, name))?;
            let mut v = reg.to_view(&cur).into_owned();
            f(&mut v);
            if let Some(m) = v.get_mut("metadata").and_then(Value::as_object_mut) {
                m.remove("resourceVersion");
            }
            st.update(rid, namespace, name, None, v, &WriteOpts::programmatic())
        })?)
    }

    /// Patches an object (JSON, merge or strategic patch; anything, status included).
    pub fn patch(
        &self,
        resource: &str,
        namespace: Option<&str>,
        name: &str,
        patch_type: PatchType,
        patch: &Value,
    ) -> Result<Value> {
        let rid = self.rid(resource)?;
        if patch_type == PatchType::Apply {
            return Err(Error::InvalidObject(
                "use FakeApiServer::apply for server-side apply".into(),
            ));
        }
        Ok(self.inner.store.write(|st| {
            st.patch(
                rid,
                namespace,
                name,
                None,
                patch_type,
                patch,
                &WriteOpts::programmatic(),
            )
        })?)
    }

    /// Merge-patches only `.status` (the patch is whole-object shaped: `{"status": {...}}`).
    pub fn patch_status(
        &self,
        resource: &str,
        namespace: Option<&str>,
        name: &str,
        patch: &Value,
    ) -> Result<Value> {
        let rid = self.rid(resource)?;
        let Some(status) = patch.get("status") else {
            return Err(Error::InvalidObject(
                "patch_status takes a whole-object merge patch: {\"status\": {...}}".into(),
            ));
        };
        let patch = json!({ "status": status });
        Ok(self.inner.store.write(|st| {
            st.patch(
                rid,
                namespace,
                name,
                None,
                PatchType::Merge,
                &patch,
                &WriteOpts::programmatic(),
            )
        })?)
    }

    /// Server-side apply by `manager` (as a controller would send it), on the main resource or, with
    /// `subresource = Some("status")`, on `/status`. The object needs `apiVersion`, `kind`, `metadata.name`.
    pub fn apply<T: Serialize + ?Sized>(
        &self,
        obj: &T,
        subresource: Option<&str>,
        manager: &str,
        force: bool,
    ) -> Result<Value> {
        let v = to_value(obj)?;
        let (rid, ns, name) = self.identity(&v, "apply")?;
        let ns = ns.or_else(|| Some("default".to_string()));
        Ok(self
            .inner
            .store
            .write(|st| {
                st.apply(
                    rid,
                    ns.as_deref(),
                    &name,
                    subresource,
                    v,
                    manager,
                    force,
                    false,
                )
            })?
            .0)
    }

    /// Deletes an object. With finalizers it only gets a `deletionTimestamp`. Returns its last state.
    pub fn delete(&self, resource: &str, namespace: Option<&str>, name: &str) -> Result<Value> {
        let rid = self.rid(resource)?;
        let out = self
            .inner
            .store
            .write(|st| st.delete(rid, namespace, name, &store::DeleteOpts::default()))?;
        Ok(match out {
            Deleted::Gone(v) | Deleted::Pending(v) => v,
        })
    }

    /// Binds a pod to a node like the scheduler (sets `spec.nodeName` and `PodScheduled=True`); 409 if bound.
    pub fn bind_pod(&self, namespace: &str, name: &str, node: &str) -> Result<Value> {
        Ok(self
            .inner
            .store
            .write(|st| st.bind(namespace, name, node, false))?)
    }

    /// Sets a pod's `status.phase` (and `Ready` for `Running`) like a kubelet.
    pub fn set_pod_phase(&self, namespace: &str, name: &str, phase: &str) -> Result<Value> {
        self.modify("pods", Some(namespace), name, |p| {
            if !p.get("status").is_some_and(Value::is_object) {
                p["status"] = json!({});
            }
            p["status"]["phase"] = json!(phase);
            let ready = if phase == "Running" { "True" } else { "False" };
            store::set_condition(p, "Ready", ready);
        })
    }

    /// One object (in the resource's view), if present.
    pub fn get(&self, resource: &str, namespace: Option<&str>, name: &str) -> Option<Value> {
        let rid = self.rid(resource).ok()?;
        let st = self.inner.store.read();
        let reg = st.resources[rid].clone();
        st.get(rid, namespace, name)
            .map(|o| reg.to_view(&o).into_owned())
    }

    /// One object as a typed resource (`Pod`, `Node`, a `kube::CustomResource`).
    pub fn get_typed<K>(&self, namespace: Option<&str>, name: &str) -> Result<Option<K>>
    where
        K: kube::Resource<DynamicType = ()> + DeserializeOwned,
    {
        let rid = self.rid_typed::<K>()?;
        let st = self.inner.store.read();
        let reg = st.resources[rid].clone();
        st.get(rid, namespace, name)
            .map(|o| serde_json::from_value(reg.to_view(&o).into_owned()))
            .transpose()
            .map_err(|e| {
                Error::InvalidObject(format!(
                    "stored {} {name} does not deserialise: {e}",
                    reg.def.kind
                ))
            })
    }

    /// The `TeeCapacity` status of `node`, if its agent published one.
    pub fn tee_capacity_status(&self, node: &str) -> Option<teeguard_shared::TeeCapacityStatus> {
        self.get_typed::<teeguard_shared::TeeCapacity>(None, node)
            .ok()
            .flatten()
            .and_then(|t| t.status)
    }

    /// All objects of a resource (one namespace or all), sorted by namespace/name.
    pub fn list(&self, resource: &str, namespace: Option<&str>) -> Vec<Value> {
        self.list_selected(resource, namespace, "", "")
            .unwrap_or_default()
    }

    /// Objects matching a label selector and a field selector (`""` = everything). Unlike HTTP lists,
    /// the field selector may use any dotted path.
    pub fn list_selected(
        &self,
        resource: &str,
        namespace: Option<&str>,
        label_selector: &str,
        field_selector: &str,
    ) -> Result<Vec<Value>> {
        let rid = self.rid(resource)?;
        let st = self.inner.store.read();
        let reg = st.resources[rid].clone();
        let sel = Selectors {
            labels: LabelSelector::parse(label_selector)?,
            fields: FieldSelector::parse(field_selector, None)?,
        };
        Ok(st
            .all(rid, namespace, &sel)
            .iter()
            .map(|o| reg.to_view(o).into_owned())
            .collect())
    }

    /// All objects of a typed resource.
    pub fn list_typed<K>(&self, namespace: Option<&str>) -> Result<Vec<K>>
    where
        K: kube::Resource<DynamicType = ()> + DeserializeOwned,
    {
        let rid = self.rid_typed::<K>()?;
        let st = self.inner.store.read();
        let reg = st.resources[rid].clone();
        st.all(rid, namespace, &Selectors::default())
            .iter()
            .map(|o| {
                serde_json::from_value(reg.to_view(o).into_owned()).map_err(|e| {
                    Error::InvalidObject(format!(
                        "stored {} does not deserialise: {e}",
                        reg.def.kind
                    ))
                })
            })
            .collect()
    }

    /// Number of objects of a resource (0 for unknown resources).
    pub fn count(&self, resource: &str) -> usize {
        match self.rid(resource) {
            Ok(rid) => self.inner.store.read().count(rid),
            Err(_) => 0,
        }
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.inner.store.read().rv
    }

    /// Forgets the watch history: resuming from any current or older resourceVersion gets 410 Gone.
    pub fn compact(&self) {
        self.inner.store.write(|st| st.compact());
    }

    /// Waits until `check` returns `Some`, re-checking after every write (and every 20 ms); fails after
    /// `timeout`.
    pub async fn wait_for<T>(
        &self,
        timeout: Duration,
        what: &str,
        mut check: impl FnMut(&FakeApiServer) -> Option<T>,
    ) -> Result<T> {
        let mut rx = self.inner.store.rv_tx.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            rx.borrow_and_update();
            if let Some(v) = check(self) {
                return Ok(v);
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: what.to_string(),
                    after: timeout,
                    log: None,
                });
            }
            // Re-check after the next write, or after a short while for state outside the store
            // (open watches, request log).
            let _ = tokio::time::timeout_at(
                deadline.min(tokio::time::Instant::now() + Duration::from_millis(20)),
                rx.changed(),
            )
            .await;
        }
    }

    /// Waits until an object exists and satisfies `pred`; returns it.
    pub async fn wait_for_object(
        &self,
        resource: &str,
        namespace: Option<&str>,
        name: &str,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Result<Value> {
        let what = format!(
            "{resource} {}{name}",
            namespace.map(|n| format!("{n}/")).unwrap_or_default()
        );
        self.wait_for(timeout, &what, |s| {
            s.get(resource, namespace, name).filter(|o| pred(o))
        })
        .await
    }

    // ---- request log ----

    /// Every recorded request, oldest first.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.inner.lock_log().entries.clone()
    }

    /// Recorded requests passing a filter.
    pub fn requests_matching(&self, filter: &RequestFilter) -> Vec<RecordedRequest> {
        self.requests_where(|r| filter.matches(r))
    }

    /// Recorded requests for which `f` holds.
    pub fn requests_where(&self, f: impl Fn(&RecordedRequest) -> bool) -> Vec<RecordedRequest> {
        self.inner
            .lock_log()
            .entries
            .iter()
            .filter(|r| f(r))
            .cloned()
            .collect()
    }

    /// Forgets recorded requests.
    pub fn clear_requests(&self) {
        self.inner.lock_log().entries.clear();
    }

    /// Turns recording on or off (off for benchmarks).
    pub fn set_recording(&self, on: bool) {
        self.inner.recording.store(on, Ordering::SeqCst);
    }

    /// Waits for a request passing `filter` to have been answered; returns the first such request.
    pub async fn wait_for_request(
        &self,
        filter: &RequestFilter,
        timeout: Duration,
    ) -> Result<RecordedRequest> {
        let mut rx = self.inner.log_tx.subscribe();
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            rx.borrow_and_update();
            if let Some(r) = self
                .inner
                .lock_log()
                .entries
                .iter()
                .find(|r| filter.matches(r) && r.response_code.is_some())
            {
                return Ok(r.clone());
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                _ => {
                    return Err(Error::Timeout {
                        what: format!("a request matching {filter:?}"),
                        after: timeout,
                        log: None,
                    });
                }
            }
        }
    }

    // ---- faults ----

    /// Arms a fault rule; the first matching armed rule applies to each request.
    pub fn add_fault(&self, rule: FaultRule) -> FaultId {
        self.inner.lock_faults().add(rule)
    }

    /// Disarms a rule and releases requests it hung.
    pub fn remove_fault(&self, id: FaultId) {
        self.inner.lock_faults().remove(id);
        self.inner.fault_epoch.send_modify(|n| *n += 1);
    }

    /// Disarms every rule and releases every hung request.
    pub fn clear_faults(&self) {
        self.inner.lock_faults().clear();
        self.inner.fault_epoch.send_modify(|n| *n += 1);
    }

    /// Number of armed fault rules (exhausted and expired ones drop out as requests arrive).
    pub fn armed_faults(&self) -> usize {
        self.inner.lock_faults().len()
    }

    /// Ends every open watch stream now, and every watch request already received as soon as its
    /// stream starts (clients see the stream end and re-watch).
    pub fn drop_watches(&self) {
        self.inner.drop_watches(DropMode::Close);
    }

    /// Sends every open watch an `ERROR` event with 410 Gone and ends it (clients must re-list).
    pub fn expire_watches(&self) {
        self.inner.drop_watches(DropMode::Expire);
    }

    /// Ends every open watch and answers new watches with 503 for `d`.
    pub fn refuse_watches_for(&self, d: Duration) -> FaultId {
        let id = self.add_fault(
            FaultRule::respond(503)
                .verb(Verb::Watch)
                .message("watches refused by the test")
                .for_duration(d),
        );
        self.drop_watches();
        id
    }

    /// Whole-server outage switch: while on, every request gets 503 and open watches are ended.
    pub fn set_unavailable(&self, on: bool) {
        self.inner.unavailable.store(on, Ordering::SeqCst);
        if on {
            self.drop_watches();
        }
    }

    /// Number of open watch streams.
    pub fn open_watches(&self) -> usize {
        self.inner.open_watches.load(Ordering::SeqCst)
    }
}
