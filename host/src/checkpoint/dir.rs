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
//! | `journal-<seq>.stopped` | only from an earlier `stowd`, which stopped writing that journal: this checkpoint can no longer be restored |
//!
//! The directory is reached through [`super::confine`]: under
//! `[checkpoint] roots`, no symbolic link below the root, owned by
//! `stowd`'s user and not writable by others; every file in it is opened,
//! created (temporary files `O_EXCL`), renamed and removed through its
//! descriptor. A directory whose `manifest.json` is not a `stowd`
//! manifest is refused, never overwritten. The next `seq` is one more
//! than the manifest's and than any name `stowd` makes (`unit-<seq>-<i>
//! .safetensors`, `journal-<seq>`, exactly: `journal-2024-12.md` is not
//! one). After a checkpoint `stowd` removes the files the previous
//! manifest names, its journal, and the files of unfinished checkpoints
//! (names of its making with another `seq`); nothing else.
//!
//! **Snapshots** (`checkpoint` with `journal: false`; TransferQueue's
//! `save_checkpoint` through the native backend) have no journal: the
//! manifest says `"journal": false`, writing one leaves the journals this
//! `stowd` keeps as they are, and a restore loads every row as it was
//! written, whatever changed after (the semantics of TransferQueue's own
//! storage checkpoints). A snapshot is not written into a directory whose
//! journal is open.
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
//! one are removed by the next checkpoint. A journaled checkpoint into
//! another directory leaves this one's journal open: a checkpoint written
//! elsewhere never makes this one unrestorable ([`crate::journal`]: at
//! most `[checkpoint] max_journals` directories; past it a new one is
//! refused).
//!
//! **Restoring** maps each unit file read-only (the rows stay file-backed
//! pages, not anonymous memory) and checks its SHA-256 against the
//! manifest **in one hashing pass at restore, before anything is
//! replaced**; a file whose bytes differ is refused, naming it. Then,
//! with the journal's gate held exclusively (no put or clear runs), the
//! indexes lost are settled: those in the journal, and, if this `stowd`
//! was not writing that journal, every index the units hold now (put
//! since the journal was last written). Those rows are not loaded: their
//! indexes are marked lost and a get of them fails with `data_lost`
//! naming the checkpoint, until they are put again. Every unit's new rows
//! are made ready (a part that does not fit refuses the whole restore,
//! every unit unchanged); every other open journal records each index the
//! restore changes; the checkpoint's journal gets the lost indexes it did
//! not hold and is written from then on; then each unit takes its rows at
//! once. The rows are routed `g % N` over the units the restoring `stowd`
//! routes to (their number may differ from the checkpoint's).
//!
//! The directory is created `0700` and its files `0600`. A restored row is
//! a mapping of its checkpoint file: nothing but `stowd` may change the
//! files of a directory it restored from while it serves them (a later
//! checkpoint into the same directory writes new files and unlinks the old
//! ones, which leaves existing mappings intact).

use std::io::Read;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use sha2::{Digest, Sha256};

use super::{CheckpointError, Dir, affected, hex, io, parse, save_snapshot, split};
use crate::journal::{self, Journal};
use crate::store::{Snapshot, Unit};

/// The `format` of a checkpoint directory's manifest.
pub const MANIFEST_FORMAT: &str = "stowage-checkpoint/1";

/// The manifest's name in a checkpoint directory.
pub const MANIFEST: &str = "manifest.json";

/// Largest manifest read (one of a million units would be smaller).
const MAX_MANIFEST: u64 = 64 << 20;

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

/// The name of unit file `i` of checkpoint `seq`.
fn unit_file(seq: u64, i: usize) -> String {
    format!("unit-{seq}-{i}.safetensors")
}

/// The decimal number `s` is, written as `stowd` writes it (no sign, no
/// leading zero).
fn number(s: &str) -> Option<u64> {
    let ok =
        !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) && (s == "0" || !s.starts_with('0'));
    ok.then(|| s.parse().ok()).flatten()
}

/// The checkpoint a name of `stowd`'s making belongs to: `unit-<seq>-<i>
/// .safetensors`, `journal-<seq>`, `journal-<seq>.stopped`, and the
/// temporary files `.unit-<seq>-<i>.safetensors.<pid>.<n>.tmp` (None for
/// `.manifest.<pid>.<n>.tmp`). Exact: `journal-2024-12.md` or
/// `unit-7-notes.txt` are not ours.
pub(crate) fn ours(name: &str) -> Option<Option<u64>> {
    if let Some(rest) = name
        .strip_prefix(".manifest.")
        .and_then(|r| r.strip_suffix(".tmp"))
    {
        let mut p = rest.split('.');
        let ok = p.next().and_then(number).is_some()
            && p.next().and_then(number).is_some()
            && p.next().is_none();
        return ok.then_some(None);
    }
    let (name, temp) = match name.strip_prefix('.').and_then(|r| r.strip_suffix(".tmp")) {
        Some(inner) => {
            let mut parts = inner.rsplitn(3, '.');
            let (n, pid) = (parts.next()?, parts.next()?);
            number(n)?;
            number(pid)?;
            (parts.next()?, true)
        }
        None => (name, false),
    };
    if let Some(rest) = name
        .strip_prefix("unit-")
        .and_then(|r| r.strip_suffix(".safetensors"))
    {
        let (seq, i) = rest.split_once('-')?;
        number(i)?;
        return Some(Some(number(seq)?));
    }
    if temp {
        return None;
    }
    let rest = name.strip_prefix("journal-")?;
    let rest = rest.strip_suffix(".stopped").unwrap_or(rest);
    Some(Some(number(rest)?))
}

