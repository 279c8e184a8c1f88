//! The command line of `teeguard-certs`, public so that the docs test can check every flag against
//! docs/cli.md (as it does for the webhook's and the agent's).

use std::net::IpAddr;
use std::path::PathBuf;

use clap::Parser;

use crate::{
    DEFAULT_CA_COMMON_NAME, DEFAULT_CA_VALIDITY_DAYS, DEFAULT_LEAF_VALIDITY_DAYS, ServiceRef,
    ServingCertRequest,
};

/// Generate a CA and an ECDSA P-256 serving certificate for a Kubernetes Service, written in
/// the kubernetes.io/tls Secret layout (ca.crt, tls.crt, tls.key).
#[derive(Debug, Parser)]
#[command(name = "teeguard-certs", version)]
pub struct Cli {
    /// Service name; the certificate names SERVICE, SERVICE.NAMESPACE, SERVICE.NAMESPACE.svc and
    /// SERVICE.NAMESPACE.svc.cluster.local.
    #[arg(long, env = "TEEGUARD_CERTS_SERVICE", requires = "namespace")]
    pub service: Option<String>,

    /// Namespace of the Service.
    #[arg(long, env = "TEEGUARD_CERTS_NAMESPACE", requires = "service")]
    pub namespace: Option<String>,

    /// Directory to write ca.crt, tls.crt and tls.key into (created if missing).
    #[arg(long, env = "TEEGUARD_CERTS_OUT_DIR")]
    pub out_dir: PathBuf,

    /// Extra DNS name (repeatable; comma-separated in the environment variable).
    #[arg(
        long = "dns",
        value_name = "NAME",
        env = "TEEGUARD_CERTS_DNS",
        value_delimiter = ','
    )]
    pub dns: Vec<String>,

    /// Extra IP address (repeatable; comma-separated in the environment variable).
    #[arg(
        long = "ip",
        value_name = "ADDR",
        env = "TEEGUARD_CERTS_IP",
        value_delimiter = ','
    )]
    pub ip: Vec<IpAddr>,

    /// Validity of the serving certificate in days.
    #[arg(long, env = "TEEGUARD_CERTS_VALIDITY_DAYS", default_value_t = DEFAULT_LEAF_VALIDITY_DAYS)]
    pub validity_days: u32,

    /// Validity of a newly generated CA in days.
    #[arg(
        long,
        env = "TEEGUARD_CERTS_CA_VALIDITY_DAYS",
        default_value_t = DEFAULT_CA_VALIDITY_DAYS,
        conflicts_with = "ca_cert"
    )]
    pub ca_validity_days: u32,

    /// Common name of a newly generated CA.
    #[arg(
        long,
        env = "TEEGUARD_CERTS_CA_COMMON_NAME",
        default_value = DEFAULT_CA_COMMON_NAME,
        conflicts_with = "ca_cert"
    )]
    pub ca_common_name: String,

    /// Existing CA certificate (PEM) to issue under instead of generating a new CA.
    #[arg(
        long,
        value_name = "FILE",
        env = "TEEGUARD_CERTS_CA_CERT",
        requires = "ca_key"
    )]
    pub ca_cert: Option<PathBuf>,

    /// Private key (PKCS#8 PEM) of the --ca-cert CA.
    #[arg(
        long,
        value_name = "FILE",
        env = "TEEGUARD_CERTS_CA_KEY",
        requires = "ca_cert"
    )]
    pub ca_key: Option<PathBuf>,

    /// Also write the CA private key as ca.key (mode 0600); needed to re-issue later.
    #[arg(long, env = "TEEGUARD_CERTS_WRITE_CA_KEY")]
    pub write_ca_key: bool,

    /// Overwrite existing files in the output directory.
    #[arg(long, env = "TEEGUARD_CERTS_FORCE")]
    pub force: bool,
}

impl Cli {
    /// The serving certificate these flags ask for.
    pub fn request(&self) -> ServingCertRequest {
        ServingCertRequest {
            service: self
                .service
                .clone()
                .zip(self.namespace.clone())
                .map(|(name, namespace)| ServiceRef { name, namespace }),
            extra_dns: self.dns.clone(),
            extra_ips: self.ip.clone(),
            validity_days: self.validity_days,
            not_before: None,
        }
    }
}
