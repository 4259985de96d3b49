//! Every value TransferQueue's encoder sends that a `SimpleStorageUnit`
//! stores, through a real stowd: per-row numpy arrays (ext 5, string and
//! empty and 0-d ones too), whole fields sent as one numpy array, tensors
//! inside lists and dicts or among `None`s, nested tensors as rows. The PUT
//! frames are TransferQueue's own and the expected GET replies a real
//! `SimpleStorageUnit`'s (`wire/src/tests/values/`, written by
//! `tests/python/make_tq_value_goldens.py`): stowd's reply must carry the
//! same body and the same data frames, from a unit and from the router.

use bytes::Bytes;
use stowage_host::wire::tq::{self, ErrorReply, Stamp};
use stowage_tests::client::tq_error;
use stowage_tests::{Stowd, TqClient, workspace_root};

fn load(name: &str) -> Vec<Bytes> {
    let dir = workspace_root().join("wire/src/tests/values");
    let mut frames = Vec::new();
    while let Ok(b) = std::fs::read(dir.join(format!("{name}.frame{}.bin", frames.len()))) {
        frames.push(Bytes::from(b));
    }
    assert!(!frames.is_empty(), "no golden frames {name}");
    frames
}

fn cases() -> Vec<String> {
    std::fs::read_to_string(workspace_root().join("wire/src/tests/values/CASES"))
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// A reply's frames with its envelope re-stamped, to compare two units'
/// replies by body and data frames.
fn normalised(frames: &[Bytes]) -> Vec<Bytes> {
    let (_, reply) = tq::decode_reply(frames).unwrap_or_else(|e| panic!("undecodable: {e}"));
    let out = tq::encode_reply_stamped("U", &reply, &Stamp::new("00000000", 1.0));
    assert_eq!(&out[1..], &frames[1..], "data frames");
    out
}

async fn get_raw(client: &TqClient, indexes: &[u64]) -> Vec<Bytes> {
    let frames = client.encode(&tq::Request::Get {
        global_indexes: indexes.to_vec(),
        fields: vec!["f".into()],
    });
    client
        .exchange(frames, client.timeout)
        .await
        .expect("a reply")
}

/// Every golden case at its own indexes shifted by `offset`.
async fn every_case(client: &TqClient, offset: u64) {
    for name in cases() {
        let put = load(&format!("{name}.put"));
        let tq::Request::Put {
            global_indexes,
            fields,
        } = tq::decode_request(&put).unwrap()
        else {
            panic!()
        };
        let indexes: Vec<u64> = global_indexes.iter().map(|g| g + offset).collect();
        let frames = if offset == 0 {
            put
        } else {
            // Same value, other indexes: the decoded PUT encoded again.
            client.encode(&tq::Request::Put {
                global_indexes: indexes.clone(),
                fields,
            })
        };
        let reply = client.send_frames(frames).await;
        assert!(
            matches!(reply, tq::Reply::PutData),
            "{name}: PUT refused: {reply:?}"
        );
        let golden = load(&format!("{name}.get"));
        let got = get_raw(client, &indexes).await;
        assert_eq!(normalised(&got), normalised(&golden), "{name}");
        client.clear(&indexes).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simple_storage_unit_values_through_a_unit() {
    let stowd = Stowd::start("");
    every_case(&TqClient::new(stowd.unit(0)), 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simple_storage_unit_values_through_the_router() {
    // Even rows on one unit, odd ones on the other; the router joins them.
    let stowd = Stowd::start("");
    let router = TqClient::new(stowd.router());
    every_case(&router, 0).await;
    every_case(&router, 7).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_numpy_input_leaves_stored_rows_intact() {
    let stowd = Stowd::start("");
    let client = TqClient::new(stowd.unit(0));
    let name = "numpy_string_rows";
    assert!(matches!(
        client.send_frames(load(&format!("{name}.put"))).await,
        tq::Reply::PutData
    ));
    let before = get_raw(&client, &[0, 1, 2]).await;
    // The same PUT with one data frame a byte short: undecodable, nothing stored.
    let mut bad = load(&format!("{name}.put"));
    let short = bad[1].slice(..bad[1].len() - 1);
    bad[1] = short;
    let reply = client.send_frames(bad).await;
    let message = tq_error(&reply, ErrorReply::PutGet);
    assert!(
        message.contains("does not fit its numpy array"),
        "{message}"
    );
    // A whole field of datetimes (rows would be numpy scalars stowd does not
    // pickle): refused with the reason, nothing stored.
    let put = load("numpy_field_1d_f64.put");
    let mut frame0 = put[0].to_vec();
    let at = frame0
        .windows(7)
        .position(|w| w == b"float64")
        .expect("dtype in the meta");
    frame0[at..at + 7].copy_from_slice(b"<M8[ns]");
    let reply = client
        .send_frames(vec![Bytes::from(frame0), put[1].clone()])
        .await;
    let message = tq_error(&reply, ErrorReply::Put);
    assert!(message.contains("one array per row"), "{message}");
    assert_eq!(
        normalised(&get_raw(&client, &[0, 1, 2]).await),
        normalised(&before)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_with_arrays_survive_a_unit_checkpoint() {
    // Each case in its own field at its own indexes; saved, the unit
    // cleared, loaded: every GET equals SimpleStorageUnit's reply again.
    let stowd = Stowd::start("");
    let client = TqClient::new(stowd.unit(0));
    let names = cases();
    let mut placed = Vec::new();
    for (k, name) in names.iter().enumerate() {
        let tq::Request::Put {
            global_indexes,
            fields,
        } = tq::decode_request(&load(&format!("{name}.put"))).unwrap()
        else {
            panic!()
        };
        let offset = 10_000 * k as u64;
        let indexes: Vec<u64> = global_indexes.iter().map(|g| g + offset).collect();
        client.put_ok(&indexes, fields).await;
        placed.push((name.clone(), indexes));
    }
    let path = stowage_tests::temp_dir("tq-values-checkpoint").join("unit.safetensors");
    let path = path.to_string_lossy().into_owned();
    let saved = client
        .request(&tq::Request::SaveCheckpoint { path: path.clone() })
        .await;
    assert_eq!(
        saved,
        tq::Reply::Checkpoint {
            load: false,
            error: None
        }
    );
    for (_, indexes) in &placed {
        client.clear(indexes).await;
    }
    let loaded = client.request(&tq::Request::LoadCheckpoint { path }).await;
    assert_eq!(
        loaded,
        tq::Reply::Checkpoint {
            load: true,
            error: None
        }
    );
    for (name, indexes) in &placed {
        let got = get_raw(&client, indexes).await;
        let golden = load(&format!("{name}.get"));
        assert_eq!(normalised(&got), normalised(&golden), "{name}");
    }
}
