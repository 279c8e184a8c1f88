//! The configuration file shared by webhook and agent (mounted from the chart's ConfigMap).
//!
//! Every field is optional; unknown fields and bad values are rejected with an error naming the field.
//!
//! ```yaml
//! resources:                 # extended resource name and keys per VM, per TEE kind
//!   tdx:   { resourceName: tdx.intel.com/keys,    keysPerVm: 1 }
//!   sev:   { resourceName: sev.amd.com/asids,     keysPerVm: 1 }
//!   sevEs: { resourceName: sev-snp.amd.com/esids, keysPerVm: 1 }
//! enforcement:               # per-pod key limits (misc.max)
//!   miscMaxAnnotation: true  # the webhook adds misc-max.teeguard.dev/compute: "tdx 1"
//!   crioAnnotation: none     # none | legacy (io.kubernetes.cri-o.UnifiedCgroup.compute) | current (unified-cgroup.crio.io/compute)
//!   mode: auto               # the agent applies the limits: auto | nri | cgroup | off
//!   strict: false            # pods requesting no keys get misc.max 0 for every kind the host has
//!   nriSocket: /var/run/nri/nri.sock
//!   nriPluginIndex: "50"     # two digits: NRI calls plugins in ascending index order
//! admission:                 # validating webhook policy
//!   mode: enforce            # enforce | warn
//!   staleReportAfter: 90s
//!   staleReportPolicy: { podCreate: deny, binding: allow }
//!   ledgerTtl: 30s
//!   deciderLease: 15s        # the decider Lease's duration (renew deadline 2/3 of it, retry 2/15)
//!   retryRefusedVmis: true   # when a key frees, have KubeVirt retry the VMIs whose pods were refused
//!   teeRuntimeClasses: {}    # RuntimeClass → kind: the webhook gives those pods a container key request
//! agent:
//!   accounting: extendedResource # extendedResource | dra (the scheduler allocates keys from ResourceSlices)
//!   advertise: true
//!   pollInterval: 1s
//!   heartbeatInterval: 30s
//! ```

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::tee::TeeKind;

/// The whole configuration, with defaults filled in and validated.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Config {
    /// Per-kind extended resource names and keys per VM.
    pub resources: ResourcesConfig,
    /// Per-pod key limits: the webhook's annotations and the agent's enforcement.
    pub enforcement: EnforcementConfig,
    /// Validating webhook policy.
    pub admission: AdmissionConfig,
    /// Node agent settings.
    pub agent: AgentConfig,
}

/// Per-kind settings.
#[derive(Clone, Debug, PartialEq)]
pub struct ResourcesConfig {
    /// Intel TDX.
    pub tdx: KindConfig,
    /// AMD SEV.
    pub sev: KindConfig,
    /// AMD SEV-ES / SEV-SNP.
    pub sev_es: KindConfig,
}

/// Settings for one TEE kind.
#[derive(Clone, Debug, PartialEq)]
pub struct KindConfig {
    /// The extended resource pods request (`tdx.intel.com/keys`).
    pub resource_name: String,
    /// Keys one VM holds (1 on every current platform).
    pub keys_per_vm: u32,
}

/// Which CRI-O unified-cgroup annotation to add, if any.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CrioAnnotation {
    /// Do not add a CRI-O annotation.
    #[default]
    None,
    /// `io.kubernetes.cri-o.UnifiedCgroup.<container>`.
    Legacy,
    /// `unified-cgroup.crio.io/<container>`.
    Current,
}

/// How the agent applies each pod's key limit (`misc.max`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EnforcementMode {
    /// NRI when the runtime's NRI socket exists, else the cgroup writer.
    #[default]
    Auto,
    /// Only the NRI plugin (container-level `linux.resources.unified["misc.max"]`).
    Nri,
    /// Only the cgroup writer (the pod cgroup's `misc.max`, written by the agent).
    Cgroup,
    /// Apply no limit.
    Off,
}

