//! PKI for Tether: a certificate authority that issues server and client leaf
//! certificates (ECDSA P-256 by default, RSA on request), written as PEM with private
//! keys mode 0600 or as Kubernetes Secret YAML, certificate inspection, and the
//! throwaway bundle `tether local` and the tests use.

pub mod csr;
pub mod inspect;
pub mod key;

use std::io::Write;
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

/// Key type for new certificates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum KeyAlgorithm {
    /// ECDSA on P-256 with SHA-256 (default: small, fast, universally supported).
    #[default]
    EcdsaP256,
    /// RSA 2048 with SHA-256, for peers that need RSA.
    Rsa2048,
    /// RSA 4096 with SHA-256.
    Rsa4096,
}

impl std::str::FromStr for KeyAlgorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ecdsa" | "ecdsa-p256" => Ok(KeyAlgorithm::EcdsaP256),
            "rsa" | "rsa-2048" => Ok(KeyAlgorithm::Rsa2048),
            "rsa-4096" => Ok(KeyAlgorithm::Rsa4096),
            other => Err(format!(
                "unknown key algorithm {other:?} (use ecdsa-p256, rsa-2048 or rsa-4096)"
            )),
        }
    }
}

impl KeyAlgorithm {
    /// A new key pair of this type.
    pub fn generate(self) -> Result<KeyPair, rcgen::Error> {
        let bits = match self {
            KeyAlgorithm::EcdsaP256 => return KeyPair::generate(),
            KeyAlgorithm::Rsa2048 => 2048,
            KeyAlgorithm::Rsa4096 => 4096,
        };
        use rsa::pkcs8::EncodePrivateKey;
        let key = rsa::RsaPrivateKey::new(&mut rsa::rand_core::OsRng, bits)
            .map_err(|_| rcgen::Error::KeyGenerationUnavailable)?;
        let pem = key
            .to_pkcs8_pem(rsa::pkcs8::LineEnding::LF)
            .map_err(|_| rcgen::Error::KeyGenerationUnavailable)?;
        KeyPair::from_pkcs8_pem_and_sign_algo(&pem, &rcgen::PKCS_RSA_SHA256)
    }
}

