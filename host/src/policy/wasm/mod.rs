//! Policies as sandboxed WebAssembly components (wasmtime component model).
//!
//! Sandbox: a WASI p2 context with no capabilities (no files, network,
//! environment or arguments; clocks frozen at zero; stderr captured into a
//! small in-memory pipe so a guest panic message reaches the host log). Every
//! call runs with a fuel budget (the deadline) and every instance under a
//! linear-memory cap. An instance is reused across calls and replaced only
//! after it faults (a trapped instance can never be entered again).
//!
//! The tensor handle: for the duration of one `select` call the host pushes
//! each field into the store's resource table and lends it to the guest as
//! a `borrow<tensor>`; after the call the entries are deleted. A guest that
//! keeps a handle and uses it later traps ("unknown handle index"), which
//! is a fault like any other.
//!
//! Two contract versions load side by side, linked into one linker (their
//! imports have different names): `stowage:policy@0.1.0`, one `select` call
//! per (field, unit) pair, and `stowage:policy@0.2.0`, one call for all of
//! a request's pairs, with the dtypes a policy handles and whether it is
//! pure (its answers are then memoized, see `memo`).
//!
//! Each contract version has its own module, `since_vX_Y_Z` (as Zed's
//! extension host does): its bindings, the host side of its resource, and
//! its conversions. An older version's types convert into the latest's,
//! and only the latest's convert into the host's; this file dispatches over
//! the versions (`Pre`, `Bindings`), newest first.
//!
//! Dtypes: each version's generated `dtype` enum is matched case by case
//! with the dtype table's [`Dtype`](stowage_plan::Dtype) (`stowage-plan`),
//! never by position; a test reads both WIT files and checks every case
//! against the table.
//!
//! | module | what it holds |
//! |---|---|
//! | this file | the sandbox: engine, linker, instances, fuel and memory caps, [`WasmPolicy`] |
//! | `lent` | [`LentField`]: the field a `select` call lends, and its methods |
//! | `since_v0_2_0` | the latest contract: bindings, the `fields` resource, conversions into host types |
//! | `since_v0_1_0` | the frozen 0.1.0 contract: bindings, the `tensor` resource, conversions into 0.2.0 types |
//! | `memo` | [`memo::Memo`]: the answers of pure policies, by layout and positions (`select`) or by sizes and limits (`pack`) |
//! | `contract` | [`check_contract`] before compiling; [`LoadError`], [`ContractError`] |
//!
//! Errors: wasmtime returns `anyhow::Error` (`wasmtime::Error`); it does not
//! leave this module as such. Call errors become a [`Fault`] (classified,
//! then formatted with `{:#}`), load errors a [`LoadError`] whose `reason`
//! is the formatted chain.

use std::sync::Mutex;
use std::time::Duration;

use wasmtime::component::{Component, Linker, Resource, ResourceTable};
use wasmtime::{Engine, Store, StoreLimits, StoreLimitsBuilder};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxView, WasiView};

use super::{Answer, Description, Fault, Policy, PolicyError, SelectAnswers, SelectRequest};
use crate::batch::Field;
use crate::plan::{FramePlan, PackLimits, PieceInfo, SelectionPlan};

mod contract;
mod enter;
mod lent;
pub mod memo;
mod since_v0_1_0;
mod since_v0_2_0;

use since_v0_2_0 as latest;

pub use contract::{ContractError, LoadError, check_contract};
pub use enter::{WORKER_FUEL, off_runtime};
pub use lent::{LentField, field_dtype};

/// Limits applied to every call into a plugin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SandboxLimits {
    /// Fuel per call (roughly one unit per Wasm instruction).
    pub fuel: u64,
    /// Linear memory cap per instance, in bytes.
    pub memory_bytes: usize,
    /// Largest `read(offset, len)` a guest may ask for, in bytes.
    pub read_cap: u64,
    /// Answers of a pure policy kept for reuse (0: no memo), see `memo`.
    pub memo_entries: usize,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        SandboxLimits {
            fuel: 200_000_000,
            memory_bytes: 64 << 20,
            read_cap: 1 << 20,
            memo_entries: memo::DEFAULT_ENTRIES,
        }
    }
}

/// Store data of one instance.
pub struct HostState {
    wasi: WasiCtx,
    table: ResourceTable,
    limits: StoreLimits,
    stderr: MemoryOutputPipe,
    read_cap: u64,
}

