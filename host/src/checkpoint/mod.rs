//! Unit checkpoints on disk: what a TransferQueue `SAVE_STORAGE_CHECKPOINT`
//! writes and `LOAD_STORAGE_CHECKPOINT` reads back (issue 16, first part).
//!
//! **Format: one [safetensors] file per unit.** Hugging Face's format is a
//! JSON header and the raw bytes of each tensor, written and read here by
//! its own crate, and read as well by torch, numpy, JAX and most model
//! tooling (`safetensors.torch.load_file(path)` gives every stored row of a
//! checkpoint as a tensor, checked by the opt-in TransferQueue suite;
//! `safetensors.numpy` too, but for bfloat16, which numpy lacks). Arrow IPC would have meant one record batch per
//! field and its much larger crates for a format no consumer of these rows
//! reads natively.
//!
//! - Each tensor is named by its position in the file's entry list (`"0"`,
//!   `"1"`, ...) and holds a run of stored rows of one field
//!   ([`crate::store::Stored`]): consecutive rows of one stored column as
//!   one tensor `[rows, ...]` (kind `rows`, at most
//!   [`crate::store::RUN_BYTES`]: a put of a million rows is a few
//!   tensors, not a million), or one nested row (`tensor`) or plain value
//!   (`str`, `bytes`, `msgpack`). Tensors keep their dtype and shape where
//!   safetensors has the dtype; the others (`complex128`, `complex32`,
//!   `float4_e2m1fn_x2`), and plain values, are `U8` tensors of their
//!   bytes. Rows stored strided (a unit's share of a put spread over
//!   units) are gathered one run at a time as they are written.
//! - The header's `__metadata__` holds one key, `stowage`: a JSON object
//!   with `format` ([`FORMAT`]), the unit id, `entries` (per tensor:
//!   `[field, kind, dtype, shape, global indexes]`) and `sha256`, the
//!   SHA-256 of every entry's bytes in entry order (left out in a
//!   checkpoint directory's files, whose manifest holds each whole file's).
//!   A load verifies it in one hashing pass before anything is replaced,
//!   and refuses a file whose bytes differ, naming the file.
//! - A save writes `.<name>.<pid>.<n>.tmp` beside `path`, fsyncs it, renames
//!   it over `path` and fsyncs the directory: a crash mid-save leaves the
//!   previous file (or none), never half of one.
//!
//! The snapshot is the unit's rows at the moment the save takes the unit's
//! lock ([`Unit::snapshot`]: the cells share the stored extents, nothing is
//! copied until the file is written); puts and gets go on meanwhile. A load
//! replaces the unit's rows as a whole, as TransferQueue's unit does
//! (`Unit::replace_with`: a clear, then one put per field, each run a column), after the file
//! was read and verified; a put that races a load may be cleared by it.
//!
//! [safetensors]: https://github.com/huggingface/safetensors

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use safetensors::{Dtype as StDtype, SafeTensors, View};
use sha2::{Digest, Sha256};

use crate::batch::{Cell, Value};
use crate::store::{Snapshot, StoreError, Stored, Unit, add_rows};
use crate::tensor::{DType, Tensor};

/// The `format` of the files this module writes and reads.
pub const FORMAT: &str = "stowage-unit-checkpoint/2";

pub mod dir;

/// Why a checkpoint could not be written or read. Nothing was changed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: not a safetensors file: {reason}")]
    NotSafetensors { path: PathBuf, reason: String },
    #[error("{path}: not a stowd unit checkpoint: {reason}")]
    NotStowage { path: PathBuf, reason: String },
    #[error(
        "{path}: checksum mismatch: the file's bytes are not those that were saved (sha256 {found}, saved {saved})"
    )]
    Checksum {
        path: PathBuf,
        saved: String,
        found: String,
    },
    #[error("{path}: {source}")]
    Store { path: PathBuf, source: StoreError },
    #[error("{path}: {reason}")]
    Refused { path: PathBuf, reason: String },
}

/// One entry of the file: `[field, kind, dtype, shape, global indexes]`.
#[derive(serde::Serialize, serde::Deserialize)]
struct Entry(String, String, String, Vec<u64>, Vec<u64>);

#[derive(serde::Serialize, serde::Deserialize)]
struct Header {
    format: String,
    unit: String,
    entries: Vec<Entry>,
    /// SHA-256 of every entry's bytes in entry order; absent in the unit
    /// files of a checkpoint directory, whose manifest has the whole file's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    sha256: Option<String>,
}

