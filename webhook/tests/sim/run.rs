//! The seeded, timed driver: actions happen at their due times (ties and every random choice from
//! the seed), as the components' own timing has them: virt-controller's backoff (5 ms doubling up to
//! 1 000 s, and at once when teeguard annotates a VMI), the scheduler's (1 s doubling up to 10 s for a
//! refused binding), kubelets starting pods in 0.3-2 s, agents polling every 250 ms, watches
//! delivering each replica's changes 1 ms to `max_delay` late (in order per kind), virt-controller
//! writing a VMI's status up to `status_lag` after creating its pod, the planner 100 ms
//! after its index changed and every 10 s besides; and chaos as asked: VMIs deleted, replicas crashed
//! and restarted, watches dropped and re-listed, the API server refusing writes for a while.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};

use teeguard_shared::TeeKind;

use super::check::{Checks, Figures};
use super::world::{Action, Bound, KINDS, Spec, World};

/// What disturbs a run.
#[derive(Clone, Debug)]
pub struct Chaos {
    /// How long VMIs keep coming and going (simulated ms); then the world is left to settle.
    pub duration: u64,
    /// VMIs created, in bursts.
    pub vmis: usize,
    /// Delete VMIs at random (running or waiting) as the run goes.
    pub deletions: bool,
    /// Crash, or stop cleanly, and restart a replica (never the last one up) one second in this many
    /// (0: never).
    pub crash_odds: u64,
    /// Drop watches and re-list them.
    pub watch_drops: bool,
    /// Refuse API writes for a while.
    pub outages: bool,
    /// Watch delays up to this (ms).
    pub max_delay: u64,
    /// virt-controller writes a VMI's status after its pod's CREATE within this (ms; 0: at once).
    /// Measured on the real chain: up to ~5 s when it is busy with the status of deleted VMIs.
    pub status_lag: u64,
}

/// How a run ended.
#[derive(Debug)]
pub struct Outcome {
    /// The seed.
    pub seed: u64,
    /// The figures.
    pub figures: Figures,
    /// What was broken.
    pub violations: Vec<String>,
    /// Every action, with its time (printed when something broke).
    pub trace: Vec<String>,
}

struct Queue {
    heap: BinaryHeap<Reverse<(u64, u64, Action)>>,
    seq: u64,
    delivering: BTreeSet<(usize, usize)>,
    planning: BTreeSet<usize>,
    deadlines: BTreeSet<(usize, u64)>,
}

impl Queue {
    fn at(&mut self, due: u64, a: Action) {
        self.seq += 1;
        self.heap.push(Reverse((due, self.seq, a)));
    }
}

/// virt-controller's backoff after `refusals` refused CREATEs (5 ms doubling, at most 1 000 s).
pub fn backoff(refusals: u32) -> u64 {
    let exp = refusals.saturating_sub(1).min(20);
    (5u64 << exp).min(1_000_000)
}

