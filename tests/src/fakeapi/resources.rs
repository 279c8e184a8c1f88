//! The resource table: which resources the fake server serves and how each behaves.

use serde_json::{Map, Value};

/// How a list field merges in strategic merge patches and server-side apply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListKind {
    /// Replaced as a whole.
    Atomic,
    /// A map keyed by these item fields (`containers` by `name`, `conditions` by `type`).
    Map(Vec<String>),
    /// A set of scalars (`finalizers`).
    Set,
}

/// What happens to `.status` when an object is created through HTTP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CreateStatus {
    /// Kept as sent (Nodes, resources without a status subresource).
    Keep,
    /// Dropped (custom resources with a status subresource).
    Drop,
    /// Replaced by `{phase: <value>}` (Pods: `Pending`, Namespaces: `Active`).
    Phase(&'static str),
}

/// One resource the fake server serves.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResourceDef {
    /// API group, `""` for core.
    pub group: String,
    /// API version (`v1`, `v1alpha1`).
    pub version: String,
    /// Plural resource name used in URLs.
    pub plural: String,
    /// Kind (`Pod`).
    pub kind: String,
    /// Namespaced (`true`) or cluster-scoped.
    pub namespaced: bool,
    /// Subresources served: `status`, `binding`.
    pub subresources: Vec<String>,
    /// Custom resource semantics: strategic merge patch is refused (415), `PUT` needs a `resourceVersion`,
    /// lists merge atomically in server-side apply unless listed in [`ResourceDef::list_types`].
    pub custom: bool,
    /// What HTTP create does with `.status`.
    pub create_status: CreateStatus,
    /// Whether DELETE answers with the deleted object (Pods) rather than a `Status`.
    pub delete_returns_object: bool,
    /// Field selector paths the real server supports for this resource; `None` allows any dotted path.
    pub field_selectors: Option<Vec<String>>,
    /// List merge types by dotted field path (`status.conditions`), used for custom resources.
    pub list_types: Vec<(String, ListKind)>,
    /// Short names for discovery.
    pub short_names: Vec<String>,
}

impl ResourceDef {
    /// A plain resource with no subresources and built-in semantics.
    pub fn new(group: &str, version: &str, plural: &str, kind: &str, namespaced: bool) -> Self {
        Self {
            group: group.to_string(),
            version: version.to_string(),
            plural: plural.to_string(),
            kind: kind.to_string(),
            namespaced,
            subresources: Vec::new(),
            custom: false,
            create_status: CreateStatus::Keep,
            delete_returns_object: false,
            field_selectors: None,
            list_types: Vec::new(),
            short_names: Vec::new(),
        }
    }

    /// A custom resource (CRD semantics); with `status` it gets a status subresource.
    pub fn custom(
        group: &str,
        version: &str,
        plural: &str,
        kind: &str,
        namespaced: bool,
        status: bool,
    ) -> Self {
        let mut d = Self::new(group, version, plural, kind, namespaced);
        d.custom = true;
        let mut fields = vec!["metadata.name".to_string()];
        if namespaced {
            fields.push("metadata.namespace".to_string());
        }
        d.field_selectors = Some(fields);
        if status {
            d.subresources.push("status".to_string());
            d.create_status = CreateStatus::Drop;
        }
        d
    }

    /// teeguard's `TeeCapacity` (cluster-scoped, status subresource, conditions merged by `type`).
    pub fn tee_capacities() -> Self {
        Self::custom(
            "teeguard.dev",
            "v1alpha1",
            "teecapacities",
            "TeeCapacity",
            false,
            true,
        )
        .with_list_map("status.conditions", &["type"])
    }

    /// Adds subresources.
    pub fn with_subresources(mut self, subs: &[&str]) -> Self {
        self.subresources.extend(subs.iter().map(|s| s.to_string()));
        self
    }

    /// Restricts field selectors to these paths.
    pub fn with_field_selectors(mut self, fields: &[&str]) -> Self {
        self.field_selectors = Some(fields.iter().map(|s| s.to_string()).collect());
        self
    }

    /// Declares a list-type map (`x-kubernetes-list-type: map`) at a dotted path.
    pub fn with_list_map(mut self, path: &str, keys: &[&str]) -> Self {
        self.list_types.push((
            path.to_string(),
            ListKind::Map(keys.iter().map(|s| s.to_string()).collect()),
        ));
        self
    }

    /// `v1` or `group/version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// Whether the resource has a `status` subresource.
    pub fn has_status(&self) -> bool {
        self.has_sub("status")
    }

    /// Whether the resource serves this subresource.
    pub fn has_sub(&self, sub: &str) -> bool {
        self.subresources.iter().any(|s| s == sub)
    }

