//! `vpdpbusd` over weight panels ([`Layout::Panels`]): lanes are a panel's 16 rows, and one
//! block's 16 dots with a token are 8 `vpdpbusd`s of the rows' codes against the token's 4
//! codes broadcast. The block's scales then apply once per 512 products (a row-major kernel
//! must apply them once per 64: its 16 lanes are 4 codes of 2 blocks), so the integer unit,
//! not the float one, bounds the matmul. The kernel set of CPUs with AVX-512 VNNI, and the
//! AMX set's kernel for steps with few tokens; [`accumulate`] ends it and the AMX tile
//! alike, so their results agree bit for bit.

// Tiles index accumulators and token rows by the same position; range loops say so plainly.
#![allow(clippy::needless_range_loop)]

use super::activations::QuantizedActs;
use super::packed::{Codes, Layout, PackedWeight, BLOCK, PANEL_ROWS};
use super::tile::Out;
use crate::backend::Rounding;
use std::arch::x86_64::*;

/// Weight rows per panel: the 16 lanes.
pub(super) const PANEL: usize = PANEL_ROWS;
/// Bytes of one slot of a panel (a block of `U8` codes, a pair of blocks of `U4` codes):
/// 8 groups of 16 rows x 4 codes.
pub(super) const SLOT: usize = 512;
/// Tokens whose accumulators stay in registers while a slot's codes are loaded once.
pub(super) const TOKENS: usize = 8;
/// Slots ahead whose codes are prefetched (4 KiB): a panel's codes are a few KiB, too short
/// a stream for the hardware prefetcher to ramp up on, so without it a decode waits on
/// memory (1.4x slower) and a verify step's dots never overlap the loads.
const PREFETCH_SLOTS: usize = 8;

/// `out[t, r] = sum_k a[t, k] * w[r, k]` for weight rows `rows` (whole panels but the last)
/// and every token, [`TOKENS`] at a time.
pub(super) fn matmul_rows(
    w: &PackedWeight,
    a: &QuantizedActs,
    rows: std::ops::Range<usize>,
    out: Out,
) {
    assert_eq!(w.layout, Layout::Panels, "column kernels read panels");
    for r0 in rows.clone().step_by(PANEL) {
        let nr = PANEL.min(rows.end - r0);
        for t0 in (0..a.rows).step_by(TOKENS) {
            let tokens = t0..(t0 + TOKENS).min(a.rows);
            // SAFETY: the CPU has AVX-512 VNNI (`Isa::Avx512Vnni` or `Isa::Amx` is
            // supported), the panel exists and the tokens are in range.
            unsafe { columns_of(w, a, r0 / PANEL, nr, tokens, out) }
        }
    }
}

/// [`columns`] for the weights' codes, the activations' rounding and the token count.
///
/// # Safety
/// The CPU has AVX-512 VNNI; `panel` and `tokens` are in range, `tokens` at most [`TOKENS`].
pub(super) unsafe fn columns_of(
    w: &PackedWeight,
    a: &QuantizedActs,
    panel: usize,
    nr: usize,
    tokens: std::ops::Range<usize>,
    out: Out,
) {
    // One instance per token count: its accumulators stay in registers.
    macro_rules! by_count {
        ($u4:literal, $f:literal) => {
            match tokens.len() {
                0 => {}
                1 => columns::<$u4, $f, 1>(w, a, panel, nr, tokens.start, out),
                2 => columns::<$u4, $f, 2>(w, a, panel, nr, tokens.start, out),
                3 => columns::<$u4, $f, 3>(w, a, panel, nr, tokens.start, out),
                4 => columns::<$u4, $f, 4>(w, a, panel, nr, tokens.start, out),
                5 => columns::<$u4, $f, 5>(w, a, panel, nr, tokens.start, out),
                6 => columns::<$u4, $f, 6>(w, a, panel, nr, tokens.start, out),
                7 => columns::<$u4, $f, 7>(w, a, panel, nr, tokens.start, out),
                8 => columns::<$u4, $f, 8>(w, a, panel, nr, tokens.start, out),
                n => unreachable!("{n} tokens at once"),
            }
        };
    }
    match (w.codes, a.rounding == Rounding::Fine) {
        (Codes::U4, false) => by_count!(true, false),
        (Codes::U4, true) => by_count!(true, true),
        (Codes::U8, false) => by_count!(false, false),
        (Codes::U8, true) => by_count!(false, true),
    }
}

/// Block `b`'s scales and (`U4`) offsets of the panel's 16 rows, as f32 lanes.
#[inline(always)]
pub(super) unsafe fn block_scales<const U4: bool>(
    w: &PackedWeight,
    panel: usize,
    b: usize,
) -> (__m512, __m512) {
    // No closure here: it would not inherit the caller's target features.
    let at = (panel * w.blocks + b) * PANEL;
    let d = _mm512_cvtph_ps(_mm256_loadu_si256(w.d.as_ptr().add(at) as *const _));
    let m = if U4 {
        _mm512_cvtph_ps(_mm256_loadu_si256(w.m.as_ptr().add(at) as *const _))
    } else {
        _mm512_setzero_ps()
    };
    (d, m)
}

