//! Starting a [`RealNode`]: what it needs, its binaries, images, the runtime's and the kubelet's
//! configuration (the same as `../shared/node-runtime/up.sh` writes, with free ports and a cgroup root
//! of the node's own), and the processes.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{
    BUSYBOX, ENV, KIT, NRI_REQUEST_TIMEOUT, PAUSE, READY_DEADLINE, RealNode, Result, Runtime,
    kube_node, run, teardown,
};
use crate::Error;
use crate::controlplane::ControlPlane;
use crate::ports::free_ports;

/// The kubelet's binaries and the helpers, besides the runtime's.
const COMMON: [&str; 3] = ["kubelet", "crictl", "pause"];
/// Scripts that come plain (never `.xz`).
const HELPERS: [&str; 2] = ["runc-record", "make-oci-image.py"];
/// Where Debian's `containernetworking-plugins` puts the loopback plugin.
const CNI_BIN: &str = "/usr/lib/cni";
/// busybox applets linked in the test image.
const APPLETS: [&str; 6] = ["sh", "sleep", "cat", "echo", "ls", "true"];

/// What the node needs, without starting anything: root, the binaries, the Debian packages.
pub(super) fn prerequisites(runtime: Runtime) -> Result<PathBuf> {
    let source = KIT.dir_from(ENV)?;
    if !source.is_dir() {
        return Err(KIT.missing(format!("{ENV}={} is not a directory", source.display())));
    }
    KIT.needs_root("the node runs as root (cgroups, mounts, the kubelet)")?;
    for b in runtime.binaries().iter().chain(&COMMON) {
        let plain = source.join(b);
        if !plain.is_file() && !source.join(format!("{b}.xz")).is_file() {
            return Err(KIT.missing(format!("{} has neither {b} nor {b}.xz", source.display())));
        }
    }
    for h in HELPERS {
        if !source.join(h).is_file() {
            return Err(KIT.missing(format!("{} has no {h}", source.display())));
        }
    }
    let mut needs = vec![
        ("runc", "runc"),
        ("busybox", "busybox-static"),
        ("python3", "python3"),
    ];
    if runtime == Runtime::Crio {
        needs.extend([("conmon", "conmon"), ("skopeo", "skopeo")]);
    }
    let missing: Vec<String> = needs
        .iter()
        .filter(|(cmd, _)| which(cmd).is_none())
        .map(|(cmd, pkg)| format!("{cmd} (Debian {pkg})"))
        .chain(
            ["loopback", "bridge", "host-local"]
                .into_iter()
                .filter(|p| !Path::new(CNI_BIN).join(p).is_file())
                .map(|p| format!("{CNI_BIN}/{p} (Debian containernetworking-plugins)")),
        )
        .collect();
    if !missing.is_empty() {
        return Err(KIT.missing(format!("missing {}", missing.join(", "))));
    }
    Ok(source)
}

