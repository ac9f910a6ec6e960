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

/// Why TLS material could not be loaded; each message names the file and what to fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// The file could not be read.
    #[error("cannot read {what} {path}: {source} (check the path and permissions)")]
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
    #[error("{what}: {source} (check that the key belongs to the certificate and both are PEM)")]
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
    Arc::new(rustls::crypto::ring::default_provider())
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
}

/// A server config presenting `files.cert`; when `files.ca` is set, clients must present
/// a certificate signed by it.
pub fn server_config(files: &TlsFiles, alpn: &[&[u8]]) -> Result<Arc<ServerConfig>, TlsError> {
    let certs = load_certs("server certificate", &files.cert)?;
    let key = load_key("server key", &files.key)?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .expect("ring supports the default protocol versions");
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
