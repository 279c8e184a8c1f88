//! The object store: objects per resource in `BTreeMap<(namespace, name), Arc<Value>>`, one global
//! `resourceVersion` counter, a bounded history of change events for watches, and every write verb with the
//! real server's semantics (preconditions, status subresource rules, generation, finalizers, managed fields).

use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};

use base64::Engine as _;
use serde_json::{Map, Value, json};
use tokio::sync::watch;

use super::dispatch::Dispatch;

use super::apply;
use super::error::ApiStatus;
use super::patch::{self, PatchType};
use super::resources::{self, CreateStatus, Registered, ResourceDef};
use super::select::Selectors;

/// Kind of change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EventKind {
    Added,
    Modified,
    Deleted,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Added => "ADDED",
            Self::Modified => "MODIFIED",
            Self::Deleted => "DELETED",
        }
    }
}

/// One committed change, as kept in the history and sent to watchers.
#[derive(Debug)]
pub(crate) struct StoredEvent {
    pub rv: u64,
    pub storage: usize,
    pub kind: EventKind,
    pub namespace: String,
    /// The object after the change (for deletes: its last state, with the deletion's resourceVersion).
    pub object: Arc<Value>,
    /// The object before a modification.
    pub prev: Option<Arc<Value>>,
}

/// How a write records managed fields.
#[derive(Clone, Debug)]
pub(crate) enum Managed {
    /// Keep the existing `managedFields` (programmatic writes).
    Keep,
    /// Record an `Update` by this manager.
    Update(String),
    /// The new object already carries its final `managedFields` (server-side apply).
    Given,
}

/// Options of one write.
#[derive(Clone, Debug)]
pub(crate) struct WriteOpts {
    pub dry_run: bool,
    /// Written through HTTP: status subresource rules and create-status rules apply.
    pub http: bool,
    pub managed: Managed,
}

impl WriteOpts {
    pub fn programmatic() -> Self {
        Self {
            dry_run: false,
            http: false,
            managed: Managed::Keep,
        }
    }
}

/// Preconditions and options of a delete.
#[derive(Clone, Debug, Default)]
pub(crate) struct DeleteOpts {
    pub dry_run: bool,
    pub uid: Option<String>,
    pub resource_version: Option<String>,
}

/// Outcome of a delete.
#[derive(Debug)]
pub(crate) enum Deleted {
    /// Removed; the last state (view form).
    Gone(Value),
    /// Finalizers pending: `deletionTimestamp` set (view form).
    Pending(Value),
}

/// One page of a list (stored form).
#[derive(Debug)]
pub(crate) struct ListPage {
    pub items: Vec<Arc<Value>>,
    pub resource_version: u64,
    pub continue_token: Option<String>,
}

/// 5 characters from the alphabet the real server uses for `generateName`.
fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| ALPHABET[fastrand::usize(..ALPHABET.len())] as char)
        .collect()
}

/// Current time as the API server formats `metav1.Time`.
pub(crate) fn now() -> String {
    jiff::Timestamp::from_second(jiff::Timestamp::now().as_second())
        .map(|t| t.to_string())
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".to_string())
}

/// DNS-1123 subdomain.
fn valid_name(n: &str) -> bool {
    let b = n.as_bytes();
    !b.is_empty()
        && b.len() <= 253
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'.')
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

type Key = (String, String);

/// All objects and the change history.
pub(crate) struct State {
    pub resources: Vec<Arc<Registered>>,
    pub storages: Vec<BTreeMap<Key, Arc<Value>>>,
    pub rv: u64,
    pub history: VecDeque<Arc<StoredEvent>>,
    pub history_cap: usize,
    /// Events with `rv <= compacted` may be gone from the history.
    pub compacted: u64,
    pending: Vec<Arc<StoredEvent>>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("resources", &self.resources.len())
            .field("rv", &self.rv)
            .field("history", &self.history.len())
            .field("compacted", &self.compacted)
            .finish()
    }
}

fn meta(obj: &Value) -> Option<&Map<String, Value>> {
    obj.get("metadata").and_then(Value::as_object)
}

fn meta_str<'a>(obj: &'a Value, key: &str) -> Option<&'a str> {
    meta(obj)
        .and_then(|m| m.get(key))
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.get("metadata").is_some_and(Value::is_object) {
        obj["metadata"] = Value::Object(Map::new());
    }
    match obj.get_mut("metadata") {
        Some(Value::Object(m)) => m,
        _ => unreachable!("metadata was just made an object"),
    }
}

/// Whether anything outside `metadata`/`status` changed (bumps `generation`).
fn spec_changed(old: &Value, new: &Value) -> bool {
    let skip = ["metadata", "status", "apiVersion", "kind"];
    let (Some(o), Some(n)) = (old.as_object(), new.as_object()) else {
        return true;
    };
    let keys: std::collections::BTreeSet<&String> = o.keys().chain(n.keys()).collect();
    keys.into_iter()
        .filter(|k| !skip.contains(&k.as_str()))
        .any(|k| o.get(k) != n.get(k))
}

