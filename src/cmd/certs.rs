//! `tether certs`: make the PKI a hardened cluster needs (`init`, `agent`), inspect
//! certificates (`inspect`), or write a throwaway PKI for trying Tether (`dev`).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use tether_certs::inspect::{self, CertInfo};
use tether_certs::{Ca, Format, KeyAlgorithm, LeafSpec, Writer};

/// Certificate commands.
#[derive(Subcommand, Debug)]
pub enum CertsCommand {
    /// The server's certificates: CA (or reuse the cluster's), agent-facing and
    /// frontend serving certificates, kube-apiserver's frontend client certificate
    /// (signed by a frontend CA of its own, so that no agent certificate opens
    /// tunnels), and the client certificate + kubeconfig for `system:konnectivity-server`.
    Init(InitArgs),
    /// An agent client certificate bound to one node (CN and SAN = the node name).
    Agent(AgentArgs),
    /// Show certificates; non-zero exit if any is expired or does not match.
    Inspect(InspectArgs),
    /// Write a throwaway PKI for one machine: for trying Tether, not production.
    ///
    /// Every agent certificate is bound to one node, as `tether certs agent` writes
    /// them: agent.crt to node `local-agent`, and agent-NODE.crt to each --node.
    Dev {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// One more node to write an agent certificate for (repeatable).
        #[arg(long = "node", value_name = "NODE")]
        nodes: Vec<String>,
    },
}

/// Options every generating command shares.
#[derive(Args, Debug)]
pub struct CommonArgs {
    /// Output directory.
    #[arg(long)]
    pub out: PathBuf,
    /// files (PEM, keys 0600) or secret (Kubernetes Secret YAML in secrets.yaml).
    ///
    /// secret writes one `kubernetes.io/tls` Secret per certificate into secrets.yaml
    /// (0600) instead of files; `init` then writes no kubeconfig.
    #[arg(long, default_value = "files")]
    pub format: Format,
    /// Namespace of emitted Secrets (--format secret).
    #[arg(long, default_value = "kube-system")]
    pub namespace: String,
    /// Key type of every key generated: ecdsa-p256, rsa-2048 or rsa-4096.
    #[arg(long, default_value = "ecdsa-p256")]
    pub key_algorithm: KeyAlgorithm,
    /// Leaf certificate validity in days.
    #[arg(long, default_value_t = 365)]
    pub validity_days: u32,
    /// Overwrite existing files.
    ///
    /// Without it no existing file is replaced: the command fails before writing any.
    #[arg(long)]
    pub force: bool,
}

/// `certs init` flags.
#[derive(Args, Debug)]
pub struct InitArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Reuse this CA certificate (e.g. the cluster's /etc/kubernetes/pki/ca.crt).
    ///
    /// Without --ca-cert and --ca-key a new CA is generated (and ca.key written);
    /// kube-apiserver then trusts konnectivity-server.conf only if it trusts that CA.
    #[arg(long, requires = "ca_key")]
    pub ca_cert: Option<PathBuf>,
    /// The CA's key.
    #[arg(long, requires = "ca_cert")]
    pub ca_key: Option<PathBuf>,
    /// DNS name or IP agents dial (repeatable; at least one).
    ///
    /// The SANs of the agent-facing certificate (server-agent.crt) and, with localhost and
    /// 127.0.0.1, of the frontend one (server-frontend.crt).
    #[arg(long = "server-san", required = true)]
    pub server_sans: Vec<String>,
    /// kube-apiserver URL for the server's kubeconfig (konnectivity-server.conf).
    #[arg(long, default_value = "https://127.0.0.1:6443")]
    pub apiserver_url: String,
}

/// `certs agent` flags.
#[derive(Args, Debug)]
pub struct AgentArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// The node this agent runs on (its agent id).
    ///
    /// The certificate's CN and a DNS SAN (organization system:konnectivity-agents), so
    /// that the server verifies the agent as this node; written as agent-NODE.{crt,key}.

    #[arg(long)]
    pub node: String,
    /// The node's addresses (repeatable), bound into the certificate as IP SANs.
    #[arg(long = "node-ip")]
    pub node_ips: Vec<std::net::IpAddr>,
    /// CA certificate that signs agents (the one the server's --cluster-ca-cert trusts).
    #[arg(long)]
    pub ca_cert: PathBuf,
    /// The CA's key.
    #[arg(long)]
    pub ca_key: PathBuf,
}

