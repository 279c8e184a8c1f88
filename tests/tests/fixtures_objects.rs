//! The object builders: shape, round trips through k8s-openapi, sizes, determinism, cross-references.

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::ResourceExt;
use pretty_assertions::assert_eq;
use serde_json::Value;
use teeguard_tests::fixtures::{
    self, EXEMPT_LABEL, KataTee, NFD_EXTENDED_RESOURCES, NodeBuilder, SNP_ESIDS, TDX_KEYS, Tee,
    VirtLauncherPod, Vmi, canonical, generated_suffix, object_uid, stable_hex, stable_uid,
    to_value,
};
use teeguard_tests::host;

fn label<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.labels().get(key).map(String::as_str)
}

fn annotation<'a>(pod: &'a Pod, key: &str) -> Option<&'a str> {
    pod.annotations().get(key).map(String::as_str)
}

fn spec(pod: &Pod) -> &k8s_openapi::api::core::v1::PodSpec {
    pod.spec.as_ref().expect("spec")
}

fn compute_request(pod: &Pod, name: &str) -> Option<String> {
    let compute = &spec(pod).containers[0];
    compute
        .resources
        .as_ref()?
        .requests
        .as_ref()?
        .get(name)
        .map(|q| q.0.clone())
}

fn compute_limit(pod: &Pod, name: &str) -> Option<String> {
    let compute = &spec(pod).containers[0];
    compute
        .resources
        .as_ref()?
        .limits
        .as_ref()?
        .get(name)
        .map(|q| q.0.clone())
}

fn json_len(value: &impl serde::Serialize) -> usize {
    serde_json::to_vec(value).expect("serialise").len()
}

#[test]
fn virt_launcher_pod_round_trips_through_k8s_openapi_without_loss() {
    for tee in Tee::ALL {
        for builder in [
            VirtLauncherPod::for_tee("vm", tee),
            VirtLauncherPod::for_tee("vm", tee).generated_name(),
            VirtLauncherPod::for_tee("vm", tee).running_on("node07"),
            VirtLauncherPod::for_tee("vm", tee)
                .large()
                .migration_target("node02"),
        ] {
            let raw = canonical(builder.to_value());
            let pod: Pod = serde_json::from_value(raw.clone()).expect("valid Pod");
            assert_eq!(
                canonical(to_value(&pod)),
                raw,
                "{tee:?}: a field was lost or renamed"
            );
        }
    }
}

