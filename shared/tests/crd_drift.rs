//! The CRD committed in the Helm chart must equal the one generated from the Rust type.
//! Regenerate with `TEEGUARD_REGENERATE=1 cargo test -p teeguard-shared --test crd_drift`.

use std::path::PathBuf;

use teeguard_shared::crd::{CRD_CHART_PATH, crd_yaml};

/// The CRD committed at `chart_path` equals `generated` (the YAML from the Rust type `ty`); with
/// `TEEGUARD_REGENERATE` set, write it first.
fn assert_committed(chart_path: &str, generated: &str, ty: &str) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(chart_path);
    if std::env::var_os("TEEGUARD_REGENERATE").is_some() {
        std::fs::write(&path, generated).expect("write CRD");
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "cannot read {}: {e}; run `TEEGUARD_REGENERATE=1 cargo test -p teeguard-shared --test crd_drift`",
            path.display()
        )
    });
    assert!(
        committed == generated,
        "{} differs from the CRD generated from {ty}; \
         run `TEEGUARD_REGENERATE=1 cargo test -p teeguard-shared --test crd_drift` and commit the result",
        path.display()
    );
}

#[test]
fn chart_crd_matches_rust_type() {
    let generated = crd_yaml().expect("generate CRD");
    assert_committed(
        CRD_CHART_PATH,
        &generated,
        "teeguard_shared::crd::TeeCapacity",
    );
}

#[test]
fn crd_shape() {
    let crd: serde_json::Value =
        serde_yaml::from_str(&crd_yaml().expect("generate")).expect("yaml");
    assert_eq!(crd["metadata"]["name"], "teecapacities.teeguard.dev");
    assert_eq!(crd["spec"]["scope"], "Cluster");
    let version = &crd["spec"]["versions"][0];
    assert_eq!(version["name"], "v1alpha1");
    assert!(version["subresources"]["status"].is_object());
    let columns: Vec<&str> = version["additionalPrinterColumns"]
        .as_array()
        .expect("columns")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    for want in ["TDX-Free", "SEV-Free", "SEV-ES-Free", "Published"] {
        assert!(
            columns.contains(&want),
            "missing printer column {want}: {columns:?}"
        );
    }
    let status = &version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"];
    for field in [
        "capacity",
        "kernelUsed",
        "podsUsed",
        "external",
        "pending",
        "free",
    ] {
        assert!(
            status["tdx"]["properties"][field].is_object(),
            "status.tdx.{field} missing from schema"
        );
    }
}

#[test]
fn chart_reservation_crd_matches_rust_type() {
    use teeguard_shared::reservation::{RESERVATION_CRD_CHART_PATH, reservation_crd_yaml};
    let generated = reservation_crd_yaml().expect("generate CRD");
    assert_committed(
        RESERVATION_CRD_CHART_PATH,
        &generated,
        "teeguard_shared::reservation::TeeReservation",
    );
    let crd: serde_json::Value = serde_yaml::from_str(&generated).expect("yaml");
    assert_eq!(crd["metadata"]["name"], "teereservations.teeguard.dev");
    assert_eq!(crd["spec"]["scope"], "Cluster");
    assert!(
        !generated.contains("uint64"),
        "no format the API server warns about"
    );
}
