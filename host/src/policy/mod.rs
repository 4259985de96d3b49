//! Policies: who decides how rows are selected and packed.
//!
//! The rest of the host sees every policy through the [`Policy`] trait. Two
//! implementations exist: [`builtin::Builtin`], native and always correct,
//! and [`wasm::WasmPolicy`], a sandboxed component loaded from a `.wasm`
//! file. [`chain::Chain`] asks policies in order, validates what they answer
//! and falls back to the built-in on any fault (a call shaped like its last,
//! when that one only read memos, takes its decisions again:
//! [`replay`]); [`registry::Registry`] loads a plugin directory and builds
//! chains per field-name pattern.

pub mod builtin;
pub mod cache;
pub mod chain;
pub mod registry;
pub mod replay;
pub mod wasm;

use crate::batch::Field;
use crate::plan::{FramePlan, PackLimits, PieceInfo, SelectionPlan};

/// What a policy can do, its field kinds and its identity (from its
/// `describe()`): the `stowage-plan` types, shared with the guest SDK.
pub use stowage_plan::{Capability, Description, FieldKind};

/// The first conformance case a plugin failed, and why (one line, at most
/// 400 bytes): [`crate::conformance::verify`]'s refusal, carried by the
/// plugin loader's errors.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{case}{}", why.as_ref().map(|w| format!(": {w}")).unwrap_or_default())]
pub struct Refusal {
    pub case: String,
    pub why: Option<String>,
}

/// Why a call into a policy produced no plan.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PolicyError {
    /// The policy does not handle this input; ask the next one.
    #[error("not applicable")]
    NotApplicable,
    /// The policy says the input is not something it can plan for.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// The policy reported its own failure.
    #[error("policy failed: {0}")]
    Failed(String),
    /// The sandbox stopped the call (trap, timeout, memory cap, bad handle).
    #[error("{0}")]
    Fault(Fault),
}

/// A fault raised by the sandbox, as opposed to an error the policy chose.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Fault {
    #[error("trap: {0}")]
    Trap(String),
    #[error("ran out of fuel (deadline)")]
    Timeout,
    #[error("memory cap reached: {0}")]
    MemoryCap(String),
    #[error("could not instantiate: {0}")]
    Instantiate(String),
}

impl Fault {
    /// Label used in counters and logs.
    pub fn label(&self) -> &'static str {
        match self {
            Fault::Trap(_) => "trap",
            Fault::Timeout => "timeout",
            Fault::MemoryCap(_) => "memory",
            Fault::Instantiate(_) => "instantiate",
        }
    }
}

/// One selection decision to take: the rows at `positions` of `field`.
#[derive(Clone, Copy, Debug)]
pub struct SelectRequest<'a> {
    pub field: &'a Field,
    pub positions: &'a [u64],
    /// The request's memo key (`wasm::memo::encode`), when the chain
    /// encoded it once for all its pure plugins; `None`: not encoded yet,
    /// or not memoizable (see `memo_key`).
    pub memo_key: Option<&'a [u64]>,
}

impl<'a> SelectRequest<'a> {
    /// A request, its memo key not encoded.
    pub fn new(field: &'a Field, positions: &'a [u64]) -> Self {
        SelectRequest {
            field,
            positions,
            memo_key: None,
        }
    }
}

/// One answer of [`Policy::select_many`].
#[derive(Clone, Debug, PartialEq)]
pub enum Answer {
    /// A plan, or why not.
    Own(Result<SelectionPlan, PolicyError>),
    /// The same answer as the earlier request at this index of the same
    /// call, to a request with the same memo key: not a copy (the fields
    /// of one layout at one unit's positions, which a put asks one after
    /// the other).
    Same(usize),
}

/// What [`Policy::select_many`] answered, and what it cost.
#[derive(Debug)]
pub struct SelectAnswers {
    /// One answer per request, in order.
    pub answers: Vec<Answer>,
    /// Times the policy was entered (sandbox calls) to answer them.
    pub entries: u64,
    /// Answers taken from the policy's memo, without a call.
    pub memo_hits: u64,
    /// Of a policy that memoizes, the answers (by index, in order) not
    /// taken from its memo; empty otherwise.
    pub missed: Vec<usize>,
}

/// A selection and packing policy.
///
/// Implementations must be cheap to call concurrently; they never see or
/// return bytes, only layouts and plans. Callers validate every plan.
pub trait Policy: Send + Sync {
    /// Name, version and capabilities.
    fn describe(&self) -> &Description;

    /// False if this policy cannot be asked to select from `field` at all
    /// (a plugin whose contract has no name for the field's dtype); the
    /// chain then skips it without a call.
    fn can_describe(&self, _field: &Field) -> bool {
        true
    }

    /// Plans the rows at `positions` of `field`.
    fn select(&self, field: &Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError>;

    /// Plans every request of one host request: one answer per request, in
    /// order. A policy that can decide them in one call (a
    /// `stowage:policy@0.2.0` plugin) does; the default asks `select` for
    /// each.
    fn select_many(&self, requests: &[SelectRequest<'_>]) -> SelectAnswers {
        SelectAnswers {
            answers: requests
                .iter()
                .map(|r| Answer::Own(self.select(r.field, r.positions)))
                .collect(),
            entries: requests.len() as u64,
            memo_hits: 0,
            missed: Vec::new(),
        }
    }

    /// Groups pieces into frames.
    fn pack(&self, pieces: &[PieceInfo], limits: &PackLimits) -> Result<FramePlan, PolicyError>;

    /// [`Policy::pack`], and whether the policy was entered to answer:
    /// false for an answer from a memo. The default enters it every time.
    fn pack_answer(
        &self,
        pieces: &[PieceInfo],
        limits: &PackLimits,
    ) -> (Result<FramePlan, PolicyError>, bool) {
        (self.pack(pieces, limits), true)
    }

    /// True if the policy answers from a memo keyed by
    /// `wasm::memo::encode`: the chain then encodes each request's key once
    /// for all such policies.
    fn memoizes(&self) -> bool {
        false
    }

    /// True if [`Policy::pack_answer`] answers a call it answered before
    /// from a memo, without entering the policy.
    fn memoizes_pack(&self) -> bool {
        false
    }

    /// Drops any state kept between calls (a sandbox instance), so the next
    /// call starts fresh. Called when a disabled plugin is re-enabled.
    fn reset(&self) {}
}

impl std::fmt::Debug for dyn Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let d = self.describe();
        write!(f, "Policy({} {})", d.name, d.version)
    }
}
