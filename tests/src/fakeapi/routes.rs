//! HTTP: path parsing, verbs, request recording, faults, discovery, and the answers in the real server's
//! shapes (objects, `<Kind>List`, `PartialObjectMetadata(List)`, `metav1.Status`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::response::Response;
use http::{HeaderMap, Method, StatusCode, header};
use serde_json::{Value, json};

use super::Inner;
use super::error::ApiStatus;
use super::faults::{FaultAction, RequestKey, Verb};
use super::patch::PatchType;
use super::record::RecordedRequest;
use super::resources::Registered;
use super::select::{FieldSelector, LabelSelector, Selectors};
use super::store::{DeleteOpts, Deleted, Managed, State as StoreState, WriteOpts};
use super::watch::{self, WatchRequest, partial_metadata, shaped};

/// The router: one fallback handler that parses Kubernetes API paths itself.
pub(crate) fn router(inner: Arc<Inner>) -> Router {
    Router::new().fallback(handle).with_state(inner)
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Target {
    /// `/api`
    CoreVersions,
    /// `/apis`
    Groups,
    /// `/apis/<group>`
    Group(String),
    /// `/api/v1`, `/apis/<g>/<v>`
    ResourceList(String, String),
    /// `/version`
    Version,
    /// `/healthz`, `/readyz`, `/livez`
    Health,
    /// A resource URL.
    Resource {
        rid: usize,
        namespace: Option<String>,
        name: Option<String>,
        sub: Option<String>,
    },
    /// `POST /api/v1/namespaces/<ns>/bindings`
    Bindings {
        namespace: String,
    },
    NotFound,
}

#[derive(Clone, Debug)]
struct Parsed {
    target: Target,
    verb: Verb,
    group: String,
    version: String,
    resource: Option<String>,
}

fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let hex = std::str::from_utf8(&b[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok());
                match hex {
                    Some(v) => {
                        out.push(v);
                        i += 2;
                    }
                    None => out.push(b'%'),
                }
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub(crate) fn parse_query(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|s| !s.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (decode(k), decode(v))
        })
        .collect()
}

fn q<'a>(query: &'a [(String, String)], key: &str) -> Option<&'a str> {
    query
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

fn truthy(v: Option<&str>) -> bool {
    matches!(v, Some("true" | "1" | "True"))
}

fn parse_target(st: &StoreState, path: &str) -> (Target, String, String) {
    let segs: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let (group, version, rest) = match segs.as_slice() {
        [] => return (Target::NotFound, String::new(), String::new()),
        ["api"] => return (Target::CoreVersions, String::new(), String::new()),
        ["apis"] => return (Target::Groups, String::new(), String::new()),
        ["version"] => return (Target::Version, String::new(), String::new()),
        ["healthz" | "readyz" | "livez", ..] => {
            return (Target::Health, String::new(), String::new());
        }
        ["apis", g] => return (Target::Group(g.to_string()), g.to_string(), String::new()),
        ["api", v, rest @ ..] => (String::new(), v.to_string(), rest),
        ["apis", g, v, rest @ ..] => (g.to_string(), v.to_string(), rest),
        _ => return (Target::NotFound, String::new(), String::new()),
    };
    let known_gv = st
        .resources
        .iter()
        .any(|r| r.def.group == group && r.def.version == version);
    if !known_gv {
        return (Target::NotFound, group, version);
    }
    let namespaced_plural = |p: &str| {
        st.find(&group, &version, p)
            .filter(|rid| st.resources[*rid].def.namespaced)
    };
    let target = match rest {
        [] => Target::ResourceList(group.clone(), version.clone()),
        ["namespaces", ns, "bindings"] if group.is_empty() => Target::Bindings {
            namespace: ns.to_string(),
        },
        ["namespaces", ns, plural, more @ ..]
            if namespaced_plural(plural).is_some() && more.len() <= 2 =>
        {
            Target::Resource {
                rid: namespaced_plural(plural).unwrap_or_default(),
                namespace: Some(ns.to_string()),
                name: more.first().map(|s| s.to_string()),
                sub: more.get(1).map(|s| s.to_string()),
            }
        }
        [plural, more @ ..] if more.len() <= 2 => match st.find(&group, &version, plural) {
            Some(rid) => Target::Resource {
                rid,
                namespace: None,
                name: more.first().map(|s| s.to_string()),
                sub: more.get(1).map(|s| s.to_string()),
            },
            None => Target::NotFound,
        },
        _ => Target::NotFound,
    };
    (target, group, version)
}

