//! Private keys as the tools users have write them: PKCS#8 (`PRIVATE KEY`, what Tether
//! writes), PKCS#1 (`RSA PRIVATE KEY`, kubeadm's and `openssl genrsa -traditional`'s)
//! and SEC1 (`EC PRIVATE KEY`, kubeadm's with ECDSA and `openssl ecparam -genkey`'s),
//! RSA or ECDSA on P-256 or P-384. Each is turned into the PKCS#8 form the signer takes.

use rcgen::{KeyPair, SignatureAlgorithm};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};

/// Why a key could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// No private key block in the PEM.
    #[error("no private key in PEM form (PRIVATE KEY, RSA PRIVATE KEY or EC PRIVATE KEY)")]
    NoPem,
    /// An EC key on a curve the signer has not.
    #[error("an EC key on a curve other than P-256 or P-384")]
    Curve,
    /// The key's bytes are not what its label says.
    #[error("a malformed {0} key")]
    Malformed(&'static str),
    /// The signer refused the key.
    #[error("the key was refused: {0}")]
    Refused(String),
}

/// The key in `pem`, whatever its form, ready to sign.
pub fn key_pair_from_pem(pem: &str) -> Result<KeyPair, KeyError> {
    let der = PrivateKeyDer::from_pem_slice(pem.as_bytes()).map_err(|_| KeyError::NoPem)?;
    let (pkcs8, rsa) = match der {
        PrivateKeyDer::Pkcs8(k) => {
            let rsa = is_rsa_pkcs8(k.secret_pkcs8_der());
            (k.secret_pkcs8_der().to_vec(), rsa)
        }
        PrivateKeyDer::Pkcs1(k) => (rsa_pkcs1_to_pkcs8(k.secret_pkcs1_der())?, true),
        PrivateKeyDer::Sec1(k) => (ec_sec1_to_pkcs8(k.secret_sec1_der())?, false),
        _ => return Err(KeyError::NoPem),
    };
    let der = PrivatePkcs8KeyDer::from(pkcs8);
    let refused = |e: rcgen::Error| KeyError::Refused(e.to_string());
    if rsa {
        return KeyPair::from_pkcs8_der_and_sign_algo(&der, &rcgen::PKCS_RSA_SHA256)
            .map_err(refused);
    }
    let algorithm: &SignatureAlgorithm = match curve_of_pkcs8(der.secret_pkcs8_der()) {
        Some(Curve::P256) => &rcgen::PKCS_ECDSA_P256_SHA256,
        Some(Curve::P384) => &rcgen::PKCS_ECDSA_P384_SHA384,
        None => return KeyPair::try_from(der.secret_pkcs8_der()).map_err(refused),
    };
    KeyPair::from_pkcs8_der_and_sign_algo(&der, algorithm).map_err(refused)
}

/// rsaEncryption, 1.2.840.113549.1.1.1 (its DER content).
const RSA_OID: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01];
/// id-ecPublicKey, 1.2.840.10045.2.1.
const EC_OID: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01];
/// prime256v1, 1.2.840.10045.3.1.7.
const P256_OID: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];
/// secp384r1, 1.3.132.0.34.
const P384_OID: &[u8] = &[0x2b, 0x81, 0x04, 0x00, 0x22];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Curve {
    P256,
    P384,
}

impl Curve {
    fn from_oid(oid: &[u8]) -> Option<Curve> {
        match oid {
            P256_OID => Some(Curve::P256),
            P384_OID => Some(Curve::P384),
            _ => None,
        }
    }

    fn oid(self) -> &'static [u8] {
        match self {
            Curve::P256 => P256_OID,
            Curve::P384 => P384_OID,
        }
    }
}

/// PKCS#1 RSAPrivateKey to PKCS#8 PrivateKeyInfo.
fn rsa_pkcs1_to_pkcs8(der: &[u8]) -> Result<Vec<u8>, KeyError> {
    use rsa::pkcs1::DecodeRsaPrivateKey;
    use rsa::pkcs8::EncodePrivateKey;
    let key = rsa::RsaPrivateKey::from_pkcs1_der(der).map_err(|_| KeyError::Malformed("RSA"))?;
    let pkcs8 = key.to_pkcs8_der().map_err(|_| KeyError::Malformed("RSA"))?;
    Ok(pkcs8.as_bytes().to_vec())
}

