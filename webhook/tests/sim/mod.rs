//! The deterministic simulation of the webhook's admission state (see `world`): the world, the
//! invariants (`check`), a seeded timed driver (`run`) and a model checker (`explore`).

pub mod check;
pub mod explore;
pub mod run;
pub mod world;
