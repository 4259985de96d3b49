//! The ZeroMQ transport: ZMTP 3.0 (NULL, PLAIN and CURVE security) spoken
//! by `stowd` itself, over tcp and ipc, with a ROUTER for serving and a DEALER
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
//! | [`zmtp`] | the same over a tokio byte stream: the frame reader, the message writers, the handshake (NULL, PLAIN, CURVE) |
//! | [`curve`] | CurveZMQ without I/O: keys, both sides of the handshake, the MESSAGE codecs |
//! | [`curve_io`] | CURVE's codecs over a connection's tokio halves, after its handshake |
//! | [`pool`] | the bounded pool of resident pages large received frames go into |
//! | [`table`] | the connection table of one listening socket: caps, eviction, idle timeout |
//! | [`socket`] | the byte stream (tcp or a unix socket), [`bind`] and its [`Listener`] |
//! | [`server`] | the serve loop: [`serve`], [`serve_with`] |
//! | [`connection`] | one client connection: handshake, requests read one ahead, replies (and tails) written in order |
//! | [`service`] | what a server answers with: [`Service`], [`Caller`] |
//! | [`message`] | what a connection sends: [`Message`], a reply's [`Tail`] of [`Chunk`]s |
//! | [`peer`] | the DEALER [`Peer`] to a remote unit |
//! | [`limits`] | [`Limits`]: what one connection may cost |
//! | [`error`] | [`TransportError`], [`ConnectError`] |
//!
//! The crate root (this file) re-exports the server's and the peer's
//! types, so they are `stowage_transport::Peer`, `stowage_transport::serve`
//! and so on. [`zmtp`] uses [`frame`] and [`pool`]; [`frame`] uses nothing
//! of the crate and nothing of tokio.

pub mod curve;
pub mod frame;
pub mod pool;
pub mod table;
pub mod zmtp;

mod connection;
mod curve_io;
mod error;
mod limits;
mod message;
mod peer;
mod server;
mod service;
mod socket;

pub use error::{ConnectError, TransportError};
pub use limits::Limits;
pub use message::{Chunk, Message, Tail, TailSender};
pub use peer::{PEER_CONNECTIONS, Peer, Tapped};
pub use pool::{Pages, ReceivePool};
pub use server::{serve, serve_with};
pub use service::{BoxFuture, Caller, Service};
pub use socket::{Listener, bind};
