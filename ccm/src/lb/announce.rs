//! Holding load-balancer addresses in the load balancers' own namespace (see
//! [`super::netns`]): each address is added to its macvlan device (/32 or /128; IPv6
//! without duplicate address detection, which would delay a takeover by seconds) and
//! announced so that neighbours move their caches to this replica at once: gratuitous
//! ARP for IPv4, an unsolicited neighbour advertisement (override set) for IPv6, sent
//! three times a second apart. Addresses go again when the replica lets go; the host's
//! own addresses are never touched (they are not in the namespace). Adding and
//! removing need CAP_NET_ADMIN, announcing CAP_NET_RAW.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tether_core::error::chain;

use futures::TryStreamExt;
use rtnetlink::packet_route::address::{
    AddressAttribute, AddressFlags, AddressHeaderFlags, AddressMessage, AddressScope,
};

use super::netns::{Device, LbNamespace};
use crate::cloud::CloudError;
use crate::netlink::errno;

/// A refresh later than the lifetime less this is too late (see [`Announcer::refresh`]).
const REFRESH_MARGIN: Duration = Duration::from_millis(500);

/// Announcements per address taken (the first at once, then one a second).
const ANNOUNCEMENTS: u32 = 3;

/// Addresses added and announced, with their pool.
type Announced = Arc<std::sync::Mutex<HashMap<IpAddr, String>>>;

/// Adds, announces and removes addresses in the load balancers' namespace, pool by
/// pool: only the addresses of pools this replica holds (their leases) are added.
pub struct Announcer {
    ns: Arc<LbNamespace>,
    /// Addresses added and announced: one already there and announced is not
    /// announced again on every sync (a resync, an endpoint change).
    announced: Announced,
    /// The pools held, each with when its addresses' lifetimes were last refreshed
    /// (from the attempt's start). [`Self::resume`] adds a pool, [`Self::release_pool`]
    /// takes it out: from then on none of its addresses is added, so that a sync still
    /// in flight when the lease was lost cannot put one back.
    held: tokio::sync::Mutex<HashMap<String, Option<std::time::Instant>>>,
    /// The lifetime (whole seconds) addresses get, 0 for none: a holder refreshes it
    /// while it holds the pool's lease ([`Self::refresh`]), so a process that hangs
    /// while alive loses its addresses when it stops refreshing.
    lifetime: std::sync::atomic::AtomicU32,
}

impl Announcer {
    /// Addresses on a macvlan of `interface`, in a namespace made now (which fails
    /// without CAP_SYS_ADMIN).
    pub fn new(interface: &str) -> Result<Self, String> {
        Ok(Announcer {
            ns: Arc::new(LbNamespace::create(interface)?),
            announced: Default::default(),
            held: Default::default(),
            lifetime: std::sync::atomic::AtomicU32::new(0),
        })
    }

