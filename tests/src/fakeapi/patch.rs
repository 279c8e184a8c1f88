//! JSON Patch (RFC 6902), JSON merge patch (RFC 7386) and strategic merge patch.

use serde_json::{Map, Value};

use super::error::ApiStatus;
use super::resources::{ListKind, ResourceDef};

/// The patch types the server accepts, by `Content-Type`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PatchType {
    /// `application/json-patch+json`
    Json,
    /// `application/merge-patch+json`
    Merge,
    /// `application/strategic-merge-patch+json`
    Strategic,
    /// `application/apply-patch+yaml` (server-side apply)
    Apply,
}

impl PatchType {
    /// Maps a `Content-Type` header value.
    pub fn from_content_type(ct: &str) -> Option<Self> {
        let base = ct
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        match base.as_str() {
            "application/json-patch+json" => Some(Self::Json),
            "application/merge-patch+json" => Some(Self::Merge),
            "application/strategic-merge-patch+json" => Some(Self::Strategic),
            "application/apply-patch+yaml" | "application/apply-patch+json" => Some(Self::Apply),
            _ => None,
        }
    }
}

/// Applies an RFC 6902 patch; a failing `test` or a bad path is a 422 like the real server.
pub fn json_patch(doc: &mut Value, patch: &Value) -> Result<(), ApiStatus> {
    let ops: json_patch::Patch = serde_json::from_value(patch.clone())
        .map_err(|e| ApiStatus::bad_request(format!("invalid JSON patch: {e}")))?;
    json_patch::patch(doc, &ops).map_err(|e| {
        ApiStatus::new(
            422,
            format!("the server rejected our request due to an error in our request: {e}"),
        )
    })
}

/// Applies an RFC 7386 merge patch; the patch must be an object.
pub fn merge_patch(doc: &mut Value, patch: &Value) -> Result<(), ApiStatus> {
    if !patch.is_object() {
        return Err(ApiStatus::bad_request(
            "a merge patch must be a JSON object",
        ));
    }
    json_patch::merge(doc, patch);
    Ok(())
}

/// Applies a strategic merge patch: merge-patch semantics plus merge-by-key lists, `$patch` directives,
/// `$deleteFromPrimitiveList/<field>`, `$retainKeys`; `$setElementOrder/<field>` is accepted and ignored.
pub fn strategic_merge(doc: &mut Value, patch: &Value, def: &ResourceDef) -> Result<(), ApiStatus> {
    if def.custom {
        return Err(ApiStatus::new(
            415,
            format!(
                "the body of the request was in an unknown format - accepted media types include: \
                 application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml \
                 (strategic merge patch is not supported for custom resource {})",
                def.plural
            ),
        ));
    }
    let Value::Object(p) = patch else {
        return Err(ApiStatus::bad_request(
            "a strategic merge patch must be a JSON object",
        ));
    };
    if !doc.is_object() {
        *doc = Value::Object(Map::new());
    }
    let mut names = Vec::new();
    smp_value(doc, p, def, &mut names)
}

/// Removes `$...` directive keys recursively (for values inserted as-is).
fn strip_directives(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .filter(|(k, _)| !k.starts_with('$'))
                .map(|(k, v)| (k.clone(), strip_directives(v)))
                .collect(),
        ),
        Value::Array(a) => Value::Array(
            a.iter()
                .filter(|i| i.get("$patch").is_none())
                .map(strip_directives)
                .collect(),
        ),
        other => other.clone(),
    }
}

