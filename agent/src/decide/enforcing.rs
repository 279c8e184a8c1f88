//! The `Enforcing` condition and what it is made of: the host facts a scan gives the enforcers, the
//! mechanism in use, the NRI plugin's connection and the cgroup writer's progress. Pure: the
//! enforcers (`enforce`) report their state here as plain values.

use std::path::PathBuf;

use teeguard_shared::TeeKind;
use teeguard_shared::names::conditions as ct;

use super::attribution::Accounting;
use super::host::{Driver, HostState};
use super::report::ConditionSpec;

/// What the poll loop knows about the host, for the enforcers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostFacts {
    /// Kinds with capacity.
    pub kinds: Vec<TeeKind>,
    /// A scan showed the misc controller delegated to pod cgroups.
    pub delegated: bool,
    /// Why (or why not), from the scan.
    pub delegation_reason: String,
    /// The kubepods cgroup.
    pub kubepods: Option<PathBuf>,
    /// The kubelet's cgroup driver.
    pub driver: Option<Driver>,
}

impl HostFacts {
    /// From a scan; `None` when the scan failed (the previous facts stay).
    pub fn from_scan(state: &HostState) -> Option<HostFacts> {
        let HostState::Scanned(scan) = state else {
            return Some(HostFacts::default());
        };
        let kinds = TeeKind::ALL
            .into_iter()
            .filter(|k| scan.capacity.get(*k) > 0)
            .collect();
        let mut facts = HostFacts {
            kinds,
            ..HostFacts::default()
        };
        if let Some(pods) = &scan.pods {
            facts.delegated = pods.accounting == Accounting::PerPod && pods.kubepods.is_some();
            facts.delegation_reason = pods.accounting_reason.clone();
            facts.kubepods = pods.kubepods.clone();
            facts.driver = pods.driver;
        }
        Some(facts)
    }

    /// Whether a limit can be set without breaking container creation.
    pub fn limits_possible(&self) -> bool {
        self.delegated && !self.kinds.is_empty()
    }
}

/// The mechanism in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mechanism {
    /// The NRI plugin.
    Nri,
    /// The cgroup writer.
    Cgroup,
    /// None (`mode: off`).
    Off,
}

impl Mechanism {
    /// Lower-case name, as in metrics and the condition.
    pub fn name(self) -> &'static str {
        match self {
            Mechanism::Nri => "nri",
            Mechanism::Cgroup => "cgroup",
            Mechanism::Off => "none",
        }
    }
}

/// The connection's state, for the `Enforcing` condition and the metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NriState {
    /// Not connected yet.
    #[default]
    Connecting,
    /// Registered and synchronized with this runtime.
    Registered {
        /// `containerd 2.1.0`, as the runtime says in `Configure`.
        runtime: String,
    },
    /// Not connected: why (the last error).
    Disconnected {
        /// What went wrong.
        reason: String,
    },
}

/// What the writer reports for the `Enforcing` condition.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WriterStatus {
    /// Pods whose limits are in place.
    pub applied: usize,
    /// Pods waiting for their cgroup.
    pub waiting: usize,
    /// The last pod cgroup found without the misc controller.
    pub not_delegated: Option<String>,
    /// The last failure.
    pub last_failure: Option<String>,
}

/// Condition reasons of `Enforcing`.
pub mod reasons {
    /// The NRI plugin is registered.
    pub const NRI: &str = "NriPlugin";
    /// The cgroup writer runs.
    pub const CGROUP: &str = "CgroupWriter";
    /// `enforcement.mode: off`.
    pub const OFF: &str = "EnforcementOff";
    /// The NRI plugin is not connected.
    pub const NRI_UNAVAILABLE: &str = "NriUnavailable";
    /// Pod cgroups have no misc controller.
    pub const NOT_DELEGATED: &str = "MiscControllerNotDelegated";
    /// No TEE kind has capacity.
    pub const NO_TEE_HARDWARE: &str = "NoTeeHardware";
    /// No scan has completed yet.
    pub const NOT_SCANNED: &str = "NotScannedYet";
}

