//! A real node for tests: a container runtime (containerd or CRI-O, both with CRI and NRI) and a kubelet
//! started from the binaries in the directory named by `TEEGUARD_NODE_RUNTIME` (plain, or the `.xz`
//! files of `../shared/node-runtime` as shipped, unpacked here once), joined to the test binary's
//! control plane ([`crate::controlplane`]).
//!
//! - One node per runtime per test binary ([`RealNode::shared`]), started on first use; its tests take
//!   it in turn ([`RealNode::acquire`]: restarts what a previous test left stopped, removes its pods).
//! - Everything lives under a temporary state directory (sockets, images, kubelet root, logs); ports
//!   are free 127.0.0.1 ports, and the kubelet's pod cgroups go under a cgroup root of this node's own
//!   (`/sys/fs/cgroup/<controller>/<node name>/kubepods/...`), so two nodes on one machine never meet.
//! - Containers run through `runc-record` (the `RECORD=1` of `../shared/node-runtime/up.sh`): each
//!   container's OCI `config.json` is saved as the runtime wrote it ([`RealNode::records`]) and
//!   `linux.resources.unified` is dropped before runc, since this kind of machine (cgroup v1, no misc
//!   controller) cannot apply it.
//! - Stopping: statics are never dropped, so a janitor process waits for the test process to exit, then
//!   stops the kubelet, the pods (so the pod cgroups go away), the runtime and whatever is left of this
//!   node (its shims and containers), removes its cgroups, puts back the kernel tunables the kubelet set
//!   (when no other test node is running) and removes the state directory, keeping the logs and the
//!   recorded configs when a test of the binary panicked (the panic message says where).
//!   `<state>/teardown.sh` does the same by hand.
//! - Without binaries, Debian packages or root, the tests skip with one line saying what is missing;
//!   with `CI=true` they fail instead.

mod images;
mod kube_node;
pub mod pods;
mod records;
mod start;
mod teardown;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

pub use images::built_images;
pub use records::{ContainerKind, Recorded, RecordedUpdate, limits};
pub use start::CRIO_UNIFIED_HANDLER;

use crate::controlplane::ControlPlane;
use crate::error::{self, Component, Error, Result};

/// The environment variable naming the directory with the binaries.
pub const ENV: &str = "TEEGUARD_NODE_RUNTIME";

/// The busybox image every test pod runs (`imagePullPolicy: Never`: no registry is reachable).
pub const BUSYBOX: &str = "localhost/test/busybox:1";

/// The sandbox image.
pub const PAUSE: &str = "registry.k8s.io/pause:3.10";

/// How long the runtime's NRI waits for a plugin's answer (`plugin_request_timeout` of containerd,
/// `nri_plugin_request_timeout` of CRI-O).
pub const NRI_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// Longest the runtime, or the kubelet with its Node, may take to come up.
pub const READY_DEADLINE: Duration = Duration::from_secs(60);

/// What to do when a node cannot be had.
const HOW_TO: &str = "set TEEGUARD_NODE_RUNTIME to a directory holding containerd, \
    containerd-shim-runc-v2, ctr, crio, pinns, kubelet, crictl, pause (plain or .xz), runc-record and \
    make-oci-image.py, e.g. ../shared/node-runtime, run as root, and install runc, busybox-static, \
    containernetworking-plugins, conmon and skopeo (Debian); scripts/test.sh does all this when \
    ../shared/node-runtime exists";

/// The container runtime of a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Runtime {
    /// containerd (CRI plugin, NRI).
    Containerd,
    /// CRI-O (NRI).
    Crio,
}

impl Runtime {
    /// `containerd` or `crio`: the binary, and the name in logs and file names.
    pub fn name(self) -> &'static str {
        match self {
            Runtime::Containerd => "containerd",
            Runtime::Crio => "crio",
        }
    }

    /// The binaries of this runtime, besides the kubelet's.
    fn binaries(self) -> &'static [&'static str] {
        match self {
            Runtime::Containerd => &["containerd", "containerd-shim-runc-v2", "ctr"],
            Runtime::Crio => &["crio", "pinns"],
        }
    }
}

