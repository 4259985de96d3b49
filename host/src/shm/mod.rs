//! Same-node shared memory: segments that `stowd` owns and hands to
//! clients on the same node as file descriptors, never by name.
//!
//! A segment is an anonymous memory file (`memfd_create`): it has no path,
//! so no other process can open, guess or pre-create it. Its descriptor
//! goes only to the client that asked, over that client's descriptor
//! channel ([`channel`], a Unix socket in a private directory, with
//! `SCM_RIGHTS`).
//!
//! **After a put is acknowledged, no process but `stowd` can change its
//! bytes, and the kernel enforces it:** a segment that holds stored rows is
//! sealed (`F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`)
//! before any reader gets it. A sealed file cannot be written through any
//! descriptor (`write`, `fallocate`, a writable shared mapping, a
//! descriptor reopened through `/proc/self/fd` with `O_RDWR`), resized, or
//! unsealed. Readers get a descriptor opened read-only. Private
//! (copy-on-write) mappings stay allowed: a reader that writes to its own
//! private mapping changes only its own copy of the pages it touches.
//!
//! Two ways in:
//! - get: an extent ([`crate::extent`]) that is not yet in a segment is
//!   copied into a new one once ([`SegmentStore::export`], called by
//!   [`crate::extent::share_all`]), sealed, and from then on every
//!   same-node get of its rows gets that segment's descriptor: zero-copy,
//!   the same pages for every reader;
//! - put: a client leases a segment ([`SegmentStore::lease`]); its
//!   writable descriptor goes over the client's channel; the client maps
//!   it, writes, unmaps, and puts descriptors naming it. `stowd` seals it
//!   ([`SegmentStore::adopt`]): sealing fails while any process still maps
//!   it writable (`EBUSY`), and then the put is refused, so a writer that
//!   kept its mapping can never change rows after `put_ok`. A lease not
//!   put before it expires is dropped by [`SegmentStore::sweep`] (once a
//!   second), and the leases of a connection that ended at once
//!   ([`SegmentStore::release_connection`]).
//!
//! No reuse: a segment some reader got may be mapped by it for as long as
//! it likes, and no kernel interface tells who maps a file, so the memory
//! of cleared rows is never rewritten: a segment's pages are freed when
//! its last row is cleared and the last reader's mapping goes. (The
//! earlier design kept cleared segment files for reuse under an `flock`
//! convention; a reader that skipped the lock, or a writer that kept its
//! mapping, could then see or change another client's rows.) A new
//! segment's pages are allocated in one go ([`allocate`]), ahead of time
//! when the store is idle ([`Prealloc`]).
//!
//! Each live segment keeps one descriptor open in `stowd` (to hand to
//! readers), and so does each lease until it is put, void or expired;
//! `stowd` raises its soft `RLIMIT_NOFILE` to the hard limit at start
//! ([`crate::sys::raise_nofile`]). Leases are counted as well as their
//! bytes ([`SegmentStore::with_lease_counts`]): a client leasing one byte
//! at a time would otherwise take every descriptor, and then no new
//! connection could be accepted.

pub mod channel;
mod prealloc;

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use memmap2::{Mmap, MmapOptions};
use rustix::fs::{FallocateFlags, MemfdFlags, SealFlags};

pub use channel::Channels;
pub use prealloc::Prealloc;

