//! Same-node shared memory: segments that `stowd` owns, maps, and lends to
//! clients on the same node by name.
//!
//! A segment is a file in the shared-memory directory (`/dev/shm` by
//! default) named `stowd-<pid>-<128 random bits in hex>`, created `O_EXCL`
//! and mode 0600 (no other user can open, guess or pre-create one). Ownership: stored rows are `Bytes`
//! slices of a read-only mapping of the segment; when the last slice is
//! dropped (every row cleared or overwritten) the mapping is unmapped and
//! the file unlinked. A client that mapped the segment keeps its mapping
//! valid until it unmaps it: unlinking never invalidates existing mappings.
//!
//! Two ways in:
//! - get: an extent ([`crate::extent`]) that is not yet in a segment is
//!   copied into one once ([`SegmentStore::export`], called by
//!   [`crate::extent::share_all`]), so every later same-node get of
//!   its rows is zero-copy and returns the same pages. A segment named in
//!   a reply is held for [`SegmentStore::with_hold`] after it (default
//!   [`DEFAULT_HOLD`]), so that an overwrite or clear racing the get
//!   cannot unlink or reuse it before the reader has opened and locked it;
//! - put: a client leases a segment ([`SegmentStore::lease`]), writes into
//!   its own mapping, and puts descriptors naming it; `stowd` adopts the
//!   file without copying ([`SegmentStore::adopt`]). A lease not adopted
//!   before it expires is unlinked by [`SegmentStore::sweep`], so a crashed
//!   client leaks nothing.
//!
//! Reuse: fresh tmpfs pages are dear (about 1.4 GB/s to fault in on the
//! development VM, against 10 GB/s to map pages a file already has), so
//! when the last row of a segment goes, `stowd` keeps the file as a spare
//! ([`Spares`]) instead of unlinking it, and the next lease or export of a
//! similar size gets it back already populated. A spare must never be
//! rewritten while a reader still maps the old rows: readers hold a shared
//! `flock` on the file while they map it (the protocol requires it), and a
//! segment becomes a spare only if `stowd` gets the exclusive lock without
//! waiting; it is then renamed to a fresh name before the lock is let go,
//! so a reader that had the old name from a reply but had not locked yet
//! finds it gone (it checks, after locking, that the name still names the
//! file it opened). A segment some reader still maps is unlinked as before.
//! Spares are bounded in bytes and removed after an idle time; they live
//! in `spares`.
//!
//! Trust: a same-node client that still holds a writable mapping of a
//! segment it handed over could change those bytes; the Python client
//! unmaps before it sends the put. Clients on the node run as the same user
//! as `stowd`, as for any shared-memory transport.

use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use std::time::{Duration, Instant};

use bytes::Bytes;
use memmap2::{Mmap, MmapMut, MmapOptions};

mod spares;

use spares::{Names, Spares};

/// Shared-memory failures.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    #[error("shared memory is not enabled on this stowd")]
    Disabled,
    #[error("shared memory I/O on {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("unknown or expired lease {0:?}")]
    UnknownLease(String),
    #[error("lease {0:?} was granted to another connection: only that connection may put it")]
    NotYourLease(String),
    #[error("segment name {0:?} is not one of this stowd's segments")]
    BadName(String),
    #[error("lease of {asked} bytes exceeds the {limit}-byte limit")]
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
    #[error("range {offset}+{len} is outside segment {name} of {size} bytes")]
    OutOfRange {
        name: String,
        offset: u64,
        len: u64,
        size: u64,
    },
}

/// A mapped segment; unmapped when the last `Bytes` over it is dropped,
/// and then kept as a spare or unlinked.
struct Segment {
    map: Mmap,
    path: PathBuf,
    live: Arc<AtomicU64>,
    spares: Weak<Spares>,
}

/// The owner behind every `Bytes` of a segment.
struct SegmentRef(Arc<Segment>);

impl AsRef<[u8]> for SegmentRef {
    fn as_ref(&self) -> &[u8] {
        &self.0.map
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::Relaxed);
        let kept = self
            .spares
            .upgrade()
            .is_some_and(|s| s.offer(&self.path, self.map.len() as u64));
        if !kept {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// How long a segment named in a same-node reply stays alive after it by
/// default: the reader opens and locks it well within this.
pub const DEFAULT_HOLD: Duration = Duration::from_secs(1);

struct Lease {
    path: PathBuf,
    len: u64,
    deadline: Instant,
    /// The connection that asked for it (`transport::Caller::connection`):
    /// the only one that may put it.
    owner: u64,
}

/// The segments of one `stowd` process.
pub struct SegmentStore {
    names: Arc<Names>,
    spares: Arc<Spares>,
    /// Mapped segments.
    live: Arc<AtomicU64>,
    /// Segments named in recent same-node replies, and until when.
    held: Mutex<VecDeque<(Instant, Bytes)>>,
    hold: Duration,
    leases: Mutex<HashMap<String, Lease>>,
    lease_ttl: Duration,
    max_lease: u64,
    /// Most bytes of all outstanding leases together.
    max_leased: u64,
}

impl std::fmt::Debug for SegmentStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentStore")
            .field("dir", &self.names.dir)
            .finish()
    }
}

