//! A router's get forwarded while it arrives: when every row of a get is
//! held by peer units (`stowage://` in `[router] units`) and each unit's
//! rows come in one fetch of this get's own (none kept in the read cache or
//! being fetched by another get), the reply's frame 0 is written as soon
//! as every peer's frame 0 is in, and each data frame as soon as the peer
//! frames it is made of are. Receiving from the peers and sending to the
//! client overlap, instead of one following the other: 2 GiB gets through
//! a router went from 0.68-0.79 of a two-hop tcp relay measured in the same
//! run to 0.85-1.32 in 6 of 8 runs (`docs/benchmarks.md`, "Peer units: one
//! stowd routing to another's units", with the two runs that fell below).
//!
//! The reply is the one [`super::get_answer`] would give for the same rows
//! (the layout is built from the peers' frame 0 alone: same field kinds,
//! dtypes, shapes, the packing chain planning the frames from the same
//! pieces, the rows in request order), and the fetch itself runs as any
//! other: checked whole, its rows kept in the read cache.
//!
//! What changes is failure after frame 0 was sent: a message begun cannot
//! be taken back, so if a peer's reply then fails (the peer dies, its
//! frames do not match its frame 0, the fetch's checks refuse it), the
//! client's connection is closed instead of an error reply being sent; the
//! last frame is sent only once the fetch has succeeded, so a client never
//! takes a message for whole that was not. A failure before every frame 0
//! is in (an error reply from a peer, a timeout, a frame 0 that does not
//! answer the request) is an error reply, as without forwarding.
//!
//! A forwarded get counts in `stowd_request_duration_seconds` up to its
//! frame 0 (the rest is the transfer, as for any reply); its data frames
//! count in `stowd_frames_sent_total{to="client"}` as they go.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::task::JoinHandle;

use super::{Answer, NativeService, get_answer};
use crate::manager::{FetchTap, ManagerError, TapEvent};
use crate::plan::{Frame, PieceInfo};
use crate::policy::registry::Registry;
use crate::server::errors;
use crate::store::Rows;
use crate::tensor::Dtype;
use crate::transport::{Chunk, Message, Tail};
use crate::wire::batch::Value;
use crate::wire::native::{self, FieldLayout, PartLayout, ReplyLayout, RowLayout};

type Got = Result<Vec<(String, Rows)>, ManagerError>;

/// Bytes of frames written in one chunk when they are there already.
const CHUNK_BYTES: usize = 8 << 20;

/// One peer unit's fetch, as it arrives.
struct Source {
    /// Request positions of its rows, in the order it was asked for them.
    positions: Vec<u64>,
    rx: UnboundedReceiver<TapEvent>,
    /// Its data frames so far (data frame `j` is `frames[j - 1]`).
    frames: Vec<Bytes>,
    /// Per field: its frame 0's layout.
    layout: Vec<(std::sync::Arc<str>, FieldLayout)>,
}

impl Source {
    /// The next event, frames pushed; `Err` says why none can come.
    async fn next_frame(&mut self) -> Result<(), String> {
        match self.rx.recv().await {
            Some(TapEvent::Frame(b)) => {
                self.frames.push(b);
                Ok(())
            }
            Some(TapEvent::Retry) => Err("the peer's reply began again on a new connection".into()),
            Some(TapEvent::NotForwarded) | None => Err("the peer's reply ended early".into()),
        }
    }
}

/// Where a piece of an outgoing frame comes from: source, its data frame
/// (1-based), offset, length.
#[derive(Clone, Copy, Debug)]
struct Src {
    source: u32,
    frame: u64,
    offset: u64,
    len: u64,
}

/// One row of a field, as some source holds it.
enum Row<'a> {
    Tensor {
        dtype: Dtype,
        shape: &'a [u64],
        at: Src,
    },
    Value(&'a Value),
}

