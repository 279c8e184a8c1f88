//! End-to-end scenarios: the real `teeguard-webhook` and `teeguard-agent` binaries as processes
//! (`KUBECONFIG` pointing at the fake API server served on 127.0.0.1, the agent reading a simulated
//! host's cgroup tree), with the test playing kube-apiserver, KubeVirt, the scheduler and the kubelet
//! through `ApiServerDriver` and `SimKubelet`. Each test has its own world, so they run in parallel.

use kube::ResourceExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};
use teeguard_tests::e2e::{NODE, World, json_log_line, peer_certificate};
use teeguard_tests::fixtures::{self, AdmissionReviewBuilder, KataTee, TDX_KEYS, Tee, kata_pod};
use teeguard_tests::host::{SANDBOX, TDX};
use teeguard_tests::standalone::{CreatedVmi, Decision, PodAdmission, VmiSpec};

/// Fast agent (reports follow the host within ~100 ms; heartbeats every second end the webhook's
/// holds quickly); default admission policy.
const CONFIG: &str = "agent:\n  pollInterval: 100ms\n  heartbeatInterval: 1s\n";

/// Every test body is bounded by this.
const TEST_DEADLINE: Duration = Duration::from_secs(150);

async fn bounded<F: Future<Output = ()>>(f: F) {
    tokio::time::timeout(TEST_DEADLINE, f)
        .await
        .expect("the scenario finished within its deadline");
}

async fn world(keys: u64, config: &str) -> World {
    World::start(keys, config).await.expect("world starts")
}

/// Create a TDX VMI and send its virt-launcher pod's CREATE through both webhooks.
async fn vm_pod(w: &World, spec: VmiSpec) -> (CreatedVmi, PodAdmission) {
    w.driver
        .create_vm(&spec)
        .await
        .expect("VMI stored, its pod reviewed")
}

/// (Re)send a VMI's virt-launcher pod CREATE, as virt-controller does after a refusal.
async fn pod_create(w: &World, vmi: &CreatedVmi) -> PodAdmission {
    w.driver
        .create_launcher_pod(vmi)
        .await
        .expect("pod CREATE reviewed")
}

fn key(pod: &Pod) -> (String, String) {
    (
        pod.metadata.namespace.clone().expect("namespace"),
        pod.metadata.name.clone().expect("name"),
    )
}

/// Bind to NODE through `/validate`; when bound, start the VM (`compute`) or Kata sandbox.
async fn bind_and_start(w: &World, pod: &Pod, charge_in: &str) -> bool {
    let (ns, name) = key(pod);
    let outcome = w
        .driver
        .bind(&ns, &name, NODE)
        .await
        .expect("binding reviewed");
    if !outcome.bound {
        return false;
    }
    let containers: &[&str] = if charge_in == SANDBOX {
        &["app"]
    } else {
        &["compute"]
    };
    w.kubelet()
        .start(&w.stored(pod), containers, charge_in, Some(TDX))
        .expect("the kernel gives the admitted VM its key");
    true
}

/// A TDX VM from VMI to running QEMU, asserting every step is admitted.
async fn run_vm(w: &World, name: &str) -> Pod {
    let pod = w.admitted_tdx_vm(name).await;
    assert!(bind_and_start(w, &pod, "compute").await, "{name} bound");
    w.settle().await.expect("settled");
    pod
}

async fn wait_vmi_event(w: &World, vmi: &CreatedVmi) -> Value {
    w.driver
        .wait_event(
            &vmi.spec.namespace,
            "VirtualMachineInstance",
            &vmi.spec.name,
            "InsufficientTEEKeys",
            Duration::from_secs(10),
        )
        .await
        .expect("InsufficientTEEKeys event on the VMI")
}

