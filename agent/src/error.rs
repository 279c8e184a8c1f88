//! The agent's one error type.

use std::path::PathBuf;

/// Result with the agent's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the agent. Each message names the thing that failed and, where
/// there is one, what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A domain-crate error: a misc file that cannot be read or parsed, a bad configuration file, ...
    #[error(transparent)]
    Shared(#[from] teeguard_shared::Error),

    /// A cgroup directory could not be listed.
    #[error("cannot list cgroup directory {path}: {source}")]
    CgroupList {
        /// The directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// A pod cgroup's `misc.current` could not be read.
    #[error("cannot read pod cgroup file {path}: {source}")]
    PodCgroupRead {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },

    /// A call to the Kubernetes API failed.
    #[error("Kubernetes API: {operation} failed: {source}")]
    Kube {
        /// What the agent was doing (`apply TeeCapacity status`).
        operation: &'static str,
        /// The client error.
        #[source]
        source: Box<kube::Error>,
    },

    /// A call to the Kubernetes API did not answer in time.
    #[error("Kubernetes API: {operation} timed out after {after:?}; will retry")]
    KubeTimeout {
        /// What the agent was doing.
        operation: &'static str,
        /// The time limit.
        after: std::time::Duration,
    },

    /// The agent's Node does not exist (yet).
    #[error(
        "Node {node:?} not found: check --node-name / NODE_NAME (it must be the Kubernetes node name, \
         set from spec.nodeName via the downward API)"
    )]
    NodeNotFound {
        /// The node name.
        node: String,
    },

    /// A file of pods given to `teeguard-agent scan --pods` could not be used.
    #[error("pods file {path}: {reason}")]
    PodsFile {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },

    /// An inotify watcher could not be set up (the agent then notices changes at its next poll).
    #[error(
        "cannot set up inotify to watch {what}: {source}; raise fs.inotify.max_user_instances if it is exhausted"
    )]
    Watch {
        /// What was to be watched.
        what: &'static str,
        /// The error.
        source: std::io::Error,
    },

    /// Output could not be rendered.
    #[error("cannot render {what}: {reason}")]
    Render {
        /// What was being rendered.
        what: &'static str,
        /// The serialiser's message.
        reason: String,
    },

    /// A kubelet plugin socket (DRA mode) could not be set up.
    #[error(
        "cannot {action} the kubelet plugin socket {path}: {source}; check that the kubelet's plugin \
         directories are mounted writable into the agent (the chart's agent.kubeletDir)"
    )]
    PluginSocket {
        /// The socket.
        path: PathBuf,
        /// What was being done.
        action: &'static str,
        /// The OS error.
        source: std::io::Error,
    },

    /// The DRA checkpoint (which claims the agent prepared) could not be read or written.
    #[error("DRA checkpoint {path}: {reason}")]
    Checkpoint {
        /// The file.
        path: PathBuf,
        /// What went wrong and what to do.
        reason: String,
    },

    /// A length in the NRI stream beyond the protocol's maximum: the stream is out of step, and the
    /// plugin closes it and registers again.
    #[error("NRI stream: {what} of {len} bytes exceeds the maximum of {max}")]
    FrameTooLong {
        /// Which length (`mux frame`, `ttrpc message`).
        what: &'static str,
        /// The length announced.
        len: usize,
        /// The maximum.
        max: usize,
    },

    /// A blocking task (the cgroup scan) panicked or was cancelled.
    #[error("background task failed: {0}")]
    Task(String),
}

impl Error {
    /// Wrap a kube client error with the operation that failed.
    pub fn kube(operation: &'static str, source: kube::Error) -> Error {
        Error::Kube {
            operation,
            source: Box::new(source),
        }
    }

    /// The HTTP status code of a Kubernetes API error reply, if this is one.
    pub fn api_code(&self) -> Option<u16> {
        match self {
            Error::Kube { source, .. } => match source.as_ref() {
                kube::Error::Api(status) => Some(status.code),
                _ => None,
            },
            _ => None,
        }
    }
}
