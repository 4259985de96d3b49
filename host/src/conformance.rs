//! `stowd plugin check` and `stowd plugin bench`: a plugin against the
//! built-in, on many layouts and position patterns.
//!
//! Every case runs through the plugin and through [`Builtin`]. A plugin may
//! decline (`not-applicable`, `invalid-input`); a plan it answers must pass
//! validation and select exactly the built-in's rows, byte for byte. A
//! trap, timeout, memory cap or `failed` is a failure. Packing plans must
//! pass frame validation. Decision times are measured per call, and each
//! answered case keeps the shape of the plugin's plan and of the built-in's
//! (pieces by kind, bytes copied): [`report`] prints them.

use std::time::{Duration, Instant};

mod report;

pub use report::{Shape, bench_table, check_table};

use bytes::Bytes;

use crate::batch::{Field, Value};
use crate::plan::{self, PackLimits, PieceInfo, Selected};
use crate::policy::builtin::Builtin;
use crate::policy::{Capability, Policy, PolicyError};
use crate::tensor::{Dtype, Tensor};

/// One input of the suite.
pub struct Case {
    pub name: String,
    pub field: Field,
    pub positions: Vec<u64>,
}

/// What happened to one case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The plugin's plan selected the built-in's rows.
    Same,
    /// The plugin declined.
    Declined,
    /// Anything else: the reason.
    Failed(String),
}

/// One case of a run.
#[derive(Debug, Clone)]
pub struct CaseResult {
    /// `select: ...` or `pack: ...`.
    pub name: String,
    pub outcome: Outcome,
    /// The plugin's decision time.
    pub plugin_time: Duration,
    /// The built-in's decision time on the same input.
    pub builtin_time: Duration,
    /// The plugin's plan, when it answered with a valid one.
    pub plugin_plan: Option<Shape>,
    /// The built-in's plan for the same input (`None` where it declines,
    /// as for no positions).
    pub builtin_plan: Option<Shape>,
}

/// The result of a whole run.
#[derive(Debug, Default)]
pub struct Report {
    pub cases: Vec<CaseResult>,
    /// Cases not run because the run gave up (see [`Stop`]).
    pub not_run: usize,
}

/// When a run stops before the end of the suite.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// Run every case.
    Never,
    /// At the first failed case (hot reload's check).
    AtFirstFailure,
    /// After this many failed cases in a row. A plugin that traps, runs
    /// out of fuel or hits its memory cap on every call fails every case
    /// the same way, and each such call costs up to its whole deadline
    /// (about 87 ms for `tests/hostile/memory-bomb`, 27 ms for
    /// `infinite-loop`, measured with a release `stowd`): the 671 cases
    /// would take a minute to say what the first few already said.
    AfterFailuresInARow(usize),
}

/// `stowd plugin check` and `bench` give up after this many failed cases in
/// a row, unless asked to run every case.
pub const GIVE_UP_AFTER: usize = 16;

impl Report {
    pub fn failures(&self) -> Vec<&CaseResult> {
        self.cases
            .iter()
            .filter(|c| matches!(c.outcome, Outcome::Failed(_)))
            .collect()
    }

    pub fn count(&self, want: &Outcome) -> usize {
        self.cases
            .iter()
            .filter(|c| std::mem::discriminant(&c.outcome) == std::mem::discriminant(want))
            .count()
    }
}

/// A deterministic pseudo-random sequence (no dependency, same every run).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}

fn regular(dtype: Dtype, rows: u64, cols: u64) -> Field {
    let len = (rows * cols) as usize * dtype.itemsize();
    let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
    Field::Regular(
        Tensor::contiguous(Bytes::from(data), dtype, vec![rows, cols]).expect("valid layout"),
    )
}

fn nested(rows: u64) -> Field {
    Field::Nested(
        (0..rows)
            .map(|i| {
                let n = i % 5; // rows of length 0..4, some empty
                let data: Vec<u8> = (0..n * 8).map(|b| (b + i) as u8).collect();
                Tensor::contiguous(Bytes::from(data), Dtype::Int64, vec![n]).expect("valid layout")
            })
            .collect(),
    )
}

