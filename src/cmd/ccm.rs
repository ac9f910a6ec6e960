//! `tether ccm`: the cloud-controller-manager, with upstream's flag names and defaults.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use tether_ccm::cloud::Provider;
use tether_ccm::leader::LeaderElection;
use tether_ccm::provider::TetherProvider;
use tether_ccm::{CcmConfig, Enabled};
use tether_ops::ratelimit::TokenBucket;
use tracing::Instrument;

use super::{duration, go_bool, LogArgs};

/// Flags of `tether ccm`.
#[derive(Args, Debug)]
// Go's pflag: a repeated flag's last value wins (managed offerings append overrides
// after their defaults); list flags append.
#[command(args_override_self = true)]
pub struct CcmArgs {
    /// Cloud provider: `tether`, the only one in this build (an inventory file, no cloud).
    #[arg(long, default_value = tether_ccm::provider::NAME)]
    pub cloud_provider: String,
    /// The provider's configuration (for `tether`: the inventory file; required).
    #[arg(long, default_value = "")]
    pub cloud_config: String,
    /// Kubeconfig (empty: in-cluster).
    #[arg(long, default_value = "")]
    pub kubeconfig: String,
    /// Controllers to run: `*`, names, `-name` to disable.
    ///
    /// The first entry naming a controller wins. Names: cloud-node-controller,
    /// cloud-node-lifecycle-controller, node-route-controller, service-lb-controller,
    /// kubelet-serving-csr-approver (or the aliases cloud-node, cloud-node-lifecycle,
    /// route, service). `-node-ipam-controller` is accepted; turning node-ipam-controller
    /// on is refused (kube-controller-manager allocates podCIDRs).
    #[arg(long, default_value = "*", value_delimiter = ',')]
    pub controllers: Vec<String>,
    /// Elect a leader among replicas on a Lease.
    ///
    /// Only the leader runs the controllers; a leader that cannot renew in time exits.
    /// With false there are no load-balancer pool leases either: run exactly one replica
    /// (a warning says so when loadBalancer.interface is set).
    #[arg(long, default_value = "true", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub leader_elect: bool,
    /// How long a leader's lease is valid.
    ///
    /// Start-up refuses anything but retry period < renew deadline < lease duration.
    #[arg(long, default_value = "15s", value_parser = duration)]
    pub leader_elect_lease_duration: Duration,
    /// A leader that cannot renew within this steps down.
    #[arg(long, default_value = "10s", value_parser = duration)]
    pub leader_elect_renew_deadline: Duration,
    /// How often to try to acquire or renew.
    #[arg(long, default_value = "2s", value_parser = duration)]
    pub leader_elect_retry_period: Duration,
    /// Lease namespace.
    #[arg(long, default_value = "kube-system")]
    pub leader_elect_resource_namespace: String,
    /// Lease name.
    #[arg(long, default_value = "cloud-controller-manager")]
    pub leader_elect_resource_name: String,
    /// How long each load-balancer pool's own Lease is valid.
    ///
    /// The Lease is `<--leader-elect-resource-name>-lb-<pool>`; its holder holds and
    /// serves the pool's addresses. Shorter than the controllers' so that a crashed
    /// holder's addresses move within seconds. Start-up refuses anything but retry period
    /// < renew deadline and deadline + retry period <= duration (whole seconds). With
    /// --leader-elect=false there is no such Lease. Tether only.
    #[arg(long, default_value = "4s", value_parser = duration)]
    pub lb_lease_duration: Duration,
    /// A pool's lease holder that cannot renew within this lets go. Tether only.
    #[arg(long, default_value = "2s", value_parser = duration)]
    pub lb_lease_renew_deadline: Duration,
    /// How often to try to acquire or renew a pool's lease. Tether only.
    #[arg(long, default_value = "500ms", value_parser = duration)]
    pub lb_lease_retry_period: Duration,
    /// Lock type: only `leases`, upstream's default, is supported.
    #[arg(long, default_value = "leases", value_parser = ["leases"])]
    pub leader_elect_resource_lock: String,
    /// How often not-ready nodes are checked with the provider.
    ///
    /// A node the provider says is gone (by the deletion policies) is deleted; one it says
    /// is shut down gets the node.cloudprovider.kubernetes.io/shutdown taint, removed once
    /// it is Ready.
    #[arg(long, default_value = "5s", value_parser = duration)]
    pub node_monitor_period: Duration,
    /// How often node addresses and the inventory's labels are synced from the provider.
    #[arg(long, default_value = "5m", value_parser = duration)]
    pub node_status_update_frequency: Duration,
    /// Cluster name passed to the provider.
    #[arg(long, default_value = "kubernetes")]
    pub cluster_name: String,
    /// How often the route controller reconciles pod-network routes.
    #[arg(long, default_value = "10s", value_parser = duration)]
    pub route_reconciliation_period: Duration,
    /// Program a route per node podCIDR (needs --cluster-cidr); false turns routes off.
    ///
    /// The route controller also needs a `routes:` section in the cloud config.
    #[arg(long, default_value = "true", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub configure_cloud_routes: bool,
    /// The pod network, comma-separated for dual stack (e.g. 10.244.0.0/16,fd00:10::/56);
    /// routes are made for podCIDRs inside it and only ours inside it are deleted.
    #[arg(long, default_value = "")]
    pub cluster_cidr: String,
    /// Must stay false: Tether's CCM has no node-IPAM controller.
    ///
    /// true is refused at start-up: kube-controller-manager allocates podCIDRs with its
    /// own --allocate-node-cidrs.
    #[arg(long, default_value = "false", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub allocate_node_cidrs: bool,
    /// Nodes initialised at once.
    #[arg(long, default_value_t = 1)]
    pub concurrent_node_syncs: usize,
    /// Each controller calls the API as its own ServiceAccount in kube-system.
    ///
    /// The ServiceAccounts are node-controller, service-controller, route-controller and
    /// kubelet-serving-csr-approver, with one-hour tokens from the TokenRequest API
    /// renewed at 80% of their life; watches and leader election stay on --kubeconfig's
    /// identity. Without it everything runs as --kubeconfig's identity.
    #[arg(long, default_value = "false", value_parser = go_bool, num_args = 0..=1, default_missing_value = "true")]
    pub use_service_account_credentials: bool,
    /// Kubeconfig for TokenReviews of /metrics callers (empty: --kubeconfig).
    #[arg(long, default_value = "")]
    pub authentication_kubeconfig: String,
    /// Kubeconfig for SubjectAccessReviews of /metrics callers (empty: --kubeconfig).
    #[arg(long, default_value = "")]
    pub authorization_kubeconfig: String,
    /// Services synced at once (never the same one twice).
    #[arg(long, default_value_t = 1)]
    pub concurrent_service_syncs: usize,
    /// Services with this `loadBalancerClass` are handled too.
    ///
    /// Those without one always are. Tether only.
    #[arg(long, default_value = "")]
    pub load_balancer_class: String,
    /// Without loadBalancer pools: the address every load balancer listens on.
    ///
    /// tether provider: the one ingress IP all Services share, colliding ports refused
    /// with a PortCollision event. Refused together with loadBalancer pools in the cloud
    /// config, and needs --tunnel-uds. Tether only.
    #[arg(long, default_value = "")]
    pub lb_bind_address: String,
    /// The Tether server's gRPC frontend socket, through which load balancers reach nodes.
    ///
    /// tether provider. Empty: no load balancers. Tether only.
    #[arg(long, default_value = "")]
    pub tunnel_uds: String,
    /// Client connections open at once over every load balancer.
    ///
    /// tether provider. Past three quarters of it, only Services under their fair share
    /// (the cap over the Services holding connections, plus one) get more. More are
    /// refused and counted (refused_global_limit). Each Service also has its own limit,
    /// the tether.dev/lb-max-connections annotation. Tether only.
    #[arg(long, default_value_t = tether_ccm::lb::balancer::DEFAULT_MAX_CONNECTIONS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub lb_max_connections: usize,
    /// How often every load balancer is ensured again (drift repair). Tether only.
    #[arg(long, default_value = "1m", value_parser = duration)]
    pub lb_resync_period: Duration,
    /// Kubernetes API requests per second (client-side limit).
    #[arg(long, default_value_t = 20.0)]
    pub kube_api_qps: f64,
    /// Kubernetes API burst above the rate.
    #[arg(long, default_value_t = 30)]
    pub kube_api_burst: u32,
    /// Cloud provider calls per second (client-side limit). Tether only.
    #[arg(long, default_value_t = 20.0)]
    pub provider_qps: f64,
    /// Cloud provider burst above the rate. Tether only.
    #[arg(long, default_value_t = 30)]
    pub provider_burst: u32,
    /// HTTPS port for /healthz and /metrics; 0 turns it off.
    ///
    /// /healthz (also /livez and /readyz) is anonymous, with one check per controller plus
    /// leader election. /metrics needs a bearer token a TokenReview accepts and a
    /// SubjectAccessReview allowing `get` on /metrics.

