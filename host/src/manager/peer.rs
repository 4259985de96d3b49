//! The manager's side of peer units: a unit of another `stowd`, reached
//! through that stowd's native `stowage/1` endpoint with the envelope's
//! `unit` key (`stowage://host:port/<unit>` in `[router] units`).
//!
//! Against a TransferQueue unit (`manager/remote.rs`), rows travel as a few
//! large frames: a put sends each field's rows of a message as one part per
//! stored column (a slice of the extent where the rows are contiguous, one
//! copy where the selection left them strided), a get_ok carries the peer
//! unit's runs, and the frames a reply arrives in become the extents its
//! rows are kept in here (no copy). Puts are split into messages of at most
//! `[limits] max_message_bytes`, like a TransferQueue unit's. A get of rows
//! that are cached at their current version moves only the versions
//! ([`crate::cache`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use bytes::Bytes;

use crate::extent::Received;
use crate::plan::{Frame, FramePlan, PackLimits, PieceInfo};
use crate::policy::chain::{Chain, Decision};
use crate::policy::registry::Registry;
use crate::store::{Column, ColumnRef, PutField, Rows};
use crate::transport::{Message, Peer};
use crate::wire::native;

use super::{Manager, ManagerError};

/// A unit of another `stowd`, spoken to in `stowage/1`.
#[derive(Debug)]
pub struct PeerUnit {
    pub peer: Peer,
    /// The unit's number in that stowd.
    pub unit: u64,
    /// As configured: `stowage://host:port/<unit>`.
    pub name: String,
    ids: AtomicU64,
}

impl PeerUnit {
    /// `name` is `stowage://host:port/<unit>`; connections get identities
    /// `<prefix>_<n>`; large reply frames are received into `pool`'s
    /// buffers (the rows kept in the read cache live in them).
    pub fn new(
        name: &str,
        endpoint: String,
        unit: u64,
        identity_prefix: String,
        limits: crate::transport::zmtp::Limits,
        pool: Option<Arc<crate::transport::ReceivePool>>,
    ) -> PeerUnit {
        PeerUnit {
            peer: Peer::with_limits(endpoint, identity_prefix, limits).with_pool(pool),
            unit,
            name: name.to_string(),
            ids: AtomicU64::new(1),
        }
    }
}

/// Shows a fetch's reply frames to a get that forwards them to its client
/// while they arrive (`server/native/forward.rs`), or tells it that this
/// unit's rows will not come from one fetch of its own.
#[derive(Clone, Debug)]
pub struct FetchTap(tokio::sync::mpsc::UnboundedSender<TapEvent>);

/// What a [`FetchTap`] shows.
#[derive(Debug)]
pub enum TapEvent {
    /// The reply's next frame, frame 0 first.
    Frame(Bytes),
    /// The request was sent again on a fresh connection: the frames shown
    /// before belong to no reply.
    Retry,
    /// The rows come otherwise (kept in the cache, another get's fetch,
    /// versions asked first): nothing to forward.
    NotForwarded,
}

impl FetchTap {
    pub fn channel() -> (FetchTap, tokio::sync::mpsc::UnboundedReceiver<TapEvent>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        (FetchTap(tx), rx)
    }

    /// Shows `e` (to nobody, once the forwarder has given up).
    pub fn send(&self, e: TapEvent) {
        let _ = self.0.send(e);
    }
}

/// A peer's reply: its frames (the rows' extents), the envelope's extra
/// keys (versions) and the reply.
pub(super) struct PeerReply {
    pub frames: Vec<Bytes>,
    pub extras: native::Extras,
    pub reply: native::Reply,
}

/// A field's pieces, as [`frame_layout`] lays them out.
type Pieces<T> = smallvec::SmallVec<[T; 4]>;

