//! Where checkpoints may be written and read: `[checkpoint] roots`, and
//! directories opened once, then used only through their descriptor.
//!
//! Every path a client names (a TransferQueue `SAVE_STORAGE_CHECKPOINT` or
//! `LOAD_STORAGE_CHECKPOINT` file, a `stowage/1` `checkpoint` or `restore`
//! directory) and `stowd serve --restore DIR` goes through [`Roots`]:
//!
//! - it must be absolute, without `..`, and lie under one of the roots
//!   (compared by path components; the roots are made canonical at start).
//!   Anything else is refused, naming the roots;
//! - it must not lie under a directory of `stowd`'s own state (the spill
//!   directory, `[shm] dir`, the plugin directory and its compile cache);
//! - it is opened one component at a time from the root's descriptor, each
//!   with `O_NOFOLLOW | O_DIRECTORY` (the walk `openat2(RESOLVE_BENEATH |
//!   RESOLVE_NO_SYMLINKS)` does in one call; done by hand so that missing
//!   components can be made `0700` on the way with `mkdirat`). A symbolic
//!   link anywhere below the root is refused; swapping a component after it
//!   was opened changes nothing, since the next step starts from the
//!   descriptor;
//! - the directory reached must belong to `stowd`'s user and not be
//!   writable by group or others: nobody else can plant, swap or remove a
//!   file in it while `stowd` works there.
//!
//! From then on a checkpoint's files are opened, created, renamed and
//! removed only through the directory's descriptor ([`Dir`]): files are
//! opened `O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC` and must then be regular
//! files of `stowd`'s user (`fstat`; a FIFO or device is refused, never
//! waited on), and temporary files are created `O_EXCL`.
//!
//! `roots = ["/"]` gives TransferQueue's behaviour (any path `stowd`'s user
//! can write), an explicit opt-in that `stowd` warns about at start.

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use super::CheckpointError;

/// The directories checkpoints may be written to and read from, and those
/// of `stowd`'s own state, which they may not touch.
#[derive(Debug)]
pub struct Roots {
    roots: Vec<PathBuf>,
    /// Added to once at start, when `[shm] dir`'s channel is bound.
    protected: std::sync::RwLock<Vec<PathBuf>>,
}

fn refused(path: &Path, reason: impl Into<String>) -> CheckpointError {
    CheckpointError::Refused {
        path: path.to_path_buf(),
        reason: reason.into(),
    }
}

fn io_err(path: &Path, e: impl Into<std::io::Error>) -> CheckpointError {
    CheckpointError::Io {
        path: path.to_path_buf(),
        source: e.into(),
    }
}

/// `stowd`'s effective user id.
pub fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Why a directory of `stat` is not private enough to hold checkpoints,
/// if it is not.
fn not_private(stat: &rustix::fs::Stat) -> Option<String> {
    let mode = stat.st_mode & 0o7777;
    if stat.st_uid != euid() {
        return Some(format!(
            "it belongs to uid {}, not to stowd's user (uid {}): a checkpoint directory \
             must be stowd's user's own",
            stat.st_uid,
            euid()
        ));
    }
    if mode & 0o022 != 0 {
        return Some(format!(
            "it is writable by group or others (mode {mode:04o}): a checkpoint directory \
             must not be (chmod go-w)"
        ));
    }
    None
}

impl Roots {
    /// `roots` (canonical paths) and the directories of `stowd`'s state
    /// (`protected`), which no checkpoint path may lie under.
    pub fn new(roots: Vec<PathBuf>, protected: Vec<PathBuf>) -> Roots {
        Roots {
            roots,
            protected: std::sync::RwLock::new(protected),
        }
    }

    /// Adds a directory of `stowd`'s state that no checkpoint may touch.
    pub fn protect(&self, dir: PathBuf) {
        self.protected
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .push(dir);
    }

