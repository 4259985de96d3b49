//! Checkpoint paths and files that no client can turn against stowd: the
//! real binary, real sockets, files and directories made the way a
//! careless operator or a hostile local client would make them.
//!
//! - a SAVE, LOAD, `checkpoint` or `restore` path outside `[checkpoint]
//!   roots`, with `..`, through a symbolic link, into stowd's own state or
//!   into a checkpoint directory (its journal, manifest, unit files) is
//!   refused, naming why; nothing is written;
//! - a directory of other files keeps them: a foreign `manifest.json` is
//!   refused, never overwritten, and only names stowd makes count;
//! - a directory another user owns or can write is refused;
//! - a LOAD is checked against the units' room from the file's header,
//!   before any row is read: a file claiming 1 GiB moves no memory;
//! - FIFOs are refused at once, never waited on;
//! - a refused LOAD or a full disk leaves every unit as it was.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::restore::{checkpoint, err, restore};
use sha2::{Digest, Sha256};
use stowage_host::batch::Field;
use stowage_host::wire::native::{self, Op};
use stowage_host::wire::tq;
use stowage_tests::data::{assert_cells, cells, f32_rows, wire_cells};
use stowage_tests::process::stowd_bin;
use stowage_tests::{NativeClient, Stowd, TqClient, plugin_dir, temp_dir};

const MIB: u64 = 1 << 20;

fn seq(reply: &native::Reply) -> u64 {
    match reply {
        native::Reply::CheckpointOk { seq, .. } => *seq,
        other => panic!("checkpoint failed: {other:?}"),
    }
}

async fn save(c: &TqClient, path: &Path) -> Option<String> {
    match c
        .request(&tq::Request::SaveCheckpoint {
            path: path.display().to_string(),
        })
        .await
    {
        tq::Reply::Checkpoint { load: false, error } => error,
        other => panic!("not a save reply: {other:?}"),
    }
}

async fn load(c: &TqClient, path: &Path) -> Option<String> {
    match c
        .request(&tq::Request::LoadCheckpoint {
            path: path.display().to_string(),
        })
        .await
    {
        tq::Reply::Checkpoint { load: true, error } => error,
        other => panic!("not a load reply: {other:?}"),
    }
}

fn contains(e: &Option<String>, words: &[&str]) {
    let e = e.as_deref().expect("refused");
    for w in words {
        assert!(e.contains(w), "{w:?} not in {e}");
    }
}

/// A directory of this user, mode 0700.
fn private_dir(tag: &str) -> PathBuf {
    let d = temp_dir(tag);
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o700)).unwrap();
    d
}

fn roots(dirs: &[&Path]) -> String {
    let list: Vec<String> = dirs
        .iter()
        .map(|d| serde_json::to_string(&d.display().to_string()).unwrap())
        .collect();
    format!("[checkpoint]\nroots = [{}]\n", list.join(", "))
}

/// The x rows of index `g` read back equal `want` (over stowage/1).
async fn check_x(c: &NativeClient, g: &[u64], want: &Field, what: &str) {
    let got = c.get_ok(g, &["x"]).await;
    assert_cells(what, &wire_cells(got[0].1.clone()), &cells(want));
}

/// The peak resident memory of process `pid`, bytes (`VmHWM`).
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("VmHWM");
    kib * 1024
}

