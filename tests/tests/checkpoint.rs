//! TransferQueue's `SAVE_STORAGE_CHECKPOINT` and `LOAD_STORAGE_CHECKPOINT`
//! at stowd's unit endpoints (issue 16, first part): the real `stowd`,
//! real sockets, the TransferQueue wire format. A unit saves its rows to a
//! safetensors file and loads them back byte for byte, replacing what it
//! held; a corrupted, truncated, foreign or missing file is refused with a
//! message naming it, and the unit keeps serving its rows; bad paths are
//! refused clearly. The router endpoint checkpoints all its local units in
//! one file, and refuses when it routes to a remote unit.

use std::path::Path;

use stowage_host::batch::{Cell, Field};
use stowage_host::wire::tq;
use stowage_tests::data::{assert_cells, cells, every_kind as batch, f32_rows};
use stowage_tests::{Stowd, TqClient, temp_dir};

async fn save(c: &TqClient, path: &Path) -> tq::Reply {
    c.request(&tq::Request::SaveCheckpoint {
        path: path.to_string_lossy().into_owned(),
    })
    .await
}

async fn load(c: &TqClient, path: &Path) -> tq::Reply {
    c.request(&tq::Request::LoadCheckpoint {
        path: path.to_string_lossy().into_owned(),
    })
    .await
}

fn ok(reply: &tq::Reply, load: bool) {
    assert_eq!(reply, &tq::Reply::Checkpoint { load, error: None });
}

fn refused(reply: &tq::Reply, load: bool) -> String {
    match reply {
        tq::Reply::Checkpoint {
            load: l,
            error: Some(e),
        } if *l == load => e.clone(),
        other => panic!("expected a refused checkpoint, got {other:?}"),
    }
}

