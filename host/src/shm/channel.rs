//! Descriptor channels: the Unix socket over which `stowd` hands segment
//! descriptors to same-node clients (`SCM_RIGHTS`), as Wayland compositors
//! and Arrow's Plasma store do. ZeroMQ cannot carry descriptors, so the
//! requests stay on the native endpoint and only descriptors go this way.
//!
//! - **Where.** `stowd` binds `sock` in a directory it creates
//!   with mode 0700 under `[shm] dir`, named `stowd-<pid>-` and 32 hex
//!   digits of OS randomness (a path longer than a socket address holds is
//!   reached through `/proc/self/fd/<directory>/sock`; clients do the same) (`mkdir` fails rather than reuse a directory
//!   someone made first). Only `stowd`'s own user (and root) can reach the
//!   socket; a peer of another user is also refused by its credentials
//!   (`SO_PEERCRED`). At start, `stowd` removes what dead `stowd`s of its
//!   own user (or an earlier process with its own pid) left under
//!   `[shm] dir`, and nothing of another user.
//! - **Which `[shm] dir`.** Whoever can rename entries in `[shm] dir` can
//!   move `stowd`'s channel directory aside and put a directory of the same
//!   name, with their own socket, in its place: same-node clients would
//!   then talk to them. So at start `[shm] dir` must be owned by `stowd`'s
//!   user or by root, and not writable by group or others unless it has
//!   the sticky bit (which lets only an entry's owner rename it): `/dev/shm`
//!   and `/tmp` (root, 1777) pass, a 0777 directory or one of another user
//!   is refused, naming its owner and mode. A missing `[shm] dir` is
//!   created 0700. The directory is judged as `lstat` sees it; a symbolic
//!   link is followed only if root or `stowd`'s user owns it (as
//!   `/dev/shm -> /run/shm` on some systems; nobody else can change where
//!   it points), its target is judged the same way, and the socket is made
//!   under the resolved path, so what the link points to later does not
//!   matter. A link of another user is refused: they could point it
//!   elsewhere at any time. Only `[shm] dir` itself is judged, not the
//!   directories above it (as for any path an operator configures).
//! - **Opening.** A client asks the native endpoint `channel`, connects to
//!   the path it gets, and reads the first message, the greeting
//!   `{"token": "<32 hex>"}` ([`Hello`]). It then names that token in the
//!   envelope key `channel` of its same-node gets and leases. The token is
//!   unguessable, so only the process that opened the channel receives
//!   what goes over it.
//! - **Messages** (`stowd` to client only): a 4-byte little-endian length,
//!   then that many bytes of msgpack `{"id": <request id>, "names":
//!   [<segment>, ...]}` ([`Descriptors`]), with one descriptor per name, in
//!   order, attached to the message's bytes (at most [`FDS_PER_SENDMSG`]
//!   per `sendmsg`, so a message's descriptors may come over several
//!   reads; a reader that reads exactly one message's bytes at a time gets
//!   exactly its descriptors). The message for a request is written before
//!   its reply on the native endpoint. Both messages are encoded and
//!   decoded in `stowage_wire::channel`, their reference; this module only
//!   moves their bytes and descriptors.
//! - **Closing.** A channel ends when the client closes it (or sends
//!   anything), or when a message cannot be written within the write
//!   timeout.

use std::collections::HashMap;
use std::io::IoSlice;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;

use super::ShmError;
use crate::wire::channel::{self as messages, Descriptors, Hello};

/// Most descriptors attached to one `sendmsg` (the kernel's limit,
/// `SCM_MAX_FD`, is 253).
pub const FDS_PER_SENDMSG: usize = 250;

/// The open channels of one `stowd`, and the socket they come through.
pub struct Channels {
    dir: PathBuf,
    path: PathBuf,
    open: Mutex<HashMap<String, Arc<tokio::sync::Mutex<OwnedWriteHalf>>>>,
    max: usize,
    write_timeout: Duration,
}

impl std::fmt::Debug for Channels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Channels")
            .field("path", &self.path)
            .finish()
    }
}

