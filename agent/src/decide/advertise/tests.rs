//! The Node plan (ownership, NFD, switching off) and the advertiser's memory of NFD and other writers.

use super::*;
use pretty_assertions::assert_eq;

const TDX_RES: &str = "tdx.intel.com/keys";
const ES_RES: &str = "sev-snp.amd.com/esids";

fn node(
    annotations: serde_json::Value,
    capacity: Option<serde_json::Value>,
    allocatable: Option<serde_json::Value>,
) -> Node {
    let mut status = serde_json::Map::new();
    if let Some(c) = capacity {
        status.insert("capacity".into(), c);
    }
    if let Some(a) = allocatable {
        status.insert("allocatable".into(), a);
    }
    serde_json::from_value(json!({
        "metadata": {"name": "n1", "annotations": annotations},
        "status": status,
    }))
    .expect("node")
}

fn desired(enabled: bool, values: &[(TeeKind, u64)]) -> Desired {
    Desired {
        enabled,
        values: values.iter().copied().collect(),
    }
}

fn patch(ops: serde_json::Value) -> NodeWrite {
    NodeWrite::Status(serde_json::from_value(ops).expect("patch"))
}

fn ann(v: Option<&str>) -> NodeWrite {
    NodeWrite::Annotation(v.map(str::to_string))
}

