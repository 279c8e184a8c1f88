//! The messages of the plugin's own calls to the runtime (`UpdateContainers`) and of the event that
//! triggers them (`PostStartContainer`, or `StateChange` before NRI v0.12).

use super::{
    DecodeError, EVENT_POST_START_CONTAINER, Reader, Writer, cc, synchronize, unified_misc_max,
};

/// `UpdateContainersRequest` / `UpdateContainersResponse` (plugin → runtime: update containers at
/// any time, not only in an answer).
pub mod update_containers {
    use super::super::{Field, field};
    /// `UpdateContainersRequest`: `repeated ContainerUpdate update = 1`.
    pub const REQ_UPDATE: Field = Field {
        repeated: true,
        ..field("update", 1, "ContainerUpdate")
    };
    /// `UpdateContainersResponse`: `repeated ContainerUpdate failed = 1`.
    pub const RESP_FAILED: Field = Field {
        repeated: true,
        ..field("failed", 1, "ContainerUpdate")
    };
}

/// `PostStartContainerRequest` (NRI v0.12 on), and `StateChangeEvent`, which runtimes before v0.12
/// send for the same event.
pub mod post_start_container {
    use super::super::{Field, field};
    /// `PostStartContainerRequest`: `Container container = 2`.
    pub const REQ_CONTAINER: Field = field("container", 2, "Container");
    /// `StateChangeEvent`: `Event event = 1`.
    pub const EVENT: Field = field("event", 1, "Event");
    /// `StateChangeEvent`: `Container container = 3`.
    pub const EVENT_CONTAINER: Field = field("container", 3, "Container");
}

/// One `ContainerUpdate`: `unified["misc.max"] = value` for container `id`, marked `ignore_failure`
/// (a runtime that cannot apply it, e.g. on cgroup v1, leaves the container as it is, and the plugin
/// stays registered).
pub(in crate::runtime) fn container_update(w: &mut Writer, id: &str, value: &str) {
    use synchronize as f;
    w.string(f::UPDATE_CONTAINER_ID, id);
    w.message(f::UPDATE_LINUX, |linux| {
        linux.message(f::LINUX_UPDATE_RESOURCES, |res| {
            unified_misc_max(res, value)
        });
    });
    w.bool(f::UPDATE_IGNORE_FAILURE, true);
}

/// `UpdateContainersRequest` setting `misc.max` to `value` for container `id`.
pub fn update_containers_request(id: &str, value: &str) -> Vec<u8> {
    let mut w = Writer::new();
    w.message(update_containers::REQ_UPDATE, |u| {
        container_update(u, id, value)
    });
    w.finish()
}

/// The IDs of the containers an `UpdateContainersResponse` says the runtime failed to update.
pub fn failed_updates(bytes: &[u8]) -> Result<Vec<String>, DecodeError> {
    let mut out = Vec::new();
    let mut r = Reader::new(bytes);
    while let Some((n, v)) = r.next_field()? {
        if n == update_containers::RESP_FAILED.number {
            let mut u = Reader::new(v.message()?);
            while let Some((n, v)) = u.next_field()? {
                if n == synchronize::UPDATE_CONTAINER_ID.number {
                    out.push(v.str()?.to_owned());
                }
            }
        }
    }
    Ok(out)
}

/// The ID of the container that started, from a `PostStartContainer` call or a `StateChange` call
/// for `POST_START_CONTAINER`; `None` for any other call or event.
pub fn started_container(method: &str, bytes: &[u8]) -> Result<Option<String>, DecodeError> {
    use post_start_container as f;
    let (container_field, needs_event) = match method {
        "PostStartContainer" => (f::REQ_CONTAINER.number, false),
        "StateChange" => (f::EVENT_CONTAINER.number, true),
        _ => return Ok(None),
    };
    let mut event = None;
    let mut id = None;
    let mut r = Reader::new(bytes);
    while let Some((n, v)) = r.next_field()? {
        if needs_event && n == f::EVENT.number {
            event = Some(v.int()?);
        } else if n == container_field {
            let mut c = Reader::new(v.message()?);
            while let Some((n, v)) = c.next_field()? {
                if n == cc::CONTAINER_ID.number {
                    id = Some(v.str()?.to_owned());
                }
            }
        }
    }
    if needs_event && event != Some(i64::from(EVENT_POST_START_CONTAINER)) {
        return Ok(None);
    }
    Ok(id)
}
