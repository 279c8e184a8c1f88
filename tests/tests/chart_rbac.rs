//! The chart's ClusterRoles and Roles grant exactly the API calls the code makes: nothing missing (the
//! binaries would fail with 403) and nothing extra (least privilege). The agents' heartbeat Leases live
//! in the release namespace: those calls are granted by a Role there, everything else by a ClusterRole.
//!
//! "What the code makes" is recorded, not written down: the standalone scenario runs the real webhook and
//! the real agent against the fake API server, each with its own kube client tagged by `User-Agent`, and
//! every request the server received is mapped to its RBAC terms (verb, group, resource[/subresource]).
//! Each component's calls must be granted by the ClusterRole bound to its ServiceAccount, and each rule
//! granted must be either recorded or listed in [`NOT_EXERCISED`] with the code path that needs it.
//!
//! Needs `TEEGUARD_HELM` (set by `scripts/chart-tools.sh`, which `scripts/test.sh` sources).

mod chart_support;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::OnceLock;
use std::time::Duration;

use chart_support::*;
use serde_json::Value;
use teeguard_tests::fakeapi::{RecordedRequest, Verb};
use teeguard_tests::standalone::cluster::{AGENT_USER_AGENT, WEBHOOK_USER_AGENT};
use teeguard_tests::standalone::{Standalone, StandaloneOptions, run_scenario};

/// One permission: (verb, API group, resource, subresource; `""` for none).
type Access = (String, String, String, String);

/// Resources the binaries use only in their own (the release's) namespace, granted by a Role there.
const OWN_NAMESPACE: &[(&str, &str)] = &[("coordination.k8s.io", "leases")];

fn in_own_namespace(group: &str, resource: &str) -> bool {
    OWN_NAMESPACE.contains(&(group, resource))
}

/// A rule the chart grants that the recorded scenario does not exercise, and the code path that needs it.
struct NotExercised {
    component: &'static str,
    verb: &'static str,
    group: &'static str,
    resource: &'static str,
    subresource: &'static str,
    why: &'static str,
}

