//! Stowage host runtime: the host owns every byte, policies only decide.
//!
//! | module | what it holds |
//! |---|---|
//! | [`tensor`] | `Tensor`: immutable bytes + dtype/shape, zero-copy rows and strided views |
//! | [`batch`] | `Field` (regular, nested, values), `Value`, `Cell` |
//! | [`plan`] | selection and frame plans: validation and execution |
//! | [`policy`] | the `Policy` trait, the built-in, the Wasm runtime, chains, the registry |
//! | [`store`] | storage units: one cell per (global index, field), capacity in bytes |
//! | [`manager`] | routing `g % N`, selection per (field, unit), remote units, the live registry |
//! | [`server`] | `stowd`'s services and start-up; `server::exposition`: Prometheus text and the `/metrics` endpoint (hyper) |
//! | [`reload`] | hot reload: the plugin directory watched, plugins checked and swapped in |
//! | [`metrics`] | request, reload and data-path counters, latency histograms (a leaf: imports nothing from the crate) |
//! | [`sys`] | the process itself: resident set size, `malloc_trim` |
//! | [`config`] | the TOML configuration |
//! | [`conformance`] | a plugin against the built-in (`stowd plugin check`, hot reload) |
//! | [`wire`], [`transport`], [`shm`] | codecs, ZeroMQ sockets, same-node shared memory |
//!
//! The policy path: a [`policy::chain::Chain`] asks its policies for a
//! [`plan::SelectionPlan`], validates it with [`plan::validate_selection`],
//! falls back to [`policy::builtin::Builtin`] on any fault, and the caller
//! runs [`plan::execute_selection`], which slices views out of the original
//! buffer and allocates only for gathers and concatenations.

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
pub mod sys;
pub mod tensor;
pub mod transport;
pub mod wire;
