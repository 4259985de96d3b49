//! What `stowd plugin check` and `stowd plugin bench` print: each answered
//! case's plan in brief ([`Shape`]: pieces by kind, bytes copied) next to the
//! built-in's, and decision times with the answered cases apart from the
//! declined ones (declining is cheap, so a mean over both says little).
//!
//! The column alignment is hand-written ([`aligned`]: each cell padded to
//! its column's widest, about 30 lines): none of the workspace's locked
//! dependencies draws tables, this machine's builds cannot fetch a new crate
//! (no crates.io access), and the widest table is the verbose check's 672
//! short rows.

use std::time::Duration;

use super::{Outcome, Report, percentile_us};
use crate::plan::{self, Frame, FramePlan, PieceInfo, Selected, SelectionPlan};

/// A plan in brief: how many pieces (selection) or frames (packing) of
/// each kind, and the row bytes it copies (gathers, concatenations,
/// coalesced or compacted frames); views and single contiguous frames copy
/// nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Shape {
    /// `piece` or `frame`.
    pub unit: &'static str,
    /// (kind, count), in first-seen order: `view`, `gather`, `row-views`,
    /// `concat`; `single`, `coalesced`.
    pub kinds: Vec<(&'static str, usize)>,
    /// Bytes the plan copies.
    pub copied: u64,
}

impl Shape {
    fn new(unit: &'static str, names: impl Iterator<Item = &'static str>, copied: u64) -> Self {
        let mut kinds: Vec<(&'static str, usize)> = Vec::new();
        for name in names {
            match kinds.iter_mut().find(|(k, _)| *k == name) {
                Some((_, n)) => *n += 1,
                None => kinds.push((name, 1)),
            }
        }
        Shape {
            unit,
            kinds,
            copied,
        }
    }

    /// Number of pieces or frames.
    pub fn len(&self) -> usize {
        self.kinds.iter().map(|(_, n)| n).sum()
    }

    /// True for a plan of no pieces.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A selection plan's shape; `selected` is its execution on the case's
    /// field, which gives the bytes gathers and concatenations copy.
    pub(super) fn of_selection(plan: &SelectionPlan, selected: &[Selected]) -> Self {
        let copied = plan
            .pieces
            .iter()
            .zip(selected)
            .map(|(piece, sel)| match (piece, sel) {
                (plan::Piece::Gather(_), Selected::Rows(t)) => t.payload_len() as u64,
                (plan::Piece::Concat(_), Selected::Packed { buffer, .. }) => buffer.len() as u64,
                _ => 0,
            })
            .sum();
        Shape::new("piece", plan.pieces.iter().map(plan::Piece::name), copied)
    }

    /// A frame plan's shape: coalesced frames copy their pieces, a single
    /// frame copies its piece when it is not contiguous.
    pub(super) fn of_frames(plan: &FramePlan, pieces: &[PieceInfo]) -> Self {
        let len = |i: &u32| pieces.get(*i as usize).map_or(0, |p| p.byte_len);
        let copied = plan
            .frames
            .iter()
            .map(|f| match f {
                Frame::Single(i) if pieces.get(*i as usize).is_some_and(|p| !p.contiguous) => {
                    len(i)
                }
                Frame::Single(_) => 0,
                Frame::Coalesced(v) => v.iter().map(len).sum(),
            })
            .sum();
        let names = plan.frames.iter().map(|f| match f {
            Frame::Single(_) => "single",
            Frame::Coalesced(_) => "coalesced",
        });
        Shape::new("frame", names, copied)
    }
}

impl std::fmt::Display for Shape {
    /// `1 piece: view`, `2 pieces: 2 view`, `3 pieces: 2 view + 1 gather`,
    /// `0 frames`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.len();
        write!(f, "{n} {}{}", self.unit, if n == 1 { "" } else { "s" })?;
        for (i, (kind, count)) in self.kinds.iter().enumerate() {
            let sep = if i == 0 { ": " } else { " + " };
            if n == 1 {
                write!(f, "{sep}{kind}")?;
            } else {
                write!(f, "{sep}{count} {kind}")?;
            }
        }
        Ok(())
    }
}

