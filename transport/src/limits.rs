//! [`Limits`]: what one connection may cost (receive limits, write and
//! handshake timeouts, connection caps, idle timeout, the receive pool).

use std::time::Duration;

use crate::{pool, zmtp};

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
    ///
    /// [`table`]: crate::table
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
    ///
    /// [`ReceivePool`]: crate::ReceivePool
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
    ///
    /// [`Peer`]: crate::Peer
    /// [`PEER_CONNECTIONS`]: crate::PEER_CONNECTIONS
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
