//! The NRI messages the plugin uses (containerd/nri `pkg/api/api.proto`), as prost structs carrying
//! only the fields the plugin reads or writes: protobuf skips the others, so no protoc and no build
//! script (as `crate::kubelet::proto`). `tests/tests/nri_proto.rs` encodes each message, populated, and
//! reads it with upstream's `api.proto` (and the other way round), so a renumbered or retyped field fails
//! the tests instead of a container start.

use std::collections::BTreeMap;

use prost::Message as _;

pub use prost::DecodeError;

/// The NRI release whose `api.proto` these messages follow (the one in `../shared/reference/nri/`, byte
/// for byte v0.12.2's `pkg/api/api.proto`); sent at registration, so the runtime logs it instead of
/// "unknown".
pub const NRI_VERSION: &str = "v0.12.2";

/// NRI's `CREATE_CONTAINER` event number (`enum Event`).
pub const EVENT_CREATE_CONTAINER: u32 = 4;
/// NRI's `POST_START_CONTAINER` event number (`enum Event`).
pub const EVENT_POST_START_CONTAINER: u32 = 7;
/// NRI's `REMOVE_CONTAINER` event number (`enum Event`).
pub const EVENT_REMOVE_CONTAINER: u32 = 11;
/// `ContainerState`: `CONTAINER_CREATED` (created, not started yet).
pub const CONTAINER_CREATED: i32 = 1;

/// The `events` bitmask subscribing to the given events (`1 << (event - 1)` each).
pub fn event_mask(events: &[u32]) -> i32 {
    events.iter().fold(0i32, |m, e| m | (1i32 << (e - 1)))
}

/// `RegisterPluginRequest` (plugin → runtime).
#[derive(Clone, PartialEq, prost::Message)]
pub struct RegisterPluginRequest {
    /// `plugin_name`.
    #[prost(string, tag = "1")]
    pub plugin_name: String,
    /// `plugin_idx`: two digits, the plugin's place in the runtime's order.
    #[prost(string, tag = "2")]
    pub plugin_idx: String,
    /// `NRI_version`.
    #[prost(string, tag = "3")]
    pub nri_version: String,
}

/// `ConfigureRequest` (runtime → plugin).
#[derive(Clone, PartialEq, prost::Message)]
pub struct ConfigureRequest {
    /// The runtime's name (`containerd`, `cri-o`).
    #[prost(string, tag = "2")]
    pub runtime_name: String,
    /// The runtime's version.
    #[prost(string, tag = "3")]
    pub runtime_version: String,
    /// How long the runtime waits for a plugin's answer (milliseconds; 0 = not said).
    #[prost(int64, tag = "5")]
    pub request_timeout: i64,
    /// The NRI release the runtime was built with (empty before NRI v0.10).
    #[prost(string, tag = "6")]
    pub nri_version: String,
}

/// `ConfigureResponse` (plugin → runtime).
#[derive(Clone, PartialEq, prost::Message)]
pub struct ConfigureResponse {
    /// Bit `event - 1` set per subscribed event ([`event_mask`]).
    #[prost(int32, tag = "2")]
    pub events: i32,
}

/// `SynchronizeRequest`: one part of what the runtime already runs.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SynchronizeRequest {
    /// Pods.
    #[prost(message, repeated, tag = "1")]
    pub pods: Vec<PodSandbox>,
    /// Containers.
    #[prost(message, repeated, tag = "2")]
    pub containers: Vec<Container>,
    /// More parts follow.
    #[prost(bool, tag = "3")]
    pub more: bool,
}

/// `SynchronizeResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SynchronizeResponse {
    /// Updates of containers that already run.
    #[prost(message, repeated, tag = "1")]
    pub update: Vec<ContainerUpdate>,
    /// The runtime should send the next part.
    #[prost(bool, tag = "2")]
    pub more: bool,
}

/// `CreateContainerRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CreateContainerRequest {
    /// The container's pod.
    #[prost(message, optional, tag = "1")]
    pub pod: Option<PodSandbox>,
    /// The container.
    #[prost(message, optional, tag = "2")]
    pub container: Option<Container>,
}

/// `CreateContainerResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CreateContainerResponse {
    /// The change to the container's OCI config.
    #[prost(message, optional, tag = "1")]
    pub adjust: Option<ContainerAdjustment>,
}

