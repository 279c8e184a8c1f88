//! `teeguard-webhook review`: decide one AdmissionReview (or bare Pod) offline, like `kyverno apply`
//! or `gator test`, with the objects it needs read from files. It runs exactly the server's code
//! ([`review_mutation`], [`review_validation`]) with file-backed [`Lookups`].
//!
//! Output (YAML or JSON), one object:
//! - `review`: the mutating AdmissionReview response as the server sends it (patch base64-encoded);
//! - `patch`: the decoded JSON Patch (absent when there is none);
//! - `patchedObject`: the object with the patch applied (absent when the request is denied);
//! - `validation`: with `--tee-capacity`, `--node` or `--pod`, the validating AdmissionReview response
//!   for the request as the validating webhook sees it (a pod CREATE after the patch; nothing when the
//!   mutation denied it). No key is held yet and no Event is recorded.
//!
//! VMI manifests without `metadata.namespace` match a pod in any namespace, and so do Pod manifests
//! without one for a binding. Without `--node` files every node with a report is a candidate node. The
//! exit status is 0 whatever the decision; unreadable or invalid input is an error naming the file.

use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::prelude::{BASE64_STANDARD, Engine as _};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use teeguard_shared::{Config, TeeCapacity, VirtualMachineInstance};

use crate::cli::{OutputFormat, ReviewArgs};
use crate::cluster::caches::{Lookups, PodLookup};
use crate::cluster::index::{KeyIndex, wall_clock};
use crate::decide::mutation::{VmiLookup, VmiRef};
use crate::error::{Error, Result};
use crate::web::handlers::mutate::review_mutation;
use crate::web::handlers::validate::{ValidationContext, review_validation};

/// UID given to the AdmissionReview built around a bare Pod.
pub const OFFLINE_UID: &str = "teeguard-offline-review";

/// Objects read from files, answering lookups like the server's caches.
#[derive(Debug)]
pub struct FileLookups {
    index: KeyIndex,
    vmis: HashMap<(String, String), Arc<VirtualMachineInstance>>,
    vmis_any_namespace: HashMap<String, Arc<VirtualMachineInstance>>,
    namespaces: HashMap<String, BTreeMap<String, String>>,
    tee_capacities: BTreeMap<String, Arc<TeeCapacity>>,
    nodes: BTreeMap<String, BTreeMap<String, String>>,
    pods: HashMap<(String, String), Arc<Pod>>,
    pods_any_namespace: HashMap<String, Arc<Pod>>,
    validate: bool,
}

impl FileLookups {
    /// Add a VMI.
    pub fn add_vmi(&mut self, vmi: VirtualMachineInstance) {
        let name = vmi.metadata.name.clone().unwrap_or_default();
        match vmi.metadata.namespace.clone().filter(|n| !n.is_empty()) {
            Some(ns) => {
                self.vmis.insert((ns, name), Arc::new(vmi));
            }
            None => {
                self.vmis_any_namespace.insert(name, Arc::new(vmi));
            }
        }
    }

    /// Add a namespace's labels.
    pub fn add_namespace(&mut self, name: String, labels: BTreeMap<String, String>) {
        self.namespaces.insert(name, labels);
    }

    /// Add a node report (keyed by its name, the node's name).
    pub fn add_tee_capacity(&mut self, cap: TeeCapacity) {
        let name = cap.metadata.name.clone().unwrap_or_default();
        self.tee_capacities.insert(name, Arc::new(cap));
        self.index_files();
    }

    /// Add a node's labels.
    pub fn add_node(&mut self, name: String, labels: BTreeMap<String, String>) {
        self.nodes.insert(name, labels);
        self.index_files();
    }

    /// The admission index from the files: the nodes of the node files (without any, every reported
    /// node, its labels unknown) and the reports. No holds: nothing is admitted yet.
    fn index_files(&mut self) {
        let config = Config::default();
        let index = KeyIndex::new(config.admission.ledger_ttl, wall_clock());
        index.update(|ix, now| {
            for (name, cap) in &self.tee_capacities {
                ix.apply_report(name, cap.status.clone().map(Arc::new), None, now);
                if self.nodes.is_empty() {
                    ix.apply_node(name, Some(BTreeMap::new()));
                }
            }
            for (name, labels) in &self.nodes {
                ix.apply_node(name, Some(labels.clone()));
            }
        });
        self.index = index;
    }

    /// Add a pod (bindings refer to it by name).
    pub fn add_pod(&mut self, pod: Pod) {
        let name = pod.metadata.name.clone().unwrap_or_default();
        match pod.metadata.namespace.clone().filter(|n| !n.is_empty()) {
            Some(ns) => {
                self.pods.insert((ns, name), Arc::new(pod));
            }
            None => {
                self.pods_any_namespace.insert(name, Arc::new(pod));
            }
        }
    }

