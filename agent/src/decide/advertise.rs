//! Advertising the TEE extended resources on the agent's Node, the way Node Feature Discovery does.
//!
//! The agent sets `status.capacity/<resource>` **and** `status.allocatable/<resource>` with a JSON Patch
//! on the Node's `status` subresource. NFD adds only `capacity` for a new resource and relies on the
//! kubelet to copy it into `allocatable` on its next node-status sync, but it replaces and removes both;
//! setting both at once makes the value schedulable immediately and agrees with what the kubelet
//! computes (extended resources have no reservations). The value is `capacity − external`: the keys
//! Kubernetes pods can really get.
//!
//! Ownership: the agent records the resources it added in the Node annotation
//! `teeguard.dev/extended-resources` (comma-separated). It claims a resource in that annotation *before*
//! writing the value and releases it *after* removing the value, so a crash in between never leaves a
//! value nobody owns. It never touches a resource listed in NFD's
//! `nfd.node.kubernetes.io/extended-resources`, nor one already present on the Node that it did not add
//! (a device plugin or another tool manages it). It removes a resource only when that kind disappears
//! from the host or advertising is switched off (`agent.advertise: false`), never on shutdown: running
//! pods rely on it.
//!
//! NFD arriving and leaving ([`Advertiser`] remembers what the Node alone does not show):
//!
//! - NFD takes a name over with two writes: first the value (`replace` of capacity and allocatable, or
//!   `add` of capacity), then its annotation. In between, the Node shows a value teeguard did not write
//!   under a name teeguard still claims. The agent does not write it back at once: it waits
//!   [`OVERWRITE_GRACE`] for the writer to list the name in NFD's annotation, then releases its claim
//!   and leaves NFD's value alone. Nothing is removed, so the value is never absent or 0 on the way. A
//!   writer that never claims the name (a script, a kubelet re-registration) has the agent's value
//!   restored after the grace; an absent or 0 value is restored at once.
//! - NFD drops a name with two writes too: first it removes the value (capacity and allocatable), then
//!   the name from its annotation. Once the annotation no longer lists it, the agent claims the name
//!   and writes its value again at once (the Node watch wakes it): the value is absent from NFD's
//!   first write to the agent's second, a few API round trips. If NFD's value stayed on the Node, the
//!   agent replaces it without any gap, because it remembers that NFD held the name (in memory: after
//!   an agent restart, a left-over value counts as another manager's).
//!
//! [`plan`] is pure: (Node, desired values) → the writes needed (none when the Node already shows them).
//! [`plan_with`] adds what the agent remembers ([`History`]). `cluster::node::apply` performs the
//! writes.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, Patch as JsonPatch, PatchOperation, RemoveOperation};
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use serde_json::json;
use teeguard_shared::TeeKind;
use teeguard_shared::config::ResourcesConfig;
use teeguard_shared::names::{
    AGENT_EXTENDED_RESOURCES_ANNOTATION, NFD_EXTENDED_RESOURCES_ANNOTATION,
};

use super::attribution::KindFigures;

/// NFD's default namespace for resource names listed without one in its annotation.
const NFD_DEFAULT_NS: &str = "feature.node.kubernetes.io";

/// How long the agent leaves a value someone else wrote under a name it owns before writing its own
/// back: NFD writes the value first and lists the name in its annotation right after.
pub const OVERWRITE_GRACE: Duration = Duration::from_secs(5);

/// What the agent wants the Node to show.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Desired {
    /// `agent.advertise`.
    pub enabled: bool,
    /// Value per kind the host has (`capacity − external`); kinds absent from the host are absent here.
    pub values: BTreeMap<TeeKind, u64>,
}

impl Desired {
    /// The desired values for a set of figures.
    pub fn from_figures(enabled: bool, figures: &BTreeMap<TeeKind, KindFigures>) -> Desired {
        Desired {
            enabled,
            values: figures
                .iter()
                .map(|(k, f)| (*k, f.advertisable()))
                .collect(),
        }
    }
}

/// Who else sets a resource the agent leaves alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Manager {
    /// Node Feature Discovery: its `nfd.node.kubernetes.io/extended-resources` annotation lists it
    /// (for TEE keys, kata-deploy's NodeFeatureRule).
    Nfd,
    /// The Node already had it and teeguard did not add it (a device plugin or another tool).
    Other,
    /// Someone just replaced teeguard's value without claiming the name; teeguard waits up to
    /// [`OVERWRITE_GRACE`] for NFD to list it, then writes its own value back.
    Overwritten,
}

