//! Checkpoint directories: `stowd`'s own checkpoints of every local unit
//! (the `stowage/1` `checkpoint` and `restore` ops, `stowd checkpoint`,
//! `stowd serve --restore`).
//!
//! A directory holds at most one complete checkpoint, numbered `seq`:
//!
//! | file | what |
//! |---|---|
//! | `manifest.json` | [`MANIFEST_FORMAT`], `seq`, when, the units, and per unit file its name, rows, bytes, size and SHA-256 |
//! | `unit-<seq>-<i>.safetensors` | the rows of the `i`-th routed unit, in the unit file format of [`super`] |
//! | `journal-<seq>` | the global indexes put or cleared since checkpoint `seq` began ([`crate::journal`]) |
//! | `journal-<seq>.stopped` | only if this `stowd` then completed a checkpoint in another directory: the journal stopped there, and this checkpoint can no longer be restored |
//!
//! **Snapshots** (`checkpoint` with `journal: false`; TransferQueue's
//! `save_checkpoint` through the native backend) have no journal: the
//! manifest says `"journal": false`, writing one leaves the journals this
//! `stowd` keeps as they are, and a restore loads every row as it was
//! written, whatever changed after (the semantics of TransferQueue's own
//! storage checkpoints). A restore from a snapshot changes rows no open
//! journal records, so it stops every open journal (`.stopped` marker, as
//! [`crate::journal::Journal::retire_others`]): those checkpoints can no
//! longer be restored, rather than be restored wrong. A snapshot is not
//! written into a directory whose journal is open.
//!
//! **Writing** (one at a time per `stowd`): the journal of `seq` is opened
//! and every unit snapshotted under the journal's gate (so every later put
//! is in the new journal), then the unit files are written with no lock
//! held (puts and gets go on; the snapshot shares the stored extents),
//! each fsynced and hashed, then `manifest.json` is written to a temporary
//! name, fsynced, and **renamed into place: the one step that makes the
//! checkpoint visible.** Then the previous checkpoint's files and journal
//! go. A crash before the rename leaves the previous checkpoint and its
//! journal (written all along) as they were; leftovers of the unfinished
//! one are removed by the next checkpoint.
//!
//! **Restoring** maps each unit file read-only (the rows stay file-backed
//! pages, not anonymous memory) and checks its SHA-256 against the
//! manifest **in one hashing pass at restore, before anything is
//! replaced**; a file whose bytes differ is refused, naming it. Rows whose
//! index is in the journal are not loaded: those indexes are marked lost
//! and a get of them fails with `data_lost` naming the checkpoint, until
//! they are put again. The rows are routed `g % N` over the units the
//! restoring `stowd` routes to (their number may differ from the
//! checkpoint's). From then on the journal of `seq` is written again.
//!
//! The directory is created `0700` and its files `0600`. A restored row is
//! a mapping of its checkpoint file: nothing but `stowd` may change the
//! files of a directory it restored from while it serves them (a later
//! checkpoint into the same directory writes new files and unlinks the old
//! ones, which leaves existing mappings intact).

use std::fs::{DirBuilder, File};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use sha2::{Digest, Sha256};

use super::{CheckpointError, hex, io, parse, replace, save_snapshot, split};
use crate::journal::{self, Journal};
use crate::store::{Snapshot, Unit};

/// The `format` of a checkpoint directory's manifest.
pub const MANIFEST_FORMAT: &str = "stowage-checkpoint/1";

/// The manifest's name in a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";

/// One unit file of a checkpoint.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct FileEntry {
    pub file: String,
    pub unit: String,
    pub rows: u64,
    pub bytes: u64,
    pub size: u64,
    pub sha256: String,
}

/// `manifest.json`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct Manifest {
    pub format: String,
    pub seq: u64,
    pub created_unix_ms: u64,
    pub files: Vec<FileEntry>,
    /// Whether `journal-<seq>` records what changed after this checkpoint
    /// (absent in manifests written before snapshots existed: true). A
    /// snapshot (false) has no journal and is restored as it was written.
    #[serde(default = "journaled_default")]
    pub journal: bool,
}

fn journaled_default() -> bool {
    true
}

/// A checkpoint written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Written {
    pub seq: u64,
    pub rows: u64,
    pub bytes: u64,
    pub files: u64,
}

/// A checkpoint restored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Restored {
    pub seq: u64,
    pub rows: u64,
    pub lost: u64,
    /// Time spent mapping the files and checking their SHA-256.
    pub verify: std::time::Duration,
    /// Time of the whole restore.
    pub total: std::time::Duration,
}

