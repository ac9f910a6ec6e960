//! Real `tether` processes for tests: spawned with `--log-format=json`, their stderr
//! parsed line by line (readiness is a log event, not a sleep), killed on drop.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

/// How long a process may take to report readiness.
pub const START_TIMEOUT: Duration = Duration::from_secs(20);

/// Variables no spawned process inherits from the test's environment: the log filter,
/// and the egress proxy settings an agent would follow (a CI machine behind a proxy
/// must not send test agents to it).
const NOT_INHERITED: [&str; 5] = [
    "RUST_LOG",
    "HTTPS_PROXY",
    "https_proxy",
    "NO_PROXY",
    "no_proxy",
];

#[derive(Default)]
struct Log {
    lines: Vec<String>,
    closed: bool,
}

/// A running process with captured JSON logs.
pub struct Proc {
    name: String,
    child: Child,
    log: Arc<(Mutex<Log>, Condvar)>,
}

impl std::fmt::Debug for Proc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proc").field("name", &self.name).finish()
    }
}

impl Proc {
    /// The process ID.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Threads of the process named `name` (e.g. tokio's `tokio-rt-worker`).
    pub fn threads_named(&self, name: &str) -> usize {
        let dir = format!("/proc/{}/task", self.pid());
        std::fs::read_dir(dir)
            .map(|tasks| {
                tasks
                    .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
                    .filter(|comm| comm.trim_end() == name)
                    .count()
            })
            .unwrap_or(0)
    }

    /// Spawns `bin` with `args`; stderr lines are collected.
    pub fn spawn(name: &str, bin: &Path, args: &[String]) -> Proc {
        Self::spawn_with_env(name, bin, args, &[])
    }

    /// [`Proc::spawn`] with the variables `env` set (after those in [`NOT_INHERITED`]
    /// are removed).
    pub fn spawn_with_env(name: &str, bin: &Path, args: &[String], env: &[(&str, &str)]) -> Proc {
        let mut command = Command::new(bin);
        for var in NOT_INHERITED {
            command.env_remove(var);
        }
        let mut child = command
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new((Mutex::new(Log::default()), Condvar::new()));
        let sink = log.clone();
        let label = name.to_string();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if std::env::var_os("TETHER_TEST_LOGS").is_some() {
                    eprintln!("[{label}] {line}");
                }
                let (lock, cv) = &*sink;
                lock.lock().unwrap().lines.push(line);
                cv.notify_all();
            }
            let (lock, cv) = &*sink;
            lock.lock().unwrap().closed = true;
            cv.notify_all();
        });
        Proc {
            name: name.to_string(),
            child,
            log,
        }
    }

    /// Waits (blocking) for a JSON log event whose `message` equals `message` and for
    /// which `pred` holds; returns it. Panics with the log on timeout or exit.
    pub fn wait_event(
        &self,
        message: &str,
        timeout: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + timeout;
        let (lock, cv) = &*self.log;
        let mut seen = 0;
        let mut log = lock.lock().unwrap();
        loop {
            for line in &log.lines[seen..] {
                if let Ok(v) = serde_json::from_str::<Value>(line) {
                    if v["message"] == message && pred(&v) {
                        return v;
                    }
                }
            }
            seen = log.lines.len();
            let now = Instant::now();
            if log.closed || now >= deadline {
                panic!(
                    "{}: no {message:?} log event within {timeout:?} (exited: {}); log:\n{}",
                    self.name,
                    log.closed,
                    log.lines.join("\n")
                );
            }
            log = cv.wait_timeout(log, deadline - now).unwrap().0;
        }
    }

    /// How many JSON log events so far have `message`.
    pub fn count_events(&self, message: &str) -> usize {
        self.events(message).len()
    }

    /// The JSON log events so far with `message`, oldest first.
    pub fn events(&self, message: &str) -> Vec<Value> {
        self.log
            .0
            .lock()
            .unwrap()
            .lines
            .iter()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["message"] == message)
            .collect()
    }

    /// Does any log line so far contain `needle`?
    pub fn logged(&self, needle: &str) -> bool {
        self.log
            .0
            .lock()
            .unwrap()
            .lines
            .iter()
            .any(|l| l.contains(needle))
    }

    /// Has the process exited?
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Everything the process has written to stderr so far.
    pub fn log_text(&self) -> String {
        self.log.0.lock().unwrap().lines.join("\n")
    }

    /// Sends SIGTERM (or another signal name, e.g. "INT").
    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{sig} {}", self.pid());
    }

    /// Kills the process at once (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Waits up to `timeout` for the process to exit, and asserts it exited 0 (`what`
    /// says which exit was awaited; the log comes with a failure).
    pub fn exits_cleanly(&mut self, timeout: Duration, what: &str) {
        let status = self
            .wait_exit(timeout)
            .unwrap_or_else(|| panic!("{what}: still running after {timeout:?}"));
        assert!(status.success(), "{what}: {status:?}\n{}", self.log_text());
    }

    /// Waits for the process to exit; None on timeout.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