/// `certs inspect` flags.
#[derive(Args, Debug)]
pub struct InspectArgs {
    /// Certificate files (PEM; bundles show every certificate).
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Also check that each certificate chains to this CA.
    #[arg(long)]
    pub ca: Option<PathBuf>,
    /// Also check that this key belongs to the (first) certificate.
    #[arg(long)]
    pub key: Option<PathBuf>,
    /// Also check that the certificates cover this DNS name or IP.
    #[arg(long)]
    pub san: Option<String>,
}

/// Runs a certs command.
pub fn main(cmd: CertsCommand) -> anyhow::Result<()> {
    match cmd {
        CertsCommand::Init(a) => init(a),
        CertsCommand::Agent(a) => agent(a),
        CertsCommand::Inspect(a) => run_inspect(a),
        CertsCommand::Dev { out, nodes } => {
            if let Some(bad) = nodes
                .iter()
                .find(|n| n.is_empty() || n.contains(['/', ' ']))
            {
                bail!("--node {bad:?} is not a node name");
            }
            let pki = tether_certs::DevPki::generate(&out)?;
            let ca = Ca::load(&pki.ca_cert, &pki.ca_key)?;
            for node in &nodes {
                let spec = tether_certs::node_agent_spec(node, &[], Default::default(), 0);
                tether_certs::write_pair(&out, &format!("agent-{node}"), &ca.issue(&spec)?)?;
            }
            println!(
                "wrote a throwaway PKI to {} (agent.crt is node {}'s{})",
                pki.dir.display(),
                tether_certs::DEV_AGENT_NODE,
                if nodes.is_empty() {
                    ""
                } else {
                    "; agent-NODE.crt each --node's"
                }
            );
            Ok(())
        }
    }
}

fn leaf(common: &CommonArgs, cn: &str, sans: Vec<String>, server: bool, client: bool) -> LeafSpec {
    LeafSpec {
        algorithm: common.key_algorithm,
        validity_days: common.validity_days,
        common_name: cn.into(),
        sans,
        server,
        client,
        ..Default::default()
    }
}

/// `certs init`: checks no output exists, makes or loads the CAs, issues the server's
/// certificates and writes them with the server's kubeconfig.
fn init(a: InitArgs) -> anyhow::Result<()> {
    let c = &a.common;
    let generated_ca = a.ca_cert.is_none();
    let mut w = Writer::new(&c.out, c.format, c.force, &c.namespace)?;
    w.check_free(&init_names(generated_ca))?;
    let ca = match (&a.ca_cert, &a.ca_key) {
        (Some(cert), Some(key)) => Ca::load(cert, key)?,
        _ => Ca::new_with("tether-ca", c.key_algorithm)?,
    };
    let ca_pem = ca.pair().cert_pem.clone();
    // Frontend clients get a CA of their own, so that no agent certificate (signed by
    // `ca`) can open tunnels: it is the server's --server-ca-cert.
    let frontend_ca = Ca::new_with("tether-frontend-ca", c.key_algorithm)?;
    let issued = issue_init_leaves(&a, &ca, &frontend_ca)?;
    write_cas(&mut w, c.format, &ca, &frontend_ca, generated_ca)?;
    for (name, pair) in &issued {
        w.pair(name, pair, &ca_pem)?;
    }
    let kubeconfig = server_kubeconfig(&a.apiserver_url, &ca_pem, &issued[3].1);
    if c.format == Format::Files {
        w.file("konnectivity-server.conf", &kubeconfig, true)?;
    }
    let written = w.finish()?;
    for p in &written {
        println!("wrote {}", p.display());
    }
    println!("server: --cluster-cert=server-agent.crt --cluster-key=server-agent.key; with agent certificates (tether certs agent) also --cluster-ca-cert=ca.crt (not with token authentication, as deploy/ ships); for a TCP frontend --server-ca-cert=frontend-ca.crt (only apiserver-client.crt chains to it)");
    if generated_ca {
        println!("note: a new CA was generated; kube-apiserver trusts konnectivity-server.conf only if it trusts this CA (use --ca-cert/--ca-key with the cluster CA)");
    }
    Ok(())
}