    fn announced(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, String>> {
        lock_map(&self.announced)
    }

    /// The host interface it announces on.
    pub fn interface(&self) -> &str {
        self.ns.parent()
    }

    /// Whether this replica may hold the addresses: its interface exists, is up and
    /// has carrier.
    pub async fn ready(&self) -> Result<(), String> {
        self.ns.parent_ready().await
    }

    /// A listener on `addr` in the namespace.
    pub async fn listen(&self, addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
        self.ns.listen(addr).await
    }

    fn failed(&self, what: String, e: &rtnetlink::Error) -> CloudError {
        let hint = match errno(e) {
            Some(libc::EPERM) => " (the CCM needs CAP_NET_ADMIN)",
            _ => "",
        };
        CloudError::Provider(format!("{what}: {e}{hint}"))
    }

    /// Adds `ip` of `pool` to the device (already there is fine) and announces it,
    /// unless it was there already and announced since it was added. Refused unless
    /// the pool is held.
    pub async fn hold(&self, ip: IpAddr, pool: &str) -> Result<(), CloudError> {
        let held = self.held.lock().await;
        self.may_hold(&held, ip, pool)?;
        let device = self.ns.device().await?;
        // Its routes first, which went with the last address before it (see
        // [`LbNamespace::restore_routes`]): an address never answers without them.
        self.ns.restore_routes(device).await?;
        let handle = self.ns.netlink().await?;
        match self.add(&handle, device, ip, false).await {
            Ok(()) => {
                self.announced().remove(&ip);
                tracing::info!(%ip, pool, interface = %self.interface(), "load-balancer address added")
            }
            Err(e) if errno(&e) == Some(libc::EEXIST) => {
                if self.announced().contains_key(&ip) {
                    return Ok(());
                }
            }
            Err(e) => return Err(self.failed(format!("cannot add {ip}"), &e)),
        }
        // The first announcement now (a failure is the caller's to report), the rest in
        // the background for neighbours that missed it.
        let first = self.ns.run(move || announce(device, ip)).await;
        first.map_err(|e| {
            CloudError::Provider(format!(
                "cannot announce {ip} on {}: {e}{}",
                self.interface(),
                if e.raw_os_error() == Some(libc::EPERM) {
                    " (the CCM needs CAP_NET_RAW to announce addresses)"
                } else {
                    ""
                }
            ))
        })?;
        self.announced().insert(ip, pool.to_string());
        drop(held);
        self.announce_again(device, ip);
        Ok(())
    }

    /// Whether `ip` of `pool` may be held now: the pool is held and, as for a late
    /// refresh, its addresses were refreshed within their lifetime (after a freeze
    /// they may have expired and a standby may hold them; this one must not come
    /// back).
    fn may_hold(
        &self,
        held: &HashMap<String, Option<std::time::Instant>>,
        ip: IpAddr,
        pool: &str,
    ) -> Result<(), CloudError> {
        let Some(refreshed) = held.get(pool) else {
            return Err(CloudError::Provider(format!(
                "not holding {ip}: this replica does not hold pool {pool:?}"
            )));
        };
        let secs = self.lifetime.load(std::sync::atomic::Ordering::Relaxed);
        let lifetime = Duration::from_secs(secs.into());
        if secs > 0
            && refreshed.is_some_and(|at| at.elapsed() >= lifetime.saturating_sub(REFRESH_MARGIN))
        {
            return Err(CloudError::Provider(format!(
                "not holding {ip}: pool {pool:?}'s addresses were not refreshed within their lifetime"
            )));
        }
        Ok(())
    }

    /// The rest of `ip`'s announcements, in the background, for neighbours that missed
    /// the first.
    fn announce_again(&self, device: Device, ip: IpAddr) {
        let (ns, held) = (self.ns.clone(), self.announced.clone());
        tokio::spawn(async move {
            for _ in 1..ANNOUNCEMENTS {
                tokio::time::sleep(Duration::from_secs(1)).await;
                // Not for an address let go of since (it would point neighbours here).
                if !lock_map(&held).contains_key(&ip) {
                    return;
                }
                if let Err(e) = ns.run(move || announce(device, ip)).await {
                    tracing::warn!(%ip, interface = %ns.parent(), error = %chain(&e), "announcement failed");
                }
            }
        });
    }

    /// Adds (or with `replace`, refreshes) `ip` with the current lifetime.
    async fn add(
        &self,
        handle: &rtnetlink::Handle,
        device: Device,
        ip: IpAddr,
        replace: bool,
    ) -> Result<(), rtnetlink::Error> {
        let prefix = if ip.is_ipv4() { 32 } else { 128 };
        let mut add = handle.address().add(device.index, ip, prefix);
        if replace {
            add = add.replace();
        }
        let msg = add.message_mut();
        if ip.is_ipv6() {
            msg.header.flags = AddressHeaderFlags::Nodad;
            msg.attributes
                .push(AddressAttribute::Flags(AddressFlags::Nodad));
        }
        let secs = self.lifetime.load(std::sync::atomic::Ordering::Relaxed);
        if secs > 0 {
            let mut info = rtnetlink::packet_route::address::CacheInfo::default();
            info.ifa_preferred = secs;
            info.ifa_valid = secs;
            msg.attributes.push(AddressAttribute::CacheInfo(info));
        }
        add.execute().await
    }

    /// Gives every address of `pool` `lifetime` (whole seconds, at least one) from
    /// now. The pool's lease holder calls this every retry period; a holder that hangs
    /// stops, and the kernel removes its addresses when the lifetime ends.
    ///
    /// A refresh that comes too late (the process was stopped, or starved) fails
    /// instead: the kernel may have removed the addresses already, and refreshing
    /// would add them back while a standby may hold them. The caller then lets go.
    pub async fn refresh(&self, pool: &str, lifetime: Duration) -> Result<(), CloudError> {
        let secs = lifetime.as_secs().max(1) as u32;
        self.lifetime
            .store(secs, std::sync::atomic::Ordering::Relaxed);
        let mut guard = self.held.lock().await;
        let Some(refreshed) = guard.get_mut(pool) else {
            return Ok(());
        };
        let started = std::time::Instant::now();
        let late =
            refreshed.is_some_and(|at| started - at >= lifetime.saturating_sub(REFRESH_MARGIN));
        let held: Vec<IpAddr> = self
            .announced()
            .iter()
            .filter(|(_, p)| p.as_str() == pool)
            .map(|(ip, _)| *ip)
            .collect();
        if held.is_empty() {
            *refreshed = Some(started);
            return Ok(());
        }
        if late {
            return Err(CloudError::Provider(format!(
                "the addresses' lifetime ({secs} s) may have run out before this refresh"
            )));
        }
        let device = self.ns.device().await?;
        let handle = self.ns.netlink().await?;
        for ip in held {
            if let Err(e) = self.add(&handle, device, ip, true).await {
                return Err(self.failed(format!("cannot refresh {ip}"), &e));
            }
        }
        if let Some(r) = guard.get_mut(pool) {
            *r = Some(started);
        }
        Ok(())
    }

    /// The device's addresses other than link-local ones (only `ip`, when given).
    async fn addresses(
        &self,
        only: Option<IpAddr>,
    ) -> Result<Vec<(IpAddr, AddressMessage)>, CloudError> {
        let device = self.ns.device().await?;
        let handle = self.ns.netlink().await?;
        let mut get = handle.address().get().set_link_index_filter(device.index);
        if let Some(ip) = only {
            get = get.set_address_filter(ip);
        }
        let mut dump = get.execute();
        let mut out = Vec::new();
        loop {
            match dump.try_next().await {
                Ok(Some(msg)) if msg.header.scope != AddressScope::Link => {
                    let ip = msg.attributes.iter().find_map(|a| match a {
                        AddressAttribute::Address(ip) => Some(*ip),
                        _ => None,
                    });
                    out.extend(ip.map(|ip| (ip, msg)));
                }
                Ok(Some(_)) => {}
                Ok(None) => return Ok(out),
                Err(e) => {
                    return Err(self.failed("cannot list the load-balancer addresses".into(), &e))
                }
            }
        }
    }

    /// Deletes the listed addresses (already gone is fine) and forgets their
    /// announcement.
    async fn remove(&self, found: Vec<(IpAddr, AddressMessage)>) -> Result<(), CloudError> {
        let handle = self.ns.netlink().await?;
        for (ip, msg) in found {
            self.announced().remove(&ip);
            match handle.address().del(msg).execute().await {
                Ok(()) => {
                    tracing::info!(%ip, interface = %self.interface(), "load-balancer address removed")
                }
                Err(e) if errno(&e) == Some(libc::EADDRNOTAVAIL) => {}
                Err(e) => return Err(self.failed(format!("cannot remove {ip}"), &e)),
            }
        }
        Ok(())
    }

    /// Removes `ip` (not there is fine).
    pub async fn release(&self, ip: IpAddr) -> Result<(), CloudError> {
        let found = self.addresses(Some(ip)).await?;
        self.remove(found).await
    }

    /// Holds `pool`'s addresses again (a new term as its holder).
    pub async fn resume(&self, pool: &str) {
        self.held.lock().await.insert(pool.to_string(), None);
    }

    /// Removes every address of `pool` (those `in_pool` says are) and adds none of its
    /// addresses until [`Self::resume`]; returns how many went. Everything on the
    /// device is ours. If they cannot be removed one by one, the device goes (taking
    /// every pool's addresses: the other pools' holders then fail to refresh and let
    /// go too); if even that fails, the process ends, and the kernel destroys the
    /// namespace: a replica that lets go never keeps answering.
    pub async fn release_pool(
        &self,
        pool: &str,
        in_pool: &(dyn Fn(IpAddr) -> bool + Sync),
    ) -> Result<usize, CloudError> {
        let mut held = self.held.lock().await;
        held.remove(pool);
        self.announced()
            .retain(|ip, p| p.as_str() != pool && !in_pool(*ip));
        let removed = match self.addresses(None).await {
            Ok(all) => {
                let ours: Vec<_> = all.into_iter().filter(|(ip, _)| in_pool(*ip)).collect();
                let n = ours.len();
                self.remove(ours).await.map(|()| n)
            }
            Err(e) => Err(e),
        };
        let n = match removed {
            Ok(n) => n,
            Err(e) => {
                tracing::error!(error = %chain(&e), pool, "cannot remove the load-balancer addresses; deleting their device");
                if let Err(e2) = self.ns.delete_device().await {
                    tracing::error!(error = %chain(&e2), "cannot delete the load-balancer device either; exiting so that the kernel removes the addresses");
                    std::process::abort();
                }
                0
            }
        };
        drop(held);
        Ok(n)
    }
}

fn lock_map(
    map: &std::sync::Mutex<HashMap<IpAddr, String>>,
) -> std::sync::MutexGuard<'_, HashMap<IpAddr, String>> {
    map.lock().unwrap_or_else(|e| e.into_inner())
}

