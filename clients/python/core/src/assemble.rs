//! A get's result, every field kind, made here for the Python client:
//! [`Assembled`], where each field's arrays lie (computed with the GIL
//! released), then made into Python objects ([`Assembled::into_py`]).
//!
//! | field | result |
//! |---|---|
//! | regular | a numpy array `[n, ...]` |
//! | nested | a list of n numpy arrays (views of one buffer) |
//! | nested, packed (`GetOptions.packed`) | `Packed(values, shapes)`: one 1-D array of every row's elements, and the rows' shapes |
//! | values | a list of n Python values |
//!
//! An array's bytes lie in a [`Base`]: a buffer of this client's own (the
//! field's rows as the core received them, or a gather), handed to Python
//! as a read-only [`Buffer`]; a segment's shared read-only mapping
//! ([`SharedPages`]); or a private copy-on-write mapping of one
//! ([`PrivatePages`], for tensors). numpy arrays over the first two are
//! read-only: a write raises ValueError.
//!
//! The dtypes numpy has no type for (bfloat16, complex32, the float8s,
//! float4) come as unsigned ints of their itemsize (the `dtypes` table the
//! client passes says which numpy dtype each wire dtype is); the fields
//! whose dtype is one of these, or becomes a tensor, are listed beside the
//! result for the client's Python glue (torch, ml_dtypes).

use std::collections::HashSet;
use std::sync::Arc;

use memmap2::MmapMut;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use stowage_wire::batch::Value;
use stowage_wire::native::FieldLayout;
use stowage_wire::tensor::Dtype;

use crate::buffer::Buffer;
use crate::error::Fail;
use crate::segments::{Mapping, PrivatePages, SharedPages};

/// The dtypes numpy has no type for, carried as raw bits (`_dtypes.BITS_DTYPES`).
pub(crate) const RAW_BITS: [&str; 8] = [
    "bfloat16",
    "complex32",
    "float8_e4m3fn",
    "float8_e4m3fnuz",
    "float8_e5m2",
    "float8_e5m2fnuz",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
];

/// How a get's result is made (`_core.GetOptions(dtypes, tensors, packed)`):
/// `dtypes` maps each wire dtype name to its numpy dtype; `tensors` names
/// the dtypes whose fields become torch tensors (same node: over private
/// copy-on-write mappings); `packed` is the `Packed` class to make nested
/// fields as, or None for a list of rows.
#[pyclass(module = "stowage._core", frozen)]
pub(crate) struct GetOptions {
    dtypes: Py<PyDict>,
    tensors: HashSet<String>,
    packed: Option<Py<PyAny>>,
}

#[pymethods]
impl GetOptions {
    #[new]
    fn new(
        dtypes: Bound<'_, PyDict>,
        tensors: Vec<String>,
        packed: Option<Bound<'_, PyAny>>,
    ) -> GetOptions {
        GetOptions {
            dtypes: dtypes.unbind(),
            tensors: tensors.into_iter().collect(),
            packed: packed.map(Bound::unbind),
        }
    }
}

impl GetOptions {
    /// Whether fields of `dtype` become tensors.
    pub(crate) fn tensor(&self, dtype: Dtype) -> bool {
        self.tensors.contains(dtype.name())
    }

    /// Whether nested fields come packed.
    pub(crate) fn packed(&self) -> bool {
        self.packed.is_some()
    }

    /// Whether a field of `dtype` needs the client's Python glue.
    fn glue(&self, dtype: Dtype) -> bool {
        self.tensor(dtype) || RAW_BITS.contains(&dtype.name())
    }
}

/// Where some of a result's bytes lie.
pub(crate) enum Base {
    /// This client's own bytes (read-only to numpy).
    Owned(Vec<u8>),
    /// A segment's shared read-only mapping.
    Shared(Arc<Mapping>),
    /// A private copy-on-write mapping of a segment (writable).
    Private(MmapMut),
}

