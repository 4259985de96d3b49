//! Same-node shared memory: segments that `stowd` owns, maps, and lends to
//! clients on the same node by name.
//!
//! A segment is a file in the shared-memory directory (`/dev/shm` by
//! default) named `stowd-<pid>-<n>`. Ownership: stored rows are `Bytes`
//! slices of a read-only mapping of the segment; when the last slice is
//! dropped (every row cleared or overwritten) the mapping is unmapped and
//! the file unlinked. A client that mapped the segment keeps its mapping
//! valid until it unmaps it: unlinking never invalidates existing mappings.
//!
//! Two ways in:
//! - get: rows that are not yet in a segment are copied into one once
//!   ([`SegmentStore::export`]) and the unit's cells are swapped to point
//!   there, so every later same-node get of those rows is zero-copy and
//!   returns the same pages;
//! - put: a client leases a segment ([`SegmentStore::lease`]), writes into
//!   its own mapping, and puts descriptors naming it; `stowd` adopts the
//!   file without copying ([`SegmentStore::adopt`]). A lease not adopted
//!   before it expires is unlinked by [`SegmentStore::sweep`], so a crashed
//!   client leaks nothing.
//!
//! Trust: a same-node client that still holds a writable mapping of a
//! segment it handed over could change those bytes; the Python client
//! unmaps before it sends the put. Clients on the node run as the same user
//! as `stowd`, as for any shared-memory transport.

use std::collections::{BTreeMap, HashMap};
use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use memmap2::{Mmap, MmapMut, MmapOptions};

/// Shared-memory failures.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    #[error("shared memory is not enabled on this stowd")]
    Disabled,
    #[error("shared memory I/O on {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("unknown or expired lease {0:?}")]
    UnknownLease(String),
    #[error("segment name {0:?} is not one of this stowd's segments")]
    BadName(String),
    #[error("lease of {asked} bytes exceeds the {limit}-byte limit")]
    TooLarge { asked: u64, limit: u64 },
    #[error("range {offset}+{len} is outside segment {name} of {size} bytes")]
    OutOfRange { name: String, offset: u64, len: u64, size: u64 },
}

/// Live segments by start address: length, name, and a weak handle (the
/// registry never keeps a segment alive).
type Live = Arc<Mutex<BTreeMap<usize, (usize, String, Weak<Segment>)>>>;

/// A mapped segment; unmapped and unlinked when the last `Bytes` over it
/// is dropped.
struct Segment {
    map: Mmap,
    path: PathBuf,
    live: Live,
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
        self.live.lock().unwrap_or_else(|p| p.into_inner()).remove(&(self.map.as_ptr() as usize));
        let _ = std::fs::remove_file(&self.path);
    }
}

struct Lease {
    path: PathBuf,
    len: u64,
    deadline: Instant,
}

/// The segments of one `stowd` process.
pub struct SegmentStore {
    dir: PathBuf,
    prefix: String,
    next: AtomicU64,
    live: Live,
    leases: Mutex<HashMap<String, Lease>>,
    lease_ttl: Duration,
    max_lease: u64,
}

impl std::fmt::Debug for SegmentStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentStore").field("dir", &self.dir).finish()
    }
}

/// Where some bytes live in a segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    pub segment: String,
    pub offset: u64,
    pub len: u64,
}

