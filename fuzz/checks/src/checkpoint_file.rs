//! Checkpoint files `stowd` reads but did not necessarily write: a unit
//! file (safetensors with `stowage` metadata, a TransferQueue
//! `LOAD_STORAGE_CHECKPOINT` file or a checkpoint directory's), and a
//! checkpoint directory's `manifest.json`.
//!
//! Input: the file's bytes.
//!
//! Invariants checked (each holds by design):
//! - reading never panics, whatever the bytes (`parse_untrusted`);
//! - the two readers agree: the mapped one (`checkpoint::parse`, checksum
//!   verified) accepts exactly the files the streamed one a load uses
//!   (`read_unit_file`, through a cursor) accepts, with the same rows, and
//!   refuses a bad header with the same kind of error; the mapped one without its
//!   checksum check accepts whatever it accepts with it;
//! - rows read are whole: each run of rows names at least one global
//!   index, no index twice in a field, a field once; each tensor is
//!   contiguous, its bytes exactly what its dtype and shape need, and a
//!   run's first dimension its number of indexes;
//! - rows read are written again (`unit_file_bytes`) as a file that reads
//!   back as the same rows, and writing those gives the same bytes;
//! - a manifest read is written again as JSON that reads back the same.

use std::collections::HashSet;
use std::io::Cursor;
use std::path::Path;

use bytes::Bytes;
use stowage_host::batch::Cell;
use stowage_host::checkpoint::dir::parse_manifest;
use stowage_host::checkpoint::{
    CheckpointError, parse, parse_untrusted, read_unit_file, unit_file_bytes,
};
use stowage_host::store::{Snapshot, Stored};
use stowage_host::tensor::{Tensor, contiguous_len};

const PATH: &str = "fuzz.safetensors";

/// A stored run of rows, comparable.
#[derive(Debug, PartialEq)]
enum Row<'a> {
    Rows(&'a [u64], &'a Tensor),
    One(u64, &'a Cell),
}

fn rows(s: &Snapshot) -> Vec<(&str, Vec<Row<'_>>)> {
    s.iter()
        .map(|(field, stored)| {
            let runs = stored
                .iter()
                .map(|s| match s {
                    Stored::Rows { indexes, tensor } => Row::Rows(indexes, tensor),
                    Stored::One { index, cell } => Row::One(*index, cell),
                })
                .collect();
            (&**field, runs)
        })
        .collect()
}

fn whole_tensor(t: &Tensor) {
    assert!(t.is_contiguous(), "a tensor read is not contiguous");
    let want = contiguous_len(t.dtype(), t.shape()).expect("a tensor read has a size");
    assert_eq!(t.payload_len(), want, "{:?} {:?}", t.dtype(), t.shape());
    assert_eq!(t.buffer().len(), want);
}

fn whole(s: &Snapshot) {
    let mut fields = HashSet::new();
    for (field, stored) in s {
        assert!(fields.insert(&**field), "field {field:?} twice");
        let mut seen = HashSet::new();
        for run in stored {
            let indexes = run.indexes();
            assert!(!indexes.is_empty(), "a run of no rows in {field:?}");
            for g in indexes {
                assert!(seen.insert(*g), "index {g} twice in {field:?}");
            }
            match run {
                Stored::Rows { indexes, tensor } => {
                    whole_tensor(tensor);
                    assert_eq!(tensor.shape().first(), Some(&(indexes.len() as u64)));
                }
                Stored::One {
                    cell: Cell::Tensor(t),
                    ..
                } => whole_tensor(t),
                Stored::One { .. } => {}
            }
        }
    }
}

/// A header-level refusal: both readers see the header the same way.
fn header_error(e: &CheckpointError) -> bool {
    matches!(
        e,
        CheckpointError::NotSafetensors { .. } | CheckpointError::NotStowage { .. }
    )
}

