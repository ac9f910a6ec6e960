//! Every kubectl path to a pod through a cluster's egress (logs, logs -f, exec, attach,
//! port-forward, cp, the proxies), as the real-node tests run them, and the timings the
//! figures are made of.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::kube::{run_with_input, wait_blocking, Cluster};
use crate::node::BUSYBOX_IMAGE;

/// The test pod: `web` serves /www with busybox httpd on 8080 and logs a numbered line
/// every 200 ms; `echo` is `cat` on an open stdin (for attach).
pub fn web_pod_containers() -> String {
    format!(
        "  - name: web\n    image: {BUSYBOX_IMAGE}\n    imagePullPolicy: Never\n    command: [sh, -c, 'i=0; while true; do i=$((i+1)); echo \"log line $i\"; sleep 0.2; done & exec httpd -f -p 8080 -h /www']\n    ports:\n    - containerPort: 8080\n  - name: echo\n    image: {BUSYBOX_IMAGE}\n    imagePullPolicy: Never\n    command: [cat]\n    stdin: true\n"
    )
}

/// kubectl's two ways for exec/attach/port-forward against a 1.20 kubelet.
#[derive(Clone, Copy, Debug)]
pub enum Streams {
    /// kubectl's default (WebSocket first, then SPDY when the server does not speak it).
    Default,
    /// `KUBECTL_REMOTE_COMMAND_WEBSOCKETS=false`, `KUBECTL_PORT_FORWARD_WEBSOCKETS=false`.
    Spdy,
}

impl Streams {
    /// Sets the environment that picks this protocol.
    pub fn apply(self, cmd: &mut Command) -> &mut Command {
        let on = match self {
            Streams::Default => "true",
            Streams::Spdy => "false",
        };
        cmd.env("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", on)
            .env("KUBECTL_PORT_FORWARD_WEBSOCKETS", on)
    }
}

/// Runs `cmd` with `input` on stdin: (success, stdout, stderr).
pub fn output_of(cmd: Command, input: &[u8]) -> (bool, String, String) {
    let out = run_with_input(cmd, input);
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Kills and reaps a child on drop (long-running kubectl commands).
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads lines from `r` until one satisfies `pred` (within `timeout`); returns it.
pub fn read_until(
    r: impl Read + Send + 'static,
    timeout: Duration,
    what: &str,
    pred: impl Fn(&str) -> bool + Send + 'static,
) -> String {
    let (tx, rx) = std::sync::mpsc::channel();
    // Keeps reading after the match: a closed pipe would kill the writer (kubectl
    // port-forward prints a line per connection).
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines() {
            let Ok(line) = line else { break };
            if pred(&line) {
                let _ = tx.send(line);
            }
        }
    });
    rx.recv_timeout(timeout)
        .unwrap_or_else(|_| panic!("no line of {what} within {timeout:?}"))
}

