//! The AdmissionReview envelope (`admission.k8s.io/v1`): parse a request once, build a response.
//!
//! The request is parsed in one pass over the body; the embedded object is kept as raw JSON
//! (borrowed from the body) and decoded into a typed object only by the handler that wants it.
//! The response is written by hand rather than with kube's `AdmissionResponse`, whose `patch`
//! serialises as an array of numbers (kube issue 1781): here it is base64, as documented.

use std::borrow::Cow;
use std::collections::BTreeMap;

use base64::prelude::{BASE64_STANDARD, Engine as _};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

use crate::error::{Error, Result};

/// Audit annotation keys of the webhooks' answers (the API server prefixes them with the webhook's
/// name).
pub mod audit {
    /// The decision: `patched`, `unchanged`, `skipped` or `denied` (mutating); `admitted`, `warned`,
    /// `denied` or `skipped` (validating).
    pub const DECISION: &str = "decision";
    /// Why (a reason, skip or deny code).
    pub const REASON: &str = "reason";
    /// The TEE kind (`tdx`, `sev`, `sev_es`).
    pub const TEE_KIND: &str = "tee-kind";
    /// The extended resource requested (mutating).
    pub const RESOURCE: &str = "resource";
    /// The TEE RuntimeClass of a pod decided by its RuntimeClass (mutating).
    pub const RUNTIME_CLASS: &str = "runtime-class";
    /// The node checked (validating: bindings and pods created with `spec.nodeName`).
    pub const NODE: &str = "node";
    /// The mode applied (validating: `enforce` or `warn`).
    pub const MODE: &str = "mode";
}

#[cfg(test)]
mod tests;

/// `apiVersion` of the reviews this webhook accepts and sends.
pub const API_VERSION: &str = "admission.k8s.io/v1";
/// `kind` of the reviews this webhook accepts and sends.
pub const KIND: &str = "AdmissionReview";

/// The operation of an admission request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum Operation {
    /// CREATE.
    Create,
    /// UPDATE.
    Update,
    /// DELETE.
    Delete,
    /// CONNECT.
    Connect,
}

/// `group`/`version`/`kind` of the object under review.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Gvk {
    /// API group; empty for the core group.
    #[serde(default)]
    pub group: String,
    /// API version.
    #[serde(default)]
    pub version: String,
    /// Kind.
    #[serde(default)]
    pub kind: String,
}

/// `group`/`version`/`resource` of the object under review.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
pub struct Gvr {
    /// API group; empty for the core group.
    #[serde(default)]
    pub group: String,
    /// API version.
    #[serde(default)]
    pub version: String,
    /// Resource (plural).
    #[serde(default)]
    pub resource: String,
}

/// The envelope, generic over how `object`/`oldObject` are read: kept raw (`&RawValue`, borrowed
/// from the body) or decoded in the same pass ([`ReviewRequest::parse_decoded`]).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawReview<O> {
    #[serde(default)]
    api_version: Option<String>,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default = "none")]
    request: Option<RawRequest<O>>,
}

fn none<T>() -> Option<T> {
    None
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct RawRequest<O> {
    #[serde(default)]
    uid: Option<String>,
    #[serde(default)]
    kind: Gvk,
    #[serde(default)]
    resource: Gvr,
    #[serde(default)]
    sub_resource: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    operation: Option<Operation>,
    #[serde(default)]
    dry_run: Option<bool>,
    #[serde(default = "none")]
    object: Option<O>,
    #[serde(default = "none")]
    old_object: Option<O>,
}

/// A review whose objects were decoded as `O` in the same pass as the envelope.
#[derive(Debug)]
pub struct Decoded<'a, O> {
    /// The envelope (its raw objects are empty: they were decoded into `object`/`old_object`).
    pub request: ReviewRequest<'a>,
    /// `request.object`, absent or `null` as `None`.
    pub object: Option<O>,
    /// `request.oldObject`, absent or `null` as `None`.
    pub old_object: Option<O>,
}

