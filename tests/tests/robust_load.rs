//! Load with faults: 10 000 reviews (mutating and validating; every TEE kind, exempt namespaces and
//! VMIs, non-TEE and non-KubeVirt pods, forged annotations, bindings, deletes) from 16 keep-alive
//! connections that reconnect every 50 requests, while the serving certificate is rotated by the
//! kubelet's `..data` symlink swap and the fake API server keeps dropping and expiring the webhook's
//! watches. Every answer is checked against the answer the scenario defines (README's resource names
//! and annotation, the validating rules), not against the webhook's own code: zero failed reviews,
//! zero wrong decisions.

mod robust_support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::prelude::{BASE64_STANDARD, Engine as _};
use bytes::Bytes;
use http::StatusCode;
use robust_support::{Expected, H1, Webhook, answer_to, bounded, check_mutate};
use serde_json::{Value, json};
use teeguard_shared::TeeKind;
use teeguard_tests::fakeapi::FakeApiServer;
use teeguard_tests::fixtures::{
    self, AdmissionReviewBuilder, KataTee, NodeBuilder, ReportBuilder, Tee, VirtLauncherPod, Vmi,
    owned_by, seed_vmi,
};

const REVIEWS: usize = 10_000;
const CONNECTIONS: usize = 16;
const REQUESTS_PER_CONNECTION: usize = 50;
/// Fixed-length placeholder replaced by each request's own uid.
const UID_PLACEHOLDER: &str = "uid-placeholder-0000000000";

/// What the validating webhook must answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Validated {
    Allowed,
    Denied,
}

#[derive(Clone, Debug)]
enum Want {
    Mutate(Expected),
    Validate(Validated),
}

struct Case {
    name: String,
    path: &'static str,
    review: Value,
    body: Vec<u8>,
    want: Want,
}

fn case(name: &str, path: &'static str, review: AdmissionReviewBuilder, want: Want) -> Case {
    let review = review.uid(UID_PLACEHOLDER).build();
    let body = serde_json::to_vec(&review).expect("review json");
    Case {
        name: name.to_string(),
        path,
        review,
        body,
        want,
    }
}

fn report(node: &str, free: u64) -> Value {
    ReportBuilder::new(node)
        .kind(TeeKind::Tdx, free, free)
        .to_value()
}