/// `PodSandbox`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PodSandbox {
    /// Sandbox ID.
    #[prost(string, tag = "1")]
    pub id: String,
    /// Pod name.
    #[prost(string, tag = "2")]
    pub name: String,
    /// Pod UID.
    #[prost(string, tag = "3")]
    pub uid: String,
    /// Pod namespace.
    #[prost(string, tag = "4")]
    pub namespace: String,
    /// Pod annotations.
    #[prost(btree_map = "string, string", tag = "6")]
    pub annotations: BTreeMap<String, String>,
}

/// `Container`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Container {
    /// Container ID.
    #[prost(string, tag = "1")]
    pub id: String,
    /// Its pod sandbox's ID.
    #[prost(string, tag = "2")]
    pub pod_sandbox_id: String,
    /// Its name in the pod.
    #[prost(string, tag = "3")]
    pub name: String,
    /// `ContainerState` ([`CONTAINER_CREATED`], ...).
    #[prost(int32, tag = "4")]
    pub state: i32,
    /// Linux-specific: its resources as they are (`Synchronize` shows a zero strict mode gave).
    #[prost(message, optional, tag = "11")]
    pub linux: Option<LinuxContainer>,
}

/// `LinuxContainer`: its resources only.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LinuxContainer {
    /// Resources.
    #[prost(message, optional, tag = "3")]
    pub resources: Option<LinuxResources>,
}

/// `ContainerAdjustment`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerAdjustment {
    /// Linux-specific changes.
    #[prost(message, optional, tag = "6")]
    pub linux: Option<LinuxContainerAdjustment>,
}

/// `LinuxContainerAdjustment`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LinuxContainerAdjustment {
    /// Resources.
    #[prost(message, optional, tag = "2")]
    pub resources: Option<LinuxResources>,
}

/// `LinuxResources`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LinuxResources {
    /// cgroup v2 files to write (`misc.max`).
    #[prost(btree_map = "string, string", tag = "6")]
    pub unified: BTreeMap<String, String>,
}

/// `ContainerUpdate`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerUpdate {
    /// The container.
    #[prost(string, tag = "1")]
    pub container_id: String,
    /// Linux-specific changes.
    #[prost(message, optional, tag = "2")]
    pub linux: Option<LinuxContainerUpdate>,
    /// A runtime that cannot apply it leaves the container as it is instead of failing.
    #[prost(bool, tag = "3")]
    pub ignore_failure: bool,
}

/// `LinuxContainerUpdate`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LinuxContainerUpdate {
    /// Resources.
    #[prost(message, optional, tag = "1")]
    pub resources: Option<LinuxResources>,
}

/// `UpdateContainersRequest` (plugin → runtime: update containers at any time, not only in an answer).
#[derive(Clone, PartialEq, prost::Message)]
pub struct UpdateContainersRequest {
    /// The updates.
    #[prost(message, repeated, tag = "1")]
    pub update: Vec<ContainerUpdate>,
}

/// `UpdateContainersResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct UpdateContainersResponse {
    /// The updates the runtime could not apply.
    #[prost(message, repeated, tag = "1")]
    pub failed: Vec<ContainerUpdate>,
}

/// `PostStartContainerRequest` (NRI v0.12 on) and `RemoveContainerRequest`: the same fields.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ContainerEventRequest {
    /// The container.
    #[prost(message, optional, tag = "2")]
    pub container: Option<Container>,
}

/// `StateChangeEvent`, which runtimes before NRI v0.12 send for `POST_START_CONTAINER`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StateChangeEvent {
    /// `Event`.
    #[prost(int32, tag = "1")]
    pub event: i32,
    /// The container.
    #[prost(message, optional, tag = "3")]
    pub container: Option<Container>,
}

/// `Empty`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Empty {}

/// What the plugin decides a container's limit from: its pod and the container, flattened.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CreateContainer {
    /// Pod sandbox ID.
    pub pod_id: String,
    /// Pod name.
    pub pod_name: String,
    /// Pod UID.
    pub pod_uid: String,
    /// Pod namespace.
    pub pod_namespace: String,
    /// The pod's annotations that are teeguard's (`misc-max.teeguard.dev/…`); others are dropped.
    pub annotations: BTreeMap<String, String>,
    /// Container ID.
    pub container_id: String,
    /// Container name.
    pub container_name: String,
}

impl CreateContainer {
    /// Decode a `CreateContainerRequest`, keeping only the annotations whose key starts with
    /// `keep_prefix`.
    pub fn decode(bytes: &[u8], keep_prefix: &str) -> Result<CreateContainer, DecodeError> {
        let req = CreateContainerRequest::decode(bytes)?;
        let mut out = CreateContainer::of_pod(req.pod.unwrap_or_default(), keep_prefix);
        let container = req.container.unwrap_or_default();
        out.container_id = container.id;
        out.container_name = container.name;
        Ok(out)
    }

