//! Reading the host's misc cgroup files: the [`Scanner`] and its state, and the walk of every pod
//! cgroup (the pods of interest are read in `interest`).
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
//!      `interest`;
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
//! The scan reuses its path and content buffers (see `kernel::files`), and in agent mode allocates
//! only for pods that hold keys.

mod interest;
mod refusals;

use std::collections::HashMap;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};

use teeguard_shared::misc::MiscController;

use self::interest::{KnownPod, Kubepods};
use self::refusals::RefusalReader;
use super::files::{list_dirs, read_text};
use crate::decide::attribution::Accounting;
use crate::decide::cgroup_names::{CgroupName, classify, normalize_uid, parse_counts};
use crate::decide::counts::KindCounts;
use crate::decide::host::{Driver, HostScan, HostState, Interest, PodScan, Refusals, UsageSource};
use crate::decide::reuse::{FULL_READ_EVERY, Reuse};
use crate::error::{Error, Result};

/// Attempts at a consistent snapshot (root usage unchanged while the pods were read).
const MAX_SNAPSHOT_ATTEMPTS: u32 = 3;

/// Reads the misc cgroup files under one cgroup root; keep one and call [`Scanner::scan`] repeatedly.
#[derive(Debug)]
pub struct Scanner {
    root: PathBuf,
    path: PathBuf,
    buf: Vec<u8>,
    uid: String,
    /// Agent mode: each pod of interest whose cgroup was found, by UID. Pruned to the interest set at
    /// every scan, so it holds at most one entry (and one open file) per pod of interest.
    known: HashMap<String, KnownPod, foldhash::fast::RandomState>,
    /// Agent mode: whether the pods' last readings may be reused (see [`crate::decide::reuse`]).
    reuse: Reuse,
    /// The `misc.events` files (failed charges).
    refusals: RefusalReader,
}

impl Scanner {
    /// A scanner for the host cgroup tree mounted at `cgroup_root` (e.g. `/host/sys/fs/cgroup`).
    pub fn new(cgroup_root: impl Into<PathBuf>) -> Self {
        Scanner {
            root: cgroup_root.into(),
            path: PathBuf::with_capacity(256),
            buf: Vec::with_capacity(512),
            uid: String::with_capacity(40),
            known: HashMap::default(),
            reuse: Reuse::new(FULL_READ_EVERY),
            refusals: RefusalReader::default(),
        }
    }

    /// Read every pod of interest at least every `scans` scans (default [`FULL_READ_EVERY`]; `1` reads
    /// every pod at every scan, as walk mode does). See [`crate::decide::reuse`].
    #[must_use]
    pub fn full_read_every(mut self, scans: u32) -> Self {
        self.reuse = Reuse::new(scans);
        self
    }

    /// The next scan reads every pod of interest, whatever the kubepods total says (a failed charge
    /// shows the figures may be behind: see [`crate::decide::reuse`]).
    pub fn read_every_pod_next(&mut self) {
        self.reuse.forget();
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
            self.reuse.scan_started();
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
        let usage_source = self.usage_source(controller.dir());
        if capacity.is_zero() {
            return Ok(HostState::Scanned(HostScan {
                misc_dir: controller.dir().to_path_buf(),
                layout: controller.layout(),
                capacity,
                kernel_used: KindCounts::ZERO,
                usage_source,
                pods: None,
                refusals: Refusals::default(),
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
        let kubepods = pods
            .as_ref()
            .and_then(|p| p.kubepods.as_ref())
            .and_then(|k| k.file_name())
            .and_then(|n| n.to_str())
            .map(str::to_string);
        let refusals = self.refusals.read(controller.dir(), kubepods.as_deref());
        Ok(HostState::Scanned(HostScan {
            misc_dir: controller.dir().to_path_buf(),
            layout: controller.layout(),
            capacity,
            kernel_used,
            usage_source,
            pods,
            refusals,
        }))
    }

    /// Where the kernel's usage can be read: the root's `misc.current`, else the top-level cgroups'
    /// (which miss keys charged to the root cgroup itself), else nowhere (cgroup v2 with the misc
    /// controller not enabled below the root).
    fn usage_source(&mut self, misc_dir: &Path) -> UsageSource {
        if misc_dir.join("misc.current").is_file() {
            return UsageSource::Root;
        }
        if self.file_lacks_misc(misc_dir, "cgroup.subtree_control") {
            UsageSource::Hidden
        } else {
            UsageSource::TopLevel
        }
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
                    let at = Kubepods {
                        dir: &kubepods,
                        driver,
                    };
                    self.read_interest(&mut scan, at, set, top);
                }
                // Nothing is held below kubepods: no pod was read, so no reading to reuse later.
                _ => self.reuse.forget(),
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

#[cfg(test)]
mod tests;
