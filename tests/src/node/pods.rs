//! Pods that can run on a [`super::RealNode`]: the test kit's realistic pods (virt-launcher, Kata, ...)
//! made runnable here, everything else about them unchanged. No registry is reachable and the node's
//! pod network routes nowhere, so every container runs the busybox image ([`super::BUSYBOX`], never
//! pulled) with `sleep` (init containers `true`) on the host network; the machine has 2 cores and no
//! local storage isolation, so CPU requests become 100m and `ephemeral-storage` requests go; PIDs 1
//! that ignore SIGTERM make a grace period of 1 s.

use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

use super::BUSYBOX;

/// What a runnable pod's long-running containers do.
const SLEEP: [&str; 2] = ["/bin/sleep", "3600"];
/// What its init containers do.
const INIT: [&str; 1] = ["/bin/true"];

/// `pod` made runnable on the node (see the module's documentation).
pub fn runnable(pod: &Pod) -> Pod {
    let mut v = serde_json::to_value(pod).unwrap_or(Value::Null);
    make_runnable(&mut v);
    serde_json::from_value(v).unwrap_or_else(|_| pod.clone())
}

/// [`runnable`] on the JSON form.
pub fn make_runnable(pod: &mut Value) {
    let Some(spec) = pod.get_mut("spec").and_then(Value::as_object_mut) else {
        return;
    };
    spec.insert("hostNetwork".into(), json!(true));
    spec.insert("terminationGracePeriodSeconds".into(), json!(1));
    spec.insert("automountServiceAccountToken".into(), json!(false));
    spec.insert("enableServiceLinks".into(), json!(false));
    for (list, command) in [("containers", &SLEEP[..]), ("initContainers", &INIT[..])] {
        for c in spec
            .get_mut(list)
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten()
        {
            let Some(c) = c.as_object_mut() else { continue };
            c.insert("image".into(), json!(BUSYBOX));
            c.insert("imagePullPolicy".into(), json!("Never"));
            c.insert("command".into(), json!(command));
            c.remove("args");
            for kind in ["requests", "limits"] {
                if let Some(r) = c
                    .get_mut("resources")
                    .and_then(|r| r.get_mut(kind))
                    .and_then(Value::as_object_mut)
                {
                    r.remove("ephemeral-storage");
                    if r.contains_key("cpu") {
                        r.insert("cpu".into(), json!("100m"));
                    }
                }
            }
        }
    }
}

/// A plain pod `name` in `namespace` with `containers` (name, requests, which are also its limits), on
/// the node `node_selector` selects, runnable.
pub fn plain(
    namespace: &str,
    name: &str,
    containers: &[(&str, &[(&str, &str)])],
    node_selector: &[(&str, &str)],
) -> Pod {
    let containers: Vec<Value> = containers
        .iter()
        .map(|(c, requests)| {
            let r: serde_json::Map<String, Value> = requests
                .iter()
                .map(|(k, v)| ((*k).into(), json!(v)))
                .collect();
            json!({"name": c, "resources": {"requests": r, "limits": r}})
        })
        .collect();
    let selector: serde_json::Map<String, Value> = node_selector
        .iter()
        .map(|(k, v)| ((*k).into(), json!(v)))
        .collect();
    let mut v = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"containers": containers, "nodeSelector": selector, "restartPolicy": "Never"}
    });
    make_runnable(&mut v);
    serde_json::from_value(v).unwrap_or_default()
}

/// The UID the kubelet runs `pod` under: a mirror pod's static pod's (`kubernetes.io/config.mirror`,
/// its configuration hash), or the pod's own.
pub fn runtime_uid(pod: &Pod) -> Option<&str> {
    pod.metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get("kubernetes.io/config.mirror"))
        .or(pod.metadata.uid.as_ref())
        .map(String::as_str)
}

/// Whether the pod runs with every container started.
pub fn running(p: &Pod) -> bool {
    let Some(status) = &p.status else {
        return false;
    };
    status.phase.as_deref() == Some("Running")
        && status
            .container_statuses
            .iter()
            .flatten()
            .all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
}
