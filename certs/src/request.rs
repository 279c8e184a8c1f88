//! What a serving certificate should be valid for.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::SystemTime;

use crate::error::{Error, Result};
use crate::names::{validate_dns_name, validate_label};

/// Default leaf validity in days.
pub const DEFAULT_LEAF_VALIDITY_DAYS: u32 = 365;
/// Default CA validity in days.
pub const DEFAULT_CA_VALIDITY_DAYS: u32 = 3650;
/// Longest accepted validity in days (100 years).
pub const MAX_VALIDITY_DAYS: u32 = 36_500;

/// A Kubernetes Service the certificate is issued for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ServiceRef {
    /// Service name (DNS-1123 label).
    pub name: String,
    /// Namespace (DNS-1123 label).
    pub namespace: String,
}

impl ServiceRef {
    /// The four in-cluster names: `<svc>`, `<svc>.<ns>`, `<svc>.<ns>.svc`,
    /// `<svc>.<ns>.svc.cluster.local`. Does not validate.
    pub fn dns_names(&self) -> [String; 4] {
        let ServiceRef { name, namespace } = self;
        [
            name.clone(),
            format!("{name}.{namespace}"),
            format!("{name}.{namespace}.svc"),
            format!("{name}.{namespace}.svc.cluster.local"),
        ]
    }

    /// `<svc>.<ns>.svc`, the name the API server uses to call a webhook Service.
    pub fn service_host(&self) -> String {
        format!("{}.{}.svc", self.name, self.namespace)
    }
}

/// One subject alternative name of a certificate.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SubjectAltName {
    /// A DNS name.
    Dns(String),
    /// An IP address.
    Ip(IpAddr),
}

impl fmt::Display for SubjectAltName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SubjectAltName::Dns(name) => write!(f, "DNS:{name}"),
            SubjectAltName::Ip(ip) => write!(f, "IP:{ip}"),
        }
    }
}

/// Parameters of a serving (leaf) certificate.
///
/// Build with [`ServingCertRequest::for_service`], [`ServingCertRequest::localhost`] or
/// [`Default`] (no names) plus the `with_*` methods; the fields are public too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServingCertRequest {
    /// The Service whose four in-cluster names go first in the SAN list; `None` issues a
    /// certificate for the extra names only.
    pub service: Option<ServiceRef>,
    /// Extra DNS names (DNS-1123 subdomains, optional leading `*.`).
    pub extra_dns: Vec<String>,
    /// Extra IP addresses.
    pub extra_ips: Vec<IpAddr>,
    /// Validity in days, counted from `not_before` (1..=36500).
    pub validity_days: u32,
    /// Start of validity; `None` means now, with the notBefore field back-dated one hour
    /// to tolerate clock skew. Set it in the past to make expired certificates for tests.
    pub not_before: Option<SystemTime>,
}

impl Default for ServingCertRequest {
    fn default() -> Self {
        ServingCertRequest {
            service: None,
            extra_dns: Vec::new(),
            extra_ips: Vec::new(),
            validity_days: DEFAULT_LEAF_VALIDITY_DAYS,
            not_before: None,
        }
    }
}

impl ServingCertRequest {
    /// A request for Service `service` in `namespace`, valid for 365 days.
    pub fn for_service(service: impl Into<String>, namespace: impl Into<String>) -> Self {
        ServingCertRequest {
            service: Some(ServiceRef {
                name: service.into(),
                namespace: namespace.into(),
            }),
            ..Default::default()
        }
    }

    /// A request for `localhost`, `127.0.0.1` and `::1` only (loopback tests).
    pub fn localhost() -> Self {
        ServingCertRequest::default()
            .with_dns("localhost")
            .with_ip(IpAddr::V4(Ipv4Addr::LOCALHOST))
            .with_ip(IpAddr::V6(Ipv6Addr::LOCALHOST))
    }

    /// Adds an extra DNS name.
    pub fn with_dns(mut self, name: impl Into<String>) -> Self {
        self.extra_dns.push(name.into());
        self
    }

    /// Adds an extra IP address.
    pub fn with_ip(mut self, ip: IpAddr) -> Self {
        self.extra_ips.push(ip);
        self
    }

    /// Sets the validity in days.
    pub fn with_validity_days(mut self, days: u32) -> Self {
        self.validity_days = days;
        self
    }

    /// Sets the start of validity.
    pub fn with_not_before(mut self, not_before: SystemTime) -> Self {
        self.not_before = Some(not_before);
        self
    }

