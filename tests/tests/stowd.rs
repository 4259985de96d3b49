//! `stowd` end to end: the real binary as a child process (port 0, an
//! endpoints file in a temporary directory), driven over real ZeroMQ
//! sockets on 127.0.0.1 with the TransferQueue and `stowage/1` protocols.
//!
//! Sections:
//! 1. the TransferQueue protocol against a unit and against the router;
//! 2. router mode over two processes (routing, message splitting);
//! 3. the capacity limit;
//! 4. the native protocol (round trip, pipelining, error codes, zero copy);
//! 5. bad input over the socket, one test per case;
//! 6. clean shutdown.
//!
//! Every test starts its own `stowd` and every handle checks, when dropped,
//! that the process is still running and exits with status 0 on SIGTERM.
//! Every wait has a timeout (see `stowage_tests::process` and `client`).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use bytes::Bytes;
use stowage_host::batch::{Cell, Field, Value};
use stowage_host::tensor::Dtype;
use stowage_host::transport::TransportError;
use stowage_host::wire::native::{self, WireField};
use stowage_host::wire::pickle::{self, PValue};
use stowage_host::wire::tq::{self, ErrorReply};
use stowage_tests::client::{native_error, stat, tq_error};
use stowage_tests::data::{assert_cells, cells, f32_rows, nested, strings, tensor, wire_cells};
use stowage_tests::{NativeClient, NativePipeline, Stowd, TqClient};

// ---------------------------------------------------------------------------
// Shared helpers

/// What the server should hold: (global index, field) -> cell.
#[derive(Default)]
struct Model {
    rows: HashMap<u64, Vec<(String, Cell)>>,
}

impl Model {
    fn put(&mut self, indexes: &[u64], fields: &[(String, Field)]) {
        for (name, field) in fields {
            for (g, cell) in indexes.iter().zip(cells(field)) {
                let row = self.rows.entry(*g).or_default();
                match row.iter_mut().find(|(n, _)| n == name) {
                    Some(slot) => slot.1 = cell,
                    None => row.push((name.clone(), cell)),
                }
            }
        }
    }

    /// Drops `indexes` (only `fields`, if given); returns the values dropped.
    fn clear(&mut self, indexes: &[u64], fields: Option<&[&str]>) -> u64 {
        let mut dropped = 0;
        for g in indexes {
            let Some(row) = self.rows.get_mut(g) else {
                continue;
            };
            let before = row.len();
            row.retain(|(n, _)| fields.is_some_and(|f| !f.contains(&n.as_str())));
            dropped += (before - row.len()) as u64;
            if row.is_empty() {
                self.rows.remove(g);
            }
        }
        dropped
    }

    fn expect(&self, indexes: &[u64], name: &str) -> Vec<Cell> {
        indexes
            .iter()
            .map(|g| {
                self.rows
                    .get(g)
                    .and_then(|r| r.iter().find(|(n, _)| n == name))
                    .map(|(_, c)| c.clone())
                    .unwrap_or_else(|| panic!("model has no ({g}, {name})"))
            })
            .collect()
    }

    /// Checks a get of `names` at `indexes`: fields in request order, rows
    /// in request order, bytes equal.
    fn check(&self, what: &str, got: &[(String, Vec<Cell>)], indexes: &[u64], names: &[&str]) {
        let got_names: Vec<&str> = got.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(got_names, names, "{what}: fields of the reply");
        for (name, cells) in got {
            assert_cells(
                &format!("{what}: field {name}"),
                cells,
                &self.expect(indexes, name),
            );
        }
    }

    fn keys(&self) -> u64 {
        self.rows.values().map(|r| r.len() as u64).sum()
    }
}

/// The fields of a native get_ok as cells.
fn native_cells(fields: Vec<(String, WireField)>) -> Vec<(String, Vec<Cell>)> {
    fields
        .into_iter()
        .map(|(n, f)| (n, wire_cells(f)))
        .collect()
}

/// The batch of the TransferQueue tests: `obs` float32 `[n, 4]`, `ids`
/// nested int64 (row 1 empty), `text` strings.
fn tq_batch(n: usize, seed: u64) -> Vec<(String, Field)> {
    let lengths: Vec<u64> = (0..n as u64)
        .map(|i| if i == 1 { 0 } else { (i + seed) % 5 + 1 })
        .collect();
    vec![
        (
            "obs".into(),
            Field::Regular(f32_rows(n as u64, 4, seed * 100_000)),
        ),
        ("ids".into(), nested(Dtype::Int64, &lengths, seed)),
        ("text".into(), strings(&format!("s{seed}"), n)),
    ]
}

const TQ_FIELDS: [&str; 3] = ["text", "obs", "ids"];

fn arrivals(m: &tq::Metrics, op: &str) -> u64 {
    m.arrivals_by_op
        .iter()
        .find(|(o, _)| o == op)
        .map(|(_, n)| *n)
        .unwrap_or(0)
}

fn assert_key_not_found(reply: &tq::Reply) {
    let message = tq_error(reply, ErrorReply::Get);
    assert!(
        message.starts_with("[TQKeyNotFound] "),
        "GET_ERROR without the key-not-found marker: {message}"
    );
}

// ---------------------------------------------------------------------------
// 1. The TransferQueue protocol against a unit and against the router

