//! Paged varlen attention on the CPU: one call per layer covers every request of the step,
//! prefill chunks and decodes together. Causal within each request, GQA by head grouping,
//! online softmax in f32, K/V read through the block tables.

use super::ops::exp_nonpositive;
use crate::backend::cpu::disjoint::DisjointSlice;
use crate::backend::cpu::quant::isa::Isa;
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
use avx512::{block_scores_avx512, row_sums_avx512, widen_avx512};

/// Where each request's queries and keys are, in the packed step.
pub struct AttentionMeta<'a> {
    /// `[B + 1]`: request `b` owns query rows `cu_seqlens_q[b]..cu_seqlens_q[b + 1]`.
    pub cu_seqlens_q: &'a [u32],
    /// `[B]`: K/V length of each request including this step's tokens.
    pub seq_lens_k: &'a [u32],
    /// `[B, max_blocks]`, row-major.
    pub block_tables: &'a [u32],
    pub max_blocks: usize,
    pub block_size: usize,
}

pub struct AttentionParams {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub sliding_window: Option<usize>,
    pub softcap: Option<f32>,
}

/// Request that owns query row `t`, by binary search over `cu_seqlens_q`.
fn owner(cu: &[u32], t: usize) -> usize {
    cu.partition_point(|&c| c as usize <= t) - 1
}

/// Query rows per tile: each K/V block is widened to f32 once for the whole tile (32
/// halves the history re-read by long prefills against 16 and keeps a 512-token step in
/// 48 tiles).
const Q_TILE: usize = 32;

/// Keys per chunk (rounded up to whole blocks). Every row's softmax is computed as one
/// partial per chunk of absolute key positions, merged in chunk order: the grid depends
/// only on positions, so a row gets the same bits whatever tile it sits in, and the chunks
/// of one long decode run on different threads.
const KEY_CHUNK: usize = 256;

/// `q`: `[T, num_heads, head_dim]`; caches in f16, `k_cache`: `[num_blocks, num_kv_heads,
/// head_dim, block_size]` (keys minor), `v_cache`: `[num_blocks, num_kv_heads, block_size,
/// head_dim]`; `out`: `[T, num_heads, head_dim]`.
pub fn paged_attention(
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
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
    k_cache: &[f16],
    v_cache: &[f16],
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
                merge_row(&items[mg.items.clone()], parts, i, group, p.head_dim, o);
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

/// The causal key range `[first, end)` of each query row of request `b`.
fn row_span<'a>(
    meta: &'a AttentionMeta,
    p: &'a AttentionParams,
    b: usize,
) -> impl Fn(usize) -> std::ops::Range<usize> + 'a {
    let q_start = meta.cu_seqlens_q[b] as usize;
    let q_len = meta.cu_seqlens_q[b + 1] as usize - q_start;
    let k_len = meta.seq_lens_k[b] as usize;
    move |t| {
        let pos = k_len - q_len + (t - q_start);
        p.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w))..pos + 1
    }
}

/// Row `i` of a merge: `o = sum_c acc_c e^(m_c - M) / sum_c l_c e^(m_c - M)` over the
/// chunks' partials in order, for each of the `group` query heads. Chunks where the row
/// saw no key are skipped, so the sum does not depend on the tile's other rows.
fn merge_row(items: &[Item], parts: &[f32], i: usize, group: usize, d: usize, o: &mut [f32]) {
    for h in 0..group {
        let oh = &mut o[h * d..][..d];
        let partial = |it: &Item| {
            let (n, s) = (it.rows.len(), i * group + h);
            let part = &parts[it.part..][..n * group * (d + 2)];
            let (acc, ml) = part.split_at(n * group * d);
            (&acc[s * d..][..d], ml[s], ml[n * group + s])
        };
        let mx = items
            .iter()
            .map(|it| partial(it).1)
            .fold(f32::NEG_INFINITY, f32::max);
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
        let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
        oh.iter_mut().for_each(|x| *x *= inv);
    }
}

/// Up to Q_TILE query rows of request `b`, KV head `kvh`, keys `keys` (one chunk, clipped
/// to the tile's range); its partials live at `part` in the step's buffer: `acc` `[rows,
/// group, head_dim]`, then `m` and `l` `[rows, group]` each.
struct Item {
    b: usize,
    rows: std::ops::Range<usize>,
    kvh: usize,
    keys: std::ops::Range<usize>,
    part: usize,
}

/// What every item of one call reads: the queries, the layer's caches, the step's layout.
#[derive(Clone, Copy)]
struct LayerInputs<'a> {
    q: &'a [f32],
    k_cache: &'a [f16],
    v_cache: &'a [f16],
    meta: &'a AttentionMeta<'a>,
    p: &'a AttentionParams,
}

