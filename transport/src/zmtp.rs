//! ZMTP 3.0 with the NULL, PLAIN and CURVE mechanisms over any tokio byte
//! stream: the frame reader, the message writers and the handshake
//! ([`Security`]). The bytes themselves (headers, greeting, commands) are
//! [`crate::frame`]'s and [`crate::curve`]'s, parsed in place in the
//! reader's buffer; this module does the I/O. After a CURVE handshake the
//! connection's halves are wrapped in [`crate::curve_io`]'s codecs, and
//! the reader and writers here run over them unchanged.
//!
//! Written for `stowd`'s needs rather than generality:
//! - every received frame gets its own allocation (a stored row never pins
//!   a read buffer shared with other frames), and a large frame is read
//!   straight into it; a frame of [`pool::MIN_POOLED`] bytes or more is
//!   read into [`Pages`] of a [`ReceivePool`] when the reader has one
//!   (pages freed by earlier frames of any size, already resident), and
//!   its pages go back to that pool once the last `Bytes` of it is
//!   dropped;
//! - a declared size is checked against [`Limits`] before anything is
//!   allocated from it, and a frame's allocation grows with the bytes that
//!   actually arrive, so a peer that declares 8 GiB and sends 10 bytes costs
//!   at most one initial chunk;
//! - a message over a limit is read to its end and dropped, frame by frame,
//!   so the connection stays usable and the caller can answer with an error;
//! - large frames are written from their own buffers, small ones coalesced.

use std::io;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use smallvec::SmallVec;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::curve::{self, ClientHandshake, CurveError, ServerHandshake};
use crate::frame::{self, Decoded, FrameError, Header, MAX_HEADER, put_header};
use crate::pool::{self, Pages, ReceivePool};

/// Receive limits, checked before any allocation from a declared size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Most bytes in one message, all frames together.
    pub max_message_bytes: u64,
    /// Most frames in one message.
    pub max_frames: usize,
}

impl Limits {
    /// 8 GiB and 2^20 frames.
    pub const DEFAULT: Limits = Limits {
        max_message_bytes: 8 << 30,
        max_frames: 1 << 20,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::DEFAULT
    }
}

/// A connection-level failure. The connection is closed after one.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ZmtpError {
    #[error("{0}")]
    Io(#[from] io::Error),
    #[error("peer closed the connection")]
    Closed,
    #[error("ZMTP protocol error: {0}")]
    Protocol(String),
    #[error("handshake did not complete within {0:?}")]
    HandshakeTimeout(Duration),
}

fn protocol(msg: impl Into<String>) -> ZmtpError {
    ZmtpError::Protocol(msg.into())
}

impl From<CurveError> for ZmtpError {
    fn from(e: CurveError) -> ZmtpError {
        protocol(e.to_string())
    }
}

impl From<FrameError> for ZmtpError {
    fn from(e: FrameError) -> ZmtpError {
        protocol(e.to_string())
    }
}

/// What [`FrameReader::read`] returns.
#[derive(Debug)]
pub enum Incoming {
    /// A whole message.
    Message(Vec<Bytes>),
    /// A message over a limit, read to its end and dropped. `head` is its
    /// first frame when that frame alone was within the limits.
    TooLarge {
        /// The first frame, if kept.
        head: Vec<Bytes>,
        /// Which limit, in words.
        reason: String,
    },
    /// A command (PING, ...), by name, with its body after the name.
    Command {
        /// Command name.
        name: String,
        /// Command data after the name.
        body: Bytes,
    },
}

/// Frames up to this size are copied out of the read buffer; larger ones
/// are read straight into their own allocation.
const SMALL_FRAME: usize = 16 << 10;
/// Capacity the read buffer is refilled to. It is what an idle connection
/// costs, so it is kept small; large frames bypass it.
const READ_CHUNK: usize = 32 << 10;
/// First allocation for a large frame; it then doubles as bytes arrive.
const FIRST_CHUNK: usize = 8 << 20;
/// Frames up to this size are coalesced into one write buffer (a
/// synchronous writer, the Python client's Rust core, coalesces by it too).
pub const COALESCE: usize = 16 << 10;
/// The write buffer is flushed at this size.
pub const WRITE_CHUNK: usize = 256 << 10;

