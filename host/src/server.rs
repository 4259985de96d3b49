//! The `stowd` sidecar: units, the router endpoint and the native endpoint
//! on ZeroMQ sockets.
//!
//! [`start`] builds everything from a [`Config`]: loads the plugins, makes
//! the local units, binds one TransferQueue ROUTER per unit, one router-mode
//! TransferQueue endpoint fanning out to the configured units, and the
//! native `stowage/1` endpoint, watches the plugin directory (hot reload,
//! [`crate::reload`]) and serves `/metrics` if configured
//! ([`crate::metrics`]). It returns a [`Running`] handle with the resolved
//! endpoints and a shutdown method.

use std::path::Path;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::Serialize;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::batch::{Cell, Field};
use crate::config::Config;
use crate::manager::{Manager, ManagerError, Target, process_rss_bytes};
use crate::metrics::{Metrics, Outcome, Protocol};
use crate::plan::{Frame, PackLimits, PieceInfo};
use crate::shm::{SegmentStore, ShmError};
use crate::spans::{self, Spans};
use crate::tensor::Tensor;
use crate::policy::registry::Registry;
use crate::store::{StoreError, Unit};
use crate::transport::{self, BoxFuture, Peer, Service};
use crate::wire::native;
use crate::wire::tq;

/// Identities a TransferQueue unit answers; others are dropped silently,
/// as the real unit does.
pub const TQ_IDENTITY_PREFIXES: [&[u8]; 2] = [b"TQ_STORAGE_", b"metrics_collector_"];

/// One served unit in the endpoints file.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct UnitEndpoint {
    pub id: String,
    pub endpoint: String,
}

/// Everything `stowd` serves, as written to `--endpoints-file`.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Endpoints {
    /// Process id of the server.
    pub pid: u32,
    /// Local units, each a TransferQueue storage-unit endpoint.
    pub units: Vec<UnitEndpoint>,
    /// The router-mode TransferQueue endpoint, if enabled.
    pub router: Option<UnitEndpoint>,
    /// The native `stowage/1` endpoint.
    pub native: String,
    /// Loaded policy plugins (`name@version`).
    pub plugins: Vec<String>,
    /// Shared-memory directory for same-node clients, if enabled.
    pub shm_dir: Option<String>,
    /// The Prometheus endpoint (`http://host:port/metrics`), if enabled.
    #[serde(default)]
    pub metrics: Option<String>,
}

impl Endpoints {
    /// Writes the file atomically (temp file + rename).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(self).map_err(std::io::Error::other)?)?;
        std::fs::rename(tmp, path)
    }
}

