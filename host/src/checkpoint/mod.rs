//! Unit checkpoints on disk: what a TransferQueue `SAVE_STORAGE_CHECKPOINT`
//! writes and `LOAD_STORAGE_CHECKPOINT` reads back (issue 16, first part).
//!
//! **Format: one [safetensors] file per unit.** Hugging Face's format is a
//! JSON header and the raw bytes of each tensor, read as well by torch,
//! numpy, JAX and most model tooling (`safetensors.torch.load_file(path)`
//! gives every stored row of a checkpoint as a tensor, checked by the
//! opt-in TransferQueue suite; `safetensors.numpy` too, but for bfloat16,
//! which numpy lacks). Arrow IPC would have meant one record batch per
//! field and its much larger crates for a format no consumer of these rows
//! reads natively. The header is the crate's own [`Metadata`] (which
//! checks the offsets, dtypes and shapes, and writes the JSON); the bytes
//! are written and read here, because the crate's `serialize_to_file` and
//! `deserialize` take a path and a whole file in memory, where a
//! checkpoint is written through its directory's descriptor
//! ([`confine`]) and a load reads a file in a stream.
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
//!   units) are written one row at a time, never gathered into a copy.
//! - The header's `__metadata__` holds one key, `stowage`: a JSON object
//!   with `format` ([`FORMAT`]), the unit id, `entries` (per tensor:
//!   `[field, kind, dtype, shape, global indexes]`) and `sha256`, the
//!   SHA-256 of every entry's bytes in entry order (left out in a
//!   checkpoint directory's files, whose manifest holds each whole file's).
//! - A save writes a temporary file (`O_EXCL`, through the directory's
//!   descriptor), fsyncs it, renames it over the file and fsyncs the
//!   directory: a crash mid-save leaves the previous file (or none), never
//!   half of one.
//!
//! **A load reads a file it cannot trust.** The path must lie under
//! `[checkpoint] roots` ([`confine`]); the file is opened without
//! following links and must be a regular file of `stowd`'s user. Its
//! header (at most 100 MB, the crate's bound) is read and every entry
//! checked against its tensor; the bytes each unit would hold are checked
//! against its capacity (and the spill room) **before any row is read**;
//! then the rows are read in a stream, each entry into a buffer of its own
//! size, and the checksum verified. Only then is anything replaced: every
//! unit's new rows are made ready, the change is journaled, and each unit
//! takes its new rows at once ([`Unit::commit`]). A refused load leaves
//! every unit as it was.
//!
//! The snapshot is the unit's rows at the moment the save takes the unit's
//! lock ([`Unit::snapshot`]: the cells share the stored extents, nothing is
//! copied until the file is written); puts and gets go on meanwhile. A load
//! replaces the unit's rows as a whole, as TransferQueue's unit does.
//!
//! [safetensors]: https://github.com/huggingface/safetensors

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use safetensors::Dtype as StDtype;
use safetensors::tensor::{Metadata, TensorInfo};
use sha2::{Digest, Sha256};

use crate::batch::{Cell, Value};
use crate::journal::Journal;
use crate::store::{Snapshot, StoreError, Stored, Unit, add_rows};
use crate::tensor::{Dtype, Tensor};

/// The `format` of the files this module writes and reads.
pub const FORMAT: &str = "stowage-unit-checkpoint/2";

pub mod confine;
pub mod dir;

pub use confine::{Dir, Roots};

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

