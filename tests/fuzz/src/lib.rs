//! Fuzz bodies shared by the cargo-fuzz targets (`tests/fuzz/fuzz_targets/*.rs`, nightly) and the
//! bounded stable fuzz test (`tests/tests/robust_fuzz.rs`, which includes this file as a module).
//!
//! Each body runs one input through the code the server runs and checks the properties that must
//! hold for ANY input; a violated property panics with a message naming it.
//! - [`mutate`]: `review_mutation` (the `/mutate` handler body) answers either an AdmissionReview
//!   response echoing the request uid, whose patch (if any) is base64 JSON Patch that applies cleanly
//!   to the request's object and leaves a valid Pod, or a client (4xx) error.
//! - [`validate`]: `review_validation` (the `/validate` handler body, with its index of holds) answers either an
//!   AdmissionReview response echoing the uid, never carrying a patch, or a client (4xx) error.
//! - [`misc`]: the misc cgroup file parsers return a value or a typed `MiscParse` error, and what
//!   they accept re-parses identically when rendered back.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::OnceLock;

use base64::prelude::{BASE64_STANDARD, Engine as _};
use serde_json::{Value, json};
use teeguard_shared::{Config, VirtualMachineInstance};
use teeguard_webhook::review::FileLookups;

/// What a body observed (for statistics in the bounded test).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Seen {
    /// A review answered with `allowed: true` and a patch.
    Patched,
    /// A review answered with `allowed: true`, no patch.
    Allowed,
    /// A review answered with `allowed: false`.
    Denied,
    /// A clean client error (HTTP 4xx).
    Rejected,
    /// Parsed successfully (misc parsers).
    Parsed,
}

/// The VMIs and namespaces the sample reviews refer to (`<slug>-vm` in `default`), plus a namespace
/// labelled exempt.
pub fn lookups() -> &'static FileLookups {
    static L: OnceLock<FileLookups> = OnceLock::new();
    L.get_or_init(|| {
        let mut l = FileLookups::default();
        let kinds: [(&str, Value); 6] = [
            ("tdx-vm", json!({"tdx": {}})),
            ("sev-vm", json!({"sev": {}})),
            (
                "sev-es-vm",
                json!({"sev": {"policy": {"encryptedState": true}}}),
            ),
            ("snp-vm", json!({"snp": {}})),
            ("secure-execution-vm", json!({})),
            ("invalid-tdx-and-snp-vm", json!({"tdx": {}, "snp": {}})),
        ];
        for (name, ls) in kinds {
            l.add_vmi(vmi(name, Some(ls)));
        }
        l.add_vmi(vmi("plain-vm", None));
        // A TDX node with free keys (its report is fresh for the whole session) and a stale one.
        for (node, age_secs) in [("node01", 0), ("node02", 3_600)] {
            l.add_node(
                node.into(),
                BTreeMap::from([
                    ("kubevirt.io/tdx".to_string(), "true".to_string()),
                    ("kubernetes.io/hostname".to_string(), node.to_string()),
                ]),
            );
            l.add_tee_capacity(report(node, age_secs));
        }
        l.add_namespace("default".into(), BTreeMap::new());
        l.add_namespace(
            "exempt".into(),
            BTreeMap::from([("teeguard.dev/exempt".to_string(), "true".to_string())]),
        );
        l
    })
}

fn vmi(name: &str, launch_security: Option<Value>) -> VirtualMachineInstance {
    let mut v = json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"domain": {}}
    });
    if let Some(ls) = launch_security {
        v["spec"]["domain"]["launchSecurity"] = ls;
    }
    match serde_json::from_value(v) {
        Ok(vmi) => vmi,
        Err(e) => panic!("fuzz VMI {name} does not deserialise: {e}"),
    }
}

fn report(node: &str, age_secs: i64) -> teeguard_shared::TeeCapacity {
    let heartbeat = jiff::Timestamp::now()
        .checked_sub(jiff::SignedDuration::from_secs(age_secs))
        .unwrap_or_else(|_| jiff::Timestamp::now());
    let v = json!({
        "apiVersion": "teeguard.dev/v1alpha1",
        "kind": "TeeCapacity",
        "metadata": {"name": node, "resourceVersion": "7"},
        "spec": {"nodeName": node},
        "status": {
            "tdx": {"resourceName": "tdx.intel.com/keys", "capacity": 64, "kernelUsed": 8,
                    "podsUsed": 6, "external": 2, "pending": 0, "free": 56},
            "heartbeatTime": heartbeat.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
        }
    });
    match serde_json::from_value(v) {
        Ok(c) => c,
        Err(e) => panic!("fuzz TeeCapacity {node} does not deserialise: {e}"),
    }
}

