//! Which identity each controller calls the API with. By default all use the
//! controller manager's own client; with `--use-service-account-credentials` each
//! controller gets a client of its own ServiceAccount in kube-system, under upstream's
//! names (`node-controller` for the node and lifecycle controllers,
//! `service-controller`, `route-controller`), so that audit logs and RBAC see which
//! controller acted. Tokens come from the TokenRequest API (served by every supported
//! Kubernetes, unlike the legacy token Secrets upstream 1.20 waited for), last an hour
//! and are renewed at 80% of their life into a private file the client re-reads.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tether_core::error::chain;

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use kube::api::{Api, PostParams};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

/// The namespace of the controllers' ServiceAccounts.
pub const NAMESPACE: &str = "kube-system";
/// The ServiceAccount of the node and node-lifecycle controllers.
pub const NODE: &str = "node-controller";
/// The ServiceAccount of the service controller.
pub const SERVICE: &str = "service-controller";
/// The ServiceAccount of the route controller.
pub const ROUTE: &str = "route-controller";
/// The ServiceAccount of the kubelet-serving CSR approver.
pub const CSR_APPROVER: &str = "kubelet-serving-csr-approver";

/// How long a requested token lasts.
const TOKEN_LIFETIME: Duration = Duration::from_secs(3600);

/// Clients by controller ServiceAccount name, and the controller manager's own.
#[derive(Clone)]
pub struct Clients {
    /// The controller manager's identity: watches, leader election.
    pub root: kube::Client,
    per_controller: BTreeMap<&'static str, kube::Client>,
    /// Where the controllers' tokens are; removed with the last clone.
    _tokens: Option<Arc<TokenDir>>,
}

impl From<kube::Client> for Clients {
    fn from(root: kube::Client) -> Self {
        Clients {
            root,
            per_controller: BTreeMap::new(),
            _tokens: None,
        }
    }
}

/// Names of token directories: this prefix, the owning process's ID and a random part.
const TOKEN_DIR_PREFIX: &str = "tether-ccm-tokens-";
/// The lock file inside a token directory, locked by its controller manager while it
/// runs: an unlocked one belongs to a process that is gone (whatever PID namespace it
/// ran in).
const LOCK_FILE: &str = ".lock";

/// The private (0700) directory of the controllers' token files. It is removed when
/// dropped (the controller manager stopping), and a later start removes those of
/// processes that died without removing theirs, so no bearer token outlives its
/// controller manager on disk.
pub struct TokenDir {
    path: PathBuf,
    /// Held (locked) for the directory's life.
    _lock: std::fs::File,
}

