//! The admission state's guarantees, proven on a deterministic simulation of the webhook's own code
//! (its index, check, election, write-behind and planner) in a world of replicas with their own late watches,
//! virt-controller, the scheduler, kubelets and agents (`sim`). Invariants I1-I5: `sim::check`.
//!
//! - every order of every step in small worlds (2 replicas, 1 node, 2 keys, 3 VMIs; a deletion; a
//!   clean stop of either replica, the decider's Lease taken over by the other), by the model checker;
//! - thousands of seeded timed runs of larger worlds (1-3 replicas, 1-3 nodes of two kinds, bursts of
//!   VMIs, deletions, replica crashes, dropped watches, refused writes);
//!   One replica, elected through the Lease, decides (the decider among those crashed); I6: one
//!   decider at a time;
//! - the checks catching planted defects: replicas each deciding on their own, a successor that does
//!   not wait the Lease out, a new decider that does not wait for the pods admitted before it, one that
//!   decides before it lists the holds, a decider that never writes its holds.
//!
//! A failing run prints its seed and its trace; `TEEGUARD_SIM_SEED=<seed>` runs that seed alone, and
//! `TEEGUARD_SIM_SEEDS=<n>` runs more (or fewer) seeds.

mod sim;

use sim::explore::{Budget, Explored, explore};
use sim::run::{Chaos, Outcome, run};
use sim::world::{Defect, NodeSpec, Spec};
use teeguard_shared::TeeKind;

/// 2 replicas, 1 node with 2 keys for Kubernetes (and one more held outside it, which the scheduler's
/// static count does not see: teeguard alone keeps a third VM off).
fn small() -> Spec {
    Spec {
        replicas: 2,
        nodes: vec![NodeSpec {
            name: "node-a",
            kind: TeeKind::Tdx,
            capacity: 3,
            external: 1,
        }],
        defect: Defect::None,
    }
}

/// Every order from a world of `spec` with `vmis` TDX VMIs and what `budget` allows beyond the
/// components' own steps; replicas lag on holds and reports, pods and VMIs reach them at once (the
/// seeded runs delay every kind).
fn explored(spec: Spec, vmis: usize, budget: Budget) -> Explored {
    let instant = [false, false, true, true];
    let found = explore(spec, &vec![TeeKind::Tdx; vmis], budget, 60, instant);
    println!(
        "model checker: {} states, {} quiet, deepest path {} steps",
        found.states, found.quiet, found.depth
    );
    found
}

/// [`explored`] finds no violation, and every path ended within the depth bound.
fn every_order(spec: Spec, vmis: usize, budget: Budget) {
    let found = explored(spec, vmis, budget);
    if let Some((what, path)) = &found.violation {
        panic!("{what}\nafter:\n{path:#?}");
    }
    assert!(found.quiet > 0, "some order ends with every VMI settled");
    assert!(found.depth < 60, "the depth bound cut no path short");
}

fn deletions(deletions: u32) -> Budget {
    Budget {
        deletions,
        crashes: 0,
        stops: 0,
        lease_runs_out: 0,
    }
}

#[test]
fn every_order_of_three_vmis_for_two_keys_on_two_replicas_keeps_the_invariants() {
    every_order(small(), 3, deletions(0));
}

#[test]
fn every_order_of_a_deletion_freeing_the_key_a_second_vmi_waits_for_keeps_the_invariants() {
    every_order(one_key(), 2, deletions(1));
}

/// A rolling update: the decider stops cleanly at any step (it writes its last holds and gives the
/// Lease up) and the other replica takes the Lease at any later step, whatever its watches have
/// delivered by then of the holds its predecessor wrote.
fn handover() -> Budget {
    Budget {
        stops: 1,
        ..deletions(0)
    }
}

/// A VMI deleted (its key freed for the VMI waiting) and a handover, in any order.
fn deletion_and_handover() -> Budget {
    Budget {
        deletions: 1,
        ..handover()
    }
}

/// 2 replicas, 1 node with 1 key for Kubernetes (and one held outside it).
fn one_key() -> Spec {
    let mut spec = small();
    spec.nodes[0].capacity = 2;
    spec
}

#[test]
fn every_order_around_a_clean_handover_of_the_decider_keeps_the_invariants() {
    every_order(small(), 3, handover());
}

#[test]
fn every_order_of_a_deletion_and_a_clean_handover_keeps_the_invariants() {
    // The key a deletion frees is promised to the VMI waiting for it, and the promise must outlive
    // the decider that made it.
    every_order(one_key(), 2, deletion_and_handover());
}

/// A crash of either replica at any step (the decider loses what it holds and has not written), its
/// restart at any later step, and a crashed decider's Lease running out at any later step (15 s in
/// which the agents publish and the live replicas' watches deliver): then any replica, the restarted
/// one too, may take it over.
fn crash() -> Budget {
    Budget {
        crashes: 1,
        lease_runs_out: 1,
        ..deletions(0)
    }
}