/// How errors and lost rows name checkpoint `seq` of `dir`.
pub fn name(dir: &Path, seq: u64) -> String {
    format!("{}#{seq}", dir.display())
}

fn refused(path: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::Refused {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

/// The checkpoint directory a request names: an absolute path that is not
/// a symbolic link. `create`: made (mode 0700, parents too) if missing.
pub fn checked(dir: &str, create: bool) -> Result<PathBuf, CheckpointError> {
    let path = PathBuf::from(dir);
    if !path.is_absolute() {
        return Err(refused(
            &path,
            "a checkpoint directory must be an absolute path",
        ));
    }
    match std::fs::symlink_metadata(&path) {
        Ok(m) if m.file_type().is_symlink() => Err(refused(
            &path,
            "a checkpoint directory may not be a symbolic link",
        )),
        Ok(m) if !m.is_dir() => Err(refused(&path, "not a directory")),
        Ok(_) => Ok(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {
            DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&path)
                .map_err(io(&path))?;
            Ok(path)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(refused(&path, "no such checkpoint directory"))
        }
        Err(e) => Err(io(&path)(e)),
    }
}

/// The manifest of `dir`, if it has one.
pub fn manifest(dir: &Path) -> Result<Option<Manifest>, CheckpointError> {
    let path = dir.join(MANIFEST);
    let text = match std::fs::read(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(&path)(e)),
    };
    let m: Manifest = serde_json::from_slice(&text)
        .map_err(|e| refused(&path, format!("not a checkpoint manifest: {e}")))?;
    if m.format != MANIFEST_FORMAT {
        return Err(refused(
            &path,
            format!(
                "format {:?}, this stowd reads {MANIFEST_FORMAT:?}",
                m.format
            ),
        ));
    }
    for f in &m.files {
        if f.file.contains('/') || f.file.starts_with('.') {
            return Err(refused(
                &path,
                format!("file name {:?} is not in the directory", f.file),
            ));
        }
    }
    Ok(Some(m))
}

/// The sequence number in one of our file names (`unit-<seq>-<i>...`,
/// `journal-<seq>`).
fn seq_of(name: &str) -> Option<u64> {
    let rest = name
        .strip_prefix("unit-")
        .or_else(|| name.strip_prefix("journal-"))?;
    let digits = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..digits].parse().ok()
}

/// Removes our files of every checkpoint but `keep`, and temporary files.
fn remove_others(dir: &Path, keep: u64) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let stale = match seq_of(&name) {
            Some(s) => s != keep,
            None => name.starts_with(".unit-") || name.starts_with(".manifest."),
        };
        if stale && let Err(err) = std::fs::remove_file(e.path()) {
            tracing::warn!(file = %e.path().display(), error = %err, "could not remove an old checkpoint file");
        }
    }
}

/// SHA-256 and size of a file, read once.
fn sha256_file(path: &Path) -> Result<(u64, String), CheckpointError> {
    let mut f = File::open(path).map_err(io(path))?;
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(io(path))?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
        size += n as u64;
    }
    Ok((size, hex(&hash.finalize())))
}

