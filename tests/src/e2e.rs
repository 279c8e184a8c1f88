//! Process harness for end-to-end tests: the real `teeguard-webhook` and `teeguard-agent` binaries run
//! as child processes against the fake API server served on 127.0.0.1 (`KUBECONFIG` points them at it)
//! and a simulated host, and the test plays the rest of the cluster with
//! [`crate::standalone::ApiServerDriver`].
//!
//! - [`binaries`] finds the two binaries next to the running test executable (`target/<profile>/`)
//!   and builds them once (`cargo build -p teeguard-webhook -p teeguard-agent --bins`, same profile and
//!   target directory) when they are missing or older than any source file of webhook, agent or shared,
//!   so a stale binary never makes a test pass or fail for the wrong reason.
//! - [`ChildProcess`] captures stdout and stderr in a log file and kills the process when dropped.
//! - [`E2eEnv`] owns one test's temporary directory, fake API server, kubeconfig, configuration file
//!   and certificate directory (laid out like a mounted Secret, rotated like the kubelet does), starts
//!   [`WebhookProcess`]es and [`AgentProcess`]es, and prints every process's log if the test panics.
//!
//! Every wait has a deadline; the webhook's ports are chosen by the OS (`127.0.0.1:0`) and read back
//! from its start-up log line.

use std::fs::File;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use rustls::pki_types::{CertificateDer, ServerName};
use serde_json::Value;
use teeguard_certs::{CertificateAuthority, ServingCert, ServingCertRequest};
use teeguard_shared::Config;
use teeguard_shared::crd::TeeCapacityStatus;

use crate::error::{self, Error, Result};
use crate::fakeapi::{FakeApiServer, ServedFakeApi};
use crate::host::SimHost;
use crate::standalone::{ApiServerDriver, WebhookClient};

/// Longest a binary build may take.
pub const BUILD_DEADLINE: Duration = Duration::from_secs(20 * 60);
/// Longest a process may take to start (log line, readiness, first report).
pub const START_DEADLINE: Duration = Duration::from_secs(30);

/// The component teeguard's processes' I/O errors name.
const COMPONENT: &str = "teeguard processes";

fn io_err(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    error::io_at(COMPONENT, op, path)
}

// ------------------------------------------------------------------------------------------------
// Binaries
// ------------------------------------------------------------------------------------------------

/// Paths of the two binaries under test.
#[derive(Clone, Debug)]
pub struct Binaries {
    /// `teeguard-webhook`.
    pub webhook: PathBuf,
    /// `teeguard-agent`.
    pub agent: PathBuf,
}

/// The repository root (the workspace directory).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// Where cargo put the running executable's profile: `target/<profile>` (the parent of `deps/` for
/// test executables).
fn profile_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe()
        .map_err(|e| Error::Binaries(format!("cannot locate the test executable: {e}")))?;
    let mut dir = exe
        .parent()
        .ok_or_else(|| Error::Binaries(format!("{} has no parent", exe.display())))?
        .to_path_buf();
    if dir
        .file_name()
        .is_some_and(|n| n == "deps" || n == "examples")
    {
        dir.pop();
    }
    Ok(dir)
}

fn exe_name(name: &str) -> String {
    format!("{name}{}", std::env::consts::EXE_SUFFIX)
}

fn mtime(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// The newest modification time of the files the binaries are built from.
fn newest_source(root: &Path) -> Option<(SystemTime, PathBuf)> {
    let mut newest: Option<(SystemTime, PathBuf)> = None;
    let mut consider = |p: PathBuf| {
        if let Some(t) = mtime(&p)
            && newest.as_ref().is_none_or(|(n, _)| t > *n)
        {
            newest = Some((t, p));
        }
    };
    for krate in ["webhook", "agent", "shared"] {
        consider(root.join(krate).join("Cargo.toml"));
        let mut stack = vec![root.join(krate).join("src")];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in entries.flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else {
                    consider(p);
                }
            }
        }
    }
    consider(root.join("Cargo.lock"));
    newest
}

/// Why the binaries must be (re)built, if they must.
fn stale_reason(bins: &Binaries, root: &Path) -> Option<String> {
    let newest = newest_source(root);
    for bin in [&bins.webhook, &bins.agent] {
        let Some(built) = mtime(bin) else {
            return Some(format!("{} does not exist", bin.display()));
        };
        if let Some((t, src)) = &newest
            && *t > built
        {
            return Some(format!("{} is older than {}", bin.display(), src.display()));
        }
    }
    None
}

/// Remove from `cmd`'s environment the variables cargo sets for the test or bench it runs
/// (`CARGO_MANIFEST_DIR`, `CARGO_PKG_*`, ...). A nested `cargo build` that inherits them sees build
/// scripts' `rerun-if-env-changed` inputs change (ring's build script watches `CARGO_MANIFEST_DIR` and
/// `CARGO_PKG_*`), and rebuilds ring and everything above it, twice per run. User configuration
/// (`CARGO_HOME`, `CARGO_TARGET_DIR`, `CARGO_BUILD_*`, `CARGO_PROFILE_*`, ...) is kept.
pub fn scrub_cargo_run_env(cmd: &mut Command) {
    const SET_BY_CARGO: [&str; 9] = [
        "CARGO_MANIFEST_DIR",
        "CARGO_MANIFEST_PATH",
        "CARGO_MANIFEST_LINKS",
        "CARGO_CRATE_NAME",
        "CARGO_BIN_NAME",
        "CARGO_PRIMARY_PACKAGE",
        "CARGO_TARGET_TMPDIR",
        "CARGO_RUSTC_CURRENT_DIR",
        "OUT_DIR",
    ];
    for (key, _) in std::env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        if key.starts_with("CARGO_PKG_") || SET_BY_CARGO.contains(&key) {
            cmd.env_remove(key);
        }
    }
}