fn parse(st: &StoreState, method: &Method, path: &str, query: &[(String, String)]) -> Parsed {
    let (target, group, version) = parse_target(st, path);
    let (verb, resource) = match &target {
        Target::Resource { rid, name, .. } => {
            let verb = match (method.as_str(), name.is_some()) {
                ("GET", true) => Verb::Get,
                ("GET", false) if truthy(q(query, "watch")) => Verb::Watch,
                ("GET", false) => Verb::List,
                ("POST", _) => Verb::Create,
                ("PUT", _) => Verb::Update,
                ("PATCH", _) => Verb::Patch,
                ("DELETE", true) => Verb::Delete,
                ("DELETE", false) => Verb::DeleteCollection,
                _ => Verb::Other,
            };
            (verb, Some(st.resources[*rid].def.plural.clone()))
        }
        Target::Bindings { .. } => (Verb::Create, Some("bindings".to_string())),
        Target::NotFound => (Verb::Other, None),
        _ => (Verb::Discovery, None),
    };
    Parsed {
        target,
        verb,
        group,
        version,
        resource,
    }
}

fn header_str(h: &HeaderMap, name: header::HeaderName) -> Option<String> {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
}

fn json_bytes(code: u16, body: Vec<u8>) -> Response {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .unwrap_or_else(|_| Response::new(Body::empty()))
}

fn json_response(code: u16, v: &Value) -> Response {
    json_bytes(code, serde_json::to_vec(v).unwrap_or_default())
}

pub(crate) fn status_response(s: &ApiStatus) -> Response {
    json_response(s.code, &s.to_json())
}

fn success_status(code: u16, details: Option<Value>) -> Value {
    let mut v = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": code});
    if let Some(d) = details {
        v["details"] = d;
    }
    v
}

fn not_found_path() -> ApiStatus {
    ApiStatus::new(404, "the server could not find the requested resource")
}

fn method_not_allowed() -> ApiStatus {
    ApiStatus::new(
        405,
        "the server does not allow this method on the requested resource",
    )
}

/// Decodes a request body: JSON, or YAML when the content type says so (or for apply).
fn decode_body(
    bytes: &Bytes,
    content_type: Option<&str>,
    yaml_ok: bool,
) -> Result<Value, ApiStatus> {
    if bytes.is_empty() {
        return Err(ApiStatus::bad_request("the request body is empty"));
    }
    let is_yaml = yaml_ok || content_type.is_some_and(|c| c.contains("yaml"));
    if is_yaml {
        serde_yaml::from_slice::<Value>(bytes)
            .map_err(|e| ApiStatus::bad_request(format!("error decoding YAML: {e}")))
    } else {
        serde_json::from_slice::<Value>(bytes)
            .map_err(|e| ApiStatus::bad_request(format!("error decoding JSON body: {e}")))
    }
}

fn check_body_type(content_type: Option<&str>) -> Result<(), ApiStatus> {
    match content_type.map(|c| {
        c.split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase()
    }) {
        None => Ok(()),
        Some(c)
            if c.is_empty() || c == "application/json" || c == "application/yaml" || c == "*/*" =>
        {
            Ok(())
        }
        Some(c) => Err(ApiStatus::new(
            415,
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json, application/yaml (got {c})"
            ),
        )),
    }
}

