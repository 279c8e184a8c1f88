//! Which of two copies of an object is the newer: the API server's `resourceVersion`s are etcd
//! revisions, numbers that only grow. A write's answer, a catch-up list and a watch may deliver one
//! object's copies out of order; the index keeps the newest.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

/// An object's `resourceVersion` as a number (`None` when absent or not a number).
pub fn resource_version(meta: &ObjectMeta) -> Option<u64> {
    meta.resource_version.as_deref()?.parse().ok()
}

/// Whether an object at `new` is older than the one held at `held` (both `resourceVersion`s, when
/// numbers).
pub fn older(new: Option<u64>, held: Option<u64>) -> bool {
    matches!((new, held), (Some(n), Some(h)) if n < h)
}
