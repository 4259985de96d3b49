//! [`Connection`], `_core.Connection`: one DEALER connection to a stowd
//! native endpoint, made on first use (the ZMTP handshake) and kept between
//! calls, and its Python methods: `get` and `get_into` (over the socket,
//! or with `shm=(channel, segments)` a same-node one, [`crate::same_node`]),
//! `put` (a [`Put`]'s messages, from the caller's arrays), `send`,
//! `send_many`, `call` (a request that moves no rows, written and its
//! reply read with stowd's codec), the fast paths ([`crate::fast`]) and
//! the started calls an event loop awaits (`start_*`, `reply_ready`,
//! `fileno`, `finish_*`).

use std::io::IoSlice;
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyInt, PyList};
use stowage_transport::curve::{self, ClientHandshake, Keypair};
use stowage_transport::frame;
use stowage_transport::zmtp;
use stowage_wire::native::{self, ReplyLayout};

use crate::assemble::GetOptions;
use crate::buffer::{Held, hold_frames};
use crate::channel::Channel;
use crate::error::{Fail, ProtocolViolation};
use crate::get::{Asked, get, get_reply};
use crate::get_into::{Target, get_into, reply_into};
use crate::message::{DataFrames, REPLY_LIMITS, read_reply, send, send_pipelined, write_frames};
use crate::put::Put;
use crate::same_node::{self, Shm};
use crate::segments::Segments;
use crate::stream::{Socket, Stream, curve_fail};
use crate::wait::{Spin, Turn};
use crate::{codec, fast, indexes};

/// A same-node client's descriptor channel and mappings, as Python passes
/// them (`shm=(channel, segments)`); None over the socket alone.
type ShmArg<'py> = Option<(Bound<'py, Channel>, Bound<'py, Segments>)>;

/// The [`Shm`] of a [`ShmArg`].
fn shm_of<'a>(arg: &'a ShmArg<'_>) -> Option<Shm<'a>> {
    arg.as_ref().map(|(channel, segments)| Shm {
        channel: channel.get(),
        segments: segments.get(),
    })
}

/// Frame 0 of a same-node get: `frame0` with the envelope keys `same_node`
/// and `channel` (None: the codec cannot write it).
fn same_node_frame0(frame0: &[u8], shm: &Shm<'_>) -> Option<Bytes> {
    let extras = native::Extras {
        same_node: true,
        channel: Some(shm.channel.token().to_owned()),
        ..native::Extras::default()
    };
    native::with_extras(frame0, &extras).ok()
}

/// The request id frame 0 names.
fn id_of(frame0: &[u8]) -> PyResult<u64> {
    native::request_id(&[Bytes::copy_from_slice(frame0)])
        .ok_or_else(|| PyValueError::new_err("frame 0 without a readable id"))
}

/// Where a [`Connection`] connects: `tcp://host:port`, or `ipc://PATH`
/// (a Unix stream socket at PATH, as ZeroMQ's ipc transport names it;
/// `ipc://@NAME` is NAME in Linux's abstract namespace, as for ZeroMQ).
enum Endpoint {
    Tcp(String),
    Ipc(String),
}

impl Endpoint {
    fn parse(endpoint: &str) -> PyResult<Endpoint> {
        let bad = || {
            PyValueError::new_err(format!(
                "the Rust core speaks tcp:// and ipc:// only, not {endpoint:?}"
            ))
        };
        if let Some(a) = endpoint.strip_prefix("tcp://") {
            return if a.is_empty() {
                Err(bad())
            } else {
                Ok(Endpoint::Tcp(a.into()))
            };
        }
        match endpoint.strip_prefix("ipc://") {
            Some(p) if !p.is_empty() && p != "@" && p != "*" => Ok(Endpoint::Ipc(p.into())),
            _ => Err(bad()),
        }
    }

    /// The endpoint as the user wrote it (for error messages).
    fn name(&self) -> String {
        match self {
            Endpoint::Tcp(a) => format!("tcp://{a}"),
            Endpoint::Ipc(p) => format!("ipc://{p}"),
        }
    }

    /// A new connection. The deadline bounds a tcp connect; a Unix
    /// socket's connect returns at once, connected or refused (it
    /// would wait only for a listener whose backlog is full).
    fn connect(&self, deadline: Instant) -> Result<Socket, Fail> {
        let cannot =
            |e: std::io::Error| Fail::Io(format!("cannot connect to {}: {e}", self.name()));
        match self {
            Endpoint::Tcp(address) => {
                let left = deadline.saturating_duration_since(Instant::now());
                let addr = std::net::ToSocketAddrs::to_socket_addrs(address)
                    .map_err(|e| Fail::Io(format!("{address}: {e}")))?
                    .next()
                    .ok_or_else(|| Fail::Io(format!("{address}: no address")))?;
                let tcp = TcpStream::connect_timeout(&addr, left.max(Duration::from_millis(1)))
                    .map_err(cannot)?;
                let _ = tcp.set_nodelay(true);
                Ok(Socket::Tcp(tcp))
            }
            Endpoint::Ipc(path) => {
                let unix = match path.strip_prefix('@') {
                    Some(name) => {
                        use std::os::linux::net::SocketAddrExt;
                        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)
                            .map_err(cannot)?;
                        UnixStream::connect_addr(&addr)
                    }
                    None => UnixStream::connect(path),
                }
                .map_err(cannot)?;
                Ok(Socket::Unix(unix))
            }
        }
    }
}

/// One DEALER connection to a stowd native endpoint.
#[pyclass(module = "stowage._core")]
pub(crate) struct Connection {
    endpoint: Endpoint,
    spin: Duration,
    /// The connection kept between calls (with its read-ahead buffer).
    stream: Option<Stream>,
    /// stowd's token, presented at the handshake (ZMTP PLAIN) when stowd
    /// asks for credentials.
    token: Option<Vec<u8>>,
    /// stowd's public key and this client's key pair, for a stowd whose
    /// greeting says CURVE.
    curve: Option<CurveKeys>,
    /// The get `start_get` sent, for `finish_get`: its id, fields, rows.
    started: Option<(u64, Vec<Arc<str>>, u64)>,
    /// How [`Connection::reply_ready_spin`] polls (its window is `spin`).
    loop_spin: Spin,
    /// The get_into `start_get_into` sent, for `finish_get_into`.
    started_into: Option<GetInto>,
}

