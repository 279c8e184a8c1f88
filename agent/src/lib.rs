//! teeguard node agent.
//!
//! Reads TEE key capacity and usage from the kernel's misc cgroup controller (the only source of
//! truth), attributes usage to the pods that request the keys, publishes the node's `TeeCapacity`
//! report and advertises the keys Kubernetes pods can really get as extended resources on the Node.
//!
//! - [`scan`]: filesystem adapter reading `misc.capacity` / `misc.current` (cgroup v1 and v2, systemd
//!   and cgroupfs kubepods layouts);
//! - [`attribution`]: pure attribution of kernel usage to pods, external consumers and pending pods;
//! - [`report`]: pure construction of the `TeeCapacity` status and the publish decision;
//! - [`advertise`]: pure Node diff (JSON Patch) and its kube adapter;
//! - [`publish`]: server-side apply of the `TeeCapacity`; [`lease`]: its heartbeat Lease;
//! - [`pods`]: reflectors for the node's pods and its Node;
//! - [`metrics`], [`run`] (the loops), [`cli`].

pub mod advertise;
pub mod attribution;
pub mod cleanup;
pub mod cli;
pub mod enforce;
pub mod error;
pub mod lease;
pub mod metrics;
pub mod pods;
pub mod publish;
pub mod report;
pub mod run;
pub mod scan;

pub use error::{Error, Result};
