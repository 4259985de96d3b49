//! Receive limits and fairness, against the real `stowd` over real sockets:
//! oversized requests answered with errors, declared sizes that allocate
//! nothing, clients that stop reading, too many connections, and bytes that
//! are not ZMTP at all. After each, the stored rows are read back intact.

use std::time::{Duration, Instant};

use bytes::{BufMut, BytesMut};
use stowage_host::batch::{Cell, Field};
use stowage_host::tensor::Dtype;
use stowage_host::transport::zmtp;
use stowage_host::wire::{native, tq};
use stowage_tests::client::{FdChannel, native_error, tq_error};
use stowage_tests::{NativeClient, Stowd, TqClient, data};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Resident set size of `pid`, bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS line");
    kib * 1024
}

fn tcp_addr(endpoint: &str) -> &str {
    endpoint.strip_prefix("tcp://").expect("a tcp endpoint")
}

/// A DEALER connection made by hand: greeting and READY done.
async fn raw_dealer(endpoint: &str, identity: &str) -> TcpStream {
    let mut stream = TcpStream::connect(tcp_addr(endpoint))
        .await
        .expect("connect");
    let (r, mut w) = stream.split();
    let mut reader = zmtp::FrameReader::new(r);
    zmtp::handshake(
        &mut reader,
        &mut w,
        "DEALER",
        identity.as_bytes(),
        &["ROUTER"],
    )
    .await
    .expect("handshake");
    stream
}

