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
//! **Several directories.** A journaled checkpoint into another directory
//! leaves the journals already open as they are: each checkpoint stays
//! restorable, whoever wrote one elsewhere (each put then `fdatasync`s one
//! record per journal). At most `[checkpoint] max_journals` directories
//! are journaled at once ([`MAX_JOURNALS`] by default); past it a
//! journaled checkpoint into a new directory is refused, saying which are
//! journaled ([`Journal::check_room`]). A journaled directory that was
//! removed no longer counts: its journal is closed. Each journal is
//! reached through its directory's descriptor, so a checkpoint directory
//! moved elsewhere keeps a complete journal.
//!
//! **Restores and loads** change rows that no put or clear journaled: they
//! run under the gate held exclusively, and record every index they
//! change in every other open journal before they change it
//! ([`Switch::record`]); a restore then keeps writing its own
//! checkpoint's journal ([`Switch::resume`]) before it lets puts run
//! again, so no put falls between two journals.
//!
//! A torn last record (a crash mid-write, before its put was applied or
//! acknowledged) is ignored at restore.
//!
//! Cost: nothing until the first checkpoint; after it, one `write` and one
//! `fdatasync` per put or clear and journaled directory
//! (docs/benchmarks.md measures it).

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// The directory a journal lives in, as the journal uses it: a checkpoint
/// directory, reached by descriptor ([`crate::checkpoint::Dir`] is the
/// one implementation; the journal names no checkpoint type, so that the
/// store, which records into it, and the checkpoints, which read the
/// store, depend on it one way).
pub trait Dir: Send + Sync {
    /// Where it was opened (for messages).
    fn path(&self) -> &Path;
    /// Device and inode: the same directory wherever it is moved to.
    fn id(&self) -> (u64, u64);
    /// Whether it was removed since it was opened.
    fn removed(&self) -> bool;
    /// A second handle on the same directory.
    fn try_clone(&self) -> std::io::Result<Box<dyn Dir>>;
    /// Creates `name` (mode 0600; an existing one is an error).
    fn create(&self, name: &str) -> std::io::Result<File>;
    /// Opens `name` to append to it (made, mode 0600, if missing).
    fn append(&self, name: &str) -> std::io::Result<File>;
    /// Removes `name` (a missing one is fine).
    fn remove(&self, name: &str) -> std::io::Result<()>;
    /// Makes its entries durable.
    fn sync(&self) -> std::io::Result<()>;
}

/// Most checkpoint directories whose journals one `stowd` keeps at once,
/// unless configured (`[checkpoint] max_journals`).
pub const MAX_JOURNALS: usize = 4;

/// The journal file's name of checkpoint `seq`.
pub fn name(seq: u64) -> String {
    format!("journal-{seq}")
}

/// The journal file of checkpoint `seq` in `dir` (for messages).
pub fn path(dir: &Path, seq: u64) -> PathBuf {
    dir.join(name(seq))
}

/// The name of the marker an earlier `stowd` left when it stopped writing
/// the journal of checkpoint `seq` (such a checkpoint is not restored).
pub fn stopped_name(seq: u64) -> String {
    format!("journal-{seq}.stopped")
}

/// One open journal file, and its directory (by descriptor: wherever the
/// directory is moved to, the journal written is the one in it).
struct Open {
    dir: Box<dyn Dir>,
    seq: u64,
    file: File,
    /// The file's length, and one append at a time: a record that cannot
    /// be written whole (a full disk) is cut off before the next one goes
    /// after it, so the records stay aligned.
    append: Mutex<u64>,
}

/// The journals of every checkpoint directory this `stowd` keeps current.
pub struct Journal {
    /// The open journal files. Shared by puts and clears (which append),
    /// exclusive for a checkpoint's switch to a new file.
    gate: RwLock<Vec<Open>>,
    /// One checkpoint or restore at a time.
    turn: Mutex<()>,
    /// Most directories journaled at once.
    max: usize,
}

impl Default for Journal {
    fn default() -> Journal {
        Journal::with_max(MAX_JOURNALS)
    }
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal").finish_non_exhaustive()
    }
}

/// Held by a put or clear from its journal write until its unit changed.
pub struct Touch<'a>(#[allow(dead_code)] RwLockReadGuard<'a, Vec<Open>>);

/// The gate held exclusively: no put or clear runs meanwhile. A
/// checkpoint snapshots the units under it; a restore or load journals and
/// makes its change under it.
pub struct Switch<'a>(RwLockWriteGuard<'a, Vec<Open>>);

fn encode(indexes: &[u64]) -> Vec<u8> {
    let mut out = Vec::with_capacity(indexes.len() * 8);
    for g in indexes {
        out.extend_from_slice(&g.to_le_bytes());
    }
    out
}

/// Appends `record` to `o`'s journal, durably. A record that cannot be
/// written whole is cut off again.
fn append(o: &Open, record: &[u8]) -> std::io::Result<()> {
    let written = {
        let mut len = o.append.lock().unwrap_or_else(|p| p.into_inner());
        let written = (&o.file).write_all(record);
        match written {
            Ok(()) => *len += record.len() as u64,
            Err(_) => {
                let _ = o.file.set_len(*len);
            }
        }
        written
    };
    written.and_then(|()| o.file.sync_data()).map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("journal {}: {e}", path(o.dir.path(), o.seq).display()),
        )
    })
}