    /// The lowercase singular name.
    pub fn singular(&self) -> String {
        self.kind.to_lowercase()
    }

    /// How the list at this field path merges.
    pub(crate) fn list_kind(&self, names: &[String]) -> ListKind {
        if self.custom && names.first().is_none_or(|n| n != "metadata") {
            let dotted = names.join(".");
            return self
                .list_types
                .iter()
                .find(|(p, _)| *p == dotted)
                .map(|(_, k)| k.clone())
                .unwrap_or(ListKind::Atomic);
        }
        let Some(last) = names.last() else {
            return ListKind::Atomic;
        };
        let dotted = names.join(".");
        if let Some((_, k)) = self.list_types.iter().find(|(p, _)| *p == dotted) {
            return k.clone();
        }
        builtin_list_kind(last)
    }
}

/// Patch merge keys of the built-in types the project touches (from the Go struct tags).
fn builtin_list_kind(field: &str) -> ListKind {
    let key = match field {
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "env"
        | "volumes"
        | "imagePullSecrets" => "name",
        "conditions" | "addresses" => "type",
        "ownerReferences" => "uid",
        "volumeMounts" => "mountPath",
        "finalizers" => return ListKind::Set,
        _ => return ListKind::Atomic,
    };
    ListKind::Map(vec![key.to_string()])
}

/// How a resource's objects map to the stored form.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum View {
    /// Stored as served.
    Identity,
    /// `events.k8s.io/v1` Event, stored as a core/v1 Event.
    EventsV1,
}

/// A registered resource: its definition, its storage slot and its view of the stored objects.
#[derive(Clone, Debug)]
pub(crate) struct Registered {
    pub def: ResourceDef,
    pub storage: usize,
    pub view: View,
}

/// core/v1 Event field <-> events.k8s.io/v1 Event field.
const EVENT_RENAMES: &[(&str, &str)] = &[
    ("involvedObject", "regarding"),
    ("message", "note"),
    ("reportingComponent", "reportingController"),
    ("source", "deprecatedSource"),
    ("firstTimestamp", "deprecatedFirstTimestamp"),
    ("lastTimestamp", "deprecatedLastTimestamp"),
    ("count", "deprecatedCount"),
];

fn rename(obj: &Value, to_view: bool) -> Value {
    let Value::Object(m) = obj else {
        return obj.clone();
    };
    let mut out = Map::new();
    for (k, v) in m {
        let key = EVENT_RENAMES
            .iter()
            .find_map(|(core, v1)| {
                if to_view && k == core {
                    Some(*v1)
                } else if !to_view && k == v1 {
                    Some(*core)
                } else {
                    None
                }
            })
            .unwrap_or(k.as_str());
        out.insert(key.to_string(), v.clone());
    }
    Value::Object(out)
}

impl Registered {
    /// The stored form of an object sent to this resource (partial objects are fine).
    pub fn to_storage(&self, obj: Value) -> Value {
        match self.view {
            View::Identity => obj,
            View::EventsV1 => {
                let mut v = rename(&obj, false);
                if v.get("apiVersion").is_some() {
                    v["apiVersion"] = Value::String("v1".into());
                }
                v
            }
        }
    }

    /// This resource's view of a stored object.
    pub fn to_view<'a>(&self, obj: &'a Value) -> std::borrow::Cow<'a, Value> {
        match self.view {
            View::Identity => std::borrow::Cow::Borrowed(obj),
            View::EventsV1 => {
                let mut v = rename(obj, true);
                v["apiVersion"] = Value::String(self.def.api_version());
                std::borrow::Cow::Owned(v)
            }
        }
    }
}

