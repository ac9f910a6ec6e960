//! `--dial-allow` rules as an operator writes them: a network or address, this node's
//! own addresses (`node`), or a host name (exact, or `*.` and a suffix), each with an
//! optional port or port range.

use std::net::IpAddr;
use std::ops::RangeInclusive;

use tether_core::identifiers::Cidr;

/// What a rule allows dials to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Addresses in this network.
    Net(Cidr),
    /// This node's own addresses (`node`).
    Node,
    /// A host name as the dial names it: exact, or `*.suffix` for any name under it.
    Name(String),
}

/// One `--dial-allow` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allow {
    /// Where to.
    pub target: Target,
    /// Which ports; `None` is every port.
    pub ports: Option<RangeInclusive<u16>>,
}

/// Why a `--dial-allow` entry does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--dial-allow {entry:?}: {why} (e.g. 10.20.0.0/16, 192.168.1.5:22, [fd00::/64]:443, node:9100, registry.example.com:443, *.example.com:8000-8100)")]
pub struct RuleError {
    entry: String,
    why: String,
}

impl Allow {
    /// Reads one entry.
    pub fn parse(entry: &str) -> Result<Allow, RuleError> {
        let err = |why: &str| RuleError {
            entry: entry.to_string(),
            why: why.to_string(),
        };
        let entry = entry.trim();
        // `[v6 or v6/len]:ports`, `v6/len` or `v6` (every port), `x:ports` or `x`.
        let (target, ports) = if let Some(rest) = entry.strip_prefix('[') {
            let (inner, after) = rest.split_once(']').ok_or_else(|| err("missing ']'"))?;
            let ports = match after {
                "" => None,
                p => Some(
                    p.strip_prefix(':')
                        .ok_or_else(|| err("expected :PORT after ']'"))?,
                ),
            };
            (inner, ports)
        } else if entry.matches(':').count() > 1 {
            (entry, None)
        } else {
            match entry.split_once(':') {
                Some((t, p)) => (t, Some(p)),
                None => (entry, None),
            }
        };
        let ports = match ports {
            None => None,
            Some(p) => Some(
                parse_ports(p)
                    .ok_or_else(|| err("the port is not PORT or LOW-HIGH within 1-65535"))?,
            ),
        };
        if target == "node" && ports.is_none() {
            return Err(err(
                "`node` needs a port: its addresses' kubelet port is allowed already",
            ));
        }
        let target = parse_target(target).map_err(|why| err(&why))?;
        Ok(Allow { target, ports })
    }

    /// Does this rule cover `port`?
    pub fn covers_port(&self, port: u16) -> bool {
        self.ports.as_ref().is_none_or(|r| r.contains(&port))
    }
}

impl std::fmt::Display for Allow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.target {
            Target::Net(n) if n.network().is_ipv6() && self.ports.is_some() => write!(f, "[{n}]")?,
            Target::Net(n) => write!(f, "{n}")?,
            Target::Node => f.write_str("node")?,
            Target::Name(n) => f.write_str(n)?,
        }
        match &self.ports {
            Some(r) if r.start() == r.end() => write!(f, ":{}", r.start()),
            Some(r) => write!(f, ":{}-{}", r.start(), r.end()),
            None => Ok(()),
        }
    }
}

/// Does `name` (a dial's host, lower case) match the rule name `pattern`?
pub fn name_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_prefix("*.") {
        Some(suffix) => name
            .strip_suffix(suffix)
            .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
        None => pattern == name,
    }
}

