//! The kubelet's pod cgroup names: which directory under kubepods is a pod's (systemd and cgroupfs
//! drivers), the pod UID in a name, where a pod's cgroup can be, and the content of a `misc.current`
//! file. Pure: paths are built, never looked at.

use std::path::{Path, PathBuf};

use teeguard_shared::TeeKind;

use super::counts::KindCounts;
use super::host::Driver;
use crate::error::Result;

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

/// Where a pod's cgroup can be with this driver (guaranteed, burstable, besteffort): the QoS directory
/// under kubepods (none for guaranteed) and the prefix of the pod's directory name.
pub fn pod_places(driver: Driver) -> &'static [(Option<&'static str>, &'static str); 3] {
    match driver {
        Driver::Systemd => &SYSTEMD_PLACES,
        Driver::Cgroupfs => &CGROUPFS_PLACES,
    }
}

/// Write a pod cgroup's directory name into `out` (cleared first): `prefix` from [`pod_places`], then
/// the UID (systemd names write its `-` as `_`) and, for systemd, `.slice`.
pub fn pod_dir_name(out: &mut String, prefix: &str, driver: Driver, uid: &str) {
    out.clear();
    out.push_str(prefix);
    match driver {
        Driver::Systemd => {
            out.extend(uid.chars().map(|c| if c == '-' { '_' } else { c }));
            out.push_str(".slice");
        }
        Driver::Cgroupfs => out.push_str(uid),
    }
}

/// The three places a pod's cgroup can be (guaranteed, burstable, besteffort), for a valid UID.
pub fn pod_cgroup_candidates(kubepods: &Path, driver: Driver, uid: &str) -> Vec<PathBuf> {
    if !is_valid_uid(uid) {
        return Vec::new();
    }
    let mut name = String::new();
    pod_places(driver)
        .iter()
        .map(|(qos, prefix)| {
            let mut dir = kubepods.to_path_buf();
            if let Some(q) = qos {
                dir.push(q);
            }
            pod_dir_name(&mut name, prefix, driver, uid);
            dir.push(&name);
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

/// What a directory name under kubepods is.
#[derive(Debug, PartialEq, Eq)]
pub enum CgroupName<'a> {
    /// A QoS-class parent (`burstable`, `besteffort`, or their systemd slices).
    Qos,
    /// A pod cgroup; `uid` is the raw part of the name (not validated yet).
    Pod { uid: &'a str, systemd: bool },
    /// Anything else (control files are not directories; this is e.g. a container cgroup).
    Other,
}

/// What the directory `name` under kubepods (or a QoS directory) is.
pub fn classify(name: &str) -> CgroupName<'_> {
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
pub fn normalize_uid(raw: &str, systemd: bool, out: &mut String) -> bool {
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

/// A pod UID as the API server writes it: RFC 4122 form, or 32 hex digits (static pods). Only such
/// UIDs are ever made into paths.
pub fn is_valid_uid(uid: &str) -> bool {
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
pub fn parse_counts(path: &Path, text: &str) -> Result<KindCounts> {
    match parse_counts_fast(text) {
        Some(c) => Ok(c),
        None => {
            let values = teeguard_shared::misc::parse_values(path, text)?;
            Ok(KindCounts::from_misc(&values))
        }
    }
}

/// Parse a `misc.events` file (`<name>.max <count>` per line) into failed charges per TEE kind
/// (other resources ignored).
pub fn parse_event_counts(path: &Path, text: &str) -> Result<KindCounts> {
    let events = teeguard_shared::misc::parse_events(path, text)?;
    Ok(KindCounts::from_pairs(events.iter().filter_map(
        |(name, n)| TeeKind::from_kernel_name(name).map(|k| (k, *n)),
    )))
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
}