/// Start node `n` of `runtime`: state directory, janitor, binaries, images, the runtime, the kubelet; returns once
/// the Node is registered, Ready and untainted.
pub(super) fn start(runtime: Runtime, n: usize, cp: &'static ControlPlane) -> Result<RealNode> {
    let started = Instant::now();
    let source = prerequisites(runtime)?;
    let name = match n {
        0 => format!("teeguard-{}-{}", runtime.name(), std::process::id()),
        n => format!("teeguard-{}-{}-{n}", runtime.name(), std::process::id()),
    };
    let dir = KIT.state_dir(
        &format!("teeguard-node-{}-", runtime.name()),
        &["log", "record", "images", "cni", "pids", "kubelet"],
    )?;
    let bin = binaries(&source, runtime, &dir.join("bin"))?;
    let network = Network::of(runtime, n);
    teardown::install(&dir, &bin, runtime, &name, &network.bridge)?;
    let [kubelet_port, kubelet_healthz] = free_ports().map_err(KIT.io("find free ports"))?;
    let node = RealNode {
        runtime,
        name,
        cp,
        started_in: Duration::ZERO,
        dir,
        bin,
        kubelet_healthz,
        procs: Mutex::new(BTreeMap::new()),
        turn: tokio::sync::Mutex::new(()),
    };
    write_runc_wrapper(&node)?;
    build_images(&node)?;
    write_runtime_config(&node, &network)?;
    if runtime == Runtime::Crio {
        import_images_crio(&node)?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(KIT.io("start a tokio runtime"))?;
    start_runtime(&node)?;
    rt.block_on(wait_runtime(&node))?;
    if runtime == Runtime::Containerd {
        import_images_containerd(&node)?;
    }
    teardown::save_sysctls(&node.dir)?;
    make_cgroup_root(&node.name)?;
    write_kubelet_config(&node, kubelet_port)?;
    start_kubelet(&node)?;
    rt.block_on(async {
        wait_kubelet(&node).await?;
        let client = node.cp.client().await?;
        kube_node::wait_registered(&node, &client).await
    })?;
    Ok(RealNode {
        started_in: started.elapsed(),
        ..node
    })
}

/// The binaries in `source` (plain, or `.xz` unpacked into `unpack`).
fn binaries(source: &Path, runtime: Runtime, unpack: &Path) -> Result<PathBuf> {
    let all: Vec<&str> = runtime
        .binaries()
        .iter()
        .chain(&COMMON)
        .chain(&HELPERS)
        .copied()
        .collect();
    KIT.files(source, unpack, &all, |_| true)
}

/// `name` on `PATH`.
pub(super) fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

fn write(path: &Path, body: &str) -> Result<()> {
    std::fs::write(path, body).map_err(KIT.io(format!("write {}", path.display())))
}

/// `<state>/runc`: runc through `runc-record` (configs saved to `record/`, `unified` dropped); an
/// `update` (the resources runc is asked to change in a running container) is saved too, with runc's
/// answer: `record/update-<container id>-<ns>.{json,rc,err}`. While `<state>/hold-create` exists, a
/// `create` whose `config.json` contains the file's text waits (it touches `hold-create.waiting`
/// first): [`RealNode::hold_create`].
fn write_runc_wrapper(node: &RealNode) -> Result<()> {
    let runc = which("runc").ok_or_else(|| KIT.missing("runc"))?;
    let wrapper = node.dir.join("runc");
    let script = r#"#!/bin/sh
export RUNC_RECORD_DIR=@RECORD@ RUNC_REAL=@RUNC@
upd=""; res=""; prev=""; id=""; create=""; bundle=""
for a in "$@"; do
  [ "$a" = update ] && upd=1
  [ "$a" = create ] && create=1
  case "$prev" in -r|--resources) res="$a";; -b|--bundle) bundle="$a";; esac
  prev="$a"; id="$a"
done
hold=@DIR@/hold-create
if [ -n "$create" ] && [ -f "$hold" ] && grep -qF "$(cat "$hold")" "$bundle/config.json" 2>/dev/null; then
  touch "$hold.waiting"
  while [ -f "$hold" ]; do sleep 0.05; done
fi
[ -n "$upd" ] || exec @RECORDER@ "$@"
base="$RUNC_RECORD_DIR/update-$id-$(date +%s%N)"
if [ "$res" = - ] || [ -z "$res" ]; then cat > "$base.json"; else cp "$res" "$base.json"; fi
@RECORDER@ "$@" < "$base.json" 2> "$base.err"
rc=$?
echo "$rc" > "$base.rc"
cat "$base.err" >&2
exit "$rc"
"#;
    write(
        &wrapper,
        &script
            .replace("@RECORD@", &node.dir.join("record").display().to_string())
            .replace("@DIR@", &node.dir.display().to_string())
            .replace("@RUNC@", &runc.display().to_string())
            .replace(
                "@RECORDER@",
                &node.bin.join("runc-record").display().to_string(),
            ),
    )?;
    KIT.make_executable(&wrapper)
}

/// Two one-layer OCI archives: the static pause, and busybox with a few applets.
fn build_images(node: &RealNode) -> Result<()> {
    let images = node.dir.join("images");
    let busybox = which("busybox").ok_or_else(|| KIT.missing("busybox"))?;
    let rootfs = images.join("busybox");
    std::fs::create_dir_all(rootfs.join("bin")).map_err(KIT.io("create the busybox rootfs"))?;
    std::fs::copy(&busybox, rootfs.join("bin/busybox")).map_err(KIT.io("copy busybox"))?;
    for applet in APPLETS {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(applet))
            .map_err(KIT.io(format!("link {applet}")))?;
    }
    let pause = images.join("pause");
    std::fs::create_dir_all(&pause).map_err(KIT.io("create the pause rootfs"))?;
    std::fs::copy(node.bin.join("pause"), pause.join("pause")).map_err(KIT.io("copy pause"))?;
    for (tar, image, root, entry) in [
        ("pause.tar", PAUSE, &pause, vec!["/pause"]),
        ("busybox.tar", BUSYBOX, &rootfs, vec!["/bin/sleep", "3600"]),
    ] {
        let mut cmd = Command::new("python3");
        cmd.arg(node.bin.join("make-oci-image.py"))
            .arg(images.join(tar))
            .arg(image)
            .arg(root)
            .args(entry);
        run(cmd, &format!("make-oci-image.py {image}"))?;
    }
    Ok(())
}

