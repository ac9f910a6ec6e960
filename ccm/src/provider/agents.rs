//! Which machines have a Tether agent connected, read from the Tether servers' admin
//! endpoint (`GET /agents` on `--admin-port`). The `tether` provider counts a node
//! whose agent is connected as existing even when the inventory does not list it, but
//! only by identifiers the server verified (its client certificate under
//! `--require-agent-identity-match`, or the node its ServiceAccount token is bound to):
//! with the shipped token authentication any agent may claim any identifier. A node
//! whose agent went away keeps existing (a WAN outage must never cost a node) unless
//! the operator opts in to deletion after a duration.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tether_core::error::chain;

use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::sync::Mutex;

use crate::cloud::CloudError;

/// How long one answer from the servers is reused.
const CACHE_FOR: Duration = Duration::from_secs(2);
/// The largest `/agents` answer read.
const MAX_LISTING: usize = 32 << 20;
/// How long one request to a server may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// `agents:` in the tether provider's cloud config.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentsConfig {
    /// The servers' admin endpoints, e.g. `http://127.0.0.1:8133/agents`. Agents hold
    /// a stream to every server, so any one that answers is enough.
    pub urls: Vec<String>,
    /// Opt-in: a node known only through its agent is deleted once it is not Ready and
    /// its agent has been away this long. Absent (the default): never deleted for
    /// that; the operator deletes it.
    #[serde(default)]
    pub delete_nodes_after_seconds: Option<u64>,
    /// For labs: use identifiers the server did not verify as if it had.
    #[serde(default)]
    pub trust_unverified_identifiers: bool,
    /// A bearer token file sent with each request (read again each time), for servers
    /// whose admin port is not bound to loopback: they authorize `/agents` with a
    /// TokenReview for the `tether-admin` audience and a SubjectAccessReview for `get`
    /// on `/agents`. Use a projected ServiceAccount token with that audience: such a
    /// token is worthless against kube-apiserver. Off loopback, give the server
    /// `--admin-cert` and use `https://` URLs with `ca_file`: in plain HTTP the token
    /// travels in clear and the answers are not authenticated. Absent: no token is
    /// sent.
    #[serde(default)]
    pub token_file: Option<String>,
    /// The CA that signed the servers' admin certificates (`--admin-cert`), for
    /// `https://` URLs; required with them. The certificate must name the URL's host.
    #[serde(default)]
    pub ca_file: Option<String>,
    /// Replaced by `deleteNodesAfterSeconds` (refused with a message saying so).
    #[serde(default)]
    pub grace_period_seconds: Option<u64>,
}

/// A connected agent, as the server reports it.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Agent {
    /// `--agent-id`.
    pub id: String,
    /// `host=` identifiers.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// `ipv4=`/`ipv6=` identifiers.
    #[serde(default)]
    pub ips: Vec<String>,
    /// The agent ID and hosts the server verified.
    #[serde(default)]
    pub verified_hosts: Vec<String>,
    /// The IPs the server verified.
    #[serde(default)]
    pub verified_ips: Vec<String>,
    /// How the server verified them (`certificate`, `serviceaccount-token`), or empty.
    #[serde(default)]
    pub verified_by: String,
    /// The node the server verified the agent runs on (its token's, its per-node
    /// certificate's), whatever ID it claims: the DaemonSet's agents may claim nothing.
    #[serde(default)]
    pub verified_node: Option<String>,
}

impl Agent {
    /// Names (agent ID, hosts) and IPs that count: the verified ones, or all of them
    /// when unverified identifiers are trusted.
    fn trusted(&self, trust_all: bool) -> (Vec<String>, Vec<String>) {
        if trust_all {
            let names = std::iter::once(&self.id)
                .chain(&self.hosts)
                .map(|n| n.to_ascii_lowercase())
                .collect();
            return (names, self.ips.clone());
        }
        let names = self
            .verified_hosts
            .iter()
            .chain(self.verified_node.iter())
            .map(|n| n.to_ascii_lowercase())
            .collect();
        (names, self.verified_ips.clone())
    }
}

#[derive(Deserialize)]
struct Listing {
    agents: Vec<Agent>,
}

