//! Tests of the dynamic codec against the upstream NRI schema and hand-computed bytes.

use serde_json::json;

use super::*;
use crate::nri::proto::{load_upstream, parse};
use crate::nri::wire::put_varint_field;

fn upstream() -> Schema {
    load_upstream().expect("the upstream NRI api.proto parses")
}

#[test]
fn register_plugin_request_bytes_are_pinned() {
    let s = upstream();
    let body = json!({"plugin_name": "teeguard", "plugin_idx": "50"});
    let bytes = encode(&s, "RegisterPluginRequest", &body).expect("encodes");
    let mut expected = vec![0x0a, 0x08];
    expected.extend_from_slice(b"teeguard");
    expected.extend_from_slice(&[0x12, 0x02, b'5', b'0']);
    assert_eq!(bytes, expected);
    assert_eq!(
        decode(&s, "RegisterPluginRequest", &expected).expect("decodes"),
        body
    );
}

#[test]
fn varints_negative_numbers_and_defaults_are_pinned() {
    let s = upstream();
    // ConfigureResponse.events = 2 (int32): key 0x10, value 8.
    let bytes = encode(&s, "ConfigureResponse", &json!({"events": 8})).expect("encodes");
    assert_eq!(bytes, [0x10, 0x08]);
    // Negative int32/int64: ten-byte two's complement varints.
    let bytes = encode(&s, "OptionalInt", &json!({"value": -1})).expect("encodes");
    assert_eq!(
        bytes,
        [
            0x08, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01
        ]
    );
    let bytes = encode(&s, "LinuxIOPriority", &json!({"priority": -2})).expect("encodes");
    assert_eq!(bytes[0], 0x10);
    assert_eq!(bytes.len(), 11);
    assert_eq!(
        decode(&s, "LinuxIOPriority", &bytes).expect("decodes"),
        json!({"priority": -2})
    );
    // 300 = 0xac 0x02.
    let bytes = encode(&s, "OptionalUInt32", &json!({"value": 300})).expect("encodes");
    assert_eq!(bytes, [0x08, 0xac, 0x02]);
    // Defaults are left out; an empty message field is still written.
    let bytes = encode(
        &s,
        "ContainerUpdate",
        &json!({"container_id": "", "ignore_failure": false, "linux": {}}),
    )
    .expect("encodes");
    assert_eq!(bytes, [0x12, 0x00]);
    assert_eq!(
        decode(&s, "ContainerUpdate", &bytes).expect("decodes"),
        json!({"linux": {}})
    );
    assert_eq!(decode(&s, "Empty", &[]).expect("decodes"), json!({}));
}

#[test]
fn create_container_request_round_trips() {
    let s = upstream();
    let request = json!({
        "pod": {
            "id": "sandbox-1",
            "name": "tee-pod",
            "uid": "8f0c-uid",
            "namespace": "default",
            "labels": {"app": "enclave", "tier": "backend"},
            "annotations": {"teeguard.dev/keys": "2", "io.kubernetes.pod.name": "tee-pod"},
            "linux": {"cgroup_parent": "/kubepods/burstable/pod8f0c", "pod_resources": {"unified": {"misc.max": "sev 2"}}},
            "pid": 4242,
            "ips": ["10.0.0.7", "fd00::7"],
        },
        "container": {
            "id": "ctr-1",
            "pod_sandbox_id": "sandbox-1",
            "name": "app",
            "state": 1,
            "labels": {"io.kubernetes.container.name": "app"},
            "args": ["/bin/app", "--serve"],
            "env": ["A=1"],
            "mounts": [{"destination": "/data", "type": "bind", "source": "/srv", "options": ["rbind", "ro"]}],
            "linux": {
                "resources": {"memory": {"limit": {"value": 1_073_741_824i64}}, "cpu": {"shares": {"value": 1024}}},
                "oom_score_adj": {"value": -997},
                "net_devices": {"eth1": {"name": "net1"}},
                "scheduler": {"flags": [1, 4], "nice": -5},
            },
            "created_at": 1_700_000_000_123_456_789i64,
            "exit_code": -1,
            "user": {"uid": 1000, "gid": 1000, "additional_gids": [5, 6, 70000]},
        },
    });
    let bytes = encode(&s, "CreateContainerRequest", &request).expect("encodes");
    let back = decode(&s, "CreateContainerRequest", &bytes).expect("decodes");
    assert_eq!(back, request);
    // A response with the adjustment the agent sends.
    let response = json!({
        "adjust": {"linux": {"resources": {"unified": {"misc.max": "sev 1"}}}},
        "update": [{"container_id": "other", "linux": {"resources": {"pids": {"limit": 10}}}}],
        "evict": [{"container_id": "evil", "reason": "no keys"}],
    });
    let bytes = encode(&s, "CreateContainerResponse", &response).expect("encodes");
    assert_eq!(
        decode(&s, "CreateContainerResponse", &bytes).expect("decodes"),
        response
    );
}

