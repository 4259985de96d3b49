//! Checkpoints and restores as operations of a [`Manager`]: every one of
//! them (`stowd serve --restore`, `stowage/1`'s `checkpoint` and `restore`,
//! TransferQueue's `SAVE_STORAGE_CHECKPOINT` and `LOAD_STORAGE_CHECKPOINT`)
//! starts here, over the manager's units in routing order, on the blocking
//! pool. The services only word the outcome in their protocol.

use std::sync::Arc;

use super::Manager;
use crate::checkpoint::{self, CheckpointError, Roots, dir as ckpt};
use crate::store::Unit;

/// Why a checkpoint operation did not run, or failed.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointRunError {
    /// The manager routes to units of other processes: it can neither
    /// write nor restore their rows.
    #[error("{0} remote unit(s)")]
    Remote(usize),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The blocking task did not finish (a panic).
    #[error("{0}")]
    Task(String),
}

impl Manager {
    /// Every unit, all local, or why not.
    fn local_units(&self) -> Result<Vec<Arc<Unit>>, CheckpointRunError> {
        self.all_local().map_err(CheckpointRunError::Remote)
    }

    /// Writes a checkpoint of every unit to the directory `dir` under
    /// `roots` (made if missing); with `journaled` false, a snapshot
    /// ([`crate::checkpoint::dir`]). Returns the directory as shown and
    /// what was written.
    pub async fn checkpoint(
        &self,
        roots: &Arc<Roots>,
        dir: &str,
        journaled: bool,
    ) -> Result<(String, ckpt::Written), CheckpointRunError> {
        let units = self.local_units()?;
        let (roots, dir) = (roots.clone(), dir.to_string());
        blocking(move || {
            let journal = first_journal(&units, &dir)?;
            let path = roots.dir(&dir, true)?;
            let written = ckpt::checkpoint(&units, &journal, &path, journaled)?;
            Ok((path.path().display().to_string(), written))
        })
        .await
    }

    /// Replaces every unit's rows with the checkpoint in `dir` under
    /// `roots`. Nothing changes unless all of it was read and verified.
    pub async fn restore(
        &self,
        roots: &Arc<Roots>,
        dir: &str,
    ) -> Result<(String, ckpt::Restored), CheckpointRunError> {
        let units = self.local_units()?;
        let (roots, dir) = (roots.clone(), dir.to_string());
        blocking(move || {
            let journal = first_journal(&units, &dir)?;
            let path = roots.dir(&dir, false)?;
            let restored = ckpt::restore(&units, &journal, &path)?;
            Ok((path.path().display().to_string(), restored))
        })
        .await
    }

    /// TransferQueue's `SAVE_STORAGE_CHECKPOINT`: every unit's rows to the
    /// file `path` under `roots`, named `file_id` inside (a unit's id, or a
    /// router endpoint's). Returns the rows and bytes written.
    pub async fn save_file(
        &self,
        roots: &Arc<Roots>,
        path: &str,
        file_id: &str,
    ) -> Result<checkpoint::Saved, CheckpointRunError> {
        let units = self.local_units()?;
        let (roots, path, file_id) = (roots.clone(), path.to_string(), file_id.to_string());
        blocking(move || {
            let (dir, name) = roots.file(&path)?;
            let journal = first_journal(&units, &path)?;
            check_target(&dir, &name, &journal)?;
            let units: Vec<&Unit> = units.iter().map(|u| u.as_ref()).collect();
            Ok(checkpoint::save_units(&file_id, &units, &dir, &name)?)
        })
        .await
    }

    /// TransferQueue's `LOAD_STORAGE_CHECKPOINT`: the rows of the file
    /// `path` under `roots` into the units, row `g` to unit `g % N`.
    /// Returns the rows loaded.
    pub async fn load_file(
        &self,
        roots: &Arc<Roots>,
        path: &str,
    ) -> Result<u64, CheckpointRunError> {
        let units = self.local_units()?;
        let (roots, path) = (roots.clone(), path.to_string());
        blocking(move || {
            let (dir, name) = roots.file(&path)?;
            let journal = first_journal(&units, &path)?;
            check_target(&dir, &name, &journal)?;
            let n = units.len() as u64;
            let units: Vec<&Unit> = units.iter().map(|u| u.as_ref()).collect();
            let route = |g: u64| (g % n) as usize;
            Ok(checkpoint::load_units(
                &units, route, &dir, &name, &journal,
            )?)
        })
        .await
    }
}

/// Runs `f` on the blocking pool.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, CheckpointRunError> + Send + 'static,
) -> Result<T, CheckpointRunError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| CheckpointRunError::Task(e.to_string()))?
}

/// The journal every local unit shares (they are made with one).
fn first_journal(
    units: &[Arc<Unit>],
    path: &str,
) -> Result<Arc<crate::journal::Journal>, CheckpointRunError> {
    match units.first() {
        Some(u) => Ok(u.journal().clone()),
        None => Err(CheckpointError::Refused {
            path: path.into(),
            reason: "this endpoint has no local unit".into(),
        }
        .into()),
    }
}

/// Refuses a SAVE or LOAD file that is part of `stowd`'s own checkpoints:
/// a name `stowd` gives its checkpoint files, or any file of a directory
/// holding a `stowd` checkpoint or journal (overwriting a journal or a
/// manifest would make a restore serve stale rows).
fn check_target(
    dir: &checkpoint::Dir,
    name: &str,
    journal: &crate::journal::Journal,
) -> Result<(), CheckpointError> {
    use crate::checkpoint::dir::{MANIFEST, ours};
    let reserved = name == MANIFEST || ours(name).is_some();
    let theirs = journal.journals_dir(dir.id())
        || dir.exists(MANIFEST)
        || dir
            .names()
            .map_err(checkpoint::io(dir.path()))?
            .iter()
            .any(|n| ours(n).is_some());
    if reserved || theirs {
        return Err(CheckpointError::Refused {
            path: dir.join(name),
            reason: "it is part of stowd's own checkpoints (a checkpoint directory, its \
                     manifest, unit files or journal): a TransferQueue checkpoint file goes \
                     elsewhere"
                .into(),
        });
    }
    Ok(())
}
