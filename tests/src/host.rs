//! A simulated host: a fake `/sys/fs/cgroup` tree in a directory, kept consistent the way the kernel's
//! misc cgroup controller keeps its files (see `DOMAIN.md` §1).
//!
//! The model mirrors `kernel/cgroup/misc.c`:
//! - `misc.capacity` at the root lists resources with capacity > 0;
//! - `misc.current` / `misc.peak` in every cgroup (root: only on newer kernels) are hierarchical: a charge
//!   made in a cgroup is added to that cgroup and every ancestor, the root included;
//! - a charge of a resource whose capacity is 0 fails with `EINVAL` before anything is counted;
//! - a charge walks from the charged cgroup up to the root and fails (`EBUSY`) at the first level where
//!   the new usage would exceed that cgroup's `misc.max` or the capacity; the failure increments
//!   `<name>.max` in `misc.events` of that cgroup and all its ancestors and in `misc.events.local` of
//!   that cgroup only. The root has no `misc.events`, so a charge refused at the root (the host is full)
//!   leaves no trace in any file, exactly as on a real host;
//! - the root's files follow the kernel: `misc.capacity` only on older kernels
//!   ([`KernelFeatures::old`], Linux 6.1), `misc.capacity`, `misc.current` and `misc.peak` on current
//!   ones ([`KernelFeatures::modern`], the 6.12 line); other cgroups have `misc.current`, `misc.max`,
//!   `misc.events`, and on current kernels `misc.peak` and `misc.events.local`;
//! - lowering a capacity (or `misc.max`) below the usage takes nothing back; a capacity of 0 drops the
//!   resource from `misc.capacity` and `misc.max` (while `misc.current` and `misc.events` still show it
//!   where non-zero), and a `misc.max` set before comes back with the capacity.
//!
//! These are the real kernels' answers, checked on Debian's Linux 6.1 and 6.12
//! (`tests/tests/kernel_*.rs`, [`crate::teevm`]); `tests/tests/host_*.rs` hold the simulator to them.
//! - when the misc controller is not enabled in a cgroup (not delegated), its processes are charged to
//!   the nearest ancestor that has it, and the cgroup has no `misc.*` files.
//!
//! The tree lives in a temporary directory (under `/dev/shm` when available, see [`SimHostBuilder::build`])
//! removed when the [`SimHost`] is dropped, or in a directory given with [`SimHostBuilder::in_dir`].
//!
//! Every file is written atomically (temporary file + rename) unless [`WriteMode::InPlace`] is chosen,
//! so a concurrent reader never sees a half-written file. Fault helpers ([`SimHost::write_garbage`],
//! [`SimHost::truncate`], [`SimHost::write_half`], ...) deliberately break files; a broken file stays
//! broken ("pinned") until [`SimHost::heal`] or [`SimHost::heal_all`].
//!
//! # `misc.max` written by other processes
//!
//! Like on a real host, another process (the agent's enforcement, a runtime) may set a limit by opening
//! `<cgroup>/misc.max` for writing *without* `O_CREAT` and writing `"<resource> <n>"` or
//! `"<resource> max"`. A cgroup without the misc controller has no `misc.max`, so that open fails with
//! `ENOENT` (`NotFound`), as on the kernel. The simulator takes such writes in ("absorbs" them) the way
//! the kernel's `misc_cg_max_write` would have handled them:
//! - each line of the file is one write: surrounding whitespace is stripped, then `name value` with a
//!   single space, `value` being `max` or a number as `kstrtou64(…, 0)` reads it (decimal, `0x` hex,
//!   leading-`0` octal, optional `+`; `u64::MAX` is `max`);
//! - a line naming a resource with a capacity > 0 sets that cgroup's limit; any other line (unknown
//!   resource, capacity 0, garbage, negative or overflowing number, several values) is refused
//!   (`EINVAL`) and changes nothing;
//! - afterwards the file is rewritten from the model, so it shows the kernel's full view again (every
//!   resource with capacity, in kernel order, e.g. `sev max\nsev_es 1\n`).
//!
//! Limits only matter when something is charged, so every charge first absorbs the `misc.max` of each
//! level it walks (the charged cgroup up to the root); the readers of one cgroup ([`SimHost::max_of`],
//! [`SimHost::usage_at`], [`SimHost::events`], ...) absorb that cgroup's file; every rewrite of a
//! cgroup's files absorbs its `misc.max` first, so the simulator never overwrites a limit it has not
//! taken in; [`SimHost::absorb_limit_writes`] and [`SimHost::resync`] absorb every file. This behaves
//! like absorbing before every operation. Pinned (deliberately broken) files are never absorbed.
//!
//! Race: the simulator sees only a file's content, never the writes themselves. If it absorbs between a
//! writer's truncating `open` and its `write`, it sees an empty file and rewrites it: in the default
//! [`WriteMode::Atomic`] the rewrite renames a new file into place, so the writer's `write` lands in the
//! old, unlinked file and is lost; in [`WriteMode::InPlace`] the write lands over the rewritten content
//! and is refused as garbage. Either way the limit is not set and the read-back shows it: a writer must
//! read the file back and retry, as the agent does.
//!
//! Cgroup arguments named `cgroup` are paths relative to [`SimHost::misc_root`] (`""` is the root), for
//! example `kubepods.slice` or `machine.slice/machine-qemu\x2d1\x2dvm.scope`.
//!
//! ```
//! use teeguard_tests::host::{SimHost, QosClass, TDX};
//! let host = SimHost::builder().capacity(TDX, 4).build().expect("host");
//! host.add_pod("0f5a3c1e-8a8b-4c3e-9e59-1d2f3a4b5c6d", QosClass::Burstable, &["compute"]).expect("pod");
//! host.start_vm("0f5a3c1e-8a8b-4c3e-9e59-1d2f3a4b5c6d", "compute", TDX).expect("charge");
//! assert_eq!(host.usage(TDX), 1);
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use tempfile::TempDir;

use crate::error::{self, Error, Result};

/// Kernel name of Intel TDX keys (HKIDs).
pub const TDX: &str = "tdx";
/// Kernel name of AMD SEV ASIDs.
pub const SEV: &str = "sev";
/// Kernel name of AMD SEV-ES ASIDs (SEV-SNP guests are charged as `sev_es` too).
pub const SEV_ES: &str = "sev_es";
/// Name kubelet gives the pod sandbox (pause) container; [`SimHost::add_pod`] always creates its cgroup.
/// Charging it models a Kata sandbox whose VMM runs in the sandbox cgroup.
pub const SANDBOX: &str = "POD";

/// Controllers listed in the v2 root's `cgroup.controllers` besides `misc`.
const V2_CONTROLLERS: &str = "cpuset cpu io memory hugetlb pids rdma";

/// cgroup hierarchy version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    /// Legacy: the misc hierarchy is mounted at `<root>/misc`.
    V1,
    /// Unified: `<root>` is the hierarchy root.
    V2,
}

/// kubelet's cgroup driver, which decides how pod cgroups are named.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupDriver {
    /// `kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>.slice`.
    Systemd,
    /// `kubepods/burstable/pod<uid>`.
    Cgroupfs,
}

/// Container runtime, which decides how container cgroups are named.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContainerRuntime {
    /// `cri-containerd-<id>.scope` (systemd driver) or `<id>` (cgroupfs driver).
    Containerd,
    /// `crio-<id>.scope` (systemd driver) or `crio-<id>` (cgroupfs driver).
    CriO,
}

/// A pod's QoS class, which decides where kubelet puts its cgroup.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QosClass {
    /// Directly under the kubepods cgroup.
    Guaranteed,
    /// Under `kubepods-burstable.slice` / `kubepods/burstable`.
    Burstable,
    /// Under `kubepods-besteffort.slice` / `kubepods/besteffort`.
    BestEffort,
}

impl QosClass {
    fn slug(self) -> Option<&'static str> {
        match self {
            QosClass::Guaranteed => None,
            QosClass::Burstable => Some("burstable"),
            QosClass::BestEffort => Some("besteffort"),
        }
    }
}

/// Where the misc controller is enabled (cgroup v2 only; v1 always has it everywhere).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MiscDelegation {
    /// Enabled in every cgroup: pod and container cgroups carry `misc.*` files.
    Full,
    /// Enabled down to the kubepods cgroup, but kubepods' `cgroup.subtree_control` lacks `misc`: pod and
    /// container cgroups have no `misc.*` files and their charges land on the kubepods cgroup.
    NotBelowKubepods,
    /// The root's `cgroup.subtree_control` lacks `misc` (systemd does not know the controller): only the
    /// root has `misc.*` files and every charge lands on the root.
    RootOnly,
}

