//! NO_PROXY as Go's `golang.org/x/net/http/httpproxy` reads it (and so grpc-go, the
//! upstream agent): which server addresses the agent dials directly instead of through
//! its egress proxy. Pure: a parsed list and one question.

use std::net::IpAddr;

/// One entry of the list.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Entry {
    /// An IP network (`10.0.0.0/8`, `2001:db8::/32`): any port.
    Net {
        /// The network's address, host bits cleared.
        base: IpAddr,
        /// Its prefix length.
        prefix: u8,
    },
    /// One IP address (`192.168.1.1`, `192.168.1.3:80`, `[2001:db8::1]:443`).
    Ip {
        /// The address, IPv4-mapped IPv6 read as IPv4 (Go's `IP.Equal`).
        ip: IpAddr,
        /// The port it applies to (empty: any), compared as text, as Go does.
        port: String,
    },
    /// A domain (`example.com`, `.example.com`, `*.example.com`, with an optional port).
    Domain {
        /// `.` and the domain: what a subdomain ends with.
        suffix: String,
        /// Written without a leading `.` (or `*.`): the domain itself matches too.
        itself: bool,
        /// The port it applies to (empty: any).
        port: String,
    },
}

/// A parsed NO_PROXY list. Besides its entries, `localhost` and loopback addresses are
/// never proxied (Go's rule, whatever the list says).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NoProxy {
    /// `*`: nothing is proxied.
    all: bool,
    entries: Vec<Entry>,
}

impl NoProxy {
    /// Parses a comma-separated NO_PROXY value. As Go's, it never fails: an entry it
    /// cannot read (`:1`) is skipped.
    pub fn parse(list: &str) -> NoProxy {
        let mut out = NoProxy::default();
        for raw in list.split(',') {
            let entry = raw.trim().to_ascii_lowercase();
            if entry.is_empty() {
                continue;
            }
            if entry == "*" {
                return NoProxy {
                    all: true,
                    entries: Vec::new(),
                };
            }
            if let Some(e) = Entry::parse(&entry) {
                out.entries.push(e);
            }
        }
        out
    }

    /// Is `host:port` dialled directly (not through the proxy)? `host` is a name or an
    /// IP address (an IPv6 one with or without brackets).
    pub fn bypasses(&self, host: &str, port: u16) -> bool {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let ip = host.parse::<IpAddr>().ok().map(|ip| ip.to_canonical());
        if host.eq_ignore_ascii_case("localhost") || ip.is_some_and(|ip| ip.is_loopback()) {
            return true;
        }
        if self.all {
            return true;
        }
        let host = host.trim().to_ascii_lowercase();
        let port = port.to_string();
        self.entries.iter().any(|e| e.matches(&host, &port, ip))
    }
}

impl Entry {
    /// One lower-cased, trimmed, non-empty entry other than `*`.
    fn parse(entry: &str) -> Option<Entry> {
        if let Some(net) = parse_cidr(entry) {
            return Some(net);
        }
        let (host, port) = match split_host_port(entry) {
            Some(("", _)) => return None,
            Some((host, port)) => (host, port),
            None => (entry, ""),
        };
        if let Ok(ip) = host.parse::<IpAddr>() {
            return Some(Entry::Ip {
                ip: ip.to_canonical(),
                port: port.to_string(),
            });
        }
        let host = host
            .strip_prefix('*')
            .filter(|h| h.starts_with('.'))
            .unwrap_or(host);
        let (suffix, itself) = match host.strip_prefix('.') {
            Some(_) => (host.to_string(), false),
            None => (format!(".{host}"), true),
        };
        Some(Entry::Domain {
            suffix,
            itself,
            port: port.to_string(),
        })
    }

    /// Does this entry cover `host` (lower case) at `port`? Domains are compared as
    /// text for IP addresses too, as Go does.
    fn matches(&self, host: &str, port: &str, ip: Option<IpAddr>) -> bool {
        match self {
            Entry::Net { base, prefix } => ip.is_some_and(|ip| in_net(ip, *base, *prefix)),
            Entry::Ip { ip: want, port: p } => ip == Some(*want) && (p.is_empty() || p == port),
            Entry::Domain {
                suffix,
                itself,
                port: p,
            } => {
                let named = host.ends_with(suffix.as_str()) || (*itself && host == &suffix[1..]);
                named && (p.is_empty() || p == port)
            }
        }
    }
}

