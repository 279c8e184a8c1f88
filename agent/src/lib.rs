//! teeguard node agent.
//!
//! Reads TEE key capacity and usage from the kernel's misc cgroup controller (the only source of
//! truth), attributes usage to the pods that request the keys, publishes the node's `TeeCapacity`
//! report and advertises the keys Kubernetes pods can really get as extended resources on the Node;
//! optionally holds every pod to its keys in the kernel (`misc.max`).
//!
//! In layers; each imports only the ones below it (checked by `tests/structure.rs`):
//!
//! - [`run`]: the agent's loop (scan, reconcile, publish), woken by the poll tick, `misc.events`,
//!   the watches and deadlines; [`enforce`] below it wires the kernel enforcement (NRI plugin or
//!   cgroup writer), and [`dra`] the DRA driver (DRA mode: the kubelet plugin and its checkpoint).
//! - One module per thing the agent talks to, none importing another: [`kernel`] (the host's cgroup
//!   files: the scanner, `misc.max`, `misc.events`), [`cluster`] (the API server: watches, the
//!   `TeeCapacity`, its Lease, the Node, ResourceSlices, Events, cleanup), [`runtime`] (the container
//!   runtime's NRI: wire format, transport, plugin connection) and [`kubelet`] (the kubelet's plugin
//!   sockets: registration, `DRAPlugin`, the checkpoint file).
//! - [`metrics`]: the Prometheus series.
//! - [`decide`]: the pure core: scan results and cgroup names, attribution, the report and its
//!   conditions, the advertise plan, the limits and the `Enforcing` condition. No runtime, client,
//!   file or metric: tested without any.
//! - [`error`]: the error enum.
//!
//! On top: [`cli`] parses the command line and runs `run` and `cleanup`; [`scan`] is the `scan` command
//! (one scan with the same code as `run`, printed).

pub mod cli;
pub mod cluster;
pub mod decide;
pub mod dra;
pub mod enforce;
pub mod error;
pub mod kernel;
pub mod kubelet;
pub mod metrics;
pub mod run;
pub mod runtime;
pub mod scan;

pub use error::{Error, Result};
