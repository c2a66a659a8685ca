//! The AVX-512 micro-kernels of the CPU attention: register-blocked scores, V sums with
//! each V row loaded once for a group of heads. Each computes exactly
//! the arithmetic of its portable counterpart in the parent module.

#![cfg(target_arch = "x86_64")]

use super::tile::{row_sums, LANES};
use super::work::ScoreBlock;

/// [`piece_scores`] in 16-lane registers, register-blocked: up to 12 query vectors (several
/// rows x heads) against up to 8 pieces at once, so each K load and each query broadcast feeds
/// several FMAs. Every (vector, piece) score is one FMA chain over the head dimension in order,
/// whatever block it is computed in.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn block_scores_avx512(b: &ScoreBlock, k: &[f32], out: &mut [f32]) {
    let pieces = k.len() / (b.d * LANES);
    let nv = b.rows * b.heads;
    assert!(pieces == 0 || out.len() >= (nv - 1) * b.cols + pieces * LANES);
    assert!(b.q.len() >= b.vector(nv - 1).0 + b.d);
    let mut v0 = 0;
    while v0 < nv {
        let n = (nv - v0).min(12);
        macro_rules! run {
            ($nv:literal, $np:literal) => {
                vectors_scores_avx512::<$nv, $np>(b, v0, k, pieces, out)
            };
        }
        match n {
            1 => run!(1, 8),
            2 => run!(2, 8),
            3 => run!(3, 7),
            4 => run!(4, 5),
            5 => run!(5, 4),
            6 => run!(6, 4),
            7 => run!(7, 3),
            8 => run!(8, 3),
            9 => run!(9, 2),
            10 => run!(10, 2),
            11 => run!(11, 2),
            _ => run!(12, 2),
        }
        v0 += n;
    }
}

/// Vectors `v0..v0 + NV` of `b` against all pieces, NP pieces at a time, then one at a time.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn vectors_scores_avx512<const NV: usize, const NP: usize>(
    b: &ScoreBlock,
    v0: usize,
    k: &[f32],
    pieces: usize,
    out: &mut [f32],
) {
    let qs: [*const f32; NV] = std::array::from_fn(|v| b.q.as_ptr().add(b.vector(v0 + v).0));
    let os: [*mut f32; NV] = std::array::from_fn(|v| out.as_mut_ptr().add(b.vector(v0 + v).1));
    let mut pc = 0;
    while pc + NP <= pieces {
        tile_scores_avx512::<NV, NP>(&qs, b.d, k.as_ptr().add(pc * b.d * LANES), &os, pc);
        pc += NP;
    }
    while pc < pieces {
        tile_scores_avx512::<NV, 1>(&qs, b.d, k.as_ptr().add(pc * b.d * LANES), &os, pc);
        pc += 1;
    }
}

/// NV query vectors x NP consecutive pieces (from piece `pc`), all accumulators in registers.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn tile_scores_avx512<const NV: usize, const NP: usize>(
    qs: &[*const f32; NV],
    d: usize,
    k: *const f32,
    os: &[*mut f32; NV],
    pc: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); NP]; NV];
    for dd in 0..d {
        let mut kr = [_mm512_setzero_ps(); NP];
        for (p, x) in kr.iter_mut().enumerate() {
            *x = _mm512_loadu_ps(k.add((p * d + dd) * LANES));
        }
        for (v, a) in acc.iter_mut().enumerate() {
            let qv = _mm512_set1_ps(*qs[v].add(dd));
            for (a, &kp) in a.iter_mut().zip(&kr) {
                *a = _mm512_fmadd_ps(qv, kp, *a);
            }
        }
    }
    for (v, a) in acc.iter().enumerate() {
        for (p, &x) in a.iter().enumerate() {
            _mm512_storeu_ps(os[v].add((pc + p) * LANES), x);
        }
    }
}

