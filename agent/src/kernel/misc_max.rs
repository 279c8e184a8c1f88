//! Writing a pod cgroup's `misc.max`: one resource per write (the kernel parses one `name value` per
//! write), opened without `O_CREAT` (a pod cgroup without `misc.max` has no misc controller: not
//! delegated, and nothing is created), and read back. The cgroup writer (`enforce::cgroup`) decides
//! when and for which pods.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use teeguard_shared::TeeKind;
use teeguard_shared::misc::{MiscLimit, parse_max};

use crate::decide::cgroup_names::pod_cgroup_candidates;
use crate::decide::host::Driver;
use crate::decide::limits::Limit;

/// What writing a pod's limits did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Every limit is in `misc.max` (read back).
    Written(PathBuf),
    /// The pod has no cgroup (yet).
    NoCgroup,
    /// The pod cgroup has no `misc.max`: the misc controller is not delegated to it.
    NotDelegated(PathBuf),
    /// A write or the read-back failed.
    Failed(String),
}

/// Write `limits` into `<dir>/misc.max`, one line per write, and read them back.
fn write_limits(dir: &Path, limits: &[Limit]) -> WriteOutcome {
    let lines: Vec<(TeeKind, MiscLimit)> = limits
        .iter()
        .map(|l| (l.kind, MiscLimit::Value(l.keys)))
        .collect();
    write_lines(dir, &lines)
}

/// Write `max` for each of `kinds` into `<dir>/misc.max` (no limit below the capacity), and read it back.
fn write_unlimited(dir: &Path, kinds: &[TeeKind]) -> WriteOutcome {
    let lines: Vec<(TeeKind, MiscLimit)> = kinds.iter().map(|k| (*k, MiscLimit::Max)).collect();
    write_lines(dir, &lines)
}

fn write_lines(dir: &Path, lines: &[(TeeKind, MiscLimit)]) -> WriteOutcome {
    let path = dir.join("misc.max");
    // The kernel's `misc.max` line: `tdx 1`, `tdx max`.
    let line = |kind: &TeeKind, limit: &MiscLimit| match limit {
        MiscLimit::Max => format!("{} max", kind.kernel_name()),
        MiscLimit::Value(n) => format!("{} {n}", kind.kernel_name()),
    };
    for (kind, limit) in lines {
        let line = line(kind, limit);
        let opened = std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&path);
        let mut file = match opened {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return if dir.is_dir() {
                    WriteOutcome::NotDelegated(dir.to_path_buf())
                } else {
                    WriteOutcome::NoCgroup
                };
            }
            Err(e) => return WriteOutcome::Failed(format!("cannot open {}: {e}", path.display())),
        };
        if let Err(e) = file.write_all(line.as_bytes()) {
            return WriteOutcome::Failed(format!(
                "writing {line:?} to {} failed: {e}",
                path.display()
            ));
        }
    }
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) => return WriteOutcome::Failed(format!("cannot read back {}: {e}", path.display())),
    };
    let now = match parse_max(&path, &text) {
        Ok(m) => m,
        Err(e) => return WriteOutcome::Failed(e.to_string()),
    };
    for (kind, limit) in lines {
        if now.get(kind.kernel_name()) != Some(limit) {
            return WriteOutcome::Failed(format!(
                "{} does not show {} after writing it",
                path.display(),
                line(kind, limit)
            ));
        }
    }
    WriteOutcome::Written(dir.to_path_buf())
}

/// Find the pod's cgroup and write its limits there.
pub fn apply(kubepods: &Path, driver: Driver, uid: &str, limits: &[Limit]) -> WriteOutcome {
    match pod_dir(kubepods, driver, uid) {
        Some(dir) => write_limits(&dir, limits),
        None => WriteOutcome::NoCgroup,
    }
}

/// Find the pod's cgroup and lift its limits of `kinds` there (`max`).
pub fn lift(kubepods: &Path, driver: Driver, uid: &str, kinds: &[TeeKind]) -> WriteOutcome {
    match pod_dir(kubepods, driver, uid) {
        Some(dir) => write_unlimited(&dir, kinds),
        None => WriteOutcome::NoCgroup,
    }
}

fn pod_dir(kubepods: &Path, driver: Driver, uid: &str) -> Option<PathBuf> {
    pod_cgroup_candidates(kubepods, driver, uid)
        .into_iter()
        .find(|d| d.is_dir())
}