fn check_unit(data: &[u8]) {
    let path = Path::new(PATH);
    let counted = parse_untrusted(data);
    let mapped = parse(Bytes::copy_from_slice(data), path, true);
    let streamed = read_unit_file(&mut Cursor::new(data), data.len() as u64, path);
    match (&mapped, &streamed) {
        (Ok(a), Ok(b)) => assert_eq!(rows(a), rows(b), "the readers disagree"),
        // The same kind of error, not always the same words: of several
        // tensors at one offset, safetensors names whichever its hash
        // map gives first (`regressions/checkpoint_file/tied-offsets`).
        (Err(a), Err(b)) => {
            if header_error(b) && !matches!(a, CheckpointError::Checksum { .. }) {
                assert_eq!(
                    std::mem::discriminant(a),
                    std::mem::discriminant(b),
                    "the readers disagree: {a} / {b}"
                );
            }
        }
        (a, b) => panic!(
            "one reader refuses: mapped {:?}, streamed {:?}",
            a.as_ref().err().map(ToString::to_string),
            b.as_ref().err().map(ToString::to_string),
        ),
    }
    let Ok(first) = mapped else {
        assert_eq!(counted, None);
        return;
    };
    let unverified = parse(Bytes::copy_from_slice(data), path, false)
        .unwrap_or_else(|e| panic!("a verified file fails unverified: {e}"));
    assert_eq!(rows(&first), rows(&unverified));
    whole(&first);
    let n: u64 = first
        .iter()
        .flat_map(|(_, s)| s.iter().map(|s| s.indexes().len() as u64))
        .sum();
    assert_eq!(counted, Some(n));

    let written = unit_file_bytes("fuzz", &first)
        .unwrap_or_else(|e| panic!("rows read do not write again: {e}"));
    let again = parse(Bytes::from(written.clone()), path, true)
        .unwrap_or_else(|e| panic!("a file written does not read back: {e}"));
    assert_eq!(rows(&first), rows(&again), "rows changed on the round trip");
    let twice = unit_file_bytes("fuzz", &again).expect("rows written again");
    assert_eq!(written, twice, "writing is not stable");
}

fn check_manifest(data: &[u8]) {
    let path = Path::new("manifest.json");
    let Ok(m) = parse_manifest(data, path) else {
        return;
    };
    let json = serde_json::to_vec(&m).expect("a manifest as JSON");
    let back = parse_manifest(&json, path)
        .unwrap_or_else(|e| panic!("a manifest written does not read back: {e}"));
    assert_eq!(m, back);
}

/// The target's body: every invariant above, on one input.
pub fn check(data: &[u8]) {
    check_unit(data);
    check_manifest(data);
}

/// The seed corpus (`fuzz/corpus/checkpoint_file/seed-*`), by name: unit
/// files written by `stowd`'s own writer (every kind of entry, dtypes
/// safetensors has and lacks, no rows at all), hand-made ones it never
/// writes but reads (tensors stored out of entry order, a checkpoint
/// directory's file without its checksum) or refuses (a run of shape
/// `[0, 4]` naming no index), and a manifest. The corpus test checks the
/// committed files are these.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    use std::sync::Arc;
    use stowage_host::batch::Value;
    use stowage_host::tensor::Dtype;

    let tensor = |d: Dtype, shape: Vec<u64>, fill: u8| {
        let n = contiguous_len(d, &shape).expect("a seed's size");
        let bytes: Vec<u8> = (0..n).map(|i| fill.wrapping_add(i as u8)).collect();
        Tensor::contiguous(Bytes::from(bytes), d, shape).expect("a seed tensor")
    };
    let rows = |indexes: Vec<u64>, d: Dtype, row: &[u64], fill: u8| {
        let mut shape = vec![indexes.len() as u64];
        shape.extend_from_slice(row);
        Stored::Rows {
            tensor: tensor(d, shape, fill),
            indexes,
        }
    };
    let one = |index: u64, cell: Cell| Stored::One { index, cell };
    let written = |s: Snapshot| unit_file_bytes("TQ_STORAGE_UNIT_seed", &s).expect("a seed");

    let regular: Snapshot = vec![
        (
            Arc::from("x"),
            vec![rows(vec![0, 1, 2], Dtype::Float32, &[2], 1)],
        ),
        (
            Arc::from("step"),
            vec![
                rows(vec![0, 1], Dtype::Int64, &[], 9),
                rows(vec![2], Dtype::Int64, &[], 40),
            ],
        ),
    ];
    let every_kind: Snapshot = vec![
        (
            Arc::from("t"),
            vec![
                one(3, Cell::Tensor(tensor(Dtype::Bfloat16, vec![2, 3], 7))),
                one(4, Cell::Tensor(tensor(Dtype::Complex128, vec![1], 2))),
                one(5, Cell::Tensor(tensor(Dtype::Float32, vec![0, 4], 0))),
            ],
        ),
        (
            Arc::from("v"),
            vec![
                one(3, Cell::Value(Value::Str("héllo".into()))),
                one(
                    4,
                    Cell::Value(Value::Bytes(Bytes::from_static(b"\x00\xff"))),
                ),
                one(
                    5,
                    Cell::Value(Value::Msgpack(Bytes::from_static(b"\x92\x01\xa1a"))),
                ),
            ],
        ),
        (
            Arc::from("packed"),
            vec![
                rows(vec![8, 9], Dtype::Float4E2m1fnX2, &[3], 5),
                rows(vec![10], Dtype::Bool, &[2], 0),
                rows(vec![11], Dtype::Float8E4m3fn, &[1], 3),
            ],
        ),
    ];
    let two: Snapshot = vec![(
        Arc::from("a"),
        vec![
            rows(vec![1], Dtype::Uint8, &[3], 1),
            rows(vec![2], Dtype::Uint16, &[1], 8),
        ],
    )];

    let two_file = written(two);
    vec![
        ("seed-rows", written(regular)),
        ("seed-every-kind", written(every_kind)),
        ("seed-no-rows", written(Vec::new())),
        ("seed-offsets-out-of-order", swapped(&two_file)),
        ("seed-rows-shape-0-4-no-indexes", hand_made(true)),
        ("seed-directory-unit-no-checksum", hand_made(false)),
        ("seed-manifest.json", manifest()),
    ]
}

