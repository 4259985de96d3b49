//! Small clients over real ZeroMQ sockets: a TransferQueue storage-unit
//! client and a `stowage/1` client built on [`Peer`] (one request in flight,
//! a reply timeout on every request), and a raw pipelining DEALER for the
//! native protocol.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use stowage_host::batch::{Cell, Field};
use stowage_host::server::UnitEndpoint;
use stowage_host::transport::{Peer, TransportError};
use stowage_host::wire::channel;
use stowage_host::wire::native::{self, WireField};
use stowage_host::wire::tq;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// How long a client waits for a reply by default.
pub const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

fn next_client() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// A TransferQueue client of one unit (or of a router endpoint).
pub struct TqClient {
    peer: Peer,
    unit_id: String,
    sender_id: String,
    /// Reply timeout of every request.
    pub timeout: Duration,
}

impl std::fmt::Debug for TqClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TqClient")
            .field("unit", &self.unit_id)
            .finish()
    }
}

impl TqClient {
    /// A client whose DEALER identity starts `TQ_STORAGE_test_`.
    pub fn new(unit: &UnitEndpoint) -> TqClient {
        let prefix = format!(
            "TQ_STORAGE_test_{:08x}_{}",
            std::process::id(),
            next_client()
        );
        TqClient::with_identity_prefix(unit, &prefix)
    }

    /// A client with any identity prefix (a unit drops unrecognised ones).
    pub fn with_identity_prefix(unit: &UnitEndpoint, prefix: &str) -> TqClient {
        TqClient {
            peer: Peer::new(unit.endpoint.clone(), prefix.to_string()),
            unit_id: unit.id.clone(),
            sender_id: prefix.to_string(),
            timeout: REPLY_TIMEOUT,
        }
    }

    /// The frames of `request`, addressed to this client's unit.
    pub fn encode(&self, request: &tq::Request) -> Vec<Bytes> {
        tq::encode_request(&self.sender_id, Some(&self.unit_id), request)
            .expect("encodable request")
    }

    /// Sends frames and waits (at most `timeout`) for the reply frames.
    pub async fn exchange(
        &self,
        frames: Vec<Bytes>,
        timeout: Duration,
    ) -> Result<Vec<Bytes>, TransportError> {
        self.peer.request(frames, timeout).await
    }

    /// Sends frames and decodes the reply; panics if there is none or it is
    /// not a well-formed reply from this unit.
    pub async fn send_frames(&self, frames: Vec<Bytes>) -> tq::Reply {
        let reply = self
            .exchange(frames, self.timeout)
            .await
            .unwrap_or_else(|e| panic!("no reply: {e}"));
        let (envelope, reply) =
            tq::decode_reply(&reply).unwrap_or_else(|e| panic!("undecodable reply: {e}"));
        assert_eq!(envelope.sender_id, self.unit_id, "reply sender");
        assert_eq!(envelope.receiver_id, None, "reply receiver");
        reply
    }

    /// One request, one reply.
    pub async fn request(&self, request: &tq::Request) -> tq::Reply {
        self.send_frames(self.encode(request)).await
    }

    pub async fn put(&self, global_indexes: &[u64], fields: Vec<(String, Field)>) -> tq::Reply {
        self.request(&tq::Request::Put {
            global_indexes: global_indexes.to_vec(),
            fields,
        })
        .await
    }

    /// A put that must succeed.
    pub async fn put_ok(&self, global_indexes: &[u64], fields: Vec<(String, Field)>) {
        match self.put(global_indexes, fields).await {
            tq::Reply::PutData => {}
            other => panic!("put failed: {other:?}"),
        }
    }

    pub async fn get(&self, global_indexes: &[u64], fields: &[&str]) -> tq::Reply {
        let fields = fields.iter().map(|f| f.to_string()).collect();
        self.request(&tq::Request::Get {
            global_indexes: global_indexes.to_vec(),
            fields,
        })
        .await
    }

