//! Spilling extents to disk when the units' memory runs short (issue 16).
//!
//! With `[units] spill_dir` set, the local units of a `stowd` share one
//! [`Spiller`]. Every extent a unit stores is counted in its memory total;
//! an extent written to a spill file moves to the disk total:
//!
//! - **Threshold** (`spill_threshold_bytes` per unit, default 80% of the
//!   unit capacity; times the number of units): past it a background
//!   thread spills the coldest extents (least recently stored or read)
//!   until the memory total is back under it.
//! - **Bound** (the unit capacity, `capacity_bytes` or the default memory
//!   bound, times the number of units): a put whose extents would take
//!   the memory total past it first spills enough of the coldest extents
//!   itself, so puts go on at the disk's pace. If it cannot (the disk is
//!   full, or `spill_max_bytes` is reached), the put is refused with a
//!   `capacity` error naming why, and nothing stored is touched.
//!
//! A spill writes the extent's bytes to a new file (mode 0600, created
//! with `O_EXCL`) in `stowd`'s private directory inside `spill_dir`,
//! `fdatasync`s it, maps it read-only and **unlinks it**: the mapping is
//! the extent's
//! place from then on, so gets on every endpoint send its pages as they
//! send any other extent's bytes (no extra copy), and a same-node reader
//! gets it copied into a sealed segment once, as any extent not yet in
//! shared memory (the extent is then counted in memory again). The file's
//! blocks are freed when the last row on it is cleared and the last reply
//! using it is sent. A failed write removes its file and leaves the
//! extent in memory.
//!
//! **The private directory.** `spill_dir` may be a directory other users
//! share (`/tmp`, a scratch mount): `stowd` never changes its mode and
//! never removes anything in it. It works in `spill_dir/stowd-spill-<uid>`
//! (its effective uid: one per user, so a restarted `stowd` finds what a
//! killed one left), which it creates with mode 0700 (and `spill_dir`
//! too, 0700, if it does not exist). A directory of that name that is a
//! symbolic link, not a directory, not owned by `stowd`'s user, or
//! writable by group or others is refused at start, naming the path and
//! why: someone else made it. The directory is opened once
//! (`O_NOFOLLOW`) and checked through that descriptor, and every spill
//! file is created and unlinked relative to it (`openat`, `unlinkat`), so
//! renaming or replacing the path later changes nothing for `stowd`. At
//! start, the spill files a killed `stowd` left there (a crash between
//! creating and unlinking one: regular files of `stowd`'s user named
//! `<pid>-<n>.spill`) are removed; nothing else is.
//!
//! The bytes of an extent never change, so a reader holding the old
//! (memory) place reads the same bytes; the memory is freed when the last
//! such reader lets go. Plain values (strings, bytes, msgpack) are not
//! extents: they stay in memory and are not counted here.
//!
//! Mapped spill files are page cache, file-backed: they do not count in
//! `stowd`'s anonymous or shared memory, and the kernel drops their pages
//! under pressure and reads them again on use.

use std::fs::DirBuilder;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use rustix::fs::{AtFlags, FileType, Mode, OFlags};

use crate::extent::{Accounts, Extent, tick};

/// Why a put could not be given room.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the units' memory is full ({memory} of {bound} bytes, [units] capacity_bytes times the \
     units) and spilling to {dir} could not make room for {needed} more: {reason}"
)]
pub struct SpillError {
    pub dir: String,
    pub memory: u64,
    pub bound: u64,
    pub needed: u64,
    pub reason: String,
}

/// What a [`Spiller`] is set to.
#[derive(Clone, Debug)]
pub struct SpillConfig {
    pub dir: PathBuf,
    /// Memory total (all units) past which the background thread spills.
    pub threshold: u64,
    /// Memory total (all units) a put may not pass.
    pub bound: u64,
    /// Most bytes in spill files at once (None: as many as the disk holds).
    pub max_disk: Option<u64>,
}

