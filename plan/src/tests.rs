//! The plan rules' test tables: the one copy (they were kept twice, in the
//! host and in the guest SDK's harness). Each case names the exact
//! [`PlanError`] expected, so a case broken by a different rule fails.

use super::*;
use FieldKind::{Nested, Regular, Values};

fn view(start: u64, step: u64, count: u64) -> Piece {
    Piece::View(RowView::new(start, step, count))
}

/// A selection case: label, field, positions, pieces, the error expected.
type SelectionCase<'a> = (&'a str, FieldInfo, &'a [u64], Vec<Piece>, PlanError);
/// A frame case: label, pieces, limits, plan, the outcome expected.
type FrameCase<'a> = (
    &'a str,
    &'a [PieceInfo],
    PackLimits,
    FramePlan,
    Result<(), PlanError>,
);

fn regular(rows: u64) -> FieldInfo {
    FieldInfo::new(Regular, rows)
}

#[test]
fn accepts_exact_plans() {
    let cases: [(FieldInfo, &[u64], Vec<Piece>); 4] = [
        (
            regular(10),
            &[0, 2, 4, 5, 1],
            vec![view(0, 2, 3), Piece::Gather(vec![5, 1])],
        ),
        (regular(10), &[], vec![]),
        (
            FieldInfo::new(Nested, 3),
            &[2, 0, 1],
            vec![Piece::Concat(vec![2]), Piece::RowViews(vec![0, 1])],
        ),
        // Positions may repeat a row; so may the plan, in the same order.
        (
            FieldInfo::new(Values, 2),
            &[1, 1],
            vec![Piece::RowViews(vec![1, 1])],
        ),
    ];
    for (field, positions, pieces) in cases {
        let plan = SelectionPlan::new(pieces);
        assert_eq!(
            validate_selection(field, positions, &plan),
            Ok(()),
            "{plan:?}"
        );
    }
}

#[test]
fn refuses_wrong_plans() {
    use PlanError as E;
    let pos: &[u64] = &[0, 2, 4];
    let values = FieldInfo::new(Values, 2);
    let cases: Vec<SelectionCase> = vec![
        (
            "dropped row",
            regular(10),
            pos,
            vec![view(0, 2, 2)],
            E::TooFewRows {
                planned: 2,
                requested: 3,
            },
        ),
        (
            "extra row",
            regular(10),
            pos,
            vec![view(0, 2, 3), Piece::Gather(vec![4])],
            E::TooManyRows {
                planned: 4,
                requested: 3,
            },
        ),
        (
            "reordered",
            regular(10),
            pos,
            vec![Piece::Gather(vec![4, 2, 0])],
            E::WrongRow {
                index: 0,
                got: 4,
                want: 0,
            },
        ),
        (
            "duplicated",
            regular(10),
            pos,
            vec![view(0, 2, 2), Piece::Gather(vec![2])],
            E::WrongRow {
                index: 2,
                got: 2,
                want: 4,
            },
        ),
        (
            "step 0",
            regular(10),
            pos,
            vec![view(0, 0, 3)],
            E::ZeroStep { piece: 0 },
        ),
        (
            "count 0",
            regular(10),
            pos,
            vec![view(0, 1, 0)],
            E::EmptyPiece { piece: 0 },
        ),
        (
            "view out of range",
            regular(10),
            pos,
            vec![view(0, 5, 3)],
            E::ViewOutOfRange {
                piece: 0,
                last: 10,
                rows: 10,
            },
        ),
        (
            "row-views on regular",
            regular(10),
            pos,
            vec![Piece::RowViews(vec![0, 2, 4])],
            E::WrongKind {
                piece: 0,
                name: "row-views",
                kind: Regular,
            },
        ),
        (
            "concat on regular",
            regular(10),
            pos,
            vec![Piece::Concat(vec![0, 2, 4])],
            E::WrongKind {
                piece: 0,
                name: "concat",
                kind: Regular,
            },
        ),
        (
            "empty piece",
            regular(10),
            pos,
            vec![Piece::Gather(vec![]), view(0, 2, 3)],
            E::EmptyPiece { piece: 0 },
        ),
        (
            "overflow",
            regular(10),
            pos,
            vec![view(u64::MAX, u64::MAX, 3)],
            E::ViewOverflow { piece: 0 },
        ),
        (
            "absurd count",
            regular(10),
            pos,
            vec![view(0, 1, u64::MAX)],
            E::TooManyRows {
                planned: u64::MAX,
                requested: 3,
            },
        ),
        (
            "empty plan",
            regular(10),
            pos,
            vec![],
            E::TooFewRows {
                planned: 0,
                requested: 3,
            },
        ),
        (
            "concat on values",
            values,
            &[0],
            vec![Piece::Concat(vec![0])],
            E::WrongKind {
                piece: 0,
                name: "concat",
                kind: Values,
            },
        ),
        (
            "view on values",
            values,
            &[0],
            vec![Piece::View(RowView::single(0))],
            E::WrongKind {
                piece: 0,
                name: "view",
                kind: Values,
            },
        ),
        (
            "gather on values",
            values,
            &[0],
            vec![Piece::Gather(vec![0])],
            E::WrongKind {
                piece: 0,
                name: "gather",
                kind: Values,
            },
        ),
        (
            "row out of range",
            values,
            &[2],
            vec![Piece::RowViews(vec![2])],
            E::RowOutOfRange {
                piece: 0,
                row: 2,
                rows: 2,
            },
        ),
        (
            "rows for no position",
            regular(10),
            &[],
            vec![Piece::Gather(vec![1])],
            E::TooManyRows {
                planned: 1,
                requested: 0,
            },
        ),
    ];
    for (what, field, positions, pieces, want) in cases {
        let plan = SelectionPlan::new(pieces);
        assert_eq!(
            validate_selection(field, positions, &plan),
            Err(want),
            "{what}"
        );
    }
}

