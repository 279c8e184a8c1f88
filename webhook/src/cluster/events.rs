//! `InsufficientTEEKeys` Events on the VMI whose pod was refused, so `kubectl describe vmi` says why its
//! pod is not scheduled; `TEEKeyFree` Events on a VMI teeguard retried once a key was free for it.
//!
//! Off the hot path: a review only puts the Event on a bounded queue ([`EventSink::record`], never
//! blocks, never fails the review); one background task writes them with kube's
//! [`kube::runtime::events::Recorder`] (`events.k8s.io/v1`; a repeat of the same Event within
//! a few minutes becomes a series patch). The scheduler retries a refused binding every 1–10 s, so each
//! VMI gets at most one Event per [`EVENT_MIN_INTERVAL`]; further ones are counted as suppressed. A full
//! queue drops the Event (counted, logged); a failed write is logged and counted.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use teeguard_shared::names;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::decide::mutation::VmiRef;
use crate::metrics::{EventResult, Metrics};

/// Events waiting to be written, at most.
pub const EVENT_QUEUE: usize = 256;
/// At most one Event per VMI this often.
pub const EVENT_MIN_INTERVAL: Duration = Duration::from_secs(30);
/// The `InsufficientTEEKeys` Event's `action`.
pub const EVENT_ACTION: &str = "AdmitPod";
/// The `TEEKeyFree` Event's `action`.
pub const RETRY_ACTION: &str = "RetryVMI";
/// Longest Event note the API server accepts (bytes).
pub const MAX_NOTE_BYTES: usize = 1024;

/// Which Event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VmiEventKind {
    /// Warning `InsufficientTEEKeys`: the VMI's pod was refused.
    InsufficientKeys,
    /// Normal `TEEKeyFree`: a key is free for the waiting VMI and teeguard had KubeVirt retry it.
    KeyFree,
}

impl VmiEventKind {
    /// Its reason, type and action.
    fn describe(self) -> (&'static str, EventType, &'static str) {
        match self {
            VmiEventKind::InsufficientKeys => (
                names::reasons::INSUFFICIENT_TEE_KEYS,
                EventType::Warning,
                EVENT_ACTION,
            ),
            VmiEventKind::KeyFree => (
                names::reasons::TEE_KEY_FREE,
                EventType::Normal,
                RETRY_ACTION,
            ),
        }
    }
}

/// One Event to write.
#[derive(Clone, Debug, PartialEq)]
pub struct VmiEvent {
    /// The VMI (`kubevirt.io/v1` `VirtualMachineInstance`, namespace, name, uid).
    pub vmi: ObjectReference,
    /// Which Event.
    pub kind: VmiEventKind,
    /// The denial message, or what was retried.
    pub message: String,
}

/// At most one Event per key per interval (pure; time is an input).
#[derive(Debug)]
pub struct RateLimiter {
    interval: Duration,
    last: HashMap<String, Instant>,
}

/// Entries kept before old ones are swept.
const LIMITER_SWEEP_AT: usize = 4096;

impl RateLimiter {
    /// A limiter allowing one event per key per `interval`.
    pub fn new(interval: Duration) -> Self {
        RateLimiter {
            interval,
            last: HashMap::new(),
        }
    }

    /// Whether an event for `key` may go out at `now`; if so it counts as sent.
    pub fn allow(&mut self, key: &str, now: Instant) -> bool {
        if let Some(at) = self.last.get(key)
            && now.saturating_duration_since(*at) < self.interval
        {
            return false;
        }
        if self.last.len() >= LIMITER_SWEEP_AT {
            let interval = self.interval;
            self.last
                .retain(|_, at| now.saturating_duration_since(*at) < interval);
        }
        self.last.insert(key.to_string(), now);
        true
    }

    /// Forget `key` (its event was not sent after all).
    pub fn forget(&mut self, key: &str) {
        self.last.remove(key);
    }
}

/// Where reviews put Events. Cheap to clone.
#[derive(Clone, Debug)]
pub struct EventSink {
    tx: mpsc::Sender<VmiEvent>,
    limiter: Arc<Mutex<RateLimiter>>,
    metrics: Arc<Metrics>,
}

/// The reference an Event about `vmi` names.
pub fn vmi_reference(vmi: &VmiRef) -> ObjectReference {
    ObjectReference {
        api_version: Some("kubevirt.io/v1".into()),
        kind: Some("VirtualMachineInstance".into()),
        namespace: Some(vmi.namespace.clone()),
        name: Some(vmi.name.clone()),
        uid: (!vmi.uid.is_empty()).then(|| vmi.uid.clone()),
        ..ObjectReference::default()
    }
}

