//! A certificate authority that issues serving certificates.

use std::fmt;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::string::Ia5String;
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PKCS_ECDSA_P256_SHA256, SanType,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use time::OffsetDateTime;
use x509_parser::certificate::X509Certificate;

use crate::bundle::{Bundle, ca_bundle_base64};
use crate::error::{Error, Result};
use crate::pem::encode_certificate;
use crate::pkcs8;
use crate::request::{ServingCertRequest, SubjectAltName, check_validity_days};

/// Seconds in a day.
const DAY_SECS: i64 = 86_400;
/// How far notBefore is back-dated when the start of validity is "now".
const CLOCK_SKEW_SECS: i64 = 3_600;
/// 9999-12-31T23:59:59Z, the last instant X.509 (GeneralizedTime) can express.
const MAX_UNIX_SECS: i64 = 253_402_300_799;
/// Longest X.520 common name.
const MAX_COMMON_NAME_LEN: usize = 64;
/// Origin label of a CA made by [`CertificateAuthority::generate`].
const GENERATED: &str = "(generated)";
/// Origin label of PEM text given directly.
const PEM_INPUT: &str = "(PEM input)";

/// A validity window as rcgen wants it, plus notAfter as a Unix timestamp.
struct Window {
    not_before: OffsetDateTime,
    not_after: OffsetDateTime,
    not_after_unix: i64,
}

fn unix_secs(t: SystemTime, what: &str) -> Result<i64> {
    let secs = t
        .duration_since(UNIX_EPOCH)
        .map_err(|_| Error::InvalidValidity {
            reason: format!("{what} is before 1970-01-01"),
        })?
        .as_secs();
    i64::try_from(secs)
        .ok()
        .filter(|s| *s <= MAX_UNIX_SECS)
        .ok_or_else(|| Error::InvalidValidity {
            reason: format!("{what} is after the year 9999"),
        })
}

fn datetime(unix: i64) -> Result<OffsetDateTime> {
    OffsetDateTime::from_unix_timestamp(unix).map_err(|e| Error::InvalidValidity {
        reason: format!("timestamp {unix} cannot be represented: {e}"),
    })
}

/// Validity from `start` (or `now`, back-dated for clock skew) lasting `days`.
fn window(start: Option<SystemTime>, now: SystemTime, days: u32) -> Result<Window> {
    check_validity_days(days)?;
    let (start, backdate) = match start {
        Some(start) => (unix_secs(start, "the start of validity")?, 0),
        None => (unix_secs(now, "the current time")?, CLOCK_SKEW_SECS),
    };
    let not_after_unix = start + i64::from(days) * DAY_SECS;
    if not_after_unix > MAX_UNIX_SECS {
        return Err(Error::InvalidValidity {
            reason: format!("{days} days from the start of validity ends after the year 9999"),
        });
    }
    Ok(Window {
        not_before: datetime((start - backdate).max(0))?,
        not_after: datetime(not_after_unix)?,
        not_after_unix,
    })
}

fn system_time(unix: i64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(u64::try_from(unix).unwrap_or(0))
}

/// Facts about a CA certificate that issuing needs.
struct CaFacts {
    subject_raw: Vec<u8>,
    not_after_unix: i64,
    has_subject_key_id: bool,
}

