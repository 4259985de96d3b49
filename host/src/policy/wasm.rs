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

use std::sync::Mutex;
use std::time::Duration;

use wasmtime::component::{Component, Linker, Resource, ResourceTable};
use wasmtime::{Engine, Store, StoreLimits, StoreLimitsBuilder};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{HostMonotonicClock, HostWallClock, WasiCtx, WasiCtxView, WasiView};

use super::{Capability, Description, Fault, FieldKind, Policy, PolicyError};
use crate::batch::Field;
use crate::plan::{self, FramePlan, PackLimits, PieceInfo, SelectionPlan};

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
        SandboxLimits { fuel: 200_000_000, memory_bytes: 64 << 20, read_cap: 1 << 20 }
    }
}

/// A field lent to a guest for one call.
pub struct LentField {
    field: Field,
    read_cap: u64,
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
        WasiCtxView { ctx: &mut self.wasi, table: &mut self.table }
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

fn field_kind(field: &Field) -> wtypes::FieldKind {
    match field {
        Field::Regular(_) => wtypes::FieldKind::Regular,
        Field::Nested(_) => wtypes::FieldKind::Nested,
        Field::Values(_) => wtypes::FieldKind::Values,
    }
}

fn wit_dtype(d: crate::tensor::DType) -> wtypes::Dtype {
    use crate::tensor::DType as D;
    use wtypes::Dtype as W;
    match d {
        D::Bool => W::Bool,
        D::U8 => W::Uint8,
        D::I8 => W::Int8,
        D::I16 => W::Int16,
        D::U16 => W::Uint16,
        D::I32 => W::Int32,
        D::U32 => W::Uint32,
        D::I64 => W::Int64,
        D::U64 => W::Uint64,
        D::F16 => W::Float16,
        D::BF16 => W::Bfloat16,
        D::F32 => W::Float32,
        D::F64 => W::Float64,
        D::Complex64 => W::Complex64,
        D::Complex128 => W::Complex128,
    }
}

impl LentField {
    fn row_byte_lens(&self) -> Vec<u64> {
        match &self.field {
            Field::Regular(t) => vec![t.row_bytes() as u64; t.rows() as usize],
            Field::Nested(rows) => rows.iter().map(|t| t.payload_len() as u64).collect(),
            Field::Values(v) => v.iter().map(|v| v.byte_len() as u64).collect(),
        }
    }

    /// Copies a range of the field's logical byte stream (rows in order).
    fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, wtypes::ReadError> {
        if len > self.read_cap {
            return Err(wtypes::ReadError::OverCap(self.read_cap));
        }
        let lens = self.row_byte_lens();
        let total: u64 = lens.iter().sum();
        let end = offset.checked_add(len).ok_or(wtypes::ReadError::OutOfRange)?;
        if end > total {
            return Err(wtypes::ReadError::OutOfRange);
        }
        let mut out = Vec::with_capacity(len as usize);
        let mut row_start = 0u64;
        for (i, row_len) in lens.iter().enumerate() {
            let row_end = row_start + row_len;
            if row_end > offset && row_start < end {
                let a = offset.max(row_start) - row_start;
                let b = end.min(row_end) - row_start;
                let row_bytes: bytes::Bytes = match &self.field {
                    Field::Regular(t) => t.row(i as u64).unwrap_or_default(),
                    Field::Nested(rows) => rows[i].contiguous_bytes(),
                    Field::Values(v) => match &v[i] {
                        crate::batch::Value::Str(s) => bytes::Bytes::copy_from_slice(s.as_bytes()),
                        crate::batch::Value::Bytes(b) | crate::batch::Value::Msgpack(b) => b.clone(),
                    },
                };
                out.extend_from_slice(&row_bytes[a as usize..b as usize]);
            }
            if row_end >= end {
                break;
            }
            row_start = row_end;
        }
        Ok(out)
    }
}

impl wtypes::Host for HostState {}

impl wtypes::HostTensor for HostState {
    fn kind(&mut self, h: Resource<LentField>) -> wasmtime::Result<wtypes::FieldKind> {
        Ok(field_kind(&self.table.get(&h)?.field))
    }

    fn dtype(&mut self, h: Resource<LentField>) -> wasmtime::Result<wtypes::Dtype> {
        Ok(match &self.table.get(&h)?.field {
            Field::Regular(t) => wit_dtype(t.dtype()),
            Field::Nested(rows) => rows.first().map(|t| wit_dtype(t.dtype())).unwrap_or(wtypes::Dtype::Uint8),
            Field::Values(_) => wtypes::Dtype::Uint8,
        })
    }

    fn shape(&mut self, h: Resource<LentField>) -> wasmtime::Result<Vec<u64>> {
        Ok(match &self.table.get(&h)?.field {
            Field::Regular(t) => t.shape().to_vec(),
            other => vec![other.rows()],
        })
    }

