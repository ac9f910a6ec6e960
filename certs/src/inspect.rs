//! Reading certificates back: subject, SANs, key usage, issuer, validity, whether a
//! certificate chains to a CA, whether a key belongs to a certificate.

use std::net::IpAddr;

use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::pem::Pem;
use x509_parser::prelude::FromDer;

/// What one certificate says.
#[derive(Debug, Clone)]
pub struct CertInfo {
    /// Subject DN.
    pub subject: String,
    /// Subject CN, if any.
    pub common_name: Option<String>,
    /// Subject O values (Kubernetes groups).
    pub organizations: Vec<String>,
    /// Issuer DN.
    pub issuer: String,
    /// DNS SANs.
    pub dns_sans: Vec<String>,
    /// IP SANs.
    pub ip_sans: Vec<IpAddr>,
    /// Key usages (digitalSignature, keyCertSign...).
    pub key_usage: Vec<String>,
    /// Extended key usages (serverAuth, clientAuth).
    pub ext_key_usage: Vec<String>,
    /// Validity start, Unix seconds.
    pub not_before: i64,
    /// Validity end, Unix seconds.
    pub not_after: i64,
    /// basicConstraints CA:TRUE.
    pub is_ca: bool,
    /// SubjectPublicKeyInfo DER.
    pub public_key_der: Vec<u8>,
    /// The certificate DER.
    pub der: Vec<u8>,
}

impl CertInfo {
    /// Has `not_after` passed?
    pub fn expired(&self) -> bool {
        self.not_after < now()
    }

    /// Does the certificate cover `name` (a DNS name or an IP address)?
    pub fn covers(&self, name: &str) -> bool {
        match name
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<IpAddr>()
        {
            Ok(ip) => self.ip_sans.contains(&ip),
            Err(_) => self.dns_sans.iter().any(|d| dns_match(d, name)),
        }
    }

    /// Is this certificate signed by `ca`'s key?
    pub fn signed_by(&self, ca: &CertInfo) -> bool {
        let (Ok((_, leaf)), Ok((_, ca_cert))) = (
            x509_parser::certificate::X509Certificate::from_der(&self.der),
            x509_parser::certificate::X509Certificate::from_der(&ca.der),
        ) else {
            return false;
        };
        leaf.issuer() == ca_cert.subject()
            && leaf.verify_signature(Some(ca_cert.public_key())).is_ok()
    }
}

fn dns_match(pattern: &str, name: &str) -> bool {
    if let Some(suffix) = pattern.strip_prefix("*.") {
        name.split_once('.')
            .is_some_and(|(_, rest)| rest.eq_ignore_ascii_case(suffix))
    } else {
        pattern.eq_ignore_ascii_case(name)
    }
}

/// Seconds since the Unix epoch.
pub fn now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// Parses every CERTIFICATE block in `pem`.
pub fn parse_pem(pem: &str) -> Result<Vec<CertInfo>, String> {
    let mut out = Vec::new();
    for block in Pem::iter_from_buffer(pem.as_bytes()) {
        let block = block.map_err(|e| format!("not valid PEM: {e}"))?;
        if block.label != "CERTIFICATE" {
            continue;
        }
        out.push(parse_der(&block.contents)?);
    }
    if out.is_empty() {
        return Err("holds no CERTIFICATE block".into());
    }
    Ok(out)
}

/// Parses one DER certificate.
pub fn parse_der(der: &[u8]) -> Result<CertInfo, String> {
    let (_, cert) = x509_parser::certificate::X509Certificate::from_der(der)
        .map_err(|e| format!("not a valid X.509 certificate: {e}"))?;
    let mut info = CertInfo {
        subject: cert.subject().to_string(),
        common_name: cert
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .map(str::to_string),
        organizations: cert
            .subject()
            .iter_organization()
            .filter_map(|o| o.as_str().ok().map(str::to_string))
            .collect(),
        issuer: cert.issuer().to_string(),
        dns_sans: Vec::new(),
        ip_sans: Vec::new(),
        key_usage: Vec::new(),
        ext_key_usage: Vec::new(),
        not_before: cert.validity().not_before.timestamp(),
        not_after: cert.validity().not_after.timestamp(),
        is_ca: false,
        public_key_der: cert.public_key().raw.to_vec(),
        der: der.to_vec(),
    };
    for ext in cert.extensions() {
        match ext.parsed_extension() {
            ParsedExtension::SubjectAlternativeName(san) => {
                for name in &san.general_names {
                    match name {
                        GeneralName::DNSName(d) => info.dns_sans.push(d.to_string()),
                        GeneralName::IPAddress(b) => match b.len() {
                            4 => info
                                .ip_sans
                                .push(IpAddr::from(<[u8; 4]>::try_from(*b).unwrap())),
                            16 => info
                                .ip_sans
                                .push(IpAddr::from(<[u8; 16]>::try_from(*b).unwrap())),
                            _ => {}
                        },
                        _ => {}
                    }
                }
            }
            ParsedExtension::BasicConstraints(bc) => info.is_ca = bc.ca,
            ParsedExtension::KeyUsage(ku) => {
                for (set, name) in [
                    (ku.digital_signature(), "digitalSignature"),
                    (ku.key_encipherment(), "keyEncipherment"),
                    (ku.key_cert_sign(), "keyCertSign"),
                    (ku.crl_sign(), "cRLSign"),
                ] {
                    if set {
                        info.key_usage.push(name.into());
                    }
                }
            }
            ParsedExtension::ExtendedKeyUsage(eku) => {
                if eku.server_auth {
                    info.ext_key_usage.push("serverAuth".into());
                }
                if eku.client_auth {
                    info.ext_key_usage.push("clientAuth".into());
                }
            }
            _ => {}
        }
    }
    Ok(info)
}

/// Does the private key in `key_pem` belong to `cert`?
pub fn key_matches(cert: &CertInfo, key_pem: &str) -> Result<bool, String> {
    let key = crate::key::key_pair_from_pem(key_pem)
        .map_err(|e| format!("not a usable private key: {e}"))?;
    Ok(rcgen::PublicKeyData::subject_public_key_info(&key) == cert.public_key_der)
}

/// A UTC timestamp as `2026-11-22T10:50:00Z`.
pub fn format_time(unix: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp(unix)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| unix.to_string())
}
