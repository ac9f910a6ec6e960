//! TLS configuration builders (rustls, ring provider): PEM loading with one-line errors
//! naming the file, server configs with optional mandatory client certificates, client
//! configs for mutual TLS.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

/// ALPN for gRPC (HTTP/2). Go gRPC peers require it on both sides.
pub const ALPN_H2: &[u8] = b"h2";
/// ALPN for the HTTP-CONNECT frontend.
pub const ALPN_HTTP11: &[u8] = b"http/1.1";

/// Whether a TLS handshake (either end's) failed for want of an ALPN protocol both
/// sides speak: this end found none it serves, or the peer said so in an alert.
pub fn no_shared_alpn(e: &std::io::Error) -> bool {
    use rustls::AlertDescription::NoApplicationProtocol;
    matches!(
        e.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()),
        Some(rustls::Error::AlertReceived(NoApplicationProtocol))
            | Some(rustls::Error::NoApplicationProtocol)
    )
}

/// Why TLS material could not be loaded; each message names the file and what to fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// The file could not be read.
    #[error("cannot read {what} {path} (check the path and permissions)")]
    Read {
        /// Which flag's file.
        what: &'static str,
        /// The path given.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file holds no PEM block of the expected kind.
    #[error("{what} {path} holds no {kind} in PEM form (expected a -----BEGIN {kind}----- block)")]
    NoPem {
        /// Which flag's file.
        what: &'static str,
        /// The path given.
        path: PathBuf,
        /// CERTIFICATE or PRIVATE KEY.
        kind: &'static str,
    },
    /// rustls refused the material (key does not match certificate, unsupported key...).
    #[error(
        "{what} cannot be used (check that the key belongs to the certificate and both are PEM)"
    )]
    Rustls {
        /// Which pair of files.
        what: String,
        /// What rustls said.
        #[source]
        source: rustls::Error,
    },
    /// The CA bundle could not be used to verify peers.
    #[error("CA bundle {path}: {reason}")]
    Ca {
        /// The path given.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}

/// The crypto provider every Tether TLS config uses.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(ring_provider())
}

/// ring's provider with AES-128-GCM ahead of AES-256-GCM, in TLS 1.3 and 1.2 alike,
/// as Go's crypto/tls (the upstream agent and server) and BoringSSL order them on
/// machines with AES instructions. rustls lists AES-256 first; 128-bit AES is as safe
/// for a session key and does 10 rounds instead of 14, which on the agent link is most
/// of the encryption's cost per byte. The server takes the client's order, so our agent
/// and Go's both land on AES-128-GCM; a peer that offers only AES-256 still gets it.
fn ring_provider() -> rustls::crypto::CryptoProvider {
    let mut provider = rustls::crypto::ring::default_provider();
    provider
        .cipher_suites
        .sort_by_key(|s| (s.version() != &rustls::version::TLS13, !is_aes128(s)));
    provider
}

/// True for an AES-128-GCM suite.
fn is_aes128(s: &rustls::SupportedCipherSuite) -> bool {
    use rustls::CipherSuite as S;
    matches!(
        s.suite(),
        S::TLS13_AES_128_GCM_SHA256
            | S::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256
            | S::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256
    )
}

/// Reads every certificate in a PEM file.
pub fn load_certs(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.into(),
        source,
    })?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&bytes)
        .filter_map(Result::ok)
        .collect();
    if certs.is_empty() {
        return Err(TlsError::NoPem {
            what,
            path: path.into(),
            kind: "CERTIFICATE",
        });
    }
    Ok(certs)
}

/// Reads the first private key (PKCS#8, PKCS#1 or SEC1) in a PEM file.
pub fn load_key(what: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = std::fs::read(path).map_err(|source| TlsError::Read {
        what,
        path: path.into(),
        source,
    })?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|_| TlsError::NoPem {
        what,
        path: path.into(),
        kind: "PRIVATE KEY",
    })
}

/// A root store from a CA bundle file.
pub fn load_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs("CA bundle", path)? {
        roots.add(cert).map_err(|e| TlsError::Ca {
            path: path.into(),
            reason: format!("not a usable CA certificate: {e}"),
        })?;
    }
    Ok(roots)
}

/// Paths of a certificate, its key and optionally the CA that signs peers.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    /// Leaf certificate (chain) PEM.
    pub cert: PathBuf,
    /// Private key PEM.
    pub key: PathBuf,
    /// CA bundle used to verify the peer; `None` = no peer verification (servers only).
    pub ca: Option<PathBuf>,
    /// Cipher suites and lowest version a server accepts.
    pub policy: TlsPolicy,
}

