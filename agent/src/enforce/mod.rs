//! Kernel enforcement: the agent makes the kernel hold every pod to the keys it was scheduled for, by
//! setting `misc.max` on its cgroup — through the runtime's NRI (container level, at creation) or by
//! writing the pod cgroup's file itself (the cgroup writer). This layer wires the pieces below it:
//!
//! - [`containers`]: the NRI plugin's answers ([`crate::runtime`]) from the pod cache
//!   ([`crate::cluster::watch`]) and the limits ([`crate::decide::limits`]), with metrics and Events;
//! - [`cgroup`]: the cgroup writer's loop (its file I/O: [`crate::kernel::misc_max`]);
//! - this module: choosing the mechanism, starting it, and its state for the `Enforcing` condition
//!   ([`crate::decide::enforcing`]).
//!
//! Never breaking a container start: runc fails a container whose `misc.max` cannot be written (the misc
//! controller not enabled in its cgroup), so no limit is set until a scan has shown the controller
//! delegated down to pod cgroups (`PerPodAccounting`), and every request the plugin cannot read is
//! answered without adjustment.

pub mod cgroup;
pub mod containers;

use std::path::Path;

use teeguard_shared::TeeKind;
use teeguard_shared::config::EnforcementMode;

use crate::cluster::events;
use crate::cluster::watch::ExemptNamespaces;
use crate::decide::attribution::PodsView;
use crate::decide::claimed::ClaimedKeys;
use crate::decide::counts::KindCounts;
use crate::decide::enforcing::{
    EnforcingInput, HostFacts, Mechanism, NriState, WriterStatus, condition, unavailable_note,
};
use crate::decide::host::{HostState, Refusals};
use crate::decide::limits;
use crate::decide::report::ConditionSpec;
use crate::runtime::plugin as nri_plugin;

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

#[cfg(test)]
mod tests;

/// The running enforcement, as the poll loop sees it.
#[derive(Debug)]
pub struct Enforcement {
    mechanism: Mechanism,
    strict: bool,
    exempt_namespaces: ExemptNamespaces,
    resources: std::sync::Arc<teeguard_shared::config::ResourcesConfig>,
    host_tx: tokio::sync::watch::Sender<HostFacts>,
    host_seen: bool,
    desired_tx: tokio::sync::watch::Sender<cgroup::Desired>,
    nri: tokio::sync::watch::Receiver<NriState>,
    writer: tokio::sync::watch::Receiver<WriterStatus>,
    claims: tokio::sync::watch::Receiver<std::sync::Arc<ClaimedKeys>>,
    events: events::EventSink,
    /// The last pod or container given no line for a kind without capacity here.
    unavailable: tokio::sync::watch::Sender<Option<String>>,
    /// Failed charges counted per pod cgroup and in kubepods at the previous scan (`None` before the
    /// first: what was counted before the agent started is not news).
    refused_seen: Option<(KindCounts, std::collections::HashMap<String, KindCounts>)>,
}

/// What [`Enforcement::start`] needs.
pub struct StartOptions {
    /// The configuration's `enforcement` section.
    pub config: teeguard_shared::config::EnforcementConfig,
    /// Resource names.
    pub resources: teeguard_shared::config::ResourcesConfig,
    /// The node's pods (the agent's watch).
    pub pods: kube::runtime::reflector::Store<crate::cluster::cached::CachedPod>,
    /// Namespaces labelled exempt (the agent's watch, in strict mode).
    pub exempt_namespaces: ExemptNamespaces,
    /// For looking up pods the cache does not know yet (NRI), and Events. `None`: no lookups, no Events.
    pub client: Option<kube::Client>,
    /// This node.
    pub node_name: String,
    /// The poll interval (the cgroup writer's sweep).
    pub poll_interval: std::time::Duration,
    /// The claims the DRA driver prepared ([`crate::dra::Dra::claims`]; in extended-resource mode
    /// [`no_claims`]).
    pub claims: tokio::sync::watch::Receiver<std::sync::Arc<ClaimedKeys>>,
    /// Metrics.
    pub metrics: crate::metrics::Metrics,
}

