//! Paged varlen attention on the CPU: one call per layer covers every request of the step,
//! prefill chunks and decodes together. Causal within each request, GQA by head grouping,
//! online softmax in f32, K/V read through the block tables.

use super::ops::exp_nonpositive;
use crate::backend::cpu::disjoint::DisjointSlice;
use crate::backend::cpu::kv_cache::Pages;
use crate::backend::cpu::quant::isa::Isa;
use rayon::prelude::*;

mod tile;
mod work;
use tile::*;
#[cfg(target_arch = "x86_64")]
use work::ScoreBlock;
use work::{row_span, Item, LayerInputs, Merge, StepWork, TileScratch};
pub use work::{AttentionMeta, AttentionParams};

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
use avx512::{block_scores_avx512, row_sums_avx512};

/// Request that owns query row `t`, by binary search over `cu_seqlens_q`.
fn owner(cu: &[u32], t: usize) -> usize {
    cu.partition_point(|&c| c as usize <= t) - 1
}

/// Query rows per tile: each K/V block is widened to f32 once for the whole tile (32
/// halves the history re-read by long prefills against 16 and keeps a 512-token step in
/// 48 tiles).
const Q_TILE: usize = 32;

/// `q`: `[T, num_heads, head_dim]`; caches as [`Pages`], `k_cache`: `[num_blocks,
/// num_kv_heads, head_dim, block_size]` (keys minor), `v_cache`: `[num_blocks, num_kv_heads,
/// block_size, head_dim]`; `out`: `[T, num_heads, head_dim]`.
pub fn paged_attention(
    q: &[f32],
    k_cache: &Pages,
    v_cache: &Pages,
    meta: &AttentionMeta,
    p: &AttentionParams,
    out: &mut [f32],
) {
    paged_attention_isa(Isa::detect(), q, k_cache, v_cache, meta, p, out)
}

/// [`paged_attention`] through the kernels of one instruction set (tests run each the CPU has;
/// `isa` must be supported here).
pub fn paged_attention_isa(
    isa: Isa,
    q: &[f32],
    k_cache: &Pages,
    v_cache: &Pages,
    meta: &AttentionMeta,
    p: &AttentionParams,
    out: &mut [f32],
) {
    assert!(
        isa.supported(),
        "{} kernels on a CPU without them",
        isa.name()
    );
    let group = p.num_heads / p.num_kv_heads;
    let chunk = key_chunk(meta.block_size);
    STEP.with_borrow_mut(|w| {
        // One item = up to Q_TILE query rows of one request x one KV head (its `group` query
        // heads share the K/V loads) x one key chunk. Tiles are cut by row index.
        w.items.clear();
        w.merges.clear();
        let mut part = 0;
        let num_rows = *meta.cu_seqlens_q.last().unwrap_or(&0) as usize;
        let mut t = 0;
        while t < num_rows {
            let b = owner(meta.cu_seqlens_q, t);
            let rows = t..(t + Q_TILE).min(meta.cu_seqlens_q[b + 1] as usize);
            let keys = tile_keys(meta, p, b, &rows);
            for kvh in 0..p.num_kv_heads {
                let first = w.items.len();
                let mut c0 = keys.start / chunk * chunk;
                while c0 < keys.end {
                    w.items.push(Item {
                        b,
                        rows: rows.clone(),
                        kvh,
                        keys: c0.max(keys.start)..(c0 + chunk).min(keys.end),
                        part,
                    });
                    part += rows.len() * group * (p.head_dim + 2);
                    c0 += chunk;
                }
                w.merges.push(Merge {
                    rows: rows.clone(),
                    kvh,
                    items: first..w.items.len(),
                });
            }
            t = rows.end;
        }
        // Every item initializes its own region: no clearing needed.
        w.parts.resize(part, 0.0);
        let parts = DisjointSlice::new(&mut w.parts);
        let inputs = LayerInputs {
            isa,
            q,
            k_cache,
            v_cache,
            meta,
            p,
        };
        w.items.par_iter().for_each(|it| {
            let len = it.rows.len() * group * (p.head_dim + 2);
            // SAFETY: each item owns `part..part + len`.
            let part = unsafe { parts.range(it.part, len) };
            SCRATCH.with_borrow_mut(|s| attend(isa, &inputs, it, part, s));
        });
        let (items, parts, out) = (&w.items, &w.parts, DisjointSlice::new(out));
        w.merges.par_iter().for_each(|mg| {
            let width = group * p.head_dim;
            for (i, t) in mg.rows.clone().enumerate() {
                // SAFETY: a row's query heads of one KV head belong to this merge alone.
                let o =
                    unsafe { out.range((t * p.num_heads + mg.kvh * group) * p.head_dim, width) };
                let sinks = p.sinks.map(|s| &s[mg.kvh * group..][..group]);
                merge_row(
                    &items[mg.items.clone()],
                    parts,
                    i,
                    group,
                    p.head_dim,
                    sinks,
                    o,
                );
            }
        });
    });
}

