//! The report's conditions (`KernelReadable`, `TeeHardware`, `PerPodAccounting`, `Advertising`; the
//! enforcers add `Enforcing`) with their reasons and messages, and their transition times. Pure.

use std::collections::BTreeMap;

use jiff::Timestamp;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use teeguard_shared::TeeKind;
use teeguard_shared::config::ResourcesConfig;
use teeguard_shared::misc::CgroupLayout;
use teeguard_shared::names::{conditions as ct, reasons};

use super::KernelView;
use crate::decide::advertise::{AdvertiseOutcome, KindAdvert, Manager};
use crate::decide::attribution::{Accounting, KindFigures};
use crate::decide::host::{HostState, UsageSource};

/// A condition before timestamps are applied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConditionSpec {
    /// Condition type.
    pub type_: &'static str,
    /// `True`, `False` or `Unknown`.
    pub status: &'static str,
    /// CamelCase reason.
    pub reason: &'static str,
    /// Human-readable message.
    pub message: String,
}

fn cond(type_: &'static str, ok: bool, reason: &'static str, message: String) -> ConditionSpec {
    ConditionSpec {
        type_,
        status: if ok { "True" } else { "False" },
        reason,
        message,
    }
}

/// The conditions for the current state, in a fixed order.
pub fn conditions(
    kernel: &KernelView,
    figures: &BTreeMap<TeeKind, KindFigures>,
    advertising: &AdvertiseOutcome,
    resources: &ResourcesConfig,
) -> Vec<ConditionSpec> {
    let mut out = Vec::with_capacity(4);
    out.push(match (&kernel.error, &kernel.last_good) {
        (Some(e), Some(_)) => cond(
            ct::KERNEL_READABLE,
            false,
            reasons::SCAN_FAILED,
            format!("{e}; the figures are from the last successful scan"),
        ),
        (Some(e), None) => cond(ct::KERNEL_READABLE, false, reasons::SCAN_FAILED, e.clone()),
        (None, Some(HostState::NoController { .. })) => cond(
            ct::KERNEL_READABLE,
            true,
            reasons::SCANNED,
            "the cgroup root was read; it has no misc controller".into(),
        ),
        (None, Some(HostState::Scanned(scan))) => {
            let layout = match scan.layout {
                CgroupLayout::V2 => "cgroup v2",
                CgroupLayout::V1 => "cgroup v1",
            };
            let mut msg = format!(
                "read the misc files in {} ({layout})",
                scan.misc_dir.display()
            );
            if let Some(p) = scan.pods.as_ref().filter(|p| p.problem_count > 0) {
                msg.push_str(&format!(
                    "; {} pod cgroup(s) could not be read and count as holding no key: {}",
                    p.problem_count,
                    p.problems.first().map(String::as_str).unwrap_or("")
                ));
            }
            let reason = match scan.usage_source {
                UsageSource::Root => reasons::SCANNED,
                UsageSource::TopLevel => {
                    msg.push_str(
                        "; this kernel has no root misc.current (Linux 6.1, RHEL 9): kernelUsed is \
                         the sum of the top-level cgroups, so keys held by processes in the root \
                         cgroup itself are not counted (a refusal they cause is counted in no file \
                         either; the refused pod stays pending)",
                    );
                    reasons::ROOT_USAGE_NOT_SHOWN
                }
                UsageSource::Hidden => {
                    msg.push_str(
                        "; this kernel has no root misc.current and the root's \
                         cgroup.subtree_control does not enable the misc controller, so every key \
                         is charged to the root cgroup and no file shows the usage: kernelUsed \
                         counts the keys of Running pods that request them, keys held outside \
                         Kubernetes are not seen",
                    );
                    reasons::USAGE_NOT_SHOWN
                }
            };
            cond(ct::KERNEL_READABLE, true, reason, msg)
        }
        (None, None) => ConditionSpec {
            type_: ct::KERNEL_READABLE,
            status: "Unknown",
            reason: reasons::SCAN_FAILED,
            message: "the misc files have not been read yet".into(),
        },
    });

    out.push(match &kernel.last_good {
        None => ConditionSpec {
            type_: ct::TEE_HARDWARE,
            status: "Unknown",
            reason: reasons::SCAN_FAILED,
            message: "the misc files have not been read successfully yet".into(),
        },
        Some(HostState::NoController { message }) => cond(
            ct::TEE_HARDWARE,
            false,
            reasons::NO_TEE_HARDWARE,
            message.clone(),
        ),
        Some(HostState::Scanned(scan)) if scan.capacity.is_zero() => cond(
            ct::TEE_HARDWARE,
            false,
            reasons::NO_TEE_HARDWARE,
            format!(
                "{}/misc.capacity lists no tdx, sev or sev_es capacity",
                scan.misc_dir.display()
            ),
        ),
        Some(HostState::Scanned(scan)) => cond(
            ct::TEE_HARDWARE,
            true,
            reasons::TEE_CAPACITY_FOUND,
            scan.capacity
                .nonzero()
                .map(|(k, v)| format!("{k}: {v} keys"))
                .collect::<Vec<_>>()
                .join(", "),
        ),
    });

    if let Some(HostState::Scanned(scan)) = &kernel.last_good
        && let Some(pods) = &scan.pods
    {
        out.push(match pods.accounting {
            Accounting::PerPod => cond(
                ct::PER_POD_ACCOUNTING,
                true,
                reasons::MISC_DELEGATED,
                pods.accounting_reason.clone(),
            ),
            Accounting::RunningPods => cond(
                ct::PER_POD_ACCOUNTING,
                false,
                reasons::MISC_NOT_DELEGATED,
                format!(
                    "{}; counting Running pods that request the resources as holding them",
                    pods.accounting_reason
                ),
            ),
        });
    }

    out.push(if kernel.last_good.is_none() {
        ConditionSpec {
            type_: ct::ADVERTISING,
            status: "Unknown",
            reason: reasons::SCAN_FAILED,
            message: "nothing is advertised or removed until the misc files have been read".into(),
        }
    } else {
        advertising_condition(figures, advertising, resources)
    });
    out
}

