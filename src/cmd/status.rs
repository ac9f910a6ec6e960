//! `tether status`: is the tunnel healthy? One GET of the server's admin `/status`
//! (or, from an upstream or older server that has none, its `/metrics`), printed as a
//! table or JSON, with each problem found on a line of its own on stderr. Exit 0:
//! healthy; 1: trouble found; 2: the endpoint could not be read.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, ValueEnum};
use http_body_util::BodyExt;
use hyper::body::Bytes;
use serde_json::{json, Value};

/// Certificates this close to their not-after are critical, whatever `--warn-days` is.
const CRITICAL_SECS: i64 = 2 * 86_400;
/// The largest answer read.
const MAX_BODY: usize = 4 << 20;
/// The most of a token file read.
const MAX_TOKEN: u64 = 64 << 10;
/// The most of one value printed in a table or a message.
const MAX_SHOWN: usize = 256;
/// Upstream's gauges of connected agents.
const READY_BACKENDS: &str = "konnectivity_network_proxy_server_ready_backends";
const READY_CONNECTIONS: &str = "konnectivity_network_proxy_server_ready_backend_connections";

/// `tether status` flags.
#[derive(Args, Debug)]
pub struct StatusArgs {
    /// The server's admin endpoint, http://HOST:PORT. Tether only.
    ///
    /// 8133 is the admin port of the shipped manifests (`tether server`'s own default
    /// is 8095). `/status` is read from it; from an upstream or older server, which
    /// has none, the agent count is read from `/metrics`.
    #[arg(long, default_value = "http://127.0.0.1:8133", value_name = "URL")]
    pub admin_url: String,
    /// A file holding the bearer token to send. Tether only.
    ///
    /// Needed when the admin port is not on loopback: a token bound to the audience
    /// `tether-admin` whose user may `get` the non-resource URL `/agents` (`/status`
    /// needs what `/agents` needs).
    #[arg(long, value_name = "FILE", conflicts_with = "token")]
    pub token_file: Option<PathBuf>,
    /// The bearer token itself; prefer --token-file (a command line is visible to every
    /// user of the machine). Tether only.
    #[arg(long, value_name = "TOKEN")]
    pub token: Option<String>,
    /// The CA that signed the endpoint's certificate, for an https:// admin URL (the
    /// server's --admin-cert, or a TLS proxy in front of the admin port). Tether only.
    #[arg(long, value_name = "FILE")]
    pub cacert: Option<PathBuf>,
    /// How to print the status: aligned tables, or JSON. Tether only.
    ///
    /// json prints the server's `/status` document with a `problems` list added.
    #[arg(short = 'o', long = "output", value_enum, default_value = "table")]
    pub output: Output,
    /// A certificate expiring within this many days is a problem (a warning; within 2
    /// days, critical). Tether only.
    #[arg(long, default_value_t = 14, value_name = "DAYS")]
    pub warn_days: u32,
    /// How long to wait for each answer from the endpoint. Tether only.
    #[arg(long, default_value = "10s", value_parser = super::duration)]
    pub timeout: Duration,
}

/// `-o`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// Aligned tables for a terminal.
    Table,
    /// The `/status` document with `problems` added.
    Json,
}

/// What the endpoint told.
#[derive(Debug)]
enum Report {
    /// Tether's `/status` document.
    Status(Value),
    /// An upstream (or older) server: only `/metrics`, so only the agent count.
    Upstream {
        /// Connected agents, from the gauges.
        agents: u64,
        /// The gauges as read.
        gauges: Value,
    },
}

/// Reads the endpoint, prints what it says; the exit code says whether it is healthy.
pub fn main(args: StatusArgs) -> ExitCode {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    let report = match runtime.block_on(read(&args)) {
        Ok(r) => r,
        Err(line) => {
            eprintln!("error: {}", printable(&line));
            return ExitCode::from(2);
        }
    };
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let found = problems(&report, args.warn_days, now);
    match args.output {
        Output::Table => print!("{}", table(&report, args.warn_days)),
        Output::Json => println!("{:#}", document(report, &found)),
    }
    for p in &found {
        eprintln!("problem: {}", printable(p));
    }
    if found.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

// === reading ===

/// The admin URL without a trailing slash or an endpoint path.
fn base_url(url: &str) -> Result<hyper::Uri, String> {
    let trimmed = url.trim_end_matches('/');
    let trimmed = ["/status", "/agents", "/metrics"]
        .iter()
        .find_map(|p| trimmed.strip_suffix(p))
        .unwrap_or(trimmed);
    let uri: hyper::Uri = trimmed
        .parse()
        .map_err(|e| format!("--admin-url {url:?} is not a URL ({e}); use http://HOST:PORT"))?;
    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
        return Err(format!(
            "--admin-url {url:?} carries credentials: pass the token with --token-file instead"
        ));
    }
    match (uri.scheme_str(), uri.host()) {
        (Some("http" | "https"), Some(_)) => Ok(uri),
        _ => Err(format!(
            "--admin-url {url:?} must be http://HOST:PORT (the server's admin port)"
        )),
    }
}