/// Sends one announcement of `ip` on `link` (a raw packet socket: the only unsafe
/// code of the CCM, four libc calls).
#[allow(unsafe_code)]
fn announce(link: Device, ip: IpAddr) -> std::io::Result<()> {
    let frames = match ip {
        IpAddr::V4(v4) => vec![
            garp(link.mac, v4.octets(), 1),
            garp(link.mac, v4.octets(), 2),
        ],
        IpAddr::V6(v6) => vec![unsolicited_na(link.mac, v6.octets())],
    };
    // SAFETY: plain socket calls on a descriptor we own and close below.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut result = Ok(());
    for frame in frames {
        let mut to: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        to.sll_family = libc::AF_PACKET as u16;
        to.sll_ifindex = link.index as i32;
        to.sll_halen = 6;
        to.sll_addr[..6].copy_from_slice(&frame[..6]);
        to.sll_protocol = u16::from_be_bytes([frame[12], frame[13]]).to_be();
        // SAFETY: `frame` outlives the call; `to` is a valid sockaddr_ll.
        let sent = unsafe {
            libc::sendto(
                fd,
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&to as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as u32,
            )
        };
        if sent < 0 {
            result = Err(std::io::Error::last_os_error());
            break;
        }
    }
    // SAFETY: `fd` is ours.
    unsafe { libc::close(fd) };
    result
}

