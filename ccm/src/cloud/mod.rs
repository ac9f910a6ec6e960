//! The provider traits the controllers call (upstream's cloudprovider interface in
//! spirit): instances, load balancers and routes, each optional, with the errors a
//! provider may answer. Providers are chosen by name (`--cloud-provider`) and read
//! their configuration from `--cloud-config`.

#[cfg(feature = "test-util")]
pub mod fake;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

/// What a provider may answer instead of a result.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum CloudError {
    /// The provider does not implement this call; the controller skips what needs it.
    #[error("not implemented by this cloud provider")]
    NotImplemented,
    /// The provider does not know this node.
    #[error("instance not found")]
    InstanceNotFound,
    /// The node is known only from claims nobody vouched for (an agent's identifiers
    /// the server did not verify); nothing is taken from them.
    #[error("{0}")]
    Unverified(String),
    /// Try again after `after` (the provider is rate limited or busy).
    #[error("provider asked to retry after {after:?}: {reason}")]
    RetryAfter {
        /// How long to wait.
        after: Duration,
        /// Why.
        reason: String,
    },
    /// The request cannot be met as written (an address in use, outside every pool,
    /// ...): said once in a Warning event with `reason`, and not retried until the
    /// object or what it waits for changes.
    #[error("{message}")]
    Refused {
        /// The event reason.
        reason: String,
        /// What is wrong, for the event.
        message: String,
    },
    /// Anything else; retried with backoff.
    #[error("{0}")]
    Provider(String),
}

/// The node a provider is asked about.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeInfo {
    /// `metadata.name`.
    pub name: String,
    /// `spec.providerID`, when set.
    pub provider_id: Option<String>,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
}

/// A node address as the provider knows it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Address {
    /// `InternalIP`, `ExternalIP`, `Hostname`, `InternalDNS` or `ExternalDNS`.
    pub kind: String,
    /// The address.
    pub address: String,
}

/// What the node controller writes onto a new node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InstanceMetadata {
    /// `spec.providerID`.
    pub provider_id: String,
    /// `node.kubernetes.io/instance-type`.
    pub instance_type: String,
    /// `status.addresses`.
    pub addresses: Vec<Address>,
    /// `topology.kubernetes.io/zone`.
    pub zone: String,
    /// `topology.kubernetes.io/region`.
    pub region: String,
    /// Further labels to set.
    pub extra_labels: BTreeMap<String, String>,
}

/// Instances: existence, shutdown state and metadata of nodes.
#[async_trait]
pub trait Instances: Send + Sync {
    /// Does the node's instance exist?
    async fn exists(&self, node: &NodeInfo) -> Result<bool, CloudError>;
    /// Is the node's instance shut down (it exists but does not run)?
    async fn shutdown(&self, node: &NodeInfo) -> Result<bool, CloudError>;
    /// The node's provider ID, type, addresses, zone, region and labels.
    async fn metadata(&self, node: &NodeInfo) -> Result<InstanceMetadata, CloudError>;
    /// Is `provider_id` one this provider gives out? Nodes initialised by someone else
    /// are never deleted by the lifecycle controller.
    fn owns(&self, provider_id: &str) -> bool {
        !provider_id.is_empty()
    }
}