/// The scenario: objects in the fake API server and the reviews with their expected answers.
fn scenario(api: &FakeApiServer) -> Vec<Case> {
    let ns = |name: &str, labels: Value| {
        api.create(&json!({"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": labels}}))
            .expect("namespace");
    };
    ns("default", json!({}));
    ns("exempt-ns", json!({"teeguard.dev/exempt": "true"}));
    // TDX nodes with plenty of keys; no node offers SEV or SEV-ES.
    for node in ["node01", "node02", "node03", "node04"] {
        api.create(&NodeBuilder::new(node).tdx(1_000_000).to_value())
            .expect("node");
        api.create(&report(node, 1_000_000)).expect("report");
    }
    let mut cases = Vec::new();
    let m = |tee: Tee| Want::Mutate(Expected::for_tee(tee));

    // --- mutating ---
    for tee in [
        Tee::Tdx,
        Tee::Sev,
        Tee::SevEs,
        Tee::Snp,
        Tee::None,
        Tee::SecureExecution,
        Tee::TdxAndSnp,
    ] {
        let vmi = format!("{}-vm", tee.slug());
        let uid = seed_vmi(api, &Vmi::new(&vmi).tee(tee));
        let pod = VirtLauncherPod::for_tee(&vmi, tee);
        cases.push(case(
            &format!("mutate {}", tee.slug()),
            "/mutate",
            AdmissionReviewBuilder::create(owned_by(&pod.to_value(), &uid)),
            m(tee),
        ));
        if tee == Tee::Tdx {
            // Dry run and a migration target get the key too.
            cases.push(case(
                "mutate tdx dry-run",
                "/mutate",
                AdmissionReviewBuilder::create(owned_by(&pod.to_value(), &uid)).dry_run(true),
                m(tee),
            ));
            cases.push(case(
                "mutate tdx migration target",
                "/mutate",
                AdmissionReviewBuilder::create(owned_by(
                    &fixtures::to_value(&fixtures::migration_target_pod(&vmi, tee, "node01")),
                    &uid,
                )),
                m(tee),
            ));
            for (name, pod) in [
                ("storage-binding", fixtures::storage_binding_pod(&vmi, tee)),
                ("hotplug", fixtures::hotplug_pod(&vmi, "node01")),
            ] {
                cases.push(case(
                    &format!("mutate {name}"),
                    "/mutate",
                    AdmissionReviewBuilder::create(owned_by(&fixtures::to_value(&pod), &uid)),
                    Want::Mutate(Expected::Untouched),
                ));
            }
        }
    }
    // An exempt VMI (its label is copied to the pod), a TEE VMI in an exempt namespace, a Kata pod.
    let uid = seed_vmi(api, &Vmi::new("exempt-vm").tee(Tee::Tdx).exempt());
    cases.push(case(
        "mutate exempt VMI",
        "/mutate",
        AdmissionReviewBuilder::create(owned_by(
            &VirtLauncherPod::for_tee("exempt-vm", Tee::Tdx)
                .exempt()
                .to_value(),
            &uid,
        )),
        Want::Mutate(Expected::Untouched),
    ));
    let uid = seed_vmi(
        api,
        &Vmi::new("tdx-vm").namespace("exempt-ns").tee(Tee::Tdx),
    );
    cases.push(case(
        "mutate exempt namespace",
        "/mutate",
        AdmissionReviewBuilder::create(owned_by(
            &VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
                .namespace("exempt-ns")
                .to_value(),
            &uid,
        )),
        Want::Mutate(Expected::Untouched),
    ));
    cases.push(case(
        "mutate kata pod",
        "/mutate",
        AdmissionReviewBuilder::create(fixtures::to_value(&fixtures::kata_pod(
            "kata-demo",
            KataTee::Tdx,
        ))),
        Want::Mutate(Expected::Untouched),
    ));

    // --- validating ---
    let v = |w: Validated| Want::Validate(w);
    let tdx_uid = api
        .get("virtualmachineinstances", Some("default"), "tdx-vm")
        .and_then(|o| o["metadata"]["uid"].as_str().map(str::to_string))
        .expect("tdx-vm uid");
    let sev_uid = api
        .get("virtualmachineinstances", Some("default"), "sev-vm")
        .and_then(|o| o["metadata"]["uid"].as_str().map(str::to_string))
        .expect("sev-vm uid");
    let mutated_tdx = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
        .patched("tdx.intel.com/keys", "tdx 1")
        .generated_name();
    // A TDX pod: some TDX node has free keys.
    cases.push(case(
        "validate tdx pod",
        "/validate",
        AdmissionReviewBuilder::create(owned_by(&mutated_tdx.to_value(), &tdx_uid)),
        v(Validated::Allowed),
    ));
    // A SEV pod: no node offers SEV.
    let mutated_sev = VirtLauncherPod::for_tee("sev-vm", Tee::Sev)
        .patched("sev.amd.com/asids", "sev 1")
        .generated_name();
    cases.push(case(
        "validate sev pod (no SEV node)",
        "/validate",
        AdmissionReviewBuilder::create(owned_by(&mutated_sev.to_value(), &sev_uid)),
        v(Validated::Denied),
    ));
    // A forged cgroup limit: teeguard writes "tdx 1", nothing else is accepted.
    let forged = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
        .patched("tdx.intel.com/keys", "tdx 64")
        .generated_name();
    cases.push(case(
        "validate forged annotation",
        "/validate",
        AdmissionReviewBuilder::create(owned_by(&forged.to_value(), &tdx_uid)),
        v(Validated::Denied),
    ));
    // The scheduler binding the TDX pod to a node with keys (the pod exists in the API server).
    let stored = api
        .create(&owned_by(&mutated_tdx.to_value(), &tdx_uid))
        .expect("pod");
    let stored: k8s_openapi::api::core::v1::Pod = serde_json::from_value(stored).expect("pod");
    cases.push(case(
        "validate binding",
        "/validate",
        AdmissionReviewBuilder::binding(&stored, "node02"),
        v(Validated::Allowed),
    ));
    // Non-TEE pods, exempt namespaces and deletes pass.
    cases.push(case(
        "validate kata pod",
        "/validate",
        AdmissionReviewBuilder::create(fixtures::to_value(&fixtures::kata_pod(
            "kata-demo",
            KataTee::Tdx,
        ))),
        v(Validated::Allowed),
    ));
    cases.push(case(
        "validate pod delete",
        "/validate",
        AdmissionReviewBuilder::delete(fixtures::to_value(&stored)),
        v(Validated::Allowed),
    ));
    let sev_exempt_ns = VirtLauncherPod::for_tee("sev-vm", Tee::Sev)
        .namespace("exempt-ns")
        .request("sev.amd.com/asids", "1")
        .generated_name();
    cases.push(case(
        "validate exempt namespace",
        "/validate",
        AdmissionReviewBuilder::create(sev_exempt_ns.to_value()),
        v(Validated::Allowed),
    ));
    cases
}

