//! The webhook's Prometheus metrics (served on the admin port's `/metrics`).

use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// How a review ended.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Outcome {
    /// Allowed untouched.
    Allowed,
    /// Allowed with a patch.
    Patched,
    /// Denied.
    Denied,
    /// Not answered with a review (bad request, too large, internal error).
    Error,
}

/// Result of a certificate reload attempt.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum ReloadResult {
    /// A new pair was loaded and is served.
    Ok,
    /// The pair on disk is unusable; the previous one stays in service.
    Failed,
}

/// Where a VMI lookup was answered.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum LookupResult {
    /// Found in the cache.
    CacheHit,
    /// Not cached when asked; arrived through the watch within the brief wait (no GET).
    WatchHit,
    /// Not cached; found by a GET.
    ApiFound,
    /// Not cached; the GET said 404.
    ApiNotFound,
    /// Not cached; the GET failed.
    ApiError,
}

pub use crate::decide::validation::ValidationOutcome;

/// `endpoint` label values: the admission handlers' names in metrics and logs (`POST /mutate`,
/// `POST /validate`).
#[allow(missing_docs)]
pub mod endpoint {
    pub const MUTATE: &str = "mutate";
    pub const VALIDATE: &str = "validate";
}

/// The caches, by their `cache` label in metrics and logs.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Cache {
    /// VirtualMachineInstances.
    Vmis,
    /// Namespace labels.
    Namespaces,
    /// TeeCapacity reports.
    TeeCapacities,
    /// Node metadata.
    Nodes,
    /// virt-launcher pods.
    LauncherPods,
    /// The nodes' holds (`TeeReservation`).
    Reservations,
    /// The agents' heartbeat Leases.
    AgentLeases,
}

/// What one write of a node's `TeeReservation` did ([`crate::cluster::holds::write_node`]).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum HoldWriteResult {
    /// Written: the key is held.
    Written,
    /// Another write came first (409 Conflict): read again and decided again.
    Conflict,
    /// The API server could not be reached, refused, or the object kept changing: the holds stay in
    /// the decider's index and the write-behind tries again.
    Failed,
}

/// What happened to an `InsufficientTEEKeys` Event on a VMI.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum EventResult {
    /// Written to the API server.
    Recorded,
    /// The API server refused it or did not answer.
    Failed,
    /// The queue was full; not sent.
    Dropped,
    /// The same VMI got an Event recently; not sent.
    Suppressed,
}

/// What became of a retry of a VMI whose pod teeguard refused ([`crate::cluster::retry`]).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum RetryResult {
    /// The VMI was annotated: virt-controller creates its pod again.
    Retried,
    /// The API server refused the annotation or did not answer.
    Failed,
}

/// What `/mutate` did with a pod of a TEE RuntimeClass (`admission.teeRuntimeClasses`).
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum RuntimeClassResult {
    /// The key request was added to the first container.
    Patched,
    /// The pod's overhead carries a key (its RuntimeClass's `overhead.podFixed`): allowed untouched,
    /// with a warning.
    OverheadKey,
    /// A container already requests a key: allowed untouched.
    AlreadyRequested,
    /// Left untouched for another reason (an exempt namespace).
    Skipped,
    /// Refused (the namespace could not be looked up).
    Denied,
}

/// Label values are the lower-case names used in dashboards (`patched`, `cache_hit`, ...).
macro_rules! label_values {
    ($ty:ty { $($variant:ident => $value:literal),+ $(,)? }) => {
        impl $ty {
            /// The label value.
            pub const fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $value),+ }
            }
        }
        impl EncodeLabelValue for $ty {
            fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
                std::fmt::Write::write_str(encoder, self.as_str())
            }
        }
    };
}

