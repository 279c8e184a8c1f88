//! What the agent says to and hears from the Kubernetes API server:
//!
//! - [`watch`]: reflectors of the node's pods, its Node and (strict mode) the exempt namespaces, and
//!   [`cached`]: the slim objects they keep;
//! - [`publish`]: server-side apply of the node's `TeeCapacity`; [`lease`]: its heartbeat Lease;
//! - [`node`]: writing the Node's extended resources;
//! - [`slices`]: DRA mode: the node's ResourceSlices and the claims the kubelet prepares;
//! - [`events`]: Warning Events on pods whose key limit could not be applied as admitted;
//! - [`cleanup`]: removing what the agent added, after an uninstall.
//!
//! What to write is decided in [`crate::decide`].

pub mod cached;
pub mod cleanup;
pub mod events;
pub mod lease;
pub mod node;
pub mod publish;
pub mod slices;
pub mod watch;
