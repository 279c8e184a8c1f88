//! The kubelet's plugin interfaces (DRA mode): the registration and `DRAPlugin` gRPC services on unix
//! sockets in the kubelet's directories, their messages, and the checkpoint of prepared claims.

pub mod checkpoint;
pub mod grpc;
pub mod proto;

use std::path::{Path, PathBuf};

use teeguard_shared::names::DRA_DRIVER;

/// Where the driver's sockets and checkpoint live under the kubelet's root directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PluginPaths {
    /// `<kubelet>/plugins_registry/tee.teeguard.dev-reg.sock`: the kubelet's plugin watcher finds it.
    pub registration: PathBuf,
    /// `<kubelet>/plugins/tee.teeguard.dev/dra.sock`: the kubelet calls `DRAPlugin` here.
    pub dra: PathBuf,
    /// `<kubelet>/plugins/tee.teeguard.dev/checkpoint.json`.
    pub checkpoint: PathBuf,
}

impl PluginPaths {
    /// The paths under the kubelet root `kubelet_dir` (`/var/lib/kubelet`).
    pub fn under(kubelet_dir: &Path) -> Self {
        let own = kubelet_dir.join("plugins").join(DRA_DRIVER);
        PluginPaths {
            registration: kubelet_dir
                .join("plugins_registry")
                .join(format!("{DRA_DRIVER}-reg.sock")),
            dra: own.join("dra.sock"),
            checkpoint: own.join("checkpoint.json"),
        }
    }
}