/// Granted for a code path the scenario does not (or not always) exercise: kept as small as honest. The
/// cache-miss GETs depend on whether a reflector saw the object before the review came; a run may or may
/// not record them. The test fails when an entry is not granted (stale).
const NOT_EXERCISED: &[NotExercised] = &[
    NotExercised {
        component: WEBHOOK_USER_AGENT,
        verb: "patch",
        group: "kubevirt.io",
        resource: "virtualmachineinstances",
        subresource: "",
        why: "webhook/src/cluster/retry.rs: the teeguard.dev/retried-at annotation on a VMI whose launcher pod was \
              refused, once a key is free; the standalone has no virt-controller to write the refusal on the VMI \
              (tests/tests/kubevirt_nodes.rs runs KubeVirt's own)",
    },
    NotExercised {
        component: AGENT_USER_AGENT,
        verb: "list",
        group: "",
        resource: "namespaces",
        subresource: "",
        why: "agent/src/cluster/watch.rs Watches::exempt_namespaces: strict mode only (the standalone runs without it; \
              tests/tests/e2e_enforcement.rs strict_mode_leaves_the_pods_of_an_exempt_namespace_alone does)",
    },
    NotExercised {
        component: AGENT_USER_AGENT,
        verb: "watch",
        group: "",
        resource: "namespaces",
        subresource: "",
        why: "agent/src/cluster/watch.rs Watches::exempt_namespaces: strict mode only",
    },
    NotExercised {
        component: WEBHOOK_USER_AGENT,
        verb: "get",
        group: "teeguard.dev",
        resource: "teereservations",
        subresource: "",
        why: "webhook/src/cluster/reservations.rs: GET of a node's TeeReservation after a write lost a race \
              (409 Conflict); the standalone's admissions do not race (tests/tests/e2e_replicas.rs does)",
    },
    NotExercised {
        component: WEBHOOK_USER_AGENT,
        verb: "update",
        group: "teeguard.dev",
        resource: "teereservations",
        subresource: "",
        why: "webhook/src/cluster/holds.rs: a node's TeeReservation written again (the decider's next batch \
              of holds written behind); whether the standalone's holds on a node fall into one batch or two \
              is a race (tests/tests/e2e_replicas.rs writes many)",
    },
    NotExercised {
        component: AGENT_USER_AGENT,
        verb: "get",
        group: "",
        resource: "pods",
        subresource: "",
        why: "agent/src/enforce/containers.rs: GET at NRI CreateContainer of an annotated pod the watch cache \
              does not know yet; the standalone has no container runtime (tests/tests/e2e_enforcement.rs \
              drives NRI)",
    },
    NotExercised {
        component: AGENT_USER_AGENT,
        verb: "create",
        group: "events.k8s.io",
        resource: "events",
        subresource: "",
        why: "agent/src/cluster/events.rs: Warning Event on a pod whose limit disagreed with its annotation \
              or could not be written; the standalone's limits all apply",
    },
    NotExercised {
        component: AGENT_USER_AGENT,
        verb: "patch",
        group: "events.k8s.io",
        resource: "events",
        subresource: "",
        why: "agent/src/cluster/events.rs: kube's Recorder patches a repeated Event into a series",
    },
    NotExercised {
        component: WEBHOOK_USER_AGENT,
        verb: "get",
        group: "kubevirt.io",
        resource: "virtualmachineinstances",
        subresource: "",
        why: "webhook/src/cluster/caches/mod.rs vmi: GET on /mutate when the pod's VMI is not cached yet (or has \
              another UID); the scenario sends the pod right after creating the VMI, so whether the \
              reflector already has it is a race",
    },
    NotExercised {
        component: WEBHOOK_USER_AGENT,
        verb: "get",
        group: "",
        resource: "namespaces",
        subresource: "",
        why: "webhook/src/cluster/caches/mod.rs namespace_labels: GET when the namespace is not in the reflector's \
              cache yet (the scenario's namespace exists before the webhook starts)",
    },
    NotExercised {
        component: WEBHOOK_USER_AGENT,
        verb: "get",
        group: "",
        resource: "pods",
        subresource: "",
        why: "webhook/src/cluster/caches/mod.rs launcher_pod: GET on pods/binding when the pod is not cached yet or \
              the cached one has another UID (the scenario binds after the pod reached the cache)",
    },
    NotExercised {
        component: WEBHOOK_USER_AGENT,
        verb: "patch",
        group: "events.k8s.io",
        resource: "events",
        subresource: "",
        why: "webhook/src/cluster/events.rs: kube's Recorder merge-patches a repeat of the same Event within its \
              6-minute cache (a VMI refused again after EVENT_MIN_INTERVAL, 30 s); the scenario is shorter, \
              so only creates go out",
    },
];

/// The whole scenario's bound: a hung run fails the test instead of CI.
const SCENARIO_DEADLINE: Duration = Duration::from_secs(120);

/// What each component called, by `User-Agent`, with one example request per permission (for messages).
#[derive(Debug, Default)]
struct Recorded {
    by_component: BTreeMap<String, BTreeMap<Access, String>>,
}

impl Recorded {
    fn of(&self, user_agent: &str) -> BTreeSet<Access> {
        self.by_component
            .get(user_agent)
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    }
}

fn access(verb: &str, group: &str, resource: &str, subresource: &str) -> Access {
    (
        verb.into(),
        group.into(),
        resource.into(),
        subresource.into(),
    )
}

/// The RBAC permissions one request needs. A server-side apply that created its object (201) is also
/// authorized as `create` by kube-apiserver.
fn needs(r: &RecordedRequest) -> Result<Vec<Access>, String> {
    let resource = r
        .resource
        .clone()
        .ok_or_else(|| format!("{} {}: not a resource request", r.method, r.path))?;
    let sub = r.subresource.clone().unwrap_or_default();
    let verb = match r.verb {
        Verb::Get
        | Verb::List
        | Verb::Watch
        | Verb::Create
        | Verb::Update
        | Verb::Patch
        | Verb::Delete
        | Verb::DeleteCollection => r.verb.as_str(),
        Verb::Discovery | Verb::Other => {
            return Err(format!(
                "{} {}: no RBAC rule of the chart covers it",
                r.method, r.path
            ));
        }
    };
    // A request for one object (a GET, an update) can be granted by a rule naming it: `resource#name`.
    let named = matches!(
        r.verb,
        Verb::Get | Verb::Update | Verb::Patch | Verb::Delete
    );
    let one = match r.name.as_deref() {
        Some(name) if named && sub.is_empty() => format!("{resource}#{name}"),
        _ => resource.clone(),
    };
    let mut out = vec![access(verb, &r.group, &one, &sub)];
    let apply = r
        .content_type
        .as_deref()
        .is_some_and(|c| c.starts_with("application/apply-patch"));
    if r.verb == Verb::Patch && apply && r.response_code == Some(201) {
        out.push(access("create", &r.group, &resource, &sub));
    }
    Ok(out)
}

