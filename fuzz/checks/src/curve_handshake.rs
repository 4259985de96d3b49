//! CurveZMQ (`transport::curve`) on what a peer may send: a real
//! [`ServerHandshake`] and a real [`ClientHandshake`] (fixed long-term test
//! keys; their transient keys and the cookie key are fresh each time, as
//! in `stowd`), fed HELLO, WELCOME, INITIATE and READY bodies, and a
//! [`Decrypter`] fed wire bytes after a real handshake.
//!
//! Random bytes never get past a box, so the input mostly chooses what to
//! do to a genuine handshake (its first byte picks the mode; the rest are
//! the mode's parameters, read as far as they go, zeros after):
//!
//! | mode | what | must hold |
//! |---|---|---|
//! | 0 | the server fed garbage HELLOs, then (with a genuine HELLO) garbage INITIATEs | each refused; a genuine INITIATE afterwards is taken |
//! | 1 | the client fed a garbage WELCOME, then (after a genuine one) a garbage READY | each refused |
//! | 2 | a genuine handshake with one message (HELLO, WELCOME, INITIATE or READY) changed: one byte flipped, cut, bytes appended or replaced | an unchanged message is taken, a changed one refused (HELLO's 72 padding bytes are not checked: a change there only is taken); the genuine message after a refused one is taken; the allowlist decides INITIATE |
//! | 3 | messages replayed: INITIATE twice, INITIATE, WELCOME or READY of another connection, HELLO again, a MESSAGE of another session | each refused (a repeated HELLO may be answered: it commits to nothing) |
//! | 4 | a genuine handshake, then a [`Decrypter`] (either side's, with or without [`Decrypter::set_max_frame`]) fed the peer's sealed frames in pieces, with frames skipped, replayed, flipped, cut, garbage, frames the receiver sealed itself, handshake commands, and headers declaring any size | every frame sealed by the peer and delivered in order comes out exactly, header and bytes; skipped ones leave no gap; a replayed, flipped, reflected, foreign or garbage frame is refused and gives nothing; a declared size over the limit is refused from its header alone; a cut frame gives nothing |
//! | 5 | `z85_decode` on the bytes as text | a key decoded is written back (`z85_encode`) as the text, trimmed |
//! | 6 | `zmtp::handshake_with` as a CURVE server (`stowd`'s side) on a client's bytes: a CURVE client greeting and a genuine HELLO first, or not, then the input | refused; it writes its greeting, WELCOME only after a genuine HELLO, and at most one ERROR, nothing else |
//!
//! A declared size under the limit (or without one) allocates at most the
//! decrypter's first chunk (1 MiB), so a header declaring 2^63 bytes costs
//! nothing: libFuzzer's malloc limit (2 GiB) would stop a run that
//! allocated from it.
//!
//! In every mode the handshake a genuine peer completes must succeed: the
//! client learns the server's metadata, the server the client's key,
//! user and metadata.

use std::collections::VecDeque;
use std::sync::OnceLock;

use bytes::Bytes;
use stowage_transport::curve::{
    self, ClientHandshake, CurveError, Decrypter, Encrypter, KEY_LEN, KeyCheck, Keypair,
    MESSAGE_OVERHEAD, ServerHandshake, Session,
};
use stowage_transport::frame::{self, Decoded, Header, Mechanism};
use stowage_transport::zmtp::{self, FrameReader, Security};

use crate::split_frames;

/// The client's metadata (INITIATE) and the server's (READY).
const CLIENT_META: &[u8] = b"\x0bSocket-Type\0\0\0\x06DEALER";
const SERVER_META: &[u8] = b"\x0bSocket-Type\0\0\0\x06ROUTER";
/// The user the allowlist names the client.
const USER: &str = "fuzz-client";

fn keys(seed: u8) -> Keypair {
    Keypair::from_secret([seed; KEY_LEN])
}

/// The server's long-term key pair.
fn server_keys() -> &'static Keypair {
    static K: OnceLock<Keypair> = OnceLock::new();
    K.get_or_init(|| keys(0x53))
}

/// The client's long-term key pair.
fn client_keys() -> &'static Keypair {
    static K: OnceLock<Keypair> = OnceLock::new();
    K.get_or_init(|| keys(0x43))
}

/// The server's allowlist: the client's key, or nobody.
struct Allow(bool);

impl KeyCheck for Allow {
    fn check(&self, client: &[u8; KEY_LEN]) -> Result<String, String> {
        if self.0 && client == client_keys().public() {
            Ok(USER.into())
        } else {
            Err("not in the allowlist".into())
        }
    }
}

/// The input's bytes, read in order; zeros once it runs out.
struct Input<'a> {
    data: &'a [u8],
}

impl<'a> Input<'a> {
    fn byte(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }

