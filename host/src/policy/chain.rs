//! Chains: policies asked in order, every answer validated, faults contained.
//!
//! A chain asks its policies one after the other. `not-applicable` (and
//! `invalid-input`) move on to the next policy; the first plan that passes
//! validation wins. A fault (trap, timeout, memory cap, bad handle, a
//! `failed` error, or a plan that fails validation) is counted against the
//! plugin and logged with its name and version; then the chain's
//! [`FailStrategy`] decides: `fallback` answers the built-in plan, `reject`
//! fails the request. A plugin that reached `max_faults` faults is disabled;
//! with a [`Backoff`] it is re-enabled (on a fresh instance) after a delay
//! that doubles at each further disable up to a cap, without one it stays
//! disabled until its file is reloaded. If no policy applies, the built-in
//! answers. A policy that cannot describe a field (a `stowage:policy@0.1.0`
//! plugin, for a dtype its closed enum has no name for) is skipped for that
//! field's `select` without a call, as if it had declined. Data is never
//! touched here: only plans are.
//!
//! Tracing: every chain call is a `policy` span (`chain` = select or pack,
//! `decided_by` recorded when it ends: `plugin <name>@<version>`,
//! `builtin (no plugin applied)` or `builtin (fallback: <plugin> faulted:
//! <why>)`), and every plugin it asks is a `plugin` span inside it (`plugin`,
//! `version`) holding one DEBUG event with that plugin's answer. Spans and
//! events are at DEBUG: at the default INFO level a call costs one cached
//! level check per span. A chain is called per (field, unit) of a request,
//! never per row.
//!
//! Allocation: a small put's decisions (40 pairs, all memo hits) allocate
//! nothing here but their answer lists. Measured in a release stowd under
//! that put (perf, strace; `docs/benchmarks.md`, "The small put: plugins
//! against the built-in"): a put keeps about 7 KiB, so the worker thread's
//! malloc arena grows on almost every put, an `mprotect` and fresh pages
//! each time, and the first allocation that does not fit pays for it.
//! That was this chain's 5 KiB memo key buffer (allocated even by a chain
//! of no plugins) and its per-request lists (8 inline, 40 used): 12% of
//! stowd's samples, and `policy_ns` of 13-22 µs a put for the built-in
//! against 1.9 µs in the criterion bench. With the keys in a per-thread
//! buffer and the lists inline up to 64 pairs, `policy_ns` a put fell to
//! 4-6 µs (built-in) and 10-11 µs (bundled plugins, memo hits).
//!
//! A put's fields of one layout ask the same question at each unit, and a
//! pure plugin answers the repeats from its memo: [`Answer::Same`], not a
//! copy of the plan. [`Chain::select_many_shared`] keeps them shared (and
//! shares the built-in's plan between requests of one kind at the same
//! positions), so a 32-field put makes 4 plans, not 128: the copies were
//! 128 small allocations a put, 12% of `stowd`'s samples under a 32-field,
//! 4-row put (perf, release build), most of it in glibc's slow path. A
//! repeat comes to what its first answer came to (the same plan for the
//! same layout and positions: valid, or the same fault), and is counted as
//! its own decision.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use smallvec::SmallVec;

use super::builtin::Builtin;
use super::replay::{Counts, Last, Shape};
use super::{Answer, FieldKind, Policy, PolicyError, SelectRequest};
use crate::batch::Field;
use crate::plan::{self, FramePlan, PackLimits, PieceInfo, PlanError, SelectionPlan};

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

/// Re-enabling a disabled plugin: after `initial`, then twice as long at
/// each further disable, never longer than `max`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Backoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Backoff {
    /// The delay before the `n`-th re-enable (0-based).
    pub fn delay(&self, n: u64) -> Duration {
        let factor = 1u32.checked_shl(n.min(31) as u32).unwrap_or(u32::MAX);
        self.initial
            .checked_mul(factor)
            .unwrap_or(self.max)
            .min(self.max)
    }
}

/// Call and fault counters of one plugin version (name and version), shared
/// by every chain that uses it and kept across hot reloads: the counters of
/// a version only ever grow, while it is loaded or not.
#[derive(Debug, Default)]
pub struct PluginStats {
    /// Decisions asked of the plugin: one per (field, unit) pair of a
    /// selection and per packing, whether the plugin was entered for it or
    /// it came from the plugin's memo.
    pub calls: AtomicU64,
    /// Times the host entered the plugin: a `stowage:policy@0.2.0` plugin
    /// answers all of a request's pairs in one entry, a 0.1.0 plugin one
    /// entry per pair; memo hits enter nothing.
    pub entries: AtomicU64,
    /// Decisions answered from the memo of a pure plugin, without a call.
    pub memo_hits: AtomicU64,
    /// Nanoseconds spent in chain calls that entered the plugin (the host's
    /// side included: lending the fields, lowering and lifting, the
    /// sandbox, and the memo lookups of that call). A call answered wholly
    /// from the memo is not timed; [`policy_ns`] counts it.
    pub call_ns: AtomicU64,
    /// Valid plans it answered (the decisions it took).
    pub plans: AtomicU64,
    /// Faults (trap, timeout, memory cap, bad handle, `failed`, invalid plan).
    pub faults: AtomicU64,
    /// Plans that failed validation (also counted in `faults`).
    pub invalid_plans: AtomicU64,
    /// Faults answered by the built-in (`fallback` strategy).
    pub fallbacks: AtomicU64,
    /// Faults that failed the request (`reject` strategy).
    pub rejections: AtomicU64,
    /// True while the plugin is not called (after `max_faults`).
    pub disabled: AtomicBool,
    /// Times the plugin was disabled since it was last loaded.
    pub disables: AtomicU64,
    /// Times it was re-enabled after a backoff.
    pub reenables: AtomicU64,
    /// Faults since it was last enabled (compared with `max_faults`).
    pub recent_faults: AtomicU64,
    /// When a disabled plugin may be called again (None: not before reload).
    reenable_at: Mutex<Option<Instant>>,
}

impl PluginStats {
    /// A fresh start after a reload: enabled, backoff and recent faults
    /// reset; the totals keep counting.
    pub fn reset_on_load(&self) {
        *self.reenable_at.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.recent_faults.store(0, Ordering::Relaxed);
        self.disables.store(0, Ordering::Relaxed);
        self.disabled.store(false, Ordering::Relaxed);
    }

    /// Time left before a disabled plugin is re-enabled (None: enabled, or
    /// disabled until its file changes).
    pub fn reenable_in(&self) -> Option<Duration> {
        if !self.disabled.load(Ordering::Relaxed) {
            return None;
        }
        let at = *self.reenable_at.lock().unwrap_or_else(|p| p.into_inner());
        at.map(|t| t.saturating_duration_since(Instant::now()))
    }

    /// `Some(re-enabled now)` if the plugin may be called now; re-enables a
    /// disabled plugin whose backoff has passed.
    fn callable(&self) -> Option<bool> {
        if !self.disabled.load(Ordering::Relaxed) {
            return Some(false);
        }
        let mut at = self.reenable_at.lock().unwrap_or_else(|p| p.into_inner());
        match *at {
            Some(t) if Instant::now() >= t => {
                *at = None;
                self.recent_faults.store(0, Ordering::Relaxed);
                self.reenables.fetch_add(1, Ordering::Relaxed);
                self.disabled.store(false, Ordering::Relaxed);
                Some(true)
            }
            _ => None,
        }
    }
}

