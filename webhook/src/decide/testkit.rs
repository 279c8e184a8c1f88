//! Building indexes for the decision tests: TDX nodes with reports, holds, pods and waiting VMIs, at a
//! fixed time.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::PodSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use teeguard_shared::TeeKind;
use teeguard_shared::crd::{KindStatus, TeeCapacityStatus};
use teeguard_shared::pod::KeyRequests;
use teeguard_shared::reservation::{
    HoldReason, KeyReservation, TeeReservation, TeeReservationSpec,
};

use super::holds::{Claimant, NewHold};
use super::index::{Index, PodState, VmiState};
use super::mutation::VmiRef;
use super::queue::Waiting;

/// The TTL of the test indexes.
pub const TTL: Duration = Duration::from_secs(30);
/// `admission.staleReportAfter` of the tests.
pub const STALE: Duration = Duration::from_secs(90);

/// The tests' "now".
pub fn t0() -> Timestamp {
    Timestamp::from_second(1_800_000_000).expect("t0")
}

/// `t0` plus `secs`.
pub fn at(secs: i64) -> Timestamp {
    t0().checked_add(SignedDuration::from_secs(secs))
        .expect("time")
}

/// One TDX key.
pub fn tdx(n: u64) -> KeyRequests {
    KeyRequests::from([(TeeKind::Tdx, n)])
}

/// A current TDX report: `capacity` keys, `free` of them free, counting `counted` pods.
pub fn report(capacity: u64, free: u64, counted: &[&str]) -> Arc<TeeCapacityStatus> {
    Arc::new(TeeCapacityStatus {
        tdx: Some(KindStatus {
            resource_name: "tdx.intel.com/keys".into(),
            capacity,
            kernel_used: capacity - free,
            pods_used: capacity - free,
            free,
            ..KindStatus::default()
        }),
        heartbeat_time: Some(Time(t0())),
        counted_pods: counted.iter().map(|s| s.to_string()).collect(),
        ..TeeCapacityStatus::default()
    })
}

/// A hold of one TDX key for `pod_uid` (empty: a promise) of VMI `vmi_uid`.
pub fn hold(pod_uid: &str, vmi_uid: &str, reason: HoldReason) -> KeyReservation {
    NewHold {
        claimant: Claimant { pod_uid, vmi_uid },
        pod: pod_uid,
        vmi: vmi_uid,
        keys: &tdx(1),
        reason,
    }
    .entry(t0(), "test")
}

/// The labels of a TDX node in `zone`.
pub fn labels(zone: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        ("kubevirt.io/tdx".to_string(), "true".to_string()),
        ("zone".to_string(), zone.to_string()),
    ])
}

/// An index builder.
#[derive(Debug)]
pub struct World {
    /// The index.
    pub ix: Index,
    version: u64,
}

impl Default for World {
    fn default() -> Self {
        World {
            ix: Index::new(TTL),
            version: 0,
        }
    }
}

impl World {
    /// A TDX node in zone `z-<name>` with `capacity` keys, `free` of them free.
    pub fn node(mut self, name: &str, capacity: u64, free: u64) -> Self {
        self.ix.apply_node(name, Some(labels(&format!("z-{name}"))));
        self.ix
            .apply_report(name, Some(report(capacity, free, &[])), None, t0());
        self
    }

    /// `node`'s `TeeReservation` holding `entries`, first seen at `t0`.
    pub fn holds(mut self, node: &str, entries: Vec<KeyReservation>) -> Self {
        self.version += 1;
        let obj = TeeReservation {
            metadata: ObjectMeta {
                name: Some(node.into()),
                resource_version: Some(self.version.to_string()),
                ..ObjectMeta::default()
            },
            spec: TeeReservationSpec {
                node_name: node.into(),
                reservations: entries,
            },
        };
        self.ix.apply_holds(node, Some(Arc::new(obj)), t0());
        self
    }

    /// A hold kept in this replica only (its write failed).
    pub fn local(mut self, node: &str, e: KeyReservation) -> Self {
        self.ix.hold_locally(node, e, t0());
        self
    }

    /// A virt-launcher pod `uid`, bound to `node` or not, of no VMI the index knows.
    pub fn pod(self, uid: &str, node: Option<&str>) -> Self {
        self.launcher(uid, "", node)
    }

    /// A virt-launcher pod `uid` of VMI `vmi_uid`, bound to `node` or not.
    pub fn launcher(mut self, uid: &str, vmi_uid: &str, node: Option<&str>) -> Self {
        let state = PodState {
            node: node.map(str::to_string),
            ended: false,
            keys: true,
            vmi: Some(vmi_uid.to_string()).filter(|v| !v.is_empty()),
        };
        self.ix.apply_pod(uid, Some(state), t0());
        self
    }

    /// A pending VMI `name` (UID `uid-<name>`), waiting for a TDX key since `t0 + since` when given,
    /// whose pod may go to nodes labelled `selector`.
    pub fn vmi(mut self, name: &str, since: Option<i64>, selector: &[(&str, &str)]) -> Self {
        let uid = format!("uid-{name}");
        let waiting = since.map(|s| Waiting {
            vmi: VmiRef {
                namespace: "vms".into(),
                name: name.into(),
                uid: uid.clone(),
            },
            kind: TeeKind::Tdx,
            since: Some(at(s)),
            placement: PodSpec {
                node_selector: Some(
                    selector
                        .iter()
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .collect(),
                ),
                ..PodSpec::default()
            },
        });
        let state = VmiState {
            pending: true,
            waiting,
        };
        self.ix.apply_vmi(&uid, Some(state), t0());
        self
    }

    /// Every watch listed.
    pub fn synced(mut self) -> Self {
        self.ix.set_synced();
        self
    }
}