/// A Service as a load balancer implementation sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceInfo {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// `metadata.uid` (stable across renames of nothing; names the balancer).
    pub uid: String,
    /// Ports: (name, protocol, port, nodePort).
    pub ports: Vec<ServicePort>,
    /// Client ranges allowed (`spec.loadBalancerSourceRanges`, else the annotation
    /// `service.beta.kubernetes.io/load-balancer-source-ranges`); empty: everyone.
    pub source_ranges: Vec<tether_core::identifiers::Cidr>,
    /// Source ranges that could not be parsed (reported, never widening access: a
    /// Service with only invalid ranges admits nobody).
    pub invalid_source_ranges: Vec<String>,
    /// Connections forwarded at once at most; more are refused.
    pub max_connections: usize,
    /// A forwarded connection with no byte either way for this long is closed.
    pub idle_timeout: Duration,
    /// `spec.ipFamilies` (`IPv4`, `IPv6`), in order.
    pub families: Vec<String>,
    /// `ipFamilyPolicy: RequireDualStack`: every family needs an address.
    pub require_dual_stack: bool,
    /// Addresses asked for (`spec.loadBalancerIP`, or the annotation
    /// [`annotations::LOAD_BALANCER_IPS`]), as written.
    pub requested_ips: Vec<String>,
    /// The ingress IPs (or hostnames) its status shows now (kept across restarts and
    /// leader changes).
    pub current_ips: Vec<String>,
    /// [`annotations::SHARING_KEY`]: Services with the same key may share an address.
    pub sharing_key: Option<String>,
    /// [`annotations::SHARING_CROSS_NAMESPACE`]: other namespaces that may share it.
    pub sharing_namespaces: Vec<String>,
    /// [`annotations::PROXY_PROTOCOL`]: a PROXY protocol header goes to backends first.
    pub proxy_protocol: Option<ProxyProtocol>,
    /// Traffic goes to NodePorts (`allocateLoadBalancerNodePorts` is not `false`);
    /// otherwise straight to the ready endpoints ([`ServicePort::endpoints`]).
    pub node_ports: bool,
}

/// A PROXY protocol version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyProtocol {
    /// The text header.
    V1,
    /// The binary header.
    V2,
}

/// Annotations a Service gives load balancers.
pub mod annotations {
    /// Connections one Service's balancer forwards at once (default 1024).
    pub const MAX_CONNECTIONS: &str = "tether.dev/lb-max-connections";
    /// Idle time after which a forwarded connection is closed (default 1h; Go
    /// duration syntax).
    pub const IDLE_TIMEOUT: &str = "tether.dev/lb-idle-timeout";
    /// The addresses wanted, comma-separated, at most one per family (dual-stack);
    /// instead of the deprecated `spec.loadBalancerIP`.
    pub const LOAD_BALANCER_IPS: &str = "tether.dev/load-balancer-ips";
    /// Services naming the same key may share an address when their ports differ.
    pub const SHARING_KEY: &str = "tether.dev/lb-sharing-key";
    /// Comma-separated namespaces (or `*`) whose Services may share this Service's
    /// address under the same sharing key; needed on both Services.
    pub const SHARING_CROSS_NAMESPACE: &str = "tether.dev/lb-sharing-cross-namespace";
    /// `v1` or `v2`: backends get a PROXY protocol header with the client's address.
    pub const PROXY_PROTOCOL: &str = "tether.dev/lb-proxy-protocol";
    /// The legacy annotation for source ranges (used when the spec field is empty).
    pub const SOURCE_RANGES: &str = "service.beta.kubernetes.io/load-balancer-source-ranges";
}

/// Default of [`ServiceInfo::max_connections`] (annotation `tether.dev/lb-max-connections`).
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Default of [`ServiceInfo::idle_timeout`] (annotation `tether.dev/lb-idle-timeout`).
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(3600);

/// One port of a LoadBalancer Service.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServicePort {
    /// Port name.
    pub name: String,
    /// `TCP`, `UDP` or `SCTP`.
    pub protocol: String,
    /// The port clients connect to.
    pub port: u16,
    /// The node port traffic goes to.
    pub node_port: u16,
    /// The ready endpoints (pod IP, targetPort) of this port, used when the Service
    /// has no node ports.
    pub endpoints: Vec<std::net::SocketAddr>,
}

/// A backend node of a load balancer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backend {
    /// Node name.
    pub name: String,
    /// The InternalIP the balancer dials: of the Service's family (its first
    /// `ipFamilies` entry), else the node's first.
    pub address: String,
    /// All its InternalIPs, in the Node's order (so that a node gaining an address of
    /// another family counts as a change of the node set).
    pub addresses: Vec<String>,
}

/// `status.loadBalancer.ingress` entries.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadBalancerStatus {
    /// IP ingress points.
    pub ips: Vec<String>,
    /// Hostname ingress points.
    pub hostnames: Vec<String>,
    /// The balancer is a proxy (`ipMode: Proxy`, Kubernetes 1.30+): kube-proxy must not
    /// capture the address and bypass it.
    pub proxy: bool,
}