/// 128 random bits as 32 lowercase hex digits.
fn random_hex() -> std::io::Result<String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(std::io::Error::other)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Removes what dead `stowd`s left in `dir` (segment files of earlier
/// versions, channel directories), and what a process with this pid left
/// before this one started (a restart as PID 1 in a container).
fn clean(dir: &Path) -> std::io::Result<()> {
    let me = std::process::id();
    // A second before the start: it is known to 10 ms and tmpfs times are
    // coarse (a predecessor gone less than a second earlier leaves its
    // entries; their random names never collide with ours).
    let started = crate::sys::process_start().and_then(|t| t.checked_sub(Duration::from_secs(1)));
    for entry in std::fs::read_dir(dir)?.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let pid = name
            .strip_prefix("stowd-")
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok());
        let stale = match pid {
            Some(pid) if pid == me => {
                let modified = entry.metadata().and_then(|m| m.modified()).ok();
                matches!((modified, started), (Some(m), Some(s)) if m < s)
            }
            Some(pid) => !Path::new(&format!("/proc/{pid}")).exists(),
            None => false,
        };
        // Only what this user owns (lstat: a link is judged, and removed,
        // as itself): a directory another user made is theirs to remove
        // (and was never ours to use).
        let Ok(meta) = entry.metadata() else { continue };
        if stale && meta.uid() == rustix::process::geteuid().as_raw() {
            let path = entry.path();
            let _ = if meta.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
        }
    }
    Ok(())
}

/// Why `dir` (as `meta`, its `lstat`) may not hold the channel directory,
/// or None if it may (module docs, "Which `[shm] dir`").
fn untrusted(meta: &std::fs::Metadata) -> Option<String> {
    let me = rustix::process::geteuid().as_raw();
    let (owner, mode) = (meta.uid(), meta.mode() & 0o7777);
    if !meta.is_dir() {
        return Some("is not a directory".into());
    }
    if owner != me && owner != 0 {
        return Some(format!(
            "is owned by uid {owner} (mode {mode:04o}), neither stowd's user (uid {me}) nor \
             root: its owner could replace stowd's channel socket. Use a directory of \
             stowd's user, or one such as /dev/shm (root's, mode 1777)"
        ));
    }
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Some(format!(
            "is writable by group or others without the sticky bit (mode {mode:04o}, owner \
             uid {owner}): any of them could rename stowd's channel directory and put their \
             own socket in its place. Remove that write permission, add the sticky bit \
             (chmod +t, as /dev/shm and /tmp have), or name a directory for stowd to create"
        ));
    }
    None
}

/// `[shm] dir` if it may hold the channel directory (created 0700 if
/// missing), else why not; a link of root or `stowd`'s user is resolved,
/// and the resolved path is returned (module docs).
fn trusted_dir(dir: &Path) -> Result<PathBuf, ShmError> {
    let refuse = |path: &Path, why: String| ShmError::UntrustedDir {
        path: path.to_path_buf(),
        why,
    };
    let io = |what| move |source| ShmError::Io { what, source };
    let meta = match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(io("creating [shm] dir"))?;
            std::fs::symlink_metadata(dir).map_err(io("reading [shm] dir"))?
        }
        m => m.map_err(io("reading [shm] dir"))?,
    };
    if !meta.file_type().is_symlink() {
        return match untrusted(&meta) {
            Some(why) => Err(refuse(dir, why)),
            None => Ok(dir.to_path_buf()),
        };
    }
    let me = rustix::process::geteuid().as_raw();
    if meta.uid() != me && meta.uid() != 0 {
        return Err(refuse(
            dir,
            format!(
                "is a symbolic link owned by uid {}, neither stowd's user (uid {me}) nor root: \
                 its owner could point it elsewhere. Name the directory itself",
                meta.uid()
            ),
        ));
    }
    let target = std::fs::canonicalize(dir).map_err(io("resolving [shm] dir"))?;
    let meta = std::fs::symlink_metadata(&target).map_err(io("reading [shm] dir"))?;
    match untrusted(&meta) {
        Some(why) => Err(refuse(
            dir,
            format!("is a symbolic link to {}, which {why}", target.display()),
        )),
        None => Ok(target),
    }
}

impl Channels {
    /// Makes the private directory under `parent` (refused if others could
    /// replace it: module docs) and binds the channel socket in it. At most `max` channels are open at once; a message
    /// not written within `write_timeout` closes its channel.
    pub fn bind(
        parent: &Path,
        max: usize,
        write_timeout: Duration,
    ) -> Result<(Arc<Channels>, UnixListener), ShmError> {
        let io = |what| move |source| ShmError::Io { what, source };
        let parent = &trusted_dir(parent)?;
        clean(parent).map_err(io("cleaning [shm] dir"))?;
        let name = format!(
            "stowd-{}-{}",
            std::process::id(),
            random_hex().map_err(io("drawing a random name"))?
        );
        let dir = parent.join(name);
        // 0700, and never a directory that exists already.
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(io("creating the channel directory"))?;
        let path = dir.join("sock");
        let listener = bind_long(&path).map_err(io("binding the channel socket"))?;
        let channels = Arc::new(Channels {
            dir,
            path,
            open: Mutex::default(),
            max,
            write_timeout,
        });
        Ok((channels, listener))
    }

