//! A count per TEE kind: the one number type of the agent's figures (capacity, usage, requests),
//! with the arithmetic the scan and attribution need. Pure.

use std::collections::BTreeMap;
use std::fmt;

use teeguard_shared::TeeKind;
use teeguard_shared::misc::MiscValues;

/// A count per TEE kind (keys, requests, usage). Zero means "none" or "not listed".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KindCounts([u64; 3]);

impl KindCounts {
    /// All zero.
    pub const ZERO: KindCounts = KindCounts([0; 3]);

    fn index(kind: TeeKind) -> usize {
        match kind {
            TeeKind::Tdx => 0,
            TeeKind::Sev => 1,
            TeeKind::SevEs => 2,
        }
    }

    /// Build from `(kind, count)` pairs (later pairs replace earlier ones).
    pub fn from_pairs(pairs: impl IntoIterator<Item = (TeeKind, u64)>) -> Self {
        let mut c = KindCounts::ZERO;
        for (k, v) in pairs {
            c.set(k, v);
        }
        c
    }

    /// The TEE kinds of a parsed misc file (unknown resource names are ignored).
    pub fn from_misc(values: &MiscValues) -> Self {
        KindCounts::from_pairs(values.kinds())
    }

    /// The count for one kind.
    pub fn get(&self, kind: TeeKind) -> u64 {
        self.0[Self::index(kind)]
    }

    /// Set the count for one kind.
    pub fn set(&mut self, kind: TeeKind, value: u64) {
        self.0[Self::index(kind)] = value;
    }

    /// Add another set of counts (saturating).
    pub fn add(&mut self, other: &KindCounts) {
        for i in 0..3 {
            self.0[i] = self.0[i].saturating_add(other.0[i]);
        }
    }

    /// `self - other` per kind, or `None` when `other` is larger for some kind.
    pub fn checked_sub(&self, other: &KindCounts) -> Option<KindCounts> {
        let mut out = KindCounts::ZERO;
        for i in 0..3 {
            out.0[i] = self.0[i].checked_sub(other.0[i])?;
        }
        Some(out)
    }

    /// True when every kind is zero.
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 3]
    }

    /// The non-zero kinds with their counts, in [`TeeKind::ALL`] order.
    pub fn nonzero(&self) -> impl Iterator<Item = (TeeKind, u64)> + '_ {
        TeeKind::ALL
            .into_iter()
            .map(|k| (k, self.get(k)))
            .filter(|(_, v)| *v > 0)
    }

    /// As a map of the non-zero kinds (for JSON/YAML output).
    pub fn to_map(&self) -> BTreeMap<TeeKind, u64> {
        self.nonzero().collect()
    }
}

impl fmt::Display for KindCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (k, v) in self.nonzero() {
            if !first {
                f.write_str(",")?;
            }
            first = false;
            write!(f, "{k}={v}")?;
        }
        if first {
            f.write_str("-")?;
        }
        Ok(())
    }
}
