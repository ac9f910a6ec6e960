//! The ready endpoints of Services: from EndpointSlices (`discovery.k8s.io/v1`, else
//! `v1beta1` as 1.20 serves it), which hold every endpoint, or, where neither is served
//! or the CCM may not read them, from core/v1 Endpoints (which stop at 1,000 addresses).

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tether_core::error::chain;

use k8s_openapi::api::core::v1::Endpoints;
use kube::api::{Api, ListParams};
use kube::core::{ApiResource, DynamicObject, GroupVersionKind};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::ResourceExt;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::workqueue::WorkQueue;

/// The label naming an EndpointSlice's Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// The ready endpoints of one Service.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ready {
    /// By Service port name (`""` for an unnamed port): (address, target port), sorted.
    pub ports: HashMap<String, Vec<SocketAddr>>,
    /// The nodes that run a ready endpoint.
    pub nodes: BTreeSet<String>,
}

/// Where the endpoints come from: a watch of EndpointSlices or of Endpoints, whose
/// changes queue the Service's key.
#[derive(Clone)]
pub enum EndpointsCache {
    /// EndpointSlices of this API version.
    Slices(Store<DynamicObject>, &'static str),
    /// core/v1 Endpoints.
    Endpoints(Store<Endpoints>),
}

impl EndpointsCache {
    /// Starts the watch: EndpointSlices of the newest version the apiserver serves and
    /// the CCM may list, else Endpoints. Discovery failures are retried until `hard_stop`
    /// (`None` then).
    pub async fn spawn(
        client: kube::Client,
        queue: Arc<WorkQueue>,
        hard_stop: CancellationToken,
    ) -> Option<EndpointsCache> {
        let version = loop {
            match slice_version(&client).await {
                Ok(v) => break v,
                Err(e) => {
                    tracing::warn!(error = %chain(&e), "cannot discover the EndpointSlice API; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = hard_stop.cancelled() => return None,
                    }
                }
            }
        };
        let Some(version) = version else {
            tracing::info!(
                "endpoints from core/v1 Endpoints: this apiserver serves no EndpointSlice API"
            );
            return Some(Self::endpoints(client, queue, hard_stop));
        };
        let ar = ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("discovery.k8s.io", version, "EndpointSlice"),
            "endpointslices",
        );
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
        match api.list(&ListParams::default().limit(1)).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 403 => {
                tracing::warn!(
                    "endpoints from core/v1 Endpoints, which stop at 1,000 addresses: this CCM may not list discovery.k8s.io endpointslices (give its ClusterRole the rule in deploy/tether-ccm.yaml)"
                );
                return Some(Self::endpoints(client, queue, hard_stop));
            }
            // Anything else the watch retries.
            Err(_) => {}
        }
        tracing::info!(version, "endpoints from EndpointSlices");
        let store = crate::informer::spawn_with(
            "endpointslices",
            api,
            ar,
            |s: &DynamicObject| {
                Some(format!(
                    "{}/{}",
                    s.namespace()?,
                    s.labels().get(SERVICE_NAME_LABEL)?
                ))
            },
            vec![queue],
            hard_stop,
        );
        Some(EndpointsCache::Slices(store, version))
    }

    fn endpoints(
        client: kube::Client,
        queue: Arc<WorkQueue>,
        hard_stop: CancellationToken,
    ) -> Self {
        EndpointsCache::Endpoints(crate::informer::spawn(
            "endpoints",
            Api::<Endpoints>::all(client),
            vec![queue],
            hard_stop,
        ))
    }

    /// Waits for the first list.
    pub async fn wait_until_ready(&self) -> Result<(), String> {
        match self {
            EndpointsCache::Slices(s, _) => s.wait_until_ready().await,
            EndpointsCache::Endpoints(s) => s.wait_until_ready().await,
        }
        .map_err(|e| chain(&e).to_string())
    }

    /// What is read: `discovery.k8s.io/<version> EndpointSlices` or `v1 Endpoints`.
    pub fn source(&self) -> String {
        match self {
            EndpointsCache::Slices(_, v) => format!("discovery.k8s.io/{v} EndpointSlices"),
            EndpointsCache::Endpoints(_) => "v1 Endpoints".into(),
        }
    }

    /// The ready endpoints of Service `namespace/name`.
    pub fn ready(&self, namespace: &str, name: &str) -> Ready {
        match self {
            EndpointsCache::Endpoints(s) => {
                from_endpoints(s.get(&ObjectRef::new(name).within(namespace)).as_deref())
            }
            EndpointsCache::Slices(s, _) => {
                let slices: Vec<Slice> = s
                    .state()
                    .iter()
                    .filter(|o| {
                        o.metadata.namespace.as_deref() == Some(namespace)
                            && o.labels().get(SERVICE_NAME_LABEL).map(String::as_str) == Some(name)
                    })
                    .filter_map(|o| serde_json::from_value(o.data.clone()).ok())
                    .collect();
                from_slices(&slices)
            }
        }
    }
}

/// The newest EndpointSlice version served (`v1`, else `v1beta1`), if any.
async fn slice_version(client: &kube::Client) -> Result<Option<&'static str>, kube::Error> {
    let group = match kube::discovery::oneshot::group(client, "discovery.k8s.io").await {
        Ok(g) => g,
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(None),
        Err(e) => return Err(e),
    };
    let versions: Vec<String> = group.versions().map(str::to_string).collect();
    Ok(["v1", "v1beta1"]
        .into_iter()
        .find(|v| versions.iter().any(|s| s == v)))
}