fn smp_value(
    target: &mut Value,
    patch: &Map<String, Value>,
    def: &ResourceDef,
    names: &mut Vec<String>,
) -> Result<(), ApiStatus> {
    match patch.get("$patch").and_then(Value::as_str) {
        Some("replace") => {
            *target = strip_directives(&Value::Object(patch.clone()));
            return Ok(());
        }
        Some("delete") => {
            *target = Value::Object(Map::new());
            return Ok(());
        }
        Some("merge") | None => {}
        Some(other) => {
            return Err(ApiStatus::bad_request(format!(
                "unknown $patch directive {other:?}"
            )));
        }
    }
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let Value::Object(t) = target else {
        return Ok(());
    };
    if let Some(Value::Array(keep)) = patch.get("$retainKeys") {
        let keep: Vec<&str> = keep.iter().filter_map(Value::as_str).collect();
        t.retain(|k, _| keep.contains(&k.as_str()));
    }
    for (k, pv) in patch {
        if let Some(field) = k.strip_prefix("$deleteFromPrimitiveList/") {
            if let (Some(Value::Array(cur)), Value::Array(del)) = (t.get_mut(field), pv) {
                cur.retain(|x| !del.contains(x));
            }
            continue;
        }
        if k.starts_with('$') {
            continue;
        }
        names.push(k.clone());
        let res = smp_field(t, k, pv, def, names);
        names.pop();
        res?;
    }
    Ok(())
}

fn smp_field(
    t: &mut Map<String, Value>,
    k: &str,
    pv: &Value,
    def: &ResourceDef,
    names: &mut Vec<String>,
) -> Result<(), ApiStatus> {
    match pv {
        Value::Null => {
            t.remove(k);
        }
        Value::Object(pm) => {
            if pm.get("$patch").and_then(Value::as_str) == Some("delete") {
                t.remove(k);
            } else {
                let slot = t.entry(k.to_string()).or_insert(Value::Null);
                smp_value(slot, pm, def, names)?;
            }
        }
        Value::Array(items) => match def.list_kind(names) {
            ListKind::Map(keys) => {
                let slot = t
                    .entry(k.to_string())
                    .or_insert_with(|| Value::Array(Vec::new()));
                if !slot.is_array() {
                    *slot = Value::Array(Vec::new());
                }
                merge_keyed(slot, items, &keys, def, names)?;
            }
            ListKind::Set => {
                let slot = t
                    .entry(k.to_string())
                    .or_insert_with(|| Value::Array(Vec::new()));
                if let Value::Array(cur) = slot {
                    for i in items {
                        if !cur.contains(i) {
                            cur.push(i.clone());
                        }
                    }
                } else {
                    *slot = strip_directives(pv);
                }
            }
            ListKind::Atomic => {
                t.insert(k.to_string(), strip_directives(pv));
            }
        },
        scalar => {
            t.insert(k.to_string(), scalar.clone());
        }
    }
    Ok(())
}

fn key_matches(item: &Value, probe: &Value, keys: &[String]) -> bool {
    keys.iter()
        .all(|k| item.get(k).is_some() && item.get(k) == probe.get(k))
}