/// The resources served by default.
pub(crate) fn builtin() -> Vec<(ResourceDef, Option<&'static str>, View)> {
    let mut pods =
        ResourceDef::new("", "v1", "pods", "Pod", true).with_subresources(&["status", "binding"]);
    pods.create_status = CreateStatus::Phase("Pending");
    pods.delete_returns_object = true;
    pods.short_names = vec!["po".into()];
    pods = pods.with_field_selectors(&[
        "metadata.name",
        "metadata.namespace",
        "spec.nodeName",
        "spec.restartPolicy",
        "spec.schedulerName",
        "spec.serviceAccountName",
        "spec.hostNetwork",
        "status.phase",
        "status.podIP",
        "status.nominatedNodeName",
    ]);

    let mut nodes = ResourceDef::new("", "v1", "nodes", "Node", false)
        .with_subresources(&["status"])
        .with_field_selectors(&["metadata.name", "spec.unschedulable"]);
    nodes.short_names = vec!["no".into()];

    let mut namespaces = ResourceDef::new("", "v1", "namespaces", "Namespace", false)
        .with_subresources(&["status"])
        .with_field_selectors(&["metadata.name", "status.phase"]);
    namespaces.create_status = CreateStatus::Phase("Active");
    namespaces.short_names = vec!["ns".into()];

    let mut events = ResourceDef::new("", "v1", "events", "Event", true).with_field_selectors(&[
        "metadata.name",
        "metadata.namespace",
        "involvedObject.kind",
        "involvedObject.namespace",
        "involvedObject.name",
        "involvedObject.uid",
        "involvedObject.apiVersion",
        "involvedObject.resourceVersion",
        "involvedObject.fieldPath",
        "reason",
        "reportingComponent",
        "type",
    ]);
    events.short_names = vec!["ev".into()];

    let events_v1 = ResourceDef::new("events.k8s.io", "v1", "events", "Event", true)
        .with_field_selectors(&[
            "metadata.name",
            "metadata.namespace",
            "regarding.kind",
            "regarding.namespace",
            "regarding.name",
            "regarding.uid",
            "regarding.apiVersion",
            "regarding.resourceVersion",
            "regarding.fieldPath",
            "reason",
            "reportingController",
            "type",
        ]);

    let leases = ResourceDef::new("coordination.k8s.io", "v1", "leases", "Lease", true)
        .with_field_selectors(&["metadata.name", "metadata.namespace"]);

    let mut vmis = ResourceDef::custom(
        "kubevirt.io",
        "v1",
        "virtualmachineinstances",
        "VirtualMachineInstance",
        true,
        true,
    );
    vmis.short_names = vec!["vmi".into(), "vmis".into()];

    let mut teecaps = ResourceDef::tee_capacities();
    teecaps.short_names = vec!["teecap".into()];

    let mut teeres = ResourceDef::custom(
        "teeguard.dev",
        "v1alpha1",
        "teereservations",
        "TeeReservation",
        false,
        false,
    );
    teeres.short_names = vec!["teeres".into()];

    // DRA (the agent's DRA mode): the claims the kubelet asks it to prepare, its slices.
    let claims = ResourceDef::new(
        "resource.k8s.io",
        "v1",
        "resourceclaims",
        "ResourceClaim",
        true,
    )
    .with_field_selectors(&["metadata.name", "metadata.namespace"]);
    let slices = ResourceDef::new(
        "resource.k8s.io",
        "v1",
        "resourceslices",
        "ResourceSlice",
        false,
    )
    .with_field_selectors(&[
        "metadata.name",
        "spec.nodeName",
        "spec.driver",
        "spec.pool.name",
    ]);

    vec![
        (pods, None, View::Identity),
        (nodes, None, View::Identity),
        (namespaces, None, View::Identity),
        (events, None, View::Identity),
        (events_v1, Some("events"), View::EventsV1),
        (leases, None, View::Identity),
        (vmis, None, View::Identity),
        (teecaps, None, View::Identity),
        (teeres, None, View::Identity),
        (claims, None, View::Identity),
        (slices, None, View::Identity),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn events_round_trip_between_versions() {
        let reg = Registered {
            def: ResourceDef::new("events.k8s.io", "v1", "events", "Event", true),
            storage: 0,
            view: View::EventsV1,
        };
        let v1 = json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e"},
            "regarding": {"name": "p"}, "note": "hello", "reportingController": "c", "reason": "R"});
        let core = reg.to_storage(v1.clone());
        assert_eq!(core["apiVersion"], "v1");
        assert_eq!(core["involvedObject"]["name"], "p");
        assert_eq!(core["message"], "hello");
        assert_eq!(core["reportingComponent"], "c");
        assert_eq!(reg.to_view(&core).into_owned(), v1);
    }

    #[test]
    fn list_kinds() {
        let pods = ResourceDef::new("", "v1", "pods", "Pod", true);
        let cr = ResourceDef::custom("g", "v1", "xs", "X", false, true)
            .with_list_map("status.conditions", &["type"]);
        let map = |key: &str| ListKind::Map(vec![key.into()]);
        for (def, path, want) in [
            (&pods, ["spec", "containers"], map("name")),
            (&pods, ["spec", "tolerations"], ListKind::Atomic),
            (&pods, ["metadata", "finalizers"], ListKind::Set),
            (&cr, ["status", "conditions"], map("type")),
            (&cr, ["spec", "conditions"], ListKind::Atomic),
        ] {
            let path: Vec<String> = path.iter().map(|s| s.to_string()).collect();
            assert_eq!(def.list_kind(&path), want, "{path:?}");
        }
    }
}
