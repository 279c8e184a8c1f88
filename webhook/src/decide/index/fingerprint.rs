//! A hash of everything an index decides by (the simulation's model checker merges the states it
//! reached twice).

use std::collections::HashMap;

use teeguard_shared::TeeKind;
use teeguard_shared::reservation::KeyReservation;

use super::Index;

impl Index {
    /// Feed everything the index holds, in a canonical order, to `h`: two indexes that decide alike
    /// hash alike (the simulation's model checker merges the states it reached twice). When each
    /// node's object last changed is left out: the model checker trims with no quiet time.
    pub fn fingerprint(&self, h: &mut impl std::hash::Hasher) {
        use std::hash::Hash;
        fn sorted<K: Ord, V>(m: &HashMap<K, V>) -> Vec<(&K, &V)> {
            let mut v: Vec<(&K, &V)> = m.iter().collect();
            v.sort_by(|a, b| a.0.cmp(b.0));
            v
        }
        fn entry(e: &KeyReservation, h: &mut impl std::hash::Hasher) {
            (&e.pod_uid, &e.vmi_uid, e.reason, e.tdx, e.sev, e.sev_es).hash(h);
            e.admitted_at.0.hash(h);
        }
        self.synced.hash(h);
        for (name, n) in &self.nodes {
            name.hash(h);
            n.labels.hash(h);
            n.lease.hash(h);
            if let Some(r) = &n.report {
                for kind in TeeKind::ALL {
                    r.kind(kind)
                        .map(|k| (k.capacity, k.free, k.external))
                        .hash(h);
                }
                r.counted_pods.hash(h);
                r.heartbeat_time.as_ref().map(|t| t.0).hash(h);
                r.accounting.hash(h);
            }
            for (e, at) in n.seen_holds() {
                entry(e, h);
                at.hash(h);
            }
        }
        for (uid, p) in sorted(&self.pods) {
            (uid, &p.node, p.ended, p.keys, &p.vmi).hash(h);
        }
        for (uid, v) in sorted(&self.vmis) {
            (uid, v.pending).hash(h);
            if let Some(w) = &v.waiting {
                (&w.vmi.uid, w.kind, w.since, &w.placement.node_selector).hash(h);
            }
        }
        sorted(&self.gone_pods).hash(h);
        sorted(&self.gone_vmis).hash(h);
        sorted(&self.counted).hash(h);
        for (uid, p) in sorted(&self.placements) {
            (uid, &p.node_selector).hash(h);
        }
    }
}
