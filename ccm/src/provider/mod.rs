//! The built-in `tether` provider, for clusters with no cloud at all: instances come
//! from an inventory file (`--cloud-config`), re-read whenever it changes, merged with
//! the nodes whose Tether agent is connected; routes go into the host's routing table;
//! load balancers forward through the tunnel.
//!
//! ```yaml
//! agents:                    # optional: a node whose (verified) agent is connected exists
//!   urls: [http://127.0.0.1:8133/agents]   # the Tether servers' admin endpoints
//!   deleteNodesAfterSeconds: 86400  # opt-in; absent: never deleted for its agent leaving
//!   trustUnverifiedIdentifiers: false  # labs only
//! routes:                    # optional, off when absent: THIS HOST is the pod-network
//!   table: 254               # router; main table
//!   protocol: 84             # marks our routes (`ip route show proto 84`)
//! loadBalancer:              # addresses for LoadBalancer Services (see lb::addresses)
//!   interface: eth0          # the leader adds and announces them here
//!   pools:
//!   - {name: public, addresses: [192.0.2.10-192.0.2.49]}
//! nodes:
//!   - name: node-a
//!     region: eu-west
//!     zone: eu-west-1a
//!     instanceType: bare-metal
//!     addresses:
//!       - {type: InternalIP, address: 10.0.0.1}
//!     labels: {example.com/rack: r1}
//!     shutdown: false        # true: the machine exists but is powered off
//! ```
//!
//! Provider IDs are `tether://NAME`. Each node initialised gets the label
//! `tether.dev/instance-source` (`inventory` or `agent`): the deletion policy follows
//! it. An inventory node is deleted (once not Ready) only when the inventory no longer
//! lists it; an agent node only under `deleteNodesAfterSeconds`.

pub mod agents;
pub mod host_routes;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use tether_core::error::chain;

use async_trait::async_trait;
use serde::Deserialize;

use crate::cloud::{
    Address, CloudError, InstanceMetadata, Instances, NodeInfo, Provider, TETHER_PROVIDER_ID_PREFIX,
};

/// The `--cloud-provider` name.
pub const NAME: &str = "tether";

/// The label saying where a node's instance is known from.
pub const SOURCE_LABEL: &str = "tether.dev/instance-source";
/// [`SOURCE_LABEL`] of a node listed in the inventory.
pub const FROM_INVENTORY: &str = "inventory";
/// [`SOURCE_LABEL`] of a node known through its connected agent.
pub const FROM_AGENT: &str = "agent";

/// Is `key` a label in a reserved domain: Kubernetes' (`kubernetes.io`, `k8s.io` and
/// their subdomains) or ours (`tether.dev`)? The inventory may not set those: they are
/// the kubelet's, the scheduler's and this CCM's own (topology, instance type, source).
pub fn reserved_label(key: &str) -> bool {
    let Some((domain, _)) = key.split_once('/') else {
        return false;
    };
    let domain = domain.to_ascii_lowercase();
    ["kubernetes.io", "k8s.io"]
        .iter()
        .any(|r| domain == *r || domain.ends_with(&format!(".{r}")))
        || domain == "tether.dev"
}

/// Why the inventory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    /// The file could not be read.
    #[error("cannot read cloud config {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid inventory.
    #[error("cloud config {path} is not a valid tether inventory")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: serde_yaml::Error,
    },
    /// Load balancers are configured inconsistently (flags against the file).
    #[error("{0}")]
    LoadBalancer(String),
    /// Two entries for one node.
    #[error("cloud config {path}: node {name:?} is listed twice")]
    Duplicate {
        /// The file.
        path: PathBuf,
        /// The node.
        name: String,
    },
}

/// One machine of the inventory.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Machine {
    /// The Node name.
    pub name: String,
    /// `topology.kubernetes.io/region`.
    #[serde(default)]
    pub region: String,
    /// `topology.kubernetes.io/zone`.
    #[serde(default)]
    pub zone: String,
    /// `node.kubernetes.io/instance-type`.
    #[serde(default)]
    pub instance_type: String,
    /// Node addresses.
    #[serde(default)]
    pub addresses: Vec<InventoryAddress>,
    /// Extra labels.
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The machine exists but is powered off.
    #[serde(default)]
    pub shutdown: bool,
}