/// The safetensors dtype of a stored dtype, where it has one.
fn st_dtype(d: Dtype) -> Option<StDtype> {
    Some(match d {
        Dtype::Bool => StDtype::BOOL,
        Dtype::Uint8 => StDtype::U8,
        Dtype::Int8 => StDtype::I8,
        Dtype::Int16 => StDtype::I16,
        Dtype::Uint16 => StDtype::U16,
        Dtype::Int32 => StDtype::I32,
        Dtype::Uint32 => StDtype::U32,
        Dtype::Int64 => StDtype::I64,
        Dtype::Uint64 => StDtype::U64,
        Dtype::Float16 => StDtype::F16,
        Dtype::Bfloat16 => StDtype::BF16,
        Dtype::Float32 => StDtype::F32,
        Dtype::Float64 => StDtype::F64,
        Dtype::Complex64 => StDtype::C64,
        Dtype::Float8E4m3fn => StDtype::F8_E4M3,
        Dtype::Float8E5m2 => StDtype::F8_E5M2,
        Dtype::Float8E4m3fnuz => StDtype::F8_E4M3FNUZ,
        Dtype::Float8E5m2fnuz => StDtype::F8_E5M2FNUZ,
        Dtype::Float8E8m0fnu => StDtype::F8_E8M0,
        Dtype::Complex128 | Dtype::Complex32 | Dtype::Float4E2m1fnX2 => return None,
    })
}

