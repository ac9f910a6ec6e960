//! gRPC serving on bare HTTP/2 (the h2 crate, no tonic or hyper between), shared by the
//! Proxy frontend and the agent link: one task per connection drives HTTP/2, its
//! keepalive pings and every stream's future, so a packet read off the socket reaches
//! the router, and an answer reaches the socket, without waking another task (or
//! going through the scheduler: see [`SelfWake`]); and
//! [`Reply`], the server's half of a stream (headers, messages, status trailers).

use crate::error::chain;
use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use super::{h2_io, percent_encode, Outbound};
use crate::transport::{H2_MAX_FRAME, H2_STREAM_WINDOW};
use bytes::Bytes;
use futures::stream::FuturesUnordered;
use futures::task::AtomicWaker;
use futures::StreamExt;
use h2::server::SendResponse;
use h2::RecvStream;
use tether_proto::Packet;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};

/// The client preface and SETTINGS exchange.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a keepalive ping may go unanswered (hyper's default, which tonic used).
const PING_TIMEOUT: Duration = Duration::from_secs(20);
/// At the hard stop: how long the last frames and the GOAWAY get to leave.
pub const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// How one listener's connections are served.
#[derive(Debug, Clone, Copy)]
pub struct Settings {
    /// Streams a client may have open at once.
    pub max_streams: u32,
    /// The largest header block a client may send.
    pub max_header_list: u32,
    /// PING interval (zero: never).
    pub keepalive: Duration,
    /// The connection's HTTP/2 receive window (each stream's is `H2_STREAM_WINDOW`).
    pub connection_window: u32,
}

/// Checks a call's head as a gRPC server does before reading its body: `POST` to
/// `path`, a gRPC content type, and no message compression (neither the frontend nor
/// the agent link offers any). Both listeners' calls go through here.
pub fn check_call(
    method: &http::Method,
    uri: &http::Uri,
    headers: &http::HeaderMap,
    path: &str,
) -> Result<(), Status> {
    if method != http::Method::POST || uri.path() != path {
        return Err(Status::new(
            Code::Unimplemented,
            format!("unknown method {}", uri.path()),
        ));
    }
    let grpc = headers
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"application/grpc"));
    if !grpc {
        return Err(Status::new(
            Code::InvalidArgument,
            "content-type is not application/grpc",
        ));
    }
    match headers.get("grpc-encoding").map(|e| e.as_bytes()) {
        None | Some(b"identity") => Ok(()),
        Some(other) => Err(Status::new(
            Code::Unimplemented,
            format!(
                "message compression {} is not supported",
                String::from_utf8_lossy(other)
            ),
        )),
    }
}

/// What an h2 error on a stream means as a gRPC status, as tonic maps it.
pub fn status_from_h2(e: &h2::Error) -> Status {
    // grpc-go's server cancels a stream's context when its peer resets the stream or
    // the connection goes, so a read fails `Canceled` whatever the reset's reason: the
    // code upstream's `stream_errors_total` carries. Only a peer that is too chatty
    // gets a code of its own.
    let code = match e.reason() {
        Some(h2::Reason::ENHANCE_YOUR_CALM) => Code::ResourceExhausted,
        _ => Code::Cancelled,
    };
    Status::new(code, e.to_string())
}

/// The code grpc-go's server gives a failed write: `Unavailable` ("transport is
/// closing") once the connection is gone, `Canceled` when only the stream was reset.
pub fn send_error_code(e: &std::io::Error) -> Code {
    let reset = e
        .get_ref()
        .and_then(|inner| inner.downcast_ref::<h2::Error>())
        .is_some_and(|h2| h2.is_reset() && !h2.is_go_away() && !h2.is_io());
    if reset {
        Code::Cancelled
    } else {
        Code::Unavailable
    }
}

/// Serves one connection until the client goes, a keepalive ping goes unanswered, or
/// `hard_stop`; `start` turns each request into the future that serves it (or `None`
/// when it answered the request itself). At the hard stop the connection says GOAWAY
/// and gets [`CLOSE_GRACE`] for its last frames; the streams' futures then run to
/// their end with the connection gone (their reads and writes fail).
pub async fn serve_connection<S, F>(
    io: S,
    settings: Settings,
    hard_stop: CancellationToken,
    start: impl FnMut(http::Request<RecvStream>, SendResponse<Bytes>) -> Option<F>,
) where
    S: AsyncRead + AsyncWrite + Unpin,
    F: Future<Output = ()>,
{
    serve_connection_until(io, settings, None, hard_stop, start).await
}