/// A get_into through the core: its request and where its rows go.
struct GetInto {
    frame0: Bytes,
    /// How many rows it asks for.
    rows: u64,
    plan: Vec<Target>,
    /// The arrays `plan` points into, held (not freed nor resized) until
    /// this is dropped.
    buffers: Vec<Held>,
}

impl GetInto {
    /// `get_into_fast`'s arguments read (request `id`): None when they are
    /// not plainly indexes and a dict of arrays of those rows (nothing is
    /// held then).
    fn read(
        id: u64,
        indexes: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        ranges: bool,
    ) -> PyResult<Option<GetInto>> {
        let py = out.py();
        let Ok(out) = out.cast_exact::<pyo3::types::PyDict>() else {
            return Ok(None);
        };
        if out.is_empty() {
            return Ok(None);
        }
        let names = pyo3::types::PyList::new(py, out.keys())?;
        let Some((n, field_names, ix)) = fast::get_head(indexes, names.as_any(), ranges) else {
            return Ok(None);
        };
        let mut buffers = Vec::with_capacity(out.len());
        let mut plan = Vec::with_capacity(out.len());
        for (name, o) in out.iter() {
            let Some((dtypes, shape, held)) = fast::read_out(&o) else {
                return Ok(None);
            };
            if shape.first() != Some(&n) {
                return Ok(None);
            }
            plan.push(Target::new(name.extract()?, dtypes, shape, &held));
            buffers.push(held);
        }
        let Ok(frame0) = ix.frame0(id, &field_names) else {
            return Ok(None);
        };
        Ok(Some(GetInto {
            frame0,
            rows: n,
            plan,
            buffers,
        }))
    }
}

/// The keys of a CURVE client.
struct CurveKeys {
    server: [u8; curve::KEY_LEN],
    client: Keypair,
}

impl CurveKeys {
    /// From Z85 text: stowd's public key, this client's public and secret
    /// keys (the public key checked against the secret one's).
    fn from_z85(server: &str, public: &str, secret: &str) -> PyResult<CurveKeys> {
        let key = |what: &str, text: &str| {
            curve::z85_decode(text).map_err(|e| PyValueError::new_err(format!("{what}: {e}")))
        };
        let server = key("curve_server_key", server)?;
        let public = key("curve_public_key", public)?;
        let client = Keypair::from_secret(key("curve_secret_key", secret)?);
        if *client.public() != public {
            return Err(PyValueError::new_err(
                "curve_public_key is not the public key of curve_secret_key",
            ));
        }
        Ok(CurveKeys { server, client })
    }
}

impl Connection {
    fn connect(&mut self, deadline: Instant) -> Result<Stream, Fail> {
        if let Some(mut s) = self.stream.take() {
            // A connection stowd closed while it sat idle (it exited or
            // restarted) is dropped for a new one, as pyzmq reconnects.
            if !s.may_be_closed() {
                s.deadline = deadline;
                return Ok(s);
            }
        }
        let sock = self.endpoint.connect(deadline)?;
        let s = Stream::new(sock, deadline, self.spin);
        self.handshake(s)
    }

    /// The ZMTP handshake on a new connection. With a token, it is offered
    /// only to a server that asks: the signature and version go first
    /// (libzmq sends the rest of its greeting once it has them), then the
    /// server's greeting is read and ours finished with its mechanism.
    fn handshake(&self, mut s: Stream) -> Result<Stream, Fail> {
        let protocol = |e: frame::FrameError| Fail::Protocol(zmtp::ZmtpError::from(e).to_string());
        let first = frame::greeting_as(frame::Mechanism::Null, false);
        s.write_all(&first[..11])?;
        let mut g = [0u8; 64];
        s.read_exact(&mut g)?;
        let theirs = frame::check_greeting(&g).map_err(protocol)?;
        if theirs.mechanism == frame::Mechanism::Curve {
            return self.curve_handshake(s);
        }
        let plain = theirs.mechanism == frame::Mechanism::Plain;
        let Some(token) = self.token.as_deref().filter(|_| plain) else {
            if plain {
                return Err(Fail::Protocol(
                    "stowd requires its token (ZMTP PLAIN) and this client has none: pass \
                     token=..., set STOWAGE_TOKEN, or run as stowd's user (its token file, \
                     or its endpoints file's \"token\")"
                        .into(),
                ));
            }
            s.write_all(&frame::greeting_as(frame::Mechanism::Null, false)[11..])?;
            s.write_all(&frame::ready_command(&[("Socket-Type", b"DEALER")]))?;
            command(&mut s, "READY")?;
            return Ok(s);
        };
        s.write_all(&frame::greeting_as(frame::Mechanism::Plain, false)[11..])?;
        s.write_all(&frame::hello_command(b"stowage", token))?;
        command(&mut s, "WELCOME")?;
        s.write_all(&frame::initiate_command(&[("Socket-Type", b"DEALER")]))?;
        command(&mut s, "READY")?;
        Ok(s)
    }