/// A manifest's bytes, checked: its format, and that it names only unit
/// files of its own checkpoint.
pub fn parse_manifest(bytes: &[u8], path: &Path) -> Result<Manifest, CheckpointError> {
    let m: Manifest = serde_json::from_slice(bytes)
        .map_err(|e| refused(path, format!("not a checkpoint manifest: {e}")))?;
    if m.format != MANIFEST_FORMAT {
        return Err(refused(
            path,
            format!(
                "format {:?}, this stowd reads {MANIFEST_FORMAT:?}",
                m.format
            ),
        ));
    }
    for (i, f) in m.files.iter().enumerate() {
        if f.file != unit_file(m.seq, i) {
            return Err(refused(
                path,
                format!(
                    "file {i} is named {:?}, not {:?}: a manifest names only the unit files \
                     of its own checkpoint, in the directory",
                    f.file,
                    unit_file(m.seq, i)
                ),
            ));
        }
    }
    Ok(m)
}

/// The manifest of `dir`, if it has one.
pub fn manifest(dir: &Dir) -> Result<Option<Manifest>, CheckpointError> {
    let path = dir.join(MANIFEST);
    let Some((file, size)) = dir.read(MANIFEST)? else {
        return Ok(None);
    };
    if size > MAX_MANIFEST {
        return Err(refused(
            &path,
            format!("{size} bytes: not a checkpoint manifest (at most {MAX_MANIFEST})"),
        ));
    }
    let mut text = Vec::with_capacity(size as usize);
    file.take(MAX_MANIFEST)
        .read_to_end(&mut text)
        .map_err(io(&path))?;
    parse_manifest(&text, &path).map(Some)
}

/// Removes the files of the checkpoint `previous` named (its unit files,
/// its journal and marker), and what unfinished checkpoints of `stowd`
/// left (names only `stowd` makes, [`ours`]); never the files of `keep`,
/// nor any other file.
fn remove_others(dir: &Dir, previous: Option<&Manifest>, keep: u64) {
    let mut names: Vec<String> = Vec::new();
    if let Some(p) = previous.filter(|p| p.seq != keep) {
        names.extend(p.files.iter().map(|f| f.file.clone()));
        names.push(journal::name(p.seq));
        names.push(journal::stopped_name(p.seq));
    }
    if let Ok(all) = dir.names() {
        names.extend(all.into_iter().filter(|n| match ours(n) {
            Some(Some(seq)) => seq != keep,
            Some(None) => true,
            None => false,
        }));
    }
    names.sort_unstable();
    names.dedup();
    for n in names {
        if let Err(err) = dir.remove(&n) {
            tracing::warn!(file = %dir.join(&n).display(), error = %err, "could not remove an old checkpoint file");
        }
    }
}

/// SHA-256 and size of a file, read once.
fn sha256_file(dir: &Dir, name: &str) -> Result<(u64, String), CheckpointError> {
    let path = dir.join(name);
    let (mut f, _) = dir
        .read(name)?
        .ok_or_else(|| refused(&path, "the file just written is gone"))?;
    let mut hash = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf).map_err(io(&path))?;
        if n == 0 {
            break;
        }
        hash.update(&buf[..n]);
        size += n as u64;
    }
    Ok((size, hex(&hash.finalize())))
}

