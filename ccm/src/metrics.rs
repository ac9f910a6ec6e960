//! The controller manager's metrics under upstream's names, so that dashboards and
//! alerts written for a Go cloud-controller-manager keep working: client-go's
//! `workqueue_*{name}`, `leader_election_master_status{name}`, the service controller's
//! `service_controller_loadbalancer_sync_total`, the route controller's
//! `route_controller_route_sync_total`, plus node and lifecycle counters. One set per
//! process (as client-go's global metrics provider), registered on a registry by
//! [`register`].

use std::sync::OnceLock;

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts,
    Registry,
};

/// Every metric of the controller manager.
pub struct Metrics {
    /// `workqueue_adds_total{name}`.
    pub queue_adds: IntCounterVec,
    /// `workqueue_depth{name}`.
    pub queue_depth: IntGaugeVec,
    /// `workqueue_retries_total{name}`.
    pub queue_retries: IntCounterVec,
    /// `workqueue_queue_duration_seconds{name}`.
    pub queue_latency: HistogramVec,
    /// `workqueue_work_duration_seconds{name}`.
    pub work_duration: HistogramVec,
    /// `workqueue_unfinished_work_seconds{name}`.
    pub unfinished_work: GaugeVec,
    /// `workqueue_longest_running_processor_seconds{name}`.
    pub longest_running: GaugeVec,
    /// `leader_election_master_status{name}`: 1 while this replica leads.
    pub leader: IntGaugeVec,
    /// `service_controller_loadbalancer_sync_total`.
    pub lb_syncs: IntCounter,
    /// `service_controller_nodesync_latency_seconds`.
    pub lb_nodesync_latency: Histogram,
    /// `route_controller_route_sync_total`.
    pub route_syncs: IntCounter,
    /// `node_controller_node_initializations_total{result}`.
    pub node_inits: IntCounterVec,
    /// `node_lifecycle_controller_node_deletions_total{reason}`.
    pub node_deletions: IntCounterVec,
    /// `node_lifecycle_controller_deletions_withheld_total{reason}`: nodes the provider
    /// does not know that were kept by policy.
    pub deletions_withheld: IntCounterVec,
    /// `tether_ccm_lb_connections_total{service,result}`.
    pub lb_connections: IntCounterVec,
    /// `tether_ccm_lb_active_connections{service}`.
    pub lb_active: IntGaugeVec,
    /// `tether_ccm_lb_bytes_total{service,direction}`.
    pub lb_bytes: IntCounterVec,
    /// `tether_ccm_lb_addresses_in_use{pool}`.
    pub lb_addresses_in_use: IntGaugeVec,
    /// `tether_ccm_lb_addresses_total{pool}`.
    pub lb_addresses_total: IntGaugeVec,
}

fn latency_buckets() -> Vec<f64> {
    // client-go's: 1 ns to 10 s by factors of 10.
    prometheus::exponential_buckets(1e-8, 10.0, 10).expect("valid buckets")
}