/// A gratuitous ARP frame (`op` 1: request, 2: reply) saying `ip` is at `mac`.
fn garp(mac: [u8; 6], ip: [u8; 4], op: u8) -> Vec<u8> {
    let mut f = Vec::with_capacity(42);
    f.extend([0xff; 6]);
    f.extend(mac);
    f.extend([0x08, 0x06]);
    // Ethernet, IPv4, 6-byte and 4-byte addresses, the operation.
    f.extend([0x00, 0x01, 0x08, 0x00, 6, 4, 0x00, op]);
    f.extend(mac);
    f.extend(ip);
    f.extend(if op == 1 { [0x00; 6] } else { [0xff; 6] });
    f.extend(ip);
    f
}

/// An unsolicited neighbour advertisement to all nodes (override set, with the target
/// link-layer address option) saying `ip` is at `mac`.
fn unsolicited_na(mac: [u8; 6], ip: [u8; 16]) -> Vec<u8> {
    let all_nodes: [u8; 16] = [0xff, 0x02, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    let mut icmp = Vec::with_capacity(32);
    icmp.extend([136, 0, 0, 0]);
    // Flags: Override.
    icmp.extend([0x20, 0, 0, 0]);
    icmp.extend(ip);
    icmp.extend([2, 1]);
    icmp.extend(mac);
    // Checksum over the pseudo-header (source, destination, length, next header).
    let mut sum: u32 = 0;
    let mut add = |bytes: &[u8]| {
        for pair in bytes.chunks(2) {
            sum += u32::from(u16::from_be_bytes([pair[0], *pair.get(1).unwrap_or(&0)]));
        }
    };
    add(&ip);
    add(&all_nodes);
    add(&(icmp.len() as u32).to_be_bytes());
    add(&[0, 0, 0, 58]);
    add(&icmp);
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    let checksum = !(sum as u16);
    icmp[2..4].copy_from_slice(&checksum.to_be_bytes());

    let mut f = Vec::with_capacity(14 + 40 + icmp.len());
    f.extend([0x33, 0x33, 0, 0, 0, 1]);
    f.extend(mac);
    f.extend([0x86, 0xdd]);
    f.extend([0x60, 0, 0, 0]);
    f.extend((icmp.len() as u16).to_be_bytes());
    // Next header ICMPv6, hop limit 255 (required of neighbour discovery).
    f.extend([58, 255]);
    f.extend(ip);
    f.extend(all_nodes);
    f.extend(icmp);
    f
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn announcements_are_well_formed() {
        let mac = [0x02, 0, 0, 0, 0, 0x01];
        let a = garp(mac, [192, 0, 2, 10], 1);
        assert_eq!(a.len(), 42);
        assert_eq!(&a[12..14], &[0x08, 0x06]);
        assert_eq!(&a[28..32], &[192, 0, 2, 10], "sender IP");
        assert_eq!(&a[38..42], &[192, 0, 2, 10], "target IP: gratuitous");
        let ip: std::net::Ipv6Addr = "2001:db8::10".parse().unwrap();
        let na = unsolicited_na(mac, ip.octets());
        assert_eq!(na.len(), 14 + 40 + 32);
        assert_eq!(na[20], 58);
        assert_eq!(na[21], 255);
        // The checksum verifies: summing the pseudo-header and the message gives 0xffff.
        let icmp = &na[54..];
        let mut sum: u32 = 0;
        for chunk in [
            &na[22..38],
            &na[38..54],
            &(32u32).to_be_bytes()[..],
            &[0, 0, 0, 58][..],
            icmp,
        ] {
            for pair in chunk.chunks(2) {
                sum += u32::from(u16::from_be_bytes([pair[0], pair[1]]));
            }
        }
        while sum >> 16 != 0 {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        assert_eq!(sum, 0xffff);
    }
}