/// The frame layout of a `stowage/1` message's fields (a get_ok, or a put
/// to a peer unit): per field, the packing chain groups the
/// field's pieces (the parts of a regular field, the runs of a nested
/// one) into frames; frames never mix fields. `nested_runs[i]`: the runs
/// of nested field `i` (an entry missing past the list's end: none).
pub fn frame_layout<N: AsRef<str>>(
    registry: &Registry,
    pack_limits: PackLimits,
    fields: &[(N, native::WireField)],
    nested_runs: &[Vec<(u64, u64)>],
) -> native::FrameLayout {
    let mut frames = Vec::with_capacity(fields.len());
    let tensor_fields = fields
        .iter()
        .filter(|(_, f)| !matches!(f, native::WireField::Values(_)))
        .count()
        .max(1);
    let mut limits = pack_limits;
    limits.max_frames = (limits.max_frames / tensor_fields as u32).max(1);
    // Every field's packing decision counted in the policy time at once.
    let timed = crate::policy::chain::PolicyTime::start();
    let mut last: Option<(&Chain, Pieces<PieceInfo>, Decision<FramePlan>)> = None;
    for (i, (name, field)) in fields.iter().enumerate() {
        // Inline: a field of a small get is a piece or a few, and two lists
        // made and freed a field were about 500 instructions of each.
        let (slices, pieces): (Pieces<native::RowSlice>, Pieces<PieceInfo>) = match field {
            native::WireField::Regular(p) => {
                // A part of more than a frame's bytes goes as several
                // pieces of whole rows, each at most a frame (rows larger
                // than that alone): every large frame stowd sends, and so
                // receives from another stowd, is of one size, which its
                // receive pool can reuse for the next (a router's puts
                // and its peers' replies alike).
                let per_piece = match p.row_bytes() as u64 {
                    0 => u64::MAX,
                    row => (limits.max_frame_bytes / row).max(1),
                };
                // The usual field of a small get: one part, one piece
                // (what the general path below makes of it, without its
                // iterator chain and two `extend`s, about 350 instructions
                // a field).
                if let [(_, rows)] = p.parts()
                    && (1..=per_piece).contains(rows)
                {
                    let slice = native::RowSlice {
                        field: i,
                        start: 0,
                        end: *rows,
                    };
                    let piece = PieceInfo {
                        byte_len: rows * p.row_bytes() as u64,
                        contiguous: true,
                    };
                    (smallvec::smallvec![slice], smallvec::smallvec![piece])
                } else {
                    let mut start = 0;
                    p.parts()
                        .iter()
                        .flat_map(|&(_, rows)| {
                            let (first, end) = (start, start + rows);
                            start = end;
                            // An empty part stays one empty piece.
                            let cuts = (first..end.max(first + 1)).step_by(per_piece as usize);
                            cuts.map(move |a| (a, end.min(a.saturating_add(per_piece))))
                        })
                        .map(|(a, b)| {
                            (
                                native::RowSlice {
                                    field: i,
                                    start: a,
                                    end: b,
                                },
                                PieceInfo {
                                    byte_len: (b - a) * p.row_bytes() as u64,
                                    contiguous: true,
                                },
                            )
                        })
                        .unzip()
                }
            }
            native::WireField::Nested(rows) => nested_runs
                .get(i)
                .map_or(&[][..], Vec::as_slice)
                .iter()
                .map(|&(a, b)| {
                    let run = &rows[a as usize..b as usize];
                    let bytes = run.iter().map(|t| t.payload_len() as u64).sum();
                    (
                        native::RowSlice {
                            field: i,
                            start: a,
                            end: b,
                        },
                        PieceInfo {
                            byte_len: bytes,
                            contiguous: true,
                        },
                    )
                })
                .unzip(),
            native::WireField::Values(_) => continue,
        };
        let chain = registry.pack_chain(name.as_ref());
        // The field before's decision, when this field asks the same chain
        // the same thing (`Chain::pack_repeat`).
        let decided = match &last {
            Some((c, p, d)) if std::ptr::eq(*c, chain) && *p == pieces => {
                chain.pack_repeat(&pieces, &limits, &timed, d)
            }
            _ => chain.pack_within(&pieces, &limits, &timed),
        };
        match decided {
            Ok(d) => {
                frames.extend(d.plan.frames.iter().map(|f| match f {
                    Frame::Single(k) => smallvec::smallvec![slices[*k as usize]],
                    Frame::Coalesced(ks) => ks.iter().map(|k| slices[*k as usize]).collect(),
                }));
                last = Some((chain, pieces, d));
            }
            // No plan within the budget: one frame per piece.
            Err(_) => {
                frames.extend(slices.into_iter().map(|s| smallvec::smallvec![s]));
                last = None;
            }
        }
    }
    native::FrameLayout { frames }
}

