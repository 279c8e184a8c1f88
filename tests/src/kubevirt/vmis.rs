//! VirtualMachineInstances and VirtualMachines as a user writes them (the shape of
//! `../shared/kubevirt/vmis/`: a containerDisk and a cloud-init disk), created through the API server,
//! where the virt-api stand-in ([`super::virt_api`]) defaults and validates them as virt-api would.

use kube::api::{DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Api, Client};
use serde_json::{Value, json};

use super::images::CONTAINER_DISK;
use crate::fixtures::Tee;

/// The size of a test VM: `cores` vCPUs (KubeVirt requests `cores / 10` CPUs for the launcher pod, its
/// default `cpuAllocationRatio`) and `memory` of guest memory (the pod requests it plus KubeVirt's
/// overhead, about 280 MiB).
#[derive(Clone, Copy, Debug)]
pub struct Size {
    /// vCPUs.
    pub cores: u32,
    /// Guest memory (a Kubernetes quantity).
    pub memory: &'static str,
}

impl Size {
    /// The samples' size: 2 vCPUs (launcher request 200m), 2Gi.
    pub const SAMPLE: Size = Size {
        cores: 2,
        memory: "2Gi",
    };
    /// A small VM, for runs of many on one node: 1 vCPU (100m), 128Mi.
    pub const SMALL: Size = Size {
        cores: 1,
        memory: "128Mi",
    };
}

/// A VMI of kind `tee` named `name`, as a user writes it (not defaulted).
pub fn vmi(name: &str, tee: Tee, size: Size) -> Value {
    let mut v = json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "labels": {"teeguard.test/kind": tee.slug()}},
        "spec": spec(tee, size)
    });
    if let Some(ls) = tee.launch_security() {
        v["spec"]["domain"]["launchSecurity"] = ls;
    }
    v
}

/// A VirtualMachine of kind `tee` named `name` with `runStrategy` `strategy` (`Always`, `Halted`, ...),
/// as a user writes it.
pub fn vm(name: &str, tee: Tee, size: Size, strategy: &str) -> Value {
    let mut template = json!({
        "metadata": {"labels": {"teeguard.test/kind": tee.slug(), "kubevirt.io/vm": name}},
        "spec": spec(tee, size)
    });
    if let Some(ls) = tee.launch_security() {
        template["spec"]["domain"]["launchSecurity"] = ls;
    }
    json!({
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachine",
        "metadata": {"name": name},
        "spec": {"runStrategy": strategy, "template": template}
    })
}

fn spec(tee: Tee, size: Size) -> Value {
    let mut spec = json!({
        "domain": {
            "cpu": {"cores": size.cores},
            "memory": {"guest": size.memory},
            "devices": {"disks": [
                {"name": "containerdisk", "disk": {"bus": "virtio"}},
                {"name": "cloudinitdisk", "disk": {"bus": "virtio"}}
            ]}
        },
        "volumes": [
            {"name": "containerdisk", "containerDisk": {"image": CONTAINER_DISK}},
            {"name": "cloudinitdisk", "cloudInitNoCloud": {
                "userData": "#cloud-config\npassword: fedora\nchpasswd: { expire: False }\n"}}
        ]
    });
    // Confidential VMs boot with UEFI (the samples turn Secure Boot off, as TDX/SEV guests need).
    if tee.launch_security().is_some() {
        spec["domain"]["firmware"] = json!({"bootloader": {"efi": {"secureBoot": false}}});
    }
    spec
}

/// The API of a KubeVirt kind (`VirtualMachineInstance`, `VirtualMachine`) in `namespace`.
pub fn api(client: &Client, namespace: &str, kind: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk("kubevirt.io", "v1", kind));
    Api::namespaced_with(client.clone(), namespace, &ar)
}

/// Create `obj` (a VMI or VM from [`vmi`] / [`vm`]) in `namespace`; the stored object.
pub async fn create(client: &Client, namespace: &str, obj: &Value) -> kube::Result<DynamicObject> {
    let kind = obj["kind"].as_str().unwrap_or("VirtualMachineInstance");
    let dynamic: DynamicObject =
        serde_json::from_value(obj.clone()).map_err(kube::Error::SerdeError)?;
    api(client, namespace, kind)
        .create(&PostParams::default(), &dynamic)
        .await
}
