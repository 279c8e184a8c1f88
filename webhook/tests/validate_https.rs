//! `/validate` through the real stack: HTTPS to an in-process webhook whose caches (VMIs, Namespaces,
//! TeeCapacities, Nodes, virt-launcher pods) watch the in-process fake API server, and whose Events land
//! in it.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use common::{Harness, WAIT};
use http::StatusCode;
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};
use teeguard_shared::TeeKind;
use teeguard_tests::fakeapi::{FakeApiServer, FaultRule, Verb};
use teeguard_tests::fixtures::{
    self, AdmissionReviewBuilder, DEFAULT_NAMESPACE, NodeBuilder, ReportBuilder, TDX_KEYS, Tee,
    VirtLauncherPod, Vmi, owned_by, seed_vmi,
};
use teeguard_tests::wait::eventually;

const HINT: &str =
    "free a key or add capacity; `kubectl get teecapacities` shows free keys per node";
/// The end of a refusal of a virt-launcher pod not bound yet (`admission.retryRefusedVmis`).
const RETRY: &str = "; teeguard starts this VM by itself as soon as a key is free for it";

/// RFC 3339 time `age` ago.
/// A TDX report: `free` of `capacity` keys free, `external` held outside Kubernetes, heartbeat `age` ago.
fn tdx_report(node: &str, capacity: u64, free: u64, external: u64, age: Duration) -> Value {
    ReportBuilder::new(node)
        .kind_with_external(TeeKind::Tdx, capacity, free, external)
        .heartbeat_age(age)
        .to_value()
}

/// The status of [`tdx_report`] alone, for status patches.
fn tdx_status(capacity: u64, free: u64, external: u64, age: Duration) -> Value {
    let status = ReportBuilder::new("-")
        .kind_with_external(TeeKind::Tdx, capacity, free, external)
        .heartbeat_age(age)
        .status();
    serde_json::to_value(status).expect("status serialises")
}

const FRESH: Duration = Duration::from_secs(1);

/// A mutated, named TDX virt-launcher pod of `vmi` (key request and teeguard's annotation).
fn mutated(vmi: &str) -> VirtLauncherPod {
    VirtLauncherPod::for_tee(vmi, Tee::Tdx)
        .request(TDX_KEYS, "1")
        .annotation("misc-max.teeguard.dev/compute", "tdx 1")
        .generated_name()
}

/// Seed a VMI and its mutated pod; returns the stored pod (server-assigned UID).
fn seed_vm(api: &FakeApiServer, vmi: &str, namespace: &str) -> Pod {
    let uid = seed_vmi(api, &Vmi::new(vmi).namespace(namespace).tee(Tee::Tdx));
    let pod = owned_by(&mutated(vmi).namespace(namespace), &uid);
    let stored = api.create(&pod).expect("create pod");
    serde_json::from_value(stored).expect("stored pod")
}

fn binding(pod: &Pod, node: &str) -> Value {
    fixtures::binding_create(pod, node)
}

fn allowed(status: StatusCode, resp: &Value) -> &Value {
    assert_eq!(status, StatusCode::OK, "{resp}");
    assert_eq!(resp["response"]["allowed"], true, "{resp}");
    &resp["response"]
}

fn denied(status: StatusCode, resp: &Value, reason: &str) -> String {
    assert_eq!(status, StatusCode::OK, "{resp}");
    let r = &resp["response"];
    assert_eq!(r["allowed"], false, "{resp}");
    assert_eq!(r["status"]["code"], 403);
    assert_eq!(r["auditAnnotations"]["decision"], "denied", "{resp}");
    assert_eq!(r["auditAnnotations"]["reason"], reason, "{resp}");
    r["status"]["message"]
        .as_str()
        .expect("message")
        .to_string()
}

