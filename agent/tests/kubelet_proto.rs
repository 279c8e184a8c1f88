//! The agent's own prost messages for the kubelet's plugin interfaces (`teeguard_agent::kubelet::proto`)
//! against upstream's `.proto` files in `../shared/reference/kubelet/` (Kubernetes v1.36.2): every
//! field of every message, populated, is encoded under upstream's field number with the wire type
//! upstream's type gives; no field is missing or extra; the gRPC service paths are upstream's
//! `package.Service`. Skipped (one line) without the reference folder, unless `CI=true`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use prost::Message;
use teeguard_agent::kubelet::proto::*;

fn reference() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/reference/kubelet");
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

/// One `.proto` file, as far as these files use the language: its package, services with their
/// methods, and messages with their fields (number → type as written).
#[derive(Debug, Default)]
struct Proto {
    package: String,
    services: BTreeMap<String, Vec<String>>,
    messages: BTreeMap<String, BTreeMap<u32, String>>,
}

fn strip_comments(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find("/*") {
        out.push_str(&rest[..i]);
        rest = rest[i..].split_once("*/").map_or("", |(_, r)| r);
    }
    out.push_str(rest);
    out.lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

fn parse(text: &str) -> Proto {
    let text = strip_comments(text);
    let mut p = Proto::default();
    let mut current: Option<(bool, String)> = None; // (is service, name)
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if let Some(pkg) = line.strip_prefix("package ") {
            p.package = pkg.trim_end_matches(';').trim().to_string();
        } else if let Some(rest) = line.strip_prefix("message ") {
            let name = rest.trim_end_matches('{').trim().to_string();
            p.messages.entry(name.clone()).or_default();
            current = Some((false, name));
        } else if let Some(rest) = line.strip_prefix("service ") {
            let name = rest.trim_end_matches('{').trim().to_string();
            current = Some((true, name));
        } else if line.starts_with('}') {
            current = None;
        } else if let Some((is_service, name)) = &current {
            if *is_service {
                if let Some(rest) = line.strip_prefix("rpc ") {
                    let method = rest.split(['(', ' ']).next().unwrap_or("").to_string();
                    p.services.entry(name.clone()).or_default().push(method);
                }
            } else if let Some((decl, number)) = line.trim_end_matches(';').split_once('=') {
                let number: u32 = number.trim().parse().expect("field number");
                let mut words: Vec<&str> = decl.split_whitespace().collect();
                words.pop(); // the field name
                p.messages
                    .get_mut(name)
                    .expect("message")
                    .insert(number, words.join(" "));
            }
        }
    }
    p
}

/// The protobuf wire type upstream's declared type encodes with.
fn wire_type(declared: &str) -> u8 {
    let ty = declared
        .trim_start_matches("repeated ")
        .trim_start_matches("optional ");
    match ty {
        "bool" | "int32" | "int64" | "uint32" | "uint64" | "enum" => 0,
        _ => 2, // string, bytes, messages, maps
    }
}

/// (field number, wire type) of each top-level field in an encoded message.
fn fields(mut buf: &[u8]) -> BTreeMap<u32, u8> {
    fn varint(buf: &mut &[u8]) -> u64 {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let b = buf[0];
            *buf = &buf[1..];
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                break;
            }
        }
        v
    }
    let mut out = BTreeMap::new();
    while !buf.is_empty() {
        let key = varint(&mut buf);
        let (number, wire) = ((key >> 3) as u32, (key & 7) as u8);
        match wire {
            0 => {
                varint(&mut buf);
            }
            2 => {
                let len = varint(&mut buf) as usize;
                buf = &buf[len..];
            }
            other => panic!("unexpected wire type {other}"),
        }
        out.insert(number, wire);
    }
    out
}

fn check(proto: &Proto, name: &str, encoded: Vec<u8>) {
    let upstream = proto
        .messages
        .get(name)
        .unwrap_or_else(|| panic!("upstream has no message {name}"));
    let want: BTreeMap<u32, u8> = upstream.iter().map(|(n, ty)| (*n, wire_type(ty))).collect();
    assert_eq!(
        fields(&encoded),
        want,
        "{name}: our fields (number → wire type) vs upstream's {upstream:?}"
    );
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
    let text = std::fs::read_to_string(dir.join("pluginregistration/v1/api.proto")).expect("read");
    let p = parse(&text);
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
    assert_eq!(format!("{}.Registration", p.package), REGISTRATION_SERVICE);
    assert_eq!(
        p.services["Registration"],
        ["GetInfo", "NotifyRegistrationStatus"]
    );
}

#[test]
fn dra_messages_and_service_match_upstream() {
    let Some(dir) = reference() else { return };
    let text = std::fs::read_to_string(dir.join("dra/v1/api.proto")).expect("read");
    let p = parse(&text);
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
    assert_eq!(format!("{}.DRAPlugin", p.package), DRA_SERVICE);
    assert_eq!(
        p.services["DRAPlugin"],
        ["NodePrepareResources", "NodeUnprepareResources"]
    );
    // Every upstream message of the file has its check above.
    assert_eq!(p.messages.len(), 8, "{:?}", p.messages.keys());
}
