//! The controllers: `node` (initialise nodes from the provider, keep addresses in
//! sync), `node_lifecycle` (shutdown taint, delete nodes gone from the provider),
//! `route` (pod-network routes per node podCIDR), `service` (load balancers for
//! Services of type LoadBalancer), `csr_approver` (kubelet serving certificates for the
//! addresses the provider knows).

pub mod csr_approver;
pub mod node;
pub mod node_lifecycle;
pub mod route;
pub mod service;

use k8s_openapi::api::core::v1::Node;

pub use crate::translate::{
    condition, condition_status, has_taint, node_info, ready_status, taints,
};

use tether_core::error::chain;

/// Set by kubelets started with `--cloud-provider=external` until we initialise them.
pub const TAINT_UNINITIALIZED: &str = "node.cloudprovider.kubernetes.io/uninitialized";
/// Put on nodes whose machine is shut down.
pub const TAINT_SHUTDOWN: &str = "node.cloudprovider.kubernetes.io/shutdown";

pub use crate::workqueue::Ticker;

/// Why one sync failed (it is retried with backoff).
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// A Kubernetes API call failed.
    #[error("kubernetes API")]
    Kube(#[from] kube::Error),
    /// The cloud provider failed.
    #[error("cloud provider")]
    Cloud(#[from] crate::cloud::CloudError),
    /// The provider's answer cannot be applied.
    #[error("{0}")]
    Invalid(String),
}

/// The worker's verdict on one sync of `key` (a `kind`): done, or logged and retried.
pub fn outcome_of(
    result: Result<(), SyncError>,
    kind: &str,
    key: &str,
) -> crate::workqueue::Outcome {
    match result {
        Ok(()) => crate::workqueue::Outcome::Done,
        Err(e) => {
            tracing::warn!(%kind, %key, error = %chain(&e), "sync failed; retrying with backoff");
            e.outcome()
        }
    }
}

impl SyncError {
    /// When to try again.
    pub fn outcome(&self) -> crate::workqueue::Outcome {
        match self {
            SyncError::Cloud(crate::cloud::CloudError::RetryAfter { after, .. }) => {
                crate::workqueue::Outcome::Retry(Some(*after))
            }
            // Our cache was behind: it catches up within moments.
            SyncError::Kube(kube::Error::Api(e)) if e.code == 409 => {
                crate::workqueue::Outcome::Retry(Some(std::time::Duration::from_millis(500)))
            }
            _ => crate::workqueue::Outcome::Retry(None),
        }
    }
}

/// What every controller shares.
#[derive(Clone)]
pub struct Context {
    /// The Kubernetes client.
    pub client: kube::Client,
    /// This replica's identity (the events' reporting instance).
    pub identity: String,
    /// The shared node cache.
    pub nodes: kube::runtime::reflector::Store<Node>,
    /// Events already published, for aggregation.
    pub recorder: std::sync::Arc<Recorder>,
    /// The controller manager's metrics.
    pub metrics: crate::metrics::Metrics,
}

/// The events' source component.
pub const COMPONENT: &str = "cloud-controller-manager";

/// How often one aggregated event is written at most; occurrences in between are
/// counted and written with the next one.
const EVENT_WRITE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);
/// Aggregation entries kept (client-go's LRU holds 4096).
const EVENT_CACHE: usize = 4096;

/// One published event, aggregated like client-go's recorder: repeated occurrences of
/// the same reason and type about the same object raise `count` and `lastTimestamp`
/// on one Event instead of creating new ones.
#[derive(Default)]
pub struct Recorder {
    seen: std::sync::Mutex<std::collections::HashMap<EventKey, Published>>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct EventKey {
    namespace: String,
    kind: &'static str,
    name: String,
    uid: Option<String>,
    reason: String,
    warning: bool,
}

struct Published {
    /// The Event object's name.
    name: String,
    /// Occurrences so far (written or not).
    count: i32,
    last_write: std::time::Instant,
}

/// What to do with one occurrence.
enum Write {
    Create(String),
    Patch(String, i32),
    Skip,
}

impl Recorder {
    fn seen(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<EventKey, Published>> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn occurrence(&self, key: &EventKey, fresh_name: String) -> Write {
        let mut seen = self.seen();
        if let Some(p) = seen.get_mut(key) {
            p.count += 1;
            if p.last_write.elapsed() < EVENT_WRITE_INTERVAL {
                return Write::Skip;
            }
            p.last_write = std::time::Instant::now();
            return Write::Patch(p.name.clone(), p.count);
        }
        if seen.len() >= EVENT_CACHE {
            seen.clear();
        }
        seen.insert(
            key.clone(),
            Published {
                name: fresh_name.clone(),
                count: 1,
                last_write: std::time::Instant::now(),
            },
        );
        Write::Create(fresh_name)
    }

    /// The Event behind `key` is gone (expired): the next occurrence creates one.
    fn forget(&self, key: &EventKey) {
        self.seen().remove(key);
    }
}

impl Context {
    /// Publishes a core/v1 event about `node` (in `default`, as client-go's recorder does
    /// for cluster-scoped objects). Failures are logged, never fatal.
    pub async fn node_event(
        &self,
        node: &Node,
        warning: bool,
        reason: &str,
        action: &str,
        note: String,
    ) {
        use kube::ResourceExt;
        let target = Target {
            api_version: "v1",
            kind: "Node",
            namespace: None,
            name: node.name_any(),
            uid: node.uid(),
        };
        self.event(&target, warning, reason, action, note).await;
    }