fn import_images_containerd(node: &RealNode) -> Result<()> {
    for tar in ["pause.tar", "busybox.tar"] {
        let mut cmd = Command::new(node.bin.join("ctr"));
        cmd.arg("-a")
            .arg(node.cri_socket())
            .args(["-n", "k8s.io", "images", "import"])
            .arg(node.dir.join("images").join(tar));
        run(cmd, &format!("ctr images import {tar}"))?;
    }
    Ok(())
}

fn import_images_crio(node: &RealNode) -> Result<()> {
    let store = format!(
        "containers-storage:[vfs@{}+{}]",
        node.dir.join("root").display(),
        node.dir.join("state").display()
    );
    for (tar, image) in [("pause.tar", PAUSE), ("busybox.tar", BUSYBOX)] {
        let mut cmd = Command::new("skopeo");
        cmd.args(["copy", "--insecure-policy", "--quiet"])
            .arg(format!(
                "oci-archive:{}",
                node.dir.join("images").join(tar).display()
            ))
            .arg(format!("{store}{image}"));
        run(cmd, &format!("skopeo copy {image}"))?;
    }
    Ok(())
}

/// The node's pod network: a Linux bridge of its own with addresses from a /24 of its own (no gateway,
/// no masquerading: pods get an address and reach nothing, which is all the pods here need; a pod that
/// must reach the host uses `hostNetwork`). Removed by the teardown.
#[derive(Debug)]
struct Network {
    /// The bridge's name (at most 15 characters).
    bridge: String,
    /// The pods' subnet.
    subnet: String,
}

impl Network {
    /// The network of node `n` of `runtime` in this test process.
    fn of(runtime: Runtime, n: usize) -> Network {
        let pid = std::process::id();
        let r = match runtime {
            Runtime::Containerd => 0,
            Runtime::Crio => 1,
        };
        Network {
            bridge: format!("tg{}{pid}n{n}", &runtime.name()[..1]),
            subnet: format!("10.{}.{}.0/24", 100 + 2 * n + r, pid % 256),
        }
    }
}