    /// The rest of the handshake with a stowd whose greeting says CURVE
    /// (RFC 26): HELLO, WELCOME, INITIATE, READY; then every byte goes
    /// through the session's codecs.
    fn curve_handshake(&self, mut s: Stream) -> Result<Stream, Fail> {
        let Some(keys) = &self.curve else {
            return Err(Fail::Protocol(
                "stowd asks for CURVE and this client has no CURVE keys: give \
                 curve_server_key= (with curve_public_key= and curve_secret_key= of a key \
                 stowd allows), set STOWAGE_CURVE_SERVER_KEY and STOWAGE_CURVE_DIR, or run \
                 as stowd's user so its curve directory (server.key, client.key_secret) \
                 is found"
                    .into(),
            ));
        };
        s.write_all(&frame::greeting_as(frame::Mechanism::Curve, false)[11..])?;
        let mut shake = ClientHandshake::new(&keys.client, &keys.server).map_err(curve_fail)?;
        write_command(&mut s, &shake.hello())?;
        // A server that cannot open HELLO (libzmq's) closes the connection.
        let welcome = command_body(&mut s, "WELCOME").map_err(|f| match f {
            Fail::Io(m) => Fail::Io(format!(
                "{m} at the CURVE handshake, before WELCOME: is curve_server_key its \
                 public key?"
            )),
            f => f,
        })?;
        let props = frame::properties(&[("Socket-Type", b"DEALER")]);
        let initiate = shake.welcome(&welcome, &props).map_err(curve_fail)?;
        write_command(&mut s, &initiate)?;
        let ready = command_body(&mut s, "READY").map_err(|f| match f {
            Fail::Io(m) => Fail::Io(format!(
                "{m} at the CURVE handshake, before READY: this client's key \
                 (curve_public_key) is not one it allows"
            )),
            Fail::Protocol(m) => match m.strip_prefix(REFUSED) {
                Some(reason) => Fail::Protocol(format!(
                    "{REFUSED}{reason} (at the CURVE handshake: is this client's key, \
                     curve_public_key, one it allows?)"
                )),
                None => Fail::Protocol(m),
            },
            f => f,
        })?;
        let (_, session) = shake.ready(&ready).map_err(curve_fail)?;
        s.secure(session);
        Ok(s)
    }

    /// The reply to `start_put`'s put: the rows when it is a put_ok for all
    /// of them, else its frames (for the caller to read and word).
    fn put_end<'py>(
        &mut self,
        py: Python<'py>,
        id: u64,
        rows: u64,
        deadline: Instant,
    ) -> PyResult<Bound<'py, PyAny>> {
        let reply = self.resume_detached(py, deadline, read_reply)?;
        if is_exact(
            &reply,
            exact_reply(id, &native::Reply::PutOk { rows }).as_ref(),
        ) {
            return Ok(rows.into_pyobject(py)?.into_any());
        }
        settled(
            py,
            id,
            reply,
            |r| matches!(r, native::Reply::PutOk { rows: r } if *r == rows),
            rows,
        )
    }

    /// Writes the request `op` with `body` (see `call`) and keeps the
    /// connection for its reply.
    fn call_begin(
        &mut self,
        py: Python<'_>,
        op: &str,
        id: u64,
        body: &Bound<'_, PyDict>,
        extras: Option<&Bound<'_, PyDict>>,
        deadline: Instant,
    ) -> PyResult<()> {
        let frame0 = codec::encode_request(py, op, id, body, extras)?;
        let frame0 = frame0.as_bytes().to_vec();
        py.detach(|| self.begin(deadline, &frame0, NO_FRAMES))?;
        Ok(())
    }

    /// Writes a request (`frame0` and its data `frames`) and keeps the
    /// connection for the reply, which `resume` reads (see
    /// `Connection.start_put`). A failed write drops the connection.
    fn begin<F: DataFrames + ?Sized>(
        &mut self,
        deadline: Instant,
        frame0: &[u8],
        frames: &F,
    ) -> Result<(), Fail> {
        let mut s = self.connect(deadline)?;
        write_frames(&mut s, frame0, frames)?;
        self.stream = Some(s);
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
            .stream
            .take()
            .ok_or_else(|| Fail::Io("no request is waiting for its reply".into()))?;
        s.deadline = deadline;
        let result = read(&mut s);
        if result.is_ok() {
            s.replied = Some(Instant::now());
            self.stream = Some(s);
        }
        result
    }

    /// [`Connection::resume`] with the GIL released, unless the whole reply
    /// is in the read-ahead already (an event loop's call, after
    /// `reply_ready`): reading it then takes less than releasing the GIL
    /// and taking it back.
    fn resume_detached<T: Send>(
        &mut self,
        py: Python<'_>,
        deadline: Instant,
        read: impl FnOnce(&mut Stream) -> Result<T, Fail> + Send,
    ) -> Result<T, Fail> {
        if self
            .stream
            .as_ref()
            .is_some_and(Stream::whole_message_ahead)
        {
            return self.resume(deadline, read);
        }
        py.detach(|| self.resume(deadline, read))
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
            s.replied = Some(Instant::now());
            self.stream = Some(s);
        }
        result
    }
    /// A get (`frame0` written as the socket's, made a same-node one with
    /// `shm`), its reply read and made into Python objects.
    fn run_get<'py>(
        &mut self,
        py: Python<'py>,
        frame0: &[u8],
        asked: &Asked<'_>,
        opts: &GetOptions,
        timeout: f64,
        shm: &ShmArg<'py>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let deadline = deadline_in(timeout);
        let reply = match shm_of(shm) {
            None => py.detach(|| self.exchange(deadline, |s| get(s, frame0, asked, opts)))?,
            Some(shm) => {
                let frame0 = same_node_frame0(frame0, &shm)
                    .ok_or_else(|| PyValueError::new_err("cannot add the same-node keys"))?;
                py.detach(|| {
                    self.exchange(deadline, |s| {
                        same_node::get(s, Some(&frame0), asked, opts, &shm)
                    })
                })?
            }
        };
        reply.into_py(py, opts)
    }

    /// A get_into (`frame0` written as the socket's, made a same-node one
    /// with `shm`) into `plan`, the GIL released.
    fn run_get_into(
        &mut self,
        py: Python<'_>,
        id: u64,
        frame0: &[u8],
        plan: &[Target],
        timeout: f64,
        shm: &ShmArg<'_>,
    ) -> Result<Option<crate::receive::Other>, Fail> {
        let deadline = deadline_in(timeout);
        // The arrays stay held (the caller's) while the GIL is released.
        match shm_of(shm) {
            None => py.detach(|| self.exchange(deadline, |s| get_into(s, frame0, plan))),
            Some(shm) => {
                let frame0 = same_node_frame0(frame0, &shm)
                    .ok_or_else(|| Fail::Protocol("cannot add the same-node keys".into()))?;
                py.detach(|| {
                    self.exchange(deadline, |s| {
                        same_node::get_into(s, id, Some(&frame0), plan, &shm)
                    })
                })
            }
        }
    }
}

