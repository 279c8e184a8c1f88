//! Exact admissions with several webhook replicas: one, elected through the decider Lease, decides
//! what the others forward, and writes its holds behind into each node's `TeeReservation` (with
//! `resourceVersion` preconditions; the fake API server answers a stale write with 409 Conflict, as a
//! real one does); a successor takes over when it dies. Real `teeguard-webhook` processes, one fake
//! API server.

use kube::ResourceExt;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use teeguard_shared::reservation::TeeReservation;
use teeguard_tests::e2e::{E2eEnv, SecretDir, WebhookProcess};
use teeguard_tests::fakeapi::Verb;
use teeguard_tests::fixtures;
use teeguard_tests::standalone::WebhookClient;
use teeguard_tests::standalone::client::{admitted, refusals, review_together};

const TEST_DEADLINE: Duration = Duration::from_secs(240);

/// Bindings racing for a node's last key in one round.
const BINDINGS: usize = 50;

async fn bounded<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_DEADLINE, f)
        .await
        .expect("the scenario finished within its deadline");
}

/// Wait until every webhook's report cache holds `n` reports.
async fn wait_reports(webhooks: &[WebhookProcess], n: usize) {
    let want = format!("teeguard_webhook_cache_objects{{cache=\"teecapacities\"}} {n}");
    for w in webhooks {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !w.metrics().await.contains(&want) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{want} never reached"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn start(env: &E2eEnv, n: usize) -> Vec<WebhookProcess> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(env.start_webhook(&[]).await.expect("webhook starts"));
    }
    out
}

/// Two replicas over the TDX node `node-a` (8 keys, `free` free) and the admitted pods of VMs `vm-1`
/// and `vm-2`, once both replicas have the node's report; a client of each replica.
struct TwoReplicas {
    env: E2eEnv,
    _webhooks: Vec<WebhookProcess>,
    vm1: Pod,
    vm2: Pod,
    a: WebhookClient,
    b: WebhookClient,
}

impl TwoReplicas {
    async fn start(free: u64) -> TwoReplicas {
        let env = E2eEnv::new("").await.expect("env");
        let webhooks = start(&env, 2).await;
        fixtures::seed_tdx_node(&env.api, "node-a", 8, free);
        let vm1 = fixtures::seed_admitted_tdx_vm(&env.api, "vm-1");
        let vm2 = fixtures::seed_admitted_tdx_vm(&env.api, "vm-2");
        wait_reports(&webhooks, 1).await;
        let a = webhooks[0].client().expect("client");
        let b = webhooks[1].client().expect("client");
        TwoReplicas {
            env,
            _webhooks: webhooks,
            vm1,
            vm2,
            a,
            b,
        }
    }
}

/// Node `node`'s `TeeReservation` once the decider has written it behind.
async fn written(env: &E2eEnv, node: &str) -> TeeReservation {
    env.api
        .wait_for(Duration::from_secs(10), "the holds written behind", |api| {
            api.get_typed::<TeeReservation>(None, node).ok().flatten()
        })
        .await
        .expect("the decider writes its holds behind")
}

/// The pod UIDs node `node`'s `TeeReservation` lists, once they are `want` (sorted).
async fn entries(env: &E2eEnv, node: &str, want: &[&str]) {
    let mut want: Vec<String> = want.iter().map(|s| s.to_string()).collect();
    want.sort();
    let listed = |api: &teeguard_tests::fakeapi::FakeApiServer| {
        let res = api.get_typed::<TeeReservation>(None, node).ok()??;
        let mut pods: Vec<String> = res
            .spec
            .reservations
            .iter()
            .map(|r| r.pod_uid.clone())
            .collect();
        pods.sort();
        Some(pods)
    };
    let found = env
        .api
        .wait_for(Duration::from_secs(10), "the holds written behind", |api| {
            listed(api).filter(|p| *p == want)
        })
        .await;
    assert!(
        found.is_ok(),
        "{node} lists {:?}, not {want:?}",
        listed(&env.api)
    );
}

