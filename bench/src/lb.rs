//! The CCM load-balancer route: one Service's tunnel balancer, the CCM's own code run
//! in this binary as a process of its own (`--lb-to`), in front of the gRPC frontend.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use tether_ccm::cloud::{Backend, LoadBalancers, ServiceInfo, ServicePort};
use tether_ccm::lb::balancer as tunnel_lb;

use crate::procs::{free_port, spawn_self, Proc};

/// Starts this binary as one CCM load balancer in front of `target` (its "NodePort")
/// over the gRPC frontend at `uds`; returns the Service port.
pub(crate) fn start_load_balancer(target: SocketAddr, uds: &Path) -> anyhow::Result<(u16, Proc)> {
    spawn_self(
        "load balancer",
        &[
            format!("--lb-to={target}"),
            format!("--lb-tunnel-uds={}", uds.display()),
        ],
    )
}

/// The CCM's tunnel load balancer for one Service (port: a free one; one node at
/// `to`'s address with `to`'s port as its NodePort), as `tether ccm` runs it.
pub(crate) async fn load_balancer(to: SocketAddr, uds: PathBuf) -> anyhow::Result<()> {
    let lbs = tunnel_lb::TunnelLoadBalancers::new(
        tunnel_lb::TunnelLbConfig {
            bind: Some(std::net::Ipv4Addr::LOCALHOST.into()),
            tunnel_uds: uds,
            max_connections: tunnel_lb::DEFAULT_MAX_CONNECTIONS,
            metrics: Default::default(),
            record: None,
        },
        None,
    )
    .map_err(anyhow::Error::msg)?;
    let port = free_port();
    let svc = service(port, to.port());
    let node = Backend {
        name: "backend".into(),
        address: to.ip().to_string(),
        addresses: vec![to.ip().to_string()],
    };
    // Assigned (as the leader's service controller does), then served (as the pool's
    // holder does).
    let status = lbs
        .allocations()
        .ensure("bench", &svc, std::slice::from_ref(&node))
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    for pool in lbs.allocations().pool_names() {
        lbs.resume_pool(&pool).await;
    }
    let addresses: Vec<std::net::IpAddr> =
        status.ips.iter().filter_map(|ip| ip.parse().ok()).collect();
    lbs.serve(&svc, &[node], &addresses)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    println!("{port}");
    std::future::pending::<()>().await;
    Ok(())
}

/// The benched Service: one TCP `port` forwarded to `node_port` on its node.
fn service(port: u16, node_port: u16) -> ServiceInfo {
    ServiceInfo {
        namespace: "bench".into(),
        name: "lb".into(),
        uid: "bench-lb".into(),
        ports: vec![ServicePort {
            name: "tcp".into(),
            protocol: "TCP".into(),
            port,
            node_port,
            endpoints: Vec::new(),
        }],
        max_connections: 1 << 20,
        idle_timeout: tether_ccm::cloud::DEFAULT_IDLE_TIMEOUT,
        families: vec!["IPv4".into()],
        node_ports: true,
        ..Default::default()
    }
}
