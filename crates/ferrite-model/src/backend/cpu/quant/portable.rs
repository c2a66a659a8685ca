//! Plain-Rust tiles: exact integer block dots, then the same per-block scaling as the
//! vector kernels. Any CPU runs it; tests force it to check the others.

use super::activations::QuantizedActs;
use super::packed::{PackedWeight, BLOCK};
use super::tile::Out;
use half::f16;

/// `U4` weights: rows `r0..r0 + R` times tokens `t0..t0 + C`.
pub(super) fn tile_u4<const R: usize, const C: usize>(
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
            let q = &a.q[t * nb * BLOCK..][..nb * BLOCK];
            let mut acc = 0f32;
            for b in 0..nb {
                let bytes = &row[(b / 2) * BLOCK..][..BLOCK];
                let shift = 4 * (b % 2);
                let dot: i32 = bytes
                    .iter()
                    .zip(&q[b * BLOCK..][..BLOCK])
                    .map(|(&c, &q)| ((c >> shift) & 0x0F) as i32 * q as i32)
                    .sum();
                acc += w.d[r * nb + b].to_f32() * a.d[t * nb + b] * dot as f32;
            }
            let off = offset_term(&w.m[r * nb..][..nb], &a.s[t * nb..][..nb]);
            out.set(t, r, acc + off);
        }
    }
}

/// `U8` weights: rows `r0..r0 + R` times tokens `t0..t0 + C`.
pub(super) fn tile_u8<const R: usize, const C: usize>(
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
            let q = &a.q[t * nb * BLOCK..][..nb * BLOCK];
            let mut acc = 0f32;
            for b in 0..nb {
                let dot: i32 = row[b * BLOCK..][..BLOCK]
                    .iter()
                    .zip(&q[b * BLOCK..][..BLOCK])
                    .map(|(&c, &q)| (c as i32 - 128) * q as i32)
                    .sum();
                acc += w.d[r * nb + b].to_f32() * a.d[t * nb + b] * dot as f32;
            }
            out.set(t, r, acc);
        }
    }
}

/// `sum_b m[b] * s[b]`: the `U4` blocks' offsets times the activation block sums.
fn offset_term(m: &[f16], s: &[f32]) -> f32 {
    m.iter().zip(s).map(|(m, s)| m.to_f32() * s).sum()
}
