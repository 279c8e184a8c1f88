//! Every label, annotation, condition type and reason teeguard reads or writes, in one place.

/// Label that exempts a namespace, a VMI or a pod from teeguard (`"true"`).
pub const EXEMPT_LABEL: &str = "teeguard.dev/exempt";
/// Namespace label that overrides the admission mode for that namespace (`enforce` or `warn`).
pub const MODE_LABEL: &str = "teeguard.dev/mode";

/// Prefix of the runtime-neutral misc.max annotation: `misc-max.teeguard.dev/<container>: "tdx 1"`.
/// A node-side enforcer (an NRI plugin or an OCI hook) writes the value into the container's `misc.max`.
pub const MISC_MAX_ANNOTATION_PREFIX: &str = "misc-max.teeguard.dev/";
/// CRI-O's unified cgroup annotation, older spelling: `io.kubernetes.cri-o.UnifiedCgroup.<container>`.
pub const CRIO_UNIFIED_LEGACY_PREFIX: &str = "io.kubernetes.cri-o.UnifiedCgroup.";
/// CRI-O's unified cgroup annotation, newer spelling: `unified-cgroup.crio.io/<container>`.
pub const CRIO_UNIFIED_PREFIX: &str = "unified-cgroup.crio.io/";

/// Every prefix of an annotation that sets a container's cgroup limits (see [`is_limit_annotation`]).
pub const LIMIT_ANNOTATION_PREFIXES: [&str; 3] = [
    MISC_MAX_ANNOTATION_PREFIX,
    CRIO_UNIFIED_LEGACY_PREFIX,
    CRIO_UNIFIED_PREFIX,
];

/// The runtime-neutral misc.max annotation key for a container.
pub fn misc_max_annotation(container: &str) -> String {
    [MISC_MAX_ANNOTATION_PREFIX, container].concat()
}

/// Whether an annotation key is one that sets a container's cgroup limits (teeguard's own or CRI-O's),
/// which a user must not set themselves.
pub fn is_limit_annotation(key: &str) -> bool {
    LIMIT_ANNOTATION_PREFIXES
        .iter()
        .any(|prefix| key.starts_with(prefix))
}

/// KubeVirt: the label whose value says what a KubeVirt pod is.
pub const KUBEVIRT_LABEL: &str = "kubevirt.io";
/// Value of [`KUBEVIRT_LABEL`] on virt-launcher pods (and on the storage-binding pod).
pub const VIRT_LAUNCHER: &str = "virt-launcher";
/// Value of [`KUBEVIRT_LABEL`] on hotplug volume pods.
pub const HOTPLUG_DISK: &str = "hotplug-disk";
/// Value of [`KUBEVIRT_LABEL`] on VM export pods.
pub const VIRT_EXPORTER: &str = "virt-exporter";
/// Label carrying the owning VMI's UID on virt-launcher pods.
pub const CREATED_BY_LABEL: &str = "kubevirt.io/created-by";
/// Annotation carrying the VMI's name on virt-launcher pods.
pub const DOMAIN_ANNOTATION: &str = "kubevirt.io/domain";
/// Annotation marking the temporary storage-binding pod (`"true"`), which must not get a key.
pub const EPHEMERAL_PROVISIONING_ANNOTATION: &str = "kubevirt.io/ephemeral-provisioning";
/// Label on migration-target pods (they do need a key on the target node).
pub const MIGRATION_JOB_LABEL: &str = "kubevirt.io/migrationJobUID";
/// The container of a virt-launcher pod that runs QEMU and is charged the key.
pub const COMPUTE_CONTAINER: &str = "compute";
/// The domain of KubeVirt's device-plugin resources (`devices.kubevirt.io/kvm`, `/tun`, `/vhost-net`,
/// `/tdx`, `/sev`, ...), which virt-launcher pods request and KubeVirt's device plugins advertise. No
/// TEE key resource of teeguard's may live there, so admission decisions never read them.
pub const KUBEVIRT_DEVICE_DOMAIN: &str = "devices.kubevirt.io";
/// Name prefix of virt-launcher pods (`generateName: virt-launcher-<vmi>-`).
pub const VIRT_LAUNCHER_NAME_PREFIX: &str = "virt-launcher-";

/// Node Feature Discovery's node annotation listing the extended resources it owns (comma-separated).
pub const NFD_EXTENDED_RESOURCES_ANNOTATION: &str = "nfd.node.kubernetes.io/extended-resources";
/// teeguard's node annotation listing the extended resources the agent added (comma-separated), so it
/// removes only what it added.
pub const AGENT_EXTENDED_RESOURCES_ANNOTATION: &str = "teeguard.dev/extended-resources";

/// Field manager name the agent uses for server-side apply.
pub const AGENT_FIELD_MANAGER: &str = "teeguard-agent";
/// Label on each agent's heartbeat Lease (`coordination.k8s.io/v1`, named after its node, in the
/// agent's namespace); the webhook watches the Leases carrying it.
pub const AGENT_LEASE_LABEL: &str = "teeguard.dev/agent-heartbeat";
/// Field manager / reporting controller name the webhook uses.
pub const WEBHOOK_FIELD_MANAGER: &str = "teeguard-webhook";
/// The domain every teeguard admission webhook's name ends in (`validate.pods.teeguard.dev`): how a
/// KubeVirt condition quoting the API server's answer tells that teeguard refused a pod.
pub const WEBHOOK_NAME_SUFFIX: &str = ".teeguard.dev";
/// The webhook writes this annotation (RFC 3339 time) on a VMI whose launcher pod it refused, when a
/// key is free for it again: the change makes virt-controller create the pod at once instead of after
/// its backoff.
pub const RETRIED_ANNOTATION: &str = "teeguard.dev/retried-at";