async fn check_all(c: &TqClient, indexes: &[u64], fields: &[(String, Field)], what: &str) {
    let names: Vec<&str> = fields.iter().map(|(n, _)| n.as_str()).collect();
    let got = c.get_ok(indexes, &names).await;
    for ((name, field), (got_name, got_cells)) in fields.iter().zip(&got) {
        assert_eq!(name, got_name);
        assert_cells(&format!("{what}: {name}"), got_cells, &cells(field));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_unit_saves_and_loads_its_rows_byte_for_byte() {
    let stowd = Stowd::start("");
    let unit = TqClient::new(stowd.unit(0));
    let dir = temp_dir("checkpoint");
    let path = dir.join("su_0.safetensors");
    let (indexes, fields) = batch();
    unit.put_ok(&indexes, fields.clone()).await;

    ok(&save(&unit, &path).await, false);
    let file = std::fs::read(&path).unwrap();
    // A safetensors file: an 8-byte little-endian header length, then JSON.
    let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&file[8..8 + n]).unwrap();
    assert!(header.contains("stowage-unit-checkpoint/2"), "{header}");
    // The 6 rows of x, put together, are one tensor [6, 8] with their
    // global indexes; nested rows and strings one tensor each.
    assert!(
        header.contains(r#"[\"x\",\"rows\",\"float32\",[6,8],[3,9,10,11,40,7]]"#),
        "{header}"
    );
    assert!(
        header.contains("\"BF16\""),
        "bf16 rows keep their dtype: {header}"
    );
    // Nothing but the file is left in the directory (no temporary).
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert_eq!(left.len(), 1);

    // Overwrite one row and add another after the save, then load: the
    // unit holds exactly what was saved.
    unit.put_ok(
        &[3, 1000],
        vec![("x".into(), Field::Regular(f32_rows(2, 8, 99)))],
    )
    .await;
    ok(&load(&unit, &path).await, true);
    check_all(&unit, &indexes, &fields, "after load").await;
    match unit.get(&[1000], &["x"]).await {
        tq::Reply::Error { kind, .. } => assert_eq!(kind, tq::ErrorReply::Get),
        other => panic!("index 1000 was put after the save: {other:?}"),
    }

    // Load into an emptied unit of another stowd (a restart).
    let other = Stowd::start("");
    let fresh = TqClient::new(other.unit(1));
    ok(&load(&fresh, &path).await, true);
    check_all(&fresh, &indexes, &fields, "in another stowd").await;
    // Saving an empty unit gives a file that empties a unit on load.
    let empty = dir.join("empty.safetensors");
    ok(&save(&TqClient::new(other.unit(0)), &empty).await, false);
    ok(&load(&fresh, &empty).await, true);
    match fresh.get(&[3], &["x"]).await {
        tq::Reply::Error { .. } => {}
        other => panic!("the unit should be empty: {other:?}"),
    }
    other.stop();
    stowd.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_or_foreign_file_is_refused_and_the_unit_keeps_its_rows() {
    let stowd = Stowd::start("");
    let unit = TqClient::new(stowd.unit(0));
    let dir = temp_dir("checkpoint-bad");
    let path = dir.join("su_0.safetensors");
    let (indexes, fields) = batch();
    unit.put_ok(&indexes, fields.clone()).await;
    ok(&save(&unit, &path).await, false);
    let good = std::fs::read(&path).unwrap();

    // One flipped byte in the last row's bytes: the checksum names the file.
    let mut flipped = good.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 0x40;
    let bad = dir.join("flipped.safetensors");
    std::fs::write(&bad, &flipped).unwrap();
    let e = refused(&load(&unit, &bad).await, true);
    assert!(
        e.contains("checksum mismatch") && e.contains("flipped.safetensors"),
        "{e}"
    );

    // Truncated, not safetensors at all, missing, another safetensors file.
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "truncated",
            good[..good.len() / 2].to_vec(),
            "not a safetensors file",
        ),
        ("text", b"hello".to_vec(), "not a safetensors file"),
        (
            "foreign",
            // A valid safetensors file without stowd's metadata.
            {
                let json = br#"{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#;
                let mut f = (json.len() as u64).to_le_bytes().to_vec();
                f.extend_from_slice(json);
                f.extend_from_slice(&[1, 2]);
                f
            },
            "not a stowd unit checkpoint",
        ),
    ];
    for (name, bytes, want) in cases {
        let p = dir.join(format!("{name}.safetensors"));
        std::fs::write(&p, bytes).unwrap();
        let e = refused(&load(&unit, &p).await, true);
        assert!(e.contains(want) && e.contains(name), "{name}: {e}");
    }
    let e = refused(&load(&unit, &dir.join("missing.safetensors")).await, true);
    assert!(e.contains("missing.safetensors"), "{e}");

    // Every refused load left the unit as it was.
    check_all(&unit, &indexes, &fields, "after refused loads").await;
    stowd.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_paths_and_a_router_with_remote_units_are_refused_clearly() {
    let stowd = Stowd::start("");
    let unit = TqClient::new(stowd.unit(0));
    let dir = temp_dir("checkpoint-paths");
    unit.put_ok(&[1], vec![("x".into(), Field::Regular(f32_rows(1, 2, 0)))])
        .await;
    // A relative path, a directory, a missing directory, a symbolic link.
    let e = refused(
        &unit
            .request(&tq::Request::SaveCheckpoint {
                path: "su_0.safetensors".into(),
            })
            .await,
        false,
    );
    assert!(e.contains("not absolute"), "{e}");
    let sub = dir.join("sub");
    std::fs::create_dir(&sub).unwrap();
    let e = refused(&save(&unit, &sub).await, false);
    assert!(e.contains("not a regular file"), "{e}");
    let e = refused(&load(&unit, &sub).await, true);
    assert!(e.contains("not a regular file"), "{e}");
    // A directory others can write (the temporary directory, 1777).
    let e = refused(&save(&unit, &dir).await, false);
    assert!(e.contains("writable by group or others"), "{e}");
    let e = refused(
        &save(&unit, &dir.join("no/such/dir/su.safetensors")).await,
        false,
    );
    assert!(e.contains("no/such/dir"), "{e}");
    let target = dir.join("target");
    std::fs::write(&target, b"keep me").unwrap();
    let link = dir.join("link.safetensors");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let e = refused(&save(&unit, &link).await, false);
    assert!(e.contains("symbolic link"), "{e}");
    assert_eq!(std::fs::read(&target).unwrap(), b"keep me");
    // A router with a remote unit cannot write for it: refused, naming why.
    let remote = Stowd::start(&format!(
        "[units]\nlocal = 1\n\n[router]\nunits = [\"local:0\", {:?}]\n",
        stowd.unit(1).endpoint
    ));
    let e = refused(
        &save(&TqClient::new(remote.router()), &dir.join("r.safetensors")).await,
        false,
    );
    assert!(
        e.contains("1 remote unit") && e.contains("own endpoint"),
        "{e}"
    );
    remote.stop();
    // A body without a path: TransferQueue's generic worker error.
    let frames = unit.encode(&tq::Request::Other("SAVE_STORAGE_CHECKPOINT".into()));
    match unit.send_frames(frames).await {
        tq::Reply::Error { kind, message } => {
            assert_eq!(kind, tq::ErrorReply::PutGet);
            assert!(message.contains("path"), "{message}");
        }
        other => panic!("expected PUT_GET_ERROR, got {other:?}"),
    }
    // The unit still serves its row.
    let got = unit.get_ok(&[1], &["x"]).await;
    assert!(matches!(got[0].1[0], Cell::Tensor(_)));
    stowd.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_checkpoints_its_local_units_in_one_file() {
    let stowd = Stowd::start("[units]\nlocal = 3\n");
    let router = TqClient::new(stowd.router());
    let dir = temp_dir("checkpoint-router");
    let path = dir.join("router.safetensors");
    let (indexes, fields) = batch();
    router.put_ok(&indexes, fields.clone()).await;
    ok(&save(&router, &path).await, false);
    // The rows go, another row comes; the load restores exactly the saved
    // rows, each on the unit g % 3 routes it to.
    router.clear(&indexes).await;
    router
        .put_ok(
            &[500],
            vec![("x".into(), Field::Regular(f32_rows(1, 8, 5)))],
        )
        .await;
    ok(&load(&router, &path).await, true);
    check_all(&router, &indexes, &fields, "through the router").await;
    match router.get(&[500], &["x"]).await {
        tq::Reply::Error { .. } => {}
        other => panic!("index 500 was put after the save: {other:?}"),
    }
    // Each unit endpoint holds its own share: index 9 on unit 0, 10 on 1.
    let unit0 = TqClient::new(stowd.unit(0));
    let got = unit0.get_ok(&[9], &["text"]).await;
    assert_cells("unit 0", &got[0].1, &cells(&fields[4].1)[1..2]);
    let unit1 = TqClient::new(stowd.unit(1));
    assert!(matches!(
        unit1.get(&[9], &["text"]).await,
        tq::Reply::Error { .. }
    ));
    stowd.stop();
}
