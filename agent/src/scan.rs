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
//!      (the place found first is remembered), without listing any directory, and then kept open: see
//!      "Open files" below;
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
//! The scan reuses its path and content buffers, reads files with positioned reads from offset 0 (no
//! seek; a read that does not fill the buffer ends the file, so a small file costs one `pread`), and in
//! agent mode allocates only for pods that hold keys.
//!
//! # Open files (agent mode)
//!
//! Opening a pod's `misc.current` walks a deep path (`kubepods.slice/kubepods-burstable.slice/
//! kubepods-burstable-pod<uid>.slice/misc.current`) and opening, reading to EOF and closing costs four
//! syscalls; with hundreds of pods requesting keys that dominated the poll. So the file of each pod of
//! interest is kept open between polls and re-read with `pread(fd, buf, 0)`: an `fstat` and one `pread`
//! per pod. The kernel's cgroup files are kernfs `seq_file`s, regenerated on every read at offset 0 (the
//! way `top` re-reads `/proc` files), so an open file always shows current usage; the kernel updates them
//! in place, never by replacing the file.
//!
//! A kept file goes stale in two ways, both sending the pod back to the open-by-path logic (which
//! reports a vanished, undelegated or unreadable cgroup exactly as a first read does):
//! - any read error: on the kernel, reading an open file of a removed cgroup fails with `ENODEV`, and a
//!   cgroup recreated at the same path is a new file that the path finds (checked on Linux 6.18, cgroup
//!   v2: after `rmdir`, `fstat` of the open file still says one link, and `pread` fails with `ENODEV`,
//!   also once a cgroup of the same name exists again);
//! - the file has no link left (`nlink == 0`, from the `fstat`): it was deleted or replaced by a rename,
//!   which is how regular files behave (the simulated host in `teeguard-tests` replaces files by rename
//!   and removes directories with their files; an open descriptor would keep reading the old content).
//!
//! Kept files are bounded by the interest set: a pod leaving it is forgotten and its file closed at the
//! next scan (and by `MAX_KEPT_FILES`, beyond which pods are opened by path each time). Permissions are checked when a file is opened only (plain Unix semantics): a file made
//! unreadable by `chmod` after it was opened stays readable through the open descriptor, whereas one
//! replaced (e.g. by a directory) is opened again and reported. Walk mode opens files by path every time.
//!
//! # Unchanged pods (agent mode)
//!
//! A pod's usage changes only when a VM in it starts or stops, and the kubepods `misc.current` (read
//! anyway, to prune) is the sum of every pod below it. So a scan reads only the pods of interest that
//! have no reading to reuse (new, not found yet, or whose last read failed) and takes the last
//! readings of the others, but keeps them only when the kubepods total equals exactly those readings
//! plus what the last full read found held outside the pods of interest (pods that request no key,
//! such as exempt VMs). Any difference (a VM started or stopped, a pod left, another cgroup charged or
//! released a key) reads every pod of interest again, as does every [`FULL_READ_EVERY`]th scan, a
//! kubepods file that cannot be read, and the first scan. On a steady host a poll reads no pod file.
//!
//! The totals cannot tell changes that cancel out within one poll interval: one cgroup charging a
//! key of the same kind as another releases one. Kernel usage is still read at every scan; what lags,
//! for at most [`FULL_READ_EVERY`] scans, is the attribution, and with it `pending`: a pod that
//! charged still counts as pending (`free` one lower: conservative), and a pod that released while it
//! lives on (its VM stopped before the pod ended) is not counted as pending (`free` one higher: the
//! key is free in the kernel, but the conservative rule would keep it for the pod until the pod ends).
//! When both happen among the pods of interest the two cancel and `free` is what a full read gives.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::ErrorKind;
use std::os::unix::fs::{FileExt as _, MetadataExt as _};
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

/// Agent mode: every pod of interest is read at least every this many scans (10 s at the default 1 s
/// poll interval), whatever the kubepods total says (see "Unchanged pods").
pub const FULL_READ_EVERY: u32 = 10;

/// At most this many pod files are kept open (agent mode), far above any node's pod count (the kubelet's
/// `maxPods` defaults to 110), so a strange configuration cannot exhaust the process's descriptors
/// (the soft limit is often 1024); pods beyond it are opened by path at every scan.
const MAX_KEPT_FILES: usize = 512;

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
    fn new(accounting: Accounting, reason: String) -> Self {
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
    /// Agent mode: each pod of interest whose cgroup was found, by UID. Pruned to the interest set at
    /// every scan, so it holds at most one entry (and one open file) per pod of interest.
    known: HashMap<String, KnownPod>,
    /// Agent mode: the kubepods usage held outside the pods of interest at the last full read, when it
    /// may be used to skip unchanged pods (see "Unchanged pods").
    outside: Option<KindCounts>,
    /// Agent mode: scans since the last full read of the pods of interest.
    scans_since_full: u32,
    /// Agent mode: a full read is due after this many scans.
    full_read_every: u32,
}

