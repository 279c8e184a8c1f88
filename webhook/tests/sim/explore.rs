//! The model checker: every order of every step, from one start, in a world without time (each
//! watch delivers whenever, each component acts whenever it may). A watch delivers everything on its
//! way at once (a replica may be behind on a kind by any number of changes, and catches up to the API
//! server's current state). States reached twice are explored once (the world's fingerprint: what
//! decides the next steps). Replica 0 takes the decider Lease first and keeps it (with no time, a
//! Lease never runs out) unless it stops cleanly, as a rolling update stops it: it gives the Lease up
//! and any other replica may take it at any later step, whatever its watches have delivered by then
//! (the stopped one stays stopped: its replacement is one more fresh replica, which the crashes cover).
//! A replica crashes at any step (losing what it has not written) and restarts at any later step; the
//! Lease of a decider that crashed runs out at any later step ([`Action::LeaseRunsOut`], the one step
//! of time: the lease duration, 15 s, in which the agents publish and the live watches deliver; under
//! the holds' TTL, beyond the pod grace), and any replica may then take it. The decider writes its
//! holds behind at any step. Other time-bound rules (the TTL, a report gone stale) never fire here;
//! the timed runs cover them.

use std::collections::HashSet;

use super::check::Checks;
use super::world::{Action, Happened, KINDS, Spec, World};

/// What may be done, beyond the components' own steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Budget {
    /// VMIs a client may delete.
    pub deletions: u32,
    /// Replica crashes (each followed by a restart whenever).
    pub crashes: u32,
    /// Clean stops of the deciding replica (it stays stopped; another takes the Lease).
    pub stops: u32,
    /// Times a crashed decider's Lease may run out (the clock moves on by the lease duration), so
    /// that another replica, or the crashed one restarted, takes it over.
    pub lease_runs_out: u32,
}

/// What the exploration found.
#[derive(Debug, Default)]
pub struct Explored {
    /// States explored.
    pub states: usize,
    /// Quiet states (nothing left to do).
    pub quiet: usize,
    /// The first violation, with the steps that led to it.
    pub violation: Option<(String, Vec<Action>)>,
    /// Deepest path.
    pub depth: usize,
}

/// Every step possible in `w`.
pub fn enabled(w: &World, budget: Budget) -> Vec<Action> {
    let mut out = Vec::new();
    let t = w.truth();
    let alive: Vec<usize> = (0..w.replicas.len())
        .filter(|r| w.replicas[*r].alive)
        .collect();
    let again = |what: &str, r: usize| {
        w.refused_with.get(&(what.to_string(), r)) == Some(&w.index_fingerprint(r))
    };
    for (uid, v) in &t.vmis {
        if v.deleted_at.is_none() && v.pod.is_none() {
            for r in &alive {
                if !again(uid, *r) {
                    out.push(Action::Create(uid.clone(), *r));
                }
            }
        }
        // A client deletes a VMI that holds a key (its pod admitted, bound or running): the key
        // frees for the VMI waiting. (Deleting a waiting VMI ends its promise: the seeded runs.)
        if v.deleted_at.is_none() && v.pod.is_some() && budget.deletions > 0 {
            out.push(Action::DeleteVmi(uid.clone()));
        }
    }
    for (uid, p) in &t.pods {
        if p.deleting {
            out.push(Action::Reap(uid.clone()));
        } else if p.node.is_none() && !p.unschedulable {
            for r in &alive {
                if !again(uid, *r) {
                    out.push(Action::Bind(uid.clone(), *r));
                }
            }
        } else if p.node.is_some()
            && !t.nodes[p.node.as_deref().unwrap_or_default()]
                .charged
                .contains(uid)
        {
            out.push(Action::Start(uid.clone()));
        }
    }
    let nodes: Vec<String> = t.nodes.keys().cloned().collect();
    drop(t);
    for n in nodes {
        if w.report_changed(&n) {
            out.push(Action::Publish(n));
        }
    }
    for (r, rep) in w.replicas.iter().enumerate() {
        if rep.alive {
            let ix = rep.index.read();
            let now = rep.index.now();
            let stale = w.config.admission.stale_report_after;
            let admit = |ix| {
                !teeguard_webhook::decide::admit::promises(ix, |_| 1, stale, now).is_empty()
                    || !teeguard_webhook::decide::admit::untidy(ix, now, std::time::Duration::ZERO)
                        .is_empty()
            };
            if admit(&ix) {
                out.push(Action::Plan(r));
            }
            if !ix.unwritten(now).is_empty() {
                out.push(Action::WriteBehind(r));
            }
            for k in 0..KINDS {
                if !rep.queues[k].is_empty() {
                    out.push(Action::CatchUp(r, k));
                }
            }
            if budget.crashes > 0 && alive.len() > 1 {
                out.push(Action::Crash(r));
            }
            if budget.stops > 0 && alive.len() > 1 && rep.leadership.deciding() {
                out.push(Action::Stop(r));
            }
            if w.may_take_lease(r) {
                out.push(Action::Renew(r));
            }
        } else if !rep.stopped {
            out.push(Action::Restart(r));
        }
    }
    if budget.lease_runs_out > 0 && w.holder_gone() == Some(true) {
        out.push(Action::LeaseRunsOut);
    }
    out
}