/// What the servers say about one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Presence {
    /// Its agent is connected now; `ips` holds only the addresses that count.
    Connected(Agent),
    /// An agent claims the name but nobody verified the claim: why, for an event.
    Unverified(String),
    /// Its agent is not connected and the deletion policy keeps the node.
    Absent,
    /// Its agent has been away longer than the opt-in `deleteNodesAfterSeconds`.
    Gone,
}

#[derive(Debug)]
struct State {
    fetched: Option<(Instant, Index)>,
    last_seen: HashMap<String, Instant>,
    /// The first successful answer: nodes never seen count from here.
    baseline: Option<Instant>,
}

/// One answer from the servers, indexed once for the lookups until the next (every
/// node's check asks, so a lookup must not walk every agent).
#[derive(Debug, Default)]
struct Index {
    /// By name that counts (lowercase): the agent, its `ips` narrowed to those that count.
    trusted: HashMap<String, Agent>,
    /// By any name an agent claims (lowercase): for the unverified-claim message.
    claimed: HashMap<String, Agent>,
}

impl Index {
    /// The first agent (by ID) wins a name, in both maps.
    fn new(agents: Vec<Agent>, trust_all: bool) -> Self {
        let mut index = Index::default();
        for a in agents {
            let (names, ips) = a.trusted(trust_all);
            for n in names {
                index.trusted.entry(n).or_insert_with(|| Agent {
                    ips: ips.clone(),
                    ..a.clone()
                });
            }
            for n in std::iter::once(&a.id).chain(&a.hosts) {
                index
                    .claimed
                    .entry(n.to_ascii_lowercase())
                    .or_insert_with(|| a.clone());
            }
        }
        index
    }
}

/// The connected agents, fetched at most every couple of seconds.
#[derive(Debug)]
pub struct ConnectedAgents {
    urls: Vec<hyper::Uri>,
    /// For `https://` URLs: trusts `agents.caFile`.
    tls: Option<Arc<rustls::ClientConfig>>,
    token_file: Option<std::path::PathBuf>,
    delete_after: Option<Duration>,
    trust_all: bool,
    state: Mutex<State>,
}

/// One of `agents.urls`: a server's admin `/agents` URL (https needs `agents.caFile`,
/// `has_ca`).
fn admin_url(u: &str, has_ca: bool) -> Result<hyper::Uri, String> {
    let uri: hyper::Uri = u
        .parse()
        .map_err(|e| format!("agents.urls: {u:?} is not a URL: {e}"))?;
    match (uri.scheme_str(), uri.host()) {
        (Some("http"), Some(_)) => {}
        (Some("https"), Some(_)) if !has_ca => {
            return Err(format!(
                "agents.urls: {u:?} is https: set agents.caFile to the CA that signed the server's --admin-cert"
            ))
        }
        (Some("https"), Some(host)) => {
            tether_core::tls::server_name(host).map_err(|e| format!("agents.urls: {u:?}: {e}"))?;
        }
        _ => {
            return Err(format!(
                "agents.urls: {u:?} must be http://HOST:PORT/agents or https://HOST:PORT/agents (the server's admin port)"
            ))
        }
    }
    Ok(uri)
}

impl ConnectedAgents {
    /// Validates the configuration (start-up errors).
    pub fn new(config: &AgentsConfig) -> Result<Self, String> {
        if config.grace_period_seconds.is_some() {
            return Err("agents.gracePeriodSeconds is gone: nodes are no longer deleted when their agent leaves unless you opt in with agents.deleteNodesAfterSeconds (see docs/ccm.md, policies)".into());
        }
        if config.urls.is_empty() {
            return Err("agents.urls is empty: list the servers' admin /agents URLs".into());
        }
        let urls = config
            .urls
            .iter()
            .map(|u| admin_url(u, config.ca_file.is_some()))
            .collect::<Result<_, _>>()?;
        // Read once at start-up: a CA changes with a restart, as kube's own CA files do.
        let tls = match &config.ca_file {
            Some(f) => Some(
                tether_core::tls::client_config(
                    std::path::Path::new(f),
                    None,
                    &[tether_core::tls::ALPN_HTTP11],
                )
                .map_err(|e| format!("agents.caFile {f:?}: {}", chain(&e)))?,
            ),
            None => None,
        };
        let token_file = match &config.token_file {
            Some(f) => {
                std::fs::metadata(f).map_err(|e| format!("agents.tokenFile {f:?}: {e}"))?;
                Some(f.into())
            }
            None => None,
        };
        Ok(ConnectedAgents {
            urls,
            tls,
            token_file,
            delete_after: config.delete_nodes_after_seconds.map(Duration::from_secs),
            trust_all: config.trust_unverified_identifiers,
            state: Mutex::new(State {
                fetched: None,
                last_seen: HashMap::new(),
                baseline: None,
            }),
        })
    }

