//! Chaos on the real chain: clients create and delete VMIs at random while webhook replicas, a node's
//! agent and one of the two API servers are killed (a replica also stopped cleanly, as a rolling update
//! stops it) and restarted at random (its watches drop with it),
//! the invariants checked throughout from the API server's and the nodes' truth (issue 42).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, ListParams};
use teeguard_shared::{TeeCapacity, TeeKind};
use teeguard_tests::fixtures::Tee;
use teeguard_tests::kubevirt::vmis::{self, Size};
use teeguard_tests::prom::Scrape;

use super::full::{BIND_BOUND, WILL_START};
use super::{KubeVirtWorld, Options, vmi_of};

/// How long the chaos lasts: 3 minutes in CI, `TEEGUARD_CHAOS_SECONDS` for the 30-minute bench.
pub fn duration() -> Duration {
    let secs = std::env::var("TEEGUARD_CHAOS_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(180);
    Duration::from_secs(secs)
}

/// A VMI may wait beside a free key of its kind this long while everything is up before it counts as
/// left waiting: the goal is [`BIND_BOUND`]; two cores carry the whole chain, so twice that.
const LEFT_BOUND: Duration = Duration::from_secs(10);

/// What the run saw.
#[derive(Debug, Default)]
struct Seen {
    /// VMIs created, and those whose launcher pod ran.
    created: usize,
    started: BTreeSet<String>,
    /// VMIs refused at least once by teeguard.
    refused: BTreeSet<String>,
    /// Samples where a node had more pods bound than keys for them.
    overcommits: Vec<String>,
    /// VMIs left waiting beside a free key.
    left_waiting: Vec<String>,
    /// The longest time from a key showing free (or the VMI's refusal, if later) to a waiting VMI's
    /// pod bound.
    longest_free_to_bound: Duration,
    /// Chaos events done.
    events: Vec<String>,
}

/// Everything up: every replica, both agents, both API servers, and a replica deciding (the samplers
/// count nothing against the webhook while something is down, nor for [`LEFT_BOUND`] after).
#[derive(Debug)]
struct Health {
    up: AtomicBool,
    since: Mutex<Instant>,
}

impl Health {
    fn set(&self, up: bool) {
        self.up.store(up, Ordering::SeqCst);
        if up {
            *self.since.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
        }
    }

    /// Up for at least `d`.
    fn up_for(&self, d: Duration) -> bool {
        self.up.load(Ordering::SeqCst)
            && self
                .since
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .elapsed()
                >= d
    }
}

/// Chaos for [`duration`] on two nodes (2 TDX keys, 2 SEV-ES keys), 3 webhook replicas behind the
/// balancer (the other KubeVirt tests run the chart's 2), two API servers: no node ever gets more pods
/// than keys, no VMI is left waiting beside a free key while everything is up, and once the VMIs are
/// gone no replica holds a key.
pub async fn vmis_come_and_go_while_replicas_an_agent_and_an_api_server_restart() {
    let options = Options {
        replicas: 3,
        ..Options::keys(2, 2)
    };
    let Some(mut w) = KubeVirtWorld::start("kv-chaos", options).await else {
        return;
    };
    let seed = std::env::var("TEEGUARD_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| u64::from(std::process::id()));
    eprintln!("chaos: seed {seed} (TEEGUARD_CHAOS_SEED), {:?}", duration());
    let seen = Arc::new(Mutex::new(Seen::default()));
    let health = Arc::new(Health {
        up: AtomicBool::new(true),
        since: Mutex::new(Instant::now()),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let capacity: BTreeMap<String, u64> =
        [(w.tdx.name().to_string(), 2), (w.snp.name().to_string(), 2)].into();
    let sampler = tokio::spawn(sample(
        w.cluster.client.clone(),
        w.ns.clone(),
        capacity,
        seen.clone(),
        health.clone(),
        stop.clone(),
    ));
    let mut clients = Vec::new();
    for c in 0..3u64 {
        clients.push(tokio::spawn(client(
            w.cluster.client.clone(),
            w.ns.clone(),
            c,
            seed.wrapping_add(c),
            seen.clone(),
            stop.clone(),
        )));
    }
    let mut rng = fastrand::Rng::with_seed(seed);
    let end = Instant::now() + duration();
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(12_000 + rng.u64(..10_000))).await;
        if Instant::now() >= end {
            break;
        }
        let outage = Duration::from_millis(2_000 + rng.u64(..3_000));
        health.set(false);
        let event = match rng.u64(..4) {
            0 => {
                let i = rng.usize(..w.webhooks.len());
                w.stop_replica(i);
                tokio::time::sleep(outage).await;
                w.start_replica(i).await;
                format!("webhook replica {i} killed for {outage:?}")
            }
            1 => {
                // A rolling update's stop of the decider: it gives the Lease up and another
                // replica takes it at once, listing the holds before it decides.
                let drawn = rng.usize(..w.webhooks.len());
                let (i, role) = match w.decider().await {
                    Some(d) => (d, "the decider"),
                    None => (drawn, "nobody deciding"),
                };
                w.terminate_replica(i).await;
                tokio::time::sleep(outage).await;
                w.start_replica(i).await;
                format!("webhook replica {i} ({role}) stopped (SIGTERM) for {outage:?}")
            }
            2 => {
                w.tdx.agent.proc.kill();
                tokio::time::sleep(outage).await;
                w.restart_agent(Tee::Tdx).await;
                format!("the TDX node's agent killed for {outage:?}")
            }
            _ => {
                w.cluster
                    .cp
                    .stop_second()
                    .await
                    .expect("stop an API server");
                tokio::time::sleep(outage).await;
                w.cluster
                    .cp
                    .restart_second()
                    .await
                    .expect("the API server comes back");
                format!(
                    "the second API server (the scheduler's, a replica's watches) killed for {outage:?}"
                )
            }
        };
        // Up again once a replica decides (leader: after a decider died, its successor waited
        // the Lease out).
        w.one_decider().await;
        health.set(true);
        lock(&seen).events.push(event);
    }
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        let _ = c.await;
    }
    // Quiet: every VMI gone, then the TTL; no replica may hold a key any more.
    let api = vmis::api(&w.cluster.client, &w.ns, "VirtualMachineInstance");
    let _ = api
        .delete_collection(&DeleteParams::default(), &ListParams::default())
        .await;
    let pods: Api<Pod> = Api::namespaced(w.cluster.client.clone(), &w.ns);
    let gone = w
        .cluster
        .wait_none_listed(
            "every launcher pod gone",
            Duration::from_secs(120),
            &pods,
            &ListParams::default().labels("kubevirt.io=virt-launcher"),
        )
        .await;
    assert!(gone.is_ok(), "{gone:?}\n{}", w.diagnostics());
    stop.store(true, Ordering::SeqCst);
    let _ = sampler.await;
    let deadline = Instant::now() + Duration::from_secs(90);
    let holds_left = loop {
        let mut holds_left = 0.0;
        for r in w.webhooks.iter().flatten() {
            let text = r.metrics().await;
            holds_left += Scrape::parse(&text).sum("teeguard_webhook_holds", &[]);
        }
        if holds_left == 0.0 || Instant::now() >= deadline {
            break holds_left;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let s = lock(&seen);
    eprintln!(
        "chaos figures: {} VMIs created, {} started, {} refused at least once; longest from a key free \
         to its VMI's pod bound {:?}; overcommits {}; VMIs left waiting beside a free key {}; holds left \
         {holds_left}; events: {:?}",
        s.created,
        s.started.len(),
        s.refused.len(),
        s.longest_free_to_bound,
        s.overcommits.len(),
        s.left_waiting.len(),
        s.events
    );
    assert!(s.overcommits.is_empty(), "overcommits: {:?}", s.overcommits);
    assert!(
        s.left_waiting.is_empty(),
        "VMIs left waiting beside a free key: {:?}\n{}",
        s.left_waiting,
        w.diagnostics()
    );
    assert_eq!(holds_left, 0.0, "holds left behind");
    assert!(
        s.started.len() >= 4 && !s.refused.is_empty(),
        "the run exercised the keys: {s:?}"
    );
}

/// The kind of the chaos clients' VMI `name` (`c<client>-<n>-<tdx|snp>`): TDX, or SEV-ES for SNP.
fn kind_of(name: &str) -> TeeKind {
    if name.ends_with("tdx") {
        TeeKind::Tdx
    } else {
        TeeKind::SevEs
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One client: create a VMI of a random kind, keep it a random while, delete it; again until `stop`.
async fn client(
    kube: kube::Client,
    ns: String,
    id: u64,
    seed: u64,
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let api = vmis::api(&kube, &ns, "VirtualMachineInstance");
    let mut n = 0;
    while !stop.load(Ordering::SeqCst) {
        n += 1;
        let tee = if rng.bool() { Tee::Tdx } else { Tee::Snp };
        let name = format!("c{id}-{n:03}-{}", tee.slug());
        if vmis::create(&kube, &ns, &vmis::vmi(&name, tee, Size::SMALL))
            .await
            .is_ok()
        {
            lock(&seen).created += 1;
        }
        let keep = Duration::from_millis(3_000 + rng.u64(..20_000));
        let until = Instant::now() + keep;
        while Instant::now() < until && !stop.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        let _ = api.delete(&name, &DeleteParams::default()).await;
    }
}

/// Every 250 ms, from the API server: pods bound per node against its keys; VMIs waiting beside a free
/// key of their kind; which VMIs started or were refused; from a key showing free to a waiting VMI's
/// pod bound.
async fn sample(
    kube: kube::Client,
    ns: String,
    capacity: BTreeMap<String, u64>,
    seen: Arc<Mutex<Seen>>,
    health: Arc<Health>,
    stop: Arc<AtomicBool>,
) {
    let pods: Api<Pod> = Api::namespaced(kube.clone(), &ns);
    let reports: Api<TeeCapacity> = Api::all(kube.clone());
    let vmis = vmis::api(&kube, &ns, "VirtualMachineInstance");
    // When each node's report first showed a key free (cleared once none is), and when each waiting
    // VMI was first seen beside one.
    let mut free_since: BTreeMap<String, Instant> = BTreeMap::new();
    let mut beside: BTreeMap<String, Instant> = BTreeMap::new();
    let mut bound_seen: BTreeSet<String> = BTreeSet::new();
    // When each VMI was first seen refused by teeguard.
    let mut refused_at: BTreeMap<String, Instant> = BTreeMap::new();
    while !stop.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let (Ok(p), Ok(r), Ok(v)) = (
            pods.list(&ListParams::default().labels("kubevirt.io=virt-launcher"))
                .await,
            reports.list(&ListParams::default()).await,
            vmis.list(&ListParams::default()).await,
        ) else {
            continue;
        };
        let now = Instant::now();
        // Pods bound per node (terminating ones still hold their key), and launcher pods admitted
        // and not bound yet, per kind: each of those holds a key on the node of its kind (teeguard's
        // `Admitted` hold) that the node's report does not count until the scheduler binds it. After
        // an API server restart the scheduler's informers reconnect with their backoff (up to 30 s),
        // so such pods can wait unbound while the report shows their keys free.
        let mut bound: BTreeMap<String, Vec<String>> = BTreeMap::new();
        let mut unbound: BTreeMap<TeeKind, u64> = BTreeMap::new();
        for pod in &p.items {
            let ended = pod
                .status
                .as_ref()
                .and_then(|s| s.phase.as_deref())
                .is_some_and(|ph| ph == "Succeeded" || ph == "Failed");
            let vmi = vmi_of(pod).to_string();
            match pod.spec.as_ref().and_then(|s| s.node_name.clone()) {
                _ if ended => {}
                Some(node) => bound.entry(node).or_default().push(vmi),
                None if !vmi.is_empty() => *unbound.entry(kind_of(&vmi)).or_default() += 1,
                None => {}
            }
        }
        let mut s = lock(&seen);
        for (node, vmis) in &bound {
            let keys = capacity.get(node).copied().unwrap_or(0);
            if vmis.len() as u64 > keys {
                s.overcommits.push(format!(
                    "{node}: {} pods bound for {keys} keys: {vmis:?}",
                    vmis.len()
                ));
            }
            for v in vmis {
                if bound_seen.insert(v.clone()) {
                    // A VMI that waited: from the moment its node showed a free key (or it was
                    // refused, if later) to its pod bound.
                    if let (Some(free), Some(refused)) = (free_since.get(node), refused_at.get(v)) {
                        let took = now.saturating_duration_since(*free.max(refused));
                        s.longest_free_to_bound = s.longest_free_to_bound.max(took);
                    }
                }
                if super::running_named(&p.items, v) {
                    s.started.insert(v.clone());
                }
            }
        }
        // Keys free for a waiting VMI per kind: the reports' free less the unbound pods' holds (each
        // kind has one node here).
        let mut free_kind: BTreeMap<TeeKind, bool> = BTreeMap::new();
        for c in &r.items {
            let node = c.metadata.name.clone().unwrap_or_default();
            let mut free = false;
            if let Some(st) = &c.status {
                for k in [TeeKind::Tdx, TeeKind::SevEs] {
                    let reported = st.kind(k).map_or(0, |k| k.free);
                    if reported > unbound.get(&k).copied().unwrap_or(0) {
                        free_kind.insert(k, true);
                        free = true;
                    }
                }
            }
            if free {
                free_since.entry(node.clone()).or_insert(now);
            } else {
                free_since.remove(&node);
            }
        }
        // VMIs waiting with teeguard's refusal, no pod.
        let mut waiting_now = BTreeSet::new();
        for vmi in &v.items {
            let name = vmi.metadata.name.clone().unwrap_or_default();
            let refused = vmi.data["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| {
                    c["type"] == "Synchronized"
                        && c["message"]
                            .as_str()
                            .is_some_and(|m| m.ends_with(WILL_START))
                });
            let has_pod = p.items.iter().any(|pod| vmi_of(pod) == name);
            if refused {
                s.refused.insert(name.clone());
                refused_at.entry(name.clone()).or_insert(now);
            }
            let kind = kind_of(&name);
            if refused && !has_pod && free_kind.get(&kind).copied().unwrap_or(false) {
                waiting_now.insert(name.clone());
                let since = *beside.entry(name.clone()).or_insert(now);
                if now.saturating_duration_since(since) > LEFT_BOUND
                    && health.up_for(LEFT_BOUND + BIND_BOUND)
                {
                    s.left_waiting.push(format!(
                        "{name} waited {:?} beside a free {kind:?} key",
                        now.saturating_duration_since(since)
                    ));
                    beside.insert(name.clone(), now);
                }
            }
        }
        beside.retain(|n, _| waiting_now.contains(n));
        if !health.up_for(Duration::ZERO) {
            beside.clear();
        }
    }
}