/// `body` as text: JSON is UTF-8 (RFC 8259 §8.1). Checked once for the whole body, so the parser
/// borrows every string it reads without checking each again (`serde_json::from_slice` validates
/// every string it reads, keys included: a sixth of the parse of a pod's review).
fn json_text(body: &[u8]) -> Result<&str> {
    std::str::from_utf8(body).map_err(|e| {
        Error::BadReview(format!(
            "invalid JSON: the body is not UTF-8 (byte {} is not valid): send the AdmissionReview as UTF-8 JSON",
            e.valid_up_to()
        ))
    })
}

/// One admission request, parsed from an AdmissionReview body. The object stays raw JSON borrowed
/// from the body until [`ReviewRequest::object`] decodes it.
#[derive(Debug)]
pub struct ReviewRequest<'a> {
    /// The request UID, echoed in the response.
    pub uid: String,
    /// Kind of the object.
    pub kind: Gvk,
    /// Resource of the object.
    pub resource: Gvr,
    /// Subresource (`binding`, `status`, ...), empty for the main resource.
    pub sub_resource: String,
    /// Object name; empty for a `generateName` CREATE.
    pub name: String,
    /// Namespace of the request; empty for cluster-scoped objects.
    pub namespace: String,
    /// The operation.
    pub operation: Operation,
    /// Dry run: the API server will not persist the object.
    pub dry_run: bool,
    raw_object: Option<&'a RawValue>,
    raw_old_object: Option<&'a RawValue>,
}

impl<'a> ReviewRequest<'a> {
    /// Parse an AdmissionReview body. Bad JSON, a wrong `apiVersion`/`kind`, a missing `request`,
    /// `uid` or `operation` are [`Error::BadReview`] (HTTP 400).
    pub fn parse(body: &'a [u8]) -> Result<Self> {
        let raw: RawReview<&'a RawValue> = serde_json::from_str(json_text(body)?)
            .map_err(|e| Error::BadReview(format!("invalid JSON: {e}")))?;
        let (mut request, object, old_object) = Self::check(raw)?;
        request.raw_object = object.filter(|o| o.get() != "null");
        request.raw_old_object = old_object.filter(|o| o.get() != "null");
        Ok(request)
    }