#[test]
fn enum_names_numeric_strings_and_int_map_keys_encode() {
    let s = upstream();
    let bytes = encode(
        &s,
        "StateChangeEvent",
        &json!({"event": "CREATE_CONTAINER"}),
    )
    .expect("encodes");
    assert_eq!(bytes, [0x08, 0x04]);
    let owners = json!({"simple": {"8": "teeguard", "27": "other"}, "compound": {"1": {"owners": {"a": "p"}}}});
    let bytes = encode(&s, "FieldOwners", &owners).expect("encodes");
    assert_eq!(decode(&s, "FieldOwners", &bytes).expect("decodes"), owners);
    let bytes = encode(&s, "OptionalInt64", &json!({"value": "-9"})).expect("encodes");
    assert_eq!(
        decode(&s, "OptionalInt64", &bytes).expect("decodes"),
        json!({"value": -9})
    );
}

#[test]
fn decode_accepts_unpacked_scalars_skips_unknown_fields_and_merges() {
    let s = upstream();
    let mut bytes = Vec::new();
    // User.additional_gids (3) unpacked, twice; then packed once.
    put_varint_field(&mut bytes, 3, 7);
    put_varint_field(&mut bytes, 3, 8);
    put_len_field(&mut bytes, 3, &[9, 10]);
    // Unknown fields of every wire type.
    put_varint_field(&mut bytes, 90, 1);
    put_key(&mut bytes, 91, WireType::Fixed64);
    bytes.extend_from_slice(&[0; 8]);
    put_len_field(&mut bytes, 92, b"ignored");
    put_key(&mut bytes, 93, WireType::Fixed32);
    bytes.extend_from_slice(&[0; 4]);
    put_key(&mut bytes, 94, WireType::StartGroup);
    put_varint_field(&mut bytes, 1, 5);
    put_key(&mut bytes, 94, WireType::EndGroup);
    put_varint_field(&mut bytes, 1, 1000);
    assert_eq!(
        decode(&s, "User", &bytes).expect("decodes"),
        json!({"uid": 1000, "additional_gids": [7, 8, 9, 10]})
    );
    // A singular message appearing twice is merged.
    let mut bytes = Vec::new();
    put_len_field(
        &mut bytes,
        1,
        &encode(&s, "LinuxMemory", &json!({"limit": {"value": 5}})).expect("encodes"),
    );
    put_len_field(
        &mut bytes,
        1,
        &encode(&s, "LinuxMemory", &json!({"swap": {"value": 6}})).expect("encodes"),
    );
    assert_eq!(
        decode(&s, "LinuxResources", &bytes).expect("decodes"),
        json!({"memory": {"limit": {"value": 5}, "swap": {"value": 6}}})
    );
}

#[test]
fn fixed_width_and_zigzag_types() {
    let s = parse(
        "syntax = \"proto3\"; message F { fixed32 a = 1; sfixed64 b = 2; double c = 3; float d = 4; \
         sint32 e = 5; sint64 f = 6; bytes g = 7; repeated double h = 8; }",
    )
    .expect("parses");
    let value = json!({"a": 7, "b": -3, "c": 1.5, "d": 0.25, "e": -2, "f": 3, "g": "AAEC", "h": [1.0, 2.5]});
    let bytes = encode(&s, "F", &value).expect("encodes");
    assert_eq!(&bytes[..5], &[0x0d, 7, 0, 0, 0]);
    assert_eq!(decode(&s, "F", &bytes).expect("decodes"), value);
    let e = encode(&s, "F", &json!({"e": -2})).expect("encodes");
    assert_eq!(e, [0x28, 0x03]);
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let s = upstream();
    assert!(matches!(
        encode(&s, "PodSandbox", &json!({"nope": 1})),
        Err(ProtoError::Encode { .. })
    ));
    assert!(encode(&s, "PodSandbox", &json!({"pid": -1})).is_err());
    assert!(encode(&s, "PodSandbox", &json!({"labels": ["x"]})).is_err());
    assert!(encode(&s, "PodSandbox", &json!([1])).is_err());
    assert!(matches!(
        encode(&s, "NoSuchMessage", &json!({})),
        Err(ProtoError::UnknownMessage(_))
    ));
    for garbage in [
        &[0xff_u8; 11][..],
        &[0x0a, 0x05, b'a'],
        &[0x0a, 0x02, 0xff, 0xfe],
        &[0x0f],
        &[0x00],
        &[0x1b, 0x08],
        &[0x0d, 1, 2],
    ] {
        assert!(decode(&s, "PodSandbox", garbage).is_err(), "{garbage:?}");
    }
    // Hostile nesting of a self-recursive message stops at the depth limit instead of the stack's.
    let mut deep = Vec::new();
    for _ in 0..200 {
        let mut outer = Vec::new();
        put_len_field(&mut outer, 8, &deep);
        deep = outer;
    }
    let schema = parse("syntax = \"proto3\"; message R { R r = 8; }").expect("parses");
    assert!(decode(&schema, "R", &deep).is_err());
}