    /// Validates every name and returns the SAN list in order (service names first, then
    /// extra DNS names, then IPs), without duplicates.
    pub fn subject_alt_names(&self) -> Result<Vec<SubjectAltName>> {
        let mut sans: Vec<SubjectAltName> = Vec::new();
        let mut push = |san: SubjectAltName| {
            if !sans.contains(&san) {
                sans.push(san);
            }
        };
        if let Some(service) = &self.service {
            validate_label("service", &service.name)?;
            validate_label("namespace", &service.namespace)?;
            for name in service.dns_names() {
                push(SubjectAltName::Dns(name));
            }
        }
        for name in &self.extra_dns {
            validate_dns_name(name)?;
            push(SubjectAltName::Dns(name.clone()));
        }
        for ip in &self.extra_ips {
            push(SubjectAltName::Ip(*ip));
        }
        if sans.is_empty() {
            return Err(Error::NoSubjectNames);
        }
        Ok(sans)
    }

    /// Checks names and validity without issuing anything.
    pub fn validate(&self) -> Result<()> {
        self.subject_alt_names()?;
        check_validity_days(self.validity_days)
    }
}

/// Checks a validity in days is within 1..=[`MAX_VALIDITY_DAYS`].
pub(crate) fn check_validity_days(days: u32) -> Result<()> {
    if days == 0 || days > MAX_VALIDITY_DAYS {
        return Err(Error::InvalidValidity {
            reason: format!(
                "{days} days is out of range; use between 1 and {MAX_VALIDITY_DAYS} days"
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dns(s: &str) -> SubjectAltName {
        SubjectAltName::Dns(s.to_owned())
    }

    #[test]
    fn service_names_come_first_in_order() {
        let sans = ServingCertRequest::for_service("teeguard-webhook", "teeguard")
            .with_dns("webhook.example.com")
            .with_ip("10.1.2.3".parse().expect("ip"))
            .subject_alt_names()
            .expect("valid");
        assert_eq!(
            sans,
            vec![
                dns("teeguard-webhook"),
                dns("teeguard-webhook.teeguard"),
                dns("teeguard-webhook.teeguard.svc"),
                dns("teeguard-webhook.teeguard.svc.cluster.local"),
                dns("webhook.example.com"),
                SubjectAltName::Ip("10.1.2.3".parse().expect("ip")),
            ]
        );
    }

    #[test]
    fn duplicates_are_dropped() {
        let sans = ServingCertRequest::for_service("a", "b")
            .with_dns("a.b.svc")
            .with_dns("x.example")
            .with_dns("x.example")
            .with_ip(IpAddr::V4(Ipv4Addr::LOCALHOST))
            .with_ip(IpAddr::V4(Ipv4Addr::LOCALHOST))
            .subject_alt_names()
            .expect("valid");
        assert_eq!(sans.len(), 6, "{sans:?}");
    }

    #[test]
    fn localhost_has_only_loopback_names() {
        let sans = ServingCertRequest::localhost()
            .subject_alt_names()
            .expect("valid");
        assert_eq!(
            sans,
            vec![
                dns("localhost"),
                SubjectAltName::Ip(IpAddr::V4(Ipv4Addr::LOCALHOST)),
                SubjectAltName::Ip(IpAddr::V6(Ipv6Addr::LOCALHOST)),
            ]
        );
        assert_eq!(sans[1].to_string(), "IP:127.0.0.1");
        assert_eq!(sans[0].to_string(), "DNS:localhost");
    }

    #[test]
    fn empty_request_is_rejected() {
        let err = ServingCertRequest::default()
            .subject_alt_names()
            .expect_err("no names");
        assert!(matches!(err, Error::NoSubjectNames));
    }

    #[test]
    fn bad_service_namespace_and_dns_are_typed_errors() {
        let err = ServingCertRequest::for_service("Bad", "ns")
            .subject_alt_names()
            .expect_err("uppercase");
        assert!(
            matches!(
                err,
                Error::InvalidLabel {
                    field: "service",
                    ..
                }
            ),
            "{err}"
        );
        let err = ServingCertRequest::for_service("ok", "a.b")
            .subject_alt_names()
            .expect_err("dot");
        assert!(
            matches!(
                err,
                Error::InvalidLabel {
                    field: "namespace",
                    ..
                }
            ),
            "{err}"
        );
        let err = ServingCertRequest::for_service("ok", "ns")
            .with_dns("bad_name")
            .subject_alt_names()
            .expect_err("underscore");
        assert!(matches!(err, Error::InvalidDnsName { .. }), "{err}");
        let err = ServingCertRequest::localhost()
            .with_dns("10.0.0.1")
            .subject_alt_names()
            .expect_err("ip as dns");
        assert!(matches!(err, Error::DnsNameIsIpAddress { .. }), "{err}");
    }

    #[test]
    fn validity_bounds() {
        for ok in [1, 365, MAX_VALIDITY_DAYS] {
            ServingCertRequest::localhost()
                .with_validity_days(ok)
                .validate()
                .unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        for bad in [0, MAX_VALIDITY_DAYS + 1, u32::MAX] {
            let err = ServingCertRequest::localhost()
                .with_validity_days(bad)
                .validate()
                .expect_err("out of range");
            assert!(matches!(err, Error::InvalidValidity { .. }), "{bad}: {err}");
        }
    }
}
