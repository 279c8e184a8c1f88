//! The kernel's misc cgroup controller: the only source of truth for TEE key capacity and usage.
//!
//! | file | where | format |
//! |---|---|---|
//! | `misc.capacity` | root only | `name value` per line, only resources with capacity > 0 |
//! | `misc.current` | every cgroup (the root only since ~6.5) | `name usage`, hierarchical |
//! | `misc.peak` | every cgroup (since ~6.11) | `name watermark` |
//! | `misc.max` | non-root | `name max` or `name N` |
//! | `misc.events` | non-root | `name.max count` (failed charges) |
//!
//! Parsers keep resource names they do not know (logic ignores them), accept blank lines and trailing
//! whitespace, take the full `u64` range, and report malformed content as [`Error::MiscParse`] naming
//! the file and line.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::tee::TeeKind;

/// `name value` pairs from `misc.capacity`, `misc.current` or `misc.peak`, in file order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MiscValues {
    entries: Vec<(String, u64)>,
}

impl MiscValues {
    /// Build from pairs (later duplicates replace earlier ones, in place). Linear in the number of
    /// pairs, whatever they hold.
    pub fn from_pairs<I, S>(pairs: I) -> Self
    where
        I: IntoIterator<Item = (S, u64)>,
        S: Into<String>,
    {
        let mut index: HashMap<String, usize> = HashMap::new();
        let mut entries: Vec<(String, u64)> = Vec::new();
        for (name, value) in pairs {
            let name = name.into();
            match index.get(&name) {
                Some(&i) => entries[i].1 = value,
                None => {
                    index.insert(name.clone(), entries.len());
                    entries.push((name, value));
                }
            }
        }
        MiscValues { entries }
    }

    fn set(&mut self, name: String, value: u64) {
        match self.entries.iter_mut().find(|(n, _)| *n == name) {
            Some(slot) => slot.1 = value,
            None => self.entries.push((name, value)),
        }
    }

    /// The value for a resource name, known or not.
    pub fn get_name(&self, name: &str) -> Option<u64> {
        self.entries
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
    }

    /// The value for a TEE kind, if the file lists it.
    pub fn get(&self, kind: TeeKind) -> Option<u64> {
        self.get_name(kind.kernel_name())
    }

    /// Every entry, including resources teeguard does not manage.
    pub fn entries(&self) -> impl Iterator<Item = (&str, u64)> {
        self.entries.iter().map(|(n, v)| (n.as_str(), *v))
    }

    /// The TEE kinds listed, with their values, in [`TeeKind::ALL`] order.
    pub fn kinds(&self) -> impl Iterator<Item = (TeeKind, u64)> + '_ {
        TeeKind::ALL
            .into_iter()
            .filter_map(|k| self.get(k).map(|v| (k, v)))
    }

    /// True when no resource is listed.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Add another set of values entry by entry (saturating), e.g. to sum children.
    pub fn add(&mut self, other: &MiscValues) {
        for (name, value) in other.entries() {
            let cur = self.get_name(name).unwrap_or(0);
            self.set(name.to_string(), cur.saturating_add(value));
        }
    }
}

/// A limit in `misc.max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MiscLimit {
    /// The literal `max`: no limit below the capacity.
    Max,
    /// A numeric limit.
    Value(u64),
}

/// Parse `misc.capacity`, `misc.current` or `misc.peak` content. `path` only names the file in errors.
pub fn parse_values(path: &Path, content: &str) -> Result<MiscValues> {
    let pairs = lines(path, content)?
        .into_iter()
        .map(|(line_no, name, value)| Ok((name, parse_u64(path, line_no, name, value)?)))
        .collect::<Result<Vec<_>>>()?;
    Ok(MiscValues::from_pairs(pairs))
}

/// Parse `misc.max` content (`name max` or `name N`).
pub fn parse_max(path: &Path, content: &str) -> Result<BTreeMap<String, MiscLimit>> {
    let mut out = BTreeMap::new();
    for (line_no, name, value) in lines(path, content)? {
        let limit = if value == "max" {
            MiscLimit::Max
        } else {
            MiscLimit::Value(parse_u64(path, line_no, name, value)?)
        };
        out.insert(name.to_string(), limit);
    }
    Ok(out)
}

/// Parse `misc.events` / `misc.events.local` content (`name.max count`): failed charges per resource.
pub fn parse_events(path: &Path, content: &str) -> Result<BTreeMap<String, u64>> {
    let mut out = BTreeMap::new();
    for (line_no, key, value) in lines(path, content)? {
        let Some(name) = key.strip_suffix(".max") else {
            return Err(Error::MiscParse {
                path: path.to_path_buf(),
                line: line_no,
                reason: format!(
                    "expected `<resource>.max <count>`, found key {:?}",
                    truncate(key)
                ),
            });
        };
        if name.is_empty() {
            return Err(Error::MiscParse {
                path: path.to_path_buf(),
                line: line_no,
                reason: "empty resource name before `.max`".into(),
            });
        }
        let count = parse_u64(path, line_no, key, value)?;
        out.insert(name.to_string(), count);
    }
    Ok(out)
}