/// Which misc files the simulated kernel provides.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelFeatures {
    /// The root has `misc.current` (kernels since about 6.5). Without it usage must be derived by summing
    /// the top-level children.
    pub root_current: bool,
    /// Every cgroup has `misc.peak` (kernels since about 6.11).
    pub peak: bool,
    /// Non-root cgroups have `misc.events.local`.
    pub events_local: bool,
}

impl KernelFeatures {
    /// A current kernel: every file present (Debian's Linux 6.12: root `misc.capacity`,
    /// `misc.current`, `misc.peak`).
    pub const fn modern() -> Self {
        Self {
            root_current: true,
            peak: true,
            events_local: true,
        }
    }

    /// An older kernel: no root `misc.current`, no `misc.peak`, no `misc.events.local` (Debian's Linux
    /// 6.1, RHEL 9's 5.14: the root has `misc.capacity` only).
    pub const fn old() -> Self {
        Self {
            root_current: false,
            peak: false,
            events_local: false,
        }
    }
}

impl Default for KernelFeatures {
    fn default() -> Self {
        Self::modern()
    }
}

/// How the simulator writes files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WriteMode {
    /// Write a temporary file and rename it over the target: readers see the old or the new content,
    /// never a mix. An inotify watch on the file itself is lost at each rename: watch the directory.
    #[default]
    Atomic,
    /// Truncate and rewrite the same inode (like kernfs, where a watch on the file sees `IN_MODIFY`).
    /// A concurrent reader may see an empty or partial file.
    InPlace,
}

/// Builder for a [`SimHost`].
#[derive(Debug, Clone)]
pub struct SimHostBuilder {
    version: CgroupVersion,
    driver: CgroupDriver,
    runtime: ContainerRuntime,
    capacity: Vec<(String, u64)>,
    kernel: KernelFeatures,
    delegation: MiscDelegation,
    write_mode: WriteMode,
    dir: Option<PathBuf>,
}

impl Default for SimHostBuilder {
    fn default() -> Self {
        Self {
            version: CgroupVersion::V2,
            driver: CgroupDriver::Systemd,
            runtime: ContainerRuntime::Containerd,
            capacity: Vec::new(),
            kernel: KernelFeatures::modern(),
            delegation: MiscDelegation::Full,
            write_mode: WriteMode::Atomic,
            dir: None,
        }
    }
}

impl SimHostBuilder {
    /// cgroup version (default v2).
    pub fn version(mut self, version: CgroupVersion) -> Self {
        self.version = version;
        self
    }

    /// kubelet cgroup driver (default systemd).
    pub fn driver(mut self, driver: CgroupDriver) -> Self {
        self.driver = driver;
        self
    }

    /// Container runtime (default containerd).
    pub fn runtime(mut self, runtime: ContainerRuntime) -> Self {
        self.runtime = runtime;
        self
    }

    /// Capacity of a resource (`tdx`, `sev`, `sev_es`, or any name such as `sgx_epc`). 0 declares a
    /// resource the kernel knows but the host lacks: it is left out of `misc.capacity`.
    pub fn capacity(mut self, resource: impl AsRef<str>, n: u64) -> Self {
        let resource = resource.as_ref().to_owned();
        self.capacity.retain(|(name, _)| *name != resource);
        self.capacity.push((resource, n));
        self
    }

    /// Which misc files the kernel provides (default: all).
    pub fn kernel(mut self, kernel: KernelFeatures) -> Self {
        self.kernel = kernel;
        self
    }

    /// Shorthand for `kernel(KernelFeatures::old())`: no root `misc.current`, no `misc.peak`.
    pub fn old_kernel(self) -> Self {
        self.kernel(KernelFeatures::old())
    }

    /// Where the misc controller is enabled (default: everywhere). cgroup v2 only.
    pub fn misc_delegation(mut self, delegation: MiscDelegation) -> Self {
        self.delegation = delegation;
        self
    }

    /// How files are written (default atomic).
    pub fn write_mode(mut self, mode: WriteMode) -> Self {
        self.write_mode = mode;
        self
    }

    /// Build the tree in an existing directory instead of a fresh temporary one (the caller cleans up).
    pub fn in_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dir = Some(dir.into());
        self
    }

    /// Create the directory tree and write every file. Without [`SimHostBuilder::in_dir`] the tree goes in a
    /// fresh temporary directory under `$TEEGUARD_SIM_DIR`, else `/dev/shm`, else the system temporary
    /// directory.
    pub fn build(self) -> Result<SimHost> {
        if self.version == CgroupVersion::V1 && self.delegation != MiscDelegation::Full {
            return Err(Error::Unsupported(
                "misc delegation settings apply to cgroup v2 only; a v1 misc hierarchy has misc files in every cgroup",
            ));
        }
        let (temp, root) = match self.dir {
            Some(dir) => {
                fs::create_dir_all(&dir).map_err(io_err("create", &dir))?;
                (None, dir)
            }
            None => {
                let parent = default_parent_dir();
                let temp = tempfile::Builder::new()
                    .prefix("teeguard-sim-cgroup-")
                    .tempdir_in(&parent)
                    .map_err(io_err("create temporary directory in", &parent))?;
                let root = temp.path().to_path_buf();
                (Some(temp), root)
            }
        };
        let misc_root = match self.version {
            CgroupVersion::V2 => root.clone(),
            CgroupVersion::V1 => root.join("misc"),
        };
        let layout = Layout {
            version: self.version,
            driver: self.driver,
            runtime: self.runtime,
            kernel: self.kernel,
            delegation: self.delegation,
            write_mode: self.write_mode,
            misc_root,
        };
        let mut state = State::default();
        for (name, n) in self.capacity {
            state.capacity.insert(name, n);
        }
        state.nodes.insert(
            String::new(),
            Node::new(true, layout.delegation != MiscDelegation::RootOnly, false),
        );
        let host = SimHost {
            _temp: temp,
            root,
            layout,
            state: Mutex::new(state),
        };
        {
            let mut st = host.lock();
            let kubepods = host.layout.kubepods_rel();
            let mut base: Vec<String> = vec![
                "init.scope".into(),
                "system.slice".into(),
                "user.slice".into(),
            ];
            base.push(kubepods.clone());
            for qos in [QosClass::Burstable, QosClass::BestEffort] {
                base.push(host.layout.qos_rel(qos));
            }
            for rel in base {
                let leaf = rel == "init.scope";
                host.ensure_node(&mut st, &rel, leaf);
            }
            st.all_dirty = true;
            host.sync(&mut st)?;
        }
        Ok(host)
    }
}

#[derive(Debug, Clone)]
struct Layout {
    version: CgroupVersion,
    driver: CgroupDriver,
    runtime: ContainerRuntime,
    kernel: KernelFeatures,
    delegation: MiscDelegation,
    write_mode: WriteMode,
    misc_root: PathBuf,
}

impl Layout {
    fn names(&self) -> KubeletNames {
        KubeletNames {
            driver: self.driver,
            runtime: self.runtime,
        }
    }

    fn kubepods_rel(&self) -> String {
        self.names().kubepods()
    }

    fn qos_rel(&self, qos: QosClass) -> String {
        self.names().qos(qos)
    }

    fn pod_rel(&self, qos: QosClass, uid_part: &str) -> String {
        self.names().pod(qos, uid_part)
    }

    fn container_dir(&self, id: &str) -> String {
        self.names().container_dir(id)
    }
}

/// Where the kubelet (by its cgroup driver) and the runtime put pod and container cgroups, relative to
/// the misc root: the names the simulated tree uses, and the kernel tests create on a real one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KubeletNames {
    /// The kubelet's cgroup driver.
    pub driver: CgroupDriver,
    /// The container runtime.
    pub runtime: ContainerRuntime,
}

impl KubeletNames {
    /// The kubepods cgroup: `kubepods.slice` or `kubepods`.
    pub fn kubepods(&self) -> String {
        match self.driver {
            CgroupDriver::Systemd => "kubepods.slice".into(),
            CgroupDriver::Cgroupfs => "kubepods".into(),
        }
    }

    /// The QoS class's cgroup (kubepods itself for Guaranteed pods).
    pub fn qos(&self, qos: QosClass) -> String {
        let kubepods = self.kubepods();
        match (qos.slug(), self.driver) {
            (None, _) => kubepods,
            (Some(slug), CgroupDriver::Systemd) => format!("{kubepods}/kubepods-{slug}.slice"),
            (Some(slug), CgroupDriver::Cgroupfs) => format!("{kubepods}/{slug}"),
        }
    }

