//! The built-in `tether` provider, for clusters with no cloud at all: instances come
//! from an inventory file (`--cloud-config`), re-read whenever it changes.
//!
//! ```yaml
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
//! Provider IDs are `tether://NAME`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use async_trait::async_trait;
use serde::Deserialize;

use super::{
    Address, CloudError, InstanceMetadata, Instances, NodeInfo, Provider, TETHER_PROVIDER_ID_PREFIX,
};

/// The `--cloud-provider` name.
pub const NAME: &str = "tether";

/// Why the inventory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    /// The file could not be read.
    #[error("cannot read cloud config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid inventory.
    #[error("cloud config {path} is not a valid tether inventory: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: serde_yaml::Error,
    },
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
#[serde(deny_unknown_fields)]
struct File {
    #[serde(default)]
    nodes: Vec<Machine>,
}

const ADDRESS_TYPES: [&str; 5] = [
    "InternalIP",
    "ExternalIP",
    "Hostname",
    "InternalDNS",
    "ExternalDNS",
];

/// Parses an inventory.
pub fn parse(path: &Path, text: &str) -> Result<BTreeMap<String, Machine>, InventoryError> {
    let file: File = if text.trim().is_empty() {
        File::default()
    } else {
        serde_yaml::from_str(text).map_err(|source| InventoryError::Parse {
            path: path.into(),
            source,
        })?
    };
    let mut machines = BTreeMap::new();
    for m in file.nodes {
        if let Some(a) = m
            .addresses
            .iter()
            .find(|a| !ADDRESS_TYPES.contains(&a.kind.as_str()))
        {
            return Err(InventoryError::Parse {
                path: path.into(),
                source: serde::de::Error::custom(format!(
                    "node {:?}: address type {:?} is not one of {ADDRESS_TYPES:?}",
                    m.name, a.kind
                )),
            });
        }
        let name = m.name.clone();
        if machines.insert(name.clone(), m).is_some() {
            return Err(InventoryError::Duplicate {
                path: path.into(),
                name,
            });
        }
    }
    Ok(machines)
}

struct Loaded {
    modified: Option<SystemTime>,
    machines: BTreeMap<String, Machine>,
}

/// The inventory file, re-read when its modification time changes. A file that
/// becomes invalid keeps the last good inventory (and the error is logged).
pub struct Inventory {
    path: PathBuf,
    loaded: Mutex<Loaded>,
}

impl Inventory {
    /// Loads `path`; errors are start-up errors.
    pub fn load(path: &Path) -> Result<Self, InventoryError> {
        let (modified, text) = read(path)?;
        Ok(Inventory {
            path: path.into(),
            loaded: Mutex::new(Loaded {
                modified,
                machines: parse(path, &text)?,
            }),
        })
    }

    /// The machine called `name`, reading the file again first if it changed.
    pub fn get(&self, name: &str) -> Option<Machine> {
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        let modified = std::fs::metadata(&self.path)
            .and_then(|m| m.modified())
            .ok();
        if modified != loaded.modified {
            match read(&self.path).and_then(|(m, text)| Ok((m, parse(&self.path, &text)?))) {
                Ok((m, machines)) => {
                    tracing::info!(path = %self.path.display(), nodes = machines.len(), "inventory reloaded");
                    loaded.modified = m;
                    loaded.machines = machines;
                }
                Err(e) => {
                    tracing::error!(error = %e, "inventory changed but is invalid; keeping the previous one");
                    loaded.modified = modified;
                }
            }
        }
        loaded.machines.get(name).cloned()
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
    load_balancers: Option<Arc<super::tunnel_lb::TunnelLoadBalancers>>,
}

impl TetherProvider {
    /// A provider over the inventory at `cloud_config`, with load balancers over the
    /// tunnel when `lb` is given.
    pub fn new(
        cloud_config: &Path,
        lb: Option<super::tunnel_lb::TunnelLbConfig>,
    ) -> Result<Self, InventoryError> {
        Ok(TetherProvider {
            inventory: Arc::new(Inventory::load(cloud_config)?),
            load_balancers: lb.map(|c| Arc::new(super::tunnel_lb::TunnelLoadBalancers::new(c))),
        })
    }
}

impl Provider for TetherProvider {
    fn name(&self) -> &str {
        NAME
    }
    fn instances(&self) -> Option<Arc<dyn Instances>> {
        Some(Arc::new(InventoryInstances(self.inventory.clone())))
    }
    fn load_balancers(&self) -> Option<Arc<dyn super::LoadBalancers>> {
        self.load_balancers
            .clone()
            .map(|l| l as Arc<dyn super::LoadBalancers>)
    }
}

struct InventoryInstances(Arc<Inventory>);

impl InventoryInstances {
    /// The inventory name of `node`: from its provider ID when it has ours, else its
    /// name.
    fn machine(&self, node: &NodeInfo) -> Option<Machine> {
        let name = node
            .provider_id
            .as_deref()
            .and_then(|id| id.strip_prefix(TETHER_PROVIDER_ID_PREFIX))
            .unwrap_or(&node.name);
        self.0.get(name)
    }
}

#[async_trait]
impl Instances for InventoryInstances {
    async fn exists(&self, node: &NodeInfo) -> Result<bool, CloudError> {
        Ok(self.machine(node).is_some())
    }

    async fn shutdown(&self, node: &NodeInfo) -> Result<bool, CloudError> {
        self.machine(node)
            .map(|m| m.shutdown)
            .ok_or(CloudError::InstanceNotFound)
    }

    async fn metadata(&self, node: &NodeInfo) -> Result<InstanceMetadata, CloudError> {
        let m = self.machine(node).ok_or(CloudError::InstanceNotFound)?;
        Ok(InstanceMetadata {
            provider_id: format!("{TETHER_PROVIDER_ID_PREFIX}{}", m.name),
            instance_type: m.instance_type,
            addresses: m
                .addresses
                .into_iter()
                .map(|a| Address {
                    kind: a.kind,
                    address: a.address,
                })
                .collect(),
            zone: m.zone,
            region: m.region,
            extra_labels: m.labels,
        })
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
        assert_eq!(ok["a"].zone, "z1");
        assert!(parse(p, "").unwrap().is_empty());
        let dup = parse(p, "nodes:\n- name: a\n- name: a\n").unwrap_err();
        assert!(dup.to_string().contains("listed twice"), "{dup}");
        let typo = parse(p, "nodes:\n- name: a\n  zones: z1\n").unwrap_err();
        assert!(typo.to_string().contains("zones"), "{typo}");
        let kind = parse(
            p,
            "nodes:\n- name: a\n  addresses: [{type: Internal, address: 1.2.3.4}]\n",
        )
        .unwrap_err();
        assert!(kind.to_string().contains("InternalIP"), "{kind}");
    }
}