    /// A get that must succeed: the fields in reply order.
    pub async fn get_ok(
        &self,
        global_indexes: &[u64],
        fields: &[&str],
    ) -> Vec<(String, Vec<Cell>)> {
        match self.get(global_indexes, fields).await {
            tq::Reply::GetData { fields } => fields,
            other => panic!("get failed: {other:?}"),
        }
    }

    pub async fn clear(&self, global_indexes: &[u64]) -> tq::Reply {
        self.request(&tq::Request::Clear {
            global_indexes: global_indexes.to_vec(),
        })
        .await
    }

    /// `GET_METRICS`.
    pub async fn metrics(&self) -> tq::Metrics {
        match self.request(&tq::Request::GetMetrics).await {
            tq::Reply::Metrics(m) => m,
            other => panic!("GET_METRICS failed: {other:?}"),
        }
    }
}

/// The message of an error reply of `kind`; panics on any other reply.
pub fn tq_error(reply: &tq::Reply, kind: tq::ErrorReply) -> &str {
    match reply {
        tq::Reply::Error { kind: k, message } if *k == kind => message,
        other => panic!("expected {}, got {other:?}", kind.as_str()),
    }
}

/// A `stowage/1` client.
pub struct NativeClient {
    peer: Peer,
    next_id: AtomicU64,
    /// Reply timeout of every request.
    pub timeout: Duration,
}

impl std::fmt::Debug for NativeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeClient")
            .field("endpoint", &self.peer.endpoint())
            .finish()
    }
}

impl NativeClient {
    /// A client offering this user's stowd token, or its CURVE key, to a
    /// stowd that asks for one ([`stowage_host::auth::with_client_credentials`]).
    pub fn new(endpoint: &str) -> NativeClient {
        let prefix = format!("native_test_{:08x}_{}", std::process::id(), next_client());
        NativeClient {
            peer: stowage_host::auth::with_client_credentials(Peer::new(endpoint, prefix)),
            next_id: AtomicU64::new(1),
            timeout: REPLY_TIMEOUT,
        }
    }

    /// A client that offers no token and no CURVE key (ZMTP NULL), whatever
    /// this user's stowd's are.
    pub fn without_token(endpoint: &str) -> NativeClient {
        let prefix = format!("native_test_{:08x}_{}", std::process::id(), next_client());
        NativeClient {
            peer: Peer::new(endpoint, prefix),
            next_id: AtomicU64::new(1),
            timeout: REPLY_TIMEOUT,
        }
    }

    /// A client speaking CURVE with key pair `keys` to a server whose
    /// public key is `server`, for a stowd with `[security] auth = "curve"`.
    pub fn with_curve(
        endpoint: &str,
        keys: stowage_host::transport::curve::Keypair,
        server: [u8; 32],
    ) -> NativeClient {
        let prefix = format!("native_test_{:08x}_{}", std::process::id(), next_client());
        NativeClient {
            peer: Peer::new(endpoint, prefix).with_curve(keys, server),
            next_id: AtomicU64::new(1),
            timeout: REPLY_TIMEOUT,
        }
    }

    /// A client presenting `token` at the handshake (ZMTP PLAIN), for a
    /// stowd with `[security] auth = "token"`, and nothing else (no CURVE
    /// key of this user's stowd).
    pub fn with_token(endpoint: &str, token: &str) -> NativeClient {
        let mut c = NativeClient::without_token(endpoint);
        c.peer = c.peer.with_credentials(b"stowage", token.as_bytes());
        c
    }

    /// One request's reply, or why there is none (a refused handshake, a
    /// timeout), without panicking.
    pub async fn try_call(&self, op: native::Op) -> Result<native::Reply, String> {
        let request = native::Request { id: self.id(), op };
        let frames = native::encode_request(&request).map_err(|e| e.to_string())?;
        let reply = self
            .peer
            .request(frames, self.timeout)
            .await
            .map_err(|e| e.to_string())?;
        native::decode_reply(&reply, &native::Limits::default())
            .map(|(_, r)| r)
            .map_err(|e| e.to_string())
    }

