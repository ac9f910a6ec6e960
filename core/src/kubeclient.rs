//! Building a Kubernetes client from `--kubeconfig` (or the in-cluster configuration),
//! with errors that say which file and what to do.

use std::path::Path;

/// Why no Kubernetes client could be built.
#[derive(Debug, thiserror::Error)]
pub enum KubeSetupError {
    /// The kubeconfig could not be read or used.
    #[error("--kubeconfig {path}: {source} (check the file is a valid kubeconfig)")]
    Kubeconfig {
        /// The file.
        path: String,
        /// What kube said.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// No kubeconfig and not running in a cluster.
    #[error("no --kubeconfig given and no in-cluster configuration: {0}")]
    InCluster(#[source] kube::config::InClusterError),
    /// The client could not be built.
    #[error("cannot build a Kubernetes client: {0}")]
    Client(#[source] kube::Error),
}

/// A client for the cluster in `kubeconfig`, or in-cluster when `None`.
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client, KubeSetupError> {
    let config = match kubeconfig {
        Some(path) => {
            let err = |source| KubeSetupError::Kubeconfig {
                path: path.display().to_string(),
                source,
            };
            let kc = kube::config::Kubeconfig::read_from(path).map_err(err)?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(err)?
        }
        None => kube::Config::incluster().map_err(KubeSetupError::InCluster)?,
    };
    kube::Client::try_from(config).map_err(KubeSetupError::Client)
}

/// Is `lease` still held at `now` (renewTime + leaseDurationSeconds in the future)?
pub fn lease_is_live(
    lease: &k8s_openapi::api::coordination::v1::Lease,
    now: k8s_openapi::jiff::Timestamp,
) -> bool {
    let Some(spec) = &lease.spec else {
        return false;
    };
    match (&spec.renew_time, spec.lease_duration_seconds) {
        (Some(renew), Some(secs)) => renew
            .0
            .checked_add(k8s_openapi::jiff::SignedDuration::from_secs(i64::from(
                secs,
            )))
            .is_ok_and(|until| until > now),
        _ => false,
    }
}
