//! The journal of indexes touched since a checkpoint: what keeps a restore
//! from serving a row's old value silently (issue 16).
//!
//! Once `stowd` has written a checkpoint directory (or restored from one),
//! every put and clear of a local unit first appends the global indexes it
//! touches to that directory's journal file (`journal-<seq>`, 8 bytes
//! little-endian per index), `fdatasync`s it, and only then changes the
//! unit. A restore from checkpoint `seq` loads every checkpointed row
//! except those whose index is in `journal-<seq>`, and marks those indexes
//! lost: a get of one fails with `data_lost`, naming the checkpoint, until
//! the index is put again. Nothing touched after a checkpoint is ever
//! served with its checkpointed value.
//!
//! Consistency with the snapshot: a put or clear holds the journal's gate
//! shared from its journal write until its unit is changed; a checkpoint
//! takes the gate exclusively while it opens the new journal and snapshots
//! every unit ([`Journal::begin`]). So a change is either in the snapshot
//! or in the new journal, never in neither. Until the new checkpoint's
//! manifest is renamed into place, the previous checkpoint's journal is
//! written as well, so a crash mid-checkpoint leaves the previous
//! checkpoint restorable with a complete journal.
//!
//! A torn last record (a crash mid-write, before its put was applied or
//! acknowledged) is ignored at restore.
//!
//! Cost: nothing until the first checkpoint; after it, one `write` and one
//! `fdatasync` per put or clear (docs/benchmarks.md measures it).

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The journal file of checkpoint `seq` in `dir`.
pub fn path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("journal-{seq}"))
}

/// The marker saying the journal of checkpoint `seq` in `dir` stopped being
/// written while `stowd` went on (see [`Journal::retire_others`]).
pub fn stopped_path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(format!("journal-{seq}.stopped"))
}

/// One open journal file.
struct Open {
    dir: PathBuf,
    seq: u64,
    file: File,
}

/// The journals of every checkpoint directory this `stowd` keeps current.
#[derive(Default)]
pub struct Journal {
    /// The open journal files. Shared by puts and clears (which append),
    /// exclusive for a checkpoint's switch to a new file.
    gate: RwLock<Vec<Open>>,
    /// One checkpoint or restore at a time.
    turn: Mutex<()>,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal").finish_non_exhaustive()
    }
}

/// Held by a put or clear from its journal write until its unit changed.
pub struct Touch<'a>(#[allow(dead_code)] RwLockReadGuard<'a, Vec<Open>>);

/// Held by a checkpoint while it snapshots the units.
pub struct Switch<'a>(#[allow(dead_code)] RwLockWriteGuard<'a, Vec<Open>>);