#[test]
fn table() {
    let res = ResourcesConfig::default();
    let cpu = json!({"cpu": "8"});
    struct Case {
        name: &'static str,
        node: Node,
        desired: Desired,
        writes: Vec<NodeWrite>,
        outcome: Vec<(TeeKind, KindAdvert)>,
    }
    let cases = vec![
        Case {
            name: "first advertisement: claim, then set capacity and allocatable",
            node: node(json!({}), Some(cpu.clone()), Some(cpu.clone())),
            desired: desired(true, &[(TeeKind::Tdx, 14)]),
            writes: vec![
                ann(Some(TDX_RES)),
                patch(json!([
                    {"op": "add", "path": "/status/capacity/tdx.intel.com~1keys", "value": "14"},
                    {"op": "add", "path": "/status/allocatable/tdx.intel.com~1keys", "value": "14"},
                ])),
            ],
            outcome: vec![(TeeKind::Tdx, KindAdvert::Advertised(14))],
        },
        Case {
            name: "already right: no writes",
            node: node(
                json!({AGENT_EXTENDED_RESOURCES_ANNOTATION: TDX_RES}),
                Some(json!({"cpu": "8", TDX_RES: "14"})),
                Some(json!({"cpu": "8", TDX_RES: "14"})),
            ),
            desired: desired(true, &[(TeeKind::Tdx, 14)]),
            writes: vec![],
            outcome: vec![(TeeKind::Tdx, KindAdvert::Advertised(14))],
        },
        Case {
            name: "value changed: replace both",
            node: node(
                json!({AGENT_EXTENDED_RESOURCES_ANNOTATION: TDX_RES}),
                Some(json!({TDX_RES: "16"})),
                Some(json!({TDX_RES: "16"})),
            ),
            desired: desired(true, &[(TeeKind::Tdx, 14)]),
            writes: vec![patch(json!([
                {"op": "add", "path": "/status/capacity/tdx.intel.com~1keys", "value": "14"},
                {"op": "add", "path": "/status/allocatable/tdx.intel.com~1keys", "value": "14"},
            ]))],
            outcome: vec![(TeeKind::Tdx, KindAdvert::Advertised(14))],
        },
        Case {
            name: "kubelet has not copied allocatable yet: only allocatable",
            node: node(
                json!({AGENT_EXTENDED_RESOURCES_ANNOTATION: TDX_RES}),
                Some(json!({TDX_RES: "14"})),
                Some(cpu.clone()),
            ),
            desired: desired(true, &[(TeeKind::Tdx, 14)]),
            writes: vec![patch(json!([
                {"op": "add", "path": "/status/allocatable/tdx.intel.com~1keys", "value": "14"},
            ]))],
            outcome: vec![(TeeKind::Tdx, KindAdvert::Advertised(14))],
        },
        Case {
            name: "node without status maps: add whole maps",
            node: node(json!({}), None, None),
            desired: desired(true, &[(TeeKind::Tdx, 3)]),
            writes: vec![
                ann(Some(TDX_RES)),
                patch(json!([
                    {"op": "add", "path": "/status/capacity", "value": {TDX_RES: "3"}},
                    {"op": "add", "path": "/status/allocatable", "value": {TDX_RES: "3"}},
                ])),
            ],
            outcome: vec![(TeeKind::Tdx, KindAdvert::Advertised(3))],
        },
        Case {
            name: "NFD owns it: untouched",
            node: node(
                json!({NFD_EXTENDED_RESOURCES_ANNOTATION: TDX_RES}),
                Some(json!({TDX_RES: "16"})),
                Some(json!({TDX_RES: "16"})),
            ),
            desired: desired(true, &[(TeeKind::Tdx, 14)]),
            writes: vec![],
            outcome: vec![(
                TeeKind::Tdx,
                KindAdvert::OwnedByOther {
                    manager: Manager::Nfd,
                    value: Some(16),
                },
            )],
        },
        Case {
            name: "NFD took over a resource we had: release our claim, leave the value",
            node: node(
                json!({NFD_EXTENDED_RESOURCES_ANNOTATION: format!("{TDX_RES},other.example.com/x"), AGENT_EXTENDED_RESOURCES_ANNOTATION: TDX_RES}),
                Some(json!({TDX_RES: "16"})),
                Some(json!({TDX_RES: "16"})),
            ),
            desired: desired(true, &[(TeeKind::Tdx, 14)]),
            writes: vec![ann(None)],
            outcome: vec![(
                TeeKind::Tdx,
                KindAdvert::OwnedByOther {
                    manager: Manager::Nfd,
                    value: Some(16),
                },
            )],
        },
        Case {
            name: "present but not ours and not NFD's: another manager, untouched",
            node: node(
                json!({}),
                Some(json!({TDX_RES: "16"})),
                Some(json!({TDX_RES: "16"})),
            ),
            desired: desired(true, &[(TeeKind::Tdx, 14)]),
            writes: vec![],
            outcome: vec![(
                TeeKind::Tdx,
                KindAdvert::OwnedByOther {
                    manager: Manager::Other,
                    value: Some(16),
                },
            )],
        },
        Case {
            name: "advertising switched off: remove what we added, then release",
            node: node(
                json!({AGENT_EXTENDED_RESOURCES_ANNOTATION: TDX_RES}),
                Some(json!({TDX_RES: "14"})),
                Some(json!({TDX_RES: "14"})),
            ),
            desired: desired(false, &[(TeeKind::Tdx, 14)]),
            writes: vec![
                patch(json!([
                    {"op": "remove", "path": "/status/capacity/tdx.intel.com~1keys"},
                    {"op": "remove", "path": "/status/allocatable/tdx.intel.com~1keys"},
                ])),
                ann(None),
            ],
            outcome: vec![(TeeKind::Tdx, KindAdvert::Disabled)],
        },
        Case {
            name: "disabled and never added: nothing",
            node: node(json!({}), Some(json!({TDX_RES: "9"})), None),
            desired: desired(false, &[(TeeKind::Tdx, 14)]),
            writes: vec![],
            outcome: vec![(TeeKind::Tdx, KindAdvert::Disabled)],
        },
        Case {
            name: "kind disappeared from the host: remove only ours (allocatable already gone)",
            node: node(
                json!({AGENT_EXTENDED_RESOURCES_ANNOTATION: format!("{ES_RES},{TDX_RES}")}),
                Some(json!({TDX_RES: "14", ES_RES: "400"})),
                Some(json!({TDX_RES: "14"})),
            ),
            desired: desired(true, &[(TeeKind::Tdx, 14)]),
            writes: vec![
                patch(json!([
                    {"op": "remove", "path": "/status/capacity/sev-snp.amd.com~1esids"},
                ])),
                ann(Some(TDX_RES)),
            ],
            outcome: vec![(TeeKind::Tdx, KindAdvert::Advertised(14))],
        },
        Case {
            name: "unparsable value on the node is replaced",
            node: node(
                json!({AGENT_EXTENDED_RESOURCES_ANNOTATION: TDX_RES}),
                Some(json!({TDX_RES: "14"})),
                Some(json!({TDX_RES: "500m"})),
            ),
            desired: desired(true, &[(TeeKind::Tdx, 14)]),
            writes: vec![patch(json!([
                {"op": "add", "path": "/status/allocatable/tdx.intel.com~1keys", "value": "14"},
            ]))],
            outcome: vec![(TeeKind::Tdx, KindAdvert::Advertised(14))],
        },
        Case {
            name: "NFD short names get NFD's default namespace (so they do not match ours)",
            node: node(
                json!({NFD_EXTENDED_RESOURCES_ANNOTATION: "keys"}),
                Some(cpu.clone()),
                Some(cpu.clone()),
            ),
            desired: desired(true, &[(TeeKind::Tdx, 1)]),
            writes: vec![
                ann(Some(TDX_RES)),
                patch(json!([
                    {"op": "add", "path": "/status/capacity/tdx.intel.com~1keys", "value": "1"},
                    {"op": "add", "path": "/status/allocatable/tdx.intel.com~1keys", "value": "1"},
                ])),
            ],
            outcome: vec![(TeeKind::Tdx, KindAdvert::Advertised(1))],
        },
    ];
    for case in cases {
        let p = plan(&case.node, &case.desired, &res);
        assert_eq!(p.writes, case.writes, "case: {}", case.name);
        assert_eq!(
            p.outcome.per_kind,
            case.outcome.into_iter().collect::<BTreeMap<_, _>>(),
            "case: {}",
            case.name
        );
    }
}

