//! The agent's `run` in a guest, against the real control plane on the host.
