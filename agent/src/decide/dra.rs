//! DRA mode, pure: which devices the node publishes, how they are cut into ResourceSlices, and whether
//! a claim the kubelet asks the agent to prepare fits the keys the kernel has left.
//!
//! One device per key: `tdx-0`, `tdx-1`, … (`sev-N`, `sev-es-N`), attribute `kind` (`tdx`, `sev`,
//! `sev-es`) under the driver's name. Keys are not addressable (the kernel picks the HKID or ASID when
//! the VM starts), so a device is a token for one key: what matters is how many are published.
//!
//! Withheld keys are not published at all (rather than published with a device taint: device taints
//! are not on by default in Kubernetes v1.36, and a scheduler without them would hand a tainted
//! device out). A key is withheld when something no DRA claim accounts for holds it: a VM outside
//! Kubernetes or another runtime (`external`), or a pod without a claim (one started before the node
//! switched to DRA, or created with `spec.nodeName`, which skips the scheduler).

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::resource::v1::{Device, DeviceAttribute, ResourcePool, ResourceSliceSpec};
use teeguard_shared::TeeKind;
use teeguard_shared::names::{DRA_DRIVER, DRA_KIND_ATTRIBUTE};

use super::attribution::KindFigures;

/// The most devices one ResourceSlice may carry (`ResourceSliceMaxDevices` in resource.k8s.io/v1);
/// a pool with more keys is split over several slices.
pub const MAX_DEVICES_PER_SLICE: usize = 128;

/// A kind as the device attribute and the device names spell it.
pub fn kind_attribute(kind: TeeKind) -> &'static str {
    match kind {
        TeeKind::Tdx => "tdx",
        TeeKind::Sev => "sev",
        TeeKind::SevEs => "sev-es",
    }
}

/// One device: one key of one kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceName {
    /// The kind of key.
    pub kind: TeeKind,
    /// Its number, `0..capacity`.
    pub index: u32,
}

impl DeviceName {
    /// Parse `tdx-3`, `sev-0`, `sev-es-12`.
    pub fn parse(name: &str) -> Option<DeviceName> {
        let (prefix, index) = name.rsplit_once('-')?;
        let kind = TeeKind::ALL
            .into_iter()
            .find(|k| kind_attribute(*k) == prefix)?;
        if index.is_empty() || (index.len() > 1 && index.starts_with('0')) {
            return None;
        }
        Some(DeviceName {
            kind,
            index: index.parse().ok()?,
        })
    }
}

impl std::fmt::Display for DeviceName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", kind_attribute(self.kind), self.index)
    }
}

/// What the node publishes of one kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KindDevices {
    /// The devices in the node's slices.
    pub published: BTreeSet<u32>,
    /// Keys not published: held by something no DRA claim accounts for.
    pub withheld: u64,
    /// Devices prepared for pods on this node (the checkpoint).
    pub allocated: u64,
}

/// Keys held by something no DRA claim accounts for: `external` plus the keys of the pods that
/// request the kind without a claim (never more than the capacity).
pub fn withheld(figures: &KindFigures, claimless_keys: u64) -> u64 {
    figures
        .external
        .saturating_add(claimless_keys)
        .min(figures.capacity)
}

/// The devices to publish for each kind the host has: every device a prepared claim holds, then the
/// lowest-numbered others, until `capacity − withheld` are published. The numbering stays put while
/// nothing changes, so a withheld key always takes the highest free number.
pub fn plan(
    figures: &BTreeMap<TeeKind, KindFigures>,
    claimless_keys: &BTreeMap<TeeKind, u64>,
    allocated: &BTreeMap<TeeKind, BTreeSet<u32>>,
) -> BTreeMap<TeeKind, KindDevices> {
    let mut out = BTreeMap::new();
    for (kind, f) in figures {
        let held = withheld(f, claimless_keys.get(kind).copied().unwrap_or(0));
        let usable = f.capacity - held;
        let empty = BTreeSet::new();
        let taken = allocated.get(kind).unwrap_or(&empty);
        let mut published: BTreeSet<u32> = taken
            .iter()
            .copied()
            .filter(|i| u64::from(*i) < f.capacity)
            .collect();
        let capacity = u32::try_from(f.capacity).unwrap_or(u32::MAX);
        for i in 0..capacity {
            if published.len() as u64 >= usable {
                break;
            }
            published.insert(i);
        }
        out.insert(
            *kind,
            KindDevices {
                published,
                withheld: held,
                allocated: taken.len() as u64,
            },
        );
    }
    out
}