fn values(rows: u64) -> Field {
    Field::Values((0..rows).map(|i| Value::Str(format!("v{i}-é"))).collect())
}

/// Position patterns over `rows` rows.
fn patterns(rows: u64, rng: &mut Lcg) -> Vec<(&'static str, Vec<u64>)> {
    let mut out: Vec<(&'static str, Vec<u64>)> = vec![("empty", vec![])];
    if rows == 0 {
        return out;
    }
    out.push(("single-first", vec![0]));
    out.push(("single-last", vec![rows - 1]));
    out.push(("all", (0..rows).collect()));
    for step in [2u64, 3, 4, 7] {
        if rows > step {
            out.push(("strided", (0..rows).step_by(step as usize).collect()));
            out.push(("strided-offset", (1..rows).step_by(step as usize).collect()));
        }
    }
    out.push(("negative-stride", (0..rows).rev().collect()));
    if rows >= 4 {
        out.push(("zero-stride", vec![1, 1, 1]));
        let half = rows / 2;
        out.push(("runs", (0..half / 2).chain(half..half + half / 2).collect()));
        out.push(("irregular", vec![0, 2, 3]));
        out.push(("reversed-irregular", vec![3, 1, 0]));
    }
    for _ in 0..3 {
        let n = 1 + rng.next() % rows.min(64);
        out.push(("random", (0..n).map(|_| rng.next() % rows).collect()));
        let mut sorted: Vec<u64> = (0..n).map(|_| rng.next() % rows).collect();
        sorted.sort_unstable();
        sorted.dedup();
        out.push(("random-sorted", sorted));
    }
    out
}

/// The selection cases of the suite.
pub fn selection_cases() -> Vec<Case> {
    let mut rng = Lcg(0x5eed);
    let mut fields: Vec<(String, Field)> = Vec::new();
    for dtype in [
        Dtype::Float32,
        Dtype::Float16,
        Dtype::Bfloat16,
        Dtype::Int64,
        Dtype::Int8,
        Dtype::Uint8,
        Dtype::Bool,
    ] {
        for (rows, cols) in [(1u64, 4u64), (8, 2), (100, 3), (1000, 1)] {
            fields.push((
                format!("regular {dtype} [{rows}, {cols}]"),
                regular(dtype, rows, cols),
            ));
        }
    }
    fields.push((
        "regular float32 [0, 4]".into(),
        regular(Dtype::Float32, 0, 4),
    ));
    for rows in [1u64, 7, 50] {
        fields.push((format!("nested int64 x{rows} (empty rows)"), nested(rows)));
        fields.push((format!("values x{rows}"), values(rows)));
    }
    let mut cases = Vec::new();
    for (fname, field) in fields {
        for (pname, positions) in patterns(field.rows(), &mut rng) {
            cases.push(Case {
                name: format!("{fname} / {pname} ({} positions)", positions.len()),
                field: field.clone(),
                positions,
            });
        }
    }
    cases
}

/// The packing cases: (name, pieces, limits).
pub fn packing_cases() -> Vec<(String, Vec<PieceInfo>, PackLimits)> {
    let small = |n: usize| {
        vec![
            PieceInfo {
                byte_len: 512,
                contiguous: true
            };
            n
        ]
    };
    let large = |n: usize| {
        vec![
            PieceInfo {
                byte_len: 4 << 20,
                contiguous: true
            };
            n
        ]
    };
    let roomy = PackLimits {
        max_frames: 1000,
        max_frame_bytes: 64 << 20,
        small_threshold: 64 << 10,
    };
    let tight = PackLimits {
        max_frames: 4,
        max_frame_bytes: 64 << 20,
        small_threshold: 64 << 10,
    };
    let mut mixed = small(100);
    mixed.extend(large(3));
    mixed.push(PieceInfo {
        byte_len: 4096,
        contiguous: false,
    });
    vec![
        ("no pieces".into(), vec![], roomy),
        ("one small".into(), small(1), roomy),
        ("10,000 small".into(), small(10_000), roomy),
        ("10,000 small, 4 frames".into(), small(10_000), tight),
        ("5 large".into(), large(5), roomy),
        ("mixed".into(), mixed.clone(), roomy),
        ("mixed, 4 frames".into(), mixed, tight),
    ]
}

fn rows_of(selected: &[Selected]) -> Vec<Bytes> {
    let mut out = Vec::new();
    for s in selected {
        match s {
            Selected::Rows(t) => out.extend((0..t.rows()).filter_map(|i| t.row(i).ok())),
            Selected::NestedRows(r) | Selected::Packed { rows: r, .. } => {
                out.extend(r.iter().map(Tensor::contiguous_bytes))
            }
            Selected::Values(v) => out.extend(v.iter().map(|v| match v {
                Value::Str(s) => Bytes::copy_from_slice(s.as_bytes()),
                Value::Bytes(b) | Value::Msgpack(b) => b.clone(),
            })),
        }
    }
    out
}

fn check_selection(policy: &dyn Policy, case: &Case) -> CaseResult {
    let t = Instant::now();
    let answer = policy.select(&case.field, &case.positions);
    let plugin_time = t.elapsed();
    let t = Instant::now();
    let expected = Builtin::plan(&case.field, &case.positions);
    let builtin_time = t.elapsed();
    let mut result = CaseResult {
        name: format!("select: {}", case.name),
        outcome: Outcome::Same,
        plugin_time,
        builtin_time,
        plugin_plan: None,
        builtin_plan: None,
    };
    // The built-in's rows and plan shape (`None` where it declines).
    let expected = expected.ok().map(|p| {
        plan::execute_selection(&case.field, &p).map(|s| (rows_of(&s), Shape::of_selection(&p, &s)))
    });
    result.builtin_plan = expected
        .as_ref()
        .and_then(|r| r.as_ref().ok())
        .map(|(_, shape)| shape.clone());
    result.outcome = match answer {
        Err(PolicyError::NotApplicable | PolicyError::InvalidInput(_)) => Outcome::Declined,
        Err(e) => Outcome::Failed(e.to_string()),
        Ok(plan) if case.positions.is_empty() => {
            if plan.pieces.is_empty() {
                result.plugin_plan = Some(Shape::of_selection(&plan, &[]));
                Outcome::Same
            } else {
                Outcome::Failed(format!(
                    "a plan of {} pieces for no positions",
                    plan.pieces.len()
                ))
            }
        }
        Ok(plan) => {
            if let Err(e) = plan::validate_selection(&case.field, &case.positions, &plan) {
                return CaseResult {
                    outcome: Outcome::Failed(format!("invalid plan: {e}")),
                    ..result
                };
            }
            match (plan::execute_selection(&case.field, &plan), expected) {
                (_, None) => Outcome::Failed("the built-in refused the case".into()),
                (Err(e), _) | (_, Some(Err(e))) => {
                    Outcome::Failed(format!("execution failed: {e}"))
                }
                (Ok(got), Some(Ok((want, _)))) if rows_of(&got) == want => {
                    result.plugin_plan = Some(Shape::of_selection(&plan, &got));
                    Outcome::Same
                }
                (Ok(_), Some(Ok(_))) => {
                    Outcome::Failed("selected rows differ from the built-in's".into())
                }
            }
        }
    };
    result
}

fn check_packing(
    policy: &dyn Policy,
    name: &str,
    pieces: &[PieceInfo],
    limits: &PackLimits,
) -> CaseResult {
    let t = Instant::now();
    // As stowd asks: from the policy's memo when it keeps one (`plugin
    // bench` times a memoized round this way).
    let (answer, _) = policy.pack_answer(pieces, limits);
    let plugin_time = t.elapsed();
    let t = Instant::now();
    let builtin = Builtin::frames(pieces, limits);
    let builtin_time = t.elapsed();
    let mut plugin_plan = None;
    let outcome = match answer {
        Err(PolicyError::NotApplicable | PolicyError::InvalidInput(_)) => Outcome::Declined,
        Err(e) => Outcome::Failed(e.to_string()),
        Ok(plan) => match plan::validate_frames(pieces, limits, &plan) {
            Ok(()) => {
                plugin_plan = Some(Shape::of_frames(&plan, pieces));
                Outcome::Same
            }
            Err(e) => Outcome::Failed(format!("invalid frame plan: {e}")),
        },
    };
    CaseResult {
        name: format!("pack: {name}"),
        outcome,
        plugin_time,
        builtin_time,
        plugin_plan,
        builtin_plan: builtin.ok().map(|p| Shape::of_frames(&p, pieces)),
    }
}

/// Runs the whole suite against `policy`.
pub fn run(policy: &dyn Policy) -> Report {
    run_with(policy, Stop::Never)
}

/// The first case a plugin failed, and why: defined with the policies,
/// which carry it in their load errors.
pub use crate::policy::Refusal;

/// Runs the suite until the first failure: `Ok(cases run)` if no case
/// failed (declining is fine), else the failing case and why. This is what
/// a plugin must pass before hot reload makes it live.
pub fn verify(policy: &dyn Policy) -> Result<usize, Refusal> {
    let report = run_with(policy, Stop::AtFirstFailure);
    let Some(failed) = report.failures().first().copied() else {
        return Ok(report.cases.len());
    };
    let name = &failed.name;
    match &failed.outcome {
        Outcome::Failed(why) => {
            // One line: a trap's text spans a backtrace and a cause.
            let mut line = why.split_whitespace().collect::<Vec<_>>().join(" ");
            if line.len() > 400 {
                let cut = (0..=400)
                    .rev()
                    .find(|i| line.is_char_boundary(*i))
                    .unwrap_or(0);
                line.truncate(cut);
                line.push_str("...");
            }
            Err(Refusal {
                case: name.clone(),
                why: Some(line),
            })
        }
        _ => Err(Refusal {
            case: name.clone(),
            why: None,
        }),
    }
}

/// Runs the suite, stopping as `stop` says; [`Report::not_run`] counts the
/// cases left.
pub fn run_with(policy: &dyn Policy, stop: Stop) -> Report {
    let mut report = Report::default();
    let caps = &policy.describe().capabilities;
    let selection = caps.contains(&Capability::Selection);
    let packing = caps.contains(&Capability::Packing);
    let limit = match stop {
        Stop::Never => usize::MAX,
        Stop::AtFirstFailure => 1,
        Stop::AfterFailuresInARow(n) => n.max(1),
    };
    let mut in_a_row = 0usize;
    let mut gave_up = |report: &Report| {
        match report.cases.last() {
            Some(c) if matches!(c.outcome, Outcome::Failed(_)) => in_a_row += 1,
            _ => in_a_row = 0,
        }
        in_a_row >= limit
    };
    let total = |report: &Report| {
        usize::from(selection) * selection_cases().len()
            + usize::from(packing) * packing_cases().len()
            - report.cases.len()
    };
    if selection {
        for case in selection_cases() {
            report.cases.push(check_selection(policy, &case));
            if gave_up(&report) {
                report.not_run = total(&report);
                return report;
            }
        }
    }
    if packing {
        for (name, pieces, limits) in packing_cases() {
            report
                .cases
                .push(check_packing(policy, &name, &pieces, &limits));
            if gave_up(&report) {
                report.not_run = total(&report);
                return report;
            }
        }
    }
    report
}

/// Percentile of a set of durations, in microseconds.
pub fn percentile_us(times: &[Duration], p: f64) -> f64 {
    if times.is_empty() {
        return 0.0;
    }
    let mut v: Vec<f64> = times.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_passes_its_own_suite() {
        let report = run(&Builtin::default());
        assert!(report.failures().is_empty(), "{:?}", report.failures());
        assert!(report.cases.len() > 200, "{} cases", report.cases.len());
        assert_eq!(
            report.count(&Outcome::Declined),
            report
                .cases
                .iter()
                .filter(|c| c.name.contains("/ empty"))
                .count()
        );
        // Every answered case has its plan's shape, the same as the built-in's.
        for c in report.cases.iter().filter(|c| c.outcome == Outcome::Same) {
            assert!(c.plugin_plan.is_some(), "{}", c.name);
            assert_eq!(c.plugin_plan, c.builtin_plan, "{}", c.name);
        }
    }
}