/// `ADDRESS/PREFIX`, as Go's `net.ParseCIDR` reads it.
fn parse_cidr(entry: &str) -> Option<Entry> {
    let (addr, prefix) = entry.split_once('/')?;
    let addr: IpAddr = addr.parse().ok()?;
    if prefix.is_empty() || !prefix.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let prefix: u8 = prefix.parse().ok()?;
    let bits = if addr.is_ipv4() { 32 } else { 128 };
    if prefix > bits {
        return None;
    }
    Some(Entry::Net {
        base: mask(addr, prefix),
        prefix,
    })
}

/// `addr` with all but its first `prefix` bits cleared.
fn mask(addr: IpAddr, prefix: u8) -> IpAddr {
    match addr {
        IpAddr::V4(a) => {
            let m = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V4((u32::from(a) & m).into())
        }
        IpAddr::V6(a) => {
            let m = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V6((u128::from(a) & m).into())
        }
    }
}

/// Is `ip` (canonical) in the network `base/prefix`? Only within one family, as Go's
/// `IPNet.Contains` (an IPv4-mapped address counts as IPv4).
fn in_net(ip: IpAddr, base: IpAddr, prefix: u8) -> bool {
    ip.is_ipv4() == base.is_ipv4() && mask(ip, prefix) == base
}