/// Explore every order from a fresh world of `spec` with `vmis` VMIs created, to `depth` steps.
pub fn explore(
    spec: Spec,
    vmis: &[teeguard_shared::TeeKind],
    budget: Budget,
    depth: usize,
    instant: [bool; KINDS],
) -> Explored {
    let mut w = World::new(spec, 0);
    w.instant = instant;
    w.model = true;
    for kind in vmis {
        w.act(&Action::NewVmi(*kind));
    }
    // Every replica has seen the VMIs, and knows the decider, before anything starts.
    for r in 0..w.replicas.len() {
        for k in 0..KINDS {
            while !w.replicas[r].queues[k].is_empty() {
                w.act(&Action::Deliver(r, k));
            }
        }
        w.act(&Action::Renew(r));
    }
    let mut seen = HashSet::new();
    let mut out = Explored::default();
    let mut path = Vec::new();
    dfs(&w, budget, depth, &mut seen, &mut path, &mut out);
    out
}

fn dfs(
    w: &World,
    budget: Budget,
    depth: usize,
    seen: &mut HashSet<(u64, Budget)>,
    path: &mut Vec<Action>,
    out: &mut Explored,
) {
    if out.violation.is_some() {
        return;
    }
    if !seen.insert((w.fingerprint(), budget)) {
        return;
    }
    out.states += 1;
    out.depth = out.depth.max(path.len());
    if out.states.is_multiple_of(20_000) {
        eprintln!(
            "model checker: {} states, {} quiet, depth {}",
            out.states,
            out.quiet,
            path.len()
        );
    }
    let next = enabled(w, budget);
    // Quiet: only steps that change nothing are left (refused CREATEs, retried bindings).
    let quiet = next.iter().all(|a| {
        matches!(
            a,
            Action::Create(..)
                | Action::Bind(..)
                | Action::DeleteVmi(_)
                | Action::Crash(_)
                | Action::Stop(_)
        )
    }) && next.iter().all(|a| !changes(w, a));
    if quiet {
        out.quiet += 1;
        let mut checks = Checks::default();
        checks.quiet(w);
        if let Some(v) = checks.violations.first() {
            out.violation = Some((v.clone(), path.clone()));
        }
    }
    if path.len() >= depth {
        return;
    }
    for a in next {
        let mut child = w.fork();
        let happened: Happened = child.act(&a);
        let mut checks = Checks::default();
        checks.after(&child, &a, &happened, false);
        path.push(a.clone());
        if let Some(v) = checks.violations.first() {
            out.violation = Some((v.clone(), path.clone()));
            return;
        }
        let budget = match a {
            Action::DeleteVmi(_) => Budget {
                deletions: budget.deletions - 1,
                ..budget
            },
            Action::Crash(_) => Budget {
                crashes: budget.crashes - 1,
                ..budget
            },
            Action::Stop(_) => Budget {
                stops: budget.stops - 1,
                ..budget
            },
            Action::LeaseRunsOut => Budget {
                lease_runs_out: budget.lease_runs_out - 1,
                ..budget
            },
            _ => budget,
        };
        dfs(&child, budget, depth, seen, path, out);
        path.pop();
    }
}

/// Whether `a` would change the world (a CREATE that is refused again, a binding refused again, do
/// not); a deletion, a crash or a stop always would, but a world waiting only on them is quiet.
fn changes(w: &World, a: &Action) -> bool {
    match a {
        Action::DeleteVmi(_) | Action::Crash(_) | Action::Stop(_) => false,
        _ => {
            let mut child = w.fork();
            let before = child.fingerprint();
            child.act(a);
            child.fingerprint() != before
        }
    }
}