/// Run `spec` under `chaos` from `seed`.
pub fn run(spec: Spec, chaos: &Chaos, seed: u64) -> Outcome {
    let mut w = World::new(spec, seed);
    w.max_delay = chaos.max_delay;
    w.status_lag = chaos.status_lag;
    let mut checks = Checks::default();
    let mut trace = Vec::new();
    let mut q = Queue {
        heap: BinaryHeap::new(),
        seq: 0,
        delivering: BTreeSet::new(),
        planning: BTreeSet::new(),
        deadlines: BTreeSet::new(),
    };
    let kinds: Vec<TeeKind> = super::check::kinds(&w).into_iter().collect();
    // VMIs in bursts over the first half.
    let mut t = 0;
    for i in 0..chaos.vmis {
        if w.rand(4) == 0 {
            t += w.rand(chaos.duration / 2 / chaos.vmis.max(1) as u64 * 4 + 1);
        }
        let kind = kinds[i % kinds.len()];
        q.at(t, Action::NewVmi(kind));
    }
    for n in w.spec.nodes.clone() {
        q.at(w.rand(250), Action::Publish(n.name.to_string()));
    }
    for r in 0..w.replicas.len() {
        q.at(10_000, Action::Plan(r));
        let d = w.rand(100);
        q.at(d, Action::Renew(r));
    }
    let mut behind: BTreeSet<usize> = BTreeSet::new();
    let mut terms: BTreeMap<usize, u64> = BTreeMap::new();
    let end = chaos.duration + 20_000;
    let mut next_chaos = 1_000;
    let mut binding_backoff: BTreeMap<String, u64> = BTreeMap::new();
    while let Some(Reverse((due, _, action))) = q.heap.pop() {
        if due > end {
            break;
        }
        w.advance(due);
        // Chaos, once a second while the run lasts.
        while next_chaos <= w.now && next_chaos < chaos.duration {
            disturb(&mut w, &mut q, chaos, next_chaos);
            next_chaos += 1_000;
        }
        if let Action::Plan(r) = action {
            q.planning.remove(&r);
        }
        if let Action::Deliver(r, k) = action {
            q.delivering.remove(&(r, k));
        }
        let happened = w.act(&action);
        trace.push(format!("{:>7} {action:?}", w.now));
        checks.after(&w, &action, &happened, true);
        if !checks.violations.is_empty() {
            trace.push(w.describe());
            return Outcome {
                seed,
                figures: checks.figures,
                violations: checks.violations,
                trace,
            };
        }
        // What follows from it.
        match &action {
            Action::NewVmi(_) => {
                if let Some(uid) = happened.new_vmi.clone() {
                    let d = w.rand(50);
                    q.at(w.now + d, Action::Create(uid, usize::MAX));
                }
            }
            Action::Create(vmi, _) => {
                if let Some(v) = &happened.status_due {
                    let d = 1 + w.rand(chaos.status_lag);
                    q.at(w.now + d, Action::VmiStatus(v.clone()));
                }
                if let Some((pod, _)) = &happened.admitted {
                    let d = 1 + w.rand(20);
                    q.at(w.now + d, Action::Bind(pod.clone(), usize::MAX));
                } else if happened.refused {
                    let refusals = w.truth().vmis[vmi].refusals;
                    q.at(
                        w.now + backoff(refusals),
                        Action::Create(vmi.clone(), usize::MAX),
                    );
                }
            }
            Action::Bind(pod, _) => match happened.bound {
                Some(Bound::Yes) => {
                    let d = 300 + w.rand(1_700);
                    q.at(w.now + d, Action::Start(pod.clone()));
                }
                Some(Bound::Refused) => {
                    let b = binding_backoff.entry(pod.clone()).or_insert(500);
                    *b = (*b * 2).min(10_000);
                    let d = *b;
                    q.at(w.now + d, Action::Bind(pod.clone(), usize::MAX));
                }
                Some(Bound::NoRoom) => q.at(w.now + 1_000, Action::Bind(pod.clone(), usize::MAX)),
                None => {}
            },
            Action::Publish(node) => q.at(w.now + 250, Action::Publish(node.clone())),
            // Every replica reads the Lease every retry period (2 s), up or not; one that starts
            // deciding plans at once.
            Action::Renew(r) => {
                q.at(w.now + 2_000, Action::Renew(*r));
                let term = w.replicas[*r].leadership.term();
                if terms.insert(*r, term) != Some(term) && term > 0 && q.planning.insert(*r) {
                    q.at(w.now + 100, Action::Plan(*r));
                }
            }
            // The backstop pass, every 10 s.
            Action::Plan(r) if due % 10_000 == 0 => q.at(w.now + 10_000, Action::Plan(*r)),
            Action::DeleteVmi(vmi) => {
                let pod = w.truth().vmis[vmi].pod.clone();
                if let Some(pod) = pod {
                    let d = 500 + w.rand(2_500);
                    q.at(w.now + d, Action::Reap(pod));
                }
            }
            // A restarted replica counts its terms from 0 again.
            Action::Restart(r) => {
                terms.remove(r);
            }
            Action::Crash(r) | Action::Stop(r) => {
                let d = 1_000 + w.rand(4_000);
                q.at(w.now + d, Action::Restart(*r));
            }
            Action::DropWatch(r, k) => {
                let d = 500 + w.rand(2_500);
                q.at(w.now + d, Action::Relist(*r, *k));
            }
            Action::ApiDown => {
                let d = 500 + w.rand(2_500);
                q.at(w.now + d, Action::ApiUp);
            }
            _ => {}
        }
        if let (Action::Plan(r), true) = (&action, happened.plan_failed)
            && q.planning.insert(*r)
        {
            let again = teeguard_webhook::cluster::retry::AGAIN_AFTER_FAILURE.as_millis() as u64;
            q.at(w.now + again + 100, Action::Plan(*r));
        }
        // The planner also wakes when a hold may end by time alone.
        if let Action::Plan(r) = &action
            && w.replicas[*r].alive
        {
            let ix = &w.replicas[*r].index;
            let next = ix.read().next_deadline(ix.now());
            if let Some(t) = next {
                let ms = t.duration_since(super::world::epoch()).as_millis().max(0) as u64;
                if q.deadlines.insert((*r, ms)) {
                    q.at(ms + 100, Action::Plan(*r));
                }
            }
        }
        // The decider writes its holds behind 250 ms after it kept one (a review's, or a promise of
        // its planner; again after a failure).
        if let Action::WriteBehind(r) = &action {
            behind.remove(r);
        }
        let kept = match (&action, happened.decided_by) {
            (Action::WriteBehind(r), _) if happened.behind_failed => Some(*r),
            (Action::Create(..), Some(r)) => Some(r),
            (Action::Plan(r), _) if !happened.retried.is_empty() => Some(*r),
            (Action::Bind(..), _) => (0..w.replicas.len())
                .find(|r| w.replicas[*r].alive && w.replicas[*r].leadership.deciding()),
            _ => None,
        };
        if let Some(r) = kept
            && behind.insert(r)
        {
            q.at(w.now + 250, Action::WriteBehind(r));
        }
        for vmi in &happened.retried {
            let d = 1 + w.rand(30);
            q.at(w.now + d, Action::Create(vmi.clone(), usize::MAX));
        }
        // Each replica's watches deliver at their due times; a replica plans 100 ms after a change.
        for r in 0..w.replicas.len() {
            for k in 0..KINDS {
                let front = w.replicas[r].queues[k].front().map(|(d, _)| *d);
                if let Some(d) = front
                    && q.delivering.insert((r, k))
                {
                    q.at(d.max(w.now), Action::Deliver(r, k));
                }
            }
            let changed = matches!(action, Action::Deliver(x, _) | Action::Relist(x, _) | Action::Restart(x) if x == r)
                || (happened.decided_by == Some(r) && !matches!(action, Action::Plan(_)));
            if changed && w.replicas[r].alive && q.planning.insert(r) {
                q.at(w.now + 100, Action::Plan(r));
            }
        }
    }
    // Settle: every VMI deleted, every pod gone, the TTL passed; then nothing may be held.
    let vmis: Vec<String> = w.truth().vmis.keys().cloned().collect();
    for v in vmis {
        w.act(&Action::DeleteVmi(v));
    }
    let pods: Vec<String> = w.truth().pods.keys().cloned().collect();
    for p in pods {
        w.act(&Action::Reap(p));
    }
    w.truth().api_down = false;
    for r in 0..w.replicas.len() {
        if !w.replicas[r].alive {
            w.act(&Action::Restart(r));
        }
        for k in 0..KINDS {
            if w.replicas[r].dropped[k] {
                w.act(&Action::Relist(r, k));
            }
            while !w.replicas[r].queues[k].is_empty() {
                w.act(&Action::Deliver(r, k));
            }
        }
    }
    let ttl = w.config.admission.ledger_ttl.as_millis() as u64;
    w.advance(w.now + ttl + 1);
    for n in w.spec.nodes.clone() {
        w.act(&Action::Publish(n.name.to_string()));
    }
    for r in 0..w.replicas.len() {
        for k in 0..KINDS {
            while !w.replicas[r].queues[k].is_empty() {
                w.act(&Action::Deliver(r, k));
            }
        }
    }
    checks.finish(&w);
    Outcome {
        seed,
        figures: checks.figures,
        violations: checks.violations,
        trace,
    }
}

