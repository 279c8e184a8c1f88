//! A fake container runtime speaking the real NRI wire protocol, for testing NRI plugins (the agent's)
//! without containerd.
//!
//! - messages: JSON encoded and decoded with upstream's `api.proto` ([`crate::proto::Schema::nri`]).
//! - [`ttrpc`]: the transport — NRI's connection multiplexing over one Unix stream and ttrpc framing
//!   and envelopes.
//! - [`runtime`]: [`NriRuntime`], which accepts a plugin, registers, configures and synchronizes it as
//!   containerd does, then lets the test relay `CreateContainer` and other calls, restart, shut down.
//!
//! The upstream definitions are read at test time, never copied into the project.

pub mod runtime;
mod runtime_conn;
pub mod ttrpc;

#[cfg(test)]
mod runtime_tests;

pub use runtime::{NriRuntime, Registration, event_bit, misc_max};
