//! The connection table of one listening socket: who is connected, since
//! when each connection last did anything, and who goes when it is full.
//!
//! A client is admitted by [`Table::admit`] right after `accept`:
//! - when its peer address already has [`Limits::max_connections_per_peer`]
//!   connections, that address's connection idle the longest is evicted to
//!   make room; only when every one of them is busy is the new client
//!   refused (ipc clients have no address and no cap). Every local client
//!   comes from 127.0.0.1, so without this eviction one stuck process
//!   holding idle connections would lock every other client of its node
//!   out;
//! - when the table holds [`Limits::max_connections`], the connection idle
//!   the longest is evicted to make room; only when every connection is
//!   busy is the new client refused. That eviction is the guarantee: open
//!   connections that do nothing never keep a new client out.
//!
//! "Busy" is a request being handled or its reply being written. Every
//! other connection is idle since the last byte it sent (or its reply was
//! written): one still handshaking, one waiting for its next request, and
//! one in the middle of sending a request. A live upload therefore has an
//! idle age of milliseconds and is the last candidate, while one that
//! stalled (or drips a byte a minute) is among the first.
//!
//! Each connection also closes itself after [`Limits::idle_timeout`] idle
//! ([`Activity::idle_expired`]). libzmq clients (pyzmq, TransferQueue)
//! reconnect by themselves, so closing an idle connection costs the client
//! one reconnect, not an error.
//!
//! Finding the victim is a scan of the table (at most `max_connections`
//! entries, done only when it or the peer's share is full); a heap ordered by activity would
//! need updating on every byte received, which is the common path.
//!
//! WARN lines for refused and evicted clients are limited to one a second
//! per table, the next one saying how many were not logged: a peer
//! reconnecting in a loop cannot flood the log.

use std::collections::HashMap;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::Notify;

use crate::Limits;

/// The connections of one listening socket.
#[derive(Debug)]
pub struct Table {
    max: usize,
    per_peer: usize,
    epoch: Instant,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    next_id: u64,
    conns: HashMap<u64, Slot>,
    by_peer: HashMap<IpAddr, usize>,
    last_warn: Option<Instant>,
    unlogged: u64,
}

#[derive(Debug)]
struct Slot {
    peer: Option<IpAddr>,
    activity: Arc<Activity>,
}

/// What one connection is doing, shared by its task and the table.
#[derive(Debug)]
pub struct Activity {
    epoch: Instant,
    /// Milliseconds from `epoch` to the last byte received or reply sent.
    last: AtomicU64,
    busy: AtomicBool,
    evicted: AtomicBool,
    wake: Notify,
}

impl Activity {
    fn new(epoch: Instant) -> Activity {
        let a = Activity {
            epoch,
            last: AtomicU64::new(0),
            busy: AtomicBool::new(false),
            evicted: AtomicBool::new(false),
            wake: Notify::new(),
        };
        a.touch();
        a
    }

    /// Marks activity now.
    pub fn touch(&self) {
        let ms = self.epoch.elapsed().as_millis() as u64;
        self.last.fetch_max(ms, Ordering::Relaxed);
    }

    /// Marks the connection busy (a request handled) or idle (its reply
    /// written); both count as activity.
    pub fn set_busy(&self, busy: bool) {
        self.busy.store(busy, Ordering::Relaxed);
        self.touch();
    }

    /// How long since the last activity.
    pub fn idle_for(&self) -> Duration {
        let now = self.epoch.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last.load(Ordering::Relaxed)))
    }

    fn is_busy(&self) -> bool {
        self.busy.load(Ordering::Relaxed)
    }

    /// Resolves when the table evicted this connection.
    pub async fn evicted(&self) {
        loop {
            let notified = self.wake.notified();
            if self.evicted.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    /// Resolves once the connection has been idle for `timeout` (never
    /// when `timeout` is zero). Activity in between pushes it back.
    pub async fn idle_expired(&self, timeout: Duration) {
        if timeout.is_zero() {
            return std::future::pending().await;
        }
        loop {
            if self.is_busy() {
                // Not idle; its reply, once written, counts as activity.
                tokio::time::sleep(timeout).await;
                continue;
            }
            let idle = self.idle_for();
            if idle >= timeout {
                return;
            }
            tokio::time::sleep(timeout - idle).await;
        }
    }
}

/// Why a client was not admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Its address already has this many connections, all busy.
    PeerCap(usize),
    /// The table is full and every connection in it is busy.
    AllBusy(usize),
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::PeerCap(n) => write!(
                f,
                "all {n} connections from this address are busy (limits.max_connections_per_peer)"
            ),
            Refusal::AllBusy(n) => {
                write!(f, "all {n} connections are busy (limits.max_connections)")
            }
        }
    }
}

/// An admitted connection; dropping it frees its place.
#[derive(Debug)]
pub struct Entry {
    table: Arc<Table>,
    id: u64,
    /// Shared with the table.
    pub activity: Arc<Activity>,
}

impl Entry {
    /// The connection's number in the table (never reused).
    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let mut inner = self.table.inner.lock().expect("connection table");
        if let Some(slot) = inner.conns.remove(&self.id) {
            inner.release(slot.peer);
        }
    }
}