    /// Pod cgroup path; `uid_part` is put in the name as given (after the systemd driver's `-` → `_`
    /// escaping).
    pub fn pod(&self, qos: QosClass, uid_part: &str) -> String {
        let parent = self.qos(qos);
        match (self.driver, qos.slug()) {
            (CgroupDriver::Systemd, None) => {
                format!("{parent}/kubepods-pod{}.slice", uid_part.replace('-', "_"))
            }
            (CgroupDriver::Systemd, Some(slug)) => {
                format!(
                    "{parent}/kubepods-{slug}-pod{}.slice",
                    uid_part.replace('-', "_")
                )
            }
            (CgroupDriver::Cgroupfs, _) => format!("{parent}/pod{uid_part}"),
        }
    }

    /// A container's cgroup directory name below its pod's.
    pub fn container_dir(&self, id: &str) -> String {
        match (self.driver, self.runtime) {
            (CgroupDriver::Systemd, ContainerRuntime::Containerd) => {
                format!("cri-containerd-{id}.scope")
            }
            (CgroupDriver::Systemd, ContainerRuntime::CriO) => format!("crio-{id}.scope"),
            (CgroupDriver::Cgroupfs, ContainerRuntime::Containerd) => id.to_owned(),
            (CgroupDriver::Cgroupfs, ContainerRuntime::CriO) => format!("crio-{id}"),
        }
    }
}

/// Per-resource accounting of one cgroup, as the kernel keeps it.
#[derive(Debug, Clone, Default)]
struct Res {
    /// Hierarchical usage (this cgroup and its descendants).
    usage: u64,
    /// `misc.max`; `None` is `max`.
    max: Option<u64>,
    /// `misc.peak`.
    watermark: u64,
    /// `misc.events` (hierarchical failed charges).
    events: u64,
    /// `misc.events.local`.
    events_local: u64,
}

#[derive(Debug, Clone)]
struct Node {
    /// The misc controller is enabled here (the cgroup has `misc.*` files).
    misc: bool,
    /// `misc` is listed in this cgroup's `cgroup.subtree_control`.
    subtree_misc: bool,
    /// A leaf (container/VM scope): empty `cgroup.subtree_control`.
    leaf: bool,
    res: BTreeMap<String, Res>,
}

impl Node {
    fn new(misc: bool, subtree_misc: bool, leaf: bool) -> Self {
        Self {
            misc,
            subtree_misc,
            leaf,
            res: BTreeMap::new(),
        }
    }
}

#[derive(Debug, Clone)]
struct PodEntry {
    rel: String,
    /// Container name → cgroup path relative to the misc root.
    containers: BTreeMap<String, String>,
}

#[derive(Debug, Default)]
struct State {
    capacity: BTreeMap<String, u64>,
    /// Relative path (`""` = root) → cgroup.
    nodes: BTreeMap<String, Node>,
    pods: BTreeMap<String, PodEntry>,
    externals: BTreeMap<String, String>,
    /// Keys held by processes of a cgroup, by (cgroup, resource): what its removal releases. A cgroup
    /// without the misc controller is charged on an ancestor but still releases its own keys.
    charges: BTreeMap<(String, String), u64>,
    /// Next libvirt VM number for external consumers.
    next_vm_id: u32,
    /// Content last written per file, to rewrite only what changed.
    written: HashMap<PathBuf, String>,
    /// Per `misc.max` file, the content last accounted for: written by the simulator or absorbed. A
    /// different content on disk was written by another process (see the module docs).
    max_seen: HashMap<PathBuf, String>,
    /// Files broken on purpose: not rewritten until healed.
    pinned: BTreeSet<PathBuf>,
    dirty: BTreeSet<String>,
    all_dirty: bool,
    tmp_counter: u64,
}

/// A simulated host cgroup tree. Methods take `&self` (state behind a mutex) so a host can be shared
/// between a test and the code under test (`Arc<SimHost>`).
#[derive(Debug)]
pub struct SimHost {
    _temp: Option<TempDir>,
    root: PathBuf,
    layout: Layout,
    state: Mutex<State>,
}

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    error::io_at("simulated host", op, path)
}

fn parent_rel(rel: &str) -> Option<&str> {
    if rel.is_empty() {
        None
    } else {
        Some(rel.rfind('/').map_or("", |i| &rel[..i]))
    }
}

/// The kernel lists its resources in enum order (`sev`, `sev_es`, `tdx`); unknown names follow.
fn resource_rank(name: &str) -> (u8, &str) {
    match name {
        SEV => (0, name),
        SEV_ES => (1, name),
        TDX => (2, name),
        other => (3, other),
    }
}

/// A 64-hex-digit container ID derived from the pod UID and container name (deterministic).
pub fn container_id(pod_uid: &str, container: &str) -> String {
    crate::fixtures::stable_hex(&format!("container:{pod_uid}/{container}"), 64)
}

/// Escape a name the way systemd escapes unit names (`-` → `\x2d`), as libvirt's machine scopes show.
pub fn systemd_escape(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for c in name.chars() {
        if c.is_ascii_alphanumeric() || c == '_' || c == '.' || c == ':' {
            out.push(c);
        } else {
            for b in c.to_string().bytes() {
                out.push_str(&format!("\\x{b:02x}"));
            }
        }
    }
    out
}

/// The cgroup of a libvirt/QEMU VM outside Kubernetes: `machine.slice/machine-qemu\x2d<id>\x2d<name>.scope`.
pub fn libvirt_vm_cgroup(id: u32, name: &str) -> String {
    format!(
        "machine.slice/machine-{}.scope",
        systemd_escape(&format!("qemu-{id}-{name}"))
    )
}

/// The cgroup of a container run by another runtime on the host (Docker): `system.slice/docker-<id>.scope`.
pub fn docker_container_cgroup(id: &str) -> String {
    format!("system.slice/docker-{id}.scope")
}

/// The cgroup of a Podman container: `machine.slice/libpod-<id>.scope`.
pub fn podman_container_cgroup(id: &str) -> String {
    format!("machine.slice/libpod-{id}.scope")
}

/// Parse a misc file strictly in the kernel's format (`name value` per line, `value` a number or `max`,
/// which maps to `u64::MAX`; `misc.events` names keep their `.max` suffix). Test helper: the real parser
/// lives in teeguard-shared and must be more tolerant.
pub fn parse_misc(text: &str) -> Result<BTreeMap<String, u64>, String> {
    let mut out = BTreeMap::new();
    if !text.is_empty() && !text.ends_with('\n') {
        return Err(format!("misc file does not end with a newline: {text:?}"));
    }
    for line in text.lines() {
        let mut parts = line.split(' ');
        let (Some(name), Some(value), None) = (parts.next(), parts.next(), parts.next()) else {
            return Err(format!("malformed misc line {line:?}"));
        };
        if name.is_empty() {
            return Err(format!("malformed misc line {line:?}"));
        }
        let value = if value == "max" {
            u64::MAX
        } else {
            value
                .parse::<u64>()
                .map_err(|e| format!("bad value in misc line {line:?}: {e}"))?
        };
        if out.insert(name.to_owned(), value).is_some() {
            return Err(format!("duplicate resource {name:?} in misc file"));
        }
    }
    Ok(out)
}

/// One write into `misc.max` as the kernel's `misc_cg_max_write` reads it: surrounding whitespace
/// stripped, `name value` split at the first space, `value` either `max` or a number for `kstrtou64`
/// with base 0. `None` where the kernel answers `EINVAL`/`ERANGE` (the name is checked by the caller).
/// The limit is `None` for `max` (a number equal to `u64::MAX` is `max` too).
fn parse_max_write(line: &str) -> Option<(&str, Option<u64>)> {
    let line = line.trim_matches(|c: char| c.is_ascii_whitespace() || c == '\u{b}');
    let (name, value) = line.split_once(' ')?;
    if value == "max" {
        return Some((name, None));
    }
    let value = kstrtou64(value)?;
    Some((name, (value != u64::MAX).then_some(value)))
}

/// `kstrtou64(s, 0, …)`: optional `+`, then `0x`/`0X` + hex digits, `0` + octal digits, or decimal;
/// nothing else, no overflow.
fn kstrtou64(s: &str) -> Option<u64> {
    let s = s.strip_prefix('+').unwrap_or(s);
    let bytes = s.as_bytes();
    let (radix, digits) = match bytes {
        [b'0', x, d, ..] if x.eq_ignore_ascii_case(&b'x') && d.is_ascii_hexdigit() => (16, &s[2..]),
        [b'0', _, ..] => (8, &s[1..]),
        _ => (10, s),
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
        return None;
    }
    u64::from_str_radix(digits, radix).ok()
}