    #[arg(long, default_value_t = 10258)]
    pub secure_port: u16,
    /// Address the HTTPS endpoint binds.
    #[arg(long, default_value = "0.0.0.0")]
    pub bind_address: String,
    /// Serving certificate (with --tls-private-key-file); a self-signed one is made at
    /// start-up when not given.
    #[arg(long, default_value = "")]
    pub tls_cert_file: String,
    /// Serving key.
    #[arg(long, default_value = "")]
    pub tls_private_key_file: String,
    #[command(flatten)]
    pub log: LogArgs,
}

impl CcmArgs {
    /// The HTTPS endpoint's address and TLS config (None with --secure-port=0).
    fn secure_listener(
        &self,
    ) -> anyhow::Result<Option<(std::net::SocketAddr, Arc<rustls::ServerConfig>)>> {
        if self.secure_port == 0 {
            return Ok(None);
        }
        let ip: std::net::IpAddr = self.bind_address.parse().with_context(|| {
            format!(
                "--bind-address {:?} is not an IP address",
                self.bind_address
            )
        })?;
        let tls = match (
            self.tls_cert_file.as_str(),
            self.tls_private_key_file.as_str(),
        ) {
            ("", "") => {
                // Self-signed, as upstream does without a certificate; kept in memory
                // only, so no key is left on disk.
                let ca = tether_certs::Ca::new("tether-ccm-self-signed-ca")
                    .context("cannot make a self-signed serving certificate")?;
                let pair = ca
                    .issue(&tether_certs::LeafSpec {
                        common_name: "localhost".into(),
                        sans: vec!["localhost".into(), "127.0.0.1".into(), "::1".into()],
                        server: true,
                        ..Default::default()
                    })
                    .context("cannot make a self-signed serving certificate")?;
                tether_core::tls::server_config_from_pem(
                    pair.cert_pem.as_bytes(),
                    pair.key_pem.as_bytes(),
                    &[b"http/1.1"],
                )?
            }
            ("", _) | (_, "") => bail!("--tls-cert-file and --tls-private-key-file go together"),
            (cert, key) => tether_core::tls::server_config(
                &tether_core::tls::TlsFiles {
                    cert: cert.into(),
                    key: key.into(),
                    ca: None,
                    policy: Default::default(),
                },
                &[b"http/1.1"],
            )?,
        };
        Ok(Some((std::net::SocketAddr::new(ip, self.secure_port), tls)))
    }

