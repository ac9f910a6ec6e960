//! An egress proxy's URL as HTTPS_PROXY or `--egress-proxy` gives it: read as Go reads
//! it (no scheme means `http://`), its user info percent-decoded for Basic
//! authentication, and shown only with the password masked.

use std::fmt;

use base64::Engine;

/// How the agent talks to the proxy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// CONNECT over plain TCP.
    Http,
    /// CONNECT over TLS to the proxy.
    Https,
}

/// An egress proxy: where it is and who the agent is to it. Its `Debug` and `Display`
/// never show the password.
#[derive(Clone, PartialEq, Eq)]
pub struct ProxyUrl {
    scheme: Scheme,
    /// A DNS name or an IP address (an IPv6 one without brackets).
    host: String,
    port: u16,
    /// The user name as the URL spells it (percent-encoded), for display.
    user_shown: Option<String>,
    /// Whether the URL carries a password (shown as `***`).
    has_password: bool,
    /// `user:password`, percent-decoded: what Basic authentication encodes.
    credentials: Option<Vec<u8>>,
}

/// Why a proxy URL was refused. Messages show the URL with its user info masked.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UrlError {
    /// The text is no URL.
    #[error("the egress proxy URL {shown} does not parse ({reason}); write it as http://[USER:PASSWORD@]HOST:PORT")]
    Syntax {
        /// The URL, its user info masked.
        shown: String,
        /// What the URL parser said.
        reason: String,
    },
    /// A scheme other than http and https (socks5, say).
    #[error("the egress proxy URL {shown} has scheme {scheme}, which the agent cannot use: use an HTTP CONNECT proxy, as http:// (plain) or https:// (TLS to the proxy)")]
    Scheme {
        /// The URL, its user info masked.
        shown: String,
        /// Its scheme.
        scheme: String,
    },
}

impl ProxyUrl {
    /// Parses a proxy URL: `[http://|https://][USER[:PASSWORD]@]HOST[:PORT][/]`. Without
    /// a scheme it is `http://` (as Go's `httpproxy`); without a port, 80 or 443.
    pub fn parse(text: &str) -> Result<ProxyUrl, UrlError> {
        let text = text.trim();
        let full = if text.contains("://") {
            text.to_string()
        } else {
            format!("http://{text}")
        };
        let syntax = |reason: String| UrlError::Syntax {
            shown: mask_raw(text),
            reason,
        };
        let url = url::Url::parse(&full).map_err(|e| syntax(e.to_string()))?;
        let scheme = match url.scheme() {
            "http" => Scheme::Http,
            "https" => Scheme::Https,
            other => {
                return Err(UrlError::Scheme {
                    shown: mask_raw(text),
                    scheme: other.to_string(),
                })
            }
        };
        let host = match url.host() {
            Some(url::Host::Ipv6(ip)) => ip.to_string(),
            Some(h) if !h.to_string().is_empty() => h.to_string(),
            _ => return Err(syntax("no host".into())),
        };
        let port = url
            .port_or_known_default()
            .ok_or_else(|| syntax("no port".into()))?;
        let (user, password) = (url.username(), url.password());
        let credentials = (!user.is_empty() || password.is_some()).then(|| {
            let mut c = decode(user);
            c.push(b':');
            c.extend(decode(password.unwrap_or_default()));
            c
        });
        Ok(ProxyUrl {
            scheme,
            host,
            port,
            user_shown: credentials.is_some().then(|| user.to_string()),
            has_password: password.is_some(),
            credentials,
        })
    }

    /// Plain TCP or TLS to the proxy.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// The proxy's host (the TLS server name of an https:// proxy).
    pub fn host(&self) -> &str {
        &self.host
    }

    /// `host:port` (`[v6]:port`), what the agent connects to and errors name.
    pub fn authority(&self) -> String {
        tether_core::transport::authority(&self.host, self.port)
    }

    /// The `Proxy-Authorization` value, when the URL carries user info.
    pub(crate) fn basic_auth(&self) -> Option<String> {
        let c = self.credentials.as_ref()?;
        Some(format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(c)
        ))
    }

    /// The decoded password, to keep it out of anything a proxy echoes back.
    pub(crate) fn password(&self) -> Option<&[u8]> {
        let c = self.credentials.as_ref()?;
        let at = c.iter().position(|b| *b == b':')?;
        Some(&c[at + 1..]).filter(|p| !p.is_empty())
    }
}