/// DRA mode's conditions: `DraBypassed` (the Node still shows a kind's extended resource) and
/// `DraDriverReady` (registered with the kubelet, slices published).
pub fn dra_conditions(view: &crate::decide::dra::DraView) -> Vec<ConditionSpec> {
    let bypassed = if view.bypassed.is_empty() {
        cond(
            ct::DRA_BYPASSED,
            false,
            reasons::NOT_ADVERTISED,
            "the Node's allocatable names no TEE key resource: the scheduler allocates the keys from \
             this node's ResourceSlices"
                .into(),
        )
    } else {
        let what: Vec<String> = view
            .bypassed
            .iter()
            .map(|b| format!("{}={} (written by {})", b.resource, b.value, b.writer))
            .collect();
        cond(
            ct::DRA_BYPASSED,
            true,
            reasons::EXTENDED_RESOURCE_ADVERTISED,
            format!(
                "the Node's allocatable has {}: the scheduler places pods requesting it by that value \
                 and bypasses DRA on this node; stop that writer here (for NFD, kata-deploy's \
                 NodeFeatureRule)",
                what.join(", ")
            ),
        )
    };
    let devices: u64 = view.plan.values().map(|d| d.published.len() as u64).sum();
    let ready = match (&view.registered, &view.publish_error) {
        (_, Some(e)) => cond(
            ct::DRA_DRIVER_READY,
            false,
            reasons::PUBLISH_FAILED,
            format!("cannot write the node's ResourceSlices: {e}"),
        ),
        (Some(Err(e)), None) => cond(
            ct::DRA_DRIVER_READY,
            false,
            reasons::REGISTRATION_REFUSED,
            format!("the kubelet refused to register the DRA driver: {e}"),
        ),
        (None, None) => ConditionSpec {
            type_: ct::DRA_DRIVER_READY,
            status: "Unknown",
            reason: reasons::WAITING_FOR_KUBELET,
            message: format!(
                "{devices} devices published in {} ResourceSlices; the kubelet has not registered \
                 the driver yet (is agent.kubeletDir the kubelet's root directory?)",
                view.slices
            ),
        },
        (Some(Ok(())), None) => cond(
            ct::DRA_DRIVER_READY,
            true,
            reasons::PUBLISHED,
            format!(
                "registered with the kubelet; {devices} devices published in {} ResourceSlices",
                view.slices
            ),
        ),
    };
    vec![bypassed, ready]
}