    fn u16(&mut self) -> u16 {
        u16::from_be_bytes([self.byte(), self.byte()])
    }

    fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        for x in &mut b {
            *x = self.byte();
        }
        u64::from_be_bytes(b)
    }

    /// Up to `n` bytes.
    fn take(&mut self, n: usize) -> &'a [u8] {
        let (a, b) = self.data.split_at(n.min(self.data.len()));
        self.data = b;
        a
    }

    fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// The target's body: every invariant above, on one input.
pub fn check(data: &[u8]) {
    let mut input = Input { data };
    match input.byte() % 7 {
        0 => server_garbage(&mut input),
        1 => client_garbage(&mut input),
        2 => mutated(&mut input),
        3 => replayed(&mut input),
        4 => {
            let s = shake(true);
            session(&mut input, s);
        }
        5 => z85(input.data),
        _ => real_server(&mut input),
    }
}

fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
    })
}

/// Mode 6: the real server handshake on a client's bytes.
fn real_server(input: &mut Input<'_>) {
    let head = input.byte();
    let mut stream = Vec::new();
    if head & 1 != 0 {
        stream.extend_from_slice(&frame::greeting_as(Mechanism::Curve, false));
    }
    if head & 2 != 0 {
        let mut c = ClientHandshake::new(client_keys(), server_keys().public()).expect("a client");
        let hello = c.hello();
        Header::command(hello.len() as u64).put(&mut stream);
        stream.extend_from_slice(&hello);
    }
    stream.extend_from_slice(input.data);
    let check = Allow(true);
    let (out, r) = runtime().block_on(async {
        let mut reader = FrameReader::new(&stream[..]);
        let mut out: Vec<u8> = Vec::new();
        let r = zmtp::handshake_with(
            &mut reader,
            &mut out,
            Security::CurveServer {
                keys: server_keys(),
                check: &check,
            },
            "ROUTER",
            b"",
            &["DEALER"],
        )
        .await;
        (out, r.map(|info| info.user))
    });
    assert!(
        r.is_err(),
        "a CURVE handshake no client sealed taken: {r:?}"
    );
    assert!(out.len() >= frame::GREETING_LEN, "no greeting written");
    assert_eq!(
        out[..frame::GREETING_LEN],
        frame::greeting_as(Mechanism::Curve, true)
    );
    let mut names = Vec::new();
    let mut at = frame::GREETING_LEN;
    while at < out.len() {
        let Ok(Decoded::Done(h)) = frame::parse_header(&out[at..]) else {
            panic!("a written frame without its header");
        };
        assert!(h.command && !h.more, "{h:?} written");
        let end = at + h.header_len + h.size as usize;
        let (name, data) = frame::split_command(&out[at + h.header_len..end]).expect("a name");
        if name == b"ERROR" {
            assert!(frame::error_reason(data).len() < 256);
        }
        names.push(name.to_vec());
        at = end;
    }
    let names: Vec<&[u8]> = names.iter().map(Vec::as_slice).collect();
    match names.as_slice() {
        [] | [b"ERROR"] => {}
        [b"WELCOME"] | [b"WELCOME", b"ERROR"] => {
            assert_eq!(head & 3, 3, "WELCOME to a HELLO nobody sealed")
        }
        other => panic!("wrote {other:?}"),
    }
}

/// A genuine handshake and its messages.
struct Shake {
    hello: Vec<u8>,
    welcome: Vec<u8>,
    initiate: Vec<u8>,
    ready: Vec<u8>,
    client: Session,
    server: Session,
}

/// A whole genuine handshake, every step checked.
fn shake(allow: bool) -> Shake {
    let mut c = ClientHandshake::new(client_keys(), server_keys().public()).expect("a client");
    let mut s = ServerHandshake::new(server_keys()).expect("a server");
    let hello = c.hello();
    let welcome = s.hello(&hello).expect("a genuine HELLO");
    let initiate = c.welcome(&welcome, CLIENT_META).expect("a genuine WELCOME");
    let who = s.initiate(&initiate, &Allow(allow));
    if !allow {
        assert!(
            matches!(who, Err(CurveError::Refused(_))),
            "a client outside the allowlist: {who:?}"
        );
        // Refused by the allowlist only: taken once allowed.
        return shake(true);
    }
    initiated(who);
    let (ready, server) = s.ready(SERVER_META).expect("READY");
    let (meta, client) = c.ready(&ready).expect("a genuine READY");
    assert_eq!(meta, SERVER_META);
    Shake {
        hello,
        welcome,
        initiate,
        ready,
        client,
        server,
    }
}

/// What the server learned from a genuine INITIATE.
fn initiated(who: Result<curve::Initiated, CurveError>) {
    let who = who.expect("a genuine INITIATE from an allowed client");
    assert_eq!(who.client, *client_keys().public());
    assert_eq!(who.user, USER);
    assert_eq!(who.metadata, CLIENT_META);
}