    /// Validates the flags into the controller manager's settings and its provider.
    fn config(&self) -> anyhow::Result<(CcmConfig, Arc<dyn Provider>)> {
        let enabled = Enabled::parse(&self.controllers).map_err(anyhow::Error::msg)?;
        let cluster_cidrs = self.cluster_cidrs()?;
        self.check_routes_and_nodes(&cluster_cidrs)?;
        let metrics = tether_ccm::metrics::Metrics::new();
        let lb = self.tunnel_lb(&metrics)?;
        let provider = self.provider(lb)?;
        self.check_leases()?;
        self.check_rates_and_periods()?;
        let identity = identity();
        let config = CcmConfig {
            metrics,
            cluster_name: self.cluster_name.clone(),
            enabled,
            node_monitor_period: self.node_monitor_period,
            node_status_update_frequency: self.node_status_update_frequency,
            load_balancer_class: (!self.load_balancer_class.is_empty())
                .then(|| self.load_balancer_class.clone()),
            lb_resync_period: self.lb_resync_period,
            concurrent_service_syncs: self.concurrent_service_syncs,
            concurrent_node_syncs: self.concurrent_node_syncs,
            cluster_cidrs,
            configure_cloud_routes: self.configure_cloud_routes,
            route_reconciliation_period: self.route_reconciliation_period,
            leader_election: self.leader_election(&identity),
            load_balancer_lease: self.load_balancer_lease(&identity),
            identity,
        };
        Ok((config, provider))
    }

    /// --cluster-cidr's ranges.
    fn cluster_cidrs(&self) -> anyhow::Result<Vec<tether_core::identifiers::Cidr>> {
        self.cluster_cidr
            .split(',')
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(|c| {
                c.parse::<tether_core::identifiers::Cidr>()
                    .map_err(|e| anyhow::anyhow!("--cluster-cidr {c:?}: {e}"))
            })
            .collect::<anyhow::Result<Vec<_>>>()
    }

