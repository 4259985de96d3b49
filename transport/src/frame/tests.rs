//! Tests of the framer: headers, the greeting and commands, on byte slices.

use super::*;

/// Sizes on both sides of the short/long boundary, and the extremes.
const SIZES: [u64; 7] = [0, 1, 255, 256, 65_536, 1 << 40, u64::MAX];

fn encoded(h: &Header) -> Vec<u8> {
    let mut b = [0u8; MAX_HEADER];
    h.encode(&mut b).to_vec()
}

#[test]
fn headers_round_trip_with_every_flag_combination() {
    for size in SIZES {
        for more in [false, true] {
            for command in [false, true] {
                let h = Header {
                    command,
                    ..Header::message(size, more)
                };
                let bytes = encoded(&h);
                let long = size > 255;
                assert_eq!(bytes.len(), if long { 9 } else { 2 }, "{h:?}");
                assert_eq!(h.header_len, bytes.len());
                let flag = |on: bool, f: u8| if on { f } else { 0 };
                let flags =
                    flag(more, FLAG_MORE) | flag(long, FLAG_LONG) | flag(command, FLAG_COMMAND);
                assert_eq!(bytes[0], flags, "{h:?}");
                assert_eq!(parse_header(&bytes), Ok(Decoded::Done(h)));
                // Bytes after the header are the body's, left alone.
                let mut with_body = bytes.clone();
                with_body.extend_from_slice(&[0xee; 12]);
                assert_eq!(parse_header(&with_body), Ok(Decoded::Done(h)));
                // Appended to a buffer: the same bytes.
                let mut out = BytesMut::new();
                h.put(&mut out);
                assert_eq!(out[..], bytes[..]);
            }
        }
    }
}

#[test]
fn the_wire_bytes_are_those_of_zmtp() {
    let mut out = BytesMut::new();
    put_header(&mut out, 3, true);
    put_header(&mut out, 300, false);
    assert_eq!(
        out[..],
        [0x01, 3, 0x02, 0, 0, 0, 0, 0, 0, 0x01, 0x2c][..],
        "short MORE of 3, then long of 300"
    );
    let cmd = command_frame("PING", b"ab");
    assert_eq!(cmd[..], b"\x04\x07\x04PINGab"[..]);
    let long = command_frame("X", &[0u8; 300]);
    assert_eq!(long[..9], [0x06, 0, 0, 0, 0, 0, 0, 0x01, 0x2e]);
    assert_eq!(long.len(), 9 + 302);
}

#[test]
fn a_long_header_of_a_small_size_is_read_and_written_back_as_it_came() {
    // Peers may use the long form for any size.
    let bytes = [FLAG_LONG | FLAG_MORE, 0, 0, 0, 0, 0, 0, 0, 5];
    let Ok(Decoded::Done(h)) = parse_header(&bytes) else {
        panic!()
    };
    assert_eq!(
        (h.more, h.command, h.size, h.header_len),
        (true, false, 5, 9)
    );
    assert_eq!(encoded(&h), bytes);
}

#[test]
fn reserved_bits_are_refused_as_soon_as_the_flags_arrive() {
    for bit in 3..8 {
        for low in 0..8u8 {
            let flags = (1u8 << bit) | low;
            assert_eq!(
                parse_header(&[flags]),
                Err(FrameError::ReservedFlags(flags))
            );
            assert_eq!(
                parse_header(&[flags, 0, 0, 0, 0, 0, 0, 0, 0]),
                Err(FrameError::ReservedFlags(flags))
            );
        }
    }
    assert_eq!(
        FrameError::ReservedFlags(0x08).to_string(),
        "frame flags 0x08 have reserved bits set"
    );
}

#[test]
fn partial_headers_need_more() {
    assert_eq!(parse_header(&[]), Ok(Decoded::Needs(1)));
    for size in SIZES {
        for flags in 0..8u8 {
            let h = Header {
                more: flags & FLAG_MORE != 0,
                command: flags & FLAG_COMMAND != 0,
                ..Header::message(size, false)
            };
            let bytes = encoded(&h);
            for cut in 1..bytes.len() {
                assert_eq!(
                    parse_header(&bytes[..cut]),
                    Ok(Decoded::Needs(bytes.len())),
                    "{h:?} cut at {cut}"
                );
            }
        }
    }
}

#[test]
fn command_sizes_are_checked_against_the_limit() {
    assert_eq!(Header::command(1).command_size(), Ok(1));
    assert_eq!(
        Header::command(MAX_COMMAND).command_size(),
        Ok(MAX_COMMAND as usize)
    );
    for size in [0, MAX_COMMAND + 1, u64::MAX] {
        let e = Header::command(size).command_size().unwrap_err();
        assert_eq!(e, FrameError::CommandSize(size));
        assert_eq!(e.to_string(), format!("command frame of {size} bytes"));
    }
}

