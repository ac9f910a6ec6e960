//! The network namespace the load-balancer addresses live in, apart from the host's.
//!
//! A thread of the CCM's own calls `unshare(CLONE_NEWNET)`; a macvlan device on the
//! configured interface is created straight into that namespace, with the
//! interface's on-link prefixes and default routes copied, and the addresses go on
//! it. Nothing pins the namespace (no bind mount, no file outside the process), so:
//!
//! - host daemons' wildcard listeners (kube-apiserver, kubelet, sshd, ...) never see
//!   traffic for an address, and no balancer's listener blocks a host port;
//! - when the process ends, however it ends (SIGKILL, OOM, eviction), the kernel
//!   destroys the namespace and the macvlan in it, and the addresses stop answering
//!   at once: no stale address for a successor to find;
//! - the host's own addresses are never touched: clean-up is of our namespace only.
//!
//! Sockets that must be in the namespace (the listeners, the announcing raw socket,
//! the namespace's netlink socket) are made on its thread ([`LbNamespace::run`]); a
//! socket stays in the namespace it was made in, whichever thread uses it later.
//! Creating the namespace needs CAP_SYS_ADMIN; the device and routes CAP_NET_ADMIN.

use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Mutex;
use tether_core::error::chain;

use futures::TryStreamExt;
use rtnetlink::packet_route::address::AddressAttribute;
use rtnetlink::packet_route::link::{LinkAttribute, LinkFlags, MacVlanMode};
use rtnetlink::packet_route::route::{RouteAttribute, RouteMessage, RouteScope};
use rtnetlink::{LinkMacVlan, LinkUnspec, RouteMessageBuilder};

use crate::cloud::CloudError;
use crate::netlink::{errno, Netlink};

/// The macvlan device's name inside the namespace.
pub const DEVICE: &str = "tether-lb";

type Job = Box<dyn FnOnce() + Send>;

/// The device holding the addresses: its index inside the namespace and its MAC.
#[derive(Debug, Clone, Copy)]
pub struct Device {
    pub index: u32,
    pub mac: [u8; 6],
}

/// The load balancers' namespace and its device on `parent`.
pub struct LbNamespace {
    parent: String,
    jobs: Mutex<std::sync::mpsc::Sender<Job>>,
    /// `/proc/thread-self/ns/net` of the namespace thread (what the device is created
    /// into).
    ns: OwnedFd,
    /// The host's netlink (the parent interface, its prefixes and routes).
    host: Netlink,
    /// A netlink connection made inside the namespace (on first use).
    inside: tokio::sync::OnceCell<rtnetlink::Handle>,
    /// Serializes device set-up.
    setup: tokio::sync::Mutex<()>,
}

impl LbNamespace {
    /// Creates the namespace (its device comes on first use, see [`Self::device`]).
    /// Fails with a line that says which privilege is missing.
    pub fn create(parent: &str) -> Result<LbNamespace, String> {
        let (jobs, rx) = std::sync::mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("tether-lb-netns".into())
            .spawn(move || {
                let _ = ready_tx.send(enter_new_namespace());
                // Jobs until the namespace's owner drops the sender.
                for job in rx {
                    job();
                }
            })
            .map_err(|e| format!("cannot start the load-balancer namespace thread: {e}"))?;
        let ns = ready_rx
            .recv()
            .map_err(|_| "the load-balancer namespace thread ended".to_string())?
            .map_err(|e| {
                format!(
                    "cannot create the load balancers' network namespace: {e}{}",
                    if e.raw_os_error() == Some(libc::EPERM) {
                        " (with loadBalancer.interface set, the CCM needs CAP_SYS_ADMIN: see deploy/README.md)"
                    } else {
                        ""
                    }
                )
            })?;
        Ok(LbNamespace {
            parent: parent.to_string(),
            jobs: Mutex::new(jobs),
            ns,
            host: Netlink::default(),
            inside: Default::default(),
            setup: Default::default(),
        })
    }

    /// The host interface the device sits on.
    pub fn parent(&self) -> &str {
        &self.parent
    }

