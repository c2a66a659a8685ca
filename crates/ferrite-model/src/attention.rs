//! Paged varlen attention on the CPU: one call per layer covers every request of the step,
//! prefill chunks and decodes together. Causal within each request, GQA by head grouping,
//! online softmax in f32, K/V read through the block tables.

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

/// Query rows per work item: each K/V block is loaded once for the whole tile.
const Q_TILE: usize = 16;

/// `q`: `[T, num_heads, head_dim]`; caches: `[num_blocks, block_size, num_kv_heads, head_dim]`;
/// `out`: `[T, num_heads, head_dim]`.
pub fn paged_attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    meta: &AttentionMeta,
    p: &AttentionParams,
    out: &mut [f32],
) {
    let d = p.head_dim;
    let group = p.num_heads / p.num_kv_heads;
    // One work item = up to Q_TILE query rows of one request x one KV head (its `group` query
    // heads share the K/V loads). Tiles are cut by row index, so a row's arithmetic does not
    // depend on which other rows share its tile.
    let mut items = Vec::new();
    let num_rows = *meta.cu_seqlens_q.last().unwrap_or(&0) as usize;
    let mut t = 0;
    while t < num_rows {
        let b = owner(meta.cu_seqlens_q, t);
        let end = (t + Q_TILE).min(meta.cu_seqlens_q[b + 1] as usize);
        for kvh in 0..p.num_kv_heads {
            items.push((b, t, end, kvh));
        }
        t = end;
    }
    let tiles: Vec<Vec<f32>> = items
        .par_iter()
        .map(|&(b, t0, t1, kvh)| {
            let rows = t0..t1;
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU supports the features the function is compiled for.
                return unsafe { attend_tile_avx512(q, k_cache, v_cache, meta, p, b, rows, kvh) };
            }
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: as above.
                return unsafe { attend_tile_avx2(q, k_cache, v_cache, meta, p, b, rows, kvh) };
            }
            attend_tile(q, k_cache, v_cache, meta, p, b, rows, kvh)
        })
        .collect();
    for (&(_, t0, t1, kvh), tile) in items.iter().zip(&tiles) {
        for (i, t) in (t0..t1).enumerate() {
            out[(t * p.num_heads + kvh * group) * d..][..group * d]
                .copy_from_slice(&tile[i * group * d..][..group * d]);
        }
    }
}

/// [`attend_tile`] compiled with AVX2 and FMA (chosen at run time; the default target
/// is baseline x86-64, whose SSE2 code is several times slower here).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_tile_avx2(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    meta: &AttentionMeta,
    p: &AttentionParams,
    b: usize,
    rows: std::ops::Range<usize>,
    kvh: usize,
) -> Vec<f32> {
    attend_tile(q, k_cache, v_cache, meta, p, b, rows, kvh)
}

/// [`attend_tile`] compiled with AVX-512: the 16-lane dot and exp fill one register.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn attend_tile_avx512(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    meta: &AttentionMeta,
    p: &AttentionParams,
    b: usize,
    rows: std::ops::Range<usize>,
    kvh: usize,
) -> Vec<f32> {
    attend_tile(q, k_cache, v_cache, meta, p, b, rows, kvh)
}

/// Online softmax for rows `rows` of request `b` and the `group` heads of KV head `kvh`,
/// one K/V block at a time; returns `[rows, group, head_dim]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn attend_tile(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    meta: &AttentionMeta,
    p: &AttentionParams,
    b: usize,
    rows: std::ops::Range<usize>,
    kvh: usize,
) -> Vec<f32> {
    let d = p.head_dim;
    let group = p.num_heads / p.num_kv_heads;
    let row = p.num_kv_heads * d;
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
    let mut out = vec![0f32; n * group * d];
    let mut m = vec![f32::NEG_INFINITY; n * group];
    let mut l = vec![0f32; n * group];
    let mut scores = vec![0f32; bs];
    let (lo_all, hi_all) = (span(0).0, span(n - 1).1);
    let mut blk_start = lo_all / bs * bs;
    while blk_start < hi_all {
        let blk = table[blk_start / bs] as usize;
        for i in 0..n {
            let (first, end) = span(i);
            let (lo, hi) = (blk_start.max(first), (blk_start + bs).min(end));
            if lo >= hi {
                continue;
            }
            let base = (blk * bs + lo % bs) * row + kvh * d;
            let qrow = &q[((rows.start + i) * p.num_heads + kvh * group) * d..][..group * d];
            for h in 0..group {
                let qh = &qrow[h * d..(h + 1) * d];
                let s_idx = i * group + h;
                let mut tile_max = f32::NEG_INFINITY;
                for j in 0..hi - lo {
                    let k = &k_cache[base + j * row..][..d];
                    let mut s = dot(qh, k) * p.scale;
                    if let Some(cap) = p.softcap {
                        s = cap * (s / cap).tanh();
                    }
                    scores[j] = s;
                    tile_max = tile_max.max(s);
                }
                let m_new = m[s_idx].max(tile_max);
                let corr = (m[s_idx] - m_new).exp();
                let oh = &mut out[s_idx * d..(s_idx + 1) * d];
                if corr != 1.0 {
                    oh.iter_mut().for_each(|x| *x *= corr);
                }
                l[s_idx] *= corr;
                let weights = &mut scores[..hi - lo];
                weights
                    .iter_mut()
                    .for_each(|s| *s = exp_nonpositive(*s - m_new));
                l[s_idx] += weights.iter().sum::<f32>();
                for (j, &w) in weights.iter().enumerate() {
                    let v = &v_cache[base + j * row..][..d];
                    oh.iter_mut().zip(v).for_each(|(o, v)| *o += w * v);
                }
                m[s_idx] = m_new;
            }
        }
        blk_start += bs;
    }
    for (s_idx, &li) in l.iter().enumerate() {
        let inv = if li > 0.0 { 1.0 / li } else { 0.0 };
        out[s_idx * d..(s_idx + 1) * d]
            .iter_mut()
            .for_each(|x| *x *= inv);
    }
    out
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

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Sixteen independent lanes over exact chunks: no bounds checks, so the loop vectorizes
    // (one fixed summation order, whatever the batch).
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}
