//! The allocation record: which Service (by UID) holds which load-balancer address and
//! TCP ports, in the ConfigMap `<--leader-elect-resource-name>-lb-allocations` of the
//! CCM's namespace. The controllers' leader writes it before it returns an address to
//! be published in a status, and reads it back when it takes over; every pool holder
//! follows it and serves a Service's status only as far as the record agrees. Anyone
//! allowed `services/status` can write a status; only the CCM writes the record.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use kube::runtime::{watcher, WatchStreamExt};
use serde::{Deserialize, Serialize};
use tether_core::error::chain;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// The Warning event's reason on a Service whose status shows addresses the record does
/// not give it.
pub const UNALLOCATED: &str = "LoadBalancerStatusNotAllocated";

/// The ConfigMap key holding the record (JSON).
pub const KEY: &str = "allocations.json";

/// How long a write stands for the record without reading it back.
const RECHECK: std::time::Duration = std::time::Duration::from_secs(60);

/// The record's name for `--leader-elect-resource-name` `lease_name`.
pub fn name_for(lease_name: &str) -> String {
    format!("{lease_name}-lb-allocations")
}

/// Every allocation, by Service UID.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocations {
    /// By Service UID.
    pub services: BTreeMap<String, Allocation>,
}

/// One Service's allocation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    /// `namespace/name`, for whoever reads the ConfigMap.
    pub service: String,
    /// Its addresses.
    pub addresses: Vec<IpAddr>,
    /// The TCP ports the allocator accepted for it on them.
    pub ports: Vec<u16>,
}

/// Why the record could not be read or written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// The API server refused or failed the request.
    #[error("load-balancer allocation record {name}: {source}")]
    Kube {
        /// The ConfigMap.
        name: String,
        /// What failed.
        #[source]
        source: kube::Error,
    },
    /// The ConfigMap holds something that is not a record.
    #[error("load-balancer allocation record {name}: {KEY} is not a record ({detail}); delete the ConfigMap to have the leader write it again from its allocations")]
    Unreadable {
        /// The ConfigMap.
        name: String,
        /// The parse error.
        detail: String,
    },
}

impl RecordError {
    /// Whether the API server refused it for want of permission (403).
    pub fn forbidden(&self) -> bool {
        matches!(self, RecordError::Kube { source: kube::Error::Api(e), .. } if e.code == 403)
    }
}

/// Where the record lives.
#[derive(Debug, Clone)]
pub struct RecordRef {
    /// Namespace (`--leader-elect-resource-namespace`).
    pub namespace: String,
    /// ConfigMap name ([`name_for`]).
    pub name: String,
}

/// Parses a ConfigMap's record; `Ok(None)` when it has none.
fn parse(cm: &ConfigMap, name: &str) -> Result<Option<Allocations>, RecordError> {
    let Some(text) = cm.data.as_ref().and_then(|d| d.get(KEY)) else {
        return Ok(None);
    };
    serde_json::from_str(text)
        .map(Some)
        .map_err(|e| RecordError::Unreadable {
            name: name.into(),
            detail: e.to_string(),
        })
}

/// What a [`Writer`] last wrote.
#[derive(Default)]
struct Written {
    /// The allocator generation, and when.
    generation: Option<(u64, std::time::Instant)>,
    /// The ConfigMap as the API server returned it: the next write replaces it without
    /// reading it first (one call per assignment), and reads it only on a conflict.
    stored: Option<ConfigMap>,
}

/// The leader's side: reads the record back and writes it.
pub struct Writer {
    api: Api<ConfigMap>,
    name: String,
    /// What was last written; concurrent writes coalesce, the first writing what all
    /// of them changed.
    written: tokio::sync::Mutex<Written>,
}

impl std::fmt::Debug for Writer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Writer").field("name", &self.name).finish()
    }
}

impl Writer {
    /// The writer of the record at `at`, through `client` (the CCM's own credentials).
    pub fn new(client: kube::Client, at: &RecordRef) -> Self {
        Writer {
            api: Api::namespaced(client, &at.namespace),
            name: at.name.clone(),
            written: Default::default(),
        }
    }

    fn kube(&self, source: kube::Error) -> RecordError {
        RecordError::Kube {
            name: self.name.clone(),
            source,
        }
    }

    /// The record as stored; `None` when there is none yet (a leader of an earlier
    /// version, or a new cluster).
    pub async fn read(&self) -> Result<Option<Allocations>, RecordError> {
        match self
            .api
            .get_opt(&self.name)
            .await
            .map_err(|e| self.kube(e))?
        {
            Some(cm) => parse(&cm, &self.name),
            None => Ok(None),
        }
    }

