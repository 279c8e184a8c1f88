//! Failed charges: the `misc.events` files of the top-level cgroups (kubepods among them) at every
//! scan, and of every pod cgroup under kubepods only when kubepods' file changed (a refusal in a pod
//! is counted in kubepods too), so a host where nothing is refused costs one small file per top-level
//! cgroup. Every pod cgroup is read, not only those of pods requesting keys: in strict mode the
//! refusals that matter are those of keyless pods.
//!
//! Files that are missing (no misc controller there), unreadable or malformed count nothing; the
//! usage scan reports the pod cgroups' trouble already.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::super::files::{list_dirs, read_text};
use crate::decide::cgroup_names::{CgroupName, classify, normalize_uid, parse_event_counts};
use crate::decide::counts::KindCounts;
use crate::decide::host::Refusals;

/// Reads the `misc.events` files, remembering the pods' counts between scans.
#[derive(Debug, Default)]
pub(super) struct RefusalReader {
    /// kubepods' count when the pods were last read.
    kubepods_seen: Option<KindCounts>,
    /// The pods' counts (those that counted any) when last read.
    pods: HashMap<String, KindCounts>,
    buf: Vec<u8>,
    uid: String,
}

impl RefusalReader {
    /// Read the refusals under `misc_dir`; `kubepods` is kubepods' directory name there, if any.
    pub(super) fn read(&mut self, misc_dir: &Path, kubepods: Option<&str>) -> Refusals {
        let mut out = Refusals::default();
        if let Ok(dirs) = list_dirs(misc_dir) {
            for dir in dirs {
                let path = misc_dir.join(&dir);
                let Some(count) = self.events(&path) else {
                    continue;
                };
                out.dirs.push(path);
                if Some(dir.as_str()) == kubepods {
                    out.kubepods = count;
                } else if !count.is_zero() {
                    out.outside.insert(dir, count);
                }
            }
        }
        out.dirs.sort();
        match kubepods {
            Some(name) if !out.kubepods.is_zero() => {
                if self.kubepods_seen != Some(out.kubepods) {
                    self.read_pods(&misc_dir.join(name));
                    self.kubepods_seen = Some(out.kubepods);
                }
                out.pods = self.pods.clone();
            }
            // Nothing refused below kubepods (or no kubepods): no pod counted anything.
            _ => {
                self.pods.clear();
                self.kubepods_seen = Some(out.kubepods);
            }
        }
        out
    }

    /// `dir/misc.events` as counts; `None` when it cannot be had.
    fn events(&mut self, dir: &Path) -> Option<KindCounts> {
        let path = dir.join("misc.events");
        let text = read_text(&path, &mut self.buf).ok()?;
        match parse_event_counts(&path, text) {
            Ok(c) => Some(c),
            Err(e) => {
                tracing::debug!(error = %e, "malformed misc.events; its refusals are not counted");
                None
            }
        }
    }

    fn read_pods(&mut self, kubepods: &Path) {
        self.pods.clear();
        let mut parents: Vec<PathBuf> = vec![kubepods.to_path_buf()];
        let mut i = 0;
        while i < parents.len() {
            let parent = parents[i].clone();
            i += 1;
            let Ok(entries) = list_dirs(&parent) else {
                continue;
            };
            for entry in entries {
                match classify(&entry) {
                    CgroupName::Qos if parent == kubepods => parents.push(parent.join(&entry)),
                    CgroupName::Pod { uid, systemd } => {
                        let mut normalized = std::mem::take(&mut self.uid);
                        let valid = normalize_uid(uid, systemd, &mut normalized);
                        if valid
                            && let Some(count) = self.events(&parent.join(&entry))
                            && !count.is_zero()
                        {
                            self.pods.insert(normalized.clone(), count);
                        }
                        self.uid = normalized;
                    }
                    _ => {}
                }
            }
        }
    }
}