/// The token in `path` (at most [`MAX_TOKEN`] bytes), trimmed.
fn read_token(path: &std::path::Path) -> Result<String, String> {
    use std::io::Read;
    let mut token = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_TOKEN).read_to_string(&mut token))
        .map_err(|e| format!("--token-file {}: {e}", path.display()))?;
    Ok(token.trim().to_string())
}

/// `/status`, or `/metrics` where the server has no `/status`.
async fn read(args: &StatusArgs) -> Result<Report, String> {
    let base = base_url(&args.admin_url)?;
    let token = match (&args.token_file, &args.token) {
        (Some(f), _) => Some(read_token(f)?),
        (None, t) => t.clone(),
    };
    let client = Client::new(base, token, args.cacert.as_deref(), args.timeout)?;
    let (status, body) = client.get("/status").await?;
    match status {
        200 => serde_json::from_slice(&body)
            .map(Report::Status)
            .map_err(|_| {
                format!(
                    "{} answered 200 but not JSON: is --admin-url the server's admin port?",
                    client.url("/status")
                )
            }),
        404 => {
            let (status, body) = client.get("/metrics").await?;
            if status != 200 {
                return Err(client.refused("/metrics", status, &body));
            }
            upstream(&String::from_utf8_lossy(&body)).ok_or_else(|| {
                format!(
                    "{} has no /status and no {READY_BACKENDS}: is --admin-url a konnectivity server's admin port (not an agent's)?",
                    client.url("")
                )
            })
        }
        _ => Err(client.refused("/status", status, &body)),
    }
}

/// The agent count an upstream server's `/metrics` gives: `ready_backends` for the
/// `default` strategy (every agent), else the largest strategy's (adding them up would
/// count an agent once per strategy), else the deprecated `ready_backend_connections`.
fn upstream(page: &str) -> Option<Report> {
    let mut by_strategy = serde_json::Map::new();
    let mut connections = None;
    for line in page.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let name = series.split('{').next().unwrap_or(series);
        if name == READY_BACKENDS {
            let strategy = series
                .split_once("proxy_strategy=\"")
                .and_then(|(_, rest)| rest.split('"').next())
                .unwrap_or("");
            by_strategy.insert(strategy.to_string(), json!(value as u64));
        } else if name == READY_CONNECTIONS {
            connections = Some(value as u64);
        }
    }
    let counts = by_strategy.values().filter_map(Value::as_u64);
    let agents = match by_strategy.get("default").and_then(Value::as_u64) {
        Some(n) => Some(n),
        None => counts.max().or(connections),
    }?;
    Some(Report::Upstream {
        agents,
        gauges: json!({ "readyBackends": by_strategy, "readyBackendConnections": connections }),
    })
}

/// One HTTP/1.1 GET at a time to the admin endpoint.
struct Client {
    base: hyper::Uri,
    token: Option<String>,
    tls: Option<std::sync::Arc<rustls::ClientConfig>>,
    timeout: Duration,
}

/// True for `localhost` and loopback addresses.
fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host
            .trim_start_matches('[')
            .trim_end_matches(']')
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

