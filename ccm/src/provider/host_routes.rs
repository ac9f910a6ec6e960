//! Pod-network routes in the Linux routing table of the host the CCM runs on, over
//! rtnetlink: one route per node podCIDR via the node's InternalIP. Our routes carry a
//! routing protocol number of their own (`proto 84` unless configured otherwise), so
//! listing and deleting never touch a route someone else made.

use std::net::IpAddr;

use async_trait::async_trait;
use futures::TryStreamExt;
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteType,
};
use rtnetlink::RouteMessageBuilder;
use serde::Deserialize;

use crate::cloud::{CloudError, Route, Routes};

/// The routing protocol number our routes carry by default (`ip route ... proto 84`).
pub const DEFAULT_PROTOCOL: u8 = 84;
/// The main routing table.
pub const MAIN_TABLE: u32 = 254;

/// `routes:` in the tether provider's cloud config.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HostRoutesConfig {
    /// Routing table (254, main, by default).
    #[serde(default = "main_table")]
    pub table: u32,
    /// Routing protocol number marking our routes (84 by default).
    #[serde(default = "default_protocol")]
    pub protocol: u8,
}

fn main_table() -> u32 {
    MAIN_TABLE
}

fn default_protocol() -> u8 {
    DEFAULT_PROTOCOL
}

impl Default for HostRoutesConfig {
    fn default() -> Self {
        HostRoutesConfig {
            table: MAIN_TABLE,
            protocol: DEFAULT_PROTOCOL,
        }
    }
}

/// Routes in the host's routing table.
pub struct HostRoutes {
    config: HostRoutesConfig,
    netlink: crate::netlink::Netlink,
}

impl HostRoutes {
    /// Routes in `config.table`, marked with `config.protocol`.
    pub fn new(config: HostRoutesConfig) -> Self {
        HostRoutes {
            config,
            netlink: Default::default(),
        }
    }

    fn message(&self, route: &Route) -> Result<RouteMessage, CloudError> {
        let cidr: tether_core::identifiers::Cidr = route
            .cidr
            .parse()
            .map_err(|e| CloudError::Provider(format!("pod CIDR {:?}: {e}", route.cidr)))?;
        let via: IpAddr = route.via.parse().map_err(|_| {
            CloudError::Provider(format!(
                "node {} has no usable address for a route: {:?} is not an IP address",
                route.node, route.via
            ))
        })?;
        let invalid = |e: String| {
            CloudError::Provider(format!("route {} via {}: {e}", route.cidr, route.via))
        };
        Ok(RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(cidr.network(), cidr.prefix())
            .map_err(|e| invalid(e.to_string()))?
            .gateway(via)
            .map_err(|e| invalid(e.to_string()))?
            .table_id(self.config.table)
            .protocol(RouteProtocol::from(self.config.protocol))
            .build())
    }

    /// Reads a dumped route back, if it is one of ours.
    fn ours(&self, msg: &RouteMessage) -> Option<Route> {
        let table = msg
            .attributes
            .iter()
            .find_map(|a| match a {
                RouteAttribute::Table(t) => Some(*t),
                _ => None,
            })
            .unwrap_or(msg.header.table as u32);
        if table != self.config.table
            || msg.header.protocol != RouteProtocol::from(self.config.protocol)
            || msg.header.kind != RouteType::Unicast
        {
            return None;
        }
        let ip = |a: &RouteAddress| match a {
            RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
            RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
            _ => None,
        };
        let mut dest = None;
        let mut via = None;
        for a in &msg.attributes {
            match a {
                RouteAttribute::Destination(d) => dest = ip(d),
                RouteAttribute::Gateway(g) => via = ip(g),
                _ => {}
            }
        }
        Some(Route {
            node: String::new(),
            via: via?.to_string(),
            cidr: format!("{}/{}", dest?, msg.header.destination_prefix_length),
        })
    }
}

#[async_trait]
impl Routes for HostRoutes {
    async fn list(&self, _cluster: &str) -> Result<Vec<Route>, CloudError> {
        let handle = self.netlink.handle().await?;
        let mut out = Vec::new();
        for query in [
            RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
            RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
        ] {
            let mut dump = handle.route().get(query).execute();
            loop {
                match dump.try_next().await {
                    Ok(Some(msg)) => out.extend(self.ours(&msg)),
                    Ok(None) => break,
                    Err(e) => {
                        return Err(self.netlink.failed("cannot list routes".into(), &e).await);
                    }
                }
            }
        }
        out.sort();
        Ok(out)
    }

    async fn create(&self, _cluster: &str, route: &Route) -> Result<(), CloudError> {
        let msg = self.message(route)?;
        let handle = self.netlink.handle().await?;
        // Replace: a route to the same CIDR (say, via the node's old address) is
        // swapped atomically, never left missing.
        if let Err(e) = handle.route().add(msg).replace().execute().await {
            return Err(self
                .netlink
                .failed(
                    format!("cannot add route {} via {}", route.cidr, route.via),
                    &e,
                )
                .await);
        }
        Ok(())
    }

    async fn delete(&self, _cluster: &str, route: &Route) -> Result<(), CloudError> {
        let msg = self.message(route)?;
        let handle = self.netlink.handle().await?;
        match handle.route().del(msg).execute().await {
            Ok(()) => Ok(()),
            // Already gone (ESRCH).
            Err(e) if crate::netlink::errno(&e) == Some(libc::ESRCH) => Ok(()),
            Err(e) => Err(self
                .netlink
                .failed(
                    format!("cannot delete route {} via {}", route.cidr, route.via),
                    &e,
                )
                .await),
        }
    }
}
