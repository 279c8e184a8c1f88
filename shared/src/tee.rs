//! The kinds of TEE key a host hands out, as the kernel's misc cgroup controller names them.

use std::fmt;
use std::str::FromStr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// A kind of TEE key. Each confidential VM holds exactly one key of one kind for its whole life.
///
/// SEV-SNP guests are charged as [`TeeKind::SevEs`]: the kernel has no separate `snp` key.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum TeeKind {
    /// Intel TDX: one HKID per guest. Kernel name `tdx`.
    Tdx,
    /// AMD SEV: one ASID per guest. Kernel name `sev`.
    Sev,
    /// AMD SEV-ES and SEV-SNP: one ES ASID per guest. Kernel name `sev_es`.
    SevEs,
}

impl TeeKind {
    /// Every kind, in a stable order (also the order of reports and tables).
    pub const ALL: [TeeKind; 3] = [TeeKind::Tdx, TeeKind::Sev, TeeKind::SevEs];

    /// The resource name in the kernel's misc cgroup files.
    pub const fn kernel_name(self) -> &'static str {
        match self {
            TeeKind::Tdx => "tdx",
            TeeKind::Sev => "sev",
            TeeKind::SevEs => "sev_es",
        }
    }

    /// The kind for a misc cgroup resource name; `None` for names teeguard does not manage.
    pub fn from_kernel_name(name: &str) -> Option<TeeKind> {
        match name {
            "tdx" => Some(TeeKind::Tdx),
            "sev" => Some(TeeKind::Sev),
            "sev_es" => Some(TeeKind::SevEs),
            _ => None,
        }
    }

    /// The name a person knows the technology by, for messages ("no node can host this TDX VM").
    pub const fn display_name(self) -> &'static str {
        match self {
            TeeKind::Tdx => "TDX",
            TeeKind::Sev => "SEV",
            TeeKind::SevEs => "SEV-ES/SNP",
        }
    }
}

impl fmt::Display for TeeKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kernel_name())
    }
}

impl FromStr for TeeKind {
    type Err = crate::Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TeeKind::from_kernel_name(s).ok_or_else(|| crate::Error::UnknownTeeKind {
            name: s.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_round_trip() {
        for kind in TeeKind::ALL {
            assert_eq!(TeeKind::from_kernel_name(kind.kernel_name()), Some(kind));
            assert_eq!(kind.to_string().parse::<TeeKind>().ok(), Some(kind));
        }
        assert_eq!(TeeKind::from_kernel_name("snp"), None);
        assert_eq!(TeeKind::from_kernel_name("sgx_epc"), None);
        assert!("SEV".parse::<TeeKind>().is_err());
    }

    #[test]
    fn serde_uses_kernel_names() {
        let json = serde_json::to_string(&TeeKind::ALL).expect("serialise kinds");
        assert_eq!(json, r#"["tdx","sev","sev_es"]"#);
    }
}