    /// Every path `stowd`'s user can reach (`roots = ["/"]`), nothing
    /// protected: for tests of the checkpoint code itself.
    pub fn anywhere() -> Roots {
        Roots::new(vec![PathBuf::from("/")], vec![])
    }

    pub fn roots(&self) -> &[PathBuf] {
        &self.roots
    }

    fn list(&self) -> String {
        let shown: Vec<String> = self.roots.iter().map(|r| r.display().to_string()).collect();
        if shown.is_empty() {
            "none: checkpoints are off".into()
        } else {
            shown.join(", ")
        }
    }

    /// The root `path` lies under (the longest), and the rest of the path.
    fn root_of<'a>(&'a self, path: &'a Path) -> Result<(&'a Path, &'a Path), CheckpointError> {
        let bytes = path.as_os_str().len();
        if path.as_os_str().as_encoded_bytes().contains(&0) {
            return Err(refused(path, "the path holds a NUL byte"));
        }
        if bytes >= 4096 || path.components().any(|c| c.as_os_str().len() > 255) {
            return Err(refused(
                path,
                "the path is too long (4,095 bytes at most, 255 per component)",
            ));
        }
        if !path.is_absolute() {
            return Err(refused(
                path,
                "the path is not absolute: a checkpoint path must be an absolute path",
            ));
        }
        if path
            .components()
            .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
        {
            return Err(refused(
                path,
                "a checkpoint path may not contain `.` or `..`",
            ));
        }
        let protected = self.protected.read().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = protected.iter().find(|p| path.starts_with(p)) {
            return Err(refused(
                path,
                format!(
                    "it lies in {}, which holds stowd's own state: checkpoints go elsewhere",
                    p.display()
                ),
            ));
        }
        let root = self
            .roots
            .iter()
            .filter(|r| path.starts_with(r))
            .max_by_key(|r| r.components().count())
            .ok_or_else(|| {
                refused(
                    path,
                    format!(
                        "it is outside the checkpoint roots ({}): stowd writes and reads \
                         checkpoints only under [checkpoint] roots",
                        self.list()
                    ),
                )
            })?;
        let rest = path.strip_prefix(root).expect("starts with the root");
        Ok((root, rest))
    }

    /// The directory `path` names, opened (see the module docs); `create`:
    /// missing components are made, mode 0700.
    pub fn dir(&self, path: &str, create: bool) -> Result<Dir, CheckpointError> {
        let path = Path::new(path);
        let (root, rest) = self.root_of(path)?;
        let mut fd = rustix::fs::open(
            root,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_err(root, e))?;
        let mut at = root.to_path_buf();
        for c in rest.components() {
            let Component::Normal(name) = c else {
                return Err(refused(path, "not a plain path below its root"));
            };
            at.push(name);
            fd = match open_dir(&fd, name) {
                Ok(next) => next,
                Err(Errno::NOENT) if create => {
                    match rustix::fs::mkdirat(&fd, name, Mode::from_raw_mode(0o700)) {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(e) => return Err(io_err(&at, e)),
                    }
                    open_dir(&fd, name).map_err(|e| dir_error(&at, e))?
                }
                Err(Errno::NOENT) => {
                    return Err(refused(
                        path,
                        format!("no such checkpoint directory ({} is missing)", at.display()),
                    ));
                }
                Err(e) => return Err(dir_error(&at, e)),
            };
        }
        let stat = rustix::fs::fstat(&fd).map_err(|e| io_err(path, e))?;
        if let Some(why) = not_private(&stat) {
            return Err(refused(path, why));
        }
        Ok(Dir {
            fd,
            path: path.to_path_buf(),
            id: (stat.st_dev, stat.st_ino),
        })
    }

    /// A checkpoint file `path` names: its directory, opened and checked
    /// as [`Roots::dir`] (it must exist), and its name in it.
    pub fn file(&self, path: &str) -> Result<(Dir, String), CheckpointError> {
        let p = Path::new(path);
        let (Some(parent), Some(name)) = (p.parent(), p.file_name().and_then(OsStr::to_str)) else {
            return Err(refused(p, "a checkpoint path must name a file"));
        };
        if path.ends_with('/') {
            return Err(refused(p, "a checkpoint path must name a file"));
        }
        self.root_of(p)?;
        let dir = self.dir(&parent.to_string_lossy(), false)?;
        Ok((dir, name.to_string()))
    }
}

