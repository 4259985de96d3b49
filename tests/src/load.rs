//! Concurrent load with verification: many clients doing random put / get /
//! clear of random batches against one `stowd`, over real ZeroMQ sockets,
//! checking every row that comes back.
//!
//! Each client owns a disjoint range of global indexes and keeps, per
//! (index, field), the version it last wrote (or that the key is absent),
//! so the expected answer of every request is known exactly even with many
//! clients running at once. Every stored value is derived from (global
//! index, field, version): tensor rows start with a 16-byte header (index,
//! field and version) followed by seeded bytes, strings spell the three out
//! and carry seeded text. A get compares every row with the model; a row
//! that differs is a *mismatch*, classified as lost (expected, reported
//! absent), ghost (expected absent, returned), stale (an older version of
//! the same key), swapped (another key's row) or corrupt (anything else).
//!
//! Fields: `reg` (float32 `[n, 64]`, regular), `jag` (int32 rows of 4..=128
//! elements, nested), `blob` (uint8 `[n, blob_bytes]`, regular) and `str`
//! (strings). Requests go through the TransferQueue router endpoint or the
//! native `stowage/1` endpoint, chosen per request, so a row put over one
//! protocol is often read over the other. A request has one reply in
//! flight per socket; a socket that failed or timed out is replaced.
//!
//! [`run`] returns a [`Report`]: op counts and rates, latency percentiles,
//! bytes moved, mismatches, unexpected errors, and `stowd`'s resident
//! memory (from `/proc/<pid>/status`) at baseline, at peak and after the
//! final clear.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use stowage_host::batch::{Cell, Field, Value};
use stowage_host::server::UnitEndpoint;
use stowage_host::tensor::{Dtype, Tensor};
use stowage_host::wire::native::{self, WireField};
use stowage_host::wire::tq;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, ZmqMessage};

use crate::data::pattern;

/// The fields every client uses, by id.
pub const FIELDS: [&str; 4] = ["reg", "jag", "blob", "str"];
const REG: usize = 0;
const JAG: usize = 1;
const BLOB: usize = 2;
const STR: usize = 3;
/// Elements of a `reg` row (float32).
pub const REG_COLS: u64 = 64;

/// Which protocols the clients use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocols {
    Tq,
    Native,
    Both,
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Options {
    /// Concurrent clients (each a TransferQueue and a native DEALER).
    pub clients: usize,
    /// How long the random phase runs.
    pub duration: Duration,
    /// Global indexes owned by each client.
    pub keys_per_client: u64,
    /// Largest batch (rows) of one request.
    pub max_batch: usize,
    /// Bytes of a `blob` row (at least 16).
    pub blob_bytes: usize,
    pub protocols: Protocols,
    /// Seed of every random choice (client `c` uses `seed + c`).
    pub seed: u64,
    /// Reply timeout of one request.
    pub timeout: Duration,
    /// First global index (client `c` owns `base + c * keys_per_client ..`).
    pub index_base: u64,
    /// Check a native clear's `cleared` count against the model (exact for
    /// local units; a remote unit reports indexes, not values).
    pub exact_clear_counts: bool,
    /// Native clears of single fields (a remote TransferQueue unit cannot).
    pub field_clears: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            clients: 64,
            duration: Duration::from_secs(10),
            keys_per_client: 256,
            max_batch: 48,
            blob_bytes: 4096,
            protocols: Protocols::Both,
            seed: 1,
            timeout: Duration::from_secs(30),
            index_base: 0,
            exact_clear_counts: true,
            field_clears: true,
        }
    }
}

/// Where `stowd` is.
#[derive(Clone, Debug)]
pub struct Target {
    /// The router-mode TransferQueue endpoint (id and address).
    pub tq: Option<UnitEndpoint>,
    /// The native endpoint.
    pub native: Option<String>,
    /// `stowd`'s process id, for memory readings.
    pub pid: Option<u32>,
}

// ---------------------------------------------------------------------------
// Values derived from (index, field, version)

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn seed_of(g: u64, field: usize, version: u64) -> u64 {
    mix(g.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ mix(version ^ ((field as u64) << 56)))
}

/// Elements of the `jag` row of (g, version): 4..=128.
fn jag_len(g: u64, version: u64) -> u64 {
    4 + seed_of(g, JAG, version) % 125
}

/// The bytes of one tensor row: header (g, field << 56 | version), then
/// seeded bytes, `len` in all (at least 16).
fn row_bytes(g: u64, field: usize, version: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(&g.to_le_bytes());
    out.extend_from_slice(&(((field as u64) << 56) | version).to_le_bytes());
    out.extend_from_slice(&pattern(len - 16, seed_of(g, field, version)));
    out
}

fn string_value(g: u64, version: u64) -> String {
    let s = seed_of(g, STR, version);
    let tail: String = pattern((s % 40) as usize, s)
        .iter()
        .map(|b| (b'a' + b % 26) as char)
        .collect();
    format!("g={g} f=str v={version} {tail}")
}

/// The expected cell of (g, field, version).
fn expected_cell(g: u64, field: usize, version: u64, blob_bytes: usize) -> Cell {
    let tensor = |dtype: Dtype, row_shape: Vec<u64>, len: usize| {
        let t = Tensor::contiguous(
            Bytes::from(row_bytes(g, field, version, len)),
            dtype,
            row_shape,
        );
        Cell::Tensor(t.expect("length matches"))
    };
    match field {
        REG => tensor(Dtype::Float32, vec![REG_COLS], REG_COLS as usize * 4),
        JAG => {
            let n = jag_len(g, version);
            tensor(Dtype::Int32, vec![n], n as usize * 4)
        }
        BLOB => tensor(Dtype::Uint8, vec![blob_bytes as u64], blob_bytes),
        _ => Cell::Value(Value::Str(string_value(g, version))),
    }
}

