//! When a scan may take the pods' last readings instead of reading their files again: the pure rule of
//! the agent mode's "unchanged pods" (the kernel adapter, `kernel::scanner`, does the reading).
//!
//! A pod's usage changes only when a VM in it starts or stops, and the kubepods `misc.current` (read
//! anyway, to prune) is the sum of every pod below it. So a scan reads only the pods of interest that
//! have no reading to reuse (new, not found yet, or whose last read failed) and takes the last
//! readings of the others, but keeps them only when the kubepods total equals exactly those readings
//! plus what the last full read found held outside the pods of interest (pods that request no key,
//! such as exempt VMs). Any difference (a VM started or stopped, a pod left, another cgroup charged or
//! released a key) reads every pod of interest again, as does every [`FULL_READ_EVERY`]th scan, a
//! kubepods file that cannot be read, the first scan, and the scan after a failed charge (`misc.events`:
//! a VM was refused, so the figures may be behind). On a steady host a poll reads no pod file.
//!
//! The totals cannot tell changes that cancel out within one poll interval: one cgroup charging a
//! key of the same kind as another releases one. Kernel usage is still read at every scan; what lags,
//! for at most [`FULL_READ_EVERY`] scans, is the attribution, and with it `pending`: a pod that
//! charged still counts as pending (`free` one lower: conservative), and a pod that released while it
//! lives on (its VM stopped before the pod ended) is not counted as pending (`free` one higher: the
//! key is free in the kernel, but the conservative rule would keep it for the pod until the pod ends).
//! When both happen among the pods of interest the two cancel and `free` is what a full read gives.

use std::collections::HashMap;

use super::counts::KindCounts;

/// Agent mode: every pod of interest is read at least every this many scans (10 s at the default 1 s
/// poll interval), whatever the kubepods total says.
pub const FULL_READ_EVERY: u32 = 10;

/// What the agent mode remembers between scans to decide whether readings may be reused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reuse {
    /// The kubepods usage held outside the pods of interest at the last full read, when it may be
    /// used to skip unchanged pods.
    outside: Option<KindCounts>,
    /// Scans since the last full read of the pods of interest.
    scans_since_full: u32,
    /// A full read is due after this many scans.
    full_read_every: u32,
}

impl Reuse {
    /// Nothing to reuse yet; a full read at least every `full_read_every` scans (at least 1: every
    /// scan).
    pub fn new(full_read_every: u32) -> Self {
        Reuse {
            outside: None,
            scans_since_full: 0,
            full_read_every: full_read_every.max(1),
        }
    }

    /// A scan of the pods of interest begins.
    pub fn scan_started(&mut self) {
        self.scans_since_full = self.scans_since_full.saturating_add(1);
    }

    /// When the pods' last readings may be reused, the keys the kubepods total (`total`, when it could
    /// be read) holds outside the pods of interest: a prediction of the total starts there and adds
    /// each pod's last reading. `None`: read every pod (no total, no full read to start from, or a
    /// full read is due).
    pub fn baseline(&self, total: Option<KindCounts>) -> Option<KindCounts> {
        match (total, self.outside) {
            (Some(_), Some(outside)) if self.scans_since_full < self.full_read_every => {
                Some(outside)
            }
            _ => None,
        }
    }

    /// Every pod of interest was read: `usage` is what they hold, `total` the kubepods total. What the
    /// total holds beyond them (pods that request no key, e.g. exempt VMs) is remembered. Readings
    /// taken at different instants can exceed the total: then nothing is reused until the next full
    /// read.
    pub fn full_read(&mut self, total: Option<KindCounts>, usage: &HashMap<String, KindCounts>) {
        self.scans_since_full = 0;
        self.outside = total.and_then(|t| {
            let mut held = KindCounts::ZERO;
            for c in usage.values() {
                held.add(c);
            }
            t.checked_sub(&held)
        });
    }

    /// Reuse nothing until the next full read (nothing is held below kubepods, or a read stopped
    /// short).
    pub fn forget(&mut self) {
        self.outside = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use teeguard_shared::TeeKind;

    fn tdx(n: u64) -> KindCounts {
        KindCounts::from_pairs([(TeeKind::Tdx, n)])
    }

    #[test]
    fn readings_are_reused_between_full_reads_only_with_a_total_and_a_baseline() {
        let mut r = Reuse::new(3);
        r.scan_started();
        assert_eq!(r.baseline(Some(tdx(4))), None, "no full read yet");
        let usage = HashMap::from([("a".to_string(), tdx(3))]);
        r.full_read(Some(tdx(4)), &usage);
        for _ in 0..2 {
            r.scan_started();
            assert_eq!(r.baseline(Some(tdx(4))), Some(tdx(1)), "one key outside");
            assert_eq!(r.baseline(None), None, "an unreadable total");
        }
        r.scan_started();
        assert_eq!(r.baseline(Some(tdx(4))), None, "a full read is due");
        r.full_read(Some(tdx(2)), &usage);
        r.scan_started();
        assert_eq!(r.baseline(Some(tdx(2))), None, "readings above the total");
        r.full_read(Some(tdx(3)), &usage);
        r.forget();
        r.scan_started();
        assert_eq!(r.baseline(Some(tdx(3))), None, "forgotten");
    }
}
