//! The on-disk compile cache: compiled plugins, trusted only if this
//! `stowd` can prove it wrote them.
//!
//! A cache entry is native code: [`wasmtime::component::Component::deserialize`]
//! maps it executable and runs it as `stowd`, outside the sandbox. So an
//! entry is loaded only when all of these hold, and otherwise the plugin is
//! compiled again from its `.wasm` (and a WARN says which check failed):
//!
//! 1. **The directory is private** (checked once, when the registry is
//!    made). Its real path (symlinks resolved; the real path is what is used
//!    afterwards) must be a directory owned by this process's effective uid,
//!    writable by no one else (no group/other write bit). Every ancestor
//!    must be owned by root or by this uid and must not be writable by group
//!    or others, as `ssh` requires of the path to its keys; the one
//!    exception is a sticky directory such as `/tmp` (others cannot rename
//!    or delete what we own in it), accepted as an ancestor only when the
//!    cache directory itself is mode `0700`. A missing directory is created
//!    `0700` (with any missing parents). A directory that fails is not used
//!    at all: the registry runs with no cache and compiles every plugin at
//!    each load (one WARN, at start).
//! 2. **The key is ours.** `<cache>/cache.key` holds 32 random bytes from
//!    the OS ([`getrandom`]). It is created `0600` with `O_EXCL` under a
//!    temporary name, then hard-linked into place, so a concurrent `stowd`
//!    never reads a half-written key (the loser of the race reads the
//!    winner's). It is opened with `O_NOFOLLOW` and must be a regular file of
//!    32 bytes, owned by this uid, with no group/other permission bit.
//!    Otherwise, as for the directory: no cache.
//! 3. **Each entry carries a valid tag.** An entry file is
//!    `MAGIC | tag | artifact`, where `tag` = HMAC-SHA256 under the key of
//!    the entry's name (SHA-256 of the `.wasm` and the engine hash, the file
//!    name without `.cwasm`) and the artifact bytes. A file copied from
//!    another entry, one that was changed, or one written by anything that
//!    lacks the key fails and is recompiled (and rewritten).
//!
//! Checks 1 and 2 keep other users out (they can neither plant a file nor
//! read the key); check 3 makes every entry stand for the exact `.wasm` and
//! engine it was compiled from, which also catches swapped or corrupt files
//! written by this uid. Root, or code already running as this uid, can
//! still forge entries: they can equally replace the `stowd` binary.
//!
//! Crates, not hand-written crypto: `hmac` + `sha2` (RustCrypto; `sha2` was
//! already used for content hashes) for the tag, verified in constant time
//! by `Mac::verify_slice`; `getrandom` for the key; `libc` for `geteuid`
//! and `O_NOFOLLOW`, which `std` does not expose.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// File name of the key, inside the cache directory.
pub const KEY_FILE: &str = "cache.key";

/// Length of the key, bytes.
pub const KEY_LEN: usize = 32;

/// First bytes of every entry file written by this version of the cache.
pub const MAGIC: &[u8; 8] = b"STOWCW1\n";

/// Length of the tag (HMAC-SHA256).
const TAG_LEN: usize = 32;

/// Domain separation of the HMAC input: this key tags nothing else.
const DOMAIN: &[u8] = b"stowage compile cache entry v1\0";

type HmacSha256 = Hmac<Sha256>;

/// A compile cache directory that passed the checks, and its key.
pub struct CompileCache {
    /// The directory's real path.
    dir: PathBuf,
    key: [u8; KEY_LEN],
}

impl std::fmt::Debug for CompileCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompileCache")
            .field("dir", &self.dir)
            .field("key", &"<redacted>")
            .finish()
    }
}

/// Why an entry was not loaded.
#[derive(Debug, thiserror::Error)]
pub enum EntryError {
    #[error("cannot read it: {0}")]
    Read(std::io::Error),
    #[error("it is not a regular file")]
    NotAFile,
    #[error("it has no stowd tag (not written by this version of stowd's compile cache)")]
    Untagged,
    #[error(
        "its tag does not match: this stowd's key did not write it for this plugin and engine \
         (a file copied from another entry, changed, or planted)"
    )]
    BadTag,
}