fn hints() -> &'static teeguard_webhook::cluster::admission::FitHints {
    static H: OnceLock<teeguard_webhook::cluster::admission::FitHints> = OnceLock::new();
    H.get_or_init(Default::default)
}

fn config() -> &'static Config {
    static C: OnceLock<Config> = OnceLock::new();
    C.get_or_init(Config::default)
}

/// Poll a future that never waits (file-backed lookups answer at once) to completion.
fn run_now<F: Future>(fut: F) -> F::Output {
    futures::executor::block_on(fut)
}

/// `/mutate` on arbitrary bytes; panics if a property is violated.
pub fn mutate(data: &[u8]) -> Seen {
    let result = run_now(teeguard_webhook::web::handlers::mutate::review_mutation(
        data,
        lookups(),
        config(),
        None,
    ));
    match result {
        Err(e) => {
            let status = e.status();
            assert!(
                status.is_client_error(),
                "review_mutation answered {status} (not 4xx) for a bad request: {e}"
            );
            Seen::Rejected
        }
        Ok(reviewed) => check_response(data, &reviewed.response.to_json()),
    }
}

/// `/validate` on arbitrary bytes; panics if a property is violated.
pub fn validate(data: &[u8]) -> Seen {
    let ctx = teeguard_webhook::web::handlers::validate::ValidationContext {
        config: config(),
        events: None,
        metrics: None,
        hints: hints(),
        replica: "fuzz",
        decider: None,
    };
    let result = run_now(
        teeguard_webhook::web::handlers::validate::review_validation(data, lookups(), &ctx),
    );
    match result {
        Err(e) => {
            let status = e.status();
            assert!(
                status.is_client_error(),
                "review_validation answered {status} (not 4xx) for a bad request: {e}"
            );
            Seen::Rejected
        }
        Ok(reviewed) => {
            let seen = check_response(data, &reviewed.response.to_json());
            assert_ne!(seen, Seen::Patched, "the validating webhook sent a patch");
            seen
        }
    }
}

/// Check an AdmissionReview response body against the request it answers.
pub fn check_response(request: &[u8], response: &[u8]) -> Seen {
    let resp: Value = match serde_json::from_slice(response) {
        Ok(v) => v,
        Err(e) => panic!(
            "the response is not JSON ({e}): {}",
            String::from_utf8_lossy(response)
        ),
    };
    assert_eq!(resp["apiVersion"], "admission.k8s.io/v1", "{resp}");
    assert_eq!(resp["kind"], "AdmissionReview", "{resp}");
    // The request was accepted, so it is JSON with a request.uid: the response must echo it. Read it
    // like the webhook does (the object kept raw): serde_json's recursion limit would refuse deeply
    // nested fields the webhook legitimately skips.
    #[derive(serde::Deserialize)]
    struct Req<'a> {
        #[serde(borrow)]
        request: ReqInner<'a>,
    }
    #[derive(serde::Deserialize)]
    struct ReqInner<'a> {
        uid: String,
        #[serde(borrow, default)]
        object: Option<&'a serde_json::value::RawValue>,
    }
    // The webhook reads only the fields it decides on and skips the rest without validating it
    // (serde skips strings without checking their \u escapes, for example). When the strict reading
    // above fails on such a skipped part, read the uid the same lenient way; the object is then not
    // one the API server could have sent, so only the response's shape is checked.
    #[derive(serde::Deserialize)]
    struct Lenient {
        request: LenientInner,
    }
    #[derive(serde::Deserialize)]
    struct LenientInner {
        uid: String,
    }
    let (req, strict) = match serde_json::from_slice::<Req<'_>>(request) {
        Ok(v) => (v, true),
        Err(strict) => match serde_json::from_slice::<Lenient>(request) {
            Ok(l) => (
                Req {
                    request: ReqInner {
                        uid: l.request.uid,
                        object: None,
                    },
                },
                false,
            ),
            Err(e) => panic!(
                "a request the handler accepted has no request.uid string: {e} (strictly: {strict})"
            ),
        },
    };
    let uid = req.request.uid.as_str();
    assert!(!uid.is_empty(), "accepted a request without uid");
    assert_eq!(
        resp["response"]["uid"], uid,
        "response uid differs from the request's"
    );
    let allowed = match resp["response"]["allowed"].as_bool() {
        Some(a) => a,
        None => panic!("response.allowed is not a bool: {resp}"),
    };
    let patch = resp["response"].get("patch");
    let patch_type = resp["response"].get("patchType");
    assert_eq!(
        patch.is_some(),
        patch_type.is_some(),
        "patch and patchType must come together: {resp}"
    );
    if !allowed {
        assert!(patch.is_none(), "a denial carries a patch: {resp}");
        let code = resp["response"]["status"]["code"].as_u64().unwrap_or(0);
        assert!(
            (400..600).contains(&code),
            "denial without an error code: {resp}"
        );
        let message = resp["response"]["status"]["message"].as_str().unwrap_or("");
        assert!(!message.is_empty(), "denial without a message: {resp}");
        return Seen::Denied;
    }
    let Some(patch) = patch else {
        return Seen::Allowed;
    };
    assert_eq!(patch_type, Some(&json!("JSONPatch")), "{resp}");
    let bytes = match BASE64_STANDARD.decode(patch.as_str().unwrap_or("!")) {
        Ok(b) => b,
        Err(e) => panic!("patch is not base64 ({e}): {resp}"),
    };
    let ops: json_patch::Patch = match serde_json::from_slice(&bytes) {
        Ok(p) => p,
        Err(e) => panic!(
            "patch is not an RFC 6902 JSON Patch ({e}): {}",
            String::from_utf8_lossy(&bytes)
        ),
    };
    assert!(!ops.0.is_empty(), "an empty patch was sent");
    if !strict {
        return Seen::Patched;
    }
    let mut object: Value = match req.request.object.map(|o| serde_json::from_str(o.get())) {
        Some(Ok(v)) => v,
        // The object does not load as a JSON value although the webhook accepted the request: nesting
        // deeper than serde_json's Value limit (128), numbers out of range or bad \u escapes, all in
        // fields the webhook skips without interpreting them. The API server never sends such an
        // object; this checker cannot load it, so only the patch's shape was checked.
        Some(Err(_)) => return Seen::Patched,
        None => panic!("a patch was sent for a request without an object"),
    };
    // A patch for an object that was not a valid Pod to begin with (a field the webhook skips has the
    // wrong type) only has to apply; the API server validates objects before admission.
    let was_pod = serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(object.clone()).is_ok();
    if let Err(e) = json_patch::patch(&mut object, &ops.0) {
        panic!(
            "the patch does not apply to the request's object ({e}); patch {}",
            String::from_utf8_lossy(&bytes)
        );
    }
    if was_pod && let Err(e) = serde_json::from_value::<k8s_openapi::api::core::v1::Pod>(object) {
        panic!("the patched object is not a valid Pod: {e}");
    }
    Seen::Patched
}

