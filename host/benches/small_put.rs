//! The fixed cost of a small put inside `stowd`, below the transport: frame
//! 0 decoded (`wire::native::decode_extras_and_body`, `decode_request_at`
//! and `request_id`, as the native service runs them), the fields turned into
//! host fields, and `Manager::put` over 4 local units with the default
//! chain of the bundled plugins (or the built-in alone), at fresh indexes
//! (cleared every 1,000 puts, outside the timing), as the Python client
//! sends it: every field's rows in one shared data frame. Prints, per
//! shape (fields x rows, float32 `[16]` a row), the time and the heap
//! allocations a put (a counting allocator).
//!
//! `cargo bench -p stowage-host --bench small_put` (the plugins from
//! `cargo xtask plugins`, or `STOWAGE_PLUGIN_DIR`; `STOWAGE_PLUGIN_DIR=none`
//! for the built-in).

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use stowage_host::config::Config;
use stowage_host::extent::Received;
use stowage_host::node::Node;
use stowage_host::tensor::Dtype;
use stowage_host::wire::native::{self, Op, RegularParts, Request, WireField};

struct Counting;
static CALLS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator and only bumps atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        CALLS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        CALLS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        CALLS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(new_size as u64, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const WIDTH: u64 = 16;

/// The frames of a put of `fields` fields x `rows` rows at `base..`, every
/// field's rows in data frame 1.
fn put_frames(fields: usize, rows: u64, base: u64) -> Vec<Bytes> {
    let row_bytes = (WIDTH * 4) as usize;
    let field_bytes = rows as usize * row_bytes;
    let data = Bytes::from(vec![7u8; fields * field_bytes]);
    let wire: Vec<(std::sync::Arc<str>, WireField)> = (0..fields)
        .map(|f| {
            let part = data.slice(f * field_bytes..(f + 1) * field_bytes);
            let parts = RegularParts::new(Dtype::Float32, vec![WIDTH], vec![(part, rows)]).unwrap();
            (format!("f{f}").into(), WireField::Regular(parts))
        })
        .collect();
    let layout = native::FrameLayout {
        frames: vec![
            (0..fields)
                .map(|f| native::RowSlice {
                    field: f,
                    start: 0,
                    end: rows,
                })
                .collect(),
        ],
    };
    let request = Request {
        id: base,
        op: Op::Put {
            global_indexes: (base..base + rows).collect(),
            fields: wire,
        },
    };
    native::encode_request_with(&request, &layout).unwrap()
}

fn plugin_dir() -> Option<PathBuf> {
    match std::env::var_os("STOWAGE_PLUGIN_DIR") {
        Some(d) if d == "none" => None,
        Some(d) => Some(PathBuf::from(d)),
        None => Some(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/plugins")),
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = plugin_dir();
    let empty = std::env::temp_dir().join(format!("small-put-{}", std::process::id()));
    std::fs::create_dir_all(&empty).unwrap();
    let plugins = dir.clone().unwrap_or(empty.clone());
    let toml = format!(
        "[units]\nlocal = 4\n\n[plugins]\ndir = {:?}\n",
        plugins.display().to_string()
    );
    let config = Config::parse(&toml, "small_put").unwrap();
    let node = rt.block_on(Node::build(&config)).unwrap();
    let m = node.manager.clone();
    let limits = native::Limits::DEFAULT;
    println!(
        "Put path below the transport, 4 local units, {}\n",
        match &dir {
            Some(d) => format!("plugins from {}", d.display()),
            None => "the built-in".into(),
        }
    );
    println!("| fields x rows | µs a put | allocations a put | bytes allocated a put |");
    println!("|---|---:|---:|---:|");
    let mut base = 1u64 << 32;
    // `SMALL_PUT_SHAPES=1x1,32x4` for some shapes, `SMALL_PUT_N` puts each.
    let shapes: Vec<(usize, u64)> = match std::env::var("SMALL_PUT_SHAPES") {
        Ok(s) => s
            .split(',')
            .map(|fr| {
                let (f, r) = fr.split_once('x').expect("FIELDSxROWS");
                (f.parse().unwrap(), r.parse().unwrap())
            })
            .collect(),
        Err(_) => vec![(1, 1), (1, 4), (10, 4), (32, 1), (32, 4)],
    };
    let n: u64 = std::env::var("SMALL_PUT_N").map_or(5000, |s| s.parse().unwrap());
    for (fields, rows) in shapes {
        let batch = 1000u64.min(n);
        let (mut ns, mut calls, mut bytes) = (0u128, 0u64, 0u64);
        for round in 0..(n / batch + 1) {
            let start_base = base;
            let all: Vec<Vec<Bytes>> = (0..batch)
                .map(|k| put_frames(fields, rows, base + k * rows))
                .collect();
            base += batch * rows;
            let (c0, b0) = (CALLS.load(Ordering::Relaxed), BYTES.load(Ordering::Relaxed));
            let t = Instant::now();
            for frames in all {
                let f0 = &frames[0];
                let _id = native::request_id(&frames);
                let (extras, body) = native::decode_extras_and_body(f0, &limits).unwrap();
                assert!(extras.segments.is_none());
                let received = Received::frames(&frames[1..]);
                let req = native::decode_request_at(&frames, &limits, &body).unwrap();
                let Op::Put {
                    global_indexes,
                    fields,
                } = req.op
                else {
                    unreachable!()
                };
                let decoded = fields
                    .into_iter()
                    .map(|(name, f)| (name, f.into_field().unwrap()))
                    .collect();
                rt.block_on(m.put(&global_indexes, decoded, &received))
                    .unwrap();
            }
            if round > 0 {
                ns += t.elapsed().as_nanos();
                calls += CALLS.load(Ordering::Relaxed) - c0;
                bytes += BYTES.load(Ordering::Relaxed) - b0;
            }
            let cleared: Vec<u64> = (start_base..base).collect();
            rt.block_on(m.clear(&cleared, None)).unwrap();
        }
        println!(
            "| {fields} x {rows} | {:.2} | {:.1} | {:.0} |",
            ns as f64 / n as f64 / 1e3,
            calls as f64 / n as f64,
            bytes as f64 / n as f64
        );
    }
    let _ = std::fs::remove_dir_all(&empty);
}