/// Writes one message. Frames above a few KiB go out from their own
/// buffers (no copy); headers and small frames are coalesced, into a
/// buffer of the size they take (at most about [`WRITE_CHUNK`]): a reply
/// of one small frame allocates a few dozen bytes, not a fixed 8 KiB
/// (which, past glibc's per-thread cache, cost every reply a trip through
/// the arena's bins).
pub async fn write_message<W: AsyncWrite + Unpin + ?Sized>(
    w: &mut W,
    frames: &[Bytes],
) -> io::Result<()> {
    let coalesced: usize = frames
        .iter()
        .map(|f| MAX_HEADER + if f.len() <= COALESCE { f.len() } else { 0 })
        .sum();
    let mut buf = BytesMut::with_capacity(coalesced.min(WRITE_CHUNK + COALESCE + MAX_HEADER));
    for (i, frame) in frames.iter().enumerate() {
        put_header(&mut buf, frame.len(), i + 1 < frames.len());
        if frame.len() <= COALESCE {
            buf.put_slice(frame);
            if buf.len() >= WRITE_CHUNK {
                w.write_all(&buf).await?;
                buf.clear();
            }
        } else {
            write_two(w, &buf, frame).await?;
            buf.clear();
        }
    }
    if !buf.is_empty() {
        w.write_all(&buf).await?;
    }
    w.flush().await
}

/// Most buffers one vectored write is given (Linux's `IOV_MAX`).
const MAX_IOV: usize = 1024;

/// Writes one message whose frames are gathered from parts: frame `k` is
/// the next `per_frame[k]` parts back to back. Headers and parts go out
/// with vectored writes of up to [`MAX_IOV`] buffers, none copied: a frame
/// of many rows from many buffers costs what the kernel's copy costs.
pub async fn write_gathered<W: AsyncWrite + Unpin + ?Sized>(
    w: &mut W,
    parts: &[Bytes],
    per_frame: &[u32],
) -> io::Result<()> {
    write_gathered_more(w, parts, per_frame, false).await
}

/// [`write_gathered`] of frames that are not the message's last: with
/// `more`, the last of them says that more frames follow (a message
/// written in pieces, [`crate::Tail`]).
pub async fn write_gathered_more<W: AsyncWrite + Unpin + ?Sized>(
    w: &mut W,
    parts: &[Bytes],
    per_frame: &[u32],
    more: bool,
) -> io::Result<()> {
    let total: usize = per_frame.iter().map(|&n| n as usize).sum();
    if total != parts.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{total} parts in the frames, {} given", parts.len()),
        ));
    }
    // Inline for the usual reply of up to a few dozen frames (a 32-field
    // get is 32): no allocation but the headers' buffer. Each header's
    // length (at most `MAX_HEADER`) is kept, not its range: they lie back
    // to back.
    let mut headers = BytesMut::with_capacity(per_frame.len() * MAX_HEADER);
    let mut at = 0usize;
    let mut lens: SmallVec<[u8; 64]> = SmallVec::with_capacity(per_frame.len());
    for (k, &n) in per_frame.iter().enumerate() {
        let len: usize = parts[at..at + n as usize].iter().map(Bytes::len).sum();
        let start = headers.len();
        put_header(&mut headers, len, more || k + 1 < per_frame.len());
        lens.push((headers.len() - start) as u8);
        at += n as usize;
    }
    let mut slices: SmallVec<[io::IoSlice<'_>; 64]> =
        SmallVec::with_capacity(parts.len() + per_frame.len());
    let (mut at, mut h) = (0usize, 0usize);
    for (k, &n) in per_frame.iter().enumerate() {
        let end = h + lens[k] as usize;
        slices.push(io::IoSlice::new(&headers[h..end]));
        h = end;
        for part in &parts[at..at + n as usize] {
            if !part.is_empty() {
                slices.push(io::IoSlice::new(part));
            }
        }
        at += n as usize;
    }
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let batch = rest.len().min(MAX_IOV);
        let n = w.write_vectored(&rest[..batch]).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        io::IoSlice::advance_slices(&mut rest, n);
    }
    w.flush().await
}

