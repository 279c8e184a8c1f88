//! Command line: `teeguard-agent run` (the DaemonSet), `teeguard-agent scan` (one scan, printed: run by
//! [`crate::scan`]) and `teeguard-agent cleanup`.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{Args, Parser, Subcommand, ValueEnum};
use prometheus_client::registry::Registry;
use teeguard_shared::Config;
use teeguard_shared::ops::{self, LogFormat, Readiness};
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::metrics::Metrics;
use crate::run::{AgentOptions, READY_PODS, READY_SCAN, run};

/// teeguard node agent: reads TEE key capacity and usage from the kernel's misc cgroup, attributes it
/// to pods, publishes the node's TeeCapacity and advertises the keys pods can really get.
#[derive(Debug, Parser)]
#[command(name = "teeguard-agent", version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the agent (DaemonSet): scan, publish the TeeCapacity, advertise extended resources.
    Run(RunArgs),
    /// Scan the host once and print the result, without a cluster.
    Scan(ScanArgs),
    /// After uninstalling, remove from one Node what the agent added (its extended resources and
    /// their annotation) and the node's TeeCapacity; nothing else.
    Cleanup(CleanupArgs),
}

/// Flags both subcommands take.
#[derive(Debug, Args)]
pub struct CommonArgs {
    /// Where the host's /sys/fs/cgroup is mounted.
    #[arg(long, env = "TEEGUARD_CGROUP_ROOT", default_value = "/sys/fs/cgroup")]
    pub cgroup_root: PathBuf,
    /// The teeguard configuration file (YAML); defaults apply without one.
    #[arg(long, env = "TEEGUARD_CONFIG")]
    pub config: Option<PathBuf>,
    /// Log format (logs go to stderr).
    #[arg(long, env = "TEEGUARD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// `teeguard-agent run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Shared flags.
    #[command(flatten)]
    pub common: CommonArgs,
    /// This node's name (from spec.nodeName via the downward API).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// Address of the plain-HTTP admin port (/livez, /readyz, /metrics).
    #[arg(long, env = "TEEGUARD_ADMIN_ADDR", default_value = "0.0.0.0:8081")]
    pub admin_addr: SocketAddr,
    /// The kubelet's root directory, as the kubelet sees it (DRA mode: the driver's sockets go in its
    /// `plugins_registry/` and `plugins/tee.teeguard.dev/`, with the checkpoint of prepared claims;
    /// switched back, the agent drains the claims that checkpoint still holds).
    #[arg(long, env = "TEEGUARD_KUBELET_DIR", default_value = crate::run::DEFAULT_KUBELET_DIR)]
    pub kubelet_dir: PathBuf,
}

/// Output format of `scan`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Human-readable tables.
    Table,
    /// JSON.
    Json,
    /// YAML.
    Yaml,
}

/// `teeguard-agent cleanup`.
#[derive(Debug, Args)]
pub struct CleanupArgs {
    /// The Node to clean up.
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// The teeguard configuration file (resource names); defaults apply when absent.
    #[arg(long, env = "TEEGUARD_CONFIG")]
    pub config: Option<PathBuf>,
    /// The namespace of the agents' heartbeat Leases (teeguard's release namespace); default: the
    /// kubeconfig's (in a pod: its own).
    #[arg(long, env = "TEEGUARD_NAMESPACE")]
    pub namespace: Option<String>,
}

/// `teeguard-agent cleanup`: see [`crate::cluster::cleanup`]. Prints what it changed.
pub async fn cleanup_command(args: &CleanupArgs, out: &mut dyn Write) -> Result<()> {
    let config = load_config(args.config.as_deref())?;
    let build = "build the Kubernetes client (in-cluster or kubeconfig)";
    let mut kube_config = kube::Config::infer()
        .await
        .map_err(|e| Error::kube(build, kube::Error::InferConfig(e)))?;
    if let Some(namespace) = &args.namespace {
        kube_config.default_namespace = namespace.clone();
    }
    let client = kube::Client::try_from(kube_config).map_err(|e| Error::kube(build, e))?;
    let cleaned =
        crate::cluster::cleanup::cleanup(client, &args.node_name, &config.resources).await?;
    writeln!(out, "node {}: {cleaned}", args.node_name).map_err(|e| Error::Render {
        what: "the cleanup summary",
        reason: e.to_string(),
    })
}

/// `teeguard-agent scan`.
#[derive(Debug, Args)]
pub struct ScanArgs {
    /// Shared flags.
    #[command(flatten)]
    pub common: CommonArgs,
    /// Pods to attribute usage to: a PodList, a list of pods, or pods as YAML documents (YAML or JSON).
    #[arg(long)]
    pub pods: Option<PathBuf>,
    /// Only use pods bound to this node (`spec.nodeName`).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: Option<String>,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutputFormat::Table)]
    pub output: OutputFormat,
}

/// The configuration file at `path`, or the defaults without one.
pub(crate) fn load_config(path: Option<&Path>) -> Result<Config> {
    match path {
        Some(p) => Ok(Config::load(p)?),
        None => Ok(Config::default()),
    }
}

/// `teeguard-agent run`: serve the admin port and run the agent until SIGTERM.
pub async fn run_command(args: RunArgs) -> Result<()> {
    ops::init_tracing(args.common.log_format);
    let config = load_config(args.common.config.as_deref())?;
    let client = kube::Client::try_default()
        .await
        .map_err(|e| Error::kube("build the Kubernetes client (in-cluster or kubeconfig)", e))?;
    let mut registry = Registry::default();
    let metrics = Metrics::new(&mut registry);
    let readiness = Readiness::new(&[READY_SCAN, READY_PODS]);
    let shutdown = CancellationToken::new();
    let listener = ops::bind_admin(args.admin_addr).await?;
    if let Ok(addr) = listener.local_addr() {
        tracing::info!(admin = %addr, "admin server listening (/livez, /readyz, /metrics)");
    }
    let admin = tokio::spawn(ops::serve_admin(
        listener,
        ops::admin_router(readiness.clone(), Arc::new(registry)),
        shutdown.clone(),
    ));
    tokio::spawn(ops::cancel_on_signal(shutdown.clone()));
    let mut opts = AgentOptions::new(args.node_name, args.common.cgroup_root, config);
    opts.kubelet_dir = args.kubelet_dir;
    let result = run(client, opts, metrics, readiness, shutdown.clone()).await;
    shutdown.cancel();
    match admin.await {
        Ok(Err(e)) => tracing::warn!(error = %e, "admin server"),
        Err(e) => tracing::warn!(error = %e, "admin server task"),
        Ok(Ok(())) => {}
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_parses() {
        let cli = Cli::try_parse_from([
            "teeguard-agent",
            "run",
            "--node-name",
            "n1",
            "--cgroup-root",
            "/host/sys/fs/cgroup",
            "--admin-addr",
            "127.0.0.1:9000",
            "--log-format",
            "json",
        ])
        .expect("parse");
        match cli.command {
            Command::Run(a) => {
                assert_eq!(a.node_name, "n1");
                assert_eq!(a.common.cgroup_root, PathBuf::from("/host/sys/fs/cgroup"));
                assert_eq!(a.common.log_format, LogFormat::Json);
            }
            other => panic!("{other:?}"),
        }
        let cli = Cli::try_parse_from(["teeguard-agent", "scan", "-o", "json"]).expect("parse");
        match cli.command {
            Command::Scan(a) => {
                assert_eq!(a.output, OutputFormat::Json);
                assert_eq!(a.common.cgroup_root, PathBuf::from("/sys/fs/cgroup"));
            }
            other => panic!("{other:?}"),
        }
    }
}
