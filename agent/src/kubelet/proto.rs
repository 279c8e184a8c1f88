//! The kubelet's plugin messages, written as prost structs from the upstream definitions
//! (`k8s.io/kubelet/pkg/apis/pluginregistration/v1` and `.../dra/v1`, Kubernetes v1.36). Field numbers
//! and types are checked against upstream's `.proto` files by `tests/kubelet_proto.rs`.

use std::collections::HashMap;

/// gRPC path prefix of the plugin registration service (its proto package is `pluginregistration`).
pub const REGISTRATION_SERVICE: &str = "pluginregistration.Registration";
/// gRPC path prefix of the DRA plugin service.
pub const DRA_SERVICE: &str = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin";
/// The plugin type a DRA driver registers as.
pub const DRA_PLUGIN_TYPE: &str = "DRAPlugin";
/// The service version a DRA driver lists in `supported_versions` (the v1 DRAPlugin service).
pub const DRA_V1_VERSION: &str = "v1.DRAPlugin";

/// `pluginregistration.PluginInfo`: what the plugin tells the kubelet's plugin watcher.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PluginInfo {
    /// `DRAPlugin`.
    #[prost(string, tag = "1")]
    pub r#type: String,
    /// The driver name.
    #[prost(string, tag = "2")]
    pub name: String,
    /// The socket the kubelet calls the driver at.
    #[prost(string, tag = "3")]
    pub endpoint: String,
    /// The services the plugin implements.
    #[prost(string, repeated, tag = "4")]
    pub supported_versions: Vec<String>,
}

/// `pluginregistration.RegistrationStatus`: the kubelet's verdict.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RegistrationStatus {
    /// Whether the kubelet registered the plugin.
    #[prost(bool, tag = "1")]
    pub plugin_registered: bool,
    /// Why not.
    #[prost(string, tag = "2")]
    pub error: String,
}

/// `pluginregistration.RegistrationStatusResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RegistrationStatusResponse {}

/// `pluginregistration.InfoRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct InfoRequest {}

/// `dra.v1.Claim`: a ResourceClaim the kubelet names.
#[derive(Clone, PartialEq, Eq, Hash, prost::Message)]
pub struct Claim {
    /// Its namespace.
    #[prost(string, tag = "1")]
    pub namespace: String,
    /// Its UID.
    #[prost(string, tag = "2")]
    pub uid: String,
    /// Its name.
    #[prost(string, tag = "3")]
    pub name: String,
}

/// `dra.v1.NodePrepareResourcesRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NodePrepareResourcesRequest {
    /// The claims to prepare.
    #[prost(message, repeated, tag = "1")]
    pub claims: Vec<Claim>,
}

/// `dra.v1.NodePrepareResourcesResponse`: per claim UID.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NodePrepareResourcesResponse {
    /// Claim UID → result.
    #[prost(map = "string, message", tag = "1")]
    pub claims: HashMap<String, NodePrepareResourceResponse>,
}

/// `dra.v1.NodePrepareResourceResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NodePrepareResourceResponse {
    /// The devices prepared.
    #[prost(message, repeated, tag = "1")]
    pub devices: Vec<Device>,
    /// Why the claim could not be prepared (the kubelet retries).
    #[prost(string, tag = "2")]
    pub error: String,
}

/// `dra.v1.Device`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Device {
    /// The claim's requests this device serves.
    #[prost(string, repeated, tag = "1")]
    pub request_names: Vec<String>,
    /// Its pool.
    #[prost(string, tag = "2")]
    pub pool_name: String,
    /// Its name.
    #[prost(string, tag = "3")]
    pub device_name: String,
    /// CDI devices to add to the containers (none: a key needs no device node).
    #[prost(string, repeated, tag = "4")]
    pub cdi_device_ids: Vec<String>,
    /// Shared allocation ID (consumable capacity; unused).
    #[prost(string, optional, tag = "5")]
    pub share_id: Option<String>,
}

/// `dra.v1.NodeUnprepareResourcesRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeUnprepareResourcesRequest {
    /// The claims to unprepare.
    #[prost(message, repeated, tag = "1")]
    pub claims: Vec<Claim>,
}

/// `dra.v1.NodeUnprepareResourcesResponse`: per claim UID.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeUnprepareResourcesResponse {
    /// Claim UID → result.
    #[prost(map = "string, message", tag = "1")]
    pub claims: HashMap<String, NodeUnprepareResourceResponse>,
}

/// `dra.v1.NodeUnprepareResourceResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct NodeUnprepareResourceResponse {
    /// Why the claim could not be unprepared.
    #[prost(string, tag = "1")]
    pub error: String,
}
