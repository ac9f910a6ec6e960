//! Transports under tonic and the HTTP-CONNECT frontend: a TLS accept loop that never
//! lets a slow or broken handshake block other clients, Unix-socket listeners that
//! replace stale sockets, and gRPC channel connectors for mTLS TCP and Unix sockets.

use crate::error::chain;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use rustls_pki_types::CertificateDer;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream, UnixListener};
use tokio::sync::mpsc;
use tokio_rustls::{TlsAcceptor, TlsConnector};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::admission::{Admission, AdmissionLimits, ConnectionSlot, Pending, Stage};
use crate::read_ahead::ReadAhead;

/// A client's TLS connection over TCP, read through [`ReadAhead`].
pub type ClientTls = TlsOver<TcpStream>;

/// A client's TLS connection over `IO` (TCP, or a tunnel through a proxy), read through
/// [`ReadAhead`].
pub type TlsOver<IO> = tokio_rustls::client::TlsStream<ReadAhead<IO>>;

/// How much application data a TLS connection takes from one write before it must send
/// what it holds: a whole HTTP/2 frame of the largest size both ends use
/// ([`H2_MAX_FRAME`]) plus its header and the frames queued beside it. rustls' default
/// (64 KiB) cut every 128 KiB frame into two `writev`s, and each ended in a TCP segment of
/// a few hundred bytes (a 64 KiB write is a little more than one 64 KiB loopback
/// segment once TLS has added its record headers), twice the segments and wake-ups of
/// the same bytes in one write. The buffer empties into the socket at once; it only
/// fills while the peer is not reading.
pub const TLS_WRITE_BUFFER: usize = 2 * H2_MAX_FRAME as usize;

/// Sets what every TLS connection of ours takes per write ([`TLS_WRITE_BUFFER`]).
fn tune_tls<D>(conn: &mut rustls::ConnectionCommon<D>) {
    conn.set_buffer_limit(Some(TLS_WRITE_BUFFER));
}

/// How long a client may take to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a client may take to send the first byte of its ClientHello: a real client
/// sends it with the connection's first segment (a lost one is resent within about 3 s);
/// a socket left idle is a slow flood's.
pub const FIRST_BYTE_TIMEOUT: Duration = Duration::from_secs(5);

/// Failed handshakes logged as warnings per second, and their burst; the others are
/// counted in the next warning (a flood of garbage must not become a flood of lines).
const HANDSHAKE_WARNINGS: (f64, u32) = (1.0, 10);

/// Hands out the current server TLS config for each new handshake (so certificates can
/// be replaced without restarting listeners).
pub type ServerConfigSource = Arc<dyn Fn() -> Arc<rustls::ServerConfig> + Send + Sync>;

/// Who is on the other end of an accepted TLS connection.
#[derive(Debug, Clone)]
pub struct TlsConnectInfo {
    /// The peer's socket address.
    pub remote_addr: std::net::SocketAddr,
    /// The peer's certificate chain, when it presented one.
    pub peer_certs: Option<Arc<Vec<CertificateDer<'static>>>>,
}

/// An accepted, handshaken server-side TLS connection.
pub struct TlsConn {
    stream: tokio_rustls::server::TlsStream<ReadAhead<TcpStream>>,
    info: TlsConnectInfo,
    /// Its place under the listener's connection cap, given back when it closes.
    _slot: ConnectionSlot,
    /// Its place among the listener's unproven connections, until its peer proves who
    /// it is ([`TlsConn::take_pending`]).
    pending: Option<Pending>,
}

impl TlsConn {
    /// The peer's address and certificates.
    pub fn info(&self) -> &TlsConnectInfo {
        &self.info
    }

    /// The protocol the client and the server agreed on by ALPN, if any.
    pub fn alpn(&self) -> Option<&[u8]> {
        self.stream.get_ref().1.alpn_protocol()
    }

    /// Its place among the unproven connections: drop it once the peer has proved who it
    /// is (a client certificate the caller accepts, an authenticated request), and close
    /// the connection if it is evicted first.
    pub fn take_pending(&mut self) -> Option<Pending> {
        self.pending.take()
    }
}