#[test]
fn command_bodies_split_into_name_and_data() {
    let frame = command_frame("READY", b"data");
    let Ok(Decoded::Done(h)) = parse_header(&frame) else {
        panic!()
    };
    assert!(h.command && !h.more);
    let body = &frame[h.header_len..];
    assert_eq!(h.size as usize, body.len());
    assert_eq!(split_command(body), Ok((&b"READY"[..], &b"data"[..])));
    assert_eq!(split_command(b""), Err(FrameError::CommandName));
    assert_eq!(split_command(b"\x05REA"), Err(FrameError::CommandName));
    assert_eq!(split_command(b"\x00"), Ok((&b""[..], &b""[..])));
}

#[test]
fn ready_round_trips_its_properties() {
    let props: [(&str, &[u8]); 2] = [("Socket-Type", b"DEALER"), ("Identity", b"\x00id")];
    let frame = ready_command(&props);
    let Ok(Decoded::Done(h)) = parse_header(&frame) else {
        panic!()
    };
    let (name, data) = split_command(&frame[h.header_len..]).unwrap();
    assert_eq!(name, b"READY");
    let back = ready_properties(data).unwrap();
    assert_eq!(back.len(), 2);
    for ((k, v), (bk, bv)) in props.iter().zip(&back) {
        assert_eq!((*k, *v), (bk.as_str(), &bv[..]));
    }
    // The frame the core used to build by hand: the same bytes.
    assert_eq!(frame, command_frame("READY", &ready(&props)[6..]));
    assert_eq!(
        ready_properties(b"\x0bSocket-Type\x00\x00"),
        Err(FrameError::ReadyProperty)
    );
    assert_eq!(
        ready_properties(b"\x01x\x00\x00\x00\x09abc")
            .unwrap_err()
            .to_string(),
        "truncated READY property \"x\""
    );
}

const NULL_CLIENT: Greeting = Greeting {
    mechanism: Mechanism::Null,
    as_server: false,
};

#[test]
fn greetings_are_parsed_step_by_step() {
    let g = greeting();
    assert_eq!(parse_greeting(&[]), Ok(Decoded::Needs(1)));
    for cut in 1..11 {
        assert_eq!(parse_greeting(&g[..cut]), Ok(Decoded::Needs(11)), "{cut}");
    }
    for cut in 11..GREETING_LEN {
        assert_eq!(
            parse_greeting(&g[..cut]),
            Ok(Decoded::Needs(GREETING_LEN)),
            "{cut}"
        );
    }
    assert_eq!(parse_greeting(&g), Ok(Decoded::Done(NULL_CLIENT)));
    // What follows the greeting (the READY) is not its concern.
    let mut more = g.to_vec();
    more.extend_from_slice(&ready_command(&[("Socket-Type", b"ROUTER")]));
    assert_eq!(parse_greeting(&more), Ok(Decoded::Done(NULL_CLIENT)));
    // Not ZMTP: refused at the first byte; an old version at the 11th.
    assert_eq!(parse_greeting(b"G"), Err(FrameError::Signature));
    let mut old = g;
    old[10] = 2;
    assert_eq!(parse_greeting(&old[..11]), Err(FrameError::Version(2)));
    assert_eq!(
        FrameError::Version(2).to_string(),
        "ZMTP major version 2 is not supported (3 or later is)"
    );
}

#[test]
fn greetings_other_than_zmtp3_null_plain_or_curve_are_refused() {
    assert!(check_greeting(&greeting()).is_ok());
    let mut g = greeting();
    g[10] = 2;
    assert!(
        check_greeting(&g)
            .unwrap_err()
            .to_string()
            .contains("major version 2")
    );
    let mut g = greeting();
    g[12..18].copy_from_slice(b"GSSAPI");
    assert_eq!(
        check_greeting(&g).unwrap_err().to_string(),
        "security mechanism \"GSSAPI\" is not supported (NULL, PLAIN and CURVE are)"
    );
    let curve = greeting_as(Mechanism::Curve, true);
    assert_eq!(
        check_greeting(&curve),
        Ok(Greeting {
            mechanism: Mechanism::Curve,
            as_server: true
        })
    );
    // PLAIN, as server and as client; its name padded with anything but
    // zeros is not PLAIN.
    let server = greeting_as(Mechanism::Plain, true);
    assert_eq!(&server[12..18], b"PLAIN\0");
    assert_eq!(
        check_greeting(&server),
        Ok(Greeting {
            mechanism: Mechanism::Plain,
            as_server: true
        })
    );
    assert!(
        !check_greeting(&greeting_as(Mechanism::Plain, false))
            .unwrap()
            .as_server
    );
    let mut padded = server;
    padded[20] = b'X';
    assert!(check_greeting(&padded).is_err());
    // NULL has no server: its as-server byte is ignored.
    let mut null = greeting();
    null[32] = 1;
    assert_eq!(check_greeting(&null), Ok(NULL_CLIENT));
    assert_eq!(check_greeting(&[0u8; 64]), Err(FrameError::Signature));
    assert_eq!(
        check_greeting(&greeting()[..63]),
        Err(FrameError::TruncatedGreeting)
    );
}

