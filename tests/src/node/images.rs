//! Images on a [`super::RealNode`] that no registry serves: OCI archives (as `scripts/images.sh` writes
//! them) imported into the runtime's own image store, and extra names for an imported image (an
//! "upgrade" to another tag without another build).

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{KIT, RealNode, Runtime, run};
use crate::controlplane::ci;
use crate::{Error, Result};

/// The environment variable naming the directory of the image archives (`scripts/test.sh` sets it).
pub const IMAGES_ENV: &str = "TEEGUARD_IMAGES";

/// The directory of the image archives `scripts/images.sh` wrote (`TEEGUARD_IMAGES`). `None` (after
/// printing one line) when it is not set and `CI` is not `true`; panics when `CI=true`.
pub fn built_images() -> Option<PathBuf> {
    match std::env::var_os(IMAGES_ENV) {
        Some(dir) => Some(PathBuf::from(dir)),
        None if ci() => {
            panic!("{IMAGES_ENV} is not set and CI=true: scripts/test.sh builds the images first")
        }
        None => {
            eprintln!("skipped: set {IMAGES_ENV} to the output of scripts/images.sh");
            None
        }
    }
}

impl RealNode {
    /// Import the OCI archive `archive` under the name `image` (containerd: `ctr images import` into
    /// the CRI's `k8s.io` namespace, which names it after the archive's `ref.name`; CRI-O: `skopeo copy`
    /// into its containers-storage).
    pub fn import_image(&self, archive: &Path, image: &str) -> Result<()> {
        if !archive.is_file() {
            return Err(KIT.missing(format!(
                "no image archive {} (scripts/images.sh writes it)",
                archive.display()
            )));
        }
        match self.runtime {
            Runtime::Containerd => {
                let mut cmd = self.ctr();
                cmd.args(["images", "import"]).arg(archive);
                run(cmd, &format!("ctr images import {}", archive.display()))?;
                // The archive's own name must be the one asked for.
                self.ctr_images_has(image)
            }
            Runtime::Crio => {
                let mut cmd = Command::new("skopeo");
                cmd.args(["copy", "--insecure-policy", "--quiet"])
                    .arg(format!("oci-archive:{}", archive.display()))
                    .arg(format!("{}{image}", self.crio_store()));
                run(cmd, &format!("skopeo copy {image}"))?;
                Ok(())
            }
        }
    }

    /// Give the imported image `from` the name `to` too.
    pub fn tag_image(&self, from: &str, to: &str) -> Result<()> {
        match self.runtime {
            Runtime::Containerd => {
                let mut cmd = self.ctr();
                cmd.args(["images", "tag", "--force", from, to]);
                run(cmd, &format!("ctr images tag {from} {to}"))?;
                Ok(())
            }
            Runtime::Crio => {
                let store = self.crio_store();
                let mut cmd = Command::new("skopeo");
                cmd.args(["copy", "--insecure-policy", "--quiet"])
                    .arg(format!("{store}{from}"))
                    .arg(format!("{store}{to}"));
                run(cmd, &format!("skopeo copy {from} {to}"))?;
                Ok(())
            }
        }
    }

    fn ctr(&self) -> Command {
        let mut cmd = Command::new(self.bin.join("ctr"));
        cmd.arg("-a").arg(self.cri_socket()).args(["-n", "k8s.io"]);
        cmd
    }

    fn ctr_images_has(&self, image: &str) -> Result<()> {
        let mut cmd = self.ctr();
        cmd.args(["images", "ls", "-q"]);
        let names = run(cmd, "ctr images ls")?;
        if names.lines().any(|l| l.trim() == image) {
            Ok(())
        } else {
            Err(Error::Failed {
                what: format!("real node: import {image}"),
                reason: format!("containerd has no image of that name; it has: {names}"),
            })
        }
    }

    fn crio_store(&self) -> String {
        format!(
            "containers-storage:[vfs@{}+{}]",
            self.dir.join("root").display(),
            self.dir.join("state").display()
        )
    }
}

impl RealNode {
    /// Write a one-layer OCI archive of the directory `rootfs` named `image` (entrypoint `entry`) with
    /// `make-oci-image.py`, into this node's image directory, and import it into the runtime.
    pub fn add_image(&self, image: &str, rootfs: &Path, entry: &[&str]) -> Result<()> {
        let file = image.replace(['/', ':'], "_");
        let archive = self.dir.join("images").join(format!("{file}.tar"));
        let mut cmd = Command::new("python3");
        cmd.arg(self.bin.join("make-oci-image.py"))
            .arg(&archive)
            .arg(image)
            .arg(rootfs)
            .args(entry);
        run(cmd, &format!("make-oci-image.py {image}"))?;
        self.import_image(&archive, image)
    }
}
