//! What the agent reads and writes in the host's cgroup tree (the kernel's misc controller files):
//!
//! - [`scanner`]: one scan of capacity and usage (root, kubepods levels, pod cgroups), agent mode
//!   reading only the pods of interest through kept-open files;
//! - `files`: the small-file reads the scanner makes;
//! - [`misc_max`]: writing a pod cgroup's `misc.max` (the cgroup writer's file I/O);
//! - [`misc_events`]: inotify on the `misc.events` files (a failed charge wakes the agent);
//! - [`dir_watch`]: the inotify watches it and the cgroup writer use (only the events they name).
//!
//! What the files mean is decided in [`crate::decide`] (names, scan results, reuse of readings).

pub mod dir_watch;
mod files;
pub mod misc_events;
pub mod misc_max;
pub mod scanner;

pub use scanner::Scanner;