/// A running server.
pub struct Running {
    pub endpoints: Endpoints,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Running {
    /// Stops every socket loop and waits for them.
    pub async fn shutdown_and_wait(self) {
        let _ = self.shutdown.send(true);
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// Request arrivals by op, in first-arrival order (TransferQueue's
/// `arrivals_by_op`).
#[derive(Debug, Default)]
struct Arrivals(Mutex<Vec<(String, u64)>>);

impl Arrivals {
    fn note(&self, op: &str) {
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match v.iter_mut().find(|(n, _)| n == op) {
            Some((_, c)) => *c += 1,
            None => v.push((op.to_string(), 1)),
        }
    }
    /// A `METRICS_RESPONSE` with these arrivals (no SSD offload here) and
    /// `extra` keys after TransferQueue's.
    fn metrics(&self, unit_id: &str, capacity: Option<u64>, active_keys: u64, extra: Vec<(String, Bytes)>) -> tq::Reply {
        let arrivals_by_op = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        tq::Reply::Metrics(tq::Metrics {
            storage_unit_id: unit_id.to_string(),
            capacity,
            active_keys,
            process_rss_bytes: process_rss_bytes(),
            ssd_offload_enabled: false,
            ssd_active_values: 0,
            ssd_active_bytes: 0,
            ssd_fallback_values_total: 0,
            requests_arrived: arrivals_by_op.iter().map(|(_, c)| c).sum(),
            arrivals_by_op,
            extra,
        })
    }
}

fn tq_identity_allowed(identity: &[u8]) -> bool {
    TQ_IDENTITY_PREFIXES.iter().any(|p| identity.starts_with(p))
}

/// Cells of a decoded field, one per row, without copying.
fn field_cells(field: Field) -> Result<Vec<Cell>, String> {
    Ok(match field {
        Field::Regular(t) => (0..t.rows()).map(|i| t.row_tensor(i).map(Cell::Tensor)).collect::<Result<_, _>>().map_err(|e| e.to_string())?,
        Field::Nested(rows) => rows.into_iter().map(Cell::Tensor).collect(),
        Field::Values(v) => v.into_iter().map(Cell::Value).collect(),
    })
}

/// The op label of a TransferQueue request, for metrics.
fn tq_op(request: &tq::Request) -> &'static str {
    match request {
        tq::Request::Put { .. } => "put",
        tq::Request::Get { .. } => "get",
        tq::Request::Clear { .. } => "clear",
        tq::Request::GetMetrics => "metrics",
        tq::Request::Other(_) => "other",
    }
}

fn tq_outcome(reply: &tq::Reply) -> Outcome {
    if matches!(reply, tq::Reply::Error { .. }) { Outcome::Error } else { Outcome::Ok }
}

/// The TransferQueue error reply to a request that broke a receive limit:
/// `PUT_ERROR`, `GET_ERROR` or `CLEAR_DATA_ERROR` when frame 0 says which
/// request it was, `PUT_GET_ERROR` otherwise.
fn tq_too_large(unit_id: &str, head: &[Bytes], reason: &str) -> tq::Reply {
    let detail = format!(
        "request refused unread: {reason} (see [limits] max_request_bytes and max_request_frames in the stowd configuration)"
    );
    let request_type = head.first().map(tq::request_type);
    let kind = match request_type.as_ref().and_then(|r| r.as_deref().ok()) {
        Some("PUT") => tq::ErrorReply::Put,
        Some("GET") => tq::ErrorReply::Get,
        Some("CLEAR_DATA") => tq::ErrorReply::ClearData,
        _ => tq::ErrorReply::PutGet,
    };
    match kind {
        tq::ErrorReply::Put => tq::Reply::put_failed(unit_id, &detail),
        tq::ErrorReply::Get => tq::Reply::get_failed(unit_id, &detail),
        tq::ErrorReply::ClearData => tq::Reply::clear_failed(unit_id, &detail),
        kind => tq::Reply::Error { kind, message: format!("undecodable request: {detail}") },
    }
}

/// The reply to a TransferQueue request refused unread (see
/// [`tq_too_large`]), counted under `protocol`; none to a peer whose
/// identity TransferQueue would not use.
fn tq_reject(
    unit_id: &str,
    identity: &Bytes,
    head: &[Bytes],
    reason: &str,
    metrics: &Metrics,
    protocol: Protocol,
) -> Option<Vec<Bytes>> {
    if !tq_identity_allowed(identity) {
        return None;
    }
    let frames = tq::encode_reply(unit_id, &tq_too_large(unit_id, head, reason));
    metrics.observe(protocol, "too_large", Outcome::Error, Duration::ZERO, frames.len());
    Some(frames)
}

/// The `stowage` key of a TransferQueue `METRICS_RESPONSE` (when
/// `[metrics] tq_extra` is on): a msgpack map of stowd's own figures.
fn tq_extra(manager: Option<&Manager>, units: &[&Unit]) -> Vec<(String, Bytes)> {
    let mut pairs: Vec<(&str, u64)> = vec![
        ("stored_bytes", units.iter().map(|u| u.stats().bytes).sum()),
        ("stored_rows", units.iter().map(|u| u.stats().rows).sum()),
        ("stored_values", units.iter().map(|u| u.stats().keys).sum()),
    ];
    if let Some(m) = manager {
        let c = &m.counters;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        pairs.extend([
            ("zero_copy_bytes", get(&c.zero_copy_bytes)),
            ("copied_bytes", get(&c.copied_bytes)),
            ("frames_sent", get(&c.frames_sent)),
            ("plugin_decisions", get(&c.plugin_decisions)),
            ("builtin_decisions", get(&c.builtin_decisions)),
            ("fallbacks", get(&c.fallbacks)),
        ]);
        let versions = m.registry().version_stats();
        pairs.push(("plugin_faults", versions.iter().map(|v| v.stats.faults.load(Ordering::Relaxed)).sum()));
    }
    let mut buf = Vec::new();
    rmp::encode::write_map_len(&mut buf, pairs.len() as u32).expect("vec write");
    for (k, v) in pairs {
        rmp::encode::write_str(&mut buf, k).expect("vec write");
        rmp::encode::write_uint(&mut buf, v).expect("vec write");
    }
    vec![("stowage".to_string(), Bytes::from(buf))]
}

/// A local unit behind its own TransferQueue endpoint.
struct UnitService {
    unit: Arc<Unit>,
    arrivals: Arrivals,
    metrics: Arc<Metrics>,
    /// Add the `stowage` key to `METRICS_RESPONSE`.
    tq_extra: bool,
}

impl UnitService {
    fn answer(&self, frames: &[Bytes]) -> (&'static str, tq::Reply) {
        let id = self.unit.id();
        let request = match tq::decode_request(frames) {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!(unit = id, error = %e, "refused request");
                return ("undecodable", e.to_reply(id));
            }
        };
        self.arrivals.note(request.op_name());
        let op = tq_op(&request);
        let reply = match request {
            tq::Request::Put { global_indexes, fields } => {
                let mut cells = Vec::with_capacity(fields.len());
                for (name, field) in fields {
                    match field_cells(field) {
                        Ok(c) => cells.push((name, c)),
                        Err(e) => return (op, tq::Reply::put_failed(id, &e)),
                    }
                }
                match self.unit.put(&global_indexes, cells) {
                    Ok(()) => tq::Reply::PutData,
                    Err(e) => tq::Reply::put_failed(id, &e.to_string()),
                }
            }
            tq::Request::Get { global_indexes, fields } => match self.unit.get(&global_indexes, &fields) {
                Ok(cells) => tq::Reply::GetData { fields: fields.into_iter().zip(cells).collect() },
                Err(StoreError::KeyNotFound { index, field, .. }) => tq::Reply::key_not_found(id, index, &field),
                Err(e) => tq::Reply::get_failed(id, &e.to_string()),
            },
            tq::Request::Clear { global_indexes } => {
                self.unit.clear(&global_indexes, None);
                tq::Reply::clear_ok(id)
            }
            tq::Request::GetMetrics => {
                let stats = self.unit.stats();
                let extra = if self.tq_extra { tq_extra(None, &[&self.unit]) } else { vec![] };
                // TransferQueue counts samples (global indexes), not values.
                self.arrivals.metrics(id, stats.capacity, stats.rows, extra)
            }
            tq::Request::Other(t) => tq::Reply::invalid_operation(id, &t),
        };
        (op, reply)
    }
}

impl Service for UnitService {
    fn handle(self: Arc<Self>, identity: Bytes, frames: Vec<Bytes>) -> BoxFuture<'static, Option<Vec<Bytes>>> {
        Box::pin(async move {
            if !tq_identity_allowed(&identity) {
                tracing::debug!(identity = %String::from_utf8_lossy(&identity), "request from an unrecognised identity dropped");
                return None;
            }
            let started = Instant::now();
            let (op, reply) = self.answer(&frames);
            let frames = tq::encode_reply(self.unit.id(), &reply);
            self.metrics.observe(Protocol::Tq, op, tq_outcome(&reply), started.elapsed(), frames.len());
            Some(frames)
        })
    }

