//! Tests of the AdmissionReview envelope.

use super::*;
use serde_json::json;

fn review(request: serde_json::Value) -> Vec<u8> {
    serde_json::to_vec(&json!({"apiVersion": API_VERSION, "kind": KIND, "request": request}))
        .expect("json")
}

#[test]
fn parses_a_pod_create() {
    let body = review(json!({
        "uid": "u1",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "namespace": "ns",
        "operation": "CREATE",
        "userInfo": {"username": "system:serviceaccount:kubevirt:kubevirt-controller"},
        "object": {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "virt-launcher-vm-"}},
        "oldObject": null,
        "dryRun": false
    }));
    let req = ReviewRequest::parse(&body).expect("parse");
    assert_eq!(req.uid, "u1");
    assert_eq!(req.operation, Operation::Create);
    assert!(req.is_resource("", "pods"));
    assert!(!req.is_resource("", "pods/binding"));
    assert_eq!(req.namespace, "ns");
    assert_eq!(req.name, "");
    let pod: k8s_openapi::api::core::v1::Pod = req.object().expect("pod");
    assert_eq!(
        pod.metadata.generate_name.as_deref(),
        Some("virt-launcher-vm-")
    );
}

#[test]
fn malformed_reviews_are_bad_requests() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"{not json".to_vec(), "invalid JSON"),
            (b"".to_vec(), "invalid JSON"),
            (b"[]".to_vec(), "apiVersion is missing"),
            (b"null".to_vec(), "invalid JSON"),
            (
                serde_json::to_vec(&json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": KIND, "request": {"uid": "u", "operation": "CREATE"}})).expect("json"),
                "v1beta1",
            ),
            (
                serde_json::to_vec(&json!({"kind": KIND, "request": {"uid": "u", "operation": "CREATE"}})).expect("json"),
                "apiVersion is missing",
            ),
            (
                serde_json::to_vec(&json!({"apiVersion": API_VERSION, "kind": "Pod", "request": {"uid": "u", "operation": "CREATE"}})).expect("json"),
                "kind is \"Pod\"",
            ),
            (
                serde_json::to_vec(&json!({"apiVersion": API_VERSION, "kind": KIND})).expect("json"),
                "request is missing",
            ),
            (review(json!({"operation": "CREATE"})), "uid is missing"),
            (review(json!({"uid": "", "operation": "CREATE"})), "uid is missing"),
            (review(json!({"uid": "u"})), "operation is missing"),
            (review(json!({"uid": "u", "operation": "PATCH"})), "invalid JSON"),
            // Not UTF-8, even inside a string no decision reads: JSON is UTF-8.
            (
                [&b"{\"apiVersion\": \"admission.k8s.io/v1\", \"x\": \"\xff\"}"[..]].concat(),
                "not UTF-8 (byte 44 is not valid)",
            ),
        ];
    for (body, want) in cases {
        let err = ReviewRequest::parse(&body).expect_err(want);
        assert!(matches!(err, Error::BadReview(_)), "{err}");
        assert!(err.to_string().contains(want), "{want:?} not in {err}");
        let err = ReviewRequest::parse_decoded::<serde::de::IgnoredAny>(&body).expect_err(want);
        assert!(err.to_string().contains(want), "{want:?} not in {err}");
    }
}

#[test]
fn object_errors_name_the_kind() {
    let body = review(json!({
        "uid": "u", "operation": "CREATE",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "object": {"apiVersion": "v1", "kind": "Pod", "spec": {"containers": "nope"}}
    }));
    let req = ReviewRequest::parse(&body).expect("parse");
    let err = req
        .object::<k8s_openapi::api::core::v1::Pod>()
        .expect_err("bad pod");
    assert!(err.to_string().contains("not a valid Pod"), "{err}");
    let body = review(json!({"uid": "u", "operation": "DELETE", "object": null}));
    let req = ReviewRequest::parse(&body).expect("parse");
    assert!(req.raw_object().is_none());
    let err = req
        .old_object::<k8s_openapi::api::core::v1::Pod>()
        .expect_err("no old object");
    assert!(
        err.to_string().contains("request.oldObject is missing"),
        "{err}"
    );
    let body = review(json!({"uid": "u", "operation": "UPDATE",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "object": {"metadata": {"name": "new"}}, "oldObject": {"metadata": {"name": "old"}}}));
    let req = ReviewRequest::parse(&body).expect("parse");
    let old: k8s_openapi::api::core::v1::Pod = req.old_object().expect("old");
    assert_eq!(old.metadata.name.as_deref(), Some("old"));
}