    /// Whether the validating review is wanted (reports, nodes or pods were given).
    pub fn validate(&self) -> bool {
        self.validate
    }

    /// Read every `--vmi`, `--namespace-file`, `--tee-capacity`, `--node` and `--pod` file.
    pub fn load(args: &ReviewArgs) -> Result<Self> {
        let mut out = FileLookups {
            validate: !(args.tee_capacities.is_empty()
                && args.nodes.is_empty()
                && args.pods.is_empty()),
            ..FileLookups::default()
        };
        for (path, i, vmi) in
            objects::<VirtualMachineInstance>(&args.vmis, "VirtualMachineInstance")?
        {
            if vmi.metadata.name.as_deref().is_none_or(str::is_empty) {
                return Err(Error::FileParse {
                    path,
                    reason: format!(
                        "document {}: VirtualMachineInstance has no metadata.name",
                        i + 1
                    ),
                });
            }
            if let Err(e) = vmi.tee_kind() {
                tracing::warn!(file = %path.display(), error = %e, "VMI sets more than one TEE kind");
            }
            out.add_vmi(vmi);
        }
        for (_, _, ns) in objects::<Namespace>(&args.namespaces, "Namespace")? {
            let name = ns.metadata.name.clone().unwrap_or_default();
            out.add_namespace(name, ns.metadata.labels.unwrap_or_default());
        }
        for (_, _, cap) in objects::<TeeCapacity>(&args.tee_capacities, "TeeCapacity")? {
            out.add_tee_capacity(cap);
        }
        for (_, _, node) in objects::<Node>(&args.nodes, "Node")? {
            let name = node.metadata.name.clone().unwrap_or_default();
            out.add_node(name, node.metadata.labels.unwrap_or_default());
        }
        for (_, _, pod) in objects::<Pod>(&args.pods, "Pod")? {
            out.add_pod(pod);
        }
        Ok(out)
    }
}

/// Every document of `paths`, each checked to be a `kind` and read as a `T`, with its file and its
/// place in it (errors name both).
fn objects<T: DeserializeOwned>(paths: &[PathBuf], kind: &str) -> Result<Vec<(PathBuf, usize, T)>> {
    let mut out = Vec::new();
    for path in paths {
        for (i, doc) in read_docs(path)?.into_iter().enumerate() {
            expect_kind(path, i, &doc, kind)?;
            let object = serde_json::from_value(doc).map_err(|e| Error::FileParse {
                path: path.clone(),
                reason: format!("document {}: not a valid {kind}: {e}", i + 1),
            })?;
            out.push((path.clone(), i, object));
        }
    }
    Ok(out)
}

impl Lookups for FileLookups {
    async fn namespace_labels(&self, namespace: &str) -> Result<Option<BTreeMap<String, String>>> {
        Ok(self.namespaces.get(namespace).cloned())
    }

    async fn vmi(&self, vmi: &VmiRef) -> VmiLookup {
        let key = (vmi.namespace.clone(), vmi.name.clone());
        match self
            .vmis
            .get(&key)
            .or_else(|| self.vmis_any_namespace.get(&vmi.name))
        {
            Some(v) => VmiLookup::Found(v.clone()),
            None => VmiLookup::NotFound,
        }
    }

    async fn launcher_pod(&self, namespace: &str, name: &str, uid: &str) -> PodLookup {
        let key = (namespace.to_string(), name.to_string());
        match self
            .pods
            .get(&key)
            .or_else(|| self.pods_any_namespace.get(name))
        {
            Some(p) if uid.is_empty() || p.metadata.uid.as_deref() == Some(uid) => {
                PodLookup::Found(p.clone())
            }
            _ => PodLookup::NotFound,
        }
    }

    fn index(&self) -> &KeyIndex {
        &self.index
    }

    fn node_labels_known(&self) -> bool {
        !self.nodes.is_empty()
    }
}

impl Default for FileLookups {
    fn default() -> Self {
        FileLookups {
            index: KeyIndex::new(Config::default().admission.ledger_ttl, wall_clock()),
            vmis: HashMap::new(),
            vmis_any_namespace: HashMap::new(),
            namespaces: HashMap::new(),
            tee_capacities: BTreeMap::new(),
            nodes: BTreeMap::new(),
            pods: HashMap::new(),
            pods_any_namespace: HashMap::new(),
            validate: false,
        }
    }
}