    /// Runs `f` on the namespace's thread (inside the caller's runtime context, so
    /// that it may make tokio sockets) and returns its result.
    pub async fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let rt = tokio::runtime::Handle::current();
        let job: Job = Box::new(move || {
            let _entered = rt.enter();
            let _ = tx.send(f());
        });
        self.jobs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(job)
            .expect("the load-balancer namespace thread lives as long as its owner");
        rx.await
            .expect("the load-balancer namespace thread runs every job")
    }

    /// A TCP listener on `addr` inside the namespace. `IP_FREEBIND`: the address may
    /// be added after the bind.
    pub async fn listen(&self, addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
        let std = self
            .run(move || -> std::io::Result<std::net::TcpListener> {
                use socket2::{Domain, Socket, Type};
                let s = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
                if addr.is_ipv6() {
                    s.set_only_v6(true)?;
                    s.set_freebind_v6(true)?;
                } else {
                    s.set_freebind_v4(true)?;
                }
                s.set_reuse_address(true)?;
                s.set_nonblocking(true)?;
                s.bind(&addr.into())?;
                s.listen(1024)?;
                Ok(s.into())
            })
            .await?;
        tokio::net::TcpListener::from_std(std)
    }

    /// The namespace's netlink connection.
    pub async fn netlink(&self) -> Result<rtnetlink::Handle, CloudError> {
        self.inside
            .get_or_try_init(|| async {
                self.run(|| {
                    rtnetlink::new_connection().map(|(conn, handle, _)| {
                        tokio::spawn(conn);
                        handle
                    })
                })
                .await
                .map_err(|e| {
                    CloudError::Provider(format!(
                        "cannot open a netlink socket in the load-balancer namespace: {e}"
                    ))
                })
            })
            .await
            .cloned()
    }

    /// Whether the parent interface exists and is up (with carrier): a replica whose
    /// interface is missing or down must not hold the addresses.
    pub async fn parent_ready(&self) -> Result<(), String> {
        let (_, flags) = self
            .parent_link()
            .await
            .map_err(|e| chain(&e).to_string())?;
        if !flags.contains(LinkFlags::Up) {
            return Err(format!("interface {} is down", self.parent));
        }
        if !flags.contains(LinkFlags::LowerUp) {
            return Err(format!("interface {} has no carrier", self.parent));
        }
        Ok(())
    }

    async fn parent_link(&self) -> Result<(u32, LinkFlags), CloudError> {
        let handle = self.host.handle().await?;
        let mut links = handle
            .link()
            .get()
            .match_name(self.parent.clone())
            .execute();
        match links.try_next().await {
            Ok(Some(m)) => Ok((m.header.index, m.header.flags)),
            Ok(None) => Err(self.no_parent()),
            Err(e) if errno(&e) == Some(libc::ENODEV) => Err(self.no_parent()),
            Err(e) => Err(self
                .host
                .failed(format!("cannot read interface {}", self.parent), &e)
                .await),
        }
    }

    fn no_parent(&self) -> CloudError {
        CloudError::Provider(format!(
            "loadBalancer.interface {:?} does not exist on this host",
            self.parent
        ))
    }

    /// The device, created now (with its routes) if it is not there: at first use, or
    /// after its parent went away and took it along.
    pub async fn device(&self) -> Result<Device, CloudError> {
        let _one = self.setup.lock().await;
        if let Some(d) = self.find_device().await? {
            return Ok(d);
        }
        let (parent, _) = self.parent_link().await?;
        let host = self.host.handle().await?;
        let add = LinkMacVlan::new(DEVICE, parent, MacVlanMode::Bridge)
            .setns_by_fd(self.ns.as_raw_fd())
            .build();
        if let Err(e) = host.link().add(add).execute().await {
            if errno(&e) != Some(libc::EEXIST) {
                return Err(self
                    .host
                    .failed(
                        format!("cannot create a macvlan device on {}", self.parent),
                        &e,
                    )
                    .await);
            }
        }
        let device = self.find_device().await?.ok_or_else(|| {
            CloudError::Provider(format!(
                "the macvlan device on {} vanished while being set up",
                self.parent
            ))
        })?;
        let inside = self.netlink().await?;
        // No IPv6 address of its own (no link-local, no SLAAC from router
        // advertisements): the device carries the load-balancer addresses only. A
        // kernel without IPv6 refuses; that is fine.
        {
            use rtnetlink::packet_route::link::{AfSpecInet6, AfSpecUnspec, In6AddrGenMode};
            let none = LinkUnspec::new_with_index(device.index)
                .append_extra_attribute(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet6(
                    vec![AfSpecInet6::AddrGenMode(In6AddrGenMode::None)],
                )]))
                .build();
            if let Err(e) = inside.link().set(none).execute().await {
                tracing::debug!(error = %chain(&e), "cannot turn off IPv6 address generation on the load-balancer device");
            }
        }
        for index in [Some(device.index), self.loopback().await?]
            .into_iter()
            .flatten()
        {
            inside
                .link()
                .set(LinkUnspec::new_with_index(index).up().build())
                .execute()
                .await
                .map_err(|e| {
                    CloudError::Provider(format!("cannot bring the load-balancer device up: {e}"))
                })?;
        }
        self.copy_routes(parent, device.index).await?;
        tracing::info!(parent = %self.parent, device = DEVICE, "load-balancer device ready in its own network namespace");
        Ok(device)
    }

    /// Deletes the device (and with it every address on it); it is made again on next
    /// use.
    pub async fn delete_device(&self) -> Result<(), CloudError> {
        let _one = self.setup.lock().await;
        let Some(d) = self.find_device().await? else {
            return Ok(());
        };
        let inside = self.netlink().await?;
        inside.link().del(d.index).execute().await.map_err(|e| {
            CloudError::Provider(format!("cannot delete the load-balancer device: {e}"))
        })
    }

    async fn find_device(&self) -> Result<Option<Device>, CloudError> {
        let inside = self.netlink().await?;
        let mut links = inside.link().get().match_name(DEVICE.to_string()).execute();
        let msg = match links.try_next().await {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(None),
            Err(e) if errno(&e) == Some(libc::ENODEV) => return Ok(None),
            Err(e) => {
                return Err(CloudError::Provider(format!(
                    "cannot read the load-balancer device: {e}"
                )))
            }
        };
        let mac = msg
            .attributes
            .iter()
            .find_map(|a| match a {
                LinkAttribute::Address(m) if m.len() == 6 => {
                    let mut mac = [0u8; 6];
                    mac.copy_from_slice(m);
                    Some(mac)
                }
                _ => None,
            })
            .unwrap_or([0; 6]);
        Ok(Some(Device {
            index: msg.header.index,
            mac,
        }))
    }

    async fn loopback(&self) -> Result<Option<u32>, CloudError> {
        let inside = self.netlink().await?;
        let mut links = inside.link().get().match_name("lo".to_string()).execute();
        Ok(links
            .try_next()
            .await
            .ok()
            .flatten()
            .map(|m| m.header.index))
    }

    /// Copies the parent's routes onto `device` again if its IPv4 routes are gone. The
    /// kernel flushes a device's IPv4 routes when its last IPv4 address goes (its
    /// Service deleted, the pool let go, its lifetime run out), and an address added
    /// later would answer ARP but send its replies nowhere: call this before adding
    /// one. Cheap when the routes are there (the namespace's own small table is read);
    /// an error when a route could not be copied, so that the caller holds no address
    /// without its routes and tries again at its next sync.
    pub async fn restore_routes(&self, device: Device) -> Result<(), CloudError> {
        let _one = self.setup.lock().await;
        if self.has_ipv4_routes(device.index).await? {
            return Ok(());
        }
        let (parent, _) = self.parent_link().await?;
        match self.copy_routes(parent, device.index).await? {
            0 => Ok(()),
            n => Err(CloudError::Provider(format!(
                "{n} route(s) of {} could not be copied into the load-balancer namespace",
                self.parent
            ))),
        }
    }

    /// Whether the namespace's main table has an IPv4 route through `device`.
    async fn has_ipv4_routes(&self, device: u32) -> Result<bool, CloudError> {
        let inside = self.netlink().await?;
        let query = RouteMessageBuilder::<std::net::Ipv4Addr>::new().build();
        let mut dump = inside.route().get(query).execute();
        loop {
            match dump.try_next().await {
                Ok(Some(msg)) if main_route_via(&msg, device) => return Ok(true),
                Ok(Some(_)) => {}
                Ok(None) => return Ok(false),
                Err(e) => {
                    return Err(CloudError::Provider(format!(
                        "cannot read the load-balancer namespace's routes: {e}"
                    )))
                }
            }
        }
    }

    /// Gives the device the parent's on-link prefixes and its default routes, so that
    /// replies reach clients on the LAN and beyond its gateway; returns how many could
    /// not be added (each logged).
    async fn copy_routes(&self, parent: u32, device: u32) -> Result<usize, CloudError> {
        let host = self.host.handle().await?;
        let inside = self.netlink().await?;
        let mut routes = on_link_routes(&host, parent, device).await?;
        routes.extend(default_routes(&host, parent, device).await?);
        let mut failed = 0;
        for route in routes {
            if let Err(e) = inside.route().add(route).replace().execute().await {
                tracing::warn!(error = %chain(&e), "cannot copy a route into the load-balancer namespace");
                failed += 1;
            }
        }
        Ok(failed)
    }
}

