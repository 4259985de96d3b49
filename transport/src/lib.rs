//! The ZeroMQ transport: ZMTP 3.0 (NULL security) spoken by `stowd`
//! itself, over tcp and ipc, with a ROUTER for serving and a DEALER
//! ([`Peer`]) for talking to remote units. Any ZeroMQ 4.x peer (libzmq,
//! pyzmq, the `zeromq` crate) talks to it.
//!
//! Why our own: a storage sidecar must bound what a peer can make it do.
//! [`zmtp`] checks every declared size against [`Limits`] before it
//! allocates, answers an oversized request with an error instead of dying,
//! and writes large frames without copying them. Serving is one task per
//! connection:
//! - requests on a connection are handled one after the other and answered
//!   in order (a ROUTER identity is one connection);
//! - the next request is read while one is handled, and no further: a
//!   client that sends its next request before the reply (a split put's
//!   next message) has it received meanwhile, and one that sends without
//!   reading is held back by TCP after that one request, not buffered in
//!   `stowd` (through `[limits] max_request_bytes`, a connection holds at
//!   most two requests: 2 GiB puts through a router stowd went from 0.73 to
//!   1.06 of a two-hop tcp relay with it, docs/benchmarks.md);
//! - a reply that cannot be written within [`Limits::write_timeout`] drops
//!   that connection; no other connection waits for it;
//! - at most [`Limits::max_connections`] connections are open at once, at
//!   most [`Limits::max_connections_per_peer`] from one address; when the
//!   table (or the address's share) is full the longest idle connection
//!   (of that address) is evicted before a new client is refused, and a connection idle for [`Limits::idle_timeout`]
//!   is closed ([`table`]).
//!
//! `stowd` is always the side that binds ([`bind`] removes a stale ipc
//! socket file first). A [`Peer`] keeps one request in flight; a connection
//! that failed or timed out is dropped and a fresh one made on the next
//! request.
//!
//! Large frames a server receives go into buffers of one [`ReceivePool`]
//! shared by all its connections (and all listeners with the same cap):
//! the memory of a frame whose rows were cleared takes the next large
//! frame, instead of going back to the OS and being faulted in afresh.
//!
//! | module | what it holds |
//! |---|---|
//! | [`frame`] | ZMTP 3.0 framing without I/O: frame headers parsed from byte slices and written into buffers, the greeting, commands and READY (also the Python client's core's framer) |
//! | [`zmtp`] | the same over a tokio byte stream: the frame reader, the message writers, the handshake |
//! | [`pool`] | the bounded pool of resident pages large received frames go into |
//! | [`table`] | the connection table of one listening socket: caps, eviction, idle timeout |
//!
//! The crate root (this file) holds the ROUTER server and the DEALER
//! [`Peer`]. [`zmtp`] uses [`frame`] and [`pool`]; [`frame`] uses nothing
//! of the crate and nothing of tokio.

pub mod frame;
pub mod pool;
pub mod table;
pub mod zmtp;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncWrite, ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::{Semaphore, watch};

pub use pool::{Pages, ReceivePool};
use zmtp::{FrameReader, Incoming, ZmtpError};

/// Transport failures.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    #[error("cannot bind {endpoint}: {reason}")]
    Bind { endpoint: String, reason: String },
    #[error("cannot connect to {endpoint}: {reason}")]
    Connect {
        endpoint: String,
        #[source]
        reason: ConnectError,
    },
    #[error("send to {endpoint} failed: {reason}")]
    Send { endpoint: String, reason: String },
    #[error("no reply from {endpoint} within {timeout:?}")]
    Timeout { endpoint: String, timeout: Duration },
    #[error("receive from {endpoint} failed: {reason}")]
    Recv { endpoint: String, reason: String },
}

/// Why a connection to a peer could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("only tcp:// and ipc:// endpoints are supported")]
    Scheme,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Handshake(#[from] ZmtpError),
}

/// What one connection may cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Receive limits: bytes and frames per message.
    pub receive: zmtp::Limits,
    /// A reply not written within this drops the connection.
    pub write_timeout: Duration,
    /// Greeting and READY must complete within this.
    pub handshake_timeout: Duration,
    /// Most connections open at once on one listening socket. When full,
    /// the longest idle connection is evicted for a new client; only when
    /// all are busy is the new client closed at once ([`table`]).
    pub max_connections: usize,
    /// Most connections from one peer address on one listening socket.
    /// When an address has this many, its longest idle connection is
    /// evicted for its new client; only when all of them are busy is the
    /// new client closed at once. 0: no cap. Unix-socket clients have no
    /// address and no cap.
    pub max_connections_per_peer: usize,
    /// A connection that sends nothing for this long (handshaking, between
    /// requests, or stalled inside one) is closed; zero: never.
    pub idle_timeout: Duration,
    /// Most bytes of idle large receive buffers kept for reuse
    /// ([`ReceivePool`]); 0 turns the pool off.
    pub receive_pool_bytes: usize,
    /// A pooled buffer unused this long is freed.
    pub receive_pool_idle: Duration,
}

