//! Watches: newline-delimited JSON events streamed as a chunked body.
//!
//! A watch from `resourceVersion` N replays the history after N and then follows live events; from an
//! unset or `"0"` resourceVersion (or with `sendInitialEvents=true`) it starts with a synthetic `ADDED` for
//! every current object. A resourceVersion older than the history window yields one `ERROR` event with a
//! 410 `Expired` Status, then the stream ends. With selectors, objects moving into/out of the selection
//! produce `ADDED`/`DELETED`, like the real server.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::broadcast::error::RecvError;

use super::Inner;
use super::error::ApiStatus;
use super::resources::Registered;
use super::select::Selectors;
use super::store::{EventKind, StoredEvent};

/// How open watches are ended by [`FakeApiServer::drop_watches`](super::FakeApiServer::drop_watches) and
/// [`FakeApiServer::expire_watches`](super::FakeApiServer::expire_watches).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DropMode {
    /// The stream just ends (connection drop / server restart).
    Close,
    /// An `ERROR` event with 410 Gone, then the end.
    Expire,
}

/// A parsed watch request.
#[derive(Debug)]
pub(crate) struct WatchRequest {
    pub rid: usize,
    pub namespace: Option<String>,
    pub selectors: Selectors,
    pub resource_version: Option<String>,
    pub send_initial_events: bool,
    pub bookmarks: bool,
    pub timeout: Duration,
    pub metadata_only: bool,
}

enum Initial {
    Object(Arc<Value>),
    Event(Arc<StoredEvent>),
}

enum Step {
    Event(Result<Arc<StoredEvent>, RecvError>),
    Bookmark,
    Dropped(DropMode),
    End,
}

/// The object as sent: the resource's view, or `PartialObjectMetadata`.
pub(crate) fn shaped(reg: &Registered, obj: &Value, metadata_only: bool) -> Value {
    if metadata_only {
        partial_metadata(obj)
    } else {
        reg.to_view(obj).into_owned()
    }
}

/// `{apiVersion: meta.k8s.io/v1, kind: PartialObjectMetadata, metadata}`.
pub(crate) fn partial_metadata(obj: &Value) -> Value {
    json!({
        "apiVersion": "meta.k8s.io/v1",
        "kind": "PartialObjectMetadata",
        "metadata": obj.get("metadata").cloned().unwrap_or_else(|| json!({})),
    })
}

fn line(kind: &str, obj: &Value) -> Bytes {
    let mut out = Vec::with_capacity(512);
    out.extend_from_slice(b"{\"type\":\"");
    out.extend_from_slice(kind.as_bytes());
    out.extend_from_slice(b"\",\"object\":");
    if let Err(e) = serde_json::to_writer(&mut out, obj) {
        tracing::error!(error = %e, "fake API server: serialising a watch event failed");
    }
    out.extend_from_slice(b"}\n");
    Bytes::from(out)
}

fn bookmark(reg: &Registered, rv: u64, initial_end: bool, metadata_only: bool) -> Bytes {
    let (api_version, kind) = if metadata_only {
        (
            "meta.k8s.io/v1".to_string(),
            "PartialObjectMetadata".to_string(),
        )
    } else {
        (reg.def.api_version(), reg.def.kind.clone())
    };
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    line(
        "BOOKMARK",
        &json!({"apiVersion": api_version, "kind": kind, "metadata": meta}),
    )
}

fn error_line(status: &ApiStatus) -> Bytes {
    line("ERROR", &status.to_json())
}

/// The line for a stored event as seen by this watch, if it passes the filters.
fn event_line(
    reg: &Registered,
    ev: &StoredEvent,
    ns: Option<&str>,
    sel: &Selectors,
    metadata_only: bool,
) -> Option<Bytes> {
    if ev.storage != reg.storage {
        return None;
    }
    if let Some(ns) = ns
        && reg.def.namespaced
        && ev.namespace != ns
    {
        return None;
    }
    let kind = if sel.is_empty() {
        ev.kind.as_str()
    } else {
        let now = sel.matches(&reg.to_view(&ev.object));
        match ev.kind {
            EventKind::Added | EventKind::Deleted => {
                if !now {
                    return None;
                }
                ev.kind.as_str()
            }
            EventKind::Modified => {
                let before = ev
                    .prev
                    .as_ref()
                    .is_some_and(|p| sel.matches(&reg.to_view(p)));
                match (before, now) {
                    (true, true) => "MODIFIED",
                    (false, true) => "ADDED",
                    (true, false) => "DELETED",
                    (false, false) => return None,
                }
            }
        }
    };
    Some(line(kind, &shaped(reg, &ev.object, metadata_only)))
}

struct OpenWatch(Arc<Inner>);

