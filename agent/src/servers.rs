//! The set of proxy servers: keeps one stream up to each (as many as the servers'
//! count or their Leases say), round-robin over the configured addresses with
//! exponential backoff and jitter, and drains them all on request.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use rand::Rng;
use tokio_util::sync::CancellationToken;

use crate::config::CountSource;
use crate::lease_count::LeaseCounter;
use crate::link::{LinkError, ESTABLISH_TIMEOUT};
use crate::Agent;

impl Agent {
    /// Keeps one stream to every server up until `shutdown`: dials (round-robin over the
    /// configured addresses) until it holds as many distinct server ids as there are
    /// servers, closing duplicates. When `drain` is cancelled every stream sends DRAIN,
    /// new dials are refused, and `run` returns once the connections have finished.
    pub async fn run(&self, drain: CancellationToken, shutdown: CancellationToken) {
        let work = self.work.clone();
        tether_ops::memory::spawn_trimmer(move || work.open() as i64, shutdown.clone());
        tether_ops::reload::spawn_watcher(
            vec![self.tls.clone() as Arc<dyn tether_ops::reload::Reload>],
            self.config.cert_reload_interval,
            shutdown.clone(),
        );
        let sessions: Arc<Mutex<HashMap<String, CancellationToken>>> = Arc::default();
        let ended = Arc::new(tokio::sync::Notify::new());
        let leases = match &self.config.lease_count {
            Some(lc) => match tether_ops::kubeclient::client(lc.kubeconfig.as_deref()).await {
                Ok(c) => Some(LeaseCounter::spawn(
                    c,
                    lc,
                    self.metrics.lease_metrics(),
                    shutdown.clone(),
                )),
                Err(e) => {
                    tracing::error!(error = %e, "cannot count server leases; using the servers' servercount");
                    None
                }
            },
            None => None,
        };
        let mut delay = self.config.sync_interval;
        let mut next = 0usize;
        loop {
            if shutdown.is_cancelled() || (drain.is_cancelled() && self.open_connections() == 0) {
                break;
            }
            let have = sessions.lock().unwrap_or_else(|e| e.into_inner()).len() as i64;
            let target = self.target_count(leases.as_ref());
            self.metrics.known_server_count.set(target);
            let want_more = !drain.is_cancelled() && (have < target || self.config.sync_forever);
            let mut backoff = false;
            if want_more {
                let (host, port) = &self.config.servers[next % self.config.servers.len()];
                next = next.wrapping_add(1);
                let established =
                    tokio::time::timeout(ESTABLISH_TIMEOUT, self.establish(host, *port))
                        .await
                        .unwrap_or(Err(LinkError::Timeout(ESTABLISH_TIMEOUT)));
                match established {
                    Ok(est) => {
                        let server_id = est.server_id.clone();
                        let mut set = sessions.lock().unwrap_or_else(|e| e.into_inner());
                        if set.contains_key(&server_id) {
                            tracing::info!(%server_id, %host, have, target, "reached a server this agent is already connected to; closing the duplicate stream and retrying");
                            backoff = true;
                        } else {
                            let stop = shutdown.child_token();
                            set.insert(server_id.clone(), stop.clone());
                            drop(set);
                            delay = self.config.sync_interval;
                            let (this, sessions, ended, drain) =
                                (self.clone(), sessions.clone(), ended.clone(), drain.clone());
                            tokio::spawn(async move {
                                if let Err(e) = this.serve(est, &drain, &stop).await {
                                    tracing::warn!(%server_id, error = %format!("{e:#}"), "proxy server stream down; reconnecting");
                                }
                                sessions
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .remove(&server_id);
                                ended.notify_one();
                            });
                            continue;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(%host, port, error = %format!("{e:#}"), "proxy server stream down; reconnecting");
                        backoff = true;
                    }
                }
            }
            let wait = if backoff {
                let jitter = 1.0 + rand::rng().random_range(0.0..0.1);
                let w = delay.mul_f64(jitter);
                delay = delay.mul_f64(1.5).min(self.config.sync_interval_cap);
                w
            } else {
                self.config.sync_interval
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = ended.notified() => {}
                _ = shutdown.cancelled() => break,
                _ = self.work.idle(), if drain.is_cancelled() => {}
            }
        }
        for stop in sessions.lock().unwrap_or_else(|e| e.into_inner()).values() {
            stop.cancel();
        }
    }

    fn target_count(&self, leases: Option<&LeaseCounter>) -> i64 {
        let header = self.header_count.load(Ordering::Relaxed).max(1);
        let Some(leases) = leases else { return header };
        let counted = leases.count();
        match (self.config.count_source, counted) {
            (_, None) => header,
            (CountSource::Default, Some(n)) => n.max(1),
            (CountSource::Max, Some(n)) => n.max(header),
        }
    }
}
