//! A real Kubernetes control plane for tests: etcd, kube-apiserver, kube-scheduler and
//! kube-controller-manager started from the binaries in the directory named by
//! `TEEGUARD_CONTROL_PLANE` (plain binaries, or the `.xz` files as shipped, unpacked here once), all on
//! free 127.0.0.1 ports.
//!
//! - One control plane per test binary, shared by its tests ([`ControlPlane::shared`]); each test works
//!   in its own namespaces and Nodes ([`unique_name`]).
//! - Set-up is in Rust: certificates from `teeguard-certs`, static token authentication, RBAC
//!   authorization, `--enable-aggregator-routing` (a service-based webhook has no endpoints without a
//!   kubelet, so such a call fails locally instead of leaving the machine), and no node-lifecycle
//!   controller (Nodes without a kubelet would be tainted). kube-scheduler serves its secure port (its
//!   metrics, for benches) and can be restarted with other flags ([`ControlPlane::restart_scheduler`]).
//! - Stopping: statics are never dropped, so each component runs under a small `bash` watchdog that
//!   stops it when the test process exits (or the component dies); a janitor then removes the state
//!   directory, unless a test of the binary panicked: then the logs are kept and the panic message says
//!   where.
//! - Without binaries the tests skip with one line saying how to provide them; with `CI=true` a missing
//!   or broken control plane fails the run instead.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use kube::Client;
use kube::config::{KubeConfigOptions, Kubeconfig};
use teeguard_certs::{CertificateAuthority, ServingCertRequest};

use crate::error::{self, Component, Error, Result};
use crate::ports::free_ports;

/// The environment variable naming the directory with the binaries.
pub const ENV: &str = "TEEGUARD_CONTROL_PLANE";

/// The environment variable naming another Kubernetes release to run (`v1.30.14`): kube-apiserver,
/// kube-scheduler and kube-controller-manager from `versions/<release>/` below [`ENV`]'s directory
/// (`../shared/control-plane`'s layout; `scripts/control-plane.sh` unpacks it), etcd from the top.
/// Unset or empty: the top-level binaries (v1.36.2). `scripts/test.sh` runs the control-plane tests
/// that matter for an older cluster a second time with it set.
pub const VERSION_ENV: &str = "TEEGUARD_KUBE_VERSION";

/// The release [`VERSION_ENV`] names, if any.
pub fn chosen_version() -> Option<String> {
    std::env::var(VERSION_ENV).ok().filter(|v| !v.is_empty())
}

/// The four binaries, in start order.
pub const BINARIES: [&str; 4] = [
    "etcd",
    "kube-apiserver",
    "kube-scheduler",
    "kube-controller-manager",
];

/// Longest the control plane may take to become ready.
pub const READY_DEADLINE: Duration = Duration::from_secs(60);

/// What to do when a control plane cannot be had.
const HOW_TO: &str = "set TEEGUARD_CONTROL_PLANE to a directory holding etcd, kube-apiserver, \
    kube-scheduler and kube-controller-manager (>= 1.30; plain or .xz), e.g. ../shared/control-plane \
    or the binaries envtest's setup tool downloads; scripts/test.sh does this when ../shared/control-plane exists";

/// This harness's component, as its errors name it.
pub(crate) const KIT: Component = Component {
    name: "control plane",
    how_to: HOW_TO,
};

/// A failure to build or use a client of the control plane.
fn client_err(e: impl std::fmt::Display) -> Error {
    Error::failed("control plane client", e)
}

