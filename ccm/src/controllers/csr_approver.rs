//! The kubelet-serving CSR approver: approves a `kubernetes.io/kubelet-serving`
//! CertificateSigningRequest only when it is what a kubelet on that machine may ask for,
//! so that kube-apiserver can verify kubelets (`--kubelet-certificate-authority`)
//! without an operator approving every rotation by hand.
//!
//! A CSR is approved when all of these hold; otherwise it stays pending and one Warning
//! event per CSR and reason says which check failed:
//! - the requester is `system:node:NAME` in group `system:nodes`, and the request's
//!   subject is `CN=system:node:NAME, O=system:nodes`;
//! - the usages are the serving ones (`server auth`, with `digital signature` and/or
//!   `key encipherment`) and nothing else;
//! - it asks for DNS names and IP addresses only (no e-mail or URI), at least one, and
//!   every one is an address the cloud provider knows for node NAME (an IP of an
//!   `InternalIP`/`ExternalIP`, a name of a `Hostname`/`InternalDNS`/`ExternalDNS`
//!   address) or NAME itself, the name the node authenticates as.
//!
//! A CSR whose names the provider does not (yet) know is retried with backoff: the
//! inventory may be updated, an agent may connect. Approving is the whole job: the
//! signer (kube-controller-manager's csrsigning) issues the certificate.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use tether_core::error::chain;

use k8s_openapi::api::certificates::v1::{
    CertificateSigningRequest, CertificateSigningRequestCondition,
};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PostParams};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::ResourceExt;
use tether_certs::csr::CsrInfo;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{Context, SyncError, Target};
use crate::cloud::{Address, CloudError, Instances, NodeInfo};
use crate::workqueue::{Outcome, WorkQueue};

/// The `--controllers` name.
pub const NAME: &str = "kubelet-serving-csr-approver";
/// The signer whose requests this controller approves.
pub const SIGNER: &str = "kubernetes.io/kubelet-serving";
/// The approval condition's reason.
pub const APPROVED_REASON: &str = "TetherNodeAddressesVerified";
/// The reason of the Warning event on a CSR left pending.
pub const PENDING_REASON: &str = "KubeletServingCSRNotApproved";

const NODE_USER_PREFIX: &str = "system:node:";
const NODES_GROUP: &str = "system:nodes";

/// What to do with one CSR.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Not ours (another signer) or already decided.
    Skip,
    /// Approve; the message goes into the condition.
    Approve(String),
    /// Leave pending for good: the request itself is wrong.
    Refuse(String),
    /// Leave pending for now: the provider does not know these names for the node.
    NotYet(String),
}

/// The checks that need no provider: who asks, for what use, for which names. Returns
/// the node name and the parsed request.
pub fn check_request(csr: &CertificateSigningRequest) -> Result<(String, CsrInfo), String> {
    let spec = &csr.spec;
    let user = spec.username.as_deref().unwrap_or_default();
    let node = user
        .strip_prefix(NODE_USER_PREFIX)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| format!("requested by {user:?}, not by a node (system:node:NAME)"))?;
    if !spec
        .groups
        .as_deref()
        .unwrap_or_default()
        .iter()
        .any(|g| g == NODES_GROUP)
    {
        return Err(format!("requester {user} is not in group {NODES_GROUP}"));
    }
    let usages: HashSet<&str> = spec
        .usages
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(String::as_str)
        .collect();
    let allowed = ["server auth", "digital signature", "key encipherment"];
    if let Some(bad) = usages.iter().find(|u| !allowed.contains(u)) {
        return Err(format!(
            "usage {bad:?} is not a serving usage (allowed: {})",
            allowed.join(", ")
        ));
    }
    if !usages.contains("server auth")
        || !(usages.contains("digital signature") || usages.contains("key encipherment"))
    {
        return Err("usages must be server auth with digital signature or key encipherment".into());
    }
    let info = tether_certs::csr::parse_csr_pem(&spec.request.0)
        .map_err(|e| format!("spec.request {e}"))?;
    let expected_cn = format!("{NODE_USER_PREFIX}{node}");
    if info.common_name.as_deref() != Some(expected_cn.as_str()) {
        return Err(format!(
            "subject CN {:?} is not {expected_cn:?}",
            info.common_name.as_deref().unwrap_or_default()
        ));
    }
    if info.organizations != [NODES_GROUP] {
        return Err(format!(
            "subject O {:?} is not [{NODES_GROUP:?}]",
            info.organizations
        ));
    }
    if !info.emails.is_empty() || !info.uris.is_empty() {
        return Err(
            "it asks for e-mail or URI names; a kubelet asks for DNS names and IPs only".into(),
        );
    }
    if info.dns_names.is_empty() && info.ip_addresses.is_empty() {
        return Err("it asks for no DNS name or IP address".into());
    }
    Ok((node.to_string(), info))
}