/// [`serve_connection`], and when `go_away` is cancelled the connection says GOAWAY
/// and takes no new stream while its open ones go on: its client opens its next
/// streams on a new connection (to a successor that took the listener's address).
pub async fn serve_connection_until<S, F>(
    io: S,
    settings: Settings,
    go_away: Option<CancellationToken>,
    hard_stop: CancellationToken,
    mut start: impl FnMut(http::Request<RecvStream>, SendResponse<Bytes>) -> Option<F>,
) where
    S: AsyncRead + AsyncWrite + Unpin,
    F: Future<Output = ()>,
{
    let handshaking = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(io, settings));
    let (conn, pings) = match handshaking.await {
        Ok(Ok(mut conn)) => {
            let pings = conn.ping_pong().expect("taken once");
            (conn, pings)
        }
        Ok(Err(e)) => return tracing::debug!(error = %chain(&e), "HTTP/2 handshake failed"),
        Err(_) => return tracing::debug!("HTTP/2 handshake timed out"),
    };
    let keepalive = std::pin::pin!(keep_alive(pings, settings.keepalive));
    let hard_stop = std::pin::pin!(hard_stop.cancelled());
    let mut serving = Serving::new(conn, keepalive, hard_stop);
    serving.go_away = go_away.map(|t| Box::pin(t.cancelled_owned()));
    loop {
        let event = std::future::poll_fn(|cx| serving.poll_event(cx)).await;
        if serving.handle(event, &mut start).is_break() {
            break;
        }
    }
    drop(serving.conn);
    while serving.streams.next().await.is_some() {}
}

/// The client preface and SETTINGS exchange, with our windows and frame size and the
/// listener's caps.
fn handshake<S>(io: S, settings: Settings) -> Pin<Box<h2::server::Handshake<S, Bytes>>>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    // Boxed: the handshake holds the connection's codec and socket until it hands
    // them to `conn`, and inline it would keep that much room in the connection's
    // future (which lives as long as the connection) for good.
    Box::pin(
        h2::server::Builder::new()
            .initial_window_size(H2_STREAM_WINDOW)
            .initial_connection_window_size(settings.connection_window)
            .max_frame_size(H2_MAX_FRAME)
            .max_concurrent_streams(settings.max_streams)
            .max_header_list_size(settings.max_header_list)
            .handshake::<_, Bytes>(io),
    )
}

/// One connection being served: HTTP/2, its keepalive pings and the hard stop (pinned
/// in [`serve_connection`]), and every stream's future.
struct Serving<'a, S, F, K, H> {
    conn: h2::server::Connection<S, Bytes>,
    keepalive: Pin<&'a mut K>,
    hard_stop: Pin<&'a mut H>,
    streams: FuturesUnordered<F>,
    /// Set at the hard stop (a timer is not kept for every idle connection before).
    closing: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Ends in a GOAWAY that lets the open streams finish (once; then `None`).
    go_away: Option<Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>>,
    stopping: bool,
    wake: Arc<SelfWake>,
    /// Made from `wake`.
    waker: Waker,
}