/// An address in the inventory.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct InventoryAddress {
    /// `InternalIP`, `ExternalIP`, `Hostname`, `InternalDNS` or `ExternalDNS`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The address.
    pub address: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct File {
    #[serde(default)]
    nodes: Vec<Machine>,
    #[serde(default)]
    agents: Option<agents::AgentsConfig>,
    #[serde(default)]
    routes: Option<host_routes::HostRoutesConfig>,
    #[serde(default)]
    load_balancer: Option<crate::lb::addresses::LoadBalancerConfig>,
}

/// A parsed cloud config.
#[derive(Debug, Default)]
pub struct CloudConfig {
    /// The inventory, by node name.
    pub machines: BTreeMap<String, Machine>,
    /// Where to learn which agents are connected, if anywhere (URLs validated).
    pub agents: Option<agents::ConnectedAgents>,
    /// Where routes go; `None` (no `routes:` section): no routes at all.
    pub routes: Option<host_routes::HostRoutesConfig>,
    /// Load-balancer address pools (validated); `None`: no `loadBalancer:` section.
    pub load_balancer: Option<crate::lb::addresses::Pools>,
}

const ADDRESS_TYPES: [&str; 5] = [
    "InternalIP",
    "ExternalIP",
    "Hostname",
    "InternalDNS",
    "ExternalDNS",
];

/// Parses a cloud config.
pub fn parse(path: &Path, text: &str) -> Result<CloudConfig, InventoryError> {
    let file: File = if text.trim().is_empty() {
        File::default()
    } else {
        serde_yaml::from_str(text).map_err(|source| InventoryError::Parse {
            path: path.into(),
            source,
        })?
    };
    let invalid = |e: String| InventoryError::Parse {
        path: path.into(),
        source: serde::de::Error::custom(e),
    };
    let mut machines = BTreeMap::new();
    for m in file.nodes {
        check_machine(&m).map_err(invalid)?;
        let name = m.name.clone();
        if machines.insert(name.clone(), m).is_some() {
            return Err(InventoryError::Duplicate {
                path: path.into(),
                name,
            });
        }
    }
    let agents = file
        .agents
        .as_ref()
        .map(|a| agents::ConnectedAgents::new(a).map_err(|e| invalid(e.to_string())))
        .transpose()?;
    let load_balancer = file
        .load_balancer
        .as_ref()
        .map(|lb| crate::lb::addresses::Pools::new(lb).map_err(|e| invalid(e.to_string())))
        .transpose()?;
    Ok(CloudConfig {
        machines,
        agents,
        routes: file.routes,
        load_balancer,
    })
}

/// What is wrong with an inventory entry: an address type Kubernetes does not have, or
/// a label in a domain the CCM or Kubernetes sets.
fn check_machine(m: &Machine) -> Result<(), String> {
    if let Some(a) = m
        .addresses
        .iter()
        .find(|a| !ADDRESS_TYPES.contains(&a.kind.as_str()))
    {
        return Err(format!(
            "node {:?}: address type {:?} is not one of {ADDRESS_TYPES:?}",
            m.name, a.kind
        ));
    }
    if let Some(key) = m.labels.keys().find(|k| reserved_label(k)) {
        return Err(format!(
            "node {:?}: label {key:?} is in a reserved domain (kubernetes.io, k8s.io, tether.dev): use region/zone/instanceType for topology, and your own domain for the rest",
            m.name
        ));
    }
    Ok(())
}

struct Loaded {
    modified: Option<SystemTime>,
    /// When the file's modification time was last looked at.
    checked: Instant,
    machines: BTreeMap<String, Machine>,
    /// The `loadBalancer:` pools as last read.
    pools: Option<crate::lb::addresses::Pools>,
}

/// The file's modification time is looked at no more often than this.
const RECHECK: Duration = Duration::from_secs(1);

/// The inventory file, re-read when its modification time changes. A file that
/// becomes invalid keeps the last good inventory (and the error is logged).
pub struct Inventory {
    path: PathBuf,
    loaded: Mutex<Loaded>,
}