impl State {
    pub fn new(history_cap: usize) -> Self {
        let mut st = Self {
            resources: Vec::new(),
            storages: Vec::new(),
            // Never "0": a list at "0" would make clients watch from "0", which means "any version".
            rv: 1,
            history: VecDeque::new(),
            history_cap,
            compacted: 0,
            pending: Vec::new(),
        };
        for (def, storage_of, view) in resources::builtin() {
            let storage = match storage_of {
                Some(plural) => st
                    .resources
                    .iter()
                    .find(|r| r.def.plural == plural && r.def.group.is_empty())
                    .map(|r| r.storage),
                None => None,
            };
            st.register(def, storage, view);
        }
        st
    }

    pub fn register(
        &mut self,
        def: ResourceDef,
        storage: Option<usize>,
        view: resources::View,
    ) -> usize {
        if let Some(i) = self.resources.iter().position(|r| {
            r.def.group == def.group && r.def.version == def.version && r.def.plural == def.plural
        }) {
            let storage = self.resources[i].storage;
            self.resources[i] = Arc::new(Registered { def, storage, view });
            return i;
        }
        let storage = storage.unwrap_or_else(|| {
            self.storages.push(BTreeMap::new());
            self.storages.len() - 1
        });
        self.resources
            .push(Arc::new(Registered { def, storage, view }));
        self.resources.len() - 1
    }

    /// `pods`, `events.events.k8s.io`, `teecapacities.teeguard.dev`; core wins for plain plurals.
    pub fn resolve(&self, name: &str) -> Option<usize> {
        let exact =
            |plural: &str, group: Option<&str>| {
                let mut hits = self.resources.iter().enumerate().filter(|(_, r)| {
                    r.def.plural == plural && group.is_none_or(|g| r.def.group == g)
                });
                let first = hits.next();
                let core = self.resources.iter().position(|r| {
                    r.def.plural == plural && r.def.group.is_empty() && group.is_none()
                });
                core.or(first.map(|(i, _)| i))
            };
        if let Some(i) = exact(name, None) {
            return Some(i);
        }
        let (plural, group) = name.split_once('.')?;
        exact(plural, Some(group))
    }

    pub fn find(&self, group: &str, version: &str, plural: &str) -> Option<usize> {
        self.resources.iter().position(|r| {
            r.def.group == group && r.def.version == version && r.def.plural == plural
        })
    }

    pub fn find_kind(&self, api_version: &str, kind: &str) -> Option<usize> {
        self.resources
            .iter()
            .position(|r| r.def.api_version() == api_version && r.def.kind == kind)
    }