impl<'a, S, F, K, H> Serving<'a, S, F, K, H>
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: Future<Output = ()>,
    K: Future<Output = ()>,
    H: Future<Output = ()>,
{
    /// A connection with no stream yet.
    fn new(
        conn: h2::server::Connection<S, Bytes>,
        keepalive: Pin<&'a mut K>,
        hard_stop: Pin<&'a mut H>,
    ) -> Self {
        // Handed to the streams and the connection instead of the task's own waker.
        let wake = Arc::new(SelfWake::default());
        Serving {
            conn,
            keepalive,
            hard_stop,
            streams: FuturesUnordered::new(),
            closing: None,
            go_away: None,
            stopping: false,
            waker: Waker::from(wake.clone()),
            wake,
        }
    }

    /// One poll of the connection's task: the streams and the connection (in passes,
    /// see [`SelfWake`]), then the hard stop, the keepalive and the grace.
    fn poll_event(&mut self, cx: &mut Context<'_>) -> Poll<Event> {
        let Serving {
            conn,
            keepalive,
            hard_stop,
            streams,
            closing,
            go_away,
            stopping,
            wake,
            waker,
        } = self;
        wake.poll(
            waker,
            cx,
            |cx| {
                // Streams first: what they queue leaves with the connection's poll
                // just below, in this same pass.
                while let Poll::Ready(Some(())) = streams.poll_next_unpin(cx) {}
                std::pin::pin!(conn.accept()).poll(cx).map(Event::Accepted)
            },
            |cx| {
                if !*stopping && hard_stop.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Event::HardStop);
                }
                if go_away
                    .as_mut()
                    .is_some_and(|g| g.as_mut().poll(cx).is_ready())
                {
                    *go_away = None;
                    return Poll::Ready(Event::GoAway);
                }
                if keepalive.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Event::PingUnanswered);
                }
                match closing.as_mut() {
                    Some(grace) => grace.as_mut().poll(cx).map(|()| Event::GraceOver),
                    None => Poll::Pending,
                }
            },
        )
    }

    /// Acts on `event`: a new stream's future joins the others (none once stopping),
    /// the hard stop says GOAWAY and starts the grace; `Break` ends the connection.
    fn handle(
        &mut self,
        event: Event,
        start: &mut impl FnMut(http::Request<RecvStream>, SendResponse<Bytes>) -> Option<F>,
    ) -> ControlFlow<()> {
        match event {
            Event::Accepted(Some(Ok(_))) if self.stopping => {}
            Event::Accepted(Some(Ok((request, respond)))) => {
                if let Some(stream) = start(request, respond) {
                    self.streams.push(stream);
                }
            }
            Event::Accepted(Some(Err(e))) => {
                tracing::debug!(error = %chain(&e), "connection ended");
                return ControlFlow::Break(());
            }
            Event::Accepted(None) => return ControlFlow::Break(()),
            Event::PingUnanswered => {
                tracing::info!("keepalive ping unanswered; closing the connection");
                return ControlFlow::Break(());
            }
            // Every stream ends at the hard stop: say GOAWAY and let the last frames out.
            Event::HardStop => {
                self.stopping = true;
                self.conn.graceful_shutdown();
                self.closing = Some(Box::pin(tokio::time::sleep(CLOSE_GRACE)));
            }
            Event::GraceOver => return ControlFlow::Break(()),
            // The open streams go on; the connection ends once they have.
            Event::GoAway => self.conn.graceful_shutdown(),
        }
        ControlFlow::Continue(())
    }
}

/// How many times one poll of a connection's task runs its streams and connection
/// again when that run woke the task itself.
const PASSES: usize = 4;

/// What `conn.accept()` gives.
type Accepted = Option<Result<(http::Request<RecvStream>, SendResponse<Bytes>), h2::Error>>;

/// What ends one poll of a connection's task (a value that lives only until handled,
/// so its size does not matter).
#[allow(clippy::large_enum_variant)]
enum Event {
    Accepted(Accepted),
    PingUnanswered,
    HardStop,
    GraceOver,
    GoAway,
}

/// The waker a connection's task hands its streams and its HTTP/2 connection: a wake
/// while the task is polling (a stream queued a frame, or the connection read one for
/// a stream) is only noted, so the poll runs another pass instead of returning and
/// being rescheduled, which tokio does as a yield (to the back of the queue, and
/// sometimes to the other worker); any other wake goes to the task.
#[derive(Default)]
struct SelfWake {
    /// [`IN_POLL`] and [`WOKEN`].
    state: AtomicU8,
    task: AtomicWaker,
}

const IN_POLL: u8 = 1;
const WOKEN: u8 = 2;