/// The part before the ports: `node`, a network, an address or a host name.
fn parse_target(target: &str) -> Result<Target, String> {
    if target == "node" {
        return Ok(Target::Node);
    }
    if let Some((addr, len)) = target.split_once('/') {
        // `::ffff:10.0.0.0/104` is 10.0.0.0/8: a dial's mapped address is judged as IPv4.
        if let (Ok(IpAddr::V6(v6)), Ok(len)) = (addr.parse::<IpAddr>(), len.parse::<u8>()) {
            if let (Some(v4), true) = (v6.to_ipv4_mapped(), (96..=128).contains(&len)) {
                return Ok(Target::Net(
                    format!("{v4}/{}", len - 96).parse::<Cidr>()?.normalized(),
                ));
            }
        }
        return Ok(Target::Net(target.parse::<Cidr>()?.normalized()));
    }
    if let Ok(ip) = target.parse::<IpAddr>() {
        let ip = canonical(ip);
        let prefix = if ip.is_ipv4() { 32 } else { 128 };
        return Ok(Target::Net(format!("{ip}/{prefix}").parse()?));
    }
    let name = target.trim_end_matches('.').to_ascii_lowercase();
    let bare = name.strip_prefix("*.").unwrap_or(&name);
    let valid = !bare.is_empty()
        && bare.split('.').all(|l| {
            !l.is_empty()
                && l.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
    match valid {
        true => Ok(Target::Name(name)),
        false => Err("not a network, an address, `node` or a host name".into()),
    }
}

/// `PORT` or `LOW-HIGH`, 1 to 65535.
fn parse_ports(p: &str) -> Option<RangeInclusive<u16>> {
    let one = |s: &str| match s.parse::<u16>() {
        Ok(n) if n > 0 && s.bytes().all(|b| b.is_ascii_digit()) => Some(n),
        _ => None,
    };
    let (lo, hi) = match p.split_once('-') {
        Some((lo, hi)) => (one(lo)?, one(hi)?),
        None => (one(p)?, one(p)?),
    };
    (lo <= hi).then_some(lo..=hi)
}

/// The reserved range `ip` is in, if any: loopback, unspecified ("this host"),
/// link-local (cloud metadata servers), multicast and broadcast. Only a rule that names
/// such a range, or a part of it, reaches it.
pub fn special(ip: IpAddr) -> Option<Cidr> {
    const RANGES: [&str; 9] = [
        "0.0.0.0/8",
        "127.0.0.0/8",
        "169.254.0.0/16",
        "224.0.0.0/4",
        "255.255.255.255/32",
        "::/128",
        "::1/128",
        "fe80::/10",
        "ff00::/8",
    ];
    RANGES
        .iter()
        .map(|r| r.parse::<Cidr>().expect("a valid range"))
        .find(|r| r.contains(canonical(ip)))
}

/// An IPv4-mapped IPv6 address as IPv4; anything else as it is.
pub fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Target {
        Target::Net(s.parse().unwrap())
    }

    #[test]
    fn reads_every_form_an_operator_writes() {
        let cases: &[(&str, Target, Option<RangeInclusive<u16>>)] = &[
            ("10.20.0.0/16", net("10.20.0.0/16"), None),
            ("10.20.3.4/16", net("10.20.0.0/16"), None),
            ("192.168.1.5:22", net("192.168.1.5/32"), Some(22..=22)),
            ("10.0.0.0/8:8000-8100", net("10.0.0.0/8"), Some(8000..=8100)),
            ("fd00::/64", net("fd00::/64"), None),
            ("fd00::5", net("fd00::5/128"), None),
            ("[fd00::/64]:443", net("fd00::/64"), Some(443..=443)),
            ("[fd00::5]:22", net("fd00::5/128"), Some(22..=22)),
            ("[::ffff:10.1.2.3]:80", net("10.1.2.3/32"), Some(80..=80)),
            ("::ffff:10.0.0.0/104", net("10.0.0.0/8"), None),
            ("node:9100", Target::Node, Some(9100..=9100)),
            ("node:9100-9200", Target::Node, Some(9100..=9200)),
            (
                "Registry.Example.com.:443",
                Target::Name("registry.example.com".into()),
                Some(443..=443),
            ),
            ("*.example.com", Target::Name("*.example.com".into()), None),
        ];
        for (entry, target, ports) in cases {
            let a = Allow::parse(entry).unwrap_or_else(|e| panic!("{entry}: {e}"));
            assert_eq!((&a.target, &a.ports), (target, ports), "{entry}");
            // What it prints reads back the same.
            assert_eq!(Allow::parse(&a.to_string()).unwrap(), a, "{entry} -> {a}");
        }
    }

    #[test]
    fn refuses_what_it_cannot_read_with_the_fix() {
        for entry in [
            "",
            "node",
            "10.0.0.0/33",
            "10.0.0.0/8:0",
            "10.0.0.0/8:70000",
            "10.0.0.0/8:443-80",
            "[fd00::/64",
            "[fd00::]443",
            "a b",
            "*.",
            "host:http",
            "10.0.0.0/8:1-",
        ] {
            let e = Allow::parse(entry).expect_err(entry).to_string();
            assert!(
                e.starts_with("--dial-allow") && e.contains("e.g."),
                "{entry}: {e}"
            );
        }
    }

    #[test]
    fn a_wildcard_matches_names_under_it_only() {
        assert!(name_matches("*.example.com", "a.example.com"));
        assert!(name_matches("*.example.com", "a.b.example.com"));
        assert!(!name_matches("*.example.com", "example.com"));
        assert!(!name_matches("*.example.com", "badexample.com"));
        assert!(name_matches("x.example.com", "x.example.com"));
        assert!(!name_matches("x.example.com", "y.x.example.com"));
    }
}
