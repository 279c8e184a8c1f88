//! teeguard's domain crate, shared by the admission webhook and the node agent.
//!
//! - [`misc`]: the kernel's misc cgroup files (`misc.capacity`, `misc.current`, ...), the only source of
//!   truth for TEE key capacity and usage.
//! - [`tee`]: the TEE key kinds (`tdx`, `sev`, `sev_es`) and their kernel names.
//! - [`vmi`]: the few fields of a KubeVirt `VirtualMachineInstance` teeguard needs, and the mapping from a
//!   VMI's `spec.domain.launchSecurity` to a [`TeeKind`].
//! - [`pod`]: how many keys of each kind a pod requests (containers, init containers and `spec.overhead`).
//! - [`config`]: the configuration file shared by webhook and agent.
//! - [`crd`]: the `TeeCapacity` node report (`teeguard.dev/v1alpha1`).
//! - [`names`]: every label, annotation, condition type and reason teeguard reads or writes.
//! - [`ops`]: process plumbing both binaries share (logging, the admin HTTP port, shutdown).

pub mod config;
pub mod crd;
pub mod error;
pub mod misc;
pub mod names;
pub mod ops;
pub mod pod;
pub mod reservation;
pub mod tee;
pub mod vmi;

pub use config::Config;
pub use crd::{KindStatus, TeeCapacity, TeeCapacitySpec, TeeCapacityStatus};
pub use error::{Error, Result};
pub use tee::TeeKind;
pub use vmi::VirtualMachineInstance;