/// Writes `a` then `b`, with vectored writes where the stream takes them.
async fn write_two<W: AsyncWrite + Unpin + ?Sized>(
    w: &mut W,
    mut a: &[u8],
    mut b: &[u8],
) -> io::Result<()> {
    while !a.is_empty() {
        let slices = [io::IoSlice::new(a), io::IoSlice::new(b)];
        let n = w.write_vectored(&slices).await?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        if n < a.len() {
            a = &a[n..];
        } else {
            b = &b[n - a.len()..];
            a = &[];
        }
    }
    w.write_all(b).await
}

/// Reads frames from a stream, with a small buffer for headers and small
/// frames.
pub struct FrameReader<R> {
    inner: R,
    buf: BytesMut,
    pool: Option<Arc<ReceivePool>>,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// A reader whose frames each get a fresh allocation.
    pub fn new(inner: R) -> Self {
        FrameReader::with_pool(inner, None)
    }

    /// A reader that receives large frames into buffers of `pool`, which
    /// get them back when the frames are dropped.
    pub fn with_pool(inner: R, pool: Option<Arc<ReceivePool>>) -> Self {
        FrameReader {
            inner,
            buf: BytesMut::new(),
            pool,
        }
    }

    /// The stream and the bytes read from it but not yet parsed (read past
    /// a handshake).
    pub fn into_parts(self) -> (R, BytesMut) {
        (self.inner, self.buf)
    }

    /// A reader over `inner` whose first bytes are `ahead`.
    pub fn from_parts(inner: R, ahead: BytesMut, pool: Option<Arc<ReceivePool>>) -> Self {
        FrameReader {
            inner,
            buf: ahead,
            pool,
        }
    }

    /// Reads until at least `n` bytes are buffered. `Ok(false)`: the stream
    /// ended with nothing buffered (a clean close); a close with a partial
    /// item buffered is an error.
    async fn fill(&mut self, n: usize) -> Result<bool, ZmtpError> {
        while self.buf.len() < n {
            if self.buf.capacity() - self.buf.len() < n.max(READ_CHUNK / 2) {
                self.buf.reserve(READ_CHUNK.max(n));
            }
            if self.inner.read_buf(&mut self.buf).await? == 0 {
                return if self.buf.is_empty() {
                    Ok(false)
                } else {
                    Err(ZmtpError::Closed)
                };
            }
        }
        Ok(true)
    }

    async fn need(&mut self, n: usize) -> Result<(), ZmtpError> {
        if self.fill(n).await? {
            Ok(())
        } else {
            Err(ZmtpError::Closed)
        }
    }

    /// Reads the peer's greeting ([`frame::parse_greeting`]: a peer that
    /// is not ZMTP 3 is refused before all of it is waited for).
    pub async fn read_greeting(&mut self) -> Result<frame::Greeting, ZmtpError> {
        loop {
            match frame::parse_greeting(&self.buf)? {
                Decoded::Done(g) => {
                    self.buf.advance(frame::GREETING_LEN);
                    return Ok(g);
                }
                Decoded::Needs(n) => self.need(n).await?,
            }
        }
    }

    /// Reads a frame header, parsed in place in the read buffer. `None` on
    /// a clean close.
    async fn header(&mut self) -> Result<Option<Header>, ZmtpError> {
        loop {
            match frame::parse_header(&self.buf)? {
                Decoded::Done(h) => {
                    self.buf.advance(h.header_len);
                    return Ok(Some(h));
                }
                Decoded::Needs(n) => {
                    if !self.fill(n).await? {
                        return Ok(None);
                    }
                }
            }
        }
    }

    /// Reads the next frame as a command; the handshake uses this.
    pub async fn read_command(&mut self) -> Result<(String, Bytes), ZmtpError> {
        match self.read(&Limits::DEFAULT).await? {
            Some(Incoming::Command { name, body }) => Ok((name, body)),
            Some(_) => Err(protocol("expected a command frame, got a message")),
            None => Err(ZmtpError::Closed),
        }
    }