fn addr(v: &Value, key: &str) -> Option<SocketAddr> {
    v[key].as_str().and_then(|s| s.parse().ok())
}

/// The program and arguments that run `bin` with `args` as the arguments of `wrapper`
/// (a command that executes the rest of its command line), or `bin` itself when
/// `wrapper` is empty.
fn wrapped(wrapper: &[String], bin: &Path, args: Vec<String>) -> (String, Vec<String>) {
    match wrapper.split_first() {
        None => (bin.display().to_string(), args),
        Some((program, before)) => {
            let mut line = before.to_vec();
            line.push(bin.display().to_string());
            line.extend(args);
            (program.clone(), line)
        }
    }
}

/// The [`wrapped`] command line that runs a program with an open-file limit of
/// `soft`:`hard` descriptors: util-linux's `prlimit`, which then executes it.
fn prlimit(soft: u64, hard: u64) -> [String; 2] {
    ["prlimit".to_string(), format!("--nofile={soft}:{hard}")]
}

/// A `tether server` process and the addresses it bound.
#[derive(Debug)]
pub struct ServerProc {
    /// The process.
    pub proc: Proc,
    /// Agent listener.
    pub agent: SocketAddr,
    /// The agent listener over QUIC (`--agent-quic-port`), when on.
    pub agent_quic: Option<SocketAddr>,
    /// Frontend: a TCP address or a socket path.
    pub frontend: String,
    /// Health endpoint.
    pub health: SocketAddr,
    /// Admin endpoint.
    pub admin: SocketAddr,
}

impl ServerProc {
    /// Starts `tether server` with `args` (plus port-0 health/admin/agent ports unless
    /// given, and JSON logs) and waits for its "server listening" event.
    pub fn start(bin: &Path, args: &[String]) -> ServerProc {
        Self::start_under(&[], bin, args)
    }

    /// [`ServerProc::start`] with an open-file limit of `soft`:`hard` descriptors (run
    /// through util-linux's `prlimit`, which then executes the server itself).
    pub fn start_with_open_files(
        bin: &Path,
        args: &[String],
        (soft, hard): (u64, u64),
    ) -> ServerProc {
        Self::start_under(&prlimit(soft, hard), bin, args)
    }