    fn reject(self: Arc<Self>, identity: Bytes, head: Vec<Bytes>, reason: String) -> BoxFuture<'static, Option<Vec<Bytes>>> {
        Box::pin(async move { tq_reject(self.unit.id(), &identity, &head, &reason, &self.metrics, Protocol::Tq) })
    }
}

/// The router-mode TransferQueue endpoint.
struct RouterService {
    id: String,
    manager: Arc<Manager>,
    arrivals: Arrivals,
    metrics: Arc<Metrics>,
    tq_extra: bool,
}

impl RouterService {
    async fn answer(&self, frames: &[Bytes]) -> (&'static str, tq::Reply) {
        let id = self.id.as_str();
        let request = match tq::decode_request(frames) {
            Ok(r) => r,
            Err(e) => return ("undecodable", e.to_reply(id)),
        };
        self.arrivals.note(request.op_name());
        let op = tq_op(&request);
        let reply = match request {
            tq::Request::Put { global_indexes, fields } => match self.manager.put(&global_indexes, fields).await {
                Ok(()) => tq::Reply::PutData,
                Err(e) => tq::Reply::put_failed(id, &e.to_string()),
            },
            tq::Request::Get { global_indexes, fields } => match self.manager.get(&global_indexes, &fields).await {
                Ok(cells) => tq::Reply::GetData { fields: cells },
                Err(ManagerError::Store(StoreError::KeyNotFound { index, field, .. })) => {
                    tq::Reply::key_not_found(id, index, &field)
                }
                Err(ManagerError::Remote { message, key_not_found: true, .. }) => {
                    tq::Reply::Error { kind: tq::ErrorReply::Get, message }
                }
                Err(e) => tq::Reply::get_failed(id, &e.to_string()),
            },
            tq::Request::Clear { global_indexes } => match self.manager.clear(&global_indexes, None).await {
                Ok(_) => tq::Reply::clear_ok(id),
                Err(e) => tq::Reply::clear_failed(id, &e.to_string()),
            },
            tq::Request::GetMetrics => {
                let (mut keys, mut capacity) = (0, Some(0u64));
                for t in self.manager.targets() {
                    match t {
                        Target::Local(u) => {
                            let s = u.stats();
                            keys += s.rows;
                            capacity = capacity.zip(s.capacity).map(|(a, b)| a + b);
                        }
                        // A remote unit's capacity is not known here.
                        Target::Remote(_) => capacity = None,
                    }
                }
                let extra = if self.tq_extra {
                    let locals: Vec<&Unit> = self
                        .manager
                        .targets()
                        .iter()
                        .filter_map(|t| if let Target::Local(u) = t { Some(u.as_ref()) } else { None })
                        .collect();
                    tq_extra(Some(&self.manager), &locals)
                } else {
                    vec![]
                };
                self.arrivals.metrics(id, capacity, keys, extra)
            }
            tq::Request::Other(t) => tq::Reply::invalid_operation(id, &t),
        };
        (op, reply)
    }
}

impl Service for RouterService {
    fn handle(self: Arc<Self>, identity: Bytes, frames: Vec<Bytes>) -> BoxFuture<'static, Option<Vec<Bytes>>> {
        Box::pin(async move {
            if !tq_identity_allowed(&identity) {
                return None;
            }
            let started = Instant::now();
            let (op, reply) = self.answer(&frames).await;
            let frames = tq::encode_reply(&self.id, &reply);
            self.metrics.observe(Protocol::TqRouter, op, tq_outcome(&reply), started.elapsed(), frames.len());
            Some(frames)
        })
    }

    fn reject(self: Arc<Self>, identity: Bytes, head: Vec<Bytes>, reason: String) -> BoxFuture<'static, Option<Vec<Bytes>>> {
        Box::pin(async move { tq_reject(&self.id, &identity, &head, &reason, &self.metrics, Protocol::TqRouter) })
    }
}

/// The native `stowage/1` endpoint.
struct NativeService {
    manager: Arc<Manager>,
    limits: native::Limits,
    pack_limits: PackLimits,
    /// Same-node shared memory, if enabled.
    shm: Option<Arc<SegmentStore>>,
    /// Data frames of received puts, so rows stored from one frame and read
    /// back in order go out as one range (see [`crate::spans`]).
    spans: Spans,
    metrics: Arc<Metrics>,
}