/// Shared-memory failures.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    #[error("shared memory is not enabled on this stowd")]
    Disabled,
    #[error("shared memory: {what}: {source}")]
    Io {
        what: &'static str,
        source: io::Error,
    },
    #[error("[shm] dir {path}: {why}", path = path.display())]
    UntrustedDir {
        path: std::path::PathBuf,
        why: String,
    },
    #[error("unknown or expired lease {0:?}")]
    UnknownLease(String),
    #[error("lease {0:?} was granted to another connection: only that connection may put it")]
    NotYourLease(String),
    #[error("lease of {asked} bytes exceeds the {limit}-byte limit ([shm] max_lease_bytes)")]
    TooLarge { asked: u64, limit: u64 },
    #[error(
        "lease of {asked} bytes refused: {outstanding} bytes are leased and not yet put, \
         and [shm] max_leased_bytes is {limit}"
    )]
    LeaseQuota {
        asked: u64,
        outstanding: u64,
        limit: u64,
    },
    #[error(
        "lease of {asked} bytes refused: this connection has {outstanding} bytes leased and \
         not yet put, and [shm] max_connection_leased_bytes is {limit}"
    )]
    ConnectionLeaseQuota {
        asked: u64,
        outstanding: u64,
        limit: u64,
    },
    #[error(
        "lease refused: {outstanding} leases are granted and not yet put or expired, and \
         [shm] max_leases is {limit} (each keeps a descriptor open in stowd)"
    )]
    LeaseCount { outstanding: usize, limit: usize },
    #[error(
        "lease refused: this connection has {outstanding} leases granted and not yet put or \
         expired, and [shm] max_connection_leases is {limit}"
    )]
    ConnectionLeaseCount { outstanding: usize, limit: usize },
    #[error("range {offset}+{len} is outside segment {name} of {size} bytes")]
    OutOfRange {
        name: String,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error(
        "segment {0:?} is still mapped writable (or pinned) by some process: unmap it before \
         the put; the lease is void, ask for a new one"
    )]
    StillMapped(String),
    #[error(
        "segment {0:?} was changed by its writer beyond writing (resized or sealed): the lease \
         is void, ask for a new one"
    )]
    Tampered(String),
    #[error("a same-node {0} needs the envelope key `channel` (the token of a descriptor channel)")]
    NoChannel(&'static str),
    #[error("no descriptor channel has token {0:?} (closed, or never opened on this stowd)")]
    UnknownChannel(String),
    #[error("descriptor channel: {0}")]
    Channel(String),
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> ShmError {
    move |source| ShmError::Io { what, source }
}

/// A sealed segment: a memory file nobody can write any more. Unmapped,
/// and its descriptor closed, when the last `Bytes` over it and the last
/// [`Handle`] go.
struct Segment {
    /// None for an empty segment (nothing to map).
    map: Option<Mmap>,
    /// Opened read-only: what readers get.
    fd: OwnedFd,
    name: Arc<str>,
    live: Arc<AtomicU64>,
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The owner behind every `Bytes` of a segment.
struct SegmentRef(Arc<Segment>);

impl AsRef<[u8]> for SegmentRef {
    fn as_ref(&self) -> &[u8] {
        self.0.map.as_deref().unwrap_or_default()
    }
}

/// A sealed segment, as a reply names it and hands its descriptor over.
#[derive(Clone)]
pub struct Handle(Arc<Segment>);

impl Handle {
    /// The name replies give it (unique within this `stowd`).
    pub fn name(&self) -> &Arc<str> {
        &self.0.name
    }

    /// Its read-only descriptor.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.0.fd.as_fd()
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.0.map.as_ref().map_or(0, |m| m.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::fmt::Debug for Handle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Handle").field(&self.0.name).finish()
    }
}

/// A lease: a writable memory file a client fills.
struct Lease {
    file: File,
    len: u64,
    deadline: Instant,
    /// The connection that asked for it (`transport::Caller::connection`):
    /// the only one that may put it.
    owner: u64,
}

/// The segments of one `stowd` process.
pub struct SegmentStore {
    next: AtomicU64,
    /// Live (sealed, mapped) segments.
    live: Arc<AtomicU64>,
    leases: Mutex<HashMap<String, Lease>>,
    lease_ttl: Duration,
    max_lease: u64,
    /// Most bytes of all outstanding leases together.
    max_leased: u64,
    /// Most bytes of the outstanding leases of one connection.
    max_connection_leased: u64,
    /// Most outstanding leases together: each holds a descriptor.
    max_leases: usize,
    /// Most outstanding leases of one connection.
    max_connection_leases: usize,
    /// Memory files allocated ahead of time for new segments.
    prealloc: Arc<Prealloc>,
}

impl std::fmt::Debug for SegmentStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentStore")
            .field("live", &self.live)
            .finish()
    }
}

