//! NRI's `Synchronize`: when the plugin registers, the runtime lists the pods and containers it already
//! runs (in parts while `more` is set), and the plugin may answer, with the last part, updates for
//! them. Containers created while the plugin was not registered (the agent started after them, was
//! restarted, or was closed by the runtime for a late answer) get their limit this way.

use prost::Message as _;

use super::wire::{self, CreateContainer, DecodeError, SynchronizeResponse, container_update};

/// `ContainerState` values of containers that still run (`CONTAINER_CREATED`, `_PAUSED`, `_RUNNING`).
const LIVE_STATES: [i32; 3] = [1, 2, 3];

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
    pub state: i32,
    /// Its `misc.max` as the runtime has it (`linux.resources.unified`).
    pub misc_max: Option<String>,
}

impl SynchronizeRequest {
    /// Decode one part, keeping the pods' annotations whose key starts with `keep_prefix`.
    pub fn decode(bytes: &[u8], keep_prefix: &str) -> Result<SynchronizeRequest, DecodeError> {
        let req = wire::SynchronizeRequest::decode(bytes)?;
        Ok(SynchronizeRequest {
            pods: req
                .pods
                .into_iter()
                .map(|p| CreateContainer::of_pod(p, keep_prefix))
                .collect(),
            containers: req
                .containers
                .into_iter()
                .map(|c| ExistingContainer {
                    misc_max: c
                        .linux
                        .and_then(|l| l.resources)
                        .and_then(|mut r| r.unified.remove("misc.max")),
                    id: c.id,
                    pod_sandbox_id: c.pod_sandbox_id,
                    name: c.name,
                    state: c.state,
                })
                .collect(),
            more: req.more,
        })
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
    SynchronizeResponse {
        update: updates
            .iter()
            .map(|(id, value)| container_update(id, value))
            .collect(),
        more,
    }
    .encode_to_vec()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::runtime::wire::{Container, PodSandbox};

    fn pod(id: &str, uid: &str) -> PodSandbox {
        PodSandbox {
            id: id.into(),
            name: "virt-launcher-vm-abcde".into(),
            uid: uid.into(),
            namespace: "vms".into(),
            annotations: BTreeMap::from([
                ("misc-max.teeguard.dev/compute".into(), "tdx 1".into()),
                ("other".into(), "x".into()),
            ]),
        }
    }

    fn container(id: &str, pod: &str, name: &str, state: i32) -> Container {
        Container {
            id: id.into(),
            pod_sandbox_id: pod.into(),
            name: name.into(),
            state,
            linux: None,
        }
    }

    #[test]
    fn running_containers_are_joined_with_their_pods() {
        let req = wire::SynchronizeRequest {
            pods: vec![pod("sandbox-1", "uid-1")],
            containers: vec![
                container("c-compute", "sandbox-1", "compute", 3),
                container("c-stopped", "sandbox-1", "init", 4),
                container("c-orphan", "sandbox-9", "compute", 3),
            ],
            more: true,
        };
        let got =
            SynchronizeRequest::decode(&req.encode_to_vec(), "misc-max.teeguard.dev/").expect("ok");
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
        let got = SynchronizeResponse::decode(bytes.as_slice()).expect("decode");
        assert_eq!(got.update, [container_update("c1", "tdx 1")]);
        let unified = got.update[0]
            .linux
            .as_ref()
            .and_then(|l| l.resources.as_ref())
            .map(|r| r.unified.clone());
        assert_eq!(
            unified,
            Some(BTreeMap::from([("misc.max".into(), "tdx 1".into())]))
        );
        assert!(got.update[0].ignore_failure);
        assert!(!got.more);
        assert_eq!(synchronize_response(true, &[]), vec![0x10, 1]);
    }
}
