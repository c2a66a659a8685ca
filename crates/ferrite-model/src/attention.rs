//! Paged varlen attention on the CPU: one call per layer covers every request of the step,
//! prefill chunks and decodes together. Causal within each request, GQA by head grouping,
//! online softmax in f32, K/V read through the block tables.

use crate::disjoint::DisjointSlice;
use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

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

/// Query rows per work item: each K/V block is widened to f32 once for the whole tile (32
/// halves the history re-read by long prefills against 16 and keeps a 512-token step in
/// 48 items).
const Q_TILE: usize = 32;

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
    let group = p.num_heads / p.num_kv_heads;
    ITEMS.with_borrow_mut(|items| {
        // One work item = up to Q_TILE query rows of one request x one KV head (its `group`
        // query heads share the K/V loads). Tiles are cut by row index, so a row's arithmetic
        // does not depend on which other rows share its tile. Tiles of a few rows (decodes)
        // split further by query head, so a lone decode still spreads over the threads; each
        // query head's arithmetic is the same either way.
        items.clear();
        let num_rows = *meta.cu_seqlens_q.last().unwrap_or(&0) as usize;
        let mut t = 0;
        while t < num_rows {
            let b = owner(meta.cu_seqlens_q, t);
            let end = (t + Q_TILE).min(meta.cu_seqlens_q[b + 1] as usize);
            let per_item = if end - t < SPLIT_HEADS_BELOW {
                1
            } else {
                group
            };
            for kvh in 0..p.num_kv_heads {
                for h0 in (0..group).step_by(per_item) {
                    items.push(Item {
                        b,
                        rows: t..end,
                        kvh,
                        heads: h0..h0 + per_item,
                    });
                }
            }
            t = end;
        }
        let out = DisjointSlice::new(out);
        items.par_iter().for_each(|it| {
            SCRATCH.with_borrow_mut(|s| {
                attend(q, k_cache, v_cache, meta, p, it, s);
                let width = it.heads.len() * p.head_dim;
                for (i, t) in it.rows.clone().enumerate() {
                    let at = (t * p.num_heads + it.kvh * group + it.heads.start) * p.head_dim;
                    // SAFETY: rows x the item's query heads belong to this item alone.
                    unsafe { out.range(at, width) }.copy_from_slice(&s.out[i * width..][..width]);
                }
            })
        });
    });
}

/// Tiles with fewer rows than this get one item per query head.
const SPLIT_HEADS_BELOW: usize = 4;

/// Up to Q_TILE query rows of request `b`, KV head `kvh`, its query heads `heads`
/// (`0..group` unless split).
#[derive(Clone)]
struct Item {
    b: usize,
    rows: std::ops::Range<usize>,
    kvh: usize,
    heads: std::ops::Range<usize>,
}

/// A compute thread's buffers for one tile, reused across tiles, layers and steps.
#[derive(Default)]
struct TileScratch {
    /// `[rows, heads, head_dim]` result.
    out: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    /// One block of the head in f32: K^T `[head_dim, block_size]`, V `[block_size, head_dim]`.
    kt: Vec<f32>,
    vb: Vec<f32>,
    /// K^T of a chunk narrower than LANES, zero-padded.
    padded: Vec<f32>,
}

thread_local! {
    static ITEMS: std::cell::RefCell<Vec<Item>> = const { std::cell::RefCell::new(Vec::new()) };
    static SCRATCH: std::cell::RefCell<TileScratch> = std::cell::RefCell::default();
}

/// [`attend_tile`] through the widest instruction set the CPU has.
fn attend(
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
    meta: &AttentionMeta,
    p: &AttentionParams,
    it: &Item,
    s: &mut TileScratch,
) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports the features the function is compiled for.
        return unsafe { attend_tile_avx512(q, k_cache, v_cache, meta, p, it, s) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: as above.
        return unsafe { attend_tile_avx2(q, k_cache, v_cache, meta, p, it, s) };
    }
    attend_tile(q, k_cache, v_cache, meta, p, it, s, chunk_scores)
}

/// [`attend_tile`] compiled with AVX2 and FMA (chosen at run time; the default target
/// is baseline x86-64, whose SSE2 code is several times slower here).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_tile_avx2(
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
    meta: &AttentionMeta,
    p: &AttentionParams,
    it: &Item,
    s: &mut TileScratch,
) {
    attend_tile(q, k_cache, v_cache, meta, p, it, s, chunk_scores)
}

/// [`attend_tile`] compiled with AVX-512: the 16-lane dot and exp fill one register.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_tile_avx512(
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
    meta: &AttentionMeta,
    p: &AttentionParams,
    it: &Item,
    s: &mut TileScratch,
) {
    // SAFETY: this function runs only where the CPU has AVX-512F.
    let scores = |q: &[f32], k: &[f32], stride: usize| unsafe { scores_avx512(q, k, stride) };
    attend_tile(q, k_cache, v_cache, meta, p, it, s, scores)
}

