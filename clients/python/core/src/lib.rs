//! `stowage._core`: the Rust core of the Python client: a tcp
//! `get_into` that receives straight into the caller's arrays, a `get` that
//! receives each field into one buffer, and a `send` that puts from the
//! caller's arrays.
//!
//! pyzmq receives every frame into memory libzmq allocates (fresh pages,
//! faulted in at about 1.4 GB/s on the benchmark machine), and the Python
//! client then copies each field into the caller's array: two copies and a
//! peak of twice the payload. Here the reply is read from the socket by
//! this crate: frame 0 is decoded by stowd's own codec
//! ([`stowage_wire::native::decode_reply_layout`]: where each field's rows
//! lie in the data frames still to come), and each data frame's bytes are
//! read from the socket straight into the rows they belong to, in the
//! caller's arrays. Nothing the size of the payload is allocated; the GIL
//! is released while bytes move.
//!
//! A put goes the other way without a copy either: pyzmq sends a frame
//! from one buffer, so the Python client joined the small rows of a put
//! into shared frames (a copy) before sending. [`Connection::send`] takes
//! the data frames as the caller's buffers (a shared frame as the list of
//! its pieces), holds them, releases the GIL, and writes them with
//! `writev`: frame headers and pieces of up to [`zmtp::COALESCE`] bytes are
//! copied into one small buffer (as stowd's own writer,
//! [`zmtp::write_message`], does: a slice per tiny piece costs the kernel
//! more than copying it), larger pieces go from where they lie, in batches
//! of at most [`IOV_MAX`] slices. A request is written without blocking
//! (`MSG_DONTWAIT`), the wait for room a `poll`, as libzmq sends: a
//! blocking `writev` of a large buffer, which waits inside the kernel, put
//! 1 GiB at 3.4 GB/s where this puts it at 4.5, on a par with pyzmq
//! (medians of 8, alternating, on the benchmark machine).
//!
//! The connection is stowd's ZMTP 3.0 (NULL security) as a DEALER, over
//! `std::net::TcpStream`: the greeting, READY and every frame header are
//! written and parsed by stowd's own framer, [`stowage_transport::frame`]
//! (which does no I/O: headers are parsed in place in the read-ahead
//! buffer); this crate does the reading and writing. A reply that breaks
//! the protocol, a timeout or an I/O error drops the connection (the next
//! call makes a new one), so a late or half-read reply is never taken for
//! the next one.
//!
//! Every envelope the Python client writes or reads, on any transport,
//! goes through [`codec`]: stowd's codec, with Python objects in and out.
//! [`fast`] reads a small call's arguments as the user gives them and lays
//! out its frames; [`indexes`] reads index inputs for both (modules point
//! down: `fast` uses `codec` and `indexes`, `codec` uses `indexes`).
//!
//! `DTYPES` is the dtype table stowd's codecs read (`stowage-plan`'s,
//! through `stowage-wire`), as `(name, itemsize, aliases)` tuples in table
//! order: the client's tests check `_dtypes.py` against it.

use std::io::IoSlice;
use std::net::TcpStream;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyConnectionError, PyTimeoutError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyTuple};
use stowage_transport::frame::{self, Decoded};
use stowage_transport::zmtp;
use stowage_wire::native::{self, FieldLayout, Limits, ReplyLayout, layout};

mod codec;
mod fast;
mod indexes;
mod pool;

pyo3::create_exception!(
    _core,
    ProtocolViolation,
    pyo3::exceptions::PyException,
    "The reply breaks stowage/1 or ZMTP (a connection it came on was dropped)."
);

/// Largest frame 0 accepted (a get_ok's descriptors; stowd's own limit on
/// a message's frame 0 is the same order).
const MAX_FRAME0: u64 = 256 << 20;

/// Most slices one `writev` takes (Linux's IOV_MAX): a request is written
/// in batches of at most this many.
const IOV_MAX: usize = 1024;

/// Why a call failed.
enum Fail {
    Timeout(String),
    Io(String),
    Protocol(String),
    /// The reply does not fit the caller's arrays (nothing was written).
    Mismatch(String),
    /// A field of plain values asked into an array (nothing was written).
    NotTensors(String),
}

impl From<Fail> for PyErr {
    fn from(f: Fail) -> PyErr {
        match f {
            Fail::Timeout(m) => PyTimeoutError::new_err(m),
            Fail::Io(m) => PyConnectionError::new_err(m),
            Fail::Protocol(m) => ProtocolViolation::new_err(m),
            Fail::Mismatch(m) => PyValueError::new_err(m),
            Fail::NotTensors(m) => PyTypeError::new_err(m),
        }
    }
}

/// Bytes of the read-ahead buffer: a reply's frame headers, frame 0 and
/// small data frames come out of it, several per `recv`.
const AHEAD: usize = 64 << 10;

/// A deadline-bound stream. Reads go through a small read-ahead buffer,
/// filled by a `recv` that does not block (and a `poll` until the deadline
/// when nothing has come yet), except long stretches (at least half of
/// it, one place or many that follow on from each other), which go from
/// the socket straight to where they belong with `MSG_WAITALL`, the
/// socket's receive timeout set to the time left.
///
/// Why: a small get used to cost the client 22 system calls (each read
/// armed with two `setsockopt` for its timeout, a frame header read a byte
/// or eight at a time, the socket switched to non-blocking and back around
/// each send); now it is a `sendmsg`, a `recv` that finds nothing yet, a
/// `poll` and one `recv` of the whole reply (docs/benchmarks.md, "A 1-row
/// get"). Bulk reads stay blocking: a non-blocking read loop (`recv` until
/// `EAGAIN`, then `poll`) took a 1 GiB get_into at 2.45-2.91 GB/s where
/// the blocking one took 2.83-3.08 (one-off check, alternating).
struct Stream {
    tcp: TcpStream,
    deadline: Instant,
    spin: Spin,
    /// Read ahead: bytes `pos..end` are received and not yet taken.
    ahead: Box<[u8]>,
    pos: usize,
    end: usize,
}

impl Stream {
    fn new(tcp: TcpStream, deadline: Instant, spin: Duration) -> Stream {
        Stream {
            tcp,
            deadline,
            spin: Spin::new(spin),
            ahead: vec![0u8; AHEAD].into_boxed_slice(),
            pos: 0,
            end: 0,
        }
    }