/// Where a pod of interest's cgroup was found, and its `misc.current` kept open (agent mode).
#[derive(Debug)]
struct KnownPod {
    /// The pod's cgroup directory: where `misc.current` is opened again when the kept file is stale.
    dir: PathBuf,
    /// `misc.current`, open since the last successful read by path; re-read at offset 0 every poll.
    /// `None` after a failed read (the next poll opens the file by path again). Dropping it closes it.
    file: Option<File>,
    /// What the pod held at its last reading (zero after a failed one).
    last: KindCounts,
}

impl Scanner {
    /// A scanner for the host cgroup tree mounted at `cgroup_root` (e.g. `/host/sys/fs/cgroup`).
    pub fn new(cgroup_root: impl Into<PathBuf>) -> Self {
        Scanner {
            root: cgroup_root.into(),
            path: PathBuf::with_capacity(256),
            buf: Vec::with_capacity(512),
            uid: String::with_capacity(40),
            known: HashMap::new(),
            outside: None,
            scans_since_full: 0,
            full_read_every: FULL_READ_EVERY,
        }
    }

    /// Read every pod of interest at least every `scans` scans (default [`FULL_READ_EVERY`]; `1` reads
    /// every pod at every scan, as walk mode does). See "Unchanged pods" in the module doc.
    #[must_use]
    pub fn full_read_every(mut self, scans: u32) -> Self {
        self.full_read_every = scans.max(1);
        self
    }

    /// How many pod `misc.current` files are kept open between scans (agent mode; at most one per pod
    /// of interest).
    pub fn open_pod_files(&self) -> usize {
        self.known.values().filter(|k| k.file.is_some()).count()
    }

    /// The cgroup root this scanner reads.
    pub fn cgroup_root(&self) -> &Path {
        &self.root
    }

