//! Waiting for the socket: [`Spin`], polling for a reply a short while
//! before sleeping, and [`wait`], a `poll(2)` until the deadline.

use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use crate::error::Fail;

/// How long a reply is awaited by polling the socket, before sleeping in
/// `poll` (`Client(spin_us=...)`, default 200 µs).
///
/// Why: on the benchmark machine (a 2-vCPU VM) waking a process that sleeps
/// on another CPU costs 50-70 µs, and a small call pays it twice (stowd
/// woken by the request, the client by the reply). A client that is still
/// running when the reply comes does not pay its half: a 1-row get across
/// two CPUs took 157-233 µs sleeping and 108-131 µs spinning
/// (docs/benchmarks.md, "Spinning for the reply"). Each turn of the spin gives the
/// CPU away (`sched_yield`), so on a shared CPU stowd, or anything else
/// runnable, goes first. A wait the spin did not catch makes the next
/// receives on this connection sleep at once ([`Spin::REST`] of them,
/// [`Spin::sleeps`]; a sync client's in one blocking `recv`), so a
/// connection whose replies come slowly (large gets, a busy stowd) burns
/// little.
///
/// A turn whose `sched_yield` came back after [`Spin::CROWDED`] (1 ms) means
/// another process held this CPU for its time slice (a few ms): each turn
/// of a spin would then cost a slice where a sleeping client, woken by the
/// reply, preempts it. Such a spin ends there, and the next waits sleep at
/// once, twice as many each time it happens again (up to
/// [`Spin::REST_MAX`]), until a spin catches a reply uncrowded. Measured: a
/// 64 KiB async get across two CPUs, with a build running on the client's
/// CPU, took 3.8 ms at the median spinning through slices against 0.22 ms
/// sleeping (docs/benchmarks.md, "The AsyncClient's spin").
pub(crate) struct Spin {
    window: Duration,
    /// Waits left that sleep without spinning first.
    rest: u32,
    /// The rest after the next crowded spin.
    backoff: u32,
    /// A `sched_yield` longer than this found the CPU crowded
    /// ([`Spin::CROWDED`], or `$STOWAGE_SPIN_CROWDED_US`).
    crowded: Duration,
}

/// What a spin's poll found.
pub(crate) enum Turn {
    /// What it waits for is here.
    Ready,
    /// Not yet: poll again.
    NotYet,
    /// Not worth polling for (a reader that may wait will take it).
    Stop,
}

impl Spin {
    const REST: u32 = 8;
    const REST_MAX: u32 = 1024;
    /// A `sched_yield` longer than this gave the CPU to another process's
    /// time slice (the kernel's slices are ms; stowd answering a small call
    /// on the same CPU takes tens of µs). `$STOWAGE_SPIN_CROWDED_US`
    /// overrides it, read when a connection is made.
    const CROWDED: Duration = Duration::from_millis(1);

    pub(crate) fn new(window: Duration) -> Spin {
        let crowded = std::env::var("STOWAGE_SPIN_CROWDED_US")
            .ok()
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map_or(Spin::CROWDED, Duration::from_micros);
        Spin {
            window,
            rest: 0,
            backoff: Spin::REST,
            crowded,
        }
    }

    /// Whether the next receive sleeps without spinning (no window, or a
    /// rest after a missed spin): then it counts as one of the rest's
    /// waits, whether or not the reply had come.
    pub(crate) fn sleeps(&mut self) -> bool {
        if self.window.is_zero() {
            return true;
        }
        if self.rest > 0 {
            self.rest -= 1;
            return true;
        }
        false
    }

    /// Waits left that return at once, without spinning.
    pub(crate) fn rest(&self) -> u32 {
        self.rest
    }

    /// Polls `fd` for readable bytes (or an error or end of stream, which
    /// the next `recv` reports) for up to the window, never past
    /// `deadline`: whether it became readable.
    pub(crate) fn wait(&mut self, fd: i32, deadline: Instant) -> bool {
        self.poll(deadline, || {
            if readable(fd) {
                Turn::Ready
            } else {
                Turn::NotYet
            }
        })
    }

    /// Calls `ready` until it says [`Turn::Ready`] (true) or
    /// [`Turn::Stop`] (false), giving the CPU away between calls, for up
    /// to the window, never past `deadline`; false once the window has
    /// passed (the next [`Spin::REST`] calls then return false at once) or
    /// a turn found the CPU crowded (see the type's doc).
    pub(crate) fn poll(&mut self, deadline: Instant, mut ready: impl FnMut() -> Turn) -> bool {
        if self.window.is_zero() {
            return false;
        }
        if self.rest > 0 {
            self.rest -= 1;
            return false;
        }
        let until = (Instant::now() + self.window).min(deadline);
        loop {
            match ready() {
                Turn::Ready => {
                    self.backoff = Spin::REST;
                    return true;
                }
                Turn::Stop => return false,
                Turn::NotYet => {}
            }
            let turn = Instant::now();
            if turn >= until {
                self.rest = Spin::REST;
                return false;
            }
            // SAFETY: no arguments; gives the CPU to anything runnable.
            unsafe { libc::sched_yield() };
            if turn.elapsed() > self.crowded {
                self.rest = self.backoff;
                self.backoff = (self.backoff * 2).min(Spin::REST_MAX);
                return matches!(ready(), Turn::Ready);
            }
        }
    }
}

/// Whether socket `fd` has bytes to read now (or an error or end of
/// stream, which the next `recv` reports).
pub(crate) fn readable(fd: i32) -> bool {
    let mut b = 0u8;
    // SAFETY: a peek of at most one byte into `b`, alive for the call.
    let n = unsafe {
        libc::recv(
            fd,
            (&mut b as *mut u8).cast(),
            1,
            libc::MSG_DONTWAIT | libc::MSG_PEEK,
        )
    };
    n >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock
}

/// Waits until the socket is ready for `events` (or reports an error,
/// which the next read or write returns), or the deadline: then a timeout
/// saying `late`.
pub(crate) fn wait(
    sock: &impl AsRawFd,
    deadline: Instant,
    events: libc::c_short,
    late: &str,
) -> Result<(), Fail> {
    let left = deadline
        .checked_duration_since(Instant::now())
        .filter(|d| !d.is_zero())
        .ok_or_else(|| Fail::Timeout(late.into()))?;
    // Rounded up: a wait never ends just short of the deadline to spin.
    let ms = left.as_millis().saturating_add(1).min(i32::MAX as u128) as i32;
    let mut fd = libc::pollfd {
        fd: sock.as_raw_fd(),
        events,
        revents: 0,
    };
    // SAFETY: one valid pollfd, alive for the call.
    match unsafe { libc::poll(&mut fd, 1, ms) } {
        0 => Err(Fail::Timeout(late.into())),
        -1 => match std::io::Error::last_os_error() {
            e if e.kind() == std::io::ErrorKind::Interrupted => crate::error::interrupted(),
            e => Err(Fail::Io(e.to_string())),
        },
        _ => Ok(()),
    }
}