impl Client {
    fn new(
        base: hyper::Uri,
        token: Option<String>,
        cacert: Option<&std::path::Path>,
        timeout: Duration,
    ) -> Result<Self, String> {
        let tls = match (base.scheme_str(), cacert) {
            (Some("https"), Some(ca)) => Some(
                tether_core::tls::client_config(ca, None, &[tether_core::tls::ALPN_HTTP11])
                    .map_err(|e| format!("--cacert: {}", tether_core::error::chain(&e)))?,
            ),
            (Some("https"), None) => {
                return Err("an https:// --admin-url needs --cacert (the CA that signed its certificate); the admin port itself is plain http://".into())
            }
            (_, Some(_)) => {
                return Err("--cacert is for an https:// --admin-url; this one is plain http://, so it would not be used".into())
            }
            _ => None,
        };
        if token.is_some() && tls.is_none() && !is_loopback(base.host().unwrap_or_default()) {
            eprintln!("warning: the token goes to {base} in clear text (plain http off loopback); a token bound to the audience tether-admin is worthless elsewhere, but anyone on the path can read it");
        }
        Ok(Client {
            base,
            token,
            tls,
            timeout,
        })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base.to_string().trim_end_matches('/'))
    }

    fn authority(&self) -> String {
        let host = self.base.host().unwrap_or_default();
        let default = if self.tls.is_some() { 443 } else { 80 };
        format!("{host}:{}", self.base.port_u16().unwrap_or(default))
    }

    /// GET `path`: the status code and body, or one line saying what to fix.
    async fn get(&self, path: &str) -> Result<(u16, Bytes), String> {
        let url = self.url(path);
        match tokio::time::timeout(self.timeout, self.exchange(path)).await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => Err(format!(
                "cannot read {url}: {e}: is the server running, and --admin-url its admin port (--admin-port, --admin-bind-address)?"
            )),
            Err(_) => Err(format!(
                "no answer from {url} within {:?}: is --admin-url the server's admin port, and reachable from here?",
                self.timeout
            )),
        }
    }

    async fn exchange(&self, path: &str) -> Result<(u16, Bytes), String> {
        let authority = self.authority();
        let mut request =
            hyper::Request::get(format!("{}{path}", self.base.path().trim_end_matches('/')))
                .header(
                    hyper::header::HOST,
                    self.base
                        .authority()
                        .map(|a| a.as_str())
                        .unwrap_or_default(),
                );
        if let Some(t) = &self.token {
            request = request.header(hyper::header::AUTHORIZATION, format!("Bearer {t}"));
        }
        let request = request
            .body(http_body_util::Empty::<Bytes>::new())
            .map_err(|e| e.to_string())?;
        match &self.tls {
            None => {
                let tcp = tokio::net::TcpStream::connect(&authority)
                    .await
                    .map_err(|e| e.to_string())?;
                send(tcp, request).await
            }
            Some(tls) => {
                let name = tether_core::tls::server_name(self.base.host().unwrap_or_default())?;
                let stream = tether_core::transport::connect_tls(&authority, name, tls.clone())
                    .await
                    .map_err(|e| e.to_string())?;
                send(stream, request).await
            }
        }
    }

    /// The line for an answer other than 200 (and 404 on `/status`).
    fn refused(&self, path: &str, status: u16, body: &[u8]) -> String {
        let url = self.url(path);
        let said = String::from_utf8_lossy(body);
        let said = said.lines().next().unwrap_or_default().trim();
        let hint = match (status, self.token.is_some()) {
            (401, false) => "the admin port is not on loopback: pass --token-file with a token bound to the audience tether-admin",
            (401, true) => "the token was refused: it must be a valid token bound to the audience tether-admin",
            (403, _) => "the token's user needs get on the non-resource URL /agents (and the server a Kubernetes client to review tokens)",
            (429, _) => "the server is busy checking tokens; retry",
            _ => "is --admin-url the server's admin port?",
        };
        format!("{url} answered {status} ({said}): {hint}")
    }
}

/// Sends `request` over `io` with HTTP/1.1 and reads the whole answer.
async fn send<IO>(
    io: IO,
    request: hyper::Request<http_body_util::Empty<Bytes>>,
) -> Result<(u16, Bytes), String>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(io))
            .await
            .map_err(|e| e.to_string())?;
    let driver = tokio::spawn(conn);
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let body = http_body_util::Limited::new(response.into_body(), MAX_BODY)
        .collect()
        .await
        .map_err(|e| format!("reading the answer: {e}"))?
        .to_bytes();
    driver.abort();
    Ok((status, body))
}

// === judging ===

/// How close a certificate is to its not-after.
fn cert_state(expires_in: i64, warn_days: u32) -> &'static str {
    if expires_in <= 0 {
        "expired"
    } else if expires_in <= CRITICAL_SECS {
        "critical"
    } else if expires_in <= i64::from(warn_days) * 86_400 {
        "warning"
    } else {
        "ok"
    }
}