    /// Is the agent of node `name` connected (agent ID or `host=` identifier equal to
    /// the name, verified)? Errors when no server answers.
    pub async fn presence(&self, name: &str) -> Result<Presence, CloudError> {
        let mut state = self.state.lock().await;
        let fresh = matches!(&state.fetched, Some((at, _)) if at.elapsed() < CACHE_FOR);
        if !fresh {
            let index = Index::new(self.fetch().await?, self.trust_all);
            let now = Instant::now();
            for key in index.trusted.keys() {
                state.last_seen.insert(key.clone(), now);
            }
            state.baseline.get_or_insert(now);
            state.fetched = Some((now, index));
        }
        let name = name.to_ascii_lowercase();
        let (_, index) = state.fetched.as_ref().expect("fetched above");
        if let Some(a) = index.trusted.get(&name) {
            return Ok(Presence::Connected(a.clone()));
        }
        if let Some(a) = index.claimed.get(&name) {
            return Ok(Presence::Unverified(format!(
                "agent {:?} claims to be node {name} but the Tether server did not verify that ({}); its identifiers are ignored (set --require-agent-identity-match with agent certificates, or use a pod-bound ServiceAccount token)",
                a.id,
                if a.verified_by.is_empty() {
                    "no verification".to_string()
                } else {
                    format!("verified by {} as {:?}", a.verified_by, a.verified_hosts)
                }
            )));
        }
        let since = state
            .last_seen
            .get(&name)
            .copied()
            .or(state.baseline)
            .unwrap_or_else(Instant::now);
        Ok(match self.delete_after {
            Some(after) if since.elapsed() >= after => Presence::Gone,
            _ => Presence::Absent,
        })
    }

    /// The union of every answering server's list.
    async fn fetch(&self) -> Result<Vec<Agent>, CloudError> {
        let mut merged: BTreeMap<String, Agent> = BTreeMap::new();
        let mut errors = Vec::new();
        let mut answered = false;
        for uri in &self.urls {
            // A projected token is rotated on disk: read it for each request.
            let token = match &self.token_file {
                Some(f) => match std::fs::read_to_string(f) {
                    Ok(t) => Some(t.trim().to_string()),
                    Err(e) => {
                        errors.push(format!("agents.tokenFile {}: {e}", f.display()));
                        continue;
                    }
                },
                None => None,
            };
            let answer = get(uri, self.tls.as_ref(), token.as_deref());
            match tokio::time::timeout(REQUEST_TIMEOUT, answer).await {
                Ok(Ok(list)) => {
                    answered = true;
                    for a in list.agents {
                        merged.entry(a.id.clone()).or_insert(a);
                    }
                }
                Ok(Err(e)) => errors.push(format!("{uri}: {e}")),
                Err(_) => errors.push(format!("{uri}: no answer within {REQUEST_TIMEOUT:?}")),
            }
        }
        if !answered {
            return Err(CloudError::Provider(format!(
                "cannot list connected agents: {}",
                errors.join("; ")
            )));
        }
        for e in errors {
            tracing::warn!(error = %e, "a Tether server did not list its agents");
        }
        Ok(merged.into_values().collect())
    }
}

async fn get(
    uri: &hyper::Uri,
    tls: Option<&Arc<rustls::ClientConfig>>,
    token: Option<&str>,
) -> Result<Listing, String> {
    use tether_core::transport::{connect_tcp, tls_over};
    let host = uri.host().unwrap_or_default();
    let tls = tls.filter(|_| uri.scheme_str() == Some("https"));
    let port = uri
        .port_u16()
        .unwrap_or(if tls.is_some() { 443 } else { 80 });
    let tcp = connect_tcp(&format!("{host}:{port}"), None)
        .await
        .map_err(|e| chain(&e).to_string())?;
    match tls {
        Some(tls) => {
            let name = tether_core::tls::server_name(host)?;
            let stream = tls_over(tcp, name, tls.clone())
                .await
                .map_err(|e| format!("TLS: {}", chain(&e)))?;
            exchange(stream, uri, token).await
        }
        None => exchange(tcp, uri, token).await,
    }
}

