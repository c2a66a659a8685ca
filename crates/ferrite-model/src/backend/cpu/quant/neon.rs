//! Arm tiles (aarch64): per 32-value block an exact int32 dot, then the block's scaling in
//! f32, as the x86 sets do. Three ways to the dot, one per kernel set:
//! - `neon`: `smull` + `sadalp` (8-bit products widened to 16 bits, pairs added into 32);
//! - `neon-dotprod`: `sdot` (four products into each 32-bit lane);
//! - `neon-i8mm`: `smmla`, a 2x8 by 8x2 product: two weight rows times two tokens at once.
//!
//! All read the row layout the AVX2 and portable sets read. `smmla` wants each operand as
//! two rows of 8 bytes; one `zip` of two 16-byte loads makes two such operands, so a block
//! of two rows costs 4 zips for its 4 `smmla`s of each token pair. A layout with weight
//! rows interleaved in pairs would save the weights' half of those zips, at the price of a
//! layout of its own; unmeasured on Arm hardware, it is left until it can be measured.
//!
//! `sdot` and `smmla` come through `asm!`: their intrinsics are not stable in Rust.

// Tiles index accumulators, codes and activations by the same (row, token); range loops
// say that more plainly than zipped iterators.
#![allow(clippy::needless_range_loop)]

use super::activations::QuantizedActs;
use super::packed::{PackedWeight, BLOCK};
use super::tile::Out;
use half::f16;
use std::arch::aarch64::*;
use std::arch::asm;

/// One f16 scale as f32 (`fcvt` is base Armv8; no FP16 arithmetic needed).
#[inline(always)]
unsafe fn scale(h: f16) -> f32 {
    let out: f32;
    asm!("fcvt {o:s}, {i:h}", o = lateout(vreg) out, i = in(vreg) h.to_bits() as i16,
        options(pure, nomem, nostack));
    out
}

/// Four f16 values (as bits) widened to f32.
#[inline(always)]
pub(in crate::backend::cpu) unsafe fn widen4(bits: uint16x4_t) -> float32x4_t {
    let out: float32x4_t;
    asm!("fcvtl {o:v}.4s, {i:v}.4h", o = lateout(vreg) out, i = in(vreg) bits,
        options(pure, nomem, nostack));
    out
}

/// Asks for the cache line at `p`; never faults.
#[inline(always)]
pub(in crate::backend::cpu) unsafe fn prefetch(p: *const u8) {
    asm!("prfm pldl1keep, [{p}]", p = in(reg) p, options(nostack, preserves_flags, readonly));
}

/// The codes of the rows two tiles after `r0`'s, as the AVX2 tiles prefetch them.
#[inline(always)]
unsafe fn prefetch_rows<const R: usize>(w: &PackedWeight, r0: usize, row_bytes: usize) {
    let from = w.data.as_ptr().wrapping_add((r0 + 2 * R) * row_bytes);
    for line in (0..R * row_bytes).step_by(64) {
        prefetch(from.wrapping_add(line));
    }
}

/// `sum_b m[b] * s[b]` over `n` (even) blocks: `U4` offsets times activation block sums.
#[inline(always)]
unsafe fn offset_term(m: *const f16, s: *const f32, n: usize) -> f32 {
    let mut acc = vdupq_n_f32(0.0);
    let mut k = 0;
    while k + 4 <= n {
        let mv = widen4(vld1_u16(m.add(k) as *const u16));
        acc = vfmaq_f32(acc, mv, vld1q_f32(s.add(k)));
        k += 4;
    }
    let mut sum = vaddvq_f32(acc);
    while k < n {
        sum += scale(*m.add(k)) * *s.add(k);
        k += 1;
    }
    sum
}