#[test]
fn plan_is_idempotent_once_applied() {
    let res = ResourcesConfig::default();
    let mut n = node(json!({}), Some(json!({"cpu": "8"})), None);
    let d = desired(true, &[(TeeKind::Tdx, 14), (TeeKind::SevEs, 3)]);
    for _ in 0..2 {
        let p = plan(&n, &d, &res);
        let mut doc = serde_json::to_value(&n).expect("node json");
        for w in &p.writes {
            match w {
                NodeWrite::Annotation(v) => {
                    doc["metadata"]["annotations"][AGENT_EXTENDED_RESOURCES_ANNOTATION] = json!(v);
                }
                NodeWrite::Status(patch) => json_patch::patch(&mut doc, patch).expect("applies"),
            }
        }
        n = serde_json::from_value(doc).expect("node");
    }
    assert_eq!(plan(&n, &d, &res).writes, vec![]);
    let s = n.status.expect("status");
    assert_eq!(
        s.capacity.expect("cap").get(ES_RES),
        Some(&Quantity("3".into()))
    );
    assert_eq!(
        s.allocatable.expect("alloc").get(TDX_RES),
        Some(&Quantity("14".into()))
    );
    assert_eq!(
        status_patch(&node(json!({}), None, None), &d, &res).map(|p| p.0.len()),
        Some(4),
        "whole maps for the first kind, members for the second"
    );
}

/// The Node after `writes`, as the API server would apply them.
fn applied(n: &Node, writes: &[NodeWrite]) -> Node {
    let mut doc = serde_json::to_value(n).expect("node json");
    for w in writes {
        match w {
            NodeWrite::Annotation(v) => {
                doc["metadata"]["annotations"][AGENT_EXTENDED_RESOURCES_ANNOTATION] = json!(v);
                if v.is_none() {
                    doc["metadata"]["annotations"]
                        .as_object_mut()
                        .expect("annotations")
                        .remove(AGENT_EXTENDED_RESOURCES_ANNOTATION);
                }
            }
            NodeWrite::Status(p) => json_patch::patch(&mut doc, p).expect("applies"),
        }
    }
    serde_json::from_value(doc).expect("node")
}

/// A JSON Patch as NFD's nfd-master sends it (status or metadata).
fn nfd_patch(n: &Node, ops: serde_json::Value) -> Node {
    let mut doc = serde_json::to_value(n).expect("node json");
    let p: JsonPatch = serde_json::from_value(ops).expect("patch");
    json_patch::patch(&mut doc, &p).expect("NFD's patch applies");
    serde_json::from_value(doc).expect("node")
}

fn tdx_value(n: &Node, field: &str) -> Option<String> {
    let s = n.status.as_ref()?;
    let m = if field == "capacity" {
        s.capacity.as_ref()
    } else {
        s.allocatable.as_ref()
    }?;
    m.get(TDX_RES).map(|q| q.0.clone())
}

/// The agent's node after it advertised 13 TDX keys (capacity 16 − 3 external).
fn advertised_13(adv: &mut Advertiser, d: &Desired, res: &ResourcesConfig, t: Instant) -> Node {
    let n = node(
        json!({}),
        Some(json!({"cpu": "8"})),
        Some(json!({"cpu": "8"})),
    );
    let p = adv.plan(&n, d, res, t);
    adv.applied();
    let n = applied(&n, &p.writes);
    assert_eq!(tdx_value(&n, "allocatable").as_deref(), Some("13"));
    assert_eq!(adv.plan(&n, d, res, t).writes, vec![], "settled");
    n
}

