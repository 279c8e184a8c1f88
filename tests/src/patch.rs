//! The write most tests make: a JSON merge patch with default parameters (of an object or its
//! status), as one call.

use std::fmt::Debug;
use std::future::Future;

use kube::Api;
use kube::api::{Patch, PatchParams};
use serde::Serialize;
use serde::de::DeserializeOwned;

/// What a merge patch can be made of (a `json!` value, or any serialisable object).
pub trait Body: Serialize + Debug + Send + Sync {}

impl<T: Serialize + Debug + Send + Sync> Body for T {}

/// `PATCH` of the named object with a JSON merge patch (`application/merge-patch+json`) and default
/// parameters; each returns the object as the API server returned it after the patch.
pub trait MergePatch<K> {
    /// Of the object.
    fn merge_patch(&self, name: &str, patch: impl Body) -> impl Future<Output = kube::Result<K>>;
    /// Of its `status` subresource.
    fn merge_patch_status(
        &self,
        name: &str,
        patch: impl Body,
    ) -> impl Future<Output = kube::Result<K>>;
}

impl<K: Clone + DeserializeOwned + Debug> MergePatch<K> for Api<K> {
    async fn merge_patch(&self, name: &str, patch: impl Body) -> kube::Result<K> {
        let params = PatchParams::default();
        self.patch(name, &params, &Patch::Merge(patch)).await
    }

    async fn merge_patch_status(&self, name: &str, patch: impl Body) -> kube::Result<K> {
        let params = PatchParams::default();
        self.patch_status(name, &params, &Patch::Merge(patch)).await
    }
}