// 1. VMI created → pod mutated → validated → bound → VM starts (usage appears) → report updated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vmi_to_running_vm_updates_the_report() {
    bounded(async {
        let w = world(4, CONFIG).await;
        // The agent advertises the key pool on the Node (nothing did before it started).
        let four = Some("4".to_string());
        assert_eq!(
            fixtures::node_resource(&w.node(), TDX_KEYS),
            (four.clone(), four)
        );

        let (_, adm) = vm_pod(&w, VmiSpec::new("vm-1", Tee::Tdx)).await;
        assert_eq!(adm.mutate.decision(), Decision::Patched);
        let patch = serde_json::to_string(adm.mutate.patch.as_ref().expect("patch")).expect("json");
        assert!(patch.contains("tdx.intel.com~1keys"), "{patch}");
        let validate = adm.validate.as_ref().expect("validated");
        assert!(validate.allowed, "{:?}", validate.raw);
        let pod = adm.pod.expect("persisted");
        let compute = &pod.spec.as_ref().expect("spec").containers[0];
        let requests = compute
            .resources
            .as_ref()
            .and_then(|r| r.requests.as_ref())
            .expect("requests");
        assert_eq!(requests.get(TDX_KEYS).map(|q| q.0.as_str()), Some("1"));
        assert_eq!(
            pod.annotations()
                .get("misc-max.teeguard.dev/compute")
                .map(String::as_str),
            Some("tdx 1")
        );

        // Bound but not started: the report counts the key as pending.
        assert_eq!(w.driver.schedule(&pod).as_deref(), Ok(NODE));
        let (ns, name) = key(&pod);
        let b = w.driver.bind(&ns, &name, NODE).await.expect("binding");
        assert!(b.bound && b.reply.allowed, "{:?}", b.reply.raw);
        let s = w.settle().await.expect("settled");
        assert_eq!(
            (s.kernel_used, s.pods_used, s.pending, s.free),
            (0, 0, 1, 3),
            "{s:?}"
        );

        // The VM starts: the kernel charges its key in the pod's cgroup, the report follows.
        w.start_tdx_vm(&pod).expect("VM starts");
        let s = w.settle().await.expect("settled");
        assert_eq!(
            (
                s.capacity,
                s.kernel_used,
                s.pods_used,
                s.pending,
                s.external,
                s.free
            ),
            (4, 1, 1, 0, 0, 3),
            "{s:?}"
        );
        assert_eq!(s.resource_name, TDX_KEYS);
    })
    .await;
}

// 1b. The holds must not count an admitted key twice: with the agent at its real cadence (poll 1 s,
//     heartbeat 30 s, immediate publish on change), VM 2 created right after VM 1's report counts VM 1
//     is admitted at once, and VM 3, refused on a full node, gets a message whose figures are the
//     report's. (Before reservations ended on a report listing the pod, VM 2 was refused for ~30 s:
//     "0/2 free (1 just admitted, not in the report yet)".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_to_back_vms_are_admitted_as_soon_as_the_report_counts_the_first() {
    bounded(async {
        let w = world(2, "").await;
        let report_timeout = Duration::from_secs(10);
        let admit_and_bind = |name: &'static str| {
            let w = &w;
            async move {
                let (_, adm) = vm_pod(w, VmiSpec::new(name, Tee::Tdx)).await;
                let pod = adm
                    .pod
                    .unwrap_or_else(|| panic!("{name} admitted at CREATE: {:?}", adm.validate));
                let (ns, pod_name) = key(&pod);
                let b = w.driver.bind(&ns, &pod_name, NODE).await.expect("binding");
                assert!(b.bound, "{name} bound: {:?}", b.reply.raw);
                pod
            }
        };

        let pod1 = admit_and_bind("vm-1").await;
        let first = std::time::Instant::now();
        // The agent sees the binding and publishes at once: free 1, pending 1, vm-1 listed as counted.
        let s = w
            .driver
            .wait_report_settled(NODE, teeguard_shared::TeeKind::Tdx, &w.host, report_timeout)
            .await
            .expect("the report counts vm-1");
        assert_eq!((s.pending, s.free), (1, 1), "{s:?}");
        let uid1 = pod1.metadata.uid.clone().expect("uid");
        let counted = w.env.report(NODE).expect("report").counted_pods;
        assert!(counted.contains(&uid1), "{counted:?}");
        // Let the webhook's report cache take the new report.
        tokio::time::sleep(teeguard_tests::e2e::PROCESS_WATCH_GRACE).await;

        // VM 2, right away: one key is free and the webhook must not hold vm-1's key back on top.
        admit_and_bind("vm-2").await;
        let gap = first.elapsed();
        assert!(
            gap < Duration::from_secs(2),
            "vm-2 admitted {gap:?} after vm-1"
        );

        // VM 3: the node is really full; the refusal's figures are the report's, with nothing
        // "just admitted" on top.
        let s = w
            .driver
            .wait_report_settled(NODE, teeguard_shared::TeeKind::Tdx, &w.host, report_timeout)
            .await
            .expect("the report counts vm-2");
        assert_eq!((s.capacity, s.pending, s.free), (2, 2, 0), "{s:?}");
        tokio::time::sleep(teeguard_tests::e2e::PROCESS_WATCH_GRACE).await;
        let (_, adm3) = vm_pod(&w, VmiSpec::new("vm-3", Tee::Tdx)).await;
        let v = adm3.validate.as_ref().expect("validated");
        let msg = v.explanation();
        assert!(!v.allowed, "vm-3 refused on a full node: {:?}", v.raw);
        assert!(
            msg.contains("no node can host this TDX VM") && msg.contains("node-a 0/2 free"),
            "{msg}"
        );
        assert!(!msg.contains("just admitted"), "{msg}");
    })
    .await;
}