/// Are all of `info`'s names `node`'s own, by the provider's `addresses`? Err names
/// every name that is not.
pub fn check_names(node: &str, info: &CsrInfo, addresses: &[Address]) -> Result<(), String> {
    let ips: HashSet<IpAddr> = addresses
        .iter()
        .filter(|a| a.kind == "InternalIP" || a.kind == "ExternalIP")
        .filter_map(|a| a.address.parse().ok())
        .collect();
    let mut names: HashSet<String> = addresses
        .iter()
        .filter(|a| matches!(a.kind.as_str(), "Hostname" | "InternalDNS" | "ExternalDNS"))
        .map(|a| a.address.to_ascii_lowercase())
        .collect();
    names.insert(node.to_ascii_lowercase());
    let mut foreign: Vec<String> = info
        .ip_addresses
        .iter()
        .filter(|ip| !ips.contains(ip))
        .map(|ip| format!("IP {ip}"))
        .collect();
    foreign.extend(
        info.dns_names
            .iter()
            .filter(|d| !names.contains(&d.to_ascii_lowercase()))
            .map(|d| format!("DNS name {d}")),
    );
    if foreign.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "{} not among the addresses the cloud provider knows for node {node}",
            foreign.join(", ")
        ))
    }
}

/// Has the CSR been approved or denied already?
fn decided(csr: &CertificateSigningRequest) -> bool {
    csr.status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default()
        .iter()
        .any(|c| c.type_ == "Approved" || c.type_ == "Denied")
}

/// The approver.
pub struct CsrApprover {
    ctx: Context,
    instances: Arc<dyn Instances>,
    csrs: Store<CertificateSigningRequest>,
    queue: Arc<WorkQueue>,
    /// The last pending reason published per CSR (one event per CSR and reason).
    warned: Mutex<HashMap<String, String>>,
}

impl CsrApprover {
    /// An approver working off `queue` (fed by the CSR informer over `csrs`).
    pub fn new(
        ctx: Context,
        instances: Arc<dyn Instances>,
        csrs: Store<CertificateSigningRequest>,
        queue: Arc<WorkQueue>,
    ) -> Self {
        CsrApprover {
            ctx,
            instances,
            csrs,
            queue,
            warned: Mutex::new(HashMap::new()),
        }
    }

    /// Runs until `hard_stop`.
    pub async fn run(self, hard_stop: CancellationToken) {
        let this = Arc::new(self);
        let queue = this.queue.clone();
        queue
            .work(1, hard_stop, move |name| {
                let this = this.clone();
                async move {
                    let result = this
                        .sync(&name)
                        .instrument(tracing::debug_span!("sync_csr", csr = %name))
                        .await;
                    result.unwrap_or_else(|e| {
                        tracing::warn!(csr = %name, error = %chain(&e), "CSR sync failed; retrying");
                        e.outcome()
                    })
                }
            })
            .await;
    }

