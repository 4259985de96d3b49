//! The get_ok reply of the native endpoint: a field's rows turned into a
//! wire field without a copy ([`get_field`]), the buffers (extents or
//! shared-memory segments) those rows are slices of ([`Places`]), the frame
//! layout the packing chain plans per field, and the encoding: frames over
//! the socket, or for a same-node reader whole segments named in frame 0.

use std::collections::HashSet;

use bytes::Bytes;

use super::NativeService;
use crate::manager::frame_layout;
use crate::server::errors::EncodeError;
use crate::shm::Handle;
use crate::store::{Rows, Run};
use crate::tensor::Tensor;
use crate::transport::Message;
use crate::wire::native;

/// The buffers (extents, or the segments they are in) a reply's rows are
/// slices of, by address: built per reply from the runs it sends, so that
/// the encoder can send rows that lie back to back as one slice, and a
/// same-node reply can name each segment once.
#[derive(Default)]
pub(super) struct Places {
    /// (start address, buffer, segment name), sorted by address once filled.
    sorted: Vec<(usize, Bytes, Option<Handle>)>,
    /// The starts in `sorted`, once it holds more than [`Places::SCAN`]
    /// (a small reply's few are found by a scan, with no set to make).
    /// Hashed by foldhash, not SipHash: a reply adds each field's runs'
    /// buffers, and SipHash was about 150 instructions of each.
    seen: HashSet<usize, foldhash::fast::RandomState>,
}

impl Places {
    /// Most places found by a scan of `sorted`.
    const SCAN: usize = 8;

    fn add(&mut self, base: &Bytes, segment: &Option<Handle>) {
        let start = base.as_ptr() as usize;
        if base.is_empty() {
            return;
        }
        let new = if self.sorted.len() < Self::SCAN {
            !self.sorted.iter().any(|(s, _, _)| *s == start)
        } else {
            if self.seen.is_empty() {
                self.seen.extend(self.sorted.iter().map(|(s, _, _)| *s));
            }
            self.seen.insert(start)
        };
        if new {
            self.sorted.push((start, base.clone(), segment.clone()));
        }
    }

    pub(super) fn seal(&mut self) {
        self.sorted.sort_by_key(|(start, _, _)| *start);
    }

    /// The buffer that holds `len` bytes from `p`, its segment, and the
    /// bytes' offset in it.
    fn find(&self, p: usize, len: usize) -> Option<(&Bytes, &Option<Handle>, usize)> {
        let i = self
            .sorted
            .partition_point(|(start, _, _)| *start <= p)
            .checked_sub(1)?;
        let (start, base, segment) = &self.sorted[i];
        (p + len <= start + base.len()).then_some((base, segment, p - start))
    }

    /// `len` bytes from `p` as one slice of their buffer.
    fn span(&self, p: *const u8, len: usize) -> Option<Bytes> {
        let (base, _, at) = self.find(p as usize, len)?;
        Some(base.slice(at..at + len))
    }

    /// The whole buffer that holds `b`, and where `b` starts in it.
    fn enclose(&self, b: &Bytes) -> Option<(Bytes, u64)> {
        if b.is_empty() {
            return None;
        }
        let (base, _, at) = self.find(b.as_ptr() as usize, b.len())?;
        Some((base.clone(), at as u64))
    }

    /// The segment a whole-buffer frame is, if it is one.
    fn segment(&self, frame: &Bytes) -> Option<Handle> {
        let (_, segment, at) = self.find(frame.as_ptr() as usize, frame.len())?;
        (at == 0).then(|| segment.clone()).flatten()
    }
}

/// A get_ok field and, for a nested field, its rows grouped into runs
/// `[a, b)` that lie back to back in one place.
pub(super) struct GetField {
    pub(super) wire: native::WireField,
    pub(super) nested_runs: Vec<(u64, u64)>,
}