/// The node's pool cut into slices of at most [`MAX_DEVICES_PER_SLICE`] devices, every slice naming
/// the same pool `generation` and the pool's slice count. Devices in kind order, then by number.
pub fn slice_specs(
    node: &str,
    plan: &BTreeMap<TeeKind, KindDevices>,
    generation: i64,
) -> Vec<ResourceSliceSpec> {
    let devices: Vec<Device> = plan
        .iter()
        .flat_map(|(kind, d)| d.published.iter().map(move |i| (*kind, *i)))
        .map(|(kind, index)| Device {
            name: DeviceName { kind, index }.to_string(),
            attributes: Some(BTreeMap::from([(
                DRA_KIND_ATTRIBUTE.to_string(),
                DeviceAttribute {
                    string: Some(kind_attribute(kind).to_string()),
                    ..Default::default()
                },
            )])),
            ..Default::default()
        })
        .collect();
    let chunks: Vec<Vec<Device>> = if devices.is_empty() {
        // An empty pool is still published, so the scheduler knows the node has none left.
        vec![Vec::new()]
    } else {
        devices
            .chunks(MAX_DEVICES_PER_SLICE)
            .map(<[Device]>::to_vec)
            .collect()
    };
    let count = chunks.len() as i64;
    chunks
        .into_iter()
        .map(|devices| ResourceSliceSpec {
            driver: DRA_DRIVER.to_string(),
            node_name: Some(node.to_string()),
            pool: ResourcePool {
                name: node.to_string(),
                generation,
                resource_slice_count: count,
            },
            devices: Some(devices),
            ..Default::default()
        })
        .collect()
}

/// The name of the node's `i`-th slice.
pub fn slice_name(node: &str, i: usize) -> String {
    format!("{node}-teeguard-{i}")
}

/// Whether the published slices already say what `wanted` says (generations aside).
pub fn same_content(published: &[ResourceSliceSpec], wanted: &[ResourceSliceSpec]) -> bool {
    let strip = |s: &ResourceSliceSpec| {
        let mut s = s.clone();
        s.pool.generation = 0;
        s
    };
    published.len() == wanted.len()
        && published
            .iter()
            .zip(wanted)
            .all(|(a, b)| strip(a) == strip(b))
}

/// A kind whose extended resource the Node's allocatable still shows in DRA mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bypass {
    /// The kind.
    pub kind: TeeKind,
    /// Its resource name.
    pub resource: String,
    /// The allocatable value.
    pub value: String,
    /// Who writes it, as far as the Node tells.
    pub writer: &'static str,
}

/// The kinds (of `kinds`) whose extended resource the Node's `status.allocatable` shows above zero:
/// for a pod requesting that name the scheduler then uses the Node's value and bypasses DRA on this
/// node.
pub fn bypasses(
    node: &k8s_openapi::api::core::v1::Node,
    kinds: impl IntoIterator<Item = TeeKind>,
    resources: &teeguard_shared::config::ResourcesConfig,
) -> Vec<Bypass> {
    use teeguard_shared::names::{
        AGENT_EXTENDED_RESOURCES_ANNOTATION, NFD_EXTENDED_RESOURCES_ANNOTATION,
    };
    let allocatable = node.status.as_ref().and_then(|s| s.allocatable.as_ref());
    let annotation = |key: &str| {
        node.metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(key))
            .cloned()
            .unwrap_or_default()
    };
    let lists = |key: &str, name: &str| annotation(key).split(',').any(|n| n.trim() == name);
    let mut out = Vec::new();
    for kind in kinds {
        let resource = resources.resource_name(kind);
        let Some(q) = allocatable.and_then(|a| a.get(resource)) else {
            continue;
        };
        if matches!(q.0.trim(), "0" | "") {
            continue;
        }
        let writer = if lists(NFD_EXTENDED_RESOURCES_ANNOTATION, resource) {
            "node-feature-discovery (its annotation lists it)"
        } else if lists(AGENT_EXTENDED_RESOURCES_ANNOTATION, resource) {
            "teeguard's extended-resource mode (being removed)"
        } else {
            "another writer (a device plugin or a script)"
        };
        out.push(Bypass {
            kind,
            resource: resource.to_string(),
            value: q.0.clone(),
            writer,
        });
    }
    out
}

/// What DRA mode adds to the report.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DraView {
    /// The devices per kind.
    pub plan: BTreeMap<TeeKind, KindDevices>,
    /// Kinds the scheduler bypasses DRA for on this node.
    pub bypassed: Vec<Bypass>,
    /// The kubelet's registration verdict: `None` before it called, `Some(Err)` when refused.
    pub registered: Option<Result<(), String>>,
    /// Why the slices could not be written (last attempt), if so.
    pub publish_error: Option<String>,
    /// Slices published.
    pub slices: usize,
}