impl SegmentStore {
    /// A store in `dir`; removes segments left there by dead `stowd`s.
    pub fn new(dir: &Path, lease_ttl: Duration, max_lease: u64) -> Result<SegmentStore, ShmError> {
        let io = |source| ShmError::Io { path: dir.display().to_string(), source };
        std::fs::create_dir_all(dir).map_err(io)?;
        for entry in std::fs::read_dir(dir).map_err(io)?.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            let pid = name.strip_prefix("stowd-").and_then(|r| r.split('-').next()).and_then(|p| p.parse::<u32>().ok());
            if let Some(pid) = pid
                && !Path::new(&format!("/proc/{pid}")).exists()
            {
                let _ = std::fs::remove_file(entry.path());
            }
        }
        Ok(SegmentStore {
            dir: dir.to_path_buf(),
            prefix: format!("stowd-{}-", std::process::id()),
            next: AtomicU64::new(0),
            live: Arc::default(),
            leases: Mutex::default(),
            lease_ttl,
            max_lease,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn fresh_name(&self) -> String {
        format!("{}{}", self.prefix, self.next.fetch_add(1, Ordering::Relaxed))
    }

    fn path_of(&self, name: &str) -> Result<PathBuf, ShmError> {
        let ok = name.starts_with(&self.prefix)
            && name[self.prefix.len()..].chars().all(|c| c.is_ascii_digit())
            && name.len() > self.prefix.len();
        if !ok {
            return Err(ShmError::BadName(name.into()));
        }
        Ok(self.dir.join(name))
    }

    /// Maps the file read-only and returns it as `Bytes` (registered so
    /// [`SegmentStore::locate`] finds it).
    fn map(&self, path: PathBuf) -> Result<Bytes, ShmError> {
        let io = |source| ShmError::Io { path: path.display().to_string(), source };
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
        let name = path.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
        let (start, len) = (map.as_ptr() as usize, map.len());
        let segment = Arc::new(Segment { map, path, live: self.live.clone() });
        self.live
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(start, (len, name, Arc::downgrade(&segment)));
        Ok(Bytes::from_owner(SegmentRef(segment)))
    }

    /// Bytes `offset..offset + len` of a live segment, as a new `Bytes`
    /// sharing the mapping (used to describe adjacent rows as one range).
    pub fn span(&self, segment: &str, offset: u64, len: u64) -> Option<Bytes> {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        let (size, _, weak) = live.values().find(|(_, name, _)| name == segment)?;
        let end = offset.checked_add(len).filter(|e| *e <= *size as u64)?;
        let arc = weak.upgrade()?;
        drop(live);
        Some(Bytes::from_owner(SegmentRef(arc)).slice(offset as usize..end as usize))
    }

    /// `len` bytes from address `start`, as a slice of the live segment
    /// that holds all of them (used to send rows that lie back to back in a
    /// segment as one range); `None` if no segment does.
    pub fn span_at(&self, start: *const u8, len: usize) -> Option<Bytes> {
        let p = start as usize;
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        let (&base, (size, _, weak)) = live.range(..=p).next_back()?;
        let end = p.checked_add(len).filter(|e| *e <= base + size)?;
        let arc = weak.upgrade()?;
        drop(live);
        Some(Bytes::from_owner(SegmentRef(arc)).slice(p - base..end - base))
    }

    /// Where `bytes` lie, if inside one of our segments.
    pub fn locate(&self, bytes: &[u8]) -> Option<Location> {
        let p = bytes.as_ptr() as usize;
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner());
        let (&start, (len, name, _)) = live.range(..=p).next_back()?;
        (p + bytes.len() <= start + len).then(|| Location {
            segment: name.clone(),
            offset: (p - start) as u64,
            len: bytes.len() as u64,
        })
    }

    /// Copies `parts` back to back into one new segment; returns the
    /// segment's bytes and each part's slice of it.
    pub fn export(&self, parts: &[&[u8]]) -> Result<Vec<Bytes>, ShmError> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total == 0 {
            return Ok(parts.iter().map(|_| Bytes::new()).collect());
        }
        let path = self.dir.join(self.fresh_name());
        let io = |source| ShmError::Io { path: path.display().to_string(), source };
        {
            let file =
                OpenOptions::new().read(true).write(true).create_new(true).open(&path).map_err(io)?;
            file.set_len(total as u64).map_err(io)?;
            // SAFETY: a file we just created and nobody else knows yet.
            // `populate`: fault every page in one go rather than one by one
            // during the copy (fresh tmpfs pages are dear on this kind of VM).
            let mut map: MmapMut = unsafe { MmapOptions::new().populate().map_mut(&file) }.map_err(io)?;
            let mut at = 0;
            for p in parts {
                map[at..at + p.len()].copy_from_slice(p);
                at += p.len();
            }
        }
        let all = self.map(path)?;
        let mut at = 0;
        Ok(parts
            .iter()
            .map(|p| {
                let s = all.slice(at..at + p.len());
                at += p.len();
                s
            })
            .collect())
    }

