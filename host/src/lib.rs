//! Stowage host runtime: the host owns every byte, policies only decide.
//!
//! | module | what it holds |
//! |---|---|
//! | [`tensor`] | `Tensor`: immutable bytes + dtype/shape, zero-copy rows and strided views (crate `stowage-wire`) |
//! | [`batch`] | `Field` (regular, nested, values), `Value`, `Cell` (crate `stowage-wire`) |
//! | [`plan`] | selection and frame plans: the `stowage-plan` types and rules (re-exported), applied to host `Field`s, and execution against host buffers |
//! | [`policy`] | the `Policy` trait, the built-in, the Wasm runtime (sandbox, lent tensor, contract check), chains (policy spans), the registry |
//! | [`store`] | storage units: the per-field index, columns, rows and runs, capacity in bytes, memory release |
//! | [`manager`] | routing `g % N`, selection per (field, unit), remote units, the live registry |
//! | [`server`] | `stowd`'s services and start-up; `server::errors`, the one error → reply mapping; request spans; `server::exposition`: Prometheus text and the `/metrics` endpoint (hyper) |
//! | [`reload`] | hot reload: the plugin directory watched, plugins checked and swapped in |
//! | [`metrics`] | request, reload and data-path counters, latency histograms (a leaf: imports nothing from the crate) |
//! | [`sys`] | the process itself: resident set size, `malloc_trim` |
//! | [`config`] | the TOML configuration |
//! | [`conformance`] | a plugin against the built-in (`stowd plugin check`, hot reload) |
//! | [`wire`] | crate `stowage-wire`: the TransferQueue 0.1.11 and `stowage/1` codecs, the pickle subset, one bounded msgpack reader; pure, no I/O |
//! | [`transport`] | crate `stowage-transport`: ZMTP 3.0 over tcp and ipc, written here with bounded reads |
//! | [`shm`] | same-node shared memory (segments, leases, spares) |
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

pub mod config;
pub mod conformance;
pub mod extent;
pub mod manager;
pub mod metrics;
pub mod plan;
pub mod policy;
pub mod reload;
pub mod server;
pub mod shm;
pub mod store;
pub mod sys;

// The pure codecs and the data model live in `stowage-wire`, the ZeroMQ
// transport in `stowage-transport`; re-exported so that `crate::wire::...`,
// `crate::tensor::...`, `crate::batch::...` and `crate::transport::...` keep
// their paths.
pub use stowage_transport as transport;
pub use stowage_wire as wire;
pub use stowage_wire::{batch, tensor};