/// Routes on `device` to the prefixes of the host's link `parent` (its link-local
/// ones left out).
async fn on_link_routes(
    host: &rtnetlink::Handle,
    parent: u32,
    device: u32,
) -> Result<Vec<RouteMessage>, CloudError> {
    let mut routes = Vec::new();
    let mut addrs = host.address().get().set_link_index_filter(parent).execute();
    while let Ok(Some(msg)) = addrs.try_next().await {
        let ip = msg.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        });
        let Some(ip) = ip else { continue };
        if is_link_local(ip) {
            continue;
        }
        let Ok(cidr) =
            format!("{ip}/{}", msg.header.prefix_len).parse::<tether_core::identifiers::Cidr>()
        else {
            continue;
        };
        routes.push(
            RouteMessageBuilder::<IpAddr>::new()
                .destination_prefix(cidr.network(), cidr.prefix())
                .map_err(|e| CloudError::Provider(format!("route for {ip}: {e}")))?
                .output_interface(device)
                .scope(RouteScope::Link)
                .build(),
        );
    }
    Ok(routes)
}

/// Default routes on `device` via the gateways of the host's main-table default
/// routes through its link `parent`, IPv4 and IPv6.
async fn default_routes(
    host: &rtnetlink::Handle,
    parent: u32,
    device: u32,
) -> Result<Vec<RouteMessage>, CloudError> {
    let mut routes = Vec::new();
    for query in [
        RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
        RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
    ] {
        let mut dump = host.route().get(query).execute();
        while let Ok(Some(msg)) = dump.try_next().await {
            let gateway = msg.attributes.iter().find_map(|a| match a {
                RouteAttribute::Gateway(g) => route_ip(g),
                _ => None,
            });
            if msg.header.destination_prefix_length != 0 || !main_route_via(&msg, parent) {
                continue;
            }
            let Some(gw) = gateway else { continue };
            let built = RouteMessageBuilder::<IpAddr>::new()
                .gateway(gw)
                .map_err(|e| CloudError::Provider(format!("default route via {gw}: {e}")))?
                .output_interface(device)
                .onlink()
                .build();
            routes.push(built);
        }
    }
    Ok(routes)
}