/// `file` (two entries) with the second tensor's bytes stored first: the
/// offsets out of entry order, the entries' checksum unchanged.
fn swapped(file: &[u8]) -> Vec<u8> {
    let n = u64::from_le_bytes(file[..8].try_into().expect("8 bytes")) as usize;
    let mut head: serde_json::Value = serde_json::from_slice(&file[8..8 + n]).expect("the header");
    let data = &file[8 + n..];
    let range = |t: &serde_json::Value| {
        let o = &t["data_offsets"];
        o[0].as_u64().expect("start") as usize..o[1].as_u64().expect("end") as usize
    };
    let (r0, r1) = (range(&head["0"]), range(&head["1"]));
    let mut out = data[r1.clone()].to_vec();
    out.extend_from_slice(&data[r0.clone()]);
    head["1"]["data_offsets"] = serde_json::json!([0, r1.len()]);
    head["0"]["data_offsets"] = serde_json::json!([r1.len(), r1.len() + r0.len()]);
    with_header(&head, &out)
}

/// A file `stowd` never writes: `bad`, a `rows` entry of shape `[0, 4]`
/// naming no index (refused); else a checkpoint directory's file, without
/// the entries' checksum (the mapped reader without verification reads
/// it, a load refuses it).
fn hand_made(bad: bool) -> Vec<u8> {
    let (entries, sha, data): (serde_json::Value, _, &[u8]) = if bad {
        (
            serde_json::json!([["x", "rows", "float32", [0, 4], []]]),
            // SHA-256 of no bytes.
            Some("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
            b"",
        )
    } else {
        (
            serde_json::json!([["x", "rows", "int16", [2, 1], [4, 6]]]),
            None,
            b"\x01\x00\x02\x00",
        )
    };
    let mut stowage = serde_json::json!({
        "format": stowage_host::checkpoint::FORMAT,
        "unit": "TQ_STORAGE_UNIT_seed",
        "entries": entries,
    });
    if let Some(sha) = sha {
        stowage["sha256"] = sha.into();
    }
    let (dtype, shape) = if bad {
        ("F32", serde_json::json!([0, 4]))
    } else {
        ("I16", serde_json::json!([2, 1]))
    };
    let head = serde_json::json!({
        "__metadata__": {"stowage": stowage.to_string()},
        "0": {"dtype": dtype, "shape": shape, "data_offsets": [0, data.len()]},
    });
    with_header(&head, data)
}

/// A safetensors file: the header's length, the header padded with spaces
/// to a multiple of 8, the data.
fn with_header(head: &serde_json::Value, data: &[u8]) -> Vec<u8> {
    let mut json = serde_json::to_vec(head).expect("a header");
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    out.extend_from_slice(data);
    out
}

/// A checkpoint directory's `manifest.json` of two units.
fn manifest() -> Vec<u8> {
    use stowage_host::checkpoint::dir::{FileEntry, MANIFEST_FORMAT, Manifest};
    let file = |i: usize, rows: u64| FileEntry {
        file: format!("unit-7-{i}.safetensors"),
        unit: format!("TQ_STORAGE_UNIT_{i}"),
        rows,
        bytes: rows * 8,
        size: 256 + rows * 8,
        sha256: "ab".repeat(32),
    };
    let m = Manifest {
        format: MANIFEST_FORMAT.into(),
        seq: 7,
        created_unix_ms: 1_796_342_400_000,
        files: vec![file(0, 3), file(1, 0)],
        journal: true,
    };
    serde_json::to_vec_pretty(&m).expect("a manifest")
}
