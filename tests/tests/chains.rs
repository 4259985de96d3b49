//! Chain entries and the structured `stats` reply, through the real binary.
//!
//! 1. A chain entry that names no loaded plugin (here the file name
//!    `constant_stride`, where the `describe()` name is `constant-stride`)
//!    stops `stowd serve` and `stowd config` with a non-zero exit and a
//!    message naming the loaded plugins and the closest name; on hot reload
//!    it is a WARN, `stowd_chain_missing_entries` and the `stats` reply
//!    count it, and requests are still served.
//! 2. The native `stats` reply gives each plugin and chain as a map of
//!    numbers, booleans, strings and lists, and `stowd plugin list` prints
//!    it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use stowage_host::batch::Field;
use stowage_host::tensor::Dtype;
use stowage_host::wire::native::Stat;
use stowage_tests::client::stat;
use stowage_tests::data::{assert_cells, cells, tensor, wire_cells};
use stowage_tests::process::{START_TIMEOUT, stowd_bin};
use stowage_tests::{NativeClient, Stowd, plugin, prom, shared_cache, temp_dir};

/// A plugin directory: `constant-stride` under its file name with an
/// underscore, `runs` and `coalesce`.
fn plugins() -> PathBuf {
    let dir = temp_dir("chain-plugins");
    std::fs::copy(plugin("constant-stride"), dir.join("constant_stride.wasm")).unwrap();
    for name in ["runs", "coalesce"] {
        std::fs::copy(plugin(name), dir.join(format!("{name}.wasm"))).unwrap();
    }
    dir
}

/// A config file using `plugins` and the shared compile cache, then `chains`.
fn config_file(plugins: &Path, chains: &str) -> PathBuf {
    let path = temp_dir("chain-config").join("stowd.toml");
    let text = format!(
        "[plugins]\ndir = \"{}\"\ncache_dir = \"{}\"\n\n{chains}",
        plugins.display(),
        shared_cache().display()
    );
    std::fs::write(&path, text).unwrap();
    path
}