/// Group the requests by component; requests from anyone else or with no RBAC equivalent are errors.
fn classify(requests: &[RecordedRequest]) -> Result<Recorded, Vec<String>> {
    let mut rec = Recorded::default();
    let mut errors = Vec::new();
    for r in requests {
        let ua = r.user_agent.clone().unwrap_or_default();
        if ua != WEBHOOK_USER_AGENT && ua != AGENT_USER_AGENT {
            errors.push(format!(
                "{} {} from unknown user agent {ua:?}",
                r.method, r.path
            ));
            continue;
        }
        match needs(r) {
            Ok(list) => {
                let calls = rec.by_component.entry(ua).or_default();
                for a in list {
                    calls
                        .entry(a)
                        .or_insert_with(|| format!("{} {}", r.method, r.path));
                }
            }
            Err(e) => errors.push(e),
        }
    }
    if errors.is_empty() {
        Ok(rec)
    } else {
        Err(errors)
    }
}

/// Run the standalone scenario once (shared by the tests of this binary) and classify what it called.
fn recorded() -> &'static Recorded {
    static RECORDED: OnceLock<Recorded> = OnceLock::new();
    RECORDED.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let requests = rt.block_on(async {
            let opts = StandaloneOptions {
                port: 0,
                ..StandaloneOptions::default()
            };
            let mut sa = tokio::time::timeout(SCENARIO_DEADLINE, Standalone::start(&opts))
                .await
                .expect("standalone started in time")
                .expect("standalone starts");
            let run =
                tokio::time::timeout(SCENARIO_DEADLINE, run_scenario(&sa, &mut std::io::sink()))
                    .await;
            // The agent's heartbeat Lease is created at its first heartbeat with nothing changing
            // (1 s in the standalone): wait for it, so its create and patch are always recorded.
            let lease = sa
                .api
                .wait_for(
                    SCENARIO_DEADLINE,
                    "the agent's heartbeat Lease created",
                    |api| {
                        api.requests_where(|r| {
                            r.resource.as_deref() == Some("leases")
                                && r.user_agent.as_deref() == Some(AGENT_USER_AGENT)
                                && r.response_code == Some(201)
                        })
                        .into_iter()
                        .next()
                    },
                )
                .await;
            sa.stop().await;
            lease.expect("the agent heartbeats with its Lease");
            let report = run.expect("scenario ended in time").expect("scenario runs");
            // The run must have exercised the interesting paths: denials (Events) and bindings.
            assert!(
                report.pod_denials > 0 && report.binding_denials > 0 && report.patched > 0,
                "the scenario no longer covers denials and patches: {report:?}"
            );
            sa.api.requests()
        });
        classify(&requests).unwrap_or_else(|errors| {
            panic!(
                "requests the chart's RBAC cannot account for:\n{}",
                errors.join("\n")
            )
        })
    })
}

/// Every (verb, group, resource, subresource) a rendered ClusterRole grants; a rule with
/// `resourceNames` grants `resource#name` for each name.
fn granted(role: &Value) -> BTreeSet<Access> {
    let mut set = BTreeSet::new();
    for rule in role["rules"].as_array().expect("rules") {
        assert!(
            rule.get("nonResourceURLs").is_none(),
            "no non-resource URLs: {rule}"
        );
        let names = match rule.get("resourceNames") {
            Some(_) => strings(rule, "resourceNames"),
            None => vec![String::new()],
        };
        for group in strings(rule, "apiGroups") {
            for resource in strings(rule, "resources") {
                for verb in strings(rule, "verbs") {
                    assert!(
                        group != "*" && resource != "*" && verb != "*" && !resource.ends_with("/*"),
                        "wildcards are not least privilege: {rule}"
                    );
                    let (res, sub) = resource.split_once('/').unwrap_or((&resource, ""));
                    for name in &names {
                        let res = match name.as_str() {
                            "" => res.to_string(),
                            name => format!("{res}#{name}"),
                        };
                        set.insert(access(&verb, &group, &res, sub));
                    }
                }
            }
        }
    }
    set
}