/// Per-pod key limits: the annotations the mutating webhook adds to a TEE virt-launcher pod, and how
/// the agent applies the limits.
#[derive(Clone, Debug, PartialEq)]
pub struct EnforcementConfig {
    /// Add `misc-max.teeguard.dev/<container>: "<kernel name> <keys>"` (read by a node-side enforcer).
    pub misc_max_annotation: bool,
    /// Also add CRI-O's unified-cgroup annotation (`misc.max=tdx 1`); only effective when the runtime
    /// handler allows that annotation.
    pub crio_annotation: CrioAnnotation,
    /// How the agent applies the limits.
    pub mode: EnforcementMode,
    /// Pods that request no keys get `misc.max` 0 for every kind the host has.
    pub strict: bool,
    /// The runtime's NRI socket (as the agent sees it).
    pub nri_socket: std::path::PathBuf,
    /// The plugin's NRI index: two digits; plugins are called in ascending order.
    pub nri_plugin_index: String,
}

/// The NRI socket containerd and CRI-O listen on.
pub const DEFAULT_NRI_SOCKET: &str = "/var/run/nri/nri.sock";
/// teeguard's default NRI plugin index.
pub const DEFAULT_NRI_PLUGIN_INDEX: &str = "50";

/// Admission outcome when a pod cannot get a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Deny the request.
    #[default]
    Enforce,
    /// Allow it with a Kubernetes warning.
    Warn,
}

impl std::str::FromStr for Mode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "enforce" => Ok(Mode::Enforce),
            "warn" => Ok(Mode::Warn),
            other => Err(Error::Config {
                source_name: None,
                field: "mode".into(),
                reason: format!("{other:?} is not a mode: expected enforce or warn"),
            }),
        }
    }
}

/// What to do when a node's report is missing or older than `staleReportAfter`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StalePolicy {
    /// Treat the node as having no free keys.
    Deny,
    /// Allow, with a warning that the report is unknown.
    Allow,
}

/// How the scheduler learns a node's free keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Accounting {
    /// The agent advertises `capacity − external` as the Node's extended resources (NFD's way).
    #[default]
    ExtendedResource,
    /// The agent is the DRA driver `tee.teeguard.dev`: it publishes one device per usable key in a
    /// ResourceSlice, the scheduler allocates them (a DeviceClass with `extendedResourceName` serves the
    /// pods' extended-resource requests) and the kubelet asks the agent to prepare them.
    Dra,
}

/// Validating webhook policy.
#[derive(Clone, Debug, PartialEq)]
pub struct AdmissionConfig {
    /// Global mode; a namespace label `teeguard.dev/mode` overrides it.
    pub mode: Mode,
    /// A report whose heartbeat is older than this counts as unknown.
    pub stale_report_after: Duration,
    /// Policy for unknown reports on pod CREATE.
    pub stale_on_pod_create: StalePolicy,
    /// Policy for unknown reports on the scheduler's `pods/binding`.
    pub stale_on_binding: StalePolicy,
    /// The longest a key stays held for a pod the node's report does not count yet (the holds' end
    /// rule's backstop; `ledgerTtl` is the name of the days of the per-replica ledger).
    pub ledger_ttl: Duration,
    /// The decider Lease's duration: one replica, elected through it, decides the admissions that
    /// take a key in memory and writes its holds behind; the others forward it those reviews.
    pub decider_lease: Duration,
    /// When a key is free again, annotate the VMIs whose launcher pods teeguard refused (oldest first,
    /// one per free key), so KubeVirt creates their pods at once instead of after its backoff.
    pub retry_refused_vmis: bool,
    /// RuntimeClasses whose pods are TEE guests (Kata's `kata-qemu-tdx`, ...) and their kind: the
    /// mutating webhook adds the kind's key request to the first container of such a pod that asks for
    /// no key itself, so the key is a container request, which DRA can serve (a RuntimeClass
    /// `overhead.podFixed` key is not).
    pub tee_runtime_classes: std::collections::BTreeMap<String, TeeKind>,
}

/// Node agent settings.
#[derive(Clone, Debug, PartialEq)]
pub struct AgentConfig {
    /// Extended resources on the Node, or DRA devices in ResourceSlices.
    pub accounting: Accounting,
    /// Advertise the extended resources on the Node (`capacity − external`).
    pub advertise: bool,
    /// How often usage is read from the kernel (it sends no event for usage).
    pub poll_interval: Duration,
    /// How often the agent renews its heartbeat Lease while nothing changes (a change is published at
    /// once); each node at its own place in the interval.
    pub heartbeat_interval: Duration,
}

