//! The rtnetlink connection the host-side providers share (routes, load-balancer
//! addresses): opened on first use, reopened after an I/O-level failure, and errors
//! turned into provider errors that say which privilege or setting is missing.

use tokio::sync::Mutex;

use crate::cloud::CloudError;

/// A lazily opened rtnetlink connection.
#[derive(Default)]
pub struct Netlink {
    handle: Mutex<Option<rtnetlink::Handle>>,
}

impl Netlink {
    /// The connection, opened now if there is none.
    pub async fn handle(&self) -> Result<rtnetlink::Handle, CloudError> {
        let mut slot = self.handle.lock().await;
        if let Some(h) = slot.as_ref() {
            return Ok(h.clone());
        }
        let (conn, handle, _) = rtnetlink::new_connection()
            .map_err(|e| CloudError::Provider(format!("cannot open a netlink socket: {e}")))?;
        tokio::spawn(conn);
        *slot = Some(handle.clone());
        Ok(handle)
    }

    /// Turns `e` from `what` into a provider error, forgetting the connection when the
    /// failure was not the kernel's answer (the next call reopens it).
    pub async fn failed(&self, what: String, e: &rtnetlink::Error) -> CloudError {
        if !matches!(e, rtnetlink::Error::NetlinkError(_)) {
            *self.handle.lock().await = None;
        }
        let hint = match errno(e) {
            Some(libc::EPERM) => " (the CCM needs CAP_NET_ADMIN in the host network namespace)",
            Some(libc::ENETUNREACH) => " (the next hop is not on a directly connected network)",
            _ => "",
        };
        CloudError::Provider(format!("{what}: {e}{hint}"))
    }
}

/// The errno the kernel answered with, if `e` is such an answer.
pub fn errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.code.map(|c| -c.get()),
        _ => None,
    }
}
