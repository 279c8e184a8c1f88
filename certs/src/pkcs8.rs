//! Wrapping PKCS#1 RSA and SEC1 EC private keys into PKCS#8 (RFC 5208), the only form
//! ring can load. Helm's `genCA` writes PKCS#1 keys and OpenSSL/cert-manager write SEC1.

/// AlgorithmIdentifier { rsaEncryption, NULL }.
const RSA_ALG_ID: &[u8] = &[
    0x30, 0x0d, 0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01, 0x05, 0x00,
];
/// AlgorithmIdentifier { id-ecPublicKey, prime256v1 }.
const EC_P256_ALG_ID: &[u8] = &[
    0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a, 0x86, 0x48,
    0xce, 0x3d, 0x03, 0x01, 0x07,
];
/// AlgorithmIdentifier { id-ecPublicKey, secp384r1 }.
const EC_P384_ALG_ID: &[u8] = &[
    0x30, 0x10, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x05, 0x2b, 0x81, 0x04,
    0x00, 0x22,
];

/// Appends a DER tag-length-value.
fn push_tlv(out: &mut Vec<u8>, tag: u8, value: &[u8]) {
    out.push(tag);
    let len = value.len();
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes = len.to_be_bytes();
        let skip = bytes.iter().take_while(|b| **b == 0).count();
        out.push(0x80 | (bytes.len() - skip) as u8);
        out.extend_from_slice(&bytes[skip..]);
    }
    out.extend_from_slice(value);
}

/// PrivateKeyInfo { version 0, `alg_id`, OCTET STRING `inner` }.
fn wrap(alg_id: &[u8], inner: &[u8]) -> Vec<u8> {
    let mut body = vec![0x02, 0x01, 0x00];
    body.extend_from_slice(alg_id);
    push_tlv(&mut body, 0x04, inner);
    let mut out = Vec::with_capacity(body.len() + 6);
    push_tlv(&mut out, 0x30, &body);
    out
}

/// PKCS#8 for a PKCS#1 `RSAPrivateKey`.
pub(crate) fn from_pkcs1_rsa(pkcs1: &[u8]) -> Vec<u8> {
    wrap(RSA_ALG_ID, pkcs1)
}

/// PKCS#8 candidates (P-256, then P-384) for a SEC1 `ECPrivateKey`; the key itself
/// decides which one loads.
pub(crate) fn from_sec1_ec(sec1: &[u8]) -> [Vec<u8>; 2] {
    [wrap(EC_P256_ALG_ID, sec1), wrap(EC_P384_ALG_ID, sec1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_use_short_and_long_form() {
        for (len, header) in [
            (0usize, vec![0x04, 0x00]),
            (0x7f, vec![0x04, 0x7f]),
            (0x80, vec![0x04, 0x81, 0x80]),
            (0xff, vec![0x04, 0x81, 0xff]),
            (0x100, vec![0x04, 0x82, 0x01, 0x00]),
            (0x1234, vec![0x04, 0x82, 0x12, 0x34]),
        ] {
            let mut out = Vec::new();
            push_tlv(&mut out, 0x04, &vec![0xaa; len]);
            assert_eq!(out[..header.len()], header[..], "len {len}");
            assert_eq!(out.len(), header.len() + len);
        }
    }

    #[test]
    fn wrapped_key_parses_as_pkcs8_structure() {
        let inner = vec![0x30, 0x03, 0x02, 0x01, 0x01];
        let der = from_pkcs1_rsa(&inner);
        let (rest, obj) = x509_parser::der_parser::parse_der(&der).expect("der");
        assert!(rest.is_empty());
        let items = obj.as_sequence().expect("sequence");
        assert_eq!(items.len(), 3);
        assert_eq!(items[0].as_u32().expect("version"), 0);
        assert_eq!(items[2].as_slice().expect("octets"), inner.as_slice());
    }
}
