//! The pickle writer against CPython 3.11 `pickle.dumps(obj, protocol=5)`
//! (vectors generated with fresh, unshared objects, as TransferQueue makes
//! them), and the reader's limits.

use super::fnv1a;
use crate::pickle::{self, PValue, PickleError, dumps, loads};

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn s(x: &str) -> PValue {
    PValue::Str(x.into())
}

fn ints(xs: &[i128]) -> PValue {
    PValue::Tuple(xs.iter().map(|&x| PValue::Int(x)).collect())
}

fn meta(dtype: &str, shape: &[i128], index: i128) -> PValue {
    PValue::Tuple(vec![s(dtype), ints(shape), PValue::Int(index)])
}

fn nested(layout: &str, tensors: Vec<PValue>) -> PValue {
    PValue::Dict(vec![
        (s("layout"), s(layout)),
        (s("tensors"), PValue::List(tensors)),
    ])
}

#[test]
fn small_values_match_cpython_byte_for_byte() {
    let big = [
        1 << 31,
        -1,
        -129,
        70000,
        i64::MAX as i128,
        i64::MIN as i128,
        255,
        256,
        65535,
        65536,
    ];
    let cases = [
        (
            meta("float32", &[], 3),
            "80059510000000000000008c07666c6f6174333294294b0387942e",
        ),
        (
            meta("float32", &[2, 3, 4, 5], 3),
            "8005951a000000000000008c07666c6f6174333294284b024b034b044b0574944b0387942e",
        ),
        (
            meta(
                "int64",
                &[big.as_slice(), &[-(1 << 31), (1 << 31) - 1]].concat(),
                3,
            ),
            "80059551000000000000008c05696e74363494288a0500000080004affffffff4a7fffffff4a701101008a08ff\
             ffffffffffff7f8a0800000000000000804bff4d00014dffff4a000001004a000000804affffff7f74944b0387942e",
        ),
        (
            nested(
                "jagged",
                vec![meta("int64", &[1], 1), meta("int64", &[3], 2)],
            ),
            "80059545000000000000007d94288c066c61796f7574948c066a6167676564948c0774656e736f7273945d9428\
             8c05696e743634944b0185944b0187948c05696e743634944b0385944b02879465752e",
        ),
        (
            nested("strided", vec![meta("int64", &[1], 1)]),
            "80059535000000000000007d94288c066c61796f7574948c0773747269646564948c0774656e736f7273945d94\
             8c05696e743634944b0185944b01879461752e",
        ),
        (
            nested("strided", vec![]),
            "80059524000000000000007d94288c066c61796f7574948c0773747269646564948c0774656e736f7273945d94752e",
        ),
        (
            meta("<U2", &[2], 1),
            "8005950f000000000000008c033c5532944b0285944b0187942e",
        ),
    ];
    for (value, expected) in cases {
        let expected = hex(expected);
        assert_eq!(dumps(&value), expected, "{value:?}");
        assert_eq!(loads(&expected).unwrap(), value);
    }
    let layout_first =
        pickle::dumps_nested_meta("jagged", &[("int64", &[1], 1), ("int64", &[3], 2)]);
    assert_eq!(
        layout_first,
        dumps(&nested(
            "jagged",
            vec![meta("int64", &[1], 1), meta("int64", &[3], 2)]
        ))
    );
}

#[test]
fn framing_batching_and_long_strings_match_cpython() {
    let x = |n: usize| "x".repeat(n);
    let cases: Vec<(&str, PValue, usize, u64)> = vec![
        (
            "long_str",
            meta(&"é".repeat(200), &[2], 1),
            426,
            0xbd60247f36b91fdb,
        ),
        (
            "nested4000",
            nested(
                "jagged",
                (0..4000)
                    .map(|i| meta("float32", &[i, i % 7], i + 1))
                    .collect(),
            ),
            87552,
            0xabb6d279234bfe2f,
        ),
        (
            "bypass",
            PValue::Tuple(vec![s(&"a".repeat(70000)), ints(&[1]), PValue::Int(1)]),
            70026,
            0x4c0828622d3da155,
        ),
        (
            "edge65530",
            s(&"a".repeat(65530)),
            65548,
            0x1f8c700b976ba50c,
        ),
        (
            "edge65536",
            s(&"a".repeat(65536)),
            65545,
            0xa4c4e8e2c85b4099,
        ),
        (
            "dict1000",
            PValue::Dict(
                (0..1000)
                    .map(|i| (PValue::Int(i), PValue::Int(i)))
                    .collect(),
            ),
            5506,
            0xd688b3bf4f043ae,
        ),
        (
            "dict2000",
            PValue::Dict(
                (0..2000)
                    .map(|i| (PValue::Int(i), s(&"v".repeat(i as usize % 5 + 2))))
                    .collect(),
            ),
            19764,
            0x333af61f7f19270f,
        ),
        (
            "list1001",
            PValue::List((0..1001).map(PValue::Int).collect()),
            2765,
            0x9856c4018edb3a46,
        ),
        (
            "mixed",
            PValue::List(
                (0..900i128)
                    .map(|i| {
                        let shape: Vec<i128> = (0..i % 5).collect();
                        PValue::Tuple(vec![
                            s(&x(((i * 7919) % 300 + 2) as usize)),
                            ints(&shape),
                            PValue::Int(i * 1000),
                        ])
                    })
                    .collect(),
            ),
            151065,
            0x6a9f2354c2f9e119,
        ),
    ];
    for (name, value, len, hash) in cases {
        let out = dumps(&value);
        assert_eq!((out.len(), fnv1a(&out)), (len, hash), "{name}");
        if name.starts_with("dict") {
            // The reader keeps dicts small (ext 4 has two keys).
            assert!(matches!(
                loads(&out),
                Err(PickleError::Malformed {
                    what: "dict too large",
                    ..
                })
            ));
        } else {
            assert_eq!(loads(&out).unwrap(), value, "{name}");
        }
    }
}

