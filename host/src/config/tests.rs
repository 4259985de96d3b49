//! Tests of the configuration.

use super::*;

#[test]
fn empty_file_is_the_default() {
    assert_eq!(Config::parse("", "x").unwrap(), Config::default());
}

#[test]
fn errors_name_the_line() {
    let err = Config::parse("[units]\nlocal = 2\ncapacity = 5\n", "stowd.toml").unwrap_err();
    let text = err.to_string();
    assert!(text.starts_with("stowd.toml:3:"), "{text}");
    assert!(text.contains("capacity"), "{text}");
    let err = Config::parse("[units]\nlocal = \"two\"\n", "c.toml")
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("c.toml:2:"), "{err}");
    let err = Config::parse("[router]\nunits = [\"local:5\"]\n", "c.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("local:5"), "{err}");
}

#[test]
fn the_example_file_is_the_default() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../stowd.example.toml");
    assert_eq!(Config::load(&path).unwrap(), Config::default());
}

#[test]
fn chains_parse() {
    let c = Config::parse(
        "[[chain]]\npattern = \"resp*\"\nselect = [\"runs\", \"gather\"]\nfail = \"reject\"\n",
        "c.toml",
    )
    .unwrap();
    assert_eq!(c.chains.len(), 1);
    assert_eq!(c.chains[0].fail, crate::policy::chain::FailStrategy::Reject);
    assert_eq!(c.chains[0].max_faults, 10);
    assert_eq!(c.chains[0].backoff_ms, 1000);
}

#[test]
fn overrides_and_metrics_parse() {
    let c = Config::parse(
        "[plugins.overrides.runs]\nfuel = 5000\n\n[metrics]\nport = 9464\n",
        "c.toml",
    )
    .unwrap();
    let o = &c.plugins.overrides["runs"];
    assert_eq!((o.fuel, o.memory_bytes), (Some(5000), None));
    assert_eq!(o.apply(c.plugins.sandbox()).fuel, 5000);
    assert_eq!(c.metrics.port, 9464);
    let err = Config::parse("[plugins.overrides.runs]\nfule = 5\n", "c.toml")
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("c.toml:2:"), "{err}");
    let err = Config::parse("[plugins.overrides.x]\nmemory_bytes = 10\n", "c.toml")
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "c.toml: plugins.overrides.x.memory_bytes is 10, it must be at least 1 MiB"
    );
}

#[test]
fn memo_entries_parse_with_a_default_and_per_plugin_overrides() {
    let c = Config::parse("", "c.toml").unwrap();
    assert_eq!(
        c.plugins.sandbox().memo_entries,
        crate::policy::wasm::memo::DEFAULT_ENTRIES
    );
    let c = Config::parse(
        "[plugins]\nmemo_entries = 0\n\n[plugins.overrides.runs]\nmemo_entries = 64\n",
        "c.toml",
    )
    .unwrap();
    assert_eq!(c.plugins.sandbox().memo_entries, 0);
    let runs = c.plugins.overrides["runs"].apply(c.plugins.sandbox());
    assert_eq!(runs.memo_entries, 64);
    let err = Config::parse("[plugins]\nmemo_entries = -1\n", "c.toml")
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("c.toml:2:"), "{err}");
}

#[test]
fn invalid_values_are_typed_errors() {
    let problem = |text: &str| match Config::parse(text, "c.toml") {
        Err(ConfigError::Invalid { problem, .. }) => problem,
        other => panic!("{text}: {other:?}"),
    };
    assert_eq!(
        problem("[units]\nlocal = 0\n"),
        Invalid::NoUnits,
        "no local unit and no router units"
    );
    let p = problem("[router]\nunits = [\"local:5\"]\n");
    assert_eq!(
        p.to_string(),
        "router.units: local:5 but units.local is 2 (local units are local:0 to local:1)"
    );
    assert_eq!(
        problem("[router]\nunits = [\"local:x\"]\n"),
        Invalid::BadLocalUnit("local:x".into())
    );
    assert_eq!(
        problem("[router]\nunits = [\"udp://a:1\"]\n"),
        Invalid::BadUnit("udp://a:1".into())
    );
    assert_eq!(
        problem("[limits]\nmax_frames = 1\n").to_string(),
        "limits.max_frames is 1, it must be at least 2"
    );
    let p = problem("[[chain]]\npattern = \"a*\"\nbackoff_ms = 10\nbackoff_max_ms = 5\n");
    assert_eq!(
        p,
        Invalid::Backoff {
            pattern: "a*".into(),
            initial: 10,
            max: 5
        }
    );
}
