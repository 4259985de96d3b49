//! What CURVE's cipher costs on this machine, beside memcpy, in one run:
//! XSalsa20-Poly1305 sealing and opening in place in a tight loop (the
//! cipher alone), and the codecs stowd runs ([`Encrypter`] then
//! [`Decrypter`]: gather a frame, seal it, open it, copy it out), per frame
//! size. One thread; so CPU seconds per GiB is 1 / (GiB/s).
//!
//! `cargo run --release -p stowage-transport --example curve_speed [MiB]`
//! (default 256 MiB moved per row).

use std::collections::VecDeque;
use std::time::Instant;

use bytes::Bytes;
use crypto_box::aead::AeadInPlace;
use crypto_box::aead::generic_array::GenericArray;
use stowage_transport::curve::{ClientHandshake, KeyCheck, Keypair, ServerHandshake, Session};
use stowage_transport::frame::Header;

struct Any;

impl KeyCheck for Any {
    fn check(&self, _: &[u8; 32]) -> Result<String, String> {
        Ok("bench".into())
    }
}

fn sessions() -> (Session, Session) {
    let (ck, sk) = (Keypair::generate().unwrap(), Keypair::generate().unwrap());
    let mut c = ClientHandshake::new(&ck, sk.public()).unwrap();
    let mut s = ServerHandshake::new(&sk).unwrap();
    let welcome = s.hello(&c.hello()).unwrap();
    let initiate = c.welcome(&welcome, b"").unwrap();
    s.initiate(&initiate, &Any).unwrap();
    let (ready, ss) = s.ready(b"").unwrap();
    let (_, cs) = c.ready(&ready).unwrap();
    (cs, ss)
}

/// GiB/s of `f` run over `bytes` bytes in all, best of 3.
fn rate(bytes: usize, mut f: impl FnMut()) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best / (1u64 << 30) as f64
}

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(256);
    let total = mib << 20;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "{mib} MiB per row, best of 3, one thread; load {}",
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "\n| frame | memcpy GiB/s | seal GiB/s | open GiB/s | codecs, send + receive GiB/s | CPU s/GiB: memcpy / seal + open / codecs |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    let (cs, _) = sessions();
    let key = crypto_box::SalsaBox::new(
        &crypto_box::PublicKey::from(*Keypair::generate().unwrap().public()),
        &crypto_box::SecretKey::from(Keypair::generate().unwrap().secret_bytes()),
    );
    drop(cs);
    for frame in [4usize << 10, 64 << 10, 1 << 20, 16 << 20] {
        let n = (total / frame).max(1);
        let src = vec![7u8; frame];
        let mut dst = vec![0u8; frame];
        let memcpy = rate(n * frame, || {
            for _ in 0..n {
                dst.copy_from_slice(std::hint::black_box(&src));
            }
        });
        let nonce = GenericArray::default();
        let mut tags = Vec::with_capacity(n);
        let seal = rate(n * frame, || {
            tags.clear();
            for _ in 0..n {
                tags.push(
                    key.encrypt_in_place_detached(&nonce, b"", &mut dst)
                        .unwrap(),
                );
            }
        });
        // Open what was sealed last, n times (the same bytes: decrypting
        // restores them, so re-seal each turn would double the work).
        let sealed = dst.clone();
        let tag = *tags.last().unwrap();
        let open = rate(n * frame, || {
            for _ in 0..n {
                dst.copy_from_slice(&sealed);
                key.decrypt_in_place_detached(&nonce, b"", &mut dst, &tag)
                    .unwrap();
            }
        });
        // The codecs: one ZMTP frame in plaintext, sealed into a MESSAGE,
        // opened and read out into a buffer.
        let mut plain = Vec::with_capacity(frame + 9);
        Header::message(frame as u64, false).put(&mut plain);
        plain.extend_from_slice(&src);
        let mut out = vec![0u8; plain.len()];
        let mut wire = VecDeque::<Bytes>::new();
        let (mut client, mut server) = sessions();
        server.decrypter.set_max_frame(u64::MAX);
        let codecs = rate(n * frame, || {
            for _ in 0..n {
                client.encrypter.feed(&plain, &mut wire).unwrap();
                for w in wire.drain(..) {
                    server.decrypter.feed(&w).unwrap();
                }
                let mut got = 0;
                while got < out.len() {
                    got += server.decrypter.read(&mut out[got..]);
                }
            }
        });
        assert_eq!(&out[out.len() - frame..], &src[..]);
        println!(
            "| {} KiB | {memcpy:.2} | {seal:.2} | {open:.2} | {codecs:.2} | {:.3} / {:.3} / {:.3} |",
            frame >> 10,
            1.0 / memcpy,
            1.0 / seal + 1.0 / open,
            1.0 / codecs
        );
    }
}
