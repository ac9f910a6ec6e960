//! Load-balancer addresses of the `tether` provider: the `loadBalancer:` section of the
//! cloud config (address pools of ranges and CIDRs, IPv4 and IPv6, optionally reserved
//! to namespaces; the interface each pool's holder announces them on) and the allocator giving
//! each Service its own addresses: the ones it asks for, the ones its status already
//! shows (so allocations survive restarts and leader changes), else the lowest free
//! one of the first pool it may use. Two Services share an address only when both name
//! the same sharing key and their ports do not collide. What cannot be given is a
//! [`Refusal`] with a reason the service controller turns into one Warning event.
//!
//! ```yaml
//! loadBalancer:
//!   interface: eth0          # where the leader adds and announces the addresses
//!   pools:
//!   - name: public
//!     addresses: [192.0.2.10-192.0.2.49, 2001:db8:1::/120]
//!   - name: team-a           # only Services in these namespaces draw from it (first)
//!     addresses: [198.51.100.0/28]
//!     namespaces: [team-a]
//!   reservedPorts: [6443, 8132]  # refused to Services (default: DEFAULT_RESERVED_PORTS)
//! ```

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use serde::Deserialize;

/// `loadBalancer:` in the tether provider's cloud config.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct LoadBalancerConfig {
    /// The interface each pool's holder adds its addresses to and announces them on (ARP /
    /// neighbour advertisements). Absent: the addresses are not added anywhere; they
    /// must already be local on every control-plane host (routed there by you).
    #[serde(default)]
    pub interface: Option<String>,
    /// The pools, in order of preference.
    pub pools: Vec<PoolConfig>,
    /// Ports no Service may ask for: the control plane's own, so that a LoadBalancer
    /// address never answers like a control-plane component. Absent:
    /// [`DEFAULT_RESERVED_PORTS`]; `[]` reserves none.
    #[serde(default)]
    pub reserved_ports: Option<Vec<u16>>,
    /// Publish each address as a hostname, `<address>.<suffix>` (IPv6 with `-` for
    /// `:`), instead of an IP: before Kubernetes 1.30 the apiserver drops `ipMode`,
    /// and kube-proxy captures an ingress IP, sending in-cluster clients around the
    /// balancer; it ignores hostnames (OpenStack's `ingress-hostname-suffix`). The
    /// name must resolve to the address: a wildcard DNS such as `sslip.io`, or yours.
    #[serde(default)]
    pub ingress_hostname_suffix: Option<String>,
}

/// Ports refused to Services unless `reservedPorts` says otherwise: etcd (2379, 2380,
/// 2381 metrics), kube-apiserver (6443), the Konnectivity server (8132 agents, 8133
/// health, 8134 admin), kube-proxy (10249 metrics, 10256 health), kubelet (10250,
/// 10255 read-only), kube-controller-manager (10257), the CCM (10258) and
/// kube-scheduler (10259).
pub const DEFAULT_RESERVED_PORTS: &[u16] = &[
    2379, 2380, 2381, 6443, 8132, 8133, 8134, 10249, 10250, 10255, 10256, 10257, 10258, 10259,
];

/// The longest pool name: it ends the pool's Lease name (`<lease>-lb-<pool>`).
pub const MAX_POOL_NAME: usize = 40;

/// A DNS label of at most [`MAX_POOL_NAME`] characters.
fn is_lease_suffix(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_POOL_NAME
        && !name.starts_with('-')
        && !name.ends_with('-')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
}

/// One pool as written.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolConfig {
    /// Named in events and logs.
    pub name: String,
    /// `A-B` ranges, CIDRs and single addresses, of either family.
    pub addresses: Vec<String>,
    /// When set, only Services in these namespaces draw from this pool (and they try it
    /// before the pools open to every namespace).
    #[serde(default)]
    pub namespaces: Vec<String>,
}

/// An IP family.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Family {
    /// IPv4.
    V4,
    /// IPv6.
    V6,
}

impl Family {
    /// The family of `ip`.
    pub fn of(ip: IpAddr) -> Family {
        match ip {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }

    /// As Kubernetes writes it (`IPv4`, `IPv6`).
    pub fn name(self) -> &'static str {
        match self {
            Family::V4 => "IPv4",
            Family::V6 => "IPv6",
        }
    }
}

/// An inclusive range of one family, as numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Range {
    family: Family,
    first: u128,
    last: u128,
}

fn number(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(v4) => u32::from(v4) as u128,
        IpAddr::V6(v6) => u128::from(v6),
    }
}

fn address(family: Family, n: u128) -> IpAddr {
    match family {
        Family::V4 => IpAddr::V4((n as u32).into()),
        Family::V6 => IpAddr::V6(n.into()),
    }
}

/// Addresses no load balancer may take: (range, only when announced, why). Loopback is
/// refused only where addresses are announced (`--lb-bind-address=127.0.0.1` on a lab
/// host is fine); on an interface it would shadow the host's own.
const UNUSABLE: [(&str, bool, &str); 9] = [
    ("0.0.0.0-0.255.255.255", false, "is or holds the unspecified address (0.0.0.0/8): a listener there takes every address of the host"),
    ("224.0.0.0-239.255.255.255", false, "holds multicast addresses (224.0.0.0/4)"),
    ("240.0.0.0-255.255.255.255", false, "holds reserved or broadcast addresses (240.0.0.0/4)"),
    ("169.254.0.0-169.254.255.255", false, "holds link-local addresses (169.254.0.0/16)"),
    ("::", false, "is the unspecified address (::): a listener there takes every address of the host"),
    ("ff00::-ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", false, "holds multicast addresses (ff00::/8)"),
    ("fe80::-febf:ffff:ffff:ffff:ffff:ffff:ffff:ffff", false, "holds link-local addresses (fe80::/10)"),
    ("127.0.0.0-127.255.255.255", true, "holds loopback addresses (127.0.0.0/8), which cannot be announced on an interface"),
    ("::1", true, "is the loopback address (::1), which cannot be announced on an interface"),
];

