//! Working against the real control plane of [`crate::controlplane`]: the objects a test needs
//! (CRDs, namespaces, Nodes without a kubelet, VMIs and their virt-launcher pods, teeguard's webhook
//! configurations taken from the rendered chart and pointed at a webhook process by URL), created
//! through the real API with the real kube client.
//!
//! Every test works in its own namespaces and Nodes ([`crate::controlplane::unique_name`]); the
//! webhook configurations a test registers are its own too, and match only namespaces labelled with
//! the test's name, so tests sharing one control plane never call each other's webhooks.

use std::net::SocketAddr;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Namespace, Node, Pod, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{DynamicObject, ListParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use kube::{Api, Client, CustomResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use teeguard_shared::{TeeCapacity, names};

use crate::controlplane::{ControlPlane, unique_name};
use crate::e2e::ProcessEnv;
use crate::error::{self, Error, Result};
use crate::fixtures::{NodeBuilder, ReportBuilder, Tee, VirtLauncherPod, Vmi};
use crate::patch::MergePatch;
use crate::standalone::driver::{own_by, strip_server_fields};
use crate::wait;

/// Create `obj`, or keep the one already there (`409 AlreadyExists`): for cluster-wide objects that
/// tests sharing one control plane create alike (CRDs, RuntimeClasses, DeviceClasses).
pub async fn create_or_keep<K>(api: &Api<K>, obj: &K) -> std::result::Result<(), kube::Error>
where
    K: Clone + DeserializeOwned + Serialize + std::fmt::Debug,
{
    match api.create(&PostParams::default(), obj).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

/// Set Node `node`'s capacity and allocatable as virt-handler's device plugins make the kubelet
/// advertise them: `devices.kubevirt.io/kvm`, `tun` and `vhost-net` (1k each), and `more` (a `null`
/// value removes a device).
pub async fn advertise_kubevirt_devices(client: &Client, node: &str, more: &[(&str, Value)]) {
    let mut devices: Vec<(String, Value)> = ["kvm", "tun", "vhost-net"]
        .iter()
        .map(|d| (format!("devices.kubevirt.io/{d}"), json!("1k")))
        .collect();
    devices.extend(more.iter().map(|(d, v)| ((*d).to_string(), v.clone())));
    advertise(client, node, &devices)
        .await
        .unwrap_or_else(|e| panic!("advertise KubeVirt's devices on {node}: {e}"));
}

/// Set `resources` (a `null` value removes one) in Node `node`'s capacity and allocatable, as a
/// device plugin, or NFD, has the kubelet advertise them.
pub async fn advertise(
    client: &Client,
    node: &str,
    resources: &[(impl AsRef<str>, Value)],
) -> kube::Result<Node> {
    let resources: serde_json::Map<String, Value> = resources
        .iter()
        .map(|(r, v)| (r.as_ref().to_string(), v.clone()))
        .collect();
    Api::<Node>::all(client.clone())
        .merge_patch_status(
            node,
            json!({"status": {"capacity": resources, "allocatable": resources}}),
        )
        .await
}

/// Run a test body, failing the test when it takes longer than `deadline`.
pub async fn within(deadline: Duration, body: impl std::future::Future<Output = ()>) {
    tokio::time::timeout(deadline, body)
        .await
        .unwrap_or_else(|_| panic!("the test did not finish within {deadline:?}"));
}

/// An Event as `reason: message`.
pub fn event_line(e: &Event) -> String {
    format!(
        "{}: {}",
        e.reason.as_deref().unwrap_or_default(),
        e.message.as_deref().unwrap_or_default()
    )
}

/// The label that scopes a test's webhook configurations to its namespaces.
pub const TEST_LABEL: &str = "teeguard-test";

/// The CRD of KubeVirt's `VirtualMachineInstance` as far as teeguard needs it: the real group,
/// version, kind and names, a schema that keeps every field (KubeVirt's own is structural; teeguard
/// reads only `spec.domain.launchSecurity` and metadata).
pub fn vmi_crd() -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "virtualmachineinstances.kubevirt.io"},
        "spec": {
            "group": "kubevirt.io",
            "names": {"kind": "VirtualMachineInstance", "listKind": "VirtualMachineInstanceList",
                "plural": "virtualmachineinstances", "singular": "virtualmachineinstance",
                "shortNames": ["vmi", "vmis"], "categories": ["all"]},
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object",
                    "x-kubernetes-preserve-unknown-fields": true}},
                "subresources": {"status": {}}
            }]
        }
    })
}

