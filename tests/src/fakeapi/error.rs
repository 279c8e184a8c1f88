//! [`ApiStatus`]: a `metav1.Status` failure, what the HTTP side answers (the programmatic API returns
//! it as [`crate::Error::Refused`]).

use serde_json::{Value, json};

/// A failed API call as the real API server reports it: a `metav1.Status` with an HTTP code and reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiStatus {
    /// HTTP status code (404, 409, 410, 422, ...).
    pub code: u16,
    /// Machine-readable reason (`NotFound`, `AlreadyExists`, `Conflict`, `Expired`, `Invalid`, ...).
    pub reason: String,
    /// Human-readable message.
    pub message: String,
    /// `details`, when the failure concerns an object.
    pub details: Option<Box<StatusDetails>>,
}

/// `metav1.StatusDetails`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StatusDetails {
    /// The object concerned.
    pub name: String,
    /// Its API group.
    pub group: String,
    /// The resource (plural) concerned, as the real server reports it (`Invalid` reports the kind).
    pub kind: String,
    /// Field-level causes.
    pub causes: Vec<StatusCause>,
}

/// `metav1.StatusCause`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StatusCause {
    /// `FieldValueInvalid`, `FieldManagerConflict`, ...
    pub reason: String,
    /// Human-readable message.
    pub message: String,
    /// The field (`.status.tdx.free`, `metadata.name`).
    pub field: String,
}

/// The reason string the real API server uses for an HTTP status code.
pub fn reason_for_code(code: u16) -> &'static str {
    match code {
        400 => "BadRequest",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "NotFound",
        405 => "MethodNotAllowed",
        406 => "NotAcceptable",
        409 => "Conflict",
        410 => "Expired",
        413 => "RequestEntityTooLarge",
        415 => "UnsupportedMediaType",
        422 => "Invalid",
        429 => "TooManyRequests",
        500 => "InternalError",
        503 => "ServiceUnavailable",
        504 => "Timeout",
        _ => "Unknown",
    }
}

impl ApiStatus {
    /// A failure with the standard reason for `code`.
    pub fn new(code: u16, message: impl Into<String>) -> Self {
        Self::with_reason(code, reason_for_code(code), message)
    }

    /// A failure with an explicit reason (e.g. 409 `AlreadyExists`).
    pub fn with_reason(code: u16, reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            code,
            reason: reason.into(),
            message: message.into(),
            details: None,
        }
    }

    /// Sets `details` (name, group, resource plural).
    pub fn details(mut self, name: &str, group: &str, resource: &str) -> Self {
        let d = self.details.get_or_insert_with(Default::default);
        d.name = name.to_string();
        d.group = group.to_string();
        d.kind = resource.to_string();
        self
    }

    /// Adds a `details.causes` entry.
    pub fn cause(mut self, reason: &str, message: &str, field: &str) -> Self {
        self.details
            .get_or_insert_with(Default::default)
            .causes
            .push(StatusCause {
                reason: reason.to_string(),
                message: message.to_string(),
                field: field.to_string(),
            });
        self
    }

    /// The causes in `details` (empty if none).
    pub fn causes(&self) -> &[StatusCause] {
        self.details
            .as_ref()
            .map(|d| d.causes.as_slice())
            .unwrap_or_default()
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, message)
    }

    pub(crate) fn not_found(group: &str, resource: &str, name: &str) -> Self {
        Self::new(
            404,
            format!("{} \"{name}\" not found", qualified(group, resource)),
        )
        .details(name, group, resource)
    }

    pub(crate) fn already_exists(group: &str, resource: &str, name: &str) -> Self {
        Self::with_reason(
            409,
            "AlreadyExists",
            format!("{} \"{name}\" already exists", qualified(group, resource)),
        )
        .details(name, group, resource)
    }

    pub(crate) fn conflict(group: &str, resource: &str, name: &str, why: &str) -> Self {
        Self::with_reason(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} \"{name}\": {why}",
                qualified(group, resource)
            ),
        )
        .details(name, group, resource)
    }

    /// 409: the write named a `resourceVersion` that is no longer the stored one.
    pub(crate) fn modified(group: &str, resource: &str, name: &str) -> Self {
        Self::conflict(
            group,
            resource,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    pub(crate) fn invalid(group: &str, kind: &str, name: &str, field: &str, why: &str) -> Self {
        let what = if group.is_empty() {
            kind.to_string()
        } else {
            format!("{kind}.{group}")
        };
        Self::with_reason(
            422,
            "Invalid",
            format!("{what} \"{name}\" is invalid: {field}: {why}"),
        )
        .details(name, group, kind)
        .cause("FieldValueInvalid", why, field)
    }

    pub(crate) fn gone(message: impl Into<String>) -> Self {
        Self::with_reason(410, "Expired", message)
    }

    /// The `metav1.Status` JSON body.
    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let Some(d) = &self.details {
            let mut details = serde_json::Map::new();
            details.insert("name".into(), json!(d.name));
            if !d.group.is_empty() {
                details.insert("group".into(), json!(d.group));
            }
            details.insert("kind".into(), json!(d.kind));
            if !d.causes.is_empty() {
                let causes: Vec<Value> = d
                    .causes
                    .iter()
                    .map(|c| json!({"reason": c.reason, "message": c.message, "field": c.field}))
                    .collect();
                details.insert("causes".into(), Value::Array(causes));
            }
            v["details"] = Value::Object(details);
        }
        v
    }
}

impl std::fmt::Display for ApiStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}, HTTP {})", self.message, self.reason, self.code)
    }
}

/// `pods` or `teecapacities.teeguard.dev`, as the real server names resources in messages.
pub(crate) fn qualified(group: &str, resource: &str) -> String {
    if group.is_empty() {
        resource.to_string()
    } else {
        format!("{resource}.{group}")
    }
}
