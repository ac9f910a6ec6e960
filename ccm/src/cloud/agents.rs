//! Which machines have a Tether agent connected, read from the Tether servers' admin
//! endpoint (`GET /agents` on `--admin-port`). The `tether` provider counts a node
//! whose agent is connected as existing even when the inventory does not list it, and
//! keeps counting it for a grace period after its agent goes away (a reboot or a
//! DaemonSet rollout must not get its Node deleted).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::sync::Mutex;

use super::CloudError;

/// How long one answer from the servers is reused.
const CACHE_FOR: Duration = Duration::from_secs(2);
/// How long one request to a server may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// `agents:` in the tether provider's cloud config.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentsConfig {
    /// The servers' admin endpoints, e.g. `http://127.0.0.1:8133/agents`. Agents hold
    /// a stream to every server, so any one that answers is enough.
    pub urls: Vec<String>,
    /// How long a node counts as existing after its agent was last seen (and, for a
    /// node never seen, after the CCM started). Default 600.
    #[serde(default = "default_grace")]
    pub grace_period_seconds: u64,
}

fn default_grace() -> u64 {
    600
}

/// A connected agent, as the server reports it.
#[derive(Debug, Clone, Default, Deserialize, PartialEq, Eq)]
pub struct Agent {
    /// `--agent-id`.
    pub id: String,
    /// `host=` identifiers.
    #[serde(default)]
    pub hosts: Vec<String>,
    /// `ipv4=`/`ipv6=` identifiers.
    #[serde(default)]
    pub ips: Vec<String>,
}

#[derive(Deserialize)]
struct Listing {
    agents: Vec<Agent>,
}

/// What the servers say about one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Presence {
    /// Its agent is connected now.
    Connected(Agent),
    /// Its agent is not connected but was (or the CCM started) within the grace period.
    Recent,
    /// Not connected for longer than the grace period.
    Gone,
}

#[derive(Debug)]
struct State {
    fetched: Option<(Instant, Vec<Agent>)>,
    last_seen: HashMap<String, Instant>,
    /// The first successful answer: nodes never seen count from here.
    baseline: Option<Instant>,
}

/// The connected agents, fetched at most every couple of seconds.
#[derive(Debug)]
pub struct ConnectedAgents {
    urls: Vec<hyper::Uri>,
    grace: Duration,
    state: Mutex<State>,
}

impl ConnectedAgents {
    /// Validates the URLs (start-up errors).
    pub fn new(config: &AgentsConfig) -> Result<Self, String> {
        if config.urls.is_empty() {
            return Err("agents.urls is empty: list the servers' admin /agents URLs".into());
        }
        let urls = config
            .urls
            .iter()
            .map(|u| {
                let uri: hyper::Uri = u
                    .parse()
                    .map_err(|e| format!("agents.urls: {u:?} is not a URL: {e}"))?;
                if uri.scheme_str() != Some("http") || uri.host().is_none() {
                    return Err(format!(
                        "agents.urls: {u:?} must be http://HOST:PORT/agents (the server's admin port)"
                    ));
                }
                Ok(uri)
            })
            .collect::<Result<_, _>>()?;
        Ok(ConnectedAgents {
            urls,
            grace: Duration::from_secs(config.grace_period_seconds),
            state: Mutex::new(State {
                fetched: None,
                last_seen: HashMap::new(),
                baseline: None,
            }),
        })
    }

    /// Is the agent of node `name` connected (agent ID or `host=` identifier equal to
    /// the name)? Errors when no server answers.
    pub async fn presence(&self, name: &str) -> Result<Presence, CloudError> {
        let mut state = self.state.lock().await;
        let fresh = matches!(&state.fetched, Some((at, _)) if at.elapsed() < CACHE_FOR);
        if !fresh {
            let agents = self.fetch().await?;
            let now = Instant::now();
            for a in &agents {
                for key in std::iter::once(&a.id).chain(&a.hosts) {
                    state.last_seen.insert(key.to_ascii_lowercase(), now);
                }
            }
            state.baseline.get_or_insert(now);
            state.fetched = Some((now, agents));
        }
        let name = name.to_ascii_lowercase();
        let (_, agents) = state.fetched.as_ref().expect("fetched above");
        if let Some(a) = agents
            .iter()
            .find(|a| a.id.eq_ignore_ascii_case(&name) || a.hosts.contains(&name))
        {
            return Ok(Presence::Connected(a.clone()));
        }
        let since = state
            .last_seen
            .get(&name)
            .copied()
            .or(state.baseline)
            .unwrap_or_else(Instant::now);
        Ok(if since.elapsed() < self.grace {
            Presence::Recent
        } else {
            Presence::Gone
        })
    }

    /// The union of every answering server's list.
    async fn fetch(&self) -> Result<Vec<Agent>, CloudError> {
        let mut merged: BTreeMap<String, Agent> = BTreeMap::new();
        let mut errors = Vec::new();
        let mut answered = false;
        for uri in &self.urls {
            match tokio::time::timeout(REQUEST_TIMEOUT, get(uri)).await {
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

async fn get(uri: &hyper::Uri) -> Result<Listing, String> {
    let host = uri.host().unwrap_or_default().trim_matches(['[', ']']);
    let port = uri.port_u16().unwrap_or(80);
    let stream = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(|e| e.to_string())?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(conn);
    let req = hyper::Request::get(uri.path_and_query().map(|p| p.as_str()).unwrap_or("/"))
        .header(hyper::header::HOST, format!("{host}:{port}"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
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
    fn rejects_urls_an_operator_would_get_wrong() {
        let cfg = |u: &str| AgentsConfig {
            urls: vec![u.into()],
            grace_period_seconds: 1,
        };
        assert!(ConnectedAgents::new(&cfg("http://127.0.0.1:8133/agents")).is_ok());
        let https = ConnectedAgents::new(&cfg("https://127.0.0.1:8133/agents"))
            .err()
            .unwrap();
        assert!(https.contains("admin port"), "{https}");
        assert!(ConnectedAgents::new(&AgentsConfig {
            urls: vec![],
            grace_period_seconds: 1
        })
        .is_err());
    }
}
