//! The server side of the ZMTP PLAIN handshake (RFC 24) on arbitrary bytes
//! from a client: the greeting, then command frames (HELLO, INITIATE, or
//! anything else).
//!
//! The input is the client's byte stream. It goes through two servers:
//!
//! - a sans-IO one, written here with [`frame`]'s parsers in the order
//!   `zmtp::handshake_with` calls them as a PLAIN server (the greeting
//!   step by step, as bytes arrive: one byte, the first 11, all 64; then
//!   HELLO, `parse_hello`, the credentials, WELCOME, INITIATE, READY and
//!   `ready_properties`);
//! - the real one, `zmtp::handshake_with` with `Security::PlainServer`,
//!   reading the bytes through a `FrameReader` and writing into a buffer.
//!
//! They must agree: the same outcome (the peer's user, socket type and
//! identity, or a refusal), and the same commands written (our greeting,
//! WELCOME, READY, ERROR; an ERROR's reason when it comes from the framer
//! or the authenticator). Every error is an `Err`, never a panic; the
//! greeting parsed step by step gives what the whole greeting gives.
//!
//! Parsing is linear: the sans-IO server takes at most 4 greeting steps
//! and moves forward at least one frame header per step; the properties
//! parsed from a body account for every byte of it (no byte read twice, no
//! property of fewer than 5 bytes).
//!
//! Then the parsers on the whole input, and on every command body found in
//! it: a HELLO that parses is written back (`hello_command`) byte for byte
//! and parses again to the same credentials; credentials cut from the
//! input are written as a HELLO that parses back to them (each cut to 255
//! bytes); READY properties whose names are UTF-8 are written back
//! (`frame::ready`) byte for byte; an ERROR's reason (`error_reason`),
//! written back with `error_command`, reads back as its first 255 bytes
//! (at a character boundary).

use std::sync::OnceLock;

use stowage_transport::frame::{self, Decoded, GREETING_LEN, Mechanism};
use stowage_transport::zmtp::{self, Authenticator, FrameReader, Security};

/// The credentials the server takes.
pub const USERNAME: &[u8] = b"stowd";
pub const PASSWORD: &[u8] = b"fuzz-token-0123456789";
/// The user the authenticator names for them.
pub const USER: &str = "fuzz-user";
/// Why it refuses others.
pub const REFUSED: &str = "wrong token";
/// Our socket type, and the peers' we talk to.
const OURS: &str = "ROUTER";
const ACCEPT: &[&str] = &["DEALER", "REQ"];

struct Auth;

