//! Tests of the one reader and the writer.

use bytes::Bytes;

use super::*;

fn item(bytes: &'static [u8]) -> Item<'static> {
    let b: &'static Bytes = Box::leak(Box::new(Bytes::from_static(bytes)));
    Reader::bytes(b, 0).item().unwrap()
}

#[test]
fn canonical_forms_are_recognised() {
    assert_eq!(
        item(b"\xa2hi"),
        Item::Str {
            s: "hi",
            canonical: true
        }
    );
    assert_eq!(
        item(b"\xd9\x02hi"),
        Item::Str {
            s: "hi",
            canonical: false
        }
    );
    assert!(matches!(
        item(b"\xc4\x01x"),
        Item::Bin {
            canonical: true,
            ..
        }
    ));
    assert!(matches!(
        item(b"\xc5\x00\x01x"),
        Item::Bin {
            canonical: false,
            ..
        }
    ));
    assert_eq!(item(b"\xd0\x80"), Item::Int(-128));
    assert_eq!(
        item(b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff"),
        Item::UInt(u64::MAX)
    );
}

#[test]
fn declared_lengths_are_checked() {
    let b = Bytes::from_static(b"\xdd\xff\xff\xff\xff\x01");
    assert!(Reader::new(&b, 0).item().is_err());
    let b = Bytes::from_static(b"\xdb\x00\x00\x01\x00ab");
    assert!(Reader::new(&b, 0).item().is_err());
    let b = Bytes::from_static(b"\xc7\xff\x03ab");
    assert!(Reader::new(&b, 0).item().is_err());
}

#[test]
fn writer_matches_msgspec_choices() {
    let mut w = Writer::new();
    w.uint(5);
    w.uint(300);
    w.str(&"x".repeat(40));
    w.ext(3, &[0; 4]);
    w.ext(3, &[0; 5]);
    let out = w.into_bytes();
    assert_eq!(&out[..4], b"\x05\xcd\x01\x2c");
    assert_eq!(&out[4..6], b"\xd9\x28");
    assert_eq!(&out[46..48], b"\xd6\x03");
    assert_eq!(&out[52..55], b"\xc7\x05\x03");
}

#[test]
fn typed_reads_and_item_agree_on_bounds() {
    // An array32 declaring 2^32-1 items over one byte: both ways fail at
    // the header, with the offset just after it.
    let b = Bytes::from_static(b"\xdd\xff\xff\xff\xff\x01");
    let want = MsgpackError::Malformed {
        offset: 5,
        reason: "count exceeds the remaining bytes",
    };
    assert_eq!(Reader::new(&b, 0).item(), Err(want.clone()));
    assert_eq!(Reader::new(&b, 0).array_len("x"), Err(want.clone()));
    assert_eq!(Reader::new(&b, 0).skip(NATIVE_MAX_DEPTH), Err(want));
    // A map needs two bytes an entry.
    let b = Bytes::from_static(b"\x81\x01");
    assert!(Reader::new(&b, 0).item().is_err());
    assert!(Reader::new(&b, 0).map_len("x").is_err());
}

#[test]
fn nesting_is_bounded_both_ways() {
    // 100 nested one-element arrays around a nil.
    let mut v = vec![0x91u8; 100];
    v.push(0xc0);
    let b = Bytes::from(v);
    let deep = |r: Result<(), MsgpackError>| {
        matches!(
            r,
            Err(MsgpackError::Malformed {
                reason: "nesting too deep",
                ..
            })
        )
    };
    assert!(deep(
        Reader::new(&b, 0).visit(TQ_MAX_DEPTH, &mut |_, _, _| Ok::<(), MsgpackError>(()))
    ));
    assert!(deep(Reader::new(&b, 0).skip(NATIVE_MAX_DEPTH).map(|_| ())));
    assert_eq!(Reader::new(&b, 0).skip(101), Ok(0..101));
    assert!(
        Reader::new(&b, 0)
            .visit(101, &mut |_, _, _| Ok::<(), MsgpackError>(()))
            .is_ok()
    );
}

#[test]
fn slices_of_a_bytes_reader_share_the_frame() {
    let b = Bytes::from_static(b"\xc4\x03abc\xd6\x05wxyz");
    let mut r = Reader::bytes(&b, 0);
    let Item::Bin { start, data, .. } = r.item().unwrap() else {
        panic!()
    };
    let s = r.slice(start, start + data.len());
    assert_eq!(&s[..], b"abc");
    assert_eq!(s.as_ptr(), b[2..].as_ptr(), "no copy");
    let mut seen = Vec::new();
    r.visit(1, &mut |code, data, at| {
        seen.push((code, data.to_vec(), at));
        Ok::<(), MsgpackError>(())
    })
    .unwrap();
    assert_eq!(seen, vec![(5, b"wxyz".to_vec(), 7)]);
    assert!(r.at_end());
}

#[test]
fn writer_is_poisoned_by_nothing_short() {
    let mut w = Writer::new();
    w.kv_str("k", "v");
    w.sint(-1);
    w.nil();
    assert_eq!(w.finish().unwrap(), b"\xa1k\xa1v\xff\xc0");
}

/// The writer's own short forms write what `rmp`'s encoders write, at and
/// around every boundary between forms.
#[test]
fn short_forms_are_rmps_bytes() {
    use rmp::encode;
    for n in (0..40).chain([255, 256, 65_535, 65_536]) {
        let (mut w, mut want) = (Writer::new(), Vec::new());
        let s = "é".repeat(n / 2) + &"x".repeat(n % 2);
        w.map(n);
        w.array(n);
        w.str(&s);
        encode::write_map_len(&mut want, n as u32).unwrap();
        encode::write_array_len(&mut want, n as u32).unwrap();
        encode::write_str(&mut want, &s).unwrap();
        assert_eq!(w.finish().unwrap(), want, "{n}");
    }
    for v in [
        0,
        1,
        127,
        128,
        255,
        256,
        65_535,
        65_536,
        u64::from(u32::MAX) + 1,
        u64::MAX,
    ] {
        let (mut w, mut want) = (Writer::new(), Vec::new());
        w.uint(v);
        encode::write_uint(&mut want, v).unwrap();
        assert_eq!(w.finish().unwrap(), want, "{v}");
    }
}