    fn strides(&mut self, h: Resource<LentField>) -> wasmtime::Result<Vec<i64>> {
        Ok(match &self.table.get(&h)?.field {
            Field::Regular(t) => t.strides(),
            _ => vec![1],
        })
    }

    fn rows(&mut self, h: Resource<LentField>) -> wasmtime::Result<u64> {
        Ok(self.table.get(&h)?.field.rows())
    }

    fn byte_len(&mut self, h: Resource<LentField>) -> wasmtime::Result<u64> {
        Ok(self.table.get(&h)?.row_byte_lens().iter().sum())
    }

    fn row_shapes(&mut self, h: Resource<LentField>) -> wasmtime::Result<Vec<Vec<u64>>> {
        let lent = self.table.get(&h)?;
        Ok(match &lent.field {
            Field::Regular(t) => vec![t.row_shape().to_vec(); t.rows() as usize],
            Field::Nested(rows) => rows.iter().map(|t| t.shape().to_vec()).collect(),
            Field::Values(_) => lent.row_byte_lens().into_iter().map(|l| vec![l]).collect(),
        })
    }

    fn row_byte_lens(&mut self, h: Resource<LentField>) -> wasmtime::Result<Vec<u64>> {
        Ok(self.table.get(&h)?.row_byte_lens())
    }

    fn read_cap(&mut self, h: Resource<LentField>) -> wasmtime::Result<u64> {
        Ok(self.table.get(&h)?.read_cap)
    }

    fn read(
        &mut self,
        h: Resource<LentField>,
        offset: u64,
        len: u64,
    ) -> wasmtime::Result<Result<Vec<u8>, wtypes::ReadError>> {
        Ok(self.table.get(&h)?.read(offset, len))
    }

    fn drop(&mut self, h: Resource<LentField>) -> wasmtime::Result<()> {
        // Borrowed handles are never dropped by the guest; the host deletes
        // the entry itself after the call.
        let _ = h;
        Ok(())
    }
}

/// Why a plugin could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    #[error("cannot read {path}: {source}")]
    Read { path: String, source: std::io::Error },
    #[error(
        "{path} is not a Stowage policy for stowage:policy@0.1.x: {reason}"
    )]
    Contract { path: String, reason: String },
    #[error("{path}: compiling the component failed: {reason}")]
    Compile { path: String, reason: String },
    #[error("{path}: the component does not link against this host: {reason}")]
    Link { path: String, reason: String },
    #[error("{path}: describe() failed: {reason}")]
    Describe { path: String, reason: String },
    #[error("{path}: refused by the conformance suite: {reason}")]
    Check { path: String, reason: String },
}

/// The WIT interfaces a policy must export, without version.
const REQUIRED_EXPORTS: [&str; 3] = ["stowage:policy/meta", "stowage:policy/selection", "stowage:policy/packing"];

