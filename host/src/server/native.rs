//! The native `stowage/1` endpoint: puts (over tcp, or naming leased
//! shared-memory segments), gets (frames planned from the extents the rows
//! are in; for a same-node reader, whole segments), clears, leases, stats.
//!
//! Every request runs in a DEBUG `request` span: `endpoint`, `proto`
//! (`native`), `bytes` (all frames), and once decoded `id` (the client's
//! request id), `op` and `rows`; the policy spans of the request sit inside
//! it. Error replies come from [`super::errors`]; a get_ok is built and
//! encoded in `native/get.rs`, the `stats` map in `native/stats.rs`.

mod forward;
mod get;
mod stats;

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tracing::Instrument;

use self::get::{GetReply, Places, get_field};
use super::errors::{self, EncodeError};
use crate::extent::{Extent, Received};
use crate::manager::Manager;
use crate::metrics::{Metrics, Outcome, Protocol};
use crate::plan::PackLimits;
use crate::shm::{Channels, SegmentStore, ShmError};
use crate::store::{Rows, Seq};
use crate::transport::{BoxFuture, Caller, Message, Service};
use crate::wire::native;

/// The native `stowage/1` endpoint.
pub(super) struct NativeService {
    pub manager: Arc<Manager>,
    /// Where `checkpoint` and `restore` may write and read.
    pub roots: Arc<crate::checkpoint::Roots>,
    pub limits: native::Limits,
    pub pack_limits: PackLimits,
    /// Same-node shared memory, if enabled, and the descriptor channels
    /// its segments go over.
    pub shm: Option<(Arc<SegmentStore>, Arc<Channels>)>,
    /// `[shm] inline_below`: same-node gets of fewer bytes are answered
    /// over the socket.
    pub inline_below: u64,
    pub metrics: Arc<Metrics>,
    /// The endpoint's address, for the request spans.
    pub endpoint: String,
    /// Where large requests run.
    pub offload: Arc<super::offload::Offload>,
    /// This stowd's local units' own managers, by number: what a peer's
    /// request names with the envelope's `unit` key.
    pub units: Vec<Arc<Manager>>,
    /// The tokens a client must present (ZMTP PLAIN), if any.
    pub auth: Option<Arc<crate::auth::Tokens>>,
    /// CURVE keys: the handshake is CURVE's (over `auth`) when set.
    pub curve: Option<Arc<crate::auth::CurveKeys>>,
}

/// The rows a request names (0 for stats and leases).
fn op_rows(op: &native::Op) -> usize {
    match op {
        native::Op::Put { global_indexes, .. } | native::Op::Clear { global_indexes, .. } => {
            global_indexes.len()
        }
        native::Op::Get { global_indexes, .. } => global_indexes.len() as usize,
        native::Op::Lease { .. }
        | native::Op::Stats
        | native::Op::Channel
        | native::Op::Checkpoint { .. }
        | native::Op::Restore { .. } => 0,
        native::Op::Versions { global_indexes, .. } => global_indexes.len() as usize,
    }
}

/// What [`NativeService::answer`] returns: a reply, or a get_ok with what
/// encoding it needs.
enum Answer {
    Reply(native::Reply),
    Get(GetReply),
    /// A get_ok whose frames follow as they arrive (`native/forward.rs`).
    Streamed(Message),
}

impl From<native::Reply> for Answer {
    fn from(r: native::Reply) -> Answer {
        Answer::Reply(r)
    }
}

/// A put through `manager` (the node's, or a unit's own for a peer's
/// request): its fields decoded, then stored; put_ok or the error reply.
async fn put(
    manager: &Manager,
    global_indexes: Vec<u64>,
    fields: Vec<(std::sync::Arc<str>, native::WireField)>,
    received: &Received,
) -> Answer {
    let mut decoded = Vec::with_capacity(fields.len());
    for (name, f) in fields {
        match f.into_field() {
            Ok(field) => decoded.push((name, field)),
            Err(e) => return errors::native_decode(&e).into(),
        }
    }
    match manager.put(&global_indexes, decoded, received).await {
        Ok(()) => native::Reply::PutOk {
            rows: global_indexes.len() as u64,
        }
        .into(),
        Err(e) => errors::native(&e).into(),
    }
}