    /// A fresh request id.
    pub fn id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Sends frames and decodes the reply: (echoed id, reply). Panics if no
    /// reply arrives in time or it cannot be decoded.
    pub async fn send_frames(&self, frames: Vec<Bytes>) -> (u64, native::Reply) {
        let reply = self
            .peer
            .request(frames, self.timeout)
            .await
            .unwrap_or_else(|e| panic!("no reply: {e}"));
        native::decode_reply(&reply, &native::Limits::default())
            .unwrap_or_else(|e| panic!("undecodable reply: {e}"))
    }

    /// One request with a fresh id; checks that the reply echoes it.
    pub async fn call(&self, op: native::Op) -> native::Reply {
        let id = self.id();
        let frames =
            native::encode_request(&native::Request { id, op }).expect("encodable request");
        let (echoed, reply) = self.send_frames(frames).await;
        assert_eq!(echoed, id, "reply id");
        reply
    }

    /// One request with a fresh id and the envelope keys `extras` sets.
    pub async fn call_with(&self, op: native::Op, extras: &native::Extras) -> native::Reply {
        let id = self.id();
        let mut frames =
            native::encode_request(&native::Request { id, op }).expect("encodable request");
        frames[0] = native::with_extras(&frames[0], extras).expect("extras");
        let (echoed, reply) = self.send_frames(frames).await;
        assert_eq!(echoed, id, "reply id");
        reply
    }

    pub async fn put(&self, global_indexes: &[u64], fields: &[(String, Field)]) -> native::Reply {
        let fields = fields
            .iter()
            .map(|(n, f)| {
                (
                    n.as_str().into(),
                    WireField::from_field(f).expect("sendable field"),
                )
            })
            .collect();
        self.call(native::Op::Put {
            global_indexes: global_indexes.to_vec(),
            fields,
        })
        .await
    }

    /// A put that must succeed.
    pub async fn put_ok(&self, global_indexes: &[u64], fields: &[(String, Field)]) {
        match self.put(global_indexes, fields).await {
            native::Reply::PutOk { rows } => {
                assert_eq!(rows, global_indexes.len() as u64, "put_ok rows")
            }
            other => panic!("put failed: {other:?}"),
        }
    }

    pub async fn get(&self, global_indexes: &[u64], fields: &[&str]) -> native::Reply {
        let fields = fields.iter().map(|f| f.to_string()).collect();
        self.call(native::Op::Get {
            global_indexes: global_indexes.to_vec().into(),
            fields,
        })
        .await
    }

    /// A get that must succeed.
    pub async fn get_ok(
        &self,
        global_indexes: &[u64],
        fields: &[&str],
    ) -> Vec<(String, WireField)> {
        match self.get(global_indexes, fields).await {
            native::Reply::GetOk { fields } => fields,
            other => panic!("get failed: {other:?}"),
        }
    }

    /// A clear that must succeed: the number of values dropped.
    pub async fn clear(&self, global_indexes: &[u64], fields: Option<&[&str]>) -> u64 {
        let fields = fields.map(|f| f.iter().map(|s| s.to_string()).collect());
        match self
            .call(native::Op::Clear {
                global_indexes: global_indexes.to_vec(),
                fields,
            })
            .await
        {
            native::Reply::ClearOk { cleared } => cleared,
            other => panic!("clear failed: {other:?}"),
        }
    }

    pub async fn stats(&self) -> Vec<(String, native::Stat)> {
        match self.call(native::Op::Stats).await {
            native::Reply::StatsOk(s) => s,
            other => panic!("stats failed: {other:?}"),
        }
    }

    /// One integer counter of `stats`; panics if it is missing.
    pub async fn stat(&self, name: &str) -> i64 {
        stat(&self.stats().await, name)
    }
}

/// Integer counter `name` of a `stats_ok`.
pub fn stat(stats: &[(String, native::Stat)], name: &str) -> i64 {
    match stats.iter().find(|(k, _)| k == name) {
        Some((_, native::Stat::Int(v))) => *v,
        other => panic!("stats has no integer {name:?} ({other:?}) in {stats:?}"),
    }
}