fn encode(indexes: &[u64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(indexes.len() * 8);
    for g in indexes {
        out.extend_from_slice(&g.to_le_bytes());
    }
    out
}

impl Journal {
    pub fn new() -> Journal {
        Journal::default()
    }

    /// One checkpoint or restore at a time in this process.
    pub fn turn(&self) -> std::sync::MutexGuard<'_, ()> {
        self.turn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records that `indexes` are about to change, durably, in every open
    /// journal. The change must be made while the returned guard is held.
    pub fn touch(&self, indexes: &[u64]) -> std::io::Result<Touch<'_>> {
        let open = self.gate.read().unwrap_or_else(|p| p.into_inner());
        if !open.is_empty() && !indexes.is_empty() {
            let record = encode(indexes);
            for o in open.iter() {
                // O_APPEND: concurrent records never interleave.
                (&o.file)
                    .write_all(&record)
                    .and_then(|()| o.file.sync_data())
                    .map_err(|e| {
                        std::io::Error::new(
                            e.kind(),
                            format!("journal {}: {e}", path(&o.dir, o.seq).display()),
                        )
                    })?;
            }
        }
        Ok(Touch(open))
    }

    /// Whether any journal is open (a checkpoint was taken or restored).
    pub fn is_active(&self) -> bool {
        !self
            .gate
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
    }

    /// Starts checkpoint `seq` of `dir`: creates its (empty) journal and
    /// opens it beside the others. Returns the gate held exclusively: the
    /// caller snapshots the units, then drops it.
    pub fn begin(&self, dir: &Path, seq: u64) -> std::io::Result<Switch<'_>> {
        // A journal left by a checkpoint that did not finish is stale.
        match std::fs::remove_file(path(dir, seq)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let file = OpenOptions::new()
            .create_new(true)
            .append(true)
            .mode(0o600)
            .open(path(dir, seq))?;
        file.sync_all()?;
        let mut open = self.gate.write().unwrap_or_else(|p| p.into_inner());
        open.push(Open {
            dir: dir.to_path_buf(),
            seq,
            file,
        });
        Ok(Switch(open))
    }

    /// The gate held exclusively, the journals unchanged: no put or clear
    /// runs while it is held (a snapshot's instant).
    pub fn freeze(&self) -> Switch<'_> {
        Switch(self.gate.write().unwrap_or_else(|p| p.into_inner()))
    }

    /// Keeps writing `journal-<seq>` of `dir` (after a restore from it):
    /// appends to it from now on. Other journals of `dir` are closed.
    pub fn resume(&self, dir: &Path, seq: u64) -> std::io::Result<()> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path(dir, seq))?;
        // A torn last record (a crash mid-write) goes, so that the records
        // appended next stay aligned.
        let len = file.metadata()?.len();
        if len % 8 != 0 {
            file.set_len(len - len % 8)?;
            file.sync_all()?;
        }
        let mut open = self.gate.write().unwrap_or_else(|p| p.into_inner());
        open.retain(|o| o.dir != dir);
        open.push(Open {
            dir: dir.to_path_buf(),
            seq,
            file,
        });
        Ok(())
    }

    /// Stops writing the journals of every directory but `dir` (after a
    /// checkpoint to `dir` completed: only the newest checkpoint is kept
    /// current, so a job checkpointing to a new directory each step does
    /// not fsync one more journal per put each time). Each stopped journal
    /// gets a marker file (`journal-<seq>.stopped`, naming `dir`), fsynced
    /// before the journal closes: a restore of that checkpoint is refused,
    /// since what changed after the journal stopped is unknown.
    pub fn retire_others(&self, dir: &Path) {
        let why = format!("stopped when a checkpoint was written to {}", dir.display());
        self.retire(Some(dir), &why);
    }

    /// Stops writing every journal, each with its `.stopped` marker saying
    /// `why` (after a restore from a snapshot, which changed rows no
    /// journal recorded).
    pub fn retire_all(&self, why: &str) {
        self.retire(None, why);
    }

    fn retire(&self, keep: Option<&Path>, why: &str) {
        let mut open = self.gate.write().unwrap_or_else(|p| p.into_inner());
        open.retain(|o| {
            if Some(o.dir.as_path()) == keep {
                return true;
            }
            let marker = stopped_path(&o.dir, o.seq);
            let text = format!("{why}\n");
            let written = OpenOptions::new()
                .create(true)
                .truncate(true)
                .write(true)
                .mode(0o600)
                .open(&marker)
                .and_then(|mut f| f.write_all(text.as_bytes()).and_then(|()| f.sync_all()))
                .and_then(|()| File::open(&o.dir).and_then(|d| d.sync_all()));
            match written {
                Ok(()) => false,
                Err(e) => {
                    // Keep writing it rather than leave it restorable and stale.
                    tracing::warn!(journal = %path(&o.dir, o.seq).display(), error = %e,
                        "cannot mark a journal stopped: it is kept");
                    true
                }
            }
        });
    }

    /// Closes every journal of `dir` but `keep`'s (`None`: all of them).
    pub fn close(&self, dir: &Path, keep: Option<u64>) {
        let mut open = self.gate.write().unwrap_or_else(|p| p.into_inner());
        open.retain(|o| o.dir != dir || Some(o.seq) == keep);
    }

    /// The directories and sequence numbers of the open journals.
    pub fn open_journals(&self) -> Vec<(PathBuf, u64)> {
        let open = self.gate.read().unwrap_or_else(|p| p.into_inner());
        open.iter().map(|o| (o.dir.clone(), o.seq)).collect()
    }
}

/// The indexes recorded in a journal file, sorted and distinct (a torn
/// last record is ignored). A missing file is an error: without it nobody
/// can tell which rows changed after the checkpoint.
pub fn read(path: &Path) -> std::io::Result<Vec<u64>> {
    let mut bytes = Vec::new();
    File::open(path)?.read_to_end(&mut bytes)?;
    let mut out: Vec<u64> = bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Scratch(PathBuf);
    impl Scratch {
        fn path(&self) -> &Path {
            &self.0
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn records_survive_and_a_torn_tail_is_ignored() {
        let dir = std::env::temp_dir().join(format!("journal-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let dir = Scratch(dir);
        let j = Journal::new();
        // Not active: nothing written anywhere.
        drop(j.touch(&[1, 2]).unwrap());
        assert!(!j.is_active());
        drop(j.begin(dir.path(), 3).unwrap());
        drop(j.touch(&[7, 5]).unwrap());
        drop(j.touch(&[5, 9]).unwrap());
        assert_eq!(read(&path(dir.path(), 3)).unwrap(), vec![5, 7, 9]);
        // A torn record at the end.
        let mut f = OpenOptions::new()
            .append(true)
            .open(path(dir.path(), 3))
            .unwrap();
        f.write_all(&[1, 2, 3]).unwrap();
        assert_eq!(read(&path(dir.path(), 3)).unwrap(), vec![5, 7, 9]);
        // Resumed (after a restore), it is cut back to whole records.
        j.resume(dir.path(), 3).unwrap();
        assert_eq!(std::fs::metadata(path(dir.path(), 3)).unwrap().len(), 32);
        // A second checkpoint of the same directory: both written until
        // the older is closed.
        drop(j.begin(dir.path(), 4).unwrap());
        drop(j.touch(&[11]).unwrap());
        assert_eq!(read(&path(dir.path(), 3)).unwrap(), vec![5, 7, 9, 11]);
        assert_eq!(read(&path(dir.path(), 4)).unwrap(), vec![11]);
        j.close(dir.path(), Some(4));
        drop(j.touch(&[12]).unwrap());
        assert_eq!(read(&path(dir.path(), 3)).unwrap(), vec![5, 7, 9, 11]);
        assert_eq!(read(&path(dir.path(), 4)).unwrap(), vec![11, 12]);
        assert!(read(&path(dir.path(), 99)).is_err());
    }
}