/// Condition types in a `TeeCapacity` status.
pub mod conditions {
    /// True when the kernel's misc files were read and the figures are current.
    pub const KERNEL_READABLE: &str = "KernelReadable";
    /// True when the host has capacity for at least one TEE kind.
    pub const TEE_HARDWARE: &str = "TeeHardware";
    /// True when usage is attributed from per-pod misc cgroup files; False when the misc controller is
    /// not delegated to pod cgroups and the agent counts running pods instead.
    pub const PER_POD_ACCOUNTING: &str = "PerPodAccounting";
    /// True when the agent advertises the extended resources on the Node; False when disabled or owned by
    /// another manager (for example NFD).
    pub const ADVERTISING: &str = "Advertising";
    /// True when the agent applies each pod's key limit (`misc.max`) through NRI or the cgroup writer.
    pub const ENFORCING: &str = "Enforcing";
    /// DRA mode: True when the Node's allocatable still names a kind's extended resource (another writer
    /// advertises it), so the scheduler bypasses DRA for that resource on this node.
    pub const DRA_BYPASSED: &str = "DraBypassed";
    /// DRA mode: True when the kubelet registered the agent's DRA driver and the node's ResourceSlices
    /// are published.
    pub const DRA_DRIVER_READY: &str = "DraDriverReady";
}

/// Reasons used in conditions, events and audit annotations.
pub mod reasons {
    /// Condition reason: the misc files were read.
    pub const SCANNED: &str = "Scanned";
    /// Condition reason: the misc files were read, but the kernel has no root `misc.current` (Linux 6.1,
    /// RHEL 9's 5.14): the usage is the top-level cgroups', which miss keys charged to the root cgroup.
    pub const ROOT_USAGE_NOT_SHOWN: &str = "RootUsageNotShown";
    /// Condition reason: the misc files were read, but the kernel shows no usage (no root
    /// `misc.current`, and the misc controller not enabled below the root).
    pub const USAGE_NOT_SHOWN: &str = "UsageNotShown";
    /// Condition reason: a misc file could not be read or parsed.
    pub const SCAN_FAILED: &str = "ScanFailed";
    /// Condition reason: no TEE kind has capacity on this host.
    pub const NO_TEE_HARDWARE: &str = "NoTeeHardware";
    /// Condition reason: at least one TEE kind has capacity.
    pub const TEE_CAPACITY_FOUND: &str = "TeeCapacityFound";
    /// Condition reason: pod cgroups carry misc files.
    pub const MISC_DELEGATED: &str = "MiscControllerDelegated";
    /// Condition reason: pod cgroups carry no misc files; running pods are counted instead.
    pub const MISC_NOT_DELEGATED: &str = "MiscControllerNotDelegated";
    /// Condition reason: the agent advertises the extended resources.
    pub const ADVERTISED: &str = "Advertised";
    /// Condition reason: advertising is switched off in the configuration.
    pub const ADVERTISING_DISABLED: &str = "AdvertisingDisabled";
    /// Condition reason: another manager (NFD) owns the extended resource on this node.
    pub const OWNED_BY_OTHER: &str = "OwnedByAnotherManager";
    /// Condition reason: DRA mode, the agent advertises no extended resource.
    pub const DRA_MODE: &str = "DraMode";
    /// Condition reason: the Node's allocatable names a kind's extended resource.
    pub const EXTENDED_RESOURCE_ADVERTISED: &str = "ExtendedResourceAdvertised";
    /// Condition reason: the Node's allocatable names none of the kinds' extended resources.
    pub const NOT_ADVERTISED: &str = "NotAdvertised";
    /// Condition reason: the kubelet registered the driver and the slices are published.
    pub const PUBLISHED: &str = "Published";
    /// Condition reason: the kubelet has not called the registration socket yet.
    pub const WAITING_FOR_KUBELET: &str = "WaitingForKubelet";
    /// Condition reason: the kubelet refused to register the driver.
    pub const REGISTRATION_REFUSED: &str = "RegistrationRefused";
    /// Condition reason: the node's ResourceSlices could not be written.
    pub const PUBLISH_FAILED: &str = "PublishFailed";
    /// Event reason on a VMI whose pod was refused for lack of keys.
    pub const INSUFFICIENT_TEE_KEYS: &str = "InsufficientTEEKeys";
    /// Event on a waiting VMI: a key is free for it, and teeguard had KubeVirt create its pod again.
    pub const TEE_KEY_FREE: &str = "TEEKeyFree";
}

/// The DRA driver name the agent publishes its devices under (DRA mode, `agent.accounting: dra`).
pub const DRA_DRIVER: &str = "tee.teeguard.dev";
/// The device attribute (qualified by the driver name) saying which kind of key a device is.
pub const DRA_KIND_ATTRIBUTE: &str = "kind";
/// The DeviceClass the chart creates for a kind: `<kind>.tee.teeguard.dev` (`sev-es.tee.teeguard.dev`).
pub fn dra_device_class(kind_attribute: &str) -> String {
    format!("{kind_attribute}.{DRA_DRIVER}")
}
