//! Why a call failed ([`Fail`]), and what Python sees of it: a
//! `TimeoutError`, a `ConnectionError`, a `ValueError` or `TypeError` for a
//! reply that does not fit the caller's arrays, [`ProtocolViolation`]
//! for a reply that breaks stowage/1 or ZMTP, or what a signal handler
//! raised while the call waited ([`interrupted`]).

use pyo3::PyErr;
use pyo3::exceptions::{PyConnectionError, PyTimeoutError, PyTypeError, PyValueError};

pyo3::create_exception!(
    _core,
    ProtocolViolation,
    pyo3::exceptions::PyException,
    "The reply breaks stowage/1 or ZMTP (a connection it came on was dropped)."
);

/// Why a call failed.
pub(crate) enum Fail {
    Timeout(String),
    Io(String),
    Protocol(String),
    /// The reply does not fit the caller's arrays (nothing was written).
    Mismatch(String),
    /// A field of plain values asked into an array (nothing was written).
    NotTensors(String),
    /// What a Python signal handler raised while the call waited
    /// (`KeyboardInterrupt` on Ctrl-C): see [`interrupted`].
    Signal(PyErr),
}

impl From<Fail> for PyErr {
    fn from(f: Fail) -> PyErr {
        match f {
            Fail::Timeout(m) => PyTimeoutError::new_err(m),
            Fail::Io(m) => PyConnectionError::new_err(m),
            Fail::Protocol(m) => ProtocolViolation::new_err(m),
            Fail::Mismatch(m) => PyValueError::new_err(m),
            Fail::NotTensors(m) => PyTypeError::new_err(m),
            Fail::Signal(e) => e,
        }
    }
}

/// Called when a signal interrupted a system call the call waits in: runs
/// Python's signal handlers (attaching to the interpreter for it), and an
/// exception one raises ends the call ([`Fail::Signal`]; its connection is
/// dropped, as for any failure). So Ctrl-C stops a call waiting for its
/// reply at once, as it stops `time.sleep`, where the wait used to go on
/// to the call's timeout. A handler that returns lets the wait go on;
/// handlers run only on the main thread, so elsewhere this does nothing.
pub(crate) fn interrupted() -> Result<(), Fail> {
    // SAFETY: reads whether the interpreter is running (it is whenever
    // Python called the core; a Rust test may run without one).
    if unsafe { pyo3::ffi::Py_IsInitialized() } == 0 {
        return Ok(());
    }
    pyo3::Python::attach(|py| py.check_signals()).map_err(Fail::Signal)
}