/// The `cargo build` that puts the binaries where the running test executable's profile lives:
/// same target directory, same profile (`--release` / `--profile <name>`), same `--target` when
/// cross-compiling (`target/<triple>/<profile>`). Respects `$CARGO`.
pub fn build_command(profile_dir: &Path) -> Result<Command> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let profile = profile_dir
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("debug")
        .to_string();
    let mut target_dir = profile_dir
        .parent()
        .ok_or_else(|| Error::Binaries(format!("{} has no parent", profile_dir.display())))?
        .to_path_buf();
    // `target/<triple>/<profile>` when cross-compiling: the triple directory has no CACHEDIR.TAG.
    let mut target_triple = None;
    if !target_dir.join("CACHEDIR.TAG").exists()
        && let (Some(triple), Some(parent)) = (
            target_dir
                .file_name()
                .and_then(|n| n.to_str())
                .map(str::to_string),
            target_dir.parent().map(Path::to_path_buf),
        )
        && parent.join("CACHEDIR.TAG").exists()
    {
        target_triple = Some(triple);
        target_dir = parent;
    }
    let mut cmd = Command::new(&cargo);
    scrub_cargo_run_env(&mut cmd);
    cmd.current_dir(workspace_root())
        .args([
            "build",
            "-p",
            "teeguard-webhook",
            "-p",
            "teeguard-agent",
            "--bins",
        ])
        .arg("--target-dir")
        .arg(&target_dir);
    match profile.as_str() {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    if let Some(t) = &target_triple {
        cmd.args(["--target", t]);
    }
    Ok(cmd)
}

fn build(profile_dir: &Path, reason: &str) -> Result<()> {
    let mut cmd = build_command(profile_dir)?;
    eprintln!("e2e: building the teeguard binaries ({reason}): {:?}", cmd);
    let log = profile_dir.join("teeguard-e2e-build.log");
    let out = File::create(&log).map_err(io_err("create", &log))?;
    let err = out.try_clone().map_err(io_err("open", &log))?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .spawn()
        .map_err(|e| Error::Binaries(format!("cannot run {:?}: {e}", cmd.get_program())))?;
    let started = Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) if status.success() => return Ok(()),
            Ok(Some(status)) => {
                return Err(Error::Binaries(format!(
                    "`cargo build` failed ({status}):\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )));
            }
            Ok(None) if started.elapsed() > BUILD_DEADLINE => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::Binaries(format!(
                    "`cargo build` did not finish within {BUILD_DEADLINE:?}:\n{}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                )));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(200)),
            Err(e) => return Err(Error::Binaries(format!("waiting for cargo: {e}"))),
        }
    }
}

/// The webhook and agent binaries, fresh: built once per test process (and serialised across test
/// processes by a lock file) when missing or older than their sources.
pub fn binaries() -> Result<&'static Binaries> {
    static BINARIES: OnceLock<std::result::Result<Binaries, String>> = OnceLock::new();
    BINARIES
        .get_or_init(|| locate_or_build().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| Error::Binaries(e.clone()))
}

/// Names the cargo profile [`guest_binaries`] takes (default `release`; `scripts/test.sh` sets `dev`:
/// the binaries the tests build anyway, so a CI run builds no second set; measured on 2 cores under
/// TCG, the kernel tests take about 20 s longer with them, the build 7 minutes less).
pub const GUEST_PROFILE_ENV: &str = "TEEGUARD_GUEST_PROFILE";

/// The webhook and agent binaries of the `release` profile (or [`GUEST_PROFILE_ENV`]'s), beside the
/// running test executable's profile directory, built once per test process when missing or older than
/// their sources: what the kernel tests hand a guest (`crate::teevm`).
pub fn guest_binaries() -> Result<&'static Binaries> {
    static BINARIES: OnceLock<std::result::Result<Binaries, String>> = OnceLock::new();
    BINARIES
        .get_or_init(|| locate_or_build_guest().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|e| Error::Binaries(e.clone()))
}

fn locate_or_build_guest() -> Result<Binaries> {
    let dir = profile_dir()?;
    let target = dir
        .parent()
        .ok_or_else(|| Error::Binaries(format!("{} has no parent", dir.display())))?;
    let profile = std::env::var(GUEST_PROFILE_ENV).unwrap_or_else(|_| "release".to_string());
    // cargo puts the `dev` profile's binaries in `debug/`.
    let dir = if profile == "dev" {
        "debug"
    } else {
        profile.as_str()
    };
    locate_or_build_in(&target.join(dir))
}

fn locate_or_build() -> Result<Binaries> {
    locate_or_build_in(&profile_dir()?)
}

fn locate_or_build_in(dir: &Path) -> Result<Binaries> {
    std::fs::create_dir_all(dir).map_err(io_err("create", dir))?;
    let dir = dir.to_path_buf();
    let bins = Binaries {
        webhook: dir.join(exe_name("teeguard-webhook")),
        agent: dir.join(exe_name("teeguard-agent")),
    };
    let root = workspace_root();
    if stale_reason(&bins, &root).is_none() {
        return Ok(bins);
    }
    // Another test process may be building: take the lock, then look again.
    let lock_path = dir.join(".teeguard-e2e-build.lock");
    let lock = File::create(&lock_path).map_err(io_err("create", &lock_path))?;
    lock.lock().map_err(io_err("lock", &lock_path))?;
    if let Some(reason) = stale_reason(&bins, &root) {
        build(&dir, &reason)?;
        if let Some(still) = stale_reason(&bins, &root) {
            // cargo decided nothing needed rebuilding (e.g. a touched file with unchanged content):
            // its fingerprints are authoritative.
            eprintln!("e2e: cargo considers the binaries fresh although {still}");
        }
    }
    let _ = lock.unlock();
    Ok(bins)
}

