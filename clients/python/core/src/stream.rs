//! The socket reader and writer: [`Stream`], a deadline-bound stream (TCP,
//! or a Unix stream socket for `ipc://`) with a read-ahead buffer. It reads ZMTP frame headers (parsed in place
//! by stowd's framer, [`stowage_transport::frame`]) and frame bytes, long
//! stretches straight from the socket to where they belong, and writes
//! with `sendmsg` without blocking. What the bytes mean is the callers'
//! ([`crate::message`], [`crate::receive`]).

use std::collections::VecDeque;
use std::io::IoSlice;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use bytes::Bytes;
use stowage_transport::curve::{CurveError, Decrypter, Encrypter, Session};
use stowage_transport::frame::{self, Decoded};
use stowage_wire::native::LayoutMemo;

use crate::error::{Fail, interrupted};
use crate::wait::{Spin, wait};

/// Largest frame 0 accepted (a get_ok's descriptors; stowd's own limit on
/// a message's frame 0 is the same order).
pub(crate) const MAX_FRAME0: u64 = 256 << 20;

/// Most slices one `writev` takes (Linux's IOV_MAX): a request is written
/// in batches of at most this many.
pub(crate) const IOV_MAX: usize = 1024;

/// Bytes of the read-ahead buffer: a reply's frame headers, frame 0 and
/// small data frames come out of it, several per `recv`.
const AHEAD: usize = 64 << 10;

/// The socket under a [`Stream`]: a `tcp://` endpoint's, or an `ipc://`
/// one's (a Unix stream socket; ZMTP is the same bytes over either). Every
/// read and write goes through its descriptor.
pub(crate) enum Socket {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Socket {
    fn set_read_timeout(&self, d: Option<Duration>) -> std::io::Result<()> {
        match self {
            Socket::Tcp(t) => t.set_read_timeout(d),
            Socket::Unix(u) => u.set_read_timeout(d),
        }
    }
}

impl AsRawFd for Socket {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Socket::Tcp(t) => t.as_raw_fd(),
            Socket::Unix(u) => u.as_raw_fd(),
        }
    }
}

/// A deadline-bound stream. Reads go through a small read-ahead buffer,
/// filled by one blocking `recv` (the socket's receive timeout the time
/// left, [`Stream::arm`]) when the client does not spin for the reply, or
/// by a `recv` that does not block, a spin, then a `poll` until the
/// deadline when it does; except long stretches (at least half of it, one
/// place or many that follow on from each other), which go from the
/// socket straight to where they belong with `MSG_WAITALL`.
///
/// Why: a small get used to cost the client 22 system calls (each read
/// armed with two `setsockopt` for its timeout, a frame header read a byte
/// or eight at a time, the socket switched to non-blocking and back around
/// each send); then a `sendmsg`, a `recv` that finds nothing yet, a `poll`
/// and one `recv` of the whole reply (docs/benchmarks.md, "A 1-row get");
/// now, not spinning, a `sendmsg` and one `recv` (0.88 fewer system calls
/// a 1-row get on one CPU, "A reply slept for in one receive"). Bulk reads stay
/// blocking: a non-blocking read loop (`recv` until `EAGAIN`, then `poll`)
/// took a 1 GiB get_into at 2.45-2.91 GB/s where the blocking one took
/// 2.83-3.08 (one-off check, alternating).
pub(crate) struct Stream {
    pub(crate) sock: Socket,
    pub(crate) deadline: Instant,
    pub(crate) spin: Spin,
    /// Read ahead: bytes `pos..end` are received and not yet taken.
    ahead: Box<[u8]>,
    pos: usize,
    end: usize,
    /// CURVE's codecs once the handshake made them: every byte read or
    /// written then goes through them (None: NULL or PLAIN, bytes as they
    /// are on the wire).
    curve: Option<Box<Curve>>,
    /// When the last reply on this connection was read to its end (None
    /// before the first): see [`Stream::may_be_closed`].
    pub(crate) replied: Option<Instant>,
    /// The receive timeout set on the socket (`SO_RCVTIMEO`), None before
    /// the first: see [`Stream::arm`].
    armed: Option<Duration>,
    /// The last get_ok's body and its fields' layout: a get of the same
    /// fields and shape as the last is answered by the same body, whose
    /// layout is then not read again ([`crate::receive::read_head`]).
    pub(crate) layouts: LayoutMemo,
}

