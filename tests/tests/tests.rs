//! Every integration test, in one binary (a module per file, as ripgrep's
//! `tests/tests.rs` does): each test binary links wasmtime, and linking it
//! once instead of once per file is most of what the test build costs.
//! Run one file's tests with `cargo test -p stowage-tests --test
//! integration stowd::` (module path as a name filter).
//!
//! To add a file: write `tests/tests/NAME.rs` and add `mod NAME;` here.

mod chains;
mod checkpoint;
mod compile_cache;
mod confinement;
mod contract_versions;
mod dedup;
mod dtypes;
mod fuzz_corpora;
mod hostile_live;
mod idle_connections;
mod large_requests;
mod limits;
mod load;
mod multihost;
mod operating;
mod peers;
mod peers_netns;
mod plugin_cli;
mod policy;
mod request_spans;
mod restore;
mod same_user;
mod security;
mod spill;
mod startup;
mod stowd;
mod tq_values;