// ------------------------------------------------------------------------------------------------
// Child processes
// ------------------------------------------------------------------------------------------------

/// A child process whose stdout and stderr go to a log file; killed (and reaped) when dropped.
#[derive(Debug)]
pub struct ChildProcess {
    name: String,
    child: Option<Child>,
    log: PathBuf,
}

impl ChildProcess {
    /// Start `program` with `args` and extra environment `envs`, logging to `log`.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        envs: &[(&str, String)],
        log: &Path,
    ) -> Result<ChildProcess> {
        let out = File::create(log).map_err(io_err("create", log))?;
        let err = out.try_clone().map_err(io_err("open", log))?;
        let mut cmd = Command::new(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::from(out))
            .stderr(Stdio::from(err))
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("KUBERNETES_SERVICE_PORT");
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let child = cmd.spawn().map_err(|source| Error::Spawn {
            name: name.to_string(),
            program: program.to_path_buf(),
            source,
        })?;
        Ok(ChildProcess {
            name: name.to_string(),
            child: Some(child),
            log: log.to_path_buf(),
        })
    }

    /// The process's name in messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its OS process id, while running.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The log file.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// `None` while running, else how it ended.
    pub fn exit_status(&mut self) -> Option<String> {
        match self.child.as_mut().map(Child::try_wait) {
            None => Some("killed by the test".into()),
            Some(Ok(Some(s))) => Some(s.to_string()),
            Some(Ok(None)) => None,
            Some(Err(e)) => Some(format!("unknown: {e}")),
        }
    }

    /// Ask it to stop as the kubelet does (SIGTERM); [`ChildProcess::wait_exit`] waits for the end.
    pub fn sigterm(&self) -> Result<()> {
        let Some(pid) = self.pid() else {
            return Ok(());
        };
        let pid = pid.to_string();
        let status = Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .map_err(|source| Error::Spawn {
                name: format!("kill -TERM {pid} ({})", self.name),
                program: "kill".into(),
                source,
            })?;
        if status.success() {
            Ok(())
        } else {
            Err(Error::Failed {
                what: format!("kill -TERM {pid} ({})", self.name),
                reason: status.to_string(),
            })
        }
    }

    /// Wait until it has exited, at most `within` (then it is killed, and the error says so): how
    /// it ended.
    pub async fn wait_exit(&mut self, within: Duration) -> Result<String> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(status) = self.exit_status() {
                return Ok(status);
            }
            if tokio::time::Instant::now() >= deadline {
                self.kill();
                return Err(Error::Timeout {
                    what: format!("{} to exit (killed)", self.name),
                    after: within,
                    log: Some(self.log()),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kill it (SIGKILL, like a crash or an OOM kill) and reap it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Poll the log (and the process) until `find` returns a value, the process exits, or `timeout`.
    pub async fn wait_for_log<T>(
        &mut self,
        what: &str,
        timeout: Duration,
        mut find: impl FnMut(&str) -> Option<T>,
    ) -> Result<T> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let log = self.log();
            if let Some(v) = log.lines().find_map(&mut find) {
                return Ok(v);
            }
            if let Some(status) = self.exit_status() {
                return Err(Error::Exited {
                    name: self.name.clone(),
                    status,
                    what: what.to_string(),
                    log: self.log(),
                });
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!("{} to log {what}", self.name),
                    after: timeout,
                    log: Some(log),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Parse a JSON log line and return it when its `message` is `message`.
pub fn json_log_line(line: &str, message: &str) -> Option<Value> {
    let v: Value = serde_json::from_str(line).ok()?;
    let m = v
        .get("message")
        .or_else(|| v.pointer("/fields/message"))
        .and_then(Value::as_str)?;
    (m == message).then_some(v)
}

// ------------------------------------------------------------------------------------------------
// Certificates laid out like a mounted Secret
// ------------------------------------------------------------------------------------------------

/// A directory laid out like a kubelet-mounted Secret volume: `..<timestamp>/{tls.crt,tls.key}`,
/// `..data -> ..<timestamp>`, `tls.crt -> ..data/tls.crt`, `tls.key -> ..data/tls.key`.
#[derive(Debug)]
pub struct SecretDir {
    dir: PathBuf,
    current: String,
    generation: u32,
    /// Set by [`SecretDir::temporary`]: removes the directory when the `SecretDir` is dropped.
    _owned: Option<tempfile::TempDir>,
}

impl SecretDir {
    /// Create it in `dir` with a first certificate pair.
    pub fn new(dir: &Path, cert_pem: &str, key_pem: &str) -> Result<SecretDir> {
        std::fs::create_dir_all(dir).map_err(io_err("create", dir))?;
        let current = Self::write_generation(dir, 0, cert_pem, key_pem)?;
        let link = |target: &str, name: &str| {
            let p = dir.join(name);
            std::os::unix::fs::symlink(target, &p).map_err(io_err("symlink", &p))
        };
        link(&current, "..data")?;
        link("..data/tls.crt", "tls.crt")?;
        link("..data/tls.key", "tls.key")?;
        Ok(SecretDir {
            dir: dir.to_path_buf(),
            current,
            generation: 0,
            _owned: None,
        })
    }

    /// Create it in a new temporary directory, removed when the `SecretDir` is dropped.
    pub fn temporary(cert_pem: &str, key_pem: &str) -> Result<SecretDir> {
        let temp =
            tempfile::tempdir().map_err(io_err("create", Path::new("a temporary directory")))?;
        let mut secret = SecretDir::new(temp.path(), cert_pem, key_pem)?;
        secret._owned = Some(temp);
        Ok(secret)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Add the CA's certificate as `ca.crt`, as the chart's Secret has it (kept across rotations).
    pub fn add_ca(&self, ca_pem: &str) -> Result<()> {
        let p = self.dir.join("ca.crt");
        std::fs::write(&p, ca_pem).map_err(io_err("write", &p))
    }

    fn write_generation(root: &Path, generation: u32, cert: &str, key: &str) -> Result<String> {
        let name = format!("..2026_01_01_00_00_{generation:02}.{:09}", 100 + generation);
        let d = root.join(&name);
        std::fs::create_dir(&d).map_err(io_err("create", &d))?;
        for (f, c) in [("tls.crt", cert), ("tls.key", key)] {
            let p = d.join(f);
            std::fs::write(&p, c).map_err(io_err("write", &p))?;
        }
        Ok(name)
    }

    /// Rotate like the kubelet's atomic writer: a new timestamped directory, a `..data_tmp` symlink
    /// renamed over `..data`, the old directory removed.
    pub fn rotate(&mut self, cert_pem: &str, key_pem: &str) -> Result<()> {
        self.generation += 1;
        let new = Self::write_generation(&self.dir, self.generation, cert_pem, key_pem)?;
        let tmp = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(&new, &tmp).map_err(io_err("symlink", &tmp))?;
        let data = self.dir.join("..data");
        std::fs::rename(&tmp, &data).map_err(io_err("rename over", &data))?;
        let old = self.dir.join(&self.current);
        std::fs::remove_dir_all(&old).map_err(io_err("remove", &old))?;
        self.current = new;
        Ok(())
    }
}

/// The certificate a TLS server at `addr` presents (trusting only `ca`, SNI `localhost`).
pub async fn peer_certificate(
    addr: SocketAddr,
    ca: CertificateDer<'static>,
) -> Result<CertificateDer<'static>> {
    let cfg = crate::standalone::client::client_config(ca)?;
    let work = async {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let name = ServerName::try_from("localhost")
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let tls = tokio_rustls::TlsConnector::from(cfg)
            .connect(name, tcp)
            .await?;
        let (_, session) = tls.get_ref();
        session
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.clone().into_owned())
            .ok_or_else(|| std::io::Error::other("no peer certificate"))
    };
    match tokio::time::timeout(Duration::from_secs(5), work).await {
        Ok(r) => r.map_err(io_err("handshake with", Path::new(&addr.to_string()))),
        Err(_) => Err(Error::Timeout {
            what: format!("a TLS handshake with {addr}"),
            after: Duration::from_secs(5),
            log: None,
        }),
    }
}

// ------------------------------------------------------------------------------------------------
// The environment
// ------------------------------------------------------------------------------------------------

/// The processes' side of an end-to-end test, whatever API server they talk to: temporary directory,
/// kubeconfig, configuration file, webhook certificates, and the webhook and agent processes started
/// from them. Prints the logs of every process it started when the test panics.
pub struct ProcessEnv {
    dir: tempfile::TempDir,
    /// The kubeconfig the processes use.
    pub kubeconfig: PathBuf,
    /// The configuration file both processes read.
    pub config_path: PathBuf,
    /// The parsed configuration.
    pub config: Config,
    /// The webhook's certificate directory.
    pub certs: SecretDir,
    /// The CA the webhook's certificates chain to.
    pub ca: CertificateAuthority,
    logs: Arc<Mutex<Vec<(String, PathBuf)>>>,
    counter: Mutex<u32>,
    /// The decider Lease of this environment's webhook replicas (`--decider-lease-name`): unique, so
    /// the webhooks of tests sharing one API server never elect each other.
    pub decider_lease: String,
}

impl std::fmt::Debug for ProcessEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessEnv")
            .field("dir", &self.dir.path())
            .field("kubeconfig", &self.kubeconfig)
            .finish_non_exhaustive()
    }
}

/// One end-to-end test's world against the fake API server: the [`ProcessEnv`] (its fields and
/// methods are reached through `Deref`) plus the served fake API server its kubeconfig points at.
pub struct E2eEnv {
    /// Files, certificates and processes.
    pub procs: ProcessEnv,
    /// The fake API server's state (the test's programmatic handle).
    pub api: FakeApiServer,
    /// The served fake API server (stop/restart to simulate an outage).
    pub served: ServedFakeApi,
}

impl std::fmt::Debug for E2eEnv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("E2eEnv")
            .field("dir", &self.procs.dir.path())
            .field("api", &self.served.url())
            .finish_non_exhaustive()
    }
}

