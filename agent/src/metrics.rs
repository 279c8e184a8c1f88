//! Prometheus metrics (OpenMetrics text on the admin port's `/metrics`).
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `teeguard_agent_capacity_keys` | gauge | `kind` |
//! | `teeguard_agent_used_keys` (kernel) | gauge | `kind` |
//! | `teeguard_agent_pods_used_keys` | gauge | `kind` |
//! | `teeguard_agent_external_keys` | gauge | `kind` |
//! | `teeguard_agent_pending_keys` | gauge | `kind` |
//! | `teeguard_agent_free_keys` | gauge | `kind` |
//! | `teeguard_agent_scan_duration_seconds` | histogram | |
//! | `teeguard_agent_scan_errors_total` | counter | |
//! | `teeguard_agent_pod_cgroup_errors_total` | counter | |
//! | `teeguard_agent_events_rescans_total` | counter | |
//! | `teeguard_agent_api_errors_total` | counter | `operation` |
//! | `teeguard_agent_publishes_total` | counter | |
//! | `teeguard_agent_lease_renewals_total` | counter | |
//! | `teeguard_agent_last_publish_timestamp_seconds` | gauge: last status publish or Lease renewal | |
//! | `teeguard_agent_node_patches_total` | counter | |
//! | `teeguard_agent_limits_applied_total` | counter | `mechanism` (`nri`, `cgroup`), `kind` |
//! | `teeguard_agent_limit_mismatches_total` | counter | `mechanism` |
//! | `teeguard_agent_limit_failures_total` | counter | `mechanism` |
//! | `teeguard_agent_nri_connected` | gauge (0/1) | |
//! | `teeguard_agent_enforcing` | gauge (0/1): the `Enforcing` condition is True | |
//! | `teeguard_agent_dra_devices` | gauge (DRA mode) | `kind`, `state` (`published`, `allocated`, `withheld`) |
//! | `teeguard_agent_dra_bypassed` | gauge (0/1, DRA mode): the Node's allocatable names the kind's resource, so the scheduler bypasses DRA | `kind` |
//! | `teeguard_agent_dra_prepare_total` | counter: claims the kubelet asked to prepare | `result` (`prepared`, `already`, `refused`) |
//! | `teeguard_agent_dra_prepare_seconds` | histogram: one NodePrepareResources call | |
//! | `teeguard_agent_dra_slice_writes_total` | counter: ResourceSlice applies and deletes | |

use std::collections::BTreeMap;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use teeguard_shared::TeeKind;

use crate::decide::attribution::KindFigures;

/// Label set `kind="tdx"`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// Kernel name of the TEE kind.
    pub kind: String,
}

/// Label set `operation="apply TeeCapacity status"`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OperationLabel {
    /// What the agent was doing.
    pub operation: String,
}

/// Label set `mechanism="nri"`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MechanismLabel {
    /// `nri` or `cgroup`.
    pub mechanism: &'static str,
}

/// Label set `mechanism="nri",kind="tdx"`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LimitLabel {
    /// `nri` or `cgroup`.
    pub mechanism: &'static str,
    /// Kernel name of the TEE kind.
    pub kind: &'static str,
}

/// Label set `kind="tdx",state="published"`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeviceLabel {
    /// Kernel name of the TEE kind.
    pub kind: &'static str,
    /// `published`, `allocated` or `withheld`.
    pub state: &'static str,
}

/// Label set `result="prepared"`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// The outcome.
    pub result: &'static str,
}

