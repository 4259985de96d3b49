//! Peer units (issue 19): a `stowd` routing to units of another `stowd`
//! through its native `stowage/1` endpoint (`stowage://host:port/<unit>`),
//! with the node-local read cache. Real processes on loopback.
//!
//! - puts and gets of every field kind through a router mixing a local unit
//!   and two peer units, rows byte-identical; a second get served from the
//!   cache (hits, nothing fetched);
//! - an overwrite or clear made on the peer directly (not through the
//!   router) is seen at once: the new rows, never the old, and after a
//!   clear `key_not_found`;
//! - a restarted peer whose put generations repeat the old ones never
//!   matches the cached rows (its incarnation differs);
//! - 8 concurrent gets of the same rows fetch them once;
//! - a small bound evicts and stays correct; `[cache] enabled = false`;
//! - a forwarded reply a client does not read counts as held once its
//!   fetch is evicted;
//! - requests naming a unit: wrong unit, wrong op, shared memory; a bad
//!   `stowage://` unit is refused at start.

use std::sync::Arc;

use stowage_host::batch::Field;
use stowage_host::tensor::Dtype;
use stowage_host::wire::native;
use stowage_tests::data::{assert_cells, expected, f32_rows, nested, strings, wire_cells};
use stowage_tests::{NativeClient, Stowd, TqClient, free_port};

/// A peer `stowd` with `units` local units on a fixed native port.
fn peer_config(port: u16, units: usize) -> String {
    format!(
        "[server]\nnative_port = {port}\n\n[units]\nlocal = {units}\n\n[router]\nenabled = false\n\n[shm]\nenabled = false\n"
    )
}

/// A router `stowd`: its own unit 0, then units 0 and 1 of the peer.
fn router_config(peer_port: u16, cache: &str) -> String {
    format!(
        "[units]\nlocal = 1\n\n[router]\nunits = [\"local:0\", \"stowage://127.0.0.1:{peer_port}/0\", \"stowage://127.0.0.1:{peer_port}/1\"]\ntimeout_secs = 10\n\n[shm]\nenabled = false\n\n{cache}"
    )
}

fn batch(n: u64, seed: u64) -> Vec<(String, Field)> {
    let lengths: Vec<u64> = (0..n).map(|i| i % 7).collect();
    vec![
        ("x".into(), Field::Regular(f32_rows(n, 48, seed))),
        ("jag".into(), nested(Dtype::Int64, &lengths, seed)),
        ("s".into(), strings(&format!("v{seed}"), n as usize)),
    ]
}

const FIELDS: [&str; 3] = ["x", "jag", "s"];