/// Everything the `Enforcing` condition says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnforcingInput<'a> {
    /// The mechanism chosen.
    pub mechanism: Mechanism,
    /// Strict mode.
    pub strict: bool,
    /// Host facts (`None` before the first scan).
    pub host: Option<&'a HostFacts>,
    /// The NRI connection (NRI only).
    pub nri: Option<&'a NriState>,
    /// The cgroup writer's status (cgroup only).
    pub writer: Option<&'a WriterStatus>,
    /// The last pod given no `misc.max` line for a kind it asks for because the host has no capacity
    /// of that kind ([`unavailable_note`]).
    pub unavailable: Option<&'a str>,
}

/// What the `Enforcing` condition says about a pod (or container) asking for kinds the host has no
/// capacity for: `pod` is `namespace/name`, `container` `None` for the whole pod (cgroup writer).
pub fn unavailable_note(
    pod: &str,
    container: Option<&str>,
    kinds: &[TeeKind],
    host_kinds: &[TeeKind],
) -> String {
    let names = |ks: &[TeeKind]| {
        if ks.is_empty() {
            "none".to_string()
        } else {
            ks.iter()
                .map(|k| k.kernel_name())
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    let who = match container {
        Some(c) => format!("{pod} (container {c})"),
        None => pod.to_string(),
    };
    format!(
        "{who} asks for {} keys, which this host has no capacity for (misc.capacity: {}): no misc.max \
         line is set for them, since the kernel refuses it (EINVAL) and the runtime would not start \
         the container",
        names(kinds),
        names(host_kinds)
    )
}

/// The `Enforcing` condition (pure).
pub fn condition(input: &EnforcingInput<'_>) -> ConditionSpec {
    let m = input.mechanism;
    let strict = if input.strict { "on" } else { "off" };
    let unavailable = input
        .unavailable
        .map(|u| format!("; {u}"))
        .unwrap_or_default();
    let spec = |ok: bool, reason: &'static str, detail: String| ConditionSpec {
        type_: ct::ENFORCING,
        status: if ok { "True" } else { "False" },
        reason,
        message: format!(
            "mechanism {}; strict {strict}; {detail}{unavailable}",
            m.name()
        ),
    };
    if m == Mechanism::Off {
        return spec(
            false,
            reasons::OFF,
            "enforcement.mode is off: pods' key limits are not applied".into(),
        );
    }
    let Some(host) = input.host else {
        return spec(
            false,
            reasons::NOT_SCANNED,
            "waiting for the first scan of the misc cgroup".into(),
        );
    };
    if host.kinds.is_empty() {
        return spec(
            false,
            reasons::NO_TEE_HARDWARE,
            "no TEE kind has capacity on this host: nothing to limit".into(),
        );
    }
    if !host.delegated {
        return spec(
            false,
            reasons::NOT_DELEGATED,
            format!(
                "no limit is written, because the runtime would fail container creation: {}",
                host.delegation_reason
            ),
        );
    }
    match m {
        Mechanism::Nri => match input.nri {
            Some(NriState::Registered { runtime }) => spec(
                true,
                reasons::NRI,
                format!("registered with {runtime}; containers get misc.max at creation"),
            ),
            Some(NriState::Disconnected { reason }) => spec(
                false,
                reasons::NRI_UNAVAILABLE,
                format!("the NRI plugin is not connected ({reason}); retrying"),
            ),
            _ => spec(
                false,
                reasons::NRI_UNAVAILABLE,
                "connecting to the runtime's NRI socket".into(),
            ),
        },
        _ => {
            let w = input.writer.cloned().unwrap_or_default();
            if let Some(why) = &w.not_delegated {
                return spec(false, reasons::NOT_DELEGATED, why.clone());
            }
            let mut detail = format!(
                "pod cgroups get misc.max when they appear; {} pods limited, {} waiting for their cgroup",
                w.applied, w.waiting
            );
            if let Some(f) = &w.last_failure {
                detail.push_str(&format!("; last failure: {f}"));
            }
            spec(true, reasons::CGROUP, detail)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(kinds: &[TeeKind], delegated: bool) -> HostFacts {
        HostFacts {
            kinds: kinds.to_vec(),
            delegated,
            delegation_reason: if delegated {
                "pod cgroups under /sys/fs/cgroup/kubepods.slice carry misc.current".into()
            } else {
                "kubepods.slice/cgroup.subtree_control does not enable the misc controller".into()
            },
            kubepods: Some("/sys/fs/cgroup/kubepods.slice".into()),
            driver: Some(Driver::Systemd),
        }
    }

    fn cond(
        mechanism: Mechanism,
        host: Option<&HostFacts>,
        nri: Option<&NriState>,
        writer: Option<&WriterStatus>,
    ) -> ConditionSpec {
        condition(&EnforcingInput {
            mechanism,
            strict: false,
            host,
            nri,
            writer,
            unavailable: None,
        })
    }

    #[test]
    fn enforcing_names_a_pod_given_no_line_for_a_kind_without_capacity_and_stays_true() {
        let ok = host(&[TeeKind::Sev], true);
        let note = unavailable_note("vms/snp", Some("compute"), &[TeeKind::SevEs], &ok.kinds);
        assert_eq!(
            note,
            "vms/snp (container compute) asks for sev_es keys, which this host has no capacity for \
             (misc.capacity: sev): no misc.max line is set for them, since the kernel refuses it (EINVAL) \
             and the runtime would not start the container"
        );
        let c = condition(&EnforcingInput {
            mechanism: Mechanism::Cgroup,
            strict: true,
            host: Some(&ok),
            nri: None,
            writer: Some(&WriterStatus::default()),
            unavailable: Some(&note),
        });
        assert_eq!((c.status, c.reason), ("True", reasons::CGROUP));
        assert!(c.message.ends_with(&note), "{}", c.message);
    }

    #[test]
    fn enforcing_says_which_mechanism_and_why_not() {
        let ok = host(&[TeeKind::Tdx], true);
        let registered = NriState::Registered {
            runtime: "containerd 2.1.0".into(),
        };
        let c = cond(Mechanism::Nri, Some(&ok), Some(&registered), None);
        assert_eq!((c.status, c.reason), ("True", reasons::NRI));
        assert!(
            c.message.starts_with("mechanism nri; strict off;"),
            "{}",
            c.message
        );
        assert!(c.message.contains("containerd 2.1.0"));

        let down = NriState::Disconnected {
            reason: "cannot connect to /var/run/nri/nri.sock: connection refused".into(),
        };
        let c = cond(Mechanism::Nri, Some(&ok), Some(&down), None);
        assert_eq!((c.status, c.reason), ("False", reasons::NRI_UNAVAILABLE));
        assert!(c.message.contains("connection refused"));

        let c = cond(
            Mechanism::Cgroup,
            Some(&ok),
            None,
            Some(&WriterStatus {
                applied: 2,
                waiting: 1,
                ..Default::default()
            }),
        );
        assert_eq!((c.status, c.reason), ("True", reasons::CGROUP));
        assert!(
            c.message.contains("2 pods limited, 1 waiting"),
            "{}",
            c.message
        );

        let c = cond(
            Mechanism::Cgroup,
            Some(&host(&[TeeKind::Tdx], false)),
            None,
            None,
        );
        assert_eq!((c.status, c.reason), ("False", reasons::NOT_DELEGATED));
        assert!(c.message.contains("subtree_control"), "{}", c.message);

        let c = cond(
            Mechanism::Nri,
            Some(&host(&[], true)),
            Some(&registered),
            None,
        );
        assert_eq!((c.status, c.reason), ("False", reasons::NO_TEE_HARDWARE));

        let c = cond(Mechanism::Off, Some(&ok), None, None);
        assert_eq!(
            (c.status, c.reason, c.type_),
            ("False", reasons::OFF, "Enforcing")
        );

        let c = cond(Mechanism::Cgroup, None, None, None);
        assert_eq!(c.reason, reasons::NOT_SCANNED);

        let not_delegated = WriterStatus {
            not_delegated: Some("pod cgroup /x has no misc.max".into()),
            ..Default::default()
        };
        let c = cond(Mechanism::Cgroup, Some(&ok), None, Some(&not_delegated));
        assert_eq!((c.status, c.reason), ("False", reasons::NOT_DELEGATED));
    }
}
