//! Tests of the segment store and the descriptor channels.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::PermissionsExt;

use super::*;

fn store(ttl: Duration) -> SegmentStore {
    SegmentStore::new(ttl, 1 << 30)
}

/// A descriptor as another process gets it: a new open file description.
fn reopen(fd: BorrowedFd<'_>, write: bool) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .open(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// Fills a leased segment through its descriptor, as a client does.
fn fill(fd: &OwnedFd, bytes: &[u8]) {
    let file = File::from(fd.try_clone().unwrap());
    file.write_all_at(bytes, 0).unwrap();
}

#[test]
fn exported_bytes_live_in_a_sealed_segment_freed_with_the_last_slice() {
    let s = store(Duration::from_secs(5));
    let (whole, handle) = s.export(&[b"abc", b"defg"]).unwrap();
    assert_eq!(&whole[..], b"abcdefg");
    assert_eq!(handle.len(), 7);
    assert_eq!(s.counts(), (1, 0));
    let part = whole.slice(3..);
    drop(whole);
    assert_eq!(s.counts(), (1, 0), "a slice keeps the segment");
    drop(part);
    assert_eq!(s.counts(), (1, 0), "a handle keeps the segment");
    drop(handle);
    assert_eq!(
        s.counts(),
        (0, 0),
        "segment not freed after the last slice and handle"
    );
}

#[test]
fn no_descriptor_a_reader_gets_can_change_a_segment() {
    let s = store(Duration::from_secs(5));
    let (whole, handle) = s.export(&[b"stored rows"]).unwrap();
    // The descriptor readers get is read-only.
    let mut ro = File::from(handle.fd().try_clone_to_owned().unwrap());
    assert!(ro.write_all(b"x").is_err());
    // Reopened read-write (as any same-user process can through /proc),
    // the seals still refuse every way to change it.
    let rw = reopen(handle.fd(), true).unwrap();
    assert!(rw.write_all_at(b"XX", 0).is_err(), "write() went through");
    assert!(rw.set_len(2).is_err(), "shrunk");
    assert!(rw.set_len(1 << 20).is_err(), "grew");
    let punch = rustix::fs::fallocate(
        &rw,
        FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
        0,
        4,
    );
    assert!(punch.is_err(), "a hole was punched");
    // SAFETY: a test mapping of a file nothing else maps writable; it is
    // expected to fail.
    let shared = unsafe { memmap2::MmapOptions::new().map_mut(&rw) };
    assert!(shared.is_err(), "a writable shared mapping was allowed");
    assert!(
        rustix::fs::fcntl_add_seals(&rw, SealFlags::FUTURE_WRITE).is_err(),
        "seals can still be changed"
    );
    // A private copy-on-write mapping is allowed, and its writes stay in it.
    // SAFETY: a private mapping; the file cannot change (sealed).
    let mut private = unsafe { memmap2::MmapOptions::new().map_copy(&rw) }.unwrap();
    private[0] = b'X';
    let mut back = String::new();
    ro.read_to_string(&mut back).unwrap();
    assert_eq!(back, "stored rows");
    assert_eq!(&whole[..], b"stored rows");
}

#[test]
fn a_lease_is_sealed_at_adoption_and_a_writer_that_kept_its_mapping_is_refused() {
    let s = store(Duration::from_secs(5));
    let (name, _, fd) = s.lease(8, 1).unwrap();
    fill(&fd, b"12345678");
    let (bytes, handle) = s.adopt(&name, 1).unwrap();
    assert_eq!(&bytes[..], b"12345678");
    assert_eq!(&**handle.name(), name);
    // The writer's own descriptor can no longer write.
    let writer = File::from(fd);
    assert!(writer.write_all_at(b"changed!", 0).is_err());
    assert_eq!(&bytes[..], b"12345678");
    assert!(matches!(s.adopt(&name, 1), Err(ShmError::UnknownLease(_))));

    // A writer that still maps its lease writable cannot have it adopted.
    let (name, _, fd) = s.lease(4096, 1).unwrap();
    // SAFETY: a test mapping of the leased file, written below.
    let mut map = unsafe { memmap2::MmapOptions::new().map_mut(&File::from(fd)) }.unwrap();
    map[..4].copy_from_slice(b"rows");
    assert!(matches!(s.adopt(&name, 1), Err(ShmError::StillMapped(_))));
    assert_eq!(s.counts(), (1, 0), "the refused lease is gone");
    map[..4].copy_from_slice(b"evil");
    drop(map);
}

#[test]
fn a_seal_refused_as_busy_can_keep_the_lease_for_another_try() {
    let s = store(Duration::from_secs(5));
    let (name, _, fd) = s.lease(4096, 1).unwrap();
    let file = File::from(fd);
    // SAFETY: a test mapping of the leased file, written below.
    let mut map = unsafe { memmap2::MmapOptions::new().map_mut(&file) }.unwrap();
    map[..4].copy_from_slice(b"rows");
    // Kept: refused while mapped, the lease still there and its owner's.
    assert!(matches!(
        s.adopt_or_keep(&name, 1, true),
        Err(ShmError::StillMapped(_))
    ));
    assert_eq!(s.counts(), (0, 1), "the lease is kept");
    assert!(matches!(
        s.adopt_or_keep(&name, 2, true),
        Err(ShmError::NotYourLease(_))
    ));
    drop(map);
    // Unmapped: the next try seals it, and the writer can no longer write.
    let (bytes, _) = s.adopt_or_keep(&name, 1, true).unwrap();
    assert_eq!(&bytes[..4], b"rows");
    assert!(file.write_all_at(b"evil", 0).is_err());
    assert_eq!(&bytes[..4], b"rows");
    assert_eq!(s.counts(), (1, 0));
}

#[test]
fn a_lease_resized_or_sealed_by_its_writer_is_refused() {
    let s = store(Duration::from_secs(5));
    let (name, _, fd) = s.lease(64, 1).unwrap();
    File::from(fd).set_len(8).unwrap();
    assert!(matches!(s.adopt(&name, 1), Err(ShmError::Tampered(_))));
    let (name, _, fd) = s.lease(64, 1).unwrap();
    rustix::fs::fcntl_add_seals(&fd, SealFlags::SEAL).unwrap();
    assert!(matches!(s.adopt(&name, 1), Err(ShmError::Tampered(_))));
    // An empty lease is adopted as an empty segment.
    let (name, _, _fd) = s.lease(0, 1).unwrap();
    let (bytes, _) = s.adopt(&name, 1).unwrap();
    assert!(bytes.is_empty());
}

#[test]
fn leases_expire_and_are_bounded() {
    let s = store(Duration::from_millis(50));
    let (stale, _, _fd) = s.lease(8, 1).unwrap();
    std::thread::sleep(Duration::from_millis(80));
    assert_eq!(s.sweep(), 1);
    assert!(matches!(s.adopt(&stale, 1), Err(ShmError::UnknownLease(_))));
    assert!(matches!(
        s.adopt("../../etc/passwd", 1),
        Err(ShmError::UnknownLease(_))
    ));
    assert!(matches!(
        s.lease(2 << 30, 1),
        Err(ShmError::TooLarge { .. })
    ));
}

#[test]
fn leases_together_stay_within_the_quota_until_adopted_or_expired() {
    let s = store(Duration::from_millis(200)).with_lease_quota(10 << 20);
    let (a, _, fa) = s.lease(4 << 20, 1).unwrap();
    let (_b, _, _fb) = s.lease(4 << 20, 1).unwrap();
    match s.lease(4 << 20, 1) {
        Err(e @ ShmError::LeaseQuota { .. }) => {
            let text = e.to_string();
            assert!(text.contains("max_leased_bytes"), "{text}");
            assert!(text.contains(&(8u64 << 20).to_string()), "{text}");
        }
        other => panic!("expected the quota, got {other:?}"),
    }
    drop(fa);
    s.adopt(&a, 1).unwrap();
    s.lease(4 << 20, 1).unwrap();
    std::thread::sleep(Duration::from_millis(250));
    s.lease(8 << 20, 1).unwrap();
}

#[test]
fn one_connection_stays_within_its_own_lease_quota() {
    let s = store(Duration::from_secs(5)).with_connection_lease_quota(6 << 20);
    let (a, _, _fa) = s.lease(4 << 20, 1).unwrap();
    match s.lease(4 << 20, 1) {
        Err(e @ ShmError::ConnectionLeaseQuota { .. }) => {
            assert!(e.to_string().contains("max_connection_leased_bytes"), "{e}")
        }
        other => panic!("expected the per-connection quota, got {other:?}"),
    }
    // Another connection has its own share.
    s.lease(4 << 20, 2).unwrap();
    // A put gives the share back.
    s.adopt(&a, 1).unwrap();
    s.lease(4 << 20, 1).unwrap();
}

#[test]
fn files_allocated_ahead_serve_the_next_lease_of_that_size_and_were_never_shared() {
    let s = store(Duration::from_secs(5)).with_prealloc(8 << 20, Duration::from_secs(60));
    let (a, _, fa) = s.lease(2 << 20, 1).unwrap();
    let first_ino = File::from(fa.try_clone().unwrap())
        .metadata()
        .unwrap()
        .ino();
    fill(&fa, &[7u8; 16]);
    drop(fa);
    s.adopt(&a, 1).unwrap();
    // The filler makes one file of that size ready, in the background.
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.prealloc().0 < 2 << 20 {
        assert!(Instant::now() < deadline, "nothing allocated ahead");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (_b, _, fb) = s.lease(2 << 20, 1).unwrap();
    assert_eq!(
        s.prealloc().1,
        1,
        "the lease did not take the file made ahead"
    );
    let file = File::from(fb);
    assert_eq!(file.metadata().unwrap().len(), 2 << 20);
    assert_ne!(
        file.metadata().unwrap().ino(),
        first_ino,
        "a leased file came back"
    );
    let mut head = [1u8; 16];
    file.read_exact_at(&mut head, 0).unwrap();
    assert_eq!(head, [0u8; 16], "memory allocated ahead is not fresh");
    // Sizes far off are allocated on demand; the cap holds.
    s.lease(6 << 20, 1).unwrap();
    assert!(s.prealloc().0 <= 8 << 20);
}

#[test]
fn a_lease_is_put_only_by_the_connection_that_asked() {
    let s = store(Duration::from_secs(5));
    let (name, _, _fd) = s.lease(16, 7).unwrap();
    assert!(matches!(s.adopt(&name, 8), Err(ShmError::NotYourLease(_))));
    s.adopt(&name, 7).unwrap();
}

#[test]
fn every_segment_is_a_new_memory_file() {
    // Pages are never reused: a cleared segment's memory is not handed to
    // the next lease or export.
    let s = store(Duration::from_secs(5));
    let (bytes, handle) = s.export(&[&[1u8; 4096]]).unwrap();
    let old = reopen(handle.fd(), false).unwrap();
    let old_ino = old.metadata().unwrap().ino();
    drop((bytes, handle));
    let (_name, _, fd) = s.lease(4096, 1).unwrap();
    let new_ino = File::from(fd).metadata().unwrap().ino();
    assert_ne!(old_ino, new_ino);
    let mut back = Vec::new();
    (&old).read_to_end(&mut back).unwrap();
    assert_eq!(back, vec![1u8; 4096], "the old reader's file changed");
}

use std::os::unix::fs::MetadataExt;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn channels_are_private_and_carry_many_descriptors_to_their_token_only() {
    let parent = std::env::temp_dir().join(format!("stowage-chan-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&parent);
    // An entry a dead stowd left, and one of another name: the first goes.
    std::fs::create_dir_all(parent.join("stowd-999999999-dead")).unwrap();
    std::fs::write(parent.join("other"), b"x").unwrap();
    let rt = runtime();
    rt.block_on(async {
        let (channels, listener) = Channels::bind(&parent, 4, Duration::from_secs(5)).unwrap();
        assert!(!parent.join("stowd-999999999-dead").exists());
        assert!(parent.join("other").exists());
        let dir = channels.path().parent().unwrap();
        let mode = std::fs::metadata(dir).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "the channel directory is not private");
        let (_tx, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(channels.clone().serve(listener, rx));
        let path = channels.path().to_path_buf();
        let (sock, token) = tokio::task::spawn_blocking(move || channel::connect(&path).unwrap())
            .await
            .unwrap();
        assert_eq!(token.len(), 32, "{token:?}");
        while !channels.is_open(&token) {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // 600 segments: more than one sendmsg's worth of descriptors.
        let s = store(Duration::from_secs(5));
        let segments: Vec<(Bytes, Handle)> = (0..600u32)
            .map(|i| s.export(&[&i.to_le_bytes()]).unwrap())
            .collect();
        let names: Vec<&str> = segments.iter().map(|(_, h)| &**h.name()).collect();
        let fds: Vec<_> = segments.iter().map(|(_, h)| h.fd()).collect();
        let reader = tokio::task::spawn_blocking(move || channel::recv_message(&sock).unwrap());
        channels.send(&token, 42, &names, &fds).await.unwrap();
        let (body, got) = reader.await.unwrap();
        assert_eq!(got.len(), 600);
        for (i, fd) in got.iter().enumerate() {
            let mut b = [0u8; 4];
            File::from(fd.try_clone().unwrap())
                .read_exact_at(&mut b, 0)
                .unwrap();
            assert_eq!(u32::from_le_bytes(b), i as u32);
        }
        let message = crate::wire::channel::Descriptors::decode(&body, &Default::default())
            .expect("a descriptor message");
        assert_eq!((message.id, message.names), (42, names));
        // An unknown token is refused.
        assert!(matches!(
            channels.send("0123", 1, &[], &[]).await,
            Err(ShmError::UnknownChannel(_))
        ));
    });
    let _ = std::fs::remove_dir_all(&parent);
}

#[test]
fn channels_past_the_limit_and_clients_that_write_are_closed() {
    let parent = std::env::temp_dir().join(format!("stowage-chan-limit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&parent);
    let rt = runtime();
    rt.block_on(async {
        let (channels, listener) = Channels::bind(&parent, 2, Duration::from_secs(5)).unwrap();
        let (_tx, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(channels.clone().serve(listener, rx));
        let path = channels.path().to_path_buf();
        let open =
            |path: std::path::PathBuf| tokio::task::spawn_blocking(move || channel::connect(&path));
        let (a, ta) = open(path.clone()).await.unwrap().unwrap();
        let (_b, tb) = open(path.clone()).await.unwrap().unwrap();
        while channels.len() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // A third is closed before its greeting.
        let third = open(path.clone()).await.unwrap();
        assert!(third.is_err(), "a channel past the limit was greeted");
        assert_eq!(channels.len(), 2);
        // A client that writes on its channel ends it; the other stays.
        (&a).write_all(b"x").unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        while channels.is_open(&ta) {
            assert!(
                Instant::now() < deadline,
                "a channel its client wrote on stayed open"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(channels.is_open(&tb));
        assert!(matches!(
            channels.send(&ta, 1, &[], &[]).await,
            Err(ShmError::UnknownChannel(_))
        ));
        // Room again for a new one.
        let (_c, tc) = open(path).await.unwrap().unwrap();
        assert_ne!(tc, ta);
    });
    let _ = std::fs::remove_dir_all(&parent);
}

/// Descriptors this process holds open on the memory file of inode `ino`
/// (other tests run beside this one: count only the file at hand).
fn open_on(ino: u64) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::metadata(e.ok()?.path()).ok())
        .filter(|m| m.ino() == ino)
        .count()
}

/// A lease's name and inode; the client's descriptor is closed.
fn lease_and_close(s: &SegmentStore, len: u64, seal: SealFlags) -> (String, u64) {
    let (name, _, fd) = s.lease(len, 1).unwrap();
    if !seal.is_empty() {
        rustix::fs::fcntl_add_seals(&fd, seal).unwrap();
    }
    let ino = File::from(fd).metadata().unwrap().ino();
    (name, ino)
}

#[test]
fn a_void_lease_closes_its_descriptor_at_once() {
    let s = store(Duration::from_secs(30));
    for _ in 0..10 {
        // Sealed by its writer: the put is refused and the lease void.
        let (name, ino) = lease_and_close(&s, 8 << 20, SealFlags::SEAL);
        assert_eq!(open_on(ino), 1, "the store holds the lease's descriptor");
        assert!(matches!(s.adopt(&name, 1), Err(ShmError::Tampered(_))));
        assert_eq!(open_on(ino), 0, "a void lease kept its descriptor");
        // Resized by its writer: void too.
        let (name, _, fd) = s.lease(64, 1).unwrap();
        let file = File::from(fd);
        file.set_len(8).unwrap();
        let ino = file.metadata().unwrap().ino();
        drop(file);
        assert!(matches!(s.adopt(&name, 1), Err(ShmError::Tampered(_))));
        assert_eq!(open_on(ino), 0, "a void lease kept its descriptor");
    }
    assert_eq!(s.counts(), (0, 0));
}

#[test]
fn an_expired_lease_closes_its_descriptor_at_the_sweep() {
    let s = store(Duration::from_millis(50));
    let inos: Vec<u64> = (0..10)
        .map(|_| lease_and_close(&s, 1 << 20, SealFlags::empty()).1)
        .collect();
    assert_eq!(s.counts(), (0, 10));
    assert!(inos.iter().all(|&i| open_on(i) == 1));
    std::thread::sleep(Duration::from_millis(80));
    assert_eq!(s.sweep(), 10);
    assert_eq!(
        s.counts(),
        (0, 0),
        "the counters disagree with what is held"
    );
    for ino in inos {
        assert_eq!(open_on(ino), 0, "an expired lease kept its descriptor");
    }
}

#[test]
fn leases_are_counted_per_connection_and_in_total_whatever_their_bytes() {
    let s = store(Duration::from_millis(300)).with_lease_counts(3, 2);
    let (a, _, _fa) = s.lease(1, 1).unwrap();
    s.lease(1, 1).unwrap();
    match s.lease(1, 1) {
        Err(e @ ShmError::ConnectionLeaseCount { .. }) => {
            let text = e.to_string();
            assert!(text.contains("max_connection_leases is 2"), "{text}");
        }
        other => panic!("expected the per-connection count, got {other:?}"),
    }
    // Another connection has its own share, up to the total.
    s.lease(1, 2).unwrap();
    match s.lease(1, 3) {
        Err(e @ ShmError::LeaseCount { .. }) => {
            let text = e.to_string();
            assert!(text.contains("max_leases is 3"), "{text}");
        }
        other => panic!("expected the total count, got {other:?}"),
    }
    // A put gives its place back, and so does expiry.
    s.adopt(&a, 1).unwrap();
    s.lease(1, 3).unwrap();
    std::thread::sleep(Duration::from_millis(350));
    for _ in 0..2 {
        s.lease(1, 1).unwrap();
    }
    assert_eq!(s.counts().1, 2);
}

#[test]
fn the_leases_of_a_connection_that_ended_close_their_descriptors_at_once() {
    let s = store(Duration::from_secs(30));
    let mine: Vec<u64> = (0..5)
        .map(|_| lease_and_close(&s, 4096, SealFlags::empty()).1)
        .collect();
    let (other, _, _fd) = s.lease(4096, 2).unwrap();
    assert_eq!(s.release_connection(1), 5);
    assert_eq!(s.counts(), (0, 1));
    for ino in mine {
        assert_eq!(
            open_on(ino),
            0,
            "a closed connection's lease kept its descriptor"
        );
    }
    s.adopt(&other, 2)
        .expect("another connection's lease stays");
}

/// Running as root (CI): what "another user" is tested with.
fn root() -> bool {
    rustix::process::geteuid().is_root()
}

const NOBODY: u32 = 65534;

/// Binds channels under `dir`: the error's text if refused.
fn bind_under(dir: &std::path::Path) -> Result<std::path::PathBuf, String> {
    runtime().block_on(async {
        Channels::bind(dir, 2, Duration::from_secs(5))
            .map(|(c, _listener)| c.path().to_path_buf())
            .map_err(|e| e.to_string())
    })
}

// The review found a 0777 `[shm] dir` of another user used as it was: its
// owner renamed stowd's channel directory and put their own socket in its
// place.
#[test]
fn a_shm_dir_others_could_rename_in_is_refused_naming_owner_and_mode() {
    let base = std::env::temp_dir().join(format!("stowage-shm-trust-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    std::fs::create_dir(&base).unwrap();
    let dir = base.join("shm");
    std::fs::create_dir(&dir).unwrap();
    let set_mode = |p: &std::path::Path, m: u32| {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
    };
    let refused = |p: &std::path::Path, words: &[&str]| {
        let e = bind_under(p).expect_err("an untrusted [shm] dir was used");
        assert!(e.contains(&p.display().to_string()), "{e}");
        for w in words {
            assert!(e.contains(w), "{w:?} not in {e}");
        }
        // Nothing was made in it.
        assert_eq!(std::fs::read_dir(p).unwrap().count(), 0, "{e}");
    };
    // Writable by others (or the group) without the sticky bit.
    set_mode(&dir, 0o777);
    refused(&dir, &["mode 0777", "without the sticky bit"]);
    set_mode(&dir, 0o775);
    refused(&dir, &["mode 0775", "without the sticky bit"]);
    // Sticky, or writable by stowd's user alone: used.
    for mode in [0o1777, 0o755, 0o700] {
        set_mode(&dir, mode);
        let sock = bind_under(&dir).unwrap_or_else(|e| panic!("mode {mode:o}: {e}"));
        assert!(sock.starts_with(&dir));
    }
    // A link of stowd's user to a good directory: resolved.
    let link = base.join("link");
    std::os::unix::fs::symlink(&dir, &link).unwrap();
    let sock = bind_under(&link).unwrap();
    assert!(sock.starts_with(&dir), "{}", sock.display());
    // ... to a bad one: refused, naming both.
    set_mode(&dir, 0o777);
    refused(&link, &["symbolic link to", "mode 0777"]);
    set_mode(&dir, 0o700);
    // A missing one is made 0700.
    let fresh = base.join("fresh").join("shm");
    bind_under(&fresh).unwrap();
    let mode = std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o700);
    if root() {
        // Another user's, even sticky or 0755: refused.
        for mode in [0o755, 0o1777] {
            set_mode(&dir, mode);
            std::os::unix::fs::chown(&dir, Some(NOBODY), Some(NOBODY)).unwrap();
            refused(&dir, &["owned by uid 65534", &format!("mode {mode:04o}")]);
        }
        std::os::unix::fs::chown(&dir, Some(0), Some(0)).unwrap();
        set_mode(&dir, 0o700);
        // A link another user owns, to a good directory: refused.
        std::os::unix::fs::lchown(&link, Some(NOBODY), Some(NOBODY)).unwrap();
        let e = bind_under(&link).expect_err("another user's link was followed");
        assert!(e.contains("symbolic link owned by uid 65534"), "{e}");
        // Root's sticky directory (as /dev/shm) is used; another user's
        // stale entry in it stays.
        set_mode(&dir, 0o1777);
        let theirs = dir.join("stowd-999999999-theirs");
        std::fs::create_dir(&theirs).unwrap();
        std::os::unix::fs::chown(&theirs, Some(NOBODY), Some(NOBODY)).unwrap();
        bind_under(&dir).unwrap();
        assert!(theirs.exists(), "another user's entry was removed");
    } else {
        eprintln!("not root: the cases of another user's directory and link are not tested");
    }
    let _ = std::fs::remove_dir_all(&base);
}
