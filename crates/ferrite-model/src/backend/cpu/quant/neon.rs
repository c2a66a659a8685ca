//! Arm tiles (aarch64): per 32-value block an exact int32 dot, then per (row, token) the
//! portable set's arithmetic, `acc += (dw * da) * dot` in f32 and the `U4` offsets added
//! in block order, lane by lane: every Arm set gives the portable set's bits, so a model
//! answers the same on every Arm CPU. Three ways to the dot, one per kernel set:
//! - `neon`: `smull` + `sadalp` (8-bit products widened to 16 bits, pairs added into 32);
//! - `neon-dotprod`: `sdot` (four products into each 32-bit lane);
//! - `neon-i8mm`: `smmla`, a 2x8 by 8x2 product: two weight rows times two tokens at once.
//!
//! The first two reduce four tokens' lane sums with two `addp`s into one vector, so the
//! scaling runs four tokens wide. All read the row layout the AVX2 and portable sets read.
//! `smmla` wants each operand as two rows of 8 bytes; one `zip` of two 16-byte loads makes
//! two such operands, so a block of two rows costs 4 zips for its 4 `smmla`s of each token
//! pair. A layout with weight rows interleaved in pairs would save the weights' half of
//! those zips, at the price of a layout of its own; unmeasured on Arm hardware, it is left
//! until it can be measured.
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
pub(crate) unsafe fn widen4(bits: uint16x4_t) -> float32x4_t {
    let out: float32x4_t;
    asm!("fcvtl {o:v}.4s, {i:v}.4h", o = lateout(vreg) out, i = in(vreg) bits,
        options(pure, nomem, nostack));
    out
}

/// Asks for the cache line at `p`; never faults.
#[inline(always)]
pub(crate) unsafe fn prefetch(p: *const u8) {
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
    let (x0, x1) = (vld1q_u8(p), vld1q_u8(p.add(16)));
    let lo = |x| vreinterpretq_s8_u8(vandq_u8(x, mask));
    let hi = |x| vreinterpretq_s8_u8(vshrq_n_u8::<4>(x));
    [[lo(x0), lo(x1)], [hi(x0), hi(x1)]]
}

/// A `U8` block's codes minus 128, as int8.
#[inline(always)]
unsafe fn centred(p: *const u8) -> [int8x16_t; 2] {
    let flip = vdupq_n_u8(0x80);
    [
        vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p), flip)),
        vreinterpretq_s8_u8(veorq_u8(vld1q_u8(p.add(16)), flip)),
    ]
}

/// Tokens `t0..t0 + C`'s values of `v` (`[tokens, blocks]`) at block `b`, zero past `C`.
#[inline(always)]
unsafe fn per_token<const C: usize>(v: &[f32], t0: usize, nb: usize, b: usize) -> float32x4_t {
    let mut x = [0f32; 4];
    for j in 0..C {
        x[j] = *v.get_unchecked((t0 + j) * nb + b);
    }
    vld1q_f32(x.as_ptr())
}

/// Four tokens' block dots (each as lane sums) as one vector of whole dots.
#[inline(always)]
unsafe fn whole_dots(d: [int32x4_t; 4]) -> float32x4_t {
    vcvtq_f32_s32(vpaddq_s32(vpaddq_s32(d[0], d[1]), vpaddq_s32(d[2], d[3])))
}