    /// Decides one CSR and acts on it.
    pub async fn sync(&self, name: &str) -> Result<Outcome, SyncError> {
        let Some(csr) = self.csrs.get(&ObjectRef::new(name)) else {
            self.warned.lock().unwrap().remove(name);
            return Ok(Outcome::Done);
        };
        match self.verdict(&csr).await? {
            Verdict::Skip => Ok(Outcome::Done),
            Verdict::Approve(message) => {
                self.approve(&csr, message).await?;
                Ok(Outcome::Done)
            }
            Verdict::Refuse(why) => {
                self.warn_once(&csr, why).await;
                Ok(Outcome::Done)
            }
            Verdict::NotYet(why) => {
                self.warn_once(&csr, why).await;
                Ok(Outcome::Retry(None))
            }
        }
    }

    /// What to do with `csr`.
    pub async fn verdict(&self, csr: &CertificateSigningRequest) -> Result<Verdict, SyncError> {
        if csr.spec.signer_name != SIGNER || decided(csr) {
            return Ok(Verdict::Skip);
        }
        let (node, info) = match check_request(csr) {
            Ok(v) => v,
            Err(why) => return Ok(Verdict::Refuse(why)),
        };
        let info_for = self
            .ctx
            .nodes
            .get(&ObjectRef::<Node>::new(&node))
            .map(|n| super::node_info(&n))
            .unwrap_or_else(|| NodeInfo {
                name: node.clone(),
                ..Default::default()
            });
        let addresses = match self.instances.metadata(&info_for).await {
            Ok(m) => m.addresses,
            Err(CloudError::InstanceNotFound) => {
                return Ok(Verdict::NotYet(format!(
                    "node {node} is not known to the cloud provider"
                )))
            }
            Err(e) => return Err(e.into()),
        };
        Ok(match check_names(&node, &info, &addresses) {
            Ok(()) => Verdict::Approve(format!(
                "every name is node {node}'s by the cloud provider: {}",
                info.dns_names
                    .iter()
                    .cloned()
                    .chain(info.ip_addresses.iter().map(|ip| ip.to_string()))
                    .collect::<Vec<_>>()
                    .join(", ")
            )),
            Err(why) => Verdict::NotYet(why),
        })
    }

