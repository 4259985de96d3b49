//! Every dtype on the TransferQueue wire: a PUT of each decodes to a tensor
//! over the very bytes of its frame, a frame one byte off is refused, and a
//! GET reply writes the dtype's meta exactly as TransferQueue's pickle does.

use bytes::Bytes;

use super::{ext3, frame0, put_body};
use crate::batch::{Cell, Field};
use crate::pickle;
use crate::tensor::{Dtype, Tensor};
use crate::tq::{Error, Reply, Request, decode_reply, decode_request, encode_reply};

/// `pickle.dumps((name, (2, 3), 1), protocol=pickle.HIGHEST_PROTOCOL).hex()`
/// from CPython 3.11 in TransferQueue 0.1.11's virtualenv.
const CPYTHON: [(&str, &str); 3] = [
    (
        "float8_e4m3fnuz",
        "8005951d000000000000008c0f666c6f6174385f65346d33666e757a944b024b0386944b0187942e",
    ),
    (
        "float4_e2m1fn_x2",
        "8005951e000000000000008c10666c6f6174345f65326d31666e5f7832944b024b0386944b0187942e",
    ),
    (
        "complex32",
        "80059517000000000000008c09636f6d706c65783332944b024b0386944b0187942e",
    ),
];

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Bytes that differ per element and per dtype (every byte value occurs).
fn pattern(d: Dtype, len: usize) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(37) ^ d.itemsize() as u8)
        .collect()
}

#[test]
fn every_dtype_puts_over_its_frame_bytes() {
    for d in Dtype::ALL {
        let data = pattern(d, 2 * 3 * d.itemsize());
        let body = put_body(&[4, 9], &[("x", ext3(d.name(), &[2, 3], 1))]);
        let frames = vec![frame0("PUT", &body), data.clone()];
        let Request::Put { fields, .. } =
            decode_request(&frames).unwrap_or_else(|e| panic!("{d}: {e}"))
        else {
            panic!("{d}: not a put")
        };
        let Field::Regular(t) = &fields[0].1 else {
            panic!("{d}: not regular")
        };
        assert_eq!((t.dtype(), t.shape()), (d, &[2u64, 3][..]));
        assert_eq!(t.buffer(), &data, "{d}");
        assert_eq!(t.buffer().as_ptr(), data.as_ptr(), "{d}: copied");

        for len in [data.len() - 1, data.len() + 1] {
            let frames = vec![frame0("PUT", &body), pattern(d, len)];
            let e = decode_request(&frames).expect_err("one byte off");
            assert!(matches!(e, Error::FrameLength { frame: 1, .. }), "{d}: {e}");
        }
    }
}

#[test]
fn every_dtype_gets_back_as_transferqueue_writes_it() {
    for d in Dtype::ALL {
        let data = pattern(d, 3 * 2 * d.itemsize());
        let t = Tensor::contiguous(data.clone(), d, vec![3, 2]).unwrap();
        let cells: Vec<Cell> = (0..3)
            .map(|i| Cell::Tensor(t.row_tensor(i).unwrap()))
            .collect();
        let reply = Reply::GetData {
            fields: vec![("x".into(), cells)],
        };
        let frames = encode_reply("U", &reply);
        assert_eq!(frames.len(), 4, "{d}");
        for (i, f) in frames[1..].iter().enumerate() {
            assert_eq!(
                f,
                &data[i * 2 * d.itemsize()..(i + 1) * 2 * d.itemsize()],
                "{d}"
            );
        }
        let (_, back) = decode_reply(&frames).unwrap_or_else(|e| panic!("{d}: {e}"));
        assert_eq!(back, reply, "{d}");
    }
    for (name, want) in CPYTHON {
        assert_eq!(
            pickle::dumps_tensor_meta(name, &[2, 3], 1),
            hex(want),
            "{name}"
        );
    }
}