impl Manager {
    /// Why the agent thinks so, for the `Advertising` condition.
    pub fn evidence(self) -> String {
        match self {
            Manager::Nfd => format!("its {NFD_EXTENDED_RESOURCES_ANNOTATION} annotation lists it"),
            Manager::Other => "the Node had it and teeguard did not add it".into(),
            Manager::Overwritten => format!(
                "it just replaced teeguard's value; teeguard writes its own back within {} s unless NFD lists the name",
                OVERWRITE_GRACE.as_secs()
            ),
        }
    }
}

impl std::fmt::Display for Manager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Manager::Nfd => "node-feature-discovery",
            Manager::Other => "another manager",
            Manager::Overwritten => "an unknown writer",
        })
    }
}

/// How one kind the host has is advertised.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KindAdvert {
    /// The agent advertises this value (or is about to).
    Advertised(u64),
    /// Advertising is switched off.
    Disabled,
    /// Another manager owns the resource on this Node; the agent leaves it alone.
    OwnedByOther {
        /// Who, as far as the agent can tell.
        manager: Manager,
        /// The value the Node shows (capacity), if any and whole.
        value: Option<u64>,
    },
}

/// The advertising state for the report.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct AdvertiseOutcome {
    /// `agent.advertise`.
    pub enabled: bool,
    /// Per kind the host has.
    pub per_kind: BTreeMap<TeeKind, KindAdvert>,
    /// The last failure writing the Node, if the latest attempt failed.
    pub error: Option<String>,
}

impl AdvertiseOutcome {
    /// The advertised value of a kind, if the agent advertises it.
    pub fn advertised(&self, kind: TeeKind) -> Option<u64> {
        match self.per_kind.get(&kind) {
            Some(KindAdvert::Advertised(v)) => Some(*v),
            _ => None,
        }
    }

    /// The outcome when no Node is at hand (the `scan` subcommand): what the agent would advertise if
    /// nobody else owned the resources.
    pub fn without_node(desired: &Desired) -> AdvertiseOutcome {
        AdvertiseOutcome {
            enabled: desired.enabled,
            per_kind: desired
                .values
                .iter()
                .map(|(k, v)| {
                    let a = if desired.enabled {
                        KindAdvert::Advertised(*v)
                    } else {
                        KindAdvert::Disabled
                    };
                    (*k, a)
                })
                .collect(),
            error: None,
        }
    }
}

/// One write to the Node, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum NodeWrite {
    /// Set (`Some`, comma-separated names) or remove (`None`) `teeguard.dev/extended-resources`.
    Annotation(Option<String>),
    /// JSON Patch on the `status` subresource.
    Status(JsonPatch),
}

/// The writes that bring the Node to the desired state, and the resulting outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// Writes to perform in order; empty when the Node is already right.
    pub writes: Vec<NodeWrite>,
    /// How each kind ends up advertised.
    pub outcome: AdvertiseOutcome,
}

/// What the agent remembers about the Node that the Node itself no longer shows (see [`Advertiser`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct History {
    /// Resources NFD listed while this agent watched: once NFD's annotation no longer lists one, the
    /// agent takes it back even when NFD left its value on the Node.
    pub yielded: BTreeSet<String>,
    /// Resources teeguard claims whose value someone else just replaced (non-zero): left alone for now,
    /// NFD may be about to list them.
    pub overwritten: BTreeSet<String>,
}

/// Compute the writes for `node` (pure), knowing nothing about the Node's past.
pub fn plan(node: &Node, desired: &Desired, resources: &ResourcesConfig) -> Plan {
    plan_with(node, desired, resources, &History::default())
}

fn whole(q: Option<&Quantity>) -> Option<u64> {
    q.and_then(|q| teeguard_shared::pod::parse_whole_quantity(&q.0))
}

