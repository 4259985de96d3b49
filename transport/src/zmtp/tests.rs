//! Tests of the frame reader and writer.

use super::*;

async fn pair() -> (tokio::io::DuplexStream, tokio::io::DuplexStream) {
    tokio::io::duplex(1 << 16)
}

#[tokio::test]
async fn messages_round_trip_with_small_and_large_frames() {
    let (a, b) = pair().await;
    let frames = vec![
        Bytes::from_static(b""),
        Bytes::from(vec![7u8; 200]),
        Bytes::from(vec![9u8; 300]),
        Bytes::from(vec![1u8; 3 << 20]),
        Bytes::from_static(b"tail"),
    ];
    let sent = frames.clone();
    let writer = tokio::spawn(async move {
        let mut a = a;
        write_message(&mut a, &sent).await.unwrap();
        write_message(&mut a, &sent[1..2]).await.unwrap();
    });
    let mut r = FrameReader::new(b);
    let Some(Incoming::Message(got)) = r.read(&Limits::DEFAULT).await.unwrap() else {
        panic!()
    };
    assert_eq!(got, frames);
    let Some(Incoming::Message(got)) = r.read(&Limits::DEFAULT).await.unwrap() else {
        panic!()
    };
    assert_eq!(got, frames[1..2]);
    writer.await.unwrap();
    assert!(
        r.read(&Limits::DEFAULT).await.unwrap().is_none(),
        "clean close"
    );
}

#[tokio::test]
async fn a_message_over_the_limit_is_skipped_and_the_next_one_read() {
    let (a, b) = pair().await;
    let writer = tokio::spawn(async move {
        let mut a = a;
        write_message(
            &mut a,
            &[Bytes::from_static(b"head"), Bytes::from(vec![0u8; 5000])],
        )
        .await
        .unwrap();
        write_message(&mut a, &[Bytes::from_static(b"ok")])
            .await
            .unwrap();
    });
    let limits = Limits {
        max_message_bytes: 1000,
        max_frames: 10,
    };
    let mut r = FrameReader::new(b);
    match r.read(&limits).await.unwrap() {
        Some(Incoming::TooLarge { head, reason }) => {
            assert_eq!(head, vec![Bytes::from_static(b"head")]);
            assert!(reason.contains("1000 bytes"), "{reason}");
        }
        other => panic!("{other:?}"),
    }
    let Some(Incoming::Message(m)) = r.read(&limits).await.unwrap() else {
        panic!()
    };
    assert_eq!(m, vec![Bytes::from_static(b"ok")]);
    writer.await.unwrap();
}

#[tokio::test]
async fn too_many_frames_is_reported_not_buffered() {
    let (a, b) = pair().await;
    let writer = tokio::spawn(async move {
        let mut a = a;
        let many: Vec<Bytes> = (0..50u8).map(|i| Bytes::from(vec![i; 3])).collect();
        write_message(&mut a, &many).await.unwrap();
    });
    let mut r = FrameReader::new(b);
    let limits = Limits {
        max_message_bytes: 1 << 20,
        max_frames: 8,
    };
    let Some(Incoming::TooLarge { head, reason }) = r.read(&limits).await.unwrap() else {
        panic!()
    };
    assert_eq!(head.len(), 1);
    assert!(reason.contains("more than 8 frames"), "{reason}");
    writer.await.unwrap();
}

/// The reading end of a peer that declares a 2^40-byte frame (within a
/// generous limit), sends 10 bytes of it and closes.
async fn declares_a_tebibyte_sends_ten_bytes() -> tokio::io::DuplexStream {
    let (mut a, b) = pair().await;
    let mut raw = BytesMut::new();
    raw.put_u8(frame::FLAG_LONG);
    raw.put_u64(1 << 40);
    raw.put_slice(&[0u8; 10]);
    a.write_all(&raw).await.unwrap();
    drop(a);
    b
}

