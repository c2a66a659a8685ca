//! Activations quantized to int8 once per matmul input, in blocks of 32 that line up with
//! the weight blocks.

use super::packed::BLOCK;
use rayon::prelude::*;

/// `[rows, blocks * 32]` int8 codes with per-block scales; buffers are reused across steps.
#[derive(Default)]
pub struct QuantizedActs {
    pub rows: usize,
    /// Blocks per row, padded to even like the weights.
    pub blocks: usize,
    pub q: Vec<i8>,
    /// Scale per block: `x ~ d * q`.
    pub d: Vec<f32>,
    /// `d * sum(q)` per block: multiplies a `U4` block's offset `m`.
    pub s: Vec<f32>,
    /// Scales of two neighbouring blocks spread over 16 lanes (`[d0; 8] ++ [d1; 8]`).
    pub d_pairs: Vec<f32>,
    /// `-128 * (q[4i] + .. + q[4i + 3])`: turns `sum(code * q)` into `sum((code - 128) * q)`
    /// for `U8` weights when `vpdpbusd` starts from it.
    pub corr: Vec<i32>,
}

impl QuantizedActs {
    /// Quantizes row-major `x` of `rows` rows, `cols` (a multiple of 32) wide.
    pub fn quantize(&mut self, x: &[f32], rows: usize, cols: usize) {
        assert!(cols.is_multiple_of(BLOCK) && x.len() == rows * cols);
        let blocks = (cols / BLOCK).next_multiple_of(2);
        self.rows = rows;
        self.blocks = blocks;
        self.q.resize(rows * blocks * BLOCK, 0);
        self.d.resize(rows * blocks, 0.0);
        self.s.resize(rows * blocks, 0.0);
        self.d_pairs.resize(rows * blocks * 8, 0.0);
        self.corr.resize(rows * blocks * 8, 0);
        self.q
            .par_chunks_mut(blocks * BLOCK)
            .zip(self.d.par_chunks_mut(blocks))
            .zip(self.s.par_chunks_mut(blocks))
            .zip(self.d_pairs.par_chunks_mut(blocks * 8))
            .zip(self.corr.par_chunks_mut(blocks * 8))
            .zip(x.par_chunks(cols))
            .for_each(|(((((q, d), s), dp), corr), x)| {
                quantize_row(x, q, d, s);
                for (i, dp) in dp.chunks_exact_mut(8).enumerate() {
                    dp.fill(d[i]);
                }
                for (c, q) in corr.iter_mut().zip(q.chunks_exact(4)) {
                    *c = -128 * q.iter().map(|&v| v as i32).sum::<i32>();
                }
            });
    }
}

/// Adding and subtracting 1.5 * 2^23 rounds an f32 below 2^22 to the nearest integer, ties
/// to even, in plain vectorizable arithmetic (`round_ties_even` becomes a libm call here).
const ROUND: f32 = 12_582_912.0;

/// Symmetric per-block quantization; blocks past the end of `x` are zero.
fn quantize_row(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    q.fill(0);
    d.fill(0.0);
    s.fill(0.0);
    for (b, v) in x.chunks_exact(BLOCK).enumerate() {
        let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
        if amax == 0.0 {
            continue;
        }
        let inv = 127.0 / amax;
        let mut sum = 0i32;
        for (q, &x) in q[b * BLOCK..][..BLOCK].iter_mut().zip(v) {
            *q = (x * inv + ROUND - ROUND) as i8;
            sum += *q as i32;
        }
        d[b] = amax / 127.0;
        s[b] = d[b] * sum as f32;
    }
}