/// A get_ok of `got` (per field, its rows), or the error that stops it;
/// `channel` for a same-node reader.
fn get_answer(got: Vec<(String, Rows)>, channel: Option<String>) -> Answer {
    let mut places = Places::default();
    let mut snapshots = crate::store::Snapshots::default();
    let mut out = Vec::with_capacity(got.len());
    // Per field up to the last nested one (none, no list, for a reply of
    // regular fields): `frame_layout` reads a missing entry as no runs.
    let mut nested_runs: Vec<Vec<(u64, u64)>> = Vec::new();
    for (i, (name, rows)) in got.into_iter().enumerate() {
        match get_field(&rows, &mut places, &mut snapshots) {
            Ok(f) => {
                out.push((name, f.wire));
                if !f.nested_runs.is_empty() {
                    nested_runs.resize_with(i, Vec::new);
                    nested_runs.push(f.nested_runs);
                }
            }
            Err(e) => return errors::native_decode(&e).into(),
        }
    }
    places.seal();
    Answer::Get(GetReply {
        reply: native::Reply::GetOk { fields: out },
        nested_runs,
        places,
        channel,
        versions: None,
    })
}

impl NativeService {
    /// The data frames of a request and the extents they are in: the
    /// segments a same-node put names (the `segments` envelope key),
    /// adopted from their leases without a copy, or the frames received.
    async fn received(
        &self,
        connection: u64,
        frames: Vec<Bytes>,
        extras: &native::Extras,
    ) -> Result<(Vec<Bytes>, Received), native::Reply> {
        let Some(segments) = &extras.segments else {
            let received = Received::frames(frames.get(1..).unwrap_or_default());
            return Ok((frames, received));
        };
        let Some((shm, _)) = &self.shm else {
            return Err(errors::shm(&ShmError::Disabled));
        };
        if frames.len() != 1 {
            return Err(errors::native_segments_with_frames());
        }
        let mut adopted: HashMap<&str, Arc<Extent>> = HashMap::new();
        let mut out = frames;
        for (name, offset, len) in segments {
            let extent = match adopted.get(name.as_str()) {
                Some(e) => e.clone(),
                None => {
                    let (whole, segment) = adopt(shm, name, connection)
                        .await
                        .map_err(|e| errors::shm(&e))?;
                    let e = Extent::in_segment(whole, segment);
                    adopted.insert(name, e.clone());
                    e
                }
            };
            let whole = extent.bytes();
            match offset.checked_add(*len) {
                Some(end) if end <= whole.len() as u64 => {
                    out.push(whole.slice(*offset as usize..end as usize))
                }
                _ => {
                    let e = ShmError::OutOfRange {
                        name: name.clone(),
                        offset: *offset,
                        len: *len,
                        size: whole.len() as u64,
                    };
                    return Err(errors::shm(&e));
                }
            }
        }
        Ok((out, Received::new(adopted.into_values())))
    }

    async fn serve_one(&self, connection: u64, frames: Vec<Bytes>) -> Message {
        let started = Instant::now();
        let mut op = "undecodable";
        // The id an error reply names when the request cannot be decoded,
        // read only then (frame 0 is not changed on the way).
        let head = frames.first().cloned();
        let fallback_id = || {
            head.as_ref()
                .and_then(|f0| native::request_id(std::slice::from_ref(f0)))
                .unwrap_or(0)
        };
        // The extras, and where the body lies: the request's decode below
        // steps over it instead of walking it again.
        let extras = match frames.first() {
            Some(f0) => native::decode_extras_and_body(f0, &self.limits),
            None => Ok(Default::default()),
        };
        let (id, answer) = match extras {
            Err(e) => (fallback_id(), errors::native_decode(&e).into()),
            Ok((extras, body)) => match self.received(connection, frames, &extras).await {
                Err(reply) => (fallback_id(), reply.into()),
                Ok((frames, received)) => {
                    match native::decode_request_at(&frames, &self.limits, &body) {
                        Ok(req) => {
                            op = req.op.name();
                            let span = tracing::Span::current();
                            span.record("id", req.id)
                                .record("op", op)
                                .record("rows", op_rows(&req.op));
                            (
                                req.id,
                                self.answer(req.id, req.op, &extras, &received, connection)
                                    .await,
                            )
                        }
                        Err(e) => (fallback_id(), errors::native_decode(&e).into()),
                    }
                }
            },
        };
        let (encoded, outcome) = match answer {
            Answer::Get(get) => match self.encode_get(id, get) {
                Ok((frames, Some((token, handles)))) => {
                    // Descriptors first, so they are there when the reply is.
                    match self.send_fds(&token, id, &handles).await {
                        Ok(()) => (Ok(frames), Outcome::Ok),
                        Err(reply) => (
                            native::encode_reply(id, &reply)
                                .map(Message::from)
                                .map_err(EncodeError::from),
                            Outcome::Error,
                        ),
                    }
                }
                other => (other.map(|(frames, _)| frames), Outcome::Ok),
            },
            Answer::Streamed(message) => (Ok(message), Outcome::Ok),
            Answer::Reply(reply) => {
                let outcome = if let native::Reply::Error { code, message } = &reply {
                    tracing::debug!(code = %code, error = %message, "error reply");
                    Outcome::Error
                } else {
                    Outcome::Ok
                };
                (
                    native::encode_reply(id, &reply)
                        .map(Message::from)
                        .map_err(EncodeError::from),
                    outcome,
                )
            }
        };
        let (frames, outcome) = match encoded {
            Ok(f) => (f, outcome),
            Err(e) => {
                tracing::debug!(error = %e, "reply not encodable");
                (
                    Message::from(
                        native::encode_reply(id, &errors::native_encode(&e)).unwrap_or_default(),
                    ),
                    Outcome::Error,
                )
            }
        };
        self.metrics.observe(
            Protocol::Native,
            op,
            outcome,
            started.elapsed(),
            frames.frames(),
        );
        frames
    }