#[test]
fn virt_launcher_pod_is_rendered_like_kubevirt() {
    let b = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx);
    let pod = b.build();
    let vmi_uid = object_uid("VirtualMachineInstance", "default", "tdx-vm");
    assert_eq!(b.vmi_uid(), vmi_uid);
    assert_eq!(
        pod.metadata.generate_name.as_deref(),
        Some("virt-launcher-tdx-vm-")
    );
    assert_eq!(pod.metadata.name, None, "no name at mutating admission");
    assert_eq!(pod.metadata.uid, None);
    assert_eq!(pod.metadata.creation_timestamp, None);
    assert_eq!(pod.metadata.namespace.as_deref(), Some("default"));
    assert_eq!(label(&pod, "kubevirt.io"), Some("virt-launcher"));
    assert_eq!(
        label(&pod, "kubevirt.io/created-by"),
        Some(vmi_uid.as_str())
    );
    assert_eq!(label(&pod, "vm.kubevirt.io/name"), Some("tdx-vm"));
    assert_eq!(
        label(&pod, "kubevirt.io/vm"),
        Some("tdx-vm"),
        "VMI labels are copied"
    );
    assert_eq!(annotation(&pod, "kubevirt.io/domain"), Some("tdx-vm"));
    assert_eq!(
        annotation(&pod, "kubectl.kubernetes.io/default-container"),
        Some("compute")
    );
    assert_eq!(
        annotation(&pod, "post.hook.backup.velero.io/container"),
        Some("compute")
    );
    assert!(
        annotation(&pod, "pre.hook.backup.velero.io/command")
            .is_some_and(|c| c.contains("--freeze"))
    );
    let owners = pod.metadata.owner_references.as_ref().expect("owners");
    assert_eq!(owners.len(), 1);
    let owner = &owners[0];
    assert_eq!(
        (
            owner.api_version.as_str(),
            owner.kind.as_str(),
            owner.name.as_str(),
            owner.uid.as_str()
        ),
        (
            "kubevirt.io/v1",
            "VirtualMachineInstance",
            "tdx-vm",
            vmi_uid.as_str()
        )
    );
    assert_eq!(
        (owner.controller, owner.block_owner_deletion),
        (Some(true), Some(true))
    );

    let spec = spec(&pod);
    let names: Vec<&str> = spec.containers.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["compute", "guest-console-log"]);
    let compute = &spec.containers[0];
    assert_eq!(compute.image.as_deref(), Some(fixtures::LAUNCHER_IMAGE));
    assert_eq!(
        compute
            .command
            .as_ref()
            .and_then(|c| c.first())
            .map(String::as_str),
        Some("/usr/bin/virt-launcher-monitor")
    );
    for device in [
        "devices.kubevirt.io/kvm",
        "devices.kubevirt.io/tun",
        "devices.kubevirt.io/vhost-net",
        "devices.kubevirt.io/tdx",
    ] {
        assert_eq!(
            compute_request(&pod, device).as_deref(),
            Some("1"),
            "{device}"
        );
        assert_eq!(
            compute_limit(&pod, device).as_deref(),
            Some("1"),
            "{device}"
        );
    }
    for r in ["cpu", "memory"] {
        assert!(
            compute_request(&pod, r).is_some() && compute_limit(&pod, r).is_some(),
            "{r}"
        );
    }
    assert_eq!(compute_request(&pod, TDX_KEYS), None);
    let init: Vec<&str> = spec
        .init_containers
        .as_ref()
        .expect("init")
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(init, ["container-disk-binary"]);
    let selector = spec.node_selector.as_ref().expect("selector");
    assert_eq!(
        selector.get("kubevirt.io/schedulable").map(String::as_str),
        Some("true")
    );
    assert_eq!(
        selector.get("kubevirt.io/tdx").map(String::as_str),
        Some("true")
    );
    assert_eq!(spec.node_name, None);
    assert_eq!(spec.hostname.as_deref(), Some("tdx-vm"));
    assert_eq!(spec.service_account_name.as_deref(), Some("default"));
    assert_eq!(spec.priority, Some(0));
    assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
    assert!(spec.tolerations.as_ref().is_some_and(|t| t.len() == 3));
    assert!(
        spec.security_context
            .as_ref()
            .is_some_and(|s| s.run_as_user == Some(107))
    );
    let gates: Vec<&str> = spec
        .readiness_gates
        .iter()
        .flatten()
        .map(|g| g.condition_type.as_str())
        .collect();
    assert_eq!(gates, ["kubevirt.io/virtual-machine-unpaused"]);
    let volumes: Vec<&str> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    assert!(
        volumes.contains(&"rootdisk") && volumes.contains(&"private"),
        "{volumes:?}"
    );
    assert_eq!(
        pod.status.as_ref().map(|s| s.phase.clone()),
        Some(None),
        "empty status at CREATE"
    );
}