    /// Makes the record say what `snapshot` gives (the allocator's generation and its
    /// allocations), unless generation `wanted` or a later one was written less than
    /// [`RECHECK`] ago (so a record someone emptied or broke is written again at the
    /// next resync).
    pub async fn write(
        &self,
        wanted: u64,
        snapshot: impl FnOnce() -> (u64, Allocations),
    ) -> Result<(), RecordError> {
        let mut written = self.written.lock().await;
        match written.generation {
            Some((g, at)) if g >= wanted && at.elapsed() < RECHECK => return Ok(()),
            // Read it again now and then: someone may have emptied or broken it.
            Some((_, at)) if at.elapsed() >= RECHECK => written.stored = None,
            _ => {}
        }
        let (generation, allocations) = snapshot();
        let text = serde_json::to_string(&allocations).unwrap_or_default();
        // A conflict is another writer in between (an ex-leader's last write): read it
        // again and write over it; the allocations of this term win.
        let mut tries = 0;
        loop {
            tries += 1;
            match self.put(&text, written.stored.take()).await {
                Err(kube::Error::Api(e)) if e.code == 409 && tries < 4 => continue,
                Err(e) => return Err(self.kube(e)),
                Ok(stored) => {
                    written.stored = Some(stored);
                    break;
                }
            }
        }
        written.generation = Some((generation, std::time::Instant::now()));
        Ok(())
    }

    /// Creates or replaces the ConfigMap (`stored`, else read first) with `text`;
    /// returns it as stored.
    async fn put(&self, text: &str, stored: Option<ConfigMap>) -> Result<ConfigMap, kube::Error> {
        let data = BTreeMap::from([(KEY.to_string(), text.to_string())]);
        let stored = match stored {
            Some(cm) => Some(cm),
            None => self.api.get_opt(&self.name).await?,
        };
        match stored {
            Some(cm) if cm.data.as_ref() == Some(&data) => Ok(cm),
            Some(mut cm) => {
                cm.data = Some(data);
                self.api
                    .replace(&self.name, &PostParams::default(), &cm)
                    .await
            }
            None => {
                let cm = ConfigMap {
                    metadata: kube::api::ObjectMeta {
                        name: Some(self.name.clone()),
                        labels: Some(BTreeMap::from([(
                            "app.kubernetes.io/managed-by".to_string(),
                            "tether-ccm".to_string(),
                        )])),
                        ..Default::default()
                    },
                    data: Some(data),
                    ..Default::default()
                };
                self.api.create(&PostParams::default(), &cm).await
            }
        }
    }

    /// Forgets what was written (the leader stepped down): the next term writes anew.
    pub async fn forget(&self) {
        *self.written.lock().await = Written::default();
    }
}

/// What a pool holder knows of the record.
#[derive(Debug, Clone, Default)]
pub enum Known {
    /// Not read yet.
    #[default]
    Unsynced,
    /// There is none (the leader is of an earlier version): statuses are served as they
    /// are, as before there was a record.
    Absent,
    /// The record.
    Present(Arc<Allocations>),
    /// There is one and it cannot be read: no status is served.
    Unreadable,
}

/// Follows the record at `at` until `hard_stop`. A replica not allowed to read it (its
/// RBAC not yet updated) serves the statuses as they are, and says so.
pub fn follow(
    client: kube::Client,
    at: &RecordRef,
    hard_stop: CancellationToken,
) -> watch::Receiver<Known> {
    let (tx, rx) = watch::channel(Known::Unsynced);
    let api: Api<ConfigMap> = Api::namespaced(client, &at.namespace);
    let name = at.name.clone();
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let stream = watcher(api, config).default_backoff();
    let known = move |cm: Option<&ConfigMap>| match cm.map(|cm| parse(cm, &name)) {
        None | Some(Ok(None)) => Known::Absent,
        Some(Ok(Some(a))) => Known::Present(Arc::new(a)),
        Some(Err(e)) => {
            tracing::error!(error = %e, "no load-balancer status is served until the record is readable");
            Known::Unreadable
        }
    };
    tokio::spawn(
        async move {
            let mut stream = std::pin::pin!(stream);
            // A (re)list's object, published when the list is complete.
            let mut listed: Option<ConfigMap> = None;
            loop {
                let event = tokio::select! {
                    e = stream.next() => e,
                    _ = hard_stop.cancelled() => return,
                };
                let now = match event {
                    Some(Ok(watcher::Event::Init)) => {
                        listed = None;
                        continue;
                    }
                    Some(Ok(watcher::Event::InitApply(cm))) => {
                        listed = Some(cm);
                        continue;
                    }
                    Some(Ok(watcher::Event::InitDone)) => known(listed.take().as_ref()),
                    Some(Ok(watcher::Event::Apply(cm))) => known(Some(&cm)),
                    Some(Ok(watcher::Event::Delete(_))) => Known::Absent,
                    Some(Err(e)) if forbidden(&e) && matches!(*tx.borrow(), Known::Unsynced) => {
                        tracing::error!(error = %chain(&e), "cannot read the load-balancer allocation record (give the CCM get, list and watch on it: deploy/tether-ccm.yaml): Services' status is served unchecked until it can");
                        Known::Absent
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %chain(&e), "watch failed; retrying");
                        continue;
                    }
                    None => return,
                };
                tx.send_replace(now);
            }
        }
        .instrument(tracing::info_span!("informer", resource = "lb-allocations")),
    );
    rx
}

