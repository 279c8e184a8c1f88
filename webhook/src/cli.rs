//! Command line: `teeguard-webhook serve` (the HTTPS webhook) and `teeguard-webhook review` (decide
//! one AdmissionReview offline). Every `serve` flag has a `TEEGUARD_*` environment variable.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use teeguard_shared::ops::LogFormat;

pub use crate::web::state::DEFAULT_MAX_BODY_BYTES;

/// teeguard admission webhook.
#[derive(Debug, Parser)]
#[command(name = "teeguard-webhook", version, about)]
pub struct Cli {
    /// Log format (logs go to stderr; the filter comes from RUST_LOG, default info).
    #[arg(long, global = true, env = "TEEGUARD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the admission webhook over HTTPS, with /livez, /readyz and /metrics on a plain-HTTP port.
    Serve(ServeArgs),
    /// Decide one AdmissionReview (or bare Pod) offline, exactly as the server would, and print the
    /// response, the decoded patch and the patched object.
    Review(ReviewArgs),
}

fn duration(s: &str) -> std::result::Result<Duration, String> {
    teeguard_shared::config::parse_duration(s)
}

/// A duration that may be zero (`0`, `0s`, `0ms`): off.
fn duration_or_zero(s: &str) -> std::result::Result<Duration, String> {
    if matches!(s.trim(), "0" | "0s" | "0ms") {
        return Ok(Duration::ZERO);
    }
    duration(s)
}

/// `serve` flags.
#[derive(Clone, Debug, Args)]
pub struct ServeArgs {
    /// HTTPS listen address.
    #[arg(long, env = "TEEGUARD_LISTEN_ADDR", default_value = "0.0.0.0:8443")]
    pub listen: SocketAddr,
    /// Where the other replicas reach this one while it decides
    /// (`https://host:port`); by default `https://$POD_IP:<the listen port>`.
    #[arg(long, env = "TEEGUARD_DECIDER_ADDRESS")]
    pub decider_address: Option<String>,
    /// The name of the decider Lease (in the namespace of the
    /// webhook's kube client): one per set of replicas that decide together.
    #[arg(long, env = "TEEGUARD_DECIDER_LEASE_NAME", default_value = crate::cluster::lead::LEASE_NAME)]
    pub decider_lease_name: String,
    /// Plain-HTTP address for /livez, /readyz and /metrics.
    #[arg(long, env = "TEEGUARD_ADMIN_ADDR", default_value = "0.0.0.0:8080")]
    pub admin_listen: SocketAddr,
    /// Directory holding tls.crt and tls.key (a mounted kubernetes.io/tls Secret); watched for rotation.
    #[arg(long, env = "TEEGUARD_CERT_DIR", default_value = "/etc/teeguard/tls")]
    pub cert_dir: PathBuf,
    /// The teeguard configuration file (YAML); defaults apply when absent.
    #[arg(long, env = "TEEGUARD_CONFIG")]
    pub config: Option<PathBuf>,
    /// How often the certificate directory is re-checked in case a change notification was missed.
    #[arg(long, env = "TEEGUARD_CERT_CHECK_INTERVAL", default_value = "30s", value_parser = duration)]
    pub cert_check_interval: Duration,
    /// Largest request body accepted, in bytes; larger requests get 413.
    #[arg(long, env = "TEEGUARD_MAX_BODY_BYTES", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Time allowed for a TLS handshake.
    #[arg(long, env = "TEEGUARD_TLS_HANDSHAKE_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub handshake_timeout: Duration,
    /// Time allowed to receive request headers (HTTP/1.1). hyper starts this timer when a keep-alive
    /// connection goes idle, so it also closes idle connections after this long.
    #[arg(long, env = "TEEGUARD_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub header_read_timeout: Duration,
    /// Time a response write may make no progress (the client reads nothing) before the connection is
    /// closed, so clients that stop reading cannot hold connection slots.
    #[arg(long, env = "TEEGUARD_WRITE_STALL_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub write_stall_timeout: Duration,
    /// Time allowed to read a request and answer it.
    #[arg(long, env = "TEEGUARD_REQUEST_TIMEOUT", default_value = "30s", value_parser = duration)]
    pub request_timeout: Duration,
    /// After SIGTERM, how long to go on accepting and serving while /readyz reports not ready (endpoint
    /// removal takes a few seconds to reach every kube-proxy); HTTP/1.1 answers carry `Connection:
    /// close` meanwhile, so clients move to other replicas. Then the listener closes and the drain
    /// starts. The Helm chart sets it (10s); 0 stops accepting at once.
    #[arg(long, env = "TEEGUARD_SHUTDOWN_GRACE", default_value = "0s", value_parser = duration_or_zero)]
    pub shutdown_grace: Duration,
    /// Time allowed for in-flight requests once the listener has closed (after the shutdown grace)
    /// before the remaining connections are closed.
    #[arg(long, env = "TEEGUARD_DRAIN_TIMEOUT", default_value = "25s", value_parser = duration)]
    pub drain_timeout: Duration,
    /// Concurrent connections served; further clients wait in the listen backlog.
    #[arg(long, env = "TEEGUARD_MAX_CONNECTIONS", default_value_t = 1024)]
    pub max_connections: usize,
    /// Timeout of the GET made when an object is not cached yet.
    #[arg(long, env = "TEEGUARD_API_TIMEOUT", default_value = "2s", value_parser = duration)]
    pub api_timeout: Duration,
}