fn read_text(path: &Path) -> Result<String> {
    if path == Path::new("-") {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|source| Error::FileRead {
                path: path.to_path_buf(),
                source,
            })?;
        return Ok(s);
    }
    std::fs::read_to_string(path).map_err(|source| Error::FileRead {
        path: path.to_path_buf(),
        source,
    })
}

/// Parse a file's documents (JSON, or YAML with `---` separators); `List` kinds are flattened and
/// empty documents skipped.
pub fn parse_docs(path: &Path, text: &str) -> Result<Vec<Value>> {
    let bad = |reason: String| Error::FileParse {
        path: path.to_path_buf(),
        reason,
    };
    let mut docs = Vec::new();
    let trimmed = text.trim_start();
    if trimmed.starts_with('{') || trimmed.starts_with('[') {
        let v: Value = serde_json::from_str(text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        docs.push(v);
    } else {
        for (i, de) in serde_yaml::Deserializer::from_str(text).enumerate() {
            let v = Value::deserialize(de)
                .map_err(|e| bad(format!("document {}: invalid YAML: {e}", i + 1)))?;
            docs.push(v);
        }
    }
    let mut out = Vec::with_capacity(docs.len());
    for doc in docs {
        match doc {
            Value::Null => {}
            Value::Array(items) => out.extend(items),
            Value::Object(ref m)
                if m.get("kind")
                    .and_then(Value::as_str)
                    .is_some_and(|k| k.ends_with("List"))
                    && m.get("items").is_some_and(Value::is_array) =>
            {
                if let Some(Value::Array(items)) = doc.get("items").cloned() {
                    out.extend(items);
                }
            }
            other => out.push(other),
        }
    }
    if out.is_empty() {
        return Err(bad("no objects found (empty file?)".into()));
    }
    Ok(out)
}

fn read_docs(path: &Path) -> Result<Vec<Value>> {
    parse_docs(path, &read_text(path)?)
}

fn expect_kind(path: &Path, index: usize, doc: &Value, kind: &str) -> Result<()> {
    let found = doc.get("kind").and_then(Value::as_str).unwrap_or("");
    if found == kind {
        Ok(())
    } else {
        Err(Error::FileParse {
            path: path.to_path_buf(),
            reason: format!("document {}: kind is {found:?}, expected {kind}", index + 1),
        })
    }
}

/// Turn the input document into an AdmissionReview body: an AdmissionReview as is, a bare Pod
/// wrapped as a CREATE.
pub fn review_body(path: &Path, doc: Value) -> Result<Vec<u8>> {
    let kind = doc.get("kind").and_then(Value::as_str).unwrap_or("");
    let review = match kind {
        "AdmissionReview" => doc,
        "Pod" => {
            let namespace = doc
                .pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .unwrap_or("default")
                .to_string();
            let name = doc
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string();
            json!({
                "apiVersion": crate::web::admission::API_VERSION,
                "kind": crate::web::admission::KIND,
                "request": {
                    "uid": OFFLINE_UID,
                    "kind": {"group": "", "version": "v1", "kind": "Pod"},
                    "resource": {"group": "", "version": "v1", "resource": "pods"},
                    "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
                    "requestResource": {"group": "", "version": "v1", "resource": "pods"},
                    "name": name,
                    "namespace": namespace,
                    "operation": "CREATE",
                    "userInfo": {"username": "teeguard-webhook-review"},
                    "object": doc,
                    "oldObject": null,
                    "dryRun": false
                }
            })
        }
        other => {
            return Err(Error::FileParse {
                path: path.to_path_buf(),
                reason: format!("kind is {other:?}: expected an AdmissionReview or a Pod"),
            });
        }
    };
    serde_json::to_vec(&review).map_err(serialising("the AdmissionReview"))
}

/// An [`Error::Serialize`] naming `what`.
fn serialising<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> Error {
    move |e| Error::Serialize {
        what,
        reason: e.to_string(),
    }
}

/// An [`Error::FileParse`] naming the input file.
fn in_input<E: std::fmt::Display>(path: &Path) -> impl FnOnce(E) -> Error + '_ {
    move |e| Error::FileParse {
        path: path.to_path_buf(),
        reason: e.to_string(),
    }
}

