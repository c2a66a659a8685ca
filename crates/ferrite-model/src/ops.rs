//! Token-wise CPU ops over the packed `[T, hidden]` matrix: they never see sequence boundaries.

use crate::config::RopeStyle;
use rayon::prelude::*;

pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let h = weight.len();
    out.par_chunks_mut(h)
        .zip(x.par_chunks(h))
        .for_each(|(o, row)| {
            let ms = row.iter().map(|v| v * v).sum::<f32>() / h as f32;
            let inv = 1.0 / (ms + eps).sqrt();
            for ((o, v), w) in o.iter_mut().zip(row).zip(weight) {
                *o = v * inv * w;
            }
        });
}

/// `gate_up` rows are `[gate | up]` of width `2 * inter`; writes `silu(gate) * up`.
pub fn silu_mul(gate_up: &[f32], inter: usize, out: &mut [f32]) {
    out.par_chunks_mut(inter)
        .zip(gate_up.par_chunks(2 * inter))
        .for_each(|(o, gu)| {
            let (g, u) = gu.split_at(inter);
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = g / (1.0 + (-g).exp()) * u;
            }
        });
}

/// `x += y`, element-wise.
pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    x.par_chunks_mut(4096)
        .zip(y.par_chunks(4096))
        .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, b)| *a += b));
}

/// Precomputed cos/sin per (position, pair).
pub struct RopeTable {
    cos: Vec<f32>,
    sin: Vec<f32>,
    half: usize,
    style: RopeStyle,
}

impl RopeTable {
    /// `[max_pos, rope_dim / 2]` cosines and sines, row-major.
    pub fn tables(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    pub fn new(rope_dim: usize, theta: f32, max_pos: usize, style: RopeStyle) -> Self {
        let half = rope_dim / 2;
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for i in 0..half {
                let freq = 1.0 / (theta as f64).powf(2.0 * i as f64 / rope_dim as f64);
                let a = p as f64 * freq;
                cos.push(a.cos() as f32);
                sin.push(a.sin() as f32);
            }
        }
        Self {
            cos,
            sin,
            half,
            style,
        }
    }

    pub fn max_positions(&self) -> usize {
        self.cos.len() / self.half.max(1)
    }

    /// Rotates every head of `x` (`[T, heads, head_dim]`) by its token's own position.
    pub fn apply(&self, x: &mut [f32], positions: &[u32], heads: usize, head_dim: usize) {
        let half = self.half;
        x.par_chunks_mut(heads * head_dim)
            .zip(positions.par_iter())
            .for_each(|(row, &p)| {
                let c = &self.cos[p as usize * half..][..half];
                let s = &self.sin[p as usize * half..][..half];
                for head in row.chunks_mut(head_dim) {
                    match self.style {
                        RopeStyle::Interleaved => {
                            for i in 0..half {
                                let (a, b) = (head[2 * i], head[2 * i + 1]);
                                head[2 * i] = a * c[i] - b * s[i];
                                head[2 * i + 1] = a * s[i] + b * c[i];
                            }
                        }
                        RopeStyle::Neox => {
                            for i in 0..half {
                                let (a, b) = (head[i], head[i + half]);
                                head[i] = a * c[i] - b * s[i];
                                head[i + half] = a * s[i] + b * c[i];
                            }
                        }
                    }
                }
            });
    }
}
