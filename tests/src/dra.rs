//! DRA's kubelet side for tests and benches: unary calls to a DRA driver's `DRAPlugin` over its unix
//! socket (a tonic client, as the kubelet makes them), and a stand-in driver that answers every
//! prepare at once, to tell the time a real driver's work costs from everything around it.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use prost::Message;
use teeguard_agent::kubelet::PluginPaths;
use teeguard_agent::kubelet::grpc::{self, DraHandler, DraService, Listening, RegistrationService};
use teeguard_agent::kubelet::proto::{
    NodePrepareResourceResponse, NodePrepareResourcesRequest, NodePrepareResourcesResponse,
    NodeUnprepareResourceResponse, NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse,
    RegistrationStatus,
};
use tokio_util::sync::CancellationToken;

/// `DRAPlugin`'s prepare method.
pub const PREPARE: &str = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources";
/// `DRAPlugin`'s unprepare method.
pub const UNPREPARE: &str = "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources";

/// Call `path` on the gRPC server at `socket` over a connection of its own; the error says which
/// step failed.
pub async fn call<Req, Resp>(socket: &Path, path: &'static str, req: Req) -> Result<Resp, String>
where
    Req: Message + Send + Sync + 'static,
    Resp: Message + Default + Send + Sync + 'static,
{
    PluginClient::connect(socket).await?.call(path, req).await
}

/// One connection to a plugin's socket, as the kubelet keeps one per driver: concurrent calls share it
/// (HTTP/2 streams).
#[derive(Clone, Debug)]
pub struct PluginClient {
    channel: tonic::transport::Channel,
    socket: PathBuf,
}

impl PluginClient {
    /// Connect to the gRPC server at `socket`.
    pub async fn connect(socket: &Path) -> Result<PluginClient, String> {
        let at = socket.to_path_buf();
        let channel = tonic::transport::Endpoint::from_static("http://localhost")
            .connect_with_connector(tower::service_fn(move |_| {
                let s = at.clone();
                async move {
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                        tokio::net::UnixStream::connect(s).await?,
                    ))
                }
            }))
            .await
            .map_err(|e| format!("connect to {}: {e}", socket.display()))?;
        Ok(PluginClient {
            channel,
            socket: socket.to_path_buf(),
        })
    }

    /// Call `path` with `req`.
    pub async fn call<Req, Resp>(&self, path: &'static str, req: Req) -> Result<Resp, String>
    where
        Req: Message + Send + Sync + 'static,
        Resp: Message + Default + Send + Sync + 'static,
    {
        let mut grpc = tonic::client::Grpc::new(self.channel.clone());
        grpc.ready()
            .await
            .map_err(|e| format!("{}: not ready: {e}", self.socket.display()))?;
        grpc.unary(
            tonic::Request::new(req),
            http::uri::PathAndQuery::from_static(path),
            tonic_prost::ProstCodec::<Req, Resp>::default(),
        )
        .await
        .map(tonic::Response::into_inner)
        .map_err(|e| format!("{path} on {}: {e}", self.socket.display()))
    }
}

/// A DRA driver that answers every prepare at once, with no device and no API read (the kubelet then
/// starts the pod with no CDI device, as it does for teeguard's devices, which carry none), and every
/// unprepare with success. It serves the kubelet plugin of `tee.teeguard.dev` at the paths the agent
/// uses, so it takes the agent's place on a node; the ResourceSlices stay the agent's.
#[derive(Debug)]
pub struct StandInDriver {
    registration: tokio::sync::watch::Receiver<Option<RegistrationStatus>>,
    answered: Arc<AtOnce>,
    stop: CancellationToken,
    _servers: [Listening; 2],
}

#[derive(Debug, Default)]
struct AtOnce {
    prepared: AtomicUsize,
}

impl DraHandler for AtOnce {
    async fn prepare(&self, request: NodePrepareResourcesRequest) -> NodePrepareResourcesResponse {
        self.prepared
            .fetch_add(request.claims.len(), Ordering::Relaxed);
        NodePrepareResourcesResponse {
            claims: request
                .claims
                .into_iter()
                .map(|c| (c.uid, NodePrepareResourceResponse::default()))
                .collect(),
        }
    }

