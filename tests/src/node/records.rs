//! The OCI configs `runc-record` saved (`<state>/record/<container id>.json`): what the runtime told
//! runc for each sandbox and container, before `linux.resources.unified` was dropped for this host.
//! Which pod and container a config belongs to comes from the annotations the runtime writes into it
//! (containerd: `io.kubernetes.cri.*`; CRI-O: `io.kubernetes.pod.*`, `io.kubernetes.container.name`,
//! `io.kubernetes.cri-o.ContainerType`).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::SystemTime;

use serde_json::Value;

/// A sandbox or a container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContainerKind {
    /// The pod's sandbox (pause).
    Sandbox,
    /// A container of the pod (init containers included).
    Container,
}

/// One recorded OCI config.
#[derive(Clone, Debug)]
pub struct Recorded {
    /// The container ID (the file's name).
    pub id: String,
    /// Sandbox or container.
    pub kind: ContainerKind,
    /// The container's name in the pod (empty for a sandbox).
    pub container: String,
    /// The pod's UID.
    pub pod_uid: String,
    /// `namespace/name` of the pod.
    pub pod: String,
    /// `linux.resources.unified` as the runtime wrote it.
    pub unified: BTreeMap<String, String>,
    /// The annotations of the OCI config.
    pub annotations: BTreeMap<String, String>,
    /// When it was recorded (the file's modification time).
    pub at: SystemTime,
    /// The whole OCI config as the runtime wrote it (the kernel tests run it with runc in a guest).
    pub config: Value,
}

impl Recorded {
    /// `unified["misc.max"]`, if set.
    pub fn misc_max(&self) -> Option<&str> {
        self.unified.get("misc.max").map(String::as_str)
    }

    /// Parse one config; `None` when it is not an OCI config of a Kubernetes pod.
    pub fn parse(id: &str, config: &Value, at: SystemTime) -> Option<Recorded> {
        let strings = |v: Option<&Value>| -> BTreeMap<String, String> {
            v.and_then(Value::as_object)
                .map(|m| {
                    m.iter()
                        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                        .collect()
                })
                .unwrap_or_default()
        };
        let annotations = strings(config.get("annotations"));
        let unified = strings(config.pointer("/linux/resources/unified"));
        let get = |keys: &[&str]| keys.iter().find_map(|k| annotations.get(*k).cloned());
        let kind = match get(&[
            "io.kubernetes.cri.container-type",
            "io.kubernetes.cri-o.ContainerType",
        ])?
        .as_str()
        {
            "sandbox" => ContainerKind::Sandbox,
            _ => ContainerKind::Container,
        };
        let container = match kind {
            ContainerKind::Sandbox => String::new(),
            ContainerKind::Container => get(&[
                "io.kubernetes.cri.container-name",
                "io.kubernetes.container.name",
            ])?,
        };
        let pod_uid = get(&["io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"])?;
        let name = get(&["io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"])?;
        let namespace = get(&[
            "io.kubernetes.cri.sandbox-namespace",
            "io.kubernetes.pod.namespace",
        ])?;
        Some(Recorded {
            id: id.to_string(),
            kind,
            container,
            pod_uid,
            pod: format!("{namespace}/{name}"),
            unified,
            annotations,
            at,
            config: config.clone(),
        })
    }
}

/// A resources update runc was asked to apply to a running container, and its answer.
#[derive(Clone, Debug)]
pub struct RecordedUpdate {
    /// The container ID.
    pub container_id: String,
    /// The resources asked for (`LinuxResources` as JSON).
    pub resources: Value,
    /// runc's exit code (`None` while it runs).
    pub exit_code: Option<i32>,
    /// What runc wrote to its standard error.
    pub stderr: String,
    /// When it was asked.
    pub at: SystemTime,
}

impl RecordedUpdate {
    /// `unified["misc.max"]` asked for, if any.
    pub fn misc_max(&self) -> Option<&str> {
        self.resources.pointer("/unified/misc.max")?.as_str()
    }
}

/// Every update in `dir`, oldest first.
pub(super) fn read_updates(dir: &Path) -> Vec<RecordedUpdate> {
    let mut out: Vec<RecordedUpdate> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let path = e.path();
            let stem = path.file_name()?.to_str()?.strip_suffix(".json")?;
            let (container_id, _) = stem.strip_prefix("update-")?.rsplit_once('-')?;
            let at = e.metadata().ok()?.modified().ok()?;
            let resources = serde_json::from_slice(&std::fs::read(&path).ok()?).ok()?;
            let read = |ext: &str| std::fs::read_to_string(dir.join(format!("{stem}.{ext}"))).ok();
            Some(RecordedUpdate {
                container_id: container_id.to_string(),
                resources,
                exit_code: read("rc").and_then(|s| s.trim().parse().ok()),
                stderr: read("err").unwrap_or_default(),
                at,
            })
        })
        .collect();
    out.sort_by_key(|u| u.at);
    out
}

/// Every config in `dir` that parses, oldest first.
pub(super) fn read_all(dir: &Path) -> Vec<Recorded> {
    let mut out: Vec<Recorded> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let path = e.path();
            let id = path.file_stem()?.to_str()?.to_string();
            if id.starts_with("update-") {
                return None;
            }
            let at = e.metadata().ok()?.modified().ok()?;
            let config: Value = serde_json::from_slice(&std::fs::read(&path).ok()?).ok()?;
            Recorded::parse(&id, &config, at)
        })
        .collect();
    out.sort_by_key(|r| r.at);
    out
}

/// `container name -> misc.max` of a pod's recorded containers (`-` for none); panics when its sandbox
/// (if the runtime ran one: CRI-O drops the infra container of pods that need none) carries anything.
pub fn limits(records: &[Recorded]) -> BTreeMap<String, String> {
    for r in records.iter().filter(|r| r.kind == ContainerKind::Sandbox) {
        assert!(
            r.unified.is_empty(),
            "sandbox {} of {}: {:?}",
            r.id,
            r.pod,
            r.unified
        );
    }
    records
        .iter()
        .filter(|r| r.kind == ContainerKind::Container)
        .map(|r| (r.container.clone(), r.misc_max().unwrap_or("-").to_string()))
        .collect()
}