/// `host:port` or `[host]:port` split as Go's `net.SplitHostPort` does (the port may be
/// empty); `None` where Go reports an error (no port, too many colons).
fn split_host_port(s: &str) -> Option<(&str, &str)> {
    if let Some(rest) = s.strip_prefix('[') {
        let (host, after) = rest.split_once(']')?;
        let port = after.strip_prefix(':')?;
        return (!port.contains(':') && !host.contains('[')).then_some((host, port));
    }
    let (host, port) = s.rsplit_once(':')?;
    (!host.contains(':') && !host.contains('[') && !host.contains(']')).then_some((host, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Go's `noProxy` in golang.org/x/net/http/httpproxy's proxy_test.go.
    const GO_LIST: &str = "foobar.com, .barbaz.net, *.wildcard.io, 192.168.1.1, 192.168.1.2:81, 192.168.1.3:80, 10.0.0.0/30, 2001:db8::52:0:1, [2001:db8::52:0:2]:443, [2001:db8::52:0:3]:80, 2002:db8:a::45/64";

    /// Go's `UseProxyTests`: each host at port 80, and whether it is proxied.
    const GO_TABLE: &[(&str, bool)] = &[
        // Never proxy localhost.
        ("localhost", false),
        ("127.0.0.1", false),
        ("127.0.0.2", false),
        ("[::1]", false),
        ("[::2]", true),                       // not a loopback address
        ("192.168.1.1", false),                // matches exact IPv4
        ("192.168.1.2", true),                 // ports do not match
        ("192.168.1.3", false),                // matches exact IPv4:port
        ("192.168.1.4", true),                 // no match
        ("10.0.0.2", false),                   // matches IPv4/CIDR
        ("[2001:db8::52:0:1]", false),         // matches exact IPv6
        ("[2001:db8::52:0:2]", true),          // no match
        ("[2001:db8::52:0:3]", false),         // matches exact [IPv6]:port
        ("[2002:db8:a::123]", false),          // matches IPv6/CIDR
        ("[fe80::424b:c8be:1643:a1b6]", true), // no match
        ("barbaz.net", true),                  // does not match as .barbaz.net
        ("www.barbaz.net", false),             // does match as .barbaz.net
        ("foobar.com", false),                 // does match as foobar.com
        ("www.foobar.com", false),             // match because NO_PROXY includes "foobar.com"
        ("foofoobar.com", true),               // not match as a part of foobar.com
        ("baz.com", true),                     // not match as a part of barbaz.com
        ("localhost.net", true),               // not match as suffix of address
        ("local.localhost", true),             // not match as prefix as address
        ("barbarbaz.net", true),               // not match, wrong domain
        ("wildcard.io", true),                 // does not match as *.wildcard.io
        ("nested.wildcard.io", false),         // match as *.wildcard.io
        ("awildcard.io", true),                // not a match because of '*'
    ];

    #[test]
    fn go_use_proxy_table() {
        let list = NoProxy::parse(GO_LIST);
        for (host, proxied) in GO_TABLE {
            assert_eq!(!list.bypasses(host, 80), *proxied, "{host}:80");
        }
    }

    #[test]
    fn go_all_no_proxy() {
        let list = NoProxy::parse("*");
        for (host, _) in GO_TABLE {
            assert!(list.bypasses(host, 80), "{host}:80");
        }
        // `*` anywhere in the list means everything.
        assert!(NoProxy::parse("example.com, *").bypasses("other.org", 443));
    }

    #[test]
    fn go_invalid_no_proxy_is_skipped() {
        assert!(!NoProxy::parse(":1").bypasses("example.com", 80));
        assert_eq!(NoProxy::parse(":1, ,"), NoProxy::default());
    }

    /// Go's `proxyForURLTests` entries on NO_PROXY (the ASCII ones: server names are
    /// ASCII, so Go's IDNA conversion has nothing to do here).
    #[test]
    fn go_proxy_for_url_no_proxy_cases() {
        let cases = [
            ("example.com", "example.com", false),
            (".example.com", "example.com", true),
            ("ample.com", "example.com", true),
            ("example.com", "foo.example.com", false),
            (".foo.com", "example.com", true),
            ("xn--fsq092h.com", "www.xn--fsq092h.com", false),
        ];
        for (list, host, proxied) in cases {
            assert_eq!(
                !NoProxy::parse(list).bypasses(host, 80),
                proxied,
                "NO_PROXY={list} host={host}"
            );
        }
    }

    #[test]
    fn ports_case_and_spacing() {
        let list = NoProxy::parse(" Example.COM:8091 ,10.1.2.3:8091,[fd00::1]");
        assert!(list.bypasses("example.com", 8091));
        assert!(list.bypasses("A.EXAMPLE.com", 8091));
        assert!(!list.bypasses("example.com", 443));
        assert!(list.bypasses("10.1.2.3", 8091));
        assert!(!list.bypasses("10.1.2.3", 8092));
        // `[fd00::1]` without a port is no IP entry for Go either (SplitHostPort fails,
        // and `[fd00::1]` does not parse as an address): it matches nothing.
        assert!(!list.bypasses("fd00::1", 8091));
        assert!(NoProxy::parse("fd00::1").bypasses("[fd00::1]", 8091));
    }

    #[test]
    fn mapped_and_loopback_addresses() {
        // IPv4-mapped IPv6 is IPv4 for exact and network entries, and for loopback.
        assert!(NoProxy::parse("10.0.0.0/8").bypasses("::ffff:10.1.2.3", 1));
        assert!(NoProxy::parse("10.1.2.3").bypasses("::ffff:10.1.2.3", 1));
        assert!(NoProxy::default().bypasses("::ffff:127.0.0.5", 1));
        assert!(NoProxy::default().bypasses("LocalHost", 1));
        assert!(!NoProxy::default().bypasses("10.0.0.1", 1));
        // Host bits in a network entry are ignored, as Go's ParseCIDR does.
        assert!(NoProxy::parse("10.0.0.5/30").bypasses("10.0.0.6", 1));
        assert!(!NoProxy::parse("10.0.0.5/30").bypasses("10.0.0.9", 1));
        assert!(NoProxy::parse("0.0.0.0/0").bypasses("192.0.2.1", 1));
        assert!(!NoProxy::parse("0.0.0.0/0").bypasses("2001:db8::1", 1));
    }

    #[test]
    fn split_host_port_as_go() {
        assert_eq!(split_host_port("a:1"), Some(("a", "1")));
        assert_eq!(split_host_port("a:"), Some(("a", "")));
        assert_eq!(split_host_port("[::1]:80"), Some(("::1", "80")));
        assert_eq!(split_host_port("[::1]"), None);
        assert_eq!(split_host_port("::1"), None);
        assert_eq!(split_host_port("a"), None);
        assert_eq!(split_host_port(":1"), Some(("", "1")));
    }
}
