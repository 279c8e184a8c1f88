//! The container runtime, through its NRI plugin interface (containerd ≥ 1.7 with NRI enabled, CRI-O
//! ≥ 1.26): at `CreateContainer` the agent answers with `linux.resources.unified["misc.max"]`, which
//! the runtime writes into the container's cgroup. What to answer is decided above (`enforce`).
//!
//! - [`wire`]: the NRI messages used (prost structs, the fields used, upstream's numbers);
//! - [`transport`]: the multiplexed ttrpc framing;
//! - [`plugin`]: the connection (register, serve, reconnect);
//! - [`sync`]: `Synchronize`, which gives containers that already run their limits;
//! - [`updates`]: the plugin's own `UpdateContainers` calls, their answers and those left unanswered;
//! - [`zeros`]: strict mode's zeros the plugin gave, lifted when their namespace is labelled exempt.

pub mod plugin;
pub mod sync;
pub mod transport;
pub mod updates;
pub mod wire;
pub mod zeros;