/// Frame 0 of a get an event loop starts: `frame0` as it is, or with
/// `shm` made a same-node one, its request `id` expected on the channel
/// (None: the codec cannot write it; nothing is expected).
fn same_node_start(frame0: Bytes, id: u64, shm: &ShmArg<'_>) -> Option<Bytes> {
    let Some(shm) = shm_of(shm) else {
        return Some(frame0);
    };
    let frame0 = same_node_frame0(&frame0, &shm)?;
    shm.channel.expect_id(id);
    Some(frame0)
}

/// When a call given `timeout` seconds (negative: none left) must end.
fn deadline_in(timeout: f64) -> Instant {
    Instant::now() + Duration::from_secs_f64(timeout.max(0.0))
}

#[pymethods]
impl Connection {
    /// A connection to `endpoint` (made on first use) that awaits each
    /// reply by polling for up to `spin_us` microseconds before sleeping
    /// (0: sleep at once; see [`Spin`]).
    /// `token` is presented to a stowd that asks for it (ZMTP PLAIN);
    /// `curve`, (stowd's public key, this client's public key, its secret
    /// key) in Z85, to one whose greeting says CURVE.
    #[new]
    #[pyo3(signature = (endpoint, spin_us = 0.0, token = None, curve = None))]
    fn new(
        endpoint: &str,
        spin_us: f64,
        token: Option<&str>,
        curve: Option<(String, String, String)>,
    ) -> PyResult<Self> {
        if !(spin_us.is_finite() && spin_us >= 0.0) {
            return Err(PyValueError::new_err(format!(
                "spin_us must be a finite number >= 0, got {spin_us}"
            )));
        }
        let spin = Duration::from_secs_f64(spin_us.min(1e9) / 1e6);
        Ok(Connection {
            endpoint: Endpoint::parse(endpoint)?,
            spin,
            stream: None,
            token: token.map(|t| t.as_bytes().to_vec()),
            curve: curve
                .map(|(server, public, secret)| CurveKeys::from_z85(&server, &public, &secret))
                .transpose()?,
            started: None,
            loop_spin: Spin::new(spin),
            started_into: None,
        })
    }

