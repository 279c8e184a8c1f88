//! The chart's ClusterRoles grant exactly the API calls the code makes: nothing missing (the binaries would
//! fail with 403) and nothing extra (least privilege).
//!
//! The tables below list each call with the code path that makes it. A later task replaces or augments them
//! with the calls the fake API server records during the end-to-end tests.
//!
//! Needs `TEEGUARD_HELM` (set by `scripts/chart-tools.sh`, which `scripts/test.sh` sources).

mod chart_support;

use std::collections::BTreeSet;

use chart_support::*;
use serde_json::Value;

/// One permission: (verb, API group, resource, subresource).
type Access = (&'static str, &'static str, &'static str, &'static str);

/// An API call a binary makes and the code path that makes it.
struct Call {
    verbs: &'static [&'static str],
    group: &'static str,
    resource: &'static str,
    subresource: &'static str,
    why: &'static str,
}

const WATCH: &[&str] = &["get", "list", "watch"];

/// What teeguard-webhook calls.
const WEBHOOK_CALLS: &[Call] = &[
    Call {
        verbs: WATCH,
        group: "kubevirt.io",
        resource: "virtualmachineinstances",
        subresource: "",
        why: "webhook/src/caches.rs: VMI reflector + GET on a cache miss; launchSecurity gives the TEE kind",
    },
    Call {
        verbs: WATCH,
        group: "",
        resource: "namespaces",
        subresource: "",
        why: "webhook/src/caches.rs: namespace metadata reflector + GET on a miss (exempt and mode labels)",
    },
    Call {
        verbs: WATCH,
        group: "teeguard.dev",
        resource: "teecapacities",
        subresource: "",
        why: "webhook /validate (pods and bindings): TeeCapacity cache, free keys per node",
    },
    Call {
        verbs: WATCH,
        group: "",
        resource: "nodes",
        subresource: "",
        why: "webhook /validate on pod CREATE: node metadata cache, which nodes can run the pod",
    },
    Call {
        verbs: WATCH,
        group: "",
        resource: "pods",
        subresource: "",
        why: "webhook /validate on pods/binding: pod cache + GET of the pod (a Binding has only the name)",
    },
    Call {
        verbs: &["create", "patch"],
        group: "events.k8s.io",
        resource: "events",
        subresource: "",
        why: "webhook/src/events.rs: kube's Recorder (events.k8s.io/v1; create, then a merge patch for a \
              repeat): InsufficientTEEKeys on the VMI",
    },
];

/// What teeguard-agent calls.
const AGENT_CALLS: &[Call] = &[
    Call {
        verbs: &["list", "watch"],
        group: "",
        resource: "pods",
        subresource: "",
        why: "agent/src/pods.rs watch_pods: reflector, field selector spec.nodeName=$NODE_NAME",
    },
    Call {
        verbs: &["list", "watch", "patch"],
        group: "",
        resource: "nodes",
        subresource: "",
        why: "agent/src/pods.rs watch_node (reflector, metadata.name=$NODE_NAME); agent/src/advertise.rs \
              apply: merge patch of the teeguard.dev/extended-resources annotation",
    },
    Call {
        verbs: &["patch"],
        group: "",
        resource: "nodes",
        subresource: "status",
        why: "agent/src/advertise.rs apply: JSON patch of status.capacity of the extended resources",
    },
    Call {
        verbs: &["create", "patch"],
        group: "teeguard.dev",
        resource: "teecapacities",
        subresource: "",
        why: "agent/src/publish.rs ensure: server-side apply of its node's TeeCapacity (an apply that \
              creates the object is also authorized as create)",
    },
    Call {
        verbs: &["patch"],
        group: "teeguard.dev",
        resource: "teecapacities",
        subresource: "status",
        why: "agent/src/publish.rs publish: server-side apply of the TeeCapacity status",
    },
];

fn required(calls: &[Call]) -> BTreeSet<Access> {
    let mut set = BTreeSet::new();
    for c in calls {
        assert!(!c.why.is_empty());
        for verb in c.verbs {
            set.insert((*verb, c.group, c.resource, c.subresource));
        }
    }
    set
}

fn strings(v: &Value, field: &str) -> Vec<String> {
    v[field]
        .as_array()
        .unwrap_or_else(|| panic!("rule without {field}: {v}"))
        .iter()
        .map(|s| s.as_str().expect("string").to_string())
        .collect()
}