impl Limits {
    /// 8 GiB and 2^20 frames per message, 60 s to write a reply, 10 s for
    /// the handshake, 1,024 connections of which 256 from one address,
    /// 300 s idle timeout, 2 GiB of pooled receive buffers.
    ///
    /// The per-peer cap is a quarter of the table: one address (a
    /// misbehaving client, or every local client at once, since they all
    /// come from 127.0.0.1) cannot take the whole table, while 256 is far
    /// more than a node's clients open (a pyzmq socket keeps one
    /// connection per endpoint, a router [`Peer`] at most
    /// [`PEER_CONNECTIONS`]). An address at its cap gives its longest idle
    /// connection up to its new one, so a process holding idle
    /// connections cannot lock the other clients of its node out.
    ///
    /// The pool's cap is the most memory `stowd` keeps beyond what it
    /// stores, for at most [`pool::IDLE`] after its last use: the pool only
    /// holds buffers of frames whose rows were cleared, memory that was in
    /// use moments before. 2 GiB takes a training step's batch of up to
    /// about 2 GiB whole through the put/get/clear cycle. 1 GiB was not
    /// enough for a 1 GiB batch: its frames (256 MiB messages) plus the
    /// last small one come to a little more than 1 GiB, so one 256 MiB
    /// buffer was pushed out every cycle (0.34 of the payload still
    /// faulted in per put, against 0.06 with room to spare).
    pub const DEFAULT: Limits = Limits {
        receive: zmtp::Limits::DEFAULT,
        write_timeout: Duration::from_secs(60),
        handshake_timeout: Duration::from_secs(10),
        max_connections: 1024,
        max_connections_per_peer: 256,
        idle_timeout: Duration::from_secs(300),
        receive_pool_bytes: 2 << 30,
        receive_pool_idle: pool::IDLE,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::DEFAULT
    }
}

/// A message to send: frame `k` is the next `per_frame[k]` parts back to
/// back, written without joining them ([`zmtp::write_gathered`]); one part
/// per frame where `per_frame` is `None`. A reply with a [`Tail`] is
/// these frames, then the tail's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Message {
    pub parts: Vec<Bytes>,
    pub per_frame: Option<Vec<u32>>,
    pub tail: Option<Tail>,
}

impl From<Vec<Bytes>> for Message {
    fn from(parts: Vec<Bytes>) -> Message {
        Message {
            parts,
            per_frame: None,
            tail: None,
        }
    }
}

impl Message {
    /// Number of frames (of a reply with a tail: before the tail).
    pub fn frames(&self) -> usize {
        self.per_frame.as_ref().map_or(self.parts.len(), Vec::len)
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Writes the message to `w` (with a tail: the frames before it, the
    /// last of them saying that more follow).
    pub async fn write<W: tokio::io::AsyncWrite + Unpin + ?Sized>(
        &self,
        w: &mut W,
    ) -> std::io::Result<()> {
        match (&self.per_frame, &self.tail) {
            (None, None) => zmtp::write_message(w, &self.parts).await,
            (Some(per_frame), None) => zmtp::write_gathered(w, &self.parts, per_frame).await,
            (per_frame, Some(_)) => {
                let ones;
                let per_frame = match per_frame {
                    Some(p) => p,
                    None => {
                        ones = vec![1; self.parts.len()];
                        &ones
                    }
                };
                zmtp::write_gathered_more(w, &self.parts, per_frame, true).await
            }
        }
    }
}

/// Frames of a reply's tail, sent by whoever makes them: `last` ends the
/// message.
#[derive(Debug)]
pub struct Chunk {
    pub parts: Vec<Bytes>,
    pub per_frame: Vec<u32>,
    pub last: bool,
}

/// What makes a [`Tail`]: chunks in order, the last with `last` set; an
/// `Err` (or dropping this before the last chunk) abandons the message,
/// and the connection it was going to is closed, since a message begun
/// cannot be taken back (the client sees the connection end, never a
/// message of other bytes).
pub type TailSender = tokio::sync::mpsc::Sender<Result<Chunk, String>>;

/// The rest of a reply whose first frames go out before the others exist
/// (a router forwarding a peer unit's reply as it arrives): the
/// connection writes the message's frames, then each [`Chunk`] as it
/// comes, each within [`Limits::write_timeout`].
#[derive(Clone)]
pub struct Tail(Arc<std::sync::Mutex<Option<TailReceiver>>>);

type TailReceiver = tokio::sync::mpsc::Receiver<Result<Chunk, String>>;

impl Tail {
    /// A tail and its sender; `ahead` chunks may wait to be written.
    pub fn channel(ahead: usize) -> (TailSender, Tail) {
        let (tx, rx) = tokio::sync::mpsc::channel(ahead.max(1));
        (tx, Tail(Arc::new(std::sync::Mutex::new(Some(rx)))))
    }

    fn take(&self) -> Option<TailReceiver> {
        self.0.lock().expect("tail").take()
    }
}

impl std::fmt::Debug for Tail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tail")
    }
}