impl Inventory {
    /// Loads `path`; errors are start-up errors. The rest of the config comes back
    /// beside it (its `machines` moved into the inventory).
    pub fn load(path: &Path) -> Result<(Self, CloudConfig), InventoryError> {
        let (modified, text) = read(path)?;
        let mut config = parse(path, &text)?;
        let inventory = Inventory {
            path: path.into(),
            loaded: Mutex::new(Loaded {
                modified,
                checked: Instant::now(),
                machines: std::mem::take(&mut config.machines),
                pools: config.load_balancer.clone(),
            }),
        };
        Ok((inventory, config))
    }

    /// The machine called `name`, reading the file again first if it changed.
    pub fn get(&self, name: &str) -> Option<Machine> {
        self.current().machines.get(name).cloned()
    }

    /// The `loadBalancer:` pools, reading the file again first if it changed: pools
    /// change without a restart.
    pub fn pools(&self) -> Option<crate::lb::addresses::Pools> {
        self.current().pools.clone()
    }

    /// What is loaded, re-read first when the file changed (at most once a second). A
    /// file that became invalid keeps the previous contents.
    fn current(&self) -> std::sync::MutexGuard<'_, Loaded> {
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        if loaded.checked.elapsed() < RECHECK {
            return loaded;
        }
        loaded.checked = Instant::now();
        let modified = std::fs::metadata(&self.path)
            .and_then(|m| m.modified())
            .ok();
        if modified != loaded.modified {
            match read(&self.path).and_then(|(m, text)| Ok((m, parse(&self.path, &text)?))) {
                Ok((m, config)) => {
                    let machines = config.machines;
                    tracing::info!(path = %self.path.display(), nodes = machines.len(), "inventory reloaded");
                    loaded.modified = m;
                    loaded.machines = machines;
                    loaded.pools = config.load_balancer;
                }
                Err(e) => {
                    tracing::error!(error = %chain(&e), "inventory changed but is invalid; keeping the previous one");
                    loaded.modified = modified;
                }
            }
        }
        loaded
    }
}

fn read(path: &Path) -> Result<(Option<SystemTime>, String), InventoryError> {
    let err = |source| InventoryError::Read {
        path: path.into(),
        source,
    };
    let modified = std::fs::metadata(path).map_err(err)?.modified().ok();
    let text = std::fs::read_to_string(path).map_err(err)?;
    Ok((modified, text))
}

/// The `tether` provider.
pub struct TetherProvider {
    inventory: Arc<Inventory>,
    agents: Option<Arc<agents::ConnectedAgents>>,
    routes: Option<Arc<host_routes::HostRoutes>>,
    load_balancers: Option<Arc<crate::lb::balancer::TunnelLoadBalancers>>,
}

impl TetherProvider {
    /// A provider over the inventory at `cloud_config`, with load balancers over the
    /// tunnel when `lb` is given (their addresses from the file's `loadBalancer:`
    /// pools, else `lb.bind`).
    pub fn new(
        cloud_config: &Path,
        lb: Option<crate::lb::balancer::TunnelLbConfig>,
    ) -> Result<Self, InventoryError> {
        let (inventory, config) = Inventory::load(cloud_config)?;
        let inventory = Arc::new(inventory);
        Ok(TetherProvider {
            inventory: inventory.clone(),
            agents: config.agents.map(Arc::new),
            routes: config
                .routes
                .map(|r| Arc::new(host_routes::HostRoutes::new(r))),
            load_balancers: match (lb, config.load_balancer) {
                // Off unless asked for: no pools and no --lb-bind-address.
                (Some(c), None) if c.bind.is_none() => {
                    tracing::info!("no loadBalancer pools in the cloud config and no --lb-bind-address: LoadBalancer Services are left alone");
                    None
                }
                (Some(c), pools) => {
                    let with_pools = pools.is_some();
                    let lbs = crate::lb::balancer::TunnelLoadBalancers::new(c, pools)
                        .map_err(InventoryError::LoadBalancer)?;
                    if with_pools {
                        let inventory = inventory.clone();
                        lbs.allocations()
                            .reloading_pools(Arc::new(move || inventory.pools()));
                    }
                    Some(Arc::new(lbs))
                }
                (None, Some(_)) => {
                    return Err(InventoryError::LoadBalancer(format!(
                        "cloud config {}: loadBalancer pools are configured but --tunnel-uds is not set: load balancers reach the nodes through the Tether server's socket",
                        cloud_config.display()
                    )))
                }
                (None, None) => None,
            },
        })
    }
}

