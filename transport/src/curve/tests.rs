use super::*;

struct Allow(Vec<[u8; KEY_LEN]>);

impl KeyCheck for Allow {
    fn check(&self, client: &[u8; KEY_LEN]) -> Result<String, String> {
        if self.0.contains(client) {
            Ok(z85_encode(client))
        } else {
            Err("client key not in the allowlist".into())
        }
    }
}

/// A whole handshake: (client's session, server's session, what the
/// server learned, the server's metadata as the client read it).
fn shake(
    client: &Keypair,
    server: &Keypair,
    told: &[u8; KEY_LEN],
    allow: &Allow,
) -> Result<(Session, Session, Initiated, Vec<u8>), CurveError> {
    let mut c = ClientHandshake::new(client, told)?;
    let mut s = ServerHandshake::new(server)?;
    let welcome = s.hello(&c.hello())?;
    let initiate = c.welcome(&welcome, b"\x0bSocket-Type\0\0\0\x06DEALER")?;
    let who = s.initiate(&initiate, allow)?;
    let (ready, ss) = s.ready(b"\x0bSocket-Type\0\0\0\x06ROUTER")?;
    let (meta, cs) = c.ready(&ready)?;
    Ok((cs, ss, who, meta))
}

/// A handshake the server takes: its outcome.
fn allowed(client: &Keypair, server: &Keypair) -> (Session, Session, Initiated, Vec<u8>) {
    shake(
        client,
        server,
        server.public(),
        &Allow(vec![*client.public()]),
    )
    .unwrap()
}

