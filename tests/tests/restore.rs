//! stowd's own checkpoints (issue 16): the `stowage/1` `checkpoint` and
//! `restore` ops, `stowd checkpoint`, and `stowd serve --restore DIR`, on
//! the real binary and real sockets.
//!
//! - checkpoint, SIGKILL, `serve --restore`: every checkpointed row reads
//!   back byte-identical over `stowage/1` and TransferQueue; an index put
//!   or cleared after the checkpoint is `data_lost` (never its old value)
//!   until it is put again;
//! - SIGKILL in the middle of a checkpoint: the previous one restores, and
//!   what was put after it is lost, not stale;
//! - one flipped byte in a file (data or header) is refused at restore,
//!   naming the file, at start and on a running stowd (which keeps its
//!   rows);
//! - bad directories and manifests are refused clearly; a stowd routing to
//!   a remote unit refuses both ops.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use stowage_host::batch::{Cell, Field};
use stowage_host::wire::native::{self, Op};
use stowage_host::wire::tq;
use stowage_tests::client::{native_error, tq_error};
use stowage_tests::data::{assert_cells, cells, every_kind as batch, f32_rows, wire_cells};
use stowage_tests::process::stowd_bin;
use stowage_tests::{NativeClient, Stowd, TqClient, temp_dir};

/// The (code, message) of an error reply.
pub(crate) fn err(reply: native::Reply) -> (String, String) {
    let (code, message) = native_error(&reply);
    (code.to_string(), message.to_string())
}

const TWO_UNITS: &str = "[units]\nlocal = 2\n";

pub(crate) async fn checkpoint(c: &NativeClient, dir: &Path) -> native::Reply {
    c.call(Op::Checkpoint {
        dir: dir.display().to_string(),
        journal: true,
    })
    .await
}

pub(crate) async fn restore(c: &NativeClient, dir: &Path) -> native::Reply {
    c.call(Op::Restore {
        dir: dir.display().to_string(),
    })
    .await
}

fn checkpoint_seq(reply: &native::Reply) -> u64 {
    match reply {
        native::Reply::CheckpointOk { seq, .. } => *seq,
        other => panic!("checkpoint failed: {other:?}"),
    }
}

/// The rows of `indexes` (positions `keep` of the batch), over both
/// protocols, against what was put.
async fn check_rows(stowd: &Stowd, keep: &[usize], what: &str) {
    let (indexes, fields) = batch();
    let gs: Vec<u64> = keep.iter().map(|&i| indexes[i]).collect();
    let names: Vec<&str> = fields.iter().map(|(n, _)| n.as_str()).collect();
    let native = NativeClient::new(stowd.native());
    let got = native.get_ok(&gs, &names).await;
    let router = TqClient::new(stowd.router());
    let got_tq = router.get_ok(&gs, &names).await;
    for (((name, field), (n1, wire)), (n2, tq_cells)) in fields.iter().zip(got).zip(got_tq) {
        assert_eq!((name, name), (&n1, &n2));
        let all = cells(field);
        let want: Vec<Cell> = keep.iter().map(|&i| all[i].clone()).collect();
        assert_cells(
            &format!("{what}: {name} (stowage/1)"),
            &wire_cells(wire),
            &want,
        );
        assert_cells(&format!("{what}: {name} (TransferQueue)"), &tq_cells, &want);
    }
}