/// The grant a call uses: the rule naming its object, else the rule for every object of its kind.
fn grant_used(have: &BTreeSet<Access>, call: &Access) -> Option<Access> {
    if have.contains(call) {
        return Some(call.clone());
    }
    let (verb, group, resource, sub) = call;
    let plain = access(
        verb,
        group,
        resource.split('#').next().unwrap_or(resource),
        sub,
    );
    have.contains(&plain).then_some(plain)
}

/// The ClusterRole (or, with `namespaced`, the Role in the release namespace) bound to the
/// ServiceAccount the component's workload runs as.
fn role_of<'a>(docs: &'a [Value], kind: &str, workload: &str, namespaced: bool) -> &'a Value {
    let (binding_kind, role_kind) = if namespaced {
        ("RoleBinding", "Role")
    } else {
        ("ClusterRoleBinding", "ClusterRole")
    };
    let sa = find(docs, kind, workload)["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .unwrap_or_else(|| panic!("{kind} {workload} names no serviceAccountName"))
        .to_string();
    let bindings: Vec<&Value> = all(docs, binding_kind)
        .into_iter()
        .filter(|b| {
            b["subjects"].as_array().is_some_and(|s| {
                s.iter().any(|s| {
                    s["kind"] == "ServiceAccount"
                        && s["name"] == sa.as_str()
                        && s["namespace"] == NAMESPACE
                })
            })
        })
        .collect();
    assert_eq!(bindings.len(), 1, "one {binding_kind} for {sa}");
    assert_eq!(bindings[0]["roleRef"]["kind"], role_kind);
    let role = bindings[0]["roleRef"]["name"]
        .as_str()
        .expect("roleRef.name");
    let found = find(docs, role_kind, role);
    if namespaced {
        assert_eq!(
            (
                bindings[0]["metadata"]["namespace"].as_str(),
                found["metadata"]["namespace"].as_str()
            ),
            (Some(NAMESPACE), Some(NAMESPACE)),
            "{role_kind} {role} and its binding live in the release namespace"
        );
    }
    found
}

/// Compare a role with what `component` called plus its [`NOT_EXERCISED`] entries, in the role's scope
/// (its own namespace with `namespaced`, else cluster-wide).
fn compare(component: &str, role: &Value, called: &BTreeSet<Access>, namespaced: bool) {
    let own = |g: &str, r: &str| in_own_namespace(g, r.split('#').next().unwrap_or(r));
    let have = granted(role);
    let mut problems = Vec::new();
    let mut used = BTreeSet::new();
    for a in called.iter().filter(|(_, g, r, _)| own(g, r) == namespaced) {
        match grant_used(&have, a) {
            Some(grant) => {
                used.insert(grant);
            }
            None => problems.push(format!("missing (the call gets 403): {a:?}")),
        }
    }
    let called = &used;
    let mut allowed = BTreeSet::new();
    for n in NOT_EXERCISED
        .iter()
        .filter(|n| n.component == component && in_own_namespace(n.group, n.resource) == namespaced)
    {
        assert!(!n.why.is_empty());
        let a = access(n.verb, n.group, n.resource, n.subresource);
        if !have.contains(&a) {
            problems.push(format!("NOT_EXERCISED entry is not granted (stale): {a:?}"));
        }
        allowed.insert(a);
    }
    for a in have.difference(called) {
        if !allowed.contains(a) {
            problems.push(format!("extra (never called, not least privilege): {a:?}"));
        }
    }
    assert!(
        problems.is_empty(),
        "{} of {component} differs from its recorded calls (verb, group, resource, subresource):\n{}",
        if namespaced { "Role" } else { "ClusterRole" },
        problems.join("\n")
    );
}