fn check_validate(
    review: &Value,
    status: StatusCode,
    body: &[u8],
    want: Validated,
) -> Result<(), String> {
    let resp = answer_to(review, status, body)?;
    let r = &resp["response"];
    if r.get("patch").is_some() || r.get("patchType").is_some() {
        return Err(format!("a validating answer carries a patch: {resp}"));
    }
    match want {
        Validated::Allowed if r["allowed"] == true => Ok(()),
        Validated::Denied if r["allowed"] == false && r["status"]["code"] == 403 => Ok(()),
        _ => Err(format!("expected {want:?}: {resp}")),
    }
}

/// Checks answers; a patch fully checked against the scenario once is then compared byte for byte.
#[derive(Default)]
struct Checker {
    verified_patches: Mutex<HashMap<String, Vec<u8>>>,
}

impl Checker {
    fn check(&self, c: &Case, uid: &str, status: StatusCode, body: &[u8]) -> Result<(), String> {
        // Only the full patch check needs the request's object; everything else only its uid.
        let review = &json!({"request": {"uid": uid}});
        match &c.want {
            Want::Validate(w) => check_validate(review, status, body, *w),
            Want::Mutate(expected) => {
                let patch = serde_json::from_slice::<Value>(body)
                    .ok()
                    .and_then(|v| v["response"]["patch"].as_str().map(str::to_string))
                    .and_then(|b| BASE64_STANDARD.decode(b).ok());
                let known = patch.as_ref().and_then(|p| {
                    self.verified_patches
                        .lock()
                        .expect("lock")
                        .get(&c.name)
                        .map(|v| v == p)
                });
                if known == Some(true) && status == StatusCode::OK {
                    // Same patch as the verified one; still check the envelope.
                    let v: Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
                    if v["response"]["uid"] != review["request"]["uid"]
                        || v["response"]["allowed"] != true
                    {
                        return Err(format!("wrong envelope: {v}"));
                    }
                    return Ok(());
                }
                if matches!(expected, Expected::Key { .. }) {
                    let mut full = c.review.clone();
                    full["request"]["uid"] = json!(uid);
                    check_mutate(&full, status, body, expected)?;
                } else {
                    check_mutate(review, status, body, expected)?;
                }
                if let Some(p) = patch {
                    self.verified_patches
                        .lock()
                        .expect("lock")
                        .insert(c.name.clone(), p);
                }
                Ok(())
            }
        }
    }
}

