//! 256-bit tiles: one block per register, `vpmaddubsw` + `vpmaddwd` for the exact block
//! dot, FMA for the scaling.

// Tiles index accumulators, codes and activations by the same (row, token); range loops
// say that more plainly than zipped iterators.
#![allow(clippy::needless_range_loop)]

use super::activations::QuantizedActs;
use super::packed::{PackedWeight, BLOCK};
use super::tile::Out;
use half::f16;
use std::arch::x86_64::*;

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Two f16 scales as f32 broadcasts.
#[inline(always)]
unsafe fn scale_pair(d: *const f16) -> (__m256, __m256) {
    let two = _mm_cvtph_ps(_mm_cvtsi32_si128((d as *const i32).read_unaligned()));
    (
        _mm256_broadcastss_ps(two),
        _mm256_broadcastss_ps(_mm_movehdup_ps(two)),
    )
}

/// `sum_b m[b] * s[b]` over `n` (even) blocks: `U4` offsets times activation block sums.
#[inline(always)]
unsafe fn offset_term(m: *const f16, s: *const f32, n: usize) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut k = 0;
    while k + 8 <= n {
        let mv = _mm256_cvtph_ps(_mm_loadu_si128(m.add(k) as *const __m128i));
        acc = _mm256_fmadd_ps(mv, _mm256_loadu_ps(s.add(k)), acc);
        k += 8;
    }
    let (mut mt, mut st) = ([f16::ZERO; 8], [0f32; 8]);
    std::ptr::copy_nonoverlapping(m.add(k), mt.as_mut_ptr(), n - k);
    std::ptr::copy_nonoverlapping(s.add(k), st.as_mut_ptr(), n - k);
    let mv = _mm256_cvtph_ps(_mm_loadu_si128(mt.as_ptr() as *const __m128i));
    hsum(_mm256_fmadd_ps(mv, _mm256_loadu_ps(st.as_ptr()), acc))
}

/// `sum(u * q)` per 8 lanes for unsigned `u <= 128` and int8 `q` (no i16 saturation).
#[inline(always)]
unsafe fn dot_small(u: __m256i, q: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1))
}

/// The block dot of `u` with `q`, or with `256 q + r` for fine activations (`F`).
#[inline(always)]
unsafe fn dot<const F: bool>(u: __m256i, q: __m256i, r: __m256i) -> __m256i {
    let d = dot_small(u, q);
    if F {
        _mm256_add_epi32(_mm256_slli_epi32(d, 8), dot_small(u, r))
    } else {
        d
    }
}