    async fn unprepare(
        &self,
        request: NodeUnprepareResourcesRequest,
    ) -> NodeUnprepareResourcesResponse {
        NodeUnprepareResourcesResponse {
            claims: request
                .claims
                .into_iter()
                .map(|c| (c.uid, NodeUnprepareResourceResponse::default()))
                .collect(),
        }
    }
}

impl StandInDriver {
    /// Serve the plugin under the kubelet root `kubelet_dir` (stale sockets replaced) until dropped.
    pub fn start(kubelet_dir: &Path) -> Result<StandInDriver, String> {
        let paths = PluginPaths::under(kubelet_dir);
        let stop = CancellationToken::new();
        let answered = Arc::new(AtOnce::default());
        let dra = grpc::serve(&paths.dra, DraService::new(answered.clone()), stop.clone())
            .map_err(|e| e.to_string())?;
        let service = RegistrationService::new(teeguard_shared::names::DRA_DRIVER, &paths.dra);
        let registration = service.status();
        let reg =
            grpc::serve(&paths.registration, service, stop.clone()).map_err(|e| e.to_string())?;
        Ok(StandInDriver {
            registration,
            answered,
            stop,
            _servers: [dra, reg],
        })
    }

    /// Wait until the kubelet says it registered the driver (its own signal); `timeout` only bounds a
    /// kubelet that never calls.
    pub async fn wait_registered(&mut self, timeout: Duration) -> Result<(), String> {
        let got = tokio::time::timeout(timeout, self.registration.wait_for(|s| s.is_some()))
            .await
            .map_err(|_| {
                format!("the kubelet did not register the stand-in driver within {timeout:?}")
            })?
            .map_err(|e| e.to_string())?
            .clone();
        match got {
            Some(s) if s.plugin_registered => Ok(()),
            Some(s) => Err(format!(
                "the kubelet refused the stand-in driver: {}",
                s.error
            )),
            None => Err("no registration status".into()),
        }
    }

    /// Claims prepared so far.
    pub fn prepared(&self) -> usize {
        self.answered.prepared.load(Ordering::Relaxed)
    }
}

impl Drop for StandInDriver {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use teeguard_agent::kubelet::proto::{Claim, InfoRequest, PluginInfo};

    const GET_INFO: &str = "/pluginregistration.Registration/GetInfo";

    fn claim(uid: &str) -> Claim {
        Claim {
            namespace: "ns".into(),
            uid: uid.into(),
            name: format!("claim-{uid}"),
        }
    }

    #[tokio::test]
    async fn the_stand_in_registers_as_teeguards_driver_and_answers_every_claim_at_once() {
        let dir = tempfile::tempdir().expect("dir");
        let driver = StandInDriver::start(dir.path()).expect("starts");
        let paths = PluginPaths::under(dir.path());
        let info: PluginInfo = call(&paths.registration, GET_INFO, InfoRequest {})
            .await
            .expect("GetInfo");
        assert_eq!(info.name, teeguard_shared::names::DRA_DRIVER);
        assert_eq!(info.endpoint, paths.dra.display().to_string());
        let client = PluginClient::connect(&paths.dra).await.expect("connects");
        let answer: NodePrepareResourcesResponse = client
            .call(
                PREPARE,
                NodePrepareResourcesRequest {
                    claims: vec![claim("a"), claim("b")],
                },
            )
            .await
            .expect("prepare");
        let mut uids: Vec<&String> = answer.claims.keys().collect();
        uids.sort();
        assert_eq!(uids, ["a", "b"]);
        assert!(
            answer
                .claims
                .values()
                .all(|c| c.error.is_empty() && c.devices.is_empty())
        );
        assert_eq!(driver.prepared(), 2);
        let undone: NodeUnprepareResourcesResponse = client
            .call(
                UNPREPARE,
                NodeUnprepareResourcesRequest {
                    claims: vec![claim("a")],
                },
            )
            .await
            .expect("unprepare");
        assert_eq!(undone.claims.len(), 1);
    }
}