/// Compute the writes for `node` (pure), with what the agent remembers.
pub fn plan_with(
    node: &Node,
    desired: &Desired,
    resources: &ResourcesConfig,
    history: &History,
) -> Plan {
    let (ours_before, nfd) = claims(node);
    let status = node.status.as_ref();
    let capacity = status.and_then(|s| s.capacity.as_ref());
    let allocatable = status.and_then(|s| s.allocatable.as_ref());

    let mut claimed = ours_before.clone();
    let mut ours_after = ours_before.clone();
    let mut ops: Vec<PatchOperation> = Vec::new();
    let mut maps = [
        StatusMap::new("capacity", capacity),
        StatusMap::new("allocatable", allocatable),
    ];
    let mut outcome = AdvertiseOutcome {
        enabled: desired.enabled,
        per_kind: BTreeMap::new(),
        error: None,
    };

    for kind in TeeKind::ALL {
        let name = resources.resource_name(kind);
        let ours = ours_before.contains(name);
        let want = desired.values.get(&kind).copied();
        if nfd.contains(name) {
            // NFD owns it: never write the value; stop claiming it if we ever did.
            ours_after.remove(name);
            claimed.remove(name);
            if want.is_some() {
                outcome.per_kind.insert(
                    kind,
                    KindAdvert::OwnedByOther {
                        manager: Manager::Nfd,
                        value: whole(capacity.and_then(|c| c.get(name))),
                    },
                );
            }
            continue;
        }
        match want {
            Some(value) if desired.enabled => {
                let on_node = capacity.and_then(|c| c.get(name));
                // A value NFD left behind when it dropped the name is taken back, like an absent one.
                if on_node.is_some() && !ours && !history.yielded.contains(name) {
                    outcome.per_kind.insert(
                        kind,
                        KindAdvert::OwnedByOther {
                            manager: Manager::Other,
                            value: whole(on_node),
                        },
                    );
                    continue;
                }
                if ours && history.overwritten.contains(name) {
                    outcome.per_kind.insert(
                        kind,
                        KindAdvert::OwnedByOther {
                            manager: Manager::Overwritten,
                            value: whole(on_node),
                        },
                    );
                    continue;
                }
                claimed.insert(name.to_string());
                ours_after.insert(name.to_string());
                outcome.per_kind.insert(kind, KindAdvert::Advertised(value));
                for map in &mut maps {
                    map.set(&mut ops, name, value);
                }
            }
            _ => {
                if want.is_some() {
                    outcome.per_kind.insert(kind, KindAdvert::Disabled);
                }
                if ours {
                    for map in &maps {
                        map.remove(&mut ops, name);
                    }
                    ours_after.remove(name);
                }
            }
        }
    }

    let mut writes = Vec::new();
    if claimed != ours_before {
        writes.push(NodeWrite::Annotation(join_list(&claimed)));
    }
    if !ops.is_empty() {
        writes.push(NodeWrite::Status(JsonPatch(ops)));
    }
    if ours_after != claimed {
        writes.push(NodeWrite::Annotation(join_list(&ours_after)));
    }
    Plan { writes, outcome }
}

/// The JSON Patch on the Node status alone (`None` when nothing needs to change).
pub fn status_patch(
    node: &Node,
    desired: &Desired,
    resources: &ResourcesConfig,
) -> Option<JsonPatch> {
    plan(node, desired, resources)
        .writes
        .into_iter()
        .find_map(|w| match w {
            NodeWrite::Status(p) => Some(p),
            NodeWrite::Annotation(_) => None,
        })
}

/// The agent's advertising with memory: [`plan_with`] plus what the Node alone does not show, namely
/// which names NFD held while the agent watched, and which value the agent last wrote (to notice a
/// writer replacing it). Memory only: a restarted agent starts from the Node as it finds it.
#[derive(Clone, Debug)]
pub struct Advertiser {
    grace: Duration,
    /// The value the agent last saw applied per name it claims.
    written: BTreeMap<String, u64>,
    /// What `written` becomes once the last plan's writes are applied.
    planned: BTreeMap<String, u64>,
    /// Names NFD listed while the agent watched.
    yielded: BTreeSet<String>,
    /// Since when a name the agent claims has shown someone else's value.
    overwritten_since: BTreeMap<String, Instant>,
}

impl Default for Advertiser {
    fn default() -> Self {
        Advertiser::new(OVERWRITE_GRACE)
    }
}

impl Advertiser {
    /// An advertiser that leaves someone else's value under a claimed name alone for `grace`.
    pub fn new(grace: Duration) -> Self {
        Advertiser {
            grace,
            written: BTreeMap::new(),
            planned: BTreeMap::new(),
            yielded: BTreeSet::new(),
            overwritten_since: BTreeMap::new(),
        }
    }

    /// The names NFD held while the agent watched and has not handed back yet.
    pub fn yielded(&self) -> &BTreeSet<String> {
        &self.yielded
    }