/// Rows of one field in one put message: zero copy where the rows are
/// contiguous in their column, one copy per strided column.
fn wire_rows(columns: &[Column], start: u64, end: u64) -> Result<native::WireField, ManagerError> {
    let bad = |e: native::Error| ManagerError::Internal(format!("rows for a peer unit: {e}"));
    let mut parts: Vec<(Bytes, u64)> = Vec::new();
    let mut regular: Option<(crate::tensor::Dtype, Vec<u64>)> = None;
    let mut all_regular = true;
    let mut at = 0u64;
    for c in columns {
        let rows = c.rows();
        let (a, b) = (start.max(at), end.min(at + rows));
        if a < b {
            match c {
                Column::Regular(r) => {
                    let t = r.rows_tensor((a - at) as usize, (b - a) as usize);
                    let shape = (t.dtype(), t.row_shape().to_vec());
                    if regular.get_or_insert_with(|| shape.clone()) != &shape {
                        all_regular = false;
                    }
                    if t.is_contiguous() || r.stride == r.row_bytes {
                        parts.push((t.contiguous_bytes(), b - a));
                    } else {
                        // Strided (rows the selection spread over units):
                        // a part per row, gathered into frames unjoined.
                        for k in 0..(b - a) as usize {
                            let at = r.offset + ((a - at) as usize + k) * r.stride;
                            parts.push((r.extent.bytes().slice(at..at + r.row_bytes), 1));
                        }
                    }
                }
                _ => all_regular = false,
            }
        }
        at += rows;
    }
    if all_regular && let Some((dtype, row_shape)) = regular {
        return native::RegularParts::new(dtype, row_shape, parts)
            .map(native::WireField::Regular)
            .map_err(bad);
    }
    // Nested rows, values, or a field whose columns differ: row by row.
    let mut cells = Vec::with_capacity((end - start) as usize);
    let mut at = 0u64;
    for c in columns {
        let rows = c.rows();
        for r in start.max(at)..end.min(at + rows) {
            cells.push(c.cell((r - at) as usize));
        }
        at += rows;
    }
    native::WireField::from_cells(cells).map_err(bad)
}

/// Per row of a get_ok field, the column it is in and its row there: the
/// frames it arrived in are its extents (no copy).
pub(super) fn reply_rows(field: native::WireField, received: &Received) -> Vec<(ColumnRef, u32)> {
    let mut out = Vec::with_capacity(field.rows() as usize);
    for column in Column::from_wire(field, received) {
        let column = ColumnRef::new(column);
        out.extend((0..column.rows() as u32).map(|r| (column.clone(), r)));
    }
    out
}

impl Manager {
    /// The receive limits a peer's reply is decoded with: a request's.
    fn peer_limits(&self) -> native::Limits {
        native::Limits {
            max_rows: self.limits.max_rows,
            max_fields: self.limits.max_fields,
            max_frames: self.limits.max_request_frames,
            max_message_bytes: self.limits.max_request_bytes,
        }
    }

