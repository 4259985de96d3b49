//! The manager's get against a model: random puts (in order, reversed,
//! shuffled), overwrites and clears over 4 local units, then gets named as
//! lists and as runs (in put order, strided, reversed, with repeats). Every
//! get must answer each position with the last value put for its index,
//! both row by row (`cells`, what TransferQueue replies are made of) and
//! as runs (`runs`, what native replies are made of).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::{Manager, Target};
use crate::batch::{Cell, Field};
use crate::config::LimitsConfig;
use crate::extent::Received;
use crate::policy::registry::Registry;
use crate::store::{Rows, Run, Unit};
use crate::tensor::{Dtype, Tensor};
use crate::wire::indexes::{IndexRun, Indexes};

/// xorshift64*: reproducible without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const ROW: usize = 8; // bytes per row: 2 uint32

fn manager() -> Manager {
    let units = (0..4)
        .map(|u| Target::Local(Arc::new(Unit::new(format!("u{u}"), None))))
        .collect();
    Manager::new(
        units,
        Arc::new(Registry::new(None, Default::default()).unwrap()),
        LimitsConfig::default(),
        Duration::ZERO,
        "t".into(),
    )
}

/// A put of `indexes` whose row for `g` holds `g` and `version`.
async fn put(m: &Manager, indexes: &[u64], version: u32) {
    let mut bytes = Vec::with_capacity(indexes.len() * ROW);
    for &g in indexes {
        bytes.extend_from_slice(&(g as u32).to_le_bytes());
        bytes.extend_from_slice(&version.to_le_bytes());
    }
    let frame = Bytes::from(bytes);
    let t =
        Tensor::contiguous(frame.clone(), Dtype::Uint32, vec![indexes.len() as u64, 2]).unwrap();
    let received = Received::frames(std::slice::from_ref(&frame));
    m.put(indexes, vec![("x".into(), Field::Regular(t))], &received)
        .await
        .unwrap();
}

/// The rows' bytes in request order, from `runs` and from `cells`, which
/// must agree.
fn bytes_of(rows: &Rows) -> Vec<u8> {
    let from_runs: Vec<u8> = rows
        .runs()
        .iter()
        .flat_map(|r| match r {
            Run::Tensor { .. } => r.bytes().to_vec(),
            Run::Value(_) => panic!("a value in a tensor field"),
        })
        .collect();
    let from_cells: Vec<u8> = rows
        .cells()
        .iter()
        .flat_map(|c| match c {
            Cell::Tensor(t) => t.contiguous_bytes().to_vec(),
            Cell::Value(_) => panic!("a value in a tensor field"),
        })
        .collect();
    assert_eq!(from_runs, from_cells);
    from_runs
}

fn expected(model: &HashMap<u64, u32>, indexes: &[u64]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    for g in indexes {
        out.extend_from_slice(&(*g as u32).to_le_bytes());
        out.extend_from_slice(&model.get(g)?.to_le_bytes());
    }
    Some(out)
}

#[tokio::test]
async fn gets_by_runs_and_by_lists_answer_what_the_model_holds() {
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    for round in 0..40u32 {
        let m = manager();
        let mut model: HashMap<u64, u32> = HashMap::new();
        let span = 8 + rng.below(200);
        for version in 0..6u32 {
            let n = 1 + rng.below(span);
            let first = rng.below(span);
            let mut indexes: Vec<u64> = (first..first + n).collect();
            match rng.below(4) {
                0 => indexes.reverse(),
                1 => {
                    for i in (1..indexes.len()).rev() {
                        indexes.swap(i, rng.below(i as u64 + 1) as usize);
                    }
                }
                2 => indexes.retain(|g| g % 3 != 0),
                _ => {}
            }
            if indexes.is_empty() {
                continue;
            }
            put(&m, &indexes, version + 1).await;
            for g in &indexes {
                model.insert(*g, version + 1);
            }
            if rng.below(3) == 0 {
                let a = rng.below(span);
                let gone: Vec<u64> = (a..a + rng.below(10)).collect();
                m.clear(&gone, None).await.unwrap();
                for g in &gone {
                    model.remove(g);
                }
            }
        }
        for _ in 0..30 {
            let start = rng.below(span);
            let run = IndexRun {
                start,
                count: 1 + rng.below(span),
                step: 1 + rng.below(5),
            };
            let mut asked = Indexes::from_runs(vec![run], u64::MAX).unwrap().to_vec();
            match rng.below(3) {
                0 => asked.reverse(),
                1 => {
                    let k = rng.below(asked.len() as u64) as usize;
                    asked.insert(k, asked[k]);
                }
                _ => {}
            }
            let want = expected(&model, &asked);
            for ix in [
                Indexes::from_list(&asked),
                Indexes::from_runs(vec![run], u64::MAX).unwrap(),
            ] {
                let list = ix.to_vec();
                let want = if list == asked {
                    want.clone()
                } else {
                    expected(&model, &list)
                };
                match (m.get(&ix, &["x".into()]).await, want) {
                    (Ok(got), Some(want)) => {
                        assert_eq!(bytes_of(&got[0].1), want, "round {round}, {ix:?}")
                    }
                    (Err(e), None) => assert!(e.is_key_not_found(), "{e}"),
                    (got, want) => panic!(
                        "round {round}, {ix:?}: got {:?}, want {:?}",
                        got.map(|g| g[0].1.len()),
                        want.map(|w| w.len())
                    ),
                }
            }
        }
    }
}