/// A policy plus its counters.
#[derive(Clone, Debug)]
pub struct Loaded {
    pub policy: Arc<dyn Policy>,
    pub stats: Arc<PluginStats>,
    /// The policy's described name, shared by every decision it takes.
    pub name: Arc<str>,
}

impl Loaded {
    pub fn new(policy: Arc<dyn Policy>) -> Loaded {
        Loaded::with_stats(policy, Arc::new(PluginStats::default()))
    }

    /// A policy with the counters of its version.
    pub fn with_stats(policy: Arc<dyn Policy>, stats: Arc<PluginStats>) -> Loaded {
        let name = Arc::from(policy.describe().name.as_str());
        Loaded {
            policy,
            stats,
            name,
        }
    }
}

/// Why a chain produced no plan.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ChainError {
    #[error("nothing to select: the position list is empty")]
    EmptyPositions,
    #[error(
        "plugin \"{plugin}\" version {version} faulted and the chain's fail strategy is reject: {reason}"
    )]
    Rejected {
        plugin: String,
        version: String,
        reason: String,
    },
    #[error("packing failed: {0}")]
    Packing(String),
}

/// Who produced a plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecidedBy {
    /// A plugin's plan, validated.
    Plugin(Arc<str>),
    /// The built-in, because no plugin applied.
    Builtin,
    /// The built-in, because a plugin faulted.
    Fallback { plugin: Arc<str> },
}

/// A validated plan and where it came from.
#[derive(Clone, Debug)]
pub struct Decision<P> {
    pub plan: P,
    pub by: DecidedBy,
}

/// A decision of [`Chain::select_many_shared`]: taken for its request, or
/// the one taken for an earlier request of the same call.
#[derive(Clone, Debug)]
pub enum Shared {
    Decided(Decision<SelectionPlan>),
    /// The decision of the request at this earlier index (always a
    /// [`Shared::Decided`]): the same plan from the same policy, for a
    /// request of the same layout and positions.
    Same(usize),
}

/// An ordered list of policies with a fail strategy.
#[derive(Clone, Debug)]
pub struct Chain {
    pub policies: Vec<Loaded>,
    pub fail: FailStrategy,
    /// Faults after which a plugin is disabled (0 = never).
    pub max_faults: u64,
    /// When a disabled plugin is called again (None: after a reload only).
    pub backoff: Option<Backoff>,
    /// The last selection calls that only read memos, for a call shaped
    /// like one of them ([`super::replay`]).
    last: Last,
}

/// What the policies of a chain answered.
///
/// The plugin's name is borrowed from the chain: a put's many decisions
/// clone it only for the plans they keep (an atomic increment and
/// decrement a request were 13% of the chain's own time on a 10-field put).
enum Outcome<'a, P> {
    /// A validated plan from the named plugin.
    Plan(P, &'a Arc<str>),
    /// The plan of the request at this earlier index, which the named
    /// plugin answered again (a repeated answer, [`Answer::Same`]).
    Same(usize, &'a Arc<str>),
    /// The named plugin faulted (why); the strategy says fall back.
    Fallback(&'a Arc<str>, String),
    /// No plugin applied.
    Builtin,
}

impl<P> Outcome<'_, P> {
    /// Records who decided in the chain call's `policy` span (nothing
    /// when that span is disabled, the default INFO level).
    fn record(&self, span: &tracing::Span, version: impl Fn(&str) -> String) {
        if span.is_disabled() {
            return;
        }
        let by = match self {
            Outcome::Plan(_, name) | Outcome::Same(_, name) => {
                format!("plugin {name}@{}", version(name))
            }
            Outcome::Fallback(name, why) => format!("builtin (fallback: {name} faulted: {why})"),
            Outcome::Builtin => "builtin (no plugin applied)".to_string(),
        };
        span.record("decided_by", by.as_str());
        tracing::debug!(decided_by = %by, "policy decision");
    }
}

/// Nanoseconds this process spent deciding, in every chain: plugin calls,
/// plan validation and the built-in (see [`policy_ns`]).
static POLICY_NS: AtomicU64 = AtomicU64::new(0);

/// Nanoseconds this process has spent in policy decisions (selection and
/// packing, plugins and built-in, validation included) since it started:
/// against the requests' own time, the share of it policies take.
pub fn policy_ns() -> u64 {
    POLICY_NS.load(Ordering::Relaxed)
}

/// Adds the time since `started` to [`policy_ns`] when dropped.
struct Timed(Instant);

/// Time a caller spends in many policy decisions in a row, added to
/// [`policy_ns`] once, when dropped: two clock reads for all of them
/// (see [`Chain::pack_within`]).
pub struct PolicyTime(#[allow(dead_code, reason = "held for its drop")] Timed);

impl PolicyTime {
    /// Starts timing.
    pub fn start() -> PolicyTime {
        PolicyTime(Timed(Instant::now()))
    }
}

impl Drop for Timed {
    fn drop(&mut self) {
        let took = u64::try_from(self.0.elapsed().as_nanos()).unwrap_or(u64::MAX);
        POLICY_NS.fetch_add(took, Ordering::Relaxed);
    }
}

/// `calls` and `plans` of one plugin's answer to a request, added to its
/// [`PluginStats`] once, when dropped: two atomic additions a plugin a
/// request instead of two a (field, unit) pair.
struct Counted<'a> {
    stats: &'a PluginStats,
    calls: u64,
    plans: u64,
}

impl<'a> Counted<'a> {
    fn new(stats: &'a PluginStats) -> Self {
        Counted {
            stats,
            calls: 0,
            plans: 0,
        }
    }
}

impl Drop for Counted<'_> {
    fn drop(&mut self) {
        if self.calls > 0 {
            self.stats.calls.fetch_add(self.calls, Ordering::Relaxed);
        }
        if self.plans > 0 {
            self.stats.plans.fetch_add(self.plans, Ordering::Relaxed);
        }
    }
}

/// The requests of a chain call that repeat the one before them: the
/// same memo key (a put's fields of one layout at one unit's positions,
/// which it asks one after the other), when every plugin of the chain
/// memoizes. Only the first of a run is asked of the plugins; its answer
/// is each repeat's, counted for each as if asked. A put of 10 fields on
/// 4 units asks each plugin 4 requests, not 40: with the bundled chain,
/// the chain's own work was about 16,000 instructions a put more than
/// the built-in's (callgrind, `small_put`), for 40 answers from memos.
///
/// Both lists are slices of one buffer the chain call holds (on the stack
/// for up to 64 requests), indexed directly: through `SmallVec` each
/// access checked whether the list had spilled, about 2,400 instructions
/// of a 10 x 4 put.
struct Repeats<'a> {
    /// The first of each request's run (itself for a first); empty when
    /// no request may repeat.
    first: &'a mut [u32],
    /// For a first, how many requests after it repeat it.
    count: &'a mut [u32],
}