/// [`row_sums`] in 16-lane registers: each V row loaded once into registers for the group's
/// heads (the compiler's version reloads it per head); the same arithmetic.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn row_sums_avx512(
    o_row: &mut [f32],
    w: &[f32],
    cols: usize,
    keys: std::ops::Range<usize>,
    vk: &[f32],
    odd: bool,
    d: usize,
) {
    let nh = o_row.len() / d;
    if !d.is_multiple_of(64) {
        return row_sums(o_row, w, cols, keys, vk, odd, d);
    }
    assert!(vk.len() == keys.len() * d && w.len() >= (nh - 1) * cols + keys.end);
    if d > 64 {
        // Wider heads in strips of 64 dimensions (each element's sum is its own chain).
        for h in 0..nh {
            let wh = w[h * cols..].as_ptr();
            for strip in (0..d).step_by(64) {
                let o = o_row[h * d + strip..].as_mut_ptr();
                let v = vk[strip..].as_ptr();
                sums_avx512::<4, 1>(o, wh, cols, keys.clone(), v, d, odd);
            }
        }
        return;
    }
    let mut h0 = 0;
    while h0 < nh {
        let g = (nh - h0).min(3);
        let (o, wg) = (o_row[h0 * d..].as_mut_ptr(), w[h0 * cols..].as_ptr());
        let v = vk.as_ptr();
        match g {
            3 => sums_avx512::<4, 3>(o, wg, cols, keys.clone(), v, d, odd),
            2 => sums_avx512::<4, 2>(o, wg, cols, keys.clone(), v, d, odd),
            _ => sums_avx512::<4, 1>(o, wg, cols, keys.clone(), v, d, odd),
        }
        h0 += g;
    }
}

/// `acc_h += w_h * v` for one V row `v` (`C * LANES` values) and R heads' weights (`w`, `cols` apart).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn sum_key_avx512<const C: usize, const R: usize>(
    acc: &mut [[std::arch::x86_64::__m512; C]; R],
    v: *const f32,
    w: *const f32,
    cols: usize,
) {
    use std::arch::x86_64::*;
    let mut vr = [_mm512_setzero_ps(); C];
    for (c, x) in vr.iter_mut().enumerate() {
        *x = _mm512_loadu_ps(v.add(c * LANES));
    }
    for (r, a) in acc.iter_mut().enumerate() {
        let wj = _mm512_set1_ps(*w.add(r * cols));
        for (a, &x) in a.iter_mut().zip(&vr) {
            *a = _mm512_fmadd_ps(wj, x, *a);
        }
    }
}

/// R heads' `o_h = sum_j w_h[j] v_j` over `C * LANES` dimensions (even and odd keys in
/// separate chains, as [`sum_rows`]); V rows and the heads' outputs are `d` apart.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn sums_avx512<const C: usize, const R: usize>(
    o: *mut f32,
    w: *const f32,
    cols: usize,
    keys: std::ops::Range<usize>,
    v: *const f32,
    d: usize,
    first_odd: bool,
) {
    use std::arch::x86_64::*;
    let [mut even, mut odd] = [[[_mm512_setzero_ps(); C]; R]; 2];
    let (k0, n) = (keys.start, keys.len());
    let mut j = 0;
    if first_odd && n > 0 {
        sum_key_avx512::<C, R>(&mut odd, v, w.add(k0), cols);
        j = 1;
    }
    while j + 1 < n {
        sum_key_avx512::<C, R>(&mut even, v.add(j * d), w.add(k0 + j), cols);
        sum_key_avx512::<C, R>(&mut odd, v.add((j + 1) * d), w.add(k0 + j + 1), cols);
        j += 2;
    }
    if j < n {
        sum_key_avx512::<C, R>(&mut even, v.add(j * d), w.add(k0 + j), cols);
    }
    for r in 0..R {
        for c in 0..C {
            let sum = _mm512_add_ps(even[r][c], odd[r][c]);
            _mm512_storeu_ps(o.add(r * d + c * LANES), sum);
        }
    }
}
