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
/// [`Spin::REST`] waits on this connection sleep at once, so a connection
/// whose replies come slowly (large gets, a busy stowd) burns little.
pub(crate) struct Spin {
    window: Duration,
    /// Waits left that sleep without spinning first.
    rest: u32,
}

impl Spin {
    const REST: u32 = 8;

    pub(crate) fn new(window: Duration) -> Spin {
        Spin { window, rest: 0 }
    }

    /// Polls `fd` for readable bytes (or an error or end of stream, which
    /// the next `recv` reports) for up to the window, never past
    /// `deadline`: whether it became readable.
    pub(crate) fn wait(&mut self, fd: i32, deadline: Instant) -> bool {
        if self.window.is_zero() {
            return false;
        }
        if self.rest > 0 {
            self.rest -= 1;
            return false;
        }
        let until = (Instant::now() + self.window).min(deadline);
        let mut b = 0u8;
        loop {
            // SAFETY: a peek of at most one byte into `b`, alive for the call.
            let n = unsafe {
                libc::recv(
                    fd,
                    (&mut b as *mut u8).cast(),
                    1,
                    libc::MSG_DONTWAIT | libc::MSG_PEEK,
                )
            };
            if n >= 0 || std::io::Error::last_os_error().kind() != std::io::ErrorKind::WouldBlock {
                return true;
            }
            if Instant::now() >= until {
                self.rest = Spin::REST;
                return false;
            }
            // SAFETY: no arguments; gives the CPU to anything runnable.
            unsafe { libc::sched_yield() };
        }
    }
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
            e if e.kind() == std::io::ErrorKind::Interrupted => Ok(()),
            e => Err(Fail::Io(e.to_string())),
        },
        _ => Ok(()),
    }
}