/// A running control plane.
#[derive(Debug)]
pub struct ControlPlane {
    dir: PathBuf,
    /// `https://127.0.0.1:PORT` of kube-apiserver.
    pub url: String,
    /// An admin kubeconfig (`system:masters`).
    pub kubeconfig: PathBuf,
    /// The CA that signed the API server's certificate.
    pub ca_pem: String,
    /// The admin's bearer token.
    pub admin_token: String,
    /// kube-scheduler's secure port on 127.0.0.1 (its `/metrics`, `/readyz`; the API server's CA
    /// signed its certificate).
    pub scheduler_port: u16,
    /// kube-scheduler's arguments before any [`ControlPlane::restart_scheduler`] extras.
    scheduler_args: Vec<String>,
    /// Where the binaries are.
    bin: PathBuf,
    /// How long start-up took (binaries unpacked, certificates made, `/readyz` ok).
    pub started_in: Duration,
    /// A second kube-apiserver on the same etcd ([`want_two_api_servers`]); kube-scheduler talks to
    /// it, everything else to the first.
    pub second: Option<SecondApiServer>,
}

/// A second kube-apiserver: the same etcd, certificates, tokens and flags, another port.
#[derive(Debug)]
pub struct SecondApiServer {
    /// `https://127.0.0.1:PORT`.
    pub url: String,
    /// An admin kubeconfig pointing at it.
    pub kubeconfig: PathBuf,
    args: Vec<String>,
}

static SHARED: OnceLock<Result<ControlPlane>> = OnceLock::new();
static TWO_API_SERVERS: AtomicBool = AtomicBool::new(false);

/// Ask for a second kube-apiserver on the same etcd in this test binary's control plane (before its
/// first [`ControlPlane::shared`]): clients spread over two API servers, each calling the webhooks for
/// the requests it serves, as in a cluster with several control-plane nodes.
pub fn want_two_api_servers() {
    TWO_API_SERVERS.store(true, Ordering::SeqCst);
}

