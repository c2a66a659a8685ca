//! Activations quantized to int8 once per matmul input, in blocks of 32 that line up with
//! the weight blocks.
//!
//! Two roundings ([`Rounding`]): `Coarse` rounds each block to 8 bits (`x ~ d * q`); `Fine` also keeps the
//! rounding residual to 8 more bits (`x ~ e * (256 q + r)`, `e = d / 256`), so a block's dot
//! is two `vpdpbusd`s over the same weight codes: ~16-bit activations for the layers whose
//! error the oracle sees (Q/K/V and the LM head), still exact integer sums (below 2^24).

use super::packed::BLOCK;
use crate::backend::Rounding;
use rayon::prelude::*;

/// `[rows, blocks * 32]` int8 codes with per-block scales; buffers are reused across steps.
#[derive(Default)]
pub struct QuantizedActs {
    pub rows: usize,
    /// Blocks per row, padded to even like the weights.
    pub blocks: usize,
    pub rounding: Rounding,
    pub q: Vec<i8>,
    /// `Fine` only: residual codes, `[rows, blocks * 32]` like `q`.
    pub r: Vec<i8>,
    /// Scale per block: `x ~ d * q` (`Coarse`), `x ~ d * (256 q + r)` (`Fine`).
    pub d: Vec<f32>,
    /// The block's sum `sum(x)` as the codes hold it (`d * sum(q)`, or `d * sum(256 q + r)`):
    /// multiplies a `U4` block's offset `m`.
    pub s: Vec<f32>,
    /// `-128 * sum(q)` over each block, `[rows, blocks]`: turns a block's `sum(code * q)`
    /// into `sum((code - 128) * q)` for `U8` weights.
    pub block_corr: Vec<i32>,
    /// The same for `r` (`Fine` only).
    pub block_corr_r: Vec<i32>,
}

/// Rows the buffers (codes, scales, sums) are padded to: tile kernels compute whole 16-token
/// tiles (the padding rows hold what earlier steps left; their results are never stored).
const ROW_PAD: usize = 16;

impl QuantizedActs {
    /// Quantizes row-major `x` of `rows` rows, `cols` (a multiple of 32) wide.
    pub fn quantize(&mut self, x: &[f32], rows: usize, cols: usize, rounding: Rounding) {
        assert!(cols.is_multiple_of(BLOCK) && x.len() == rows * cols);
        let blocks = (cols / BLOCK).next_multiple_of(2);
        let fine = rounding == Rounding::Fine;
        self.rows = rows;
        self.blocks = blocks;
        self.rounding = rounding;
        let padded = rows.next_multiple_of(ROW_PAD) * blocks;
        self.q.resize(padded * BLOCK, 0);
        self.r.resize(if fine { padded * BLOCK } else { 0 }, 0);
        self.block_corr.resize(padded, 0);
        self.block_corr_r.resize(if fine { padded } else { 0 }, 0);
        self.d.resize(padded, 0.0);
        self.s.resize(padded, 0.0);
        let rows_iter = self
            .q
            .par_chunks_mut(blocks * BLOCK)
            .zip(self.d.par_chunks_mut(blocks))
            .zip(self.s.par_chunks_mut(blocks))
            .zip(self.block_corr.par_chunks_mut(blocks))
            .zip(x.par_chunks(cols));
        if fine {
            let r_rows = self.r.par_chunks_mut(blocks * BLOCK);
            let br_rows = self.block_corr_r.par_chunks_mut(blocks);
            rows_iter
                .zip(r_rows)
                .zip(br_rows)
                .for_each(|((((((q, d), s), bc), x), r), br)| {
                    quantize_row(x, q, Some(&mut *r), d, s);
                    block_sums(q, bc);
                    block_sums(r, br);
                });
        } else {
            rows_iter.for_each(|((((q, d), s), bc), x)| {
                quantize_row(x, q, None, d, s);
                block_sums(q, bc);
            });
        }
    }

    /// The value code `c` of row `t` stands for (tests check the kernels against it).
    pub fn value(&self, t: usize, c: usize) -> f64 {
        let (b, i) = (t * self.blocks + c / BLOCK, t * self.blocks * BLOCK + c);
        let code = match self.rounding {
            Rounding::Coarse => self.q[i] as f64,
            Rounding::Fine => 256.0 * self.q[i] as f64 + self.r[i] as f64,
        };
        self.d[b] as f64 * code
    }
}

/// `-128 * sum(v)` over each block of codes.
fn block_sums(v: &[i8], blocks: &mut [i32]) {
    for (b, v) in blocks.iter_mut().zip(v.chunks_exact(BLOCK)) {
        *b = -128 * v.iter().map(|&v| v as i32).sum::<i32>();
    }
}

/// Adding and subtracting 1.5 * 2^23 rounds an f32 below 2^22 to the nearest integer, ties
/// to even, in plain vectorizable arithmetic (`round_ties_even` becomes a libm call here).
const ROUND: f32 = 12_582_912.0;