impl NativeService {
    /// A get whose rows are all held by peer units (`positions`, from
    /// [`crate::manager::Manager::peer_positions`]), forwarded as it
    /// arrives if it can be (the module doc), answered as usual if not.
    pub(super) async fn forward_get(
        &self,
        id: u64,
        global_indexes: native::Indexes,
        fields: Vec<String>,
        positions: Vec<(usize, Vec<u64>)>,
    ) -> Answer {
        let m = self.manager.clone();
        let mut taps: Vec<Option<FetchTap>> = vec![None; m.targets().len()];
        let mut sources = Vec::with_capacity(positions.len());
        for (t, positions) in positions {
            let (tap, rx) = FetchTap::channel();
            taps[t] = Some(tap);
            sources.push(Source {
                positions,
                rx,
                frames: Vec::new(),
                layout: Vec::new(),
            });
        }
        let asked = fields.clone();
        let task: JoinHandle<Got> = tokio::spawn(async move {
            let got = m.get_tapped(&global_indexes, &asked, &taps).await;
            drop(taps);
            got
        });
        // Every source's frame 0, checked against the request.
        for s in &mut sources {
            let head = loop {
                match s.rx.recv().await {
                    Some(TapEvent::Frame(b)) => break Some(b),
                    Some(TapEvent::Retry) => continue,
                    Some(TapEvent::NotForwarded) | None => break None,
                }
            };
            // With the read cache, the fetch asked for the rows' versions.
            let versions_ok = |h: &Bytes| {
                self.manager.cache().is_none()
                    || native::decode_extras(h, &self.limits).is_ok_and(|x| {
                        x.versions.is_some_and(|(_, v)| {
                            v.len() as u64 == s.positions.len() as u64 * fields.len() as u64
                        })
                    })
            };
            let layout = head.filter(versions_ok).and_then(|h| {
                match native::decode_reply_layout(&h, &self.limits) {
                    Ok((_, ReplyLayout::GetOk(l))) => Some(l),
                    _ => None,
                }
            });
            match layout {
                Some(l)
                    if l.len() == fields.len()
                        && l.iter().zip(&fields).all(|((name, f), want)| {
                            **name == **want && f.rows() == s.positions.len() as u64
                        }) =>
                {
                    s.layout = l
                }
                _ => return answered(task).await,
            }
        }
        let n = sources.iter().map(|s| s.positions.len() as u64).sum();
        let registry = self.manager.registry();
        // No plan (the usual path's error), or values only (nothing to
        // forward, and nothing gained): answered as usual.
        let plan = plan_reply(&registry, self.pack_limits, &fields, &sources, n)
            .filter(|p| !p.frames.is_empty());
        let Some((plan, Ok(head))) = plan.map(|p| {
            let head = native::encode_get_ok_head(id, &p.fields);
            (p, head)
        }) else {
            return answered(task).await;
        };
        let counters = &self.manager.counters;
        counters.gets_forwarded.fetch_add(1, Ordering::Relaxed);
        let (tx, tail) = Tail::channel(2);
        let (dropped, metrics) = (self.manager.clone(), self.metrics.clone());
        tokio::spawn(async move {
            if let Err(why) = send_frames(plan.frames, sources, task, &tx, &metrics).await {
                dropped
                    .counters
                    .gets_forward_dropped
                    .fetch_add(1, Ordering::Relaxed);
                let _ = tx.send(Err(why)).await;
            }
        });
        Answer::Streamed(Message {
            parts: vec![head],
            per_frame: None,
            tail: Some(tail),
        })
    }
}

/// The get answered as without forwarding, once its task is done.
async fn answered(task: JoinHandle<Got>) -> Answer {
    match task.await {
        Ok(Ok(got)) => get_answer(got, None),
        Ok(Err(e)) => errors::native(&e).into(),
        Err(e) => errors::native(&ManagerError::Internal(format!("a get failed: {e}"))).into(),
    }
}

/// A forwarded reply's layout: per field its descriptor, and per data
/// frame the pieces of source frames it is made of.
struct ReplyPlan {
    fields: Vec<(String, FieldLayout)>,
    frames: Vec<Vec<Src>>,
}

