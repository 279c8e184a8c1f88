//! Reading the host's misc cgroup files: the filesystem adapter.
//!
//! One [`Scanner::scan`] reads, in this order:
//!
//! 1. `misc.capacity` at the root (cgroup v2 `<root>/misc.capacity`, v1 `<root>/misc/misc.capacity`);
//!    a host without TEE capacity stops here;
//! 2. the root `misc.current`;
//! 3. the kubepods subtree, only as deep as needed: `kubepods[.slice]/misc.current` (if the whole subtree
//!    holds no key, no pod is read) and the QoS levels (`burstable`, `besteffort`; their
//!    `cgroup.subtree_control` too, to tell whether pod cgroups get misc files at all); then pod-level
//!    `misc.current` only, never containers:
//!    - agent mode ([`Interest::Only`]): only the pods that request keys, opened by constructed path
//!      (the place found first is remembered), without listing any directory;
//!    - walk mode ([`Interest::All`], the `scan` subcommand): every pod directory, by listing the
//!      kubepods and QoS directories (QoS levels holding nothing are skipped);
//! 4. the root `misc.current` again: when it moved while the pods were read (a VM started or stopped),
//!    the pods are read again (up to 3 attempts), so keys do not shift between "pods" and "external"
//!    for a poll interval.
//!
//! Pod cgroup names understood: systemd driver `kubepods-<qos>-pod<uid_with_underscores>.slice` and
//! `kubepods-pod<uid>.slice` (guaranteed), cgroupfs driver `pod<uid>`. Directories that look like pods but
//! carry no valid UID are skipped (their usage ends up as external). A pod cgroup that cannot be read is
//! recorded as a problem and treated as holding nothing (its request then counts as pending and its real
//! usage as external: conservative in both directions).
//!
//! The scan reuses its path and content buffers, reads files with a plain read loop (no stat/seek), and
//! in agent mode allocates only for pods that hold keys.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{ErrorKind, Read};
use std::path::{Path, PathBuf};

use serde::Serialize;
use teeguard_shared::TeeKind;
use teeguard_shared::misc::{CgroupLayout, MiscController};

use crate::attribution::{Accounting, KindCounts};
use crate::error::{Error, Result};

/// Attempts at a consistent snapshot (root usage unchanged while the pods were read).
const MAX_SNAPSHOT_ATTEMPTS: u32 = 3;

/// At most this many skipped names and problems are kept per scan (the counts are exact).
const MAX_LISTED: usize = 16;

/// Which pods' cgroups to read.
#[derive(Clone, Copy, Debug)]
pub enum Interest<'a> {
    /// Every pod cgroup (the `scan` subcommand).
    All,
    /// Only these pod UIDs (the agent: pods that request a TEE resource). Usage of every other pod
    /// counts as external anyway, so it need not be read.
    Only(&'a HashSet<String>),
}

impl Interest<'_> {
    fn wants(&self, uid: &str) -> bool {
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
    /// The pod cgroups, when the host has TEE capacity (otherwise they are not looked at).
    pub pods: Option<PodScan>,
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
    fn new(accounting: Accounting, reason: String) -> Self {
        PodScan {
            kubepods: None,
            driver: None,
            accounting,
            accounting_reason: reason,
            usage: HashMap::new(),
            pods_read: 0,
            skipped: Vec::new(),
            skipped_count: 0,
            problems: Vec::new(),
            problem_count: 0,
        }
    }

    fn not_delegated(&mut self, reason: String) {
        self.accounting = Accounting::RunningPods;
        self.accounting_reason = reason;
        self.usage.clear();
    }

    fn skip(&mut self, name: &str) {
        self.skipped_count += 1;
        if self.skipped.len() < MAX_LISTED {
            self.skipped.push(name.to_string());
        }
    }

    fn problem(&mut self, message: String) {
        self.problem_count += 1;
        if self.problems.len() < MAX_LISTED {
            self.problems.push(message);
        }
    }
}

/// Reads the misc cgroup files under one cgroup root; keep one and call [`Scanner::scan`] repeatedly.
#[derive(Debug)]
pub struct Scanner {
    root: PathBuf,
    path: PathBuf,
    buf: Vec<u8>,
    uid: String,
    /// Where each pod of interest's cgroup was found last time (agent mode), to open it directly.
    locations: HashMap<String, PathBuf>,
}