/// Keys `[first key of the first row, end of the last row)` a tile of request `b` reads.
fn tile_keys(
    meta: &AttentionMeta,
    p: &AttentionParams,
    b: usize,
    rows: &std::ops::Range<usize>,
) -> std::ops::Range<usize> {
    let span = row_span(meta, p, b);
    span(rows.start).start..span(rows.end - 1).end
}

/// Row `i` of a merge: `o = sum_c acc_c e^(m_c - M) / sum_c l_c e^(m_c - M)` over the
/// chunks' partials in order, for each of the `group` query heads (with `sinks`, each head's
/// sink adds `e^(sink - M)` to the denominator). Chunks where the row saw no key are
/// skipped, so the sum does not depend on the tile's other rows.
fn merge_row(
    items: &[Item],
    parts: &[f32],
    i: usize,
    group: usize,
    d: usize,
    sinks: Option<&[f32]>,
    o: &mut [f32],
) {
    for h in 0..group {
        let oh = &mut o[h * d..][..d];
        let partial = |it: &Item| {
            let (n, s) = (it.rows.len(), i * group + h);
            let part = &parts[it.part..][..n * group * (d + 2)];
            let (acc, ml) = part.split_at(n * group * d);
            (&acc[s * d..][..d], ml[s], ml[n * group + s])
        };
        let sink = sinks.map(|s| s[h]);
        let mx = items
            .iter()
            .map(|it| partial(it).1)
            .fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
        oh.fill(0.0);
        let mut l = 0.0f32;
        for it in items {
            let (acc, m, lc) = partial(it);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let f = exp_nonpositive(m - mx);
            l += lc * f;
            oh.iter_mut().zip(acc).for_each(|(x, &a)| *x += a * f);
        }
        if let Some(s) = sink {
            l += exp_nonpositive(s - mx);
        }
        let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
        oh.iter_mut().for_each(|x| *x *= inv);
    }
}

thread_local! {
    static STEP: std::cell::RefCell<StepWork> = std::cell::RefCell::default();
    static SCRATCH: std::cell::RefCell<TileScratch> = std::cell::RefCell::default();
}

/// [`attend_tile`] through the kernels of `isa`.
fn attend(isa: Isa, x: &LayerInputs, it: &Item, part: &mut [f32], s: &mut TileScratch) {
    #[cfg(target_arch = "x86_64")]
    if isa.vector() == Isa::Avx512Vnni {
        // SAFETY: the CPU supports the features the function is compiled for (checked by
        // `paged_attention_isa`).
        return unsafe { attend_tile_avx512(x, it, part, s) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa.vector() == Isa::Avx2 {
        // SAFETY: as above.
        return unsafe { attend_tile_avx2(x, it, part, s) };
    }
    // Elsewhere the portable tile: on Arm its 16-lane loops compile to NEON (baseline there).
    let _ = isa;
    attend_tile(x, it, part, s, piece_scores, row_sums)
}

/// [`attend_tile`] compiled with AVX2 and FMA (chosen at run time; the default target
/// is baseline x86-64, whose SSE2 code is several times slower here).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_tile_avx2(x: &LayerInputs, it: &Item, part: &mut [f32], s: &mut TileScratch) {
    // Closures, not the fn items: a closure inherits this function's target features, while
    // a fn item's `Fn::call` shim is compiled for the baseline target, where every
    // `mul_add` is a call into software `fmaf` (prefill attention ~10x slower).
    let scores = |b: &ScoreBlock, k: &[f32], out: &mut [f32]| piece_scores(b, k, out);
    let sums = |o: &mut [f32], w: &[f32], cols, keys, vk: &[f32], odd, d| {
        row_sums(o, w, cols, keys, vk, odd, d)
    };
    attend_tile(x, it, part, s, scores, sums)
}

/// [`attend_tile`] compiled with AVX-512: the 16-lane dot and exp fill one register.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn attend_tile_avx512(x: &LayerInputs, it: &Item, part: &mut [f32], s: &mut TileScratch) {
    // SAFETY: this function runs only where the CPU has AVX-512F.
    if !x.p.head_dim.is_multiple_of(4) {
        return attend_tile_avx2(x, it, part, s);
    }
    let scores =
        |b: &ScoreBlock, k: &[f32], out: &mut [f32]| unsafe { block_scores_avx512(b, k, out) };
    let sums = |o: &mut [f32], w: &[f32], cols, keys, vk: &[f32], odd, d| unsafe {
        row_sums_avx512(o, w, cols, keys, vk, odd, d)
    };
    attend_tile(x, it, part, s, scores, sums)
}
