//! Tether's cloud-controller-manager: the node, node-lifecycle, route and service
//! controllers of upstream's cloud-provider, on kube-rs, behind the provider traits in
//! [`cloud`]. One shared watch per resource feeds every controller ([`informer`]);
//! controllers work off keyed queues with per-key backoff ([`workqueue`]); only the
//! replica holding the leader Lease runs them ([`leader`]).

pub mod cloud;
pub mod controllers;
pub mod credentials;
pub mod endpoints;
pub mod informer;
pub mod lb;
pub mod leader;
mod manager;
pub mod metrics;
pub mod netlink;
pub mod provider;
pub mod serving;
pub mod translate;
pub mod workqueue;

use std::time::Duration;

pub use manager::run;

/// The controllers `--controllers` can name: (canonical name, alias). The canonical
/// names are upstream's (k8s.io/cloud-provider `names`), the aliases its older short
/// names; both are accepted wherever a name is.
pub const CONTROLLERS: [(&str, &str); 5] = [
    ("cloud-node-controller", "cloud-node"),
    ("cloud-node-lifecycle-controller", "cloud-node-lifecycle"),
    ("node-route-controller", "route"),
    ("service-lb-controller", "service"),
    (
        controllers::csr_approver::NAME,
        controllers::csr_approver::NAME,
    ),
];

/// Upstream controllers this build does not have: naming them off (`-name`) is accepted
/// so that upstream command lines start; turning one on is refused with the reason.
pub const UNSUPPORTED: [(&str, &str); 1] = [(
    "node-ipam-controller",
    "node IPAM is kube-controller-manager's (its --allocate-node-cidrs)",
)];

/// Which controllers run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Enabled {
    /// `cloud-node-controller`.
    pub node: bool,
    /// `cloud-node-lifecycle-controller`.
    pub node_lifecycle: bool,
    /// `node-route-controller`.
    pub route: bool,
    /// `service-lb-controller`.
    pub service: bool,
    /// `kubelet-serving-csr-approver`.
    pub csr_approver: bool,
}

impl Enabled {
    /// Parses `--controllers` with upstream's rules: `*` turns on every controller not
    /// named otherwise, `name` turns one on, `-name` off, and for each controller the
    /// first entry naming it (by canonical name or alias) wins.
    pub fn parse(list: &[String]) -> Result<Self, String> {
        // (on, name) per entry; `*` stays as a name of its own.
        let items: Vec<(bool, &str)> = list
            .iter()
            .map(|s| s.trim())
            .filter(|s| !s.is_empty())
            .map(|s| match s.strip_prefix('-') {
                Some(name) => (false, name),
                None => (true, s),
            })
            .collect();
        for &(on, name) in &items {
            if let Some((_, why)) = UNSUPPORTED.iter().find(|(n, _)| *n == name) {
                if on {
                    return Err(format!(
                        "--controllers: {name} is not in this build: {why}; leave it off (-{name})"
                    ));
                }
                continue;
            }
            let known = CONTROLLERS.iter().any(|(c, a)| name == *c || name == *a);
            if !(known || (on && name == "*")) {
                return Err(format!(
                    "--controllers: unknown controller {name:?} (known: {}; or * for all)",
                    CONTROLLERS
                        .iter()
                        .map(|(c, a)| if c == a {
                            c.to_string()
                        } else {
                            format!("{c} ({a})")
                        })
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
        let star = items.contains(&(true, "*"));
        // The first entry naming the controller wins; otherwise `*` decides.
        let is_on = |index: usize| {
            let (canonical, alias) = CONTROLLERS[index];
            items
                .iter()
                .find(|(_, name)| *name == canonical || *name == alias)
                .map_or(star, |&(on, _)| on)
        };
        Ok(Enabled {
            node: is_on(0),
            node_lifecycle: is_on(1),
            route: is_on(2),
            service: is_on(3),
            csr_approver: is_on(4),
        })
    }
}

/// Settings of the controller manager.
#[derive(Debug, Clone)]
pub struct CcmConfig {
    /// `--cluster-name`.
    pub cluster_name: String,
    /// Controllers to run.
    pub enabled: Enabled,
    /// `--node-monitor-period` (5 s).
    pub node_monitor_period: Duration,
    /// `--node-status-update-frequency` (5 min).
    pub node_status_update_frequency: Duration,
    /// `--load-balancer-class`.
    pub load_balancer_class: Option<String>,
    /// How often every load balancer is ensured again (drift repair).
    pub lb_resync_period: Duration,
    /// `--concurrent-service-syncs` (1).
    pub concurrent_service_syncs: usize,
    /// `--concurrent-node-syncs` (1).
    pub concurrent_node_syncs: usize,
    /// `--cluster-cidr` (comma-separated, one per family); the route controller runs
    /// only when it is set and `--configure-cloud-routes` is true.
    pub cluster_cidrs: Vec<tether_core::identifiers::Cidr>,
    /// `--configure-cloud-routes` (true).
    pub configure_cloud_routes: bool,
    /// `--route-reconciliation-period` (10 s).
    pub route_reconciliation_period: Duration,
    /// Leader election; `None` with `--leader-elect=false`.
    pub leader_election: Option<leader::LeaderElection>,
    /// The load-balancer pools' leases (shorter than the controllers'; `name` is their
    /// prefix, `-<pool>` is added): each pool's holder holds and serves its addresses.
    /// `None` with `--leader-elect=false`.
    pub load_balancer_lease: Option<leader::LeaderElection>,
    /// Reported as the event source.
    pub identity: String,
    /// The controller manager's metrics (served on the secure port).
    pub metrics: metrics::Metrics,
}

/// Why the controller manager stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CcmError {
    /// Leadership was lost; upstream exits so that it restarts clean.
    #[error("leader election lost")]
    LeadershipLost,
    /// The node cache never synced.
    #[error("node watch never synced: {0}")]
    CacheSync(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controllers_flag_follows_upstream_syntax() {
        let p = |s: &[&str]| Enabled::parse(&s.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let all = p(&["*"]).unwrap();
        // Upstream's canonical names, aliases, and the first match winning.
        let upstream = p(&["*", "-node-route-controller", "-service-lb-controller"]).unwrap();
        assert!(upstream.node && upstream.node_lifecycle && !upstream.route && !upstream.service);
        assert!(!p(&["-cloud-node", "cloud-node-controller"]).unwrap().node);
        assert!(p(&["cloud-node-controller", "-cloud-node"]).unwrap().node);
        assert_eq!(
            p(&["cloud-node-controller", "cloud-node-lifecycle-controller"]).unwrap(),
            p(&["cloud-node", "cloud-node-lifecycle"]).unwrap()
        );
        assert!(all.node && all.node_lifecycle && all.route && all.service && all.csr_approver);
        assert!(
            !p(&["*", "-kubelet-serving-csr-approver"])
                .unwrap()
                .csr_approver
        );
        let no_route = p(&["*", "-route"]).unwrap();
        assert!(no_route.node && !no_route.route);
        let only = p(&["cloud-node"]).unwrap();
        assert!(only.node && !only.service);
        assert!(p(&["cloud-nodes"])
            .unwrap_err()
            .contains("unknown controller"));
        assert!(p(&["*", "-node-ipam-controller"]).unwrap().node);
        assert!(p(&["*", "node-ipam-controller"])
            .unwrap_err()
            .contains("kube-controller-manager"));
    }
}
