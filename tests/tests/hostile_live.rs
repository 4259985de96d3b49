//! Hostile plugins inside a running stowd: a policy that panics (and so
//! writes to the guest's stderr) or breaks its plan is contained on the
//! request path, whatever the fail strategy, and the server keeps serving.

use std::time::Duration;

use stowage_host::batch::Field;
use stowage_host::wire::native;
use stowage_tests::client::native_error;
use stowage_tests::{NativeClient, Stowd, data, hostile, temp_dir};

fn plugins_with(names: &[&str]) -> std::path::PathBuf {
    let dir = temp_dir("hostile-plugins");
    for name in names {
        std::fs::copy(hostile(name), dir.join(format!("{name}.wasm"))).unwrap();
    }
    dir
}

fn config(plugin: &str, fail: &str) -> String {
    format!(
        "[[chain]]\npattern = \"*\"\nselect = [\"{plugin}\"]\nfail = \"{fail}\"\nmax_faults = 0\n"
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_panicking_plugin_is_rejected_or_replaced_and_the_request_is_answered() {
    let plugins = plugins_with(&["trap", "drop-row"]);
    for plugin in ["trap", "drop-row"] {
        // reject: the request fails with `rejected`, in time, naming the plugin.
        let mut stowd = Stowd::start_with_plugins(&plugins, &config(plugin, "reject"));
        let client = NativeClient::new(stowd.native());
        let x = Field::Regular(data::f32_rows(8, 4, 1));
        let reply = tokio::time::timeout(
            Duration::from_secs(20),
            client.put(&[0, 1, 2, 3, 4, 5, 6, 7], &[("x".into(), x.clone())]),
        )
        .await
        .unwrap_or_else(|_| panic!("{plugin}: no reply (the worker died?)\n{}", stowd.log()));
        let (code, message) = native_error(&reply);
        assert_eq!(code, native::code::REJECTED, "{plugin}: {message}");
        assert!(message.contains(plugin), "{plugin}: {message}");
        // Nothing of the rejected put was stored; the server still answers.
        let reply = client.get(&[0], &["x"]).await;
        assert_eq!(native_error(&reply).0, native::code::KEY_NOT_FOUND);
        stowd.assert_running();
        stowd.stop();

        // fallback: the put succeeds with the built-in's rows, repeatedly.
        let mut stowd = Stowd::start_with_plugins(&plugins, &config(plugin, "fallback"));
        let client = NativeClient::new(stowd.native());
        for round in 0..3u64 {
            let indexes: Vec<u64> = (round * 8..round * 8 + 8).collect();
            let x = Field::Regular(data::f32_rows(8, 4, round));
            client.put_ok(&indexes, &[("x".into(), x.clone())]).await;
            let got = client.get_ok(&indexes, &["x"]).await;
            let got = data::wire_cells(got.into_iter().next().unwrap().1);
            data::assert_cells(plugin, &got, &data::cells(&x));
        }
        assert!(
            client.stat("fallbacks").await >= 3,
            "{plugin}: fallbacks not counted"
        );
        stowd.assert_running();
        stowd.stop();
    }
}
