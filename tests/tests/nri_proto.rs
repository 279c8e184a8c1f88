//! The NRI messages the agent writes by hand agree with upstream's `api.proto` (containerd/nri,
//! kept in the shared reference folder): every message, field name, number, type and `repeated` flag.

use teeguard_agent::runtime::wire::{EVENT_CREATE_CONTAINER, MESSAGES};
use teeguard_tests::nri::proto::{diff, load_upstream};

fn ours() -> Vec<(&'static str, &'static str, u32, &'static str, bool)> {
    MESSAGES
        .iter()
        .flat_map(|m| {
            m.fields
                .iter()
                .map(move |f| (m.name, f.name, f.number, f.ty, f.repeated))
        })
        .collect()
}

#[test]
fn the_agents_nri_messages_match_upstream_api_proto() {
    let schema = load_upstream().expect("upstream api.proto parses");
    for m in MESSAGES {
        assert!(
            schema.message(m.name).is_some(),
            "message {} exists upstream",
            m.name
        );
    }
    let differences = diff(&schema, &ours());
    assert!(
        differences.is_empty(),
        "drift from upstream:\n{}",
        differences.join("\n")
    );
    let event = schema.enumeration("Event").expect("enum Event");
    assert_eq!(
        event.value("CREATE_CONTAINER"),
        Some(EVENT_CREATE_CONTAINER as i32)
    );
}

#[test]
fn a_renumbered_or_retyped_field_is_reported() {
    let schema = load_upstream().expect("upstream api.proto parses");
    let mut rows = ours();
    let unified = rows
        .iter_mut()
        .find(|r| r.0 == "LinuxResources" && r.1 == "unified")
        .expect("unified is in the table");
    unified.2 = 7;
    let pod = rows
        .iter_mut()
        .find(|r| r.0 == "CreateContainerRequest" && r.1 == "pod")
        .expect("pod is in the table");
    pod.3 = "Container";
    let differences = diff(&schema, &rows);
    assert_eq!(differences.len(), 2, "{differences:?}");
    assert!(differences[0].contains("number differs") || differences[1].contains("number differs"));
}