/// Spills the coldest extents of a `stowd`'s units (module docs).
pub struct Spiller {
    config: SpillConfig,
    /// The private directory inside `config.dir` (see [`PrivateDir`]).
    private: PrivateDir,
    accounts: Arc<Accounts>,
    /// Every extent counted, to pick the coldest from (dead ones pruned
    /// when the list has doubled since the last pruning, and at each scan).
    extents: Mutex<Extents>,
    /// Wakes the background thread.
    wake: (Mutex<bool>, Condvar),
    next_file: AtomicU64,
    stopped: AtomicBool,
}

impl std::fmt::Debug for Spiller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Spiller")
            .field("config", &self.config)
            .field("accounts", &self.accounts)
            .finish()
    }
}

/// The extents counted, and the length at which the dead are pruned.
#[derive(Default)]
struct Extents {
    list: Vec<Weak<Extent>>,
    prune_at: usize,
}

impl Extents {
    fn prune(&mut self) {
        self.list.retain(|w| w.strong_count() > 0);
        self.prune_at = (2 * self.list.len()).max(1024);
    }
}

/// Totals, for stats and metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpillStats {
    pub memory: u64,
    pub disk: u64,
    pub spilled: u64,
    pub files: u64,
    pub failures: u64,
    pub write_ns: u64,
    pub threshold: u64,
    pub bound: u64,
}

/// `stowd`'s private spill directory, opened: where spill files are
/// created and unlinked, relative to `fd` (module docs).
#[derive(Debug)]
pub struct PrivateDir {
    /// `spill_dir/stowd-spill-<uid>`, for messages.
    pub path: PathBuf,
    fd: OwnedFd,
}

/// Whether `name` is one a [`Spiller`] gives its files: `<pid>-<n>.spill`.
fn is_spill_file_name(name: &[u8]) -> bool {
    let Some(stem) = name.strip_suffix(b".spill") else {
        return false;
    };
    let mut parts = stem.split(|b| *b == b'-');
    let digits =
        |p: Option<&[u8]>| p.is_some_and(|p| !p.is_empty() && p.iter().all(u8::is_ascii_digit));
    digits(parts.next()) && digits(parts.next()) && parts.next().is_none()
}

/// Makes (or opens) `stowd`'s private directory inside `spill_dir` and
/// removes the spill files a killed `stowd` left in it (module docs).
/// `spill_dir` itself is created 0700 if missing, and otherwise left as
/// it is. Err: why the directory cannot be used, naming it.
pub fn prepare_dir(spill_dir: &Path) -> std::io::Result<PrivateDir> {
    let refuse = |path: &Path, what: String| {
        std::io::Error::other(format!("spill_dir {}: {what}", path.display()))
    };
    match std::fs::symlink_metadata(spill_dir) {
        Ok(m) if m.file_type().is_symlink() => {
            return Err(refuse(spill_dir, "is a symbolic link".into()));
        }
        Ok(m) if !m.is_dir() => return Err(refuse(spill_dir, "is not a directory".into())),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(spill_dir)?;
        }
        Err(e) => return Err(e),
    }
    let me = rustix::process::geteuid().as_raw();
    let path = spill_dir.join(format!("stowd-spill-{me}"));
    match DirBuilder::new().mode(0o700).create(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(refuse(&path, format!("cannot be created: {e}"))),
    }
    // Judged by what was opened without following a link (the lstat
    // before it only names the reason for a link, which open refuses as
    // "not a directory").
    if std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_symlink()) {
        return Err(refuse(
            &path,
            "is a symbolic link, not a directory stowd made: remove it".into(),
        ));
    }
    let fd = rustix::fs::open(
        &path,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| {
        let why = match e {
            rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => {
                "is not a directory (nor one stowd made): remove it".into()
            }
            e => format!("cannot be opened: {e}"),
        };
        refuse(&path, why)
    })?;
    let stat = rustix::fs::fstat(&fd)?;
    if stat.st_uid != me {
        return Err(refuse(
            &path,
            format!(
                "belongs to uid {}, not to stowd's user (uid {me}): another user made it; \
                 remove it or choose another spill_dir",
                stat.st_uid
            ),
        ));
    }
    let mode = stat.st_mode & 0o7777;
    if mode & 0o022 != 0 {
        return Err(refuse(
            &path,
            format!(
                "is writable by group or others (mode {mode:04o}): stowd made it 0700; \
                 remove it or make it 0700"
            ),
        ));
    }
    for entry in rustix::fs::Dir::read_from(&fd)? {
        let entry = entry?;
        let name = entry.file_name();
        if !is_spill_file_name(name.to_bytes()) {
            continue;
        }
        let Ok(st) = rustix::fs::statat(&fd, name, AtFlags::SYMLINK_NOFOLLOW) else {
            continue;
        };
        if FileType::from_raw_mode(st.st_mode) == FileType::RegularFile && st.st_uid == me {
            rustix::fs::unlinkat(&fd, name, AtFlags::empty())?;
            tracing::info!(
                file = %path.join(name.to_string_lossy().as_ref()).display(),
                "removed a spill file left by an earlier stowd"
            );
        }
    }
    Ok(PrivateDir { path, fd })
}

