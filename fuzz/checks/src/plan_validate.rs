//! Selection and frame plans, as a (possibly hostile) policy answers them,
//! against arbitrary fields: regular tensors of any dtype and row shape,
//! row-strided views of them, nested rows of different shapes, plain
//! values.
//!
//! Input: an [`Input`] built with `arbitrary`. Plans are validated by the
//! `stowage-plan` rules (the ones the host and the guest SDK harness call)
//! and executed by the host.
//!
//! Invariants checked (each holds by design):
//! - validation never panics, whatever the plan claims;
//! - the built-in plan for in-range, non-empty positions always validates
//!   (and the built-in frame plan, when it answers, too);
//! - a plan that validates executes without error, and yields exactly the
//!   requested rows, in order, byte for byte the rows of the field (the
//!   same rows the built-in plan yields); views are slices of the field's
//!   buffer, never copies;
//! - a frame plan that validates executes to exactly its frames, each
//!   piece placed once, inside its frame, with its own bytes, and copied
//!   plus zero-copy bytes add up to the frames' bytes.

use arbitrary::{Arbitrary, Unstructured};
use bytes::Bytes;
use stowage_host::plan::{Selected, execute_frames, execute_selection, field_info};
use stowage_host::policy::builtin::Builtin;
use stowage_plan::{
    Frame, FramePlan, PackLimits, Piece, PieceInfo, RowView, SelectionPlan, validate_frames,
    validate_selection,
};
use stowage_wire::batch::{Field, Value};
use stowage_wire::tensor::{Dtype, Tensor};

/// A row number: mostly small (near the field's rows), sometimes anything.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Num {
    Small(u8),
    Any(u64),
}

impl Num {
    fn get(self) -> u64 {
        match self {
            Num::Small(v) => u64::from(v % 40),
            Num::Any(v) => v,
        }
    }
}

/// A tensor: `rows` rows of `row_shape` (each dimension 0..=4, at most 3
/// of them), optionally seen through a `start:step:count` row view.
#[derive(Arbitrary, Debug)]
struct TensorSpec {
    dtype: u8,
    rows: u8,
    row_shape: Vec<u8>,
    view: Option<(u8, u8, u8)>,
}

#[derive(Arbitrary, Debug)]
enum FieldSpec {
    Regular(TensorSpec),
    Nested(Vec<TensorSpec>),
    Values(Vec<Vec<u8>>),
}

#[derive(Arbitrary, Debug)]
enum PieceSpec {
    View(Num, Num, Num),
    Gather(Vec<Num>),
    RowViews(Vec<Num>),
    Concat(Vec<Num>),
}

/// A plan: a correct one to start from (or none), then edits.
#[derive(Arbitrary, Debug)]
enum PlanStart {
    Empty,
    Builtin,
    /// Positions cut into chunks of these sizes, each chunk a piece of a
    /// kind picked by the byte (views only where the stride allows).
    Chunks(Vec<(u8, u8)>),
}

#[derive(Arbitrary, Debug)]
enum Edit {
    Push(PieceSpec),
    Insert(u8, PieceSpec),
    Remove(u8),
    Swap(u8, u8),
    /// Change one row number inside a piece.
    SetRow(u8, u8, Num),
    /// Change a view's start, step or count.
    SetView(u8, u8, Num),
}

