//! Serving HTTP/1.1 on a listener, bounded against clients that stall.
//!
//! Both listeners face clients the operator does not control: the control
//! API may be reachable from a network, and the agent gateway from every
//! job that runs in a container or VM. A connection that sends nothing, half
//! a request head or half a body would otherwise hold a socket and a task
//! forever, and a few hundred of them exhaust the daemon's descriptors. So
//! every connection served here has:
//!
//! - a **head deadline** ([`ConnectionLimits::header_timeout`]): the whole
//!   request head must arrive within it. It also runs while a keep-alive
//!   connection waits for its next request, so it is the idle deadline too;
//!   a response being streamed (SSE, job logs) or an upgraded WebSocket is
//!   not subject to it;
//! - a **body deadline** ([`ConnectionLimits::body_timeout`]), handed to the
//!   handlers as the [`BodyDeadline`] request extension: the JSON extractor
//!   answers 408 when the body has not arrived in full by then;
//! - a **cap** on concurrent connections per listener
//!   ([`ConnectionLimits::max_connections`]). At the cap the listener stops
//!   accepting: new connections wait in the kernel's backlog (holding no
//!   descriptor of ours) until a connection ends, instead of being reset.
//!   Reaching the cap is logged once per episode and counted
//!   (`kici_orch_scaler_connection_limit_reached_total{listener}`).
//!
//! Each listener has its own cap, so clients of one (jobs reaching the
//! gateway) can never starve the other (the control API). A TLS handshake
//! counts as part of the head and has the same deadline.

use axum::extract::Request;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use std::io;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{watch, Semaphore};
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::Instant;
use tower::ServiceExt;

/// The bounds of one listener's connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Most connections served at once.
    pub max_connections: usize,
    /// For the request head (and a TLS handshake); also the keep-alive idle
    /// deadline.
    pub header_timeout: Duration,
    /// For the whole request body.
    pub body_timeout: Duration,
}

impl ConnectionLimits {
    pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
    pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
    pub const DEFAULT_API_CONNECTIONS: usize = 1024;
    pub const DEFAULT_GATEWAY_CONNECTIONS: usize = 4096;

    /// The control API's defaults.
    pub fn api() -> Self {
        Self {
            max_connections: Self::DEFAULT_API_CONNECTIONS,
            header_timeout: Self::DEFAULT_HEADER_TIMEOUT,
            body_timeout: Self::DEFAULT_BODY_TIMEOUT,
        }
    }

    /// The agent gateway's defaults (a connection per agent).
    pub fn gateway() -> Self {
        Self {
            max_connections: Self::DEFAULT_GATEWAY_CONNECTIONS,
            ..Self::api()
        }
    }

    /// This cap, lowered to `share` of the process's descriptor limit, so
    /// that the caps of every listener together leave descriptors for the
    /// store, the backends and the agents' files.
    pub fn within_descriptors(self, descriptors: u64, share: u64) -> Self {
        let fair = usize::try_from(descriptors / share.max(1)).unwrap_or(usize::MAX);
        Self {
            max_connections: self.max_connections.min(fair.max(MIN_CONNECTIONS)),
            ..self
        }
    }
}

/// Raises this process's soft limit on open files to its hard limit (a
/// daemon's connections, agents' log files and store handles all count
/// against it, and the soft default of 1024 is low for a busy gateway);
/// returns the limit now in force (`u64::MAX` when unlimited).
pub fn raise_open_file_limit() -> u64 {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    let current = limit.current.unwrap_or(u64::MAX);
    if limit.current == limit.maximum {
        return current;
    }
    match setrlimit(
        Resource::Nofile,
        Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        },
    ) {
        Ok(()) => limit.maximum.unwrap_or(u64::MAX),
        Err(e) => {
            tracing::warn!(error = %e, soft = current, "cannot raise the open-file limit");
            current
        }
    }
}

/// The gateway's bounds: a stack without a control API serves only the
/// gateway.
impl Default for ConnectionLimits {
    fn default() -> Self {
        Self::gateway()
    }
}

/// How long open connections may finish after the listener failed.
const FAILED_LISTENER_DRAIN: Duration = Duration::from_secs(5);

/// However few descriptors there are, a listener serves this many.
const MIN_CONNECTIONS: usize = 16;

/// Which listener: the `listener` label of its metrics and log lines.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ListenerName {
    /// The control API (`--listen`).
    Api,
    /// The agent gateway (`--gateway-listen` and each backend network's).
    Gateway,
    /// `POST /v1/claims` for externally provisioned agents (`--claims-listen`).
    Claims,
}

impl ListenerName {
    pub const ALL: [ListenerName; 3] = [Self::Api, Self::Gateway, Self::Claims];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Api => "api",
            Self::Gateway => "gateway",
            Self::Claims => "claims",
        }
    }
}