impl Authenticator for Auth {
    fn authenticate(&self, username: &[u8], password: &[u8]) -> Result<String, String> {
        if username == USERNAME && password == PASSWORD {
            Ok(USER.into())
        } else {
            Err(REFUSED.into())
        }
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

/// What a server writes, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Sent {
    Greeting,
    Welcome,
    Ready,
    /// ERROR with this reason; `None`: a reason the model does not write
    /// (the handshake's own texts), any reason matches.
    Error(Option<String>),
}

/// The peer the handshake took: user, socket type, identity.
type Peer = (Option<String>, String, Vec<u8>);

/// The target's body: every invariant above, on one input.
pub fn check(data: &[u8]) {
    let (sent, outcome) = model(data);
    let (real_out, real) = real(data);
    let real_sent = written(&real_out);
    assert_eq!(
        real_sent.len(),
        sent.len(),
        "written {real_sent:?}, expected {sent:?}"
    );
    for (r, m) in real_sent.iter().zip(&sent) {
        match (r, m) {
            (Sent::Error(_), Sent::Error(None)) => {}
            (Sent::Error(Some(r)), Sent::Error(Some(m))) => assert_eq!(r, &cut_255(m)),
            _ => assert_eq!(r, m, "written {real_sent:?}, expected {sent:?}"),
        }
    }
    match (&outcome, &real) {
        (Some(m), Ok(r)) => assert_eq!(m, r),
        (None, Err(_)) => {}
        _ => panic!("the model says {outcome:?}, the handshake {real:?}"),
    }
    parsers(data);
}

/// The real server over `data`: what it wrote, and the peer or the error.
fn real(data: &[u8]) -> (Vec<u8>, Result<Peer, String>) {
    runtime().block_on(async {
        let mut reader = FrameReader::new(data);
        let mut out: Vec<u8> = Vec::new();
        let r = zmtp::handshake_with(
            &mut reader,
            &mut out,
            Security::PlainServer(&Auth),
            OURS,
            b"",
            ACCEPT,
        )
        .await;
        let r = r
            .map(|info| (info.user, info.socket_type, info.identity.to_vec()))
            .map_err(|e| e.to_string());
        (out, r)
    })
}

/// The commands a server wrote (after its greeting), each checked to be
/// the bytes the framer writes for it.
fn written(out: &[u8]) -> Vec<Sent> {
    assert!(out.len() >= GREETING_LEN, "no greeting written");
    assert_eq!(
        out[..GREETING_LEN],
        frame::greeting_as(Mechanism::Plain, true),
        "our greeting"
    );
    let mut sent = vec![Sent::Greeting];
    let mut at = GREETING_LEN;
    while at < out.len() {
        let Ok(Decoded::Done(h)) = frame::parse_header(&out[at..]) else {
            panic!("a written frame without its header");
        };
        assert!(h.command && !h.more, "{h:?} written");
        let end = at + h.header_len + h.size as usize;
        let whole = &out[at..end];
        let (name, body) = frame::split_command(&whole[h.header_len..]).expect("a name");
        sent.push(match name {
            b"WELCOME" => {
                assert_eq!(whole, &frame::welcome_command()[..]);
                Sent::Welcome
            }
            b"READY" => {
                let ours: &[(&str, &[u8])] = &[("Socket-Type", OURS.as_bytes())];
                assert_eq!(whole, &frame::ready_command(ours)[..]);
                Sent::Ready
            }
            b"ERROR" => {
                let reason = frame::error_reason(body);
                assert!(reason.len() <= 255 && body.len() == 1 + reason.len());
                Sent::Error(Some(reason))
            }
            other => panic!("wrote a {:?} command", String::from_utf8_lossy(other)),
        });
        at = end;
    }
    sent
}

/// `reason` as `error_command` cuts it: 255 bytes at most, at a character
/// boundary.
fn cut_255(reason: &str) -> String {
    let mut end = reason.len().min(255);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    reason[..end].to_string()
}

/// The next command frame at `*at`: its name and data. `None` where the
/// server stops without a word: a message frame, a bad header or size, a
/// truncated frame or command name (the stream ends, or breaks ZMTP).
fn command<'a>(data: &'a [u8], at: &mut usize) -> Option<(&'a [u8], &'a [u8])> {
    let h = match frame::parse_header(&data[*at..]) {
        Ok(Decoded::Done(h)) => h,
        Ok(Decoded::Needs(n)) => {
            assert!(n > data.len() - *at && n <= frame::MAX_HEADER);
            return None;
        }
        Err(_) => return None,
    };
    if !h.command {
        return None;
    }
    let size = h.command_size().ok()?;
    let start = *at + h.header_len;
    let body = data.get(start..start + size)?;
    let before = *at;
    *at = start + size;
    assert!(*at >= before + 3, "a command frame of fewer than 3 bytes");
    let (name, rest) = frame::split_command(body).ok()?;
    assert_eq!(1 + name.len() + rest.len(), body.len());
    parsers(rest);
    Some((name, rest))
}