/// Prefetches the codes of the rows two tiles after `r0`'s: a tile reads its rows' codes as
/// R short interleaved streams that the hardware prefetcher does not follow in time (a decode
/// waited on memory: 1.3x slower). Past the matrix's end this reads nothing: a prefetch
/// never faults.
#[inline(always)]
unsafe fn prefetch_rows<const R: usize>(w: &PackedWeight, r0: usize, row_bytes: usize) {
    let from = w.data.as_ptr().wrapping_add((r0 + 2 * R) * row_bytes) as *const i8;
    for line in (0..R * row_bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(from.wrapping_add(line));
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile_u4<const R: usize, const C: usize, const F: bool>(
    w: &PackedWeight,
    r0: usize,
    a: &QuantizedActs,
    t0: usize,
    out: Out<'_>,
) {
    let nb = w.blocks;
    let mask = _mm256_set1_epi8(0x0F);
    prefetch_rows::<R>(w, r0, nb * 16);
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    for p in 0..nb / 2 {
        let b = 2 * p;
        let mut q0 = [_mm256_setzero_si256(); C];
        let mut q1 = [_mm256_setzero_si256(); C];
        let (mut rq0, mut rq1) = ([_mm256_setzero_si256(); C], [_mm256_setzero_si256(); C]);
        for j in 0..C {
            let ai = ((t0 + j) * nb + b) * BLOCK;
            let base = a.q.as_ptr().add(ai);
            q0[j] = _mm256_loadu_si256(base as *const __m256i);
            q1[j] = _mm256_loadu_si256(base.add(BLOCK) as *const __m256i);
            if F {
                let base = a.r.as_ptr().add(ai);
                rq0[j] = _mm256_loadu_si256(base as *const __m256i);
                rq1[j] = _mm256_loadu_si256(base.add(BLOCK) as *const __m256i);
            }
        }
        for i in 0..R {
            let r = r0 + i;
            let x = _mm256_loadu_si256(w.data.as_ptr().add((r * nb + b) * 16) as *const __m256i);
            let lo = _mm256_and_si256(x, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), mask);
            let (d0, d1) = scale_pair(w.d.as_ptr().add(r * nb + b));
            for j in 0..C {
                let ai = (t0 + j) * nb + b;
                let s0 = _mm256_mul_ps(d0, _mm256_set1_ps(*a.d.get_unchecked(ai)));
                let s1 = _mm256_mul_ps(d1, _mm256_set1_ps(*a.d.get_unchecked(ai + 1)));
                let p0 = _mm256_cvtepi32_ps(dot::<F>(lo, q0[j], rq0[j]));
                let p1 = _mm256_cvtepi32_ps(dot::<F>(hi, q1[j], rq1[j]));
                acc[i][j] = _mm256_fmadd_ps(p0, s0, acc[i][j]);
                acc[i][j] = _mm256_fmadd_ps(p1, s1, acc[i][j]);
            }
        }
    }
    for i in 0..R {
        let r = r0 + i;
        for j in 0..C {
            let t = t0 + j;
            let off = offset_term(w.m.as_ptr().add(r * nb), a.s.as_ptr().add(t * nb), nb);
            out.set(t, r, hsum(acc[i][j]) + off);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile_u8<const R: usize, const C: usize, const F: bool>(
    w: &PackedWeight,
    r0: usize,
    a: &QuantizedActs,
    t0: usize,
    out: Out<'_>,
) {
    let nb = w.blocks;
    let flip = _mm256_set1_epi8(-128);
    prefetch_rows::<R>(w, r0, nb * BLOCK);
    let mut acc = [[_mm256_setzero_ps(); C]; R];
    for b in 0..nb {
        let mut q = [_mm256_setzero_si256(); C];
        let mut fine = [_mm256_setzero_si256(); C];
        for j in 0..C {
            let ai = ((t0 + j) * nb + b) * BLOCK;
            q[j] = _mm256_loadu_si256(a.q.as_ptr().add(ai) as *const __m256i);
            if F {
                fine[j] = _mm256_loadu_si256(a.r.as_ptr().add(ai) as *const __m256i);
            }
        }
        for i in 0..R {
            let r = r0 + i;
            // code - 128 as int8; |.| and the sign moved onto q keep vpmaddubsw exact.
            let c = _mm256_xor_si256(
                _mm256_loadu_si256(w.data.as_ptr().add((r * nb + b) * BLOCK) as *const __m256i),
                flip,
            );
            let abs = _mm256_sign_epi8(c, c);
            let dw = _mm256_set1_ps(_mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
                *(w.d.as_ptr().add(r * nb + b) as *const u16) as i32,
            ))));
            for j in 0..C {
                let s = _mm256_mul_ps(dw, _mm256_set1_ps(*a.d.get_unchecked((t0 + j) * nb + b)));
                let p = _mm256_cvtepi32_ps(dot::<F>(
                    abs,
                    _mm256_sign_epi8(q[j], c),
                    _mm256_sign_epi8(fine[j], c),
                ));
                acc[i][j] = _mm256_fmadd_ps(p, s, acc[i][j]);
            }
        }
    }
    for i in 0..R {
        for j in 0..C {
            out.set(t0 + j, r0 + i, hsum(acc[i][j]));
        }
    }
}
