//! Which nodes a pod may be scheduled to by its labels: `spec.nodeSelector` and required node affinity
//! (`requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms`), with the scheduler's semantics.
//! Pure: the caller passes each node's name and labels.
//!
//! - `nodeSelector`: every `key: value` must be a label of the node.
//! - `nodeSelectorTerms` are ORed; within a term `matchExpressions` and `matchFields` are ANDed. An empty
//!   term, or an empty list of terms, matches no node.
//! - Operators: `In`, `NotIn` (also true when the label is absent), `Exists`, `DoesNotExist`, `Gt`, `Lt`
//!   (one value; label and value both parse as 64-bit integers). `matchFields` supports only
//!   `metadata.name` with `In`/`NotIn` and exactly one value.
//! - A malformed requirement (unknown operator, wrong number of values, non-integer `Gt`/`Lt` value)
//!   makes its term match nothing, as the scheduler treats a term it cannot parse.
//!
//! Taints, `spec.unschedulable` and resources other than TEE keys are not considered: the webhook's node
//! cache holds metadata only.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{NodeSelectorRequirement, NodeSelectorTerm, PodSpec};

/// The field key `matchFields` supports.
pub const NODE_NAME_FIELD: &str = "metadata.name";

/// Whether a pod with `spec` may run on the node `name` with `labels`, by node selector and required
/// node affinity.
pub fn node_matches(spec: &PodSpec, name: &str, labels: &BTreeMap<String, String>) -> bool {
    if let Some(selector) = &spec.node_selector
        && !selector.iter().all(|(k, v)| labels.get(k) == Some(v))
    {
        return false;
    }
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|n| {
            n.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    match required {
        None => true,
        Some(sel) => sel
            .node_selector_terms
            .iter()
            .any(|t| term_matches(t, name, labels)),
    }
}

/// Whether one node selector term matches: every expression and every field requirement holds. A term
/// with neither matches nothing.
pub fn term_matches(
    term: &NodeSelectorTerm,
    name: &str,
    labels: &BTreeMap<String, String>,
) -> bool {
    let exprs = term.match_expressions.as_deref().unwrap_or(&[]);
    let fields = term.match_fields.as_deref().unwrap_or(&[]);
    if exprs.is_empty() && fields.is_empty() {
        return false;
    }
    exprs.iter().all(|r| requirement_matches(r, labels))
        && fields.iter().all(|r| field_matches(r, name))
}

/// Whether a label requirement holds for `labels`; `false` for a malformed requirement.
pub fn requirement_matches(
    req: &NodeSelectorRequirement,
    labels: &BTreeMap<String, String>,
) -> bool {
    let values = req.values.as_deref().unwrap_or(&[]);
    let label = labels.get(&req.key);
    match req.operator.as_str() {
        "In" => !values.is_empty() && label.is_some_and(|l| values.contains(l)),
        "NotIn" => !values.is_empty() && label.is_none_or(|l| !values.contains(l)),
        "Exists" => values.is_empty() && label.is_some(),
        "DoesNotExist" => values.is_empty() && label.is_none(),
        op @ ("Gt" | "Lt") => {
            let [bound] = values else {
                return false;
            };
            let (Ok(bound), Some(Ok(value))) = (
                bound.trim().parse::<i64>(),
                label.map(|l| l.trim().parse::<i64>()),
            ) else {
                return false;
            };
            if op == "Gt" {
                value > bound
            } else {
                value < bound
            }
        }
        _ => false,
    }
}

/// Whether a `matchFields` requirement holds for the node `name`; only `metadata.name` with `In`/`NotIn`
/// and exactly one value is valid.
pub fn field_matches(req: &NodeSelectorRequirement, name: &str) -> bool {
    if req.key != NODE_NAME_FIELD {
        return false;
    }
    let [value] = req.values.as_deref().unwrap_or(&[]) else {
        return false;
    };
    match req.operator.as_str() {
        "In" => value == name,
        "NotIn" => value != name,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect()
    }

    fn req(key: &str, op: &str, values: &[&str]) -> NodeSelectorRequirement {
        NodeSelectorRequirement {
            key: key.into(),
            operator: op.into(),
            values: if values.is_empty() {
                None
            } else {
                Some(values.iter().map(|v| (*v).to_string()).collect())
            },
        }
    }

    fn spec(v: Value) -> PodSpec {
        let mut v = v;
        v["containers"] = json!([{"name": "c"}]);
        serde_json::from_value(v).expect("pod spec")
    }

    #[test]
    fn every_operator() {
        let node = labels(&[("zone", "a"), ("gen", "4"), ("tdx", "true"), ("neg", "-3")]);
        // (requirement, matches)
        let cases = [
            (req("zone", "In", &["a", "b"]), true),
            (req("zone", "In", &["b"]), false),
            (req("missing", "In", &["a"]), false),
            (req("zone", "In", &[]), false),
            (req("zone", "NotIn", &["b", "c"]), true),
            (req("zone", "NotIn", &["a"]), false),
            (req("missing", "NotIn", &["a"]), true),
            (req("zone", "NotIn", &[]), false),
            (req("tdx", "Exists", &[]), true),
            (req("missing", "Exists", &[]), false),
            (req("tdx", "Exists", &["true"]), false),
            (req("missing", "DoesNotExist", &[]), true),
            (req("tdx", "DoesNotExist", &[]), false),
            (req("missing", "DoesNotExist", &["x"]), false),
            (req("gen", "Gt", &["3"]), true),
            (req("gen", "Gt", &["4"]), false),
            (req("gen", "Gt", &["-10"]), true),
            (req("neg", "Gt", &["-4"]), true),
            (req("gen", "Lt", &["5"]), true),
            (req("gen", "Lt", &["4"]), false),
            (req("neg", "Lt", &["0"]), true),
            (req("gen", "Gt", &["x"]), false),
            (req("gen", "Gt", &["1", "2"]), false),
            (req("gen", "Gt", &[]), false),
            (req("zone", "Gt", &["1"]), false),
            (req("missing", "Lt", &["1"]), false),
            (req("zone", "Equals", &["a"]), false),
            (req("zone", "in", &["a"]), false),
        ];
        for (r, want) in cases {
            assert_eq!(requirement_matches(&r, &node), want, "{r:?}");
        }
    }

    #[test]
    fn match_fields_on_node_name() {
        let cases = [
            (req("metadata.name", "In", &["node-a"]), true),
            (req("metadata.name", "In", &["node-b"]), false),
            (req("metadata.name", "NotIn", &["node-b"]), true),
            (req("metadata.name", "NotIn", &["node-a"]), false),
            (req("metadata.name", "In", &["node-a", "node-b"]), false),
            (req("metadata.name", "In", &[]), false),
            (req("metadata.name", "Exists", &[]), false),
            (req("metadata.uid", "In", &["node-a"]), false),
        ];
        for (r, want) in cases {
            assert_eq!(field_matches(&r, "node-a"), want, "{r:?}");
        }
    }

    #[test]
    fn terms_are_ored_expressions_anded() {
        let node = labels(&[("zone", "a"), ("tdx", "true")]);
        let both = NodeSelectorTerm {
            match_expressions: Some(vec![req("zone", "In", &["a"]), req("tdx", "Exists", &[])]),
            match_fields: Some(vec![req("metadata.name", "In", &["node-a"])]),
        };
        assert!(term_matches(&both, "node-a", &node));
        assert!(!term_matches(&both, "node-b", &node), "fields ANDed");
        let one_fails = NodeSelectorTerm {
            match_expressions: Some(vec![
                req("zone", "In", &["a"]),
                req("tdx", "DoesNotExist", &[]),
            ]),
            match_fields: None,
        };
        assert!(!term_matches(&one_fails, "node-a", &node));
        assert!(!term_matches(&NodeSelectorTerm::default(), "node-a", &node));
        let empty_lists = NodeSelectorTerm {
            match_expressions: Some(vec![]),
            match_fields: Some(vec![]),
        };
        assert!(!term_matches(&empty_lists, "node-a", &node));

        let s = spec(
            json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-a"]}]}
            ]}}}}),
        );
        assert!(node_matches(&s, "node-a", &node), "second term matches");
        assert!(!node_matches(&s, "node-c", &node));
        let s = spec(
            json!({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": []}}}}),
        );
        assert!(!node_matches(&s, "node-a", &node), "no terms: no node");
    }

    #[test]
    fn node_selector_and_affinity_combine() {
        let node = labels(&[("kubevirt.io/tdx", "true"), ("zone", "a")]);
        assert!(node_matches(&spec(json!({})), "n", &node));
        assert!(node_matches(&spec(json!({"nodeSelector": {}})), "n", &node));
        assert!(node_matches(
            &spec(json!({"nodeSelector": {"kubevirt.io/tdx": "true"}})),
            "n",
            &node
        ));
        assert!(!node_matches(
            &spec(json!({"nodeSelector": {"kubevirt.io/tdx": "false"}})),
            "n",
            &node
        ));
        assert!(!node_matches(
            &spec(json!({"nodeSelector": {"kubevirt.io/sev": "true"}})),
            "n",
            &node
        ));
        // Both must hold.
        let s = spec(json!({
            "nodeSelector": {"kubevirt.io/tdx": "true"},
            "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]}]}}}
        }));
        assert!(!node_matches(&s, "n", &node));
        // Preferred affinity and pod affinity are not requirements.
        let s = spec(json!({"affinity": {
            "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 1, "preference": {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z"]}]}}]},
            "podAntiAffinity": {}
        }}));
        assert!(node_matches(&s, "n", &node));
    }
}