    /// An object written to a URL must not name another object: its `metadata.name` (and, for
    /// namespaced resources, `metadata.namespace`), when set, must match the URL's.
    fn check_url_identity(
        def: &ResourceDef,
        obj: &Value,
        ns: Option<&str>,
        name: &str,
    ) -> Result<(), ApiStatus> {
        if let Some(n) = meta_str(obj, "name")
            && n != name
        {
            return Err(ApiStatus::bad_request(format!(
                "the name of the object ({n}) does not match the name on the URL ({name})"
            )));
        }
        if def.namespaced
            && let (Some(b), Some(p)) = (meta_str(obj, "namespace"), ns)
            && b != p
        {
            return Err(ApiStatus::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
        Ok(())
    }

    fn key(def: &ResourceDef, ns: Option<&str>, name: &str) -> Key {
        let ns = if def.namespaced { ns.unwrap_or("") } else { "" };
        (ns.to_string(), name.to_string())
    }

    /// The stored object `name` (and its key), or 404.
    fn stored(
        &self,
        reg: &Registered,
        ns: Option<&str>,
        name: &str,
    ) -> Result<(Key, Arc<Value>), ApiStatus> {
        let def = &reg.def;
        let key = Self::key(def, ns, name);
        let old = self.storages[reg.storage]
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiStatus::not_found(&def.group, &def.plural, name))?;
        Ok((key, old))
    }

    pub fn get(&self, rid: usize, ns: Option<&str>, name: &str) -> Option<Arc<Value>> {
        let reg = &self.resources[rid];
        self.storages[reg.storage]
            .get(&Self::key(&reg.def, ns, name))
            .cloned()
    }

    pub fn count(&self, rid: usize) -> usize {
        self.storages[self.resources[rid].storage].len()
    }

    fn commit(&mut self, storage: usize, key: Key, mut obj: Value, kind: EventKind) -> Arc<Value> {
        self.rv += 1;
        let rv = self.rv;
        meta_mut(&mut obj).insert("resourceVersion".into(), Value::String(rv.to_string()));
        let arc = Arc::new(obj);
        let prev = match kind {
            EventKind::Added | EventKind::Modified => {
                self.storages[storage].insert(key.clone(), arc.clone())
            }
            EventKind::Deleted => self.storages[storage].remove(&key),
        };
        let ev = Arc::new(StoredEvent {
            rv,
            storage,
            kind,
            namespace: key.0,
            object: arc.clone(),
            prev: if kind == EventKind::Modified {
                prev
            } else {
                None
            },
        });
        self.history.push_back(ev.clone());
        while self.history.len() > self.history_cap {
            if let Some(old) = self.history.pop_front() {
                self.compacted = old.rv;
            }
        }
        if self.history_cap == 0 {
            self.compacted = rv;
        }
        self.pending.push(ev);
        arc
    }

    /// Forgets the whole history: watches from any older resourceVersion get 410 Gone.
    pub fn compact(&mut self) {
        self.history.clear();
        self.compacted = self.rv;
    }

    /// Checks `apiVersion`/`kind` against the resource, fills them in and converts to the stored form.
    fn check_types(reg: &Registered, obj: Value, require: bool) -> Result<Value, ApiStatus> {
        let def = &reg.def;
        let Value::Object(mut m) = obj else {
            return Err(ApiStatus::bad_request(
                "the body of the request must be a JSON object",
            ));
        };
        let want_av = def.api_version();
        match m.get("apiVersion").and_then(Value::as_str) {
            Some(av) if av != want_av => {
                return Err(ApiStatus::bad_request(format!(
                    "the API version in the data ({av}) does not match the expected API version ({want_av})"
                )));
            }
            None if require => return Err(ApiStatus::bad_request("apiVersion must be set")),
            _ => {}
        }
        match m.get("kind").and_then(Value::as_str) {
            Some(k) if k != def.kind => {
                return Err(ApiStatus::bad_request(format!(
                    "the kind in the data ({k}) does not match the expected kind ({})",
                    def.kind
                )));
            }
            None if require => return Err(ApiStatus::bad_request("kind must be set")),
            _ => {}
        }
        m.insert("apiVersion".into(), Value::String(want_av));
        m.insert("kind".into(), Value::String(def.kind.clone()));
        if !m.get("metadata").is_some_and(Value::is_object) {
            m.insert("metadata".into(), Value::Object(Map::new()));
        }
        Ok(reg.to_storage(Value::Object(m)))
    }

    fn view(reg: &Registered, obj: &Value) -> Value {
        reg.to_view(obj).into_owned()
    }

    /// Creates an object sent in the resource's view form.
    pub fn create(
        &mut self,
        rid: usize,
        ns: Option<&str>,
        obj: Value,
        opts: &WriteOpts,
    ) -> Result<Value, ApiStatus> {
        let reg = self.resources[rid].clone();
        let obj = Self::check_types(&reg, obj, false)?;
        self.create_stored(&reg, ns, obj, opts)
    }

    fn create_stored(
        &mut self,
        reg: &Registered,
        ns: Option<&str>,
        mut obj: Value,
        opts: &WriteOpts,
    ) -> Result<Value, ApiStatus> {
        let def = &reg.def;
        let now = now();
        let m = meta_mut(&mut obj);
        let ns = if def.namespaced {
            let body_ns = m
                .get("namespace")
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
                .map(str::to_string);
            let ns = match (ns, body_ns) {
                (Some(p), Some(b)) if p != b => {
                    return Err(ApiStatus::bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ));
                }
                (Some(p), _) => p.to_string(),
                (None, Some(b)) => b,
                (None, None) => "default".to_string(),
            };
            m.insert("namespace".into(), Value::String(ns.clone()));
            Some(ns)
        } else {
            m.remove("namespace");
            None
        };
        let name = match m
            .get("name")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
        {
            Some(n) => n.to_string(),
            None => {
                let Some(prefix) = m
                    .get("generateName")
                    .and_then(Value::as_str)
                    .filter(|s| !s.is_empty())
                else {
                    return Err(ApiStatus::invalid(
                        &def.group,
                        &def.kind,
                        "",
                        "metadata.name",
                        "Required value: name or generateName is required",
                    ));
                };
                let prefix = prefix.to_string();
                let storage = &self.storages[reg.storage];
                let mut name;
                loop {
                    name = format!("{prefix}{}", random_suffix());
                    if !storage.contains_key(&(ns.clone().unwrap_or_default(), name.clone())) {
                        break;
                    }
                }
                m.insert("name".into(), Value::String(name.clone()));
                name
            }
        };
        if !valid_name(&name) {
            return Err(ApiStatus::invalid(
                &def.group,
                &def.kind,
                &name,
                "metadata.name",
                &format!(
                    "Invalid value: {name:?}: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric \
                     characters, '-' or '.', and must start and end with an alphanumeric character"
                ),
            ));
        }
        let key = Self::key(def, ns.as_deref(), &name);
        if self.storages[reg.storage].contains_key(&key) {
            return Err(ApiStatus::already_exists(&def.group, &def.plural, &name));
        }
        // Over HTTP the server assigns the UID, as kube-apiserver does. Programmatic seeding keeps a UID
        // the test gave (fixtures carry deterministic UIDs that owner references point at).
        let given_uid = (!opts.http)
            .then(|| {
                m.get("uid")
                    .and_then(Value::as_str)
                    .filter(|u| !u.is_empty())
            })
            .flatten()
            .map(str::to_string);
        let uid = given_uid.unwrap_or_else(crate::fixtures::random_uid);
        m.insert("uid".into(), Value::String(uid));
        m.insert("creationTimestamp".into(), Value::String(now.clone()));
        m.insert("generation".into(), json!(1));
        for k in [
            "resourceVersion",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "selfLink",
        ] {
            m.remove(k);
        }
        if matches!(opts.managed, Managed::Update(_)) {
            m.remove("managedFields");
        }
        match def.create_status {
            CreateStatus::Keep => {}
            CreateStatus::Drop => {
                if opts.http {
                    obj.as_object_mut().map(|o| o.remove("status"));
                }
            }
            CreateStatus::Phase(p) => {
                if opts.http || obj.get("status").is_none() {
                    obj["status"] = json!({"phase": p});
                }
            }
        }
        if let Managed::Update(manager) = &opts.managed {
            apply::record_update(None, &mut obj, def, manager, "", &now);
        }
        if opts.dry_run {
            return Ok(Self::view(reg, &obj));
        }
        let stored = self.commit(reg.storage, key, obj, EventKind::Added);
        Ok(Self::view(reg, &stored))
    }

