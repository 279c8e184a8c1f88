//! The test kit's one error type: every harness (the fake API server, the simulated host, the real
//! control plane, node, KubeVirt and tee-vm guest, the NRI runtime, the standalone mode) fails with an
//! [`Error`] that names what failed and, where there is one, what to do.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::fakeapi::ApiStatus;
use crate::nri::ttrpc::{FRAME_PAYLOAD_MAX, MESSAGE_LENGTH_MAX};
use crate::teevm::Kernel;

/// A failure of the test kit.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    // --- Shared by the harnesses of real components.
    /// A real component or kit the tests need is missing (the tests skip, unless `CI=true`).
    #[error("no {kit}: {reason}; {how_to}")]
    Missing {
        /// The component (`real node`, `KubeVirt`, ...).
        kit: &'static str,
        /// What is missing.
        reason: String,
        /// How to provide it.
        how_to: &'static str,
    },
    /// A file, socket or process operation failed.
    #[error("{component}: cannot {what}: {source}")]
    Io {
        /// The harness (`real node`, `simulated host`, ...).
        component: &'static str,
        /// What was attempted, on what.
        what: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// A command ran and failed.
    #[error("{command} failed ({status}): {output}")]
    Command {
        /// The command line.
        command: String,
        /// Its exit status.
        status: String,
        /// Its output.
        output: String,
    },
    /// A component did not come up, or something did not happen in time; its logs say why.
    #[error("{component}: {what}; logs in {}", logs.display())]
    NotReady {
        /// The harness.
        component: &'static str,
        /// What did not happen.
        what: String,
        /// The log directory.
        logs: PathBuf,
    },
    /// A request (to an API server, a webhook, a client set-up) failed or its answer did not fit.
    #[error("{what}: {reason}")]
    Failed {
        /// What was asked.
        what: String,
        /// What went wrong.
        reason: String,
    },
    /// A wait passed its deadline.
    #[error("timed out after {after:?} waiting for {what}{}", log.as_ref().map(|l| format!("; log:\n{l}")).unwrap_or_default())]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long it was awaited.
        after: Duration,
        /// The log of the process concerned, if any.
        log: Option<String>,
    },
    /// Certificates could not be made.
    #[error("certificates: {0}")]
    Certs(#[from] teeguard_certs::Error),
    /// The webhook (run in process) failed.
    #[error("webhook: {0}")]
    Webhook(#[from] teeguard_webhook::Error),
    /// The agent (run in process) failed.
    #[error("agent: {0}")]
    Agent(#[from] teeguard_agent::Error),

    // --- Protobuf definitions (`proto`).
    /// A `.proto` file could not be read or compiled.
    #[error("compiling {path}: {message}")]
    Compile {
        /// The file.
        path: PathBuf,
        /// protox's diagnostic (line and column included).
        message: String,
    },
    /// A message, enum or service the file does not define.
    #[error("{path} defines no {what} {name}")]
    UnknownDefinition {
        /// The file.
        path: PathBuf,
        /// `message`, `enum`, `enum value` or `service`.
        what: &'static str,
        /// The name asked for.
        name: String,
    },
    /// A JSON value that does not fit the message.
    #[error("encoding {message} from {json}: {error}")]
    Encode {
        /// The message type.
        message: String,
        /// The JSON given.
        json: String,
        /// What does not fit.
        error: String,
    },
    /// Bytes that are not a valid encoding of the message.
    #[error("decoding {message}: {error}")]
    Decode {
        /// The message type.
        message: String,
        /// What is wrong.
        error: String,
    },

    // --- teeguard's processes (`e2e`).
    /// The binaries could not be found or built.
    #[error("teeguard binaries: {0}")]
    Binaries(String),
    /// A process could not be started.
    #[error("cannot start {name} ({program}): {source}")]
    Spawn {
        /// Process name.
        name: String,
        /// Program path.
        program: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A process exited while it was expected to run.
    #[error("{name} exited ({status}) before {what}; its log:\n{log}")]
    Exited {
        /// Process name.
        name: String,
        /// Exit status.
        status: String,
        /// What was awaited.
        what: String,
        /// Its output.
        log: String,
    },
    /// The configuration is invalid.
    #[error("configuration: {0}")]
    Config(String),

    // --- The NRI runtime (`nri`).
    /// No plugin completed registration in time.
    #[error("timed out waiting for the plugin to register on {socket}")]
    RegisterTimeout {
        /// The runtime's socket.
        socket: PathBuf,
    },
    /// A call needs a registered plugin and there is none.
    #[error("no NRI plugin is registered on {socket}")]
    NotRegistered {
        /// The runtime's socket.
        socket: PathBuf,
    },
    /// The plugin answered with a failed ttrpc status.
    #[error("plugin answered {method} with ttrpc status {code}: {message}")]
    Status {
        /// The method called.
        method: String,
        /// gRPC code.
        code: i32,
        /// Status message.
        message: String,
    },
    /// The plugin did not answer within the request timeout (the runtime then closed it).
    #[error(
        "plugin did not answer {method} within the {timeout:?} request timeout; the runtime closed its connection"
    )]
    RequestTimeout {
        /// The method called.
        method: String,
        /// The request timeout.
        timeout: Duration,
    },
    /// The plugin connection closed before the answer came.
    #[error("the plugin connection closed before the plugin answered {method}")]
    Disconnected {
        /// The method called.
        method: String,
    },
    /// A request larger than ttrpc allows.
    #[error("{method} request of {len} bytes exceeds ttrpc's {MESSAGE_LENGTH_MAX}-byte limit")]
    TooLarge {
        /// The method.
        method: String,
        /// Encoded size.
        len: usize,
    },
    /// A frame announcing more than [`FRAME_PAYLOAD_MAX`] bytes.
    #[error(
        "frame on connection {conn} announces {len} bytes, more than the {FRAME_PAYLOAD_MAX} allowed"
    )]
    FrameTooLarge {
        /// Connection id of the frame.
        conn: u32,
        /// Announced payload length.
        len: u32,
    },
    /// A ttrpc message announcing more than [`MESSAGE_LENGTH_MAX`] bytes.
    #[error(
        "ttrpc message on connection {conn} announces {len} bytes, more than the {MESSAGE_LENGTH_MAX} allowed"
    )]
    MessageTooLarge {
        /// Connection id.
        conn: u32,
        /// Announced length.
        len: u32,
    },
    /// A ttrpc request or response that is not valid protobuf.
    #[error("malformed ttrpc {what}: {message}")]
    Envelope {
        /// `request` or `response`.
        what: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The stream ended inside a frame.
    #[error("the stream ended inside a frame")]
    Truncated,

    // --- The simulated host (`host`).
    /// The cgroup does not exist in the simulated tree.
    #[error("simulated host: no cgroup {0:?}; create it first (add_pod, add_external, add_cgroup)")]
    UnknownCgroup(String),
    /// No pod with this UID was added.
    #[error("simulated host: no pod with uid {0}; add it with SimHost::add_pod first")]
    UnknownPod(String),
    /// The pod has no container of this name.
    #[error("simulated host: pod {uid} has no container {container:?}")]
    UnknownContainer {
        /// Pod UID.
        uid: String,
        /// Container name.
        container: String,
    },
    /// A pod, external consumer or cgroup with this identity already exists.
    #[error("simulated host: {0} already exists")]
    AlreadyExists(String),
    /// The kernel refused the charge (`EBUSY`): a `misc.max` or the capacity would be exceeded.
    #[error(
        "simulated host: charge of {amount} {resource} in cgroup {cgroup:?} refused at {failed_at:?}: \
         usage would be {would_be}, limit {limit} (EBUSY)"
    )]
    ChargeRefused {
        /// The cgroup the charge was made in.
        cgroup: String,
        /// Resource name.
        resource: String,
        /// How many were requested.
        amount: u64,
        /// The level that refused it (`""` = the root, i.e. the host is full).
        failed_at: String,
        /// The usage the refusing level would have reached.
        would_be: u64,
        /// That level's limit (its `misc.max` or the capacity, whichever is lower).
        limit: u64,
    },
    /// An uncharge asked for more than was charged in that cgroup.
    #[error(
        "simulated host: cannot release {amount} {resource} from cgroup {cgroup:?}: only {charged} charged there"
    )]
    NotCharged {
        /// The cgroup.
        cgroup: String,
        /// Resource name.
        resource: String,
        /// How many were to be released.
        amount: u64,
        /// How many the cgroup holds itself.
        charged: u64,
    },
    /// The kernel answered `EINVAL`: a charge or a `misc.max` of a resource whose capacity is 0 (its
    /// `misc_cg_try_charge` checks the capacity before walking the cgroups, so no `misc.events` counts
    /// it; seen on Linux 6.1 and 6.12 with `fake_tee`).
    #[error(
        "simulated host: {what} of {resource:?} in cgroup {cgroup:?} refused: its capacity is 0 (EINVAL)"
    )]
    Invalid {
        /// A charge or a `misc.max` write.
        what: &'static str,
        /// The cgroup.
        cgroup: String,
        /// Resource name.
        resource: String,
    },
    /// The misc controller is not enabled in that cgroup (writing `misc.max` fails like on a real host).
    #[error("simulated host: misc controller not available in cgroup {0:?} (not delegated)")]
    MiscNotEnabled(String),
    /// The resource was never given a capacity (the simulated kernel does not know it).
    #[error(
        "simulated host: resource {0:?} unknown to the simulated kernel; call set_capacity first"
    )]
    UnknownMiscResource(String),
    /// The requested combination is not modelled.
    #[error("simulated host: {0}")]
    Unsupported(&'static str),

    // --- The tee-vm guest (`teevm`).
    /// The guest did not come up, did not answer or failed a request; the console log says more.
    #[error("tee-vm guest ({kernel}): {what}; console log: {}", console.display())]
    Guest {
        /// The kernel.
        kernel: Kernel,
        /// What went wrong.
        what: String,
        /// The guest's console log.
        console: PathBuf,
    },
    /// The release agent binary the guest runs could not be had.
    #[error("tee-vm: the release teeguard-agent: {0}")]
    AgentBinary(String),

    // --- The fake API server (`fakeapi`).
    /// The operation failed the way the real API server would fail it.
    #[error("fake API server refused the operation: {0}")]
    Refused(ApiStatus),
    /// The resource name is not in the resource table; register it with
    /// [`FakeApiServer::register_resource`](crate::fakeapi::FakeApiServer::register_resource).
    #[error(
        "unknown resource {0:?}: use a registered plural such as \"pods\" or \"events.events.k8s.io\", or register it"
    )]
    UnknownResource(String),
    /// The object could not be turned into JSON or lacks `apiVersion`/`kind`.
    #[error("invalid object: {0}")]
    InvalidObject(String),
    /// Binding or serving the TCP listener failed.
    #[error("serving the fake API server on {addr}: {source}; is the port free?")]
    Serve {
        /// The address being bound.
        addr: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// Writing a kubeconfig or building a client from it failed.
    #[error("kubeconfig for the fake API server: {0}")]
    Kubeconfig(String),

    // --- The standalone mode and its API-server driver (`standalone`).
    /// The webhook's port could not be reached.
    #[error("cannot connect to the webhook at {addr}: {source}")]
    Connect {
        /// Where.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The TLS handshake with the webhook failed (wrong CA, wrong name, server gone).
    #[error("TLS handshake with the webhook at {addr} failed: {source}")]
    Tls {
        /// Where.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An HTTP exchange failed below the application level.
    #[error("HTTP {method} {url} failed: {reason}")]
    Http {
        /// Method.
        method: &'static str,
        /// Target.
        url: String,
        /// Why.
        reason: String,
    },
    /// The webhook answered with an HTTP error instead of an AdmissionReview.
    #[error("the webhook answered POST {path} with HTTP {status}: {body}")]
    HttpStatus {
        /// Endpoint.
        path: String,
        /// HTTP status.
        status: u16,
        /// Response body (trimmed).
        body: String,
    },
    /// The webhook's answer is not a usable AdmissionReview.
    #[error("the webhook's answer on {path} is not a valid AdmissionReview response: {reason}")]
    BadReply {
        /// Endpoint.
        path: String,
        /// Why.
        reason: String,
    },
    /// The patch returned by `/mutate` does not apply to the object it was computed for.
    #[error("the JSON patch from /mutate does not apply to pod {pod}: {reason}")]
    Patch {
        /// Pod (namespace/name or generateName).
        pod: String,
        /// Why.
        reason: String,
    },
    /// A port the standalone needs is taken.
    #[error(
        "cannot listen on {addr}: the port is in use (another teeguard-standalone?). \
         Pick another one with --port <N>, or --port 0 for any free port"
    )]
    PortInUse {
        /// The address.
        addr: SocketAddr,
    },
    /// Start-up of a component failed for another reason.
    #[error("{what}: {reason}")]
    Startup {
        /// Which component.
        what: &'static str,
        /// Why.
        reason: String,
    },
}