/// Why a certificate could not be made or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CertError {
    /// rcgen refused the parameters (a malformed SAN, for instance).
    #[error("cannot generate certificate {name}")]
    Generate {
        /// The certificate's common name.
        name: String,
        /// What rcgen said.
        #[source]
        source: rcgen::Error,
    },
    /// A file could not be read.
    #[error("cannot read {path} (check the path and permissions)")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A file holds something unusable.
    #[error("{path}: {reason}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong and what to do.
        reason: String,
    },
    /// Refusing to replace an existing file.
    #[error("{path} already exists; pass --force to overwrite it")]
    Exists {
        /// The file.
        path: PathBuf,
    },
    /// A file could not be written.
    #[error("cannot write {path} (check the directory exists and is writable)")]
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
    /// Key type.
    pub algorithm: KeyAlgorithm,
    /// Validity in days from now (0 = 365).
    pub validity_days: u32,
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
    /// A new self-signed ECDSA CA named `common_name`, valid ten years.
    pub fn new(common_name: &str) -> Result<Self, CertError> {
        Self::new_with(common_name, KeyAlgorithm::EcdsaP256)
    }

    /// Loads an existing CA (e.g. the cluster's own) from PEM files.
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<Self, CertError> {
        let read = |p: &Path| {
            std::fs::read_to_string(p).map_err(|source| CertError::Read {
                path: p.to_path_buf(),
                source,
            })
        };
        let cert_pem = read(cert_path)?;
        let key_pem = read(key_path)?;
        let bad = |why: String| CertError::Invalid {
            path: key_path.to_path_buf(),
            reason: why,
        };
        let key = key::key_pair_from_pem(&key_pem).map_err(|e| {
            bad(format!(
                "not a usable private key ({e}); give the CA's RSA or ECDSA (P-256, P-384) key in PEM"
            ))
        })?;
        let parsed = inspect::parse_pem(&cert_pem).map_err(|reason| CertError::Invalid {
            path: cert_path.to_path_buf(),
            reason,
        })?;
        let first = parsed.first().ok_or_else(|| CertError::Invalid {
            path: cert_path.to_path_buf(),
            reason: "no CERTIFICATE block".into(),
        })?;
        if !first.is_ca {
            return Err(CertError::Invalid {
                path: cert_path.to_path_buf(),
                reason: "not a CA certificate (basicConstraints CA:TRUE missing)".into(),
            });
        }
        if first.public_key_der != rcgen::PublicKeyData::subject_public_key_info(&key) {
            return Err(bad(format!(
                "does not belong to the CA certificate {}",
                cert_path.display()
            )));
        }
        let issuer = Issuer::from_ca_cert_pem(&cert_pem, key).map_err(|e| CertError::Invalid {
            path: cert_path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Ok(Ca {
            pair: Pair { cert_pem, key_pem },
            issuer,
        })
    }

    /// A new self-signed CA of key type `alg`, valid ten years.
    pub fn new_with(common_name: &str, alg: KeyAlgorithm) -> Result<Self, CertError> {
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
        let now = time::OffsetDateTime::now_utc();
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(3650);
        let key = alg.generate().map_err(err)?;
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
        let now = time::OffsetDateTime::now_utc();
        let days = if spec.validity_days == 0 {
            365
        } else {
            spec.validity_days
        };
        params.not_before = now - time::Duration::hours(1);
        params.not_after = now + time::Duration::days(i64::from(days));
        params.serial_number = Some(rcgen::SerialNumber::from_slice(
            &rand::random::<[u8; 16]>()[..],
        ));
        let key = spec.algorithm.generate().map_err(err)?;
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

/// Writes `contents` to `path`; `secret` files get mode 0600, also when they replace a
/// file that had another. The file is written beside `path` and renamed over it, so a
/// process that reloads it (a server watching its certificate) never reads half of it.
pub fn write_file(path: &Path, contents: &str, secret: bool) -> Result<(), CertError> {
    let werr = |source| CertError::Write {
        path: path.to_path_buf(),
        source,
    };
    let name = path
        .file_name()
        .map_or_else(Default::default, |n| n.to_os_string());
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(&name);
    tmp_name.push(format!(".tmp-{}", std::process::id()));
    let tmp = path.with_file_name(tmp_name);
    let _ = std::fs::remove_file(&tmp);
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    if secret {
        opts.mode(0o600);
    }
    let written = opts.open(&tmp).and_then(|mut f| {
        f.write_all(contents.as_bytes())?;
        f.sync_all()
    });
    if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
        let _ = std::fs::remove_file(&tmp);
        return Err(werr(e));
    }
    Ok(())
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
/// frontends (what kube-apiserver presents) and a per-node agent certificate (as
/// `tether certs agent` writes them: no agent can pass for another node).
#[derive(Debug, Clone)]
pub struct DevPki {
    /// The directory holding every file.
    pub dir: PathBuf,
    /// CA certificate: signs the server and the agents (the agents' --ca-cert, the
    /// server's --cluster-ca-cert).
    pub ca_cert: PathBuf,
    /// CA key (to issue more leaves).
    pub ca_key: PathBuf,
    /// Server certificate for both the agent listener and the frontend.
    pub server_cert: PathBuf,
    /// Its key.
    pub server_key: PathBuf,
    /// The CA that signs frontend clients only (the server's --server-ca-cert): an
    /// agent's certificate must not open tunnels.
    pub frontend_ca_cert: PathBuf,
    /// Its key.
    pub frontend_ca_key: PathBuf,
    /// Frontend client certificate (CN system:kube-apiserver... as an apiserver would
    /// use), signed by the frontend CA.
    pub frontend_cert: PathBuf,
    /// Its key.
    pub frontend_key: PathBuf,
    /// Agent client certificate of node [`DEV_AGENT_NODE`].
    pub agent_cert: PathBuf,
    /// Its key.
    pub agent_key: PathBuf,
}

/// The node of [`DevPki`]'s agent certificate (and `tether local`'s agent ID).
pub const DEV_AGENT_NODE: &str = "local-agent";

/// Subject O of per-node agent certificates: the server reads the CN as the node.
pub const AGENT_ORGANIZATION: &str = "system:konnectivity-agents";

/// The leaf of a per-node agent certificate, as `tether certs agent` issues it: CN and a
/// DNS SAN the node, O [`AGENT_ORGANIZATION`], `ips` as IP SANs, client auth only.
pub fn node_agent_spec(
    node: &str,
    ips: &[String],
    algorithm: KeyAlgorithm,
    validity_days: u32,
) -> LeafSpec {
    let mut sans = vec![node.to_string()];
    sans.extend(ips.iter().cloned());
    LeafSpec {
        algorithm,
        validity_days,
        common_name: node.to_string(),
        organization: Some(AGENT_ORGANIZATION.to_string()),
        sans,
        client: true,
        ..Default::default()
    }
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
        let frontend_ca = Ca::new("tether-local-frontend-ca")?;
        let (frontend_ca_cert, frontend_ca_key) =
            write_pair(dir, "frontend-ca", frontend_ca.pair())?;
        let frontend = frontend_ca.issue(&LeafSpec {
            common_name: "system:kube-apiserver".into(),
            client: true,
            ..Default::default()
        })?;
        let (frontend_cert, frontend_key) = write_pair(dir, "frontend-client", &frontend)?;
        let agent = ca.issue(&node_agent_spec(
            DEV_AGENT_NODE,
            &[],
            KeyAlgorithm::default(),
            0,
        ))?;
        let (agent_cert, agent_key) = write_pair(dir, "agent", &agent)?;
        Ok(DevPki {
            dir: dir.to_path_buf(),
            ca_cert,
            ca_key,
            server_cert,
            server_key,
            frontend_ca_cert,
            frontend_ca_key,
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
    fn a_key_written_over_a_readable_file_is_private_and_whole() {
        let dir = std::env::temp_dir().join(format!("tether-certs-over-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("server.key");
        std::fs::write(&key, "old").unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        write_file(&key, "new key", true).unwrap();
        assert_eq!(std::fs::read_to_string(&key).unwrap(), "new key");
        let mode = std::fs::metadata(&key).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        // Nothing left beside it.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

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

/// Where generated material goes: PEM files, or Kubernetes Secret YAML.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Format {
    /// `NAME.crt` / `NAME.key` files (keys 0600).
    #[default]
    Files,
    /// One `kubernetes.io/tls` Secret per pair, in `secrets.yaml` (0600).
    Secret,
}

impl std::str::FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "files" => Ok(Format::Files),
            "secret" => Ok(Format::Secret),
            other => Err(format!("unknown format {other:?} (use files or secret)")),
        }
    }
}

/// Writes generated material into a directory, never replacing a file unless `force`.
#[derive(Debug)]
pub struct Writer {
    dir: PathBuf,
    format: Format,
    force: bool,
    namespace: String,
    secrets: String,
    written: Vec<PathBuf>,
}

impl Writer {
    /// A writer into `dir` (created if missing).
    pub fn new(
        dir: &Path,
        format: Format,
        force: bool,
        namespace: &str,
    ) -> Result<Self, CertError> {
        std::fs::create_dir_all(dir).map_err(|source| CertError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
        Ok(Writer {
            dir: dir.to_path_buf(),
            format,
            force,
            namespace: namespace.to_string(),
            secrets: String::new(),
            written: Vec::new(),
        })
    }

    fn target(&self, name: &str) -> Result<PathBuf, CertError> {
        let path = self.dir.join(name);
        if path.exists() && !self.force {
            return Err(CertError::Exists { path });
        }
        Ok(path)
    }

    /// Checks up front that none of `names` exists (so nothing is half-written).
    pub fn check_free(&self, names: &[String]) -> Result<(), CertError> {
        let names: Vec<String> = match self.format {
            Format::Files => names.to_vec(),
            Format::Secret => vec!["secrets.yaml".into()],
        };
        for n in names {
            self.target(&n)?;
        }
        Ok(())
    }

    /// A certificate and key named `name` (files `name.crt`/`name.key`, or Secret `name`).
    pub fn pair(&mut self, name: &str, pair: &Pair, ca_pem: &str) -> Result<(), CertError> {
        match self.format {
            Format::Files => {
                let cert = self.target(&format!("{name}.crt"))?;
                let key = self.target(&format!("{name}.key"))?;
                write_file(&cert, &pair.cert_pem, false)?;
                write_file(&key, &pair.key_pem, true)?;
                self.written.extend([cert, key]);
            }
            Format::Secret => {
                use base64::Engine;
                let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
                self.secrets.push_str(&format!(
                    "---\napiVersion: v1\nkind: Secret\nmetadata:\n  name: {name}\n  namespace: {}\ntype: kubernetes.io/tls\ndata:\n  tls.crt: {}\n  tls.key: {}\n  ca.crt: {}\n",
                    self.namespace,
                    b64(&pair.cert_pem),
                    b64(&pair.key_pem),
                    b64(ca_pem)
                ));
            }
        }
        Ok(())
    }

    /// A plain file (certificate bundle, kubeconfig); `secret` files get mode 0600.
    pub fn file(&mut self, name: &str, contents: &str, secret: bool) -> Result<(), CertError> {
        let path = self.target(name)?;
        write_file(&path, contents, secret)?;
        self.written.push(path);
        Ok(())
    }

    /// Flushes Secret YAML; returns every path written.
    pub fn finish(mut self) -> Result<Vec<PathBuf>, CertError> {
        if self.format == Format::Secret && !self.secrets.is_empty() {
            let path = self.target("secrets.yaml")?;
            write_file(&path, &self.secrets, true)?;
            self.written.push(path);
        }
        Ok(self.written)
    }
}