impl std::ops::Deref for E2eEnv {
    type Target = ProcessEnv;
    fn deref(&self) -> &ProcessEnv {
        &self.procs
    }
}

impl std::ops::DerefMut for E2eEnv {
    fn deref_mut(&mut self) -> &mut ProcessEnv {
        &mut self.procs
    }
}

impl E2eEnv {
    /// A new world with configuration `config_yaml` (validated here, as the binaries would).
    pub async fn new(config_yaml: &str) -> Result<E2eEnv> {
        let api = FakeApiServer::new();
        let served = api.serve().await?;
        let procs = ProcessEnv::new(config_yaml, |path| served.write_kubeconfig(path))?;
        Ok(E2eEnv { procs, api, served })
    }

    /// A driver sending reviews to `webhook` and storing objects in this world's API server.
    pub fn driver(&self, webhook: &WebhookProcess) -> Result<ApiServerDriver> {
        Ok(ApiServerDriver::new(
            self.api.clone(),
            webhook.client()?,
            self.config.resources.clone(),
        ))
    }

    /// The `TeeCapacity` status of `node`, if published.
    pub fn report(&self, node: &str) -> Option<TeeCapacityStatus> {
        self.api.tee_capacity_status(node)
    }
}

impl ProcessEnv {
    /// A new environment with configuration `config_yaml` (validated here, as the binaries would);
    /// `write_kubeconfig` writes the kubeconfig the processes use at the path it is given.
    pub fn new(
        config_yaml: &str,
        write_kubeconfig: impl FnOnce(&Path) -> Result<()>,
    ) -> Result<ProcessEnv> {
        let config = Config::from_yaml(config_yaml).map_err(|e| Error::Config(e.to_string()))?;
        let dir = error::temp_dir(COMPONENT, "teeguard-e2e-")?;
        let kubeconfig = dir.path().join("kubeconfig");
        write_kubeconfig(&kubeconfig)?;
        let config_path = dir.path().join("config.yaml");
        std::fs::write(&config_path, config_yaml).map_err(io_err("write", &config_path))?;
        let ca = CertificateAuthority::generate("teeguard-e2e-ca", 30)?;
        let leaf = ca.issue(&ServingCertRequest::localhost())?;
        let certs = SecretDir::new(&dir.path().join("certs"), leaf.cert_pem(), leaf.key_pem())?;
        certs.add_ca(ca.cert_pem())?;
        Ok(ProcessEnv {
            dir,
            kubeconfig,
            config_path,
            config,
            certs,
            ca,
            logs: Arc::new(Mutex::new(Vec::new())),
            counter: Mutex::new(0),
            decider_lease: {
                static ENVS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let n = ENVS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                format!("teeguard-webhook-decider-{}-{n}", std::process::id())
            },
        })
    }