impl Error {
    /// [`Error::Failed`]: what was asked and why it failed.
    pub fn failed(what: impl Into<String>, reason: impl std::fmt::Display) -> Self {
        Self::Failed {
            what: what.into(),
            reason: reason.to_string(),
        }
    }

    /// For a refused charge of the simulated host: the level that refused it (`""`: the root), the
    /// usage it would have reached and its limit.
    pub fn refusal(&self) -> Option<(&str, u64, u64)> {
        match self {
            Self::ChargeRefused {
                failed_at,
                would_be,
                limit,
                ..
            } => Some((failed_at, *would_be, *limit)),
            _ => None,
        }
    }

    /// The HTTP code of a [`Error::Refused`] error.
    pub fn code(&self) -> Option<u16> {
        match self {
            Self::Refused(s) => Some(s.code),
            _ => None,
        }
    }
}

impl From<ApiStatus> for Error {
    fn from(s: ApiStatus) -> Self {
        Self::Refused(s)
    }
}

/// The test kit's result.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A real component a harness runs (the control plane, a node, KubeVirt, the tee-vm guest): the name
/// its errors carry and how to provide it when it is missing.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Component {
    /// The name errors carry (`real node`, `KubeVirt`, ...).
    pub name: &'static str,
    /// How to provide it.
    pub how_to: &'static str,
}