/// Parses and checks a CA certificate, and checks `key` belongs to it.
fn inspect_ca(
    der: &CertificateDer<'_>,
    key: &KeyPair,
    cert_origin: &str,
    key_origin: &str,
    now: SystemTime,
) -> Result<CaFacts> {
    let invalid = |reason: String| Error::InvalidCaCertificate {
        origin: cert_origin.to_owned(),
        reason,
    };
    let (_, x509) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| invalid(format!("cannot parse the certificate: {e}")))?;
    let is_ca = x509
        .basic_constraints()
        .map_err(|e| invalid(format!("cannot parse basicConstraints: {e}")))?
        .is_some_and(|bc| bc.value.ca);
    if !is_ca {
        return Err(invalid(
            "it is not a CA certificate (basicConstraints CA:TRUE is missing); \
             pass the certificate of the issuing CA"
                .to_owned(),
        ));
    }
    let key_usage = x509
        .key_usage()
        .map_err(|e| invalid(format!("cannot parse keyUsage: {e}")))?;
    if key_usage.is_some_and(|ku| !ku.value.key_cert_sign()) {
        return Err(invalid(
            "its keyUsage does not allow keyCertSign, so it cannot sign certificates".to_owned(),
        ));
    }
    let not_after_unix = x509.validity().not_after.timestamp();
    if not_after_unix <= unix_secs(now, "the current time")? {
        return Err(invalid(format!(
            "it expired on {}; generate a new CA",
            x509.validity().not_after
        )));
    }
    if x509.public_key().subject_public_key.data.as_ref() != key.public_key_raw() {
        return Err(Error::CaKeyMismatch {
            cert_origin: cert_origin.to_owned(),
            key_origin: key_origin.to_owned(),
        });
    }
    let has_subject_key_id = x509.iter_extensions().any(|ext| {
        matches!(
            ext.parsed_extension(),
            x509_parser::extensions::ParsedExtension::SubjectKeyIdentifier(_)
        )
    });
    Ok(CaFacts {
        subject_raw: x509.subject().as_raw().to_vec(),
        not_after_unix,
        has_subject_key_id,
    })
}

/// Parses exactly one certificate from PEM text.
fn parse_single_cert(pem: &[u8], origin: &str) -> Result<CertificateDer<'static>> {
    let invalid = |reason: String| Error::InvalidCaCertificate {
        origin: origin.to_owned(),
        reason,
    };
    let mut certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| invalid(format!("cannot read PEM: {e}")))?;
    match certs.len() {
        1 => Ok(certs.remove(0)),
        0 => Err(invalid(
            "no \"BEGIN CERTIFICATE\" block found; pass a PEM certificate file".to_owned(),
        )),
        n => Err(invalid(format!(
            "it contains {n} certificates; pass a file holding only the CA certificate"
        ))),
    }
}

/// Parses a private key from PEM text: PKCS#8, PKCS#1 RSA or SEC1 EC.
fn parse_key(pem: &[u8], origin: &str) -> Result<KeyPair> {
    let invalid = |reason: String| Error::InvalidCaKey {
        origin: origin.to_owned(),
        reason,
    };
    let key = PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        rustls_pki_types::pem::Error::NoItemsFound => invalid(
            "no \"BEGIN PRIVATE KEY\", \"BEGIN RSA PRIVATE KEY\" or \"BEGIN EC PRIVATE KEY\" \
             block found; pass a PEM private key file"
                .to_owned(),
        ),
        e => invalid(format!("cannot read PEM: {e}")),
    })?;
    let candidates: Vec<Vec<u8>> = match &key {
        PrivateKeyDer::Pkcs8(der) => vec![der.secret_pkcs8_der().to_vec()],
        PrivateKeyDer::Pkcs1(der) => vec![pkcs8::from_pkcs1_rsa(der.secret_pkcs1_der())],
        PrivateKeyDer::Sec1(der) => pkcs8::from_sec1_ec(der.secret_sec1_der()).into(),
        _ => return Err(invalid("unsupported private key format".to_owned())),
    };
    let mut last_error = None;
    for der in candidates {
        match KeyPair::try_from(&PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(der))) {
            Ok(key) => return Ok(key),
            Err(e) => last_error = Some(e),
        }
    }
    let detail = last_error.map(|e| format!(" ({e})")).unwrap_or_default();
    Err(invalid(format!(
        "unsupported or corrupt key{detail}; ECDSA P-256/P-384 (with its public key), \
         Ed25519 and RSA keys are supported"
    )))
}

fn to_rcgen_san(san: &SubjectAltName) -> Result<SanType> {
    Ok(match san {
        SubjectAltName::Dns(name) => {
            SanType::DnsName(Ia5String::try_from(name.as_str()).map_err(|e| {
                Error::InvalidDnsName {
                    value: name.clone(),
                    reason: e.to_string(),
                }
            })?)
        }
        SubjectAltName::Ip(ip) => SanType::IpAddress(*ip),
    })
}