/// The sans-IO PLAIN server on the client's bytes `data`: what it writes
/// and whom it takes.
fn model(data: &[u8]) -> (Vec<Sent>, Option<Peer>) {
    let mut sent = vec![Sent::Greeting];
    // The greeting, step by step: each step asks for more than it had.
    let mut have = 0usize;
    let mut steps = 0;
    let g = loop {
        steps += 1;
        assert!(steps <= 4, "{steps} greeting steps");
        match frame::parse_greeting(&data[..have]) {
            Ok(Decoded::Done(g)) => break g,
            Ok(Decoded::Needs(n)) => {
                assert!(n > have && n <= GREETING_LEN, "needs {n} with {have}");
                if n > data.len() {
                    // What there is agrees: not refused, still short.
                    assert!(matches!(frame::parse_greeting(data), Ok(Decoded::Needs(_))));
                    return (sent, None);
                }
                have = n;
            }
            Err(e) => {
                // The whole input is refused the same way.
                assert_eq!(frame::parse_greeting(data), Err(e.clone()));
                if let Some(g) = data.get(..GREETING_LEN) {
                    assert_eq!(frame::check_greeting(g), Err(e));
                }
                return (sent, None);
            }
        }
    };
    assert_eq!(have, GREETING_LEN);
    assert_eq!(frame::parse_greeting(data), Ok(Decoded::Done(g)));
    if g.mechanism != Mechanism::Plain || g.as_server {
        // Another mechanism (NULL, CURVE), or a PLAIN server: the peer
        // reads a command after the greeting, and is told why.
        sent.push(Sent::Error(None));
        return (sent, None);
    }
    let mut at = GREETING_LEN;
    let Some((name, hello)) = command(data, &mut at) else {
        return (sent, None);
    };
    if name != b"HELLO" {
        return (sent, None);
    }
    let (username, password) = match frame::parse_hello(hello) {
        Ok(c) => c,
        Err(e) => {
            sent.push(Sent::Error(Some(e.to_string())));
            return (sent, None);
        }
    };
    let user = match Auth.authenticate(username, password) {
        Ok(u) => u,
        Err(reason) => {
            sent.push(Sent::Error(Some(reason)));
            return (sent, None);
        }
    };
    sent.push(Sent::Welcome);
    let Some((name, initiate)) = command(data, &mut at) else {
        return (sent, None);
    };
    if name != b"INITIATE" {
        return (sent, None);
    }
    sent.push(Sent::Ready);
    let Ok(props) = frame::ready_properties(initiate) else {
        return (sent, None);
    };
    let mut socket_type = String::new();
    let mut identity = Vec::new();
    for (key, value) in props {
        if key.eq_ignore_ascii_case("Socket-Type") {
            socket_type = String::from_utf8_lossy(&value).into_owned();
        } else if key.eq_ignore_ascii_case("Identity") {
            identity = value.to_vec();
        }
    }
    if !ACCEPT.contains(&socket_type.as_str()) {
        sent.push(Sent::Error(None));
        return (sent, None);
    }
    (sent, Some((Some(user), socket_type, identity)))
}

