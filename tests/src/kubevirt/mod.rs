//! KubeVirt's own `virt-controller` for tests, against the test binary's control plane
//! ([`crate::controlplane`]), from the directory named by `TEEGUARD_KUBEVIRT` (`virt-controller`,
//! `kvtool` and `crds.yaml`, plain or `.xz` as `../shared/kubevirt` ships them; `scripts/kubevirt.sh`
//! unpacks and checks them into `./.tools/kubevirt`): v1.9.0, or v1.7.4 / v1.8.4 from its
//! `versions/<tag>/` when a test binary [`choose`]s one.
//!
//! What virt-operator would do is done here once per test binary ([`KubeVirt::shared`]): KubeVirt's
//! generated CRDs applied, the KubeVirt CR from `kvtool kv-cr` (feature gates `WorkloadEncryptionSEV`,
//! `WorkloadEncryptionTDX`) with the status virt-operator writes (virt-controller ignores a CR without a
//! phase), certificates for the controller's HTTPS listener and its export/backup CAs. virt-controller
//! then runs as root in a private mount namespace (`unshare -m`) where `/etc/virt-controller` holds
//! those certificates and `/run/secrets/kubernetes.io/serviceaccount/namespace` says `kubevirt`, as
//! `../shared/kubevirt/up.sh` does; the host sees no change. Ready once `GET /leader` says it leads (it
//! won its Lease and its caches synced).
//!
//! virt-api does not run: [`virt_api`] stands in for its VMI mutating webhook on CREATE, running
//! virt-api's own defaulting and validation (`kvtool default-vmi`) on every VMI the API server is asked
//! to create, by a test or by KubeVirt's VirtualMachine controller. No VMI is ever defaulted by hand.
//! virt-handler does not run either: tests label and equip their Nodes as it would.
//!
//! Stopping: like the control plane, virt-controller runs under a watchdog that stops it when the test
//! process exits; a janitor removes the state directory, keeping `log/` when a test failed. Without the
//! kit the tests skip with one line; with `CI=true` they fail.

pub mod images;
pub mod rendered;
pub mod virt_api;
pub mod vmis;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Api, Client};
use serde_json::{Value, json};
use teeguard_certs::{CertificateAuthority, ServingCertRequest};

use crate::controlplane::{self, ControlPlane};
use crate::error::{self, Component, Error, Result};
use crate::patch::MergePatch;
use crate::ports::free_ports;
use crate::realcluster::create_or_keep;
use crate::standalone::client::WebhookClient;

/// The environment variable naming the kit's directory.
pub const ENV: &str = "TEEGUARD_KUBEVIRT";
/// The namespace KubeVirt runs in (its CR, virt-controller's Lease).
pub const NAMESPACE: &str = "kubevirt";
/// The feature gates of the KubeVirt CR (TDX is Alpha in v1.9, SEV Beta).
pub const FEATURE_GATES: &str = "WorkloadEncryptionSEV,WorkloadEncryptionTDX";
/// A KubeVirt release the kit holds: v1.9.0 at the top of `TEEGUARD_KUBEVIRT`, the others under its
/// `versions/<tag>/` (`../shared/kubevirt`'s layout; `scripts/kubevirt.sh` unpacks all three).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Version {
    /// v1.7.4: the first release with TDX and SNP `launchSecurity`.
    V1_7_4,
    /// v1.8.4.
    V1_8_4,
    /// v1.9.0, the default.
    V1_9_0,
}

impl Version {
    /// Every release the kit holds, oldest first.
    pub const ALL: [Version; 3] = [Version::V1_7_4, Version::V1_8_4, Version::V1_9_0];