/// Everything wrong, one line each.
fn problems(report: &Report, warn_days: u32, now: i64) -> Vec<String> {
    let doc = match report {
        Report::Upstream { agents: 0, .. } => return vec!["no agent connected".into()],
        Report::Upstream { .. } => return Vec::new(),
        Report::Status(doc) => doc,
    };
    let mut out = Vec::new();
    let agents = doc["agents"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    if agents.is_empty() {
        out.push("no agent connected".to_string());
    } else if agents.iter().all(|a| a["draining"] == true) {
        out.push(format!(
            "all {} connected agents are draining: no new tunnel has an agent that stays",
            agents.len()
        ));
    }
    for c in doc["certificates"].as_array().into_iter().flatten() {
        let left = expires_in(c, now);
        let what = format!("certificate {} ({})", cert_name(c), str_of(&c["source"]));
        match cert_state(left, warn_days) {
            "expired" => out.push(format!(
                "{what} expired {} ago ({}): issue a new one (tether certs)",
                human(-left),
                str_of(&c["notAfter"])
            )),
            "critical" | "warning" => out.push(format!(
                "{what} expires in {} ({}, within {}): rotate it",
                human(left),
                str_of(&c["notAfter"]),
                if left <= CRITICAL_SECS {
                    "2 days, critical".to_string()
                } else {
                    format!("--warn-days {warn_days}")
                }
            )),
            _ => {}
        }
    }
    out.extend(lease_problem(doc));
    out
}

/// The lease controller's trouble: a count that disagrees with the server count in
/// use, or no count for three renewals.
fn lease_problem(doc: &Value) -> Option<String> {
    let lease = &doc["lease"];
    if lease["enabled"] != true {
        return None;
    }
    let in_use = lease["serverCount"].as_u64().unwrap_or(0);
    let renew = lease["renewIntervalSeconds"].as_f64().unwrap_or(15.0);
    let stale = 3.0 * renew;
    match (lease["liveLeases"].as_u64(), lease["countedSecondsAgo"].as_u64()) {
        (Some(_), Some(ago)) if ago as f64 > stale => Some(format!(
            "the live leases were last counted {} ago (every {renew}s expected): the server cannot list Leases; see its log",
            human(ago as i64)
        )),
        (Some(live), _) if live != in_use => Some(format!(
            "{live} live lease(s) but the server count in use is {in_use}: agents are told the wrong number of servers"
        )),
        (None, _) if doc["uptimeSeconds"].as_f64().unwrap_or(0.0) > stale => Some(
            "the lease controller has not counted the live leases yet: the server cannot list Leases; see its log".into(),
        ),
        _ => None,
    }
}

/// Seconds to a certificate's not-after: as the server computed it, else from `now`.
fn expires_in(c: &Value, now: i64) -> i64 {
    c["expiresInSeconds"]
        .as_i64()
        .or_else(|| c["notAfterSeconds"].as_i64().map(|t| t - now))
        .unwrap_or(0)
}

// === printing ===

/// `-o json`: the document with `problems`; for an upstream server, what is known.
fn document(report: Report, problems: &[String]) -> Value {
    let mut doc = match report {
        Report::Status(doc) => doc,
        Report::Upstream { agents, gauges } => json!({
            "upstream": true,
            "note": UPSTREAM_NOTE,
            "agentCount": agents,
            "metrics": gauges,
        }),
    };
    doc["problems"] = json!(problems);
    doc
}

const UPSTREAM_NOTE: &str = "an upstream (or older Tether) server: it has no /status, so only the agent count is known (from /metrics), not the agents' identifiers, the certificates or the leases";

/// `-o table`.
fn table(report: &Report, warn_days: u32) -> String {
    let doc = match report {
        Report::Upstream { agents, .. } => {
            return format!("{UPSTREAM_NOTE}.\n\nagents connected: {agents}\n")
        }
        Report::Status(doc) => doc,
    };
    let mut out = columns(&[
        vec!["server".into(), str_of(&doc["serverId"])],
        vec!["mode".into(), str_of(&doc["mode"])],
        vec!["agents over".into(), agent_transports(doc)],
        vec![
            "version".into(),
            format!("Tether {}", str_of(&doc["version"])),
        ],
        vec![
            "uptime".into(),
            format!(
                "{} (since {})",
                human(doc["uptimeSeconds"].as_i64().unwrap_or(0)),
                str_of(&doc["startTime"])
            ),
        ],
    ]);
    out.push('\n');
    out.push_str(&agents_table(doc));
    out.push('\n');
    out.push_str(&certificates_table(doc, warn_days));
    out.push('\n');
    out.push_str(&lease_line(&doc["lease"]));
    out
}

fn agents_table(doc: &Value) -> String {
    let agents = doc["agents"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    if agents.is_empty() {
        return "agents: none connected\n".into();
    }
    let mut rows = vec![
        ["AGENT", "VERIFIED AS", "BY", "DRAINING", "STREAMS", "OVER"]
            .map(String::from)
            .to_vec(),
    ];
    for a in agents {
        let verified: Vec<String> = list(&a["verifiedHosts"])
            .into_iter()
            .chain(list(&a["verifiedIps"]))
            .collect();
        rows.push(vec![
            str_of(&a["id"]),
            dash(verified.join(",")),
            dash(str_of(&a["verifiedBy"])),
            if a["draining"] == true { "yes" } else { "no" }.into(),
            a["streams"].as_u64().unwrap_or(0).to_string(),
            dash(list(&a["transports"]).join(",")),
        ]);
    }
    columns(&rows)
}

fn certificates_table(doc: &Value, warn_days: u32) -> String {
    let certs = doc["certificates"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or(&[]);
    if certs.is_empty() {
        return "certificates: none loaded from files\n".into();
    }
    let mut rows = vec![["SOURCE", "FILE", "EXPIRES IN", "STATE"]
        .map(String::from)
        .to_vec()];
    for c in certs {
        let left = c["expiresInSeconds"].as_i64().unwrap_or(0);
        rows.push(vec![
            str_of(&c["source"]),
            cert_name(c),
            if left > 0 {
                human(left)
            } else {
                format!("expired {} ago", human(-left))
            },
            cert_state(left, warn_days).into(),
        ]);
    }
    columns(&rows)
}

fn lease_line(lease: &Value) -> String {
    let in_use = lease["serverCount"].as_u64().unwrap_or(0);
    if lease["enabled"] != true {
        return format!("lease: controller off; server count {in_use} (--server-count)\n");
    }
    match (lease["liveLeases"].as_u64(), lease["countedSecondsAgo"].as_i64()) {
        (Some(live), Some(ago)) => format!(
            "lease: controller on; {live} live lease(s), counted {} ago; server count in use {in_use}\n",
            human(ago)
        ),
        _ => format!("lease: controller on; not counted yet; server count in use {in_use}\n"),
    }
}

/// Rows padded into aligned columns, every cell made [`printable`].
fn columns(rows: &[Vec<String>]) -> String {
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| r.iter().map(|c| printable(c)).collect())
        .collect();
    let rows = &rows;
    let mut widths: Vec<usize> = Vec::new();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            if widths.len() <= i {
                widths.push(0);
            }
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .enumerate()
            .map(|(i, cell)| format!("{cell:<w$}", w = widths[i]))
            .collect();
        out.push_str(line.join("  ").trim_end());
        out.push('\n');
    }
    out
}

/// `file`, or `file#index` for a certificate after a bundle's first.
fn cert_name(c: &Value) -> String {
    match c["index"].as_u64() {
        Some(i) if i > 0 => format!("{}#{i}", str_of(&c["file"])),
        _ => str_of(&c["file"]),
    }
}

/// `s` safe for a terminal: what the server sent (agent IDs, host names, file names)
/// may be forged on a plain-HTTP path, so control characters (escape sequences
/// What agents may carry their streams over, and where QUIC is taken (`-` from a
/// server that does not say).
fn agent_transports(doc: &Value) -> String {
    let names: Vec<&str> = doc["agentTransports"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if names.is_empty() {
        return "-".into();
    }
    match doc["agentQuic"].as_str() {
        Some(at) => format!("{} (QUIC on udp {at})", names.join(", ")),
        None => names.join(", "),
    }
}

/// included) become `?`, and a value is cut at [`MAX_SHOWN`] characters.
fn printable(s: &str) -> String {
    let mut out: String = s
        .chars()
        .take(MAX_SHOWN)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect();
    if s.chars().nth(MAX_SHOWN).is_some() {
        out.push_str("...");
    }
    out
}

fn str_of(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_string()
}

fn list(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(String::from))
        .collect()
}

fn dash(s: String) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s
    }
}