#[test]
fn reader_rejects_opcodes_outside_the_subset() {
    // GLOBAL 'builtins\neval\n' — the classic unpickling exploit.
    let evil = b"\x80\x05cbuiltins\neval\n\x94.";
    assert_eq!(
        loads(evil),
        Err(PickleError::UnsupportedOpcode { op: b'c', at: 2 })
    );
    assert!(matches!(
        loads(b"\x80\x05N."),
        Err(PickleError::UnsupportedOpcode { op: b'N', .. })
    ));
    assert_eq!(loads(b"\x80\x06K\x01."), Err(PickleError::Protocol(6)));
}

#[test]
fn reader_checks_declared_lengths_before_allocating() {
    let huge_str = b"\x80\x05X\xff\xff\xff\xffab.";
    assert!(matches!(
        loads(huge_str),
        Err(PickleError::Length {
            len: 0xffff_ffff,
            ..
        })
    ));
    let huge_frame = b"\x80\x05\x95\xff\xff\xff\xff\xff\xff\xff\x7fK\x01.";
    assert!(matches!(loads(huge_frame), Err(PickleError::Length { .. })));
    assert!(matches!(
        loads(b"\x80\x05\x8a\x20"),
        Err(PickleError::IntTooLarge(_))
    ));
    assert!(matches!(
        loads(b"\x80\x05\x8c\x05ab"),
        Err(PickleError::Length {
            len: 5,
            remaining: 2,
            ..
        })
    ));
    assert_eq!(loads(b"\x80\x05M\x01"), Err(PickleError::Truncated(4)));
}

#[test]
fn reader_bounds_depth_and_memo_copies() {
    let mut deep = b"\x80\x05".to_vec();
    deep.extend(std::iter::repeat_n(b']', 40));
    deep.extend(std::iter::repeat_n(b'a', 39));
    deep.push(b'.');
    assert!(matches!(loads(&deep), Err(PickleError::TooDeep(_))));
    // A 200-int tuple memoized once and fetched a thousand times.
    let mut blowup = b"\x80\x05(".to_vec();
    (0..200).for_each(|_| blowup.extend_from_slice(b"K\x01"));
    blowup.extend_from_slice(b"t\x94");
    (0..1000).for_each(|_| blowup.extend_from_slice(b"h\x00"));
    assert_eq!(loads(&blowup), Err(PickleError::TooManyValues));
    // BINGET of a list: Python memoizes it before filling it.
    assert!(matches!(
        loads(b"\x80\x05]\x94K\x01ah\x00\x86."),
        Err(PickleError::Memo { index: 0, .. })
    ));
    // BINGET of a string is fine.
    let v = loads(b"\x80\x05\x8c\x02ab\x94h\x00\x86\x94.").unwrap();
    assert_eq!(v, PValue::Tuple(vec![s("ab"), s("ab")]));
}

#[test]
fn reader_is_strict_about_the_stack() {
    assert_eq!(loads(b"\x80\x05K\x01.x"), Err(PickleError::Trailing(5)));
    assert_eq!(loads(b"\x80\x05K\x01"), Err(PickleError::NoStop));
    assert!(matches!(
        loads(b"\x80\x05K\x01K\x02."),
        Err(PickleError::Malformed { .. })
    ));
    assert!(matches!(
        loads(b"\x80\x05(K\x01."),
        Err(PickleError::Malformed { .. })
    ));
    assert!(matches!(
        loads(b"\x80\x05K\x01(\x86."),
        Err(PickleError::Underflow(_))
    ));
    assert!(matches!(
        loads(b"\x80\x05K\x01K\x02a."),
        Err(PickleError::Malformed { .. })
    ));
    assert!(matches!(
        loads(b"\x80\x05}(K\x01u."),
        Err(PickleError::Malformed { .. })
    ));
    assert!(matches!(
        loads(b"\x80\x05\x8c\x01\xff."),
        Err(PickleError::Utf8(2))
    ));
}