/// Received data frames at least this large are registered in
/// [`NativeService::spans`] (smaller ones rarely hold more than a row or two).
const SPAN_MIN_FRAME: usize = 64 << 10;

fn shm_error(e: &ShmError) -> native::Reply {
    let code = match e {
        ShmError::Disabled => native::code::UNSUPPORTED,
        ShmError::TooLarge { .. } => native::code::TOO_LARGE,
        ShmError::Io { .. } => native::code::INTERNAL,
        _ => native::code::BAD_REQUEST,
    };
    native::Reply::Error { code: code.into(), message: e.to_string() }
}

fn native_error(e: &ManagerError) -> native::Reply {
    let code = match e {
        _ if e.is_key_not_found() => native::code::KEY_NOT_FOUND,
        ManagerError::Store(StoreError::Capacity { .. }) => native::code::CAPACITY,
        ManagerError::Store(_) | ManagerError::BadRequest(_) => native::code::BAD_REQUEST,
        ManagerError::Policy(crate::policy::chain::ChainError::Rejected { .. }) => native::code::REJECTED,
        ManagerError::Policy(crate::policy::chain::ChainError::EmptyPositions) => native::code::BAD_REQUEST,
        _ => native::code::INTERNAL,
    };
    native::Reply::Error { code: code.into(), message: e.to_string() }
}

impl NativeService {
    /// The frame layout of a get_ok: per field, the packing chain groups the
    /// field's pieces (the parts of a regular field, the rows of a nested
    /// one) into frames; frames never mix fields.
    fn layout(&self, fields: &[(String, native::WireField)]) -> native::FrameLayout {
        let mut frames = Vec::new();
        let tensor_fields = fields.iter().filter(|(_, f)| !matches!(f, native::WireField::Values(_))).count().max(1);
        let mut limits = self.pack_limits;
        limits.max_frames = (limits.max_frames / tensor_fields as u32).max(1);
        let registry = self.manager.registry();
        for (i, (name, field)) in fields.iter().enumerate() {
            let slices: Vec<native::RowSlice> = match field {
                native::WireField::Regular(p) => {
                    let mut start = 0;
                    p.parts()
                        .iter()
                        .map(|(_, rows)| {
                            let s = native::RowSlice { field: i, start, end: start + rows };
                            start += rows;
                            s
                        })
                        .collect()
                }
                // Rows that lie back to back in one received frame are one
                // piece: sent as a slice of that frame, whatever the policy
                // does with it (see `encode_reply_joined`).
                native::WireField::Nested(rows) => self
                    .nested_runs(rows)
                    .into_iter()
                    .map(|(a, b)| native::RowSlice { field: i, start: a, end: b })
                    .collect(),
                native::WireField::Values(_) => continue,
            };
            let pieces: Vec<PieceInfo> = match field {
                native::WireField::Regular(p) => {
                    p.parts().iter().map(|(b, _)| PieceInfo { byte_len: b.len() as u64, contiguous: true }).collect()
                }
                native::WireField::Nested(rows) => slices
                    .iter()
                    .map(|s| {
                        let run = &rows[s.start as usize..s.end as usize];
                        PieceInfo {
                            byte_len: run.iter().map(|t| t.payload_len() as u64).sum(),
                            contiguous: run.iter().all(|t| t.is_contiguous()),
                        }
                    })
                    .collect(),
                native::WireField::Values(_) => continue,
            };
            match registry.pack_chain(name).pack(&pieces, &limits) {
                Ok(d) => frames.extend(d.plan.frames.iter().map(|f| match f {
                    Frame::Single(k) => vec![slices[*k as usize]],
                    Frame::Coalesced(ks) => ks.iter().map(|k| slices[*k as usize]).collect(),
                })),
                // No plan within the budget: one frame per piece.
                Err(_) => frames.extend(slices.into_iter().map(|s| vec![s])),
            }
        }
        native::FrameLayout { frames }
    }

    /// The rows of a nested field as runs `[a, b)`: rows that follow each
    /// other in memory inside one buffer [`NativeService::span`] finds form
    /// one run, any other row is a run of its own.
    fn nested_runs(&self, rows: &[Tensor]) -> Vec<(u64, u64)> {
        let mut runs = Vec::with_capacity(rows.len());
        let mut a = 0usize;
        while a < rows.len() {
            let whole = |t: &Tensor| t.is_contiguous() && !t.buffer().is_empty();
            let start = rows[a].buffer().as_ptr() as usize;
            let (mut end, mut b) = (start + rows[a].buffer().len(), a + 1);
            if whole(&rows[a]) {
                while b < rows.len() && whole(&rows[b]) && rows[b].buffer().as_ptr() as usize == end {
                    end += rows[b].buffer().len();
                    b += 1;
                }
            }
            if b - a == 1 || self.span(start as *const u8, end - start).is_some() {
                runs.push((a as u64, b as u64));
            } else {
                runs.extend((a..b).map(|r| (r as u64, r as u64 + 1))); // not inside one buffer: row by row
            }
            a = b;
        }
        runs
    }

    /// `len` bytes from `start` as a slice of the received frame or the
    /// shared-memory segment that holds them all, if any.
    fn span(&self, start: *const u8, len: usize) -> Option<Bytes> {
        self.spans.span(start, len).or_else(|| self.shm.as_ref()?.span_at(start, len))
    }