    /// Sends the descriptors of `handles` for request `id` over the
    /// channel `token`.
    async fn send_fds(
        &self,
        token: &str,
        id: u64,
        handles: &[crate::shm::Handle],
    ) -> Result<(), native::Reply> {
        let Some((_, channels)) = &self.shm else {
            return Err(errors::shm(&ShmError::Disabled));
        };
        let names: Vec<&str> = handles.iter().map(|h| &**h.name()).collect();
        let fds: Vec<_> = handles.iter().map(|h| h.fd()).collect();
        channels
            .send(token, id, &names, &fds)
            .await
            .map_err(|e| errors::shm(&e))
    }

    /// Whether a same-node get of `got` is answered over the socket: its
    /// rows come to fewer than `[shm] inline_below` bytes.
    fn inline(&self, got: &[(String, Rows)]) -> bool {
        if self.inline_below == 0 {
            return false;
        }
        let mut bytes = 0u64;
        for (_, rows) in got {
            bytes = bytes.saturating_add(rows.byte_len());
            if bytes >= self.inline_below {
                return false;
            }
        }
        true
    }

    /// The channel a same-node `what` names, if it is open.
    fn channel<'a>(
        &self,
        extras: &'a native::Extras,
        what: &'static str,
    ) -> Result<&'a str, native::Reply> {
        let Some((_, channels)) = &self.shm else {
            return Err(errors::shm(&ShmError::Disabled));
        };
        let token = extras
            .channel
            .as_deref()
            .ok_or_else(|| errors::shm(&ShmError::NoChannel(what)))?;
        if !channels.is_open(token) {
            return Err(errors::shm(&ShmError::UnknownChannel(token.into())));
        }
        Ok(token)
    }

    async fn answer(
        &self,
        id: u64,
        op: native::Op,
        extras: &native::Extras,
        received: &Received,
        connection: u64,
    ) -> Answer {
        if let Some(unit) = extras.unit {
            // Boxed, like the other rare branches below: a future holding
            // them inline would make every request's future that large.
            return Box::pin(self.answer_unit(unit, op, extras, received)).await;
        }
        let m = &self.manager;
        let same_node = extras.same_node;
        match op {
            native::Op::Put {
                global_indexes,
                fields,
            } => put(m, global_indexes, fields, received).await,
            native::Op::Get {
                global_indexes,
                fields,
            } => {
                if !same_node
                    && let Some(positions) = m.peer_positions(&global_indexes)
                    && !positions.is_empty()
                {
                    return self
                        .forward_get(id, global_indexes, fields, positions)
                        .await;
                }
                // The rows, and whether they go as segments.
                let got = match (same_node, &self.shm) {
                    // The asked names, owned here, go with their rows.
                    (false, _) => m
                        .get_rows(&global_indexes, &fields)
                        .await
                        .map(|rows| (fields.into_iter().zip(rows).collect(), false))
                        .map_err(|e| errors::native(&e)),
                    (true, None) => Err(errors::shm(&ShmError::Disabled)),
                    // Small: over the socket, as any get (no segment made,
                    // none named; the reader reads either reply).
                    (true, Some((shm, _))) => match self.channel(extras, "get") {
                        Err(reply) => Err(reply),
                        Ok(_) => m
                            .get_shared(&global_indexes, &fields, shm, |g| self.inline(g))
                            .await
                            .map_err(|e| errors::native_shared(&e)),
                    },
                };
                match got {
                    Ok((got, shared)) => {
                        if same_node && !shared {
                            m.counters
                                .same_node_gets_inline
                                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        get_answer(got, extras.channel.clone().filter(|_| shared))
                    }
                    Err(reply) => reply.into(),
                }
            }
            native::Op::Lease { bytes } => Box::pin(self.lease(id, bytes, extras, connection))
                .await
                .into(),
            native::Op::Channel => match &self.shm {
                None => errors::shm(&ShmError::Disabled).into(),
                Some((_, channels)) => native::Reply::ChannelOk {
                    path: channels.path().display().to_string(),
                }
                .into(),
            },
            native::Op::Clear {
                global_indexes,
                fields,
            } => match m.clear(&global_indexes, fields.as_deref()).await {
                Ok(cleared) => native::Reply::ClearOk { cleared }.into(),
                Err(e) => errors::native(&e).into(),
            },
            native::Op::Stats => self.stats().into(),
            native::Op::Checkpoint { dir, journal } => {
                Box::pin(self.checkpoint(dir, false, journal)).await.into()
            }
            native::Op::Restore { dir } => Box::pin(self.checkpoint(dir, true, true)).await.into(),
            native::Op::Versions { .. } => errors::native_bad_request(
                "versions is a peer request: it names a unit (the envelope's unit key)".into(),
            )
            .into(),
        }
    }

    /// A peer's request for local unit `n` alone (the envelope's `unit`
    /// key): no routing and no selection policy, a put stored as it
    /// arrived (the peer's policies chose its rows), a get answered from
    /// the unit (with each row's version if asked), clears and versions.
    async fn answer_unit(
        &self,
        n: u64,
        op: native::Op,
        extras: &native::Extras,
        received: &Received,
    ) -> Answer {
        let bad = |message: String| -> Answer { errors::native_bad_request(message).into() };
        let Some((manager, unit)) = usize::try_from(n)
            .ok()
            .and_then(|i| self.units.get(i))
            .and_then(|m| Some((m, m.unit()?)))
        else {
            return bad(format!(
                "unit {n} does not exist: this stowd has {} local unit(s), numbered from 0",
                self.units.len()
            ));
        };
        if extras.same_node || extras.segments.is_some() {
            return bad(
                "a request naming a unit is a peer's: it goes over tcp, not shared memory".into(),
            );
        }
        let store = |e: crate::store::StoreError| errors::native(&e.into()).into();
        match op {
            native::Op::Put {
                global_indexes,
                fields,
            } => put(manager, global_indexes, fields, received).await,
            native::Op::Get {
                global_indexes,
                fields,
            } => {
                let seqs = Seq::from_indexes(&global_indexes);
                let mut versions = Vec::new();
                let got = unit.get_versioned(
                    &seqs,
                    &fields,
                    extras.with_versions.then_some(&mut versions),
                );
                match got {
                    Ok(rows) => {
                        let answer = get_answer(fields.into_iter().zip(rows).collect(), None);
                        match answer {
                            Answer::Get(mut get) if extras.with_versions => {
                                get.versions = Some((unit.incarnation(), versions));
                                Answer::Get(get)
                            }
                            other => other,
                        }
                    }
                    Err(e) => store(e),
                }
            }
            native::Op::Clear {
                global_indexes,
                fields,
            } => match manager.clear(&global_indexes, fields.as_deref()).await {
                Ok(cleared) => native::Reply::ClearOk { cleared }.into(),
                Err(e) => errors::native(&e).into(),
            },
            native::Op::Versions {
                global_indexes,
                fields,
            } => native::Reply::VersionsOk {
                incarnation: unit.incarnation(),
                versions: unit.versions(&Seq::from_indexes(&global_indexes), &fields),
            }
            .into(),
            other => bad(format!("op {} does not name a unit", other.name())),
        }
    }

    /// `checkpoint` / `restore` (`restore`) of every unit to or from the
    /// checkpoint directory `dir` ([`crate::manager::checkpoint`]); a
    /// checkpoint without `journaled` is a snapshot. Refused when a unit is
    /// remote.
    async fn checkpoint(&self, dir: String, restore: bool, journaled: bool) -> native::Reply {
        use crate::manager::checkpoint::CheckpointRunError;
        let what = if restore { "restore" } else { "checkpoint" };
        let m = &self.manager;
        let done = if restore {
            m.restore(&self.roots, &dir)
                .await
                .map(|(dir, r)| native::Reply::RestoreOk {
                    dir,
                    seq: r.seq,
                    rows: r.rows,
                    lost: r.lost,
                })
        } else {
            m.checkpoint(&self.roots, &dir, journaled)
                .await
                .map(|(dir, w)| native::Reply::CheckpointOk {
                    dir,
                    seq: w.seq,
                    rows: w.rows,
                    bytes: w.bytes,
                    files: w.files,
                })
        };
        match done {
            Ok(reply) => {
                tracing::info!(?reply, "{what} done");
                reply
            }
            Err(e) => {
                if let CheckpointRunError::Checkpoint(e) = &e {
                    tracing::warn!(error = %e, "{what} failed");
                }
                errors::native_checkpoint(what, &e)
            }
        }
    }

    /// A lease: a new segment whose writable descriptor goes over the
    /// caller's channel before the reply.
    async fn lease(
        &self,
        id: u64,
        bytes: u64,
        extras: &native::Extras,
        connection: u64,
    ) -> native::Reply {
        let Some((shm, channels)) = &self.shm else {
            return errors::shm(&ShmError::Disabled);
        };
        let token = match self.channel(extras, "lease") {
            Ok(t) => t,
            Err(reply) => return reply,
        };
        let (segment, ttl, fd) = match shm.lease(bytes, connection) {
            Ok(l) => l,
            Err(e) => return errors::shm(&e),
        };
        if let Err(e) = channels.send(token, id, &[&segment], &[fd.as_fd()]).await {
            shm.cancel(&segment);
            return errors::shm(&e);
        }
        native::Reply::LeaseOk {
            segment,
            bytes,
            ttl_ms: ttl.as_millis() as u64,
        }
    }
}