#[tokio::test]
async fn a_huge_declared_frame_allocates_only_what_arrives() {
    let b = declares_a_tebibyte_sends_ten_bytes().await;
    let mut r = FrameReader::new(b);
    let limits = Limits {
        max_message_bytes: u64::MAX,
        max_frames: 10,
    };
    // Would abort the process if 1 TiB were reserved up front.
    assert!(matches!(r.read(&limits).await, Err(ZmtpError::Closed)));
}

/// Sends `frames` as one message and reads it through `r`.
async fn through<W: AsyncWrite + Unpin, R: AsyncRead + Unpin>(
    w: &mut W,
    r: &mut FrameReader<R>,
    frames: &[Bytes],
) -> Vec<Bytes> {
    let (sent, got) = tokio::join!(write_message(w, frames), r.read(&Limits::DEFAULT));
    sent.unwrap();
    let Some(Incoming::Message(got)) = got.unwrap() else {
        panic!()
    };
    got
}

#[tokio::test]
async fn a_large_frame_reuses_the_buffer_of_a_dropped_one() {
    let (mut a, b) = pair().await;
    let pool = ReceivePool::new(64 << 20, pool::IDLE);
    let mut r = FrameReader::with_pool(b, Some(pool.clone()));
    let first: Vec<u8> = (0..3 << 20).map(|i: u32| (i % 251) as u8).collect();
    let got = through(
        &mut a,
        &mut r,
        &[Bytes::from_static(b"h"), Bytes::from(first.clone())],
    )
    .await;
    assert_eq!(got[1], first);
    let ptr = got[1].as_ptr();
    drop(got);
    assert_eq!(
        pool.pooled_bytes(),
        3 << 20,
        "a whole frame leaves its buffer at its size"
    );
    // The same size again (an eighth smaller fits too): same memory, new bytes.
    let second: Vec<u8> = (0..3 << 20).map(|i: u32| (i % 13) as u8).collect();
    let got = through(
        &mut a,
        &mut r,
        &[Bytes::from(second.clone()), Bytes::from_static(b"t")],
    )
    .await;
    assert_eq!(got[0].as_ptr(), ptr);
    assert_eq!(got[0], second);
    assert_eq!(got[1], Bytes::from_static(b"t"));
    assert_eq!(pool.pooled_bytes(), 0);
    drop(got);
    let third = vec![5u8; (3 << 20) - (1 << 18)];
    let got = through(&mut a, &mut r, &[Bytes::from(third.clone())]).await;
    assert_eq!((got[0].as_ptr(), &got[0][..]), (ptr, &third[..]));
}

#[tokio::test]
async fn a_buffer_a_row_still_refers_to_is_not_reused() {
    let (mut a, b) = pair().await;
    let pool = ReceivePool::new(64 << 20, pool::IDLE);
    let mut r = FrameReader::with_pool(b, Some(pool.clone()));
    let got = through(&mut a, &mut r, &[Bytes::from(vec![1u8; 2 << 20])]).await;
    let ptr = got[0].as_ptr();
    // A stored row: a slice of the frame.
    let row = got[0].slice(4096..8192);
    drop(got);
    assert_eq!(pool.pooled_bytes(), 0);
    let got = through(&mut a, &mut r, &[Bytes::from(vec![2u8; 2 << 20])]).await;
    assert_ne!(got[0].as_ptr(), ptr);
    assert!(got[0].iter().all(|&x| x == 2));
    assert!(row.iter().all(|&x| x == 1), "the row kept its bytes");
    drop(row);
    assert_eq!(pool.pooled_bytes(), 2 << 20);
    drop(got);
    assert_eq!(pool.pooled_bytes(), 4 << 20);
}