impl SimHost {
    /// Start building a host (cgroup v2, systemd driver, containerd, modern kernel, no capacity).
    pub fn builder() -> SimHostBuilder {
        SimHostBuilder::default()
    }

    /// A host of `keys` TDX keys (the builder's defaults otherwise) with one Burstable pod `uid`
    /// whose one container is `compute`: where most tests of one pod's charges start.
    pub fn with_tdx_pod(keys: u64, uid: &str) -> Result<SimHost> {
        let host = Self::builder().capacity(TDX, keys).build()?;
        host.add_pod(uid, QosClass::Burstable, &["compute"])?;
        Ok(host)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic in another test thread while holding the lock leaves the model intact (every mutation
        // completes before files are written), so a poisoned lock is still usable.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    // ----- accessors -----

    /// The simulated `/sys/fs/cgroup` mount point.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The root of the misc hierarchy: [`SimHost::root`] on v2, `<root>/misc` on v1. Holds `misc.capacity`.
    pub fn misc_root(&self) -> &Path {
        &self.layout.misc_root
    }

    /// cgroup version.
    pub fn version(&self) -> CgroupVersion {
        self.layout.version
    }

    /// kubelet cgroup driver.
    pub fn driver(&self) -> CgroupDriver {
        self.layout.driver
    }

    /// Container runtime.
    pub fn runtime(&self) -> ContainerRuntime {
        self.layout.runtime
    }

    /// Absolute path of a cgroup given relative to the misc root.
    pub fn path(&self, cgroup: &str) -> PathBuf {
        if cgroup.is_empty() {
            self.layout.misc_root.clone()
        } else {
            self.layout.misc_root.join(cgroup)
        }
    }

    /// The kubepods cgroup (`kubepods.slice` or `kubepods`), absolute.
    pub fn kubepods_path(&self) -> PathBuf {
        self.path(&self.layout.kubepods_rel())
    }

    /// Where kubelet would put a pod's cgroup for this driver and QoS class, relative to the misc root,
    /// whether or not the pod exists.
    pub fn pod_cgroup_rel_for(&self, uid: &str, qos: QosClass) -> String {
        self.layout.pod_rel(qos, uid)
    }

    /// A pod's cgroup, relative to the misc root, if the pod was added.
    pub fn pod_cgroup_rel(&self, uid: &str) -> Option<String> {
        self.lock().pods.get(uid).map(|p| p.rel.clone())
    }

    /// A pod's cgroup directory, if the pod was added.
    pub fn pod_cgroup_path(&self, uid: &str) -> Option<PathBuf> {
        self.pod_cgroup_rel(uid).map(|rel| self.path(&rel))
    }

    /// A container's cgroup, relative to the misc root.
    pub fn container_cgroup_rel(&self, uid: &str, container: &str) -> Option<String> {
        self.lock()
            .pods
            .get(uid)
            .and_then(|p| p.containers.get(container).cloned())
    }

    /// A container's cgroup directory.
    pub fn container_cgroup_path(&self, uid: &str, container: &str) -> Option<PathBuf> {
        self.container_cgroup_rel(uid, container)
            .map(|rel| self.path(&rel))
    }

    /// UIDs of the pods currently present.
    pub fn pod_uids(&self) -> Vec<String> {
        self.lock().pods.keys().cloned().collect()
    }

    /// Capacity of a resource (0 if unknown).
    pub fn capacity(&self, resource: impl AsRef<str>) -> u64 {
        self.lock()
            .capacity
            .get(resource.as_ref())
            .copied()
            .unwrap_or(0)
    }

    /// Keys in use on the whole host (the root's hierarchical usage, whatever files the kernel shows).
    pub fn usage(&self, resource: impl AsRef<str>) -> u64 {
        self.usage_at("", resource).unwrap_or(0)
    }

    /// Keys free on the host (`capacity - usage`).
    pub fn free(&self, resource: impl AsRef<str>) -> u64 {
        let resource = resource.as_ref();
        self.capacity(resource).saturating_sub(self.usage(resource))
    }

    /// Hierarchical usage of a cgroup; `None` if the cgroup does not exist. A cgroup without the misc
    /// controller reports 0 (its charges land on an ancestor).
    pub fn usage_at(&self, cgroup: &str, resource: impl AsRef<str>) -> Option<u64> {
        let st = self.lock_absorbed(cgroup);
        st.nodes
            .get(cgroup)
            .map(|n| n.res.get(resource.as_ref()).map_or(0, |r| r.usage))
    }

    /// Hierarchical usage of a pod's cgroup (0 if the pod is unknown or its cgroup has no misc files).
    pub fn pod_usage(&self, uid: &str, resource: impl AsRef<str>) -> u64 {
        let Some(rel) = self.pod_cgroup_rel(uid) else {
            return 0;
        };
        self.usage_at(&rel, resource).unwrap_or(0)
    }

    /// The `<resource>.max` count of a cgroup's `misc.events` (0 if unknown).
    pub fn events(&self, cgroup: &str, resource: impl AsRef<str>) -> u64 {
        let st = self.lock_absorbed(cgroup);
        st.nodes
            .get(cgroup)
            .and_then(|n| n.res.get(resource.as_ref()))
            .map_or(0, |r| r.events)
    }

    /// The `<resource>.max` count of a cgroup's `misc.events.local` (0 if unknown).
    pub fn events_local(&self, cgroup: &str, resource: impl AsRef<str>) -> u64 {
        let st = self.lock_absorbed(cgroup);
        st.nodes
            .get(cgroup)
            .and_then(|n| n.res.get(resource.as_ref()))
            .map_or(0, |r| r.events_local)
    }

    /// A cgroup's limit for a resource as its `misc.max` shows it, after taking in what other processes
    /// wrote there: `Some(None)` is `max` (no limit), `Some(Some(n))` a limit of `n`; `None` when the
    /// cgroup does not exist, has no `misc.max` (the root, or the misc controller is not enabled), or the
    /// resource has no capacity (the kernel leaves it out of `misc.max`).
    pub fn max_of(&self, cgroup: &str, resource: impl AsRef<str>) -> Option<Option<u64>> {
        let resource = resource.as_ref();
        let st = self.lock_absorbed(cgroup);
        if cgroup.is_empty() || st.capacity.get(resource).copied().unwrap_or(0) == 0 {
            return None;
        }
        let node = st.nodes.get(cgroup).filter(|n| n.misc)?;
        Some(node.res.get(resource).and_then(|r| r.max))
    }

    /// [`SimHost::max_of`] for a pod's cgroup (`None` also when the pod is unknown).
    pub fn pod_max(&self, uid: &str, resource: impl AsRef<str>) -> Option<Option<u64>> {
        let rel = self.pod_cgroup_rel(uid)?;
        self.max_of(&rel, resource)
    }

    /// Take in what other processes wrote into every `misc.max` file (see the module docs) and rewrite
    /// those files with the kernel's full view. The simulator does this by itself where it matters (before
    /// a charge, for the levels the charge walks); call it to make every file show the kernel's view now.
    pub fn absorb_limit_writes(&self) -> Result<()> {
        let mut st = self.lock();
        self.absorb_all(&mut st);
        self.sync(&mut st)
    }

    /// Whether the misc controller is enabled in a cgroup (it has `misc.*` files); `None` if unknown.
    pub fn misc_enabled(&self, cgroup: &str) -> Option<bool> {
        self.lock().nodes.get(cgroup).map(|n| n.misc)
    }

    /// Relative paths of every cgroup in the tree (root = `""`), sorted.
    pub fn cgroups(&self) -> Vec<String> {
        self.lock().nodes.keys().cloned().collect()
    }

    /// Read and strictly parse one misc file of a cgroup (e.g. `read_misc("", "misc.current")`).
    pub fn read_misc(&self, cgroup: &str, file: &str) -> Result<BTreeMap<String, u64>> {
        let path = self.path(cgroup).join(file);
        let text = fs::read_to_string(&path).map_err(io_err("read", &path))?;
        parse_misc(&text).map_err(|msg| {
            io_err("parse", &path)(std::io::Error::new(std::io::ErrorKind::InvalidData, msg))
        })
    }

    // ----- tree changes -----

    /// Add a pod cgroup with its sandbox ([`SANDBOX`]) and the named containers, like kubelet does when
    /// it starts a pod. Returns the pod's cgroup directory.
    pub fn add_pod(&self, uid: &str, qos: QosClass, containers: &[&str]) -> Result<PathBuf> {
        let mut st = self.lock();
        if st.pods.contains_key(uid) {
            return Err(Error::AlreadyExists(format!("pod {uid}")));
        }
        let rel = self.layout.pod_rel(qos, uid);
        if st.nodes.contains_key(&rel) {
            return Err(Error::AlreadyExists(format!("cgroup {rel}")));
        }
        self.ensure_node(&mut st, &self.layout.qos_rel(qos), false);
        self.ensure_node(&mut st, &rel, false);
        let mut entry = PodEntry {
            rel: rel.clone(),
            containers: BTreeMap::new(),
        };
        for name in std::iter::once(SANDBOX).chain(containers.iter().copied()) {
            let crel = format!(
                "{rel}/{}",
                self.layout.container_dir(&container_id(uid, name))
            );
            self.ensure_node(&mut st, &crel, true);
            entry.containers.insert(name.to_owned(), crel);
        }
        st.pods.insert(uid.to_owned(), entry);
        self.sync(&mut st)?;
        Ok(self.path(&rel))
    }

    /// Add a container cgroup to an existing pod (e.g. a hotplugged sidecar). Returns its directory.
    pub fn add_container(&self, uid: &str, container: &str) -> Result<PathBuf> {
        let mut st = self.lock();
        let pod = st
            .pods
            .get(uid)
            .ok_or_else(|| Error::UnknownPod(uid.to_owned()))?;
        if pod.containers.contains_key(container) {
            return Err(Error::AlreadyExists(format!(
                "container {container} of pod {uid}"
            )));
        }
        let crel = format!(
            "{}/{}",
            pod.rel,
            self.layout.container_dir(&container_id(uid, container))
        );
        self.ensure_node(&mut st, &crel, true);
        if let Some(pod) = st.pods.get_mut(uid) {
            pod.containers.insert(container.to_owned(), crel.clone());
        }
        self.sync(&mut st)?;
        Ok(self.path(&crel))
    }

    /// Remove a pod's cgroups, releasing every key its processes held (the VMs exited).
    pub fn remove_pod(&self, uid: &str) -> Result<()> {
        let mut st = self.lock();
        let pod = st
            .pods
            .remove(uid)
            .ok_or_else(|| Error::UnknownPod(uid.to_owned()))?;
        self.remove_subtree(&mut st, &pod.rel)?;
        self.sync(&mut st)
    }

    /// Create an arbitrary cgroup (and its missing ancestors). `leaf` gives it an empty
    /// `cgroup.subtree_control`. Returns its directory.
    pub fn add_cgroup(&self, cgroup: &str, leaf: bool) -> Result<PathBuf> {
        let mut st = self.lock();
        if st.nodes.contains_key(cgroup) {
            return Err(Error::AlreadyExists(format!("cgroup {cgroup}")));
        }
        self.ensure_node(&mut st, cgroup, leaf);
        self.sync(&mut st)?;
        Ok(self.path(cgroup))
    }

    /// Remove an arbitrary cgroup subtree, releasing its charges.
    pub fn remove_cgroup(&self, cgroup: &str) -> Result<()> {
        if cgroup.is_empty() {
            return Err(Error::Unsupported("the root cgroup cannot be removed"));
        }
        let mut st = self.lock();
        if !st.nodes.contains_key(cgroup) {
            return Err(Error::UnknownCgroup(cgroup.to_owned()));
        }
        st.pods.retain(|_, p| !is_within(&p.rel, cgroup));
        st.externals.retain(|_, rel| !is_within(rel, cgroup));
        self.remove_subtree(&mut st, cgroup)?;
        self.sync(&mut st)
    }

    /// Create a pod-looking cgroup whose name carries `bogus` where the UID belongs (e.g.
    /// `kubepods-burstable-podnot_a_uid.slice`), which a scanner must skip without crashing. Returns its
    /// path relative to the misc root.
    pub fn add_unparsable_pod_dir(&self, qos: QosClass, bogus: &str) -> Result<String> {
        let rel = self.layout.pod_rel(qos, bogus);
        self.add_cgroup(&rel, false)?;
        Ok(rel)
    }

    /// Add a non-Kubernetes consumer holding `n` keys. `name` is either a cgroup path relative to the misc
    /// root (contains `/`, e.g. [`docker_container_cgroup`]) or a VM name, placed like libvirt does in
    /// `machine.slice/machine-qemu\x2d1\x2d<name>.scope`. Returns the cgroup's directory.
    pub fn add_external(&self, name: &str, resource: impl AsRef<str>, n: u64) -> Result<PathBuf> {
        let resource = resource.as_ref();
        let mut st = self.lock();
        if st.externals.contains_key(name) {
            return Err(Error::AlreadyExists(format!("external consumer {name}")));
        }
        let rel = if name.contains('/') {
            name.to_owned()
        } else {
            st.next_vm_id += 1;
            libvirt_vm_cgroup(st.next_vm_id, name)
        };
        if st.externals.values().any(|r| *r == rel) {
            return Err(Error::AlreadyExists(format!(
                "external consumer in cgroup {rel}"
            )));
        }
        let created = !st.nodes.contains_key(&rel);
        self.ensure_node(&mut st, &rel, true);
        if n > 0
            && let Err(err) = self.try_charge(&mut st, &rel, resource, n)
        {
            if created {
                self.remove_subtree(&mut st, &rel)?;
            }
            self.sync(&mut st)?;
            return Err(err);
        }
        st.externals.insert(name.to_owned(), rel.clone());
        self.sync(&mut st)?;
        Ok(self.path(&rel))
    }

    /// Remove a consumer added with [`SimHost::add_external`], releasing its keys.
    pub fn remove_external(&self, name: &str) -> Result<()> {
        let mut st = self.lock();
        let rel = st
            .externals
            .remove(name)
            .ok_or_else(|| Error::UnknownCgroup(name.to_owned()))?;
        self.remove_subtree(&mut st, &rel)?;
        self.sync(&mut st)
    }

    // ----- charges -----

    /// Charge `n` keys in a cgroup, like KVM does when a process there creates a TEE VM. Refused (and
    /// counted in `misc.events`) when a `misc.max` or the capacity would be exceeded.
    pub fn charge(&self, cgroup: &str, resource: impl AsRef<str>, n: u64) -> Result<()> {
        let mut st = self.lock();
        let result = self.try_charge(&mut st, cgroup, resource.as_ref(), n);
        self.sync(&mut st)?;
        result
    }

    /// Release `n` keys charged in a cgroup (the VM exited).
    pub fn uncharge(&self, cgroup: &str, resource: impl AsRef<str>, n: u64) -> Result<()> {
        let mut st = self.lock();
        self.release(&mut st, cgroup, resource.as_ref(), n)?;
        self.sync(&mut st)
    }

    /// Start a TEE VM in a pod's container: charge one key there (and in every ancestor).
    pub fn start_vm(&self, uid: &str, container: &str, resource: impl AsRef<str>) -> Result<()> {
        let rel = self.container_rel_checked(uid, container)?;
        self.charge(&rel, resource, 1)
    }

    /// Stop a TEE VM in a pod's container: release one key.
    pub fn stop_vm(&self, uid: &str, container: &str, resource: impl AsRef<str>) -> Result<()> {
        let rel = self.container_rel_checked(uid, container)?;
        self.uncharge(&rel, resource, 1)
    }

    /// Record a failed charge in a cgroup, as the kernel does when a charge there hits that cgroup's
    /// limit: `<resource>.max` in `misc.events` goes up by one in this cgroup and every ancestor, and in
    /// `misc.events.local` of this cgroup. Usage is unchanged.
    pub fn fail_charge(&self, cgroup: &str, resource: impl AsRef<str>) -> Result<()> {
        let resource = resource.as_ref();
        let mut st = self.lock();
        if !st.capacity.contains_key(resource) {
            return Err(Error::UnknownMiscResource(resource.to_owned()));
        }
        let at = self.effective(&st, cgroup)?;
        self.record_failure(&mut st, &at, resource);
        self.sync(&mut st)
    }

    /// [`SimHost::fail_charge`] in a pod's container cgroup.
    pub fn fail_charge_in(
        &self,
        uid: &str,
        container: &str,
        resource: impl AsRef<str>,
    ) -> Result<()> {
        let rel = self.container_rel_checked(uid, container)?;
        self.fail_charge(&rel, resource)
    }

    /// Set a cgroup's `misc.max` for a resource (`None` = `max`), like a runtime applying
    /// `linux.resources.unified["misc.max"]`. Fails where the controller is not enabled. Lowering it
    /// below the current usage is allowed (as in the kernel); later charges are refused.
    pub fn set_max(&self, cgroup: &str, resource: impl AsRef<str>, max: Option<u64>) -> Result<()> {
        let resource = resource.as_ref();
        let mut st = self.lock();
        if cgroup.is_empty() {
            return Err(Error::Unsupported("the root cgroup has no misc.max"));
        }
        // Keep what other processes wrote for other resources.
        self.absorb_max(&mut st, cgroup);
        let has_capacity = st.capacity.get(resource).copied().unwrap_or(0) > 0;
        let node = st
            .nodes
            .get_mut(cgroup)
            .ok_or_else(|| Error::UnknownCgroup(cgroup.to_owned()))?;
        if !node.misc {
            return Err(Error::MiscNotEnabled(cgroup.to_owned()));
        }
        if !has_capacity {
            // The kernel answers EINVAL for a resource it does not know or whose capacity is 0.
            return Err(if st.capacity.contains_key(resource) {
                Error::Invalid {
                    what: "misc.max",
                    cgroup: cgroup.to_owned(),
                    resource: resource.to_owned(),
                }
            } else {
                Error::UnknownMiscResource(resource.to_owned())
            });
        }
        node.res.entry(resource.to_owned()).or_default().max = max;
        st.dirty.insert(cgroup.to_owned());
        self.sync(&mut st)
    }

    /// Change a resource's capacity (0 keeps the resource known but removes it from `misc.capacity`;
    /// lines in other files stay while usage or events are non-zero, like the kernel).
    pub fn set_capacity(&self, resource: impl AsRef<str>, n: u64) -> Result<()> {
        let mut st = self.lock();
        // Limits written before the change were accepted or refused under the old capacities.
        self.absorb_all(&mut st);
        st.capacity.insert(resource.as_ref().to_owned(), n);
        st.all_dirty = true;
        self.sync(&mut st)
    }

    /// Make the kernel forget a resource: it disappears from every file, usage and events included.
    pub fn remove_resource(&self, resource: impl AsRef<str>) -> Result<()> {
        let resource = resource.as_ref();
        let mut st = self.lock();
        self.absorb_all(&mut st);
        st.capacity.remove(resource);
        st.charges.retain(|(_, name), _| name != resource);
        for node in st.nodes.values_mut() {
            node.res.remove(resource);
        }
        st.all_dirty = true;
        self.sync(&mut st)
    }

    // ----- faults -----

    /// Resolve a file argument: absolute paths are used as given, relative ones are relative to the misc
    /// root.
    pub fn file(&self, path: impl AsRef<Path>) -> PathBuf {
        let path = path.as_ref();
        if path.is_absolute() {
            path.to_path_buf()
        } else {
            self.layout.misc_root.join(path)
        }
    }

    /// Atomically replace a file with arbitrary content and pin it (not rewritten until healed).
    pub fn write_raw(&self, path: impl AsRef<Path>, contents: &str) -> Result<()> {
        let path = self.file(path);
        let mut st = self.lock();
        st.pinned.insert(path.clone());
        st.written.remove(&path);
        self.write_atomic(&mut st, &path, contents.as_bytes())
    }

    /// Atomically replace a file with deterministic garbage (binary bytes, lines without numbers,
    /// overflowing numbers) and pin it.
    pub fn write_garbage(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = self.file(path);
        let mut bytes: Vec<u8> =
            b"tdx \xff\xfe\x00garbage\nsev_es -3\nsev 99999999999999999999999\n\tnot a line"
                .to_vec();
        bytes.extend_from_slice(&[0x80, 0x81, b'\n']);
        let mut st = self.lock();
        st.pinned.insert(path.clone());
        st.written.remove(&path);
        self.write_atomic(&mut st, &path, &bytes)
    }

    /// Atomically empty a file and pin it.
    pub fn truncate(&self, path: impl AsRef<Path>) -> Result<()> {
        self.write_raw(path, "")
    }

    /// Deliberately NOT atomic: rewrite the file in place with only the first half of its current
    /// content (a torn write, e.g. `"tdx 3\nse"`), and pin it. Returns what was written.
    pub fn write_half(&self, path: impl AsRef<Path>) -> Result<String> {
        let path = self.file(path);
        let current = fs::read(&path).map_err(io_err("read", &path))?;
        let half = &current[..current.len() / 2];
        let mut st = self.lock();
        st.pinned.insert(path.clone());
        st.written.remove(&path);
        drop(st);
        write_in_place(&path, half)?;
        Ok(String::from_utf8_lossy(half).into_owned())
    }

    /// Deliberately NOT atomic: truncate the file and write `contents` in place with a separate write
    /// call per line (a reader may see any prefix). Pins the file.
    pub fn write_in_place(&self, path: impl AsRef<Path>, contents: &str) -> Result<()> {
        let path = self.file(path);
        let mut st = self.lock();
        st.pinned.insert(path.clone());
        st.written.remove(&path);
        drop(st);
        write_in_place(&path, contents.as_bytes())
    }

    /// Replace a file with an empty directory, so reading it fails with an I/O error (`EISDIR`) even as
    /// root. Pinned until healed.
    pub fn replace_with_dir(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = self.file(path);
        let mut st = self.lock();
        st.pinned.insert(path.clone());
        st.written.remove(&path);
        if path.is_dir() {
            return Ok(());
        }
        if path.exists() {
            fs::remove_file(&path).map_err(io_err("remove", &path))?;
        }
        fs::create_dir(&path).map_err(io_err("create directory", &path))
    }

    /// Make reading a pod's `misc.current` fail with an I/O error (replaces it with a directory). Use this
    /// rather than [`SimHost::make_pod_unreadable`] when tests run as root. Returns the broken file.
    pub fn break_pod_misc_current(&self, uid: &str) -> Result<PathBuf> {
        let rel = self
            .pod_cgroup_rel(uid)
            .ok_or_else(|| Error::UnknownPod(uid.to_owned()))?;
        let file = self.path(&rel).join("misc.current");
        self.replace_with_dir(&file)?;
        Ok(file)
    }

    /// `chmod 000` a pod's cgroup directory and its `misc.*` files. Only effective for non-root
    /// processes: root (`CAP_DAC_OVERRIDE`, as in CI containers) still reads them; see
    /// [`SimHost::break_pod_misc_current`] for an error that also hits root. Undo with
    /// [`SimHost::make_pod_readable`].
    pub fn make_pod_unreadable(&self, uid: &str) -> Result<PathBuf> {
        self.set_pod_mode(uid, 0o000, 0o000)
    }

    /// Restore the permissions changed by [`SimHost::make_pod_unreadable`].
    pub fn make_pod_readable(&self, uid: &str) -> Result<PathBuf> {
        self.set_pod_mode(uid, 0o755, 0o444)
    }

    fn set_pod_mode(&self, uid: &str, dir_mode: u32, file_mode: u32) -> Result<PathBuf> {
        use std::os::unix::fs::PermissionsExt as _;
        let rel = self
            .pod_cgroup_rel(uid)
            .ok_or_else(|| Error::UnknownPod(uid.to_owned()))?;
        let dir = self.path(&rel);
        // Files first while the directory is still searchable, directory last (and the reverse on undo).
        let apply_dir = |mode| {
            fs::set_permissions(&dir, fs::Permissions::from_mode(mode))
                .map_err(io_err("chmod", &dir))
        };
        if dir_mode != 0 {
            apply_dir(dir_mode)?;
        }
        for name in [
            "misc.current",
            "misc.peak",
            "misc.max",
            "misc.events",
            "misc.events.local",
        ] {
            let file = dir.join(name);
            if file.is_file() {
                fs::set_permissions(&file, fs::Permissions::from_mode(file_mode))
                    .map_err(io_err("chmod", &file))?;
            }
        }
        if dir_mode == 0 {
            apply_dir(dir_mode)?;
        }
        Ok(dir)
    }

    /// Stop treating a file as broken and rewrite its true content (removes a directory put in its place).
    pub fn heal(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = self.file(path);
        let mut st = self.lock();
        st.pinned.remove(&path);
        st.written.remove(&path);
        // The broken content was a fault, not a write by another process: a `misc.max` is not absorbed
        // from it.
        if let Ok(bytes) = fs::read(&path) {
            st.max_seen
                .insert(path.clone(), String::from_utf8_lossy(&bytes).into_owned());
        }
        if path.is_dir() {
            fs::remove_dir_all(&path).map_err(io_err("remove", &path))?;
        }
        st.all_dirty = true;
        self.sync(&mut st)
    }

    /// [`SimHost::heal`] every broken file.
    pub fn heal_all(&self) -> Result<()> {
        let pinned: Vec<PathBuf> = std::mem::take(&mut self.lock().pinned)
            .into_iter()
            .collect();
        for path in pinned {
            self.heal(path)?;
        }
        Ok(())
    }

    /// Rewrite every file from the model (files changed behind the simulator's back are restored, pinned
    /// files excepted).
    pub fn resync(&self) -> Result<()> {
        let mut st = self.lock();
        self.absorb_all(&mut st);
        st.written.clear();
        st.all_dirty = true;
        self.sync(&mut st)
    }

    // ----- internals -----

    /// Lock the state after taking in what other processes wrote into `cgroup`'s `misc.max` (rewriting
    /// it with the kernel's view; a failed rewrite is retried by the next operation).
    fn lock_absorbed(&self, cgroup: &str) -> MutexGuard<'_, State> {
        let mut st = self.lock();
        self.absorb_max(&mut st, cgroup);
        if !st.dirty.is_empty() {
            // Best effort in readers: the model is already up to date, only the file may lag.
            let _ = self.sync(&mut st);
        }
        st
    }

    /// Take in what another process wrote into the `misc.max` of one cgroup, like the kernel's
    /// `misc_cg_max_write` (one write per line), and mark the cgroup for a rewrite with the kernel's
    /// view. No-op for the root, unknown cgroups, cgroups without the controller and pinned files.
    fn absorb_max(&self, st: &mut State, rel: &str) {
        if rel.is_empty() || !st.nodes.get(rel).is_some_and(|n| n.misc) {
            return;
        }
        let path = self.path(rel).join("misc.max");
        if st.pinned.contains(&path) {
            return;
        }
        let text = match fs::read(&path) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                // Removed behind the simulator's back (cgroupfs files cannot be): recreate it.
                st.written.remove(&path);
                st.dirty.insert(rel.to_owned());
                return;
            }
            // Unreadable (made so on purpose): leave it alone.
            Err(_) => return,
        };
        // Empty: a writer between its open with O_TRUNC and its write (the kernel's file is never
        // empty); taking that in would rewrite the file over the write about to land. Read it again
        // next time.
        if text.is_empty() || st.max_seen.get(&path) == Some(&text) {
            return;
        }
        for line in text.split('\n') {
            let Some((name, max)) = parse_max_write(line) else {
                continue;
            };
            if st.capacity.get(name).copied().unwrap_or(0) == 0 {
                continue; // EINVAL: unknown resource or capacity 0
            }
            if let Some(node) = st.nodes.get_mut(rel) {
                node.res.entry(name.to_owned()).or_default().max = max;
            }
        }
        st.max_seen.insert(path.clone(), text);
        st.written.remove(&path);
        st.dirty.insert(rel.to_owned());
    }

    /// [`SimHost::absorb_max`] for every cgroup.
    fn absorb_all(&self, st: &mut State) {
        let rels: Vec<String> = st.nodes.keys().cloned().collect();
        for rel in rels {
            self.absorb_max(st, &rel);
        }
    }

    fn container_rel_checked(&self, uid: &str, container: &str) -> Result<String> {
        let st = self.lock();
        let pod = st
            .pods
            .get(uid)
            .ok_or_else(|| Error::UnknownPod(uid.to_owned()))?;
        pod.containers
            .get(container)
            .cloned()
            .ok_or_else(|| Error::UnknownContainer {
                uid: uid.to_owned(),
                container: container.to_owned(),
            })
    }

    /// Create a node and its missing ancestors (ancestors are non-leaf).
    fn ensure_node(&self, st: &mut State, rel: &str, leaf: bool) {
        if st.nodes.contains_key(rel) {
            return;
        }
        let parent = parent_rel(rel).unwrap_or("");
        self.ensure_node(st, parent, false);
        let (parent_misc, parent_subtree) = st
            .nodes
            .get(parent)
            .map_or((true, true), |p| (p.misc, p.subtree_misc));
        let misc = match self.layout.version {
            CgroupVersion::V1 => true,
            CgroupVersion::V2 => parent_misc && parent_subtree,
        };
        let subtree_misc = match self.layout.version {
            CgroupVersion::V1 => true,
            CgroupVersion::V2 => {
                !leaf
                    && misc
                    && !(self.layout.delegation == MiscDelegation::NotBelowKubepods
                        && rel == self.layout.kubepods_rel())
            }
        };
        st.nodes
            .insert(rel.to_owned(), Node::new(misc, subtree_misc, leaf));
        st.dirty.insert(rel.to_owned());
        st.dirty.insert(parent.to_owned());
    }

    /// The nearest ancestor-or-self with the misc controller (where the kernel charges).
    fn effective(&self, st: &State, rel: &str) -> Result<String> {
        let mut cur = rel;
        loop {
            let node = st
                .nodes
                .get(cur)
                .ok_or_else(|| Error::UnknownCgroup(rel.to_owned()))?;
            if node.misc {
                return Ok(cur.to_owned());
            }
            cur = parent_rel(cur).unwrap_or("");
        }
    }

    /// Ancestors of `rel` from itself up to the root.
    fn chain(rel: &str) -> Vec<String> {
        let mut out = vec![rel.to_owned()];
        let mut cur = rel;
        while let Some(parent) = parent_rel(cur) {
            out.push(parent.to_owned());
            cur = parent;
        }
        out
    }

    /// `misc_cg_try_charge`: walk up, fail at the first level over its max or the capacity.
    fn try_charge(&self, st: &mut State, rel: &str, resource: &str, n: u64) -> Result<()> {
        let capacity = *st
            .capacity
            .get(resource)
            .ok_or_else(|| Error::UnknownMiscResource(resource.to_owned()))?;
        let at = self.effective(st, rel)?;
        if capacity == 0 {
            // The kernel refuses before walking the cgroups: nothing is counted anywhere.
            return Err(Error::Invalid {
                what: "charge",
                cgroup: rel.to_owned(),
                resource: resource.to_owned(),
            });
        }
        let chain = Self::chain(&at);
        // The limits that decide this charge are those of the levels it walks: take in what other
        // processes wrote there first.
        for level in &chain {
            self.absorb_max(st, level);
        }
        for level in &chain {
            let res = st
                .nodes
                .get(level)
                .and_then(|n| n.res.get(resource))
                .cloned()
                .unwrap_or_default();
            let would_be = res.usage + n;
            let limit = res.max.map_or(capacity, |m| m.min(capacity));
            if would_be > limit {
                self.record_failure(st, level, resource);
                return Err(Error::ChargeRefused {
                    cgroup: rel.to_owned(),
                    resource: resource.to_owned(),
                    amount: n,
                    failed_at: level.clone(),
                    would_be,
                    limit,
                });
            }
        }
        for level in &chain {
            if let Some(node) = st.nodes.get_mut(level) {
                let res = node.res.entry(resource.to_owned()).or_default();
                res.usage += n;
                res.watermark = res.watermark.max(res.usage);
            }
            st.dirty.insert(level.clone());
        }
        *st.charges
            .entry((rel.to_owned(), resource.to_owned()))
            .or_default() += n;
        Ok(())
    }

    fn record_failure(&self, st: &mut State, at: &str, resource: &str) {
        for level in Self::chain(at) {
            if let Some(node) = st.nodes.get_mut(&level) {
                let res = node.res.entry(resource.to_owned()).or_default();
                res.events += 1;
                if level == at {
                    res.events_local += 1;
                }
            }
            st.dirty.insert(level);
        }
    }

    fn release(&self, st: &mut State, rel: &str, resource: &str, n: u64) -> Result<()> {
        let at = self.effective(st, rel)?;
        let key = (rel.to_owned(), resource.to_owned());
        let own = st.charges.get(&key).copied().unwrap_or(0);
        if own < n {
            return Err(Error::NotCharged {
                cgroup: rel.to_owned(),
                resource: resource.to_owned(),
                amount: n,
                charged: own,
            });
        }
        for level in Self::chain(&at) {
            if let Some(node) = st.nodes.get_mut(&level)
                && let Some(res) = node.res.get_mut(resource)
            {
                res.usage = res.usage.saturating_sub(n);
            }
            st.dirty.insert(level);
        }
        if own == n {
            st.charges.remove(&key);
        } else {
            st.charges.insert(key, own - n);
        }
        Ok(())
    }

    /// Release every charge held in a subtree, then delete its nodes and directory.
    fn remove_subtree(&self, st: &mut State, rel: &str) -> Result<()> {
        let inside: Vec<String> = st
            .nodes
            .keys()
            .filter(|k| is_within(k, rel))
            .cloned()
            .collect();
        let held: Vec<((String, String), u64)> = st
            .charges
            .iter()
            .filter(|((cg, _), _)| is_within(cg, rel))
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        for ((cgroup, resource), n) in held {
            self.release(st, &cgroup, &resource, n)?;
        }
        for node_rel in &inside {
            st.nodes.remove(node_rel);
            st.dirty.remove(node_rel);
        }
        if let Some(parent) = parent_rel(rel) {
            st.dirty.insert(parent.to_owned());
        }
        let dir = self.path(rel);
        st.written.retain(|p, _| !p.starts_with(&dir));
        st.max_seen.retain(|p, _| !p.starts_with(&dir));
        st.pinned.retain(|p| !p.starts_with(&dir));
        if dir.exists() {
            // A pod made unreadable must still be removable.
            make_tree_writable(&dir);
            fs::remove_dir_all(&dir).map_err(io_err("remove", &dir))?;
        }
        Ok(())
    }

    /// Resources shown in files, in kernel order.
    fn resources(st: &State) -> Vec<String> {
        let mut names: Vec<&String> = st.capacity.keys().collect();
        names.sort_by(|a, b| resource_rank(a).cmp(&resource_rank(b)));
        names.into_iter().cloned().collect()
    }

    /// Render every file of one cgroup: (file name, content).
    fn render(&self, st: &State, rel: &str, resources: &[String]) -> Vec<(&'static str, String)> {
        let Some(node) = st.nodes.get(rel) else {
            return Vec::new();
        };
        let is_root = rel.is_empty();
        let mut files: Vec<(&'static str, String)> = Vec::new();
        match self.layout.version {
            CgroupVersion::V2 => {
                let controllers = if is_root {
                    format!("{V2_CONTROLLERS} misc\n")
                } else {
                    let parent = st.nodes.get(parent_rel(rel).unwrap_or(""));
                    match parent {
                        Some(p) if p.subtree_misc => format!("{V2_CONTROLLERS} misc\n"),
                        _ => format!("{V2_CONTROLLERS}\n"),
                    }
                };
                let subtree = if node.leaf {
                    "\n".to_owned()
                } else if node.subtree_misc {
                    "cpuset cpu io memory hugetlb pids rdma misc\n".to_owned()
                } else {
                    "cpuset cpu io memory hugetlb pids rdma\n".to_owned()
                };
                files.push(("cgroup.controllers", controllers));
                files.push(("cgroup.subtree_control", subtree));
                files.push(("cgroup.procs", String::new()));
                if !is_root {
                    files.push(("cgroup.type", "domain\n".to_owned()));
                }
            }
            CgroupVersion::V1 => {
                files.push(("cgroup.procs", String::new()));
                files.push(("tasks", String::new()));
                files.push(("notify_on_release", "0\n".to_owned()));
                files.push(("cgroup.clone_children", "0\n".to_owned()));
                if is_root {
                    files.push(("release_agent", "\n".to_owned()));
                    files.push(("cgroup.sane_behavior", "0\n".to_owned()));
                }
            }
        }
        if !node.misc {
            return files;
        }
        let cap = |name: &str| st.capacity.get(name).copied().unwrap_or(0);
        let get = |name: &str| node.res.get(name).cloned().unwrap_or_default();
        let mut current = String::new();
        let mut peak = String::new();
        let mut max = String::new();
        let mut events = String::new();
        let mut events_local = String::new();
        for name in resources {
            let r = get(name);
            let c = cap(name);
            if c > 0 || r.usage > 0 {
                current.push_str(&format!("{name} {}\n", r.usage));
            }
            if c > 0 || r.watermark > 0 {
                peak.push_str(&format!("{name} {}\n", r.watermark));
            }
            if c > 0 {
                match r.max {
                    None => max.push_str(&format!("{name} max\n")),
                    Some(m) => max.push_str(&format!("{name} {m}\n")),
                }
            }
            if c > 0 || r.events > 0 {
                events.push_str(&format!("{name}.max {}\n", r.events));
            }
            if c > 0 || r.events_local > 0 {
                events_local.push_str(&format!("{name}.max {}\n", r.events_local));
            }
        }
        let kernel = self.layout.kernel;
        if is_root {
            let mut capacity = String::new();
            for name in resources {
                let c = cap(name);
                if c > 0 {
                    capacity.push_str(&format!("{name} {c}\n"));
                }
            }
            files.push(("misc.capacity", capacity));
            if kernel.root_current {
                files.push(("misc.current", current));
            }
            if kernel.peak {
                files.push(("misc.peak", peak));
            }
        } else {
            files.push(("misc.current", current));
            if kernel.peak {
                files.push(("misc.peak", peak));
            }
            files.push(("misc.max", max));
            files.push(("misc.events", events));
            if kernel.events_local {
                files.push(("misc.events.local", events_local));
            }
        }
        files
    }

    /// Write every file whose rendered content changed since the last write (pinned files excepted).
    fn sync(&self, st: &mut State) -> Result<()> {
        let rels: Vec<String> = if st.all_dirty {
            st.nodes.keys().cloned().collect()
        } else {
            std::mem::take(&mut st.dirty)
                .into_iter()
                .filter(|r| st.nodes.contains_key(r))
                .collect()
        };
        st.all_dirty = false;
        st.dirty.clear();
        // Never overwrite a limit another process wrote without taking it in.
        for rel in &rels {
            self.absorb_max(st, rel);
        }
        st.dirty.clear();
        let resources = Self::resources(st);
        for rel in rels {
            let dir = self.path(&rel);
            if !dir.is_dir() {
                fs::create_dir_all(&dir).map_err(io_err("create directory", &dir))?;
            }
            for (name, content) in self.render(st, &rel, &resources) {
                let path = dir.join(name);
                if st.pinned.contains(&path) || st.written.get(&path) == Some(&content) {
                    continue;
                }
                match self.layout.write_mode {
                    WriteMode::Atomic => self.write_atomic(st, &path, content.as_bytes())?,
                    WriteMode::InPlace => write_in_place(&path, content.as_bytes())?,
                }
                if name == "misc.max" {
                    st.max_seen.insert(path.clone(), content.clone());
                }
                st.written.insert(path, content);
            }
        }
        Ok(())
    }

    fn write_atomic(&self, st: &mut State, path: &Path, bytes: &[u8]) -> Result<()> {
        let dir = path.parent().unwrap_or(&self.root);
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        st.tmp_counter += 1;
        let tmp = dir.join(format!(".{name}.sim-tmp-{}", st.tmp_counter));
        fs::write(&tmp, bytes).map_err(io_err("write", &tmp))?;
        if path.is_dir() {
            fs::remove_dir_all(path).map_err(io_err("remove", path))?;
        }
        fs::rename(&tmp, path).map_err(io_err("rename into place", path))
    }
}

