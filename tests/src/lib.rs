//! teeguard test kit: an in-process, stateful Kubernetes API server ([`fakeapi`]), a simulated host
//! cgroup tree ([`host`]) and builders for realistic objects ([`fixtures`]). Every crate's tests use it so
//! that kube clients, watches, patches and file reads run through the real protocol.

pub mod controlplane;
pub mod dra;
pub mod e2e;
pub mod fakeapi;
pub mod fixtures;
pub mod fuzzing;
pub mod host;
/// KubeVirt v1.9.0's own virt-controller (and a stand-in for virt-api's VMI webhook) on the real control plane.
pub mod kubevirt;
/// A real node (containerd or CRI-O, and a kubelet) joined to the real control plane.
pub mod node;
/// A fake container runtime speaking NRI (multiplexed ttrpc over a Unix socket), for NRI plugin tests.
pub mod nri;
pub mod ports;
pub mod prom;
pub mod realcluster;
pub mod standalone;
pub mod structure;
/// A real Linux misc cgroup controller: Debian's kernels under QEMU with the `../shared/tee-vm` kit.
pub mod teevm;
pub mod wait;