// === impl TlsConn ===

impl AsyncRead for TlsConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for TlsConn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.stream).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for TlsConn {
    type ConnectInfo = TlsConnectInfo;
    fn connect_info(&self) -> TlsConnectInfo {
        self.info.clone()
    }
}

/// Accepts TCP connections on `listener` and completes TLS handshakes concurrently,
/// yielding the finished connections until `hard_stop`. Failed handshakes (garbage,
/// wrong CA, timeouts) are logged and dropped; they never stall other clients.
pub fn tls_incoming(
    listener: TcpListener,
    tls: ServerConfigSource,
    name: &'static str,
    hard_stop: CancellationToken,
) -> mpsc::Receiver<TlsConn> {
    let admission = Arc::new(Admission::new(AdmissionLimits::NONE, Arc::new(|_| {})));
    tls_incoming_with(listener, tls, name, None, admission, hard_stop)
}

/// [`tls_incoming`] under `admission`'s caps on connections and handshakes, with every
/// accepted socket closed by the kernel once its peer has been silent for `dead_link`
/// (see [`bound_silence`]).
pub fn tls_incoming_with(
    listener: TcpListener,
    tls: ServerConfigSource,
    name: &'static str,
    dead_link: Option<Duration>,
    admission: Arc<Admission>,
    hard_stop: CancellationToken,
) -> mpsc::Receiver<TlsConn> {
    let (tx, rx) = mpsc::channel(64);
    let span = tracing::info_span!("tls_accept", listener = name);
    tokio::spawn(accept_loop(listener, tls, dead_link, admission, hard_stop, tx).instrument(span));
    rx
}

/// Accepts connections as `admission` has room for them, each handshaken in a task of
/// its own, until `hard_stop` or until nobody takes the connections from `tx`. Only the
/// connection cap makes it wait: a full set of unproven connections makes room by
/// evicting, so the kernel's backlog never holds a real client behind a flood.
async fn accept_loop(
    listener: TcpListener,
    tls: ServerConfigSource,
    dead_link: Option<Duration>,
    admission: Arc<Admission>,
    hard_stop: CancellationToken,
    tx: mpsc::Sender<TlsConn>,
) {
    let warnings = Arc::new(Warnings::new(HANDSHAKE_WARNINGS.0, HANDSHAKE_WARNINGS.1));
    loop {
        // Room first, then accept: a full listener leaves new clients in the
        // kernel's backlog, where they hold no descriptor of ours.
        let slot = tokio::select! {
            _ = hard_stop.cancelled() => break,
            _ = tx.closed() => break,
            slot = admission.connection_slot() => slot,
        };
        let (tcp, remote_addr) = tokio::select! {
            _ = hard_stop.cancelled() => break,
            _ = tx.closed() => break,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    match warnings.allow() {
                        Some(suppressed) => tracing::warn!(error = %chain(&e), suppressed, "accept failed"),
                        None => tracing::debug!(error = %chain(&e), "accept failed"),
                    }
                    // EMFILE and friends: back off a little instead of spinning.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let pending = tokio::select! {
            _ = hard_stop.cancelled() => break,
            admitted = admission.admit(remote_addr.ip()) => admitted,
        };
        let Ok(pending) = pending else {
            tracing::debug!(peer = %remote_addr, "too many unproven connections from this address or prefix; connection closed");
            continue;
        };
        tune_accepted(&tcp, dead_link);
        if has_data(&tcp) {
            // Its hello is already here: it is handshaking, whenever its task runs.
            pending.set_stage(Stage::Handshaking);
        }
        let acceptor = TlsAcceptor::from(tls());
        let handshake = handshake(
            acceptor,
            tcp,
            remote_addr,
            (slot, pending),
            tx.clone(),
            (warnings.clone(), admission.clone()),
        );
        tokio::spawn(handshake.instrument(tracing::info_span!("handshake", peer = %remote_addr)));
    }
}