#[test]
fn nfd_taking_the_name_over_keeps_its_value_and_the_agent_only_releases_its_claim() {
    let res = ResourcesConfig::default();
    let d = desired(true, &[(TeeKind::Tdx, 13)]);
    let t0 = Instant::now();
    let mut adv = Advertiser::default();
    let n = advertised_13(&mut adv, &d, &res, t0);
    // nfd-master, first write: its value replaces ours (status), ...
    let n = nfd_patch(
        &n,
        json!([
            {"op": "replace", "path": "/status/capacity/tdx.intel.com~1keys", "value": "16"},
            {"op": "replace", "path": "/status/allocatable/tdx.intel.com~1keys", "value": "16"},
        ]),
    );
    let p = adv.plan(&n, &d, &res, t0 + Duration::from_millis(50));
    assert_eq!(
        p.writes,
        vec![],
        "someone else's value is not written over at once"
    );
    assert_eq!(
        p.outcome.per_kind.get(&TeeKind::Tdx),
        Some(&KindAdvert::OwnedByOther {
            manager: Manager::Overwritten,
            value: Some(16)
        })
    );
    // ... second write: its annotation lists the name. The agent releases its claim, nothing else.
    let n = nfd_patch(
        &n,
        json!([{"op": "add", "path": "/metadata/annotations/nfd.node.kubernetes.io~1extended-resources", "value": TDX_RES}]),
    );
    let p = adv.plan(&n, &d, &res, t0 + Duration::from_millis(100));
    assert_eq!(p.writes, vec![ann(None)]);
    adv.applied();
    let n = applied(&n, &p.writes);
    assert_eq!(tdx_value(&n, "capacity").as_deref(), Some("16"));
    assert_eq!(tdx_value(&n, "allocatable").as_deref(), Some("16"));
    assert!(adv.yielded().contains(TDX_RES));
    // Long after: still NFD's.
    let later = adv.plan(&n, &d, &res, t0 + OVERWRITE_GRACE * 3);
    assert_eq!(later.writes, vec![]);
    assert_eq!(
        later.outcome.per_kind.get(&TeeKind::Tdx),
        Some(&KindAdvert::OwnedByOther {
            manager: Manager::Nfd,
            value: Some(16)
        })
    );
}

#[test]
fn a_writer_that_never_claims_the_name_gets_the_agents_value_back_after_the_grace() {
    let res = ResourcesConfig::default();
    let d = desired(true, &[(TeeKind::Tdx, 13)]);
    let t0 = Instant::now();
    let mut adv = Advertiser::default();
    let n = advertised_13(&mut adv, &d, &res, t0);
    let n = nfd_patch(
        &n,
        json!([{"op": "replace", "path": "/status/capacity/tdx.intel.com~1keys", "value": "20"}]),
    );
    assert_eq!(adv.plan(&n, &d, &res, t0).writes, vec![]);
    assert_eq!(
        adv.plan(
            &n,
            &d,
            &res,
            t0 + OVERWRITE_GRACE - Duration::from_millis(1)
        )
        .writes,
        vec![]
    );
    let p = adv.plan(&n, &d, &res, t0 + OVERWRITE_GRACE);
    assert_eq!(
        p.writes,
        vec![patch(json!([
            {"op": "add", "path": "/status/capacity/tdx.intel.com~1keys", "value": "13"},
        ]))]
    );
    adv.applied();
    let n = applied(&n, &p.writes);
    // Back to normal: a later change by the same writer gets a new grace.
    assert_eq!(adv.plan(&n, &d, &res, t0 + OVERWRITE_GRACE).writes, vec![]);
    let n = nfd_patch(
        &n,
        json!([{"op": "replace", "path": "/status/capacity/tdx.intel.com~1keys", "value": "20"}]),
    );
    let t1 = t0 + OVERWRITE_GRACE * 2;
    assert_eq!(adv.plan(&n, &d, &res, t1).writes, vec![]);
}

