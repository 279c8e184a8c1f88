//! Scripted faults: rules matched against each request that answer with an error, hang or delay.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use super::record::RequestFilter;

/// The API verb of a request, derived from method and path like the real server's authorizer does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verb {
    /// GET of one object (or its subresource).
    Get,
    /// GET of a collection.
    List,
    /// GET of a collection with `watch=true`.
    Watch,
    /// POST (including `pods/binding`).
    Create,
    /// PUT.
    Update,
    /// PATCH of any type, including server-side apply.
    Patch,
    /// DELETE of one object.
    Delete,
    /// DELETE of a collection.
    DeleteCollection,
    /// `/api`, `/apis`, `/version` and friends.
    Discovery,
    /// Anything else.
    Other,
}

impl Verb {
    /// The lowercase verb name (`get`, `list`, `watch`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Get => "get",
            Self::List => "list",
            Self::Watch => "watch",
            Self::Create => "create",
            Self::Update => "update",
            Self::Patch => "patch",
            Self::Delete => "delete",
            Self::DeleteCollection => "deletecollection",
            Self::Discovery => "discovery",
            Self::Other => "other",
        }
    }
}

/// What a matching fault does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FaultAction {
    /// Answer with a `metav1.Status` failure with this HTTP code (and message).
    Respond {
        /// HTTP code, e.g. 500, 503, 409, 429.
        code: u16,
        /// Status message.
        message: String,
    },
    /// Do not answer until the rule is removed/cleared, or `max` elapsed; then serve normally.
    Hang {
        /// Longest hang; `None` = until cleared.
        max: Option<Duration>,
    },
    /// Wait this long, then serve normally.
    Delay(Duration),
}

/// How long a rule stays armed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultTimes {
    /// For this many matching requests.
    Times(u32),
    /// Until removed or cleared.
    UntilCleared,
    /// For this long after being added.
    For(Duration),
}

/// A fault rule: which requests (verb, resource, namespace, name, subresource; `None` matches anything) and
/// what happens to them.
///
/// ```ignore
/// server.add_fault(FaultRule::respond(503).verb(Verb::Patch).resource("teecapacities").subresource("status").times(2));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FaultRule {
    /// Which requests it applies to.
    pub filter: RequestFilter,
    /// What it does to them.
    pub action: FaultAction,
    /// How long it stays armed.
    pub times: FaultTimes,
}

impl FaultRule {
    fn with(action: FaultAction) -> Self {
        Self {
            filter: RequestFilter::new(),
            action,
            times: FaultTimes::UntilCleared,
        }
    }

    /// Answer matching requests with HTTP `code` and a `Status` body.
    pub fn respond(code: u16) -> Self {
        Self::with(FaultAction::Respond {
            code,
            message: format!("injected fault: HTTP {code}"),
        })
    }

    /// Hang matching requests until the rule is removed or all faults are cleared.
    pub fn hang() -> Self {
        Self::with(FaultAction::Hang { max: None })
    }

    /// Hang matching requests for at most `max` (earlier if cleared), then serve them.
    pub fn hang_for(max: Duration) -> Self {
        Self::with(FaultAction::Hang { max: Some(max) })
    }

    /// Delay matching requests by `d`.
    pub fn delay(d: Duration) -> Self {
        Self::with(FaultAction::Delay(d))
    }

    /// Only this verb.
    pub fn verb(mut self, v: Verb) -> Self {
        self.filter = self.filter.verb(v);
        self
    }

    /// Only this resource (plural).
    pub fn resource(mut self, r: &str) -> Self {
        self.filter = self.filter.resource(r);
        self
    }

    /// Only this namespace.
    pub fn namespace(mut self, ns: &str) -> Self {
        self.filter = self.filter.namespace(ns);
        self
    }

    /// Only this object name.
    pub fn name(mut self, n: &str) -> Self {
        self.filter = self.filter.name(n);
        self
    }

    /// Only this subresource (`""`: only the main resource).
    pub fn subresource(mut self, s: &str) -> Self {
        self.filter = self.filter.subresource(s);
        self
    }

    /// The `Status` message for [`FaultRule::respond`].
    pub fn message(mut self, m: &str) -> Self {
        if let FaultAction::Respond { message, .. } = &mut self.action {
            *message = m.to_string();
        }
        self
    }

    /// Armed for `n` matching requests.
    pub fn times(mut self, n: u32) -> Self {
        self.times = FaultTimes::Times(n);
        self
    }

    /// Armed for `d` from now.
    pub fn for_duration(mut self, d: Duration) -> Self {
        self.times = FaultTimes::For(d);
        self
    }

    pub(crate) fn matches(&self, r: &RequestKey<'_>) -> bool {
        self.filter.matches_key(r)
    }
}

