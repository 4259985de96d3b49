//! The ZeroMQ transport, behind a small surface so it can be replaced.
//!
//! Built on the pure-Rust `zeromq` crate (0.7, tokio). Facts that shape this
//! module: `zeromq` copies every frame it sends into its write buffer, has a
//! fixed per-peer queue and no DEALER reconnect, and cannot bind `ipc://`
//! over a stale socket file. So:
//! - `stowd` is always the side that binds ([`bind`] removes a stale ipc
//!   file first);
//! - a [`Peer`] (our DEALER to a remote unit) keeps one request in flight,
//!   and a socket that failed or timed out is dropped and reconnected on the
//!   next request;
//! - callers split large puts to remote units into messages of bounded size
//!   (see `manager`), which bounds the copy `zeromq` makes.
//!
//! Server side: [`serve`] runs a ROUTER. Requests from one identity are
//! handled one after the other and answered in order; different identities
//! are served concurrently.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use zeromq::{DealerSocket, RouterSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

/// Requests queued per client identity before the reader waits.
pub const PER_PEER_QUEUE: usize = 64;

/// Transport failures.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    #[error("cannot bind {endpoint}: {reason}")]
    Bind { endpoint: String, reason: String },
    #[error("cannot connect to {endpoint}: {reason}")]
    Connect { endpoint: String, reason: String },
    #[error("send to {endpoint} failed: {reason}")]
    Send { endpoint: String, reason: String },
    #[error("no reply from {endpoint} within {timeout:?}")]
    Timeout { endpoint: String, timeout: Duration },
    #[error("receive from {endpoint} failed: {reason}")]
    Recv { endpoint: String, reason: String },
}

/// A boxed future, for handlers.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Answers requests arriving on a ROUTER.
pub trait Service: Send + Sync + 'static {
    /// Handles one request from `identity` (`frames` excludes the identity).
    /// `None` means: send no reply (e.g. an identity that is not allowed).
    fn handle(self: Arc<Self>, identity: Bytes, frames: Vec<Bytes>) -> BoxFuture<'static, Option<Vec<Bytes>>>;
}

/// Binds a ROUTER on `endpoint` and returns it with the resolved endpoint
/// (the real port when 0 was asked).
pub async fn bind(endpoint: &str) -> Result<(RouterSocket, String), TransportError> {
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        // A socket file left by a dead process makes bind fail: remove it.
        let p = std::path::Path::new(path);
        if p.exists() {
            let _ = std::fs::remove_file(p);
        }
    }
    let mut socket = RouterSocket::new();
    let bound = socket
        .bind(endpoint)
        .await
        .map_err(|e| TransportError::Bind { endpoint: endpoint.into(), reason: e.to_string() })?;
    Ok((socket, bound.to_string()))
}

/// Serves `service` on `socket` until `shutdown` turns true.
pub async fn serve(socket: RouterSocket, service: Arc<dyn Service>, mut shutdown: watch::Receiver<bool>) {
    let (send, mut recv) = socket.split();
    let mut workers: HashMap<Bytes, mpsc::Sender<Vec<Bytes>>> = HashMap::new();
    loop {
        let message = tokio::select! {
            m = recv.recv() => m,
            _ = shutdown.changed() => break,
        };
        let message = match message {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(error = %e, "router receive error");
                continue;
            }
        };
        let mut frames = message.into_vec();
        if frames.is_empty() {
            continue;
        }
        let identity = frames.remove(0);
        let tx = workers.entry(identity.clone()).or_insert_with(|| {
            let (tx, rx) = mpsc::channel(PER_PEER_QUEUE);
            tokio::spawn(peer_worker(identity.clone(), rx, service.clone(), send.clone()));
            tx
        });
        if tx.send(frames).await.is_err() {
            workers.remove(&identity);
        }
    }
}