    /// The temporary directory.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    fn log_path(&self, name: &str) -> PathBuf {
        let mut n = self.counter.lock().unwrap_or_else(|e| e.into_inner());
        *n += 1;
        let p = self.dir.path().join(format!("{:02}-{name}.log", *n));
        self.logs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((name.to_string(), p.clone()));
        p
    }

    fn envs(&self) -> Vec<(&'static str, String)> {
        vec![("KUBECONFIG", self.kubeconfig.display().to_string())]
    }

    /// A new serving certificate from the same CA (for rotation).
    pub fn issue_leaf(&self) -> Result<ServingCert> {
        Ok(self.ca.issue(&ServingCertRequest::localhost())?)
    }

    /// Start `teeguard-webhook serve` on ephemeral ports with this world's certificates and
    /// configuration, plus `extra` flags; wait until it logs its addresses and `/readyz` answers 200.
    pub async fn start_webhook(&self, extra: &[&str]) -> Result<WebhookProcess> {
        self.start_webhook_via(extra, &self.kubeconfig, &[]).await
    }

    /// [`ProcessEnv::start_webhook`] with another kubeconfig (another API server) and more
    /// `NAME=value` environment variables (`POD_NAME`, the replica's name in its holds).
    pub async fn start_webhook_via(
        &self,
        extra: &[&str],
        kubeconfig: &Path,
        env: &[&str],
    ) -> Result<WebhookProcess> {
        self.start_webhook_at(self.certs.path(), extra, kubeconfig, env)
            .await
    }

    /// [`ProcessEnv::start_webhook`] serving the certificate in `certs` (another replica's view of
    /// the Secret, e.g. one renewal ahead).
    pub async fn start_webhook_with_certs(&self, certs: &Path) -> Result<WebhookProcess> {
        self.start_webhook_at(certs, &[], &self.kubeconfig, &[])
            .await
    }

    async fn start_webhook_at(
        &self,
        certs: &Path,
        extra: &[&str],
        kubeconfig: &Path,
        env: &[&str],
    ) -> Result<WebhookProcess> {
        let bins = binaries()?;
        let mut args: Vec<String> = [
            "--log-format",
            "json",
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--cert-dir",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.push(certs.display().to_string());
        args.push("--config".into());
        args.push(self.config_path.display().to_string());
        args.push("--decider-lease-name".into());
        args.push(self.decider_lease.clone());
        args.extend(extra.iter().map(|s| s.to_string()));
        let log = self.log_path("webhook");
        let mut envs: Vec<(&str, String)> = vec![("KUBECONFIG", kubeconfig.display().to_string())];
        for e in env {
            if let Some((name, value)) = e.split_once('=') {
                envs.push((name, value.to_string()));
            }
        }
        let mut proc = ChildProcess::spawn("teeguard-webhook", &bins.webhook, &args, &envs, &log)?;
        let (https, admin) = proc
            .wait_for_log("its listen addresses", START_DEADLINE, |line| {
                let v = json_log_line(line, "teeguard-webhook started")?;
                let get = |k: &str| {
                    v.get(k)
                        .or_else(|| v.pointer(&format!("/fields/{k}")))
                        .and_then(Value::as_str)
                        .and_then(|s| s.parse::<SocketAddr>().ok())
                };
                Some((get("https")?, get("admin")?))
            })
            .await?;
        let mut w = WebhookProcess {
            proc,
            https,
            admin,
            ca: self.ca.cert_der(),
        };
        w.wait_ready(START_DEADLINE).await?;
        Ok(w)
    }

    /// Start `teeguard-agent run` for `node` reading `host`'s cgroup tree; wait until it has
    /// published a report for the node that agrees with the host's kernel usage.
    pub async fn start_agent(&self, node: &str, host: &SimHost) -> Result<AgentProcess> {
        self.start_agent_at(node, host.root()).await
    }

    /// [`ProcessEnv::start_agent`] reading the cgroup tree at `cgroup_root` (a simulated host's, or
    /// the machine's own `/sys/fs/cgroup`).
    pub async fn start_agent_at(&self, node: &str, cgroup_root: &Path) -> Result<AgentProcess> {
        self.start_agent_with(node, cgroup_root, &[]).await
    }

    /// [`ProcessEnv::start_agent_at`] with more command-line arguments (`--kubelet-dir ...`).
    pub async fn start_agent_with(
        &self,
        node: &str,
        cgroup_root: &Path,
        extra_args: &[String],
    ) -> Result<AgentProcess> {
        let bins = binaries()?;
        let mut args: Vec<String> = vec![
            "run".into(),
            "--node-name".into(),
            node.into(),
            "--cgroup-root".into(),
            cgroup_root.display().to_string(),
            "--config".into(),
            self.config_path.display().to_string(),
            "--admin-addr".into(),
            "127.0.0.1:0".into(),
            "--log-format".into(),
            "json".into(),
        ];
        args.extend(extra_args.iter().cloned());
        let log = self.log_path(&format!("agent-{node}"));
        let proc = ChildProcess::spawn(
            &format!("teeguard-agent ({node})"),
            &bins.agent,
            &args,
            &self.envs(),
            &log,
        )?;
        let mut agent = AgentProcess {
            proc,
            node: node.to_string(),
            admin: None,
        };
        agent.admin = agent
            .proc
            .wait_for_log("its admin address", START_DEADLINE, |line| {
                let v = json_log_line(line, "admin server listening (/livez, /readyz, /metrics)")?;
                v.get("admin")
                    .or_else(|| v.pointer("/fields/admin"))?
                    .as_str()?
                    .parse()
                    .ok()
            })
            .await
            .ok();
        // A fresh process logs its first successful publish at info level.
        agent
            .proc
            .wait_for_log(
                &format!("publishing the TeeCapacity of {node}"),
                START_DEADLINE,
                |line| json_log_line(line, "published TeeCapacity"),
            )
            .await?;
        Ok(agent)
    }

    /// Every log so far, for failure messages.
    pub fn all_logs(&self) -> String {
        let mut out = String::new();
        for (name, path) in self.logs.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            out.push_str(&format!(
                "----- {name} ({}) -----\n{}\n",
                path.display(),
                std::fs::read_to_string(path).unwrap_or_default()
            ));
        }
        out
    }
}