/// Warnings a listener logs about its clients, at most [`HANDSHAKE_WARNINGS`].
type Warnings = crate::ratelimit::LogLimit;

/// Sets an accepted socket's options: no Nagle delay, and closed by the kernel once its
/// peer has been silent for `dead_link`.
fn tune_accepted(tcp: &TcpStream, dead_link: Option<Duration>) {
    let _ = tcp.set_nodelay(true);
    if let Some(limit) = dead_link {
        if let Err(e) = bound_silence(tcp, limit) {
            tracing::warn!(error = %chain(&e), "cannot set TCP keepalive and user timeout");
        }
    }
}

/// Has the peer sent anything yet? (A non-blocking peek at an accepted socket.)
fn has_data(tcp: &TcpStream) -> bool {
    let mut byte = [std::mem::MaybeUninit::<u8>::uninit()];
    matches!(socket2::SockRef::from(tcp).peek(&mut byte), Ok(n) if n > 0)
}

/// Why a handshake did not finish.
enum Unfinished {
    Silent,
    Failed(io::Error),
    TimedOut,
}

/// Runs one TLS handshake: its first byte within [`FIRST_BYTE_TIMEOUT`], all of it
/// within [`HANDSHAKE_TIMEOUT`], unless evicted first; then hands the connection
/// (holding its slot and its unproven place) to `tx`. A failed one is logged (rate
/// limited) and dropped.
// An async block, not an async fn: an async fn would copy its arguments into the
// future beside themselves, and there is one of these per connection handshaking.
#[allow(clippy::manual_async_fn)]
fn handshake(
    acceptor: TlsAcceptor,
    tcp: TcpStream,
    remote_addr: std::net::SocketAddr,
    (slot, pending): (ConnectionSlot, Pending),
    tx: mpsc::Sender<TlsConn>,
    (warnings, admission): (Arc<Warnings>, Arc<Admission>),
) -> impl Future<Output = ()> {
    async move {
        let deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT;
        let work = async {
            match tokio::time::timeout(FIRST_BYTE_TIMEOUT, tcp.readable()).await {
                Err(_) => return Err(Unfinished::Silent),
                Ok(Err(e)) => return Err(Unfinished::Failed(e)),
                Ok(Ok(())) => pending.set_stage(Stage::Handshaking),
            }
            match tokio::time::timeout_at(deadline, acceptor.accept(ReadAhead::new(tcp))).await {
                Ok(Ok(stream)) => Ok(stream),
                Ok(Err(e)) => Err(Unfinished::Failed(e)),
                Err(_) => Err(Unfinished::TimedOut),
            }
        };
        let done = tokio::select! {
            done = work => done,
            _ = pending.evicted() => {
                tracing::debug!("unproven connection evicted to make room; closed");
                return;
            }
        };
        match done {
            Ok(mut stream) => {
                pending.set_stage(Stage::Connected);
                tune_tls(stream.get_mut().1);
                let peer_certs = stream
                    .get_ref()
                    .1
                    .peer_certificates()
                    .map(|c| Arc::new(c.iter().map(|c| c.clone().into_owned()).collect()));
                let info = TlsConnectInfo {
                    remote_addr,
                    peer_certs,
                };
                let _ = tx
                    .send(TlsConn {
                        stream,
                        info,
                        _slot: slot,
                        pending: Some(pending),
                    })
                    .await;
            }
            Err(e) => {
                admission.count(crate::admission::Refusal::Handshake);
                log_unfinished(&warnings, remote_addr, e);
            }
        }
    }
}