/// The field of a put of `indexes` at `version`.
fn make_field(field: usize, indexes: &[u64], version: u64, blob_bytes: usize) -> Field {
    let n = indexes.len() as u64;
    let regular = |dtype: Dtype, row_len: usize, cols: u64| {
        let mut bytes = Vec::with_capacity(row_len * indexes.len());
        for &g in indexes {
            bytes.extend_from_slice(&row_bytes(g, field, version, row_len));
        }
        Field::Regular(
            Tensor::contiguous(Bytes::from(bytes), dtype, vec![n, cols]).expect("length matches"),
        )
    };
    match field {
        REG => regular(Dtype::Float32, REG_COLS as usize * 4, REG_COLS),
        BLOB => regular(Dtype::Uint8, blob_bytes, blob_bytes as u64),
        JAG => Field::Nested(
            indexes
                .iter()
                .map(|&g| {
                    let len = jag_len(g, version);
                    let bytes = Bytes::from(row_bytes(g, field, version, len as usize * 4));
                    Tensor::contiguous(bytes, Dtype::Int32, vec![len]).expect("length matches")
                })
                .collect(),
        ),
        _ => Field::Values(
            indexes
                .iter()
                .map(|&g| Value::Str(string_value(g, version)))
                .collect(),
        ),
    }
}

/// Field `name` (one of [`FIELDS`]) of a put of `indexes` at `version`,
/// with 4 KiB blob rows.
pub fn field(name: &str, indexes: &[u64], version: u64) -> Field {
    let f = FIELDS
        .iter()
        .position(|n| *n == name)
        .expect("a known field");
    make_field(f, indexes, version, 4096)
}

/// Checks a returned cell of field `name` against (g, version), 4 KiB blob
/// rows: `None` if right, else what is wrong (stale, swapped, corrupt).
pub fn check(cell: &Cell, g: u64, name: &str, version: u64) -> Option<String> {
    let f = FIELDS
        .iter()
        .position(|n| *n == name)
        .expect("a known field");
    check_cell(cell, g, f, version, 4096)
}

/// Compares a returned cell with the expected (g, field, version); `None`
/// if equal, else what is wrong.
fn check_cell(got: &Cell, g: u64, field: usize, version: u64, blob_bytes: usize) -> Option<String> {
    let want = expected_cell(g, field, version, blob_bytes);
    match (got, &want) {
        (Cell::Tensor(a), Cell::Tensor(b)) => {
            let bytes = a.contiguous_bytes();
            if a.dtype() == b.dtype() && a.shape() == b.shape() && bytes == b.contiguous_bytes() {
                return None;
            }
            if bytes.len() < 16 {
                return Some(format!(
                    "corrupt: {} {:?} {} bytes",
                    a.dtype(),
                    a.shape(),
                    bytes.len()
                ));
            }
            let hg = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
            let tag = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
            let (hf, hv) = ((tag >> 56) as usize, tag & ((1 << 56) - 1));
            Some(if hg != g || hf != field {
                format!(
                    "swapped: holds g={hg} field={} v={hv}",
                    FIELDS.get(hf).unwrap_or(&"?")
                )
            } else if hv != version {
                format!("stale: holds v={hv}, want v={version}")
            } else {
                format!(
                    "corrupt: {} {:?} {} bytes, want {} {:?}",
                    a.dtype(),
                    a.shape(),
                    bytes.len(),
                    b.dtype(),
                    b.shape()
                )
            })
        }
        (Cell::Value(Value::Str(a)), Cell::Value(Value::Str(b))) => {
            if a == b {
                return None;
            }
            let mut words = a.split(' ');
            let (hg, hf, hv) = (words.next(), words.next(), words.next());
            Some(if hg != Some(&format!("g={g}")) || hf != Some("f=str") {
                format!("swapped: holds {a:?}")
            } else if hv != Some(&format!("v={version}")) {
                format!("stale: holds {a:?}, want v={version}")
            } else {
                format!("corrupt: {a:?}")
            })
        }
        (a, _) => Some(format!("wrong kind: {}", crate::data::describe(a))),
    }
}

// ---------------------------------------------------------------------------
// Sockets

/// One DEALER with one request in flight; replaced after any failure.
struct Conn {
    endpoint: String,
    prefix: String,
    n: u64,
    socket: Option<DealerSocket>,
}

impl Conn {
    fn new(endpoint: &str, prefix: String) -> Conn {
        Conn {
            endpoint: endpoint.to_string(),
            prefix,
            n: 0,
            socket: None,
        }
    }

    async fn request(
        &mut self,
        frames: Vec<Bytes>,
        timeout: Duration,
    ) -> Result<Vec<Bytes>, String> {
        let result = tokio::time::timeout(timeout, self.exchange(frames, timeout)).await;
        let result = match result {
            Ok(r) => r,
            Err(_) => Err(format!(
                "no reply from {} within {timeout:?}",
                self.endpoint
            )),
        };
        if result.is_err() {
            self.socket = None;
        }
        result
    }

    async fn exchange(
        &mut self,
        frames: Vec<Bytes>,
        timeout: Duration,
    ) -> Result<Vec<Bytes>, String> {
        if self.socket.is_none() {
            let mut options = SocketOptions::default();
            let identity = format!("{}_{}", self.prefix, self.n);
            self.n += 1;
            options.peer_identity(
                identity
                    .into_bytes()
                    .try_into()
                    .map_err(|e: zeromq::ZmqError| e.to_string())?,
            );
            options.connect_timeout(timeout);
            let mut socket = DealerSocket::with_options(options);
            socket
                .connect(&self.endpoint)
                .await
                .map_err(|e| format!("cannot connect to {}: {e}", self.endpoint))?;
            self.socket = Some(socket);
        }
        let socket = self.socket.as_mut().expect("connected");
        let message = ZmqMessage::try_from(frames).map_err(|e| e.to_string())?;
        socket
            .send(message)
            .await
            .map_err(|e| format!("send to {} failed: {e}", self.endpoint))?;
        let reply = socket
            .recv()
            .await
            .map_err(|e| format!("receive from {} failed: {e}", self.endpoint))?;
        Ok(reply.into_vec())
    }
}

fn frames_len(frames: &[Bytes]) -> u64 {
    frames.iter().map(|f| f.len() as u64).sum()
}

/// What a request came to, protocol aside.
#[derive(Debug)]
pub enum Outcome {
    /// put_ok / PUT_DATA_RESPONSE.
    Put,
    /// The fields in request order.
    Got(Vec<(String, Vec<Cell>)>),
    /// The `cleared` count (native) or `None` (TransferQueue).
    Cleared(Option<u64>),
    /// A missing key: the error text.
    KeyNotFound(String),
    /// Any other error reply: the error text.
    Error(String),
    /// No reply (timeout, connection): the reason.
    Transport(String),
}