/// The leaf's common name: the service host if present, else the first short-enough SAN.
fn leaf_common_name(req: &ServingCertRequest, sans: &[SubjectAltName]) -> Option<String> {
    req.service
        .as_ref()
        .map(|s| s.service_host())
        .into_iter()
        .chain(sans.iter().map(|san| match san {
            SubjectAltName::Dns(name) => name.clone(),
            SubjectAltName::Ip(ip) => ip.to_string(),
        }))
        .find(|name| name.len() <= MAX_COMMON_NAME_LEN)
}

/// A CA (ECDSA P-256 when generated) that issues serving certificates.
pub struct CertificateAuthority {
    issuer: Issuer<'static, KeyPair>,
    cert_der: CertificateDer<'static>,
    cert_pem: String,
    facts: CaFacts,
    origin: String,
}

impl fmt::Debug for CertificateAuthority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertificateAuthority")
            .field("origin", &self.origin)
            .field("not_after", &self.not_after())
            .field("key", &"[elided]")
            .finish_non_exhaustive()
    }
}

impl CertificateAuthority {
    /// Generates a self-signed CA (ECDSA P-256, basicConstraints CA with pathlen 0,
    /// keyCertSign + cRLSign + digitalSignature) valid for `validity_days` (1..=36500).
    pub fn generate(common_name: &str, validity_days: u32) -> Result<Self> {
        Self::generate_at(common_name, validity_days, SystemTime::now())
    }