#[tokio::test]
async fn a_pooled_reader_still_allocates_only_what_arrives() {
    let pool = ReceivePool::new(64 << 20, pool::IDLE);
    // One 2 MiB buffer pooled: it does not fit a declared 2^40.
    drop(ReceivePool::wrap(
        &pool,
        Pages::copy_from(&vec![0u8; 2 << 20]).unwrap(),
    ));
    let b = declares_a_tebibyte_sends_ten_bytes().await;
    let mut r = FrameReader::with_pool(b, Some(pool.clone()));
    let limits = Limits {
        max_message_bytes: u64::MAX,
        max_frames: 10,
    };
    assert!(matches!(r.read(&limits).await, Err(ZmtpError::Closed)));
    // The pooled buffer is untouched; the broken frame's (one first
    // chunk) was freed, not pooled.
    assert_eq!(pool.pooled_buffers(), 1);
    assert_eq!(pool.pooled_bytes(), 2 << 20);
}

#[tokio::test]
async fn reserved_flag_bits_are_a_protocol_error() {
    let (mut a, b) = pair().await;
    a.write_all(&[0x80, 1, 0]).await.unwrap();
    let mut r = FrameReader::new(b);
    match r.read(&Limits::DEFAULT).await {
        Err(e @ ZmtpError::Protocol(_)) => assert_eq!(
            e.to_string(),
            "ZMTP protocol error: frame flags 0x80 have reserved bits set"
        ),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn empty_and_oversized_commands_are_protocol_errors() {
    for (header, size) in [
        (vec![frame::FLAG_COMMAND, 0], 0u64),
        (
            [
                &[frame::FLAG_COMMAND | frame::FLAG_LONG][..],
                &(2u64 << 20).to_be_bytes(),
            ]
            .concat(),
            2 << 20,
        ),
    ] {
        let mut r = FrameReader::new(&header[..]);
        match r.read(&Limits::DEFAULT).await {
            Err(e) => assert_eq!(
                e.to_string(),
                format!("ZMTP protocol error: command frame of {size} bytes")
            ),
            other => panic!("{other:?}"),
        }
    }
}

#[tokio::test]
async fn handshake_exchanges_identity_and_refuses_wrong_socket_types() {
    let (a, b) = pair().await;
    let (ra, mut wa) = tokio::io::split(a);
    let (rb, mut wb) = tokio::io::split(b);
    let server = tokio::spawn(async move {
        let mut r = FrameReader::new(rb);
        handshake(&mut r, &mut wb, "ROUTER", b"", &["DEALER", "REQ"]).await
    });
    let mut r = FrameReader::new(ra);
    let info = handshake(&mut r, &mut wa, "DEALER", b"me", &["ROUTER"])
        .await
        .unwrap();
    assert_eq!(info.socket_type, "ROUTER");
    let peer = server.await.unwrap().unwrap();
    assert_eq!(
        (peer.socket_type.as_str(), &peer.identity[..]),
        ("DEALER", &b"me"[..])
    );

    let (a, b) = pair().await;
    let (ra, mut wa) = tokio::io::split(a);
    let (rb, mut wb) = tokio::io::split(b);
    let server = tokio::spawn(async move {
        let mut r = FrameReader::new(rb);
        handshake(&mut r, &mut wb, "ROUTER", b"", &["DEALER"]).await
    });
    let mut r = FrameReader::new(ra);
    handshake(&mut r, &mut wa, "PUB", b"", &["ROUTER"])
        .await
        .expect("the ROUTER side is acceptable to us");
    // The ROUTER refuses us: an ERROR command naming the reason.
    match r.read(&Limits::DEFAULT).await {
        Ok(Some(Incoming::Command { name, body })) => {
            assert_eq!(name, "ERROR");
            assert!(String::from_utf8_lossy(&body).contains("PUB"));
        }
        other => panic!("expected ERROR, got {other:?}"),
    }
    let server_err = server.await.unwrap().unwrap_err().to_string();
    assert!(server_err.contains("PUB"), "{server_err}");
}

#[test]
fn the_pool_counts_hits_misses_and_what_it_frees() {
    use std::sync::atomic::Ordering::Relaxed;
    let pool = ReceivePool::new(4 << 20, pool::IDLE);
    let c = pool.counters();
    assert!(pool.take(1 << 10).is_none(), "small frames are not pooled");
    assert_eq!((c.hits.load(Relaxed), c.misses.load(Relaxed)), (0, 0));
    assert!(pool.take(2 << 20).is_none());
    assert_eq!((c.hits.load(Relaxed), c.misses.load(Relaxed)), (0, 1));
    drop(ReceivePool::wrap(
        &pool,
        Pages::copy_from(&vec![0u8; 2 << 20]).unwrap(),
    ));
    let buf = pool.take(2 << 20).expect("the pages just given back");
    assert_eq!((c.hits.load(Relaxed), c.misses.load(Relaxed)), (1, 1));
    // Past the cap, or nothing pooled: misses.
    assert!(pool.take(5 << 20).is_none());
    assert!(pool.take(1 << 20).is_none());
    assert_eq!((c.hits.load(Relaxed), c.misses.load(Relaxed)), (1, 3));
    // Full at 4 MiB: a third 2 MiB range pushes the oldest out.
    let fresh = || Pages::copy_from(&vec![0u8; 2 << 20]).unwrap();
    pool.give(buf);
    pool.give(fresh());
    assert_eq!(c.freed_bytes.load(Relaxed), 0);
    pool.give(fresh());
    assert_eq!(c.freed_bytes.load(Relaxed), 2 << 20);
    // Idle ones go too, and count.
    assert_eq!(
        pool.release_idle(std::time::Instant::now() + pool::IDLE),
        4 << 20
    );
    assert_eq!(c.freed_bytes.load(Relaxed), 6 << 20);
}

/// Takes one username and password.
struct OneToken;

impl Authenticator for OneToken {
    fn authenticate(&self, username: &[u8], password: &[u8]) -> Result<String, String> {
        match (username, password) {
            (b"stowage", b"s3cret") => Ok("own token".into()),
            _ => Err("wrong credentials".into()),
        }
    }
}

/// Runs a handshake on each end of a duplex pipe: (client's, server's).
async fn shake(
    client: Security<'_>,
    server: Security<'_>,
) -> (Result<PeerInfo, ZmtpError>, Result<PeerInfo, ZmtpError>) {
    let (a, b) = pair().await;
    let (ar, mut aw) = tokio::io::split(a);
    let (br, mut bw) = tokio::io::split(b);
    let (mut ar, mut br) = (FrameReader::new(ar), FrameReader::new(br));
    let c = handshake_with(&mut ar, &mut aw, client, "DEALER", b"me", &["ROUTER"]);
    let s = handshake_with(&mut br, &mut bw, server, "ROUTER", b"", &["DEALER"]);
    let (c, s) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(5), c),
        tokio::time::timeout(Duration::from_secs(5), s)
    );
    (
        c.expect("client side finishes"),
        s.expect("server side finishes"),
    )
}

