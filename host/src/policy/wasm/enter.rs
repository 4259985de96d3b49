//! Where a call into a plugin runs: on the calling tokio worker, unless
//! the plugin has shown that it makes WASI calls that need tokio.
//!
//! wasmtime-wasi's synchronous bindings run their asynchronous host
//! functions (a stream write, a poll, dropping a stream) with
//! `Handle::block_on` of the current runtime; on a tokio worker that panics
//! with "Cannot start a runtime from within a runtime". So calls used to
//! leave the worker first (`block_in_place`: tokio wakes another thread to
//! drive the runtime and takes the worker back afterwards). That handoff
//! was most of what a plugin cost a small request: a 1-row get through the
//! bundled packing chain took 50.4 µs of round trip in the Rust-core
//! client against 38.2 µs with the built-in policies, and 38.3 µs once
//! entered on the worker (release stowd on the client's CPU, medians of
//! 3,000 gets; `docs/benchmarks.md`, "Entering plugins on the worker").
//!
//! A policy needs no WASI at all to decide (it has no files, clock or
//! network); only a guest that panics writes its message to stderr. So a
//! call first runs on the worker with that panic caught: if WASI asked for
//! tokio, the instance is thrown away (it stopped in the middle of a host
//! call), the plugin is marked, and the call runs again from the start on a
//! fresh instance, off the runtime, as before; every later call of that
//! plugin goes off the runtime at once. A call is a pure function of its
//! arguments and the instance's state, so running it again gives the same
//! answer (and a guest that panicked panics again, now with its message
//! captured). Any other panic is resumed as it was.
//!
//! A call on the worker holds that worker's other tasks for as long as it
//! runs, so there it gets at most [`WORKER_FUEL`] (about 1.2 ms of a tight
//! Wasm loop here: `infinite-loop` burnt 400M fuel in 48 ms; a decision
//! takes microseconds). A call that runs out of that budget is not
//! a fault: its instance is thrown away, the plugin is marked the same way,
//! and the call runs again off the runtime with the plugin's whole budget
//! (where it may still run out of fuel, and fault, as any call).

use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Once;
use std::sync::atomic::{AtomicBool, Ordering};

/// The words of tokio's panic when something blocks on a runtime from
/// inside it (tokio 1.x `runtime::context::enter_runtime`).
const IN_RUNTIME: &str = "Cannot start a runtime from within a runtime";

/// Fuel a call may burn on a tokio worker before it is run again off the
/// runtime (about 1.2 ms of a tight Wasm loop on the benchmark machine).
pub const WORKER_FUEL: u64 = 10_000_000;

thread_local! {
    /// Set while this thread runs a plugin on a tokio worker: the panic hook
    /// leaves tokio's in-runtime panic unprinted there (it is caught), and
    /// a call gets at most WORKER_FUEL.
    static ON_WORKER: Cell<bool> = const { Cell::new(false) };
    /// Set when a call on the worker ran out of WORKER_FUEL.
    static CUT_SHORT: Cell<bool> = const { Cell::new(false) };
}

/// The fuel a call starts with, of the plugin's `full` budget.
pub fn fuel(full: u64) -> u64 {
    if ON_WORKER.get() {
        full.min(WORKER_FUEL)
    } else {
        full
    }
}

/// Whether a call that ran out of fuel ran out of the worker's budget
/// only (it then runs again off the runtime, and is not a fault); once
/// true, every further call of this try answers the same at once.
pub fn cut_short(full: u64) -> bool {
    let cut = ON_WORKER.get() && full > WORKER_FUEL;
    if cut {
        CUT_SHORT.set(true);
    }
    cut
}

/// Whether this try was already cut short (the rest of it is not run).
pub fn was_cut_short() -> bool {
    ON_WORKER.get() && CUT_SHORT.get()
}

/// Whether a plugin has needed tokio from WASI, or more than the worker's
/// fuel (then it is entered off the runtime from then on).
#[derive(Debug, Default)]
pub(super) struct Entry {
    needs_tokio: AtomicBool,
}

impl Entry {
    /// Runs `f` on `instance` (the plugin's instance slot) on this thread
    /// if it can, else (a plugin that needs tokio from WASI) with
    /// [`off_runtime`]. Before a retry the slot is emptied: the instance the
    /// first try stopped in is never entered again.
    pub fn run<T: Send, R: Send>(
        &self,
        instance: &mut Option<T>,
        mut f: impl FnMut(&mut Option<T>) -> R + Send,
    ) -> R {
        let on_worker = matches!(
            tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()),
            Ok(tokio::runtime::RuntimeFlavor::MultiThread)
        );
        if on_worker && !self.needs_tokio.load(Ordering::Relaxed) {
            quiet_in_runtime_panics();
            ON_WORKER.set(true);
            CUT_SHORT.set(false);
            let tried = catch_unwind(AssertUnwindSafe(|| f(instance)));
            ON_WORKER.set(false);
            match tried {
                Ok(r) if !CUT_SHORT.get() => return r,
                Ok(_) => {
                    *instance = None;
                    self.needs_tokio.store(true, Ordering::Relaxed);
                    tracing::debug!(
                        "a plugin call ran past the worker's fuel: it is entered off the runtime from now on"
                    );
                }
                Err(panic) if panic_text(&*panic).is_some_and(|t| t.contains(IN_RUNTIME)) => {
                    *instance = None;
                    self.needs_tokio.store(true, Ordering::Relaxed);
                    tracing::debug!(
                        "a plugin's WASI call needs tokio: it is entered off the runtime from now on"
                    );
                }
                Err(panic) => resume_unwind(panic),
            }
        }
        off_runtime(|| f(instance))
    }

    /// Whether calls go off the runtime (a plugin that needed tokio, or
    /// more than the worker's fuel).
    pub fn needs_tokio(&self) -> bool {
        self.needs_tokio.load(Ordering::Relaxed)
    }
}

fn panic_text(panic: &(dyn std::any::Any + Send)) -> Option<&str> {
    panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
}

/// Installs, once, a panic hook that prints every panic as the hook before
/// it did, except tokio's in-runtime panic on a thread inside [`Entry::run`]
/// (caught there and answered by a retry, not a fault).
fn quiet_in_runtime_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let caught = ON_WORKER.get()
                && panic_text(info.payload()).is_some_and(|t| t.contains(IN_RUNTIME));
            if !caught {
                previous(info);
            }
        }));
    });
}

/// Runs `f` where WASI's synchronous host calls may run their own tokio
/// runtime: on this thread when it is outside tokio, on a scoped helper
/// thread when called from a tokio task.
///
/// On a multi-thread runtime (stowd's) this is `block_in_place`, which lets
/// the closure block on a runtime without a thread spawn; on a
/// current-thread runtime, a scoped thread.
pub fn off_runtime<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Err(_) => f(),
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        Ok(_) => {
            std::thread::scope(|s| s.spawn(f).join()).unwrap_or_else(|panic| resume_unwind(panic))
        }
    }
}