    /// The socket clients connect to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether a channel with this token is open.
    pub fn is_open(&self, token: &str) -> bool {
        self.open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(token)
    }

    /// How many channels are open.
    pub fn len(&self) -> usize {
        self.open.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Accepts channels until `shutdown` turns true.
    pub async fn serve(
        self: Arc<Self>,
        listener: UnixListener,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let me = rustix::process::geteuid().as_raw();
        loop {
            let stream = tokio::select! {
                s = listener.accept() => s,
                _ = shutdown.changed() => break,
            };
            let stream = match stream {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "channel accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let uid = stream.peer_cred().map(|c| c.uid()).ok();
            if uid != Some(me) && uid != Some(0) {
                tracing::warn!(?uid, "descriptor channel of another user refused");
                continue;
            }
            if self.len() >= self.max {
                tracing::warn!(max = self.max, "descriptor channel refused: too many open");
                continue;
            }
            let this = self.clone();
            tokio::spawn(async move {
                if let Err(e) = this.open_one(stream).await {
                    tracing::debug!(error = %e, "descriptor channel not opened");
                }
            });
        }
    }

    /// Greets a new channel with its token, and forgets it when the client
    /// closes it.
    async fn open_one(self: Arc<Self>, stream: UnixStream) -> Result<(), ShmError> {
        let token = random_hex().map_err(|source| ShmError::Io {
            what: "drawing a token",
            source,
        })?;
        let (mut read, write) = stream.into_split();
        let write = Arc::new(tokio::sync::Mutex::new(write));
        let hello = Hello { token: &token }.encode().map_err(unencodable)?;
        // Open before the greeting goes: the client may name the token in
        // a request the moment it reads it.
        self.open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(token.clone(), write.clone());
        if let Err(e) = self.write(&write, &hello, &[]).await {
            self.open
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&token);
            return Err(e);
        }
        // The client never writes: any byte, or the end, closes it.
        let mut byte = [0u8; 1];
        let _ = read.read(&mut byte).await;
        self.open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&token);
        Ok(())
    }

    /// Sends the descriptors `fds`, named `names`, for request `id` over
    /// the channel `token`.
    pub async fn send(
        &self,
        token: &str,
        id: u64,
        names: &[&str],
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), ShmError> {
        debug_assert_eq!(names.len(), fds.len());
        let writer = self
            .open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(token)
            .cloned()
            .ok_or_else(|| ShmError::UnknownChannel(token.chars().take(64).collect()))?;
        let message = Descriptors {
            id,
            names: names.to_vec(),
        }
        .encode()
        .map_err(unencodable)?;
        let sent = self.write(&writer, &message, fds).await;
        if sent.is_err() {
            // A channel that failed mid-message is out of step: close it.
            self.open
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(token);
            let _ = writer.lock().await.shutdown().await;
        }
        sent
    }

    /// Writes one encoded message (length, body) with `fds` attached,
    /// within the write timeout.
    async fn write(
        &self,
        writer: &tokio::sync::Mutex<OwnedWriteHalf>,
        message: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), ShmError> {
        let chunks: Vec<&[BorrowedFd<'_>]> = fds.chunks(FDS_PER_SENDMSG).collect();
        if chunks.len() > message.len() {
            return Err(ShmError::Channel(format!(
                "{} descriptors cannot ride on a {}-byte message",
                fds.len(),
                message.len()
            )));
        }
        let writer = writer.lock().await;
        let stream: &UnixStream = writer.as_ref();
        let go = async {
            let mut at = 0;
            for (i, chunk) in chunks.iter().enumerate() {
                // Every chunk but the last rides on one byte of its own, so
                // that bytes are left for the chunks after it.
                let end = if i + 1 < chunks.len() {
                    at + 1
                } else {
                    message.len()
                };
                at += send_with_fds(stream, &message[at..end], chunk).await?;
            }
            while at < message.len() {
                at += send_with_fds(stream, &message[at..], &[]).await?;
            }
            Ok::<(), std::io::Error>(())
        };
        match tokio::time::timeout(self.write_timeout, go).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(ShmError::Channel(format!("write failed: {e}"))),
            Err(_) => Err(ShmError::Channel(format!(
                "the client did not read its channel within {:?}",
                self.write_timeout
            ))),
        }
    }
}