#[test]
fn each_tee_kind_gets_kubevirts_selectors_and_devices() {
    let cases: [(Tee, &[&str], &[&str]); 7] = [
        (Tee::None, &[], &[]),
        (Tee::Tdx, &["kubevirt.io/tdx"], &["devices.kubevirt.io/tdx"]),
        (Tee::Sev, &["kubevirt.io/sev"], &["devices.kubevirt.io/sev"]),
        (
            Tee::SevEs,
            &["kubevirt.io/sev", "kubevirt.io/sev-es"],
            &["devices.kubevirt.io/sev"],
        ),
        (
            Tee::Snp,
            &["kubevirt.io/sev-snp"],
            &["devices.kubevirt.io/sev"],
        ),
        (Tee::SecureExecution, &[], &[]),
        (
            Tee::TdxAndSnp,
            &["kubevirt.io/tdx", "kubevirt.io/sev-snp"],
            &["devices.kubevirt.io/tdx", "devices.kubevirt.io/sev"],
        ),
    ];
    let tee_selectors = [
        "kubevirt.io/tdx",
        "kubevirt.io/sev",
        "kubevirt.io/sev-es",
        "kubevirt.io/sev-snp",
    ];
    for (tee, selectors, devices) in cases {
        let pod = fixtures::virt_launcher_pod(tee);
        let selector = spec(&pod).node_selector.clone().expect("selector");
        for s in tee_selectors {
            assert_eq!(
                selector.contains_key(s),
                selectors.contains(&s),
                "{tee:?} {s}"
            );
        }
        for d in ["devices.kubevirt.io/tdx", "devices.kubevirt.io/sev"] {
            assert_eq!(
                compute_request(&pod, d).is_some(),
                devices.contains(&d),
                "{tee:?} {d}"
            );
        }
        let arch = selector.get("kubernetes.io/arch").map(String::as_str);
        assert_eq!(
            arch,
            Some(if tee == Tee::SecureExecution {
                "s390x"
            } else {
                "amd64"
            })
        );
        assert_eq!(
            label(&pod, "vm.kubevirt.io/name"),
            Some(format!("{}-vm", tee.slug()).as_str())
        );
    }
    assert_eq!(Tee::Snp.misc_names(), ["sev_es"]);
    assert_eq!(Tee::SevEs.misc_names(), ["sev_es"]);
    assert_eq!(Tee::Sev.misc_names(), ["sev"]);
    assert!(Tee::SecureExecution.misc_names().is_empty());
}

#[test]
fn builder_options() {
    let pod = VirtLauncherPod::for_tee("vm1", Tee::Tdx)
        .namespace("tenant-a")
        .node_name("node09")
        .label("team", "blue")
        .annotation("example.com/note", "x")
        .request(TDX_KEYS, "2")
        .exempt()
        .build();
    assert_eq!(pod.metadata.namespace.as_deref(), Some("tenant-a"));
    assert_eq!(spec(&pod).node_name.as_deref(), Some("node09"));
    assert_eq!(label(&pod, "team"), Some("blue"));
    assert_eq!(label(&pod, EXEMPT_LABEL), Some("true"));
    assert_eq!(annotation(&pod, "example.com/note"), Some("x"));
    assert_eq!(compute_request(&pod, TDX_KEYS).as_deref(), Some("2"));
    assert_eq!(compute_limit(&pod, TDX_KEYS).as_deref(), Some("2"));
    assert_eq!(
        label(&pod, "kubevirt.io/created-by"),
        Some(object_uid("VirtualMachineInstance", "tenant-a", "vm1").as_str())
    );
    // A label overriding a default replaces it rather than duplicating it.
    let pod = VirtLauncherPod::new("vm1")
        .label("kubevirt.io/vm", "other")
        .build();
    assert_eq!(label(&pod, "kubevirt.io/vm"), Some("other"));
}