impl fmt::Display for ProxyUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scheme = match self.scheme {
            Scheme::Http => "http",
            Scheme::Https => "https",
        };
        write!(f, "{scheme}://")?;
        if let Some(user) = &self.user_shown {
            write!(f, "{user}")?;
            if self.has_password {
                write!(f, ":***")?;
            }
            write!(f, "@")?;
        }
        write!(f, "{}", self.authority())
    }
}

impl fmt::Debug for ProxyUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ProxyUrl({self})")
    }
}

/// Percent-decoded bytes of a URL's user name or password.
fn decode(s: &str) -> Vec<u8> {
    percent_encoding::percent_decode_str(s).collect()
}

/// `text` with everything between its scheme and its last `@` masked: for a URL that did
/// not parse, whose password cannot be told apart.
fn mask_raw(text: &str) -> String {
    let Some(at) = text.rfind('@') else {
        return text.to_string();
    };
    let start = text.find("://").map_or(0, |i| i + 3).min(at);
    format!("{}***{}", &text[..start], &text[at..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shown(text: &str) -> String {
        ProxyUrl::parse(text).unwrap().to_string()
    }

    #[test]
    fn schemes_hosts_and_ports_as_go_reads_them() {
        // Go's proxyForURLTests: host[:port] without a scheme is http://.
        assert_eq!(shown("127.0.0.1:8080"), "http://127.0.0.1:8080");
        assert_eq!(
            shown("cache.corp.example.com:1234"),
            "http://cache.corp.example.com:1234"
        );
        assert_eq!(shown("localhost"), "http://localhost:80");
        assert_eq!(
            shown("https://cache.corp.example.com"),
            "https://cache.corp.example.com:443"
        );
        assert_eq!(shown("http://127.0.0.1:8080"), "http://127.0.0.1:8080");
        assert_eq!(shown("HTTPS://127.0.0.1:8080/"), "https://127.0.0.1:8080");
        assert_eq!(shown("http://[fd00::9]:3128"), "http://[fd00::9]:3128");
        let v6 = ProxyUrl::parse("[fd00::9]:3128").unwrap();
        assert_eq!((v6.host(), v6.scheme()), ("fd00::9", Scheme::Http));
    }

    #[test]
    fn other_schemes_and_garbage_are_refused() {
        let e = ProxyUrl::parse("socks5://127.0.0.1").unwrap_err();
        assert!(matches!(e, UrlError::Scheme { .. }), "{e}");
        assert!(e.to_string().contains("socks5"), "{e}");
        assert!(ProxyUrl::parse("http://").is_err());
        assert!(ProxyUrl::parse("http://proxy:99999").is_err());
    }

    #[test]
    fn user_info_is_decoded_for_basic_auth() {
        let p = ProxyUrl::parse("http://user:pass@proxy:3128").unwrap();
        // base64("user:pass")
        assert_eq!(p.basic_auth().unwrap(), "Basic dXNlcjpwYXNz");
        assert_eq!(p.password(), Some(&b"pass"[..]));
        // Percent-encoded and reserved characters, as Go's url.UserPassword decodes them.
        let p = ProxyUrl::parse("http://us%40er:p%3As%20s@proxy:3128").unwrap();
        let want = base64::engine::general_purpose::STANDARD.encode("us@er:p:s s");
        assert_eq!(p.basic_auth().unwrap(), format!("Basic {want}"));
        assert_eq!(p.password(), Some(&b"p:s s"[..]));
        // A user without a password is `user:`, as Go sends it.
        let p = ProxyUrl::parse("proxy.corp:3128").unwrap();
        assert_eq!(p.basic_auth(), None);
        let p = ProxyUrl::parse("user@proxy.corp:3128").unwrap();
        let want = base64::engine::general_purpose::STANDARD.encode("user:");
        assert_eq!(p.basic_auth().unwrap(), format!("Basic {want}"));
        assert_eq!(p.password(), None);
    }

    #[test]
    fn the_password_is_never_shown() {
        assert_eq!(
            shown("http://user:s3cret@proxy:3128"),
            "http://user:***@proxy:3128"
        );
        assert_eq!(shown("user@proxy:3128"), "http://user@proxy:3128");
        let p = ProxyUrl::parse("https://u:s3cret@proxy").unwrap();
        assert_eq!(format!("{p:?}"), "ProxyUrl(https://u:***@proxy:443)");
        // A URL that does not parse is shown with all its user info masked.
        for bad in [
            "http://u:s3cret@proxy:notaport",
            "socks5://u:s3cret@proxy:1080",
        ] {
            let e = ProxyUrl::parse(bad).unwrap_err().to_string();
            assert!(!e.contains("s3cret"), "{e}");
            assert!(e.contains("***@proxy"), "{e}");
        }
    }
}
