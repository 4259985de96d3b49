//! Bytes allocated when selecting a 2 GiB float32 tensor `[2^19, 1024]` for
//! 4 units (stride 4), with the constant-stride plan (views) and the gather
//! plan (`index_select`), counted by a counting allocator. Prints a table.
//! `cargo bench -p stowage-host --bench select_alloc`

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use bytes::Bytes;
use stowage_host::batch::Field;
use stowage_host::plan::{self, Piece, SelectionPlan};
use stowage_host::tensor::{Dtype, Tensor};

struct Counting;
static BYTES: AtomicU64 = AtomicU64::new(0);
static CALLS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator and only bumps atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        CALLS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        CALLS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: same contract as the caller's.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn main() {
    let (rows, cols, units) = (1u64 << 19, 1024u64, 4u64);
    let payload = rows * cols * 4;
    let field = Field::Regular(
        Tensor::contiguous(
            Bytes::from(vec![1u8; payload as usize]),
            Dtype::Float32,
            vec![rows, cols],
        )
        .unwrap(),
    );
    println!(
        "Selecting a {} MiB float32 [{rows}, {cols}] tensor for {units} units (stride {units})\n",
        payload >> 20
    );
    println!("Counted: allocations made while executing the plans (the data path);");
    println!("planning and validation allocate only position lists.\n");
    println!("| plan | allocations | bytes allocated | ratio to payload | time (ms) |");
    println!("|---|---:|---:|---:|---:|");
    for name in ["constant-stride (views)", "gather (index_select)"] {
        let (mut bytes, mut calls, mut secs) = (0u64, 0u64, 0f64);
        let mut kept = Vec::new();
        for u in 0..units {
            let positions: Vec<u64> = (u..rows).step_by(units as usize).collect();
            let plan = if name.starts_with("gather") {
                SelectionPlan {
                    pieces: vec![Piece::Gather(positions.clone())],
                }
            } else {
                stowage_host::policy::builtin::Builtin::plan(&field, &positions).unwrap()
            };
            plan::validate_selection(&field, &positions, &plan).unwrap();
            let (b0, c0) = (BYTES.load(Ordering::Relaxed), CALLS.load(Ordering::Relaxed));
            let start = Instant::now();
            kept.push(plan::execute_selection(&field, &plan).unwrap());
            secs += start.elapsed().as_secs_f64();
            bytes += BYTES.load(Ordering::Relaxed) - b0;
            calls += CALLS.load(Ordering::Relaxed) - c0;
        }
        println!(
            "| {name} | {calls} | {bytes} | {:.6} | {:.1} |",
            bytes as f64 / payload as f64,
            secs * 1e3
        );
        drop(kept);
    }
}