#[test]
fn response_patch_is_base64_with_type() {
    let patch: json_patch::Patch =
        serde_json::from_value(json!([{"op": "add", "path": "/a", "value": 1}])).expect("patch");
    let resp = ReviewResponse::allow("u1")
        .with_patch(&patch)
        .expect("patch")
        .audit("decision", "patched");
    let v: serde_json::Value = serde_json::from_slice(&resp.to_json()).expect("json");
    assert_eq!(v["apiVersion"], API_VERSION);
    assert_eq!(v["kind"], KIND);
    assert_eq!(v["response"]["uid"], "u1");
    assert_eq!(v["response"]["allowed"], true);
    assert_eq!(v["response"]["patchType"], "JSONPatch");
    let decoded = BASE64_STANDARD
        .decode(v["response"]["patch"].as_str().expect("string"))
        .expect("base64");
    let back: serde_json::Value = serde_json::from_slice(&decoded).expect("patch json");
    assert_eq!(back, json!([{"op": "add", "path": "/a", "value": 1}]));
    assert_eq!(v["response"]["auditAnnotations"]["decision"], "patched");
}

#[test]
fn no_patch_type_without_patch() {
    let resp = ReviewResponse::allow("u")
        .with_patch(&json_patch::Patch(vec![]))
        .expect("empty patch");
    let v: serde_json::Value = serde_json::from_slice(&resp.to_json()).expect("json");
    let r = v["response"].as_object().expect("object");
    assert!(
        !r.contains_key("patch") && !r.contains_key("patchType"),
        "{v}"
    );
    assert!(!r.contains_key("status"));

    let deny = ReviewResponse::deny("u", 403, "no");
    let v: serde_json::Value = serde_json::from_slice(&deny.to_json()).expect("json");
    assert_eq!(v["response"]["allowed"], false);
    assert_eq!(v["response"]["status"]["code"], 403);
    assert_eq!(v["response"]["status"]["message"], "no");
    assert_eq!(v["response"]["status"]["reason"], "Forbidden");
}

/// The hand-written JSON equals the same response built as a `serde_json::Value`, for every
/// field and strings that need escaping, and for patches of every length modulo 3 (padding).
#[test]
fn to_json_matches_a_value_built_independently() {
    let nasty = "quote \" backslash \\ newline \n tab \t nul \u{0} bell \u{7} é 漢 🔑 </script>";
    for patch_len in 1..=7 {
        let patch_bytes: Vec<u8> = (0..patch_len).map(|i| b"[{}]x\"\\"[i % 7]).collect();
        for allowed in [true, false] {
            let mut resp = if allowed {
                ReviewResponse::allow(format!("uid-{nasty}"))
            } else {
                ReviewResponse::deny(format!("uid-{nasty}"), 422, format!("msg {nasty}"))
            };
            resp.patch = Some(patch_bytes.clone());
            const ODD_KEY: &str = "k\"ey\\/\u{1}";
            let resp = resp
                .audit("decision", nasty)
                .audit(ODD_KEY, "v")
                .warn(nasty)
                .warn("second");
            let mut expected = json!({
                "uid": format!("uid-{nasty}"),
                "allowed": allowed,
                "patchType": "JSONPatch",
                "patch": BASE64_STANDARD.encode(&patch_bytes),
                "auditAnnotations": {"decision": nasty, ODD_KEY: "v"},
                "warnings": [nasty, "second"],
            });
            if !allowed {
                expected["status"] =
                    json!({"code": 422, "message": format!("msg {nasty}"), "reason": "Invalid"});
            }
            let got: serde_json::Value =
                serde_json::from_slice(&resp.to_json()).expect("valid JSON");
            assert_eq!(
                got,
                json!({"apiVersion": API_VERSION, "kind": KIND, "response": expected}),
                "patch of {patch_len} bytes, allowed {allowed}"
            );
        }
    }
    // The bare minimum: no optional field at all.
    let got: serde_json::Value =
        serde_json::from_slice(&ReviewResponse::allow("u").to_json()).expect("valid JSON");
    assert_eq!(
        got,
        json!({"apiVersion": API_VERSION, "kind": KIND, "response": {"uid": "u", "allowed": true}})
    );
}