fn advertising_condition(
    figures: &BTreeMap<TeeKind, KindFigures>,
    advertising: &AdvertiseOutcome,
    resources: &ResourcesConfig,
) -> ConditionSpec {
    if !advertising.enabled {
        return cond(
            ct::ADVERTISING,
            false,
            reasons::ADVERTISING_DISABLED,
            "agent.advertise is false: the agent does not advertise extended resources on the Node"
                .into(),
        );
    }
    if figures.is_empty() {
        return cond(
            ct::ADVERTISING,
            false,
            reasons::NO_TEE_HARDWARE,
            "nothing to advertise: the host has no TEE key capacity".into(),
        );
    }
    let mut advertised = Vec::new();
    let mut foreign = Vec::new();
    for (kind, a) in &advertising.per_kind {
        let name = resources.resource_name(*kind);
        match a {
            KindAdvert::Advertised(v) => advertised.push(format!("{name}={v}")),
            KindAdvert::OwnedByOther { manager, value } => {
                foreign.push(owned_by_other(name, *manager, *value, figures.get(kind)))
            }
            KindAdvert::Disabled => {}
        }
    }
    let mut msg = if foreign.is_empty() {
        format!("advertising {}", advertised.join(", "))
    } else if advertised.is_empty() {
        foreign.join("; ")
    } else {
        format!(
            "{}; advertising {}",
            foreign.join("; "),
            advertised.join(", ")
        )
    };
    if let Some(e) = &advertising.error {
        msg.push_str(&format!(" (updating the Node failed, retrying: {e})"));
    }
    if foreign.is_empty() {
        cond(ct::ADVERTISING, true, reasons::ADVERTISED, msg)
    } else {
        cond(ct::ADVERTISING, false, reasons::OWNED_BY_OTHER, msg)
    }
}

/// README section that tells how to hand a name NFD holds to teeguard.
pub const HANDOVER_SECTION: &str = "Handing the key resources to teeguard";

/// What a resource someone else manages means for the scheduler, with the numbers: the value on the
/// Node against what teeguard would advertise (`capacity − external`), and what to do about it.
pub fn owned_by_other(
    name: &str,
    manager: Manager,
    value: Option<u64>,
    figures: Option<&KindFigures>,
) -> String {
    let shown = match value {
        Some(v) => format!("value {v}"),
        None => "no value on the Node".to_string(),
    };
    let mut msg = format!(
        "{name} is managed by {manager} ({}; {shown})",
        manager.evidence()
    );
    if let Some(f) = figures {
        let would = f.advertisable();
        msg.push_str(&format!(
            "; teeguard would advertise {would} (capacity {} − {} held outside Kubernetes)",
            f.capacity, f.external
        ));
        msg.push_str(&match value {
            Some(v) if v > would => {
                ": the scheduler may place pods on keys that are not free".to_string()
            }
            Some(v) if v == would => ": the same for now, but keys taken outside Kubernetes later stay invisible to the scheduler".to_string(),
            Some(v) => format!(": the scheduler leaves {} usable keys idle", would - v),
            None => ": the scheduler places no pod that needs it on this node".to_string(),
        });
    }
    match manager {
        Manager::Nfd => msg.push_str(&format!(
            ". Hand the name to teeguard: see README '{HANDOVER_SECTION}'"
        )),
        Manager::Other => msg.push_str(
            ". To have teeguard advertise it, stop whatever sets it and remove it from the Node's status",
        ),
        Manager::Overwritten => {}
    }
    msg
}