/// A new memory file of `len` bytes that can be sealed.
fn memfd(len: u64) -> Result<File, ShmError> {
    let fd = rustix::fs::memfd_create(
        "stowd-segment",
        MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING,
    )
    .map_err(|e| io_err("memfd_create")(e.into()))?;
    let file = File::from(fd);
    file.set_len(len).map_err(io_err("sizing a segment"))?;
    Ok(file)
}

/// Allocates the pages of a new segment in one go: writes into them then
/// only copy (`fallocate` ran at 2.5-4.9 GB/s and `pwrite` into allocated
/// pages at 3.4 GB/s on the development VM, against 0.45-0.6 GB/s for
/// `pwrite` into a fresh memory file and 1.3 GB/s for faulting pages in
/// through a mapping), and running out of memory fails here, not halfway.
fn allocate(file: &File, len: u64) -> Result<(), ShmError> {
    if len == 0 {
        return Ok(());
    }
    rustix::fs::fallocate(file, FallocateFlags::empty(), 0, len)
        .map_err(|e| io_err("allocating a segment")(e.into()))
}

/// Seals `file` for good: no write, no resize, no further seal.
fn seal(file: &File, name: &str) -> Result<(), ShmError> {
    let seals = SealFlags::WRITE | SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL;
    match rustix::fs::fcntl_add_seals(file, seals) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::BUSY) => Err(ShmError::StillMapped(name.into())),
        // The writer sealed it first (F_SEAL_SEAL): refuse it.
        Err(rustix::io::Errno::PERM) => Err(ShmError::Tampered(name.into())),
        Err(e) => Err(io_err("sealing a segment")(e.into())),
    }
}

/// The same memory file, opened again read-only: what readers get. Falls
/// back to the sealed read-write descriptor where `/proc` is missing (it
/// cannot write either).
fn read_only(file: File) -> OwnedFd {
    match File::open(format!("/proc/self/fd/{}", file.as_raw_fd())) {
        Ok(ro) => ro.into(),
        Err(e) => {
            tracing::debug!(error = %e, "no /proc/self/fd: readers get the sealed descriptor");
            file.into()
        }
    }
}

impl SegmentStore {
    /// A store whose leases last `lease_ttl` unused, each at most
    /// `max_lease` bytes.
    pub fn new(lease_ttl: Duration, max_lease: u64) -> SegmentStore {
        SegmentStore {
            next: AtomicU64::new(1),
            live: Arc::default(),
            leases: Mutex::default(),
            lease_ttl,
            max_lease,
            max_leased: u64::MAX,
            max_connection_leased: u64::MAX,
            max_leases: usize::MAX,
            max_connection_leases: usize::MAX,
            prealloc: Prealloc::start(0, Duration::ZERO),
        }
    }

    /// Keeps up to `cap` bytes of memory files allocated ahead of time, of
    /// the sizes recent leases and exports asked for, each freed after
    /// `idle` unused ([`Prealloc`]); 0 allocates on demand only.
    pub fn with_prealloc(mut self, cap: u64, idle: Duration) -> SegmentStore {
        self.prealloc.stop();
        self.prealloc = Prealloc::start(cap, idle);
        self
    }

    /// A new memory file of `len` bytes, its pages allocated: one made
    /// ahead of time if one fits.
    fn fresh_file(&self, len: u64) -> Result<File, ShmError> {
        if let Some(file) = self.prealloc.take(len) {
            return Ok(file);
        }
        let file = memfd(len)?;
        allocate(&file, len)?;
        Ok(file)
    }

    /// Notes that a request used shared memory now (a same-node get): the
    /// memory allocated ahead waits for a quiet spell.
    pub fn touch(&self) {
        self.prealloc.touch();
    }

    /// Bytes allocated ahead of time and ready, and how many leases and
    /// exports took such a file.
    pub fn prealloc(&self) -> (u64, u64) {
        (
            self.prealloc.bytes(),
            self.prealloc.hits.load(Ordering::Relaxed),
        )
    }

    /// At most `total` bytes of leases granted and not yet adopted or
    /// expired, together (each still at most the per-lease limit).
    pub fn with_lease_quota(mut self, total: u64) -> SegmentStore {
        self.max_leased = total;
        self
    }

