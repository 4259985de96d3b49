//! Chains: policies asked in order, every answer validated, faults contained.
//!
//! A chain asks its policies one after the other. `not-applicable` (and
//! `invalid-input`) move on to the next policy; the first plan that passes
//! validation wins. A fault (trap, timeout, memory cap, bad handle, a
//! `failed` error, or a plan that fails validation) is counted against the
//! plugin and logged with its name and version; then the chain's
//! [`FailStrategy`] decides: `fallback` answers the built-in plan, `reject`
//! fails the request. A plugin that reached `max_faults` is no longer called.
//! If no policy applies, the built-in answers. Data is never touched here:
//! only plans are.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::builtin::Builtin;
use super::{Policy, PolicyError};
use crate::batch::Field;
use crate::plan::{self, FramePlan, PackLimits, PieceInfo, SelectionPlan, ValidationError};

/// What a chain does after a plugin fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailStrategy {
    /// Answer the built-in plan (same rows, always valid).
    #[default]
    Fallback,
    /// Fail the request with an error naming the plugin.
    Reject,
}

/// Fault and call counters of one loaded plugin, shared by every chain that
/// uses it.
#[derive(Debug, Default)]
pub struct PluginStats {
    pub calls: AtomicU64,
    pub faults: AtomicU64,
    pub invalid_plans: AtomicU64,
    pub disabled: AtomicBool,
}

/// A policy plus its counters.
#[derive(Clone, Debug)]
pub struct Loaded {
    pub policy: Arc<dyn Policy>,
    pub stats: Arc<PluginStats>,
}

impl Loaded {
    pub fn new(policy: Arc<dyn Policy>) -> Loaded {
        Loaded { policy, stats: Arc::new(PluginStats::default()) }
    }
}

/// Why a chain produced no plan.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChainError {
    #[error("nothing to select: the position list is empty")]
    EmptyPositions,
    #[error("plugin \"{plugin}\" version {version} faulted and the chain's fail strategy is reject: {reason}")]
    Rejected { plugin: String, version: String, reason: String },
    #[error("packing failed: {0}")]
    Packing(String),
}

/// Who produced a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecidedBy {
    /// A plugin's plan, validated.
    Plugin(String),
    /// The built-in, because no plugin applied.
    Builtin,
    /// The built-in, because a plugin faulted.
    Fallback { plugin: String },
}

/// A validated plan and where it came from.
#[derive(Clone, Debug)]
pub struct Decision<P> {
    pub plan: P,
    pub by: DecidedBy,
}

/// An ordered list of policies with a fail strategy.
#[derive(Clone, Debug)]
pub struct Chain {
    pub policies: Vec<Loaded>,
    pub fail: FailStrategy,
    /// Faults after which a plugin is no longer called (0 = never stop).
    pub max_faults: u64,
}

/// What the policies of a chain answered.
enum Outcome<P> {
    /// A validated plan from the named plugin.
    Plan(P, String),
    /// The named plugin faulted; the strategy says fall back.
    Fallback(String),
    /// No plugin applied.
    Builtin,
}

impl Chain {
    pub fn new(policies: Vec<Loaded>, fail: FailStrategy, max_faults: u64) -> Chain {
        Chain { policies, fail, max_faults }
    }

    /// A chain of the built-in alone.
    pub fn builtin() -> Chain {
        Chain::new(vec![], FailStrategy::Fallback, 0)
    }

    /// Names of the policies, in order.
    pub fn names(&self) -> Vec<String> {
        self.policies.iter().map(|l| l.policy.describe().name.clone()).collect()
    }

    /// Counts and logs a fault, then applies the fail strategy.
    fn on_fault<P>(&self, loaded: &Loaded, reason: &str) -> Result<Outcome<P>, ChainError> {
        let d = loaded.policy.describe();
        let faults = loaded.stats.faults.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::warn!(plugin = %d.name, version = %d.version, faults, reason, "policy fault");
        if self.max_faults > 0 && faults >= self.max_faults && !loaded.stats.disabled.swap(true, Ordering::Relaxed) {
            tracing::error!(plugin = %d.name, version = %d.version, faults, "plugin disabled after too many faults");
        }
        match self.fail {
            FailStrategy::Fallback => Ok(Outcome::Fallback(d.name.clone())),
            FailStrategy::Reject => Err(ChainError::Rejected {
                plugin: d.name.clone(),
                version: d.version.clone(),
                reason: reason.to_string(),
            }),
        }
    }

    fn ask<P>(
        &self,
        call: impl Fn(&dyn Policy) -> Result<P, PolicyError>,
        check: impl Fn(&P) -> Result<(), ValidationError>,
    ) -> Result<Outcome<P>, ChainError> {
        for loaded in &self.policies {
            if loaded.stats.disabled.load(Ordering::Relaxed) {
                continue;
            }
            loaded.stats.calls.fetch_add(1, Ordering::Relaxed);
            match call(loaded.policy.as_ref()) {
                Ok(plan) => match check(&plan) {
                    Ok(()) => return Ok(Outcome::Plan(plan, loaded.policy.describe().name.clone())),
                    Err(e) => {
                        loaded.stats.invalid_plans.fetch_add(1, Ordering::Relaxed);
                        return self.on_fault(loaded, &format!("invalid plan: {e}"));
                    }
                },
                Err(PolicyError::NotApplicable | PolicyError::InvalidInput(_)) => continue,
                Err(e @ (PolicyError::Failed(_) | PolicyError::Fault(_))) => return self.on_fault(loaded, &e.to_string()),
            }
        }
        Ok(Outcome::Builtin)
    }

    /// A validated selection plan for `positions` of `field`.
    pub fn select(&self, field: &Field, positions: &[u64]) -> Result<Decision<SelectionPlan>, ChainError> {
        if positions.is_empty() {
            return Err(ChainError::EmptyPositions);
        }
        let outcome = self.ask(|p| p.select(field, positions), |plan| plan::validate_selection(field, positions, plan))?;
        let by = match outcome {
            Outcome::Plan(plan, name) => return Ok(Decision { plan, by: DecidedBy::Plugin(name) }),
            Outcome::Fallback(plugin) => DecidedBy::Fallback { plugin },
            Outcome::Builtin => DecidedBy::Builtin,
        };
        let plan = Builtin::plan(field, positions).map_err(|_| ChainError::EmptyPositions)?;
        Ok(Decision { plan, by })
    }

    /// A validated frame plan for `pieces`.
    pub fn pack(&self, pieces: &[PieceInfo], limits: &PackLimits) -> Result<Decision<FramePlan>, ChainError> {
        let outcome = self.ask(|p| p.pack(pieces, limits), |plan| plan::validate_frames(pieces, limits, plan))?;
        let by = match outcome {
            Outcome::Plan(plan, name) => return Ok(Decision { plan, by: DecidedBy::Plugin(name) }),
            Outcome::Fallback(plugin) => DecidedBy::Fallback { plugin },
            Outcome::Builtin => DecidedBy::Builtin,
        };
        let plan = Builtin::frames(pieces, limits).map_err(|e| ChainError::Packing(e.to_string()))?;
        Ok(Decision { plan, by })
    }
}