/// A unit file in stowd's format (8-byte header length, the JSON header
/// with `stowage` metadata, the data): `entries` are `[field, kind,
/// dtype, shape, indexes]`, `tensors` each tensor's safetensors dtype,
/// shape and byte length; `data` the bytes (None: none written, for a
/// file made sparse to its size afterwards). Returns the header bytes and
/// the file's full size.
fn unit_file(
    entries: serde_json::Value,
    tensors: &[(&str, Vec<u64>, u64)],
    data: Option<&[u8]>,
) -> (Vec<u8>, u64) {
    let sha = hex(&Sha256::digest(data.unwrap_or_default()));
    let stowage = serde_json::json!({
        "format": "stowage-unit-checkpoint/2",
        "unit": "crafted",
        "entries": entries,
        "sha256": sha,
    });
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        serde_json::json!({"stowage": stowage.to_string()}),
    );
    let mut offset = 0u64;
    for (i, (dtype, shape, len)) in tensors.iter().enumerate() {
        header.insert(
            i.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len]}),
        );
        offset += len;
    }
    let mut json = serde_json::to_vec(&header).unwrap();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    let size = out.len() as u64 + offset;
    if let Some(d) = data {
        out.extend_from_slice(d);
    }
    (out, size)
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Paths outside the roots, with `..`, through a link, into stowd's own
/// state or a checkpoint directory: refused, nothing written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paths_outside_the_roots_or_into_stowd_state_are_refused() {
    let root = private_dir("confine-root");
    let outside = private_dir("confine-outside");
    let stowd = Stowd::start(&roots(&[&root]));
    let unit = TqClient::new(stowd.unit(0));
    let c = NativeClient::new(stowd.native());
    // A row holding a line an attacker would like in authorized_keys.
    let key = "\nssh-ed25519 AAAAC3Nza attacker\n";
    let x = Field::Regular(f32_rows(1, 4, 1));
    unit.put_ok(
        &[0],
        vec![
            ("x".into(), x.clone()),
            ("k".into(), stowage_tests::data::strings(key, 1)),
        ],
    )
    .await;
    let keys = outside.join("authorized_keys");
    std::fs::write(&keys, b"ssh-ed25519 AAAA owner\n").unwrap();
    let root_s = root.display().to_string();
    contains(
        &save(&unit, &keys).await,
        &["outside the checkpoint roots", &root_s],
    );
    contains(&load(&unit, &keys).await, &["outside the checkpoint roots"]);
    let (code, message) = err(checkpoint(&c, &outside.join("ckpt")).await);
    assert_eq!(code, native::code::BAD_REQUEST);
    assert!(message.contains(&root_s), "{message}");
    assert!(!outside.join("ckpt").exists());
    let (_, message) = err(restore(&c, &outside).await);
    assert!(
        message.contains("outside the checkpoint roots"),
        "{message}"
    );
    assert_eq!(
        std::fs::read(&keys).unwrap(),
        b"ssh-ed25519 AAAA owner\n",
        "a file outside the roots was changed"
    );
    // A NUL byte, a component longer than a file name can be.
    let nul = format!("{}/a\0b", root.display());
    let (code, message) = err(c
        .call(Op::Checkpoint {
            dir: nul,
            journal: true,
        })
        .await);
    assert_eq!(code, native::code::BAD_REQUEST, "{message}");
    assert!(message.contains("NUL"), "{message}");
    contains(
        &save(&unit, &root.join("x".repeat(300))).await,
        &["too long"],
    );
    // `..` out of the root.
    let dotdot = root.join("..").join(outside.file_name().unwrap()).join("k");
    contains(&save(&unit, &dotdot).await, &["`..`"]);
    assert!(!outside.join("k").exists());
    // A symbolic link inside the root to a directory outside it.
    std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
    contains(
        &save(&unit, &root.join("link").join("x.safetensors")).await,
        &["symbolic link"],
    );
    let (_, message) = err(checkpoint(&c, &root.join("link").join("ckpt")).await);
    assert!(message.contains("symbolic link"), "{message}");
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 1);
    // A stowd checkpoint directory: its journal, its manifest, a unit
    // file, and any other name in it.
    let ckpt = root.join("ckpt");
    assert_eq!(seq(&checkpoint(&c, &ckpt).await), 1);
    let journal = std::fs::read(ckpt.join("journal-1")).unwrap();
    for name in [
        "journal-1",
        "manifest.json",
        "unit-1-0.safetensors",
        "mine.safetensors",
    ] {
        contains(
            &save(&unit, &ckpt.join(name)).await,
            &["part of stowd's own checkpoints"],
        );
    }
    contains(
        &load(&unit, &ckpt.join("unit-1-0.safetensors")).await,
        &["part of stowd's own checkpoints"],
    );
    assert_eq!(std::fs::read(ckpt.join("journal-1")).unwrap(), journal);
    assert!(!ckpt.join("mine.safetensors").exists());
    // Inside the root, elsewhere: saved and loaded.
    let good = root.join("su_0.safetensors");
    assert_eq!(save(&unit, &good).await, None);
    assert_eq!(load(&unit, &good).await, None);
    check_x(&c, &[0], &x, "after a load inside the root").await;
    stowd.stop();

    // roots = ["/"]: TransferQueue's any path, with a WARN; stowd's own
    // state (the plugin directory) still refused.
    let any = Stowd::start(&roots(&[Path::new("/")]));
    assert!(
        any.log().contains("any client may make stowd write"),
        "{}",
        any.log()
    );
    let unit = TqClient::new(any.unit(0));
    unit.put_ok(&[1], vec![("x".into(), x.clone())]).await;
    contains(
        &save(&unit, &plugin_dir().join("x.safetensors")).await,
        &["stowd's own state"],
    );
    assert_eq!(save(&unit, &outside.join("any.safetensors")).await, None);
    any.stop();
}