/// The claims of a node without the DRA driver: none, ever.
pub fn no_claims() -> tokio::sync::watch::Receiver<std::sync::Arc<ClaimedKeys>> {
    tokio::sync::watch::channel(std::sync::Arc::new(ClaimedKeys::NONE)).1
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
        let refusal_events = events.clone();
        let (unavailable, _) = watch::channel(None);
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
                    claims: opts.claims.clone(),
                    metrics: opts.metrics.clone(),
                    events,
                    unavailable: unavailable.clone(),
                };
                let config = nri_plugin::PluginConfig {
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
                tokio::spawn(nri_plugin::run(
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
            claims: opts.claims,
            events: refusal_events,
            unavailable,
            refused_seen: None,
        }
    }

    /// After every scan: failed charges counted since the previous scan. A pod cgroup whose
    /// `misc.events` rose gets a `TEEKeyRefused` Event; a rise in kubepods that no pod's explains
    /// (the pods together reached the capacity: the node is full) is logged.
    pub fn observe_refusals(&mut self, refusals: &Refusals, pods: &PodsView) {
        let previous = self
            .refused_seen
            .replace((refusals.kubepods, refusals.pods.clone()));
        let Some((kubepods_before, pods_before)) = previous else {
            return;
        };
        let mut in_pods = KindCounts::ZERO;
        for (uid, now) in &refusals.pods {
            let before = pods_before.get(uid).copied().unwrap_or_default();
            for kind in TeeKind::ALL {
                let rose = now.get(kind).saturating_sub(before.get(kind));
                if rose == 0 {
                    continue;
                }
                in_pods.set(kind, in_pods.get(kind) + rose);
                let Some(pod) = pods.pods.iter().find(|p| p.uid == *uid) else {
                    tracing::warn!(uid = %uid, kind = %kind, refused = rose, "the kernel refused keys in the cgroup of a pod not bound to this node");
                    continue;
                };
                let (namespace, name) = pod.name.split_once('/').unwrap_or(("", &pod.name));
                let note = format!(
                    "the kernel refused {rose} {} key(s) charged in this pod's cgroup (its misc.events counts {}): \
                     a VM asked for more keys than the pod's misc.max allows, or none was left on the node",
                    kind.kernel_name(),
                    now.get(kind)
                );
                tracing::warn!(pod = %pod.name, kind = %kind, refused = rose, "{note}");
                self.events.warn(
                    events::PodRef {
                        namespace: namespace.to_string(),
                        name: name.to_string(),
                        uid: uid.clone(),
                    },
                    events::REASON_REFUSED,
                    note,
                );
            }
        }
        for kind in TeeKind::ALL {
            let rose = refusals
                .kubepods
                .get(kind)
                .saturating_sub(kubepods_before.get(kind));
            let unexplained = rose.saturating_sub(in_pods.get(kind));
            if unexplained > 0 {
                tracing::warn!(kind = %kind, refused = unexplained, "the kernel refused keys in kubepods outside any pod's limit: the pods together hold the whole capacity (the node is full)");
            }
        }
    }

    /// The mechanism in use.
    pub fn mechanism(&self) -> Mechanism {
        self.mechanism
    }

    /// After every scan: what the host allows (a failed scan keeps the previous facts).
    /// Whether the host's facts changed (the pod cgroups' limits then follow, [`Self::set_pods`]).
    pub fn observe_scan(&mut self, state: &HostState) -> bool {
        let Some(facts) = HostFacts::from_scan(state) else {
            return false;
        };
        // The first scan is news even when it finds the defaults: the NRI plugin waits for it.
        let first = !self.host_seen;
        self.host_seen = true;
        self.host_tx.send_if_modified(|f| {
            let changed = first || *f != facts;
            *f = facts;
            changed
        })
    }

    /// After the pods, the host or the prepared claims changed: the pod cgroups' limits (cgroup
    /// writer only).
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
        let claims = self.claims.borrow().clone();
        let mut desired = std::collections::BTreeMap::new();
        let mut note = None;
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
            let missing = limits::pod_unavailable_kinds(pod, &claims, policy);
            if !missing.is_empty() && host.limits_possible() {
                let text = unavailable_note(&format!("{ns}/{name}"), None, &missing, &host.kinds);
                self.events.warn(
                    events::PodRef {
                        namespace: ns.clone(),
                        name: name.clone(),
                        uid: uid.clone(),
                    },
                    events::REASON_KIND_UNAVAILABLE,
                    text.clone(),
                );
                note = Some(text);
            }
            let pod_limits = limits::pod_limits(pod, namespace_exempt, &claims, policy);
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
        let changed = self.unavailable.send_if_modified(|n| {
            let changed = *n != note;
            *n = note.clone();
            changed
        });
        if changed && let Some(n) = &note {
            tracing::warn!("{n}");
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
        let unavailable = self.unavailable.borrow().clone();
        condition(&EnforcingInput {
            mechanism: self.mechanism,
            strict: self.strict,
            host: self.host_seen.then_some(&host),
            nri: (self.mechanism == Mechanism::Nri).then_some(&nri),
            writer: (self.mechanism == Mechanism::Cgroup).then_some(&writer),
            unavailable: unavailable.as_deref(),
        })
    }
}