impl Range {
    /// Why no load balancer may use this range, if it may not; `announced`: its
    /// addresses go on an interface.
    fn unusable(&self, announced: bool) -> Option<&'static str> {
        UNUSABLE.iter().find_map(|(range, only_announced, why)| {
            let special = Range::parse(range).expect("a valid range");
            (self.overlaps(&special) && (announced || !only_announced)).then_some(*why)
        })
    }

    fn contains(&self, ip: IpAddr) -> bool {
        Family::of(ip) == self.family && (self.first..=self.last).contains(&number(ip))
    }

    fn overlaps(&self, other: &Range) -> bool {
        self.family == other.family && self.first <= other.last && other.first <= self.last
    }

    /// `A-B`, `CIDR` or a single address. An IPv4 CIDR of /30 or wider leaves out its
    /// network and broadcast addresses (clients on such a subnet cannot use them).
    fn parse(s: &str) -> Result<Range, String> {
        let s = s.trim();
        if let Some((a, b)) = s.split_once('-') {
            return Range::span(s, a, b);
        }
        if s.contains('/') {
            return Range::cidr(s);
        }
        let ip: IpAddr = s
            .parse()
            .map_err(|_| format!("{s:?} is not a range (A-B), CIDR or address"))?;
        Ok(Range {
            family: Family::of(ip),
            first: number(ip),
            last: number(ip),
        })
    }

    /// The range `s`, written `a-b`.
    fn span(s: &str, a: &str, b: &str) -> Result<Range, String> {
        let (a, b): (IpAddr, IpAddr) = (
            a.trim()
                .parse()
                .map_err(|_| format!("{s:?}: {a:?} is not an IP address"))?,
            b.trim()
                .parse()
                .map_err(|_| format!("{s:?}: {b:?} is not an IP address"))?,
        );
        if Family::of(a) != Family::of(b) {
            return Err(format!("{s:?}: the range's ends are of different families"));
        }
        if number(a) > number(b) {
            return Err(format!("{s:?}: the range ends before it starts"));
        }
        Ok(Range {
            family: Family::of(a),
            first: number(a),
            last: number(b),
        })
    }

    /// The CIDR `s` (without host bits), less the network and broadcast addresses of
    /// an IPv4 one of /30 or wider.
    fn cidr(s: &str) -> Result<Range, String> {
        let cidr: tether_core::identifiers::Cidr = s
            .parse()
            .map_err(|e| format!("{s:?} is not a range, CIDR or address: {e}"))?;
        let net = cidr.network();
        let family = Family::of(net);
        let bits = match family {
            Family::V4 => 32,
            Family::V6 => 128,
        };
        let host_bits = bits - u32::from(cidr.prefix());
        let first = number(net);
        let last = if host_bits == 128 {
            u128::MAX
        } else {
            first | ((1u128 << host_bits) - 1)
        };
        if cidr.normalized() != cidr {
            return Err(format!(
                "{s:?} has host bits set; did you mean {net}/{}?",
                cidr.prefix()
            ));
        }
        Ok(match (family, host_bits >= 2) {
            (Family::V4, true) => Range {
                family,
                first: first + 1,
                last: last - 1,
            },
            _ => Range {
                family,
                first,
                last,
            },
        })
    }
}

/// A parsed pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pool {
    /// Its name.
    pub name: String,
    ranges: Vec<Range>,
    /// Namespaces it is reserved to (empty: all).
    pub namespaces: Vec<String>,
}

impl Pool {
    /// Does the pool hold `ip`?
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.ranges.iter().any(|r| r.contains(ip))
    }

    /// May a Service in `namespace` draw from this pool?
    fn serves(&self, namespace: &str) -> bool {
        self.namespaces.is_empty() || self.namespaces.iter().any(|n| n == namespace)
    }

    /// Checks pool `p` (its name, unique among the `earlier` pools; its entries, valid,
    /// usable (`announced`: on an interface) and in no other pool) and parses it.
    fn parse(p: &PoolConfig, earlier: &[Pool], announced: bool) -> Result<Pool, String> {
        if p.name.is_empty() {
            return Err("loadBalancer.pools: a pool has no name".into());
        }
        if !is_lease_suffix(&p.name) {
            return Err(format!(
                "loadBalancer pool name {:?} must be a DNS label of at most {MAX_POOL_NAME} characters (lower-case letters, digits and '-'): it names the pool's Lease",
                p.name
            ));
        }
        if earlier.iter().any(|q| q.name == p.name) {
            return Err(format!("loadBalancer.pools: {:?} is named twice", p.name));
        }
        if p.addresses.is_empty() {
            return Err(format!("loadBalancer pool {:?} has no addresses", p.name));
        }
        let mut ranges = Vec::new();
        for a in &p.addresses {
            let r = Range::parse(a).map_err(|e| format!("loadBalancer pool {:?}: {e}", p.name))?;
            if let Some(why) = r.unusable(announced) {
                return Err(format!("loadBalancer pool {:?}: {a:?} {why}", p.name));
            }
            let clash = earlier
                .iter()
                .map(|q| (q.name.as_str(), &q.ranges))
                .chain(std::iter::once((p.name.as_str(), &ranges)))
                .find(|(_, rs)| rs.iter().any(|o| o.overlaps(&r)));
            if let Some((other, _)) = clash {
                return Err(format!(
                    "loadBalancer pool {:?}: {a:?} overlaps addresses of pool {other:?}",
                    p.name
                ));
            }
            ranges.push(r);
        }
        Ok(Pool {
            name: p.name.clone(),
            ranges,
            namespaces: p.namespaces.clone(),
        })
    }
}