/// Once a second: maybe delete a VMI, crash a replica, drop a watch, or refuse writes.
fn disturb(w: &mut World, q: &mut Queue, chaos: &Chaos, at: u64) {
    if chaos.deletions && w.rand(3) == 0 {
        let live: Vec<String> = w
            .truth()
            .vmis
            .iter()
            .filter(|(_, v)| v.deleted_at.is_none())
            .map(|(u, _)| u.clone())
            .collect();
        if !live.is_empty() {
            let v = live[w.rand(live.len() as u64) as usize].clone();
            q.at(at, Action::DeleteVmi(v));
        }
    }
    let up: Vec<usize> = (0..w.replicas.len())
        .filter(|r| w.replicas[*r].alive)
        .collect();
    if chaos.crash_odds > 0 && up.len() > 1 && w.rand(chaos.crash_odds) == 0 {
        // Half the crashes are the decider's (the one whose crash loses what it has not written).
        let decider = up
            .iter()
            .copied()
            .find(|r| w.replicas[*r].leadership.deciding());
        let r = match decider {
            Some(d) if w.rand(2) == 0 => d,
            _ => up[w.rand(up.len() as u64) as usize],
        };
        // A replica going away at an even second stops cleanly (a rolling upgrade), else it crashes
        // (no random draw: the runs' other choices stay as they were).
        if (at / 1_000).is_multiple_of(2) {
            q.at(at, Action::Stop(r));
        } else {
            q.at(at, Action::Crash(r));
        }
    }
    if chaos.watch_drops && w.rand(10) == 0 {
        let r = w.rand(w.replicas.len() as u64) as usize;
        let k = w.rand(KINDS as u64) as usize;
        if w.replicas[r].alive && !w.replicas[r].dropped[k] {
            q.at(at, Action::DropWatch(r, k));
        }
    }
    if chaos.outages && w.rand(20) == 0 && !w.truth().api_down {
        q.at(at, Action::ApiDown);
    }
}
