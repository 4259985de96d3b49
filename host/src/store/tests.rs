//! Unit tests of the store: puts, gets, overwrites, clears, capacity and
//! runs, on in-memory extents.

use super::*;
use crate::batch::{Cell, Field, Value};
use crate::extent::Received;
use crate::shm::SegmentStore;
use crate::tensor::{Dtype, Tensor};
use bytes::Bytes;

fn s(v: &str) -> Value {
    Value::Str(v.into())
}

fn values(v: &[&str]) -> Columns {
    smallvec::smallvec![Column::Values(v.iter().map(|x| s(x)).collect())]
}

fn got(unit: &Unit, g: &[u64], field: &str) -> Vec<Cell> {
    unit.get(g, &[field.to_string()]).unwrap().remove(0).cells()
}

/// The first column a get of `field` at `g` touched.
fn first_column(unit: &Unit, g: &[u64], field: &str) -> ColumnRef {
    unit.get(g, &[field.into()])
        .unwrap()
        .remove(0)
        .columns
        .remove(0)
}

#[test]
fn put_get_overwrite_clear() {
    let unit = Unit::new("u0", None);
    unit.put(&[1, 2], vec![("a".into(), values(&["x", "yy"]))])
        .unwrap();
    assert_eq!(unit.stats().bytes, 3);
    unit.put(&[2], vec![("a".into(), values(&["zzzz"]))])
        .unwrap();
    assert_eq!(
        unit.stats(),
        UnitStats {
            keys: 2,
            rows: 2,
            bytes: 5,
            capacity: None
        }
    );
    assert_eq!(
        got(&unit, &[2, 1], "a"),
        vec![Cell::Value(s("zzzz")), Cell::Value(s("x"))]
    );
    let err = unit.get(&[1, 9], &["a".into()]).unwrap_err();
    assert!(err.to_string().starts_with("[TQKeyNotFound] "));
    assert!(unit.get(&[1], &["nope".into()]).is_err());
    assert_eq!(unit.clear(&[1, 7], None).unwrap(), 1);
    assert_eq!(unit.stats().bytes, 4);
}

#[test]
fn fields_clear_one_by_one() {
    let unit = Unit::new("u0", None);
    unit.put(
        &[1, 2],
        vec![
            ("a".into(), values(&["x", "y"])),
            ("b".into(), values(&["p", "q"])),
        ],
    )
    .unwrap();
    assert_eq!(
        unit.stats(),
        UnitStats {
            keys: 4,
            rows: 2,
            bytes: 4,
            capacity: None
        }
    );
    assert_eq!(unit.clear(&[1], Some(&["a".to_string()])).unwrap(), 1);
    assert_eq!(
        unit.stats(),
        UnitStats {
            keys: 3,
            rows: 2,
            bytes: 3,
            capacity: None
        }
    );
    assert_eq!(
        unit.clear(&[1], Some(&["b".to_string(), "a".to_string()]))
            .unwrap(),
        1
    );
    assert_eq!(
        unit.stats(),
        UnitStats {
            keys: 2,
            rows: 1,
            bytes: 2,
            capacity: None
        }
    );
    assert_eq!(got(&unit, &[2], "b"), vec![Cell::Value(s("q"))]);
    assert_eq!(unit.clear(&[2], None).unwrap(), 2);
    assert_eq!(
        unit.stats(),
        UnitStats {
            keys: 0,
            rows: 0,
            bytes: 0,
            capacity: None
        }
    );
}

#[test]
fn puts_are_all_or_nothing() {
    let unit = Unit::new("u0", Some(10));
    unit.put(&[1], vec![("a".into(), values(&["12345"]))])
        .unwrap();
    let before = unit.stats();
    assert!(matches!(
        unit.put(&[2, 2], vec![("a".into(), values(&["1", "2"]))]),
        Err(StoreError::DuplicateIndex(2))
    ));
    assert!(matches!(
        unit.put(
            &[2, 3],
            vec![
                ("a".into(), values(&["1", "2"])),
                ("b".into(), values(&["1"]))
            ]
        ),
        Err(StoreError::RowCount { .. })
    ));
    assert!(matches!(
        unit.put(&[2], vec![("a".into(), values(&["123456"]))]),
        Err(StoreError::Capacity { .. })
    ));
    assert_eq!(unit.stats(), before);
    assert!(unit.get(&[2], &["a".into()]).is_err());
    // Overwriting frees the old bytes first.
    unit.put(&[1], vec![("a".into(), values(&["1234567890"]))])
        .unwrap();
    assert_eq!(unit.stats().bytes, 10);
}