impl ControlPlane {
    /// The control plane of this test binary, started on first use. `None` (after printing one line)
    /// when no binaries are configured and `CI` is not `true`; panics when `CI=true` and there are
    /// none, or when the control plane does not start.
    pub fn shared() -> Option<&'static ControlPlane> {
        KIT.start_once(&SHARED, Self::start)
    }

    /// Start one: find or unpack the binaries, write certificates and tokens, start the four
    /// components and wait until `/readyz` answers `ok`.
    pub fn start() -> Result<ControlPlane> {
        let started = Instant::now();
        let source = KIT.dir_from(ENV)?;
        let dir = KIT.state_dir("teeguard-control-plane-", &["log", "etcd", "pki"])?;
        let bin = binaries(&source, &dir.join("bin"), chosen_version().as_deref())?;
        if let Some(want) = chosen_version() {
            let out = Command::new(bin.join("kube-apiserver"))
                .arg("--version")
                .output()
                .map_err(KIT.io("run kube-apiserver --version"))?;
            let said = String::from_utf8_lossy(&out.stdout).trim().to_string();
            if !said.contains(&want) {
                return Err(KIT.missing(format!(
                    "{VERSION_ENV}={want}, but {} says {said:?}",
                    bin.join("kube-apiserver").display()
                )));
            }
        }
        spawn_janitor(&dir)?;
        let kept = format!(
            "control plane: a test failed; the components' logs are kept in {}",
            dir.join("log").display()
        );
        install_panic_hook(&dir, kept);

        // Certificates and tokens.
        let pki = dir.join("pki");
        let ca = CertificateAuthority::generate("teeguard-test-control-plane", 7)?;
        let serving = ca.issue(&ServingCertRequest::localhost())?;
        let signing = ca.issue(&ServingCertRequest::localhost())?;
        let write = |name: &str, body: &str| -> Result<PathBuf> {
            let p = pki.join(name);
            std::fs::write(&p, body).map_err(KIT.io(format!("write {}", p.display())))?;
            Ok(p)
        };
        let ca_file = write("ca.crt", ca.cert_pem())?;
        let cert_file = write("apiserver.crt", serving.cert_pem())?;
        let key_file = write("apiserver.key", serving.key_pem())?;
        // The API server reads the public key from the certificate; the private key is PKCS#8.
        let sa_key = write("sa.key", signing.key_pem())?;
        let sa_pub = write("sa.crt", signing.cert_pem())?;
        let token =
            |who: &str| format!("{who}-{:016x}{:08x}", fastrand::u64(..), std::process::id());
        let (admin, scheduler) = (token("admin"), token("sched"));
        let tokens = write(
            "tokens.csv",
            &format!(
                "{admin},admin,admin,system:masters\n\
                 {scheduler},system:kube-scheduler,system:kube-scheduler\n"
            ),
        )?;

        let [
            etcd_port,
            peer_port,
            metrics_port,
            api_port,
            scheduler_port,
            api_port_b,
        ] = free_ports().map_err(KIT.io("find free ports"))?;
        let url = format!("https://127.0.0.1:{api_port}");
        let url_b = format!("https://127.0.0.1:{api_port_b}");
        let two = TWO_API_SERVERS.load(Ordering::SeqCst);
        let kubeconfig = |name: &str, url: &str, tok: &str| -> Result<PathBuf> {
            write(
                name,
                &format!(
                    "apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster: {{server: \"{url}\", \
                     certificate-authority: \"{}\"}}\nusers:\n- name: u\n  user: {{token: \"{tok}\"}}\n\
                     contexts:\n- name: local\n  context: {{cluster: local, user: u}}\ncurrent-context: local\n",
                    ca_file.display()
                ),
            )
        };
        let admin_kc = kubeconfig("admin.kubeconfig", &url, &admin)?;
        let admin_kc_b = kubeconfig("admin-b.kubeconfig", &url_b, &admin)?;
        let sched_kc = kubeconfig(
            "scheduler.kubeconfig",
            if two { &url_b } else { &url },
            &scheduler,
        )?;
        let p = |path: &Path| path.display().to_string();

        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        spawn(
            &dir,
            &bin,
            "etcd",
            &[
                "--name=default".into(),
                format!("--data-dir={}", p(&dir.join("etcd"))),
                format!("--listen-client-urls={etcd_url}"),
                format!("--advertise-client-urls={etcd_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster=default={peer_url}"),
                format!("--listen-metrics-urls=http://127.0.0.1:{metrics_port}"),
                // Test data: no fsync per write (etcd 3.4+); a lost control plane is simply restarted.
                "--unsafe-no-fsync".into(),
            ],
        )?;
        let api_args = |port: u16| -> Vec<String> {
            vec![
                format!("--etcd-servers={etcd_url}"),
                "--bind-address=127.0.0.1".into(),
                "--advertise-address=127.0.0.1".into(),
                format!("--secure-port={port}"),
                format!("--tls-cert-file={}", p(&cert_file)),
                format!("--tls-private-key-file={}", p(&key_file)),
                format!("--client-ca-file={}", p(&ca_file)),
                format!("--token-auth-file={}", p(&tokens)),
                "--anonymous-auth=false".into(),
                "--authorization-mode=RBAC".into(),
                "--enable-aggregator-routing=true".into(),
                "--service-account-issuer=https://kubernetes.default.svc".into(),
                format!("--service-account-key-file={}", p(&sa_pub)),
                format!("--service-account-signing-key-file={}", p(&sa_key)),
                "--service-cluster-ip-range=10.96.0.0/24".into(),
                "--allow-privileged=true".into(),
            ]
        };
        spawn(&dir, &bin, "kube-apiserver", &api_args(api_port))?;
        let second = two.then(|| SecondApiServer {
            url: url_b.clone(),
            kubeconfig: admin_kc_b,
            args: api_args(api_port_b),
        });
        let scheduler_args: Vec<String> = vec![
            format!("--kubeconfig={}", p(&sched_kc)),
            format!("--authentication-kubeconfig={}", p(&sched_kc)),
            format!("--authorization-kubeconfig={}", p(&sched_kc)),
            "--bind-address=127.0.0.1".into(),
            // Served so that benches can read its metrics (`ControlPlane::scheduler_metrics`).
            format!("--secure-port={scheduler_port}"),
            format!("--tls-cert-file={}", p(&cert_file)),
            format!("--tls-private-key-file={}", p(&key_file)),
            "--leader-elect=false".into(),
        ];
        let cp = ControlPlane {
            dir: dir.clone(),
            url,
            kubeconfig: admin_kc,
            ca_pem: ca.cert_pem().to_string(),
            admin_token: admin,
            scheduler_port,
            scheduler_args,
            bin: bin.clone(),
            started_in: Duration::ZERO,
            second,
        };
        cp.wait_ready(started + READY_DEADLINE)?;
        if cp.second.is_some() {
            cp.start_second()?;
        }
        spawn(&dir, &bin, "kube-scheduler", &cp.scheduler_args)?;
        // As the admin: with its own identity and no per-controller credentials, controllers such
        // as the ValidatingAdmissionPolicy type checker lack the rights to write their status.
        spawn(
            &dir,
            &bin,
            "kube-controller-manager",
            &[
                format!("--kubeconfig={}", p(&cp.kubeconfig)),
                format!("--authentication-kubeconfig={}", p(&cp.kubeconfig)),
                format!("--authorization-kubeconfig={}", p(&cp.kubeconfig)),
                "--bind-address=127.0.0.1".into(),
                "--secure-port=0".into(),
                "--leader-elect=false".into(),
                // Nodes without a kubelet would be tainted and their pods evicted.
                "--controllers=*,-node-lifecycle-controller".into(),
                format!("--service-account-private-key-file={}", p(&sa_key)),
                format!("--root-ca-file={}", p(&ca_file)),
                "--service-cluster-ip-range=10.96.0.0/24".into(),
            ],
        )?;
        Ok(ControlPlane {
            started_in: started.elapsed(),
            ..cp
        })
    }

    /// Start the second kube-apiserver and wait until its `/readyz` answers `ok` (at start-up, on
    /// the control plane's own thread).
    fn start_second(&self) -> Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(KIT.io("start a runtime"))?;
        rt.block_on(self.restart_second())
    }

    /// Start the second kube-apiserver again (after [`ControlPlane::stop_second`]) and wait until its
    /// `/readyz` answers `ok`.
    pub async fn restart_second(&self) -> Result<()> {
        let Some(second) = &self.second else {
            return Ok(());
        };
        let log = self.dir.join("log").join("kube-apiserver-b.log");
        spawn_watched(&log, &self.bin.join("kube-apiserver"), &second.args)
            .map_err(KIT.io("start the second kube-apiserver (needs bash)"))?;
        let deadline = Instant::now() + READY_DEADLINE;
        let kc = Kubeconfig::read_from(&second.kubeconfig).map_err(client_err)?;
        let config = kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .map_err(client_err)?;
        let client = Client::try_from(config).map_err(client_err)?;
        match ready(&client, deadline).await? {
            None => Ok(()),
            Some(last) => Err(Error::NotReady {
                component: KIT.name,
                what: format!("the second kube-apiserver's /readyz is not ok ({last})"),
                logs: self.dir.join("log"),
            }),
        }
    }

    /// Kill the second kube-apiserver (SIGKILL, as a crash; its clients' requests fail until
    /// [`ControlPlane::restart_second`]). Not SIGTERM: a graceful shutdown closes the listener at once
    /// but kept the process up to a minute on this machine, so "an outage of 3 s" lasted 60-70 s.
    pub async fn stop_second(&self) -> Result<()> {
        let pid_file = self.dir.join("log").join("kube-apiserver-b.log.pid");
        let pid = std::fs::read_to_string(&pid_file)
            .map_err(KIT.io(format!("read {}", pid_file.display())))?;
        let proc_dir = PathBuf::from(format!("/proc/{}", pid.trim()));
        let _ = Command::new("kill").args(["-KILL", pid.trim()]).status();
        let deadline = Instant::now() + READY_DEADLINE;
        while proc_dir.exists() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// The state directory (`log/` holds each component's output).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The log of one component (`kube-apiserver`, ...).
    pub fn log(&self, component: &str) -> String {
        std::fs::read_to_string(self.dir.join("log").join(format!("{component}.log")))
            .unwrap_or_default()
    }

    /// Stop kube-scheduler and start it again with its arguments plus `extra` (a later flag wins:
    /// `--kube-api-qps=5000`), then wait until its `/readyz` answers `ok` (its informers synced).
    /// Its metrics start from zero again.
    pub async fn restart_scheduler(&self, extra: &[String]) -> Result<()> {
        let pid_file = self.dir.join("log").join("kube-scheduler.log.pid");
        let pid = std::fs::read_to_string(&pid_file)
            .map_err(KIT.io(format!("read {}", pid_file.display())))?;
        let proc_dir = PathBuf::from(format!("/proc/{}", pid.trim()));
        let _ = Command::new("kill").arg(pid.trim()).status();
        let deadline = Instant::now() + READY_DEADLINE;
        while proc_dir.exists() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let args: Vec<String> = self.scheduler_args.iter().chain(extra).cloned().collect();
        spawn(&self.dir, &self.bin, "kube-scheduler", &args)?;
        let last = match ready(&self.scheduler_client().await?, deadline).await? {
            None => return Ok(()),
            Some(last) => last,
        };
        Err(Error::NotReady {
            component: KIT.name,
            what: format!("kube-scheduler (restarted with {extra:?}) is not ready: {last}"),
            logs: self.dir.join("log"),
        })
    }

    /// kube-scheduler's own metrics (Prometheus text), read as the admin.
    pub async fn scheduler_metrics(&self) -> Result<String> {
        let req = http::Request::get("/metrics")
            .body(Vec::new())
            .map_err(client_err)?;
        self.scheduler_client()
            .await?
            .request_text(req)
            .await
            .map_err(error::failed(
                "control plane client: kube-scheduler /metrics",
            ))
    }

    /// An admin client for kube-scheduler's secure port.
    async fn scheduler_client(&self) -> Result<Client> {
        let mut config = self.admin_config().await?;
        config.cluster_url = format!("https://127.0.0.1:{}", self.scheduler_port)
            .parse()
            .map_err(|e: http::uri::InvalidUri| client_err(e))?;
        Client::try_from(config).map_err(client_err)
    }

    /// A new admin client (a client belongs to the tokio runtime it is made in: one per test).
    pub async fn client(&self) -> Result<Client> {
        Client::try_from(self.admin_config().await?).map_err(client_err)
    }

    /// The admin kubeconfig as a client configuration.
    async fn admin_config(&self) -> Result<kube::Config> {
        let kc = Kubeconfig::read_from(&self.kubeconfig).map_err(client_err)?;
        kube::Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
            .await
            .map_err(client_err)
    }

    fn wait_ready(&self, deadline: Instant) -> Result<()> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(KIT.io("start a runtime"))?;
        rt.block_on(async {
            let last = match ready(&self.client().await?, deadline).await? {
                None => return Ok(()),
                Some(last) => last,
            };
            let log = self.log("kube-apiserver");
            Err(Error::NotReady {
                component: KIT.name,
                what: format!(
                    "kube-apiserver's /readyz is not ok ({last}); its last log lines:\n{}",
                    crate::e2e::last_lines(&log, 5)
                ),
                logs: self.dir.join("log"),
            })
        })
    }
}