/// What a server offers (`--cipher-suites`, `--tls-min-version`), as Go's crypto/tls
/// applies them: the TLS 1.2 suites are chosen, the TLS 1.3 ones always on.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TlsPolicy {
    /// TLS 1.2 suites to offer, by IANA name; empty = rustls' defaults.
    pub tls12_suites: Vec<&'static str>,
    /// Refuse TLS 1.2.
    pub tls13_only: bool,
}

/// Go's IANA cipher suite names rustls offers, and the TLS 1.3 ones (always on).
const OFFERED_TLS12: [&str; 6] = [
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
];
const TLS13: [&str; 3] = [
    "TLS_AES_128_GCM_SHA256",
    "TLS_AES_256_GCM_SHA384",
    "TLS_CHACHA20_POLY1305_SHA256",
];
static TLS13_ONLY: [&rustls::SupportedProtocolVersion; 1] = [&rustls::version::TLS13];
/// Names Go's `tls.CipherSuites()` lists (so upstream accepts them) that rustls does
/// not implement: CBC and static-RSA key exchange. They are dropped with a warning.
const GO_ACCEPTED_NOT_OFFERED: [&str; 8] = [
    "TLS_RSA_WITH_AES_128_CBC_SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA",
];
/// Names only `tls.InsecureCipherSuites()` lists: upstream refuses them at start-up.
const GO_INSECURE: [&str; 8] = [
    "TLS_RSA_WITH_RC4_128_SHA",
    "TLS_RSA_WITH_3DES_EDE_CBC_SHA",
    "TLS_RSA_WITH_AES_128_CBC_SHA256",
    "TLS_ECDHE_ECDSA_WITH_RC4_128_SHA",
    "TLS_ECDHE_RSA_WITH_RC4_128_SHA",
    "TLS_ECDHE_RSA_WITH_3DES_EDE_CBC_SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256",
];

impl TlsPolicy {
    /// Parses `--cipher-suites` (comma-separated Go names) and `--tls-min-version` as
    /// upstream accepts them. Values Go accepts but rustls cannot serve (TLS 1.0/1.1, CBC
    /// and static-RSA suites) are dropped, and the second value is the one warning to
    /// log about them. A list that names TLS 1.3 suites only serves TLS 1.3 only, as Go
    /// does (it has no TLS 1.2 suite left). Refused: unknown or insecure names (as
    /// upstream refuses them), and a list whose TLS 1.2 suites are all dropped while
    /// TLS 1.2 is allowed (Go would serve TLS 1.2 clients; Tether could not).
    pub fn parse(
        cipher_suites: &str,
        min_version: &str,
    ) -> Result<(TlsPolicy, Option<String>), String> {
        let mut dropped: Vec<String> = Vec::new();
        let mut tls13_only = parse_min_version(min_version, &mut dropped)?;
        let named = NamedSuites::parse(cipher_suites)?;
        if !named.not_offered.is_empty() {
            if named.tls12.is_empty() && !tls13_only {
                return Err(format!("--cipher-suites: of its TLS 1.2 suites only {} remain, which Tether's TLS library (rustls) does not implement (no CBC or static-RSA suites), so TLS 1.2 clients could not connect; add an ECDHE GCM or CHACHA20 suite (e.g. TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256) or set --tls-min-version=VersionTLS13", named.not_offered.join(", ")));
            }
            dropped.push(format!(
                "cipher suites {} (rustls implements no CBC or static-RSA suite)",
                named.not_offered.join(", ")
            ));
        } else if named.tls12.is_empty() && named.tls13 && !tls13_only {
            // Go keeps no TLS 1.2 suite for such a list, so only TLS 1.3 clients connect.
            tls13_only = true;
            dropped.push("TLS 1.2 (--cipher-suites names TLS 1.3 suites only, so TLS 1.2 has no suite left, as in Go)".into());
        }
        let warning = (!dropped.is_empty())
            .then(|| format!("not offered: {}; serving the rest", dropped.join("; ")));
        Ok((
            TlsPolicy {
                tls12_suites: named.tls12,
                tls13_only,
            },
            warning,
        ))
    }

    /// The crypto provider and protocol versions for a server with this policy.
    fn server_provider(
        &self,
    ) -> (
        Arc<rustls::crypto::CryptoProvider>,
        &'static [&'static rustls::SupportedProtocolVersion],
    ) {
        let mut provider = ring_provider();
        if !self.tls12_suites.is_empty() || self.tls13_only {
            provider.cipher_suites.retain(|s| match s {
                rustls::SupportedCipherSuite::Tls13(_) => true,
                rustls::SupportedCipherSuite::Tls12(_) => {
                    !self.tls13_only
                        && s.suite()
                            .as_str()
                            .is_some_and(|n| self.tls12_suites.contains(&n))
                }
            });
        }
        let versions: &'static [&'static rustls::SupportedProtocolVersion] = if self.tls13_only {
            &TLS13_ONLY
        } else {
            rustls::DEFAULT_VERSIONS
        };
        (Arc::new(provider), versions)
    }
}

