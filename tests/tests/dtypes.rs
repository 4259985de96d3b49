//! Every dtype TransferQueue 0.1.11 sends by its bytes, stored and served
//! byte for byte by a real `stowd` on both protocols; and the policy chain
//! with real `.wasm` plugins built against `stowage:policy@0.1.0`, whose
//! dtype enum has no name for float8, complex32 or float4: such fields are
//! answered by the built-in, without a call into the plugin.

use stowage_host::batch::{Cell, Field};
use stowage_host::tensor::Dtype;
use stowage_tests::client::stat;
use stowage_tests::data::{assert_cells, expected, nested, tensor, wire_cells};
use stowage_tests::{NativeClient, Stowd, TqClient, prom};

/// The dtypes `stowage:policy@0.1.0` has no name for.
const NEW: [Dtype; 7] = [
    Dtype::Complex32,
    Dtype::Float8E4m3fn,
    Dtype::Float8E4m3fnuz,
    Dtype::Float8E5m2,
    Dtype::Float8E5m2fnuz,
    Dtype::Float8E8m0fnu,
    Dtype::Float4E2m1fnX2,
];

/// A regular `[n, 3]` and a nested field (row 1 empty) of every dtype.
fn every_dtype(n: usize, seed: u64) -> Vec<(String, Field)> {
    let lengths: Vec<u64> = (0..n as u64)
        .map(|i| if i == 1 { 0 } else { (i + seed) % 4 + 1 })
        .collect();
    let mut fields = Vec::new();
    for (k, d) in Dtype::ALL.into_iter().enumerate() {
        let s = seed * 100 + k as u64;
        fields.push((
            format!("r_{d}"),
            Field::Regular(tensor(d, &[n as u64, 3], s)),
        ));
        fields.push((format!("n_{d}"), nested(d, &lengths, s)));
    }
    fields
}

fn names(batch: &[(String, Field)]) -> Vec<&str> {
    batch.iter().map(|(n, _)| n.as_str()).collect()
}

/// Checks a get reply (fields in request order) against the batch put at
/// `put`, for the rows `get`.
fn check(
    what: &str,
    got: &[(String, Vec<Cell>)],
    batch: &[(String, Field)],
    put: &[u64],
    get: &[u64],
) {
    assert_eq!(got.len(), batch.len(), "{what}: field count");
    for ((name, cells), (want_name, field)) in got.iter().zip(batch) {
        assert_eq!(name, want_name, "{what}");
        assert_cells(&format!("{what} {name}"), cells, &expected(field, put, get));
    }
}