impl WasiView for HostState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// Clocks that never move: a policy has no business reading time.
struct FrozenClock;

impl HostWallClock for FrozenClock {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }
    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

impl HostMonotonicClock for FrozenClock {
    fn resolution(&self) -> u64 {
        1_000_000_000
    }
    fn now(&self) -> u64 {
        0
    }
}

/// Classifies a wasmtime error from a call.
fn fault_of(err: wasmtime::Error) -> Fault {
    if let Some(trap) = err.downcast_ref::<wasmtime::Trap>()
        && *trap == wasmtime::Trap::OutOfFuel
    {
        return Fault::Timeout;
    }
    let text = format!("{err:#}");
    if text.contains("growing memory") || text.contains("memory") && text.contains("limit") {
        return Fault::MemoryCap(text);
    }
    Fault::Trap(text)
}

/// A component's bindings, by the contract version it exports.
enum Bindings {
    V0_2_0(since_v0_2_0::Policy),
    V0_1_0(since_v0_1_0::Policy),
}

/// A linked component, ready to instantiate, by contract version.
enum Pre {
    V0_2_0(since_v0_2_0::PolicyPre<HostState>),
    V0_1_0(since_v0_1_0::PolicyPre<HostState>),
}

struct Instance {
    store: Store<HostState>,
    bindings: Bindings,
}

/// A policy backed by a compiled component.
pub struct WasmPolicy {
    description: Description,
    engine: Engine,
    pre: Pre,
    limits: SandboxLimits,
    instance: Mutex<Option<Instance>>,
    /// Answers of a pure policy (0.2.0 `describe().pure`).
    memo: memo::Memo,
    /// Its `pack` answers: a packing policy sees only sizes and limits, so
    /// a pure one answers a call it has answered before the same way.
    pack_memo: memo::Memo<memo::PackAnswer>,
    /// On the worker, or off the runtime (a plugin whose WASI calls need tokio).
    entry: enter::Entry,
}

impl std::fmt::Debug for WasmPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WasmPolicy")
            .field("description", &self.description)
            .finish()
    }
}

/// Builds the engine every plugin of a registry shares: fuel on, no async.
pub fn engine() -> wasmtime::Result<Engine> {
    let mut config = wasmtime::Config::new();
    config.consume_fuel(true);
    config.wasm_component_model(true);
    // Off already (it defaults to the `component-model-async` cargo
    // feature, which the workspace does not enable), and said so: stores
    // then set up no concurrent-task state and a call takes the
    // synchronous path. Kept off even if a dependency enables the feature.
    config.concurrency_support(false);
    Engine::new(&config)
}

/// The linker: WASI p2 (all of it, with an empty context) and the tensor
/// resource of both contract versions.
pub fn linker(engine: &Engine) -> wasmtime::Result<Linker<HostState>> {
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
    since_v0_1_0::Policy::add_to_linker::<HostState, wasmtime::component::HasSelf<HostState>>(
        &mut linker,
        |s| s,
    )?;
    since_v0_2_0::Policy::add_to_linker::<HostState, wasmtime::component::HasSelf<HostState>>(
        &mut linker,
        |s| s,
    )?;
    Ok(linker)
}

impl WasmPolicy {
    /// Links a compiled component and asks it to describe itself.
    pub fn new(
        engine: &Engine,
        linker: &Linker<HostState>,
        component: &Component,
        limits: SandboxLimits,
        path: &str,
    ) -> Result<WasmPolicy, LoadError> {
        let link = |e: wasmtime::Error| LoadError::Link {
            path: path.into(),
            reason: format!("{e:#}"),
        };
        let instance_pre = linker.instantiate_pre(component).map_err(link)?;
        // The version the component exports decides its bindings; a
        // component exporting neither does not link.
        let pre = match since_v0_2_0::PolicyPre::new(instance_pre.clone()) {
            Ok(pre) => Pre::V0_2_0(pre),
            Err(latest_err) => match since_v0_1_0::PolicyPre::new(instance_pre) {
                Ok(pre) => Pre::V0_1_0(pre),
                Err(_) => return Err(link(latest_err)),
            },
        };
        let mut policy = WasmPolicy {
            description: Description::new("", "", ""),
            engine: engine.clone(),
            pre,
            limits,
            instance: Mutex::new(None),
            memo: memo::Memo::new(limits.memo_entries),
            pack_memo: memo::Memo::new(limits.memo_entries),
            entry: enter::Entry::default(),
        };
        let description = policy
            .call(|inst| {
                let store = &mut inst.store;
                match &inst.bindings {
                    Bindings::V0_2_0(b) => b
                        .stowage_policy_meta()
                        .call_describe(store)
                        .map(latest::description),
                    Bindings::V0_1_0(b) => b
                        .stowage_policy_meta()
                        .call_describe(store)
                        .map(|d| latest::description(d.into())),
                }
            })
            .map_err(|f| LoadError::Describe {
                path: path.into(),
                reason: f.to_string(),
            })?;
        policy.description = description;
        Ok(policy)
    }