/// Why a cache directory or its key is not used (the whole cache is then
/// off; see the module doc).
#[derive(Debug, thiserror::Error)]
pub enum CacheDirError {
    #[error("cannot {action} {}: {source}", path.display())]
    Io {
        action: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{} is not a directory", .0.display())]
    NotADirectory(PathBuf),
    #[error("{} is owned by uid {owner}, not by this process's uid {uid}", path.display())]
    Owner { path: PathBuf, owner: u32, uid: u32 },
    #[error("{} is writable by group or others (mode {mode:04o}); it must be 0700", path.display())]
    Writable { path: PathBuf, mode: u32 },
    #[error(
        "ancestor {} is owned by uid {owner}, neither root nor this process's uid {uid}",
        path.display()
    )]
    AncestorOwner { path: PathBuf, owner: u32, uid: u32 },
    #[error("ancestor {} is writable by group or others (mode {mode:04o})", path.display())]
    AncestorWritable { path: PathBuf, mode: u32 },
    #[error(
        "{} is under the world-writable sticky directory {}, so it must be mode 0700 (it is {mode:04o})",
        path.display(),
        sticky.display()
    )]
    UnderSticky {
        path: PathBuf,
        sticky: PathBuf,
        mode: u32,
    },
    #[error("the key file {} is not a regular file", .0.display())]
    KeyNotAFile(PathBuf),
    #[error(
        "the key file {} is owned by uid {owner}, not by this process's uid {uid}",
        path.display()
    )]
    KeyOwner { path: PathBuf, owner: u32, uid: u32 },
    #[error(
        "the key file {} is open to group or others (mode {mode:04o}); it must be 0600",
        path.display()
    )]
    KeyOpen { path: PathBuf, mode: u32 },
    #[error(
        "the key file {} has {len} bytes, not {KEY_LEN} (remove it to start a new key and cache)",
        path.display()
    )]
    KeyLength { path: PathBuf, len: u64 },
    #[error("no random bytes from the OS for a new key: {0}")]
    Random(#[source] getrandom::Error),
}

/// An [`CacheDirError::Io`] maker: `io("stat", path)(e)`.
fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> CacheDirError {
    let path = path.to_path_buf();
    move |source| CacheDirError::Io {
        action,
        path,
        source,
    }
}

/// This process's effective uid.
pub fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Opens `path` for reading without following a symlink at its last
/// component.
fn open_nofollow(path: &Path) -> std::io::Result<File> {
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
}

/// A process-unique suffix for temporary files.
fn tmp_suffix() -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    format!(
        "{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

impl CompileCache {
    /// Checks (creating it `0700` if missing) the directory `dir`, then
    /// reads or creates its key. The error says which check failed and on
    /// which path.
    pub fn open(dir: &Path) -> Result<CompileCache, CacheDirError> {
        let dir = private_dir(dir)?;
        let key = load_or_create_key(&dir)?;
        Ok(CompileCache { dir, key })
    }

    /// The directory's real path.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Path of the entry named `name`.
    pub fn entry_path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.cwasm"))
    }

    fn mac(&self, name: &str) -> HmacSha256 {
        let mut mac =
            HmacSha256::new_from_slice(&self.key).expect("HMAC takes a key of any length");
        mac.update(DOMAIN);
        mac.update(&(name.len() as u64).to_le_bytes());
        mac.update(name.as_bytes());
        mac
    }

    /// The tag of `artifact` as the entry `name`.
    fn tag(&self, name: &str, artifact: &[u8]) -> [u8; TAG_LEN] {
        let mut mac = self.mac(name);
        mac.update(artifact);
        mac.finalize().into_bytes().into()
    }

    /// The verified contents of entry `name`: `Ok(None)` if there is no
    /// entry, `Ok(Some(file))` with the artifact at `file[`[`CompileCache::ARTIFACT_AT`]`..]`,
    /// or why the entry cannot be trusted.
    pub fn load(&self, name: &str) -> Result<Option<Vec<u8>>, EntryError> {
        let path = self.entry_path(name);
        let mut file = match open_nofollow(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(EntryError::Read(e)),
        };
        if !file.metadata().map_err(EntryError::Read)?.is_file() {
            return Err(EntryError::NotAFile);
        }
        let mut data = Vec::new();
        file.read_to_end(&mut data).map_err(EntryError::Read)?;
        if data.len() < Self::ARTIFACT_AT || &data[..MAGIC.len()] != MAGIC {
            return Err(EntryError::Untagged);
        }
        let (tag, artifact) = data[MAGIC.len()..].split_at(TAG_LEN);
        let mut mac = self.mac(name);
        mac.update(artifact);
        mac.verify_slice(tag).map_err(|_| EntryError::BadTag)?;
        Ok(Some(data))
    }

    /// Where the artifact starts in what [`CompileCache::load`] returns.
    pub const ARTIFACT_AT: usize = MAGIC.len() + TAG_LEN;

    /// Writes `artifact` as entry `name`, tagged (a private temporary file
    /// renamed into place, so a reader sees the old entry or the new one).
    pub fn store(&self, name: &str, artifact: &[u8]) -> std::io::Result<()> {
        let path = self.entry_path(name);
        let tmp = self.dir.join(format!(".{name}.tmp{}", tmp_suffix()));
        let write = || -> std::io::Result<()> {
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&tmp)?;
            f.write_all(MAGIC)?;
            f.write_all(&self.tag(name, artifact))?;
            f.write_all(artifact)?;
            std::fs::rename(&tmp, &path)
        };
        let result = write();
        if result.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        result
    }
}

