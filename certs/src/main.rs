//! `teeguard-certs`: write a CA and a webhook serving certificate as `ca.crt`, `tls.crt`,
//! `tls.key`, and print the base64 caBundle.

use std::fmt::Write as _;
use std::io::Write as _;
use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::Parser;
use teeguard_certs::cli::Cli;
use teeguard_certs::{Bundle, CertificateAuthority};

/// Does the work and returns the report for stdout.
fn run(args: &Cli) -> teeguard_certs::Result<String> {
    let req = args.request();
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
    let args = Cli::parse();
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
