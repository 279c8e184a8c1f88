//! The request log: every request the server received, with what tests need to assert on.

use serde_json::Value;

use super::faults::{RequestKey, Verb};

/// One request as the server received it.
#[derive(Clone, Debug, PartialEq)]
pub struct RecordedRequest {
    /// Arrival order, from 1.
    pub seq: u64,
    /// HTTP method (`GET`, `PATCH`, ...).
    pub method: String,
    /// URL path.
    pub path: String,
    /// Decoded query parameters, in order.
    pub query: Vec<(String, String)>,
    /// API verb.
    pub verb: Verb,
    /// API group (`""` for core).
    pub group: String,
    /// API version.
    pub version: String,
    /// Resource plural, if the path names one.
    pub resource: Option<String>,
    /// Subresource (`status`, `binding`).
    pub subresource: Option<String>,
    /// Namespace from the path.
    pub namespace: Option<String>,
    /// Object name from the path.
    pub name: Option<String>,
    /// `Content-Type` header.
    pub content_type: Option<String>,
    /// `Accept` header.
    pub accept: Option<String>,
    /// `User-Agent` header.
    pub user_agent: Option<String>,
    /// `fieldManager` query parameter.
    pub field_manager: Option<String>,
    /// Body decoded as JSON (or YAML for apply patches), if any.
    pub body: Option<Value>,
    /// HTTP status of the answer, once answered (watches: 200 when the stream starts).
    pub response_code: Option<u16>,
    /// When the server received it.
    pub received_at: std::time::Instant,
}

impl RecordedRequest {
    /// A query parameter's value.
    pub fn query_param(&self, key: &str) -> Option<&str> {
        self.query
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    /// Whether this is `verb` on `resource` (plural).
    pub fn is(&self, verb: Verb, resource: &str) -> bool {
        self.verb == verb && self.resource.as_deref() == Some(resource)
    }

    /// The patch type from the `Content-Type` of a PATCH.
    pub fn patch_type(&self) -> Option<super::patch::PatchType> {
        if self.verb != Verb::Patch {
            return None;
        }
        self.content_type
            .as_deref()
            .and_then(super::patch::PatchType::from_content_type)
    }
}

/// A reusable filter over recorded requests; unset fields match anything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestFilter {
    /// Verb.
    pub verb: Option<Verb>,
    /// Resource plural.
    pub resource: Option<String>,
    /// Subresource (`""`: main resource only).
    pub subresource: Option<String>,
    /// Namespace.
    pub namespace: Option<String>,
    /// Name.
    pub name: Option<String>,
    /// Field manager.
    pub field_manager: Option<String>,
}

impl RequestFilter {
    /// Matches every request.
    pub fn new() -> Self {
        Self::default()
    }

    /// Only `verb`.
    pub fn verb(mut self, v: Verb) -> Self {
        self.verb = Some(v);
        self
    }

    /// Only `resource`.
    pub fn resource(mut self, r: &str) -> Self {
        self.resource = Some(r.to_string());
        self
    }

    /// Only `subresource` (`""`: main resource only).
    pub fn subresource(mut self, s: &str) -> Self {
        self.subresource = Some(s.to_string());
        self
    }

    /// Only `namespace`.
    pub fn namespace(mut self, ns: &str) -> Self {
        self.namespace = Some(ns.to_string());
        self
    }

    /// Only `name`.
    pub fn name(mut self, n: &str) -> Self {
        self.name = Some(n.to_string());
        self
    }

    /// Only requests by field manager `m`.
    pub fn field_manager(mut self, m: &str) -> Self {
        self.field_manager = Some(m.to_string());
        self
    }

    /// Whether `r` passes.
    pub fn matches(&self, r: &RecordedRequest) -> bool {
        self.matches_key(&RequestKey {
            verb: r.verb,
            resource: r.resource.as_deref(),
            namespace: r.namespace.as_deref(),
            name: r.name.as_deref(),
            subresource: r.subresource.as_deref(),
            field_manager: r.field_manager.as_deref(),
        })
    }

    /// Whether a request with these parts passes.
    pub(crate) fn matches_key(&self, r: &RequestKey<'_>) -> bool {
        let is = |want: &Option<String>, got: Option<&str>| {
            want.as_deref().is_none_or(|x| Some(x) == got)
        };
        self.verb.is_none_or(|v| v == r.verb)
            && is(&self.resource, r.resource)
            && is(&self.namespace, r.namespace)
            && is(&self.name, r.name)
            && is(&self.subresource, Some(r.subresource.unwrap_or("")))
            && is(&self.field_manager, r.field_manager)
    }
}

/// The log itself.
#[derive(Debug, Default)]
pub(crate) struct RequestLog {
    pub entries: Vec<RecordedRequest>,
    pub next_seq: u64,
}

impl RequestLog {
    pub fn push(&mut self, mut r: RecordedRequest) -> u64 {
        self.next_seq += 1;
        r.seq = self.next_seq;
        self.entries.push(r);
        self.next_seq
    }

    pub fn set_code(&mut self, seq: u64, code: u16) {
        if let Ok(i) = self.entries.binary_search_by_key(&seq, |r| r.seq) {
            self.entries[i].response_code = Some(code);
        }
    }
}
