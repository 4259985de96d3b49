//! Deduplicated puts (issue 19): `[dedup] fields` on the real `stowd`.
//!
//! - a GRPO-style put (8 prompts, each repeated for 8 samples) stores each
//!   distinct prompt row once: `dedup_rows` and `dedup_bytes` count the
//!   other 56, every row reads back byte-identical, in both protocols;
//! - clearing or overwriting one copy leaves the other copies;
//! - fields the patterns do not name, and a put without duplicates, are
//!   stored as they came (hashed, nothing saved);
//! - nested rows (images of one shape or another) are deduplicated too;
//! - the case: 64 rows of 4 MiB, every 8 identical, keep 1/8 of the
//!   bytes in `stats` and in stowd's RssAnon + RssShmem (receive pool off,
//!   so the request's frame is given back once the distinct rows are copied
//!   out of it), and every row reads back right after some copies are
//!   overwritten and cleared.

use stowage_host::batch::Field;
use stowage_host::tensor::{Dtype, Tensor};
use stowage_tests::data::{assert_cells, cells, expected, f32_rows, tensor, wire_cells};
use stowage_tests::{NativeClient, Stowd, TqClient};

/// `prompts` distinct rows of `cols` float32, each repeated `samples`
/// times in a row (as GRPO puts them).
fn repeated(prompts: u64, samples: u64, cols: u64) -> Field {
    let distinct = f32_rows(prompts, cols, 3);
    let rows: Vec<Tensor> = (0..prompts * samples)
        .map(|i| distinct.row_tensor(i / samples).expect("row"))
        .collect();
    let mut bytes = Vec::new();
    for r in &rows {
        bytes.extend_from_slice(&r.contiguous_bytes());
    }
    Field::Regular(
        Tensor::contiguous(bytes.into(), Dtype::Float32, vec![prompts * samples, cols])
            .expect("shape"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_rows_of_a_named_field_are_stored_once() {
    let stowd = Stowd::start(
        "[units]\nlocal = 2\n\n[dedup]\nfields = [\"prompt*\", \"image\"]\n\n[shm]\nenabled = false\n",
    );
    let client = NativeClient::new(stowd.native());
    let indexes: Vec<u64> = (0..64).collect();
    let prompt = repeated(8, 8, 256);
    let response = Field::Regular(f32_rows(64, 32, 5));
    // Images: 2 distinct of one shape, 2 of another, each 16 times.
    let images: Vec<Tensor> = (0..64u64)
        .map(|i| match i % 4 {
            0 | 1 => tensor(Dtype::Uint8, &[3, 8, 8], i % 4),
            _ => tensor(Dtype::Uint8, &[3, 4, 4], i % 4),
        })
        .collect();
    let image = Field::Nested(images);
    let fields = vec![
        ("prompt_ids".to_string(), prompt.clone()),
        ("response".to_string(), response.clone()),
        ("image".to_string(), image.clone()),
    ];
    client.put_ok(&indexes, &fields).await;
    let prompt_dups = 64 - 8;
    let image_dups = 64 - 4;
    assert_eq!(
        client.stat("dedup_rows").await,
        prompt_dups + image_dups,
        "duplicates of prompt_ids and image"
    );
    let image_saved: i64 = (4..64).map(|i: i64| if i % 4 < 2 { 192 } else { 48 }).sum();
    assert_eq!(
        client.stat("dedup_bytes").await,
        prompt_dups * 1024 + image_saved
    );
    let scanned = client.stat("dedup_scanned_bytes").await;
    assert_eq!(scanned, 64 * 1024 + 64 * 120);

    let check = |what: &'static str| {
        let client = &client;
        let (indexes, fields) = (&indexes, &fields);
        async move {
            let got = client
                .get_ok(indexes, &["prompt_ids", "response", "image"])
                .await;
            for ((name, want), (_, got)) in fields.iter().zip(got) {
                assert_cells(&format!("{what}: {name}"), &wire_cells(got), &cells(want));
            }
        }
    };
    check("native").await;
    let tq = TqClient::new(stowd.router());
    match tq.get(&indexes, &["prompt_ids", "image"]).await {
        stowage_host::wire::tq::Reply::GetData { fields: got } => {
            assert_cells("tq prompt", &got[0].1, &cells(&prompt));
            assert_cells("tq image", &got[1].1, &cells(&image));
        }
        other => panic!("tq get: {other:?}"),
    }

    // Clear one copy, overwrite another: the rest keep their rows.
    assert_eq!(client.clear(&[0], Some(&["prompt_ids"])).await, 1);
    let new = Field::Regular(f32_rows(1, 256, 77));
    client
        .put_ok(&[1], &[("prompt_ids".to_string(), new.clone())])
        .await;
    let rest: Vec<u64> = (2..8).collect();
    let got = client.get_ok(&rest, &["prompt_ids"]).await;
    assert_cells(
        "the other copies",
        &wire_cells(got.into_iter().next().unwrap().1),
        &expected(&prompt, &indexes, &rest),
    );
    let got = client.get_ok(&[1], &["prompt_ids"]).await;
    assert_cells(
        "the overwritten copy",
        &wire_cells(got.into_iter().next().unwrap().1),
        &cells(&new),
    );
    let reply = client.get(&[0], &["prompt_ids"]).await;
    assert_eq!(
        stowage_tests::client::native_error(&reply).0,
        "key_not_found"
    );

    // A put without duplicates: hashed, nothing saved.
    let before = client.stat("dedup_rows").await;
    let distinct: Vec<u64> = (100..132).collect();
    client
        .put_ok(
            &distinct,
            &[(
                "prompt_ids".to_string(),
                Field::Regular(f32_rows(32, 256, 9)),
            )],
        )
        .await;
    assert_eq!(client.stat("dedup_rows").await, before);
    assert_eq!(
        client.stat("dedup_scanned_bytes").await,
        scanned + 1024 + 32 * 1024
    );
    stowd.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_rows_of_4_mib_in_eights_keep_an_eighth_of_the_memory() {
    const MIB: u64 = 1 << 20;
    let stowd = Stowd::start(
        "[units]\nlocal = 2\n\n[dedup]\nfields = [\"p\"]\n\n[shm]\nenabled = false\n\n[limits]\nmax_message_bytes = 536870912\nreceive_pool_bytes = 0\n",
    );
    let client = NativeClient::new(stowd.native());
    let indexes: Vec<u64> = (0..64).collect();
    // 8 distinct rows of 4 MiB (1 Mi float32), each 8 times in a row.
    let p = repeated(8, 8, MIB);
    let payload = 64 * 4 * MIB;
    let before = crate::spill::anon_and_shmem(stowd.pid());
    client
        .put_ok(&indexes, &[("p".to_string(), p.clone())])
        .await;
    assert_eq!(client.stat("dedup_rows").await, 56);
    assert_eq!(client.stat("dedup_bytes").await as u64, 56 * 4 * MIB);
    // The frame goes once the put's reply is out; give the OS a moment.
    let bound = payload / 8 + payload / 16;
    let mut grew = u64::MAX;
    for _ in 0..50 {
        grew = crate::spill::anon_and_shmem(stowd.pid()).saturating_sub(before);
        if grew <= bound {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    println!(
        "RssAnon + RssShmem grew by {} MiB for a {} MiB put of 8 distinct rows x 8",
        grew / MIB,
        payload / MIB
    );
    assert!(
        grew <= bound,
        "stowd grew by {} MiB for {} MiB of rows of which 1/8 are distinct",
        grew / MIB,
        payload / MIB
    );

    // Overwrite one copy of two prompts, clear one of a third: the others
    // keep their bytes.
    let new = Field::Regular(f32_rows(2, MIB, 77));
    client
        .put_ok(&[0, 9], &[("p".to_string(), new.clone())])
        .await;
    assert_eq!(client.clear(&[1, 17], None).await, 2);
    let rest: Vec<u64> = (0..64).filter(|g| ![0, 9, 1, 17].contains(g)).collect();
    let got = client.get_ok(&rest, &["p"]).await;
    assert_cells(
        "the other copies",
        &wire_cells(got.into_iter().next().unwrap().1),
        &expected(&p, &indexes, &rest),
    );
    let got = client.get_ok(&[0, 9], &["p"]).await;
    assert_cells(
        "the overwritten copies",
        &wire_cells(got.into_iter().next().unwrap().1),
        &cells(&new),
    );
    for g in [1, 17] {
        let reply = client.get(&[g], &["p"]).await;
        assert_eq!(
            stowage_tests::client::native_error(&reply).0,
            "key_not_found"
        );
    }
    stowd.stop();
}