impl Drop for ProcessEnv {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "e2e: the test failed; logs of the processes it started:\n{}",
                self.all_logs()
            );
        }
    }
}

/// A running `teeguard-webhook serve`.
#[derive(Debug)]
pub struct WebhookProcess {
    /// The process.
    pub proc: ChildProcess,
    /// Its HTTPS address.
    pub https: SocketAddr,
    /// Its admin address.
    pub admin: SocketAddr,
    ca: CertificateDer<'static>,
}

impl WebhookProcess {
    /// A new client for it (trusting the world's CA).
    pub fn client(&self) -> Result<WebhookClient> {
        WebhookClient::new(self.https, self.ca.clone())
    }

    /// Wait until `/readyz` answers 200.
    pub async fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let got = crate::standalone::cluster::http_get(self.admin, "/readyz").await;
            if matches!(got, Ok((200, _))) {
                return Ok(());
            }
            if let Some(status) = self.proc.exit_status() {
                return Err(Error::Exited {
                    name: self.proc.name.clone(),
                    status,
                    what: "getting ready".into(),
                    log: self.proc.log(),
                });
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(Error::Timeout {
                    what: format!("the webhook's /readyz ({got:?})"),
                    after: timeout,
                    log: Some(self.proc.log()),
                });
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// `/metrics` of the admin port.
    pub async fn metrics(&self) -> String {
        crate::standalone::cluster::http_get(self.admin, "/metrics")
            .await
            .map(|(_, b)| b)
            .unwrap_or_default()
    }
}

/// A running `teeguard-agent run`.
#[derive(Debug)]
pub struct AgentProcess {
    /// The process.
    pub proc: ChildProcess,
    /// Its node.
    pub node: String,
    /// Its admin address (`/metrics`), from its start-up log.
    pub admin: Option<SocketAddr>,
}

impl AgentProcess {
    /// `/metrics` of the admin port (empty when the address is unknown or the request fails).
    pub async fn metrics(&self) -> String {
        let Some(addr) = self.admin else {
            return String::new();
        };
        crate::standalone::cluster::http_get(addr, "/metrics")
            .await
            .map(|(_, body)| body)
            .unwrap_or_default()
    }