#[test]
fn cluster_roles_grant_exactly_what_the_recorded_run_called() {
    let rec = recorded();
    let webhook_calls = rec.of(WEBHOOK_USER_AGENT);
    let agent_calls = rec.of(AGENT_USER_AGENT);
    for (ua, calls) in &rec.by_component {
        eprintln!("{ua} called:");
        for (a, example) in calls {
            eprintln!("  {a:?}  e.g. {example}");
        }
    }
    assert!(
        !webhook_calls.is_empty() && !agent_calls.is_empty(),
        "both components must have called the API: {rec:?}"
    );
    for stem in VALUES_FILES {
        let docs = render(stem, &[]);
        assert_eq!(
            all(&docs, "ClusterRole").len(),
            2,
            "{stem}: one ClusterRole per binary"
        );
        let prefix = if stem == "custom" { "tg" } else { "teeguard" };
        for namespaced in [false, true] {
            compare(
                WEBHOOK_USER_AGENT,
                role_of(
                    &docs,
                    "Deployment",
                    &format!("{prefix}-webhook"),
                    namespaced,
                ),
                &webhook_calls,
                namespaced,
            );
            compare(
                AGENT_USER_AGENT,
                role_of(&docs, "DaemonSet", &format!("{prefix}-agent"), namespaced),
                &agent_calls,
                namespaced,
            );
        }
        assert_eq!(
            (all(&docs, "Role").len(), all(&docs, "RoleBinding").len()),
            (2, 2),
            "{stem}: one Role (the heartbeat Leases) per binary"
        );
    }
}

#[test]
fn comparison_catches_missing_and_extra_rules() {
    // The comparison above can fail: a role with a recorded rule dropped and an unused one added differs
    // both ways.
    let agent_calls = recorded().of(AGENT_USER_AGENT);
    let docs = render("default", &[]);
    let mut role = role_of(&docs, "DaemonSet", "teeguard-agent", false).clone();
    let rules = role["rules"].as_array_mut().expect("rules");
    rules.retain(|r| r["resources"] != serde_json::json!(["nodes/status"]));
    rules.push(serde_json::json!({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}));
    // The comparison's panic message, which must exist (`role` must not match).
    let mismatch = |role: &Value, namespaced: bool| -> String {
        *std::panic::catch_unwind(|| compare(AGENT_USER_AGENT, role, &agent_calls, namespaced))
            .expect_err("a changed role must not match")
            .downcast::<String>()
            .expect("panic message")
    };
    let message = mismatch(&role, false);
    assert!(message.contains("\"nodes\", \"status\""), "{message}");
    assert!(message.contains("\"secrets\""), "{message}");
    // The same for the namespaced Role: without the Lease rule, the heartbeat gets 403.
    let mut role = role_of(&docs, "DaemonSet", "teeguard-agent", true).clone();
    role["rules"] = serde_json::json!([]);
    let message = mismatch(&role, true);
    assert!(message.contains("\"leases#"), "{message}");
}

#[test]
fn requests_are_mapped_to_rbac_terms() {
    // An apply that created its object needs `create` too; one that updated it needs only `patch` (on
    // that object: a rule naming it grants it as well as one for every object of its kind); a request
    // from an untagged client is refused.
    let apply = |code: u16, ua: &str| RecordedRequest {
        seq: 1,
        method: "PATCH".into(),
        path: "/apis/teeguard.dev/v1alpha1/teecapacities/node-a".into(),
        query: vec![],
        verb: Verb::Patch,
        group: "teeguard.dev".into(),
        version: "v1alpha1".into(),
        resource: Some("teecapacities".into()),
        subresource: None,
        namespace: None,
        name: Some("node-a".into()),
        content_type: Some("application/apply-patch+yaml".into()),
        accept: None,
        user_agent: Some(ua.into()),
        field_manager: Some("teeguard-agent".into()),
        body: None,
        response_code: Some(code),
        received_at: std::time::Instant::now(),
    };
    let created = needs(&apply(201, AGENT_USER_AGENT)).expect("resource request");
    assert_eq!(
        created,
        vec![
            access("patch", "teeguard.dev", "teecapacities#node-a", ""),
            access("create", "teeguard.dev", "teecapacities", "")
        ]
    );
    let updated = needs(&apply(200, AGENT_USER_AGENT)).expect("resource request");
    assert_eq!(
        updated,
        vec![access("patch", "teeguard.dev", "teecapacities#node-a", "")]
    );
    let errors = classify(&[apply(200, "kube-rs")]).expect_err("untagged client");
    assert!(errors[0].contains("kube-rs"), "{errors:?}");
}