/// The wire form of a field's rows, zero copy: rows of one dtype and row
/// shape become a regular field with one part per run; rows of one dtype
/// and several shapes a nested field; values a values field.
pub(super) fn get_field(
    rows: &Rows,
    places: &mut Places,
    snapshots: &mut crate::store::Snapshots,
) -> Result<GetField, native::Error> {
    let runs = rows.runs_with(snapshots);
    let nothing = || GetField {
        wire: native::WireField::Values(Vec::new()),
        nested_runs: Vec::new(),
    };
    let Some(first) = runs.first() else {
        return Ok(nothing());
    };
    let Run::Tensor {
        dtype, row_shape, ..
    } = first
    else {
        let values = runs.into_iter().map(|r| match r {
            Run::Value(v) => Ok(v),
            Run::Tensor { .. } => Err(native::Error::MixedField(
                "its rows mix tensors and values".into(),
            )),
        });
        return Ok(GetField {
            wire: native::WireField::Values(values.collect::<Result<_, _>>()?),
            nested_runs: Vec::new(),
        });
    };
    let (dtype, row_shape) = (*dtype, row_shape.clone());
    let mut same_shape = true;
    for r in &runs {
        match r {
            Run::Value(_) => {
                return Err(native::Error::MixedField(
                    "its rows mix tensors and values".into(),
                ));
            }
            Run::Tensor {
                dtype: d,
                row_shape: s,
                base,
                segment,
                ..
            } => {
                if *d != dtype {
                    return Err(native::Error::MixedField(format!(
                        "its rows mix dtypes {dtype} and {d}"
                    )));
                }
                same_shape &= *s == row_shape;
                places.add(base, segment);
            }
        }
    }
    if same_shape {
        let parts: native::PartBytes = runs
            .iter()
            .map(|r| match r {
                Run::Tensor { rows, .. } => (r.bytes(), *rows),
                Run::Value(_) => unreachable!("checked above"),
            })
            .collect();
        let wire = native::WireField::Regular(native::RegularParts::new(
            dtype,
            native::Dims::from(&row_shape[..]),
            parts,
        )?);
        return Ok(GetField {
            wire,
            nested_runs: Vec::new(),
        });
    }
    let mut tensors = Vec::with_capacity(rows.len());
    let mut nested_runs = Vec::with_capacity(runs.len());
    for r in &runs {
        let Run::Tensor {
            rows,
            row_bytes,
            dtype,
            row_shape,
            ..
        } = r
        else {
            unreachable!("checked above")
        };
        let bytes = r.bytes();
        let a = tensors.len() as u64;
        for i in 0..*rows as usize {
            let row = bytes.slice(i * row_bytes..(i + 1) * row_bytes);
            tensors.push(
                Tensor::contiguous_of(row, *dtype, row_shape)
                    .map_err(|e| native::Error::MixedField(e.to_string()))?,
            );
        }
        nested_runs.push((a, tensors.len() as u64));
    }
    Ok(GetField {
        wire: native::WireField::Nested(tensors),
        nested_runs,
    })
}

/// A get_ok ready to encode: the reply, the nested runs per field, and the
/// places its rows are in.
pub(super) struct GetReply {
    pub(super) reply: native::Reply,
    pub(super) nested_runs: Vec<Vec<(u64, u64)>>,
    pub(super) places: Places,
    /// For a same-node reader: the token of the channel its segments'
    /// descriptors go over.
    pub(super) channel: Option<String>,
    /// For a peer that asked: the unit's incarnation and each row's
    /// version, added to frame 0.
    pub(super) versions: Option<(u64, Vec<u64>)>,
}

/// A same-node reply's descriptors: the channel's token and the segments.
pub(super) type Descriptors = (String, Vec<Handle>);

impl NativeService {
    /// Encodes a get_ok: over the socket, frames planned by the packing
    /// chain from the runs; for a same-node reader, one whole segment per
    /// frame, named in frame 0 instead of sent, with the segments whose
    /// descriptors the reader gets (each once, in order of first mention).
    /// Returns the frames, and for a same-node reader its channel's token
    /// and the segments whose descriptors go over it (none if every frame
    /// is empty).
    pub(super) fn encode_get(
        &self,
        id: u64,
        get: GetReply,
    ) -> Result<(Message, Option<Descriptors>), EncodeError> {
        let GetReply {
            reply,
            nested_runs,
            places,
            channel,
            versions,
        } = get;
        let Some(channel) = channel else {
            let native::Reply::GetOk { fields } = &reply else {
                unreachable!("a get reply is a get_ok")
            };
            let registry = self.manager.registry();
            let layout = frame_layout(&registry, self.pack_limits, fields, &nested_runs);
            // Rows that do not lie back to back (from several extents, or
            // strided) go out as their own slices, gathered into frames by
            // the writer: no copy.
            let mut frames =
                native::encode_reply_gathered(id, &reply, &layout, &|p, l| places.span(p, l))?;
            if let Some((incarnation, versions)) = versions {
                frames.parts[0] = native::with_versions(&frames.parts[0], incarnation, &versions)?;
            }
            let message = Message {
                parts: frames.parts,
                per_frame: frames.per_frame,
                tail: None,
            };
            return Ok((message, None));
        };
        let frames = native::encode_reply_enclosed(id, &reply, &|b| places.enclose(b))?;
        let mut segments = Vec::with_capacity(frames.len().saturating_sub(1));
        let mut handles: Vec<Handle> = Vec::new();
        let mut seen = HashSet::new();
        for f in &frames[1..] {
            if f.is_empty() {
                segments.push((String::new(), 0, 0));
                continue;
            }
            let segment = places.segment(f).ok_or(EncodeError::NotASegment)?;
            segments.push((segment.name().to_string(), 0, f.len() as u64));
            if seen.insert(segment.name().clone()) {
                handles.push(segment);
            }
        }
        let frame0 = native::with_segments(&frames[0], &segments)?;
        let fds = (!handles.is_empty()).then_some((channel, handles));
        Ok((vec![frame0].into(), fds))
    }
}
