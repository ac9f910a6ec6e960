//! The plain TCP relay (this binary with `--relay-to`): the two-relay floor, and the
//! one relay behind the tunnel that is the load balancer's floor.

use std::net::SocketAddr;

use crate::procs::{spawn_self, Proc};

/// One relay process to `to`: its port and the process.
pub(crate) fn start_relay(to: SocketAddr) -> anyhow::Result<(u16, Proc)> {
    spawn_self("relay", &[format!("--relay-to={to}")])
}

/// Two relay processes in a chain to `target`: the first one's port and both processes.
pub(crate) fn start_relays(target: SocketAddr) -> anyhow::Result<(u16, Vec<Proc>)> {
    let mut procs = Vec::new();
    let mut to = target;
    for _ in 0..2 {
        let (port, relay) = start_relay(to)?;
        procs.push(relay);
        to = SocketAddr::from(([127, 0, 0, 1], port));
    }
    Ok((to.port(), procs))
}

/// A plain TCP relay on one thread: 128 KiB reads each way, nothing else.
pub(crate) async fn relay(to: SocketAddr) -> anyhow::Result<()> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("{}", l.local_addr()?.port());
    loop {
        let (mut a, _) = l.accept().await?;
        tokio::spawn(async move {
            let Ok(mut b) = tokio::net::TcpStream::connect(to).await else {
                return;
            };
            let _ = (a.set_nodelay(true), b.set_nodelay(true));
            let _ = tokio::io::copy_bidirectional_with_sizes(&mut a, &mut b, 128 << 10, 128 << 10)
                .await;
        });
    }
}
