//! The domain crate's one error type.

use std::path::PathBuf;

use crate::tee::TeeKind;

/// Result with the domain crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the domain crate. Each message names the thing that failed and,
/// where there is one, what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A misc cgroup file could not be read.
    #[error("cannot read {path}: {source}")]
    MiscRead {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A misc cgroup file's content is malformed.
    #[error("{path}:{line}: {reason}")]
    MiscParse {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line.
        reason: String,
    },
    /// No misc cgroup controller under the given cgroup root.
    #[error(
        "no misc cgroup controller under {root}: neither {root}/misc.capacity (cgroup v2) nor \
         {root}/misc/misc.capacity (cgroup v1) exists; mount the host's /sys/fs/cgroup there \
         (kernel 5.13+ with CONFIG_CGROUP_MISC)"
    )]
    MiscControllerNotFound {
        /// The cgroup root that was searched.
        root: PathBuf,
    },
    /// A resource name is not one of the TEE kinds.
    #[error("unknown TEE kind {name:?}: expected one of tdx, sev, sev_es")]
    UnknownTeeKind {
        /// The name given.
        name: String,
    },
    /// A VMI asks for more than one TEE at once.
    #[error(
        "VirtualMachineInstance {namespace}/{name} sets more than one launchSecurity kind ({kinds:?}); \
         a VM can use only one TEE technology: keep one of them"
    )]
    ConflictingTeeKinds {
        /// VMI namespace.
        namespace: String,
        /// VMI name.
        name: String,
        /// The kinds found.
        kinds: Vec<TeeKind>,
    },
    /// A resource quantity on a pod is not a whole number of keys.
    #[error("pod {pod}: {resource} quantity {quantity:?} is not a whole number of keys")]
    BadQuantity {
        /// `namespace/name` of the pod (or `generateName` when the name is not set yet).
        pod: String,
        /// The resource name.
        resource: String,
        /// The quantity as written.
        quantity: String,
    },
    /// The configuration file could not be read.
    #[error("cannot read configuration file {path}: {source}")]
    ConfigRead {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A configuration field is unknown, of the wrong type or has a bad value.
    #[error("configuration{}: field `{field}`: {reason}", source_suffix(.source_name))]
    Config {
        /// Where the configuration came from (a file path), if known.
        source_name: Option<String>,
        /// Dotted path of the field (`resources.tdx.keysPerVm`).
        field: String,
        /// What is wrong and what is expected.
        reason: String,
    },
    /// A value could not be rendered as YAML or JSON.
    #[error("cannot serialise {what}: {reason}")]
    Serialize {
        /// What was being serialised.
        what: &'static str,
        /// The serialiser's message.
        reason: String,
    },
    /// The admin (health/metrics) server could not start or failed.
    #[error("admin server on {addr}: {source}")]
    AdminServer {
        /// The address it was bound to.
        addr: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

fn source_suffix(source: &Option<String>) -> String {
    source.as_ref().map(|s| format!(" {s}")).unwrap_or_default()
}
