//! The candidate scan of a pod CREATE without `spec.nodeName` stops at the first node that fits, and
//! looks first at the node that fitted the last pod of the same TEE kind (the ledger's fit hint). The
//! verdict never depends on it; how many reports are read does. Driven through `review_validation`
//! with the offline lookups (nodes in name order) wrapped to count report reads.

use std::collections::BTreeMap;
use std::future::Future;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use serde_json::Value;
use teeguard_shared::vmi::VirtualMachineInstance;
use teeguard_shared::{Config, TeeCapacity, TeeKind};
use teeguard_tests::fixtures::{
    AdmissionReviewBuilder, NodeBuilder, ReportBuilder, TDX_KEYS, Tee, VirtLauncherPod, Vmi,
    owned_by,
};
use teeguard_webhook::cluster::caches::{Labels, Lookups, NodeFilter, PodLookup};
use teeguard_webhook::decide::ledger::Ledger;
use teeguard_webhook::decide::mutation::{VmiLookup, VmiRef};
use teeguard_webhook::review::FileLookups;
use teeguard_webhook::web::handlers::validate::{ValidationContext, review_validation};

const VMI_UID: &str = "5f0c1a2e-0000-4000-8000-000000000001";

/// Lookups that count the node reports read (one per candidate node looked at).
struct Counting {
    inner: FileLookups,
    reports: AtomicUsize,
}

impl Counting {
    fn take(&self) -> usize {
        self.reports.swap(0, Ordering::SeqCst)
    }
}

impl Lookups for Counting {
    fn namespace_labels(
        &self,
        namespace: &str,
    ) -> impl Future<Output = Result<Option<BTreeMap<String, String>>, String>> + Send {
        self.inner.namespace_labels(namespace)
    }

    fn vmi(&self, vmi: &VmiRef) -> impl Future<Output = VmiLookup> + Send {
        self.inner.vmi(vmi)
    }

    fn launcher_pod(
        &self,
        namespace: &str,
        name: &str,
        uid: &str,
    ) -> impl Future<Output = PodLookup> + Send {
        self.inner.launcher_pod(namespace, name, uid)
    }

    fn tee_capacity(&self, node: &str) -> Option<Arc<TeeCapacity>> {
        self.reports.fetch_add(1, Ordering::SeqCst);
        self.inner.tee_capacity(node)
    }

    fn scan_nodes(
        &self,
        filter: NodeFilter<'_>,
        first: Option<&str>,
        visit: &mut dyn FnMut(&str, &Labels) -> ControlFlow<()>,
    ) {
        self.inner.scan_nodes(filter, first, visit)
    }
}

/// Ten TDX nodes `n0`..`n9`, all full except those in `free` (one key each).
fn cluster(free: &[&str]) -> Counting {
    let mut l = FileLookups::default();
    l.add_namespace("default".into(), BTreeMap::new());
    let mut vmi = Vmi::new("tdx-vm").tee(Tee::Tdx).build();
    vmi["metadata"]["uid"] = Value::from(VMI_UID);
    l.add_vmi(serde_json::from_value::<VirtualMachineInstance>(vmi).expect("VMI"));
    for i in 0..10 {
        let name = format!("n{i}");
        let node = NodeBuilder::new(&name).tdx(64).build();
        l.add_node(name.clone(), node.metadata.labels.unwrap_or_default());
        let keys = u64::from(free.contains(&name.as_str()));
        let report = ReportBuilder::new(&name).kind(TeeKind::Tdx, 64, keys);
        l.add_tee_capacity(serde_json::from_value(report.to_value()).expect("report"));
    }
    Counting {
        inner: l,
        reports: AtomicUsize::new(0),
    }
}

/// The body of a pod CREATE review of a mutated TDX virt-launcher pod (no node yet).
fn create_review() -> Vec<u8> {
    let pod = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
        .request(TDX_KEYS, "1")
        .annotation("misc-max.teeguard.dev/compute", "tdx 1")
        .generated_name();
    let review = AdmissionReviewBuilder::create(owned_by(&pod.to_value(), VMI_UID)).build();
    serde_json::to_vec(&review).expect("review")
}

/// Review once; the audit reason and how many reports were read.
async fn review(lookups: &Counting, ledger: &Ledger) -> (String, usize) {
    let config = Config::default();
    let ctx = ValidationContext {
        config: &config,
        ledger,
        events: None,
        metrics: None,
        shared: None,
        promises: None,
        waiting: None,
    };
    let reviewed = review_validation(&create_review(), lookups, &ctx)
        .await
        .expect("reviewed");
    let json: Value = serde_json::from_slice(&reviewed.response.to_json()).expect("json");
    let reason = json["response"]["auditAnnotations"]["reason"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (reason, lookups.take())
}

#[tokio::test]
async fn the_node_that_fitted_last_is_looked_at_first() {
    let ledger = Ledger::new(std::time::Duration::from_secs(30));
    assert_eq!(ledger.fit_hint(TeeKind::Tdx), None);

    // Only n7 has a key: the first scan reads n0..n7 (name order here), then n7 alone.
    let only_n7 = cluster(&["n7"]);
    assert_eq!(review(&only_n7, &ledger).await, ("enough-keys".into(), 8));
    assert_eq!(ledger.fit_hint(TeeKind::Tdx).as_deref(), Some("n7"));
    assert_eq!(ledger.fit_hint(TeeKind::Sev), None, "hints are per kind");
    assert_eq!(review(&only_n7, &ledger).await, ("enough-keys".into(), 1));

    // n7 fills up and n3 frees a key: n7 first (full), then n0..n3 in order, n7 not read twice.
    let only_n3 = cluster(&["n3"]);
    assert_eq!(review(&only_n3, &ledger).await, ("enough-keys".into(), 5));
    assert_eq!(ledger.fit_hint(TeeKind::Tdx).as_deref(), Some("n3"));
    assert_eq!(review(&only_n3, &ledger).await, ("enough-keys".into(), 1));

    // Nothing fits: every node is read once, the hinted one included, and the hint stays.
    let full = cluster(&[]);
    assert_eq!(
        review(&full, &ledger).await,
        ("insufficient-keys".into(), 10)
    );
    assert_eq!(ledger.fit_hint(TeeKind::Tdx).as_deref(), Some("n3"));
}
