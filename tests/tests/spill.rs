//! Spilling to disk (issue 16): `[units] spill_dir` on the real `stowd`.
//!
//! - twice the units' capacity is put and read back byte-identical over
//!   both protocols, while stowd's anonymous and shared memory stays
//!   within that capacity plus 10% (reuse pools off); the spill files are
//!   unlinked once mapped, the directory is 0700;
//! - the default memory bound (no `capacity_bytes`) spills too;
//! - a full disk (a small tmpfs) and `spill_max_bytes` refuse the put that
//!   needed the space with a `capacity` error saying why; every earlier row
//!   is still served and stowd serves on;
//! - leftover spill files are removed at start; bad settings are refused
//!   at start;
//! - a shared `spill_dir` (1777, as `/tmp`) keeps its mode and other
//!   users' files: stowd works in a private directory it makes inside, and
//!   refuses one of that name that it did not make.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use stowage_host::batch::Field;
use stowage_host::wire::native;
use stowage_tests::data::{assert_cells, cells, f32_rows, wire_cells};
use stowage_tests::{NativeClient, Stowd, TqClient, temp_dir};

const MIB: u64 = 1 << 20;

/// RssAnon + RssShmem of `pid`, bytes.
pub(crate) fn anon_and_shmem(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .filter(|l| l.starts_with("RssAnon:") || l.starts_with("RssShmem:"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum::<u64>()
        * 1024
}

/// Samples [`anon_and_shmem`] every 5 ms until stopped; the peak.
pub(crate) struct Peak {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Peak {
    pub(crate) fn watch(pid: u32) -> Peak {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let (s, p) = (stop.clone(), peak.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                p.fetch_max(anon_and_shmem(pid), Ordering::Relaxed);
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        });
        Peak {
            stop,
            peak,
            thread: Some(thread),
        }
    }

    pub(crate) fn end(mut self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap();
        self.peak.load(Ordering::Relaxed)
    }
}

/// This process's effective uid (stowd's, as the tests start it).
fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() }
}

/// The private directory stowd spills into inside `spill_dir`.
fn private_dir(spill_dir: &Path) -> std::path::PathBuf {
    spill_dir.join(format!("stowd-spill-{}", euid()))
}

fn config(dir: &Path, extra: &str) -> String {
    format!(
        "[units]\nlocal = 2\nspill_dir = {:?}\n{extra}\n[limits]\nreceive_pool_bytes = 0\n",
        dir.display().to_string()
    )
}

/// `n` puts of 16 rows of 128 KiB (2 MiB each) under field "x".
fn put_field(k: u64) -> (Vec<u64>, Field) {
    let indexes: Vec<u64> = (k * 16..k * 16 + 16).collect();
    (indexes, Field::Regular(f32_rows(16, 32 * 1024, 1000 + k)))
}