// 2. Host full (including keys held outside Kubernetes) → the next binding is denied, the VMI gets
//    an Event, and once a key is freed the retry is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_host_denies_binding_until_a_key_is_freed() {
    bounded(async {
        let w = world(3, CONFIG).await;
        w.host
            .add_external("legacy-db", TDX, 1)
            .expect("external VM");
        w.settle().await.expect("settled");
        run_vm(&w, "vm-1").await;

        // One key left: vm-2's pod is admitted at CREATE...
        let (vmi2, adm) = vm_pod(&w, VmiSpec::new("vm-2", Tee::Tdx)).await;
        let pod2 = adm.pod.expect("vm-2 admitted while a key is free");
        // ...then a VM outside Kubernetes takes the last key before the scheduler binds it.
        w.host
            .add_external("batch-job", TDX, 1)
            .expect("external VM");
        let s = w.settle().await.expect("settled");
        assert_eq!((s.free, s.external), (0, 2), "{s:?}");
        let (ns, name) = key(&pod2);
        let b = w
            .driver
            .bind(&ns, &name, NODE)
            .await
            .expect("binding reviewed");
        assert!(!b.bound, "binding onto a full host must be refused");
        let msg = b.reply.explanation();
        assert!(
            msg.contains("node node-a cannot host this TDX VM")
                && msg.contains("0/3 free")
                && msg.contains("2 held outside Kubernetes"),
            "{msg}"
        );
        assert_eq!(b.reply.code, Some(403));
        let ev = wait_vmi_event(&w, &vmi2).await;
        assert_eq!(ev["type"], "Warning");
        assert!(
            ev["message"].as_str().unwrap_or("").contains("cannot host"),
            "{ev}"
        );
        assert!(
            w.driver
                .events_for(&ns, "Pod", &name)
                .iter()
                .any(|e| e["reason"] == "FailedScheduling"),
            "the scheduler recorded FailedScheduling"
        );

        // A new VM is refused at pod CREATE already, with an Event too.
        let (vmi3, adm3) = vm_pod(&w, VmiSpec::new("vm-3", Tee::Tdx)).await;
        let v = adm3.validate.as_ref().expect("validated");
        assert!(
            !v.allowed && v.explanation().contains("no node can host this TDX VM"),
            "{:?}",
            v.raw
        );
        assert!(adm3.pod.is_none(), "a refused pod is not persisted");
        wait_vmi_event(&w, &vmi3).await;

        // The outside VM stops: the scheduler's retry of the same binding is admitted and the VM runs.
        w.host
            .remove_external("batch-job")
            .expect("stop external VM");
        w.settle().await.expect("settled");
        assert!(bind_and_start(&w, &pod2, "compute").await, "retry admitted");
        let s = w.settle().await.expect("settled");
        assert_eq!(
            (s.kernel_used, s.pods_used, s.external, s.free),
            (3, 2, 1, 0),
            "{s:?}"
        );
        // vm-3 is still refused: the host is full again.
        let again = pod_create(&w, &vmi3).await;
        assert!(again.pod.is_none(), "{:?}", again.validate);
    })
    .await;
}