/// A client speaking both protocols; every request waits for its reply.
pub struct DualClient {
    tq: Option<(Conn, String, String)>,
    native: Option<(Conn, u64)>,
    pub timeout: Duration,
    pub bytes_out: u64,
    pub bytes_in: u64,
    /// Largest request or reply, bytes.
    pub max_message: u64,
}

impl DualClient {
    /// A client of `target` (`tag` names its sockets' identities).
    pub fn new(target: &Target, tag: &str, timeout: Duration) -> DualClient {
        let tq = target.tq.as_ref().map(|u| {
            let sender = format!("TQ_STORAGE_load_{tag}_{:x}", std::process::id());
            (Conn::new(&u.endpoint, sender.clone()), sender, u.id.clone())
        });
        let native = target.native.as_ref().map(|e| {
            (
                Conn::new(e, format!("load_{tag}_{:x}", std::process::id())),
                1,
            )
        });
        DualClient {
            tq,
            native,
            timeout,
            bytes_out: 0,
            bytes_in: 0,
            max_message: 0,
        }
    }

    pub fn has(&self, p: Proto) -> bool {
        match p {
            Proto::Tq => self.tq.is_some(),
            Proto::Native => self.native.is_some(),
        }
    }

    async fn tq_call(&mut self, request: tq::Request) -> Outcome {
        let (conn, sender, unit) = self.tq.as_mut().expect("a TransferQueue endpoint");
        let frames = match tq::encode_request(sender, Some(unit), &request) {
            Ok(f) => f,
            Err(e) => return Outcome::Error(format!("cannot encode: {e}")),
        };
        self.bytes_out += frames_len(&frames);
        self.max_message = self.max_message.max(frames_len(&frames));
        let reply = match conn.request(frames, self.timeout).await {
            Ok(r) => r,
            Err(e) => return Outcome::Transport(e),
        };
        self.bytes_in += frames_len(&reply);
        self.max_message = self.max_message.max(frames_len(&reply));
        match tq::decode_reply(&reply) {
            Err(e) => Outcome::Error(format!("undecodable reply: {e}")),
            Ok((_, tq::Reply::PutData)) => Outcome::Put,
            Ok((_, tq::Reply::GetData { fields })) => Outcome::Got(fields),
            Ok((_, tq::Reply::ClearData { .. })) => Outcome::Cleared(None),
            Ok((_, tq::Reply::Error { kind, message })) => {
                if kind == tq::ErrorReply::Get
                    && message.starts_with(&format!("[{}]", tq::KEY_NOT_FOUND_MARKER))
                {
                    Outcome::KeyNotFound(message)
                } else {
                    Outcome::Error(format!("{}: {message}", kind.as_str()))
                }
            }
            Ok((_, other)) => Outcome::Error(format!("unexpected reply {}", other.request_type())),
        }
    }

    async fn native_call(&mut self, op: native::Op) -> Outcome {
        let (conn, next) = self.native.as_mut().expect("a native endpoint");
        let id = *next;
        *next += 1;
        let frames = match native::encode_request(&native::Request { id, op }) {
            Ok(f) => f,
            Err(e) => return Outcome::Error(format!("cannot encode: {e}")),
        };
        self.bytes_out += frames_len(&frames);
        self.max_message = self.max_message.max(frames_len(&frames));
        let reply = match conn.request(frames, self.timeout).await {
            Ok(r) => r,
            Err(e) => return Outcome::Transport(e),
        };
        self.bytes_in += frames_len(&reply);
        self.max_message = self.max_message.max(frames_len(&reply));
        match native::decode_reply(&reply, &native::Limits::default()) {
            Err(e) => Outcome::Error(format!("undecodable reply: {e}")),
            Ok((echoed, _)) if echoed != id => {
                Outcome::Error(format!("reply id {echoed} for request {id}"))
            }
            Ok((_, native::Reply::PutOk { .. })) => Outcome::Put,
            Ok((_, native::Reply::GetOk { fields })) => Outcome::Got(
                fields
                    .into_iter()
                    .map(|(n, f)| (n, f.into_cells()))
                    .collect(),
            ),
            Ok((_, native::Reply::ClearOk { cleared })) => Outcome::Cleared(Some(cleared)),
            Ok((_, native::Reply::Error { code, message }))
                if code == native::code::KEY_NOT_FOUND =>
            {
                Outcome::KeyNotFound(format!("{code}: {message}"))
            }
            Ok((_, native::Reply::Error { code, message })) => {
                Outcome::Error(format!("{code}: {message}"))
            }
            Ok((_, other)) => Outcome::Error(format!("unexpected reply {}", other.name())),
        }
    }

    pub async fn put(
        &mut self,
        p: Proto,
        indexes: &[u64],
        fields: Vec<(String, Field)>,
    ) -> Outcome {
        match p {
            Proto::Tq => {
                self.tq_call(tq::Request::Put {
                    global_indexes: indexes.to_vec(),
                    fields,
                })
                .await
            }
            Proto::Native => {
                let mut wire = Vec::with_capacity(fields.len());
                for (n, f) in &fields {
                    match WireField::from_field(f) {
                        Ok(w) => wire.push((n.as_str().into(), w)),
                        Err(e) => return Outcome::Error(format!("cannot encode {n}: {e}")),
                    }
                }
                self.native_call(native::Op::Put {
                    global_indexes: indexes.to_vec(),
                    fields: wire,
                })
                .await
            }
        }
    }

    pub async fn get(&mut self, p: Proto, indexes: &[u64], fields: &[String]) -> Outcome {
        let (global_indexes, fields) = (indexes.to_vec(), fields.to_vec());
        match p {
            Proto::Tq => {
                self.tq_call(tq::Request::Get {
                    global_indexes,
                    fields,
                })
                .await
            }
            Proto::Native => {
                self.native_call(native::Op::Get {
                    global_indexes: global_indexes.into(),
                    fields,
                })
                .await
            }
        }
    }