fn warnings(r: &Value) -> Vec<String> {
    r["warnings"]
        .as_array()
        .map(|w| {
            w.iter()
                .map(|s| s.as_str().expect("warning").to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Wait until the webhook's report cache shows `free` TDX keys for `node`.
async fn wait_free(h: &Harness, node: &str, free: u64) {
    let caches = h.caches();
    let node = node.to_string();
    eventually("report cached", async move || {
        let ix = caches.index.read();
        ix.report(&node)
            .status
            .and_then(|s| s.tdx.as_ref())
            .is_some_and(|k| k.free == free)
    })
    .await;
}

/// Wait until the webhook's VMI cache holds `n` VMIs waiting on teeguard.
async fn wait_waiting(h: &Harness, n: usize) {
    let c = h.caches();
    eventually("VMIs waiting", async move || {
        c.index.read().waiting_counts().values().sum::<usize>() == n
    })
    .await;
}

async fn wait_cached(h: &Harness, reports: usize, nodes: usize, pods: usize, vmis: usize) {
    let c = h.caches();
    eventually("caches filled", async move || {
        let (with_report, with_labels) = {
            let ix = c.index.read();
            let reported = ix.nodes().filter(|(_, n)| n.report.is_some()).count();
            let labelled = ix.nodes().filter(|(_, n)| n.labels.is_some()).count();
            (reported, labelled)
        };
        with_report == reports
            && with_labels == nodes
            && c.launcher_pods.len() == pods
            && c.vmis.len() == vmis
    })
    .await;
}

/// The events.k8s.io Events regarding `vmi`.
fn vmi_events(api: &FakeApiServer, namespace: &str, vmi: &str) -> Vec<Value> {
    api.list("events.events.k8s.io", Some(namespace))
        .into_iter()
        .filter(|e| e["regarding"]["name"] == vmi)
        .collect()
}

fn pod_gets(api: &FakeApiServer) -> Vec<teeguard_tests::fakeapi::RecordedRequest> {
    api.requests_where(|r| r.is(Verb::Get, "pods"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_node_binding_denied_until_a_key_is_freed_with_an_event_on_the_vmi() {
    let api = FakeApiServer::new();
    api.create(&tdx_report("node01", 31, 0, 3, FRESH))
        .expect("report");
    api.create(&NodeBuilder::new("node01").tdx(31).build())
        .expect("node");
    let pod = seed_vm(&api, "tdx-vm", DEFAULT_NAMESPACE);
    let vmi_uid = pod.metadata.owner_references.as_ref().expect("owner")[0]
        .uid
        .clone();
    let h = Harness::start_with(api, None, &[]).await;
    wait_cached(&h, 1, 1, 1, 1).await;
    h.api.clear_requests();

    // Full node; the three keys held by a VM outside Kubernetes are named.
    let review = binding(&pod, "node01");
    let (status, resp) = h.validate(&review).await;
    let msg = denied(status, &resp, "insufficient-keys");
    assert_eq!(
        msg,
        format!(
            "node node01 cannot host this TDX VM: 0/31 free (3 held outside Kubernetes); {HINT}"
        )
    );
    assert_eq!(resp["response"]["uid"], review["request"]["uid"]);
    assert_eq!(resp["response"]["auditAnnotations"]["node"], "node01");
    assert_eq!(resp["response"]["auditAnnotations"]["tee-kind"], "tdx");
    assert_eq!(resp["response"]["auditAnnotations"]["mode"], "enforce");

    // The Event appears on the VMI, carrying the same message.
    let event = h
        .api
        .wait_for(WAIT, "InsufficientTEEKeys event", |s| {
            vmi_events(s, DEFAULT_NAMESPACE, "tdx-vm")
                .into_iter()
                .next()
        })
        .await
        .expect("event recorded");
    assert_eq!(event["reason"], "InsufficientTEEKeys");
    assert_eq!(event["type"], "Warning");
    assert_eq!(event["reportingController"], "teeguard-webhook");
    assert_eq!(event["note"], msg.as_str());
    assert_eq!(event["regarding"]["kind"], "VirtualMachineInstance");
    assert_eq!(event["regarding"]["apiVersion"], "kubevirt.io/v1");
    assert_eq!(event["regarding"]["uid"], vmi_uid.as_str());

    // The scheduler retries a second later: denied again, but no second Event (rate limit).
    let (status, resp) = h.validate(&review).await;
    denied(status, &resp, "insufficient-keys");

    // The agent reports a freed key; once the cache has it, the binding is admitted and reserved.
    h.api
        .patch_status(
            "teecapacities",
            None,
            "node01",
            &json!({"status": tdx_status(31, 1, 3, FRESH)}),
        )
        .expect("free a key");
    wait_free(&h, "node01", 1).await;
    let (status, resp) = h.validate(&review).await;
    let r = allowed(status, &resp);
    assert_eq!(r["auditAnnotations"]["decision"], "admitted");
    assert_eq!(r["auditAnnotations"]["reason"], "enough-keys");
    assert!(r.get("warnings").is_none(), "{resp}");
    // A retry of the same binding does not reserve twice: still admitted.
    let (status, resp) = h.validate(&review).await;
    allowed(status, &resp);

    // Everything came from the caches.
    assert!(pod_gets(&h.api).is_empty(), "{:?}", pod_gets(&h.api));
    h.wait_metric(r#"teeguard_webhook_holds{reason="Bound"} 1"#)
        .await;
    // Written behind, once.
    h.wait_metric(r#"teeguard_webhook_hold_writes_total{result="written"} 1"#)
        .await;
    let (_, metrics) = h.admin_get("/metrics").await;
    for want in [
        r#"teeguard_webhook_validations_total{request="binding",kind="tdx",outcome="denied"} 2"#,
        r#"teeguard_webhook_validations_total{request="binding",kind="tdx",outcome="admitted"} 2"#,
        r#"teeguard_webhook_hold_writes_total{result="written"} 1"#,
        r#"teeguard_webhook_vmi_events_total{result="recorded"} 1"#,
        r#"teeguard_webhook_vmi_events_total{result="suppressed"} 1"#,
        r#"teeguard_webhook_cache_lookups_total{cache="virt_launcher_pods",result="cache_hit"} 4"#,
        r#"teeguard_webhook_admission_requests_total{endpoint="validate",outcome="denied"} 2"#,
    ] {
        assert!(metrics.contains(want), "{want} missing from\n{metrics}");
    }
    assert_eq!(vmi_events(&h.api, DEFAULT_NAMESPACE, "tdx-vm").len(), 1);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_bindings_take_the_last_key_once() {
    const N: usize = 50;
    let api = FakeApiServer::new();
    api.create(&tdx_report("node01", 31, 1, 0, FRESH))
        .expect("report");
    let pods: Vec<Pod> = (0..N)
        .map(|i| seed_vm(&api, &format!("vm{i:02}"), DEFAULT_NAMESPACE))
        .collect();
    let h = Arc::new(Harness::start_with(api, None, &[]).await);
    wait_cached(&h, 1, 0, N, N).await;

    // Connect first, then fire all bindings at once.
    let barrier = Arc::new(tokio::sync::Barrier::new(N));
    let mut tasks = Vec::new();
    for pod in &pods {
        let body = serde_json::to_vec(&binding(pod, "node01")).expect("json");
        let h = h.clone();
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            let mut conn = h.connect().await;
            barrier.wait().await;
            conn.post("/validate", body).await
        }));
    }
    let mut admitted = 0;
    let mut refused = Vec::new();
    for t in tasks {
        let (status, resp) = common::bounded("binding", t).await.expect("task");
        assert_eq!(status, StatusCode::OK, "{resp}");
        if resp["response"]["allowed"] == true {
            admitted += 1;
        } else {
            refused.push(
                resp["response"]["status"]["message"]
                    .as_str()
                    .expect("message")
                    .to_string(),
            );
        }
    }
    assert_eq!(admitted, 1, "exactly one binding gets the last key");
    assert_eq!(refused.len(), N - 1);
    for msg in &refused {
        assert_eq!(
            msg,
            &format!(
                "node node01 cannot host this TDX VM: 0/31 free (1 just admitted, not in the report yet); {HINT}"
            )
        );
    }
    h.wait_metric(r#"teeguard_webhook_holds{reason="Bound"} 1"#)
        .await;
    let h = Arc::into_inner(h).expect("no other handle");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_decides_but_reserves_nothing() {
    let api = FakeApiServer::new();
    api.create(&tdx_report("node01", 31, 1, 0, FRESH))
        .expect("report");
    let a = seed_vm(&api, "vm-a", DEFAULT_NAMESPACE);
    let b = seed_vm(&api, "vm-b", DEFAULT_NAMESPACE);
    let c = seed_vm(&api, "vm-c", DEFAULT_NAMESPACE);
    let h = Harness::start_with(api, None, &[]).await;
    wait_cached(&h, 1, 0, 3, 3).await;

    let dry = AdmissionReviewBuilder::binding(&a, "node01")
        .dry_run(true)
        .build();
    let (status, resp) = h.validate(&dry).await;
    allowed(status, &resp);
    // The dry run took nothing: a real binding still gets the key ...
    let (status, resp) = h.validate(&binding(&b, "node01")).await;
    allowed(status, &resp);
    // ... and the next one finds it taken. A dry run is decided like the real thing.
    let (status, resp) = h.validate(&binding(&c, "node01")).await;
    denied(status, &resp, "insufficient-keys");
    let dry = AdmissionReviewBuilder::binding(&c, "node01")
        .dry_run(true)
        .build();
    let (status, resp) = h.validate(&dry).await;
    denied(status, &resp, "insufficient-keys");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_and_missing_reports_under_both_policies() {
    const OLD: Duration = Duration::from_secs(600);
    let configs = [
        (None, false, true),
        (
            Some("admission:\n  staleReportPolicy:\n    podCreate: allow\n    binding: deny\n"),
            true,
            false,
        ),
    ];
    for (config, create_allowed, binding_allowed) in configs {
        let api = FakeApiServer::new();
        api.create(&tdx_report("stale-node", 31, 5, 0, OLD))
            .expect("report");
        api.create(&NodeBuilder::new("stale-node").tdx(31).build())
            .expect("node");
        let pod = seed_vm(&api, "tdx-vm", DEFAULT_NAMESPACE);
        let h = Harness::start_with(api, config, &[]).await;
        wait_cached(&h, 1, 1, 1, 1).await;

        // The scheduler's binding.
        let (status, resp) = h.validate(&binding(&pod, "stale-node")).await;
        if binding_allowed {
            let r = allowed(status, &resp);
            assert_eq!(r["auditAnnotations"]["decision"], "warned");
            assert_eq!(r["auditAnnotations"]["reason"], "report-unknown");
            let w = warnings(r);
            assert_eq!(w.len(), 1, "{resp}");
            assert!(
                w[0].contains("could not check free TDX keys on node stale-node")
                    && w[0].contains("(last heartbeat 10m")
                    && w[0].contains("admission.staleReportPolicy.binding"),
                "{}",
                w[0]
            );
        } else {
            let msg = denied(status, &resp, "report-unknown");
            assert!(
                msg.contains("node stale-node") && msg.contains("stale (last heartbeat 10m"),
                "{msg}"
            );
        }
        // A binding to a node with no report at all.
        let (status, resp) = h.validate(&binding(&pod, "no-agent-node")).await;
        if binding_allowed {
            let w = warnings(allowed(status, &resp));
            assert!(w[0].contains("has no TeeCapacity report"), "{w:?}");
        } else {
            let msg = denied(status, &resp, "report-unknown");
            assert!(
                msg.contains("no-agent-node has no TeeCapacity report"),
                "{msg}"
            );
        }

        // A pod CREATE choosing among candidates (only the stale node matches).
        let create = AdmissionReviewBuilder::create(fixtures::to_value(&pod)).build();
        let (status, resp) = h.validate(&create).await;
        if create_allowed {
            let r = allowed(status, &resp);
            assert_eq!(r["auditAnnotations"]["reason"], "report-unknown");
            let w = warnings(r);
            assert!(
                w[0].contains("report of stale-node is missing or stale")
                    && w[0].contains("admission.staleReportPolicy.podCreate"),
                "{w:?}"
            );
        } else {
            let msg = denied(status, &resp, "report-unknown");
            assert!(
                msg.starts_with(
                    "no node can host this TDX VM: stale-node report is stale (last heartbeat 10m"
                ) && msg.ends_with(&format!(
                    "ago); {HINT}; a node needs a running teeguard agent to report its keys{RETRY}"
                )),
                "{msg}"
            );
        }
        h.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warn_mode_and_namespace_override() {
    let api = FakeApiServer::new();
    api.create(&tdx_report("node01", 31, 0, 0, FRESH))
        .expect("report");
    for (name, mode) in [("team-warn", "warn"), ("team-enforce", "enforce")] {
        api.create(&json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": {"teeguard.dev/mode": mode}}}))
            .expect("namespace");
    }
    let default_pod = seed_vm(&api, "vm-default", DEFAULT_NAMESPACE);
    let enforced_pod = seed_vm(&api, "vm-enforced", "team-enforce");
    let h = Harness::start_with(api, Some("admission:\n  mode: warn\n"), &[]).await;
    wait_cached(&h, 1, 0, 2, 2).await;
    let c = h.caches();
    eventually("namespaces cached", async move || c.namespaces.len() == 2).await;

    // Global warn: allowed, with the denial message as the warning.
    let expected = format!("node node01 cannot host this TDX VM: 0/31 free; {HINT}");
    let (status, resp) = h.validate(&binding(&default_pod, "node01")).await;
    let r = allowed(status, &resp);
    assert_eq!(warnings(r), vec![expected.clone()]);
    assert_eq!(r["auditAnnotations"]["decision"], "warned");
    assert_eq!(r["auditAnnotations"]["reason"], "insufficient-keys");
    assert_eq!(r["auditAnnotations"]["mode"], "warn");

    // The namespace label says enforce: denied with the same message.
    let (status, resp) = h.validate(&binding(&enforced_pod, "node01")).await;
    assert_eq!(denied(status, &resp, "insufficient-keys"), expected);
    assert_eq!(resp["response"]["auditAnnotations"]["mode"], "enforce");

    // Events are written in order by one writer: once the enforced VMI's Event is there, a warn-mode
    // Event for the other VMI would be too. There is none.
    h.api
        .wait_for(WAIT, "event of the enforced VMI", |s| {
            vmi_events(s, "team-enforce", "vm-enforced")
                .into_iter()
                .next()
        })
        .await
        .expect("event");
    assert!(vmi_events(&h.api, DEFAULT_NAMESPACE, "vm-default").is_empty());
    h.stop().await;

    // And the other way round: global enforce, a namespace labelled warn.
    let api = FakeApiServer::new();
    api.create(&tdx_report("node01", 31, 0, 0, FRESH))
        .expect("report");
    api.create(&json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "team-warn", "labels": {"teeguard.dev/mode": "warn"}}}))
        .expect("namespace");
    api.create(&json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "typo", "labels": {"teeguard.dev/mode": "loud"}}}))
        .expect("namespace");
    let warned_pod = seed_vm(&api, "vm-w", "team-warn");
    let typo_pod = seed_vm(&api, "vm-t", "typo");
    let default_pod = seed_vm(&api, "vm-d", DEFAULT_NAMESPACE);
    let h = Harness::start_with(api, None, &[]).await;
    wait_cached(&h, 1, 0, 3, 3).await;
    let c = h.caches();
    eventually("namespaces cached", async move || c.namespaces.len() == 2).await;
    let (status, resp) = h.validate(&binding(&warned_pod, "node01")).await;
    assert_eq!(warnings(allowed(status, &resp)), vec![expected.clone()]);
    let (status, resp) = h.validate(&binding(&default_pod, "node01")).await;
    denied(status, &resp, "insufficient-keys");
    // An unknown label value keeps the global mode and says so.
    let (status, resp) = h.validate(&binding(&typo_pod, "node01")).await;
    denied(status, &resp, "insufficient-keys");
    let w = warnings(&resp["response"]);
    assert!(
        w.len() == 1 && w[0].contains("teeguard.dev/mode=\"loud\" is neither enforce nor warn"),
        "{w:?}"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_limit_annotations_are_denied_the_mutations_own_accepted() {
    let api = FakeApiServer::new();
    api.create(&tdx_report("node01", 31, 5, 0, FRESH))
        .expect("report");
    api.create(&NodeBuilder::new("node01").tdx(31).build())
        .expect("node");
    api.create(&json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "team-warn", "labels": {"teeguard.dev/mode": "warn"}}}))
        .expect("namespace");
    let uid = seed_vmi(&api, &Vmi::new("tdx-vm").tee(Tee::Tdx));
    let warn_uid = seed_vmi(
        &api,
        &Vmi::new("tdx-vm").namespace("team-warn").tee(Tee::Tdx),
    );
    let h = Harness::start_with(api, None, &[]).await;
    wait_cached(&h, 1, 1, 0, 2).await;

    // Exactly what /mutate writes: admitted (a node has keys).
    let pod = owned_by(&mutated("tdx-vm"), &uid);
    let (status, resp) = h
        .validate(&AdmissionReviewBuilder::create(pod.clone()).build())
        .await;
    let r = allowed(status, &resp);
    assert_eq!(r["auditAnnotations"]["reason"], "enough-keys");

    // The pod's /mutate result, fed to /validate: accepted.
    let unmutated = owned_by(
        &VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx).generated_name(),
        &uid,
    );
    let review = AdmissionReviewBuilder::create(unmutated).build();
    let (_, m) = h.review(&review).await;
    let patch = common::response_patch(&m).expect("patch");
    let (patched, _) = common::apply_to_object(&review, &patch);
    let (status, resp) = h
        .validate(&AdmissionReviewBuilder::create(patched).build())
        .await;
    allowed(status, &resp);

    // A user raising their own limit, another container, CRI-O's annotation (config: none).
    let cases = [
        (
            mutated("tdx-vm").annotation("misc-max.teeguard.dev/compute", "tdx 8"),
            "annotation misc-max.teeguard.dev/compute=\"tdx 8\" differs from what teeguard writes for a TDX VM with 1 key (\"tdx 1\")",
        ),
        (
            mutated("tdx-vm").annotation("misc-max.teeguard.dev/guest-console-log", "tdx 1"),
            "misc-max.teeguard.dev/guest-console-log",
        ),
        (
            mutated("tdx-vm").annotation(
                "io.kubernetes.cri-o.UnifiedCgroup.compute",
                "misc.max=tdx 4",
            ),
            "io.kubernetes.cri-o.UnifiedCgroup.compute",
        ),
    ];
    for (pod, want) in cases {
        let (status, resp) = h
            .validate(&AdmissionReviewBuilder::create(owned_by(&pod, &uid)).build())
            .await;
        let msg = denied(status, &resp, "forged-limit-annotation");
        assert!(msg.contains(want), "{want:?} not in {msg}");
        assert!(msg.contains("cannot raise its own TEE key limit"), "{msg}");
    }
    // Denied in a warn-mode namespace too: a namespace label does not switch security off.
    let pod = mutated("tdx-vm")
        .namespace("team-warn")
        .annotation("misc-max.teeguard.dev/compute", "tdx 8");
    let (status, resp) = h
        .validate(&AdmissionReviewBuilder::create(owned_by(&pod, &warn_uid)).build())
        .await;
    denied(status, &resp, "forged-limit-annotation");

    // A pod that is not a virt-launcher pod gets no such annotation from teeguard.
    let mut kata = fixtures::to_value(&fixtures::kata_pod("kata", fixtures::KataTee::Tdx));
    kata["metadata"]["annotations"]["unified-cgroup.crio.io/kata"] = json!("misc.max=tdx 9");
    let (status, resp) = h
        .validate(&AdmissionReviewBuilder::create(kata).build())
        .await;
    let msg = denied(status, &resp, "forged-limit-annotation");
    assert!(
        msg.contains("unified-cgroup.crio.io/kata")
            && msg.contains("writes no cgroup-limit annotation"),
        "{msg}"
    );

    // UPDATE: changing the limit annotation is denied; other changes pass.
    let before: Pod = serde_json::from_value(owned_by(&mutated("tdx-vm"), &uid)).expect("pod");
    let mut raised = before.clone();
    raised
        .metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert("misc-max.teeguard.dev/compute".into(), "tdx 9".into());
    let (status, resp) = h.validate(&fixtures::pod_update(&before, &raised)).await;
    let msg = denied(status, &resp, "forged-limit-annotation");
    assert!(
        msg.contains("cannot be changed from \"tdx 1\" to \"tdx 9\""),
        "{msg}"
    );
    let mut relabelled = before.clone();
    relabelled
        .metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert("team".into(), "a".into());
    let (status, resp) = h
        .validate(&fixtures::pod_update(&before, &relabelled))
        .await;
    let r = allowed(status, &resp);
    assert_eq!(r["auditAnnotations"]["reason"], "limits-unchanged");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binding_of_an_uncached_pod_is_decided_from_one_get() {
    let api = FakeApiServer::new();
    api.create(&tdx_report("node01", 31, 0, 0, FRESH))
        .expect("report");
    let uid = seed_vmi(&api, &Vmi::new("late-vm").tee(Tee::Tdx));
    let h = Harness::start_with(api, None, &[]).await;
    wait_cached(&h, 1, 0, 0, 1).await;
    // Keep new pods out of the cache: pod lists and watches fail from now on.
    for verb in [Verb::List, Verb::Watch] {
        h.api
            .add_fault(FaultRule::respond(503).verb(verb).resource("pods"));
    }
    h.api.clear_requests();
    h.api.drop_watches();
    let api = h.api.clone();
    eventually("pod watch refused", async move || {
        !api.requests_where(|r| r.is(Verb::Watch, "pods") && r.response_code == Some(503))
            .is_empty()
    })
    .await;
    // Created just now, as the binding follows within milliseconds.
    let stored = h
        .api
        .create(&owned_by(&mutated("late-vm"), &uid))
        .expect("pod");
    let pod: Pod = serde_json::from_value(stored).expect("pod");
    let name = pod.metadata.name.clone().expect("name");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        h.caches().launcher_pods.len(),
        0,
        "the pod must not be cached"
    );
    h.api.clear_requests();

    let (status, resp) = h.validate(&binding(&pod, "node01")).await;
    denied(status, &resp, "insufficient-keys");
    let gets = pod_gets(&h.api);
    assert_eq!(gets.len(), 1, "{gets:?}");
    assert_eq!(gets[0].name.as_deref(), Some(name.as_str()));
    assert_eq!(gets[0].namespace.as_deref(), Some(DEFAULT_NAMESPACE));

    // A binding for a pod that is gone (404) is allowed: the bind itself will fail.
    let ghost = VirtLauncherPod::for_tee("ghost-vm", Tee::Tdx)
        .generated_name()
        .build();
    let (status, resp) = h.validate(&binding(&ghost, "node01")).await;
    assert_eq!(
        allowed(status, &resp)["auditAnnotations"]["reason"],
        "pod-not-found"
    );
    // The API server failing the GET: allowed with a warning (fail open, like failurePolicy Ignore).
    h.api
        .add_fault(FaultRule::respond(500).verb(Verb::Get).resource("pods"));
    let (status, resp) = h.validate(&binding(&ghost, "node01")).await;
    let r = allowed(status, &resp);
    assert_eq!(r["auditAnnotations"]["reason"], "pod-lookup-failed");
    assert!(warnings(r)[0].contains("could not look up pod"), "{resp}");
    h.api.clear_faults();
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_bindings_are_allowed_without_an_api_call() {
    let api = FakeApiServer::new();
    api.create(&tdx_report("node01", 31, 0, 0, FRESH))
        .expect("report");
    let h = Harness::start_with(api, None, &[]).await;
    wait_cached(&h, 1, 0, 0, 0).await;
    h.api.clear_requests();
    let web: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web-7d9c8f6b5-x2q7k", "namespace": DEFAULT_NAMESPACE, "uid": "u-web"},
        "spec": {"containers": [{"name": "c", "resources": {"requests": {TDX_KEYS: "1"}}}]}
    }))
    .expect("pod");
    let (status, resp) = h.validate(&binding(&web, "node01")).await;
    let r = allowed(status, &resp);
    assert_eq!(r["auditAnnotations"]["reason"], "not-virt-launcher");
    assert_eq!(r["auditAnnotations"]["decision"], "skipped");
    let calls = h
        .api
        .requests_where(|r| !matches!(r.verb, Verb::Watch | Verb::List));
    assert!(calls.is_empty(), "{calls:?}");
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_create_checks_the_candidate_nodes() {
    let api = FakeApiServer::new();
    api.create(&tdx_report("node-a", 31, 0, 3, FRESH))
        .expect("report");
    api.create(&tdx_report("node-b", 31, 0, 0, FRESH))
        .expect("report");
    api.create(
        &ReportBuilder::new("sev-node")
            .kind(TeeKind::SevEs, 100, 100)
            .to_value(),
    )
    .expect("report");
    api.create(&NodeBuilder::new("node-a").tdx(31).build())
        .expect("node");
    api.create(&NodeBuilder::new("node-b").tdx(31).zone("zone-b").build())
        .expect("node");
    api.create(&NodeBuilder::new("sev-node").sev(500, 100).build())
        .expect("node");
    let uid = seed_vmi(&api, &Vmi::new("tdx-vm").tee(Tee::Tdx));
    let h = Harness::start_with(api, None, &[]).await;
    wait_cached(&h, 3, 3, 0, 1).await;
    let pod = owned_by(&mutated("tdx-vm"), &uid);

    // The pod's TDX node selector matches node-a and node-b; both full.
    let (status, resp) = h
        .validate(&AdmissionReviewBuilder::create(pod.clone()).build())
        .await;
    let msg = denied(status, &resp, "insufficient-keys");
    assert_eq!(
        msg,
        format!(
            "no node can host this TDX VM: node-a 0/31 free (3 held outside Kubernetes), node-b 0/31 free; {HINT}{RETRY}"
        )
    );
    assert!(resp["response"]["auditAnnotations"].get("node").is_none());
    h.api
        .wait_for(WAIT, "event", |s| {
            vmi_events(s, DEFAULT_NAMESPACE, "tdx-vm")
                .into_iter()
                .next()
        })
        .await
        .expect("event on the VMI");

    // A selector that matches no node.
    let mut nowhere = pod.clone();
    nowhere["spec"]["nodeSelector"]["topology.kubernetes.io/zone"] = json!("zone-z");
    let (status, resp) = h
        .validate(&AdmissionReviewBuilder::create(nowhere).build())
        .await;
    let msg = denied(status, &resp, "no-candidate-nodes");
    assert!(
        msg.starts_with("no node can host this TDX VM: no node matches the pod's nodeSelector"),
        "{msg}"
    );

    // Required affinity naming the SEV node (matchFields): it has no TDX keys.
    let mut sev_only = pod.clone();
    sev_only["spec"]
        .as_object_mut()
        .expect("spec")
        .remove("nodeSelector");
    sev_only["spec"]["affinity"] = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["sev-node"]}]}]}}});
    let (status, resp) = h
        .validate(&AdmissionReviewBuilder::create(sev_only).build())
        .await;
    let msg = denied(status, &resp, "insufficient-keys");
    assert!(msg.contains(": sev-node has no TDX keys;"), "{msg}");

    // A key frees up on node-b: admitted; affinity excluding zone-b leaves node-a only: refused.
    h.api
        .patch_status(
            "teecapacities",
            None,
            "node-b",
            &json!({"status": tdx_status(31, 1, 0, FRESH)}),
        )
        .expect("free");
    wait_free(&h, "node-b", 1).await;
    let (status, resp) = h
        .validate(&AdmissionReviewBuilder::create(pod.clone()).build())
        .await;
    allowed(status, &resp);
    let mut zone_a = pod.clone();
    zone_a["spec"]["affinity"] = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "topology.kubernetes.io/zone", "operator": "NotIn", "values": ["zone-b"]}]}]}}});
    let (status, resp) = h
        .validate(&AdmissionReviewBuilder::create(zone_a).build())
        .await;
    let msg = denied(status, &resp, "insufficient-keys");
    assert!(
        msg.contains("node-a 0/31 free") && !msg.contains("node-b"),
        "{msg}"
    );

    // With spec.nodeName the named node decides (and is reserved): node-b's one key.
    let mut bound = pod.clone();
    bound["spec"]["nodeName"] = json!("node-b");
    let (status, resp) = h
        .validate(&AdmissionReviewBuilder::create(bound).build())
        .await;
    assert_eq!(allowed(status, &resp)["auditAnnotations"]["node"], "node-b");
    // Now the candidates are all taken for another pod.
    let other = owned_by(&mutated("tdx-vm").name("virt-launcher-tdx-vm-other"), &uid);
    let (status, resp) = h
        .validate(&AdmissionReviewBuilder::create(other).build())
        .await;
    let msg = denied(status, &resp, "insufficient-keys");
    assert!(
        msg.contains("node-b 0/31 free (1 just admitted, not in the report yet)"),
        "{msg}"
    );
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_kinds_subresources_and_operations_are_allowed() {
    let api = FakeApiServer::new();
    api.create(&tdx_report("node01", 31, 0, 0, FRESH))
        .expect("report");
    let uid = seed_vmi(&api, &Vmi::new("tdx-vm").tee(Tee::Tdx));
    let h = Harness::start_with(api, None, &[]).await;
    wait_cached(&h, 1, 0, 0, 1).await;
    let pod: Pod = serde_json::from_value(owned_by(&mutated("tdx-vm"), &uid)).expect("pod");
    let pod_json = fixtures::to_value(&pod);
    let deployment = json!({"apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "default"}, "spec": {}});
    let cases: Vec<(Value, &str)> = vec![
        (fixtures::pod_delete(&pod), "pod-delete"),
        (
            AdmissionReviewBuilder::update(pod_json.clone(), pod_json.clone())
                .sub_resource("status")
                .build(),
            "not-validated",
        ),
        (
            AdmissionReviewBuilder::create(pod_json.clone())
                .sub_resource("ephemeralcontainers")
                .build(),
            "not-validated",
        ),
        (
            AdmissionReviewBuilder::create(deployment).build(),
            "not-validated",
        ),
        (
            AdmissionReviewBuilder::delete(pod_json.clone())
                .sub_resource("binding")
                .build(),
            "not-validated",
        ),
    ];
    for (review, reason) in cases {
        let (status, resp) = h.validate(&review).await;
        let r = allowed(status, &resp);
        assert_eq!(r["auditAnnotations"]["reason"], reason, "{review}");
        assert_eq!(r["auditAnnotations"]["decision"], "skipped");
        assert!(r.get("patch").is_none());
    }
    // A CONNECT (exec) review.
    let mut connect = fixtures::pod_delete(&pod);
    connect["request"]["operation"] = json!("CONNECT");
    connect["request"]["subResource"] = json!("exec");
    let (status, resp) = h.validate(&connect).await;
    allowed(status, &resp);

    // Malformed input is a 400, never a panic; the connection survives.
    let mut no_target = binding(&pod, "node01");
    no_target["request"]["object"]["target"] = json!({});
    let mut bad_pod = AdmissionReviewBuilder::create(pod_json).build();
    bad_pod["request"]["object"]["spec"]["containers"] = json!(7);
    let mut no_old = fixtures::pod_update(&pod, &pod);
    no_old["request"]["oldObject"] = Value::Null;
    let mut conn = h.connect().await;
    for (review, want) in [
        (no_target, "no target.name"),
        (bad_pod, "not a valid Pod"),
        (no_old, "request.oldObject is missing"),
    ] {
        let (status, resp) = conn
            .post("/validate", serde_json::to_vec(&review).expect("json"))
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{resp}");
        assert!(
            resp["error"].as_str().expect("error").contains(want),
            "{want}: {resp}"
        );
    }
    let (status, _) = conn.post("/validate", b"{".to_vec()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    h.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exemptions_skip_the_capacity_check() {
    let api = FakeApiServer::new();
    api.create(&tdx_report("node01", 31, 0, 0, FRESH))
        .expect("report");
    api.create(&json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "exempt-ns", "labels": {"teeguard.dev/exempt": "true"}}}))
        .expect("namespace");
    let in_ns = seed_vm(&api, "vm-ns", "exempt-ns");
    let vmi_uid = seed_vmi(&api, &Vmi::new("vm-x").tee(Tee::Tdx).exempt());
    let exempt_vmi_pod: Pod = serde_json::from_value(
        api.create(&owned_by(
            &VirtLauncherPod::for_tee("vm-x", Tee::Tdx)
                .request(TDX_KEYS, "1")
                .generated_name(),
            &vmi_uid,
        ))
        .expect("pod"),
    )
    .expect("pod");
    let h = Harness::start_with(api, None, &[]).await;
    wait_cached(&h, 1, 0, 2, 2).await;
    let c = h.caches();
    eventually("namespace cached", async move || c.namespaces.len() == 1).await;
    for (pod, reason) in [
        (&in_ns, "exempt-namespace"),
        (&exempt_vmi_pod, "exempt-vmi"),
    ] {
        let (status, resp) = h.validate(&binding(pod, "node01")).await;
        assert_eq!(allowed(status, &resp)["auditAnnotations"]["reason"], reason);
        let (status, resp) = h
            .validate(&AdmissionReviewBuilder::create(fixtures::to_value(pod)).build())
            .await;
        assert_eq!(allowed(status, &resp)["auditAnnotations"]["reason"], reason);
    }
    h.stop().await;
}

/// A VMI whose launcher pod teeguard refused at `since` (RFC 3339): `Pending`, virt-controller's
/// `Synchronized` condition quoting the refusal. Returns its UID.
fn seed_waiting_vmi(api: &FakeApiServer, name: &str, since: &str) -> String {
    let mut vmi = Vmi::new(name).tee(Tee::Tdx).scheduling().build();
    vmi["status"]["phase"] = json!("Pending");
    vmi["status"]["conditions"] = json!([{
        "type": "Synchronized", "status": "False", "reason": "FailedCreate",
        "lastTransitionTime": since,
        "message": format!("failed to create virtual machine pod: admission webhook \
            \"validate.pods.teeguard.dev\" denied the request: no node can host this TDX VM: node-a \
            0/31 free; {HINT}{RETRY}")
    }]);
    let stored = api.create(&vmi).expect("create VMI");
    stored["metadata"]["uid"].as_str().expect("uid").to_string()
}

// Under a burst, virt-controller's own retry of a VMI that waited less could land between the report
// showing a key free and the retry task's promise to the VMI that waited longest, and take the key.
// A launcher pod CREATE counts the keys of the VMIs waiting ahead of its own (without a promise) as
// taken: the newer VMI is refused and waits its turn, the older one is admitted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launcher_pod_waits_its_turn_behind_the_vmis_refused_before_its_own() {
    let api = FakeApiServer::new();
    api.create(&tdx_report("node-a", 31, 1, 0, FRESH))
        .expect("report");
    api.create(&NodeBuilder::new("node-a").tdx(31).build())
        .expect("node");
    // The key is `older`'s (refused first), whichever launcher pod CREATE lands first.
    let older = seed_waiting_vmi(&api, "older", "2026-11-26T10:00:00Z");
    let newer = seed_waiting_vmi(&api, "newer", "2026-11-26T10:05:00Z");
    let fresh = seed_vmi(&api, &Vmi::new("fresh").tee(Tee::Tdx).scheduling());
    let h = Harness::start_with(api, None, &[]).await;
    wait_cached(&h, 1, 1, 0, 3).await;
    wait_waiting(&h, 2).await;
    let pod = |vmi: &str, uid: &str| owned_by(&mutated(vmi), uid);

    // `newer` waits behind `older`; `fresh`, not refused yet, behind both (the one free key is kept).
    for (vmi, uid) in [("newer", &newer), ("fresh", &fresh)] {
        let (status, resp) = h
            .validate(&AdmissionReviewBuilder::create(pod(vmi, uid)).build())
            .await;
        let msg = denied(status, &resp, "insufficient-keys");
        assert_eq!(
            msg,
            format!(
                "no node can host this TDX VM: node-a 0/31 free (1 kept for VMs waiting longer); {HINT}{RETRY}"
            ),
            "{vmi}"
        );
    }
    // From its refused pod on, `newer` goes where that pod could go (virt-controller's full selector).
    let selector: BTreeMap<String, String> =
        serde_json::from_value(pod("newer", &newer)["spec"]["nodeSelector"].clone())
            .expect("the pod's nodeSelector");
    let learned = h
        .caches()
        .index
        .read()
        .vmis()
        .filter_map(|(_, v)| v.waiting.clone())
        .find(|w| w.vmi.name == "newer")
        .and_then(|w| w.placement.node_selector);
    assert_eq!(learned, Some(selector));
    let (status, resp) = h
        .validate(&AdmissionReviewBuilder::create(pod("older", &older)).build())
        .await;
    allowed(status, &resp);
    // `older` now holds the key through its promise, not through the queue.
    let (status, resp) = h
        .validate(&AdmissionReviewBuilder::create(pod("newer", &newer)).build())
        .await;
    let msg = denied(status, &resp, "insufficient-keys");
    assert!(
        msg.contains("node-a 0/31 free (1 just admitted, not in the report yet);"),
        "{msg}"
    );
    h.stop().await;
}

