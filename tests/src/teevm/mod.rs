//! A real Linux misc cgroup controller for tests: Debian 12's own kernels booted under QEMU with the
//! `../shared/tee-vm` kit (read its README), prepared by `scripts/tee-vm.sh` under the directory named
//! by `TEEGUARD_TEE_VM` (one `TEEVM_HOME` per kernel: `6.1/`, `6.12/`).
//!
//! - The guest: busybox initramfs, cgroup v2 with the misc controller, the kit's `fake_tee` module
//!   (`insmod /opt/tee/fake_tee.ko sev=N sev_es=M` sets `misc.capacity`; each open file of
//!   `/dev/fake_tee` asked for a key is charged to the caller's misc cgroup exactly as KVM charges an
//!   SEV ASID), `holdkeys` as the confidential VM, `cgwrite` for one `write(2)` with its errno.
//! - [`Guest`] boots one guest and keeps it for several checks: requests (shell scripts) go in through
//!   the kit's 9p share and run in order; background processes (VMs, the agent) write their output into
//!   the share, where the test reads it live. The release `teeguard-agent` with the libraries it links
//!   (laid out by `scripts/image-root.sh`) and the kit's runc are copied into the guest's root when
//!   asked for.
//! - Network: none, or QEMU's user-mode network with `restrict=on` and one `guestfwd` from
//!   [`API_ADDRESS`] in the guest to a port on the host's 127.0.0.1 (the real control plane's API
//!   server): no other route, no other address.
//! - Without the kit (or qemu), the tests skip with one line; with `CI=true` they fail instead.

mod guest;
pub mod oci;
mod runc;
pub mod shell;

use std::path::{Path, PathBuf};

pub use guest::{Guest, GuestOptions, Output, Spawned};
pub use runc::Container;

use crate::error::{self, Component, Error, Result};

/// The environment variable naming the prepared kit (`scripts/tee-vm.sh` sets it).
pub const ENV: &str = "TEEGUARD_TEE_VM";

/// Where the agent is in a guest booted with [`GuestOptions::agent`] (where `scripts/image-root.sh`
/// puts it).
pub const AGENT: &str = "/usr/local/bin/teeguard-agent";

/// The address the guest reaches the forwarded host port at (QEMU's user-mode network).
pub const API_ADDRESS: &str = "10.0.2.100:6443";

/// What to do when the kit is missing.
const HOW_TO: &str = "run `source scripts/tee-vm.sh` as root (it prepares ../shared/tee-vm for Linux \
    6.1 and 6.12 under .tools/tee-vm and sets TEEGUARD_TEE_VM); scripts/test.sh does this";

/// This harness's component, as its errors name it.
pub(crate) const KIT: Component = Component {
    name: "tee-vm kit",
    how_to: HOW_TO,
};

/// The two kernels the tests run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// Debian 12's default kernel, Linux 6.1: no root `misc.current` (like RHEL 9's 5.14 that
    /// OpenShift Virtualization runs), no `misc.peak`, no `misc.events.local`.
    Linux6_1,
    /// Debian 12's 6.12 line: root `misc.current` and `misc.peak`, `misc.events.local`.
    Linux6_12,
}

impl Kernel {
    /// Both, oldest first.
    pub const ALL: [Kernel; 2] = [Kernel::Linux6_1, Kernel::Linux6_12];

    /// The kit's state directory for this kernel, below `TEEGUARD_TEE_VM`.
    pub fn dir_name(self) -> &'static str {
        match self {
            Kernel::Linux6_1 => "6.1",
            Kernel::Linux6_12 => "6.12",
        }
    }

    /// Whether the root cgroup has `misc.current` (and `misc.peak`).
    pub fn root_current(self) -> bool {
        self == Kernel::Linux6_12
    }

    /// Whether non-root cgroups have `misc.peak` and `misc.events.local`.
    pub fn peak_and_local_events(self) -> bool {
        self == Kernel::Linux6_12
    }
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Linux {}", self.dir_name())
    }
}

/// One kernel's prepared kit: its kernel, initramfs (with `fake_tee.ko`, `holdkeys`, `cgwrite`) and
/// runc tree.
#[derive(Clone, Debug)]
pub struct Kit {
    /// The kernel.
    pub kernel: Kernel,
    /// Its `TEEVM_HOME`.
    pub home: PathBuf,
    /// The kernel's release (`uname -r` in the guest).
    pub kver: String,
}

impl Kit {
    /// The kit for `kernel`, or `None` after printing one line when it is missing and `CI` is not
    /// `true`; panics when `CI=true` and it is missing.
    pub fn get(kernel: Kernel) -> Option<Kit> {
        Kit::find(kernel).map_or_else(error::skip, Some)
    }

    /// The kit for `kernel` under `TEEGUARD_TEE_VM`, checked: its files exist and qemu is installed.
    pub fn find(kernel: Kernel) -> Result<Kit> {
        let root = KIT.dir_from(ENV)?;
        let home = root.join(kernel.dir_name());
        let build = home.join("build");
        for file in [
            "vmlinux",
            "initramfs.cpio",
            "KVER",
            "runc-root",
            "bb/bin/busybox",
        ] {
            if !build.join(file).exists() {
                return Err(KIT.missing(format!("{} does not exist", build.join(file).display())));
            }
        }
        if !on_path("qemu-system-x86_64") {
            return Err(
                KIT.missing("qemu-system-x86_64 is not installed (Debian: qemu-system-x86)")
            );
        }
        let kver = std::fs::read_to_string(build.join("KVER"))
            .map_err(KIT.io(format!("read {}", build.join("KVER").display())))?
            .trim()
            .to_string();
        Ok(Kit { kernel, home, kver })
    }

    /// A file of the kit's `build/` directory.
    pub fn build_file(&self, name: &str) -> PathBuf {
        self.home.join("build").join(name)
    }
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
}

/// Lay out `bin` and the libraries it links under `root` with `scripts/image-root.sh` (as the images
/// do), so that it runs in a guest whose own root holds only busybox.
fn image_root(bin: &Path, root: &Path) -> Result<()> {
    let script = crate::e2e::workspace_root().join("scripts/image-root.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .arg(bin)
        .arg(root)
        .output()
        .map_err(KIT.io(format!("run {}", script.display())))?;
    if !out.status.success() {
        return Err(Error::AgentBinary(format!(
            "{} {} failed: {}{}",
            script.display(),
            bin.display(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(())
}