// 3. Kata pods and KubeVirt VMs on one host share one pool: the sum never exceeds capacity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kata_pods_and_vms_share_one_pool() {
    bounded(async {
        let w = world(4, CONFIG).await;
        let mut started = 0;
        let mut refused = Vec::new();
        for (i, kata) in [true, false, true, false, true, false]
            .into_iter()
            .enumerate()
        {
            if kata {
                let name = format!("kata-{i}");
                let adm = w
                    .driver
                    .create_pod(&kata_pod(&name, KataTee::Tdx))
                    .await
                    .expect("kata CREATE");
                // Kata pods are not teeguard's to mutate or check: the RuntimeClass overhead
                // requests the shared resource and the scheduler counts it.
                assert_eq!(adm.mutate.decision(), Decision::Allowed);
                let pod = adm.pod.expect("kata pod persisted");
                match w.driver.schedule(&pod) {
                    Ok(node) => {
                        assert_eq!(node, NODE);
                        assert!(bind_and_start(&w, &pod, SANDBOX).await);
                        started += 1;
                    }
                    Err(why) => {
                        assert!(why.contains("Insufficient tdx.intel.com/keys"), "{why}");
                        refused.push(name);
                    }
                }
            } else {
                let name = format!("vm-{i}");
                let (_, adm) = vm_pod(&w, VmiSpec::new(&name, Tee::Tdx)).await;
                match adm.pod {
                    Some(pod) => {
                        assert!(w.driver.schedule(&pod).is_ok());
                        assert!(bind_and_start(&w, &pod, "compute").await, "{name} bound");
                        started += 1;
                    }
                    None => {
                        let v = adm.validate.expect("validated");
                        assert!(v.explanation().contains("0/4 free"), "{:?}", v.raw);
                        refused.push(name);
                    }
                }
            }
            let s = w.settle().await.expect("settled");
            assert!(s.kernel_used <= 4 && w.host.usage(TDX) <= 4);
            assert_eq!(s.kernel_used, started, "{s:?}");
        }
        assert_eq!(started, 4, "the first four consumers run");
        assert_eq!(refused, vec!["kata-4".to_string(), "vm-5".to_string()]);
        let s = w.settle().await.expect("settled");
        assert_eq!((s.pods_used, s.external, s.free), (4, 0, 0), "{s:?}");
    })
    .await;
}

// 4. Agent dies → its report goes stale → the stale policy applies (pod CREATE: deny; binding:
//    allow with a warning); the agent restarts → figures are right, nothing counted twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_agent_goes_stale_and_a_restart_does_not_double_count() {
    bounded(async {
        let config = "agent:\n  pollInterval: 100ms\n  heartbeatInterval: 500ms\nadmission:\n  staleReportAfter: 2s\n";
        let mut w = world(4, config).await;
        run_vm(&w, "vm-1").await;
        // vm-2's pod is admitted while the report is fresh; its binding comes later.
        let (_, adm) = vm_pod(&w, VmiSpec::new("vm-2", Tee::Tdx)).await;
        let pod2 = adm.pod.expect("admitted while fresh");

        w.kill_agent();
        let last = w.driver.last_heartbeat(NODE).expect("heartbeat");
        // Past staleReportAfter (2 s) plus the webhook's whole-second clock margin.
        let stale_at = last + jiff::SignedDuration::from_millis(3500);
        while jiff::Timestamp::now() < stale_at {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        let (vmi3, adm3) = vm_pod(&w, VmiSpec::new("vm-3", Tee::Tdx)).await;
        let v = adm3.validate.as_ref().expect("validated");
        assert!(!v.allowed, "podCreate: deny on a stale report: {:?}", v.raw);
        assert!(v.explanation().contains("stale"), "{}", v.explanation());
        wait_vmi_event(&w, &vmi3).await;

        let (ns, name) = key(&pod2);
        let b = w.driver.bind(&ns, &name, NODE).await.expect("binding reviewed");
        assert!(b.bound, "binding: allow on a stale report: {:?}", b.reply.raw);
        assert_eq!(b.reply.decision(), Decision::Warned);
        assert!(b.reply.warnings.iter().any(|m| m.contains("stale")), "{:?}", b.reply.warnings);
        // The VM starts while nobody reports.
        w.start_tdx_vm(&pod2)
            .expect("VM starts");

        w.restart_agent().await.expect("agent restarts");
        let s = w.settle().await.expect("settled");
        assert_eq!(
            (s.kernel_used, s.pods_used, s.pending, s.external, s.free),
            (2, 2, 0, 0, 2),
            "{s:?}"
        );
        // Fresh again: vm-3's retry is admitted.
        let again = pod_create(&w, &vmi3).await;
        assert!(again.pod.is_some(), "{:?}", again.validate);
    })
    .await;
}