/// Split into `(line number, key, value)`; blank lines skipped; exactly two fields required.
fn lines<'a>(path: &Path, content: &'a str) -> Result<Vec<(usize, &'a str, &'a str)>> {
    let mut out = Vec::new();
    for (i, line) in content.lines().enumerate() {
        let line_no = i + 1;
        let trimmed = line.trim();
        if trimmed.is_empty() {
            continue;
        }
        let mut fields = trimmed.split_ascii_whitespace();
        match (fields.next(), fields.next(), fields.next()) {
            (Some(k), Some(v), None) => out.push((line_no, k, v)),
            _ => {
                return Err(Error::MiscParse {
                    path: path.to_path_buf(),
                    line: line_no,
                    reason: format!("expected `<name> <value>`, found {:?}", truncate(trimmed)),
                });
            }
        }
    }
    Ok(out)
}

fn parse_u64(path: &Path, line: usize, name: &str, value: &str) -> Result<u64> {
    value.parse::<u64>().map_err(|_| Error::MiscParse {
        path: path.to_path_buf(),
        line,
        reason: format!(
            "value of {:?} is {:?}, not an unsigned 64-bit integer",
            truncate(name),
            truncate(value)
        ),
    })
}

fn truncate(s: &str) -> String {
    if s.len() <= 64 {
        s.to_string()
    } else {
        let mut end = 64;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}…", &s[..end])
    }
}

/// The cgroup hierarchy version the misc controller was found in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupLayout {
    /// Unified hierarchy: `<root>/misc.*`.
    V2,
    /// Legacy hierarchy: `<root>/misc/misc.*`.
    V1,
}

/// Where the misc controller lives on a host, and how to read it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MiscController {
    dir: PathBuf,
    layout: CgroupLayout,
}

impl MiscController {
    /// Find the misc controller under a cgroup root (the host's `/sys/fs/cgroup`, mounted anywhere):
    /// cgroup v2 `<root>/misc.capacity`, else cgroup v1 `<root>/misc/misc.capacity`.
    pub fn locate(cgroup_root: &Path) -> Result<MiscController> {
        if cgroup_root.join("misc.capacity").is_file() {
            return Ok(MiscController {
                dir: cgroup_root.to_path_buf(),
                layout: CgroupLayout::V2,
            });
        }
        let v1 = cgroup_root.join("misc");
        if v1.join("misc.capacity").is_file() {
            return Ok(MiscController {
                dir: v1,
                layout: CgroupLayout::V1,
            });
        }
        Err(Error::MiscControllerNotFound {
            root: cgroup_root.to_path_buf(),
        })
    }

    /// The directory holding the root `misc.*` files (also the root of the hierarchy to walk).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// cgroup v1 or v2.
    pub fn layout(&self) -> CgroupLayout {
        self.layout
    }

    /// Read `misc.capacity`.
    pub fn capacity(&self) -> Result<MiscValues> {
        read_values(&self.dir.join("misc.capacity"))
    }

    /// Read the host's usage: the root `misc.current`, or, on older kernels without one, the sum of
    /// the top-level children's `misc.current`.
    pub fn current(&self) -> Result<MiscValues> {
        match read_values_opt(&self.dir.join("misc.current"))? {
            Some(v) => Ok(v),
            None => self.sum_children_current(),
        }
    }

    /// The sum of `misc.current` over the root's direct child cgroups (children without the file,
    /// where the controller is not enabled, count as zero).
    pub fn sum_children_current(&self) -> Result<MiscValues> {
        let mut total = MiscValues::default();
        let rd = std::fs::read_dir(&self.dir).map_err(|source| Error::MiscRead {
            path: self.dir.clone(),
            source,
        })?;
        let mut dirs: Vec<PathBuf> = Vec::new();
        for entry in rd {
            let entry = entry.map_err(|source| Error::MiscRead {
                path: self.dir.clone(),
                source,
            })?;
            let ft = entry.file_type().map_err(|source| Error::MiscRead {
                path: entry.path(),
                source,
            })?;
            if ft.is_dir() {
                dirs.push(entry.path());
            }
        }
        dirs.sort();
        for d in dirs {
            if let Some(v) = read_values_opt(&d.join("misc.current"))? {
                total.add(&v);
            }
        }
        Ok(total)
    }

    /// `misc.current` of a cgroup below the root (`relative` to [`MiscController::dir`]);
    /// `None` when the file does not exist (the controller is not enabled there).
    pub fn cgroup_current(&self, relative: &Path) -> Result<Option<MiscValues>> {
        read_values_opt(&self.dir.join(relative).join("misc.current"))
    }

    /// `misc.events` of a cgroup below the root; `None` when absent.
    pub fn cgroup_events(&self, relative: &Path) -> Result<Option<BTreeMap<String, u64>>> {
        let path = self.dir.join(relative).join("misc.events");
        match read_opt(&path)? {
            Some(text) => parse_events(&path, &text).map(Some),
            None => Ok(None),
        }
    }
}

