//! `stowage._core`: the Rust core of the Python client: a tcp or ipc
//! `get_into` that receives straight into the caller's arrays, a `get` that
//! receives each field into one buffer and makes its results (every field
//! kind, [`assemble`]), a `send` that puts from the caller's arrays, and
//! the same-node mode's gets ([`same_node`]): its descriptor channel
//! ([`channel`]) and the mappings of stowd's segments ([`segments`]).
//!
//! pyzmq receives every frame into memory libzmq allocates (fresh pages,
//! faulted in at about 1.4 GB/s on the benchmark machine), and the Python
//! client then copies each field into the caller's array: two copies and a
//! peak of twice the payload. Here the reply is read from the socket by
//! this crate: frame 0 is decoded by stowd's own codec
//! ([`stowage_wire::native::decode_reply_layout`]: where each field's rows
//! lie in the data frames still to come; a get_ok whose descriptors are the
//! last one's bytes takes the last layout again,
//! [`stowage_wire::native::decode_reply_layout_memo`]), and each data frame's bytes are
//! read from the socket straight into the rows they belong to, in the
//! caller's arrays. Nothing the size of the payload is allocated; the GIL
//! is released while bytes move.
//!
//! A put goes the other way without a copy either: pyzmq sends a frame
//! from one buffer, so the Python client joined the small rows of a put
//! into shared frames (a copy) before sending. A put is read and laid out
//! here, every input kind ([`put`]: `_core.Put`), and
//! [`Connection::put`](connection::Connection::put) holds the caller's
//! arrays, releases the GIL, and writes them with `writev`: frame
//! headers and pieces of up to
//! [`zmtp::COALESCE`](stowage_transport::zmtp::COALESCE) bytes are copied
//! into one small buffer (as stowd's own writer,
//! [`zmtp::write_message`](stowage_transport::zmtp::write_message), does: a
//! slice per tiny piece costs the kernel more than copying it), larger
//! pieces go from where they lie, in batches of at most
//! [`IOV_MAX`](stream::IOV_MAX) slices. A request is written without
//! blocking (`MSG_DONTWAIT`), the wait for room a `poll`, as libzmq sends:
//! a blocking `writev` of a large buffer, which waits inside the kernel,
//! put 1 GiB at 3.4 GB/s where this puts it at 4.5, on a par with pyzmq
//! (medians of 8, alternating, on the benchmark machine).
//!
//! The connection is stowd's ZMTP 3.0 (NULL, PLAIN or CURVE) as a DEALER,
//! over a `std::net::TcpStream` (`tcp://`) or a
//! `std::os::unix::net::UnixStream` (`ipc://`): the greeting, READY and every frame header are
//! written and parsed by stowd's own framer, [`stowage_transport::frame`]
//! (which does no I/O: headers are parsed in place in the read-ahead
//! buffer); this crate does the reading and writing. A reply that breaks
//! the protocol, a timeout or an I/O error drops the connection (the next
//! call makes a new one), so a late or half-read reply is never taken for
//! the next one.
//!
//! Every envelope the Python client writes or reads, on any transport,
//! goes through [`codec`]: stowd's codec, with Python objects in and out.
//! [`put`] reads a put's arguments and lays out its messages; [`fast`]
//! reads a small get's or clear's arguments as the user gives them;
//! [`indexes`] reads index inputs for all of them.
//!
//! Each module uses only modules below it in this table:
//!
//! | module | what it holds |
//! |---|---|
//! | [`connection`] | `_core.Connection`: the connection, its ZMTP handshake, its Python methods |
//! | [`put`] | `_core.Put`: a put's arguments read and checked, its messages laid out, a lease filled |
//! | [`fast`] | a small get's or clear's arguments read as the user gives them |
//! | [`same_node`] | same-node get and get_into: the channel read while waiting, segments mapped and checked |
//! | [`get_into`] | a get into the caller's arrays, each checked before any byte is written |
//! | [`get`] | a get over the socket, each field's rows into one pooled buffer |
//! | [`assemble`] | a get's result, every field kind, made into Python objects (`_core.GetOptions`) |
//! | [`codec`] | stowd's codec, with Python objects in and out |
//! | [`channel`] | `_core.Channel`: the descriptor channel, its messages and their descriptors |
//! | [`segments`] | `_core.Segments`: mappings of stowd's segments, shared read-only or private |
//! | [`receive`] | a reply's frame 0 as a layout, its data frames read straight into place |
//! | [`message`] | whole messages: a request written (gathered `writev`), a reply read whole, pipelining |
//! | [`source`] | a caller's array as the bytes a put sends: strided blocks, big-endian swapped |
//! | [`ndarray`] | a numpy array read from its own fields, its layout checked once against the buffer protocol |
//! | [`stream`] | the socket reader and writer: a deadline-bound stream with a read-ahead buffer |
//! | [`wait`] | waiting for the socket: a short spin, then `poll` |
//! | [`indexes`] | index inputs, for `codec` and `fast` |
//! | [`buffer`] | the buffer protocol both ways: a caller's buffer held, `_core.Buffer` handed out |
//! | [`pool`] | the receive buffers, reused from one get to the next |
//! | [`error`] | why a call failed, and the Python exception it raises |
//!
//! `DTYPES` is the dtype table stowd's codecs read (`stowage-plan`'s,
//! through `stowage-wire`), as `(name, itemsize, aliases)` tuples in table
//! order: the client's tests check `_dtypes.py` against it.

use pyo3::prelude::*;

mod assemble;
mod buffer;
mod channel;
mod codec;
mod connection;
mod error;
mod fast;
mod get;
mod get_into;
mod indexes;
mod message;
mod ndarray;
mod pool;
mod put;
mod receive;
mod same_node;
mod segments;
mod source;
mod stream;
mod wait;

/// Frees the buffers kept for reuse by later gets (`pool`); the bytes freed.
#[pyfunction]
fn release_receive_buffers() -> usize {
    pool::release()
}

/// Whether a put reads numpy arrays from their own fields rather than
/// through the buffer protocol (`ndarray::ndarray_layout_ok`: this numpy's
/// layout checked once).
#[pyfunction]
fn ndarray_direct(py: Python<'_>) -> bool {
    ndarray::ndarray_layout_ok(py)
}

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

/// The module: `Connection`, and the codec's `encode_request` and
/// `decode_reply`.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<connection::Connection>()?;
    m.add_function(wrap_pyfunction!(codec::encode_request, m)?)?;
    m.add_function(wrap_pyfunction!(codec::decode_reply, m)?)?;
    m.add_class::<buffer::Buffer>()?;
    m.add_class::<indexes::IndexList>()?;
    m.add_function(wrap_pyfunction!(indexes::read_index_list, m)?)?;
    m.add_function(wrap_pyfunction!(indexes::index_layouts, m)?)?;
    m.add_class::<put::Put>()?;
    m.add_function(wrap_pyfunction!(release_receive_buffers, m)?)?;
    m.add_function(wrap_pyfunction!(ndarray_direct, m)?)?;
    m.add_class::<channel::Channel>()?;
    m.add_class::<segments::Segments>()?;
    m.add_class::<assemble::GetOptions>()?;
    m.add_function(wrap_pyfunction!(assemble::decode_get, m)?)?;
    m.add(
        "ProtocolViolation",
        m.py().get_type::<error::ProtocolViolation>(),
    )?;
    m.add("DTYPES", dtype_table())?;
    Ok(())
}