fn uid(pod: &Pod) -> &str {
    pod.metadata.uid.as_deref().expect("uid")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_hold_is_written_behind_owned_by_its_node_and_a_dry_run_or_a_retried_binding_adds_none()
{
    bounded(async {
        let replicas = TwoReplicas::start(2).await;
        let (env, vm1, vm2) = (&replicas.env, &replicas.vm1, &replicas.vm2);
        let (a, b) = (&replicas.a, &replicas.b);

        // A dry run of vm-2's binding decides but holds nothing; vm-1's binding holds its key.
        let dry = fixtures::AdmissionReviewBuilder::binding(vm2, "node-a")
            .dry_run(true)
            .build();
        assert!(a.review("/validate", &dry).await.expect("answered").allowed);
        let bind1 = fixtures::binding_create(vm1, "node-a");
        assert!(
            a.review("/validate", &bind1)
                .await
                .expect("answered")
                .allowed
        );
        entries(env, "node-a", &[uid(vm1)]).await;
        let res = written(env, "node-a").await;
        let owner = &res.metadata.owner_references.as_ref().expect("owner")[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str()),
            ("Node", "node-a")
        );
        let node_uid =
            env.api.get("nodes", None, "node-a").expect("node")["metadata"]["uid"].clone();
        assert_eq!(Some(owner.uid.as_str()), node_uid.as_str());

        // vm-1's retry through replica b is admitted on its hold; vm-2 takes the second key; a third
        // is refused on either replica.
        assert!(
            b.review("/validate", &bind1)
                .await
                .expect("answered")
                .allowed
        );
        assert!(
            b.review("/validate", &fixtures::binding_create(vm2, "node-a"))
                .await
                .expect("answered")
                .allowed
        );
        let vm3 = fixtures::seed_admitted_tdx_vm(&env.api, "vm-3");
        let r = a
            .review("/validate", &fixtures::binding_create(&vm3, "node-a"))
            .await
            .expect("answered");
        assert!(!r.allowed, "{:?}", r.raw);
        entries(env, "node-a", &[uid(vm1), uid(vm2)]).await;
        let writes = env
            .api
            .requests()
            .iter()
            .filter(|r| {
                r.resource.as_deref() == Some("teereservations")
                    && matches!(r.verb, Verb::Create | Verb::Update)
            })
            .count();
        assert!(writes <= 2, "one write per batch of holds: {writes}");
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_pods_hold_is_released() {
    bounded(async {
        let replicas = TwoReplicas::start(1).await;
        let (env, vm1, vm2) = (&replicas.env, &replicas.vm1, &replicas.vm2);
        let (a, b) = (&replicas.a, &replicas.b);
        assert!(
            a.review("/validate", &fixtures::binding_create(vm1, "node-a"))
                .await
                .expect("answered")
                .allowed
        );
        let refused = b
            .review("/validate", &fixtures::binding_create(vm2, "node-a"))
            .await
            .expect("answered");
        assert!(!refused.allowed, "vm-1 holds the key: {:?}", refused.raw);
        // vm-1's pod is deleted before it ever reaches the node: the replicas' virt-launcher caches see
        // the deletion and its entry stops holding the key at once (not only 5 s after admission, when
        // a pod missing from the cache counts as gone anyway).
        env.api
            .delete(
                "pods",
                Some(fixtures::DEFAULT_NAMESPACE),
                vm1.metadata.name.as_deref().expect("name"),
            )
            .expect("deleted");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        loop {
            let r = b
                .review("/validate", &fixtures::binding_create(vm2, "node-a"))
                .await
                .expect("answered");
            if r.allowed {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "still refused: {:?}",
                r.raw
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // vm-1's entry trimmed.
        entries(env, "node-a", &[uid(vm2)]).await;
    })
    .await;
}

/// The name of the replica that holds the decider Lease, once one does.
async fn decider(env: &E2eEnv, webhooks: &[WebhookProcess]) -> usize {
    use k8s_openapi::api::coordination::v1::Lease;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let lease = env
            .api
            .get_typed::<Lease>(Some("default"), &env.procs.decider_lease)
            .expect("typed");
        let address = lease
            .as_ref()
            .filter(|l| {
                l.spec
                    .as_ref()
                    .and_then(|s| s.holder_identity.as_deref())
                    .is_some_and(|h| !h.is_empty())
            })
            .and_then(|l| {
                l.annotations()
                    .get("teeguard.dev/decider-address")
                    .map(String::as_str)
            })
            .map(str::to_string);
        if let Some(a) = address
            && let Some(i) = webhooks
                .iter()
                .position(|w| a == format!("https://{}", w.https))
        {
            return i;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no replica took the decider Lease: {lease:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// [`BINDINGS`] bindings of one node's last key sent at once, spread over `clients` (once `webhooks` hold
/// `reports` reports): how many were admitted, and the refusals' messages.
async fn race_for_the_last_key(
    env: &E2eEnv,
    webhooks: &[WebhookProcess],
    clients: &[Arc<WebhookClient>],
    node: &str,
    tag: &str,
    reports: usize,
) -> (usize, Vec<String>) {
    fixtures::seed_tdx_node(&env.api, node, 31, 1);
    wait_reports(webhooks, reports).await;
    let pods: Vec<Pod> = (0..BINDINGS)
        .map(|i| fixtures::seed_admitted_tdx_vm(&env.api, &format!("{tag}-vm{i:02}")))
        .collect();
    let bindings = pods
        .iter()
        .map(|pod| fixtures::binding_create(pod, node))
        .collect();
    let replies = review_together(clients, "/validate", bindings)
        .await
        .expect("answered");
    for r in replies.iter().filter(|r| r.allowed) {
        eprintln!("{tag}: admitted: {}", r.raw["response"]);
    }
    (admitted(&replies), refusals(&replies))
}

/// One binding of a race took the node's last key, and every refusal is the decider's own,
/// whichever replica was called.
fn decided_once(admitted: usize, messages: &[String], node: &str) {
    assert_eq!(admitted, 1, "{messages:?}");
    let own = format!("node {node} cannot host this TDX VM: 0/31 free");
    assert!(
        messages.iter().all(|m| m.starts_with(&own)),
        "the decider's own refusals, whichever replica was called: {messages:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_elected_replica_decides_what_the_others_forward_and_another_takes_over_when_it_dies() {
    bounded(async {
        // A 3 s Lease: a successor decides ~3 s after the decider's last renewal.
        let env = E2eEnv::new("admission:\n  deciderLease: 3s\n")
            .await
            .expect("env");
        let mut webhooks = start(&env, 3).await;
        let first = decider(&env, &webhooks).await;
        let clients: Vec<_> = webhooks
            .iter()
            .map(|w| Arc::new(w.client().expect("client")))
            .collect();
        let (admitted, messages) =
            race_for_the_last_key(&env, &webhooks, &clients, "node-0", "a", 1).await;
        decided_once(admitted, &messages, "node-0");
        // No API write on the requests' path: the hold is written behind, soon after.
        let res = written(&env, "node-0").await;
        assert_eq!(res.spec.reservations.len(), 1, "{res:?}");

        // The decider dies: the others refuse (no decider) until one of them takes the Lease over,
        // then decide exactly again.
        webhooks[first].proc.kill();
        let rest: Vec<WebhookProcess> = webhooks
            .drain(..)
            .enumerate()
            .filter(|(i, _)| *i != first)
            .map(|(_, w)| w)
            .collect();
        let clients: Vec<_> = rest
            .iter()
            .map(|w| Arc::new(w.client().expect("client")))
            .collect();
        // Meanwhile a launcher pod CREATE through a remaining replica is refused as for lack of keys:
        // its VMI waits its turn and the next decider retries it.
        let pod = fixtures::seed_admitted_tdx_vm(&env.api, "between");
        let review = fixtures::AdmissionReviewBuilder::create(fixtures::to_value(&pod)).build();
        let r = clients[0]
            .review("/validate", &review)
            .await
            .expect("answered");
        assert!(
            !r.allowed
                && r.explanation()
                    .contains("teeguard starts this VM by itself"),
            "{:?}",
            r.raw
        );
        let t0 = tokio::time::Instant::now();
        let deadline = t0 + Duration::from_secs(60);
        loop {
            let lease = env
                .api
                .get_typed::<k8s_openapi::api::coordination::v1::Lease>(
                    Some("default"),
                    &env.procs.decider_lease,
                )
                .expect("typed")
                .expect("the Lease exists");
            let address = lease
                .annotations()
                .get("teeguard.dev/decider-address")
                .map(String::as_str)
                .unwrap_or_default()
                .to_string();
            if rest
                .iter()
                .any(|w| address == format!("https://{}", w.https))
            {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "no successor: {lease:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        println!(
            "a successor took the Lease {:?} after the decider died",
            t0.elapsed()
        );
        let (admitted, messages) =
            race_for_the_last_key(&env, &rest, &clients, "node-1", "b", 2).await;
        assert_eq!(admitted, 1, "{messages:?}");
    })
    .await;
}

// A renewed certificate reaches the replicas one by one (the kubelet refreshes each pod's Secret
// volume on its own sync, a minute or two apart): meanwhile the replicas serve different certificates
// of one CA, and the others still forward to the decider, which decides exactly. (Before, a replica
// trusted only the very certificate it served, and refused every review it had to forward.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_serving_different_certificates_of_one_ca_still_forward_to_the_decider() {
    bounded(async {
        let env = E2eEnv::new("").await.expect("env");
        let renewed = env.procs.issue_leaf().expect("a renewed certificate");
        let dir = env.procs.dir().join("renewed-certs");
        let certs = SecretDir::new(&dir, renewed.cert_pem(), renewed.key_pem()).expect("certs");
        certs.add_ca(env.procs.ca.cert_pem()).expect("ca.crt");
        let webhooks = vec![
            env.start_webhook(&[]).await.expect("webhook starts"),
            env.procs
                .start_webhook_with_certs(certs.path())
                .await
                .expect("the renewed replica starts"),
        ];
        let d = decider(&env, &webhooks).await;
        // Every review through the replica that does not decide: each is forwarded.
        let client = Arc::new(webhooks[1 - d].client().expect("client"));
        let (admitted, messages) =
            race_for_the_last_key(&env, &webhooks, &[client], "node-0", "r", 1).await;
        decided_once(admitted, &messages, "node-0");
    })
    .await;
}