/// Reads the component's exports before compiling it and checks that it
/// speaks `stowage:policy@0.1.x`. Returns the exact version found.
pub fn check_contract(bytes: &[u8]) -> Result<String, String> {
    let mut exports: Vec<String> = Vec::new();
    let mut depth = 0usize;
    for payload in wasmparser::Parser::new(0).parse_all(bytes) {
        let payload = payload.map_err(|e| format!("not a valid Wasm binary ({e})"))?;
        match payload {
            wasmparser::Payload::Version { encoding, .. } => {
                if depth == 0 {
                    if encoding != wasmparser::Encoding::Component {
                        return Err("a core Wasm module, not a component (build for wasm32-wasip2)".into());
                    }
                }
                depth += 1;
            }
            wasmparser::Payload::End(_) => depth = depth.saturating_sub(1),
            wasmparser::Payload::ComponentExportSection(reader) if depth == 1 => {
                for export in reader {
                    let export = export.map_err(|e| format!("bad export section ({e})"))?;
                    exports.push(export.name.name.to_string());
                }
            }
            _ => {}
        }
    }
    let mut version = None;
    for required in REQUIRED_EXPORTS {
        let found = exports.iter().find(|e| e.split('@').next() == Some(required));
        let Some(found) = found else {
            return Err(format!("it does not export `{required}` (exports: {exports:?})"));
        };
        let v = found.split_once('@').map(|(_, v)| v.to_string()).unwrap_or_default();
        let mut parts = v.split('.');
        let compatible = parts.next() == Some("0") && parts.next() == Some("1");
        if !compatible {
            return Err(format!(
                "it exports `{found}`, built for contract version {v:?}; this host speaks 0.1.x (rebuild the plugin against stowage-guest 0.1)"
            ));
        }
        version = Some(v);
    }
    Ok(version.unwrap_or_default())
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
        f.debug_struct("WasmPolicy").field("description", &self.description).finish()
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
    bindings::Policy::add_to_linker::<HostState, wasmtime::component::HasSelf<HostState>>(&mut linker, |s| s)?;
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
        let link = |e: wasmtime::Error| LoadError::Link { path: path.into(), reason: format!("{e:#}") };
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
            .map_err(|f| LoadError::Describe { path: path.into(), reason: f.to_string() })?;
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
        let state = HostState { wasi, table: ResourceTable::new(), limits, stderr, read_cap: self.limits.read_cap };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limits);
        store.set_fuel(self.limits.fuel).map_err(|e| Fault::Instantiate(format!("{e:#}")))?;
        let bindings = self.pre.instantiate(&mut store).map_err(|e| match fault_of(e) {
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
    fn call<R: Send>(&self, f: impl FnOnce(&mut Instance) -> wasmtime::Result<R> + Send) -> Result<R, Fault> {
        let mut slot = self.instance.lock().unwrap_or_else(|p| p.into_inner());
        let slot = &mut *slot;
        off_runtime(|| self.call_here(slot, f))
    }

    fn call_here<R>(&self, slot: &mut Option<Instance>, f: impl FnOnce(&mut Instance) -> wasmtime::Result<R>) -> Result<R, Fault> {
        if slot.is_none() {
            *slot = Some(self.instantiate()?);
        }
        let inst = slot.as_mut().expect("instance present");
        inst.store.set_fuel(self.limits.fuel).map_err(|e| Fault::Instantiate(format!("{e:#}")))?;
        match f(inst) {
            Ok(r) => Ok(r),
            Err(e) => {
                let mut fault = fault_of(e);
                let said = inst.store.data().stderr.contents();
                if !said.is_empty()
                    && let Fault::Trap(t) = &mut fault
                {
                    t.push_str(&format!(" (guest stderr: {})", String::from_utf8_lossy(&said).trim()));
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
fn off_runtime<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Err(_) => f(),
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        Ok(_) => std::thread::scope(|s| s.spawn(f).join()).unwrap_or_else(|panic| std::panic::resume_unwind(panic)),
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
                wsel::Piece::View(v) => plan::Piece::View(plan::RowView { start: v.start, step: v.step, count: v.count }),
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

    fn select(&self, field: &Field, positions: &[u64]) -> Result<SelectionPlan, PolicyError> {
        let answer = self
            .call(|inst| {
                let read_cap = inst.store.data().read_cap;
                let lent = LentField { field: field.clone(), read_cap };
                let handle = inst.store.data_mut().table.push(lent)?;
                let borrowed = Resource::new_borrow(handle.rep());
                let result = inst.bindings.stowage_policy_selection().call_select(&mut inst.store, borrowed, positions);
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
        let wpieces: Vec<wpack::PieceInfo> =
            pieces.iter().map(|p| wpack::PieceInfo { byte_len: p.byte_len, contiguous: p.contiguous }).collect();
        let wlimits = wpack::PackLimits {
            max_frames: limits.max_frames,
            max_frame_bytes: limits.max_frame_bytes,
            small_threshold: limits.small_threshold,
        };
        let answer = self
            .call(|inst| inst.bindings.stowage_policy_packing().call_pack(&mut inst.store, &wpieces, wlimits))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{DType, Tensor};
    use bytes::Bytes;

    fn lent(field: Field, read_cap: u64) -> LentField {
        LentField { field, read_cap }
    }

    #[test]
    fn read_walks_the_logical_byte_stream() {
        let t = Tensor::contiguous(Bytes::from((0u8..32).collect::<Vec<_>>()), DType::U8, vec![8, 4]).unwrap();
        // A strided view: rows 1, 3, 5 -> bytes 4..8, 12..16, 20..24 without gaps.
        let view = t.rows_view(1, 2, 3).unwrap();
        let l = lent(Field::Regular(view), 16);
        assert_eq!(l.read(2, 4).unwrap(), vec![6, 7, 12, 13]);
        assert_eq!(l.read(0, 12).unwrap(), vec![4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]);
        assert!(matches!(l.read(10, 3), Err(wtypes::ReadError::OutOfRange)));
        assert!(matches!(l.read(0, 17), Err(wtypes::ReadError::OverCap(16))));
        assert!(matches!(l.read(u64::MAX, 2), Err(wtypes::ReadError::OutOfRange)));
        let rows = vec![
            Tensor::contiguous(Bytes::from(vec![1u8, 2]), DType::U8, vec![2]).unwrap(),
            Tensor::contiguous(Bytes::new(), DType::U8, vec![0]).unwrap(),
            Tensor::contiguous(Bytes::from(vec![3u8]), DType::U8, vec![1]).unwrap(),
        ];
        let l = lent(Field::Nested(rows), 16);
        assert_eq!(l.read(1, 2).unwrap(), vec![2, 3]);
        assert_eq!(l.row_byte_lens(), vec![2, 0, 1]);
    }

    #[test]
    fn contract_check_refuses_non_components() {
        assert!(check_contract(b"not wasm").is_err());
        assert!(check_contract(b"\0asm\x01\0\0\0").unwrap_err().contains("core Wasm module"));
    }
}