/// An array's place: `at` bytes into base number `base` ([`NOWHERE`]: an
/// array of no bytes, made empty).
#[derive(Clone, Copy)]
pub(crate) struct Place {
    pub(crate) base: usize,
    pub(crate) at: usize,
}

/// The place of an array of no bytes.
pub(crate) const NOWHERE: Place = Place {
    base: usize::MAX,
    at: 0,
};

/// One field's result.
pub(crate) enum Made {
    /// An array of `shape`.
    Array(Place, Vec<u64>),
    /// One array per row: (place, shape).
    Rows(Vec<(Place, Vec<u64>)>),
    /// `Packed`: `elements` elements from the place, and each row's shape.
    Packed(Place, u64, Vec<Vec<u64>>),
    Values(Vec<Value>),
}

/// A get's result before it becomes Python objects: the bases, and each
/// field's result (its dtype: None for values), in reply order.
pub(crate) struct Assembled {
    pub(crate) bases: Vec<Base>,
    pub(crate) fields: Vec<(String, Option<Dtype>, Made)>,
}

/// A list of names as Python writes it (the client's words).
fn py_names<S: AsRef<str>>(names: &[S]) -> String {
    let items: Vec<String> = names.iter().map(|n| format!("'{}'", n.as_ref())).collect();
    format!("[{}]", items.join(", "))
}

/// Checks a get_ok against the request: the fields asked for, in order,
/// each of `n` rows.
pub(crate) fn check_request(
    fields: &[(String, FieldLayout)],
    names: &[String],
    n: u64,
) -> Result<(), Fail> {
    if fields.len() != names.len() || fields.iter().zip(names).any(|((a, _), b)| a != b) {
        let got: Vec<&str> = fields.iter().map(|(n, _)| n.as_str()).collect();
        return Err(Fail::Protocol(format!(
            "get_ok has fields {}, requested {}",
            py_names(&got),
            py_names(names)
        )));
    }
    for (name, f) in fields {
        let bad = match f {
            FieldLayout::Regular { shape, .. } if shape[0] != n => {
                format!("shape {shape:?} does not have {n} rows")
            }
            FieldLayout::Nested { rows, .. } if rows.len() as u64 != n => {
                format!("nested descriptor without {n} rows")
            }
            FieldLayout::Values(v) if v.len() as u64 != n => {
                format!("values descriptor without {n} values")
            }
            _ => continue,
        };
        return Err(Fail::Protocol(format!("field '{name}': {bad}")));
    }
    Ok(())
}

/// The shapes of a nested field's rows.
pub(crate) fn row_shapes(f: &FieldLayout) -> Vec<Vec<u64>> {
    match f {
        FieldLayout::Nested { rows, .. } => rows.iter().map(|r| r.shape.clone()).collect(),
        _ => Vec::new(),
    }
}

impl Assembled {
    /// The result of a reply whose fields' rows were received each into a
    /// buffer of its own, rows back to back in row order (`buffers`: one
    /// per regular or nested field, in order).
    pub(crate) fn from_received(
        fields: Vec<(String, FieldLayout)>,
        buffers: Vec<Vec<u8>>,
        opts: &GetOptions,
    ) -> Assembled {
        let mut bases = Vec::with_capacity(buffers.len());
        let mut buffers = buffers.into_iter();
        let mut out = Vec::with_capacity(fields.len());
        for (name, f) in fields {
            if let FieldLayout::Values(v) = f {
                out.push((name, None, Made::Values(v)));
                continue;
            }
            let buf = buffers
                .next()
                .expect("a buffer per regular or nested field");
            let place = if buf.is_empty() {
                NOWHERE
            } else {
                bases.push(Base::Owned(buf));
                Place {
                    base: bases.len() - 1,
                    at: 0,
                }
            };
            let made = match f {
                FieldLayout::Regular { dtype, shape, .. } => (dtype, Made::Array(place, shape)),
                FieldLayout::Nested { dtype, rows } if opts.packed() => {
                    let total: u64 = rows.iter().map(|r| r.len).sum();
                    let shapes = rows.into_iter().map(|r| r.shape).collect();
                    let elements = total / dtype.itemsize() as u64;
                    (dtype, Made::Packed(place, elements, shapes))
                }
                FieldLayout::Nested { dtype, rows } => {
                    let mut at = 0usize;
                    let rows = rows
                        .into_iter()
                        .map(|r| {
                            let p = if r.len == 0 {
                                NOWHERE
                            } else {
                                Place {
                                    base: place.base,
                                    at,
                                }
                            };
                            at += r.len as usize;
                            (p, r.shape)
                        })
                        .collect();
                    (dtype, Made::Rows(rows))
                }
                FieldLayout::Values(_) => unreachable!("values are made above"),
            };
            out.push((name, Some(made.0), made.1));
        }
        Assembled { bases, fields: out }
    }

