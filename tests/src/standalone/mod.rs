//! Standalone mode: the whole of teeguard working on one machine without a cluster.
//!
//! [`Standalone::start`] runs the real agent (its `run` loop) on a simulated TDX host and the real
//! webhook (`app::start`, HTTPS with freshly generated certificates) against the in-process fake API
//! server served on 127.0.0.1. [`run_scenario`] then plays the rest of the cluster through an
//! [`ApiServerDriver`]: it creates VMIs, renders their virt-launcher pods like KubeVirt, sends the pod
//! CREATE to `/mutate` and `/validate` and the scheduler's `pods/binding` to `/validate` like
//! kube-apiserver, binds, and starts the VMs on the simulated host like the kubelet, printing a table
//! of what was patched, admitted and refused and why. The binary `teeguard-standalone` wraps it.
//!
//! The driver is independent of the in-process setup: the end-to-end tests point it at webhook and
//! agent processes (see `crate::e2e`).
//!
//! - [`client`]: the HTTPS client (CA-pinned, keep-alive) and the parsed [`ReviewReply`];
//! - [`driver`]: [`ApiServerDriver`] (API server, virt-controller, scheduler) and [`SimKubelet`];
//! - [`cluster`]: [`Standalone`], the in-process environment;
//! - [`scenario`]: the story and its summary; [`table`]: the step table.

pub mod client;
pub mod cluster;
pub mod driver;
pub mod scenario;
pub mod table;

pub use client::{Decision, ReviewReply, WebhookClient};
pub use cluster::{Standalone, StandaloneOptions};
pub use driver::{ApiServerDriver, BindOutcome, CreatedVmi, PodAdmission, SimKubelet, VmiSpec};
pub use scenario::{ScenarioReport, run_scenario, summary};
