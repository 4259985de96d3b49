//! [`crate::curve`]'s codecs over tokio streams: after a CURVE handshake a
//! connection's read half becomes a [`CurveReader`] (MESSAGE commands in,
//! plaintext ZMTP frames out) and its write half a [`CurveWriter`]
//! (plaintext ZMTP frames in, MESSAGE commands out), so the frame reader
//! and the message writers of [`crate::zmtp`] run over them unchanged.
//!
//! What it costs beyond the cipher: a received frame is copied once more
//! (from the opened box to the frame reader's buffer), and a sent frame is
//! gathered whole before it is sealed (a box is one frame), so a connection
//! holds one frame's ciphertext while it is written.

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::curve::{CurveError, Decrypter, Encrypter};

/// A connection's read half after the handshake, whatever its mechanism.
pub type ReadStream = Box<dyn AsyncRead + Send + Unpin>;
/// A connection's write half after the handshake, whatever its mechanism.
pub type WriteStream = Box<dyn AsyncWrite + Send + Unpin>;

fn invalid(e: CurveError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

/// Bytes read from the wire at a time.
const READ_CHUNK: usize = 64 << 10;

/// MESSAGE commands in, plaintext ZMTP frames out.
pub struct CurveReader<R> {
    inner: R,
    decrypter: Decrypter,
    scratch: Box<[u8]>,
    /// A failure found while feeding what the handshake had read ahead,
    /// reported at the first read.
    failed: Option<CurveError>,
}

impl<R> CurveReader<R> {
    /// Reads from `inner`, the bytes `ahead` (read past the handshake)
    /// first.
    pub fn new(inner: R, mut decrypter: Decrypter, ahead: &[u8]) -> CurveReader<R> {
        let failed = decrypter.feed(ahead).err();
        CurveReader {
            inner,
            decrypter,
            scratch: vec![0u8; READ_CHUNK].into_boxed_slice(),
            failed,
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for CurveReader<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        if buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        loop {
            if this.decrypter.ready() > 0 {
                let n = this.decrypter.read(buf.initialize_unfilled());
                buf.advance(n);
                return Poll::Ready(Ok(()));
            }
            if let Some(e) = this.failed.take() {
                return Poll::Ready(Err(invalid(e)));
            }
            let mut rb = ReadBuf::new(&mut this.scratch);
            ready!(Pin::new(&mut this.inner).poll_read(cx, &mut rb))?;
            let got = rb.filled().len();
            if got == 0 {
                // End of stream: the frame reader tells a clean close from
                // one mid-frame.
                return Poll::Ready(Ok(()));
            }
            if let Err(e) = this.decrypter.feed(&this.scratch[..got]) {
                // Frames opened before the bad one are still given.
                this.failed = Some(e);
            }
        }
    }
}

/// Ciphertext queued beyond this makes a write wait for the queue to
/// drain.
const HIGH_WATER: usize = 1 << 20;

/// Plaintext ZMTP frames in, MESSAGE commands out.
pub struct CurveWriter<W> {
    inner: W,
    encrypter: Encrypter,
    queue: VecDeque<Bytes>,
    queued: usize,
}

impl<W> CurveWriter<W> {
    pub fn new(inner: W, encrypter: Encrypter) -> CurveWriter<W> {
        CurveWriter {
            inner,
            encrypter,
            queue: VecDeque::new(),
            queued: 0,
        }
    }
}

impl<W: AsyncWrite + Unpin> CurveWriter<W> {
    /// Writes queued ciphertext until the queue is empty.
    fn poll_drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.queue.is_empty() {
            let slices: Vec<io::IoSlice<'_>> = self
                .queue
                .iter()
                .take(64)
                .map(|b| io::IoSlice::new(b))
                .collect();
            let n = ready!(Pin::new(&mut self.inner).poll_write_vectored(cx, &slices))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.queued -= n;
            let mut n = n;
            while n > 0 {
                let front = self.queue.front_mut().expect("written bytes were queued");
                if n >= front.len() {
                    n -= front.len();
                    self.queue.pop_front();
                } else {
                    front.advance(n);
                    n = 0;
                }
            }
        }
        Poll::Ready(Ok(()))
    }

    fn take(&mut self, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        if self.queued > HIGH_WATER {
            match self.poll_drain(cx) {
                Poll::Ready(r) => r?,
                Poll::Pending if self.queued > HIGH_WATER => return Poll::Pending,
                Poll::Pending => {}
            }
        }
        let mut n = 0;
        for b in bufs {
            let before = self.queue.len();
            self.encrypter.feed(b, &mut self.queue).map_err(invalid)?;
            self.queued += self
                .queue
                .iter()
                .skip(before)
                .map(Bytes::len)
                .sum::<usize>();
            n += b.len();
        }
        Poll::Ready(Ok(n))
    }
}

impl<W: AsyncWrite + Unpin> AsyncWrite for CurveWriter<W> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.take(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.take(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_drain(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.poll_drain(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
