//! The TransferQueue endpoints: one per local unit, and the router
//! endpoint over every configured unit. Both speak TransferQueue 0.1.11's
//! storage-unit protocol byte for byte; they differ only in the manager
//! that answers a request: a unit endpoint's is the unit's own
//! ([`Manager::over_unit`]: puts stored as they arrived, no selection
//! policy), the router's is the node's (`g % N` over the configured units,
//! with the selection chains).
//!
//! Every request runs in a DEBUG `request` span: `endpoint` (the unit or
//! router id), `proto` (`tq` or `tq_router`), `bytes` (all frames), and
//! once decoded `id` (the envelope's `request_id`), `op` and `rows`. The
//! policy spans of a routed request ([`crate::policy::chain`]) and the
//! `remote` spans of its exchanges with remote units sit inside it. Error
//! replies come from [`super::errors`].

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use bytes::Bytes;
use tracing::Instrument;

use super::errors;
use super::offload::Offload;
use crate::extent::Received;
use crate::manager::{Manager, Target};
use crate::metrics::{Metrics, Outcome, Protocol};
use crate::store::Unit;
use crate::transport::{BoxFuture, Caller, Message, Service};
use crate::wire::indexes::Indexes;
use crate::wire::tq;

/// Identities a TransferQueue unit answers; others are dropped silently,
/// as the real unit does.
pub const TQ_IDENTITY_PREFIXES: [&[u8]; 2] = [b"TQ_STORAGE_", b"metrics_collector_"];

pub(super) fn identity_allowed(identity: &[u8]) -> bool {
    TQ_IDENTITY_PREFIXES.iter().any(|p| identity.starts_with(p))
}

