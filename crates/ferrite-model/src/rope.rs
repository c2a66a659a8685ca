//! Rotary position embeddings: the frequencies (with `rope_scaling`) and the cos/sin tables
//! every backend reads, and their application on the CPU.

use crate::config::{ModelConfig, RopeScaling, RopeStyle};
use rayon::prelude::*;

/// One rotary embedding: which dimensions rotate, their base, pairing and scaling.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeSpec {
    pub dim: usize,
    pub theta: f32,
    pub style: RopeStyle,
    pub scaling: RopeScaling,
}

impl RopeSpec {
    /// The model's own rotary embedding.
    pub fn of(c: &ModelConfig) -> Self {
        Self {
            dim: c.rope_dim,
            theta: c.rope_theta,
            style: c.rope_style,
            scaling: c.rope_scaling.clone(),
        }
    }

    /// Each pair's angular frequency, and the factor cos and sin are scaled by (YaRN's
    /// attention temperature; 1 otherwise). Computed in f64 as transformers does in f32
    /// or better.
    fn inv_freq(&self) -> (Vec<f64>, f64) {
        let (dim, base) = (self.dim as f64, self.theta as f64);
        let half = self.dim / 2;
        let plain = |i: usize| 1.0 / base.powf(2.0 * i as f64 / dim);
        let mut mscale = 1.0;
        let freqs = (0..half)
            .map(|i| match &self.scaling {
                RopeScaling::None => plain(i),
                RopeScaling::Linear(f) => plain(i) / *f as f64,
                RopeScaling::Factors(v) => plain(i) / v.get(i).copied().unwrap_or(1.0) as f64,
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_positions,
                } => {
                    let (factor, low, high) = (
                        *factor as f64,
                        *low_freq_factor as f64,
                        *high_freq_factor as f64,
                    );
                    let orig = *original_max_positions as f64;
                    let freq = plain(i);
                    let wavelen = 2.0 * std::f64::consts::PI / freq;
                    if wavelen < orig / high {
                        freq
                    } else if wavelen > orig / low {
                        freq / factor
                    } else {
                        let smooth = (orig / wavelen - low) / (high - low);
                        (1.0 - smooth) * freq / factor + smooth * freq
                    }
                }
                RopeScaling::Yarn {
                    factor,
                    original_max_positions,
                    beta_fast,
                    beta_slow,
                } => {
                    let factor = *factor as f64;
                    mscale = if factor <= 1.0 {
                        1.0
                    } else {
                        0.1 * factor.ln() + 1.0
                    };
                    let orig = *original_max_positions as f64;
                    let correction = |rotations: f64| {
                        dim * (orig / (rotations * 2.0 * std::f64::consts::PI)).ln()
                            / (2.0 * base.ln())
                    };
                    let low = correction(*beta_fast as f64).floor().max(0.0);
                    let mut high = correction(*beta_slow as f64).ceil().min(dim - 1.0);
                    if high == low {
                        high += 0.001;
                    }
                    let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    let extrapolate = 1.0 - ramp;
                    plain(i) / factor * (1.0 - extrapolate) + plain(i) * extrapolate
                }
            })
            .collect();
        (freqs, mscale)
    }
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

    pub fn new(spec: &RopeSpec, max_pos: usize) -> Self {
        let (inv_freq, mscale) = spec.inv_freq();
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for &freq in &inv_freq {
                let a = p as f64 * freq;
                cos.push((a.cos() * mscale) as f32);
                sin.push((a.sin() * mscale) as f32);
            }
        }
        Self {
            cos,
            sin,
            half,
            style: spec.style,
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