    /// Sends the get request `frame0` and reads the reply's rows straight
    /// into `targets`: a list of `(field, accepted dtype names, shape,
    /// writable buffer)`, contiguous or strided. Returns None when the rows
    /// are in place, or (the reply's frame 0, why this codec refused it or
    /// None) when stowd answered otherwise (an error, for the caller to
    /// decode). Raises ValueError when the reply does not fit the arrays
    /// (nothing written), TimeoutError and ConnectionError otherwise (the
    /// connection is dropped). With `shm=(channel, segments)`, `frame0` is
    /// a same-node get (its envelope names the channel) and the rows are
    /// copied from stowd's segments.
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (frame0, targets, timeout, shm = None))]
    fn get_into<'py>(
        &mut self,
        py: Python<'py>,
        frame0: &[u8],
        targets: Vec<(String, Vec<String>, Vec<u64>, Bound<'py, PyAny>)>,
        timeout: f64,
        shm: ShmArg<'py>,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, Option<String>)>> {
        let mut buffers = Vec::with_capacity(targets.len());
        let mut plan = Vec::with_capacity(targets.len());
        for (name, dtypes, shape, obj) in targets {
            let flags = pyo3::ffi::PyBUF_STRIDES | pyo3::ffi::PyBUF_WRITABLE;
            let Ok(held) = Held::with_flags(&obj, flags) else {
                return Err(PyValueError::new_err(format!(
                    "get_into: out[{name:?}] must be a writable buffer"
                )));
            };
            if dtypes.is_empty() {
                return Err(PyValueError::new_err("no dtype given"));
            }
            plan.push(Target::new(name, dtypes, shape, &held));
            buffers.push(held);
        }
        let id = id_of(frame0)?;
        let result = self.run_get_into(py, id, frame0, &plan, timeout, &shm);
        drop(buffers);
        Ok(result?.map(|(head, problem)| (PyBytes::new(py, &head), problem)))
    }

    /// Sends the get request `frame0` (request id read from it), asking for
    /// `names`, `n` rows, and reads the reply: for a get_ok, `(results,
    /// glue)`, the results made as `opts` (a `GetOptions`) says: a dict of
    /// field name to a read-only numpy array (regular), a list of arrays
    /// (nested) or a `Packed`, or a list of values, in reply order, and the
    /// `(field, dtype name)` of each field the client's Python glue makes
    /// a tensor or a typed array of; for any other reply, `(frame 0, why
    /// this codec refused it or None)`. Over the socket each field's rows
    /// are read straight into one buffer; with `shm=(channel, segments)`
    /// (`frame0` a same-node get), they are views of stowd's segments or
    /// gathered from them. Raises ProtocolViolation for a reply that breaks
    /// the protocol or does not answer the request, TimeoutError and
    /// ConnectionError (the connection is dropped).
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (frame0, names, n, timeout, opts, shm = None))]
    fn get<'py>(
        &mut self,
        py: Python<'py>,
        frame0: &[u8],
        names: Vec<String>,
        n: u64,
        timeout: f64,
        opts: &Bound<'py, GetOptions>,
        shm: ShmArg<'py>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let id = id_of(frame0)?;
        let names: Vec<Arc<str>> = names
            .iter()
            .map(|n| stowage_wire::names::shared_name(n))
            .collect();
        let asked = Asked {
            id,
            names: &names,
            rows: n,
        };
        self.run_get(py, frame0, &asked, opts.get(), timeout, &shm)
    }

    /// A get of `indexes` of `fields`, request id `id`, read and written
    /// here ([`fast`]: a list, tuple, range or 1-d integer buffer of
    /// indexes; a str or a list or tuple of distinct str), as runs where
    /// that is shorter unless `ranges` is false (a stowd from before
    /// ranges): (how many indexes, what `get` returns); or None, with
    /// nothing sent, when the arguments are not plainly that (for the
    /// caller's general path to check and word). `shm` as for `get`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (id, indexes, fields, timeout, opts, ranges = true, shm = None))]
    fn get_fast<'py>(
        &mut self,
        py: Python<'py>,
        id: u64,
        indexes: &Bound<'py, PyAny>,
        fields: &Bound<'py, PyAny>,
        timeout: f64,
        opts: &Bound<'py, GetOptions>,
        ranges: bool,
        shm: ShmArg<'py>,
    ) -> PyResult<Option<(u64, Bound<'py, PyAny>)>> {
        let Some((n, names, ix)) = fast::get_head(indexes, fields, ranges) else {
            return Ok(None);
        };
        // One the codec cannot write goes the general way too.
        let Ok(frame0) = ix.frame0(id, &names) else {
            return Ok(None);
        };
        let asked = Asked {
            id,
            names: &names,
            rows: n,
        };
        let got = self.run_get(py, &frame0, &asked, opts.get(), timeout, &shm)?;
        Ok(Some((n, got)))
    }

    /// A get_into of `indexes` into `out` (a dict of field name to array),
    /// request id `id`, read and written here ([`fast`]; `ranges` as for
    /// `get_fast`): what `get_into` returns (None: the rows are in place),
    /// or False, with nothing sent, when the arguments are not plainly
    /// that (for the caller's general path to check and word). `shm` as
    /// for `get_into`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (id, indexes, out, timeout, ranges = true, shm = None))]
    fn get_into_fast<'py>(
        &mut self,
        py: Python<'py>,
        id: u64,
        indexes: &Bound<'py, PyAny>,
        out: &Bound<'py, PyAny>,
        timeout: f64,
        ranges: bool,
        shm: ShmArg<'py>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let not_here = || Ok(pyo3::types::PyBool::new(py, false).to_owned().into_any());
        let Some(into) = GetInto::read(id, indexes, out, ranges)? else {
            return not_here();
        };
        let GetInto {
            frame0,
            plan,
            buffers,
            ..
        } = into;
        let result = self.run_get_into(py, id, &frame0, &plan, timeout, &shm);
        drop(buffers);
        Ok(result?
            .map(|(head, problem)| (PyBytes::new(py, &head), problem))
            .into_pyobject(py)?
            .into_any())
    }

    /// Sends `put` (a [`Put`]: read, checked and laid out) as put requests
    /// of id `id` and, for each later message, the next of `ids` (an
    /// iterator of ints; None for a put of one message), with two on the
    /// wire (stowd reads the next while it stores one); with `segments`
    /// (same node: what `Put.fill` wrote into a lease), its one message
    /// names them, its data frames not sent. Returns the rows stored when
    /// stowd answered put_ok for every message; else `(rows stored by the
    /// messages answered so far, the request id of the one that was not,
    /// its reply's frames as bytes or None, the exception that dropped the
    /// connection or None)`: the reply to read and word (an error), or the
    /// TimeoutError, ConnectionError or ProtocolViolation that broke the
    /// exchange after those replies.
    #[pyo3(signature = (id, ids, put, timeout, segments = None))]
    fn put<'py>(
        &mut self,
        py: Python<'py>,
        id: u64,
        ids: Option<&Bound<'py, PyAny>>,
        put: &Bound<'py, Put>,
        timeout: f64,
        segments: Option<Vec<(String, u64, u64)>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let plan = &put.get().plan;
        let count = plan.message_count();
        if segments.is_some() && count != 1 {
            return Err(PyValueError::new_err("a same-node put is one message"));
        }
        let mut rids = Vec::with_capacity(count);
        rids.push(id);
        for _ in 1..count {
            let Some(ids) = ids else {
                return Err(PyValueError::new_err(format!(
                    "a put of {count} messages needs ids"
                )));
            };
            rids.push(ids.call_method0("__next__")?.extract::<u64>()?);
        }
        let each = Duration::from_secs_f64(timeout.max(0.0));
        let deadline = Instant::now() + each;
        let mut replies = Vec::new();
        let segments = segments.as_deref();
        // Each message's put_ok as this codec writes it: a reply of exactly
        // these bytes is not read at all (`put_ok`).
        let oks: Vec<Option<Bytes>> = (0..count)
            .map(|k| {
                exact_reply(
                    rids[k],
                    &native::Reply::PutOk {
                        rows: plan.message_len(k),
                    },
                )
            })
            .collect();
        // The put's arrays stay held (`put`) while the GIL is released.
        let done = py.detach(|| {
            self.exchange(deadline, |s| {
                send_pipelined(
                    s,
                    count,
                    &mut |s, k| {
                        let m = plan.message(k, rids[k], segments)?;
                        write_frames(s, &m.frame0, &m)
                    },
                    &|k, head| oks[k].as_deref() == Some(head),
                    each,
                    &mut replies,
                )
            })
        });
        let mut stored = 0u64;
        for (k, reply) in replies.iter().enumerate() {
            let rows = plan.message_len(k);
            if !is_exact(reply, oks[k].as_ref()) && !put_ok(reply, rids[k], rows) {
                let frames: Vec<Bound<'py, PyBytes>> =
                    reply.iter().map(|f| PyBytes::new(py, f)).collect();
                return (stored, rids[k], frames, None::<Bound<'py, PyAny>>)
                    .into_pyobject(py)
                    .map(Bound::into_any);
            }
            stored += rows;
        }
        match done {
            Ok(()) => Ok(stored.into_pyobject(py)?.into_any()),
            Err(f) => {
                let rid = rids[replies.len().min(count - 1)];
                let failure = PyErr::from(f).into_value(py).into_bound(py).into_any();
                (stored, rid, None::<Vec<Bound<'py, PyBytes>>>, Some(failure))
                    .into_pyobject(py)
                    .map(Bound::into_any)
            }
        }
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
            fields: names.map(|names| names.iter().map(|n| n.to_string()).collect()),
        });
        let Ok(frame0) = native::encode_request_head(id, &head) else {
            return Ok(None);
        };
        let deadline = deadline_in(timeout);
        let reply = py.detach(|| self.exchange(deadline, |s| send(s, &frame0, NO_FRAMES)))?;
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
        let reply = py.detach(|| self.exchange(deadline, |s| send(s, frame0, frames.as_slice())));
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
        let plan: Vec<(&[u8], Vec<Vec<&[u8]>>)> = messages
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
        let done = py.detach(|| {
            self.exchange(deadline, |s| {
                send_pipelined(
                    s,
                    plan.len(),
                    &mut |s, k| write_frames(s, plan[k].0, plan[k].1.as_slice()),
                    &|_, _| false,
                    each,
                    &mut replies,
                )
            })
        });
        drop(plan);
        drop(held);
        let replies = replies
            .iter()
            .map(|r| r.iter().map(|f| PyBytes::new(py, f)).collect())
            .collect();
        let failure = done.err().map(|f| PyErr::from(f).into_value(py).into_any());
        Ok((replies, failure.map(|e| e.into_bound(py))))
    }

    /// The first half of `put`, for an event loop that awaits the reply
    /// itself: a put of one message (`put`, a [`Put`]) written as request
    /// `id` (the connection made first if there is none); the rows it
    /// carries, or None with nothing sent when it is more than one
    /// message. Then `reply_ready`, `fileno` and `finish_put`.
    ///
    /// The `start_*` methods take `(id, timeout, ...)` and the `finish_*`
    /// ones `(id, what start returned, timeout, ...)`, so that the
    /// `AsyncClient` calls them as they are, with no closure a call.
    ///
    /// With `segments` (what `Put.fill` returned for its lease), the put
    /// names them and carries no data frames (a same-node put).
    #[pyo3(signature = (id, timeout, put, segments = None))]
    fn start_put(
        &mut self,
        py: Python<'_>,
        id: u64,
        timeout: f64,
        put: &Bound<'_, Put>,
        segments: Option<Vec<(String, u64, u64)>>,
    ) -> PyResult<Option<u64>> {
        let plan = &put.get().plan;
        if plan.message_count() != 1 {
            return Ok(None);
        }
        let deadline = deadline_in(timeout);
        let segments = segments.as_deref();
        // The put's arrays stay held (`put`) while the GIL is released.
        py.detach(|| -> Result<(), Fail> {
            let m = plan.message(0, id, segments)?;
            self.begin(deadline, &m.frame0, &m)
        })?;
        Ok(Some(plan.message_len(0)))
    }

    /// The second half of a `start_put` of `rows` rows, request id `id`:
    /// the rows when stowd answered put_ok for all of them, else the
    /// reply's frames (for the caller to read and word).
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

    /// The first half of `get_fast`, for an event loop that awaits the
    /// reply itself: the request written, how many indexes it asks for, or
    /// None with nothing sent. Then `finish_get`. With `shm`, a same-node
    /// get (its descriptors expected on the channel, which the loop reads
    /// as they come: `Channel.pump`); see `reply_read_here`.
    #[pyo3(signature = (id, timeout, indexes, fields, ranges = true, shm = None))]
    #[allow(clippy::too_many_arguments)]
    fn start_get(
        &mut self,
        py: Python<'_>,
        id: u64,
        timeout: f64,
        indexes: &Bound<'_, PyAny>,
        fields: &Bound<'_, PyAny>,
        ranges: bool,
        shm: ShmArg<'_>,
    ) -> PyResult<Option<u64>> {
        let Some((n, names, ix)) = fast::get_head(indexes, fields, ranges) else {
            return Ok(None);
        };
        let Ok(frame0) = ix.frame0(id, &names) else {
            return Ok(None);
        };
        let Some(frame0) = same_node_start(frame0, id, &shm) else {
            return Ok(None);
        };
        let deadline = deadline_in(timeout);
        self.started = None;
        py.detach(|| self.begin(deadline, &frame0, NO_FRAMES))?;
        self.started = Some((id, names, n));
        Ok(Some(n))
    }

    /// The second half of `get_fast`: what `get` returns, its result made
    /// as `opts` says (`_id` and `_rows` as `start_get` had them: the get
    /// it started is the one kept here).
    #[pyo3(signature = (_id, _rows, timeout, opts, shm = None))]
    fn finish_get<'py>(
        &mut self,
        py: Python<'py>,
        _id: u64,
        _rows: Option<u64>,
        timeout: f64,
        opts: &Bound<'py, GetOptions>,
        shm: ShmArg<'py>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let Some((id, names, rows)) = self.started.take() else {
            return Err(Fail::Io("no get is waiting for its reply".into()).into());
        };
        let asked = Asked {
            id,
            names: &names,
            rows,
        };
        let deadline = deadline_in(timeout);
        let opts = opts.get();
        let got = match shm_of(&shm) {
            None => self.resume_detached(py, deadline, |s| get_reply(s, &asked, opts))?,
            Some(shm) => self.resume_detached(py, deadline, |s| {
                same_node::get(s, None, &asked, opts, &shm)
            })?,
        };
        got.into_py(py, opts)
    }

    /// The first half of `get_into_fast` (over the socket), for an event
    /// loop that awaits the reply itself: the request written, how many
    /// indexes it asks for, or None with nothing sent (not plainly that:
    /// the caller's general path checks and words). The arrays of `out`
    /// stay held until `finish_get_into` (or until the connection is
    /// closed).
    #[pyo3(signature = (id, timeout, indexes, out, ranges = true, shm = None))]
    #[allow(clippy::too_many_arguments)]
    fn start_get_into(
        &mut self,
        py: Python<'_>,
        id: u64,
        timeout: f64,
        indexes: &Bound<'_, PyAny>,
        out: &Bound<'_, PyAny>,
        ranges: bool,
        shm: ShmArg<'_>,
    ) -> PyResult<Option<u64>> {
        let Some(mut into) = GetInto::read(id, indexes, out, ranges)? else {
            return Ok(None);
        };
        let Some(frame0) = same_node_start(into.frame0.clone(), id, &shm) else {
            return Ok(None);
        };
        into.frame0 = frame0;
        let deadline = deadline_in(timeout);
        self.started_into = None;
        py.detach(|| self.begin(deadline, &into.frame0, NO_FRAMES))?;
        let n = into.rows;
        self.started_into = Some(into);
        Ok(Some(n))
    }

    /// The second half: the reply read, a get_ok's rows straight into the
    /// arrays; True, or (frame 0, why the codec refused it or None) of
    /// any other reply, as `get_into_fast` gives it.
    #[pyo3(signature = (id, _rows, timeout, shm = None))]
    fn finish_get_into<'py>(
        &mut self,
        py: Python<'py>,
        id: u64,
        _rows: Option<u64>,
        timeout: f64,
        shm: ShmArg<'py>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let Some(into) = self.started_into.take() else {
            return Err(Fail::Io("no get_into is waiting for its reply".into()).into());
        };
        let deadline = deadline_in(timeout);
        // The arrays stay held (`into.buffers`) while the GIL is released.
        let result = match shm_of(&shm) {
            None => self.resume_detached(py, deadline, |s| reply_into(s, &into.plan)),
            Some(shm) => self.resume_detached(py, deadline, |s| {
                same_node::get_into(s, id, None, &into.plan, &shm)
            }),
        };
        drop(into);
        match result? {
            None => Ok(pyo3::types::PyBool::new(py, true).to_owned().into_any()),
            Some((head, problem)) => Ok((PyBytes::new(py, &head), problem)
                .into_pyobject(py)?
                .into_any()),
        }
    }

    /// Whether the connection is made (a call then starts without
    /// connecting first).
    #[getter]
    fn connected(&self) -> bool {
        self.stream.is_some()
    }

    /// The socket's descriptor (None: no connection), for an event loop
    /// to await the reply to a started call on.
    fn fileno(&self) -> Option<i32> {
        self.stream
            .as_ref()
            .map(|s| std::os::fd::AsRawFd::as_raw_fd(&s.sock))
    }

    /// A request that moves no rows (stats, checkpoint, restore, clear,
    /// channel, lease): `op` with `body` (and the envelope keys `extras`:
    /// a lease's `channel`) as `encode_request` takes them, request
    /// id `id`, written by stowd's codec, and the reply that answers it read
    /// whole: (its frame 0 as `decode_reply` gives it, or why the codec
    /// refused it as a str; how many frames the reply has). A reply to
    /// another request (a peer's stray) is dropped and the next one read;
    /// an error reply of id 0 (to a request stowd could not read) answers
    /// it. Raises TimeoutError and ConnectionError as `send` (the
    /// connection is dropped).
    #[pyo3(signature = (op, id, body, timeout, extras = None))]
    fn call<'py>(
        &mut self,
        py: Python<'py>,
        op: &str,
        id: u64,
        body: &Bound<'py, PyDict>,
        timeout: f64,
        extras: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<(Bound<'py, PyAny>, usize)> {
        let deadline = deadline_in(timeout);
        self.call_begin(py, op, id, body, extras, deadline)?;
        loop {
            let reply = self.resume_detached(py, deadline, read_reply)?;
            if let Some(got) = answer(py, id, &reply)? {
                return Ok(got);
            }
        }
    }

    /// The first half of `call`, for an event loop that awaits the reply
    /// itself: the request written (the connection made first if there is
    /// none), with the envelope keys `extras` (a same-node lease names its
    /// channel). Then `reply_ready`, `fileno` and `finish_call`.
    #[pyo3(signature = (id, timeout, op, body, extras = None))]
    fn start_call<'py>(
        &mut self,
        py: Python<'py>,
        id: u64,
        timeout: f64,
        op: &str,
        body: &Bound<'py, PyDict>,
        extras: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<bool> {
        self.call_begin(py, op, id, body, extras, deadline_in(timeout))?;
        Ok(true)
    }

    /// The second half of `call`: one reply read whole; what `call`
    /// returns when it answers request `id`, else None (a stray, dropped:
    /// the caller awaits the next). `_started`: what `start_call` returned.
    fn finish_call<'py>(
        &mut self,
        py: Python<'py>,
        id: u64,
        _started: bool,
        timeout: f64,
    ) -> PyResult<Option<(Bound<'py, PyAny>, usize)>> {
        let deadline = deadline_in(timeout);
        let reply = self.resume_detached(py, deadline, read_reply)?;
        answer(py, id, &reply)
    }

    /// Whether an event loop reads the reply to a started same-node get
    /// itself: its whole frame 0 is in the read-ahead (see `reply_ready`;
    /// not CURVE's) and it names no segments (stowd's `[shm]
    /// inline_below`: a small get), one segment range (views of the
    /// mapping, nothing to gather), or ranges whose rows, as its fields
    /// read them, come to at most `gather_max` bytes. Otherwise a worker
    /// thread reads it: its rows may be gathered into one buffer, a copy
    /// the loop should not wait for.
    fn reply_read_here(&self, gather_max: u64) -> bool {
        let Some(f0) = self.stream.as_ref().and_then(Stream::frame0_ahead) else {
            return false;
        };
        let entries = match crate::receive::segments(f0) {
            Ok(None) => return true,
            Ok(Some(entries)) => entries,
            Err(_) => return false,
        };
        if entries.len() <= 1 {
            return true;
        }
        // The rows' bytes, not the ranges': stowd names whole segments.
        // (A copy of frame 0, which the layout's decoder takes as `Bytes`.)
        let f0 = Bytes::copy_from_slice(f0);
        match native::decode_reply_layout(&f0, &REPLY_LIMITS) {
            Ok((_, ReplyLayout::GetOk(fields))) => {
                fields
                    .iter()
                    .map(|(_, f)| f.bytes())
                    .fold(0u64, u64::saturating_add)
                    <= gather_max
            }
            _ => false,
        }
    }

    /// Whether the whole reply to a started call has arrived, so that
    /// `finish_*` reads it without waiting (also true when the connection
    /// broke, or there is none: `finish_*` then says so).
    fn reply_ready(&mut self) -> bool {
        self.stream.as_mut().is_none_or(Stream::message_waiting)
    }

    /// [`Connection::reply_ready`], polled for up to the connection's
    /// `spin_us` with the GIL released, giving the CPU away each turn, as
    /// a blocking call's wait spins ([`Spin`], its rest after a miss and
    /// its backing off from a crowded CPU included): for an event loop
    /// with nothing else to run, which would otherwise sleep in its
    /// selector and pay a wake-up for the reply. A reply larger than the
    /// read-ahead ends the spin as soon as it fills it (false): its reader
    /// waits in a worker thread, not in a poll.
    fn reply_ready_spin(&mut self, py: Python<'_>) -> bool {
        let Some(s) = self.stream.as_mut() else {
            return true;
        };
        if s.message_waiting() {
            return true;
        }
        if s.ahead_full() {
            return false;
        }
        let spin = &mut self.loop_spin;
        py.detach(|| {
            spin.poll(s.deadline, || {
                if s.message_waiting() {
                    Turn::Ready
                } else if s.ahead_full() {
                    Turn::Stop
                } else {
                    Turn::NotYet
                }
            })
        })
    }

    /// How many of the next [`Connection::reply_ready_spin`] calls return
    /// at once, without spinning (after a spin that missed its reply or
    /// found the CPU crowded).
    #[getter]
    fn loop_spin_rest(&self) -> u32 {
        self.loop_spin.rest()
    }

    /// Drops the connection (the next call makes a new one).
    fn close(&mut self) {
        self.stream = None;
        self.started = None;
        self.started_into = None;
    }
}

