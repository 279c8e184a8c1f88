//! Pure validation of the names that go into a certificate.

use std::net::IpAddr;

use crate::error::{Error, Result};

/// Longest DNS-1123 label.
pub const MAX_LABEL_LEN: usize = 63;
/// Longest DNS-1123 subdomain.
pub const MAX_SUBDOMAIN_LEN: usize = 253;

/// Why `label` is not a DNS-1123 label, or `None` if it is one.
fn label_problem(label: &str) -> Option<String> {
    if label.is_empty() {
        return Some("it is empty".to_owned());
    }
    if label.len() > MAX_LABEL_LEN {
        return Some(format!(
            "it is {} characters long, the limit is {MAX_LABEL_LEN}",
            label.len()
        ));
    }
    if let Some(c) = label
        .chars()
        .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
    {
        return Some(if c.is_ascii_uppercase() {
            format!("it contains the uppercase letter {c:?}; use lowercase")
        } else {
            format!("it contains the character {c:?}")
        });
    }
    if label.starts_with('-') || label.ends_with('-') {
        return Some("it starts or ends with '-'".to_owned());
    }
    None
}

/// Checks that `value` is a DNS-1123 label; `field` names the input in the error.
pub fn validate_label(field: &'static str, value: &str) -> Result<()> {
    match label_problem(value) {
        None => Ok(()),
        Some(reason) => Err(Error::InvalidLabel {
            field,
            value: value.to_owned(),
            reason,
        }),
    }
}

/// Checks that `value` is a DNS-1123 subdomain, optionally starting with a `*.` wildcard label,
/// and not an IP address.
pub fn validate_dns_name(value: &str) -> Result<()> {
    if value.parse::<IpAddr>().is_ok() {
        return Err(Error::DnsNameIsIpAddress {
            value: value.to_owned(),
        });
    }
    let invalid = |reason: String| Error::InvalidDnsName {
        value: value.to_owned(),
        reason,
    };
    if value.is_empty() {
        return Err(invalid("it is empty".to_owned()));
    }
    if value.len() > MAX_SUBDOMAIN_LEN {
        return Err(invalid(format!(
            "it is {} characters long, the limit is {MAX_SUBDOMAIN_LEN}",
            value.len()
        )));
    }
    if value.ends_with('.') {
        return Err(invalid("it ends with '.'".to_owned()));
    }
    let rest = match value.strip_prefix("*.") {
        Some(rest) => rest,
        None => value,
    };
    for label in rest.split('.') {
        if label == "*" {
            return Err(invalid(
                "'*' is only allowed as the whole leftmost label".to_owned(),
            ));
        }
        if let Some(problem) = label_problem(label) {
            return Err(invalid(format!("label {label:?}: {problem}")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_valid_labels() {
        for ok in [
            "a",
            "0",
            "teeguard",
            "teeguard-webhook",
            "a1-b2",
            &"x".repeat(63),
        ] {
            validate_label("service", ok).unwrap_or_else(|e| panic!("{ok:?} rejected: {e}"));
        }
    }

    #[test]
    fn rejects_invalid_labels_with_reason() {
        let cases: &[(&str, &str)] = &[
            ("", "empty"),
            ("-a", "starts or ends"),
            ("a-", "starts or ends"),
            ("Webhook", "uppercase letter 'W'"),
            ("a.b", "character '.'"),
            ("a_b", "character '_'"),
            ("a b", "character ' '"),
            ("ä", "character 'ä'"),
        ];
        for (value, want) in cases {
            let err = validate_label("namespace", value).expect_err("must be rejected");
            let msg = err.to_string();
            assert!(msg.contains(want), "{value:?}: {msg}");
            assert!(msg.starts_with("invalid namespace"), "{msg}");
            assert!(msg.contains("DNS-1123 label"), "{msg}");
        }
        let long = "x".repeat(64);
        let msg = validate_label("service", &long)
            .expect_err("64 chars")
            .to_string();
        assert!(msg.contains("64 characters long"), "{msg}");
    }

    #[test]
    fn accepts_valid_dns_names() {
        let max = format!(
            "{}.{}.{}.{}",
            "a".repeat(63),
            "b".repeat(63),
            "c".repeat(63),
            "d".repeat(61)
        );
        assert_eq!(max.len(), 253);
        for ok in [
            "localhost",
            "webhook.example.com",
            "a.b-c.d",
            "*.example.com",
            "1-2.example",
            max.as_str(),
        ] {
            validate_dns_name(ok).unwrap_or_else(|e| panic!("{ok:?} rejected: {e}"));
        }
    }

    #[test]
    fn rejects_invalid_dns_names_with_reason() {
        let cases: &[(&str, &str)] = &[
            ("", "empty"),
            ("example.com.", "ends with '.'"),
            ("a..b", "label \"\": it is empty"),
            (".a", "label \"\": it is empty"),
            ("Example.com", "uppercase letter 'E'"),
            ("a.*.b", "only allowed as the whole leftmost label"),
            ("*", "only allowed as the whole leftmost label"),
            ("*a.b", "character '*'"),
            ("a_b.c", "character '_'"),
            ("-a.b", "starts or ends"),
        ];
        for (value, want) in cases {
            let msg = validate_dns_name(value)
                .expect_err("must be rejected")
                .to_string();
            assert!(msg.contains(want), "{value:?}: {msg}");
            assert!(msg.starts_with("invalid DNS name"), "{msg}");
        }
        let too_long = format!("{}.b", "a.".repeat(126));
        assert_eq!(too_long.len(), 254);
        let msg = validate_dns_name(&too_long)
            .expect_err("too long")
            .to_string();
        assert!(msg.contains("254 characters long"), "{msg}");
    }

    #[test]
    fn rejects_ip_addresses_as_dns_names() {
        for ip in ["127.0.0.1", "::1", "10.0.0.1", "fe80::1"] {
            let err = validate_dns_name(ip).expect_err("ip");
            assert!(
                matches!(err, Error::DnsNameIsIpAddress { .. }),
                "{ip}: {err}"
            );
            assert!(err.to_string().contains("--ip"));
        }
    }
}