fn open_dir(at: &OwnedFd, name: &OsStr) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(
        at,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

fn dir_error(path: &Path, e: Errno) -> CheckpointError {
    match e {
        Errno::LOOP => refused(
            path,
            "a symbolic link: checkpoint paths are followed without links",
        ),
        Errno::NOTDIR => refused(
            path,
            "not a directory (or a symbolic link: checkpoint paths are followed without links)",
        ),
        e => io_err(path, e),
    }
}

/// A checkpoint directory, opened and checked by [`Roots`]: every file of
/// it is reached through its descriptor.
#[derive(Debug)]
pub struct Dir {
    fd: OwnedFd,
    path: PathBuf,
    /// Device and inode: the same directory wherever it is moved to.
    id: (u64, u64),
}

static TEMP: AtomicU64 = AtomicU64::new(0);

/// The journal keeps its files in checkpoint directories, through these.
impl crate::journal::Dir for Dir {
    fn path(&self) -> &Path {
        Dir::path(self)
    }
    fn id(&self) -> (u64, u64) {
        Dir::id(self)
    }
    fn removed(&self) -> bool {
        Dir::removed(self)
    }
    fn try_clone(&self) -> std::io::Result<Box<dyn crate::journal::Dir>> {
        Ok(Box::new(Dir::try_clone(self)?))
    }
    fn create(&self, name: &str) -> std::io::Result<File> {
        Dir::create(self, name)
    }
    fn append(&self, name: &str) -> std::io::Result<File> {
        Dir::append(self, name)
    }
    fn remove(&self, name: &str) -> std::io::Result<()> {
        Dir::remove(self, name)
    }
    fn sync(&self) -> std::io::Result<()> {
        Dir::sync(self)
    }
}

impl Dir {
    /// A directory of this process's own making, checked as [`Roots::dir`]
    /// does, with no root: for tests and tools.
    pub fn open(path: &Path) -> Result<Dir, CheckpointError> {
        Roots::anywhere().dir(&path.to_string_lossy(), false)
    }

    /// The path it was opened by (for messages; it may have moved since).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `name` in it, as a path (for messages).
    pub fn join(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// Device and inode of the directory.
    pub fn id(&self) -> (u64, u64) {
        self.id
    }

    pub fn try_clone(&self) -> std::io::Result<Dir> {
        Ok(Dir {
            fd: self.fd.try_clone()?,
            path: self.path.clone(),
            id: self.id,
        })
    }

    /// Whether the directory was removed since it was opened.
    pub fn removed(&self) -> bool {
        rustix::fs::fstat(&self.fd).is_ok_and(|s| s.st_nlink == 0)
    }

    /// Opens `name` to read: None if there is no such file; refused unless
    /// it is a regular file of `stowd`'s user (a link, FIFO, device or
    /// directory is never opened for reading, nor waited on). Returns the
    /// file and its size.
    pub fn read(&self, name: &str) -> Result<Option<(File, u64)>, CheckpointError> {
        let path = self.join(name);
        let fd = match rustix::fs::openat(
            &self.fd,
            name,
            OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => return Ok(None),
            Err(Errno::LOOP) => return Err(refused(&path, "a symbolic link: not read")),
            Err(e) => return Err(io_err(&path, e)),
        };
        let stat = rustix::fs::fstat(&fd).map_err(|e| io_err(&path, e))?;
        let kind = FileType::from_raw_mode(stat.st_mode);
        if kind != FileType::RegularFile {
            return Err(refused(
                &path,
                format!("not a regular file ({kind:?}): not read"),
            ));
        }
        if stat.st_uid != euid() {
            return Err(refused(
                &path,
                format!(
                    "it belongs to uid {}, not to stowd's user (uid {}): not read",
                    stat.st_uid,
                    euid()
                ),
            ));
        }
        // Reads of a regular file never block on O_NONBLOCK; clear it all
        // the same, for what reads it next.
        let _ = rustix::fs::fcntl_setfl(&fd, OFlags::empty());
        Ok(Some((File::from(fd), stat.st_size as u64)))
    }

    /// Creates `name` (mode 0600); it must not exist.
    pub fn create(&self, name: &str) -> std::io::Result<File> {
        let fd = rustix::fs::openat(
            &self.fd,
            name,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )?;
        Ok(File::from(fd))
    }

    /// Opens `name` to append (made, mode 0600, if missing); refused
    /// unless it is a regular file of `stowd`'s user.
    pub fn append(&self, name: &str) -> std::io::Result<File> {
        let fd = rustix::fs::openat(
            &self.fd,
            name,
            OFlags::WRONLY
                | OFlags::APPEND
                | OFlags::CREATE
                | OFlags::NOFOLLOW
                | OFlags::NONBLOCK
                | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )?;
        let stat = rustix::fs::fstat(&fd)?;
        if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile || stat.st_uid != euid() {
            return Err(std::io::Error::other(format!(
                "{} is not a regular file of stowd's user",
                self.join(name).display()
            )));
        }
        let _ = rustix::fs::fcntl_setfl(&fd, OFlags::APPEND);
        Ok(File::from(fd))
    }

    /// A new temporary file (`.<stem>.<pid>.<n>.tmp`, mode 0600, `O_EXCL`)
    /// and its name.
    pub fn temp(&self, stem: &str) -> std::io::Result<(File, String)> {
        loop {
            let n = TEMP.fetch_add(1, Ordering::Relaxed);
            let name = format!(".{stem}.{}.{n}.tmp", std::process::id());
            match self.create(&name) {
                Ok(f) => return Ok((f, name)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Renames `from` to `to`, both in this directory.
    pub fn rename(&self, from: &str, to: &str) -> std::io::Result<()> {
        Ok(rustix::fs::renameat(&self.fd, from, &self.fd, to)?)
    }

    /// Removes the file `name`; a missing one is not an error.
    pub fn remove(&self, name: &str) -> std::io::Result<()> {
        match rustix::fs::unlinkat(&self.fd, name, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// What `name` is, if it exists (links are not followed).
    pub fn kind(&self, name: &str) -> Option<FileType> {
        rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW)
            .ok()
            .map(|s| FileType::from_raw_mode(s.st_mode))
    }

    /// Whether `name` exists (whatever it is; links are not followed).
    pub fn exists(&self, name: &str) -> bool {
        rustix::fs::statat(&self.fd, name, AtFlags::SYMLINK_NOFOLLOW).is_ok()
    }

    /// The names in the directory.
    pub fn names(&self) -> std::io::Result<Vec<String>> {
        let mut out = Vec::new();
        for entry in rustix::fs::Dir::read_from(&self.fd)? {
            let entry = entry?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name != "." && name != ".." {
                out.push(name);
            }
        }
        Ok(out)
    }

    /// `fsync` of the directory: its renames and removals are durable.
    pub fn sync(&self) -> std::io::Result<()> {
        Ok(rustix::fs::fsync(&self.fd)?)
    }

    /// Free bytes on its file system, for an unprivileged writer.
    pub fn available(&self) -> Option<u64> {
        rustix::fs::fstatvfs(&self.fd)
            .ok()
            .map(|s| s.f_bavail.saturating_mul(s.f_frsize))
    }
}

impl AsFd for Dir {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
