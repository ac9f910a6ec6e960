//! Dials that wait for an agent (`--wait-for-agent`): while a server has just started, a
//! successor is taking over, or a node's agent is reconnecting, a dial no connected agent
//! can take waits for one to arrive instead of failing at once.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tether_proto::{DialRequest, Packet};
use tracing::Instrument;

use super::{NoRoute, Router, NO_AGENT};
use crate::router::state::{AgentStream, FrontendStream};

/// How often a waiting dial looks again without news of an agent: the Node inventory
/// (which verifies an agent's node) changes without the registry saying so.
const LOOK_AGAIN: Duration = Duration::from_millis(250);

/// Whether a dial that found no agent for this reason should wait for one: for a
/// missing agent, not for an address no agent may ever take.
pub(super) fn worth_waiting(why: &NoRoute, wait: Duration) -> bool {
    !wait.is_zero()
        && matches!(
            why,
            NoRoute::NoAgent | NoRoute::NodeAgent(_) | NoRoute::NodesUnknown
        )
}

impl Router {
    /// Routes `req` as soon as an agent that may take it is connected, within
    /// `--wait-for-agent` (and the dial timeout); else fails it as a dial with no agent.
    /// The frontend goes on meanwhile: its other connections are not held up.
    pub(super) fn wait_for_agent(
        self: &Arc<Self>,
        fe: Arc<FrontendStream>,
        req: DialRequest,
        why: NoRoute,
    ) {
        let this = self.clone();
        let started = Instant::now();
        let deadline = started + self.config.agent_wait.min(self.dial_timeout());
        let address = req.address.clone();
        tracing::debug!(%address, reason = %why, "no agent yet; the dial waits for one");
        let work = self.work.watch();
        fe.wait(req.random, &address);
        tokio::spawn(
            async move {
                let _work = work;
                let routed = this.agent_for(&fe, &req, deadline).await;
                // Cancelled (CLOSE_DIAL) or its stream gone meanwhile: nothing to answer.
                if fe.unwait(req.random).is_none() {
                    return;
                }
                match routed {
                    Ok((agent, strategy)) => {
                        this.metrics.dials_waited.with_label_values(&["arrived"]).inc();
                        let (agent_id, waited) = (&agent.agent_id, started.elapsed());
                        tracing::info!(%address, ?waited, %agent_id, "an agent arrived; the waiting dial goes to it");
                        this.send_dial(&fe, req, agent, strategy, started, 0).await;
                    }
                    Err(why) => {
                        this.metrics.dials_waited.with_label_values(&["gave_up"]).inc();
                        this.no_agent(&fe, &address, &why);
                        this.to_frontend(&fe, Packet::dial_response(req.random, 0, NO_AGENT));
                    }
                }
            }
            .in_current_span(),
        );
    }

    /// The agent `req` goes to, once one is connected; why none, at `deadline`, when
    /// `fe` is gone or no longer wants it, or when the server stops.
    async fn agent_for(
        &self,
        fe: &FrontendStream,
        req: &DialRequest,
        deadline: Instant,
    ) -> Result<(Arc<AgentStream>, &'static str), NoRoute> {
        loop {
            // Asked for before looking, so an agent arriving in between is seen.
            let arrived = self.registry.arrived();
            let why = match self.registry.route(&self.config.strategies, &req.address) {
                Ok(routed) => return Ok(routed),
                Err(why) => why,
            };
            let stopping = self.stopping.load(Ordering::Relaxed);
            let wanted = !fe.is_closed() && fe.is_waiting(req.random);
            if !wanted || stopping || Instant::now() >= deadline {
                return Err(why);
            }
            let next = deadline.min(Instant::now() + LOOK_AGAIN);
            tokio::select! {
                () = arrived => {}
                () = tokio::time::sleep_until(next.into()) => {}
            }
        }
    }
}