/// Plans the reply from the sources' frame 0 as [`super::get_answer`] and
/// the packing chain would from the rows themselves; `None` where that
/// reply would be an error (a field mixing dtypes, or values and tensors),
/// which the usual path then gives.
fn plan_reply(
    registry: &Registry,
    pack_limits: crate::plan::PackLimits,
    fields: &[String],
    sources: &[Source],
    n: u64,
) -> Option<ReplyPlan> {
    let tensor_fields = (0..fields.len())
        .filter(|&f| {
            !sources
                .iter()
                .all(|s| matches!(s.layout[f].1, FieldLayout::Values(_)))
        })
        .count()
        .max(1);
    let mut limits = pack_limits;
    limits.max_frames = (limits.max_frames / tensor_fields as u32).max(1);
    let mut out = ReplyPlan {
        fields: Vec::with_capacity(fields.len()),
        frames: Vec::new(),
    };
    for (f, name) in fields.iter().enumerate() {
        let rows = field_rows(sources, f, n)?;
        let layout = match rows.first()? {
            Row::Value(_) => {
                let values = rows.iter().map(|r| match r {
                    Row::Value(v) => Some((*v).clone()),
                    Row::Tensor { .. } => None,
                });
                FieldLayout::Values(values.collect::<Option<_>>()?)
            }
            Row::Tensor { dtype, shape, .. } => {
                let (dtype, first_shape) = (*dtype, *shape);
                let mut same_shape = true;
                for r in &rows {
                    match r {
                        Row::Tensor {
                            dtype: d, shape, ..
                        } if *d == dtype => {
                            same_shape &= *shape == first_shape;
                        }
                        _ => return None,
                    }
                }
                tensor_layout(
                    registry,
                    &limits,
                    name,
                    &rows,
                    dtype,
                    same_shape.then_some(first_shape),
                    &mut out.frames,
                )
            }
        };
        out.fields.push((name.clone(), layout));
    }
    Some(out)
}

/// A field's rows in request order, each from the source that holds it.
fn field_rows<'a>(sources: &'a [Source], f: usize, n: u64) -> Option<Vec<Row<'a>>> {
    let mut rows: Vec<Option<Row<'a>>> = (0..n).map(|_| None).collect();
    for (k, s) in sources.iter().enumerate() {
        let mut i = 0usize;
        let mut place = |row: Row<'a>| -> Option<()> {
            let pos = *s.positions.get(i)? as usize;
            i += 1;
            let slot = rows.get_mut(pos)?;
            slot.is_none().then_some(())?;
            *slot = Some(row);
            Some(())
        };
        let source = k as u32;
        match &s.layout[f].1 {
            FieldLayout::Regular {
                dtype,
                shape,
                parts,
            } => {
                let row_shape = &shape[1..];
                for p in parts {
                    let each = p.len.checked_div(p.rows).unwrap_or(0);
                    for r in 0..p.rows {
                        place(Row::Tensor {
                            dtype: *dtype,
                            shape: row_shape,
                            at: Src {
                                source,
                                frame: p.frame,
                                offset: p.offset + r * each,
                                len: each,
                            },
                        })?;
                    }
                }
            }
            FieldLayout::Nested { dtype, rows: rs } => {
                for r in rs {
                    place(Row::Tensor {
                        dtype: *dtype,
                        shape: &r.shape,
                        at: Src {
                            source,
                            frame: r.frame,
                            offset: r.offset,
                            len: r.len,
                        },
                    })?;
                }
            }
            FieldLayout::Values(values) => {
                for v in values {
                    place(Row::Value(v))?;
                }
            }
        }
    }
    rows.into_iter().collect()
}