    /// The writes for `node` now. Call [`Advertiser::applied`] once they succeeded (a plan without
    /// writes needs no call).
    pub fn plan(
        &mut self,
        node: &Node,
        desired: &Desired,
        resources: &ResourcesConfig,
        now: Instant,
    ) -> Plan {
        let (ours, nfd) = claims(node);
        let capacity = node.status.as_ref().and_then(|s| s.capacity.as_ref());
        let names: BTreeSet<&str> = TeeKind::ALL
            .iter()
            .map(|k| resources.resource_name(*k))
            .collect();

        // A claimed name now showing a non-zero value the agent did not write: someone else wrote it.
        let mut overwritten = BTreeSet::new();
        for name in &ours {
            let seen = whole(capacity.and_then(|c| c.get(name)));
            match (self.written.get(name), seen) {
                (Some(w), Some(v)) if v != *w && v > 0 && !nfd.contains(name) => {
                    let since = *self.overwritten_since.entry(name.clone()).or_insert(now);
                    if now.saturating_duration_since(since) < self.grace {
                        overwritten.insert(name.clone());
                    }
                }
                _ => {
                    self.overwritten_since.remove(name);
                }
            }
        }
        self.overwritten_since.retain(|n, _| ours.contains(n));
        // A name back in the agent's annotation has been handed back.
        self.yielded.retain(|n| !ours.contains(n));
        self.yielded
            .extend(nfd.iter().filter(|n| names.contains(n.as_str())).cloned());

        let history = History {
            yielded: self.yielded.clone(),
            overwritten,
        };
        let plan = plan_with(node, desired, resources, &history);
        self.planned = plan
            .outcome
            .per_kind
            .iter()
            .filter_map(|(kind, a)| {
                let name = resources.resource_name(*kind);
                match a {
                    KindAdvert::Advertised(v) => Some((name.to_string(), *v)),
                    // Still waiting for the writer to claim it: keep comparing with our own value.
                    KindAdvert::OwnedByOther {
                        manager: Manager::Overwritten,
                        ..
                    } => self.written.get(name).map(|w| (name.to_string(), *w)),
                    _ => None,
                }
            })
            .collect();
        if plan.writes.is_empty() {
            self.applied();
        }
        plan
    }

    /// The last plan's writes were applied.
    pub fn applied(&mut self) {
        self.written = self.planned.clone();
    }
}

/// One of the Node's status maps the agent writes (`capacity`, `allocatable`): what the Node shows,
/// and whether the plan adds the map itself.
struct StatusMap<'a> {
    field: &'static str,
    on_node: Option<&'a BTreeMap<String, Quantity>>,
    added: bool,
}

impl<'a> StatusMap<'a> {
    fn new(field: &'static str, on_node: Option<&'a BTreeMap<String, Quantity>>) -> Self {
        StatusMap {
            field,
            on_node,
            added: false,
        }
    }

    /// Set `name` to `value`, unless the Node shows that already.
    fn set(&mut self, ops: &mut Vec<PatchOperation>, name: &str, value: u64) {
        if whole(self.on_node.and_then(|m| m.get(name))) == Some(value) {
            return;
        }
        if self.on_node.is_some() || self.added {
            // `add` on an existing member replaces it (RFC 6902 §4.1).
            ops.push(PatchOperation::Add(AddOperation {
                path: PointerBuf::from_tokens(["status", self.field, name]),
                value: json!(value.to_string()),
            }));
        } else {
            ops.push(PatchOperation::Add(AddOperation {
                path: PointerBuf::from_tokens(["status", self.field]),
                value: json!({ name: value.to_string() }),
            }));
            self.added = true;
        }
    }

    /// Remove `name`, when the Node shows it.
    fn remove(&self, ops: &mut Vec<PatchOperation>, name: &str) {
        if self.on_node.is_some_and(|m| m.contains_key(name)) {
            ops.push(PatchOperation::Remove(RemoveOperation {
                path: PointerBuf::from_tokens(["status", self.field, name]),
            }));
        }
    }
}

/// The resource names the Node's annotations give to teeguard (`teeguard.dev/extended-resources`) and
/// to NFD (`nfd.node.kubernetes.io/extended-resources`, names without a namespace in NFD's default).
fn claims(node: &Node) -> (BTreeSet<String>, BTreeSet<String>) {
    let annotations = node.metadata.annotations.as_ref();
    let ours = parse_list(
        annotations.and_then(|a| a.get(AGENT_EXTENDED_RESOURCES_ANNOTATION)),
        None,
    );
    let nfd = parse_list(
        annotations.and_then(|a| a.get(NFD_EXTENDED_RESOURCES_ANNOTATION)),
        Some(NFD_DEFAULT_NS),
    );
    (ours, nfd)
}

fn parse_list(value: Option<&String>, default_ns: Option<&str>) -> BTreeSet<String> {
    value
        .map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(|s| match default_ns {
                    Some(ns) if !s.contains('/') => format!("{ns}/{s}"),
                    _ => s.to_string(),
                })
                .collect()
        })
        .unwrap_or_default()
}

fn join_list(names: &BTreeSet<String>) -> Option<String> {
    if names.is_empty() {
        None
    } else {
        Some(names.iter().cloned().collect::<Vec<_>>().join(","))
    }
}

#[cfg(test)]
mod tests;