impl PartialEq for Tail {
    fn eq(&self, other: &Tail) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

/// A boxed future, for handlers.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Answers requests arriving on a ROUTER.
pub trait Service: Send + Sync + 'static {
    /// Handles one request from `caller` (`frames` excludes the identity).
    /// `None` means: send no reply (e.g. an identity that is not allowed).
    fn handle(
        self: Arc<Self>,
        caller: Caller,
        frames: Vec<Bytes>,
    ) -> BoxFuture<'static, Option<Message>>;

    /// Answers a request that broke a receive limit and was dropped
    /// unread. `head` is its first frame when that frame was within the
    /// limits; `reason` says which limit. The default sends no reply.
    fn reject(
        self: Arc<Self>,
        caller: Caller,
        head: Vec<Bytes>,
        reason: String,
    ) -> BoxFuture<'static, Option<Message>> {
        let _ = (caller, head, reason);
        Box::pin(async { None })
    }

    /// Called once when the connection numbered `connection`
    /// ([`Caller::connection`]) has ended: closed by either side, evicted
    /// or timed out. A request of it still running off the runtime may
    /// finish later. The default does nothing.
    fn closed(&self, connection: u64) {
        let _ = connection;
    }
}

/// Who sent a request.
#[derive(Clone, Debug)]
pub struct Caller {
    /// The connection it came on: a number no other connection to the same
    /// listening socket has had or will have in this process. Unlike the
    /// identity, a peer cannot choose it, so it can own things (a lease).
    pub connection: u64,
    /// The peer's ZMTP routing identity (its own, or one made up for it).
    pub identity: Bytes,
}

/// A byte stream: tcp or a unix socket.
trait Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Stream for T {}

type BoxStream = Box<dyn Stream>;

/// A bound ROUTER socket, not yet serving.
#[derive(Debug)]
pub enum Listener {
    Tcp(TcpListener),
    Ipc(UnixListener, PathBuf),
}