/// Mode 0: HELLOs and INITIATEs the server never sealed or keyed.
fn server_garbage(input: &mut Input<'_>) {
    let genuine = input.byte() & 1 != 0;
    let frames = split_frames(input.data);
    let mut s = ServerHandshake::new(server_keys()).expect("a server");
    let mut frames = frames.iter();
    if let Some(f) = frames.next() {
        let r = s.hello(f);
        assert!(r.is_err(), "a garbage HELLO taken");
    }
    if !genuine {
        for f in frames {
            assert!(
                s.initiate(f, &Allow(true)).is_err(),
                "INITIATE before HELLO"
            );
        }
        return;
    }
    let mut c = ClientHandshake::new(client_keys(), server_keys().public()).expect("a client");
    let welcome = s.hello(&c.hello()).expect("a genuine HELLO");
    for f in frames {
        let r = s.initiate(f, &Allow(true));
        assert!(r.is_err(), "a garbage INITIATE taken");
    }
    // Nothing refused changed the server.
    let initiate = c.welcome(&welcome, CLIENT_META).expect("a genuine WELCOME");
    initiated(s.initiate(&initiate, &Allow(true)));
}

/// Mode 1: WELCOMEs and READYs the client cannot open.
fn client_garbage(input: &mut Input<'_>) {
    let frames = split_frames(input.data);
    let mut c = ClientHandshake::new(client_keys(), server_keys().public()).expect("a client");
    let hello = c.hello();
    let mut frames = frames.iter();
    if let Some(f) = frames.next() {
        assert!(
            c.welcome(f, CLIENT_META).is_err(),
            "a garbage WELCOME taken"
        );
    }
    let Some(f) = frames.next() else {
        // READY before WELCOME.
        assert!(c.ready(SERVER_META).is_err());
        return;
    };
    let mut s = ServerHandshake::new(server_keys()).expect("a server");
    let welcome = s.hello(&hello).expect("a genuine HELLO");
    let initiate = c.welcome(&welcome, CLIENT_META).expect("a genuine WELCOME");
    initiated(s.initiate(&initiate, &Allow(true)));
    assert!(c.ready(f).is_err(), "a garbage READY taken");
}

/// One change to a message.
#[derive(Debug)]
enum Change<'a> {
    Xor(usize, u8),
    Cut(usize),
    Append(&'a [u8]),
    Replace(&'a [u8]),
}

impl Change<'_> {
    fn read<'a>(input: &mut Input<'a>) -> Change<'a> {
        let kind = input.byte() % 4;
        let pos = input.u16() as usize;
        let x = input.byte();
        match kind {
            0 => Change::Xor(pos, x),
            1 => Change::Cut(pos),
            2 => {
                let n = x as usize;
                Change::Append(input.take(n))
            }
            _ => {
                let n = pos % 512;
                Change::Replace(input.take(n))
            }
        }
    }

    fn apply(&self, msg: &[u8]) -> Vec<u8> {
        match *self {
            Change::Xor(pos, x) => {
                let mut m = msg.to_vec();
                if !m.is_empty() {
                    let at = pos % m.len();
                    m[at] ^= x;
                }
                m
            }
            Change::Cut(pos) => msg[..pos % (msg.len() + 1)].to_vec(),
            Change::Append(b) => [msg, b].concat(),
            Change::Replace(b) => b.to_vec(),
        }
    }
}

/// Whether `changed` must be refused where `genuine` is taken: HELLO's
/// padding (72 bytes after the version) is checked by nobody, the rest of
/// every message is (the version is 1.0, minor version included, as
/// libzmq checks it).
fn refused(step: u8, genuine: &[u8], changed: &[u8]) -> bool {
    if genuine.len() != changed.len() {
        return true;
    }
    let unchecked = if step == 0 { 8..80 } else { 0..0 };
    genuine
        .iter()
        .zip(changed)
        .enumerate()
        .any(|(i, (a, b))| a != b && !unchecked.contains(&i))
}

