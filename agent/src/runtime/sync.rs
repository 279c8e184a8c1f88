//! NRI's `Synchronize`: when the plugin registers, the runtime lists the pods and containers it already
//! runs (in parts while `more` is set), and the plugin may answer, with the last part, updates for
//! them. Containers created while the plugin was not registered (the agent started after them, was
//! restarted, or was closed by the runtime for a late answer) get their limit this way.

use super::wire::{
    CreateContainer, DecodeError, Reader, Writer, container_update, create_container as cc,
    synchronize as f,
};

/// `ContainerState` values of containers that still run (`CONTAINER_CREATED`, `_PAUSED`, `_RUNNING`).
const LIVE_STATES: [i64; 3] = [1, 2, 3];

/// One part of a `SynchronizeRequest`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SynchronizeRequest {
    /// Pods of this part (only the pod fields of each are set).
    pub pods: Vec<CreateContainer>,
    /// Containers of this part.
    pub containers: Vec<ExistingContainer>,
    /// More parts follow.
    pub more: bool,
}

/// A container the runtime already has.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExistingContainer {
    /// Container ID.
    pub id: String,
    /// Its pod sandbox's ID.
    pub pod_sandbox_id: String,
    /// Its name in the pod.
    pub name: String,
    /// `ContainerState`.
    pub state: i64,
}

impl SynchronizeRequest {
    /// Decode one part, keeping the pods' annotations whose key starts with `keep_prefix`.
    pub fn decode(bytes: &[u8], keep_prefix: &str) -> Result<SynchronizeRequest, DecodeError> {
        let mut out = SynchronizeRequest::default();
        let mut r = Reader::new(bytes);
        while let Some((n, v)) = r.next_field()? {
            match n {
                _ if n == f::REQ_PODS.number => {
                    let mut pod = CreateContainer::default();
                    pod.decode_pod(v.message()?, keep_prefix)?;
                    out.pods.push(pod);
                }
                _ if n == f::REQ_CONTAINERS.number => {
                    out.containers
                        .push(ExistingContainer::decode(v.message()?)?);
                }
                _ if n == f::REQ_MORE.number => out.more = v.int()? != 0,
                _ => {}
            }
        }
        Ok(out)
    }
}

impl ExistingContainer {
    fn decode(bytes: &[u8]) -> Result<ExistingContainer, DecodeError> {
        let mut out = ExistingContainer::default();
        let mut r = Reader::new(bytes);
        while let Some((n, v)) = r.next_field()? {
            match n {
                _ if n == cc::CONTAINER_ID.number => out.id = v.str()?.to_owned(),
                _ if n == cc::CONTAINER_POD_SANDBOX_ID.number => {
                    out.pod_sandbox_id = v.str()?.to_owned();
                }
                _ if n == cc::CONTAINER_NAME.number => out.name = v.str()?.to_owned(),
                _ if n == cc::CONTAINER_STATE.number => out.state = v.int()?,
                _ => {}
            }
        }
        Ok(out)
    }
}

/// The running containers of all parts, each with its pod, in the form `CreateContainer` has (what
/// the plugin decides limits from). Containers whose pod was not listed, or that have stopped, are left
/// out.
pub fn live_containers(
    pods: &[CreateContainer],
    containers: &[ExistingContainer],
) -> Vec<CreateContainer> {
    containers
        .iter()
        .filter(|c| LIVE_STATES.contains(&c.state))
        .filter_map(|c| {
            let pod = pods.iter().find(|p| p.pod_id == c.pod_sandbox_id)?;
            Some(CreateContainer {
                container_id: c.id.clone(),
                container_name: c.name.clone(),
                ..pod.clone()
            })
        })
        .collect()
}

