//! One tile of query rows against its keys: scores, online softmax and the weighted sum of
//! values, portable (the compiler vectorizes the 16-lane loops) with the AVX-512 pieces of
//! `avx512.rs` plugged in where the CPU has them.

use super::work::{row_span, AttentionParams, Item, LayerInputs, ScoreBlock, TileScratch};
use crate::backend::cpu::ops::exp_nonpositive;

/// The scores of each query vector of `b` against consecutive LANES-key pieces of K^T (`k`:
/// `[pieces, d, LANES]`), into `out` as [`ScoreBlock`] lays it out.
#[inline(always)]
pub(super) fn piece_scores(b: &ScoreBlock, k: &[f32], out: &mut [f32]) {
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
pub(super) const LANES: usize = 16;

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
pub(super) fn attend_tile(
    x: &LayerInputs,
    it: &Item,
    part: &mut [f32],
    s: &mut TileScratch,
    scores: impl Fn(&ScoreBlock, &[f32], &mut [f32]),
    sums: impl Fn(&mut [f32], &[f32], usize, std::ops::Range<usize>, &[f32], bool, usize),
) {
    let LayerInputs { q, meta, p, .. } = *x;
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
    let TileScratch { kt, vb, w, blk } = s;
    for (buf, len) in [
        (&mut *kt, d * cols),
        (&mut *vb, cols * d),
        (&mut *w, (12 / nh).max(1) * nh * cols),
    ] {
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
    }
    widen_chunk(x, table, kvh, b0..b1, c0, kt, vb, blk);
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
                (m[s_idx], l[s_idx]) = softmax_weights(wh, pieces.clone(), c0, lo..hi, p);
            }
            let keys_in = (lo - c0)..(hi - c0);
            let vk = &vb[keys_in.start * d..keys_in.end * d];
            let odd = keys_in.start % 2 == 1;
            sums(o_row, w, cols, keys_in, vk, odd, d);
        }
    }
}

/// The chunk's blocks `blocks` of KV head `kvh`, widened to f32: K^T as LANES-key pieces
/// into `kt`, V rows into `vb`, columns from the chunk start `c0`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn widen_chunk(
    x: &LayerInputs,
    table: &[u32],
    kvh: usize,
    blocks: std::ops::Range<usize>,
    c0: usize,
    kt: &mut [f32],
    vb: &mut [f32],
    blk: &mut Vec<f32>,
) {
    let LayerInputs {
        isa,
        k_cache,
        v_cache,
        meta,
        p,
        ..
    } = *x;
    let (d, bs, b1) = (p.head_dim, meta.block_size, blocks.end);
    for bi in blocks {
        let head = table[bi] as usize * p.num_kv_heads + kvh;
        if let Some(&ahead) = table[..b1].get(bi + PREFETCH_BLOCKS) {
            let head = ahead as usize * p.num_kv_heads + kvh;
            k_cache.prefetch(head, d, bs);
            v_cache.prefetch(head, d, bs);
        }
        let col = bi * bs - c0;
        if bs == LANES && col.is_multiple_of(LANES) {
            k_cache.widen_k(head, d, bs, &mut kt[col * d..][..d * bs], isa);
        } else {
            blk.resize(d * bs, 0.0);
            k_cache.widen_k(head, d, bs, blk, isa);
            for dd in 0..d {
                for k in 0..bs {
                    let (pc, lane) = ((col + k) / LANES, (col + k) % LANES);
                    kt[(pc * d + dd) * LANES + lane] = blk[dd * bs + k];
                }
            }
        }
        v_cache.widen_v(head, d, bs, &mut vb[col * d..][..bs * d], isa);
    }
}