impl TokenDir {
    /// Creates this process's token directory in `parent` (the temp dir), after
    /// removing the ones dead processes left there. The directory is new (never one
    /// someone prepared), ours and 0700.
    pub fn create(parent: &std::path::Path) -> Result<Self, CredentialsError> {
        remove_stale(parent);
        let err = |path: &std::path::Path| {
            let path = path.to_path_buf();
            move |source| CredentialsError::File { path, source }
        };
        let path = parent.join(format!(
            "{TOKEN_DIR_PREFIX}{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&path)
                .map_err(err(&path))?;
        }
        restrict(&path, 0o700)?;
        let lock = std::fs::File::create(path.join(LOCK_FILE)).map_err(err(&path))?;
        lock.try_lock().map_err(|e| CredentialsError::File {
            path: path.clone(),
            source: std::io::Error::other(e.to_string()),
        })?;
        Ok(TokenDir { path, _lock: lock })
    }

    /// The directory.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

impl Drop for TokenDir {
    fn drop(&mut self) {
        match std::fs::remove_dir_all(&self.path) {
            Ok(()) => tracing::debug!(dir = %self.path.display(), "token directory removed"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(dir = %self.path.display(), error = %chain(&e), "cannot remove the token directory; remove it by hand")
            }
        }
    }
}

/// Removes the token directories in `parent` that are ours (this user's, real
/// directories) and whose lock no process holds.
fn remove_stale(parent: &std::path::Path) {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    let uid = std::fs::metadata("/proc/self").map(|m| m.uid()).ok();
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name
            .to_str()
            .is_some_and(|n| n.starts_with(TOKEN_DIR_PREFIX))
        {
            continue;
        }
        let path = entry.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if !meta.is_dir() || Some(meta.uid()) != uid {
            continue;
        }
        // Held by a running controller manager: leave it.
        if let Ok(lock) = std::fs::File::open(path.join(LOCK_FILE)) {
            if lock.try_lock().is_err() {
                continue;
            }
        }
        match std::fs::remove_dir_all(&path) {
            Ok(()) => {
                tracing::info!(dir = %path.display(), "removed the token directory of a controller manager that did not stop cleanly")
            }
            Err(e) => {
                tracing::warn!(dir = %path.display(), error = %chain(&e), "cannot remove a stale token directory")
            }
        }
    }
}

impl Clients {
    /// The client controller `service_account` acts with.
    pub fn controller(&self, service_account: &str) -> kube::Client {
        self.per_controller
            .get(service_account)
            .cloned()
            .unwrap_or_else(|| self.root.clone())
    }
}

/// Why per-controller credentials could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum CredentialsError {
    /// The ServiceAccount could not be read or created.
    #[error("ServiceAccount {NAMESPACE}/{name} (the CCM needs get and create on serviceaccounts in {NAMESPACE})")]
    ServiceAccount {
        /// Its name.
        name: String,
        /// What the API said.
        #[source]
        source: kube::Error,
    },
    /// No token could be requested.
    #[error("token for ServiceAccount {NAMESPACE}/{name} (the CCM needs create on serviceaccounts/token in {NAMESPACE})")]
    Token {
        /// Its name.
        name: String,
        /// What the API said.
        #[source]
        source: kube::Error,
    },
    /// The token file could not be written.
    #[error("cannot write token file {path}")]
    File {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The client could not be built.
    #[error(transparent)]
    Client(#[from] tether_ops::kubeclient::KubeSetupError),
}

/// One client per controller ServiceAccount: each account is created if missing, a
/// token requested, and renewed in the background until `hard_stop`. `base` is the
/// controller manager's configuration (its server and CA are kept, its credentials
/// replaced); `build` makes the client (rate limits, metrics).
pub async fn service_account_clients(
    root: kube::Client,
    base: kube::Config,
    build: impl Fn(kube::Config) -> Result<kube::Client, tether_ops::kubeclient::KubeSetupError>,
    hard_stop: CancellationToken,
) -> Result<Clients, CredentialsError> {
    let tokens = Arc::new(TokenDir::create(&std::env::temp_dir())?);
    let dir = tokens.path().to_path_buf();
    let accounts: Api<ServiceAccount> = Api::namespaced(root.clone(), NAMESPACE);
    let mut per_controller = BTreeMap::new();
    for name in [NODE, SERVICE, ROUTE, CSR_APPROVER] {
        ensure_account(&accounts, name).await?;
        let path = dir.join(name);
        let lifetime = write_token(&accounts, name, &path).await?;
        let mut config = base.clone();
        config.auth_info = kube::config::AuthInfo {
            token_file: Some(path.display().to_string()),
            ..Default::default()
        };
        per_controller.insert(name, build(config)?);
        tokio::spawn(
            renew(accounts.clone(), name, path, lifetime, hard_stop.clone())
                .instrument(tracing::info_span!("token_renewal", service_account = name)),
        );
    }
    tracing::info!(
        accounts = ?per_controller.keys().collect::<Vec<_>>(),
        "controllers use their own ServiceAccount credentials"
    );
    Ok(Clients {
        root,
        per_controller,
        _tokens: Some(tokens),
    })
}

async fn ensure_account(
    accounts: &Api<ServiceAccount>,
    name: &str,
) -> Result<(), CredentialsError> {
    let err = |source| CredentialsError::ServiceAccount {
        name: name.into(),
        source,
    };
    if accounts.get_opt(name).await.map_err(err)?.is_some() {
        return Ok(());
    }
    let sa = ServiceAccount {
        metadata: kube::api::ObjectMeta {
            name: Some(name.into()),
            namespace: Some(NAMESPACE.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    match accounts.create(&PostParams::default(), &sa).await {
        Ok(_) => {
            tracing::info!(service_account = name, "ServiceAccount created");
            Ok(())
        }
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(err(e)),
    }
}

/// Requests a token and writes it (mode 0600, via rename); returns how long it lasts.
async fn write_token(
    accounts: &Api<ServiceAccount>,
    name: &str,
    path: &std::path::Path,
) -> Result<Duration, CredentialsError> {
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: Vec::new(),
            expiration_seconds: Some(TOKEN_LIFETIME.as_secs() as i64),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = accounts
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .map_err(|source| CredentialsError::Token {
            name: name.into(),
            source,
        })?;
    let Some(status) = answer.status else {
        return Err(CredentialsError::Token {
            name: name.into(),
            source: kube::Error::Service("the TokenRequest answer has no status".into()),
        });
    };
    let lifetime = Duration::from_secs(
        status
            .expiration_timestamp
            .0
            .duration_since(k8s_openapi::jiff::Timestamp::now())
            .as_secs()
            .max(60) as u64,
    );
    let tmp = path.with_extension("tmp");
    let file_err = |source| CredentialsError::File {
        path: path.into(),
        source,
    };
    std::fs::write(&tmp, status.token.as_bytes()).map_err(file_err)?;
    restrict(&tmp, 0o600)?;
    std::fs::rename(&tmp, path).map_err(file_err)?;
    Ok(lifetime)
}

fn restrict(path: &std::path::Path, mode: u32) -> Result<(), CredentialsError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(|source| {
        CredentialsError::File {
            path: path.into(),
            source,
        }
    })
}

/// Renews at 80% of the token's life; on failure retries every 10 s (the old token
/// stays valid until it expires).
async fn renew(
    accounts: Api<ServiceAccount>,
    name: &'static str,
    path: PathBuf,
    mut lifetime: Duration,
    hard_stop: CancellationToken,
) {
    let mut wait = lifetime.mul_f64(0.8);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = hard_stop.cancelled() => {
                let _ = std::fs::remove_file(&path);
                return;
            }
        }
        match write_token(&accounts, name, &path).await {
            Ok(l) => {
                lifetime = l;
                wait = lifetime.mul_f64(0.8);
                tracing::debug!(?lifetime, "token renewed");
            }
            Err(e) => {
                tracing::warn!(error = %chain(&e), "cannot renew token; retrying in 10s");
                wait = Duration::from_secs(10);
            }
        }
    }
}

#[cfg(test)]
mod token_dir_tests {
    use super::*;

    #[test]
    fn a_token_directory_goes_with_its_process_and_dead_ones_are_swept() {
        let parent =
            std::env::temp_dir().join(format!("tether-tokendir-test-{}", std::process::id()));
        std::fs::create_dir_all(&parent).unwrap();
        // A dead process's directory (its lock free) and an unrelated one.
        let stale = parent.join(format!("{TOKEN_DIR_PREFIX}1-0"));
        std::fs::create_dir_all(&stale).unwrap();
        std::fs::write(stale.join("node-controller"), "token").unwrap();
        std::fs::write(stale.join(LOCK_FILE), "").unwrap();
        let other = parent.join("something-else");
        std::fs::create_dir_all(&other).unwrap();
        let dir = TokenDir::create(&parent).unwrap();
        assert!(!stale.exists(), "a dead process's tokens are removed");
        assert!(other.exists());
        // A live one (its lock held) is left alone by another start.
        let second = TokenDir::create(&parent).unwrap();
        assert!(
            dir.path().exists(),
            "a running controller manager's tokens stay"
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path()).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        std::fs::write(dir.path().join("service-controller"), "token").unwrap();
        let path = dir.path().to_path_buf();
        drop(dir);
        drop(second);
        assert!(!path.exists(), "removed when the controller manager stops");
        std::fs::remove_dir_all(&parent).unwrap();
    }
}