    /// Clears `indexes` (only `fields`, native only).
    pub async fn clear(
        &mut self,
        p: Proto,
        indexes: &[u64],
        fields: Option<Vec<String>>,
    ) -> Outcome {
        match p {
            Proto::Tq => {
                assert!(fields.is_none(), "TransferQueue clears whole indexes");
                self.tq_call(tq::Request::Clear {
                    global_indexes: indexes.to_vec(),
                })
                .await
            }
            Proto::Native => {
                self.native_call(native::Op::Clear {
                    global_indexes: indexes.to_vec(),
                    fields,
                })
                .await
            }
        }
    }

    /// The native `stats`, as (name, integer) pairs.
    pub async fn stats(&mut self) -> Result<Vec<(String, i64)>, String> {
        let (conn, next) = self.native.as_mut().ok_or("no native endpoint")?;
        let id = *next;
        *next += 1;
        let frames = native::encode_request(&native::Request {
            id,
            op: native::Op::Stats,
        })
        .map_err(|e| e.to_string())?;
        let reply = conn.request(frames, self.timeout).await?;
        match native::decode_reply(&reply, &native::Limits::default()) {
            Ok((_, native::Reply::StatsOk(s))) => Ok(s
                .into_iter()
                .filter_map(|(k, v)| {
                    if let native::Stat::Int(i) = v {
                        Some((k, i))
                    } else {
                        None
                    }
                })
                .collect()),
            other => Err(format!("stats failed: {other:?}")),
        }
    }
}

/// A protocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Proto {
    Tq,
    Native,
}

// ---------------------------------------------------------------------------
// The model and one client's loop

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Absent,
    Present(u64),
    /// A put or clear whose outcome is not known (no reply).
    Unknown,
}

/// xorshift64*.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(mix(seed.wrapping_add(0x2545_f491_4f6c_dd1d)) | 1)
    }
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    /// `k` distinct values of `pool` (all of them if fewer).
    fn sample(&mut self, pool: &[u64], k: usize) -> Vec<u64> {
        let mut pool = pool.to_vec();
        let k = k.min(pool.len());
        for i in 0..k {
            let j = i + self.below((pool.len() - i) as u64) as usize;
            pool.swap(i, j);
        }
        pool.truncate(k);
        pool
    }
}

/// Op kinds in the report.
pub const OPS: [&str; 4] = ["put", "get", "get_miss", "clear"];

/// Latencies and counts of one op kind.
#[derive(Clone, Debug, Default)]
pub struct OpStats {
    pub count: u64,
    pub rows: u64,
    /// Latencies in microseconds.
    pub latencies_us: Vec<u32>,
}

impl OpStats {
    fn add(&mut self, rows: usize, took: Duration) {
        self.count += 1;
        self.rows += rows as u64;
        self.latencies_us
            .push(took.as_micros().min(u32::MAX as u128) as u32);
    }
    /// The `q` quantile (0..=1) in microseconds, from sorted latencies.
    pub fn quantile_us(&self, q: f64) -> u32 {
        if self.latencies_us.is_empty() {
            return 0;
        }
        let i = ((self.latencies_us.len() - 1) as f64 * q).round() as usize;
        self.latencies_us[i]
    }
}

/// What went wrong, with enough detail to find it.
#[derive(Clone, Debug)]
pub struct Finding {
    pub client: usize,
    pub op: &'static str,
    pub proto: Proto,
    pub detail: String,
}

struct Tally {
    ops: [OpStats; 4],
    per_proto: [u64; 2],
    mismatches: Vec<Finding>,
    errors: Vec<Finding>,
}

struct ClientResult {
    ops: [OpStats; 4],
    per_proto: [u64; 2],
    mismatches: Vec<Finding>,
    errors: Vec<Finding>,
    model: Vec<[State; 4]>,
    client: DualClient,
}

struct Ctx {
    opts: Options,
    stop: AtomicBool,
}