/// One entry's bytes, as safetensors sees them.
struct Data {
    dtype: StDtype,
    shape: Vec<usize>,
    /// The rows: contiguous bytes, or a strided view gathered when written.
    rows: Tensor,
}

impl Data {
    /// Calls `f` with the bytes of each row in order (all of them at once
    /// when contiguous): no copy.
    fn for_each_row(&self, mut f: impl FnMut(&[u8])) {
        let t = &self.rows;
        if t.is_contiguous() {
            return f(t.buffer());
        }
        let (stride, len) = (t.row_stride(), t.row_bytes());
        let bytes = t.buffer();
        for i in 0..t.rows() as usize {
            f(&bytes[i * stride..i * stride + len]);
        }
    }
}

impl View for &Data {
    fn dtype(&self) -> StDtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        if self.rows.is_contiguous() {
            Cow::Borrowed(self.rows.buffer().as_ref())
        } else {
            // One copy of the run (at most RUN_BYTES), written and dropped.
            let mut out = Vec::with_capacity(self.rows.payload_len());
            self.for_each_row(|row| out.extend_from_slice(row));
            Cow::Owned(out)
        }
    }
    fn data_len(&self) -> usize {
        self.rows.payload_len()
    }
}

/// The safetensors dtype of a stored dtype, where it has one.
fn st_dtype(d: DType) -> Option<StDtype> {
    Some(match d {
        DType::Bool => StDtype::BOOL,
        DType::U8 => StDtype::U8,
        DType::I8 => StDtype::I8,
        DType::I16 => StDtype::I16,
        DType::U16 => StDtype::U16,
        DType::I32 => StDtype::I32,
        DType::U32 => StDtype::U32,
        DType::I64 => StDtype::I64,
        DType::U64 => StDtype::U64,
        DType::F16 => StDtype::F16,
        DType::BF16 => StDtype::BF16,
        DType::F32 => StDtype::F32,
        DType::F64 => StDtype::F64,
        DType::Complex64 => StDtype::C64,
        DType::F8E4M3Fn => StDtype::F8_E4M3,
        DType::F8E5M2 => StDtype::F8_E5M2,
        DType::F8E4M3Fnuz => StDtype::F8_E4M3FNUZ,
        DType::F8E5M2Fnuz => StDtype::F8_E5M2FNUZ,
        DType::F8E8M0Fnu => StDtype::F8_E8M0,
        DType::Complex128 | DType::Complex32 | DType::F4E2M1FnX2 => return None,
    })
}