/// Seconds as the two largest units: `45s`, `12m`, `3h20m`, `1d3h`, `364d`.
fn human(secs: i64) -> String {
    let s = secs.max(0);
    let (d, h, m) = (s / 86_400, s % 86_400 / 3600, s % 3600 / 60);
    match () {
        _ if d >= 2 => format!("{d}d"),
        _ if d == 1 => format!("1d{h}h"),
        _ if h > 0 => format!("{h}h{m}m"),
        _ if m > 0 => format!("{m}m"),
        _ => format!("{s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_a_server_sends_reaches_the_terminal_without_escapes() {
        assert_eq!(printable("node-1"), "node-1");
        assert_eq!(
            printable("a\u{1b}]0;owned\u{7}b\u{9b}c\n"),
            "a?]0;owned?b?c?"
        );
        let long = "x".repeat(MAX_SHOWN + 10);
        assert_eq!(printable(&long).len(), MAX_SHOWN + 3);
        let rows = vec![vec!["\u{1b}[2J".to_string()]];
        assert_eq!(columns(&rows), "?[2J\n");
    }

    #[test]
    fn admin_urls_with_credentials_or_cacert_on_http_are_refused() {
        assert!(base_url("http://user:secret@10.0.0.1:8133")
            .unwrap_err()
            .contains("--token-file"));
        assert!(base_url("http://127.0.0.1:8133/status").is_ok());
        let ca = std::path::Path::new("/nonexistent/ca.crt");
        let http = base_url("http://10.0.0.1:8133").unwrap();
        assert!(Client::new(http, None, Some(ca), Duration::from_secs(1))
            .err()
            .unwrap()
            .contains("plain http"));
        assert!(is_loopback("127.0.0.1") && is_loopback("localhost") && is_loopback("[::1]"));
        assert!(!is_loopback("10.0.0.1"));
    }

    #[test]
    fn certificate_states() {
        assert_eq!(cert_state(-1, 14), "expired");
        assert_eq!(cert_state(86_400, 14), "critical");
        assert_eq!(cert_state(5 * 86_400, 14), "warning");
        assert_eq!(cert_state(5 * 86_400, 3), "ok");
        assert_eq!(cert_state(300 * 86_400, 14), "ok");
    }

    #[test]
    fn upstream_metrics_give_the_agent_count() {
        let page = "# HELP x\n\
            konnectivity_network_proxy_server_ready_backends{proxy_strategy=\"destHost\"} 1\n\
            konnectivity_network_proxy_server_ready_backends{proxy_strategy=\"default\"} 3\n\
            konnectivity_network_proxy_server_ready_backend_connections 3\n";
        let Some(Report::Upstream { agents, .. }) = upstream(page) else {
            panic!("read")
        };
        assert_eq!(agents, 3);
        let old = "konnectivity_network_proxy_server_ready_backend_connections 2\n";
        assert!(matches!(
            upstream(old),
            Some(Report::Upstream { agents: 2, .. })
        ));
        assert!(upstream("process_open_fds 9\n").is_none());
    }

    #[test]
    fn lease_trouble() {
        let doc = |lease: Value| json!({ "uptimeSeconds": 600, "lease": lease });
        let on = |live: Value, ago: Value| {
            doc(
                json!({ "enabled": true, "serverCount": 2, "renewIntervalSeconds": 15.0, "liveLeases": live, "countedSecondsAgo": ago }),
            )
        };
        assert_eq!(lease_problem(&on(json!(2), json!(3))), None);
        assert!(lease_problem(&on(json!(3), json!(3)))
            .unwrap()
            .contains("3 live lease(s)"));
        assert!(lease_problem(&on(json!(2), json!(120)))
            .unwrap()
            .contains("last counted 2m ago"));
        assert!(lease_problem(&on(Value::Null, Value::Null))
            .unwrap()
            .contains("not counted"));
        assert_eq!(
            lease_problem(&doc(json!({ "enabled": false, "serverCount": 1 }))),
            None
        );
    }

    #[test]
    fn admin_urls() {
        assert_eq!(
            base_url("http://127.0.0.1:8133/").unwrap().to_string(),
            "http://127.0.0.1:8133/"
        );
        assert_eq!(
            base_url("http://h:1/status")
                .unwrap()
                .authority()
                .unwrap()
                .as_str(),
            "h:1"
        );
        assert!(base_url("127.0.0.1:8133").is_err());
        assert!(base_url("ftp://h/").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(human(45), "45s");
        assert_eq!(human(12 * 60 + 5), "12m");
        assert_eq!(human(3 * 3600 + 20 * 60), "3h20m");
        assert_eq!(human(86_400 + 3 * 3600), "1d3h");
        assert_eq!(human(364 * 86_400), "364d");
    }
}