    /// The release tag (`v1.9.0`).
    pub fn tag(self) -> &'static str {
        match self {
            Version::V1_7_4 => "v1.7.4",
            Version::V1_8_4 => "v1.8.4",
            Version::V1_9_0 => "v1.9.0",
        }
    }

    /// The launcher image every virt-launcher pod of this release names.
    pub fn launcher_image(self) -> String {
        format!("quay.io/kubevirt/virt-launcher:{}", self.tag())
    }

    /// The export server image (only VirtualMachineExports use it).
    pub fn exporter_image(self) -> String {
        format!("quay.io/kubevirt/virt-exportserver:{}", self.tag())
    }

    /// The kit's directory for this release, below the one `TEEGUARD_KUBEVIRT` names.
    fn kit(self, top: &Path) -> PathBuf {
        match self {
            Version::V1_9_0 => top.to_path_buf(),
            other => top.join("versions").join(other.tag()),
        }
    }
}

impl std::fmt::Display for Version {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.tag())
    }
}

/// The release this test process runs ([`choose`]; v1.9.0 unless a test binary chose another).
static CHOSEN: OnceLock<Version> = OnceLock::new();

/// Run `version` in this test process: one virt-controller per control plane (they would contend for
/// one Lease), so a test binary picks its release before its first [`KubeVirt::shared`]. Panics when
/// the process already runs another.
pub fn choose(version: Version) {
    let got = *CHOSEN.get_or_init(|| version);
    assert_eq!(
        got, version,
        "this test process already runs KubeVirt {got}; one release per test binary"
    );
}

/// The release this test process runs.
pub fn version() -> Version {
    *CHOSEN.get_or_init(|| Version::V1_9_0)
}
/// Longest virt-controller may take to lead with its caches synced (it takes ~25 s on 2 busy cores).
pub const READY_DEADLINE: Duration = Duration::from_secs(180);

/// The files of the kit.
const FILES: [&str; 3] = ["virt-controller", "kvtool", "crds.yaml"];

const HOW_TO: &str = "set TEEGUARD_KUBEVIRT to a directory holding virt-controller, kvtool and \
    crds.yaml (plain or .xz) of KubeVirt v1.9.0, and versions/v1.7.4/ and versions/v1.8.4/ likewise, e.g. ../shared/kubevirt, and run as root (virt-controller \
    runs in a private mount namespace); scripts/test.sh does this when ../shared/kubevirt exists";

/// This harness's component, as its errors name it.
pub(crate) const KIT: Component = Component {
    name: "KubeVirt",
    how_to: HOW_TO,
};

fn api(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    error::failed(what)
}

/// KubeVirt running against the test binary's control plane.
#[derive(Debug)]
pub struct KubeVirt {
    /// The release running.
    pub version: Version,
    /// The control plane it runs against.
    pub cp: &'static ControlPlane,
    /// How long start-up took (CRDs, CR, certificates, virt-controller leading).
    pub started_in: Duration,
    dir: PathBuf,
    bin: PathBuf,
    leader: SocketAddr,
    ca_pem: String,
    /// The KubeVirt CR as stored, for `kvtool default-vmi` (virt-api reads the live CR).
    cr_file: PathBuf,
    virt_api: virt_api::VirtApi,
}

static SHARED: OnceLock<Result<KubeVirt>> = OnceLock::new();