impl<'a> Repeats<'a> {
    /// Repeats for `n` requests in `buf` (none repeating yet), or none at
    /// all (`n` = 0: no request may repeat).
    fn new(buf: &'a mut SmallVec<[u32; 128]>, n: usize) -> Self {
        buf.clear();
        buf.extend(0..n as u32);
        buf.extend(std::iter::repeat_n(0, n));
        let (first, count) = buf.as_mut_slice().split_at_mut(n);
        Repeats { first, count }
    }

    /// Request `i` (> 0) repeats request `i - 1`.
    fn repeat(&mut self, i: usize) {
        let f = self.first[i - 1];
        self.first[i] = f;
        self.count[f as usize] += 1;
    }

    fn is_repeat(&self, i: usize) -> bool {
        self.first.get(i).is_some_and(|&f| f as usize != i)
    }

    /// How many requests repeat the first `i`.
    fn count(&self, i: usize) -> u32 {
        self.count.get(i).copied().unwrap_or(0)
    }

    /// The requests that repeat the first `i`.
    fn of(&self, i: usize) -> std::ops::Range<usize> {
        i + 1..i + 1 + self.count(i) as usize
    }

    /// Repeats `from..` of the first `i` are asked on their own from now.
    fn release(&mut self, i: usize, from: usize) {
        for d in self.of(i).filter(|&d| d >= from) {
            self.first[d] = d as u32;
        }
        self.count[i] = (from - i - 1) as u32;
    }
}

thread_local! {
    /// The memo keys' buffer of this thread's last chain call, kept for the
    /// next one (see [`KeyWords`]).
    static KEY_WORDS: std::cell::Cell<Vec<u64>> = const { std::cell::Cell::new(Vec::new()) };
}

/// A chain call's memo key buffer: this thread's kept buffer, emptied,
/// given back when dropped unless it grew past [`KeyWords::KEEP`] words. A
/// call nested in another (none today) finds it taken and starts a new one.
struct KeyWords(Vec<u64>);

impl KeyWords {
    /// Largest buffer kept between calls (32 KiB).
    const KEEP: usize = 4096;

    fn take() -> Self {
        let mut words = KEY_WORDS.take();
        words.clear();
        KeyWords(words)
    }
}

impl Drop for KeyWords {
    fn drop(&mut self) {
        if self.0.capacity() <= Self::KEEP {
            KEY_WORDS.set(std::mem::take(&mut self.0));
        }
    }
}

/// What one answer of a plugin came to (see `Chain::select_many_shared`).
#[derive(Clone)]
enum Came {
    /// A valid plan, now the outcome of the request at this index.
    Plan(usize),
    /// A plan that failed validation, and why.
    Invalid(String),
    /// `not-applicable` or `invalid-input`.
    Declined(PolicyError),
    /// `failed` or a fault: the reason counted.
    Faulted(String),
}

/// The kind of `field`, as `describe()` lists kinds.
fn kind_of(field: &Field) -> FieldKind {
    match field {
        Field::Regular(_) => FieldKind::Regular,
        Field::Nested(_) => FieldKind::Nested,
        Field::Values(_) => FieldKind::Values,
    }
}

impl Chain {
    /// A chain whose disabled plugins stay disabled until reloaded.
    pub fn new(policies: Vec<Loaded>, fail: FailStrategy, max_faults: u64) -> Chain {
        Chain {
            policies,
            fail,
            max_faults,
            backoff: None,
            last: Last::default(),
        }
    }

    /// Re-enables disabled plugins after `backoff`.
    pub fn with_backoff(mut self, backoff: Option<Backoff>) -> Chain {
        self.backoff = backoff;
        self
    }

    /// Selection calls answered with the decisions of a kept call shaped
    /// like them ([`super::replay`]), since this chain was made.
    pub fn replays(&self) -> u64 {
        self.last.replays()
    }

    /// Whether a caller should give its next selection call's [`Shape`]
    /// (see [`super::replay::Last::wants_shape`]): computing it costs
    /// about as much as a replay saves when no kept shape comes again.
    pub fn wants_shape(&self) -> bool {
        self.last.wants_shape()
    }