/// The misc-file parsers on arbitrary bytes; panics if a property is violated.
pub fn misc(data: &[u8]) -> Seen {
    use teeguard_shared::misc::{MiscLimit, parse_events, parse_max, parse_values};
    let Ok(text) = std::str::from_utf8(data) else {
        return Seen::Rejected;
    };
    let values = round_trips("parse_values", parse_values, text, |values| {
        values
            .entries()
            .map(|(n, v)| format!("{n} {v}\n"))
            .collect()
    });
    let limits = round_trips("parse_max", parse_max, text, |limits| {
        limits
            .iter()
            .map(|(n, l)| match l {
                MiscLimit::Max => format!("{n} max\n"),
                MiscLimit::Value(v) => format!("{n} {v}\n"),
            })
            .collect()
    });
    let events = round_trips("parse_events", parse_events, text, |events| {
        events
            .iter()
            .map(|(n, c)| format!("{n}.max {c}\n"))
            .collect()
    });
    if let Some(events) = &events {
        assert!(
            events.keys().all(|k| !k.is_empty()),
            "empty resource name accepted"
        );
    }
    if values.is_some() || limits.is_some() || events.is_some() {
        Seen::Parsed
    } else {
        Seen::Rejected
    }
}

/// One misc-file parser (`what`) on `text`: an error must be typed and name the file, briefly; a value
/// must come back the same from its own rendering. The value, when `text` parsed.
fn round_trips<T: PartialEq + std::fmt::Debug>(
    what: &str,
    parse: fn(&Path, &str) -> teeguard_shared::Result<T>,
    text: &str,
    render: impl Fn(&T) -> String,
) -> Option<T> {
    let path = Path::new("/sys/fs/cgroup/fuzz/misc.file");
    match parse(path, text) {
        Ok(value) => {
            match parse(path, &render(&value)) {
                Ok(again) => assert_eq!(again, value, "{what} does not round-trip"),
                Err(e) => panic!("{what} rejects its own rendering: {e}"),
            }
            Some(value)
        }
        Err(e) => {
            assert!(
                matches!(e, teeguard_shared::Error::MiscParse { .. }),
                "{what} returned an untyped error: {e}"
            );
            let msg = e.to_string();
            assert!(
                msg.starts_with("/sys/fs/cgroup/fuzz/misc.file:"),
                "error does not name the file: {msg}"
            );
            assert!(
                msg.len() < 1024,
                "error message is unbounded ({} bytes)",
                msg.len()
            );
            None
        }
    }
}