#[test]
fn named_and_running_pods() {
    let b = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx).generated_name();
    let pod = b.build();
    let name = format!("virt-launcher-tdx-vm-{}", generated_suffix(&b.vmi_uid()));
    assert_eq!(pod.metadata.name.as_deref(), Some(name.as_str()));
    assert_eq!(pod.metadata.uid, b.uid());
    assert_eq!(
        pod.metadata.uid.as_deref(),
        Some(object_uid("Pod", "default", &name).as_str())
    );
    assert!(pod.metadata.creation_timestamp.is_some());
    let status = pod.status.as_ref().expect("status");
    assert_eq!(status.phase.as_deref(), Some("Pending"));
    assert_eq!(status.qos_class.as_deref(), Some("Burstable"));

    let running = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
        .running_on("node03")
        .build();
    assert_eq!(
        running.metadata.name, pod.metadata.name,
        "same generated name"
    );
    assert_eq!(spec(&running).node_name.as_deref(), Some("node03"));
    let status = running.status.as_ref().expect("status");
    assert_eq!(status.phase.as_deref(), Some("Running"));
    let uid = running.metadata.uid.clone().expect("uid");
    for cs in status.container_statuses.iter().flatten() {
        assert_eq!(
            cs.container_id.as_deref(),
            Some(format!("containerd://{}", host::container_id(&uid, &cs.name)).as_str()),
            "container IDs match the simulated host's cgroup names"
        );
    }
    // The VMI names this pod as its active pod.
    let vmi = Vmi::new("tdx-vm").tee(Tee::Tdx).node("node03").build();
    assert_eq!(
        vmi.pointer(&format!("/status/activePods/{uid}"))
            .and_then(Value::as_str),
        Some("node03")
    );
}

#[test]
fn json_sizes() {
    let default = fixtures::virt_launcher_pod(Tee::Tdx);
    let large = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx).large().build();
    let (d, l) = (json_len(&default), json_len(&large));
    println!("virt-launcher pod: {d} bytes, large: {l} bytes");
    assert!(
        (5_000..=7_500).contains(&d),
        "default pod is {d} bytes, expected about 6 KB"
    );
    assert!(
        (18_000..=23_000).contains(&l),
        "large pod is {l} bytes, expected about 20 KB"
    );
    let spec = spec(&large);
    assert!(spec.volumes.as_ref().is_some_and(|v| v.len() > 40));
    assert!(
        spec.containers[0]
            .env
            .as_ref()
            .is_some_and(|e| e.len() > 50)
    );
}

#[test]
fn vmis_for_every_kind() {
    let expected = [
        (Tee::None, None),
        (Tee::Tdx, Some(serde_json::json!({"tdx": {}}))),
        (Tee::Sev, Some(serde_json::json!({"sev": {}}))),
        (
            Tee::SevEs,
            Some(serde_json::json!({"sev": {"policy": {"encryptedState": true}}})),
        ),
        (Tee::Snp, Some(serde_json::json!({"snp": {}}))),
        (Tee::SecureExecution, Some(serde_json::json!({}))),
        (
            Tee::TdxAndSnp,
            Some(serde_json::json!({"tdx": {}, "snp": {}})),
        ),
    ];
    for (tee, launch_security) in expected {
        let vmi = fixtures::vmi(tee);
        assert_eq!(vmi["apiVersion"], "kubevirt.io/v1");
        assert_eq!(vmi["kind"], "VirtualMachineInstance");
        assert_eq!(
            vmi.pointer("/spec/domain/launchSecurity").cloned(),
            launch_security,
            "{tee:?}"
        );
        let name = format!("{}-vm", tee.slug());
        assert_eq!(vmi["metadata"]["name"], name.as_str());
        assert_eq!(
            vmi["metadata"]["uid"],
            object_uid("VirtualMachineInstance", "default", &name).as_str()
        );
        assert_eq!(vmi["status"]["phase"], "Running");
        assert_eq!(vmi["status"]["nodeName"], "node01");
    }
    let scheduling = Vmi::new("x")
        .tee(Tee::Tdx)
        .namespace("ns")
        .scheduling()
        .exempt()
        .build();
    assert_eq!(scheduling["status"]["phase"], "Scheduling");
    assert!(scheduling.pointer("/status/nodeName").is_none());
    assert_eq!(scheduling["metadata"]["labels"][EXEMPT_LABEL], "true");
    assert_eq!(scheduling["metadata"]["namespace"], "ns");
}

