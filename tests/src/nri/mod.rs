//! A fake container runtime speaking the real NRI wire protocol, for testing NRI plugins (the agent's)
//! without containerd.
//!
//! - [`proto`]: a parser of `.proto` files ([`proto::parse`], [`proto::load_upstream`] for NRI's
//!   `api.proto` kept in the shared reference folder).
//! - [`codec`]: protobuf encoding/decoding of messages given as JSON, driven by the parsed schema;
//!   [`wire`]: the schema-less protobuf wire format underneath.
//! - [`ttrpc`]: the transport — NRI's connection multiplexing over one Unix stream and ttrpc framing
//!   and envelopes.
//! - [`runtime`]: [`NriRuntime`], which accepts a plugin, registers, configures and synchronizes it as
//!   containerd does, then lets the test relay `CreateContainer` and other calls, restart, shut down.
//!
//! The upstream definitions are read at test time, never copied into the project.

pub mod codec;
pub mod proto;
mod proto_parse;
pub mod runtime;
mod runtime_conn;
pub mod ttrpc;
pub mod wire;

#[cfg(test)]
mod runtime_tests;

pub use proto::{ProtoError, Schema};
pub use runtime::{NriError, NriRuntime, Registration, event_bit, misc_max};