    /// At most `total` bytes of leases granted to one connection and not
    /// yet adopted or expired.
    pub fn with_connection_lease_quota(mut self, total: u64) -> SegmentStore {
        self.max_connection_leased = total;
        self
    }

    /// At most `total` leases granted and not yet adopted or expired,
    /// together, and at most `per_connection` of them to one connection,
    /// whatever their bytes: each keeps a descriptor open in `stowd`
    /// until it ends, and descriptors are what connections need too.
    pub fn with_lease_counts(mut self, total: usize, per_connection: usize) -> SegmentStore {
        self.max_leases = total;
        self.max_connection_leases = per_connection;
        self
    }

    fn fresh_name(&self) -> String {
        format!("s{:x}", self.next.fetch_add(1, Ordering::Relaxed))
    }

    /// Seals `file`, checks it is `len` bytes, and maps it read-only as a
    /// live segment.
    fn sealed(&self, file: File, name: String, len: u64) -> Result<(Bytes, Handle), ShmError> {
        seal(&file, &name)?;
        self.map_sealed(file, name, len)
    }

    /// [`Self::sealed`] for a file already sealed.
    fn map_sealed(&self, file: File, name: String, len: u64) -> Result<(Bytes, Handle), ShmError> {
        // Sealed: the size can no longer change under us.
        let size = file.metadata().map_err(io_err("sizing a segment"))?.len();
        if size != len {
            return Err(ShmError::Tampered(name));
        }
        let fd = read_only(file);
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the file is sealed against writes, shrinking and
            // growing (checked just above): its bytes never change and no
            // access can fault for want of pages.
            Some(
                unsafe { MmapOptions::new().len(len as usize).map(&fd) }
                    .map_err(io_err("mapping a segment"))?,
            )
        };
        self.live.fetch_add(1, Ordering::Relaxed);
        let segment = Arc::new(Segment {
            map,
            fd,
            name: Arc::from(name),
            live: self.live.clone(),
        });
        let handle = Handle(segment.clone());
        Ok((Bytes::from_owner(SegmentRef(segment)), handle))
    }

    /// Copies `parts` back to back into one new sealed segment; returns
    /// its bytes (a read-only mapping) and its handle.
    pub fn export(&self, parts: &[&[u8]]) -> Result<(Bytes, Handle), ShmError> {
        let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
        let file = self.fresh_file(total)?;
        let mut at = 0u64;
        for p in parts {
            file.write_all_at(p, at)
                .map_err(io_err("writing a segment"))?;
            at += p.len() as u64;
        }
        let sealed = self.sealed(file, self.fresh_name(), total);
        self.prealloc.touch();
        sealed
    }

    /// Creates a segment of `len` bytes (its pages allocated) for a client
    /// to fill: returns its name, the lease's time to live and a writable
    /// descriptor for the client. It must be adopted by the same `owner`
    /// (the connection that asked) before the lease expires.
    pub fn lease(&self, len: u64, owner: u64) -> Result<(String, Duration, OwnedFd), ShmError> {
        if len > self.max_lease {
            return Err(ShmError::TooLarge {
                asked: len,
                limit: self.max_lease,
            });
        }
        self.sweep();
        self.prealloc.touch();
        // Checked before the memory is allocated (a lease that will be
        // refused allocates nothing), and again, under the same lock as
        // the lease is recorded, after: concurrent leases cannot all pass.
        self.check_quotas(
            &self.leases.lock().unwrap_or_else(|p| p.into_inner()),
            len,
            owner,
        )?;
        // Allocated without the lock: another lease need not wait for it.
        let file = self.fresh_file(len)?;
        let fd = file
            .try_clone()
            .map_err(io_err("duplicating a lease's descriptor"))?;
        let name = self.fresh_name();
        let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        self.check_quotas(&leases, len, owner)?;
        let lease = Lease {
            file,
            len,
            deadline: Instant::now() + self.lease_ttl,
            owner,
        };
        leases.insert(name.clone(), lease);
        Ok((name, self.lease_ttl, fd.into()))
    }

    /// Refuses a lease of `len` bytes to `owner` past any quota: the
    /// counts of leases first, then their bytes.
    fn check_quotas(
        &self,
        leases: &HashMap<String, Lease>,
        len: u64,
        owner: u64,
    ) -> Result<(), ShmError> {
        let (count, mine) = leases
            .values()
            .filter(|l| l.owner == owner)
            .fold((0usize, 0u64), |(n, b), l| (n + 1, b + l.len));
        if count >= self.max_connection_leases {
            return Err(ShmError::ConnectionLeaseCount {
                outstanding: count,
                limit: self.max_connection_leases,
            });
        }
        if leases.len() >= self.max_leases {
            return Err(ShmError::LeaseCount {
                outstanding: leases.len(),
                limit: self.max_leases,
            });
        }
        if mine.saturating_add(len) > self.max_connection_leased {
            return Err(ShmError::ConnectionLeaseQuota {
                asked: len,
                outstanding: mine,
                limit: self.max_connection_leased,
            });
        }
        let outstanding: u64 = leases.values().map(|l| l.len).sum();
        if outstanding.saturating_add(len) > self.max_leased {
            return Err(ShmError::LeaseQuota {
                asked: len,
                outstanding,
                limit: self.max_leased,
            });
        }
        Ok(())
    }

    /// Drops a lease whose descriptor could not be handed over.
    pub fn cancel(&self, name: &str) {
        self.leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name);
    }

    /// Takes over a leased segment its owner filled: seals it and maps it
    /// read-only, without a copy. The lease ends, whether or not the seal
    /// takes (a segment still mapped writable is refused for good).
    /// Another connection naming it is refused, and the lease stays its
    /// owner's.
    pub fn adopt(&self, name: &str, owner: u64) -> Result<(Bytes, Handle), ShmError> {
        self.adopt_or_keep(name, owner, false)
    }

    /// [`Self::adopt`], except that with `keep`, a seal the kernel refuses
    /// because the segment is still mapped writable or its pages pinned
    /// (`EBUSY`) leaves the lease as it was, for the caller to try again.
    pub fn adopt_or_keep(
        &self,
        name: &str,
        owner: u64,
        keep: bool,
    ) -> Result<(Bytes, Handle), ShmError> {
        let lease = {
            let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
            match leases.get(name) {
                None => return Err(ShmError::UnknownLease(name.into())),
                Some(l) if l.owner != owner => return Err(ShmError::NotYourLease(name.into())),
                Some(_) => leases.remove(name),
            }
        };
        let Some(lease) = lease else {
            return Err(ShmError::UnknownLease(name.into()));
        };
        let sealed = match seal(&lease.file, name) {
            Err(e @ ShmError::StillMapped(_)) if keep => {
                let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
                leases.insert(name.to_owned(), lease);
                return Err(e);
            }
            Err(e) => Err(e),
            Ok(()) => self.map_sealed(lease.file, name.to_owned(), lease.len),
        };
        self.prealloc.touch();
        sealed
    }

    /// Drops the leases of connection `owner`, which has ended: nobody
    /// else may put them, so they would only hold their descriptors until
    /// they expire. Returns how many.
    pub fn release_connection(&self, owner: u64) -> usize {
        let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        let before = leases.len();
        leases.retain(|_, l| l.owner != owner);
        let dropped = before - leases.len();
        if dropped > 0 {
            tracing::debug!(
                connection = owner,
                leases = dropped,
                "connection closed: its leases dropped"
            );
        }
        dropped
    }

    /// Drops every expired lease; returns how many.
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        let before = leases.len();
        leases.retain(|name, l| {
            let keep = l.deadline > now;
            if !keep {
                tracing::info!(segment = %name, "lease expired: segment dropped");
            }
            keep
        });
        before - leases.len()
    }

    /// Number of live (sealed) segments and open leases.
    pub fn counts(&self) -> (usize, usize) {
        let live = self.live.load(Ordering::Relaxed) as usize;
        let leases = self.leases.lock().unwrap_or_else(|p| p.into_inner()).len();
        (live, leases)
    }
}

impl Drop for SegmentStore {
    fn drop(&mut self) {
        // The filler thread holds the pool too: stop it.
        self.prealloc.stop();
    }
}

#[cfg(test)]
mod tests;