/// Found with the `plan_validate` fuzz target (input in
/// `fuzz/regressions/plan_validate/view-count-overflow`): a view whose count
/// is near u64::MAX after at least one planned row overflowed `next + len`
/// while building the error (a panic in debug builds, a wrong row count in
/// the message otherwise).
#[test]
fn fuzz_plan_validate_view_count_overflow() {
    let plan = SelectionPlan::new(vec![view(0, 1, 1), view(1, u64::MAX, u64::MAX)]);
    let err = validate_selection(regular(10), &[0, 1], &plan).unwrap_err();
    assert_eq!(
        err,
        PlanError::TooManyRows {
            planned: u64::MAX,
            requested: 2
        }
    );
}

#[test]
fn frame_rules() {
    use PlanError as E;
    let pieces = [PieceInfo::contiguous(10); 3];
    let big = [PieceInfo::contiguous(100)];
    let tight = PackLimits {
        max_frames: 2,
        max_frame_bytes: 15,
        small_threshold: 0,
    };
    let limits = PackLimits {
        max_frame_bytes: 20,
        ..tight
    };
    let two = FramePlan::new(vec![
        Frame::Coalesced(vec![0]),
        Frame::Coalesced(vec![1, 2]),
    ]);
    let single = |i| Frame::Single(i);
    let cases: Vec<FrameCase> = vec![
        (
            "coalesced over the limit",
            &pieces,
            tight,
            two.clone(),
            Err(E::FrameTooLarge {
                frame: 1,
                bytes: 20,
                limit: 15,
            }),
        ),
        ("coalesced at the limit", &pieces, limits, two, Ok(())),
        (
            "over the frame budget",
            &pieces,
            limits,
            FramePlan::one_per_piece(3),
            Err(E::TooManyFrames {
                frames: 3,
                budget: 2,
            }),
        ),
        (
            "piece twice",
            &pieces,
            limits,
            FramePlan::new(vec![single(0), Frame::Coalesced(vec![0, 1])]),
            Err(E::PieceRepeated { frame: 1, piece: 0 }),
        ),
        (
            "piece missing",
            &pieces,
            limits,
            FramePlan::new(vec![single(0), single(1)]),
            Err(E::PieceMissing { piece: 2 }),
        ),
        (
            "no such piece",
            &pieces,
            limits,
            FramePlan::new(vec![single(7)]),
            Err(E::NoSuchPiece {
                frame: 0,
                piece: 7,
                pieces: 3,
            }),
        ),
        (
            "empty coalesced frame",
            &pieces,
            PackLimits {
                max_frame_bytes: 30,
                ..limits
            },
            FramePlan::new(vec![
                Frame::Coalesced(vec![]),
                Frame::Coalesced(vec![0, 1, 2]),
            ]),
            Err(E::EmptyFrame { frame: 0 }),
        ),
        // A single large piece may exceed the limit, even inside `coalesced`.
        (
            "one large piece coalesced",
            &big,
            limits,
            FramePlan::new(vec![Frame::Coalesced(vec![0])]),
            Ok(()),
        ),
        (
            "nothing to send",
            &[],
            PackLimits {
                max_frames: 0,
                ..limits
            },
            FramePlan::default(),
            Ok(()),
        ),
    ];
    for (what, pieces, limits, plan, want) in cases {
        assert_eq!(validate_frames(pieces, &limits, &plan), want, "{what}");
    }
}