impl Metrics {
    fn new() -> Self {
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric")
        };
        Metrics {
            queue_adds: counter_vec(
                "workqueue_adds_total",
                "Total number of adds handled by workqueue",
                &["name"],
            ),
            queue_depth: IntGaugeVec::new(
                Opts::new("workqueue_depth", "Current depth of workqueue"),
                &["name"],
            )
            .expect("valid metric"),
            queue_retries: counter_vec(
                "workqueue_retries_total",
                "Total number of retries handled by workqueue",
                &["name"],
            ),
            queue_latency: HistogramVec::new(
                HistogramOpts::new(
                    "workqueue_queue_duration_seconds",
                    "How long in seconds an item stays in workqueue before being requested.",
                )
                .buckets(latency_buckets()),
                &["name"],
            )
            .expect("valid metric"),
            work_duration: HistogramVec::new(
                HistogramOpts::new(
                    "workqueue_work_duration_seconds",
                    "How long in seconds processing an item from workqueue takes.",
                )
                .buckets(latency_buckets()),
                &["name"],
            )
            .expect("valid metric"),
            unfinished_work: GaugeVec::new(
                Opts::new(
                    "workqueue_unfinished_work_seconds",
                    "How many seconds of work has been done that is in progress and hasn't been observed by work_duration.",
                ),
                &["name"],
            )
            .expect("valid metric"),
            longest_running: GaugeVec::new(
                Opts::new(
                    "workqueue_longest_running_processor_seconds",
                    "How many seconds has the longest running processor for workqueue been running.",
                ),
                &["name"],
            )
            .expect("valid metric"),
            leader: IntGaugeVec::new(
                Opts::new(
                    "leader_election_master_status",
                    "Gauge of if the reporting system is master of the relevant lease, 0 indicates backup, 1 indicates master. 'name' is the string used to identify the lease.",
                ),
                &["name"],
            )
            .expect("valid metric"),
            lb_syncs: IntCounter::new(
                "service_controller_loadbalancer_sync_total",
                "A metric counting the amount of times any load balancer has been configured, as an effect of service/node changes on the cluster",
            )
            .expect("valid metric"),
            lb_nodesync_latency: Histogram::with_opts(
                HistogramOpts::new(
                    "service_controller_nodesync_latency_seconds",
                    "A metric measuring the latency for nodesync which updates loadbalancer hosts on cluster node updates.",
                )
                .buckets(prometheus::exponential_buckets(1.0, 2.0, 15).expect("valid buckets")),
            )
            .expect("valid metric"),
            route_syncs: IntCounter::new(
                "route_controller_route_sync_total",
                "A metric counting the amount of times routes have been synced with the cloud provider.",
            )
            .expect("valid metric"),
            node_inits: counter_vec(
                "node_controller_node_initializations_total",
                "Nodes the cloud-node controller tried to initialise, by result (initialized, failed).",
                &["result"],
            ),
            node_deletions: counter_vec(
                "node_lifecycle_controller_node_deletions_total",
                "Nodes deleted because the cloud provider no longer knows them, by reason.",
                &["reason"],
            ),
            lb_connections: counter_vec(
                "tether_ccm_lb_connections_total",
                "Client connections to load balancers by Service and result: accepted, refused_source_range, refused_limit (the Service's), refused_global_limit (--lb-max-connections), no_backend (no node answered).",
                &["service", "result"],
            ),
            lb_active: IntGaugeVec::new(
                Opts::new(
                    "tether_ccm_lb_active_connections",
                    "Connections a load balancer has open now (dialing or forwarding), by Service; what its connection limit counts.",
                ),
                &["service"],
            )
            .expect("valid metric"),
            lb_bytes: counter_vec(
                "tether_ccm_lb_bytes_total",
                "Bytes forwarded by load balancers, by Service and direction (to_backend, to_client).",
                &["service", "direction"],
            ),
            lb_addresses_in_use: IntGaugeVec::new(
                Opts::new(
                    "tether_ccm_lb_addresses_in_use",
                    "Load-balancer addresses held by Services, by pool.",
                ),
                &["pool"],
            )
            .expect("valid metric"),
            lb_addresses_total: IntGaugeVec::new(
                Opts::new(
                    "tether_ccm_lb_addresses_total",
                    "Load-balancer addresses in each pool (IPv4 CIDRs without their network and broadcast addresses).",
                ),
                &["pool"],
            )
            .expect("valid metric"),
            deletions_withheld: counter_vec(
                "node_lifecycle_controller_deletions_withheld_total",
                "Checks of not-Ready nodes unknown to the provider that were not deleted, by reason (uninitialized: never initialised by this CCM).",
                &["reason"],
            ),
        }
    }

    fn collectors(&self) -> Vec<Box<dyn prometheus::core::Collector>> {
        vec![
            Box::new(self.queue_adds.clone()),
            Box::new(self.queue_depth.clone()),
            Box::new(self.queue_retries.clone()),
            Box::new(self.queue_latency.clone()),
            Box::new(self.work_duration.clone()),
            Box::new(self.unfinished_work.clone()),
            Box::new(self.longest_running.clone()),
            Box::new(self.leader.clone()),
            Box::new(self.lb_syncs.clone()),
            Box::new(self.lb_nodesync_latency.clone()),
            Box::new(self.route_syncs.clone()),
            Box::new(self.node_inits.clone()),
            Box::new(self.node_deletions.clone()),
            Box::new(self.deletions_withheld.clone()),
            Box::new(self.lb_connections.clone()),
            Box::new(self.lb_active.clone()),
            Box::new(self.lb_bytes.clone()),
            Box::new(self.lb_addresses_in_use.clone()),
            Box::new(self.lb_addresses_total.clone()),
        ]
    }
}

/// The process's metrics.
pub fn get() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::new)
}

/// Registers every metric on `registry` (once per registry).
pub fn register(registry: &Registry) -> Result<(), prometheus::Error> {
    for c in get().collectors() {
        registry.register(c)?;
    }
    Ok(())
}