    /// Moves every tensor cell that is not yet in shared memory into one new
    /// segment (one copy, once) and points the local units' stored cells
    /// there, so later same-node gets of these rows are zero-copy and share
    /// pages.
    fn move_to_shm(
        &self,
        shm: &SegmentStore,
        global_indexes: &[u64],
        cells: &mut [(String, Vec<Cell>)],
    ) -> Result<(), ShmError> {
        let mut pending: Vec<(usize, usize)> = Vec::new();
        let mut seen: std::collections::HashMap<(usize, usize), usize> = std::collections::HashMap::new();
        let mut unique: Vec<Bytes> = Vec::new();
        let mut slot_of: Vec<usize> = Vec::new();
        for (f, (_, field_cells)) in cells.iter().enumerate() {
            for (j, cell) in field_cells.iter().enumerate() {
                if let Cell::Tensor(t) = cell
                    && !t.buffer().is_empty()
                    && shm.locate(t.buffer()).is_none()
                {
                    let key = (t.buffer().as_ptr() as usize, t.buffer().len());
                    let slot = *seen.entry(key).or_insert_with(|| {
                        unique.push(t.contiguous_bytes());
                        unique.len() - 1
                    });
                    pending.push((f, j));
                    slot_of.push(slot);
                }
            }
        }
        if pending.is_empty() {
            return Ok(());
        }
        let parts: Vec<&[u8]> = unique.iter().map(|b| b.as_ref()).collect();
        let moved = shm.export(&parts)?;
        for ((f, j), slot) in pending.into_iter().zip(slot_of) {
            let (name, field_cells) = &mut cells[f];
            let Cell::Tensor(old) = &field_cells[j] else { continue };
            let Ok(fresh) = Tensor::contiguous(moved[slot].clone(), old.dtype(), old.shape().to_vec()) else { continue };
            let fresh = Cell::Tensor(fresh);
            let g = global_indexes[j];
            if let Some(unit) = self.manager.local_unit(g) {
                unit.swap(g, name, &field_cells[j], fresh.clone());
            }
            field_cells[j] = fresh;
        }
        Ok(())
    }

    async fn answer(&self, op: native::Op, same_node: bool) -> native::Reply {
        let m = &self.manager;
        match op {
            native::Op::Put { global_indexes, fields } => {
                let mut decoded = Vec::with_capacity(fields.len());
                for (name, f) in fields {
                    match f.into_field() {
                        Ok(field) => decoded.push((name, field)),
                        Err(e) => return native::Reply::from_error(&e),
                    }
                }
                match m.put(&global_indexes, decoded).await {
                    Ok(()) => native::Reply::PutOk { rows: global_indexes.len() as u64 },
                    Err(e) => native_error(&e),
                }
            }
            native::Op::Get { global_indexes, fields } => match m.get(&global_indexes, &fields).await {
                Ok(mut cells) => {
                    if same_node {
                        let Some(shm) = &self.shm else { return shm_error(&ShmError::Disabled) };
                        if let Err(e) = self.move_to_shm(shm, &global_indexes, &mut cells) {
                            return shm_error(&e);
                        }
                    }
                    let mut out = Vec::with_capacity(cells.len());
                    for (name, c) in cells {
                        match native::WireField::from_cells(c) {
                            Ok(w) => out.push((name, w)),
                            Err(e) => return native::Reply::from_error(&e),
                        }
                    }
                    out = match (&self.shm, same_node) {
                        (Some(shm), true) => out.into_iter().map(|(n, w)| (n, join_runs(w, |p, l| shm.span_at(p, l)))).collect(),
                        _ => out.into_iter().map(|(n, w)| (n, join_runs(w, |p, l| self.span(p, l)))).collect(),
                    };
                    return native::Reply::GetOk { fields: out };
                }
                Err(e) => native_error(&e),
            },
            native::Op::Lease { bytes } => match &self.shm {
                None => shm_error(&ShmError::Disabled),
                Some(shm) => match shm.lease(bytes) {
                    Ok((segment, ttl)) => native::Reply::LeaseOk { segment, bytes, ttl_ms: ttl.as_millis() as u64 },
                    Err(e) => shm_error(&e),
                },
            },
            native::Op::Clear { global_indexes, fields } => match m.clear(&global_indexes, fields.as_deref()).await {
                Ok(cleared) => native::Reply::ClearOk { cleared },
                Err(e) => native_error(&e),
            },
            native::Op::Stats => {
                let c = &m.counters;
                let mut stats = vec![("units".to_string(), native::Stat::Int(m.targets().len() as i64))];
                let (mut keys, mut rows, mut bytes, mut capacity) = (0u64, 0u64, 0u64, Some(0u64));
                for t in m.targets() {
                    match t {
                        Target::Local(u) => {
                            let s = u.stats();
                            keys += s.keys;
                            rows += s.rows;
                            bytes += s.bytes;
                            capacity = capacity.zip(s.capacity).map(|(a, b)| a.saturating_add(b));
                        }
                        Target::Remote(_) => capacity = None,
                    }
                }
                let int = |v: u64| native::Stat::Int(v.min(i64::MAX as u64) as i64);
                stats.push(("keys".into(), int(keys)));
                stats.push(("rows".into(), int(rows)));
                stats.push(("bytes".into(), int(bytes)));
                if let Some(c) = capacity {
                    stats.push(("capacity".into(), int(c)));
                }
                stats.push(("zero_copy_bytes".into(), int(c.zero_copy_bytes.load(Ordering::Relaxed))));
                stats.push(("copied_bytes".into(), int(c.copied_bytes.load(Ordering::Relaxed))));
                stats.push(("plugin_decisions".into(), int(c.plugin_decisions.load(Ordering::Relaxed))));
                stats.push(("builtin_decisions".into(), int(c.builtin_decisions.load(Ordering::Relaxed))));
                stats.push(("fallbacks".into(), int(c.fallbacks.load(Ordering::Relaxed))));
                stats.push(("process_rss_bytes".into(), int(process_rss_bytes())));
                let r = &self.metrics.reloads;
                stats.push(("plugin_swaps".into(), int(r.swapped.load(Ordering::Relaxed))));
                stats.push(("plugin_refusals".into(), int(r.refused.load(Ordering::Relaxed))));
                stats.push(("plugin_removals".into(), int(r.removed.load(Ordering::Relaxed))));
                let registry = m.registry();
                for name in registry.names() {
                    let Some(l) = registry.get(&name) else { continue };
                    let st = &l.stats;
                    let mut line = format!(
                        "version {} calls {} faults {} invalid_plans {} disabled {} plans {} fallbacks {} rejections {} reenables {}",
                        l.policy.describe().version,
                        st.calls.load(Ordering::Relaxed),
                        st.faults.load(Ordering::Relaxed),
                        st.invalid_plans.load(Ordering::Relaxed),
                        st.disabled.load(Ordering::Relaxed),
                        st.plans.load(Ordering::Relaxed),
                        st.fallbacks.load(Ordering::Relaxed),
                        st.rejections.load(Ordering::Relaxed),
                        st.reenables.load(Ordering::Relaxed),
                    );
                    if let Some(left) = st.reenable_in() {
                        line.push_str(&format!(" reenable_in_ms {}", left.as_millis()));
                    }
                    stats.push((format!("plugin.{name}"), native::Stat::Str(line)));
                }
                for (pattern, line) in registry.chain_summaries() {
                    stats.push((format!("chain.{pattern}"), native::Stat::Str(line)));
                }
                native::Reply::StatsOk(stats)
            }
        }
    }
}

