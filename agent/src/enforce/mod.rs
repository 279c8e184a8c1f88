//! Kernel enforcement: the agent makes the kernel hold every pod to the keys it was scheduled for, by
//! setting `misc.max` on its cgroup — through the runtime's NRI (container level, at creation) or by
//! writing the pod cgroup's file itself (the cgroup writer).
//!
//! - [`limits`]: pure decisions (which value for which pod and container; strict mode);
//! - [`nri`]: the NRI plugin (wire format, transport, connection);
//! - [`containers`]: the plugin's decisions from the pod cache;
//! - [`cgroup`]: the cgroup writer;
//! - [`events`]: Warning Events on pods;
//! - this module: choosing the mechanism, starting it, and the `Enforcing` condition.
//!
//! Never breaking a container start: runc fails a container whose `misc.max` cannot be written (the misc
//! controller not enabled in its cgroup), so no limit is set until a scan has shown the controller
//! delegated down to pod cgroups (`PerPodAccounting`), and every request the plugin cannot read is
//! answered without adjustment.

pub mod cgroup;
pub mod containers;
pub mod events;
pub mod limits;
pub mod nri;

use std::path::{Path, PathBuf};

use teeguard_shared::TeeKind;
use teeguard_shared::config::EnforcementMode;
use teeguard_shared::names::conditions as ct;

use crate::attribution::Accounting;
use crate::report::ConditionSpec;
use crate::scan::{Driver, HostState};

use self::cgroup::WriterStatus;
use self::nri::plugin::NriState;

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

/// The mechanism for a mode: `auto` takes NRI when the runtime's socket exists at start-up.
pub fn choose(mode: EnforcementMode, nri_socket: &Path) -> Mechanism {
    match mode {
        EnforcementMode::Off => Mechanism::Off,
        EnforcementMode::Nri => Mechanism::Nri,
        EnforcementMode::Cgroup => Mechanism::Cgroup,
        EnforcementMode::Auto => {
            if nri_socket.exists() {
                Mechanism::Nri
            } else {
                Mechanism::Cgroup
            }
        }
    }
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
}

/// The `Enforcing` condition (pure).
pub fn condition(input: &EnforcingInput<'_>) -> ConditionSpec {
    let m = input.mechanism;
    let strict = if input.strict { "on" } else { "off" };
    let spec = |ok: bool, reason: &'static str, detail: String| ConditionSpec {
        type_: ct::ENFORCING,
        status: if ok { "True" } else { "False" },
        reason,
        message: format!("mechanism {}; strict {strict}; {detail}", m.name()),
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
mod tests;

/// The running enforcement, as the poll loop sees it.
#[derive(Debug)]
pub struct Enforcement {
    mechanism: Mechanism,
    strict: bool,
    exempt_namespaces: crate::pods::ExemptNamespaces,
    resources: std::sync::Arc<teeguard_shared::config::ResourcesConfig>,
    host_tx: tokio::sync::watch::Sender<HostFacts>,
    host_seen: bool,
    desired_tx: tokio::sync::watch::Sender<cgroup::Desired>,
    nri: tokio::sync::watch::Receiver<NriState>,
    writer: tokio::sync::watch::Receiver<WriterStatus>,
}

/// What [`Enforcement::start`] needs.
pub struct StartOptions {
    /// The configuration's `enforcement` section.
    pub config: teeguard_shared::config::EnforcementConfig,
    /// Resource names.
    pub resources: teeguard_shared::config::ResourcesConfig,
    /// The node's pods (the agent's watch).
    pub pods: kube::runtime::reflector::Store<crate::pods::CachedPod>,
    /// Namespaces labelled exempt (the agent's watch, in strict mode).
    pub exempt_namespaces: crate::pods::ExemptNamespaces,
    /// For looking up pods the cache does not know yet (NRI), and Events. `None`: no lookups, no Events.
    pub client: Option<kube::Client>,
    /// This node.
    pub node_name: String,
    /// The poll interval (the cgroup writer's sweep).
    pub poll_interval: std::time::Duration,
    /// Metrics.
    pub metrics: crate::metrics::Metrics,
}

impl std::fmt::Debug for StartOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StartOptions")
            .field("config", &self.config)
            .field("node_name", &self.node_name)
            .finish_non_exhaustive()
    }
}