/// A get of `g` is refused as lost over both protocols, naming the
/// checkpoint.
async fn assert_lost(stowd: &Stowd, g: u64, checkpoint: &str) {
    let native = NativeClient::new(stowd.native());
    let (code, message) = err(native.get(&[g], &["x"]).await);
    assert_eq!(code, native::code::DATA_LOST, "{message}");
    assert!(message.contains(checkpoint), "{message}");
    let tq_reply = TqClient::new(stowd.router()).get(&[g], &["x"]).await;
    let message = tq_error(&tq_reply, tq::ErrorReply::Get);
    assert!(message.contains("[DataLost]"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoint_kill_restore_serves_every_row_and_nothing_stale() {
    let mut stowd = Stowd::start(TWO_UNITS);
    let c = NativeClient::new(stowd.native());
    let dir = temp_dir("restore").join("ckpt");
    let (indexes, fields) = batch();
    c.put_ok(&indexes, &fields).await;
    assert_eq!(checkpoint_seq(&checkpoint(&c, &dir).await), 1);
    // The directory is private, and holds the manifest, one file per unit
    // and the journal.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700);
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "journal-1",
            "manifest.json",
            "unit-1-0.safetensors",
            "unit-1-1.safetensors"
        ]
    );
    // After the checkpoint: overwrite index 9 (position 1), clear index 40
    // (position 4) over TransferQueue, put a new index 500.
    c.put_ok(&[9], &[("x".into(), Field::Regular(f32_rows(1, 8, 77)))])
        .await;
    assert_eq!(
        TqClient::new(stowd.router()).clear(&[40]).await,
        tq::Reply::clear_ok(stowd.router().id.as_str())
    );
    c.put_ok(&[500], &[("x".into(), Field::Regular(f32_rows(1, 8, 5)))])
        .await;
    stowd.kill();

    let restored = Stowd::start_restoring(TWO_UNITS, &dir).unwrap_or_else(|e| panic!("{e}"));
    assert!(
        restored.log().contains("checkpoint restored"),
        "{}",
        restored.log()
    );
    check_rows(&restored, &[0, 2, 3, 5], "after restore").await;
    let name = format!("{}#1", dir.display());
    for g in [9, 40, 500] {
        assert_lost(&restored, g, &name).await;
    }
    // Never put: not found, not lost.
    let c = NativeClient::new(restored.native());
    let (code, _) = err(c.get(&[12345], &["x"]).await);
    assert_eq!(code, native::code::KEY_NOT_FOUND);
    // Put again: served.
    let again = Field::Regular(f32_rows(1, 8, 8));
    c.put_ok(&[9], &[("x".into(), again.clone())]).await;
    let got = c.get_ok(&[9], &["x"]).await;
    assert_cells("put again", &wire_cells(got[0].1.clone()), &cells(&again));

    // The restored stowd journals into the same checkpoint: a second kill
    // and restore still reports 40 and 500 lost, and now 9 too.
    let mut restored = restored;
    restored.kill();
    let twice = Stowd::start_restoring(TWO_UNITS, &dir).unwrap_or_else(|e| panic!("{e}"));
    check_rows(&twice, &[0, 2, 3, 5], "after a second restore").await;
    for g in [9, 40, 500] {
        assert_lost(&twice, g, &name).await;
    }
    // A new checkpoint replaces the old one in the directory.
    let c = NativeClient::new(twice.native());
    assert_eq!(checkpoint_seq(&checkpoint(&c, &dir).await), 2);
    assert!(!dir.join("unit-1-0.safetensors").exists());
    assert!(!dir.join("journal-1").exists());
    twice.stop();
}

/// Waits until `path` exists (a checkpoint has begun writing).
fn wait_for(what: impl Fn() -> bool, deadline: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < deadline {
        if what() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    false
}

fn seq_files(dir: &Path, seq: u64) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let n = p.file_name().unwrap().to_string_lossy().into_owned();
            n.starts_with(&format!(".unit-{seq}-")) || n.starts_with(&format!("unit-{seq}-"))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_killed_midway_leaves_the_previous_one() {
    let mut stowd = Stowd::start(TWO_UNITS);
    let c = NativeClient::new(stowd.native());
    let dir = temp_dir("restore-kill").join("ckpt");
    let (indexes, fields) = batch();
    c.put_ok(&indexes, &fields).await;
    assert_eq!(checkpoint_seq(&checkpoint(&c, &dir).await), 1);
    // Enough bytes that checkpoint 2 takes a while to write and hash: 64
    // MiB in 8 puts.
    for k in 0..8u64 {
        let big = Field::Regular(f32_rows(1024, 2048, 100 + k));
        let gs: Vec<u64> = (0..1024).map(|i| 10_000 + k * 1024 + i).collect();
        c.put_ok(&gs, &[("big".into(), big)]).await;
    }
    let endpoint = stowd.native().to_string();
    let dir2 = dir.clone();
    let second = std::thread::spawn(move || {
        Command::new(stowd_bin())
            .args(["checkpoint", "--endpoint", &endpoint])
            .arg(&dir2)
            .output()
            .unwrap()
    });
    assert!(
        wait_for(|| !seq_files(&dir, 2).is_empty(), Duration::from_secs(60)),
        "checkpoint 2 never began"
    );
    stowd.kill();
    let out = second.join().unwrap();
    assert!(
        !out.status.success(),
        "checkpoint 2 finished before the kill"
    );
    let manifest = std::fs::read_to_string(dir.join("manifest.json")).unwrap();
    assert!(manifest.contains("\"seq\": 1"), "{manifest}");

    let restored = Stowd::start_restoring(TWO_UNITS, &dir).unwrap_or_else(|e| panic!("{e}"));
    check_rows(&restored, &[0, 1, 2, 3, 4, 5], "the previous checkpoint").await;
    let native = NativeClient::new(restored.native());
    let (code, message) = err(native.get(&[10_000], &["big"]).await);
    assert_eq!(code, native::code::DATA_LOST, "{message}");
    // The next checkpoint removes what the killed one left.
    assert_eq!(checkpoint_seq(&checkpoint(&native, &dir).await), 3);
    assert!(seq_files(&dir, 2).is_empty());
    assert!(!dir.join("journal-2").exists());
    restored.stop();
}

/// Flips one byte of `path` at `at` (from the end if negative).
fn flip(path: &Path, at: i64) {
    let mut bytes = std::fs::read(path).unwrap();
    let i = if at < 0 {
        (bytes.len() as i64 + at) as usize
    } else {
        at as usize
    };
    bytes[i] ^= 0x01;
    std::fs::write(path, bytes).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flipped_byte_is_refused_at_restore_naming_the_file() {
    let stowd = Stowd::start(TWO_UNITS);
    let c = NativeClient::new(stowd.native());
    let base = temp_dir("restore-flip");
    let (indexes, fields) = batch();
    c.put_ok(&indexes, &fields).await;
    // In the last data byte, and in the JSON header (a digit of an index).
    for (k, at) in [(0, -1i64), (1, 40)] {
        let dir = base.join(format!("ckpt{k}"));
        checkpoint_seq(&checkpoint(&c, &dir).await);
        let file = dir.join("unit-1-1.safetensors");
        flip(&file, at);
        // At start: stowd refuses to start, naming the file.
        let refused =
            Stowd::start_restoring(TWO_UNITS, &dir).expect_err("restored a corrupted file");
        assert!(
            refused.contains("unit-1-1.safetensors") && refused.contains("checksum mismatch"),
            "{refused}"
        );
        // On a running stowd: refused, naming the file, and its rows stay.
        let (code, message) = err(restore(&c, &dir).await);
        assert_eq!(code, native::code::BAD_REQUEST);
        assert!(message.contains("unit-1-1.safetensors"), "{message}");
        check_rows(&stowd, &[0, 1, 2, 3, 4, 5], "after a refused restore").await;
    }
    // A truncated file: refused by its size.
    let dir = base.join("ckpt-short");
    checkpoint_seq(&checkpoint(&c, &dir).await);
    let file = dir.join("unit-1-0.safetensors");
    let len = std::fs::metadata(&file).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&file)
        .unwrap()
        .set_len(len - 3)
        .unwrap();
    let (_, message) = err(restore(&c, &dir).await);
    assert!(
        message.contains("unit-1-0.safetensors") && message.contains("bytes"),
        "{message}"
    );
    stowd.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_directories_and_manifests_are_refused_clearly() {
    let stowd = Stowd::start(TWO_UNITS);
    let c = NativeClient::new(stowd.native());
    let (indexes, fields) = batch();
    c.put_ok(&indexes, &fields).await;
    let base = temp_dir("restore-bad");
    let refuse = |reply: native::Reply, words: &[&str]| {
        let (code, message) = err(reply);
        assert_eq!(code, native::code::BAD_REQUEST, "{message}");
        for w in words {
            assert!(message.contains(w), "{w:?} not in {message}");
        }
    };
    refuse(
        checkpoint(&c, Path::new("relative/dir")).await,
        &["absolute path"],
    );
    refuse(
        restore(&c, &base.join("missing")).await,
        &["no such checkpoint directory"],
    );
    std::fs::write(base.join("file"), b"x").unwrap();
    refuse(
        checkpoint(&c, &base.join("file")).await,
        &["not a directory"],
    );
    std::os::unix::fs::symlink(&base, base.join("link")).unwrap();
    refuse(checkpoint(&c, &base.join("link")).await, &["symbolic link"]);
    let empty = base.join("empty");
    std::fs::create_dir(&empty).unwrap();
    refuse(
        restore(&c, &empty).await,
        &["no checkpoint", "manifest.json"],
    );
    // Manifests: not JSON, another format, a file outside the directory.
    let dir = base.join("ckpt");
    checkpoint_seq(&checkpoint(&c, &dir).await);
    let manifest = dir.join("manifest.json");
    let good = std::fs::read_to_string(&manifest).unwrap();
    for (text, words) in [
        ("{not json".to_string(), &["not a checkpoint manifest"][..]),
        (
            good.replace("stowage-checkpoint/1", "stowage-checkpoint/9"),
            &["stowage-checkpoint/9"][..],
        ),
        (
            good.replace("\"unit-1-0.safetensors\"", "\"../unit-1-0.safetensors\""),
            &["unit files of its own checkpoint, in the directory"][..],
        ),
    ] {
        std::fs::write(&manifest, text).unwrap();
        refuse(restore(&c, &dir).await, words);
    }
    // A journal gone: nobody can tell what changed after the checkpoint.
    std::fs::write(&manifest, &good).unwrap();
    std::fs::remove_file(dir.join("journal-1")).unwrap();
    refuse(
        restore(&c, &dir).await,
        &["journal-1", "journal is missing"],
    );
    check_rows(&stowd, &[0, 1, 2, 3, 4, 5], "after refused restores").await;
    // A stowd that routes to a remote unit refuses both.
    let remote = Stowd::start(&format!(
        "[units]\nlocal = 1\n\n[router]\nunits = [\"local:0\", {:?}]\n",
        stowd.unit(0).endpoint
    ));
    let r = NativeClient::new(remote.native());
    for reply in [checkpoint(&r, &dir).await, restore(&r, &dir).await] {
        let (code, message) = err(reply);
        assert_eq!(code, native::code::UNSUPPORTED);
        assert!(message.contains("1 remote unit"), "{message}");
    }
    remote.stop();
    stowd.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checkpoint_cli_writes_and_restores() {
    let stowd = Stowd::start(TWO_UNITS);
    let c = NativeClient::new(stowd.native());
    let (indexes, fields) = batch();
    c.put_ok(&indexes, &fields).await;
    let dir = temp_dir("restore-cli").join("ckpt");
    let run_with = |args: &[&str], dir: &Path| {
        Command::new(stowd_bin())
            .args(args)
            .args(["--endpoint", stowd.native()])
            .arg(dir)
            .output()
            .unwrap()
    };
    let run = |op: &str, dir: &Path| run_with(&[op], dir);
    let out = run("checkpoint", &dir);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert!(
        text.contains("checkpoint 1 written") && text.contains("30 rows"),
        "{text}"
    );
    // Cleared after the checkpoint: a restore reports them lost, never
    // their checkpointed values.
    c.clear(&indexes[..2], None).await;
    let out = run("restore", &dir);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("20 rows, 2 indexes lost"), "{text}");
    check_rows(&stowd, &[2, 3, 4, 5], "restored by the CLI").await;
    let (code, _) = err(c.get(&indexes[..1], &["x"]).await);
    assert_eq!(code, native::code::DATA_LOST);
    let out = run("restore", Path::new("/nonexistent/ckpt"));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("outside the checkpoint roots"), "{err}");
    let out = run("restore", &dir.with_file_name("missing"));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no such checkpoint directory"), "{err}");
    // --snapshot: cleared after it, restored as written.
    c.put_ok(&indexes, &fields).await;
    let snap = dir.with_file_name("snap");
    let out = run_with(&["checkpoint", "--snapshot"], &snap);
    assert!(out.status.success(), "{out:?}");
    c.clear(&indexes[..2], None).await;
    let out = run("restore", &snap);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("30 rows, 0 indexes lost"), "{text}");
    check_rows(
        &stowd,
        &[0, 1, 2, 3, 4, 5],
        "a snapshot restored by the CLI",
    )
    .await;
    stowd.stop();
}

/// A checkpoint written elsewhere never makes another unrestorable: a
/// client checkpoints into a directory of its own and moves it away; the
/// first checkpoint still restores, with every index changed since lost
/// (none stale). The moved copy's journal follows it. Past
/// `max_journals` directories a journaled checkpoint into one more is
/// refused, and removing a journaled directory frees its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_elsewhere_leaves_every_other_restorable() {
    let config = "[units]\nlocal = 2\n";
    let mut stowd = Stowd::start(config);
    let c = NativeClient::new(stowd.native());
    let base = temp_dir("restore-elsewhere");
    let (a, b, moved) = (base.join("a"), base.join("b"), base.join("b-moved"));
    let (indexes, fields) = batch();
    c.put_ok(&indexes, &fields).await;
    assert_eq!(checkpoint_seq(&checkpoint(&c, &a).await), 1);
    c.put_ok(&[600], &[("x".into(), Field::Regular(f32_rows(1, 8, 6)))])
        .await;
    assert_eq!(checkpoint_seq(&checkpoint(&c, &b).await), 1);
    std::fs::rename(&b, &moved).unwrap();
    c.put_ok(&[3], &[("x".into(), Field::Regular(f32_rows(1, 8, 7)))])
        .await;
    // Both journals written: a's holds 600 and 3, the moved b's 3.
    assert_eq!(std::fs::metadata(a.join("journal-1")).unwrap().len(), 16);
    assert_eq!(std::fs::metadata(moved.join("journal-1")).unwrap().len(), 8);
    assert!(!a.join("journal-1.stopped").exists());
    assert!(!moved.join("journal-1.stopped").exists());
    // Two more directories: the fourth is journaled, the fifth refused,
    // naming max_journals; a removed directory frees its place.
    let (c3, c4, c5) = (base.join("c3"), base.join("c4"), base.join("c5"));
    checkpoint_seq(&checkpoint(&c, &c3).await);
    checkpoint_seq(&checkpoint(&c, &c4).await);
    let (code, message) = err(checkpoint(&c, &c5).await);
    assert_eq!(code, native::code::BAD_REQUEST, "{message}");
    assert!(
        message.contains("max_journals") && message.contains(&a.display().to_string()),
        "{message}"
    );
    std::fs::remove_dir_all(&c4).unwrap();
    checkpoint_seq(&checkpoint(&c, &c5).await);
    stowd.kill();

    // Restored into 3 units instead of 2: rows re-routed by g % 3.
    let three = "[units]\nlocal = 3\n";
    let restored = Stowd::start_restoring(three, &a).unwrap_or_else(|e| panic!("{e}"));
    check_rows(&restored, &[1, 2, 3, 4, 5], "a restored into 3 units").await;
    assert_lost(&restored, 3, &format!("{}#1", a.display())).await;
    assert_lost(&restored, 600, &format!("{}#1", a.display())).await;
    restored.stop();
    let restored = Stowd::start_restoring(three, &moved).unwrap_or_else(|e| panic!("{e}"));
    check_rows(&restored, &[1, 2, 3, 4, 5], "the moved b").await;
    assert_lost(&restored, 3, &format!("{}#1", moved.display())).await;
    let got = NativeClient::new(restored.native())
        .get_ok(&[600], &["x"])
        .await;
    assert_cells(
        "600, put before b",
        &wire_cells(got[0].1.clone()),
        &cells(&Field::Regular(f32_rows(1, 8, 6))),
    );
    restored.stop();
}