    /// The Python result: (a dict of field name to its result, in reply
    /// order; a list of `(field, dtype name)` of the fields the client's
    /// glue turns into tensors or typed arrays).
    pub(crate) fn into_py<'py>(
        self,
        py: Python<'py>,
        opts: &GetOptions,
    ) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyList>)> {
        let ndarray = ndarray_type(py)?;
        let bases = self
            .bases
            .into_iter()
            .map(|b| {
                Ok(match b {
                    Base::Owned(data) => Bound::new(py, Buffer { data })?.into_any(),
                    Base::Shared(map) => Bound::new(py, SharedPages { map })?.into_any(),
                    Base::Private(map) => Bound::new(py, PrivatePages::new(map))?.into_any(),
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let out = PyDict::new(py);
        let glue = PyList::empty(py);
        let dtypes = opts.dtypes.bind(py);
        for (name, dtype, made) in self.fields {
            let Some(dtype) = dtype else {
                let Made::Values(values) = made else {
                    unreachable!("a field without a dtype holds values")
                };
                let values = values
                    .iter()
                    .map(|v| crate::codec::value(py, v))
                    .collect::<PyResult<Vec<_>>>()?;
                out.set_item(name, PyList::new(py, values)?)?;
                continue;
            };
            let dt = dtypes.get_item(dtype.name())?.ok_or_else(|| {
                PyValueError::new_err(format!("no numpy dtype given for {}", dtype.name()))
            })?;
            let array = |place: Place, shape: &[u64]| -> PyResult<Bound<'py, PyAny>> {
                let shape = PyTuple::new(py, shape)?;
                if place.base == usize::MAX {
                    // (no bytes: a new empty array, read-only)
                    let a = ndarray.call1((shape, &dt))?;
                    a.getattr("flags")?.setattr("writeable", false)?;
                    return Ok(a);
                }
                ndarray.call1((shape, &dt, &bases[place.base], place.at))
            };
            let value = match made {
                Made::Array(place, shape) => array(place, &shape)?,
                Made::Rows(rows) => {
                    let rows = rows
                        .iter()
                        .map(|(place, shape)| array(*place, shape))
                        .collect::<PyResult<Vec<_>>>()?;
                    PyList::new(py, rows)?.into_any()
                }
                Made::Packed(place, elements, shapes) => {
                    let values = array(place, &[elements])?;
                    let shapes = shapes
                        .iter()
                        .map(|s| PyTuple::new(py, s))
                        .collect::<PyResult<Vec<_>>>()?;
                    let class = opts.packed.as_ref().expect("packed fields with a class");
                    class.bind(py).call1((values, PyList::new(py, shapes)?))?
                }
                Made::Values(_) => unreachable!("values have no dtype"),
            };
            if opts.glue(dtype) {
                glue.append((&name, dtype.name()))?;
            }
            out.set_item(name, value)?;
        }
        Ok((out, glue))
    }
}

/// `numpy.ndarray`.
pub(crate) fn ndarray_type(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    static NDARRAY: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();
    NDARRAY
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(py.import("numpy")?.getattr("ndarray")?.unbind())
        })
        .map(|t| t.bind(py).clone())
}