impl Enforcement {
    /// Choose the mechanism and start it (tasks stop with `shutdown`).
    pub fn start(opts: StartOptions, shutdown: tokio_util::sync::CancellationToken) -> Enforcement {
        use std::sync::Arc;
        use tokio::sync::watch;
        let mechanism = choose(opts.config.mode, &opts.config.nri_socket);
        let (host_tx, host_rx) = watch::channel(HostFacts::default());
        let (desired_tx, desired_rx) = watch::channel(cgroup::Desired::default());
        let (nri_tx, nri) = watch::channel(NriState::default());
        let (writer_tx, writer) = watch::channel(WriterStatus::default());
        let resources = Arc::new(opts.resources);
        let events = match &opts.client {
            Some(c) => events::EventSink::start(c.clone(), &opts.node_name, shutdown.clone()),
            None => events::EventSink::disabled(),
        };
        tracing::info!(
            mechanism = mechanism.name(),
            mode = ?opts.config.mode,
            strict = opts.config.strict,
            nri_socket = %opts.config.nri_socket.display(),
            "kernel enforcement"
        );
        match mechanism {
            Mechanism::Nri => {
                let containers = containers::NriContainers {
                    pods: opts.pods,
                    client: opts.client,
                    host: host_rx,
                    resources: resources.clone(),
                    strict: opts.config.strict,
                    exempt_namespaces: opts.exempt_namespaces.clone(),
                    metrics: opts.metrics.clone(),
                    events,
                };
                let config = nri::plugin::PluginConfig {
                    socket: opts.config.nri_socket.clone(),
                    index: opts.config.nri_plugin_index.clone(),
                };
                let metrics = opts.metrics.clone();
                let mut state = nri_tx.subscribe();
                let stop = shutdown.clone();
                tokio::spawn(async move {
                    loop {
                        let registered =
                            matches!(*state.borrow_and_update(), NriState::Registered { .. });
                        metrics.nri_connected.set(i64::from(registered));
                        tokio::select! {
                            () = stop.cancelled() => return,
                            r = state.changed() => if r.is_err() { return },
                        }
                    }
                });
                tokio::spawn(nri::plugin::run(
                    config,
                    Arc::new(containers),
                    nri_tx,
                    shutdown,
                ));
            }
            Mechanism::Cgroup => {
                let writer = cgroup::Writer {
                    host: host_rx,
                    desired: desired_rx,
                    status: writer_tx,
                    metrics: opts.metrics.clone(),
                    events,
                    sweep_every: opts.poll_interval,
                };
                tokio::spawn(writer.run(shutdown));
            }
            Mechanism::Off => {}
        }
        Enforcement {
            mechanism,
            strict: opts.config.strict,
            exempt_namespaces: opts.exempt_namespaces,
            resources,
            host_tx,
            host_seen: false,
            desired_tx,
            nri,
            writer,
        }
    }

    /// The mechanism in use.
    pub fn mechanism(&self) -> Mechanism {
        self.mechanism
    }

    /// After every scan: what the host allows (a failed scan keeps the previous facts).
    pub fn observe_scan(&mut self, state: &HostState) {
        if let Some(facts) = HostFacts::from_scan(state) {
            // The first scan is news even when it finds the defaults: the NRI plugin waits for it.
            let first = !self.host_seen;
            self.host_seen = true;
            self.host_tx.send_if_modified(|f| {
                let changed = first || *f != facts;
                *f = facts;
                changed
            });
        }
    }

    /// After the pods or the host changed: the pod cgroups' limits (cgroup writer only).
    pub fn set_pods<'a>(
        &self,
        pods: impl IntoIterator<Item = &'a k8s_openapi::api::core::v1::Pod>,
    ) {
        if self.mechanism != Mechanism::Cgroup {
            return;
        }
        let host = self.host_tx.borrow().clone();
        let policy = limits::Policy {
            resources: &self.resources,
            host_kinds: &host.kinds,
            strict: self.strict,
        };
        let mut desired = std::collections::BTreeMap::new();
        for pod in pods {
            let terminated = pod
                .status
                .as_ref()
                .and_then(|s| s.phase.as_deref())
                .is_some_and(|p| p == "Succeeded" || p == "Failed");
            let (Some(uid), Some(ns), Some(name)) = (
                pod.metadata.uid.clone(),
                pod.metadata.namespace.clone(),
                pod.metadata.name.clone(),
            ) else {
                continue;
            };
            if terminated {
                continue;
            }
            let namespace_exempt = self.exempt_namespaces.contains(&ns);
            let pod_limits = limits::pod_limits(pod, namespace_exempt, policy);
            if !pod_limits.is_empty() {
                desired.insert(
                    uid.clone(),
                    cgroup::DesiredPod {
                        pod: events::PodRef {
                            namespace: ns,
                            name,
                            uid,
                        },
                        limits: pod_limits,
                    },
                );
            }
        }
        self.desired_tx.send_if_modified(|d| {
            let changed = **d != desired;
            if changed {
                *d = std::sync::Arc::new(desired);
            }
            changed
        });
    }

    /// The `Enforcing` condition now.
    pub fn condition(&self) -> ConditionSpec {
        let host = self.host_tx.borrow().clone();
        let nri = self.nri.borrow().clone();
        let writer = self.writer.borrow().clone();
        condition(&EnforcingInput {
            mechanism: self.mechanism,
            strict: self.strict,
            host: self.host_seen.then_some(&host),
            nri: (self.mechanism == Mechanism::Nri).then_some(&nri),
            writer: (self.mechanism == Mechanism::Cgroup).then_some(&writer),
        })
    }
}