fn refused(path: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::Refused {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
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
/// whose global indexes are distinct across them) to the file `name` of
/// `dir`, as one file naming `id` (see the module docs).
pub fn save_units(
    id: &str,
    units: &[&Unit],
    dir: &Dir,
    name: &str,
) -> Result<Saved, CheckpointError> {
    if let [unit] = units {
        return save_snapshot(id, &unit.snapshot(), dir, name, true);
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
    save_snapshot(id, &merged, dir, name, true)
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
                let t = Tensor::contiguous(bytes, Dtype::Uint8, vec![n]).expect("bytes as u8");
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

/// Writes `snapshot` to the file `name` of `dir` as a unit file naming
/// `id`; `entry_hash`: with the SHA-256 of the entries' bytes in the
/// header (one more pass over them; a checkpoint directory's manifest
/// holds the whole file's instead).
pub(crate) fn save_snapshot(
    id: &str,
    snapshot: &Snapshot,
    dir: &Dir,
    name: &str,
    entry_hash: bool,
) -> Result<Saved, CheckpointError> {
    let path = dir.join(name);
    match dir.kind(name) {
        None | Some(rustix::fs::FileType::RegularFile) => {}
        Some(rustix::fs::FileType::Symlink) => {
            return Err(refused(&path, "a symbolic link: not overwritten"));
        }
        Some(other) => {
            return Err(refused(
                &path,
                format!("not a regular file ({other:?}): not overwritten"),
            ));
        }
    }
    let (head, data, saved) = encode(id, snapshot, entry_hash, &path)?;
    let (file, tmp) = dir.temp(name).map_err(io(&path))?;
    let written = write_file(file, &head, &data)
        .and_then(|()| dir.rename(&tmp, name))
        .map_err(io(&path));
    if let Err(e) = written {
        let _ = dir.remove(&tmp);
        return Err(e);
    }
    dir.sync().map_err(io(dir.path()))?;
    Ok(saved)
}

/// The header of the unit file of `snapshot` naming `id` (see
/// [`save_snapshot`]), the entries' data, and what they hold.
fn encode(
    id: &str,
    snapshot: &Snapshot,
    entry_hash: bool,
    path: &Path,
) -> Result<(Vec<u8>, Vec<Data>, Saved), CheckpointError> {
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
    let head = header_bytes(json, &data).map_err(|reason| CheckpointError::NotSafetensors {
        path: path.to_path_buf(),
        reason,
    })?;
    Ok((head, data, saved))
}

/// The bytes [`save_units`] writes for `snapshot` as unit `id` (with the
/// entries' SHA-256), in memory: what [`parse`] reads back as the same
/// rows. For tests and the fuzz target; a save streams to its file instead.
pub fn unit_file_bytes(id: &str, snapshot: &Snapshot) -> Result<Vec<u8>, CheckpointError> {
    let (head, data, _) = encode(id, snapshot, true, Path::new("unit.safetensors"))?;
    let mut out = Vec::new();
    write_data(&mut out, &head, &data).expect("writing to a Vec");
    Ok(out)
}

/// The safetensors header of `data` (in entry order, each tensor named by
/// its position) with `stowage` metadata `json`: its length (8 bytes,
/// little-endian), then the JSON, padded with spaces to a multiple of 8.
/// The crate's own [`Metadata`] checks and writes it.
fn header_bytes(json: String, data: &[Data]) -> Result<Vec<u8>, String> {
    let mut tensors = Vec::with_capacity(data.len());
    let mut offset = 0usize;
    for (i, d) in data.iter().enumerate() {
        let len = d.rows.payload_len();
        tensors.push((
            i.to_string(),
            TensorInfo {
                dtype: d.dtype,
                shape: d.shape.clone(),
                data_offsets: (offset, offset + len),
            },
        ));
        offset += len;
    }
    let metadata = Metadata::new(
        Some(HashMap::from([("stowage".to_string(), json)])),
        tensors,
    )
    .map_err(|e| e.to_string())?;
    let mut head = serde_json::to_vec(&metadata).map_err(|e| e.to_string())?;
    head.resize(head.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + head.len());
    out.extend_from_slice(&(head.len() as u64).to_le_bytes());
    out.extend_from_slice(&head);
    Ok(out)
}

/// Writes a unit file's bytes to `file` and makes them durable.
fn write_file(file: File, head: &[u8], data: &[Data]) -> std::io::Result<()> {
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    write_data(&mut w, head, data)?;
    let file = w.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()
}

/// Writes a unit file's header, then every entry's rows in order.
fn write_data(w: &mut impl Write, head: &[u8], data: &[Data]) -> std::io::Result<()> {
    w.write_all(head)?;
    for d in data {
        let mut result = Ok(());
        d.for_each_row(|row| {
            if result.is_ok() {
                result = w.write_all(row);
            }
        });
        result?;
    }
    Ok(())
}

/// Refuses a file whose entries' SHA-256 (`hash`) is not the one its
/// header says it saved.
fn check_sum(hash: Sha256, saved: String, path: &Path) -> Result<(), CheckpointError> {
    let found = hex(&hash.finalize());
    if found != saved {
        return Err(CheckpointError::Checksum {
            path: path.to_path_buf(),
            saved,
            found,
        });
    }
    Ok(())
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Largest safetensors header read (the crate's own bound).
const MAX_HEADER: u64 = 100_000_000;

/// A unit file's header, checked: the entries and where each one's bytes
/// lie in the data that follows the header.
struct Layout {
    header: Header,
    /// Per entry, in entry order: its bytes in the data section.
    ranges: Vec<Range<usize>>,
    /// Bytes of the data section.
    data_len: usize,
}

/// Reads and checks a unit file's header (`head`: the JSON after the
/// 8-byte length). Every entry is checked against its tensor (kind,
/// dtype, shape, byte length, indexes, no index twice in a field) before
/// any of its bytes are read.
fn layout(head: &[u8], path: &Path) -> Result<Layout, CheckpointError> {
    let not_st = |reason: String| CheckpointError::NotSafetensors {
        path: path.to_path_buf(),
        reason,
    };
    let not_ours = |reason: String| CheckpointError::NotStowage {
        path: path.to_path_buf(),
        reason,
    };
    let metadata: Metadata = serde_json::from_slice(head).map_err(|e| not_st(e.to_string()))?;
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
    let tensors = metadata.tensors().len();
    if tensors != header.entries.len() {
        return Err(not_ours(format!(
            "{tensors} tensors for {} entries",
            header.entries.len()
        )));
    }
    let mut ranges = Vec::with_capacity(tensors);
    let mut by_field: HashMap<&str, Vec<u64>> = HashMap::new();
    for (i, Entry(field, kind, dtype, shape, indexes)) in header.entries.iter().enumerate() {
        let bad = |reason: String| not_ours(format!("entry {i}: {reason}"));
        let info = metadata
            .info(&i.to_string())
            .ok_or_else(|| bad(format!("no tensor named {i:?}")))?;
        let (start, end) = info.data_offsets;
        let len = end - start;
        let d = Dtype::from_name(dtype).ok_or_else(|| bad(format!("unknown dtype {dtype:?}")))?;
        match kind.as_str() {
            "rows" | "tensor" => {
                if kind == "rows"
                    && (indexes.is_empty() || shape.first() != Some(&(indexes.len() as u64)))
                {
                    return Err(bad(format!(
                        "shape {shape:?} for {} indexes",
                        indexes.len()
                    )));
                }
                let want =
                    crate::tensor::contiguous_len(d, shape).map_err(|e| bad(e.to_string()))?;
                if want != len {
                    return Err(bad(format!(
                        "{len} bytes for dtype {dtype} and shape {shape:?} ({want} bytes)"
                    )));
                }
            }
            "str" | "bytes" | "msgpack" => {}
            other => return Err(bad(format!("unknown kind {other:?}"))),
        }
        if kind != "rows" && indexes.len() != 1 {
            return Err(bad(format!("{} indexes for one row", indexes.len())));
        }
        by_field
            .entry(field)
            .or_default()
            .extend_from_slice(indexes);
        ranges.push(start..end);
    }
    for all in by_field.values() {
        if let Some(g) = crate::store::duplicate(all) {
            return Err(not_ours(format!(
                "global index {g} appears twice in one field"
            )));
        }
    }
    Ok(Layout {
        header,
        ranges,
        data_len: metadata.data_len(),
    })
}

/// The stored rows of entry `e`, whose bytes are `bytes` (checked to
/// fit by [`layout`]).
fn stored(
    i: usize,
    e: Entry,
    bytes: Bytes,
    path: &Path,
) -> Result<(String, Stored), CheckpointError> {
    let Entry(field, kind, dtype, shape, indexes) = e;
    let bad = |reason: String| CheckpointError::NotStowage {
        path: path.to_path_buf(),
        reason: format!("entry {i}: {reason}"),
    };
    let d = Dtype::from_name(&dtype).ok_or_else(|| bad(format!("unknown dtype {dtype:?}")))?;
    let index = indexes.first().copied().unwrap_or_default();
    let s = match kind.as_str() {
        "rows" => Stored::Rows {
            indexes,
            tensor: Tensor::contiguous(bytes, d, shape).map_err(|e| bad(e.to_string()))?,
        },
        "tensor" => Stored::One {
            index,
            cell: Cell::Tensor(
                Tensor::contiguous(bytes, d, shape).map_err(|e| bad(e.to_string()))?,
            ),
        },
        "str" => Stored::One {
            index,
            cell: Cell::Value(Value::Str(
                String::from_utf8(bytes.to_vec()).map_err(|e| bad(e.to_string()))?,
            )),
        },
        "bytes" => Stored::One {
            index,
            cell: Cell::Value(Value::Bytes(bytes)),
        },
        "msgpack" => Stored::One {
            index,
            cell: Cell::Value(Value::Msgpack(bytes)),
        },
        other => return Err(bad(format!("unknown kind {other:?}"))),
    };
    Ok((field, s))
}

/// Reads the 8-byte length and the header of a unit file of `size` bytes
/// from `file` (a file, or any reader: left at the start of the data), checked against the size.
fn read_head(file: &mut impl Read, size: u64, path: &Path) -> Result<Layout, CheckpointError> {
    let not_st = |reason: String| CheckpointError::NotSafetensors {
        path: path.to_path_buf(),
        reason,
    };
    let mut n = [0u8; 8];
    if size < 8 {
        return Err(not_st(format!("{size} bytes: too short for a header")));
    }
    file.read_exact(&mut n).map_err(io(path))?;
    let n = u64::from_le_bytes(n);
    if n > MAX_HEADER || n > size - 8 {
        return Err(not_st(format!(
            "a header of {n} bytes in a file of {size} (at most {MAX_HEADER})"
        )));
    }
    let mut head = vec![0u8; n as usize];
    file.read_exact(&mut head).map_err(io(path))?;
    let l = layout(&head, path)?;
    if 8 + n + l.data_len as u64 != size {
        return Err(not_st(format!(
            "the file is {size} bytes, its header describes {}",
            8 + n + l.data_len as u64
        )));
    }
    Ok(l)
}

/// A unit file without the entries' checksum: a checkpoint directory's,
/// which only its manifest verifies.
fn no_checksum(path: &Path) -> CheckpointError {
    CheckpointError::NotStowage {
        path: path.to_path_buf(),
        reason: "the file carries no checksum of its own (a checkpoint directory's unit \
                 file: restore its directory instead)"
            .into(),
    }
}

/// Reads the data of a unit file from `file`, left at its start by
/// [`read_head`]: in file order, each entry into a buffer of its own, then
/// verifies the entries' checksum and makes the rows.
fn read_rows(
    file: &mut impl Read,
    layout: Layout,
    path: &Path,
) -> Result<Snapshot, CheckpointError> {
    let Layout { header, ranges, .. } = layout;
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_unstable_by_key(|&i| ranges[i].start);
    let mut data = vec![Bytes::new(); ranges.len()];
    for i in order {
        let mut buf = vec![0u8; ranges[i].len()];
        file.read_exact(&mut buf).map_err(io(path))?;
        data[i] = Bytes::from(buf);
    }
    let mut hash = Sha256::new();
    for d in &data {
        hash.update(d);
    }
    check_sum(hash, header.sha256.unwrap_or_default(), path)?;
    let mut rows: Snapshot = Vec::new();
    for (i, (e, bytes)) in header.entries.into_iter().zip(data).enumerate() {
        let (field, s) = stored(i, e, bytes, path)?;
        add_rows(&mut rows, &field, [s]);
    }
    Ok(rows)
}

/// The rows of the unit file of `size` bytes that `file` reads (checksum
/// verified), read as a load reads them: the header, then the data in a
/// stream. The same rows as [`parse`] with `verify`, or an error.
pub fn read_unit_file(
    file: &mut impl Read,
    size: u64,
    path: &Path,
) -> Result<Snapshot, CheckpointError> {
    let layout = read_head(file, size, path)?;
    if layout.header.sha256.is_none() {
        return Err(no_checksum(path));
    }
    read_rows(file, layout, path)
}

/// Reads and verifies the file `name` of `dir`, then replaces the rows of
/// every unit in `units` with those of the file that `route` sends to it
/// (a router's `g % N`), journaling every index that changes. The sizes
/// are checked against every unit (capacity, spill room) from the header,
/// before any row is read; the rows are read in a stream, each entry into
/// its own buffer, and hashed. Nothing changes unless the whole file was
/// read and verified and every unit's part fits. Returns the rows loaded.
pub fn load_units(
    units: &[&Unit],
    route: impl Fn(u64) -> usize,
    dir: &Dir,
    name: &str,
    journal: &Journal,
) -> Result<u64, CheckpointError> {
    let path = dir.join(name);
    let (mut file, size) = dir
        .read(name)?
        .ok_or_else(|| refused(&path, "no such file"))?;
    let layout = read_head(&mut file, size, &path)?;
    if layout.header.sha256.is_none() {
        return Err(no_checksum(&path));
    }
    // What each unit would hold, from the header alone.
    let mut sizes = vec![0u64; units.len()];
    for (Entry(_, _, _, _, indexes), r) in layout.header.entries.iter().zip(&layout.ranges) {
        let each = (r.len() / indexes.len().max(1)) as u64;
        for &g in indexes {
            sizes[route(g)] += if indexes.len() == 1 {
                r.len() as u64
            } else {
                each
            };
        }
    }
    for (unit, &bytes) in units.iter().zip(&sizes) {
        unit.check_fits(bytes, false)
            .map_err(|source| CheckpointError::Store {
                path: path.clone(),
                source,
            })?;
    }
    let file_rows = read_rows(&mut file, layout, &path)?;
    drop(file);
    let mut parts: Vec<Snapshot> = units.iter().map(|_| Vec::new()).collect();
    let rows = split(file_rows, &mut parts, |g| Some(route(g)));
    replace(units, parts, &path, false, journal)?;
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

/// Every index a replacement of `units` by `parts` changes: those the
/// units hold now and those the parts hold, sorted, distinct.
pub(crate) fn affected(units: &[&Unit], parts: &[Snapshot]) -> Vec<u64> {
    let mut all: Vec<u64> = units.iter().flat_map(|u| u.indexes()).collect();
    for (_, stored) in parts.iter().flatten() {
        for s in stored {
            all.extend_from_slice(s.indexes());
        }
    }
    all.sort_unstable();
    all.dedup();
    all
}

/// Replaces each unit's rows with its part, all or nothing: every part is
/// made ready first (capacity, spill room), then the change is journaled,
/// then each unit takes its new rows at once.
fn replace(
    units: &[&Unit],
    parts: Vec<Snapshot>,
    path: &Path,
    mapped: bool,
    journal: &Journal,
) -> Result<(), CheckpointError> {
    let store = |source| CheckpointError::Store {
        path: path.to_path_buf(),
        source,
    };
    let touched = affected(units, &parts);
    let mut ready = Vec::with_capacity(units.len());
    for (unit, part) in units.iter().zip(parts) {
        ready.push(unit.prepare(part, mapped).map_err(store)?);
    }
    let _journaled = journal.touch(&touched).map_err(|e| CheckpointError::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    for (unit, r) in units.iter().zip(ready) {
        unit.commit(r);
    }
    Ok(())
}

/// The rows of a unit file whose bytes are all of `file` (a mapping of
/// it, read from `path`), as slices of `file`. `verify`: check the
/// entries' checksum (one hashing pass); a caller that verified the whole
/// file passes false.
pub fn parse(file: Bytes, path: &Path, verify: bool) -> Result<Snapshot, CheckpointError> {
    let not_st = |reason: String| CheckpointError::NotSafetensors {
        path: path.to_path_buf(),
        reason,
    };
    let n = file
        .get(..8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .ok_or_else(|| not_st(format!("{} bytes: too short for a header", file.len())))?;
    let size = file.len() as u64;
    if n > MAX_HEADER || n > size - 8 {
        return Err(not_st(format!(
            "a header of {n} bytes in a file of {size} (at most {MAX_HEADER})"
        )));
    }
    let start = 8 + n as usize;
    let Layout {
        header,
        ranges,
        data_len,
    } = layout(&file[8..start], path)?;
    if start + data_len != file.len() {
        return Err(not_st(format!(
            "the file is {size} bytes, its header describes {}",
            start + data_len
        )));
    }
    if verify && header.sha256.is_none() {
        return Err(no_checksum(path));
    }
    let mut hash = Sha256::new();
    let mut by_field: Snapshot = Vec::new();
    for (i, (e, r)) in header.entries.into_iter().zip(ranges).enumerate() {
        // A slice of the file's buffer: nothing is copied.
        let bytes = file.slice(start + r.start..start + r.end);
        if verify {
            hash.update(&bytes);
        }
        let (field, s) = stored(i, e, bytes, path)?;
        add_rows(&mut by_field, &field, [s]);
    }
    if verify {
        check_sum(hash, header.sha256.unwrap_or_default(), path)?;
    }
    Ok(by_field)
}

/// `bytes` read as a checkpoint directory's manifest, and as a unit file
/// both ways a load reads one (mapped: [`parse`], checksum verified; and
/// streamed: [`read_unit_file`]). Never panics; returns the rows read, if
/// the bytes were a unit file. The fuzz target `checkpoint_file` checks
/// more (`fuzz/checks/src/checkpoint_file.rs`).
pub fn parse_untrusted(bytes: &[u8]) -> Option<u64> {
    let path = Path::new("fuzz.safetensors");
    let _ = dir::parse_manifest(bytes, Path::new("manifest.json"));
    let _ = read_unit_file(&mut std::io::Cursor::new(bytes), bytes.len() as u64, path);
    let rows = parse(Bytes::copy_from_slice(bytes), path, true).ok()?;
    Some(
        rows.iter()
            .flat_map(|(_, s)| s.iter().map(|s| s.indexes().len() as u64))
            .sum(),
    )
}
