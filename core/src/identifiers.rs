//! Agent identifiers: the `agentidentifiers` metadata value (a URL query string with
//! keys host, ipv4, ipv6, cidr, default-route) and the address matching the server's
//! proxy strategies use.

use crate::error::chain;
use std::net::IpAddr;

/// What an agent says it can reach, parsed from `agentidentifiers`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentIdentifiers {
    /// Host names (`host=`).
    pub hosts: Vec<String>,
    /// Addresses (`ipv4=`, `ipv6=`).
    pub ips: Vec<IpAddr>,
    /// Networks (`cidr=`) the agent routes to.
    pub cidrs: Vec<Cidr>,
    /// `default-route=true`: the agent can reach anything.
    pub default_route: bool,
}

/// An identifier value that could not be understood.
#[derive(Debug, thiserror::Error)]
#[error("agent identifier {key}={value:?} is invalid: {reason}")]
pub struct IdentifierError {
    key: String,
    value: String,
    reason: String,
}

impl AgentIdentifiers {
    /// Parses the query string. Unknown keys are ignored, as upstream does. With
    /// `strict`, malformed values of known keys are an error (agent start-up);
    /// otherwise they are skipped (server receiving from a peer).
    pub fn parse(query: &str, strict: bool) -> Result<Self, IdentifierError> {
        let mut ids = AgentIdentifiers::default();
        for (key, value) in url::form_urlencoded::parse(query.as_bytes()) {
            let bad = |reason: &str| IdentifierError {
                key: key.to_string(),
                value: value.to_string(),
                reason: reason.to_string(),
            };
            let result = match &*key {
                "host" => {
                    ids.hosts.push(value.to_ascii_lowercase());
                    Ok(())
                }
                "ipv4" | "ipv6" => match value.parse::<IpAddr>() {
                    Ok(ip) if ip.is_ipv4() == (key == "ipv4") => {
                        ids.ips.push(ip);
                        Ok(())
                    }
                    _ if key == "ipv4" => Err(bad("not an IPv4 address")),
                    _ => Err(bad("not an IPv6 address")),
                },
                "cidr" => value
                    .parse::<Cidr>()
                    .map(|c| ids.cidrs.push(c))
                    .map_err(|e| bad(&e)),
                "default-route" => match &*value {
                    "true" => {
                        ids.default_route = true;
                        Ok(())
                    }
                    "false" => Ok(()),
                    _ => Err(bad("expected true or false")),
                },
                _ => Ok(()),
            };
            if let Err(e) = result {
                if strict {
                    return Err(e);
                }
                tracing::warn!(error = %chain(&e), "ignoring malformed agent identifier");
            }
        }
        Ok(ids)
    }

    /// Does `host` (the host part of a dial address) name this agent exactly?
    pub fn matches_host(&self, host: &str) -> bool {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        match host.parse::<IpAddr>() {
            Ok(ip) => self.ips.contains(&ip),
            Err(_) => self.hosts.iter().any(|h| h.eq_ignore_ascii_case(host)),
        }
    }

    /// Is `host` an address inside one of this agent's advertised networks?
    pub fn matches_cidr(&self, host: &str) -> bool {
        let host = host.trim_start_matches('[').trim_end_matches(']');
        match host.parse::<IpAddr>() {
            Ok(ip) => self.cidrs.iter().any(|c| c.contains(ip)),
            Err(_) => false,
        }
    }
}

/// Splits `host:port` (or `[v6]:port`) and returns the host part.
pub fn dial_host(address: &str) -> &str {
    if let Some(rest) = address.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match address.rsplit_once(':') {
        Some((host, _)) if !host.contains(':') => host,
        _ => address,
    }
}

/// An IP network such as `10.0.0.0/8` or `fd00::/64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix: u8,
}

impl Cidr {
    /// The network address (host bits cleared).
    pub fn network(&self) -> IpAddr {
        match self.addr {
            IpAddr::V4(a) => {
                let mask = u32::MAX.checked_shl(32 - self.prefix as u32).unwrap_or(0);
                IpAddr::V4((u32::from(a) & mask).into())
            }
            IpAddr::V6(a) => {
                let mask = u128::MAX.checked_shl(128 - self.prefix as u32).unwrap_or(0);
                IpAddr::V6((u128::from(a) & mask).into())
            }
        }
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// This network with its host bits cleared (`10.1.2.3/16` -> `10.1.0.0/16`).
    pub fn normalized(&self) -> Cidr {
        Cidr {
            addr: self.network(),
            prefix: self.prefix,
        }
    }

    /// Is all of `other` inside this network?
    pub fn covers(&self, other: &Cidr) -> bool {
        other.prefix >= self.prefix && self.contains(other.addr)
    }

    /// Is `ip` inside this network?
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX.checked_shl(32 - self.prefix as u32).unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX.checked_shl(128 - self.prefix as u32).unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

impl std::str::FromStr for Cidr {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (addr, prefix) = s
            .split_once('/')
            .ok_or_else(|| "expected ADDRESS/PREFIX, e.g. 10.0.0.0/8".to_string())?;
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{addr:?} is not an IP address"))?;
        let prefix: u8 = prefix
            .parse()
            .map_err(|_| format!("{prefix:?} is not a prefix length"))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(format!("prefix /{prefix} is longer than {max}"));
        }
        Ok(Cidr { addr, prefix })
    }
}

impl std::fmt::Display for Cidr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_identifiers() {
        let ids = AgentIdentifiers::parse(
            "host=node-1&ipv4=10.0.0.5&ipv6=fd00::5&cidr=10.1.0.0/16&default-route=true&zone=x",
            true,
        )
        .unwrap();
        assert_eq!(ids.hosts, vec!["node-1"]);
        assert_eq!(ids.ips.len(), 2);
        assert!(ids.default_route);
        assert!(ids.matches_host("node-1"));
        assert!(ids.matches_host("10.0.0.5"));
        assert!(ids.matches_host("[fd00::5]"));
        assert!(!ids.matches_host("10.0.0.6"));
        let net: Cidr = "10.244.0.0/16".parse().unwrap();
        let pod: Cidr = "10.244.3.7/24".parse().unwrap();
        assert!(net.covers(&pod) && !pod.covers(&net));
        assert_eq!(pod.normalized().to_string(), "10.244.3.0/24");
        assert!(!net.covers(&"10.245.0.0/24".parse().unwrap()));
        assert!(ids.matches_cidr("10.1.200.3"));
        assert!(!ids.matches_cidr("10.2.0.1"));
        assert!(AgentIdentifiers::parse("ipv4=nope", true).is_err());
        assert!(AgentIdentifiers::parse("ipv4=nope", false)
            .unwrap()
            .ips
            .is_empty());
    }

    #[test]
    fn splits_dial_hosts() {
        assert_eq!(dial_host("10.0.0.1:10250"), "10.0.0.1");
        assert_eq!(dial_host("node-1:10250"), "node-1");
        assert_eq!(dial_host("[fd00::1]:443"), "fd00::1");
        assert_eq!(dial_host("node-1"), "node-1");
    }

    #[test]
    fn cidr_edges() {
        let c: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(c.contains("1.2.3.4".parse().unwrap()));
        let c: Cidr = "10.0.0.1/32".parse().unwrap();
        assert!(c.contains("10.0.0.1".parse().unwrap()));
        assert!(!c.contains("10.0.0.2".parse().unwrap()));
        assert!("10.0.0.0/33".parse::<Cidr>().is_err());
    }
}