impl Journal {
    pub fn new() -> Journal {
        Journal::default()
    }

    /// A journal keeping at most `max` directories' journals at once.
    pub fn with_max(max: usize) -> Journal {
        Journal {
            gate: RwLock::default(),
            turn: Mutex::default(),
            max: max.max(1),
        }
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
                append(o, &record)?;
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

    /// Whether a journaled checkpoint into `dir` may begin: the journals
    /// of directories removed since are closed first (nothing can restore
    /// them), then at most `max` directories may be journaled, `dir`
    /// counted. Err: why not, naming the journaled directories.
    pub fn check_room(&self, dir: &dyn Dir) -> Result<(), String> {
        let mut open = self.gate.write().unwrap_or_else(|p| p.into_inner());
        open.retain(|o| {
            let gone = o.dir.removed();
            if gone {
                tracing::info!(dir = %o.dir.path().display(), seq = o.seq,
                    "checkpoint directory removed: its journal is closed");
            }
            !gone
        });
        let mut dirs: Vec<(u64, u64)> = open.iter().map(|o| o.dir.id()).collect();
        dirs.sort_unstable();
        dirs.dedup();
        if dirs.contains(&dir.id()) || dirs.len() < self.max {
            return Ok(());
        }
        let shown: Vec<String> = open
            .iter()
            .map(|o| path(o.dir.path(), o.seq).display().to_string())
            .collect();
        Err(format!(
            "stowd already journals {} checkpoint directories ([checkpoint] max_journals): {}. \
             A journaled checkpoint elsewhere would stop one of them and make it unrestorable: \
             checkpoint into one of those directories, remove one that is no longer needed, \
             take a snapshot (journal: false), or raise max_journals",
            dirs.len(),
            shown.join(", ")
        ))
    }

    /// Starts checkpoint `seq` of `dir`: creates its (empty) journal and
    /// opens it beside the others. Returns the gate held exclusively: the
    /// caller snapshots the units, then drops it.
    pub fn begin(&self, dir: &dyn Dir, seq: u64) -> std::io::Result<Switch<'_>> {
        // A journal left by a checkpoint that did not finish is stale.
        dir.remove(&name(seq))?;
        let file = dir.create(&name(seq))?;
        file.sync_all()?;
        dir.sync()?;
        let mut open = self.gate.write().unwrap_or_else(|p| p.into_inner());
        open.push(Open {
            dir: dir.try_clone()?,
            seq,
            file,
            append: Mutex::new(0),
        });
        Ok(Switch(open))
    }

    /// The gate held exclusively, the journals unchanged: no put or clear
    /// runs while it is held.
    pub fn freeze(&self) -> Switch<'_> {
        Switch(self.gate.write().unwrap_or_else(|p| p.into_inner()))
    }

    /// Closes every journal of `dir` but `keep`'s (`None`: all of them).
    pub fn close(&self, dir: &dyn Dir, keep: Option<u64>) {
        let mut open = self.gate.write().unwrap_or_else(|p| p.into_inner());
        open.retain(|o| o.dir.id() != dir.id() || Some(o.seq) == keep);
    }

    /// The directories (as opened) and sequence numbers of the open
    /// journals.
    pub fn open_journals(&self) -> Vec<(PathBuf, u64)> {
        let open = self.gate.read().unwrap_or_else(|p| p.into_inner());
        open.iter()
            .map(|o| (o.dir.path().to_path_buf(), o.seq))
            .collect()
    }

    /// Whether a journal of the directory `id` (device, inode) is open.
    pub fn journals_dir(&self, id: (u64, u64)) -> bool {
        let open = self.gate.read().unwrap_or_else(|p| p.into_inner());
        open.iter().any(|o| o.dir.id() == id)
    }
}

impl Switch<'_> {
    /// Whether `journal-<seq>` of `dir` is open: every change since that
    /// checkpoint is in it.
    pub fn is_open(&self, dir: &dyn Dir, seq: u64) -> bool {
        self.0
            .iter()
            .any(|o| o.dir.id() == dir.id() && o.seq == seq)
    }

    /// Records `indexes` in every open journal but those of the directory
    /// `except`, durably (the change they describe is made while the gate
    /// is held).
    pub fn record(&self, indexes: &[u64], except: Option<&dyn Dir>) -> std::io::Result<()> {
        if indexes.is_empty() {
            return Ok(());
        }
        let record = encode(indexes);
        for o in self.0.iter() {
            if except.is_none_or(|d| d.id() != o.dir.id()) {
                append(o, &record)?;
            }
        }
        Ok(())
    }

    /// Keeps writing `journal-<seq>` of `dir` (after a restore from it),
    /// first appending `lost` to it: appends to it from now on. Other
    /// journals of `dir` are closed.
    pub fn resume(&mut self, dir: &dyn Dir, seq: u64, lost: &[u64]) -> std::io::Result<()> {
        let file = dir.append(&name(seq))?;
        // A torn last record (a crash mid-write) goes, so that the records
        // appended next stay aligned.
        let mut len = file.metadata()?.len();
        if len % 8 != 0 {
            len -= len % 8;
            file.set_len(len)?;
        }
        if !lost.is_empty() {
            let record = encode(lost);
            if let Err(e) = (&file).write_all(&record) {
                let _ = file.set_len(len);
                return Err(e);
            }
            len += record.len() as u64;
        }
        file.sync_all()?;
        let o = Open {
            dir: dir.try_clone()?,
            seq,
            file,
            append: Mutex::new(len),
        };
        self.0.retain(|x| x.dir.id() != dir.id());
        self.0.push(o);
        Ok(())
    }
}