/// Poll `/readyz` through `client` until it answers `ok` (`None`) or `deadline` passes (`Some`: the last
/// answer or error).
async fn ready(client: &Client, deadline: Instant) -> Result<Option<String>> {
    let mut last = String::new();
    while Instant::now() < deadline {
        let req = http::Request::get("/readyz")
            .body(Vec::new())
            .map_err(client_err)?;
        match client.request_text(req).await {
            Ok(body) if body.trim() == "ok" => return Ok(None),
            Ok(body) => last = body,
            Err(e) => last = e.to_string(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(Some(last))
}

/// `CI=true`: the real-cluster tests must run.
pub fn ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// A name no other test of this process uses: `<prefix>-<pid>-<n>` (namespaces, Nodes, webhook
/// configurations).
pub fn unique_name(prefix: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// The four binaries in `source` (plain, or `.xz` unpacked into `unpack`); with `version`, the three
/// Kubernetes ones from `source/versions/<version>/` and etcd from `source`.
fn binaries(top: &Path, unpack: &Path, version: Option<&str>) -> Result<PathBuf> {
    if !top.is_dir() {
        return Err(KIT.missing(format!("{ENV}={} is not a directory", top.display())));
    }
    let source_of = |b: &str| match version {
        Some(v) if b != "etcd" => top.join("versions").join(v),
        _ => top.to_path_buf(),
    };
    if version.is_none() && BINARIES.iter().all(|b| is_executable(&top.join(b))) {
        return Ok(top.to_path_buf());
    }
    std::fs::create_dir_all(unpack).map_err(KIT.io(format!("create {}", unpack.display())))?;
    for b in BINARIES {
        let source = source_of(b);
        if is_executable(&source.join(b)) {
            std::os::unix::fs::symlink(source.join(b), unpack.join(b))
                .map_err(KIT.io(format!("link {b} into {}", unpack.display())))?;
            continue;
        }
        let xz = source.join(format!("{b}.xz"));
        if !xz.is_file() {
            return Err(KIT.missing(format!("{} has neither {b} nor {b}.xz", source.display())));
        }
        KIT.unxz(&xz, &unpack.join(b))?;
        KIT.make_executable(&unpack.join(b))?;
    }
    Ok(unpack.to_path_buf())
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Runs a component until the test process (`$1`) exits or the component dies, then stops it (TERM,
/// then KILL after 5 s). Output goes to `$2`.
const WATCHDOG: &str = r#"
parent=$1; log=$2; shift 2
"$@" >"$log" 2>&1 </dev/null &
child=$!
echo "$child" >"$log.pid"
trap 'kill "$child" 2>/dev/null; exit 0' TERM INT
while kill -0 "$parent" 2>/dev/null && kill -0 "$child" 2>/dev/null; do sleep 0.2; done
kill "$child" 2>/dev/null
for _ in $(seq 1 50); do kill -0 "$child" 2>/dev/null || exit 0; sleep 0.1; done
kill -9 "$child" 2>/dev/null
"#;

/// Once the test process (`$1`) has exited and the components are gone, removes the state directory
/// (`$2`), or only etcd's data when a test failed (the `FAILED` marker): the logs stay.
const JANITOR: &str = r#"
parent=$1; dir=$2
while kill -0 "$parent" 2>/dev/null; do sleep 0.5; done
sleep 6
if [ -e "$dir/FAILED" ]; then rm -rf "$dir/etcd" "$dir/bin"; else rm -rf "$dir"; fi
"#;

fn spawn(dir: &Path, bin: &Path, name: &str, args: &[String]) -> Result<()> {
    let log = dir.join("log").join(format!("{name}.log"));
    spawn_watched(&log, &bin.join(name), args).map_err(KIT.io(format!("start {name} (needs bash)")))
}

/// Start `program` with `args` under the watchdog: output to `log`, stopped (TERM, then KILL after
/// 5 s) when the test process exits. Other harnesses' long-running components use it too.
pub(crate) fn spawn_watched(log: &Path, program: &Path, args: &[String]) -> std::io::Result<()> {
    Command::new("bash")
        .arg("-c")
        .arg(WATCHDOG)
        .arg("watchdog")
        .arg(std::process::id().to_string())
        .arg(log)
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map(|_| ())
}

pub(crate) fn spawn_janitor(dir: &Path) -> Result<()> {
    Command::new("bash")
        .arg("-c")
        .arg(JANITOR)
        .arg("janitor")
        .arg(std::process::id().to_string())
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(KIT.io("start the janitor (needs bash)"))?;
    Ok(())
}

/// On the first panic in this process, mark a harness's state directory `dir` so its janitor keeps
/// the logs, and print `kept` (which harness, what is kept where).
pub(crate) fn install_panic_hook(dir: &Path, kept: String) {
    let marker = dir.join("FAILED");
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !marker.exists() {
            let _ = std::fs::write(&marker, info.to_string());
        }
        eprintln!("{kept}");
        previous(info);
    }));
}