impl TetherProvider {
    /// Whether its load balancers hold and announce addresses (`loadBalancer.interface`).
    pub fn announces(&self) -> bool {
        self.load_balancers.as_ref().is_some_and(|l| l.announces())
    }
}

impl Provider for TetherProvider {
    fn name(&self) -> &str {
        NAME
    }
    fn instances(&self) -> Option<Arc<dyn Instances>> {
        Some(Arc::new(InventoryInstances {
            inventory: self.inventory.clone(),
            agents: self.agents.clone(),
        }))
    }
    fn routes(&self) -> Option<Arc<dyn crate::cloud::Routes>> {
        self.routes
            .clone()
            .map(|r| r as Arc<dyn crate::cloud::Routes>)
    }
    fn load_balancers(&self) -> Option<Arc<dyn crate::cloud::LoadBalancers>> {
        self.load_balancers
            .as_ref()
            .map(|l| l.allocations().clone() as Arc<dyn crate::cloud::LoadBalancers>)
    }
    /// The load balancers' data plane, on every replica: the allocation record kept
    /// for the service controller if this replica leads, and each pool whose lease this
    /// replica holds served.
    fn initialize(
        &self,
        replica: crate::cloud::Replica,
    ) -> Option<futures::future::BoxFuture<'static, ()>> {
        let lbs = self.load_balancers.clone()?;
        lbs.allocations().keep_record(&replica.client);
        Some(Box::pin(crate::lb::pools::run(lbs, replica)))
    }
}

struct InventoryInstances {
    inventory: Arc<Inventory>,
    agents: Option<Arc<agents::ConnectedAgents>>,
}

/// Where a node's instance is known from.
enum Found {
    Inventory(Machine, String),
    Agent(agents::Agent, String),
    /// Not listed, and known only through an agent that is away; the policy keeps it.
    Absent,
    /// An agent claims it without verification.
    Unverified(String),
    Gone,
}

impl InventoryInstances {
    /// The node's inventory name (from its provider ID when it has ours, else its
    /// name), looked up in the inventory, then among the connected agents; a node no
    /// longer in either goes by its source label and the deletion policy.
    async fn find(&self, node: &NodeInfo) -> Result<Found, CloudError> {
        let name = node
            .provider_id
            .as_deref()
            .and_then(|id| id.strip_prefix(TETHER_PROVIDER_ID_PREFIX))
            .unwrap_or(&node.name)
            .to_string();
        if let Some(m) = self.inventory.get(&name) {
            return Ok(Found::Inventory(m, name));
        }
        let source = node.labels.get(SOURCE_LABEL).map(String::as_str);
        let presence = match &self.agents {
            Some(agents) => Some(agents.presence(&name).await?),
            None => None,
        };
        Ok(match presence {
            Some(agents::Presence::Connected(a)) => Found::Agent(a, name),
            // The operator took it out of the inventory.
            _ if source == Some(FROM_INVENTORY) => Found::Gone,
            Some(agents::Presence::Unverified(why)) => Found::Unverified(why),
            Some(agents::Presence::Absent) => Found::Absent,
            Some(agents::Presence::Gone) => Found::Gone,
            // No agents section: an agent node keeps existing (the section may come
            // back); anything else was the inventory's.
            None if source == Some(FROM_AGENT) => Found::Absent,
            None => Found::Gone,
        })
    }

    /// The agent's (counted) addresses as InternalIPs, when the node's agent is
    /// connected.
    async fn agent_addresses(&self, name: &str) -> Vec<Address> {
        let Some(agents) = &self.agents else {
            return Vec::new();
        };
        match agents.presence(name).await {
            Ok(agents::Presence::Connected(a)) => internal_ips(&a),
            _ => Vec::new(),
        }
    }
}

fn internal_ips(agent: &agents::Agent) -> Vec<Address> {
    agent
        .ips
        .iter()
        .map(|ip| Address {
            kind: "InternalIP".into(),
            address: ip.clone(),
        })
        .collect()
}

#[async_trait]
impl Instances for InventoryInstances {
    async fn exists(&self, node: &NodeInfo) -> Result<bool, CloudError> {
        Ok(!matches!(self.find(node).await?, Found::Gone))
    }

