//! The heartbeat's API cost: with nothing changing, one write per node per `heartbeatInterval` (a
//! renewal of the agent's Lease, not the report) and none between; a change still re-writes the report
//! at once; the heartbeats of many nodes spread over the interval, also after they all started together
//! and after an API server outage.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{Agent, NODE, WAIT};
use k8s_openapi::api::coordination::v1::Lease;
use teeguard_shared::Config;
use teeguard_shared::names::AGENT_LEASE_LABEL;
use teeguard_tests::fakeapi::{FakeApiServer, RecordedRequest, Verb};
use teeguard_tests::fixtures::tdx_node;
use teeguard_tests::host::{SimHost, TDX};

fn is_write(r: &RecordedRequest) -> bool {
    matches!(
        r.verb,
        Verb::Create | Verb::Update | Verb::Patch | Verb::Delete
    )
}

fn heartbeat_config(interval: &str) -> Config {
    Config::from_yaml(&format!(
        "agent:\n  pollInterval: 50ms\n  heartbeatInterval: {interval}\nenforcement:\n  mode: \"off\"\n"
    ))
    .expect("config")
}

#[tokio::test]
async fn with_nothing_changing_the_report_is_written_once_per_heartbeat_and_never_between() {
    let api = FakeApiServer::new();
    api.create(&tdx_node(NODE, 16, false)).expect("node");
    let host = SimHost::builder().capacity(TDX, 16).build().expect("host");
    host.add_external("outside", TDX, 2).expect("external");
    let agent = Agent::start(&api, host.root(), heartbeat_config("1s"));
    agent
        .wait_status("published", |s| {
            s.tdx.as_ref().is_some_and(|t| t.external == 2)
        })
        .await;
    // The first heartbeat moves to the node's place in the interval; from then on, steady state.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    api.clear_requests();
    let window = Duration::from_millis(4200);
    tokio::time::sleep(window).await;
    let writes: Vec<RecordedRequest> = api.requests_where(is_write);
    assert!(
        (4..=5).contains(&writes.len()),
        "{} writes in {window:?} with a 1 s heartbeat: {:#?}",
        writes.len(),
        writes
            .iter()
            .map(|r| (&r.path, r.received_at))
            .collect::<Vec<_>>()
    );
    for w in &writes {
        assert_eq!(
            (w.resource.as_deref(), w.name.as_deref()),
            (Some("leases"), Some(NODE)),
            "in steady state only the node's heartbeat Lease is written, not the report"
        );
    }
    let lease: Lease = api
        .get_typed(Some("default"), NODE)
        .expect("typed")
        .expect("the Lease exists");
    assert_eq!(
        lease
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(AGENT_LEASE_LABEL))
            .map(String::as_str),
        Some("true")
    );
    assert_eq!(
        lease
            .metadata
            .owner_references
            .as_ref()
            .map(|o| o[0].kind.as_str()),
        Some("Node"),
        "deleted with its Node"
    );

    // A change is written to the report at once, not at the next heartbeat.
    api.clear_requests();
    host.remove_external("outside").expect("external VM stops");
    let changed = Instant::now();
    agent
        .wait_status("external 0", |s| {
            s.tdx.as_ref().is_some_and(|t| t.external == 0)
        })
        .await;
    assert!(
        changed.elapsed() < Duration::from_millis(500),
        "{:?}",
        changed.elapsed()
    );
    // Slots are one interval apart; a write delayed by a loaded machine makes the next gap shorter by
    // as much, so "none between" is checked as: never two within half an interval.
    for pair in writes.windows(2) {
        let gap = pair[1].received_at - pair[0].received_at;
        assert!(
            gap >= Duration::from_millis(500),
            "two writes {gap:?} apart with a 1 s heartbeat and nothing changing"
        );
    }
    agent.stop().await;
}

/// The largest number of `times` falling into one tenth of `interval`, counted modulo the interval
/// (heartbeats in lockstep all fall into one).
fn busiest_tenth(times: &[Instant], from: Instant, interval: Duration) -> usize {
    let tenth = interval.as_millis() / 10;
    let mut buckets: BTreeMap<u128, usize> = BTreeMap::new();
    for t in times {
        let into = t.saturating_duration_since(from).as_millis() % interval.as_millis();
        *buckets.entry(into / tenth).or_default() += 1;
    }
    buckets.values().copied().max().unwrap_or(0)
}

