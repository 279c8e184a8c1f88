//! `teeguard-certs`: write a CA and a webhook serving certificate as `ca.crt`, `tls.crt`,
//! `tls.key`, and print the base64 caBundle.

use std::fmt::Write as _;
use std::io::Write as _;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::Parser;
use teeguard_certs::{
    Bundle, CertificateAuthority, DEFAULT_CA_COMMON_NAME, DEFAULT_CA_VALIDITY_DAYS,
    DEFAULT_LEAF_VALIDITY_DAYS, ServiceRef, ServingCertRequest,
};

/// Generate a CA and an ECDSA P-256 serving certificate for a Kubernetes Service, written in
/// the kubernetes.io/tls Secret layout (ca.crt, tls.crt, tls.key).
#[derive(Debug, Parser)]
#[command(name = "teeguard-certs", version)]
struct Args {
    /// Service name; the certificate names <svc>, <svc>.<ns>, <svc>.<ns>.svc and
    /// <svc>.<ns>.svc.cluster.local.
    #[arg(long, env = "TEEGUARD_CERTS_SERVICE", requires = "namespace")]
    service: Option<String>,

    /// Namespace of the Service.
    #[arg(long, env = "TEEGUARD_CERTS_NAMESPACE", requires = "service")]
    namespace: Option<String>,

    /// Directory to write ca.crt, tls.crt and tls.key into (created if missing).
    #[arg(long, env = "TEEGUARD_CERTS_OUT_DIR")]
    out_dir: PathBuf,

    /// Extra DNS name (repeatable; comma-separated in the environment variable).
    #[arg(
        long = "dns",
        value_name = "NAME",
        env = "TEEGUARD_CERTS_DNS",
        value_delimiter = ','
    )]
    dns: Vec<String>,

    /// Extra IP address (repeatable; comma-separated in the environment variable).
    #[arg(
        long = "ip",
        value_name = "ADDR",
        env = "TEEGUARD_CERTS_IP",
        value_delimiter = ','
    )]
    ip: Vec<IpAddr>,

    /// Validity of the serving certificate in days.
    #[arg(long, env = "TEEGUARD_CERTS_VALIDITY_DAYS", default_value_t = DEFAULT_LEAF_VALIDITY_DAYS)]
    validity_days: u32,

    /// Validity of a newly generated CA in days.
    #[arg(
        long,
        env = "TEEGUARD_CERTS_CA_VALIDITY_DAYS",
        default_value_t = DEFAULT_CA_VALIDITY_DAYS,
        conflicts_with = "ca_cert"
    )]
    ca_validity_days: u32,

    /// Common name of a newly generated CA.
    #[arg(
        long,
        env = "TEEGUARD_CERTS_CA_COMMON_NAME",
        default_value = DEFAULT_CA_COMMON_NAME,
        conflicts_with = "ca_cert"
    )]
    ca_common_name: String,

    /// Existing CA certificate (PEM) to issue under instead of generating a new CA.
    #[arg(
        long,
        value_name = "FILE",
        env = "TEEGUARD_CERTS_CA_CERT",
        requires = "ca_key"
    )]
    ca_cert: Option<PathBuf>,

    /// Private key (PKCS#8 PEM) of the --ca-cert CA.
    #[arg(
        long,
        value_name = "FILE",
        env = "TEEGUARD_CERTS_CA_KEY",
        requires = "ca_cert"
    )]
    ca_key: Option<PathBuf>,

    /// Also write the CA private key as ca.key (mode 0600); needed to re-issue later.
    #[arg(long, env = "TEEGUARD_CERTS_WRITE_CA_KEY")]
    write_ca_key: bool,

    /// Overwrite existing files in the output directory.
    #[arg(long, env = "TEEGUARD_CERTS_FORCE")]
    force: bool,
}

fn request(args: &Args) -> ServingCertRequest {
    ServingCertRequest {
        service: args
            .service
            .clone()
            .zip(args.namespace.clone())
            .map(|(name, namespace)| ServiceRef { name, namespace }),
        extra_dns: args.dns.clone(),
        extra_ips: args.ip.clone(),
        validity_days: args.validity_days,
        not_before: None,
    }
}

/// Does the work and returns the report for stdout.
fn run(args: &Args) -> teeguard_certs::Result<String> {
    let req = request(args);
    req.validate()?;
    let (ca, ca_source) = match (&args.ca_cert, &args.ca_key) {
        (Some(cert), Some(key)) => (
            CertificateAuthority::from_pem_files(cert, key)?,
            format!("existing CA {}", cert.display()),
        ),
        _ => (
            CertificateAuthority::generate(&args.ca_common_name, args.ca_validity_days)?,
            format!(
                "new CA {:?} valid for {} days",
                args.ca_common_name, args.ca_validity_days
            ),
        ),
    };
    let leaf = ca.issue(&req)?;
    let bundle = Bundle {
        ca_pem: ca.cert_pem().to_owned(),
        cert_pem: leaf.cert_pem().to_owned(),
        key_pem: leaf.key_pem().to_owned(),
    };
    let written = if args.write_ca_key {
        bundle.write_to_dir_with_ca_key(&args.out_dir, &ca.key_pem(), args.force)?
    } else {
        bundle.write_to_dir(&args.out_dir, args.force)?
    };

    let mut report = String::new();
    for path in written.paths() {
        let _ = writeln!(report, "wrote {}", path.display());
    }
    let sans: Vec<String> = leaf.sans().iter().map(ToString::to_string).collect();
    let _ = writeln!(
        report,
        "serving certificate valid until {}{}, issued by {ca_source}",
        utc(leaf.not_after()),
        if leaf.not_after() < ca.not_after() {
            ""
        } else {
            " (the CA's expiry)"
        }
    );
    let _ = writeln!(report, "subject alternative names: {}", sans.join(", "));
    let _ = writeln!(report, "caBundle: {}", bundle.ca_bundle_base64());
    Ok(report)
}

/// `YYYY-MM-DD hh:mm:ss UTC`.
fn utc(t: SystemTime) -> String {
    let secs = t
        .duration_since(UNIX_EPOCH)
        .ok()
        .and_then(|d| i64::try_from(d.as_secs()).ok())
        .unwrap_or(0);
    match time::OffsetDateTime::from_unix_timestamp(secs) {
        Ok(dt) => format!(
            "{} {:02}:{:02}:{:02} UTC",
            dt.date(),
            dt.hour(),
            dt.minute(),
            dt.second()
        ),
        Err(_) => format!("{secs} (Unix time)"),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(report) => match std::io::stdout().lock().write_all(report.as_bytes()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("teeguard-certs: error: files were written but stdout failed: {e}");
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            eprintln!("teeguard-certs: error: {e}");
            ExitCode::FAILURE
        }
    }
}