impl Scanner {
    /// A scanner for the host cgroup tree mounted at `cgroup_root` (e.g. `/host/sys/fs/cgroup`).
    pub fn new(cgroup_root: impl Into<PathBuf>) -> Self {
        Scanner {
            root: cgroup_root.into(),
            path: PathBuf::with_capacity(256),
            buf: Vec::with_capacity(512),
            uid: String::with_capacity(40),
            locations: HashMap::new(),
        }
    }

    /// The cgroup root this scanner reads.
    pub fn cgroup_root(&self) -> &Path {
        &self.root
    }

    /// Read capacity and usage. `Err` means a file that must be readable (the root `misc.capacity` or
    /// `misc.current`) could not be read or parsed; pod-level trouble is reported inside the result.
    pub fn scan(&mut self, interest: Interest<'_>) -> Result<HostState> {
        let controller = match MiscController::locate(&self.root) {
            Ok(c) => c,
            Err(e @ teeguard_shared::Error::MiscControllerNotFound { .. }) => {
                return Ok(HostState::NoController {
                    message: e.to_string(),
                });
            }
            Err(e) => return Err(e.into()),
        };
        let capacity = KindCounts::from_misc(&controller.capacity()?);
        if capacity.is_zero() {
            return Ok(HostState::Scanned(HostScan {
                misc_dir: controller.dir().to_path_buf(),
                layout: controller.layout(),
                capacity,
                kernel_used: KindCounts::ZERO,
                pods: None,
            }));
        }
        // The pod files and the root file are read at different instants. Read the root before and
        // after the pods and retry when it moved, so a VM starting or stopping mid-scan does not
        // shift keys between "pods" and "external" for a poll interval.
        let mut before = KindCounts::from_misc(&controller.current()?);
        let mut attempts = 1;
        let (pods, kernel_used) = loop {
            let pods = self.scan_pods(controller.dir(), interest);
            let after = KindCounts::from_misc(&controller.current()?);
            if after == before || attempts == MAX_SNAPSHOT_ATTEMPTS {
                break (Some(pods), after);
            }
            before = after;
            attempts += 1;
        };
        Ok(HostState::Scanned(HostScan {
            misc_dir: controller.dir().to_path_buf(),
            layout: controller.layout(),
            capacity,
            kernel_used,
            pods,
        }))
    }

    /// Top-level cgroup directories under the misc controller whose `misc.events` exists (these count
    /// failed charges of their whole subtree, kubepods included). Empty when there is no controller.
    pub fn events_dirs(&self) -> Vec<PathBuf> {
        let Ok(controller) = MiscController::locate(&self.root) else {
            return Vec::new();
        };
        let Ok(rd) = std::fs::read_dir(controller.dir()) else {
            return Vec::new();
        };
        let mut out: Vec<PathBuf> = rd
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
            .map(|e| e.path())
            .filter(|p| p.join("misc.events").is_file())
            .collect();
        out.sort();
        out
    }

