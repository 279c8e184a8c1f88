//! DRA mode in the KubeVirt world: the chart's DeviceClasses, and ending a DRA test while the agents
//! (the DRA drivers) still run, so the kubelet can unprepare the claims of the pods it stops.

use k8s_openapi::api::resource::v1::DeviceClass;
use kube::Api;
use kube::api::DeleteParams;
use teeguard_tests::realcluster::create_or_keep;

use super::{KubeVirtWorld, remove_vmis};
use crate::chart_support;

impl KubeVirtWorld {
    /// Create the DeviceClasses exactly as the chart renders them in DRA mode; their names.
    pub async fn create_device_classes(&self) -> Vec<String> {
        let rendered = chart_support::render_for(chart_support::DRA_KUBE_VERSION, "dra", &[]);
        let classes: Api<DeviceClass> = Api::all(self.cluster.client.clone());
        let mut names = Vec::new();
        for doc in rendered.iter().filter(|d| d["kind"] == "DeviceClass") {
            let class: DeviceClass =
                serde_json::from_value(doc.clone()).expect("the chart's DeviceClass");
            let name = class.metadata.name.clone().unwrap_or_default();
            create_or_keep(&classes, &class)
                .await
                .unwrap_or_else(|e| panic!("create DeviceClass {name}: {e}"));
            names.push(name);
        }
        assert!(
            !names.is_empty(),
            "the chart renders DeviceClasses in DRA mode"
        );
        names
    }

    /// End a DRA test: the VMIs (and their pods) gone while the drivers run, then the DeviceClasses.
    pub async fn end_dra(&self, classes: &[String]) {
        remove_vmis(&self.cluster, &self.ns).await;
        let api: Api<DeviceClass> = Api::all(self.cluster.client.clone());
        for name in classes {
            let _ = api.delete(name, &DeleteParams::default()).await;
        }
    }
}