    /// The time left before the deadline (a timeout once none is).
    fn left(&self) -> Result<Duration, Fail> {
        self.deadline
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or_else(|| Fail::Timeout("no reply within the timeout".into()))
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

    /// Fills the read-ahead buffer with whatever comes first (waiting in
    /// `poll` until the deadline if nothing has come yet).
    fn fill(&mut self) -> Result<(), Fail> {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&self.tcp);
        loop {
            // SAFETY: `ahead` is valid for writes of its length for the call.
            let n = unsafe {
                libc::recv(
                    fd,
                    self.ahead.as_mut_ptr().cast(),
                    self.ahead.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            match n {
                0 => return Err(Fail::Io("stowd closed the connection".into())),
                n if n > 0 => {
                    (self.pos, self.end) = (0, n as usize);
                    return Ok(());
                }
                _ => match std::io::Error::last_os_error() {
                    e if e.kind() == std::io::ErrorKind::Interrupted => {}
                    e if e.kind() == std::io::ErrorKind::WouldBlock => {
                        if !self.spin.wait(fd, self.deadline) {
                            wait(
                                &self.tcp,
                                self.deadline,
                                libc::POLLIN,
                                "no reply within the timeout",
                            )?
                        }
                    }
                    e => return Err(Stream::io(e)),
                },
            }
        }
    }

    /// One blocking `recvmsg(2)` with `MSG_WAITALL` into `iov`, the receive
    /// timeout set to the time left: the bytes read (all of them unless
    /// the deadline came first).
    fn recv_all(&mut self, iov: &mut [libc::iovec]) -> Result<usize, Fail> {
        loop {
            let left = self.left()?;
            self.tcp.set_read_timeout(Some(left)).map_err(Stream::io)?;
            // SAFETY: an all-zero msghdr is valid (no name, no control data).
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_mut_ptr();
            msg.msg_iovlen = iov.len() as _;
            // SAFETY: every iovec names caller-owned writable bytes, alive
            // for the call (`read_scattered`'s contract).
            let n = unsafe {
                libc::recvmsg(
                    std::os::fd::AsRawFd::as_raw_fd(&self.tcp),
                    &mut msg,
                    libc::MSG_WAITALL,
                )
            };
            match n {
                0 => return Err(Fail::Io("stowd closed the connection".into())),
                n if n > 0 => return Ok(n as usize),
                _ => match std::io::Error::last_os_error() {
                    // Interrupted, or the receive timeout: the deadline
                    // decides, above.
                    e if matches!(
                        e.kind(),
                        std::io::ErrorKind::Interrupted | std::io::ErrorKind::WouldBlock
                    ) => {}
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
    unsafe fn read_scattered(&mut self, places: &[(usize, usize)]) -> Result<(), Fail> {
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
                let mut n = self.recv_all(&mut iov)?;
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

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), Fail> {
        // SAFETY: `buf` is ours, exclusively, for the call.
        unsafe { self.read_scattered(&[(buf.as_mut_ptr() as usize, buf.len())]) }
    }

    fn write_all(&mut self, buf: &[u8]) -> Result<(), Fail> {
        self.write_all_vectored(&mut [IoSlice::new(buf)])
    }

    /// Writes every byte of `slices` with `writev`, resuming after partial
    /// writes: the socket non-blocking meanwhile, waiting in `poll` for
    /// room (why: the module doc).
    fn write_all_vectored(&mut self, mut slices: &mut [IoSlice<'_>]) -> Result<(), Fail> {
        IoSlice::advance_slices(&mut slices, 0);
        while !slices.is_empty() {
            match self.send_vectored(slices) {
                Ok(0) => return Err(Fail::Io("stowd closed the connection".into())),
                Ok(n) => IoSlice::advance_slices(&mut slices, n),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => wait(
                    &self.tcp,
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
                std::os::fd::AsRawFd::as_raw_fd(&self.tcp),
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
    fn skip(&mut self, mut n: u64) -> Result<(), Fail> {
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

    /// Whether a whole message has arrived and is waiting to be read
    /// (in the read-ahead buffer and the socket's), so that reading it
    /// does not block: its frame headers walked in a peek. True as well
    /// when the socket is closed or failed (the read then says so); false
    /// when more than [`PEEK_MAX`] bytes wait (a large reply, for a
    /// reader that may wait).
    fn message_waiting(&mut self) -> bool {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&self.tcp);
        let mut queued: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int.
        if unsafe { libc::ioctl(fd, libc::FIONREAD, &mut queued) } != 0 {
            return true;
        }
        let queued = queued.max(0) as usize;
        if queued > PEEK_MAX {
            return false;
        }
        let mut bytes = self.ahead[self.pos..self.end].to_vec();
        if queued > 0 {
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
        } else {
            // Nothing queued: a closed socket reads as readable, with 0 bytes.
            let mut b = 0u8;
            // SAFETY: a peek of at most one byte into `b`.
            let n = unsafe {
                libc::recv(
                    fd,
                    (&mut b as *mut u8).cast(),
                    1,
                    libc::MSG_DONTWAIT | libc::MSG_PEEK,
                )
            };
            if n == 0
                || (n < 0
                    && std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock)
            {
                return true;
            }
        }
        frame::message_complete(&bytes)
    }

    /// A frame header ([`frame::parse_header`]), parsed in place in the
    /// read-ahead buffer; one split across two reads is gathered in a
    /// stack buffer.
    fn header(&mut self) -> Result<frame::Header, Fail> {
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
    fn frame_header(&mut self) -> Result<(bool, u64), Fail> {
        match self.header()? {
            frame::Header { command: true, .. } => {
                Err(Fail::Protocol("a command frame inside a reply".into()))
            }
            h => Ok((h.more, h.size)),
        }
    }

    /// A reply's frame 0 (at most [`MAX_FRAME0`] bytes), and whether data
    /// frames follow.
    fn head(&mut self) -> Result<(Vec<u8>, bool), Fail> {
        let (more, size) = self.frame_header()?;
        Ok((self.small_frame(size, MAX_FRAME0, "frame 0")?, more))
    }

    /// A whole frame of at most `max` bytes into a new buffer.
    fn small_frame(&mut self, size: u64, max: u64, what: &str) -> Result<Vec<u8>, Fail> {
        if size > max {
            return Err(Fail::Protocol(format!(
                "{what} of {size} bytes (at most {max})"
            )));
        }
        let mut out = vec![0u8; size as usize];
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

/// How long a reply is awaited by polling the socket, before sleeping in
/// `poll` (`Client(spin_us=...)`, default 200 µs).
///
/// Why: on the benchmark machine (a 2-vCPU VM) waking a process that sleeps
/// on another CPU costs 50-70 µs, and a small call pays it twice (stowd
/// woken by the request, the client by the reply). A client that is still
/// running when the reply comes does not pay its half: a 1-row get across
/// two CPUs took 157-233 µs sleeping and 108-131 µs spinning
/// (docs/benchmarks.md, "Spinning for the reply"). Each turn of the spin gives the
/// CPU away (`sched_yield`), so on a shared CPU stowd, or anything else
/// runnable, goes first. A wait the spin did not catch makes the next
/// [`Spin::REST`] waits on this connection sleep at once, so a connection
/// whose replies come slowly (large gets, a busy stowd) burns little.
struct Spin {
    window: Duration,
    /// Waits left that sleep without spinning first.
    rest: u32,
}

impl Spin {
    const REST: u32 = 8;

    fn new(window: Duration) -> Spin {
        Spin { window, rest: 0 }
    }

    /// Polls `fd` for readable bytes (or an error or end of stream, which
    /// the next `recv` reports) for up to the window, never past
    /// `deadline`: whether it became readable.
    fn wait(&mut self, fd: i32, deadline: Instant) -> bool {
        if self.window.is_zero() {
            return false;
        }
        if self.rest > 0 {
            self.rest -= 1;
            return false;
        }
        let until = (Instant::now() + self.window).min(deadline);
        let mut b = 0u8;
        loop {
            // SAFETY: a peek of at most one byte into `b`, alive for the call.
            let n = unsafe {
                libc::recv(
                    fd,
                    (&mut b as *mut u8).cast(),
                    1,
                    libc::MSG_DONTWAIT | libc::MSG_PEEK,
                )
            };
            if n >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock {
                return true;
            }
            if Instant::now() >= until {
                self.rest = Spin::REST;
                return false;
            }
            // SAFETY: no arguments; gives the CPU to anything runnable.
            unsafe { libc::sched_yield() };
        }
    }
}

/// Waits until the socket is ready for `events` (or reports an error,
/// which the next read or write returns), or the deadline: then a timeout
/// saying `late`.
fn wait(tcp: &TcpStream, deadline: Instant, events: libc::c_short, late: &str) -> Result<(), Fail> {
    let left = deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
        .ok_or_else(|| Fail::Timeout(late.into()))?;
    // Rounded up: a wait never ends just short of the deadline to spin.
    let ms = left.as_millis().saturating_add(1).min(i32::MAX as u128) as i32;
    let mut fd = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(tcp),
        events,
        revents: 0,
    };
    // SAFETY: one valid pollfd, alive for the call.
    match unsafe { libc::poll(&mut fd, 1, ms) } {
        0 => Err(Fail::Timeout(late.into())),
        -1 => match std::io::Error::last_os_error() {
            e if e.kind() == std::io::ErrorKind::Interrupted => Ok(()),
            e => Err(Fail::Io(e.to_string())),
        },
        _ => Ok(()),
    }
}

/// `tcp://host:port` -> `host:port`.
fn address(endpoint: &str) -> PyResult<String> {
    match endpoint.strip_prefix("tcp://") {
        Some(a) if !a.is_empty() => Ok(a.to_string()),
        _ => Err(PyValueError::new_err(format!(
            "the Rust core speaks tcp only, not {endpoint:?}"
        ))),
    }
}

/// One DEALER connection to a stowd native endpoint.
#[pyclass(module = "stowage._core")]
struct Connection {
    address: String,
    spin: Duration,
    /// The connection kept between calls (with its read-ahead buffer).
    tcp: Option<Stream>,
}

/// A caller's array, writable and C-contiguous: where a field's rows go.
struct Target {
    name: String,
    dtypes: Vec<String>,
    shape: Vec<u64>,
    ptr: usize,
    len: usize,
}

/// The places of each data frame, by frame number (1-based; a number no
/// frame has is reported by `check_frames` once the reply is read).
type Places = std::collections::BTreeMap<u64, Vec<Place>>;

/// Where one range of a data frame goes: `len` bytes at `offset` of the
/// frame into `dest` (an address in a caller's array).
#[derive(Clone, Copy)]
struct Place {
    offset: u64,
    len: u64,
    dest: usize,
}

impl Connection {
    fn connect(&mut self, deadline: Instant) -> Result<Stream, Fail> {
        if let Some(mut s) = self.tcp.take() {
            s.deadline = deadline;
            return Ok(s);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let addr = std::net::ToSocketAddrs::to_socket_addrs(&self.address)
            .map_err(|e| Fail::Io(format!("{}: {e}", self.address)))?
            .next()
            .ok_or_else(|| Fail::Io(format!("{}: no address", self.address)))?;
        let tcp = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1)))
            .map_err(|e| Fail::Io(format!("cannot connect to {}: {e}", self.address)))?;
        let _ = tcp.set_nodelay(true);
        let mut s = Stream::new(tcp, deadline, self.spin);
        s.write_all(&frame::greeting())?;
        let mut g = [0u8; 64];
        s.read_exact(&mut g)?;
        frame::check_greeting(&g)
            .map_err(|e| Fail::Protocol(zmtp::ZmtpError::from(e).to_string()))?;
        s.write_all(&frame::ready_command(&[("Socket-Type", b"DEALER")]))?;
        let h = s.header()?;
        if !h.command {
            return Err(Fail::Protocol("expected stowd's READY".into()));
        }
        let body = s.small_frame(h.size, frame::MAX_COMMAND, "a command")?;
        // A name cut short reads as none.
        let name = frame::split_command(&body).map_or(&[][..], |(name, _)| name);
        if name != b"READY" {
            return Err(Fail::Protocol(format!(
                "expected READY, got {:?}",
                String::from_utf8_lossy(name)
            )));
        }
        Ok(s)
    }

    /// A put read, laid out and written ([`fast::plan_put`]), its reply
    /// left for `put_end`: its rows, or None with nothing sent.
    fn put_begin(
        &mut self,
        py: Python<'_>,
        id: u64,
        indexes: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
        deadline: Instant,
        max_bytes: usize,
    ) -> PyResult<Option<u64>> {
        let Some(mut plan) = fast::plan_put(indexes, data, max_bytes)? else {
            return Ok(None);
        };
        let Some((frame0, rows)) = plan.frame0(id) else {
            plan.release();
            return Ok(None);
        };
        let sent = {
            let frames = plan.frame_slices();
            // The arrays stay held (`plan`) while the GIL is released.
            py.detach(|| self.begin(deadline, &frame0, &frames))
        };
        plan.release();
        sent?;
        Ok(Some(rows))
    }

    /// The reply to `put_begin`'s put: the rows when it is a put_ok for all
    /// of them, else its frames (for the caller to read and word).
    fn put_end<'py>(
        &mut self,
        py: Python<'py>,
        id: u64,
        rows: u64,
        deadline: Instant,
    ) -> PyResult<Bound<'py, PyAny>> {
        let reply = py.detach(|| self.resume(deadline, read_reply))?;
        settled(
            py,
            id,
            reply,
            |r| matches!(r, native::Reply::PutOk { rows: r } if *r == rows),
            rows,
        )
    }

    /// Writes a request (`frame0` and its data `frames`) and keeps the
    /// connection for the reply, which `resume` reads (see
    /// `Connection.start_put`). A failed write drops the connection.
    fn begin(
        &mut self,
        deadline: Instant,
        frame0: &[u8],
        frames: &[Vec<&[u8]>],
    ) -> Result<(), Fail> {
        let mut s = self.connect(deadline)?;
        write_message(&mut s, frame0, frames)?;
        self.tcp = Some(s);
        Ok(())
    }

    /// Reads the reply to the request `begin` wrote, `read`; as `exchange`,
    /// the connection is kept only after a reply read to its end.
    fn resume<T>(
        &mut self,
        deadline: Instant,
        read: impl FnOnce(&mut Stream) -> Result<T, Fail>,
    ) -> Result<T, Fail> {
        let mut s = self
            .tcp
            .take()
            .ok_or_else(|| Fail::Io("no request is waiting for its reply".into()))?;
        s.deadline = deadline;
        let result = read(&mut s);
        if result.is_ok() {
            self.tcp = Some(s);
        }
        result
    }

    /// Runs one request and its reply, `call`, on the connection (made
    /// first if there is none). The connection is kept only after a reply
    /// read to its end: a timeout, an I/O error or a broken reply drops it.
    fn exchange<T>(
        &mut self,
        deadline: Instant,
        call: impl FnOnce(&mut Stream) -> Result<T, Fail>,
    ) -> Result<T, Fail> {
        let mut s = self.connect(deadline)?;
        let result = call(&mut s);
        if result.is_ok() {
            self.tcp = Some(s);
        }
        result
    }
}

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
fn write_message<'a>(
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
fn check_frame_count(frames: usize) -> Result<(), Fail> {
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
fn send(s: &mut Stream, frame0: &[u8], frames: &[Vec<&[u8]>]) -> Result<Vec<Vec<u8>>, Fail> {
    write_message(s, frame0, frames)?;
    read_reply(s)
}

/// Reads one reply whole (as [`send`] does after writing).
fn read_reply(s: &mut Stream) -> Result<Vec<Vec<u8>>, Fail> {
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
type Outgoing<'a> = (&'a [u8], Vec<Vec<&'a [u8]>>);

/// Sends `messages` with two on the wire: message `k + 1` is written
/// before the reply to `k` is read, so that stowd (which reads one message
/// ahead while it handles one) receives the next while it handles this
/// one. The replies go to `replies` in order: all of them, or up to the
/// first error and the reply to the one message already sent after it.
/// Each step (a message written and the reply before it read) has `each`
/// to finish, as each message sent alone would.
fn send_pipelined(
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

/// The dtypes of a regular field as its descriptor names them.
fn layout_dtype(f: &FieldLayout) -> Option<(&str, &[u64])> {
    match f {
        FieldLayout::Regular { dtype, shape, .. } => Some((dtype.name(), shape)),
        _ => None,
    }
}

/// A reply that is not a readable get_ok: its frame 0, and why this codec
/// refused it (None: another reply, such as an error).
type Other = (Vec<u8>, Option<String>);

/// A get_ok's frame 0: its fields' layout, whether data frames follow,
/// and the frame itself.
type Head = (Vec<(String, FieldLayout)>, bool, Bytes);

/// Sends a get and reads its reply's frame 0: the get_ok's layout and
/// whether data frames follow, or (the rest drained) any other reply.
fn request(s: &mut Stream, frame0: &[u8]) -> Result<Result<Head, Other>, Fail> {
    write_message(s, frame0, &[])?;
    read_head(s)
}

/// Reads a reply's frame 0: a get_ok's layout, or (the rest drained) any
/// other reply.
fn read_head(s: &mut Stream) -> Result<Result<Head, Other>, Fail> {
    let (head, more) = s.head()?;
    let head = Bytes::from(head);
    match native::decode_reply_layout(&head, &REPLY_LIMITS) {
        Ok((_, ReplyLayout::GetOk(fields))) => Ok(Ok((fields, more, head))),
        // Another reply, or one this codec refuses: the caller decodes
        // frame 0 and says what it is.
        other => {
            drain(s, more)?;
            Ok(Err((head.to_vec(), other.err().map(|e| e.to_string()))))
        }
    }
}

fn get_into(s: &mut Stream, frame0: &[u8], targets: &[Target]) -> Result<Option<Other>, Fail> {
    let (fields, more) = match request(s, frame0)? {
        Ok((fields, more, _)) => (fields, more),
        Err(other) => return Ok(Some(other)),
    };
    // Every requested field, regular, of an accepted dtype and the array's
    // shape, before any byte is written.
    let mut places = Places::new();
    for t in targets {
        let Some((_, f)) = fields.iter().find(|(n, _)| *n == t.name) else {
            return Err(Fail::Protocol(format!(
                "the reply has no field {:?}",
                t.name
            )));
        };
        // Worded as the Python client words them (names as Python's repr).
        let name = format!("'{}'", t.name);
        let what = format!("get_into: out[{name}]");
        let Some((dtype, shape)) = layout_dtype(f) else {
            return Err(match f {
                FieldLayout::Values(_) => Fail::NotTensors(format!(
                    "{what}: field {name} holds plain values, not tensors; use get()"
                )),
                _ => Fail::Mismatch(format!(
                    "{what}: the requested rows of {name} have different shapes, so they do not fit one array; use get()"
                )),
            });
        };
        if !t.dtypes.iter().any(|d| d == dtype) {
            return Err(Fail::Mismatch(format!(
                "{what} has dtype {}, but field {name} is {dtype}",
                t.dtypes[0]
            )));
        }
        if shape != t.shape.as_slice() {
            return Err(Fail::Mismatch(format!(
                "{what} has shape {:?}, but field {name} is {shape:?}",
                t.shape
            )));
        }
        let FieldLayout::Regular { parts, .. } = f else {
            unreachable!("a regular layout")
        };
        // The array holds exactly the field's bytes (the descriptor's parts
        // were checked against the dtype and rows when decoded).
        let total: u64 = parts.iter().map(|p| p.len).sum();
        if total != t.len as u64 {
            return Err(Fail::Mismatch(format!(
                "{what} holds {} bytes, but field {name} is {total}",
                t.len
            )));
        }
        let row_bytes = total.checked_div(shape[0]).unwrap_or(0);
        let mut row = 0u64;
        for p in parts {
            places.entry(p.frame).or_default().push(Place {
                offset: p.offset,
                len: p.len,
                dest: t.ptr + (row * row_bytes) as usize,
            });
            row += p.rows;
        }
    }
    read_frames(s, more, &places, &fields)?;
    Ok(None)
}

/// A reply read by [`get`]: frame 0, and the fields' buffers.
struct Gotten {
    head: Vec<u8>,
    /// Why this codec refused frame 0, if it did.
    problem: Option<String>,
    /// (field, its rows back to back) for each regular or nested field, in
    /// reply order; None for a reply that is not a get_ok.
    fields: Option<Vec<(String, Vec<u8>)>>,
    /// (dtype name, shape) of each field, in reply order, if every field
    /// is regular (its buffer then holds exactly that array's bytes).
    regular: Option<Vec<(&'static str, Vec<u64>)>>,
}

/// What `Connection.get` returns: (frame 0, [(field, Buffer)] or None,
/// why the codec refused frame 0 or None).
type GotTuple<'py> = (
    Bound<'py, PyBytes>,
    Option<Vec<(String, Bound<'py, Buffer>)>>,
    Option<String>,
);

impl Gotten {
    fn into_tuple(self, py: Python<'_>) -> PyResult<GotTuple<'_>> {
        let fields = match self.fields {
            None => None,
            Some(fields) => Some(
                fields
                    .into_iter()
                    .map(|(name, data)| Ok((name, Bound::new(py, Buffer { data })?)))
                    .collect::<PyResult<Vec<_>>>()?,
            ),
        };
        Ok((PyBytes::new(py, &self.head), fields, self.problem))
    }
}

/// `numpy.ndarray`.
fn ndarray_type(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    static NDARRAY: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();
    NDARRAY
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(py.import("numpy")?.getattr("ndarray")?.unbind())
        })
        .map(|t| t.bind(py).clone())
}

/// What `get_arrays` returns for a reply `get` read: for a get_ok whose
/// every field is regular, of a dtype `dtypes` (a dict of dtype name to
/// numpy dtype) has, a dict of field name to a read-only numpy array over
/// its received bytes, in reply order; else `Gotten::into_tuple`.
fn arrays<'py>(
    py: Python<'py>,
    got: Gotten,
    dtypes: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    // `regular` is only ever set beside the buffers of a get_ok.
    if let (Some(_), Some(regular)) = (&got.fields, &got.regular) {
        let mut made = Vec::with_capacity(regular.len());
        for (dtype, _) in regular {
            match dtypes.get_item(*dtype) {
                Ok(dt) => made.push(dt),
                Err(_) => break,
            }
        }
        if made.len() == regular.len() {
            // Each array made here (numpy.ndarray over the field's read-only
            // buffer: read-only itself), one call a field.
            let ndarray = ndarray_type(py)?;
            let out = pyo3::types::PyDict::new(py);
            let fields = got.fields.expect("checked above");
            for (((name, data), (_, shape)), dt) in fields.into_iter().zip(regular).zip(made) {
                let shape = PyTuple::new(py, shape)?;
                let array = if data.is_empty() {
                    // (an empty buffer is no buffer to numpy: a new empty array, read-only)
                    let a = ndarray.call1((shape, dt))?;
                    a.getattr("flags")?.setattr("writeable", false)?;
                    a
                } else {
                    ndarray.call1((shape, dt, Bound::new(py, Buffer { data })?))?
                };
                out.set_item(name, array)?;
            }
            return Ok(out.into_any());
        }
    }
    got.into_tuple(py)?.into_pyobject(py).map(|t| t.into_any())
}

/// When a call given `timeout` seconds (negative: none left) must end.
fn deadline_in(timeout: f64) -> Instant {
    Instant::now() + Duration::from_secs_f64(timeout.max(0.0))
}

fn get(s: &mut Stream, frame0: &[u8]) -> Result<Gotten, Fail> {
    write_message(s, frame0, &[])?;
    get_reply(s)
}

/// Reads a get's reply (see [`get`]).
fn get_reply(s: &mut Stream) -> Result<Gotten, Fail> {
    let (layouts, more, head) = match read_head(s)? {
        Ok(got) => got,
        Err((head, problem)) => {
            return Ok(Gotten {
                head,
                problem,
                fields: None,
                regular: None,
            });
        }
    };
    // Only for a plain reply: one that names shared-memory segments goes
    // to the caller's decoder, which refuses it (this client asked for none).
    // (A frame 0 without the bytes of the key `segments` has none: the
    // second decode, a pass over all of frame 0, only when it might.)
    let plain = !head.windows(9).any(|w| w == b"\xa8segments")
        || native::decode_extras(&head, &REPLY_LIMITS).is_ok_and(|e| e.segments.is_none());
    let regular = if plain {
        layouts
            .iter()
            .map(|(_, f)| match f {
                FieldLayout::Regular { dtype, shape, .. } => Some((dtype.name(), shape.clone())),
                _ => None,
            })
            .collect()
    } else {
        None
    };
    // One buffer per field; each range of the reply goes to its place in
    // its field's buffer, rows in row order.
    let mut buffers: Vec<(String, Vec<u8>)> = Vec::new();
    let mut places = Places::new();
    for (name, f) in &layouts {
        if matches!(f, FieldLayout::Values(_)) {
            continue;
        }
        let ranges = f.ranges();
        let total: u64 = ranges.iter().map(|r| r.2).sum();
        // A reused buffer, or one zeroed by calloc (fresh pages for a large
        // one); every byte is written here, by this reply (`pool` says why).
        let buf = pool::take(total as usize, huge_pages);
        let base = buf.as_ptr() as usize;
        let mut at = 0u64;
        for (frame, offset, len) in ranges {
            places.entry(frame).or_default().push(Place {
                offset,
                len,
                dest: base + at as usize,
            });
            at += len;
        }
        buffers.push((name.clone(), buf));
    }
    read_frames(s, more, &places, &layouts)?;
    Ok(Gotten {
        head: head.to_vec(),
        problem: None,
        fields: Some(buffers),
        regular,
    })
}

/// A caller's buffer held while its bytes are sent with the GIL released:
/// C-contiguous, of any item type (no format is asked for), neither freed
/// nor resized until released (on drop).
struct Held(Box<ffi::Py_buffer>);

impl Held {
    fn get(obj: &Bound<'_, PyAny>) -> PyResult<Held> {
        Held::with_flags(obj, ffi::PyBUF_C_CONTIGUOUS)
    }

    /// The buffer of `obj` as `flags` ask for it (`PyObject_GetBuffer`).
    fn with_flags(obj: &Bound<'_, PyAny>, flags: std::os::raw::c_int) -> PyResult<Held> {
        // Boxed: an exporter may point the view's fields into the view
        // itself, so it must not move.
        let mut view = Box::new(ffi::Py_buffer::new());
        // SAFETY: `view` is a valid Py_buffer for the exporter to fill; on
        // success it is released exactly once, by `drop`.
        let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
        if rc == -1 {
            return Err(PyErr::fetch(obj.py()));
        }
        Ok(Held(view))
    }

    /// The item format (struct module syntax; "B" when the exporter gave none).
    fn format(&self) -> &[u8] {
        if self.0.format.is_null() {
            return b"B";
        }
        // SAFETY: a NUL-terminated string the exporter keeps with the view.
        unsafe { std::ffi::CStr::from_ptr(self.0.format) }.to_bytes()
    }

    fn itemsize(&self) -> usize {
        self.0.itemsize.max(0) as usize
    }

    /// The shape (none for a 0-d buffer; `[len / itemsize]` when the
    /// exporter gave none).
    fn shape(&self) -> Vec<u64> {
        if self.0.ndim == 0 {
            return Vec::new();
        }
        if self.0.shape.is_null() {
            return vec![(self.0.len.max(0) as u64) / (self.itemsize().max(1) as u64)];
        }
        // SAFETY: `ndim` sizes the exporter keeps with the view.
        unsafe { std::slice::from_raw_parts(self.0.shape, self.0.ndim.max(0) as usize) }
            .iter()
            .map(|&d| d.max(0) as u64)
            .collect()
    }

    /// The first axis' stride in bytes (the itemsize when the exporter gave none).
    fn stride0(&self) -> isize {
        if self.0.strides.is_null() || self.0.ndim < 1 {
            return self.itemsize() as isize;
        }
        // SAFETY: `ndim` (at least 1) strides the exporter keeps with the view.
        unsafe { *self.0.strides }
    }

    fn ndim(&self) -> usize {
        self.0.ndim.max(0) as usize
    }

    /// The first byte's address (for strided reads).
    fn ptr(&self) -> *const u8 {
        self.0.buf as *const u8
    }

    fn bytes(&self) -> &[u8] {
        if self.0.len <= 0 {
            return &[];
        }
        // SAFETY: the exporter keeps `len` contiguous bytes at `buf` until
        // the view is released, which `self` outlives. (Another thread may
        // write the array meanwhile; its bytes are only copied out to the
        // socket, as pyzmq would.)
        unsafe { std::slice::from_raw_parts(self.0.buf as *const u8, self.0.len as usize) }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        // SAFETY: a view PyObject_GetBuffer filled, released once, attached
        // to the interpreter.
        Python::attach(|_| unsafe { ffi::PyBuffer_Release(&mut *self.0) });
    }
}

/// Bytes handed to Python without a copy: a read-only buffer object.
#[pyclass(module = "stowage._core", frozen)]
struct Buffer {
    data: Vec<u8>,
}

#[pymethods]
impl Buffer {
    /// The buffer protocol: a read-only view of the bytes.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let (ptr, len) = {
            let me = slf.get();
            (me.data.as_ptr(), me.data.len())
        };
        // SAFETY: `view` comes from Python's buffer machinery; the bytes
        // never move or change and live as long as `slf`, which the view
        // holds a reference to.
        let rc = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                ptr as *mut std::os::raw::c_void,
                len as pyo3::ffi::Py_ssize_t,
                1,
                flags,
            )
        };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.data.len()
    }
}

impl Drop for Buffer {
    /// The last array over these bytes is gone: the next get may take them.
    fn drop(&mut self) {
        pool::give(std::mem::take(&mut self.data));
    }
}

/// Copies the parts of a regular field that lie in several buffers into
/// one buffer of `total` bytes, in order: part k is bytes `at[k]..at[k] +
/// len[k]` of `bases[base[k]]` and goes right after part k - 1. The result
/// is a [`Buffer`] (read-only to Python) taken from the receive pool, so a
/// training loop that gets the same shape every step copies into pages
/// already resident, with the GIL released.
///
/// Why: a same-node get of rows scattered over the segments (32,768 random
/// 4 KiB rows of 4 units) was gathered by numpy, one `take` per segment
/// into a temporary and a masked assignment from it (two copies), into a
/// fresh array that numpy asks huge pages for: 196-291 ms, and 1.5 s when
/// the huge pages had to come from the host (docs/benchmarks.md, "Same-node
/// gathers").
///
/// ValueError if the parts do not fill `total` exactly or one lies outside
/// its buffer (nothing of a reused buffer shows through a result).
#[pyfunction]
fn gather<'py>(
    py: Python<'py>,
    total: u64,
    bases: Vec<Bound<'py, PyAny>>,
    base: PyBuffer<i64>,
    at: PyBuffer<i64>,
    len: PyBuffer<i64>,
) -> PyResult<Bound<'py, Buffer>> {
    let (base, at, len) = (base.to_vec(py)?, at.to_vec(py)?, len.to_vec(py)?);
    if base.len() != at.len() || at.len() != len.len() {
        return Err(PyValueError::new_err(format!(
            "gather: {} bases, {} offsets and {} lengths",
            base.len(),
            at.len(),
            len.len()
        )));
    }
    let held = bases
        .iter()
        .map(Held::get)
        .collect::<PyResult<Vec<Held>>>()?;
    let srcs: Vec<(usize, usize)> = held
        .iter()
        .map(|h| (h.bytes().as_ptr() as usize, h.bytes().len()))
        .collect();
    let mut sum = 0u64;
    for k in 0..base.len() {
        let (b, a, l) = (base[k], at[k], len[k]);
        let src = usize::try_from(b).ok().and_then(|b| srcs.get(b));
        let inside = match (src, u64::try_from(a), u64::try_from(l)) {
            (Some(&(_, n)), Ok(a), Ok(l)) => a.checked_add(l).is_some_and(|end| end <= n as u64),
            _ => false,
        };
        if !inside {
            return Err(PyValueError::new_err(format!(
                "gather: part {k} ({a}+{l} of buffer {b}) lies outside its buffer"
            )));
        }
        sum += l as u64;
    }
    if sum != total || usize::try_from(total).is_err() {
        return Err(PyValueError::new_err(format!(
            "gather: the parts hold {sum} bytes, not {total}"
        )));
    }
    let data = py.detach(|| {
        let mut out = pool::take(total as usize, huge_pages);
        let mut to = 0usize;
        for k in 0..base.len() {
            let (from, _) = srcs[base[k] as usize];
            let l = len[k] as usize;
            // SAFETY: the source range was checked to lie inside its
            // buffer, which `held` keeps alive and in place; the parts'
            // lengths sum to `out`'s length, so `to..to + l` is inside it.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (from + at[k] as usize) as *const u8,
                    out.as_mut_ptr().add(to),
                    l,
                );
            }
            to += l;
        }
        out
    });
    drop(held);
    Bound::new(py, Buffer { data })
}

/// Frees the buffers kept for reuse by later gets (`pool`); the bytes freed.
#[pyfunction]
fn release_receive_buffers() -> usize {
    pool::release()
}

/// With `STOWAGE_HUGE_PAGES=1`, asks for transparent huge pages under a
/// large fresh buffer (`MADV_HUGEPAGE`); by default it does not.
///
/// Why off: on the benchmark machine (a Firecracker VM whose free memory
/// goes back to the host) a fresh 1 GiB get through the core ran at
/// 0.10-0.13 GB/s with the hint when the process started after a few idle
/// seconds, against 1.36-1.69 without: huge pages then come from memory
/// the host took back and must fault in again. Only back to back, in
/// memory just freed, did the hint win (2.0-3.8 GB/s against 0.74-1.68),
/// and there the receive pool ([`pool`]) hands out a resident buffer
/// anyway (docs/benchmarks.md, "Huge pages for fresh get buffers").
fn huge_pages(buf: &[u8]) {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if !*ON.get_or_init(|| std::env::var_os("STOWAGE_HUGE_PAGES").is_some_and(|v| v == "1")) {
        return;
    }
    const HUGE: usize = 2 << 20;
    let start = (buf.as_ptr() as usize).next_multiple_of(HUGE);
    let end = (buf.as_ptr() as usize + buf.len()) / HUGE * HUGE;
    if end > start {
        // SAFETY: the range lies inside `buf`'s allocation; MADV_HUGEPAGE
        // changes how its pages are backed, never their contents.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
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
    let mut read: Vec<(u64, u64, usize)> = Vec::new();
    // Stretches that follow on from what was read, not read yet: read
    // together, by one scattered read, before anything needs their bytes.
    let mut pending: Vec<(usize, usize)> = Vec::new();
    let flush = |s: &mut Stream, pending: &mut Vec<(usize, usize)>| {
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

/// Reads the rest of a reply and throws it away.
fn drain(s: &mut Stream, mut more: bool) -> Result<(), Fail> {
    while more {
        let h = s.header()?;
        s.skip(h.size)?;
        more = h.more;
    }
    Ok(())
}

/// A layout error in the Python client's words (its suite checks them).
fn frames_error(e: &stowage_wire::native::Error) -> String {
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
fn read_frames(
    s: &mut Stream,
    mut more: bool,
    places: &Places,
    fields: &[(String, FieldLayout)],
) -> Result<(), Fail> {
    // The data frames, each read straight into its places.
    let mut lens = Vec::new();
    let mut k = 0usize;
    while more {
        let (m, size) = s.frame_header()?;
        more = m;
        lens.push(size);
        check_frame_count(lens.len() + 1)?;
        let mut mine = places.get(&(k as u64 + 1)).cloned().unwrap_or_default();
        mine.sort_by_key(|p| p.offset);
        if mine
            .iter()
            .any(|p| p.offset.checked_add(p.len).is_none_or(|e| e > size))
        {
            // Reported by check_frames below, after the frame is drained.
            s.skip(size)?;
        } else {
            read_ranges(s, &mine, size)?;
        }
        k += 1;
    }
    layout::check_frames(fields, &lens).map_err(|e| Fail::Protocol(frames_error(&e)))
}

#[pymethods]
impl Connection {
    /// A connection to `endpoint` (made on first use) that awaits each
    /// reply by polling for up to `spin_us` microseconds before sleeping
    /// (0: sleep at once; see [`Spin`]).
    #[new]
    #[pyo3(signature = (endpoint, spin_us = 0.0))]
    fn new(endpoint: &str, spin_us: f64) -> PyResult<Self> {
        if !(spin_us.is_finite() && spin_us >= 0.0) {
            return Err(PyValueError::new_err(format!(
                "spin_us must be a finite number >= 0, got {spin_us}"
            )));
        }
        Ok(Connection {
            address: address(endpoint)?,
            spin: Duration::from_secs_f64(spin_us.min(1e9) / 1e6),
            tcp: None,
        })
    }

    /// Sends the get request `frame0` and reads the reply's rows straight
    /// into `targets`: a list of `(field, accepted dtype names, shape,
    /// writable C-contiguous buffer)`. Returns None when the rows are in
    /// place, or (the reply's frame 0, why this codec refused it or None)
    /// when stowd answered otherwise (an error, for the caller to decode). Raises ValueError when the reply
    /// does not fit the arrays (nothing written), TimeoutError and
    /// ConnectionError otherwise (the connection is dropped).
    #[allow(clippy::type_complexity)]
    fn get_into<'py>(
        &mut self,
        py: Python<'py>,
        frame0: &[u8],
        targets: Vec<(String, Vec<String>, Vec<u64>, Bound<'py, PyAny>)>,
        timeout: f64,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, Option<String>)>> {
        let mut buffers = Vec::with_capacity(targets.len());
        let mut plan = Vec::with_capacity(targets.len());
        for (name, dtypes, shape, obj) in targets {
            let buf = PyBuffer::<u8>::get(&obj)?;
            if buf.readonly() || !buf.is_c_contiguous() {
                return Err(PyValueError::new_err(format!(
                    "get_into: out[{name:?}] must be writable and C-contiguous"
                )));
            }
            if dtypes.is_empty() {
                return Err(PyValueError::new_err("no dtype given"));
            }
            plan.push(Target {
                name,
                dtypes,
                shape,
                ptr: buf.buf_ptr() as usize,
                len: buf.len_bytes(),
            });
            buffers.push(buf);
        }
        let deadline = deadline_in(timeout);
        let frame0 = frame0.to_vec();
        // The buffers stay held (`buffers`) while the GIL is released.
        let result = py.detach(|| self.exchange(deadline, |s| get_into(s, &frame0, &plan)));
        drop(buffers);
        Ok(result?.map(|(head, problem)| (PyBytes::new(py, &head), problem)))
    }

    /// Sends the get request `frame0` and reads the reply. Returns (frame
    /// 0, None, why this codec refused it or None) for a reply that is not a
    /// readable get_ok (an error, for the caller to decode), else (frame 0,
    /// [(field, Buffer)], None): for each regular or
    /// nested field, in reply order, its rows back to back in row order in
    /// one read-only buffer, read straight from the socket (values stay in
    /// frame 0). Raises TimeoutError and ConnectionError as `get_into`.
    fn get<'py>(
        &mut self,
        py: Python<'py>,
        frame0: &[u8],
        timeout: f64,
    ) -> PyResult<GotTuple<'py>> {
        let deadline = deadline_in(timeout);
        let frame0 = frame0.to_vec();
        let got = py.detach(|| self.exchange(deadline, |s| get(s, &frame0)))?;
        got.into_tuple(py)
    }

    /// `get`, for the common reply: if the reply is a get_ok whose every
    /// field is regular, of a dtype `dtypes` (a dict of dtype name to numpy
    /// dtype) has, a dict of field name to its read-only numpy array, in
    /// reply order, each over a buffer of exactly its bytes (no decoding of
    /// frame 0 into Python objects first); else what `get` returns.
    fn get_arrays<'py>(
        &mut self,
        py: Python<'py>,
        frame0: &[u8],
        timeout: f64,
        dtypes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let deadline = deadline_in(timeout);
        let frame0 = frame0.to_vec();
        let got = py.detach(|| self.exchange(deadline, |s| get(s, &frame0)))?;
        arrays(py, got, dtypes)
    }

    /// A get of `indexes` of `fields`, request id `id`, read and written
    /// here ([`fast`]: a list, tuple, range or 1-d integer buffer of
    /// indexes; a str or a list or tuple of distinct str), as runs where
    /// that is shorter unless `ranges` is false (a stowd from before
    /// ranges): (how many indexes, what `get_arrays` returns); or None,
    /// with nothing sent, when the arguments are not plainly that (for the
    /// caller's general path to check and word).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (id, indexes, fields, timeout, dtypes, ranges = true))]
    fn get_fast<'py>(
        &mut self,
        py: Python<'py>,
        id: u64,
        indexes: &Bound<'py, PyAny>,
        fields: &Bound<'py, PyAny>,
        timeout: f64,
        dtypes: &Bound<'py, PyAny>,
        ranges: bool,
    ) -> PyResult<Option<(u64, Bound<'py, PyAny>)>> {
        let Some((n, _, head)) = fast::get_head(indexes, fields, ranges) else {
            return Ok(None);
        };
        // One the codec cannot write goes the general way too.
        let Ok(frame0) = native::encode_request_head(id, &head) else {
            return Ok(None);
        };
        Ok(Some((n, self.get_arrays(py, &frame0, timeout, dtypes)?)))
    }

    /// A get_into of `indexes` into `out` (a dict of field name to array),
    /// request id `id`, read and written here ([`fast`]; `ranges` as for
    /// `get_fast`): what `get_into` returns (None: the rows are in place),
    /// or False, with nothing sent, when the arguments are not plainly
    /// that (for the caller's general path to check and word).
    #[pyo3(signature = (id, indexes, out, timeout, ranges = true))]
    fn get_into_fast<'py>(
        &mut self,
        py: Python<'py>,
        id: u64,
        indexes: &Bound<'py, PyAny>,
        out: &Bound<'py, PyAny>,
        timeout: f64,
        ranges: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let not_here = || Ok(pyo3::types::PyBool::new(py, false).to_owned().into_any());
        let Ok(out) = out.cast_exact::<pyo3::types::PyDict>() else {
            return not_here();
        };
        if out.is_empty() {
            return not_here();
        }
        let names = pyo3::types::PyList::new(py, out.keys())?;
        let Some((n, _, head)) = fast::get_head(indexes, names.as_any(), ranges) else {
            return not_here();
        };
        let mut buffers = Vec::with_capacity(out.len());
        let mut plan = Vec::with_capacity(out.len());
        for (name, o) in out.iter() {
            let Some((dtypes, shape, held)) = fast::read_out(&o) else {
                return not_here();
            };
            if shape.first() != Some(&n) {
                return not_here();
            }
            let bytes = held.bytes();
            plan.push(Target {
                name: name.extract()?,
                dtypes,
                shape,
                ptr: bytes.as_ptr() as usize,
                len: bytes.len(),
            });
            buffers.push(held);
        }
        let Ok(frame0) = native::encode_request_head(id, &head) else {
            return not_here();
        };
        let deadline = deadline_in(timeout);
        // The buffers stay held (`buffers`) while the GIL is released.
        let result = py.detach(|| self.exchange(deadline, |s| get_into(s, &frame0, &plan)));
        drop(buffers);
        Ok(result?
            .map(|(head, problem)| (PyBytes::new(py, &head), problem))
            .into_pyobject(py)?
            .into_any())
    }

    /// A put of `indexes` and `data` (a dict of field name to array, list
    /// of arrays or list of values), request id `id`, read, laid out and
    /// written here ([`fast`]) as one message of at most `max_bytes`: the
    /// number of rows stored when stowd answers put_ok for all of them,
    /// else the reply's frames (for the caller to read: an error); or
    /// None, with nothing sent, when the arguments are not plainly that
    /// (for the caller's general path). Raises TimeoutError and
    /// ConnectionError as `send` (the connection is dropped).
    fn put_fast<'py>(
        &mut self,
        py: Python<'py>,
        id: u64,
        indexes: &Bound<'py, PyAny>,
        data: &Bound<'py, PyAny>,
        timeout: f64,
        max_bytes: usize,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let deadline = deadline_in(timeout);
        let Some(rows) = self.put_begin(py, id, indexes, data, deadline, max_bytes)? else {
            return Ok(None);
        };
        self.put_end(py, id, rows, deadline).map(Some)
    }

    /// A clear of `indexes` (as `get_fast` reads them) and `fields` (None:
    /// every field), request id `id`: the number of values cleared, else
    /// the reply's frames (for the caller to read); or None, nothing sent,
    /// for the general path.
    #[pyo3(signature = (id, indexes, fields, timeout))]
    fn clear_fast<'py>(
        &mut self,
        py: Python<'py>,
        id: u64,
        indexes: &Bound<'py, PyAny>,
        fields: Option<&Bound<'py, PyAny>>,
        timeout: f64,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let names = match fields {
            None => None,
            Some(f) => match fast::read_names(f) {
                Some(names) => Some(names),
                None => return Ok(None),
            },
        };
        let Some(read) = indexes::read_indexes(indexes) else {
            return Ok(None);
        };
        let head = native::RequestHead::Other(native::Op::Clear {
            global_indexes: read.into_vec(),
            fields: names,
        });
        let Ok(frame0) = native::encode_request_head(id, &head) else {
            return Ok(None);
        };
        let deadline = deadline_in(timeout);
        let reply = py.detach(|| self.exchange(deadline, |s| send(s, &frame0, &[])))?;
        let mut cleared = 0u64;
        let got = settled(
            py,
            id,
            reply,
            |r| match r {
                native::Reply::ClearOk { cleared: c } => {
                    cleared = *c;
                    true
                }
                _ => false,
            },
            0,
        )?;
        if got.is_instance_of::<PyInt>() {
            return Ok(Some(cleared.into_pyobject(py)?.into_any()));
        }
        Ok(Some(got))
    }

