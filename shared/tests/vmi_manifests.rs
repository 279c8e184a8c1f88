//! The VMI → TEE kind mapping on complete `kubevirt.io/v1` VirtualMachineInstance manifests (the test
//! kit's samples under tests/fixtures/vmis/, with status, finalizers, devices and everything else
//! teeguard ignores).

use std::path::PathBuf;

use teeguard_shared::{TeeKind, VirtualMachineInstance};

fn load(name: &str) -> VirtualMachineInstance {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/vmis")
        .join(name);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

#[test]
fn every_kind_from_a_complete_manifest() {
    let cases = [
        ("tdx.yaml", Some(TeeKind::Tdx)),
        ("sev.yaml", Some(TeeKind::Sev)),
        ("sev-es.yaml", Some(TeeKind::SevEs)),
        ("snp.yaml", Some(TeeKind::SevEs)),
        ("secure-execution.yaml", None),
        ("plain.yaml", None),
    ];
    for (file, want) in cases {
        let vmi = load(file);
        assert_eq!(vmi.tee_kind().expect(file), want, "{file}");
        assert!(vmi.metadata.name.is_some(), "{file}: metadata kept");
    }
}

#[test]
fn two_kinds_at_once_is_an_error() {
    let vmi = load("invalid-tdx-and-snp.yaml");
    let err = vmi.tee_kind().expect_err("tdx + snp");
    assert!(
        err.to_string()
            .contains("more than one launchSecurity kind"),
        "{err}"
    );
}