    /// A frame body of `len` bytes, in its own allocation.
    async fn frame(&mut self, len: usize) -> Result<Bytes, ZmtpError> {
        if len <= SMALL_FRAME {
            self.need(len).await?;
            // Copied, then stepped over: no handle of the read buffer made
            // and dropped per frame (`split_to` shares the buffer first).
            let frame = Bytes::copy_from_slice(&self.buf[..len]);
            self.buf.advance(len);
            return Ok(frame);
        }
        // With a pool, a large frame takes pooled pages, already resident,
        // or else a mapping that grows with the bytes that arrive; either
        // goes to the pool when the frame is dropped.
        if let Some(pool) = self.pool.clone().filter(|_| len >= pool::MIN_POOLED) {
            let taken = pool.take(len);
            let pooled = taken.is_some();
            let mut out = taken.unwrap_or_else(Pages::empty);
            return match self.frame_into_pages(&mut out, len).await {
                Ok(()) => Ok(ReceivePool::wrap(&pool, out)),
                Err(e) => {
                    // Pooled pages go back (no `Bytes` ever showed them);
                    // a fresh mapping grown for a frame that never
                    // completed is unmapped.
                    if pooled {
                        pool.give(out);
                    }
                    Err(e)
                }
            };
        }
        let mut out = Vec::new();
        self.frame_into(&mut out, len).await?;
        Ok(Bytes::from(out))
    }

    /// Reads a frame body of `len` bytes into `out` (empty): into its
    /// capacity when that is `len` or more, else growing it with what
    /// arrives, from one first chunk and at most doubling, exactly (a whole
    /// frame leaves it at capacity `len`).
    async fn frame_into(&mut self, out: &mut Vec<u8>, len: usize) -> Result<(), ZmtpError> {
        if out.capacity() < len {
            out.reserve_exact(len.min(FIRST_CHUNK));
        }
        let buffered = self.buf.len().min(len);
        out.extend_from_slice(&self.buf[..buffered]);
        self.buf.advance(buffered);
        while out.len() < len {
            if out.len() == out.capacity() {
                out.reserve_exact((len - out.len()).min(out.capacity()));
            }
            let room = (out.capacity() - out.len()).min(len - out.len());
            let n = self.inner.read_buf(&mut (&mut *out).limit(room)).await?;
            if n == 0 {
                return Err(ZmtpError::Closed);
            }
        }
        Ok(())
    }

    /// [`FrameReader::frame_into`] for [`Pages`]: into their capacity when
    /// that is `len` or more, else growing them the same way (`mremap`, no
    /// copy), so a declared size alone maps nothing.
    async fn frame_into_pages(&mut self, out: &mut Pages, len: usize) -> Result<(), ZmtpError> {
        if out.capacity() < len {
            out.grow(len.min(FIRST_CHUNK).max(out.capacity()))?;
        }
        let buffered = self.buf.len().min(len);
        out.spare()[..buffered].copy_from_slice(&self.buf[..buffered]);
        out.filled(buffered);
        self.buf.advance(buffered);
        while out.len() < len {
            if out.len() == out.capacity() {
                out.grow(out.capacity() + (len - out.len()).min(out.capacity()))?;
            }
            let room = (out.capacity() - out.len()).min(len - out.len());
            let n = self.inner.read(&mut out.spare()[..room]).await?;
            if n == 0 {
                return Err(ZmtpError::Closed);
            }
            out.filled(n);
        }
        Ok(())
    }

    /// Skips `len` bytes of a frame body without keeping them.
    async fn skip(&mut self, mut len: u64) -> Result<(), ZmtpError> {
        loop {
            let take = (self.buf.len() as u64).min(len) as usize;
            self.buf.advance(take);
            len -= take as u64;
            if len == 0 {
                return Ok(());
            }
            self.need(1).await?;
        }
    }

    /// Reads the next message or command. `None` on a clean close between
    /// messages. A message over `limits` is consumed and reported as
    /// [`Incoming::TooLarge`].
    pub async fn read(&mut self, limits: &Limits) -> Result<Option<Incoming>, ZmtpError> {
        self.read_observed(limits, &mut |_| {}).await
    }

