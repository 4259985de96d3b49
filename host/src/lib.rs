//! Stowage host runtime: the host owns every byte, policies only decide.
//!
//! | module | what it holds |
//! |---|---|
//! | [`tensor`] | `Tensor`: immutable bytes + dtype/shape, zero-copy rows and strided views |
//! | [`batch`] | `Field` (regular, nested, values), `Value`, `Cell` |
//! | [`plan`] | selection and frame plans: validation and execution |
//! | [`policy`] | the `Policy` trait, the built-in, the Wasm runtime (sandbox, lent tensor, contract check), chains (policy spans), the registry |
//! | [`store`] | storage units: the per-field index, columns, rows and runs, capacity in bytes, memory release |
//! | [`manager`] | routing `g % N`, selection per (field, unit), remote units, the live registry |
//! | [`server`] | `stowd`'s services and start-up; `server::errors`, the one error → reply mapping; request spans |
//! | [`reload`] | hot reload: the plugin directory watched, plugins checked and swapped in |
//! | [`metrics`] | request counters, latency histograms, the Prometheus `/metrics` endpoint |
//! | [`config`] | the TOML configuration |
//! | [`conformance`] | a plugin against the built-in (`stowd plugin check`, hot reload) |
//! | [`wire`], [`transport`], [`shm`] | codecs, ZeroMQ sockets, same-node shared memory (segments, leases, spares) |
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

pub mod batch;
pub mod config;
pub mod conformance;
pub mod manager;
pub mod metrics;
pub mod plan;
pub mod server;
pub mod shm;
pub mod extent;
pub mod policy;
pub mod reload;
pub mod store;
pub mod tensor;
pub mod transport;
pub mod wire;