/// A test's connection to the shared control plane.
#[derive(Clone)]
pub struct Cluster {
    /// The control plane.
    pub cp: &'static ControlPlane,
    /// An admin client (made in the test's runtime).
    pub client: Client,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("url", &self.cp.url)
            .finish()
    }
}

/// The API server's answer to a create, with the warnings it carried (`Warning` headers, e.g. an
/// admission webhook's).
#[derive(Debug)]
pub struct Created {
    /// The HTTP status.
    pub status: u16,
    /// Each `Warning` header.
    pub warnings: Vec<String>,
    /// The body (the stored object, or a Status).
    pub body: Vec<u8>,
}

impl Cluster {
    /// Create `pod` in `ns` through the API server, keeping the warnings the client would show (the
    /// kube client drops them).
    pub async fn create_pod_with_warnings(&self, ns: &str, pod: &impl serde::Serialize) -> Created {
        let body = serde_json::to_vec(pod).expect("json");
        let req = http::Request::post(format!("/api/v1/namespaces/{ns}/pods"))
            .header("content-type", "application/json")
            .body(body)
            .expect("request");
        let resp = self
            .client
            .send(req.map(kube::client::Body::from))
            .await
            .expect("the API server answers");
        let status = resp.status().as_u16();
        let warnings = resp
            .headers()
            .get_all("warning")
            .iter()
            .map(|v| v.to_str().unwrap_or("").to_string())
            .collect();
        let body = http_body_util::BodyExt::collect(resp.into_body())
            .await
            .expect("body")
            .to_bytes()
            .to_vec();
        Created {
            status,
            warnings,
            body,
        }
    }

    /// Connect to this test binary's control plane (started on first use) with the CRDs installed;
    /// `None` when the test should skip (see [`ControlPlane::shared`]).
    pub async fn connect() -> Option<Cluster> {
        let cp = ControlPlane::shared()?;
        let client = cp.client().await.unwrap_or_else(|e| panic!("{e}"));
        let cluster = Cluster { cp, client };
        cluster
            .install_crds()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        Some(cluster)
    }

    /// The Events about object `ns/name` (none when they cannot be listed).
    pub async fn events_about(&self, ns: &str, name: &str) -> Vec<Event> {
        let events: Api<Event> = Api::namespaced(self.client.clone(), ns);
        events
            .list(&ListParams::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.involved_object.name.as_deref() == Some(name))
            .collect()
    }

    /// The first Event about object `ns/name` with reason `reason`, waited for ([`Cluster::wait_for`]).
    pub async fn wait_event(&self, ns: &str, name: &str, reason: &str) -> Result<Event> {
        self.wait_for(&format!("a {reason} Event about {ns}/{name}"), || async {
            self.events_about(ns, name)
                .await
                .into_iter()
                .find(|e| e.reason.as_deref() == Some(reason))
        })
        .await
    }

    /// Wait, at most `timeout`, until `api` lists nothing with `params` (`what` is gone).
    pub async fn wait_none_listed<K>(
        &self,
        what: &str,
        timeout: Duration,
        api: &Api<K>,
        params: &ListParams,
    ) -> Result<()>
    where
        K: Clone + DeserializeOwned + std::fmt::Debug,
    {
        self.wait_for_within(what, timeout, || async {
            api.list(params)
                .await
                .ok()
                .filter(|l| l.items.is_empty())
                .map(|_| ())
        })
        .await
    }

    /// Install the `TeeCapacity`, `TeeReservation` and `VirtualMachineInstance` CRDs (once;
    /// idempotent) and wait until they are established.
    pub async fn install_crds(&self) -> Result<()> {
        let crds: Api<CustomResourceDefinition> = Api::all(self.client.clone());
        let wanted: Vec<CustomResourceDefinition> = vec![
            teeguard_shared::TeeCapacity::crd(),
            teeguard_shared::reservation::TeeReservation::crd(),
            serde_json::from_value(vmi_crd()).map_err(|e| Error::failed("the VMI CRD", e))?,
        ];
        for crd in &wanted {
            let name = crd.metadata.name.clone().unwrap_or_default();
            create_or_keep(&crds, crd)
                .await
                .map_err(error::failed(format!("create CRD {name}")))?;
        }
        for crd in &wanted {
            let name = crd.metadata.name.clone().unwrap_or_default();
            self.wait_for(&format!("CRD {name} to be established"), || async {
                let c = crds.get(&name).await.ok()?;
                c.status?
                    .conditions?
                    .iter()
                    .any(|c| c.type_ == "Established" && c.status == "True")
                    .then_some(())
            })
            .await?;
        }
        Ok(())
    }