/// Four lane sums of `w * a` over 16 int8 pairs, added to `acc`.
pub(super) trait LaneDot {
    unsafe fn dot16(acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t;
}

/// `smull` + `sadalp`: each product fits 16 bits (at most 128 * 128).
pub(super) struct Smull;

impl LaneDot for Smull {
    #[inline(always)]
    unsafe fn dot16(acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
        let lo = vmull_s8(vget_low_s8(w), vget_low_s8(a));
        let hi = vmull_high_s8(w, a);
        vpadalq_s16(vpadalq_s16(acc, lo), hi)
    }
}

/// `sdot`: needs the `dotprod` feature, which the calling tile enables.
pub(super) struct Sdot;

impl LaneDot for Sdot {
    #[inline(always)]
    unsafe fn dot16(mut acc: int32x4_t, w: int8x16_t, a: int8x16_t) -> int32x4_t {
        asm!("sdot {acc:v}.4s, {w:v}.16b, {a:v}.16b", acc = inout(vreg) acc, w = in(vreg) w,
            a = in(vreg) a, options(pure, nomem, nostack));
        acc
    }
}

/// The block dot of codes `c` with activations `q`, or with `256 q + r` when fine (`F`).
#[inline(always)]
unsafe fn block_dot<D: LaneDot, const F: bool>(
    c: [int8x16_t; 2],
    q: [int8x16_t; 2],
    r: [int8x16_t; 2],
) -> int32x4_t {
    let zero = vdupq_n_s32(0);
    let d = D::dot16(D::dot16(zero, c[0], q[0]), c[1], q[1]);
    if F {
        let fine = D::dot16(D::dot16(zero, c[0], r[0]), c[1], r[1]);
        vaddq_s32(vshlq_n_s32::<8>(d), fine)
    } else {
        d
    }
}

/// A block's 32 int8 values at `p`.
#[inline(always)]
unsafe fn load_block(p: *const i8) -> [int8x16_t; 2] {
    [vld1q_s8(p), vld1q_s8(p.add(16))]
}

/// Token `t`'s codes of block `b` (and the residual codes when fine).
#[inline(always)]
unsafe fn acts<const F: bool>(a: &QuantizedActs, t: usize, b: usize) -> [[int8x16_t; 2]; 2] {
    let i = (t * a.blocks + b) * BLOCK;
    let q = load_block(a.q.as_ptr().add(i));
    let r = match F {
        true => load_block(a.r.as_ptr().add(i)),
        false => q,
    };
    [q, r]
}

/// The two blocks of a `U4` pair: low nibbles (block `b`), high nibbles (block `b + 1`).
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> [[int8x16_t; 2]; 2] {
    let mask = vdupq_n_u8(0x0F);
    let x = [vld1q_u8(p), vld1q_u8(p.add(16))];
    [
        x.map(|x| vreinterpretq_s8_u8(vandq_u8(x, mask))),
        x.map(|x| vreinterpretq_s8_u8(vshrq_n_u8::<4>(x))),
    ]
}

/// A `U8` block's codes minus 128, as int8.
#[inline(always)]
unsafe fn centred(p: *const u8) -> [int8x16_t; 2] {
    let flip = vdupq_n_u8(0x80);
    [vld1q_u8(p), vld1q_u8(p.add(16))].map(|x| vreinterpretq_s8_u8(veorq_u8(x, flip)))
}

/// `U4` rows `r0..r0 + R` times tokens `t0..t0 + C`, lane dots through `D`.
#[inline(always)]
unsafe fn lanes_u4<D: LaneDot, const R: usize, const C: usize, const F: bool>(
    w: &PackedWeight,
    r0: usize,
    a: &QuantizedActs,
    t0: usize,
    out: Out<'_>,
) {
    let nb = w.blocks;
    prefetch_rows::<R>(w, r0, nb * 16);
    let mut acc = [[vdupq_n_f32(0.0); C]; R];
    for b in (0..nb).step_by(2) {
        let x: [[[[int8x16_t; 2]; 2]; 2]; C] =
            std::array::from_fn(|j| [acts::<F>(a, t0 + j, b), acts::<F>(a, t0 + j, b + 1)]);
        for i in 0..R {
            let r = r0 + i;
            let codes = nibbles(w.data.as_ptr().add((r * nb + b) * 16));
            let dw = [0, 1].map(|h| scale(*w.d.get_unchecked(r * nb + b + h)));
            for j in 0..C {
                for h in 0..2 {
                    let s = dw[h] * *a.d.get_unchecked((t0 + j) * nb + b + h);
                    let [q, fine] = x[j][h];
                    let d = block_dot::<D, F>(codes[h], q, fine);
                    acc[i][j] = vfmaq_n_f32(acc[i][j], vcvtq_f32_s32(d), s);
                }
            }
        }
    }
    for i in 0..R {
        let r = r0 + i;
        for j in 0..C {
            let t = t0 + j;
            let off = offset_term(w.m.as_ptr().add(r * nb), a.s.as_ptr().add(t * nb), nb);
            out.set(t, r, vaddvq_f32(acc[i][j]) + off);
        }
    }
}

/// `U8` rows `r0..r0 + R` times tokens `t0..t0 + C`, lane dots through `D`.
#[inline(always)]
unsafe fn lanes_u8<D: LaneDot, const R: usize, const C: usize, const F: bool>(
    w: &PackedWeight,
    r0: usize,
    a: &QuantizedActs,
    t0: usize,
    out: Out<'_>,
) {
    let nb = w.blocks;
    prefetch_rows::<R>(w, r0, nb * BLOCK);
    let mut acc = [[vdupq_n_f32(0.0); C]; R];
    for b in 0..nb {
        let x: [[[int8x16_t; 2]; 2]; C] = std::array::from_fn(|j| acts::<F>(a, t0 + j, b));
        for i in 0..R {
            let r = r0 + i;
            let c = centred(w.data.as_ptr().add((r * nb + b) * BLOCK));
            let dw = scale(*w.d.get_unchecked(r * nb + b));
            for j in 0..C {
                let s = dw * *a.d.get_unchecked((t0 + j) * nb + b);
                let [q, fine] = x[j];
                let d = block_dot::<D, F>(c, q, fine);
                acc[i][j] = vfmaq_n_f32(acc[i][j], vcvtq_f32_s32(d), s);
            }
        }
    }
    for i in 0..R {
        for j in 0..C {
            out.set(t0 + j, r0 + i, vaddvq_f32(acc[i][j]));
        }
    }
}

/// `acc += a * b^T` for `a`, `b` each two rows of 8 int8 values: lanes
/// `[a0.b0, a0.b1, a1.b0, a1.b1]`.
#[inline(always)]
unsafe fn smmla(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    asm!("smmla {acc:v}.4s, {a:v}.16b, {b:v}.16b", acc = inout(vreg) acc, a = in(vreg) a,
        b = in(vreg) b, options(pure, nomem, nostack));
    acc
}

/// Two 32-value blocks (one per row or token) as `smmla`'s four operands of 2 x 8 values.
#[inline(always)]
unsafe fn pair(x: [int8x16_t; 2], y: [int8x16_t; 2]) -> [int8x16_t; 4] {
    let zip = |x: int8x16_t, y: int8x16_t, hi: bool| {
        let (x, y) = (vreinterpretq_s64_s8(x), vreinterpretq_s64_s8(y));
        vreinterpretq_s8_s64(if hi {
            vzip2q_s64(x, y)
        } else {
            vzip1q_s64(x, y)
        })
    };
    [
        zip(x[0], y[0], false),
        zip(x[0], y[0], true),
        zip(x[1], y[1], false),
        zip(x[1], y[1], true),
    ]
}

/// The 2 x 2 block dots of a row pair `w` and a token pair `q` (or `256 q + r`).
#[inline(always)]
unsafe fn pair_dot<const F: bool>(
    w: [int8x16_t; 4],
    q: [int8x16_t; 4],
    r: [int8x16_t; 4],
) -> int32x4_t {
    let dot = |x: [int8x16_t; 4]| (0..4).fold(vdupq_n_s32(0), |acc, k| smmla(acc, w[k], x[k]));
    let d = dot(q);
    if F {
        vaddq_s32(vshlq_n_s32::<8>(d), dot(r))
    } else {
        d
    }
}

/// Index `k` of a pair list over `n` items: the pair's second item repeats the first past
/// the end (its results are computed and dropped).
#[inline(always)]
fn member(p: usize, second: bool, n: usize) -> usize {
    (2 * p + second as usize).min(n - 1)
}

/// The pairs' scale products `[w0 a0, w0 a1, w1 a0, w1 a1]`.
#[inline(always)]
unsafe fn pair_scales(dw: [f32; 2], da: [f32; 2]) -> float32x4_t {
    let w = [dw[0], dw[0], dw[1], dw[1]];
    let a = [da[0], da[1], da[0], da[1]];
    vmulq_f32(vld1q_f32(w.as_ptr()), vld1q_f32(a.as_ptr()))
}

/// Stores the pairs' lanes that are real (rows below `R`, tokens below `C`), adding each
/// row and token's `extra`.
#[inline(always)]
unsafe fn store_pairs<const R: usize, const C: usize, const RP: usize, const CP: usize>(
    acc: &[[float32x4_t; CP]; RP],
    r0: usize,
    t0: usize,
    out: Out<'_>,
    extra: impl Fn(usize, usize) -> f32,
) {
    for rp in 0..RP {
        for cp in 0..CP {
            let mut v = [0f32; 4];
            vst1q_f32(v.as_mut_ptr(), acc[rp][cp]);
            for (lane, &x) in v.iter().enumerate() {
                let (i, j) = (2 * rp + lane / 2, 2 * cp + lane % 2);
                if i < R && j < C {
                    out.set(t0 + j, r0 + i, x + extra(r0 + i, t0 + j));
                }
            }
        }
    }
}

/// `U4` rows `r0..r0 + R` times tokens `t0..t0 + C` through `smmla`.
#[inline(always)]
unsafe fn mmla_u4<
    const R: usize,
    const C: usize,
    const F: bool,
    const RP: usize,
    const CP: usize,
>(
    w: &PackedWeight,
    r0: usize,
    a: &QuantizedActs,
    t0: usize,
    out: Out<'_>,
) {
    let nb = w.blocks;
    prefetch_rows::<R>(w, r0, nb * 16);
    let mut acc = [[vdupq_n_f32(0.0); CP]; RP];
    for b in (0..nb).step_by(2) {
        for h in 0..2 {
            // The token pairs' operands for block `b + h`.
            let x: [[[int8x16_t; 4]; 2]; CP] = std::array::from_fn(|cp| {
                let [qa, ra] = acts::<F>(a, t0 + member(cp, false, C), b + h);
                let [qb, rb] = acts::<F>(a, t0 + member(cp, true, C), b + h);
                [pair(qa, qb), pair(ra, rb)]
            });
            for rp in 0..RP {
                let rows = [false, true].map(|s| r0 + member(rp, s, R));
                let codes = rows.map(|r| nibbles(w.data.as_ptr().add((r * nb + b) * 16))[h]);
                let wz = pair(codes[0], codes[1]);
                let dw = rows.map(|r| scale(*w.d.get_unchecked(r * nb + b + h)));
                for cp in 0..CP {
                    let da = [false, true]
                        .map(|s| *a.d.get_unchecked((t0 + member(cp, s, C)) * nb + b + h));
                    let d = pair_dot::<F>(wz, x[cp][0], x[cp][1]);
                    acc[rp][cp] = vfmaq_f32(acc[rp][cp], vcvtq_f32_s32(d), pair_scales(dw, da));
                }
            }
        }
    }
    store_pairs::<R, C, RP, CP>(&acc, r0, t0, out, |r, t| {
        offset_term(w.m.as_ptr().add(r * nb), a.s.as_ptr().add(t * nb), nb)
    });
}

/// `U8` rows `r0..r0 + R` times tokens `t0..t0 + C` through `smmla`.
#[inline(always)]
unsafe fn mmla_u8<
    const R: usize,
    const C: usize,
    const F: bool,
    const RP: usize,
    const CP: usize,
>(
    w: &PackedWeight,
    r0: usize,
    a: &QuantizedActs,
    t0: usize,
    out: Out<'_>,
) {
    let nb = w.blocks;
    prefetch_rows::<R>(w, r0, nb * BLOCK);
    let mut acc = [[vdupq_n_f32(0.0); CP]; RP];
    for b in 0..nb {
        let x: [[[int8x16_t; 4]; 2]; CP] = std::array::from_fn(|cp| {
            let [qa, ra] = acts::<F>(a, t0 + member(cp, false, C), b);
            let [qb, rb] = acts::<F>(a, t0 + member(cp, true, C), b);
            [pair(qa, qb), pair(ra, rb)]
        });
        for rp in 0..RP {
            let rows = [false, true].map(|s| r0 + member(rp, s, R));
            let codes = rows.map(|r| centred(w.data.as_ptr().add((r * nb + b) * BLOCK)));
            let wz = pair(codes[0], codes[1]);
            let dw = rows.map(|r| scale(*w.d.get_unchecked(r * nb + b)));
            for cp in 0..CP {
                let da =
                    [false, true].map(|s| *a.d.get_unchecked((t0 + member(cp, s, C)) * nb + b));
                let d = pair_dot::<F>(wz, x[cp][0], x[cp][1]);
                acc[rp][cp] = vfmaq_f32(acc[rp][cp], vcvtq_f32_s32(d), pair_scales(dw, da));
            }
        }
    }
    store_pairs::<R, C, RP, CP>(&acc, r0, t0, out, |_, _| 0.0);
}

/// The tiles each kernel set's dispatch calls (`by_shape!` in the parent module), compiled
/// with the features that set needs.
macro_rules! tiles {
    ($name:ident, $features:literal, $body:ident $(::<$dot:ty>)?) => {
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name<const R: usize, const C: usize, const F: bool>(
            w: &PackedWeight,
            r0: usize,
            a: &QuantizedActs,
            t0: usize,
            out: Out<'_>,
        ) {
            $body::<$($dot,)? R, C, F>(w, r0, a, t0, out)
        }
    };
}

tiles!(smull_u4, "neon", lanes_u4::<Smull>);
tiles!(smull_u8, "neon", lanes_u8::<Smull>);
tiles!(sdot_u4, "neon,dotprod", lanes_u4::<Sdot>);
tiles!(sdot_u8, "neon,dotprod", lanes_u8::<Sdot>);

/// `smmla` tiles: `R` rows and `C` tokens in pairs (1..=4 each, so 1 or 2 pairs).
macro_rules! mmla_tiles {
    ($name:ident, $body:ident) => {
        #[target_feature(enable = "neon,i8mm")]
        pub(super) unsafe fn $name<const R: usize, const C: usize, const F: bool>(
            w: &PackedWeight,
            r0: usize,
            a: &QuantizedActs,
            t0: usize,
            out: Out<'_>,
        ) {
            match (R.div_ceil(2), C.div_ceil(2)) {
                (1, 1) => $body::<R, C, F, 1, 1>(w, r0, a, t0, out),
                (1, 2) => $body::<R, C, F, 1, 2>(w, r0, a, t0, out),
                (2, 1) => $body::<R, C, F, 2, 1>(w, r0, a, t0, out),
                _ => $body::<R, C, F, 2, 2>(w, r0, a, t0, out),
            }
        }
    };
}

mmla_tiles!(mmla_tile_u4, mmla_u4);
mmla_tiles!(mmla_tile_u8, mmla_u8);