/// Apply timestamps: keep a previous condition's `lastTransitionTime` when its status is unchanged.
pub fn merge_conditions(
    previous: &[Condition],
    specs: Vec<ConditionSpec>,
    now: Timestamp,
) -> Vec<Condition> {
    specs
        .into_iter()
        .map(|s| {
            let last_transition_time = previous
                .iter()
                .find(|c| c.type_ == s.type_ && c.status == s.status)
                .map(|c| c.last_transition_time.clone())
                .unwrap_or_else(|| Time(now));
            Condition {
                type_: s.type_.to_string(),
                status: s.status.to_string(),
                reason: s.reason.to_string(),
                message: s.message,
                last_transition_time,
                observed_generation: None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::tests::{find, outcome, scan};
    use super::*;
    use crate::decide::attribution::{PodPhase, PodSummary};
    use crate::decide::counts::KindCounts;

    fn tdx_figures(capacity: u64, external: u64) -> KindFigures {
        KindFigures {
            capacity,
            kernel_used: external + 1,
            pods_used: 1,
            external,
            pending: 0,
            free: capacity - external - 1,
        }
    }

    #[test]
    fn advertising_condition_says_nfd_advertises_keys_held_outside_kubernetes_with_the_numbers() {
        let res = ResourcesConfig::default();
        // The host: 16 TDX keys, a VM pod holding 1, 3 held outside Kubernetes; NFD shows 16.
        let kernel = KernelView {
            last_good: Some(scan(
                &[(TeeKind::Tdx, 16)],
                &[(TeeKind::Tdx, 4)],
                Accounting::PerPod,
            )),
            error: None,
        };
        let pods = vec![PodSummary {
            uid: "vm1".into(),
            name: "ns/vm1".into(),
            phase: PodPhase::Running,
            requests: KindCounts::from_pairs([(TeeKind::Tdx, 1)]),
            dra_claim: false,
        }];
        let figures = kernel.figures(&pods);
        let adv = outcome(&[(
            TeeKind::Tdx,
            KindAdvert::OwnedByOther {
                manager: Manager::Nfd,
                value: Some(16),
            },
        )]);
        let specs = conditions(&kernel, &figures, &adv, &res);
        let c = find(&specs, ct::ADVERTISING).expect("Advertising");
        assert_eq!((c.status, c.reason), ("False", reasons::OWNED_BY_OTHER));
        assert_eq!(
            c.message,
            "tdx.intel.com/keys is managed by node-feature-discovery (its \
             nfd.node.kubernetes.io/extended-resources annotation lists it; value 16); teeguard \
             would advertise 13 (capacity 16 − 3 held outside Kubernetes): the scheduler may place \
             pods on keys that are not free. Hand the name to teeguard: see README 'Handing the key \
             resources to teeguard'"
        );
    }

    #[test]
    fn owned_by_other_message_tells_what_the_value_means_for_the_scheduler() {
        let name = "tdx.intel.com/keys";
        let f = tdx_figures(16, 3);
        /// (manager, value on the Node, figures, the message has, the message lacks)
        type Case<'a> = (
            Manager,
            Option<u64>,
            Option<&'a KindFigures>,
            Vec<&'a str>,
            Vec<&'a str>,
        );
        let cases: Vec<Case<'_>> = vec![
            (
                Manager::Nfd,
                Some(13),
                Some(&f),
                vec![
                    "(its nfd.node.kubernetes.io/extended-resources annotation lists it; value 13)",
                    "would advertise 13 (capacity 16 − 3 held outside Kubernetes): the same for now, but keys taken outside Kubernetes later stay invisible to the scheduler",
                    "see README 'Handing the key resources to teeguard'",
                ],
                vec!["not free"],
            ),
            (
                Manager::Nfd,
                Some(10),
                Some(&f),
                vec!["value 10", "the scheduler leaves 3 usable keys idle"],
                vec!["not free"],
            ),
            (
                Manager::Nfd,
                None,
                Some(&f),
                vec![
                    "(its nfd.node.kubernetes.io/extended-resources annotation lists it; no value on the Node)",
                    "the scheduler places no pod that needs it on this node",
                ],
                vec![],
            ),
            (
                Manager::Other,
                Some(16),
                Some(&f),
                vec![
                    "is managed by another manager (the Node had it and teeguard did not add it; value 16)",
                    "the scheduler may place pods on keys that are not free",
                    "stop whatever sets it and remove it from the Node's status",
                ],
                vec!["README"],
            ),
            (
                Manager::Overwritten,
                Some(20),
                Some(&f),
                vec![
                    "is managed by an unknown writer (it just replaced teeguard's value; teeguard writes its own back within 5 s unless NFD lists the name; value 20)",
                    "would advertise 13",
                ],
                vec!["README", "remove it"],
            ),
            (
                Manager::Nfd,
                Some(16),
                None,
                vec!["value 16). Hand the name to teeguard"],
                vec!["would advertise"],
            ),
        ];
        for (manager, value, figures, has, lacks) in cases {
            let msg = owned_by_other(name, manager, value, figures);
            assert!(
                msg.starts_with("tdx.intel.com/keys is managed by "),
                "{msg}"
            );
            for part in has {
                assert!(
                    msg.contains(part),
                    "{manager:?} {value:?}: {msg:?} lacks {part:?}"
                );
            }
            for part in lacks {
                assert!(
                    !msg.contains(part),
                    "{manager:?} {value:?}: {msg:?} has {part:?}"
                );
            }
        }
    }
}
