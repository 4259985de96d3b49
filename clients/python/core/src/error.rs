//! Why a call failed ([`Fail`]), and what Python sees of it: a
//! `TimeoutError`, a `ConnectionError`, a `ValueError` or `TypeError` for a
//! reply that does not fit the caller's arrays, or [`ProtocolViolation`]
//! for a reply that breaks stowage/1 or ZMTP.

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