#[test]
fn check_put_stores_nothing() {
    let unit = Unit::new("u0", Some(4));
    unit.put(&[1], vec![("a".into(), values(&["12"]))]).unwrap();
    let too_big = [("a".into(), values(&["123"]))];
    assert!(matches!(
        unit.check_put(&[2], &too_big),
        Err(StoreError::Capacity { .. })
    ));
    // Overwriting index 1 frees its 2 bytes first.
    unit.check_put(&[1], &too_big).unwrap();
    assert!(matches!(
        unit.check_put(&[2, 2], &[]),
        Err(StoreError::DuplicateIndex(2))
    ));
    assert_eq!(
        unit.stats(),
        UnitStats {
            keys: 1,
            rows: 1,
            bytes: 2,
            capacity: Some(4)
        }
    );
}

fn frame_tensor(rows: u64, cols: u64) -> (Bytes, Tensor) {
    let data: Vec<u8> = (0..rows * cols)
        .flat_map(|v| (v as f32).to_le_bytes())
        .collect();
    let frame = Bytes::from(data);
    let t = Tensor::contiguous(frame.clone(), Dtype::Float32, vec![rows, cols]).unwrap();
    (frame, t)
}

/// Rows `start..start + count` of `t` as a regular column over the
/// received frame they lie in (zero copy).
fn view_column(received: &Received, t: &Tensor, start: u64, count: u64) -> Column {
    let v = t.rows_view(start, 1, count).unwrap();
    let (extent, offset, zero_copy) = received.locate_or_own(v.buffer());
    assert!(zero_copy);
    Column::regular(extent, offset, &v)
}

#[test]
fn clearing_the_last_row_frees_the_extent() {
    let (frame, t) = frame_tensor(4, 4);
    let received = Received::frames(std::slice::from_ref(&frame));
    let unit = Unit::new("u0", None);
    unit.put(
        &[0, 1, 2, 3],
        vec![(
            "t".into(),
            smallvec::smallvec![Column::from_field(Field::Regular(t), &received)],
        )],
    )
    .unwrap();
    drop(received);
    assert!(!frame.is_unique());
    unit.clear(&[0, 1, 2], None).unwrap();
    assert!(!frame.is_unique());
    unit.put(&[3], vec![("t".into(), values(&["over"]))])
        .unwrap();
    assert!(
        frame.is_unique(),
        "the frame is still pinned after its last row was overwritten"
    );
}

#[test]
fn a_fields_columns_go_to_their_group_in_order_whichever_comes_first() {
    // Field a is two pieces, rows 0-1 from frame 2 and rows 2-3 from
    // frame 1; b is frame 1 again, c frame 2 again. Frame 2 is the
    // first regular column's, so a's first piece and c are moved into one
    // allocation; a's second piece and b stay on their own. Every row
    // reads back from where it was put.
    let (frame1, t1) = frame_tensor(8, 2);
    let (frame2, t2) = frame_tensor(6, 2);
    let received = Received::frames(&[frame1.clone(), frame2.clone()]);
    let view = |t: &Tensor, start: u64, count: u64| view_column(&received, t, start, count);
    let g = [20, 21, 22, 23];
    let unit = Unit::new("u0", None);
    unit.put(
        &g,
        vec![
            (
                "a".into(),
                smallvec::smallvec![view(&t2, 0, 2), view(&t1, 6, 2)],
            ),
            ("b".into(), smallvec::smallvec![view(&t1, 0, 4)]),
            ("c".into(), smallvec::smallvec![view(&t2, 2, 4)]),
        ],
    )
    .unwrap();
    let rows = |t: &Tensor, rows: std::ops::Range<u64>| -> Vec<Cell> {
        rows.map(|r| Cell::Tensor(t.row_tensor(r).unwrap()))
            .collect()
    };
    let mut a = rows(&t2, 0..2);
    a.extend(rows(&t1, 6..8));
    assert_eq!(got(&unit, &g, "a"), a);
    assert_eq!(got(&unit, &g, "b"), rows(&t1, 0..4));
    assert_eq!(got(&unit, &g, "c"), rows(&t2, 2..6));
    let column = |g: &[u64], f: &str| first_column(&unit, g, f);
    assert!(column(&g[..2], "a").shares_allocation_with(&column(&g, "c")));
    assert!(!column(&g[2..], "a").shares_allocation_with(&column(&g, "b")));
    assert!(!column(&g[..2], "a").shares_allocation_with(&column(&g[2..], "a")));
}