    /// Wait (up to `timeout`) for the agent's log to say it registered with the node's runtime over
    /// NRI.
    pub async fn wait_nri_registered(&mut self, timeout: Duration) -> Result<()> {
        self.proc
            .wait_for_log("its NRI registration", timeout, |line| {
                json_log_line(line, "NRI plugin registered").map(|_| ())
            })
            .await
    }
}

/// The backends of a [`balance`]r, by slot: `None` for one that is down.
pub type Backends = Arc<Mutex<Vec<Option<SocketAddr>>>>;

/// A TCP balancer on 127.0.0.1 over `backends`, as a Service's kube-proxy balances the replicas of a
/// Deployment: each new connection goes to the next backend that is up (round robin) and stays with
/// it (TLS passes through). Runs until the test process ends.
pub async fn balance(backends: Backends) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("balancer listens");
    let addr = listener.local_addr().expect("balancer address");
    tokio::spawn(async move {
        let mut next = 0usize;
        while let Ok((mut inbound, _)) = listener.accept().await {
            let to = {
                let b = backends.lock().unwrap_or_else(|e| e.into_inner());
                let up: Vec<SocketAddr> = b.iter().flatten().copied().collect();
                next = next.wrapping_add(1);
                (!up.is_empty()).then(|| up[next % up.len()])
            };
            tokio::spawn(async move {
                if let Some(to) = to
                    && let Ok(mut outbound) = tokio::net::TcpStream::connect(to).await
                {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    addr
}

/// The last `n` lines of `text`.
pub fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().rev().take(n).collect();
    lines.into_iter().rev().collect::<Vec<_>>().join("\n")
}

// ------------------------------------------------------------------------------------------------
// A ready-made world: one TDX node with its agent process, the webhook process, a driver
// ------------------------------------------------------------------------------------------------

/// The TDX node of a [`World`].
pub const NODE: &str = "node-a";

/// Time allowed for a new report to reach the webhook process's watch cache.
pub const PROCESS_WATCH_GRACE: Duration = Duration::from_millis(300);

/// How long a [`World`] waits for the agent's report to follow a change.
pub const SETTLE_DEADLINE: Duration = Duration::from_secs(20);

/// One TDX node (`node-a`, simulated host with `keys` TDX keys, agent process), the webhook process,
/// and an [`ApiServerDriver`] playing the rest of the cluster.
#[derive(Debug)]
pub struct World {
    /// Plays the API server, virt-controller and scheduler against the webhook process.
    pub driver: ApiServerDriver,
    /// The webhook process (fields drop in order: processes first, files last).
    pub webhook: WebhookProcess,
    /// The agent process (`None` after [`World::kill_agent`]).
    pub agent: Option<AgentProcess>,
    /// The simulated host of [`NODE`].
    pub host: SimHost,
    /// Files, fake API server, certificates; prints the process logs if the test panics.
    pub env: E2eEnv,
}

/// The objects every world starts with: the `default` namespace and the TDX node (labelled for
/// Kata's RuntimeClass, without any advertised key resource: the agent adds it).
fn seed(api: &FakeApiServer, keys: u64) -> Result<()> {
    api.create(&serde_json::json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "default", "labels": {"kubernetes.io/metadata.name": "default"}}
    }))?;
    let mut node = crate::fixtures::NodeBuilder::new(NODE)
        .tdx(keys)
        .label(crate::standalone::cluster::KATA_NODE_LABEL, "true")
        .to_value();
    if let Some(m) = node.get_mut("metadata").and_then(Value::as_object_mut) {
        for k in ["uid", "resourceVersion", "creationTimestamp"] {
            m.remove(k);
        }
    }
    api.create(&node)?;
    Ok(())
}

impl World {
    /// Start a world with configuration `config_yaml` and `keys` TDX keys: the agent first (its first
    /// report), then the webhook (ready).
    pub async fn start(keys: u64, config_yaml: &str) -> Result<World> {
        Self::start_with(keys, config_yaml, &[]).await
    }

    /// [`World::start`] with extra webhook flags.
    pub async fn start_with(keys: u64, config_yaml: &str, webhook_flags: &[&str]) -> Result<World> {
        let env = E2eEnv::new(config_yaml).await?;
        seed(&env.api, keys)?;
        let host = SimHost::builder()
            .capacity(crate::host::TDX, keys)
            .build()
            .map_err(|e| Error::Config(e.to_string()))?;
        let agent = env.start_agent(NODE, &host).await?;
        let webhook = env.start_webhook(webhook_flags).await?;
        let driver = env
            .driver(&webhook)?
            .with_ledger_ttl(env.config.admission.ledger_ttl)
            .with_watch_grace(PROCESS_WATCH_GRACE);
        let world = World {
            env,
            host,
            agent: Some(agent),
            webhook,
            driver,
        };
        world.settle().await?;
        Ok(world)
    }

    /// The kubelet of [`NODE`].
    pub fn kubelet(&self) -> crate::standalone::SimKubelet<'_> {
        crate::standalone::SimKubelet {
            node: NODE.to_string(),
            host: &self.host,
            api: &self.env.api,
        }
    }

    /// A TDX VM `name` created as a user and virt-controller create it, its launcher pod patched and
    /// admitted at CREATE (not bound yet); panics otherwise.
    pub async fn admitted_tdx_vm(&self, name: &str) -> k8s_openapi::api::core::v1::Pod {
        let (_, adm) = self
            .driver
            .create_vm(&crate::standalone::VmiSpec::new(
                name,
                crate::fixtures::Tee::Tdx,
            ))
            .await
            .expect("VMI stored, its pod reviewed");
        adm.expect_patched_pod(name)
    }

    /// `pod` as stored now (bound, with its UID); panics when it is gone.
    pub fn stored(&self, pod: &k8s_openapi::api::core::v1::Pod) -> k8s_openapi::api::core::v1::Pod {
        let ns = pod.metadata.namespace.as_deref();
        let name = pod.metadata.name.as_deref().expect("a named pod");
        self.env
            .api
            .get_typed(ns, name)
            .expect("a pod decodes")
            .unwrap_or_else(|| panic!("pod {name} is stored"))
    }

    /// The kubelet starts `pod`'s TDX VM: its `compute` container, where QEMU takes one key (`pod` as
    /// stored now, [`World::stored`]).
    pub fn start_tdx_vm(&self, pod: &k8s_openapi::api::core::v1::Pod) -> Result<()> {
        self.kubelet().start(
            &self.stored(pod),
            &["compute"],
            "compute",
            Some(crate::host::TDX),
        )
    }

    /// The Node [`NODE`] as stored now (panics when it is not: every world has it).
    pub fn node(&self) -> k8s_openapi::api::core::v1::Node {
        self.env
            .api
            .get_typed(None, NODE)
            .expect("a Node decodes")
            .expect("the world's Node exists")
    }

    /// Wait until the next review sees the current state (see [`ApiServerDriver::settle`]).
    pub async fn settle(&self) -> Result<teeguard_shared::crd::KindStatus> {
        self.driver
            .settle(
                NODE,
                teeguard_shared::TeeKind::Tdx,
                &self.host,
                SETTLE_DEADLINE,
            )
            .await
    }

    /// [`World::settle`], then half a second more for the webhook's other watches (the VMIs, the pods)
    /// to deliver: before an API server outage, when a GET on a cache miss would fail.
    pub async fn settle_before_outage(&self) -> Result<teeguard_shared::crd::KindStatus> {
        let s = self.settle().await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        Ok(s)
    }

    /// Kill the agent (SIGKILL).
    pub fn kill_agent(&mut self) {
        if let Some(mut a) = self.agent.take() {
            a.proc.kill();
        }
    }

    /// Start a new agent process (after [`World::kill_agent`]); waits for its first publish.
    pub async fn restart_agent(&mut self) -> Result<()> {
        self.kill_agent();
        self.agent = Some(self.env.start_agent(NODE, &self.host).await?);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn touch(path: &Path, at: SystemTime) {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("mkdir");
        }
        std::fs::write(path, "x").expect("write");
        File::options()
            .write(true)
            .open(path)
            .expect("open")
            .set_modified(at)
            .expect("set mtime");
    }

    #[test]
    fn binaries_older_than_any_source_are_stale() {
        let root = tempfile::tempdir().expect("tempdir");
        let r = root.path();
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let later = |s: u64| t0 + Duration::from_secs(s);
        for f in [
            "webhook/src/lib.rs",
            "agent/src/run.rs",
            "shared/src/tee.rs",
            "Cargo.lock",
        ] {
            touch(&r.join(f), t0);
        }
        let bins = Binaries {
            webhook: r.join("target/debug/teeguard-webhook"),
            agent: r.join("target/debug/teeguard-agent"),
        };
        let missing = stale_reason(&bins, r).expect("missing binaries are stale");
        assert!(missing.contains("does not exist"), "{missing}");
        touch(&bins.webhook, later(10));
        touch(&bins.agent, later(10));
        assert_eq!(stale_reason(&bins, r), None);
        // A source edited after the build, however deep.
        touch(&r.join("webhook/src/web/handlers/validate.rs"), later(20));
        let why = stale_reason(&bins, r).expect("stale");
        assert!(why.contains("validate.rs"), "{why}");
        touch(&bins.webhook, later(30));
        touch(&bins.agent, later(30));
        assert_eq!(stale_reason(&bins, r), None);
        touch(&r.join("shared/Cargo.toml"), later(40));
        assert!(
            stale_reason(&bins, r).is_some(),
            "a manifest change is a source change"
        );
        // Other crates do not matter.
        touch(&bins.webhook, later(50));
        touch(&bins.agent, later(50));
        touch(&r.join("certs/src/lib.rs"), later(60));
        assert_eq!(stale_reason(&bins, r), None);
    }

    fn args(cmd: &Command) -> Vec<String> {
        cmd.get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect()
    }

    #[test]
    fn build_command_follows_the_profile_and_target_directory() {
        let dir = tempfile::tempdir().expect("tempdir");
        let target = dir.path().join("target");
        std::fs::create_dir_all(target.join("debug")).expect("mkdir");
        std::fs::write(target.join("CACHEDIR.TAG"), "").expect("tag");
        let target_s = target.display().to_string();
        let debug = args(&build_command(&target.join("debug")).expect("cmd"));
        assert_eq!(
            debug[..6],
            [
                "build",
                "-p",
                "teeguard-webhook",
                "-p",
                "teeguard-agent",
                "--bins"
            ]
        );
        assert!(
            !debug.iter().any(|a| a == "--release" || a == "--profile"),
            "{debug:?}"
        );
        assert!(
            debug
                .windows(2)
                .any(|w| w == ["--target-dir", target_s.as_str()]),
            "{debug:?}"
        );
        // Cargo runs this test with CARGO_MANIFEST_DIR and CARGO_PKG_* set; the nested build must not
        // inherit them (build scripts watch them) but keeps user configuration.
        assert!(std::env::var_os("CARGO_MANIFEST_DIR").is_some());
        let cmd = build_command(&target.join("debug")).expect("cmd");
        let removed: Vec<String> = cmd
            .get_envs()
            .filter(|(_, v)| v.is_none())
            .map(|(k, _)| k.to_string_lossy().into_owned())
            .collect();
        for var in ["CARGO_MANIFEST_DIR", "CARGO_PKG_NAME", "CARGO_PKG_VERSION"] {
            assert!(removed.iter().any(|r| r == var), "{var} kept: {removed:?}");
        }
        assert!(
            !removed
                .iter()
                .any(|r| r == "CARGO_HOME" || r == "CARGO_TARGET_DIR")
        );
        let release = args(&build_command(&target.join("release")).expect("cmd"));
        assert!(release.iter().any(|a| a == "--release"), "{release:?}");
        let custom = args(&build_command(&target.join("ci")).expect("cmd"));
        assert!(
            custom.windows(2).any(|w| w == ["--profile", "ci"]),
            "{custom:?}"
        );
        let cross = args(
            &build_command(&target.join("x86_64-unknown-linux-musl").join("debug")).expect("cmd"),
        );
        assert!(
            cross
                .windows(2)
                .any(|w| w == ["--target", "x86_64-unknown-linux-musl"]),
            "{cross:?}"
        );
        assert!(
            cross
                .windows(2)
                .any(|w| w == ["--target-dir", target_s.as_str()]),
            "{cross:?}"
        );
    }

    #[test]
    fn json_log_lines_are_matched_by_message() {
        let line = r#"{"timestamp":"t","level":"INFO","message":"teeguard-webhook started","https":"127.0.0.1:1"}"#;
        let found = json_log_line(line, "teeguard-webhook started").expect("matched");
        assert_eq!(found["https"], "127.0.0.1:1");
        assert!(json_log_line(line, "other").is_none());
        assert!(json_log_line("plain text", "teeguard-webhook started").is_none());
    }
}
