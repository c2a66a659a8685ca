//! 512-bit tiles: two blocks per register and `vpdpbusd` for the exact block dots.

// Tiles index accumulators, codes and activations by the same (row, token); range loops
// say that more plainly than zipped iterators.
#![allow(clippy::needless_range_loop)]

use super::activations::QuantizedActs;
use super::packed::{PackedWeight, BLOCK};
use super::tile::Out;
use half::f16;
use std::arch::x86_64::*;

/// The f16 scales of blocks `b` and `b + 1` as `[d[b]; 8] ++ [d[b + 1]; 8]` in f32.
#[inline(always)]
unsafe fn pair_scales(d: *const f16) -> __m512 {
    let two = _mm_cvtph_ps(_mm_cvtsi32_si128((d as *const i32).read_unaligned()));
    let idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(two))
}

/// `sum_b m[b] * s[b]` over `n` blocks: `U4` offsets times activation block sums.
#[inline(always)]
unsafe fn offset_term(m: *const f16, s: *const f32, n: usize) -> f32 {
    let mut acc = _mm512_setzero_ps();
    for k in (0..n).step_by(16) {
        let lanes: __mmask16 = if n - k >= 16 {
            0xFFFF
        } else {
            (1 << (n - k)) - 1
        };
        let mv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, m.add(k) as *const i16));
        acc = _mm512_fmadd_ps(mv, _mm512_maskz_loadu_ps(lanes, s.add(k)), acc);
    }
    _mm512_reduce_add_ps(acc)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
pub(super) unsafe fn tile_u4<const R: usize, const C: usize, const F: bool>(
    w: &PackedWeight,
    r0: usize,
    a: &QuantizedActs,
    t0: usize,
    out: Out<'_>,
) {
    let nb = w.blocks;
    let mask = _mm256_set1_epi8(0x0F);
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    for p in 0..nb / 2 {
        let b = 2 * p;
        let mut q = [_mm512_setzero_si512(); C];
        let mut fine = [_mm512_setzero_si512(); C];
        for j in 0..C {
            let ai = ((t0 + j) * nb + b) * BLOCK;
            q[j] = _mm512_loadu_si512(a.q.as_ptr().add(ai) as *const _);
            if F {
                fine[j] = _mm512_loadu_si512(a.r.as_ptr().add(ai) as *const _);
            }
        }
        for i in 0..R {
            let r = r0 + i;
            let x = _mm256_loadu_si256(w.data.as_ptr().add((r * nb + b) * 16) as *const __m256i);
            let lo = _mm256_and_si256(x, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), mask);
            let codes = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            let dw = pair_scales(w.d.as_ptr().add(r * nb + b));
            for j in 0..C {
                let da = _mm512_loadu_ps(a.d_pairs.as_ptr().add(((t0 + j) * nb + b) * 8));
                let mut dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, q[j]);
                if F {
                    dot = _mm512_dpbusd_epi32(_mm512_slli_epi32(dot, 8), codes, fine[j]);
                }
                acc[i][j] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, da), acc[i][j]);
            }
        }
    }
    for i in 0..R {
        let r = r0 + i;
        for j in 0..C {
            let t = t0 + j;
            let off = offset_term(w.m.as_ptr().add(r * nb), a.s.as_ptr().add(t * nb), nb);
            out.set(t, r, _mm512_reduce_add_ps(acc[i][j]) + off);
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
pub(super) unsafe fn tile_u8<const R: usize, const C: usize, const F: bool>(
    w: &PackedWeight,
    r0: usize,
    a: &QuantizedActs,
    t0: usize,
    out: Out<'_>,
) {
    let nb = w.blocks;
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    for p in 0..nb / 2 {
        let b = 2 * p;
        let mut q = [_mm512_setzero_si512(); C];
        let mut corr = [_mm512_setzero_si512(); C];
        let mut fine = [_mm512_setzero_si512(); C];
        let mut corr_r = [_mm512_setzero_si512(); C];
        for j in 0..C {
            let ai = (t0 + j) * nb + b;
            q[j] = _mm512_loadu_si512(a.q.as_ptr().add(ai * BLOCK) as *const _);
            corr[j] = _mm512_loadu_si512(a.corr.as_ptr().add(ai * 8) as *const _);
            if F {
                fine[j] = _mm512_loadu_si512(a.r.as_ptr().add(ai * BLOCK) as *const _);
                corr_r[j] = _mm512_loadu_si512(a.corr_r.as_ptr().add(ai * 8) as *const _);
            }
        }
        for i in 0..R {
            let r = r0 + i;
            let codes = _mm512_loadu_si512(w.data.as_ptr().add((r * nb + b) * BLOCK) as *const _);
            let dw = pair_scales(w.d.as_ptr().add(r * nb + b));
            for j in 0..C {
                let da = _mm512_loadu_ps(a.d_pairs.as_ptr().add(((t0 + j) * nb + b) * 8));
                // Starting from -128 * sum(q) makes the u8 codes signed: sum((code - 128) * q).
                let mut dot = _mm512_dpbusd_epi32(corr[j], codes, q[j]);
                if F {
                    let hi = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), corr_r[j]);
                    dot = _mm512_dpbusd_epi32(hi, codes, fine[j]);
                }
                acc[i][j] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, da), acc[i][j]);
            }
        }
    }
    for i in 0..R {
        for j in 0..C {
            out.set(t0 + j, r0 + i, _mm512_reduce_add_ps(acc[i][j]));
        }
    }
}
