//! A fault-injecting fake cloud provider for the CCM tests (a test double behind the
//! `test-util` feature, never the product's default): machines with metadata and a shutdown flag, load balancers that
//! record what they were asked, and injected errors and latency.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::cloud::{
    Address, Backend, CloudError, InstanceMetadata, Instances, LoadBalancerStatus, LoadBalancers,
    NodeInfo, Provider, ServiceInfo,
};
use async_trait::async_trait;

/// What a load balancer call was.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LbCall {
    /// `ensure(service key, nodes)`.
    Ensure(String, Vec<String>),
    /// `update(service key, nodes)`.
    Update(String, Vec<String>),
    /// `delete(service key)`.
    Delete(String),
}

#[derive(Default)]
struct State {
    machines: BTreeMap<String, (InstanceMetadata, bool)>,
    /// Errors the next calls return, in order.
    faults: VecDeque<CloudError>,
    latency: Duration,
    calls: usize,
    lb_calls: Vec<LbCall>,
}

/// The fake provider; clones share state.
#[derive(Clone, Default)]
pub struct FakeCloud {
    state: Arc<Mutex<State>>,
}

impl std::fmt::Debug for FakeCloud {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeCloud").finish_non_exhaustive()
    }
}

impl FakeCloud {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap()
    }

    /// Adds (or replaces) machine `name` with InternalIP `ip` in `zone`.
    pub fn add_machine(&self, name: &str, ip: &str, zone: &str) {
        let meta = InstanceMetadata {
            provider_id: format!("fake://{name}"),
            instance_type: "fake-1".into(),
            addresses: vec![Address {
                kind: "InternalIP".into(),
                address: ip.into(),
            }],
            zone: zone.into(),
            region: "fake-region".into(),
            extra_labels: BTreeMap::new(),
        };
        self.state().machines.insert(name.into(), (meta, false));
    }

    /// Removes machine `name`.
    pub fn remove_machine(&self, name: &str) {
        self.state().machines.remove(name);
    }

    /// Marks machine `name` shut down (or running).
    pub fn set_shutdown(&self, name: &str, shutdown: bool) {
        if let Some(m) = self.state().machines.get_mut(name) {
            m.1 = shutdown;
        }
    }

    /// The next calls fail with `errors`, in order.
    pub fn fail_next(&self, errors: impl IntoIterator<Item = CloudError>) {
        self.state().faults.extend(errors);
    }

    /// Every call takes this long.
    pub fn set_latency(&self, latency: Duration) {
        self.state().latency = latency;
    }

    /// How many calls were made.
    pub fn calls(&self) -> usize {
        self.state().calls
    }

    /// The load balancer calls so far.
    pub fn lb_calls(&self) -> Vec<LbCall> {
        self.state().lb_calls.clone()
    }

    async fn enter(&self) -> Result<(), CloudError> {
        let (latency, fault) = {
            let mut s = self.state();
            s.calls += 1;
            (s.latency, s.faults.pop_front())
        };
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }
        fault.map_or(Ok(()), Err)
    }

    fn machine(&self, node: &NodeInfo) -> Option<(InstanceMetadata, bool)> {
        self.state().machines.get(&node.name).cloned()
    }
}

impl Provider for FakeCloud {
    fn name(&self) -> &str {
        "fake"
    }
    fn instances(&self) -> Option<Arc<dyn Instances>> {
        Some(Arc::new(self.clone()))
    }
    fn load_balancers(&self) -> Option<Arc<dyn LoadBalancers>> {
        Some(Arc::new(self.clone()))
    }
}

#[async_trait]
impl Instances for FakeCloud {
    async fn exists(&self, node: &NodeInfo) -> Result<bool, CloudError> {
        self.enter().await?;
        Ok(self.machine(node).is_some())
    }
    async fn shutdown(&self, node: &NodeInfo) -> Result<bool, CloudError> {
        self.enter().await?;
        self.machine(node)
            .map(|m| m.1)
            .ok_or(CloudError::InstanceNotFound)
    }
    async fn metadata(&self, node: &NodeInfo) -> Result<InstanceMetadata, CloudError> {
        self.enter().await?;
        self.machine(node)
            .map(|m| m.0)
            .ok_or(CloudError::InstanceNotFound)
    }
}

fn key(svc: &ServiceInfo) -> String {
    format!("{}/{}", svc.namespace, svc.name)
}

fn names(nodes: &[Backend]) -> Vec<String> {
    nodes.iter().map(|n| n.name.clone()).collect()
}

#[async_trait]
impl LoadBalancers for FakeCloud {
    async fn get(
        &self,
        _cluster: &str,
        _svc: &ServiceInfo,
    ) -> Result<Option<LoadBalancerStatus>, CloudError> {
        self.enter().await?;
        Ok(None)
    }
    async fn ensure(
        &self,
        _cluster: &str,
        svc: &ServiceInfo,
        nodes: &[Backend],
    ) -> Result<LoadBalancerStatus, CloudError> {
        self.enter().await?;
        self.state()
            .lb_calls
            .push(LbCall::Ensure(key(svc), names(nodes)));
        Ok(LoadBalancerStatus {
            ips: vec!["192.0.2.10".into()],
            hostnames: Vec::new(),
            proxy: false,
        })
    }
    async fn update(
        &self,
        _cluster: &str,
        svc: &ServiceInfo,
        nodes: &[Backend],
    ) -> Result<(), CloudError> {
        self.enter().await?;
        self.state()
            .lb_calls
            .push(LbCall::Update(key(svc), names(nodes)));
        Ok(())
    }
    async fn delete(&self, _cluster: &str, svc: &ServiceInfo) -> Result<(), CloudError> {
        self.enter().await?;
        self.state().lb_calls.push(LbCall::Delete(key(svc)));
        Ok(())
    }
}