/// This harness's component, as its errors name it.
pub(crate) const KIT: Component = Component {
    name: "real node",
    how_to: HOW_TO,
};

/// A running node: the runtime and the kubelet, joined to the control plane as Node [`RealNode::name`].
#[derive(Debug)]
pub struct RealNode {
    /// Its container runtime.
    pub runtime: Runtime,
    /// The Node's name (also the name of its cgroup root).
    pub name: String,
    /// The control plane it joined.
    pub cp: &'static ControlPlane,
    /// How long start-up took (binaries, images, runtime, kubelet, Node registered and untainted).
    pub started_in: Duration,
    dir: PathBuf,
    bin: PathBuf,
    kubelet_healthz: u16,
    procs: Mutex<BTreeMap<&'static str, Child>>,
    turn: tokio::sync::Mutex<()>,
}

/// How many nodes of one runtime a test binary may run (`RealNode::shared_nth`).
pub const MAX_NODES: usize = 2;

type Slot = OnceLock<Result<RealNode>>;
static CONTAINERD: [Slot; MAX_NODES] = [const { OnceLock::new() }; MAX_NODES];
static CRIO: [Slot; MAX_NODES] = [const { OnceLock::new() }; MAX_NODES];

impl RealNode {
    /// The node of this test binary with `runtime`, started on first use (with the control plane).
    /// `None` (after printing one line) when something it needs is missing and `CI` is not `true`;
    /// panics when `CI=true` and something is missing, or when the node does not start.
    pub fn shared(runtime: Runtime) -> Option<&'static RealNode> {
        Self::shared_nth(runtime, 0)
    }

    /// The `n`th node of this test binary with `runtime` (`n` < [`MAX_NODES`]; 0 is
    /// [`RealNode::shared`]'s), each with its own runtime, kubelet, ports, root directory and cgroup
    /// root, started on first use; as [`RealNode::shared`] otherwise. A test taking several nodes
    /// acquires them in order of `n`, so two such tests never wait for each other's second node.
    pub fn shared_nth(runtime: Runtime, n: usize) -> Option<&'static RealNode> {
        let slots = match runtime {
            Runtime::Containerd => &CONTAINERD,
            Runtime::Crio => &CRIO,
        };
        let cell = slots
            .get(n)
            .unwrap_or_else(|| panic!("a test binary runs at most {MAX_NODES} nodes per runtime"));
        // Checked first: a machine without the node's binaries need not start a control plane.
        if let Err(e) = start::prerequisites(runtime) {
            return error::skip(e);
        }
        let cp = ControlPlane::shared()?;
        KIT.start_once(cell, move || start::start(runtime, n, cp))
    }

    /// Take the node for one test: waits for the previous test to finish, starts the runtime or the
    /// kubelet again if it left them stopped, re-registers an untainted Node, and deletes the pods it
    /// left (waiting until they are gone).
    pub async fn acquire(&'static self) -> NodeTurn {
        let guard = self.turn.lock().await;
        self.heal().await.unwrap_or_else(|e| panic!("{e}"));
        NodeTurn {
            node: self,
            _guard: guard,
        }
    }

    /// The state directory (`log/`, `record/`, sockets, `teardown.sh`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The kubelet's `staticPodPath`: a pod manifest written there runs as a static pod (removed when
    /// the node is next acquired).
    pub fn static_pod_path(&self) -> PathBuf {
        self.dir.join("kubelet").join("manifests")
    }

    /// The kubelet's root directory (`--root-dir`: `plugins_registry/`, `plugins/`, `pods/`).
    pub fn kubelet_root(&self) -> PathBuf {
        self.dir.join("kubelet").join("root")
    }

    /// The runtime's CRI socket.
    pub fn cri_socket(&self) -> PathBuf {
        self.dir.join(format!("{}.sock", self.runtime.name()))
    }

    /// The runtime's NRI socket.
    pub fn nri_socket(&self) -> PathBuf {
        self.dir.join("nri.sock")
    }

    /// The log of `component` (`kubelet`, `containerd`, `crio`) so far.
    pub fn log(&self, component: &str) -> String {
        std::fs::read_to_string(self.dir.join("log").join(format!("{component}.log")))
            .unwrap_or_default()
    }

    /// The containers' OCI configs as the runtime handed them to runc, oldest first.
    pub fn records(&self) -> Vec<Recorded> {
        records::read_all(&self.dir.join("record"))
    }

    /// The OCI config of container `id` as the runtime handed it to runc, whatever its annotations
    /// (a container made through `crictl` has none of the kubelet's).
    pub fn recorded_config(&self, id: &str) -> Option<serde_json::Value> {
        let bytes = std::fs::read(self.dir.join("record").join(format!("{id}.json"))).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    /// The recorded configs of `pod` once every container of its spec (init containers too) has one,
    /// waiting up to `timeout` (its sandbox's too, if the runtime ran one: CRI-O drops the infra
    /// container of pods that need none, `drop_infra_ctr`).
    pub async fn records_of_pod(
        &self,
        pod: &k8s_openapi::api::core::v1::Pod,
        timeout: Duration,
    ) -> Vec<Recorded> {
        let uid = pods::runtime_uid(pod).expect("uid").to_owned();
        let spec = pod.spec.as_ref().expect("spec");
        let want: Vec<&str> = spec
            .containers
            .iter()
            .chain(spec.init_containers.iter().flatten())
            .map(|c| c.name.as_str())
            .collect();
        let deadline = Instant::now() + timeout;
        loop {
            let got = self.records_of(&uid);
            if want.iter().all(|w| got.iter().any(|r| r.container == *w)) {
                return got;
            }
            let recorded: Vec<&str> = got.iter().map(|r| r.container.as_str()).collect();
            assert!(
                Instant::now() < deadline,
                "pod {uid}: containers {want:?}, configs recorded for {recorded:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The recorded configs of the pod with UID `pod_uid` (sandbox and containers), oldest first.
    pub fn records_of(&self, pod_uid: &str) -> Vec<Recorded> {
        self.records()
            .into_iter()
            .filter(|r| r.pod_uid == pod_uid)
            .collect()
    }

    /// The resources updates runc was asked to apply to running containers, with its answers, oldest
    /// first.
    pub fn updates(&self) -> Vec<RecordedUpdate> {
        records::read_updates(&self.dir.join("record"))
    }

    /// Run `crictl` against the runtime (each call bounded by 60 s: a test may hold one, e.g. a start in
    /// [`RealNode::hold_create`], for a while); its standard output.
    pub fn crictl(&self, args: &[&str]) -> Result<String> {
        let sock = format!("unix://{}", self.cri_socket().display());
        let mut cmd = Command::new(self.bin.join("crictl"));
        cmd.args(["-r", &sock, "-i", &sock, "-t", "60s"]).args(args);
        run(cmd, &format!("crictl {}", args.join(" ")))
    }

    /// Stop the runtime (SIGTERM, SIGKILL after 10 s) and start it again with the same state; returns
    /// the moment its NRI socket was back (the socket file is removed while it is down).
    pub async fn restart_runtime(&self) -> Result<Instant> {
        self.stop(self.runtime.name(), Duration::from_secs(10))
            .await;
        let _ = std::fs::remove_file(self.nri_socket());
        start::start_runtime(self)?;
        start::wait_runtime(self).await
    }

    /// Stop the kubelet (SIGTERM, SIGKILL after 10 s) and start it again with the same root directory;
    /// returns once its `/healthz` answers.
    pub async fn restart_kubelet(&self) -> Result<()> {
        self.stop("kubelet", Duration::from_secs(10)).await;
        start::start_kubelet(self)?;
        start::wait_kubelet(self).await
    }

    /// Make `runc create` wait for a container whose OCI config contains `marker` (e.g. an environment
    /// variable of its own), until [`RealNode::release_create`]: the runtime's call stays in progress
    /// meanwhile. [`RealNode::create_held`] says when one waits.
    pub fn hold_create(&self, marker: &str) -> Result<()> {
        let _ = std::fs::remove_file(self.dir.join("hold-create.waiting"));
        std::fs::write(self.dir.join("hold-create"), marker).map_err(KIT.io("write hold-create"))
    }

    /// Whether a `runc create` waits because of [`RealNode::hold_create`].
    pub fn create_held(&self) -> bool {
        self.dir.join("hold-create.waiting").exists()
    }

    /// Let the `runc create` held by [`RealNode::hold_create`] go on.
    pub fn release_create(&self) {
        let _ = std::fs::remove_file(self.dir.join("hold-create"));
    }

    /// Stop the kubelet (SIGTERM, SIGKILL after 10 s); its pods keep running. [`RealNode::start_kubelet`]
    /// brings it back.
    pub async fn stop_kubelet(&self) {
        self.stop("kubelet", Duration::from_secs(10)).await;
    }

    /// Start the kubelet stopped by [`RealNode::stop_kubelet`]; returns once its `/healthz` answers.
    pub async fn start_kubelet(&self) -> Result<()> {
        start::start_kubelet(self)?;
        start::wait_kubelet(self).await
    }

    /// Whether `component` (`kubelet` or the runtime's name) is running.
    pub fn running(&self, component: &str) -> bool {
        let mut procs = self.procs.lock().unwrap_or_else(|e| e.into_inner());
        procs
            .get_mut(component)
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// Stop `component` (SIGTERM, then SIGKILL after `grace`) and reap it.
    async fn stop(&self, component: &str, grace: Duration) {
        let child = self
            .procs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(component);
        let Some(mut child) = child else { return };
        let _ = Command::new("kill").arg(child.id().to_string()).status();
        let deadline = Instant::now() + grace;
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    async fn heal(&self) -> Result<()> {
        if !self.running(self.runtime.name()) {
            let _ = std::fs::remove_file(self.nri_socket());
            start::start_runtime(self)?;
            start::wait_runtime(self).await?;
        }
        if !self.running("kubelet") {
            start::start_kubelet(self)?;
            start::wait_kubelet(self).await?;
        }
        // A static pod a test left would keep running whatever happens to its mirror pod.
        for manifest in std::fs::read_dir(self.static_pod_path())
            .into_iter()
            .flatten()
        {
            let path = manifest
                .map_err(KIT.io("list the static pod manifests"))?
                .path();
            std::fs::remove_file(&path).map_err(KIT.io(format!("remove {}", path.display())))?;
        }
        let client = self.cp.client().await?;
        kube_node::wait_registered(self, &client).await?;
        kube_node::delete_pods(self, &client).await
    }
}

/// One test's use of a [`RealNode`] (others wait in [`RealNode::acquire`] until it is dropped).
#[derive(Debug)]
pub struct NodeTurn {
    node: &'static RealNode,
    _guard: tokio::sync::MutexGuard<'static, ()>,
}

impl std::ops::Deref for NodeTurn {
    type Target = RealNode;
    fn deref(&self) -> &RealNode {
        self.node
    }
}

impl NodeTurn {
    /// The node, for tasks that outlive a borrow of the turn.
    pub fn node(&self) -> &'static RealNode {
        self.node
    }

    /// Wait until the kubelet has registered the Node again (after a deletion or a restart) and
    /// lift the not-ready taint it is registered with (no node-lifecycle controller runs here).
    pub async fn wait_registered(&self, client: &kube::Client) -> Result<()> {
        kube_node::wait_registered(self.node, client).await
    }
}

/// Run `cmd`; its standard output, or an error with its output.
fn run(mut cmd: Command, what: &str) -> Result<String> {
    let out = cmd.output().map_err(KIT.io(format!("run {what}")))?;
    if !out.status.success() {
        return Err(Error::Command {
            command: what.to_string(),
            status: out.status.to_string(),
            output: format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