    /// The contract version the component speaks: `0.1.0` or `0.2.0`.
    pub fn contract(&self) -> &'static str {
        match self.pre {
            Pre::V0_2_0(_) => since_v0_2_0::VERSION,
            Pre::V0_1_0(_) => since_v0_1_0::VERSION,
        }
    }

    /// Whether calls leave the tokio worker first: only once a call's WASI
    /// host call needed tokio (see `enter`).
    pub fn enters_off_runtime(&self) -> bool {
        self.entry.needs_tokio()
    }

    /// Answers held in the memos, `select`'s and `pack`'s (0 unless the
    /// policy is pure).
    pub fn memo_len(&self) -> usize {
        self.memo.len() + self.pack_memo.len()
    }

    /// The limits every call runs under.
    pub fn limits(&self) -> SandboxLimits {
        self.limits
    }

    /// Changes the limits (e.g. a per-plugin override learnt from
    /// `describe()`); the next call runs on a fresh instance under them.
    pub fn set_limits(&mut self, limits: SandboxLimits) {
        self.limits = limits;
        self.memo = memo::Memo::new(limits.memo_entries);
        self.pack_memo = memo::Memo::new(limits.memo_entries);
        *self.instance.get_mut().unwrap_or_else(|p| p.into_inner()) = None;
    }

    fn instantiate(&self) -> Result<Instance, Fault> {
        let stderr = MemoryOutputPipe::new(4096);
        let wasi = WasiCtx::builder()
            .stderr(stderr.clone())
            .wall_clock(FrozenClock)
            .monotonic_clock(FrozenClock)
            .insecure_random_seed(0)
            .build();
        let limits = StoreLimitsBuilder::new()
            .memory_size(self.limits.memory_bytes)
            .instances(16)
            .trap_on_grow_failure(true)
            .build();
        let state = HostState {
            wasi,
            table: ResourceTable::new(),
            limits,
            stderr,
            read_cap: self.limits.read_cap,
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limits);
        store
            .set_fuel(self.limits.fuel)
            .map_err(|e| Fault::Instantiate(format!("{e:#}")))?;
        let bindings = match &self.pre {
            Pre::V0_2_0(pre) => pre.instantiate(&mut store).map(Bindings::V0_2_0),
            Pre::V0_1_0(pre) => pre.instantiate(&mut store).map(Bindings::V0_1_0),
        }
        .map_err(|e| match fault_of(e) {
            Fault::Trap(t) => Fault::Instantiate(t),
            other => other,
        })?;
        Ok(Instance { store, bindings })
    }

    /// Runs `f` on the (possibly new) instance with a fresh fuel budget; a
    /// fault discards the instance.
    ///
    /// The instance is locked before leaving the runtime: a call waiting for
    /// another to finish waits on its own thread, and only the one running
    /// moves off the runtime. (Waiting inside `block_in_place` made tokio
    /// start a replacement worker per waiter: 517 threads under 64 clients.)
    fn call<R: Send>(
        &self,
        f: impl Fn(&mut Instance) -> wasmtime::Result<R> + Sync,
    ) -> Result<R, Fault> {
        let mut slot = self.instance.lock().unwrap_or_else(|p| p.into_inner());
        self.entry.run(&mut *slot, |slot| self.call_here(slot, &f))
    }

    fn call_here<R>(
        &self,
        slot: &mut Option<Instance>,
        f: impl FnOnce(&mut Instance) -> wasmtime::Result<R>,
    ) -> Result<R, Fault> {
        if enter::was_cut_short() {
            return Err(Fault::Timeout);
        }
        if slot.is_none() {
            *slot = Some(self.instantiate()?);
        }
        let inst = slot.as_mut().expect("instance present");
        inst.store
            .set_fuel(enter::fuel(self.limits.fuel))
            .map_err(|e| Fault::Instantiate(format!("{e:#}")))?;
        match f(inst) {
            Ok(r) => Ok(r),
            Err(e) => {
                let mut fault = fault_of(e);
                if matches!(fault, Fault::Timeout) && enter::cut_short(self.limits.fuel) {
                    *slot = None;
                    return Err(fault);
                }
                let said = inst.store.data().stderr.contents();
                if !said.is_empty()
                    && let Fault::Trap(t) = &mut fault
                {
                    t.push_str(&format!(
                        " (guest stderr: {})",
                        String::from_utf8_lossy(&said).trim()
                    ));
                }
                *slot = None;
                Err(fault)
            }
        }
    }
}