/// Reads (and drops) whatever arrives until the peer closes; false if it
/// is still open after `within`.
async fn closed_within(stream: &mut TcpStream, within: Duration) -> bool {
    let mut sink = vec![0u8; 1 << 20];
    let drain = async {
        loop {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(within, drain).await.is_ok()
}

/// Rows 0..8 of field `x` ([8, 1024] f32) through the router, checked.
async fn seed(client: &TqClient) -> Field {
    let field = Field::Regular(data::f32_rows(8, 1024, 42));
    client
        .put_ok(
            &(0..8).collect::<Vec<_>>(),
            vec![("x".into(), field.clone())],
        )
        .await;
    field
}

async fn assert_intact(client: &TqClient, expected: &Field) {
    let got = client.get_ok(&(0..8).collect::<Vec<_>>(), &["x"]).await;
    let Field::Regular(t) = expected else {
        unreachable!()
    };
    for (i, cell) in got[0].1.iter().enumerate() {
        let Cell::Tensor(row) = cell else {
            panic!("row {i} is not a tensor")
        };
        assert_eq!(
            row.contiguous_bytes(),
            t.row(i as u64).expect("row"),
            "row {i} changed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_put_gets_put_error_and_the_connection_and_data_survive() {
    let mut stowd = Stowd::start("[limits]\nmax_request_bytes = 1048576\n");
    let client = TqClient::new(stowd.router());
    let stored = seed(&client).await;

    // 2 MiB in one message: over the 1 MiB limit.
    let big = Field::Regular(data::f32_rows(512, 1024, 7));
    let reply = client
        .put(&(100..612).collect::<Vec<_>>(), vec![("y".into(), big)])
        .await;
    let message = tq_error(&reply, tq::ErrorReply::Put);
    assert!(message.contains("max_request_bytes"), "{message}");
    assert!(message.contains("1048576"), "{message}");

    // Same client, same connection: still usable, nothing of the refused
    // put stored, the seeded rows unchanged.
    assert_intact(&client, &stored).await;
    let reply = client.get(&[100], &["y"]).await;
    tq_error(&reply, tq::ErrorReply::Get);
    stowd.assert_running();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_frames_is_refused_by_count() {
    let mut stowd = Stowd::start("[limits]\nmax_request_frames = 16\n");
    let client = TqClient::new(stowd.router());
    let stored = seed(&client).await;
    // A nested field of 40 rows is one frame per row: over 16 frames.
    let nested = data::nested(Dtype::Float32, &[3; 40], 1);
    let reply = client
        .put(&(200..240).collect::<Vec<_>>(), vec![("n".into(), nested)])
        .await;
    let message = match &reply {
        tq::Reply::Error { message, .. } => message.clone(),
        other => panic!("expected an error, got {other:?}"),
    };
    assert!(message.contains("more than 16 frames"), "{message}");
    assert_intact(&client, &stored).await;
    stowd.assert_running();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_requests_over_the_limit_get_too_large() {
    let mut stowd = Stowd::start("[limits]\nmax_request_bytes = 65536\n");
    let client = NativeClient::new(stowd.native());
    let small = Field::Regular(data::f32_rows(4, 16, 3));
    client.put_ok(&[0, 1, 2, 3], &[("x".into(), small)]).await;
    let big = Field::Regular(data::f32_rows(64, 1024, 3));
    let reply = client
        .put(&(10..74).collect::<Vec<_>>(), &[("x".into(), big)])
        .await;
    let (code, message) = native_error(&reply);
    assert_eq!(code, native::code::TOO_LARGE, "{message}");
    assert!(message.contains("max_request_bytes"), "{message}");
    assert_eq!(client.get_ok(&[0, 1, 2, 3], &["x"]).await.len(), 1);
    stowd.assert_running();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_sizes_allocate_nothing_until_bytes_arrive() {
    let mut stowd = Stowd::start("");
    let client = TqClient::new(stowd.router());
    let stored = seed(&client).await;
    let before = rss(stowd.pid());

    // One connection declares 2^62 bytes (over every limit), another 4 GiB
    // (within the default 8 GiB); each sends 1 MiB and then nothing.
    let mut over = raw_dealer(&stowd.router().endpoint, "TQ_STORAGE_huge").await;
    let mut within = raw_dealer(&stowd.router().endpoint, "TQ_STORAGE_big").await;
    for (stream, declared) in [(&mut over, 1u64 << 62), (&mut within, 4u64 << 30)] {
        let mut head = BytesMut::new();
        head.put_u8(0x02); // LONG, last frame
        head.put_u64(declared);
        stream.write_all(&head).await.unwrap();
        stream.write_all(&vec![0u8; 1 << 20]).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Others are served meanwhile, and the data is intact.
    assert_intact(&client, &stored).await;
    let grown = rss(stowd.pid()).saturating_sub(before);
    assert!(
        grown < 48 << 20,
        "stowd grew by {grown} bytes for 2 MiB received"
    );
    drop((over, within));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_intact(&client, &stored).await;
    stowd.assert_running();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_blocks_nobody_and_is_dropped() {
    let mut stowd = Stowd::start("[limits]\nwrite_timeout_secs = 3\n");
    let client = TqClient::new(stowd.router());
    // 64 MiB stored: 64 rows of 1 MiB.
    let field = Field::Regular(data::f32_rows(64, 256 << 10, 9));
    let indexes: Vec<u64> = (0..64).collect();
    client
        .put_ok(&indexes, vec![("x".into(), field.clone())])
        .await;
    let baseline = rss(stowd.pid());

    // The stuck client asks for all 64 MiB twenty times and reads nothing.
    let stuck_client = TqClient::with_identity_prefix(stowd.router(), "TQ_STORAGE_stuck");
    let get = stuck_client.encode(&tq::Request::Get {
        global_indexes: indexes.clone(),
        fields: vec!["x".into()],
    });
    let mut stuck = raw_dealer(&stowd.router().endpoint, "TQ_STORAGE_stuck_raw").await;
    for _ in 0..20 {
        let mut buf = Vec::new();
        zmtp::write_message(&mut buf, &get).await.unwrap();
        // Do not wait for the writes to be taken: a full socket is the point.
        let _ = tokio::time::timeout(Duration::from_millis(200), stuck.write_all(&buf)).await;
    }

    // Meanwhile another client is served, every request within its timeout.
    let other = TqClient::new(stowd.router());
    let started = Instant::now();
    for round in 0..20u64 {
        let row = Field::Regular(data::f32_rows(1, 1024, round));
        other.put_ok(&[1000 + round], vec![("y".into(), row)]).await;
        let got = other.get_ok(&[1000 + round], &["y"]).await;
        assert_eq!(got[0].1.len(), 1);
    }
    let served_in = started.elapsed();

    // Replies are views of the stored rows: a stuck reply costs no copy.
    let grown = rss(stowd.pid()).saturating_sub(baseline);
    assert!(
        grown < 32 << 20,
        "stowd grew by {grown} bytes while a client did not read 64 MiB replies"
    );

    // After the write timeout the stuck connection is closed: reading it
    // now reaches the end (after whatever was already in flight).
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        closed_within(&mut stuck, Duration::from_secs(10)).await,
        "the stuck connection is still open after its write timeout"
    );
    assert!(
        stowd.log().contains("did not read its reply in time"),
        "{}",
        stowd.log()
    );

    // Everything stored is intact.
    let got = client.get_ok(&indexes, &["x"]).await;
    let Field::Regular(t) = &field else {
        unreachable!()
    };
    for (i, cell) in got[0].1.iter().enumerate() {
        let Cell::Tensor(row) = cell else { panic!() };
        assert_eq!(row.contiguous_bytes(), t.row(i as u64).unwrap());
    }
    eprintln!("other client: 40 requests in {served_in:?} while one client did not read");
    stowd.assert_running();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_at_its_cap_gives_up_its_longest_idle_connection_to_its_new_client() {
    let mut stowd = Stowd::start("[limits]\nmax_connections = 8\nmax_connections_per_peer = 3\n");
    let endpoint = stowd.router().endpoint.clone();
    let mut held = Vec::new();
    for i in 0..3 {
        held.push(raw_dealer(&endpoint, &format!("TQ_STORAGE_hold{i}")).await);
        // Idle ages are kept in milliseconds: keep the order unambiguous.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A fourth from the same address is served; the oldest idle goes.
    // (All busy, it would be refused: transport/src/table/tests.rs.)
    let client = TqClient::new(stowd.router());
    seed(&client).await;
    assert!(
        closed_within(&mut held[0], Duration::from_secs(2)).await,
        "the longest idle connection stayed"
    );
    for h in &mut held[1..] {
        assert!(
            !closed_within(h, Duration::from_millis(50)).await,
            "a younger idle connection was evicted"
        );
    }
    let log = stowd.log();
    for part in [
        "connection evicted",
        "127.0.0.1",
        "max_connections_per_peer",
    ] {
        assert!(log.contains(part), "{log}");
    }
    stowd.assert_running();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_that_are_not_zmtp_close_only_their_connection() {
    let mut stowd = Stowd::start("");
    let client = TqClient::new(stowd.router());
    let stored = seed(&client).await;
    for garbage in [
        &b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..],
        &[0xffu8, 0, 0, 0, 0, 0, 0, 0, 0, 0x7f, 2, 0][..],
        &[0u8; 200][..],
    ] {
        let mut s = TcpStream::connect(tcp_addr(&stowd.router().endpoint))
            .await
            .unwrap();
        let _ = s.write_all(garbage).await;
        assert!(
            closed_within(&mut s, Duration::from_secs(15)).await,
            "connection sending {garbage:?} was not closed"
        );
    }
    // Reserved flag bits after a good handshake.
    let mut s = raw_dealer(&stowd.router().endpoint, "TQ_STORAGE_flags").await;
    s.write_all(&[0xf0, 1, 0]).await.unwrap();
    let mut sink = [0u8; 16];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut sink))
        .await
        .expect("closed promptly");
    assert!(matches!(n, Ok(0) | Err(_)));
    assert_intact(&client, &stored).await;
    stowd.assert_running();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_past_the_total_quota_are_refused_and_an_expired_lease_frees_its_share() {
    let stowd = Stowd::start("[shm]\nmax_leased_bytes = 1048576\nlease_secs = 1\n");
    let client = NativeClient::new(stowd.native());
    let channel = FdChannel::open(&client).await;
    let extras = channel.extras(false);
    let lease = |bytes: u64| client.call_with(native::Op::Lease { bytes }, &extras);
    let granted = |reply: &native::Reply| matches!(reply, native::Reply::LeaseOk { .. });
    let first = lease(600_000).await;
    assert!(
        granted(&first),
        "{}",
        stowage_tests::client::summary(&first)
    );
    // Together over the quota: refused, naming the key, the sizes and the limit.
    let over = lease(500_000).await;
    let (code, message) = native_error(&over);
    assert_eq!(code, "too_large");
    for part in ["500000", "600000", "max_leased_bytes", "1048576"] {
        assert!(message.contains(part), "{message}");
    }
    // Within what is left: granted.
    assert!(granted(&lease(400_000).await));
    // One lease alone over the quota (under max_lease_bytes): refused too.
    let alone = lease(2_000_000).await;
    assert_eq!(native_error(&alone).0, "too_large");
    // The leases expire unused (lease_secs = 1): their share comes back.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let reply = lease(1_000_000).await;
        if granted(&reply) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{}",
            stowage_tests::client::summary(&reply)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Other clients are still served.
    assert!(client.stat("rows").await >= 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_is_put_only_by_the_connection_that_took_it() {
    let shm = stowage_tests::temp_dir("lease-owner");
    let stowd = Stowd::start(&format!("[shm]\ndir = \"{}\"\n", shm.display()));
    let (a, b) = (
        NativeClient::new(stowd.native()),
        NativeClient::new(stowd.native()),
    );
    let channel = FdChannel::open(&a).await;
    let segment = match a
        .call_with(native::Op::Lease { bytes: 64 }, &channel.extras(false))
        .await
    {
        native::Reply::LeaseOk { segment, .. } => segment,
        other => panic!("{}", stowage_tests::client::summary(&other)),
    };
    let (_, mut fds) = channel.recv();
    let (name, fd) = fds.pop().expect("the lease's descriptor");
    assert_eq!(name, segment, "the descriptor came under another name");
    let leased = std::fs::File::from(fd);
    // The put A means to send: its data frames written into the segment.
    let rows = data::f32_rows(4, 4, 3);
    let frames = native::encode_request(&native::Request {
        id: 9,
        op: native::Op::Put {
            global_indexes: vec![0, 1, 2, 3],
            fields: vec![(
                "x".into(),
                native::WireField::from_field(&Field::Regular(rows.clone())).unwrap(),
            )],
        },
    })
    .unwrap();
    let (mut bytes, mut segments) = (Vec::new(), Vec::new());
    for f in &frames[1..] {
        segments.push((segment.clone(), bytes.len() as u64, f.len() as u64));
        bytes.extend_from_slice(f);
    }
    assert!(bytes.len() <= 64);
    std::os::unix::fs::FileExt::write_all_at(&leased, &bytes, 0).unwrap();
    let put = vec![native::with_segments(&frames[0], &segments).unwrap()];
    // B, another connection, names A's lease: refused; nothing stored.
    let (_, stolen) = b.send_frames(put.clone()).await;
    let (code, message) = native_error(&stolen);
    assert_eq!(code, "bad_request");
    assert!(message.contains("another connection"), "{message}");
    assert_eq!(b.stat("rows").await, 0);
    // A's own put of it still works, and the rows read back whole.
    let (_, own) = a.send_frames(put).await;
    assert!(
        matches!(own, native::Reply::PutOk { rows: 4 }),
        "{}",
        stowage_tests::client::summary(&own)
    );
    assert_eq!(b.stat("rows").await, 4);
    let got = b
        .call(native::Op::Get {
            global_indexes: vec![0, 1, 2, 3].into(),
            fields: vec!["x".into()],
        })
        .await;
    let native::Reply::GetOk { fields } = got else {
        panic!("{}", stowage_tests::client::summary(&got));
    };
    let Field::Regular(t) = fields[0].1.clone().into_field().unwrap() else {
        panic!("not regular");
    };
    assert_eq!(t.contiguous_bytes(), rows.contiguous_bytes());
}

/// Descriptors open in process `pid`.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("read /proc/<pid>/fd")
        .count()
}

/// Leases `bytes` through `channel`; the segment's name and the writable
/// descriptor, or the refusal.
async fn lease_fd(
    client: &NativeClient,
    channel: &FdChannel,
    bytes: u64,
) -> Result<(String, std::os::fd::OwnedFd), native::Reply> {
    match client
        .call_with(native::Op::Lease { bytes }, &channel.extras(false))
        .await
    {
        native::Reply::LeaseOk { segment, .. } => {
            let (_, mut fds) = channel.recv();
            let (name, fd) = fds.pop().expect("the lease's descriptor");
            assert_eq!(name, segment, "the descriptor came under another name");
            Ok((segment, fd))
        }
        other => Err(other),
    }
}

/// Waits up to 5 s for `pid` to hold `want` descriptors; the count then.
/// Waits (up to 5 s) until stowd holds at most `want` descriptors: how
/// many it holds then. (At most: one stowd opened for itself before the
/// count was taken, such as a plugin compile-cache file written at start
/// on a loaded machine, may close meanwhile; a leak shows as more.)
async fn fds_settle(pid: u32, want: usize) -> usize {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = open_fds(pid);
        if n <= want || Instant::now() > deadline {
            return n;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// stowd's descriptor count once it holds still (the same over 200 ms,
/// up to 10 s): a base that start-up's own files, still open on a loaded
/// machine, do not inflate.
async fn steady_fds(pid: u32) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut n = open_fds(pid);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = open_fds(pid);
        if now == n || Instant::now() > deadline {
            return now;
        }
        n = now;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_are_counted_so_one_byte_leases_cannot_take_stowds_descriptors() {
    let stowd = Stowd::start("[shm]\nmax_leases = 300\nprealloc_bytes = 0\n");
    let pid = stowd.pid();
    let a = NativeClient::new(stowd.native());
    let channel_a = FdChannel::open(&a).await;
    let base = open_fds(pid);
    // One connection leasing a byte at a time stops at the default of 256.
    let mut held = Vec::new();
    let refusal = loop {
        match lease_fd(&a, &channel_a, 1).await {
            Ok(lease) => held.push(lease),
            Err(reply) => break reply,
        }
        assert!(held.len() <= 256, "more than 256 leases on one connection");
    };
    assert_eq!(held.len(), 256);
    let (code, message) = native_error(&refusal);
    assert_eq!(code, "too_large");
    for part in ["max_connection_leases", "256"] {
        assert!(message.contains(part), "{message}");
    }
    // Another connection gets the rest of the total, then is refused too.
    let b = NativeClient::new(stowd.native());
    let channel_b = FdChannel::open(&b).await;
    let refusal = loop {
        match lease_fd(&b, &channel_b, 1).await {
            Ok(lease) => held.push(lease),
            Err(reply) => break reply,
        }
        assert!(held.len() <= 300, "more than max_leases granted");
    };
    assert_eq!(held.len(), 300);
    let (code, message) = native_error(&refusal);
    assert_eq!(code, "too_large");
    for part in ["max_leases", "300"] {
        assert!(message.contains(part), "{message}");
    }
    let during = open_fds(pid);
    eprintln!("stowd's descriptors: {base} before, {during} with 300 one-byte leases");
    assert!(during <= base + 300 + 8, "{during} descriptors");
    // New clients, tcp and same-node, are still served.
    let c = NativeClient::new(stowd.native());
    assert!(c.stat("shm_leases").await == 300);
    let _channel_c = FdChannel::open(&c).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn void_and_expired_leases_give_their_descriptors_back() {
    let stowd = Stowd::start("[shm]\nlease_secs = 1\nprealloc_bytes = 0\n");
    let pid = stowd.pid();
    let client = NativeClient::new(stowd.native());
    let channel = FdChannel::open(&client).await;
    client.stats().await;
    let base = steady_fds(pid).await;
    let frames = native::encode_request(&native::Request {
        id: 9,
        op: native::Op::Put {
            global_indexes: vec![0],
            fields: vec![(
                "x".into(),
                native::WireField::from_field(&Field::Regular(data::f32_rows(1, 4, 3))).unwrap(),
            )],
        },
    })
    .unwrap();
    // Ten rounds of 8 MiB sealed by the client (F_SEAL_SEAL) before the put:
    // each put refused, each lease void.
    for _ in 0..10 {
        let (segment, fd) = lease_fd(&client, &channel, 8 << 20).await.unwrap();
        use std::os::fd::AsRawFd;
        // SAFETY: fcntl on a descriptor this test owns.
        let sealed = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, libc::F_SEAL_SEAL) };
        assert_eq!(sealed, 0, "{}", std::io::Error::last_os_error());
        drop(fd);
        let ranges = vec![(segment, 0u64, frames[1].len() as u64)];
        let put = vec![native::with_segments(&frames[0], &ranges).unwrap()];
        let (_, reply) = client.send_frames(put).await;
        let (code, message) = native_error(&reply);
        assert_eq!(code, "bad_request");
        assert!(message.contains("void"), "{message}");
    }
    let after_void = fds_settle(pid, base).await;
    assert_eq!(client.stat("shm_leases").await, 0);
    assert_eq!(client.stat("rows").await, 0);
    // Ten leases never put: held until they expire (lease_secs = 1).
    for _ in 0..10 {
        lease_fd(&client, &channel, 8 << 20).await.unwrap();
    }
    let leased = open_fds(pid);
    let t0 = Instant::now();
    let after_expiry = fds_settle(pid, after_void).await;
    eprintln!(
        "stowd's descriptors: {base} at first, {after_void} after 10 void leases, {leased} with \
         10 leases, {after_expiry} {:?} later",
        t0.elapsed()
    );
    assert!(after_void <= base, "void leases kept descriptors");
    assert_eq!(leased, after_void + 10);
    assert!(
        after_expiry <= after_void,
        "expired leases kept descriptors"
    );
    assert_eq!(client.stat("shm_leases").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_connections_leases_give_their_descriptors_back_at_once() {
    // lease_secs 30 (the default): nothing here waits for expiry.
    let stowd = Stowd::start("[shm]\nprealloc_bytes = 0\n");
    let pid = stowd.pid();
    let watcher = NativeClient::new(stowd.native());
    watcher.stats().await;
    let base = steady_fds(pid).await;
    let client = NativeClient::new(stowd.native());
    let channel = FdChannel::open(&client).await;
    for _ in 0..10 {
        lease_fd(&client, &channel, 1 << 20).await.unwrap();
    }
    assert_eq!(watcher.stat("shm_leases").await, 10);
    let t0 = Instant::now();
    drop(client);
    drop(channel);
    let after = fds_settle(pid, base).await;
    eprintln!(
        "stowd's descriptors: {base}, back to {after} {:?} after the connection with 10 \
         leases closed",
        t0.elapsed()
    );
    assert!(
        after <= base,
        "a closed connection's leases kept descriptors"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(watcher.stat("shm_leases").await, 0);
}