    pub(crate) fn generate_at(
        common_name: &str,
        validity_days: u32,
        now: SystemTime,
    ) -> Result<Self> {
        let bad_cn = |reason: &str| Error::InvalidCommonName {
            value: common_name.to_owned(),
            reason: reason.to_owned(),
        };
        if common_name.trim().is_empty() {
            return Err(bad_cn("it is empty"));
        }
        if common_name.len() > MAX_COMMON_NAME_LEN {
            return Err(bad_cn("it is longer than 64 bytes"));
        }
        let window = window(None, now, validity_days)?;
        let mut params = CertificateParams::default();
        params.not_before = window.not_before;
        params.not_after = window.not_after;
        params.distinguished_name = DistinguishedName::new();
        params
            .distinguished_name
            .push(DnType::CommonName, common_name);
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)
            .map_err(Error::generate("generate the CA key"))?;
        let cert = params
            .self_signed(&key)
            .map_err(Error::generate("self-sign the CA certificate"))?;
        let cert_der = cert.der().clone();
        let facts = inspect_ca(&cert_der, &key, GENERATED, GENERATED, now)?;
        Ok(CertificateAuthority {
            issuer: Issuer::new(params, key),
            cert_pem: encode_certificate(&cert_der),
            cert_der,
            facts,
            origin: GENERATED.to_owned(),
        })
    }

    /// Loads an existing CA from its certificate and PKCS#8 private key (PEM text).
    ///
    /// The certificate must be a single, unexpired CA certificate allowed to sign
    /// certificates, and the key must belong to it.
    pub fn from_pem(cert_pem: &str, key_pem: &str) -> Result<Self> {
        Self::from_pem_labeled(
            cert_pem.as_bytes(),
            PEM_INPUT,
            key_pem.as_bytes(),
            PEM_INPUT,
            SystemTime::now(),
        )
    }

    /// Like [`CertificateAuthority::from_pem`], reading two files; errors name the files.
    pub fn from_pem_files(cert_path: &Path, key_path: &Path) -> Result<Self> {
        let cert =
            std::fs::read(cert_path).map_err(|e| Error::io("read CA certificate", cert_path, e))?;
        let key =
            std::fs::read(key_path).map_err(|e| Error::io("read CA private key", key_path, e))?;
        Self::from_pem_labeled(
            &cert,
            &cert_path.display().to_string(),
            &key,
            &key_path.display().to_string(),
            SystemTime::now(),
        )
    }

    fn from_pem_labeled(
        cert_pem: &[u8],
        cert_origin: &str,
        key_pem: &[u8],
        key_origin: &str,
        now: SystemTime,
    ) -> Result<Self> {
        let cert_der = parse_single_cert(cert_pem, cert_origin)?;
        let key = parse_key(key_pem, key_origin)?;
        let facts = inspect_ca(&cert_der, &key, cert_origin, key_origin, now)?;
        let issuer =
            Issuer::from_ca_cert_der(&cert_der, key).map_err(|e| Error::InvalidCaCertificate {
                origin: cert_origin.to_owned(),
                reason: format!("cannot reuse its subject name for issuing: {e}"),
            })?;
        Ok(CertificateAuthority {
            issuer,
            cert_pem: encode_certificate(&cert_der),
            cert_der,
            facts,
            origin: cert_origin.to_owned(),
        })
    }

    /// The CA certificate as PEM (goes into `ca.crt` and the webhook's caBundle).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The CA certificate as DER (for a rustls `RootCertStore`).
    pub fn cert_der(&self) -> CertificateDer<'static> {
        self.cert_der.clone()
    }

    /// The CA private key as PKCS#8 PEM. Keep it secret; the Secret layout has no CA key.
    pub fn key_pem(&self) -> String {
        self.issuer.key().serialize_pem()
    }

    /// When the CA certificate expires (second precision).
    pub fn not_after(&self) -> SystemTime {
        system_time(self.facts.not_after_unix)
    }

    /// Base64 of the CA certificate PEM, the `caBundle` value of a webhook configuration.
    pub fn ca_bundle_base64(&self) -> String {
        ca_bundle_base64(&self.cert_pem)
    }

    /// Issues a serving certificate (fresh ECDSA P-256 key, serverAuth EKU,
    /// digitalSignature key usage, basicConstraints CA:FALSE). A notAfter later than the
    /// CA's is cut to the CA's notAfter (see [`ServingCert::not_after`]).
    pub fn issue(&self, req: &ServingCertRequest) -> Result<ServingCert> {
        self.issue_at(req, SystemTime::now())
    }

    pub(crate) fn issue_at(
        &self,
        req: &ServingCertRequest,
        now: SystemTime,
    ) -> Result<ServingCert> {
        let sans = req.subject_alt_names()?;
        let mut window = window(req.not_before, now, req.validity_days)?;
        // Like cert-manager, never let the leaf outlive its CA: cut it to the CA's expiry.
        if window.not_after_unix > self.facts.not_after_unix {
            window.not_after_unix = self.facts.not_after_unix;
            window.not_after = datetime(window.not_after_unix)?;
        }
        if window.not_after <= window.not_before {
            return Err(Error::CaExpiresTooSoon {
                origin: self.origin.clone(),
            });
        }
        let mut params = CertificateParams::default();
        params.not_before = window.not_before;
        params.not_after = window.not_after;
        params.distinguished_name = DistinguishedName::new();
        if let Some(cn) = leaf_common_name(req, &sans) {
            params.distinguished_name.push(DnType::CommonName, cn);
        }
        params.subject_alt_names = sans.iter().map(to_rcgen_san).collect::<Result<_>>()?;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = self.facts.has_subject_key_id;
        let key = KeyPair::generate_for(&PKCS_ECDSA_P256_SHA256)
            .map_err(Error::generate("generate the serving key"))?;
        let cert = params
            .signed_by(&key, &self.issuer)
            .map_err(Error::generate("sign the serving certificate"))?;
        self.check_chains(cert.der())?;
        Ok(ServingCert {
            cert_pem: encode_certificate(cert.der()),
            cert_der: cert.der().clone(),
            key_pem: key.serialize_pem(),
            key_der: key.serialize_der(),
            sans,
            not_after: system_time(window.not_after_unix),
        })
    }

    /// Checks the issuer name of `leaf` is byte-identical to the CA subject, which
    /// verifiers require; rcgen re-encodes the name, which fails for unusual subjects.
    fn check_chains(&self, leaf: &CertificateDer<'_>) -> Result<()> {
        let chains = x509_parser::parse_x509_certificate(leaf)
            .map(|(_, x509): (_, X509Certificate<'_>)| {
                x509.issuer().as_raw() == self.facts.subject_raw.as_slice()
            })
            .unwrap_or(false);
        if chains {
            Ok(())
        } else {
            Err(Error::InvalidCaCertificate {
                origin: self.origin.clone(),
                reason: "its subject name cannot be reproduced exactly (for example it repeats \
                         an attribute or has multi-valued parts), so issued certificates would \
                         not chain to it; use a CA with a simple subject such as CN=<name>"
                    .to_owned(),
            })
        }
    }

    /// Issues a serving certificate and pairs it with this CA's certificate.
    pub fn bundle(&self, req: &ServingCertRequest) -> Result<Bundle> {
        self.bundle_at(req, SystemTime::now())
    }

    pub(crate) fn bundle_at(&self, req: &ServingCertRequest, now: SystemTime) -> Result<Bundle> {
        let leaf = self.issue_at(req, now)?;
        Ok(Bundle {
            ca_pem: self.cert_pem.clone(),
            cert_pem: leaf.cert_pem,
            key_pem: leaf.key_pem,
        })
    }
}