/// The sha256 of a file, in hex.
pub fn sha256_of(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// `kubectl exec POD -c CONTAINER -- sh -c SCRIPT`, which must succeed: its stdout.
pub fn exec(c: &Cluster, pod: &str, container: &str, script: &str) -> String {
    c.kubectl_ok(&["exec", pod, "-c", container, "--", "sh", "-c", script])
}

/// Every kubectl path to pod `default/web` (see [`web_pod_containers`]) on node `node`
/// whose InternalIP is `node_ip`, with files kept in `scratch`: logs, logs -f, the
/// nodes/pods/services proxies, then for both of kubectl's stream protocols exec with
/// stdin, exec -t, attach and port-forward (64 MiB checksummed), then cp both ways.
/// First asserts that neither the kubelet nor the pod is reachable from here directly.
pub fn every_kubectl_path(c: &Cluster, node: &str, node_ip: &str, scratch: &Path) {
    let pod_ip = c.kubectl_ok(&["get", "pod", "web", "-o", "jsonpath={.status.podIP}"]);
    // Nothing of the node is reachable from the control-plane host but through Tether.
    let node_addr = match node_ip.contains(':') {
        true => format!("[{node_ip}]:10250"),
        false => format!("{node_ip}:10250"),
    };
    for addr in [node_addr, format!("{pod_ip}:8080")] {
        let direct =
            std::net::TcpStream::connect_timeout(&addr.parse().unwrap(), Duration::from_secs(2));
        assert!(direct.is_err(), "{addr} is reachable without the tunnel");
    }

    // kubectl logs, logs -f.
    let logs = c.kubectl_ok(&["logs", "web", "-c", "web"]);
    assert!(logs.starts_with("log line 1\n"), "{logs}");
    let mut follow = c.kubectl_command();
    follow
        .args(["logs", "-f", "web", "-c", "web", "--tail=1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = Killed(follow.spawn().unwrap());
    let out = child.0.stdout.take().unwrap();
    let first: u64 = {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut numbers = Vec::new();
        while numbers.len() < 6 {
            let line = rx
                .recv_timeout(Duration::from_secs(20))
                .expect("logs -f streams");
            numbers.push(line.trim_start_matches("log line ").parse::<u64>().unwrap());
        }
        assert!(numbers.windows(2).all(|w| w[1] == w[0] + 1), "{numbers:?}");
        numbers[0]
    };
    assert!(first > 0);
    drop(child);

    // nodes/proxy, pods/proxy, services/proxy.
    assert_eq!(
        c.kubectl_ok(&[
            "get",
            "--raw",
            &format!("/api/v1/nodes/{node}/proxy/healthz")
        ]),
        "ok"
    );
    let pods = c.kubectl_ok(&["get", "--raw", &format!("/api/v1/nodes/{node}/proxy/pods")]);
    assert!(pods.contains(r#""name":"web""#), "{pods}");
    assert_eq!(
        c.kubectl_ok(&[
            "get",
            "--raw",
            "/api/v1/namespaces/default/pods/web:8080/proxy/"
        ]),
        "hello from the pod\n"
    );
    c.apply("apiVersion: v1\nkind: Service\nmetadata:\n  name: web\n  namespace: default\nspec:\n  selector:\n    app: web\n  ports:\n  - name: http\n    port: 80\n    targetPort: 8080\n");
    let via_service = wait_blocking("services/proxy to the pod", Duration::from_secs(60), || {
        let out = c.kubectl(&[
            "get",
            "--raw",
            "/api/v1/namespaces/default/services/web:http/proxy/",
        ]);
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    });
    assert_eq!(via_service, "hello from the pod\n");

    // 64 MiB in the pod, for port-forward and cp.
    let big_sum = exec(
        c,
        "web",
        "web",
        "dd if=/dev/urandom of=/www/big bs=1048576 count=64 2>/dev/null && sha256sum /www/big",
    );
    let big_sum = big_sum.split_whitespace().next().unwrap().to_string();

    for streams in [Streams::Default, Streams::Spdy] {
        // exec with stdin.
        let mut cmd = c.kubectl_command();
        streams
            .apply(&mut cmd)
            .args(["exec", "-i", "web", "-c", "web", "--", "cat"]);
        let (ok, out, err) = output_of(cmd, b"hi\nthrough the tunnel\n");
        assert!(ok, "{streams:?} exec -i: {err}");
        assert_eq!(out, "hi\nthrough the tunnel\n", "{streams:?}");

        // exec -t: a terminal in the container (script gives kubectl one here).
        let kubectl = format!(
            "kubectl --kubeconfig={} exec -ti web -c web -- sh -c 'tty; echo cols=$(stty size)'",
            c.files.admin_kubeconfig.display()
        );
        let mut cmd = Command::new("script");
        streams
            .apply(&mut cmd)
            .args(["-qec", &kubectl, "/dev/null"]);
        let (ok, out, err) = output_of(cmd, b"");
        assert!(
            ok && out.contains("/dev/pts/"),
            "{streams:?} exec -t: {out} {err}"
        );

        // attach to `echo` (cat): what we type comes back on its stdout.
        let mut cmd = c.kubectl_command();
        streams
            .apply(&mut cmd)
            .args(["attach", "-i", "web", "-c", "echo"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        let mut child = Killed(cmd.spawn().unwrap());
        let marker = format!("attached {streams:?}");
        let mut stdin = child.0.stdin.take().unwrap();
        let line = marker.clone();
        // Repeat until seen: the first line may be typed before the stream is up.
        let typer = std::thread::spawn(move || {
            for _ in 0..100 {
                if writeln!(stdin, "{line}").is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        });
        let m = marker.clone();
        read_until(
            child.0.stdout.take().unwrap(),
            Duration::from_secs(30),
            "attach",
            move |l| l == m,
        );
        drop(child);
        let _ = typer.join();

        // exec's first output, measured.
        let first_output = exec_first_output(c.kubectl_command(), streams);
        println!(
            "[{:?}] kubectl exec to first output: {} ms",
            streams,
            first_output.as_millis()
        );

        // port-forward: the httpd, then 64 MiB checksummed.
        let (port, pf) = port_forward(c.kubectl_command(), streams);
        let out = Command::new("curl")
            .args([
                "-sf",
                "--max-time",
                "20",
                &format!("http://127.0.0.1:{port}/"),
            ])
            .output()
            .unwrap();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "hello from the pod\n",
            "{streams:?}"
        );
        let took = download_big(port, &scratch.join("big.download"), &big_sum);
        println!(
            "[{:?}] port-forward through the tunnel: 64 MiB in {} ms = {:.1} MiB/s",
            streams,
            took.as_millis(),
            64.0 / took.as_secs_f64()
        );
        drop(pf);
    }

    // cp both ways.
    let up = scratch.join("up.bin");
    let data: Vec<u8> = (0..3 * 1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(&up, &data).unwrap();
    c.kubectl_ok(&[
        "cp",
        &up.display().to_string(),
        "default/web:/tmp/up.bin",
        "-c",
        "web",
    ]);
    let inside = exec(c, "web", "web", "sha256sum /tmp/up.bin");
    assert_eq!(inside.split_whitespace().next().unwrap(), sha256_of(&up));
    let down = scratch.join("down.bin");
    c.kubectl_ok(&[
        "cp",
        "default/web:/tmp/up.bin",
        &down.display().to_string(),
        "-c",
        "web",
    ]);
    assert_eq!(std::fs::read(&down).unwrap(), data, "cp from the pod");
}

/// `kubectl port-forward pod/web :8080` from the kubectl command `cmd`: the local port
/// and the process.
pub fn port_forward(mut cmd: Command, streams: Streams) -> (u16, Killed) {
    streams
        .apply(&mut cmd)
        .args(["port-forward", "pod/web", ":8080"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = Killed(cmd.spawn().unwrap());
    let line = read_until(
        child.0.stdout.take().unwrap(),
        Duration::from_secs(30),
        "port-forward",
        |l| l.starts_with("Forwarding from 127.0.0.1:"),
    );
    let port = line
        .trim_start_matches("Forwarding from 127.0.0.1:")
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap();
    (port, child)
}

/// Downloads /big (64 MiB) through local port `port` into `file`, checks its sha256
/// against `sum`; returns how long it took.
pub fn download_big(port: u16, file: &Path, sum: &str) -> Duration {
    let started = Instant::now();
    let out = Command::new("curl")
        .args(["-sf", "--max-time", "120", "-o"])
        .arg(file)
        .arg(format!("http://127.0.0.1:{port}/big"))
        .output()
        .unwrap();
    let took = started.elapsed();
    assert!(
        out.status.success(),
        "port-forward download: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(sha256_of(file), sum, "port-forward corrupted the transfer");
    took
}

/// How long `kubectl exec web -c web -- echo first` (from the kubectl command `cmd`)
/// takes to print its output.
pub fn exec_first_output(mut cmd: Command, streams: Streams) -> Duration {
    streams
        .apply(&mut cmd)
        .args(["exec", "web", "-c", "web", "--", "echo", "first"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let started = Instant::now();
    let mut child = Killed(cmd.spawn().unwrap());
    read_until(
        child.0.stdout.take().unwrap(),
        Duration::from_secs(30),
        "exec echo",
        |l| l == "first",
    );
    let took = started.elapsed();
    let _ = child.0.wait();
    took
}

/// CPU seconds (user + system) of every process on the machine, summed by program
/// name (`/proc/PID/comm`).
pub fn cpu_by_program() -> std::collections::BTreeMap<String, f64> {
    let mut by = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let comm = head.split_once('(').map_or("", |(_, c)| c).to_string();
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // utime and stime are fields 14 and 15 of stat; `rest` starts at field 3.
        let ticks: f64 =
            fields[11].parse::<f64>().unwrap_or(0.0) + fields[12].parse::<f64>().unwrap_or(0.0);
        *by.entry(comm).or_insert(0.0) += ticks / 100.0;
    }
    by
}

/// What each program spent between two [`cpu_by_program`] readings, most first.
pub fn cpu_spent(
    before: &std::collections::BTreeMap<String, f64>,
    after: &std::collections::BTreeMap<String, f64>,
) -> Vec<(String, f64)> {
    let mut spent: Vec<(String, f64)> = after
        .iter()
        .map(|(p, s)| (p.clone(), s - before.get(p).copied().unwrap_or(0.0)))
        .filter(|(_, s)| *s > 0.0)
        .collect();
    spent.sort_by(|a, b| b.1.total_cmp(&a.1));
    spent
}

/// The median of `v`.
pub fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// `kubectl port-forward` throughput (64 MiB `/www/big` of pod `web`, whose sha256 is
/// `sum`, downloaded into `file` 3 times) and the time from `kubectl exec` to its first
/// output (5 times), through the kubectl commands `tunnel` and `direct`; prints the
/// medians, the CPU each program spent per 64 MiB and the ratios under `title`. Returns
/// the ratios (port-forward, exec) of tunnel to direct.
pub fn compare_paths(
    title: &str,
    tunnel: &dyn Fn() -> Command,
    direct: &dyn Fn() -> Command,
    file: &Path,
    sum: &str,
) -> (f64, f64) {
    let mut rows = Vec::new();
    for (path, kubectl) in [("tunnel", tunnel), ("direct", direct)] {
        let (port, _pf) = port_forward(kubectl(), Streams::Spdy);
        let cpu_before = cpu_by_program();
        let downloads: Vec<Duration> = (0..3).map(|_| download_big(port, file, sum)).collect();
        let cpu = cpu_spent(&cpu_before, &cpu_by_program());
        let execs: Vec<Duration> = (0..5)
            .map(|_| exec_first_output(kubectl(), Streams::Spdy))
            .collect();
        rows.push((path, 64.0 / median(downloads).as_secs_f64(), median(execs)));
        let total: f64 = cpu.iter().map(|(_, s)| s).sum();
        println!(
            "  {path}: CPU seconds per 64 MiB, by program: {} (all: {:.2})",
            cpu.iter()
                .filter(|(_, s)| *s >= 0.01)
                .map(|(p, s)| format!("{p} {:.2}", s / 3.0))
                .collect::<Vec<_>>()
                .join(", "),
            total / 3.0
        );
    }
    println!("{title}:");
    for (path, mibs, first) in &rows {
        println!(
            "  {path:>6}: port-forward {mibs:>6.1} MiB/s, exec to first output {:>4} ms",
            first.as_millis()
        );
    }
    let ratios = (
        rows[0].1 / rows[1].1,
        rows[0].2.as_secs_f64() / rows[1].2.as_secs_f64(),
    );
    println!(
        "  tunnel/direct: port-forward {:.2}x, exec first output {:.2}x",
        ratios.0, ratios.1
    );
    ratios
}