/// The default root is `checkpoints` in stowd's state directory, and a
/// root that is not absolute is refused at start.
#[test]
fn the_default_root_is_in_the_state_directory() {
    let state = private_dir("confine-state");
    let empty = state.join("empty.toml");
    std::fs::write(&empty, "").unwrap();
    let config = |envs: &[(&str, &Path)]| {
        let mut cmd = Command::new(stowd_bin());
        cmd.args(["config", "--config"]).arg(&empty);
        cmd.env_remove("STATE_DIRECTORY")
            .env_remove("XDG_STATE_HOME")
            .env("STOWD_PLUGIN_DIR", plugin_dir());
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let text = config(&[("STATE_DIRECTORY", &state)]);
    let want = state.join("checkpoints").display().to_string();
    assert!(text.contains(&want), "{text}");
    let text = config(&[("HOME", &state)]);
    let want = state.join(".local/state/stowd/checkpoints");
    assert!(text.contains(&want.display().to_string()), "{text}");
    std::fs::write(&empty, "[checkpoint]\nroots = [\"rel\"]\n").unwrap();
    let out = Command::new(stowd_bin())
        .args(["config", "--config"])
        .arg(&empty)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("rel is not an absolute path"), "{e}");
}

/// A directory holding files of its own: a foreign manifest is refused,
/// never overwritten; names stowd does not make are never counted nor
/// removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_of_other_files_keeps_them() {
    let root = private_dir("confine-mixed");
    let stowd = Stowd::start(&roots(&[&root]));
    let c = NativeClient::new(stowd.native());
    c.put_ok(&[5], &[("x".into(), Field::Regular(f32_rows(1, 4, 2)))])
        .await;
    let dir = root.join("mixed");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    let others = [
        ("manifest.json", "{\"model\": \"theirs\"}"),
        ("unit-7-notes.txt", "notes"),
        ("journal-2024-12.md", "diary"),
    ];
    for (name, text) in others {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let (code, message) = err(checkpoint(&c, &dir).await);
    assert_eq!(code, native::code::BAD_REQUEST);
    assert!(
        message.contains("manifest.json") && message.contains("does not replace it"),
        "{message}"
    );
    for (name, text) in others {
        assert_eq!(std::fs::read_to_string(dir.join(name)).unwrap(), text);
    }
    std::fs::remove_file(dir.join("manifest.json")).unwrap();
    assert_eq!(seq(&checkpoint(&c, &dir).await), 1, "not the year 2025");
    assert_eq!(seq(&checkpoint(&c, &dir).await), 2);
    for (name, text) in &others[1..] {
        assert_eq!(&std::fs::read_to_string(dir.join(name)).unwrap(), text);
    }
    assert!(!dir.join("unit-1-0.safetensors").exists());
    assert!(dir.join("unit-2-0.safetensors").exists());
    stowd.stop();
}

/// Directories another user owns or can write, and files another user
/// owns, are refused; a link planted as the manifest's temporary name
/// changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn directories_and_files_of_others_are_refused() {
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test makes files of another user: it needs root, as .ci/run has"
    );
    let root = private_dir("confine-others");
    let stowd = Stowd::start(&roots(&[&root]));
    let c = NativeClient::new(stowd.native());
    let unit = TqClient::new(stowd.unit(0));
    unit.put_ok(&[2], vec![("x".into(), Field::Regular(f32_rows(1, 4, 3)))])
        .await;
    // Mode 0777, with a link planted where the manifest is written.
    let open = root.join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let precious = root.join("precious");
    std::fs::write(&precious, b"root only").unwrap();
    for n in 0..4 {
        let planted = open.join(format!(".manifest.{}.{n}.tmp", stowd.pid()));
        std::os::unix::fs::symlink(&precious, planted).unwrap();
    }
    let (code, message) = err(checkpoint(&c, &open).await);
    assert_eq!(code, native::code::BAD_REQUEST);
    assert!(
        message.contains("writable by group or others (mode 0777)"),
        "{message}"
    );
    contains(
        &save(&unit, &open.join("x.safetensors")).await,
        &["writable by group or others"],
    );
    assert_eq!(std::fs::read(&precious).unwrap(), b"root only");
    // Owned by another user (nobody), mode 0700.
    let theirs = root.join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    std::fs::set_permissions(&theirs, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&theirs, Some(65534), Some(65534)).unwrap();
    let (_, message) = err(checkpoint(&c, &theirs).await);
    assert!(message.contains("belongs to uid 65534"), "{message}");
    // A file of another user in a good directory: not loaded.
    let good = root.join("su.safetensors");
    assert_eq!(save(&unit, &good).await, None);
    std::os::unix::fs::chown(&good, Some(65534), Some(65534)).unwrap();
    contains(&load(&unit, &good).await, &["belongs to uid 65534"]);
    stowd.stop();
}