/// A TransferQueue storage-unit endpoint.
pub(super) struct TqService {
    id: String,
    manager: Arc<Manager>,
    /// `Tq` for a unit endpoint, `TqRouter` for the router's.
    protocol: Protocol,
    arrivals: Arrivals,
    metrics: Arc<Metrics>,
    /// Add the `stowage` key to `METRICS_RESPONSE`.
    tq_extra: bool,
    /// `max_rows` and `max_fields`, checked as the counts are read.
    limits: tq::Limits,
    /// Where large requests run.
    offload: Arc<Offload>,
    /// Where SAVE and LOAD may write and read (none until set).
    roots: Arc<crate::checkpoint::Roots>,
    /// Serve only connections from loopback addresses (`[security]
    /// tq_endpoints = "loopback"`).
    loopback_only: bool,
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
    fn metrics(
        &self,
        unit_id: &str,
        capacity: Option<u64>,
        active_keys: u64,
        extra: Vec<(String, Bytes)>,
    ) -> tq::Reply {
        let arrivals_by_op = self.0.lock().unwrap_or_else(|p| p.into_inner()).clone();
        tq::Reply::Metrics(tq::Metrics {
            storage_unit_id: unit_id.to_string(),
            capacity,
            active_keys,
            process_rss_bytes: crate::sys::process_rss_bytes(),
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

/// The op label of a TransferQueue request, for metrics.
fn op_label(request: &tq::Request) -> &'static str {
    match request {
        tq::Request::Put { .. } => "put",
        tq::Request::Get { .. } => "get",
        tq::Request::Clear { .. } => "clear",
        tq::Request::GetMetrics => "metrics",
        tq::Request::SaveCheckpoint { .. } => "save_checkpoint",
        tq::Request::LoadCheckpoint { .. } => "load_checkpoint",
        tq::Request::Other(_) => "other",
    }
}

/// The `stowage` key of a TransferQueue `METRICS_RESPONSE` (when
/// `[metrics] tq_extra` is on): a msgpack map of stowd's own figures.
fn extra(manager: Option<&Manager>, units: &[&Unit]) -> Vec<(String, Bytes)> {
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
        pairs.push((
            "plugin_faults",
            versions
                .iter()
                .map(|v| v.stats.faults.load(Ordering::Relaxed))
                .sum(),
        ));
    }
    let mut w = crate::wire::msgpack::Writer::new();
    w.map(pairs.len());
    for (k, v) in pairs {
        w.kv_uint(k, v);
    }
    let map = w
        .finish()
        .expect("a dozen short keys fit any msgpack length");
    vec![("stowage".to_string(), Bytes::from(map))]
}

impl TqService {
    pub(super) fn new(
        id: String,
        manager: Arc<Manager>,
        protocol: Protocol,
        metrics: Arc<Metrics>,
        tq_extra: bool,
    ) -> Arc<TqService> {
        Arc::new(TqService {
            id,
            manager,
            protocol,
            arrivals: Arrivals::default(),
            metrics,
            tq_extra,
            limits: tq::Limits::NONE,
            offload: Offload::new(usize::MAX),
            roots: Arc::new(crate::checkpoint::Roots::new(vec![], vec![])),
            loopback_only: false,
        })
    }

    /// The same service, serving only connections from loopback addresses.
    pub(super) fn loopback_only(mut self: Arc<Self>, only: bool) -> Arc<TqService> {
        let this = Arc::get_mut(&mut self).expect("called right after new");
        this.loopback_only = only;
        self
    }

    /// The same service writing and reading checkpoints under `roots`.
    pub(super) fn with_roots(
        mut self: Arc<Self>,
        roots: Arc<crate::checkpoint::Roots>,
    ) -> Arc<TqService> {
        let this = Arc::get_mut(&mut self).expect("called right after new");
        this.roots = roots;
        self
    }

    /// The same service with receiver limits and a blocking pool.
    pub(super) fn with_limits(
        mut self: Arc<Self>,
        limits: tq::Limits,
        offload: Arc<Offload>,
    ) -> Arc<TqService> {
        let this = Arc::get_mut(&mut self).expect("called right after new");
        this.limits = limits;
        this.offload = offload;
        self
    }

    async fn answer(&self, frames: &[Bytes]) -> (&'static str, tq::Reply) {
        let id = self.id.as_str();
        let request = match tq::decode_message_with(frames, &self.limits) {
            Ok(m) => {
                let span = tracing::Span::current();
                span.record("id", m.envelope.request_id.as_str());
                m.request
            }
            Err(e) => {
                tracing::debug!(unit = id, error = %e, "refused request");
                return ("undecodable", errors::tq_undecodable(id, &e));
            }
        };
        self.arrivals.note(request.op_name());
        let op = op_label(&request);
        let rows = match &request {
            tq::Request::Put { global_indexes, .. }
            | tq::Request::Get { global_indexes, .. }
            | tq::Request::Clear { global_indexes } => global_indexes.len(),
            _ => 0,
        };
        tracing::Span::current()
            .record("op", op)
            .record("rows", rows);
        let reply = match request {
            tq::Request::Put {
                global_indexes,
                fields,
            } => {
                let received = Received::frames(frames.get(1..).unwrap_or_default());
                // The names shared, as the native decoder shares them.
                let fields = fields
                    .into_iter()
                    .map(|(name, f)| (crate::wire::names::shared_name(&name), f))
                    .collect();
                let result = self.manager.put(&global_indexes, fields, &received).await;
                match result {
                    Ok(()) => tq::Reply::PutData,
                    Err(e) => errors::tq_reply(id, tq::ErrorReply::Put, &e),
                }
            }
            tq::Request::Get {
                global_indexes,
                fields,
            } => {
                let result = self
                    .manager
                    .get(&Indexes::from_list(&global_indexes), &fields)
                    .await
                    .map(|got| {
                        got.into_iter()
                            .map(|(name, rows)| (name, rows.cells()))
                            .collect()
                    });
                match result {
                    Ok(fields) => tq::Reply::GetData { fields },
                    Err(e) => errors::tq_reply(id, tq::ErrorReply::Get, &e),
                }
            }
            tq::Request::Clear { global_indexes } => {
                match self.manager.clear(&global_indexes, None).await {
                    Ok(_) => tq::Reply::clear_ok(id),
                    Err(e) => errors::tq_reply(id, tq::ErrorReply::ClearData, &e),
                }
            }
            tq::Request::GetMetrics => self.metrics_reply(),
            tq::Request::SaveCheckpoint { path } => self.checkpoint(path, false).await,
            tq::Request::LoadCheckpoint { path } => self.checkpoint(path, true).await,
            tq::Request::Other(t) => errors::tq_invalid_operation(id, &t),
        };
        (op, reply)
    }

    /// `SAVE_STORAGE_CHECKPOINT` / `LOAD_STORAGE_CHECKPOINT` (`load`): a
    /// unit endpoint's rows, or all the local units of a router (refused if
    /// it routes to a remote unit), to or from the file `path`
    /// ([`crate::manager::checkpoint`]). The reply says `success` and, on
    /// failure, why.
    async fn checkpoint(&self, path: String, load: bool) -> tq::Reply {
        let id = self.id.as_str();
        let what = if load { "load" } else { "save" };
        let done = if load {
            self.manager
                .load_file(&self.roots, &path)
                .await
                .map(|rows| (rows, 0))
        } else {
            // The file names the endpoint: a unit's id, or the router's.
            self.manager
                .save_file(&self.roots, &path, id)
                .await
                .map(|s| (s.rows, s.bytes))
        };
        let error = match done {
            Ok((rows, bytes)) => {
                tracing::info!(unit = id, path, rows, bytes, "checkpoint {what}");
                None
            }
            Err(e) => Some(errors::tq_checkpoint(what, &e)),
        };
        if let Some(e) = &error {
            tracing::warn!(unit = id, path, error = %e, "checkpoint {what} refused");
        }
        tq::Reply::Checkpoint { load, error }
    }

    fn metrics_reply(&self) -> tq::Reply {
        let (mut keys, mut capacity) = (0, Some(0u64));
        let mut locals: Vec<&Unit> = Vec::new();
        for t in self.manager.targets() {
            match t {
                Target::Local(u) => {
                    let s = u.stats();
                    // TransferQueue counts samples (global indexes), not values.
                    keys += s.rows;
                    capacity = capacity.zip(s.capacity).map(|(a, b)| a + b);
                    locals.push(u);
                }
                // A remote unit's capacity is not known here.
                Target::Remote(_) | Target::Peer(_) => capacity = None,
            }
        }
        let extra = match (self.tq_extra, self.protocol) {
            (false, _) => vec![],
            // A unit endpoint runs no policy: its figures are its unit's.
            (true, Protocol::Tq) => extra(None, &locals),
            (true, _) => extra(Some(&self.manager), &locals),
        };
        self.arrivals.metrics(&self.id, capacity, keys, extra)
    }

    /// Decodes, answers and encodes one request (on the blocking pool if
    /// it is large, see [`Offload`]).
    async fn serve(self: Arc<Self>, frames: Vec<Bytes>) -> Option<Vec<Bytes>> {
        let started = Instant::now();
        let span = tracing::debug_span!(
            "request",
            endpoint = %self.id,
            proto = self.protocol().label(),
            id = tracing::field::Empty,
            op = tracing::field::Empty,
            rows = tracing::field::Empty,
            bytes = frames.iter().map(Bytes::len).sum::<usize>(),
        );
        let (op, reply) = self.answer(&frames).instrument(span.clone()).await;
        let outcome = if matches!(reply, tq::Reply::Error { .. }) {
            Outcome::Error
        } else {
            Outcome::Ok
        };
        if let tq::Reply::Error { message, .. } = &reply {
            span.in_scope(|| tracing::debug!(error = %message, "error reply"));
        }
        let frames = tq::encode_reply(&self.id, &reply);
        self.metrics.observe(
            self.protocol(),
            op,
            outcome,
            started.elapsed(),
            frames.len(),
        );
        Some(frames)
    }

    fn protocol(&self) -> Protocol {
        self.protocol
    }
}

impl Service for TqService {
    fn admits(&self, peer: Option<std::net::IpAddr>) -> bool {
        !self.loopback_only || peer.is_none_or(|ip| ip.is_loopback())
    }

    fn handle(
        self: Arc<Self>,
        caller: Caller,
        frames: Vec<Bytes>,
    ) -> BoxFuture<'static, Option<Message>> {
        let identity = caller.identity;
        Box::pin(async move {
            if !identity_allowed(&identity) {
                tracing::debug!(identity = %String::from_utf8_lossy(&identity), "request from an unrecognised identity dropped");
                return None;
            }
            let frame0 = frames.first().map_or(0, Bytes::len);
            let offload = self.offload.clone();
            // Awaited here when inline: `run`'s future would hold the
            // request's state a second time (see `Offload::inline`).
            if offload.inline(frame0) {
                return self.serve(frames).await.map(Message::from);
            }
            offload
                .run(frame0, Box::pin(self.serve(frames)))
                .await
                .map(Message::from)
        })
    }

    fn reject(
        self: Arc<Self>,
        caller: Caller,
        head: Vec<Bytes>,
        reason: String,
    ) -> BoxFuture<'static, Option<Message>> {
        Box::pin(async move {
            if !identity_allowed(&caller.identity) {
                return None;
            }
            let frames =
                tq::encode_reply(&self.id, &errors::tq_too_large(&self.id, &head, &reason));
            self.metrics.observe(
                self.protocol(),
                "too_large",
                Outcome::Error,
                std::time::Duration::ZERO,
                frames.len(),
            );
            Some(frames.into())
        })
    }
}