impl SelfWake {
    /// One poll of the task, with `waker` (made from this) handed down: `pass` runs
    /// again, up to [`PASSES`] times, while it wakes the task without being ready; then
    /// `rest` once.
    fn poll<T>(
        &self,
        waker: &Waker,
        cx: &mut Context<'_>,
        mut pass: impl FnMut(&mut Context<'_>) -> Poll<T>,
        rest: impl FnOnce(&mut Context<'_>) -> Poll<T>,
    ) -> Poll<T> {
        self.enter(cx.waker());
        let mut inner = Context::from_waker(waker);
        let mut ready = Poll::Pending;
        let mut rerun = false;
        for _ in 0..PASSES {
            ready = pass(&mut inner);
            rerun = self.woken();
            if ready.is_ready() || !rerun {
                break;
            }
        }
        if ready.is_pending() {
            ready = rest(&mut inner);
        }
        if rerun && ready.is_pending() {
            // Out of passes with work still to do: be polled again.
            cx.waker().wake_by_ref();
        }
        self.leave();
        ready
    }

    fn enter(&self, task: &Waker) {
        self.task.register(task);
        self.state.store(IN_POLL, Ordering::Release);
    }

    /// Whether the task was woken since it entered or last asked (and forgets it).
    fn woken(&self) -> bool {
        self.state.fetch_and(!WOKEN, Ordering::AcqRel) & WOKEN != 0
    }

    /// Ends the poll: a wake noted and not run for goes to the task now.
    fn leave(&self) {
        if self.state.swap(0, Ordering::AcqRel) & WOKEN != 0 {
            self.task.wake();
        }
    }
}

impl Wake for SelfWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let mut state = self.state.load(Ordering::Acquire);
        loop {
            if state & IN_POLL == 0 {
                return self.task.wake();
            }
            match self.state.compare_exchange_weak(
                state,
                state | WOKEN,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return,
                Err(now) => state = now,
            }
        }
    }
}

/// Pings every `every` (never if zero); returns when a ping goes unanswered.
async fn keep_alive(mut pings: h2::PingPong, every: Duration) {
    if every.is_zero() {
        return std::future::pending().await;
    }
    loop {
        tokio::time::sleep(every).await;
        let ping = pings.ping(h2::Ping::opaque());
        match tokio::time::timeout(PING_TIMEOUT.min(every), ping).await {
            Ok(Ok(_)) => {}
            // The connection is going anyway; its accept loop sees why.
            Ok(Err(_)) => return std::future::pending().await,
            Err(_) => return,
        }
    }
}

/// The server's half of a stream: the response headers go with the first message (as
/// grpc-go's do) unless sent before, the status in trailers, or alone if nothing was
/// sent.
pub struct Reply {
    respond: Option<SendResponse<Bytes>>,
    headers: http::HeaderMap,
    out: Outbound,
}