fn vmi_key(r: &ObjectReference) -> String {
    format!(
        "{}/{}/{}",
        r.namespace.as_deref().unwrap_or(""),
        r.name.as_deref().unwrap_or(""),
        r.uid.as_deref().unwrap_or("")
    )
}

/// Cut `s` to at most `max` bytes on a character boundary.
pub fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

impl EventSink {
    /// Start the writer task (it ends when `shutdown` is cancelled; queued Events are then dropped).
    /// `instance` names this replica in `reportingInstance` (the pod name).
    pub fn start(
        client: Client,
        instance: Option<String>,
        metrics: Arc<Metrics>,
        api_timeout: Duration,
        shutdown: CancellationToken,
    ) -> (EventSink, JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(EVENT_QUEUE);
        let recorder = Recorder::new(
            client,
            Reporter {
                controller: names::WEBHOOK_FIELD_MANAGER.to_string(),
                instance,
            },
        );
        let task = tokio::spawn(write_events(
            rx,
            recorder,
            metrics.clone(),
            api_timeout,
            shutdown,
        ));
        (
            EventSink {
                tx,
                limiter: Arc::new(Mutex::new(RateLimiter::new(EVENT_MIN_INTERVAL))),
                metrics,
            },
            task,
        )
    }

    /// Queue an Event unless the VMI got one of its kind recently or the queue is full. Never blocks.
    pub fn record(&self, event: VmiEvent) -> EventResult {
        let key = format!("{}/{}", vmi_key(&event.vmi), event.kind.describe().0);
        let allowed = self
            .limiter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .allow(&key, Instant::now());
        if !allowed {
            self.metrics.vmi_event(EventResult::Suppressed);
            return EventResult::Suppressed;
        }
        match self.tx.try_send(event) {
            Ok(()) => EventResult::Recorded,
            Err(e) => {
                self.limiter
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .forget(&key);
                self.metrics.vmi_event(EventResult::Dropped);
                tracing::warn!(vmi = key, error = %e, "event queue full; VMI event dropped");
                EventResult::Dropped
            }
        }
    }
}

async fn write_events(
    mut rx: mpsc::Receiver<VmiEvent>,
    recorder: Recorder,
    metrics: Arc<Metrics>,
    api_timeout: Duration,
    shutdown: CancellationToken,
) {
    loop {
        let event = tokio::select! {
            _ = shutdown.cancelled() => break,
            e = rx.recv() => match e {
                Some(e) => e,
                None => break,
            },
        };
        let (reason, type_, action) = event.kind.describe();
        let ev = Event {
            type_,
            reason: reason.to_string(),
            note: Some(truncate(&event.message, MAX_NOTE_BYTES).to_string()),
            action: action.to_string(),
            secondary: None,
        };
        let vmi = vmi_key(&event.vmi);
        let action = || format!("recording a {reason} Event on VMI {vmi}");
        let published = recorder.publish(&ev, &event.vmi);
        match super::bounded(action, api_timeout, published).await {
            Ok(()) => {
                metrics.vmi_event(EventResult::Recorded);
                tracing::debug!(vmi, reason, "VMI event recorded");
            }
            Err(e) => {
                metrics.vmi_event(EventResult::Failed);
                tracing::warn!(vmi, reason, error = %e, "cannot record the VMI event");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_event_per_vmi_per_interval() {
        let mut l = RateLimiter::new(Duration::from_secs(30));
        let t0 = Instant::now();
        assert!(l.allow("ns/a/u", t0));
        assert!(!l.allow("ns/a/u", t0 + Duration::from_secs(1)));
        assert!(!l.allow("ns/a/u", t0 + Duration::from_secs(29)));
        assert!(l.allow("ns/b/u", t0 + Duration::from_secs(1)), "other VMI");
        assert!(l.allow("ns/a/u", t0 + Duration::from_secs(30)));
        l.forget("ns/a/u");
        assert!(l.allow("ns/a/u", t0 + Duration::from_secs(31)));
        assert_eq!(l.last.len(), 2);
    }

    #[test]
    fn limiter_memory_is_bounded() {
        let mut l = RateLimiter::new(Duration::from_secs(30));
        let t0 = Instant::now();
        for i in 0..LIMITER_SWEEP_AT {
            assert!(l.allow(&format!("k{i}"), t0));
        }
        // Once full and the old entries have aged out, they are swept.
        assert!(l.allow("new", t0 + Duration::from_secs(31)));
        assert_eq!(l.last.len(), 1);
    }

    #[test]
    fn truncation_keeps_characters_whole() {
        assert_eq!(truncate("abc", 10), "abc");
        assert_eq!(truncate("abc", 2), "ab");
        assert_eq!(truncate("aé", 2), "a");
        assert_eq!(
            truncate(&"x".repeat(2000), MAX_NOTE_BYTES).len(),
            MAX_NOTE_BYTES
        );
    }
}
