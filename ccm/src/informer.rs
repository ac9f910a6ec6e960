//! One shared watch per resource for every controller: a reflector keeps the cache that
//! all controllers read, and each change queues the object's key on every work queue
//! that subscribed. Watch errors are retried with kube-runtime's default backoff.

use std::fmt::Debug;
use std::sync::Arc;
use tether_core::error::chain;

use futures::StreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::workqueue::WorkQueue;

/// The work-queue key of an object: `name`, or `namespace/name`.
pub fn key<K: Resource>(obj: &K) -> String {
    match obj.namespace() {
        Some(ns) => format!("{ns}/{}", obj.name_any()),
        None => obj.name_any(),
    }
}

/// Starts the shared watch of `api`; changes queue keys on `queues`. Returns the cache
/// (wait for [`Store::wait_until_ready`] before trusting it).
pub fn spawn<K>(
    what: &'static str,
    api: Api<K>,
    queues: Vec<Arc<WorkQueue>>,
    hard_stop: CancellationToken,
) -> Store<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Default + Eq + std::hash::Hash + Clone + Send + Sync,
{
    spawn_with(
        what,
        api,
        Default::default(),
        |o: &K| Some(key(o)),
        queues,
        hard_stop,
    )
}

/// [`spawn`] for a type known at run time (`dyntype`), queueing `key_of(object)`
/// (nothing for `None`) on each change: an EndpointSlice queues its Service's key.
pub fn spawn_with<K>(
    what: &'static str,
    api: Api<K>,
    dyntype: K::DynamicType,
    key_of: impl Fn(&K) -> Option<String> + Send + 'static,
    queues: Vec<Arc<WorkQueue>>,
    hard_stop: CancellationToken,
) -> Store<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
{
    let writer = reflector::store::Writer::new(dyntype);
    let store = writer.as_reader();
    let stream = reflector::reflector(
        writer,
        watcher(api, watcher::Config::default()).default_backoff(),
    );
    tokio::spawn(
        async move {
            let mut stream = std::pin::pin!(stream);
            loop {
                let event = tokio::select! {
                    e = stream.next() => e,
                    _ = hard_stop.cancelled() => return,
                };
                match event {
                    Some(Ok(watcher::Event::Apply(obj) | watcher::Event::InitApply(obj)))
                    | Some(Ok(watcher::Event::Delete(obj))) => {
                        if let Some(k) = key_of(&obj) {
                            for q in &queues {
                                q.add(&k);
                            }
                        }
                    }
                    Some(Ok(_)) => {}
                    Some(Err(e)) => tracing::warn!(error = %chain(&e), "watch failed; retrying"),
                    None => return,
                }
            }
        }
        .instrument(tracing::info_span!("informer", resource = what)),
    );
    store
}