/// One message per rule, word for word: the host logs these and the guest
/// SDK's harness returns them.
#[test]
fn messages() {
    use PlanError as E;
    let cases = [
        (
            E::WrongKind {
                piece: 1,
                name: "concat",
                kind: Regular,
            },
            "piece 1: a concat piece does not apply to a regular field",
        ),
        (E::EmptyPiece { piece: 0 }, "piece 0 is empty"),
        (
            E::TooManyRows {
                planned: 4,
                requested: 3,
            },
            "plan covers 4 rows or more, 3 were requested",
        ),
        (E::ZeroStep { piece: 2 }, "piece 2: view with step 0"),
        (
            E::ViewOverflow { piece: 0 },
            "piece 0: the view's last row overflows u64",
        ),
        (
            E::ViewOutOfRange {
                piece: 0,
                last: 10,
                rows: 10,
            },
            "piece 0: view ends at row 10, the field has 10 rows",
        ),
        (
            E::RowOutOfRange {
                piece: 3,
                row: 7,
                rows: 2,
            },
            "piece 3 names row 7, the field has 2 rows",
        ),
        (
            E::WrongRow {
                index: 2,
                got: 2,
                want: 4,
            },
            "plan row #2 is row 2, position 2 asks for row 4",
        ),
        (
            E::TooFewRows {
                planned: 2,
                requested: 3,
            },
            "plan covers 2 rows, 3 were requested",
        ),
        (
            E::TooManyFrames {
                frames: 3,
                budget: 2,
            },
            "frame plan has 3 frames, the budget is 2",
        ),
        (
            E::NoSuchPiece {
                frame: 0,
                piece: 7,
                pieces: 3,
            },
            "frame 0 names piece 7, there are 3 pieces",
        ),
        (
            E::PieceRepeated { frame: 1, piece: 0 },
            "frame 1: piece 0 appears more than once",
        ),
        (
            E::EmptyFrame { frame: 0 },
            "frame 0 is an empty coalesced frame",
        ),
        (
            E::FrameTooLarge {
                frame: 1,
                bytes: 20,
                limit: 15,
            },
            "frame 1: coalesced frame of 20 bytes exceeds the 15-byte limit",
        ),
        (E::PieceMissing { piece: 2 }, "piece 2 appears in no frame"),
    ];
    for (err, text) in cases {
        assert_eq!(err.to_string(), text);
    }
}

#[test]
fn piece_fits_kinds() {
    let pieces = [
        view(0, 1, 1),
        Piece::Gather(vec![0]),
        Piece::RowViews(vec![0]),
        Piece::Concat(vec![0]),
    ];
    let fits: Vec<[bool; 3]> = pieces
        .iter()
        .map(|p| [p.fits(Regular), p.fits(Nested), p.fits(Values)])
        .collect();
    assert_eq!(
        fits,
        [
            [true, false, false],
            [true, false, false],
            [false, true, true],
            [false, true, false]
        ]
    );
}

#[test]
fn description_builder() {
    let d = Description::new("x", "1.0.0", "s")
        .selects(&[Regular, Regular])
        .packs();
    assert_eq!(
        d.capabilities,
        vec![Capability::Selection, Capability::Packing]
    );
    assert_eq!(d.kinds, vec![Regular, Nested, Values]);
}

#[test]
fn row_view_helpers() {
    assert_eq!(
        RowView::new(2, 3, 3).rows().collect::<Vec<_>>(),
        vec![2, 5, 8]
    );
    assert_eq!(RowView::new(2, 3, 3).last(), Some(8));
    assert_eq!(RowView::new(2, 3, 0).last(), None);
    assert_eq!(RowView::new(1, u64::MAX, 2).last(), None);
    assert_eq!(
        Piece::Gather(vec![4, 1]).rows().collect::<Vec<_>>(),
        vec![4, 1]
    );
    let plan = SelectionPlan::new(vec![
        Piece::View(RowView::new(0, 1, 5)),
        Piece::Concat(vec![1]),
    ]);
    assert_eq!(plan.row_count(), 6);
    assert_eq!(
        PackLimits {
            small_threshold: 0,
            ..PackLimits::default()
        }
        .small_threshold_or(7),
        7
    );
    assert_eq!(PackLimits::default().small_threshold_or(7), 64 << 10);
}