    /// One request/reply with a peer unit; an error reply becomes
    /// [`ManagerError::Peer`] with the peer's code.
    pub(super) async fn exchange_peer(
        &self,
        p: &PeerUnit,
        op: native::Op,
        layout: Option<&native::FrameLayout>,
        with_versions: bool,
        tap: Option<(&FetchTap, Option<&Arc<()>>)>,
    ) -> Result<PeerReply, ManagerError> {
        let id = p.ids.fetch_add(1, Ordering::Relaxed);
        let op_name = op.name();
        let request = native::Request { id, op };
        // Frames of rows from several places are gathered, not joined.
        let encoded = match layout {
            Some(l) => native::encode_request_gathered(&request, l).map(|g| Message {
                parts: g.parts,
                per_frame: g.per_frame,
                tail: None,
            }),
            None => native::encode_request(&request).map(Message::from),
        };
        let encoding = |e: native::Error| {
            ManagerError::Internal(format!("encoding a request for {}: {e}", p.name))
        };
        let mut message = encoded.map_err(encoding)?;
        let extras = native::Extras {
            unit: Some(p.unit),
            with_versions,
            ..Default::default()
        };
        message.parts[0] = native::with_extras(&message.parts[0], &extras).map_err(encoding)?;
        let sent = message.frames();
        self.counters.messages_sent.fetch_add(1, Ordering::Relaxed);
        self.counters
            .frames_sent
            .fetch_add(sent as u64, Ordering::Relaxed);
        let span = tracing::debug_span!("remote", unit = %p.name, op = op_name, frames = sent);
        // A frame 0 that is not this request's reply, or lacks the versions
        // asked for, is not shown: the reply fails below, and a forwarding
        // get answers it as an error instead of beginning a reply.
        let (first, muted) = (AtomicBool::new(true), AtomicBool::new(false));
        let show = |e: crate::transport::Tapped<'_>| {
            let Some((tap, token)) = tap else { return };
            match e {
                crate::transport::Tapped::Frame(f) => {
                    if first.swap(false, Ordering::Relaxed) {
                        let ours = native::request_id(std::slice::from_ref(f)) == Some(id)
                            && (!with_versions
                                || native::decode_extras(f, &self.peer_limits())
                                    .is_ok_and(|x| x.versions.is_some()));
                        if !ours {
                            muted.store(true, Ordering::Relaxed);
                            tap.send(TapEvent::NotForwarded);
                        }
                    }
                    if !muted.load(Ordering::Relaxed) {
                        // Under the fetch's token, so that the read cache
                        // counts what the forwarding get holds.
                        let f = match token {
                            Some(t) => crate::cache::track(f, t),
                            None => f.clone(),
                        };
                        tap.send(TapEvent::Frame(f));
                    }
                }
                crate::transport::Tapped::Retry => {
                    first.store(true, Ordering::Relaxed);
                    muted.store(false, Ordering::Relaxed);
                    tap.send(TapEvent::Retry);
                }
            }
        };
        let request = p.peer.request_tapped(message, self.timeout, &show);
        let frames = tracing::Instrument::instrument(request, span)
            .await
            .map_err(|source| ManagerError::Transport {
                unit: p.name.clone(),
                source,
            })?;
        let limits = self.peer_limits();
        let undecodable = |e: native::Error| ManagerError::Remote {
            unit: p.name.clone(),
            message: format!("undecodable reply: {e}"),
            key_not_found: false,
        };
        let (got, reply) = native::decode_reply(&frames, &limits).map_err(undecodable)?;
        let extras = native::decode_extras(&frames[0], &limits).map_err(undecodable)?;
        if got != id {
            return Err(ManagerError::Remote {
                unit: p.name.clone(),
                message: format!("reply to request {got}, expected {id}"),
                key_not_found: false,
            });
        }
        if let native::Reply::Error { code, message } = reply {
            let code = native::code::ALL
                .into_iter()
                .find(|c| *c == code)
                .unwrap_or(native::code::INTERNAL);
            return Err(ManagerError::Peer {
                unit: p.name.clone(),
                code,
                message,
            });
        }
        Ok(PeerReply {
            frames,
            extras,
            reply,
        })
    }

    /// An unexpected reply from a peer.
    fn peer_unexpected(p: &PeerUnit, reply: &native::Reply) -> ManagerError {
        ManagerError::Remote {
            unit: p.name.clone(),
            message: format!("unexpected reply {}", reply.name()),
            key_not_found: false,
        }
    }

    /// Sends one unit's rows to a peer unit in messages of at most
    /// `max_message_bytes` (at least one row each).
    pub(super) async fn put_peer(
        &self,
        registry: &Registry,
        p: &PeerUnit,
        indexes: &[u64],
        fields: Vec<PutField>,
    ) -> Result<(), ManagerError> {
        let n = indexes.len() as u64;
        let bytes: u64 = fields
            .iter()
            .flat_map(|(_, c)| c.iter())
            .map(Column::byte_len)
            .sum();
        let per_message = match bytes / n.max(1) {
            0 => n,
            row => (self.limits.max_message_bytes / row).clamp(1, n),
        };
        let pack_limits = self.limits.pack_limits();
        let mut start = 0u64;
        while start < n {
            let end = (start + per_message).min(n);
            let mut wire = Vec::with_capacity(fields.len());
            for (name, columns) in &fields {
                wire.push((name.clone(), wire_rows(columns, start, end)?));
            }
            let nested_runs: Vec<Vec<(u64, u64)>> = wire
                .iter()
                .map(|(_, f)| match f {
                    native::WireField::Nested(rows) => {
                        (0..rows.len() as u64).map(|r| (r, r + 1)).collect()
                    }
                    _ => Vec::new(),
                })
                .collect();
            let layout = frame_layout(registry, pack_limits, &wire, &nested_runs);
            let op = native::Op::Put {
                global_indexes: indexes[start as usize..end as usize].to_vec(),
                fields: wire,
            };
            let got = self
                .exchange_peer(p, op, Some(&layout), false, None)
                .await?;
            if !matches!(got.reply, native::Reply::PutOk { .. }) {
                return Err(Self::peer_unexpected(p, &got.reply));
            }
            start = end;
        }
        if let Some(cache) = &self.cache {
            cache.forget(&p.name, indexes);
        }
        Ok(())
    }

    /// Clears rows (of `fields`, or all) in a peer unit; the number of
    /// (index, field) values it removed.
    pub(super) async fn clear_peer(
        &self,
        p: &PeerUnit,
        indexes: &[u64],
        fields: Option<&[String]>,
    ) -> Result<u64, ManagerError> {
        let op = native::Op::Clear {
            global_indexes: indexes.to_vec(),
            fields: fields.map(<[String]>::to_vec),
        };
        let got = self.exchange_peer(p, op, None, false, None).await?;
        if let Some(cache) = &self.cache {
            cache.forget(&p.name, indexes);
        }
        match got.reply {
            native::Reply::ClearOk { cleared } => Ok(cleared),
            other => Err(Self::peer_unexpected(p, &other)),
        }
    }

    /// Fetches `indexes` of `fields` from a peer unit: per field, per row,
    /// the column it is in here (the reply's frames, no copy); with the
    /// rows' versions if `with_versions` (incarnation, field-major), the
    /// read cache's fetch, whose frames are then tracked (the `Weak`:
    /// alive while any slice of them is; see `cache::tracked`).
    #[allow(clippy::type_complexity)]
    pub(crate) async fn fetch_peer(
        &self,
        p: &PeerUnit,
        indexes: &[u64],
        fields: &[String],
        with_versions: bool,
        tap: Option<&FetchTap>,
    ) -> Result<
        (
            Vec<Vec<(ColumnRef, u32)>>,
            Option<(u64, Vec<u64>)>,
            Weak<()>,
        ),
        ManagerError,
    > {
        let op = native::Op::Get {
            global_indexes: native::Indexes::from_list(indexes),
            fields: fields.to_vec(),
        };
        // The cache's fetches (with versions) hold a token in every slice
        // of their frames, those shown to `tap` as well, so that the cache
        // sees when gets no longer hold their rows (see `cache::tracked`).
        let token = with_versions.then(|| Arc::new(()));
        let got = self
            .exchange_peer(p, op, None, with_versions, tap.map(|t| (t, token.as_ref())))
            .await?;
        let native::Reply::GetOk { fields: wire } = got.reply else {
            return Err(Self::peer_unexpected(p, &got.reply));
        };
        let bad = |message: String| ManagerError::Remote {
            unit: p.name.clone(),
            message,
            key_not_found: false,
        };
        if wire.len() != fields.len() || wire.iter().zip(fields).any(|((n, _), f)| n != f) {
            return Err(bad("the reply's fields are not the ones asked for".into()));
        }
        let data = got.frames.get(1..).unwrap_or_default();
        let (received, alive) = match token {
            Some(token) => {
                let (frames, alive) = crate::cache::tracked(data, token);
                (Received::frames(&frames), alive)
            }
            None => (Received::frames(data), Weak::new()),
        };
        let mut out = Vec::with_capacity(wire.len());
        for (_, field) in wire {
            if field.rows() != indexes.len() as u64 {
                return Err(bad(format!(
                    "returned {} rows for {} indexes",
                    field.rows(),
                    indexes.len()
                )));
            }
            out.push(reply_rows(field, &received));
        }
        let versions = match (with_versions, got.extras.versions) {
            (false, _) => None,
            (true, Some(v)) if v.1.len() == indexes.len() * fields.len() => Some(v),
            (true, _) => return Err(bad("the reply lacks the rows' versions".into())),
        };
        Ok((out, versions, alive))
    }

    /// The versions of `indexes` of `fields` in a peer unit (see
    /// [`crate::store::Unit::versions`]).
    pub(crate) async fn versions_peer(
        &self,
        p: &PeerUnit,
        indexes: &[u64],
        fields: &[String],
    ) -> Result<(u64, Vec<u64>), ManagerError> {
        let op = native::Op::Versions {
            global_indexes: native::Indexes::from_list(indexes),
            fields: fields.to_vec(),
        };
        let got = self.exchange_peer(p, op, None, false, None).await?;
        match got.reply {
            native::Reply::VersionsOk {
                incarnation,
                versions,
            } if versions.len() == indexes.len() * fields.len() => Ok((incarnation, versions)),
            other => Err(Self::peer_unexpected(p, &other)),
        }
    }

    /// Rows of a peer unit for a get: per field, a [`Rows`] answering
    /// `positions` (one per index). Through the read cache if there is one.
    pub(super) async fn get_peer(
        &self,
        p: &Arc<PeerUnit>,
        indexes: &[u64],
        positions: &[u64],
        fields: &[String],
        tap: Option<&FetchTap>,
    ) -> Result<Vec<Rows>, ManagerError> {
        let per_field = match &self.cache {
            Some(cache) => cache.get(self, &**p, indexes, fields, tap).await?,
            None => self.fetch_peer(p, indexes, fields, false, tap).await?.0,
        };
        Ok(per_field
            .into_iter()
            .map(|rows| rows_at(rows, positions))
            .collect())
    }
}