    /// Checks the route controller's flags (a pod network when it runs) and the node
    /// controllers' (no node IPAM, at least one sync at a time).
    fn check_routes_and_nodes(
        &self,
        cluster_cidrs: &[tether_core::identifiers::Cidr],
    ) -> anyhow::Result<()> {
        let named = |n: &str| self.controllers.iter().any(|c| c.trim() == n);
        if (named("route") || named("node-route-controller"))
            && self.configure_cloud_routes
            && cluster_cidrs.is_empty()
        {
            bail!("--controllers names route but --cluster-cidr is not set: give the pod network, e.g. --cluster-cidr=10.244.0.0/16");
        }
        if self.route_reconciliation_period.is_zero() {
            bail!("--route-reconciliation-period must be positive");
        }
        if self.allocate_node_cidrs {
            bail!("--allocate-node-cidrs=true: tether ccm has no node-IPAM controller; drop the flag (or set it false) and let kube-controller-manager allocate podCIDRs (its --allocate-node-cidrs --cluster-cidr)");
        }
        if self.concurrent_node_syncs == 0 {
            bail!("--concurrent-node-syncs must be at least 1");
        }
        Ok(())
    }

    /// The load balancers reaching the nodes through the Tether server's socket
    /// (--tunnel-uds), bound to --lb-bind-address when given; `None` without a socket.
    fn tunnel_lb(
        &self,
        metrics: &tether_ccm::metrics::Metrics,
    ) -> anyhow::Result<Option<tether_ccm::lb::balancer::TunnelLbConfig>> {
        let bind = match self.lb_bind_address.as_str() {
            "" => None,
            bind => Some(
                bind.parse::<std::net::IpAddr>()
                    .with_context(|| format!("--lb-bind-address {bind:?} is not an IP address"))
                    .and_then(|ip| {
                        if ip.is_unspecified() {
                            bail!("--lb-bind-address {bind} is not an address clients can reach: it becomes every Service's ingress IP; give this host's address, or configure loadBalancer pools in the cloud config")
                        }
                        Ok(ip)
                    })?,
            ),
        };
        Ok(match (bind, self.tunnel_uds.as_str()) {
            (Some(_), "") => bail!("--lb-bind-address needs --tunnel-uds: load balancers reach the nodes through the Tether server's socket"),
            (_, "") => None,
            (bind, uds) => Some(tether_ccm::lb::balancer::TunnelLbConfig {
                bind,
                tunnel_uds: PathBuf::from(uds),
                max_connections: self.lb_max_connections,
                metrics: metrics.clone(),
                record: Some(tether_ccm::lb::record::RecordRef {
                    namespace: self.leader_elect_resource_namespace.clone(),
                    name: tether_ccm::lb::record::name_for(&self.leader_elect_resource_name),
                }),
            }),
        })
    }

    /// The --cloud-provider with its --cloud-config and load balancers `lb`, and the load
    /// balancers it serves.
    fn provider(
        &self,
        lb: Option<tether_ccm::lb::balancer::TunnelLbConfig>,
    ) -> anyhow::Result<Arc<dyn Provider>> {
        match self.cloud_provider.as_str() {
            tether_ccm::provider::NAME => {
                if self.cloud_config.is_empty() {
                    bail!("--cloud-provider=tether needs --cloud-config: the inventory file (see docs/ccm.md)");
                }
                let provider = TetherProvider::new(&PathBuf::from(&self.cloud_config), lb)?;
                if !self.leader_elect && provider.announces() {
                    tracing::warn!("--leader-elect=false: this replica holds and announces every load-balancer address without a lease; run exactly one replica, or two will answer for the same addresses");
                }
                Ok(Arc::new(provider))
            }
            other => bail!("--cloud-provider: unknown provider {other:?} (this build has: tether)"),
        }
    }