// Without the retry task nothing serves the VMIs ahead promptly: no queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_refused_vmis_not_retried_a_launcher_pod_does_not_wait_behind_them() {
    let api = FakeApiServer::new();
    api.create(&tdx_report("node-a", 31, 1, 0, FRESH))
        .expect("report");
    api.create(&NodeBuilder::new("node-a").tdx(31).build())
        .expect("node");
    seed_waiting_vmi(&api, "older", "2026-11-26T10:00:00Z");
    let newer = seed_waiting_vmi(&api, "newer", "2026-11-26T10:05:00Z");
    let config = "admission:\n  retryRefusedVmis: false\n";
    let h = Harness::start_with(api, Some(config), &[]).await;
    wait_cached(&h, 1, 1, 0, 2).await;
    wait_waiting(&h, 2).await;
    let (status, resp) = h
        .validate(&AdmissionReviewBuilder::create(owned_by(&mutated("newer"), &newer)).build())
        .await;
    allowed(status, &resp);
    h.stop().await;
}

/// The node's report status with `free` of one TDX key and `counted` pods in `countedPods`.
fn one_key_status(free: u64, counted: &[&str]) -> Value {
    let mut status = tdx_status(1, free, 0, FRESH);
    status["countedPods"] = json!(counted);
    json!({ "status": status })
}