/// One client: random ops until `stop`, then returns its model.
async fn client_loop(ctx: Arc<Ctx>, c: usize, mut client: DualClient) -> ClientResult {
    let o = &ctx.opts;
    let mut rng = Rng::new(o.seed.wrapping_mul(1000).wrapping_add(c as u64));
    let base = o.index_base + c as u64 * o.keys_per_client;
    let keys: Vec<u64> = (base..base + o.keys_per_client).collect();
    let mut model = vec![[State::Absent; 4]; o.keys_per_client as usize];
    let mut version = 0u64;
    let mut r = Tally {
        ops: Default::default(),
        per_proto: [0; 2],
        mismatches: vec![],
        errors: vec![],
    };
    let protos: Vec<Proto> = [Proto::Tq, Proto::Native]
        .into_iter()
        .filter(|p| client.has(*p))
        .collect();
    while !ctx.stop.load(Ordering::Relaxed) {
        let proto = protos[rng.below(protos.len() as u64) as usize];
        r.per_proto[proto as usize] += 1;
        let n = 1 + rng.below(o.max_batch as u64) as usize;
        let roll = rng.below(100);
        if roll < 45 {
            // put
            let indexes = rng.sample(&keys, n);
            let mut fields: Vec<usize> = (0..4).filter(|_| rng.chance(50)).collect();
            if fields.is_empty() {
                fields.push(rng.below(4) as usize);
            }
            version += 1;
            let batch: Vec<(String, Field)> = fields
                .iter()
                .map(|&f| {
                    (
                        FIELDS[f].to_string(),
                        make_field(f, &indexes, version, o.blob_bytes),
                    )
                })
                .collect();
            let t = Instant::now();
            let outcome = client.put(proto, &indexes, batch).await;
            let took = t.elapsed();
            let set = |model: &mut Vec<[State; 4]>, s: State| {
                for g in &indexes {
                    for &f in &fields {
                        model[(g - base) as usize][f] = s;
                    }
                }
            };
            match outcome {
                Outcome::Put => {
                    r.ops[0].add(n, took);
                    set(&mut model, State::Present(version));
                }
                other => {
                    r.errors.push(Finding {
                        client: c,
                        op: "put",
                        proto,
                        detail: format!("{other:?}"),
                    });
                    set(&mut model, State::Unknown);
                }
            }
        } else if roll < 85 {
            // get
            let mut fields: Vec<usize> = (0..4).filter(|_| rng.chance(40)).collect();
            if fields.is_empty() {
                fields.push(rng.below(4) as usize);
            }
            let known = |g: &u64| {
                fields
                    .iter()
                    .all(|&f| model[(g - base) as usize][f] != State::Unknown)
            };
            let present: Vec<u64> = keys
                .iter()
                .copied()
                .filter(|g| {
                    fields
                        .iter()
                        .all(|&f| matches!(model[(g - base) as usize][f], State::Present(_)))
                })
                .collect();
            let indexes = if rng.chance(80) && !present.is_empty() {
                rng.sample(&present, n)
            } else {
                let pool: Vec<u64> = keys.iter().copied().filter(known).collect();
                rng.sample(&pool, n)
            };
            if indexes.is_empty() {
                continue;
            }
            let expect_hit = indexes.iter().all(|g| {
                fields
                    .iter()
                    .all(|&f| matches!(model[(g - base) as usize][f], State::Present(_)))
            });
            let names: Vec<String> = fields.iter().map(|&f| FIELDS[f].to_string()).collect();
            let t = Instant::now();
            let outcome = client.get(proto, &indexes, &names).await;
            let took = t.elapsed();
            let finding = |detail: String| Finding {
                client: c,
                op: "get",
                proto,
                detail,
            };
            match (outcome, expect_hit) {
                (Outcome::Got(got), true) => {
                    r.ops[1].add(n, took);
                    if got.len() != fields.len() {
                        r.mismatches.push(finding(format!(
                            "{} fields for {} asked",
                            got.len(),
                            fields.len()
                        )));
                        continue;
                    }
                    for ((name, cells), &f) in got.iter().zip(&fields) {
                        if name != FIELDS[f] || cells.len() != indexes.len() {
                            r.mismatches.push(finding(format!(
                                "field {name} with {} rows where {} with {} rows was asked",
                                cells.len(),
                                FIELDS[f],
                                indexes.len()
                            )));
                            continue;
                        }
                        for (cell, g) in cells.iter().zip(&indexes) {
                            let State::Present(v) = model[(g - base) as usize][f] else {
                                unreachable!()
                            };
                            if let Some(why) = check_cell(cell, *g, f, v, o.blob_bytes) {
                                r.mismatches
                                    .push(finding(format!("g={g} field={}: {why}", FIELDS[f])));
                            }
                        }
                    }
                }
                (Outcome::KeyNotFound(_), false) => r.ops[2].add(n, took),
                (Outcome::Got(_), false) => {
                    let absent: Vec<String> = indexes
                        .iter()
                        .flat_map(|g| fields.iter().map(move |&f| (*g, f)))
                        .filter(|(g, f)| model[(g - base) as usize][*f] == State::Absent)
                        .map(|(g, f)| format!("({g}, {})", FIELDS[f]))
                        .take(4)
                        .collect();
                    r.mismatches.push(finding(format!(
                        "ghost: got rows for absent keys {}",
                        absent.join(" ")
                    )));
                }
                (Outcome::KeyNotFound(msg), true) => {
                    r.mismatches.push(finding(format!(
                        "lost: key not found although every key was put: {msg}"
                    )));
                }
                (other, _) => r.errors.push(finding(format!("{other:?}"))),
            }
        } else {
            // clear
            let indexes = rng.sample(&keys, n);
            let fields: Option<Vec<usize>> =
                if proto == Proto::Native && o.field_clears && rng.chance(50) {
                    let mut f: Vec<usize> = (0..4).filter(|_| rng.chance(50)).collect();
                    if f.is_empty() {
                        f.push(rng.below(4) as usize);
                    }
                    Some(f)
                } else {
                    None
                };
            let affected: Vec<(u64, usize)> = indexes
                .iter()
                .flat_map(|g| {
                    let fs: Vec<usize> = fields.clone().unwrap_or_else(|| (0..4).collect());
                    fs.into_iter().map(move |f| (*g, f))
                })
                .collect();
            let unknown = affected
                .iter()
                .any(|(g, f)| model[(g - base) as usize][*f] == State::Unknown);
            let expected = affected
                .iter()
                .filter(|(g, f)| matches!(model[(g - base) as usize][*f], State::Present(_)))
                .count();
            let names = fields
                .as_ref()
                .map(|fs| fs.iter().map(|&f| FIELDS[f].to_string()).collect());
            let t = Instant::now();
            let outcome = client.clear(proto, &indexes, names).await;
            let took = t.elapsed();
            match outcome {
                Outcome::Cleared(count) => {
                    r.ops[3].add(n, took);
                    if let Some(count) = count
                        && o.exact_clear_counts
                        && !unknown
                        && count != expected as u64
                    {
                        r.mismatches.push(Finding {
                            client: c,
                            op: "clear",
                            proto,
                            detail: format!("cleared {count} values, the model held {expected}"),
                        });
                    }
                    for (g, f) in affected {
                        model[(g - base) as usize][f] = State::Absent;
                    }
                }
                other => {
                    r.errors.push(Finding {
                        client: c,
                        op: "clear",
                        proto,
                        detail: format!("{other:?}"),
                    });
                    for (g, f) in affected {
                        model[(g - base) as usize][f] = State::Unknown;
                    }
                }
            }
        }
    }
    ClientResult {
        ops: r.ops,
        per_proto: r.per_proto,
        mismatches: r.mismatches,
        errors: r.errors,
        model,
        client,
    }
}