async fn check(c: &NativeClient, indexes: &[u64], field: &Field, what: &str) {
    let got = c.get_ok(indexes, &["x"]).await;
    assert_cells(what, &wire_cells(got[0].1.clone()), &cells(field));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twice_the_capacity_reads_back_within_the_memory_bound() {
    let dir = temp_dir("spill").join("spill");
    // 2 units x 64 MiB: 128 MiB in memory at most; 256 MiB put.
    let stowd = Stowd::start(&config(&dir, &format!("capacity_bytes = {}", 64 * MIB)));
    let c = NativeClient::new(stowd.native());
    let before = anon_and_shmem(stowd.pid());
    let peak = Peak::watch(stowd.pid());
    let puts = 128;
    for k in 0..puts {
        let (indexes, field) = put_field(k);
        c.put_ok(&indexes, &[("x".into(), field)]).await;
    }
    let stats = c.stats().await;
    let stat = |k: &str| stowage_tests::client::stat(&stats, k) as u64;
    assert_eq!(stat("spill_bound_bytes"), 128 * MIB);
    assert!(stat("spill_memory_bytes") <= 128 * MIB, "{stats:?}");
    assert!(stat("spill_disk_bytes") >= 128 * MIB, "{stats:?}");
    assert_eq!(
        stat("spill_memory_bytes") + stat("spill_disk_bytes"),
        256 * MIB
    );
    // Every row, byte for byte: stowage/1 for all, TransferQueue for some.
    let router = TqClient::new(stowd.router());
    for k in 0..puts {
        let (indexes, field) = put_field(k);
        check(&c, &indexes, &field, &format!("put {k}")).await;
        if k % 17 == 0 {
            let got = router.get_ok(&indexes, &["x"]).await;
            assert_cells(
                &format!("put {k} (TransferQueue)"),
                &got[0].1,
                &cells(&field),
            );
        }
    }
    let peak = peak.end();
    eprintln!(
        "RssAnon + RssShmem: {} MiB at start, peak {} MiB",
        before / MIB,
        peak / MIB
    );
    assert!(
        peak <= before + 128 * MIB + 128 * MIB / 10,
        "RssAnon + RssShmem peaked at {} MiB (started at {} MiB), bound 128 MiB + 10%",
        peak / MIB,
        before / MIB
    );
    // Spill files are unlinked once mapped: nothing in the directory.
    use std::os::unix::fs::PermissionsExt;
    let private = private_dir(&dir);
    assert_eq!(
        std::fs::metadata(&private).unwrap().permissions().mode() & 0o777,
        0o700
    );
    assert_eq!(std::fs::read_dir(&private).unwrap().count(), 0);
    // Clearing frees both.
    let all: Vec<u64> = (0..puts * 16).collect();
    c.clear(&all, None).await;
    let stats = c.stats().await;
    assert_eq!(stowage_tests::client::stat(&stats, "spill_disk_bytes"), 0);
    assert_eq!(stowage_tests::client::stat(&stats, "spill_memory_bytes"), 0);
    stowd.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_bound_spills_and_reads_back() {
    let dir = temp_dir("spill-default").join("spill");
    // No capacity_bytes: 50% of 16 MiB over 2 units, spilled past it.
    let stowd = Stowd::start(&config(&dir, &format!("memory_bytes = {}", 16 * MIB)));
    let c = NativeClient::new(stowd.native());
    for k in 0..12 {
        let (indexes, field) = put_field(k);
        c.put_ok(&indexes, &[("x".into(), field)]).await;
    }
    assert!(c.stat("spill_memory_bytes").await as u64 <= 8 * MIB);
    assert!(c.stat("spill_disk_bytes").await as u64 >= 16 * MIB);
    for k in 0..12 {
        let (indexes, field) = put_field(k);
        check(&c, &indexes, &field, &format!("put {k}")).await;
    }
    stowd.stop();
}

/// Puts until one is refused; checks the refusal and that every earlier
/// row is served; returns how many were stored.
async fn fill_until_refused(c: &NativeClient, words: &[&str]) -> u64 {
    let mut k = 0;
    loop {
        let (indexes, field) = put_field(k);
        match c.put(&indexes, &[("x".into(), field)]).await {
            native::Reply::PutOk { .. } => k += 1,
            native::Reply::Error { code, message } => {
                assert_eq!(code, native::code::CAPACITY, "{message}");
                for w in words {
                    assert!(message.contains(w), "{w:?} not in {message}");
                }
                break;
            }
            other => panic!("{other:?}"),
        }
        assert!(k < 200, "nothing was refused");
    }
    assert!(k >= 4, "refused too early: after {k} puts");
    for j in 0..k {
        let (indexes, field) = put_field(j);
        check(c, &indexes, &field, &format!("put {j} after the refusal")).await;
    }
    k
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_the_put_and_keeps_every_row() {
    let mount = temp_dir("spill-tmpfs");
    let status = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=12m,mode=0700", "tmpfs"])
        .arg(&mount)
        .status()
        .expect("run mount (the test needs root, as .ci/run has)");
    assert!(status.success(), "mounting a tmpfs needs root");
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(mount.clone());
    // 2 x 4 MiB in memory, 12 MiB of disk: about 10 puts of 2 MiB fit.
    let stowd = Stowd::start(&config(&mount, &format!("capacity_bytes = {}", 4 * MIB)));
    let c = NativeClient::new(stowd.native());
    let stored = fill_until_refused(&c, &["No space left on device", "spilling to"]).await;
    assert!(c.stat("spill_failures_total").await > 0);
    // Room again after a clear.
    let first: Vec<u64> = (0..32).collect();
    c.clear(&first, None).await;
    let (indexes, field) = put_field(stored);
    c.put_ok(&indexes, &[("x".into(), field.clone())]).await;
    check(&c, &indexes, &field, "after the clear").await;
    stowd.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spill_max_bytes_refuses_the_put_clearly() {
    let dir = temp_dir("spill-max").join("spill");
    let extra = format!(
        "capacity_bytes = {}\nspill_max_bytes = {}",
        4 * MIB,
        6 * MIB
    );
    let stowd = Stowd::start(&config(&dir, &extra));
    let c = NativeClient::new(stowd.native());
    fill_until_refused(&c, &["spill_max_bytes"]).await;
    assert!(c.stat("spill_disk_bytes").await as u64 <= 6 * MIB);
    stowd.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leftovers_go_at_start_and_bad_settings_are_refused() {
    let base = temp_dir("spill-start");
    let dir = base.join("spill");
    let private = private_dir(&dir);
    std::fs::create_dir_all(&private).unwrap();
    std::fs::write(private.join("123-4.spill"), b"left by a killed stowd").unwrap();
    std::fs::write(private.join("notes.txt"), b"not ours").unwrap();
    let stowd = Stowd::start(&config(&dir, &format!("capacity_bytes = {}", 4 * MIB)));
    assert!(!private.join("123-4.spill").exists());
    assert!(private.join("notes.txt").exists());
    stowd.stop();
    std::os::unix::fs::symlink(&dir, base.join("link")).unwrap();
    for (cfg, words) in [
        (
            "[units]\nspill_dir = \"relative\"\ncapacity_bytes = 1048576\n".to_string(),
            "absolute path",
        ),
        (
            config(
                &dir,
                "capacity_bytes = 1048576\nspill_threshold_bytes = 2097152",
            ),
            "above the unit capacity",
        ),
        (config(&dir, "memory_percent = 0"), "needs a memory bound"),
        (
            config(&base.join("link"), "capacity_bytes = 1048576"),
            "symbolic link",
        ),
    ] {
        let refused = Stowd::try_start(&cfg).expect_err("started with a bad spill setting");
        assert!(refused.contains(words), "{words:?} not in {refused}");
    }
}

/// Running as root (CI): what "another user" is tested with.
fn root() -> bool {
    euid() == 0
}

const NOBODY: u32 = 65534;

// The review found a shared `spill_dir` made 0700 at start (every other
// user locked out of it) and another user's `*.spill` file in it removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_spill_dir_keeps_its_mode_and_other_users_files() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().mode() & 0o7777;
    let dir = temp_dir("spill-shared").join("scratch");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let theirs = dir.join("123-4.spill");
    std::fs::write(&theirs, b"another user's").unwrap();
    if root() {
        std::os::unix::fs::chown(&theirs, Some(NOBODY), Some(NOBODY)).unwrap();
    }
    let stowd = Stowd::start(&config(&dir, &format!("capacity_bytes = {}", 4 * MIB)));
    let c = NativeClient::new(stowd.native());
    for k in 0..8 {
        let (indexes, field) = put_field(k);
        c.put_ok(&indexes, &[("x".into(), field)]).await;
    }
    assert!(c.stat("spill_disk_bytes").await as u64 >= 4 * MIB);
    for k in 0..8 {
        let (indexes, field) = put_field(k);
        check(&c, &indexes, &field, &format!("put {k}")).await;
    }
    stowd.stop();
    assert_eq!(
        mode(&dir),
        0o1777,
        "stowd changed the shared directory's mode"
    );
    assert_eq!(std::fs::read(&theirs).unwrap(), b"another user's");
    let private = private_dir(&dir);
    assert_eq!(mode(&private), 0o700);
    assert_eq!(std::fs::metadata(&private).unwrap().uid(), euid());
    assert_eq!(std::fs::read_dir(&private).unwrap().count(), 0);
    // A directory of that name stowd did not make is refused, named, and
    // left as it is: writable by others, a link, another user's.
    std::fs::remove_dir(&private).unwrap();
    std::fs::create_dir(&private).unwrap();
    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o777)).unwrap();
    let refuse = |words: &str| {
        let refused = Stowd::try_start(&config(&dir, &format!("capacity_bytes = {}", 4 * MIB)))
            .expect_err("started with a spill directory stowd did not make");
        let first = refused.lines().next().unwrap_or_default().to_string();
        assert!(refused.contains(&private.display().to_string()), "{first}");
        assert!(refused.contains(words), "{words:?} not in {refused}");
    };
    refuse("writable by group or others (mode 0777)");
    assert_eq!(mode(&private), 0o777);
    std::fs::remove_dir(&private).unwrap();
    std::os::unix::fs::symlink(temp_dir("spill-elsewhere"), &private).unwrap();
    refuse("symbolic link");
    std::fs::remove_file(&private).unwrap();
    if root() {
        std::fs::create_dir(&private).unwrap();
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&private, Some(NOBODY), Some(NOBODY)).unwrap();
        refuse("belongs to uid 65534");
    } else {
        eprintln!("not root: the case of another user's directory is not tested");
    }
}