impl SegmentStore {
    /// A store in `dir`; removes segments left there by dead `stowd`s, and
    /// by an earlier process with this one's pid.
    pub fn new(dir: &Path, lease_ttl: Duration, max_lease: u64) -> Result<SegmentStore, ShmError> {
        let io = |source| ShmError::Io {
            path: dir.display().to_string(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(io)?;
        // A stowd restarted with its predecessor's pid (PID 1 in a
        // container) removes the files that pid left before it started: a
        // second before, as the start time is known to 10 ms and tmpfs
        // times are coarse (a predecessor gone less than a second earlier
        // leaves its files; their random names never collide with ours).
        let me = std::process::id();
        let started =
            crate::sys::process_start().and_then(|t| t.checked_sub(Duration::from_secs(1)));
        for entry in std::fs::read_dir(dir).map_err(io)?.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            let pid = name
                .strip_prefix("stowd-")
                .and_then(|r| r.split('-').next())
                .and_then(|p| p.parse::<u32>().ok());
            let stale = match pid {
                Some(pid) if pid == me => {
                    let modified = entry.metadata().and_then(|m| m.modified()).ok();
                    matches!((modified, started), (Some(m), Some(s)) if m < s)
                }
                Some(pid) => !Path::new(&format!("/proc/{pid}")).exists(),
                None => false,
            };
            if stale {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        let names = Arc::new(Names {
            dir: dir.to_path_buf(),
            prefix: format!("stowd-{}-", std::process::id()),
        });
        let spares = Arc::new(Spares::new(names.clone(), 0, Duration::ZERO));
        Ok(SegmentStore {
            names,
            spares,
            live: Arc::default(),
            held: Mutex::default(),
            hold: DEFAULT_HOLD,
            leases: Mutex::default(),
            lease_ttl,
            max_lease,
            max_leased: u64::MAX,
        })
    }

    /// Keeps the files of cleared segments (each of at least 1 MiB) for
    /// reuse, up to `cap` bytes in all, each for at most `idle` unused;
    /// `cap` 0 unlinks them at once.
    pub fn with_reuse(mut self, cap: u64, idle: Duration) -> SegmentStore {
        self.spares = Arc::new(Spares::new(self.names.clone(), cap, idle));
        self
    }

    /// At most `total` bytes of leases granted and not yet adopted or
    /// expired, together (each still at most the per-lease limit).
    pub fn with_lease_quota(mut self, total: u64) -> SegmentStore {
        self.max_leased = total;
        self
    }

    pub fn dir(&self) -> &Path {
        &self.names.dir
    }

    fn path_of(&self, name: &str) -> Result<PathBuf, ShmError> {
        if !self.names.is_segment(name) {
            return Err(ShmError::BadName(name.into()));
        }
        Ok(self.names.dir.join(name))
    }

    /// A new file of `len` bytes for stowd or a client to fill: a spare
    /// if one fits, else created. Holds that have run out are let go
    /// first, so a segment whose rows were cleared while it was held is a
    /// spare by now.
    fn create(&self, len: u64) -> Result<(File, PathBuf), ShmError> {
        self.let_go_expired(Instant::now());
        if let Some(spare) = self.spares.take(len) {
            return Ok(spare);
        }
        let fresh = self.names.fresh().map_err(|source| ShmError::Io {
            path: self.names.dir.display().to_string(),
            source,
        })?;
        let path = self.names.dir.join(fresh);
        let io = |source| ShmError::Io {
            path: path.display().to_string(),
            source,
        };
        // 0600: only this user (stowd and its same-node clients) can open
        // it; `create_new` (O_EXCL) never opens a file someone else made.
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(io)?;
        file.set_len(len).map_err(io)?;
        Ok((file, path))
    }

    /// Maps the file read-only and returns it as `Bytes` (registered so
    /// [`SegmentStore::locate`] finds it).
    fn map(&self, path: PathBuf) -> Result<Bytes, ShmError> {
        let io = |source| ShmError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = OpenOptions::new().read(true).open(&path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            let _ = std::fs::remove_file(&path);
            return Ok(Bytes::new());
        }
        // SAFETY: the file is one of this process's segments (the name was
        // checked); stowd never writes to it after this point, and clients
        // are trusted not to (see the module docs). The mapping lives as
        // long as the `Segment` that owns it.
        let map = unsafe { MmapOptions::new().map(&file) }.map_err(io)?;
        self.live.fetch_add(1, Ordering::Relaxed);
        let segment = Arc::new(Segment {
            map,
            path,
            live: self.live.clone(),
            spares: Arc::downgrade(&self.spares),
        });
        Ok(Bytes::from_owner(SegmentRef(segment)))
    }

    /// Copies `parts` back to back into one new segment (a spare if one
    /// fits); returns the segment's bytes (read-only mapping) and its name.
    pub fn export(&self, parts: &[&[u8]]) -> Result<(Bytes, String), ShmError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let (file, path) = self.create(total as u64)?;
        let io = |source| ShmError::Io {
            path: path.display().to_string(),
            source,
        };
        {
            // SAFETY: a file stowd just created (or took from its spares,
            // which no reader locks) and nobody else writes; the writable
            // mapping is dropped before the read-only one is made.
            let mut map: MmapMut =
                unsafe { MmapOptions::new().populate().map_mut(&file) }.map_err(io)?;
            let mut at = 0;
            for p in parts {
                map[at..at + p.len()].copy_from_slice(p);
                at += p.len();
            }
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        Ok((self.map(path)?, name))
    }

    /// How long a segment named in a same-node reply is kept alive after
    /// the reply, at least (0: not held).
    pub fn with_hold(mut self, hold: Duration) -> SegmentStore {
        self.hold = hold;
        self
    }

    /// Keeps these segments alive for the hold time (see the module docs):
    /// a reader that got their names opens and locks them meanwhile.
    pub fn hold(&self, segments: impl IntoIterator<Item = Bytes>) {
        if self.hold.is_zero() {
            return;
        }
        let until = Instant::now() + self.hold;
        self.held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(segments.into_iter().map(|b| (until, b)));
        self.let_go_expired(Instant::now());
    }

    /// Lets go the segments whose hold ran out by `now`: unmapped, and kept
    /// as spares or unlinked, after the lock on the holds is released.
    fn let_go_expired(&self, now: Instant) {
        let expired: Vec<(Instant, Bytes)> = {
            let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
            let n = held.iter().take_while(|(until, _)| *until <= now).count();
            held.drain(..n).collect()
        };
        drop(expired);
    }

    /// Creates a segment of `len` bytes for a client to fill; it must be
    /// adopted by the same `owner` (the connection that asked) before the
    /// lease expires.
    pub fn lease(&self, len: u64, owner: u64) -> Result<(String, Duration), ShmError> {
        if len > self.max_lease {
            return Err(ShmError::TooLarge {
                asked: len,
                limit: self.max_lease,
            });
        }
        self.sweep();
        // The quota is checked and the lease recorded under one lock, so
        // that concurrent leases cannot all pass the check.
        let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        let outstanding: u64 = leases.values().map(|l| l.len).sum();
        if outstanding.saturating_add(len) > self.max_leased {
            return Err(ShmError::LeaseQuota {
                asked: len,
                outstanding,
                limit: self.max_leased,
            });
        }
        let (_, path) = self.create(len)?;
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        let lease = Lease {
            path,
            len,
            deadline: Instant::now() + self.lease_ttl,
            owner,
        };
        leases.insert(name.clone(), lease);
        Ok((name, self.lease_ttl))
    }

    /// Takes over a leased segment its owner filled: maps it read-only,
    /// without a copy. The lease ends. Another connection naming it is
    /// refused, and the lease stays its owner's.
    pub fn adopt(&self, name: &str, owner: u64) -> Result<Bytes, ShmError> {
        let path = self.path_of(name)?;
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
        debug_assert_eq!(lease.path, path);
        let bytes = self.map(path)?;
        if bytes.len() as u64 != lease.len {
            return Err(ShmError::OutOfRange {
                name: name.into(),
                offset: 0,
                len: lease.len,
                size: bytes.len() as u64,
            });
        }
        Ok(bytes)
    }

    /// Unlinks every expired lease and idle spare; returns how many leases.
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        self.let_go_expired(now);
        self.spares.sweep(now);
        let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        let expired: Vec<String> = leases
            .iter()
            .filter(|(_, l)| l.deadline <= now)
            .map(|(n, _)| n.clone())
            .collect();
        for name in &expired {
            if let Some(l) = leases.remove(name) {
                let _ = std::fs::remove_file(l.path);
                tracing::info!(segment = %name, "lease expired: segment removed");
            }
        }
        expired.len()
    }

    /// Spare segments kept for reuse: how many, their bytes, and how many
    /// times one was reused.
    pub fn spares(&self) -> (usize, u64, u64) {
        let (n, bytes) = self.spares.counts();
        (n, bytes, self.spares.reused.load(Ordering::Relaxed))
    }

    /// Number of live (mapped) segments and open leases.
    pub fn counts(&self) -> (usize, usize) {
        let live = self.live.load(Ordering::Relaxed) as usize;
        let leases = self.leases.lock().unwrap_or_else(|p| p.into_inner()).len();
        (live, leases)
    }
}

impl Drop for SegmentStore {
    fn drop(&mut self) {
        for (_, l) in self
            .leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
        {
            let _ = std::fs::remove_file(l.path);
        }
    }
}

#[cfg(test)]
mod tests;
