//! Managed fields and server-side apply.
//!
//! Ownership is tracked per manager entry (manager, operation `Apply`/`Update`, subresource) as a set of
//! field paths, stored in the object's `metadata.managedFields` in the real `FieldsV1` format and parsed
//! back on every write. List items are identified by key for list-type maps (`k:{"type":"Ready"}`), by value
//! for sets (`v:"finalizer"`); other lists are atomic leaves.

use std::collections::BTreeSet;

use serde_json::{Map, Value, json};

use super::error::ApiStatus;
use super::resources::{ListKind, ResourceDef};

/// One step of a field path.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Pe {
    Field(String),
    /// Canonical JSON of the key fields of a list-map item.
    Key(String),
    /// Canonical JSON of a set item.
    Val(String),
    Index(usize),
}

pub(crate) type FieldPath = Vec<Pe>;
pub(crate) type FieldSet = BTreeSet<FieldPath>;

/// Metadata fields the server owns; never part of managed fields.
const SERVER_METADATA: &[&str] = &[
    "name",
    "namespace",
    "generateName",
    "uid",
    "resourceVersion",
    "generation",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "managedFields",
    "selfLink",
];

/// One `managedFields` entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ManagedEntry {
    pub manager: String,
    pub operation: String,
    pub api_version: String,
    pub subresource: String,
    pub time: String,
    pub fields: FieldSet,
}

impl ManagedEntry {
    fn same_slot(&self, manager: &str, operation: &str, subresource: &str) -> bool {
        self.manager == manager && self.operation == operation && self.subresource == subresource
    }
}

fn key_json(item: &Value, keys: &[String]) -> Option<String> {
    let mut m = Map::new();
    for k in keys {
        m.insert(k.clone(), item.get(k)?.clone());
    }
    Some(Value::Object(m).to_string())
}

/// The field paths set in `obj` (leaves, plus list-map and set items).
pub(crate) fn leaves(obj: &Value, def: &ResourceDef) -> FieldSet {
    let mut out = FieldSet::new();
    let Value::Object(top) = obj else { return out };
    let mut path = Vec::new();
    let mut names = Vec::new();
    for (k, v) in top {
        if k == "apiVersion" || k == "kind" {
            continue;
        }
        path.push(Pe::Field(k.clone()));
        names.push(k.clone());
        if k == "metadata" {
            if let Value::Object(meta) = v {
                for (mk, mv) in meta {
                    if SERVER_METADATA.contains(&mk.as_str()) {
                        continue;
                    }
                    path.push(Pe::Field(mk.clone()));
                    names.push(mk.clone());
                    collect(mv, &mut path, &mut names, def, &mut out);
                    names.pop();
                    path.pop();
                }
            }
        } else {
            collect(v, &mut path, &mut names, def, &mut out);
        }
        names.pop();
        path.pop();
    }
    out
}

fn collect(
    v: &Value,
    path: &mut FieldPath,
    names: &mut Vec<String>,
    def: &ResourceDef,
    out: &mut FieldSet,
) {
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, c) in m {
                path.push(Pe::Field(k.clone()));
                names.push(k.clone());
                collect(c, path, names, def, out);
                names.pop();
                path.pop();
            }
        }
        Value::Array(items) if !items.is_empty() => match def.list_kind(names) {
            ListKind::Map(keys)
                if items
                    .iter()
                    .all(|i| i.is_object() && key_json(i, &keys).is_some()) =>
            {
                for item in items {
                    let Some(k) = key_json(item, &keys) else {
                        continue;
                    };
                    path.push(Pe::Key(k));
                    out.insert(path.clone());
                    if let Value::Object(m) = item {
                        for (ik, iv) in m {
                            path.push(Pe::Field(ik.clone()));
                            names.push(ik.clone());
                            collect(iv, path, names, def, out);
                            names.pop();
                            path.pop();
                        }
                    }
                    path.pop();
                }
            }
            ListKind::Set if items.iter().all(|i| !i.is_object() && !i.is_array()) => {
                for item in items {
                    path.push(Pe::Val(item.to_string()));
                    out.insert(path.clone());
                    path.pop();
                }
            }
            _ => {
                out.insert(path.clone());
            }
        },
        _ => {
            out.insert(path.clone());
        }
    }
}