/// The agent's metrics. Cheap to clone (all handles are shared).
#[derive(Clone, Debug)]
pub struct Metrics {
    capacity: Family<KindLabel, Gauge>,
    used: Family<KindLabel, Gauge>,
    pods_used: Family<KindLabel, Gauge>,
    external: Family<KindLabel, Gauge>,
    pending: Family<KindLabel, Gauge>,
    free: Family<KindLabel, Gauge>,
    scan_duration: Histogram,
    /// Scans that failed (a root misc file unreadable or malformed).
    pub scan_errors: Counter,
    /// Pod cgroups that could not be read.
    pub pod_cgroup_errors: Counter,
    /// Pod `misc.current` files read.
    pub pod_files_read: Counter,
    /// Pod readings taken unchanged because the kubepods total matched them.
    pub pod_readings_reused: Counter,
    /// Re-scans triggered by a `misc.events` change.
    pub events_rescans: Counter,
    api_errors: Family<OperationLabel, Counter>,
    /// Successful status publishes.
    pub publishes: Counter,
    /// Heartbeat Lease renewals.
    pub lease_renewals: Counter,
    /// Unix time the report was last confirmed current: a status publish or a heartbeat Lease renewal
    /// (the report's age as the webhook and the alerts see it).
    pub last_publish: Gauge,
    /// Successful Node writes (annotation or extended resources).
    pub node_patches: Counter,
    limits_applied: Family<LimitLabel, Counter>,
    limit_mismatches: Family<MechanismLabel, Counter>,
    limit_failures: Family<MechanismLabel, Counter>,
    /// 1 while the NRI plugin is registered with the runtime.
    pub nri_connected: Gauge,
    /// 1 while the `Enforcing` condition is True (pods' key limits are applied), else 0.
    pub enforcing: Gauge,
    dra_devices: Family<DeviceLabel, Gauge>,
    dra_bypassed: Family<KindLabel, Gauge>,
    dra_prepare: Family<ResultLabel, Counter>,
    /// NodePrepareResources call durations.
    pub dra_prepare_seconds: Histogram,
    /// ResourceSlice writes.
    pub dra_slice_writes: Counter,
}