fn merge_keyed(
    slot: &mut Value,
    items: &[Value],
    keys: &[String],
    def: &ResourceDef,
    names: &mut Vec<String>,
) -> Result<(), ApiStatus> {
    if items.iter().any(|i| {
        i.get("$patch").and_then(Value::as_str) == Some("replace")
            && i.as_object().is_some_and(|m| m.len() == 1)
    }) {
        *slot = Value::Array(
            items
                .iter()
                .filter(|i| i.get("$patch").is_none())
                .map(strip_directives)
                .collect(),
        );
        return Ok(());
    }
    let Value::Array(cur) = slot else {
        return Ok(());
    };
    for item in items {
        let Value::Object(im) = item else {
            return Err(ApiStatus::new(
                422,
                format!("list {} items must be objects", names.join(".")),
            ));
        };
        if !keys.iter().all(|k| im.contains_key(k)) {
            return Err(ApiStatus::new(
                422,
                format!(
                    "map: {item} does not contain declared merge key: {}",
                    keys.join(",")
                ),
            ));
        }
        let pos = cur.iter().position(|c| key_matches(c, item, keys));
        if im.get("$patch").and_then(Value::as_str) == Some("delete") {
            cur.retain(|c| !key_matches(c, item, keys));
            continue;
        }
        match pos {
            Some(i) => smp_value(&mut cur[i], im, def, names)?,
            None => cur.push(strip_directives(item)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pods() -> ResourceDef {
        ResourceDef::new("", "v1", "pods", "Pod", true)
    }

    #[test]
    fn json_patch_test_failure_is_422() {
        let mut doc = json!({"a": 1});
        let e = json_patch(&mut doc, &json!([{"op": "test", "path": "/a", "value": 2}]))
            .expect_err("test op fails");
        assert_eq!(e.code, 422);
        let e = json_patch(&mut doc, &json!({"op": "add"})).expect_err("not an array");
        assert_eq!(e.code, 400);
        json_patch(&mut doc, &json!([{"op": "add", "path": "/b", "value": 2}])).expect("applies");
        assert_eq!(doc, json!({"a": 1, "b": 2}));
    }

    #[test]
    fn strategic_merges_by_key() {
        let mut doc = json!({
            "metadata": {"finalizers": ["a"], "ownerReferences": [{"uid": "u1", "name": "x"}]},
            "spec": {
                "containers": [{"name": "compute", "image": "i1", "env": [{"name": "A", "value": "1"}]},
                               {"name": "side", "image": "s"}],
                "tolerations": [{"key": "t1"}]
            },
            "status": {"conditions": [{"type": "Ready", "status": "False"}, {"type": "PodScheduled", "status": "True"}]}
        });
        let patch = json!({
            "metadata": {"finalizers": ["b"], "ownerReferences": [{"uid": "u2", "name": "y"}]},
            "spec": {
                "containers": [{"name": "compute", "env": [{"name": "B", "value": "2"}]},
                               {"name": "side", "$patch": "delete"}],
                "tolerations": [{"key": "t2"}]
            },
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}
        });
        strategic_merge(&mut doc, &patch, &pods()).expect("applies");
        assert_eq!(doc["metadata"]["finalizers"], json!(["a", "b"]));
        assert_eq!(
            doc["metadata"]["ownerReferences"].as_array().map(Vec::len),
            Some(2)
        );
        assert_eq!(
            doc["spec"]["containers"],
            json!([{"name": "compute", "image": "i1", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]}])
        );
        assert_eq!(doc["spec"]["tolerations"], json!([{"key": "t2"}]));
        assert_eq!(
            doc["status"]["conditions"],
            json!([{"type": "Ready", "status": "True"}, {"type": "PodScheduled", "status": "True"}])
        );
    }

    #[test]
    fn strategic_directives() {
        let mut doc = json!({"metadata": {"finalizers": ["a", "b"], "labels": {"x": "1", "y": "2"}},
                             "spec": {"containers": [{"name": "c"}]}});
        let patch = json!({
            "$setElementOrder/finalizers": ["a"],
            "metadata": {"$deleteFromPrimitiveList/finalizers": ["b"], "labels": {"$patch": "replace", "z": "3"}},
            "spec": {"containers": [{"$patch": "replace"}, {"name": "d"}]}
        });
        strategic_merge(&mut doc, &patch, &pods()).expect("applies");
        assert_eq!(doc["metadata"]["finalizers"], json!(["a"]));
        assert_eq!(doc["metadata"]["labels"], json!({"z": "3"}));
        assert_eq!(doc["spec"]["containers"], json!([{"name": "d"}]));
        let e = strategic_merge(
            &mut doc,
            &json!({"spec": {"containers": [{"image": "x"}]}}),
            &pods(),
        )
        .expect_err("missing merge key");
        assert_eq!(e.code, 422);
    }

    #[test]
    fn strategic_refused_for_custom_resources() {
        let def = ResourceDef::tee_capacities();
        let e = strategic_merge(&mut json!({}), &json!({}), &def).expect_err("415");
        assert_eq!(e.code, 415);
    }
}