/// Reads every key of the model back (absent keys must be reported
/// absent), then clears every key; returns (mismatches, errors).
async fn final_pass(o: &Options, c: usize, r: &mut ClientResult) {
    let base = o.index_base + c as u64 * o.keys_per_client;
    let protos: Vec<Proto> = [Proto::Native, Proto::Tq]
        .into_iter()
        .filter(|p| r.client.has(*p))
        .collect();
    let proto = protos[c % protos.len()];
    let chunk = o.max_batch.max(1);
    for (f, field) in FIELDS.iter().enumerate() {
        let names = vec![field.to_string()];
        let present: Vec<(u64, u64)> = (0..o.keys_per_client)
            .filter_map(|k| match r.model[k as usize][f] {
                State::Present(v) => Some((base + k, v)),
                _ => None,
            })
            .collect();
        for part in present.chunks(chunk) {
            let indexes: Vec<u64> = part.iter().map(|(g, _)| *g).collect();
            match r.client.get(proto, &indexes, &names).await {
                Outcome::Got(got) if got.len() == 1 && got[0].1.len() == part.len() => {
                    for (cell, (g, v)) in got[0].1.iter().zip(part) {
                        if let Some(why) = check_cell(cell, *g, f, *v, o.blob_bytes) {
                            r.mismatches.push(Finding {
                                client: c,
                                op: "final get",
                                proto,
                                detail: format!("g={g} field={}: {why}", FIELDS[f]),
                            });
                        }
                    }
                }
                Outcome::KeyNotFound(msg) => r.mismatches.push(Finding {
                    client: c,
                    op: "final get",
                    proto,
                    detail: format!("lost: {msg}"),
                }),
                other => r.errors.push(Finding {
                    client: c,
                    op: "final get",
                    proto,
                    detail: format!("{other:?}"),
                }),
            }
        }
        // Absent keys, one at a time for a sample (a whole-batch miss only
        // says that one of them is missing).
        let absent: Vec<u64> = (0..o.keys_per_client)
            .filter(|k| r.model[*k as usize][f] == State::Absent)
            .map(|k| base + k)
            .take(8)
            .collect();
        for g in absent {
            match r.client.get(proto, &[g], &names).await {
                Outcome::KeyNotFound(_) => {}
                Outcome::Got(_) => r.mismatches.push(Finding {
                    client: c,
                    op: "final get",
                    proto,
                    detail: format!(
                        "ghost: g={g} field={} was cleared but is returned",
                        FIELDS[f]
                    ),
                }),
                other => r.errors.push(Finding {
                    client: c,
                    op: "final get",
                    proto,
                    detail: format!("{other:?}"),
                }),
            }
        }
    }
    let all: Vec<u64> = (base..base + o.keys_per_client).collect();
    for part in all.chunks(256) {
        if let Outcome::Cleared(_) = r.client.clear(proto, part, None).await {
            continue;
        }
        r.errors.push(Finding {
            client: c,
            op: "final clear",
            proto,
            detail: "final clear failed".into(),
        });
    }
}

// ---------------------------------------------------------------------------
// Memory

/// `VmRSS` of `pid` in bytes.
pub fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Resident memory of `stowd` over the run.
#[derive(Clone, Copy, Debug, Default)]
pub struct Memory {
    /// After the warm-up (every client connected, one small batch put,
    /// read and cleared by each over each protocol).
    pub baseline: u64,
    /// Highest reading during the run (sampled every 50 ms).
    pub peak: u64,
    /// After the final clear (lowest reading within the settle time).
    pub after_clear: u64,
    /// After the clients disconnected, with a put and clear of one row each
    /// second (lowest reading within 12 s: longer than the 10 s an idle
    /// thread of tokio's blocking pool lives, with its stack).
    pub after_disconnect: u64,
    /// Row bytes stored at the end of the random phase (`stats.bytes`).
    pub stored_at_end: u64,
    /// Client connections (sockets) open during the run.
    pub connections: u64,
    /// Largest request or reply of the run, bytes.
    pub max_message: u64,
}

/// Slack for what the allocator cannot give back: partly used pages,
/// tokio bookkeeping, the units' (emptied) hash tables, idle threads of
/// tokio's blocking pool (they exit after 10 s), frees that land after
/// `stowd`'s last trim. Measured after a 15 s run of 64 clients: +18 MiB
/// once disconnected; 24 MiB leaves room for a slow CI machine without
/// hiding a leak of the stored bytes (46 MiB of rows at the end of that
/// run, 250 MiB resident at peak).
pub const RSS_SLACK: u64 = 24 << 20;

/// The allowed excess of `after_clear` over `baseline`, clients still
/// connected: [`RSS_SLACK`] plus, per connection, a read and a write buffer
/// of up to twice the largest message. A generous bound: `stowd`'s
/// transport keeps at most a 64 KiB read buffer per idle connection
/// (measured +29 MiB connected after a 15 s run).
pub fn rss_tolerance(m: &Memory) -> u64 {
    RSS_SLACK + m.connections * 4 * m.max_message
}

/// Config for a `stowd` under load: memory kept for reuse (the receive
/// pool) goes back after 3 s unused instead of 30 s, so the
/// after-disconnect reading (12 s) sees whether it really goes back.
/// The run's clients are the zeromq crate's DEALERs, an independent ZMTP
/// implementation that speaks NULL only: the native endpoint takes them
/// without a token.
pub const REUSE_CONFIG: &str =
    "[limits]\nreceive_pool_idle_secs = 3\n\n[security]\nauth = \"none\"\n";

/// The allowed excess of `after_disconnect` over `baseline`: [`RSS_SLACK`].
pub fn rss_tolerance_disconnected(_m: &Memory) -> u64 {
    RSS_SLACK
}

// ---------------------------------------------------------------------------
// The run

/// Everything measured.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub clients: usize,
    pub elapsed: Duration,
    pub ops: Vec<(&'static str, OpStats)>,
    /// Requests per protocol (TransferQueue, native).
    pub per_proto: [u64; 2],
    pub bytes_out: u64,
    pub bytes_in: u64,
    pub mismatches: Vec<Finding>,
    pub mismatch_count: usize,
    pub errors: Vec<Finding>,
    pub error_count: usize,
    pub memory: Option<Memory>,
    /// `stats` after the final clear: (keys, rows, bytes).
    pub after_clear_stats: Option<(i64, i64, i64)>,
}

impl Report {
    pub fn op(&self, name: &str) -> &OpStats {
        &self
            .ops
            .iter()
            .find(|(n, _)| *n == name)
            .expect("known op")
            .1
    }

    /// `after_clear <= baseline + tolerance` and `after_disconnect <=
    /// baseline + tolerance_disconnected`.
    pub fn rss_ok(&self) -> Option<bool> {
        self.memory.map(|m| {
            m.after_clear <= m.baseline + rss_tolerance(&m)
                && m.after_disconnect <= m.baseline + rss_tolerance_disconnected(&m)
        })
    }

