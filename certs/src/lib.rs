//! Generate a CA and an ECDSA P-256 serving certificate for a Kubernetes webhook Service,
//! in the `kubernetes.io/tls` Secret layout (`ca.crt`, `tls.crt`, `tls.key`).
//!
//! The serving certificate names `<svc>`, `<svc>.<ns>`, `<svc>.<ns>.svc` and
//! `<svc>.<ns>.svc.cluster.local`, plus any extra DNS names and IP addresses.
//!
//! # CLI
//!
//! ```text
//! teeguard-certs --service teeguard-webhook --namespace teeguard --out-dir ./certs \
//!     [--dns NAME]... [--ip ADDR]... [--validity-days 365] [--force] \
//!     [--ca-cert ca.crt --ca-key ca.key] [--write-ca-key]
//! ```
//!
//! It refuses to overwrite existing files unless `--force` is given, prints the paths it
//! wrote and the base64 `caBundle` for the webhook configuration. `--ca-cert`/`--ca-key`
//! re-issue a serving certificate under an existing CA (PKCS#8 key); `--write-ca-key` also
//! writes `ca.key`. Every flag has a `TEEGUARD_CERTS_*` environment variable.
//!
//! # Library
//!
//! ```no_run
//! use teeguard_certs::{CertificateAuthority, ServingCertRequest, generate_bundle};
//!
//! # fn main() -> Result<(), teeguard_certs::Error> {
//! // New CA + leaf, written as a Secret-shaped directory.
//! let req = ServingCertRequest::for_service("teeguard-webhook", "teeguard").with_dns("localhost");
//! let bundle = generate_bundle(&req)?;
//! let written = bundle.write_to_dir("certs".as_ref(), false)?;
//! println!("{} caBundle={}", written.tls_cert.display(), bundle.ca_bundle_base64());
//!
//! // Rotation: a second leaf from the same CA, loaded back from PEM.
//! let ca = CertificateAuthority::generate("teeguard-webhook-ca", 3650)?;
//! let ca = CertificateAuthority::from_pem(ca.cert_pem(), &ca.key_pem())?;
//! let leaf = ca.issue(&ServingCertRequest::localhost())?; // localhost, 127.0.0.1, ::1
//! let _for_rustls = (ca.cert_der(), leaf.cert_der(), leaf.key_der());
//! # Ok(())
//! # }
//! ```

mod bundle;
mod ca;
pub mod cli;
mod error;
mod names;
mod pem;
mod pkcs8;
mod request;

pub use bundle::{
    Bundle, CA_CERT_FILE, CA_KEY_FILE, TLS_CERT_FILE, TLS_KEY_FILE, WrittenFiles, ca_bundle_base64,
};
pub use ca::{CertificateAuthority, ServingCert};
pub use error::{Error, Result};
pub use names::{validate_dns_name, validate_label};
pub use request::{
    DEFAULT_CA_VALIDITY_DAYS, DEFAULT_LEAF_VALIDITY_DAYS, MAX_VALIDITY_DAYS, ServiceRef,
    ServingCertRequest, SubjectAltName,
};

/// Common name of CAs made by [`generate_bundle`].
pub const DEFAULT_CA_COMMON_NAME: &str = "teeguard-ca";

/// Generates a new CA (named [`DEFAULT_CA_COMMON_NAME`], valid for
/// [`DEFAULT_CA_VALIDITY_DAYS`] or longer if the leaf needs it) and a serving certificate.
pub fn generate_bundle(req: &ServingCertRequest) -> Result<Bundle> {
    req.validate()?;
    let now = std::time::SystemTime::now();
    // A leaf starting in the future must still end before the CA does.
    let future_days = req
        .not_before
        .and_then(|nb| nb.duration_since(now).ok())
        .map_or(0, |d| d.as_secs().div_ceil(86_400));
    let leaf_end_days = u64::from(req.validity_days) + future_days;
    let ca_days = u32::try_from(leaf_end_days)
        .unwrap_or(u32::MAX)
        .max(DEFAULT_CA_VALIDITY_DAYS);
    let ca = CertificateAuthority::generate_at(DEFAULT_CA_COMMON_NAME, ca_days, now)?;
    ca.bundle_at(req, now)
}