/// `--tls-min-version`: whether only TLS 1.3 is served. TLS 1.0 and 1.1 serve TLS 1.2,
/// noted in `dropped`; any other name is refused.
fn parse_min_version(min_version: &str, dropped: &mut Vec<String>) -> Result<bool, String> {
    match min_version {
        "" | "VersionTLS12" => Ok(false),
        "VersionTLS13" => Ok(true),
        "VersionTLS10" | "VersionTLS11" => {
            dropped.push(format!(
                "--tls-min-version={min_version} (TLS 1.0 and 1.1 are insecure, RFC 8996; the lowest version served is TLS 1.2)"
            ));
            Ok(false)
        }
        other => Err(format!(
            "--tls-min-version {other:?}: use VersionTLS12 or VersionTLS13 (VersionTLS10 and VersionTLS11 are accepted and serve TLS 1.2)"
        )),
    }
}

/// The suites `--cipher-suites` names, by what Tether does with them.
#[derive(Default)]
struct NamedSuites<'a> {
    /// TLS 1.2 suites rustls offers, each once, in the order named.
    tls12: Vec<&'static str>,
    /// Names Go accepts that rustls does not implement, each once, as written.
    not_offered: Vec<&'a str>,
    /// Whether a TLS 1.3 suite (always on) was named.
    tls13: bool,
}

impl<'a> NamedSuites<'a> {
    /// Sorts the comma-separated Go names; unknown and insecure names are refused.
    fn parse(cipher_suites: &'a str) -> Result<Self, String> {
        let mut named = NamedSuites::default();
        for name in cipher_suites
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
        {
            // Go also knows the CHACHA20 suites without their _SHA256 suffix.
            let full = match name {
                "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305" => {
                    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256"
                }
                "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305" => {
                    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256"
                }
                n => n,
            };
            if let Some(known) = OFFERED_TLS12.iter().find(|s| **s == full) {
                if !named.tls12.contains(known) {
                    named.tls12.push(*known);
                }
            } else if TLS13.contains(&full) {
                // Always on, as in Go.
                named.tls13 = true;
            } else if GO_ACCEPTED_NOT_OFFERED.contains(&full) {
                if !named.not_offered.contains(&name) {
                    named.not_offered.push(name);
                }
            } else if GO_INSECURE.contains(&full) {
                return Err(format!("--cipher-suites: {name} is insecure (RC4, 3DES or CBC-SHA256) and upstream refuses it too; remove it"));
            } else {
                return Err(format!(
                    "--cipher-suites: {name:?} is not a Go cipher suite name (e.g. TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256)"
                ));
            }
        }
        Ok(named)
    }
}