impl Listener {
    /// A new connection and its peer's address (none for ipc).
    async fn accept(&self) -> std::io::Result<(BoxStream, Option<std::net::IpAddr>)> {
        match self {
            Listener::Tcp(l) => {
                let (s, addr) = l.accept().await?;
                s.set_nodelay(true)?;
                Ok((Box::new(s), Some(addr.ip().to_canonical())))
            }
            Listener::Ipc(l, _) => {
                let (s, _) = l.accept().await?;
                Ok((Box::new(s), None))
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Ipc(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

fn bind_err(endpoint: &str, reason: impl ToString) -> TransportError {
    TransportError::Bind {
        endpoint: endpoint.into(),
        reason: reason.to_string(),
    }
}

/// Binds a ROUTER on `endpoint` (`tcp://host:port` or `ipc://path`) and
/// returns it with the resolved endpoint (the real port when 0 was asked).
pub async fn bind(endpoint: &str) -> Result<(Listener, String), TransportError> {
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        // A socket file left by a dead process makes bind fail: remove it.
        let p = PathBuf::from(path);
        if p.exists() {
            let _ = std::fs::remove_file(&p);
        }
        let l = UnixListener::bind(&p).map_err(|e| bind_err(endpoint, e))?;
        return Ok((Listener::Ipc(l, p), endpoint.to_string()));
    }
    let Some(addr) = endpoint.strip_prefix("tcp://") else {
        return Err(bind_err(
            endpoint,
            "only tcp:// and ipc:// endpoints are supported",
        ));
    };
    let addr = if let Some(port) = addr.strip_prefix("*:") {
        format!("0.0.0.0:{port}")
    } else {
        addr.to_string()
    };
    let l = TcpListener::bind(&addr)
        .await
        .map_err(|e| bind_err(endpoint, e))?;
    let local = l.local_addr().map_err(|e| bind_err(endpoint, e))?;
    Ok((Listener::Tcp(l), format!("tcp://{local}")))
}

/// Serves `service` on `listener` with the default [`Limits`] until
/// `shutdown` turns true.
pub async fn serve(listener: Listener, service: Arc<dyn Service>, shutdown: watch::Receiver<bool>) {
    serve_with(listener, service, Limits::DEFAULT, shutdown).await
}

/// Serves `service` on `listener` until `shutdown` turns true.
pub async fn serve_with(
    listener: Listener,
    service: Arc<dyn Service>,
    limits: Limits,
    mut shutdown: watch::Receiver<bool>,
) {
    let table = table::Table::new(&limits);
    let next_id = Arc::new(AtomicU32::new(0x6b8b_4567));
    let pool = ReceivePool::shared(limits.receive_pool_bytes, limits.receive_pool_idle);
    loop {
        let stream = tokio::select! {
            s = listener.accept() => s,
            _ = shutdown.changed() => break,
        };
        let (stream, peer) = match stream {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(error = %e, "accept failed");
                // EMFILE and friends: do not spin.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        // Refusals and evictions are logged by the table.
        let Ok(entry) = table.admit(peer) else {
            drop(stream);
            continue;
        };
        let (service, shutdown, next_id, pool) = (
            service.clone(),
            shutdown.clone(),
            next_id.clone(),
            pool.clone(),
        );
        tokio::spawn(async move {
            let activity = entry.activity.clone();
            let owner = service.clone();
            tokio::select! {
                _ = connection(stream, service, limits, shutdown, next_id, pool, &activity, entry.id()) => {}
                _ = activity.evicted() => {}
                _ = activity.idle_expired(limits.idle_timeout) => {
                    tracing::debug!(
                        peer = %peer.map_or_else(|| "local (ipc)".into(), |p| p.to_string()),
                        timeout = ?limits.idle_timeout,
                        "idle connection closed (limits.idle_timeout_secs)"
                    );
                }
            }
            owner.closed(entry.id());
            drop(entry);
        });
    }
}

/// One client connection: handshake, then request, reply, request, ...,
/// with the next request read while one is handled.
#[allow(clippy::too_many_arguments)]
async fn connection(
    stream: BoxStream,
    service: Arc<dyn Service>,
    limits: Limits,
    mut shutdown: watch::Receiver<bool>,
    next_id: Arc<AtomicU32>,
    pool: Option<Arc<ReceivePool>>,
    activity: &Arc<table::Activity>,
    connection: u64,
) {
    let (reader, mut writer) = tokio::io::split(stream);
    let reader = table::Tracked::new(reader, activity.clone());
    let mut reader = FrameReader::with_pool(reader, pool);
    let shake = zmtp::handshake(
        &mut reader,
        &mut writer,
        "ROUTER",
        b"",
        &["DEALER", "REQ", "ROUTER"],
    );
    let peer = match tokio::time::timeout(limits.handshake_timeout, shake).await {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return tracing::debug!(error = %e, "handshake failed"),
        Err(_) => {
            return tracing::debug!(timeout = ?limits.handshake_timeout, "handshake timed out");
        }
    };
    let identity = if peer.identity.is_empty() {
        // As libzmq does: a zero byte then a 32-bit counter.
        let n = next_id.fetch_add(1, Ordering::Relaxed);
        let mut id = vec![0u8];
        id.extend_from_slice(&n.to_be_bytes());
        Bytes::from(id)
    } else {
        peer.identity
    };
    let caller = Caller {
        connection,
        identity: identity.clone(),
    };
    // The next message is read while one is handled (a client may send it
    // before the reply, as the Python client's puts of several messages
    // do), never more than one: the reader takes a slot of the channel
    // before it reads, and the slot is free only once the loop below has
    // taken the message before. Requests are still handled, and answered,
    // one at a time and in order.
    let (ahead, mut incoming_rx) = tokio::sync::mpsc::channel(1);
    let read_limits = limits.receive;
    let _reading = AbortOnDrop(tokio::spawn(async move {
        loop {
            let Ok(slot) = ahead.reserve().await else {
                return;
            };
            let r = reader.read(&read_limits).await;
            let last = !matches!(r, Ok(Some(_)));
            slot.send(r);
            if last {
                return;
            }
        }
    }));
    loop {
        let incoming = tokio::select! {
            r = incoming_rx.recv() => r.unwrap_or(Ok(None)),
            _ = shutdown.changed() => return,
        };
        let reply = match incoming {
            Ok(None) => return,
            Err(e) => return log_end(&e),
            Ok(Some(Incoming::Command { name, body })) => {
                if name == "PING" && reply_pong(&mut writer, &body, &limits).await.is_err() {
                    return;
                }
                continue;
            }
            Ok(Some(Incoming::Message(frames))) => {
                activity.set_busy(true);
                service.clone().handle(caller.clone(), frames).await
            }
            Ok(Some(Incoming::TooLarge { head, reason })) => {
                activity.set_busy(true);
                tracing::info!(identity = %String::from_utf8_lossy(&identity), %reason, "request refused unread");
                service.clone().reject(caller.clone(), head, reason).await
            }
        };
        let Some(reply) = reply.filter(|r| !r.is_empty()) else {
            activity.set_busy(false);
            continue;
        };
        let mut tail = reply.tail.as_ref().and_then(Tail::take);
        let mut write = write_within(&mut writer, &limits, &identity, &reply).await;
        while write.is_ok()
            && let Some(rx) = tail.as_mut()
        {
            match rx.recv().await {
                Some(Ok(chunk)) => {
                    let more = !chunk.last;
                    write = write_within(&mut writer, &limits, &identity, &chunk).await;
                    if !more {
                        tail = None;
                    }
                }
                why => {
                    let why = match why {
                        Some(Err(why)) => why,
                        _ => "its sender ended before the last frame".into(),
                    };
                    return tracing::warn!(
                        identity = %String::from_utf8_lossy(&identity),
                        reason = %why,
                        "a reply begun could not be finished: connection dropped"
                    );
                }
            }
        }
        match write {
            Ok(()) => activity.set_busy(false),
            Err(()) => return,
        }
    }
}

/// Something a connection writes: a message's first frames or a tail's
/// chunk.
trait Writable: Sync {
    fn write_to<'a>(
        &'a self,
        w: &'a mut WriteHalf<BoxStream>,
    ) -> BoxFuture<'a, std::io::Result<()>>;
}

impl Writable for Message {
    fn write_to<'a>(
        &'a self,
        w: &'a mut WriteHalf<BoxStream>,
    ) -> BoxFuture<'a, std::io::Result<()>> {
        Box::pin(self.write(w))
    }
}

impl Writable for Chunk {
    fn write_to<'a>(
        &'a self,
        w: &'a mut WriteHalf<BoxStream>,
    ) -> BoxFuture<'a, std::io::Result<()>> {
        Box::pin(zmtp::write_gathered_more(
            w,
            &self.parts,
            &self.per_frame,
            !self.last,
        ))
    }
}