#[test]
fn a_puts_columns_of_one_extent_share_an_allocation_and_free_it_with_their_last_row() {
    // Fields a and b are views of frame 1, c of frame 2, d plain values:
    // a and b are stored in one allocation, c and d each on their own.
    let (frame1, t1) = frame_tensor(8, 2);
    let (frame2, t2) = frame_tensor(4, 2);
    let received = Received::frames(&[frame1.clone(), frame2.clone()]);
    let view = |t: &Tensor, start: u64| view_column(&received, t, start, 4);
    let g = [10, 11, 12, 13];
    let unit = Unit::new("u0", None);
    unit.put(
        &g,
        vec![
            ("a".into(), smallvec::smallvec![view(&t1, 0)]),
            ("d".into(), values(&["p", "q", "r", "s"])),
            ("c".into(), smallvec::smallvec![view(&t2, 0)]),
            ("b".into(), smallvec::smallvec![view(&t1, 4)]),
        ],
    )
    .unwrap();
    drop(received);
    let rows = |t: &Tensor, start: u64| -> Vec<Cell> {
        (start..start + 4)
            .map(|r| Cell::Tensor(t.row_tensor(r).unwrap()))
            .collect()
    };
    assert_eq!(got(&unit, &g, "a"), rows(&t1, 0));
    assert_eq!(got(&unit, &g, "b"), rows(&t1, 4));
    assert_eq!(got(&unit, &g, "c"), rows(&t2, 0));
    assert_eq!(got(&unit, &g, "d")[3], Cell::Value(s("s")));
    let column = |f: &str| first_column(&unit, &g, f);
    assert!(column("a").shares_allocation_with(&column("b")));
    assert!(!column("a").shares_allocation_with(&column("c")));
    assert!(!column("c").shares_allocation_with(&column("d")));
    // One field of the group overwritten: the other reads the same, and
    // frame 1 stays pinned by it.
    unit.put(&g, vec![("a".into(), values(&["1", "2", "3", "4"]))])
        .unwrap();
    assert_eq!(got(&unit, &g, "b"), rows(&t1, 4));
    let c_rows = rows(&t2, 0)[2..].to_vec();
    // Nothing but the unit holds the frames from here.
    drop((t1, t2));
    assert!(!frame1.is_unique());
    // The group's last row gone: the allocation and frame 1 with it;
    // frame 2 is still held by c.
    unit.clear(&g[..2], None).unwrap();
    assert!(!frame1.is_unique());
    unit.put(&g[2..], vec![("b".into(), values(&["x", "y"]))])
        .unwrap();
    assert!(
        frame1.is_unique(),
        "frame 1 is still pinned after the last row of its group went"
    );
    assert_eq!(got(&unit, &g[2..], "c"), c_rows);
    drop(c_rows);
    assert!(!frame2.is_unique());
}