#[test]
fn pods_that_must_not_get_a_key_and_migration_targets() {
    let binding = fixtures::storage_binding_pod("tdx-vm", Tee::Tdx);
    assert_eq!(label(&binding, "kubevirt.io"), Some("virt-launcher"));
    assert_eq!(
        annotation(&binding, "kubevirt.io/ephemeral-provisioning"),
        Some("true")
    );
    assert_eq!(spec(&binding).containers.len(), 1);
    assert_eq!(
        spec(&binding).containers[0]
            .command
            .as_ref()
            .and_then(|c| c.get(2))
            .map(String::as_str),
        Some("echo")
    );

    let hotplug = fixtures::hotplug_pod("tdx-vm", "node01");
    assert_eq!(label(&hotplug, "kubevirt.io"), Some("hotplug-disk"));
    assert_eq!(
        hotplug.metadata.generate_name.as_deref(),
        Some("hp-volume-")
    );
    let owner = &hotplug.metadata.owner_references.as_ref().expect("owner")[0];
    assert_eq!(owner.kind, "Pod");
    assert!(owner.name.starts_with("virt-launcher-tdx-vm-"));

    let export = fixtures::export_pod("exp");
    assert_eq!(label(&export, "kubevirt.io"), Some("virt-exporter"));
    assert_eq!(export.metadata.name.as_deref(), Some("virt-export-exp"));

    let b = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx).migration_target("node02");
    let target = b.build();
    assert_eq!(
        label(&target, "kubevirt.io/migrationJobUID"),
        Some(b.migration_uid().as_str())
    );
    let affinity = spec(&target).affinity.as_ref().expect("affinity");
    let anti = affinity.pod_anti_affinity.as_ref().expect("anti-affinity");
    assert_eq!(
        anti.required_during_scheduling_ignored_during_execution
            .as_ref()
            .map(Vec::len),
        Some(1)
    );
    assert_eq!(
        fixtures::migration_target_pod("tdx-vm", Tee::Tdx, "node02"),
        target
    );
}

#[test]
fn kata_pods_and_runtime_classes() {
    for (tee, resource, class, misc) in [
        (KataTee::Tdx, TDX_KEYS, "kata-qemu-tdx", "tdx"),
        (KataTee::Snp, SNP_ESIDS, "kata-qemu-snp", "sev_es"),
    ] {
        let pod = fixtures::kata_pod("demo", tee);
        let spec = spec(&pod);
        assert_eq!(spec.runtime_class_name.as_deref(), Some(class));
        let overhead = spec.overhead.as_ref().expect("overhead");
        assert_eq!(overhead.get(resource), Some(&Quantity("1".into())));
        assert!(overhead.contains_key("cpu") && overhead.contains_key("memory"));
        let rc = fixtures::kata_runtime_class(tee);
        assert_eq!(rc.metadata.name.as_deref(), Some(class));
        assert_eq!(rc.handler, class);
        let pod_fixed = rc
            .overhead
            .as_ref()
            .and_then(|o| o.pod_fixed.as_ref())
            .expect("podFixed");
        assert_eq!(pod_fixed, overhead, "the pod carries the class's overhead");
        assert_eq!(tee.misc_name(), misc);
    }
}