#[test]
fn a_message_is_complete_only_once_every_frame_is_there() {
    let mut m = BytesMut::new();
    put_header(&mut m, 3, true);
    m.put_slice(b"abc");
    put_header(&mut m, 300, false);
    m.put_slice(&[7u8; 300]);
    for cut in 0..m.len() {
        assert!(
            !message_complete(&m[..cut]),
            "complete at {cut} of {}",
            m.len()
        );
    }
    assert!(message_complete(&m));
    let mut more = m.to_vec();
    more.extend_from_slice(b"\x00\x05next");
    assert!(
        message_complete(&more),
        "bytes after it are the next message's"
    );
    // A declared size past u64: whole, for the reader to refuse.
    let absurd = [FLAG_LONG, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff];
    assert!(message_complete(&absurd));
    // So is a header with reserved bits, after a whole frame or not.
    assert!(message_complete(&[0x08]));
    assert!(message_complete(b"\x01\x01a\x10"));
}

/// The body of the one frame in `f`.
fn body(f: &[u8]) -> &[u8] {
    match parse_header(f).unwrap() {
        Decoded::Done(h) => &f[h.header_len..],
        Decoded::Needs(_) => panic!("a whole frame"),
    }
}

#[test]
fn plain_commands_round_trip_and_refuse_garbage() {
    let hello = hello_command(b"stowage", b"s3cret");
    let (h, rest) = match parse_header(&hello).unwrap() {
        Decoded::Done(h) => (h, &hello[h.header_len..]),
        Decoded::Needs(_) => unreachable!(),
    };
    assert!(h.command && rest.len() as u64 == h.size);
    let (name, data) = split_command(rest).unwrap();
    assert_eq!(name, b"HELLO");
    assert_eq!(data, b"\x07stowage\x06s3cret");
    assert_eq!(parse_hello(data), Ok((&b"stowage"[..], &b"s3cret"[..])));
    assert_eq!(parse_hello(b"\x00\x00"), Ok((&b""[..], &b""[..])));
    for bad in [&b""[..], b"\x03ab", b"\x01a", b"\x01a\x02b", b"\x01a\x01bc"] {
        assert_eq!(parse_hello(bad), Err(FrameError::Hello), "{bad:?}");
    }
    // Over 255 bytes: cut, so the length byte stays true.
    let long = hello_command(&[b'u'; 300], &[b'p'; 256]);
    let (_, data) = split_command(body(&long)).unwrap();
    let (u, p) = parse_hello(data).unwrap();
    assert_eq!((u.len(), p.len()), (255, 255));
    // INITIATE carries properties as READY does.
    let init = initiate_command(&[("Socket-Type", b"DEALER")]);
    let (name, props) = split_command(&init[2..]).unwrap();
    assert_eq!(name, b"INITIATE");
    let props = ready_properties(props).unwrap();
    assert_eq!(props[0].0, "Socket-Type");
    assert_eq!(&props[0].1[..], b"DEALER");
    assert_eq!(&welcome_command()[..], b"\x04\x08\x07WELCOME");
}

#[test]
fn error_reasons_are_cut_at_a_character_and_read_back() {
    let e = error_command("no");
    let (name, data) = split_command(&e[2..]).unwrap();
    assert_eq!((name, error_reason(data).as_str()), (&b"ERROR"[..], "no"));
    let long = "é".repeat(200);
    let e = error_command(&long);
    let (_, data) = split_command(body(&e)).unwrap();
    let reason = error_reason(data);
    assert_eq!(reason.len(), 254);
    assert!(long.starts_with(&reason));
    // A length byte past the end: what is there.
    assert_eq!(error_reason(b"\x09abc"), "abc");
    assert_eq!(error_reason(b""), "");
}
