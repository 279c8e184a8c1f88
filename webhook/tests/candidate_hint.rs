//! The candidate scan of a pod CREATE without `spec.nodeName` stops at the first node that fits, and
//! looks first at the node it is given as a hint (the web layer passes the node that fitted the last
//! pod of the same TEE kind). The verdict never depends on it; how many nodes are looked at does.
//! Driven through `decide::admit::at_create` on an index of ten TDX nodes, counting the nodes the
//! placement filter is asked about (one per candidate looked at).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use teeguard_shared::config::{Mode, StalePolicy};
use teeguard_shared::pod::KeyRequests;
use teeguard_shared::{TeeCapacity, TeeKind};
use teeguard_tests::fixtures::{NodeBuilder, ReportBuilder};
use teeguard_webhook::decide::admit::{Ask, Placement, at_create};
use teeguard_webhook::decide::holds::Claimant;
use teeguard_webhook::decide::index::Index;

/// Ten TDX nodes `n0`..`n9`, all full except those in `free` (one key each).
fn cluster(free: &[&str]) -> Index {
    let now = jiff::Timestamp::now();
    let mut ix = Index::new(Duration::from_secs(30));
    for i in 0..10 {
        let name = format!("n{i}");
        let node = NodeBuilder::new(&name).tdx(64).build();
        ix.apply_node(&name, Some(node.metadata.labels.unwrap_or_default()));
        let keys = u64::from(free.contains(&name.as_str()));
        let report = ReportBuilder::new(&name).kind(TeeKind::Tdx, 64, keys);
        let cap: TeeCapacity = serde_json::from_value(report.to_value()).expect("report");
        ix.apply_report(&name, cap.status.map(Arc::new), None, now);
    }
    ix
}

/// Decide once with `hint`: the audit reason, the nodes looked at in order, and the node that fitted.
fn review(ix: &Index, hint: Option<&str>) -> (&'static str, Vec<String>, Option<String>) {
    let seen = Mutex::new(Vec::new());
    let fits = |name: &str, _: &BTreeMap<String, String>| {
        seen.lock().expect("lock").push(name.to_string());
        true
    };
    let requests = KeyRequests::from([(TeeKind::Tdx, 1)]);
    let ask = Ask {
        claimant: Claimant {
            pod_uid: "pod-1",
            vmi_uid: "vmi-1",
        },
        pod: "default/virt-launcher-tdx-vm-abcde",
        vmi: "default/tdx-vm",
        requests: &requests,
        mode: Mode::Enforce,
        policy: StalePolicy::Deny,
        dry_run: false,
        stale_after: Duration::from_secs(60),
        replica: "test",
    };
    let placement = Placement {
        fits: &fits,
        hint,
        queue: None,
    };
    let planned = at_create(ix, &ask, placement, jiff::Timestamp::now());
    let seen = seen.into_inner().expect("lock");
    (planned.decision.reason, seen, planned.node)
}

fn once_each(seen: &[String]) -> bool {
    let mut sorted = seen.to_vec();
    sorted.sort();
    sorted.dedup();
    sorted.len() == seen.len()
}

#[test]
fn the_hinted_node_is_looked_at_first_and_a_scan_stops_at_the_first_fit() {
    // Only n7 has a key: without a hint the scan looks at nodes until n7; with n7 as the hint, n7 alone.
    let only_n7 = cluster(&["n7"]);
    let (reason, seen, fitted) = review(&only_n7, None);
    assert_eq!((reason, fitted.as_deref()), ("enough-keys", Some("n7")));
    assert_eq!(seen.last().map(String::as_str), Some("n7"));
    assert!(once_each(&seen), "{seen:?}");
    assert_eq!(review(&only_n7, Some("n7")).1, ["n7"]);

    // n7 fills up and n3 frees a key: n7 first (full), then the others until n3; n7 not looked at twice.
    let only_n3 = cluster(&["n3"]);
    let (reason, seen, fitted) = review(&only_n3, Some("n7"));
    assert_eq!((reason, fitted.as_deref()), ("enough-keys", Some("n3")));
    assert_eq!(seen.first().map(String::as_str), Some("n7"));
    assert!(once_each(&seen) && seen.len() >= 2, "{seen:?}");
    assert_eq!(review(&only_n3, Some("n3")).1, ["n3"]);

    // Nothing fits: every node is looked at once, the hinted one first.
    let full = cluster(&[]);
    let (reason, seen, fitted) = review(&full, Some("n3"));
    assert_eq!((reason, fitted), ("insufficient-keys", None));
    assert_eq!(seen.len(), 10);
    assert!(once_each(&seen) && seen[0] == "n3", "{seen:?}");
}