/// The items (consecutive) whose partials make up the output of one tile and KV head.
struct Merge {
    rows: std::ops::Range<usize>,
    kvh: usize,
    items: std::ops::Range<usize>,
}

/// The calling thread's work list and partials, reused across layers and steps.
#[derive(Default)]
struct StepWork {
    items: Vec<Item>,
    merges: Vec<Merge>,
    parts: Vec<f32>,
}

/// A compute thread's buffers for one item, reused across items, layers and steps.
#[derive(Default)]
struct TileScratch {
    /// The chunk in f32: K^T `[head_dim, keys]`, V `[keys, head_dim]`.
    kt: Vec<f32>,
    vb: Vec<f32>,
    /// One row's scores, then its weights, `[heads, keys]`.
    w: Vec<f32>,
}

thread_local! {
    static STEP: std::cell::RefCell<StepWork> = std::cell::RefCell::default();
    static SCRATCH: std::cell::RefCell<TileScratch> = std::cell::RefCell::default();
}

/// [`attend_tile`] through the kernels of `isa`.
fn attend(isa: Isa, x: &LayerInputs, it: &Item, part: &mut [f32], s: &mut TileScratch) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512Vnni {
        // SAFETY: the CPU supports the features the function is compiled for (checked by
        // `paged_attention_isa`).
        return unsafe { attend_tile_avx512(x, it, part, s) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: as above.
        return unsafe { attend_tile_avx2(x, it, part, s) };
    }
    attend_tile(x, it, part, s, piece_scores, row_sums)
}

/// [`attend_tile`] compiled with AVX2 and FMA (chosen at run time; the default target
/// is baseline x86-64, whose SSE2 code is several times slower here).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_tile_avx2(x: &LayerInputs, it: &Item, part: &mut [f32], s: &mut TileScratch) {
    attend_tile(x, it, part, s, piece_scores, row_sums)
}

/// [`attend_tile`] compiled with AVX-512: the 16-lane dot and exp fill one register.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn attend_tile_avx512(x: &LayerInputs, it: &Item, part: &mut [f32], s: &mut TileScratch) {
    // SAFETY: this function runs only where the CPU has AVX-512F.
    if !x.p.head_dim.is_multiple_of(4) {
        return attend_tile(x, it, part, s, piece_scores, row_sums);
    }
    let scores =
        |b: &ScoreBlock, k: &[f32], out: &mut [f32]| unsafe { block_scores_avx512(b, k, out) };
    let sums = |o: &mut [f32], w: &[f32], cols, keys, vk: &[f32], odd, d| unsafe {
        row_sums_avx512(o, w, cols, keys, vk, odd, d)
    };
    attend_tile(x, it, part, s, scores, sums)
}

/// A group of a tile's rows whose query vectors (each row's heads of one KV head) meet the same
/// K^T pieces: `q` starts at the first row's first head, rows `row_stride` apart, heads `d`
/// apart; scores go to `out[(row * heads + head) * cols + piece * LANES + lane]`.
struct ScoreBlock<'a> {
    q: &'a [f32],
    row_stride: usize,
    rows: usize,
    heads: usize,
    d: usize,
    cols: usize,
}

impl ScoreBlock<'_> {
    /// Query vector `v` (row-major over rows and heads) and where its scores start.
    fn vector(&self, v: usize) -> (usize, usize) {
        let (row, head) = (v / self.heads, v % self.heads);
        (row * self.row_stride + head * self.d, v * self.cols)
    }
}

/// The scores of each query vector of `b` against consecutive LANES-key pieces of K^T (`k`:
/// `[pieces, d, LANES]`), into `out` as [`ScoreBlock`] lays it out.
#[inline(always)]
fn piece_scores(b: &ScoreBlock, k: &[f32], out: &mut [f32]) {
    for v in 0..b.rows * b.heads {
        let (qa, oa) = b.vector(v);
        let qv = &b.q[qa..][..b.d];
        for (o, kp) in out[oa..]
            .chunks_exact_mut(LANES)
            .zip(k.chunks_exact(b.d * LANES))
        {
            o.copy_from_slice(&chunk_scores(qv, kp, LANES));
        }
    }
}

/// Keys per softmax step: a block is walked in chunks of up to 16 keys, one register of
/// scores (two on AVX2).
const LANES: usize = 16;