/// Whether `msg` is a route of the main table through link `index`.
fn main_route_via(msg: &RouteMessage, index: u32) -> bool {
    msg.header.table == libc::RT_TABLE_MAIN
        && msg
            .attributes
            .iter()
            .any(|a| matches!(a, RouteAttribute::Oif(i) if *i == index))
}

fn route_ip(a: &rtnetlink::packet_route::route::RouteAddress) -> Option<IpAddr> {
    use rtnetlink::packet_route::route::RouteAddress;
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

fn is_link_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
    }
}

/// On the calling thread: a new network namespace, and a descriptor of it.
#[allow(unsafe_code)]
fn enter_new_namespace() -> std::io::Result<OwnedFd> {
    // SAFETY: unshare affects only this thread (a dedicated one); open returns a
    // descriptor we own.
    if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let path = c"/proc/thread-self/ns/net";
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor nobody else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // This thread makes the listeners: it keeps no SYS_ADMIN.
    drop_sys_admin()?;
    Ok(fd)
}

/// Linux capability number of CAP_SYS_ADMIN.
const CAP_SYS_ADMIN: u32 = 21;

/// Drops CAP_SYS_ADMIN from the calling thread's effective, permitted and inheritable
/// sets (threads it starts later inherit that). The CCM needs it only to create the
/// load balancers' namespace: `tether ccm` drops it on its main thread once the
/// provider is built, before any runtime thread exists, and the namespace thread right
/// after `unshare`.
#[allow(unsafe_code)]
pub fn drop_sys_admin() -> std::io::Result<()> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    let mut header = Header {
        version: VERSION_3,
        pid: 0,
    };
    let mut data = [Data::default(); 2];
    // SAFETY: capget fills two Data for version 3 from a valid header.
    if unsafe { libc::syscall(libc::SYS_capget, &mut header, data.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let bit = 1u32 << CAP_SYS_ADMIN;
    if data[0].permitted & bit == 0 && data[0].effective & bit == 0 {
        return Ok(());
    }
    data[0].effective &= !bit;
    data[0].permitted &= !bit;
    data[0].inheritable &= !bit;
    // SAFETY: capset reads the header and two Data; dropping is always allowed.
    if unsafe { libc::syscall(libc::SYS_capset, &header, data.as_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The host's addresses, each with its interface's name (getifaddrs(3)).
#[allow(unsafe_code)]
pub fn host_addresses() -> std::io::Result<Vec<(String, IpAddr)>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: the family says which sockaddr it is.
        let ip = unsafe {
            match i32::from((*ifa.ifa_addr).sa_family) {
                libc::AF_INET => {
                    let sa = &*(ifa.ifa_addr as *const libc::sockaddr_in);
                    IpAddr::from(u32::from_be(sa.sin_addr.s_addr).to_be_bytes())
                }
                libc::AF_INET6 => {
                    let sa = &*(ifa.ifa_addr as *const libc::sockaddr_in6);
                    IpAddr::from(sa.sin6_addr.s6_addr)
                }
                _ => continue,
            }
        };
        // SAFETY: ifa_name is a NUL-terminated string.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        out.push((name, ip));
    }
    // SAFETY: `head` came from getifaddrs.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}