#[test]
fn every_order_around_a_crash_and_a_failover_keeps_the_invariants() {
    // 1 key, 2 VMIs: a key the crashed decider admitted a pod for, or bound one to, must not be given
    // to the other VMI by its successor.
    every_order(one_key(), 2, crash());
}

#[test]
fn a_new_decider_that_does_not_wait_for_its_crashed_predecessors_pods_is_caught_by_the_model_checker()
 {
    let spec = Spec {
        defect: Defect::NoOrphanGate,
        ..one_key()
    };
    let (what, path) = explored(spec, 2, crash())
        .violation
        .expect("some order gives the key of a pod admitted before the crash away");
    println!("{what}\nafter:\n{path:#?}");
    assert!(what.starts_with("I2"), "{what}");
}

/// With a deletion as well: 258 056 states, about a minute (before a release:
/// `--ignored every_order_with_a_deletion`).
#[test]
#[ignore]
fn every_order_with_a_deletion_and_a_crash_and_a_failover_keeps_the_invariants() {
    every_order(
        one_key(),
        2,
        Budget {
            deletions: 1,
            ..crash()
        },
    );
}

/// The first violation the model checker finds around a handover with `defect` planted: one that
/// gives a key the stopped decider held to another pod (I1 or I2). Prints the path to it.
fn caught_at_handover(defect: Defect) {
    let spec = Spec {
        defect,
        ..one_key()
    };
    let found = explored(spec, 2, handover());
    let (what, path) = found.violation.expect("some order gives a held key away");
    println!("{what}\nafter:\n{path:#?}");
    assert!(what.starts_with("I1") || what.starts_with("I2"), "{what}");
}

#[test]
fn a_new_decider_that_decides_before_listing_the_holds_is_caught_by_the_model_checker() {
    caught_at_handover(Defect::NoCatchUp);
}

#[test]
fn a_decider_that_never_writes_its_holds_is_caught_by_the_model_checker_at_a_handover() {
    caught_at_handover(Defect::NoWriteBehind);
}

/// The whole small world of issue 42 (3 VMIs, 2 keys, a deletion): 583 540 states, about 6 minutes,
/// so not in CI (`cargo test -p teeguard-webhook --test simulation --
/// --ignored every_order_with_a_deletion`).
#[test]
#[ignore]
fn every_order_with_a_deletion_of_three_vmis_for_two_keys_keeps_the_invariants() {
    every_order(small(), 3, deletions(1));
}

/// The same world with a handover as well: 3 315 216 states, about 12 minutes on a busy machine
/// (before a release, as the one above: `--ignored every_order_with_a_deletion`).
#[test]
#[ignore]
fn every_order_with_a_deletion_and_a_handover_of_three_vmis_for_two_keys_keeps_the_invariants() {
    every_order(small(), 3, deletion_and_handover());
}

/// The world of seed `seed`: 1-3 replicas, 1-3 nodes (TDX, SEV-SNP), some keys held outside
/// Kubernetes.
fn world(seed: u64) -> Spec {
    let replicas = 1 + (seed % 3) as usize;
    let nodes = match (seed / 3) % 3 {
        0 => vec![NodeSpec {
            name: "tdx-a",
            kind: TeeKind::Tdx,
            capacity: 2,
            external: 0,
        }],
        1 => vec![
            NodeSpec {
                name: "tdx-a",
                kind: TeeKind::Tdx,
                capacity: 3,
                external: 1,
            },
            NodeSpec {
                name: "snp-a",
                kind: TeeKind::SevEs,
                capacity: 2,
                external: 0,
            },
        ],
        _ => vec![
            NodeSpec {
                name: "tdx-a",
                kind: TeeKind::Tdx,
                capacity: 2,
                external: 1,
            },
            NodeSpec {
                name: "tdx-b",
                kind: TeeKind::Tdx,
                capacity: 2,
                external: 0,
            },
            NodeSpec {
                name: "snp-a",
                kind: TeeKind::SevEs,
                capacity: 2,
                external: 0,
            },
        ],
    };
    Spec {
        replicas,
        nodes,
        defect: Defect::None,
    }
}

fn chaos() -> Chaos {
    Chaos {
        duration: 60_000,
        vmis: 16,
        deletions: true,
        crash_odds: 10,
        watch_drops: true,
        outages: true,
        max_delay: 200,
        status_lag: 6_000,
    }
}