/// A server config presenting `files.cert`; when `files.ca` is set, clients must present
/// a certificate signed by it.
pub fn server_config(files: &TlsFiles, alpn: &[&[u8]]) -> Result<Arc<ServerConfig>, TlsError> {
    let certs = load_certs("server certificate", &files.cert)?;
    let key = load_key("server key", &files.key)?;
    let (suites, versions) = files.policy.server_provider();
    let builder = ServerConfig::builder_with_provider(suites)
        .with_protocol_versions(versions)
        .expect("ring supports TLS 1.2 and 1.3");
    let builder = match &files.ca {
        Some(ca) => {
            let roots = Arc::new(load_roots(ca)?);
            let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
                .build()
                .map_err(|e| TlsError::Ca {
                    path: ca.clone(),
                    reason: e.to_string(),
                })?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(certs, key)
        .map_err(|source| TlsError::Rustls {
            what: format!("{} / {}", files.cert.display(), files.key.display()),
            source,
        })?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// A server config presenting a certificate and key held in memory (PEM), with no
/// client authentication: for a self-signed serving pair that never touches disk.
pub fn server_config_from_pem(
    cert_pem: &[u8],
    key_pem: &[u8],
    alpn: &[&[u8]],
) -> Result<Arc<ServerConfig>, TlsError> {
    let certs: Vec<_> = CertificateDer::pem_slice_iter(cert_pem)
        .filter_map(Result::ok)
        .collect();
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|_| TlsError::NoPem {
        what: "server key",
        path: "(in memory)".into(),
        kind: "PRIVATE KEY",
    })?;
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|source| TlsError::Rustls {
            what: "in-memory serving certificate".into(),
            source,
        })?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// A client config trusting `ca` and, when given, presenting `cert`/`key`.
pub fn client_config(
    ca: &Path,
    identity: Option<(&Path, &Path)>,
    alpn: &[&[u8]],
) -> Result<Arc<ClientConfig>, TlsError> {
    let roots = load_roots(ca)?;
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions")
        .with_root_certificates(roots);
    let mut config = match identity {
        Some((cert, key)) => {
            let certs = load_certs("client certificate", cert)?;
            let key_der = load_key("client key", key)?;
            builder
                .with_client_auth_cert(certs, key_der)
                .map_err(|source| TlsError::Rustls {
                    what: format!("{} / {}", cert.display(), key.display()),
                    source,
                })?
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// The TLS server name for `host` (a DNS name or an IP address).
pub fn server_name(host: &str) -> Result<rustls_pki_types::ServerName<'static>, String> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    rustls_pki_types::ServerName::try_from(host.to_string())
        .map_err(|_| format!("{host:?} is neither a DNS name nor an IP address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_cipher_suite_names() {
        let (p, warning) = TlsPolicy::parse(
            "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256, TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305,TLS_AES_128_GCM_SHA256",
            "",
        )
        .unwrap();
        assert_eq!(warning, None);
        assert_eq!(
            p.tls12_suites,
            [
                "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256",
                "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256"
            ]
        );
        let (provider, _) = p.server_provider();
        assert_eq!(provider.cipher_suites.len(), 3 + 2);
        // The Mozilla "Old" / OpenShift profiles: CBC dropped with one warning.
        let (p, warning) = TlsPolicy::parse(
            "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA,TLS_RSA_WITH_AES_256_CBC_SHA",
            "VersionTLS10",
        )
        .unwrap();
        assert_eq!(p.tls12_suites, ["TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256"]);
        assert!(!p.tls13_only);
        let warning = warning.unwrap();
        assert!(warning.contains("VersionTLS10"), "{warning}");
        assert!(
            warning.contains("TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA, TLS_RSA_WITH_AES_256_CBC_SHA"),
            "{warning}"
        );
        // Only CBC suites with TLS 1.2 allowed: nothing would serve a TLS 1.2 client.
        let e = TlsPolicy::parse("TLS_RSA_WITH_AES_128_CBC_SHA", "").unwrap_err();
        assert!(
            e.contains("only TLS_RSA_WITH_AES_128_CBC_SHA remain"),
            "{e}"
        );
        assert!(TlsPolicy::parse("TLS_RSA_WITH_AES_128_CBC_SHA", "VersionTLS13").is_ok());
        assert!(TlsPolicy::parse("TLS_ECDHE_RSA_WITH_3DES_EDE_CBC_SHA", "")
            .unwrap_err()
            .contains("insecure"));
        assert!(TlsPolicy::parse("NOPE", "")
            .unwrap_err()
            .contains("not a Go cipher"));
        // TLS 1.3 names only: TLS 1.3 only, as Go serves it.
        let (p, warning) =
            TlsPolicy::parse("TLS_AES_128_GCM_SHA256,TLS_AES_256_GCM_SHA384", "").unwrap();
        assert!(p.tls13_only);
        assert!(warning.unwrap().contains("TLS 1.2"));
        let (p, warning) = TlsPolicy::parse("TLS_AES_128_GCM_SHA256", "VersionTLS13").unwrap();
        assert!(p.tls13_only && warning.is_none());
        let (p, warning) = TlsPolicy::parse("", "VersionTLS11").unwrap();
        assert!(!p.tls13_only && warning.unwrap().contains("RFC 8996"));
        assert!(TlsPolicy::parse("", "TLS12").is_err());
        let (_, v) = TlsPolicy::parse("", "VersionTLS13")
            .unwrap()
            .0
            .server_provider();
        assert_eq!(v.len(), 1);
        // AES-128-GCM leads each protocol version, as in Go.
        let names: Vec<_> = super::provider()
            .cipher_suites
            .iter()
            .filter_map(|s| s.suite().as_str())
            .collect();
        assert_eq!(names[0], "TLS13_AES_128_GCM_SHA256", "{names:?}");
        assert_eq!(names[1], "TLS13_AES_256_GCM_SHA384", "{names:?}");
        assert!(names[3].starts_with("TLS_ECDHE_") && names[3].contains("AES_128_GCM"));
        // Every suite rustls offers has its Go name here.
        for s in rustls::crypto::ring::default_provider().cipher_suites {
            // rustls spells TLS 1.3 suites `TLS13_...`, Go and IANA `TLS_...`.
            let n = s.suite().as_str().unwrap().replace("TLS13_", "TLS_");
            assert!(
                OFFERED_TLS12.contains(&n.as_str()) || TLS13.contains(&n.as_str()),
                "{n}"
            );
        }
    }
}