/// Put, get (request order, a repeat), overwrite, clear, metrics, on a
/// fresh unit or router endpoint with id `id`.
async fn tq_round_trip(client: &TqClient, id: &str) {
    let mut model = Model::default();
    let indexes = [10, 11, 12, 13, 14, 15];
    let batch = tq_batch(6, 1);
    client.put_ok(&indexes, batch.clone()).await;
    model.put(&indexes, &batch);

    let order = [13, 10, 15, 11, 12, 14, 10];
    model.check(
        "get",
        &client.get_ok(&order, &TQ_FIELDS).await,
        &order,
        &TQ_FIELDS,
    );

    // Overwrite two rows (given in another order) with other values.
    let over = tq_batch(2, 7);
    client.put_ok(&[14, 11], over.clone()).await;
    model.put(&[14, 11], &over);
    let got = client.get_ok(&order, &TQ_FIELDS).await;
    model.check("get after overwrite", &got, &order, &TQ_FIELDS);
    assert_ne!(
        got[1].1[3],
        cells(&batch[0].1)[1],
        "row 11 was not overwritten"
    );

    match client.clear(&[10, 11, 999]).await {
        tq::Reply::ClearData { message } => assert!(message.contains(id), "{message}"),
        other => panic!("clear failed: {other:?}"),
    }
    model.clear(&[10, 11], None);
    assert_key_not_found(&client.get(&[12, 10], &["obs"]).await);
    assert_key_not_found(&client.get(&[11], &["text"]).await);
    let rest = [15, 12, 13, 14];
    model.check(
        "get after clear",
        &client.get_ok(&rest, &TQ_FIELDS).await,
        &rest,
        &TQ_FIELDS,
    );

    let m = client.metrics().await;
    assert_eq!(m.storage_unit_id, id);
    // No capacity configured: the default memory bound ([units] memory_percent).
    let (each, _) = stowage_host::config::UnitsConfig::default().unit_capacity();
    let each = each.expect("the default bound is a bound");
    assert!(
        m.capacity == Some(each) || m.capacity == Some(2 * each),
        "the default memory bound, per unit ({each}) or over the router's two: {m:?}"
    );
    assert_eq!(
        m.active_keys, 4,
        "active keys (global indexes stored): {m:?}"
    );
    let ops = [
        ("PUT_DATA", 2),
        ("GET_DATA", 5),
        ("CLEAR_DATA", 1),
        ("GET_METRICS", 1),
    ];
    for (op, n) in ops {
        assert_eq!(arrivals(&m, op), n, "arrivals of {op}: {m:?}");
    }
    assert_eq!(m.requests_arrived, 9, "{m:?}");
    assert!(m.process_rss_bytes > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tq_protocol_against_a_unit() {
    let stowd = Stowd::start("");
    let unit = stowd.unit(0);
    tq_round_trip(&TqClient::new(unit), &unit.id).await;
    // The other unit saw nothing.
    let other = TqClient::new(stowd.unit(1)).metrics().await;
    assert_eq!(
        (other.active_keys, other.requests_arrived),
        (0, 1),
        "{other:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tq_protocol_against_the_router() {
    let stowd = Stowd::start("");
    let router = stowd.router();
    tq_round_trip(&TqClient::new(router), &router.id).await;
    // The router spread the rows g % 2 over the local units.
    let u0 = TqClient::new(stowd.unit(0));
    let u1 = TqClient::new(stowd.unit(1));
    assert_eq!(u0.metrics().await.active_keys, 2);
    assert_eq!(u1.metrics().await.active_keys, 2);
    assert_eq!(u0.get_ok(&[12, 14], &["text"]).await.len(), 1);
    assert_key_not_found(&u0.get(&[13], &["text"]).await);
    assert_eq!(u1.get_ok(&[13, 15], &["obs"]).await.len(), 1);
}

// ---------------------------------------------------------------------------
// 2. Router mode over two processes

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_mode_over_two_processes() {
    let a = Stowd::start("");
    let b = Stowd::start(&format!(
        "[units]\nlocal = 1\n\n[router]\nunits = [{:?}, {:?}]\n\n[limits]\nmax_message_bytes = 1048576\n",
        a.unit(0).endpoint,
        a.unit(1).endpoint
    ));
    let via_b = TqClient::new(b.router());
    let (a0, a1) = (TqClient::new(a.unit(0)), TqClient::new(a.unit(1)));
    let mut model = Model::default();

    // 64 rows in a scrambled order; 1000 is even, so g % 2 == i % 2.
    let indexes: Vec<u64> = (0..64).map(|i| 1000 + (i * 37) % 64).collect();
    let batch = tq_batch(64, 3);
    via_b.put_ok(&indexes, batch.clone()).await;
    model.put(&indexes, &batch);

    let mut evens: Vec<u64> = indexes.iter().copied().filter(|g| g % 2 == 0).collect();
    let mut odds: Vec<u64> = indexes.iter().copied().filter(|g| g % 2 == 1).collect();
    evens.sort_unstable();
    odds.sort_unstable();
    model.check(
        "A unit 0",
        &a0.get_ok(&evens, &TQ_FIELDS).await,
        &evens,
        &TQ_FIELDS,
    );
    model.check(
        "A unit 1",
        &a1.get_ok(&odds, &TQ_FIELDS).await,
        &odds,
        &TQ_FIELDS,
    );
    for (client, wrong) in [(&a0, &odds), (&a1, &evens)] {
        for &g in wrong.iter() {
            assert_key_not_found(&client.get(&[g], &["obs"]).await);
        }
    }
    assert_eq!(a0.metrics().await.active_keys, 32);
    assert_eq!(a1.metrics().await.active_keys, 32);
    // B's own unit is not a router target.
    assert_eq!(TqClient::new(b.unit(0)).metrics().await.active_keys, 0);

    let mut order: Vec<u64> = indexes.iter().rev().copied().collect();
    order.push(indexes[5]);
    model.check(
        "get through B",
        &via_b.get_ok(&order, &TQ_FIELDS).await,
        &order,
        &TQ_FIELDS,
    );
    assert_key_not_found(&via_b.get(&[1000, 7777], &["obs"]).await);

    match via_b.clear(&indexes).await {
        tq::Reply::ClearData { .. } => {}
        other => panic!("clear through B failed: {other:?}"),
    }
    assert_eq!(a0.metrics().await.active_keys, 0);
    assert_eq!(a1.metrics().await.active_keys, 0);
    assert_key_not_found(&a0.get(&[evens[0]], &["text"]).await);
    assert_key_not_found(&a1.get(&[odds[0]], &["text"]).await);
    assert_key_not_found(&via_b.get(&[indexes[0]], &["obs"]).await);

    // 8 MiB through B with messages of at most 1 MiB: 4 MiB per unit, so
    // each of A's units must receive at least 4 PUT messages.
    let big_indexes: Vec<u64> = (5000..5256).collect();
    let big = vec![(
        "big".to_string(),
        Field::Regular(tensor(Dtype::Float32, &[256, 8192], 42)),
    )];
    let before = [
        arrivals(&a0.metrics().await, "PUT_DATA"),
        arrivals(&a1.metrics().await, "PUT_DATA"),
    ];
    via_b.put_ok(&big_indexes, big.clone()).await;
    model.put(&big_indexes, &big);
    let after = [
        arrivals(&a0.metrics().await, "PUT_DATA"),
        arrivals(&a1.metrics().await, "PUT_DATA"),
    ];
    for u in 0..2 {
        assert!(
            after[u] - before[u] >= 4,
            "unit {u} got {} PUT messages for 4 MiB",
            after[u] - before[u]
        );
    }
    assert_eq!(a0.metrics().await.active_keys, 128);
    assert_eq!(a1.metrics().await.active_keys, 128);
    model.check(
        "big through B",
        &via_b.get_ok(&big_indexes, &["big"]).await,
        &big_indexes,
        &["big"],
    );
    let some = [5255, 5001, 5127];
    model.check(
        "big on A unit 1",
        &a1.get_ok(&some, &["big"]).await,
        &some,
        &["big"],
    );
}

// ---------------------------------------------------------------------------
// 3. Capacity

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_limit_refuses_whole_puts() {
    let stowd = Stowd::start("[units]\ncapacity_bytes = 65536\n");
    let u0 = TqClient::new(stowd.unit(0));
    let mut model = Model::default();
    let with_text = |t, n| {
        vec![
            ("x".to_string(), Field::Regular(t)),
            ("t".to_string(), strings("c", n)),
        ]
    };

    // 20 rows of 4 KiB = 80 KiB > 64 KiB: refused, nothing stored.
    let too_big: Vec<u64> = (0..20).collect();
    let reply = u0.put(&too_big, with_text(f32_rows(20, 1024, 1), 20)).await;
    let message = tq_error(&reply, ErrorReply::Put);
    assert!(message.contains("full"), "{message}");
    assert_key_not_found(&u0.get(&[0], &["t"]).await);
    assert_key_not_found(&u0.get(&[19], &["x"]).await);
    let m = u0.metrics().await;
    assert_eq!((m.active_keys, m.capacity), (0, Some(65536)), "{m:?}");

    // 8 rows (32 KiB) fit.
    let small: Vec<u64> = (0..8).collect();
    let batch = with_text(f32_rows(8, 1024, 2), 8);
    u0.put_ok(&small, batch.clone()).await;
    model.put(&small, &batch);
    // 10 more rows (40 KiB) do not fit next to them...
    let reply = u0
        .put(
            &(8..18).collect::<Vec<_>>(),
            with_text(f32_rows(10, 1024, 3), 10),
        )
        .await;
    tq_error(&reply, ErrorReply::Put);
    assert_key_not_found(&u0.get(&[8], &["x"]).await);
    // ...but overwriting the 8 rows does: the old bytes are freed first.
    let batch = with_text(f32_rows(8, 1024, 4), 8);
    u0.put_ok(&small, batch.clone()).await;
    model.put(&small, &batch);
    model.check(
        "after overwrite",
        &u0.get_ok(&small, &["x", "t"]).await,
        &small,
        &["x", "t"],
    );
    assert_eq!(u0.metrics().await.active_keys, 8);

    // Over both units (native endpoint): unit 0's part fits, unit 1's part
    // (17 rows, 68 KiB) does not. Nothing may be stored, on either unit.
    let native = NativeClient::new(stowd.native());
    let keys = native.stat("keys").await;
    let indexes: Vec<u64> = std::iter::once(100)
        .chain((0..17).map(|i| 101 + 2 * i))
        .collect();
    let reply = native
        .put(
            &indexes,
            &[("y".to_string(), Field::Regular(f32_rows(18, 1024, 5)))],
        )
        .await;
    let (code, message) = native_error(&reply);
    assert_eq!(code, "capacity", "{message}");
    assert_eq!(
        native_error(&native.get(&[100], &["y"]).await).0,
        "key_not_found",
        "unit 0 kept part of a refused put"
    );
    assert_eq!(native.stat("keys").await, keys);
    // The same put through the router endpoint is refused the same way.
    let router = TqClient::new(stowd.router());
    let reply = router
        .put(
            &indexes,
            vec![("y".to_string(), Field::Regular(f32_rows(18, 1024, 5)))],
        )
        .await;
    tq_error(&reply, ErrorReply::Put);
    assert_key_not_found(&router.get(&[100], &["y"]).await);
    // A smaller put over both units works.
    let fits = vec![("y".to_string(), Field::Regular(f32_rows(4, 1024, 6)))];
    native.put_ok(&[100, 101, 102, 103], &fits).await;
    model.put(&[100, 101, 102, 103], &fits);
    let got = native_cells(native.get_ok(&[103, 100], &["y"]).await);
    model.check("native after capacity error", &got, &[103, 100], &["y"]);
    model.check(
        "first put intact",
        &u0.get_ok(&small, &["x"]).await,
        &small,
        &["x"],
    );
}

// ---------------------------------------------------------------------------
// 4. The native protocol

const DTYPES: [Dtype; 7] = [
    Dtype::Float32,
    Dtype::Float16,
    Dtype::Bfloat16,
    Dtype::Int64,
    Dtype::Int8,
    Dtype::Uint8,
    Dtype::Bool,
];

/// Every field kind in every dtype of [`DTYPES`], plus 1-d and scalar rows
/// and every kind of plain value.
fn native_batch(n: usize, seed: u64) -> Vec<(String, Field)> {
    let mut fields = Vec::new();
    let lengths: Vec<u64> = (0..n as u64)
        .map(|i| if i == 1 { 0 } else { (i + seed) % 4 + 1 })
        .collect();
    for (k, dtype) in DTYPES.into_iter().enumerate() {
        let s = seed * 100 + k as u64;
        fields.push((
            format!("reg_{dtype}"),
            Field::Regular(tensor(dtype, &[n as u64, 3], s)),
        ));
        fields.push((format!("nest_{dtype}"), nested(dtype, &lengths, s)));
    }
    fields.push((
        "reg_1d".into(),
        Field::Regular(tensor(Dtype::Float32, &[n as u64], seed)),
    ));
    let rows_2d = (0..n as u64)
        .map(|i| tensor(Dtype::Float32, &[i % 3, 2], seed + i))
        .collect();
    fields.push(("nest_2d".into(), Field::Nested(rows_2d)));
    let scalars = (0..n as u64)
        .map(|i| tensor(Dtype::Int64, &[], seed + i))
        .collect();
    fields.push(("nest_scalar".into(), Field::Nested(scalars)));
    fields.push(("str".into(), strings(&format!("v{seed}"), n)));
    let blobs = (0..n)
        .map(|i| Value::Bytes(Bytes::from(vec![i as u8; i])))
        .collect();
    fields.push(("bin".into(), Field::Values(blobs)));
    // Opaque msgpack: 42, nil, [1, "a"], {"k": 1}, -1, 1.5, ...
    let opaque: [&[u8]; 6] = [
        b"\x2a",
        b"\xc0",
        b"\x92\x01\xa1a",
        b"\x81\xa1k\x01",
        b"\xff",
        b"\xcb\x3f\xf8\0\0\0\0\0\0",
    ];
    let values = (0..n)
        .map(|i| Value::Msgpack(Bytes::from_static(opaque[(i + seed as usize) % 6])))
        .collect();
    fields.push(("opaque".into(), Field::Values(values)));
    fields
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_round_trip_of_every_kind_and_dtype() {
    let stowd = Stowd::start("");
    let client = NativeClient::new(stowd.native());
    let mut model = Model::default();
    let indexes = [7, 3, 11, 5, 2, 8];
    let batch = native_batch(6, 1);
    let names: Vec<String> = batch.iter().map(|(n, _)| n.clone()).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let f = names.len() as i64;

    let stats = client.stats().await;
    assert_eq!(stat(&stats, "units"), 2);
    assert_eq!(
        (
            stat(&stats, "keys"),
            stat(&stats, "rows"),
            stat(&stats, "bytes")
        ),
        (0, 0, 0)
    );

    client.put_ok(&indexes, &batch).await;
    model.put(&indexes, &batch);
    let stats = client.stats().await;
    assert_eq!(stat(&stats, "keys"), 6 * f);
    assert_eq!(stat(&stats, "rows"), 6);
    assert!(stat(&stats, "bytes") > 0);

    // Fields in a different order than put, rows in request order, repeats.
    let order = [5, 7, 7, 2, 11, 3, 8];
    let mut asked = names.clone();
    asked.reverse();
    let got = native_cells(client.get_ok(&order, &asked).await);
    model.check("get", &got, &order, &asked);

    // Overwrite two rows.
    let over = native_batch(2, 9);
    client.put_ok(&[8, 3], &over).await;
    model.put(&[8, 3], &over);
    model.check(
        "after overwrite",
        &native_cells(client.get_ok(&order, &names).await),
        &order,
        &names,
    );

    // Clear two fields of two rows, then whole rows; a retried clear drops 0.
    let some: [&str; 2] = ["reg_float32", "str"];
    assert_eq!(client.clear(&[7, 3], Some(&some)).await, 4);
    model.clear(&[7, 3], Some(&some));
    assert_eq!(
        native_error(&client.get(&[7], &["reg_float32"]).await).0,
        "key_not_found"
    );
    assert_eq!(
        native_error(&client.get(&[2, 3], &["str"]).await).0,
        "key_not_found"
    );
    model.check(
        "other fields kept",
        &native_cells(client.get_ok(&[7], &["reg_int64"]).await),
        &[7],
        &["reg_int64"],
    );
    let dropped = model.clear(&[7, 3, 999], None);
    assert_eq!(client.clear(&[7, 3, 999], None).await, dropped);
    assert_eq!(dropped, 2 * (f as u64 - 2));
    assert_eq!(client.clear(&[7, 3], None).await, 0);
    assert_eq!(client.clear(&[], None).await, 0);
    let rest = [11, 2, 5, 8];
    model.check(
        "after clear",
        &native_cells(client.get_ok(&rest, &names).await),
        &rest,
        &names,
    );
    let stats = client.stats().await;
    assert_eq!(stat(&stats, "keys") as u64, model.keys());
    assert_eq!(stat(&stats, "rows"), 4);

    // The TransferQueue endpoints see the same units.
    let tq_unit0 = TqClient::new(stowd.unit(0));
    model.check(
        "via TQ",
        &tq_unit0.get_ok(&[2, 8], &["reg_bfloat16"]).await,
        &[2, 8],
        &["reg_bfloat16"],
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_request_ids_are_echoed_with_requests_in_flight() {
    // The pipelining DEALER is the zeromq crate's, an independent ZMTP
    // implementation that speaks NULL only.
    let stowd = Stowd::start("[security]\nauth = \"none\"\n");
    let client = NativeClient::new(stowd.native());
    let mut model = Model::default();
    let indexes: Vec<u64> = (0..16).collect();
    let batch = vec![("x".to_string(), Field::Regular(f32_rows(16, 8, 3)))];
    client.put_ok(&indexes, &batch).await;
    model.put(&indexes, &batch);

    let mut pipe = NativePipeline::connect(stowd.native()).await;
    let mut expected: HashMap<u64, Option<u64>> = HashMap::new();
    for (i, &g) in indexes.iter().rev().enumerate() {
        let id = 1_000 + 7 * i as u64;
        let op = native::Op::Get {
            global_indexes: vec![g].into(),
            fields: vec!["x".into()],
        };
        pipe.send(&native::Request { id, op }).await;
        expected.insert(id, Some(g));
    }
    pipe.send(&native::Request {
        id: 5,
        op: native::Op::Stats,
    })
    .await;
    let missing = native::Op::Get {
        global_indexes: vec![4242].into(),
        fields: vec!["x".into()],
    };
    pipe.send(&native::Request {
        id: u64::MAX,
        op: missing,
    })
    .await;
    expected.insert(5, None);
    expected.insert(u64::MAX, None);

    let mut seen = HashSet::new();
    for _ in 0..expected.len() {
        let (id, reply) = pipe.recv().await;
        assert!(seen.insert(id), "id {id} answered twice");
        match (expected.get(&id), reply) {
            (Some(Some(g)), native::Reply::GetOk { fields }) => {
                model.check(&format!("reply {id}"), &native_cells(fields), &[*g], &["x"]);
            }
            (Some(None), native::Reply::StatsOk(stats)) if id == 5 => {
                assert_eq!(stat(&stats, "units"), 2)
            }
            (Some(None), native::Reply::Error { code, .. }) if id == u64::MAX => {
                assert_eq!(code, "key_not_found")
            }
            (want, reply) => panic!("reply {reply:?} under id {id}, expected {want:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_error_codes() {
    let stowd = Stowd::start("");
    let client = NativeClient::new(stowd.native());
    let base = vec![("x".to_string(), Field::Regular(f32_rows(2, 4, 1)))];
    client.put_ok(&[0, 1], &base).await;

    assert_eq!(
        native_error(&client.get(&[0, 9], &["x"]).await).0,
        "key_not_found"
    );
    assert_eq!(
        native_error(&client.get(&[0], &["nope"]).await).0,
        "key_not_found"
    );

    // Empty batches.
    for op in [
        native::Op::Put {
            global_indexes: vec![],
            fields: vec![],
        },
        native::Op::Get {
            global_indexes: vec![].into(),
            fields: vec!["x".into()],
        },
        native::Op::Get {
            global_indexes: vec![0].into(),
            fields: vec![],
        },
    ] {
        let reply = client.call(op).await;
        let (code, message) = native_error(&reply);
        assert_eq!(code, "bad_request", "{message}");
        assert!(message.starts_with("empty batch:"), "{message}");
    }
    let no_fields = native::Op::Put {
        global_indexes: vec![3],
        fields: vec![],
    };
    assert_eq!(native_error(&client.call(no_fields).await).0, "bad_request");

    // Malformed frame 0: no id can be read, so the reply has id 0.
    let (id, reply) = client
        .send_frames(vec![Bytes::from_static(b"\x84\xa5proto\xa9stowa")])
        .await;
    assert_eq!((id, native_error(&reply).0), (0, "bad_request"));
    // An unknown envelope key with a readable id: the id is echoed.
    let frame0 = native_frame0(&[
        ("proto", S("stowage/1")),
        ("op", S("stats")),
        ("id", U(77)),
        ("body", Raw(b"\x80")),
        ("bogus", U(1)),
    ]);
    let (id, reply) = client.send_frames(vec![frame0]).await;
    assert_eq!((id, native_error(&reply).0), (77, "bad_request"));
    // Another protocol version, an unknown op.
    let frame0 = native_frame0(&[
        ("proto", S("stowage/2")),
        ("op", S("stats")),
        ("id", U(78)),
        ("body", Raw(b"\x80")),
    ]);
    let (id, reply) = client.send_frames(vec![frame0]).await;
    assert_eq!((id, native_error(&reply).0), (78, "unsupported"));
    let frame0 = native_frame0(&[
        ("proto", S("stowage/1")),
        ("op", S("put_ok")),
        ("id", U(79)),
        ("body", Raw(b"\x80")),
    ]);
    assert_eq!(
        native_error(&client.send_frames(vec![frame0]).await.1).0,
        "unsupported"
    );

    let got = native_cells(client.get_ok(&[1, 0], &["x"]).await);
    let mut model = Model::default();
    model.put(&[0, 1], &base);
    model.check("data intact", &got, &[1, 0], &["x"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_constant_stride_put_is_zero_copy() {
    let stowd = Stowd::start("");
    let client = NativeClient::new(stowd.native());
    let before = client.stats().await;
    // [1024, 256] float32 over 2 units: each unit's 512 rows are one
    // strided view of the received frame (constant stride 2).
    let indexes: Vec<u64> = (0..1024).collect();
    let batch = vec![(
        "obs".to_string(),
        Field::Regular(tensor(Dtype::Float32, &[1024, 256], 5)),
    )];
    client.put_ok(&indexes, &batch).await;
    let after = client.stats().await;
    let delta = |name| stat(&after, name) - stat(&before, name);
    assert_eq!(delta("zero_copy_bytes"), 1 << 20, "{after:?}");
    assert_eq!(delta("copied_bytes"), 0, "{after:?}");
    assert_eq!(
        delta("plugin_decisions"),
        2,
        "constant-stride answers once per unit: {after:?}"
    );
    assert_eq!(delta("fallbacks"), 0);
    assert_eq!(stat(&after, "bytes"), 1 << 20);

    let mut model = Model::default();
    model.put(&indexes, &batch);
    let some = [1023, 0, 511, 512];
    model.check(
        "rows back",
        &native_cells(client.get_ok(&some, &["obs"]).await),
        &some,
        &["obs"],
    );
}

// ---------------------------------------------------------------------------
// 5. Bad input over the socket

/// A msgpack value for the hand-written frames.
#[derive(Clone, Copy)]
enum Mp<'a> {
    S(&'a str),
    U(u64),
    I(i64),
    Nil,
    F(f64),
    Raw(&'a [u8]),
}
use Mp::{F, I, Nil, Raw, S, U};

fn write_mp(buf: &mut Vec<u8>, v: &Mp<'_>) {
    match v {
        S(s) => rmp::encode::write_str(buf, s).expect("vec write"),
        U(u) => drop(rmp::encode::write_uint(buf, *u).expect("vec write")),
        I(i) => drop(rmp::encode::write_sint(buf, *i).expect("vec write")),
        Nil => rmp::encode::write_nil(buf).expect("vec write"),
        F(f) => rmp::encode::write_f64(buf, *f).expect("vec write"),
        Raw(b) => buf.extend_from_slice(b),
    }
}

/// A msgpack map of `entries`.
fn mp_map(entries: &[(&str, Mp<'_>)]) -> Vec<u8> {
    let mut buf = Vec::new();
    rmp::encode::write_map_len(&mut buf, entries.len() as u32).expect("vec write");
    for (k, v) in entries {
        write_mp(&mut buf, &S(k));
        write_mp(&mut buf, v);
    }
    buf
}

fn mp_array(items: &[Mp<'_>]) -> Vec<u8> {
    let mut buf = Vec::new();
    rmp::encode::write_array_len(&mut buf, items.len() as u32).expect("vec write");
    items.iter().for_each(|v| write_mp(&mut buf, v));
    buf
}

fn mp_ext(code: i8, payload: &[u8]) -> Vec<u8> {
    let mut buf = Vec::new();
    rmp::encode::write_ext_meta(&mut buf, payload.len() as u32, code).expect("vec write");
    buf.extend_from_slice(payload);
    buf
}

fn native_frame0(entries: &[(&str, Mp<'_>)]) -> Bytes {
    Bytes::from(mp_map(entries))
}

/// A TransferQueue frame 0 with the envelope keys except `omit`.
fn tq_frame0(request_type: &str, unit: &str, omit: &[&str], body: &[u8]) -> Bytes {
    let all = [
        ("request_type", S(request_type)),
        ("sender_id", S("TQ_STORAGE_test")),
        ("receiver_id", S(unit)),
        ("request_id", S("0badf00d")),
        ("timestamp", F(1.0e9)),
        ("body", Raw(body)),
    ];
    let kept: Vec<(&str, Mp<'_>)> = all.into_iter().filter(|(k, _)| !omit.contains(k)).collect();
    Bytes::from(mp_map(&kept))
}

/// The ext 3 payload `pickle((dtype, shape, frame))` with any ints.
fn ext3(dtype: &str, shape: &[i128], frame: i128) -> Vec<u8> {
    let meta = PValue::Tuple(vec![
        PValue::Str(dtype.into()),
        PValue::Tuple(shape.iter().map(|&d| PValue::Int(d)).collect()),
        PValue::Int(frame),
    ]);
    mp_ext(3, &pickle::dumps(&meta))
}

fn replace(frame: &Bytes, from: &[u8], to: &[u8]) -> Bytes {
    assert_eq!(from.len(), to.len());
    let mut v = frame.to_vec();
    let mut found = false;
    for i in 0..v.len().saturating_sub(from.len() - 1) {
        if &v[i..i + from.len()] == from {
            v[i..i + from.len()].copy_from_slice(to);
            found = true;
        }
    }
    assert!(
        found,
        "{:?} not in the frame",
        String::from_utf8_lossy(from)
    );
    Bytes::from(v)
}

/// A `stowd` with known data on unit 0 (TransferQueue) and on both units
/// (native), and clients of each.
struct Fixture {
    stowd: Stowd,
    tq: TqClient,
    native: NativeClient,
    model: Model,
}

const TQ_BASE: [u64; 4] = [0, 2, 4, 6];
const NATIVE_BASE: [u64; 2] = [100, 101];

/// The put the bad-input tests mutate: `obs` float32 [2, 4] in frame 1 and
/// `ids` int64 rows of 2 and 3 elements in frames 2 and 3.
fn victim_fields() -> Vec<(String, Field)> {
    vec![
        ("obs".into(), Field::Regular(f32_rows(2, 4, 9))),
        ("ids".into(), nested(Dtype::Int64, &[2, 3], 9)),
    ]
}
const VICTIM: [u64; 2] = [50, 52];

impl Fixture {
    async fn new() -> Fixture {
        let stowd = Stowd::start("");
        let tq = TqClient::new(stowd.unit(0));
        let native = NativeClient::new(stowd.native());
        let mut model = Model::default();
        let batch = tq_batch(4, 2);
        tq.put_ok(&TQ_BASE, batch.clone()).await;
        model.put(&TQ_BASE, &batch);
        let batch = vec![
            ("n_obs".to_string(), Field::Regular(f32_rows(2, 4, 5))),
            ("n_text".to_string(), strings("n", 2)),
        ];
        native.put_ok(&NATIVE_BASE, &batch).await;
        model.put(&NATIVE_BASE, &batch);
        Fixture {
            stowd,
            tq,
            native,
            model,
        }
    }

    /// A valid TransferQueue put of [`VICTIM`] to unit 0.
    fn tq_put(&self) -> Vec<Bytes> {
        self.tq.encode(&tq::Request::Put {
            global_indexes: VICTIM.to_vec(),
            fields: victim_fields(),
        })
    }

    /// A valid native put of [`VICTIM`].
    fn native_put(&self) -> Vec<Bytes> {
        let fields = victim_fields()
            .into_iter()
            .map(|(n, f)| (n.into(), WireField::from_field(&f).expect("sendable")))
            .collect();
        let op = native::Op::Put {
            global_indexes: VICTIM.to_vec(),
            fields,
        };
        native::encode_request(&native::Request { id: 4321, op }).expect("encodable")
    }

    /// Sends TransferQueue frames to unit 0; the reply must be an `kind`
    /// error whose message contains `needle`.
    async fn tq_refused(&self, frames: Vec<Bytes>, kind: ErrorReply, needle: &str) {
        let reply = self.tq.send_frames(frames).await;
        let message = tq_error(&reply, kind);
        if kind == ErrorReply::PutGet {
            assert!(message.starts_with("undecodable request: "), "{message}");
        }
        assert!(message.contains(needle), "{needle:?} not in {message:?}");
    }

    /// Sends native frames; the reply must be error `code` under `id`.
    async fn native_refused(&self, frames: Vec<Bytes>, id: u64, code: &str) {
        let (got_id, reply) = self.native.send_frames(frames).await;
        let (got_code, message) = native_error(&reply);
        assert_eq!((got_id, got_code), (id, code), "{message}");
    }

    /// The process runs, nothing of [`VICTIM`] was stored, the known data
    /// is intact, and new requests are served.
    async fn assert_intact(&mut self) {
        self.stowd.assert_running();
        assert_key_not_found(&self.tq.get(&[VICTIM[0]], &["obs"]).await);
        assert_key_not_found(&self.tq.get(&[VICTIM[1]], &["ids"]).await);
        assert_eq!(
            native_error(&self.native.get(&[VICTIM[0]], &["obs"]).await).0,
            "key_not_found"
        );
        let got = self.tq.get_ok(&TQ_BASE, &TQ_FIELDS).await;
        self.model.check("TQ data", &got, &TQ_BASE, &TQ_FIELDS);
        let got = native_cells(self.native.get_ok(&NATIVE_BASE, &["n_obs", "n_text"]).await);
        self.model
            .check("native data", &got, &NATIVE_BASE, &["n_obs", "n_text"]);
        let m = self.tq.metrics().await;
        assert_eq!(m.active_keys, 5, "{m:?}");
        // A new client on a fresh connection is served too.
        let fresh = TqClient::new(self.stowd.unit(0));
        fresh.put_ok(&[70], tq_batch(1, 4)).await;
        assert_eq!(fresh.get_ok(&[70], &["text"]).await.len(), 1);
        fresh.clear(&[70]).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_malformed_msgpack_frame0() {
    let mut f = Fixture::new().await;
    let put = f.tq_put();
    let truncated = put[0].slice(..put[0].len() / 2);
    f.tq_refused(
        [vec![truncated], put[1..].to_vec()].concat(),
        ErrorReply::PutGet,
        "msgpack",
    )
    .await;
    f.tq_refused(
        vec![Bytes::from_static(b"\xc1")],
        ErrorReply::PutGet,
        "msgpack",
    )
    .await;
    f.tq_refused(
        vec![Bytes::from_static(b"\x93\x01\x02\x03")],
        ErrorReply::PutGet,
        "not a map",
    )
    .await;
    let trailing = Bytes::from([put[0].as_ref(), b"\x00"].concat());
    f.tq_refused(
        [vec![trailing], put[1..].to_vec()].concat(),
        ErrorReply::PutGet,
        "trailing",
    )
    .await;
    f.tq_refused(vec![Bytes::new()], ErrorReply::PutGet, "empty")
        .await;
    // A map count far larger than the frame.
    f.tq_refused(
        vec![Bytes::from_static(b"\xdf\xff\xff\xff\xff")],
        ErrorReply::PutGet,
        "",
    )
    .await;

    let put = f.native_put();
    f.native_refused(vec![Bytes::from_static(b"\x84\xa5pro")], 0, "bad_request")
        .await;
    f.native_refused(
        vec![Bytes::from_static(b"\xdf\xff\xff\xff\xff")],
        0,
        "bad_request",
    )
    .await;
    // Truncated inside the body: the id is still readable and echoed.
    let truncated = put[0].slice(..put[0].len() - 10);
    f.native_refused(
        [vec![truncated], put[1..].to_vec()].concat(),
        4321,
        "bad_request",
    )
    .await;
    f.assert_intact().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_missing_envelope_key() {
    let mut f = Fixture::new().await;
    let unit = f.stowd.unit(0).id.clone();
    let body = mp_map(&[
        ("global_indexes", Raw(&mp_array(&[U(0)]))),
        ("fields", Raw(&mp_array(&[S("obs")]))),
    ]);
    for key in [
        "request_type",
        "sender_id",
        "receiver_id",
        "request_id",
        "timestamp",
        "body",
    ] {
        let frame0 = tq_frame0("GET", &unit, &[key], &body);
        f.tq_refused(
            vec![frame0],
            ErrorReply::PutGet,
            &format!("missing key '{key}'"),
        )
        .await;
    }
    // The complete envelope is answered.
    match f
        .tq
        .send_frames(vec![tq_frame0("GET", &unit, &[], &body)])
        .await
    {
        tq::Reply::GetData { fields } => assert_eq!(fields.len(), 1),
        other => panic!("{other:?}"),
    }
    // A body without its keys is the operation's own error.
    let frame0 = tq_frame0(
        "GET",
        &unit,
        &[],
        &mp_map(&[("global_indexes", Raw(&mp_array(&[U(0)])))]),
    );
    f.tq_refused(vec![frame0], ErrorReply::Get, "missing key 'fields'")
        .await;

    let all = [
        ("proto", S("stowage/1")),
        ("op", S("stats")),
        ("id", U(31)),
        ("body", Raw(b"\x80")),
    ];
    for omit in ["proto", "op", "body"] {
        let kept: Vec<(&str, Mp<'_>)> = all.iter().copied().filter(|(k, _)| *k != omit).collect();
        f.native_refused(vec![native_frame0(&kept)], 31, "bad_request")
            .await;
    }
    let kept: Vec<(&str, Mp<'_>)> = all.iter().copied().filter(|(k, _)| *k != "id").collect();
    f.native_refused(vec![native_frame0(&kept)], 0, "bad_request")
        .await;
    f.assert_intact().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_wrong_frame_count() {
    let mut f = Fixture::new().await;
    let put = f.tq_put();
    assert_eq!(put.len(), 4, "frame 0, obs, two ids rows");
    f.tq_refused(put[..3].to_vec(), ErrorReply::PutGet, "out of range")
        .await;
    f.tq_refused(put[..1].to_vec(), ErrorReply::PutGet, "out of range")
        .await;
    let extra = [put.clone(), vec![Bytes::from_static(b"spare")]].concat();
    f.tq_refused(extra, ErrorReply::PutGet, "not referenced")
        .await;
    // A GET carrying a data frame.
    let get = f.tq.encode(&tq::Request::Get {
        global_indexes: vec![0],
        fields: vec!["obs".into()],
    });
    f.tq_refused(
        [get, vec![Bytes::from_static(b"x")]].concat(),
        ErrorReply::PutGet,
        "not referenced",
    )
    .await;

    let put = f.native_put();
    assert_eq!(put.len(), 4);
    f.native_refused(put[..3].to_vec(), 4321, "bad_request")
        .await;
    f.native_refused(put[..1].to_vec(), 4321, "bad_request")
        .await;
    let extra = [put.clone(), vec![Bytes::from_static(b"spare")]].concat();
    f.native_refused(extra, 4321, "bad_request").await;
    f.assert_intact().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_frame_length_not_matching_shape() {
    let mut f = Fixture::new().await;
    let put = f.tq_put();
    for (frame, len) in [(1, 31), (1, 33), (1, 0), (3, 16), (2, 24)] {
        let mut frames = put.clone();
        let mut bytes = frames[frame].to_vec();
        bytes.resize(len, 0);
        frames[frame] = Bytes::from(bytes);
        f.tq_refused(frames, ErrorReply::PutGet, "does not fit")
            .await;
    }
    let put = f.native_put();
    for (frame, len) in [(1, 31), (1, 0), (3, 23)] {
        let mut frames = put.clone();
        frames[frame] = frames[frame].slice(..len);
        f.native_refused(frames, 4321, "bad_request").await;
    }
    f.assert_intact().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_unknown_dtype() {
    let mut f = Fixture::new().await;
    let mut put = f.tq_put();
    put[0] = replace(&put[0], b"float32", b"float31");
    f.tq_refused(put, ErrorReply::PutGet, "unknown dtype").await;
    let mut put = f.tq_put();
    put[0] = replace(&put[0], b"int64", b"int63");
    f.tq_refused(put, ErrorReply::PutGet, "unknown dtype").await;

    let mut put = f.native_put();
    put[0] = replace(&put[0], b"float32", b"float8_");
    f.native_refused(put, 4321, "bad_request").await;
    f.assert_intact().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_negative_or_absurd_shape() {
    let mut f = Fixture::new().await;
    let unit = f.stowd.unit(0).id.clone();
    let tiny = Bytes::from_static(&[0u8; 16]);
    let big = 1i128 << 40;
    for (shape, needle) in [
        (vec![-1, 4], "negative"),
        (vec![1, -4], "negative"),
        (vec![big, big, big], "overflows"),
        (vec![big, 4], "does not fit"),
        (vec![i128::from(i64::MAX) + 1], "too large"),
        (vec![1; 65], "too many dimensions"),
    ] {
        // As a whole regular field...
        let data = mp_map(&[("obs", Raw(&ext3("float32", &shape, 1)))]);
        let body = mp_map(&[
            ("global_indexes", Raw(&mp_array(&[U(VICTIM[0])]))),
            ("data", Raw(&data)),
            ("data_parser", Nil),
        ]);
        let frames = vec![tq_frame0("PUT", &unit, &[], &body), tiny.clone()];
        f.tq_refused(frames, ErrorReply::PutGet, needle).await;
        // ...and as a row of a nested field.
        let rows = mp_array(&[Raw(&ext3("int64", &shape, 1))]);
        let body = mp_map(&[
            ("global_indexes", Raw(&mp_array(&[U(VICTIM[0])]))),
            ("data", Raw(&mp_map(&[("ids", Raw(&rows))]))),
            ("data_parser", Nil),
        ]);
        let frames = vec![tq_frame0("PUT", &unit, &[], &body), tiny.clone()];
        f.tq_refused(frames, ErrorReply::PutGet, needle).await;
    }

    for (shape, part_rows, code) in [
        (vec![I(-1), U(4)], U(1), "bad_request"),
        (vec![U(1), I(-4)], U(1), "bad_request"),
        (vec![U(1 << 40), U(4)], U(1), "too_large"),
        (vec![U(1), U(1 << 40)], U(1), "bad_request"),
        (
            vec![U(1), U(1 << 40), U(1 << 40), U(1 << 40)],
            U(1),
            "bad_request",
        ),
        (vec![U(1), U(4)], U(1 << 40), "bad_request"),
    ] {
        let part = mp_map(&[
            ("frame", U(1)),
            ("offset", U(0)),
            ("len", U(16)),
            ("rows", part_rows),
        ]);
        let descriptor = mp_map(&[
            ("kind", S("regular")),
            ("dtype", S("float32")),
            ("shape", Raw(&mp_array(&shape))),
            ("parts", Raw(&mp_array(&[Raw(&part)]))),
        ]);
        let body = mp_map(&[
            ("global_indexes", Raw(&mp_array(&[U(VICTIM[0])]))),
            ("fields", Raw(&mp_map(&[("obs", Raw(&descriptor))]))),
        ]);
        let frame0 = native_frame0(&[
            ("proto", S("stowage/1")),
            ("op", S("put")),
            ("id", U(9)),
            ("body", Raw(&body)),
        ]);
        f.native_refused(vec![frame0, tiny.clone()], 9, code).await;
    }
    f.assert_intact().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_duplicate_global_indexes() {
    let mut f = Fixture::new().await;
    // Index 2 is stored; a put naming it twice must change nothing.
    let dup = tq::Request::Put {
        global_indexes: vec![2, 2],
        fields: tq_batch(2, 8),
    };
    f.tq_refused(f.tq.encode(&dup), ErrorReply::Put, "duplicate")
        .await;
    let dup = tq::Request::Put {
        global_indexes: vec![VICTIM[0], 4, VICTIM[0]],
        fields: tq_batch(3, 8),
    };
    f.tq_refused(f.tq.encode(&dup), ErrorReply::Put, "duplicate")
        .await;
    // Through the router as well.
    let router = TqClient::new(f.stowd.router());
    let reply = router.put(&[VICTIM[0], 2, VICTIM[0]], tq_batch(3, 8)).await;
    assert!(tq_error(&reply, ErrorReply::Put).contains("duplicate"));

    let fields = vec![("n_obs".to_string(), Field::Regular(f32_rows(3, 4, 8)))];
    let reply = f.native.put(&[101, 100, 101], &fields).await;
    assert_eq!(native_error(&reply).0, "bad_request");
    let reply = f
        .native
        .put(&[VICTIM[0], VICTIM[0]], &victim_fields())
        .await;
    assert_eq!(native_error(&reply).0, "bad_request");
    f.assert_intact().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_get_of_unknown_field() {
    let mut f = Fixture::new().await;
    let reply = f.tq.get(&[0, 2], &["obs", "nope"]).await;
    assert!(tq_error(&reply, ErrorReply::Get).contains("nope"));
    let router = TqClient::new(f.stowd.router());
    let reply = router.get(&[0], &["nope"]).await;
    assert!(tq_error(&reply, ErrorReply::Get).contains("nope"));
    let reply = f.native.get(&[100], &["nope"]).await;
    let (code, message) = native_error(&reply);
    assert_eq!(code, "key_not_found");
    assert!(message.contains("nope"), "{message}");
    f.assert_intact().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_unrecognised_identity_is_dropped() {
    let mut f = Fixture::new().await;
    let unit = f.stowd.unit(0).clone();
    let before = f.tq.metrics().await.requests_arrived;
    for prefix in ["intruder", "TQ_STORAG", "tq_storage_lowercase"] {
        let intruder = TqClient::with_identity_prefix(&unit, prefix);
        let frames = intruder.encode(&tq::Request::Get {
            global_indexes: vec![0],
            fields: vec!["obs".into()],
        });
        let started = std::time::Instant::now();
        match intruder.exchange(frames, Duration::from_secs(1)).await {
            Err(TransportError::Timeout { .. }) => {
                assert!(started.elapsed() >= Duration::from_millis(900))
            }
            other => panic!("identity {prefix}: expected no reply, got {other:?}"),
        }
        // Others are still served, and the router drops it too.
        assert_eq!(f.tq.get_ok(&[0], &["obs"]).await.len(), 1);
        let to_router = TqClient::with_identity_prefix(f.stowd.router(), prefix);
        let frames = to_router.encode(&tq::Request::GetMetrics);
        assert!(matches!(
            to_router.exchange(frames, Duration::from_secs(1)).await,
            Err(TransportError::Timeout { .. })
        ));
    }
    // A metrics collector is a recognised identity.
    let collector = TqClient::with_identity_prefix(&unit, "metrics_collector_test");
    let m = collector.metrics().await;
    // Dropped requests were never counted: `before` counted its own
    // request; then 3 gets of the fixture client and this request arrived.
    assert_eq!(m.requests_arrived, before + 3 + 1, "{m:?}");
    f.assert_intact().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_pickle_fallback_form() {
    let mut f = Fixture::new().await;
    // pickle.dumps({"request_type": "PUT"}) would follow; it is never unpickled.
    let fallback = vec![
        Bytes::from_static(tq::PICKLE_FALLBACK_SENTINEL),
        Bytes::from_static(
            b"\x80\x05\x95\x0c\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01a\x94K\x01s.",
        ),
    ];
    f.tq_refused(fallback.clone(), ErrorReply::PutGet, "pickle fallback")
        .await;
    let router = TqClient::new(f.stowd.router());
    let reply = router.send_frames(fallback.clone()).await;
    assert!(tq_error(&reply, ErrorReply::PutGet).contains("pickle fallback"));
    // A pickle that would run code if unpickled.
    let evil = vec![
        Bytes::from_static(tq::PICKLE_FALLBACK_SENTINEL),
        Bytes::from_static(b"cos\nsystem\n(S'true'\ntR."),
    ];
    f.tq_refused(evil, ErrorReply::PutGet, "pickle fallback")
        .await;
    f.native_refused(fallback, 0, "bad_request").await;
    f.assert_intact().await;
}

// ---------------------------------------------------------------------------
// 6. Shutdown

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_shuts_down_cleanly() {
    let stowd = Stowd::start("");
    let file = stowd.endpoints_file().to_path_buf();
    assert!(file.exists());
    // With connected clients and stored data.
    let tq = TqClient::new(stowd.unit(1));
    tq.put_ok(&[1, 3], tq_batch(2, 1)).await;
    let native = NativeClient::new(stowd.native());
    assert_eq!(native.stat("rows").await, 2);
    let took = stowd.stop();
    assert!(took < Duration::from_secs(10), "shutdown took {took:?}");
    assert!(
        !file.exists(),
        "endpoints file {} left behind",
        file.display()
    );
    // Nothing answers any more.
    let frames = tq.encode(&tq::Request::GetMetrics);
    assert!(tq.exchange(frames, Duration::from_secs(1)).await.is_err());
}