impl Component {
    /// [`Error::Missing`]: the tests skip, unless `CI=true`.
    pub fn missing(self, reason: impl Into<String>) -> Error {
        Error::Missing {
            kit: self.name,
            reason: reason.into(),
            how_to: self.how_to,
        }
    }

    /// Maps an I/O error to [`Error::Io`] of this component, saying what was attempted.
    pub fn io(self, what: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        io(self.name, what)
    }

    /// The harness a test binary shares, in `cell`: started by `start` on first use, on a thread of its
    /// own (a test's tokio runtime cannot block on another runtime). Later calls get the same result:
    /// the harness, or (as [`skip`]) `None` when its kit is missing, or a panic when it did not start.
    pub fn start_once<T: Send + Sync>(
        self,
        cell: &'static std::sync::OnceLock<Result<T>>,
        start: impl FnOnce() -> Result<T> + Send,
    ) -> Option<&'static T> {
        let got = cell.get_or_init(|| {
            std::thread::scope(|s| {
                s.spawn(start)
                    .join()
                    .unwrap_or_else(|_| Err(Error::failed(self.name, "its start-up panicked")))
            })
        });
        match got {
            Ok(harness) => Some(harness),
            Err(e) => skip_for(e),
        }
    }

    /// A new state directory `<temp>/<prefix>XXXX` with the subdirectories `subdirs`, kept after the
    /// test process ends (its logs are read after a failure).
    pub fn state_dir(self, prefix: &str, subdirs: &[&str]) -> Result<std::path::PathBuf> {
        let dir = temp_dir(self.name, prefix)?.keep();
        for sub in subdirs {
            std::fs::create_dir_all(dir.join(sub)).map_err(self.io(format!("create {sub}/")))?;
        }
        Ok(dir)
    }

    /// The directory the environment variable `env` names (where the kit was built or unpacked).
    pub fn dir_from(self, env: &str) -> Result<std::path::PathBuf> {
        std::env::var_os(env)
            .map(std::path::PathBuf::from)
            .ok_or_else(|| self.missing(format!("{env} is not set")))
    }

    /// [`Error::Missing`] unless this test process runs as root (`why`: what needs it).
    pub fn needs_root(self, why: &str) -> Result<()> {
        if running_as_root() {
            Ok(())
        } else {
            Err(self.missing(format!("{why}; this test process is not root")))
        }
    }

    /// The kit's `files`: in `source` when all are there as they are; otherwise all of them copied or
    /// (`<file>.xz`) unpacked into `unpack`, those `executable` names made executable.
    pub fn files(
        self,
        source: &std::path::Path,
        unpack: &std::path::Path,
        files: &[&str],
        executable: impl Fn(&str) -> bool,
    ) -> Result<std::path::PathBuf> {
        if files.iter().all(|f| source.join(f).is_file()) {
            return Ok(source.to_path_buf());
        }
        std::fs::create_dir_all(unpack).map_err(self.io(format!("create {}", unpack.display())))?;
        for f in files {
            let out = unpack.join(f);
            if source.join(f).is_file() {
                std::fs::copy(source.join(f), &out).map_err(self.io(format!("copy {f}")))?;
            } else {
                self.unxz(&source.join(format!("{f}.xz")), &out)?;
            }
            if executable(f) {
                self.make_executable(&out)?;
            }
        }
        Ok(unpack.to_path_buf())
    }

    /// Unpack the kit's compressed file `xz` into `out` (`xz -dc`, Debian package xz-utils).
    pub fn unxz(self, xz: &std::path::Path, out: &std::path::Path) -> Result<()> {
        let file =
            std::fs::File::create(out).map_err(self.io(format!("create {}", out.display())))?;
        let command = format!("xz -dc {}", xz.display());
        let status = std::process::Command::new("xz")
            .arg("-dc")
            .arg(xz)
            .stdout(file)
            .status()
            .map_err(self.io(format!("run {command} (Debian package xz-utils)")))?;
        if !status.success() {
            return Err(Error::Command {
                command,
                status: status.to_string(),
                output: String::new(),
            });
        }
        Ok(())
    }

    /// Make the kit's file `p` executable (mode 755).
    pub fn make_executable(self, p: &std::path::Path) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755))
            .map_err(self.io(format!("chmod {}", p.display())))
    }
}

