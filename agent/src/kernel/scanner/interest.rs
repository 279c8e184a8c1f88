//! Agent mode: reading only the pods of interest (the pods that request keys), by constructed path,
//! with their files kept open between scans and their last readings reused while the kubepods total
//! shows no change (the rule: [`crate::decide::reuse`]).
//!
//! # Open files
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

use std::fs::File;
use std::path::{Path, PathBuf};

use super::{LevelUsage, Scanner};
use crate::decide::attribution::Uids;
use crate::decide::cgroup_names::{is_valid_uid, pod_dir_name, pod_places};
use crate::decide::counts::KindCounts;
use crate::decide::host::{Driver, PodScan};
use crate::kernel::files::{PodRead, read_pod_file, record_pod, reread};

/// At most this many pod files are kept open (agent mode), far above any node's pod count (the kubelet's
/// `maxPods` defaults to 110), so a strange configuration cannot exhaust the process's descriptors
/// (the soft limit is often 1024); pods beyond it are opened by path at every scan.
const MAX_KEPT_FILES: usize = 512;

/// Where the pod cgroups are: the kubepods directory, and the cgroup driver that names them.
#[derive(Clone, Copy, Debug)]
pub(super) struct Kubepods<'a> {
    /// `kubepods.slice` or `kubepods`.
    pub(super) dir: &'a Path,
    /// The kubelet's cgroup driver.
    pub(super) driver: Driver,
}

/// Where a pod of interest's cgroup was found, and its `misc.current` kept open (agent mode).
#[derive(Debug)]
pub(super) struct KnownPod {
    /// The pod's cgroup directory: where `misc.current` is opened again when the kept file is stale.
    dir: PathBuf,
    /// `misc.current`, open since the last successful read by path; re-read at offset 0 every poll.
    /// `None` after a failed read (the next poll opens the file by path again). Dropping it closes it.
    pub(super) file: Option<File>,
    /// What the pod held at its last reading (zero after a failed one).
    last: KindCounts,
}

impl Scanner {
    /// Read the pods of interest ([`crate::decide::reuse`]): first only those without a reading to
    /// reuse, taking the others' last readings, and all of them when the kubepods total (`top`) does
    /// not add up or a full read is due.
    pub(super) fn read_interest(
        &mut self,
        scan: &mut PodScan,
        at: Kubepods<'_>,
        set: &Uids,
        top: LevelUsage,
    ) {
        let total = match top {
            LevelUsage::Read(c) => Some(c),
            LevelUsage::Unknown => None,
        };
        if let (Some(total), Some(outside)) = (total, self.reuse.baseline(total)) {
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
                if !self.read_and_remember(scan, at, uid) {
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
            if !self.read_and_remember(scan, at, uid) {
                return;
            }
        }
        self.reuse.full_read(total, &scan.usage);
    }

    /// [`Scanner::direct_pod`], then remember what the pod held for the next scan. False: stop (the
    /// controller is not delegated), and reuse nothing until a full read.
    fn read_and_remember(&mut self, scan: &mut PodScan, at: Kubepods<'_>, uid: &str) -> bool {
        if !self.direct_pod(scan, at, uid) {
            self.reuse.forget();
            return false;
        }
        if let Some(k) = self.known.get_mut(uid) {
            k.last = scan.usage.get(uid).copied().unwrap_or(KindCounts::ZERO);
        }
        true
    }

    /// Read a pod's cgroup through its kept-open `misc.current`, else by constructing its
    /// path (no directory listing). The QoS class is not known from the UID, so the three possible places
    /// are tried once and the hit remembered, with the file kept open. Returns false when the pod showed
    /// the controller is not delegated (stop).
    fn direct_pod(&mut self, scan: &mut PodScan, at: Kubepods<'_>, uid: &str) -> bool {
        let Kubepods {
            dir: kubepods,
            driver,
        } = at;
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
        for (qos, prefix) in pod_places(driver) {
            pod_dir_name(&mut self.uid, prefix, driver, uid);
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
}

#[cfg(test)]
mod tests;
