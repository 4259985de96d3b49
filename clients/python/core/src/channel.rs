//! `_core.Channel`: a same-node client's descriptor channel to stowd (the
//! protocol page, "Same-node shared memory", "The descriptor channel"): a
//! Unix stream socket on which stowd sends, for each same-node reply or
//! lease, the descriptors of its segments (`SCM_RIGHTS`), before the reply.
//! Every message is decoded by [`stowage_wire::channel`], the messages'
//! reference implementation.
//!
//! Messages are read whole, one at a time (exactly a message's bytes, so
//! exactly its descriptors), under a lock, by whoever finds the channel
//! readable: a get waiting for its reply ([`crate::same_node`]), a
//! [`Channel::take`] waiting for a request's descriptors, or an event loop
//! (`pump`). A message for a request nobody expects (see
//! [`Channel::expect`]: it timed out, or asked for none) has its
//! descriptors closed at once, so they never pile up. A message that
//! cannot be read whole or breaks the format (bad msgpack, more
//! descriptors than names, descriptors the kernel dropped: `MSG_CTRUNC`,
//! when this process's open-file limit is reached) closes the channel,
//! which then says why ([`Channel::why`]); stowd's closing it does too.
//!
//! A channel also raises this process's soft open-file limit to its hard
//! limit, once: each segment a reply names comes as a descriptor.

use std::collections::{HashMap, HashSet};
use std::io::IoSliceMut;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, IntoRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard, Once};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use rustix::io::Errno;
use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags};
use stowage_wire::channel::{self as messages, Descriptors, Hello, Limits};

use crate::error::Fail;
use crate::wait::wait;

/// Descriptors one read of the channel can carry (the kernel's `SCM_MAX_FD`).
const MAX_FDS: usize = 253;

/// Longest path a Unix socket address holds (108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// One request's descriptors: (segment name, descriptor), in the order
/// the message named them.
pub(crate) type Fds = Vec<(String, OwnedFd)>;

/// What the lock guards.
struct State {
    /// The socket (None once closed). Shared with anyone polling it, so
    /// that closing never closes a descriptor another thread still polls.
    sock: Option<Arc<UnixStream>>,
    /// Why the channel closed.
    why: Option<String>,
    /// Requests whose descriptors are kept when they come.
    expected: HashSet<u64>,
    /// Descriptors that came for expected requests, not yet taken.
    ready: HashMap<u64, Fds>,
}

/// A descriptor channel to stowd (see the module doc).
#[pyclass(module = "stowage._core", frozen)]
pub(crate) struct Channel {
    token: String,
    state: Mutex<State>,
}

/// Raises the soft open-file limit to the hard one, once per process.
fn raise_nofile() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        use rustix::process::{Resource, getrlimit, setrlimit};
        let mut lim = getrlimit(Resource::Nofile);
        if lim.current != lim.maximum {
            lim.current = lim.maximum;
            let _ = setrlimit(Resource::Nofile, lim);
        }
    });
}

/// Connects to the Unix socket `path`; a path longer than a socket address
/// holds is reached as `/proc/self/fd/<its directory>/<name>`, as stowd
/// binds it.
fn connect(path: &str) -> std::io::Result<UnixStream> {
    if path.len() <= MAX_SOCKET_PATH {
        return UnixStream::connect(path);
    }
    let p = Path::new(path);
    let (Some(dir), Some(name)) = (p.parent(), p.file_name()) else {
        return UnixStream::connect(path);
    };
    let dir = std::fs::File::open(dir)?;
    let short = Path::new(&format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name);
    UnixStream::connect(short)
}

/// Whether `fd` is readable (or closed, or failed) right now.
pub(crate) fn readable_now(fd: RawFd) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd, alive for the call.
    unsafe { libc::poll(&mut p, 1, 0) > 0 }
}

/// Reads exactly `out.len()` bytes, and the descriptors that come with
/// them, by `deadline`.
fn recv_exact(
    sock: &UnixStream,
    out: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    deadline: Instant,
) -> Result<(), Fail> {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut at = 0;
    while at < out.len() {
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let got = rustix::net::recvmsg(
            sock,
            &mut [IoSliceMut::new(&mut out[at..])],
            &mut control,
            RecvFlags::DONTWAIT | RecvFlags::CMSG_CLOEXEC,
        );
        match got {
            Ok(got) => {
                for m in control.drain() {
                    if let RecvAncillaryMessage::ScmRights(r) = m {
                        fds.extend(r);
                    }
                }
                if got.flags.contains(ReturnFlags::CTRUNC) {
                    return Err(Fail::Protocol(
                        "descriptors from stowd were dropped by the kernel (open-file limit \
                         reached?)"
                            .into(),
                    ));
                }
                if got.bytes == 0 {
                    return Err(Fail::Protocol("stowd closed the descriptor channel".into()));
                }
                at += got.bytes;
            }
            Err(Errno::AGAIN) => wait(
                sock,
                deadline,
                libc::POLLIN,
                "a descriptor channel message did not arrive within the timeout",
            )?,
            Err(Errno::INTR) => {}
            Err(e) => return Err(Fail::Io(format!("the descriptor channel failed: {e}"))),
        }
    }
    Ok(())
}