/// Runs `stowd args...` to its exit (killed after [`START_TIMEOUT`]);
/// returns its exit code, stdout and stderr.
fn run_to_exit(args: &[&str]) -> (Option<i32>, String, String) {
    let dir = temp_dir("chain-run");
    let (out, err) = (dir.join("stdout"), dir.join("stderr"));
    let mut child = Command::new(stowd_bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .spawn()
        .expect("start stowd");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if started.elapsed() > START_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "stowd {args:?} still running after {START_TIMEOUT:?}:\n{}",
                std::fs::read_to_string(&err).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
    let result = (status.code(), read(&out), read(&err));
    let _ = std::fs::remove_dir_all(&dir);
    result
}

const MISSPELT: &str = "[[chain]]\npattern = \"*\"\nselect = [\"constant_stride\", \"runs\"]\n\
                        pack = [\"coalesce\", \"runs\"]\n";

/// What both refusals must say: each bad entry, the closest name, the
/// loaded plugins of the needed kind.
fn assert_names_the_problem(stderr: &str) {
    let want = [
        "stowd: error: 2 chain entries name no loaded plugin",
        "describe() names, not file names",
        "chain \"*\" select entry \"constant_stride\" names no loaded plugin \
         (closest: \"constant-stride\"); loaded selection plugins: constant-stride, runs",
        "chain \"*\" pack entry \"runs\" is loaded but is not a packing plugin; \
         loaded packing plugins: coalesce",
    ];
    for w in want {
        assert!(stderr.contains(w), "missing {w:?} in:\n{stderr}");
    }
}

#[test]
fn a_misspelt_chain_entry_stops_stowd_at_start() {
    let dir = plugins();
    let config = config_file(&dir, MISSPELT);
    let endpoints = config.with_file_name("endpoints.json");
    let args = [
        "serve",
        "--config",
        config.to_str().unwrap(),
        "--endpoints-file",
        endpoints.to_str().unwrap(),
    ];
    let (code, _, stderr) = run_to_exit(&args);
    assert_eq!(code, Some(1), "{stderr}");
    assert_names_the_problem(&stderr);
    assert!(!endpoints.exists(), "it served before refusing");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stowd_config_refuses_a_misspelt_chain_entry_and_accepts_the_fix() {
    let dir = plugins();
    let config = config_file(&dir, MISSPELT);
    let (code, stdout, stderr) = run_to_exit(&["config", "--config", config.to_str().unwrap()]);
    assert_eq!(code, Some(1), "{stderr}");
    assert_names_the_problem(&stderr);
    assert!(stdout.is_empty(), "printed a refused config:\n{stdout}");

    // The describe() names pass, and the effective config is printed.
    let fixed = "[[chain]]\npattern = \"*\"\nselect = [\"constant-stride\", \"runs\"]\n\
                 pack = [\"coalesce\"]\n";
    let config = config_file(&dir, fixed);
    let (code, stdout, stderr) = run_to_exit(&["config", "--config", config.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("[[chain]]"), "{stdout}");
    assert!(stdout.contains("\"constant-stride\""), "{stdout}");

    // A chain that allows missing entries starts with them skipped.
    let allowed = format!("{MISSPELT}allow_missing = true\n");
    let config = config_file(&dir, &allowed);
    let (code, _, stderr) = run_to_exit(&["config", "--config", config.to_str().unwrap()]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stderr.contains("skipped until a plugin of that name is loaded (allow_missing)"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The value of `key` in the stats reply.
fn entry<'a>(stats: &'a [(String, Stat)], key: &str) -> &'a Stat {
    stats
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no {key} in {stats:?}"))
}

/// A list of strings in a map value.
fn strs<'a>(map: &'a Stat, key: &str) -> Vec<&'a str> {
    map.get(key)
        .and_then(Stat::as_strs)
        .unwrap_or_else(|| panic!("{key} is not a list of str in {map:?}"))
}

async fn wait_for_stat(client: &NativeClient, key: &str, value: i64) -> Vec<(String, Stat)> {
    let started = Instant::now();
    loop {
        let stats = client.stats().await;
        if stat(&stats, key) == value {
            return stats;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{key} never reached {value}: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A put and get of a stride-2 field, checked row for row.
async fn served(client: &NativeClient, seed: u64) {
    let indexes: Vec<u64> = (seed * 64..seed * 64 + 64).collect();
    let x = Field::Regular(tensor(Dtype::Float32, &[64, 4], seed));
    client.put_ok(&indexes, &[("x".into(), x.clone())]).await;
    let got = client.get_ok(&indexes, &["x"]).await;
    let got = wire_cells(got.into_iter().next().unwrap().1);
    assert_cells("x", &got, &cells(&x));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_entry_lost_on_reload_is_a_warning_and_a_metric() {
    let dir = plugins();
    std::fs::rename(
        dir.join("constant_stride.wasm"),
        dir.join("constant-stride.wasm"),
    )
    .unwrap();
    let port = stowage_tests::free_port();
    let config = format!(
        "[metrics]\nport = {port}\n\n[[chain]]\npattern = \"*\"\n\
         select = [\"constant-stride\", \"runs\"]\npack = [\"coalesce\"]\n"
    );
    let stowd = Stowd::start_with_plugins(&dir, &config);
    let url = format!("http://127.0.0.1:{port}/metrics");
    let client = NativeClient::new(stowd.native());
    let gauge = || prom::scrape(&url).value("stowd_chain_missing_entries", &[]);
    assert_eq!(stat(&client.stats().await, "missing_chain_entries"), 0);
    assert_eq!(gauge(), 0.0);

    // The file goes: the entry is missing, the reload still happens.
    std::fs::remove_file(dir.join("constant-stride.wasm")).unwrap();
    let stats = wait_for_stat(&client, "plugin_removals", 1).await;
    assert_eq!(stat(&stats, "missing_chain_entries"), 1, "{stats:?}");
    let chain = entry(&stats, "chain.*");
    assert_eq!(strs(chain, "select"), ["runs"]);
    assert_eq!(strs(chain, "missing_select"), ["constant-stride"]);
    assert!(strs(chain, "missing_pack").is_empty());
    assert_eq!(gauge(), 1.0);
    let log = stowd.full_log();
    let warning = log
        .lines()
        .find(|l| l.contains("select entry \"constant-stride\" names no loaded plugin"))
        .unwrap_or_else(|| panic!("no warning in:\n{log}"));
    assert!(warning.contains("WARN"), "{warning}");
    assert!(
        warning.contains("loaded selection plugins: runs"),
        "{warning}"
    );
    // Requests are served meanwhile (by runs and the built-in).
    served(&client, 1).await;

    // Back under another file name: the chain entry is the describe() name,
    // so it is live again.
    let tmp = dir.join(".cs.tmp");
    std::fs::copy(plugin("constant-stride"), &tmp).unwrap();
    std::fs::rename(&tmp, dir.join("constant_stride.wasm")).unwrap();
    let stats = wait_for_stat(&client, "plugin_swaps", 1).await;
    assert_eq!(stat(&stats, "missing_chain_entries"), 0, "{stats:?}");
    let chain = entry(&stats, "chain.*");
    assert_eq!(strs(chain, "select"), ["constant-stride", "runs"]);
    assert!(strs(chain, "missing_select").is_empty());
    assert_eq!(gauge(), 0.0);
    assert!(stowd.full_log().contains("chain entry is live again"));
    served(&client, 2).await;
    stowd.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stats_reply_is_structured() {
    let config = "[[chain]]\npattern = \"*\"\nselect = [\"single-row\", \"constant-stride\", \"runs\"]\n\
                  pack = [\"coalesce\"]\nfail = \"reject\"\nmax_faults = 3\nbackoff_ms = 0\n";
    let stowd = Stowd::start(config);
    let client = NativeClient::new(stowd.native());
    // A stride-2 field over 2 units: constant-stride answers once per unit.
    served(&client, 0).await;
    let stats = client.stats().await;

    for (key, value) in &stats {
        let Some(name) = key.strip_prefix("plugin.") else {
            continue;
        };
        let Stat::Map(entries) = value else {
            panic!("{key} is not a map: {value:?}")
        };
        for (k, v) in entries {
            let ok = match k.as_str() {
                "version" => matches!(v, Stat::Str(_)),
                "capabilities" => v.as_strs().is_some(),
                "disabled" => matches!(v, Stat::Bool(_)),
                _ => matches!(v, Stat::Int(n) if *n >= 0),
            };
            assert!(ok, "plugin {name}: {k} is {v:?}");
        }
    }
    let cs = entry(&stats, "plugin.constant-stride");
    assert_eq!(cs.get("version"), Some(&Stat::Str("0.1.0".into())));
    assert_eq!(strs(cs, "capabilities"), ["select"]);
    let int = |m: &Stat, k: &str| m.get(k).and_then(Stat::as_int).unwrap();
    assert_eq!((int(cs, "calls"), int(cs, "plans")), (2, 2), "{cs:?}");
    assert_eq!((int(cs, "faults"), int(cs, "fallbacks")), (0, 0), "{cs:?}");
    assert_eq!(cs.get("disabled"), Some(&Stat::Bool(false)));
    assert_eq!(cs.get("reenable_in_ms"), None, "only while disabled");
    // single-row is asked first and declines a 32-row selection.
    let single = entry(&stats, "plugin.single-row");
    assert_eq!((int(single, "calls"), int(single, "plans")), (2, 0));
    assert_eq!(
        strs(entry(&stats, "plugin.coalesce"), "capabilities"),
        ["pack"]
    );

    let chain = entry(&stats, "chain.*");
    assert_eq!(
        strs(chain, "select"),
        ["single-row", "constant-stride", "runs"]
    );
    assert_eq!(strs(chain, "pack"), ["coalesce"]);
    assert_eq!(chain.get("fail"), Some(&Stat::Str("reject".into())));
    assert_eq!(int(chain, "max_faults"), 3);
    assert_eq!(
        (int(chain, "backoff_ms"), int(chain, "backoff_max_ms")),
        (0, 0)
    );
    assert_eq!(chain.get("allow_missing"), Some(&Stat::Bool(false)));
    assert!(strs(chain, "missing_select").is_empty() && strs(chain, "missing_pack").is_empty());
    assert_eq!(entry(&stats, "missing_chain_entries"), &Stat::Int(0));

    // `stowd plugin list` prints the same figures.
    let out = Command::new(stowd_bin())
        .args(["plugin", "list", "--endpoint", stowd.native()])
        .output()
        .expect("run stowd plugin list");
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{listing}");
    let want = [
        "constant-stride: version 0.1.0 (select) calls 2 plans 2 faults 0 invalid_plans 0 \
         fallbacks 0 rejections 0 reenables 0",
        "coalesce: version 0.1.0 (pack) calls ",
        "chain *: select [single-row, constant-stride, runs] pack [coalesce] fail reject \
         max_faults 3 backoff none",
    ];
    for w in want {
        assert!(
            listing.lines().any(|l| l.starts_with(w)),
            "no line {w:?} in:\n{listing}"
        );
    }
    stowd.stop();
}