    /// Starts the server as the arguments of `wrapper` (a command that executes the
    /// rest of its command line), or directly when `wrapper` is empty.
    fn start_under(wrapper: &[String], bin: &Path, args: &[String]) -> ServerProc {
        let mut all: Vec<String> = vec!["server".into(), "--log-format=json".into()];
        for (flag, default) in [
            ("--agent-port", "0"),
            ("--health-port", "0"),
            ("--admin-port", "0"),
            ("--health-bind-address", "127.0.0.1"),
            ("--agent-bind-address", "127.0.0.1"),
        ] {
            if !args.iter().any(|a| a.starts_with(&format!("{flag}="))) {
                all.push(format!("{flag}={default}"));
            }
        }
        all.extend(args.iter().cloned());
        let (program, all) = wrapped(wrapper, bin, all);
        let proc = Proc::spawn("server", Path::new(&program), &all);
        let ev = proc.wait_event("server listening", START_TIMEOUT, |_| true);
        ServerProc {
            agent: addr(&ev, "agent").expect("agent address"),
            agent_quic: addr(&ev, "agent_quic"),
            frontend: ev["frontend"].as_str().unwrap_or_default().to_string(),
            health: addr(&ev, "health").expect("health address"),
            admin: addr(&ev, "admin").expect("admin address"),
            proc,
        }
    }

    /// Waits until `n` agent streams are connected.
    pub async fn wait_agents(&self, n: usize) {
        self.wait_metric(
            "konnectivity_network_proxy_server_ready_backend_connections",
            n as f64,
        )
        .await
    }

    /// Waits until the metric sample `name` (with labels, as rendered) equals `value`.
    pub async fn wait_metric(&self, name: &str, value: f64) {
        let health = self.health;
        crate::wait_until(
            &format!("{name} == {value}"),
            START_TIMEOUT,
            || async move {
                let (_, page) = crate::http_get(health, "/metrics").await.ok()?;
                (crate::metric(&page, name)? == value).then_some(())
            },
        )
        .await
    }

    /// How many connections `listener` closed for any of `reasons`
    /// (`tether_server_connections_refused_total`).
    pub async fn refused(&self, listener: &str, reasons: &[&str]) -> f64 {
        let page = self.metrics().await;
        reasons
            .iter()
            .filter_map(|reason| {
                crate::metric(
                    &page,
                    &format!(
                        r#"tether_server_connections_refused_total{{listener="{listener}",reason="{reason}"}}"#
                    ),
                )
            })
            .sum()
    }

    /// Waits up to `within` until `listener` has closed more than `more_than`
    /// connections for `reasons`.
    pub async fn wait_refused(
        &self,
        listener: &str,
        reasons: &[&str],
        more_than: f64,
        within: Duration,
    ) {
        crate::wait_until(
            &format!("{listener} connections closed for {reasons:?} > {more_than}"),
            within,
            || async { (self.refused(listener, reasons).await > more_than).then_some(()) },
        )
        .await
    }

    /// The server's /metrics page.
    pub async fn metrics(&self) -> String {
        crate::http_get(self.health, "/metrics")
            .await
            .expect("GET /metrics")
            .1
    }
}

/// A `tether agent` process.
#[derive(Debug)]
pub struct AgentProc {
    /// The process.
    pub proc: Proc,
    /// Health endpoint.
    pub health: SocketAddr,
}

impl AgentProc {
    /// Starts `tether agent` against `server` with the PKI's agent certificate, plus
    /// `args`, and waits for its "agent starting" event. A `bin` named `tether-agent` is
    /// the agent-only binary and takes the same flags without the subcommand.
    pub fn start(bin: &Path, pki: &crate::Pki, server: SocketAddr, args: &[String]) -> AgentProc {
        Self::start_in(None, bin, pki, server, args)
    }

    /// [`AgentProc::start`] with an open-file limit of `soft`:`hard` descriptors (run
    /// through util-linux's `prlimit`, which then executes the agent itself).
    pub fn start_with_open_files(
        bin: &Path,
        pki: &crate::Pki,
        server: SocketAddr,
        args: &[String],
        (soft, hard): (u64, u64),
    ) -> AgentProc {
        Self::launch(None, &prlimit(soft, hard), bin, pki, server, args, &[])
    }