async fn handle(State(inner): State<Arc<Inner>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, inner.options.max_body_bytes).await {
        Ok(b) => b,
        Err(_) => {
            return status_response(&ApiStatus::new(
                413,
                format!(
                    "Request entity too large: limit is {}",
                    inner.options.max_body_bytes
                ),
            ));
        }
    };
    let path = parts.uri.path().to_string();
    let query = parse_query(parts.uri.query().unwrap_or(""));
    let parsed = {
        let st = inner.store.read();
        parse(&st, &parts.method, &path, &query)
    };
    let content_type = header_str(&parts.headers, header::CONTENT_TYPE);
    let accept = header_str(&parts.headers, header::ACCEPT);
    let seq = if inner.recording.load(Ordering::SeqCst) {
        let (namespace, name, sub) = match &parsed.target {
            Target::Resource {
                namespace,
                name,
                sub,
                ..
            } => (namespace.clone(), name.clone(), sub.clone()),
            Target::Bindings { namespace } => (Some(namespace.clone()), None, None),
            _ => (None, None, None),
        };
        let body = if bytes.is_empty() {
            None
        } else {
            serde_json::from_slice::<Value>(&bytes)
                .ok()
                .or_else(|| serde_yaml::from_slice::<Value>(&bytes).ok())
        };
        let rec = RecordedRequest {
            seq: 0,
            method: parts.method.to_string(),
            path: path.clone(),
            query: query.clone(),
            verb: parsed.verb,
            group: parsed.group.clone(),
            version: parsed.version.clone(),
            resource: parsed.resource.clone(),
            subresource: sub,
            namespace,
            name,
            content_type: content_type.clone(),
            accept: accept.clone(),
            user_agent: header_str(&parts.headers, header::USER_AGENT),
            field_manager: q(&query, "fieldManager").map(str::to_string),
            body,
            response_code: None,
            received_at: std::time::Instant::now(),
        };
        Some(inner.record(rec))
    } else {
        None
    };
    let ctx = Ctx {
        // Taken as the request arrives: a watch request in flight when the test drops the watches
        // is dropped too once it starts, as an API server restart ends it.
        drops: inner.drops.subscribe(),
        inner: inner.clone(),
        method: parts.method.clone(),
        query,
        content_type,
        accept,
        user_agent: header_str(&parts.headers, header::USER_AGENT),
        body: bytes,
    };
    let resp = serve(&ctx, &parsed).await;
    if let Some(seq) = seq {
        inner.set_response_code(seq, resp.status().as_u16());
    }
    resp
}

struct Ctx {
    inner: Arc<Inner>,
    /// The watch drops since this request arrived.
    drops: tokio::sync::watch::Receiver<(u64, watch::DropMode)>,
    method: Method,
    query: Vec<(String, String)>,
    content_type: Option<String>,
    accept: Option<String>,
    user_agent: Option<String>,
    body: Bytes,
}

impl Ctx {
    fn q(&self, key: &str) -> Option<&str> {
        q(&self.query, key)
    }

    fn metadata_only(&self) -> bool {
        self.accept
            .as_deref()
            .is_some_and(|a| a.contains("as=PartialObjectMetadata"))
    }

    fn dry_run(&self) -> Result<bool, ApiStatus> {
        match self.q("dryRun") {
            None | Some("") => Ok(false),
            Some("All") => Ok(true),
            Some(v) => Err(ApiStatus::bad_request(format!(
                "Invalid dryRun value {v:?}: only \"All\" is supported"
            ))),
        }
    }

    /// The field manager of a non-apply write: `fieldManager`, else the user agent's prefix.
    fn update_manager(&self) -> String {
        if let Some(m) = self.q("fieldManager").filter(|m| !m.is_empty()) {
            return m.to_string();
        }
        self.user_agent
            .as_deref()
            .map(|ua| ua.split('/').next().unwrap_or(ua).to_string())
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "unknown".to_string())
    }

    fn selectors(&self, reg: &Registered) -> Result<Selectors, ApiStatus> {
        Ok(Selectors {
            labels: LabelSelector::parse(self.q("labelSelector").unwrap_or(""))?,
            fields: FieldSelector::parse(
                self.q("fieldSelector").unwrap_or(""),
                reg.def.field_selectors.as_deref(),
            )?,
        })
    }

    /// Answers with a stored object in the resource's view (or as `PartialObjectMetadata`).
    fn object_response(&self, code: u16, reg: &Registered, stored: &Value) -> Response {
        if self.metadata_only() {
            json_response(code, &partial_metadata(stored))
        } else {
            json_response(code, &shaped(reg, stored, false))
        }
    }

    /// Answers with an object already in the resource's view.
    fn view_response(&self, code: u16, view: &Value) -> Response {
        if self.metadata_only() {
            json_response(code, &partial_metadata(view))
        } else {
            json_response(code, view)
        }
    }
}