impl OpenWatch {
    fn new(inner: Arc<Inner>) -> Self {
        inner.open_watches.fetch_add(1, Ordering::SeqCst);
        Self(inner)
    }
}

impl Drop for OpenWatch {
    fn drop(&mut self) {
        self.0.open_watches.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Starts a watch that ends at the first drop `drop_rx` has not seen (taken when the request
/// arrived); errors before the stream starts are plain HTTP errors.
pub(crate) fn start(
    inner: Arc<Inner>,
    req: WatchRequest,
    mut drop_rx: tokio::sync::watch::Receiver<(u64, DropMode)>,
) -> Result<Response, ApiStatus> {
    let mut store_rv = inner.store.rv_tx.subscribe();
    let (reg, initial, gone, mut rx, start_rv) = {
        let st = inner.store.read();
        let reg = st.resources[req.rid].clone();
        let rx = inner.store.dispatch.subscribe(reg.storage, &req.selectors);
        let cur = st.rv;
        let rv_param = req.resource_version.as_deref().filter(|s| !s.is_empty());
        let mut initial = Vec::new();
        let mut gone = None;
        if req.send_initial_events || rv_param.is_none() || rv_param == Some("0") {
            initial = st
                .all(req.rid, req.namespace.as_deref(), &req.selectors)
                .into_iter()
                .map(Initial::Object)
                .collect();
        } else {
            let rv: u64 = rv_param.unwrap_or("0").parse().map_err(|_| {
                ApiStatus::bad_request(format!(
                    "resourceVersion: Invalid value: {:?}: must be an integer",
                    rv_param
                ))
            })?;
            if rv < st.compacted {
                gone = Some(ApiStatus::gone(format!(
                    "too old resource version: {rv} ({})",
                    st.compacted + 1
                )));
            } else {
                let from = st.history.partition_point(|e| e.rv <= rv);
                initial = st
                    .history
                    .range(from..)
                    .filter(|e| e.storage == reg.storage)
                    .cloned()
                    .map(Initial::Event)
                    .collect();
            }
        }
        (reg, initial, gone, rx, cur)
    };
    let every = inner
        .options
        .bookmark_interval
        .max(Duration::from_millis(10));
    let guard = OpenWatch::new(inner);
    let WatchRequest {
        namespace,
        selectors,
        send_initial_events,
        bookmarks,
        timeout,
        metadata_only,
        ..
    } = req;
    let stream = async_stream::stream! {
        let _guard = guard;
        let ns = namespace.as_deref();
        for item in initial {
            let l = match item {
                Initial::Object(o) => Some(line("ADDED", &shaped(&reg, &o, metadata_only))),
                Initial::Event(ev) => event_line(&reg, &ev, ns, &selectors, metadata_only),
            };
            if let Some(l) = l {
                yield Ok::<Bytes, Infallible>(l);
            }
        }
        if let Some(g) = gone {
            yield Ok(error_line(&g));
            return;
        }
        if send_initial_events {
            yield Ok(bookmark(&reg, start_rv, true, metadata_only));
        }
        let mut last_rv = start_rv;
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
        loop {
            let step = tokio::select! {
                r = rx.recv() => Step::Event(r),
                _ = &mut deadline => Step::End,
                _ = ticker.tick(), if bookmarks => Step::Bookmark,
                r = drop_rx.changed() => match r {
                    Ok(()) => Step::Dropped(drop_rx.borrow_and_update().1),
                    Err(_) => Step::End,
                },
            };
            match step {
                Step::Event(Ok(ev)) => {
                    last_rv = ev.rv;
                    if let Some(l) = event_line(&reg, &ev, ns, &selectors, metadata_only) {
                        yield Ok(l);
                    }
                }
                // A watcher that fell behind is closed; the client resumes from its last resourceVersion.
                Step::Event(Err(_)) => break,
                // Like the real server's, a bookmark carries the store's progress, not just the last
                // event this watch was sent: a watch of one node sees few events, and a resume from its
                // last event's resourceVersion would be answered 410 Gone once the history moved on.
                // Read the progress first, then check nothing routed here is still queued: every event
                // up to it was sent to the channels before it was published.
                Step::Bookmark => {
                    let progress = *store_rv.borrow_and_update();
                    if rx.is_empty() {
                        last_rv = last_rv.max(progress);
                    }
                    yield Ok(bookmark(&reg, last_rv, false, metadata_only));
                }
                Step::Dropped(DropMode::Expire) => {
                    yield Ok(error_line(&ApiStatus::gone(format!("too old resource version: {last_rv}"))));
                    break;
                }
                Step::Dropped(DropMode::Close) | Step::End => break,
            }
        }
    };
    Response::builder()
        .status(200)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(stream))
        .map_err(|e| ApiStatus::new(500, format!("building the watch response: {e}")))
}