/// A message that cannot be encoded (a length above 2^32-1).
fn unencodable(e: messages::Error) -> ShmError {
    ShmError::Channel(e.to_string())
}

/// One `sendmsg` of at least one byte of `bytes` with `fds` attached;
/// returns how many bytes went.
async fn send_with_fds(
    stream: &UnixStream,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> std::io::Result<usize> {
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(FDS_PER_SENDMSG))];
    loop {
        stream.writable().await?;
        let sent = stream.try_io(Interest::WRITABLE, || {
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
                return Err(std::io::Error::other(
                    "descriptors do not fit the control buffer",
                ));
            }
            rustix::net::sendmsg(
                stream.as_fd(),
                &[IoSlice::new(bytes)],
                &mut control,
                SendFlags::NOSIGNAL,
            )
            .map_err(std::io::Error::from)
        });
        match sent {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Longest path a Unix socket address holds (108 bytes with the NUL).
const MAX_SOCKET_PATH: usize = 107;

/// Runs `f` on `path`, or, when `path` is longer than a socket address
/// holds, on `/proc/self/fd/<dir>/<name>` through a descriptor of its
/// directory (the kernel resolves it to the same place).
fn via_short_path<T>(
    path: &Path,
    f: impl FnOnce(&Path) -> std::io::Result<T>,
) -> std::io::Result<T> {
    if path.as_os_str().len() <= MAX_SOCKET_PATH {
        return f(path);
    }
    let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
        return f(path);
    };
    let dir = std::fs::File::open(dir)?;
    let short = Path::new(&format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name);
    f(&short)
}

/// Binds a Unix socket at `path`, however long.
fn bind_long(path: &Path) -> std::io::Result<UnixListener> {
    via_short_path(path, |p| UnixListener::bind(p))
}

/// The client side, blocking: connects to a channel socket and reads its
/// greeting; returns the socket and the channel's token.
pub fn connect(path: &Path) -> std::io::Result<(std::os::unix::net::UnixStream, String)> {
    let sock = via_short_path(path, |p| std::os::unix::net::UnixStream::connect(p))?;
    let (hello, fds) = recv_message(&sock)?;
    if !fds.is_empty() {
        return Err(std::io::Error::other(format!(
            "bad channel greeting: {} descriptors came with it",
            fds.len()
        )));
    }
    let token = Hello::decode(&hello)
        .map_err(|e| std::io::Error::other(format!("bad channel greeting: {e}")))?
        .token
        .to_owned();
    Ok((sock, token))
}

/// The client side, blocking: one message of a channel, its body (msgpack,
/// for `stowage_wire::channel` to decode) and its descriptors. Reads
/// exactly the message's bytes, so it gets exactly its descriptors; a body
/// longer than `stowage_wire::channel::Limits::DEFAULT` allows is refused
/// before it is read.
pub fn recv_message(
    sock: &std::os::unix::net::UnixStream,
) -> std::io::Result<(Vec<u8>, Vec<std::os::fd::OwnedFd>)> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    let mut fds = Vec::new();
    let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(253))];
    let mut read_exact = |n: usize, fds: &mut Vec<std::os::fd::OwnedFd>| {
        let mut out = vec![0u8; n];
        let mut at = 0;
        while at < n {
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let got = rustix::net::recvmsg(
                sock,
                &mut [std::io::IoSliceMut::new(&mut out[at..])],
                &mut control,
                RecvFlags::CMSG_CLOEXEC,
            )?;
            for m in control.drain() {
                if let RecvAncillaryMessage::ScmRights(r) = m {
                    fds.extend(r);
                }
            }
            if got.bytes == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            at += got.bytes;
        }
        Ok::<_, std::io::Error>(out)
    };
    let prefix = read_exact(messages::LEN_BYTES, &mut fds)?;
    let len = messages::body_len(
        prefix.try_into().expect("LEN_BYTES bytes"),
        &messages::Limits::DEFAULT,
    )
    .map_err(std::io::Error::other)?;
    let body = read_exact(len, &mut fds)?;
    Ok((body, fds))
}

impl Drop for Channels {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