/// The body deadline of the connection a request came on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyDeadline(pub Duration);

/// A bound listener.
pub enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

impl Listener {
    pub fn tcp(listener: std::net::TcpListener) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        tokio::net::TcpListener::from_std(listener).map(Self::Tcp)
    }

    pub fn unix(listener: std::os::unix::net::UnixListener) -> io::Result<Self> {
        listener.set_nonblocking(true)?;
        tokio::net::UnixListener::from_std(listener).map(Self::Unix)
    }
}

/// Where a listener reports its connections.
#[derive(Clone, Default)]
pub struct ListenerMetrics {
    /// Connections being served.
    pub open: Gauge,
    /// Times the cap was reached.
    pub limit_reached: Counter,
}

/// One connection in the `open` gauge, for as long as this lives.
struct OpenConnection(Gauge);

impl OpenConnection {
    fn count(open: &Gauge) -> Self {
        open.inc();
        Self(open.clone())
    }
}

impl Drop for OpenConnection {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// How a [`Server`] is asked to stop.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Stop {
    Running,
    /// Stop accepting; let open connections finish (within the limit, if
    /// any, after which they are closed).
    Graceful(Option<Duration>),
    /// Close every connection now.
    Now,
}

/// A listener being served, and its controls.
pub struct Server {
    stop: watch::Sender<Stop>,
    /// Ends when the listener stops (asked to, or failed).
    pub task: JoinHandle<io::Result<()>>,
}

impl Server {
    /// Serves `router` on `listener` (through TLS when `tls` is given),
    /// within `limits`.
    pub fn start(
        name: ListenerName,
        listener: Listener,
        tls: Option<Arc<rustls::ServerConfig>>,
        router: Router,
        limits: ConnectionLimits,
        metrics: ListenerMetrics,
    ) -> Self {
        let (stop, stopped) = watch::channel(Stop::Running);
        let task = tokio::spawn(accept_loop(
            name,
            listener,
            tls.map(tokio_rustls::TlsAcceptor::from),
            router,
            limits,
            metrics,
            stopped,
        ));
        Self { stop, task }
    }

    /// Stops accepting; open connections finish their requests (and
    /// streams) — within `limit` when given, after which they are closed.
    pub fn graceful_shutdown(&self, limit: Option<Duration>) {
        self.stop.send_replace(Stop::Graceful(limit));
    }

    /// Closes every connection now.
    pub fn shutdown(&self) {
        self.stop.send_replace(Stop::Now);
    }
}