/// One block's step for one token, lanes = 16 weight rows: `dot` the exact block dots
/// (corrections included), `ab` the (token, block) index. Both kernels end in it, so their
/// results agree bit for bit.
#[inline(always)]
pub(super) unsafe fn accumulate<const U4: bool>(
    acc: __m512,
    dot: __m512i,
    dw: __m512,
    mw: __m512,
    a: &QuantizedActs,
    ab: usize,
) -> __m512 {
    let scale = _mm512_mul_ps(dw, _mm512_set1_ps(a.d[ab]));
    let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
    if U4 {
        _mm512_fmadd_ps(mw, _mm512_set1_ps(a.s[ab]), acc)
    } else {
        acc
    }
}

/// The integer added to a block's raw dot: `U8` codes stand for `code - 128`.
#[inline(always)]
pub(super) unsafe fn correction<const U4: bool, const F: bool>(
    a: &QuantizedActs,
    ab: usize,
) -> i32 {
    match (U4, F) {
        (true, _) => 0,
        (false, false) => a.block_corr[ab],
        (false, true) => 256 * a.block_corr[ab] + a.block_corr_r[ab],
    }
}

/// Token `t0 + j`'s 16 row results `acc[j]` into the output (the first `nr` of them).
#[inline(always)]
pub(super) unsafe fn store(acc: &[__m512], t0: usize, panel: usize, nr: usize, out: Out) {
    let lanes: __mmask16 = if nr == PANEL { 0xFFFF } else { (1 << nr) - 1 };
    for (j, acc) in acc.iter().enumerate() {
        let row = out.row(t0 + j, panel * PANEL, nr);
        _mm512_mask_storeu_ps(row.as_mut_ptr(), lanes, *acc);
    }
}

/// The 16 rows' exact dots with one block of a token's codes `x` (`[32]`): `codes[k4]` holds
/// the rows' codes `4 k4 .. 4 k4 + 4`, each multiplied by the same 4 broadcast codes.
#[inline(always)]
unsafe fn block_dot(codes: &[__m512i; 8], x: *const i8) -> __m512i {
    let x = x as *const i32;
    // Two chains: `vpdpbusd`'s latency, not its throughput, would bound one.
    let (mut even, mut odd) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    for k in (0..8).step_by(2) {
        even = _mm512_dpbusd_epi32(even, codes[k], _mm512_set1_epi32(x.add(k).read_unaligned()));
        odd = _mm512_dpbusd_epi32(
            odd,
            codes[k + 1],
            _mm512_set1_epi32(x.add(k + 1).read_unaligned()),
        );
    }
    _mm512_add_epi32(even, odd)
}

/// Block `b` of the panel (its codes `codes`) for `N` tokens from `t0`: the exact dots, then
/// [`accumulate`] per token.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn block<const U4: bool, const F: bool, const N: usize>(
    acc: &mut [__m512; N],
    codes: &[__m512i; 8],
    w: &PackedWeight,
    a: &QuantizedActs,
    panel: usize,
    b: usize,
    t0: usize,
) {
    let nb = w.blocks;
    let (dw, mw) = block_scales::<U4>(w, panel, b);
    for (j, acc) in acc.iter_mut().enumerate() {
        let at = (t0 + j) * nb * BLOCK + b * BLOCK;
        let mut dot = block_dot(codes, a.q.as_ptr().add(at));
        if F {
            let fine = block_dot(codes, a.r.as_ptr().add(at));
            dot = _mm512_add_epi32(_mm512_slli_epi32(dot, 8), fine);
        }
        let ab = (t0 + j) * nb + b;
        let dot = _mm512_add_epi32(dot, _mm512_set1_epi32(correction::<U4, F>(a, ab)));
        *acc = accumulate::<U4>(*acc, dot, dw, mw, a, ab);
    }
}

/// `N` tokens from `t0` times the panel's rows, a block at a time.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
unsafe fn columns<const U4: bool, const F: bool, const N: usize>(
    w: &PackedWeight,
    a: &QuantizedActs,
    panel: usize,
    nr: usize,
    t0: usize,
    out: Out,
) {
    let nibble = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); N];
    // One slot (`U4`: a pair of blocks, `U8`: a block) of the panel at a time.
    let slots = if U4 { w.blocks / 2 } else { w.blocks };
    let src = w.data.as_ptr().add(panel * slots * SLOT) as *const __m512i;
    for s in 0..slots {
        // Past the matrix's end this reads nothing: a prefetch never faults.
        let ahead = src.wrapping_add((s + PREFETCH_SLOTS) * 8) as *const i8;
        for line in 0..SLOT / 64 {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line * 64));
        }
        let raw: [__m512i; 8] = std::array::from_fn(|k4| _mm512_loadu_si512(src.add(s * 8 + k4)));
        if U4 {
            let lo = raw.map(|x| _mm512_and_si512(x, nibble));
            block::<U4, F, N>(&mut acc, &lo, w, a, panel, 2 * s, t0);
            let hi = raw.map(|x| _mm512_and_si512(_mm512_srli_epi16(x, 4), nibble));
            block::<U4, F, N>(&mut acc, &hi, w, a, panel, 2 * s + 1, t0);
        } else {
            block::<U4, F, N>(&mut acc, &raw, w, a, panel, s, t0);
        }
    }
    store(&acc, t0, panel, nr, out);
}
