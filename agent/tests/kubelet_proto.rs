//! The agent's own prost messages for the kubelet's plugin interfaces (`teeguard_agent::kubelet::proto`)
//! against upstream's `.proto` files in `../shared/reference/kubelet/` (Kubernetes v1.36.2): every
//! field of every message, populated, is read by upstream's definition (compiled by the test kit's
//! `proto`) as set, under upstream's number and wire type; no field is missing or extra; the gRPC
//! service paths and methods are upstream's. Skipped (one line) without the reference folder, unless `CI=true`.

use std::path::{Path, PathBuf};

use prost::Message;
use teeguard_agent::kubelet::proto::*;
use teeguard_tests::proto::{Coverage, Schema, reference_dir};

fn reference() -> Option<PathBuf> {
    let dir = reference_dir().join("kubelet");
    if dir.is_dir() {
        return Some(dir);
    }
    assert!(
        std::env::var("CI").as_deref() != Ok("true"),
        "{} is missing",
        dir.display()
    );
    eprintln!("skipped: {} not found", dir.display());
    None
}

fn schema(dir: &Path, file: &str) -> Schema {
    Schema::load(&dir.join(file)).unwrap_or_else(|e| panic!("{e}"))
}

/// Ours, every field populated, is every field of upstream's message, under upstream's numbers and
/// wire types, and nothing else.
fn check(schema: &Schema, name: &str, encoded: Vec<u8>) {
    let coverage = schema
        .coverage(name, &encoded)
        .unwrap_or_else(|e| panic!("{name}: upstream cannot read ours: {e}"));
    assert_eq!(
        coverage,
        Coverage::default(),
        "{name}: upstream's fields ours leaves unset, and our fields upstream does not have"
    );
}

/// The service's full gRPC name and its methods, in order.
fn service(schema: &Schema, name: &str) -> (String, Vec<String>) {
    let methods = schema.methods(name).unwrap_or_else(|e| panic!("{e}"));
    (
        format!("{}.{name}", schema.package()),
        methods.into_iter().map(|(m, _, _)| m).collect(),
    )
}

fn claim() -> Claim {
    Claim {
        namespace: "ns".into(),
        uid: "uid".into(),
        name: "name".into(),
    }
}

#[test]
fn registration_messages_and_service_match_upstream() {
    let Some(dir) = reference() else { return };
    let p = schema(&dir, "pluginregistration/v1/api.proto");
    check(
        &p,
        "PluginInfo",
        PluginInfo {
            r#type: "DRAPlugin".into(),
            name: "n".into(),
            endpoint: "e".into(),
            supported_versions: vec!["v1.DRAPlugin".into()],
        }
        .encode_to_vec(),
    );
    check(
        &p,
        "RegistrationStatus",
        RegistrationStatus {
            plugin_registered: true,
            error: "e".into(),
        }
        .encode_to_vec(),
    );
    check(
        &p,
        "RegistrationStatusResponse",
        RegistrationStatusResponse {}.encode_to_vec(),
    );
    check(&p, "InfoRequest", InfoRequest {}.encode_to_vec());
    assert_eq!(
        service(&p, "Registration"),
        (
            REGISTRATION_SERVICE.to_string(),
            vec!["GetInfo".into(), "NotifyRegistrationStatus".into()]
        )
    );
}

#[test]
fn dra_messages_and_service_match_upstream() {
    let Some(dir) = reference() else { return };
    let p = schema(&dir, "dra/v1/api.proto");
    let device = Device {
        request_names: vec!["r".into()],
        pool_name: "p".into(),
        device_name: "d".into(),
        cdi_device_ids: vec!["c".into()],
        share_id: Some("s".into()),
    };
    check(&p, "Device", device.encode_to_vec());
    check(&p, "Claim", claim().encode_to_vec());
    check(
        &p,
        "NodePrepareResourcesRequest",
        NodePrepareResourcesRequest {
            claims: vec![claim()],
        }
        .encode_to_vec(),
    );
    check(
        &p,
        "NodePrepareResourceResponse",
        NodePrepareResourceResponse {
            devices: vec![device.clone()],
            error: "e".into(),
        }
        .encode_to_vec(),
    );
    check(
        &p,
        "NodePrepareResourcesResponse",
        NodePrepareResourcesResponse {
            claims: [(
                "uid".to_string(),
                NodePrepareResourceResponse {
                    devices: vec![device],
                    error: String::new(),
                },
            )]
            .into(),
        }
        .encode_to_vec(),
    );
    check(
        &p,
        "NodeUnprepareResourcesRequest",
        NodeUnprepareResourcesRequest {
            claims: vec![claim()],
        }
        .encode_to_vec(),
    );
    check(
        &p,
        "NodeUnprepareResourceResponse",
        NodeUnprepareResourceResponse { error: "e".into() }.encode_to_vec(),
    );
    check(
        &p,
        "NodeUnprepareResourcesResponse",
        NodeUnprepareResourcesResponse {
            claims: [(
                "uid".to_string(),
                NodeUnprepareResourceResponse { error: "e".into() },
            )]
            .into(),
        }
        .encode_to_vec(),
    );
    assert_eq!(
        service(&p, "DRAPlugin"),
        (
            DRA_SERVICE.to_string(),
            vec![
                "NodePrepareResources".into(),
                "NodeUnprepareResources".into()
            ]
        )
    );
    // Every upstream message of the file has its check above.
    assert_eq!(p.message_names().len(), 8, "{:?}", p.message_names());
}