    /// Read capacity and usage. `Err` means a file that must be readable (the root `misc.capacity` or
    /// `misc.current`) could not be read or parsed; pod-level trouble is reported inside the result.
    pub fn scan(&mut self, interest: Interest<'_>) -> Result<HostState> {
        if let Interest::Only(set) = interest {
            // Forget pods that no longer request keys (or left the node): this closes their files,
            // also when this scan ends before the pods are read.
            self.known.retain(|uid, _| set.contains(uid));
            self.scans_since_full = self.scans_since_full.saturating_add(1);
        }
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
        if top.is_zero() || !matches!(interest, Interest::All) {
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
            match (interest, top.is_zero()) {
                (Interest::Only(set), false) => {
                    self.read_interest(&mut scan, &kubepods, driver, set, top);
                }
                // Nothing is held below kubepods: no pod was read, so no reading to reuse later.
                _ => self.outside = None,
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
                        Ok(u) if u.is_zero() => continue,
                        Ok(_) => {}
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

    /// Agent mode: read the pods of interest (see "Unchanged pods" in the module doc): first only
    /// those without a reading to reuse, taking the others' last readings, and all of them when the
    /// kubepods total (`top`) does not add up or a full read is due.
    fn read_interest(
        &mut self,
        scan: &mut PodScan,
        kubepods: &Path,
        driver: Driver,
        set: &HashSet<String>,
        top: LevelUsage,
    ) {
        let total = match top {
            LevelUsage::Read(c) => Some(c),
            LevelUsage::Unknown => None,
        };
        let due = self.scans_since_full >= self.full_read_every;
        if let (Some(total), Some(outside), false) = (total, self.outside, due) {
            let before = scan.clone();
            let mut predicted = outside;
            let mut unchanged = 0;
            for uid in set {
                if let Some(k) = self.known.get(uid.as_str())
                    && k.file.is_some()
                {
                    predicted.add(&k.last);
                    if !k.last.is_zero() {
                        scan.usage.insert(uid.clone(), k.last);
                    }
                    unchanged += 1;
                    continue;
                }
                if !self.read_and_remember(scan, kubepods, driver, uid) {
                    return;
                }
                if let Some(c) = scan.usage.get(uid.as_str()) {
                    predicted.add(c);
                }
            }
            if predicted == total {
                scan.pods_unchanged = unchanged;
                return;
            }
            tracing::debug!(
                kubepods = %total,
                predicted = %predicted,
                "kubepods usage differs from the pods' last readings; reading every pod"
            );
            *scan = before;
        }
        for uid in set {
            if !self.read_and_remember(scan, kubepods, driver, uid) {
                return;
            }
        }
        self.scans_since_full = 0;
        // What the kubepods total holds beyond the pods of interest (pods that request no key, e.g.
        // exempt VMs). Readings taken at different instants can exceed the total: then nothing is
        // reused until the next full read.
        self.outside = total.and_then(|t| {
            let mut held = KindCounts::ZERO;
            for c in scan.usage.values() {
                held.add(c);
            }
            t.checked_sub(&held)
        });
    }

    /// [`Scanner::direct_pod`], then remember what the pod held for the next scan. False: stop (the
    /// controller is not delegated), and reuse nothing until a full read.
    fn read_and_remember(
        &mut self,
        scan: &mut PodScan,
        kubepods: &Path,
        driver: Driver,
        uid: &str,
    ) -> bool {
        if !self.direct_pod(scan, kubepods, driver, uid) {
            self.outside = None;
            return false;
        }
        if let Some(k) = self.known.get_mut(uid) {
            k.last = scan.usage.get(uid).copied().unwrap_or(KindCounts::ZERO);
        }
        true
    }

    /// Agent mode: read a pod's cgroup through its kept-open `misc.current`, else by constructing its
    /// path (no directory listing). The QoS class is not known from the UID, so the three possible places
    /// are tried once and the hit remembered, with the file kept open. Returns false when the pod showed
    /// the controller is not delegated (stop).
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
        // Files are kept only while the entries (a superset) stay within the bound.
        let room = self.known.len() <= MAX_KEPT_FILES;
        if let Some(known) = self.known.get_mut(uid) {
            if let Some(file) = &known.file {
                match reread(file, &mut self.buf) {
                    Ok(Some(text)) => {
                        self.path.clear();
                        self.path.push(&known.dir);
                        self.path.push("misc.current");
                        record_pod(scan, uid, &self.path, text);
                        return true;
                    }
                    Ok(None) => {
                        tracing::debug!(uid, dir = %known.dir.display(), "kept-open misc.current was deleted or replaced; opening it again");
                    }
                    Err(e) => {
                        // ENODEV on the kernel: the cgroup was removed (and maybe recreated).
                        tracing::debug!(uid, dir = %known.dir.display(), error = %e, "kept-open misc.current unreadable; opening it again");
                    }
                }
                // Close it; the path decides what happened.
                known.file = None;
            }
            self.path.clear();
            self.path.push(&known.dir);
            match read_pod_file(scan, &mut self.path, &mut self.buf, uid) {
                PodRead::Done(file) => {
                    known.file = file.filter(|_| room);
                    return true;
                }
                PodRead::NotDelegated => return false,
                PodRead::Gone => {
                    self.known.remove(uid);
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
            match read_pod_file(scan, &mut self.path, &mut self.buf, uid) {
                PodRead::Done(file) => {
                    let room = self.known.len() < MAX_KEPT_FILES;
                    self.known.insert(
                        uid.to_string(),
                        KnownPod {
                            dir: self.path.clone(),
                            file: file.filter(|_| room),
                            last: KindCounts::ZERO,
                        },
                    );
                    return true;
                }
                PodRead::NotDelegated => return false,
                PodRead::Gone => {}
            }
        }
        // No cgroup yet: the kubelet has not started the pod. It holds nothing.
        true
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
                Ok(c) => LevelUsage::Read(c),
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

/// Agent mode: open and read `misc.current` in the pod directory `path` (left pointing at the
/// directory) and record what it holds. `Done` carries the file when it was read, to keep open.
fn read_pod_file(scan: &mut PodScan, path: &mut PathBuf, buf: &mut Vec<u8>, uid: &str) -> PodRead {
    path.push("misc.current");
    let result = match File::open(&*path) {
        Ok(file) => match read_from_start(&file, buf) {
            Ok(text) => {
                record_pod(scan, uid, path, text);
                PodRead::Done(Some(file))
            }
            Err(source) => {
                pod_unreadable(scan, path, source);
                PodRead::Done(None)
            }
        },
        Err(e) if e.kind() == ErrorKind::NotFound => {
            path.pop();
            let read = if path.is_dir() {
                scan.not_delegated(format!("pod cgroup {} has no misc.current", path.display()));
                PodRead::NotDelegated
            } else {
                PodRead::Gone
            };
            path.push("misc.current");
            read
        }
        Err(source) => {
            pod_unreadable(scan, path, source);
            PodRead::Done(None)
        }
    };
    path.pop();
    result
}

/// Record the content of a pod's `misc.current` (`path`, named in messages).
fn record_pod(scan: &mut PodScan, uid: &str, path: &Path, text: &str) {
    scan.pods_read += 1;
    match parse_counts(path, text) {
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
}

/// Record a pod's `misc.current` (`path`) that could not be read.
fn pod_unreadable(scan: &mut PodScan, path: &Path, source: std::io::Error) {
    scan.pods_read += 1;
    let e = Error::PodCgroupRead {
        path: path.to_path_buf(),
        source,
    };
    tracing::warn!(error = %e, "cannot read a pod cgroup; treating the pod as holding no key");
    scan.problem(e.to_string());
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

/// The three places a pod's cgroup can be (guaranteed, burstable, besteffort), for a valid UID.
pub fn pod_cgroup_candidates(kubepods: &Path, driver: Driver, uid: &str) -> Vec<PathBuf> {
    if !is_valid_uid(uid) {
        return Vec::new();
    }
    let places = match driver {
        Driver::Systemd => &SYSTEMD_PLACES,
        Driver::Cgroupfs => &CGROUPFS_PLACES,
    };
    places
        .iter()
        .map(|(qos, prefix)| {
            let mut dir = kubepods.to_path_buf();
            if let Some(q) = qos {
                dir.push(q);
            }
            dir.push(match driver {
                Driver::Systemd => format!("{prefix}{}.slice", uid.replace('-', "_")),
                Driver::Cgroupfs => format!("{prefix}{uid}"),
            });
            dir
        })
        .collect()
}

/// The QoS-class directories under kubepods (their pod cgroups are one level down).
pub fn qos_dirs(kubepods: &Path, driver: Driver) -> [PathBuf; 2] {
    match driver {
        Driver::Systemd => [
            kubepods.join("kubepods-burstable.slice"),
            kubepods.join("kubepods-besteffort.slice"),
        ],
        Driver::Cgroupfs => [kubepods.join("burstable"), kubepods.join("besteffort")],
    }
}

/// The pod UID in a pod cgroup's directory name (`kubepods-burstable-pod<uid_>.slice`, `pod<uid>`),
/// when it is one.
pub fn pod_uid_of_dir(name: &str) -> Option<String> {
    match classify(name) {
        CgroupName::Pod { uid, systemd } => {
            let mut out = String::new();
            normalize_uid(uid, systemd, &mut out).then_some(out)
        }
        _ => None,
    }
}

/// What reading a pod's `misc.current` by path found.
enum PodRead {
    /// Read (and recorded) or reported as a problem; the file, open, when it could be read.
    Done(Option<File>),
    /// The pod cgroup exists without `misc.current`: the controller is not delegated to pods.
    NotDelegated,
    /// No such pod cgroup (there).
    Gone,
}

/// What an intermediate level's (kubepods, a QoS class) `misc.current` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LevelUsage {
    /// Read: the usage of the whole subtree.
    Read(KindCounts),
    /// Unreadable or malformed: the pods below are read anyway.
    Unknown,
}

impl LevelUsage {
    /// Read, and no key is held anywhere below.
    fn is_zero(self) -> bool {
        self == LevelUsage::Read(KindCounts::ZERO)
    }
}

/// Largest misc/cgroup control file read (real ones are a few lines).
const MAX_FILE_BYTES: usize = 64 * 1024;

/// Bytes asked for per read; any real misc or cgroup control file fits in one.
const READ_CHUNK: usize = 512;

/// Open a small file, read it into `buf` and return it as text.
fn read_text<'b>(path: &Path, buf: &'b mut Vec<u8>) -> std::io::Result<&'b str> {
    read_from_start(&File::open(path)?, buf)
}

/// Re-read a file kept open (see "Open files" in the module doc). `Ok(None)`: the file has no link left
/// (deleted, or replaced by a rename), so its content is stale and it must be opened again by path.
/// The `fstat` is what catches that on regular files; on the kernel's cgroup files a removed cgroup
/// shows as a read error (`ENODEV`) instead.
fn reread<'b>(file: &File, buf: &'b mut Vec<u8>) -> std::io::Result<Option<&'b str>> {
    if file.metadata()?.nlink() == 0 {
        return Ok(None);
    }
    read_from_start(file, buf).map(Some)
}

/// Read a whole small file from offset 0 into `buf` with positioned reads (`pread`; the file position
/// is neither used nor moved, so the same open file can be read again the same way).
///
/// A read returning fewer bytes than asked ends the file, without the extra read that would return 0:
/// a kernfs `seq_file` (every cgroup file) renders the whole content at offset 0 and hands out all of
/// it that fits, and a regular file returns a short read only at its end. A full read is followed by
/// the next one at the offset reached, until a read returns 0 or falls short.
fn read_from_start<'b>(file: &File, buf: &'b mut Vec<u8>) -> std::io::Result<&'b str> {
    buf.clear();
    let mut chunk = [0u8; READ_CHUNK];
    loop {
        match file.read_at(&mut chunk, buf.len() as u64) {
            Ok(0) => break,
            Ok(n) => {
                if buf.len() + n > MAX_FILE_BYTES {
                    return Err(std::io::Error::new(
                        ErrorKind::InvalidData,
                        format!("larger than {MAX_FILE_BYTES} bytes: not a misc cgroup file"),
                    ));
                }
                buf.extend_from_slice(&chunk[..n]);
                if n < chunk.len() {
                    break;
                }
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

    // Kept-open files (agent mode).

    const A: &str = "aaaaaaaa-2222-3333-4444-555555555555";
    const B: &str = "bbbbbbbb-2222-3333-4444-555555555555";
    const C: &str = "cccccccc-2222-3333-4444-555555555555";

    /// A pod's `misc.current`, relative to the root (v2/systemd), in a QoS slice or not (guaranteed).
    fn pod_file(uid: &str, qos: Option<&str>) -> String {
        let uid_ = uid.replace('-', "_");
        match qos {
            Some(q) => format!(
                "kubepods.slice/kubepods-{q}.slice/kubepods-{q}-pod{uid_}.slice/misc.current"
            ),
            None => format!("kubepods.slice/kubepods-pod{uid_}.slice/misc.current"),
        }
    }

    /// A v2/systemd host where pods A (burstable), B (guaranteed) and C (besteffort) hold 1, 2 and 3
    /// TDX keys. Returns the three files.
    fn kept_open_host(r: &Path) -> [PathBuf; 3] {
        write(r, "misc.capacity", "tdx 16\n");
        write(r, "misc.current", "tdx 6\n");
        write(r, "kubepods.slice/cgroup.controllers", "cpu misc\n");
        write(r, "kubepods.slice/misc.current", "tdx 6\n");
        for q in ["burstable", "besteffort"] {
            write(
                r,
                &format!("kubepods.slice/kubepods-{q}.slice/misc.current"),
                "tdx 1\n",
            );
        }
        let files = [
            pod_file(A, Some("burstable")),
            pod_file(B, None),
            pod_file(C, Some("besteffort")),
        ];
        for (n, f) in files.iter().enumerate() {
            write(r, f, &format!("tdx {}\n", n + 1));
        }
        files.map(|f| r.join(f))
    }

    fn all_three() -> HashSet<String> {
        HashSet::from([A, B, C].map(String::from))
    }

    fn tdx(n: u64) -> KindCounts {
        KindCounts::from_pairs([(TeeKind::Tdx, n)])
    }

    /// Scan with `s` (keeping files open) and with a new scanner (opening every file), check both agree
    /// and return the pods.
    fn scan_both(s: &mut Scanner, interest: &HashSet<String>) -> PodScan {
        let kept = s.scan(Interest::Only(interest)).expect("scan");
        let fresh = Scanner::new(s.cgroup_root())
            .scan(Interest::Only(interest))
            .expect("fresh scan");
        assert_eq!(kept, fresh, "kept-open files and a fresh scan disagree");
        scanned(kept).pods.expect("pods")
    }

    /// Replace a file by writing a temporary file and renaming it over (as the simulated host does).
    fn replace(path: &Path, content: &str) {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, content).expect("write");
        std::fs::rename(&tmp, path).expect("rename");
    }

    fn ino(path: &Path) -> u64 {
        std::fs::metadata(path).expect("stat").ino()
    }

    #[test]
    fn kept_open_files_follow_changes_in_place_and_by_replacement() {
        let d = tempfile::tempdir().expect("tempdir");
        let r = d.path();
        let [a, b, c] = kept_open_host(r);
        let interest = all_three();
        let mut s = Scanner::new(r).full_read_every(1);
        assert_eq!(s.open_pod_files(), 0);
        for _ in 0..2 {
            let pods = scan_both(&mut s, &interest);
            assert_eq!(
                pods.usage,
                HashMap::from([
                    (A.to_string(), tdx(1)),
                    (B.to_string(), tdx(2)),
                    (C.to_string(), tdx(3)),
                ])
            );
            assert_eq!(pods.pods_read, 3);
            assert_eq!(s.open_pod_files(), 3);
        }

        // In place (how the kernel updates its files): same inode, new content, here longer than one
        // read chunk with the TDX line last, so the read continues past a full chunk.
        let before = ino(&a);
        let mut long = (0..150)
            .map(|i| format!("res_{i:03} 0\n"))
            .collect::<String>();
        long.push_str("tdx 4\n");
        assert!(long.len() > 2 * READ_CHUNK);
        std::fs::write(&a, &long).expect("write");
        assert_eq!(ino(&a), before, "written in place");
        // By replacement: the kept file is unlinked and still holds "tdx 2".
        let before = ino(&b);
        replace(&b, "tdx 5\n");
        assert_ne!(ino(&b), before, "replaced");
        // Emptied in place (the VMs stopped): holds nothing.
        std::fs::write(&c, "tdx 0\n").expect("write");

        let pods = scan_both(&mut s, &interest);
        assert_eq!(
            pods.usage,
            HashMap::from([(A.to_string(), tdx(4)), (B.to_string(), tdx(5))])
        );
        assert_eq!(pods.pods_read, 3);
        assert_eq!(s.open_pod_files(), 3, "B's new file is kept open");
        // And again from the files kept now (B's new one).
        replace(&b, "tdx 6\n");
        std::fs::write(&a, "tdx 1\n").expect("write");
        let pods = scan_both(&mut s, &interest);
        assert_eq!(
            pods.usage,
            HashMap::from([(A.to_string(), tdx(1)), (B.to_string(), tdx(6))])
        );
    }

    #[test]
    fn removed_pod_cgroups_are_gone_and_recreated_ones_read_again() {
        let d = tempfile::tempdir().expect("tempdir");
        let r = d.path();
        let [a, ..] = kept_open_host(r);
        let a_dir = a.parent().expect("pod dir").to_path_buf();
        let interest = all_three();
        let mut s = Scanner::new(r).full_read_every(1);
        scan_both(&mut s, &interest);
        assert_eq!(s.open_pod_files(), 3);

        // Removed: its keys are no longer counted (the kept file still reads "tdx 1").
        std::fs::remove_dir_all(&a_dir).expect("rmdir");
        let pods = scan_both(&mut s, &interest);
        assert!(!pods.usage.contains_key(A), "{:?}", pods.usage);
        assert_eq!(pods.usage.len(), 2);
        assert_eq!(pods.pods_read, 2);
        assert_eq!(pods.problem_count, 0, "{:?}", pods.problems);
        assert_eq!(s.open_pod_files(), 2);
        assert!(
            !s.known.contains_key(A),
            "a vanished pod's place is forgotten"
        );

        // Recreated at the same path.
        write(r, &pod_file(A, Some("burstable")), "tdx 7\n");
        let pods = scan_both(&mut s, &interest);
        assert_eq!(pods.usage.get(A), Some(&tdx(7)));
        assert_eq!(s.open_pod_files(), 3);

        // Removed and recreated at once between two scans, then recreated in another place.
        std::fs::remove_dir_all(&a_dir).expect("rmdir");
        write(r, &pod_file(A, Some("burstable")), "tdx 8\n");
        assert_eq!(scan_both(&mut s, &interest).usage.get(A), Some(&tdx(8)));
        std::fs::remove_dir_all(&a_dir).expect("rmdir");
        write(r, &pod_file(A, Some("besteffort")), "tdx 9\n");
        assert_eq!(scan_both(&mut s, &interest).usage.get(A), Some(&tdx(9)));
        assert_eq!(s.open_pod_files(), 3);
    }

    #[test]
    fn kept_files_that_break_are_reported_as_before() {
        let d = tempfile::tempdir().expect("tempdir");
        let r = d.path();
        let [a, b, c] = kept_open_host(r);
        let interest = all_three();
        let mut s = Scanner::new(r).full_read_every(1);
        scan_both(&mut s, &interest);

        // Malformed, written in place into the kept file.
        std::fs::write(&a, "tdx many\n").expect("write");
        let pods = scan_both(&mut s, &interest);
        assert_eq!(pods.problem_count, 1, "{:?}", pods.problems);
        assert!(
            pods.problems[0].contains(&format!("{}:1", a.display())),
            "{:?}",
            pods.problems
        );
        assert!(!pods.usage.contains_key(A));
        assert_eq!(pods.pods_read, 3);
        assert_eq!(s.open_pod_files(), 3, "a malformed file stays open");

        // Unreadable: replaced by a directory (EISDIR, also for root).
        std::fs::remove_file(&b).expect("rm");
        std::fs::create_dir(&b).expect("mkdir");
        let pods = scan_both(&mut s, &interest);
        assert_eq!(pods.problem_count, 2, "{:?}", pods.problems);
        assert!(
            pods.problems
                .iter()
                .any(|p| p.contains("cannot read pod cgroup file")
                    && p.contains(&b.display().to_string())),
            "{:?}",
            pods.problems
        );
        assert_eq!(pods.usage, HashMap::from([(C.to_string(), tdx(3))]));
        assert_eq!(s.open_pod_files(), 2, "an unreadable file is not kept");

        // misc.current removed, the pod directory kept: the controller is not delegated to pods.
        std::fs::remove_file(&c).expect("rm");
        let pods = scan_both(&mut s, &interest);
        assert_eq!(pods.accounting, Accounting::RunningPods);
        assert!(
            pods.accounting_reason.contains("has no misc.current"),
            "{}",
            pods.accounting_reason
        );

        // Healed: read and kept again.
        std::fs::write(&a, "tdx 1\n").expect("write");
        std::fs::remove_dir(&b).expect("rmdir");
        std::fs::write(&b, "tdx 2\n").expect("write");
        std::fs::write(&c, "tdx 3\n").expect("write");
        let pods = scan_both(&mut s, &interest);
        assert_eq!(pods.accounting, Accounting::PerPod);
        assert_eq!(pods.problem_count, 0, "{:?}", pods.problems);
        assert_eq!(pods.usage.len(), 3);
        assert_eq!(s.open_pod_files(), 3);
    }

    #[test]
    fn kept_files_are_bounded_by_the_interest_set() {
        let d = tempfile::tempdir().expect("tempdir");
        let r = d.path();
        kept_open_host(r);
        let mut s = Scanner::new(r).full_read_every(1);
        scan_both(&mut s, &all_three());
        assert_eq!(s.open_pod_files(), 3);

        let only_a = HashSet::from([A.to_string()]);
        assert_eq!(scan_both(&mut s, &only_a).pods_read, 1);
        assert_eq!(s.open_pod_files(), 1);
        assert_eq!(s.known.keys().collect::<Vec<_>>(), vec![A]);
        scan_both(&mut s, &HashSet::new());
        assert_eq!(s.open_pod_files(), 0);
        assert!(s.known.is_empty());
        scan_both(&mut s, &all_three());
        assert_eq!(s.open_pod_files(), 3);

        // Pruned also when the scan stops before the pods (no TEE capacity left).
        write(r, "misc.capacity", "");
        let scan = scanned(s.scan(Interest::Only(&only_a)).expect("scan"));
        assert!(scan.pods.is_none());
        assert_eq!(s.open_pod_files(), 1);
        s.scan(Interest::Only(&HashSet::new())).expect("scan");
        assert_eq!(s.open_pod_files(), 0);

        write(r, "misc.capacity", "tdx 16\n");
        // Never more than MAX_KEPT_FILES, however many pods request keys; the others are still read.
        let many: HashSet<String> = (0..MAX_KEPT_FILES + 8)
            .map(|i| format!("{i:08x}-2222-3333-4444-555555555555"))
            .collect();
        for (i, uid) in many.iter().enumerate() {
            write(r, &pod_file(uid, None), &format!("tdx {}\n", i % 2));
        }
        let holding = many.len() / 2;
        let mut big = Scanner::new(r).full_read_every(1);
        for _ in 0..2 {
            let pods = scan_both(&mut big, &many);
            assert_eq!(pods.pods_read, many.len());
            assert_eq!(pods.usage.len(), holding);
            assert_eq!(big.open_pod_files(), MAX_KEPT_FILES);
        }
        let fewer: HashSet<String> = many.iter().take(100).cloned().collect();
        scan_both(&mut big, &fewer);
        assert_eq!(big.open_pod_files(), 100);
        assert_eq!(scan_both(&mut big, &many).usage.len(), holding);
        assert_eq!(big.open_pod_files(), MAX_KEPT_FILES);

        // Walk mode keeps nothing open.
        let mut walk = Scanner::new(r);
        let pods = scanned(walk.scan(Interest::All).expect("scan"))
            .pods
            .expect("pods");
        assert_eq!(pods.usage.len(), 3 + holding);
        assert_eq!(walk.open_pod_files(), 0);
    }
    // ---- unchanged pods (agent mode) ----

    const D: &str = "dddddddd-2222-3333-4444-555555555555";
    const E: &str = "eeeeeeee-2222-3333-4444-555555555555";

    /// A v2/systemd host whose burstable pods hold these TDX keys, with the kubepods and root totals
    /// equal to their sum, as on a kernel. Files are rewritten in place (kept files see the change).
    fn set_host(r: &Path, pods: &[(&str, u64)]) {
        write(r, "misc.capacity", "tdx 64\n");
        write(r, "kubepods.slice/cgroup.controllers", "cpu misc\n");
        write(
            r,
            "kubepods.slice/kubepods-burstable.slice/misc.current",
            "tdx 0\n",
        );
        let total: u64 = pods.iter().map(|(_, n)| n).sum();
        write(r, "kubepods.slice/misc.current", &format!("tdx {total}\n"));
        write(r, "misc.current", &format!("tdx {total}\n"));
        for (uid, n) in pods {
            write(r, &pod_file(uid, Some("burstable")), &format!("tdx {n}\n"));
        }
    }

    fn interest(uids: &[&str]) -> HashSet<String> {
        uids.iter().map(|u| u.to_string()).collect()
    }

    /// One scan: (pods read, pods taken as unchanged, usage).
    fn agent_scan(
        s: &mut Scanner,
        set: &HashSet<String>,
    ) -> (usize, usize, HashMap<String, KindCounts>) {
        let pods = scanned(s.scan(Interest::Only(set)).expect("scan"))
            .pods
            .expect("pods");
        (pods.pods_read, pods.pods_unchanged, pods.usage)
    }

    fn usage(pairs: &[(&str, u64)]) -> HashMap<String, KindCounts> {
        pairs
            .iter()
            .map(|(u, n)| (u.to_string(), tdx(*n)))
            .collect()
    }

    #[test]
    fn unchanged_pods_are_not_read_while_the_kubepods_total_adds_up() {
        let d = tempfile::tempdir().expect("tempdir");
        let r = d.path();
        let set = interest(&[A, B, C]);
        let mut s = Scanner::new(r);
        set_host(r, &[(A, 1), (B, 2), (C, 0)]);
        let steady = usage(&[(A, 1), (B, 2)]);
        // The first scan reads everything; then nothing is read while the total adds up.
        assert_eq!(agent_scan(&mut s, &set), (3, 0, steady.clone()));
        assert_eq!(agent_scan(&mut s, &set), (0, 3, steady.clone()));
        // C's VM starts: the total moves, every pod is read.
        set_host(r, &[(A, 1), (B, 2), (C, 1)]);
        let with_c = usage(&[(A, 1), (B, 2), (C, 1)]);
        assert_eq!(agent_scan(&mut s, &set), (3, 0, with_c.clone()));
        assert_eq!(agent_scan(&mut s, &set), (0, 3, with_c));
        // A's VM stops: the same.
        set_host(r, &[(A, 0), (B, 2), (C, 1)]);
        let without_a = usage(&[(B, 2), (C, 1)]);
        assert_eq!(agent_scan(&mut s, &set), (3, 0, without_a.clone()));
        assert_eq!(agent_scan(&mut s, &set), (0, 3, without_a.clone()));
        // A pod with no cgroup yet is looked for at every scan (and holds nothing).
        let with_d = interest(&[A, B, C, D]);
        assert_eq!(agent_scan(&mut s, &with_d), (0, 3, without_a.clone()));
        // Whatever was reused, a fresh scanner (reading every file) agrees.
        let mut fresh = Scanner::new(r);
        assert_eq!(agent_scan(&mut fresh, &set).2, without_a);
    }

    #[test]
    fn keys_held_outside_the_pods_of_interest_are_carried_and_their_changes_noticed() {
        let d = tempfile::tempdir().expect("tempdir");
        let r = d.path();
        let set = interest(&[A]);
        let mut s = Scanner::new(r);
        // E (say an exempt VM) requests no key but holds two.
        set_host(r, &[(A, 1), (E, 2)]);
        assert_eq!(agent_scan(&mut s, &set), (1, 0, usage(&[(A, 1)])));
        assert_eq!(agent_scan(&mut s, &set), (0, 1, usage(&[(A, 1)])));
        // E releases them: the total drops, A is read again.
        set_host(r, &[(A, 1), (E, 0)]);
        assert_eq!(agent_scan(&mut s, &set), (1, 0, usage(&[(A, 1)])));
        assert_eq!(agent_scan(&mut s, &set), (0, 1, usage(&[(A, 1)])));
        // E charges keys again (counted outside by a full read), then joins the pods of interest: its
        // keys would count twice, the total does not add up, everything is read.
        set_host(r, &[(A, 1), (E, 2)]);
        assert_eq!(agent_scan(&mut s, &set), (1, 0, usage(&[(A, 1)])));
        let both = interest(&[A, E]);
        assert_eq!(agent_scan(&mut s, &both), (2, 0, usage(&[(A, 1), (E, 2)])));
        assert_eq!(agent_scan(&mut s, &both), (0, 2, usage(&[(A, 1), (E, 2)])));
        // A leaves the pods of interest while its cgroup still holds its key: it now counts outside.
        assert_eq!(
            agent_scan(&mut s, &interest(&[E])),
            (1, 0, usage(&[(E, 2)]))
        );
    }

    #[test]
    fn every_pod_is_read_again_every_full_read_period() {
        let d = tempfile::tempdir().expect("tempdir");
        let r = d.path();
        let set = interest(&[A, B]);
        set_host(r, &[(A, 1), (B, 1)]);
        let mut s = Scanner::new(r).full_read_every(3);
        let read: Vec<usize> = (0..7).map(|_| agent_scan(&mut s, &set).0).collect();
        assert_eq!(read, [2, 0, 0, 2, 0, 0, 2]);
        // The default period.
        let mut s = Scanner::new(r);
        let read: Vec<usize> = (0..=FULL_READ_EVERY)
            .map(|_| agent_scan(&mut s, &set).0)
            .collect();
        assert_eq!(read.iter().filter(|n| **n == 2).count(), 2, "{read:?}");
        assert_eq!(read.last(), Some(&2), "{read:?}");
    }

    /// Changes the totals cannot show (see "Unchanged pods"): a pod releases a key while a cgroup that
    /// is not read charges one. The stale reading lasts until the next full read.
    #[test]
    fn offsetting_changes_lag_until_the_next_full_read() {
        let d = tempfile::tempdir().expect("tempdir");
        let r = d.path();
        let set = interest(&[A]);
        set_host(r, &[(A, 1), (E, 0)]);
        let mut s = Scanner::new(r).full_read_every(4);
        assert_eq!(agent_scan(&mut s, &set), (1, 0, usage(&[(A, 1)])));
        set_host(r, &[(A, 0), (E, 1)]);
        for _ in 0..3 {
            assert_eq!(agent_scan(&mut s, &set), (0, 1, usage(&[(A, 1)])));
        }
        assert_eq!(agent_scan(&mut s, &set), (1, 0, usage(&[])));
        // From then on the new state is the baseline.
        assert_eq!(agent_scan(&mut s, &set), (0, 1, usage(&[])));
    }

    #[test]
    fn an_unreadable_kubepods_total_reads_every_pod() {
        let d = tempfile::tempdir().expect("tempdir");
        let r = d.path();
        let set = interest(&[A, B]);
        set_host(r, &[(A, 1), (B, 1)]);
        write(r, "kubepods.slice/misc.current", "tdx many\n");
        let mut s = Scanner::new(r);
        for _ in 0..3 {
            assert_eq!(agent_scan(&mut s, &set), (2, 0, usage(&[(A, 1), (B, 1)])));
        }
    }
}