/// A serving certificate and its private key.
#[derive(Clone)]
pub struct ServingCert {
    cert_pem: String,
    cert_der: CertificateDer<'static>,
    key_pem: String,
    key_der: Vec<u8>,
    sans: Vec<SubjectAltName>,
    not_after: SystemTime,
}

impl fmt::Debug for ServingCert {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServingCert")
            .field("sans", &self.sans)
            .field("not_after", &self.not_after)
            .field("key", &"[elided]")
            .finish_non_exhaustive()
    }
}

impl ServingCert {
    /// The certificate as PEM (`tls.crt`).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The private key as PKCS#8 PEM (`tls.key`).
    pub fn key_pem(&self) -> &str {
        &self.key_pem
    }

    /// The certificate as DER.
    pub fn cert_der(&self) -> CertificateDer<'static> {
        self.cert_der.clone()
    }

    /// The private key as DER, ready for rustls.
    pub fn key_der(&self) -> PrivateKeyDer<'static> {
        PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.key_der.clone()))
    }

    /// The subject alternative names, in certificate order.
    pub fn sans(&self) -> &[SubjectAltName] {
        &self.sans
    }

    /// When the certificate expires (second precision).
    pub fn not_after(&self) -> SystemTime {
        self.not_after
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: u64 = 1_750_000_000; // mid-2025

    fn at(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn window_backdates_only_when_starting_now() {
        let w = window(None, at(T0), 2).expect("window");
        assert_eq!(w.not_before.unix_timestamp(), T0 as i64 - CLOCK_SKEW_SECS);
        assert_eq!(w.not_after_unix, T0 as i64 + 2 * DAY_SECS);
        let w = window(Some(at(T0 - 10 * 86_400)), at(T0), 1).expect("window");
        assert_eq!(w.not_before.unix_timestamp(), T0 as i64 - 10 * DAY_SECS);
        assert_eq!(w.not_after_unix, T0 as i64 - 9 * DAY_SECS);
    }

    #[test]
    fn window_rejects_out_of_range() {
        assert!(matches!(
            window(None, at(T0), 0),
            Err(Error::InvalidValidity { .. })
        ));
        let before_epoch = UNIX_EPOCH - Duration::from_secs(1);
        assert!(matches!(
            window(Some(before_epoch), at(T0), 1),
            Err(Error::InvalidValidity { .. })
        ));
        assert!(matches!(
            window(Some(at(MAX_UNIX_SECS as u64 - 10)), at(T0), 1),
            Err(Error::InvalidValidity { .. })
        ));
    }

    #[test]
    fn leaf_is_cut_to_ca_expiry() {
        let ca = CertificateAuthority::generate_at("short ca", 10, at(T0)).expect("ca");
        let localhost = |days| ServingCertRequest::localhost().with_validity_days(days);
        let leaf = ca.issue_at(&localhost(9), at(T0)).expect("shorter");
        assert_eq!(leaf.not_after(), at(T0 + 9 * 86_400));
        for (days, issued) in [(10, T0), (11, T0), (365, T0), (10, T0 + 120)] {
            let leaf = ca.issue_at(&localhost(days), at(issued)).expect("cut");
            assert_eq!(leaf.not_after(), ca.not_after(), "{days} days at {issued}");
        }
        let err = ca
            .issue_at(&localhost(5).with_not_before(at(T0 + 11 * 86_400)), at(T0))
            .expect_err("starts after the CA expires");
        assert!(matches!(err, Error::CaExpiresTooSoon { .. }), "{err}");
    }

    #[test]
    fn ca_common_name_is_checked() {
        for bad in ["", "  ", &"x".repeat(65)] {
            let err = CertificateAuthority::generate(bad, 1).expect_err("bad cn");
            assert!(matches!(err, Error::InvalidCommonName { .. }), "{err}");
        }
    }

    #[test]
    fn leaf_common_name_prefers_service_host() {
        let req = ServingCertRequest::for_service("svc", "ns").with_dns("a.example");
        let sans = req.subject_alt_names().expect("sans");
        assert_eq!(leaf_common_name(&req, &sans).as_deref(), Some("svc.ns.svc"));
        let req = ServingCertRequest::default()
            .with_dns(format!("{}.example", "a".repeat(60)))
            .with_ip("10.0.0.1".parse().expect("ip"));
        let sans = req.subject_alt_names().expect("sans");
        assert_eq!(leaf_common_name(&req, &sans).as_deref(), Some("10.0.0.1"));
    }

    #[test]
    fn from_pem_rejects_bad_inputs_clearly() {
        let ca = CertificateAuthority::generate("ca", 30).expect("ca");
        let other = CertificateAuthority::generate("other", 30).expect("ca");
        let leaf = ca.issue(&ServingCertRequest::localhost()).expect("leaf");

        let err =
            CertificateAuthority::from_pem(ca.cert_pem(), &other.key_pem()).expect_err("mismatch");
        assert!(matches!(err, Error::CaKeyMismatch { .. }), "{err}");

        let err = CertificateAuthority::from_pem(leaf.cert_pem(), leaf.key_pem())
            .expect_err("leaf is not a CA");
        assert!(err.to_string().contains("not a CA certificate"), "{err}");

        let two = format!("{}{}", ca.cert_pem(), other.cert_pem());
        let err = CertificateAuthority::from_pem(&two, &ca.key_pem()).expect_err("two certs");
        assert!(err.to_string().contains("contains 2 certificates"), "{err}");

        let err = CertificateAuthority::from_pem("garbage", &ca.key_pem()).expect_err("no pem");
        assert!(err.to_string().contains("BEGIN CERTIFICATE"), "{err}");

        let err = CertificateAuthority::from_pem(ca.cert_pem(), "nope").expect_err("no key");
        assert!(matches!(err, Error::InvalidCaKey { .. }), "{err}");

        let sec1 = "-----BEGIN EC PRIVATE KEY-----\nAAAA\n-----END EC PRIVATE KEY-----\n";
        let err = CertificateAuthority::from_pem(ca.cert_pem(), sec1).expect_err("corrupt");
        assert!(
            err.to_string().contains("unsupported or corrupt key"),
            "{err}"
        );
    }

    #[test]
    fn from_pem_rejects_expired_ca() {
        let ca = CertificateAuthority::generate_at("old", 1, at(T0)).expect("ca");
        let err = CertificateAuthority::from_pem_labeled(
            ca.cert_pem().as_bytes(),
            "old.crt",
            ca.key_pem().as_bytes(),
            "old.key",
            at(T0 + 2 * 86_400),
        )
        .expect_err("expired");
        let msg = err.to_string();
        assert!(msg.starts_with("CA certificate old.crt"), "{msg}");
        assert!(msg.contains("expired"), "{msg}");
    }

    #[test]
    fn loaded_ca_keeps_identity() {
        let ca = CertificateAuthority::generate("round trip", 30).expect("ca");
        let loaded = CertificateAuthority::from_pem(ca.cert_pem(), &ca.key_pem()).expect("load");
        assert_eq!(loaded.cert_pem(), ca.cert_pem());
        assert_eq!(loaded.cert_der(), ca.cert_der());
        assert_eq!(loaded.key_pem(), ca.key_pem());
        assert_eq!(loaded.not_after(), ca.not_after());
        assert!(loaded.facts.has_subject_key_id);
    }

    #[test]
    fn debug_output_hides_keys() {
        let ca = CertificateAuthority::generate("dbg", 1).expect("ca");
        let leaf = ca.issue(&ServingCertRequest::localhost()).expect("leaf");
        for dbg in [format!("{ca:?}"), format!("{leaf:?}")] {
            assert!(!dbg.contains("PRIVATE"), "{dbg}");
            assert!(dbg.contains("[elided]"), "{dbg}");
        }
    }
}