pub(crate) fn io(path: &Path) -> impl Fn(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Rows written, and their bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Saved {
    pub rows: u64,
    pub bytes: u64,
}

/// Writes every row of `units` (one unit's, or a router's local units',
/// whose global indexes are distinct across them) to `path`, as one file
/// naming `id` (see the module docs).
pub fn save_units(id: &str, units: &[&Unit], path: &Path) -> Result<Saved, CheckpointError> {
    if let [unit] = units {
        return save_snapshot(id, &unit.snapshot(), path, true);
    }
    let mut merged: Snapshot = Vec::new();
    for unit in units {
        for (field, stored) in unit.snapshot() {
            add_rows(&mut merged, &field, stored);
        }
    }
    for (_, stored) in &mut merged {
        stored.sort_unstable_by_key(|s| s.indexes()[0]);
    }
    save_snapshot(id, &merged, path, true)
}

/// An entry and its data for one run of stored rows.
fn entry(field: &str, stored: &Stored) -> (Entry, Data) {
    let indexes = stored.indexes().to_vec();
    let (kind, rows) = match stored {
        Stored::Rows { tensor, .. } => ("rows", tensor.clone()),
        Stored::One { cell, .. } => match cell {
            Cell::Tensor(t) => ("tensor", t.clone()),
            Cell::Value(v) => {
                let (kind, bytes) = match v {
                    Value::Str(s) => ("str", Bytes::copy_from_slice(s.as_bytes())),
                    Value::Bytes(b) => ("bytes", b.clone()),
                    Value::Msgpack(b) => ("msgpack", b.clone()),
                };
                let n = bytes.len() as u64;
                let t = Tensor::contiguous(bytes, DType::U8, vec![n]).expect("bytes as u8");
                (kind, t)
            }
        },
    };
    let native = match kind {
        "rows" | "tensor" => st_dtype(rows.dtype()),
        _ => None,
    };
    let (dtype, shape) = match native {
        Some(d) => (d, rows.shape().iter().map(|&s| s as usize).collect()),
        None => (StDtype::U8, vec![rows.payload_len()]),
    };
    let e = Entry(
        field.to_string(),
        kind.into(),
        rows.dtype().name().into(),
        rows.shape().to_vec(),
        indexes,
    );
    (e, Data { dtype, shape, rows })
}

/// Writes `snapshot` to `path` as a unit file naming `id`; `entry_hash`:
/// with the SHA-256 of the entries' bytes in the header (one more pass
/// over them; a checkpoint directory's manifest holds the whole file's
/// instead).
pub(crate) fn save_snapshot(
    id: &str,
    snapshot: &Snapshot,
    path: &Path,
    entry_hash: bool,
) -> Result<Saved, CheckpointError> {
    let mut entries = Vec::new();
    let mut data = Vec::new();
    let mut hash = Sha256::new();
    let mut saved = Saved { rows: 0, bytes: 0 };
    for (field, stored) in snapshot {
        for s in stored {
            let (e, d) = entry(field, s);
            if entry_hash {
                d.for_each_row(|row| hash.update(row));
            }
            saved.rows += e.4.len() as u64;
            saved.bytes += d.rows.payload_len() as u64;
            entries.push(e);
            data.push(d);
        }
    }
    let header = Header {
        format: FORMAT.into(),
        unit: id.into(),
        entries,
        sha256: entry_hash.then(|| hex(&hash.finalize())),
    };
    let json = serde_json::to_string(&header).map_err(|e| CheckpointError::NotStowage {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let metadata = HashMap::from([("stowage".to_string(), json)]);
    let tmp = temp_beside(path);
    let named = data.iter().enumerate().map(|(i, r)| (i.to_string(), r));
    let written = safetensors::serialize_to_file(named, Some(metadata), &tmp);
    let result = written
        .map_err(|e| CheckpointError::NotSafetensors {
            path: tmp.clone(),
            reason: e.to_string(),
        })
        .and_then(|()| {
            dir::private(&tmp)
                .and_then(|()| std::fs::File::open(&tmp))
                .and_then(|f| f.sync_all())
                .map_err(io(&tmp))
        })
        .and_then(|()| std::fs::rename(&tmp, path).map_err(io(path)));
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io(dir))?;
    }
    Ok(saved)
}

/// A fresh temporary name beside `path`.
fn temp_beside(path: &Path) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let n = N.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.{}.{n}.tmp", std::process::id()))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Reads and verifies `path`, then replaces the rows of every unit in
/// `units` with those of the file that `route` sends to it (a router's
/// `g % N`). Nothing changes unless the whole file was read and verified
/// and every unit's part fits its capacity. Returns the rows loaded.
pub fn load_units(
    units: &[&Unit],
    route: impl Fn(u64) -> usize,
    path: &Path,
) -> Result<u64, CheckpointError> {
    let file = read(path)?;
    let mut parts: Vec<Snapshot> = units.iter().map(|_| Vec::new()).collect();
    let rows = split(file, &mut parts, |g| Some(route(g)));
    replace(units, parts, path, false)?;
    Ok(rows)
}

/// Adds the rows of a file to `parts`, split by unit (`to(g)`; None:
/// dropped); returns how many rows were kept.
pub(crate) fn split(
    file: Snapshot,
    parts: &mut [Snapshot],
    to: impl Fn(u64) -> Option<usize>,
) -> u64 {
    let mut rows = 0u64;
    for (field, stored) in file {
        for s in stored {
            for (u, part) in s.split(&to) {
                rows += part.indexes().len() as u64;
                add_rows(&mut parts[u], &field, [part]);
            }
        }
    }
    rows
}

/// Checks every unit's part, then replaces each unit's rows with it.
pub(crate) fn replace(
    units: &[&Unit],
    parts: Vec<Snapshot>,
    path: &Path,
    mapped: bool,
) -> Result<(), CheckpointError> {
    let store = |source| CheckpointError::Store {
        path: path.to_path_buf(),
        source,
    };
    for (unit, part) in units.iter().zip(&parts) {
        unit.check_replace(part).map_err(store)?;
    }
    for (unit, part) in units.iter().zip(parts) {
        unit.replace_with(part, mapped).map_err(store)?;
    }
    Ok(())
}

/// The rows of a checkpoint file, by field, verified against its checksum.
pub fn read(path: &Path) -> Result<Snapshot, CheckpointError> {
    let file = Bytes::from(std::fs::read(path).map_err(io(path))?);
    parse(file, path, true)
}

/// The rows of the checkpoint file whose bytes are `file` (read from
/// `path`), as slices of `file`. `verify`: check the entries' checksum
/// (one hashing pass); a caller that verified the whole file passes false.
fn parse(file: Bytes, path: &Path, verify: bool) -> Result<Snapshot, CheckpointError> {
    let not_st = |reason: String| CheckpointError::NotSafetensors {
        path: path.to_path_buf(),
        reason,
    };
    let not_ours = |reason: String| CheckpointError::NotStowage {
        path: path.to_path_buf(),
        reason,
    };
    let st = SafeTensors::deserialize(&file).map_err(|e| not_st(e.to_string()))?;
    let (_, metadata) = SafeTensors::read_metadata(&file).map_err(|e| not_st(e.to_string()))?;
    let json = metadata
        .metadata()
        .as_ref()
        .and_then(|m| m.get("stowage"))
        .ok_or_else(|| not_ours("no \"stowage\" metadata".into()))?;
    let header: Header = serde_json::from_str(json).map_err(|e| not_ours(e.to_string()))?;
    if header.format != FORMAT {
        return Err(not_ours(format!(
            "format {:?}, this stowd reads {FORMAT:?}",
            header.format
        )));
    }
    if verify && header.sha256.is_none() {
        return Err(not_ours(
            "the file carries no checksum of its own (a checkpoint directory's unit file: \
             restore its directory instead)"
                .into(),
        ));
    }
    let mut hash = Sha256::new();
    let mut by_field: Snapshot = Vec::new();
    for (i, Entry(field, kind, dtype, shape, indexes)) in header.entries.into_iter().enumerate() {
        let bad = |reason: String| not_ours(format!("entry {i}: {reason}"));
        let view = st.tensor(&i.to_string()).map_err(|e| bad(e.to_string()))?;
        let data = view.data();
        if verify {
            hash.update(data);
        }
        // A slice of the file's buffer: nothing is copied.
        let offset = data.as_ptr() as usize - file.as_ptr() as usize;
        let bytes = file.slice(offset..offset + data.len());
        let d = DType::from_name(&dtype).ok_or_else(|| bad(format!("unknown dtype {dtype:?}")))?;
        let one = |indexes: &[u64]| match indexes {
            [g] => Ok(*g),
            other => Err(bad(format!("{} indexes for one row", other.len()))),
        };
        let stored = match kind.as_str() {
            "rows" => {
                if shape.first() != Some(&(indexes.len() as u64)) {
                    return Err(bad(format!(
                        "shape {shape:?} for {} indexes",
                        indexes.len()
                    )));
                }
                let tensor = Tensor::contiguous(bytes, d, shape).map_err(|e| bad(e.to_string()))?;
                Stored::Rows { indexes, tensor }
            }
            "tensor" => {
                let t = Tensor::contiguous(bytes, d, shape).map_err(|e| bad(e.to_string()))?;
                Stored::One {
                    index: one(&indexes)?,
                    cell: Cell::Tensor(t),
                }
            }
            "str" => {
                let s = String::from_utf8(bytes.to_vec()).map_err(|e| bad(e.to_string()))?;
                Stored::One {
                    index: one(&indexes)?,
                    cell: Cell::Value(Value::Str(s)),
                }
            }
            "bytes" => Stored::One {
                index: one(&indexes)?,
                cell: Cell::Value(Value::Bytes(bytes)),
            },
            "msgpack" => Stored::One {
                index: one(&indexes)?,
                cell: Cell::Value(Value::Msgpack(bytes)),
            },
            other => return Err(bad(format!("unknown kind {other:?}"))),
        };
        add_rows(&mut by_field, &field, [stored]);
    }
    if verify {
        let found = hex(&hash.finalize());
        let saved = header.sha256.unwrap_or_default();
        if found != saved {
            return Err(CheckpointError::Checksum {
                path: path.to_path_buf(),
                saved,
                found,
            });
        }
    }
    for (_, stored) in &by_field {
        let all: Vec<u64> = stored
            .iter()
            .flat_map(|s| s.indexes().iter().copied())
            .collect();
        if let Some(g) = crate::store::duplicate(&all) {
            return Err(not_ours(format!(
                "global index {g} appears twice in one field"
            )));
        }
    }
    Ok(by_field)
}