    /// The printed table.
    pub fn table(&self) -> String {
        let secs = self.elapsed.as_secs_f64().max(1e-9);
        let mut s = String::new();
        let _ = writeln!(s, "stowload: {} clients, {:.1} s", self.clients, secs);
        let _ = writeln!(
            s,
            "{:<9} {:>9} {:>9} {:>10} {:>9} {:>9} {:>9} {:>9}",
            "op", "count", "ops/s", "rows", "p50 ms", "p90 ms", "p99 ms", "max ms"
        );
        let ms = |us: u32| us as f64 / 1000.0;
        let mut total = 0;
        for (name, st) in &self.ops {
            total += st.count;
            let _ = writeln!(
                s,
                "{:<9} {:>9} {:>9.1} {:>10} {:>9.2} {:>9.2} {:>9.2} {:>9.2}",
                name,
                st.count,
                st.count as f64 / secs,
                st.rows,
                ms(st.quantile_us(0.5)),
                ms(st.quantile_us(0.9)),
                ms(st.quantile_us(0.99)),
                ms(st.quantile_us(1.0))
            );
        }
        let _ = writeln!(s, "{:<9} {:>9} {:>9.1}", "all", total, total as f64 / secs);
        let _ = writeln!(
            s,
            "requests by protocol: transferqueue {}, stowage/1 {}",
            self.per_proto[0], self.per_proto[1]
        );
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let _ = writeln!(
            s,
            "bytes: sent {:.1} MiB, received {:.1} MiB ({:.1} MiB/s both ways)",
            mib(self.bytes_out),
            mib(self.bytes_in),
            mib(self.bytes_out + self.bytes_in) / secs
        );
        let _ = writeln!(s, "mismatches: {}", self.mismatch_count);
        for m in self.mismatches.iter().take(10) {
            let _ = writeln!(
                s,
                "  client {} {} {:?}: {}",
                m.client, m.op, m.proto, m.detail
            );
        }
        let _ = writeln!(s, "unexpected errors: {}", self.error_count);
        for m in self.errors.iter().take(10) {
            let _ = writeln!(
                s,
                "  client {} {} {:?}: {}",
                m.client, m.op, m.proto, m.detail
            );
        }
        if let Some((k, r, b)) = self.after_clear_stats {
            let _ = writeln!(
                s,
                "stats after the final clear: keys {k}, rows {r}, bytes {b}"
            );
        }
        if let Some(m) = self.memory {
            let delta = |v: u64| (v as f64 - m.baseline as f64) / (1 << 20) as f64;
            let _ = writeln!(
                s,
                "stowd RSS: baseline {:.1} MiB, peak {:.1} MiB (row bytes stored at the end {:.1} MiB)",
                mib(m.baseline),
                mib(m.peak),
                mib(m.stored_at_end),
            );
            let _ = writeln!(
                s,
                "  after the final clear {:.1} MiB ({:+.1} MiB; tolerance {:.1} MiB = {:.0} MiB slack + {} connections x 4 x {:.0} KiB largest message)",
                mib(m.after_clear),
                delta(m.after_clear),
                mib(rss_tolerance(&m)),
                mib(RSS_SLACK),
                m.connections,
                m.max_message as f64 / 1024.0,
            );
            let _ = writeln!(
                s,
                "  after the clients disconnected {:.1} MiB ({:+.1} MiB; tolerance {:.1} MiB): {}",
                mib(m.after_disconnect),
                delta(m.after_disconnect),
                mib(rss_tolerance_disconnected(&m)),
                if self.rss_ok() == Some(true) {
                    "ok"
                } else {
                    "NOT BACK TO BASELINE"
                }
            );
        }
        s
    }
}