/// Refuses a `loadBalancer.interface` the kernel could not have.
fn check_interface(i: &str) -> Result<(), String> {
    if i.is_empty() || i.len() > 15 || i.contains('/') || i.contains(char::is_whitespace) {
        return Err(format!(
            "loadBalancer.interface {i:?} is not an interface name"
        ));
    }
    Ok(())
}

/// Refuses a `loadBalancer.ingressHostnameSuffix` that is not a DNS name.
fn check_hostname_suffix(suffix: &str) -> Result<(), String> {
    let ok = !suffix.is_empty()
        && suffix.len() <= 200
        && suffix.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        });
    if !ok {
        return Err(format!(
            "loadBalancer.ingressHostnameSuffix {suffix:?} is not a DNS name (lower-case labels, no leading dot)"
        ));
    }
    Ok(())
}

/// The validated `loadBalancer:` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pools {
    /// Where each pool's holder announces (see [`LoadBalancerConfig::interface`]).
    pub interface: Option<String>,
    /// The pools, in the order written.
    pub pools: Vec<Pool>,
    /// Ports refused to Services (see [`LoadBalancerConfig::reserved_ports`]).
    pub reserved_ports: Vec<u16>,
    /// See [`LoadBalancerConfig::ingress_hostname_suffix`].
    pub ingress_hostname_suffix: Option<String>,
}

impl Pools {
    /// Checks the section: names unique, every entry a valid range, no address in two
    /// pools, an interface name the kernel could have.
    pub fn new(config: &LoadBalancerConfig) -> Result<Pools, String> {
        if config.pools.is_empty() {
            return Err("loadBalancer.pools is empty: give at least one pool".into());
        }
        if let Some(i) = &config.interface {
            check_interface(i)?;
        }
        if let Some(suffix) = &config.ingress_hostname_suffix {
            check_hostname_suffix(suffix)?;
        }
        let mut pools: Vec<Pool> = Vec::new();
        for p in &config.pools {
            let pool = Pool::parse(p, &pools, config.interface.is_some())?;
            pools.push(pool);
        }
        Ok(Pools {
            interface: config.interface.clone(),
            pools,
            reserved_ports: config
                .reserved_ports
                .clone()
                .unwrap_or_else(|| DEFAULT_RESERVED_PORTS.to_vec()),
            ingress_hostname_suffix: config.ingress_hostname_suffix.clone(),
        })
    }

    /// Is `ip` in any pool?
    pub fn contains(&self, ip: IpAddr) -> bool {
        self.pools.iter().any(|p| p.contains(ip))
    }

    /// The name of the pool holding `ip`.
    pub fn pool_of(&self, ip: IpAddr) -> Option<&str> {
        self.pools
            .iter()
            .find(|p| p.contains(ip))
            .map(|p| p.name.as_str())
    }

    /// The pools a Service in `namespace` may draw from, its namespace's own first.
    fn for_namespace<'a>(&'a self, namespace: &'a str) -> impl Iterator<Item = &'a Pool> + 'a {
        let own = self
            .pools
            .iter()
            .filter(move |p| !p.namespaces.is_empty() && p.serves(namespace));
        let open = self.pools.iter().filter(|p| p.namespaces.is_empty());
        own.chain(open)
    }
}

/// What a Service asks of the allocator.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Request {
    /// `metadata.uid`.
    pub uid: String,
    /// `namespace/name`, for messages.
    pub service: String,
    /// Its namespace (pool eligibility).
    pub namespace: String,
    /// Its families in order (`spec.ipFamilies`); the first is required.
    pub families: Vec<Family>,
    /// The other families are required too (`ipFamilyPolicy: RequireDualStack`).
    pub require_all: bool,
    /// Addresses it asks for (`spec.loadBalancerIP`, the Tether annotation).
    pub requested: Vec<IpAddr>,
    /// Addresses its status shows now.
    pub current: Vec<IpAddr>,
    /// The sharing key annotation, if any.
    pub sharing_key: Option<String>,
    /// Other namespaces whose Services may share its address (`*`: any), from
    /// `tether.dev/lb-sharing-cross-namespace`. Sharing across namespaces needs both
    /// sides to allow it, as Cilium's LB-IPAM asks.
    pub sharing_namespaces: Vec<String>,
    /// Its ports as (protocol, port).
    pub ports: Vec<(String, u16)>,
}

/// Why the allocator cannot give a Service addresses; becomes one Warning event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The event reason.
    pub reason: &'static str,
    /// The event message.
    pub message: String,
}

/// Event reasons of refusals.
pub mod reasons {
    /// A requested address is in no pool the Service may use.
    pub const NOT_IN_POOL: &str = "AddressNotInPool";
    /// A requested (or the only) address is held by a Service it may not share with.
    pub const IN_USE: &str = "AddressInUse";
    /// A requested address is of a family the Service does not have.
    pub const WRONG_FAMILY: &str = "AddressFamilyMismatch";
    /// The ports collide with a Service sharing the address.
    pub const PORT_COLLISION: &str = "PortCollision";
    /// No free address is left in the pools the Service may use.
    pub const EXHAUSTED: &str = "NoAddressAvailable";
    /// An annotation or field naming addresses is not valid.
    pub const INVALID: &str = "InvalidLoadBalancerIP";
    /// A port is reserved for the control plane.
    pub const RESERVED_PORT: &str = "PortReserved";
}