/// `parse_hello`, `ready_properties` and `error_reason` on `data` (a
/// command's data, or any bytes), with their round trips.
fn parsers(data: &[u8]) {
    if let Ok((username, password)) = frame::parse_hello(data) {
        assert_eq!(2 + username.len() + password.len(), data.len());
        let (u, p) = hello_round_trip(username, password);
        assert_eq!((u.as_slice(), p.as_slice()), (username, password));
        let again = frame::hello_command(username, password);
        assert!(again.ends_with(data), "a parsed HELLO written back");
    }
    // Credentials cut from the input: the first byte says where.
    if let Some((&k, rest)) = data.split_first() {
        let (username, password) = rest.split_at((k as usize).min(rest.len()));
        let (u, p) = hello_round_trip(username, password);
        assert_eq!(u, &username[..username.len().min(255)]);
        assert_eq!(p, &password[..password.len().min(255)]);
    }
    if let Ok(props) = frame::ready_properties(data) {
        // Every byte accounted for, once.
        let used: usize = props.iter().map(|(_, v)| 5 + v.len()).sum::<usize>();
        assert!(used <= data.len() && props.len() * 5 <= data.len());
        // Names that were UTF-8 (lossy names are longer, or hold a
        // replacement character) are written back byte for byte.
        let utf8 = props.iter().map(|(name, _)| name.len()).sum::<usize>() + used == data.len()
            && !props.iter().any(|(name, _)| name.contains('\u{FFFD}'));
        if utf8 {
            let named: Vec<(&str, &[u8])> = props
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_ref()))
                .collect();
            let body = frame::ready(&named);
            assert_eq!(&body[..6], b"\x05READY");
            assert_eq!(&body[6..], data, "READY properties written back");
        }
    }
    let reason = frame::error_reason(data);
    assert!(reason.len() <= 3 * data.len());
    let cmd = frame::error_command(&reason);
    let (name, body) = split_frame(&cmd);
    assert_eq!(name, b"ERROR");
    let back = frame::error_reason(body);
    assert_eq!(back, cut_255(&reason), "an ERROR's reason read back");
}

/// A HELLO written with `hello_command` and parsed back.
fn hello_round_trip(username: &[u8], password: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let frame = frame::hello_command(username, password);
    let (name, body) = split_frame(&frame);
    assert_eq!(name, b"HELLO");
    let (u, p) = frame::parse_hello(body).expect("a written HELLO parses");
    (u.to_vec(), p.to_vec())
}

/// A whole command frame we wrote: its name and data.
fn split_frame(bytes: &[u8]) -> (&[u8], &[u8]) {
    let Ok(Decoded::Done(h)) = frame::parse_header(bytes) else {
        panic!("a written frame without its header");
    };
    assert!(h.command);
    assert_eq!(h.header_len as u64 + h.size, bytes.len() as u64);
    frame::split_command(&bytes[h.header_len..]).expect("a command name")
}