    fn scan_pods(&mut self, misc_dir: &Path, interest: Interest<'_>) -> PodScan {
        let (name, driver) = if misc_dir.join("kubepods.slice").is_dir() {
            ("kubepods.slice", Driver::Systemd)
        } else if misc_dir.join("kubepods").is_dir() {
            ("kubepods", Driver::Cgroupfs)
        } else {
            return PodScan::new(
                Accounting::RunningPods,
                format!(
                    "no kubepods cgroup under {} (looked for kubepods.slice and kubepods)",
                    misc_dir.display()
                ),
            );
        };
        let kubepods = misc_dir.join(name);
        let mut scan = PodScan::new(
            Accounting::PerPod,
            format!(
                "pod cgroups under {} carry misc.current",
                kubepods.display()
            ),
        );
        scan.kubepods = Some(kubepods.clone());
        scan.driver = Some(driver);

        // cgroup v2 lists the controllers available in a cgroup; v1 hierarchies have no such file.
        if self.file_lacks_misc(&kubepods, "cgroup.controllers") {
            scan.not_delegated(format!(
                "{}/cgroup.controllers does not list the misc controller",
                kubepods.display()
            ));
            return scan;
        }
        let top = match self.level(&kubepods) {
            Ok(u) => u,
            Err(reason) => {
                scan.not_delegated(reason);
                return scan;
            }
        };
        let qos_names = match driver {
            Driver::Systemd => ["kubepods-burstable.slice", "kubepods-besteffort.slice"],
            Driver::Cgroupfs => ["burstable", "besteffort"],
        };
        if let Interest::Only(set) = interest {
            self.locations.retain(|uid, _| set.contains(uid));
        }
        if top == LevelUsage::Zero || !matches!(interest, Interest::All) {
            // The answer must not depend on usage: check the QoS levels too.
            for q in qos_names {
                let qos = kubepods.join(q);
                if qos.is_dir()
                    && let Err(reason) = self.level(&qos)
                {
                    scan.not_delegated(reason);
                    return scan;
                }
            }
            if let (Interest::Only(set), false) = (interest, top == LevelUsage::Zero) {
                for uid in set {
                    if !self.direct_pod(&mut scan, &kubepods, driver, uid) {
                        return scan;
                    }
                }
            }
            return scan;
        }

        let entries = match list_dirs(&kubepods) {
            Ok(e) => e,
            Err(e) => {
                scan.problem(e.to_string());
                return scan;
            }
        };
        for entry in entries {
            match classify(&entry) {
                CgroupName::Qos => {
                    let qos = kubepods.join(&entry);
                    match self.level(&qos) {
                        Err(reason) => {
                            scan.not_delegated(reason);
                            return scan;
                        }
                        Ok(LevelUsage::Zero) => continue,
                        Ok(LevelUsage::Held | LevelUsage::Unknown) => {}
                    }
                    let pods = match list_dirs(&qos) {
                        Ok(p) => p,
                        Err(e) => {
                            scan.problem(e.to_string());
                            continue;
                        }
                    };
                    for pod in pods {
                        if let CgroupName::Pod { uid, systemd } = classify(&pod)
                            && !self.pod(&mut scan, &qos, &pod, uid, systemd, interest)
                        {
                            return scan;
                        }
                    }
                }
                CgroupName::Pod { uid, systemd } => {
                    if !self.pod(&mut scan, &kubepods, &entry, uid, systemd, interest) {
                        return scan;
                    }
                }
                CgroupName::Other => {}
            }
        }
        scan
    }

    /// Agent mode: read a pod's cgroup by constructing its path (no directory listing). The QoS class is
    /// not known from the UID, so the three possible places are tried once and the hit remembered.
    /// Returns false when the pod showed the controller is not delegated (stop).
    fn direct_pod(
        &mut self,
        scan: &mut PodScan,
        kubepods: &Path,
        driver: Driver,
        uid: &str,
    ) -> bool {
        if !is_valid_uid(uid) {
            // UIDs come from the API server; never build paths from anything else.
            tracing::debug!(uid, "pod UID is not a UUID; its cgroup is not read");
            return true;
        }
        if let Some(dir) = self.locations.get(uid) {
            self.path.clear();
            self.path.push(dir);
            match self.read_pod_file(scan, uid) {
                PodRead::Done => return true,
                PodRead::NotDelegated => return false,
                PodRead::Gone => {
                    self.locations.remove(uid);
                }
            }
        }
        let places = match driver {
            Driver::Systemd => &SYSTEMD_PLACES,
            Driver::Cgroupfs => &CGROUPFS_PLACES,
        };
        for (qos, prefix) in places {
            self.uid.clear();
            self.uid.push_str(prefix);
            match driver {
                Driver::Systemd => {
                    self.uid
                        .extend(uid.chars().map(|c| if c == '-' { '_' } else { c }));
                    self.uid.push_str(".slice");
                }
                Driver::Cgroupfs => self.uid.push_str(uid),
            }
            self.path.clear();
            self.path.push(kubepods);
            if let Some(q) = qos {
                self.path.push(q);
            }
            self.path.push(&self.uid);
            match self.read_pod_file(scan, uid) {
                PodRead::Done => {
                    self.locations.insert(uid.to_string(), self.path.clone());
                    return true;
                }
                PodRead::NotDelegated => return false,
                PodRead::Gone => {}
            }
        }
        // No cgroup yet: the kubelet has not started the pod. It holds nothing.
        true
    }

    /// Read `misc.current` in the pod directory `self.path` (left pointing at the directory).
    fn read_pod_file(&mut self, scan: &mut PodScan, uid: &str) -> PodRead {
        self.path.push("misc.current");
        let result = match read_text(&self.path, &mut self.buf) {
            Ok(text) => {
                scan.pods_read += 1;
                match parse_counts(&self.path, text) {
                    Ok(c) => {
                        if !c.is_zero() {
                            scan.usage.insert(uid.to_string(), c);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "pod cgroup misc.current is malformed; treating the pod as holding no key");
                        scan.problem(e.to_string());
                    }
                }
                PodRead::Done
            }
            Err(e) if e.kind() == ErrorKind::NotFound => {
                self.path.pop();
                let read = if self.path.is_dir() {
                    scan.not_delegated(format!(
                        "pod cgroup {} has no misc.current",
                        self.path.display()
                    ));
                    PodRead::NotDelegated
                } else {
                    PodRead::Gone
                };
                self.path.push("misc.current");
                read
            }
            Err(source) => {
                scan.pods_read += 1;
                let e = Error::PodCgroupRead {
                    path: self.path.clone(),
                    source,
                };
                tracing::warn!(error = %e, "cannot read a pod cgroup; treating the pod as holding no key");
                scan.problem(e.to_string());
                PodRead::Done
            }
        };
        self.path.pop();
        result
    }