/// Logs (rate limited) why a handshake did not finish.
fn log_unfinished(warnings: &Warnings, peer: std::net::SocketAddr, e: Unfinished) {
    let why = match &e {
        Unfinished::Failed(e) if crate::tls::no_shared_alpn(e) => format!(
            "{}: the client offered only ALPN protocols this listener does not serve (an agent with --transports=websocket offers http/1.1, which the agent port serves unless --agent-websocket=false; a gRPC client must offer h2)",
            chain(e)
        ),
        Unfinished::Failed(e) => chain(e).to_string(),
        Unfinished::Silent => format!("nothing sent within {FIRST_BYTE_TIMEOUT:?}"),
        Unfinished::TimedOut => format!("not finished within {HANDSHAKE_TIMEOUT:?}"),
    };
    match warnings.allow() {
        Some(suppressed) => {
            tracing::warn!(%peer, error = %why, suppressed, "TLS handshake failed; connection dropped")
        }
        None => tracing::debug!(%peer, error = %why, "TLS handshake failed; connection dropped"),
    }
}

/// A Unix socket file this process bound, known by its inode: a successor that bound
/// the path after it (`--delete-existing-uds-file`) owns the path from then on, and this
/// process must leave it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SocketFile {
    /// Where it was bound.
    pub path: PathBuf,
    dev: u64,
    ino: u64,
}

impl SocketFile {
    fn at(path: &Path) -> io::Result<SocketFile> {
        use std::os::unix::fs::MetadataExt;
        let meta = std::fs::symlink_metadata(path)?;
        Ok(SocketFile {
            path: path.to_path_buf(),
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }

    /// Whether the path still holds the socket this process bound. (The socket, open,
    /// keeps its inode, so no other file can have its number meanwhile.)
    pub fn is_ours(&self) -> bool {
        SocketFile::at(&self.path).is_ok_and(|now| now == *self)
    }

    /// Removes the file if it is still the socket this process bound. (A successor
    /// may bind between the check and the removal; it then loses its path, as it did
    /// with an unconditional removal: a window of one system call.)
    pub fn remove_if_ours(&self) -> Removal {
        if !self.is_ours() {
            return match std::fs::symlink_metadata(&self.path) {
                Ok(_) => Removal::NotOurs,
                Err(_) => Removal::Gone,
            };
        }
        match std::fs::remove_file(&self.path) {
            Ok(()) => Removal::Removed,
            Err(e) => Removal::Failed(e),
        }
    }
}

/// What [`SocketFile::remove_if_ours`] did.
#[derive(Debug)]
pub enum Removal {
    /// The socket file is gone.
    Removed,
    /// Nothing was there any more.
    Gone,
    /// Another file is at the path now (a successor's socket): left.
    NotOurs,
    /// It could not be removed.
    Failed(io::Error),
}

/// Binds a Unix socket at `path`. An existing socket file is replaced when
/// `delete_existing` (upstream's `--delete-existing-uds-file`); a non-socket file there
/// is never removed. See [`bind_uds_with`].
pub fn bind_uds(path: &Path, delete_existing: bool) -> io::Result<(UnixListener, SocketFile)> {
    bind_uds_with(path, delete_existing, &SocketAccess::default())
}

/// Whether a socket file is at `path` (to be replaced); an error for any other file.
fn existing_socket(path: &Path) -> io::Result<bool> {
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => Ok(true),
        Ok(_) => Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            format!(
                "{} exists and is not a socket; refusing to remove it",
                path.display()
            ),
        )),
        Err(_) => Ok(false),
    }
}

/// Where a replacing socket is bound before it is renamed over the path: beside it (a
/// rename stays in one directory), named for this process.
fn staging_path(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".{}.new", std::process::id()));
    path.with_file_name(name)
}

/// The queue of connections the kernel accepts for a listener before we do: as long as
/// the kernel allows (`net.core.somaxconn`, 4096 by default since Linux 5.4; it silently
/// lowers a larger figure), as Go's listeners ask, the upstream server's among them.
/// tokio's `bind` asks for 1024: when thousands of agents come back at once after a
/// server restart, the connections above that were dropped, and each dropped agent's SYN
/// was only retried after 1, 3, 7, 15 s.
pub const LISTEN_BACKLOG: i32 = 65_535;