    /// [`FrameReader::read`], calling `seen` with each frame of a message
    /// as soon as it is read (frame 0 first), before the rest arrives: a
    /// router forwards a peer's reply while it is still coming. Frames of
    /// a message over the limits are not shown past the one that broke
    /// them.
    pub async fn read_observed(
        &mut self,
        limits: &Limits,
        seen: &mut (dyn FnMut(&Bytes) + Send),
    ) -> Result<Option<Incoming>, ZmtpError> {
        let mut frames: Vec<Bytes> = Vec::new();
        let mut total = 0u64;
        let mut count = 0usize;
        let mut over: Option<String> = None;
        loop {
            let Some(h) = self.header().await? else {
                return if count == 0 {
                    Ok(None)
                } else {
                    Err(ZmtpError::Closed)
                };
            };
            if h.command {
                if count != 0 {
                    return Err(protocol("command frame inside a multipart message"));
                }
                let body = self.frame(h.command_size()?).await?;
                let (name, data) = frame::split_command(&body)?;
                return Ok(Some(Incoming::Command {
                    name: String::from_utf8_lossy(name).into_owned(),
                    body: body.slice_ref(data),
                }));
            }
            let len = h.size;
            count += 1;
            total = total.saturating_add(len);
            if over.is_none() {
                if count > limits.max_frames {
                    over = Some(format!(
                        "message has more than {} frames",
                        limits.max_frames
                    ));
                } else if total > limits.max_message_bytes {
                    over = Some(format!(
                        "message is larger than the limit of {} bytes (frame {} declares {len} bytes)",
                        limits.max_message_bytes,
                        count - 1
                    ));
                }
                if over.is_some() {
                    // Keep frame 0 for the error reply; free the rest now.
                    frames.truncate(1);
                }
            }
            if over.is_some() {
                self.skip(len).await?;
            } else {
                let frame = self.frame(len as usize).await?;
                seen(&frame);
                frames.push(frame);
            }
            if !h.more {
                break;
            }
        }
        if self.buf.is_empty() && self.buf.capacity() > 2 * READ_CHUNK {
            // Grown for an odd item: do not keep it while the connection idles.
            self.buf = BytesMut::new();
        }
        Ok(Some(match over {
            Some(reason) => Incoming::TooLarge {
                head: frames,
                reason,
            },
            None => Incoming::Message(frames),
        }))
    }
}

/// What the peer said in its READY (or INITIATE).
#[derive(Debug, Default)]
pub struct PeerInfo {
    /// `Socket-Type`.
    pub socket_type: String,
    /// `Identity` (empty when not sent).
    pub identity: Bytes,
    /// Under PLAIN, as its server: whom the credentials named, as the
    /// authenticator said (ZAP's User-Id). Never the password.
    pub user: Option<String>,
    /// Under CURVE: the connection's codecs, for [`secure`].
    pub session: Option<curve::Session>,
}

/// A connection's halves after its handshake: as they were under NULL and
/// PLAIN, wrapped in CURVE's codecs under CURVE (the bytes `reader` read
/// past the handshake go through them first).
pub fn secure<R, W>(
    reader: FrameReader<R>,
    writer: W,
    session: Option<curve::Session>,
    pool: Option<Arc<ReceivePool>>,
    limits: &Limits,
) -> (
    FrameReader<crate::curve_io::ReadStream>,
    crate::curve_io::WriteStream,
)
where
    R: AsyncRead + Send + Unpin + 'static,
    W: AsyncWrite + Send + Unpin + 'static,
{
    let (inner, ahead) = reader.into_parts();
    match session {
        None => (
            FrameReader::from_parts(Box::new(inner), ahead, pool),
            Box::new(writer),
        ),
        Some(mut s) => {
            s.decrypter.set_max_frame(limits.max_message_bytes);
            let r = crate::curve_io::CurveReader::new(inner, s.decrypter, &ahead);
            (
                FrameReader::from_parts(Box::new(r), BytesMut::new(), pool),
                Box::new(crate::curve_io::CurveWriter::new(writer, s.encrypter)),
            )
        }
    }
}

