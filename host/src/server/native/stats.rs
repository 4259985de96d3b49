//! The `stats` op: the node's figures as one flat map of counters, gauges
//! and, per live plugin and per chain, a map of their own. Names are the
//! protocol's (`docs/protocol-stowage1.md`, "stats"); every count is an
//! int, capped at `i64::MAX`.

use std::sync::atomic::{AtomicU64, Ordering};

use super::NativeService;
use crate::manager::Target;
use crate::policy::chain::{FailStrategy, Loaded};
use crate::policy::registry::{ChainSummary, list_name};
use crate::wire::native::{self, Stat};

fn int(v: u64) -> Stat {
    Stat::Int(v.min(i64::MAX as u64) as i64)
}

fn load(a: &AtomicU64) -> Stat {
    int(a.load(Ordering::Relaxed))
}

impl NativeService {
    pub(super) fn stats(&self) -> native::Reply {
        let m = &self.manager;
        let mut stats: Vec<(String, Stat)> = vec![("units".into(), int(m.targets().len() as u64))];
        let mut push = |k: &str, v: Stat| stats.push((k.to_string(), v));
        let (mut keys, mut rows, mut bytes, mut capacity) = (0u64, 0u64, 0u64, Some(0u64));
        for t in m.targets() {
            match t {
                Target::Local(u) => {
                    let s = u.stats();
                    keys += s.keys;
                    rows += s.rows;
                    bytes += s.bytes;
                    capacity = capacity.zip(s.capacity).map(|(a, b)| a.saturating_add(b));
                }
                Target::Remote(_) | Target::Peer(_) => capacity = None,
            }
        }
        push("keys", int(keys));
        push("rows", int(rows));
        push("bytes", int(bytes));
        if let Some(c) = capacity {
            push("capacity", int(c));
        }
        let spiller = m.targets().iter().find_map(|t| match t {
            Target::Local(u) => u.spiller().cloned(),
            Target::Remote(_) | Target::Peer(_) => None,
        });
        if let Some(s) = spiller {
            let s = s.stats();
            for (k, v) in [
                ("spill_memory_bytes", s.memory),
                ("spill_disk_bytes", s.disk),
                ("spill_threshold_bytes", s.threshold),
                ("spill_bound_bytes", s.bound),
                ("spilled_bytes_total", s.spilled),
                ("spilled_extents_total", s.files),
                ("spill_failures_total", s.failures),
                ("spill_write_ns_total", s.write_ns),
            ] {
                push(k, int(v));
            }
        }
        if let Some(cache) = m.cache() {
            let k = &cache.counters;
            for (key, v) in [
                ("cache_hits", &k.hits),
                ("cache_shared", &k.shared),
                ("cache_misses", &k.misses),
                ("cache_saved_bytes", &k.saved_bytes),
                ("cache_fetched_bytes", &k.fetched_bytes),
                ("cache_evictions", &k.evictions),
            ] {
                push(key, load(v));
            }
            push("cache_bytes", int(cache.bytes()));
            push("cache_held_bytes", int(cache.held_bytes()));
            push("cache_max_bytes", int(cache.max_bytes()));
        }
        let (d, c, r) = (&m.dedup_counters, &m.counters, &self.metrics.reloads);
        for (key, v) in [
            ("dedup_rows", &d.rows),
            ("dedup_bytes", &d.bytes),
            ("dedup_scanned_bytes", &d.scanned_bytes),
            ("dedup_ns", &d.ns),
            ("zero_copy_bytes", &c.zero_copy_bytes),
            ("copied_bytes", &c.copied_bytes),
            ("plugin_decisions", &c.plugin_decisions),
            ("builtin_decisions", &c.builtin_decisions),
            ("fallbacks", &c.fallbacks),
            ("gets_forwarded", &c.gets_forwarded),
            ("gets_forward_dropped", &c.gets_forward_dropped),
            ("same_node_gets_inline", &c.same_node_gets_inline),
        ] {
            push(key, load(v));
        }
        push("process_rss_bytes", int(crate::sys::process_rss_bytes()));
        for (key, v) in [
            ("plugin_swaps", &r.swapped),
            ("plugin_refusals", &r.refused),
            ("plugin_removals", &r.removed),
            ("missing_chain_entries", &r.missing_chain_entries),
        ] {
            push(key, load(v));
        }
        push("policy_ns", int(crate::policy::chain::policy_ns()));
        if let Some((shm, channels)) = &self.shm {
            let (segments, leases) = shm.counts();
            push("shm_segments", int(segments as u64));
            push("shm_leases", int(leases as u64));
            push("shm_channels", int(channels.len() as u64));
            let (ready, hits) = shm.prealloc();
            push("shm_prealloc_bytes", int(ready));
            push("shm_prealloc_hits", int(hits));
        }
        let registry = m.registry();
        for name in registry.names() {
            if let Some(l) = registry.get(&name) {
                stats.push((format!("plugin.{name}"), plugin_stats(l)));
            }
        }
        for c in registry.chain_summaries() {
            stats.push((format!("chain.{}", c.pattern), chain_stats(&c)));
        }
        native::Reply::StatsOk(stats)
    }
}

/// A live plugin's `stats` map: its version and capabilities, its counters
/// (kept per version across reloads) and whether it is disabled.
fn plugin_stats(l: &Loaded) -> Stat {
    let d = l.policy.describe();
    let st = &l.stats;
    let n = |c: &AtomicU64| Stat::count(c.load(Ordering::Relaxed));
    let caps: Vec<&str> = d.capabilities.iter().map(|c| list_name(*c)).collect();
    let mut map = vec![
        ("version".to_string(), Stat::Str(d.version.clone())),
        ("capabilities".into(), Stat::strs(&caps)),
    ];
    for (key, v) in [
        ("calls", &st.calls),
        ("entries", &st.entries),
        ("memo_hits", &st.memo_hits),
        ("call_ns", &st.call_ns),
        ("plans", &st.plans),
        ("faults", &st.faults),
        ("invalid_plans", &st.invalid_plans),
        ("fallbacks", &st.fallbacks),
        ("rejections", &st.rejections),
        ("disables", &st.disables),
        ("reenables", &st.reenables),
    ] {
        map.push((key.into(), n(v)));
    }
    map.push((
        "disabled".into(),
        Stat::Bool(st.disabled.load(Ordering::Relaxed)),
    ));
    if let Some(left) = st.reenable_in() {
        let ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX);
        map.push(("reenable_in_ms".into(), Stat::count(ms)));
    }
    Stat::Map(map)
}

/// A chain's `stats` map: its live policies, settings and missing entries.
fn chain_stats(c: &ChainSummary) -> Stat {
    let ms = |d: std::time::Duration| Stat::count(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let fail = match c.fail {
        FailStrategy::Fallback => "fallback",
        FailStrategy::Reject => "reject",
    };
    Stat::Map(vec![
        ("select".into(), Stat::strs(&c.select)),
        ("pack".into(), Stat::strs(&c.pack)),
        ("fail".into(), Stat::Str(fail.into())),
        ("max_faults".into(), Stat::count(c.max_faults)),
        (
            "backoff_ms".into(),
            c.backoff.map_or(Stat::Int(0), |b| ms(b.initial)),
        ),
        (
            "backoff_max_ms".into(),
            c.backoff.map_or(Stat::Int(0), |b| ms(b.max)),
        ),
        ("allow_missing".into(), Stat::Bool(c.allow_missing)),
        ("missing_select".into(), Stat::strs(&c.missing_select)),
        ("missing_pack".into(), Stat::strs(&c.missing_pack)),
    ])
}