/// The runtime's configuration (as `up.sh` writes it) and the node's CNI network ([`Network`]).
fn write_runtime_config(node: &RealNode, network: &Network) -> Result<()> {
    let d = |p: &str| node.dir.join(p).display().to_string();
    write(
        &node.dir.join("cni/10-teeguard.conflist"),
        &serde_json::json!({
            "cniVersion": "1.0.0",
            "name": format!("teeguard-{}", node.name),
            "plugins": [{
                "type": "bridge", "bridge": network.bridge, "isGateway": false, "ipMasq": false,
                "ipam": {"type": "host-local", "ranges": [[{"subnet": network.subnet}]],
                    "dataDir": d("cni-ipam")}
            }]
        })
        .to_string(),
    )?;
    let timeout = format!("{}s", NRI_REQUEST_TIMEOUT.as_secs());
    match node.runtime {
        Runtime::Containerd => write(
            &node.dir.join("config.toml"),
            &format!(
                r#"version = 3
root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins.'io.containerd.nri.v1.nri']
  disable = false
  socket_path = "{nri}"
  plugin_registration_timeout = "5s"
  plugin_request_timeout = "{timeout}"
[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{PAUSE}"
[plugins.'io.containerd.cri.v1.runtime']
  # a sandbox here may not lower its oom_score_adj (runc fails with "can't get final child's PID")
  restrict_oom_score_adj = true
[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = "runc"
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = "{runc}"
  SystemdCgroup = false
[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ["{CNI_BIN}"]
  conf_dir = "{cni}"
"#,
                root = d("root"),
                state = d("state"),
                sock = node.cri_socket().display(),
                nri = node.nri_socket().display(),
                runc = d("runc"),
                cni = d("cni"),
            ),
        ),
        Runtime::Crio => {
            write(
                &node.dir.join("policy.json"),
                r#"{"default":[{"type":"insecureAcceptAnything"}]}"#,
            )?;
            let conmon = which("conmon").ok_or_else(|| KIT.missing("conmon"))?;
            let handler = |name: &str, allowed: &str| {
                format!(
                    "[crio.runtime.runtimes.{name}]\nruntime_path = \"{runc}\"\nruntime_root = \"{root}\"\n\
                     monitor_path = \"{conmon}\"\nallowed_annotations = [{allowed}]\n",
                    runc = d("runc"),
                    root = d("runc-state"),
                    conmon = conmon.display(),
                )
            };
            write(
                &node.dir.join("crio.conf"),
                &format!(
                    r#"[crio]
root = "{root}"
runroot = "{state}"
storage_driver = "vfs"
log_dir = "{pod_logs}"
version_file = "{state}/version"
version_file_persist = "{root}/version"
clean_shutdown_file = "{root}/clean.shutdown"
[crio.api]
listen = "{sock}"
[crio.runtime]
default_runtime = "runc"
cgroup_manager = "cgroupfs"
conmon_cgroup = "pod"
namespaces_dir = "{ns}"
pinns_path = "{pinns}"
container_exits_dir = "{exits}"
container_attach_socket_dir = "{attach}"
{plain}{unified}[crio.image]
pause_image = "{PAUSE}"
signature_policy = "{policy}"
[crio.network]
network_dir = "{cni}"
plugin_dirs = ["{CNI_BIN}"]
[crio.nri]
enable_nri = true
nri_listen = "{nri}"
nri_plugin_registration_timeout = "5s"
nri_plugin_request_timeout = "{timeout}"
"#,
                    root = d("root"),
                    state = d("state"),
                    pod_logs = d("log/pods"),
                    sock = node.cri_socket().display(),
                    ns = d("ns"),
                    pinns = node.bin.join("pinns").display(),
                    exits = d("exits"),
                    attach = d("attach"),
                    plain = handler("runc", ""),
                    unified = handler(CRIO_UNIFIED_HANDLER, CRIO_UNIFIED_ANNOTATIONS),
                    policy = d("policy.json"),
                    cni = d("cni"),
                    nri = node.nri_socket().display(),
                ),
            )
        }
    }
}

/// A second CRI-O runtime handler (same runc) that allows the unified-cgroup annotations, for pods
/// of a RuntimeClass with this handler; the default handler `runc` allows none.
pub const CRIO_UNIFIED_HANDLER: &str = "runc-unified";
/// The annotations [`CRIO_UNIFIED_HANDLER`] allows: CRI-O's legacy and current names.
const CRIO_UNIFIED_ANNOTATIONS: &str =
    r#""io.kubernetes.cri-o.UnifiedCgroup", "unified-cgroup.crio.io""#;

/// Start `program` in its own process group (a Ctrl-C of the test run reaches the janitor's ordered
/// teardown instead), output appended to `log/<component>.log`, pid in `pids/<component>`.
fn spawn(node: &RealNode, component: &'static str, mut cmd: Command) -> Result<()> {
    let log_path = node.dir.join("log").join(format!("{component}.log"));
    let log = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .map_err(KIT.io(format!("open {}", log_path.display())))?;
    let err = log.try_clone().map_err(KIT.io("clone a log handle"))?;
    let path = std::env::var("PATH").unwrap_or_default();
    cmd.env("PATH", format!("{}:{path}", node.bin.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::from(log))
        .stderr(Stdio::from(err))
        .process_group(0);
    let child = cmd.spawn().map_err(KIT.io(format!("start {component}")))?;
    write(
        &node.dir.join("pids").join(component),
        &child.id().to_string(),
    )?;
    node.procs
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(component, child);
    Ok(())
}

/// Start the runtime (after a stop: with the state it left).
pub(super) fn start_runtime(node: &RealNode) -> Result<()> {
    let mut cmd = Command::new(node.bin.join(node.runtime.name()));
    let config = match node.runtime {
        Runtime::Containerd => "config.toml",
        Runtime::Crio => "crio.conf",
    };
    cmd.arg("--config").arg(node.dir.join(config));
    spawn(node, node.runtime.name(), cmd)
}

/// Wait until the runtime answers on its CRI socket and listens on its NRI socket; returns when the
/// NRI socket appeared.
pub(super) async fn wait_runtime(node: &RealNode) -> Result<Instant> {
    let deadline = Instant::now() + READY_DEADLINE;
    let mut nri_at = None;
    let mut last = String::new();
    loop {
        if nri_at.is_none() && node.nri_socket().exists() {
            nri_at = Some(Instant::now());
        }
        if let Some(at) = nri_at
            && node.cri_socket().exists()
        {
            match node.crictl(&["version"]) {
                Ok(_) => return Ok(at),
                Err(e) => last = e.to_string(),
            }
        }
        if !node.running(node.runtime.name()) || Instant::now() >= deadline {
            return Err(Error::NotReady {
                component: KIT.name,
                what: format!(
                    "{} is not serving CRI and NRI ({}); {last}",
                    node.runtime.name(),
                    if node.running(node.runtime.name()) {
                        "not within the deadline"
                    } else {
                        "it exited"
                    }
                ),
                logs: node.dir.join("log"),
            });
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The kubelet's configuration (as `up.sh` writes it) with free ports and the node's cgroup root, and
/// room for 250 pods (the `dra_scheduling` bench places 200 at once; the kubelet's default is 110).
fn write_kubelet_config(node: &RealNode, port: u16) -> Result<()> {
    let kd = node.dir.join("kubelet");
    for sub in ["root", "certs", "manifests", "pod-logs"] {
        std::fs::create_dir_all(kd.join(sub)).map_err(KIT.io(format!("create kubelet/{sub}")))?;
    }
    write(
        &kd.join("config.yaml"),
        &format!(
            "apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
failSwapOn: false
cgroupDriver: cgroupfs
cgroupRoot: /{cgroup_root}
containerRuntimeEndpoint: unix://{sock}
address: 127.0.0.1
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: {healthz}
authentication: {{anonymous: {{enabled: false}}, webhook: {{enabled: false}}}}
authorization: {{mode: AlwaysAllow}}
enforceNodeAllocatable: []
localStorageCapacityIsolation: true
imageGCHighThresholdPercent: 100
evictionHard: {{}}
staticPodPath: {kd}/manifests
podLogsDir: {kd}/pod-logs
syncFrequency: 5s
makeIPTablesUtilChains: false
maxPods: 250
",
            cgroup_root = node.name,
            sock = node.cri_socket().display(),
            healthz = node.kubelet_healthz,
            kd = kd.display(),
        ),
    )
}

/// Start the kubelet (after a stop: with the root directory it left).
pub(super) fn start_kubelet(node: &RealNode) -> Result<()> {
    let kd = node.dir.join("kubelet");
    let mut cmd = Command::new(node.bin.join("kubelet"));
    cmd.arg("--config")
        .arg(kd.join("config.yaml"))
        .arg("--kubeconfig")
        .arg(&node.cp.kubeconfig)
        .arg("--root-dir")
        .arg(kd.join("root"))
        .arg("--cert-dir")
        .arg(kd.join("certs"))
        .arg("--hostname-override")
        .arg(&node.name)
        .args(["--node-ip", "127.0.0.1"]);
    spawn(node, "kubelet", cmd)
}

/// Wait until the kubelet's `/healthz` answers `ok`.
pub(super) async fn wait_kubelet(node: &RealNode) -> Result<()> {
    let deadline = Instant::now() + READY_DEADLINE;
    let addr = ([127, 0, 0, 1], node.kubelet_healthz).into();
    loop {
        let got = crate::standalone::cluster::http_get(addr, "/healthz").await;
        if matches!(&got, Ok((200, body)) if body.trim() == "ok") {
            return Ok(());
        }
        if !node.running("kubelet") || Instant::now() >= deadline {
            return Err(Error::NotReady {
                component: KIT.name,
                what: format!("the kubelet's /healthz is not ok ({got:?})"),
                logs: node.dir.join("log"),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The node's cgroup root, `/<name>`, in every cgroup v1 hierarchy (with the parent's cpuset), or
/// in the v2 tree with the root's controllers enabled below it; the kubelet refuses a missing one.
fn make_cgroup_root(name: &str) -> Result<()> {
    let top = Path::new("/sys/fs/cgroup");
    if top.join("cgroup.controllers").is_file() {
        let dir = top.join(name);
        std::fs::create_dir_all(&dir).map_err(KIT.io(format!("create {}", dir.display())))?;
        let enabled = std::fs::read_to_string(top.join("cgroup.subtree_control"))
            .map_err(KIT.io("read /sys/fs/cgroup/cgroup.subtree_control"))?;
        let want: Vec<String> = enabled
            .split_whitespace()
            .map(|c| format!("+{c}"))
            .collect();
        return write(&dir.join("cgroup.subtree_control"), &want.join(" "));
    }
    let hierarchies = std::fs::read_dir(top).map_err(KIT.io("list /sys/fs/cgroup"))?;
    for h in hierarchies.flatten() {
        let path = h.path();
        let is_v1 = h.file_type().is_ok_and(|t| t.is_dir())
            && path.join("cgroup.procs").is_file()
            && !path.join("cgroup.controllers").is_file();
        if !is_v1 {
            continue;
        }
        let dir = path.join(name);
        std::fs::create_dir_all(&dir).map_err(KIT.io(format!("create {}", dir.display())))?;
        for f in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(v) = std::fs::read_to_string(path.join(f)) {
                write(&dir.join(f), v.trim())?;
            }
        }
    }
    Ok(())
}