    /// Publishes a core/v1 event about `target` in its namespace (or `default`). An
    /// event repeating an earlier one (same object, reason and type) raises that one's
    /// count and lastTimestamp (and takes the newest message) instead.
    pub async fn event(
        &self,
        target: &Target,
        warning: bool,
        reason: &str,
        action: &str,
        note: String,
    ) {
        use k8s_openapi::api::core::v1::Event;
        let said = Occurrence {
            now: k8s_openapi::jiff::Timestamp::now(),
            target,
            warning,
            reason,
            action,
            note,
        };
        let namespace = target.namespace.clone().unwrap_or_else(|| "default".into());
        let api: kube::Api<Event> = kube::Api::namespaced(self.client.clone(), &namespace);
        let key = EventKey {
            namespace: namespace.clone(),
            kind: target.kind,
            name: target.name.clone(),
            uid: target.uid.clone(),
            reason: reason.into(),
            warning,
        };
        let Some(name) = self.event_name(&api, &key, &said).await else {
            return;
        };
        let event = self.new_event(said, name, namespace);
        if let Err(e) = api.create(&Default::default(), &event).await {
            tracing::warn!(error = %chain(&e), reason, object = %target.name, "cannot publish event");
            // Let the next occurrence try to create it again.
            self.recorder.forget(&key);
        }
    }

    /// The name of the Event to create for `said`; `None` when an earlier one about
    /// `key` was raised instead (or is written later, or could not be raised).
    async fn event_name(
        &self,
        api: &kube::Api<k8s_openapi::api::core::v1::Event>,
        key: &EventKey,
        said: &Occurrence<'_>,
    ) -> Option<String> {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
        let (target, now) = (said.target, said.now);
        let fresh = || format!("{}.{:x}", target.name, now.as_nanosecond());
        match self.recorder.occurrence(key, fresh()) {
            Write::Skip => None,
            Write::Create(name) => Some(name),
            Write::Patch(name, count) => {
                let patch = serde_json::json!({
                    "count": count,
                    "lastTimestamp": Time(now),
                    "message": said.note,
                });
                match api
                    .patch(
                        &name,
                        &kube::api::PatchParams::default(),
                        &kube::api::Patch::Merge(patch),
                    )
                    .await
                {
                    Ok(_) => None,
                    Err(kube::Error::Api(e)) if e.code == 404 => {
                        // Expired (the apiserver's --event-ttl): start a new one.
                        self.recorder.forget(key);
                        match self.recorder.occurrence(key, fresh()) {
                            Write::Create(name) => Some(name),
                            _ => None,
                        }
                    }
                    Err(e) => {
                        let reason = said.reason;
                        tracing::warn!(error = %chain(&e), reason, object = %target.name, "cannot update event");
                        None
                    }
                }
            }
        }
    }

    /// A new Event `name` in `namespace` saying `said`, counted once.
    fn new_event(
        &self,
        said: Occurrence<'_>,
        name: String,
        namespace: String,
    ) -> k8s_openapi::api::core::v1::Event {
        use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
        let target = said.target;
        Event {
            metadata: ObjectMeta {
                name: Some(name),
                namespace: Some(namespace),
                ..Default::default()
            },
            involved_object: ObjectReference {
                api_version: Some(target.api_version.into()),
                kind: Some(target.kind.into()),
                name: Some(target.name.clone()),
                namespace: target.namespace.clone(),
                uid: target.uid.clone(),
                ..Default::default()
            },
            reason: Some(said.reason.into()),
            message: Some(said.note),
            type_: Some(if said.warning { "Warning" } else { "Normal" }.into()),
            action: Some(said.action.into()),
            source: Some(EventSource {
                component: Some(COMPONENT.into()),
                host: None,
            }),
            reporting_component: Some(COMPONENT.into()),
            reporting_instance: Some(self.identity.clone()),
            first_timestamp: Some(Time(said.now)),
            last_timestamp: Some(Time(said.now)),
            count: Some(1),
            ..Default::default()
        }
    }
}

/// One occurrence of an event: what it says about which object, and when.
struct Occurrence<'a> {
    now: k8s_openapi::jiff::Timestamp,
    target: &'a Target,
    warning: bool,
    reason: &'a str,
    action: &'a str,
    note: String,
}

/// The object an event is about.
#[derive(Debug, Clone)]
pub struct Target {
    /// `v1`.
    pub api_version: &'static str,
    /// `Node`, `Service`.
    pub kind: &'static str,
    /// Namespace (None for cluster-scoped objects).
    pub namespace: Option<String>,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: Option<String>,
}

impl Target {
    /// A core/v1 Service.
    pub fn service(namespace: Option<String>, name: String, uid: Option<String>) -> Target {
        Target {
            api_version: "v1",
            kind: "Service",
            namespace,
            name,
            uid,
        }
    }
}
