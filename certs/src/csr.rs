//! Reading certificate signing requests (PKCS#10, as in a Kubernetes
//! CertificateSigningRequest's `spec.request`): who the request names and which DNS
//! names, IP addresses, e-mail addresses and URIs it asks to be certified for.

use std::net::IpAddr;

use x509_parser::certification_request::X509CertificationRequest;
use x509_parser::extensions::{GeneralName, ParsedExtension};
use x509_parser::pem::Pem;
use x509_parser::prelude::FromDer;

/// What one CSR asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CsrInfo {
    /// Subject CN, if any.
    pub common_name: Option<String>,
    /// Subject O values (Kubernetes groups).
    pub organizations: Vec<String>,
    /// Requested DNS names.
    pub dns_names: Vec<String>,
    /// Requested IP addresses.
    pub ip_addresses: Vec<IpAddr>,
    /// Requested e-mail addresses.
    pub emails: Vec<String>,
    /// Requested URIs.
    pub uris: Vec<String>,
}

/// A new ECDSA P-256 key and a CSR for subject `CN=common_name, O=organization` asking
/// for `sans` (IP addresses where they parse as one, else DNS names, else e-mail
/// addresses when they hold an `@`): (CSR PEM, key PEM). What a kubelet sends, for tests
/// and tools.
pub fn request_pem(
    common_name: &str,
    organization: &str,
    sans: &[&str],
) -> Result<(String, String), rcgen::Error> {
    let mut params = rcgen::CertificateParams::default();
    for san in sans {
        params.subject_alt_names.push(match san.parse::<IpAddr>() {
            Ok(ip) => rcgen::SanType::IpAddress(ip),
            Err(_) if san.contains('@') => rcgen::SanType::Rfc822Name((*san).try_into()?),
            Err(_) => rcgen::SanType::DnsName((*san).try_into()?),
        });
    }
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, common_name);
    params
        .distinguished_name
        .push(rcgen::DnType::OrganizationName, organization);
    let key = rcgen::KeyPair::generate()?;
    let csr = params.serialize_request(&key)?;
    Ok((csr.pem()?, key.serialize_pem()))
}

/// Parses the single CERTIFICATE REQUEST block in `pem` and checks its signature (the
/// requester holds the key).
pub fn parse_csr_pem(pem: &[u8]) -> Result<CsrInfo, String> {
    let mut blocks = Pem::iter_from_buffer(pem);
    let block = match blocks.next() {
        Some(Ok(b)) => b,
        Some(Err(e)) => return Err(format!("not valid PEM: {e}")),
        None => return Err("holds no PEM block".into()),
    };
    if block.label != "CERTIFICATE REQUEST" && block.label != "NEW CERTIFICATE REQUEST" {
        return Err(format!(
            "holds a {} block, not a CERTIFICATE REQUEST",
            block.label
        ));
    }
    if blocks.next().is_some() {
        return Err("holds more than one PEM block".into());
    }
    parse_csr_der(&block.contents)
}

/// Parses one DER CSR and checks its signature.
pub fn parse_csr_der(der: &[u8]) -> Result<CsrInfo, String> {
    let (rest, csr) = X509CertificationRequest::from_der(der)
        .map_err(|e| format!("not a valid certificate request: {e}"))?;
    if !rest.is_empty() {
        return Err("trailing bytes after the certificate request".into());
    }
    csr.verify_signature()
        .map_err(|e| format!("the request's signature does not verify: {e}"))?;
    let subject = &csr.certification_request_info.subject;
    let mut info = CsrInfo {
        common_name: subject
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .map(str::to_string),
        organizations: subject
            .iter_organization()
            .filter_map(|o| o.as_str().ok().map(str::to_string))
            .collect(),
        ..Default::default()
    };
    for ext in csr.requested_extensions().into_iter().flatten() {
        let ParsedExtension::SubjectAlternativeName(san) = ext else {
            continue;
        };
        for name in &san.general_names {
            match name {
                GeneralName::DNSName(d) => info.dns_names.push(d.to_string()),
                GeneralName::IPAddress(b) => info.ip_addresses.push(match b.len() {
                    4 => IpAddr::from(<[u8; 4]>::try_from(*b).unwrap()),
                    16 => IpAddr::from(<[u8; 16]>::try_from(*b).unwrap()),
                    n => return Err(format!("an IP address SAN of {n} bytes")),
                }),
                GeneralName::RFC822Name(m) => info.emails.push(m.to_string()),
                GeneralName::URI(u) => info.uris.push(u.to_string()),
                other => return Err(format!("an unsupported SAN: {other:?}")),
            }
        }
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn csr(cn: &str, sans: &[&str]) -> String {
        request_pem(cn, "system:nodes", sans).unwrap().0
    }

    #[test]
    fn reads_subject_and_every_requested_name() {
        let info = parse_csr_pem(csr("system:node:n1", &["n1", "10.0.0.7", "fd00::7"]).as_bytes())
            .unwrap();
        assert_eq!(info.common_name.as_deref(), Some("system:node:n1"));
        assert_eq!(info.organizations, ["system:nodes"]);
        assert_eq!(info.dns_names, ["n1"]);
        assert_eq!(
            info.ip_addresses,
            [
                "10.0.0.7".parse::<IpAddr>().unwrap(),
                "fd00::7".parse().unwrap()
            ]
        );
        assert!(info.emails.is_empty() && info.uris.is_empty());
        let mail = parse_csr_pem(csr("a", &["a@example.com"]).as_bytes()).unwrap();
        assert_eq!(mail.emails, ["a@example.com"]);
    }

    #[test]
    fn refuses_what_is_not_one_signed_request() {
        assert!(parse_csr_pem(b"not pem").is_err());
        let two = format!("{}{}", csr("a", &["a"]), csr("b", &["b"]));
        assert!(parse_csr_pem(two.as_bytes())
            .unwrap_err()
            .contains("more than one"));
        // A flipped bit in the signature.
        let pem = csr("a", &["a"]);
        let block = Pem::iter_from_buffer(pem.as_bytes())
            .next()
            .unwrap()
            .unwrap();
        let mut der = block.contents.clone();
        let last = der.len() - 1;
        der[last] ^= 1;
        assert!(parse_csr_der(&der).unwrap_err().contains("signature"));
    }
}