/// Symmetric per-block quantization, with the residuals when `r` is given; blocks past the
/// end of `x` are zero.
fn quantize_row(x: &[f32], q: &mut [i8], mut r: Option<&mut [i8]>, d: &mut [f32], s: &mut [f32]) {
    q.fill(0);
    if let Some(r) = r.as_deref_mut() {
        r.fill(0);
    }
    d.fill(0.0);
    s.fill(0.0);
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") {
        // SAFETY: the CPU has AVX-512 F and BW; the slices are as `quantize` sized them.
        return unsafe { avx512::quantize_blocks(x, q, r, d, s) };
    }
    // SAFETY: NEON is baseline on aarch64; slices as above.
    #[cfg(target_arch = "aarch64")]
    return unsafe { neon::quantize_blocks(x, q, r, d, s) };
    #[cfg(not(target_arch = "aarch64"))]
    quantize_blocks(x, q, r, d, s);
}

/// [`quantize_row`]'s blocks, one element at a time (on aarch64, where NEON is baseline,
/// only the test comparing the vector form calls it).
#[cfg_attr(target_arch = "aarch64", allow(dead_code))]
fn quantize_blocks(
    x: &[f32],
    q: &mut [i8],
    mut r: Option<&mut [i8]>,
    d: &mut [f32],
    s: &mut [f32],
) {
    for (b, v) in x.chunks_exact(BLOCK).enumerate() {
        let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
        if amax == 0.0 {
            continue;
        }
        let inv = 127.0 / amax;
        let q = &mut q[b * BLOCK..][..BLOCK];
        let mut sum = 0i32;
        for (q, &x) in q.iter_mut().zip(v) {
            *q = (x * inv + ROUND - ROUND) as i8;
            sum += *q as i32;
        }
        match r.as_deref_mut() {
            None => {
                d[b] = amax / 127.0;
                s[b] = d[b] * sum as f32;
            }
            Some(r) => {
                // The residual is within half a step; 256ths of a step, clamped to int8
                // (only an exact half step reaches 128).
                let mut fine = 256 * sum;
                for ((r, &q), &x) in r[b * BLOCK..][..BLOCK].iter_mut().zip(q.iter()).zip(v) {
                    let res = (x * inv - q as f32) * 256.0;
                    *r = (res + ROUND - ROUND).clamp(-127.0, 127.0) as i8;
                    fine += *r as i32;
                }
                d[b] = amax / 127.0 / 256.0;
                s[b] = d[b] * fine as f32;
            }
        }
    }
}

/// [`quantize_blocks`] 16 elements at a time: per element the same operations in the same
/// order (no fused multiply-add), so the same codes and scales.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{BLOCK, ROUND};
    use std::arch::x86_64::*;

    /// The block's 32 values rounded to their codes: (codes, the codes as f32, `x * inv`).
    #[inline(always)]
    unsafe fn round(x: [__m512; 2], inv: __m512) -> ([__m512i; 2], [__m512; 2], [__m512; 2]) {
        let round = _mm512_set1_ps(ROUND);
        let scaled = x.map(|x| _mm512_mul_ps(x, inv));
        let codes_f = scaled.map(|t| _mm512_sub_ps(_mm512_add_ps(t, round), round));
        (codes_f.map(|c| _mm512_cvttps_epi32(c)), codes_f, scaled)
    }

    /// Stores 32 int32 codes (each within int8) as bytes and returns their sum.
    #[inline(always)]
    unsafe fn store(codes: [__m512i; 2], to: &mut [i8]) -> i32 {
        let p = to.as_mut_ptr() as *mut __m128i;
        _mm_storeu_si128(p, _mm512_cvtepi32_epi8(codes[0]));
        _mm_storeu_si128(p.add(1), _mm512_cvtepi32_epi8(codes[1]));
        _mm512_reduce_add_epi32(_mm512_add_epi32(codes[0], codes[1]))
    }

    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn quantize_blocks(
        x: &[f32],
        q: &mut [i8],
        mut r: Option<&mut [i8]>,
        d: &mut [f32],
        s: &mut [f32],
    ) {
        let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
        let steps = _mm512_set1_ps(256.0);
        for (b, v) in x.chunks_exact(BLOCK).enumerate() {
            let v = [
                _mm512_loadu_ps(v.as_ptr()),
                _mm512_loadu_ps(v.as_ptr().add(16)),
            ];
            let amax =
                _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
            if amax == 0.0 {
                continue;
            }
            let inv = 127.0 / amax;
            let (codes, codes_f, scaled) = round(v, _mm512_set1_ps(inv));
            let sum = store(codes, &mut q[b * BLOCK..][..BLOCK]);
            match r.as_deref_mut() {
                None => {
                    d[b] = amax / 127.0;
                    s[b] = d[b] * sum as f32;
                }
                Some(r) => {
                    let round = _mm512_set1_ps(ROUND);
                    let res: [__m512i; 2] = std::array::from_fn(|i| {
                        let res = _mm512_mul_ps(_mm512_sub_ps(scaled[i], codes_f[i]), steps);
                        let res = _mm512_sub_ps(_mm512_add_ps(res, round), round);
                        _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(res, lo), hi))
                    });
                    let fine = 256 * sum + store(res, &mut r[b * BLOCK..][..BLOCK]);
                    d[b] = amax / 127.0 / 256.0;
                    s[b] = d[b] * fine as f32;
                }
            }
        }
    }
}