/// Stores each row's four token lanes `acc + off`, the first `C` of them.
#[inline(always)]
unsafe fn store_rows<const R: usize, const C: usize>(
    acc: [float32x4_t; R],
    off: [float32x4_t; R],
    r0: usize,
    t0: usize,
    out: Out<'_>,
) {
    for i in 0..R {
        let mut v = [0f32; 4];
        vst1q_f32(v.as_mut_ptr(), vaddq_f32(acc[i], off[i]));
        for j in 0..C {
            out.set(t0 + j, r0 + i, v[j]);
        }
    }
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
    let zero = vdupq_n_s32(0);
    prefetch_rows::<R>(w, r0, nb * 16);
    let (mut acc, mut off) = ([vdupq_n_f32(0.0); R], [vdupq_n_f32(0.0); R]);
    for b in (0..nb).step_by(2) {
        // Loops and plain arrays, not closures (`from_fn`, `map`): the hot loop stays
        // free of calls.
        let mut x = [[[[vdupq_n_s8(0); 2]; 2]; 2]; C];
        for j in 0..C {
            x[j] = [acts::<F>(a, t0 + j, b), acts::<F>(a, t0 + j, b + 1)];
        }
        let da = [
            per_token::<C>(&a.d, t0, nb, b),
            per_token::<C>(&a.d, t0, nb, b + 1),
        ];
        let sums = [
            per_token::<C>(&a.s, t0, nb, b),
            per_token::<C>(&a.s, t0, nb, b + 1),
        ];
        for i in 0..R {
            let r = r0 + i;
            let codes = nibbles(w.data.as_ptr().add((r * nb + b) * 16));
            for h in 0..2 {
                // A loop, not a closure: a closure is compiled without the tile's features.
                let mut dot = [zero; 4];
                for j in 0..C {
                    dot[j] = block_dot::<D, F>(codes[h], x[j][h][0], x[j][h][1]);
                }
                let s = vmulq_n_f32(da[h], scale(*w.d.get_unchecked(r * nb + b + h)));
                acc[i] = vaddq_f32(acc[i], vmulq_f32(s, whole_dots(dot)));
                let m = scale(*w.m.get_unchecked(r * nb + b + h));
                off[i] = vaddq_f32(off[i], vmulq_n_f32(sums[h], m));
            }
        }
    }
    store_rows::<R, C>(acc, off, r0, t0, out);
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
    let zero = vdupq_n_s32(0);
    prefetch_rows::<R>(w, r0, nb * BLOCK);
    let mut acc = [vdupq_n_f32(0.0); R];
    for b in 0..nb {
        let mut x = [[[vdupq_n_s8(0); 2]; 2]; C];
        for j in 0..C {
            x[j] = acts::<F>(a, t0 + j, b);
        }
        let da = per_token::<C>(&a.d, t0, nb, b);
        for i in 0..R {
            let r = r0 + i;
            let c = centred(w.data.as_ptr().add((r * nb + b) * BLOCK));
            let mut dot = [zero; 4];
            for j in 0..C {
                dot[j] = block_dot::<D, F>(c, x[j][0], x[j][1]);
            }
            let s = vmulq_n_f32(da, scale(*w.d.get_unchecked(r * nb + b)));
            acc[i] = vaddq_f32(acc[i], vmulq_f32(s, whole_dots(dot)));
        }
    }
    store_rows::<R, C>(acc, [vdupq_n_f32(0.0); R], r0, t0, out);
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
    let (mut d, mut fine) = (vdupq_n_s32(0), vdupq_n_s32(0));
    for k in 0..4 {
        d = smmla(d, w[k], q[k]);
        if F {
            fine = smmla(fine, w[k], r[k]);
        }
    }
    if F {
        vaddq_s32(vshlq_n_s32::<8>(d), fine)
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

/// The pairs' products `[x0 y0, x0 y1, x1 y0, x1 y1]` (of rows' and tokens' scales, or of
/// offsets and block sums).
#[inline(always)]
unsafe fn pair_products(x: [f32; 2], y: [f32; 2]) -> float32x4_t {
    let x = [x[0], x[0], x[1], x[1]];
    let y = [y[0], y[1], y[0], y[1]];
    vmulq_f32(vld1q_f32(x.as_ptr()), vld1q_f32(y.as_ptr()))
}

/// Stores the pairs' lanes that are real (rows below `R`, tokens below `C`): `acc + off`.
#[inline(always)]
unsafe fn store_pairs<const R: usize, const C: usize, const RP: usize, const CP: usize>(
    acc: &[[float32x4_t; CP]; RP],
    off: &[[float32x4_t; CP]; RP],
    r0: usize,
    t0: usize,
    out: Out<'_>,
) {
    for rp in 0..RP {
        for cp in 0..CP {
            let mut v = [0f32; 4];
            vst1q_f32(v.as_mut_ptr(), vaddq_f32(acc[rp][cp], off[rp][cp]));
            for (lane, &x) in v.iter().enumerate() {
                let (i, j) = (2 * rp + lane / 2, 2 * cp + lane % 2);
                if i < R && j < C {
                    out.set(t0 + j, r0 + i, x);
                }
            }
        }
    }
}

/// Token pair `cp`'s operands for block `b`: codes, and residual codes when fine.
#[inline(always)]
unsafe fn token_pair<const C: usize, const F: bool>(
    a: &QuantizedActs,
    t0: usize,
    cp: usize,
    b: usize,
) -> [[int8x16_t; 4]; 2] {
    let [qa, ra] = acts::<F>(a, t0 + member(cp, false, C), b);
    let [qb, rb] = acts::<F>(a, t0 + member(cp, true, C), b);
    [pair(qa, qb), pair(ra, rb)]
}

/// Token pair `cp`'s values of `v` (`[tokens, blocks]`) at block `b`.
#[inline(always)]
unsafe fn of_tokens<const C: usize>(
    v: &[f32],
    t0: usize,
    cp: usize,
    nb: usize,
    b: usize,
) -> [f32; 2] {
    [
        *v.get_unchecked((t0 + member(cp, false, C)) * nb + b),
        *v.get_unchecked((t0 + member(cp, true, C)) * nb + b),
    ]
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
    let (mut acc, mut off) = ([[vdupq_n_f32(0.0); CP]; RP], [[vdupq_n_f32(0.0); CP]; RP]);
    for b in (0..nb).step_by(2) {
        for h in 0..2 {
            let mut x = [[[vdupq_n_s8(0); 4]; 2]; CP];
            for cp in 0..CP {
                x[cp] = token_pair::<C, F>(a, t0, cp, b + h);
            }
            for rp in 0..RP {
                let (ra, rb) = (r0 + member(rp, false, R), r0 + member(rp, true, R));
                let codes = |r: usize| nibbles(w.data.as_ptr().add((r * nb + b) * 16))[h];
                let wz = pair(codes(ra), codes(rb));
                let of_rows = |v: &[f16]| {
                    let k = b + h;
                    [
                        scale(*v.get_unchecked(ra * nb + k)),
                        scale(*v.get_unchecked(rb * nb + k)),
                    ]
                };
                let (dw, m) = (of_rows(&w.d), of_rows(&w.m));
                for cp in 0..CP {
                    let d = vcvtq_f32_s32(pair_dot::<F>(wz, x[cp][0], x[cp][1]));
                    let s = pair_products(dw, of_tokens::<C>(&a.d, t0, cp, nb, b + h));
                    acc[rp][cp] = vaddq_f32(acc[rp][cp], vmulq_f32(s, d));
                    let o = pair_products(m, of_tokens::<C>(&a.s, t0, cp, nb, b + h));
                    off[rp][cp] = vaddq_f32(off[rp][cp], o);
                }
            }
        }
    }
    store_pairs::<R, C, RP, CP>(&acc, &off, r0, t0, out);
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
        let mut x = [[[vdupq_n_s8(0); 4]; 2]; CP];
        for cp in 0..CP {
            x[cp] = token_pair::<C, F>(a, t0, cp, b);
        }
        for rp in 0..RP {
            let (ra, rb) = (r0 + member(rp, false, R), r0 + member(rp, true, R));
            let codes = |r: usize| centred(w.data.as_ptr().add((r * nb + b) * BLOCK));
            let wz = pair(codes(ra), codes(rb));
            let dw = [
                scale(*w.d.get_unchecked(ra * nb + b)),
                scale(*w.d.get_unchecked(rb * nb + b)),
            ];
            for cp in 0..CP {
                let d = vcvtq_f32_s32(pair_dot::<F>(wz, x[cp][0], x[cp][1]));
                let s = pair_products(dw, of_tokens::<C>(&a.d, t0, cp, nb, b));
                acc[rp][cp] = vaddq_f32(acc[rp][cp], vmulq_f32(s, d));
            }
        }
    }
    let off = [[vdupq_n_f32(0.0); CP]; RP];
    store_pairs::<R, C, RP, CP>(&acc, &off, r0, t0, out);
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