    /// Checks, with --leader-elect, the controllers' and the pools' lease timings.
    fn check_leases(&self) -> anyhow::Result<()> {
        if self.leader_elect
            && !(self.leader_elect_retry_period < self.leader_elect_renew_deadline
                && self.leader_elect_renew_deadline < self.leader_elect_lease_duration)
        {
            bail!("--leader-elect-retry-period < --leader-elect-renew-deadline < --leader-elect-lease-duration must hold (defaults 2s, 10s, 15s)");
        }
        if self.leader_elect
            && !(self.lb_lease_retry_period < self.lb_lease_renew_deadline
                && self.lb_lease_renew_deadline + self.lb_lease_retry_period
                    <= self.lb_lease_duration
                && self.lb_lease_duration.subsec_nanos() == 0)
        {
            bail!("--lb-lease-retry-period < --lb-lease-renew-deadline, deadline + retry period <= --lb-lease-duration (whole seconds) must hold: a holder must let go before the lease can run out elsewhere (defaults 500ms, 2s, 4s)");
        }
        Ok(())
    }

    /// Checks the rate limits, the Service syncs and the node controllers' periods.
    fn check_rates_and_periods(&self) -> anyhow::Result<()> {
        if !(self.kube_api_qps > 0.0 && self.provider_qps > 0.0)
            || self.kube_api_burst == 0
            || self.provider_burst == 0
        {
            bail!("--kube-api-qps, --kube-api-burst, --provider-qps and --provider-burst must be positive");
        }
        if self.concurrent_service_syncs == 0 {
            bail!("--concurrent-service-syncs must be at least 1");
        }
        if self.node_monitor_period.is_zero() || self.node_status_update_frequency.is_zero() {
            bail!("--node-monitor-period and --node-status-update-frequency must be positive");
        }
        Ok(())
    }

    /// The controllers' leader election, with --leader-elect.
    fn leader_election(&self, identity: &str) -> Option<LeaderElection> {
        self.leader_elect.then(|| LeaderElection {
            namespace: self.leader_elect_resource_namespace.clone(),
            name: self.leader_elect_resource_name.clone(),
            identity: identity.to_string(),
            lease_duration: self.leader_elect_lease_duration,
            renew_deadline: self.leader_elect_renew_deadline,
            retry_period: self.leader_elect_retry_period,
            await_successor: None,
            balance: None,
        })
    }

    /// The load-balancer pools' leases, with --leader-elect.
    fn load_balancer_lease(&self, identity: &str) -> Option<LeaderElection> {
        // One lease per pool, `<this>-<pool>`, balanced over the replicas.
        self.leader_elect.then(|| LeaderElection {
            namespace: self.leader_elect_resource_namespace.clone(),
            name: format!("{}-lb", self.leader_elect_resource_name),
            identity: identity.to_string(),
            lease_duration: self.lb_lease_duration,
            renew_deadline: self.lb_lease_renew_deadline,
            retry_period: self.lb_lease_retry_period,
            // Before the process exits, a standby holds the addresses.
            await_successor: Some(self.lb_lease_duration),
            balance: Some(Default::default()),
        })
    }
}

/// This replica's identity in its leases: the host name (`HOSTNAME`, else `tether-ccm`)
/// and a random UUID.
fn identity() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "tether-ccm".into());
    format!("{host}_{}", uuid::Uuid::new_v4())
}

/// Runs the controller manager until signalled; exits non-zero when leadership is lost.
pub fn main(args: CcmArgs) -> anyhow::Result<()> {
    args.log.init()?;
    let (config, provider) = args.config()?;
    // SYS_ADMIN made the load balancers' namespace (if any); nothing needs it from here
    // on, and the runtime's threads, started below, inherit its absence.
    tether_ccm::lb::netns::drop_sys_admin()
        .map_err(|e| anyhow::anyhow!("cannot drop CAP_SYS_ADMIN: {e}"))?;
    let metrics = config.metrics.clone();
    let registry = metrics.catalog.registry().clone();
    let (rest_metrics, provider_calls) = (metrics.rest.clone(), metrics.provider_calls.clone());
    let secure = args.secure_listener()?;
    let health = tether_ccm::serving::Health::default();
    let provider = tether_ccm::cloud::rate_limited(
        provider,
        Arc::new(TokenBucket::new(args.provider_qps, args.provider_burst)),
        provider_calls.clone(),
    );
    let kube_limit = Arc::new(TokenBucket::new(args.kube_api_qps, args.kube_api_burst));
    super::block_on(0, async move {
        // SIGTERM starts the drain (controllers clean up, leases are handed over); the
        // token renewal and the HTTPS endpoint take it as their hard stop.
        let drain = tokio_util::sync::CancellationToken::new();
        let (clients, delegation) =
            kube_clients(&args, kube_limit, &rest_metrics, drain.clone()).await?;
        tokio::spawn(
            report_usage(rest_metrics.clone(), provider_calls)
                .instrument(tracing::info_span!("api_usage")),
        );
        if let Some((addr, tls)) = secure {
            serve_https(
                addr,
                tls,
                delegation,
                health.clone(),
                registry,
                drain.clone(),
            )
            .await?;
        }
        tracing::info!(provider = provider.name(), identity = %config.identity, "cloud-controller-manager starting");
        tokio::spawn({
            let drain = drain.clone();
            async move {
                tether_ops::shutdown::signal().await;
                drain.cancel();
            }
        });
        tether_ccm::run(clients, provider, config, health, drain).await?;
        Ok(())
    })
}

