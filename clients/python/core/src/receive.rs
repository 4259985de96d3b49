//! A reply's data received in place: its frame 0 decoded to a layout
//! ([`read_head`]), then each data frame's ranges read from the socket
//! straight to their places ([`read_frames`]: no buffer of a frame's size)
//! and checked against the frames that came.

use bytes::Bytes;
use smallvec::SmallVec;
use std::sync::Arc;
use stowage_wire::native::{self, FieldLayout, ReplyLayout, layout};

use crate::error::Fail;
use crate::message::{REPLY_LIMITS, check_frame_count};
use crate::stream::Stream;

/// The places of a reply's data frames: where each range of each frame
/// goes, added in any order, sorted once by (frame, offset) when the
/// frames are read (a frame number no frame has is reported by
/// `check_frames` once the reply is read). One list for all: a map by
/// frame number made a node or a list a frame, and a small get's reply
/// has a frame a field (a `BTreeMap` of inline lists was about 130
/// instructions a field of a 32-field get, callgrind).
#[derive(Default)]
pub(crate) struct Places {
    list: Vec<Place>,
}

impl Places {
    pub(crate) fn new() -> Places {
        Places::default()
    }

    /// Room for `n` places more.
    pub(crate) fn reserve(&mut self, n: usize) {
        self.list.reserve(n);
    }

    pub(crate) fn push(&mut self, place: Place) {
        self.list.push(place);
    }
}

/// Where one range of a data frame goes: `len` bytes at `offset` of
/// frame `frame` (numbered from 1) into `dest` (an address in a caller's
/// array).
#[derive(Clone, Copy)]
pub(crate) struct Place {
    pub(crate) frame: u64,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) dest: usize,
}

/// A reply that is not a readable get_ok: its frame 0, and why this codec
/// refused it (None: another reply, such as an error).
pub(crate) type Other = (Vec<u8>, Option<String>);

/// A get_ok's frame 0: the request id it answers, its fields' layout,
/// whether data frames follow, and the frame itself.
pub(crate) type Head = (u64, Vec<(Arc<str>, FieldLayout)>, bool, Bytes);

/// Reads a reply's frame 0: a get_ok's layout, or (the rest drained) any
/// other reply.
pub(crate) fn read_head(s: &mut Stream) -> Result<Result<Head, Other>, Fail> {
    let (head, more) = s.head()?;
    let head = Bytes::from(head);
    match native::decode_reply_layout_memo(&head, &REPLY_LIMITS, &mut s.layouts) {
        Ok((id, ReplyLayout::GetOk(fields))) => Ok(Ok((id, fields, more, head))),
        // Another reply, or one this codec refuses: the caller decodes
        // frame 0 and says what it is.
        other => {
            drain(s, more)?;
            Ok(Err((head.to_vec(), other.err().map(|e| e.to_string()))))
        }
    }
}

/// Reads one data frame of `size` bytes into its places (sorted by
/// offset, each inside the frame), in one pass over the stream with no
/// buffer of the frame's size: bytes not read yet go from the socket
/// straight to their place; bytes a place shares with earlier ones (a get
/// that names an index twice, or runs of rows that overlap) are copied from
/// where they were read to.
fn read_ranges(s: &mut Stream, places: &[Place], size: u64) -> Result<(), Fail> {
    // The disjoint stretches read (or about to be) so far: (frame offset,
    // len, where).
    // (Both inline for the few places a frame usually holds: two lists
    // grown and freed a frame were about 600 instructions a field of a
    // 32-field get, whose fields each come in a frame of their own.)
    let mut read: SmallVec<[(u64, u64, usize); 4]> = SmallVec::new();
    // Stretches that follow on from what was read, not read yet: read
    // together, by one scattered read, before anything needs their bytes.
    let mut pending: SmallVec<[(usize, usize); 4]> = SmallVec::new();
    let flush = |s: &mut Stream, pending: &mut SmallVec<[(usize, usize); 4]>| {
        // SAFETY: each pending stretch lies in a caller-owned destination
        // checked against the layout before any read, and no two overlap.
        let r = unsafe { s.read_scattered(pending) };
        pending.clear();
        r
    };
    let mut pos = 0u64;
    for p in places {
        let end = p.offset + p.len;
        // The part already read: copied from each stretch that holds it.
        let shared_end = end.min(pos);
        if p.offset < shared_end {
            flush(s, &mut pending)?;
            let first = read.partition_point(|r| r.0 + r.1 <= p.offset);
            for &(at, len, dest) in &read[first..] {
                if at >= shared_end {
                    break;
                }
                let from = at.max(p.offset);
                let to = (at + len).min(shared_end);
                // SAFETY: both ranges lie in caller-owned destinations
                // checked against the layout before any read; a stretch
                // read earlier and this place never share bytes (a place
                // is a distinct row range of a field's destination).
                unsafe {
                    std::ptr::copy(
                        (dest + (from - at) as usize) as *const u8,
                        (p.dest + (from - p.offset) as usize) as *mut u8,
                        (to - from) as usize,
                    );
                }
            }
        }
        // The part not read yet: from the socket, straight into place.
        let start = p.offset.max(pos);
        if start < end {
            if start > pos {
                flush(s, &mut pending)?;
                s.skip(start - pos)?;
            }
            let dest = p.dest + (start - p.offset) as usize;
            pending.push((dest, (end - start) as usize));
            read.push((start, end - start, dest));
            pos = end;
        }
    }
    flush(s, &mut pending)?;
    s.skip(size - pos)
}