/// Mode 2: a genuine handshake with one message changed.
fn mutated(input: &mut Input<'_>) {
    let head = input.byte();
    let step = head % 4;
    let allow = head & 0x80 == 0;
    let change = Change::read(input);
    let check = Allow(allow);
    let mut c = ClientHandshake::new(client_keys(), server_keys().public()).expect("a client");
    let mut s = ServerHandshake::new(server_keys()).expect("a server");

    let hello = c.hello();
    let welcome = if step == 0 {
        let m = change.apply(&hello);
        match s.hello(&m) {
            Ok(w) => {
                assert!(!refused(0, &hello, &m), "a changed HELLO taken: {change:?}");
                w
            }
            Err(e) => {
                assert!(refused(0, &hello, &m), "the genuine HELLO refused: {e}");
                // A refused HELLO left nothing behind.
                s.hello(&hello)
                    .expect("the genuine HELLO after a refused one")
            }
        }
    } else {
        s.hello(&hello).expect("a genuine HELLO")
    };

    let initiate = if step == 1 {
        let m = change.apply(&welcome);
        match c.welcome(&m, CLIENT_META) {
            Ok(i) => {
                assert!(
                    !refused(1, &welcome, &m),
                    "a changed WELCOME taken: {change:?}"
                );
                i
            }
            Err(e) => {
                assert!(refused(1, &welcome, &m), "the genuine WELCOME refused: {e}");
                c.welcome(&welcome, CLIENT_META)
                    .expect("the genuine WELCOME after a refused one")
            }
        }
    } else {
        c.welcome(&welcome, CLIENT_META).expect("a genuine WELCOME")
    };

    if step == 2 {
        let m = change.apply(&initiate);
        let r = s.initiate(&m, &check);
        if refused(2, &initiate, &m) {
            assert!(r.is_err(), "a changed INITIATE taken: {change:?}");
        } else if allow {
            initiated(r);
        } else {
            assert!(matches!(r, Err(CurveError::Refused(_))), "{r:?}");
        }
    }
    let r = s.initiate(&initiate, &check);
    if !allow {
        assert!(matches!(r, Err(CurveError::Refused(_))), "{r:?}");
        return;
    }
    if step == 2 && !refused(2, &initiate, &change.apply(&initiate)) {
        // Taken already: the same INITIATE again is a replay.
        assert!(matches!(r, Err(CurveError::Replay(_))), "{r:?}");
    } else {
        initiated(r);
    }

    let (ready, server) = s.ready(SERVER_META).expect("READY");
    let m = if step == 3 {
        change.apply(&ready)
    } else {
        ready.clone()
    };
    match c.ready(&m) {
        Ok((meta, client)) => {
            assert!(!refused(3, &ready, &m), "a changed READY taken: {change:?}");
            assert_eq!(meta, SERVER_META);
            session(
                input,
                Shake {
                    hello,
                    welcome,
                    initiate,
                    ready,
                    client,
                    server,
                },
            );
        }
        Err(e) => assert!(refused(3, &ready, &m), "the genuine READY refused: {e}"),
    }
}

/// Mode 3: messages replayed, from this connection or another.
fn replayed(input: &mut Input<'_>) {
    let which = input.byte() % 7;
    let allow = Allow(true);
    let client = || ClientHandshake::new(client_keys(), server_keys().public()).expect("a client");
    let server = || ServerHandshake::new(server_keys()).expect("a server");
    match which {
        0 => {
            // INITIATE twice.
            let (mut c, mut s) = (client(), server());
            let welcome = s.hello(&c.hello()).expect("HELLO");
            let initiate = c.welcome(&welcome, CLIENT_META).expect("WELCOME");
            initiated(s.initiate(&initiate, &allow));
            let r = s.initiate(&initiate, &allow);
            assert!(matches!(r, Err(CurveError::Replay(_))), "{r:?}");
        }
        1 => {
            // Connection A's INITIATE to server B, which greeted its own
            // client.
            let (mut ca, mut sa) = (client(), server());
            let welcome = sa.hello(&ca.hello()).expect("HELLO");
            let initiate = ca.welcome(&welcome, CLIENT_META).expect("WELCOME");
            let (mut cb, mut sb) = (client(), server());
            sb.hello(&cb.hello()).expect("HELLO");
            assert!(
                sb.initiate(&initiate, &allow).is_err(),
                "a foreign INITIATE"
            );
        }
        2 => {
            // A's HELLO and then A's INITIATE, replayed to server B.
            let (mut ca, mut sa) = (client(), server());
            let hello = ca.hello();
            let initiate = ca
                .welcome(&sa.hello(&hello).expect("HELLO"), CLIENT_META)
                .expect("WELCOME");
            let mut sb = server();
            sb.hello(&hello).expect("a HELLO replayed is answered");
            let r = sb.initiate(&initiate, &allow);
            assert!(
                matches!(r, Err(CurveError::Forged("INITIATE cookie", _))),
                "{r:?}"
            );
            initiated(sa.initiate(&initiate, &allow));
        }
        3 => {
            // Server B's WELCOME to client A.
            let mut ca = client();
            ca.hello();
            let (mut cb, mut sb) = (client(), server());
            let welcome = sb.hello(&cb.hello()).expect("HELLO");
            assert!(
                ca.welcome(&welcome, CLIENT_META).is_err(),
                "a foreign WELCOME"
            );
        }
        4 => {
            // Server B's READY to client A.
            let a = shake_until_ready();
            let b = shake(true);
            assert!(a.0.ready(&b.ready).is_err(), "a foreign READY");
        }
        5 => {
            // HELLO again after INITIATE: answered or not, the session
            // works.
            let (mut c, mut s) = (client(), server());
            let hello = c.hello();
            let welcome = s.hello(&hello).expect("HELLO");
            let initiate = c.welcome(&welcome, CLIENT_META).expect("WELCOME");
            initiated(s.initiate(&initiate, &allow));
            let _ = s.hello(&hello);
            let (ready, server) = s.ready(SERVER_META).expect("READY");
            let (meta, client) = c.ready(&ready).expect("READY");
            assert_eq!(meta, SERVER_META);
            session(
                input,
                Shake {
                    hello,
                    welcome,
                    initiate,
                    ready,
                    client,
                    server,
                },
            );
        }
        _ => {
            // A MESSAGE of session B into session A.
            let mut a = shake(true);
            let mut b = shake(true);
            let frames = vec![(input.take(40).to_vec(), false, false)];
            let (_, wire) = seal(&mut b.client.encrypter, &frames, 0);
            let dec = if input.byte() & 1 == 0 {
                &mut a.server.decrypter
            } else {
                &mut a.client.decrypter
            };
            assert!(dec.feed(&wire[0]).is_err(), "a foreign MESSAGE");
            assert!(drain(dec).is_empty());
        }
    }
}

