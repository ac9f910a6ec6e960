//! The HTTP-CONNECT frontend: `CONNECT host:port HTTP/1.1`, then `200 Connection
//! Established` and raw bytes, one tunnel per connection. 400 for a malformed request,
//! 405 for other methods, 500 when no agent is available, 502/503/504 for agent dial
//! errors (504 for timeouts, 503 for resource exhaustion).

use std::sync::Arc;
use std::time::Duration;
use tether_core::error::chain;

use bytes::{Bytes, BytesMut};
use tether_core::pump::{splice, Buffered, Flow, Sink, SpliceEnd};
use tether_proto::{packet::Payload, DialRequest, Packet};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::router::{outbox, DialError, FrontendPeer, FrontendSink, FrontendStream, Router};

/// Largest request head we accept.
const MAX_HEAD: usize = 64 * 1024;
/// How long a client may take to send its request head.
const HEAD_TIMEOUT: Duration = Duration::from_secs(30);
/// Backstop for a dial nobody answers when `--backend-dial-timeout` is off (upstream's
/// client gives up after 30 s as well).
const DIAL_BACKSTOP: Duration = Duration::from_secs(30);

/// Serves one HTTP-CONNECT client connection to the end: read the request head, dial
/// through the router, then pump bytes both ways.
pub async fn serve_connection<S>(
    router: Arc<Router>,
    mut sock: S,
    peer: Arc<FrontendPeer>,
    hard_stop: CancellationToken,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let gauge = router.metrics.http_connections.clone();
    gauge.inc();
    let _guard = scopeguard(move || gauge.dec());

    let Some((address, leftover)) = accept_head(&mut sock).await else {
        return;
    };
    tracing::Span::current().record("address", address.as_str());
    let (tx, rx) = tether_core::queue::queue();
    let fe = FrontendStream::http_connect(tx, peer);
    let mut rx = outbox(rx);
    let connect_id = match dial(&router, &fe, &mut rx, &address, &hard_stop).await {
        Ok(id) => id,
        Err((status, body)) => {
            // Cancels a dial still pending, closes a connection the agent opened late.
            router.frontend_gone(&fe).await;
            respond(&mut sock, status, &format!("{body}\n")).await;
            return;
        }
    };
    if sock
        .write_all(b"HTTP/1.1 200 Connection Established\r\n\r\n")
        .await
        .is_err()
    {
        router.frontend_gone(&fe).await;
        return;
    }
    tracing::debug!(%address, connect_id, "tunnel established");
    let sink = FrontendSink::new(&router, &fe);
    if leftover.is_empty() || sink.send(Packet::data(connect_id, leftover)).await {
        // DATA from the agent leaves its window in `outbox`; ours takes the road every
        // frontend takes (credit, counters) through the sink.
        let (rd, wr) = tokio::io::split(&mut sock);
        let flow = Flow::default();
        match splice(Buffered(rd), wr, rx, &sink, connect_id, &hard_stop, flow).await {
            SpliceEnd::RemoteClosed(Some(err)) => {
                tracing::debug!(%err, connect_id, "closed by agent")
            }
            SpliceEnd::LocalError(e) => {
                tracing::debug!(error = %chain(&e), connect_id, "client connection failed")
            }
            _ => {}
        }
    }
    // Closes the connection on the agent unless the agent closed it first.
    router.frontend_gone(&fe).await;
}

/// Reads the request head; answers and returns `None` when it is not a CONNECT we can
/// serve. The target address and any bytes the client sent after the head.
async fn accept_head<S>(sock: &mut S) -> Option<(String, Bytes)>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (status, body) = match tokio::time::timeout(HEAD_TIMEOUT, read_head(sock)).await {
        Ok(Ok(Head::Connect { address, leftover })) => return Some((address, leftover)),
        Ok(Ok(Head::OtherMethod(method))) => {
            tracing::info!(%method, "non-CONNECT request refused");
            (
                "405 Method Not Allowed",
                "only CONNECT is supported".to_string(),
            )
        }
        Ok(Ok(Head::Malformed(why))) => {
            tracing::info!(%why, "malformed CONNECT request");
            ("400 Bad Request", why)
        }
        Ok(Err(e)) => {
            tracing::debug!(error = %chain(&e), "client went away before sending a request");
            return None;
        }
        Err(_) => (
            "408 Request Timeout",
            "request head not received in time".to_string(),
        ),
    };
    respond(sock, status, &format!("{body}\n")).await;
    None
}