impl Default for ResourcesConfig {
    fn default() -> Self {
        ResourcesConfig {
            tdx: KindConfig::default_for(TeeKind::Tdx),
            sev: KindConfig::default_for(TeeKind::Sev),
            sev_es: KindConfig::default_for(TeeKind::SevEs),
        }
    }
}

impl ResourcesConfig {
    /// The settings for one kind.
    pub fn get(&self, kind: TeeKind) -> &KindConfig {
        match kind {
            TeeKind::Tdx => &self.tdx,
            TeeKind::Sev => &self.sev,
            TeeKind::SevEs => &self.sev_es,
        }
    }

    fn get_mut(&mut self, kind: TeeKind) -> &mut KindConfig {
        match kind {
            TeeKind::Tdx => &mut self.tdx,
            TeeKind::Sev => &mut self.sev,
            TeeKind::SevEs => &mut self.sev_es,
        }
    }

    /// The extended resource name for a kind.
    pub fn resource_name(&self, kind: TeeKind) -> &str {
        &self.get(kind).resource_name
    }

    /// The extended resource names of every kind, in kernel order.
    pub fn resource_names(&self) -> Vec<String> {
        TeeKind::ALL
            .iter()
            .map(|k| self.resource_name(*k).to_string())
            .collect()
    }

    /// The kind whose extended resource is `name`, if any.
    pub fn kind_of_resource(&self, name: &str) -> Option<TeeKind> {
        TeeKind::ALL
            .into_iter()
            .find(|k| self.get(*k).resource_name == name)
    }
}

impl KindConfig {
    /// The default resource name (Kata/NFD-compatible where one exists) and one key per VM.
    pub fn default_for(kind: TeeKind) -> Self {
        let resource_name = match kind {
            TeeKind::Tdx => "tdx.intel.com/keys",
            TeeKind::Sev => "sev.amd.com/asids",
            TeeKind::SevEs => "sev-snp.amd.com/esids",
        };
        KindConfig {
            resource_name: resource_name.to_string(),
            keys_per_vm: 1,
        }
    }
}

impl Default for EnforcementConfig {
    fn default() -> Self {
        EnforcementConfig {
            misc_max_annotation: true,
            crio_annotation: CrioAnnotation::None,
            mode: EnforcementMode::Auto,
            strict: false,
            nri_socket: DEFAULT_NRI_SOCKET.into(),
            nri_plugin_index: DEFAULT_NRI_PLUGIN_INDEX.into(),
        }
    }
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig {
            mode: Mode::Enforce,
            stale_report_after: Duration::from_secs(90),
            stale_on_pod_create: StalePolicy::Deny,
            stale_on_binding: StalePolicy::Allow,
            ledger_ttl: Duration::from_secs(30),
            decider_lease: Duration::from_secs(15),
            retry_refused_vmis: true,
            tee_runtime_classes: Default::default(),
        }
    }
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            accounting: Accounting::ExtendedResource,
            advertise: true,
            poll_interval: Duration::from_secs(1),
            heartbeat_interval: Duration::from_secs(30),
        }
    }
}

