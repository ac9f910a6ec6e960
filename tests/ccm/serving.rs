//! The CCM's HTTPS port: `/healthz` for anyone, `/metrics` only with an authorized
//! token.

use std::path::Path;
use std::time::Duration;

use tether_testkit::ccm::{
    https_get, inventory_dir, sa_token, scrape, start_ccm_with, write_inventory,
};
use tether_testkit::kube::{free_port, wait_blocking, Cluster, Egress};
use tether_testkit::process::START_TIMEOUT;

use crate::BIN;

#[test]
fn healthz_is_anonymous_and_metrics_need_an_authorized_token() {
    let cluster = Cluster::start(&Egress::Direct);
    let (_dir, inventory) = inventory_dir();
    write_inventory(&inventory, "nodes: []\n");
    let port = free_port();
    let ccm = start_ccm_with(
        Path::new(BIN),
        &cluster,
        &inventory,
        "ccm",
        &[format!("--secure-port={port}")],
    );
    ccm.wait_event("controllers started", START_TIMEOUT, |_| true);
    let base = format!("https://127.0.0.1:{port}");
    let (code, body) = wait_blocking("healthz", Duration::from_secs(20), || {
        let r = https_get(&format!("{base}/healthz"), None);
        (r.0 == 200).then_some(r)
    });
    assert_eq!((code, body.as_str()), (200, "ok"));

    assert_eq!(https_get(&format!("{base}/metrics"), None).0, 401);
    let nobody = sa_token(&cluster, "nobody");
    assert_eq!(https_get(&format!("{base}/metrics"), Some(&nobody)).0, 403);
    scrape(
        &cluster,
        &base,
        &[
            "rest_client_requests_total{code=\"200\",host=",
            "workqueue_adds_total{name=\"node\"}",
            "leader_election_master_status{name=\"cloud-controller-manager\"} 1",
        ],
    );
}