/// The item's rows and query heads against its keys, into unnormalized partials: the
/// chunk's K^T and V are widened to f32 once for all rows and heads; then per query
/// vector the scores of its keys, their max, the weights `e^(s - m)` and the weighted sum
/// of V rows.
///
/// A query vector's arithmetic is fixed by its own key range and the chunk grid: scores in
/// LANES-key pieces aligned to the chunk start, masked lanes exact zeros, the denominator
/// one partial sum per lane, the V sum over the keys in order (even and odd keys apart). So
/// a row gets the same bits whatever else shares its tile or step.
#[inline(always)]
fn attend_tile(
    x: &LayerInputs,
    it: &Item,
    part: &mut [f32],
    s: &mut TileScratch,
    scores: impl Fn(&ScoreBlock, &[f32], &mut [f32]),
    sums: impl Fn(&mut [f32], &[f32], usize, std::ops::Range<usize>, &[f32], bool, usize),
) {
    let LayerInputs {
        q,
        k_cache,
        v_cache,
        meta,
        p,
    } = *x;
    let (rows, kvh, keys) = (it.rows.clone(), it.kvh, it.keys.clone());
    let d = p.head_dim;
    let nh = p.num_heads / p.num_kv_heads;
    let bs = meta.block_size;
    let table = &meta.block_tables[it.b * meta.max_blocks..(it.b + 1) * meta.max_blocks];
    let n = rows.len();
    let span = row_span(meta, p, it.b);
    let (out, ml) = part.split_at_mut(n * nh * d);
    let (m, l) = ml.split_at_mut(n * nh);
    // Columns are keys from the chunk start `c0`. K^T is kept as LANES-key pieces
    // `[pieces, d, LANES]` (a 16-key block is one piece as stored), V as `[keys, d]`.
    let c0 = keys.start / key_chunk(bs) * key_chunk(bs);
    let (b0, b1) = (keys.start / bs, keys.end.div_ceil(bs));
    let cols = (b1 * bs - c0).div_ceil(LANES) * LANES;
    let TileScratch { kt, vb, w } = s;
    for (buf, len) in [
        (&mut *kt, d * cols),
        (&mut *vb, cols * d),
        (&mut *w, (12 / nh).max(1) * nh * cols),
    ] {
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
    }
    for bi in b0..b1 {
        let at = (table[bi] as usize * p.num_kv_heads + kvh) * d * bs;
        if let Some(&ahead) = table[..b1].get(bi + PREFETCH_BLOCKS) {
            let at = (ahead as usize * p.num_kv_heads + kvh) * d * bs;
            prefetch(&k_cache[at..][..d * bs]);
            prefetch(&v_cache[at..][..d * bs]);
        }
        let col = bi * bs - c0;
        if bs == LANES && col.is_multiple_of(LANES) {
            widen(&k_cache[at..][..d * bs], &mut kt[col * d..][..d * bs]);
        } else {
            for dd in 0..d {
                for k in 0..bs {
                    let (pc, lane) = ((col + k) / LANES, (col + k) % LANES);
                    kt[(pc * d + dd) * LANES + lane] = k_cache[at + dd * bs + k].to_f32();
                }
            }
        }
        widen(&v_cache[at..][..bs * d], &mut vb[col * d..][..bs * d]);
    }
    // Rows in groups whose query vectors share each K^T load (up to 12 vectors; `w` holds a group).
    let group_rows = (12 / nh).max(1);
    for i0 in (0..n).step_by(group_rows) {
        let g = group_rows.min(n - i0);
        let range = |i: usize| {
            let r = span(rows.start + i);
            r.start.max(keys.start)..r.end.min(keys.end)
        };
        let live = (i0..i0 + g).map(range).filter(|r| r.start < r.end);
        let pa = live.clone().map(|r| (r.start - c0) / LANES).min();
        let pb = live.map(|r| (r.end - c0).div_ceil(LANES)).max();
        if let (Some(pa), Some(pb)) = (pa, pb) {
            let block = ScoreBlock {
                q: &q[((rows.start + i0) * p.num_heads + kvh * nh) * d..],
                row_stride: p.num_heads * d,
                rows: g,
                heads: nh,
                d,
                cols,
            };
            scores(
                &block,
                &kt[pa * d * LANES..pb * d * LANES],
                &mut w[pa * LANES..],
            );
        }
        for (ii, r) in (i0..i0 + g).map(range).enumerate() {
            let i = i0 + ii;
            let (lo, hi) = (r.start, r.end);
            let o_row = &mut out[i * nh * d..][..nh * d];
            if lo >= hi {
                m[i * nh..][..nh].fill(f32::NEG_INFINITY);
                l[i * nh..][..nh].fill(0.0);
                o_row.fill(0.0);
                continue;
            }
            let pieces = (lo - c0) / LANES..(hi - c0).div_ceil(LANES);
            let w = &mut w[ii * nh * cols..];
            for h in 0..nh {
                let s_idx = i * nh + h;
                let wh = &mut w[h * cols..][..cols];
                let mut mv = [f32::NEG_INFINITY; LANES];
                for pc in pieces.clone() {
                    let sc: &mut [f32; LANES] =
                        (&mut wh[pc * LANES..][..LANES]).try_into().unwrap();
                    sc.iter_mut().for_each(|s| *s *= p.scale);
                    if let Some(cap) = p.softcap {
                        sc.iter_mut().for_each(|s| *s = cap * (*s / cap).tanh());
                    }
                    for (j, s) in sc.iter_mut().enumerate() {
                        let key = c0 + pc * LANES + j;
                        if key < lo || key >= hi {
                            *s = f32::NEG_INFINITY;
                        }
                        mv[j] = mv[j].max(*s);
                    }
                }
                let mx = mv.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
                let mut lv = [0f32; LANES];
                for pc in pieces.clone() {
                    let wp: &mut [f32; LANES] =
                        (&mut wh[pc * LANES..][..LANES]).try_into().unwrap();
                    for j in 0..LANES {
                        let e = if wp[j] == f32::NEG_INFINITY {
                            0.0
                        } else {
                            exp_nonpositive(wp[j] - mx)
                        };
                        wp[j] = e;
                        lv[j] += e;
                    }
                }
                (m[s_idx], l[s_idx]) = (mx, lv.iter().sum());
            }
            let keys_in = (lo - c0)..(hi - c0);
            let vk = &vb[keys_in.start * d..keys_in.end * d];
            let odd = keys_in.start % 2 == 1;
            sums(o_row, w, cols, keys_in, vk, odd, d);
        }
    }
}