    /// The [`Shape`] of a call asking about `fields` at each of `units`
    /// (each unit's fields in `fields`' order), when this chain wants one
    /// ([`Chain::wants_shape`]) and such a call can be kept.
    pub fn shape_of<'a>(
        &self,
        fields: impl ExactSizeIterator<Item = &'a Field>,
        units: impl ExactSizeIterator<Item = &'a [u64]>,
    ) -> Option<Shape> {
        self.wants_shape()
            .then(|| Shape::grid(&self.policies, fields, units))
            .flatten()
    }

    /// A chain of the built-in alone.
    pub fn builtin() -> Chain {
        Chain::new(vec![], FailStrategy::Fallback, 0)
    }

    /// Names of the policies, in order.
    pub fn names(&self) -> Vec<String> {
        self.policies
            .iter()
            .map(|l| l.policy.describe().name.clone())
            .collect()
    }

    /// The version of the policy named `name` in this chain.
    fn version_of(&self, name: &str) -> String {
        let found = self
            .policies
            .iter()
            .map(|l| l.policy.describe())
            .find(|d| d.name == name);
        found.map(|d| d.version.clone()).unwrap_or_default()
    }

    /// Counts and logs a fault, then applies the fail strategy.
    fn on_fault<'a, P>(
        &self,
        loaded: &'a Loaded,
        reason: &str,
    ) -> Result<Outcome<'a, P>, ChainError> {
        let d = loaded.policy.describe();
        let st = &loaded.stats;
        let faults = st.faults.fetch_add(1, Ordering::Relaxed) + 1;
        let recent = st.recent_faults.fetch_add(1, Ordering::Relaxed) + 1;
        tracing::warn!(plugin = %d.name, version = %d.version, faults, reason, "policy fault");
        if self.max_faults > 0 && recent >= self.max_faults {
            // Hold the lock while disabling, so a concurrent re-enable does
            // not interleave.
            let mut at = st.reenable_at.lock().unwrap_or_else(|p| p.into_inner());
            if !st.disabled.swap(true, Ordering::Relaxed) {
                let n = st.disables.fetch_add(1, Ordering::Relaxed);
                *at = self.backoff.map(|b| Instant::now() + b.delay(n));
                match self.backoff {
                    Some(b) => tracing::error!(
                        plugin = %d.name, version = %d.version, faults = recent,
                        reenable_in_ms = b.delay(n).as_millis() as u64,
                        "plugin disabled after too many faults; re-enabled after the backoff"
                    ),
                    None => tracing::error!(
                        plugin = %d.name, version = %d.version, faults = recent,
                        "plugin disabled after too many faults, until its file is reloaded"
                    ),
                }
            }
        }
        match self.fail {
            FailStrategy::Fallback => {
                st.fallbacks.fetch_add(1, Ordering::Relaxed);
                Ok(Outcome::Fallback(&loaded.name, reason.to_string()))
            }
            FailStrategy::Reject => {
                st.rejections.fetch_add(1, Ordering::Relaxed);
                Err(ChainError::Rejected {
                    plugin: d.name.clone(),
                    version: d.version.clone(),
                    reason: reason.to_string(),
                })
            }
        }
    }

    /// Asks each policy in turn until one answers a valid plan (packing;
    /// selection asks a whole request at once, [`Chain::select_many`]).
    /// `call` answers, and whether it entered the policy (false: from its
    /// memo, counted as a memo hit and not timed).
    fn ask<P>(
        &self,
        call: impl Fn(&dyn Policy) -> (Result<P, PolicyError>, bool),
        check: impl Fn(&P) -> Result<(), PlanError>,
    ) -> Result<Outcome<'_, P>, ChainError> {
        for loaded in &self.policies {
            match loaded.stats.callable() {
                None => continue,
                Some(true) => {
                    let d = loaded.policy.describe();
                    tracing::info!(plugin = %d.name, version = %d.version, "plugin re-enabled after its backoff");
                    loaded.policy.reset();
                }
                Some(false) => {}
            }
            loaded.stats.calls.fetch_add(1, Ordering::Relaxed);
            let d = loaded.policy.describe();
            let _plugin =
                tracing::debug_span!("plugin", plugin = %d.name, version = %d.version).entered();
            let started = Instant::now();
            let (answer, entered) = call(loaded.policy.as_ref());
            if entered {
                let took = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                loaded.stats.call_ns.fetch_add(took, Ordering::Relaxed);
                loaded.stats.entries.fetch_add(1, Ordering::Relaxed);
            } else {
                loaded.stats.memo_hits.fetch_add(1, Ordering::Relaxed);
            }
            match answer {
                Ok(plan) => match check(&plan) {
                    Ok(()) => {
                        loaded.stats.plans.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!("answered a valid plan");
                        return Ok(Outcome::Plan(plan, &loaded.name));
                    }
                    Err(e) => {
                        loaded.stats.invalid_plans.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(error = %e, "answered an invalid plan");
                        return self.on_fault(loaded, &format!("invalid plan: {e}"));
                    }
                },
                Err(e @ (PolicyError::NotApplicable | PolicyError::InvalidInput(_))) => {
                    tracing::debug!(answer = %e, "declined");
                    continue;
                }
                Err(e @ (PolicyError::Failed(_) | PolicyError::Fault(_))) => {
                    return self.on_fault(loaded, &e.to_string());
                }
            }
        }
        Ok(Outcome::Builtin)
    }

    /// A validated selection plan for `positions` of `field`.
    pub fn select(
        &self,
        field: &Field,
        positions: &[u64],
    ) -> Result<Decision<SelectionPlan>, ChainError> {
        let mut decided = self.select_many(&[SelectRequest::new(field, positions)])?;
        Ok(decided.pop().expect("one decision per request"))
    }

    /// Whether `p` is skipped for `field` without a call, and why.
    fn skip(p: &dyn Policy, field: &Field, kind: FieldKind) -> Option<&'static str> {
        let d = p.describe();
        // A plugin that lists the kinds (dtypes) it handles is not asked
        // about another: it could only decline.
        if !d.kinds.is_empty() && !d.kinds.contains(&kind) {
            Some("its describe() does not list the field's kind")
        } else if !p.can_describe(field) {
            Some("its contract cannot name the field's dtype")
        } else if !d.dtypes.is_empty() && !d.dtypes.contains(&super::wasm::field_dtype(field)) {
            Some("its describe() does not list the field's dtype")
        } else {
            None
        }
    }

    /// Validated selection plans for every request of one host request,
    /// in order. Each plugin of the chain is asked once about all the
    /// requests still undecided that it handles (one entry into a
    /// `stowage:policy@0.2.0` plugin); a request it declines goes on to the
    /// next plugin, and the built-in decides what none did. Faults are
    /// counted per request, as if each had been its own call.
    pub fn select_many(
        &self,
        requests: &[SelectRequest<'_>],
    ) -> Result<Vec<Decision<SelectionPlan>>, ChainError> {
        let shared = self.select_many_shared(requests, None)?;
        let mut out: Vec<Decision<SelectionPlan>> = Vec::with_capacity(shared.len());
        for d in shared.iter() {
            let d = match d {
                Shared::Decided(d) => d.clone(),
                Shared::Same(j) => out[*j].clone(),
            };
            out.push(d);
        }
        Ok(out)
    }

    /// [`Chain::select_many`], a decision that repeats an earlier one of
    /// the call given as [`Shared::Same`] rather than copied: the many
    /// fields of one layout that a put asks about per unit hold one plan
    /// between them. The policies are asked, and counted, exactly as for
    /// `select_many`.
    ///
    /// `shape`, the requests' [`Shape`] as the caller laid them out (a
    /// put's fields by its units, [`Chain::shape_of`]), lets a call shaped
    /// like one of the last that only read memos take that one's
    /// decisions, counted as asking would have ([`super::replay`]); `None`
    /// always asks.
    pub fn select_many_shared(
        &self,
        requests: &[SelectRequest<'_>],
        shape: Option<Shape>,
    ) -> Result<Arc<Vec<Shared>>, ChainError> {
        if requests.iter().any(|r| r.positions.is_empty()) {
            return Err(ChainError::EmptyPositions);
        }
        let t0 = Instant::now();
        let _timed = Timed(t0);
        // The first plugin asked is timed from the chain's start (one clock
        // read less: a memo hit costs about as much as three reads).
        let mut first_mark = Some(t0);
        let span = tracing::debug_span!(
            "policy",
            chain = "select",
            requests = requests.len(),
            decided_by = tracing::field::Empty
        )
        .entered();
        // A call shaped like one kept takes its decisions again
        // (see `super::replay`); one traced at DEBUG asks, so its log is
        // whole.
        if let Some(s) = &shape
            && span.is_disabled()
            && let Some(decided) = self.last.replay(&self.policies, s)
        {
            return Ok(decided);
        }
        // Whether this call may be kept for the next (only memos read, no
        // fault, no plugin disabled or re-enabled), and each plugin's counts.
        let mut keep = shape.is_some();
        let mut counts: SmallVec<[Counts; 4]> = SmallVec::new();
        if keep {
            counts.resize(self.policies.len(), Counts::default());
        }
        // Inline (on the stack, about 8 KiB in all) for a request of up to
        // 64 pairs: a small put's decisions (10 fields on 4 units: 40)
        // allocate nothing here but the list returned. With 8 inline, the
        // four lists of 40 went to the heap on every put.
        // Filled in place: collected into, the list was returned by value,
        // a copy of all its inline slots.
        let mut outcomes: SmallVec<[Option<Outcome<SelectionPlan>>; 64]> = SmallVec::new();
        outcomes.resize_with(requests.len(), || None);
        // Indexed as a slice (see `Repeats`), as are the lists below.
        let outcomes = outcomes.as_mut_slice();
        // Each request's memo key, encoded once for every pure plugin of
        // the chain (none if no plugin memoizes), into this thread's
        // reused buffer.
        let mut scratch = KeyWords::take();
        let mut keys: SmallVec<[Option<std::ops::Range<usize>>; 64]> = SmallVec::new();
        // Repeats (see `Repeats`): only when every plugin of the chain
        // memoizes, so each would answer a repeat as the request before.
        let memoizing = self.policies.iter().any(|l| l.policy.memoizes());
        let all_memoize = memoizing && self.policies.iter().all(|l| l.policy.memoizes());
        let mut runs: SmallVec<[u32; 128]> = SmallVec::new();
        let mut repeats = Repeats::new(&mut runs, if all_memoize { requests.len() } else { 0 });
        if memoizing {
            keys.resize(requests.len(), None);
            let slots = keys.as_mut_slice();
            for (i, r) in requests.iter().enumerate() {
                // The next field of one layout at the same unit's positions
                // (how a put asks) has the key of the one before.
                if i > 0
                    && let prev = &requests[i - 1]
                    && prev.memo_key.is_none()
                    && r.memo_key.is_none()
                    && std::ptr::eq(prev.positions, r.positions)
                    && let Some(k) = slots[i - 1].clone()
                    && super::wasm::memo::same_layout(prev.field, r.field)
                {
                    slots[i] = Some(k);
                    if all_memoize {
                        repeats.repeat(i);
                    }
                    continue;
                }
                let start = scratch.0.len();
                let encoded = super::wasm::memo::encode(r.field, r.positions, &mut scratch.0);
                slots[i] = encoded.then_some(start..scratch.0.len());
            }
        }
        let words = &scratch.0;
        let keys = keys.as_slice();
        let key_of =
            |i: usize| -> Option<&[u64]> { keys.get(i).and_then(|k| k.clone()).map(|k| &words[k]) };
        // Reused for each plugin: the requests still undecided that it
        // handles, by index and as asked.
        // Made empty and reserved in place: `with_capacity` returned each
        // by value, a copy of its inline slots (three such copies were
        // about 560 instructions of a 10 x 4 put).
        let mut pending: SmallVec<[usize; 64]> = SmallVec::new();
        pending.reserve(requests.len());
        let mut asked: SmallVec<[SelectRequest<'_>; 64]> = SmallVec::new();
        asked.reserve(requests.len());
        // Requests with an outcome: once all have one, the plugins left are
        // not looked at (a put the first plugin decides whole no longer
        // walks its requests once for each plugin after it).
        let mut settled = 0usize;
        for (k, loaded) in self.policies.iter().enumerate() {
            if settled == requests.len() {
                break;
            }
            let d = loaded.policy.describe();
            pending.clear();
            asked.clear();
            // Run by run: a repeat goes with its first (a released one is
            // a first of its own, with no repeats).
            let mut next = 0;
            while let Some(r) = requests.get(next) {
                let i = next;
                next = i + 1 + repeats.count(i) as usize;
                if outcomes[i].is_some() {
                    continue;
                }
                match Self::skip(loaded.policy.as_ref(), r.field, kind_of(r.field)) {
                    Some(why) => {
                        tracing::debug!(plugin = %d.name, version = %d.version, request = i, "skipped: {why}");
                    }
                    None => {
                        pending.push(i);
                        asked.push(SelectRequest {
                            memo_key: r.memo_key.or_else(|| key_of(i)),
                            ..*r
                        });
                    }
                }
            }
            if pending.is_empty() {
                continue;
            }
            match loaded.stats.callable() {
                None => {
                    keep = false;
                    continue;
                }
                Some(true) => {
                    keep = false;
                    tracing::info!(plugin = %d.name, version = %d.version, "plugin re-enabled after its backoff");
                    loaded.policy.reset();
                }
                Some(false) => {}
            }
            let _plugin =
                tracing::debug_span!("plugin", plugin = %d.name, version = %d.version).entered();
            let started = first_mark.take().unwrap_or_else(Instant::now);
            let answered = loaded.policy.select_many(&asked);
            let st = &loaded.stats;
            if answered.entries > 0 {
                // Answers all from the memo are not timed: a clock read
                // costs as much as a fifth of such a decision.
                let took = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                st.call_ns.fetch_add(took, Ordering::Relaxed);
            }
            if answered.entries > 0 {
                st.entries.fetch_add(answered.entries, Ordering::Relaxed);
                keep = false;
            }
            // A repeat of an answer from the memo is one more hit (`missed`
            // is in order: one walk).
            let mut repeated_hits = 0u64;
            if loaded.policy.memoizes() {
                let mut missed = answered.missed.iter().peekable();
                for (at, &i) in pending.iter().enumerate() {
                    if missed.next_if(|&&m| m == at).is_none() {
                        repeated_hits += u64::from(repeats.count(i));
                    }
                }
            }
            let memo_hits = answered.memo_hits + repeated_hits;
            if memo_hits > 0 {
                st.memo_hits.fetch_add(memo_hits, Ordering::Relaxed);
            }
            // `calls` and `plans` are added once for the whole answer (and
            // before a `reject` returns).
            let mut counted = Counted::new(st);
            // What each answer came to, for an answer that repeats it
            // (`Answer::Same`): the same outcome, counted the same.
            let mut came: SmallVec<[Came; 64]> = SmallVec::new();
            came.reserve(pending.len());
            for (&i, answer) in pending.iter().zip(answered.answers) {
                // A plugin disabled by a fault earlier in this answer is
                // not asked again: its remaining answers are dropped, and
                // their requests go on down the chain, as they would have
                // had each been its own call.
                if st.disabled.load(Ordering::Relaxed) {
                    break;
                }
                counted.calls += 1;
                let r = requests[i];
                let answer = match answer {
                    Answer::Same(q) => match came.get(q) {
                        Some(c) => Err(c.clone()),
                        None => Ok(Err(PolicyError::Failed(format!(
                            "answer {} repeats answer {q}, which it does not follow",
                            came.len()
                        )))),
                    },
                    Answer::Own(a) => Ok(a),
                };
                let (outcome, c) = match answer {
                    Ok(Ok(plan)) => match plan::validate_selection(r.field, r.positions, &plan) {
                        Ok(()) => (Some(Outcome::Plan(plan, &loaded.name)), Came::Plan(i)),
                        Err(e) => (None, Came::Invalid(e.to_string())),
                    },
                    Ok(Err(e @ (PolicyError::NotApplicable | PolicyError::InvalidInput(_)))) => {
                        (None, Came::Declined(e))
                    }
                    Ok(Err(e @ (PolicyError::Failed(_) | PolicyError::Fault(_)))) => {
                        (None, Came::Faulted(e.to_string()))
                    }
                    Err(Came::Plan(j)) => (Some(Outcome::Same(j, &loaded.name)), Came::Plan(j)),
                    Err(c) => (None, c),
                };
                outcomes[i] = match &c {
                    Came::Plan(_) => {
                        counted.plans += 1;
                        tracing::debug!(request = i, "answered a valid plan");
                        outcome
                    }
                    Came::Invalid(e) => {
                        st.invalid_plans.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(request = i, error = %e, "answered an invalid plan");
                        Some(self.on_fault(loaded, &format!("invalid plan: {e}"))?)
                    }
                    Came::Declined(answer) => {
                        tracing::debug!(request = i, answer = %answer, "declined");
                        None
                    }
                    Came::Faulted(reason) => Some(self.on_fault(loaded, reason)?),
                };
                settled += usize::from(outcomes[i].is_some());
                // Then the repeats of request i get its answer, each
                // counted as if asked: a call, a plan, an invalid plan or a
                // fault. A plan or a decline is counted for the whole run
                // at once, and a planned run's repeats are left without an
                // outcome: each takes its first's plan when the decisions
                // are made below. If a fault disables the plugin, the
                // repeats left go on down the chain each on its own, as
                // they would have had the plugin been asked about each.
                // (why, whether an invalid plan) of a faulting answer.
                let fault = match &c {
                    Came::Plan(_) => {
                        let n = repeats.count(i);
                        counted.calls += u64::from(n);
                        counted.plans += u64::from(n);
                        settled += n as usize;
                        None
                    }
                    Came::Declined(_) => {
                        counted.calls += u64::from(repeats.count(i));
                        None
                    }
                    Came::Invalid(e) => Some((format!("invalid plan: {e}"), true)),
                    Came::Faulted(reason) => Some((reason.clone(), false)),
                };
                if let Some((why, invalid)) = fault {
                    keep = false;
                    for d in repeats.of(i) {
                        if st.disabled.load(Ordering::Relaxed) {
                            repeats.release(i, d);
                            break;
                        }
                        counted.calls += 1;
                        if invalid {
                            st.invalid_plans.fetch_add(1, Ordering::Relaxed);
                        }
                        outcomes[d] = Some(self.on_fault(loaded, &why)?);
                        settled += 1;
                    }
                }
                came.push(c);
            }
            if let Some(c) = counts.get_mut(k) {
                *c = Counts {
                    calls: counted.calls,
                    plans: counted.plans,
                    memo_hits,
                };
            }
        }
        let mut decided = Vec::with_capacity(requests.len());
        // The last request the built-in decided: a request of the same kind
        // of field at the same positions (one unit's, shared by the fields
        // asked about for it) gets its plan, which depends on nothing else.
        let mut last_builtin: Option<usize> = None;
        // The plan the repeats of the current run take when its first got
        // one (they have no outcome of their own, see above): the request
        // that holds it, and the plugin that gave it.
        let mut run: Option<(usize, &Arc<str>)> = None;
        // Taken in place: moving the list into an iterator copied all of
        // its inline slots (about 2.5 KiB) whatever the count.
        for (i, (r, slot)) in requests.iter().zip(outcomes.iter_mut()).enumerate() {
            let repeat = repeats.is_repeat(i);
            let outcome = match (slot.take(), run) {
                (Some(o), _) => o,
                (None, Some((j, name))) if repeat => Outcome::Same(j, name),
                (None, _) => Outcome::Builtin,
            };
            if !repeat {
                run = match &outcome {
                    Outcome::Plan(_, name) => Some((i, *name)),
                    Outcome::Same(j, name) => Some((*j, *name)),
                    Outcome::Fallback(..) | Outcome::Builtin => None,
                };
            }
            outcome.record(&span, |name| self.version_of(name));
            let by = match outcome {
                Outcome::Plan(plan, name) => {
                    decided.push(Shared::Decided(Decision {
                        plan,
                        by: DecidedBy::Plugin(name.clone()),
                    }));
                    continue;
                }
                Outcome::Same(j, _) => {
                    decided.push(Shared::Same(j));
                    continue;
                }
                Outcome::Fallback(plugin, _) => DecidedBy::Fallback {
                    plugin: plugin.clone(),
                },
                Outcome::Builtin => DecidedBy::Builtin,
            };
            if let Some(j) = last_builtin
                && let Shared::Decided(d) = &decided[j]
                && d.by == by
                && kind_of(requests[j].field) == kind_of(r.field)
                && std::ptr::eq(requests[j].positions, r.positions)
            {
                decided.push(Shared::Same(j));
                continue;
            }
            let plan =
                Builtin::plan(r.field, r.positions).map_err(|_| ChainError::EmptyPositions)?;
            decided.push(Shared::Decided(Decision { plan, by }));
            last_builtin = Some(i);
        }
        let decided = Arc::new(decided);
        if keep && let Some(shape) = shape {
            self.last.keep(&self.policies, shape, &decided, counts);
        }
        Ok(decided)
    }

    /// A validated frame plan for `pieces`.
    pub fn pack(
        &self,
        pieces: &[PieceInfo],
        limits: &PackLimits,
    ) -> Result<Decision<FramePlan>, ChainError> {
        let _timed = Timed(Instant::now());
        self.pack_untimed(pieces, limits)
    }

    /// [`Chain::pack`], its time counted by the caller's `timed`, which
    /// spans all the decisions of a reply: a 32-field get timed each
    /// field's pack by two clock reads of its own (about 150 instructions
    /// and two reads of the clock a field).
    pub fn pack_within(
        &self,
        pieces: &[PieceInfo],
        limits: &PackLimits,
        _timed: &PolicyTime,
    ) -> Result<Decision<FramePlan>, ChainError> {
        self.pack_untimed(pieces, limits)
    }

    /// [`Chain::pack_within`] for a call whose pieces and limits are those
    /// of the call that gave `prev` (the next field of a get, of the same
    /// layout): `prev` again, without asking, when asking could only have
    /// read memos, that is when `prev` came from a plugin or the built-in,
    /// every plugin up to the one that decided is enabled and answers
    /// `pack` from its memo, and the call and the plan are ones the memos
    /// keep (at most `memo::MAX_KEY_PIECES` pieces, a plan of at most
    /// `memo::MAX_PLAN_WORDS` indexes). Each plugin is counted as the memo
    /// would have answered it: a call and a memo hit, and the deciding one
    /// a plan. Otherwise (a fallback, a plugin that would be entered) the
    /// chain is asked.
    ///
    /// Why: a get of many fields of one layout asked the chain once a
    /// field; with the memo, each was a key encoded, a lookup and a plan
    /// validated, about 1,200 instructions a field of a 10-field get.
    pub fn pack_repeat(
        &self,
        pieces: &[PieceInfo],
        limits: &PackLimits,
        timed: &PolicyTime,
        prev: &Decision<FramePlan>,
    ) -> Result<Decision<FramePlan>, ChainError> {
        let upto = match &prev.by {
            DecidedBy::Plugin(name) => self
                .policies
                .iter()
                .position(|l| l.name == *name)
                .map(|i| i + 1),
            DecidedBy::Builtin => Some(self.policies.len()),
            DecidedBy::Fallback { .. } => None,
        };
        let kept = pieces.len() <= super::wasm::memo::MAX_KEY_PIECES
            && super::wasm::memo::keeps_frame_plan(&prev.plan);
        let asked = upto.filter(|_| kept).map(|n| &self.policies[..n]);
        let Some(asked) = asked.filter(|asked| {
            asked
                .iter()
                .all(|l| l.policy.memoizes_pack() && !l.stats.disabled.load(Ordering::Relaxed))
        }) else {
            return self.pack_within(pieces, limits, timed);
        };
        let span =
            tracing::debug_span!("policy", chain = "pack", decided_by = tracing::field::Empty)
                .entered();
        for l in asked {
            l.stats.calls.fetch_add(1, Ordering::Relaxed);
            l.stats.memo_hits.fetch_add(1, Ordering::Relaxed);
        }
        let outcome = match (&prev.by, asked.last()) {
            (DecidedBy::Plugin(_), Some(decider)) => {
                decider.stats.plans.fetch_add(1, Ordering::Relaxed);
                Outcome::<FramePlan>::Same(0, &decider.name)
            }
            _ => Outcome::Builtin,
        };
        outcome.record(&span, |name| self.version_of(name));
        Ok(prev.clone())
    }

    fn pack_untimed(
        &self,
        pieces: &[PieceInfo],
        limits: &PackLimits,
    ) -> Result<Decision<FramePlan>, ChainError> {
        let span =
            tracing::debug_span!("policy", chain = "pack", decided_by = tracing::field::Empty)
                .entered();
        let outcome = self.ask(
            |p| p.pack_answer(pieces, limits),
            |plan| plan::validate_frames(pieces, limits, plan),
        )?;
        outcome.record(&span, |name| self.version_of(name));
        let by = match outcome {
            Outcome::Plan(plan, name) => {
                return Ok(Decision {
                    plan,
                    by: DecidedBy::Plugin(name.clone()),
                });
            }
            Outcome::Fallback(plugin, _) => DecidedBy::Fallback {
                plugin: plugin.clone(),
            },
            Outcome::Builtin | Outcome::Same(..) => DecidedBy::Builtin,
        };
        let plan =
            Builtin::frames(pieces, limits).map_err(|e| ChainError::Packing(e.to_string()))?;
        Ok(Decision { plan, by })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Piece, RowView};
    use crate::tensor::{Dtype, Tensor};
    use bytes::Bytes;

    /// A policy that answers every call with `answers` (as many as asked).
    struct Scripted {
        description: super::super::Description,
        answers: Vec<Answer>,
        /// Says it memoizes (so the chain asks a run's first only).
        memoizes: bool,
        /// Requests asked in all.
        asked: std::sync::atomic::AtomicUsize,
    }

    impl Policy for Scripted {
        fn describe(&self) -> &super::super::Description {
            &self.description
        }
        fn select(&self, _: &Field, _: &[u64]) -> Result<SelectionPlan, PolicyError> {
            unreachable!("asked through select_many")
        }
        fn select_many(&self, requests: &[SelectRequest<'_>]) -> super::super::SelectAnswers {
            self.asked.fetch_add(requests.len(), Ordering::Relaxed);
            super::super::SelectAnswers {
                answers: self.answers[..requests.len()].to_vec(),
                entries: 0,
                memo_hits: 0,
                missed: Vec::new(),
            }
        }
        fn pack(&self, _: &[PieceInfo], _: &PackLimits) -> Result<FramePlan, PolicyError> {
            Err(PolicyError::NotApplicable)
        }
        fn memoizes(&self) -> bool {
            self.memoizes
        }
    }

    fn scripted(
        answers: Vec<Answer>,
        fail: FailStrategy,
        max_faults: u64,
    ) -> (Chain, Arc<PluginStats>) {
        let (chain, stats, _) = scripted_as(answers, fail, max_faults, false);
        (chain, stats)
    }

    /// [`scripted`], memoizing or not, with the policy itself (to count
    /// the requests it was asked).
    fn scripted_as(
        answers: Vec<Answer>,
        fail: FailStrategy,
        max_faults: u64,
        memoizes: bool,
    ) -> (Chain, Arc<PluginStats>, Arc<Scripted>) {
        let policy = Arc::new(Scripted {
            description: super::super::Description::new("scripted", "1.0.0", "test")
                .selects(&[FieldKind::Regular]),
            answers,
            memoizes,
            asked: Default::default(),
        });
        let loaded = Loaded::new(policy.clone());
        let stats = loaded.stats.clone();
        (Chain::new(vec![loaded], fail, max_faults), stats, policy)
    }

    fn field(rows: u64) -> Field {
        let t = Tensor::contiguous(
            Bytes::from(vec![0u8; rows as usize * 8]),
            Dtype::Float32,
            vec![rows, 2],
        );
        Field::Regular(t.unwrap())
    }

    fn view(start: u64) -> SelectionPlan {
        SelectionPlan::single(Piece::View(RowView::single(start)))
    }

    fn counts(s: &PluginStats) -> [u64; 4] {
        [&s.calls, &s.plans, &s.faults, &s.invalid_plans].map(|c| c.load(Ordering::Relaxed))
    }

    /// The plans `select_many` gives for `shared`, and whether they agree.
    fn expanded(chain: &Chain, requests: &[SelectRequest<'_>]) -> Vec<(SelectionPlan, DecidedBy)> {
        chain
            .select_many(requests)
            .unwrap()
            .into_iter()
            .map(|d| (d.plan, d.by))
            .collect()
    }

    #[test]
    fn a_repeated_answer_is_shared_and_counted_as_its_own() {
        let (a, b) = (field(4), field(4));
        let at = [2u64];
        let requests = [
            SelectRequest::new(&a, &at),
            SelectRequest::new(&b, &at),
            SelectRequest::new(&a, &at),
        ];
        let answers = vec![Answer::Own(Ok(view(2))), Answer::Same(0), Answer::Same(1)];
        let (chain, stats) = scripted(answers, FailStrategy::Fallback, 0);
        let shared = chain.select_many_shared(&requests, None).unwrap();
        assert!(matches!(shared[0], Shared::Decided(_)));
        assert!(
            matches!(shared[1..], [Shared::Same(0), Shared::Same(0)]),
            "{shared:?}"
        );
        assert_eq!(counts(&stats), [3, 3, 0, 0]);
        let by = DecidedBy::Plugin("scripted".into());
        assert_eq!(expanded(&chain, &requests), vec![(view(2), by.clone()); 3]);
        assert_eq!(counts(&stats), [6, 6, 0, 0]);
    }

    #[test]
    fn a_repeated_invalid_plan_faults_again_and_a_disabled_plugin_stops_answering() {
        let a = field(4);
        let at = [1u64];
        let requests = [SelectRequest::new(&a, &at); 3];
        // View of row 3 for position 1: invalid, each time it is given.
        let answers = vec![Answer::Own(Ok(view(3))), Answer::Same(0), Answer::Same(1)];
        let (chain, stats) = scripted(answers.clone(), FailStrategy::Fallback, 0);
        let got = expanded(&chain, &requests);
        let fallback = DecidedBy::Fallback {
            plugin: "scripted".into(),
        };
        assert_eq!(got, vec![(view(1), fallback.clone()); 3]);
        assert_eq!(counts(&stats), [3, 0, 3, 3]);
        assert_eq!(stats.fallbacks.load(Ordering::Relaxed), 3);
        // Disabled after 2 faults: the third request goes on to the built-in.
        let (chain, stats) = scripted(answers.clone(), FailStrategy::Fallback, 2);
        let got = expanded(&chain, &requests);
        assert_eq!(got[..2], vec![(view(1), fallback); 2]);
        assert_eq!(got[2], (view(1), DecidedBy::Builtin));
        assert_eq!(counts(&stats), [2, 0, 2, 2]);
        // Reject: the first fault fails the call.
        let (chain, stats) = scripted(answers, FailStrategy::Reject, 0);
        assert!(matches!(
            chain.select_many(&requests),
            Err(ChainError::Rejected { .. })
        ));
        assert_eq!(counts(&stats), [1, 0, 1, 1]);
    }

    /// A memoizing plugin is asked only the first of a run of requests of
    /// one layout at the same positions; each repeat takes its answer and
    /// is counted as if asked. The decisions and counts are those of a
    /// plugin that does not memoize, asked about every request: a plan, a
    /// decline, an invalid plan each time it is given, and one disabled
    /// partway through the run.
    #[test]
    fn a_runs_repeats_are_decided_and_counted_as_if_each_were_asked() {
        let (a, b, c, d) = (field(4), field(4), field(4), field(4));
        let at = [1u64];
        let requests = [
            SelectRequest::new(&a, &at),
            SelectRequest::new(&b, &at),
            SelectRequest::new(&c, &at),
            SelectRequest::new(&d, &at),
        ];
        let fallback = DecidedBy::Fallback {
            plugin: "scripted".into(),
        };
        let plugin = DecidedBy::Plugin("scripted".into());
        // (first answer, max faults, decisions, counts)
        let cases = [
            (Ok(view(1)), 0, vec![plugin; 4], [4, 4, 0, 0]),
            (
                Err(PolicyError::NotApplicable),
                0,
                vec![DecidedBy::Builtin; 4],
                [4, 0, 0, 0],
            ),
            (Ok(view(3)), 0, vec![fallback.clone(); 4], [4, 0, 4, 4]),
            (
                Ok(view(3)),
                3,
                vec![
                    fallback.clone(),
                    fallback.clone(),
                    fallback,
                    DecidedBy::Builtin,
                ],
                [3, 0, 3, 3],
            ),
        ];
        for (first, max_faults, by, want) in cases {
            let said = format!("{first:?}, max_faults {max_faults}");
            let alone: Vec<Answer> = (0..4).map(|_| Answer::Own(first.clone())).collect();
            let (each, each_stats, each_policy) =
                scripted_as(alone, FailStrategy::Fallback, max_faults, false);
            let (memo, memo_stats, memo_policy) = scripted_as(
                vec![Answer::Own(first.clone())],
                FailStrategy::Fallback,
                max_faults,
                true,
            );
            let got = expanded(&memo, &requests);
            assert_eq!(got, expanded(&each, &requests), "{said}");
            assert_eq!(
                got.iter().map(|g| g.1.clone()).collect::<Vec<_>>(),
                by,
                "{said}"
            );
            assert_eq!(counts(&memo_stats), want, "{said}");
            assert_eq!(counts(&each_stats), want, "{said}");
            assert_eq!(memo_policy.asked.load(Ordering::Relaxed), 1, "{said}");
            assert!(each_policy.asked.load(Ordering::Relaxed) >= 3, "{said}");
            // The repeats of a planned run share its first's plan.
            let shared = memo.select_many_shared(&requests, None).unwrap();
            if first.is_ok() && max_faults == 0 && want[1] > 0 {
                assert!(
                    matches!(
                        shared[1..],
                        [Shared::Same(0), Shared::Same(0), Shared::Same(0)]
                    ),
                    "{shared:?}"
                );
            }
        }
    }

    #[test]
    fn a_chain_whose_calls_do_not_repeat_is_given_one_shape_in_eight() {
        use super::super::replay::SAMPLE;
        let chain = Chain::builtin();
        let (a, b) = (field(8), field(4));
        let at: [&[u64]; 2] = [&[0, 2], &[1, 3]];
        let call = |f: &Field| {
            let requests: Vec<_> = at.iter().map(|p| SelectRequest::new(f, p)).collect();
            let shape = chain
                .wants_shape()
                .then(|| Shape::grid(&chain.policies, [f].into_iter(), at.into_iter()))
                .flatten();
            chain.select_many_shared(&requests, shape).unwrap();
        };
        // Calls of two shapes in turn, each kept and replayed.
        for _ in 0..4 {
            call(&a);
            call(&b);
        }
        assert_eq!(chain.replays(), 6);
        // Calls that never repeat a kept shape: after SAMPLE of them, one
        // in SAMPLE is given its shape.
        let given: Vec<bool> = (0..4 * SAMPLE).map(|_| chain.wants_shape()).collect();
        assert!(given[..SAMPLE as usize].iter().all(|&g| g));
        assert_eq!(given.iter().filter(|&&g| g).count() as u32, SAMPLE + 3);
        // A kept shape comes back: the sampled call replays it, and every
        // call is given its shape again.
        while !chain.wants_shape() {}
        let requests: Vec<_> = at.iter().map(|p| SelectRequest::new(&a, p)).collect();
        let shape = Shape::grid(&chain.policies, [&a].into_iter(), at.into_iter());
        chain.select_many_shared(&requests, shape).unwrap();
        assert_eq!(chain.replays(), 7);
        assert!((0..SAMPLE).all(|_| chain.wants_shape()));
    }

    #[test]
    fn built_in_decisions_are_shared_only_for_the_same_positions_and_kind() {
        let (a, b) = (field(4), field(4));
        let nested = Field::Nested(vec![]);
        let (at, same_rows) = ([0u64, 2], [0u64, 2]);
        let requests = [
            SelectRequest::new(&a, &at),
            SelectRequest::new(&b, &at),
            SelectRequest::new(&a, &same_rows),
            SelectRequest::new(&nested, &same_rows),
            SelectRequest::new(&b, &same_rows),
        ];
        let answers = vec![
            Answer::Own(Err(PolicyError::NotApplicable)),
            Answer::Same(0),
            Answer::Own(Err(PolicyError::NotApplicable)),
            Answer::Own(Err(PolicyError::NotApplicable)),
            Answer::Own(Err(PolicyError::NotApplicable)),
        ];
        let (chain, stats) = scripted(answers, FailStrategy::Fallback, 0);
        let shared = chain.select_many_shared(&requests, None).unwrap();
        // [1] repeats [0] (one unit's positions); [2] is other positions
        // with the same values: decided again, as is the nested [3] and
        // [4], which follows it.
        assert!(matches!(shared[1], Shared::Same(0)), "{shared:?}");
        for i in [0, 2, 3, 4] {
            assert!(matches!(shared[i], Shared::Decided(_)), "{i}: {shared:?}");
        }
        // Kinds are checked before the plugin is asked: the nested field is
        // not its to answer (`Description::selects` handles regular only).
        assert_eq!(stats.calls.load(Ordering::Relaxed), 4);
        let got = expanded(&chain, &requests);
        let builtin = |f: &Field, p: &[u64]| (Builtin::plan(f, p).unwrap(), DecidedBy::Builtin);
        let want: Vec<_> = requests
            .iter()
            .map(|r| builtin(r.field, r.positions))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let b = Backoff {
            initial: Duration::from_millis(100),
            max: Duration::from_millis(1000),
        };
        let got: Vec<u128> = (0..6).map(|n| b.delay(n).as_millis()).collect();
        assert_eq!(got, vec![100, 200, 400, 800, 1000, 1000]);
        assert_eq!(b.delay(200), Duration::from_millis(1000));
    }
}
