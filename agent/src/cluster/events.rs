//! Warning Events on pods whose key limit was not what teeguard's annotation said, could not be
//! applied or was not set (a kind without capacity here), and on pods whose cgroup the kernel refused
//! a key in, so `kubectl describe pod` says why. Off the hot path: callers put the Event on a bounded
//! queue (never blocking; a full queue drops it, logged); one task writes them with kube's
//! [`Recorder`]. At most one Event per pod and reason.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Events waiting to be written, at most.
pub const QUEUE: usize = 64;
/// Event reason: the annotation disagreed with the requests.
pub const REASON_MISMATCH: &str = "TEEKeyLimitMismatch";
/// Event reason: the limit could not be applied.
pub const REASON_FAILED: &str = "TEEKeyLimitFailed";
/// Event reason: the kernel refused a key charged in the pod's cgroup (its `misc.events` rose).
pub const REASON_REFUSED: &str = "TEEKeyRefused";
/// Event reason: the pod requests a kind of key this host has no capacity for, so no `misc.max` is
/// set for it (the kernel would refuse the line, and the runtime the container).
pub const REASON_KIND_UNAVAILABLE: &str = "TEEKeyKindUnavailable";

/// The pod an Event is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodRef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: String,
}

/// Where Events are queued. Cheap to clone.
#[derive(Clone, Debug)]
pub struct EventSink {
    tx: Option<mpsc::Sender<(PodRef, &'static str, String)>>,
    sent: Arc<Mutex<HashSet<(String, &'static str)>>>,
}

impl EventSink {
    /// A sink writing through `client` as `teeguard-agent` on `node`.
    pub fn start(client: Client, node: &str, shutdown: CancellationToken) -> EventSink {
        let (tx, mut rx) = mpsc::channel::<(PodRef, &'static str, String)>(QUEUE);
        let reporter = Reporter {
            controller: teeguard_shared::names::AGENT_FIELD_MANAGER.into(),
            instance: Some(node.to_string()),
        };
        let recorder = Recorder::new(client, reporter);
        tokio::spawn(async move {
            loop {
                let item = tokio::select! {
                    () = shutdown.cancelled() => return,
                    item = rx.recv() => item,
                };
                let Some((pod, reason, note)) = item else {
                    return;
                };
                let reference = ObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    namespace: Some(pod.namespace.clone()),
                    name: Some(pod.name.clone()),
                    uid: Some(pod.uid.clone()),
                    ..ObjectReference::default()
                };
                let event = Event {
                    type_: EventType::Warning,
                    reason: reason.into(),
                    note: Some(note),
                    action: "ApplyKeyLimit".into(),
                    secondary: None,
                };
                if let Err(e) = recorder.publish(&event, &reference).await {
                    tracing::warn!(pod = %format!("{}/{}", pod.namespace, pod.name), error = %e, "cannot write the pod's Event");
                }
            }
        });
        EventSink {
            tx: Some(tx),
            sent: Arc::default(),
        }
    }

    /// A sink that only logs (tests of the decisions, the `scan` subcommand).
    pub fn disabled() -> EventSink {
        EventSink {
            tx: None,
            sent: Arc::default(),
        }
    }

    /// Queue a Warning Event on `pod`, once per pod and reason.
    pub fn warn(&self, pod: PodRef, reason: &'static str, note: String) {
        let Some(tx) = &self.tx else { return };
        {
            let mut sent = self.sent.lock().unwrap_or_else(PoisonError::into_inner);
            if sent.len() > 4096 {
                sent.clear();
            }
            if !sent.insert((pod.uid.clone(), reason)) {
                return;
            }
        }
        if tx.try_send((pod, reason, note)).is_err() {
            tracing::warn!("the Event queue is full; an Event was dropped");
        }
    }
}
