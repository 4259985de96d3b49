//! Where a request's decoding and unit work run: inline on the async worker
//! for small requests, on a bounded blocking pool for large ones, so that
//! one large request (a 1 MB frame 0 of 100,000 fields, or 1,000,000 global
//! indexes) cannot hold the async workers every other connection needs.
//!
//! A request is *large* when its frame 0, the part that is decoded entry by
//! entry, holds at least [`Offload::DEFAULT_CUTOFF`] (16 KiB) bytes; data frames are
//! not counted (tensors are taken as views, at a cost independent of their
//! size). A large request waits for one of `permits` slots, then runs on a
//! `spawn_blocking` thread that drives the request's future with
//! [`tokio::runtime::Handle::block_on`], so the router's awaits on remote
//! units still work. `permits` is the core count less one (at least one):
//! on a 2-core machine one large request runs at a time and one core is
//! left to the async workers. Further large requests queue for a slot; small
//! requests and other connections do not.
//!
//! The cutoff: decoding frame 0 costs 17-140 ns per byte in release
//! (`cargo bench -p stowage-wire --bench decode`, `docs/benchmarks.md`: a
//! list of indexes is cheapest, 100,000 one-row fields dearest), so 16 KiB
//! decode in at most about 2.3 ms inline; the hop to a blocking thread and
//! back costs about 120 µs per request (the `hop_cost` test, debug build,
//! loaded 2-core machine; inline: 89 ns), which the small
//! requests of a training step need not pay.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::Semaphore;
use tracing::Instrument;

/// The blocking pool's gate; one per `stowd`, shared by every endpoint.
#[derive(Debug)]
pub(super) struct Offload {
    permits: Arc<Semaphore>,
    cutoff: usize,
}

impl Offload {
    /// Frame-0 bytes from which a request runs on the blocking pool.
    pub const DEFAULT_CUTOFF: usize = 16 << 10;

    /// A gate with one slot per core but one (at least one).
    pub fn new(cutoff: usize) -> Arc<Offload> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        Arc::new(Offload {
            permits: Arc::new(Semaphore::new(cores.saturating_sub(1).max(1))),
            cutoff,
        })
    }

    /// Whether a request whose frame 0 holds `frame0_bytes` runs inline
    /// ([`Offload::run`] awaits it where it is). A caller may then await
    /// it itself: a future that holds the request's work and `run`'s
    /// future, which holds it again, is twice its size, and it is moved
    /// into a box per request.
    pub fn inline(&self, frame0_bytes: usize) -> bool {
        frame0_bytes < self.cutoff
    }

    /// Runs `work` inline if `frame0_bytes` is under the cutoff, else on
    /// the blocking pool once a slot is free. A panic in `work` is resumed
    /// here, as it would have been inline.
    pub async fn run<T, F>(&self, frame0_bytes: usize, work: F) -> T
    where
        F: Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        if self.inline(frame0_bytes) {
            return work.await;
        }
        let permit = self
            .permits
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        let handle = tokio::runtime::Handle::current();
        let work = work.in_current_span();
        let joined = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            handle.block_on(work)
        })
        .await;
        match joined {
            Ok(v) => v,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => panic!("blocking request task cancelled: {e}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_work_runs_off_the_async_workers() {
        let offload = Offload::new(10);
        let here = std::thread::current().id();
        let a = offload.run(9, async { std::thread::current().id() }).await;
        let b = offload.run(10, async { std::thread::current().id() }).await;
        assert_eq!(a, here);
        assert_ne!(b, here);
    }

    /// What the hop to the blocking pool costs a request (printed; the
    /// module doc quotes it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hop_cost() {
        let offload = Offload::new(1);
        let n = 2000u32;
        let t = std::time::Instant::now();
        for i in 0..n {
            assert_eq!(offload.run(0, async move { i }).await, i);
        }
        let inline = t.elapsed() / n;
        let t = std::time::Instant::now();
        for i in 0..n {
            assert_eq!(offload.run(1, async move { i }).await, i);
        }
        let pooled = t.elapsed() / n;
        eprintln!("offload: inline {inline:?} per request, via the blocking pool {pooled:?}");
        assert!(pooled < std::time::Duration::from_millis(50));
    }
}
