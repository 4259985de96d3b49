//! Stowage host runtime: the host owns every byte, policies only decide.
//!
//! | module | what it holds |
//! |---|---|
//! | [`auth`] | who may talk to the native endpoint: stowd's token (made once, mode 0600) and the ZMTP PLAIN authenticator over it and `[security] tokens` |
//! | [`cache`] | the node-local read cache of peer units' rows: versions asked, only what changed fetched, one transfer shared by concurrent gets |
//! | [`checkpoint`] | unit checkpoints on disk (safetensors files): TransferQueue's `SAVE_STORAGE_CHECKPOINT` and `LOAD_STORAGE_CHECKPOINT`, at a unit or the router |
//! | [`config`] | the TOML configuration (`stowd.example.toml` lists every key) |
//! | [`conformance`] | a plugin against the built-in (`stowd plugin check`, hot reload) |
//! | [`extent`] | extents: the immutable buffers rows live in (a received frame, an adopted segment, a gather's output), their clock and memory and disk totals |
//! | [`journal`] | the journal of indexes put or cleared since a checkpoint, written before each change of a unit, so that a restore never serves an old value silently |
//! | [`manager`] | routing `g % N`, selection per (field, unit), the live registry; `manager::remote`: forwarding to remote TransferQueue units; `manager::peer`: peer units (another `stowd`'s, in `stowage/1`) |
//! | [`metrics`] | request, reload and data-path counters, latency histograms (a leaf: imports nothing from the crate) |
//! | [`node`] | what a running `stowd` holds, built from the configuration before any socket is bound: plugins, journal, spiller, units, the node's manager and one per unit, the segment store, a restore |
//! | [`plan`] | selection and frame plans: the `stowage-plan` types and rules (re-exported), applied to host `Field`s, and execution against host buffers |
//! | [`policy`] | the `Policy` trait, the built-in, the Wasm runtime (sandbox, lent tensor, contract check), chains (policy spans), the registry and its loading, the compile cache |
//! | [`release`] | giving memory freed by clears, overwrites and spills back to the OS (`malloc_trim` on its own thread, after a pause, a second, or a sixteenth of the units' bound) |
//! | [`reload`] | hot reload: the plugin directory watched, plugins checked and swapped in |
//! | [`server`] | `stowd`'s sockets and services (`Listeners::bind`, `run`): `tq` (unit and router endpoints), `native` (`stowage/1`, with `native::get`, `native::stats`, and `native::forward`: a router's get sent on while the peers' rows arrive), `offload` (large requests decoded and run on a bounded blocking pool), `errors` (the one error → reply mapping), `exposition` (Prometheus text, `/metrics` over hyper); request spans |
//! | [`shm`] | same-node shared memory (sealed segments, leases, descriptor channels, memory allocated ahead) |
//! | [`spill`] | spilling the coldest extents to disk when the units' memory runs short, and reading them back |
//! | [`store`] | storage units: row numbers and each field's entries, columns, rows and runs, capacity in bytes |
//! | [`sys`] | the process itself: resident set size, `malloc_trim`, start time; the size of a file system |
//! | [`tensor`], [`batch`] | re-exported from `stowage-wire`: `Tensor` (immutable bytes + dtype/shape, zero-copy rows and strided views); `Field`, `Value`, `Cell` |
//! | [`wire`] | re-export of crate `stowage-wire`: the TransferQueue 0.1.11 and `stowage/1` codecs, the pickle subset, one bounded msgpack reader; pure, no I/O |
//! | [`transport`] | re-export of crate `stowage-transport`: ZMTP 3.0 over tcp and ipc with bounded reads, the connection table, the receive pool |
//!
//! The workspace around this crate (the README's "Layout" lists the same
//! directories):
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
//!
//! # Where a byte goes
//!
//! A put over tcp, say a `stowage/1` put of one regular field to the native
//! endpoint:
//!
//! 1. **Socket.** `transport::serve_with` runs one task per connection;
//!    `transport::zmtp` reads the ZMTP frames, checking every size the peer
//!    declares against `transport::Limits` before allocating. A frame of
//!    1 MiB or more lands in pages of the receive pool (`transport::pool`),
//!    memory of cleared rows kept for the next frames. The frames are
//!    `Bytes` from here on; nothing below copies them unless a plan says so.
//! 2. **Decode.** [`server`]'s native service decodes frame 0 with
//!    `wire::native` (on `server::offload`'s blocking pool when frame 0 is
//!    16 KiB or more) and wraps the data frames as [`extent`]s
//!    (`extent::Received`): the field's tensor is a view of its frame. A
//!    TransferQueue `PUT` at a unit or the router endpoint takes the same
//!    path through `server::tq` and `wire::tq`.
//! 3. **Plan.** [`manager`] routes global index `g` to unit `g % N` and, for
//!    each (field, unit), asks the field's selection chain
//!    (`policy::chain::Chain::select_many`: plugins in order, a memo for
//!    pure ones, the built-in last) for a plan, validates it and executes
//!    it ([`plan`]): a unit's rows become strided views of the received
//!    frame, or one gathered buffer if the plan copies. `[dedup]` fields are
//!    stored once per distinct row (`manager::dedup`). Rows for remote and
//!    peer units are sent on first (`manager::remote`, `manager::peer`);
//!    local units are written last, so a failed put leaves no unit half new.
//! 4. **Store.** `store::Unit::put` checks the whole put (shape, duplicates,
//!    capacity) under the unit's lock; once a checkpoint exists, [`journal`]
//!    appends the put's indexes and `fdatasync`s them before anything
//!    changes. Each (field, piece) becomes one `store::Column` over its
//!    extent; each index is numbered once in the unit and each (row,
//!    field) is a word in the field's pages of entries (`stowage-index`). With `[units] spill_dir` set, [`spill`] counts the
//!    extents, and writes the coldest to unlinked, mapped files (past the
//!    threshold in the background, past the bound before the put).
//!
//! A same-node put's rows never cross the socket: the client leases a
//! memory file from [`shm`] (its descriptor comes over the client's
//! descriptor channel), writes into it and puts a frame 0 that names it;
//! `shm::SegmentStore::adopt` seals it, it becomes the extent, and steps 3
//! and 4 run on views of it, with no copy in `stowd`.
//!
//! A get runs the other way. The native service decodes it, and [`manager`]
//! asks each unit for the rows: `store::Rows`, runs of consecutive rows of
//! one column (rows of peer units come through [`cache`], which asks their
//! versions and fetches only what changed; a get wholly of peer rows not
//! kept here is streamed through `server::native::forward` as the peers'
//! frames arrive). Then:
//!
//! - **over tcp**, `server::native::get` turns the rows into wire fields
//!   without a copy, the packing chain plans the frames
//!   (`manager::frame_layout`; the default chain's `coalesce` sends large
//!   runs alone and copies small pieces into shared frames), and the reply's frames are
//!   slices of the extents that `transport::zmtp::write_gathered` writes
//!   with `writev`. A TransferQueue `GET` is answered one frame per row, as
//!   its protocol has it;
//! - **same node**, `Manager::get_shared` makes sure every extent the rows
//!   lie in is in a sealed segment (`extent::share_all`: an extent not yet
//!   in one, a received frame or a spill file's mapping, is copied into a
//!   new memory file once, and every later reader gets that file); frame 0
//!   names the segments the rows lie in, each once, and the segments'
//!   read-only descriptors go over the client's descriptor channel
//!   (`shm::channel`, `SCM_RIGHTS`) before the reply. The client maps them:
//!   no byte of the rows crosses a socket.

pub mod auth;
pub mod cache;
pub mod checkpoint;
pub mod config;
pub mod conformance;
pub mod extent;
pub mod journal;
pub mod manager;
pub mod metrics;
pub mod node;
pub mod plan;
pub mod policy;
pub mod release;
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
