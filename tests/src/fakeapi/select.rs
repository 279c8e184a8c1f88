//! Label and field selectors, parsed the way the real API server parses them.

use serde_json::Value;

use super::error::ApiStatus;

#[derive(Clone, Debug, PartialEq, Eq)]
enum LabelReq {
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
    Gt(String, i64),
    Lt(String, i64),
}

/// A parsed label selector (`a=b,c!=d,e in (f,g),h notin (i),j,!k`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LabelSelector(Vec<LabelReq>);

/// Splits at commas outside parentheses.
fn split_top(s: &str) -> Result<Vec<&str>, ApiStatus> {
    let mut out = Vec::new();
    let mut depth = 0i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth < 0 {
                    return Err(ApiStatus::bad_request(format!(
                        "unable to parse requirement: unbalanced ')' in {s:?}"
                    )));
                }
            }
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(ApiStatus::bad_request(format!(
            "unable to parse requirement: unbalanced '(' in {s:?}"
        )));
    }
    out.push(&s[start..]);
    Ok(out)
}

fn valid_label_key(k: &str) -> bool {
    !k.is_empty()
        && k.len() <= 317
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'))
}

fn valid_label_value(v: &str) -> bool {
    v.len() <= 63
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

fn bad_req(req: &str, why: &str) -> ApiStatus {
    ApiStatus::bad_request(format!("unable to parse requirement: {req:?}: {why}"))
}

fn parse_set(req: &str, rest: &str) -> Result<Vec<String>, ApiStatus> {
    let rest = rest.trim();
    let inner = rest
        .strip_prefix('(')
        .and_then(|r| r.strip_suffix(')'))
        .ok_or_else(|| bad_req(req, "expected a parenthesised value list"))?;
    let mut vals = Vec::new();
    for v in inner.split(',') {
        let v = v.trim();
        if !valid_label_value(v) {
            return Err(bad_req(req, "invalid label value"));
        }
        vals.push(v.to_string());
    }
    Ok(vals)
}

impl LabelSelector {
    /// Parses a selector; an empty string selects everything.
    pub fn parse(s: &str) -> Result<Self, ApiStatus> {
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(Self(reqs));
        }
        for raw in split_top(s)? {
            let r = raw.trim();
            if r.is_empty() {
                return Err(bad_req(raw, "empty requirement"));
            }
            if let Some(k) = r.strip_prefix('!') {
                let k = k.trim();
                if !valid_label_key(k) {
                    return Err(bad_req(r, "invalid label key"));
                }
                reqs.push(LabelReq::NotExists(k.to_string()));
                continue;
            }
            // Set-based: `key in (..)` / `key notin (..)`.
            let key_end = r
                .find(|c: char| c.is_whitespace() || matches!(c, '=' | '!' | '(' | '<' | '>'))
                .unwrap_or(r.len());
            let key = &r[..key_end];
            let rest = r[key_end..].trim_start();
            if !valid_label_key(key) {
                return Err(bad_req(r, "invalid label key"));
            }
            if rest.is_empty() {
                reqs.push(LabelReq::Exists(key.to_string()));
            } else if let Some(v) = rest.strip_prefix("notin") {
                reqs.push(LabelReq::NotIn(key.to_string(), parse_set(r, v)?));
            } else if let Some(v) = rest.strip_prefix("in") {
                reqs.push(LabelReq::In(key.to_string(), parse_set(r, v)?));
            } else {
                let (op, val) = if let Some(v) = rest.strip_prefix("==") {
                    ("=", v)
                } else if let Some(v) = rest.strip_prefix("!=") {
                    ("!=", v)
                } else if let Some(v) = rest.strip_prefix('=') {
                    ("=", v)
                } else if let Some(v) = rest.strip_prefix('>') {
                    (">", v)
                } else if let Some(v) = rest.strip_prefix('<') {
                    ("<", v)
                } else {
                    return Err(bad_req(r, "unknown operator"));
                };
                let val = val.trim();
                match op {
                    ">" | "<" => {
                        let n: i64 = val
                            .parse()
                            .map_err(|_| bad_req(r, "value must be an integer"))?;
                        reqs.push(if op == ">" {
                            LabelReq::Gt(key.to_string(), n)
                        } else {
                            LabelReq::Lt(key.to_string(), n)
                        });
                    }
                    _ => {
                        if !valid_label_value(val) {
                            return Err(bad_req(r, "invalid label value"));
                        }
                        reqs.push(if op == "=" {
                            LabelReq::Eq(key.to_string(), val.to_string())
                        } else {
                            LabelReq::NotEq(key.to_string(), val.to_string())
                        });
                    }
                }
            }
        }
        Ok(Self(reqs))
    }

    /// Whether the selector selects everything.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether an object (with `metadata.labels`) matches.
    pub fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels");
        let get = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        self.0.iter().all(|r| match r {
            LabelReq::Eq(k, v) => get(k) == Some(v.as_str()),
            LabelReq::NotEq(k, v) => get(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => get(k).is_some_and(|x| vs.iter().any(|v| v == x)),
            LabelReq::NotIn(k, vs) => get(k).is_none_or(|x| vs.iter().all(|v| v != x)),
            LabelReq::Exists(k) => get(k).is_some(),
            LabelReq::NotExists(k) => get(k).is_none(),
            LabelReq::Gt(k, n) => get(k)
                .and_then(|x| x.parse::<i64>().ok())
                .is_some_and(|x| x > *n),
            LabelReq::Lt(k, n) => get(k)
                .and_then(|x| x.parse::<i64>().ok())
                .is_some_and(|x| x < *n),
        })
    }
}