// ---- the file format: every field optional, unknown fields rejected ----

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawConfig {
    resources: Option<RawResources>,
    enforcement: Option<RawEnforcement>,
    admission: Option<RawAdmission>,
    agent: Option<RawAgent>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawResources {
    tdx: Option<RawKind>,
    sev: Option<RawKind>,
    sev_es: Option<RawKind>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawKind {
    resource_name: Option<String>,
    keys_per_vm: Option<u32>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawEnforcement {
    misc_max_annotation: Option<bool>,
    crio_annotation: Option<CrioAnnotation>,
    mode: Option<EnforcementMode>,
    strict: Option<bool>,
    nri_socket: Option<String>,
    nri_plugin_index: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawAdmission {
    mode: Option<Mode>,
    stale_report_after: Option<String>,
    stale_report_policy: Option<RawStalePolicy>,
    ledger_ttl: Option<String>,
    decider_lease: Option<String>,
    retry_refused_vmis: Option<bool>,
    tee_runtime_classes: Option<std::collections::BTreeMap<String, RawKindName>>,
}

/// A TEE kind as the configuration file spells it.
#[derive(Deserialize, Clone, Copy)]
#[serde(rename_all = "camelCase")]
enum RawKindName {
    Tdx,
    Sev,
    SevEs,
}

impl From<RawKindName> for TeeKind {
    fn from(k: RawKindName) -> TeeKind {
        match k {
            RawKindName::Tdx => TeeKind::Tdx,
            RawKindName::Sev => TeeKind::Sev,
            RawKindName::SevEs => TeeKind::SevEs,
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawStalePolicy {
    pod_create: Option<StalePolicy>,
    binding: Option<StalePolicy>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawAgent {
    accounting: Option<Accounting>,
    advertise: Option<bool>,
    poll_interval: Option<String>,
    heartbeat_interval: Option<String>,
}

impl Config {
    /// Read and validate a configuration file.
    pub fn load(path: &Path) -> Result<Config> {
        let text = std::fs::read_to_string(path).map_err(|source| Error::ConfigRead {
            path: path.to_path_buf(),
            source,
        })?;
        Config::from_yaml_named(&text, Some(path.display().to_string()))
    }

    /// Parse and validate configuration YAML (an empty document gives the defaults).
    pub fn from_yaml(text: &str) -> Result<Config> {
        Config::from_yaml_named(text, None)
    }

    fn from_yaml_named(text: &str, source_name: Option<String>) -> Result<Config> {
        let err = |field: String, reason: String| Error::Config {
            source_name: source_name.clone(),
            field,
            reason,
        };
        let raw: RawConfig = if text.trim().is_empty() {
            RawConfig::default()
        } else {
            let de = serde_yaml::Deserializer::from_str(text);
            serde_path_to_error::deserialize(de).map_err(|e| {
                let path = e.path().to_string();
                let field = if path == "." {
                    "(top level)".to_string()
                } else {
                    path
                };
                err(field, e.into_inner().to_string())
            })?
        };
        let mut cfg = Config::default();
        if let Some(r) = raw.resources {
            for (kind, key, raw_kind) in [
                (TeeKind::Tdx, "tdx", r.tdx),
                (TeeKind::Sev, "sev", r.sev),
                (TeeKind::SevEs, "sevEs", r.sev_es),
            ] {
                let Some(raw_kind) = raw_kind else { continue };
                let slot = cfg.resources.get_mut(kind);
                if let Some(name) = raw_kind.resource_name {
                    validate_resource_name(&name)
                        .map_err(|reason| err(format!("resources.{key}.resourceName"), reason))?;
                    slot.resource_name = name;
                }
                if let Some(n) = raw_kind.keys_per_vm {
                    if n == 0 || n > 64 {
                        return Err(err(
                            format!("resources.{key}.keysPerVm"),
                            format!(
                                "{n} is out of range: expected 1 to 64 (every current platform uses 1)"
                            ),
                        ));
                    }
                    slot.keys_per_vm = n;
                }
            }
            for (i, a) in TeeKind::ALL.iter().enumerate() {
                for b in &TeeKind::ALL[i + 1..] {
                    if cfg.resources.resource_name(*a) == cfg.resources.resource_name(*b) {
                        return Err(err(
                            format!("resources.{}.resourceName", camel(*b)),
                            format!(
                                "{:?} is also the resource name of {}: each kind needs its own resource",
                                cfg.resources.resource_name(*b),
                                camel(*a)
                            ),
                        ));
                    }
                }
            }
        }
        if let Some(e) = raw.enforcement {
            if let Some(v) = e.misc_max_annotation {
                cfg.enforcement.misc_max_annotation = v;
            }
            if let Some(v) = e.crio_annotation {
                cfg.enforcement.crio_annotation = v;
            }
            if let Some(v) = e.mode {
                cfg.enforcement.mode = v;
            }
            if let Some(v) = e.strict {
                cfg.enforcement.strict = v;
            }
            if let Some(v) = e.nri_socket {
                if !v.starts_with('/') {
                    return Err(err(
                        "enforcement.nriSocket".into(),
                        format!("{v:?} is not an absolute path"),
                    ));
                }
                cfg.enforcement.nri_socket = v.into();
            }
            if let Some(v) = e.nri_plugin_index {
                if v.len() != 2 || !v.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(err(
                        "enforcement.nriPluginIndex".into(),
                        format!("{v:?} is not two digits (00-99)"),
                    ));
                }
                cfg.enforcement.nri_plugin_index = v;
            }
        }
        if let Some(a) = raw.admission {
            if let Some(m) = a.mode {
                cfg.admission.mode = m;
            }
            if let Some(s) = a.stale_report_after {
                cfg.admission.stale_report_after =
                    parse_duration(&s).map_err(|r| err("admission.staleReportAfter".into(), r))?;
            }
            if let Some(p) = a.stale_report_policy {
                if let Some(v) = p.pod_create {
                    cfg.admission.stale_on_pod_create = v;
                }
                if let Some(v) = p.binding {
                    cfg.admission.stale_on_binding = v;
                }
            }
            if let Some(s) = a.ledger_ttl {
                cfg.admission.ledger_ttl =
                    parse_duration(&s).map_err(|r| err("admission.ledgerTtl".into(), r))?;
            }
            if let Some(s) = a.decider_lease {
                let lease =
                    parse_duration(&s).map_err(|r| err("admission.deciderLease".into(), r))?;
                if lease < Duration::from_secs(3) {
                    return Err(err(
                        "admission.deciderLease".into(),
                        format!(
                            "{s} is too short: at least 3s (the renewals come every 2/15 of it)"
                        ),
                    ));
                }
                cfg.admission.decider_lease = lease;
            }
            if let Some(v) = a.retry_refused_vmis {
                cfg.admission.retry_refused_vmis = v;
            }
            if let Some(classes) = a.tee_runtime_classes {
                for (name, kind) in classes {
                    if name.is_empty() || name.len() > 253 {
                        return Err(err(
                            format!("admission.teeRuntimeClasses.{name}"),
                            "a RuntimeClass name is 1 to 253 characters".into(),
                        ));
                    }
                    cfg.admission.tee_runtime_classes.insert(name, kind.into());
                }
            }
        }
        if let Some(a) = raw.agent {
            if let Some(v) = a.accounting {
                cfg.agent.accounting = v;
            }
            if let Some(v) = a.advertise {
                cfg.agent.advertise = v;
            }
            if let Some(s) = a.poll_interval {
                cfg.agent.poll_interval =
                    parse_duration(&s).map_err(|r| err("agent.pollInterval".into(), r))?;
            }
            if let Some(s) = a.heartbeat_interval {
                cfg.agent.heartbeat_interval =
                    parse_duration(&s).map_err(|r| err("agent.heartbeatInterval".into(), r))?;
            }
        }
        Ok(cfg)
    }
}

fn camel(kind: TeeKind) -> &'static str {
    match kind {
        TeeKind::Tdx => "tdx",
        TeeKind::Sev => "sev",
        TeeKind::SevEs => "sevEs",
    }
}

/// Check an extended resource name: `<domain>/<name>` with a DNS subdomain outside `kubernetes.io`.
pub fn validate_resource_name(name: &str) -> std::result::Result<(), String> {
    let Some((domain, local)) = name.split_once('/') else {
        return Err(format!(
            "{name:?} is not an extended resource name: expected <domain>/<name>, e.g. tdx.intel.com/keys"
        ));
    };
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    if domain.len() > 253 || !domain.split('.').all(label_ok) || !domain.contains('.') {
        return Err(format!(
            "{name:?}: the domain {domain:?} must be a lower-case DNS subdomain such as intel.com"
        ));
    }
    if domain == "kubernetes.io" || domain.ends_with(".kubernetes.io") {
        return Err(format!(
            "{name:?}: the kubernetes.io domain is reserved; use a vendor domain"
        ));
    }
    if domain == crate::names::KUBEVIRT_DEVICE_DOMAIN {
        return Err(format!(
            "{name:?}: {domain} is KubeVirt's device-plugin domain (its device plugin advertises \
             devices.kubevirt.io/tdx and /sev with the whole capacity, the count teeguard corrects); \
             use the Kata/NFD name, e.g. tdx.intel.com/keys or sev-snp.amd.com/esids"
        ));
    }
    let local_ok = !local.is_empty()
        && local.len() <= 63
        && local
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && local.as_bytes()[0].is_ascii_alphanumeric()
        && local.as_bytes()[local.len() - 1].is_ascii_alphanumeric();
    if !local_ok {
        return Err(format!(
            "{name:?}: the part after / must be 1-63 letters, digits, '-', '_' or '.', starting and ending alphanumeric"
        ));
    }
    Ok(())
}

/// Parse a duration such as `500ms`, `1s`, `2m`, `1h`, `1m30s`; must be above zero.
pub fn parse_duration(s: &str) -> std::result::Result<Duration, String> {
    let bad = || format!("{s:?} is not a duration: expected e.g. 500ms, 1s, 90s, 2m, 1h30m");
    let mut rest = s.trim();
    if rest.is_empty() {
        return Err(bad());
    }
    let mut total = Duration::ZERO;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        if digits == 0 {
            return Err(bad());
        }
        let n: u64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let d = match unit {
            "ms" => Duration::from_millis(n),
            "s" => Duration::from_secs(n),
            "m" => Duration::from_secs(n.checked_mul(60).ok_or_else(bad)?),
            "h" => Duration::from_secs(n.checked_mul(3600).ok_or_else(bad)?),
            _ => return Err(bad()),
        };
        total = total.checked_add(d).ok_or_else(bad)?;
    }
    if total.is_zero() {
        return Err(format!("{s:?}: must be greater than zero"));
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_defaults() {
        let cfg = Config::from_yaml("").expect("empty");
        assert_eq!(cfg, Config::default());
        assert_eq!(
            cfg.resources.resource_name(TeeKind::Tdx),
            "tdx.intel.com/keys"
        );
        assert_eq!(
            cfg.resources.resource_name(TeeKind::SevEs),
            "sev-snp.amd.com/esids"
        );
        assert_eq!(
            cfg.resources.resource_name(TeeKind::Sev),
            "sev.amd.com/asids"
        );
        assert_eq!(cfg.resources.tdx.keys_per_vm, 1);
        assert_eq!(
            cfg.resources.kind_of_resource("sev-snp.amd.com/esids"),
            Some(TeeKind::SevEs)
        );
    }

    #[test]
    fn partial_override_keeps_other_defaults() {
        let cfg = Config::from_yaml(
            "resources:\n  tdx:\n    resourceName: example.com/tdx\nadmission:\n  mode: warn\n  staleReportAfter: 2m\nagent:\n  pollInterval: 500ms\n",
        )
        .expect("valid");
        assert_eq!(cfg.resources.tdx.resource_name, "example.com/tdx");
        assert_eq!(cfg.resources.tdx.keys_per_vm, 1);
        assert_eq!(
            cfg.resources.sev_es,
            KindConfig::default_for(TeeKind::SevEs)
        );
        assert_eq!(cfg.admission.mode, Mode::Warn);
        assert_eq!(cfg.admission.stale_report_after, Duration::from_secs(120));
        assert_eq!(cfg.agent.poll_interval, Duration::from_millis(500));
        assert!(cfg.agent.advertise);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            ("resources:\n  tdx:\n    keysPerVM: 1\n", "resources.tdx"),
            (
                "resources:\n  tdx:\n    keysPerVm: 0\n",
                "resources.tdx.keysPerVm",
            ),
            (
                "resources:\n  tdx:\n    keysPerVm: -1\n",
                "resources.tdx.keysPerVm",
            ),
            (
                "resources:\n  sevEs:\n    resourceName: keys\n",
                "resources.sevEs.resourceName",
            ),
            (
                "resources:\n  sev:\n    resourceName: tdx.intel.com/keys\n",
                "resources.sev.resourceName",
            ),
            ("admission:\n  mode: block\n", "admission.mode"),
            // Removed (one elected replica always decides): named as unknown.
            ("admission:\n  decider: shared\n", "decider"),
            (
                "admission:\n  staleReportAfter: soon\n",
                "admission.staleReportAfter",
            ),
            ("agent:\n  pollInterval: 0s\n", "agent.pollInterval"),
            ("agent:\n  advertise: maybe\n", "agent.advertise"),
            (
                "enforcement:\n  crioAnnotation: yes\n",
                "enforcement.crioAnnotation",
            ),
            ("enforcement:\n  mode: kernel\n", "enforcement.mode"),
            (
                "enforcement:\n  nriSocket: nri.sock\n",
                "enforcement.nriSocket",
            ),
            (
                "enforcement:\n  nriPluginIndex: \"5\"\n",
                "enforcement.nriPluginIndex",
            ),
            ("nonsense: 1\n", "nonsense"),
        ];
        for (yaml, field) in cases {
            let err = Config::from_yaml(yaml).expect_err(yaml).to_string();
            assert!(err.contains(&format!("`{field}")), "{yaml:?} -> {err}");
        }
    }

    #[test]
    fn dra_accounting_and_tee_runtime_classes_are_read() {
        let cfg = Config::from_yaml(
            "agent:\n  accounting: dra\nadmission:\n  teeRuntimeClasses:\n    kata-qemu-tdx: tdx\n    kata-qemu-snp: sevEs\n",
        )
        .expect("valid");
        assert_eq!(cfg.agent.accounting, Accounting::Dra);
        assert_eq!(
            cfg.admission.tee_runtime_classes.get("kata-qemu-snp"),
            Some(&TeeKind::SevEs)
        );
        assert_eq!(
            Config::default().agent.accounting,
            Accounting::ExtendedResource
        );
        let e = Config::from_yaml("agent:\n  accounting: plugin\n").expect_err("bad value");
        assert!(e.to_string().contains("agent.accounting"), "{e}");
        let e = Config::from_yaml("admission:\n  teeRuntimeClasses:\n    kata: sgx\n")
            .expect_err("bad kind");
        assert!(e.to_string().contains("admission.teeRuntimeClasses"), "{e}");
    }

    #[test]
    fn enforcement_settings_are_read() {
        let cfg = Config::from_yaml(
            "enforcement:\n  mode: cgroup\n  strict: true\n  nriSocket: /run/nri/x.sock\n  nriPluginIndex: \"07\"\n",
        )
        .expect("valid");
        assert_eq!(cfg.enforcement.mode, EnforcementMode::Cgroup);
        assert!(cfg.enforcement.strict);
        assert_eq!(cfg.enforcement.nri_socket, Path::new("/run/nri/x.sock"));
        assert_eq!(cfg.enforcement.nri_plugin_index, "07");
        let defaults = Config::default().enforcement;
        assert_eq!(defaults.mode, EnforcementMode::Auto);
        assert!(!defaults.strict);
        assert_eq!(defaults.nri_socket, Path::new(DEFAULT_NRI_SOCKET));
    }

    #[test]
    fn load_names_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("config.yaml");
        std::fs::write(&path, "agent:\n  heartbeatInterval: x\n").expect("write");
        let err = Config::load(&path).expect_err("bad").to_string();
        assert!(
            err.contains("config.yaml") && err.contains("agent.heartbeatInterval"),
            "{err}"
        );
        let missing = Config::load(&dir.path().join("nope.yaml")).expect_err("missing");
        assert!(missing.to_string().contains("nope.yaml"));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert!(parse_duration("10").is_err());
        assert!(parse_duration("s").is_err());
        assert!(parse_duration("1d").is_err());
    }

    #[test]
    fn resource_names() {
        assert!(validate_resource_name("tdx.intel.com/keys").is_ok());
        assert!(validate_resource_name("sev-snp.amd.com/esids").is_ok());
        assert!(validate_resource_name("keys").is_err());
        assert!(validate_resource_name("kubernetes.io/keys").is_err());
        let kubevirt = validate_resource_name("devices.kubevirt.io/tdx").expect_err("KubeVirt's");
        assert!(kubevirt.contains("device-plugin domain"), "{kubevirt}");
        assert!(validate_resource_name("kubevirt.io/keys").is_ok());
        assert!(validate_resource_name("Intel.com/keys").is_err());
        assert!(validate_resource_name("intel.com/").is_err());
    }
}
