//! Routing committed changes to open watches.
//!
//! Like the real API server's watch cache, which indexes pods by `spec.nodeName` so that 5,000
//! kubelets are not each handed every pod change in the cluster, a watch whose field selector
//! requires `metadata.name=X` or `spec.nodeName=X` subscribes to the changes of objects that had or
//! have that value only; every other watch subscribes to all changes of its storage. The watch still
//! applies its own selectors to what it receives (an object moving out of the selection becomes a
//! `DELETED`), so routing changes what a watch is woken for, never what it sends.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::broadcast;

use super::select::{Selectors, field_value};
use super::store::StoredEvent;

/// Field paths whose equality selectors get their own channel.
const INDEXED_FIELDS: [&str; 2] = ["metadata.name", "spec.nodeName"];

/// Events buffered per indexed channel: one node's or one object's changes, few at a time. Each
/// channel allocates its slots up front, so thousands of them must stay small.
const INDEXED_BUFFER: usize = 256;

#[derive(Clone, Debug, Hash, PartialEq, Eq)]
enum Route {
    /// Every change of one storage.
    All(usize),
    /// Changes of objects of one storage whose field had or has this value.
    Field(usize, &'static str, String),
}

/// The channels of the open watches, created when the first watch needs one and dropped when the
/// last one ends.
#[derive(Debug)]
pub(crate) struct Dispatch {
    buffer: usize,
    channels: Mutex<HashMap<Route, broadcast::Sender<Arc<StoredEvent>>>>,
}

impl Dispatch {
    /// `buffer`: events buffered per all-changes channel before a slow watch is closed.
    pub fn new(buffer: usize) -> Self {
        Dispatch {
            buffer: buffer.max(16),
            channels: Mutex::new(HashMap::new()),
        }
    }

    /// A receiver of the changes a watch on `storage` with `selectors` needs.
    pub fn subscribe(
        &self,
        storage: usize,
        selectors: &Selectors,
    ) -> broadcast::Receiver<Arc<StoredEvent>> {
        let (route, buffer) = match INDEXED_FIELDS
            .iter()
            .find_map(|f| selectors.fields.required(f).map(|v| (*f, v)))
        {
            Some((field, value)) => (
                Route::Field(storage, field, value.to_string()),
                self.buffer.min(INDEXED_BUFFER),
            ),
            None => (Route::All(storage), self.buffer),
        };
        let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        channels
            .entry(route)
            .or_insert_with(|| broadcast::channel(buffer).0)
            .subscribe()
    }

    /// Hands `ev` to every channel that routes it; channels whose watches have all ended are dropped.
    pub fn publish(&self, ev: &Arc<StoredEvent>) {
        let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        if channels.is_empty() {
            return;
        }
        let mut routes = vec![Route::All(ev.storage)];
        for field in INDEXED_FIELDS {
            let now = field_value(&ev.object, field);
            if let Some(prev) = &ev.prev {
                let before = field_value(prev, field);
                if before != now {
                    routes.push(Route::Field(ev.storage, field, before));
                }
            }
            routes.push(Route::Field(ev.storage, field, now));
        }
        for route in routes {
            if let Some(tx) = channels.get(&route)
                && tx.send(ev.clone()).is_err()
            {
                channels.remove(&route);
            }
        }
    }

    /// Open channels (for tests).
    #[cfg(test)]
    fn len(&self) -> usize {
        self.channels
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fakeapi::select::FieldSelector;
    use crate::fakeapi::store::EventKind;
    use serde_json::{Value, json};

    fn selectors(fields: &str) -> Selectors {
        Selectors {
            fields: FieldSelector::parse(fields, None).expect("selector"),
            ..Selectors::default()
        }
    }

    fn pod_event(node: &str, prev_node: Option<&str>) -> Arc<StoredEvent> {
        let pod = |n: &str| -> Arc<Value> {
            Arc::new(json!({"metadata": {"name": "p", "namespace": "ns"}, "spec": {"nodeName": n}}))
        };
        Arc::new(StoredEvent {
            rv: 1,
            storage: 0,
            kind: if prev_node.is_some() {
                EventKind::Modified
            } else {
                EventKind::Added
            },
            namespace: "ns".into(),
            object: pod(node),
            prev: prev_node.map(pod),
        })
    }

    #[test]
    fn a_node_scoped_watch_gets_only_its_nodes_changes_including_moves_in_and_out() {
        let d = Dispatch::new(1024);
        let mut a = d.subscribe(0, &selectors("spec.nodeName=node-a"));
        let mut b = d.subscribe(0, &selectors("spec.nodeName=node-b"));
        let mut all = d.subscribe(0, &Selectors::default());
        let other_storage = d.subscribe(1, &Selectors::default());
        d.publish(&pod_event("node-a", None));
        d.publish(&pod_event("node-b", Some("node-a")));
        d.publish(&pod_event("", None));
        assert_eq!(a.len(), 2, "added on node-a, moved away from node-a");
        assert_eq!(b.len(), 1, "moved onto node-b");
        assert_eq!(all.len(), 3);
        assert_eq!(other_storage.len(), 0);
        assert!(a.try_recv().is_ok() && b.try_recv().is_ok() && all.try_recv().is_ok());
    }

    #[test]
    fn a_name_scoped_watch_and_an_unselected_value_are_routed_by_equality_only() {
        let d = Dispatch::new(1024);
        let named = d.subscribe(0, &selectors("metadata.name=p"));
        let not_equal = d.subscribe(0, &selectors("spec.nodeName!=node-a"));
        let unscheduled = d.subscribe(0, &selectors("spec.nodeName="));
        d.publish(&pod_event("node-a", None));
        d.publish(&pod_event("", None));
        assert_eq!(named.len(), 2);
        assert_eq!(
            not_equal.len(),
            2,
            "`!=` is not indexed: it sees every change"
        );
        assert_eq!(unscheduled.len(), 1, "a missing or empty field is \"\"");
    }

    #[test]
    fn channels_whose_watches_ended_are_dropped() {
        let d = Dispatch::new(1024);
        let rx = d.subscribe(0, &selectors("spec.nodeName=node-a"));
        let keep = d.subscribe(0, &Selectors::default());
        assert_eq!(d.len(), 2);
        drop(rx);
        d.publish(&pod_event("node-a", None));
        assert_eq!(d.len(), 1);
        drop(keep);
    }
}