#[test]
fn a_put_of_one_column_a_field_in_one_extent_is_kept_whole_until_its_last_row_goes() {
    // Fields a, b and c each one view of frame 1: taken whole into one
    // allocation. Overwritten, cleared and got in every order, each
    // field reads its own rows, and the frame goes with the last of them.
    let (frame, t) = frame_tensor(12, 2);
    let received = Received::frames(std::slice::from_ref(&frame));
    let g = [20, 21, 22, 23];
    let unit = Unit::new("u0", None);
    let fields = |names: &[&str]| -> Vec<PutField> {
        names
            .iter()
            .enumerate()
            .map(|(f, n)| {
                let c = view_column(&received, &t, 4 * f as u64, 4);
                ((*n).into(), smallvec::smallvec![c])
            })
            .collect()
    };
    unit.put(&g, fields(&["a", "b", "c"])).unwrap();
    drop(received);
    let rows = |start: u64, r: std::ops::Range<usize>| -> Vec<Cell> {
        (start..start + 4)
            .map(|r| Cell::Tensor(t.row_tensor(r).unwrap()))
            .collect::<Vec<_>>()[r]
            .to_vec()
    };
    assert_eq!(got(&unit, &g, "a"), rows(0, 0..4));
    assert_eq!(got(&unit, &g, "b"), rows(4, 0..4));
    assert_eq!(got(&unit, &g, "c"), rows(8, 0..4));
    assert_eq!(unit.stats().bytes, 3 * 4 * 8);
    let column = |g: &[u64], f: &str| first_column(&unit, g, f);
    assert!(column(&g, "a").shares_allocation_with(&column(&g, "c")));
    // A field overwritten, another cleared at some rows, the third at all.
    unit.put(&g[..2], vec![("a".into(), values(&["p", "q"]))])
        .unwrap();
    unit.clear(&g[1..3], Some(&["b".to_string()])).unwrap();
    unit.clear(&g, Some(&["c".to_string()])).unwrap();
    let expected_a: Vec<Cell> = [Cell::Value(s("p")), Cell::Value(s("q"))]
        .into_iter()
        .chain(rows(0, 2..4))
        .collect();
    assert_eq!(got(&unit, &g, "a"), expected_a);
    assert_eq!(
        got(&unit, &[20, 23], "b"),
        [rows(4, 0..1), rows(4, 3..4)].concat()
    );
    assert!(unit.get(&[21], &["b".to_string()]).is_err());
    assert!(unit.get(&[20], &["c".to_string()]).is_err());
    assert_eq!(unit.stats().bytes, 2 + 2 * 8 + 2 * 8);
    drop((t, expected_a));
    assert!(!frame.is_unique());
    unit.clear(&[20, 23], Some(&["b".to_string()])).unwrap();
    assert!(
        !frame.is_unique(),
        "a's rows 22 and 23 still hold the frame"
    );
    unit.put(&g[2..], vec![("a".into(), values(&["r", "s"]))])
        .unwrap();
    assert!(
        frame.is_unique(),
        "the frame is still pinned after the put's last row went"
    );
    assert_eq!(unit.stats().bytes, 4);
}

#[test]
fn rows_put_together_come_back_as_one_run_across_units() {
    // One frame of 8 rows, split over two units as strided views (the
    // g % 2 routing), got back in put order: one run, one slice of the
    // frame, no copy.
    let (frame, t) = frame_tensor(8, 2);
    let received = Received::frames(std::slice::from_ref(&frame));
    let units = [Unit::new("u0", None), Unit::new("u1", None)];
    for (u, unit) in units.iter().enumerate() {
        let view = t.rows_view(u as u64, 2, 4).unwrap();
        let (extent, offset, zero_copy) = received.locate_or_own(view.buffer());
        assert!(zero_copy);
        let g: Vec<u64> = (0..4).map(|i| u as u64 + 2 * i).collect();
        unit.put(
            &g,
            vec![(
                "t".into(),
                smallvec::smallvec![Column::regular(extent, offset, &view)],
            )],
        )
        .unwrap();
    }
    let mut all = Rows::default();
    for g in 0..8u64 {
        all.append(
            units[(g % 2) as usize]
                .get(&[g], &["t".into()])
                .unwrap()
                .remove(0),
        );
    }
    let runs = all.runs();
    assert_eq!(runs.len(), 1);
    let bytes = runs[0].bytes();
    assert_eq!(bytes.as_ptr(), frame.as_ptr());
    assert_eq!(bytes.len(), frame.len());
    // Reversed order: every row its own run, each a slice of the frame.
    let mut rev = Rows::default();
    for g in (0..8u64).rev() {
        rev.append(
            units[(g % 2) as usize]
                .get(&[g], &["t".into()])
                .unwrap()
                .remove(0),
        );
    }
    let runs = rev.runs();
    assert_eq!(runs.len(), 8);
    assert_eq!(runs[0].bytes().as_ptr(), frame.slice(7 * 8..).as_ptr());
    let cells = rev.cells();
    assert_eq!(cells[0], Cell::Tensor(t.row_tensor(7).unwrap()));
}