/// Review the input against `lookups` and return the output document.
pub async fn review_document(
    path: &Path,
    body: &[u8],
    lookups: &FileLookups,
    config: &Config,
) -> Result<Value> {
    let reviewed = review_mutation(body, lookups, config, None)
        .await
        .map_err(in_input(path))?;
    let review: Value = serde_json::from_slice(&reviewed.response.to_json())
        .map_err(serialising("the AdmissionReview response"))?;
    let mut out = serde_json::Map::new();
    let patch = match review.pointer("/response/patch").and_then(Value::as_str) {
        Some(b64) => {
            let bytes = BASE64_STANDARD
                .decode(b64)
                .map_err(serialising("the patch (base64)"))?;
            let patch: json_patch::Patch =
                serde_json::from_slice(&bytes).map_err(serialising("the patch"))?;
            out.insert(
                "patch".into(),
                serde_json::to_value(&patch).map_err(serialising("the patch"))?,
            );
            Some(patch)
        }
        None => None,
    };
    let allowed = review
        .pointer("/response/allowed")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    // The mutation read the body, so it is JSON.
    let mut request: Value = serde_json::from_slice(body).map_err(in_input(path))?;
    if allowed
        && let Some(object) = request
            .pointer_mut("/request/object")
            .filter(|o| !o.is_null())
    {
        if let Some(p) = &patch {
            json_patch::patch(object, &p.0).map_err(|e| Error::FileParse {
                path: path.to_path_buf(),
                reason: format!("the patch does not apply to the object: {e}"),
            })?;
        }
        out.insert("patchedObject".into(), object.clone());
    }
    // The validating webhook sees a pod CREATE after the mutation (the request now holds the patched
    // object); a denied CREATE never gets there.
    if lookups.validate() && allowed {
        let vbody =
            serde_json::to_vec(&request).map_err(serialising("the validating AdmissionReview"))?;
        let hints = crate::cluster::admission::FitHints::default();
        let ctx = ValidationContext {
            config,
            events: None,
            metrics: None,
            hints: &hints,
            replica: "offline",
            decider: None,
        };
        let validated = review_validation(&vbody, lookups, &ctx)
            .await
            .map_err(in_input(path))?;
        let v: Value = serde_json::from_slice(&validated.response.to_json())
            .map_err(serialising("the validating AdmissionReview response"))?;
        out.insert("validation".into(), v);
    }
    let mut doc = serde_json::Map::new();
    doc.insert("review".into(), review);
    doc.extend(out);
    Ok(Value::Object(doc))
}

/// `teeguard-webhook review`.
pub async fn run(args: &ReviewArgs, out: &mut impl Write) -> Result<()> {
    let config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    let mut docs = read_docs(&args.input)?;
    if docs.len() != 1 {
        return Err(Error::FileParse {
            path: args.input.clone(),
            reason: format!(
                "holds {} objects: give exactly one AdmissionReview or Pod",
                docs.len()
            ),
        });
    }
    let body = review_body(&args.input, docs.remove(0))?;
    let lookups = FileLookups::load(args)?;
    let doc = review_document(&args.input, &body, &lookups, &config).await?;
    let text = match args.output {
        OutputFormat::Json => serde_json::to_string_pretty(&doc)
            .map(|s| s + "\n")
            .map_err(|e| e.to_string()),
        OutputFormat::Yaml => serde_yaml::to_string(&doc).map_err(|e| e.to_string()),
    }
    .map_err(serialising("the review output"))?;
    out.write_all(text.as_bytes()).map_err(Error::Output)?;
    out.flush().map_err(Error::Output)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn docs_yaml_json_lists() {
        let p = PathBuf::from("x.yaml");
        let docs = parse_docs(
            &p,
            "---\na: 1\n---\n---\nkind: List\nitems:\n- b: 2\n- c: 3\n",
        )
        .expect("docs");
        assert_eq!(
            docs,
            vec![json!({"a": 1}), json!({"b": 2}), json!({"c": 3})]
        );
        let docs = parse_docs(&p, "{\"kind\": \"Pod\"}").expect("json");
        assert_eq!(docs, vec![json!({"kind": "Pod"})]);
        let err = parse_docs(&p, "a: [").expect_err("bad yaml").to_string();
        assert!(err.starts_with("x.yaml: document 1: invalid YAML"), "{err}");
        let err = parse_docs(&p, "{oops").expect_err("bad json").to_string();
        assert!(err.starts_with("x.yaml: invalid JSON"), "{err}");
        let err = parse_docs(&p, "\n").expect_err("empty").to_string();
        assert!(err.contains("no objects"), "{err}");
    }

    #[test]
    fn bare_pod_is_wrapped_as_a_create() {
        let body = review_body(
            Path::new("pod.yaml"),
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "p-"}}),
        )
        .expect("body");
        let req = crate::web::admission::ReviewRequest::parse(&body).expect("review");
        assert_eq!(req.uid, OFFLINE_UID);
        assert_eq!(req.namespace, "default");
        assert!(req.is_resource("", "pods"));
        let err = review_body(Path::new("d.yaml"), json!({"kind": "Deployment"}))
            .expect_err("deployment")
            .to_string();
        assert!(
            err.contains("d.yaml") && err.contains("Deployment"),
            "{err}"
        );
    }
}