    /// Walk mode: read one pod cgroup found by listing. Returns false when it showed the controller is
    /// not delegated (stop).
    fn pod(
        &mut self,
        scan: &mut PodScan,
        parent: &Path,
        dir_name: &str,
        raw_uid: &str,
        systemd: bool,
        interest: Interest<'_>,
    ) -> bool {
        if !normalize_uid(raw_uid, systemd, &mut self.uid) {
            tracing::debug!(cgroup = %parent.join(dir_name).display(), "pod cgroup name carries no valid UID; skipped (its usage counts as external)");
            scan.skip(dir_name);
            return true;
        }
        if !interest.wants(&self.uid) {
            return true;
        }
        self.path.clear();
        self.path.push(parent);
        self.path.push(dir_name);
        self.path.push("misc.current");
        scan.pods_read += 1;
        match read_text(&self.path, &mut self.buf) {
            Ok(text) => match parse_counts(&self.path, text) {
                Ok(c) => {
                    if !c.is_zero() {
                        scan.usage.insert(self.uid.clone(), c);
                    }
                    true
                }
                Err(e) => {
                    tracing::warn!(error = %e, "pod cgroup misc.current is malformed; treating the pod as holding no key");
                    scan.problem(e.to_string());
                    true
                }
            },
            Err(e) if e.kind() == ErrorKind::NotFound => {
                self.path.pop();
                if self.path.is_dir() {
                    scan.not_delegated(format!(
                        "pod cgroup {} has no misc.current",
                        self.path.display()
                    ));
                    false
                } else {
                    // The pod went away between listing and reading.
                    true
                }
            }
            Err(source) => {
                let e = Error::PodCgroupRead {
                    path: self.path.clone(),
                    source,
                };
                tracing::warn!(error = %e, "cannot read a pod cgroup; treating the pod as holding no key");
                scan.problem(e.to_string());
                true
            }
        }
    }

    fn set_path(&mut self, dir: &Path, file: Option<&str>) {
        self.path.clear();
        self.path.push(dir);
        if let Some(f) = file {
            self.path.push(f);
        }
    }

    /// True when `dir/file` exists and does not list `misc` (a missing file says nothing).
    fn file_lacks_misc(&mut self, dir: &Path, file: &str) -> bool {
        self.set_path(dir, Some(file));
        read_text(&self.path, &mut self.buf)
            .is_ok_and(|text| !text.split_ascii_whitespace().any(|c| c == "misc"))
    }

    /// Usage of an intermediate level (kubepods or a QoS class), or why its children get no misc
    /// files: its `misc.current` is missing or its `cgroup.subtree_control` lacks `misc`.
    fn level(&mut self, dir: &Path) -> std::result::Result<LevelUsage, String> {
        self.set_path(dir, Some("misc.current"));
        let usage = match read_text(&self.path, &mut self.buf) {
            Ok(text) => match parse_counts(&self.path, text) {
                Ok(c) if c.is_zero() => LevelUsage::Zero,
                Ok(_) => LevelUsage::Held,
                Err(e) => {
                    tracing::debug!(error = %e, "intermediate misc.current is malformed; reading below it anyway");
                    LevelUsage::Unknown
                }
            },
            Err(e) if e.kind() == ErrorKind::NotFound => {
                return Err(format!(
                    "{}/misc.current does not exist: the misc controller is not enabled there",
                    dir.display()
                ));
            }
            Err(e) => {
                tracing::debug!(dir = %dir.display(), error = %e, "intermediate misc.current unreadable; reading below it anyway");
                LevelUsage::Unknown
            }
        };
        if self.file_lacks_misc(dir, "cgroup.subtree_control") {
            return Err(format!(
                "{}/cgroup.subtree_control does not enable the misc controller for the cgroups below it",
                dir.display()
            ));
        }
        Ok(usage)
    }
}