#[test]
fn a_removed_or_zeroed_value_is_restored_at_once() {
    let res = ResourcesConfig::default();
    let d = desired(true, &[(TeeKind::Tdx, 13)]);
    let t0 = Instant::now();
    for wipe in [
        json!([
            {"op": "replace", "path": "/status/capacity/tdx.intel.com~1keys", "value": "0"},
            {"op": "replace", "path": "/status/allocatable/tdx.intel.com~1keys", "value": "0"},
        ]),
        json!([
            {"op": "remove", "path": "/status/capacity/tdx.intel.com~1keys"},
            {"op": "remove", "path": "/status/allocatable/tdx.intel.com~1keys"},
        ]),
    ] {
        let mut adv = Advertiser::default();
        let n = advertised_13(&mut adv, &d, &res, t0);
        let n = nfd_patch(&n, wipe.clone());
        let p = adv.plan(&n, &d, &res, t0);
        let n = applied(&n, &p.writes);
        assert_eq!(tdx_value(&n, "capacity").as_deref(), Some("13"), "{wipe}");
        assert_eq!(
            tdx_value(&n, "allocatable").as_deref(),
            Some("13"),
            "{wipe}"
        );
    }
}

/// A node NFD owns `tdx.intel.com/keys` on (value 16), seen by `adv` once.
fn nfd_owned(adv: &mut Advertiser, d: &Desired, res: &ResourcesConfig, t: Instant) -> Node {
    let n = node(
        json!({NFD_EXTENDED_RESOURCES_ANNOTATION: TDX_RES}),
        Some(json!({TDX_RES: "16"})),
        Some(json!({TDX_RES: "16"})),
    );
    assert_eq!(adv.plan(&n, d, res, t).writes, vec![]);
    n
}

#[test]
fn nfd_dropping_the_name_but_leaving_its_value_hands_it_back_without_a_gap() {
    let res = ResourcesConfig::default();
    let d = desired(true, &[(TeeKind::Tdx, 13)]);
    let t0 = Instant::now();
    let mut adv = Advertiser::default();
    let n = nfd_owned(&mut adv, &d, &res, t0);
    let n = nfd_patch(
        &n,
        json!([{"op": "remove", "path": "/metadata/annotations/nfd.node.kubernetes.io~1extended-resources"}]),
    );
    let p = adv.plan(&n, &d, &res, t0);
    assert_eq!(
        p.writes,
        vec![
            ann(Some(TDX_RES)),
            patch(json!([
                {"op": "add", "path": "/status/capacity/tdx.intel.com~1keys", "value": "13"},
                {"op": "add", "path": "/status/allocatable/tdx.intel.com~1keys", "value": "13"},
            ])),
        ],
        "claim, then replace the value in place (never remove it)"
    );
    adv.applied();
    let n = applied(&n, &p.writes);
    assert_eq!(adv.plan(&n, &d, &res, t0).writes, vec![]);
    assert!(adv.yielded().is_empty());
    // A restarted agent does not know NFD held it: a left-over value is another manager's.
    let left_over = nfd_patch(
        &nfd_owned(&mut Advertiser::default(), &d, &res, t0),
        json!([{"op": "remove", "path": "/metadata/annotations/nfd.node.kubernetes.io~1extended-resources"}]),
    );
    let fresh = Advertiser::default().plan(&left_over, &d, &res, t0);
    assert_eq!(fresh.writes, vec![]);
    assert_eq!(
        fresh.outcome.per_kind.get(&TeeKind::Tdx),
        Some(&KindAdvert::OwnedByOther {
            manager: Manager::Other,
            value: Some(16)
        })
    );
}

#[test]
fn nfd_removing_its_value_and_name_has_the_agent_add_its_own_in_one_step() {
    let res = ResourcesConfig::default();
    let d = desired(true, &[(TeeKind::Tdx, 13)]);
    let t0 = Instant::now();
    let mut adv = Advertiser::default();
    let n = nfd_owned(&mut adv, &d, &res, t0);
    // nfd-master, first write: remove the value. NFD still lists it: the agent waits.
    let n = nfd_patch(
        &n,
        json!([
            {"op": "remove", "path": "/status/capacity/tdx.intel.com~1keys"},
            {"op": "remove", "path": "/status/allocatable/tdx.intel.com~1keys"},
        ]),
    );
    assert_eq!(adv.plan(&n, &d, &res, t0).writes, vec![]);
    // Second write: the annotation no longer lists it.
    let n = nfd_patch(
        &n,
        json!([{"op": "remove", "path": "/metadata/annotations/nfd.node.kubernetes.io~1extended-resources"}]),
    );
    let p = adv.plan(&n, &d, &res, t0);
    let n = applied(&n, &p.writes);
    assert_eq!(tdx_value(&n, "capacity").as_deref(), Some("13"));
    assert_eq!(tdx_value(&n, "allocatable").as_deref(), Some("13"));
}