/// The value of version `v` of index `g`: one row of 4 u64.
fn versioned(g: u64, v: u64) -> Field {
    let words = [g, v, g ^ v, g.wrapping_mul(31).wrapping_add(v)];
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    Field::Regular(
        stowage_host::tensor::Tensor::contiguous(
            bytes.into(),
            stowage_host::tensor::Dtype::Uint64,
            vec![1, 4],
        )
        .unwrap(),
    )
}

/// Each index of `last` reads version `last[g]` of its row, or is
/// `data_lost`: (how many read their value, how many were lost).
async fn values_or_lost(
    c: &NativeClient,
    last: &std::collections::HashMap<u64, u64>,
    what: &str,
) -> (usize, usize) {
    let (mut kept, mut lost) = (0, 0);
    for (&g, &v) in last {
        match c.get(&[g], &["x"]).await {
            native::Reply::GetOk { fields } => {
                assert_cells(
                    &format!("index {g} {what}"),
                    &wire_cells(fields[0].1.clone()),
                    &cells(&versioned(g, v)),
                );
                kept += 1;
            }
            other => {
                let (code, message) = err(other);
                assert_eq!(code, native::code::DATA_LOST, "index {g}: {message}");
                lost += 1;
            }
        }
    }
    (kept, lost)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_racing_a_checkpoint_never_come_back_stale() {
    let mut stowd = Stowd::start(TWO_UNITS);
    let dir = temp_dir("restore-race").join("ckpt");
    let native = stowd.native().to_string();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // 4 writers, each over its own indexes: each index is put 3 times
    // (versions 1 to 3), then the next; each returns the last version it
    // stored per index. Around the checkpoint some index has its last put
    // just before the snapshot and the next just after.
    let mut writers = Vec::new();
    for w in 0..4u64 {
        let (native, stop) = (native.clone(), stop.clone());
        writers.push(tokio::spawn(async move {
            let c = NativeClient::new(&native);
            let mut last = Vec::new();
            let mut j = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let g = w * 1_000_000 + j;
                for v in 1..=3 {
                    c.put_ok(&[g], &[("x".into(), versioned(g, v))]).await;
                    last.push((g, v));
                }
                j += 1;
            }
            last
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let c = NativeClient::new(&native);
    assert_eq!(checkpoint_seq(&checkpoint(&c, &dir).await), 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut last = std::collections::HashMap::new();
    for w in writers {
        for (g, v) in w.await.unwrap() {
            last.insert(g, v);
        }
    }
    stowd.kill();
    let restored = Stowd::start_restoring(TWO_UNITS, &dir).unwrap_or_else(|e| panic!("{e}"));
    let c = NativeClient::new(restored.native());
    // Not touched after the checkpoint: its last value; else lost.
    let (kept, lost) = values_or_lost(&c, &last, "restored").await;
    // Both sides of the checkpoint are exercised.
    assert!(lost > 0 && kept > 0, "kept {kept}, lost {lost}");
    restored.stop();
}

/// Puts keep going while a restore runs, on the running stowd and after a
/// SIGKILL and `serve --restore`: every index a writer had acknowledged
/// reads its last acknowledged value or `data_lost`, never `key_not_found`
/// and never an older value; in the new stowd every index written after
/// the checkpoint is `data_lost` and every other one its checkpointed
/// value. (Before, puts between the journal's close and its resume were
/// journaled nowhere and came back with their checkpointed values.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_during_a_restore_are_lost_never_stale() {
    let mut stowd = Stowd::start(TWO_UNITS);
    let dir = temp_dir("restore-during").join("ckpt");
    let native = stowd.native().to_string();
    let c = NativeClient::new(&native);
    // Indexes 0..400 at version 1; the writers touch only the even ones.
    for g in 0..400u64 {
        c.put_ok(&[g], &[("x".into(), versioned(g, 1))]).await;
    }
    assert_eq!(checkpoint_seq(&checkpoint(&c, &dir).await), 1);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..2u64 {
        let (native, stop) = (native.clone(), stop.clone());
        writers.push(tokio::spawn(async move {
            let c = NativeClient::new(&native);
            let mut last = std::collections::HashMap::new();
            let mut v = 2u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                for k in 0..50u64 {
                    let g = (w * 100 + k) * 2;
                    c.put_ok(&[g], &[("x".into(), versioned(g, v))]).await;
                    last.insert(g, v);
                }
                v += 1;
            }
            last
        }));
    }
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        match restore(&c, &dir).await {
            native::Reply::RestoreOk { .. } => {}
            other => panic!("restore failed: {other:?}"),
        }
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut last = std::collections::HashMap::new();
    for w in writers {
        last.extend(w.await.unwrap());
    }
    let (kept, lost) = values_or_lost(&c, &last, "on the running stowd").await;
    assert!(lost + kept == 100, "kept {kept}, lost {lost}");
    stowd.kill();
    let restored = Stowd::start_restoring(TWO_UNITS, &dir).unwrap_or_else(|e| panic!("{e}"));
    let c = NativeClient::new(restored.native());
    for g in 0..400u64 {
        match c.get(&[g], &["x"]).await {
            native::Reply::GetOk { fields } => {
                assert!(
                    !last.contains_key(&g),
                    "index {g}, written after the checkpoint, came back with a value"
                );
                assert_cells(
                    &format!("index {g} restored"),
                    &wire_cells(fields[0].1.clone()),
                    &cells(&versioned(g, 1)),
                );
            }
            other => {
                let (code, message) = err(other);
                assert_eq!(code, native::code::DATA_LOST, "index {g}: {message}");
                assert!(
                    last.contains_key(&g),
                    "index {g} was never written after the checkpoint"
                );
            }
        }
    }
    restored.stop();
}

async fn snapshot(c: &NativeClient, dir: &Path) -> native::Reply {
    c.call(Op::Checkpoint {
        dir: dir.display().to_string(),
        journal: false,
    })
    .await
}

/// A snapshot (`checkpoint` with `journal: false`, what TransferQueue's
/// `save_checkpoint` asks through the native backend) keeps no journal:
/// rows cleared or overwritten after it come back as they were when it is
/// restored, on a running stowd and in a new one, also after its directory
/// was renamed (TransferQueue renames `X.tmp` to `X`). Restoring it stops
/// the journal of the journaled checkpoint taken before (which can then no
/// longer be restored, rather than be restored wrong); a snapshot is refused
/// in a directory whose journal is open, and `journal` must be a bool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_restores_every_row_as_it_was_written() {
    let mut stowd = Stowd::start(TWO_UNITS);
    let c = NativeClient::new(stowd.native());
    let base = temp_dir("restore-snapshot");
    let (journaled, tmp, snap) = (base.join("j"), base.join("s.tmp"), base.join("s"));
    let (indexes, fields) = batch();
    c.put_ok(&indexes, &fields).await;
    assert_eq!(checkpoint_seq(&checkpoint(&c, &journaled).await), 1);
    assert_eq!(checkpoint_seq(&snapshot(&c, &tmp).await), 1);
    let names: Vec<String> = std::fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n.starts_with("journal")), "{names:?}");
    let manifest = std::fs::read_to_string(tmp.join("manifest.json")).unwrap();
    assert!(manifest.contains("\"journal\": false"), "{manifest}");
    std::fs::rename(&tmp, &snap).unwrap();

    // After the snapshot: one row overwritten, every other cleared.
    c.put_ok(
        &[indexes[0]],
        &[("x".into(), Field::Regular(f32_rows(1, 8, 9)))],
    )
    .await;
    let cleared: Vec<u64> = indexes[1..].to_vec();
    match c
        .call(Op::Clear {
            global_indexes: cleared,
            fields: None,
        })
        .await
    {
        native::Reply::ClearOk { .. } => {}
        other => panic!("clear failed: {other:?}"),
    }
    // The snapshot's directory is not journaled: no journal grew there.
    assert!(std::fs::read_dir(&snap).unwrap().all(|e| {
        !e.unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with("journal")
    }));

    match restore(&c, &snap).await {
        native::Reply::RestoreOk { rows, lost, .. } => {
            assert_eq!(lost, 0);
            assert!(rows > 0);
        }
        other => panic!("restore failed: {other:?}"),
    }
    check_rows(&stowd, &[0, 1, 2, 3, 4, 5], "restored snapshot (running)").await;
    // The journaled checkpoint stays restorable, and never stale: its
    // journal recorded every index the overwrite, the clear and the
    // snapshot's restore changed, so each reads data_lost.
    match restore(&c, &journaled).await {
        native::Reply::RestoreOk { rows, lost, .. } => {
            assert_eq!((rows, lost), (0, indexes.len() as u64));
        }
        other => panic!("restore failed: {other:?}"),
    }
    let (code, _) = err(c.get(&indexes[..1], &["x"]).await);
    assert_eq!(code, native::code::DATA_LOST);
    // The snapshot again, for what follows.
    match restore(&c, &snap).await {
        native::Reply::RestoreOk { lost: 0, .. } => {}
        other => panic!("restore failed: {other:?}"),
    }
    // A snapshot where a journal is open is refused; so is a journal that is not a bool.
    let j2 = base.join("j2");
    assert_eq!(checkpoint_seq(&checkpoint(&c, &j2).await), 1);
    let (_, message) = err(snapshot(&c, &j2).await);
    assert!(
        message.contains("journals its checkpoint in this directory"),
        "{message}"
    );
    stowd.kill();

    // A new stowd restores the snapshot at start.
    let restored = Stowd::start_restoring(TWO_UNITS, &snap).unwrap_or_else(|e| panic!("{e}"));
    check_rows(
        &restored,
        &[0, 1, 2, 3, 4, 5],
        "restored snapshot (at start)",
    )
    .await;
    restored.stop();
}