    /// Replaces an object (PUT), on the main resource or `status`.
    pub fn update(
        &mut self,
        rid: usize,
        ns: Option<&str>,
        name: &str,
        sub: Option<&str>,
        obj: Value,
        opts: &WriteOpts,
    ) -> Result<Value, ApiStatus> {
        let reg = self.resources[rid].clone();
        let def = &reg.def;
        let obj = Self::check_types(&reg, obj, false)?;
        Self::check_url_identity(def, &obj, ns, name)?;
        let (key, old) = self.stored(&reg, ns, name)?;
        match meta_str(&obj, "resourceVersion") {
            Some(rv) if Some(rv) != meta_str(&old, "resourceVersion") => {
                return Err(ApiStatus::modified(&def.group, &def.plural, name));
            }
            None if def.custom && opts.http => {
                return Err(ApiStatus::invalid(
                    &def.group,
                    &def.kind,
                    name,
                    "metadata.resourceVersion",
                    "Invalid value: 0x0: must be specified for an update",
                ));
            }
            _ => {}
        }
        self.finish_update(&reg, key, &old, obj, sub, opts)
    }

    /// Patches an object (JSON, merge or strategic; apply goes through [`State::apply`]).
    #[allow(clippy::too_many_arguments)]
    pub fn patch(
        &mut self,
        rid: usize,
        ns: Option<&str>,
        name: &str,
        sub: Option<&str>,
        ptype: PatchType,
        body: &Value,
        opts: &WriteOpts,
    ) -> Result<Value, ApiStatus> {
        let reg = self.resources[rid].clone();
        let def = &reg.def;
        let (key, old) = self.stored(&reg, ns, name)?;
        let mut doc = Self::view(&reg, &old);
        match ptype {
            PatchType::Json => patch::json_patch(&mut doc, body)?,
            PatchType::Merge => patch::merge_patch(&mut doc, body)?,
            PatchType::Strategic => patch::strategic_merge(&mut doc, body, def)?,
            PatchType::Apply => {
                return Err(ApiStatus::new(
                    500,
                    "internal error: apply patches go through apply",
                ));
            }
        }
        if let Some(rv) = meta_str(&doc, "resourceVersion")
            && Some(rv) != meta_str(&old, "resourceVersion")
        {
            return Err(ApiStatus::modified(&def.group, &def.plural, name));
        }
        let new = Self::check_types(&reg, doc, false)?;
        self.finish_update(&reg, key, &old, new, sub, opts)
    }

