//! Stowage host runtime: the host owns every byte, policies only decide.
//!
//! | module | what it holds |
//! |---|---|
//! | [`tensor`] | `Tensor`: immutable bytes + dtype/shape, zero-copy rows and strided views |
//! | [`batch`] | `Field` (regular, nested, values), `Value`, `Cell` |
//! | [`plan`] | selection and frame plans: validation and execution |
//! | [`policy`] | the `Policy` trait, the built-in, the Wasm runtime, chains, the registry |
//! | [`store`] | storage units: one cell per (global index, field), capacity in bytes |
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
pub mod plan;
pub mod server;
pub mod shm;
pub mod policy;
pub mod store;
pub mod tensor;
pub mod transport;
pub mod wire;