/// `o_row`'s `heads x d` outputs as [`sum_rows`] computes them, the heads in groups that
/// share each V row's loads (a head's sums are the same in any group).
#[inline(always)]
fn row_sums(
    o_row: &mut [f32],
    w: &[f32],
    cols: usize,
    keys: std::ops::Range<usize>,
    vk: &[f32],
    odd: bool,
    d: usize,
) {
    let nh = o_row.len() / d;
    let mut h0 = 0;
    while h0 < nh {
        let g = (nh - h0).min(if d <= 64 { 3 } else { 1 });
        let (o, wg) = (&mut o_row[h0 * d..(h0 + g) * d], &w[h0 * cols..]);
        match (d, g) {
            (64, 3) => sum_rows::<4, 3>(o, wg, cols, keys.clone(), vk, odd),
            (64, 2) => sum_rows::<4, 2>(o, wg, cols, keys.clone(), vk, odd),
            (64, _) => sum_rows::<4, 1>(o, wg, cols, keys.clone(), vk, odd),
            (128, _) => sum_rows::<8, 1>(o, wg, cols, keys.clone(), vk, odd),
            (256, _) => sum_rows::<16, 1>(o, wg, cols, keys.clone(), vk, odd),
            _ => (0..g).for_each(|u| {
                let wk = &w[(h0 + u) * cols..][keys.clone()];
                sum_rows_any(&mut o[u * d..][..d], wk, vk, odd)
            }),
        }
        h0 += g;
    }
}

/// Blocks ahead whose K/V are requested from memory while one is widened: a decode's
/// blocks are scattered over the pool, beyond what the hardware prefetcher follows.
const PREFETCH_BLOCKS: usize = 2;

/// Asks for `data` to be brought into the cache.
#[inline(always)]
fn prefetch(data: &[f16]) {
    #[cfg(target_arch = "x86_64")]
    for line in data.chunks(32) {
        // SAFETY: a prefetch hint on a valid address; it never faults.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            _mm_prefetch::<_MM_HINT_T0>(line.as_ptr() as *const i8);
        }
    }
}

/// Keys per chunk for a block size: KEY_CHUNK rounded up to whole blocks.
fn key_chunk(block_size: usize) -> usize {
    KEY_CHUNK.div_ceil(block_size) * block_size
}

