//! Tests of the DRA plan, the slices and the check before a claim is prepared.

use std::collections::{BTreeMap, BTreeSet};

use pretty_assertions::assert_eq;
use teeguard_shared::TeeKind;

use super::*;

fn fig(capacity: u64, external: u64) -> KindFigures {
    KindFigures {
        capacity,
        kernel_used: external,
        external,
        free: capacity - external,
        ..Default::default()
    }
}

fn tdx(capacity: u64, external: u64) -> BTreeMap<TeeKind, KindFigures> {
    BTreeMap::from([(TeeKind::Tdx, fig(capacity, external))])
}

fn set(items: &[u32]) -> BTreeSet<u32> {
    items.iter().copied().collect()
}

fn dev(device: &str) -> AllocatedDevice {
    AllocatedDevice {
        request: "container-0-request-0".into(),
        pool: "node-a".into(),
        device: device.into(),
    }
}

#[test]
fn device_names_round_trip_and_reject_what_is_not_a_key_device() {
    for (name, kind, index) in [
        ("tdx-0", TeeKind::Tdx, 0),
        ("sev-17", TeeKind::Sev, 17),
        ("sev-es-508", TeeKind::SevEs, 508),
    ] {
        let d = DeviceName::parse(name).expect(name);
        assert_eq!((d.kind, d.index), (kind, index));
        assert_eq!(d.to_string(), name);
    }
    for bad in [
        "tdx", "tdx-", "tdx-01", "tdx--1", "gpu-0", "sev_es-1", "tdx-x", "",
    ] {
        assert_eq!(DeviceName::parse(bad), None, "{bad}");
    }
}

#[test]
fn every_key_is_published_when_nothing_outside_a_claim_holds_one() {
    let p = plan(&tdx(4, 0), &BTreeMap::new(), &BTreeMap::new());
    assert_eq!(p[&TeeKind::Tdx].published, set(&[0, 1, 2, 3]));
    assert_eq!(p[&TeeKind::Tdx].withheld, 0);
}

#[test]
fn keys_held_outside_kubernetes_and_by_claimless_pods_are_withheld_from_the_top() {
    let claimless = BTreeMap::from([(TeeKind::Tdx, 1)]);
    let p = plan(&tdx(4, 1), &claimless, &BTreeMap::new());
    assert_eq!(p[&TeeKind::Tdx].published, set(&[0, 1]));
    assert_eq!(p[&TeeKind::Tdx].withheld, 2);
}

#[test]
fn devices_prepared_for_claims_stay_published_whatever_their_number() {
    let allocated = BTreeMap::from([(TeeKind::Tdx, set(&[3]))]);
    let p = plan(&tdx(4, 2), &BTreeMap::new(), &allocated);
    assert_eq!(p[&TeeKind::Tdx].published, set(&[0, 3]));
    assert_eq!(p[&TeeKind::Tdx].allocated, 1);
}

#[test]
fn withheld_never_exceeds_the_capacity() {
    let claimless = BTreeMap::from([(TeeKind::Tdx, 9)]);
    let p = plan(&tdx(4, 3), &claimless, &BTreeMap::new());
    assert_eq!(p[&TeeKind::Tdx].withheld, 4);
    assert!(p[&TeeKind::Tdx].published.is_empty());
}