/// Every (verb, group, resource, subresource) a rendered ClusterRole grants.
fn granted(role: &Value) -> BTreeSet<(String, String, String, String)> {
    let mut set = BTreeSet::new();
    for rule in role["rules"].as_array().expect("rules") {
        assert!(
            rule.get("nonResourceURLs").is_none(),
            "no non-resource URLs: {rule}"
        );
        assert!(
            rule.get("resourceNames").is_none(),
            "unexpected resourceNames: {rule}"
        );
        for group in strings(rule, "apiGroups") {
            for resource in strings(rule, "resources") {
                for verb in strings(rule, "verbs") {
                    assert!(
                        group != "*" && resource != "*" && verb != "*" && !resource.ends_with("/*"),
                        "wildcards are not least privilege: {rule}"
                    );
                    let (res, sub) = resource.split_once('/').unwrap_or((&resource, ""));
                    set.insert((
                        verb.clone(),
                        group.clone(),
                        res.to_string(),
                        sub.to_string(),
                    ));
                }
            }
        }
    }
    set
}

fn compare(role_name: &str, role: &Value, calls: &[Call]) {
    let want: BTreeSet<(String, String, String, String)> = required(calls)
        .into_iter()
        .map(|(v, g, r, s)| (v.into(), g.into(), r.into(), s.into()))
        .collect();
    let have = granted(role);
    let missing: Vec<_> = want.difference(&have).collect();
    let extra: Vec<_> = have.difference(&want).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "ClusterRole {role_name} differs from the calls the code makes (verb, group, resource, subresource):\n\
         missing (the binary would get 403): {missing:?}\n\
         extra (not least privilege): {extra:?}"
    );
}

#[test]
fn cluster_roles_grant_exactly_what_the_code_calls() {
    for stem in VALUES_FILES {
        let docs = render(stem, &[]);
        let roles = all(&docs, "ClusterRole");
        assert_eq!(roles.len(), 2, "{stem}: one ClusterRole per binary");
        let prefix = if stem == "custom" { "tg" } else { "teeguard" };
        let webhook = format!("{prefix}-webhook");
        let agent = format!("{prefix}-agent");
        compare(
            &webhook,
            find(&docs, "ClusterRole", &webhook),
            WEBHOOK_CALLS,
        );
        compare(&agent, find(&docs, "ClusterRole", &agent), AGENT_CALLS);
        // No namespaced Roles: everything the binaries read or write is cluster-wide or in any namespace.
        assert!(all(&docs, "Role").is_empty() && all(&docs, "RoleBinding").is_empty());
    }
}

#[test]
fn comparison_catches_missing_and_extra_rules() {
    // The comparison above can fail: a role with one rule dropped and one added differs both ways.
    let docs = render("default", &[]);
    let mut role = find(&docs, "ClusterRole", "teeguard-agent").clone();
    let rules = role["rules"].as_array_mut().expect("rules");
    rules.remove(0);
    rules.push(serde_json::json!({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}));
    let result = std::panic::catch_unwind(|| compare("teeguard-agent", &role, AGENT_CALLS));
    let message = *result
        .expect_err("a changed role must not match")
        .downcast::<String>()
        .expect("panic message");
    assert!(message.contains("\"pods\""), "{message}");
    assert!(message.contains("\"secrets\""), "{message}");
}

#[test]
fn each_role_is_bound_to_the_service_account_its_workload_runs_as() {
    for stem in VALUES_FILES {
        let docs = render(stem, &[]);
        let prefix = if stem == "custom" { "tg" } else { "teeguard" };
        for (component, kind) in [("webhook", "Deployment"), ("agent", "DaemonSet")] {
            let name = format!("{prefix}-{component}");
            let binding = find(&docs, "ClusterRoleBinding", &name);
            assert_eq!(binding["roleRef"]["kind"], "ClusterRole");
            assert_eq!(binding["roleRef"]["name"], name.as_str());
            let subjects = binding["subjects"].as_array().expect("subjects");
            assert_eq!(subjects.len(), 1, "{stem} {name}");
            let workload = find(&docs, kind, &name);
            assert_eq!(subjects[0]["kind"], "ServiceAccount");
            assert_eq!(
                subjects[0]["name"], workload["spec"]["template"]["spec"]["serviceAccountName"],
                "{stem} {name}"
            );
            assert_eq!(subjects[0]["namespace"], NAMESPACE);
        }
    }
}