async fn assert_get(
    what: &str,
    client: &NativeClient,
    put: &[(String, Field)],
    put_indexes: &[u64],
    get_indexes: &[u64],
) {
    let got = client.get_ok(get_indexes, &FIELDS).await;
    for ((name, field), (got_name, got_field)) in put.iter().zip(got) {
        assert_eq!(name, &got_name, "{what}: field order");
        assert_cells(
            &format!("{what}: {name}"),
            &wire_cells(got_field),
            &expected(field, put_indexes, get_indexes),
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_units_serve_every_kind_and_see_the_peers_changes() {
    let port = free_port();
    let peer = Stowd::start(&peer_config(port, 2));
    let router = Stowd::start(&router_config(port, ""));
    let client = NativeClient::new(router.native());
    let indexes: Vec<u64> = (0..300).collect();
    let v1 = batch(300, 1);
    client.put_ok(&indexes, &v1).await;
    // Two thirds of the rows went to the peer, in its two units.
    let direct = NativeClient::new(peer.native());
    assert_eq!(
        direct.stat("keys").await,
        200 * 3,
        "rows stored on the peer"
    );

    assert_get("all", &client, &v1, &indexes, &indexes).await;
    let fetched = client.stat("cache_fetched_bytes").await;
    assert!(fetched > 0, "the first get fetched from the peer");
    let strided: Vec<u64> = (1..300u64).rev().step_by(7).collect();
    assert_get("strided, reversed", &client, &v1, &indexes, &strided).await;
    assert_get("again", &client, &v1, &indexes, &indexes).await;
    assert_eq!(
        client.stat("cache_fetched_bytes").await,
        fetched,
        "rows at an unchanged version are not fetched again"
    );
    assert!(client.stat("cache_hits").await >= 200 * 3);
    // The TransferQueue router endpoint reads through the same cache.
    let hits = client.stat("cache_hits").await;
    let tq_router = TqClient::new(router.router());
    match tq_router.get(&[1, 2, 3], &["x"]).await {
        stowage_host::wire::tq::Reply::GetData { fields } => assert_cells(
            "through the TransferQueue router",
            &fields[0].1,
            &expected(&v1[0].1, &indexes, &[1, 2, 3]),
        ),
        other => panic!("TransferQueue router get: {other:?}"),
    }
    assert_eq!(
        client.stat("cache_hits").await,
        hits + 2,
        "indexes 1 and 2 (on the peer) came from the cache"
    );
    assert_eq!(client.stat("cache_fetched_bytes").await, fetched);

    // An overwrite through the router.
    let some: Vec<u64> = (0..300).step_by(5).collect();
    let v2 = batch(some.len() as u64, 2);
    client.put_ok(&some, &v2).await;
    assert_get("overwritten rows", &client, &v2, &some, &some).await;

    // An overwrite made on the peer's unit directly, in TransferQueue's
    // protocol: index 1 lives in the peer's unit 0 (1 % 3 = 1).
    let tq = TqClient::new(peer.unit(0));
    let v3 = batch(1, 3);
    tq.put_ok(&[1], v3.clone()).await;
    assert_get("changed on the peer", &client, &v3, &[1], &[1]).await;

    // A clear on the peer: the router says key_not_found, never the old row.
    assert_eq!(direct.stat("keys").await % 3, 0);
    match tq.clear(&[1]).await {
        stowage_host::wire::tq::Reply::ClearData { .. } => {}
        other => panic!("clear on the peer: {other:?}"),
    }
    let reply = client.get(&[1], &["x"]).await;
    let (code, message) = stowage_tests::client::native_error(&reply);
    assert_eq!(code, native::code::KEY_NOT_FOUND, "{message}");
    assert!(
        message.contains("stowage://127.0.0.1"),
        "names the unit: {message}"
    );

    // Clearing one field through the router works on peer units.
    let cleared = client.clear(&[2, 4], Some(&["s"])).await;
    assert_eq!(cleared, 2);
    let reply = client.get(&[2], &["s"]).await;
    assert_eq!(
        stowage_tests::client::native_error(&reply).0,
        native::code::KEY_NOT_FOUND
    );
    let got = client.get_ok(&[2, 4], &["x"]).await;
    assert_cells(
        "other fields kept",
        &wire_cells(got.into_iter().next().expect("one field").1),
        &expected(&v1[0].1, &indexes, &[2, 4]),
    );
    router.stop();
    peer.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_peer_never_matches_cached_rows() {
    let port = free_port();
    let mut peer = Stowd::start(&peer_config(port, 2));
    let router = Stowd::start(&router_config(port, ""));
    let client = NativeClient::new(router.native());
    let indexes: Vec<u64> = (0..60).collect();
    let v1 = batch(60, 1);
    client.put_ok(&indexes, &v1).await;
    assert_get("before", &client, &v1, &indexes, &indexes).await;
    // Same puts in the same order after a restart: the same generations.
    peer.kill();
    let peer = Stowd::start(&peer_config(port, 2));
    let v2 = batch(60, 2);
    client.put_ok(&indexes, &v2).await;
    assert_get("after the restart", &client, &v2, &indexes, &indexes).await;
    router.stop();
    peer.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_gets_of_the_same_rows_fetch_them_once() {
    let port = free_port();
    let peer = Stowd::start(&peer_config(port, 2));
    let router = Stowd::start(&router_config(port, ""));
    let client = Arc::new(NativeClient::new(router.native()));
    let n = 3000u64;
    let indexes: Vec<u64> = (0..n).collect();
    let put = vec![("x".to_string(), Field::Regular(f32_rows(n, 256, 9)))];
    client.put_ok(&indexes, &put).await;
    let peer_rows: Vec<u64> = indexes.iter().copied().filter(|g| g % 3 != 0).collect();
    let peer_bytes = peer_rows.len() as i64 * 256 * 4;
    let mut readers = Vec::new();
    for _ in 0..8 {
        let (client, indexes, put) = (client.clone(), indexes.clone(), put.clone());
        readers.push(tokio::spawn(async move {
            let got = client.get_ok(&indexes, &["x"]).await;
            assert_cells(
                "reader",
                &wire_cells(got.into_iter().next().expect("one field").1),
                &expected(&put[0].1, &indexes, &indexes),
            );
        }));
    }
    for r in readers {
        r.await.expect("reader");
    }
    let fetched = client.stat("cache_fetched_bytes").await;
    assert_eq!(
        fetched,
        peer_bytes,
        "8 readers of the same rows: fetched once (hits {}, shared {}, misses {})",
        client.stat("cache_hits").await,
        client.stat("cache_shared").await,
        client.stat("cache_misses").await
    );
    assert_eq!(
        client.stat("cache_saved_bytes").await,
        7 * peer_bytes,
        "the 7 other readers' rows came from the cache or the shared fetch"
    );
    router.stop();
    peer.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_cache_evicts_and_a_disabled_one_is_not_there() {
    let port = free_port();
    let peer = Stowd::start(&peer_config(port, 2));
    // Room for about one fetch of 100 rows of 4 KiB.
    let small = Stowd::start(&router_config(port, "[cache]\nmax_bytes = 300000\n"));
    let client = NativeClient::new(small.native());
    let put = |seed| vec![("x".to_string(), Field::Regular(f32_rows(150, 1024, seed)))];
    let a: Vec<u64> = (0..150).collect();
    let b: Vec<u64> = (1000..1150).collect();
    let (pa, pb) = (put(1), put(2));
    client.put_ok(&a, &pa).await;
    client.put_ok(&b, &pb).await;
    for round in 0..3 {
        for (indexes, put) in [(&a, &pa), (&b, &pb)] {
            let got = client.get_ok(indexes, &["x"]).await;
            assert_cells(
                &format!("round {round}"),
                &wire_cells(got.into_iter().next().unwrap().1),
                &expected(&put[0].1, indexes, indexes),
            );
        }
    }
    assert!(client.stat("cache_evictions").await >= 4);
    assert!(client.stat("cache_bytes").await <= 300_000);
    // Every reply written (the last one's buffers dropped just after):
    // no evicted fetch is held any more.
    let mut held = client.stat("cache_held_bytes").await;
    for _ in 0..100 {
        if held == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        held = client.stat("cache_held_bytes").await;
    }
    assert_eq!(held, 0, "bytes still held after every reply was read");
    // Rows cleared (or put) through this stowd leave the cache at once.
    assert!(client.stat("cache_bytes").await > 0);
    client.clear(&a, None).await;
    client.clear(&b, None).await;
    assert_eq!(
        client.stat("cache_bytes").await,
        0,
        "cleared rows are not kept"
    );
    client.put_ok(&a, &pa).await;
    client.put_ok(&b, &pb).await;
    // One get naming indexes twice: right rows, and a clear frees them all.
    let twice: Vec<u64> = vec![1, 1, 4, 4, 1];
    for _ in 0..2 {
        let got = client.get_ok(&twice, &["x"]).await;
        assert_cells(
            "indexes named twice",
            &wire_cells(got.into_iter().next().unwrap().1),
            &expected(&pa[0].1, &a, &twice),
        );
    }
    assert!(client.stat("cache_bytes").await > 0);
    client.clear(&[1, 4], None).await;
    assert_eq!(
        client.stat("cache_bytes").await,
        0,
        "every entry of the fetch released"
    );
    small.stop();

    let off = Stowd::start(&router_config(port, "[cache]\nenabled = false\n"));
    let client = NativeClient::new(off.native());
    client.put_ok(&a, &pa).await;
    let got = client.get_ok(&a, &["x"]).await;
    assert_cells(
        "no cache",
        &wire_cells(got.into_iter().next().unwrap().1),
        &expected(&pa[0].1, &a, &a),
    );
    let stats = client.stats().await;
    assert!(
        !stats.iter().any(|(k, _)| k.starts_with("cache_")),
        "no cache counters without a cache"
    );
    off.stop();
    peer.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_naming_a_unit_are_checked() {
    let port = free_port();
    let peer = Stowd::start(&peer_config(port, 2));
    let client = NativeClient::new(peer.native());
    let unit = |u| native::Extras {
        unit: Some(u),
        ..Default::default()
    };
    let versions = native::Op::Versions {
        global_indexes: vec![1u64, 2].into(),
        fields: vec!["x".into()],
    };
    let reply = client.call_with(versions.clone(), &unit(2)).await;
    let (code, message) = stowage_tests::client::native_error(&reply);
    assert_eq!(code, native::code::BAD_REQUEST);
    assert!(
        message.contains("unit 2 does not exist") && message.contains("2 local unit"),
        "{message}"
    );
    let reply = client.call_with(native::Op::Stats, &unit(0)).await;
    assert!(
        stowage_tests::client::native_error(&reply)
            .1
            .contains("does not name a unit")
    );
    let reply = client.call(versions.clone()).await;
    assert!(
        stowage_tests::client::native_error(&reply)
            .1
            .contains("peer request")
    );
    let same_node = native::Extras {
        unit: Some(0),
        same_node: true,
        ..Default::default()
    };
    let reply = client.call_with(versions.clone(), &same_node).await;
    assert!(
        stowage_tests::client::native_error(&reply)
            .1
            .contains("not shared memory")
    );
    // Versions of rows not stored are 0; stored rows get the put's
    // generation, one more per put.
    match client.call_with(versions.clone(), &unit(0)).await {
        native::Reply::VersionsOk { versions, .. } => assert_eq!(versions, vec![0, 0]),
        other => panic!("{other:?}"),
    }
    let put = |seed| native::Op::Put {
        global_indexes: vec![1],
        fields: vec![(
            "x".into(),
            native::WireField::from_field(&Field::Regular(f32_rows(1, 4, seed))).unwrap(),
        )],
    };
    for seed in 0..2 {
        match client.call_with(put(seed), &unit(0)).await {
            native::Reply::PutOk { rows: 1 } => {}
            other => panic!("{other:?}"),
        }
    }
    let incarnation = match client.call_with(versions.clone(), &unit(0)).await {
        native::Reply::VersionsOk {
            versions,
            incarnation,
        } => {
            assert_eq!(versions, vec![2, 0]);
            incarnation
        }
        other => panic!("{other:?}"),
    };
    match client.call_with(versions, &unit(1)).await {
        native::Reply::VersionsOk {
            incarnation: other, ..
        } => assert_ne!(other, incarnation, "each unit draws its own incarnation"),
        other => panic!("{other:?}"),
    }
    peer.stop();

    let err =
        Stowd::try_start("[units]\nlocal = 0\n\n[router]\nunits = [\"stowage://127.0.0.1/0\"]\n")
            .expect_err("a stowage:// unit without a port");
    assert!(err.contains("stowage://host:port/<unit>"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peers_errors_keep_their_code_and_a_silent_peer_times_out() {
    // A peer whose units hold 64 KiB each: a bigger put is refused there.
    let port = free_port();
    let peer = Stowd::start(&format!(
        "[server]\nnative_port = {port}\n\n[units]\nlocal = 2\ncapacity_bytes = 65536\n\n[router]\nenabled = false\n\n[shm]\nenabled = false\n"
    ));
    let router = Stowd::start(&format!(
        "[units]\nlocal = 0\n\n[router]\nunits = [\"stowage://127.0.0.1:{port}/0\"]\ntimeout_secs = 1\n\n[shm]\nenabled = false\n"
    ));
    let client = NativeClient::new(router.native());
    let indexes: Vec<u64> = (0..40).collect();
    let big = vec![("x".to_string(), Field::Regular(f32_rows(40, 1024, 1)))];
    let reply = client.put(&indexes, &big).await;
    let (code, message) = stowage_tests::client::native_error(&reply);
    assert_eq!(code, native::code::CAPACITY, "{message}");
    assert!(
        message.contains(&format!("stowage://127.0.0.1:{port}/0")),
        "{message}"
    );
    router.stop();
    peer.stop();

    // A "peer" that accepts connections and never says anything.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_port = silent.local_addr().unwrap().port();
    let router = Stowd::start(&format!(
        "[units]\nlocal = 1\n\n[router]\nunits = [\"local:0\", \"stowage://127.0.0.1:{silent_port}/0\"]\ntimeout_secs = 1\n\n[shm]\nenabled = false\n"
    ));
    let client = NativeClient::new(router.native());
    let started = std::time::Instant::now();
    let reply = client.get(&[1], &["x"]).await;
    let waited = started.elapsed();
    let (code, message) = stowage_tests::client::native_error(&reply);
    assert_eq!(code, native::code::INTERNAL, "{message}");
    assert!(message.contains("stowage://127.0.0.1"), "{message}");
    assert!(
        waited >= std::time::Duration::from_millis(900)
            && waited < std::time::Duration::from_secs(5),
        "answered after {waited:?}"
    );
    // Rows of the local unit are served meanwhile.
    let rows = vec![("x".to_string(), Field::Regular(f32_rows(1, 4, 3)))];
    client.put_ok(&[2], &rows).await;
    let got = client.get_ok(&[2], &["x"]).await;
    assert_cells(
        "local rows",
        &wire_cells(got.into_iter().next().unwrap().1),
        &expected(&rows[0].1, &[2], &[2]),
    );
    drop(silent);
    router.stop();
}

/// A hostile "peer": answers every stowage/1 request with the reply its
/// mode makes (a real ZeroMQ endpoint: stowd's own transport).
struct Hostile(std::sync::atomic::AtomicU32);

impl stowage_host::transport::Service for Hostile {
    fn handle(
        self: Arc<Self>,
        _caller: stowage_host::transport::Caller,
        frames: Vec<bytes::Bytes>,
    ) -> stowage_host::transport::BoxFuture<'static, Option<stowage_host::transport::Message>> {
        Box::pin(async move {
            let req = native::decode_request(&frames, &native::Limits::default()).ok()?;
            let mode = self.0.load(std::sync::atomic::Ordering::Relaxed);
            let rows =
                |n: u64| native::WireField::from_field(&Field::Regular(f32_rows(n, 4, 1))).unwrap();
            let asked = match &req.op {
                native::Op::Get { global_indexes, .. }
                | native::Op::Versions { global_indexes, .. } => global_indexes.len(),
                _ => 1,
            };
            let reply = match (mode, &req.op) {
                // Fewer rows than asked.
                (0, native::Op::Get { .. }) => native::Reply::GetOk {
                    fields: vec![("x".into(), rows(asked - 1))],
                },
                // Another field than asked.
                (1, native::Op::Get { .. }) => native::Reply::GetOk {
                    fields: vec![("y".into(), rows(asked))],
                },
                // The right rows without the versions asked for.
                (2, native::Op::Get { .. }) => native::Reply::GetOk {
                    fields: vec![("x".into(), rows(asked))],
                },
                // Versions of the wrong length.
                (3, native::Op::Versions { .. }) => native::Reply::VersionsOk {
                    incarnation: 1,
                    versions: vec![1],
                },
                // A reply of another op.
                (_, _) => native::Reply::ClearOk { cleared: 0 },
            };
            let id = if mode == 4 { req.id + 1 } else { req.id };
            let out = native::encode_reply(id, &reply).ok()?;
            if mode == 5 {
                // Not msgpack at all.
                return Some(vec![bytes::Bytes::from_static(b"\xc1\xc1garbage")].into());
            }
            Some(out.into())
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_peers_replies_are_errors_and_the_router_serves_on() {
    let (socket, endpoint) = stowage_host::transport::bind("tcp://127.0.0.1:0")
        .await
        .unwrap();
    let port = endpoint.rsplit(':').next().unwrap().to_string();
    let hostile = Arc::new(Hostile(std::sync::atomic::AtomicU32::new(0)));
    let (stop, rx) = tokio::sync::watch::channel(false);
    let server = tokio::spawn(stowage_host::transport::serve(socket, hostile.clone(), rx));
    for cache in ["", "[cache]\nenabled = false\n"] {
        let router = Stowd::start(&format!(
            "[units]\nlocal = 1\n\n[router]\nunits = [\"local:0\", \"stowage://127.0.0.1:{port}/0\"]\ntimeout_secs = 2\n\n[shm]\nenabled = false\n\n{cache}"
        ));
        let client = NativeClient::new(router.native());
        let local = vec![("x".to_string(), Field::Regular(f32_rows(1, 4, 8)))];
        client.put_ok(&[0], &local).await;
        // Peer indexes 1 and 3 (odd: the peer). No bad reply is ever kept,
        // so each get fetches (the versions request, for rows kept, is
        // checked by the same code: its length against the rows asked).
        for mode in 0..6u32 {
            hostile.0.store(mode, std::sync::atomic::Ordering::Relaxed);
            let reply = client.get(&[1, 3], &["x"]).await;
            if mode == 2 && !cache.is_empty() {
                // Without the cache no versions are asked: a plain reply.
                assert!(matches!(reply, native::Reply::GetOk { .. }), "{reply:?}");
                continue;
            }
            let (code, message) = stowage_tests::client::native_error(&reply);
            assert_eq!(
                code,
                native::code::INTERNAL,
                "mode {mode} ({cache:?}): {message}"
            );
            assert!(
                message.contains("stowage://127.0.0.1"),
                "mode {mode}: {message}"
            );
            // The router serves on, its own rows intact.
            let got = client.get_ok(&[0], &["x"]).await;
            assert_cells(
                &format!("local rows after mode {mode}"),
                &wire_cells(got.into_iter().next().unwrap().1),
                &expected(&local[0].1, &[0], &[0]),
            );
        }
        router.stop();
    }
    stop.send(true).unwrap();
    server.await.unwrap();
}

/// A get forwarded to a client that does not read its reply: once the
/// cache has evicted that fetch, the rows the reply still holds count as
/// held (`cache_held_bytes`), so that the room made for later fetches
/// covers them too (see the module doc of `stowage_host::cache`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_reply_still_being_written_counts_as_held() {
    use stowage_host::transport::zmtp;
    let port = free_port();
    let peer = Stowd::start(&format!(
        "[server]\nnative_port = {port}\n\n[units]\nlocal = 2\n\n[router]\nenabled = false\n\n[shm]\nenabled = false\n\n[security]\nauth = \"none\"\n"
    ));
    // Room for one fetch of 6 MiB, not two. A raw NULL handshake below.
    let bound = 8u64 << 20;
    let router = Stowd::start(&forwarding_router(
        port,
        &format!("[cache]\nmax_bytes = {bound}\n\n[security]\nauth = \"none\"\n"),
    ));
    let client = NativeClient::new(router.native());
    let n = 1536u64; // 6 MiB of 4 KiB rows
    let (a, b): (Vec<u64>, Vec<u64>) = ((0..n).collect(), (10_000..10_000 + n).collect());
    let (pa, pb) = (
        vec![("x".to_string(), Field::Regular(f32_rows(n, 1024, 1)))],
        vec![("x".to_string(), Field::Regular(f32_rows(n, 1024, 2)))],
    );
    client.put_ok(&a, &pa).await;
    client.put_ok(&b, &pb).await;

    // A client that asks for `a` and never reads.
    let addr = router.native().strip_prefix("tcp://").unwrap().to_string();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut stalled = socket.connect(addr.parse().unwrap()).await.unwrap();
    let (r, mut w) = stalled.split();
    let mut reader = zmtp::FrameReader::new(r);
    zmtp::handshake(&mut reader, &mut w, "DEALER", b"stalled", &["ROUTER"])
        .await
        .unwrap();
    let request = native::encode_request(&native::Request {
        id: 1,
        op: native::Op::Get {
            global_indexes: native::Indexes::from_list(&a),
            fields: vec!["x".into()],
        },
    })
    .unwrap();
    zmtp::write_message(&mut w, &request).await.unwrap();
    let fetched = 6u64 << 20;
    let mut waited = 0;
    while (client.stat("gets_forwarded").await as u64) < 1
        || (client.stat("cache_fetched_bytes").await as u64) < fetched
    {
        assert!(waited < 1000, "the stalled client's get was not forwarded");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        waited += 1;
    }
    // Another client's get of `b` makes room by evicting `a`'s fetch,
    // which the stalled reply still holds.
    let got = client.get_ok(&b, &["x"]).await;
    assert_cells(
        "b",
        &wire_cells(got.into_iter().next().unwrap().1),
        &expected(&pb[0].1, &b, &b),
    );
    assert!(client.stat("cache_evictions").await >= 1);
    let held = client.stat("cache_held_bytes").await as u64;
    assert!(
        held >= fetched,
        "a reply still being written holds {fetched} bytes of an evicted fetch; {held} counted as held"
    );
    assert!(client.stat("cache_bytes").await as u64 + held <= bound + fetched);
    // Once the stalled client goes, nothing is held.
    drop(reader);
    drop(stalled);
    let mut held = held;
    for _ in 0..200 {
        if held == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        held = client.stat("cache_held_bytes").await as u64;
    }
    assert_eq!(held, 0, "bytes still held after the stalled client went");
    router.stop();
    peer.stop();
}

/// A router with no units of its own: every row of a get is a peer's, so
/// a get is forwarded while it arrives (`server/native/forward.rs`).
fn forwarding_router(peer_port: u16, extra: &str) -> String {
    format!(
        "[units]\nlocal = 0\n\n[router]\nunits = [\"stowage://127.0.0.1:{peer_port}/0\", \"stowage://127.0.0.1:{peer_port}/1\"]\ntimeout_secs = 10\n\n[limits]\nmax_message_bytes = 1048576\n\n[shm]\nenabled = false\n\n{extra}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_get_of_peer_rows_alone_is_forwarded_and_reads_as_any_other() {
    let port = free_port();
    let peer = Stowd::start(&format!(
        "[server]\nnative_port = {port}\n\n[units]\nlocal = 2\n\n[router]\nenabled = false\n\n[limits]\nmax_message_bytes = 1048576\n\n[shm]\nenabled = false\n"
    ));
    for cache in ["", "[cache]\nenabled = false\n"] {
        let router = Stowd::start(&forwarding_router(port, cache));
        let client = NativeClient::new(router.native());
        let n = 1500u64;
        let indexes: Vec<u64> = (0..n).collect();
        // 4 KiB rows (6 MiB: several frames of at most 1 MiB), jagged
        // rows, strings, and a field whose rows are of one shape on each
        // unit but not across them (nested in the reply).
        let lengths: Vec<u64> = (0..n).map(|i| i % 2 + 1).collect();
        let mut put = batch(n, 1);
        put[0] = ("x".into(), Field::Regular(f32_rows(n, 1024, 1)));
        put.push(("m".into(), nested(Dtype::Float32, &lengths, 2)));
        client.put_ok(&indexes, &put).await;
        let names = ["x", "jag", "s", "m"];
        let check = |what: String, got: Vec<(String, native::WireField)>, ix: &[u64]| {
            for ((name, field), (got_name, got_field)) in put.iter().zip(got) {
                assert_eq!(name, &got_name, "{what}: field order");
                assert_cells(
                    &format!("{what}: {name}"),
                    &wire_cells(got_field),
                    &expected(field, &indexes, ix),
                );
            }
        };
        let strided: Vec<u64> = (1..n).rev().step_by(3).collect();
        let repeats: Vec<u64> = vec![5, 5, 2, 7, 5, 1498, 0];
        for (what, ix) in [
            ("all", &indexes),
            ("strided, reversed", &strided),
            ("repeats", &repeats),
        ] {
            // A put through the router forgets the cached rows: every get
            // below fetches them all, and is forwarded.
            client.put_ok(&indexes, &put).await;
            let before = client.stat("gets_forwarded").await;
            check(
                format!("{what} ({cache:?})"),
                client.get_ok(ix, &names).await,
                ix,
            );
            assert_eq!(
                client.stat("gets_forwarded").await,
                before + 1,
                "{what} ({cache:?}): forwarded"
            );
        }
        if cache.is_empty() {
            // Rows kept in the cache are not forwarded: they are here.
            let before = client.stat("gets_forwarded").await;
            check(
                "again".into(),
                client.get_ok(&repeats, &names).await,
                &repeats,
            );
            assert_eq!(client.stat("gets_forwarded").await, before);
            assert!(client.stat("cache_hits").await > 0);
        }
        // A field mixing dtypes across units: the same error as unforwarded.
        let f = vec![("d".to_string(), Field::Regular(f32_rows(1, 2, 1)))];
        client.put_ok(&[0], &f).await;
        let ints = stowage_tests::data::tensor(Dtype::Int64, &[1, 2], 1);
        client
            .put_ok(&[1], &[("d".to_string(), Field::Regular(ints))])
            .await;
        let reply = client.get(&[0, 1], &["d"]).await;
        let (code, message) = stowage_tests::client::native_error(&reply);
        assert!(message.contains("dtype"), "{code}: {message}");
        assert_eq!(client.stat("gets_forward_dropped").await, 0);
        router.stop();
    }
    peer.stop();
}

/// A "peer" whose get replies a forwarding router cannot finish, or can:
/// its mode says which (a real ZeroMQ endpoint: stowd's own transport).
struct Breaking(std::sync::atomic::AtomicU32);

impl stowage_host::transport::Service for Breaking {
    fn handle(
        self: Arc<Self>,
        _caller: stowage_host::transport::Caller,
        frames: Vec<bytes::Bytes>,
    ) -> stowage_host::transport::BoxFuture<'static, Option<stowage_host::transport::Message>> {
        Box::pin(async move {
            let req = native::decode_request(&frames, &native::Limits::default()).ok()?;
            let native::Op::Get { global_indexes, .. } = &req.op else {
                return None;
            };
            let rows = native::WireField::from_field(&Field::Regular(f32_rows(
                global_indexes.len(),
                1024,
                1,
            )))
            .unwrap();
            let reply = native::Reply::GetOk {
                fields: vec![("x".into(), rows)],
            };
            let mut out = native::encode_reply(req.id, &reply).ok()?;
            match self.0.load(std::sync::atomic::Ordering::Relaxed) {
                // Frame 0 right, the last data frame a byte short.
                0 => {
                    let last = out.pop()?;
                    out.push(last.slice(..last.len() - 1));
                    Some(out.into())
                }
                // Frame 0 and the first data frame, then nothing: the rest
                // never comes.
                1 => {
                    let (tx, tail) = stowage_host::transport::Tail::channel(1);
                    let first = out[1].clone();
                    tokio::spawn(async move {
                        let chunk = stowage_host::transport::Chunk {
                            parts: vec![first],
                            per_frame: vec![1],
                            last: false,
                        };
                        let _ = tx.send(Ok(chunk)).await;
                        tokio::time::sleep(std::time::Duration::from_secs(8)).await;
                        drop(tx);
                    });
                    Some(stowage_host::transport::Message {
                        parts: vec![out[0].clone()],
                        per_frame: None,
                        tail: Some(tail),
                    })
                }
                // A whole, right reply.
                _ => Some(out.into()),
            }
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_reply_that_breaks_closes_the_connection_and_the_router_serves_on() {
    let (socket, endpoint) = stowage_host::transport::bind("tcp://127.0.0.1:0")
        .await
        .unwrap();
    let port = endpoint.rsplit(':').next().unwrap().to_string();
    let breaking = Arc::new(Breaking(std::sync::atomic::AtomicU32::new(0)));
    let (stop, rx) = tokio::sync::watch::channel(false);
    let server = tokio::spawn(stowage_host::transport::serve(socket, breaking.clone(), rx));
    let router = Stowd::start(&format!(
        "[units]\nlocal = 0\n\n[router]\nunits = [\"stowage://127.0.0.1:{port}/0\"]\ntimeout_secs = 2\n\n[limits]\nmax_message_bytes = 1048576\n\n[shm]\nenabled = false\n\n[cache]\nenabled = false\n"
    ));
    let client = NativeClient::new(router.native());
    let indexes: Vec<u64> = (0..600).collect();
    let get = |id| {
        native::encode_request(&native::Request {
            id,
            op: native::Op::Get {
                global_indexes: native::Indexes::from_list(&indexes),
                fields: vec!["x".into()],
            },
        })
        .unwrap()
    };
    let want = expected(&Field::Regular(f32_rows(600, 1024, 1)), &indexes, &indexes);
    for (mode, took_at_least) in [(0u32, 0u64), (1, 1800)] {
        breaking.0.store(mode, std::sync::atomic::Ordering::Relaxed);
        let raw = stowage_host::auth::with_client_credentials(stowage_host::transport::Peer::new(
            router.native().to_string(),
            "breaking",
        ));
        let started = std::time::Instant::now();
        let e = raw
            .request(get(1), std::time::Duration::from_secs(20))
            .await
            .expect_err("a reply the router could not finish");
        let waited = started.elapsed().as_millis() as u64;
        assert!(
            matches!(e, stowage_host::transport::TransportError::Recv { .. }),
            "mode {mode}: {e:?}"
        );
        assert!(
            waited >= took_at_least && waited < 10_000,
            "mode {mode}: {waited} ms"
        );
        assert_eq!(
            client.stat("gets_forward_dropped").await,
            mode as i64 + 1,
            "mode {mode}"
        );
        // The router serves on: a right reply is forwarded whole.
        breaking.0.store(2, std::sync::atomic::Ordering::Relaxed);
        let got = client.get_ok(&indexes, &["x"]).await;
        assert_cells(
            &format!("after mode {mode}"),
            &wire_cells(got.into_iter().next().unwrap().1),
            &want,
        );
    }
    assert_eq!(client.stat("gets_forwarded").await, 4);
    router.stop();
    stop.send(true).unwrap();
    server.await.unwrap();
}