/// The clients that check /metrics callers: --authentication-kubeconfig's and
/// --authorization-kubeconfig's, each defaulting to the controller manager's own `client`.
async fn delegation(
    args: &CcmArgs,
    client: &kube::Client,
    build: &impl Fn(kube::Config) -> Result<kube::Client, tether_ops::kubeclient::KubeSetupError>,
) -> anyhow::Result<tether_ccm::serving::Delegation> {
    let delegated = |flag: &str| {
        let (flag, client) = (flag.to_string(), client.clone());
        async move {
            if flag.is_empty() {
                return Ok(client);
            }
            let config = tether_ops::kubeclient::config(Some(Path::new(&flag))).await?;
            build(config)
        }
    };
    Ok(tether_ccm::serving::Delegation {
        authentication: delegated(&args.authentication_kubeconfig)
            .await
            .context("--authentication-kubeconfig")?,
        authorization: delegated(&args.authorization_kubeconfig)
            .await
            .context("--authorization-kubeconfig")?,
    })
}

/// The Kubernetes clients, each limited by `limit` and counted in `rest_metrics`: the
/// controllers' (with --use-service-account-credentials each its own ServiceAccount's,
/// their tokens renewed until `hard_stop`) and those checking /metrics callers.
async fn kube_clients(
    args: &CcmArgs,
    limit: Arc<TokenBucket>,
    rest_metrics: &tether_ops::kubeclient::RestMetrics,
    hard_stop: tokio_util::sync::CancellationToken,
) -> anyhow::Result<(
    tether_ccm::credentials::Clients,
    tether_ccm::serving::Delegation,
)> {
    let kubeconfig = (!args.kubeconfig.is_empty()).then(|| PathBuf::from(&args.kubeconfig));
    let build = |config| {
        tether_ops::kubeclient::limited_client_from(config, limit.clone(), rest_metrics.clone())
    };
    let root_config = tether_ops::kubeclient::config(kubeconfig.as_deref())
        .await
        .context("cannot build the Kubernetes client")?;
    let client = build(root_config.clone()).context("cannot build the Kubernetes client")?;
    let delegation = delegation(args, &client, &build).await?;
    let clients = if args.use_service_account_credentials {
        tether_ccm::credentials::service_account_clients(
            client.clone(),
            root_config,
            build,
            hard_stop,
        )
        .await
        .context("--use-service-account-credentials")?
    } else {
        tether_ccm::credentials::Clients::from(client.clone())
    };
    Ok((clients, delegation))
}

/// Binds the HTTPS endpoint at `addr` and serves /healthz and /metrics on it until
/// `hard_stop`.
async fn serve_https(
    addr: std::net::SocketAddr,
    tls: Arc<rustls::ServerConfig>,
    delegation: tether_ccm::serving::Delegation,
    health: tether_ccm::serving::Health,
    registry: prometheus::Registry,
    hard_stop: tokio_util::sync::CancellationToken,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen on --bind-address/--secure-port {addr}"))?;
    let bound = listener.local_addr()?;
    tracing::info!(addr = %bound, "serving /healthz and /metrics over HTTPS");
    tether_ccm::serving::spawn(
        listener,
        Arc::new(move || tls.clone()),
        delegation,
        health,
        registry,
        hard_stop,
    );
    Ok(())
}

/// Logs the running totals of API calls every 10 s while they change.
async fn report_usage(kube: tether_ops::kubeclient::RestMetrics, provider: prometheus::IntCounter) {
    let mut last = (0, 0);
    let mut tick = tokio::time::interval(Duration::from_secs(10));
    loop {
        tick.tick().await;
        let now = (kube.total(), provider.get());
        if now != last {
            tracing::info!(kube_api_calls = now.0, provider_calls = now.1, "api usage");
            last = now;
        }
    }
}
