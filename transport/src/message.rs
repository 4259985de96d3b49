//! What a connection sends: a [`Message`] (frames, each gathered from
//! parts), and the [`Tail`] of a reply whose last frames are sent as they
//! are made ([`Chunk`]s from a [`TailSender`]).

use std::sync::Arc;

use bytes::Bytes;

use crate::zmtp;

/// A message to send: frame `k` is the next `per_frame[k]` parts back to
/// back, written without joining them ([`zmtp::write_gathered`]); one part
/// per frame where `per_frame` is `None`. A reply with a [`Tail`] is
/// these frames, then the tail's.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Message {
    pub parts: Vec<Bytes>,
    pub per_frame: Option<Vec<u32>>,
    pub tail: Option<Tail>,
}

impl From<Vec<Bytes>> for Message {
    fn from(parts: Vec<Bytes>) -> Message {
        Message {
            parts,
            per_frame: None,
            tail: None,
        }
    }
}

impl Message {
    /// Number of frames (of a reply with a tail: before the tail).
    pub fn frames(&self) -> usize {
        self.per_frame.as_ref().map_or(self.parts.len(), Vec::len)
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// Writes the message to `w` (with a tail: the frames before it, the
    /// last of them saying that more follow).
    pub async fn write<W: tokio::io::AsyncWrite + Unpin + ?Sized>(
        &self,
        w: &mut W,
    ) -> std::io::Result<()> {
        match (&self.per_frame, &self.tail) {
            (None, None) => zmtp::write_message(w, &self.parts).await,
            (Some(per_frame), None) => zmtp::write_gathered(w, &self.parts, per_frame).await,
            (per_frame, Some(_)) => {
                let ones;
                let per_frame = match per_frame {
                    Some(p) => p,
                    None => {
                        ones = vec![1; self.parts.len()];
                        &ones
                    }
                };
                zmtp::write_gathered_more(w, &self.parts, per_frame, true).await
            }
        }
    }
}

/// Frames of a reply's tail, sent by whoever makes them: `last` ends the
/// message.
#[derive(Debug)]
pub struct Chunk {
    pub parts: Vec<Bytes>,
    pub per_frame: Vec<u32>,
    pub last: bool,
}

/// What makes a [`Tail`]: chunks in order, the last with `last` set; an
/// `Err` (or dropping this before the last chunk) abandons the message,
/// and the connection it was going to is closed, since a message begun
/// cannot be taken back (the client sees the connection end, never a
/// message of other bytes).
pub type TailSender = tokio::sync::mpsc::Sender<Result<Chunk, String>>;

/// The rest of a reply whose first frames go out before the others exist
/// (a router forwarding a peer unit's reply as it arrives): the
/// connection writes the message's frames, then each [`Chunk`] as it
/// comes, each within [`Limits::write_timeout`].
///
/// [`Limits::write_timeout`]: crate::Limits::write_timeout
#[derive(Clone)]
pub struct Tail(Arc<std::sync::Mutex<Option<TailReceiver>>>);

type TailReceiver = tokio::sync::mpsc::Receiver<Result<Chunk, String>>;

impl Tail {
    /// A tail and its sender; `ahead` chunks may wait to be written.
    pub fn channel(ahead: usize) -> (TailSender, Tail) {
        let (tx, rx) = tokio::sync::mpsc::channel(ahead.max(1));
        (tx, Tail(Arc::new(std::sync::Mutex::new(Some(rx)))))
    }

    pub(crate) fn take(&self) -> Option<TailReceiver> {
        self.0.lock().expect("tail").take()
    }
}

impl std::fmt::Debug for Tail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Tail")
    }
}

impl PartialEq for Tail {
    fn eq(&self, other: &Tail) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