/// Binds a TCP listener at `addr` with [`LISTEN_BACKLOG`] (and `SO_REUSEADDR`, as
/// tokio's `bind` sets, so a restarted server can bind again at once).
pub fn bind_tcp(addr: std::net::SocketAddr) -> io::Result<TcpListener> {
    bind_tcp_with(addr, false)
}

/// [`bind_tcp`], and with `reuse_port` also `SO_REUSEPORT`: another listener of the
/// same user may then bind the same address while this one runs (a successor taking
/// over; the kernel spreads new connections over both until one closes).
pub fn bind_tcp_with(addr: std::net::SocketAddr, reuse_port: bool) -> io::Result<TcpListener> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    socket.bind(&addr.into())?;
    TcpListener::from_std(listening(socket)?.into())
}

/// A bound socket listening with [`LISTEN_BACKLOG`], non-blocking (as tokio needs).
fn listening(socket: socket2::Socket) -> io::Result<socket2::Socket> {
    socket.listen(LISTEN_BACKLOG)?;
    socket.set_nonblocking(true)?;
    Ok(socket)
}

/// Who may connect to a Unix socket: its mode (connecting needs write permission) and
/// group. `None` leaves what bind(2) made (umask, our own group).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SocketAccess {
    /// Permission bits, e.g. 0o660.
    pub mode: Option<u32>,
    /// Group ID given the socket.
    pub group: Option<u32>,
}

/// Binds a Unix socket at `path` with the group and mode `access` says (the group
/// first, so the socket is never open wider than asked).
///
/// An existing socket is replaced only when `delete_existing`, and without a moment
/// where the path is missing: the new socket is bound beside it, given its access, and
/// renamed over it. So a client connecting meanwhile reaches the old server or the new
/// one, never nothing (a successor's take-over, see docs/operating.md); the old server
/// keeps the connections it has.
pub fn bind_uds_with(
    path: &Path,
    delete_existing: bool,
    access: &SocketAccess,
) -> io::Result<(UnixListener, SocketFile)> {
    let replace = existing_socket(path)?;
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir)?;
        }
    }
    let at = if replace && delete_existing {
        staging_path(path)
    } else {
        path.to_path_buf()
    };
    // A staging file left by a process of ours that died in between: ours to remove.
    if at != path && existing_socket(&at)? {
        std::fs::remove_file(&at)?;
    }
    let socket = socket2::Socket::new(socket2::Domain::UNIX, socket2::Type::STREAM, None)?;
    socket.bind(&socket2::SockAddr::unix(&at)?)?;
    let placed = set_access(&at, access).and_then(|()| match at != path {
        true => std::fs::rename(&at, path),
        false => Ok(()),
    });
    if let Err(e) = placed {
        let _ = std::fs::remove_file(&at);
        return Err(e);
    }
    let file = SocketFile::at(path)?;
    Ok((UnixListener::from_std(listening(socket)?.into())?, file))
}

fn set_access(path: &Path, access: &SocketAccess) -> io::Result<()> {
    if let Some(gid) = access.group {
        // Without CAP_CHOWN (a container that drops every capability) only a group the
        // process is in may be given.
        std::os::unix::fs::chown(path, None, Some(gid)).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot give the socket group {gid}: {e} (run the server with {gid} among its groups, such as the pod's supplementalGroups, or with CAP_CHOWN)"
                ),
            )
        })?;
    }
    if let Some(mode) = access.mode {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))?;
    }
    Ok(())
}

/// HTTP/2 receive window per stream on every Tether endpoint (agent link, gRPC
/// frontend, client). Measured with tether-bench: 16 MiB stream / 64 MiB connection
/// windows and adaptive (BDP) windows were no faster on loopback than these.
pub const H2_STREAM_WINDOW: u32 = 1 << 20;

/// HTTP/2 receive window per connection where a connection carries one stream (the
/// agent link: one Connect call per connection, so this bounds what an agent can make
/// the server hold).
pub const H2_CONN_WINDOW: u32 = 4 << 20;