impl KubeVirt {
    /// KubeVirt of this test binary, started on first use (with the control plane). `None` (after
    /// printing one line) when the kit or root is missing and `CI` is not `true`; panics when
    /// `CI=true` and something is missing, or when it does not start.
    pub fn shared() -> Option<&'static KubeVirt> {
        let version = version();
        if let Err(e) = prerequisites(version) {
            return error::skip(e);
        }
        let cp = ControlPlane::shared()?;
        KIT.start_once(&SHARED, move || Self::start(cp, version))
    }

    fn start(cp: &'static ControlPlane, version: Version) -> Result<KubeVirt> {
        let started = Instant::now();
        let source = prerequisites(version)?;
        let dir = KIT.state_dir(
            "teeguard-kubevirt-",
            &["log", "etc-upper/virt-controller", "etc-work", "run"],
        )?;
        controlplane::spawn_janitor(&dir).map_err(|e| KIT.missing(e.to_string()))?;
        let kept = format!(
            "KubeVirt: a test failed; virt-controller's log is kept in {}",
            dir.join("log").display()
        );
        controlplane::install_panic_hook(&dir, kept);
        let bin = unpack(&source, &dir.join("bin"))?;

        // Certificates virt-operator would mount from secrets.
        let ca = CertificateAuthority::generate("teeguard-test-kubevirt", 7)?;
        let serving = ca.issue(&ServingCertRequest::localhost())?;
        let etc = dir.join("etc-upper/virt-controller");
        let write = |sub: &str, cert: &str, key: &str| -> Result<()> {
            let d = etc.join(sub);
            std::fs::create_dir_all(&d).map_err(KIT.io(format!("create {}", d.display())))?;
            std::fs::write(d.join("tls.crt"), cert).map_err(KIT.io("write a certificate"))?;
            std::fs::write(d.join("tls.key"), key).map_err(KIT.io("write a key"))
        };
        write("certificates", serving.cert_pem(), serving.key_pem())?;
        for (sub, cn) in [
            ("exportca", "export.kubevirt.io@teeguard-tests"),
            ("backupca", "backup.kubevirt.io@teeguard-tests"),
        ] {
            let other = CertificateAuthority::generate(cn, 7)?;
            write(sub, other.cert_pem(), &other.key_pem())?;
        }
        std::fs::write(dir.join("run/namespace"), NAMESPACE)
            .map_err(KIT.io("write run/namespace"))?;

        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(KIT.io("start a tokio runtime"))?;
        let cr_file = dir.join("kubevirt-cr.json");
        rt.block_on(async {
            let client = cp.client().await?;
            apply_crds(&client, &bin.join("crds.yaml")).await?;
            create_cr(&client, &bin, &cr_file, version).await
        })?;
        let virt_api = virt_api::VirtApi::start(&bin.join("kvtool"), &cr_file, &dir.join("log"))?;
        rt.block_on(async {
            let client = cp.client().await?;
            virt_api.register(&client).await
        })?;

        let [port] = free_ports().map_err(KIT.io("find a free port"))?;
        let etc_certs = etc.join("certificates");
        let controller_args: Vec<String> = vec![
            "--kubeconfig".into(),
            cp.kubeconfig.display().to_string(),
            "--listen".into(),
            "127.0.0.1".into(),
            "--port".into(),
            port.to_string(),
            "--launcher-image".into(),
            version.launcher_image(),
            "--exporter-image".into(),
            version.exporter_image(),
            "--prom-cert-file".into(),
            etc_certs.join("tls.crt").display().to_string(),
            "--prom-key-file".into(),
            etc_certs.join("tls.key").display().to_string(),
            "-v".into(),
            "2".into(),
        ];
        // In a private mount namespace: /etc overlaid with the certificates, /run a tmpfs holding
        // only the service account's namespace file.
        let mut args: Vec<String> = vec![
            "-m".into(),
            "--propagation".into(),
            "private".into(),
            "sh".into(),
            "-c".into(),
            MOUNT_NS_SCRIPT.into(),
            "sh".into(),
            dir.display().to_string(),
            bin.join("virt-controller").display().to_string(),
        ];
        args.extend(controller_args);
        controlplane::spawn_watched(
            &dir.join("log/virt-controller.log"),
            Path::new("unshare"),
            &args,
        )
        .map_err(KIT.io("start virt-controller (needs bash and unshare)"))?;
        let kv = KubeVirt {
            version,
            cp,
            started_in: Duration::ZERO,
            dir,
            bin,
            leader: ([127, 0, 0, 1], port).into(),
            ca_pem: ca.cert_pem().to_string(),
            cr_file,
            virt_api,
        };
        rt.block_on(kv.wait_leader(started + READY_DEADLINE))?;
        Ok(KubeVirt {
            started_in: started.elapsed(),
            ..kv
        })
    }

    async fn wait_leader(&self, deadline: Instant) -> Result<()> {
        let client =
            WebhookClient::from_ca_pem(self.leader, &self.ca_pem).map_err(|e| Error::NotReady {
                component: KIT.name,
                what: format!("an HTTPS client for virt-controller: {e}"),
                logs: self.dir.join("log"),
            })?;
        loop {
            let last = match client.get("/leader").await {
                Ok((status, body)) => {
                    let body = String::from_utf8_lossy(&body).into_owned();
                    let leads = serde_json::from_str::<Value>(&body)
                        .ok()
                        .is_some_and(|v| v["apiserver"]["leader"] == "true");
                    if status.is_success() && leads {
                        return Ok(());
                    }
                    format!("{status} {body}")
                }
                Err(e) => e.to_string(),
            };
            if Instant::now() >= deadline {
                let log = self.log();
                return Err(Error::NotReady {
                    component: KIT.name,
                    what: format!(
                        "virt-controller does not lead within {READY_DEADLINE:?} (GET /leader: {last}); \
                         its last log lines:\n{}",
                        crate::e2e::last_lines(&log, 10)
                    ),
                    logs: self.dir.join("log"),
                });
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// virt-controller's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log/virt-controller.log")).unwrap_or_default()
    }

    /// The state directory (`log/`: virt-controller's and the virt-api stand-in's logs).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `kvtool default-vmi`: virt-api's defaulting and validation of `vmi` on CREATE, against the
    /// live KubeVirt CR; the VMI as virt-api would store it, or the causes it is refused for.
    pub fn default_vmi(&self, vmi: &Value) -> Result<Value> {
        virt_api::default_vmi(&self.bin.join("kvtool"), &self.cr_file, vmi)
    }

    /// The stand-in for virt-api's VMI webhook: how many VMIs it defaulted, refused.
    pub fn virt_api(&self) -> &virt_api::VirtApi {
        &self.virt_api
    }

    /// Merge `patch` into the KubeVirt CR's `spec.configuration` (e.g. `{"defaultRuntimeClass":
    /// "kata-tdx"}`; `null` removes a field), let `kvtool default-vmi` read the new CR, and wait until
    /// virt-controller logs that it took that version of the CR (`Updating cluster config from KubeVirt
    /// to resource version '<rv>'`): the pods it renders from then on follow it.
    pub async fn configure(&self, client: &Client, patch: Value) -> Result<()> {
        let crs = kubevirt_api(client);
        let stored = crs
            .merge_patch("kubevirt", json!({"spec": {"configuration": patch}}))
            .await
            .map_err(api("patch the KubeVirt CR"))?;
        write_cr(&self.cr_file, &stored)?;
        let rv = stored.metadata.resource_version.unwrap_or_default();
        let line = format!("Updating cluster config from KubeVirt to resource version '{rv}'");
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.log().contains(&line) {
            if Instant::now() >= deadline {
                return Err(Error::NotReady {
                    component: KIT.name,
                    what: format!("virt-controller did not log {line:?} within 60 s"),
                    logs: self.dir.join("log"),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    }
}

/// `sh -c` in the private mount namespace: `$1` the state directory, then the command.
const MOUNT_NS_SCRIPT: &str = r#"set -e
mount -t overlay overlay -o "lowerdir=/etc,upperdir=$1/etc-upper,workdir=$1/etc-work" /etc
mount -t tmpfs -o size=1m tmpfs /run
mkdir -p /run/secrets/kubernetes.io/serviceaccount
cp "$1/run/namespace" /run/secrets/kubernetes.io/serviceaccount/namespace
shift; exec "$@""#;

/// The KubeVirt CR API.
fn kubevirt_api(client: &Client) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk("kubevirt.io", "v1", "KubeVirt"));
    Api::namespaced_with(client.clone(), NAMESPACE, &ar)
}

/// The kit's directory for `version`, root, and `unshare`, without starting anything.
fn prerequisites(version: Version) -> Result<PathBuf> {
    let top = KIT.dir_from(ENV)?;
    let source = version.kit(&top);
    for f in FILES {
        if !source.join(f).is_file() && !source.join(format!("{f}.xz")).is_file() {
            return Err(KIT.missing(format!("{} has neither {f} nor {f}.xz", source.display())));
        }
    }
    KIT.needs_root("virt-controller runs as root in a private mount namespace")?;
    Ok(source)
}

/// The kit's files in `source` (plain, or `.xz` unpacked into `unpack`).
fn unpack(source: &Path, unpack: &Path) -> Result<PathBuf> {
    KIT.files(source, unpack, &FILES, |f| f != "crds.yaml")
}

/// Apply KubeVirt's CRDs (server-side, taking over fields another test kit set, such as the minimal
/// VMI CRD of [`crate::realcluster`]) and wait until each is established.
async fn apply_crds(client: &Client, file: &Path) -> Result<()> {
    let text = std::fs::read_to_string(file).map_err(KIT.io(format!("read {}", file.display())))?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let params = PatchParams::apply("teeguard-tests").force();
    let mut names = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(&text) {
        let v: Value = serde::Deserialize::deserialize(doc).map_err(|e| Error::Failed {
            what: format!("parse {}", file.display()),
            reason: e.to_string(),
        })?;
        if v.is_null() {
            continue;
        }
        let name = v["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        crds.patch(&name, &params, &Patch::Apply(&v))
            .await
            .map_err(api(format!("apply CRD {name}")))?;
        names.push(name);
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    for name in names {
        loop {
            let established = crds
                .get(&name)
                .await
                .ok()
                .and_then(|c| c.status?.conditions)
                .is_some_and(|c| {
                    c.iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                });
            if established {
                break;
            }
            if Instant::now() >= deadline {
                return Err(Error::Failed {
                    what: format!("CRD {name}"),
                    reason: "not established within 60 s".into(),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

/// The `kubevirt` namespace and KubeVirt CR (`kvtool kv-cr`), with the status virt-operator writes;
/// the stored CR goes to `cr_file` for `kvtool default-vmi`.
async fn create_cr(client: &Client, bin: &Path, cr_file: &Path, version: Version) -> Result<()> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns: Namespace =
        serde_json::from_value(json!({"metadata": {"name": NAMESPACE}})).map_err(|e| {
            Error::Failed {
                what: "the kubevirt namespace".into(),
                reason: e.to_string(),
            }
        })?;
    create_or_keep(&namespaces, &ns)
        .await
        .map_err(api("create namespace kubevirt"))?;
    let out = Command::new(bin.join("kvtool"))
        .args(["kv-cr", NAMESPACE, FEATURE_GATES])
        .output()
        .map_err(KIT.io("run kvtool kv-cr"))?;
    if !out.status.success() {
        return Err(Error::Command {
            command: "kvtool kv-cr".into(),
            status: out.status.to_string(),
            output: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    let cr: Value = serde_yaml::from_slice(&out.stdout).map_err(|e| Error::Failed {
        what: "parse kvtool kv-cr's output".into(),
        reason: e.to_string(),
    })?;
    let crs = kubevirt_api(client);
    crs.patch(
        "kubevirt",
        &PatchParams::apply("teeguard-tests").force(),
        &Patch::Apply(&cr),
    )
    .await
    .map_err(api("apply the KubeVirt CR"))?;
    let status = json!({"status": {
        "phase": "Deployed",
        "defaultArchitecture": "amd64",
        "observedKubeVirtVersion": version.tag(),
        "targetKubeVirtVersion": version.tag(),
        "conditions": [{"type": "Available", "status": "True", "reason": "AllComponentsReady",
            "message": "status written by the teeguard test kit in place of virt-operator"}]
    }});
    let stored = crs
        .merge_patch_status("kubevirt", &status)
        .await
        .map_err(api("write the KubeVirt CR's status"))?;
    write_cr(cr_file, &stored)
}

/// Write the stored KubeVirt CR to `path` for `kvtool default-vmi`, atomically (the virt-api stand-in
/// may be reading it).
fn write_cr(path: &Path, stored: &DynamicObject) -> Result<()> {
    let text = serde_json::to_string(stored).map_err(|e| Error::Failed {
        what: "serialise the KubeVirt CR".into(),
        reason: e.to_string(),
    })?;
    let tmp = path.with_extension("json.new");
    std::fs::write(&tmp, text).map_err(KIT.io(format!("write {}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(KIT.io(format!("rename {}", tmp.display())))
}