/// A LOAD is measured against every unit's room from the header, before a
/// row is read: a file claiming 1 GiB of rows into 16 MiB units moves no
/// memory; a large file that is not a checkpoint neither; an entry with
/// no rows (it once made the load panic) and an entry whose bytes do not
/// fit its shape are refused; the unit keeps its rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_is_checked_from_the_header_before_any_row_is_read() {
    let root = private_dir("confine-load");
    let config = format!(
        "[units]\nlocal = 2\ncapacity_bytes = {}\n\n{}",
        16 * MIB,
        roots(&[&root])
    );
    let stowd = Stowd::start(&config);
    let unit = TqClient::new(stowd.unit(0));
    let c = NativeClient::new(stowd.native());
    let x = Field::Regular(f32_rows(2, 4, 4));
    c.put_ok(&[0, 2], &[("x".into(), x.clone())]).await;
    let before = peak_rss(stowd.pid());
    // 1 GiB of f32 rows: [1024, 262144], in a sparse file.
    let rows = 1024u64;
    let indexes: Vec<u64> = (0..rows).map(|g| g * 2).collect();
    let (head, size) = unit_file(
        serde_json::json!([["x", "rows", "float32", [rows, 262144], indexes]]),
        &[("F32", vec![rows, 262144], rows * 262144 * 4)],
        None,
    );
    let big = root.join("big.safetensors");
    std::fs::write(&big, &head).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&big)
        .unwrap()
        .set_len(size)
        .unwrap();
    let began = Instant::now();
    contains(&load(&unit, &big).await, &["is full", "1073741824"]);
    let took = began.elapsed();
    // A sparse GiB of zeros that is no checkpoint at all.
    let zeros = root.join("weights.bin");
    std::fs::File::create(&zeros)
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    contains(&load(&unit, &zeros).await, &["not a safetensors file"]);
    let grew = peak_rss(stowd.pid()).saturating_sub(before);
    assert!(
        grew < 200 * MIB,
        "the refused loads grew stowd's peak memory by {grew} bytes"
    );
    assert!(took < Duration::from_secs(20), "{took:?}");
    // An entry of shape [0, 4] and no indexes, with a correct checksum.
    let (file, _) = unit_file(
        serde_json::json!([["x", "rows", "float32", [0, 4], []]]),
        &[("F32", vec![0, 4], 0)],
        Some(&[]),
    );
    let empty = root.join("empty-entry.safetensors");
    std::fs::write(&empty, file).unwrap();
    contains(
        &load(&unit, &empty).await,
        &["entry 0", "shape [0, 4] for 0 indexes"],
    );
    // Bytes that do not fit the entry's dtype and shape.
    let data = [7u8; 12];
    let (file, _) = unit_file(
        serde_json::json!([["x", "rows", "complex128", [1, 1], [0]]]),
        &[("U8", vec![12], 12)],
        Some(&data),
    );
    let short = root.join("short.safetensors");
    std::fs::write(&short, file).unwrap();
    contains(&load(&unit, &short).await, &["entry 0", "12 bytes"]);
    check_x(&c, &[0, 2], &x, "after the refused loads").await;
    stowd.stop();
}