/// [`chunk_scores`] with one 16-lane register per accumulator (the compiler's own
/// vectorization of the generic loop splits them across narrower registers and the stack).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn scores_avx512(q: &[f32], k_rows: &[f32], stride: usize) -> [f32; LANES] {
    use std::arch::x86_64::*;
    let d = q.len();
    assert!(d > 0 && k_rows.len() >= (d - 1) * stride + LANES);
    let k = k_rows.as_ptr();
    let fma = |acc: __m512, dd: usize| {
        _mm512_fmadd_ps(
            _mm512_set1_ps(q[dd]),
            _mm512_loadu_ps(k.add(dd * stride)),
            acc,
        )
    };
    let [mut a0, mut a1, mut a2, mut a3] = [_mm512_setzero_ps(); 4];
    let full = d / 4 * 4;
    for dd in (0..full).step_by(4) {
        a0 = fma(a0, dd);
        a1 = fma(a1, dd + 1);
        a2 = fma(a2, dd + 2);
        a3 = fma(a3, dd + 3);
    }
    for (u, dd) in (full..d).enumerate() {
        match u {
            0 => a0 = fma(a0, dd),
            1 => a1 = fma(a1, dd),
            _ => a2 = fma(a2, dd),
        }
    }
    std::mem::transmute(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)))
}

/// Keys per softmax step: a block is walked in chunks of up to 16 keys, one register of
/// scores (two on AVX2).
const LANES: usize = 16;

/// Online softmax for the item's rows and query heads, one chunk of keys at a time, into
/// `s.out` (`[rows, heads, head_dim]`).
///
/// Each query vector's arithmetic is fixed by its own key range and the block layout: scores
/// over the K^T chunk (keys in lanes), masked lanes contribute exact zeros, the denominator
/// keeps one partial sum per lane and the output sums run key by key. So a row gets the same
/// bits whatever else shares its tile or step.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_tile(
    q: &[f32],
    k_cache: &[f16],
    v_cache: &[f16],
    meta: &AttentionMeta,
    p: &AttentionParams,
    it: &Item,
    s: &mut TileScratch,
    chunk_scores: impl Fn(&[f32], &[f32], usize) -> [f32; LANES],
) {
    let (b, rows, kvh) = (it.b, it.rows.clone(), it.kvh);
    let d = p.head_dim;
    let group = p.num_heads / p.num_kv_heads;
    let nh = it.heads.len();
    let bs = meta.block_size;
    let q_start = meta.cu_seqlens_q[b] as usize;
    let q_len = meta.cu_seqlens_q[b + 1] as usize - q_start;
    let k_len = meta.seq_lens_k[b] as usize;
    let table = &meta.block_tables[b * meta.max_blocks..(b + 1) * meta.max_blocks];
    let n = rows.len();
    // Causal range of keys of each row: [first, end).
    let span = |i: usize| {
        let pos = k_len - q_len + (rows.start + i - q_start);
        let first = p.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
        (first, pos + 1)
    };
    let TileScratch {
        out,
        m,
        l,
        kt,
        vb,
        padded,
    } = s;
    for (buf, len, init) in [
        (&mut *out, n * nh * d, 0.0),
        (&mut *m, n * nh, f32::NEG_INFINITY),
        (&mut *l, n * nh * LANES, 0.0),
        (&mut *kt, d * bs, 0.0),
        (&mut *vb, d * bs, 0.0),
        (&mut *padded, d * LANES, 0.0),
    ] {
        buf.clear();
        buf.resize(len, init);
    }
    let (lo_all, hi_all) = (span(0).0, span(n - 1).1);
    let mut blk_start = lo_all / bs * bs;
    while blk_start < hi_all {
        let blk = table[blk_start / bs] as usize;
        let at = (blk * p.num_kv_heads + kvh) * d * bs;
        widen(&k_cache[at..][..d * bs], kt);
        widen(&v_cache[at..][..d * bs], vb);
        for c0 in (0..bs).step_by(LANES) {
            let (key0, lanes) = (blk_start + c0, LANES.min(bs - c0));
            if key0 + lanes <= lo_all || key0 >= hi_all {
                continue;
            }
            let (k_rows, stride) = if lanes == LANES {
                (&kt[c0..], bs)
            } else {
                for dd in 0..d {
                    padded[dd * LANES..][..lanes].copy_from_slice(&kt[dd * bs + c0..][..lanes]);
                }
                (&padded[..], LANES)
            };
            for i in 0..n {
                let (first, end) = span(i);
                let (lo, hi) = (key0.max(first), (key0 + lanes).min(end));
                if lo >= hi {
                    continue;
                }
                let (ja, jb) = (lo - key0, hi - key0);
                for (hi, h) in it.heads.clone().enumerate() {
                    let s_idx = i * nh + hi;
                    let qh = &q[((rows.start + i) * p.num_heads + kvh * group + h) * d..][..d];
                    let mut s = chunk_scores(qh, k_rows, stride);
                    s.iter_mut().for_each(|s| *s *= p.scale);
                    if let Some(cap) = p.softcap {
                        s.iter_mut().for_each(|s| *s = cap * (*s / cap).tanh());
                    }
                    for (j, s) in s.iter_mut().enumerate() {
                        if j < ja || j >= jb {
                            *s = f32::NEG_INFINITY;
                        }
                    }
                    let m_old = m[s_idx];
                    let m_new = s.iter().fold(m_old, |a, &b| a.max(b));
                    let corr = if m_old == f32::NEG_INFINITY {
                        0.0
                    } else {
                        exp_nonpositive(m_old - m_new)
                    };
                    let mut w = [0f32; LANES];
                    for (j, (w, &s)) in w.iter_mut().zip(&s).enumerate() {
                        let e = exp_nonpositive(s - m_new);
                        *w = if j >= ja && j < jb { e } else { 0.0 };
                    }
                    // The softmax denominator, one partial sum per key lane.
                    let lv: &mut [f32; LANES] =
                        (&mut l[s_idx * LANES..][..LANES]).try_into().unwrap();
                    for j in 0..LANES {
                        lv[j] = lv[j] * corr + w[j];
                    }
                    let oh = &mut out[s_idx * d..][..d];
                    let vs = &vb[c0 * d..];
                    match d {
                        64 => accumulate_pv::<4>(oh, corr, &w, ja..jb, vs, d),
                        128 => accumulate_pv::<8>(oh, corr, &w, ja..jb, vs, d),
                        _ => {
                            oh.iter_mut().for_each(|x| *x *= corr);
                            for j in ja..jb {
                                let v = &vs[j * d..][..d];
                                oh.iter_mut()
                                    .zip(v)
                                    .for_each(|(x, &v)| *x = w[j].mul_add(v, *x));
                            }
                        }
                    }
                    m[s_idx] = m_new;
                }
            }
        }
        blk_start += bs;
    }
    for (s_idx, lv) in l.chunks_exact(LANES).enumerate() {
        let li: f32 = lv.iter().sum();
        let inv = if li > 0.0 { 1.0 / li } else { 0.0 };
        out[s_idx * d..(s_idx + 1) * d]
            .iter_mut()
            .for_each(|x| *x *= inv);
    }
}