    /// Creates a segment of `len` bytes for a client to fill; it must be
    /// adopted before the lease expires.
    pub fn lease(&self, len: u64) -> Result<(String, Duration), ShmError> {
        if len > self.max_lease {
            return Err(ShmError::TooLarge { asked: len, limit: self.max_lease });
        }
        self.sweep();
        let name = self.fresh_name();
        let path = self.dir.join(&name);
        let io = |source| ShmError::Io { path: path.display().to_string(), source };
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(&path).map_err(io)?;
        file.set_len(len).map_err(io)?;
        let lease = Lease { path, len, deadline: Instant::now() + self.lease_ttl };
        self.leases.lock().unwrap_or_else(|p| p.into_inner()).insert(name.clone(), lease);
        Ok((name, self.lease_ttl))
    }

    /// Takes over a leased segment the client filled: maps it read-only,
    /// without a copy. The lease ends.
    pub fn adopt(&self, name: &str) -> Result<Bytes, ShmError> {
        let path = self.path_of(name)?;
        let lease = self.leases.lock().unwrap_or_else(|p| p.into_inner()).remove(name);
        let Some(lease) = lease else { return Err(ShmError::UnknownLease(name.into())) };
        debug_assert_eq!(lease.path, path);
        let bytes = self.map(path)?;
        if bytes.len() as u64 != lease.len {
            return Err(ShmError::OutOfRange { name: name.into(), offset: 0, len: lease.len, size: bytes.len() as u64 });
        }
        Ok(bytes)
    }

    /// Unlinks every expired lease; returns how many.
    pub fn sweep(&self) -> usize {
        let now = Instant::now();
        let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        let expired: Vec<String> = leases.iter().filter(|(_, l)| l.deadline <= now).map(|(n, _)| n.clone()).collect();
        for name in &expired {
            if let Some(l) = leases.remove(name) {
                let _ = std::fs::remove_file(l.path);
                tracing::info!(segment = %name, "lease expired: segment removed");
            }
        }
        expired.len()
    }

    /// Number of live (mapped) segments and open leases.
    pub fn counts(&self) -> (usize, usize) {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner()).len();
        let leases = self.leases.lock().unwrap_or_else(|p| p.into_inner()).len();
        (live, leases)
    }
}

impl Drop for SegmentStore {
    fn drop(&mut self) {
        for (_, l) in self.leases.lock().unwrap_or_else(|p| p.into_inner()).drain() {
            let _ = std::fs::remove_file(l.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(tag: &str, ttl: Duration) -> SegmentStore {
        let dir = std::env::temp_dir().join(format!("stowage-shm-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        SegmentStore::new(&dir, ttl, 1 << 30).unwrap()
    }

    #[test]
    fn exported_bytes_are_located_and_freed_with_the_last_slice() {
        let s = store("export", Duration::from_secs(5));
        let parts = s.export(&[b"abc", b"", b"defg"]).unwrap();
        assert_eq!(&parts[2][..], b"defg");
        let loc = s.locate(&parts[2]).unwrap();
        assert_eq!((loc.offset, loc.len), (3, 4));
        let file = s.dir().join(&loc.segment);
        assert!(file.exists());
        assert!(s.locate(b"elsewhere").is_none());
        drop(parts);
        assert!(!file.exists(), "segment not unlinked after the last slice");
        assert_eq!(s.counts(), (0, 0));
    }

    #[test]
    fn leases_are_adopted_without_copy_or_expire() {
        let s = store("lease", Duration::from_millis(50));
        let (name, _) = s.lease(8).unwrap();
        std::fs::write(s.dir().join(&name), b"12345678").unwrap();
        let bytes = s.adopt(&name).unwrap();
        assert_eq!(&bytes[..], b"12345678");
        assert_eq!(s.locate(&bytes).unwrap().segment, name);
        assert!(matches!(s.adopt(&name), Err(ShmError::UnknownLease(_))));
        let (stale, _) = s.lease(8).unwrap();
        std::thread::sleep(Duration::from_millis(80));
        assert_eq!(s.sweep(), 1);
        assert!(!s.dir().join(&stale).exists());
        assert!(matches!(s.adopt(&stale), Err(ShmError::UnknownLease(_))));
        assert!(matches!(s.adopt("../../etc/passwd"), Err(ShmError::BadName(_))));
        assert!(matches!(s.lease(2 << 30), Err(ShmError::TooLarge { .. })));
    }
}
