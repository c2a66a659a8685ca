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
    let row = p.num_kv_heads * d;
    // One work item = one query token x one KV head (its `group` query heads share K/V loads).
    out.par_chunks_mut(group * d)
        .enumerate()
        .for_each(|(item, o)| {
            let t = item / p.num_kv_heads;
            let kvh = item % p.num_kv_heads;
            let b = owner(meta.cu_seqlens_q, t);
            let q_start = meta.cu_seqlens_q[b] as usize;
            let q_len = meta.cu_seqlens_q[b + 1] as usize - q_start;
            let k_len = meta.seq_lens_k[b] as usize;
            let pos = k_len - q_len + (t - q_start);
            let first = p.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let table = &meta.block_tables[b * meta.max_blocks..(b + 1) * meta.max_blocks];
            let qs = &q[(t * p.num_heads + kvh * group) * d..][..group * d];
            attend_group(
                qs,
                k_cache,
                v_cache,
                table,
                first,
                pos + 1,
                row,
                kvh * d,
                meta.block_size,
                p,
                o,
            );
        });
}

/// Online softmax over keys `first..end` for the `group` heads in `qs`, one block at a time.
#[allow(clippy::too_many_arguments)]
fn attend_group(
    qs: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    table: &[u32],
    first: usize,
    end: usize,
    row: usize,
    head_off: usize,
    block_size: usize,
    p: &AttentionParams,
    out: &mut [f32],
) {
    let d = p.head_dim;
    let group = qs.len() / d;
    const MAX_GROUP: usize = 16;
    assert!(
        group <= MAX_GROUP,
        "GQA group of {group} heads is not supported"
    );
    let mut m = [f32::NEG_INFINITY; MAX_GROUP];
    let mut l = [0f32; MAX_GROUP];
    out.fill(0.0);
    let mut scores = vec![0f32; block_size * group];
    let mut j = first;
    while j < end {
        let blk = table[j / block_size] as usize;
        let off = j % block_size;
        let n = (block_size - off).min(end - j);
        let base = (blk * block_size + off) * row + head_off;
        for h in 0..group {
            let qh = &qs[h * d..(h + 1) * d];
            let mut tile_max = f32::NEG_INFINITY;
            for i in 0..n {
                let k = &k_cache[base + i * row..][..d];
                let mut s = dot(qh, k) * p.scale;
                if let Some(cap) = p.softcap {
                    s = cap * (s / cap).tanh();
                }
                scores[h * block_size + i] = s;
                tile_max = tile_max.max(s);
            }
            let m_new = m[h].max(tile_max);
            let corr = (m[h] - m_new).exp();
            let oh = &mut out[h * d..(h + 1) * d];
            if corr != 1.0 {
                oh.iter_mut().for_each(|x| *x *= corr);
            }
            l[h] *= corr;
            for i in 0..n {
                let w = (scores[h * block_size + i] - m_new).exp();
                l[h] += w;
                let v = &v_cache[base + i * row..][..d];
                oh.iter_mut().zip(v).for_each(|(o, v)| *o += w * v);
            }
            m[h] = m_new;
        }
        j += n;
    }
    for h in 0..group {
        let inv = if l[h] > 0.0 { 1.0 / l[h] } else { 0.0 };
        out[h * d..(h + 1) * d].iter_mut().for_each(|x| *x *= inv);
    }
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent lanes so the compiler vectorizes without reassociating one sum.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for i in 0..8 {
            acc[i] += a[c * 8 + i] * b[c * 8 + i];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}