impl Reply {
    /// The reply to a request, with `content-type: application/grpc`.
    pub fn new(respond: SendResponse<Bytes>) -> Self {
        let mut headers = http::HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/grpc"),
        );
        Reply {
            respond: Some(respond),
            headers,
            out: Outbound::closed(),
        }
    }

    /// The response headers, until they are sent.
    pub fn headers_mut(&mut self) -> &mut http::HeaderMap {
        &mut self.headers
    }

    /// Sends the response headers now (a client waiting for them before its first
    /// message, as agents do).
    pub fn send_headers(&mut self) -> std::io::Result<()> {
        if let Some(mut respond) = self.respond.take() {
            let mut response = http::Response::new(());
            *response.headers_mut() = std::mem::take(&mut self.headers);
            self.out = Outbound::new(respond.send_response(response, false).map_err(h2_io)?);
        }
        Ok(())
    }

    /// Sends `packet` once HTTP/2 flow control has room.
    pub async fn send(&mut self, packet: &Packet) -> std::io::Result<()> {
        self.send_headers()?;
        self.out.send(packet).await
    }

    /// Ends the stream with `status`: in trailers, or trailers-only when nothing was
    /// sent.
    pub fn finish(&mut self, status: Status) {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", (status.code() as i32).into());
        if !status.message().is_empty() {
            if let Ok(m) = http::HeaderValue::from_str(&percent_encode(status.message())) {
                trailers.insert("grpc-message", m);
            }
        }
        if let Some(mut respond) = self.respond.take() {
            let mut only = http::Response::new(());
            *only.headers_mut() = std::mem::take(&mut self.headers);
            only.headers_mut().extend(trailers);
            let _ = respond.send_response(only, true);
        } else if let Some(stream) = self.out.stream() {
            let _ = stream.send_trailers(trailers);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn a_call_is_checked_as_grpc_servers_do() {
        let check = |method: &str, path: &str, headers: &[(&'static str, &'static str)]| {
            let mut map = http::HeaderMap::new();
            for (k, v) in headers {
                map.insert(*k, http::HeaderValue::from_static(v));
            }
            let uri: http::Uri = format!("http://localhost{path}").parse().unwrap();
            check_call(&method.parse().unwrap(), &uri, &map, "/S/M").map_err(|s| s.code())
        };
        let grpc = ("content-type", "application/grpc");
        assert_eq!(check("POST", "/S/M", &[grpc]), Ok(()));
        assert_eq!(
            check(
                "POST",
                "/S/M",
                &[("content-type", "application/grpc+proto")]
            ),
            Ok(())
        );
        assert_eq!(
            check("POST", "/S/M", &[grpc, ("grpc-encoding", "identity")]),
            Ok(())
        );
        assert_eq!(check("GET", "/S/M", &[grpc]), Err(Code::Unimplemented));
        assert_eq!(check("POST", "/S/Other", &[grpc]), Err(Code::Unimplemented));
        assert_eq!(check("POST", "/S/M", &[]), Err(Code::InvalidArgument));
        assert_eq!(
            check("POST", "/S/M", &[("content-type", "text/plain")]),
            Err(Code::InvalidArgument)
        );
        assert_eq!(
            check("POST", "/S/M", &[grpc, ("grpc-encoding", "gzip")]),
            Err(Code::Unimplemented)
        );
    }

    /// Counts the wakes the task itself gets.
    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn task() -> (Arc<Count>, Waker, Arc<SelfWake>, Waker) {
        let count = Arc::new(Count::default());
        let wake = Arc::new(SelfWake::default());
        let inner = Waker::from(wake.clone());
        (count.clone(), Waker::from(count), wake, inner)
    }

    /// One poll whose pass wakes the task itself on its first `wakes` runs: how many
    /// times the pass ran, and how many wakes reached the task.
    fn poll_waking(wakes: usize) -> (usize, usize) {
        let (count, task, wake, inner) = task();
        let mut cx = Context::from_waker(&task);
        let mut runs = 0;
        let polled: Poll<()> = wake.poll(
            &inner,
            &mut cx,
            |cx| {
                runs += 1;
                if runs <= wakes {
                    cx.waker().wake_by_ref();
                }
                Poll::Pending
            },
            |_| Poll::Pending,
        );
        assert!(polled.is_pending());
        (runs, count.0.load(Ordering::SeqCst))
    }

    #[test]
    fn a_pass_that_wakes_the_task_runs_again_within_the_poll() {
        // No trip through the scheduler.
        assert_eq!(poll_waking(0), (1, 0));
        assert_eq!(poll_waking(2), (3, 0));
    }

    #[test]
    fn a_task_still_waking_itself_after_every_pass_is_woken_not_lost() {
        assert_eq!(poll_waking(usize::MAX), (PASSES, 1), "polled again later");
        // A wake from in `rest` is not lost either.
        let (count, task, wake, inner) = task();
        let mut cx = Context::from_waker(&task);
        let polled: Poll<()> = wake.poll(
            &inner,
            &mut cx,
            |_| Poll::Pending,
            |cx| {
                cx.waker().wake_by_ref();
                Poll::Pending
            },
        );
        assert!(polled.is_pending());
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn wakes_between_polls_go_to_the_task() {
        let (count, task, wake, inner) = task();
        let mut cx = Context::from_waker(&task);
        let kept = std::cell::RefCell::new(None);
        let polled: Poll<()> = wake.poll(
            &inner,
            &mut cx,
            |cx| {
                *kept.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            },
            |_| Poll::Pending,
        );
        assert!(polled.is_pending());
        assert_eq!(count.0.load(Ordering::SeqCst), 0);
        let kept = kept.take().expect("registered");
        std::thread::spawn(move || kept.wake()).join().unwrap();
        assert_eq!(count.0.load(Ordering::SeqCst), 1);
        // Ready ends the poll at once.
        let polled = wake.poll(&inner, &mut cx, |_| Poll::Ready(7), |_| Poll::Pending);
        assert_eq!(polled, Poll::Ready(7));
    }
}