/// The indexes recorded in a journal file, sorted and distinct (a torn
/// last record is ignored).
pub fn read(mut file: File) -> std::io::Result<Vec<u64>> {
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
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
    use crate::checkpoint::Dir as CheckpointDir;

    struct Scratch(PathBuf);
    impl Scratch {
        fn new(tag: &str) -> Scratch {
            let dir = std::env::temp_dir().join(format!("journal-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
            Scratch(dir)
        }
        fn dir(&self) -> CheckpointDir {
            CheckpointDir::open(&self.0).unwrap()
        }
        fn read(&self, seq: u64) -> std::io::Result<Vec<u64>> {
            read(File::open(path(&self.0, seq))?)
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn records_survive_and_a_torn_tail_is_ignored() {
        let s = Scratch::new("unit");
        let dir = s.dir();
        let j = Journal::new();
        // Not active: nothing written anywhere.
        drop(j.touch(&[1, 2]).unwrap());
        assert!(!j.is_active());
        drop(j.begin(&dir, 3).unwrap());
        drop(j.touch(&[7, 5]).unwrap());
        drop(j.touch(&[5, 9]).unwrap());
        assert_eq!(s.read(3).unwrap(), vec![5, 7, 9]);
        // A torn record at the end.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(path(&s.0, 3))
            .unwrap();
        f.write_all(&[1, 2, 3]).unwrap();
        assert_eq!(s.read(3).unwrap(), vec![5, 7, 9]);
        // Resumed (after a restore), it is cut back to whole records and
        // the lost indexes appended.
        j.freeze().resume(&dir, 3, &[4]).unwrap();
        assert_eq!(std::fs::metadata(path(&s.0, 3)).unwrap().len(), 40);
        // A second checkpoint of the same directory: both written until
        // the older is closed.
        drop(j.begin(&dir, 4).unwrap());
        drop(j.touch(&[11]).unwrap());
        assert_eq!(s.read(3).unwrap(), vec![4, 5, 7, 9, 11]);
        assert_eq!(s.read(4).unwrap(), vec![11]);
        j.close(&dir, Some(4));
        drop(j.touch(&[12]).unwrap());
        assert_eq!(s.read(3).unwrap(), vec![4, 5, 7, 9, 11]);
        assert_eq!(s.read(4).unwrap(), vec![11, 12]);
        assert!(s.read(99).is_err());
    }

    /// A checkpoint elsewhere leaves a journal open; past `max` directories
    /// one more is refused, and a removed directory's journal is closed
    /// and no longer counts. A journal follows its directory when moved.
    #[test]
    fn several_directories_up_to_the_limit() {
        let (a, b, c) = (Scratch::new("a"), Scratch::new("b"), Scratch::new("c"));
        let j = Journal::with_max(2);
        j.check_room(&a.dir()).unwrap();
        drop(j.begin(&a.dir(), 1).unwrap());
        j.check_room(&b.dir()).unwrap();
        drop(j.begin(&b.dir(), 1).unwrap());
        drop(j.touch(&[8]).unwrap());
        assert_eq!(a.read(1).unwrap(), vec![8]);
        assert_eq!(b.read(1).unwrap(), vec![8]);
        // A third directory: refused, naming both.
        let e = j.check_room(&c.dir()).unwrap_err();
        assert!(
            e.contains("max_journals") && e.contains(&a.0.display().to_string()),
            "{e}"
        );
        // The same directory again is fine.
        j.check_room(&a.dir()).unwrap();
        // b moved: its journal follows it.
        let moved = std::env::temp_dir().join(format!("journal-b-moved-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&moved);
        std::fs::rename(&b.0, &moved).unwrap();
        drop(j.touch(&[9]).unwrap());
        assert_eq!(
            read(File::open(moved.join("journal-1")).unwrap()).unwrap(),
            vec![8, 9]
        );
        // Removed: closed, and c has room.
        std::fs::remove_dir_all(&moved).unwrap();
        j.check_room(&c.dir()).unwrap();
        assert_eq!(j.open_journals().len(), 1);
        // The frozen gate records in every journal but the one excepted.
        drop(j.begin(&c.dir(), 1).unwrap());
        j.freeze().record(&[21], Some(&c.dir())).unwrap();
        assert_eq!(a.read(1).unwrap(), vec![8, 9, 21]);
        assert_eq!(c.read(1).unwrap(), Vec::<u64>::new());
    }
}
