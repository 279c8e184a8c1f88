//! teeguard test kit: an in-process, stateful Kubernetes API server ([`fakeapi`]), a simulated host
//! cgroup tree ([`host`]) and builders for realistic objects ([`fixtures`]). Every crate's tests use it so
//! that kube clients, watches, patches and file reads run through the real protocol. Every harness
//! fails with the one [`Error`].

pub mod controlplane;
pub mod dra;
pub mod e2e;
pub mod error;
pub mod fakeapi;
pub mod fixtures;
pub mod fuzzing;
pub mod host;
pub mod kubevirt;
pub mod node;
pub mod nri;
pub mod patch;
pub mod ports;
pub mod prom;
pub mod proto;
pub mod realcluster;
pub mod standalone;
pub mod structure;
pub mod teevm;
pub mod wait;

pub use error::{Error, Result};