fn err(r: Result<PeerInfo, ZmtpError>) -> String {
    r.expect_err("refused").to_string()
}

#[tokio::test]
async fn plain_with_the_right_credentials_connects_and_names_the_user() {
    let (c, s) = shake(
        Security::PlainClient {
            username: b"stowage",
            password: b"s3cret",
        },
        Security::PlainServer(&OneToken),
    )
    .await;
    let (c, s) = (c.unwrap(), s.unwrap());
    assert_eq!(c.socket_type, "ROUTER");
    assert_eq!(
        (s.socket_type.as_str(), &s.identity[..]),
        ("DEALER", &b"me"[..])
    );
    assert_eq!(s.user.as_deref(), Some("own token"));
    assert_eq!(c.user, None);
}

#[tokio::test]
async fn a_wrong_password_is_refused_on_both_sides_without_echoing_it() {
    let (c, s) = shake(
        Security::PlainClient {
            username: b"stowage",
            password: b"guess",
        },
        Security::PlainServer(&OneToken),
    )
    .await;
    let (c, s) = (err(c), err(s));
    assert!(
        c.contains("peer refused the connection: wrong credentials"),
        "{c}"
    );
    assert!(s.contains("wrong credentials"), "{s}");
    assert!(!c.contains("guess") && !s.contains("guess"));
}

