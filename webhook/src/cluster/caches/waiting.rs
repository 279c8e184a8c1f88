//! The VMIs waiting because teeguard refused their launcher pods ([`crate::decide::retry::waiting`]),
//! kept up to date by the VMI cache, and a wake-up for the retry task ([`crate::cluster::retry`]) when
//! one starts waiting or a report changes (a key may have freed).

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use jiff::Timestamp;
use teeguard_shared::{TeeKind, VirtualMachineInstance};
use tokio::sync::Notify;

use super::Observer;
use crate::decide::mutation::VmiRef;
use crate::decide::retry::{Waiting, waiting};

/// The waiting VMIs, by namespace and name.
#[derive(Debug, Default)]
pub struct WaitingVmis {
    vmis: Mutex<HashMap<(String, String), Waiting>>,
    wake: Notify,
}

impl WaitingVmis {
    /// Every waiting VMI, in no particular order.
    pub fn snapshot(&self) -> Vec<Waiting> {
        self.lock().values().cloned().collect()
    }

    /// How many VMIs wait, per kind.
    pub fn counts(&self) -> BTreeMap<TeeKind, usize> {
        let mut counts = BTreeMap::new();
        for w in self.lock().values() {
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
            .get_mut(&(vmi.namespace.clone(), vmi.name.clone()))
        {
            w.retried = Some(at);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(String, String), Waiting>> {
        self.vmis.lock().unwrap_or_else(|e| e.into_inner())
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
        match waiting(vmi) {
            Some(w) => {
                if self.lock().insert(key, w).is_none() {
                    self.wake();
                }
            }
            None => {
                self.lock().remove(&key);
            }
        }
    }

    fn removed(&self, vmi: &VirtualMachineInstance) {
        self.lock().remove(&Self::key(vmi));
    }
}
