//! Serving the fake API server on 127.0.0.1 (plain HTTP), for separate processes, with a kubeconfig.

use std::net::SocketAddr;
use std::path::Path;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::task::{JoinHandle, JoinSet};

use super::FakeApiServer;
use crate::{Error, Result};

/// The fake API server listening on `127.0.0.1:<port>`. Stopping it closes the listener and every open
/// connection (like a crashed API server); restarting listens on the same port again with the same state.
/// Dropping it stops it.
#[derive(Debug)]
pub struct ServedFakeApi {
    server: FakeApiServer,
    addr: SocketAddr,
    task: Option<JoinHandle<()>>,
}

async fn accept_loop(listener: TcpListener, server: FakeApiServer) {
    let mut conns = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    let svc = TowerToHyperService::new(server.router());
                    conns.spawn(async move {
                        let builder = Builder::new(TokioExecutor::new());
                        if let Err(e) = builder.serve_connection(TokioIo::new(stream), svc).await {
                            tracing::debug!(error = %e, "fake API server connection ended with an error");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "fake API server: accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            },
            Some(_) = conns.join_next(), if !conns.is_empty() => {}
        }
    }
    // Dropping `conns` (when this task is aborted) aborts every connection.
}

impl ServedFakeApi {
    pub(crate) async fn start(server: FakeApiServer, addr: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| Error::Serve {
                addr: addr.to_string(),
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| Error::Serve {
            addr: addr.to_string(),
            source,
        })?;
        let task = tokio::spawn(accept_loop(listener, server.clone()));
        Ok(Self {
            server,
            addr,
            task: Some(task),
        })
    }

    /// The listening address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The served server (same state as the in-process one).
    pub fn server(&self) -> &FakeApiServer {
        &self.server
    }

    /// Whether it is currently listening.
    pub fn is_running(&self) -> bool {
        self.task.is_some()
    }

    /// A kubeconfig (YAML) pointing at this server, context `fakeapi`, namespace `default`, no credentials.
    pub fn kubeconfig_yaml(&self) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fakeapi\n  cluster:\n    server: {}\n\
             contexts:\n- name: fakeapi\n  context:\n    cluster: fakeapi\n    user: fakeapi\n    namespace: default\n\
             current-context: fakeapi\nusers:\n- name: fakeapi\n  user: {{}}\n",
            self.url()
        )
    }

    /// Writes [`ServedFakeApi::kubeconfig_yaml`] to `path` (for `KUBECONFIG` of child processes).
    pub fn write_kubeconfig(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.kubeconfig_yaml())
            .map_err(|e| Error::Kubeconfig(format!("writing {}: {e}", path.display())))
    }

    /// A kube client built the way a separate process builds it: from the kubeconfig, over TCP.
    pub async fn client(&self) -> Result<kube::Client> {
        self.build_client(None).await
    }

    /// Like [`ServedFakeApi::client`], sending `User-Agent: <user_agent>` on every request (through kube's
    /// extra-headers layer), so the request log tells which component made each call.
    pub async fn client_with_user_agent(&self, user_agent: &str) -> Result<kube::Client> {
        self.build_client(Some(user_agent)).await
    }

    async fn build_client(&self, user_agent: Option<&str>) -> Result<kube::Client> {
        let kc = kube::config::Kubeconfig::from_yaml(&self.kubeconfig_yaml())
            .map_err(|e| Error::Kubeconfig(format!("parsing the generated kubeconfig: {e}")))?;
        let mut config =
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| Error::Kubeconfig(format!("loading the generated kubeconfig: {e}")))?;
        if let Some(ua) = user_agent {
            let value = http::HeaderValue::from_str(ua).map_err(|e| {
                Error::Kubeconfig(format!("user agent {ua:?} is not a header value: {e}"))
            })?;
            config.headers.push((http::header::USER_AGENT, value));
        }
        kube::Client::try_from(config)
            .map_err(|e| Error::Kubeconfig(format!("building a client: {e}")))
    }

    /// Stops listening and closes every connection (open watches and in-flight requests included).
    pub async fn stop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }

    /// Listens again on the same port (after [`ServedFakeApi::stop`]); a no-op while running.
    pub async fn restart(&mut self) -> Result<()> {
        if self.task.is_some() {
            return Ok(());
        }
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        let listener = loop {
            match TcpListener::bind(self.addr).await {
                Ok(l) => break l,
                Err(e)
                    if tokio::time::Instant::now() < deadline
                        && e.kind() == std::io::ErrorKind::AddrInUse =>
                {
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                Err(source) => {
                    return Err(Error::Serve {
                        addr: self.addr.to_string(),
                        source,
                    });
                }
            }
        };
        self.task = Some(tokio::spawn(accept_loop(listener, self.server.clone())));
        Ok(())
    }
}

impl Drop for ServedFakeApi {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}