// 4b. Nothing changes for longer than staleReportAfter: the agent renews its heartbeat Lease instead of
//     re-writing the report, and the webhook (which reads the Leases) still takes the report as current.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchanged_report_stays_current_while_its_agent_renews_its_lease() {
    bounded(async {
        let config = "agent:\n  pollInterval: 100ms\n  heartbeatInterval: 500ms\nadmission:\n  staleReportAfter: 2s\n";
        let w = world(4, config).await;
        let written = w.driver.report(NODE).and_then(|s| s.heartbeat_time).expect("report").0;
        // Past staleReportAfter (2 s) of the report's own heartbeat, plus the whole-second margin.
        let stale_at = written + jiff::SignedDuration::from_millis(3500);
        while jiff::Timestamp::now() < stale_at {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let now_written = w.driver.report(NODE).and_then(|s| s.heartbeat_time).expect("report").0;
        assert_eq!(now_written, written, "nothing changed: the report was not re-written");
        let renewed = w.driver.last_heartbeat(NODE).expect("lease");
        assert!(renewed > written + jiff::SignedDuration::from_secs(2), "the Lease was renewed");
        let (_, adm) = vm_pod(&w, VmiSpec::new("vm-1", Tee::Tdx)).await;
        assert!(adm.pod.is_some(), "admitted on the report its Lease keeps current: {:?}", adm.validate);
    })
    .await;
}

// Lifecycle: restarting (or upgrading: a new process replaces the old) the agent while a TEE VM runs
// never takes the key resource off the Node nor sets it to 0, and the report resumes with the same
// figures. Every write the new agent makes to the Node is in the fake API server's request log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_restart_with_a_running_vm_keeps_the_nodes_key_resource() {
    bounded(async {
        let mut w = world(4, CONFIG).await;
        run_vm(&w, "vm-1").await;
        let before = w.settle().await.expect("settled");
        let advertised = fixtures::node_resource(&w.node(), TDX_KEYS);
        let four = Some("4".to_string());
        assert_eq!(advertised, (four.clone(), four));
        let from = w.env.api.requests().last().map_or(0, |r| r.seq);

        w.restart_agent().await.expect("agent restarts");
        let after = w.settle().await.expect("settled");
        let figures = |s: &teeguard_shared::KindStatus| {
            (
                s.capacity,
                s.kernel_used,
                s.pods_used,
                s.pending,
                s.external,
                s.free,
            )
        };
        assert_eq!(figures(&after), figures(&before));
        assert_eq!(fixtures::node_resource(&w.node(), TDX_KEYS), advertised);
        // No write in between removed the resource or set it to anything else.
        let escaped = TDX_KEYS.replace('/', "~1");
        for r in w
            .env
            .api
            .requests_where(|r| r.seq > from && r.resource.as_deref() == Some("nodes"))
            .into_iter()
            .filter(|r| r.method != "GET")
        {
            let body = r.body.map(|b| b.to_string()).unwrap_or_default();
            assert!(
                !body.contains(&escaped) && !body.contains(TDX_KEYS),
                "the restarted agent wrote the key resource: {} {} {body}",
                r.method,
                r.path
            );
        }
    })
    .await;
}