impl Spiller {
    /// A spiller over `config.dir` (see [`prepare_dir`], done here) with
    /// its background thread.
    pub fn start(config: SpillConfig) -> std::io::Result<Arc<Spiller>> {
        let private = prepare_dir(&config.dir)?;
        let spiller = Arc::new(Spiller {
            config,
            private,
            accounts: Arc::new(Accounts::default()),
            extents: Mutex::new(Extents::default()),
            wake: (Mutex::new(false), Condvar::new()),
            next_file: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
        });
        let weak = Arc::downgrade(&spiller);
        std::thread::Builder::new()
            .name("stowd-spill".into())
            .spawn(move || background(weak))?;
        Ok(spiller)
    }

    pub fn config(&self) -> &SpillConfig {
        &self.config
    }

    /// The private directory the spill files go to.
    pub fn private_dir(&self) -> &Path {
        &self.private.path
    }

    /// How many extents the spiller keeps track of (live and not yet
    /// pruned).
    pub fn tracked(&self) -> usize {
        self.extents
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .list
            .len()
    }

    pub fn stats(&self) -> SpillStats {
        let a = &self.accounts;
        SpillStats {
            memory: a.memory.load(Ordering::Acquire),
            disk: a.disk.load(Ordering::Acquire),
            spilled: a.spilled.load(Ordering::Relaxed),
            files: a.files.load(Ordering::Relaxed),
            failures: a.failures.load(Ordering::Relaxed),
            write_ns: a.write_ns.load(Ordering::Relaxed),
            threshold: self.config.threshold,
            bound: self.config.bound,
        }
    }

    /// Whether `bytes` of new rows fit in place of `held` bytes a unit
    /// holds now: within the memory bound and the room left on the spill
    /// disk (`spill_max_bytes`, or the file system's free space). Asked
    /// before a load reads a file, so that a file too large is refused
    /// before any of it is in memory.
    pub fn check_room(&self, bytes: u64, held: u64) -> Result<(), SpillError> {
        let a = &self.accounts;
        let (memory, disk) = (
            a.memory.load(Ordering::Acquire),
            a.disk.load(Ordering::Acquire),
        );
        let disk_room = match self.config.max_disk {
            Some(max) => max.saturating_sub(disk),
            None => rustix::fs::statvfs(&self.config.dir)
                .map_or(u64::MAX, |s| s.f_bavail.saturating_mul(s.f_frsize)),
        };
        let room = self
            .config
            .bound
            .saturating_sub(memory)
            .saturating_add(disk_room)
            .saturating_add(held);
        if bytes <= room {
            return Ok(());
        }
        Err(SpillError {
            dir: self.config.dir.display().to_string(),
            memory,
            bound: self.config.bound,
            needed: bytes,
            reason: format!(
                "the rows need {bytes} bytes; memory and the spill disk have room for {room} \
                 (spill_max_bytes, or the disk's free space)"
            ),
        })
    }