/// Rows of cells as text with aligned columns, two spaces apart; the first
/// row is the header. Columns flagged in `right` are right-aligned.
pub fn aligned(rows: &[Vec<String>], right: &[bool]) -> String {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let width: Vec<usize> = (0..cols)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            if c > 0 {
                line.push_str("  ");
            }
            let pad = width[c] - cell.chars().count();
            if right.get(c).copied().unwrap_or(false) {
                line.extend(std::iter::repeat_n(' ', pad));
                line.push_str(cell);
            } else {
                line.push_str(cell);
                line.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// The word for an outcome, the same in the table and the summary.
fn word(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Same => "ok",
        Outcome::Declined => "declined",
        Outcome::Failed(_) => "FAIL",
    }
}

fn plan_cells(shape: Option<&Shape>) -> [String; 2] {
    match shape {
        Some(s) => [s.to_string(), s.copied.to_string()],
        None => ["-".into(), "-".into()],
    }
}

/// `stowd plugin check`'s report after its first line: with `verbose`, a
/// table of every case (result, plan shapes, bytes copied by the plugin's
/// plan and by the built-in's); then one `FAIL  case: why` line per
/// failure, the counts, the bytes the answered cases copy and the decision
/// times.
pub fn check_table(report: &Report, verbose: bool) -> String {
    let mut out = String::new();
    if verbose {
        let mut rows = vec![
            [
                "result",
                "case",
                "plugin plan",
                "copied B",
                "built-in plan",
                "copied B",
            ]
            .map(String::from)
            .to_vec(),
        ];
        for c in &report.cases {
            let [pp, pc] = plan_cells(c.plugin_plan.as_ref());
            let [bp, bc] = plan_cells(c.builtin_plan.as_ref());
            rows.push(vec![
                word(&c.outcome).into(),
                c.name.clone(),
                pp,
                pc,
                bp,
                bc,
            ]);
        }
        out.push_str(&aligned(&rows, &[false, false, false, true, false, true]));
    }
    for c in &report.cases {
        if let Outcome::Failed(why) = &c.outcome {
            let why = why.lines().next().unwrap_or_default();
            out.push_str(&format!("FAIL  {}: {why}\n", c.name));
        }
    }
    let answered: Vec<_> = report
        .cases
        .iter()
        .filter(|c| c.outcome == Outcome::Same)
        .collect();
    let copied = |f: fn(&super::CaseResult) -> Option<&Shape>| -> u64 {
        answered.iter().filter_map(|c| f(c)).map(|s| s.copied).sum()
    };
    out.push_str(&format!(
        "\n{} cases: {} {} (same rows as the built-in), {} {}, {} failed\n",
        report.cases.len(),
        answered.len(),
        word(&Outcome::Same),
        report.count(&Outcome::Declined),
        word(&Outcome::Declined),
        report.failures().len(),
    ));
    if report.not_run > 0 {
        out.push_str(&format!(
            "stopped after {} failed cases in a row: {} cases not run (--all runs every case)\n",
            report
                .cases
                .iter()
                .rev()
                .take_while(|c| matches!(c.outcome, Outcome::Failed(_)))
                .count(),
            report.not_run,
        ));
    }
    out.push_str(&format!(
        "bytes copied by the {} answered cases: plugin {}, built-in {}\n",
        answered.len(),
        copied(|c| c.plugin_plan.as_ref()),
        copied(|c| c.builtin_plan.as_ref()),
    ));
    out.push_str("\ndecision time per call, one round:\n");
    out.push_str(&bench_table(std::slice::from_ref(report)));
    out
}

/// Decision-time table of one or more runs of the suite: the plugin's
/// answered cases, its declined cases (and failed ones, if any), each next
/// to the built-in's time on the same cases, with the number of calls.
pub fn bench_table(runs: &[Report]) -> String {
    let mut rows = vec![
        ["decision time (us)", "calls", "p50", "p90", "p99", "max"]
            .map(String::from)
            .to_vec(),
    ];
    for (label, want) in [
        ("answered", Outcome::Same),
        ("declined", Outcome::Declined),
        ("failed", Outcome::Failed(String::new())),
    ] {
        let cases = runs
            .iter()
            .flat_map(|r| &r.cases)
            .filter(|c| std::mem::discriminant(&c.outcome) == std::mem::discriminant(&want));
        let plugin: Vec<Duration> = cases.clone().map(|c| c.plugin_time).collect();
        let builtin: Vec<Duration> = cases.map(|c| c.builtin_time).collect();
        if plugin.is_empty() && label == "failed" {
            continue;
        }
        for (who, times) in [
            (format!("plugin, {label} cases"), &plugin),
            ("built-in, same cases".to_string(), &builtin),
        ] {
            let mut row = vec![who, times.len().to_string()];
            for q in [0.5, 0.9, 0.99, 1.0] {
                row.push(if times.is_empty() {
                    "-".into()
                } else {
                    format!("{:.2}", percentile_us(times, q))
                });
            }
            rows.push(row);
        }
    }
    aligned(&rows, &[false, true, true, true, true, true])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::conformance::{CaseResult, regular};
    use crate::tensor::Dtype;

    fn case(name: &str, outcome: Outcome, us: u64, plan: Option<Shape>) -> CaseResult {
        CaseResult {
            name: name.into(),
            outcome,
            plugin_time: Duration::from_micros(us),
            builtin_time: Duration::from_micros(1),
            plugin_plan: plan.clone(),
            builtin_plan: plan,
        }
    }

    #[test]
    fn tables_align_and_keep_answered_apart_from_declined() {
        let view = Shape::new("piece", ["view"].into_iter(), 0);
        let gather = Shape::new("piece", ["gather"].into_iter(), 24);
        let report = Report {
            cases: vec![
                case("select: a", Outcome::Same, 10, Some(view)),
                case("select: a longer name", Outcome::Same, 30, Some(gather)),
                case("select: b", Outcome::Declined, 2, None),
            ],
            not_run: 0,
        };
        let text = check_table(&report, true);
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("result    case "), "{text}");
        let col = lines[0].find("plugin plan").unwrap();
        assert_eq!(lines[1].find("1 piece: view"), Some(col), "{text}");
        assert_eq!(lines[2].find("1 piece: gather"), Some(col), "{text}");
        assert!(lines[3].starts_with("declined  select: b "), "{text}");
        assert!(!text.contains("skip"), "{text}");
        assert!(text.contains("3 cases: 2 ok (same rows as the built-in), 1 declined, 0 failed"));
        assert!(text.contains("bytes copied by the 2 answered cases: plugin 24, built-in 24"));
        let bench = bench_table(std::slice::from_ref(&report));
        let row = |label: &str| {
            bench
                .lines()
                .find(|l| l.starts_with(label))
                .unwrap_or_else(|| panic!("no {label} in {bench}"))
                .split_whitespace()
                .map(String::from)
                .collect::<Vec<_>>()
        };
        // answered: 10 and 30 us; declined: 2 us; no failed row.
        // Columns: label (3 words), calls, p50, p90, p99, max.
        assert_eq!(row("plugin, answered")[3], "2");
        assert_eq!(row("plugin, answered")[7], "30.00");
        assert_eq!(row("plugin, declined")[3], "1");
        assert_eq!(row("plugin, declined")[7], "2.00");
        assert_eq!(row("built-in, same cases")[3], "2");
        assert!(!bench.contains("failed"), "{bench}");
    }

    #[test]
    fn shapes_count_pieces_by_kind_and_the_bytes_they_copy() {
        let field = regular(Dtype::Float32, 8, 2); // 8 bytes a row
        let plan = SelectionPlan::new(vec![
            plan::Piece::View(plan::RowView::new(0, 2, 2)),
            plan::Piece::Gather(vec![5, 3, 7]),
            plan::Piece::View(plan::RowView::single(1)),
        ]);
        let sel = plan::execute_selection(&field, &plan).unwrap();
        let shape = Shape::of_selection(&plan, &sel);
        assert_eq!(shape.to_string(), "3 pieces: 2 view + 1 gather");
        assert_eq!(shape.copied, 3 * 8);
        let one = SelectionPlan::single(plan::Piece::View(plan::RowView::single(0)));
        let sel = plan::execute_selection(&field, &one).unwrap();
        assert_eq!(Shape::of_selection(&one, &sel).to_string(), "1 piece: view");

        let pieces = [
            PieceInfo::contiguous(100),
            PieceInfo::strided(40),
            PieceInfo::contiguous(7),
            PieceInfo::contiguous(9),
        ];
        let frames = FramePlan::new(vec![
            Frame::Single(0),
            Frame::Single(1),
            Frame::Coalesced(vec![2, 3]),
        ]);
        let shape = Shape::of_frames(&frames, &pieces);
        assert_eq!(shape.to_string(), "3 frames: 2 single + 1 coalesced");
        assert_eq!(shape.copied, 40 + 7 + 9);
        assert_eq!(
            Shape::of_frames(&FramePlan::default(), &[]).to_string(),
            "0 frames"
        );
    }
}