/// Whether a watch failed for want of permission.
fn forbidden(e: &watcher::Error) -> bool {
    let api = match e {
        watcher::Error::InitialListFailed(kube::Error::Api(a))
        | watcher::Error::WatchStartFailed(kube::Error::Api(a))
        | watcher::Error::WatchFailed(kube::Error::Api(a)) => Some(a.code),
        watcher::Error::WatchError(s) => Some(s.code),
        _ => None,
    };
    api == Some(403)
}

/// What of a Service the record lets a pool holder serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// The addresses of its status it may be served on.
    pub addresses: Vec<IpAddr>,
    /// The TCP ports it may be served on; `None`: all of them (no record).
    pub ports: Option<Vec<u16>>,
    /// The addresses of its status the record does not give it.
    pub refused: Vec<IpAddr>,
}

/// What of `status` (the addresses a Service's status shows) the record `known` lets
/// Service `uid` be served on, and on which TCP ports.
pub fn admit(known: &Known, uid: &str, status: &[IpAddr]) -> Admitted {
    let recorded = match known {
        Known::Absent => {
            return Admitted {
                addresses: status.to_vec(),
                ports: None,
                refused: Vec::new(),
            }
        }
        Known::Present(a) => a.services.get(uid),
        Known::Unsynced | Known::Unreadable => None,
    };
    let (addresses, refused) = status
        .iter()
        .partition(|ip| recorded.is_some_and(|r| r.addresses.contains(ip)));
    Admitted {
        addresses,
        ports: Some(recorded.map(|r| r.ports.clone()).unwrap_or_default()),
        refused,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn record() -> Known {
        let mut a = Allocations::default();
        a.services.insert(
            "uid-a".into(),
            Allocation {
                service: "ns/a".into(),
                addresses: vec![ip("192.0.2.10")],
                ports: vec![80],
            },
        );
        Known::Present(Arc::new(a))
    }

    #[test]
    fn a_status_the_record_agrees_with_is_served_on_its_recorded_ports() {
        let admitted = admit(&record(), "uid-a", &[ip("192.0.2.10")]);
        assert_eq!(admitted.addresses, vec![ip("192.0.2.10")]);
        assert_eq!(admitted.ports, Some(vec![80]));
        assert!(admitted.refused.is_empty());
    }

    #[test]
    fn a_status_naming_another_services_address_is_refused() {
        let admitted = admit(&record(), "uid-b", &[ip("192.0.2.10")]);
        assert!(admitted.addresses.is_empty());
        assert_eq!(admitted.refused, vec![ip("192.0.2.10")]);
        // Its own recorded address, beside a forged one: only its own.
        let admitted = admit(&record(), "uid-a", &[ip("192.0.2.10"), ip("192.0.2.11")]);
        assert_eq!(admitted.addresses, vec![ip("192.0.2.10")]);
        assert_eq!(admitted.refused, vec![ip("192.0.2.11")]);
    }

    #[test]
    fn without_a_record_statuses_are_served_and_an_unreadable_one_serves_nothing() {
        let absent = admit(&Known::Absent, "uid-b", &[ip("192.0.2.10")]);
        assert_eq!(
            (absent.addresses, absent.ports),
            (vec![ip("192.0.2.10")], None)
        );
        for known in [Known::Unreadable, Known::Unsynced] {
            assert!(admit(&known, "uid-a", &[ip("192.0.2.10")])
                .addresses
                .is_empty());
        }
    }

    #[test]
    fn the_record_reads_back_what_was_written() {
        let Known::Present(a) = record() else {
            unreachable!()
        };
        let text = serde_json::to_string(&*a).unwrap();
        let cm = ConfigMap {
            data: Some(BTreeMap::from([(KEY.to_string(), text)])),
            ..Default::default()
        };
        assert_eq!(parse(&cm, "x").unwrap().as_ref(), Some(&*a));
        let bad = ConfigMap {
            data: Some(BTreeMap::from([(KEY.to_string(), "{".to_string())])),
            ..Default::default()
        };
        assert!(matches!(
            parse(&bad, "x"),
            Err(RecordError::Unreadable { .. })
        ));
    }
}