/// Checks a PLAIN client's username and password: the user they name
/// (for logs), or why they are refused (sent to the client in ERROR).
pub trait Authenticator: Send + Sync {
    fn authenticate(&self, username: &[u8], password: &[u8]) -> Result<String, String>;
}

/// A connection's security mechanism and role.
#[derive(Clone, Copy)]
pub enum Security<'a> {
    /// RFC 23: no credentials either way.
    Null,
    /// RFC 24, as the client: present these credentials to a server that
    /// asks for them (its greeting names PLAIN); to one that takes none
    /// (NULL), connect without them.
    PlainClient {
        username: &'a [u8],
        password: &'a [u8],
    },
    /// RFC 24, as the server: a client must present credentials this
    /// authenticator takes.
    PlainServer(&'a dyn Authenticator),
    /// RFC 26, as the client: our key pair, and the server's public key.
    CurveClient {
        keys: &'a curve::Keypair,
        server: &'a [u8; curve::KEY_LEN],
    },
    /// As a client: whichever of these the server's greeting asks for
    /// (NULL when it asks for none).
    Client {
        plain: Option<(&'a [u8], &'a [u8])>,
        curve: Option<(&'a curve::Keypair, &'a [u8; curve::KEY_LEN])>,
    },
    /// RFC 26, as the server: our key pair, and who may connect.
    CurveServer {
        keys: &'a curve::Keypair,
        check: &'a dyn curve::KeyCheck,
    },
}

impl Security<'_> {
    fn mechanism(&self) -> frame::Mechanism {
        match self {
            Security::Null => frame::Mechanism::Null,
            Security::PlainClient { .. } | Security::PlainServer(_) => frame::Mechanism::Plain,
            Security::CurveClient { .. } | Security::CurveServer { .. } => frame::Mechanism::Curve,
            Security::Client { curve: Some(_), .. } => frame::Mechanism::Curve,
            Security::Client { plain: Some(_), .. } => frame::Mechanism::Plain,
            Security::Client { .. } => frame::Mechanism::Null,
        }
    }

    fn is_server(&self) -> bool {
        matches!(
            self,
            Security::PlainServer(_) | Security::CurveServer { .. }
        )
    }
}

/// Why a handshake was refused by the peer or by us: ZMTP error texts
/// that name the mechanism, never a credential.
fn mismatch(ours: &Security<'_>, theirs: frame::Greeting) -> String {
    match (ours, theirs.mechanism) {
        (Security::PlainServer(_), frame::Mechanism::Null) => {
            "this endpoint requires credentials (ZMTP PLAIN with stowd's token); the peer \
             sent none (NULL)"
                .into()
        }
        (Security::Null, frame::Mechanism::Plain) => {
            "one side presents credentials (ZMTP PLAIN) and the other takes none (NULL): \
             the server requires stowd's token, or takes no token"
                .into()
        }
        (Security::CurveServer { .. }, m) => format!(
            "this endpoint requires CURVE (an allowed client key and this server's public \
             key); the peer speaks {}",
            m.name()
        ),
        (_, frame::Mechanism::Curve) => format!(
            "the server requires CURVE (its public key and an allowed client key); this \
             peer speaks {}",
            ours.mechanism().name()
        ),
        (Security::CurveClient { .. }, m) => {
            format!("this peer speaks CURVE; the server speaks {}", m.name())
        }
        (_, m) if m == ours.mechanism() => format!(
            "the peer is a {} server too: one side must be the client",
            m.name()
        ),
        (_, m) => format!(
            "the peer speaks {}, this side {}",
            m.name(),
            ours.mechanism().name()
        ),
    }
}

/// Sends ERROR with `reason` (best effort) and returns the error to give.
async fn refuse<W: AsyncWrite + Unpin + ?Sized>(writer: &mut W, reason: String) -> ZmtpError {
    let _ = writer.write_all(&frame::error_command(&reason)).await;
    let _ = writer.flush().await;
    protocol(reason)
}