/// Writes `what` within the write timeout; `Err` (logged) if the
/// connection is to be dropped.
async fn write_within(
    writer: &mut WriteHalf<BoxStream>,
    limits: &Limits,
    identity: &[u8],
    what: &(dyn Writable + Sync),
) -> Result<(), ()> {
    match tokio::time::timeout(limits.write_timeout, what.write_to(writer)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "reply could not be sent (client gone?)");
            Err(())
        }
        Err(_) => {
            tracing::warn!(
                identity = %String::from_utf8_lossy(identity),
                timeout = ?limits.write_timeout,
                "client did not read its reply in time: connection dropped"
            );
            Err(())
        }
    }
}

/// A task aborted when this is dropped (a connection's reader, when the
/// connection ends).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn log_end(e: &ZmtpError) {
    match e {
        ZmtpError::Closed => tracing::debug!("client closed the connection mid-message"),
        e => tracing::debug!(error = %e, "connection dropped"),
    }
}

/// Answers a ZMTP 3.1 PING with its context.
async fn reply_pong(
    writer: &mut WriteHalf<BoxStream>,
    ping: &[u8],
    limits: &Limits,
) -> Result<(), ()> {
    use tokio::io::AsyncWriteExt;
    let context = ping.get(2..).unwrap_or(&[]);
    let pong = frame::command_frame("PONG", &context[..context.len().min(16)]);
    let write = async {
        writer.write_all(&pong).await?;
        writer.flush().await
    };
    match tokio::time::timeout(limits.write_timeout, write).await {
        Ok(Ok(())) => Ok(()),
        _ => Err(()),
    }
}

/// What [`Peer::request_tapped`] shows of a reply while it arrives.
pub enum Tapped<'a> {
    /// The reply's next frame (frame 0 first).
    Frame(&'a Bytes),
    /// The request is sent again on a fresh connection: the frames shown
    /// so far belong to no reply.
    Retry,
}

/// An open DEALER connection.
struct Conn {
    reader: FrameReader<ReadHalf<BoxStream>>,
    writer: WriteHalf<BoxStream>,
}

/// Connections a [`Peer`] opens to one unit at most: that many requests
/// are in flight at once.
pub const PEER_CONNECTIONS: usize = 8;

/// Our DEALER to a remote unit: up to [`PEER_CONNECTIONS`] connections,
/// one request in flight on each, reconnect on failure.
pub struct Peer {
    endpoint: String,
    identity_prefix: String,
    sequence: AtomicU64,
    limits: zmtp::Limits,
    /// Idle connections, most recently used last.
    idle: std::sync::Mutex<Vec<Conn>>,
    /// One permit per connection in use.
    slots: Semaphore,
    /// Where large reply frames are received, if set.
    pool: Option<Arc<ReceivePool>>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("endpoint", &self.endpoint)
            .finish()
    }
}

impl Peer {
    /// A peer for `endpoint`; connections get identities `<prefix>_<n>`.
    pub fn new(endpoint: impl Into<String>, identity_prefix: impl Into<String>) -> Peer {
        Peer::with_limits(endpoint, identity_prefix, zmtp::Limits::DEFAULT)
    }

    /// Like [`Peer::new`], with receive limits for replies.
    pub fn with_limits(
        endpoint: impl Into<String>,
        identity_prefix: impl Into<String>,
        limits: zmtp::Limits,
    ) -> Peer {
        Peer {
            endpoint: endpoint.into(),
            identity_prefix: identity_prefix.into(),
            sequence: AtomicU64::new(0),
            limits,
            idle: std::sync::Mutex::new(Vec::new()),
            slots: Semaphore::new(PEER_CONNECTIONS),
            pool: None,
        }
    }