    async fn approve(
        &self,
        csr: &CertificateSigningRequest,
        message: String,
    ) -> Result<(), SyncError> {
        let name = csr.name_any();
        let mut csr = csr.clone();
        let status = csr.status.get_or_insert_with(Default::default);
        let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::now(),
        );
        status
            .conditions
            .get_or_insert_with(Vec::new)
            .push(CertificateSigningRequestCondition {
                type_: "Approved".into(),
                status: "True".into(),
                reason: Some(APPROVED_REASON.into()),
                message: Some(format!(
                    "Approved by Tether's cloud-controller-manager: {message}"
                )),
                last_update_time: Some(now),
                ..Default::default()
            });
        let api: Api<CertificateSigningRequest> = Api::all(self.ctx.client.clone());
        api.replace_subresource("approval", &name, &PostParams::default(), &csr)
            .await?;
        self.warned.lock().unwrap().remove(&name);
        tracing::info!(csr = %name, %message, "kubelet serving CSR approved");
        Ok(())
    }

    async fn warn_once(&self, csr: &CertificateSigningRequest, why: String) {
        let name = csr.name_any();
        {
            let mut warned = self.warned.lock().unwrap();
            if warned.get(&name) == Some(&why) {
                return;
            }
            warned.insert(name.clone(), why.clone());
        }
        tracing::warn!(csr = %name, reason = %why, "kubelet serving CSR left pending");
        let target = Target {
            api_version: "certificates.k8s.io/v1",
            kind: "CertificateSigningRequest",
            namespace: None,
            name,
            uid: csr.uid(),
        };
        self.ctx
            .event(
                &target,
                true,
                PENDING_REASON,
                "Approve",
                format!("Not approved: {why}"),
            )
            .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::certificates::v1::CertificateSigningRequestSpec;
    use k8s_openapi::ByteString;

    fn request(cn: &str, org: &str, sans: &[&str]) -> Vec<u8> {
        tether_certs::csr::request_pem(cn, org, sans)
            .unwrap()
            .0
            .into_bytes()
    }

    fn csr(user: &str, usages: &[&str], req: Vec<u8>) -> CertificateSigningRequest {
        CertificateSigningRequest {
            spec: CertificateSigningRequestSpec {
                signer_name: SIGNER.into(),
                username: Some(user.into()),
                groups: Some(vec![NODES_GROUP.into(), "system:authenticated".into()]),
                usages: Some(usages.iter().map(|u| u.to_string()).collect()),
                request: ByteString(req),
                ..Default::default()
            },
            ..Default::default()
        }
    }

    const SERVING: [&str; 3] = ["digital signature", "key encipherment", "server auth"];

    fn addr(kind: &str, a: &str) -> Address {
        Address {
            kind: kind.into(),
            address: a.into(),
        }
    }

    #[test]
    fn a_kubelets_own_request_passes() {
        let c = csr(
            "system:node:n1",
            &SERVING,
            request("system:node:n1", NODES_GROUP, &["n1", "10.0.0.7"]),
        );
        let (node, info) = check_request(&c).unwrap();
        assert_eq!(node, "n1");
        check_names("n1", &info, &[addr("InternalIP", "10.0.0.7")]).unwrap();
        check_names(
            "n1",
            &info,
            &[addr("InternalIP", "10.0.0.7"), addr("Hostname", "n1")],
        )
        .unwrap();
    }

    #[test]
    fn another_nodes_or_anybodys_address_is_named() {
        let c = csr(
            "system:node:n1",
            &SERVING,
            request(
                "system:node:n1",
                NODES_GROUP,
                &["n1", "n2", "10.0.0.7", "10.9.9.9"],
            ),
        );
        let (_, info) = check_request(&c).unwrap();
        let err = check_names("n1", &info, &[addr("InternalIP", "10.0.0.7")]).unwrap_err();
        assert!(
            err.contains("IP 10.9.9.9") && err.contains("DNS name n2"),
            "{err}"
        );
        assert!(!err.contains("10.0.0.7"), "{err}");
    }

    #[test]
    fn wrong_requester_subject_or_usage_is_refused() {
        let ok_req = || request("system:node:n1", NODES_GROUP, &["n1"]);
        let cases = [
            (csr("alice", &SERVING, ok_req()), "not by a node"),
            (
                csr("system:node:n2", &SERVING, ok_req()),
                "is not \"system:node:n2\"",
            ),
            (
                csr("system:node:n1", &["server auth", "client auth"], ok_req()),
                "client auth",
            ),
            (
                csr("system:node:n1", &["digital signature"], ok_req()),
                "server auth",
            ),
            (
                csr(
                    "system:node:n1",
                    &SERVING,
                    request("system:node:n1", "system:masters", &["n1"]),
                ),
                "subject O",
            ),
            (
                csr(
                    "system:node:n1",
                    &SERVING,
                    request("system:node:n1", NODES_GROUP, &["n1", "admin@example.com"]),
                ),
                "e-mail",
            ),
            (
                csr("system:node:n1", &SERVING, b"garbage".to_vec()),
                "spec.request",
            ),
        ];
        for (c, needle) in cases {
            let err = check_request(&c).unwrap_err();
            assert!(err.contains(needle), "{needle}: {err}");
        }
        let mut not_node_group = csr("system:node:n1", &SERVING, ok_req());
        not_node_group.spec.groups = Some(vec!["system:authenticated".into()]);
        assert!(check_request(&not_node_group)
            .unwrap_err()
            .contains("group"));
    }
}