#[test]
fn the_fields_of_a_get_share_their_extents_places() {
    // Three fields in one frame over two units (the g % 2 routing), one
    // in another frame: a get of all of them in put order takes each
    // frame's place once, and every field's runs are what it gets alone.
    let (frame, t) = frame_tensor(12, 2);
    let (other, t2) = frame_tensor(4, 2);
    let received = Received::frames(&[frame.clone(), other.clone()]);
    let units = [Unit::new("u0", None), Unit::new("u1", None)];
    for (u, unit) in units.iter().enumerate() {
        let g: Vec<u64> = (0..2).map(|i| u as u64 + 2 * i).collect();
        let mut fields: Vec<PutField> = (0..3u64)
            .map(|f| {
                let view = t.rows_view(4 * f + u as u64, 2, 2).unwrap();
                let (extent, offset, zero_copy) = received.locate_or_own(view.buffer());
                assert!(zero_copy);
                let c = Column::regular(extent, offset, &view);
                (format!("f{f}").into(), smallvec::smallvec![c])
            })
            .collect();
        let view = t2.rows_view(u as u64, 2, 2).unwrap();
        let (extent, offset, _) = received.locate_or_own(view.buffer());
        let c = Column::regular(extent, offset, &view);
        fields.push(("o".into(), smallvec::smallvec![c]));
        unit.put(&g, fields).unwrap();
    }
    let names = ["f0", "f1", "f2", "o"];
    let mut snapshots = Snapshots::default();
    for name in names {
        let mut rows = Rows::default();
        for g in 0..4u64 {
            rows.append(
                units[(g % 2) as usize]
                    .get(&[g], &[name.into()])
                    .unwrap()
                    .remove(0),
            );
        }
        let shared = rows.runs_with(&mut snapshots);
        let alone = rows.runs();
        assert_eq!(shared.len(), alone.len(), "field {name}");
        for (a, b) in shared.iter().zip(&alone) {
            assert_eq!(a.bytes(), b.bytes(), "field {name}");
            assert_eq!(a.bytes().as_ptr(), b.bytes().as_ptr(), "field {name}");
        }
        let want = match name {
            "o" => &other[..],
            _ => {
                let f: usize = name[1..].parse().unwrap();
                &frame[f * 32..(f + 1) * 32]
            }
        };
        assert_eq!(shared.len(), 1, "field {name}: one run in put order");
        assert_eq!(&shared[0].bytes()[..], want, "field {name}");
    }
    assert_eq!(snapshots.len(), 2, "one place a frame, for all four fields");
}

#[test]
fn a_get_in_put_order_sees_an_overwritten_or_cleared_row() {
    let unit = Unit::new("u0", None);
    unit.put(
        &[1, 2, 3, 4],
        vec![("a".into(), values(&["a1", "a2", "a3", "a4"]))],
    )
    .unwrap();
    assert_eq!(
        got(&unit, &[1, 2, 3, 4], "a"),
        ["a1", "a2", "a3", "a4"].map(|v| Cell::Value(s(v))).to_vec()
    );
    unit.put(&[2], vec![("a".into(), values(&["b2"]))]).unwrap();
    assert_eq!(
        got(&unit, &[1, 2, 3, 4], "a"),
        ["a1", "b2", "a3", "a4"].map(|v| Cell::Value(s(v))).to_vec()
    );
    unit.clear(&[3], None).unwrap();
    assert!(matches!(
        unit.get(&[1, 2, 3, 4], &["a".into()]),
        Err(StoreError::KeyNotFound { index: 3, .. })
    ));
    assert_eq!(
        got(&unit, &[4, 1], "a"),
        ["a4", "a1"].map(|v| Cell::Value(s(v))).to_vec()
    );
}

#[test]
fn sharing_puts_the_extents_of_a_get_into_one_segment_in_request_order() {
    // Two puts (two frames), rows read back across both: after the
    // move into shared memory they are one run of one segment.
    let shm = SegmentStore::new(std::time::Duration::from_secs(5), 1 << 30);
    let unit = Unit::new("u0", None);
    let (f1, t1) = frame_tensor(4, 2);
    let (f2, t2) = frame_tensor(4, 2);
    for (g, f, t) in [([0u64, 1, 2, 3], &f1, t1), ([4, 5, 6, 7], &f2, t2)] {
        let received = Received::frames(std::slice::from_ref(f));
        unit.put(
            &g,
            vec![(
                "t".into(),
                smallvec::smallvec![Column::from_field(Field::Regular(t), &received)],
            )],
        )
        .unwrap();
    }
    let all: Vec<u64> = (0..8).collect();
    let rows = unit.get(&all, &["t".into()]).unwrap().remove(0);
    assert_eq!(rows.runs().len(), 2, "two frames before the move");
    rows.share(&shm).unwrap();
    let runs = rows.runs();
    assert_eq!(runs.len(), 1, "one segment after the move");
    let Run::Tensor { segment, base, .. } = &runs[0] else {
        panic!()
    };
    assert!(segment.is_some());
    assert_eq!(&runs[0].bytes()[..], [&f1[..], &f2[..]].concat().as_slice());
    assert_eq!(base.len(), 64);
    // A second share copies nothing more.
    let before = shm.counts().0;
    unit.get(&all, &["t".into()]).unwrap()[0]
        .share(&shm)
        .unwrap();
    assert_eq!(shm.counts().0, before);
    // The frames are no longer pinned by the store.
    assert!(f1.is_unique() && f2.is_unique());
    drop(runs);
    drop(rows);
    unit.clear(&all, None).unwrap();
    assert_eq!(shm.counts().0, 0, "the segment outlived its rows");
}