    async fn shutdown(&self, node: &NodeInfo) -> Result<bool, CloudError> {
        match self.find(node).await? {
            Found::Inventory(m, _) => Ok(m.shutdown),
            Found::Agent(..) | Found::Absent | Found::Unverified(_) => Ok(false),
            Found::Gone => Err(CloudError::InstanceNotFound),
        }
    }

    async fn metadata(&self, node: &NodeInfo) -> Result<InstanceMetadata, CloudError> {
        match self.find(node).await? {
            Found::Inventory(m, name) => {
                let mut addresses: Vec<Address> = m
                    .addresses
                    .into_iter()
                    .map(|a| Address {
                        kind: a.kind,
                        address: a.address,
                    })
                    .collect();
                if addresses.is_empty() {
                    addresses = self.agent_addresses(&name).await;
                }
                let mut extra_labels = m.labels;
                extra_labels.insert(SOURCE_LABEL.into(), FROM_INVENTORY.into());
                Ok(InstanceMetadata {
                    provider_id: format!("{TETHER_PROVIDER_ID_PREFIX}{name}"),
                    instance_type: m.instance_type,
                    addresses,
                    zone: m.zone,
                    region: m.region,
                    extra_labels,
                })
            }
            Found::Agent(a, name) => Ok(InstanceMetadata {
                provider_id: format!("{TETHER_PROVIDER_ID_PREFIX}{name}"),
                addresses: internal_ips(&a),
                extra_labels: [(SOURCE_LABEL.to_string(), FROM_AGENT.to_string())].into(),
                ..Default::default()
            }),
            Found::Absent => Err(CloudError::RetryAfter {
                after: Duration::from_secs(30),
                reason: "the node is not in the inventory and its agent is not connected".into(),
            }),
            Found::Unverified(why) => Err(CloudError::Unverified(why)),
            Found::Gone => Err(CloudError::InstanceNotFound),
        }
    }

    fn owns(&self, provider_id: &str) -> bool {
        provider_id.starts_with(TETHER_PROVIDER_ID_PREFIX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_rejects_what_an_operator_would_get_wrong() {
        let p = Path::new("inv.yaml");
        let ok = parse(
            p,
            "nodes:\n- name: a\n  zone: z1\n  region: r\n  instanceType: t\n  addresses:\n  - {type: InternalIP, address: 10.0.0.1}\n",
        )
        .unwrap();
        assert_eq!(ok.machines["a"].zone, "z1");
        assert!(ok.routes.is_none(), "routes are opt-in");
        let routes = parse(p, "routes: {}\n").unwrap().routes.unwrap();
        assert_eq!(routes.table, 254);
        assert!(parse(p, "").unwrap().machines.is_empty());
        let agents = parse(p, "agents: {urls: [\"127.0.0.1:8133\"]}\n").unwrap_err();
        assert!(
            tether_core::error::chain(&agents)
                .to_string()
                .contains("admin port"),
            "{agents}"
        );
        let dup = parse(p, "nodes:\n- name: a\n- name: a\n").unwrap_err();
        assert!(
            tether_core::error::chain(&dup)
                .to_string()
                .contains("listed twice"),
            "{dup}"
        );
        let typo = parse(p, "nodes:\n- name: a\n  zones: z1\n").unwrap_err();
        assert!(
            tether_core::error::chain(&typo)
                .to_string()
                .contains("zones"),
            "{typo}"
        );
        let kind = parse(
            p,
            "nodes:\n- name: a\n  addresses: [{type: Internal, address: 1.2.3.4}]\n",
        )
        .unwrap_err();
        assert!(
            tether_core::error::chain(&kind)
                .to_string()
                .contains("InternalIP"),
            "{kind}"
        );
        for key in [
            "node-role.kubernetes.io/edge",
            "kubernetes.io/hostname",
            "k8s.io/x",
            "tether.dev/instance-source",
        ] {
            let e = parse(p, &format!("nodes:\n- name: a\n  labels: {{{key}: x}}\n")).unwrap_err();
            assert!(
                tether_core::error::chain(&e)
                    .to_string()
                    .contains("reserved domain"),
                "{key}: {e}"
            );
        }
        assert!(parse(
            p,
            "nodes:\n- name: a\n  labels: {example.com/rack: r1, plain: x}\n"
        )
        .is_ok());
        assert!(!reserved_label("notkubernetes.io/x"));
    }
}