/// `SynchronizeResponse`: `more`, and one update per `(container ID, misc.max)`, each marked
/// `ignore_failure` (a runtime that cannot apply it, e.g. on cgroup v1, leaves the container as it
/// is, and the plugin stays registered).
pub fn synchronize_response(more: bool, updates: &[(String, String)]) -> Vec<u8> {
    let mut w = Writer::new();
    for (id, value) in updates {
        w.message(f::RESP_UPDATE, |u| container_update(u, id, value));
    }
    w.bool(f::RESP_MORE, more);
    w.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::wire::map_entry;

    fn pod(id: &str, uid: &str) -> Vec<u8> {
        let mut w = Writer::new();
        w.string(cc::POD_ID, id)
            .string(cc::POD_NAME, "virt-launcher-vm-abcde")
            .string(cc::POD_UID, uid)
            .string(cc::POD_NAMESPACE, "vms")
            .string_map(
                cc::POD_ANNOTATIONS,
                [("misc-max.teeguard.dev/compute", "tdx 1"), ("other", "x")],
            );
        w.finish()
    }

    fn container(id: &str, pod: &str, name: &str, state: i64) -> Vec<u8> {
        let mut w = Writer::new();
        w.string(cc::CONTAINER_ID, id)
            .string(cc::CONTAINER_POD_SANDBOX_ID, pod)
            .string(cc::CONTAINER_NAME, name)
            .int(cc::CONTAINER_STATE, state);
        w.finish()
    }

    #[test]
    fn running_containers_are_joined_with_their_pods() {
        let mut req = Writer::new();
        req.message(f::REQ_PODS, |w| {
            w.raw(&pod("sandbox-1", "uid-1"));
        })
        .message(f::REQ_CONTAINERS, |w| {
            w.raw(&container("c-compute", "sandbox-1", "compute", 3));
        })
        .message(f::REQ_CONTAINERS, |w| {
            w.raw(&container("c-stopped", "sandbox-1", "init", 4));
        })
        .message(f::REQ_CONTAINERS, |w| {
            w.raw(&container("c-orphan", "sandbox-9", "compute", 3));
        })
        .bool(f::REQ_MORE, true);
        let got = SynchronizeRequest::decode(&req.finish(), "misc-max.teeguard.dev/").expect("ok");
        assert!(got.more);
        assert_eq!(got.pods.len(), 1);
        assert_eq!(
            got.pods[0].annotations.len(),
            1,
            "only teeguard's annotations"
        );
        let live = live_containers(&got.pods, &got.containers);
        assert_eq!(live.len(), 1, "{live:?}");
        assert_eq!(
            (
                live[0].container_id.as_str(),
                live[0].container_name.as_str(),
                live[0].pod_uid.as_str()
            ),
            ("c-compute", "compute", "uid-1")
        );
    }

    #[test]
    fn the_response_carries_one_update_per_container_and_more() {
        let bytes = synchronize_response(false, &[("c1".into(), "tdx 1".into())]);
        let mut r = Reader::new(&bytes);
        let (n, v) = r.next_field().expect("ok").expect("update");
        assert_eq!(n, f::RESP_UPDATE.number);
        // ContainerUpdate: id, linux -> resources -> unified, ignore_failure.
        let mut u = Reader::new(v.message().expect("msg"));
        let (n, v) = u.next_field().expect("ok").expect("id");
        assert_eq!((n, v.str().expect("str")), (1, "c1"));
        let (n, v) = u.next_field().expect("ok").expect("linux");
        assert_eq!(n, 2);
        let (n, v) = Reader::new(v.message().expect("msg"))
            .next_field()
            .expect("ok")
            .expect("resources");
        assert_eq!(n, 1);
        let (n, v) = Reader::new(v.message().expect("msg"))
            .next_field()
            .expect("ok")
            .expect("unified");
        assert_eq!(n, cc::RESOURCES_UNIFIED.number);
        assert_eq!(
            map_entry(v.message().expect("entry")),
            Ok(("misc.max", "tdx 1"))
        );
        let (n, v) = u.next_field().expect("ok").expect("ignore_failure");
        assert_eq!((n, v.int().expect("int")), (3, 1));
        assert!(
            r.next_field().expect("ok").is_none(),
            "more=false is omitted"
        );
        assert_eq!(synchronize_response(true, &[]), vec![0x10, 1]);
    }
}