    /// Parse an AdmissionReview body and decode `request.object`/`request.oldObject` as `O` in the
    /// same pass (the body is scanned once instead of twice). Any failure, including an object that is
    /// not an `O`, is an error whose message is less precise than [`ReviewRequest::parse`] followed by
    /// [`ReviewRequest::object`]: callers that answer errors fall back to those for the message.
    pub fn parse_decoded<O: Deserialize<'a>>(body: &'a [u8]) -> Result<Decoded<'a, O>> {
        let raw: RawReview<O> = serde_json::from_str(json_text(body)?)
            .map_err(|e| Error::BadReview(format!("invalid JSON: {e}")))?;
        let (request, object, old_object) = Self::check(raw)?;
        Ok(Decoded {
            request,
            object,
            old_object,
        })
    }

    /// The envelope checks shared by both parses; the objects are handed back as read.
    #[allow(clippy::type_complexity)]
    fn check<O>(raw: RawReview<O>) -> Result<(Self, Option<O>, Option<O>)> {
        match raw.api_version.as_deref() {
            Some(API_VERSION) => {}
            Some(other) => {
                return Err(Error::BadReview(format!(
                    "apiVersion {other:?} is not supported: expected {API_VERSION:?} (set admissionReviewVersions: [v1])"
                )));
            }
            None => {
                return Err(Error::BadReview(format!(
                    "apiVersion is missing: expected {API_VERSION:?}"
                )));
            }
        }
        if raw.kind.as_deref() != Some(KIND) {
            return Err(Error::BadReview(format!(
                "kind is {:?}: expected {KIND:?}",
                raw.kind.unwrap_or_default()
            )));
        }
        let req = raw
            .request
            .ok_or_else(|| Error::BadReview("request is missing".into()))?;
        let uid = req
            .uid
            .filter(|u| !u.is_empty())
            .ok_or_else(|| Error::BadReview("request.uid is missing".into()))?;
        let operation = req
            .operation
            .ok_or_else(|| Error::BadReview("request.operation is missing".into()))?;
        Ok((
            ReviewRequest {
                uid,
                kind: req.kind,
                resource: req.resource,
                sub_resource: req.sub_resource.unwrap_or_default(),
                name: req.name.unwrap_or_default(),
                namespace: req.namespace.unwrap_or_default(),
                operation,
                dry_run: req.dry_run.unwrap_or(false),
                raw_object: None,
                raw_old_object: None,
            },
            req.object,
            req.old_object,
        ))
    }

    /// True when the request is for `<group>/<resource>` itself (no subresource).
    pub fn is_resource(&self, group: &str, resource: &str) -> bool {
        self.resource.group == group
            && self.resource.resource == resource
            && self.sub_resource.is_empty()
    }

    /// The raw JSON of `request.object`, if present.
    pub fn raw_object(&self) -> Option<&'a RawValue> {
        self.raw_object
    }

    /// Decode `request.object` as `T`; a missing or undecodable object is [`Error::BadReview`].
    pub fn object<T: DeserializeOwned>(&self) -> Result<T> {
        self.decode("object", self.raw_object)
    }

    /// Decode `request.oldObject` (UPDATE, DELETE) as `T`; missing or undecodable is
    /// [`Error::BadReview`].
    pub fn old_object<T: DeserializeOwned>(&self) -> Result<T> {
        self.decode("oldObject", self.raw_old_object)
    }

    fn decode<T: DeserializeOwned>(&self, field: &str, raw: Option<&RawValue>) -> Result<T> {
        let raw = raw.ok_or_else(|| Error::BadReview(format!("request.{field} is missing")))?;
        serde_json::from_str(raw.get()).map_err(|e| {
            Error::BadReview(format!(
                "request.{field} is not a valid {}: {e}",
                if self.kind.kind.is_empty() {
                    "object"
                } else {
                    &self.kind.kind
                }
            ))
        })
    }
}

/// `response.status` of a denial.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DenyStatus {
    /// HTTP-like code the API server returns to its client (403 for policy denials).
    pub code: u16,
    /// The message the client sees.
    pub message: String,
    /// Machine-readable reason (`Forbidden`).
    pub reason: &'static str,
}

/// An admission response, rendered by [`ReviewResponse::to_json`] as a full AdmissionReview.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReviewResponse {
    /// The request UID.
    pub uid: String,
    /// Whether the request is allowed.
    pub allowed: bool,
    /// Set on a denial.
    pub status: Option<DenyStatus>,
    /// The RFC 6902 JSON Patch as JSON bytes; sent base64-encoded with `patchType: JSONPatch`.
    pub patch: Option<Vec<u8>>,
    /// Audit annotations (the API server prefixes each key with the webhook's name). Keys are the
    /// handlers' constants; values are mostly constants too, so neither is allocated per review.
    pub audit_annotations: BTreeMap<&'static str, Cow<'static, str>>,
    /// Warnings shown to the client (kubectl prints them).
    pub warnings: Vec<String>,
    /// A whole AdmissionReview another replica answered (a forwarded review), sent as it is.
    pub forwarded: Option<axum::body::Bytes>,
}

impl ReviewResponse {
    /// Allow, unchanged.
    pub fn allow(uid: impl Into<String>) -> Self {
        ReviewResponse {
            uid: uid.into(),
            allowed: true,
            ..Default::default()
        }
    }

    /// Deny with `code` (403 for policy denials) and a message for the client.
    pub fn deny(uid: impl Into<String>, code: u16, message: impl Into<String>) -> Self {
        ReviewResponse {
            uid: uid.into(),
            allowed: false,
            status: Some(DenyStatus {
                code,
                message: message.into(),
                reason: match code {
                    400 | 422 => "Invalid",
                    500..=599 => "InternalError",
                    _ => "Forbidden",
                },
            }),
            ..Default::default()
        }
    }

