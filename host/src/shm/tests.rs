//! Tests of the segment store.

use super::*;

fn store(tag: &str, ttl: Duration) -> SegmentStore {
    let dir = std::env::temp_dir().join(format!("stowage-shm-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    SegmentStore::new(&dir, ttl, 1 << 30).unwrap()
}

#[test]
fn exported_bytes_are_freed_with_the_last_slice_or_the_hold() {
    let s = store("export", Duration::from_secs(5)).with_hold(Duration::from_millis(50));
    let (whole, name) = s.export(&[b"abc", b"defg"]).unwrap();
    assert_eq!(&whole[..], b"abcdefg");
    let file = s.dir().join(&name);
    assert!(file.exists());
    let part = whole.slice(3..);
    drop(whole);
    assert!(file.exists());
    assert_eq!(s.counts(), (1, 0));
    // Named in a reply: held after the last row goes.
    s.hold([part.clone()]);
    drop(part);
    assert!(
        file.exists(),
        "a segment named in a reply went before its hold time"
    );
    std::thread::sleep(Duration::from_millis(80));
    s.sweep();
    assert!(
        !file.exists(),
        "segment not unlinked after the last slice and the hold"
    );
    assert_eq!(s.counts(), (0, 0));
}

#[test]
fn leases_are_adopted_without_copy_or_expire() {
    let s = store("lease", Duration::from_millis(50));
    let (name, _) = s.lease(8, 1).unwrap();
    std::fs::write(s.dir().join(&name), b"12345678").unwrap();
    let bytes = s.adopt(&name, 1).unwrap();
    assert_eq!(&bytes[..], b"12345678");
    assert!(matches!(s.adopt(&name, 1), Err(ShmError::UnknownLease(_))));
    let (stale, _) = s.lease(8, 1).unwrap();
    std::thread::sleep(Duration::from_millis(80));
    assert_eq!(s.sweep(), 1);
    assert!(!s.dir().join(&stale).exists());
    assert!(matches!(s.adopt(&stale, 1), Err(ShmError::UnknownLease(_))));
    assert!(matches!(
        s.adopt("../../etc/passwd", 1),
        Err(ShmError::BadName(_))
    ));
    assert!(matches!(
        s.lease(2 << 30, 1),
        Err(ShmError::TooLarge { .. })
    ));
}

fn inode(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().ino()
}

/// Leases `len` bytes, fills them with `byte`, adopts the segment.
fn put(s: &SegmentStore, len: u64, byte: u8) -> (Bytes, PathBuf) {
    let (name, _) = s.lease(len, 1).unwrap();
    let path = s.dir().join(&name);
    std::fs::write(&path, vec![byte; len as usize]).unwrap();
    (s.adopt(&name, 1).unwrap(), path)
}

#[test]
fn a_cleared_segment_nobody_maps_is_kept_and_leased_again() {
    let s = store("reuse", Duration::from_secs(5)).with_reuse(64 << 20, Duration::from_secs(60));
    let (bytes, path) = put(&s, 4 << 20, 1);
    let ino = inode(&path);
    drop(bytes);
    assert!(!path.exists(), "the old name must go with the rows");
    assert_eq!(s.spares(), (1, 4 << 20, 0));
    // A put naming the spare's file is refused: it is no segment name.
    let spare = std::fs::read_dir(s.dir())
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .file_name();
    let spare = spare.to_string_lossy().to_string();
    assert!(spare.contains("-spare-"), "{spare}");
    assert!(matches!(s.adopt(&spare, 1), Err(ShmError::BadName(_))));
    // A lease of a size within a factor of two gets the same file, resized, under a new name.
    let (name, _) = s.lease(3 << 20, 1).unwrap();
    let again = s.dir().join(&name);
    assert_ne!(again, path);
    assert_eq!(inode(&again), ino, "the spare was not reused");
    assert_eq!(std::fs::metadata(&again).unwrap().len(), 3 << 20);
    assert_eq!(s.spares(), (0, 0, 1));
    // Exports take spares too.
    std::fs::write(&again, vec![2u8; 3 << 20]).unwrap();
    drop(s.adopt(&name, 1).unwrap());
    let (whole, segment) = s.export(&[&vec![9u8; 3 << 20]]).unwrap();
    assert_eq!(inode(&s.dir().join(&segment)), ino);
    assert!(whole.iter().all(|b| *b == 9));
}

#[test]
fn a_segment_a_reader_still_locks_is_unlinked_not_reused() {
    let s = store("locked", Duration::from_secs(5)).with_reuse(64 << 20, Duration::from_secs(60));
    let (bytes, path) = put(&s, 2 << 20, 7);
    // A reader maps it under a shared lock (as the protocol asks).
    let reader = File::open(&path).unwrap();
    reader.lock_shared().unwrap();
    // SAFETY: a test file nobody writes while it is mapped.
    let map = unsafe { MmapOptions::new().map(&reader) }.unwrap();
    drop(bytes);
    assert!(!path.exists());
    assert_eq!(
        s.spares(),
        (0, 0, 0),
        "a segment a reader locks was kept for reuse"
    );
    // New leases get new pages: the reader's bytes never change.
    let (again, _) = put(&s, 2 << 20, 8);
    assert!(map.iter().all(|b| *b == 7));
    assert!(again.iter().all(|b| *b == 8));
}

#[test]
fn spares_are_bounded_small_ones_unlinked_and_idle_ones_removed() {
    let s = store("bounded", Duration::from_secs(5)).with_reuse(5 << 20, Duration::from_millis(50));
    let (a, _) = put(&s, 2 << 20, 1);
    let (b, _) = put(&s, 2 << 20, 2);
    let (c, c_path) = put(&s, 3 << 20, 3);
    let (small, small_path) = put(&s, 4096, 4);
    drop(small);
    assert!(!small_path.exists());
    drop(a);
    drop(b);
    assert_eq!(s.spares().1, 4 << 20);
    let c_ino = inode(&c_path);
    drop(c); // 7 MiB > 5: the oldest spare goes
    assert_eq!(s.spares().1, 5 << 20);
    let files = std::fs::read_dir(s.dir()).unwrap().count();
    assert_eq!(files, 2, "an evicted spare's file was left behind");
    // Far too small or far too large a lease does not take a spare.
    let (name, _) = s.lease(8 << 20, 1).unwrap();
    assert_eq!(s.spares().0, 2);
    assert_ne!(inode(&s.dir().join(&name)), c_ino);
    std::thread::sleep(Duration::from_millis(80));
    s.sweep();
    assert_eq!(s.spares(), (0, 0, 0));
    assert_eq!(
        std::fs::read_dir(s.dir()).unwrap().count(),
        1,
        "idle spares were not removed"
    );
}

#[test]
fn without_reuse_cleared_segments_are_unlinked() {
    let s = store("noreuse", Duration::from_secs(5));
    let (bytes, path) = put(&s, 2 << 20, 1);
    drop(bytes);
    assert!(!path.exists());
    assert_eq!(s.spares(), (0, 0, 0));
    assert_eq!(std::fs::read_dir(s.dir()).unwrap().count(), 0);
}

#[test]
fn segment_files_are_private_and_their_names_unguessable() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let s = store("private", Duration::from_secs(5));
    let (bytes, a) = s.export(&[b"private rows"]).unwrap();
    let (lease, _) = s.lease(64, 1).unwrap();
    for name in [&a, &lease] {
        let meta = std::fs::metadata(s.dir().join(name)).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600, "{name}");
        let random = name
            .strip_prefix(&format!("stowd-{}-", std::process::id()))
            .unwrap_or_else(|| panic!("{name}"));
        assert_eq!(random.len(), 32, "{name}");
        assert!(random.bytes().all(|c| c.is_ascii_hexdigit()), "{name}");
    }
    assert_ne!(a, lease);
    // The old sequential names are not segment names any more.
    let old = format!("stowd-{}-0", std::process::id());
    assert!(matches!(s.adopt(&old, 1), Err(ShmError::BadName(_))));
    // Another user cannot open it (as root, run `cat` as nobody).
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        use std::os::unix::process::CommandExt;
        let path = s.dir().join(&a);
        let nobody_cannot_read = || {
            let out = std::process::Command::new("cat")
                .arg(&path)
                .uid(65534)
                .gid(65534)
                .output()
                .unwrap();
            assert!(!out.status.success() && out.stdout.is_empty(), "{out:?}");
        };
        nobody_cannot_read();
        // Even with the directory open to everyone.
        std::fs::set_permissions(s.dir(), std::fs::Permissions::from_mode(0o755)).unwrap();
        nobody_cannot_read();
        assert_eq!(std::fs::metadata(&path).unwrap().uid(), 0);
    }
    drop(bytes);
}

