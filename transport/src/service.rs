//! What a server answers with: the [`Service`] trait, handed each request
//! with its [`Caller`].

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;

use crate::message::Message;

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

    /// Whether a connection from `peer` (`None`: a Unix socket) is served
    /// at all; one that is not is closed before the handshake. The default
    /// serves every peer.
    fn admits(&self, peer: Option<std::net::IpAddr>) -> bool {
        let _ = peer;
        true
    }

    /// The mechanism a client must speak at the handshake, this side its
    /// server: NULL (no credentials, the default), PLAIN with an
    /// authenticator, or CURVE with a key pair and a key check.
    fn security(&self) -> crate::zmtp::Security<'_> {
        crate::zmtp::Security::Null
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