async fn accept_loop(
    name: ListenerName,
    listener: Listener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    router: Router,
    limits: ConnectionLimits,
    metrics: ListenerMetrics,
    mut stopped: watch::Receiver<Stop>,
) -> io::Result<()> {
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    // Flipped once the listener stops: each connection then finishes the
    // request it serves and closes.
    let (draining, drain_signal) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut at_cap = false;
    let outcome = loop {
        // Finished connections are reaped as we go, so the set holds only
        // open ones.
        while connections.try_join_next().is_some() {}
        if *stopped.borrow() != Stop::Running {
            break Ok(());
        }
        let permit = match Arc::clone(&permits).try_acquire_owned() {
            Ok(permit) => {
                at_cap = false;
                permit
            }
            Err(_) => {
                if !at_cap {
                    at_cap = true;
                    metrics.limit_reached.inc();
                    tracing::warn!(
                        listener = name.as_str(),
                        max_connections = limits.max_connections,
                        "connection limit reached: new connections wait until one ends"
                    );
                }
                tokio::select! {
                    p = Arc::clone(&permits).acquire_owned() => match p {
                        Ok(p) => p,
                        // Never closed: the semaphore lives in this loop.
                        Err(_) => break Ok(()),
                    },
                    _ = stopped.changed() => continue,
                }
            }
        };
        let accepted = tokio::select! {
            a = accept(&listener) => a,
            _ = stopped.changed() => continue,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(e) if transient(&e) => {
                // Out of descriptors or a connection reset before accept:
                // back off instead of spinning.
                tracing::warn!(listener = name.as_str(), error = %e, "accept failed; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
            Err(e) => break Err(e),
        };
        let open = OpenConnection::count(&metrics.open);
        let router = router.clone();
        let tls = tls.clone();
        let watcher = drain_signal.clone();
        connections.spawn(async move {
            // Both released however the task ends, aborted at shutdown too.
            let _permit = permit;
            let _open = open;
            match stream {
                Stream::Tcp(tcp) => match tls {
                    Some(acceptor) => {
                        match tokio::time::timeout(limits.header_timeout, acceptor.accept(tcp))
                            .await
                        {
                            Ok(Ok(tls)) => {
                                serve_connection(tls, router, limits, watcher, peer).await
                            }
                            Ok(Err(e)) => tracing::debug!(error = %e, "TLS handshake failed"),
                            Err(_) => tracing::debug!("TLS handshake timed out"),
                        }
                    }
                    None => serve_connection(tcp, router, limits, watcher, peer).await,
                },
                Stream::Unix(unix) => serve_connection(unix, router, limits, watcher, peer).await,
            }
        });
    };
    drop(listener);
    draining.send_replace(true);
    drain(&mut connections, &mut stopped).await;
    // Whatever is still open (past the limit, or mid-handshake) is closed.
    connections.abort_all();
    while connections.join_next().await.is_some() {}
    outcome
}

/// Waits for open connections to finish their requests, until the stop
/// asked for allows no more time.
async fn drain(connections: &mut JoinSet<()>, stopped: &mut watch::Receiver<Stop>) {
    let limit_of = |stop: Stop| match stop {
        Stop::Graceful(limit) => limit,
        Stop::Now => Some(Duration::ZERO),
        // The listener failed on its own: its owner must hear of it soon,
        // not after the last open stream (an SSE reader may never leave).
        Stop::Running => Some(FAILED_LISTENER_DRAIN),
    };
    let mut deadline = limit_of(*stopped.borrow_and_update()).map(|l| Instant::now() + l);
    loop {
        let until_deadline = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            next = connections.join_next() => if next.is_none() {
                return;
            },
            () = until_deadline => return,
            changed = stopped.changed() => {
                if changed.is_err() {
                    // The controls are gone: nobody waits for a drain.
                    return;
                }
                // Asked again: the earlier of the two deadlines holds.
                if let Some(limit) = limit_of(*stopped.borrow_and_update()) {
                    let at = Instant::now() + limit;
                    deadline = Some(deadline.map_or(at, |d| d.min(at)));
                }
            }
        }
    }
}

enum Stream {
    Tcp(tokio::net::TcpStream),
    Unix(tokio::net::UnixStream),
}

/// The connection and, over TCP, its peer's address (handlers read it as
/// `ConnectInfo<SocketAddr>`: the claim rate limit keys on it).
async fn accept(listener: &Listener) -> io::Result<(Stream, Option<std::net::SocketAddr>)> {
    match listener {
        Listener::Tcp(l) => l.accept().await.map(|(s, a)| (Stream::Tcp(s), Some(a))),
        Listener::Unix(l) => l.accept().await.map(|(s, _)| (Stream::Unix(s), None)),
    }
}

/// Errors after which the listener still works.
fn transient(e: &io::Error) -> bool {
    use rustix::io::Errno;
    let out_of_resources = Errno::from_io_error(e)
        .is_some_and(|n| [Errno::MFILE, Errno::NFILE, Errno::NOBUFS, Errno::NOMEM].contains(&n));
    out_of_resources
        || matches!(
            e.kind(),
            io::ErrorKind::ConnectionAborted
                | io::ErrorKind::ConnectionReset
                | io::ErrorKind::Interrupted
        )
}

async fn serve_connection<IO>(
    io: IO,
    router: Router,
    limits: ConnectionLimits,
    mut draining: watch::Receiver<bool>,
    peer: Option<std::net::SocketAddr>,
) where
    IO: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let deadline = BodyDeadline(limits.body_timeout);
    let service = hyper::service::service_fn(move |mut request: Request<hyper::body::Incoming>| {
        request.extensions_mut().insert(deadline);
        if let Some(peer) = peer {
            request
                .extensions_mut()
                .insert(axum::extract::ConnectInfo(peer));
        }
        router.clone().oneshot(request.map(axum::body::Body::new))
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .keep_alive(true);
    let connection = http
        .serve_connection(TokioIo::new(ErrorShapedIo::new(io)), service)
        .with_upgrades();
    tokio::pin!(connection);
    let result = tokio::select! {
        result = connection.as_mut() => result,
        () = async {
            // The guard `wait_for` returns is not `Send`: drop it at once.
            let _ = draining.wait_for(|d| *d).await.map(|_| ());
        } => {
            // The request in flight (or stream) finishes; no further one
            // is read.
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    // Errors here are the client's (a reset, a head deadline): nothing to
    // act on, and at debug level only, or a stalling client floods the log.
    if let Err(e) = result {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

/// hyper answers a request it cannot parse (a malformed request line or
/// header, a duplicate or negative `Content-Length`, HTTP/0.9: 400; a URI
/// too long: 414; a head too large: 431) itself, before any handler runs,
/// with an empty body. Clients of this API read every error as
/// `{"error":{"code","message"}}`, so this wrapper gives those automatic
/// answers that body on their way out.
///
/// It recognises them exactly: a write that is one whole response head
/// with one of those statuses and `content-length: 0`, and nothing after
/// it — the daemon's own error answers always carry a body. Writes are not
/// vectored, so hyper hands a head over in one buffer.
struct ErrorShapedIo<IO> {
    io: IO,
    /// A rewritten answer not yet fully written, and how much of it was.
    pending: Option<(Vec<u8>, usize)>,
}

impl<IO> ErrorShapedIo<IO> {
    fn new(io: IO) -> Self {
        Self { io, pending: None }
    }
}

/// The error-shaped answer for one of hyper's automatic ones, if `head` is
/// one.
fn error_shaped(head: &[u8]) -> Option<Vec<u8>> {
    const EMPTY: &[u8] = b"content-length: 0\r\n";
    let (code, message) = [
        (
            &b"HTTP/1.1 400 "[..],
            "bad-request",
            "the request is not valid HTTP/1.1: a malformed request line or header, a duplicate \
             or invalid Content-Length, or an HTTP version other than 1.0 and 1.1",
        ),
        (
            &b"HTTP/1.1 414 "[..],
            "uri-too-long",
            "the request URI is longer than this server accepts (64 KiB)",
        ),
        (
            &b"HTTP/1.1 431 "[..],
            "headers-too-large",
            "the request head is larger than this server accepts",
        ),
    ]
    .into_iter()
    .find(|(status, _, _)| head.starts_with(status))
    .map(|(_, code, message)| (code, message))?;
    let end = head.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    if end != head.len() {
        return None;
    }
    let at = head
        .windows(EMPTY.len())
        .position(|w| w.eq_ignore_ascii_case(EMPTY))?;
    let body = format!(r#"{{"error":{{"code":"{code}","message":"{message}"}}}}"#);
    let mut out = Vec::with_capacity(head.len() + body.len() + 64);
    out.extend_from_slice(&head[..at]);
    out.extend_from_slice(
        format!(
            "content-type: application/json\r\ncontent-length: {}\r\n",
            body.len()
        )
        .as_bytes(),
    );
    out.extend_from_slice(&head[at + EMPTY.len()..]);
    out.extend_from_slice(body.as_bytes());
    Some(out)
}

impl<IO: AsyncWrite + Unpin> ErrorShapedIo<IO> {
    /// Writes what is pending; `Ready(Ok)` once nothing is.
    fn poll_pending(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<io::Result<()>> {
        use std::task::Poll;
        while let Some((bytes, written)) = &mut self.pending {
            match std::pin::Pin::new(&mut self.io).poll_write(cx, &bytes[*written..]) {
                Poll::Ready(Ok(0)) => {
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                Poll::Ready(Ok(n)) => {
                    *written += n;
                    if *written == bytes.len() {
                        self.pending = None;
                    }
                }
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for ErrorShapedIo<IO> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for ErrorShapedIo<IO> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        let this = self.get_mut();
        std::task::ready!(this.poll_pending(cx))?;
        if let Some(shaped) = error_shaped(buf) {
            // Taken whole; written out by this and the next polls.
            this.pending = Some((shaped, 0));
            return match this.poll_pending(cx) {
                std::task::Poll::Ready(Err(e)) => std::task::Poll::Ready(Err(e)),
                _ => std::task::Poll::Ready(Ok(buf.len())),
            };
        }
        std::pin::Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.poll_pending(cx))?;
        std::pin::Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        let this = self.get_mut();
        std::task::ready!(this.poll_pending(cx))?;
        std::pin::Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn hypers_automatic_answers_get_the_error_shape() {
        let head =
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-length: 0\r\ndate: x\r\n\r\n";
        let shaped = String::from_utf8(error_shaped(head).unwrap()).unwrap();
        let (head, body) = shaped.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 431 "), "{head}");
        assert!(head.contains("content-type: application/json"), "{head}");
        assert!(
            head.contains(&format!("content-length: {}", body.len())),
            "{head}"
        );
        assert!(head.contains("date: x"), "{head}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["code"], "headers-too-large");
    }

    #[test]
    fn other_writes_pass_unchanged() {
        // A handler's own 400 has a body.
        assert!(error_shaped(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 12\r\n\r\n").is_none());
        // A head followed by its body in the same buffer is not hyper's.
        assert!(error_shaped(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\nx").is_none());
        assert!(error_shaped(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_none());
    }

    #[test]
    fn descriptor_caps_keep_a_floor() {
        let l = ConnectionLimits::api().within_descriptors(256, 4);
        assert_eq!(l.max_connections, 64);
        let l = ConnectionLimits::api().within_descriptors(20, 4);
        assert_eq!(l.max_connections, MIN_CONNECTIONS);
        let l = ConnectionLimits::api().within_descriptors(u64::MAX, 4);
        assert_eq!(l.max_connections, ConnectionLimits::DEFAULT_API_CONNECTIONS);
    }
}