/// No data frames.
const NO_FRAMES: &[Vec<&[u8]>] = &[];

/// `reply` to request `id` as this codec writes it: frame 0 alone. A reply
/// of exactly these bytes reads as `reply` with no extras, so a caller
/// that compares with it need not read it: a 1-row put's put_ok was read
/// three times (once for `send_pipelined`, twice for `put_ok`), about
/// 3,500 of the client's 19,800 instructions a put (callgrind).
fn exact_reply(id: u64, reply: &native::Reply) -> Option<Bytes> {
    match native::encode_reply(id, reply) {
        Ok(mut frames) if frames.len() == 1 => frames.pop(),
        _ => None,
    }
}

/// Whether `reply` is the one frame `exact` ([`exact_reply`]).
fn is_exact(reply: &[Vec<u8>], exact: Option<&Bytes>) -> bool {
    matches!((reply, exact), ([head], Some(e)) if head[..] == e[..])
}

/// Whether `reply` is one frame answering request `id` with put_ok for
/// `rows` rows, and nothing else.
fn put_ok(reply: &[Vec<u8>], id: u64, rows: u64) -> bool {
    if reply.len() != 1 {
        return false;
    }
    let head = Bytes::copy_from_slice(&reply[0]);
    matches!(
        native::decode_reply_layout(&head, &REPLY_LIMITS),
        Ok((rid, ReplyLayout::Other(native::Reply::PutOk { rows: r }))) if rid == id && r == rows
    ) && native::decode_extras(&head, &REPLY_LIMITS).is_ok_and(|e| e == native::Extras::default())
}