fn is_item(p: &[Pe]) -> bool {
    matches!(p.last(), Some(Pe::Key(_) | Pe::Val(_)))
}

fn find_item(items: &[Value], e: &Pe) -> Option<usize> {
    match e {
        Pe::Key(k) => {
            let probe: Value = serde_json::from_str(k).ok()?;
            let pm = probe.as_object()?;
            items
                .iter()
                .position(|i| pm.iter().all(|(pk, pv)| i.get(pk) == Some(pv)))
        }
        Pe::Val(j) => items
            .iter()
            .position(|i| i.to_string().as_str() == j.as_str()),
        Pe::Index(n) => (*n < items.len()).then_some(*n),
        Pe::Field(_) => None,
    }
}

/// The value at a field path.
pub(crate) fn get_at<'a>(v: &'a Value, path: &[Pe]) -> Option<&'a Value> {
    let mut cur = v;
    for e in path {
        cur = match (e, cur) {
            (Pe::Field(f), Value::Object(m)) => m.get(f)?,
            (_, Value::Array(items)) => &items[find_item(items, e)?],
            _ => return None,
        };
    }
    Some(cur)
}

/// Removes the value at a field path; returns whether something was removed.
pub(crate) fn remove_at(v: &mut Value, path: &[Pe]) -> bool {
    let Some((last, parent)) = path.split_last() else {
        return false;
    };
    let mut cur = v;
    for e in parent {
        cur = match (e, cur) {
            (Pe::Field(f), Value::Object(m)) => match m.get_mut(f) {
                Some(c) => c,
                None => return false,
            },
            (_, Value::Array(items)) => match find_item(items, e) {
                Some(i) => &mut items[i],
                None => return false,
            },
            _ => return false,
        };
    }
    match (last, cur) {
        (Pe::Field(f), Value::Object(m)) => m.remove(f).is_some(),
        (e, Value::Array(items)) => match find_item(items, e) {
            Some(i) => {
                items.remove(i);
                true
            }
            None => false,
        },
        _ => false,
    }
}

/// `.status.conditions[type="Ready"].status`, as the real server prints paths in conflicts.
pub(crate) fn path_string(path: &[Pe]) -> String {
    let mut s = String::new();
    for e in path {
        match e {
            Pe::Field(f) => {
                s.push('.');
                s.push_str(f);
            }
            Pe::Key(k) => {
                let parts: Vec<String> = serde_json::from_str::<Map<String, Value>>(k)
                    .map(|m| m.iter().map(|(k, v)| format!("{k}={v}")).collect())
                    .unwrap_or_default();
                s.push_str(&format!("[{}]", parts.join(",")));
            }
            Pe::Val(j) => s.push_str(&format!("[={j}]")),
            Pe::Index(i) => s.push_str(&format!("[{i}]")),
        }
    }
    s
}

// ---- FieldsV1 encoding ----

#[derive(Default)]
struct Node {
    owned: bool,
    children: std::collections::BTreeMap<String, Node>,
}

fn pe_key(e: &Pe) -> String {
    match e {
        Pe::Field(f) => format!("f:{f}"),
        Pe::Key(k) => format!("k:{k}"),
        Pe::Val(j) => format!("v:{j}"),
        Pe::Index(i) => format!("i:{i}"),
    }
}

fn render_node(n: &Node) -> Value {
    let mut m = Map::new();
    if n.owned && !n.children.is_empty() {
        m.insert(".".into(), json!({}));
    }
    for (k, c) in &n.children {
        m.insert(k.clone(), render_node(c));
    }
    Value::Object(m)
}

/// Encodes a field set as `FieldsV1`.
pub(crate) fn to_fields_v1(set: &FieldSet) -> Value {
    let mut root = Node::default();
    for p in set {
        let mut n = &mut root;
        for e in p {
            n = n.children.entry(pe_key(e)).or_default();
        }
        n.owned = true;
    }
    render_node(&root)
}