    /// Server-side apply; returns the object (view form) and whether it was created.
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &mut self,
        rid: usize,
        ns: Option<&str>,
        name: &str,
        sub: Option<&str>,
        body: Value,
        manager: &str,
        force: bool,
        dry_run: bool,
    ) -> Result<(Value, bool), ApiStatus> {
        let reg = self.resources[rid].clone();
        let def = &reg.def;
        let applied = Self::check_types(&reg, body, true)?;
        Self::check_url_identity(def, &applied, ns, name)?;
        let key = Self::key(def, ns, name);
        let old = self.storages[reg.storage].get(&key).cloned();
        let now = now();
        let opts = WriteOpts {
            dry_run,
            http: true,
            managed: Managed::Given,
        };
        match old {
            None => {
                if sub.is_some() {
                    return Err(ApiStatus::not_found(&def.group, &def.plural, name));
                }
                let result = apply::apply(None, applied, def, name, ns, manager, "", force, &now)?;
                Ok((self.create_stored(&reg, ns, result.object, &opts)?, true))
            }
            Some(old) => {
                let result = apply::apply(
                    Some(&old),
                    applied,
                    def,
                    name,
                    ns,
                    manager,
                    sub.unwrap_or(""),
                    force,
                    &now,
                )?;
                Ok((
                    self.finish_update(&reg, key, &old, result.object, sub, &opts)?,
                    false,
                ))
            }
        }
    }

    /// Shared tail of update, patch and apply: server-owned metadata, status rules, generation, managed
    /// fields, no-op detection, finalizer-driven deletion, commit.
    fn finish_update(
        &mut self,
        reg: &Registered,
        key: Key,
        old: &Arc<Value>,
        mut new: Value,
        sub: Option<&str>,
        opts: &WriteOpts,
    ) -> Result<Value, ApiStatus> {
        let def = &reg.def;
        let name = key.1.clone();
        if let Some(uid) = meta_str(&new, "uid")
            && Some(uid) != meta_str(old, "uid")
        {
            return Err(ApiStatus::conflict(
                &def.group,
                &def.plural,
                &name,
                &format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    meta_str(old, "uid").unwrap_or("")
                ),
            ));
        }
        if let Some(n) = meta_str(&new, "name")
            && n != name
        {
            return Err(ApiStatus::bad_request(format!(
                "the name of the object ({n}) does not match the name on the URL ({name})"
            )));
        }
        if opts.http {
            if sub == Some("status") {
                let status = new.get("status").cloned();
                let managed = meta(&new).and_then(|m| m.get("managedFields")).cloned();
                let mut merged = (**old).clone();
                match status {
                    Some(s) => merged["status"] = s,
                    None => {
                        merged.as_object_mut().map(|m| m.remove("status"));
                    }
                }
                if matches!(opts.managed, Managed::Given) {
                    let m = meta_mut(&mut merged);
                    match managed {
                        Some(mf) => m.insert("managedFields".into(), mf),
                        None => m.remove("managedFields"),
                    };
                }
                new = merged;
            } else if def.has_status() {
                match old.get("status") {
                    Some(s) => new["status"] = s.clone(),
                    None => {
                        new.as_object_mut().map(|m| m.remove("status"));
                    }
                }
            }
        }
        {
            let old_meta = meta(old).cloned().unwrap_or_default();
            let m = meta_mut(&mut new);
            for k in [
                "uid",
                "name",
                "namespace",
                "creationTimestamp",
                "generation",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "resourceVersion",
            ] {
                match old_meta.get(k) {
                    Some(v) => m.insert(k.to_string(), v.clone()),
                    None => m.remove(k),
                };
            }
            m.remove("selfLink");
            if !matches!(opts.managed, Managed::Given) {
                match old_meta.get("managedFields") {
                    Some(v) => m.insert("managedFields".into(), v.clone()),
                    None => m.remove("managedFields"),
                };
            }
        }
        if spec_changed(old, &new) {
            let gen_ = meta(old)
                .and_then(|m| m.get("generation"))
                .and_then(Value::as_i64)
                .unwrap_or(0);
            meta_mut(&mut new).insert("generation".into(), json!(gen_ + 1));
        }
        if let Managed::Update(manager) = &opts.managed {
            apply::record_update(Some(old), &mut new, def, manager, sub.unwrap_or(""), &now());
        }
        if new == **old {
            return Ok(Self::view(reg, old));
        }
        let finalizing = meta(&new).is_some_and(|m| {
            m.contains_key("deletionTimestamp")
                && m.get("finalizers")
                    .and_then(Value::as_array)
                    .is_none_or(Vec::is_empty)
        });
        if opts.dry_run {
            return Ok(Self::view(reg, &new));
        }
        let stored = self.commit(
            reg.storage,
            key,
            new,
            if finalizing {
                EventKind::Deleted
            } else {
                EventKind::Modified
            },
        );
        Ok(Self::view(reg, &stored))
    }

    /// Deletes an object; with finalizers it only gets a `deletionTimestamp`.
    pub fn delete(
        &mut self,
        rid: usize,
        ns: Option<&str>,
        name: &str,
        opts: &DeleteOpts,
    ) -> Result<Deleted, ApiStatus> {
        let reg = self.resources[rid].clone();
        let def = &reg.def;
        let (key, old) = self.stored(&reg, ns, name)?;
        if let Some(uid) = &opts.uid
            && Some(uid.as_str()) != meta_str(&old, "uid")
        {
            return Err(ApiStatus::conflict(
                &def.group,
                &def.plural,
                name,
                &format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    meta_str(&old, "uid").unwrap_or("")
                ),
            ));
        }
        if let Some(rv) = &opts.resource_version
            && Some(rv.as_str()) != meta_str(&old, "resourceVersion")
        {
            return Err(ApiStatus::conflict(
                &def.group,
                &def.plural,
                name,
                &format!(
                    "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                    meta_str(&old, "resourceVersion").unwrap_or("")
                ),
            ));
        }
        let has_finalizers = meta(&old)
            .and_then(|m| m.get("finalizers"))
            .and_then(Value::as_array)
            .is_some_and(|f| !f.is_empty());
        if has_finalizers {
            if meta(&old).is_some_and(|m| m.contains_key("deletionTimestamp")) {
                return Ok(Deleted::Pending(Self::view(&reg, &old)));
            }
            let mut new = (*old).clone();
            let m = meta_mut(&mut new);
            m.insert("deletionTimestamp".into(), Value::String(now()));
            m.insert("deletionGracePeriodSeconds".into(), json!(0));
            if opts.dry_run {
                return Ok(Deleted::Pending(Self::view(&reg, &new)));
            }
            let stored = self.commit(reg.storage, key, new, EventKind::Modified);
            return Ok(Deleted::Pending(Self::view(&reg, &stored)));
        }
        if opts.dry_run {
            return Ok(Deleted::Gone(Self::view(&reg, &old)));
        }
        let stored = self.commit(reg.storage, key, (*old).clone(), EventKind::Deleted);
        Ok(Deleted::Gone(Self::view(&reg, &stored)))
    }

    /// Assigns a pod to a node (the `binding` subresource); 409 if it is already bound.
    pub fn bind(
        &mut self,
        ns: &str,
        name: &str,
        node: &str,
        dry_run: bool,
    ) -> Result<Value, ApiStatus> {
        let rid = self
            .find("", "v1", "pods")
            .ok_or_else(|| ApiStatus::new(500, "pods are not registered"))?;
        let reg = self.resources[rid].clone();
        if node.is_empty() {
            return Err(ApiStatus::invalid(
                "",
                "Binding",
                name,
                "target.name",
                "Required value",
            ));
        }
        let key = Self::key(&reg.def, Some(ns), name);
        let old = self.storages[reg.storage]
            .get(&key)
            .cloned()
            .ok_or_else(|| ApiStatus::not_found("", "pods", name))?;
        if let Some(cur) = old
            .pointer("/spec/nodeName")
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty())
        {
            return Err(ApiStatus::conflict(
                "",
                "pods/binding",
                name,
                &format!("pod {name} is already assigned to node \"{cur}\""),
            ));
        }
        if meta(&old).is_some_and(|m| m.contains_key("deletionTimestamp")) {
            return Err(ApiStatus::conflict(
                "",
                "pods/binding",
                name,
                "pod is being deleted, cannot be assigned to a host",
            ));
        }
        let mut new = (*old).clone();
        new["spec"]["nodeName"] = Value::String(node.to_string());
        set_condition(&mut new, "PodScheduled", "True");
        let opts = WriteOpts {
            dry_run,
            http: false,
            managed: Managed::Keep,
        };
        self.finish_update(&reg, key, &old, new, None, &opts)
    }

    /// A page of objects matching the selectors, sorted by namespace/name.
    pub fn list(
        &self,
        rid: usize,
        ns: Option<&str>,
        sel: &Selectors,
        limit: Option<usize>,
        continue_token: Option<&str>,
    ) -> Result<ListPage, ApiStatus> {
        let reg = &self.resources[rid];
        let map = &self.storages[reg.storage];
        let (snapshot_rv, start) = match continue_token.filter(|t| !t.is_empty()) {
            Some(t) => {
                let (rv, key) = decode_continue(t)?;
                if rv < self.compacted {
                    return Err(ApiStatus::gone(
                        "The provided continue parameter is too old to display a consistent list result. \
                         You can start a new list without the continue parameter.",
                    ));
                }
                (rv, Bound::Excluded(key))
            }
            None => (
                self.rv,
                match ns {
                    Some(ns) if reg.def.namespaced => {
                        Bound::Included((ns.to_string(), String::new()))
                    }
                    _ => Bound::Unbounded,
                },
            ),
        };
        let limit = limit.filter(|l| *l > 0);
        let mut items = Vec::new();
        let mut last_key = None;
        let mut more = false;
        for (k, v) in map.range((start, Bound::Unbounded)) {
            if let Some(ns) = ns.filter(|_| reg.def.namespaced)
                && k.0 != ns
            {
                break;
            }
            if !sel.is_empty() && !sel.matches(&reg.to_view(v)) {
                continue;
            }
            if limit.is_some_and(|l| items.len() >= l) {
                more = true;
                break;
            }
            items.push(v.clone());
            last_key = Some(k.clone());
        }
        let continue_token = match (more, last_key) {
            (true, Some(k)) => Some(encode_continue(snapshot_rv, &k)),
            _ => None,
        };
        Ok(ListPage {
            items,
            resource_version: snapshot_rv,
            continue_token,
        })
    }

    /// Objects (view form) of one namespace (or all) of a resource, optionally filtered.
    pub fn all(&self, rid: usize, ns: Option<&str>, sel: &Selectors) -> Vec<Arc<Value>> {
        self.list(rid, ns, sel, None, None)
            .map(|p| p.items)
            .unwrap_or_default()
    }

    /// Takes the events committed since the last call.
    pub fn take_pending(&mut self) -> Vec<Arc<StoredEvent>> {
        std::mem::take(&mut self.pending)
    }
}