/// Load balancers for Services of type LoadBalancer.
#[async_trait]
pub trait LoadBalancers: Send + Sync {
    /// The balancer's status if it exists.
    async fn get(
        &self,
        cluster: &str,
        svc: &ServiceInfo,
    ) -> Result<Option<LoadBalancerStatus>, CloudError>;
    /// Creates or updates the balancer for `svc` over `nodes`.
    async fn ensure(
        &self,
        cluster: &str,
        svc: &ServiceInfo,
        nodes: &[Backend],
    ) -> Result<LoadBalancerStatus, CloudError>;
    /// Points the balancer at a new node set.
    async fn update(
        &self,
        cluster: &str,
        svc: &ServiceInfo,
        nodes: &[Backend],
    ) -> Result<(), CloudError>;
    /// Deletes the balancer (no error if it does not exist).
    async fn delete(&self, cluster: &str, svc: &ServiceInfo) -> Result<(), CloudError>;
    /// Before any sync, with every Service of this provider (with an ingress or not):
    /// what each holds (its status shows, or the provider's own record says) is its,
    /// never handed to another.
    async fn restore(&self, _cluster: &str, _services: &[ServiceInfo]) {}
    /// The controller stops (its hard stop: the drain, lost leadership): forget what is
    /// kept in memory (the next leader reads it back through [`Self::restore`]).
    async fn release_all(&self, _cluster: &str) {}
}

/// A route: traffic for `cidr` goes to `node`'s address.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Route {
    /// Target node name (empty in what a provider lists when it cannot tell; the
    /// controller matches routes by CIDR and next hop).
    pub node: String,
    /// The node's InternalIP (the next hop).
    pub via: String,
    /// The pod CIDR.
    pub cidr: String,
}

/// Routes to pod CIDRs.
#[async_trait]
pub trait Routes: Send + Sync {
    /// Routes the provider manages for `cluster`.
    async fn list(&self, cluster: &str) -> Result<Vec<Route>, CloudError>;
    /// Creates `route`.
    async fn create(&self, cluster: &str, route: &Route) -> Result<(), CloudError>;
    /// Deletes `route`.
    async fn delete(&self, cluster: &str, route: &Route) -> Result<(), CloudError>;
}

/// A cloud provider: whichever of the three interfaces it implements.
pub trait Provider: Send + Sync {
    /// The `--cloud-provider` name.
    fn name(&self) -> &str;
    /// Instances, if supported.
    fn instances(&self) -> Option<Arc<dyn Instances>>;
    /// Load balancers, if supported.
    fn load_balancers(&self) -> Option<Arc<dyn LoadBalancers>> {
        None
    }
    /// Routes, if supported.
    fn routes(&self) -> Option<Arc<dyn Routes>> {
        None
    }
    /// What the provider runs on every replica, leader or not, until `replica.drain`
    /// (upstream's `Initialize`): the `tether` provider's load-balancer data plane.
    /// `None`: nothing.
    fn initialize(&self, _replica: Replica) -> Option<futures::future::BoxFuture<'static, ()>> {
        None
    }
}

/// What the manager gives a provider's [`Provider::initialize`]: the cluster and this
/// replica's settings.
pub struct Replica {
    /// The controller manager's own client.
    pub client: kube::Client,
    /// The leases the provider's per-replica work elects with (`None` without
    /// `--leader-elect`; the load-balancer pools add `-<pool>` to its name).
    pub lease: Option<crate::leader::LeaderElection>,
    /// `--load-balancer-class`.
    pub load_balancer_class: Option<String>,
    /// How often everything is looked at again.
    pub resync: Duration,
    /// Work in parallel (`--concurrent-service-syncs`).
    pub workers: usize,
    /// This replica's identity (its events' source).
    pub identity: String,
    /// Ends the work.
    pub drain: tokio_util::sync::CancellationToken,
}

/// The provider ID scheme of the built-in provider.
pub const TETHER_PROVIDER_ID_PREFIX: &str = "tether://";