#[tokio::test]
async fn a_null_client_is_told_the_endpoint_wants_credentials() {
    let (c, s) = shake(Security::Null, Security::PlainServer(&OneToken)).await;
    let (c, s) = (err(c), err(s));
    assert!(c.contains("the server requires stowd's token"), "{c}");
    assert!(s.contains("the peer sent none (NULL)"), "{s}");
}

#[tokio::test]
async fn a_plain_client_of_a_null_server_connects_without_offering_its_credentials() {
    let (c, s) = shake(
        Security::PlainClient {
            username: b"stowage",
            password: b"s3cret",
        },
        Security::Null,
    )
    .await;
    assert_eq!(c.unwrap().socket_type, "ROUTER");
    assert_eq!(s.unwrap().socket_type, "DEALER");
}

#[tokio::test]
async fn two_plain_servers_do_not_connect_and_a_libzmq_style_server_greeting_is_taken() {
    let (c, s) = shake(
        Security::PlainServer(&OneToken),
        Security::PlainServer(&OneToken),
    )
    .await;
    assert!(err(c).contains("PLAIN server too") && err(s).contains("PLAIN server too"));
    // libzmq's PLAIN server sends as-server 0: a client does not check it.
    let mut g = frame::greeting_as(frame::Mechanism::Plain, false);
    let (a, b) = pair().await;
    let (ar, mut aw) = tokio::io::split(a);
    let (br, mut bw) = tokio::io::split(b);
    let mut ar = FrameReader::new(ar);
    let mut br = FrameReader::new(br);
    let client = handshake_with(
        &mut ar,
        &mut aw,
        Security::PlainClient {
            username: b"stowage",
            password: b"s3cret",
        },
        "DEALER",
        b"",
        &["ROUTER"],
    );
    let server = async {
        g[32] = 0;
        bw.write_all(&g).await.unwrap();
        br.read_greeting().await.unwrap();
        let (name, _) = br.read_command().await.unwrap();
        assert_eq!(name, "HELLO");
        bw.write_all(&frame::welcome_command()).await.unwrap();
        let (name, _) = br.read_command().await.unwrap();
        assert_eq!(name, "INITIATE");
        bw.write_all(&frame::ready_command(&[("Socket-Type", b"ROUTER")]))
            .await
            .unwrap();
        bw.flush().await.unwrap();
    };
    let (c, ()) = tokio::join!(client, server);
    assert_eq!(c.unwrap().socket_type, "ROUTER");
}

/// A client that sends a HELLO of its own making, then reads the reply.
async fn raw_hello(data: &[u8]) -> (Result<PeerInfo, ZmtpError>, Bytes) {
    let (a, b) = pair().await;
    let (ar, mut aw) = tokio::io::split(a);
    let (br, mut bw) = tokio::io::split(b);
    let mut ar = FrameReader::new(ar);
    let mut br = FrameReader::new(br);
    let server = handshake_with(
        &mut br,
        &mut bw,
        Security::PlainServer(&OneToken),
        "ROUTER",
        b"",
        &["DEALER"],
    );
    let client = async {
        aw.write_all(&frame::greeting_as(frame::Mechanism::Plain, false))
            .await
            .unwrap();
        aw.write_all(&frame::command_frame("HELLO", data))
            .await
            .unwrap();
        aw.flush().await.unwrap();
        ar.read_greeting().await.unwrap();
        ar.read_command().await.unwrap()
    };
    let (s, (name, body)) = tokio::join!(server, client);
    assert_eq!(name, "ERROR");
    (s, body)
}