#[test]
fn a_pool_past_128_devices_is_split_and_every_slice_names_the_pool_generation_and_count() {
    let figures = BTreeMap::from([(TeeKind::Tdx, fig(64, 0)), (TeeKind::SevEs, fig(200, 0))]);
    let p = plan(&figures, &BTreeMap::new(), &BTreeMap::new());
    let slices = slice_specs("node-a", &p, 7);
    assert_eq!(slices.len(), 3);
    let sizes: Vec<usize> = slices
        .iter()
        .map(|s| s.devices.as_ref().map_or(0, Vec::len))
        .collect();
    assert_eq!(sizes, vec![128, 128, 8]);
    for s in &slices {
        assert_eq!(s.driver, "tee.teeguard.dev");
        assert_eq!(s.node_name.as_deref(), Some("node-a"));
        assert_eq!(s.pool.name, "node-a");
        assert_eq!(s.pool.generation, 7);
        assert_eq!(s.pool.resource_slice_count, 3);
    }
    let first = &slices[0].devices.as_ref().expect("devices")[0];
    assert_eq!(first.name, "tdx-0");
    assert_eq!(
        first.attributes.as_ref().expect("attributes")["kind"]
            .string
            .as_deref(),
        Some("tdx")
    );
    let last = slices[2].devices.as_ref().expect("devices").last().cloned();
    assert_eq!(last.map(|d| d.name), Some("sev-es-199".to_string()));
}

#[test]
fn a_node_with_no_usable_key_publishes_one_empty_slice() {
    let p = plan(&tdx(2, 2), &BTreeMap::new(), &BTreeMap::new());
    let slices = slice_specs("node-a", &p, 1);
    assert_eq!(slices.len(), 1);
    assert_eq!(slices[0].devices.as_deref(), Some(&[][..]));
}

#[test]
fn content_comparison_ignores_the_generation_only() {
    let p = plan(&tdx(2, 0), &BTreeMap::new(), &BTreeMap::new());
    let a = slice_specs("node-a", &p, 1);
    assert!(same_content(&a, &slice_specs("node-a", &p, 2)));
    let q = plan(&tdx(2, 1), &BTreeMap::new(), &BTreeMap::new());
    assert!(!same_content(&a, &slice_specs("node-a", &q, 1)));
}

fn check(
    devices: &[AllocatedDevice],
    figures: &BTreeMap<TeeKind, KindFigures>,
    claimless: u64,
    others: &[u32],
) -> Result<(), String> {
    prepare_check(
        devices,
        PrepareInput {
            node: "node-a",
            figures: Some(figures),
            claimless_keys: &BTreeMap::from([(TeeKind::Tdx, claimless)]),
            others: &BTreeMap::from([(TeeKind::Tdx, set(others))]),
        },
    )
}

#[test]
fn a_claim_is_prepared_while_the_kernel_has_a_key_for_it() {
    assert_eq!(check(&[dev("tdx-1")], &tdx(4, 1), 1, &[0]), Ok(()));
}

#[test]
fn a_claim_is_refused_when_keys_held_outside_claims_took_the_last_one() {
    let e = check(&[dev("tdx-1")], &tdx(2, 1), 0, &[0]).expect_err("no key left");
    assert!(e.contains("no free tdx key"), "{e}");
    let e = check(&[dev("tdx-1")], &tdx(2, 0), 1, &[0]).expect_err("claimless pod holds it");
    assert!(e.contains("1 are held outside DRA claims"), "{e}");
}

#[test]
fn a_device_of_another_pool_or_beyond_the_capacity_or_already_taken_is_refused() {
    let mut other_pool = dev("tdx-0");
    other_pool.pool = "node-b".into();
    assert!(check(&[other_pool], &tdx(4, 0), 0, &[]).is_err());
    assert!(check(&[dev("tdx-4")], &tdx(4, 0), 0, &[]).is_err());
    assert!(check(&[dev("gpu-0")], &tdx(4, 0), 0, &[]).is_err());
    assert!(check(&[dev("sev-0")], &tdx(4, 0), 0, &[]).is_err());
    let e = check(&[dev("tdx-2")], &tdx(4, 0), 0, &[2]).expect_err("taken");
    assert!(e.contains("already prepared"), "{e}");
}

#[test]
fn nothing_is_prepared_before_the_first_scan() {
    let e = prepare_check(
        &[dev("tdx-0")],
        PrepareInput {
            node: "node-a",
            figures: None,
            claimless_keys: &BTreeMap::new(),
            others: &BTreeMap::new(),
        },
    )
    .expect_err("no scan yet");
    assert!(e.contains("not read the kernel"), "{e}");
}