impl WasmPolicy {
    /// Asks the component about `requests` (none memoized): a 0.1.0
    /// component once per request, a 0.2.0 component once for all, on one
    /// instance lock. A fault ends the call: every request it covered gets
    /// it.
    fn ask(
        &self,
        requests: &[SelectRequest<'_>],
    ) -> (Vec<Result<SelectionPlan, PolicyError>>, u64) {
        let pure = self.description.pure;
        let mut slot = self.instance.lock().unwrap_or_else(|p| p.into_inner());
        self.entry.run(&mut *slot, |slot| match &self.pre {
            Pre::V0_1_0(_) => {
                let answers = requests
                    .iter()
                    .map(|r| {
                        self.call_here(slot, |inst| {
                            let lent = LentField {
                                field: r.field.clone(),
                                read_cap: inst.store.data().read_cap,
                                pure,
                            };
                            let handle = inst.store.data_mut().table.push(lent)?;
                            let Bindings::V0_1_0(b) = &inst.bindings else {
                                unreachable!("a 0.1.0 component has 0.1.0 bindings")
                            };
                            let result = b.stowage_policy_selection().call_select(
                                &mut inst.store,
                                Resource::new_borrow(handle.rep()),
                                r.positions,
                            );
                            inst.store.data_mut().table.delete(handle)?;
                            result
                        })
                        .map_err(PolicyError::Fault)
                        .and_then(|a| {
                            a.map(|p| latest::plan(p.into()))
                                .map_err(|e| latest::policy_error(e.into()))
                        })
                    })
                    .collect();
                (answers, requests.len() as u64)
            }
            Pre::V0_2_0(_) => {
                use latest::exports::stowage::policy::selection as wsel;
                let answered = self.call_here(slot, |inst| {
                    let read_cap = inst.store.data().read_cap;
                    // Each distinct field once (a field is asked about for
                    // every unit), numbered in order of first use.
                    let mut lent: Vec<LentField> = Vec::new();
                    let mut layouts = Vec::new();
                    let mut seen: Vec<*const Field> = Vec::new();
                    let mut asked = Vec::with_capacity(requests.len());
                    for r in requests {
                        let n = match seen.iter().position(|&p| std::ptr::eq(p, r.field)) {
                            Some(n) => n,
                            None => {
                                let field = LentField {
                                    field: r.field.clone(),
                                    read_cap,
                                    pure,
                                };
                                layouts.push(latest::layout(&field));
                                lent.push(field);
                                seen.push(r.field);
                                seen.len() - 1
                            }
                        };
                        asked.push(wsel::SelectRequest {
                            field: n as u32,
                            positions: r.positions.to_vec(),
                        });
                    }
                    let handle = inst
                        .store
                        .data_mut()
                        .table
                        .push(lent::LentFields { fields: lent })?;
                    let Bindings::V0_2_0(b) = &inst.bindings else {
                        unreachable!("a 0.2.0 component has 0.2.0 bindings")
                    };
                    let result = b.stowage_policy_selection().call_select(
                        &mut inst.store,
                        Resource::new_borrow(handle.rep()),
                        &layouts,
                        &asked,
                    );
                    inst.store.data_mut().table.delete(handle)?;
                    result
                });
                let answers = match answered {
                    Ok(list) if list.len() == requests.len() => list
                        .into_iter()
                        .map(|a| a.map(latest::plan).map_err(latest::policy_error))
                        .collect(),
                    Ok(list) => {
                        // The instance ran to completion; only its answer is
                        // wrong, like an invalid plan.
                        let fault = Fault::Trap(format!(
                            "select answered {} results for {} requests",
                            list.len(),
                            requests.len()
                        ));
                        vec![Err(PolicyError::Fault(fault)); requests.len()]
                    }
                    Err(fault) => vec![Err(PolicyError::Fault(fault)); requests.len()],
                };
                (answers, 1)
            }
        })
    }
}

impl Policy for WasmPolicy {
    fn describe(&self) -> &Description {
        &self.description
    }