impl Inner {
    fn release(&mut self, peer: Option<IpAddr>) {
        if let Some(p) = peer
            && let Some(n) = self.by_peer.get_mut(&p)
        {
            *n -= 1;
            if *n == 0 {
                self.by_peer.remove(&p);
            }
        }
    }

    /// The connection among those `which` picks that has been idle the
    /// longest; never a busy one.
    fn longest_idle(&self, which: impl Fn(&Slot) -> bool) -> Option<u64> {
        self.conns
            .iter()
            .filter(|(_, s)| which(s) && !s.activity.is_busy())
            .max_by_key(|(_, s)| s.activity.idle_for())
            .map(|(id, _)| *id)
    }

    /// Closes connection `victim` to make room for a client from
    /// `new_peer`, and logs why (`reason`, and the `limit` reached).
    fn evict(&mut self, victim: u64, new_peer: Option<IpAddr>, limit: usize, reason: &'static str) {
        let slot = self.conns.remove(&victim).expect("victim present");
        self.release(slot.peer);
        slot.activity.evicted.store(true, Ordering::Release);
        slot.activity.wake.notify_one();
        if let Some(unlogged) = self.may_warn() {
            tracing::warn!(
                peer = %show(slot.peer),
                idle = ?slot.activity.idle_for(),
                new_peer = %show(new_peer),
                limit,
                reason,
                unlogged,
                "connection evicted"
            );
        }
    }

    /// Whether a WARN may be logged now; counts the ones that may not.
    fn may_warn(&mut self) -> Option<u64> {
        let now = Instant::now();
        match self.last_warn {
            Some(t) if now.duration_since(t) < Duration::from_secs(1) => {
                self.unlogged += 1;
                None
            }
            _ => {
                self.last_warn = Some(now);
                Some(std::mem::take(&mut self.unlogged))
            }
        }
    }
}

fn show(peer: Option<IpAddr>) -> String {
    peer.map_or_else(|| "local (ipc)".into(), |p| p.to_string())
}

impl Table {
    /// A table with `limits`' caps (a per-peer cap of 0: none).
    pub fn new(limits: &Limits) -> Arc<Table> {
        Arc::new(Table {
            max: limits.max_connections.max(1),
            per_peer: limits.max_connections_per_peer,
            epoch: Instant::now(),
            inner: Mutex::new(Inner::default()),
        })
    }

    /// Connections in the table.
    pub fn len(&self) -> usize {
        self.inner.lock().expect("connection table").conns.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Admits a client from `peer`, evicting the longest idle connection
    /// of that peer if it has its cap, or of the table if the table is
    /// full, or says why not. Logs evictions and refusals.
    pub fn admit(self: &Arc<Table>, peer: Option<IpAddr>) -> Result<Entry, Refusal> {
        let mut inner = self.inner.lock().expect("connection table");
        if let Some(p) = peer
            && self.per_peer > 0
            && inner.by_peer.get(&p).copied().unwrap_or(0) >= self.per_peer
        {
            let Some(victim) = inner.longest_idle(|s| s.peer == Some(p)) else {
                let refusal = Refusal::PeerCap(self.per_peer);
                if let Some(unlogged) = inner.may_warn() {
                    tracing::warn!(peer = %p, reason = %refusal, unlogged, "connection refused");
                }
                return Err(refusal);
            };
            inner.evict(
                victim,
                peer,
                self.per_peer,
                "peer at its cap (limits.max_connections_per_peer): its longest idle \
                 connection makes room",
            );
        }
        if inner.conns.len() >= self.max {
            let Some(victim) = inner.longest_idle(|_| true) else {
                let refusal = Refusal::AllBusy(self.max);
                if let Some(unlogged) = inner.may_warn() {
                    tracing::warn!(peer = %show(peer), reason = %refusal, unlogged, "connection refused");
                }
                return Err(refusal);
            };
            inner.evict(
                victim,
                peer,
                self.max,
                "table full (limits.max_connections): the longest idle connection makes room",
            );
        }
        let id = inner.next_id;
        inner.next_id += 1;
        let activity = Arc::new(Activity::new(self.epoch));
        inner.conns.insert(
            id,
            Slot {
                peer,
                activity: activity.clone(),
            },
        );
        if let Some(p) = peer {
            *inner.by_peer.entry(p).or_default() += 1;
        }
        Ok(Entry {
            table: self.clone(),
            id,
            activity,
        })
    }
}

/// A reader that marks activity on every byte received.
pub struct Tracked<R> {
    inner: R,
    activity: Arc<Activity>,
}

impl<R> Tracked<R> {
    pub fn new(inner: R, activity: Arc<Activity>) -> Tracked<R> {
        Tracked { inner, activity }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Tracked<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

/// Raises this process's soft limit of open files to its hard limit and
/// returns the soft limit now in force. Every connection is a file: 1,024
/// connections on each of several endpoints do not fit in the common
/// default soft limit of 1,024.
pub fn raise_open_files_limit() -> std::io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit only reads the struct.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        lim = raised;
    }
    #[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux, not everywhere
    Ok(lim.rlim_cur as u64)
}

#[cfg(test)]
mod tests;
