//! The two gRPC services a DRA driver serves the kubelet, over tonic with the messages of
//! [`super::proto`]: `Registration` on the registration socket (the kubelet's plugin watcher finds it
//! in `plugins_registry/`) and `DRAPlugin` on the driver's own socket. No code generation: each service
//! is a small `tower::Service` that routes a method name to a handler.

use std::convert::Infallible;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tokio_stream::wrappers::UnixListenerStream;
use tokio_util::sync::CancellationToken;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::{Request, Response, Status};

use super::proto::{
    DRA_PLUGIN_TYPE, DRA_SERVICE, DRA_V1_VERSION, InfoRequest, NodePrepareResourcesRequest,
    NodePrepareResourcesResponse, NodeUnprepareResourcesRequest, NodeUnprepareResourcesResponse,
    PluginInfo, REGISTRATION_SERVICE, RegistrationStatus, RegistrationStatusResponse,
};
use crate::error::{Error, Result};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// What the driver does when the kubelet calls `DRAPlugin`.
pub trait DraHandler: Send + Sync + 'static {
    /// Prepare claims (one result per claim UID; errors per claim, never for the whole call).
    fn prepare(
        &self,
        request: NodePrepareResourcesRequest,
    ) -> impl Future<Output = NodePrepareResourcesResponse> + Send;
    /// Unprepare claims.
    fn unprepare(
        &self,
        request: NodeUnprepareResourcesRequest,
    ) -> impl Future<Output = NodeUnprepareResourcesResponse> + Send;
}

/// Answer one unary call: decode `Req`, run `f`, encode its answer.
async fn unary<Req, Resp, F, Fut>(request: http::Request<Body>, f: F) -> http::Response<Body>
where
    Req: prost::Message + Default + Send + 'static,
    Resp: prost::Message + Send + 'static,
    F: FnOnce(Req) -> Fut + Clone + Send + 'static,
    Fut: Future<Output = std::result::Result<Resp, Status>> + Send + 'static,
{
    let service = tower::service_fn(move |r: Request<Req>| {
        let f = f.clone();
        async move { f(r.into_inner()).await.map(Response::new) }
    });
    let mut grpc = tonic::server::Grpc::new(tonic_prost::ProstCodec::<Resp, Req>::default());
    grpc.unary(service, request).await
}

fn unknown_method(service: &str, path: &str) -> http::Response<Body> {
    Status::unimplemented(format!("{path}: not a method of {service}")).into_http()
}

/// The `DRAPlugin` service around a handler.
pub struct DraService<H>(Arc<H>);

impl<H> DraService<H> {
    /// Serve `handler`.
    pub fn new(handler: Arc<H>) -> Self {
        DraService(handler)
    }
}

impl<H> std::fmt::Debug for DraService<H> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DraService")
    }
}

impl<H> Clone for DraService<H> {
    fn clone(&self) -> Self {
        DraService(self.0.clone())
    }
}

impl<H> NamedService for DraService<H> {
    const NAME: &'static str = DRA_SERVICE;
}

impl<H: DraHandler> tower::Service<http::Request<Body>> for DraService<H> {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<std::result::Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::result::Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let handler = self.0.clone();
        Box::pin(async move {
            let path = request.uri().path().to_owned();
            Ok(match path.rsplit_once('/').map(|(_, m)| m) {
                Some("NodePrepareResources") => {
                    unary(request, move |r: NodePrepareResourcesRequest| async move {
                        Ok(handler.prepare(r).await)
                    })
                    .await
                }
                Some("NodeUnprepareResources") => {
                    unary(
                        request,
                        move |r: NodeUnprepareResourcesRequest| async move {
                            Ok(handler.unprepare(r).await)
                        },
                    )
                    .await
                }
                _ => unknown_method(DRA_SERVICE, &path),
            })
        })
    }
}

/// The `Registration` service: tells the kubelet who the driver is and where it listens, and logs the
/// kubelet's verdict.
#[derive(Clone, Debug)]
pub struct RegistrationService {
    info: PluginInfo,
    registered: tokio::sync::watch::Sender<Option<RegistrationStatus>>,
}

impl RegistrationService {
    /// Register driver `name` with its DRA socket at `endpoint` (the path as the kubelet sees it).
    pub fn new(name: &str, endpoint: &Path) -> Self {
        RegistrationService {
            info: PluginInfo {
                r#type: DRA_PLUGIN_TYPE.into(),
                name: name.into(),
                endpoint: endpoint.display().to_string(),
                supported_versions: vec![DRA_V1_VERSION.into()],
            },
            registered: tokio::sync::watch::Sender::new(None),
        }
    }

    /// The kubelet's last verdict (`None` until it called).
    pub fn status(&self) -> tokio::sync::watch::Receiver<Option<RegistrationStatus>> {
        self.registered.subscribe()
    }
}

impl NamedService for RegistrationService {
    const NAME: &'static str = REGISTRATION_SERVICE;
}

impl tower::Service<http::Request<Body>> for RegistrationService {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<std::result::Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<std::result::Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let path = request.uri().path().to_owned();
            Ok(match path.rsplit_once('/').map(|(_, m)| m) {
                Some("GetInfo") => {
                    let info = this.info.clone();
                    unary(request, move |_: InfoRequest| async move { Ok(info) }).await
                }
                Some("NotifyRegistrationStatus") => {
                    let tx = this.registered.clone();
                    unary(request, move |s: RegistrationStatus| async move {
                        if s.plugin_registered {
                            tracing::info!("the kubelet registered the DRA driver");
                        } else {
                            tracing::error!(error = %s.error, "the kubelet refused to register the DRA driver");
                        }
                        tx.send_replace(Some(s));
                        Ok(RegistrationStatusResponse {})
                    })
                    .await
                }
                _ => unknown_method(REGISTRATION_SERVICE, &path),
            })
        })
    }
}

/// A service listening on a unix socket until shutdown; the socket file is removed when it stops.
#[derive(Debug)]
pub struct Listening {
    /// The socket.
    pub path: PathBuf,
    /// The server task (its error, when it failed).
    pub task: tokio::task::JoinHandle<()>,
}

/// Listen on `socket` (a stale file there is replaced; the directory is created) and serve `service`
/// until `shutdown`.
pub fn serve<S>(socket: &Path, service: S, shutdown: CancellationToken) -> Result<Listening>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    S::Future: Send + 'static,
{
    let io = |action: &'static str| {
        let path = socket.to_path_buf();
        move |source| Error::PluginSocket {
            path: path.clone(),
            action,
            source,
        }
    };
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).map_err(io("create the directory of"))?;
    }
    match std::fs::remove_file(socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("remove the stale")(e)),
    }
    let listener = tokio::net::UnixListener::bind(socket).map_err(io("listen on"))?;
    let path = socket.to_path_buf();
    let task = {
        let path = path.clone();
        tokio::spawn(async move {
            let result = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(
                    UnixListenerStream::new(listener),
                    shutdown.cancelled_owned(),
                )
                .await;
            if let Err(e) = result {
                tracing::error!(socket = %path.display(), error = %e, "the kubelet plugin server stopped");
            }
            let _ = std::fs::remove_file(&path);
        })
    };
    Ok(Listening { path, task })
}