#[test]
fn nodes_with_and_without_nfd_resources() {
    let plain: Node = fixtures::node("node05");
    let labels = plain.metadata.labels.clone().expect("labels");
    assert_eq!(
        labels.get("kubernetes.io/hostname").map(String::as_str),
        Some("node05")
    );
    assert_eq!(
        labels.get("kubevirt.io/schedulable").map(String::as_str),
        Some("true")
    );
    assert!(labels.contains_key("topology.kubernetes.io/zone"));
    assert!(!labels.contains_key("kubevirt.io/tdx"));

    let tdx = fixtures::tdx_node("node01", 31, false);
    let labels = tdx.metadata.labels.clone().expect("labels");
    assert_eq!(
        labels.get("kubevirt.io/tdx").map(String::as_str),
        Some("true")
    );
    assert_eq!(
        labels
            .get("feature.node.kubernetes.io/cpu-security.tdx.enabled")
            .map(String::as_str),
        Some("true")
    );
    let status = tdx.status.as_ref().expect("status");
    let capacity = status.capacity.as_ref().expect("capacity");
    assert!(
        ["cpu", "memory", "pods"]
            .iter()
            .all(|k| capacity.contains_key(*k))
    );
    assert_eq!(
        capacity.get("devices.kubevirt.io/tdx"),
        Some(&Quantity("31".into()))
    );
    assert!(!capacity.contains_key(TDX_KEYS));
    assert!(
        tdx.metadata
            .annotations
            .as_ref()
            .is_none_or(|a| !a.contains_key(NFD_EXTENDED_RESOURCES))
    );

    let nfd = fixtures::tdx_node("node01", 31, true);
    let status = nfd.status.as_ref().expect("status");
    assert_eq!(
        status.capacity.as_ref().and_then(|c| c.get(TDX_KEYS)),
        Some(&Quantity("31".into()))
    );
    assert_eq!(
        status.allocatable.as_ref().and_then(|c| c.get(TDX_KEYS)),
        Some(&Quantity("31".into()))
    );
    assert_eq!(
        nfd.annotations()
            .get(NFD_EXTENDED_RESOURCES)
            .map(String::as_str),
        Some(TDX_KEYS)
    );

    let sev = NodeBuilder::new("amd1")
        .sev(99, 410)
        .nfd_extended_resource(true)
        .zone("zone-b")
        .build();
    let labels = sev.metadata.labels.clone().expect("labels");
    for l in [
        "kubevirt.io/sev",
        "kubevirt.io/sev-es",
        "kubevirt.io/sev-snp",
    ] {
        assert_eq!(labels.get(l).map(String::as_str), Some("true"), "{l}");
    }
    assert_eq!(
        labels
            .get("topology.kubernetes.io/zone")
            .map(String::as_str),
        Some("zone-b")
    );
    let capacity = sev
        .status
        .as_ref()
        .and_then(|s| s.capacity.clone())
        .expect("capacity");
    assert_eq!(capacity.get(SNP_ESIDS), Some(&Quantity("410".into())));

    let raw = canonical(
        NodeBuilder::new("n")
            .tdx(4)
            .nfd_extended_resource(true)
            .to_value(),
    );
    let typed: Node = serde_json::from_value(raw.clone()).expect("node");
    assert_eq!(canonical(to_value(&typed)), raw);
}

#[test]
fn identities_are_deterministic_and_well_formed() {
    let uid = stable_uid("x");
    assert_eq!(uid, stable_uid("x"));
    assert_ne!(uid, stable_uid("y"));
    let parts: Vec<&str> = uid.split('-').collect();
    assert_eq!(
        parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
        [8, 4, 4, 4, 12]
    );
    assert!(parts[2].starts_with('4'));
    assert!(matches!(
        parts[3].chars().next(),
        Some('8' | '9' | 'a' | 'b')
    ));
    assert_eq!(stable_hex("seed", 64).len(), 64);
    assert_eq!(stable_hex("seed", 7).len(), 7);
    let suffix = generated_suffix("vmi");
    assert_eq!(suffix.len(), 5);
    assert!(
        suffix
            .chars()
            .all(|c| "bcdfghjklmnpqrstvwxz2456789".contains(c))
    );
    assert_eq!(fixtures::timestamp(0), fixtures::BASE_TIME);
    assert_eq!(fixtures::timestamp(61), "2025-06-02T09:31:01Z");
    let a = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
        .large()
        .running_on("n")
        .to_value();
    let b = VirtLauncherPod::for_tee("tdx-vm", Tee::Tdx)
        .large()
        .running_on("n")
        .to_value();
    assert_eq!(a, b);
}