/// Where a pod's cgroup can be, by QoS class: (QoS directory under kubepods, name prefix).
const SYSTEMD_PLACES: [(Option<&str>, &str); 3] = [
    (None, "kubepods-pod"),
    (Some("kubepods-burstable.slice"), "kubepods-burstable-pod"),
    (Some("kubepods-besteffort.slice"), "kubepods-besteffort-pod"),
];
const CGROUPFS_PLACES: [(Option<&str>, &str); 3] = [
    (None, "pod"),
    (Some("burstable"), "pod"),
    (Some("besteffort"), "pod"),
];

enum PodRead {
    Done,
    NotDelegated,
    Gone,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LevelUsage {
    Zero,
    Held,
    Unknown,
}

/// Largest misc/cgroup control file read (real ones are a few lines).
const MAX_FILE_BYTES: usize = 64 * 1024;

/// Read a small file into `buf` and return it as text. A plain read loop: `File::read_to_string` would
/// first stat and seek the file to size its buffer (two extra syscalls per file, per pod, per poll).
fn read_text<'b>(path: &Path, buf: &'b mut Vec<u8>) -> std::io::Result<&'b str> {
    buf.clear();
    let mut file = File::open(path)?;
    let mut chunk = [0u8; 512];
    loop {
        match file.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                if buf.len() + n > MAX_FILE_BYTES {
                    return Err(std::io::Error::new(
                        ErrorKind::InvalidData,
                        format!("larger than {MAX_FILE_BYTES} bytes: not a misc cgroup file"),
                    ));
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    std::str::from_utf8(buf).map_err(|e| std::io::Error::new(ErrorKind::InvalidData, e))
}

fn list_dirs(dir: &Path) -> Result<Vec<String>> {
    let err = |source| Error::CgroupList {
        path: dir.to_path_buf(),
        source,
    };
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(err)? {
        let entry = match entry {
            Ok(e) => e,
            // An entry vanishing mid-listing is normal for cgroups.
            Err(e) if e.kind() == ErrorKind::NotFound => continue,
            Err(e) => return Err(err(e)),
        };
        if !entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            continue;
        }
        if let Ok(name) = entry.file_name().into_string() {
            out.push(name);
        }
    }
    Ok(out)
}

/// What a directory name under kubepods is.
#[derive(Debug, PartialEq, Eq)]
enum CgroupName<'a> {
    /// A QoS-class parent (`burstable`, `besteffort`, or their systemd slices).
    Qos,
    /// A pod cgroup; `uid` is the raw part of the name (not validated yet).
    Pod { uid: &'a str, systemd: bool },
    /// Anything else (control files are not directories; this is e.g. a container cgroup).
    Other,
}

fn classify(name: &str) -> CgroupName<'_> {
    match name {
        "burstable" | "besteffort" | "kubepods-burstable.slice" | "kubepods-besteffort.slice" => {
            return CgroupName::Qos;
        }
        _ => {}
    }
    if let Some(rest) = name.strip_suffix(".slice") {
        for prefix in [
            "kubepods-pod",
            "kubepods-burstable-pod",
            "kubepods-besteffort-pod",
        ] {
            if let Some(uid) = rest.strip_prefix(prefix) {
                return CgroupName::Pod { uid, systemd: true };
            }
        }
        return CgroupName::Other;
    }
    if let Some(uid) = name.strip_prefix("pod") {
        return CgroupName::Pod {
            uid,
            systemd: false,
        };
    }
    CgroupName::Other
}

/// Turn the UID part of a pod cgroup name into the pod's UID in `out`. systemd names use `_` where the
/// UID has `-`. Valid UIDs are RFC 4122 form (`8-4-4-4-12` hex) or, for static pods, 32 hex digits.
fn normalize_uid(raw: &str, systemd: bool, out: &mut String) -> bool {
    out.clear();
    for c in raw.chars() {
        let c = match c {
            '_' if systemd => '-',
            '-' if systemd => return false,
            '_' => return false,
            c => c.to_ascii_lowercase(),
        };
        out.push(c);
    }
    is_valid_uid(out)
}

fn is_valid_uid(uid: &str) -> bool {
    let b = uid.as_bytes();
    match b.len() {
        32 => b.iter().all(u8::is_ascii_hexdigit),
        36 => b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_hexdigit(),
        }),
        _ => false,
    }
}

