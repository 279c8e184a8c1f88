//! Encoding and decoding the NRI messages: round trips, unknown fields skipped, malformed input.

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
    // adjust(1) -> linux(6) -> resources(2) -> unified(6) entry {1: "misc.max", 2: "tdx 1"}.
    let mut r = Reader::new(&bytes);
    let (n, v) = r.next_field().expect("ok").expect("adjust");
    assert_eq!(n, 1);
    let mut r = Reader::new(v.message().expect("msg"));
    let (n, v) = r.next_field().expect("ok").expect("linux");
    assert_eq!(n, 6);
    let mut r = Reader::new(v.message().expect("msg"));
    let (n, v) = r.next_field().expect("ok").expect("resources");
    assert_eq!(n, 2);
    let mut r = Reader::new(v.message().expect("msg"));
    let (n, v) = r.next_field().expect("ok").expect("unified");
    assert_eq!(n, 6);
    assert_eq!(
        map_entry(v.message().expect("entry")),
        Ok(("misc.max", "tdx 1"))
    );
    assert!(create_container_response(None).is_empty());
}

#[test]
fn create_container_decodes_and_skips_unknown_fields() {
    let mut pod = Writer::new();
    pod.string(cc::POD_ID, "sandbox")
        .string(cc::POD_NAME, "virt-launcher-vm-abcde")
        .string(cc::POD_UID, "0f5a3c1e-8a8b-4c3e-9e59-1d2f3a4b5c6d")
        .string(cc::POD_NAMESPACE, "vms")
        .string_map(
            cc::POD_ANNOTATIONS,
            [
                ("misc-max.teeguard.dev/compute", "tdx 1"),
                ("kubevirt.io/domain", "vm"),
            ],
        )
        .int(field("pid", 9, "uint32"), 4242);
    let pod = pod.finish();
    let mut ctr = Writer::new();
    ctr.string(cc::CONTAINER_ID, "c1")
        .string(cc::CONTAINER_NAME, "compute")
        .int(field("exit_code", 17, "int32"), -1);
    let ctr = ctr.finish();
    let mut req = Writer::new();
    req.message(cc::REQ_POD, |w| {
        w.raw(&pod);
    })
    .message(cc::REQ_CONTAINER, |w| {
        w.raw(&ctr);
    });
    let got = CreateContainer::decode(&req.finish(), "misc-max.teeguard.dev/").expect("decode");
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
    assert!(ConfigureRequest::decode(&[0x12, 1, 0xff]).is_err());
}

fn container(id: &str) -> Vec<u8> {
    let mut w = Writer::new();
    w.string(cc::CONTAINER_ID, id)
        .string(cc::CONTAINER_NAME, "compute");
    w.finish()
}

#[test]
fn a_started_container_is_read_from_post_start_and_from_a_post_start_state_change_only() {
    use post_start_container as f;
    let mut post_start = Writer::new();
    post_start.message(f::REQ_CONTAINER, |c| {
        c.raw(&container("c1"));
    });
    let post_start = post_start.finish();
    assert_eq!(
        started_container("PostStartContainer", &post_start),
        Ok(Some("c1".into()))
    );
    let event = |number: u32| {
        let mut w = Writer::new();
        w.int(f::EVENT, i64::from(number))
            .message(f::EVENT_CONTAINER, |c| {
                c.raw(&container("c2"));
            });
        w.finish()
    };
    assert_eq!(
        started_container("StateChange", &event(EVENT_POST_START_CONTAINER)),
        Ok(Some("c2".into())),
        "runtimes before NRI v0.12 send the event as a StateChange"
    );
    assert_eq!(started_container("StateChange", &event(6)), Ok(None));
    assert_eq!(started_container("StopContainer", &post_start), Ok(None));
    assert!(started_container("PostStartContainer", &[0x12, 5, 1]).is_err());
}

#[test]
fn an_update_request_carries_misc_max_and_ignore_failure_and_failures_are_read_back() {
    let bytes = update_containers_request("c1", "tdx 1");
    // The response lists failed updates in the same ContainerUpdate shape: read the request as one.
    assert_eq!(failed_updates(&bytes), Ok(vec!["c1".to_string()]));
    let mut r = Reader::new(&bytes);
    let (n, v) = r.next_field().expect("ok").expect("update");
    assert_eq!(n, update_containers::REQ_UPDATE.number);
    let mut u = Reader::new(v.message().expect("msg"));
    let mut fields = Vec::new();
    while let Some((n, _)) = u.next_field().expect("ok") {
        fields.push(n);
    }
    assert_eq!(fields, [1, 2, 3], "container_id, linux, ignore_failure");
    assert_eq!(failed_updates(&[]), Ok(Vec::new()));
}
