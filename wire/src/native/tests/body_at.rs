//! [`decode_request_at`], which steps over the body where
//! [`decode_extras_and_body`] found it, answers exactly what
//! [`decode_request`] answers: the same request, or the same error,
//! whatever the envelope holds (keys in any order, repeated, unknown,
//! malformed, too deep, trailing bytes) and under tight limits.

use super::*;

/// A body nested `n` arrays deep.
fn deep(n: usize) -> M {
    (0..n).fold(M::U(1), |inner, _| M::Arr(vec![inner]))
}

fn get_body() -> M {
    M::Map(vec![
        ("global_indexes", uints(&[1, 2])),
        ("fields", M::Arr(vec![M::S("x")])),
    ])
}

/// Envelopes: the keys of `hand_put` and of a get in several orders, with
/// bodies valid and not, extras valid and not, keys repeated or unknown;
/// each whole, with a byte after it, and a byte short.
fn envelopes() -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for kv in envelope_maps() {
        let bytes = M::Map(kv).bytes().to_vec();
        let mut trailing = bytes.clone();
        trailing.push(0x01);
        let mut short = bytes.clone();
        short.pop();
        out.extend([bytes, trailing, short]);
    }
    out
}

/// The key-value lists of [`envelopes`].
fn envelope_maps() -> Vec<Vec<(&'static str, M)>> {
    let put_body = match hand_put() {
        M::Map(kv) => kv.into_iter().find(|(k, _)| *k == "body").unwrap().1,
        _ => unreachable!(),
    };
    let bodies = [
        put_body,
        get_body(),
        M::U(7),
        M::Map(vec![]),
        deep(30),
        deep(200),
        M::Raw(vec![0x92, 0x01]), // an array of 2 that holds 1
        M::Raw(vec![0xc1]),       // a reserved marker
        M::Map(vec![
            ("global_indexes", uints(&[1])),
            ("fields", M::Raw(vec![0xdd, 0xff, 0xff, 0xff, 0xff])),
        ]),
    ];
    let head = |op: &'static str| {
        vec![
            ("proto", M::S("stowage/1")),
            ("op", M::S(op)),
            ("id", M::U(9)),
        ]
    };
    let mut out = Vec::new();
    for (b, body) in bodies.iter().enumerate() {
        let op = if b == 1 { "get" } else { "put" };
        let extras: [Vec<(&'static str, M)>; 5] = [
            vec![],
            vec![("channel", M::S("tok"))],
            vec![("channel", M::S(""))],
            vec![("zz", M::U(1))],
            vec![("proto", M::S("stowage/2"))],
        ];
        for extra in &extras {
            // body last, first, between the others, and twice
            let mut orders: Vec<Vec<(&'static str, M)>> = Vec::new();
            let mut last = head(op);
            last.push(("body", body.clone()));
            last.extend(extra.clone());
            orders.push(last);
            let mut first = vec![("body", body.clone())];
            first.extend(extra.clone());
            first.extend(head(op));
            orders.push(first);
            let mut middle = head(op);
            middle.insert(1, ("body", body.clone()));
            middle.extend(extra.clone());
            orders.push(middle);
            let mut twice = head(op);
            twice.push(("body", body.clone()));
            twice.extend(extra.clone());
            twice.push(("body", get_body()));
            orders.push(twice);
            let mut no_body = head(op);
            no_body.extend(extra.clone());
            orders.push(no_body);
            out.extend(orders);
        }
    }
    out
}

#[test]
fn stepping_over_the_body_decodes_what_walking_it_decodes() {
    let tight = Limits {
        max_rows: 1,
        max_fields: 1,
        max_frames: 1,
        max_message_bytes: 64,
    };
    let other = M::Map(vec![("body", get_body())]).bytes();
    let (mut checked, mut ok) = (0, 0);
    for frame0 in envelopes() {
        for data in [&[][..], &[16][..], &[16, 4][..]] {
            let mut frames = vec![Bytes::from(frame0.clone())];
            frames.extend(data.iter().map(|&n| Bytes::from(vec![0u8; n])));
            for limits in [Limits::default(), tight] {
                let walked = decode_request(&frames, &limits);
                let Ok((_, body)) = decode_extras_and_body(&frames[0], &limits) else {
                    continue;
                };
                assert_eq!(
                    decode_request_at(&frames, &limits, &body),
                    walked,
                    "{frame0:02x?}"
                );
                // Found in another frame 0: not used.
                let (_, elsewhere) = decode_extras_and_body(&other, &limits).unwrap();
                assert_eq!(decode_request_at(&frames, &limits, &elsewhere), walked);
                checked += 1;
                ok += usize::from(walked.is_ok());
            }
        }
    }
    // Both kinds of answer were compared, many times.
    assert!(checked > 500 && ok > 10, "{checked} checked, {ok} decoded");
}

/// A body that is the envelope's last key is read once, by the op's
/// reader, which then checks that frame 0 ends there: such an envelope
/// decodes to the same request as one with the same body first (walked,
/// then read), and is refused where that one is, trailing or missing
/// bytes included.
#[test]
fn a_last_body_read_once_decodes_what_a_walked_body_decodes() {
    let (mut ok, mut refused) = (0, 0);
    for kv in envelope_maps() {
        if kv.last().is_none_or(|(k, _)| *k != "body")
            || kv.iter().filter(|(k, _)| *k == "body").count() != 1
        {
            continue;
        }
        let mut first = kv.clone();
        first.rotate_right(1); // body first: walked by the envelope
        for tail in [&[][..], &[0x01][..], &[0x01, 0x02][..]] {
            let last = [M::Map(kv.clone()).bytes().to_vec(), tail.to_vec()].concat();
            let walked = [M::Map(first.clone()).bytes().to_vec(), tail.to_vec()].concat();
            for data in [&[][..], &[16][..], &[16, 4][..]] {
                let frames = |f0: &[u8]| {
                    let mut frames = vec![Bytes::from(f0.to_vec())];
                    frames.extend(data.iter().map(|&n| Bytes::from(vec![0u8; n])));
                    frames
                };
                let (a, b) = (
                    decode_request(&frames(&last), &Limits::default()),
                    decode_request(&frames(&walked), &Limits::default()),
                );
                match (&a, &b) {
                    (Ok(x), Ok(y)) => {
                        assert_eq!(x, y);
                        ok += 1;
                    }
                    (Err(_), Err(_)) => refused += 1,
                    _ => panic!("{last:02x?}: {a:?} against {b:?}"),
                }
                if !tail.is_empty() {
                    assert!(a.is_err(), "trailing bytes after a last body: {last:02x?}");
                }
            }
        }
    }
    // The put and the get decode (each with its data frames); the rest are refused.
    assert!(ok >= 2 && refused > 50, "{ok} decoded, {refused} refused");
}