fn parse_node(v: &Value, path: &mut FieldPath, out: &mut FieldSet) {
    let Value::Object(m) = v else { return };
    for (k, c) in m {
        if k == "." {
            out.insert(path.clone());
            continue;
        }
        let e = if let Some(f) = k.strip_prefix("f:") {
            Pe::Field(f.to_string())
        } else if let Some(j) = k.strip_prefix("k:") {
            // Canonicalise the key JSON (sorted keys, compact).
            match serde_json::from_str::<Value>(j) {
                Ok(kv) => Pe::Key(kv.to_string()),
                Err(_) => continue,
            }
        } else if let Some(j) = k.strip_prefix("v:") {
            match serde_json::from_str::<Value>(j) {
                Ok(vv) => Pe::Val(vv.to_string()),
                Err(_) => continue,
            }
        } else if let Some(i) = k.strip_prefix("i:") {
            match i.parse() {
                Ok(i) => Pe::Index(i),
                Err(_) => continue,
            }
        } else {
            continue;
        };
        path.push(e);
        if c.as_object().is_some_and(Map::is_empty) {
            out.insert(path.clone());
        } else {
            parse_node(c, path, out);
        }
        path.pop();
    }
}

/// Decodes `FieldsV1`.
pub(crate) fn from_fields_v1(v: &Value) -> FieldSet {
    let mut out = FieldSet::new();
    parse_node(v, &mut Vec::new(), &mut out);
    out
}

/// Reads `metadata.managedFields`.
pub(crate) fn read_managed(obj: &Value) -> Vec<ManagedEntry> {
    let Some(Value::Array(entries)) = obj.pointer("/metadata/managedFields") else {
        return Vec::new();
    };
    entries
        .iter()
        .filter_map(|e| {
            let s = |k: &str| e.get(k).and_then(Value::as_str).unwrap_or("").to_string();
            let manager = s("manager");
            if manager.is_empty() && e.get("fieldsV1").is_none() {
                return None;
            }
            Some(ManagedEntry {
                manager,
                operation: s("operation"),
                api_version: s("apiVersion"),
                subresource: s("subresource"),
                time: s("time"),
                fields: e.get("fieldsV1").map(from_fields_v1).unwrap_or_default(),
            })
        })
        .collect()
}

/// Writes `metadata.managedFields` (removed when empty).
pub(crate) fn write_managed(obj: &mut Value, entries: &[ManagedEntry]) {
    let Some(Value::Object(meta)) = obj.get_mut("metadata") else {
        return;
    };
    let rendered: Vec<Value> = entries
        .iter()
        .filter(|e| !e.fields.is_empty())
        .map(|e| {
            let mut m = Map::new();
            m.insert("manager".into(), json!(e.manager));
            m.insert("operation".into(), json!(e.operation));
            m.insert("apiVersion".into(), json!(e.api_version));
            m.insert("time".into(), json!(e.time));
            m.insert("fieldsType".into(), json!("FieldsV1"));
            m.insert("fieldsV1".into(), to_fields_v1(&e.fields));
            if !e.subresource.is_empty() {
                m.insert("subresource".into(), json!(e.subresource));
            }
            Value::Object(m)
        })
        .collect();
    if rendered.is_empty() {
        meta.remove("managedFields");
    } else {
        meta.insert("managedFields".into(), Value::Array(rendered));
    }
}

fn restrict(set: FieldSet, subresource: &str, def: &ResourceDef) -> FieldSet {
    let status = Pe::Field("status".into());
    if subresource == "status" {
        set.into_iter()
            .filter(|p| p.first() == Some(&status))
            .collect()
    } else if def.has_status() {
        set.into_iter()
            .filter(|p| p.first() != Some(&status))
            .collect()
    } else {
        set
    }
}