    /// Sends the request `frame0` with its data `frames` and reads the whole
    /// reply: its frames as bytes, frame 0 first. Each data frame is a
    /// C-contiguous buffer (an array of any dtype, a memoryview, bytes) or a
    /// list of them, sent back to back as one frame; their bytes go to the
    /// socket from where they lie, with the GIL released (nothing is joined).
    /// Raises TimeoutError and ConnectionError as `get` (the connection is
    /// dropped).
    fn send<'py>(
        &mut self,
        py: Python<'py>,
        frame0: &[u8],
        frames: Vec<Bound<'py, PyAny>>,
        timeout: f64,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let mut held = Vec::with_capacity(frames.len());
        let counts = hold_frames(&frames, &mut held)?;
        let mut pieces = held.iter().map(Held::bytes);
        let frames: Vec<Vec<&[u8]>> = counts
            .iter()
            .map(|&k| pieces.by_ref().take(k).collect())
            .collect();
        let deadline = deadline_in(timeout);
        // The buffers stay held (`held`) while the GIL is released.
        let reply = py.detach(|| self.exchange(deadline, |s| send(s, frame0, &frames)));
        drop(frames);
        drop(held);
        Ok(reply?.iter().map(|f| PyBytes::new(py, f)).collect())
    }

    /// Several requests with their data frames (each a list of `send`'s
    /// `frames`), sent with two on the wire. Returns `(replies, failure)`:
    /// the replies in order (all of them, or up to the first error and the
    /// reply to the one request sent after it), and `None`, or the
    /// exception `send` would have raised (TimeoutError, ConnectionError,
    /// ProtocolViolation; the connection dropped) after the replies read
    /// before it. `timeout` holds for each request as for `send`'s one.
    #[allow(clippy::type_complexity)]
    fn send_many<'py>(
        &mut self,
        py: Python<'py>,
        messages: Vec<(Vec<u8>, Vec<Bound<'py, PyAny>>)>,
        timeout: f64,
    ) -> PyResult<(Vec<Vec<Bound<'py, PyBytes>>>, Option<Bound<'py, PyAny>>)> {
        let mut held = Vec::new();
        let mut shapes = Vec::with_capacity(messages.len());
        for (_, frames) in &messages {
            shapes.push(hold_frames(frames, &mut held)?);
        }
        let mut pieces = held.iter().map(Held::bytes);
        let plan: Vec<Outgoing<'_>> = messages
            .iter()
            .zip(&shapes)
            .map(|((frame0, _), counts)| {
                let frames = counts
                    .iter()
                    .map(|&k| pieces.by_ref().take(k).collect())
                    .collect();
                (frame0.as_slice(), frames)
            })
            .collect();
        let each = Duration::from_secs_f64(timeout.max(0.0));
        let deadline = Instant::now() + each;
        let mut replies = Vec::new();
        // The buffers stay held (`held`) while the GIL is released.
        let done =
            py.detach(|| self.exchange(deadline, |s| send_pipelined(s, &plan, each, &mut replies)));
        drop(plan);
        drop(held);
        let replies = replies
            .iter()
            .map(|r| r.iter().map(|f| PyBytes::new(py, f)).collect())
            .collect();
        let failure = done.err().map(|f| PyErr::from(f).into_value(py).into_any());
        Ok((replies, failure.map(|e| e.into_bound(py))))
    }

    /// The first half of `put_fast`, for an event loop that awaits the
    /// reply itself: the put read, laid out and written (the connection
    /// made first if there is none); the rows it carries, or None with
    /// nothing sent. Then `reply_ready`, `fileno` and `finish_put`.
    fn start_put(
        &mut self,
        py: Python<'_>,
        id: u64,
        indexes: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
        timeout: f64,
        max_bytes: usize,
    ) -> PyResult<Option<u64>> {
        let deadline = deadline_in(timeout);
        self.put_begin(py, id, indexes, data, deadline, max_bytes)
    }

    /// The second half of `put_fast` (after `start_put` of `rows` rows,
    /// request id `id`): what `put_fast` returns.
    fn finish_put<'py>(
        &mut self,
        py: Python<'py>,
        id: u64,
        rows: u64,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let deadline = deadline_in(timeout);
        self.put_end(py, id, rows, deadline)
    }

    /// The first half of `get_fast`: the request written, how many indexes
    /// it asks for, or None with nothing sent. Then `finish_get`.
    #[pyo3(signature = (id, indexes, fields, timeout, ranges = true))]
    fn start_get(
        &mut self,
        py: Python<'_>,
        id: u64,
        indexes: &Bound<'_, PyAny>,
        fields: &Bound<'_, PyAny>,
        timeout: f64,
        ranges: bool,
    ) -> PyResult<Option<u64>> {
        let Some((n, _, head)) = fast::get_head(indexes, fields, ranges) else {
            return Ok(None);
        };
        let Ok(frame0) = native::encode_request_head(id, &head) else {
            return Ok(None);
        };
        let deadline = deadline_in(timeout);
        py.detach(|| self.begin(deadline, &frame0, &[]))?;
        Ok(Some(n))
    }

    /// The second half of `get_fast`: what `get_arrays` returns.
    fn finish_get<'py>(
        &mut self,
        py: Python<'py>,
        timeout: f64,
        dtypes: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let deadline = deadline_in(timeout);
        let got = py.detach(|| self.resume(deadline, get_reply))?;
        arrays(py, got, dtypes)
    }

    /// Whether the connection is made (a call then starts without
    /// connecting first).
    #[getter]
    fn connected(&self) -> bool {
        self.tcp.is_some()
    }

    /// The socket's descriptor (None: no connection), for an event loop
    /// to await the reply to a started call on.
    fn fileno(&self) -> Option<i32> {
        self.tcp
            .as_ref()
            .map(|s| std::os::fd::AsRawFd::as_raw_fd(&s.tcp))
    }

    /// Whether the whole reply to a started call has arrived, so that
    /// `finish_*` reads it without waiting (also true when the connection
    /// broke, or there is none: `finish_*` then says so).
    fn reply_ready(&mut self) -> bool {
        self.tcp.as_mut().is_none_or(Stream::message_waiting)
    }

    /// Drops the connection (the next call makes a new one).
    fn close(&mut self) {
        self.tcp = None;
    }
}

