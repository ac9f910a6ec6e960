//! Balanced leases: of a kind a replica may hold several of (the load-balancer pools'),
//! spread over the replicas. A replica waits one more retry period per lease of the
//! kind it holds before taking a free one, the holder writes how many it holds on the
//! lease, and a standby holding at least two fewer asks for it in an annotation; the
//! holder hands it over gracefully (its term lets go first, then the lease is released
//! to the asker, whom the others leave it to).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use kube::api::PostParams;

use super::{Attempt, Elector, LeaseError};

/// The holder's count of leases of the kind (balanced leases).
pub const HELD_ANNOTATION: &str = "tether.dev/leases-held";
/// A standby's request for the lease: `<identity> <leases it holds>`.
pub const REQUEST_ANNOTATION: &str = "tether.dev/handover-request";
/// Released to this identity: the others leave it to it for a lease duration.
pub const HANDOVER_ANNOTATION: &str = "tether.dev/handover-to";

/// A replica's share of balanced leases.
#[derive(Debug, Default)]
pub struct Balance {
    /// How many it holds. The caller keeps it current as its terms start and end; a
    /// granted handover takes one off as soon as it is written.
    pub held: AtomicUsize,
    /// The lease it asked for, and when: one request at a time, so that an asker
    /// does not collect several leases on one stale count.
    asking: std::sync::Mutex<Option<(String, Instant)>>,
}

impl Balance {
    fn asking(&self) -> std::sync::MutexGuard<'_, Option<(String, Instant)>> {
        self.asking.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A count taken off until the grant it was reserved for is written (put back if the
/// write fails or is abandoned).
struct Reserved<'a> {
    balance: &'a Balance,
    committed: bool,
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        if !self.committed {
            self.balance.held.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// A handover the holder grants: to whom, how many they hold, and our count reserved.
struct Grant<'a> {
    asker: String,
    theirs: usize,
    reserved: Reserved<'a>,
}

/// The grant of `request` (`<identity> <count>`), if it leaves both replicas nearer an
/// even share. Our count drops now, so another request this round sees it, and comes
/// back if the grant is not written.
fn grant<'a>(balance: &'a Balance, request: Option<&str>) -> Option<Grant<'a>> {
    let (asker, theirs) = request.and_then(parse_request)?;
    balance
        .held
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |mine| {
            (mine > theirs.saturating_add(1)).then(|| mine - 1)
        })
        .ok()?;
    Some(Grant {
        asker: asker.to_string(),
        theirs,
        reserved: Reserved {
            balance,
            committed: false,
        },
    })
}

/// The value of annotation `key` on `lease`.
fn annotation<'a>(lease: &'a Lease, key: &str) -> Option<&'a str> {
    lease
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// `<identity> <count>` of a handover request.
fn parse_request(r: &str) -> Option<(&str, usize)> {
    let (who, n) = r.rsplit_once(' ')?;
    Some((who, n.parse().ok()?))
}

impl Elector {
    /// How many leases of the kind we hold, 0 when not balanced.
    pub(super) fn held(&self) -> usize {
        self.cfg
            .balance
            .as_ref()
            .map(|b| b.held.load(Ordering::SeqCst))
            .unwrap_or(0)
    }

    /// Whether a free lease was released to another replica, and is still theirs (for
    /// two retry periods: it polls fast).
    pub(super) fn left_to_another(&mut self, lease: &Lease, first_seen: Instant) -> bool {
        if self.cfg.balance.is_none() {
            return false;
        }
        let Some(to) = annotation(lease, HANDOVER_ANNOTATION) else {
            return false;
        };
        let reserved = self.cfg.retry_period * 2;
        if to != self.cfg.identity && first_seen.elapsed() < reserved {
            self.expires = Some(first_seen + reserved);
            return true;
        }
        false
    }

