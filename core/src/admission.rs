//! What a TLS listener lets in before anyone has authenticated: a cap on its open
//! connections (handshaking or served), on concurrent handshakes, and on concurrent
//! handshakes from one source address. Unauthenticated clients cannot take the
//! descriptors established agents and the frontend need: at the connection cap the
//! listener stops accepting (new clients wait in the kernel's backlog, holding no
//! descriptor of ours), and a source over its handshake share is closed at once.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// The caps; 0 means no cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Open connections, handshaking or served.
    pub max_connections: usize,
    /// TLS handshakes in progress.
    pub max_handshakes: usize,
    /// TLS handshakes in progress from one source address.
    pub max_handshakes_per_source: usize,
}

impl AdmissionLimits {
    /// No caps at all (a listener only the process itself reaches).
    pub const NONE: AdmissionLimits = AdmissionLimits {
        max_connections: 0,
        max_handshakes: 0,
        max_handshakes_per_source: 0,
    };

    /// The defaults for an open-file limit of `nofile`: connections up to three
    /// quarters of it (the rest stays for tunnels, the frontend, files and the
    /// apiserver client), 1,024 handshakes, 128 handshakes per source address (a NAT
    /// gateway in front of many nodes included).
    pub fn for_open_files(nofile: u64) -> Self {
        AdmissionLimits {
            max_connections: (nofile.saturating_mul(3) / 4).max(64) as usize,
            max_handshakes: DEFAULT_MAX_HANDSHAKES,
            max_handshakes_per_source: DEFAULT_MAX_HANDSHAKES_PER_SOURCE,
        }
    }
}

/// Handshakes in progress at once, per listener, by default.
pub const DEFAULT_MAX_HANDSHAKES: usize = 1024;
/// Handshakes in progress from one address at once, per listener, by default.
pub const DEFAULT_MAX_HANDSHAKES_PER_SOURCE: usize = 128;

/// Why a connection was closed unserved (the counter label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Its source already had its handshake share.
    PerSource,
}

impl Refusal {
    /// The metric label.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::PerSource => "per_source",
        }
    }
}

/// Called for every refused connection (a metric counter, for instance).
pub type OnRefusal = Arc<dyn Fn(Refusal) + Send + Sync>;

/// Handshakes in progress by source address.
type Sources = Arc<Mutex<HashMap<IpAddr, usize>>>;

/// One listener's admission state.
pub struct Admission {
    connections: Option<Arc<Semaphore>>,
    handshakes: Option<Arc<Semaphore>>,
    per_source: usize,
    sources: Sources,
    on_refusal: OnRefusal,
}

/// A connection's place under the connection cap; released when dropped.
pub struct ConnectionSlot(#[allow(dead_code)] Option<OwnedSemaphorePermit>);

/// A handshake's place under both handshake caps; released when dropped.
pub struct HandshakeSlot {
    _overall: Option<OwnedSemaphorePermit>,
    source: Option<(IpAddr, Sources)>,
}

impl Drop for HandshakeSlot {
    fn drop(&mut self) {
        if let Some((ip, sources)) = self.source.take() {
            let mut map = sources.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(n) = map.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    map.remove(&ip);
                }
            }
        }
    }
}

fn semaphore(n: usize) -> Option<Arc<Semaphore>> {
    (n > 0).then(|| Arc::new(Semaphore::new(n)))
}

impl Admission {
    /// A listener's admission under `limits`; `on_refusal` hears each refusal.
    pub fn new(limits: AdmissionLimits, on_refusal: OnRefusal) -> Self {
        Admission {
            connections: semaphore(limits.max_connections),
            handshakes: semaphore(limits.max_handshakes),
            per_source: limits.max_handshakes_per_source,
            sources: Arc::default(),
            on_refusal,
        }
    }

    /// Waits for room for one more connection (call before `accept`, so that a full
    /// listener leaves new clients in the kernel's backlog).
    pub async fn connection_slot(&self) -> ConnectionSlot {
        match &self.connections {
            Some(s) => ConnectionSlot(s.clone().acquire_owned().await.ok()),
            None => ConnectionSlot(None),
        }
    }

    /// Waits for room for one more handshake overall (call before `accept` too).
    pub async fn handshake_room(&self) -> Option<OwnedSemaphorePermit> {
        match &self.handshakes {
            Some(s) => s.clone().acquire_owned().await.ok(),
            None => None,
        }
    }

    /// Takes a handshake place for a connection from `source`, holding `overall`; `None`
    /// (and counted) when the source already holds its share: close the connection.
    pub fn handshake_slot(
        &self,
        source: IpAddr,
        overall: Option<OwnedSemaphorePermit>,
    ) -> Option<HandshakeSlot> {
        if self.per_source == 0 {
            return Some(HandshakeSlot {
                _overall: overall,
                source: None,
            });
        }
        let source = canonical(source);
        {
            let mut map = self.sources.lock().unwrap_or_else(|e| e.into_inner());
            let n = map.entry(source).or_default();
            if *n >= self.per_source {
                drop(map);
                (self.on_refusal)(Refusal::PerSource);
                return None;
            }
            *n += 1;
        }
        Some(HandshakeSlot {
            _overall: overall,
            source: Some((source, self.sources.clone())),
        })
    }
}

/// An IPv4-mapped IPv6 address as the IPv4 address it is (a dual-stack listener).
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn a_source_gets_its_share_of_handshakes_and_no_more() {
        let refused = Arc::new(AtomicUsize::new(0));
        let r = refused.clone();
        let adm = Admission::new(
            AdmissionLimits {
                max_connections: 0,
                max_handshakes: 0,
                max_handshakes_per_source: 2,
            },
            Arc::new(move |_| {
                r.fetch_add(1, Ordering::Relaxed);
            }),
        );
        let a: IpAddr = "127.0.0.2".parse().unwrap();
        let b: IpAddr = "127.0.0.1".parse().unwrap();
        let s1 = adm.handshake_slot(a, None).unwrap();
        let _s2 = adm.handshake_slot(a, None).unwrap();
        assert!(adm.handshake_slot(a, None).is_none());
        // The mapped form is the same source.
        assert!(adm
            .handshake_slot("::ffff:127.0.0.2".parse().unwrap(), None)
            .is_none());
        assert!(adm.handshake_slot(b, None).is_some(), "another source");
        assert_eq!(refused.load(Ordering::Relaxed), 2);
        drop(s1);
        assert!(adm.handshake_slot(a, None).is_some(), "room again");
    }

    #[tokio::test]
    async fn at_the_connection_cap_the_next_waits_for_a_slot() {
        let adm = Admission::new(
            AdmissionLimits {
                max_connections: 1,
                max_handshakes: 1,
                max_handshakes_per_source: 0,
            },
            Arc::new(|_| {}),
        );
        let first = adm.connection_slot().await;
        use futures::FutureExt;
        assert!(
            adm.connection_slot().now_or_never().is_none(),
            "no room while the first is open"
        );
        drop(first);
        let _second = adm.connection_slot().await;
        let h = adm.handshake_room().await;
        assert!(h.is_some());
    }

    #[test]
    fn defaults_leave_a_quarter_of_the_descriptors() {
        let l = AdmissionLimits::for_open_files(20_000);
        assert_eq!(l.max_connections, 15_000);
        assert_eq!(AdmissionLimits::for_open_files(10).max_connections, 64);
    }
}