/// Every node's heartbeat writes within `window` starting now, by node.
async fn heartbeats_within(
    api: &FakeApiServer,
    window: Duration,
) -> (Instant, BTreeMap<String, Vec<Instant>>) {
    api.clear_requests();
    let from = Instant::now();
    tokio::time::sleep(window).await;
    let mut by_node: BTreeMap<String, Vec<Instant>> = BTreeMap::new();
    for r in api.requests_where(|r| {
        is_write(r) && matches!(r.resource.as_deref(), Some("teecapacities" | "leases"))
    }) {
        if r.received_at.saturating_duration_since(from) < window {
            by_node
                .entry(r.name.clone().unwrap_or_default())
                .or_default()
                .push(r.received_at);
        }
    }
    (from, by_node)
}

#[tokio::test]
async fn agents_started_together_or_back_from_an_api_outage_do_not_heartbeat_together() {
    const NODES: usize = 30;
    let interval = Duration::from_secs(2);
    let api = FakeApiServer::new();
    let hosts: Vec<SimHost> = (0..NODES)
        .map(|_| SimHost::builder().capacity(TDX, 16).build().expect("host"))
        .collect();
    let names: Vec<String> = (0..NODES).map(|i| format!("node-{i:02}")).collect();
    for name in &names {
        api.create(&tdx_node(name, 16, false)).expect("node");
    }
    // All agents start at the same moment (a DaemonSet created at once).
    let agents: Vec<Agent> = names
        .iter()
        .zip(&hosts)
        .map(|(n, h)| Agent::start_on(&api, n, h.root(), heartbeat_config("2s")))
        .collect();
    api.wait_for(WAIT, "every node's first report", |api| {
        (api.list("teecapacities", None)
            .iter()
            .filter(|o| o.pointer("/status/heartbeatTime").is_some())
            .count()
            == NODES)
            .then_some(())
    })
    .await
    .expect("reports");
    // Over two intervals: about two heartbeats per node, none closer than half an interval (a write
    // delayed by a loaded machine makes the next gap shorter by as much), spread over the interval.
    let spread = |what: &str, from: Instant, by_node: &BTreeMap<String, Vec<Instant>>| {
        assert_eq!(
            by_node.len(),
            NODES,
            "{what}: every node heartbeats: {by_node:?}"
        );
        for (node, times) in by_node {
            assert!(
                (1..=3).contains(&times.len()),
                "{what}: {node} wrote {} times in two heartbeat intervals",
                times.len()
            );
            for pair in times.windows(2) {
                assert!(
                    pair[1] - pair[0] >= interval / 2,
                    "{what}: {node} wrote twice {:?} apart",
                    pair[1] - pair[0]
                );
            }
        }
        let times: Vec<Instant> = by_node.values().flatten().copied().collect();
        let busiest = busiest_tenth(&times, from, interval);
        // About 6 per tenth; in lockstep all 60 would fall into one.
        assert!(
            busiest <= times.len() / 3,
            "{what}: {busiest} of {} heartbeats in one tenth of the interval",
            times.len()
        );
    };
    tokio::time::sleep(interval + interval / 2).await;
    let (from, beats) = heartbeats_within(&api, interval * 2).await;
    spread("after starting together", from, &beats);

    // The API server goes away (every watch dropped) and comes back: the publishes that failed are
    // retried on a jittered backoff, then every node goes back to its own place in the interval.
    let watches = api.open_watches();
    api.set_unavailable(true);
    api.drop_watches();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    api.clear_requests();
    api.set_unavailable(false);
    api.wait_for(WAIT, "every watch open again", |api| {
        (api.open_watches() >= watches).then_some(())
    })
    .await
    .expect("watches back");
    tokio::time::sleep(interval * 2).await;
    let (from, beats) = heartbeats_within(&api, interval * 2).await;
    spread("after the API server came back", from, &beats);

    for a in agents {
        a.stop().await;
    }
}
