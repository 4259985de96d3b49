//! Whole messages on a [`Stream`]: one request written ([`write_message`]:
//! frame headers and small pieces gathered, large pieces from where they
//! lie), one reply read whole ([`read_reply`]), and requests sent with two
//! on the wire ([`send_pipelined`]).

use std::io::IoSlice;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use stowage_transport::{frame, zmtp};
use stowage_wire::native::{self, Limits};

use crate::error::Fail;
use crate::stream::{IOV_MAX, MAX_FRAME0, Stream};

/// Where a [`Gather`] writes: every byte of the slices given, in order.
pub(crate) trait Sink {
    fn write_vectored_all(&mut self, io: &mut [IoSlice<'_>]) -> Result<(), Fail>;
}

impl Sink for Stream {
    fn write_vectored_all(&mut self, io: &mut [IoSlice<'_>]) -> Result<(), Fail> {
        self.write_all_vectored(io)
    }
}

/// A request's data frames as [`write_frames`] takes them: how many,
/// each one's length, and each one's bytes, in order.
pub(crate) trait DataFrames {
    fn count(&self) -> usize;
    fn frame_len(&self, k: usize) -> usize;
    /// Gives frame `k`'s bytes to `out`, in order.
    fn each<'a>(&'a self, k: usize, out: &mut dyn Out<'a>) -> Result<(), Fail>;
}

/// Where [`DataFrames::each`] puts a frame's bytes.
pub(crate) trait Out<'a> {
    /// Bytes where they lie (alive as long as the frames).
    fn slice(&mut self, bytes: &'a [u8]) -> Result<(), Fail>;
    /// `len` bytes that `fill` writes, all of them, into the room it is
    /// given (a strided array's small blocks, gathered in one pass).
    fn fill(&mut self, len: usize, fill: &mut dyn FnMut(&mut [u8])) -> Result<(), Fail>;
}

/// Data frames given as the caller's buffers: each frame its pieces.
impl DataFrames for [Vec<&[u8]>] {
    fn count(&self) -> usize {
        self.len()
    }

    fn frame_len(&self, k: usize) -> usize {
        self[k].iter().map(|p| p.len()).sum()
    }

    fn each<'a>(&'a self, k: usize, out: &mut dyn Out<'a>) -> Result<(), Fail> {
        self[k].iter().try_for_each(|&p| out.slice(p))
    }
}

/// A [`Gather`] writing to a sink, as an [`Out`].
pub(crate) struct GatherTo<'g, 'a, S: Sink> {
    pub(crate) g: &'g mut Gather<'a>,
    pub(crate) s: &'g mut S,
}

impl<'a, S: Sink> Out<'a> for GatherTo<'_, 'a, S> {
    fn slice(&mut self, bytes: &'a [u8]) -> Result<(), Fail> {
        self.g.piece(self.s, bytes)
    }

    fn fill(&mut self, len: usize, fill: &mut dyn FnMut(&mut [u8])) -> Result<(), Fail> {
        self.g.fill(self.s, len, fill)
    }
}

/// Bytes on their way out: pieces of up to `coalesce` bytes (and frame
/// headers) are copied into `copied`, larger pieces stay where they lie;
/// written with one vectored write whenever [`IOV_MAX`] slices or
/// [`zmtp::WRITE_CHUNK`] copied bytes are gathered, and at the end.
pub(crate) struct Gather<'a> {
    copied: BytesMut,
    slices: Vec<Slice<'a>>,
    coalesce: usize,
}

/// One slice of a batch: a range of [`Gather::copied`], or a caller's piece.
enum Slice<'a> {
    Copied(usize, usize),
    Caller(&'a [u8]),
}

impl<'a> Gather<'a> {
    /// A gather that copies pieces of up to `coalesce` bytes (a socket's:
    /// [`zmtp::COALESCE`], as stowd's own writer; a slice per tiny piece
    /// costs the kernel more than copying it).
    pub(crate) fn new(coalesce: usize) -> Gather<'a> {
        Gather::with_capacity(coalesce, 0)
    }

