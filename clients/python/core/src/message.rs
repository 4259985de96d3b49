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

/// A request on its way out: frame headers and pieces of up to
/// [`zmtp::COALESCE`] bytes are copied into `copied`, larger pieces stay
/// where they lie; written with `writev` whenever [`IOV_MAX`] slices or
/// [`zmtp::WRITE_CHUNK`] copied bytes are gathered, and at the end.
#[derive(Default)]
struct Gather<'a> {
    copied: BytesMut,
    slices: Vec<Slice<'a>>,
}

/// One slice of a batch: a range of [`Gather::copied`], or a caller's piece.
enum Slice<'a> {
    Copied(usize, usize),
    Caller(&'a [u8]),
}

impl<'a> Gather<'a> {
    fn header(&mut self, s: &mut Stream, len: usize, more: bool) -> Result<(), Fail> {
        self.room(s)?;
        let start = self.copied.len();
        frame::put_header(&mut self.copied, len, more);
        self.copied_from(start);
        Ok(())
    }

    fn piece(&mut self, s: &mut Stream, piece: &'a [u8]) -> Result<(), Fail> {
        if piece.is_empty() {
            return Ok(());
        }
        self.room(s)?;
        if piece.len() <= zmtp::COALESCE {
            let start = self.copied.len();
            self.copied.extend_from_slice(piece);
            self.copied_from(start);
        } else {
            self.slices.push(Slice::Caller(piece));
        }
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
    fn room(&mut self, s: &mut Stream) -> Result<(), Fail> {
        if self.slices.len() >= IOV_MAX || self.copied.len() >= zmtp::WRITE_CHUNK {
            self.flush(s)?;
        }
        Ok(())
    }

    fn flush(&mut self, s: &mut Stream) -> Result<(), Fail> {
        let mut io: Vec<IoSlice<'_>> = self
            .slices
            .iter()
            .map(|slice| match *slice {
                Slice::Copied(a, b) => IoSlice::new(&self.copied[a..b]),
                Slice::Caller(p) => IoSlice::new(p),
            })
            .collect();
        s.write_all_vectored(&mut io)?;
        self.slices.clear();
        self.copied.clear();
        Ok(())
    }
}

/// Sends one message: `frame0`, then the data `frames`, each its pieces
/// back to back.
pub(crate) fn write_message<'a>(
    s: &mut Stream,
    frame0: &'a [u8],
    frames: &[Vec<&'a [u8]>],
) -> Result<(), Fail> {
    let mut g = Gather::default();
    g.header(s, frame0.len(), !frames.is_empty())?;
    g.piece(s, frame0)?;
    for (i, pieces) in frames.iter().enumerate() {
        let len = pieces.iter().map(|p| p.len()).sum();
        g.header(s, len, i + 1 < frames.len())?;
        for &piece in pieces {
            g.piece(s, piece)?;
        }
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
pub(crate) fn send(
    s: &mut Stream,
    frame0: &[u8],
    frames: &[Vec<&[u8]>],
) -> Result<Vec<Vec<u8>>, Fail> {
    write_message(s, frame0, frames)?;
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

/// A request to send: frame 0 and its data frames, each its pieces.
pub(crate) type Outgoing<'a> = (&'a [u8], Vec<Vec<&'a [u8]>>);

/// Sends `messages` with two on the wire: message `k + 1` is written
/// before the reply to `k` is read, so that stowd (which reads one message
/// ahead while it handles one) receives the next while it handles this
/// one. The replies go to `replies` in order: all of them, or up to the
/// first error and the reply to the one message already sent after it.
/// Each step (a message written and the reply before it read) has `each`
/// to finish, as each message sent alone would.
pub(crate) fn send_pipelined(
    s: &mut Stream,
    messages: &[Outgoing<'_>],
    each: Duration,
    replies: &mut Vec<Vec<Vec<u8>>>,
) -> Result<(), Fail> {
    let mut sent = 0;
    if let Some((frame0, frames)) = messages.first() {
        write_message(s, frame0, frames)?;
        sent = 1;
    }
    while replies.len() < sent {
        s.deadline = Instant::now() + each;
        let failed = replies.last().is_some_and(|r| is_error(&r[0]));
        if !failed && sent < messages.len() {
            let (frame0, frames) = &messages[sent];
            write_message(s, frame0, frames)?;
            sent += 1;
        }
        let reply = read_reply(s)?;
        let error = is_error(&reply[0]);
        replies.push(reply);
        if error && replies.len() == sent {
            break;
        }
    }
    Ok(())
}