#[derive(Debug, Clone)]
struct Holder {
    uid: String,
    service: String,
    namespace: String,
    sharing_key: Option<String>,
    sharing_namespaces: Vec<String>,
    ports: Vec<(String, u16)>,
}

/// Does a Service of namespace `own`, open to `open_to` (its cross-namespace sharing
/// annotation), let a Service of namespace `other` share its address?
fn allows(own: &str, open_to: &[String], other: &str) -> bool {
    own == other || open_to.iter().any(|n| n == "*" || n == other)
}

/// The Services among `holders`, for messages.
fn names(holders: &[&Holder]) -> String {
    holders
        .iter()
        .map(|h| h.service.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// May `req` share `ip` with the `others` holding it: the same sharing key, and
/// namespaces that allow each other?
fn may_share(req: &Request, ip: IpAddr, others: &[&Holder]) -> Result<(), Refusal> {
    let same_key =
        req.sharing_key.is_some() && others.iter().all(|h| h.sharing_key == req.sharing_key);
    let foreign: Vec<&str> = others
        .iter()
        .filter(|h| {
            !(allows(&h.namespace, &h.sharing_namespaces, &req.namespace)
                && allows(&req.namespace, &req.sharing_namespaces, &h.namespace))
        })
        .map(|h| h.service.as_str())
        .collect();
    if same_key && !foreign.is_empty() {
        return Err(Refusal {
            reason: reasons::IN_USE,
            message: format!(
                "address {ip} is held by {} in another namespace; Services of two namespaces share an address only when both name the other's namespace (or *) in {}",
                foreign.join(", "),
                crate::cloud::annotations::SHARING_CROSS_NAMESPACE
            ),
        });
    }
    if !same_key {
        return Err(Refusal {
            reason: reasons::IN_USE,
            message: format!(
                "address {ip} is held by {} (share it only by giving both Services the same {} annotation)",
                names(others),
                crate::cloud::annotations::SHARING_KEY
            ),
        });
    }
    Ok(())
}

/// Are `req`'s ports free on `ip`, shared with `others`?
fn ports_free(req: &Request, ip: IpAddr, others: &[&Holder]) -> Result<(), Refusal> {
    let taken: Vec<String> = req
        .ports
        .iter()
        .filter(|p| others.iter().any(|h| h.ports.contains(p)))
        .map(|(proto, port)| format!("{port}/{proto}"))
        .collect();
    if !taken.is_empty() {
        return Err(Refusal {
            reason: reasons::PORT_COLLISION,
            message: format!(
                "address {ip} is shared with {}, which already serve(s) port(s) {}",
                names(others),
                taken.join(", ")
            ),
        });
    }
    Ok(())
}

/// Who holds which address.
#[derive(Debug)]
pub struct Allocator {
    pools: Pools,
    held: BTreeMap<IpAddr, Vec<Holder>>,
    by_uid: HashMap<String, Vec<IpAddr>>,
    /// Raised by every change of what is held (for the record's writes).
    generation: u64,
}

impl Allocator {
    /// An allocator over `pools`, nothing held.
    pub fn new(pools: Pools) -> Self {
        Allocator {
            pools,
            held: BTreeMap::new(),
            by_uid: HashMap::new(),
            generation: 0,
        }
    }

    /// The pools it gives from.
    pub fn pools(&self) -> &Pools {
        &self.pools
    }

    /// Gives from `pools` from now on. What Services hold stays theirs until their next
    /// sync; one whose address left every pool then moves to a free one.
    pub fn set_pools(&mut self, pools: Pools) {
        self.pools = pools;
    }

    /// Per pool: (name, addresses held, addresses in it), for
    /// `tether_ccm_lb_addresses_in_use` and `..._total`.
    pub fn usage(&self) -> Vec<(String, u64, u64)> {
        self.pools
            .pools
            .iter()
            .map(|p| {
                let total: u128 = p.ranges.iter().map(|r| r.last - r.first + 1).sum();
                let used = self.held.keys().filter(|ip| p.contains(**ip)).count();
                (
                    p.name.clone(),
                    used as u64,
                    total.min(u64::MAX as u128) as u64,
                )
            })
            .collect()
    }

    /// What `uid` holds now.
    pub fn holding(&self, uid: &str) -> &[IpAddr] {
        self.by_uid.get(uid).map(Vec::as_slice).unwrap_or(&[])
    }

    fn eligible(&self, req: &Request, ip: IpAddr) -> bool {
        self.pools
            .for_namespace(&req.namespace)
            .any(|p| p.contains(ip))
    }

    /// May `req` hold `ip`, given who holds it now?
    fn shareable(&self, req: &Request, ip: IpAddr) -> Result<(), Refusal> {
        let others: Vec<&Holder> = self
            .held
            .get(&ip)
            .into_iter()
            .flatten()
            .filter(|h| h.uid != req.uid)
            .collect();
        if others.is_empty() {
            return Ok(());
        }
        may_share(req, ip, &others)?;
        ports_free(req, ip, &others)
    }

    /// An address of `family` for `req`: a sharing partner's, else the lowest free one.
    fn pick(&self, req: &Request, family: Family) -> Option<IpAddr> {
        if req.sharing_key.is_some() {
            let partner = self.held.iter().find(|(ip, holders)| {
                Family::of(**ip) == family
                    && holders.iter().any(|h| h.uid != req.uid)
                    && self.eligible(req, **ip)
                    && self.shareable(req, **ip).is_ok()
            });
            if let Some((ip, _)) = partner {
                return Some(*ip);
            }
        }
        for pool in self.pools.for_namespace(&req.namespace) {
            for r in pool.ranges.iter().filter(|r| r.family == family) {
                // Held addresses are few: walk past them from the range's start.
                let mut n = r.first;
                loop {
                    let ip = address(family, n);
                    match self.held.get(&ip) {
                        Some(h) if h.iter().any(|h| h.uid != req.uid) => {}
                        _ => return Some(ip),
                    }
                    if n == r.last {
                        break;
                    }
                    n += 1;
                }
            }
        }
        None
    }

    /// Gives `req` its addresses (one per family it wants, in its families' order) and
    /// records them, releasing what it held before and no longer gets. Nothing changes
    /// when it is refused.
    pub fn assign(&mut self, req: &Request) -> Result<Vec<IpAddr>, Refusal> {
        let mut families = req.families.clone();
        if families.is_empty() {
            families.push(Family::V4);
        }
        let mut chosen = self.requested(req, &families)?;
        self.fill(req, &families, &mut chosen)?;
        chosen.sort_by_key(|ip| families.iter().position(|f| *f == Family::of(*ip)));
        self.record(req, &chosen);
        Ok(chosen)
    }

    /// The addresses `req` asks for, if it may have them: of its `families`, one per
    /// family, each in a pool open to it and shareable with who holds it.
    fn requested(&self, req: &Request, families: &[Family]) -> Result<Vec<IpAddr>, Refusal> {
        let mut chosen: Vec<IpAddr> = Vec::new();
        for ip in &req.requested {
            let family = Family::of(*ip);
            if !families.contains(&family) {
                return Err(Refusal {
                    reason: reasons::WRONG_FAMILY,
                    message: format!(
                        "requested address {ip} is {} but the Service's ipFamilies are {}",
                        family.name(),
                        families
                            .iter()
                            .map(|f| f.name())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                });
            }
            if chosen.iter().any(|c| Family::of(*c) == family) {
                return Err(Refusal {
                    reason: reasons::INVALID,
                    message: format!(
                        "two {} addresses requested; ask for at most one per family",
                        family.name()
                    ),
                });
            }
            if !self.eligible(req, *ip) {
                return Err(Refusal {
                    reason: reasons::NOT_IN_POOL,
                    message: format!(
                        "requested address {ip} is in no load-balancer pool open to namespace {}",
                        req.namespace
                    ),
                });
            }
            self.shareable(req, *ip)?;
            chosen.push(*ip);
        }
        Ok(chosen)
    }

    /// Adds to `chosen` an address of each of `families` it has none of: the one `req`
    /// holds or its status shows, else a free one; refused when none is left for the
    /// first family (or any, when all are required).
    fn fill(
        &self,
        req: &Request,
        families: &[Family],
        chosen: &mut Vec<IpAddr>,
    ) -> Result<(), Refusal> {
        for (i, family) in families.iter().enumerate() {
            if chosen.iter().any(|c| Family::of(*c) == *family) {
                continue;
            }
            // Kept from the status (a restart, a leader change) when still in a pool
            // open to it. An address it holds that it may no longer share (it added a
            // port its partner serves, say) is kept and the change refused: a
            // Service's address never moves silently.
            let current = req
                .current
                .iter()
                .chain(self.holding(&req.uid))
                .copied()
                .find(|ip| Family::of(*ip) == *family && self.eligible(req, *ip));
            if let Some(ip) = current {
                self.shareable(req, ip)?;
            }
            match current.or_else(|| self.pick(req, *family)) {
                Some(ip) => chosen.push(ip),
                None if i == 0 || req.require_all => {
                    return Err(Refusal {
                        reason: reasons::EXHAUSTED,
                        message: format!(
                            "no free {} address in the load-balancer pools open to namespace {}",
                            family.name(),
                            req.namespace
                        ),
                    })
                }
                None => {}
            }
        }
        Ok(())
    }

    /// Takes `req.current` where valid and free, before anything is assigned (the
    /// allocations read back at start-up). Returns what was taken.
    pub fn restore(&mut self, req: &Request) -> Vec<IpAddr> {
        let mut taken = Vec::new();
        for ip in &req.current {
            if taken.iter().any(|t| Family::of(*t) == Family::of(*ip)) {
                continue;
            }
            if self.eligible(req, *ip) && self.shareable(req, *ip).is_ok() {
                taken.push(*ip);
            }
        }
        if !taken.is_empty() {
            self.record(req, &taken);
        }
        taken
    }

    fn record(&mut self, req: &Request, chosen: &[IpAddr]) {
        self.release(&req.uid);
        self.generation += 1;
        for ip in chosen {
            self.held.entry(*ip).or_default().push(Holder {
                uid: req.uid.clone(),
                service: req.service.clone(),
                namespace: req.namespace.clone(),
                sharing_key: req.sharing_key.clone(),
                sharing_namespaces: req.sharing_namespaces.clone(),
                ports: req.ports.clone(),
            });
        }
        self.by_uid.insert(req.uid.clone(), chosen.to_vec());
    }

    /// Does any Service hold `ip`?
    pub fn is_held(&self, ip: IpAddr) -> bool {
        self.held.contains_key(&ip)
    }

    /// Forgets `uid`'s addresses; returns those nobody holds any more.
    pub fn release(&mut self, uid: &str) -> Vec<IpAddr> {
        self.generation += 1;
        let mut freed = Vec::new();
        for ip in self.by_uid.remove(uid).unwrap_or_default() {
            if let Some(holders) = self.held.get_mut(&ip) {
                holders.retain(|h| h.uid != uid);
                if holders.is_empty() {
                    self.held.remove(&ip);
                    freed.push(ip);
                }
            }
        }
        freed
    }

    /// Forgets everything (the leader stepped down).
    pub fn clear(&mut self) {
        self.held.clear();
        self.by_uid.clear();
        self.generation += 1;
    }

    /// How many changes of what is held there were so far.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// What is held now, as the allocation record says it, and its generation.
    pub fn snapshot(&self) -> (u64, super::record::Allocations) {
        let mut services = BTreeMap::new();
        for (uid, addresses) in &self.by_uid {
            let holder = addresses
                .first()
                .and_then(|ip| self.held.get(ip))
                .and_then(|hs| hs.iter().find(|h| &h.uid == uid));
            let Some(h) = holder else { continue };
            let ports = h.ports.iter().map(|(_, port)| *port).collect();
            services.insert(
                uid.clone(),
                super::record::Allocation {
                    service: h.service.clone(),
                    addresses: addresses.clone(),
                    ports,
                },
            );
        }
        (self.generation, super::record::Allocations { services })
    }
}

/// `ip` as a hostname under `suffix` (`192.0.2.10.sslip.io`, `2001-db8--10.sslip.io`).
pub fn ingress_hostname(ip: IpAddr, suffix: &str) -> String {
    match ip {
        IpAddr::V4(v4) => format!("{v4}.{suffix}"),
        IpAddr::V6(v6) => format!("{}.{suffix}", v6.to_string().replace(':', "-")),
    }
}

/// The address an [`ingress_hostname`] under `suffix` names, if it is one.
pub fn address_of_hostname(name: &str, suffix: &str) -> Option<IpAddr> {
    let head = name.strip_suffix(suffix)?.strip_suffix('.')?;
    head.parse().ok().or_else(|| {
        head.replace('-', ":")
            .parse::<std::net::Ipv6Addr>()
            .ok()
            .map(IpAddr::V6)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ingress_hostnames_name_their_address() {
        for ip in ["192.0.2.10", "2001:db8::10", "::ffff:1.2.3.4"] {
            let ip: IpAddr = ip.parse().unwrap();
            let name = ingress_hostname(ip, "sslip.io");
            assert_eq!(address_of_hostname(&name, "sslip.io"), Some(ip), "{name}");
        }
        assert_eq!(
            ingress_hostname("2001:db8::10".parse().unwrap(), "lb.example"),
            "2001-db8--10.lb.example"
        );
        assert_eq!(address_of_hostname("x.sslip.io", "sslip.io"), None);
        assert_eq!(address_of_hostname("192.0.2.10.other.io", "sslip.io"), None);
        let bad = |suffix: &str| {
            pools(&format!(
                "ingressHostnameSuffix: {suffix:?}\npools:\n- name: a\n  addresses: [192.0.2.1]\n"
            ))
            .unwrap_err()
        };
        assert!(bad(".sslip.io").contains("not a DNS name"));
        assert!(bad("SSLIP.io").contains("not a DNS name"));
        assert!(pools(
            "ingressHostnameSuffix: sslip.io\npools:\n- name: a\n  addresses: [192.0.2.1]\n"
        )
        .is_ok());
    }

    fn pools(yaml: &str) -> Result<Pools, String> {
        let c: LoadBalancerConfig = serde_yaml::from_str(yaml).map_err(|e| e.to_string())?;
        Pools::new(&c)
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn req(uid: &str, ns: &str) -> Request {
        Request {
            uid: uid.into(),
            service: format!("{ns}/{uid}"),
            namespace: ns.into(),
            families: vec![Family::V4],
            ports: vec![("TCP".into(), 443)],
            ..Default::default()
        }
    }

    #[test]
    fn pools_reject_what_an_operator_would_get_wrong() {
        let ok = pools("interface: eth0\npools:\n- name: a\n  addresses: [192.0.2.0/30, 2001:db8::1-2001:db8::3]\n").unwrap();
        assert!(ok.contains(ip("192.0.2.1")) && ok.contains(ip("192.0.2.2")));
        assert!(
            !ok.contains(ip("192.0.2.0")) && !ok.contains(ip("192.0.2.3")),
            "network and broadcast left out"
        );
        assert!(ok.contains(ip("2001:db8::2")));
        assert_eq!(ok.pool_of(ip("2001:db8::2")), Some("a"));
        assert_eq!(ok.pool_of(ip("192.0.2.3")), None);
        // Loopback only where nothing is announced (--lb-bind-address=127.0.0.1).
        assert!(pools("pools:\n- name: a\n  addresses: [127.0.0.1]\n").is_ok());
        for (bad, says) in [
            ("pools: []\n", "empty"),
            ("pools:\n- name: a\n  addresses: [192.0.2.9-192.0.2.1]\n", "ends before"),
            ("pools:\n- name: a\n  addresses: [192.0.2.1-2001:db8::1]\n", "different families"),
            ("pools:\n- name: a\n  addresses: [192.0.2.1/24]\n", "host bits"),
            ("pools:\n- name: a\n  addresses: [nope]\n", "not a range"),
            ("pools:\n- name: a\n  addresses: [192.0.2.0/24]\n- name: b\n  addresses: [192.0.2.7]\n", "overlaps"),
            ("pools:\n- name: a\n  addresses: [192.0.2.1]\n- name: a\n  addresses: [192.0.2.7]\n", "named twice"),
            ("interface: a-very-long-interface-name\npools:\n- name: a\n  addresses: [192.0.2.1]\n", "interface"),
            ("pools:\n- name: a\n  adresses: [192.0.2.1]\n", "adresses"),
            ("pools:\n- name: Public\n  addresses: [192.0.2.1]\n", "DNS label"),
            ("pools:\n- name: a_b\n  addresses: [192.0.2.1]\n", "DNS label"),
            ("pools:\n- name: a\n  addresses: [0.0.0.0]\n", "unspecified"),
            ("pools:\n- name: a\n  addresses: [\"::\"]\n", "unspecified"),
            ("pools:\n- name: a\n  addresses: [224.0.0.0/28]\n", "multicast"),
            ("pools:\n- name: a\n  addresses: [ff02::1]\n", "multicast"),
            ("pools:\n- name: a\n  addresses: [169.254.1.1]\n", "link-local"),
            ("pools:\n- name: a\n  addresses: [255.255.255.255]\n", "broadcast"),
            ("interface: eth0\npools:\n- name: a\n  addresses: [127.0.0.5]\n", "loopback"),
            ("interface: eth0\npools:\n- name: a\n  addresses: [126.255.255.250-127.0.0.1]\n", "loopback"),
        ] {
            let e = pools(bad).unwrap_err();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn each_service_gets_its_own_address_and_keeps_it() {
        let mut a =
            Allocator::new(pools("pools:\n- name: p\n  addresses: [10.0.0.1-10.0.0.2]\n").unwrap());
        assert_eq!(a.assign(&req("a", "d")).unwrap(), [ip("10.0.0.1")]);
        assert_eq!(a.assign(&req("b", "d")).unwrap(), [ip("10.0.0.2")]);
        // Again: the same.
        assert_eq!(a.assign(&req("a", "d")).unwrap(), [ip("10.0.0.1")]);
        let full = a.assign(&req("c", "d")).unwrap_err();
        assert_eq!(full.reason, reasons::EXHAUSTED);
        assert_eq!(a.release("a"), [ip("10.0.0.1")]);
        assert_eq!(a.assign(&req("c", "d")).unwrap(), [ip("10.0.0.1")]);
    }

    #[test]
    fn allocations_read_back_at_start_up_are_never_handed_out_again() {
        let p = pools("pools:\n- name: p\n  addresses: [10.0.0.1-10.0.0.5]\n").unwrap();
        let mut a = Allocator::new(p);
        let mut old = req("old", "d");
        old.current = vec![ip("10.0.0.1")];
        assert_eq!(a.restore(&old), [ip("10.0.0.1")]);
        // A new Service synced first does not get it; the old one keeps it.
        assert_eq!(a.assign(&req("new", "d")).unwrap(), [ip("10.0.0.2")]);
        assert_eq!(a.assign(&old).unwrap(), [ip("10.0.0.1")]);
        // A status address outside the pools (they changed) is replaced.
        let mut moved = req("moved", "d");
        moved.current = vec![ip("172.16.0.1")];
        assert_eq!(a.assign(&moved).unwrap(), [ip("10.0.0.3")]);
    }

    #[test]
    fn requested_addresses_are_honoured_or_refused_with_the_reason() {
        let mut a = Allocator::new(
            pools("pools:\n- name: p\n  addresses: [10.0.0.0/29, 'fd00::10-fd00::1f']\n- name: t\n  addresses: [10.1.0.1]\n  namespaces: [team]\n").unwrap(),
        );
        let mut r = req("a", "d");
        r.requested = vec![ip("10.0.0.5")];
        assert_eq!(a.assign(&r).unwrap(), [ip("10.0.0.5")]);
        let mut taken = req("b", "d");
        taken.requested = vec![ip("10.0.0.5")];
        assert_eq!(a.assign(&taken).unwrap_err().reason, reasons::IN_USE);
        let mut outside = req("b", "d");
        outside.requested = vec![ip("192.0.2.1")];
        assert_eq!(a.assign(&outside).unwrap_err().reason, reasons::NOT_IN_POOL);
        // A namespace's pool is for that namespace only, and tried first there.
        let mut other_ns = req("b", "d");
        other_ns.requested = vec![ip("10.1.0.1")];
        assert_eq!(
            a.assign(&other_ns).unwrap_err().reason,
            reasons::NOT_IN_POOL
        );
        assert_eq!(a.assign(&req("t1", "team")).unwrap(), [ip("10.1.0.1")]);
        assert_eq!(a.assign(&req("t2", "team")).unwrap(), [ip("10.0.0.1")]);
        let mut v6 = req("b", "d");
        v6.requested = vec![ip("fd00::11")];
        assert_eq!(a.assign(&v6).unwrap_err().reason, reasons::WRONG_FAMILY);
        // Dual-stack: one per family, in the Service's order; the requested one kept.
        v6.families = vec![Family::V6, Family::V4];
        assert_eq!(a.assign(&v6).unwrap(), [ip("fd00::11"), ip("10.0.0.2")]);
        // Nothing changed by a refusal.
        assert_eq!(a.holding("a"), [ip("10.0.0.5")]);
    }

    #[test]
    fn a_sharing_key_shares_an_address_unless_ports_collide() {
        let mut a =
            Allocator::new(pools("pools:\n- name: p\n  addresses: [10.0.0.1-10.0.0.9]\n").unwrap());
        let mut web = req("web", "d");
        web.sharing_key = Some("k".into());
        let first = a.assign(&web).unwrap();
        let mut dns = req("dns", "d");
        dns.sharing_key = Some("k".into());
        dns.ports = vec![("TCP".into(), 53)];
        assert_eq!(
            a.assign(&dns).unwrap(),
            first,
            "same key, other ports: shared"
        );
        let mut clash = req("clash", "d");
        clash.sharing_key = Some("k".into());
        clash.requested = first.clone();
        let e = a.assign(&clash).unwrap_err();
        assert_eq!(e.reason, reasons::PORT_COLLISION, "{e:?}");
        assert!(e.message.contains("443/TCP"), "{}", e.message);
        // Without a requested address, a colliding Service with the key gets its own.
        clash.requested.clear();
        assert_ne!(a.assign(&clash).unwrap(), first);
        // No key: never shared.
        let mut nokey = req("nokey", "d");
        nokey.requested = first.clone();
        nokey.ports = vec![("TCP".into(), 8080)];
        assert_eq!(a.assign(&nokey).unwrap_err().reason, reasons::IN_USE);
        // The address is freed only when its last holder goes.
        assert!(a.release("web").is_empty());
        assert_eq!(a.release("dns"), first);
    }

    #[test]
    fn a_shared_address_is_kept_and_a_colliding_change_refused() {
        let mut a =
            Allocator::new(pools("pools:\n- name: p\n  addresses: [10.0.0.1-10.0.0.9]\n").unwrap());
        let mut web = req("web", "d");
        web.sharing_key = Some("k".into());
        let shared = a.assign(&web).unwrap();
        let mut dns = req("dns", "d");
        dns.sharing_key = Some("k".into());
        dns.ports = vec![("TCP".into(), 53)];
        assert_eq!(a.assign(&dns).unwrap(), shared);
        // dns adds web's port: its address does not move; the change is refused (the
        // controller keeps it serving on what it had and says why in an event).
        dns.ports.push(("TCP".into(), 443));
        dns.current = shared.clone();
        let e = a.assign(&dns).unwrap_err();
        assert_eq!(e.reason, reasons::PORT_COLLISION, "{e:?}");
        assert_eq!(a.holding("dns"), shared.as_slice());
        // Dropping the port again is fine, on the same address.
        dns.ports.pop();
        assert_eq!(a.assign(&dns).unwrap(), shared);
    }

    #[test]
    fn sharing_across_namespaces_needs_both_sides() {
        let mut a =
            Allocator::new(pools("pools:\n- name: p\n  addresses: [10.0.0.1-10.0.0.9]\n").unwrap());
        let mut web = req("web", "team-a");
        web.sharing_key = Some("k".into());
        let first = a.assign(&web).unwrap();
        // Another namespace naming the same key gets an address of its own...
        let mut other = req("other", "team-b");
        other.sharing_key = Some("k".into());
        other.ports = vec![("TCP".into(), 80)];
        assert_ne!(a.assign(&other).unwrap(), first);
        // ...and asking for web's address is refused, even when it allows team-a.
        other.requested = first.clone();
        other.sharing_namespaces = vec!["team-a".into()];
        let e = a.assign(&other).unwrap_err();
        assert_eq!(e.reason, reasons::IN_USE, "{e:?}");
        assert!(e.message.contains("another namespace"), "{}", e.message);
        // Once web allows team-b too, they share.
        web.sharing_namespaces = vec!["team-b".into()];
        assert_eq!(a.assign(&web).unwrap(), first);
        assert_eq!(a.assign(&other).unwrap(), first);
        // `*` on both sides works as well.
        let mut third = req("third", "team-c");
        third.sharing_key = Some("k".into());
        third.ports = vec![("TCP".into(), 8443)];
        third.sharing_namespaces = vec!["*".into()];
        third.requested = first.clone();
        assert_eq!(a.assign(&third).unwrap_err().reason, reasons::IN_USE);
    }

    #[test]
    fn pools_change_in_place_and_report_their_use() {
        let mut a = Allocator::new(
            pools("pools:\n- name: p\n  addresses: [10.0.0.1-10.0.0.2]\n- name: q\n  addresses: [10.0.1.0/30]\n").unwrap(),
        );
        assert_eq!(
            a.usage(),
            [("p".to_string(), 0, 2), ("q".to_string(), 0, 2)]
        );
        a.assign(&req("a", "d")).unwrap();
        a.assign(&req("b", "d")).unwrap();
        assert_eq!(a.assign(&req("c", "d")).unwrap(), [ip("10.0.1.1")]);
        assert_eq!(a.usage()[0], ("p".to_string(), 2, 2));
        // A grown pool serves at once; what is held stays held.
        a.set_pools(pools("pools:\n- name: p\n  addresses: [10.0.0.1-10.0.0.3]\n").unwrap());
        assert_eq!(a.holding("a"), [ip("10.0.0.1")]);
        assert_eq!(a.assign(&req("d", "d")).unwrap(), [ip("10.0.0.3")]);
        assert_eq!(a.usage(), [("p".to_string(), 3, 3)]);
        // c's address left the pools: at its next sync it moves (here: none is free).
        let mut c = req("c", "d");
        c.current = vec![ip("10.0.1.1")];
        assert_eq!(a.assign(&c).unwrap_err().reason, reasons::EXHAUSTED);
    }
}