/// Dials `address` for `fe` and waits for the answer: the connectID, or the status
/// and body to answer the client with.
async fn dial<In>(
    router: &Arc<Router>,
    fe: &Arc<FrontendStream>,
    rx: &mut In,
    address: &str,
    hard_stop: &CancellationToken,
) -> Result<i64, (&'static str, String)>
where
    In: futures::Stream<Item = Packet> + Unpin,
{
    use futures::StreamExt;
    let req = DialRequest {
        protocol: "tcp".into(),
        address: address.to_string(),
        random: tether_core::random_id(),
    };
    match router.dial(fe, req).await {
        Ok(()) => {}
        Err(DialError::NoAgent) => {
            return Err((
                "500 Internal Server Error",
                "currently no tunnels available".into(),
            ))
        }
        Err(DialError::BadAddress(e)) => return Err(("400 Bad Request", e.to_string())),
        Err(e @ DialError::ShuttingDown) => return Err(("503 Service Unavailable", e.to_string())),
    }
    let first = tokio::select! {
        p = tokio::time::timeout(DIAL_BACKSTOP, rx.next()) => p,
        _ = hard_stop.cancelled() => Ok(None),
    };
    match first.map(|p| p.and_then(|p| p.payload)) {
        Ok(Some(Payload::DialResponse(rsp))) if rsp.error.is_empty() => {
            match fe.route(rsp.connect_id).and_then(|c| c.agent()) {
                Some(_) => Ok(rsp.connect_id),
                None => Err(("502 Bad Gateway", "agent disconnected".into())),
            }
        }
        // A dial that waited for an agent (--wait-for-agent) and none came: what
        // upstream answers when there is none.
        Ok(Some(Payload::DialResponse(rsp))) if rsp.error == crate::router::NO_AGENT => Err((
            "500 Internal Server Error",
            "currently no tunnels available".into(),
        )),
        Ok(Some(Payload::DialResponse(rsp))) => {
            tracing::info!(error = %rsp.error, %address, "dial failed");
            Err((dial_error_status(&rsp.error), rsp.error))
        }
        Ok(Some(_)) => Err(("502 Bad Gateway", "dial cancelled by the agent".into())),
        Ok(None) => Err(("503 Service Unavailable", "server shutting down".into())),
        Err(_) => Err(("504 Gateway Timeout", "dial timeout".into())),
    }
}

/// The status for an agent's dial error (upstream's mapping).
pub fn dial_error_status(error: &str) -> &'static str {
    let e = error.to_ascii_lowercase();
    // Deadline causes, as Go and Rust spell them: "i/o timeout", "context deadline
    // exceeded", "connection timed out", our own "dial timeout".
    if e.contains("timeout") || e.contains("timed out") || e.contains("deadline") {
        "504 Gateway Timeout"
    } else if e.contains("too many open files")
        || e.contains("resource")
        || e.contains("no buffer space")
    {
        "503 Service Unavailable"
    } else {
        "502 Bad Gateway"
    }
}

enum Head {
    Connect { address: String, leftover: Bytes },
    OtherMethod(String),
    Malformed(String),
}

async fn read_head<S: AsyncRead + Unpin>(sock: &mut S) -> std::io::Result<Head> {
    let mut buf = BytesMut::with_capacity(1024);
    loop {
        if sock.read_buf(&mut buf).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf) {
            Ok(httparse::Status::Complete(n)) => {
                let method = req.method.unwrap_or_default().to_string();
                if method != "CONNECT" {
                    return Ok(Head::OtherMethod(method));
                }
                let target = req.path.unwrap_or_default();
                if !valid_authority(target) {
                    return Ok(Head::Malformed(format!(
                        "CONNECT target {target:?} is not host:port"
                    )));
                }
                let address = target.to_string();
                let leftover = buf.split_off(n).freeze();
                return Ok(Head::Connect { address, leftover });
            }
            Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => continue,
            Ok(httparse::Status::Partial) => {
                return Ok(Head::Malformed(format!(
                    "request head larger than {MAX_HEAD} bytes"
                )))
            }
            Err(e) => return Ok(Head::Malformed(format!("malformed request: {e}"))),
        }
    }
}

/// Fuzzing entry point: reads a request head from `input`; the CONNECT target it
/// accepts (a valid `host:port`), or why the request is refused.
#[doc(hidden)]
pub fn fuzz_head(input: &[u8]) -> Result<String, String> {
    let mut sock = input;
    match futures::executor::block_on(read_head(&mut sock)) {
        Ok(Head::Connect { address, .. }) => {
            assert!(valid_authority(&address), "accepted {address:?}");
            Ok(address)
        }
        Ok(Head::OtherMethod(m)) => Err(format!("method {m}")),
        Ok(Head::Malformed(why)) => Err(why),
        Err(e) => Err(e.to_string()),
    }
}

fn valid_authority(target: &str) -> bool {
    let (host, port) = match target.rsplit_once(':') {
        Some(pair) => pair,
        None => return false,
    };
    let host_ok = if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        inner.parse::<std::net::Ipv6Addr>().is_ok()
    } else {
        !host.is_empty() && !host.contains(['/', '@', ' ', '[', ']']) && !host.contains(':')
    };
    host_ok && port.parse::<u16>().is_ok_and(|p| p != 0)
}

async fn respond<S: AsyncWrite + Unpin>(sock: &mut S, status: &str, body: &str) {
    let msg = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = sock.write_all(msg.as_bytes()).await;
    let _ = sock.shutdown().await;
}

struct Guard<F: FnOnce()>(Option<F>);
impl<F: FnOnce()> Drop for Guard<F> {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f()
        }
    }
}
fn scopeguard<F: FnOnce()>(f: F) -> Guard<F> {
    Guard(Some(f))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn authorities() {
        assert!(valid_authority("10.0.0.1:10250"));
        assert!(valid_authority("node-1:443"));
        assert!(valid_authority("[fd00::1]:443"));
        assert!(!valid_authority("node-1"));
        assert!(!valid_authority("node-1:0"));
        assert!(!valid_authority("node-1:http"));
        assert!(!valid_authority("/path:1"));
        assert!(!valid_authority("fd00::1:443"));
    }

    #[test]
    fn status_mapping() {
        assert_eq!(
            dial_error_status("dial tcp 1.2.3.4:5: i/o timeout"),
            "504 Gateway Timeout"
        );
        assert_eq!(
            dial_error_status("dial timeout: no answer"),
            "504 Gateway Timeout"
        );
        assert_eq!(
            dial_error_status("dial tcp 10.0.0.1:10250: context deadline exceeded"),
            "504 Gateway Timeout"
        );
        assert_eq!(dial_error_status("connection refused"), "502 Bad Gateway");
        assert_eq!(
            dial_error_status("too many open files"),
            "503 Service Unavailable"
        );
    }
}