#[test]
fn names_another_user_created_first_do_not_block_leases_or_exports() {
    let s = store("squat", Duration::from_secs(5));
    // What a squatter could guess before: the next sequential names.
    for n in 0..64 {
        std::fs::write(
            s.dir().join(format!("stowd-{}-{n}", std::process::id())),
            b"",
        )
        .unwrap();
    }
    let (lease, _) = s.lease(4096, 1).unwrap();
    let (bytes, name) = s.export(&[b"rows"]).unwrap();
    assert_eq!(&bytes[..], b"rows");
    assert_ne!(lease, name);
}

#[test]
fn files_an_earlier_process_with_this_pid_left_are_removed_at_start() {
    let dir = std::env::temp_dir().join(format!("stowage-shm-samepid-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = format!("stowd-{}-", std::process::id());
    let old = dir.join(format!("{prefix}{}", "0".repeat(32)));
    let spare = dir.join(format!("{prefix}spare-{}", "1".repeat(32)));
    let ours = dir.join(format!("{prefix}{}", "2".repeat(32)));
    let hour_ago = std::time::SystemTime::now() - Duration::from_secs(3600);
    for path in [&old, &spare] {
        let f = File::create(path).unwrap();
        f.set_modified(hour_ago).unwrap();
    }
    // Made after this process started: another store's of this process.
    File::create(&ours).unwrap();
    let s = SegmentStore::new(&dir, Duration::from_secs(5), 1 << 20).unwrap();
    assert!(!old.exists() && !spare.exists());
    assert!(ours.exists());
    let (name, _) = s.lease(16, 1).unwrap();
    assert!(dir.join(name).exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn leases_together_stay_within_the_quota_until_adopted_or_expired() {
    let s = store("quota", Duration::from_millis(50)).with_lease_quota(100);
    let (a, _) = s.lease(60, 1).unwrap();
    match s.lease(50, 1) {
        Err(ShmError::LeaseQuota {
            asked: 50,
            outstanding: 60,
            limit: 100,
        }) => {}
        other => panic!("{other:?}"),
    }
    let (b, _) = s.lease(40, 1).unwrap();
    // Adopted: no longer outstanding.
    std::fs::write(s.dir().join(&a), [1u8; 60]).unwrap();
    let rows = s.adopt(&a, 1).unwrap();
    assert_eq!(rows.len(), 60);
    let (_, _) = s.lease(60, 1).unwrap();
    assert!(matches!(s.lease(1, 1), Err(ShmError::LeaseQuota { .. })));
    // Expired: no longer outstanding either.
    std::thread::sleep(Duration::from_millis(80));
    let (_, _) = s.lease(100, 1).unwrap();
    assert!(!s.dir().join(&b).exists());
}

#[test]
fn a_lease_is_put_only_by_the_connection_that_asked() {
    let s = store("owner", Duration::from_secs(5));
    let (name, _) = s.lease(8, 7).unwrap();
    std::fs::write(s.dir().join(&name), b"rows of7").unwrap();
    // Another connection naming it: refused, and the lease stays.
    match s.adopt(&name, 8) {
        Err(e @ ShmError::NotYourLease(_)) => {
            assert!(e.to_string().contains("another connection"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    let rows = s.adopt(&name, 7).unwrap();
    assert_eq!(&rows[..], b"rows of7");
}

#[test]
fn a_held_segment_whose_rows_went_is_leased_again_once_the_hold_ends() {
    let s = store("held-reuse", Duration::from_secs(5))
        .with_reuse(64 << 20, Duration::from_secs(60))
        .with_hold(Duration::from_millis(100));
    let (bytes, path) = put(&s, 4 << 20, 1);
    let ino = inode(&path);
    s.hold([bytes.clone()]);
    drop(bytes); // the rows are cleared; the reply's hold keeps the file
    assert!(path.exists(), "a held segment keeps its name");
    let (early, _) = s.lease(4 << 20, 1).unwrap();
    assert_ne!(inode(&s.dir().join(&early)), ino, "reused while held");
    std::thread::sleep(Duration::from_millis(150));
    // No other reply came meanwhile: the lease itself lets the hold go.
    let (name, _) = s.lease(4 << 20, 1).unwrap();
    assert_eq!(
        inode(&s.dir().join(&name)),
        ino,
        "not reused after the hold"
    );
    assert!(!path.exists());
}