    /// A gather whose copy buffer starts with room for `room` bytes.
    pub(crate) fn with_capacity(coalesce: usize, room: usize) -> Gather<'a> {
        Gather {
            copied: BytesMut::with_capacity(room),
            slices: Vec::new(),
            coalesce,
        }
    }

    fn header(&mut self, s: &mut impl Sink, len: usize, more: bool) -> Result<(), Fail> {
        self.room(s)?;
        let start = self.copied.len();
        frame::put_header(&mut self.copied, len, more);
        self.copied_from(start);
        Ok(())
    }

    pub(crate) fn piece(&mut self, s: &mut impl Sink, piece: &'a [u8]) -> Result<(), Fail> {
        if piece.is_empty() {
            return Ok(());
        }
        self.room(s)?;
        if piece.len() <= self.coalesce {
            let start = self.copied.len();
            self.copied.extend_from_slice(piece);
            self.copied_from(start);
        } else {
            self.slices.push(Slice::Caller(piece));
        }
        Ok(())
    }

    /// `len` bytes `fill` writes, copied into the batch (however many).
    pub(crate) fn fill(
        &mut self,
        s: &mut impl Sink,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]),
    ) -> Result<(), Fail> {
        if len == 0 {
            return Ok(());
        }
        self.room(s)?;
        let start = self.copied.len();
        self.copied.resize(start + len, 0);
        fill(&mut self.copied[start..]);
        self.copied_from(start);
        Ok(())
    }

    /// The bytes of `copied` from `start` on: the last slice grows when it
    /// ends at `start`, else they are a slice of their own.
    fn copied_from(&mut self, start: usize) {
        let end = self.copied.len();
        match self.slices.last_mut() {
            Some(Slice::Copied(_, e)) if *e == start => *e = end,
            _ => self.slices.push(Slice::Copied(start, end)),
        }
    }

    /// Writes the batch out if it is full.
    fn room(&mut self, s: &mut impl Sink) -> Result<(), Fail> {
        if self.slices.len() >= IOV_MAX || self.copied.len() >= zmtp::WRITE_CHUNK {
            self.flush(s)?;
        }
        Ok(())
    }

    /// Writes out what is gathered.
    pub(crate) fn flush(&mut self, s: &mut impl Sink) -> Result<(), Fail> {
        if self.slices.is_empty() {
            return Ok(());
        }
        let mut io: Vec<IoSlice<'_>> = self
            .slices
            .iter()
            .map(|slice| match *slice {
                Slice::Copied(a, b) => IoSlice::new(&self.copied[a..b]),
                Slice::Caller(p) => IoSlice::new(p),
            })
            .collect();
        s.write_vectored_all(&mut io)?;
        self.slices.clear();
        self.copied.clear();
        Ok(())
    }
}

/// Sends one message: `frame0`, then the data `frames`, each its pieces
/// back to back.
pub(crate) fn write_message(
    s: &mut Stream,
    frame0: &[u8],
    frames: &[Vec<&[u8]>],
) -> Result<(), Fail> {
    write_frames(s, frame0, frames)
}

/// [`write_message`] of data frames of any kind.
pub(crate) fn write_frames<'a, F: DataFrames + ?Sized>(
    s: &mut Stream,
    frame0: &'a [u8],
    frames: &'a F,
) -> Result<(), Fail> {
    let count = frames.count();
    // Room for the headers and frames up to the message's size, at most
    // 64 KiB: a 32-field put's copy buffer grew from empty by doubling
    // (its reallocations and frame 0's, with their copies, were 18,400
    // instructions a call, callgrind), where its size was known before
    // the first byte.
    let size = (0..count).fold(frame0.len() + 9, |n, k| {
        n.saturating_add(frames.frame_len(k) + 9)
    });
    let mut g = Gather::with_capacity(zmtp::COALESCE, size.min(64 << 10));
    g.header(s, frame0.len(), count > 0)?;
    g.piece(s, frame0)?;
    for k in 0..count {
        g.header(s, frames.frame_len(k), k + 1 < count)?;
        frames.each(k, &mut GatherTo { g: &mut g, s })?;
    }
    g.flush(s)
}