/// Adopts lease `name` for a put. A seal the kernel refuses with `EBUSY`
/// (the segment mapped writable, or a page of it pinned) is tried again
/// 10, 20 and 40 ms later before the lease is void: the kernel can hold a
/// page for a moment itself, and the race test (`test_races.py`, 4
/// writers through leases and pwritev, no mapping) saw a writer's put
/// refused so in 3 runs of 9. The waits are the runtime's, so no worker is
/// held; a writer that really keeps a mapping is refused 70 ms later than
/// before.
async fn adopt(
    shm: &SegmentStore,
    name: &str,
    connection: u64,
) -> Result<(Bytes, crate::shm::Handle), ShmError> {
    for wait in [10, 20, 40] {
        match shm.adopt_or_keep(name, connection, true) {
            Err(ShmError::StillMapped(_)) => tokio::time::sleep(Duration::from_millis(wait)).await,
            other => return other,
        }
    }
    shm.adopt(name, connection)
}

impl Service for NativeService {
    fn handle(
        self: Arc<Self>,
        caller: Caller,
        frames: Vec<Bytes>,
    ) -> BoxFuture<'static, Option<Message>> {
        let span = tracing::debug_span!(
            "request",
            endpoint = %self.endpoint,
            proto = Protocol::Native.label(),
            id = tracing::field::Empty,
            op = tracing::field::Empty,
            rows = tracing::field::Empty,
            bytes = frames.iter().map(Bytes::len).sum::<usize>(),
        );
        let frame0 = frames.first().map_or(0, Bytes::len);
        let offload = self.offload.clone();
        // A small request's future is the one box: the request's own state,
        // once (see `Offload::inline`).
        if offload.inline(frame0) {
            return Box::pin(
                async move {
                    Some(self.serve_one(caller.connection, frames).await).filter(|f| !f.is_empty())
                }
                .instrument(span),
            );
        }
        let work = Box::pin(
            async move { self.serve_one(caller.connection, frames).await }.instrument(span),
        );
        Box::pin(async move { Some(offload.run(frame0, work).await).filter(|f| !f.is_empty()) })
    }

    fn reject(
        self: Arc<Self>,
        _caller: Caller,
        head: Vec<Bytes>,
        reason: String,
    ) -> BoxFuture<'static, Option<Message>> {
        Box::pin(async move {
            let id = native::request_id(&head).unwrap_or(0);
            let frames = native::encode_reply(id, &errors::native_too_large(&reason)).ok()?;
            self.metrics.observe(
                Protocol::Native,
                "too_large",
                Outcome::Error,
                Duration::ZERO,
                frames.len(),
            );
            Some(frames.into())
        })
    }

    /// A connection that ended can no longer put its leases: their
    /// descriptors are closed now, not when the leases expire.
    fn closed(&self, connection: u64) {
        if let Some((shm, _)) = &self.shm {
            shm.release_connection(connection);
        }
    }

    fn security(&self) -> crate::transport::zmtp::Security<'_> {
        use crate::transport::zmtp::Security;
        match (&self.curve, &self.auth) {
            (Some(k), _) => Security::CurveServer {
                keys: &k.server,
                check: &**k,
            },
            (None, Some(a)) => Security::PlainServer(&**a),
            (None, None) => Security::Null,
        }
    }
}