/// The files `certs init` writes (ca.key only when it generates the CA).
fn init_names(generated_ca: bool) -> Vec<String> {
    let mut names: Vec<String> = [
        "server-agent",
        "server-frontend",
        "apiserver-client",
        "konnectivity-server-client",
    ]
    .iter()
    .flat_map(|n| [format!("{n}.crt"), format!("{n}.key")])
    .collect();
    names.extend([
        "ca.crt".into(),
        "frontend-ca.crt".into(),
        "frontend-ca.key".into(),
        "konnectivity-server.conf".into(),
    ]);
    if generated_ca {
        names.push("ca.key".into());
    }
    names
}

/// The four leaves of `certs init`, by file name: the agent-facing and frontend serving
/// certificates, kube-apiserver's frontend client certificate (from `frontend_ca`) and
/// the server's own client certificate (last).
fn issue_init_leaves(
    a: &InitArgs,
    ca: &Ca,
    frontend_ca: &Ca,
) -> anyhow::Result<[(&'static str, tether_certs::Pair); 4]> {
    let c = &a.common;
    let mut frontend_sans = vec!["localhost".to_string(), "127.0.0.1".into()];
    frontend_sans.extend(a.server_sans.iter().cloned());
    Ok([
        (
            "server-agent",
            ca.issue(&leaf(
                c,
                "konnectivity-server",
                a.server_sans.clone(),
                true,
                false,
            ))?,
        ),
        (
            "server-frontend",
            ca.issue(&leaf(
                c,
                "konnectivity-server-frontend",
                frontend_sans,
                true,
                false,
            ))?,
        ),
        (
            "apiserver-client",
            frontend_ca.issue(&leaf(
                c,
                "kube-apiserver-konnectivity-client",
                vec![],
                false,
                true,
            ))?,
        ),
        (
            "konnectivity-server-client",
            ca.issue(&leaf(c, "system:konnectivity-server", vec![], false, true))?,
        ),
    ])
}

/// Writes the CA (its key only when generated) and the frontend CA, as files or Secrets.
fn write_cas(
    w: &mut Writer,
    format: Format,
    ca: &Ca,
    frontend_ca: &Ca,
    generated_ca: bool,
) -> anyhow::Result<()> {
    let ca_pem = &ca.pair().cert_pem;
    match format {
        Format::Files => {
            w.file("ca.crt", ca_pem, false)?;
            if generated_ca {
                w.file("ca.key", &ca.pair().key_pem, true)?;
            }
        }
        Format::Secret => w.pair("konnectivity-ca", ca.pair(), ca_pem)?,
    }
    match format {
        Format::Files => {
            w.file("frontend-ca.crt", &frontend_ca.pair().cert_pem, false)?;
            w.file("frontend-ca.key", &frontend_ca.pair().key_pem, true)?;
        }
        Format::Secret => w.pair(
            "konnectivity-frontend-ca",
            frontend_ca.pair(),
            &frontend_ca.pair().cert_pem,
        )?,
    }
    Ok(())
}

/// The server's kubeconfig (konnectivity-server.conf): `identity` as
/// `system:konnectivity-server` at `apiserver_url`, trusting `ca_pem`.
fn server_kubeconfig(apiserver_url: &str, ca_pem: &str, identity: &tether_certs::Pair) -> String {
    use base64::Engine;
    let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: kubernetes\n  cluster:\n    server: {}\n    certificate-authority-data: {}\nusers:\n- name: system:konnectivity-server\n  user:\n    client-certificate-data: {}\n    client-key-data: {}\ncontexts:\n- name: konnectivity-server\n  context:\n    cluster: kubernetes\n    user: system:konnectivity-server\ncurrent-context: konnectivity-server\n",
        apiserver_url,
        b64(ca_pem),
        b64(&identity.cert_pem),
        b64(&identity.key_pem)
    )
}

fn agent(a: AgentArgs) -> anyhow::Result<()> {
    let c = &a.common;
    if a.node.is_empty() || a.node.contains(['/', ' ']) {
        bail!("--node {:?} is not a node name", a.node);
    }
    let ca = Ca::load(&a.ca_cert, &a.ca_key)?;
    let mut w = Writer::new(&c.out, c.format, c.force, &c.namespace)?;
    let name = format!("agent-{}", a.node);
    w.check_free(&[format!("{name}.crt"), format!("{name}.key")])?;
    let ips: Vec<String> = a.node_ips.iter().map(|ip| ip.to_string()).collect();
    let spec = tether_certs::node_agent_spec(&a.node, &ips, c.key_algorithm, c.validity_days);
    let pair = ca.issue(&spec)?;
    w.pair(&name, &pair, &ca.pair().cert_pem)?;
    for p in w.finish()? {
        println!("wrote {}", p.display());
    }
    Ok(())
}