/// `o_h = sum_j w_h[j] v_j` for R heads (weights `w[h * w_stride + key]`) over `C * LANES`-wide
/// V rows, in registers: per element one FMA chain for the even keys (counted from the chunk
/// start) and one for the odd, added at the end; each V row is loaded once for the R heads.
#[inline(always)]
fn sum_rows<const C: usize, const R: usize>(
    o: &mut [f32],
    w: &[f32],
    w_stride: usize,
    keys: std::ops::Range<usize>,
    v: &[f32],
    first_odd: bool,
) {
    let d = C * LANES;
    let [mut even, mut odd] = [[[[0f32; LANES]; C]; R]; 2];
    let k0 = keys.start;
    let wj = |r: usize, j: usize| w[r * w_stride + k0 + j];
    let n = keys.len();
    let mut j = 0;
    if first_odd {
        for (r, a) in odd.iter_mut().enumerate() {
            fma_row(a, wj(r, 0), &v[..d]);
        }
        j = 1;
    }
    while j + 1 < n {
        let (va, vb) = (&v[j * d..][..d], &v[(j + 1) * d..][..d]);
        for r in 0..R {
            fma_row(&mut even[r], wj(r, j), va);
            fma_row(&mut odd[r], wj(r, j + 1), vb);
        }
        j += 2;
    }
    if j < n {
        for (r, a) in even.iter_mut().enumerate() {
            fma_row(a, wj(r, j), &v[j * d..][..d]);
        }
    }
    for r in 0..R {
        for c in 0..C {
            for k in 0..LANES {
                o[r * d + c * LANES + k] = even[r][c][k] + odd[r][c][k];
            }
        }
    }
}

/// `a += wj * vr`, element by element.
#[inline(always)]
fn fma_row<const C: usize>(a: &mut [[f32; LANES]; C], wj: f32, vr: &[f32]) {
    for (c, a) in a.iter_mut().enumerate() {
        for k in 0..LANES {
            a[k] = wj.mul_add(vr[c * LANES + k], a[k]);
        }
    }
}

/// [`sum_rows`] for any head size (up to 512), the same arithmetic. Inlined so that it takes
/// its caller's target features: `mul_add` without FMA is a call into software `fmaf`.
#[inline(always)]
fn sum_rows_any(o: &mut [f32], w: &[f32], v: &[f32], first_odd: bool) {
    let d = o.len();
    assert!(d <= 512, "head_dim {d} above 512 is not supported");
    let mut odd = [0f32; 512];
    let odd = &mut odd[..d];
    o.fill(0.0);
    for (j, (&wj, vr)) in w.iter().zip(v.chunks_exact(d)).enumerate() {
        let acc = if (j + first_odd as usize) % 2 == 1 {
            &mut *odd
        } else {
            &mut *o
        };
        acc.iter_mut()
            .zip(vr)
            .for_each(|(a, &x)| *a = wj.mul_add(x, *a));
    }
    o.iter_mut().zip(&*odd).for_each(|(a, &b)| *a += b);
}

/// f16 -> f32, 16 values per instruction where the CPU has AVX-512 (half's slice conversion
/// goes 8 at a time through a feature check per chunk, most of a decode's attention time).
fn widen(src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len());
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU has AVX-512F; the lengths are equal.
        unsafe { widen_avx512(src, dst) };
        return;
    }
    src.convert_to_f32_slice(dst);
}

/// `a[j] += q * k[j]` as one fused multiply-add per lane.
#[inline(always)]
fn fma_lanes(a: &mut [f32; LANES], q: f32, k: &[f32]) {
    let k: &[f32; LANES] = k[..LANES].try_into().expect("LANES keys");
    for j in 0..LANES {
        a[j] = q.mul_add(k[j], a[j]);
    }
}

/// `q . k_j` for the LANES keys of a K^T chunk (`k_rows[dd * stride + j]`): four independent
/// accumulators over `dd mod 4`, combined in a fixed order.
#[inline(always)]
fn chunk_scores(q: &[f32], k_rows: &[f32], stride: usize) -> [f32; LANES] {
    let [mut a0, mut a1, mut a2, mut a3] = [[0f32; LANES]; 4];
    let mut quads = q.chunks_exact(4);
    for (c, qq) in quads.by_ref().enumerate() {
        let k = &k_rows[4 * c * stride..];
        fma_lanes(&mut a0, qq[0], k);
        fma_lanes(&mut a1, qq[1], &k[stride..]);
        fma_lanes(&mut a2, qq[2], &k[2 * stride..]);
        fma_lanes(&mut a3, qq[3], &k[3 * stride..]);
    }
    let tail = q.len() - quads.remainder().len();
    for (u, &qd) in quads.remainder().iter().enumerate() {
        let a = match u {
            0 => &mut a0,
            1 => &mut a1,
            _ => &mut a2,
        };
        fma_lanes(a, qd, &k_rows[(tail + u) * stride..]);
    }
    let mut s = [0f32; LANES];
    for j in 0..LANES {
        s[j] = (a0[j] + a1[j]) + (a2[j] + a3[j]);
    }
    s
}
