//! The decoded pod types the decisions take as input and the pod cache keeps: [`admitted`] (the pod
//! under review, reduced to what admission decisions read), [`launcher`] (the virt-launcher pod of a
//! binding, as watched, fetched and cached), and [`decode`] (the serde functions both decode with,
//! which keep only the keys decisions read).

pub mod admitted;
pub mod decode;
pub mod launcher;

pub use launcher::{CachedContainer, CachedLauncherPod, ContainerResources, LauncherPod};
