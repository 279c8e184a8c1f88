//! Stand-in images under KubeVirt's image names, so the launcher pods virt-controller renders run on a
//! real node as they are (no registry is reachable, and no VM can run here):
//!
//! - [`super::Version::launcher_image`] of the release the process runs: busybox with `/usr/bin/virt-launcher-monitor` (the `compute` container)
//!   and `/usr/bin/virt-tail` (the `guest-console-log` sidecar), scripts that sleep until the pod ends,
//!   and `/usr/bin/container-disk`, which the `volumecontainerdisk` init container runs from the launcher
//!   image mounted as an `image` volume (`--no-op`: exits at once), or v1.7/v1.8's init containers copy
//!   with `/usr/bin/cp` into the pod for the containerDisk's containers;
//! - a containerDisk image ([`CONTAINER_DISK`]): a disk file under `/disk`, and busybox's `sh` for the
//!   `container-disk` script (KubeVirt's real binary is static; a real containerDisk has no shell).
//!
//! The scripts trap SIGTERM, so a launcher pod ends at once when it is deleted (as virt-launcher's
//! monitor does) instead of after its 60 s grace period.

use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};

use crate::node::RealNode;

/// The containerDisk image of the sample VMIs (`../shared/kubevirt/vmis/`).
pub const CONTAINER_DISK: &str = "quay.io/containerdisks/fedora:41";

/// A process that sleeps until it is told to stop (SIGTERM or SIGINT), as a pod's PID 1.
const SLEEPER: &str = "#!/bin/sh\n# teeguard test stand-in: sleeps until the pod ends.\n\
    trap 'exit 0' TERM INT\nwhile :; do sleep 3600 & wait $!; done\n";

/// KubeVirt's `container-disk`: with `--no-op` it exits at once (the init container that only checks
/// the image can run); otherwise it sleeps like the others.
const CONTAINER_DISK_SCRIPT: &str = "#!/bin/sh\n# teeguard test stand-in for KubeVirt's container-disk.\n\
    [ \"$1\" = --no-op ] && exit 0\ntrap 'exit 0' TERM INT\nwhile :; do sleep 3600 & wait $!; done\n";

/// coreutils' `cp` as the `container-disk-binary` init container of KubeVirt v1.7/v1.8 runs it
/// (`cp [--preserve=all] /usr/bin/container-disk /init/usr/bin/container-disk`): options dropped,
/// busybox copies.
const CP_SCRIPT: &str = "#!/bin/sh\n# teeguard test stand-in for cp.\nsrc= dst=\n\
    for a in \"$@\"; do case \"$a\" in -*) ;; *) src=$dst; dst=$a ;; esac; done\n\
    exec /bin/busybox cp \"$src\" \"$dst\"\n";

/// Build both images under `dir` and import them into `node`'s runtime.
pub fn import_stand_ins(node: &RealNode, dir: &Path) -> std::io::Result<()> {
    let busybox = busybox()?;
    let launcher = dir.join("virt-launcher");
    rootfs_with_busybox(&launcher, &busybox)?;
    for (name, body) in [
        ("virt-launcher-monitor", SLEEPER),
        ("virt-tail", SLEEPER),
        ("container-disk", CONTAINER_DISK_SCRIPT),
        ("cp", CP_SCRIPT),
    ] {
        script(&launcher.join("usr/bin").join(name), body)?;
    }
    let disk = dir.join("containerdisk");
    rootfs_with_busybox(&disk, &busybox)?;
    std::fs::create_dir_all(disk.join("disk"))?;
    std::fs::write(
        disk.join("disk/disk.img"),
        b"teeguard test stand-in for a VM disk\n",
    )?;
    let launcher_image = super::version().launcher_image();
    for (image, root, entry) in [
        (
            launcher_image.as_str(),
            &launcher,
            "/usr/bin/virt-launcher-monitor",
        ),
        (CONTAINER_DISK, &disk, "/bin/sh"),
    ] {
        node.add_image(image, root, &[entry])
            .map_err(|e| std::io::Error::other(e.to_string()))?;
    }
    Ok(())
}

fn busybox() -> std::io::Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|d| d.join("busybox"))
        .find(|p| p.is_file())
        .ok_or_else(|| std::io::Error::other("busybox not found (Debian busybox-static)"))
}

fn rootfs_with_busybox(root: &Path, busybox: &Path) -> std::io::Result<()> {
    if root.exists() {
        std::fs::remove_dir_all(root)?;
    }
    std::fs::create_dir_all(root.join("bin"))?;
    std::fs::create_dir_all(root.join("usr/bin"))?;
    std::fs::create_dir_all(root.join("tmp"))?;
    std::fs::copy(busybox, root.join("bin/busybox"))?;
    for applet in ["sh", "sleep", "true"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet))?;
    }
    Ok(())
}

fn script(path: &Path, body: &str) -> std::io::Result<()> {
    std::fs::write(path, body)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
}