    /// Stops the background thread (at its next wake-up).
    pub fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        self.wake.1.notify_all();
    }

    /// Counts the extents a put stores (those not counted yet), then makes
    /// room: spills the coldest extents until the memory total is within
    /// the bound, or fails saying why (the put must then be refused). Past
    /// the threshold the background thread is woken.
    pub fn admit<'a>(
        &self,
        extents: impl IntoIterator<Item = &'a Arc<Extent>>,
    ) -> Result<(), SpillError> {
        let mut added = 0u64;
        {
            let mut counted = self.extents.lock().unwrap_or_else(|p| p.into_inner());
            for e in extents {
                if !e.is_empty() && e.account(&self.accounts) {
                    counted.list.push(Arc::downgrade(e));
                    added += e.len() as u64;
                }
            }
            if counted.list.len() >= counted.prune_at {
                counted.prune();
            }
        }
        if added == 0 {
            return Ok(());
        }
        let memory = self.accounts.memory.load(Ordering::Acquire);
        if memory > self.config.bound {
            self.spill(memory - self.config.bound)
                .map_err(|reason| SpillError {
                    dir: self.private.path.display().to_string(),
                    memory: self.accounts.memory.load(Ordering::Acquire),
                    bound: self.config.bound,
                    needed: added,
                    reason,
                })?;
        }
        if self.accounts.memory.load(Ordering::Acquire) > self.config.threshold {
            *self.wake.0.lock().unwrap_or_else(|p| p.into_inner()) = true;
            self.wake.1.notify_one();
        }
        Ok(())
    }

    /// The coldest extents in memory, `need` bytes of them or all there
    /// are, claimed for spilling (nobody else spills them meanwhile).
    fn coldest(&self, need: u64) -> Vec<(Arc<Extent>, Bytes)> {
        tick();
        let mut live: Vec<Arc<Extent>> = {
            let mut counted = self.extents.lock().unwrap_or_else(|p| p.into_inner());
            counted.prune();
            counted
                .list
                .iter()
                .filter_map(Weak::upgrade)
                .filter(|e| !e.is_spilled())
                .collect()
        };
        live.sort_by_key(|e| e.used());
        let mut out = Vec::new();
        let mut got = 0u64;
        for e in live {
            if got >= need {
                break;
            }
            if let Some(bytes) = e.claim() {
                got += e.len() as u64;
                out.push((e, bytes));
            }
        }
        out
    }

    /// Spills the coldest extents until `need` bytes moved to disk. Err:
    /// why not (what did move stays moved).
    fn spill(&self, need: u64) -> Result<(), String> {
        let mut moved = 0u64;
        let mut last_error = None;
        for (extent, bytes) in self.coldest(need) {
            if last_error.is_some() || moved >= need {
                extent.settle(None, &bytes);
                continue;
            }
            let started = std::time::Instant::now();
            let written = self.write(&bytes);
            self.accounts
                .write_ns
                .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            match written {
                Ok(file) => {
                    if extent.settle(Some(file), &bytes) {
                        moved += extent.len() as u64;
                        // Its memory goes back to the allocator once the
                        // last reader lets go: give it back to the OS too.
                        crate::release::note_freed(extent.len() as u64);
                    }
                }
                Err(e) => {
                    self.accounts.failures.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(dir = %self.private.path.display(), error = %e, "spilling failed");
                    extent.settle(None, &bytes);
                    last_error = Some(e.to_string());
                }
            }
        }
        if moved >= need {
            return Ok(());
        }
        Err(last_error.unwrap_or_else(|| {
            "every extent in memory is in use by a spill already or is the put's own".into()
        }))
    }

    /// Writes `bytes` to a new spill file, syncs it, maps it read-only and
    /// unlinks it.
    fn write(&self, bytes: &Bytes) -> std::io::Result<Bytes> {
        let len = bytes.len() as u64;
        if let Some(max) = self.config.max_disk {
            let disk = self.accounts.disk.load(Ordering::Acquire);
            if disk + len > max {
                return Err(std::io::Error::other(format!(
                    "[units] spill_max_bytes ({max}) reached: {disk} bytes are spilled"
                )));
            }
        }
        let n = self.next_file.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}-{n}.spill", std::process::id());
        let dir = &self.private.fd;
        let mut file = std::fs::File::from(rustix::fs::openat(
            dir,
            &name,
            OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )?);
        let written = file
            .write_all(bytes)
            .and_then(|()| file.sync_data())
            // SAFETY: the file is private to stowd (0600 in a 0700
            // directory of its own), unlinked right below, and never
            // written again.
            .and_then(|()| unsafe { memmap2::Mmap::map(&file) });
        let _ = rustix::fs::unlinkat(dir, &name, AtFlags::empty());
        let map = written?;
        let _ = map.advise(memmap2::Advice::Sequential);
        Ok(Bytes::from_owner(map))
    }
}