    /// Attach a JSON Patch; an empty patch attaches nothing (never `patchType` without a patch).
    pub fn with_patch(mut self, patch: &json_patch::Patch) -> Result<Self> {
        if patch.0.is_empty() {
            self.patch = None;
            return Ok(self);
        }
        let bytes = serde_json::to_vec(patch).map_err(|e| Error::Serialize {
            what: "the JSON patch",
            reason: e.to_string(),
        })?;
        self.patch = Some(bytes);
        Ok(self)
    }

    /// Add an audit annotation.
    pub fn audit(mut self, key: &'static str, value: impl Into<Cow<'static, str>>) -> Self {
        self.audit_annotations.insert(key, value.into());
        self
    }

    /// Add a warning.
    pub fn warn(mut self, warning: impl Into<String>) -> Self {
        self.warnings.push(warning.into());
        self
    }

    /// The full `admission.k8s.io/v1` AdmissionReview JSON carrying this response.
    ///
    /// Written straight into one buffer sized up front: the fixed parts as literals, strings through
    /// serde_json's escaping, the patch base64-encoded in place (its alphabet needs no escaping).
    /// Field order: uid, allowed, status, patchType, patch, auditAnnotations, warnings.
    pub fn to_json(&self) -> Vec<u8> {
        if let Some(answer) = &self.forwarded {
            return answer.to_vec();
        }
        let patch = self.patch.as_deref().filter(|p| !p.is_empty());
        let strings = self.uid.len()
            + self.status.as_ref().map_or(0, |s| s.message.len())
            + self
                .audit_annotations
                .iter()
                .map(|(k, v)| k.len() + v.len() + 6)
                .sum::<usize>()
            + self.warnings.iter().map(|w| w.len() + 3).sum::<usize>();
        let patch_len = patch.map_or(0, |p| p.len().div_ceil(3) * 4);
        // Escapes can make strings longer: the estimate only saves reallocations.
        let mut out = Vec::with_capacity(192 + strings + strings / 8 + patch_len);
        out.extend_from_slice(b"{\"apiVersion\":\"");
        out.extend_from_slice(API_VERSION.as_bytes());
        out.extend_from_slice(b"\",\"kind\":\"");
        out.extend_from_slice(KIND.as_bytes());
        out.extend_from_slice(b"\",\"response\":{\"uid\":");
        json_str(&mut out, &self.uid);
        out.extend_from_slice(if self.allowed {
            b",\"allowed\":true"
        } else {
            b",\"allowed\":false"
        });
        if let Some(status) = &self.status {
            out.extend_from_slice(b",\"status\":{\"code\":");
            out.extend_from_slice(status.code.to_string().as_bytes());
            out.extend_from_slice(b",\"message\":");
            json_str(&mut out, &status.message);
            out.extend_from_slice(b",\"reason\":");
            json_str(&mut out, status.reason);
            out.push(b'}');
        }
        if let Some(patch) = patch {
            out.extend_from_slice(b",\"patchType\":\"JSONPatch\",\"patch\":\"");
            let at = out.len();
            out.resize(at + patch_len, 0);
            // The buffer was sized for exactly this encoding (padded base64 of `patch`).
            let written = BASE64_STANDARD
                .encode_slice(patch, &mut out[at..])
                .unwrap_or(0);
            out.truncate(at + written);
            out.push(b'"');
        }
        if !self.audit_annotations.is_empty() {
            out.extend_from_slice(b",\"auditAnnotations\":{");
            for (i, (k, v)) in self.audit_annotations.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                json_str(&mut out, k);
                out.push(b':');
                json_str(&mut out, v);
            }
            out.push(b'}');
        }
        if !self.warnings.is_empty() {
            out.extend_from_slice(b",\"warnings\":[");
            for (i, w) in self.warnings.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                json_str(&mut out, w);
            }
            out.push(b']');
        }
        out.extend_from_slice(b"}}");
        out
    }
}

/// Append `s` as a JSON string (quoted and escaped).
fn json_str(out: &mut Vec<u8>, s: &str) {
    // Writing a string into a Vec cannot fail; an error would leave the output unparseable, which
    // the response tests would catch.
    let _ = serde_json::to_writer(&mut *out, s);
}