/// A FIFO where a file is expected is refused at once: as a LOAD file,
/// and as a checkpoint's manifest (which then does not hold up the next
/// checkpoint or restore).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifos_are_refused_at_once() {
    let root = private_dir("confine-fifo");
    let stowd = Stowd::start(&roots(&[&root]));
    let unit = TqClient::new(stowd.unit(0));
    let c = NativeClient::new(stowd.native());
    let mkfifo = |p: &Path| {
        let path = std::ffi::CString::new(p.display().to_string()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    };
    let fifo = root.join("fifo.safetensors");
    mkfifo(&fifo);
    let began = Instant::now();
    contains(&load(&unit, &fifo).await, &["not a regular file"]);
    let dir = root.join("ckpt");
    std::fs::create_dir(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
    mkfifo(&dir.join("manifest.json"));
    let (_, message) = err(checkpoint(&c, &dir).await);
    assert!(message.contains("not a regular file"), "{message}");
    let (_, message) = err(restore(&c, &dir).await);
    assert!(message.contains("not a regular file"), "{message}");
    assert!(began.elapsed() < Duration::from_secs(10));
    // The next checkpoint and restore are served.
    let other = root.join("other");
    assert_eq!(seq(&checkpoint(&c, &other).await), 1);
    assert!(matches!(
        restore(&c, &other).await,
        native::Reply::RestoreOk { .. }
    ));
    stowd.stop();
}

/// A valid file too large for a spilling unit's memory and disk: refused,
/// and every row the unit held is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_load_into_a_spilling_unit_keeps_its_rows() {
    let root = private_dir("confine-spill");
    // A 8 MiB file from a stowd without bounds.
    let source = Stowd::start(&format!(
        "[units]\nlocal = 1\nmemory_percent = 0\n\n{}",
        roots(&[&root])
    ));
    let big = Field::Regular(f32_rows(32, 65536, 5));
    let big_indexes: Vec<u64> = (1000..1032).collect();
    let unit = TqClient::new(source.unit(0));
    unit.put_ok(&big_indexes, vec![("x".into(), big)]).await;
    let file = root.join("big.safetensors");
    assert_eq!(save(&unit, &file).await, None);
    source.stop();
    // A unit of 1 MiB spilling to at most 2 MiB, holding 16 rows.
    let spill = root.join("spill");
    let stowd = Stowd::start(&format!(
        "[units]\nlocal = 1\ncapacity_bytes = {}\nspill_dir = {:?}\nspill_max_bytes = {}\n\n{}",
        MIB,
        spill.display().to_string(),
        2 * MIB,
        roots(&[&root])
    ));
    let unit = TqClient::new(stowd.unit(0));
    let c = NativeClient::new(stowd.native());
    let rows = Field::Regular(f32_rows(16, 1024, 6));
    let indexes: Vec<u64> = (0..16).collect();
    c.put_ok(&indexes, &[("x".into(), rows.clone())]).await;
    contains(&load(&unit, &file).await, &["spill", "8388608"]);
    check_x(&c, &indexes, &rows, "after the refused load").await;
    stowd.stop();
}

/// With the journal's directory on a full disk, a put over two units and
/// a clear are refused and applied nowhere; a checkpoint there fails as
/// `internal`, not as the request's fault.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_applies_a_put_nowhere() {
    let root = private_dir("confine-full");
    let mount = root.join("tmpfs");
    std::fs::create_dir(&mount).unwrap();
    let status = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs"])
        .arg(&mount)
        .status()
        .expect("run mount (the test needs root, as .ci/run has)");
    assert!(status.success(), "mounting a tmpfs needs root");
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(mount.clone());
    let stowd = Stowd::start(&format!("[units]\nlocal = 2\n\n{}", roots(&[&root])));
    let c = NativeClient::new(stowd.native());
    let indexes: Vec<u64> = (0..200).collect();
    let old = Field::Regular(f32_rows(200, 4, 7));
    c.put_ok(&indexes, &[("x".into(), old.clone())]).await;
    let ckpt = mount.join("ckpt");
    assert_eq!(seq(&checkpoint(&c, &ckpt).await), 1);
    // Fill the disk.
    let filler = mount.join("filler");
    let mut f = std::fs::File::create(&filler).unwrap();
    let chunk = vec![1u8; 64 << 10];
    while std::io::Write::write_all(&mut f, &chunk).is_ok() {}
    drop(f);
    let new = Field::Regular(f32_rows(200, 4, 8));
    let (code, message) = err(c.put(&indexes, &[("x".into(), new)]).await);
    assert!(message.contains("was not made"), "{code}: {message}");
    check_x(&c, &indexes, &old, "after a put the journal refused").await;
    match c
        .call(Op::Clear {
            global_indexes: indexes.clone(),
            fields: None,
        })
        .await
    {
        native::Reply::Error { message, .. } => {
            assert!(message.contains("was not made"), "{message}")
        }
        other => panic!("the clear should be refused: {other:?}"),
    }
    check_x(&c, &indexes, &old, "after a clear the journal refused").await;
    let (code, message) = err(c
        .call(Op::Checkpoint {
            dir: mount.join("snap").display().to_string(),
            journal: false,
        })
        .await);
    assert_eq!(code, native::code::INTERNAL, "{message}");
    // Room again: the put goes through, and the checkpoint restores.
    std::fs::remove_file(&filler).unwrap();
    let newer = Field::Regular(f32_rows(200, 4, 9));
    c.put_ok(&indexes, &[("x".into(), newer)]).await;
    match restore(&c, &ckpt).await {
        native::Reply::RestoreOk { lost, .. } => assert_eq!(lost, 200),
        other => panic!("restore failed: {other:?}"),
    }
    stowd.stop();
}
