//! The DRA checkpoint: the claims the agent prepared, kept in a file beside the driver's socket so an
//! agent restart still knows them (the kubelet does not prepare a claim twice, and unprepares it once
//! its pods are gone). Written whole to a temporary file, synced, then renamed over the old one, so a
//! crash leaves either the old or the new content, never a torn file.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::decide::dra::PreparedClaim;
use crate::error::{Error, Result};

/// The file's format version.
const VERSION: u32 = 1;

#[derive(Serialize, Deserialize)]
struct File {
    version: u32,
    /// Claim UID → what was prepared.
    claims: BTreeMap<String, PreparedClaim>,
}

/// The checkpoint file.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    path: PathBuf,
}

impl Checkpoint {
    /// The checkpoint at `path`.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Checkpoint { path: path.into() }
    }

    /// The claims recorded (none when the file does not exist yet).
    pub fn load(&self) -> Result<BTreeMap<String, PreparedClaim>> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
            Err(e) => return Err(self.error(format!("cannot read it: {e}"))),
        };
        let file: File = serde_json::from_str(&text).map_err(|e| {
            self.error(format!(
                "it is not a checkpoint this agent can read ({e}); move it aside: the kubelet \
                 prepares its claims again for pods not started yet"
            ))
        })?;
        if file.version != VERSION {
            return Err(self.error(format!(
                "format version {} is not {VERSION}: written by another agent version",
                file.version
            )));
        }
        Ok(file.claims)
    }

    /// Replace the recorded claims with `claims`.
    pub fn save(&self, claims: &BTreeMap<String, PreparedClaim>) -> Result<()> {
        let body = serde_json::to_vec_pretty(&File {
            version: VERSION,
            claims: claims.clone(),
        })
        .map_err(|e| self.error(format!("cannot encode it: {e}")))?;
        let tmp = self.path.with_extension("json.tmp");
        let write = || -> std::io::Result<()> {
            if let Some(dir) = self.path.parent() {
                std::fs::create_dir_all(dir)?;
            }
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&body)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &self.path)?;
            if let Some(dir) = self.path.parent() {
                std::fs::File::open(dir)?.sync_all()?;
            }
            Ok(())
        };
        write().map_err(|e| self.error(format!("cannot write it: {e}")))
    }

    fn error(&self, reason: String) -> Error {
        Error::Checkpoint {
            path: self.path.clone(),
            reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decide::dra::AllocatedDevice;

    fn claim() -> PreparedClaim {
        PreparedClaim {
            namespace: "vms".into(),
            name: "virt-launcher-a-extended-resources-x".into(),
            pods: vec!["pod-uid".into()],
            devices: vec![AllocatedDevice {
                request: "container-0-request-0".into(),
                pool: "node-a".into(),
                device: "tdx-0".into(),
            }],
        }
    }

    #[test]
    fn saved_claims_are_read_back_and_a_missing_file_is_empty() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cp = Checkpoint::new(dir.path().join("sub/checkpoint.json"));
        assert!(cp.load().expect("missing is empty").is_empty());
        let claims = BTreeMap::from([("uid-1".to_string(), claim())]);
        cp.save(&claims).expect("save");
        assert_eq!(cp.load().expect("load"), claims);
        cp.save(&BTreeMap::new()).expect("save empty");
        assert!(cp.load().expect("load").is_empty());
        assert!(!dir.path().join("sub/checkpoint.json.tmp").exists());
    }

    #[test]
    fn a_torn_or_foreign_file_is_an_error_that_names_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("checkpoint.json");
        std::fs::write(&path, "{\"version\": 1, \"claims\": {").expect("write");
        let e = Checkpoint::new(&path).load().expect_err("torn");
        assert!(e.to_string().contains("checkpoint.json"), "{e}");
        std::fs::write(&path, "{\"version\": 9, \"claims\": {}}").expect("write");
        let e = Checkpoint::new(&path).load().expect_err("foreign");
        assert!(e.to_string().contains("version 9"), "{e}");
    }
}