async fn serve(ctx: &Ctx, p: &Parsed) -> Response {
    let inner = &ctx.inner;
    if inner.unavailable.load(Ordering::SeqCst) {
        return status_response(&ApiStatus::new(
            503,
            "the fake API server is unavailable (switched off by the test)",
        ));
    }
    let (resource, namespace, name, subresource) = match &p.target {
        Target::Resource {
            namespace,
            name,
            sub,
            ..
        } => (
            p.resource.as_deref(),
            namespace.as_deref(),
            name.as_deref(),
            sub.as_deref(),
        ),
        Target::Bindings { namespace } => (Some("bindings"), Some(namespace.as_str()), None, None),
        _ => (None, None, None, None),
    };
    let key = RequestKey {
        verb: p.verb,
        resource,
        namespace,
        name,
        subresource,
        field_manager: None,
    };
    let (fault, generation) = {
        let mut plan = inner.lock_faults();
        (plan.take(&key), plan.cleared_generation)
    };
    match fault {
        Some((_, FaultAction::Respond { code, message })) => {
            return status_response(&ApiStatus::new(code, message));
        }
        Some((id, FaultAction::Hang { max })) => inner.hang(id, generation, max).await,
        Some((_, FaultAction::Delay(d))) => tokio::time::sleep(d).await,
        None => {}
    }
    match dispatch(ctx, p) {
        Ok(r) => r,
        Err(s) => status_response(&s),
    }
}

fn dispatch(ctx: &Ctx, p: &Parsed) -> Result<Response, ApiStatus> {
    match &p.target {
        Target::NotFound => Err(not_found_path()),
        Target::Health => Ok(Response::builder()
            .status(200)
            .header(header::CONTENT_TYPE, "text/plain")
            .body(Body::from("ok"))
            .unwrap_or_else(|_| Response::new(Body::empty()))),
        Target::Version => Ok(json_response(
            200,
            &json!({
                "major": "1", "minor": "33", "gitVersion": "v1.33.0-teeguard-fakeapi",
                "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
                "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.24", "compiler": "gc",
                "platform": "linux/amd64"
            }),
        )),
        Target::CoreVersions | Target::Groups | Target::Group(_) | Target::ResourceList(..) => {
            if ctx.method != Method::GET {
                return Err(method_not_allowed());
            }
            let st = ctx.inner.store.read();
            discovery(&st, &p.target, ctx.accept.as_deref().unwrap_or(""))
        }
        Target::Bindings { namespace } => {
            if ctx.method != Method::POST {
                return Err(method_not_allowed());
            }
            let body = decode_body(&ctx.body, ctx.content_type.as_deref(), false)?;
            let name = body
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiStatus::invalid("", "Binding", "", "metadata.name", "Required value")
                })?
                .to_string();
            bind(ctx, namespace, &name, &body)
        }
        Target::Resource {
            rid,
            namespace,
            name,
            sub,
        } => resource(
            ctx,
            p.verb,
            *rid,
            namespace.as_deref(),
            name.as_deref(),
            sub.as_deref(),
        ),
    }
}