/// A client that has sent INITIATE, and the READY its server sent.
fn shake_until_ready() -> (ClientHandshake, Vec<u8>) {
    let mut c = ClientHandshake::new(client_keys(), server_keys().public()).expect("a client");
    let mut s = ServerHandshake::new(server_keys()).expect("a server");
    let welcome = s.hello(&c.hello()).expect("HELLO");
    let initiate = c.welcome(&welcome, CLIENT_META).expect("WELCOME");
    initiated(s.initiate(&initiate, &Allow(true)));
    let (ready, _) = s.ready(SERVER_META).expect("READY");
    (c, ready)
}

/// A plaintext ZMTP frame as a writer writes it and the decrypter gives
/// it back: header then bytes.
fn plain_frame(bytes: &[u8], more: bool, command: bool) -> Vec<u8> {
    let h = if command {
        Header::command(bytes.len() as u64)
    } else {
        Header::message(bytes.len() as u64, more)
    };
    let mut out = Vec::with_capacity(frame::MAX_HEADER + bytes.len());
    h.put(&mut out);
    out.extend_from_slice(bytes);
    out
}

/// Seals `frames` (bytes, MORE, COMMAND) with `enc`, fed in pieces of
/// `step` bytes (0: at once): each frame's plaintext, and its MESSAGE.
fn seal(
    enc: &mut Encrypter,
    frames: &[(Vec<u8>, bool, bool)],
    step: usize,
) -> (Vec<Vec<u8>>, Vec<Bytes>) {
    let plain: Vec<Vec<u8>> = frames
        .iter()
        .map(|(b, more, command)| plain_frame(b, *more, *command))
        .collect();
    let all = plain.concat();
    let mut wire = VecDeque::new();
    let step = if step == 0 { all.len().max(1) } else { step };
    for piece in all.chunks(step) {
        enc.feed(piece, &mut wire).expect("our own frames seal");
    }
    assert!(!enc.mid_frame());
    assert_eq!(wire.len(), frames.len(), "one MESSAGE per frame");
    for (w, p) in wire.iter().zip(&plain) {
        let body = p.len() - header_len(p);
        let Ok(Decoded::Done(h)) = frame::parse_header(w) else {
            panic!("a MESSAGE without its header");
        };
        // A data frame of its own, as libzmq sends it.
        assert!(!h.command && !h.more, "{h:?}");
        assert_eq!(h.size, (MESSAGE_OVERHEAD + body) as u64);
        assert_eq!(w.len() as u64, h.header_len as u64 + h.size);
        assert_eq!(&w[h.header_len..h.header_len + 8], b"\x07MESSAGE");
    }
    (plain, wire.into_iter().collect())
}

fn header_len(frame_bytes: &[u8]) -> usize {
    match frame::parse_header(frame_bytes) {
        Ok(Decoded::Done(h)) => h.header_len,
        other => panic!("not a frame: {other:?}"),
    }
}

/// Everything the decrypter has ready, read in pieces of 97 bytes.
fn drain(dec: &mut Decrypter) -> Vec<u8> {
    let mut out = Vec::new();
    let mut buf = [0u8; 97];
    loop {
        let ready = dec.ready();
        if ready == 0 {
            break;
        }
        let n = dec.read(&mut buf);
        assert!(n > 0 && n <= ready, "read {n} of {ready}");
        assert_eq!(dec.ready(), ready - n);
        out.extend_from_slice(&buf[..n]);
    }
    assert_eq!(dec.read(&mut buf), 0);
    out
}