/// Provider calls share one client-side token bucket (`--provider-qps`,
/// `--provider-burst`) and are counted, so a large cluster cannot hammer the cloud's
/// API either.
pub fn rate_limited(
    provider: Arc<dyn Provider>,
    limit: Arc<tether_ops::ratelimit::TokenBucket>,
    calls: prometheus::IntCounter,
) -> Arc<dyn Provider> {
    Arc::new(Limited {
        inner: provider,
        gate: Gate { limit, calls },
    })
}

#[derive(Clone)]
struct Gate {
    limit: Arc<tether_ops::ratelimit::TokenBucket>,
    calls: prometheus::IntCounter,
}

impl Gate {
    async fn pass(&self) {
        self.limit.acquire().await;
        self.calls.inc();
    }
}

struct Limited<T: ?Sized> {
    inner: Arc<T>,
    gate: Gate,
}

impl Provider for Limited<dyn Provider> {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn instances(&self) -> Option<Arc<dyn Instances>> {
        let inner = self.inner.instances()?;
        Some(Arc::new(Limited {
            inner,
            gate: self.gate.clone(),
        }))
    }
    fn load_balancers(&self) -> Option<Arc<dyn LoadBalancers>> {
        let inner = self.inner.load_balancers()?;
        Some(Arc::new(Limited {
            inner,
            gate: self.gate.clone(),
        }))
    }
    fn initialize(&self, replica: Replica) -> Option<futures::future::BoxFuture<'static, ()>> {
        self.inner.initialize(replica)
    }
    fn routes(&self) -> Option<Arc<dyn Routes>> {
        let inner = self.inner.routes()?;
        Some(Arc::new(Limited {
            inner,
            gate: self.gate.clone(),
        }))
    }
}

#[async_trait]
impl Instances for Limited<dyn Instances> {
    async fn exists(&self, node: &NodeInfo) -> Result<bool, CloudError> {
        self.gate.pass().await;
        self.inner.exists(node).await
    }
    async fn shutdown(&self, node: &NodeInfo) -> Result<bool, CloudError> {
        self.gate.pass().await;
        self.inner.shutdown(node).await
    }
    async fn metadata(&self, node: &NodeInfo) -> Result<InstanceMetadata, CloudError> {
        self.gate.pass().await;
        self.inner.metadata(node).await
    }
    fn owns(&self, provider_id: &str) -> bool {
        self.inner.owns(provider_id)
    }
}

#[async_trait]
impl LoadBalancers for Limited<dyn LoadBalancers> {
    async fn get(
        &self,
        cluster: &str,
        svc: &ServiceInfo,
    ) -> Result<Option<LoadBalancerStatus>, CloudError> {
        self.gate.pass().await;
        self.inner.get(cluster, svc).await
    }
    async fn ensure(
        &self,
        cluster: &str,
        svc: &ServiceInfo,
        nodes: &[Backend],
    ) -> Result<LoadBalancerStatus, CloudError> {
        self.gate.pass().await;
        self.inner.ensure(cluster, svc, nodes).await
    }
    async fn update(
        &self,
        cluster: &str,
        svc: &ServiceInfo,
        nodes: &[Backend],
    ) -> Result<(), CloudError> {
        self.gate.pass().await;
        self.inner.update(cluster, svc, nodes).await
    }
    async fn delete(&self, cluster: &str, svc: &ServiceInfo) -> Result<(), CloudError> {
        self.gate.pass().await;
        self.inner.delete(cluster, svc).await
    }
    async fn restore(&self, cluster: &str, services: &[ServiceInfo]) {
        self.inner.restore(cluster, services).await
    }
    async fn release_all(&self, cluster: &str) {
        self.inner.release_all(cluster).await
    }
}

#[async_trait]
impl Routes for Limited<dyn Routes> {
    async fn list(&self, cluster: &str) -> Result<Vec<Route>, CloudError> {
        self.gate.pass().await;
        self.inner.list(cluster).await
    }
    async fn create(&self, cluster: &str, route: &Route) -> Result<(), CloudError> {
        self.gate.pass().await;
        self.inner.create(cluster, route).await
    }
    async fn delete(&self, cluster: &str, route: &Route) -> Result<(), CloudError> {
        self.gate.pass().await;
        self.inner.delete(cluster, route).await
    }
}