/// A same-node reply's `segments`: `[name, offset, len]` per data frame.
pub(crate) type Entries = Vec<(String, u64, u64)>;

/// The `segments` of a get_ok's frame 0, if it has them.
pub(crate) fn segments(head: &[u8]) -> Result<Option<Entries>, Fail> {
    // (A frame 0 without the bytes of the key `segments` has none: the
    // second decode, a pass over all of frame 0, only when it might. The
    // search is memchr's: a scan by 9-byte windows cost about 9
    // instructions a byte of frame 0, 8,000 a 10-field get's, callgrind.)
    if memchr::memmem::find(head, b"\xa8segments").is_none() {
        return Ok(None);
    }
    native::decode_extras(head, &REPLY_LIMITS)
        .map(|e| e.segments)
        .map_err(|e| Fail::Protocol(e.to_string()))
}

/// Reads the rest of a reply and throws it away.
pub(crate) fn drain(s: &mut Stream, mut more: bool) -> Result<(), Fail> {
    while more {
        let h = s.header()?;
        s.skip(h.size)?;
        more = h.more;
    }
    Ok(())
}

/// A layout error in the Python client's words (its suite checks them).
pub(crate) fn frames_error(e: &stowage_wire::native::Error) -> String {
    use stowage_wire::native::Error as E;
    match e.root() {
        E::FrameOutOfRange { frame, data_frames } => {
            format!("frame {frame} does not exist (the reply has {data_frames} data frames)")
        }
        E::RangeOutsideFrame {
            frame,
            offset,
            len,
            frame_len,
        } => format!("range {offset}+{len} lies outside frame {frame} ({frame_len} bytes)"),
        E::UnusedFrame(i) => format!("reply data frames [{i}] are referenced by no descriptor"),
        other => other.to_string(),
    }
}

/// Reads the data frames of a reply (`more`: frame 0 said more follow),
/// each range straight to its place, then checks the ranges against the
/// frames that came.
pub(crate) fn read_frames(
    s: &mut Stream,
    mut more: bool,
    places: &mut Places,
    fields: &[(Arc<str>, FieldLayout)],
) -> Result<(), Fail> {
    // The data frames, each read straight into its places: those of
    // frame k+1 are the next stretch of the sorted list (stable: places
    // at one offset stay in the order they were added).
    places.list.sort_by_key(|p| (p.frame, p.offset));
    let mut rest: &[Place] = &places.list;
    let mut lens = Vec::with_capacity(fields.len() + 1);
    let mut k = 0usize;
    while more {
        let (m, size) = s.frame_header()?;
        more = m;
        lens.push(size);
        check_frame_count(lens.len() + 1)?;
        let frame = k as u64 + 1;
        // Places before this frame name frame 0, which is no data frame
        // (check_frames reports it); skipped here.
        let from = rest.partition_point(|p| p.frame < frame);
        let to = rest.partition_point(|p| p.frame <= frame);
        let mine = &rest[from..to];
        rest = &rest[to..];
        if mine
            .iter()
            .any(|p| p.offset.checked_add(p.len).is_none_or(|e| e > size))
        {
            // Reported by check_frames below, after the frame is drained.
            s.skip(size)?;
        } else {
            read_ranges(s, mine, size)?;
        }
        k += 1;
    }
    layout::check_frames(fields, &lens).map_err(|e| Fail::Protocol(frames_error(&e)))
}