/// Feeds `bytes` to `dec` in pieces of `step` (0: at once): the first
/// error, and what came out.
fn feed(dec: &mut Decrypter, bytes: &[u8], step: usize) -> (Result<(), CurveError>, Vec<u8>) {
    let step = if step == 0 { bytes.len().max(1) } else { step };
    let mut r = Ok(());
    for piece in bytes.chunks(step) {
        r = dec.feed(piece);
        if r.is_err() {
            break;
        }
    }
    (r, drain(dec))
}

/// Mode 4 (and after modes 2 and 3): the decrypter of one side fed what
/// the other sealed, and worse.
fn session(input: &mut Input<'_>, shake: Shake) {
    let Shake {
        hello,
        welcome,
        initiate,
        ready,
        mut client,
        mut server,
    } = shake;
    let head = input.byte();
    // The sender's encrypter, the receiver's decrypter and encrypter.
    let (sender, receiver) = if head & 1 == 0 {
        (&mut client, &mut server)
    } else {
        (&mut server, &mut client)
    };
    let max = match (head >> 1) % 4 {
        0 => None,
        1 => Some(0),
        2 => Some(u64::from(input.byte()) * 16),
        _ => Some(1 << 20),
    };
    if let Some(m) = max {
        receiver.decrypter.set_max_frame(m);
    }
    let step = usize::from(input.byte() % 64);
    let n = 1 + usize::from(input.byte() % 6);
    let mut frames = Vec::with_capacity(n);
    for j in 0..n {
        let flags = input.byte();
        let len = if flags & 0x80 != 0 {
            256 + 4 * usize::from(input.byte())
        } else {
            usize::from(input.byte())
        };
        let command = flags & 2 != 0;
        let more = !command && flags & 1 != 0;
        let mut bytes: Vec<u8> = (0..len).map(|i| (j * 31 + i) as u8).collect();
        if let Some(b) = bytes.first_mut() {
            *b = j as u8;
        }
        frames.push((bytes, more, command));
    }
    let (plain, wire) = seal(&mut sender.encrypter, &frames, step);
    let over = |j: usize| max.is_some_and(|m| frames[j].0.len() as u64 > m);
    let error = frame::error_command("go away")[2..].to_vec();
    let dec = &mut receiver.decrypter;
    // Frames the receiver's decrypter has taken, and the next one.
    let mut last: Option<usize> = None;
    let mut next = 0usize;
    while !input.is_empty() {
        let op = input.byte() % 9;
        match op {
            0 | 1 if next >= n => {}
            0 => {
                let (r, out) = feed(dec, &wire[next], step);
                if over(next) {
                    assert!(matches!(r, Err(CurveError::TooLarge(..))), "{r:?}");
                    assert!(out.is_empty());
                    return;
                }
                r.expect("a genuine frame in order");
                assert_eq!(out, plain[next], "frame {next} decrypted");
                last = Some(next);
                next += 1;
            }
            1 => next += 1,
            2 => {
                let Some(l) = last else { continue };
                let j = usize::from(input.byte()) % (l + 1);
                let (r, out) = feed(dec, &wire[j], step);
                assert!(r.is_err(), "frame {j} replayed after {l}");
                assert!(out.is_empty());
                return;
            }
            3 => {
                if next >= n {
                    continue;
                }
                let w = &wire[next];
                let at = usize::from(input.u16()) % w.len();
                let x = input.byte() | 1;
                let mut m = w.to_vec();
                m[at] ^= x;
                let (r, out) = feed(dec, &m, step);
                if at < header_len(w) {
                    // The header (its size or flags): the frame is cut
                    // elsewhere, refused or waited for, or the same frame
                    // (a MESSAGE may come as a command frame too).
                    assert!(out.is_empty() || out == plain[next], "{r:?}");
                } else {
                    assert!(r.is_err(), "a flipped byte {at} of frame {next} taken");
                    assert!(out.is_empty());
                }
                return;
            }
            4 => {
                if next >= n {
                    continue;
                }
                let w = &wire[next];
                let cut = usize::from(input.u16()) % w.len();
                let (r, out) = feed(dec, &w[..cut], step);
                assert!(out.is_empty(), "a cut frame gave bytes");
                if !over(next) {
                    r.expect("a cut frame is waited for");
                }
                return;
            }
            5 => {
                let len = usize::from(input.byte());
                let junk = input.take(len);
                let (_, out) = feed(dec, junk, step);
                assert!(out.is_empty(), "garbage decrypted");
                return;
            }
            6 => {
                // Sealed by the receiver itself (its nonces, its prefix).
                let own = vec![(b"reflected".to_vec(), false, false)];
                let (_, w) = seal(&mut receiver.encrypter, &own, 0);
                let (r, out) = feed(dec, &w[0], step);
                assert!(r.is_err(), "a reflected frame taken");
                assert!(out.is_empty());
                return;
            }
            7 => {
                let body = match input.byte() % 5 {
                    0 => &hello,
                    1 => &welcome,
                    2 => &initiate,
                    3 => &ready,
                    _ => &error,
                };
                let mut cmd = Vec::new();
                Header::command(body.len() as u64).put(&mut cmd);
                cmd.extend_from_slice(body);
                let (r, out) = feed(dec, &cmd, step);
                assert!(r.is_err(), "a handshake command taken as a MESSAGE");
                assert!(out.is_empty());
                return;
            }
            _ => {
                let size = input.u64();
                let mut h = Vec::new();
                Header::command(size).put(&mut h);
                let (r, out) = feed(dec, &h, step);
                assert!(out.is_empty());
                let limit = max.map_or(u64::MAX, |m| m.saturating_add(MESSAGE_OVERHEAD as u64));
                if size > limit {
                    assert!(matches!(r, Err(CurveError::TooLarge(..))), "{r:?}");
                } else if size == 0 {
                    assert!(r.is_err(), "an empty command taken");
                } else {
                    r.unwrap_or_else(|e| panic!("a frame of {size} bytes refused: {e}"));
                }
                return;
            }
        }
    }
    // The rest, in order: each whole, and nothing else.
    for j in next..n {
        let (r, out) = feed(dec, &wire[j], step);
        if over(j) {
            assert!(matches!(r, Err(CurveError::TooLarge(..))), "{r:?}");
            return;
        }
        r.expect("a genuine frame in order");
        assert_eq!(out, plain[j], "frame {j} decrypted");
    }
    // And the other way.
    let back = vec![(b"back".to_vec(), true, false), (Vec::new(), false, false)];
    let (plain, wire) = seal(&mut receiver.encrypter, &back, 1);
    for (p, w) in plain.iter().zip(&wire) {
        let (r, out) = feed(&mut sender.decrypter, w, 0);
        r.expect("a genuine frame back");
        assert_eq!(&out, p);
    }
}

