//! The agent under a real kubelet on containerd v2.4 (`teeguard_tests::node`): pods created through the
//! real API server, webhook and scheduler, started by the kubelet through containerd, which asks the
//! agent over NRI; each container's OCI config as containerd handed it to runc is the evidence. Skipped
//! (one line) without the node's binaries or root, unless `CI=true`.

mod chart_support;
mod node_support;

use teeguard_tests::node::Runtime;

const RUNTIME: Runtime = Runtime::Containerd;

every_runtime_runs!(RUNTIME);