/// Records a non-apply write (create, update, patch) by `manager`: it takes over the fields it changed;
/// fields it removed are dropped from every manager.
pub(crate) fn record_update(
    old: Option<&Value>,
    new: &mut Value,
    def: &ResourceDef,
    manager: &str,
    subresource: &str,
    now: &str,
) {
    let mut entries = old.map(read_managed).unwrap_or_default();
    let new_leaves = restrict(leaves(new, def), subresource, def);
    let old_leaves = old
        .map(|o| restrict(leaves(o, def), subresource, def))
        .unwrap_or_default();
    let changed: FieldSet = new_leaves
        .iter()
        .filter(|p| match old {
            None => true,
            Some(o) => {
                if is_item(p) {
                    get_at(o, p).is_none()
                } else {
                    get_at(o, p) != get_at(new, p)
                }
            }
        })
        .cloned()
        .collect();
    let removed: FieldSet = old_leaves.difference(&new_leaves).cloned().collect();
    if changed.is_empty() && removed.is_empty() {
        write_managed(new, &entries);
        return;
    }
    for e in &mut entries {
        e.fields.retain(|p| !removed.contains(p));
        if !e.same_slot(manager, "Update", subresource) {
            e.fields.retain(|p| !changed.contains(p));
        }
    }
    match entries
        .iter_mut()
        .find(|e| e.same_slot(manager, "Update", subresource))
    {
        Some(e) => {
            e.fields.extend(changed);
            e.time = now.to_string();
        }
        None => entries.push(ManagedEntry {
            manager: manager.to_string(),
            operation: "Update".into(),
            api_version: def.api_version(),
            subresource: subresource.to_string(),
            time: now.to_string(),
            fields: changed,
        }),
    }
    entries.retain(|e| !e.fields.is_empty());
    write_managed(new, &entries);
}

fn strip_nulls(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.retain(|_, c| !c.is_null());
            m.values_mut().for_each(strip_nulls);
        }
        Value::Array(a) => a.iter_mut().for_each(strip_nulls),
        _ => {}
    }
}

/// Merges an applied configuration into an object: maps recursively, list-maps by key, sets by union,
/// everything else replaced.
fn ssa_merge(target: &mut Value, applied: &Value, def: &ResourceDef, names: &mut Vec<String>) {
    match (target, applied) {
        (Value::Object(t), Value::Object(a)) => {
            for (k, av) in a {
                names.push(k.clone());
                match t.get_mut(k) {
                    Some(tv) => ssa_merge(tv, av, def, names),
                    None => {
                        t.insert(k.clone(), av.clone());
                    }
                }
                names.pop();
            }
        }
        (Value::Array(t), Value::Array(a)) => match def.list_kind(names) {
            ListKind::Map(keys) if a.iter().all(|i| key_json(i, &keys).is_some()) => {
                for item in a {
                    let k = key_json(item, &keys);
                    match t.iter_mut().find(|ti| key_json(ti, &keys) == k) {
                        Some(ti) => ssa_merge(ti, item, def, names),
                        None => t.push(item.clone()),
                    }
                }
            }
            ListKind::Set => {
                for item in a {
                    if !t.contains(item) {
                        t.push(item.clone());
                    }
                }
            }
            _ => *t = a.clone(),
        },
        (t, a) => *t = a.clone(),
    }
}

/// Result of a server-side apply: the new object (with `metadata.managedFields` written).
pub(crate) struct Applied {
    pub object: Value,
}

