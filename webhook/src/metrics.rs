//! The webhook's Prometheus metrics (served on the admin port's `/metrics`).

use std::sync::OnceLock;
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use teeguard_shared::TeeKind;

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
});
label_values!(EventResult {
    Recorded => "recorded",
    Failed => "failed",
    Dropped => "dropped",
    Suppressed => "suppressed",
});
label_values!(ReloadResult { Ok => "ok", Failed => "failed" });
label_values!(LookupResult {
    CacheHit => "cache_hit",
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
    cache: &'static str,
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
struct ReloadLabels {
    result: ReloadResult,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LookupLabels {
    cache: &'static str,
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

/// The series of one family that the admission path touches on every review, each resolved from the
/// family once, on first use (so a series still appears in `/metrics` only once it has been counted).
///
/// A [`Family`] lookup hashes the label set and takes the family's read lock, an atomic
/// read-modify-write on a line every server thread shares; a resolved series is a clone of the
/// family's own (counters and histograms share their state with it), so after the first use a review
/// touches only the metric. Label sets without a slot (see the `*_slot` functions) go through the
/// family. Nothing removes series from these families, so a resolved series never goes stale.
struct Resolved<M, const N: usize>([OnceLock<M>; N]);

impl<M, const N: usize> Default for Resolved<M, N> {
    fn default() -> Self {
        Resolved([const { OnceLock::new() }; N])
    }
}

impl<M, const N: usize> std::fmt::Debug for Resolved<M, N> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let resolved = self.0.iter().filter(|c| c.get().is_some()).count();
        write!(f, "Resolved({resolved} of {N})")
    }
}

impl<M: Clone, const N: usize> Resolved<M, N> {
    /// Run `f` on the series of `labels`, whose slot is `slot`.
    fn with<S, C>(
        &self,
        family: &Family<S, M, C>,
        slot: Option<usize>,
        labels: &S,
        f: impl FnOnce(&M),
    ) where
        S: Clone + std::hash::Hash + Eq,
        C: prometheus_client::metrics::family::MetricConstructor<M>,
    {
        match slot.and_then(|i| self.0.get(i)) {
            Some(cell) => f(cell.get_or_init(|| family.get_or_create_owned(labels))),
            None => f(&family.get_or_create(labels)),
        }
    }
}

/// The admission endpoints (`endpoint` label) with resolved series.
const ENDPOINTS: [&str; 2] = [endpoint::MUTATE, endpoint::VALIDATE];
/// `request` values of the validations family.
const VALIDATION_REQUESTS: [&str; 4] = ["pod_create", "pod_update", "binding", "other"];
/// `kind` values of the validations family.
const VALIDATION_KINDS: [&str; 4] = [
    "none",
    TeeKind::Tdx.kernel_name(),
    TeeKind::Sev.kernel_name(),
    TeeKind::SevEs.kernel_name(),
];
/// Caches looked up on the admission path.
const LOOKUP_CACHES: [&str; 3] = [
    Cache::Namespaces.as_str(),
    Cache::Vmis.as_str(),
    Cache::LauncherPods.as_str(),
];

fn position(values: &[&str], value: &str) -> Option<usize> {
    values.iter().position(|v| *v == value)
}

fn request_slot(l: &RequestLabels) -> Option<usize> {
    Some(position(&ENDPOINTS, l.endpoint)? * 4 + l.outcome as usize)
}

fn validation_slot(l: &ValidationLabels) -> Option<usize> {
    let request = position(&VALIDATION_REQUESTS, l.request)?;
    let kind = position(&VALIDATION_KINDS, l.kind)?;
    Some((request * 4 + kind) * 4 + l.outcome as usize)
}

fn lookup_slot(l: &LookupLabels) -> Option<usize> {
    Some(position(&LOOKUP_CACHES, l.cache)? * 4 + l.result as usize)
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
    ledger_reservations: Gauge,
    vmi_events: Family<EventLabels, Counter>,
    resolved_requests: Resolved<Counter, 8>,
    resolved_latency: Resolved<Histogram, 8>,
    resolved_validations: Resolved<Counter, 64>,
    resolved_lookups: Resolved<Counter, 12>,
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
            ledger_reservations: Gauge::default(),
            vmi_events: Family::default(),
            resolved_requests: Resolved::default(),
            resolved_latency: Resolved::default(),
            resolved_validations: Resolved::default(),
            resolved_lookups: Resolved::default(),
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
            "ledger_reservations",
            "Keys reservations held in this replica's admission ledger (admitted, not in a node report yet)",
            m.ledger_reservations.clone(),
        );
        r.register(
            "vmi_events",
            "InsufficientTEEKeys Events on VMIs, by result",
            m.vmi_events.clone(),
        );
        m
    }

    /// Count one validating decision. `request` is `pod_create`, `pod_update`, `binding` or `other`;
    /// `kind` a kernel name (`tdx`) or `none`.
    pub fn validation(
        &self,
        request: &'static str,
        kind: &'static str,
        outcome: ValidationOutcome,
    ) {
        let labels = ValidationLabels {
            request,
            kind,
            outcome,
        };
        self.resolved_validations
            .with(&self.validations, validation_slot(&labels), &labels, |c| {
                c.inc();
            });
    }

    /// Set the number of ledger reservations.
    pub fn set_ledger_reservations(&self, n: usize) {
        self.ledger_reservations
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Count an Event outcome.
    pub fn vmi_event(&self, result: EventResult) {
        self.vmi_events.get_or_create(&EventLabels { result }).inc();
    }

    /// Record one answered request.
    pub fn observe_request(&self, endpoint: &'static str, outcome: Outcome, elapsed: Duration) {
        let labels = RequestLabels { endpoint, outcome };
        let slot = request_slot(&labels);
        self.resolved_requests
            .with(&self.requests, slot, &labels, |c| {
                c.inc();
            });
        self.resolved_latency
            .with(&self.latency, slot, &labels, |h| {
                h.observe(elapsed.as_secs_f64())
            });
    }

    /// Set the number of objects in a cache.
    pub fn set_cache_objects(&self, cache: &'static str, n: usize) {
        self.cache_objects
            .get_or_create(&CacheLabels { cache })
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Count a lookup on the admission path.
    pub fn lookup(&self, cache: &'static str, result: LookupResult) {
        let labels = LookupLabels { cache, result };
        self.resolved_lookups
            .with(&self.lookups, lookup_slot(&labels), &labels, |c| {
                c.inc();
            });
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
        m.set_cache_objects("vmis", 3);
        m.lookup("vmis", LookupResult::CacheHit);
        m.cert_reload(ReloadResult::Failed);
        m.set_cert_expiry(1_900_000_000);
        m.validation("binding", "tdx", ValidationOutcome::Denied);
        m.set_ledger_reservations(2);
        m.vmi_event(EventResult::Suppressed);
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
            "teeguard_webhook_ledger_reservations 2",
            r#"teeguard_webhook_vmi_events_total{result="suppressed"} 1"#,
        ] {
            assert!(out.contains(want), "{want} missing from\n{out}");
        }
    }

    const OUTCOMES: [Outcome; 4] = [
        Outcome::Allowed,
        Outcome::Patched,
        Outcome::Denied,
        Outcome::Error,
    ];
    const VALIDATION_OUTCOMES: [ValidationOutcome; 4] = [
        ValidationOutcome::Admitted,
        ValidationOutcome::Warned,
        ValidationOutcome::Denied,
        ValidationOutcome::Skipped,
    ];
    const LOOKUP_RESULTS: [LookupResult; 4] = [
        LookupResult::CacheHit,
        LookupResult::ApiFound,
        LookupResult::ApiNotFound,
        LookupResult::ApiError,
    ];

    /// Every label set with a slot has its own, within the array.
    fn assert_distinct(slots: Vec<Option<usize>>, n: usize) {
        let mut seen = vec![false; n];
        for slot in slots {
            let slot = slot.expect("a slot");
            assert!(slot < n, "slot {slot} out of {n}");
            assert!(!seen[slot], "slot {slot} taken twice");
            seen[slot] = true;
        }
        assert!(seen.iter().all(|s| *s), "every slot used");
    }

    #[test]
    fn resolved_slots_are_distinct_and_in_range() {
        let mut requests = Vec::new();
        for endpoint in ENDPOINTS {
            for outcome in OUTCOMES {
                requests.push(request_slot(&RequestLabels { endpoint, outcome }));
            }
        }
        assert_distinct(requests, 8);
        let mut validations = Vec::new();
        for request in VALIDATION_REQUESTS {
            for kind in VALIDATION_KINDS {
                for outcome in VALIDATION_OUTCOMES {
                    validations.push(validation_slot(&ValidationLabels {
                        request,
                        kind,
                        outcome,
                    }));
                }
            }
        }
        assert_distinct(validations, 64);
        let mut lookups = Vec::new();
        for cache in LOOKUP_CACHES {
            for result in LOOKUP_RESULTS {
                lookups.push(lookup_slot(&LookupLabels { cache, result }));
            }
        }
        assert_distinct(lookups, 12);
        // The kinds the handlers pass are TeeKind's kernel names.
        for kind in teeguard_shared::TeeKind::ALL {
            assert!(VALIDATION_KINDS.contains(&kind.kernel_name()), "{kind}");
        }
    }

    /// A resolved series is the family's own: counts through the slot and through the family (a label
    /// set without a slot, the same series after a lookup) land in one series each.
    #[test]
    fn resolved_series_count_into_the_family() {
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry);
        for _ in 0..3 {
            m.observe_request("validate", Outcome::Denied, Duration::from_micros(80));
            m.observe_request("other", Outcome::Allowed, Duration::from_micros(80));
            m.validation("pod_create", "sev_es", ValidationOutcome::Warned);
            m.validation("pod_create", "future_kind", ValidationOutcome::Warned);
            m.lookup(Cache::Vmis.as_str(), LookupResult::ApiError);
            m.lookup("nodes", LookupResult::CacheHit);
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