impl NativeService {
    /// The data frames a put names by segment (the `segments` envelope
    /// key), adopted from their leases without a copy, after frame 0.
    fn resolve_segments(&self, frames: Vec<Bytes>, extras: &native::Extras) -> Result<Vec<Bytes>, native::Reply> {
        let Some(segments) = &extras.segments else { return Ok(frames) };
        let Some(shm) = &self.shm else { return Err(shm_error(&ShmError::Disabled)) };
        if frames.len() != 1 {
            let message = "a message with `segments` carries no data frames over the socket".to_string();
            return Err(native::Reply::Error { code: native::code::BAD_REQUEST.into(), message });
        }
        let mut adopted: std::collections::HashMap<&str, Bytes> = std::collections::HashMap::new();
        let mut out = frames;
        for (name, offset, len) in segments {
            let whole = match adopted.get(name.as_str()) {
                Some(b) => b.clone(),
                None => {
                    let b = shm.adopt(name).map_err(|e| shm_error(&e))?;
                    adopted.insert(name, b.clone());
                    b
                }
            };
            match offset.checked_add(*len) {
                Some(end) if end <= whole.len() as u64 => out.push(whole.slice(*offset as usize..end as usize)),
                _ => {
                    let e = ShmError::OutOfRange { name: name.clone(), offset: *offset, len: *len, size: whole.len() as u64 };
                    return Err(shm_error(&e));
                }
            }
        }
        Ok(out)
    }

    /// Replaces the data frames of an encoded reply by a `segments` key.
    fn as_segments(shm: &SegmentStore, frames: Vec<Bytes>) -> Result<Vec<Bytes>, String> {
        let mut segments = Vec::with_capacity(frames.len().saturating_sub(1));
        for f in &frames[1..] {
            if f.is_empty() {
                segments.push((String::new(), 0, 0));
                continue;
            }
            let loc = shm.locate(f).ok_or("a reply frame is not in shared memory")?;
            segments.push((loc.segment, loc.offset, loc.len));
        }
        let frame0 = native::with_segments(&frames[0], &segments).map_err(|e| e.to_string())?;
        Ok(vec![frame0])
    }

