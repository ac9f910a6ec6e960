//! The controller manager's metrics under upstream's names, so that dashboards and
//! alerts written for a Go cloud-controller-manager keep working: client-go's
//! `workqueue_*{name}`, `leader_election_master_status{name}`, the service controller's
//! `service_controller_loadbalancer_sync_total`, the route controller's
//! `route_controller_route_sync_total`, plus node and lifecycle counters, and the process's own
//! families. One set per controller manager, passed to what counts.

use prometheus::{
    GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGaugeVec, Opts,
};
use tether_ops::metrics::Catalog;

fn latency_buckets() -> Vec<f64> {
    // client-go's: 1 ns to 10 s by factors of 10.
    prometheus::exponential_buckets(1e-8, 10.0, 10).expect("valid buckets")
}

fn counter_vec(catalog: &Catalog, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    catalog.made(IntCounterVec::new(Opts::new(name, help), labels))
}

tether_ops::metric_set! {
    /// Every metric of the controller manager, each declared once.
    pub struct Metrics in catalog {
        /// `workqueue_adds_total{name}`.
        pub queue_adds: IntCounterVec = counter_vec(&catalog,
            "workqueue_adds_total",
            "Total number of adds handled by workqueue",
            &["name"],
        ),
        /// `workqueue_depth{name}`.
        pub queue_depth: IntGaugeVec = catalog.made(IntGaugeVec::new(
            Opts::new("workqueue_depth", "Current depth of workqueue"),
            &["name"],
        )),
        /// `workqueue_retries_total{name}`.
        pub queue_retries: IntCounterVec = counter_vec(&catalog,
            "workqueue_retries_total",
            "Total number of retries handled by workqueue",
            &["name"],
        ),
        /// `workqueue_queue_duration_seconds{name}`.
        pub queue_latency: HistogramVec = catalog.made(HistogramVec::new(
            HistogramOpts::new(
                "workqueue_queue_duration_seconds",
                "How long in seconds an item stays in workqueue before being requested.",
            )
            .buckets(latency_buckets()),
            &["name"],
        )),
        /// `workqueue_work_duration_seconds{name}`.
        pub work_duration: HistogramVec = catalog.made(HistogramVec::new(
            HistogramOpts::new(
                "workqueue_work_duration_seconds",
                "How long in seconds processing an item from workqueue takes.",
            )
            .buckets(latency_buckets()),
            &["name"],
        )),
        /// `workqueue_unfinished_work_seconds{name}`.
        pub unfinished_work: GaugeVec = catalog.made(GaugeVec::new(
            Opts::new(
                "workqueue_unfinished_work_seconds",
                "How many seconds of work has been done that is in progress and hasn't been observed by work_duration.",
            ),
            &["name"],
        )),
        /// `workqueue_longest_running_processor_seconds{name}`.
        pub longest_running: GaugeVec = catalog.made(GaugeVec::new(
            Opts::new(
                "workqueue_longest_running_processor_seconds",
                "How many seconds has the longest running processor for workqueue been running.",
            ),
            &["name"],
        )),
        /// `leader_election_master_status{name}`: 1 while this replica leads.
        pub leader: IntGaugeVec = catalog.made(IntGaugeVec::new(
            Opts::new(
                "leader_election_master_status",
                "Gauge of if the reporting system is master of the relevant lease, 0 indicates backup, 1 indicates master. 'name' is the string used to identify the lease.",
            ),
            &["name"],
        )),
        /// `service_controller_loadbalancer_sync_total`.
        pub lb_syncs: IntCounter = catalog.made(IntCounter::new(
            "service_controller_loadbalancer_sync_total",
            "A metric counting the amount of times any load balancer has been configured, as an effect of service/node changes on the cluster",
        )),
        /// `service_controller_nodesync_latency_seconds`.
        pub lb_nodesync_latency: Histogram = catalog.made(Histogram::with_opts(
            HistogramOpts::new(
                "service_controller_nodesync_latency_seconds",
                "A metric measuring the latency for nodesync which updates loadbalancer hosts on cluster node updates.",
            )
            .buckets(prometheus::exponential_buckets(1.0, 2.0, 15).expect("valid buckets")),
        )),
        /// `route_controller_route_sync_total`.
        pub route_syncs: IntCounter = catalog.made(IntCounter::new(
            "route_controller_route_sync_total",
            "A metric counting the amount of times routes have been synced with the cloud provider.",
        )),
        /// `node_controller_node_initializations_total{result}`.
        pub node_inits: IntCounterVec = counter_vec(&catalog,
            "node_controller_node_initializations_total",
            "Nodes the cloud-node controller tried to initialise, by result (initialized, failed).",
            &["result"],
        ),
        /// Nodes left uninitialized, by reason (`no_addresses`).
        pub node_init_failures: IntCounterVec = counter_vec(&catalog,
            "tether_ccm_node_initialization_failures_total",
            "Attempts to initialise a node that left it uninitialized, by reason: no_addresses (its kubelet reports none and the provider knows none: give the kubelet --node-ip, or list the node in the inventory).",
            &["reason"],
        ),
        /// `node_lifecycle_controller_node_deletions_total{reason}`.
        pub node_deletions: IntCounterVec = counter_vec(&catalog,
            "node_lifecycle_controller_node_deletions_total",
            "Nodes deleted because the cloud provider no longer knows them, by reason.",
            &["reason"],
        ),
        /// `node_lifecycle_controller_deletions_withheld_total{reason}`: nodes the provider
        /// does not know that were kept by policy.
        pub deletions_withheld: IntCounterVec = counter_vec(&catalog,
            "node_lifecycle_controller_deletions_withheld_total",
            "Checks of not-Ready nodes unknown to the provider that were not deleted, by reason (uninitialized: never initialised by this CCM).",
            &["reason"],
        ),
        /// `tether_ccm_lb_connections_total{service,result}`.
        pub lb_connections: IntCounterVec = counter_vec(&catalog,
            "tether_ccm_lb_connections_total",
            "Client connections to load balancers by Service and result: accepted, refused_source_range, refused_limit (the Service's), refused_global_limit (--lb-max-connections), no_backend (no node answered).",
            &["service", "result"],
        ),
        /// `tether_ccm_lb_active_connections{service}`.
        pub lb_active: IntGaugeVec = catalog.made(IntGaugeVec::new(
            Opts::new(
                "tether_ccm_lb_active_connections",
                "Connections a load balancer has open now (dialing or forwarding), by Service; what its connection limit counts.",
            ),
            &["service"],
        )),
        /// `tether_ccm_lb_backends{service}`.
        pub lb_backends: IntGaugeVec = catalog.made(IntGaugeVec::new(
            Opts::new(
                "tether_ccm_lb_backends",
                "Backends a load balancer chooses from now, by Service: the nodes serving its NodePort, or its ready endpoints. 0 means every connection is refused.",
            ),
            &["service"],
        )),
        /// `tether_ccm_lb_bytes_total{service,direction}`.
        pub lb_bytes: IntCounterVec = counter_vec(&catalog,
            "tether_ccm_lb_bytes_total",
            "Bytes forwarded by load balancers, by Service and direction (to_backend, to_client).",
            &["service", "direction"],
        ),
        /// `tether_ccm_lb_addresses_in_use{pool}`.
        pub lb_addresses_in_use: IntGaugeVec = catalog.made(IntGaugeVec::new(
            Opts::new(
                "tether_ccm_lb_addresses_in_use",
                "Load-balancer addresses held by Services, by pool.",
            ),
            &["pool"],
        )),
        /// `tether_ccm_lb_addresses_total{pool}`.
        pub lb_addresses_total: IntGaugeVec = catalog.made(IntGaugeVec::new(
            Opts::new(
                "tether_ccm_lb_addresses_total",
                "Load-balancer addresses in each pool (IPv4 CIDRs without their network and broadcast addresses).",
            ),
            &["pool"],
        )),
        /// client-go's `rest_client_requests_total` and
        /// `rest_client_request_duration_seconds`.
        pub rest: tether_ops::kubeclient::RestMetrics =
            tether_ops::kubeclient::RestMetrics::new(&catalog),
        /// `tether_ccm_provider_calls_total`.
        pub provider_calls: IntCounter = catalog.made(IntCounter::new(
            "tether_ccm_provider_calls_total",
            "Calls made to the cloud provider.",
        )),
    }
}

impl Metrics {
    /// Every metric of the controller manager, beside the process's own families
    /// (`process_*`, `promhttp_*`, heap), in a registry of their own.
    pub fn new() -> Self {
        Self::declare(Catalog::with_process())
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}