#[tokio::test]
async fn a_garbled_hello_is_refused_with_a_reason() {
    // Password length past the end; bytes after the password; empty.
    for data in [&b"\x07stowage\x09s3"[..], b"\x07stowage\x06s3cretXX", b""] {
        let (s, body) = raw_hello(data).await;
        assert!(err(s).contains("truncated HELLO"));
        assert!(frame::error_reason(&body).contains("truncated HELLO"));
    }
    // Well formed, wrong: refused the same way as through the client.
    let (s, body) = raw_hello(b"\x07stowage\x05guess").await;
    assert!(err(s).contains("wrong credentials"));
    assert_eq!(frame::error_reason(&body), "wrong credentials");
}

/// Takes one client key.
struct OneKey([u8; curve::KEY_LEN]);

impl curve::KeyCheck for OneKey {
    fn check(&self, client: &[u8; curve::KEY_LEN]) -> Result<String, String> {
        if *client == self.0 {
            Ok("the one client".into())
        } else {
            Err("client key not allowed".into())
        }
    }
}

#[tokio::test]
async fn curve_connects_names_the_client_and_carries_messages_both_ways_encrypted() {
    let (ck, sk) = (
        curve::Keypair::generate().unwrap(),
        curve::Keypair::generate().unwrap(),
    );
    let check = OneKey(*ck.public());
    let (a, b) = pair().await;
    let (ar, mut aw) = tokio::io::split(a);
    let (br, mut bw) = tokio::io::split(b);
    let (mut ar, mut br) = (FrameReader::new(ar), FrameReader::new(br));
    let client = Security::Client {
        plain: Some((b"stowage", b"s3cret")),
        curve: Some((&ck, sk.public())),
    };
    let server = Security::CurveServer {
        keys: &sk,
        check: &check,
    };
    let c = handshake_with(&mut ar, &mut aw, client, "DEALER", b"me", &["ROUTER"]);
    let s = handshake_with(&mut br, &mut bw, server, "ROUTER", b"", &["DEALER"]);
    let (c, s) = tokio::join!(c, s);
    let (mut c, mut s) = (c.unwrap(), s.unwrap());
    assert_eq!(s.user.as_deref(), Some("the one client"));
    assert_eq!(&s.identity[..], b"me");
    assert_eq!(c.socket_type, "ROUTER");
    let (mut ar, mut aw) = secure(ar, aw, c.session.take(), None, &Limits::DEFAULT);
    let (mut br, mut bw) = secure(br, bw, s.session.take(), None, &Limits::DEFAULT);
    let big = Bytes::from(
        (0..3_000_000u32)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<_>>(),
    );
    let msg = vec![Bytes::from_static(b"head"), Bytes::new(), big.clone()];
    let sent = msg.clone();
    let writer = tokio::spawn(async move {
        write_message(&mut aw, &sent).await.unwrap();
        write_gathered(
            &mut aw,
            &[Bytes::from_static(b"ab"), Bytes::from_static(b"cd")],
            &[2],
        )
        .await
        .unwrap();
        aw
    });
    match br.read(&Limits::DEFAULT).await.unwrap() {
        Some(Incoming::Message(frames)) => assert_eq!(frames, msg),
        other => panic!("{other:?}"),
    }
    match br.read(&Limits::DEFAULT).await.unwrap() {
        Some(Incoming::Message(frames)) => assert_eq!(frames, vec![Bytes::from_static(b"abcd")]),
        other => panic!("{other:?}"),
    }
    let _aw = writer.await.unwrap();
    write_message(&mut bw, &[Bytes::from_static(b"reply")])
        .await
        .unwrap();
    match ar.read(&Limits::DEFAULT).await.unwrap() {
        Some(Incoming::Message(frames)) => assert_eq!(frames, vec![Bytes::from_static(b"reply")]),
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn curve_refuses_a_key_not_allowed_a_wrong_server_key_and_other_mechanisms() {
    let (ck, sk, other) = (
        curve::Keypair::generate().unwrap(),
        curve::Keypair::generate().unwrap(),
        curve::Keypair::generate().unwrap(),
    );
    let check = OneKey(*other.public());
    // A client key not allowed: refused at INITIATE, both sides say why.
    let (c, s) = shake(
        Security::CurveClient {
            keys: &ck,
            server: sk.public(),
        },
        Security::CurveServer {
            keys: &sk,
            check: &check,
        },
    )
    .await;
    assert!(err(c).contains("client key not allowed"));
    assert!(err(s).contains("client key not allowed"));
    // The wrong server key: the server cannot open HELLO.
    let check = OneKey(*ck.public());
    let (c, s) = shake(
        Security::CurveClient {
            keys: &ck,
            server: other.public(),
        },
        Security::CurveServer {
            keys: &sk,
            check: &check,
        },
    )
    .await;
    assert!(err(c).contains("HELLO did not decrypt"), "client side");
    assert!(err(s).contains("HELLO did not decrypt"));
    // A NULL client, and a PLAIN one, are told CURVE is required.
    let (c, s) = shake(
        Security::Null,
        Security::CurveServer {
            keys: &sk,
            check: &check,
        },
    )
    .await;
    assert!(err(c).contains("requires CURVE"));
    assert!(err(s).contains("requires CURVE"));
    let (c, s) = shake(
        Security::PlainClient {
            username: b"stowage",
            password: b"s3cret",
        },
        Security::CurveServer {
            keys: &sk,
            check: &check,
        },
    )
    .await;
    assert!(err(c).contains("requires CURVE"));
    assert!(s.is_err());
    // A CURVE client of a PLAIN server is refused, not downgraded.
    let (c, s) = shake(
        Security::CurveClient {
            keys: &ck,
            server: sk.public(),
        },
        Security::PlainServer(&OneToken),
    )
    .await;
    assert!(err(c).contains("speaks CURVE; the server speaks PLAIN"));
    assert!(s.is_err());
}

#[tokio::test]
async fn a_client_without_keys_or_credentials_is_told_curve_is_required() {
    let sk = curve::Keypair::generate().unwrap();
    let check = OneKey(*sk.public());
    let (c, s) = shake(
        Security::Client {
            plain: None,
            curve: None,
        },
        Security::CurveServer {
            keys: &sk,
            check: &check,
        },
    )
    .await;
    assert!(err(c).contains("requires CURVE"));
    assert!(s.is_err());
}

/// A gathered message of more frames than the writer keeps inline (70,
/// past its 64 header lengths and iovecs), short and long headers mixed
/// (frames of 0, 1, 255, 256 and 70,000 bytes, some of several parts),
/// reads back as the same frames, each part in order.
#[tokio::test]
async fn a_gathered_message_of_many_frames_and_both_header_sizes_reads_back() {
    let (a, b) = tokio::io::duplex(1 << 20);
    let sizes = [0usize, 1, 255, 256, 70_000];
    let mut parts = Vec::new();
    let mut per_frame = Vec::new();
    let mut frames = Vec::new();
    for k in 0..70usize {
        let len = sizes[k % sizes.len()];
        let whole: Vec<u8> = (0..len).map(|i| (i + k) as u8).collect();
        // Every third frame in two parts (the second may be empty).
        let cut = if k % 3 == 0 { len / 2 } else { len };
        parts.push(Bytes::copy_from_slice(&whole[..cut]));
        let mut n = 1;
        if cut < len || k % 3 == 0 {
            parts.push(Bytes::copy_from_slice(&whole[cut..]));
            n += 1;
        }
        per_frame.push(n);
        frames.push(Bytes::from(whole));
    }
    let writer = tokio::spawn(async move {
        let mut a = a;
        write_gathered(&mut a, &parts, &per_frame).await.unwrap();
    });
    let mut r = FrameReader::new(b);
    let Some(Incoming::Message(got)) = r.read(&Limits::DEFAULT).await.unwrap() else {
        panic!()
    };
    writer.await.unwrap();
    assert_eq!(got.len(), 70);
    assert_eq!(got, frames);
}
