//! Asking a simulated LAN who answers ARP for an address: an ARP probe (sender address
//! 0.0.0.0, so no neighbour cache learns anything from it) sent from inside a node's
//! namespace, and the MACs of every reply to it collected.

use std::net::Ipv4Addr;
use std::time::{Duration, Instant};

/// The MACs (`aa:bb:...`) that answer an ARP probe for `target`, sent on `iface` in
/// network namespace `ns` (a name under /var/run/netns), within `wait`.
pub fn who_has(ns: &str, iface: &str, target: Ipv4Addr, wait: Duration) -> Vec<String> {
    let (ns, iface) = (ns.to_string(), iface.to_string());
    std::thread::spawn(move || probe(&ns, &iface, target, wait))
        .join()
        .expect("the ARP probe thread")
        .unwrap_or_else(|e| panic!("ARP probe for {target}: {e}"))
}

#[allow(unsafe_code)]
fn probe(ns: &str, iface: &str, target: Ipv4Addr, wait: Duration) -> std::io::Result<Vec<String>> {
    let err = std::io::Error::last_os_error;
    // This thread only (it ends with the probe).
    crate::netns::enter(ns)?;
    let name = std::ffi::CString::new(iface).unwrap();
    // SAFETY: a NUL-terminated name.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    if index == 0 {
        return Err(err());
    }
    let proto = (libc::ETH_P_ARP as u16).to_be();
    // SAFETY: plain socket calls on a descriptor closed below.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC,
            proto as i32,
        )
    };
    if fd < 0 {
        return Err(err());
    }
    let result = (|| {
        let mut ll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        ll.sll_family = libc::AF_PACKET as u16;
        ll.sll_protocol = proto;
        ll.sll_ifindex = index as i32;
        let len = std::mem::size_of::<libc::sockaddr_ll>() as u32;
        // SAFETY: `ll` is a valid sockaddr_ll.
        if unsafe { libc::bind(fd, (&ll as *const libc::sockaddr_ll).cast(), len) } != 0 {
            return Err(err());
        }
        // Our MAC.
        let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
        for (d, s) in req.ifr_name.iter_mut().zip(name.as_bytes_with_nul()) {
            *d = *s as libc::c_char;
        }
        // SAFETY: SIOCGIFHWADDR fills `req`.
        if unsafe { libc::ioctl(fd, libc::SIOCGIFHWADDR, &mut req) } != 0 {
            return Err(err());
        }
        let mut mac = [0u8; 6];
        // SAFETY: the union holds a sockaddr after SIOCGIFHWADDR.
        let hw = unsafe { req.ifr_ifru.ifru_hwaddr.sa_data };
        for (m, b) in mac.iter_mut().zip(hw.iter()) {
            *m = *b as u8;
        }
        let mut frame = Vec::with_capacity(42);
        frame.extend([0xff; 6]);
        frame.extend(mac);
        frame.extend([0x08, 0x06, 0x00, 0x01, 0x08, 0x00, 6, 4, 0x00, 1]);
        frame.extend(mac);
        frame.extend([0, 0, 0, 0]);
        frame.extend([0; 6]);
        frame.extend(target.octets());
        ll.sll_halen = 6;
        ll.sll_addr[..6].copy_from_slice(&[0xff; 6]);
        // SAFETY: `frame` and `ll` outlive the call.
        if unsafe {
            libc::sendto(
                fd,
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&ll as *const libc::sockaddr_ll).cast(),
                len,
            )
        } < 0
        {
            return Err(err());
        }
        let deadline = Instant::now() + wait;
        let mut seen = Vec::new();
        let mut buf = [0u8; 1500];
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            let tv = libc::timeval {
                tv_sec: left.as_secs() as libc::time_t,
                tv_usec: left.subsec_micros().max(1) as libc::suseconds_t,
            };
            // SAFETY: `tv` is a valid timeval.
            unsafe {
                libc::setsockopt(
                    fd,
                    libc::SOL_SOCKET,
                    libc::SO_RCVTIMEO,
                    (&tv as *const libc::timeval).cast(),
                    std::mem::size_of::<libc::timeval>() as u32,
                )
            };
            // SAFETY: `buf` is writable for its length.
            let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n < 0 {
                break;
            }
            let f = &buf[..n as usize];
            // A reply to this probe (addressed to our MAC) whose sender is `target`:
            // not a gratuitous announcement, which a host sends unasked and which may
            // overlap another host's answer while an address moves between them.
            if f.len() >= 42
                && f[12..14] == [0x08, 0x06]
                && f[20..22] == [0, 2]
                && f[28..32] == target.octets()
                && f[32..38] == mac
            {
                let m = f[22..28]
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<Vec<_>>()
                    .join(":");
                if !seen.contains(&m) {
                    seen.push(m);
                }
            }
        }
        Ok(seen)
    })();
    // SAFETY: `fd` is ours.
    unsafe { libc::close(fd) };
    result
}
