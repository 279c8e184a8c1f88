//! The agent's pure core: what it computes from what it read, as plain functions and types. Nothing
//! here reads a file, awaits, calls the API server or records a metric (checked by
//! `tests/structure.rs`); time comes in as an argument.
//!
//! - [`counts`]: a count per TEE kind;
//! - [`host`]: what one scan found (the kernel adapter fills it in); [`cgroup_names`]: the kubelet's
//!   pod cgroup names and the `misc.current` format; [`reuse`]: when a scan may reuse pods' last
//!   readings;
//! - [`attribution`]: who holds the keys (pods, external consumers, pending pods);
//! - [`report`]: the `TeeCapacity` status, its conditions, and when to write it;
//! - [`advertise`]: the Node's extended resources: the writes, and what the agent remembers of other
//!   managers;
//! - [`dra`]: DRA mode: the devices published, the slices, the check before preparing a claim;
//! - [`limits`]: which `misc.max` each pod and container gets ([`claimed`]: what DRA claims give
//!   them); [`enforcing`]: the `Enforcing` condition.

pub mod advertise;
pub mod attribution;
pub mod cgroup_names;
pub mod claimed;
pub mod counts;
pub mod dra;
pub mod enforcing;
pub mod host;
pub mod limits;
pub mod report;
pub mod reuse;