label_values!(Outcome { Allowed => "allowed", Patched => "patched", Denied => "denied", Error => "error" });
label_values!(ValidationOutcome {
    Admitted => "admitted",
    Warned => "warned",
    Denied => "denied",
    Skipped => "skipped",
});
label_values!(Cache {
    Vmis => "vmis",
    Namespaces => "namespaces",
    TeeCapacities => "teecapacities",
    Nodes => "nodes",
    LauncherPods => "virt_launcher_pods",
    Reservations => "teereservations",
    AgentLeases => "agent_leases",
});
label_values!(HoldWriteResult {
    Written => "written",
    Conflict => "conflict",
    Failed => "failed",
});
label_values!(EventResult {
    Recorded => "recorded",
    Failed => "failed",
    Dropped => "dropped",
    Suppressed => "suppressed",
});
label_values!(RetryResult {
    Retried => "retried",
    Failed => "failed",
});
label_values!(RuntimeClassResult {
    Patched => "patched",
    OverheadKey => "overhead_key",
    AlreadyRequested => "already_requested",
    Skipped => "skipped",
    Denied => "denied",
});
label_values!(ReloadResult { Ok => "ok", Failed => "failed" });
label_values!(LookupResult {
    CacheHit => "cache_hit",
    WatchHit => "watch_hit",
    ApiFound => "api_found",
    ApiNotFound => "api_not_found",
    ApiError => "api_error",
});

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    endpoint: &'static str,
    outcome: Outcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheLabels {
    cache: Cache,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ValidationLabels {
    request: &'static str,
    kind: &'static str,
    outcome: ValidationOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    result: EventResult,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RetryLabels {
    kind: &'static str,
    result: RetryResult,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HoldWriteLabels {
    result: HoldWriteResult,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RuntimeClassLabels {
    kind: &'static str,
    result: RuntimeClassResult,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReloadLabels {
    result: ReloadResult,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LookupLabels {
    cache: Cache,
    result: LookupResult,
}

/// Latency buckets in seconds: 50 µs to 10 s (the hot path is sub-millisecond).
const LATENCY_BUCKETS: [f64; 16] = [
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 10.0,
];

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

/// All webhook metrics. Cheap to share behind an `Arc`; every method is lock-free or takes a short
/// read lock.
#[derive(Debug)]
pub struct Metrics {
    requests: Family<RequestLabels, Counter>,
    latency: Family<RequestLabels, Histogram, fn() -> Histogram>,
    cache_objects: Family<CacheLabels, Gauge>,
    lookups: Family<LookupLabels, Counter>,
    cert_reloads: Family<ReloadLabels, Counter>,
    cert_expiry: Gauge,
    validations: Family<ValidationLabels, Counter>,
    holds: Family<ReasonLabels, Gauge>,
    hold_writes: Family<HoldWriteLabels, Counter>,
    hold_write_latency: Histogram,
    vmi_events: Family<EventLabels, Counter>,
    vmi_retries: Family<RetryLabels, Counter>,
    waiting_vmis: Family<KindLabels, Gauge>,
    decider: Gauge,
    runtime_class_mutations: Family<RuntimeClassLabels, Counter>,
}

impl Metrics {
    /// Create the metrics and register them (prefix `teeguard_webhook_`).
    pub fn new(registry: &mut Registry) -> Self {
        let m = Metrics {
            requests: Family::default(),
            latency: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            cache_objects: Family::default(),
            lookups: Family::default(),
            cert_reloads: Family::default(),
            cert_expiry: Gauge::default(),
            validations: Family::default(),
            holds: Family::default(),
            hold_writes: Family::default(),
            hold_write_latency: latency_histogram(),
            vmi_events: Family::default(),
            vmi_retries: Family::default(),
            waiting_vmis: Family::default(),
            decider: Gauge::default(),
            runtime_class_mutations: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("teeguard_webhook");
        r.register(
            "admission_requests",
            "Admission reviews served, by endpoint and outcome",
            m.requests.clone(),
        );
        r.register(
            "admission_duration_seconds",
            "Time to answer an admission review (body read to response), by endpoint and outcome",
            m.latency.clone(),
        );
        r.register(
            "cache_objects",
            "Objects held in each in-memory cache",
            m.cache_objects.clone(),
        );
        r.register(
            "cache_lookups",
            "Cache lookups on the admission path, by cache and where they were answered",
            m.lookups.clone(),
        );
        r.register(
            "cert_reloads",
            "Serving certificate reload attempts, by result",
            m.cert_reloads.clone(),
        );
        r.register(
            "cert_expiry_timestamp_seconds",
            "Expiry (notAfter, Unix seconds) of the serving certificate in use",
            m.cert_expiry.clone(),
        );
        r.register(
            "validations",
            "Validating decisions, by request (pod_create, pod_update, binding, other), TEE kind and outcome",
            m.validations.clone(),
        );
        r.register(
            "holds",
            "Keys held on nodes that their reports do not count yet, as this replica sees them, by reason (Admitted, Promised, Bound)",
            m.holds.clone(),
        );
        r.register(
            "hold_writes",
            "Writes of nodes' TeeReservations, by result (written, conflict, failed)",
            m.hold_writes.clone(),
        );
        r.register(
            "hold_write_duration_seconds",
            "Time from a node's TeeReservation write to its last answer (reads and retries included)",
            m.hold_write_latency.clone(),
        );
        r.register(
            "vmi_events",
            "InsufficientTEEKeys and TEEKeyFree Events on VMIs, by result",
            m.vmi_events.clone(),
        );
        r.register(
            "vmi_retries",
            "VMIs whose launcher pod teeguard refused, retried once a key was free for them, by TEE kind and result (retried, failed)",
            m.vmi_retries.clone(),
        );
        r.register(
            "waiting_vmis",
            "VMIs waiting for a key: their launcher pod was refused by teeguard and not created since, by TEE kind",
            m.waiting_vmis.clone(),
        );
        r.register(
            "decider",
            "1 while this replica decides the admissions that take a key (the others forward to it), else 0",
            m.decider.clone(),
        );
        r.register(
            "runtime_class_mutations",
            "Mutating decisions on pods of a TEE RuntimeClass (admission.teeRuntimeClasses), by TEE kind and result (patched, overhead_key, already_requested, skipped, denied)",
            m.runtime_class_mutations.clone(),
        );
        m
    }

    /// Count one retry of a waiting VMI; `kind` a kernel name (`tdx`).
    pub fn vmi_retry(&self, kind: &'static str, result: RetryResult) {
        self.vmi_retries
            .get_or_create(&RetryLabels { kind, result })
            .inc();
    }

    /// Set how many VMIs wait for a key of `kind` (a kernel name).
    pub fn set_waiting_vmis(&self, kind: &'static str, n: usize) {
        self.waiting_vmis
            .get_or_create(&KindLabels { kind })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Count one mutating decision on a pod of a TEE RuntimeClass; `kind` a kernel name (`tdx`).
    pub fn runtime_class_mutation(&self, kind: &'static str, result: RuntimeClassResult) {
        self.runtime_class_mutations
            .get_or_create(&RuntimeClassLabels { kind, result })
            .inc();
    }

    /// Count one validating decision. `request` is `pod_create`, `pod_update`, `binding` or `other`;
    /// `kind` a kernel name (`tdx`) or `none`.
    pub fn validation(
        &self,
        request: &'static str,
        kind: &'static str,
        outcome: ValidationOutcome,
    ) {
        self.validations
            .get_or_create(&ValidationLabels {
                request,
                kind,
                outcome,
            })
            .inc();
    }

    /// Set how many live holds this replica sees for `reason` (`Admitted`, `Promised`, `Bound`).
    pub fn set_holds(&self, reason: &'static str, n: usize) {
        self.holds
            .get_or_create(&ReasonLabels { reason })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Whether this replica decides the admissions that take a key now.
    pub fn set_decider(&self, deciding: bool) {
        self.decider.set(i64::from(deciding));
    }

    /// Count a write of a node's `TeeReservation`.
    pub fn hold_write(&self, result: HoldWriteResult) {
        self.hold_writes
            .get_or_create(&HoldWriteLabels { result })
            .inc();
    }

    /// Record the time an admission spent writing its hold.
    pub fn observe_hold_write(&self, d: std::time::Duration) {
        self.hold_write_latency.observe(d.as_secs_f64());
    }

    /// Count an Event outcome.
    pub fn vmi_event(&self, result: EventResult) {
        self.vmi_events.get_or_create(&EventLabels { result }).inc();
    }

    /// Record one answered request.
    pub fn observe_request(&self, endpoint: &'static str, outcome: Outcome, elapsed: Duration) {
        let labels = RequestLabels { endpoint, outcome };
        self.requests.get_or_create(&labels).inc();
        self.latency
            .get_or_create(&labels)
            .observe(elapsed.as_secs_f64());
    }

    /// Set the number of objects in a cache.
    pub fn set_cache_objects(&self, cache: Cache, n: usize) {
        self.cache_objects
            .get_or_create(&CacheLabels { cache })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Count a lookup on the admission path.
    pub fn lookup(&self, cache: Cache, result: LookupResult) {
        self.lookups
            .get_or_create(&LookupLabels { cache, result })
            .inc();
    }

    /// Count a certificate reload attempt.
    pub fn cert_reload(&self, result: ReloadResult) {
        self.cert_reloads
            .get_or_create(&ReloadLabels { result })
            .inc();
    }

    /// Set the expiry of the certificate in use.
    pub fn set_cert_expiry(&self, unix_seconds: i64) {
        self.cert_expiry.set(unix_seconds);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_all_families() {
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry);
        m.observe_request("mutate", Outcome::Patched, Duration::from_micros(300));
        m.set_cache_objects(Cache::Vmis, 3);
        m.lookup(Cache::Vmis, LookupResult::CacheHit);
        m.cert_reload(ReloadResult::Failed);
        m.set_cert_expiry(1_900_000_000);
        m.validation("binding", "tdx", ValidationOutcome::Denied);
        m.set_holds("Promised", 2);
        m.hold_write(HoldWriteResult::Conflict);
        m.vmi_event(EventResult::Suppressed);
        m.runtime_class_mutation("tdx", RuntimeClassResult::OverheadKey);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).expect("encode");
        for want in [
            r#"teeguard_webhook_admission_requests_total{endpoint="mutate",outcome="patched"} 1"#,
            r#"teeguard_webhook_admission_duration_seconds_bucket{le="0.0005",endpoint="mutate",outcome="patched"} 1"#,
            r#"teeguard_webhook_cache_objects{cache="vmis"} 3"#,
            r#"teeguard_webhook_cache_lookups_total{cache="vmis",result="cache_hit"} 1"#,
            r#"teeguard_webhook_cert_reloads_total{result="failed"} 1"#,
            "teeguard_webhook_cert_expiry_timestamp_seconds 1900000000",
            r#"teeguard_webhook_validations_total{request="binding",kind="tdx",outcome="denied"} 1"#,
            r#"teeguard_webhook_holds{reason="Promised"} 2"#,
            r#"teeguard_webhook_hold_writes_total{result="conflict"} 1"#,
            r#"teeguard_webhook_vmi_events_total{result="suppressed"} 1"#,
            r#"teeguard_webhook_runtime_class_mutations_total{kind="tdx",result="overhead_key"} 1"#,
        ] {
            assert!(out.contains(want), "{want} missing from\n{out}");
        }
    }

    /// Every count lands in its label set's one series, whatever the label values.
    #[test]
    fn counts_land_in_one_series_per_label_set() {
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry);
        for _ in 0..3 {
            m.observe_request("validate", Outcome::Denied, Duration::from_micros(80));
            m.observe_request("other", Outcome::Allowed, Duration::from_micros(80));
            m.validation("pod_create", "sev_es", ValidationOutcome::Warned);
            m.validation("pod_create", "future_kind", ValidationOutcome::Warned);
            m.lookup(Cache::Vmis, LookupResult::ApiError);
            m.lookup(Cache::Nodes, LookupResult::CacheHit);
        }
        m.requests
            .get_or_create(&RequestLabels {
                endpoint: "validate",
                outcome: Outcome::Denied,
            })
            .inc();
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).expect("encode");
        for want in [
            r#"teeguard_webhook_admission_requests_total{endpoint="validate",outcome="denied"} 4"#,
            r#"teeguard_webhook_admission_requests_total{endpoint="other",outcome="allowed"} 3"#,
            r#"teeguard_webhook_admission_duration_seconds_count{endpoint="validate",outcome="denied"} 3"#,
            r#"teeguard_webhook_validations_total{request="pod_create",kind="sev_es",outcome="warned"} 3"#,
            r#"teeguard_webhook_validations_total{request="pod_create",kind="future_kind",outcome="warned"} 3"#,
            r#"teeguard_webhook_cache_lookups_total{cache="vmis",result="api_error"} 3"#,
            r#"teeguard_webhook_cache_lookups_total{cache="nodes",result="cache_hit"} 3"#,
        ] {
            assert!(out.contains(want), "{want} missing from\n{out}");
        }
        // Series appear once counted, not before.
        assert!(!out.contains(r#"outcome="patched""#), "{out}");
    }
}