/// HTTP/2 receive window per connection where a connection carries many tunnels, one
/// stream each (the gRPC frontend, the client): room for 16 stalled streams' full
/// windows before the connection, and every other tunnel on it, stops. With
/// [`H2_CONN_WINDOW`] four stalled tunnels stopped every dial on a shared connection.
pub const H2_MUX_CONN_WINDOW: u32 = 16 * H2_STREAM_WINDOW;

/// Largest HTTP/2 frame we accept.
pub const H2_MAX_FRAME: u32 = 128 << 10;

/// A gRPC server builder with our HTTP/2 windows and frame size (what [`endpoint`] sets
/// for clients).
pub fn h2_server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .initial_stream_window_size(Some(H2_STREAM_WINDOW))
        .initial_connection_window_size(Some(H2_CONN_WINDOW))
        .max_frame_size(Some(H2_MAX_FRAME))
}

/// `host:port` as a URI authority (an IPv6 literal in brackets).
pub fn authority(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Opens TCP to `authority` (no Nagle delay) and runs the TLS handshake, verifying the
/// server as `name`.
pub async fn connect_tls(
    authority: &str,
    name: rustls_pki_types::ServerName<'static>,
    tls: Arc<rustls::ClientConfig>,
) -> io::Result<ClientTls> {
    connect_tls_with(authority, name, tls, None).await
}

/// [`connect_tls`], closed by the kernel once the server has been silent for
/// `dead_link` (see [`bound_silence`]).
pub async fn connect_tls_with(
    authority: &str,
    name: rustls_pki_types::ServerName<'static>,
    tls: Arc<rustls::ClientConfig>,
    dead_link: Option<Duration>,
) -> io::Result<ClientTls> {
    let tcp = connect_tcp(authority, dead_link).await?;
    tls_over(tcp, name, tls).await
}

/// Opens TCP to `authority` with no Nagle delay, closed by the kernel once the peer has
/// been silent for `dead_link` (see [`bound_silence`]).
pub async fn connect_tcp(authority: &str, dead_link: Option<Duration>) -> io::Result<TcpStream> {
    let tcp = TcpStream::connect(authority).await?;
    tcp.set_nodelay(true)?;
    if let Some(limit) = dead_link {
        bound_silence(&tcp, limit)?;
    }
    Ok(tcp)
}

/// Runs a client's TLS handshake over `io` (a TCP connection, or a tunnel through an
/// egress proxy), read through [`ReadAhead`] and verifying the server as `name`.
pub async fn tls_over<IO>(
    io: IO,
    name: rustls_pki_types::ServerName<'static>,
    tls: Arc<rustls::ClientConfig>,
) -> io::Result<TlsOver<IO>>
where
    IO: AsyncRead + AsyncWrite + Unpin,
{
    let mut stream = TlsConnector::from(tls)
        .connect(name, ReadAhead::new(io))
        .await?;
    tune_tls(stream.get_mut().1);
    Ok(stream)
}

/// Has the kernel close `tcp` once its peer has been silent for about `limit`, however
/// long the HTTP/2 keepalive interval is: an idle connection is probed after `limit/2`
/// and given up after three unanswered probes `limit/6` apart; data left unacknowledged
/// for `limit` ends it too (`TCP_USER_TIMEOUT`). Neither is visible to the peer's HTTP/2
/// layer, so no ping policy (gRPC-Go's `too_many_pings`) can object.
pub fn bound_silence(tcp: &TcpStream, limit: Duration) -> io::Result<()> {
    let sock = socket2::SockRef::from(tcp);
    let probe = (limit / 6).max(Duration::from_secs(1));
    let keepalive = socket2::TcpKeepalive::new()
        .with_time((limit / 2).max(Duration::from_secs(1)))
        .with_interval(probe)
        .with_retries(3);
    sock.set_tcp_keepalive(&keepalive)?;
    sock.set_tcp_user_timeout(Some(limit))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The backlog the kernel gives a listening socket, as `ss` reports it (Send-Q).
    fn backlog(ss_args: &[&str]) -> u64 {
        let out = std::process::Command::new("ss")
            .args(ss_args)
            .output()
            .expect("ss (iproute2; scripts/install-deps.sh installs it)");
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .next()
            .unwrap_or_else(|| panic!("no socket in {text:?}"));
        // ... LISTEN Recv-Q Send-Q ... (a Netid column first for Unix sockets)
        let mut fields = line.split_whitespace().skip_while(|f| *f != "LISTEN");
        fields.nth(2).unwrap().parse().unwrap()
    }

    #[tokio::test]
    async fn listeners_ask_for_the_whole_backlog_the_kernel_allows() {
        let somaxconn: u64 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let expected = somaxconn.min(LISTEN_BACKLOG as u64);
        let tcp = bind_tcp("127.0.0.1:0".parse().unwrap()).unwrap();
        let port = tcp.local_addr().unwrap().port();
        assert_eq!(backlog(&["-Hltn", &format!("sport = :{port}")]), expected);

        let dir = std::env::temp_dir().join(format!("tether-backlog-{}", std::process::id()));
        let path = dir.join("s.sock");
        let (uds, _) = bind_uds(&path, true).unwrap();
        assert_eq!(backlog(&["-Hlx", "src", path.to_str().unwrap()]), expected);
        // Both still work as listeners.
        let (_c, _) = tokio::join!(TcpStream::connect(("127.0.0.1", port)), tcp.accept());
        let (_c, _) = tokio::join!(tokio::net::UnixStream::connect(&path), uds.accept());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn a_successor_that_took_the_socket_path_keeps_it() {
        let dir = std::env::temp_dir().join(format!("tether-successor-{}", std::process::id()));
        let path = dir.join("s.sock");
        let (_old, old_file) = bind_uds(&path, true).unwrap();
        assert!(old_file.is_ours());
        // The successor binds the same path, as --delete-existing-uds-file does.
        let (new, new_file) = bind_uds(&path, true).unwrap();
        assert!(!old_file.is_ours());
        // The old server, stopping, leaves the path to the new one.
        assert!(matches!(old_file.remove_if_ours(), Removal::NotOurs));
        let (_c, accepted) = tokio::join!(tokio::net::UnixStream::connect(&path), new.accept());
        accepted.unwrap();
        // Which removes it when it stops.
        assert!(matches!(new_file.remove_if_ours(), Removal::Removed));
        assert!(!path.exists());
        assert!(matches!(new_file.remove_if_ours(), Removal::Gone));
        let _ = std::fs::remove_dir_all(dir);
    }

    /// A successor's socket replaces the old one by a rename: a client looking at the
    /// path meanwhile always finds a socket there, and the old server's clients keep
    /// their connections.
    #[tokio::test]
    async fn replacing_a_socket_never_leaves_its_path_empty() {
        let dir = std::env::temp_dir().join(format!("tether-replace-{}", std::process::id()));
        let path = dir.join("s.sock");
        let (old, _) = bind_uds(&path, true).unwrap();
        let (kept, accepted) = tokio::join!(tokio::net::UnixStream::connect(&path), old.accept());
        let (kept, (mut old_end, _)) = (kept.unwrap(), accepted.unwrap());
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let watcher = {
            let (path, stop) = (path.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut looks = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    std::fs::symlink_metadata(&path).expect("the path is never missing");
                    looks += 1;
                }
                looks
            })
        };
        let mut successors = Vec::new();
        for _ in 0..200 {
            successors.push(bind_uds(&path, true).unwrap());
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(watcher.join().unwrap() > 0);
        let (last, last_file) = successors.pop().unwrap();
        assert!(last_file.is_ours());
        let (_c, accepted) = tokio::join!(tokio::net::UnixStream::connect(&path), last.accept());
        accepted.unwrap();
        // No staging file is left beside it.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut kept = kept;
        kept.write_all(b"x").await.unwrap();
        let mut b = [0u8; 1];
        old_end.read_exact(&mut b).await.unwrap();
        let _ = std::fs::remove_dir_all(dir);
    }
}