/// One query head's scores in `wh` (the pieces of keys `keys`, columns from `c0`) scaled,
/// soft-capped and masked, then turned into the weights `e^(s - m)`; returns (m, the sum of
/// the weights).
#[inline(always)]
fn softmax_weights(
    wh: &mut [f32],
    pieces: std::ops::Range<usize>,
    c0: usize,
    keys: std::ops::Range<usize>,
    p: &AttentionParams,
) -> (f32, f32) {
    let (lo, hi) = (keys.start, keys.end);
    let mut mv = [f32::NEG_INFINITY; LANES];
    for pc in pieces.clone() {
        // A copy in registers, the row's keys as a lane range (masked only in edge
        // pieces), selects for the max: per-key branches, or `f32::max` with its
        // NaN rule, kept this loop scalar (most of the softmax's time).
        let at = pc * LANES;
        let mut sc: [f32; LANES] = wh[at..][..LANES].try_into().unwrap();
        sc.iter_mut().for_each(|s| *s *= p.scale);
        if let Some(cap) = p.softcap {
            sc.iter_mut().for_each(|s| *s = cap * (*s / cap).tanh());
        }
        let base = c0 + at;
        let (from, to) = (lo.saturating_sub(base), hi.saturating_sub(base));
        if from > 0 || to < LANES {
            let (from, to) = (from as u32, to.min(LANES) as u32);
            for (lane, s) in (0..LANES as u32).zip(sc.iter_mut()) {
                let keep = (lane >= from) & (lane < to);
                *s = if keep { *s } else { f32::NEG_INFINITY };
            }
        }
        for (m, &s) in mv.iter_mut().zip(&sc) {
            *m = if s > *m { s } else { *m };
        }
        wh[at..][..LANES].copy_from_slice(&sc);
    }
    let mx = mv
        .iter()
        .fold(f32::NEG_INFINITY, |a, &b| if b > a { b } else { a });
    let mut lv = [0f32; LANES];
    for pc in pieces.clone() {
        let wp: &mut [f32; LANES] = (&mut wh[pc * LANES..][..LANES]).try_into().unwrap();
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
    (mx, lv.iter().sum())
}

/// `o_row`'s `heads x d` outputs as [`sum_rows`] computes them, the heads in groups that
/// share each V row's loads (a head's sums are the same in any group).
#[inline(always)]
pub(super) fn row_sums(
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
            (32, 3) => sum_rows::<2, 3>(o, wg, cols, keys.clone(), vk, odd),
            (32, 2) => sum_rows::<2, 2>(o, wg, cols, keys.clone(), vk, odd),
            (32, _) => sum_rows::<2, 1>(o, wg, cols, keys.clone(), vk, odd),
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
pub(super) const PREFETCH_BLOCKS: usize = 2;

/// Keys per chunk (rounded up to whole blocks). Every row's softmax is computed as one
/// partial per chunk of absolute key positions, merged in chunk order: the grid depends
/// only on positions, so a row gets the same bits whatever tile it sits in, and the chunks
/// of one long decode run on different threads.
const KEY_CHUNK: usize = 256;

/// Keys per chunk for a block size: KEY_CHUNK rounded up to whole blocks.
pub(super) fn key_chunk(block_size: usize) -> usize {
    KEY_CHUNK.div_ceil(block_size) * block_size
}

/// `o_h = sum_j w_h[j] v_j` for R heads (weights `w[h * w_stride + key]`) over `C * LANES`-wide
/// V rows, in registers: per element one FMA chain for the even keys (counted from the chunk
/// start) and one for the odd, added at the end; each V row is loaded once for the R heads.
#[inline(always)]
pub(super) fn sum_rows<const C: usize, const R: usize>(
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
pub(super) fn fma_row<const C: usize>(a: &mut [[f32; LANES]; C], wj: f32, vr: &[f32]) {
    for (c, a) in a.iter_mut().enumerate() {
        for k in 0..LANES {
            a[k] = wj.mul_add(vr[c * LANES + k], a[k]);
        }
    }
}

/// [`sum_rows`] for any head size (up to 512), the same arithmetic. Inlined so that it takes
/// its caller's target features: `mul_add` without FMA is a call into software `fmaf`.
#[inline(always)]
pub(super) fn sum_rows_any(o: &mut [f32], w: &[f32], v: &[f32], first_odd: bool) {
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

/// `a[j] += q * k[j]` as one fused multiply-add per lane.
#[inline(always)]
pub(super) fn fma_lanes(a: &mut [f32; LANES], q: f32, k: &[f32]) {
    let k: &[f32; LANES] = k[..LANES].try_into().expect("LANES keys");
    for j in 0..LANES {
        a[j] = q.mul_add(k[j], a[j]);
    }
}

/// `q . k_j` for the LANES keys of a K^T chunk (`k_rows[dd * stride + j]`): four independent
/// accumulators over `dd mod 4`, combined in a fixed order.
#[inline(always)]
pub(super) fn chunk_scores(q: &[f32], k_rows: &[f32], stride: usize) -> [f32; LANES] {
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
