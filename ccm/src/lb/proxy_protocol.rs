//! The PROXY protocol (v1 text, v2 binary) header a balancer sends a backend first,
//! so that it learns the client's address.

use std::net::{IpAddr, SocketAddr};

use crate::cloud::ProxyProtocol;

/// `ip`, or the IPv4 address an IPv4-mapped IPv6 `ip` carries.
pub fn unmapped(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

/// The PROXY protocol header telling a backend that `client` connected to `local`
/// (v1: the text line; v2: the binary form). IPv4-mapped addresses count as IPv4.
pub fn header(version: ProxyProtocol, client: SocketAddr, local: SocketAddr) -> Vec<u8> {
    let (src, dst) = (unmapped(client.ip()), unmapped(local.ip()));
    // Mixed families (cannot happen on one socket, but be safe): as IPv6.
    let (src, dst) = match (src, dst) {
        (IpAddr::V4(s), IpAddr::V6(d)) => (IpAddr::V6(s.to_ipv6_mapped()), IpAddr::V6(d)),
        (IpAddr::V6(s), IpAddr::V4(d)) => (IpAddr::V6(s), IpAddr::V6(d.to_ipv6_mapped())),
        other => other,
    };
    match version {
        ProxyProtocol::V1 => {
            let family = if src.is_ipv4() { "TCP4" } else { "TCP6" };
            format!(
                "PROXY {family} {src} {dst} {} {}\r\n",
                client.port(),
                local.port()
            )
            .into_bytes()
        }
        ProxyProtocol::V2 => {
            let mut h = b"\r\n\r\n\0\r\nQUIT\n".to_vec();
            // Version 2, PROXY command.
            h.push(0x21);
            let addresses: Vec<u8> = match (src, dst) {
                (IpAddr::V4(s), IpAddr::V4(d)) => {
                    h.push(0x11); // TCP over IPv4
                    [&s.octets()[..], &d.octets()[..]].concat()
                }
                (IpAddr::V6(s), IpAddr::V6(d)) => {
                    h.push(0x21); // TCP over IPv6
                    [&s.octets()[..], &d.octets()[..]].concat()
                }
                _ => unreachable!("families made equal above"),
            };
            h.extend(((addresses.len() + 4) as u16).to_be_bytes());
            h.extend(addresses);
            h.extend(client.port().to_be_bytes());
            h.extend(local.port().to_be_bytes());
            h
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_headers_follow_the_spec() {
        let client: SocketAddr = "192.0.2.7:51000".parse().unwrap();
        let local: SocketAddr = "[::ffff:198.51.100.1]:443".parse().unwrap();
        assert_eq!(
            header(ProxyProtocol::V1, client, local),
            b"PROXY TCP4 192.0.2.7 198.51.100.1 51000 443\r\n"
        );
        let v2 = header(ProxyProtocol::V2, client, local);
        assert_eq!(&v2[..12], b"\r\n\r\n\0\r\nQUIT\n");
        assert_eq!(&v2[12..16], &[0x21, 0x11, 0, 12]);
        assert_eq!(&v2[16..20], &[192, 0, 2, 7]);
        assert_eq!(&v2[24..28], &[0xc7, 0x38, 0x01, 0xbb]);
        let six = header(
            ProxyProtocol::V1,
            "[2001:db8::7]:1".parse().unwrap(),
            "[2001:db8::1]:2".parse().unwrap(),
        );
        assert_eq!(six, b"PROXY TCP6 2001:db8::7 2001:db8::1 1 2\r\n");
        let six2 = header(
            ProxyProtocol::V2,
            "[2001:db8::7]:1".parse().unwrap(),
            "[2001:db8::1]:2".parse().unwrap(),
        );
        assert_eq!(&six2[13..16], &[0x21, 0, 36]);
        assert_eq!(six2.len(), 16 + 36);
    }
}