fn plain_frames(frames: &[(&[u8], bool)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (f, more) in frames {
        Header::message(f.len() as u64, *more).put(&mut out);
        out.extend_from_slice(f);
    }
    out
}

/// Runs `plain` through `enc` in pieces of `step` bytes and the result
/// through `dec` in pieces of `step2`: the plaintext read back.
fn through(
    enc: &mut Encrypter,
    dec: &mut Decrypter,
    plain: &[u8],
    step: usize,
    step2: usize,
) -> Vec<u8> {
    let mut wire = VecDeque::new();
    for chunk in plain.chunks(step) {
        enc.feed(chunk, &mut wire).unwrap();
    }
    assert!(!enc.mid_frame());
    let wire: Vec<u8> = wire.iter().flat_map(|b| b.iter().copied()).collect();
    let mut out = vec![0u8; plain.len()];
    let mut got = 0;
    for chunk in wire.chunks(step2) {
        dec.feed(chunk).unwrap();
        got += dec.read(&mut out[got..]);
    }
    assert_eq!(dec.ready(), 0);
    out.truncate(got);
    out
}

#[test]
fn a_handshake_names_the_client_and_frames_go_both_ways() {
    let client = Keypair::generate().unwrap();
    let server = Keypair::generate().unwrap();
    let (mut cs, mut ss, who, meta) = allowed(&client, &server);
    assert_eq!(who.client, *client.public());
    assert_eq!(who.metadata, b"\x0bSocket-Type\0\0\0\x06DEALER");
    assert_eq!(meta, b"\x0bSocket-Type\0\0\0\x06ROUTER");
    let big = vec![7u8; 70_000];
    let plain = plain_frames(&[(b"head", true), (b"", true), (&big, false)]);
    for (step, step2) in [
        (1, 3),
        (5, 1000),
        (plain.len(), plain.len() + 100),
        (4096, 17),
    ] {
        assert_eq!(
            through(&mut cs.encrypter, &mut ss.decrypter, &plain, step, step2),
            plain
        );
        assert_eq!(
            through(&mut ss.encrypter, &mut cs.decrypter, &plain, step2, step),
            plain
        );
    }
    // A command (PING) keeps its flag.
    let mut ping = Vec::new();
    Header::command(9).put(&mut ping);
    ping.extend_from_slice(b"\x04PING\0\x01ab");
    assert_eq!(
        through(&mut cs.encrypter, &mut ss.decrypter, &ping, 3, 3),
        ping
    );
}

#[test]
fn the_wrong_server_key_fails_at_hello() {
    let client = Keypair::generate().unwrap();
    let server = Keypair::generate().unwrap();
    let other = Keypair::generate().unwrap();
    let e = shake(
        &client,
        &server,
        other.public(),
        &Allow(vec![*client.public()]),
    )
    .err()
    .unwrap();
    assert!(matches!(e, CurveError::Forged("HELLO", _)), "{e}");
}

#[test]
fn a_client_outside_the_allowlist_is_refused_at_initiate() {
    let client = Keypair::generate().unwrap();
    let server = Keypair::generate().unwrap();
    let e = shake(&client, &server, server.public(), &Allow(vec![]))
        .err()
        .unwrap();
    assert_eq!(
        e,
        CurveError::Refused("client key not in the allowlist".into())
    );
    assert!(!e.to_string().contains(&z85_encode(client.public())));
}

#[test]
fn a_replayed_or_garbled_message_is_refused() {
    let client = Keypair::generate().unwrap();
    let server = Keypair::generate().unwrap();
    let (mut cs, mut ss, _, _) = allowed(&client, &server);
    let mut wire = VecDeque::new();
    cs.encrypter
        .feed(&plain_frames(&[(b"one", false)]), &mut wire)
        .unwrap();
    let first = wire.pop_front().unwrap();
    ss.decrypter.feed(&first).unwrap();
    assert_eq!(
        ss.decrypter.feed(&first),
        Err(CurveError::Replay("MESSAGE"))
    );
    // A flipped bit of the next frame.
    cs.encrypter
        .feed(&plain_frames(&[(b"two", false)]), &mut wire)
        .unwrap();
    let mut second = wire.pop_front().unwrap().to_vec();
    let last = second.len() - 1;
    second[last] ^= 1;
    let e = ss.decrypter.feed(&second).unwrap_err();
    assert!(matches!(e, CurveError::Forged("MESSAGE", _)), "{e}");
}

#[test]
fn a_plaintext_frame_or_a_huge_declared_size_is_refused_before_it_is_read() {
    let client = Keypair::generate().unwrap();
    let server = Keypair::generate().unwrap();
    let (_, mut ss, _, _) = allowed(&client, &server);
    let plain = plain_frames(&[(b"hi", false)]);
    assert!(matches!(
        ss.decrypter.feed(&plain),
        Err(CurveError::Frame(_))
    ));
    let (_, mut ss, _, _) = allowed(&client, &server);
    let more = plain_frames(&[(b"\x07MESSAGE", true)]);
    assert!(matches!(
        ss.decrypter.feed(&more),
        Err(CurveError::NotMessage(_))
    ));
    let (_, mut ss, _, _) = allowed(&client, &server);
    ss.decrypter.set_max_frame(1 << 20);
    let mut huge = Vec::new();
    Header::command(1 << 40).put(&mut huge);
    assert!(matches!(
        ss.decrypter.feed(&huge),
        Err(CurveError::TooLarge(_, _))
    ));
}

#[test]
fn a_replayed_initiate_from_another_connection_is_refused() {
    let client = Keypair::generate().unwrap();
    let server = Keypair::generate().unwrap();
    let allow = Allow(vec![*client.public()]);
    let mut c = ClientHandshake::new(&client, server.public()).unwrap();
    let mut s = ServerHandshake::new(&server).unwrap();
    let hello = c.hello();
    let welcome = s.hello(&hello).unwrap();
    let initiate = c.welcome(&welcome, b"").unwrap();
    // Another connection that replays this HELLO and INITIATE: its cookie
    // key and transient key are not the first connection's.
    let mut s2 = ServerHandshake::new(&server).unwrap();
    s2.hello(&hello).unwrap();
    let e = s2.initiate(&initiate, &allow).unwrap_err();
    assert!(matches!(e, CurveError::Forged("INITIATE cookie", _)), "{e}");
    s.initiate(&initiate, &allow).unwrap();
}

#[test]
fn truncated_or_garbled_handshake_commands_are_errors_not_panics() {
    let client = Keypair::generate().unwrap();
    let server = Keypair::generate().unwrap();
    let allow = Allow(vec![*client.public()]);
    let mut c = ClientHandshake::new(&client, server.public()).unwrap();
    let hello = c.hello();
    for cut in 0..hello.len() {
        let mut s = ServerHandshake::new(&server).unwrap();
        assert!(s.hello(&hello[..cut]).is_err());
    }
    let mut s = ServerHandshake::new(&server).unwrap();
    let welcome = s.hello(&hello).unwrap();
    for cut in 0..welcome.len() {
        let mut c2 = ClientHandshake::new(&client, server.public()).unwrap();
        c2.hello();
        assert!(c2.welcome(&welcome[..cut], b"").is_err());
    }
    let initiate = c.welcome(&welcome, b"").unwrap();
    for cut in 0..initiate.len() {
        let mut s2 = ServerHandshake::new(&server).unwrap();
        s2.hello(&hello).unwrap();
        assert!(s2.initiate(&initiate[..cut], &allow).is_err());
    }
    let mut bad = initiate.clone();
    bad[200] ^= 0x40;
    assert!(s.initiate(&bad, &allow).is_err());
}

#[test]
fn z85_keys_round_trip_and_bad_text_is_refused() {
    let k = Keypair::generate().unwrap();
    let text = z85_encode(k.public());
    assert_eq!(text.len(), KEY_Z85_LEN);
    assert_eq!(z85_decode(&format!(" {text}\n")).unwrap(), *k.public());
    assert!(z85_decode("short").is_err());
    assert!(z85_decode(&"~".repeat(40)).is_err() || z85_decode(&"~".repeat(40)).is_ok());
    assert!(z85_decode(&format!("{}\"", &text[..39])).is_err());
    // A key from its secret is the same pair.
    assert_eq!(Keypair::from_secret(k.secret_bytes()).public(), k.public());
}

#[test]
fn keys_of_small_order_are_refused() {
    let client = Keypair::generate().unwrap();
    let server = Keypair::generate().unwrap();
    // u = 0 and u = 1 are of small order: the X25519 output is all zeros
    // whatever the secret key.
    for bad in [[0u8; KEY_LEN], {
        let mut one = [0u8; KEY_LEN];
        one[0] = 1;
        one
    }] {
        assert!(matches!(
            ClientHandshake::new(&client, &bad),
            Err(CurveError::Key(_))
        ));
        // A HELLO whose transient key is of small order: refused by the server.
        let mut c = ClientHandshake::new(&client, server.public()).unwrap();
        let mut hello = c.hello();
        hello[80..112].copy_from_slice(&bad);
        let mut s = ServerHandshake::new(&server).unwrap();
        assert!(matches!(s.hello(&hello), Err(CurveError::Key(_))));
    }
}