#[tokio::test]
async fn a_get_in_put_order_over_four_units_is_one_piece_per_unit_and_one_run() {
    let m = manager();
    let indexes: Vec<u64> = (0..4096).collect();
    put(&m, &indexes, 1).await;
    let ix = Indexes::from_runs(
        vec![IndexRun {
            start: 0,
            count: 4096,
            step: 1,
        }],
        u64::MAX,
    )
    .unwrap();
    let got = m.get(&ix, &["x".into()]).await.unwrap();
    let rows = &got[0].1;
    assert_eq!(rows.pieces.len(), 4, "{:?}", rows.pieces);
    let runs = rows.runs();
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0].bytes().len(), 4096 * ROW);
    // Every other row (step 2 over 4 units): two pieces, 2048 runs of one
    // row each (the rows between are not asked for).
    let ix = Indexes::from_runs(
        vec![IndexRun {
            start: 0,
            count: 2048,
            step: 2,
        }],
        u64::MAX,
    )
    .unwrap();
    let got = m.get(&ix, &["x".into()]).await.unwrap();
    assert_eq!(got[0].1.pieces.len(), 2);
    assert_eq!(got[0].1.runs().len(), 2048);
}

/// A plan of views made straight into columns (`FieldView`) makes what
/// the general path (a view tensor a piece, located in the frames) makes:
/// the same extent, offset, stride, rows, row size, dtype, row shape and
/// zero-copy count; and leaves to it every plan it does not handle.
#[test]
fn views_made_straight_into_columns_equal_the_general_path() {
    use super::{FieldView, Tally};
    use crate::plan::{self, Piece, RowView, Selected, SelectionPlan};
    use crate::store::Column;

    fn view_columns(
        field: &Field,
        plan: &SelectionPlan,
        received: &Received,
        tally: &mut Tally,
    ) -> Option<crate::store::Columns> {
        FieldView::of(field, received, &mut tally.row_shape)?.columns(plan, tally)
    }

    // A field of 8 rows of float32 [2, 3] that starts 16 bytes into its
    // frame, and a frame the request did not bring.
    let frame = Bytes::from((0..16 + 8 * 24).map(|i| i as u8).collect::<Vec<u8>>());
    let received = Received::frames(std::slice::from_ref(&frame));
    let t = Tensor::contiguous(frame.slice(16..), Dtype::Float32, vec![8, 2, 3]).unwrap();
    let field = Field::Regular(t.clone());
    let view = |start, step, count| Piece::View(RowView { start, step, count });
    let general = |plan: &SelectionPlan| {
        let mut tally = Tally::default();
        let columns: Vec<Column> = plan::execute_selection(&field, plan)
            .unwrap()
            .into_iter()
            .map(|piece| {
                let Selected::Rows(v) = piece else {
                    panic!("not rows")
                };
                let (extent, offset, zero_copy) = received.locate_or_own(v.buffer());
                assert!(zero_copy);
                tally.zero_copy_bytes += v.payload_len() as u64;
                Column::regular_sharing(extent, offset, &v, &mut tally.row_shape)
            })
            .collect();
        (columns, tally.zero_copy_bytes)
    };
    let key = |c: &Column| match c {
        Column::Regular(r) => (
            Arc::as_ptr(&r.extent),
            r.offset,
            r.stride,
            r.rows,
            r.row_bytes,
            r.dtype,
            r.row_shape.to_vec(),
        ),
        _ => panic!("not regular"),
    };
    for pieces in [
        vec![view(0, 1, 8)],
        vec![view(1, 2, 3), view(0, 4, 2)],
        vec![view(5, 1, 1)],
        vec![view(7, 1, 1), view(0, 7, 2)],
        vec![view(2, 3, 2)],
    ] {
        let plan = SelectionPlan::new(pieces.clone());
        let mut tally = Tally::default();
        let fast = view_columns(&field, &plan, &received, &mut tally).expect("handled");
        let (slow, bytes) = general(&plan);
        assert_eq!(
            fast.iter().map(key).collect::<Vec<_>>(),
            slow.iter().map(key).collect::<Vec<_>>(),
            "{pieces:?}"
        );
        assert_eq!(tally.zero_copy_bytes, bytes, "{pieces:?}");
    }
    // Left to the general path: a gather, a view past the rows, a field
    // not in the request's frames, a field of values.
    let mut tally = Tally::default();
    for plan in [
        SelectionPlan::new(vec![view(0, 1, 2), Piece::Gather(vec![3])]),
        SelectionPlan::new(vec![view(6, 2, 2)]),
    ] {
        assert!(view_columns(&field, &plan, &received, &mut tally).is_none());
    }
    let elsewhere = Field::Regular(
        Tensor::contiguous(Bytes::from(vec![0u8; 48]), Dtype::Float32, vec![2, 2, 3]).unwrap(),
    );
    let plan = SelectionPlan::new(vec![view(0, 1, 2)]);
    assert!(view_columns(&elsewhere, &plan, &received, &mut tally).is_none());
    let values = Field::Values(vec![crate::batch::Value::Str("v".into())]);
    let plan = SelectionPlan::new(vec![view(0, 1, 1)]);
    assert!(view_columns(&values, &plan, &received, &mut tally).is_none());
    assert_eq!(tally.zero_copy_bytes, 0);
}