fn read_certs(path: &Path) -> anyhow::Result<Vec<CertInfo>> {
    let pem =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    inspect::parse_pem(&pem).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// `certs inspect`: prints each certificate and checks it; fails naming every problem.
fn run_inspect(a: InspectArgs) -> anyhow::Result<()> {
    let roots = match &a.ca {
        Some(p) => read_certs(p)?,
        None => Vec::new(),
    };
    let mut problems = Vec::new();
    for path in &a.files {
        let certs = read_certs(path)?;
        for (i, cert) in certs.iter().enumerate() {
            print_cert(path, i, certs.len(), cert);
            problems.extend(check_cert(&a, &roots, path, i, cert)?);
            println!();
        }
    }
    if !problems.is_empty() {
        bail!("{}", problems.join("; "));
    }
    Ok(())
}

/// Prints certificate `i` of the `count` in `path`: subject, issuer, SANs, key usages,
/// CA flag and expiry.
fn print_cert(path: &Path, i: usize, count: usize, cert: &CertInfo) {
    println!(
        "{}{}",
        path.display(),
        if count > 1 {
            format!(" [{i}]")
        } else {
            String::new()
        }
    );
    println!("  subject:       {}", cert.subject);
    println!("  issuer:        {}", cert.issuer);
    let mut sans: Vec<String> = cert.dns_sans.clone();
    sans.extend(cert.ip_sans.iter().map(|ip| ip.to_string()));
    println!(
        "  SANs:          {}",
        if sans.is_empty() {
            "-".into()
        } else {
            sans.join(", ")
        }
    );
    println!("  key usage:     {}", cert.key_usage.join(", "));
    println!(
        "  ext key usage: {}",
        if cert.ext_key_usage.is_empty() {
            "-".into()
        } else {
            cert.ext_key_usage.join(", ")
        }
    );
    println!("  CA:            {}", cert.is_ca);
    let days = (cert.not_after - inspect::now()) / 86_400;
    println!(
        "  not after:     {} ({})",
        inspect::format_time(cert.not_after),
        if cert.expired() {
            "EXPIRED".to_string()
        } else {
            format!("{days} days left")
        }
    );
}

/// Checks certificate `i` of `path` (expiry; with the flags, its chain to --ca and, for
/// the first, --san and --key), printing each flag's outcome; returns the problems.
fn check_cert(
    a: &InspectArgs,
    roots: &[CertInfo],
    path: &Path,
    i: usize,
    cert: &CertInfo,
) -> anyhow::Result<Vec<String>> {
    let mut problems = Vec::new();
    if cert.expired() {
        problems.push(format!(
            "{} is expired: issue a new certificate",
            path.display()
        ));
    }
    if let Some(ca_path) = &a.ca {
        let ok = roots.iter().any(|r| cert.signed_by(r) || cert.der == r.der);
        println!("  chains to CA:  {}", if ok { "yes" } else { "NO" });
        if !ok {
            problems.push(format!(
                "{} is not signed by {}",
                path.display(),
                ca_path.display()
            ));
        }
    }
    if let (Some(san), 0) = (&a.san, i) {
        let ok = cert.covers(san);
        println!("  covers {san}: {}", if ok { "yes" } else { "NO" });
        if !ok {
            problems.push(format!(
                "{} is not valid for {san}: add it as a SAN",
                path.display()
            ));
        }
    }
    if let (Some(key), 0) = (&a.key, i) {
        let pem = std::fs::read_to_string(key)
            .with_context(|| format!("cannot read {}", key.display()))?;
        let ok = inspect::key_matches(cert, &pem)
            .map_err(|e| anyhow::anyhow!("{}: {e}", key.display()))?;
        println!("  key matches:   {}", if ok { "yes" } else { "NO" });
        if !ok {
            problems.push(format!(
                "{} does not belong to {}",
                key.display(),
                path.display()
            ));
        }
    }
    Ok(problems)
}
