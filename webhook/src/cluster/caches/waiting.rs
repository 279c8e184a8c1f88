//! The VMIs waiting because teeguard refused their launcher pods ([`crate::decide::retry::waiting`]),
//! kept up to date by the VMI cache, and a wake-up for the retry task ([`crate::cluster::retry`]) when
//! one starts waiting or a report changes (a key may have freed).
//!
//! Where a waiting VMI's pod may go is first read from the VMI ([`waiting`]: its node selector and
//! affinity with KubeVirt's labels for its kind). virt-controller adds more to the pod (the
//! architecture, `kubevirt.io/schedulable`, the machine type, CPU model labels), so once teeguard has
//! refused one of the VMI's pods the pod's own node selector and affinity replace it
//! ([`WaitingVmis::refused`]): the retry task then hands the VMI no key on a node its pod cannot go to,
//! and the queue keeps none there for it (a VMI that could never take such a key would otherwise hold
//! it from every newer VMI).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use jiff::Timestamp;
use k8s_openapi::api::core::v1::PodSpec;
use teeguard_shared::{TeeKind, VirtualMachineInstance};
use tokio::sync::Notify;

use super::Observer;
use crate::decide::mutation::VmiRef;
use crate::decide::retry::{Waiting, pending, waiting};

/// The waiting VMIs, by namespace and name.
#[derive(Debug, Default)]
pub struct WaitingVmis {
    state: Mutex<State>,
    wake: Notify,
}

#[derive(Debug, Default)]
struct State {
    vmis: HashMap<(String, String), Waiting>,
    /// By VMI UID: where its last refused launcher pod could go (kept until the VMI no longer waits;
    /// the refusal usually comes before the VMI's status says it waits).
    placements: HashMap<String, PodSpec>,
}

impl WaitingVmis {
    /// Every waiting VMI, in no particular order.
    pub fn snapshot(&self) -> Vec<Waiting> {
        self.lock().vmis.values().cloned().collect()
    }

    /// teeguard refused a launcher pod of `vmi` whose node selector and affinity are in `pod`: its
    /// placement from now on.
    pub fn refused(&self, vmi: &VmiRef, pod: &PodSpec) {
        let placement = PodSpec {
            node_selector: pod.node_selector.clone(),
            affinity: pod.affinity.clone(),
            ..PodSpec::default()
        };
        let mut st = self.lock();
        if let Some(w) = st
            .vmis
            .get_mut(&(vmi.namespace.clone(), vmi.name.clone()))
            .filter(|w| w.vmi.uid == vmi.uid)
        {
            w.placement = placement.clone();
        }
        st.placements.insert(vmi.uid.clone(), placement);
    }

    /// How many VMIs wait, per kind.
    pub fn counts(&self) -> BTreeMap<TeeKind, usize> {
        let mut counts = BTreeMap::new();
        for w in self.lock().vmis.values() {
            *counts.entry(w.kind).or_default() += 1;
        }
        counts
    }

    /// Wait until a VMI starts waiting or a report changes (a wake-up that came while nobody waited is
    /// kept for the next call).
    pub async fn changed(&self) {
        self.wake.notified().await;
    }

    /// Wake the retry task.
    pub fn wake(&self) {
        self.wake.notify_one();
    }

    /// Note that `vmi` was retried at `at`, until the watch brings the annotation saying so.
    pub fn mark_retried(&self, vmi: &VmiRef, at: Timestamp) {
        if let Some(w) = self
            .lock()
            .vmis
            .get_mut(&(vmi.namespace.clone(), vmi.name.clone()))
        {
            w.retried = Some(at);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn key(vmi: &VirtualMachineInstance) -> (String, String) {
        (
            vmi.metadata.namespace.clone().unwrap_or_default(),
            vmi.metadata.name.clone().unwrap_or_default(),
        )
    }
}

impl Observer<VirtualMachineInstance> for WaitingVmis {
    fn stored(&self, vmi: &VirtualMachineInstance) {
        let key = Self::key(vmi);
        let mut st = self.lock();
        match waiting(vmi) {
            Some(mut w) => {
                if let Some(p) = st.placements.get(&w.vmi.uid) {
                    w.placement = p.clone();
                }
                if st.vmis.insert(key, w).is_none() {
                    drop(st);
                    self.wake();
                }
            }
            None => {
                // Not (or no longer) waiting: a refusal recorded for it since stays until it waits,
                // or until it leaves Pending (its pod was created).
                st.vmis.remove(&key);
                if let Some(uid) = vmi.metadata.uid.as_deref()
                    && !pending(vmi)
                {
                    st.placements.remove(uid);
                }
            }
        }
    }

    fn removed(&self, vmi: &VirtualMachineInstance) {
        let mut st = self.lock();
        st.vmis.remove(&Self::key(vmi));
        if let Some(uid) = vmi.metadata.uid.as_deref() {
            st.placements.remove(uid);
        }
    }
}
