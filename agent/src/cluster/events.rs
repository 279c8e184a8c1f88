//! Warning Events on pods whose key limit was not what teeguard's annotation said, could not be
//! applied or was not set (a kind without capacity here), and on pods whose cgroup the kernel refused
//! a key in, so `kubectl describe pod` says why. Off the hot path: callers put the Event on a bounded
//! queue (never blocking; a full queue drops it, logged); one task writes them with kube's
//! [`Recorder`]. At most one Event per pod and reason.

use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Api, Client};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::cached::static_pod_uid;

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

/// The UID of `pod`'s API object, which `kubectl describe pod` lists Events by: the pod's own, or for
/// a static pod, which the node runs under its manifest's hash (not a UUID, as the API server's UIDs
/// are), its mirror pod's (one GET of its metadata; the hash when it cannot be read).
async fn api_uid(client: &Client, pod: &PodRef) -> String {
    if uuid_shaped(&pod.uid) {
        return pod.uid.clone();
    }
    let api = Api::<Pod>::namespaced(client.clone(), &pod.namespace);
    let read = tokio::time::timeout(MIRROR_READ_TIMEOUT, api.get_metadata_opt(&pod.name)).await;
    let mirror = match read {
        Ok(Ok(found)) => found,
        Ok(Err(e)) => {
            tracing::debug!(pod = %format!("{}/{}", pod.namespace, pod.name), error = %e, "cannot read the static pod's mirror pod; its Event names the static pod's hash");
            None
        }
        Err(_) => {
            tracing::debug!(pod = %format!("{}/{}", pod.namespace, pod.name), "no answer for the static pod's mirror pod; its Event names the static pod's hash");
            None
        }
    };
    mirror
        .filter(|m| static_pod_uid(m.metadata.annotations.as_ref()) == Some(&pod.uid))
        .and_then(|m| m.metadata.uid)
        .unwrap_or_else(|| pod.uid.clone())
}

/// The longest the read of a static pod's mirror pod may hold the Event queue up.
const MIRROR_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Whether `uid` has the shape of the API server's UIDs (`8-4-4-4-12` hexadecimal digits).
fn uuid_shaped(uid: &str) -> bool {
    let groups: Vec<&str> = uid.split('-').collect();
    groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12])
        && groups
            .iter()
            .all(|g| g.bytes().all(|b| b.is_ascii_hexdigit()))
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
        let recorder = Recorder::new(client.clone(), reporter);
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
                    uid: Some(api_uid(&client, &pod).await),
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

#[cfg(test)]
mod tests {
    use super::uuid_shaped;

    #[test]
    fn api_uids_are_told_from_static_pod_hashes() {
        assert!(uuid_shaped("3f1c2b4a-9d8e-4f7a-b6c5-0123456789ab"));
        assert!(
            !uuid_shaped("6d1b9e0c2f4a8b3e5c7d9f1a2b4c6e8f"),
            "a static pod's hash"
        );
        assert!(!uuid_shaped("3f1c2b4a-9d8e-4f7a-b6c5-0123456789ag"));
        assert!(!uuid_shaped(""));
    }
}
