//! What one scan of the host's misc cgroup found: plain data the kernel adapter fills in
//! (`kernel::scanner`) and attribution, the report and the enforcers read. Pure.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use serde::Serialize;
use teeguard_shared::misc::CgroupLayout;

use super::attribution::{Accounting, Uids};
use super::counts::KindCounts;

/// At most this many skipped names and problems are kept per scan (the counts are exact).
const MAX_LISTED: usize = 16;

/// Which pods' cgroups to read.
#[derive(Clone, Copy, Debug)]
pub enum Interest<'a> {
    /// Every pod cgroup (the `scan` subcommand).
    All,
    /// Only these pod UIDs (the agent: pods that request a TEE resource). Usage of every other pod
    /// counts as external anyway, so it need not be read.
    Only(&'a Uids),
}

impl Interest<'_> {
    /// Whether the pod with this UID is to be read.
    pub fn wants(&self, uid: &str) -> bool {
        match self {
            Interest::All => true,
            Interest::Only(set) => set.contains(uid),
        }
    }
}

/// The kubelet's cgroup driver, as seen from the directory names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Driver {
    /// `kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid_>.slice`.
    Systemd,
    /// `kubepods/<qos>/pod<uid>`.
    Cgroupfs,
}

/// The result of one scan.
#[derive(Clone, Debug, PartialEq)]
#[expect(
    clippy::large_enum_variant,
    reason = "one value per scan; boxing buys nothing"
)]
pub enum HostState {
    /// There is no misc cgroup controller under the cgroup root (old kernel, no `CONFIG_CGROUP_MISC`,
    /// or the host's cgroup tree is not mounted where configured).
    NoController {
        /// The error explaining where the agent looked.
        message: String,
    },
    /// The misc files were read.
    Scanned(HostScan),
}

/// Figures read from a host with a misc controller.
#[derive(Clone, Debug, PartialEq)]
pub struct HostScan {
    /// The directory holding the root misc files (`<root>` for v2, `<root>/misc` for v1).
    pub misc_dir: PathBuf,
    /// cgroup v1 or v2.
    pub layout: CgroupLayout,
    /// `misc.capacity` (TEE kinds only; zero = absent).
    pub capacity: KindCounts,
    /// Root `misc.current` (or the sum of the top-level children on kernels without one).
    pub kernel_used: KindCounts,
    /// Where [`HostScan::kernel_used`] comes from, and so what it cannot see.
    pub usage_source: UsageSource,
    /// The pod cgroups, when the host has TEE capacity (otherwise they are not looked at).
    pub pods: Option<PodScan>,
    /// Failed charges counted in `misc.events` (empty when the host has no TEE capacity).
    pub refusals: Refusals,
}

/// Where the kernel's usage was read. Checked on the real kernels (`tests/tests/kernel_scan.rs`):
/// Linux 6.1 (like RHEL 9's 5.14) has no root `misc.current`, the 6.12 line has one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum UsageSource {
    /// The root's `misc.current`: every key the kernel handed out.
    #[default]
    Root,
    /// No root `misc.current`: the sum of the top-level cgroups' `misc.current`. Keys charged to the
    /// root cgroup itself (a VM process in it) are in no file.
    TopLevel,
    /// No root `misc.current`, and the root's `cgroup.subtree_control` does not enable the misc
    /// controller: every key is charged to the root cgroup, so the kernel shows no usage at all.
    Hidden,
}

/// Failed charges the kernel counted in `misc.events` files: kubepods', each pod cgroup's that counted
/// any, and each other top-level cgroup's that counted any. Each file counts the refusals stopped in
/// that cgroup or below it (`misc.events` is hierarchical).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Refusals {
    /// kubepods' `misc.events`: every refusal at kubepods or below, its pods' included.
    pub kubepods: KindCounts,
    /// Each pod cgroup's `misc.events` that counted any, by pod UID.
    pub pods: HashMap<String, KindCounts>,
    /// Each top-level cgroup outside kubepods whose `misc.events` counted any, by directory name.
    pub outside: BTreeMap<String, KindCounts>,
    /// The top-level cgroups whose `misc.events` was read (kubepods included), sorted: the files
    /// the agent watches with inotify.
    pub dirs: Vec<PathBuf>,
}

impl Refusals {
    /// The refusals counted in the pods' cgroups together.
    pub fn in_pods(&self) -> KindCounts {
        let mut total = KindCounts::ZERO;
        for c in self.pods.values() {
            total.add(c);
        }
        total
    }

    /// The refusals counted outside kubepods together.
    pub fn outside_total(&self) -> KindCounts {
        let mut total = KindCounts::ZERO;
        for c in self.outside.values() {
            total.add(c);
        }
        total
    }
}

/// What the walk of the kubepods subtree found.
#[derive(Clone, Debug, PartialEq)]
pub struct PodScan {
    /// `kubepods.slice` or `kubepods` under [`HostScan::misc_dir`], when found.
    pub kubepods: Option<PathBuf>,
    /// The cgroup driver, when kubepods was found.
    pub driver: Option<Driver>,
    /// Per-pod or running-pod accounting.
    pub accounting: Accounting,
    /// Why: which file showed the controller is or is not delegated.
    pub accounting_reason: String,
    /// Usage of the pod cgroups that were read and hold at least one key, by pod UID.
    pub usage: HashMap<String, KindCounts>,
    /// Pod cgroups whose `misc.current` was read.
    pub pods_read: usize,
    /// Agent mode: pods of interest not read because the kubepods total showed that none of them
    /// changed; their last reading is in [`PodScan::usage`] (when not zero).
    pub pods_unchanged: usize,
    /// Directory names that look like pod cgroups but carry no valid UID (at most 16 listed).
    pub skipped: Vec<String>,
    /// How many such directories there were.
    pub skipped_count: usize,
    /// Pod cgroups that could not be read, with the error (at most 16 listed).
    pub problems: Vec<String>,
    /// How many pod cgroups could not be read.
    pub problem_count: usize,
}

impl PodScan {
    /// A walk that found the pods' cgroups (`reason`: which file shows the accounting possible).
    pub fn new(accounting: Accounting, reason: String) -> Self {
        PodScan {
            kubepods: None,
            driver: None,
            accounting,
            accounting_reason: reason,
            usage: HashMap::new(),
            pods_read: 0,
            pods_unchanged: 0,
            skipped: Vec::new(),
            skipped_count: 0,
            problems: Vec::new(),
            problem_count: 0,
        }
    }

    /// The controller is not delegated to pod cgroups (`reason`: which file shows it): running pods
    /// are counted instead, and no usage read so far counts.
    pub fn not_delegated(&mut self, reason: String) {
        self.accounting = Accounting::RunningPods;
        self.accounting_reason = reason;
        self.usage.clear();
    }

    /// A directory that looks like a pod cgroup but carries no valid UID.
    pub fn skip(&mut self, name: &str) {
        self.skipped_count += 1;
        if self.skipped.len() < MAX_LISTED {
            self.skipped.push(name.to_string());
        }
    }

    /// A pod cgroup that could not be read.
    pub fn problem(&mut self, message: String) {
        self.problem_count += 1;
        if self.problems.len() < MAX_LISTED {
            self.problems.push(message);
        }
    }
}