// 5. API server unavailable for a while → the webhook keeps answering from its caches (the decider
//    admits a launcher pod CREATE while its Lease lasts, holding the key in memory); the agent keeps
//    scanning and publishes when it is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_outage_webhook_answers_from_caches_agent_publishes_after() {
    bounded(async {
        let mut w = world(4, CONFIG).await;
        run_vm(&w, "vm-1").await;
        // vm-2: admitted and bound, not started yet. vm-3: admitted, not bound. vm-4: VMI only.
        let (_, a2) = vm_pod(&w, VmiSpec::new("vm-2", Tee::Tdx)).await;
        let pod2 = a2.pod.expect("vm-2 admitted");
        let (ns2, name2) = key(&pod2);
        assert!(w.driver.bind(&ns2, &name2, NODE).await.expect("bind").bound);
        w.settle().await.expect("settled");
        let (_, a3) = vm_pod(&w, VmiSpec::new("vm-3", Tee::Tdx)).await;
        let pod3 = a3.pod.expect("vm-3 admitted");
        let vmi4 = w
            .driver
            .create_vmi(&VmiSpec::new("vm-4", Tee::Tdx))
            .expect("VMI");
        w.settle_before_outage().await.expect("settled");

        w.env.served.stop().await;
        let outage_start = std::time::Instant::now();
        // The VM of the bound pod starts while the API server is down.
        w.start_tdx_vm(&pod2).expect("VM starts");
        // The webhook still answers every kind of review from its caches.
        let launcher = w.driver.launcher_pod(&vmi4).expect("pod");
        let v = w
            .driver
            .review_create(
                &launcher,
                "virt-launcher-vm-4-x7k2p",
                "8d1c1c3e-1d7c-4b8e-9a61-7a1e4d3c2b10",
            )
            .await
            .expect("mutated and validated");
        // Decided from the cached report by the decider, whose Lease holds for its renew deadline
        // (10 s) after its last renewal, seconds before: its hold is kept in memory and written
        // behind once the API server answers.
        assert!(v.allowed, "pod CREATE from cached reports: {:?}", v.raw);
        let b = w
            .driver
            .review_binding(&pod3, NODE)
            .await
            .expect("binding answered");
        // Decided from the cached pod and report; its key has been held since its CREATE: nothing to
        // write.
        assert!(b.allowed, "binding from cached pod and report: {:?}", b.raw);
        assert!(b.warnings.is_empty(), "{:?}", b.warnings);
        w.driver.note_admission(NODE, "default/vm-3");
        // Keep the outage going for two agent polls at least.
        while outage_start.elapsed() < Duration::from_secs(2) {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let agent = w.agent.as_mut().expect("agent");
        assert!(
            agent.proc.exit_status().is_none(),
            "the agent keeps running"
        );
        let log = agent.proc.log();
        assert!(
            log.lines().any(
                |l| json_log_line(l, "cannot publish TeeCapacity; scanning goes on").is_some()
            ),
            "the agent noticed the outage:\n{log}"
        );

        w.env.served.restart().await.expect("API server back");
        let s = w
            .settle()
            .await
            .expect("the agent publishes the VM that started during the outage");
        assert_eq!((s.kernel_used, s.pods_used, s.pending), (2, 2, 0), "{s:?}");
        w.webhook
            .wait_ready(Duration::from_secs(20))
            .await
            .expect("webhook ready after the outage");
    })
    .await;
}

// 6. Certificate rotation under load (the kubelet's `..data` symlink swap) while clients send
//    reviews over kept-alive and new connections → no failed request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_rotation_under_load_fails_no_request() {
    bounded(async {
        let mut w = World::start_with(4, CONFIG, &["--cert-check-interval", "1s"])
            .await
            .expect("world starts");
        let vmi = w
            .driver
            .create_vmi(&VmiSpec::new("vm-1", Tee::Tdx))
            .expect("VMI");
        let review = AdmissionReviewBuilder::create(fixtures::to_value(
            &w.driver.launcher_pod(&vmi).expect("pod"),
        ))
        .build();
        let body = serde_json::to_vec(&review).expect("json");
        let ok = Arc::new(AtomicUsize::new(0));
        let failures = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
        let stop = tokio_util::sync::CancellationToken::new();
        let mut tasks = Vec::new();
        for fresh in [false, false, true, true] {
            let client = w.webhook.client().expect("client");
            let (body, ok, failures, stop) =
                (body.clone(), ok.clone(), failures.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                while !stop.is_cancelled() {
                    let got = if fresh {
                        client.post_fresh("/mutate", &body).await
                    } else {
                        client.post("/mutate", &body).await
                    };
                    match got {
                        Ok((status, resp))
                            if status.is_success()
                                && String::from_utf8_lossy(&resp).contains("\"patch\"") =>
                        {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok((status, resp)) => failures
                            .lock()
                            .expect("lock")
                            .push(format!("HTTP {status}: {}", String::from_utf8_lossy(&resp))),
                        Err(e) => failures.lock().expect("lock").push(e.to_string()),
                    }
                    // Steady load without starving the other scenarios running in parallel.
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }));
        }
        let ca = w.env.ca.cert_der();
        let mut served = peer_certificate(w.webhook.https, ca.clone())
            .await
            .expect("handshake");
        for round in 0..3 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let leaf = w.env.issue_leaf().expect("new leaf");
            w.env
                .certs
                .rotate(leaf.cert_pem(), leaf.key_pem())
                .expect("rotate");
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                let now = peer_certificate(w.webhook.https, ca.clone())
                    .await
                    .expect("handshake");
                if now == leaf.cert_der() {
                    assert_ne!(now, served);
                    served = now;
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "rotation {round}: the webhook did not serve the new certificate within 10s"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        stop.cancel();
        for t in tasks {
            t.await.expect("client task");
        }
        let failures = failures.lock().expect("lock").clone();
        assert!(
            failures.is_empty(),
            "{} failed requests: {failures:#?}",
            failures.len()
        );
        assert!(
            ok.load(Ordering::Relaxed) >= 20,
            "load was applied: {}",
            ok.load(Ordering::Relaxed)
        );
        w.kill_agent();
    })
    .await;
}

