//! The agent's NRI messages (`teeguard_agent::runtime::wire`, prost structs with only the fields it
//! uses) agree with upstream's `api.proto` (containerd/nri v0.12.2, in the shared reference folder):
//! each message, every field of ours populated, is read through upstream's
//! schema (`teeguard_tests::proto`) as exactly the fields we mean (by name: a wrong number is dropped as unknown, a wrong type
//! is an error or another value), and upstream's encoding of those fields is read back by ours.

use std::fmt::Debug;

use prost::Message;
use serde_json::{Value, json};
use teeguard_agent::runtime::wire::*;
use teeguard_tests::proto::Schema;

fn agrees<M: Message + Default + PartialEq + Debug>(
    schema: &Schema,
    name: &str,
    ours: M,
    upstream: Value,
) {
    let read = schema
        .decode(name, &ours.encode_to_vec())
        .unwrap_or_else(|e| panic!("{name}: upstream cannot read ours: {e}"));
    assert_eq!(
        read, upstream,
        "{name}: ours as upstream's api.proto reads it"
    );
    let bytes = schema
        .encode(name, &upstream)
        .unwrap_or_else(|e| panic!("{name}: upstream cannot encode {upstream}: {e}"));
    let back = M::decode(bytes.as_slice())
        .unwrap_or_else(|e| panic!("{name}: ours cannot read upstream's: {e}"));
    assert_eq!(back, ours, "{name}: upstream's encoding as ours reads it");
}

fn pod() -> (PodSandbox, Value) {
    (
        PodSandbox {
            id: "sandbox".into(),
            name: "virt-launcher-vm-abcde".into(),
            uid: "0f5a3c1e".into(),
            namespace: "vms".into(),
            annotations: [(
                "misc-max.teeguard.dev/compute".to_string(),
                "tdx 1".to_string(),
            )]
            .into(),
        },
        json!({"id": "sandbox", "name": "virt-launcher-vm-abcde", "uid": "0f5a3c1e", "namespace": "vms",
            "annotations": {"misc-max.teeguard.dev/compute": "tdx 1"}}),
    )
}

fn container() -> (Container, Value) {
    (
        Container {
            id: "c1".into(),
            pod_sandbox_id: "sandbox".into(),
            name: "compute".into(),
            state: CONTAINER_CREATED,
            linux: Some(LinuxContainer {
                resources: Some(LinuxResources {
                    unified: [("misc.max".to_string(), "tdx 0".to_string())].into(),
                }),
            }),
        },
        json!({"id": "c1", "pod_sandbox_id": "sandbox", "name": "compute", "state": 1,
            "linux": {"resources": {"unified": {"misc.max": "tdx 0"}}}}),
    )
}

fn update() -> (ContainerUpdate, Value) {
    (
        container_update("c1", "tdx 1"),
        json!({"container_id": "c1", "linux": {"resources": {"unified": {"misc.max": "tdx 1"}}},
            "ignore_failure": true}),
    )
}

#[test]
fn the_agents_nri_messages_mean_what_upstream_api_proto_says() {
    let s = &Schema::nri().expect("upstream api.proto compiles");
    agrees(
        s,
        "RegisterPluginRequest",
        RegisterPluginRequest {
            plugin_name: "teeguard".into(),
            plugin_idx: "50".into(),
            nri_version: NRI_VERSION.into(),
        },
        json!({"plugin_name": "teeguard", "plugin_idx": "50", "NRI_version": NRI_VERSION}),
    );
    agrees(
        s,
        "ConfigureRequest",
        ConfigureRequest {
            runtime_name: "containerd".into(),
            runtime_version: "v2.4.0".into(),
            request_timeout: 2000,
            nri_version: "v0.12.2".into(),
        },
        json!({"runtime_name": "containerd", "runtime_version": "v2.4.0", "request_timeout": 2000,
            "NRI_version": "v0.12.2"}),
    );
    agrees(
        s,
        "ConfigureResponse",
        ConfigureResponse { events: 72 },
        json!({"events": 72}),
    );
    let ((p, pj), (c, cj), (u, uj)) = (pod(), container(), update());
    agrees(
        s,
        "SynchronizeRequest",
        SynchronizeRequest {
            pods: vec![p.clone()],
            containers: vec![c.clone()],
            more: true,
        },
        json!({"pods": [pj.clone()], "containers": [cj.clone()], "more": true}),
    );
    agrees(
        s,
        "SynchronizeResponse",
        SynchronizeResponse {
            update: vec![u.clone()],
            more: true,
        },
        json!({"update": [uj.clone()], "more": true}),
    );
    agrees(
        s,
        "CreateContainerRequest",
        CreateContainerRequest {
            pod: Some(p),
            container: Some(c.clone()),
        },
        json!({"pod": pj, "container": cj.clone()}),
    );
    agrees(
        s,
        "CreateContainerResponse",
        CreateContainerResponse::decode(create_container_response(Some("tdx 1")).as_slice())
            .expect("ours"),
        json!({"adjust": {"linux": {"resources": {"unified": {"misc.max": "tdx 1"}}}}}),
    );
    agrees(
        s,
        "UpdateContainersRequest",
        UpdateContainersRequest {
            update: vec![u.clone()],
        },
        json!({"update": [uj.clone()]}),
    );
    agrees(
        s,
        "UpdateContainersResponse",
        UpdateContainersResponse { failed: vec![u] },
        json!({"failed": [uj]}),
    );
    for message in ["PostStartContainerRequest", "RemoveContainerRequest"] {
        agrees(
            s,
            message,
            ContainerEventRequest {
                container: Some(c.clone()),
            },
            json!({"container": cj.clone()}),
        );
    }
    agrees(
        s,
        "StateChangeEvent",
        StateChangeEvent {
            event: EVENT_POST_START_CONTAINER as i32,
            container: Some(c),
        },
        json!({"event": EVENT_POST_START_CONTAINER, "container": cj}),
    );
    agrees(s, "Empty", Empty {}, json!({}));

    let value = |e: &str, v: &str| s.enum_value(e, v).expect("enum value");
    assert_eq!(
        value("Event", "CREATE_CONTAINER"),
        EVENT_CREATE_CONTAINER as i32
    );
    assert_eq!(
        value("Event", "POST_START_CONTAINER"),
        EVENT_POST_START_CONTAINER as i32
    );
    assert_eq!(
        value("Event", "REMOVE_CONTAINER"),
        EVENT_REMOVE_CONTAINER as i32
    );
    assert_eq!(
        value("ContainerState", "CONTAINER_CREATED"),
        CONTAINER_CREATED
    );
}