/// Sets (or replaces) a status condition `type` to `status`.
pub(crate) fn set_condition(obj: &mut Value, type_: &str, status: &str) {
    if !obj.get("status").is_some_and(Value::is_object) {
        obj["status"] = json!({});
    }
    let conds = &mut obj["status"]["conditions"];
    if !conds.is_array() {
        *conds = json!([]);
    }
    let Value::Array(list) = conds else { return };
    let cond = json!({"type": type_, "status": status, "lastProbeTime": null, "lastTransitionTime": now()});
    match list
        .iter_mut()
        .find(|c| c.get("type").and_then(Value::as_str) == Some(type_))
    {
        Some(c) => {
            if c.get("status").and_then(Value::as_str) != Some(status) {
                *c = cond;
            }
        }
        None => list.push(cond),
    }
}

fn encode_continue(rv: u64, key: &Key) -> String {
    let raw = json!({"rv": rv, "ns": key.0, "name": key.1}).to_string();
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
}

fn decode_continue(t: &str) -> Result<(u64, Key), ApiStatus> {
    let bad = || ApiStatus::bad_request(format!("invalid continue token {t:?}"));
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(t)
        .map_err(|_| bad())?;
    let v: Value = serde_json::from_slice(&raw).map_err(|_| bad())?;
    let rv = v.get("rv").and_then(Value::as_u64).ok_or_else(bad)?;
    let ns = v.get("ns").and_then(Value::as_str).ok_or_else(bad)?;
    let name = v.get("name").and_then(Value::as_str).ok_or_else(bad)?;
    Ok((rv, (ns.to_string(), name.to_string())))
}