/// Where temporary trees go: `$TEEGUARD_SIM_DIR` if set, else `/dev/shm` (memory-backed like cgroupfs,
/// and about ten times faster than a disk-backed `/tmp` for the many small renames), else the system
/// temporary directory.
fn default_parent_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("TEEGUARD_SIM_DIR") {
        return PathBuf::from(dir);
    }
    let shm = Path::new("/dev/shm");
    let writable = fs::metadata(shm)
        .map(|m| m.is_dir() && !m.permissions().readonly())
        .unwrap_or(false);
    if writable {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

fn is_within(rel: &str, ancestor: &str) -> bool {
    ancestor.is_empty()
        || rel == ancestor
        || rel
            .strip_prefix(ancestor)
            .is_some_and(|rest| rest.starts_with('/'))
}

fn write_in_place(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(io_err("open", path))?;
    for chunk in bytes.split_inclusive(|b| *b == b'\n') {
        file.write_all(chunk).map_err(io_err("write", path))?;
    }
    Ok(())
}

fn make_tree_writable(dir: &Path) {
    use std::os::unix::fs::PermissionsExt as _;
    // Best effort: failures surface in the following remove_dir_all.
    let _ = fs::set_permissions(dir, fs::Permissions::from_mode(0o755));
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                make_tree_writable(&path);
            }
        }
    }
}