/// The seeds (`fuzz/corpus/plain_handshake/seed-*`): whole handshakes a
/// client may send, right and wrong.
pub fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let client = frame::greeting_as(Mechanism::Plain, false);
    let hello = frame::hello_command(USERNAME, PASSWORD);
    let dealer: &[(&str, &[u8])] = &[("Socket-Type", b"DEALER")];
    let initiate = frame::initiate_command(dealer);
    let cat = |parts: &[&[u8]]| parts.concat();
    let greeting_with = |f: &dyn Fn(&mut [u8; GREETING_LEN])| {
        let mut g = client;
        f(&mut g);
        cat(&[&g, &hello, &initiate])
    };
    let mut out: Vec<(&'static str, Vec<u8>)> = vec![
        ("seed-ok", cat(&[&client, &hello, &initiate])),
        (
            "seed-ok-identity",
            cat(&[
                &client,
                &hello,
                &frame::initiate_command(&[("Identity", b"worker-7"), ("Socket-Type", b"REQ")]),
            ]),
        ),
        (
            "seed-ok-twice-socket-type",
            cat(&[
                &client,
                &hello,
                &frame::initiate_command(&[
                    ("Socket-Type", b"PUB"),
                    ("socket-type", b"DEALER"),
                    ("X-Other", &[0xff; 300]),
                ]),
            ]),
        ),
        (
            "seed-wrong-socket-type",
            cat(&[
                &client,
                &hello,
                &frame::initiate_command(&[("Socket-Type", b"SUB")]),
            ]),
        ),
        (
            "seed-no-socket-type",
            cat(&[&client, &hello, &frame::initiate_command(&[])]),
        ),
        (
            "seed-wrong-token",
            cat(&[
                &client,
                &frame::hello_command(USERNAME, b"guess"),
                &initiate,
            ]),
        ),
        (
            "seed-wrong-user",
            cat(&[&client, &frame::hello_command(b"root", PASSWORD), &initiate]),
        ),
        (
            "seed-empty-credentials",
            cat(&[&client, &frame::hello_command(b"", b""), &initiate]),
        ),
        (
            "seed-long-credentials",
            cat(&[
                &client,
                &frame::hello_command(&[b'u'; 255], &[b'p'; 255]),
                &initiate,
            ]),
        ),
        ("seed-greeting-only", client.to_vec()),
        ("seed-hello-only", cat(&[&client, &hello])),
    ];
    // HELLO bodies the parser refuses.
    let bad_hello = |data: &[u8]| cat(&[&client, &frame::command_frame("HELLO", data), &initiate]);
    out.push(("seed-hello-trailing", bad_hello(b"\x05stowd\x01x!")));
    out.push(("seed-hello-past-end", bad_hello(b"\x05stowd\x09abc")));
    out.push(("seed-hello-empty", bad_hello(b"")));
    out.push(("seed-hello-no-password", bad_hello(b"\x05stowd")));
    // Other commands where HELLO or INITIATE belongs.
    let error = frame::error_command("no thanks");
    out.push(("seed-error-for-hello", cat(&[&client, &error])));
    out.push(("seed-error-for-initiate", cat(&[&client, &hello, &error])));
    out.push((
        "seed-ready-for-initiate",
        cat(&[&client, &hello, &frame::ready_command(dealer)]),
    ));
    out.push((
        "seed-message-for-hello",
        cat(&[&client, b"\x00\x05hello", &initiate]),
    ));
    out.push((
        "seed-initiate-truncated-property",
        cat(&[
            &client,
            &hello,
            &frame::command_frame("INITIATE", b"\x0bSocket-Type\x00\x00\x01\x00DEALER"),
        ]),
    ));
    out.push((
        "seed-initiate-cut",
        cat(&[&client, &hello, &initiate[..initiate.len() - 3]]),
    ));
    // HELLO in a long header; a command of 0 bytes; one over 1 MiB.
    let mut long = vec![frame::FLAG_COMMAND | frame::FLAG_LONG];
    long.extend_from_slice(&(hello.len() as u64 - 2).to_be_bytes());
    long.extend_from_slice(&hello[2..]);
    out.push(("seed-hello-long-header", cat(&[&client, &long, &initiate])));
    out.push(("seed-command-empty", cat(&[&client, b"\x04\x00"])));
    let mut huge = vec![frame::FLAG_COMMAND | frame::FLAG_LONG];
    huge.extend_from_slice(&((1u64 << 20) + 1).to_be_bytes());
    huge.extend_from_slice(b"\x05HELLO");
    out.push(("seed-command-huge", cat(&[&client, &huge])));
    out.push((
        "seed-reserved-flags",
        cat(&[&client, b"\x44\x07", &hello[2..]]),
    ));
    // Greetings: NULL, a PLAIN server, CURVE, an old version, no signature,
    // cut short, a later minor version, junk after the mechanism.
    out.push((
        "seed-greeting-null",
        cat(&[&frame::greeting_as(Mechanism::Null, false), &hello]),
    ));
    out.push(("seed-greeting-as-server", greeting_with(&|g| g[32] = 1)));
    out.push((
        "seed-greeting-curve",
        greeting_with(&|g| g[12..17].copy_from_slice(b"CURVE")),
    ));
    out.push(("seed-greeting-version-2", greeting_with(&|g| g[10] = 2)));
    out.push(("seed-greeting-minor-1", greeting_with(&|g| g[11] = 1)));
    out.push(("seed-greeting-signature", greeting_with(&|g| g[9] = 0x7e)));
    out.push(("seed-greeting-not-zmtp", greeting_with(&|g| g[0] = b'G')));
    out.push(("seed-greeting-padding", greeting_with(&|g| g[20] = b'X')));
    out.push(("seed-greeting-cut-11", client[..11].to_vec()));
    out.push(("seed-greeting-cut-40", client[..40].to_vec()));
    out
}