/// A reply read whole, for `put_fast` and `clear_fast`: `ok` (an int) when
/// it is one frame answering request `id` with a reply `expected` takes,
/// else its frames as bytes for the caller to read and word.
fn settled<'py>(
    py: Python<'py>,
    id: u64,
    reply: Vec<Vec<u8>>,
    mut expected: impl FnMut(&native::Reply) -> bool,
    ok: u64,
) -> PyResult<Bound<'py, PyAny>> {
    if reply.len() == 1 {
        let head = Bytes::copy_from_slice(&reply[0]);
        if let Ok((rid, ReplyLayout::Other(r))) = native::decode_reply_layout(&head, &REPLY_LIMITS)
            && rid == id
            && expected(&r)
            && native::decode_extras(&head, &REPLY_LIMITS)
                .is_ok_and(|e| e == native::Extras::default())
        {
            return Ok(ok.into_pyobject(py)?.into_any());
        }
    }
    let frames: Vec<Bound<'py, PyBytes>> = reply.iter().map(|f| PyBytes::new(py, f)).collect();
    Ok(PyList::new(py, frames)?.into_any())
}

/// Holds the buffers of `frames` (each a buffer, or a list of pieces sent
/// back to back as one frame) in `held`; how many pieces each frame has.
fn hold_frames(frames: &[Bound<'_, PyAny>], held: &mut Vec<Held>) -> PyResult<Vec<usize>> {
    let mut counts = Vec::with_capacity(frames.len());
    for frame in frames {
        if let Ok(pieces) = frame.cast::<PyList>() {
            for piece in pieces.iter() {
                held.push(Held::get(&piece)?);
            }
            counts.push(pieces.len());
        } else {
            held.push(Held::get(frame)?);
            counts.push(1);
        }
    }
    Ok(counts)
}

/// The module: `Connection`, and the codec's `encode_request` and
/// `decode_reply`.
/// The dtype table as `_core.DTYPES` holds it: `(name, itemsize, aliases)`
/// per dtype, in table order.
fn dtype_table() -> Vec<(&'static str, usize, Vec<&'static str>)> {
    stowage_wire::tensor::Dtype::ALL
        .iter()
        .map(|d| {
            let row = d.info();
            (row.name, row.itemsize, row.aliases.to_vec())
        })
        .collect()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Connection>()?;
    m.add_function(wrap_pyfunction!(codec::encode_request, m)?)?;
    m.add_function(wrap_pyfunction!(codec::decode_reply, m)?)?;
    m.add_class::<Buffer>()?;
    m.add_class::<indexes::IndexList>()?;
    m.add_function(wrap_pyfunction!(indexes::read_index_list, m)?)?;
    m.add_function(wrap_pyfunction!(fast::encode_put, m)?)?;
    m.add_function(wrap_pyfunction!(fast::encode_get, m)?)?;
    m.add_function(wrap_pyfunction!(release_receive_buffers, m)?)?;
    m.add_function(wrap_pyfunction!(gather, m)?)?;
    m.add("ProtocolViolation", m.py().get_type::<ProtocolViolation>())?;
    m.add("DTYPES", dtype_table())?;
    Ok(())
}