/// The store with its notification channels.
pub(crate) struct Store {
    state: RwLock<State>,
    pub dispatch: Dispatch,
    pub rv_tx: watch::Sender<u64>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("state", &*self.read())
            .finish()
    }
}

impl Store {
    pub fn new(history_cap: usize, broadcast_cap: usize) -> Self {
        let (rv_tx, _) = watch::channel(0);
        Self {
            state: RwLock::new(State::new(history_cap)),
            dispatch: Dispatch::new(broadcast_cap),
            rv_tx,
        }
    }

    pub fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs a write under the lock and publishes its events before releasing it, so watch registration
    /// (under the read lock) sees each event exactly once: in the history or on the channel.
    pub fn write<R>(&self, f: impl FnOnce(&mut State) -> R) -> R {
        let mut st = self.state.write().unwrap_or_else(PoisonError::into_inner);
        let r = f(&mut st);
        let pending = st.take_pending();
        if !pending.is_empty() {
            for ev in &pending {
                self.dispatch.publish(ev);
            }
            self.rv_tx.send_replace(st.rv);
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str) -> Value {
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "ns"}, "spec": {"containers": [{"name": "c"}]}})
    }

    #[test]
    fn seeding_keeps_a_given_uid_http_does_not() {
        let mut st = State::new(100);
        let rid = st.resolve("pods").expect("pods");
        let mut given = pod("seeded");
        given["metadata"]["uid"] = json!("11111111-2222-4333-8444-555555555555");
        let seeded = st
            .create(rid, Some("ns"), given.clone(), &WriteOpts::programmatic())
            .expect("seed");
        assert_eq!(
            seeded["metadata"]["uid"],
            "11111111-2222-4333-8444-555555555555"
        );
        given["metadata"]["name"] = json!("over-http");
        let http = WriteOpts {
            http: true,
            ..WriteOpts::programmatic()
        };
        let created = st.create(rid, Some("ns"), given, &http).expect("create");
        assert_ne!(
            created["metadata"]["uid"],
            "11111111-2222-4333-8444-555555555555"
        );
    }

    #[test]
    fn create_update_conflict_and_generation() {
        let mut st = State::new(100);
        let rid = st.resolve("pods").expect("pods");
        let created = st
            .create(rid, Some("ns"), pod("a"), &WriteOpts::programmatic())
            .expect("create");
        assert_eq!(created["metadata"]["resourceVersion"], "2");
        assert_eq!(created["metadata"]["generation"], 1);
        assert_eq!(created["status"]["phase"], "Pending");
        let uid = created["metadata"]["uid"].as_str().expect("uid");
        assert_eq!(uid.len(), 36);
        assert_eq!(&uid[14..15], "4");
        let e = st
            .create(rid, Some("ns"), pod("a"), &WriteOpts::programmatic())
            .expect_err("exists");
        assert_eq!((e.code, e.reason.as_str()), (409, "AlreadyExists"));

        let mut upd = created.clone();
        upd["spec"]["nodeName"] = json!("n1");
        let updated = st
            .update(
                rid,
                Some("ns"),
                "a",
                None,
                upd.clone(),
                &WriteOpts::programmatic(),
            )
            .expect("update");
        assert_eq!(updated["metadata"]["generation"], 2);
        assert_eq!(updated["metadata"]["resourceVersion"], "3");
        let e = st
            .update(rid, Some("ns"), "a", None, upd, &WriteOpts::programmatic())
            .expect_err("stale");
        assert_eq!((e.code, e.reason.as_str()), (409, "Conflict"));
    }

    #[test]
    fn generate_name_and_pagination() {
        let mut st = State::new(100);
        let rid = st.resolve("pods").expect("pods");
        for _ in 0..5 {
            let p = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "virt-launcher-x-", "namespace": "ns"}});
            let c = st
                .create(rid, None, p, &WriteOpts::programmatic())
                .expect("create");
            let n = c["metadata"]["name"].as_str().expect("name");
            assert!(
                n.starts_with("virt-launcher-x-") && n.len() == "virt-launcher-x-".len() + 5,
                "{n}"
            );
        }
        let sel = Selectors::default();
        let p1 = st
            .list(rid, Some("ns"), &sel, Some(2), None)
            .expect("page 1");
        assert_eq!(p1.items.len(), 2);
        let tok = p1.continue_token.clone().expect("more");
        let p2 = st
            .list(rid, Some("ns"), &sel, Some(2), Some(&tok))
            .expect("page 2");
        let p3 = st
            .list(rid, Some("ns"), &sel, Some(2), p2.continue_token.as_deref())
            .expect("page 3");
        assert_eq!(p3.items.len(), 1);
        assert!(p3.continue_token.is_none());
        assert_eq!(p3.resource_version, p1.resource_version);
        st.create(rid, Some("ns"), pod("z"), &WriteOpts::programmatic())
            .expect("create");
        st.list(rid, Some("ns"), &sel, Some(2), Some(&tok))
            .expect("history still covers the snapshot");
        st.compact();
        assert_eq!(
            st.list(rid, Some("ns"), &sel, Some(2), Some(&tok))
                .expect_err("expired")
                .code,
            410
        );
    }

    #[test]
    fn finalizers_delay_deletion() {
        let mut st = State::new(100);
        let rid = st.resolve("pods").expect("pods");
        let mut p = pod("f");
        p["metadata"]["finalizers"] = json!(["x/y"]);
        st.create(rid, None, p, &WriteOpts::programmatic())
            .expect("create");
        let d = st
            .delete(rid, Some("ns"), "f", &DeleteOpts::default())
            .expect("delete");
        let Deleted::Pending(obj) = d else {
            panic!("expected pending")
        };
        assert!(obj["metadata"]["deletionTimestamp"].is_string());
        let mut cleared = obj.clone();
        cleared["metadata"]["finalizers"] = json!([]);
        st.update(
            rid,
            Some("ns"),
            "f",
            None,
            cleared,
            &WriteOpts::programmatic(),
        )
        .expect("remove finalizer");
        assert!(st.get(rid, Some("ns"), "f").is_none());
        assert_eq!(st.history.back().map(|e| e.kind), Some(EventKind::Deleted));
    }

    #[test]
    fn history_is_bounded() {
        let mut st = State::new(3);
        let rid = st.resolve("nodes").expect("nodes");
        for i in 0..10 {
            let n =
                json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": format!("n{i}")}});
            st.create(rid, None, n, &WriteOpts::programmatic())
                .expect("create");
        }
        assert_eq!(st.history.len(), 3);
        assert_eq!(st.compacted, 8);
    }
}