fn sync_dir(dir: &Path) -> Result<(), CheckpointError> {
    File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

/// Writes a checkpoint of `units` (in routing order) to `dir` (see the
/// module docs); with `journaled` false, a snapshot.
pub fn checkpoint(
    units: &[Arc<Unit>],
    journal: &Journal,
    dir: &Path,
    journaled: bool,
) -> Result<Written, CheckpointError> {
    let _one = journal.turn();
    if !journaled && journal.open_journals().iter().any(|(d, _)| d == dir) {
        return Err(refused(
            &dir.join(MANIFEST),
            "stowd journals its checkpoint in this directory: a snapshot goes to another one",
        ));
    }
    let previous = match manifest(dir) {
        Ok(m) => m.map(|m| m.seq),
        // An unreadable manifest names no usable checkpoint: the new one
        // replaces it.
        Err(e) => {
            tracing::warn!(error = %e, "replacing an unreadable checkpoint manifest");
            None
        }
    };
    let highest = std::fs::read_dir(dir)
        .map_err(io(dir))?
        .flatten()
        .filter_map(|e| seq_of(&e.file_name().to_string_lossy()))
        .max();
    let seq = previous.max(highest).map_or(1, |s| s + 1);
    let snapshots: Vec<Snapshot> = {
        // Every unit at one instant: no put or clear runs while the gate is held.
        let _switch = if journaled {
            journal
                .begin(dir, seq)
                .map_err(io(&journal::path(dir, seq)))?
        } else {
            journal.freeze()
        };
        units.iter().map(|u| u.snapshot()).collect()
    };
    let written = write_files(units, &snapshots, dir, seq).and_then(|(files, w)| {
        let m = Manifest {
            format: MANIFEST_FORMAT.into(),
            seq,
            created_unix_ms: std::time::UNIX_EPOCH
                .elapsed()
                .map_or(0, |d| d.as_millis() as u64),
            files,
            journal: journaled,
        };
        write_manifest(dir, &m).map(|()| w)
    });
    match written {
        Ok(w) => {
            if journaled {
                journal.close(dir, Some(seq));
                journal.retire_others(dir);
            }
            remove_others(dir, seq);
            Ok(w)
        }
        Err(e) => {
            // The previous checkpoint (if any) stays, with its journal.
            if journaled {
                journal.close(dir, previous);
            }
            if let Ok(entries) = std::fs::read_dir(dir) {
                for e in entries.flatten() {
                    if seq_of(&e.file_name().to_string_lossy()) == Some(seq) {
                        let _ = std::fs::remove_file(e.path());
                    }
                }
            }
            Err(e)
        }
    }
}

fn write_files(
    units: &[Arc<Unit>],
    snapshots: &[Snapshot],
    dir: &Path,
    seq: u64,
) -> Result<(Vec<FileEntry>, Written), CheckpointError> {
    let mut files = Vec::new();
    let mut total = Written {
        seq,
        rows: 0,
        bytes: 0,
        files: 0,
    };
    for (i, (unit, snapshot)) in units.iter().zip(snapshots).enumerate() {
        let file = format!("unit-{seq}-{i}.safetensors");
        let path = dir.join(&file);
        let saved = save_snapshot(unit.id(), snapshot, &path, false)?;
        let (size, sha256) = sha256_file(&path)?;
        total.rows += saved.rows;
        total.bytes += saved.bytes;
        total.files += 1;
        files.push(FileEntry {
            file,
            unit: unit.id().to_string(),
            rows: saved.rows,
            bytes: saved.bytes,
            size,
            sha256,
        });
    }
    Ok((files, total))
}

fn write_manifest(dir: &Path, m: &Manifest) -> Result<(), CheckpointError> {
    let tmp = dir.join(format!(".manifest.{}.tmp", std::process::id()));
    let path = dir.join(MANIFEST);
    let json = serde_json::to_vec_pretty(m).map_err(|e| refused(&path, e.to_string()))?;
    let written = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| f.write_all(&json).and_then(|()| f.sync_all()))
        .map_err(io(&tmp))
        .and_then(|()| std::fs::rename(&tmp, &path).map_err(io(&path)))
        .and_then(|()| sync_dir(dir));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// Maps a unit file read-only and checks its size and SHA-256 against the
/// manifest.
fn map_verified(dir: &Path, entry: &FileEntry) -> Result<Bytes, CheckpointError> {
    let path = dir.join(&entry.file);
    let file = File::open(&path).map_err(io(&path))?;
    let size = file.metadata().map_err(io(&path))?.len();
    if size != entry.size {
        return Err(refused(
            &path,
            format!(
                "the file is {size} bytes, the manifest says {}: it was changed after the checkpoint",
                entry.size
            ),
        ));
    }
    if size == 0 {
        return Err(refused(&path, "empty file"));
    }
    // SAFETY: checkpoint files are written once under a fresh name and
    // never changed by stowd; the directory is private to stowd's user
    // (module docs).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io(&path))?;
    let _ = map.advise(memmap2::Advice::Sequential);
    let found = hex(&Sha256::digest(&map[..]));
    if found != entry.sha256 {
        return Err(CheckpointError::Checksum {
            path,
            saved: entry.sha256.clone(),
            found,
        });
    }
    Ok(Bytes::from_owner(map))
}

/// Replaces the rows of `units` (in routing order: row `g` goes to
/// `units[g % N]`) with the checkpoint in `dir` (see the module docs).
/// Nothing changes unless every file was read and verified and every part
/// fits its unit.
pub fn restore(
    units: &[Arc<Unit>],
    journal: &Journal,
    dir: &Path,
) -> Result<Restored, CheckpointError> {
    let _one = journal.turn();
    let Some(m) = manifest(dir)? else {
        return Err(refused(
            &dir.join(MANIFEST),
            "no checkpoint in this directory (no manifest.json)",
        ));
    };
    let journal_path = journal::path(dir, m.seq);
    if !m.journal {
        return restore_snapshot(units, journal, dir, &m);
    }
    if let Ok(why) = std::fs::read_to_string(journal::stopped_path(dir, m.seq)) {
        return Err(refused(
            &journal_path,
            format!(
                "this checkpoint's journal {}: rows written or cleared after that are unknown, \
                 so nothing is restored (restore the newer checkpoint)",
                why.trim()
            ),
        ));
    }
    let lost = journal::read(&journal_path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => refused(
            &journal_path,
            "the checkpoint's journal is missing: without it the rows written or cleared \
             after the checkpoint cannot be told from the others, so nothing is restored",
        ),
        _ => io(&journal_path)(e),
    })?;
    let begun = std::time::Instant::now();
    let n = units.len() as u64;
    let (parts, rows, verify) = load(units, dir, &m, |g: u64| {
        lost.binary_search(&g).is_err().then_some((g % n) as usize)
    })?;
    // Restoring is not a change the restored checkpoint's journal records;
    // every change after it is, whether the restore succeeds or not.
    journal.close(dir, None);
    let units_ref: Vec<&Unit> = units.iter().map(|u| u.as_ref()).collect();
    let replaced = replace(&units_ref, parts, dir, true);
    if replaced.is_ok() {
        let checkpoint: Arc<str> = Arc::from(name(dir, m.seq));
        for (i, unit) in units.iter().enumerate() {
            let mine: Vec<u64> = lost.iter().copied().filter(|g| g % n == i as u64).collect();
            unit.set_lost(&mine, &checkpoint);
        }
    }
    journal.resume(dir, m.seq).map_err(io(&journal_path))?;
    replaced?;
    Ok(Restored {
        seq: m.seq,
        rows,
        lost: lost.len() as u64,
        verify,
        total: begun.elapsed(),
    })
}