    /// Starts an agent with id `id` that authenticates with `token` (written to
    /// `dir/ID.token`) instead of a client certificate, plus `args`.
    pub fn start_with_token(
        bin: &Path,
        pki: &crate::Pki,
        server: SocketAddr,
        dir: &Path,
        id: &str,
        token: &str,
        args: &[String],
    ) -> AgentProc {
        let path = dir.join(format!("{id}.token"));
        std::fs::write(&path, token).unwrap();
        let mut all = vec![
            format!("--agent-id={id}"),
            format!("--service-account-token-path={}", path.display()),
            "--agent-cert=".into(),
            "--agent-key=".into(),
        ];
        all.extend(args.iter().cloned());
        Self::start(bin, pki, server, &all)
    }

    /// Like [`AgentProc::start`], inside the network namespace of `node` when given.
    pub fn start_in(
        node: Option<&crate::netns::Node>,
        bin: &Path,
        pki: &crate::Pki,
        server: SocketAddr,
        args: &[String],
    ) -> AgentProc {
        Self::launch(node, &[], bin, pki, server, args, &[])
    }

    /// [`AgentProc::start_in`] with the environment variables `env` set (say,
    /// HTTPS_PROXY and NO_PROXY; the test's own proxy variables are never inherited).
    pub fn start_with_env(
        node: Option<&crate::netns::Node>,
        bin: &Path,
        pki: &crate::Pki,
        server: SocketAddr,
        args: &[String],
        env: &[(&str, &str)],
    ) -> AgentProc {
        Self::launch(node, &[], bin, pki, server, args, env)
    }

    /// Starts the agent (inside `node`'s namespace when given) as the arguments of
    /// `wrapper`, or directly when `wrapper` is empty.
    fn launch(
        node: Option<&crate::netns::Node>,
        wrapper: &[String],
        bin: &Path,
        pki: &crate::Pki,
        server: SocketAddr,
        args: &[String],
        env: &[(&str, &str)],
    ) -> AgentProc {
        let f = &pki.files;
        let mut all: Vec<String> = Vec::new();
        if bin.file_name().is_none_or(|n| n != "tether-agent") {
            all.push("agent".into());
        }
        all.push("--log-format=json".into());
        for (flag, default) in [
            ("--proxy-server-host", server.ip().to_string()),
            ("--proxy-server-port", server.port().to_string()),
            ("--ca-cert", f.ca_cert.display().to_string()),
            ("--agent-cert", f.agent_cert.display().to_string()),
            ("--agent-key", f.agent_key.display().to_string()),
            ("--health-server-host", "127.0.0.1".into()),
            ("--health-server-port", "0".into()),
            ("--admin-server-port", "0".into()),
            ("--sync-interval", "100ms".into()),
            ("--sync-interval-cap", "1s".into()),
        ] {
            if !args.iter().any(|a| a.starts_with(&format!("{flag}="))) {
                all.push(format!("{flag}={default}"));
            }
        }
        // The test backends listen on loopback or on a namespace node's own addresses,
        // which the default dial policy refuses (no kubelet port, pod or Service):
        // allow those, unless the test sets a policy. Everything else stays refused.
        if !args.iter().any(|a| a.starts_with("--dial-")) {
            all.push("--dial-allow=127.0.0.0/8,::1".into());
            if let Some(n) = node {
                all.push(format!(
                    "--dial-allow={},{},{}",
                    n.node_ip, n.pod_ip, n.node_ip6
                ));
            }
        }
        all.extend(args.iter().cloned());
        let (program, all) = wrapped(wrapper, bin, all);
        let proc = match node {
            Some(node) => node.spawn_with_env(&format!("agent@{}", node.ns), &program, &all, env),
            None => Proc::spawn_with_env("agent", Path::new(&program), &all, env),
        };
        let ev = proc.wait_event("agent starting", START_TIMEOUT, |_| true);
        AgentProc {
            health: addr(&ev, "health").expect("health address"),
            proc,
        }
    }

