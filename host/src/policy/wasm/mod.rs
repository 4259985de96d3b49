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
//! the field into the store's resource table and lends it to the guest as a
//! `borrow<tensor>`; after the call the entry is deleted. A guest that keeps
//! a handle and uses it later traps ("unknown handle index"), which is a
//! fault like any other.
//!
//! | module | what it holds |
//! |---|---|
//! | this file | the sandbox: engine, linker, instances, fuel and memory caps, [`WasmPolicy`] |
//! | `lent` | [`LentField`]: the tensor resource a `select` call lends, and its methods |
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

use super::{Capability, Description, Fault, FieldKind, Policy, PolicyError};
use crate::batch::Field;
use crate::plan::{self, FramePlan, PackLimits, PieceInfo, SelectionPlan};

mod contract;
mod lent;

pub use contract::{ContractError, LoadError, check_contract};
pub use lent::LentField;

mod bindings {
    wasmtime::component::bindgen!({
        path: "../wit/since_v0.1.0",
        world: "policy",
        imports: { default: trappable },
        with: { "stowage:policy/types.tensor": super::LentField },
    });
}

use bindings::exports::stowage::policy::{packing as wpack, selection as wsel};
use bindings::stowage::policy::types as wtypes;

/// Limits applied to every call into a plugin.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SandboxLimits {
    /// Fuel per call (roughly one unit per Wasm instruction).
    pub fuel: u64,
    /// Linear memory cap per instance, in bytes.
    pub memory_bytes: usize,
    /// Largest `read(offset, len)` a guest may ask for, in bytes.
    pub read_cap: u64,
}