#[test]
fn overwriting_many_rows_keeps_counts() {
    let unit = Unit::new("u0", None);
    let g: Vec<u64> = (0..1000).collect();
    let v: Vec<String> = g.iter().map(|i| i.to_string()).collect();
    let col = || smallvec::smallvec![Column::Values(v.iter().map(|x| s(x)).collect())];
    unit.put(&g, vec![("a".into(), col()), ("b".into(), col())])
        .unwrap();
    unit.put(
        &g[500..],
        vec![(
            "a".into(),
            smallvec::smallvec![Column::Values(g[500..].iter().map(|_| s("z")).collect())],
        )],
    )
    .unwrap();
    let st = unit.stats();
    assert_eq!((st.keys, st.rows), (2000, 1000));
    assert_eq!(
        got(&unit, &[499, 500], "a"),
        vec![Cell::Value(s("499")), Cell::Value(s("z"))]
    );
    assert_eq!(unit.clear(&g, None).unwrap(), 2000);
    assert_eq!(
        unit.stats(),
        UnitStats {
            keys: 0,
            rows: 0,
            bytes: 0,
            capacity: None
        }
    );
}

/// A put counts each row's new fields once it has stored them all: rows
/// whose fields are partly new, wholly new or all overwritten come out
/// with the right counts, and clearing fields one at a time drops a row
/// exactly when its last field goes.
#[test]
fn a_put_of_new_and_old_fields_counts_each_rows_fields() {
    let unit = Unit::new("u0", None);
    unit.put(
        &[1, 2],
        vec![
            ("a".into(), values(&["a1", "a2"])),
            ("b".into(), values(&["b1", "b2"])),
        ],
    )
    .unwrap();
    // Row 2: b old, c new; row 3: both new; row 1 untouched.
    unit.put(
        &[2, 3],
        vec![
            ("b".into(), values(&["B2", "b3"])),
            ("c".into(), values(&["c2", "c3"])),
        ],
    )
    .unwrap();
    let st = unit.stats();
    assert_eq!((st.keys, st.rows), (7, 3));
    // Nothing new at all: the counts stay.
    unit.put(&[3, 2], vec![("c".into(), values(&["C3", "C2"]))])
        .unwrap();
    let st = unit.stats();
    assert_eq!((st.keys, st.rows), (7, 3));
    assert_eq!(
        got(&unit, &[2, 3], "c"),
        vec![Cell::Value(s("C2")), Cell::Value(s("C3"))]
    );
    // Row 2 has a, b and c: it stays until all three are cleared.
    for (field, rows) in [("a", 3), ("c", 3), ("b", 2)] {
        assert_eq!(unit.clear(&[2], Some(&[field.to_string()])).unwrap(), 1);
        assert_eq!(unit.stats().rows, rows, "after clearing {field} of row 2");
    }
    assert_eq!(unit.clear(&[1, 3], None).unwrap(), 4);
    assert_eq!(unit.stats().rows, 0);
}

/// A full unit still takes an overwrite that frees what it adds, and
/// refuses one row more; `check_put` agrees with `put`, and a refused put
/// changes nothing.
#[test]
fn capacity_counts_overwritten_rows_as_freed() {
    let unit = Unit::new("u0", Some(10));
    unit.put(&[1, 2], vec![("a".into(), values(&["xxxx", "yyyy"]))])
        .unwrap();
    assert_eq!(unit.stats().bytes, 8);
    // 8 + 4 > 10 unless row 2's 4 bytes are counted as freed.
    let over = vec![("a".into(), values(&["zzzz"]))];
    unit.check_put(&[2], &over).unwrap();
    unit.put(&[2], over).unwrap();
    assert_eq!(unit.stats().bytes, 8);
    // Overwriting with more than is freed: 8 - 4 + 6 = 10 still fits.
    unit.put(&[2], vec![("a".into(), values(&["wwwwww"]))])
        .unwrap();
    assert_eq!(unit.stats().bytes, 10);
    let more = vec![("a".into(), values(&["v"]))];
    assert!(matches!(
        unit.check_put(&[3], &more),
        Err(StoreError::Capacity { .. })
    ));
    assert!(matches!(
        unit.put(&[3], more),
        Err(StoreError::Capacity { .. })
    ));
    assert_eq!(got(&unit, &[2], "a"), vec![Cell::Value(s("wwwwww"))]);
    assert_eq!(unit.stats().bytes, 10);
}