/// Mode 5: Z85 keys from text.
fn z85(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    if let Ok(key) = curve::z85_decode(&text) {
        assert_eq!(curve::z85_encode(&key), text.trim(), "Z85 written back");
    }
}

/// The seeds (`fuzz/corpus/curve_handshake/seed-*`): each mode, and in
/// mode 2 each message with each kind of change.
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let mut out: Vec<(String, Vec<u8>)> = Vec::new();
    let mut add = |name: String, bytes: Vec<u8>| out.push((name, bytes));
    // Mode 0: HELLO- and INITIATE-shaped garbage (right names and sizes).
    let mut hello = b"\x05HELLO\x01\x00".to_vec();
    hello.resize(200, 0x11);
    let mut initiate = b"\x08INITIATE".to_vec();
    initiate.resize(300, 0x22);
    let error = frame::error_command("no")[2..].to_vec();
    add(
        "seed-server-garbage-hello".into(),
        [&[0u8, 0][..], &crate::join_frames(&[&hello])].concat(),
    );
    add(
        "seed-server-garbage-initiate".into(),
        [
            &[0u8, 1][..],
            &crate::join_frames(&[&hello[..], &initiate, &initiate[..257], &error]),
        ]
        .concat(),
    );
    add(
        "seed-server-initiate-first".into(),
        [
            &[0u8, 0][..],
            &crate::join_frames(&[&b"\x05HELLO"[..], &initiate]),
        ]
        .concat(),
    );
    // Mode 1.
    let mut welcome = b"\x07WELCOME".to_vec();
    welcome.resize(168, 0x33);
    let mut ready = b"\x05READY".to_vec();
    ready.resize(40, 0x44);
    add(
        "seed-client-garbage-welcome".into(),
        [&[1u8][..], &crate::join_frames(&[&welcome])].concat(),
    );
    add(
        "seed-client-garbage-ready".into(),
        [&[1u8][..], &crate::join_frames(&[&welcome[..], &ready])].concat(),
    );
    add(
        "seed-client-error".into(),
        [&[1u8][..], &crate::join_frames(&[&error[..], &error])].concat(),
    );
    // Mode 2: each message, each change; then a session.
    let names = ["hello", "welcome", "initiate", "ready"];
    for (step, name) in names.iter().enumerate() {
        let s = step as u8;
        let changes: [(&str, Vec<u8>); 7] = [
            ("none", vec![0, 0, 5, 0]),
            ("flip-name", vec![0, 0, 3, 0x20]),
            ("flip-last", vec![0, 0xff, 0xff, 1]),
            ("flip-middle", vec![0, 0, 100, 0x80]),
            ("cut", vec![1, 0, 150, 0]),
            ("append", vec![2, 0, 0, 3, 1, 2, 3]),
            ("replace", vec![3, 0, 6, 0, 5, b'R', b'E', b'A', b'D', b'Y']),
        ];
        for (what, change) in changes {
            add(
                format!("seed-mutate-{name}-{what}"),
                [&[2u8, s][..], &change].concat(),
            );
        }
    }
    add(
        "seed-mutate-hello-padding".into(),
        vec![2, 0, 0, 0, 40, 0xff],
    );
    add("seed-mutate-hello-minor".into(), vec![2, 0, 0, 0, 7, 1]);
    add(
        "seed-mutate-initiate-refused".into(),
        vec![2, 0x82, 0, 0, 0, 0],
    );
    add(
        "seed-mutate-none-then-session".into(),
        vec![2, 3, 0, 0, 5, 0, 0, 0, 3, 0, 5, 2, 9, 0x80, 3, 0, 0, 0],
    );
    // Mode 3: each replay.
    for which in 0..7u8 {
        add(
            format!("seed-replay-{which}"),
            vec![3, which, 0, 0, 2, 1, 4, 0, 0, 0],
        );
    }
    // Mode 4: sessions. head: bit 0 the direction, bits 1-2 the limit.
    let session = |head: u8, step: u8, ops: &[u8]| {
        let mut v = vec![4, head];
        if (head >> 1) % 4 == 2 {
            v.push(4); // a limit of 64 bytes
        }
        // 4 frames: a message with MORE, a command, a long one, an empty one.
        v.extend_from_slice(&[step, 3, 1, 20, 2, 9, 0x80, 10, 0, 0]);
        v.extend_from_slice(ops);
        v
    };
    add("seed-session-all".into(), session(0, 0, &[0, 0, 0, 0]));
    add("seed-session-bytewise".into(), session(1, 1, &[0, 0, 0, 0]));
    add("seed-session-pieces".into(), session(0, 7, &[0, 1, 0]));
    add("seed-session-replay".into(), session(0, 0, &[0, 0, 2, 1]));
    add(
        "seed-session-flip-body".into(),
        session(0, 5, &[0, 3, 0, 40, 4]),
    );
    add(
        "seed-session-flip-header".into(),
        session(1, 0, &[3, 0, 0, 1]),
    );
    add("seed-session-cut".into(), session(0, 3, &[0, 4, 0, 30]));
    add(
        "seed-session-garbage".into(),
        session(0, 0, &[5, 12, 4, 0, 1, 2]),
    );
    add("seed-session-reflect".into(), session(1, 0, &[0, 6]));
    for (k, name) in ["hello", "welcome", "initiate", "ready", "error"]
        .iter()
        .enumerate()
    {
        add(
            format!("seed-session-command-{name}"),
            session(0, 0, &[7, k as u8]),
        );
    }
    add(
        "seed-session-huge".into(),
        session(2, 0, &[8, 0x40, 0, 0, 0, 0, 0, 0, 0]),
    );
    add(
        "seed-session-huge-unlimited".into(),
        session(0, 0, &[8, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff]),
    );
    add("seed-session-limit-0".into(), session(2, 0, &[0, 0]));
    add("seed-session-limit-64".into(), session(4, 0, &[0, 0, 0, 0]));
    add("seed-session-limit-1m".into(), session(6, 2, &[1, 0, 0]));
    // Mode 5.
    let key = curve::z85_encode(server_keys().public());
    add("seed-z85".into(), [b"\x05", key.as_bytes()].concat());
    add(
        "seed-z85-spaces".into(),
        [b"\x05 ", key.as_bytes(), b"\n"].concat(),
    );
    add(
        "seed-z85-overflow".into(),
        [&b"\x05"[..], &[b'#'; 40]].concat(),
    );
    // Mode 6: the real server, with a client greeting and a genuine HELLO
    // or not, then an INITIATE-shaped frame, garbage, a PLAIN greeting.
    let mut initiate_frame = Vec::new();
    Header::command(initiate.len() as u64).put(&mut initiate_frame);
    initiate_frame.extend_from_slice(&initiate);
    add(
        "seed-server-initiate-garbage".into(),
        [&[6u8, 3][..], &initiate_frame].concat(),
    );
    add(
        "seed-server-error".into(),
        [&[6u8, 3][..], &frame::error_command("bye")[..]].concat(),
    );
    add("seed-server-hello-only".into(), vec![6, 3]);
    add(
        "seed-server-garbage-hello-frame".into(),
        [&[6u8, 1, 4, 200][..], &hello].concat(),
    );
    add(
        "seed-server-plain-greeting".into(),
        [&[6u8, 0][..], &frame::greeting_as(Mechanism::Plain, false)].concat(),
    );
    out
}
