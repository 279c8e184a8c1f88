//! Agent mode: kept-open files and unchanged pods.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

use pretty_assertions::assert_eq;
use teeguard_shared::TeeKind;

use super::*;
use crate::decide::attribution::Accounting;
use crate::decide::host::Interest;
use crate::decide::reuse::FULL_READ_EVERY;
use crate::kernel::files::READ_CHUNK;
use crate::kernel::scanner::tests::{scanned, write};
// Kept-open files (agent mode).

const A: &str = "aaaaaaaa-2222-3333-4444-555555555555";
const B: &str = "bbbbbbbb-2222-3333-4444-555555555555";
const C: &str = "cccccccc-2222-3333-4444-555555555555";

/// A pod's `misc.current`, relative to the root (v2/systemd), in a QoS slice or not (guaranteed).
fn pod_file(uid: &str, qos: Option<&str>) -> String {
    let uid_ = uid.replace('-', "_");
    match qos {
        Some(q) => {
            format!("kubepods.slice/kubepods-{q}.slice/kubepods-{q}-pod{uid_}.slice/misc.current")
        }
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

fn all_three() -> Uids {
    [A, B, C].map(String::from).into_iter().collect()
}

fn tdx(n: u64) -> KindCounts {
    KindCounts::from_pairs([(TeeKind::Tdx, n)])
}

/// Scan with `s` (keeping files open) and with a new scanner (opening every file), check both agree
/// and return the pods.
fn scan_both(s: &mut Scanner, interest: &Uids) -> PodScan {
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

    let only_a: Uids = [A.to_string()].into_iter().collect();
    assert_eq!(scan_both(&mut s, &only_a).pods_read, 1);
    assert_eq!(s.open_pod_files(), 1);
    assert_eq!(s.known.keys().collect::<Vec<_>>(), vec![A]);
    scan_both(&mut s, &Uids::default());
    assert_eq!(s.open_pod_files(), 0);
    assert!(s.known.is_empty());
    scan_both(&mut s, &all_three());
    assert_eq!(s.open_pod_files(), 3);

    // Pruned also when the scan stops before the pods (no TEE capacity left).
    write(r, "misc.capacity", "");
    let scan = scanned(s.scan(Interest::Only(&only_a)).expect("scan"));
    assert!(scan.pods.is_none());
    assert_eq!(s.open_pod_files(), 1);
    s.scan(Interest::Only(&Uids::default())).expect("scan");
    assert_eq!(s.open_pod_files(), 0);

    write(r, "misc.capacity", "tdx 16\n");
    // Never more than MAX_KEPT_FILES, however many pods request keys; the others are still read.
    let many: Uids = (0..MAX_KEPT_FILES + 8)
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
    let fewer: Uids = many.iter().take(100).cloned().collect();
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

fn interest(uids: &[&str]) -> Uids {
    uids.iter().map(|u| u.to_string()).collect()
}

/// One scan: (pods read, pods taken as unchanged, usage).
fn agent_scan(s: &mut Scanner, set: &Uids) -> (usize, usize, HashMap<String, KindCounts>) {
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

/// Changes the totals cannot show (see `crate::decide::reuse`): a pod releases a key while a cgroup
/// that is not read charges one. The stale reading lasts until the next full read.
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