/// Reads the next command; an ERROR becomes the peer's refusal.
async fn expect_command<R: AsyncRead + Unpin>(
    reader: &mut FrameReader<R>,
    want: &str,
) -> Result<Bytes, ZmtpError> {
    let (name, body) = reader.read_command().await?;
    if name == "ERROR" {
        return Err(protocol(format!(
            "peer refused the connection: {}",
            frame::error_reason(&body)
        )));
    }
    if name != want {
        return Err(protocol(format!("expected {want}, got {name:?}")));
    }
    Ok(body)
}

/// Writes a command frame whose body (name included) is `body`.
async fn write_command<W: AsyncWrite + Unpin + ?Sized>(
    writer: &mut W,
    body: &[u8],
) -> Result<(), ZmtpError> {
    writer.write_all(&frame::command_with_body(body)).await?;
    writer.flush().await?;
    Ok(())
}

/// Reads the next command, `want`, whole (name included), as CURVE's
/// handshake takes it; an ERROR becomes the peer's refusal.
async fn expect_body<R: AsyncRead + Unpin>(
    reader: &mut FrameReader<R>,
    want: &str,
) -> Result<Vec<u8>, ZmtpError> {
    let data = expect_command(reader, want).await?;
    let mut body = Vec::with_capacity(1 + want.len() + data.len());
    body.push(want.len() as u8);
    body.extend_from_slice(want.as_bytes());
    body.extend_from_slice(&data);
    Ok(body)
}

/// The greeting and READY exchange under NULL. `accept` lists the peer
/// socket types we talk to; others get an ERROR command and a closed
/// connection.
pub async fn handshake<R, W>(
    reader: &mut FrameReader<R>,
    writer: &mut W,
    socket_type: &str,
    identity: &[u8],
    accept: &[&str],
) -> Result<PeerInfo, ZmtpError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + ?Sized,
{
    handshake_with(
        reader,
        writer,
        Security::Null,
        socket_type,
        identity,
        accept,
    )
    .await
}