/// Runs the load against `target` and reports.
pub async fn run(target: &Target, opts: &Options) -> Report {
    assert!(opts.blob_bytes >= 16, "blob rows carry a 16-byte header");
    assert!(
        target.tq.is_some() || target.native.is_some(),
        "no endpoint to load"
    );
    let mut clients: Vec<DualClient> = (0..opts.clients)
        .map(|c| DualClient::new(target, &format!("c{c}"), opts.timeout))
        .collect();

    // Warm-up: every socket connected, every path taken once, nothing left.
    let warm_base = opts.index_base + opts.clients as u64 * opts.keys_per_client;
    let warm = clients
        .iter_mut()
        .enumerate()
        .map(|(c, client)| async move {
            let g = [warm_base + c as u64 * 2, warm_base + c as u64 * 2 + 1];
            let mut failures = vec![];
            for p in [Proto::Tq, Proto::Native] {
                if !client.has(p) {
                    continue;
                }
                let fields: Vec<(String, Field)> = (0..4)
                    .map(|f| (FIELDS[f].to_string(), make_field(f, &g, 0, opts.blob_bytes)))
                    .collect();
                let names: Vec<String> = FIELDS.iter().map(|s| s.to_string()).collect();
                if !matches!(client.put(p, &g, fields).await, Outcome::Put) {
                    failures.push(format!("warm-up put {p:?}"));
                }
                if !matches!(client.get(p, &g, &names).await, Outcome::Got(_)) {
                    failures.push(format!("warm-up get {p:?}"));
                }
                if !matches!(client.clear(p, &g, None).await, Outcome::Cleared(_)) {
                    failures.push(format!("warm-up clear {p:?}"));
                }
            }
            failures
        });
    let failures: Vec<String> = join_all(warm).await.into_iter().flatten().collect();
    assert!(failures.is_empty(), "warm-up failed: {failures:?}");
    let mut stats_client = DualClient::new(target, "stats", opts.timeout);

    // Baseline, then a sampler for the peak.
    let mut memory = None;
    let mut sampler = None;
    if let Some(pid) = target.pid {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let baseline = rss_bytes(pid).unwrap_or(0);
        memory = Some(Memory {
            baseline,
            peak: baseline,
            ..Memory::default()
        });
        let peak = Arc::new(AtomicU64::new(baseline));
        let done = Arc::new(AtomicBool::new(false));
        let (p, d) = (peak.clone(), done.clone());
        let handle = tokio::spawn(async move {
            while !d.load(Ordering::Relaxed) {
                if let Some(r) = rss_bytes(pid) {
                    p.fetch_max(r, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        sampler = Some((pid, peak, done, handle));
    }

    // The random phase; then, with every client stopped, the stored bytes;
    // then each client's final pass (read back, clear everything).
    let ctx = Arc::new(Ctx {
        opts: opts.clone(),
        stop: AtomicBool::new(false),
    });
    let stopped = Arc::new(tokio::sync::Barrier::new(opts.clients + 1));
    let resume = Arc::new(tokio::sync::Barrier::new(opts.clients + 1));
    let started = Instant::now();
    let handles: Vec<_> = clients
        .into_iter()
        .enumerate()
        .map(|(c, client)| {
            let (ctx, stopped, resume) = (ctx.clone(), stopped.clone(), resume.clone());
            tokio::spawn(async move {
                let mut r = client_loop(ctx.clone(), c, client).await;
                stopped.wait().await;
                resume.wait().await;
                final_pass(&ctx.opts, c, &mut r).await;
                r
            })
        })
        .collect();
    tokio::time::sleep(opts.duration).await;
    ctx.stop.store(true, Ordering::Relaxed);
    stopped.wait().await;
    let elapsed = started.elapsed();
    let stored_at_end = match stats_client.stats().await {
        Ok(s) => s
            .iter()
            .find(|(k, _)| k == "bytes")
            .map(|(_, v)| *v as u64)
            .unwrap_or(0),
        Err(_) => 0,
    };
    resume.wait().await;
    let mut results: Vec<ClientResult> = Vec::with_capacity(handles.len());
    for h in handles {
        results.push(h.await.expect("a client task panicked"));
    }

    let after_clear_stats = match stats_client.stats().await {
        Ok(s) => {
            let get = |k: &str| {
                s.iter()
                    .find(|(n, _)| n == k)
                    .map(|(_, v)| *v)
                    .unwrap_or(-1)
            };
            Some((get("keys"), get("rows"), get("bytes")))
        }
        Err(_) => None,
    };

    if let (Some((pid, peak, done, handle)), Some(m)) = (sampler, memory.as_mut()) {
        done.store(true, Ordering::Relaxed);
        let _ = handle.await;
        m.peak = peak.load(Ordering::Relaxed);
        m.stored_at_end = stored_at_end;
        // Freed memory goes back to the OS as the allocator trims: take the
        // lowest reading within 4 s (or the first one within tolerance).
        let mut low = u64::MAX;
        let settle = Instant::now();
        while settle.elapsed() < Duration::from_secs(4) {
            if let Some(r) = rss_bytes(pid) {
                low = low.min(r);
                m.peak = m.peak.max(r);
            }
            if low <= m.baseline + rss_tolerance(m) && settle.elapsed() > Duration::from_millis(500)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        m.after_clear = low;
    }

    // Disconnect every client; then one put and clear from a fresh client
    // (stowd gives freed memory back after clears) and the lowest reading.
    let connections = results
        .iter()
        .map(|r| r.client.tq.is_some() as u64 + r.client.native.is_some() as u64)
        .sum::<u64>()
        + 1;
    let max_message = results
        .iter()
        .map(|r| r.client.max_message)
        .max()
        .unwrap_or(0);
    let (mut bytes_out, mut bytes_in) = (0, 0);
    for r in &mut results {
        bytes_out += r.client.bytes_out;
        bytes_in += r.client.bytes_in;
        r.client.tq = None;
        r.client.native = None;
    }
    drop(stats_client);
    if let (Some(pid), Some(m)) = (target.pid, memory.as_mut()) {
        m.connections = connections;
        m.max_message = max_message;
        // stowd tears the connections down (and frees their buffers) over
        // the next seconds; a put and clear of one row each second from a
        // fresh client (light use goes on) has it give the memory back.
        let mut last = DualClient::new(target, "last", opts.timeout);
        let p = if last.has(Proto::Native) {
            Proto::Native
        } else {
            Proto::Tq
        };
        let g = [opts.index_base
            + opts.clients as u64 * opts.keys_per_client
            + 2 * opts.clients as u64];
        let mut low = u64::MAX;
        let settle = Instant::now();
        let mut next_touch = settle + Duration::from_secs(1);
        while settle.elapsed() < Duration::from_secs(12) {
            if Instant::now() >= next_touch {
                let _ = last
                    .put(
                        p,
                        &g,
                        vec![(
                            FIELDS[BLOB].to_string(),
                            make_field(BLOB, &g, 0, opts.blob_bytes),
                        )],
                    )
                    .await;
                let _ = last.clear(p, &g, None).await;
                next_touch += Duration::from_secs(1);
            }
            if let Some(r) = rss_bytes(pid) {
                low = low.min(r);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        m.after_disconnect = low;
    }

    let mut report = Report {
        clients: opts.clients,
        elapsed,
        memory,
        after_clear_stats,
        bytes_out,
        bytes_in,
        ..Report::default()
    };
    let mut ops: [OpStats; 4] = Default::default();
    for r in results {
        for (i, st) in r.ops.into_iter().enumerate() {
            ops[i].count += st.count;
            ops[i].rows += st.rows;
            ops[i].latencies_us.extend(st.latencies_us);
        }
        report.per_proto[0] += r.per_proto[0];
        report.per_proto[1] += r.per_proto[1];
        report.mismatch_count += r.mismatches.len();
        report.error_count += r.errors.len();
        report.mismatches.extend(r.mismatches.into_iter().take(20));
        report.errors.extend(r.errors.into_iter().take(20));
    }
    for (i, mut st) in ops.into_iter().enumerate() {
        st.latencies_us.sort_unstable();
        report.ops.push((OPS[i], st));
    }
    report
}

/// Runs futures concurrently on this task and collects their outputs.
pub async fn join_all<F: std::future::Future>(
    futures: impl IntoIterator<Item = F>,
) -> Vec<F::Output> {
    let mut set: Vec<std::pin::Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = (0..set.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in set.iter_mut().enumerate() {
            if out[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter()
        .map(|o| o.expect("every future finished"))
        .collect()
}

/// Counts of findings by their first word (lost, ghost, stale, ...).
pub fn classify(findings: &[Finding]) -> HashMap<String, usize> {
    let mut out = HashMap::new();
    for f in findings {
        let word = f
            .detail
            .split([':', ' '])
            .find(|w| !w.is_empty() && !w.starts_with("g=") && !w.starts_with("field="))
            .unwrap_or("?");
        *out.entry(word.to_string()).or_insert(0) += 1;
    }
    out
}
