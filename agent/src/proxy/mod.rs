//! The egress proxy between the agent and its servers, used as grpc-go (the upstream
//! agent) uses one: which proxy (`--egress-proxy`, else HTTPS_PROXY / https_proxy),
//! which servers bypass it (NO_PROXY / no_proxy; `localhost` and loopback addresses
//! always), and the CONNECT tunnel through it. `address` reads the proxy's URL,
//! `no_proxy` the list, `connect` opens the tunnel.

mod address;
mod connect;
mod no_proxy;

use std::path::PathBuf;
use std::sync::Arc;

use tether_core::tls::TlsError;
use tether_ops::metrics::CertExpiry;
use tether_ops::reload::Reloadable;

pub use address::{ProxyUrl, Scheme, UrlError};
pub use connect::{tunnel, Carrier, ProxyError, HEAD_LIMIT, PROXY_TIMEOUT};
pub use no_proxy::NoProxy;

/// `--egress-proxy` values that turn the proxy off, whatever the environment says.
pub const NEVER: [&str; 2] = ["direct", "none"];

/// The system's CA bundle, which verifies an https:// proxy unless another is given.
pub const SYSTEM_ROOTS: &str = "/etc/ssl/certs/ca-certificates.crt";

/// How the agent reaches its servers: through `proxy` unless `no_proxy` covers the
/// server. The default goes directly.
#[derive(Debug, Clone, Default)]
pub struct Egress {
    /// The proxy, if any.
    pub proxy: Option<ProxyUrl>,
    /// Servers reached directly even so.
    pub no_proxy: NoProxy,
    /// The CA bundle that verifies an https:// proxy's certificate (`None`: the
    /// system's, [`SYSTEM_ROOTS`]).
    pub proxy_ca: Option<PathBuf>,
}

impl Egress {
    /// The settings from the `--egress-proxy` flag and the environment (`env` looks a
    /// variable up), as Go's `httpproxy.FromEnvironment` reads it for an https
    /// request: the first non-empty of HTTPS_PROXY and https_proxy, and of NO_PROXY and
    /// no_proxy. A non-empty flag replaces the proxy variables (`direct` or `none`: no
    /// proxy); NO_PROXY applies either way.
    pub fn from_flag_and_env(
        flag: &str,
        proxy_ca: Option<PathBuf>,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Egress, UrlError> {
        let first = |names: [&str; 2]| {
            names
                .into_iter()
                .find_map(|n| env(n).filter(|v| !v.is_empty()))
        };
        let flag = flag.trim();
        let proxy = if flag.is_empty() {
            first(["HTTPS_PROXY", "https_proxy"])
                .map(|v| ProxyUrl::parse(&v))
                .transpose()?
        } else if NEVER.iter().any(|n| flag.eq_ignore_ascii_case(n)) {
            None
        } else {
            Some(ProxyUrl::parse(flag)?)
        };
        Ok(Egress {
            proxy,
            no_proxy: NoProxy::parse(&first(["NO_PROXY", "no_proxy"]).unwrap_or_default()),
            proxy_ca,
        })
    }

    /// The proxy to reach the server at `host:port` through, or `None` to go directly.
    pub fn route(&self, host: &str, port: u16) -> Option<&ProxyUrl> {
        self.proxy
            .as_ref()
            .filter(|_| !self.no_proxy.bypasses(host, port))
    }

    /// TLS to an https:// proxy (trusting `proxy_ca`), reloaded when the bundle
    /// changes; `None` for an http:// proxy or none.
    pub(crate) fn tls(
        &self,
        expiry: CertExpiry,
    ) -> Result<Option<Arc<Reloadable<rustls::ClientConfig>>>, TlsError> {
        if self.proxy.as_ref().map(ProxyUrl::scheme) != Some(Scheme::Https) {
            return Ok(None);
        }
        let ca = self
            .proxy_ca
            .clone()
            .unwrap_or_else(|| PathBuf::from(SYSTEM_ROOTS));
        let build = {
            let ca = ca.clone();
            move || tether_core::tls::client_config(&ca, None, &[b"http/1.1"])
        };
        let label = "egress proxy TLS";
        match self.proxy_ca {
            // A bundle of the operator's: its expiry is theirs to watch.
            Some(_) => Reloadable::watching_certs(label, vec![ca], build, expiry),
            None => Reloadable::new(label, vec![ca], build, None),
        }
        .map(Some)
    }

    /// Logs, once, how each server is reached when a proxy is configured.
    pub(crate) fn log_routes(&self, servers: &[(String, u16)]) {
        if self.proxy.is_none() {
            return;
        }
        for (host, port) in servers {
            let server = tether_core::transport::authority(host, *port);
            match self.route(host, *port) {
                Some(proxy) => {
                    tracing::info!(%server, egress_proxy = %proxy, "reaching the proxy server through the egress proxy")
                }
                None => tracing::info!(
                    %server,
                    "reaching the proxy server directly: NO_PROXY covers it, or it is a loopback address"
                ),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn from(flag: &str, vars: &[(&str, &str)]) -> Egress {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Egress::from_flag_and_env(flag, None, |name| {
            vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        })
        .unwrap()
    }

    fn proxy(e: &Egress) -> Option<String> {
        e.proxy.as_ref().map(ToString::to_string)
    }

    #[test]
    fn environment_precedence_as_go() {
        // Upper case first; an empty value counts as unset.
        let both = [("HTTPS_PROXY", "upper:1"), ("https_proxy", "lower:2")];
        assert_eq!(proxy(&from("", &both)).as_deref(), Some("http://upper:1"));
        let empty_upper = [("HTTPS_PROXY", ""), ("https_proxy", "lower:2")];
        assert_eq!(
            proxy(&from("", &empty_upper)).as_deref(),
            Some("http://lower:2")
        );
        // HTTP_PROXY is for http requests; the agent's dial is https, as grpc-go's.
        assert_eq!(proxy(&from("", &[("HTTP_PROXY", "p:1")])), None);
        let no = [("HTTPS_PROXY", "p:1"), ("NO_PROXY", ""), ("no_proxy", "s")];
        let e = from("", &no);
        assert!(e.route("s", 1).is_none());
        assert!(e.route("t", 1).is_some());
    }

    #[test]
    fn the_flag_replaces_the_environment_but_not_no_proxy() {
        let env = [("HTTPS_PROXY", "env:1"), ("NO_PROXY", "direct.example")];
        let e = from("https://flag:2", &env);
        assert_eq!(proxy(&e).as_deref(), Some("https://flag:2"));
        assert!(e.route("direct.example", 8091).is_none());
        for never in ["direct", "none", "NONE"] {
            assert_eq!(proxy(&from(never, &env)), None);
        }
    }

    #[test]
    fn routes_skip_loopback_and_no_proxy() {
        let e = from("", &[("https_proxy", "p:3128"), ("no_proxy", ".internal")]);
        assert!(e.route("127.0.0.1", 8091).is_none());
        assert!(e.route("localhost", 8091).is_none());
        assert!(e.route("konnectivity.internal", 8091).is_none());
        let p = e.route("konnectivity.example.com", 8091).unwrap();
        assert_eq!(p.authority(), "p:3128");
        assert!(from("", &[])
            .route("konnectivity.example.com", 8091)
            .is_none());
    }

    #[test]
    fn a_bad_environment_url_is_an_error() {
        let e = Egress::from_flag_and_env("", None, |n| {
            (n == "HTTPS_PROXY").then(|| "socks5://u:pw@p:1080".to_string())
        })
        .unwrap_err();
        assert!(!e.to_string().contains("pw"), "{e}");
    }
}