/// Read and parse a values file (`misc.capacity`, `misc.current`, `misc.peak`).
pub fn read_values(path: &Path) -> Result<MiscValues> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::MiscRead {
        path: path.to_path_buf(),
        source,
    })?;
    parse_values(path, &text)
}

/// Like [`read_values`], but `None` when the file does not exist.
pub fn read_values_opt(path: &Path) -> Result<Option<MiscValues>> {
    match read_opt(path)? {
        Some(text) => parse_values(path, &text).map(Some),
        None => Ok(None),
    }
}

fn read_opt(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(Error::MiscRead {
            path: path.to_path_buf(),
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p() -> &'static Path {
        Path::new("/sys/fs/cgroup/misc.capacity")
    }

    #[test]
    fn real_world_contents() {
        let v = parse_values(p(), "tdx 31\n").expect("tdx");
        assert_eq!(v.get(TeeKind::Tdx), Some(31));
        assert_eq!(v.get(TeeKind::Sev), None);

        let v = parse_values(p(), "sev 99\nsev_es 410\n").expect("amd");
        assert_eq!(v.get(TeeKind::Sev), Some(99));
        assert_eq!(v.get(TeeKind::SevEs), Some(410));
        assert_eq!(v.get(TeeKind::Tdx), None);
        assert_eq!(
            v.kinds().collect::<Vec<_>>(),
            vec![(TeeKind::Sev, 99), (TeeKind::SevEs, 410)]
        );
    }

    #[test]
    fn tolerant_of_blank_lines_trailing_space_and_unknown_names() {
        let v = parse_values(p(), "\nsgx_epc 1024  \n\n tdx 16\t\n\n").expect("tolerant");
        assert_eq!(v.get(TeeKind::Tdx), Some(16));
        assert_eq!(v.get_name("sgx_epc"), Some(1024));
        assert_eq!(v.kinds().count(), 1);
    }

    #[test]
    fn full_u64_range() {
        let v = parse_values(p(), "tdx 18446744073709551615\n").expect("max u64");
        assert_eq!(v.get(TeeKind::Tdx), Some(u64::MAX));
        assert!(parse_values(p(), "tdx 18446744073709551616\n").is_err());
    }

    #[test]
    fn garbage_is_an_error_naming_file_and_line() {
        for (content, line) in [
            ("tdx 31\nsev\n", 2),
            ("tdx -1\n", 1),
            ("tdx 3 4\n", 1),
            ("\n\ntdx many\n", 3),
            ("\u{0}\u{1}binary\n", 1),
        ] {
            let err = parse_values(p(), content).expect_err(content);
            match &err {
                Error::MiscParse { path, line: l, .. } => {
                    assert_eq!(path, p());
                    assert_eq!(*l, line, "{content:?}");
                }
                other => panic!("unexpected error {other:?}"),
            }
            assert!(
                err.to_string().starts_with("/sys/fs/cgroup/misc.capacity:"),
                "{err}"
            );
        }
    }

    #[test]
    fn error_messages_stay_short_and_parsing_is_linear() {
        let long = "n".repeat(5000);
        for content in [
            format!("{long} x\n"),
            format!("{long}.max x\n"),
            format!("{long} 1\n"),
        ] {
            if let Err(e) = parse_values(p(), &content) {
                assert!(e.to_string().len() < 300, "{} bytes", e.to_string().len());
            }
            if let Err(e) = parse_events(p(), &content) {
                assert!(e.to_string().len() < 300, "{} bytes", e.to_string().len());
            }
        }
        let many: String = (0..50_000).map(|i| format!("r{i} {i}\n")).collect();
        let v = parse_values(p(), &many).expect("many names");
        assert_eq!(v.get_name("r49999"), Some(49_999));
        assert_eq!(v.entries().count(), 50_000);
        let dup = parse_values(p(), "tdx 1\ntdx 2\n").expect("duplicate");
        assert_eq!(dup.get(TeeKind::Tdx), Some(2));
        assert_eq!(dup.entries().count(), 1);
    }

    #[test]
    fn max_and_events() {
        let m = parse_max(Path::new("misc.max"), "tdx max\nsev 3\n").expect("max");
        assert_eq!(m.get("tdx"), Some(&MiscLimit::Max));
        assert_eq!(m.get("sev"), Some(&MiscLimit::Value(3)));
        assert!(parse_max(Path::new("misc.max"), "tdx unlimited\n").is_err());

        let e =
            parse_events(Path::new("misc.events"), "tdx.max 2\nsev_es.max 0\n").expect("events");
        assert_eq!(e.get("tdx"), Some(&2));
        assert_eq!(e.get("sev_es"), Some(&0));
        assert!(parse_events(Path::new("misc.events"), "tdx 2\n").is_err());
        assert!(parse_events(Path::new("misc.events"), ".max 2\n").is_err());
    }
}
