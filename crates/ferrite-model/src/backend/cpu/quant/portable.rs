//! Plain-Rust tiles: exact integer block dots, then per block `acc += (dw * da) * dot` in
//! f32. Any CPU runs it; tests force it to check the others. The Arm sets do the same
//! arithmetic per (row, token), so they give its bits.

use super::activations::QuantizedActs;
use super::packed::{PackedWeight, BLOCK};
use super::tile::Out;
use half::f16;

/// `U4` weights: rows `r0..r0 + R` times tokens `t0..t0 + C`.
pub(super) fn tile_u4<const R: usize, const C: usize, const F: bool>(
    w: &PackedWeight,
    r0: usize,
    a: &QuantizedActs,
    t0: usize,
    out: Out<'_>,
) {
    let nb = w.blocks;
    for i in 0..R {
        let r = r0 + i;
        let row = &w.data[r * nb * 16..][..nb * 16];
        for j in 0..C {
            let t = t0 + j;
            let mut acc = 0f32;
            for b in 0..nb {
                let bytes = &row[(b / 2) * BLOCK..][..BLOCK];
                let shift = 4 * (b % 2);
                let dot = block_dot::<F>(a, t, b, |k| ((bytes[k] >> shift) & 0x0F) as i32);
                acc += w.d[r * nb + b].to_f32() * a.d[t * nb + b] * dot as f32;
            }
            let off = offset_term(&w.m[r * nb..][..nb], &a.s[t * nb..][..nb]);
            out.set(t, r, acc + off);
        }
    }
}

/// `U8` weights: rows `r0..r0 + R` times tokens `t0..t0 + C`.
pub(super) fn tile_u8<const R: usize, const C: usize, const F: bool>(
    w: &PackedWeight,
    r0: usize,
    a: &QuantizedActs,
    t0: usize,
    out: Out<'_>,
) {
    let nb = w.blocks;
    for i in 0..R {
        let r = r0 + i;
        let row = &w.data[r * nb * BLOCK..][..nb * BLOCK];
        for j in 0..C {
            let t = t0 + j;
            let mut acc = 0f32;
            for b in 0..nb {
                let codes = &row[b * BLOCK..][..BLOCK];
                let dot = block_dot::<F>(a, t, b, |k| codes[k] as i32 - 128);
                acc += w.d[r * nb + b].to_f32() * a.d[t * nb + b] * dot as f32;
            }
            out.set(t, r, acc);
        }
    }
}

/// `sum_k w(k) * code[k]` over block `b` of token `t`, the code `256 q + r` when fine (`F`).
fn block_dot<const F: bool>(
    a: &QuantizedActs,
    t: usize,
    b: usize,
    w: impl Fn(usize) -> i32,
) -> i32 {
    let i = (t * a.blocks + b) * BLOCK;
    let dot = |v: &[i8]| -> i32 { (0..BLOCK).map(|k| w(k) * v[i + k] as i32).sum() };
    if F {
        256 * dot(&a.q) + dot(&a.r)
    } else {
        dot(&a.q)
    }
}

/// `sum_b m[b] * s[b]`: the `U4` blocks' offsets times the activation block sums, added in
/// block order from +0 (the Arm sets repeat this arithmetic lane by lane).
fn offset_term(m: &[f16], s: &[f32]) -> f32 {
    m.iter()
        .zip(s)
        .fold(0.0, |acc, (m, s)| acc + m.to_f32() * s)
}