/// One device of a claim's allocation that belongs to this driver.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct AllocatedDevice {
    /// The claim's request the device serves (`container-0-request-0` for extended resources).
    pub request: String,
    /// The pool (the node's name).
    pub pool: String,
    /// The device (`tdx-0`).
    pub device: String,
}

/// A claim the agent prepared, as the checkpoint keeps it.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PreparedClaim {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's name.
    pub name: String,
    /// The pods the claim is reserved for (UIDs).
    pub pods: Vec<String>,
    /// The devices it holds on this node.
    pub devices: Vec<AllocatedDevice>,
}

impl PreparedClaim {
    /// Its devices by kind (names that do not parse are left out; `prepare_check` refuses them).
    pub fn device_names(&self) -> impl Iterator<Item = DeviceName> + '_ {
        self.devices
            .iter()
            .filter_map(|d| DeviceName::parse(&d.device))
    }
}

/// Devices held by prepared claims, per kind.
pub fn allocated_devices<'a>(
    claims: impl IntoIterator<Item = &'a PreparedClaim>,
) -> BTreeMap<TeeKind, BTreeSet<u32>> {
    let mut out: BTreeMap<TeeKind, BTreeSet<u32>> = BTreeMap::new();
    for c in claims {
        for d in c.device_names() {
            out.entry(d.kind).or_default().insert(d.index);
        }
    }
    out
}

/// What [`prepare_check`] reads.
#[derive(Clone, Copy, Debug)]
pub struct PrepareInput<'a> {
    /// This node (the pool the agent publishes).
    pub node: &'a str,
    /// The kernel's figures at the last scan; `None` before the first scan.
    pub figures: Option<&'a BTreeMap<TeeKind, KindFigures>>,
    /// Keys of pods without a claim, per kind.
    pub claimless_keys: &'a BTreeMap<TeeKind, u64>,
    /// Devices other prepared claims hold.
    pub others: &'a BTreeMap<TeeKind, BTreeSet<u32>>,
}

/// Check a claim's devices of this driver before the kubelet starts its pod: each is in this node's
/// pool, names a key the host has, and is not held by another prepared claim; and the kernel still
/// has a key for each (`capacity − withheld − held by other claims`). `Err` says what is wrong, for
/// the kubelet's event on the pod (it retries).
pub fn prepare_check(devices: &[AllocatedDevice], input: PrepareInput<'_>) -> Result<(), String> {
    let Some(figures) = input.figures else {
        return Err("the agent has not read the kernel's TEE keys yet; the kubelet retries".into());
    };
    let mut wanted: BTreeMap<TeeKind, BTreeSet<u32>> = BTreeMap::new();
    for d in devices {
        if d.pool != input.node {
            return Err(format!(
                "device {} is from pool {:?}, not this node's pool {:?}",
                d.device, d.pool, input.node
            ));
        }
        let Some(name) = DeviceName::parse(&d.device) else {
            return Err(format!(
                "device {:?} is not a teeguard key device (tdx-N, sev-N, sev-es-N)",
                d.device
            ));
        };
        let Some(f) = figures.get(&name.kind) else {
            return Err(format!(
                "device {} is a {} key, and this host has no {} capacity",
                d.device, name.kind, name.kind
            ));
        };
        if u64::from(name.index) >= f.capacity {
            return Err(format!(
                "device {} does not exist: the host has {} {} keys",
                d.device, f.capacity, name.kind
            ));
        }
        if input
            .others
            .get(&name.kind)
            .is_some_and(|s| s.contains(&name.index))
        {
            return Err(format!(
                "device {} is already prepared for another claim",
                d.device
            ));
        }
        wanted.entry(name.kind).or_default().insert(name.index);
    }
    for (kind, set) in &wanted {
        let f = &figures[kind];
        let held = withheld(f, input.claimless_keys.get(kind).copied().unwrap_or(0));
        let others = input.others.get(kind).map_or(0, |s| s.len() as u64);
        let free = f.capacity.saturating_sub(held).saturating_sub(others);
        if (set.len() as u64) > free {
            return Err(format!(
                "no free {kind} key for this claim: the host has {} of which {held} are held outside \
                 DRA claims and {others} by other prepared claims ({free} free, {} wanted)",
                f.capacity,
                set.len()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