/// Creates `dir` (`0700`, with missing parents) if it does not exist, then
/// checks it and its ancestors; returns its real path.
pub fn private_dir(dir: &Path) -> Result<PathBuf, CacheDirError> {
    match std::fs::symlink_metadata(dir) {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io("create", dir))?,
        Err(e) => return Err(io("stat", dir)(e)),
    }
    let real = dir.canonicalize().map_err(io("resolve", dir))?;
    check_private_dir(&real, euid())?;
    Ok(real)
}

/// The checks of a private directory `real` (an absolute path with no
/// symlinks) for a process of effective uid `uid`.
pub fn check_private_dir(real: &Path, uid: u32) -> Result<(), CacheDirError> {
    let stat = |p: &Path| std::fs::metadata(p).map_err(io("stat", p));
    let meta = stat(real)?;
    let path = || real.to_path_buf();
    if !meta.is_dir() {
        return Err(CacheDirError::NotADirectory(path()));
    }
    if meta.uid() != uid {
        return Err(CacheDirError::Owner {
            path: path(),
            owner: meta.uid(),
            uid,
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(CacheDirError::Writable { path: path(), mode });
    }
    for anc in real.ancestors().skip(1) {
        let m = stat(anc)?;
        if m.uid() != 0 && m.uid() != uid {
            return Err(CacheDirError::AncestorOwner {
                path: anc.to_path_buf(),
                owner: m.uid(),
                uid,
            });
        }
        let amode = m.mode() & 0o7777;
        if amode & 0o022 != 0 {
            if amode & 0o1000 == 0 {
                return Err(CacheDirError::AncestorWritable {
                    path: anc.to_path_buf(),
                    mode: amode,
                });
            }
            if mode & 0o077 != 0 {
                return Err(CacheDirError::UnderSticky {
                    path: path(),
                    sticky: anc.to_path_buf(),
                    mode,
                });
            }
        }
    }
    Ok(())
}

/// Reads the key of the (checked) directory `dir`, or creates it.
fn load_or_create_key(dir: &Path) -> Result<[u8; KEY_LEN], CacheDirError> {
    let path = dir.join(KEY_FILE);
    match open_nofollow(&path) {
        Ok(f) => read_key(f, &path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => create_key(dir, &path),
        Err(e) => Err(io("open the key file", &path)(e)),
    }
}

fn read_key(mut f: File, path: &Path) -> Result<[u8; KEY_LEN], CacheDirError> {
    let meta = f.metadata().map_err(io("stat the key file", path))?;
    let uid = euid();
    if !meta.is_file() {
        return Err(CacheDirError::KeyNotAFile(path.to_path_buf()));
    }
    if meta.uid() != uid {
        return Err(CacheDirError::KeyOwner {
            path: path.to_path_buf(),
            owner: meta.uid(),
            uid,
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(CacheDirError::KeyOpen {
            path: path.to_path_buf(),
            mode,
        });
    }
    if meta.len() != KEY_LEN as u64 {
        return Err(CacheDirError::KeyLength {
            path: path.to_path_buf(),
            len: meta.len(),
        });
    }
    let mut key = [0u8; KEY_LEN];
    f.read_exact(&mut key)
        .map_err(io("read the key file", path))?;
    Ok(key)
}

fn create_key(dir: &Path, path: &Path) -> Result<[u8; KEY_LEN], CacheDirError> {
    let mut key = [0u8; KEY_LEN];
    getrandom::fill(&mut key).map_err(CacheDirError::Random)?;
    let tmp = dir.join(format!(".{KEY_FILE}.tmp{}", tmp_suffix()));
    let write = || -> std::io::Result<()> {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)?;
        f.write_all(&key)?;
        f.sync_all()
    };
    let written = write().map_err(io("write a new key file", &tmp));
    // Hard-link rather than rename: the link fails if another stowd made
    // the key first, and then its key is the one to use.
    let linked = written.and_then(|()| match std::fs::hard_link(&tmp, path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(io("create the key file", path)(e)),
    });
    let _ = std::fs::remove_file(&tmp);
    if linked? {
        Ok(key)
    } else {
        let f = open_nofollow(path).map_err(io("open the key file", path))?;
        read_key(f, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh(tag: &str) -> PathBuf {
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let d = std::env::temp_dir().join(format!("cache-unit-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn entries_round_trip_and_bind_their_name() {
        let dir = fresh("roundtrip");
        let c = CompileCache::open(&dir.join("c")).unwrap();
        assert_eq!(std::fs::metadata(c.dir()).unwrap().mode() & 0o777, 0o700);
        assert_eq!(
            std::fs::metadata(c.dir().join(KEY_FILE)).unwrap().mode() & 0o777,
            0o600
        );
        assert!(c.load("a-1").unwrap().is_none());
        c.store("a-1", b"artifact a").unwrap();
        c.store("b-1", b"artifact b").unwrap();
        let a = c.load("a-1").unwrap().unwrap();
        assert_eq!(&a[CompileCache::ARTIFACT_AT..], b"artifact a");
        // A copy of one entry under another's name fails.
        std::fs::copy(c.entry_path("a-1"), c.entry_path("b-1")).unwrap();
        assert!(
            matches!(c.load("b-1"), Err(EntryError::BadTag)),
            "{:?}",
            c.load("b-1")
        );
        // So does an untagged file and a changed byte.
        std::fs::write(c.entry_path("b-1"), b"plain").unwrap();
        assert!(matches!(c.load("b-1"), Err(EntryError::Untagged)));
        let mut changed = a.clone();
        *changed.last_mut().unwrap() ^= 1;
        std::fs::write(c.entry_path("a-1"), &changed).unwrap();
        assert!(matches!(c.load("a-1"), Err(EntryError::BadTag)));
        // The key survives a reopen; another key does not accept the entry.
        c.store("a-1", b"artifact a").unwrap();
        let again = CompileCache::open(&dir.join("c")).unwrap();
        assert!(again.load("a-1").unwrap().is_some());
        std::fs::remove_file(c.dir().join(KEY_FILE)).unwrap();
        let rekeyed = CompileCache::open(&dir.join("c")).unwrap();
        assert!(matches!(rekeyed.load("a-1"), Err(EntryError::BadTag)));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn insecure_dirs_and_keys_are_refused() {
        let dir = fresh("insecure");
        let c = dir.join("c");
        CompileCache::open(&c).unwrap();
        std::fs::set_permissions(&c, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
        let e = CompileCache::open(&c).unwrap_err().to_string();
        assert!(
            e.contains("writable by group or others") && e.contains("0777"),
            "{e}"
        );
        std::fs::set_permissions(&c, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
        // An ancestor writable by others (not sticky).
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .unwrap();
        let e = CompileCache::open(&c).unwrap_err().to_string();
        assert!(e.contains("ancestor") && e.contains("0777"), "{e}");
        // Sticky: fine as an ancestor of a 0700 directory, not of a 0755 one.
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o1777))
            .unwrap();
        CompileCache::open(&c).unwrap();
        std::fs::set_permissions(&c, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let e = CompileCache::open(&c).unwrap_err().to_string();
        assert!(e.contains("sticky") && e.contains("0700"), "{e}");
        std::fs::set_permissions(&c, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
        std::fs::set_permissions(&dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        // Another uid owning the directory (checked without chown).
        let real = c.canonicalize().unwrap();
        let e = check_private_dir(&real, euid() + 1).unwrap_err();
        assert!(matches!(e, CacheDirError::Owner { .. }), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("owned by uid"), "{e}");
        // A key open to others, a symlinked key, a short key.
        let key = real.join(KEY_FILE);
        std::fs::set_permissions(&key, std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .unwrap();
        let e = CompileCache::open(&c).unwrap_err().to_string();
        assert!(e.contains("key file") && e.contains("0644"), "{e}");
        std::fs::remove_file(&key).unwrap();
        std::fs::write(real.join("elsewhere"), [7u8; KEY_LEN]).unwrap();
        std::os::unix::fs::symlink(real.join("elsewhere"), &key).unwrap();
        let e = CompileCache::open(&c).unwrap_err().to_string();
        assert!(e.contains("key file"), "{e}");
        std::fs::remove_file(&key).unwrap();
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&key)
            .unwrap()
            .write_all(b"short")
            .unwrap();
        let e = CompileCache::open(&c).unwrap_err().to_string();
        assert!(e.contains("5 bytes"), "{e}");
        // A file where the directory should be.
        std::fs::write(dir.join("f"), b"").unwrap();
        let e = CompileCache::open(&dir.join("f")).unwrap_err();
        assert!(matches!(e, CacheDirError::NotADirectory(_)), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("not a directory"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