async fn native_get(c: &NativeClient, get: &[u64], fields: &[&str]) -> Vec<(String, Vec<Cell>)> {
    let got = c.get_ok(get, fields).await;
    got.into_iter().map(|(n, f)| (n, wire_cells(f))).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dtype_is_stored_and_served_byte_for_byte_on_both_protocols() {
    // The default chains: every seed plugin is asked for what it can name.
    let stowd = Stowd::start("");
    let native = NativeClient::new(stowd.native());
    let router = TqClient::new(stowd.router());
    let unit0 = TqClient::new(stowd.unit(0));

    // stowage/1 in, both protocols out.
    let put_a: Vec<u64> = (0..6).collect();
    let a = every_dtype(6, 1);
    native.put_ok(&put_a, &a).await;
    let get = [5, 0, 3, 3, 1];
    check(
        "native put, native get",
        &native_get(&native, &get, &names(&a)).await,
        &a,
        &put_a,
        &get,
    );
    check(
        "native put, tq router get",
        &router.get_ok(&get, &names(&a)).await,
        &a,
        &put_a,
        &get,
    );
    let even = [4, 0, 2];
    check(
        "native put, tq unit get",
        &unit0.get_ok(&even, &names(&a)).await,
        &a,
        &put_a,
        &even,
    );

    // TransferQueue in (the router and a unit), both protocols out.
    let put_b: Vec<u64> = (100..106).collect();
    let b = every_dtype(6, 2);
    router.put_ok(&put_b, b.clone()).await;
    let get = [105, 100, 102, 101];
    check(
        "tq router put, native get",
        &native_get(&native, &get, &names(&b)).await,
        &b,
        &put_b,
        &get,
    );
    check(
        "tq router put, tq router get",
        &router.get_ok(&get, &names(&b)).await,
        &b,
        &put_b,
        &get,
    );

    let put_c = [200, 202, 204];
    let c = every_dtype(3, 3);
    unit0.put_ok(&put_c, c.clone()).await;
    let get = [204, 200];
    check(
        "tq unit put, tq unit get",
        &unit0.get_ok(&get, &names(&c)).await,
        &c,
        &put_c,
        &get,
    );
    check(
        "tq unit put, native get",
        &native_get(&native, &get, &names(&c)).await,
        &c,
        &put_c,
        &get,
    );

    let rows = 6 + 6 + 3;
    assert_eq!(native.stat("rows").await, rows, "every row stored once");
    stowd.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_0_1_0_plugin_is_skipped_for_dtypes_its_contract_cannot_name() {
    // One plugin, built against 0.1.0 (the kept fixture), and `reject`: had
    // the plugin been entered and faulted on a dtype it cannot name, the
    // put would fail instead of being answered.
    let dir = stowage_tests::temp_dir("dtypes-v0-1");
    std::fs::copy(stowage_tests::plugin_v0_1("runs"), dir.join("runs.wasm")).unwrap();
    let port = stowage_tests::free_port();
    let stowd = Stowd::start_with_plugins(
        &dir,
        &format!(
            "[metrics]\nport = {port}\n\n[[chain]]\npattern = \"*\"\nselect = [\"runs\"]\nfail = \"reject\"\n"
        ),
    );
    let url = stowd.endpoints.metrics.clone().expect("metrics endpoint");
    let calls = || {
        prom::scrape(&url).value_or_zero(
            "stowd_plugin_calls_total",
            &[("plugin", "runs"), ("version", "0.1.0")],
        )
    };
    let native = NativeClient::new(stowd.native());
    let router = TqClient::new(stowd.router());
    let indexes: Vec<u64> = (0..512).collect();
    let decisions = async || {
        let s = native.stats().await;
        [
            stat(&s, "plugin_decisions"),
            stat(&s, "builtin_decisions"),
            stat(&s, "fallbacks"),
        ]
    };

    // A dtype the contract names: the plugin plans both units' halves.
    let before = (decisions().await, calls());
    let f32s = vec![(
        "x".to_string(),
        Field::Regular(tensor(Dtype::Float32, &[512, 4], 1)),
    )];
    native.put_ok(&indexes, &f32s).await;
    let after = (decisions().await, calls());
    assert_eq!(after.0[0] - before.0[0], 2, "plugin decisions: {after:?}");
    assert_eq!(after.1 - before.1, 2.0, "plugin calls");
    // The time in those calls, and in all decisions, is counted.
    let scrape = prom::scrape(&url);
    let in_calls = scrape.value_or_zero(
        "stowd_plugin_call_seconds_total",
        &[("plugin", "runs"), ("version", "0.1.0")],
    );
    let deciding = scrape.value_or_zero("stowd_policy_seconds_total", &[]);
    assert!(
        in_calls > 0.0 && deciding >= in_calls,
        "{in_calls} s in calls, {deciding} s deciding"
    );

    // Each new dtype, on each protocol: the built-in answers, the plugin is
    // never called, nothing faults, and the rows come back byte for byte.
    for (k, d) in NEW.into_iter().enumerate() {
        let name = format!("x_{d}");
        let batch = vec![(
            name.clone(),
            Field::Regular(tensor(d, &[512, 4], 10 + k as u64)),
        )];
        for proto in ["native", "tq"] {
            let before = (decisions().await, calls());
            match proto {
                "native" => native.put_ok(&indexes, &batch).await,
                _ => router.put_ok(&indexes, batch.clone()).await,
            }
            let after = (decisions().await, calls());
            let delta: Vec<i64> = (0..3).map(|i| after.0[i] - before.0[i]).collect();
            assert_eq!(
                delta,
                [0, 2, 0],
                "{d} over {proto}: plugin, builtin, fallback decisions"
            );
            assert_eq!(after.1, before.1, "{d} over {proto}: the plugin was called");
            let get = [511, 0, 256, 7];
            let got = native_get(&native, &get, &[&name]).await;
            check(&format!("{d} over {proto}"), &got, &batch, &indexes, &get);
        }
    }
    assert!(
        stowd
            .log()
            .contains("skipped: its contract cannot name the field's dtype"),
        "{}",
        stowd.log()
    );

    // The 0.1.0 dtypes still go to the plugin afterwards.
    let before = calls();
    native.put_ok(&indexes, &f32s).await;
    assert_eq!(calls() - before, 2.0);
    stowd.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_0_2_0_plugin_decides_the_dtypes_0_1_0_could_not_name() {
    let stowd = Stowd::start(
        "[[chain]]\npattern = \"*\"\nselect = [\"constant-stride\"]\nfail = \"reject\"\n",
    );
    let native = NativeClient::new(stowd.native());
    let indexes: Vec<u64> = (0..512).collect();
    for (k, d) in NEW.into_iter().enumerate() {
        let name = format!("x_{d}");
        let batch = vec![(
            name.clone(),
            Field::Regular(tensor(d, &[512, 4], 30 + k as u64)),
        )];
        let before = stat(&native.stats().await, "plugin_decisions");
        native.put_ok(&indexes, &batch).await;
        let after = stat(&native.stats().await, "plugin_decisions");
        assert_eq!(
            after - before,
            2,
            "{d}: the plugin planned both units' rows"
        );
        let get = [511, 0, 256, 7];
        let got = native_get(&native, &get, &[&name]).await;
        check(&format!("{d}"), &got, &batch, &indexes, &get);
    }
    stowd.stop();
}