/// An EndpointSlice, either version: v1beta1 names the node in `topology` (and, behind
/// a 1.20 alpha gate, in `nodeName`), v1 in `nodeName`.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Slice {
    #[serde(default)]
    address_type: String,
    #[serde(default)]
    endpoints: Option<Vec<SliceEndpoint>>,
    #[serde(default)]
    ports: Option<Vec<SlicePort>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct SliceEndpoint {
    #[serde(default)]
    addresses: Vec<String>,
    #[serde(default)]
    conditions: Conditions,
    #[serde(default)]
    node_name: Option<String>,
    #[serde(default)]
    topology: Option<HashMap<String, String>>,
}

#[derive(Debug, Default, Deserialize)]
struct Conditions {
    /// Absent: unknown, which consumers take as ready (the API's advice).
    ready: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
struct SlicePort {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    port: Option<i32>,
}

fn from_slices(slices: &[Slice]) -> Ready {
    let mut ready = Ready::default();
    for s in slices {
        if s.address_type != "IPv4" && s.address_type != "IPv6" {
            continue;
        }
        let endpoints = s.endpoints.iter().flatten();
        for e in endpoints.filter(|e| e.conditions.ready != Some(false)) {
            let node = e.node_name.clone().or_else(|| {
                e.topology
                    .as_ref()
                    .and_then(|t| t.get("kubernetes.io/hostname").cloned())
            });
            if let Some(node) = node {
                ready.nodes.insert(node);
            }
            for p in s.ports.iter().flatten() {
                let Some(port) = p.port.and_then(|p| u16::try_from(p).ok()) else {
                    continue;
                };
                let name = p.name.clone().unwrap_or_default();
                for ip in e.addresses.iter().filter_map(|a| a.parse().ok()) {
                    ready.add(&name, SocketAddr::new(ip, port));
                }
            }
        }
    }
    ready.sorted()
}

impl Ready {
    fn add(&mut self, port_name: &str, addr: SocketAddr) {
        self.ports
            .entry(port_name.to_string())
            .or_default()
            .push(addr);
    }

    /// Each port's addresses sorted, each once (slices may repeat an endpoint).
    fn sorted(mut self) -> Ready {
        for addrs in self.ports.values_mut() {
            addrs.sort();
            addrs.dedup();
        }
        self
    }
}

fn from_endpoints(endpoints: Option<&Endpoints>) -> Ready {
    let mut ready = Ready::default();
    for subset in endpoints
        .into_iter()
        .flat_map(|e| e.subsets.iter().flatten())
    {
        for a in subset.addresses.iter().flatten() {
            if let Some(n) = &a.node_name {
                ready.nodes.insert(n.clone());
            }
            let Ok(ip) = a.ip.parse() else { continue };
            for p in subset.ports.iter().flatten() {
                if let Ok(port) = u16::try_from(p.port) {
                    ready.add(p.name.as_deref().unwrap_or(""), SocketAddr::new(ip, port));
                }
            }
        }
    }
    ready.sorted()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(json: serde_json::Value) -> Slice {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn v1_and_v1beta1_slices_read_alike() {
        // As 1.20 serves v1beta1: the node in topology, an unready and an unknown one.
        let beta = slice(serde_json::json!({
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.0.1.5"], "conditions": {"ready": true},
                 "topology": {"kubernetes.io/hostname": "node-1"}},
                {"addresses": ["10.0.2.5"], "conditions": {"ready": false},
                 "topology": {"kubernetes.io/hostname": "node-2"}},
                {"addresses": ["10.0.3.5"], "conditions": {},
                 "topology": {"kubernetes.io/hostname": "node-3"}}
            ],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]
        }));
        // As v1 (1.21 and later) serves it: nodeName, a second slice of the same
        // Service, a duplicate address across slices, an FQDN slice ignored.
        let v1 = slice(serde_json::json!({
            "addressType": "IPv4",
            "endpoints": [
                {"addresses": ["10.0.4.5"], "conditions": {"ready": true, "serving": true,
                 "terminating": false}, "nodeName": "node-4", "zone": "a"},
                {"addresses": ["10.0.1.5"], "conditions": {"ready": true}, "nodeName": "node-1"}
            ],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]
        }));
        let fqdn = slice(serde_json::json!({
            "addressType": "FQDN",
            "endpoints": [{"addresses": ["web.example"], "nodeName": "node-5"}],
            "ports": [{"name": "http", "port": 80}]
        }));
        let r = from_slices(&[beta, v1, fqdn]);
        assert_eq!(
            r.nodes.iter().map(String::as_str).collect::<Vec<_>>(),
            ["node-1", "node-3", "node-4"]
        );
        let addrs: Vec<String> = r.ports["http"].iter().map(|a| a.to_string()).collect();
        assert_eq!(addrs, ["10.0.1.5:8080", "10.0.3.5:8080", "10.0.4.5:8080"]);
    }

    #[test]
    fn a_slice_without_ports_or_endpoints_is_empty() {
        let r = from_slices(&[slice(serde_json::json!({"addressType": "IPv6",
            "endpoints": null, "ports": null}))]);
        assert_eq!(r, Ready::default());
    }

    #[test]
    fn endpoints_read_as_before() {
        let ep: Endpoints = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "web", "namespace": "default"},
            "subsets": [{
                "addresses": [{"ip": "10.0.1.5", "nodeName": "node-1"}],
                "notReadyAddresses": [{"ip": "10.0.2.5", "nodeName": "node-2"}],
                "ports": [{"name": "http", "port": 8080}]
            }]
        }))
        .unwrap();
        let r = from_endpoints(Some(&ep));
        assert_eq!(r.nodes.iter().collect::<Vec<_>>(), ["node-1"]);
        assert_eq!(r.ports["http"], ["10.0.1.5:8080".parse().unwrap()]);
    }
}
