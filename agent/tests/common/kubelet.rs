//! A kubelet's side of the DRA plugin protocol: the test kit's unary gRPC calls over the plugin's unix
//! sockets, failing the test when a call fails.

use std::path::Path;

use prost::Message;

/// Call `path` on the gRPC server at `socket`.
pub async fn call<Req, Resp>(socket: &Path, path: &'static str, req: Req) -> Resp
where
    Req: Message + Send + Sync + 'static,
    Resp: Message + Default + Send + Sync + 'static,
{
    teeguard_tests::dra::call(socket, path, req)
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}