impl Default for SandboxLimits {
    fn default() -> Self {
        SandboxLimits {
            fuel: 200_000_000,
            memory_bytes: 64 << 20,
            read_cap: 1 << 20,
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

struct Instance {
    store: Store<HostState>,
    bindings: bindings::Policy,
}

/// A policy backed by a compiled component.
pub struct WasmPolicy {
    description: Description,
    engine: Engine,
    pre: bindings::PolicyPre<HostState>,
    limits: SandboxLimits,
    instance: Mutex<Option<Instance>>,
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
    Engine::new(&config)
}

/// The linker: WASI p2 (all of it, with an empty context) and the tensor
/// resource.
pub fn linker(engine: &Engine) -> wasmtime::Result<Linker<HostState>> {
    let mut linker = Linker::new(engine);
    wasmtime_wasi::p2::add_to_linker_sync(&mut linker)?;
    bindings::Policy::add_to_linker::<HostState, wasmtime::component::HasSelf<HostState>>(
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
        let pre = linker.instantiate_pre(component).map_err(link)?;
        let pre = bindings::PolicyPre::new(pre).map_err(link)?;
        let mut policy = WasmPolicy {
            description: Description {
                name: String::new(),
                version: String::new(),
                summary: String::new(),
                capabilities: vec![],
                kinds: vec![],
            },
            engine: engine.clone(),
            pre,
            limits,
            instance: Mutex::new(None),
        };
        let d = policy
            .call(|inst| {
                let store = &mut inst.store;
                inst.bindings.stowage_policy_meta().call_describe(store)
            })
            .map_err(|f| LoadError::Describe {
                path: path.into(),
                reason: f.to_string(),
            })?;
        policy.description = Description {
            name: d.name,
            version: d.version,
            summary: d.summary,
            capabilities: d
                .capabilities
                .into_iter()
                .map(|c| match c {
                    wtypes::Capability::Selection => Capability::Selection,
                    wtypes::Capability::Packing => Capability::Packing,
                })
                .collect(),
            kinds: d
                .kinds
                .into_iter()
                .map(|k| match k {
                    wtypes::FieldKind::Regular => FieldKind::Regular,
                    wtypes::FieldKind::Nested => FieldKind::Nested,
                    wtypes::FieldKind::Values => FieldKind::Values,
                })
                .collect(),
        };
        Ok(policy)
    }

    /// The limits every call runs under.
    pub fn limits(&self) -> SandboxLimits {
        self.limits
    }

    /// Changes the limits (e.g. a per-plugin override learnt from
    /// `describe()`); the next call runs on a fresh instance under them.
    pub fn set_limits(&mut self, limits: SandboxLimits) {
        self.limits = limits;
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
        let bindings = self
            .pre
            .instantiate(&mut store)
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
        f: impl FnOnce(&mut Instance) -> wasmtime::Result<R> + Send,
    ) -> Result<R, Fault> {
        let mut slot = self.instance.lock().unwrap_or_else(|p| p.into_inner());
        let slot = &mut *slot;
        off_runtime(|| self.call_here(slot, f))
    }

    fn call_here<R>(
        &self,
        slot: &mut Option<Instance>,
        f: impl FnOnce(&mut Instance) -> wasmtime::Result<R>,
    ) -> Result<R, Fault> {
        if slot.is_none() {
            *slot = Some(self.instantiate()?);
        }
        let inst = slot.as_mut().expect("instance present");
        inst.store
            .set_fuel(self.limits.fuel)
            .map_err(|e| Fault::Instantiate(format!("{e:#}")))?;
        match f(inst) {
            Ok(r) => Ok(r),
            Err(e) => {
                let mut fault = fault_of(e);
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

/// Runs `f` where WASI's synchronous host calls may run their own tokio
/// runtime: on this thread when it is outside tokio, on a scoped helper
/// thread when called from a tokio task. (wasmtime-wasi's sync bindings
/// block on tokio internally, e.g. when a guest writes its panic message to
/// stderr; inside a tokio worker that panics with "Cannot start a runtime
/// from within a runtime".)
///
/// On a multi-thread runtime (stowd's) this is `block_in_place`, which lets
/// the closure block on a runtime without a thread spawn; on a
/// current-thread runtime, a scoped thread.
pub fn off_runtime<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Err(_) => f(),
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        Ok(_) => std::thread::scope(|s| s.spawn(f).join())
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
    }
}

fn policy_error(e: wtypes::PolicyError) -> PolicyError {
    match e {
        wtypes::PolicyError::NotApplicable => PolicyError::NotApplicable,
        wtypes::PolicyError::InvalidInput(m) => PolicyError::InvalidInput(m),
        wtypes::PolicyError::Failed(m) => PolicyError::Failed(m),
    }
}

fn host_plan(p: wsel::SelectionPlan) -> SelectionPlan {
    SelectionPlan {
        pieces: p
            .pieces
            .into_iter()
            .map(|piece| match piece {
                wsel::Piece::View(v) => plan::Piece::View(plan::RowView {
                    start: v.start,
                    step: v.step,
                    count: v.count,
                }),
                wsel::Piece::Gather(r) => plan::Piece::Gather(r),
                wsel::Piece::RowViews(r) => plan::Piece::RowViews(r),
                wsel::Piece::Concat(r) => plan::Piece::Concat(r),
            })
            .collect(),
    }
}

impl Policy for WasmPolicy {
    fn describe(&self) -> &Description {
        &self.description
    }

    /// A 0.1.0 plugin cannot be told the dtype of a field of the dtypes
    /// added after it (float8, complex32, ...): the chain skips it for them.
    fn can_describe(&self, field: &Field) -> bool {
        lent::wit_can_name(field)
    }

    fn select(&self, field: &Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        let answer = self
            .call(|inst| {
                let read_cap = inst.store.data().read_cap;
                let lent = LentField {
                    field: field.clone(),
                    read_cap,
                };
                let handle = inst.store.data_mut().table.push(lent)?;
                let borrowed = Resource::new_borrow(handle.rep());
                let result = inst.bindings.stowage_policy_selection().call_select(
                    &mut inst.store,
                    borrowed,
                    positions,
                );
                inst.store.data_mut().table.delete(handle)?;
                result
            })
            .map_err(PolicyError::Fault)?;
        answer.map(host_plan).map_err(policy_error)
    }

    fn reset(&self) {
        *self.instance.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    fn pack(&self, pieces: &[PieceInfo], limits: &PackLimits) -> Result<FramePlan, PolicyError> {
        let wpieces: Vec<wpack::PieceInfo> = pieces
            .iter()
            .map(|p| wpack::PieceInfo {
                byte_len: p.byte_len,
                contiguous: p.contiguous,
            })
            .collect();
        let wlimits = wpack::PackLimits {
            max_frames: limits.max_frames,
            max_frame_bytes: limits.max_frame_bytes,
            small_threshold: limits.small_threshold,
        };
        let answer = self
            .call(|inst| {
                inst.bindings
                    .stowage_policy_packing()
                    .call_pack(&mut inst.store, &wpieces, wlimits)
            })
            .map_err(PolicyError::Fault)?;
        answer
            .map(|p| FramePlan {
                frames: p
                    .frames
                    .into_iter()
                    .map(|f| match f {
                        wpack::Frame::Single(i) => plan::Frame::Single(i),
                        wpack::Frame::Coalesced(v) => plan::Frame::Coalesced(v),
                    })
                    .collect(),
            })
            .map_err(policy_error)
    }
}