/// A reply read whole, for `finish_put` and `clear_fast`: `ok` (an int) when
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

/// A reply read whole, for `call`: (frame 0 decoded, or why the codec
/// refused it; how many frames) when it answers request `id` (its id, or
/// an error of id 0; a frame 0 the codec refuses counts as the answer),
/// else None.
fn answer<'py>(
    py: Python<'py>,
    id: u64,
    reply: &[Vec<u8>],
) -> PyResult<Option<(Bound<'py, PyAny>, usize)>> {
    let env = match codec::decode_reply(py, &reply[0]) {
        Ok(env) => env,
        Err(e) if e.is_instance_of::<ProtocolViolation>(py) => {
            return Ok(Some((e.value(py).str()?.into_any(), reply.len())));
        }
        Err(e) => return Err(e),
    };
    let field = |key: &str| {
        env.get_item(key)?
            .ok_or_else(|| PyValueError::new_err(format!("a decoded reply without {key:?}")))
    };
    let rid: u64 = field("id")?.extract()?;
    let error = field("op")?.extract::<String>()? == "error";
    if rid == id || (rid == 0 && error) {
        return Ok(Some((env.into_any(), reply.len())));
    }
    Ok(None)
}

/// How stowd's ERROR at the handshake begins, its reason after.
const REFUSED: &str = "stowd refused the connection: ";