/// A tensor field's descriptor, its frames appended to `frames`: the rows
/// in runs that lie back to back in one source frame (a regular field's
/// cut at a frame's bytes, as [`crate::manager::frame_layout`] cuts its
/// parts), grouped into frames by the field's packing chain.
fn tensor_layout(
    registry: &Registry,
    limits: &crate::plan::PackLimits,
    name: &str,
    rows: &[Row<'_>],
    dtype: Dtype,
    regular: Option<&[u64]>,
    frames: &mut Vec<Vec<Src>>,
) -> FieldLayout {
    let at = |r: &Row<'_>| match r {
        Row::Tensor { at, .. } => *at,
        Row::Value(_) => unreachable!("a tensor field's rows are tensors"),
    };
    // (first row, rows, where they lie)
    let mut pieces: Vec<(usize, u64, Src)> = Vec::new();
    for (i, r) in rows.iter().enumerate() {
        let a = at(r);
        if let Some((_, count, run)) = pieces.last_mut()
            && run.source == a.source
            && run.frame == a.frame
            && run.offset + run.len == a.offset
            && run.len + a.len <= limits.max_frame_bytes.max(a.len)
        {
            *count += 1;
            run.len += a.len;
            continue;
        }
        pieces.push((i, 1, a));
    }
    let infos: Vec<PieceInfo> = pieces
        .iter()
        .map(|(_, _, p)| PieceInfo {
            byte_len: p.len,
            contiguous: true,
        })
        .collect();
    let planned: Vec<Vec<u32>> = match registry.pack_chain(name).pack(&infos, limits) {
        Ok(d) => d
            .plan
            .frames
            .iter()
            .map(|f| match f {
                Frame::Single(k) => vec![*k],
                Frame::Coalesced(ks) => ks.clone(),
            })
            .collect(),
        // No plan within the budget: one frame per piece.
        Err(_) => (0..pieces.len() as u32).map(|k| vec![k]).collect(),
    };
    // Where each piece lands: (data frame, offset in it).
    let mut landed = vec![(0u64, 0u64); pieces.len()];
    for ks in planned {
        let number = frames.len() as u64 + 1;
        let mut offset = 0;
        let mut frame = Vec::with_capacity(ks.len());
        for k in ks {
            let p = pieces[k as usize].2;
            landed[k as usize] = (number, offset);
            offset += p.len;
            frame.push(p);
        }
        frames.push(frame);
    }
    match regular {
        Some(row_shape) => {
            let mut parts = native::Parts::with_capacity(pieces.len());
            for ((_, count, p), (frame, offset)) in pieces.iter().zip(&landed) {
                if let Some(last) = parts.last_mut()
                    && last.frame == *frame
                    && last.offset + last.len == *offset
                {
                    last.len += p.len;
                    last.rows += count;
                    continue;
                }
                parts.push(PartLayout {
                    frame: *frame,
                    offset: *offset,
                    len: p.len,
                    rows: *count,
                });
            }
            let mut shape = native::Dims::with_capacity(row_shape.len() + 1);
            shape.push(rows.len() as u64);
            shape.extend_from_slice(row_shape);
            FieldLayout::Regular {
                dtype,
                shape,
                parts,
            }
        }
        None => {
            let mut out = Vec::with_capacity(rows.len());
            for ((first, count, p), (frame, offset)) in pieces.iter().zip(&landed) {
                for r in &rows[*first..*first + *count as usize] {
                    let Row::Tensor { shape, at, .. } = r else {
                        unreachable!("a tensor field's rows are tensors")
                    };
                    out.push(RowLayout {
                        shape: shape.to_vec(),
                        frame: *frame,
                        offset: offset + (at.offset - p.offset),
                        len: at.len,
                    });
                }
            }
            FieldLayout::Nested { dtype, rows: out }
        }
    }
}

/// Sends the reply's data frames as the source frames they are made of
/// arrive; the last only once the get's task succeeded. `Err` says why the
/// reply cannot be finished.
async fn send_frames(
    frames: Vec<Vec<Src>>,
    mut sources: Vec<Source>,
    task: JoinHandle<Got>,
    tx: &crate::transport::TailSender,
    metrics: &crate::metrics::Metrics,
) -> Result<(), String> {
    let total = frames.len();
    let mut k = 0;
    let mut task = Some(task);
    while k < total {
        let (mut parts, mut per_frame, mut bytes) = (Vec::new(), Vec::new(), 0usize);
        while k < total && bytes < CHUNK_BYTES {
            let ready = |sources: &[Source]| {
                frames[k]
                    .iter()
                    .all(|p| sources[p.source as usize].frames.len() as u64 >= p.frame)
            };
            if !ready(&sources) {
                if !per_frame.is_empty() {
                    break; // send what is there; then wait
                }
                for p in &frames[k] {
                    let s = &mut sources[p.source as usize];
                    while (s.frames.len() as u64) < p.frame {
                        s.next_frame().await?;
                    }
                }
            }
            let mut count = 0u32;
            for p in &frames[k] {
                let f = &sources[p.source as usize].frames[p.frame as usize - 1];
                let end = p.offset + p.len;
                if end > f.len() as u64 {
                    return Err(format!(
                        "a peer's data frame {} has {} bytes, its frame 0 places rows up to byte {end}",
                        p.frame,
                        f.len()
                    ));
                }
                if p.len > 0 {
                    parts.push(f.slice(p.offset as usize..end as usize));
                    count += 1;
                }
                bytes += p.len as usize;
            }
            per_frame.push(count);
            k += 1;
        }
        let last = k == total;
        if last && let Some(task) = task.take() {
            match task.await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => return Err(format!("the get failed after its reply began: {e}")),
                Err(e) => return Err(format!("the get failed after its reply began: {e}")),
            }
        }
        metrics
            .reply_frames
            .fetch_add(per_frame.len() as u64, Ordering::Relaxed);
        let chunk = Chunk {
            parts,
            per_frame,
            last,
        };
        tx.send(Ok(chunk))
            .await
            .map_err(|_| "the client's connection is gone".to_string())?;
    }
    Ok(())
}