/// What a reply's frame 0 may declare, for the client's decoder: stowd's
/// row and field limits are its configuration's (2^24 rows a request by
/// default, and an operator may raise both), so the client does not refuse
/// a reply by a count of its own; the decoder already bounds every count it
/// reads by the bytes of frame 0 left to hold it (at most [`MAX_FRAME0`]), so
/// decoding stays linear in what arrived. Frames keep the codec's bound.
pub(crate) const REPLY_LIMITS: Limits = Limits {
    max_rows: u64::MAX,
    max_fields: u64::MAX,
    ..Limits::DEFAULT
};

/// Refuses a reply of more than [`Limits`]' `max_frames` frames (`frames`:
/// how many it has so far, frame 0 included).
pub(crate) fn check_frame_count(frames: usize) -> Result<(), Fail> {
    let max_frames = Limits::default().max_frames;
    if frames as u64 > max_frames {
        return Err(Fail::Protocol(format!(
            "a reply of more than {max_frames} frames"
        )));
    }
    Ok(())
}

/// Sends a request with its data `frames` and reads the whole reply: its
/// frames, frame 0 first. Bounded: frame 0 at most [`MAX_FRAME0`] bytes,
/// the data frames as many bytes together, and each frame's declared size
/// checked before anything is allocated for it.
pub(crate) fn send<F: DataFrames + ?Sized>(
    s: &mut Stream,
    frame0: &[u8],
    frames: &F,
) -> Result<Vec<Vec<u8>>, Fail> {
    write_frames(s, frame0, frames)?;
    read_reply(s)
}

/// Reads one reply whole (as [`send`] does after writing).
pub(crate) fn read_reply(s: &mut Stream) -> Result<Vec<Vec<u8>>, Fail> {
    let (head, mut more) = s.head()?;
    let mut reply = vec![head];
    let mut left = MAX_FRAME0;
    while more {
        let (m, size) = s.frame_header()?;
        check_frame_count(reply.len() + 1)?;
        reply.push(s.small_frame(size, left, "the reply's data frames")?);
        left -= size;
        more = m;
    }
    Ok(reply)
}

/// Whether a reply's frame 0 is an `error` reply (or one the codec
/// refuses, which the caller reports).
fn is_error(head: &[u8]) -> bool {
    !matches!(
        native::decode_reply(&[Bytes::copy_from_slice(head)], &REPLY_LIMITS),
        Ok((_, r)) if !matches!(r, native::Reply::Error { .. })
    )
}

/// Sends `count` messages with two on the wire: message `k + 1` is written
/// (`write(s, k + 1)`, which lays it out then) before the reply to `k` is
/// read, so that stowd (which reads one message ahead while it handles
/// one) receives the next while it handles this one. The replies go to
/// `replies` in order: all of them, or up to the first error and the
/// reply to the one message already sent after it. Each step (a message
/// written and the reply before it read) has `each` to finish, as each
/// message sent alone would. `known_ok(k, frame0)` says, without reading
/// it, that the reply to message `k` is no error (a caller's exact bytes).
pub(crate) fn send_pipelined(
    s: &mut Stream,
    count: usize,
    write: &mut dyn FnMut(&mut Stream, usize) -> Result<(), Fail>,
    known_ok: &dyn Fn(usize, &[u8]) -> bool,
    each: Duration,
    replies: &mut Vec<Vec<Vec<u8>>>,
) -> Result<(), Fail> {
    let mut sent = 0;
    if count > 0 {
        write(s, 0)?;
        sent = 1;
    }
    while replies.len() < sent {
        s.deadline = Instant::now() + each;
        let failed = replies
            .last()
            .is_some_and(|r| !known_ok(replies.len() - 1, &r[0]) && is_error(&r[0]));
        if !failed && sent < count {
            write(s, sent)?;
            sent += 1;
        }
        let reply = read_reply(s)?;
        let error = !known_ok(replies.len(), &reply[0]) && is_error(&reply[0]);
        replies.push(reply);
        if error && replies.len() == sent {
            break;
        }
    }
    Ok(())
}
