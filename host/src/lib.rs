//! Stowage host runtime: the host owns every byte, policies only decide.
//!
//! | module | what it holds |
//! |---|---|
//! | [`cache`] | the node-local read cache of peer units' rows: versions asked, only what changed fetched, one transfer shared by concurrent gets |
//! | [`checkpoint`] | unit checkpoints on disk (safetensors files): TransferQueue's `SAVE_STORAGE_CHECKPOINT` and `LOAD_STORAGE_CHECKPOINT`, at a unit or the router |
//! | [`config`] | the TOML configuration (`stowd.example.toml` lists every key) |
//! | [`conformance`] | a plugin against the built-in (`stowd plugin check`, hot reload) |
//! | [`extent`] | extents: the immutable buffers rows live in (a received frame, an adopted segment, a gather's output), their clock and memory and disk totals |
//! | [`journal`] | the journal of indexes put or cleared since a checkpoint, written before each change of a unit, so that a restore never serves an old value silently |
//! | [`manager`] | routing `g % N`, selection per (field, unit), the live registry; `manager::remote`: forwarding to remote TransferQueue units; `manager::peer`: peer units (another `stowd`'s, in `stowage/1`) |
//! | [`metrics`] | request, reload and data-path counters, latency histograms (a leaf: imports nothing from the crate) |
//! | [`plan`] | selection and frame plans: the `stowage-plan` types and rules (re-exported), applied to host `Field`s, and execution against host buffers |
//! | [`policy`] | the `Policy` trait, the built-in, the Wasm runtime (sandbox, lent tensor, contract check), chains (policy spans), the registry and its loading, the compile cache |
//! | [`reload`] | hot reload: the plugin directory watched, plugins checked and swapped in |
//! | [`server`] | `stowd`'s services and start-up: `tq` (unit and router endpoints), `native` (`stowage/1`, with `native::get`, and `native::forward`: a router's get sent on while the peers' rows arrive), `offload` (large requests decoded and run on a bounded blocking pool), `errors` (the one error → reply mapping), `exposition` (Prometheus text, `/metrics` over hyper); request spans |
//! | [`shm`] | same-node shared memory (sealed segments, leases, descriptor channels, memory allocated ahead) |
//! | [`spill`] | spilling the coldest extents to disk when the units' memory runs short, and reading them back |
//! | [`store`] | storage units: the per-field index, columns, rows and runs, capacity in bytes, memory release |
//! | [`sys`] | the process itself: resident set size, `malloc_trim`, start time; the size of a file system |
//! | [`tensor`], [`batch`] | re-exported from `stowage-wire`: `Tensor` (immutable bytes + dtype/shape, zero-copy rows and strided views); `Field`, `Value`, `Cell` |
//! | [`wire`] | re-export of crate `stowage-wire`: the TransferQueue 0.1.11 and `stowage/1` codecs, the pickle subset, one bounded msgpack reader; pure, no I/O |
//! | [`transport`] | re-export of crate `stowage-transport`: ZMTP 3.0 over tcp and ipc with bounded reads, the connection table, the receive pool |
//!
//! The workspace around this crate (the README's "Layout" has the same
//! tree):
//!
//! | crate | path | what it holds | depends on |
//! |---|---|---|---|
//! | `stowage-plan` | `plan/` | plan types, the plan rules, one message per rule | nothing |
//! | `stowage-index` | `index/` | the units' row maps (global index -> u64), optimised even in debug builds | nothing |
//! | `stowage-wire` | `wire/` | the codecs and the data they carry | `bytes`, `rmp`, `thiserror` |
//! | `stowage-transport` | `transport/` | ZeroMQ (ZMTP 3.0), limits, receive pool | tokio |
//! | `stowage-host` | `host/` | this crate, and the `stowd` binary (`src/bin/stowd.rs`) | the four above, wasmtime |
//! | `stowage-guest` | `guest-sdk/` | the policy SDK: traits, `export_policy!`, the test harness | `stowage-plan`, wit-bindgen |
//! | `stowage-tests` | `tests/` | integration tests (one binary), the `stowload` load program | `stowage-host` |
//! | `stowage-fuzz-checks` | `fuzz/checks/` | the fuzz targets' bodies, run over the corpora by the tests | the host crates |
//! | `xtask` | `xtask/` | `cargo xtask` build tasks | std, `sha2`, `object` |
//!
//! Inside each crate the top-level modules import each other one way:
//! `cargo xtask cycles` (run first by `cargo xtask test`) fails on any
//! cycle, and on a module missing from a crate's module table.
//!
//! The policy path: a [`policy::chain::Chain`] asks its policies for a
//! [`plan::SelectionPlan`], validates it with [`plan::validate_selection`],
//! falls back to [`policy::builtin::Builtin`] on any fault, and the caller
//! runs [`plan::execute_selection`], which slices views out of the original
//! buffer and allocates only for gathers and concatenations.
//!
//! Errors are `thiserror` enums (`anyhow` only in the `stowd` binary);
//! tracing makes DEBUG spans per request and per policy call, and only the
//! binary installs a subscriber.

pub mod cache;
pub mod checkpoint;
pub mod config;
pub mod conformance;
pub mod extent;
pub mod journal;
pub mod manager;
pub mod metrics;
pub mod plan;
pub mod policy;
pub mod reload;
pub mod server;
pub mod shm;
pub mod spill;
pub mod store;
pub mod sys;

// The pure codecs and the data model live in `stowage-wire`, the ZeroMQ
// transport in `stowage-transport`; re-exported so that `crate::wire::...`,
// `crate::tensor::...`, `crate::batch::...` and `crate::transport::...` keep
// their paths.
pub use stowage_transport as transport;
pub use stowage_wire as wire;
pub use stowage_wire::{batch, tensor};