    /// The agent's /metrics page.
    pub async fn metrics(&self) -> String {
        crate::http_get(self.health, "/metrics")
            .await
            .expect("GET /metrics")
            .1
    }
}

/// Common server arguments for a frontend on a Unix socket at `socket`.
pub fn uds_frontend_args(pki: &crate::Pki, mode: &str, socket: &Path) -> Vec<String> {
    let f = &pki.files;
    vec![
        format!("--mode={mode}"),
        format!("--uds-name={}", socket.display()),
        "--server-port=0".into(),
        format!("--cluster-cert={}", f.server_cert.display()),
        format!("--cluster-key={}", f.server_key.display()),
        format!("--cluster-ca-cert={}", f.ca_cert.display()),
    ]
}

/// Common server arguments for an mTLS TCP frontend on 127.0.0.1 (port 0).
pub fn tcp_frontend_args(pki: &crate::Pki, mode: &str) -> Vec<String> {
    let f = &pki.files;
    vec![
        format!("--mode={mode}"),
        "--server-port=0".into(),
        "--server-bind-address=127.0.0.1".into(),
        format!("--server-cert={}", f.server_cert.display()),
        format!("--server-key={}", f.server_key.display()),
        format!("--server-ca-cert={}", f.frontend_ca_cert.display()),
        format!("--cluster-ca-cert={}", f.ca_cert.display()),
    ]
}

/// `bin server` with an HTTP-CONNECT frontend on TCP whose clients must chain to
/// `frontend_ca`, agents to `agent_ca`, every port ephemeral: the command line of a
/// server whose start-up checks of its CAs a test looks at.
pub fn frontend_cas_command(
    bin: &Path,
    pki: &crate::Pki,
    frontend_ca: &Path,
    agent_ca: &Path,
) -> std::process::Command {
    let f = &pki.files;
    let mut cmd = std::process::Command::new(bin);
    cmd.args([
        "server",
        "--mode=http-connect",
        "--server-port=0",
        "--agent-port=0",
    ])
    .args([
        "--health-port=0",
        "--admin-port=0",
        "--server-bind-address=127.0.0.1",
    ])
    .arg(format!("--server-cert={}", f.server_cert.display()))
    .arg(format!("--server-key={}", f.server_key.display()))
    .arg(format!("--server-ca-cert={}", frontend_ca.display()))
    .arg(format!("--cluster-ca-cert={}", agent_ca.display()));
    cmd
}

/// A socket path inside `dir`.
pub fn socket_path(dir: &Path) -> PathBuf {
    dir.join("konnectivity.sock")
}

/// Server flags for a gRPC frontend on a socket in the PKI's directory with agents
/// authenticated by ServiceAccount token (TokenReview through `kubeconfig`), as
/// deploy/konnectivity-server.yaml does: namespace kube-system, ServiceAccount
/// konnectivity-agent, audience system:konnectivity-server.
pub fn token_auth_server_args(pki: &crate::Pki, kubeconfig: &Path) -> Vec<String> {
    let f = &pki.files;
    vec![
        "--mode=grpc".into(),
        format!("--uds-name={}", socket_path(pki.dir()).display()),
        "--server-port=0".into(),
        format!("--cluster-cert={}", f.server_cert.display()),
        format!("--cluster-key={}", f.server_key.display()),
        "--agent-namespace=kube-system".into(),
        "--agent-service-account=konnectivity-agent".into(),
        "--authentication-audience=system:konnectivity-server".into(),
        format!("--kubeconfig={}", kubeconfig.display()),
    ]
}

/// The one `error:` line `bin args` exits with at start-up (asserting that it does not
/// start, and prints exactly one such line).
pub fn start_up_error(bin: &Path, args: &[String]) -> String {
    let out = std::process::Command::new(bin).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(
        !out.status.success(),
        "{} {args:?} started:\n{stderr}",
        bin.display()
    );
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "one error line expected:\n{stderr}");
    errors[0].to_string()
}