/// Writes a checkpoint of `units` (in routing order) to `dir` (see the
/// module docs); with `journaled` false, a snapshot.
pub fn checkpoint(
    units: &[Arc<Unit>],
    journal: &Journal,
    dir: &Dir,
    journaled: bool,
) -> Result<Written, CheckpointError> {
    let _one = journal.turn();
    if !journaled && journal.journals_dir(dir.id()) {
        return Err(refused(
            &dir.join(MANIFEST),
            "stowd journals its checkpoint in this directory: a snapshot goes to another one",
        ));
    }
    let previous = manifest(dir).map_err(|e| {
        refused(
            &dir.join(MANIFEST),
            format!(
                "the directory holds a manifest.json stowd cannot read as its own ({e}): \
                 stowd does not replace it; checkpoint into an empty directory"
            ),
        )
    })?;
    let highest = dir
        .names()
        .map_err(io(dir.path()))?
        .iter()
        .filter_map(|n| ours(n).flatten())
        .max();
    let seq = previous
        .as_ref()
        .map(|m| m.seq)
        .max(highest)
        .map_or(1, |s| s + 1);
    if journaled {
        journal
            .check_room(dir)
            .map_err(|why| refused(dir.path(), why))?;
    }
    let snapshots: Vec<Snapshot> = {
        // Every unit at one instant: no put or clear runs while the gate is held.
        let _switch = if journaled {
            journal
                .begin(dir, seq)
                .map_err(io(&journal::path(dir.path(), seq)))?
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
            } else {
                journal.close(dir, None);
            }
            remove_others(dir, previous.as_ref(), seq);
            Ok(w)
        }
        Err(e) => {
            // The previous checkpoint (if any) stays, with its journal.
            if journaled {
                journal.close(dir, previous.as_ref().map(|m| m.seq));
            }
            for i in 0..units.len() {
                let _ = dir.remove(&unit_file(seq, i));
            }
            let _ = dir.remove(&journal::name(seq));
            Err(e)
        }
    }
}