/// A parsed field selector (`metadata.name=x,spec.nodeName!=y`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FieldSelector(Vec<(String, bool, String)>);

impl FieldSelector {
    /// Parses a selector; `allowed` lists the field paths the resource supports (`None`: any path).
    pub fn parse(s: &str, allowed: Option<&[String]>) -> Result<Self, ApiStatus> {
        let mut reqs = Vec::new();
        if s.trim().is_empty() {
            return Ok(Self(reqs));
        }
        for raw in s.split(',') {
            let r = raw.trim();
            let (path, eq, val) = if let Some((p, v)) = r.split_once("!=") {
                (p, false, v)
            } else if let Some((p, v)) = r.split_once("==") {
                (p, true, v)
            } else if let Some((p, v)) = r.split_once('=') {
                (p, true, v)
            } else {
                return Err(ApiStatus::bad_request(format!(
                    "invalid selector: '{r}'; can't understand '{r}'"
                )));
            };
            let path = path.trim();
            if path.is_empty() {
                return Err(ApiStatus::bad_request(format!("invalid selector: '{r}'")));
            }
            if let Some(allowed) = allowed
                && !allowed.iter().any(|a| a == path)
            {
                return Err(ApiStatus::bad_request(format!(
                    "field label not supported: {path}"
                )));
            }
            reqs.push((path.to_string(), eq, val.trim().to_string()));
        }
        Ok(Self(reqs))
    }

    /// Whether the selector selects everything.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether an object matches; a missing field compares as `""`.
    pub fn matches(&self, obj: &Value) -> bool {
        self.0
            .iter()
            .all(|(path, eq, want)| (field_value(obj, path) == *want) == *eq)
    }

    /// The value an equality requirement (`path=value`) asks `path` to have, if there is one.
    pub fn required(&self, path: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(p, eq, _)| *eq && p == path)
            .map(|(_, _, v)| v.as_str())
    }
}

/// A field of an object as field selectors see it: strings as they are, other values as JSON, a
/// missing field or `null` as `""`.
pub(crate) fn field_value(obj: &Value, path: &str) -> String {
    let mut cur = Some(obj);
    for seg in path.split('.') {
        cur = cur.and_then(|c| c.get(seg));
    }
    match cur {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    }
}

/// Both selectors together.
#[derive(Clone, Debug, Default)]
pub struct Selectors {
    /// Label selector.
    pub labels: LabelSelector,
    /// Field selector.
    pub fields: FieldSelector,
}

impl Selectors {
    /// Whether nothing is filtered.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty() && self.fields.is_empty()
    }

    /// Whether the object matches both.
    pub fn matches(&self, obj: &Value) -> bool {
        self.labels.matches(obj) && self.fields.matches(obj)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(labels: Value) -> Value {
        json!({"metadata": {"name": "p", "labels": labels}, "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}})
    }

    #[test]
    fn label_operators() {
        let p = pod(json!({"app": "web", "tier": "front", "n": "5"}));
        let matching = [
            "",
            "app=web",
            "app==web",
            "app!=db",
            "app in (web, db)",
            "zone notin (a)",
            "app,tier",
            "!zone",
            "app=web,tier in (front),!zone",
            "n>4",
            "kubevirt.io/created-by notin (x)",
        ];
        let not_matching = [
            "app!=web",
            "app notin (web,db)",
            "!app",
            "app=web,tier=back",
            "n<4",
        ];
        let matches = |s: &str| LabelSelector::parse(s).expect("parses").matches(&p);
        for s in matching {
            assert!(matches(s), "{s:?} selects the pod");
        }
        for s in not_matching {
            assert!(!matches(s), "{s:?} does not select the pod");
        }
    }

    #[test]
    fn label_parse_errors() {
        for bad in ["app in web", "app=(", "=x", "a b", "app in (a", "x=a b"] {
            let e = LabelSelector::parse(bad).expect_err(bad);
            assert_eq!(e.code, 400, "{bad}");
        }
    }

    #[test]
    fn field_selectors() {
        let p = pod(json!({}));
        let ok = |s: &str| FieldSelector::parse(s, None).expect("parses").matches(&p);
        assert!(ok("metadata.name=p"));
        assert!(ok("spec.nodeName==n1,status.phase!=Pending"));
        assert!(!ok("spec.nodeName!=n1"));
        assert!(ok("spec.missing="));
        assert!(!ok("spec.missing=x"));
        let allowed = vec!["metadata.name".to_string()];
        assert_eq!(
            FieldSelector::parse("spec.nodeName=x", Some(&allowed))
                .expect_err("unsupported")
                .code,
            400
        );
        assert_eq!(
            FieldSelector::parse("nonsense", None)
                .expect_err("no operator")
                .code,
            400
        );
    }
}