// 7. Exempt namespace and exempt VMI → untouched, even on a full host (a non-exempt VM is refused).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exempt_namespace_and_vmi_are_untouched() {
    bounded(async {
        let w = world(2, CONFIG).await;
        w.env
            .api
            .create(&json!({
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": "legacy", "labels": {fixtures::EXEMPT_LABEL: "true"}}
            }))
            .expect("namespace");
        w.host.add_external("legacy-db", TDX, 2).expect("host full");
        let s = w.settle().await.expect("settled");
        assert_eq!(s.free, 0);

        // KubeVirt copies the VMI's labels onto its pod, so an exempt VMI's pod is exempt itself.
        for (spec, reason) in [
            (
                VmiSpec::new("old-vm", Tee::Tdx).namespace("legacy"),
                "exempt-namespace",
            ),
            (VmiSpec::new("special-vm", Tee::Tdx).exempt(), "exempt-pod"),
        ] {
            let (_, adm) = vm_pod(&w, spec.clone()).await;
            assert_eq!(
                adm.mutate.decision(),
                Decision::Allowed,
                "{:?}",
                adm.mutate.raw
            );
            assert!(adm.mutate.patch.is_none());
            assert_eq!(
                adm.mutate.audit.get("reason").map(String::as_str),
                Some(reason)
            );
            let v = adm.validate.as_ref().expect("validated");
            assert!(v.allowed && v.warnings.is_empty(), "{:?}", v.raw);
            assert_eq!(v.audit.get("decision").map(String::as_str), Some("skipped"));
            let pod = adm.pod.expect("persisted untouched");
            let compute = &pod.spec.as_ref().expect("spec").containers[0];
            let requests = compute
                .resources
                .as_ref()
                .and_then(|r| r.requests.clone())
                .unwrap_or_default();
            assert!(
                !requests.contains_key(TDX_KEYS),
                "{}: no key request",
                spec.name
            );
            assert!(
                pod.metadata
                    .annotations
                    .as_ref()
                    .is_none_or(|a| !a.keys().any(|k| k.starts_with("misc-max.teeguard.dev/"))),
                "{}: no misc.max annotation",
                spec.name
            );
            let (ns, name) = key(&pod);
            let b = w
                .driver
                .bind(&ns, &name, NODE)
                .await
                .expect("binding reviewed");
            assert!(
                b.bound,
                "{}: binding untouched: {:?}",
                spec.name, b.reply.raw
            );
            assert_eq!(
                b.reply.audit.get("decision").map(String::as_str),
                Some("skipped")
            );
            assert!(
                w.driver
                    .events_for(&spec.namespace, "VirtualMachineInstance", &spec.name)
                    .is_empty()
            );
        }
        // Control: the same VM without exemption is refused.
        let (_, adm) = vm_pod(&w, VmiSpec::new("normal-vm", Tee::Tdx)).await;
        assert!(adm.pod.is_none(), "{:?}", adm.validate);
    })
    .await;
}
