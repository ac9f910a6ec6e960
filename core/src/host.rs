//! Dial hosts as the server routes by them. The server picks the agent for a dial by its
//! host, and the agent hands the same text to its resolver: glibc's `getaddrinfo` (our
//! agent, and upstream's built with cgo) reads `0177.0.0.2`, `127.2`, `2130706434` and
//! `0x7f000002` all as 127.0.0.2 (`inet_aton`), while Go's own parser refuses them and
//! older parsers read `010.244.2.5` as 10.244.2.5 where glibc reads 8.244.2.5. No
//! spelling may take a node's dial past the server's checks, so an IPv4 host must be
//! the canonical dotted quad: any other numeric spelling is refused, as is a host that
//! looks numeric but is no address or holds a character no host name has. A name loses
//! its trailing dots and its case; an IPv6 literal its brackets and zone, and an
//! IPv4-mapped one is its IPv4 address. kube-apiserver only ever sends canonical
//! spellings.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// How an agent's refusal of a dial by its dial policy begins (the DIAL_RSP error):
/// the agent writes it, the server's audit tells such refusals apart by it.
pub const POLICY_REFUSAL: &str = "dial refused by the agent's dial policy:";

/// A dial host, canonical: what the server routes by.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum DialHost {
    /// An address: IPv4-mapped IPv6 as IPv4, a zone dropped.
    Ip(IpAddr),
    /// A name: lower case, without trailing dots.
    Name(String),
}

impl std::fmt::Display for DialHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DialHost::Ip(ip) => ip.fmt(f),
            DialHost::Name(n) => f.write_str(n),
        }
    }
}

/// Why a dial host was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// Nothing left once brackets and trailing dots are gone.
    #[error("the dial host is empty")]
    Empty,
    /// A character no host name or address has (a space, a slash, a control character).
    #[error("the dial host {0:?} holds a character no host name has")]
    Character(String),
    /// Numeric, but no address (`127.0.0.256`, `1.2.3.4.5`, `08.1.1.1`).
    #[error("the dial host {0:?} looks like an address but is none")]
    Numeric(String),
    /// An empty label (`a..b`).
    #[error("the dial host {0:?} has an empty label")]
    EmptyLabel(String),
    /// Not `host:port` with an IPv6 host in brackets.
    #[error(
        "the dial address {0:?} is not host:port (an IPv6 address goes in brackets: [fd00::1]:443)"
    )]
    Address(String),
    /// An IPv4 address spelled other than as a dotted quad of decimals (octal, hex, fewer
    /// parts, leading zeros, a trailing dot): resolvers disagree on what it is.
    #[error("the dial host {host:?} is {ip} spelled unusually; resolvers disagree on such spellings, so dial {ip}")]
    NonCanonical {
        /// As given.
        host: String,
        /// What glibc reads it as.
        ip: Ipv4Addr,
    },
}

impl DialHost {
    /// Reads the host part of a dial address (brackets allowed).
    pub fn parse(host: &str) -> Result<DialHost, HostError> {
        let inner = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        // An IPv6 literal, with a zone (`fe80::1%eth0`) or not.
        let unzoned = inner.split_once('%').map_or(inner, |(a, _)| a);
        if let Ok(v6) = unzoned.parse::<Ipv6Addr>() {
            return Ok(DialHost::Ip(match v6.to_ipv4_mapped() {
                Some(v4) => IpAddr::V4(v4),
                None => IpAddr::V6(v6),
            }));
        }
        let name = inner.trim_end_matches('.');
        if name.is_empty() {
            return Err(HostError::Empty);
        }
        if !name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'))
        {
            return Err(HostError::Character(host.to_string()));
        }
        if let Some(v4) = inet_aton(name) {
            if v4.to_string() == inner {
                return Ok(DialHost::Ip(IpAddr::V4(v4)));
            }
            return Err(HostError::NonCanonical {
                host: host.to_string(),
                ip: v4,
            });
        }
        if name.split('.').any(str::is_empty) {
            return Err(HostError::EmptyLabel(host.to_string()));
        }
        let last = name.rsplit('.').next().unwrap_or(name);
        if looks_numeric(last) {
            return Err(HostError::Numeric(host.to_string()));
        }
        Ok(DialHost::Name(name.to_ascii_lowercase()))
    }