// A pod's hold (in its node's TeeReservation) ends for good once a report counted the pod: when its
// containers stop before its object is deleted, the report no longer lists it, and the entry held the
// key again for the rest of ledgerTtl ("another replica's reservations took the keys", with one
// replica: a KubeVirt VMI retried for a freed key was refused at its binding).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_counted_by_a_report_does_not_hold_the_key_again_after_the_pod_stops() {
    let api = FakeApiServer::new();
    api.create(&tdx_report("node01", 1, 1, 0, FRESH))
        .expect("report");
    api.create(&NodeBuilder::new("node01").tdx(1).build())
        .expect("node");
    let first = seed_vm(&api, "first", DEFAULT_NAMESPACE);
    let second = seed_vm(&api, "second", DEFAULT_NAMESPACE);
    let h = Harness::start_with(api, None, &[]).await;
    wait_cached(&h, 1, 1, 2, 2).await;
    let (status, resp) = h.validate(&binding(&first, "node01")).await;
    allowed(status, &resp);
    h.api
        .wait_for(WAIT, "the binding's hold written behind", |s| {
            (s.list("teereservations", None).len() == 1).then_some(())
        })
        .await
        .expect("the binding is recorded in the node's TeeReservation");

    // The agent counts the first pod, then its containers stop: the key is free again, the pod's
    // object still there.
    let first_uid = first.metadata.uid.clone().expect("uid");
    h.api
        .patch_status(
            "teecapacities",
            None,
            "node01",
            &one_key_status(0, &[&first_uid]),
        )
        .expect("counted");
    wait_free(&h, "node01", 0).await;
    h.api
        .patch_status("teecapacities", None, "node01", &one_key_status(1, &[]))
        .expect("stopped");
    wait_free(&h, "node01", 1).await;

    let (status, resp) = h.validate(&binding(&second, "node01")).await;
    allowed(status, &resp);
    h.stop().await;
}