/// The small map of a get's columns and extents answers each key's first
/// value, and makes it once, across the change from a scan to a hash map.
#[test]
fn a_few_map_keeps_first_values_past_its_inline_list() {
    let mut m: rows::FewMap<u32, u32> = rows::FewMap::default();
    let mut made = 0u32;
    for round in 0..3 {
        for k in (0..40u32).rev() {
            let v = m.get_or_insert_with(k * 7, || {
                made += 1;
                k + 1000 * round
            });
            assert_eq!(v, k, "key {} in round {round}", k * 7);
        }
    }
    assert_eq!(made, 40);
    assert!(matches!(m, rows::FewMap::Many(_)));
    let mut few: rows::FewMap<u64, u32> = rows::FewMap::default();
    for k in 0..8u64 {
        assert_eq!(few.get_or_insert_with(k, || k as u32), k as u32);
    }
    assert!(matches!(few, rows::FewMap::Few(_)));
}

/// The unit against a plain map of (index, field) -> value, over random
/// puts (new and stored indexes, in order or shuffled, fields split into
/// pieces; plain values, or regular rows sliced from one frame, whose
/// columns are taken whole or grouped), clears of some fields or of all,
/// and gets. Row numbers are
/// given back and taken again many times, over enough indexes to span
/// many pages of a field's entries; the sizes and every value must agree
/// after each step, and again after a snapshot is loaded into a new unit.
#[test]
fn random_puts_and_clears_agree_with_a_plain_map() {
    use std::collections::{BTreeMap, BTreeSet};
    let unit = Unit::new("u0", None);
    let mut model: BTreeMap<(u64, String), String> = BTreeMap::new();
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move |n: u64| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    };
    let names = ["a", "b", "c", "d", "e"];
    // The next number a regular row holds.
    let mut serial = 0u64;
    let stored_len = |v: &str| {
        if v.starts_with('#') {
            8
        } else {
            v.len() as u64
        }
    };
    let cell_of = |v: &str| match v.strip_prefix('#') {
        Some(n) => Cell::Tensor(
            Tensor::contiguous(
                Bytes::copy_from_slice(&n.parse::<u64>().unwrap().to_le_bytes()),
                Dtype::Uint64,
                vec![1],
            )
            .unwrap(),
        ),
        None => Cell::Value(s(v)),
    };
    let check = |unit: &Unit, model: &BTreeMap<(u64, String), String>, when: &str| {
        let rows: BTreeSet<u64> = model.keys().map(|(g, _)| *g).collect();
        let bytes: u64 = model.values().map(|v| stored_len(v)).sum();
        let st = unit.stats();
        assert_eq!(
            (st.keys, st.rows, st.bytes),
            (model.len() as u64, rows.len() as u64, bytes),
            "{when}"
        );
        for name in names {
            let (g, want): (Vec<u64>, Vec<Cell>) = model
                .iter()
                .filter(|((_, f), _)| f == name)
                .map(|((g, _), v)| (*g, cell_of(v)))
                .unzip();
            if !g.is_empty() {
                assert_eq!(got(unit, &g, name), want, "{when}: field {name}");
            }
        }
        // Every field at once, at the indexes that have them all (in
        // runs and not), and one index more that lacks one.
        let all: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let full: Vec<u64> = rows
            .iter()
            .copied()
            .filter(|g| all.iter().all(|f| model.contains_key(&(*g, f.clone()))))
            .collect();
        if !full.is_empty() {
            let reply = unit.get(&full, &all).unwrap();
            for (f, rows) in all.iter().zip(reply) {
                let want: Vec<Cell> = full
                    .iter()
                    .map(|g| cell_of(&model[&(*g, f.clone())]))
                    .collect();
                assert_eq!(rows.cells(), want, "{when}: field {f} of a get of all");
            }
        }
        if let Some(&g) = rows.iter().find(|g| !full.contains(g)) {
            let mut asked = full.clone();
            asked.push(g);
            assert!(unit.get(&asked, &all).is_err(), "{when}: {g} lacks a field");
        }
    };
    for step in 0..300 {
        match next(10) {
            0..=5 => {
                let n = 1 + next(150);
                let (base, stride) = (next(400), 1 + next(3));
                let mut idx: Vec<u64> = (0..n).map(|i| base + i * stride).collect();
                if next(3) == 0 {
                    for i in (1..idx.len()).rev() {
                        idx.swap(i, next(i as u64 + 1) as usize);
                    }
                }
                let mut chosen: Vec<&str> =
                    names.iter().copied().filter(|_| next(2) == 0).collect();
                if chosen.is_empty() {
                    chosen.push(names[next(5) as usize]);
                }
                let mut fields = Vec::new();
                // Half the puts are regular rows (a number each, `#n` in
                // the model), every field a slice of one frame, as a
                // request brings them: kept whole when each field is one
                // piece, the pieces grouped otherwise.
                let regular = next(2) == 0;
                let n = idx.len() as u64;
                let first = serial;
                serial += n * chosen.len() as u64;
                let frame: Bytes = (first..serial).flat_map(|v| v.to_le_bytes()).collect();
                let received = Received::frames(std::slice::from_ref(&frame));
                for (k, name) in chosen.into_iter().enumerate() {
                    let vals: Vec<String> = idx
                        .iter()
                        .enumerate()
                        .map(|(i, g)| match regular {
                            true => format!("#{}", first + k as u64 * n + i as u64),
                            false => format!("{name}{step}:{}", "x".repeat((g % 5) as usize)),
                        })
                        .collect();
                    let t = Tensor::contiguous(
                        frame.slice(k * n as usize * 8..(k + 1) * n as usize * 8),
                        Dtype::Uint64,
                        vec![n, 1],
                    )
                    .unwrap();
                    // One to three pieces.
                    let len = vals.len() as u64;
                    let mut cuts = [0, next(len + 1), next(len + 1), len];
                    if next(2) == 0 {
                        cuts = [0, 0, 0, len];
                    }
                    cuts.sort_unstable();
                    let mut columns = Columns::new();
                    for w in cuts.windows(2).filter(|w| w[1] > w[0]) {
                        let piece = &vals[w[0] as usize..w[1] as usize];
                        columns.push(match regular {
                            true => view_column(&received, &t, w[0], w[1] - w[0]),
                            false => Column::Values(piece.iter().map(|v| s(v)).collect()),
                        });
                    }
                    for (g, v) in idx.iter().zip(vals) {
                        model.insert((*g, name.to_string()), v);
                    }
                    fields.push((Arc::from(name), columns));
                }
                unit.put(&idx, fields).unwrap();
            }
            6..=8 => {
                let idx: Vec<u64> = (0..1 + next(100))
                    .map(|_| next(900))
                    .collect::<BTreeSet<_>>()
                    .into_iter()
                    .collect();
                // Sometimes an index twice: cleared once, counted once.
                let mut idx = idx;
                if next(3) == 0 {
                    idx.push(idx[0]);
                }
                let mut which: Option<Vec<String>> = (next(2) == 0).then(|| {
                    names
                        .iter()
                        .filter(|_| next(2) == 0)
                        .map(|n| n.to_string())
                        .collect()
                });
                // Sometimes a field named twice.
                if let Some(w) = which.as_mut().filter(|w| !w.is_empty() && next(3) == 0) {
                    w.push(w[0].clone());
                }
                let before = model.len();
                model.retain(|(g, f), _| {
                    !(idx.contains(g) && which.as_ref().is_none_or(|w| w.contains(f)))
                });
                let removed = unit.clear(&idx, which.as_deref()).unwrap();
                assert_eq!(removed, (before - model.len()) as u64, "step {step}: clear");
            }
            _ => {
                // A get of one index too many fails, whatever the rest.
                let absent = (0..1000).find(|g| !model.contains_key(&(*g, "a".to_string())));
                if let Some(g) = absent {
                    let err = unit.get(&[g], &["a".into()]).unwrap_err();
                    assert!(matches!(err, StoreError::KeyNotFound { index, .. } if index == g));
                }
            }
        }
        check(&unit, &model, &format!("step {step}"));
    }
    let copy = Unit::new("u1", None);
    copy.replace_with(unit.snapshot(), false).unwrap();
    check(&copy, &model, "after a snapshot is loaded");
    let all: Vec<u64> = (0..1000).collect();
    unit.clear(&all, None).unwrap();
    model.clear();
    check(&unit, &model, "after clearing everything");
}