/// The handshake under `security`: the greeting, then NULL's READY
/// exchange, or PLAIN's or CURVE's HELLO, WELCOME, INITIATE and READY
/// (under CURVE, [`PeerInfo::session`] then holds the codecs every later
/// byte goes through: [`secure`]). A peer of
/// another mechanism or role, wrong credentials or an unaccepted socket
/// type get an ERROR command (when the peer can read one) and a closed
/// connection; the error says which, and never carries a credential.
pub async fn handshake_with<R, W>(
    reader: &mut FrameReader<R>,
    writer: &mut W,
    security: Security<'_>,
    socket_type: &str,
    identity: &[u8],
    accept: &[&str],
) -> Result<PeerInfo, ZmtpError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + ?Sized,
{
    let as_server = security.is_server();
    let adaptive = matches!(
        security,
        Security::PlainClient { .. } | Security::CurveClient { .. } | Security::Client { .. }
    );
    let theirs = if adaptive {
        // A client with credentials offers them only to a server that asks:
        // the signature and version first (libzmq sends the rest of its
        // greeting once it has them), the server's greeting read, then our
        // mechanism, the server's.
        let ours = frame::greeting_as(frame::Mechanism::Plain, false);
        writer.write_all(&ours[..11]).await?;
        writer.flush().await?;
        let theirs = reader.read_greeting().await?;
        let rest = frame::greeting_as(theirs.mechanism, false);
        writer.write_all(&rest[11..]).await?;
        writer.flush().await?;
        theirs
    } else {
        writer
            .write_all(&frame::greeting_as(security.mechanism(), as_server))
            .await?;
        writer.flush().await?;
        reader.read_greeting().await?
    };
    // Credentials offered to a server that takes none: NULL, without them;
    // a client of both mechanisms speaks the server's.
    let security = match (security, theirs.mechanism) {
        (Security::PlainClient { .. }, frame::Mechanism::Null) => Security::Null,
        (Security::Client { plain, curve }, m) => match (m, plain, curve) {
            (frame::Mechanism::Curve, _, Some((keys, server))) => {
                Security::CurveClient { keys, server }
            }
            (frame::Mechanism::Plain, Some((username, password)), _) => {
                Security::PlainClient { username, password }
            }
            (frame::Mechanism::Null, _, _) => Security::Null,
            // Neither fits: refused below, in the words of what we have.
            (_, _, Some((keys, server))) => Security::CurveClient { keys, server },
            (_, Some((username, password)), None) => Security::PlainClient { username, password },
            (_, None, None) => Security::Null,
        },
        (s, _) => s,
    };
    // libzmq leaves the as-server byte 0 even as a PLAIN server, so only a
    // peer that claims to be the server when we are is refused for it.
    if theirs.mechanism != security.mechanism() || (theirs.as_server && security.is_server()) {
        let reason = mismatch(&security, theirs);
        // The peer reads a command after the greeting (READY, HELLO or
        // WELCOME): an ERROR there tells it why.
        return Err(refuse(writer, reason).await);
    }
    let mut props: Vec<(&str, &[u8])> = vec![("Socket-Type", socket_type.as_bytes())];
    if !identity.is_empty() {
        props.push(("Identity", identity));
    }
    let mut user = None;
    let mut session = None;
    let body = match security {
        Security::Null => {
            writer.write_all(&frame::ready_command(&props)).await?;
            writer.flush().await?;
            expect_command(reader, "READY").await?
        }
        Security::PlainClient { username, password } => {
            writer
                .write_all(&frame::hello_command(username, password))
                .await?;
            writer.flush().await?;
            expect_command(reader, "WELCOME").await?;
            writer.write_all(&frame::initiate_command(&props)).await?;
            writer.flush().await?;
            expect_command(reader, "READY").await?
        }
        Security::Client { .. } => unreachable!("a client of both mechanisms chose one above"),
        Security::PlainServer(auth) => {
            let hello = expect_command(reader, "HELLO").await?;
            let (username, password) = match frame::parse_hello(&hello) {
                Ok(c) => c,
                Err(e) => return Err(refuse(writer, e.to_string()).await),
            };
            match auth.authenticate(username, password) {
                Ok(u) => user = Some(u),
                Err(reason) => return Err(refuse(writer, reason).await),
            }
            writer.write_all(&frame::welcome_command()).await?;
            writer.flush().await?;
            let body = expect_command(reader, "INITIATE").await?;
            writer.write_all(&frame::ready_command(&props)).await?;
            writer.flush().await?;
            body
        }
        Security::CurveClient { keys, server } => {
            let mut shake = ClientHandshake::new(keys, server)?;
            write_command(writer, &shake.hello()).await?;
            let welcome = expect_body(reader, "WELCOME").await?;
            let initiate = shake.welcome(&welcome, &frame::properties(&props))?;
            write_command(writer, &initiate).await?;
            let ready = expect_body(reader, "READY").await?;
            let (metadata, s) = shake.ready(&ready)?;
            session = Some(s);
            Bytes::from(metadata)
        }
        Security::CurveServer { keys, check } => {
            let mut shake = ServerHandshake::new(keys)?;
            let hello = expect_body(reader, "HELLO").await?;
            match shake.hello(&hello) {
                Ok(welcome) => write_command(writer, &welcome).await?,
                Err(e) => return Err(refuse(writer, e.to_string()).await),
            }
            let initiate = expect_body(reader, "INITIATE").await?;
            let initiated = match shake.initiate(&initiate, check) {
                Ok(i) => i,
                Err(e) => return Err(refuse(writer, e.to_string()).await),
            };
            user = Some(initiated.user);
            let (ready, s) = shake.ready(&frame::properties(&props))?;
            write_command(writer, &ready).await?;
            session = Some(s);
            Bytes::from(initiated.metadata)
        }
    };
    let mut info = PeerInfo {
        user,
        session,
        ..PeerInfo::default()
    };
    for (key, value) in frame::ready_properties(&body)? {
        if key.eq_ignore_ascii_case("Socket-Type") {
            info.socket_type = String::from_utf8_lossy(&value).into_owned();
        } else if key.eq_ignore_ascii_case("Identity") {
            info.identity = value;
        }
    }
    if !accept.iter().any(|t| *t == info.socket_type) {
        let reason = format!("a {socket_type} does not talk to a {}", info.socket_type);
        return Err(refuse(writer, reason).await);
    }
    Ok(info)
}

#[cfg(test)]
mod tests;