/// Handles one identity's requests in order and sends the replies.
async fn peer_worker(
    identity: Bytes,
    mut rx: mpsc::Receiver<Vec<Bytes>>,
    service: Arc<dyn Service>,
    mut send: zeromq::RouterSendHalf,
) {
    while let Some(frames) = rx.recv().await {
        let Some(reply) = service.clone().handle(identity.clone(), frames).await else { continue };
        let mut out = Vec::with_capacity(reply.len() + 1);
        out.push(identity.clone());
        out.extend(reply);
        let Ok(message) = ZmqMessage::try_from(out) else { continue };
        if let Err(e) = send.send(message).await {
            tracing::debug!(error = %e, "reply could not be sent (client gone?)");
        }
    }
}

/// Our DEALER to a remote unit: one request in flight, reconnect on failure.
pub struct Peer {
    endpoint: String,
    identity_prefix: String,
    sequence: AtomicU64,
    socket: tokio::sync::Mutex<Option<DealerSocket>>,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer").field("endpoint", &self.endpoint).finish()
    }
}

impl Peer {
    /// A peer for `endpoint`; sockets get identities `<prefix>_<n>`.
    pub fn new(endpoint: impl Into<String>, identity_prefix: impl Into<String>) -> Peer {
        Peer {
            endpoint: endpoint.into(),
            identity_prefix: identity_prefix.into(),
            sequence: AtomicU64::new(0),
            socket: tokio::sync::Mutex::new(None),
        }
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    async fn connect(&self, timeout: Duration) -> Result<DealerSocket, TransportError> {
        let n = self.sequence.fetch_add(1, Ordering::Relaxed);
        let identity = format!("{}_{n}", self.identity_prefix);
        let mut options = SocketOptions::default();
        options.peer_identity(identity.into_bytes().try_into().map_err(|e: zeromq::ZmqError| {
            TransportError::Connect { endpoint: self.endpoint.clone(), reason: e.to_string() }
        })?);
        options.connect_timeout(timeout);
        let mut socket = DealerSocket::with_options(options);
        socket
            .connect(&self.endpoint)
            .await
            .map_err(|e| TransportError::Connect { endpoint: self.endpoint.clone(), reason: e.to_string() })?;
        Ok(socket)
    }

    /// Sends one request and waits for its reply. On any failure the socket
    /// is dropped, so the next request starts on a fresh connection.
    pub async fn request(&self, frames: Vec<Bytes>, timeout: Duration) -> Result<Vec<Bytes>, TransportError> {
        let mut slot = self.socket.lock().await;
        if slot.is_none() {
            *slot = Some(self.connect(timeout).await?);
        }
        let socket = slot.as_mut().expect("socket present");
        let endpoint = self.endpoint.clone();
        let exchange = async {
            let message = ZmqMessage::try_from(frames)
                .map_err(|e| TransportError::Send { endpoint: endpoint.clone(), reason: e.to_string() })?;
            socket
                .send(message)
                .await
                .map_err(|e| TransportError::Send { endpoint: endpoint.clone(), reason: e.to_string() })?;
            socket
                .recv()
                .await
                .map(|m| m.into_vec())
                .map_err(|e| TransportError::Recv { endpoint: endpoint.clone(), reason: e.to_string() })
        };
        let result = match tokio::time::timeout(timeout, exchange).await {
            Err(_) => Err(TransportError::Timeout { endpoint: self.endpoint.clone(), timeout }),
            Ok(r) => r,
        };
        if result.is_err() {
            *slot = None;
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo;

    impl Service for Echo {
        fn handle(self: Arc<Self>, _identity: Bytes, frames: Vec<Bytes>) -> BoxFuture<'static, Option<Vec<Bytes>>> {
            Box::pin(async move { Some(frames) })
        }
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
            let reply = peer.request(vec![Bytes::from(vec![i; 3]), Bytes::from_static(b"x")], t).await.unwrap();
            assert_eq!(reply, vec![Bytes::from(vec![i; 3]), Bytes::from_static(b"x")]);
        }
        tx.send(true).unwrap();
        server.await.unwrap();
        // A peer whose unit is gone fails within its timeout, it does not hang.
        let gone = Peer::new("tcp://127.0.0.1:1", "TQ_STORAGE_test");
        assert!(gone.request(vec![Bytes::from_static(b"x")], Duration::from_millis(500)).await.is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