/// Output format of `review`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, ValueEnum)]
pub enum OutputFormat {
    /// YAML.
    #[default]
    Yaml,
    /// JSON.
    Json,
}

/// `review` flags.
#[derive(Clone, Debug, Args)]
pub struct ReviewArgs {
    /// AdmissionReview or bare Pod, JSON or YAML (`-` reads stdin). A bare Pod is reviewed as a
    /// CREATE in its namespace (default `default`).
    pub input: PathBuf,
    /// VirtualMachineInstance manifest(s): JSON, YAML (multi-document) or a List. Repeatable.
    #[arg(long = "vmi", value_name = "FILE")]
    pub vmis: Vec<PathBuf>,
    /// Namespace manifest(s), for the teeguard.dev/exempt namespace label. Repeatable.
    #[arg(long = "namespace-file", value_name = "FILE")]
    pub namespaces: Vec<PathBuf>,
    /// TeeCapacity manifest(s): node reports for the validating review. Repeatable. With any of
    /// --tee-capacity, --node or --pod the validating response is printed too.
    #[arg(long = "tee-capacity", value_name = "FILE")]
    pub tee_capacities: Vec<PathBuf>,
    /// Node manifest(s), for node selection (labels) in the validating review of a pod without
    /// spec.nodeName. Without any, every node with a TeeCapacity report is a candidate. Repeatable.
    #[arg(long = "node", value_name = "FILE")]
    pub nodes: Vec<PathBuf>,
    /// Pod manifest(s): the pods a pods/binding review refers to. Repeatable.
    #[arg(long = "pod", value_name = "FILE")]
    pub pods: Vec<PathBuf>,
    /// The teeguard configuration file (YAML); defaults apply when absent.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutputFormat::Yaml)]
    pub output: OutputFormat,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serve_defaults() {
        let cli = Cli::try_parse_from(["teeguard-webhook", "serve"]).expect("parse");
        let Command::Serve(a) = cli.command else {
            panic!("serve expected");
        };
        assert_eq!(a.listen, "0.0.0.0:8443".parse().expect("addr"));
        assert_eq!(a.admin_listen, "0.0.0.0:8080".parse().expect("addr"));
        assert_eq!(a.cert_dir, PathBuf::from("/etc/teeguard/tls"));
        assert_eq!(a.config, None);
        assert_eq!(a.max_body_bytes, 7 * 1024 * 1024);
        assert_eq!(a.cert_check_interval, Duration::from_secs(30));
        assert_eq!(a.shutdown_grace, Duration::ZERO);
        assert_eq!(a.drain_timeout, Duration::from_secs(25));
        assert_eq!(cli.log_format, LogFormat::Text);
    }

    #[test]
    fn review_flags_repeat() {
        let cli = Cli::try_parse_from([
            "teeguard-webhook",
            "review",
            "pod.yaml",
            "--vmi",
            "a.yaml",
            "--vmi",
            "b.yaml",
            "-o",
            "json",
            "--log-format",
            "json",
        ])
        .expect("parse");
        let Command::Review(a) = cli.command else {
            panic!("review expected");
        };
        assert_eq!(a.vmis.len(), 2);
        assert_eq!(a.output, OutputFormat::Json);
        assert_eq!(cli.log_format, LogFormat::Json);
        assert!(
            Cli::try_parse_from(["teeguard-webhook", "serve", "--drain-timeout", "soon"]).is_err()
        );
        let grace = |v: &str| match Cli::try_parse_from([
            "teeguard-webhook",
            "serve",
            "--shutdown-grace",
            v,
        ])
        .map(|c| c.command)
        {
            Ok(Command::Serve(a)) => Ok(a.shutdown_grace),
            Ok(Command::Review(_)) => panic!("serve expected"),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(grace("0"), Ok(Duration::ZERO));
        assert_eq!(grace("0s"), Ok(Duration::ZERO));
        assert_eq!(grace("1500ms"), Ok(Duration::from_millis(1500)));
        assert!(grace("-1s").is_err());
    }
}