    /// The same peer, receiving large reply frames into buffers of `pool`
    /// (replies whose rows are kept: a buffer comes back to the pool, and
    /// is read into again resident, once the last row of it is dropped).
    pub fn with_pool(mut self, pool: Option<Arc<ReceivePool>>) -> Peer {
        self.pool = pool;
        self
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    async fn open(&self) -> Result<BoxStream, ConnectError> {
        if let Some(path) = self.endpoint.strip_prefix("ipc://") {
            let s = UnixStream::connect(path).await?;
            return Ok(Box::new(s));
        }
        let Some(addr) = self.endpoint.strip_prefix("tcp://") else {
            return Err(ConnectError::Scheme);
        };
        let s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        Ok(Box::new(s))
    }

    async fn connect(&self) -> Result<Conn, ConnectError> {
        let n = self.sequence.fetch_add(1, Ordering::Relaxed);
        let identity = format!("{}_{n}", self.identity_prefix);
        let (reader, mut writer) = tokio::io::split(self.open().await?);
        let mut reader = FrameReader::with_pool(reader, self.pool.clone());
        zmtp::handshake(
            &mut reader,
            &mut writer,
            "DEALER",
            identity.as_bytes(),
            &["ROUTER", "REP", "DEALER"],
        )
        .await?;
        Ok(Conn { reader, writer })
    }

    /// Sends one request and waits for its reply, all within `timeout`
    /// counted from now (waiting for a free connection included). On any
    /// failure the connection is dropped, so a later request starts on a
    /// fresh one.
    pub async fn request(
        &self,
        frames: Vec<Bytes>,
        timeout: Duration,
    ) -> Result<Vec<Bytes>, TransportError> {
        self.request_message(frames.into(), timeout).await
    }

    /// [`Peer::request`] of a message whose frames may be gathered.
    pub async fn request_message(
        &self,
        frames: Message,
        timeout: Duration,
    ) -> Result<Vec<Bytes>, TransportError> {
        self.request_tapped(frames, timeout, &|_| {}).await
    }

    /// [`Peer::request_message`], showing `tap` each frame of the reply as
    /// it arrives (frame 0 first), and [`Tapped::Retry`] when the request
    /// is sent again on a fresh connection (frames shown before belong to
    /// no reply). The reply is still returned whole, and only a reply
    /// returned `Ok` was a whole message.
    pub async fn request_tapped(
        &self,
        frames: Message,
        timeout: Duration,
        tap: &(dyn Fn(Tapped<'_>) + Send + Sync),
    ) -> Result<Vec<Bytes>, TransportError> {
        let attempt = async {
            let _permit = self
                .slots
                .acquire()
                .await
                .expect("the semaphore is never closed");
            let kept = self.idle.lock().expect("idle list").pop();
            let mut slot = kept;
            let result = self.exchange(&mut slot, &frames, tap).await;
            if result.is_ok()
                && let Some(conn) = slot
            {
                self.idle.lock().expect("idle list").push(conn);
            }
            result
        };
        match tokio::time::timeout(timeout, attempt).await {
            Err(_) => Err(TransportError::Timeout {
                endpoint: self.endpoint.clone(),
                timeout,
            }),
            Ok(r) => r,
        }
    }

    async fn exchange(
        &self,
        slot: &mut Option<Conn>,
        frames: &Message,
        tap: &(dyn Fn(Tapped<'_>) + Send + Sync),
    ) -> Result<Vec<Bytes>, TransportError> {
        if slot.is_some() {
            // A kept connection may be to a unit process that has since
            // restarted: its failure says nothing about the unit now. Every
            // request of both protocols is idempotent (put overwrites, get
            // and clear repeat), so try once more on a fresh connection.
            match self.exchange_once(slot, frames, tap).await {
                Err(TransportError::Send { .. } | TransportError::Recv { .. }) => {
                    *slot = None;
                    tap(Tapped::Retry);
                }
                done => return done,
            }
        }
        self.exchange_once(slot, frames, tap).await
    }

    async fn exchange_once(
        &self,
        slot: &mut Option<Conn>,
        frames: &Message,
        tap: &(dyn Fn(Tapped<'_>) + Send + Sync),
    ) -> Result<Vec<Bytes>, TransportError> {
        if slot.is_none() {
            let conn = self
                .connect()
                .await
                .map_err(|reason| TransportError::Connect {
                    endpoint: self.endpoint.clone(),
                    reason,
                })?;
            *slot = Some(conn);
        }
        let conn = slot.as_mut().expect("connection present");
        let recv_err = |reason: String| TransportError::Recv {
            endpoint: self.endpoint.clone(),
            reason,
        };
        frames
            .write(&mut conn.writer)
            .await
            .map_err(|e| TransportError::Send {
                endpoint: self.endpoint.clone(),
                reason: e.to_string(),
            })?;
        loop {
            let mut seen = |f: &Bytes| tap(Tapped::Frame(f));
            match conn.reader.read_observed(&self.limits, &mut seen).await {
                Ok(Some(Incoming::Message(reply))) => return Ok(reply),
                Ok(Some(Incoming::Command { .. })) => continue,
                Ok(Some(Incoming::TooLarge { reason, .. })) => {
                    return Err(recv_err(format!("reply refused: {reason}")));
                }
                Ok(None) => return Err(recv_err("the unit closed the connection".into())),
                Err(e) => return Err(recv_err(e.to_string())),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo;

    impl Service for Echo {
        fn handle(
            self: Arc<Self>,
            _caller: Caller,
            frames: Vec<Bytes>,
        ) -> BoxFuture<'static, Option<Message>> {
            // Each frame sent back gathered from two parts (its halves).
            Box::pin(async move {
                let mut parts = Vec::new();
                for f in &frames {
                    let half = f.len() / 2;
                    parts.push(f.slice(..half));
                    parts.push(f.slice(half..));
                }
                let per_frame = Some(vec![2; frames.len()]);
                Some(Message {
                    parts,
                    per_frame,
                    tail: None,
                })
            })
        }
    }

    /// Answers each request with the length of its first frame; the first
    /// request waits for the test's go first.
    struct Gate {
        go: std::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
    }

    impl Service for Gate {
        fn handle(
            self: Arc<Self>,
            _caller: Caller,
            frames: Vec<Bytes>,
        ) -> BoxFuture<'static, Option<Message>> {
            Box::pin(async move {
                let go = self.go.lock().unwrap().take();
                if let Some(go) = go {
                    let _ = go.await;
                }
                let len = frames[0].len() as u64;
                Some(Message::from(vec![Bytes::from(len.to_le_bytes().to_vec())]))
            })
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_next_request_is_read_while_one_is_handled() {
        let (socket, bound) = bind("tcp://127.0.0.1:0").await.unwrap();
        let (go, wait) = tokio::sync::oneshot::channel();
        let gate = Arc::new(Gate {
            go: std::sync::Mutex::new(Some(wait)),
        });
        let (tx, rx) = watch::channel(false);
        let server = tokio::spawn(serve(socket, gate, rx));
        let stream = TcpStream::connect(bound.trim_start_matches("tcp://"))
            .await
            .unwrap();
        let (r, mut w) = tokio::io::split(stream);
        let mut r = FrameReader::new(r);
        zmtp::handshake(&mut r, &mut w, "DEALER", b"", &["ROUTER"])
            .await
            .unwrap();
        // The first request, held by the service; then one of 64 MiB, far
        // more than the sockets' buffers hold: its write ends only if the
        // server reads it while it handles the first.
        zmtp::write_message(&mut w, &[Bytes::from_static(b"first")])
            .await
            .unwrap();
        let big = Bytes::from(vec![7u8; 64 << 20]);
        tokio::time::timeout(Duration::from_secs(30), zmtp::write_message(&mut w, &[big]))
            .await
            .expect("the second request was not read while the first was handled")
            .unwrap();
        go.send(()).unwrap();
        // Both answered, in order.
        for want in [5u64, 64 << 20] {
            match r.read(&zmtp::Limits::DEFAULT).await.unwrap() {
                Some(Incoming::Message(f)) => {
                    assert_eq!(f, vec![Bytes::from(want.to_le_bytes().to_vec())])
                }
                other => panic!("{other:?}"),
            }
        }
        tx.send(true).unwrap();
        server.await.unwrap();
    }

    /// Answers with frame 0 "head", then a tail of one chunk per
    /// remaining request frame sent 20 ms apart (the request's frames
    /// echoed); a request whose first frame is "abort" gets a tail that
    /// fails after its first chunk.
    struct Trickle;

    impl Service for Trickle {
        fn handle(
            self: Arc<Self>,
            _caller: Caller,
            frames: Vec<Bytes>,
        ) -> BoxFuture<'static, Option<Message>> {
            Box::pin(async move {
                let (tx, tail) = Tail::channel(1);
                let abort = frames[0] == "abort";
                tokio::spawn(async move {
                    let n = frames.len() - 1;
                    for (k, f) in frames.into_iter().skip(1).enumerate() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        if abort && k == 1 {
                            let _ = tx.send(Err("the source went away".into())).await;
                            return;
                        }
                        let chunk = Chunk {
                            parts: vec![f.slice(..f.len() / 2), f.slice(f.len() / 2..)],
                            per_frame: vec![2],
                            last: k + 1 == n,
                        };
                        if tx.send(Ok(chunk)).await.is_err() {
                            return;
                        }
                    }
                });
                Some(Message {
                    parts: vec![Bytes::from_static(b"head")],
                    per_frame: None,
                    tail: Some(tail),
                })
            })
        }
    }

    #[tokio::test]
    async fn a_reply_with_a_tail_arrives_whole_and_an_abandoned_one_ends_its_connection() {
        let (socket, bound) = bind("tcp://127.0.0.1:0").await.unwrap();
        let (tx, rx) = watch::channel(false);
        let server = tokio::spawn(serve(socket, Arc::new(Trickle), rx));
        let peer = Peer::new(bound, "tail_test");
        let t = Duration::from_secs(10);
        let big = Bytes::from(vec![3u8; 8 << 20]);
        let request = vec![
            Bytes::from_static(b"go"),
            Bytes::from_static(b"one"),
            big.clone(),
            Bytes::new(),
        ];
        let seen = std::sync::Mutex::new(Vec::new());
        let reply = peer
            .request_tapped(request.clone().into(), t, &|e| {
                if let Tapped::Frame(f) = e {
                    seen.lock().unwrap().push(f.len());
                }
            })
            .await
            .unwrap();
        assert_eq!(reply.len(), 4);
        assert_eq!(reply[0], "head");
        assert_eq!(reply[1..], request[1..]);
        assert_eq!(*seen.lock().unwrap(), vec![4, 3, 8 << 20, 0]);
        // A tail that fails: the caller sees the connection end, not a
        // reply, and the next request is answered on a fresh connection.
        let e = peer
            .request(vec![Bytes::from_static(b"abort"), big.clone(), big], t)
            .await
            .unwrap_err();
        assert!(matches!(e, TransportError::Recv { .. }), "{e:?}");
        let reply = peer.request(request.clone(), t).await.unwrap();
        assert_eq!(reply[1..], request[1..]);
        tx.send(true).unwrap();
        server.await.unwrap();
    }

    #[tokio::test]
    async fn ipc_bind_survives_a_stale_socket_file_and_peers_reconnect() {
        let dir = std::env::temp_dir().join(format!("stowage-ipc-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("unit.sock");
        // A file left behind by a dead process.
        std::fs::write(&path, b"stale").unwrap();
        let endpoint = format!("ipc://{}", path.display());
        let (socket, bound) = bind(&endpoint).await.unwrap();
        assert!(bound.starts_with("ipc://"), "{bound}");
        let (tx, rx) = watch::channel(false);
        let server = tokio::spawn(serve(socket, Arc::new(Echo), rx));
        let peer = Peer::new(endpoint.clone(), "TQ_STORAGE_test");
        let t = Duration::from_secs(5);
        for i in 0..3u8 {
            let reply = peer
                .request(vec![Bytes::from(vec![i; 3]), Bytes::from_static(b"x")], t)
                .await
                .unwrap();
            assert_eq!(
                reply,
                vec![Bytes::from(vec![i; 3]), Bytes::from_static(b"x")]
            );
        }
        tx.send(true).unwrap();
        server.await.unwrap();
        // A peer whose unit is gone fails within its timeout, it does not hang.
        let gone = Peer::new("tcp://127.0.0.1:1", "TQ_STORAGE_test");
        assert!(
            gone.request(vec![Bytes::from_static(b"x")], Duration::from_millis(500))
                .await
                .is_err()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn gathered_messages_cross_tcp_whole() {
        let (socket, bound) = bind("tcp://127.0.0.1:0").await.unwrap();
        let (tx, rx) = watch::channel(false);
        let server = tokio::spawn(serve(socket, Arc::new(Echo), rx));
        let peer = Peer::new(bound, "TQ_STORAGE_test");
        // Frame 1 from 5,000 parts of 4 KiB (more than one vectored write
        // takes, and more than a socket buffer holds), an empty part among
        // them; frame 2 from one part.
        let mut parts: Vec<Bytes> = (0..5000u32)
            .map(|i| Bytes::from(vec![(i % 251) as u8; 4096]))
            .collect();
        parts.insert(17, Bytes::new());
        let mut whole = Vec::new();
        parts.iter().for_each(|p| whole.extend_from_slice(p));
        parts.push(Bytes::from_static(b"tail"));
        let msg = Message {
            parts,
            per_frame: Some(vec![5001, 1]),
            tail: None,
        };
        let reply = peer
            .request_message(msg, Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(reply.len(), 2);
        assert!(
            reply[0] == whole,
            "frame 1 arrives as its parts back to back"
        );
        assert_eq!(reply[1], Bytes::from_static(b"tail"));
        // Counts that do not add up are refused before anything is sent.
        let mut sink = Vec::new();
        let e = zmtp::write_gathered(&mut sink, &[Bytes::from_static(b"x")], &[2])
            .await
            .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
        assert!(sink.is_empty());
        tx.send(true).unwrap();
        server.await.unwrap();
    }
}