/// Parse a `misc.current` file into TEE kind counts without allocating. Malformed content is reported
/// with the domain crate's parser, so errors read the same everywhere.
fn parse_counts(path: &Path, text: &str) -> Result<KindCounts> {
    match parse_counts_fast(text) {
        Some(c) => Ok(c),
        None => {
            let values = teeguard_shared::misc::parse_values(path, text)?;
            Ok(KindCounts::from_misc(&values))
        }
    }
}

fn parse_counts_fast(text: &str) -> Option<KindCounts> {
    let mut out = KindCounts::ZERO;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let mut fields = line.split_ascii_whitespace();
        let (Some(name), Some(value), None) = (fields.next(), fields.next(), fields.next()) else {
            return None;
        };
        let value: u64 = value.parse().ok()?;
        if let Some(kind) = TeeKind::from_kernel_name(name) {
            out.set(kind, value);
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use pretty_assertions::assert_eq;

    const UID: &str = "0e5d9f8c-3b1a-4c2d-9e8f-123456789abc";
    const UID_: &str = "0e5d9f8c_3b1a_4c2d_9e8f_123456789abc";

    fn write(root: &Path, rel: &str, content: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(p, content).expect("write");
    }

    fn scanned(state: HostState) -> HostScan {
        match state {
            HostState::Scanned(s) => s,
            other => panic!("expected a scan, got {other:?}"),
        }
    }

    #[test]
    fn names() {
        assert_eq!(classify("kubepods-burstable.slice"), CgroupName::Qos);
        assert_eq!(classify("besteffort"), CgroupName::Qos);
        assert_eq!(
            classify(&format!("kubepods-burstable-pod{UID_}.slice")),
            CgroupName::Pod {
                uid: UID_,
                systemd: true
            }
        );
        assert_eq!(
            classify(&format!("kubepods-pod{UID_}.slice")),
            CgroupName::Pod {
                uid: UID_,
                systemd: true
            }
        );
        assert_eq!(
            classify(&format!("pod{UID}")),
            CgroupName::Pod {
                uid: UID,
                systemd: false
            }
        );
        assert_eq!(classify("cri-containerd-abc.scope"), CgroupName::Other);
        assert_eq!(classify("system.slice"), CgroupName::Other);

        let mut out = String::new();
        assert!(normalize_uid(UID_, true, &mut out));
        assert_eq!(out, UID);
        assert!(normalize_uid(UID, false, &mut out));
        assert_eq!(out, UID);
        assert!(normalize_uid(
            "0E5D9F8C-3B1A-4C2D-9E8F-123456789ABC",
            false,
            &mut out
        ));
        assert_eq!(out, UID);
        assert!(normalize_uid(
            "d41d8cd98f00b204e9800998ecf8427e",
            false,
            &mut out
        ));
        for bad in [
            "",
            "garbage",
            "0e5d9f8c-3b1a",
            UID_,
            "zz5d9f8c-3b1a-4c2d-9e8f-123456789abc",
        ] {
            assert!(!normalize_uid(bad, false, &mut out), "{bad}");
        }
        assert!(
            !normalize_uid(UID, true, &mut out),
            "dash in a systemd name"
        );
    }

    #[test]
    fn fast_parser_agrees_with_the_domain_parser() {
        let p = Path::new("misc.current");
        for text in [
            "",
            "tdx 3\n",
            "tdx 3",
            "  tdx\t3  \n\nsev 1\nsev_es 2\nsgx_epc 99\n",
            "tdx 1\ntdx 2\n",
            "tdx 18446744073709551615\n",
            "tdx\n",
            "tdx 1 2\n",
            "tdx -1\n",
            "tdx x\n",
            "tdx 18446744073709551616\n",
            "\u{0}\u{1}\n",
        ] {
            let fast = parse_counts_fast(text);
            let slow = teeguard_shared::misc::parse_values(p, text)
                .ok()
                .map(|v| KindCounts::from_misc(&v));
            assert_eq!(fast, slow, "{text:?}");
        }
        let err = parse_counts(p, "tdx many\n").expect_err("garbage");
        assert!(err.to_string().contains("misc.current:1"), "{err}");
    }

    #[test]
    fn systemd_v2_per_pod() {
        let d = tempfile::tempdir().expect("tempdir");
        let r = d.path();
        write(r, "misc.capacity", "tdx 16\n");
        write(r, "misc.current", "tdx 3\n");
        write(r, "kubepods.slice/cgroup.controllers", "cpu memory misc\n");
        write(r, "kubepods.slice/misc.current", "tdx 2\n");
        write(
            r,
            "kubepods.slice/kubepods-burstable.slice/misc.current",
            "tdx 1\n",
        );
        write(
            r,
            &format!(
                "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/misc.current"
            ),
            "tdx 1\n",
        );
        write(
            r,
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podnot_a_uid.slice/misc.current",
            "tdx 0\n",
        );
        write(
            r,
            "kubepods.slice/kubepods-besteffort.slice/misc.current",
            "tdx 0\n",
        );
        let g = "11111111-2222-3333-4444-555555555555";
        write(
            r,
            &format!(
                "kubepods.slice/kubepods-pod{}.slice/misc.current",
                g.replace('-', "_")
            ),
            "tdx 1\n",
        );
        write(r, "system.slice/misc.events", "tdx.max 0\n");

        let mut s = Scanner::new(r);
        let scan = scanned(s.scan(Interest::All).expect("scan"));
        assert_eq!(scan.layout, CgroupLayout::V2);
        assert_eq!(scan.capacity, KindCounts::from_pairs([(TeeKind::Tdx, 16)]));
        assert_eq!(
            scan.kernel_used,
            KindCounts::from_pairs([(TeeKind::Tdx, 3)])
        );
        let pods = scan.pods.expect("pods");
        assert_eq!(
            pods.accounting,
            Accounting::PerPod,
            "{}",
            pods.accounting_reason
        );
        assert_eq!(pods.driver, Some(Driver::Systemd));
        let one = KindCounts::from_pairs([(TeeKind::Tdx, 1)]);
        assert_eq!(
            pods.usage,
            HashMap::from([(UID.to_string(), one), (g.to_string(), one)])
        );
        assert_eq!(
            pods.skipped,
            vec!["kubepods-burstable-podnot_a_uid.slice".to_string()]
        );

        // Only pods of interest are read.
        let interest = HashSet::from([g.to_string()]);
        let pods = scanned(s.scan(Interest::Only(&interest)).expect("scan"))
            .pods
            .expect("pods");
        assert_eq!(pods.usage, HashMap::from([(g.to_string(), one)]));
        assert_eq!(pods.pods_read, 1);

        // Nothing of interest: no pod is read at all.
        let none = HashSet::new();
        let pods = scanned(s.scan(Interest::Only(&none)).expect("scan"))
            .pods
            .expect("pods");
        assert_eq!(pods.pods_read, 0);
        assert_eq!(pods.accounting, Accounting::PerPod);

        assert_eq!(s.events_dirs(), vec![r.join("system.slice")]);
    }

    #[test]
    fn cgroupfs_v1_per_pod_and_pruning() {
        let d = tempfile::tempdir().expect("tempdir");
        let r = d.path();
        write(r, "misc/misc.capacity", "sev 99\nsev_es 410\n");
        write(r, "misc/misc.current", "sev 1\nsev_es 2\n");
        write(r, "misc/kubepods/misc.current", "sev_es 1\n");
        write(r, "misc/kubepods/besteffort/misc.current", "sev_es 0\n");
        write(
            r,
            &format!("misc/kubepods/besteffort/pod{UID}/misc.current"),
            "garbage that must not be read\n",
        );
        write(r, "misc/kubepods/burstable/misc.current", "sev_es 1\n");
        let b = "22222222-2222-3333-4444-555555555555";
        write(
            r,
            &format!("misc/kubepods/burstable/pod{b}/misc.current"),
            "sev_es 1\n",
        );
        let mut s = Scanner::new(r);
        let scan = scanned(s.scan(Interest::All).expect("scan"));
        assert_eq!(scan.layout, CgroupLayout::V1);
        let pods = scan.pods.expect("pods");
        assert_eq!(pods.driver, Some(Driver::Cgroupfs));
        assert_eq!(pods.problem_count, 0, "{:?}", pods.problems);
        assert_eq!(
            pods.usage,
            HashMap::from([(b.to_string(), KindCounts::from_pairs([(TeeKind::SevEs, 1)]))])
        );
        assert_eq!(pods.pods_read, 1, "besteffort holds nothing and is skipped");
    }

    #[test]
    fn not_delegated_variants() {
        // No misc files under kubepods.
        let d = tempfile::tempdir().expect("tempdir");
        let r = d.path();
        write(r, "misc.capacity", "tdx 16\n");
        write(r, "misc.current", "tdx 2\n");
        write(r, "kubepods.slice/cgroup.controllers", "cpu memory\n");
        let mut s = Scanner::new(r);
        let pods = scanned(s.scan(Interest::All).expect("scan"))
            .pods
            .expect("pods");
        assert_eq!(pods.accounting, Accounting::RunningPods);
        assert!(
            pods.accounting_reason.contains("cgroup.controllers"),
            "{}",
            pods.accounting_reason
        );

        // Controller listed but subtree_control not enabling it further down.
        std::fs::write(r.join("kubepods.slice/cgroup.controllers"), "cpu misc\n").expect("write");
        write(r, "kubepods.slice/misc.current", "tdx 1\n");
        std::fs::create_dir_all(r.join("kubepods.slice/kubepods-burstable.slice")).expect("mkdir");
        let pods = scanned(s.scan(Interest::All).expect("scan"))
            .pods
            .expect("pods");
        assert_eq!(pods.accounting, Accounting::RunningPods);
        assert!(
            pods.accounting_reason
                .contains("kubepods-burstable.slice/misc.current"),
            "{}",
            pods.accounting_reason
        );

        // A pod cgroup without misc.current.
        write(
            r,
            "kubepods.slice/kubepods-burstable.slice/misc.current",
            "tdx 1\n",
        );
        std::fs::create_dir_all(r.join(format!(
            "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
        )))
        .expect("mkdir");
        let pods = scanned(s.scan(Interest::All).expect("scan"))
            .pods
            .expect("pods");
        assert_eq!(pods.accounting, Accounting::RunningPods);
        assert!(
            pods.accounting_reason.contains("has no misc.current"),
            "{}",
            pods.accounting_reason
        );

        // No kubepods at all.
        let d2 = tempfile::tempdir().expect("tempdir");
        write(d2.path(), "misc.capacity", "tdx 16\n");
        let pods = scanned(Scanner::new(d2.path()).scan(Interest::All).expect("scan"))
            .pods
            .expect("pods");
        assert_eq!(pods.accounting, Accounting::RunningPods);
    }

    #[test]
    fn bad_files() {
        let d = tempfile::tempdir().expect("tempdir");
        let r = d.path();
        let mut s = Scanner::new(r);

        // No controller at all: not an error.
        match s
            .scan(Interest::All)
            .expect("no controller is not an error")
        {
            HostState::NoController { message } => {
                assert!(message.contains("no misc cgroup controller"), "{message}")
            }
            other => panic!("{other:?}"),
        }

        // Empty capacity: no kinds, nothing else read.
        write(r, "misc.capacity", "");
        write(r, "misc.current", "garbage garbage garbage\n");
        let scan = scanned(s.scan(Interest::All).expect("empty capacity"));
        assert!(scan.capacity.is_zero() && scan.pods.is_none());

        // Garbage capacity and truncated current are errors naming the file.
        write(r, "misc.capacity", "tdx sixteen\n");
        let e = s.scan(Interest::All).expect_err("garbage capacity");
        assert!(e.to_string().contains("misc.capacity:1"), "{e}");
        write(r, "misc.capacity", "tdx 16\n");
        write(r, "misc.current", "tdx\n");
        let e = s.scan(Interest::All).expect_err("truncated current");
        assert!(e.to_string().contains("misc.current:1"), "{e}");

        // An unreadable pod cgroup (misc.current is a directory) and a malformed one are problems.
        write(r, "misc.current", "tdx 2\n");
        write(r, "kubepods/misc.current", "tdx 2\n");
        std::fs::create_dir_all(r.join(format!("kubepods/pod{UID}/misc.current"))).expect("mkdir");
        let other = "33333333-2222-3333-4444-555555555555";
        write(r, &format!("kubepods/pod{other}/misc.current"), "tdx one\n");
        let pods = scanned(s.scan(Interest::All).expect("scan"))
            .pods
            .expect("pods");
        assert_eq!(pods.accounting, Accounting::PerPod);
        assert_eq!(pods.problem_count, 2, "{:?}", pods.problems);
        assert!(pods.usage.is_empty());
        assert!(
            pods.problems.iter().any(|p| p.contains(UID)),
            "{:?}",
            pods.problems
        );
    }

    #[test]
    fn old_kernel_without_root_current_sums_children() {
        let d = tempfile::tempdir().expect("tempdir");
        let r = d.path();
        write(r, "misc.capacity", "tdx 16\n");
        write(r, "kubepods/misc.current", "tdx 2\n");
        write(r, "machine.slice/misc.current", "tdx 3\n");
        let scan = scanned(Scanner::new(r).scan(Interest::All).expect("scan"));
        assert_eq!(
            scan.kernel_used,
            KindCounts::from_pairs([(TeeKind::Tdx, 5)])
        );
    }
}
