//! Token-wise CPU ops over the packed `[T, hidden]` matrix: they never see sequence boundaries.

use crate::backend::{Activation, Pointwise};
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

/// `gate_up` rows are `[gate | up]` of width `2 * inter`; writes `act(gate) * up`.
pub fn gated_mul(gate_up: &[f32], inter: usize, act: Activation, out: &mut [f32]) {
    let rows = out.par_chunks_mut(inter).zip(gate_up.par_chunks(2 * inter));
    match act {
        Activation::Silu => rows.for_each(|(o, gu)| {
            let (g, u) = gu.split_at(inter);
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                *o = g / (1.0 + (-g).exp()) * u;
            }
        }),
        Activation::GeluTanh => rows.for_each(|(o, gu)| {
            const SQRT_2_OVER_PI: f32 = 0.797_884_6;
            let (g, u) = gu.split_at(inter);
            for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
                let inner = SQRT_2_OVER_PI * (g + 0.044715 * g * g * g);
                *o = 0.5 * g * (1.0 + tanh(inner)) * u;
            }
        }),
    }
}

/// RMSNorm of every head (`weight.len()` wide) of every row, in place (Q/K norm).
pub fn head_rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    x.par_chunks_mut(d).for_each(|head| {
        let ms = head.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        head.iter_mut()
            .zip(weight)
            .for_each(|(v, w)| *v = *v * inv * w);
    });
}

/// `cap * tanh(x / cap)`, in place (Gemma 2's final-logit soft-cap).
pub fn softcap(x: &mut [f32], cap: f32) {
    x.par_chunks_mut(4096)
        .for_each(|c| c.iter_mut().for_each(|v| *v = cap * (*v / cap).tanh()));
}

/// `x += y`, element-wise.
pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    x.par_chunks_mut(4096)
        .zip(y.par_chunks(4096))
        .for_each(|(a, b)| a.iter_mut().zip(b).for_each(|(a, b)| *a += b));
}

/// `tanh(y)` through [`exp_nonpositive`] (libm's `tanhf` does not vectorize and took a tenth
/// of Gemma's prefill): `sign(y) (1 - e) / (1 + e)` with `e = exp(-2|y|)`.
#[inline(always)]
fn tanh(y: f32) -> f32 {
    let e = exp_nonpositive(-2.0 * y.abs());
    ((1.0 - e) / (1.0 + e)).copysign(y)
}

/// `exp(x)` for `x <= 0` as `2^k * 2^f` with `|f| <= 1/2` and a degree-6 polynomial
/// (relative error about 1e-7, and 5e-8 |x| from rounding `x log2 e`): unlike libm's `expf`, this loop vectorizes.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    let t = x.max(-87.0) * std::f32::consts::LOG2_E;
    // Rounded to nearest by the float adder (1.5 * 2^23 leaves no fraction bits): `floor`
    // is a libm call on baseline x86-64 and would stop the loops around this from vectorizing.
    const ROUND: f32 = 12_582_912.0;
    let shifted = t + ROUND;
    let k = shifted - ROUND;
    let f = (t - k) * std::f32::consts::LN_2;
    let p = 1.0
        + f * (1.0
            + f * (0.5
                + f * (1.0 / 6.0 + f * (1.0 / 24.0 + f * (1.0 / 120.0 + f * (1.0 / 720.0))))));
    // `k` sits in the low mantissa bits of `shifted` (its bits are those of ROUND plus `k`),
    // and shifting by 23 leaves only them: `2^k` without a float-to-int conversion, whose
    // saturating `as` kept the loops around this scalar (most of the softmax's time).
    p * f32::from_bits(shifted.to_bits().wrapping_add(127) << 23)
}

/// The error function (Abramowitz and Stegun 7.1.26: absolute error 1.5e-7, below 5e-7 in
/// f32) through
/// [`exp_nonpositive`]: libm's `erff` is a call per value, most of a BERT MLP's time.
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_8 + t * (-1.453_152 + t * 1.061_405_4))));
    let y = 1.0 - poly * exp_nonpositive(-a * a);
    y.copysign(x)
}

/// `x += bias` per row of `bias.len()`, then `then`.
pub fn add_bias(x: &mut [f32], bias: &[f32], then: Option<Pointwise>) {
    x.par_chunks_mut(bias.len()).for_each(|row| {
        row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
        match then {
            None => {}
            Some(Pointwise::Gelu) => row
                .iter_mut()
                .for_each(|v| *v = 0.5 * *v * (1.0 + erf(*v / std::f32::consts::SQRT_2))),
            Some(Pointwise::Tanh) => row.iter_mut().for_each(|v| *v = tanh(*v)),
        }
    });
}

/// LayerNorm of each row of `weight.len()` in place.
pub fn layer_norm(x: &mut [f32], weight: &[f32], bias: &[f32], eps: f32) {
    let h = weight.len();
    x.par_chunks_mut(h).for_each(|row| {
        let mean = row.iter().sum::<f32>() / h as f32;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / h as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for ((v, w), b) in row.iter_mut().zip(weight).zip(bias) {
            *v = (*v - mean) * inv * w + b;
        }
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn erf_is_within_its_bound_of_the_exact_function() {
        let worst = (-6000..=6000)
            .map(|i| i as f32 / 1000.0)
            .map(|x| (super::erf(x) as f64 - candle_core::cpu::erf::erf_f64(x as f64)).abs())
            .fold(0f64, f64::max);
        assert!(worst < 5e-7, "max abs error {worst:e}");
    }

    #[test]
    fn exp_nonpositive_is_within_its_bound_of_the_exact_function() {
        // Relative error within 3e-7, plus what rounding `x log2(e)` to f32 adds as |x| grows.
        let worst = (0..=870_000)
            .map(|i| -(i as f32) / 10_000.0)
            .map(|x| {
                let err = (super::exp_nonpositive(x) as f64 / (x as f64).exp() - 1.0).abs();
                err / (3e-7 + 1e-7 * x.abs() as f64)
            })
            .fold(0f64, f64::max);
        assert!(worst <= 1.0, "error {worst} of its bound");
        assert_eq!(super::exp_nonpositive(0.0), 1.0);
    }
}