    /// The pod's fields, keeping only the annotations whose key starts with `keep_prefix`.
    pub fn of_pod(pod: PodSandbox, keep_prefix: &str) -> CreateContainer {
        let mut annotations = pod.annotations;
        annotations.retain(|k, _| k.starts_with(keep_prefix));
        CreateContainer {
            pod_id: pod.id,
            pod_name: pod.name,
            pod_uid: pod.uid,
            pod_namespace: pod.namespace,
            annotations,
            ..CreateContainer::default()
        }
    }
}

/// `RegisterPluginRequest`, with [`NRI_VERSION`].
pub fn register_plugin_request(name: &str, index: &str) -> Vec<u8> {
    RegisterPluginRequest {
        plugin_name: name.to_owned(),
        plugin_idx: index.to_owned(),
        nri_version: NRI_VERSION.to_owned(),
    }
    .encode_to_vec()
}

/// `ConfigureResponse` subscribing to `events` (a mask from [`event_mask`]).
pub fn configure_response(events: i32) -> Vec<u8> {
    ConfigureResponse { events }.encode_to_vec()
}

/// `LinuxResources` with `unified["misc.max"] = value`.
fn misc_max(value: &str) -> LinuxResources {
    LinuxResources {
        unified: BTreeMap::from([("misc.max".to_owned(), value.to_owned())]),
    }
}

/// `CreateContainerResponse`: no adjustment (`None`), or `linux.resources.unified["misc.max"]`.
pub fn create_container_response(value: Option<&str>) -> Vec<u8> {
    CreateContainerResponse {
        adjust: value.map(|v| ContainerAdjustment {
            linux: Some(LinuxContainerAdjustment {
                resources: Some(misc_max(v)),
            }),
        }),
    }
    .encode_to_vec()
}

/// One `ContainerUpdate`: `unified["misc.max"] = value` for container `id`, marked `ignore_failure`
/// (a runtime that cannot apply it, e.g. on cgroup v1, leaves the container as it is, and the plugin
/// stays registered).
pub fn container_update(id: &str, value: &str) -> ContainerUpdate {
    ContainerUpdate {
        container_id: id.to_owned(),
        linux: Some(LinuxContainerUpdate {
            resources: Some(misc_max(value)),
        }),
        ignore_failure: true,
    }
}

/// `UpdateContainersRequest` setting `misc.max` to `value` for container `id`.
pub fn update_containers_request(id: &str, value: &str) -> Vec<u8> {
    UpdateContainersRequest {
        update: vec![container_update(id, value)],
    }
    .encode_to_vec()
}

/// The IDs of the containers an `UpdateContainersResponse` says the runtime failed to update.
pub fn failed_updates(bytes: &[u8]) -> Result<Vec<String>, DecodeError> {
    let resp = UpdateContainersResponse::decode(bytes)?;
    Ok(resp.failed.into_iter().map(|u| u.container_id).collect())
}

/// A container event the plugin subscribes to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ContainerEvent {
    /// The container with this ID started.
    Started(String),
    /// The container with this ID was removed.
    Removed(String),
}

/// The container event of a `PostStartContainer` or `RemoveContainer` call, or of a `StateChange`
/// call for `POST_START_CONTAINER` or `REMOVE_CONTAINER` (runtimes before NRI v0.12 send those);
/// `None` for any other call or event.
pub fn container_event(method: &str, bytes: &[u8]) -> Result<Option<ContainerEvent>, DecodeError> {
    let (event, container) = match method {
        "PostStartContainer" => (
            EVENT_POST_START_CONTAINER,
            ContainerEventRequest::decode(bytes)?.container,
        ),
        "RemoveContainer" => (
            EVENT_REMOVE_CONTAINER,
            ContainerEventRequest::decode(bytes)?.container,
        ),
        "StateChange" => {
            let e = StateChangeEvent::decode(bytes)?;
            (u32::try_from(e.event).unwrap_or(0), e.container)
        }
        _ => return Ok(None),
    };
    let Some(id) = container.map(|c| c.id).filter(|id| !id.is_empty()) else {
        return Ok(None);
    };
    Ok(match event {
        EVENT_POST_START_CONTAINER => Some(ContainerEvent::Started(id)),
        EVENT_REMOVE_CONTAINER => Some(ContainerEvent::Removed(id)),
        _ => None,
    })
}

#[cfg(test)]
mod tests;