/// The parts of a request filters match on.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RequestKey<'a> {
    pub verb: Verb,
    pub resource: Option<&'a str>,
    pub namespace: Option<&'a str>,
    pub name: Option<&'a str>,
    pub subresource: Option<&'a str>,
    /// `fieldManager` (faults do not match on it).
    pub field_manager: Option<&'a str>,
}

/// Handle of an added fault rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FaultId(pub(crate) u64);

#[derive(Debug)]
struct Armed {
    id: u64,
    rule: FaultRule,
    remaining: Option<u32>,
    expires: Option<Instant>,
}

/// The active rules, in the order added; the first matching rule wins.
#[derive(Debug, Default)]
pub(crate) struct FaultPlan {
    rules: Vec<Armed>,
    next_id: u64,
    /// Bumped by `clear`: releases every hung request.
    pub cleared_generation: u64,
    /// Rules removed explicitly: releases requests they hung.
    removed: HashSet<u64>,
}

impl FaultPlan {
    pub fn add(&mut self, rule: FaultRule) -> FaultId {
        self.next_id += 1;
        let (remaining, expires) = match rule.times {
            FaultTimes::Times(n) => (Some(n), None),
            FaultTimes::UntilCleared => (None, None),
            FaultTimes::For(d) => (None, Some(Instant::now() + d)),
        };
        self.rules.push(Armed {
            id: self.next_id,
            rule,
            remaining,
            expires,
        });
        FaultId(self.next_id)
    }

    pub fn remove(&mut self, id: FaultId) {
        self.rules.retain(|r| r.id != id.0);
        self.removed.insert(id.0);
    }

    pub fn clear(&mut self) {
        self.rules.clear();
        self.removed.clear();
        self.cleared_generation += 1;
    }

    pub fn is_released(&self, id: u64, generation: u64) -> bool {
        self.cleared_generation != generation || self.removed.contains(&id)
    }

    pub fn len(&self) -> usize {
        self.rules.len()
    }

    /// The action for a request, consuming one use of the matching rule.
    pub fn take(&mut self, r: &RequestKey<'_>) -> Option<(u64, FaultAction)> {
        let now = Instant::now();
        self.rules
            .retain(|a| a.expires.is_none_or(|e| e > now) && a.remaining != Some(0));
        let idx = self.rules.iter().position(|a| a.rule.matches(r))?;
        let armed = &mut self.rules[idx];
        let out = (armed.id, armed.rule.action.clone());
        if let Some(n) = &mut armed.remaining {
            *n -= 1;
            if *n == 0 {
                self.rules.remove(idx);
            }
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key<'a>(
        verb: Verb,
        resource: &'a str,
        name: Option<&'a str>,
        sub: Option<&'a str>,
    ) -> RequestKey<'a> {
        RequestKey {
            verb,
            resource: Some(resource),
            namespace: None,
            name,
            subresource: sub,
            field_manager: None,
        }
    }

    #[test]
    fn matching_and_counts() {
        let mut plan = FaultPlan::default();
        plan.add(
            FaultRule::respond(500)
                .verb(Verb::Patch)
                .resource("pods")
                .subresource("status")
                .times(2),
        );
        assert!(
            plan.take(&key(Verb::Patch, "pods", Some("a"), None))
                .is_none()
        );
        assert!(
            plan.take(&key(Verb::Get, "pods", Some("a"), Some("status")))
                .is_none()
        );
        assert!(
            plan.take(&key(Verb::Patch, "pods", Some("a"), Some("status")))
                .is_some()
        );
        assert!(
            plan.take(&key(Verb::Patch, "pods", Some("b"), Some("status")))
                .is_some()
        );
        assert!(
            plan.take(&key(Verb::Patch, "pods", Some("c"), Some("status")))
                .is_none()
        );
        assert_eq!(plan.len(), 0);

        let id = plan.add(FaultRule::respond(503).name("x"));
        assert!(
            plan.take(&key(Verb::Get, "nodes", Some("x"), None))
                .is_some()
        );
        assert!(
            plan.take(&key(Verb::Get, "nodes", Some("y"), None))
                .is_none()
        );
        plan.remove(id);
        assert!(
            plan.take(&key(Verb::Get, "nodes", Some("x"), None))
                .is_none()
        );
        assert!(plan.is_released(id.0, plan.cleared_generation));

        plan.add(FaultRule::respond(503).for_duration(Duration::ZERO));
        assert!(plan.take(&key(Verb::Get, "nodes", None, None)).is_none());
        let generation = plan.cleared_generation;
        plan.add(FaultRule::hang().subresource(""));
        assert!(
            plan.take(&key(Verb::Get, "nodes", None, Some("status")))
                .is_none()
        );
        assert!(plan.take(&key(Verb::Get, "nodes", None, None)).is_some());
        plan.clear();
        assert!(plan.is_released(99, generation));
    }
}