    async fn serve_one(&self, frames: Vec<Bytes>) -> Vec<Bytes> {
        let started = Instant::now();
        let mut op = "undecodable";
        let fallback_id = native::request_id(&frames).unwrap_or(0);
        let extras = match frames.first() {
            Some(f0) => native::decode_extras(f0, &self.limits),
            None => Ok(native::Extras::default()),
        };
        let (id, reply, same_node) = match extras {
            Err(e) => (fallback_id, native::Reply::from_error(&e), false),
            Ok(extras) => match self.resolve_segments(frames, &extras) {
                Err(reply) => (fallback_id, reply, false),
                Ok(mut frames) => {
                    if extras.segments.is_none() {
                        for f in frames.iter_mut().skip(1).filter(|f| f.len() >= SPAN_MIN_FRAME) {
                            *f = self.spans.register(std::mem::take(f));
                        }
                    }
                    match native::decode_request(&frames, &self.limits) {
                        Ok(req) => {
                            op = req.op.name();
                            (req.id, self.answer(req.op, extras.same_node).await, extras.same_node)
                        }
                        Err(e) => (fallback_id, native::Reply::from_error(&e), false),
                    }
                }
            },
        };
        let encoded = match &reply {
            native::Reply::GetOk { .. } if same_node => {
                let shm = self.shm.as_ref().expect("same_node get needs shm");
                // One virtual frame per segment, however many rows.
                native::encode_reply_enclosed(id, &reply, &|b| shm.enclosing(b))
                    .map_err(|e| e.to_string())
                    .and_then(|f| Self::as_segments(shm, f))
            }
            native::Reply::GetOk { fields } => native::encode_reply_joined(id, &reply, &self.layout(fields), &|p, l| self.span(p, l))
            .map_err(|e| e.to_string()),
            _ => native::encode_reply(id, &reply).map_err(|e| e.to_string()),
        };
        let outcome = if matches!(reply, native::Reply::Error { .. }) { Outcome::Error } else { Outcome::Ok };
        let (frames, outcome) = match encoded {
            Ok(f) => (f, outcome),
            Err(message) => {
                let error = native::Reply::Error { code: native::code::INTERNAL.into(), message };
                (native::encode_reply(id, &error).unwrap_or_default(), Outcome::Error)
            }
        };
        self.metrics.observe(Protocol::Native, op, outcome, started.elapsed(), frames.len());
        frames
    }
}

/// A regular field whose rows lie back to back in one buffer (a received
/// frame, or a shared-memory segment) becomes one part per run, found by
/// `span`: sent as one frame without a copy, or mapped by a same-node client
/// as one array.
fn join_runs(field: native::WireField, span: impl Fn(*const u8, usize) -> Option<Bytes>) -> native::WireField {
    let native::WireField::Regular(p) = &field else { return field };
    let Some(parts) = spans::join_runs(p.parts(), span) else { return field };
    match native::RegularParts::new(p.dtype(), p.row_shape().to_vec(), parts) {
        Ok(joined) => native::WireField::Regular(joined),
        Err(_) => field,
    }
}

impl Service for NativeService {
    fn handle(self: Arc<Self>, _identity: Bytes, frames: Vec<Bytes>) -> BoxFuture<'static, Option<Vec<Bytes>>> {
        Box::pin(async move { Some(self.serve_one(frames).await).filter(|f| !f.is_empty()) })
    }

    fn reject(self: Arc<Self>, _identity: Bytes, head: Vec<Bytes>, reason: String) -> BoxFuture<'static, Option<Vec<Bytes>>> {
        Box::pin(async move {
            let id = native::request_id(&head).unwrap_or(0);
            let message = format!(
                "request refused unread: {reason} (see [limits] max_request_bytes and max_request_frames in the stowd configuration)"
            );
            let error = native::Reply::Error { code: native::code::TOO_LARGE.into(), message };
            let frames = native::encode_reply(id, &error).ok()?;
            self.metrics.observe(Protocol::Native, "too_large", Outcome::Error, Duration::ZERO, frames.len());
            Some(frames)
        })
    }
}

/// Removes expired leases once a second until shutdown.
async fn sweep_leases(store: Arc<SegmentStore>, mut shutdown: watch::Receiver<bool>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => { store.sweep(); }
            _ = shutdown.changed() => break,
        }
    }
}

/// The plugin directory of `config`, made absolute (hot reload matches
/// the watcher's paths against the loaded files' paths).
pub fn plugin_dir(config: &Config) -> Option<std::path::PathBuf> {
    config.plugins.resolve_dir().map(|d| d.canonicalize().unwrap_or(d))
}

/// Loads the plugins and configures the chains.
pub fn build_registry(config: &Config) -> anyhow::Result<Registry> {
    let dir = plugin_dir(config);
    let cache = config.plugins.cache_dir.clone().or_else(|| dir.as_ref().map(|d| d.join(".cache")));
    let mut registry = Registry::new(cache, config.plugins.sandbox())?.with_overrides(config.plugins.overrides.clone());
    match &dir {
        Some(d) => {
            let check_at_start = config.plugins.check_at_start;
            let reports = registry
                .load_dir_checked(d, |p| if check_at_start { crate::conformance::verify(p).map(|_| ()) } else { Ok(()) })
                .map_err(|e| anyhow::anyhow!("cannot read plugin directory {}: {e}", d.display()))?;
            let loaded = reports.iter().filter(|r| r.result.is_ok()).count();
            tracing::info!(dir = %d.display(), loaded, refused = reports.len() - loaded, "plugins");
        }
        None => tracing::warn!("no plugin directory found: only the built-in policy answers"),
    }
    registry.configure(&config.chains);
    Ok(registry)
}