/// GET `uri` on `stream`: the listing.
async fn exchange<IO>(stream: IO, uri: &hyper::Uri, token: Option<&str>) -> Result<Listing, String>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| chain(&e).to_string())?;
    tokio::spawn(conn);
    let mut req = hyper::Request::get(uri.path_and_query().map(|p| p.as_str()).unwrap_or("/"))
        // The URL's own authority (`[::1]:8133` keeps its brackets): a server's
        // loopback admin port refuses a Host it cannot tell from a rebound name.
        .header(
            hyper::header::HOST,
            uri.authority().map(|a| a.as_str()).unwrap_or_default(),
        );
    if let Some(token) = token {
        req = req.header(hyper::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let req = req
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|e| chain(&e).to_string())?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| chain(&e).to_string())?;
    let status = resp.status();
    // A listing of 10,000 agents is about 3 MiB; anything far larger is not one.
    let body = http_body_util::Limited::new(resp.into_body(), MAX_LISTING)
        .collect()
        .await
        .map_err(|e| format!("reading the listing: {e}"))?
        .to_bytes();
    if !status.is_success() {
        return Err(format!("HTTP {status}"));
    }
    serde_json::from_slice(&body).map_err(|e| format!("not an /agents listing: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_verified_names_and_ips_count_unless_trusted() {
        let agents = || {
            vec![Agent {
                id: "Edge-1".into(),
                hosts: vec!["edge-1".into(), "edge-2".into()],
                ips: vec!["10.0.0.1".into()],
                verified_hosts: vec!["Edge-1".into()],
                verified_ips: vec![],
                verified_by: "serviceaccount-token".into(),
                verified_node: None,
            }]
        };
        let strict = Index::new(agents(), false);
        assert!(strict.trusted["edge-1"].ips.is_empty());
        assert!(!strict.trusted.contains_key("edge-2"));
        assert_eq!(strict.claimed["edge-2"].id, "Edge-1");
        let lab = Index::new(agents(), true);
        assert_eq!(lab.trusted["edge-2"].ips, ["10.0.0.1"]);
        // The DaemonSet's agent: a random ID, no claims, its token's node verified.
        let daemonset = Agent {
            id: "3f2a9c".into(),
            verified_ips: vec!["10.0.0.3".into(), "fd00::3".into()],
            verified_by: "serviceaccount-token".into(),
            verified_node: Some("Edge-3".into()),
            ..Agent::default()
        };
        let index = Index::new(vec![daemonset], false);
        assert_eq!(index.trusted["edge-3"].ips, ["10.0.0.3", "fd00::3"]);
    }

    #[test]
    fn rejects_urls_an_operator_would_get_wrong() {
        let cfg = |u: &str| AgentsConfig {
            urls: vec![u.into()],
            ..Default::default()
        };
        assert!(ConnectedAgents::new(&cfg("http://127.0.0.1:8133/agents")).is_ok());
        let https = ConnectedAgents::new(&cfg("https://127.0.0.1:8133/agents"))
            .err()
            .unwrap();
        assert!(https.contains("agents.caFile"), "{https}");
        let ftp = ConnectedAgents::new(&cfg("ftp://127.0.0.1:8133/agents"))
            .err()
            .unwrap();
        assert!(ftp.contains("admin port"), "{ftp}");
        let missing = ConnectedAgents::new(&AgentsConfig {
            ca_file: Some("/nonexistent/admin-ca.crt".into()),
            ..cfg("https://127.0.0.1:8133/agents")
        })
        .err()
        .unwrap();
        assert!(missing.contains("agents.caFile"), "{missing}");
        assert!(ConnectedAgents::new(&AgentsConfig::default()).is_err());
        let old = ConnectedAgents::new(&AgentsConfig {
            grace_period_seconds: Some(600),
            ..cfg("http://127.0.0.1:8133/agents")
        })
        .err()
        .unwrap();
        assert!(old.contains("deleteNodesAfterSeconds"), "{old}");
    }
}
