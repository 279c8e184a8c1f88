//! PEM encoding of certificates, with the `pem` crate rcgen uses.

/// Encodes DER as a `CERTIFICATE` PEM block with 64-character lines and a trailing newline.
pub(crate) fn encode_certificate(der: &[u8]) -> String {
    let lf = pem::EncodeConfig::new().set_line_ending(pem::LineEnding::LF);
    pem::encode_config(&pem::Pem::new("CERTIFICATE", der), lf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls_pki_types::CertificateDer;
    use rustls_pki_types::pem::PemObject;

    #[test]
    fn round_trips_through_a_pem_parser() {
        for len in [0usize, 1, 47, 48, 49, 96, 500] {
            let der: Vec<u8> = (0..len).map(|i| (i * 7 % 256) as u8).collect();
            let pem = encode_certificate(&der);
            assert!(pem.lines().all(|l| l.len() <= 64), "{pem}");
            assert!(pem.ends_with("-----END CERTIFICATE-----\n"));
            if len > 0 {
                let parsed = CertificateDer::from_pem_slice(pem.as_bytes()).expect("parse");
                assert_eq!(parsed.as_ref(), der.as_slice(), "len {len}");
            }
        }
    }
}
