//! Spare segments: the files of cleared segments kept, with their pages,
//! for the next lease or export of a similar size (see the parent module's
//! "Reuse"), and the segment names they are kept under.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Segments smaller than this are unlinked, not kept: their pages are few.
const MIN_SPARE: u64 = 1 << 20;

/// A cleared segment's file, kept with its pages for a later lease or
/// export.
struct Spare {
    file: File,
    path: PathBuf,
    len: u64,
    since: Instant,
}

/// The spare segments of one `stowd`, at most `cap` bytes in all, each
/// removed after `idle` unused.
pub(super) struct Spares {
    pub(super) names: Arc<Names>,
    pub(super) cap: u64,
    pub(super) idle: Duration,
    list: Mutex<Vec<Spare>>,
    pub(super) reused: AtomicU64,
}

/// Fresh segment names in `dir`: `stowd-<pid>-` and 32 hex digits of OS
/// randomness, so that no other local user can guess the next name and
/// create it first (sequential names could be squatted: every lease and
/// same-node put then failed with "File exists").
pub(super) struct Names {
    pub(super) dir: PathBuf,
    pub(super) prefix: String,
}

/// 128 random bits as 32 lowercase hex digits.
fn random_hex() -> std::io::Result<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(std::io::Error::other)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

impl Names {
    pub(super) fn fresh(&self) -> std::io::Result<String> {
        Ok(format!("{}{}", self.prefix, random_hex()?))
    }

    /// A spare's name: not a segment name, so no request can name it.
    pub(super) fn spare(&self) -> std::io::Result<String> {
        Ok(format!("{}spare-{}", self.prefix, random_hex()?))
    }

    /// Whether `name` is a segment name of this store (not a spare's).
    pub(super) fn is_segment(&self, name: &str) -> bool {
        name.strip_prefix(self.prefix.as_str()).is_some_and(|r| {
            r.len() == 32 && r.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
        })
    }
}

impl Spares {
    /// No spares yet; at most `cap` bytes of them, each kept `idle`.
    pub(super) fn new(names: Arc<Names>, cap: u64, idle: Duration) -> Spares {
        Spares {
            names,
            cap,
            idle,
            list: Mutex::default(),
            reused: AtomicU64::new(0),
        }
    }

    /// Keeps the file at `path` (of `len` bytes, no longer used by stowd)
    /// as a spare if no reader holds it and there is room; false if the
    /// caller should unlink it.
    pub(super) fn offer(&self, path: &Path, len: u64) -> bool {
        if len < MIN_SPARE || len > self.cap {
            return false;
        }
        let Ok(file) = OpenOptions::new().read(true).write(true).open(path) else {
            return false;
        };
        // A reader's shared lock means its mapping may still be read.
        if file.try_lock().is_err() {
            return false;
        }
        // A fresh name before the lock goes: a reader that opened the old
        // name but had not locked yet sees the name gone and stops.
        let Ok(spare) = self.names.spare() else {
            return false;
        };
        let renamed = self.names.dir.join(spare);
        if std::fs::rename(path, &renamed).is_err() {
            return false;
        }
        let _ = file.unlock();
        let mut list = self.list.lock().unwrap_or_else(|p| p.into_inner());
        // Room for the newest: the oldest spares go first.
        let mut total: u64 = list.iter().map(|s| s.len).sum::<u64>() + len;
        while total > self.cap && !list.is_empty() {
            let old = list.remove(0);
            total -= old.len;
            let _ = std::fs::remove_file(&old.path);
        }
        list.push(Spare {
            file,
            path: renamed,
            len,
            since: Instant::now(),
        });
        true
    }

    /// A spare resized to `len` bytes under a fresh segment name: the
    /// smallest of at least `len` (and at most twice it), else the largest
    /// of at least half of it (the rest of the pages are new); `None` if
    /// none fits that well.
    pub(super) fn take(&self, len: u64) -> Option<(File, PathBuf)> {
        if len < MIN_SPARE {
            return None;
        }
        let mut list = self.list.lock().unwrap_or_else(|p| p.into_inner());
        let above = list
            .iter()
            .enumerate()
            .filter(|(_, s)| s.len >= len && s.len / 2 <= len)
            .min_by_key(|(_, s)| s.len)
            .map(|(i, _)| i);
        let below = || {
            list.iter()
                .enumerate()
                .filter(|(_, s)| s.len < len && s.len >= len / 2)
                .max_by_key(|(_, s)| s.len)
                .map(|(i, _)| i)
        };
        let i = above.or_else(below)?;
        let spare = list.remove(i);
        drop(list);
        let Ok(fresh) = self.names.fresh() else {
            let _ = std::fs::remove_file(&spare.path);
            return None;
        };
        let path = self.names.dir.join(fresh);
        if spare.file.set_len(len).is_err() || std::fs::rename(&spare.path, &path).is_err() {
            let _ = std::fs::remove_file(&spare.path);
            return None;
        }
        self.reused.fetch_add(1, Ordering::Relaxed);
        Some((spare.file, path))
    }

    /// Removes spares unused for `idle`; returns how many.
    pub(super) fn sweep(&self, now: Instant) -> usize {
        let mut list = self.list.lock().unwrap_or_else(|p| p.into_inner());
        let before = list.len();
        list.retain(|s| {
            let keep = now.duration_since(s.since) < self.idle;
            if !keep {
                let _ = std::fs::remove_file(&s.path);
            }
            keep
        });
        before - list.len()
    }

    pub(super) fn counts(&self) -> (usize, u64) {
        let list = self.list.lock().unwrap_or_else(|p| p.into_inner());
        (list.len(), list.iter().map(|s| s.len).sum())
    }
}

impl Drop for Spares {
    fn drop(&mut self) {
        for s in self
            .list
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            let _ = std::fs::remove_file(&s.path);
        }
    }
}
