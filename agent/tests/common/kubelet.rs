//! A kubelet's side of the DRA plugin protocol: unary gRPC calls over the plugin's unix sockets, with a
//! tonic client as the kubelet makes them.

use std::path::Path;

use prost::Message;

/// The DRA plugin's prepare method.
pub const PREPARE: &str = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources";
/// The DRA plugin's unprepare method.
pub const UNPREPARE: &str = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources";

/// Call `path` on the gRPC server at `socket`.
pub async fn call<Req, Resp>(socket: &Path, path: &'static str, req: Req) -> Resp
where
    Req: Message + Send + Sync + 'static,
    Resp: Message + Default + Send + Sync + 'static,
{
    let socket = socket.to_path_buf();
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_| {
            let s = socket.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(s).await?,
                ))
            }
        }))
        .await
        .expect("connect to the plugin socket");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    grpc.unary(
        tonic::Request::new(req),
        http::uri::PathAndQuery::from_static(path),
        tonic_prost::ProstCodec::<Req, Resp>::default(),
    )
    .await
    .expect("call")
    .into_inner()
}