/// Reads the next frame as the command `want`; stowd's ERROR is its
/// refusal, in its own words.
fn command(s: &mut Stream, want: &str) -> Result<(), Fail> {
    command_body(s, want).map(drop)
}

/// Writes a command frame whose body (name included) is `body`.
fn write_command(s: &mut Stream, body: &[u8]) -> Result<(), Fail> {
    let mut head = [0u8; frame::MAX_HEADER];
    let head = frame::Header::command(body.len() as u64).encode(&mut head);
    s.write_all_vectored(&mut [IoSlice::new(head), IoSlice::new(body)])
}

/// [`command`], giving the command's body (name included).
fn command_body(s: &mut Stream, want: &str) -> Result<Vec<u8>, Fail> {
    let h = s.header()?;
    if !h.command {
        return Err(Fail::Protocol(format!("expected stowd's {want}")));
    }
    let body = s.small_frame(h.size, frame::MAX_COMMAND, "a command")?;
    // A name cut short reads as none.
    let (name, data) = frame::split_command(&body).unwrap_or((&[][..], &[][..]));
    if name == b"ERROR" {
        return Err(Fail::Protocol(format!(
            "{REFUSED}{}",
            frame::error_reason(data)
        )));
    }
    if name != want.as_bytes() {
        return Err(Fail::Protocol(format!(
            "expected {want}, got {:?}",
            String::from_utf8_lossy(name)
        )));
    }
    Ok(body)
}
