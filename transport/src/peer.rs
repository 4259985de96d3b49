//! [`Peer`], our DEALER to a remote unit: a few connections, one request
//! in flight on each, a fresh connection after a failure.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::net::{TcpStream, UnixStream};
use tokio::sync::Semaphore;

use crate::curve_io::{ReadStream, WriteStream};
use crate::error::{ConnectError, TransportError};
use crate::message::Message;
use crate::pool::ReceivePool;
use crate::socket::BoxStream;
use crate::zmtp::{self, FrameReader, Incoming};

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
    reader: FrameReader<ReadStream>,
    writer: WriteStream,
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
    /// ZMTP PLAIN credentials (username, password) presented at each
    /// connection's handshake; NULL without.
    credentials: Option<(Vec<u8>, Vec<u8>)>,
    /// CURVE: our key pair and the server's public key. With credentials
    /// too, the server's greeting picks which is presented.
    curve: Option<(crate::curve::Keypair, [u8; crate::curve::KEY_LEN])>,
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
            credentials: None,
            curve: None,
        }
    }

    /// The same peer, presenting `username` and `password` (ZMTP PLAIN)
    /// at each connection's handshake.
    pub fn with_credentials(mut self, username: &[u8], password: &[u8]) -> Peer {
        self.credentials = Some((username.to_vec(), password.to_vec()));
        self
    }

    /// The same peer, speaking CURVE with key pair `keys` to a server whose
    /// public key is `server`.
    pub fn with_curve(
        mut self,
        keys: crate::curve::Keypair,
        server: [u8; crate::curve::KEY_LEN],
    ) -> Peer {
        self.curve = Some((keys, server));
        self
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
        let mut reader = FrameReader::new(reader);
        let security = zmtp::Security::Client {
            plain: self
                .credentials
                .as_ref()
                .map(|(u, p)| (u.as_slice(), p.as_slice())),
            curve: self.curve.as_ref().map(|(k, s)| (k, s)),
        };
        let mut info = zmtp::handshake_with(
            &mut reader,
            &mut writer,
            security,
            "DEALER",
            identity.as_bytes(),
            &["ROUTER", "REP", "DEALER"],
        )
        .await?;
        let (reader, writer) = zmtp::secure(
            reader,
            writer,
            info.session.take(),
            self.pool.clone(),
            &self.limits,
        );
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
