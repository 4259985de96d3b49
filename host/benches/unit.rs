//! Time of one storage unit's put, get and clear of 131,072 rows of one
//! float32 field with 128 elements per row (512 B rows), all rows in one
//! call, reported per row (criterion throughput in elements = rows).
//! `cargo bench -p stowage-host --bench unit`
//!
//! The store API is used only in the `Store` adapter below (build a filled
//! or empty unit, put, get, clear): porting the bench to another store API
//! means rewriting that adapter alone.
//!
//! What is timed: `put` of all rows into an empty unit (the unit is then
//! dropped untimed); `get` of all rows in put order (the returned cells are
//! dropped untimed); `clear` of all rows (dropping the unit's empty index
//! afterwards is untimed). The rows are zero-copy slices of one buffer, as
//! stowd stores rows of a frame that arrived in one piece.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};

const ROWS: u64 = 131_072;
const ELEMS: u64 = 128; // float32 elements per row: 512 B rows
const FIELD: &str = "x";

/// The one place that knows the store API (ef17a9b: `store::Unit` of
/// `batch::Cell`s, one cell per row).
mod adapter {
    use bytes::Bytes;
    use stowage_host::batch::Cell;
    use stowage_host::store::Unit;
    use stowage_host::tensor::{DType, Tensor};

    /// What a put hands the unit: the rows of one received buffer.
    #[derive(Clone)]
    pub struct Rows {
        pub indexes: Vec<u64>,
        cells: Vec<Cell>,
    }

    /// `rows` rows of `elems` float32 each, global indexes 0..rows, as
    /// zero-copy slices of one buffer.
    pub fn rows(rows: u64, elems: u64) -> Rows {
        let bytes = Bytes::from(vec![1u8; (rows * elems * 4) as usize]);
        let t = Tensor::contiguous(bytes, DType::F32, vec![rows, elems]).unwrap();
        let cells = (0..rows).map(|i| Cell::Tensor(t.row_tensor(i).unwrap())).collect();
        Rows { indexes: (0..rows).collect(), cells }
    }

    pub struct Store(Unit);

    impl Store {
        pub fn empty() -> Store {
            Store(Unit::new("bench", None))
        }

        pub fn filled(field: &str, rows: &Rows) -> Store {
            let s = Store::empty();
            s.put(field, rows.clone());
            s
        }

        pub fn put(&self, field: &str, rows: Rows) {
            self.0.put(&rows.indexes, vec![(field.to_string(), rows.cells)]).unwrap();
        }

        /// The stored rows, in the order asked (whatever the store returns
        /// for them: dropped by the caller).
        pub fn get(&self, field: &str, indexes: &[u64]) -> impl Sized + use<> {
            self.0.get(indexes, &[field.to_string()]).unwrap()
        }

        /// Returns the number of rows (or keys) cleared.
        pub fn clear(&self, indexes: &[u64]) -> u64 {
            self.0.clear(indexes, None)
        }
    }
}

use adapter::Store;

fn bench(c: &mut Criterion) {
    let rows = adapter::rows(ROWS, ELEMS);
    let mut g = c.benchmark_group(format!("unit/{ROWS}x{}B", ELEMS * 4));
    g.throughput(Throughput::Elements(ROWS));
    g.sample_size(20);
    g.warm_up_time(Duration::from_secs(2));
    g.measurement_time(Duration::from_secs(6));

    g.bench_function("put", |b| {
        b.iter_batched(
            || (Store::empty(), rows.clone()),
            |(s, r)| {
                s.put(FIELD, r);
                s // dropped outside the timing
            },
            BatchSize::PerIteration,
        )
    });

    let filled = Store::filled(FIELD, &rows);
    g.bench_function("get", |b| b.iter_with_large_drop(|| filled.get(FIELD, black_box(&rows.indexes))));
    drop(filled);

    g.bench_function("clear", |b| {
        b.iter_batched(
            || Store::filled(FIELD, &rows),
            |s| {
                assert_eq!(s.clear(black_box(&rows.indexes)), ROWS);
                s
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
