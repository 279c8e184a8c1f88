//! The crate's single error type.

use std::io;
use std::path::PathBuf;

/// Result alias for this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong while generating, loading or writing certificates.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A service or namespace name is not a DNS-1123 label.
    #[error(
        "invalid {field} {value:?}: {reason}; a {field} must be a DNS-1123 label \
         (lowercase letters, digits and '-', starting and ending with a letter or digit, \
         at most 63 characters)"
    )]
    InvalidLabel {
        /// Which input was wrong (`service` or `namespace`).
        field: &'static str,
        /// The rejected value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },

    /// An extra DNS name is not a valid DNS-1123 subdomain (optionally with a leading `*.`).
    #[error(
        "invalid DNS name {value:?}: {reason}; extra DNS names must be DNS-1123 subdomains \
         such as \"webhook.example.com\" (lowercase, at most 253 characters, optional leading \"*.\")"
    )]
    InvalidDnsName {
        /// The rejected value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },

    /// An extra DNS name is really an IP address.
    #[error("DNS name {value:?} is an IP address; pass it as an IP name (--ip) instead")]
    DnsNameIsIpAddress {
        /// The rejected value.
        value: String,
    },

    /// The request has no service and no extra names, so the certificate would name nothing.
    #[error(
        "the certificate request names nothing: give a service and namespace, \
         or at least one extra DNS name (--dns) or IP address (--ip)"
    )]
    NoSubjectNames,

    /// The CA common name is empty or too long.
    #[error("invalid CA common name {value:?}: {reason}")]
    InvalidCommonName {
        /// The rejected value.
        value: String,
        /// What is wrong with it.
        reason: String,
    },

    /// The requested validity period cannot be used.
    #[error("invalid validity period: {reason}")]
    InvalidValidity {
        /// What is wrong with it.
        reason: String,
    },

    /// The CA expires before the requested serving certificate would become valid.
    #[error(
        "CA certificate {origin} expires before the serving certificate would become valid; \
         use a CA that is valid for longer or an earlier start of validity"
    )]
    CaExpiresTooSoon {
        /// Where the CA came from (a file path, "(generated)" or "(PEM input)").
        origin: String,
    },

    /// The CA certificate could not be used.
    #[error("CA certificate {origin}: {reason}")]
    InvalidCaCertificate {
        /// Where the certificate came from (a file path, or "PEM input").
        origin: String,
        /// What is wrong with it.
        reason: String,
    },

    /// The CA private key could not be used.
    #[error("CA private key {origin}: {reason}")]
    InvalidCaKey {
        /// Where the key came from (a file path, or "PEM input").
        origin: String,
        /// What is wrong with it.
        reason: String,
    },

    /// The CA private key does not belong to the CA certificate.
    #[error(
        "CA private key {key_origin} does not match the public key of CA certificate \
         {cert_origin}; pass the key that belongs to that certificate"
    )]
    CaKeyMismatch {
        /// Where the certificate came from.
        cert_origin: String,
        /// Where the key came from.
        key_origin: String,
    },

    /// rcgen failed to build or sign a certificate or key.
    #[error("could not {what}: {source}")]
    Generate {
        /// What was being done.
        what: &'static str,
        /// The underlying rcgen error.
        #[source]
        source: rcgen::Error,
    },

    /// An output file exists and overwriting was not requested.
    #[error("refusing to overwrite existing file {}; pass --force to replace it", path.display())]
    FileExists {
        /// The file that already exists.
        path: PathBuf,
    },

    /// A filesystem operation failed.
    #[error("could not {action} {}: {source}", path.display())]
    Io {
        /// What was being done (e.g. "create directory").
        action: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: io::Error,
    },
}

impl Error {
    pub(crate) fn io(action: &'static str, path: impl Into<PathBuf>, source: io::Error) -> Self {
        Error::Io {
            action,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn generate(what: &'static str) -> impl FnOnce(rcgen::Error) -> Self {
        move |source| Error::Generate { what, source }
    }
}