/// SEC1 ECPrivateKey (RFC 5915) to PKCS#8: the curve from its parameters moves to the
/// algorithm identifier, and the inner key keeps its private and public parts only.
fn ec_sec1_to_pkcs8(der: &[u8]) -> Result<Vec<u8>, KeyError> {
    let bad = || KeyError::Malformed("EC");
    let (tag, body, _) = tlv(der).ok_or_else(bad)?;
    if tag != 0x30 {
        return Err(bad());
    }
    let mut rest = body;
    let (mut version, mut private, mut curve, mut public) = (None, None, None, None);
    while !rest.is_empty() {
        let (tag, content, next) = tlv(rest).ok_or_else(bad)?;
        let whole = &rest[..rest.len() - next.len()];
        match tag {
            0x02 => version = Some(content),
            0x04 => private = Some(whole),
            0xa0 => {
                let (t, oid, _) = tlv(content).ok_or_else(bad)?;
                if t != 0x06 {
                    return Err(KeyError::Curve);
                }
                curve = Some(Curve::from_oid(oid).ok_or(KeyError::Curve)?);
            }
            0xa1 => public = Some(whole),
            _ => {}
        }
        rest = next;
    }
    if version != Some(&[1u8][..]) {
        return Err(bad());
    }
    let (private, curve) = (private.ok_or_else(bad)?, curve.ok_or(KeyError::Curve)?);
    let public = public.ok_or(KeyError::Refused(
        "the EC key carries no public key; write it again with `openssl ec -in KEY -out KEY`"
            .into(),
    ))?;
    let inner = seq(&[&[0x02, 0x01, 0x01], private, public]);
    let algorithm = seq(&[&encode(0x06, EC_OID), &encode(0x06, curve.oid())]);
    Ok(seq(&[
        &[0x02, 0x01, 0x00],
        &algorithm,
        &encode(0x04, &inner),
    ]))
}

/// The curve a PKCS#8 EC key names, if it is one.
fn curve_of_pkcs8(der: &[u8]) -> Option<Curve> {
    let (_, algorithm) = pkcs8_algorithm(der)?;
    let (t, oid, rest) = tlv(algorithm)?;
    if t != 0x06 || oid != EC_OID {
        return None;
    }
    let (t, curve, _) = tlv(rest)?;
    (t == 0x06).then_some(())?;
    Curve::from_oid(curve)
}

/// Is this PKCS#8 key an RSA key?
fn is_rsa_pkcs8(der: &[u8]) -> bool {
    pkcs8_algorithm(der)
        .is_some_and(|(_, alg)| tlv(alg).is_some_and(|(t, oid, _)| t == 0x06 && oid == RSA_OID))
}

/// A PKCS#8 PrivateKeyInfo's version and the content of its AlgorithmIdentifier.
fn pkcs8_algorithm(der: &[u8]) -> Option<(&[u8], &[u8])> {
    let (t, body, _) = tlv(der)?;
    (t == 0x30).then_some(())?;
    let (t, version, rest) = tlv(body)?;
    (t == 0x02).then_some(())?;
    let (t, algorithm, _) = tlv(rest)?;
    (t == 0x30).then_some((version, algorithm))
}

/// One DER element: (tag, content, what follows). Single-byte tags; definite lengths.
fn tlv(der: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = der.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |l, b| (l << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

/// A DER element with `tag` around `content`.
fn encode(tag: u8, content: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    let len = content.len();
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes: Vec<u8> = len
            .to_be_bytes()
            .into_iter()
            .skip_while(|b| *b == 0)
            .collect();
        out.push(0x80 | bytes.len() as u8);
        out.extend(bytes);
    }
    out.extend_from_slice(content);
    out
}

/// A SEQUENCE of already-encoded elements.
fn seq(parts: &[&[u8]]) -> Vec<u8> {
    encode(0x30, &parts.concat())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn der_lengths_round_trip() {
        for n in [0usize, 1, 127, 128, 255, 256, 70_000] {
            let content = vec![7u8; n];
            let der = encode(0x04, &content);
            let (t, c, rest) = tlv(&der).unwrap();
            assert_eq!((t, c.len(), rest.len()), (0x04, n, 0));
        }
        assert!(tlv(&[0x30, 0x85, 1, 2, 3, 4, 5]).is_none());
        assert!(tlv(&[0x30, 0x05, 1]).is_none());
    }

    #[test]
    fn tethers_own_keys_still_load() {
        for alg in [
            &rcgen::PKCS_ECDSA_P256_SHA256,
            &rcgen::PKCS_ECDSA_P384_SHA384,
        ] {
            let k = KeyPair::generate_for(alg).unwrap();
            let again = key_pair_from_pem(&k.serialize_pem()).unwrap();
            assert_eq!(again.public_key_pem(), k.public_key_pem());
        }
        assert_eq!(key_pair_from_pem("junk").err(), Some(KeyError::NoPem));
    }
}
