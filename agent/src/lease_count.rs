//! Counts live server Leases for `--count-server-leases`: one list, then a watch from
//! its resourceVersion (a re-list only when the watch cannot resume), as upstream's
//! informer does, so a large cluster's agents each hold one watch instead of listing
//! every few seconds, and reading the count never waits on the apiserver.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tether_core::error::chain;

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Api, ListParams, WatchEvent, WatchParams};
use tether_ops::kubeclient::{lease_is_live, CallMetrics};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::LeaseCount;

/// Longest pause between failed lists.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// Server-side timeout of one watch call (the apiserver ends it; we resume).
const WATCH_SECONDS: u32 = 290;

/// The counter's view of the leases; cheap to clone.
#[derive(Clone, Default)]
pub struct LeaseCounter {
    /// Leases by name; `None` until the first list succeeded.
    leases: Arc<Mutex<Option<HashMap<String, Lease>>>>,
}

/// Upstream's agent lease metrics.
#[derive(Clone)]
pub struct LeaseMetrics {
    /// `lease_lists_total` and `lease_list_latency_seconds`.
    pub lists: CallMetrics,
    /// `lease_watches_total`.
    pub watches: CallMetrics,
}

impl LeaseCounter {
    /// Starts listing and watching the leases `lc` names; runs until `hard_stop`.
    pub fn spawn(
        client: kube::Client,
        lc: &LeaseCount,
        metrics: LeaseMetrics,
        hard_stop: CancellationToken,
    ) -> Self {
        let counter = LeaseCounter::default();
        let api: Api<Lease> = Api::namespaced(client, &lc.namespace);
        let span =
            tracing::info_span!("lease_count", namespace = %lc.namespace, selector = %lc.selector);
        let (this, selector) = (counter.clone(), lc.selector.clone());
        tokio::spawn(
            async move {
                tokio::select! {
                    _ = this.run(api, selector, metrics) => {}
                    _ = hard_stop.cancelled() => {}
                }
            }
            .instrument(span),
        );
        counter
    }

    /// Live leases now, or `None` before the first successful list.
    pub fn count(&self) -> Option<i64> {
        let now = k8s_openapi::jiff::Timestamp::now();
        let guard = self.leases.lock().unwrap_or_else(|e| e.into_inner());
        guard
            .as_ref()
            .map(|m| m.values().filter(|l| lease_is_live(l, now)).count() as i64)
    }

    async fn run(&self, api: Api<Lease>, selector: String, metrics: LeaseMetrics) {
        let mut backoff = Duration::from_secs(1);
        loop {
            let started = Instant::now();
            let listed = api.list(&ListParams::default().labels(&selector)).await;
            metrics.lists.observe(started, &listed);
            let list = match listed {
                Ok(list) => list,
                Err(e) => {
                    tracing::warn!(error = %chain(&e), retry_in = ?backoff, "cannot list server leases");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    continue;
                }
            };
            backoff = Duration::from_secs(1);
            let mut version = list.metadata.resource_version.clone().unwrap_or_default();
            let items = list
                .items
                .into_iter()
                .filter_map(|l| Some((l.metadata.name.clone()?, l)))
                .collect();
            *self.leases.lock().unwrap_or_else(|e| e.into_inner()) = Some(items);
            while self.watch(&api, &selector, &mut version, &metrics).await {}
            // A watch that cannot resume: list again, after a pause so an apiserver
            // refusing watches is not hammered with lists.
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// One watch call from `version`, applying its events. True when it ended in a
    /// way the next watch can resume from; false when a re-list is needed.
    async fn watch(
        &self,
        api: &Api<Lease>,
        selector: &str,
        version: &mut String,
        metrics: &LeaseMetrics,
    ) -> bool {
        let params = WatchParams::default()
            .labels(selector)
            .timeout(WATCH_SECONDS);
        let started = Instant::now();
        let stream = api.watch(&params, version).await;
        metrics.watches.observe(started, &stream);
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %chain(&e), "cannot watch server leases; listing again");
                return false;
            }
        };
        let mut stream = std::pin::pin!(stream);
        while let Some(event) = stream.next().await {
            let (lease, removed) = match event {
                Ok(WatchEvent::Added(l) | WatchEvent::Modified(l)) => (l, false),
                Ok(WatchEvent::Deleted(l)) => (l, true),
                Ok(WatchEvent::Bookmark(b)) => {
                    *version = b.metadata.resource_version;
                    continue;
                }
                Ok(WatchEvent::Error(status)) => {
                    // 410 Gone: the version is too old; anything else: start over too.
                    tracing::debug!(code = status.code, reason = %status.reason, "lease watch ended; listing again");
                    return false;
                }
                Err(e) => {
                    tracing::warn!(error = %chain(&e), "server lease watch failed; listing again");
                    return false;
                }
            };
            if let Some(v) = &lease.metadata.resource_version {
                version.clone_from(v);
            }
            let Some(name) = lease.metadata.name.clone() else {
                continue;
            };
            let mut guard = self.leases.lock().unwrap_or_else(|e| e.into_inner());
            let map = guard.get_or_insert_with(HashMap::new);
            if removed {
                map.remove(&name);
            } else {
                map.insert(name, lease);
            }
        }
        true
    }
}