impl Stream {
    pub(crate) fn new(sock: Socket, deadline: Instant, spin: Duration) -> Stream {
        Stream {
            sock,
            deadline,
            spin: Spin::new(spin),
            ahead: vec![0u8; AHEAD].into_boxed_slice(),
            pos: 0,
            end: 0,
            curve: None,
            replied: None,
            armed: None,
            layouts: LayoutMemo::default(),
        }
    }

    /// From here on, the stream's bytes are CURVE's MESSAGE commands,
    /// sealed and opened by `session` (the bytes already read ahead are the
    /// first of them).
    pub(crate) fn secure(&mut self, session: Session) {
        let mut c = Box::new(Curve {
            encrypter: session.encrypter,
            decrypter: session.decrypter,
            wire: vec![0u8; CURVE_WIRE].into_boxed_slice(),
            staged: Vec::new(),
            staged_pos: 0,
            sealed: VecDeque::new(),
            broken: None,
        });
        c.take_wire(&self.ahead[self.pos..self.end]);
        (self.pos, self.end) = (0, 0);
        self.curve = Some(c);
    }

    /// The time left before the deadline (a timeout once none is).
    fn left(&self) -> Result<Duration, Fail> {
        self.deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| Fail::Timeout("no reply within the timeout".into()))
    }

    /// Sets the socket's receive timeout to the time left, unless the one
    /// set is within [`ARM_SLACK`] of it: a blocking read then ends by the
    /// deadline (at most that much after it), and a call made right after
    /// the last one (its deadline a few µs later, the same timeout) sets
    /// nothing. A timeout set shorter than the time left only wakes a read
    /// early, which then sets it again.
    fn arm(&mut self) -> Result<(), Fail> {
        let left = self.left()?;
        let near = |set: Duration| set <= left + ARM_SLACK && set + ARM_SLACK >= left;
        if !self.armed.is_some_and(near) {
            self.sock.set_read_timeout(Some(left)).map_err(Stream::io)?;
            self.armed = Some(left);
        }
        Ok(())
    }

    /// One blocking `recv` into the read-ahead buffer, within the deadline:
    /// how many bytes. A reply not come yet is slept for in the `recv`
    /// itself, not in a `recv` that finds nothing, a `poll` and a second
    /// `recv`.
    fn recv_blocking(&mut self) -> Result<usize, Fail> {
        let mut iov = [libc::iovec {
            iov_base: self.ahead.as_mut_ptr().cast(),
            iov_len: self.ahead.len(),
        }];
        // SAFETY: the read-ahead buffer is the stream's own, alive and
        // touched by nothing else while it is read into.
        unsafe { self.recv_within(&mut iov, 0) }
    }

    fn io(e: std::io::Error) -> Fail {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                Fail::Timeout("no reply within the timeout".into())
            }
            std::io::ErrorKind::UnexpectedEof => Fail::Io("stowd closed the connection".into()),
            _ => Fail::Io(e.to_string()),
        }
    }

    /// Fills the read-ahead buffer with whatever comes first (waiting until
    /// the deadline if nothing has come yet: in one blocking `recv`, or a
    /// spin then `poll`, as [`Spin::sleeps`] says). Called with the
    /// read-ahead buffer used up.
    fn fill(&mut self) -> Result<(), Fail> {
        let n = match self.curve.as_deref_mut() {
            // Not spinning (`spin_us=0`, or resting after a missed spin):
            // the reply is slept for in one blocking `recv`.
            None if self.spin.sleeps() => self.recv_blocking()?,
            None => recv_some(&self.sock, &mut self.spin, self.deadline, &mut self.ahead)?,
            Some(c) => c.read(&self.sock, &mut self.spin, self.deadline, &mut self.ahead)?,
        };
        (self.pos, self.end) = (0, n);
        Ok(())
    }

    /// One blocking `recvmsg(2)` into `iov` with `flags`, the socket's
    /// receive timeout armed ([`Stream::arm`]) and the wait going on
    /// through the receive timeout and signals (whose handlers run,
    /// [`interrupted`]) until the deadline: the bytes read.
    ///
    /// # Safety
    /// Every iovec names writable bytes the caller owns, alive and touched
    /// by nothing else for the call.
    unsafe fn recv_within(
        &mut self,
        iov: &mut [libc::iovec],
        flags: libc::c_int,
    ) -> Result<usize, Fail> {
        loop {
            self.arm()?;
            // SAFETY: an all-zero msghdr is valid (no name, no control data).
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = iov.len() as _;
            // SAFETY: the caller's contract on `iov`.
            let n = unsafe { libc::recvmsg(self.sock.as_raw_fd(), &mut msg, flags) };
            match n {
                0 => return Err(Fail::Io("stowd closed the connection".into())),
                n if n > 0 => return Ok(n as usize),
                _ => match std::io::Error::last_os_error() {
                    e if e.kind() == std::io::ErrorKind::Interrupted => interrupted()?,
                    // The receive timeout: the deadline decides, in `arm`.
                    e if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    e => return Err(Stream::io(e)),
                },
            }
        }
    }

    /// Reads the next bytes of the stream into `places`, (address, len)
    /// pairs filled in order: first from the read-ahead buffer; then, while
    /// at least half the read-ahead's size is still to come, straight into
    /// the places, up to [`IOV_MAX`] of them a `recvmsg` (no copy, few
    /// calls, however small each place); the last few bytes through the
    /// read-ahead.
    ///
    /// # Safety
    /// Each place must be writable bytes the caller owns, alive and
    /// touched by nothing else for the call.
    pub(crate) unsafe fn read_scattered(&mut self, places: &[(usize, usize)]) -> Result<(), Fail> {
        let (mut i, mut off) = (0usize, 0usize);
        let mut left: usize = places.iter().map(|p| p.1).sum();
        while left > 0 {
            let (dest, len) = places[i];
            if off == len {
                (i, off) = (i + 1, 0);
                continue;
            }
            if self.pos < self.end {
                let k = (self.end - self.pos).min(len - off);
                // SAFETY: `dest + off .. + k` lies in the place (contract).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        self.ahead.as_ptr().add(self.pos),
                        (dest + off) as *mut u8,
                        k,
                    );
                }
                self.pos += k;
                off += k;
                left -= k;
            } else if let Some(c) = self.curve.as_deref_mut() {
                // CURVE: the plaintext, already in memory, goes straight
                // to its place.
                // SAFETY: `dest + off .. + len - off` lies in the place
                // (contract), which nothing else touches for the call.
                let place =
                    unsafe { std::slice::from_raw_parts_mut((dest + off) as *mut u8, len - off) };
                let k = c.read(&self.sock, &mut self.spin, self.deadline, place)?;
                off += k;
                left -= k;
            } else if left >= AHEAD / 2 {
                let mut iov: Vec<libc::iovec> = places[i..]
                    .iter()
                    .take(IOV_MAX)
                    .map(|&(d, l)| libc::iovec {
                        iov_base: d as *mut libc::c_void,
                        iov_len: l,
                    })
                    .collect();
                iov[0].iov_base = (dest + off) as *mut libc::c_void;
                iov[0].iov_len = len - off;
                // SAFETY: each iovec lies in a place (contract), which
                // nothing else touches for the call.
                let mut n = unsafe { self.recv_within(&mut iov, libc::MSG_WAITALL) }?;
                left -= n;
                // Advance past the bytes read.
                while n > 0 {
                    let k = n.min(places[i].1 - off);
                    off += k;
                    n -= k;
                    if off == places[i].1 && n > 0 {
                        (i, off) = (i + 1, 0);
                    }
                }
            } else {
                self.fill()?;
            }
        }
        Ok(())
    }

    pub(crate) fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), Fail> {
        // SAFETY: `buf` is ours, exclusively, for the call.
        unsafe { self.read_scattered(&[(buf.as_mut_ptr() as usize, buf.len())]) }
    }

    pub(crate) fn write_all(&mut self, buf: &[u8]) -> Result<(), Fail> {
        self.write_all_vectored(&mut [IoSlice::new(buf)])
    }

    /// Writes every byte of `slices` with `writev`, resuming after partial
    /// writes: the socket non-blocking meanwhile, waiting in `poll` for
    /// room (why: the module doc).
    pub(crate) fn write_all_vectored(&mut self, slices: &mut [IoSlice<'_>]) -> Result<(), Fail> {
        if self.curve.is_some() {
            return self.write_sealed(slices);
        }
        self.send_all(slices)
    }

    /// CURVE's `write_all_vectored`: the plaintext frames sealed into
    /// MESSAGE commands, written whenever [`CURVE_WIRE`] bytes of them are
    /// sealed, and at the end (a frame cut off at the end is sealed once
    /// its last bytes are written).
    fn write_sealed(&mut self, slices: &[IoSlice<'_>]) -> Result<(), Fail> {
        let c = self.curve.as_deref_mut().expect("a CURVE stream");
        let mut sealed = std::mem::take(&mut c.sealed);
        for s in slices {
            for piece in s.chunks(CURVE_WIRE) {
                let c = self.curve.as_deref_mut().expect("a CURVE stream");
                if let Err(e) = c.encrypter.feed(piece, &mut sealed) {
                    return Err(curve_fail(e));
                }
                if sealed.iter().map(Bytes::len).sum::<usize>() >= CURVE_WIRE {
                    self.send_sealed(&mut sealed)?;
                }
            }
        }
        if !sealed.is_empty() {
            self.send_sealed(&mut sealed)?;
        }
        if let Some(c) = self.curve.as_deref_mut() {
            c.sealed = sealed;
        }
        Ok(())
    }

    /// Writes and forgets the sealed MESSAGE commands `sealed`.
    fn send_sealed(&mut self, sealed: &mut VecDeque<Bytes>) -> Result<(), Fail> {
        let mut io: Vec<IoSlice<'_>> = sealed.iter().map(|b| IoSlice::new(b)).collect();
        let r = self.send_all(&mut io);
        drop(io);
        sealed.clear();
        r
    }

    /// Writes every byte of `slices` to the socket as they are.
    fn send_all(&mut self, mut slices: &mut [IoSlice<'_>]) -> Result<(), Fail> {
        IoSlice::advance_slices(&mut slices, 0);
        while !slices.is_empty() {
            match self.send_vectored(slices) {
                Ok(0) => return Err(Fail::Io("stowd closed the connection".into())),
                Ok(n) => IoSlice::advance_slices(&mut slices, n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => interrupted()?,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => wait(
                    &self.sock,
                    self.deadline,
                    libc::POLLOUT,
                    "could not send within the timeout",
                )?,
                Err(e) => return Err(Stream::io(e)),
            }
        }
        Ok(())
    }

    /// `sendmsg(2)` of `slices` that does not block (`MSG_DONTWAIT`, so the
    /// socket's own mode is never switched: two `ioctl`s a call fewer) and
    /// never raises SIGPIPE: the bytes taken, or the error.
    fn send_vectored(&self, slices: &[IoSlice<'_>]) -> std::io::Result<usize> {
        // SAFETY: an all-zero msghdr is valid (no name, no control data).
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        // IoSlice is ABI-compatible with iovec on Unix (std guarantees it).
        msg.msg_iov = slices.as_ptr() as *mut libc::iovec;
        msg.msg_iovlen = slices.len().min(IOV_MAX) as _;
        // SAFETY: `msg` points at `slices`, alive and unchanged for the call.
        let n = unsafe {
            libc::sendmsg(
                self.sock.as_raw_fd(),
                &msg,
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }

    /// Reads and throws away `n` bytes.
    /// (Through the read-ahead buffer: no scratch buffer to clear per call,
    /// which cost a small get a 64 KiB memset when it skipped nothing.)
    pub(crate) fn skip(&mut self, mut n: u64) -> Result<(), Fail> {
        loop {
            let k = ((self.end - self.pos) as u64).min(n);
            self.pos += k as usize;
            n -= k;
            if n == 0 {
                return Ok(());
            }
            self.fill()?;
        }
    }

    /// Whether a kept connection may have been closed by stowd while it
    /// sat idle: [`Stream::peer_closed`], asked only after a pause of
    /// [`RECHECK_AFTER`] since the last reply. Back-to-back calls skip the
    /// peek, a system call each (350 ns alone on these VMs; client CPU of
    /// one-field calls 0.96-0.99x, `bench/core_ab.py`, one CPU): within
    /// that pause no restarted stowd can be listening yet, and stowd
    /// evicts the connection idle the longest, so one that just answered
    /// is the last it would close. The peek never made the reuse
    /// race-free either: stowd may close a connection between the peek
    /// and the request.
    pub(crate) fn may_be_closed(&self) -> bool {
        self.replied.is_none_or(|t| t.elapsed() >= RECHECK_AFTER) && self.peer_closed()
    }

    /// Whether the peer closed the connection (or it broke) while it sat
    /// idle between calls, with nothing of a message left to read: a kept
    /// connection to a stowd that exited or restarted. Such a connection is
    /// not reused: a request written on it would reach no one.
    pub(crate) fn peer_closed(&self) -> bool {
        if self.pos != self.end {
            return false;
        }
        let mut b = [0u8; 1];
        // SAFETY: one writable byte; a peek moves nothing.
        let n = unsafe {
            libc::recv(
                self.sock.as_raw_fd(),
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => true,
            n if n > 0 => false,
            _ => !matches!(
                std::io::Error::last_os_error().kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
            ),
        }
    }

    /// Whether bytes of the stream are in memory already (read ahead, or
    /// opened by CURVE), so that the next read takes them without waiting
    /// for the socket.
    pub(crate) fn buffered(&self) -> bool {
        self.pos < self.end
            || self.curve.as_deref().is_some_and(|c| {
                c.staged_pos < c.staged.len() || c.decrypter.ready() > 0 || c.broken.is_some()
            })
    }

    /// Whether the read-ahead buffer is full without holding a whole
    /// message (not CURVE's): a reply larger than it is arriving, for a
    /// reader that may wait rather than a poll.
    pub(crate) fn ahead_full(&self) -> bool {
        self.curve.is_none() && self.pos == 0 && self.end == self.ahead.len()
    }

    /// Whether a whole message is in the read-ahead buffer (not CURVE's),
    /// so that reading it makes no system call.
    pub(crate) fn whole_message_ahead(&self) -> bool {
        self.curve.is_none() && frame::message_complete(&self.ahead[self.pos..self.end])
    }

    /// Frame 0 of the whole message in the read-ahead buffer (not
    /// CURVE's), None when there is none.
    pub(crate) fn frame0_ahead(&self) -> Option<&[u8]> {
        if !self.whole_message_ahead() {
            return None;
        }
        let bytes = &self.ahead[self.pos..self.end];
        match frame::parse_header(bytes) {
            Ok(Decoded::Done(h)) => {
                let end = (h.header_len as u64).checked_add(h.size)?;
                bytes.get(h.header_len..usize::try_from(end).ok()?)
            }
            _ => None,
        }
    }

    /// Whether a whole message has arrived and is waiting to be read, so
    /// that reading it does not block: what has arrived is moved into the
    /// read-ahead buffer without waiting and its frame headers walked (past
    /// the read-ahead's size, the rest is peeked at). True as well when the
    /// socket is closed or failed (the read then says so); false when more
    /// than [`PEEK_MAX`] bytes wait (a large reply, for a reader that may
    /// wait).
    pub(crate) fn message_waiting(&mut self) -> bool {
        if let Some(c) = self.curve.as_deref_mut() {
            return c.message_waiting(&self.sock, &self.ahead[self.pos..self.end]);
        }
        if frame::message_complete(&self.ahead[self.pos..self.end]) {
            return true;
        }
        // What has arrived is read now, without waiting, into the
        // read-ahead (moved to its front first), where the reply's read
        // then takes it: one system call for a small reply, where peeking
        // (`FIONREAD`, a peek into a buffer of its own, then the read
        // itself) took three.
        if self.pos > 0 {
            self.ahead.copy_within(self.pos..self.end, 0);
            (self.pos, self.end) = (0, self.end - self.pos);
        }
        let fd = self.sock.as_raw_fd();
        let room = &mut self.ahead[self.end..];
        // A full read-ahead (a reply larger than it) reads nothing here:
        // the rest is peeked at below.
        if !room.is_empty() {
            // SAFETY: `room` is writable for its length for the call.
            let n =
                unsafe { libc::recv(fd, room.as_mut_ptr().cast(), room.len(), libc::MSG_DONTWAIT) };
            match n {
                // Closed: readable, and the read says so.
                0 => return true,
                n if n > 0 => self.end += n as usize,
                // Nothing more yet (or a signal: the loop's reader wakes
                // at once if bytes wait); any other error: readable, and
                // the read says so.
                _ => {
                    return !matches!(
                        std::io::Error::last_os_error().kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                    );
                }
            }
        }
        if frame::message_complete(&self.ahead[..self.end]) {
            return true;
        }
        if self.end < self.ahead.len() {
            // Everything that had arrived is read, and the reply is not
            // whole: its rest is still to come.
            return false;
        }
        // A reply larger than the read-ahead: the rest is peeked at.
        let mut queued: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int.
        if unsafe { libc::ioctl(fd, libc::FIONREAD, &mut queued) } != 0 {
            return true;
        }
        let queued = queued.max(0) as usize;
        if queued == 0 || queued > PEEK_MAX {
            return false;
        }
        let mut bytes = self.ahead[..self.end].to_vec();
        let at = bytes.len();
        bytes.resize(at + queued, 0);
        // SAFETY: `queued` writable bytes at `at`.
        let n = unsafe {
            libc::recv(
                fd,
                bytes.as_mut_ptr().add(at).cast(),
                queued,
                libc::MSG_DONTWAIT | libc::MSG_PEEK,
            )
        };
        if n <= 0 {
            return n == 0
                || std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock;
        }
        bytes.truncate(at + n as usize);
        frame::message_complete(&bytes)
    }

    /// A frame header ([`frame::parse_header`]), parsed in place in the
    /// read-ahead buffer; one split across two reads is gathered in a
    /// stack buffer.
    pub(crate) fn header(&mut self) -> Result<frame::Header, Fail> {
        loop {
            match frame::parse_header(&self.ahead[self.pos..self.end]) {
                Ok(Decoded::Done(h)) => {
                    self.pos += h.header_len;
                    return Ok(h);
                }
                Ok(Decoded::Needs(_)) if self.pos == self.end => self.fill()?,
                Ok(Decoded::Needs(_)) => return self.header_split(),
                Err(e) => return Err(header_fail(e)),
            }
        }
    }

    /// [`Stream::header`] of a header whose first bytes end the read-ahead.
    fn header_split(&mut self) -> Result<frame::Header, Fail> {
        let mut b = [0u8; frame::MAX_HEADER];
        let mut have = 0;
        loop {
            match frame::parse_header(&b[..have]) {
                Ok(Decoded::Done(h)) => return Ok(h),
                Ok(Decoded::Needs(n)) => {
                    self.read_exact(&mut b[have..n])?;
                    have = n;
                }
                Err(e) => return Err(header_fail(e)),
            }
        }
    }

    /// A reply's frame header (a command there breaks the protocol): (more,
    /// size).
    pub(crate) fn frame_header(&mut self) -> Result<(bool, u64), Fail> {
        match self.header()? {
            frame::Header { command: true, .. } => {
                Err(Fail::Protocol("a command frame inside a reply".into()))
            }
            h => Ok((h.more, h.size)),
        }
    }

    /// A reply's frame 0 (at most [`MAX_FRAME0`] bytes), and whether data
    /// frames follow.
    pub(crate) fn head(&mut self) -> Result<(Vec<u8>, bool), Fail> {
        let (more, size) = self.frame_header()?;
        Ok((self.small_frame(size, MAX_FRAME0, "frame 0")?, more))
    }

    /// A whole frame of at most `max` bytes into a new buffer.
    pub(crate) fn small_frame(&mut self, size: u64, max: u64, what: &str) -> Result<Vec<u8>, Fail> {
        if size > max {
            return Err(Fail::Protocol(format!(
                "{what} of {size} bytes (at most {max})"
            )));
        }
        // Allocated, then zeroed: `vec![0; n]` asks for a zeroed allocation,
        // which glibc serves past its per-thread cache (a frame 0 every call).
        #[expect(clippy::slow_vector_initialization, reason = "not a zeroed allocation")]
        let mut out = Vec::with_capacity(size as usize);
        out.resize(size as usize, 0u8);
        self.read_exact(&mut out)?;
        Ok(out)
    }
}

/// A frame header the framer refused, in the client's words.
fn header_fail(e: frame::FrameError) -> Fail {
    match e {
        frame::FrameError::ReservedFlags(f) => {
            Fail::Protocol(format!("reserved frame flags {f:#04x}"))
        }
        e => Fail::Protocol(e.to_string()),
    }
}

/// Most bytes [`Stream::message_waiting`] peeks at.
const PEEK_MAX: usize = 4 << 20;

/// How long after its last reply a kept connection is reused without
/// asking whether stowd closed it ([`Stream::may_be_closed`]).
pub(crate) const RECHECK_AFTER: Duration = Duration::from_millis(1);

/// How far the socket's receive timeout may be from the time left before
/// it is set again ([`Stream::arm`]): a blocking read may end this much
/// after the deadline.
const ARM_SLACK: Duration = Duration::from_millis(1);

/// Bytes of CURVE's receive buffer (MESSAGE commands as they come off the
/// socket), and of sealed commands gathered before a write.
const CURVE_WIRE: usize = 256 << 10;

/// Receives whatever comes first into `buf` (waiting, spinning first, in
/// `poll` until the deadline if nothing has come yet): how many bytes.
fn recv_some(
    sock: &Socket,
    spin: &mut Spin,
    deadline: Instant,
    buf: &mut [u8],
) -> Result<usize, Fail> {
    let fd = sock.as_raw_fd();
    loop {
        // SAFETY: `buf` is valid for writes of its length for the call.
        let n = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), libc::MSG_DONTWAIT) };
        match n {
            0 => return Err(Fail::Io("stowd closed the connection".into())),
            n if n > 0 => return Ok(n as usize),
            _ => match std::io::Error::last_os_error() {
                e if e.kind() == std::io::ErrorKind::Interrupted => interrupted()?,
                e if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if !spin.wait(fd, deadline) {
                        wait(sock, deadline, libc::POLLIN, "no reply within the timeout")?
                    }
                }
                e => return Err(Stream::io(e)),
            },
        }
    }
}

/// A CURVE codec's refusal, in the client's words.
pub(crate) fn curve_fail(e: CurveError) -> Fail {
    match e {
        CurveError::PeerError(reason) => {
            Fail::Protocol(format!("stowd refused the connection: {reason}"))
        }
        e => Fail::Protocol(e.to_string()),
    }
}

/// A CURVE connection's state: its codecs, and the plaintext between them
/// and the stream. The plaintext is read in this order: the stream's
/// read-ahead, `staged`, the decrypter's.
struct Curve {
    encrypter: Encrypter,
    decrypter: Decrypter,
    /// Receive buffer for MESSAGE commands.
    wire: Box<[u8]>,
    /// Plaintext taken out of the decrypter by `message_waiting`, to walk
    /// its frame headers: bytes `staged_pos..` are not read yet.
    staged: Vec<u8>,
    staged_pos: usize,
    /// Sealed MESSAGE commands' buffer (kept for its capacity).
    sealed: VecDeque<Bytes>,
    /// Why the decrypter refused what came after the plaintext it holds:
    /// reported once that plaintext is read.
    broken: Option<String>,
}

impl Curve {
    /// Feeds received MESSAGE commands to the decrypter; a refusal is kept
    /// for after the frames opened before it.
    fn take_wire(&mut self, wire: &[u8]) {
        if self.broken.is_none()
            && let Err(e) = self.decrypter.feed(wire)
        {
            self.broken = Some(match curve_fail(e) {
                Fail::Protocol(m) => m,
                _ => unreachable!("curve_fail gives protocol failures"),
            });
        }
    }

    /// Reads plaintext into `out` (not empty), receiving and opening
    /// MESSAGE commands until there is some: how many bytes.
    fn read(
        &mut self,
        sock: &Socket,
        spin: &mut Spin,
        deadline: Instant,
        out: &mut [u8],
    ) -> Result<usize, Fail> {
        loop {
            if self.staged_pos < self.staged.len() {
                let k = (self.staged.len() - self.staged_pos).min(out.len());
                out[..k].copy_from_slice(&self.staged[self.staged_pos..self.staged_pos + k]);
                self.staged_pos += k;
                if self.staged_pos == self.staged.len() {
                    self.staged.clear();
                    self.staged_pos = 0;
                }
                return Ok(k);
            }
            if self.decrypter.ready() > 0 {
                return Ok(self.decrypter.read(out));
            }
            if let Some(m) = &self.broken {
                return Err(Fail::Protocol(m.clone()));
            }
            let n = recv_some(sock, spin, deadline, &mut self.wire)?;
            let wire = std::mem::take(&mut self.wire);
            self.take_wire(&wire[..n]);
            self.wire = wire;
        }
    }

    /// [`Stream::message_waiting`] for CURVE (`ahead`: the stream's unread
    /// read-ahead): what has arrived is received without waiting and
    /// opened, up to [`PEEK_MAX`] bytes of plaintext, then its frame
    /// headers walked. True also when the socket is closed or failed or a
    /// frame was refused (the read then says so); false while more than
    /// [`PEEK_MAX`] bytes of plaintext wait and the socket has more (it is
    /// then still readable, so an event loop waiting for it wakes).
    fn message_waiting(&mut self, sock: &Socket, ahead: &[u8]) -> bool {
        let fd = sock.as_raw_fd();
        loop {
            if self.broken.is_some() {
                return true;
            }
            let plain = ahead.len() + self.staged.len() - self.staged_pos + self.decrypter.ready();
            if plain > PEEK_MAX {
                let mut queued: libc::c_int = 0;
                // SAFETY: FIONREAD writes one int.
                if unsafe { libc::ioctl(fd, libc::FIONREAD, &mut queued) } != 0 {
                    return true;
                }
                if queued > 0 {
                    return false;
                }
                break;
            }
            // SAFETY: `wire` is valid for writes of its length for the call.
            let n = unsafe {
                libc::recv(
                    fd,
                    self.wire.as_mut_ptr().cast(),
                    self.wire.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            match n {
                0 => return true,
                n if n > 0 => {
                    let wire = std::mem::take(&mut self.wire);
                    self.take_wire(&wire[..n as usize]);
                    self.wire = wire;
                }
                _ => match std::io::Error::last_os_error().kind() {
                    std::io::ErrorKind::Interrupted => {}
                    std::io::ErrorKind::WouldBlock => break,
                    _ => return true,
                },
            }
        }
        // The decrypter's plaintext moves to `staged`, where it can be
        // walked (it is read from there first).
        let at = self.staged.len();
        self.staged.resize(at + self.decrypter.ready(), 0);
        let n = self.decrypter.read(&mut self.staged[at..]);
        debug_assert_eq!(at + n, self.staged.len());
        if ahead.is_empty() {
            return frame::message_complete(&self.staged[self.staged_pos..]);
        }
        let mut bytes = ahead.to_vec();
        bytes.extend_from_slice(&self.staged[self.staged_pos..]);
        frame::message_complete(&bytes)
    }
}