/// The (code, message) of an `error` reply; panics on any other reply.
pub fn native_error(reply: &native::Reply) -> (&str, &str) {
    match reply {
        native::Reply::Error { code, message } => (code, message),
        other => panic!("expected an error reply, got {}", summary(other)),
    }
}

/// A reply without its bulk, for assertion messages.
pub fn summary(reply: &native::Reply) -> String {
    match reply {
        native::Reply::GetOk { fields } => {
            let fields: Vec<String> = fields
                .iter()
                .map(|(n, f)| format!("{n}: {} x{}", f.kind(), f.rows()))
                .collect();
            format!("get_ok {{{}}}", fields.join(", "))
        }
        other => format!("{other:?}"),
    }
}

/// A raw DEALER on the native endpoint that may have many requests in
/// flight (the [`Peer`]-based client keeps one).
pub struct NativePipeline {
    socket: DealerSocket,
}

impl std::fmt::Debug for NativePipeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativePipeline").finish()
    }
}

impl NativePipeline {
    pub async fn connect(endpoint: &str) -> NativePipeline {
        let mut socket = DealerSocket::new();
        tokio::time::timeout(REPLY_TIMEOUT, socket.connect(endpoint))
            .await
            .unwrap_or_else(|_| panic!("connect to {endpoint} timed out"))
            .unwrap_or_else(|e| panic!("connect to {endpoint}: {e}"));
        NativePipeline { socket }
    }

    /// Sends one request without waiting for its reply.
    pub async fn send(&mut self, request: &native::Request) {
        let frames = native::encode_request(request).expect("encodable request");
        let message = ZmqMessage::try_from(frames).expect("at least one frame");
        tokio::time::timeout(REPLY_TIMEOUT, self.socket.send(message))
            .await
            .expect("send timed out")
            .expect("send failed");
    }

    /// The next reply, whichever request it answers.
    pub async fn recv(&mut self) -> (u64, native::Reply) {
        let message = tokio::time::timeout(REPLY_TIMEOUT, self.socket.recv())
            .await
            .expect("no reply in time")
            .expect("receive failed");
        native::decode_reply(&message.into_vec(), &native::Limits::default())
            .expect("decodable reply")
    }
}

/// A same-node descriptor channel, as a client opens it (the Unix socket
/// `stowd` names in `channel_ok`, and its token).
pub struct FdChannel {
    pub sock: std::os::unix::net::UnixStream,
    pub token: String,
    pub path: std::path::PathBuf,
}

impl FdChannel {
    /// Asks `client`'s stowd for its channel socket and opens a channel.
    pub async fn open(client: &NativeClient) -> FdChannel {
        let path = match client.call(native::Op::Channel).await {
            native::Reply::ChannelOk { path } => std::path::PathBuf::from(path),
            other => panic!("no channel: {}", summary(&other)),
        };
        let p = path.clone();
        let (sock, token) = tokio::task::spawn_blocking(move || {
            stowage_host::shm::channel::connect(&p).expect("channel opens")
        })
        .await
        .expect("join");
        FdChannel { sock, token, path }
    }

    /// The envelope keys of a lease (`same_node` false) or a same-node get.
    pub fn extras(&self, same_node: bool) -> native::Extras {
        native::Extras {
            same_node,
            channel: Some(self.token.clone()),
            ..native::Extras::default()
        }
    }

    /// The next message (blocking): the request it answers, and its
    /// descriptors with the segment names they came under, in order.
    pub fn recv(&self) -> (u64, Vec<(String, std::os::fd::OwnedFd)>) {
        let (body, fds) =
            stowage_host::shm::channel::recv_message(&self.sock).expect("a channel message");
        let message = channel::Descriptors::decode(&body, &channel::Limits::DEFAULT)
            .unwrap_or_else(|e| panic!("a bad channel message: {e}"));
        assert_eq!(
            message.names.len(),
            fds.len(),
            "a channel message's names and descriptors differ in number"
        );
        let names = message.names.into_iter().map(str::to_owned);
        (message.id, names.zip(fds).collect())
    }
}