    /// Reads a dial address strictly: `host:port`, an IPv6 host in brackets
    /// (`[fd00::2]:443`), the port a number from 1 to 65535. Anything else is refused:
    /// `fd00::2:443` is one address to the server and another (`fd00::2`, port 443) to an
    /// agent that splits at the last colon. kube-apiserver writes addresses this way.
    pub fn parse_address(address: &str) -> Result<(DialHost, u16), HostError> {
        let bad = || HostError::Address(address.to_string());
        let (host, port) = match address.strip_prefix('[') {
            Some(rest) => {
                let (host, after) = rest.split_once(']').ok_or_else(bad)?;
                if host.parse::<Ipv6Addr>().is_err() && host.split_once('%').is_none() {
                    return Err(bad());
                }
                (host, after.strip_prefix(':').ok_or_else(bad)?)
            }
            None => {
                let (host, port) = address.rsplit_once(':').ok_or_else(bad)?;
                if host.contains(':') {
                    return Err(bad());
                }
                (host, port)
            }
        };
        let port: u16 = match port.parse() {
            Ok(p) if p > 0 && port.bytes().all(|b| b.is_ascii_digit()) => p,
            _ => return Err(bad()),
        };
        Ok((DialHost::parse(host)?, port))
    }

    /// The address, if it is one.
    pub fn ip(&self) -> Option<IpAddr> {
        match self {
            DialHost::Ip(ip) => Some(*ip),
            DialHost::Name(_) => None,
        }
    }
}

/// A label a resolver would take for a number: all digits, or `0x` and hex digits. No
/// top-level domain looks like that (RFC 3696 section 2).
fn looks_numeric(label: &str) -> bool {
    let hex = label
        .strip_prefix("0x")
        .or_else(|| label.strip_prefix("0X"));
    match hex {
        Some(digits) => digits.bytes().all(|b| b.is_ascii_hexdigit()),
        None => !label.is_empty() && label.bytes().all(|b| b.is_ascii_digit()),
    }
}

/// glibc's `inet_aton`: one to four parts, each decimal, octal (a leading 0) or hex
/// (`0x`); the last part fills the bytes the others leave. (glibc also stops at a space
/// and ignores what follows; [`DialHost::parse`] has refused spaces before this.)
pub fn inet_aton(s: &str) -> Option<Ipv4Addr> {
    let mut parts = [0u64; 4];
    let mut n = 0;
    for part in s.split('.') {
        if n == 4 {
            return None;
        }
        parts[n] = aton_part(part)?;
        n += 1;
    }
    let (head, last) = (&parts[..n - 1], parts[n - 1]);
    if head.iter().any(|&p| p > 0xff) {
        return None;
    }
    let room = 8 * (4 - head.len() as u32);
    if room < 64 && last >> room != 0 {
        return None;
    }
    let mut value = last as u32;
    for (i, &p) in head.iter().enumerate() {
        value |= (p as u32) << (24 - 8 * i as u32);
    }
    Some(Ipv4Addr::from(value))
}