    /// Writes a balanced lease we hold (or take): our count on it, a standby's request
    /// answered (granted if it evens the shares out), a handover to us cleared.
    pub(super) async fn write_balanced(
        &mut self,
        mut lease: Lease,
        spec: LeaseSpec,
        ours: bool,
    ) -> Result<Option<Attempt>, LeaseError> {
        let request = annotation(&lease, REQUEST_ANNOTATION).map(str::to_string);
        let mut held = self.held() + usize::from(!ours);
        let balance = self.cfg.balance.as_deref();
        let granted = match balance {
            Some(b) if ours && self.granted.is_none() => grant(b, request.as_deref()),
            _ => None,
        };
        if granted.is_some() {
            held = held.saturating_sub(1);
        }
        let annotations = lease.metadata.annotations.get_or_insert_with(BTreeMap::new);
        annotations.remove(HANDOVER_ANNOTATION);
        annotations.remove(REQUEST_ANNOTATION);
        annotations.insert(HELD_ANNOTATION.to_string(), held.to_string());
        if let (false, Some(b)) = (ours, balance) {
            // What we asked for, or not: we hold one more now.
            b.asking().take();
        }
        let written = self.write(lease, spec).await;
        if let (Ok(Some(Attempt::Held)), Some(mut g)) = (&written, granted) {
            g.reserved.committed = true;
            tracing::info!(asker = %g.asker, theirs = g.theirs, mine = held, "handing the lease over to even out the replicas' shares");
            self.granted = Some(g.asker);
        }
        written
    }

    /// Whether our pending request is for this lease (and not stale).
    fn asked_for_this(&self) -> bool {
        let Some(b) = &self.cfg.balance else {
            return false;
        };
        let mut asking = b.asking();
        match &*asking {
            Some((_, at)) if at.elapsed() > self.cfg.lease_duration * 2 => {
                *asking = None;
                false
            }
            Some((name, _)) => *name == self.cfg.name,
            None => false,
        }
    }

    /// A standby of a balanced lease held by another: asks for it when the holder
    /// holds at least two more of the kind than we do (and nobody asked yet).
    pub(super) async fn maybe_ask(&mut self, lease: Lease) -> Result<Option<Attempt>, LeaseError> {
        if self.asked_for_this() {
            self.await_answer(&lease);
            return Ok(Some(Attempt::NotHeld));
        }
        let mine = self.held();
        let theirs: Option<usize> =
            annotation(&lease, HELD_ANNOTATION).and_then(|h| h.parse().ok());
        let Some(theirs) = theirs.filter(|t| *t > mine.saturating_add(1)) else {
            return Ok(Some(Attempt::NotHeld));
        };
        // Another's request pending: the holder answers it first. And one request of
        // ours at a time.
        if annotation(&lease, REQUEST_ANNOTATION).is_none() && self.start_asking() {
            self.ask(lease, theirs, mine).await?;
        }
        Ok(Some(Attempt::NotHeld))
    }

    /// Our request is out: answered at the holder's next renewal (a grant is released
    /// to us), so look again soon; gone with the holder still holding, it was denied.
    fn await_answer(&mut self, lease: &Lease) {
        self.eager = true;
        let ours_pending = annotation(lease, REQUEST_ANNOTATION)
            .is_some_and(|r| r.starts_with(&format!("{} ", self.cfg.identity)));
        if !ours_pending {
            if let Some(b) = &self.cfg.balance {
                b.asking().take();
            }
        }
    }

    /// Notes that we ask for this lease; false if we are asking for one already.
    fn start_asking(&self) -> bool {
        let Some(b) = &self.cfg.balance else {
            return false;
        };
        let mut asking = b.asking();
        if asking.is_some() {
            return false;
        }
        *asking = Some((self.cfg.name.clone(), Instant::now()));
        true
    }

    /// Writes our request on the lease (`theirs`: what its holder holds, `mine`: us).
    async fn ask(
        &mut self,
        mut lease: Lease,
        theirs: usize,
        mine: usize,
    ) -> Result<(), LeaseError> {
        lease
            .metadata
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(
                REQUEST_ANNOTATION.to_string(),
                format!("{} {mine}", self.cfg.identity),
            );
        match self
            .api
            .replace(&self.cfg.name, &PostParams::default(), &lease)
            .await
        {
            Ok(_) => {
                tracing::info!(holds = theirs, mine, "asked the holder for the lease");
                self.eager = true;
                Ok(())
            }
            Err(e) => {
                if let Some(b) = &self.cfg.balance {
                    b.asking().take();
                }
                match e {
                    kube::Error::Api(a) if a.code == 409 => Ok(()),
                    e => Err(self.err(e)),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn handover_requests_name_the_asker_and_its_count() {
        assert_eq!(
            super::parse_request("host-a_1234 2"),
            Some(("host-a_1234", 2))
        );
        assert_eq!(super::parse_request("host a 0"), Some(("host a", 0)));
        assert_eq!(super::parse_request("host-a"), None);
        assert_eq!(super::parse_request("host-a x"), None);
    }
}