/// Server-side apply of `applied` by `manager` onto `current` (or onto an empty object of the resource
/// when `current` is `None`). `subresource` is `""` or `"status"`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn apply(
    current: Option<&Value>,
    mut applied: Value,
    def: &ResourceDef,
    name: &str,
    namespace: Option<&str>,
    manager: &str,
    subresource: &str,
    force: bool,
    now: &str,
) -> Result<Applied, ApiStatus> {
    strip_nulls(&mut applied);
    if let Some(Value::Object(meta)) = applied.get_mut("metadata") {
        for k in SERVER_METADATA {
            if *k != "resourceVersion" {
                meta.remove(*k);
            }
        }
    }
    // resourceVersion in an applied configuration is a precondition.
    if let Some(rv) = applied
        .pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .map(str::to_string)
    {
        let cur_rv = current
            .and_then(|c| c.pointer("/metadata/resourceVersion"))
            .and_then(Value::as_str);
        if !rv.is_empty() && cur_rv != Some(rv.as_str()) {
            return Err(ApiStatus::modified(&def.group, &def.plural, name));
        }
    }
    if let Some(Value::Object(meta)) = applied.get_mut("metadata") {
        meta.remove("resourceVersion");
        if meta.is_empty() {
            applied.as_object_mut().map(|m| m.remove("metadata"));
        }
    }
    // Only the status stanza counts on /status; the main resource ignores it when status is a subresource.
    if let Value::Object(m) = &mut applied {
        if subresource == "status" {
            m.retain(|k, _| k == "status" || k == "apiVersion" || k == "kind");
        } else if def.has_status() {
            m.remove("status");
        }
    }
    let applied_set = leaves(&applied, def);

    let mut base = match current {
        Some(c) => c.clone(),
        None => {
            let mut meta = Map::new();
            meta.insert("name".into(), json!(name));
            if let Some(ns) = namespace {
                meta.insert("namespace".into(), json!(ns));
            }
            json!({"apiVersion": def.api_version(), "kind": def.kind, "metadata": meta})
        }
    };
    let mut entries = current.map(read_managed).unwrap_or_default();

    // Conflicts: fields another manager owns that this apply would change.
    let mut conflicts: Vec<(usize, FieldPath)> = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        if e.manager == manager {
            continue;
        }
        for p in applied_set.intersection(&e.fields) {
            if !is_item(p) && get_at(&base, p) != get_at(&applied, p) {
                conflicts.push((i, p.clone()));
            }
        }
    }
    if !conflicts.is_empty() {
        if !force {
            let n = conflicts.len();
            let mut s = ApiStatus::with_reason(
                409,
                "Conflict",
                format!(
                    "Apply failed with {n} conflict{}: {}",
                    if n == 1 { "" } else { "s" },
                    conflicts
                        .iter()
                        .map(|(i, p)| format!(
                            "conflict with \"{}\" using {}: {}",
                            entries[*i].manager,
                            entries[*i].api_version,
                            path_string(p)
                        ))
                        .collect::<Vec<_>>()
                        .join("\n")
                ),
            )
            .details(name, &def.group, &def.plural);
            for (i, p) in &conflicts {
                s = s.cause(
                    "FieldManagerConflict",
                    &format!(
                        "conflict with \"{}\" using {}",
                        entries[*i].manager, entries[*i].api_version
                    ),
                    &path_string(p),
                );
            }
            return Err(s);
        }
        for (i, p) in &conflicts {
            entries[*i].fields.remove(p);
        }
    }

    // Fields this manager applied before but not now are removed, unless someone else still owns them.
    let mine = entries
        .iter()
        .position(|e| e.same_slot(manager, "Apply", subresource));
    let previous: FieldSet = mine.map(|i| entries[i].fields.clone()).unwrap_or_default();
    let others: FieldSet = entries
        .iter()
        .enumerate()
        .filter(|(i, _)| Some(*i) != mine)
        .flat_map(|(_, e)| e.fields.iter().cloned())
        .collect();
    let mut to_remove: Vec<&FieldPath> = previous
        .difference(&applied_set)
        .filter(|p| {
            !others
                .range((*p).clone()..)
                .take_while(|q| q.starts_with(p))
                .any(|_| true)
                && !(1..p.len()).any(|n| others.contains(&p[..n]) && !is_item(&p[..n]))
        })
        .collect();
    // Shallowest first: a list item goes as a whole (its fields then no longer resolve).
    to_remove.sort_by_key(|p| p.len());
    for p in &to_remove {
        remove_at(&mut base, p);
        // Drop maps emptied by the removal (below top level), unless still owned.
        for n in (2..p.len()).rev() {
            let parent = &p[..n];
            let empty =
                get_at(&base, parent).is_some_and(|v| v.as_object().is_some_and(Map::is_empty));
            if empty && !others.contains(parent) && !applied_set.contains(parent) {
                remove_at(&mut base, parent);
            } else {
                break;
            }
        }
    }

    let mut names = Vec::new();
    ssa_merge(&mut base, &applied, def, &mut names);

    match mine {
        Some(i) => {
            if entries[i].fields != applied_set {
                entries[i].time = now.to_string();
            }
            entries[i].fields = applied_set;
            entries[i].api_version = def.api_version();
        }
        None => entries.push(ManagedEntry {
            manager: manager.to_string(),
            operation: "Apply".into(),
            api_version: def.api_version(),
            subresource: subresource.to_string(),
            time: now.to_string(),
            fields: applied_set,
        }),
    }
    entries.retain(|e| !e.fields.is_empty());
    write_managed(&mut base, &entries);
    Ok(Applied { object: base })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn def() -> ResourceDef {
        ResourceDef::tee_capacities()
    }

    /// A status apply of `cfg` over `base` (TeeCapacity `n`) by `manager`.
    fn apply_status(
        base: &Value,
        cfg: Value,
        manager: &str,
        force: bool,
    ) -> Result<Applied, ApiStatus> {
        apply(
            Some(base),
            cfg,
            &def(),
            "n",
            None,
            manager,
            "status",
            force,
            "t",
        )
    }

    #[test]
    fn fields_v1_round_trip() {
        let obj = json!({"apiVersion": "v1", "kind": "X", "metadata": {"name": "n", "labels": {"a": "b"}, "finalizers": ["f"]},
            "status": {"conditions": [{"type": "Ready", "status": "True"}], "tdx": {"free": 3}, "list": [1, 2]}});
        let set = leaves(&obj, &def());
        let enc = to_fields_v1(&set);
        assert_eq!(
            enc,
            json!({"f:metadata": {"f:labels": {"f:a": {}}, "f:finalizers": {"v:\"f\"": {}}},
                   "f:status": {"f:conditions": {"k:{\"type\":\"Ready\"}": {".": {}, "f:status": {}, "f:type": {}}},
                                "f:list": {}, "f:tdx": {"f:free": {}}}})
        );
        assert_eq!(from_fields_v1(&enc), set);
    }

    #[test]
    fn reapply_removes_dropped_fields_and_detects_conflicts() {
        let d = def();
        let cfg1 = json!({"apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeCapacity", "metadata": {"name": "n"},
            "status": {"tdx": {"free": 3, "capacity": 8}, "conditions": [{"type": "A", "status": "True"}, {"type": "B", "status": "True"}]}});
        let obj = apply(None, json!({"apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeCapacity", "metadata": {"name": "n"}, "spec": {"nodeName": "n"}}),
            &d, "n", None, "agent", "", false, "t").expect("create").object;
        let obj = apply_status(&obj, cfg1, "agent", false)
            .expect("status")
            .object;
        assert_eq!(obj["status"]["tdx"]["capacity"], 8);
        let cfg2 = json!({"apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeCapacity", "metadata": {"name": "n"},
            "status": {"tdx": {"free": 2}, "conditions": [{"type": "A", "status": "False"}]}});
        let obj = apply_status(&obj, cfg2, "agent", false)
            .expect("reapply")
            .object;
        assert_eq!(obj["status"]["tdx"], json!({"free": 2}));
        assert_eq!(
            obj["status"]["conditions"],
            json!([{"type": "A", "status": "False"}])
        );
        assert_eq!(obj["spec"]["nodeName"], "n");

        let other = json!({"apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeCapacity", "metadata": {"name": "n"},
            "status": {"tdx": {"free": 5}}});
        let e = apply_status(&obj, other.clone(), "intruder", false)
            .err()
            .expect("conflict");
        assert_eq!(e.code, 409);
        assert!(
            e.message.contains("conflict with \"agent\""),
            "{}",
            e.message
        );
        assert_eq!(e.causes()[0].field, ".status.tdx.free");
        let same = json!({"apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeCapacity", "metadata": {"name": "n"},
            "status": {"tdx": {"free": 2}}});
        apply_status(&obj, same, "intruder", false).expect("same value is no conflict");
        let forced = apply_status(&obj, other, "intruder", true)
            .expect("force")
            .object;
        assert_eq!(forced["status"]["tdx"]["free"], 5);
        let agent = read_managed(&forced)
            .into_iter()
            .find(|e| e.manager == "agent" && e.subresource == "status")
            .expect("agent entry");
        assert!(!agent.fields.contains(&vec![
            Pe::Field("status".into()),
            Pe::Field("tdx".into()),
            Pe::Field("free".into())
        ]));
    }

    #[test]
    fn update_takes_ownership() {
        let d = def();
        let old = apply(None, json!({"apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeCapacity", "metadata": {"name": "n"}, "spec": {"nodeName": "a"}}),
            &d, "n", None, "agent", "", false, "t").expect("create").object;
        let mut new = old.clone();
        new["spec"]["nodeName"] = json!("b");
        record_update(Some(&old), &mut new, &d, "kubectl", "", "t");
        let e = apply(Some(&new), json!({"apiVersion": "teeguard.dev/v1alpha1", "kind": "TeeCapacity", "metadata": {"name": "n"}, "spec": {"nodeName": "a"}}),
            &d, "n", None, "agent", "", false, "t").err().expect("conflict with kubectl");
        assert!(e.message.contains("kubectl"));
    }
}