/// The background thread: spills down to the threshold whenever woken past
/// it (and checks once a second).
fn background(spiller: Weak<Spiller>) {
    loop {
        let Some(s) = spiller.upgrade() else { return };
        if s.stopped.load(Ordering::Acquire) {
            return;
        }
        let memory = s.accounts.memory.load(Ordering::Acquire);
        if memory > s.config.threshold {
            let _ = s.spill(memory - s.config.threshold);
        }
        let (flag, cvar) = &s.wake;
        let woken = flag.lock().unwrap_or_else(|p| p.into_inner());
        let (mut woken, _) = cvar
            .wait_timeout_while(woken, Duration::from_secs(1), |w| !*w)
            .unwrap_or_else(|p| p.into_inner());
        *woken = false;
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use super::*;

    fn spiller(tag: &str, threshold: u64, bound: u64) -> Arc<Spiller> {
        let dir = std::env::temp_dir().join(format!("spill-unit-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Spiller::start(SpillConfig {
            dir,
            threshold,
            bound,
            max_disk: None,
        })
        .unwrap()
    }

    #[test]
    fn dead_extents_are_not_tracked_for_ever() {
        let s = spiller("prune", 1 << 30, 1 << 30);
        for i in 0..10_000u32 {
            let e = Extent::new(Bytes::from(i.to_le_bytes().to_vec()));
            s.admit([&e]).unwrap();
        }
        assert!(s.tracked() <= 2048, "{} tracked", s.tracked());
        assert_eq!(s.stats().memory, 0);
        let _ = std::fs::remove_dir_all(&s.config().dir);
    }

    #[test]
    fn a_put_past_the_bound_spills_the_coldest_first() {
        let s = spiller("coldest", 1 << 30, 3000);
        let old = Extent::new(Bytes::from(vec![1u8; 1000]));
        let warm = Extent::new(Bytes::from(vec![2u8; 1000]));
        s.admit([&old, &warm]).unwrap();
        tick();
        let _ = warm.bytes(); // used later than `old`
        let new = Extent::new(Bytes::from(vec![3u8; 1500]));
        s.admit([&new]).unwrap();
        assert!(old.is_spilled() && !warm.is_spilled() && !new.is_spilled());
        assert_eq!(old.bytes().as_ref(), &[1u8; 1000][..]);
        let st = s.stats();
        assert_eq!((st.memory, st.disk, st.files), (2500, 1000, 1));
        // Nothing is left in the directory: the file was unlinked once mapped.
        assert_eq!(std::fs::read_dir(s.private_dir()).unwrap().count(), 0);
        drop(old);
        assert_eq!(s.stats().disk, 0);
        let _ = std::fs::remove_dir_all(&s.config().dir);
    }

    /// A directory everyone shares (1777), as `/tmp` is: made here.
    fn shared_dir(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("spill-shared-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
        dir
    }

    fn mode(path: &Path) -> u32 {
        std::fs::symlink_metadata(path).unwrap().mode() & 0o7777
    }

    /// Running as root (CI): what "another user" is tested with.
    fn root() -> bool {
        rustix::process::geteuid().is_root()
    }

    const NOBODY: u32 = 65534;

    // The review found a shared `spill_dir` made 0700 (every other user
    // locked out) and another user's `*.spill` file in it removed.
    #[test]
    fn a_shared_spill_dir_keeps_its_mode_and_what_others_put_in_it() {
        let dir = shared_dir("keep");
        let theirs = dir.join("123-4.spill");
        std::fs::write(&theirs, b"another user's").unwrap();
        if root() {
            std::os::unix::fs::chown(&theirs, Some(NOBODY), Some(NOBODY)).unwrap();
        }
        // Even a file of stowd's own user there is not its to remove.
        let mine = dir.join("5-6.spill");
        std::fs::write(&mine, b"not written by a spiller").unwrap();
        let private = prepare_dir(&dir).unwrap();
        assert_eq!(mode(&dir), 0o1777, "the shared directory's mode changed");
        assert!(
            theirs.exists() && mine.exists(),
            "a file in spill_dir was removed"
        );
        let me = rustix::process::geteuid().as_raw();
        assert_eq!(private.path, dir.join(format!("stowd-spill-{me}")));
        assert_eq!(mode(&private.path), 0o700);
        // A second start reuses it, and spill files go there only.
        let private = prepare_dir(&dir).unwrap();
        let s = Spiller {
            config: SpillConfig {
                dir: dir.clone(),
                threshold: 0,
                bound: 0,
                max_disk: None,
            },
            private,
            accounts: Arc::new(Accounts::default()),
            extents: Mutex::new(Extents::default()),
            wake: (Mutex::new(false), Condvar::new()),
            next_file: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
        };
        let mapped = s.write(&Bytes::from(vec![7u8; 5000])).unwrap();
        assert_eq!(mapped.as_ref(), &[7u8; 5000][..]);
        assert_eq!(std::fs::read_dir(s.private_dir()).unwrap().count(), 0);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 3);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn only_spill_files_of_stowds_user_go_from_its_private_dir() {
        let dir = shared_dir("leftovers");
        let private = prepare_dir(&dir).unwrap().path;
        for name in [
            "123-4.spill",
            "1-2.spill",
            "notes.txt",
            "x-1.spill",
            "1-2-3.spill",
        ] {
            std::fs::write(private.join(name), b"x").unwrap();
        }
        std::fs::create_dir(private.join("9-9.spill")).unwrap();
        std::os::unix::fs::symlink("/etc/hostname", private.join("8-8.spill")).unwrap();
        if root() {
            std::os::unix::fs::chown(private.join("1-2.spill"), Some(NOBODY), None).unwrap();
        }
        prepare_dir(&dir).unwrap();
        let mut left: Vec<String> = std::fs::read_dir(&private)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        let mut want = vec![
            "1-2-3.spill",
            "8-8.spill",
            "9-9.spill",
            "notes.txt",
            "x-1.spill",
        ];
        if root() {
            want.push("1-2.spill");
            want.sort();
        }
        assert_eq!(left, want);
        assert!(Path::new("/etc/hostname").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_private_dir_someone_else_made_is_refused_naming_it() {
        let dir = shared_dir("refused");
        let me = rustix::process::geteuid().as_raw();
        let private = dir.join(format!("stowd-spill-{me}"));
        let refused = |words: &str| {
            let e = prepare_dir(&dir).expect_err("a directory stowd did not make was used");
            let e = e.to_string();
            assert!(e.contains(&private.display().to_string()), "{e}");
            assert!(e.contains(words), "{words:?} not in {e}");
        };
        // Writable by others.
        std::fs::create_dir(&private).unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o777)).unwrap();
        refused("writable by group or others (mode 0777)");
        assert_eq!(mode(&private), 0o777, "its mode was changed");
        std::fs::remove_dir(&private).unwrap();
        // A symbolic link, to a directory of stowd's user.
        let elsewhere = dir.join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::write(elsewhere.join("1-1.spill"), b"x").unwrap();
        std::os::unix::fs::symlink(&elsewhere, &private).unwrap();
        refused("symbolic link");
        assert!(elsewhere.join("1-1.spill").exists());
        std::fs::remove_file(&private).unwrap();
        // A file.
        std::fs::write(&private, b"x").unwrap();
        refused("not a directory");
        std::fs::remove_file(&private).unwrap();
        // Owned by another user (0700): only root can make one to test.
        if root() {
            std::fs::create_dir(&private).unwrap();
            std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
            std::os::unix::fs::chown(&private, Some(NOBODY), Some(NOBODY)).unwrap();
            refused("belongs to uid 65534");
        } else {
            eprintln!("not root: the case of another user's directory is not tested");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