/// Starts every socket of `config`.
pub async fn start(config: Config) -> anyhow::Result<Running> {
    let registry = Arc::new(build_registry(&config)?);
    let plugins: Vec<String> = registry
        .names()
        .iter()
        .filter_map(|n| registry.get(n).map(|l| format!("{}@{}", n, l.policy.describe().version)))
        .collect();
    let (shutdown, rx) = watch::channel(false);
    let mut tasks = Vec::new();
    let metrics = Arc::new(Metrics::default());
    let tq_extra_on = config.metrics.tq_extra;
    let host = &config.server.host;
    let pid = std::process::id();
    let capacity = (config.units.capacity_bytes > 0).then_some(config.units.capacity_bytes);
    let transport_limits = config.limits.transport_limits();

    let mut units = Vec::new();
    let mut unit_endpoints = Vec::new();
    for i in 0..config.units.local {
        let id = format!("TQ_STORAGE_UNIT_{:08x}", (pid << 8) ^ i);
        let unit = Arc::new(Unit::new(id.clone(), capacity));
        let port = if config.units.port_base == 0 { 0 } else { config.units.port_base as u32 + i };
        let (socket, endpoint) = transport::bind(&format!("tcp://{host}:{port}")).await?;
        let service = Arc::new(UnitService {
            unit: unit.clone(),
            arrivals: Arrivals::default(),
            metrics: metrics.clone(),
            tq_extra: tq_extra_on,
        });
        tasks.push(tokio::spawn(transport::serve_with(socket, service, transport_limits, rx.clone())));
        tracing::info!(unit = %id, %endpoint, "unit listening");
        unit_endpoints.push(UnitEndpoint { id, endpoint });
        units.push(unit);
    }

    let sender = format!("TQ_STORAGE_{pid:08x}_{:08x}", std::time::UNIX_EPOCH.elapsed().map(|d| d.subsec_nanos()).unwrap_or(0));
    let targets: Vec<Target> = if config.router.units.is_empty() {
        units.iter().cloned().map(Target::Local).collect()
    } else {
        config
            .router
            .units
            .iter()
            .enumerate()
            .map(|(i, u)| match u.strip_prefix("local:") {
                Some(n) => Target::Local(units[n.parse::<usize>().expect("checked by config")].clone()),
                None => Target::Remote(Arc::new(Peer::with_limits(
                    u.clone(),
                    format!("{sender}_to_unit{i}"),
                    config.limits.receive_limits(),
                ))),
            })
            .collect()
    };
    let manager = Arc::new(Manager::new(
        targets,
        registry.clone(),
        config.limits.clone(),
        Duration::from_secs(config.router.timeout_secs),
        sender,
    ));

    let router = if config.router.enabled {
        let id = format!("TQ_STORAGE_UNIT_{:08x}", (pid << 8) ^ 0xff);
        let (socket, endpoint) = transport::bind(&format!("tcp://{host}:{}", config.router.port)).await?;
        let service = Arc::new(RouterService {
            id: id.clone(),
            manager: manager.clone(),
            arrivals: Arrivals::default(),
            metrics: metrics.clone(),
            tq_extra: tq_extra_on,
        });
        tasks.push(tokio::spawn(transport::serve_with(socket, service, transport_limits, rx.clone())));
        tracing::info!(%endpoint, units = manager.targets().len(), "router listening");
        Some(UnitEndpoint { id, endpoint })
    } else {
        None
    };

    let native_limits = native::Limits {
        max_rows: config.limits.max_rows,
        max_fields: config.limits.max_fields,
        max_frames: config.limits.max_request_frames,
        max_message_bytes: config.limits.max_request_bytes,
    };
    let (socket, native_endpoint) = transport::bind(&format!("tcp://{host}:{}", config.server.native_port)).await?;
    let shm = if config.shm.enabled {
        let store = SegmentStore::new(
            &config.shm.dir,
            Duration::from_secs(config.shm.lease_secs),
            config.shm.max_lease_bytes,
        )?
        .with_reuse(config.shm.reuse_bytes, Duration::from_secs(config.shm.reuse_secs));
        let store = Arc::new(store);
        tasks.push(tokio::spawn(sweep_leases(store.clone(), rx.clone())));
        tracing::info!(dir = %config.shm.dir.display(), "same-node shared memory enabled");
        Some(store)
    } else {
        None
    };
    let pack_limits = config.limits.pack_limits();
    let service = Arc::new(NativeService {
        manager: manager.clone(),
        limits: native_limits,
        pack_limits,
        shm: shm.clone(),
        spans: Spans::new(),
        metrics: metrics.clone(),
    });
    tasks.push(tokio::spawn(transport::serve_with(socket, service, transport_limits, rx.clone())));
    tracing::info!(endpoint = %native_endpoint, "native endpoint listening");

    let metrics_endpoint = if config.metrics.port != 0 {
        let addr = format!("{}:{}", config.metrics.host, config.metrics.port);
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .map_err(|e| anyhow::anyhow!("cannot bind the metrics endpoint {addr}: {e}"))?;
        let local = listener.local_addr()?;
        let (m, mg, us) = (metrics.clone(), manager.clone(), units.clone());
        let exposition: Arc<dyn crate::metrics::Exposition> = Arc::new(move || m.render(&mg, &us));
        tasks.push(tokio::spawn(crate::metrics::serve_http(listener, exposition, rx.clone())));
        let url = format!("http://{local}/metrics");
        tracing::info!(endpoint = %url, "metrics endpoint listening");
        Some(url)
    } else {
        None
    };

    if config.plugins.watch {
        match plugin_dir(&config) {
            Some(dir) if dir.is_dir() => {
                tasks.push(tokio::spawn(crate::reload::run(dir, manager.clone(), metrics.clone(), rx.clone())));
            }
            _ => tracing::info!("no plugin directory to watch: hot reload is off"),
        }
    }

    let shm_dir = shm.as_ref().map(|s| s.dir().display().to_string());
    let endpoints = Endpoints {
        pid,
        units: unit_endpoints,
        router,
        native: native_endpoint,
        plugins,
        shm_dir,
        metrics: metrics_endpoint,
    };
    Ok(Running { endpoints, shutdown, tasks })
}