/// `o = o * corr + sum_j w[j] v_j` for `o` of `C * LANES` values, every element an FMA chain
/// over the keys in order (the same arithmetic as the plain loop for other head sizes), held
/// in registers across the keys.
#[inline(always)]
fn accumulate_pv<const C: usize>(
    o: &mut [f32],
    corr: f32,
    w: &[f32; LANES],
    keys: std::ops::Range<usize>,
    v: &[f32],
    row: usize,
) {
    let mut acc = [[0f32; LANES]; C];
    for (c, a) in acc.iter_mut().enumerate() {
        for k in 0..LANES {
            a[k] = o[c * LANES + k] * corr;
        }
    }
    for j in keys {
        let (wj, vr) = (w[j], &v[j * row..][..C * LANES]);
        for (c, a) in acc.iter_mut().enumerate() {
            for k in 0..LANES {
                a[k] = wj.mul_add(vr[c * LANES + k], a[k]);
            }
        }
    }
    for (c, a) in acc.iter().enumerate() {
        o[c * LANES..][..LANES].copy_from_slice(a);
    }
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_avx512(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = src.len() / 16 * 16;
    for i in (0..n).step_by(16) {
        let h = _mm256_loadu_si256(src.as_ptr().add(i) as *const __m256i);
        _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
    }
    src[n..].convert_to_f32_slice(&mut dst[n..]);
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

/// `exp(x)` for `x <= 0` as `2^k * 2^f` with `|f| <= 1/2` and a degree-6 polynomial
/// (relative error about 1e-7): unlike libm's `expf`, this loop vectorizes.
#[inline(always)]
fn exp_nonpositive(x: f32) -> f32 {
    let t = x.max(-87.0) * std::f32::consts::LOG2_E;
    let k = (t + 0.5).floor();
    let f = (t - k) * std::f32::consts::LN_2;
    let p = 1.0
        + f * (1.0
            + f * (0.5
                + f * (1.0 / 6.0 + f * (1.0 / 24.0 + f * (1.0 / 120.0 + f * (1.0 / 720.0))))));
    p * f32::from_bits(((k as i32 + 127) as u32) << 23)
}
