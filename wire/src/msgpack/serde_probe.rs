//! What rmp-serde does with the inputs this reader bounds: the measured
//! reasons in the module doc of [`super`]. Each probe asserts what was
//! seen, so a change in a later rmp-serde shows up here.

use std::time::Instant;

use bytes::Bytes;
use serde::Deserialize;

/// A declared 2^32-1-element array over a few bytes fails at the end of
/// the input without allocating for the declared count; over 1 MiB of
/// items it reads them all before failing (linear, like ours).
#[test]
fn a_huge_declared_array_fails_at_the_end_of_input() {
    let r = rmp_serde::from_slice::<Vec<u32>>(b"\xdd\xff\xff\xff\xff\x01");
    assert!(r.is_err(), "{r:?}");
    let mut big = b"\xdd\xff\xff\xff\xff".to_vec();
    big.resize(5 + (1 << 20), 0x01);
    let t = Instant::now();
    let r = rmp_serde::from_slice::<Vec<u32>>(&big);
    let took = t.elapsed();
    assert!(r.is_err(), "{r:?}");
    eprintln!("rmp-serde: 2^32-1 declared, 1 MiB present: {r:?} after {took:?}");
    // Ours refuses at the header, before reading an item.
    let b = Bytes::from(big);
    assert!(super::Reader::new(&b, 0).item().is_err());
}

/// str8 and fixstr decode to the same `&str`: the header width, which the
/// TransferQueue codec needs to know whether a value re-encodes to the
/// same bytes, is gone.
#[test]
fn the_header_width_is_lost() {
    let long: &str = rmp_serde::from_slice(b"\xd9\x02hi").unwrap();
    let short: &str = rmp_serde::from_slice(b"\xa2hi").unwrap();
    assert_eq!(long, short);
    assert_eq!(rmp_serde::to_vec(long).unwrap(), b"\xa2hi");
}

/// `&str` and `&[u8]` are borrowed from the slice: a `Bytes` slice can be
/// recovered, but only by pointer arithmetic (`Bytes::slice_ref`); the
/// offset itself never reaches the caller.
#[test]
fn str_and_bin_borrow() {
    let frame = Bytes::from_static(b"\x92\xa2hi\xc4\x03abc");
    let (s, b): (&str, &[u8]) = rmp_serde::from_slice(&frame).unwrap();
    assert_eq!(s.as_ptr(), frame[2..].as_ptr());
    assert_eq!(frame.slice_ref(b).as_ptr(), frame[6..].as_ptr());
}

#[derive(Debug, Deserialize)]
#[serde(rename = "_ExtStruct")]
struct Ext<'a>(#[serde(borrow)] (i8, &'a [u8]));

/// An ext value reaches serde only through the `_ExtStruct` newtype.
#[test]
fn ext_goes_through_the_ext_struct_convention() {
    let frame = Bytes::from_static(b"\xd6\x05wxyz");
    let r = rmp_serde::from_slice::<Ext<'_>>(&frame);
    eprintln!("rmp-serde: fixext4 as _ExtStruct((i8, &[u8])): {r:?}");
    let Ext((code, data)) = r.unwrap();
    assert_eq!((code, data), (5, &b"wxyz"[..]));
    // Decoded as anything else, the ext is refused.
    assert!(rmp_serde::from_slice::<&[u8]>(&frame).is_err());
}

/// The default depth limit is 1024 levels with a recursion per level: in
/// a debug build 1,000 nested arrays (1,001 bytes) overflow a 2 MiB thread
/// stack (a tokio worker's default) and abort the process before the limit
/// is reached. Shown in a child process, since a stack overflow cannot be
/// caught; ours stop at 32 and 64 levels.
#[test]
fn deep_nesting_overflows_the_stack_before_the_default_limit() {
    let nested = |n: usize| {
        let mut v = vec![0x91u8; n];
        v.push(0xc0);
        v
    };
    let decode = move |n: usize| {
        std::thread::Builder::new()
            .stack_size(2 << 20)
            .spawn(move || rmp_serde::from_slice::<serde::de::IgnoredAny>(&nested(n)).is_ok())
            .unwrap()
            .join()
            .unwrap()
    };
    if std::env::var_os("STOWAGE_SERDE_PROBE_CHILD").is_some() {
        decode(1000);
        return;
    }
    assert!(decode(100));
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "msgpack::serde_probe::deep_nesting_overflows_the_stack_before_the_default_limit",
            "--exact",
        ])
        .env("STOWAGE_SERDE_PROBE_CHILD", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!(
        "rmp-serde: 1000 nested arrays on a 2 MiB stack: {:?}, {}",
        out.status,
        stderr.trim()
    );
    if cfg!(debug_assertions) {
        assert!(
            !out.status.success() && stderr.contains("overflowed its stack"),
            "{stderr}"
        );
    }
    let deep = Bytes::from(nested(1000));
    let r = super::Reader::new(&deep, 0).skip(super::NATIVE_MAX_DEPTH);
    assert!(matches!(
        r,
        Err(super::MsgpackError::Malformed {
            reason: "nesting too deep",
            ..
        })
    ));
}

/// A truncated input fails with an I/O-style error that names no offset.
#[test]
fn errors_name_no_offset() {
    let e = rmp_serde::from_slice::<(u8, &str)>(b"\x92\x01\xa5ab").unwrap_err();
    eprintln!("rmp-serde: truncated str: {e:?} / {e}");
    let ours = super::Reader::new(b"\x92\x01\xa5ab", 2).item().unwrap_err();
    assert_eq!(
        ours,
        super::MsgpackError::Malformed {
            offset: 3,
            reason: "truncated"
        }
    );
}
