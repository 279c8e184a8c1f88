//! The NRI messages on the wire: bytes computed by hand, unknown fields skipped, malformed input.

use prost::Message as _;

use super::*;

#[test]
fn register_request_encodes_as_protobuf_does() {
    // Hand-computed: field 1 (key 0x0a), length 8, "teeguard"; field 2 (key 0x12), length 2, "50";
    // field 3 (key 0x1a), length 7, "v0.12.2".
    let mut want = vec![0x0a, 8];
    want.extend_from_slice(b"teeguard");
    want.extend_from_slice(&[0x12, 2, b'5', b'0']);
    want.extend_from_slice(&[0x1a, 7]);
    want.extend_from_slice(b"v0.12.2");
    assert_eq!(register_plugin_request("teeguard", "50"), want);
}

#[test]
fn the_create_container_mask_is_bit_three() {
    assert_eq!(event_mask(&[EVENT_CREATE_CONTAINER]), 0b1000);
    assert_eq!(configure_response(8), vec![0x10, 8]);
}

#[test]
fn an_adjustment_nests_unified_misc_max_four_levels_deep() {
    let bytes = create_container_response(Some("tdx 1"));
    // adjust(1) -> linux(6) -> resources(2) -> unified(6) entry {1: "misc.max", 2: "tdx 1"}: keys
    // 0x0a, 0x32, 0x12, 0x32, then the entry's 0x0a "misc.max" 0x12 "tdx 1".
    let mut want = vec![0x0a, 23, 0x32, 21, 0x12, 19, 0x32, 17, 0x0a, 8];
    want.extend_from_slice(b"misc.max");
    want.extend_from_slice(&[0x12, 5]);
    want.extend_from_slice(b"tdx 1");
    assert_eq!(bytes, want);
    assert!(create_container_response(None).is_empty());
}

#[test]
fn create_container_keeps_teeguards_annotations_and_skips_unknown_fields() {
    let pod = PodSandbox {
        id: "sandbox".into(),
        name: "virt-launcher-vm-abcde".into(),
        uid: "0f5a3c1e-8a8b-4c3e-9e59-1d2f3a4b5c6d".into(),
        namespace: "vms".into(),
        annotations: BTreeMap::from([
            ("misc-max.teeguard.dev/compute".into(), "tdx 1".into()),
            ("kubevirt.io/domain".into(), "vm".into()),
        ]),
    };
    let mut pod = pod.encode_to_vec();
    pod.extend_from_slice(&[0x48, 0x92, 0x21]); // pid = 4242 (field 9), not ours
    let mut ctr = Container {
        id: "c1".into(),
        name: "compute".into(),
        ..Container::default()
    }
    .encode_to_vec();
    ctr.extend_from_slice(&[
        0x88, 0x01, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01,
    ]); // exit_code = -1 (17)
    let mut req = Vec::new();
    for (key, body) in [(0x0a, &pod), (0x12, &ctr)] {
        req.push(key);
        prost::encoding::encode_varint(body.len() as u64, &mut req);
        req.extend_from_slice(body);
    }
    let got = CreateContainer::decode(&req, "misc-max.teeguard.dev/").expect("decode");
    assert_eq!(got.pod_uid, "0f5a3c1e-8a8b-4c3e-9e59-1d2f3a4b5c6d");
    assert_eq!(got.pod_namespace, "vms");
    assert_eq!(got.container_name, "compute");
    assert_eq!(
        got.annotations,
        BTreeMap::from([("misc-max.teeguard.dev/compute".into(), "tdx 1".into())])
    );
}

#[test]
fn malformed_messages_are_errors_not_panics() {
    for bad in [
        &[0x0a, 5, b'a'][..],
        &[0x80],
        &[0x0b],
        &[0x00, 1],
        &[0xff; 11],
    ] {
        assert!(CreateContainer::decode(bad, "").is_err(), "{bad:?}");
    }
    // A string field carrying invalid UTF-8.
    assert!(ConfigureRequest::decode(&[0x12, 1, 0xff][..]).is_err());
}

fn container(id: &str) -> Option<Container> {
    Some(Container {
        id: id.into(),
        name: "compute".into(),
        ..Container::default()
    })
}

#[test]
fn a_start_or_a_removal_is_read_from_its_call_and_from_a_state_change_and_nothing_else_is() {
    let request = |id: &str| {
        ContainerEventRequest {
            container: container(id),
        }
        .encode_to_vec()
    };
    let started = |id: &str| Ok(Some(ContainerEvent::Started(id.into())));
    let removed = |id: &str| Ok(Some(ContainerEvent::Removed(id.into())));
    assert_eq!(
        container_event("PostStartContainer", &request("c1")),
        started("c1")
    );
    assert_eq!(
        container_event("RemoveContainer", &request("c1")),
        removed("c1")
    );
    let event = |number: u32| {
        StateChangeEvent {
            event: number as i32,
            container: container("c2"),
        }
        .encode_to_vec()
    };
    assert_eq!(
        container_event("StateChange", &event(EVENT_POST_START_CONTAINER)),
        started("c2"),
        "runtimes before NRI v0.12 send the events as a StateChange"
    );
    assert_eq!(
        container_event("StateChange", &event(EVENT_REMOVE_CONTAINER)),
        removed("c2")
    );
    assert_eq!(container_event("StateChange", &event(6)), Ok(None));
    assert_eq!(container_event("StopContainer", &request("c1")), Ok(None));
    assert_eq!(
        container_event("RemoveContainer", &request("")),
        Ok(None),
        "no ID"
    );
    assert!(container_event("PostStartContainer", &[0x12, 5, 1]).is_err());
}

#[test]
fn an_update_request_carries_misc_max_and_ignore_failure_and_failures_are_read_back() {
    let bytes = update_containers_request("c1", "tdx 1");
    let req = UpdateContainersRequest::decode(bytes.as_slice()).expect("decode");
    assert_eq!(req.update, [container_update("c1", "tdx 1")]);
    assert!(req.update[0].ignore_failure);
    // The response lists failed updates in the same ContainerUpdate shape: read the request as one.
    assert_eq!(failed_updates(&bytes), Ok(vec!["c1".to_string()]));
    assert_eq!(failed_updates(&[]), Ok(Vec::new()));
}
