//! PKI for Tether: a certificate authority that issues server and client leaf
//! certificates (ECDSA P-256), written as PEM with private keys mode 0600, and the
//! throwaway bundle `tether local` and the tests use.

use std::io::Write;
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// Why a certificate could not be made or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CertError {
    /// rcgen refused the parameters (a malformed SAN, for instance).
    #[error("cannot generate certificate {name}: {source}")]
    Generate {
        /// The certificate's common name.
        name: String,
        /// What rcgen said.
        #[source]
        source: rcgen::Error,
    },
    /// A file could not be written.
    #[error("cannot write {path}: {source} (check the directory exists and is writable)")]
    Write {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
}

/// A certificate and its private key, PEM-encoded.
#[derive(Debug, Clone)]
pub struct Pair {
    /// The certificate.
    pub cert_pem: String,
    /// The PKCS#8 private key.
    pub key_pem: String,
}

/// What a leaf certificate is for.
#[derive(Debug, Clone, Default)]
pub struct LeafSpec {
    /// Subject CN.
    pub common_name: String,
    /// Subject O (Kubernetes groups).
    pub organization: Option<String>,
    /// DNS names and IP addresses.
    pub sans: Vec<String>,
    /// serverAuth extended key usage.
    pub server: bool,
    /// clientAuth extended key usage.
    pub client: bool,
}

/// A certificate authority that can sign leaves.
pub struct Ca {
    pair: Pair,
    issuer: Issuer<'static, KeyPair>,
}

impl std::fmt::Debug for Ca {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ca").finish_non_exhaustive()
    }
}

impl Ca {
    /// A new self-signed CA named `common_name`.
    pub fn new(common_name: &str) -> Result<Self, CertError> {
        let err = |source| CertError::Generate {
            name: common_name.to_string(),
            source,
        };
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        params.distinguished_name = dn(common_name, None);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().map_err(err)?;
        let cert = params.self_signed(&key).map_err(err)?;
        let pair = Pair {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        };
        Ok(Ca {
            pair,
            issuer: Issuer::new(params, key),
        })
    }

    /// The CA's own certificate and key.
    pub fn pair(&self) -> &Pair {
        &self.pair
    }

    /// Issues a leaf certificate.
    pub fn issue(&self, spec: &LeafSpec) -> Result<Pair, CertError> {
        let err = |source| CertError::Generate {
            name: spec.common_name.clone(),
            source,
        };
        let mut params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        params.distinguished_name = dn(&spec.common_name, spec.organization.as_deref());
        for san in &spec.sans {
            let san = match san.parse::<IpAddr>() {
                Ok(ip) => SanType::IpAddress(ip),
                Err(_) => SanType::DnsName(san.clone().try_into().map_err(err)?),
            };
            params.subject_alt_names.push(san);
        }
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        if spec.server {
            params
                .extended_key_usages
                .push(ExtendedKeyUsagePurpose::ServerAuth);
        }
        if spec.client {
            params
                .extended_key_usages
                .push(ExtendedKeyUsagePurpose::ClientAuth);
        }
        params.use_authority_key_identifier_extension = true;
        let key = KeyPair::generate().map_err(err)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(err)?;
        Ok(Pair {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }
}

fn dn(cn: &str, org: Option<&str>) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, cn);
    if let Some(o) = org {
        dn.push(DnType::OrganizationName, o);
    }
    dn
}

/// Writes `contents` to `path`; `secret` files get mode 0600.
pub fn write_file(path: &Path, contents: &str, secret: bool) -> Result<(), CertError> {
    let werr = |source| CertError::Write {
        path: path.to_path_buf(),
        source,
    };
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    if secret {
        opts.mode(0o600);
    }
    let mut f = opts.open(path).map_err(werr)?;
    f.write_all(contents.as_bytes()).map_err(werr)
}

/// Writes `NAME.crt` and `NAME.key` into `dir`, returning their paths.
pub fn write_pair(dir: &Path, name: &str, pair: &Pair) -> Result<(PathBuf, PathBuf), CertError> {
    let cert = dir.join(format!("{name}.crt"));
    let key = dir.join(format!("{name}.key"));
    write_file(&cert, &pair.cert_pem, false)?;
    write_file(&key, &pair.key_pem, true)?;
    Ok((cert, key))
}

/// A complete throwaway PKI for one machine: a CA, a serving certificate for
/// localhost/127.0.0.1/::1 used by both server listeners, a client certificate for
/// frontends (what kube-apiserver presents) and one for agents.
#[derive(Debug, Clone)]
pub struct DevPki {
    /// The directory holding every file.
    pub dir: PathBuf,
    /// CA certificate (trust anchor for all peers).
    pub ca_cert: PathBuf,
    /// CA key (to issue more leaves).
    pub ca_key: PathBuf,
    /// Server certificate for both the agent listener and the frontend.
    pub server_cert: PathBuf,
    /// Its key.
    pub server_key: PathBuf,
    /// Frontend client certificate (CN system:kube-apiserver... as an apiserver would use).
    pub frontend_cert: PathBuf,
    /// Its key.
    pub frontend_key: PathBuf,
    /// Agent client certificate.
    pub agent_cert: PathBuf,
    /// Its key.
    pub agent_key: PathBuf,
}

impl DevPki {
    /// Generates every file into `dir` (created if missing).
    pub fn generate(dir: &Path) -> Result<Self, CertError> {
        Self::generate_with_sans(dir, &[])
    }

    /// Like [`DevPki::generate`], with extra server certificate SANs (DNS names or IPs).
    pub fn generate_with_sans(dir: &Path, extra_sans: &[String]) -> Result<Self, CertError> {
        std::fs::create_dir_all(dir).map_err(|source| CertError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
        let ca = Ca::new("tether-local-ca")?;
        let (ca_cert, ca_key) = write_pair(dir, "ca", ca.pair())?;
        let mut localhost = vec!["localhost".to_string(), "127.0.0.1".into(), "::1".into()];
        localhost.extend(extra_sans.iter().cloned());
        let server = ca.issue(&LeafSpec {
            common_name: "tether-server".into(),
            sans: localhost,
            server: true,
            ..Default::default()
        })?;
        let (server_cert, server_key) = write_pair(dir, "server", &server)?;
        let frontend = ca.issue(&LeafSpec {
            common_name: "system:kube-apiserver".into(),
            client: true,
            ..Default::default()
        })?;
        let (frontend_cert, frontend_key) = write_pair(dir, "frontend-client", &frontend)?;
        let agent = ca.issue(&LeafSpec {
            common_name: "system:konnectivity-agent".into(),
            client: true,
            ..Default::default()
        })?;
        let (agent_cert, agent_key) = write_pair(dir, "agent", &agent)?;
        Ok(DevPki {
            dir: dir.to_path_buf(),
            ca_cert,
            ca_key,
            server_cert,
            server_key,
            frontend_cert,
            frontend_key,
            agent_cert,
            agent_key,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn dev_pki_files_and_modes() {
        let dir = std::env::temp_dir().join(format!("tether-certs-test-{}", std::process::id()));
        let pki = DevPki::generate(&dir).unwrap();
        let mode = std::fs::metadata(&pki.server_key)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let pem = std::fs::read_to_string(&pki.server_cert).unwrap();
        assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