fn bind(ctx: &Ctx, ns: &str, name: &str, body: &Value) -> Result<Response, ApiStatus> {
    if let Some(n) = body.pointer("/metadata/name").and_then(Value::as_str)
        && n != name
    {
        return Err(ApiStatus::bad_request(format!(
            "the name of the object ({n}) does not match the name on the URL ({name})"
        )));
    }
    let node = body
        .pointer("/target/name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let dry_run = ctx.dry_run()?;
    ctx.inner
        .store
        .write(|st| st.bind(ns, name, &node, dry_run))?;
    Ok(json_response(201, &success_status(201, None)))
}

fn resource(
    ctx: &Ctx,
    verb: Verb,
    rid: usize,
    ns: Option<&str>,
    name: Option<&str>,
    sub: Option<&str>,
) -> Result<Response, ApiStatus> {
    let inner = &ctx.inner;
    let reg = inner.store.read().resources[rid].clone();
    let def = &reg.def;
    if let Some(s) = sub
        && !def.has_sub(s)
    {
        return Err(not_found_path());
    }
    // Item verbs on a namespaced resource need a namespace.
    if def.namespaced && ns.is_none() && (name.is_some() || verb == Verb::Create) {
        return Err(if name.is_some() {
            not_found_path()
        } else {
            method_not_allowed()
        });
    }
    if !def.namespaced && ns.is_some() {
        return Err(not_found_path());
    }
    let ns_owned = ns.map(str::to_string);
    match (verb, sub) {
        (Verb::Get, None | Some("status")) => {
            let name = name.unwrap_or_default();
            let obj = inner
                .store
                .read()
                .get(rid, ns, name)
                .ok_or_else(|| ApiStatus::not_found(&def.group, &def.plural, name))?;
            Ok(ctx.object_response(200, &reg, &obj))
        }
        (Verb::List, None) => {
            let sel = ctx.selectors(&reg)?;
            let limit =
                match ctx.q("limit").filter(|s| !s.is_empty()) {
                    Some(l) => Some(l.parse::<usize>().map_err(|_| {
                        ApiStatus::bad_request(format!("limit: Invalid value: {l:?}"))
                    })?),
                    None => None,
                };
            if let Some(rv) = ctx.q("resourceVersion").filter(|s| !s.is_empty())
                && rv.parse::<u64>().is_err()
            {
                return Err(ApiStatus::bad_request(format!(
                    "resourceVersion: Invalid value: {rv:?}"
                )));
            }
            let page = inner
                .store
                .read()
                .list(rid, ns, &sel, limit, ctx.q("continue"))?;
            list_response(&reg, page, ctx.metadata_only())
        }
        (Verb::Watch, None) => {
            let sel = ctx.selectors(&reg)?;
            // timeoutSeconds=0 (or absent) means the server's default, like the real server.
            let timeout = match ctx
                .q("timeoutSeconds")
                .filter(|s| !s.is_empty() && *s != "0")
            {
                Some(t) => Duration::from_secs(t.parse::<u64>().map_err(|_| {
                    ApiStatus::bad_request(format!("timeoutSeconds: Invalid value: {t:?}"))
                })?),
                None => inner.options.default_watch_timeout,
            };
            let req = WatchRequest {
                rid,
                namespace: ns_owned,
                selectors: sel,
                resource_version: ctx.q("resourceVersion").map(str::to_string),
                send_initial_events: truthy(ctx.q("sendInitialEvents")),
                bookmarks: truthy(ctx.q("allowWatchBookmarks")),
                timeout,
                metadata_only: ctx.metadata_only(),
            };
            watch::start(inner.clone(), req, ctx.drops.clone())
        }
        (Verb::Create, None) => {
            check_body_type(ctx.content_type.as_deref())?;
            let body = decode_body(&ctx.body, ctx.content_type.as_deref(), false)?;
            let opts = WriteOpts {
                dry_run: ctx.dry_run()?,
                http: true,
                managed: Managed::Update(ctx.update_manager()),
            };
            let obj = inner.store.write(|st| st.create(rid, ns, body, &opts))?;
            Ok(ctx.view_response(201, &obj))
        }
        (Verb::Create, Some("binding")) => {
            check_body_type(ctx.content_type.as_deref())?;
            let body = decode_body(&ctx.body, ctx.content_type.as_deref(), false)?;
            bind(ctx, ns.unwrap_or_default(), name.unwrap_or_default(), &body)
        }
        (Verb::Update, None | Some("status")) => {
            check_body_type(ctx.content_type.as_deref())?;
            let body = decode_body(&ctx.body, ctx.content_type.as_deref(), false)?;
            let name = name.ok_or_else(method_not_allowed)?;
            let opts = WriteOpts {
                dry_run: ctx.dry_run()?,
                http: true,
                managed: Managed::Update(ctx.update_manager()),
            };
            let obj = inner
                .store
                .write(|st| st.update(rid, ns, name, sub, body, &opts))?;
            Ok(ctx.view_response(200, &obj))
        }
        (Verb::Patch, None | Some("status")) => {
            let name = name.ok_or_else(method_not_allowed)?;
            let ct = ctx.content_type.as_deref().unwrap_or("");
            let ptype = PatchType::from_content_type(ct).ok_or_else(|| {
                ApiStatus::new(
                    415,
                    format!(
                        "the body of the request was in an unknown format - accepted media types include: \
                         application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, \
                         application/strategic-merge-patch+json (got {ct:?})"
                    ),
                )
            })?;
            let dry_run = ctx.dry_run()?;
            let force = ctx.q("force");
            if ptype == PatchType::Apply {
                let manager = ctx
                    .q("fieldManager")
                    .filter(|m| !m.is_empty())
                    .ok_or_else(|| {
                        ApiStatus::invalid(
                            "meta.k8s.io",
                            "PatchOptions",
                            "",
                            "fieldManager",
                            "Required value: is required for apply patch",
                        )
                    })?;
                let force = truthy(force);
                let body = decode_body(&ctx.body, ctx.content_type.as_deref(), true)?;
                let (obj, created) = inner
                    .store
                    .write(|st| st.apply(rid, ns, name, sub, body, manager, force, dry_run))?;
                Ok(ctx.view_response(if created { 201 } else { 200 }, &obj))
            } else {
                if force.is_some() {
                    return Err(ApiStatus::invalid(
                        "meta.k8s.io",
                        "PatchOptions",
                        "",
                        "force",
                        "Forbidden: may not be specified for non-apply patch",
                    ));
                }
                let body = decode_body(&ctx.body, Some("application/json"), false)?;
                let opts = WriteOpts {
                    dry_run,
                    http: true,
                    managed: Managed::Update(ctx.update_manager()),
                };
                let obj = inner
                    .store
                    .write(|st| st.patch(rid, ns, name, sub, ptype, &body, &opts))?;
                Ok(ctx.view_response(200, &obj))
            }
        }
        (Verb::Delete, None) => {
            let name = name.unwrap_or_default();
            let opts = delete_options(ctx)?;
            let out = inner.store.write(|st| st.delete(rid, ns, name, &opts))?;
            match out {
                Deleted::Gone(obj) if !def.delete_returns_object => Ok(json_response(
                    200,
                    &success_status(
                        200,
                        Some(json!({
                            "name": name, "group": def.group, "kind": def.plural,
                            "uid": obj.pointer("/metadata/uid").cloned().unwrap_or(Value::Null)
                        })),
                    ),
                )),
                Deleted::Gone(obj) | Deleted::Pending(obj) => Ok(ctx.view_response(200, &obj)),
            }
        }
        (Verb::DeleteCollection, None) => {
            let sel = ctx.selectors(&reg)?;
            let opts = delete_options(ctx)?;
            let deleted = inner.store.write(|st| {
                let victims: Vec<(String, String)> = st
                    .all(rid, ns, &sel)
                    .iter()
                    .map(|o| {
                        let s = |p: &str| {
                            o.pointer(p)
                                .and_then(Value::as_str)
                                .unwrap_or("")
                                .to_string()
                        };
                        (s("/metadata/namespace"), s("/metadata/name"))
                    })
                    .collect();
                let mut out = Vec::new();
                for (vns, vname) in victims {
                    let vns = if def.namespaced {
                        Some(vns.as_str())
                    } else {
                        None
                    };
                    if let Ok(Deleted::Gone(o) | Deleted::Pending(o)) =
                        st.delete(rid, vns, &vname, &opts)
                    {
                        out.push(o);
                    }
                }
                out
            });
            let items: Vec<Value> = deleted
                .iter()
                .map(|o| {
                    if ctx.metadata_only() {
                        partial_metadata(o)
                    } else {
                        o.clone()
                    }
                })
                .collect();
            Ok(json_response(
                200,
                &json!({"kind": format!("{}List", def.kind), "apiVersion": def.api_version(),
                        "metadata": {"resourceVersion": inner.store.read().rv.to_string()}, "items": items}),
            ))
        }
        _ => Err(method_not_allowed()),
    }
}

fn delete_options(ctx: &Ctx) -> Result<DeleteOpts, ApiStatus> {
    let mut opts = DeleteOpts {
        dry_run: ctx.dry_run()?,
        ..Default::default()
    };
    let mut policy = ctx.q("propagationPolicy").map(str::to_string);
    if !ctx.body.is_empty() {
        let body: Value = serde_json::from_slice(&ctx.body)
            .map_err(|e| ApiStatus::bad_request(format!("error decoding DeleteOptions: {e}")))?;
        if let Some(p) = body.get("propagationPolicy").and_then(Value::as_str) {
            policy = Some(p.to_string());
        }
        opts.uid = body
            .pointer("/preconditions/uid")
            .and_then(Value::as_str)
            .map(str::to_string);
        opts.resource_version = body
            .pointer("/preconditions/resourceVersion")
            .and_then(Value::as_str)
            .map(str::to_string);
        if let Some(Value::Array(d)) = body.get("dryRun") {
            opts.dry_run = opts.dry_run || d.iter().any(|x| x == "All");
        }
    }
    if let Some(p) =
        policy.filter(|p| !matches!(p.as_str(), "Orphan" | "Background" | "Foreground"))
    {
        return Err(ApiStatus::invalid(
            "meta.k8s.io",
            "DeleteOptions",
            "",
            "propagationPolicy",
            &format!(
                "Unsupported value: {p:?}: supported values: \"Foreground\", \"Background\", \"Orphan\""
            ),
        ));
    }
    Ok(opts)
}

fn list_response(
    reg: &Registered,
    page: super::store::ListPage,
    metadata_only: bool,
) -> Result<Response, ApiStatus> {
    let (api_version, kind) = if metadata_only {
        (
            "meta.k8s.io/v1".to_string(),
            "PartialObjectMetadataList".to_string(),
        )
    } else {
        (reg.def.api_version(), format!("{}List", reg.def.kind))
    };
    let mut meta = json!({"resourceVersion": page.resource_version.to_string()});
    if let Some(c) = &page.continue_token {
        meta["continue"] = json!(c);
    }
    let mut out = Vec::with_capacity(64 + page.items.len() * 1024);
    let err = |e: serde_json::Error| ApiStatus::new(500, format!("serialising the list: {e}"));
    out.extend_from_slice(b"{\"apiVersion\":");
    serde_json::to_writer(&mut out, &api_version).map_err(err)?;
    out.extend_from_slice(b",\"kind\":");
    serde_json::to_writer(&mut out, &kind).map_err(err)?;
    out.extend_from_slice(b",\"metadata\":");
    serde_json::to_writer(&mut out, &meta).map_err(err)?;
    out.extend_from_slice(b",\"items\":[");
    for (i, item) in page.items.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        if metadata_only {
            serde_json::to_writer(&mut out, &partial_metadata(item)).map_err(err)?;
        } else {
            serde_json::to_writer(&mut out, reg.to_view(item).as_ref()).map_err(err)?;
        }
    }
    out.extend_from_slice(b"]}");
    Ok(json_bytes(200, out))
}