/// One part of an `inet_aton` address: a digit first; `0x` hex (possibly no digits, as
/// glibc takes it), a leading `0` octal, else decimal. Values past 32 bits are refused.
fn aton_part(part: &str) -> Option<u64> {
    let b = part.as_bytes();
    if b.first().is_none_or(|c| !c.is_ascii_digit()) {
        return None;
    }
    let (digits, radix) = if b.len() >= 2 && b[0] == b'0' && (b[1] == b'x' || b[1] == b'X') {
        (&part[2..], 16)
    } else if b[0] == b'0' {
        (&part[1..], 8)
    } else {
        (part, 10)
    };
    let mut v: u64 = 0;
    for c in digits.chars() {
        v = v * radix as u64 + u64::from(c.to_digit(radix)?);
        if v > u64::from(u32::MAX) {
            return None;
        }
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> DialHost {
        DialHost::Ip(s.parse().unwrap())
    }

    #[test]
    fn inet_aton_reads_what_glibc_reads() {
        let v4 = |s: &str| s.parse::<Ipv4Addr>().unwrap();
        for spelled in [
            "127.0.0.2",
            "0177.0.0.2",
            "127.000.000.002",
            "127.2",
            "127.0.2",
            "2130706434",
            "0x7f000002",
            "0X7F.0.0.2",
            "0x7f.0x0.0.02",
        ] {
            assert_eq!(inet_aton(spelled), Some(v4("127.0.0.2")), "{spelled}");
        }
        assert_eq!(inet_aton("010.244.2.5"), Some(v4("8.244.2.5")));
        assert_eq!(inet_aton("0x"), Some(v4("0.0.0.0")));
        for bad in [
            "127.0.0.256",
            "1.2.3.4.5",
            "08.1.1.1",
            "4294967296",
            "1..2",
            "a.1",
            "",
        ] {
            assert_eq!(inet_aton(bad), None, "{bad}");
        }
    }

    #[test]
    fn an_address_is_routed_only_as_its_canonical_spelling() {
        assert_eq!(DialHost::parse("127.0.0.2"), Ok(ip("127.0.0.2")));
        assert_eq!(DialHost::parse("[::ffff:127.0.0.2]"), Ok(ip("127.0.0.2")));
        assert_eq!(DialHost::parse("::ffff:7f00:2"), Ok(ip("127.0.0.2")));
        assert_eq!(DialHost::parse("[fe80::1%eth0]"), Ok(ip("fe80::1")));
        assert_eq!(DialHost::parse("2001:0db8::1"), Ok(ip("2001:db8::1")));
        for spelled in [
            "0177.0.0.2",
            "127.000.000.002",
            "127.2",
            "2130706434",
            "0x7f000002",
            "127.0.0.2.",
            "010.244.2.5",
        ] {
            let e = DialHost::parse(spelled).unwrap_err();
            assert!(
                matches!(e, HostError::NonCanonical { .. }),
                "{spelled}: {e}"
            );
        }
    }

    #[test]
    fn an_address_is_host_colon_port_with_ipv6_in_brackets() {
        let ok = |a: &str| DialHost::parse_address(a).unwrap();
        assert_eq!(ok("127.0.0.2:10250"), (ip("127.0.0.2"), 10250));
        assert_eq!(ok("[::ffff:127.0.0.2]:8080"), (ip("127.0.0.2"), 8080));
        assert_eq!(ok("[fd00::2]:443"), (ip("fd00::2"), 443));
        assert_eq!(ok("node-b.:22"), (DialHost::Name("node-b".into()), 22));
        for bad in [
            "::ffff:7f00:2:8080",
            "fd00::2:443",
            "[fd00::2]443",
            "[fd00::2]:",
            "[node-b]:80",
            "node-b",
            "node-b:0",
            "node-b:65536",
            "node-b:+80",
            "node-b: 80",
        ] {
            assert!(DialHost::parse_address(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names_lose_trailing_dots_and_case() {
        for spelled in ["nodeB", "nodeb.", "NODEB..", "nodeb..."] {
            assert_eq!(
                DialHost::parse(spelled),
                Ok(DialHost::Name("nodeb".into())),
                "{spelled}"
            );
        }
        assert_eq!(
            DialHost::parse("kubernetes.default.svc"),
            Ok(DialHost::Name("kubernetes.default.svc".into()))
        );
        assert_eq!(
            DialHost::parse("1node.example"),
            Ok(DialHost::Name("1node.example".into()))
        );
    }

    #[test]
    fn what_no_resolver_reads_alike_is_refused() {
        for (spelled, why) in [
            ("127.0.0.256", "looks like"),
            ("1.2.3.4.5", "looks like"),
            ("08.1.1.1", "looks like"),
            ("4294967296", "looks like"),
            ("0x1ffffffff", "looks like"),
            ("127.0.0.1 junk", "character"),
            ("node/b", "character"),
            ("a..b", "empty label"),
            ("", "empty"),
            ("...", "empty"),
            ("[]", "empty"),
        ] {
            let e = DialHost::parse(spelled).unwrap_err();
            assert!(e.to_string().contains(why), "{spelled}: {e}");
        }
    }
}