#[derive(Arbitrary, Debug)]
enum FrameSpec {
    Single(u8),
    Coalesced(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
struct FramesInput {
    max_frames: u8,
    max_frame_bytes: u16,
    small_threshold: u16,
    /// Start from the built-in frame plan (if it answers) or from nothing.
    builtin: bool,
    edits: Vec<(u8, Option<FrameSpec>)>,
}

/// One fuzz input (built with `arbitrary` from the raw bytes).
#[derive(Arbitrary, Debug)]
pub struct Input {
    field: FieldSpec,
    positions: Vec<Num>,
    start: PlanStart,
    edits: Vec<Edit>,
    frames: FramesInput,
}

/// Bytes `0..len` of a recognisable pattern (so rows differ).
fn pattern(len: usize, seed: u64) -> Bytes {
    (0..len)
        .map(|i| {
            (i as u64)
                .wrapping_mul(31)
                .wrapping_add(seed.wrapping_mul(7)) as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

fn tensor(spec: &TensorSpec, seed: u64) -> Tensor {
    let dtype = Dtype::ALL[spec.dtype as usize % Dtype::ALL.len()];
    let row_shape: Vec<u64> = spec
        .row_shape
        .iter()
        .take(3)
        .map(|&d| u64::from(d % 5))
        .collect();
    let mut shape = vec![u64::from(spec.rows % 48)];
    shape.extend(&row_shape);
    let row_elems: u64 = row_shape.iter().product();
    let len = (shape[0] * row_elems) as usize * dtype.itemsize();
    let t =
        Tensor::contiguous(pattern(len, seed), dtype, shape).expect("pattern has the right length");
    match spec.view {
        Some((start, step, count)) => t
            .rows_view(
                u64::from(start % 48),
                u64::from(step % 8),
                u64::from(count % 48),
            )
            .unwrap_or(t),
        None => t,
    }
}

fn field(spec: &FieldSpec) -> Field {
    match spec {
        FieldSpec::Regular(t) => Field::Regular(tensor(t, 1)),
        FieldSpec::Nested(rows) => Field::Nested(
            rows.iter()
                .take(48)
                .enumerate()
                .map(|(i, t)| tensor(t, i as u64 + 2))
                .collect(),
        ),
        FieldSpec::Values(vs) => Field::Values(
            vs.iter()
                .take(48)
                .enumerate()
                .map(|(i, v)| match i % 3 {
                    0 => Value::Bytes(Bytes::copy_from_slice(v)),
                    1 => Value::Str(String::from_utf8_lossy(v).into_owned()),
                    _ => Value::Msgpack(Bytes::copy_from_slice(v)),
                })
                .collect(),
        ),
    }
}

fn piece(spec: &PieceSpec) -> Piece {
    let rows = |v: &Vec<Num>| v.iter().take(64).map(|n| n.get()).collect();
    match spec {
        PieceSpec::View(a, b, c) => Piece::View(RowView {
            start: a.get(),
            step: b.get(),
            count: c.get(),
        }),
        PieceSpec::Gather(v) => Piece::Gather(rows(v)),
        PieceSpec::RowViews(v) => Piece::RowViews(rows(v)),
        PieceSpec::Concat(v) => Piece::Concat(rows(v)),
    }
}

/// A correct plan for `positions` cut into chunks.
fn chunked(field: &Field, positions: &[u64], cuts: &[(u8, u8)]) -> SelectionPlan {
    let mut pieces = Vec::new();
    let mut rest = positions;
    let mut cuts = cuts.iter().cycle();
    while !rest.is_empty() {
        let &(size, kind) = cuts.next().unwrap_or(&(u8::MAX, 0));
        let n = (size as usize % 8 + 1).min(rest.len());
        let (chunk, tail) = rest.split_at(n);
        rest = tail;
        let stride = match chunk {
            [_] => Some(1),
            _ => stowage_host::policy::builtin::constant_stride(chunk),
        };
        pieces.push(match (field, kind % 2, stride) {
            (Field::Regular(_), 0, Some(step)) => Piece::View(RowView {
                start: chunk[0],
                step,
                count: chunk.len() as u64,
            }),
            (Field::Regular(_), _, _) => Piece::Gather(chunk.to_vec()),
            (Field::Nested(_), 0, _) => Piece::Concat(chunk.to_vec()),
            _ => Piece::RowViews(chunk.to_vec()),
        });
    }
    SelectionPlan { pieces }
}

fn edit(plan: &mut SelectionPlan, e: &Edit) {
    let p = &mut plan.pieces;
    let at = |i: u8, len: usize| {
        if len == 0 {
            None
        } else {
            Some(i as usize % len)
        }
    };
    match e {
        Edit::Push(s) => p.push(piece(s)),
        Edit::Insert(i, s) => {
            let i = *i as usize % (p.len() + 1);
            p.insert(i, piece(s));
        }
        Edit::Remove(i) => {
            if let Some(i) = at(*i, p.len()) {
                p.remove(i);
            }
        }
        Edit::Swap(i, j) => {
            if let (Some(i), Some(j)) = (at(*i, p.len()), at(*j, p.len())) {
                p.swap(i, j);
            }
        }
        Edit::SetRow(i, k, n) => {
            if let Some(i) = at(*i, p.len()) {
                match &mut p[i] {
                    Piece::Gather(r) | Piece::RowViews(r) | Piece::Concat(r) => {
                        if let Some(k) = at(*k, r.len()) {
                            r[k] = n.get();
                        }
                    }
                    Piece::View(v) => v.start = n.get(),
                }
            }
        }
        Edit::SetView(i, which, n) => {
            if let Some(i) = at(*i, p.len())
                && let Piece::View(v) = &mut p[i]
            {
                match which % 3 {
                    0 => v.start = n.get(),
                    1 => v.step = n.get(),
                    _ => v.count = n.get(),
                }
            }
        }
    }
}

/// One selected row, in a comparable form.
#[derive(Debug, PartialEq)]
enum RowOut {
    Tensor {
        dtype: Dtype,
        shape: Vec<u64>,
        bytes: Bytes,
    },
    Value(Value),
}

fn row_of(t: &Tensor) -> RowOut {
    RowOut::Tensor {
        dtype: t.dtype(),
        shape: t.shape().to_vec(),
        bytes: t.contiguous_bytes(),
    }
}

/// What the field holds at `pos`.
fn expected_row(field: &Field, pos: u64) -> RowOut {
    match field {
        Field::Regular(t) => row_of(&t.row_tensor(pos).expect("validated row is in range")),
        Field::Nested(rows) => row_of(&rows[pos as usize]),
        Field::Values(vs) => RowOut::Value(vs[pos as usize].clone()),
    }
}

/// True if `inner` lies inside `outer`'s memory.
fn inside(inner: &Bytes, outer: &Bytes) -> bool {
    let (i, o) = (inner.as_ptr() as usize, outer.as_ptr() as usize);
    inner.is_empty() || (i >= o && i + inner.len() <= o + outer.len())
}

/// Executes a validated plan and checks every row; returns the rows and
/// the tensors a packer would frame.
fn run(field: &Field, plan: &SelectionPlan, positions: &[u64]) -> (Vec<RowOut>, Vec<Tensor>) {
    let out = execute_selection(field, plan)
        .unwrap_or_else(|e| panic!("validated plan fails to execute: {e}"));
    assert_eq!(out.len(), plan.pieces.len());
    let (mut rows, mut tensors) = (Vec::new(), Vec::new());
    for (sel, piece) in out.iter().zip(&plan.pieces) {
        let before = rows.len();
        match sel {
            Selected::Rows(t) => {
                if let (Piece::View(_), Field::Regular(base)) = (piece, field) {
                    assert!(
                        inside(t.buffer(), base.buffer()),
                        "a view is not a slice of the field"
                    );
                } else {
                    assert!(t.is_contiguous(), "a gather is not contiguous");
                }
                for i in 0..t.rows() {
                    rows.push(row_of(&t.row_tensor(i).expect("row of a selected tensor")));
                }
                tensors.push(t.clone());
            }
            Selected::NestedRows(ts) => {
                let Field::Nested(all) = field else {
                    panic!("nested rows from a {field:?}")
                };
                for t in ts {
                    assert!(
                        all.iter().any(|a| inside(t.buffer(), a.buffer())),
                        "a row view is a copy"
                    );
                    rows.push(row_of(t));
                }
                tensors.extend(ts.iter().cloned());
            }
            Selected::Packed { buffer, rows: ts } => {
                let total: usize = ts.iter().map(Tensor::payload_len).sum();
                assert_eq!(
                    buffer.len(),
                    total,
                    "packed buffer is not the rows back to back"
                );
                for t in ts {
                    assert!(
                        inside(t.buffer(), buffer),
                        "a packed row is outside its buffer"
                    );
                    rows.push(row_of(t));
                }
                tensors.extend(ts.iter().cloned());
            }
            Selected::Values(vs) => rows.extend(vs.iter().cloned().map(RowOut::Value)),
        }
        assert_eq!(rows.len() - before, sel.rows() as usize, "piece row count");
    }
    assert_eq!(
        rows.len(),
        positions.len(),
        "executed plan has the wrong number of rows"
    );
    for (k, (got, &pos)) in rows.iter().zip(positions).enumerate() {
        assert_eq!(
            got,
            &expected_row(field, pos),
            "row #{k} (position {pos}) differs"
        );
    }
    (rows, tensors)
}

fn frames(tensors: &[Tensor], input: &FramesInput) {
    let infos: Vec<PieceInfo> = tensors
        .iter()
        .map(|t| PieceInfo {
            byte_len: t.payload_len() as u64,
            contiguous: t.is_contiguous(),
        })
        .collect();
    let limits = PackLimits {
        max_frames: u32::from(input.max_frames),
        max_frame_bytes: u64::from(input.max_frame_bytes),
        small_threshold: u64::from(input.small_threshold),
    };
    let builtin = Builtin::frames(&infos, &limits);
    if let Ok(plan) = &builtin {
        validate_frames(&infos, &limits, plan)
            .unwrap_or_else(|e| panic!("built-in frame plan refused: {e}"));
    }
    let mut plan = match (&builtin, input.builtin) {
        (Ok(plan), true) => plan.clone(),
        _ => FramePlan::default(),
    };
    for (at, spec) in input.edits.iter().take(16) {
        let f = &mut plan.frames;
        let i = *at as usize % (f.len() + 1);
        match spec {
            None if i < f.len() => drop(f.remove(i)),
            None => {}
            Some(FrameSpec::Single(p)) => f.insert(i, Frame::Single(u32::from(*p))),
            Some(FrameSpec::Coalesced(ps)) => f.insert(
                i,
                Frame::Coalesced(ps.iter().map(|&p| u32::from(p)).collect()),
            ),
        }
    }
    if validate_frames(&infos, &limits, &plan).is_err() {
        return;
    }
    let framed = execute_frames(tensors, &plan);
    assert_eq!(framed.frames.len(), plan.frames.len());
    assert_eq!(framed.placements.len(), tensors.len());
    let total: u64 = framed.frames.iter().map(|f| f.len() as u64).sum();
    assert_eq!(
        framed.zero_copy_bytes + framed.copied_bytes,
        total,
        "copied + zero-copy != frame bytes"
    );
    for (fi, frame) in plan.frames.iter().enumerate() {
        let list = match frame {
            Frame::Single(i) => vec![*i],
            Frame::Coalesced(list) => list.clone(),
        };
        let mut offset = 0;
        for i in list {
            let p = framed.placements[i as usize];
            let want = tensors[i as usize].contiguous_bytes();
            assert_eq!(
                (p.frame as usize, p.offset, p.len),
                (fi, offset, want.len() as u64),
                "piece {i} misplaced"
            );
            let bytes = &framed.frames[fi][p.offset as usize..(p.offset + p.len) as usize];
            assert_eq!(bytes, &want[..], "piece {i} has the wrong bytes");
            offset += p.len;
        }
        assert_eq!(
            offset,
            framed.frames[fi].len() as u64,
            "frame {fi} holds more than its pieces"
        );
    }
}

/// The target's body: every invariant above, on one input.
pub fn check_input(input: Input) {
    let field = field(&input.field);
    let positions: Vec<u64> = input.positions.iter().take(64).map(|n| n.get()).collect();
    let rows = field.rows();
    let sane = !positions.is_empty() && positions.iter().all(|&p| p < rows);

    let builtin = Builtin::plan(&field, &positions);
    assert_eq!(builtin.is_ok(), !positions.is_empty());
    let reference = match &builtin {
        Ok(plan) if sane => {
            validate_selection(field_info(&field), &positions, plan)
                .unwrap_or_else(|e| panic!("built-in plan refused: {e}"));
            Some(run(&field, plan, &positions).0)
        }
        Ok(plan) => {
            assert!(
                validate_selection(field_info(&field), &positions, plan).is_err(),
                "out-of-range positions accepted"
            );
            None
        }
        Err(_) => None,
    };

    let mut plan = match (&input.start, &builtin) {
        (PlanStart::Builtin, Ok(plan)) => plan.clone(),
        (PlanStart::Chunks(cuts), _) => chunked(&field, &positions, cuts),
        _ => SelectionPlan::default(),
    };
    for e in input.edits.iter().take(8) {
        edit(&mut plan, e);
    }
    let tensors = match validate_selection(field_info(&field), &positions, &plan) {
        Ok(()) => {
            assert!(
                positions.iter().all(|&p| p < rows),
                "plan accepted for out-of-range positions"
            );
            let (got, tensors) = run(&field, &plan, &positions);
            if let Some(reference) = &reference {
                assert_eq!(&got, reference, "plan and built-in select different rows");
            }
            tensors
        }
        // Frame the field's own tensors instead.
        Err(_) => match &field {
            Field::Regular(t) => vec![t.clone()],
            Field::Nested(ts) => ts.clone(),
            Field::Values(_) => Vec::new(),
        },
    };
    frames(&tensors, &input.frames);
}

/// The target on raw bytes, read the way libfuzzer-sys reads a typed
/// target's input: bytes too short for `Input`'s size hint, or that do not
/// make an `Input`, are skipped.
pub fn check(data: &[u8]) {
    if data.len() < Input::size_hint(0).0 {
        return;
    }
    if let Ok(input) = Input::arbitrary_take_rest(Unstructured::new(data)) {
        check_input(input);
    }
}