fn with_uid(body: &[u8], uid: &str) -> Bytes {
    assert_eq!(uid.len(), UID_PLACEHOLDER.len());
    let at = body
        .windows(UID_PLACEHOLDER.len())
        .position(|w| w == UID_PLACEHOLDER.as_bytes())
        .expect("placeholder");
    let mut out = body.to_vec();
    out[at..at + uid.len()].copy_from_slice(uid.as_bytes());
    Bytes::from(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_reviews_through_rotations_and_watch_drops() {
    let api = FakeApiServer::new();
    let cases = Arc::new(scenario(&api));
    api.set_recording(false);
    let vmis = api.count("virtualmachineinstances");
    let mut wh = Webhook::start(
        api.clone(),
        &["--cert-check-interval", "200ms", "--drain-timeout", "2s"],
    )
    .await;
    wh.wait_vmis(vmis).await;
    let cfg = wh.client_config();
    let addr = wh.https;
    let checker = Arc::new(Checker::default());
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let started = Instant::now();

    let mut workers = tokio::task::JoinSet::new();
    for w in 0..CONNECTIONS {
        let (cases, checker, failures, cfg) = (
            cases.clone(),
            checker.clone(),
            failures.clone(),
            cfg.clone(),
        );
        workers.spawn(async move {
            let mut conn: Option<H1> = None;
            let mut done = 0usize;
            for (sent, i) in (w..REVIEWS).step_by(CONNECTIONS).enumerate() {
                if sent.is_multiple_of(REQUESTS_PER_CONNECTION)
                    || conn.as_ref().is_none_or(H1::is_closed)
                {
                    conn = match H1::try_connect(addr, cfg.clone()).await {
                        Ok(c) => Some(c),
                        Err(e) => {
                            failures
                                .lock()
                                .expect("lock")
                                .push(format!("review {i}: connect: {e}"));
                            None
                        }
                    };
                }
                let Some(c) = conn.as_mut() else { continue };
                let case = &cases[i % cases.len()];
                let uid = format!("uid-load-{i:017}");
                let body = with_uid(&case.body, &uid);
                let result = match c.post(case.path, body).await {
                    Ok((status, resp)) => checker.check(case, &uid, status, &resp),
                    Err(e) => {
                        conn = None;
                        Err(e)
                    }
                };
                match result {
                    Ok(()) => done += 1,
                    Err(e) => failures
                        .lock()
                        .expect("lock")
                        .push(format!("review {i} ({}): {e}", case.name)),
                }
            }
            done
        });
    }

    // Faults while the load runs: rotate the certificate every 250 ms, drop every watch every
    // 100 ms, and expire them (410, forcing a re-list) every 700 ms.
    let mut rotations = 0;
    let mut drops = 0;
    let mut tick = 0u32;
    let mut answered = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !workers.is_empty() {
        tokio::select! {
            done = workers.join_next() => {
                if let Some(done) = done {
                    answered += done.expect("worker");
                }
            }
            _ = tokio::time::sleep(Duration::from_millis(50)) => {
                assert!(Instant::now() < deadline, "the load did not finish within 60 s");
                tick += 1;
                if tick.is_multiple_of(2) {
                    api.drop_watches();
                    drops += 1;
                }
                if tick.is_multiple_of(14) {
                    api.expire_watches();
                }
                if tick.is_multiple_of(5) {
                    wh.rotate_certificate();
                    rotations += 1;
                }
            }
        }
    }
    let elapsed = started.elapsed();
    let failures = failures.lock().expect("lock").clone();
    assert!(
        failures.is_empty(),
        "{} of {REVIEWS} reviews failed or were wrong; first ones: {:#?}",
        failures.len(),
        &failures[..failures.len().min(20)]
    );
    assert_eq!(answered, REVIEWS);
    assert!(
        rotations >= 3,
        "only {rotations} certificate rotations happened during the load"
    );
    assert!(
        drops >= 5,
        "only {drops} watch drops happened during the load"
    );
    // The webhook really reloaded the rotated certificates.
    let (_, metrics) = wh.admin_get("/metrics").await;
    let reloads: u64 = metrics
        .lines()
        .find(|l| l.starts_with("teeguard_webhook_cert_reloads_total{result=\"ok\"}"))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0);
    assert!(
        reloads >= 2,
        "only {reloads} certificate reloads:\n{metrics}"
    );
    println!(
        "{REVIEWS} reviews in {elapsed:?} over {CONNECTIONS} connections; {rotations} rotations ({reloads} reloads), {drops} watch drops"
    );
    bounded("stop", wh.stop()).await;
}