/// [`quantize_blocks`] 4 elements at a time with NEON: the same operations in the same
/// order, so the same codes and scales.
#[cfg(target_arch = "aarch64")]
mod neon {
    use super::{BLOCK, ROUND};
    use std::arch::aarch64::*;

    /// Four values' codes (as f32 and int32) and `x * inv`.
    #[inline(always)]
    unsafe fn round(x: float32x4_t, inv: float32x4_t) -> (int32x4_t, float32x4_t, float32x4_t) {
        let round = vdupq_n_f32(ROUND);
        let scaled = vmulq_f32(x, inv);
        let codes_f = vsubq_f32(vaddq_f32(scaled, round), round);
        (vcvtq_s32_f32(codes_f), codes_f, scaled)
    }

    /// Stores 32 int32 codes (each within int8) as bytes and returns their sum.
    #[inline(always)]
    unsafe fn store(codes: [int32x4_t; 8], to: &mut [i8]) -> i32 {
        let mut sum = vdupq_n_s32(0);
        for (i, pair) in codes.chunks_exact(2).enumerate() {
            let h = vcombine_s16(vmovn_s32(pair[0]), vmovn_s32(pair[1]));
            vst1_s8(to.as_mut_ptr().add(8 * i), vmovn_s16(h));
            sum = vaddq_s32(sum, vaddq_s32(pair[0], pair[1]));
        }
        vaddvq_s32(sum)
    }

    #[target_feature(enable = "neon")]
    pub(super) unsafe fn quantize_blocks(
        x: &[f32],
        q: &mut [i8],
        mut r: Option<&mut [i8]>,
        d: &mut [f32],
        s: &mut [f32],
    ) {
        let (lo, hi) = (vdupq_n_f32(-127.0), vdupq_n_f32(127.0));
        for (b, v) in x.chunks_exact(BLOCK).enumerate() {
            let v: [float32x4_t; 8] = std::array::from_fn(|i| vld1q_f32(v.as_ptr().add(4 * i)));
            let amax = vmaxvq_f32(
                v.iter()
                    .fold(vdupq_n_f32(0.0), |m, &x| vmaxq_f32(m, vabsq_f32(x))),
            );
            if amax == 0.0 {
                continue;
            }
            let inv = vdupq_n_f32(127.0 / amax);
            let rounded = v.map(|x| round(x, inv));
            let sum = store(rounded.map(|r| r.0), &mut q[b * BLOCK..][..BLOCK]);
            match r.as_deref_mut() {
                None => {
                    d[b] = amax / 127.0;
                    s[b] = d[b] * sum as f32;
                }
                Some(r) => {
                    let round = vdupq_n_f32(ROUND);
                    let res = rounded.map(|(_, codes_f, scaled)| {
                        let res = vmulq_n_f32(vsubq_f32(scaled, codes_f), 256.0);
                        let res = vsubq_f32(vaddq_f32(res, round), round);
                        vcvtq_s32_f32(vminq_f32(vmaxq_f32(res, lo), hi))
                    });
                    let fine = 256 * sum + store(res, &mut r[b * BLOCK..][..BLOCK]);
                    d[b] = amax / 127.0 / 256.0;
                    s[b] = d[b] * fine as f32;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector form gives the scalar form's codes and scales exactly, ties and zero
    /// blocks included.
    #[test]
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    fn vector_blocks_match_scalar_blocks() {
        #[cfg(target_arch = "x86_64")]
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")) {
            return;
        }
        let n = 64 * BLOCK;
        let mut x: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 + 13) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        x[..BLOCK].fill(0.0);
        // Exact half steps: amax 127 makes every value its own code plus a half.
        for (j, v) in x[BLOCK..2 * BLOCK].iter_mut().enumerate() {
            *v = if j == 0 { 127.0 } else { j as f32 - 15.5 };
        }
        for fine in [false, true] {
            let run = |vector: bool| {
                let (mut q, mut r) = (vec![0i8; n], vec![0i8; n]);
                let (mut d, mut s) = (vec![0f32; n / BLOCK], vec![0f32; n / BLOCK]);
                let r_opt = fine.then_some(&mut r[..]);
                match vector {
                    // SAFETY: checked above (NEON is baseline on aarch64).
                    #[cfg(target_arch = "x86_64")]
                    true => unsafe { avx512::quantize_blocks(&x, &mut q, r_opt, &mut d, &mut s) },
                    #[cfg(target_arch = "aarch64")]
                    true => unsafe { neon::quantize_blocks(&x, &mut q, r_opt, &mut d, &mut s) },
                    false => quantize_blocks(&x, &mut q, r_opt, &mut d, &mut s),
                }
                (q, r, d, s)
            };
            assert_eq!(run(true), run(false), "fine {fine}");
        }
    }
}