    /// Poll `check` until it returns `Some`, for at most [`wait::PATIENCE`] (30 s).
    pub async fn wait_for<T>(
        &self,
        what: &str,
        check: impl AsyncFnMut() -> Option<T>,
    ) -> Result<T> {
        self.wait_for_within(what, wait::PATIENCE, check).await
    }

    /// [`Cluster::wait_for`] with a deadline of `timeout` (the polling is [`wait::until`]'s).
    pub async fn wait_for_within<T>(
        &self,
        what: &str,
        timeout: Duration,
        check: impl AsyncFnMut() -> Option<T>,
    ) -> Result<T> {
        wait::until(what, timeout, check).await.map_err(|_| {
            Error::failed(
                format!("waiting for {what}"),
                format!("not within {timeout:?}"),
            )
        })
    }

    /// A new namespace `<prefix>-<pid>-<n>` labelled [`TEST_LABEL`]`=<test>` (plus `labels`), once
    /// its `default` ServiceAccount exists (pods cannot be created before).
    pub async fn namespace(
        &self,
        test: &str,
        prefix: &str,
        labels: &[(&str, &str)],
    ) -> Result<String> {
        let name = unique_name(prefix);
        let mut l = serde_json::Map::new();
        l.insert(TEST_LABEL.into(), json!(test));
        for (k, v) in labels {
            l.insert((*k).into(), json!(v));
        }
        let ns: Namespace = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": l}
        }))
        .map_err(|e| Error::failed("namespace", e))?;
        Api::<Namespace>::all(self.client.clone())
            .create(&PostParams::default(), &ns)
            .await
            .map_err(error::failed(format!("create namespace {name}")))?;
        let sas: Api<ServiceAccount> = Api::namespaced(self.client.clone(), &name);
        self.wait_for(&format!("the default ServiceAccount of {name}"), || async {
            sas.get("default").await.ok().map(|_| ())
        })
        .await?;
        Ok(name)
    }

    /// Create a Node from `builder` (labels, annotations) and set its status (capacity, allocatable,
    /// Ready) as a kubelet would; returns it as stored.
    pub async fn node(&self, builder: &NodeBuilder) -> Result<Node> {
        let mut v = builder.to_value();
        strip_server_fields(&mut v);
        let status = v.as_object_mut().and_then(|o| o.remove("status"));
        let name = v["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let taints = v.pointer("/spec/taints").cloned().unwrap_or(Value::Null);
        let node: Node = serde_json::from_value(v).map_err(|e| Error::failed("node", e))?;
        let nodes: Api<Node> = Api::all(self.client.clone());
        nodes
            .create(&PostParams::default(), &node)
            .await
            .map_err(error::failed(format!("create Node {name}")))?;
        // The API server's TaintNodesByCondition admission taints every new Node not-ready; the node
        // lifecycle controller, off here, would lift it once the kubelet reports Ready.
        nodes
            .merge_patch(&name, json!({ "spec": { "taints": taints } }))
            .await
            .map_err(error::failed(format!(
                "lift the not-ready taint of Node {name}"
            )))?;
        nodes
            .merge_patch_status(&name, json!({ "status": status }))
            .await
            .map_err(error::failed(format!("set the status of Node {name}")))
    }

    /// Store a VMI like `kubectl create` (phase `Scheduling`, no node); returns its UID.
    pub async fn create_vmi(&self, namespace: &str, name: &str, tee: Tee) -> Result<String> {
        let mut v = Vmi::new(name)
            .namespace(namespace)
            .tee(tee)
            .scheduling()
            .build();
        strip_server_fields(&mut v);
        let obj: DynamicObject = serde_json::from_value(v).map_err(|e| Error::failed("VMI", e))?;
        let created = self
            .vmis(namespace)
            .create(&PostParams::default(), &obj)
            .await
            .map_err(error::failed(format!("create VMI {namespace}/{name}")))?;
        created
            .metadata
            .uid
            .ok_or_else(|| Error::failed(format!("VMI {namespace}/{name}"), "stored without a UID"))
    }

    /// The VMI API of a namespace.
    pub fn vmis(&self, namespace: &str) -> Api<DynamicObject> {
        let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
            "kubevirt.io",
            "v1",
            "VirtualMachineInstance",
        ));
        Api::namespaced_with(self.client.clone(), namespace, &ar)
    }

    /// The virt-launcher pod virt-controller renders for VMI `vmi` (UID `vmi_uid`), ready to create
    /// (`generateName`, owned by the VMI), with `node_selector` added to KubeVirt's (a test's own
    /// Nodes carry a label of the test, so the scheduler and teeguard's candidate scan see only them).
    pub fn launcher_pod(
        namespace: &str,
        vmi: &str,
        vmi_uid: &str,
        tee: Tee,
        node_selector: &[(&str, &str)],
    ) -> Result<Pod> {
        let mut v = VirtLauncherPod::for_tee(vmi, tee)
            .namespace(namespace)
            .to_value();
        own_by(&mut v, vmi_uid);
        strip_server_fields(&mut v);
        if let Some(obj) = v.as_object_mut() {
            obj.remove("status");
        }
        for (k, val) in node_selector {
            v["spec"]["nodeSelector"][*k] = json!(val);
        }
        // The VM's disks are PVCs, which a cluster without storage never binds (the scheduler would
        // wait for them): the same volumes as emptyDirs, which teeguard does not look at either way.
        for vol in v["spec"]["volumes"].as_array_mut().into_iter().flatten() {
            if let Some(o) = vol.as_object_mut()
                && o.remove("persistentVolumeClaim").is_some()
            {
                o.insert("emptyDir".into(), json!({}));
            }
        }
        serde_json::from_value(v).map_err(|e| Error::failed("launcher pod", e))
    }

    /// Create a VMI and its virt-launcher pod through the API server (both admission webhooks run);
    /// returns the VMI's UID and the API server's answer to the pod CREATE.
    pub async fn create_vm(
        &self,
        namespace: &str,
        vmi: &str,
        tee: Tee,
        node_selector: &[(&str, &str)],
    ) -> Result<(String, kube::Result<Pod>)> {
        let uid = self.create_vmi(namespace, vmi, tee).await?;
        let pod = Self::launcher_pod(namespace, vmi, &uid, tee, node_selector)?;
        let created = Api::<Pod>::namespaced(self.client.clone(), namespace)
            .create(&PostParams::default(), &pod)
            .await;
        Ok((uid, created))
    }

    /// Store a node's `TeeCapacity` report as its agent would (object, then status).
    pub async fn report(&self, report: &ReportBuilder) -> Result<()> {
        let obj = report.build();
        let name = obj.metadata.name.clone().unwrap_or_default();
        let api: Api<TeeCapacity> = Api::all(self.client.clone());
        api.create(&PostParams::default(), &obj)
            .await
            .map_err(error::failed(format!("create TeeCapacity {name}")))?;
        api.merge_patch_status(&name, json!({ "status": obj.status }))
            .await
            .map_err(error::failed(format!(
                "set the status of TeeCapacity {name}"
            )))?;
        Ok(())
    }

    /// Wait until the API server calls the webhooks registered for `namespace`'s test: a dry-run
    /// CREATE of a TDX VM's pod is either mutated by teeguard or refused by it.
    pub async fn wait_webhooks_called(&self, namespace: &str) -> Result<()> {
        let vmi = unique_name("probe");
        let uid = self.create_vmi(namespace, &vmi, Tee::Tdx).await?;
        let pod = Self::launcher_pod(namespace, &vmi, &uid, Tee::Tdx, &[])?;
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), namespace);
        let dry = PostParams {
            dry_run: true,
            ..PostParams::default()
        };
        self.wait_for(
            &format!("teeguard's webhooks to be called in {namespace}"),
            || async {
                match pods.create(&dry, &pod).await {
                    Ok(p) => p
                        .metadata
                        .annotations
                        .as_ref()?
                        .keys()
                        .any(|k| k.starts_with(names::MISC_MAX_ANNOTATION_PREFIX))
                        .then_some(()),
                    Err(kube::Error::Api(s)) => s.message.contains("TDX").then_some(()),
                    Err(_) => None,
                }
            },
        )
        .await
    }

    /// [`Cluster::register_webhooks`] for `test`, then [`Cluster::wait_webhooks_called`] in its
    /// `namespace`: from then on the API server calls `webhook` for the test's namespaces.
    pub async fn serve_webhooks(
        &self,
        test: &str,
        namespace: &str,
        rendered: &[Value],
        webhook: SocketAddr,
        ca_bundle_b64: &str,
    ) -> Result<()> {
        self.register_webhooks(test, rendered, webhook, ca_bundle_b64)
            .await?;
        self.wait_webhooks_called(namespace).await
    }

    /// Register teeguard's webhook configurations, taken from the rendered chart (`rendered`: every
    /// object of `helm template`), under names of this test (configurations `<name>-<test>`, webhooks
    /// `<test>.<name>`), calling `webhook` by URL
    /// (`https://<addr>/<path of the chart's service reference>`) with `ca_bundle_b64`, and matching
    /// only namespaces labelled [`TEST_LABEL`]`=<test>` on top of the chart's own selectors (see
    /// [`Cluster::wait_webhooks_called`] for when the API server starts calling them).
    pub async fn register_webhooks(
        &self,
        test: &str,
        rendered: &[Value],
        webhook: SocketAddr,
        ca_bundle_b64: &str,
    ) -> Result<Vec<String>> {
        let mut names = Vec::new();
        for kind in [
            "MutatingWebhookConfiguration",
            "ValidatingWebhookConfiguration",
        ] {
            for obj in rendered.iter().filter(|o| o["kind"] == kind) {
                let mut obj = obj.clone();
                let name = format!("{}-{test}", obj["metadata"]["name"].as_str().unwrap_or(""));
                obj["metadata"] = json!({ "name": name });
                for hook in obj["webhooks"].as_array_mut().into_iter().flatten() {
                    // Prefixed with the test's name: the API server's metrics and messages name
                    // webhooks by this name, so each test's are told apart.
                    let hook_name = format!("{test}.{}", hook["name"].as_str().unwrap_or(""));
                    hook["name"] = json!(hook_name);
                    let path = hook
                        .pointer("/clientConfig/service/path")
                        .and_then(Value::as_str)
                        .unwrap_or("/")
                        .to_string();
                    hook["clientConfig"] = json!({
                        "url": format!("https://{webhook}{path}"),
                        "caBundle": ca_bundle_b64,
                    });
                    let selector = hook
                        .get_mut("namespaceSelector")
                        .filter(|s| s.is_object())
                        .map(|s| s.take())
                        .unwrap_or_else(|| json!({}));
                    let mut exprs = selector
                        .get("matchExpressions")
                        .and_then(Value::as_array)
                        .cloned()
                        .unwrap_or_default();
                    exprs.push(json!({"key": TEST_LABEL, "operator": "In", "values": [test]}));
                    let mut selector = selector;
                    selector["matchExpressions"] = Value::Array(exprs);
                    hook["namespaceSelector"] = selector;
                }
                let plural = if kind.starts_with("Mutating") {
                    "mutatingwebhookconfigurations"
                } else {
                    "validatingwebhookconfigurations"
                };
                let ar = ApiResource {
                    group: "admissionregistration.k8s.io".into(),
                    version: "v1".into(),
                    api_version: "admissionregistration.k8s.io/v1".into(),
                    kind: kind.into(),
                    plural: plural.into(),
                };
                let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &ar);
                let dynamic: DynamicObject =
                    serde_json::from_value(obj).map_err(|e| Error::failed(kind, e))?;
                api.create(&PostParams::default(), &dynamic)
                    .await
                    .map_err(error::failed(format!("register {kind} {name}")))?;
                names.push(name);
            }
        }
        Ok(names)
    }

    /// A [`ProcessEnv`] whose processes talk to this control plane as its admin.
    pub fn process_env(&self, config_yaml: &str) -> Result<ProcessEnv> {
        let source = self.cp.kubeconfig.clone();
        ProcessEnv::new(config_yaml, |path| {
            std::fs::copy(&source, path).map_err(error::io_at(
                "control plane",
                "copy the kubeconfig to",
                path,
            ))?;
            Ok(())
        })
    }
}