fn write_files(
    units: &[Arc<Unit>],
    snapshots: &[Snapshot],
    dir: &Dir,
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
        let file = unit_file(seq, i);
        let saved = save_snapshot(unit.id(), snapshot, dir, &file, false)?;
        let (size, sha256) = sha256_file(dir, &file)?;
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

fn write_manifest(dir: &Dir, m: &Manifest) -> Result<(), CheckpointError> {
    use std::io::Write;
    let path = dir.join(MANIFEST);
    let json = serde_json::to_vec_pretty(m).map_err(|e| refused(&path, e.to_string()))?;
    let (mut f, tmp) = dir.temp("manifest").map_err(io(&path))?;
    let written = f
        .write_all(&json)
        .and_then(|()| f.sync_all())
        .and_then(|()| dir.rename(&tmp, MANIFEST))
        .and_then(|()| dir.sync())
        .map_err(io(&path));
    if written.is_err() {
        let _ = dir.remove(&tmp);
    }
    written
}

/// Maps a unit file read-only and checks its size and SHA-256 against the
/// manifest.
fn map_verified(dir: &Dir, entry: &FileEntry) -> Result<Bytes, CheckpointError> {
    let path = dir.join(&entry.file);
    let (file, size) = dir
        .read(&entry.file)?
        .ok_or_else(|| refused(&path, "the file is missing"))?;
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
    // (module docs, and checked when it was opened).
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

/// The indexes in the journal of checkpoint `seq` of `dir`.
fn read_journal(dir: &Dir, seq: u64) -> Result<Vec<u64>, CheckpointError> {
    let path = journal::path(dir.path(), seq);
    let (file, _) = dir.read(&journal::name(seq))?.ok_or_else(|| {
        refused(
            &path,
            "the checkpoint's journal is missing: without it the rows written or cleared \
             after the checkpoint cannot be told from the others, so nothing is restored",
        )
    })?;
    journal::read(file).map_err(io(&path))
}

/// `a` without the indexes of `b` (both sorted).
fn minus(a: &[u64], b: &[u64]) -> Vec<u64> {
    a.iter()
        .copied()
        .filter(|g| b.binary_search(g).is_err())
        .collect()
}

/// Replaces the rows of `units` (in routing order: row `g` goes to
/// `units[g % N]`) with the checkpoint in `dir` (see the module docs).
/// Nothing changes unless every file was read and verified and every part
/// fits its unit.
pub fn restore(
    units: &[Arc<Unit>],
    journal: &Journal,
    dir: &Dir,
) -> Result<Restored, CheckpointError> {
    let _one = journal.turn();
    let Some(m) = manifest(dir)? else {
        return Err(refused(
            &dir.join(MANIFEST),
            "no checkpoint in this directory (no manifest.json)",
        ));
    };
    let begun = std::time::Instant::now();
    let lost_before = if m.journal {
        let stopped = journal::stopped_name(m.seq);
        if let Some((f, _)) = dir.read(&stopped)? {
            let mut why = String::new();
            let _ = f.take(4096).read_to_string(&mut why);
            return Err(refused(
                &journal::path(dir.path(), m.seq),
                format!(
                    "this checkpoint's journal {}: rows written or cleared after that are \
                     unknown, so nothing is restored (restore the newer checkpoint)",
                    why.trim()
                ),
            ));
        }
        read_journal(dir, m.seq)?
    } else {
        Vec::new()
    };
    let n = units.len() as u64;
    let (mut parts, verify) = load(units, dir, &m, |g: u64| {
        lost_before
            .binary_search(&g)
            .is_err()
            .then_some((g % n) as usize)
    })?;
    let units_ref: Vec<&Unit> = units.iter().map(|u| u.as_ref()).collect();
    let store = |source| CheckpointError::Store {
        path: dir.path().to_path_buf(),
        source,
    };
    // From here no put or clear runs until the restore is done and the
    // checkpoint's journal written again: none falls between journals.
    let mut gate = journal.freeze();
    // Every index changed since the checkpoint: its journal, complete if
    // this stowd kept writing it; if not, also every index the units hold
    // now (put since, unjournaled there).
    let (lost, unrecorded) = if m.journal {
        let recorded = read_journal(dir, m.seq)?;
        let mut lost = recorded.clone();
        if !gate.is_open(dir, m.seq) {
            lost.extend(units_ref.iter().flat_map(|u| u.indexes()));
            lost.sort_unstable();
            lost.dedup();
        }
        let unrecorded = minus(&lost, &recorded);
        (lost, unrecorded)
    } else {
        (Vec::new(), Vec::new())
    };
    let late = minus(&lost, &lost_before);
    if !late.is_empty() {
        parts = parts
            .into_iter()
            .map(|part| {
                let mut kept = vec![Snapshot::new()];
                split(part, &mut kept, |g| {
                    late.binary_search(&g).is_err().then_some(0)
                });
                kept.pop().unwrap_or_default()
            })
            .collect();
    }
    let rows: u64 = parts
        .iter()
        .flatten()
        .flat_map(|(_, s)| s.iter().map(|s| s.indexes().len() as u64))
        .sum();
    let mut touched = affected(&units_ref, &parts);
    touched.extend_from_slice(&lost);
    touched.sort_unstable();
    touched.dedup();
    let mut ready = Vec::with_capacity(units.len());
    for (unit, part) in units.iter().zip(parts) {
        ready.push(unit.prepare(part, true).map_err(store)?);
    }
    // Durable before anything changes: the other checkpoints' journals
    // learn every index this restore changes, and this one's journal the
    // indexes it did not hold yet.
    gate.record(&touched, Some(dir)).map_err(io(dir.path()))?;
    if m.journal {
        gate.resume(dir, m.seq, &unrecorded)
            .map_err(io(&journal::path(dir.path(), m.seq)))?;
    }
    let checkpoint: Arc<str> = Arc::from(name(dir.path(), m.seq));
    for (i, (unit, r)) in units.iter().zip(ready).enumerate() {
        unit.commit(r);
        let mine: Vec<u64> = lost.iter().copied().filter(|g| g % n == i as u64).collect();
        unit.set_lost(&mine, &checkpoint);
    }
    drop(gate);
    Ok(Restored {
        seq: m.seq,
        rows,
        lost: lost.len() as u64,
        verify,
        total: begun.elapsed(),
    })
}

/// The rows of checkpoint `m` of `dir`, verified and split over `units` by
/// `to` (None: not loaded): (the parts, the time spent verifying). Nothing
/// is changed.
fn load(
    units: &[Arc<Unit>],
    dir: &Dir,
    m: &Manifest,
    to: impl Fn(u64) -> Option<usize> + Copy,
) -> Result<(Vec<Snapshot>, std::time::Duration), CheckpointError> {
    let mut verify = std::time::Duration::ZERO;
    let mut parts: Vec<Snapshot> = units.iter().map(|_| Vec::new()).collect();
    for entry in &m.files {
        let path = dir.join(&entry.file);
        let started = std::time::Instant::now();
        let file = map_verified(dir, entry)?;
        verify += started.elapsed();
        split(parse(file, &path, false)?, &mut parts, to);
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
        let bytes = part
            .iter()
            .flat_map(|(_, s)| s.iter().map(|s| s.byte_len()))
            .sum();
        unit.check_fits(bytes, true)
            .map_err(|source| CheckpointError::Store {
                path: dir.path().to_path_buf(),
                source,
            })?;
    }
    Ok((parts, verify))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_names_stowd_makes_are_its_own() {
        assert_eq!(ours("unit-3-0.safetensors"), Some(Some(3)));
        assert_eq!(ours("journal-12"), Some(Some(12)));
        assert_eq!(ours("journal-12.stopped"), Some(Some(12)));
        assert_eq!(ours(".unit-4-1.safetensors.77.0.tmp"), Some(Some(4)));
        assert_eq!(ours(".manifest.77.3.tmp"), Some(None));
        for foreign in [
            "unit-7-notes.txt",
            "journal-2024-12.md",
            "journal-007",
            "journal-",
            "unit--0.safetensors",
            "unit-1-x.safetensors",
            ".manifest.tmp",
            ".journal-1.5.5.tmp",
            "manifest.json",
            "notes",
        ] {
            assert_eq!(ours(foreign), None, "{foreign}");
        }
    }
}