/// A field's rows (column, row per index) as [`Rows`] answering `positions`.
pub(super) fn rows_at(rows: Vec<(ColumnRef, u32)>, positions: &[u64]) -> Rows {
    let mut out = Rows::default();
    let mut numbered: rustc_hash::FxHashMap<*const Column, u32> = Default::default();
    for ((column, row), &pos) in rows.into_iter().zip(positions) {
        let n = *numbered
            .entry(std::ptr::from_ref::<Column>(&column))
            .or_insert_with(|| {
                out.columns.push(column.clone());
                (out.columns.len() - 1) as u32
            });
        out.push(crate::store::Piece {
            pos,
            pos_step: 1,
            column: n,
            row,
            count: 1,
        });
    }
    out
}

/// The read cache fetches a peer unit's rows through the manager.
impl crate::cache::Source for Manager {
    type Peer = PeerUnit;
    type Tap = FetchTap;
    type Error = ManagerError;

    fn peer_name(p: &PeerUnit) -> &str {
        &p.name
    }

    fn not_forwarded(tap: &FetchTap) {
        tap.send(TapEvent::NotForwarded);
    }

    fn not_fetched() -> ManagerError {
        ManagerError::Internal("a row of a peer unit was not fetched".into())
    }

    async fn versions(
        &self,
        p: &PeerUnit,
        indexes: &[u64],
        fields: &[String],
    ) -> Result<(u64, Vec<u64>), ManagerError> {
        self.versions_peer(p, indexes, fields).await
    }

    async fn fetch(
        &self,
        p: &PeerUnit,
        indexes: &[u64],
        fields: &[String],
        tap: Option<&FetchTap>,
    ) -> Result<crate::cache::PeerRows, ManagerError> {
        let (rows, versions, alive) = self.fetch_peer(p, indexes, fields, true, tap).await?;
        let (incarnation, versions) = versions.expect("asked with versions");
        Ok(crate::cache::PeerRows {
            rows,
            incarnation,
            versions,
            alive,
        })
    }
}