fn report(o: &Outcome) -> String {
    // The steps of the last 15 simulated seconds, the agents' polls left out.
    let end: u64 = o
        .trace
        .last()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .or_else(|| {
            let l = o.trace.iter().rev().nth(1)?;
            l.split_whitespace().next()?.parse().ok()
        })
        .unwrap_or(0);
    let tail: Vec<&String> = o
        .trace
        .iter()
        .filter(|l| !l.contains("Publish(") || std::env::var("TEEGUARD_SIM_SEED").is_ok())
        .filter(|l| {
            l.split_whitespace()
                .next()
                .and_then(|t| t.parse::<u64>().ok())
                .is_none_or(|t| t + 15_000 >= end || std::env::var("TEEGUARD_SIM_TRACE").is_ok())
        })
        .collect();
    format!(
        "seed {} broke {} invariant(s):\n{}\nfigures: {:?}\nlast steps:\n{}\nrun it alone: TEEGUARD_SIM_SEED={} cargo test -p teeguard-webhook --test simulation seeded",
        o.seed,
        o.violations.len(),
        o.violations.join("\n"),
        o.figures,
        tail.iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        o.seed
    )
}

/// Seeds beyond the usual count that once broke an invariant (found by runs of more seeds), run every
/// time: 4498, a pod's binding held anew after its CREATE's hold expired, which replicas that had
/// seen the old hold ended at once; 5293, a replica restarted and taking the Lease again (the driver
/// missed its new term, so its planner did not start at once).
const REGRESSIONS: &[u64] = &[4498, 5293];

/// Seeds `half` of two (each test runs half, so the two cores share them) with the [`REGRESSIONS`],
/// or the one seed asked for.
fn seeds(half: u64) -> Vec<u64> {
    if let Ok(s) = std::env::var("TEEGUARD_SIM_SEED") {
        let seed: u64 = s.parse().expect("TEEGUARD_SIM_SEED is a number");
        return if seed % 2 == half {
            vec![seed]
        } else {
            Vec::new()
        };
    }
    let n = std::env::var("TEEGUARD_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2_000u64);
    (0..n)
        .chain(REGRESSIONS.iter().copied().filter(|s| *s >= n))
        .filter(|s| s % 2 == half)
        .collect()
}

#[test]
fn seeded_runs_with_deletions_crashes_dropped_watches_and_refused_writes_keep_the_invariants() {
    runs(&seeds(0));
}

#[test]
fn more_seeded_runs_with_deletions_crashes_dropped_watches_and_refused_writes_keep_the_invariants()
{
    runs(&seeds(1));
}

fn runs(seeds: &[u64]) {
    if seeds.is_empty() {
        return;
    }
    let mut total = sim::check::Figures::default();
    for seed in seeds {
        let o = run(world(*seed), &chaos(), *seed);
        if !o.violations.is_empty() {
            panic!("{}", report(&o));
        }
        let f = &o.figures;
        total.started += f.started;
        total.refused += f.refused;
        total.retried += f.retried;
        total.longest_to_hold = total.longest_to_hold.max(f.longest_to_hold);
        total.longest_to_bound = total.longest_to_bound.max(f.longest_to_bound);
        total.insufficient += f.insufficient;
    }
    println!("{} seeded runs: {total:?}", seeds.len());
    assert!(
        total.started > 0 && total.retried > 0,
        "the runs did something: {total:?}"
    );
}

/// The first violation of invariant `by` (`I1`, ...) a planted `defect` causes in the seeded runs of
/// 2-3 replicas (runs that break another invariant first are skipped).
fn caught(defect: Defect, by: &[&str]) -> String {
    // More VMIs, and a crash one second in three: the defects are in what happens around a crash.
    let chaos = Chaos {
        crash_odds: 3,
        vmis: 30,
        ..chaos()
    };
    (0..1_000)
        .find_map(|seed| {
            let mut spec = world(seed);
            spec.replicas = 2 + (seed % 2) as usize;
            spec.defect = defect;
            let first = run(spec, &chaos, seed).violations.first().cloned();
            let found = first.filter(|v| by.iter().any(|i| v.starts_with(i)));
            found.inspect(|v| println!("seed {seed}: {v}"))
        })
        .unwrap_or_else(|| panic!("no run caught {defect:?} by {by:?}"))
}

#[test]
fn replicas_each_deciding_on_their_own_holds_are_caught_overbooking() {
    // Each replica decides on its own index and writes its holds behind (no election; before issue
    // 42, each replica's CREATE-time promises): keys promised at CREATE are given to another pod (I2
    // over time), or VMs sent where the kernel has no key (I1).
    caught(Defect::EveryReplicaDecides, &["I1", "I2"]);
}

#[test]
fn a_new_decider_that_does_not_wait_for_the_pods_admitted_before_it_is_caught_overbooking() {
    caught(Defect::NoOrphanGate, &["I2"]);
}

#[test]
fn a_replica_taking_the_lease_without_waiting_it_out_is_caught_deciding_beside_the_holder() {
    caught(Defect::NoLeaseWait, &["I6"]);
}

#[test]
fn a_new_decider_that_decides_before_listing_the_holds_is_caught_giving_away_its_predecessors_keys()
{
    // A clean stop gives the Lease up and a successor takes it at once, before its watch has
    // delivered the last holds the stopped decider wrote.
    caught(Defect::NoCatchUp, &["I1", "I2"]);
}