/// One whole message: its body and its descriptors.
fn recv_message(sock: &UnixStream, deadline: Instant) -> Result<(Vec<u8>, Vec<OwnedFd>), Fail> {
    let mut fds = Vec::new();
    let mut prefix = [0u8; messages::LEN_BYTES];
    recv_exact(sock, &mut prefix, &mut fds, deadline)?;
    let len = messages::body_len(prefix, &Limits::DEFAULT)
        .map_err(|e| Fail::Protocol(format!("bad descriptor channel message: {e}")))?;
    let mut body = vec![0u8; len];
    recv_exact(sock, &mut body, &mut fds, deadline)?;
    Ok((body, fds))
}

/// A failure's words.
fn words(f: &Fail) -> &str {
    match f {
        Fail::Timeout(m) | Fail::Io(m) | Fail::Protocol(m) | Fail::Mismatch(m) => m,
        Fail::NotTensors(m) => m,
        Fail::Signal(_) => "a signal handler raised while it was read",
    }
}

impl Channel {
    /// Connects to the channel at `path` and reads its greeting.
    pub(crate) fn open(path: &str, deadline: Instant) -> Result<Channel, Fail> {
        raise_nofile();
        let sock = connect(path)
            .and_then(|s| s.set_nonblocking(true).map(|()| s))
            .map_err(|e| {
                Fail::Io(format!(
                    "cannot open stowd's descriptor channel {path:?}: {e} (same-node mode needs \
                     the same node and the same user as stowd)"
                ))
            })?;
        let (body, fds) = recv_message(&sock, deadline)?;
        if !fds.is_empty() {
            return Err(Fail::Protocol(format!(
                "bad descriptor channel greeting: {} descriptors came with it",
                fds.len()
            )));
        }
        let token = Hello::decode(&body)
            .map_err(|e| Fail::Protocol(format!("bad descriptor channel greeting: {e}")))?
            .token
            .to_owned();
        Ok(Channel {
            token,
            state: Mutex::new(State {
                sock: Some(Arc::new(sock)),
                why: None,
                expected: HashSet::new(),
                ready: HashMap::new(),
            }),
        })
    }

    pub(crate) fn token(&self) -> &str {
        &self.token
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The socket, for polling (None: closed).
    pub(crate) fn sock(&self) -> Option<Arc<UnixStream>> {
        self.lock().sock.clone()
    }

    /// Keeps the descriptors of request `id` when they come.
    pub(crate) fn expect_id(&self, id: u64) {
        self.lock().expected.insert(id);
    }

    /// No longer expects request `id`: its descriptors, come or to come,
    /// are closed.
    pub(crate) fn forget_id(&self, id: u64) {
        let mut st = self.lock();
        st.expected.remove(&id);
        st.ready.remove(&id);
    }

    /// Why a closed channel closed.
    fn closed_fail(st: &State) -> Fail {
        Fail::Protocol(format!(
            "the descriptor channel is closed ({})",
            st.why.as_deref().unwrap_or("closed")
        ))
    }

    fn close_locked(st: &mut State, why: &str) {
        if let Some(sock) = st.sock.take() {
            let _ = sock.shutdown(std::net::Shutdown::Both);
        }
        if st.why.is_none() {
            st.why = Some(why.to_owned());
        }
        st.ready.clear();
        st.expected.clear();
    }

    /// Reads one message (the lock held, the channel readable): its
    /// descriptors go to `ready` if its request is expected, else are
    /// closed. A failure closes the channel.
    fn read_one(st: &mut State, sock: &UnixStream, deadline: Instant) -> Result<(), Fail> {
        let got = recv_message(sock, deadline).and_then(|(body, fds)| {
            let d = Descriptors::decode(&body, &Limits::DEFAULT)
                .map_err(|e| Fail::Protocol(format!("bad descriptor channel message: {e}")))?;
            if d.names.len() != fds.len() {
                return Err(Fail::Protocol(format!(
                    "a descriptor channel message for request {} names {} segments and brings {} \
                     descriptors",
                    d.id,
                    d.names.len(),
                    fds.len()
                )));
            }
            let mut seen = HashSet::with_capacity(d.names.len());
            if let Some(twice) = d.names.iter().find(|n| !seen.insert(**n)) {
                return Err(Fail::Protocol(format!(
                    "a descriptor channel message for request {} names segment {twice:?} twice",
                    d.id
                )));
            }
            let named = d.names.iter().map(|n| (*n).to_owned()).zip(fds).collect();
            Ok((d.id, named))
        });
        match got {
            Ok((id, named)) => {
                if st.expected.contains(&id) {
                    st.ready.insert(id, named);
                }
                Ok(())
            }
            Err(f) => {
                Channel::close_locked(st, words(&f));
                Err(f)
            }
        }
    }

    /// Reads one message if one has begun to arrive (waiting for the rest
    /// of it until `deadline`); with `block` false, returns at once when
    /// another thread is reading. Whether one was read.
    pub(crate) fn pump_one(&self, deadline: Instant, block: bool) -> Result<bool, Fail> {
        let mut st = if block {
            self.lock()
        } else {
            match self.state.try_lock() {
                Ok(g) => g,
                Err(std::sync::TryLockError::WouldBlock) => return Ok(false),
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            }
        };
        let Some(sock) = st.sock.clone() else {
            return Err(Channel::closed_fail(&st));
        };
        if !readable_now(sock.as_raw_fd()) {
            return Ok(false);
        }
        Channel::read_one(&mut st, &sock, deadline).map(|()| true)
    }

    /// The descriptors of request `id`, waiting for them (reading the
    /// channel) until `deadline`. Not come by then: a timeout, and the
    /// request is forgotten.
    pub(crate) fn take_fds(&self, id: u64, deadline: Instant) -> Result<Fds, Fail> {
        loop {
            let sock = {
                let mut st = self.lock();
                loop {
                    if let Some(fds) = st.ready.remove(&id) {
                        st.expected.remove(&id);
                        return Ok(fds);
                    }
                    let Some(sock) = st.sock.clone() else {
                        return Err(Channel::closed_fail(&st));
                    };
                    st.expected.insert(id);
                    if !readable_now(sock.as_raw_fd()) {
                        break sock;
                    }
                    Channel::read_one(&mut st, &sock, deadline)?;
                }
            };
            if let Err(f) = wait(&*sock, deadline, libc::POLLIN, "") {
                self.forget_id(id);
                return Err(match f {
                    Fail::Timeout(_) => Fail::Timeout(format!(
                        "request {id}: its descriptors did not arrive on the descriptor channel \
                         in time"
                    )),
                    f => f,
                });
            }
        }
    }

    /// Closes the channel (idempotent).
    pub(crate) fn shut(&self, why: &str) {
        Channel::close_locked(&mut self.lock(), why);
    }
}

/// When a call given `timeout` seconds must end.
fn deadline_in(timeout: f64) -> Instant {
    Instant::now() + Duration::from_secs_f64(timeout.clamp(0.0, 1e9))
}

#[pymethods]
impl Channel {
    /// Connects to the channel socket `path` (stowd's `channel_ok`) and
    /// reads its greeting within `timeout` seconds. ConnectionError if it
    /// cannot connect, ProtocolViolation for a bad greeting, TimeoutError.
    #[new]
    fn new(py: Python<'_>, path: &str, timeout: f64) -> PyResult<Channel> {
        let deadline = deadline_in(timeout);
        Ok(py.detach(|| Channel::open(path, deadline))?)
    }