impl Metrics {
    /// Create the metrics and register them (prefix `teeguard_agent`).
    pub fn new(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            capacity: Family::default(),
            used: Family::default(),
            pods_used: Family::default(),
            external: Family::default(),
            pending: Family::default(),
            free: Family::default(),
            // 10 µs .. ~1.3 s
            scan_duration: Histogram::new(exponential_buckets(1e-5, 4.0, 9)),
            scan_errors: Counter::default(),
            pod_cgroup_errors: Counter::default(),
            pod_files_read: Counter::default(),
            pod_readings_reused: Counter::default(),
            events_rescans: Counter::default(),
            api_errors: Family::default(),
            publishes: Counter::default(),
            lease_renewals: Counter::default(),
            last_publish: Gauge::default(),
            node_patches: Counter::default(),
            limits_applied: Family::default(),
            limit_mismatches: Family::default(),
            limit_failures: Family::default(),
            nri_connected: Gauge::default(),
            enforcing: Gauge::default(),
            dra_devices: Family::default(),
            dra_bypassed: Family::default(),
            dra_prepare: Family::default(),
            // 100 µs .. ~1.6 s, doubling
            dra_prepare_seconds: Histogram::new(exponential_buckets(1e-4, 2.0, 15)),
            dra_slice_writes: Counter::default(),
        };
        let r = registry.sub_registry_with_prefix("teeguard_agent");
        r.register(
            "capacity_keys",
            "TEE keys the kernel can hand out (misc.capacity)",
            m.capacity.clone(),
        );
        r.register(
            "used_keys",
            "TEE keys the kernel has handed out (root misc.current)",
            m.used.clone(),
        );
        r.register(
            "pods_used_keys",
            "TEE keys held by pods that request the resource",
            m.pods_used.clone(),
        );
        r.register(
            "external_keys",
            "TEE keys held by anything that does not request the resource",
            m.external.clone(),
        );
        r.register(
            "pending_keys",
            "TEE keys requested by bound pods that the kernel does not show yet",
            m.pending.clone(),
        );
        r.register(
            "free_keys",
            "TEE keys a new VM can still get",
            m.free.clone(),
        );
        r.register(
            "scan_duration_seconds",
            "Wall time of one scan of the misc cgroup files",
            m.scan_duration.clone(),
        );
        r.register(
            "scan_errors",
            "Scans that failed to read or parse a root misc file",
            m.scan_errors.clone(),
        );
        r.register(
            "pod_cgroup_errors",
            "Pod cgroup misc files that could not be read or parsed",
            m.pod_cgroup_errors.clone(),
        );
        r.register(
            "pod_files_read",
            "Pod cgroup misc.current files read",
            m.pod_files_read.clone(),
        );
        r.register(
            "pod_readings_reused",
            "Pod readings taken from the previous scan because the kubepods total showed no change",
            m.pod_readings_reused.clone(),
        );
        r.register(
            "events_rescans",
            "Re-scans triggered by a misc.events change (a failed charge)",
            m.events_rescans.clone(),
        );
        r.register(
            "api_errors",
            "Failed Kubernetes API calls by operation",
            m.api_errors.clone(),
        );
        r.register(
            "publishes",
            "TeeCapacity status publishes",
            m.publishes.clone(),
        );
        r.register(
            "lease_renewals",
            "Heartbeat Lease renewals (heartbeats while the published status is current)",
            m.lease_renewals.clone(),
        );
        r.register(
            "last_publish_timestamp_seconds",
            "Unix time the TeeCapacity report was last confirmed current: a status publish or a heartbeat Lease renewal",
            m.last_publish.clone(),
        );
        r.register(
            "node_patches",
            "Writes to the Node (extended resources and their annotation)",
            m.node_patches.clone(),
        );
        r.register(
            "limits_applied",
            "Per-pod key limits (misc.max) applied, by mechanism and kind",
            m.limits_applied.clone(),
        );
        r.register(
            "limit_mismatches",
            "Limits where teeguard's annotation disagreed with the pod's requests (the requests were applied)",
            m.limit_mismatches.clone(),
        );
        r.register(
            "limit_failures",
            "Limits that could not be applied",
            m.limit_failures.clone(),
        );
        r.register(
            "nri_connected",
            "1 while the NRI plugin is registered with the container runtime",
            m.nri_connected.clone(),
        );
        r.register(
            "enforcing",
            "1 while the Enforcing condition is True (pods' key limits are applied), 0 otherwise",
            m.enforcing.clone(),
        );
        r.register(
            "dra_devices",
            "DRA mode: key devices of the node's pool, published in its ResourceSlices, prepared for pods (allocated), or withheld (held by something no claim accounts for)",
            m.dra_devices.clone(),
        );
        r.register(
            "dra_bypassed",
            "DRA mode: 1 while the Node's allocatable names the kind's extended resource (another writer advertises it), so the scheduler bypasses DRA on this node",
            m.dra_bypassed.clone(),
        );
        r.register(
            "dra_prepare",
            "DRA mode: claims the kubelet asked the agent to prepare, by result",
            m.dra_prepare.clone(),
        );
        r.register(
            "dra_prepare_seconds",
            "DRA mode: duration of one NodePrepareResources call",
            m.dra_prepare_seconds.clone(),
        );
        r.register(
            "dra_slice_writes",
            "DRA mode: ResourceSlice applies and deletes",
            m.dra_slice_writes.clone(),
        );
        m
    }

    /// DRA mode: the devices of one kind published, allocated and withheld.
    pub fn set_dra_devices(&self, kind: TeeKind, published: u64, allocated: u64, withheld: u64) {
        for (state, v) in [
            ("published", published),
            ("allocated", allocated),
            ("withheld", withheld),
        ] {
            self.dra_devices
                .get_or_create(&DeviceLabel {
                    kind: kind.kernel_name(),
                    state,
                })
                .set(i64::try_from(v).unwrap_or(i64::MAX));
        }
    }

    /// Record whether the scheduler bypasses DRA for `kind` on this node.
    pub fn set_dra_bypassed(&self, kind: TeeKind, bypassed: bool) {
        self.dra_bypassed
            .get_or_create(&KindLabel {
                kind: kind.kernel_name().to_string(),
            })
            .set(i64::from(bypassed));
    }

    /// Count a claim the kubelet asked to prepare.
    pub fn dra_prepared(&self, result: &'static str) {
        self.dra_prepare
            .get_or_create(&ResultLabel { result })
            .inc();
    }

    /// Follow the `Enforcing` condition: 1 when True, 0 otherwise.
    pub fn set_enforcing(&self, condition: &crate::decide::report::ConditionSpec) {
        self.enforcing.set(i64::from(condition.status == "True"));
    }

    /// Count an applied limit.
    pub fn limit_applied(&self, mechanism: &'static str, kind: TeeKind) {
        self.limits_applied
            .get_or_create(&LimitLabel {
                mechanism,
                kind: kind.kernel_name(),
            })
            .inc();
    }

    /// Count an annotation that disagreed with the requests.
    pub fn limit_mismatch(&self, mechanism: &'static str) {
        self.limit_mismatches
            .get_or_create(&MechanismLabel { mechanism })
            .inc();
    }

    /// Count a limit that could not be applied.
    pub fn limit_failure(&self, mechanism: &'static str) {
        self.limit_failures
            .get_or_create(&MechanismLabel { mechanism })
            .inc();
    }

    /// Set the per-kind gauges; kinds no longer present are removed.
    pub fn set_figures(&self, figures: &BTreeMap<TeeKind, KindFigures>) {
        for kind in TeeKind::ALL {
            let label = KindLabel {
                kind: kind.kernel_name().to_string(),
            };
            let families = [
                &self.capacity,
                &self.used,
                &self.pods_used,
                &self.external,
                &self.pending,
                &self.free,
            ];
            match figures.get(&kind) {
                Some(f) => {
                    let values = [
                        f.capacity,
                        f.kernel_used,
                        f.pods_used,
                        f.external,
                        f.pending,
                        f.free,
                    ];
                    for (family, v) in families.into_iter().zip(values) {
                        family
                            .get_or_create(&label)
                            .set(i64::try_from(v).unwrap_or(i64::MAX));
                    }
                }
                None => {
                    for family in families {
                        family.remove(&label);
                    }
                }
            }
        }
    }

    /// Record a scan's duration.
    pub fn observe_scan(&self, d: Duration) {
        self.scan_duration.observe(d.as_secs_f64());
    }

    /// Count a failed API call.
    pub fn api_error(&self, operation: &str) {
        self.api_errors
            .get_or_create(&OperationLabel {
                operation: operation.to_string(),
            })
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_gauges_per_kind_and_removes_vanished_kinds() {
        let mut reg = Registry::default();
        let m = Metrics::new(&mut reg);
        let mut figures = BTreeMap::new();
        figures.insert(
            TeeKind::Tdx,
            KindFigures {
                capacity: 16,
                kernel_used: 6,
                pods_used: 4,
                external: 2,
                pending: 0,
                free: 10,
            },
        );
        m.set_figures(&figures);
        m.api_error("apply TeeCapacity status");
        m.observe_scan(Duration::from_micros(50));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).expect("encode");
        for line in [
            "teeguard_agent_capacity_keys{kind=\"tdx\"} 16",
            "teeguard_agent_external_keys{kind=\"tdx\"} 2",
            "teeguard_agent_free_keys{kind=\"tdx\"} 10",
            "teeguard_agent_api_errors_total{operation=\"apply TeeCapacity status\"} 1",
            "teeguard_agent_scan_duration_seconds_count 1",
        ] {
            assert!(out.contains(line), "missing {line:?} in\n{out}");
        }
        m.set_figures(&BTreeMap::new());
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &reg).expect("encode");
        assert!(!out.contains("kind=\"tdx\""), "{out}");
    }

    #[test]
    fn enforcing_gauge_is_1_only_while_the_enforcing_condition_is_true() {
        let mut reg = Registry::default();
        let m = Metrics::new(&mut reg);
        let encoded = |reg: &Registry| {
            let mut out = String::new();
            prometheus_client::encoding::text::encode(&mut out, reg).expect("encode");
            out
        };
        assert!(encoded(&reg).contains("teeguard_agent_enforcing 0\n"));
        let spec = |status: &'static str| crate::decide::report::ConditionSpec {
            type_: "Enforcing",
            status,
            reason: "NriPlugin",
            message: String::new(),
        };
        m.set_enforcing(&spec("True"));
        assert!(encoded(&reg).contains("teeguard_agent_enforcing 1\n"));
        for status in ["False", "Unknown"] {
            m.set_enforcing(&spec(status));
            assert!(
                encoded(&reg).contains("teeguard_agent_enforcing 0\n"),
                "{status}"
            );
        }
    }
}