/// For a harness a test could not have: `None`, after one line saying what is missing, when a kit is
/// missing and `CI` is not `true` (the test skips); panics otherwise.
pub(crate) fn skip<T>(e: Error) -> Option<T> {
    skip_for(&e)
}

fn skip_for<T>(e: &Error) -> Option<T> {
    match e {
        Error::Missing {
            kit,
            reason,
            how_to,
        } if !crate::controlplane::ci() => {
            eprintln!("skipped: no {kit} ({reason}); {how_to}");
            None
        }
        e => panic!("{e}"),
    }
}

/// Maps an I/O error to [`Error::Io`] of `component`, saying what was attempted.
pub(crate) fn io(
    component: &'static str,
    what: impl Into<String>,
) -> impl FnOnce(std::io::Error) -> Error {
    let what = what.into();
    move |source| Error::Io {
        component,
        what,
        source,
    }
}

/// Maps an I/O error to [`Error::Io`] of `component`: `op` (`create`, `write`, ...) on `path` failed.
pub(crate) fn io_at(
    component: &'static str,
    op: &str,
    path: &std::path::Path,
) -> impl FnOnce(std::io::Error) -> Error {
    io(component, format!("{op} {}", path.display()))
}

/// Whether this test process runs as root (its real UID, from `/proc/self/status`).
pub fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .map(|l| l.split_whitespace().next() == Some("0"))
        })
        .unwrap_or(false)
}

/// A new temporary directory `<temp>/<prefix>XXXX` of `component`, removed when dropped.
pub(crate) fn temp_dir(component: &'static str, prefix: &str) -> Result<tempfile::TempDir> {
    let temp = std::env::temp_dir();
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(&temp)
        .map_err(io_at(component, "create a temporary directory in", &temp))
}

/// Maps an error (a kube client's, a parser's) to [`Error::Failed`], saying what was asked.
pub(crate) fn failed<E: std::fmt::Display>(what: impl Into<String>) -> impl FnOnce(E) -> Error {
    let what = what.into();
    move |e| Error::failed(what, e)
}