    /// The token to name in the envelope key `channel` of same-node
    /// requests.
    #[getter(token)]
    fn py_token(&self) -> &str {
        &self.token
    }

    /// Whether the channel is closed (see `why`).
    #[getter]
    fn closed(&self) -> bool {
        self.lock().sock.is_none()
    }

    /// Why the channel closed (None while open).
    #[getter]
    fn why(&self) -> Option<String> {
        let st = self.lock();
        if st.sock.is_some() {
            return None;
        }
        st.why.clone()
    }

    /// The socket's descriptor (None once closed), for an event loop to
    /// wait on before `pump`.
    fn fileno(&self) -> Option<RawFd> {
        self.lock().sock.as_ref().map(|s| s.as_raw_fd())
    }

    /// Keeps the descriptors of request `id` when they come (for `take`);
    /// call it before sending the request. Descriptors for requests nobody
    /// expects are closed as they arrive.
    fn expect(&self, id: u64) {
        self.expect_id(id);
    }

    /// No longer expects request `id`: descriptors that came for it, or
    /// come later, are closed.
    fn forget(&self, id: u64) {
        self.forget_id(id);
    }

    /// `{segment name: descriptor}` that stowd sent for request `id`,
    /// waiting for them (reading the channel) at most `timeout` seconds.
    /// The descriptors are the caller's to close. TimeoutError if they do
    /// not come in time; ProtocolViolation if the channel is closed or
    /// breaks (it is then closed, see `why`); ConnectionError on an I/O
    /// error.
    fn take<'py>(
        &self,
        py: Python<'py>,
        id: u64,
        timeout: f64,
    ) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
        let deadline = deadline_in(timeout);
        let fds = py.detach(|| self.take_fds(id, deadline))?;
        let out = pyo3::types::PyDict::new(py);
        for (name, fd) in fds {
            out.set_item(name, fd.into_raw_fd())?;
        }
        Ok(out)
    }

    /// Reads one message if one has begun to arrive, waiting at most
    /// `timeout` seconds for the rest of it; returns at once (False) when
    /// nothing is readable or another thread is reading. Whether a message
    /// was read. Raises as `take` when the channel breaks.
    fn pump(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let deadline = deadline_in(timeout);
        Ok(py.detach(|| self.pump_one(deadline, false))?)
    }

    /// Closes the channel and every descriptor not taken (idempotent).
    fn close(&self) {
        self.shut("closed by this client");
    }
}