fn resource_verbs(sub: Option<&str>) -> Vec<&'static str> {
    match sub {
        None => vec![
            "create",
            "delete",
            "deletecollection",
            "get",
            "list",
            "patch",
            "update",
            "watch",
        ],
        Some("binding") => vec!["create"],
        Some(_) => vec!["get", "patch", "update"],
    }
}

fn discovery(st: &StoreState, target: &Target, accept: &str) -> Result<Response, ApiStatus> {
    let aggregated = accept.contains("as=APIGroupDiscoveryList");
    let groups: Vec<(String, Vec<String>)> = {
        let mut g: Vec<(String, Vec<String>)> = Vec::new();
        for r in &st.resources {
            if r.def.group.is_empty() {
                continue;
            }
            match g.iter_mut().find(|(n, _)| *n == r.def.group) {
                Some((_, vs)) => {
                    if !vs.contains(&r.def.version) {
                        vs.push(r.def.version.clone());
                    }
                }
                None => g.push((r.def.group.clone(), vec![r.def.version.clone()])),
            }
        }
        g
    };
    let resources_of = |group: &str, version: &str| -> Vec<&Arc<Registered>> {
        st.resources
            .iter()
            .filter(|r| r.def.group == group && r.def.version == version)
            .collect()
    };
    let aggregated_group = |group: &str, versions: &[String]| -> Value {
        let versions: Vec<Value> = versions
            .iter()
            .map(|v| {
                let resources: Vec<Value> = resources_of(group, v)
                    .iter()
                    .map(|r| {
                        let d = &r.def;
                        let gvk = json!({"group": d.group, "version": d.version, "kind": d.kind});
                        json!({
                            "resource": d.plural,
                            "responseKind": gvk,
                            "scope": if d.namespaced { "Namespaced" } else { "Cluster" },
                            "singularResource": d.singular(),
                            "verbs": resource_verbs(None),
                            "shortNames": d.short_names,
                            "subresources": d.subresources.iter().map(|s| json!({
                                "subresource": s, "responseKind": gvk, "verbs": resource_verbs(Some(s))
                            })).collect::<Vec<_>>(),
                        })
                    })
                    .collect();
                json!({"version": v, "resources": resources, "freshness": "Current"})
            })
            .collect();
        json!({"metadata": {"name": group}, "versions": versions})
    };
    let group_doc = |name: &str, versions: &[String]| -> Value {
        let vs: Vec<Value> = versions
            .iter()
            .map(|v| json!({"groupVersion": format!("{name}/{v}"), "version": v}))
            .collect();
        json!({"name": name, "versions": vs, "preferredVersion": vs.first().cloned().unwrap_or(Value::Null)})
    };
    let agg_list = |items: Vec<Value>| {
        Response::builder()
            .status(200)
            .header(
                header::CONTENT_TYPE,
                "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList",
            )
            .body(Body::from(
                serde_json::to_vec(
                    &json!({"kind": "APIGroupDiscoveryList", "apiVersion": "apidiscovery.k8s.io/v2",
                                             "metadata": {}, "items": items}),
                )
                .unwrap_or_default(),
            ))
            .unwrap_or_else(|_| Response::new(Body::empty()))
    };
    match target {
        Target::CoreVersions if aggregated => {
            Ok(agg_list(vec![aggregated_group("", &["v1".to_string()])]))
        }
        Target::CoreVersions => Ok(json_response(
            200,
            &json!({"kind": "APIVersions", "versions": ["v1"],
                    "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1:6443"}]}),
        )),
        Target::Groups if aggregated => Ok(agg_list(
            groups
                .iter()
                .map(|(g, vs)| aggregated_group(g, vs))
                .collect(),
        )),
        Target::Groups => Ok(json_response(
            200,
            &json!({"kind": "APIGroupList", "apiVersion": "v1",
                    "groups": groups.iter().map(|(g, vs)| group_doc(g, vs)).collect::<Vec<_>>()}),
        )),
        Target::Group(name) => match groups.iter().find(|(g, _)| g == name) {
            Some((g, vs)) => {
                let mut doc = group_doc(g, vs);
                doc["kind"] = json!("APIGroup");
                doc["apiVersion"] = json!("v1");
                Ok(json_response(200, &doc))
            }
            None => Err(not_found_path()),
        },
        Target::ResourceList(group, version) => {
            let mut list = Vec::new();
            for r in resources_of(group, version) {
                let d = &r.def;
                list.push(json!({"name": d.plural, "singularName": d.singular(), "namespaced": d.namespaced,
                                 "kind": d.kind, "verbs": resource_verbs(None), "shortNames": d.short_names}));
                for s in &d.subresources {
                    list.push(json!({"name": format!("{}/{s}", d.plural), "singularName": "", "namespaced": d.namespaced,
                                     "kind": if s == "binding" { "Binding" } else { d.kind.as_str() },
                                     "verbs": resource_verbs(Some(s))}));
                }
            }
            let gv = if group.is_empty() {
                version.clone()
            } else {
                format!("{group}/{version}")
            };
            Ok(json_response(
                200,
                &json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": list}),
            ))
        }
        _ => Err(not_found_path()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_decoding() {
        let q = parse_query("labelSelector=app%3Dweb%2Ctier+in+%28a%2Cb%29&watch=1&x=%zz&y=%4");
        assert_eq!(
            q[0],
            ("labelSelector".into(), "app=web,tier in (a,b)".into())
        );
        assert_eq!(q[1], ("watch".into(), "1".into()));
        assert_eq!(q[2], ("x".into(), "%zz".into()));
        assert_eq!(q[3], ("y".into(), "%4".into()));
    }

    #[test]
    fn paths() {
        let st = StoreState::new(10);
        let t = |p: &str| parse_target(&st, p).0;
        let pods = st.find("", "v1", "pods").expect("pods");
        let ns = st.find("", "v1", "namespaces").expect("namespaces");
        assert_eq!(
            t("/api/v1/namespaces/a/pods/b/status"),
            Target::Resource {
                rid: pods,
                namespace: Some("a".into()),
                name: Some("b".into()),
                sub: Some("status".into())
            }
        );
        assert_eq!(
            t("/api/v1/pods"),
            Target::Resource {
                rid: pods,
                namespace: None,
                name: None,
                sub: None
            }
        );
        assert_eq!(
            t("/api/v1/namespaces/a"),
            Target::Resource {
                rid: ns,
                namespace: None,
                name: Some("a".into()),
                sub: None
            }
        );
        assert_eq!(
            t("/api/v1/namespaces/a/status"),
            Target::Resource {
                rid: ns,
                namespace: None,
                name: Some("a".into()),
                sub: Some("status".into())
            }
        );
        assert_eq!(
            t("/apis/teeguard.dev/v1alpha1"),
            Target::ResourceList("teeguard.dev".into(), "v1alpha1".into())
        );
        assert_eq!(t("/apis/nope/v1/things"), Target::NotFound);
        assert_eq!(
            t("/api/v1/namespaces/a/pods/b/status/extra"),
            Target::NotFound
        );
        assert_eq!(
            t("/api/v1/namespaces/a/bindings"),
            Target::Bindings {
                namespace: "a".into()
            }
        );
    }
}