    /// A 0.1.0 plugin cannot be told the dtype of a field of the dtypes
    /// added after it (float8, complex32, ...): the chain skips it for them.
    fn can_describe(&self, field: &Field) -> bool {
        match self.pre {
            Pre::V0_2_0(_) => true,
            Pre::V0_1_0(_) => lent::v0_1_can_name(field),
        }
    }

    fn select(&self, field: &Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        let mut answers = self
            .select_many(&[SelectRequest::new(field, positions)])
            .answers;
        match answers.pop() {
            Some(Answer::Own(answer)) => answer,
            // One request: nothing earlier to repeat.
            Some(Answer::Same(_)) | None => Err(PolicyError::NotApplicable),
        }
    }

    /// Memo hits first (a pure policy), then one call for the rest.
    fn select_many(&self, requests: &[SelectRequest<'_>]) -> SelectAnswers {
        if !self.description.pure || !self.memo.enabled() {
            let (answers, entries) = self.ask(requests);
            return SelectAnswers {
                answers: answers.into_iter().map(Answer::Own).collect(),
                entries,
                memo_hits: 0,
                missed: Vec::new(),
            };
        }
        // Keys the chain did not encode are encoded here, one after the
        // other in one buffer (nothing is allocated when the chain did).
        let mut words: Vec<u64> = Vec::new();
        let mut keys: Vec<Option<std::ops::Range<usize>>> = Vec::new();
        if requests.iter().any(|r| r.memo_key.is_none()) {
            keys.reserve(requests.len());
            for r in requests {
                let start = words.len();
                let encoded =
                    r.memo_key.is_none() && memo::encode(r.field, r.positions, &mut words);
                keys.push(encoded.then_some(start..words.len()));
            }
        }
        let key = |i: usize| -> Option<&[u64]> {
            requests[i]
                .memo_key
                .or_else(|| keys.get(i).and_then(|k| k.clone()).map(|k| &words[k]))
        };
        let mut answers: Vec<Answer> = Vec::with_capacity(requests.len());
        let mut missed = Vec::new();
        {
            let mut memo = self.memo.lock();
            // The last hit's key and answer: a request with the same key
            // (the fields of one layout at one unit's positions, which a
            // put asks one after the other) is answered without a lookup,
            // and without a copy of the answer.
            let mut last: Option<(&[u64], usize)> = None;
            for i in 0..requests.len() {
                let k = key(i);
                if let (Some(k), Some((lk, at))) = (k, last)
                    && (std::ptr::eq(k, lk) || k == lk)
                {
                    answers.push(Answer::Same(at));
                    continue;
                }
                match k.and_then(|k| memo.get(k).map(|hit| (k, hit))) {
                    Some((k, hit)) => {
                        last = Some((k, i));
                        answers.push(Answer::Own(hit));
                    }
                    None => {
                        missed.push(i);
                        // Replaced by the plugin's answer below.
                        answers.push(Answer::Own(Err(PolicyError::NotApplicable)));
                    }
                }
            }
        }
        let memo_hits = (requests.len() - missed.len()) as u64;
        let mut entries = 0;
        if !missed.is_empty() {
            let asked: Vec<SelectRequest<'_>> = missed.iter().map(|&i| requests[i]).collect();
            let (fresh, n) = self.ask(&asked);
            entries = n;
            let mut memo = self.memo.lock();
            for (&i, answer) in missed.iter().zip(fresh) {
                if let Some(k) = key(i) {
                    memo.put(k, &answer);
                }
                answers[i] = Answer::Own(answer);
            }
        }
        SelectAnswers {
            answers,
            entries,
            memo_hits,
            missed,
        }
    }

    fn memoizes(&self) -> bool {
        self.description.pure && self.memo.enabled()
    }

    fn memoizes_pack(&self) -> bool {
        self.description.pure && self.pack_memo.enabled()
    }

    fn reset(&self) {
        *self.instance.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// From the memo for a pure policy that answered the same call before
    /// (a get of many fields of one layout packs each the same way: the
    /// bundled `coalesce` was entered once a field, about 8,500
    /// instructions each, and a 10-field get took 1.9 times the built-in's
    /// instructions in `stowd`). Calls of more than
    /// [`memo::MAX_KEY_PIECES`] pieces are not memoized.
    fn pack_answer(
        &self,
        pieces: &[PieceInfo],
        limits: &PackLimits,
    ) -> (Result<FramePlan, PolicyError>, bool) {
        if !self.description.pure || !self.pack_memo.enabled() {
            return (self.pack(pieces, limits), true);
        }
        let mut key = Vec::new();
        if !memo::encode_pack(pieces, limits, &mut key) {
            return (self.pack(pieces, limits), true);
        }
        if let Some(hit) = self.pack_memo.get(&key) {
            return (hit, false);
        }
        let answer = self.pack(pieces, limits);
        self.pack_memo.put(&key, &answer);
        (answer, true)
    }

    fn pack(&self, pieces: &[PieceInfo], limits: &PackLimits) -> Result<FramePlan, PolicyError> {
        self.call(|inst| {
            let store = &mut inst.store;
            let (p, l) = latest::pack_args(pieces, limits);
            Ok(match &inst.bindings {
                Bindings::V0_2_0(b) => {
                    latest::frames(b.stowage_policy_packing().call_pack(store, &p, l)?)
                }
                Bindings::V0_1_0(b) => {
                    let p: Vec<_> = p.into_iter().map(Into::into).collect();
                    let answer = b.stowage_policy_packing().call_pack(store, &p, l.into())?;
                    latest::frames(answer.map(Into::into).map_err(Into::into))
                }
            })
        })
        .map_err(PolicyError::Fault)?
    }
}

#[cfg(test)]
mod tests {
    use stowage_plan::{Contract, DTYPES, Dtype};

    /// The cases of `enum dtype` in a released WIT file, in order.
    fn wit_dtype_cases(wit: &str) -> Vec<&str> {
        let body = wit
            .split_once("enum dtype {")
            .and_then(|(_, rest)| rest.split_once('}'))
            .expect("the WIT has an `enum dtype`")
            .0;
        body.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with("//"))
            .map(|l| l.trim_end_matches(',').trim_start_matches('%'))
            .collect()
    }

    /// Each released contract's `dtype` enum, case by case, is the dtype
    /// table's rows of that version or older, and the host's `match`es map
    /// each dtype to the generated case of its table name.
    #[test]
    fn the_wit_dtype_enums_are_the_table() {
        let v1 = include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../wit/since_v0.1.0/policy.wit"
        ));
        let v2 = include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../wit/since_v0.2.0/policy.wit"
        ));
        for (contract, wit) in [(Contract::V0_1_0, v1), (Contract::V0_2_0, v2)] {
            let table: Vec<&str> = DTYPES
                .iter()
                .filter(|r| r.since <= contract)
                .map(|r| r.wit)
                .collect();
            assert_eq!(wit_dtype_cases(wit), table, "{}", contract.version());
        }
        let (v1_cases, v2_cases) = (wit_dtype_cases(v1), wit_dtype_cases(v2));
        for row in DTYPES.iter() {
            let d = row.dtype;
            // A generated enum's discriminant is the case's position in
            // the WIT enum.
            let at = |cases: &[&str]| cases.iter().position(|&c| c == row.wit);
            assert_eq!(
                Some(super::since_v0_2_0::dtype(d) as usize),
                at(&v2_cases),
                "{d}"
            );
            assert_eq!(
                super::since_v0_2_0::from_dtype(super::since_v0_2_0::dtype(d)),
                d
            );
            match super::since_v0_1_0::dtype(d) {
                Ok(w) => assert_eq!(Some(w as usize), at(&v1_cases), "{d}"),
                Err(e) => {
                    assert_eq!(row.since, Contract::V0_2_0, "{d}");
                    assert_eq!(
                        e.to_string(),
                        format!("dtype {d:?} has no name in stowage:policy@0.1.0")
                    );
                }
            }
        }
        assert_eq!(
            super::since_v0_1_0::dtype(Dtype::Float8E4m3fn)
                .unwrap_err()
                .to_string(),
            "dtype Float8E4m3fn has no name in stowage:policy@0.1.0"
        );
    }

    #[test]
    fn the_engine_has_no_concurrency_support() {
        // wasmtime 48: no concurrent-task state in a store, the synchronous
        // call path (see `engine`).
        assert!(!super::engine().unwrap().get_concurrency_support());
    }
}