/// The rows of checkpoint `m` of `dir`, verified and split over `units` by
/// `to` (None: not loaded), checked to fit them: (the parts, the rows read,
/// the time spent verifying). Nothing is changed.
fn load(
    units: &[Arc<Unit>],
    dir: &Path,
    m: &Manifest,
    to: impl Fn(u64) -> Option<usize> + Copy,
) -> Result<(Vec<Snapshot>, u64, std::time::Duration), CheckpointError> {
    let mut verify = std::time::Duration::ZERO;
    let mut parts: Vec<Snapshot> = units.iter().map(|_| Vec::new()).collect();
    let mut rows = 0u64;
    for entry in &m.files {
        let path = dir.join(&entry.file);
        let started = std::time::Instant::now();
        let file = map_verified(dir, entry)?;
        verify += started.elapsed();
        rows += split(parse(file, &path, false)?, &mut parts, to);
    }
    for (_, stored) in parts.iter_mut().flatten() {
        let all: Vec<u64> = stored
            .iter()
            .flat_map(|s| s.indexes().iter().copied())
            .collect();
        if let Some(g) = crate::store::duplicate(&all) {
            return Err(refused(
                &dir.join(MANIFEST),
                format!("global index {g} is in two files of one field"),
            ));
        }
    }
    for (unit, part) in units.iter().zip(&parts) {
        unit.check_replace(part)
            .map_err(|source| CheckpointError::Store {
                path: dir.to_path_buf(),
                source,
            })?;
    }
    Ok((parts, rows, verify))
}

/// `restore` of a snapshot: every row as written, nothing lost; every open
/// journal stops (see the module docs).
fn restore_snapshot(
    units: &[Arc<Unit>],
    journal: &Journal,
    dir: &Path,
    m: &Manifest,
) -> Result<Restored, CheckpointError> {
    let begun = std::time::Instant::now();
    let n = units.len() as u64;
    let (parts, rows, verify) = load(units, dir, m, |g: u64| Some((g % n) as usize))?;
    journal.retire_all(&format!(
        "stopped when snapshot {} was restored",
        name(dir, m.seq)
    ));
    let units_ref: Vec<&Unit> = units.iter().map(|u| u.as_ref()).collect();
    replace(&units_ref, parts, dir, true)?;
    Ok(Restored {
        seq: m.seq,
        rows,
        lost: 0,
        verify,
        total: begun.elapsed(),
    })
}

/// Makes `path` private to stowd's user (a checkpoint file).
pub(crate) fn private(path: &Path) -> std::io::Result<()> {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
}
