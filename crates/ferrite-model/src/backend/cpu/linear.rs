//! Linear layers: block-quantized weights through ferrite's int8 kernels ([`crate::backend::cpu::quant`]),
//! float weights through candle's f32 GEMM. Projections that read the same input (Q|K|V,
//! gate|up) are stacked into one weight when their forms match, and in any case share one
//! quantization of the input ([`LinearInput`]).

use super::quant::activations::QuantizedActs;
use super::quant::packed::{Codes, PackedWeight};
use super::quant::{matmul, Isa};
use crate::backend::Rounding;
use crate::settings::WeightFormat;
use anyhow::{anyhow, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};

enum Weights {
    Quantized(PackedWeight),
    /// `[in, out]` f32: stored transposed, so a matmul reads it row-major as it is (a
    /// `[out, in]` weight is repacked by the GEMM at every call, most of a small step's time).
    Float(Tensor),
}

pub struct Linear {
    weights: Weights,
    out_features: usize,
    /// How finely the int8 kernels quantize this matrix's input.
    input: Rounding,
}

/// A matmul input in both forms the layers read.
pub struct LinearInput<'a> {
    x: &'a [f32],
    rows: usize,
    q: &'a QuantizedActs,
}

impl<'a> LinearInput<'a> {
    /// Quantizes `x` (`[rows, cols]`, `rows` may be 0) into `scratch`, whose buffers are reused.
    pub fn new(
        x: &'a [f32],
        rows: usize,
        cols: usize,
        rounding: Rounding,
        scratch: &'a mut QuantizedActs,
    ) -> Self {
        scratch.quantize(x, rows, cols, rounding);
        Self {
            x,
            rows,
            q: scratch,
        }
    }
}

/// How a stored matrix of `dtype` is kept: repacked for the int8 kernels, or f32 (`None`).
fn packed_as(dtype: GgmlDType, format: WeightFormat) -> Option<Codes> {
    Codes::of(dtype).filter(|_| format != WeightFormat::F32)
}

/// Whether a stored `dtype` matrix runs on the int8 kernels in `format` (else as f32).
pub fn repacks(dtype: GgmlDType, format: WeightFormat) -> bool {
    packed_as(dtype, format).is_some()
}

/// [`Linear::bytes`] of a stored `[rows, cols]` matrix, known before it is read (plans).
pub fn matrix_bytes(dtype: GgmlDType, rows: usize, cols: usize, format: WeightFormat) -> usize {
    match packed_as(dtype, format) {
        Some(codes) => PackedWeight::bytes_for(rows, cols, codes, Isa::detect().layout()),
        None => rows * cols * 4,
    }
}

impl Linear {
    pub fn new(w: QTensor, format: WeightFormat, input: Rounding) -> Result<Self> {
        Ok(Self::rows_first(w, format, input)?.laid_out())
    }

    /// Quantized weights in the layout of this CPU's kernels (after any stacking).
    fn laid_out(self) -> Self {
        let weights = match self.weights {
            Weights::Quantized(w) => Weights::Quantized(w.into_layout(Isa::detect().layout())),
            float => float,
        };
        Self { weights, ..self }
    }

    /// The matrix with quantized weights row after row, as stacking takes them.
    fn rows_first(w: QTensor, format: WeightFormat, input: Rounding) -> Result<Self> {
        let out_features = w.shape().dims2()?.0;
        let weights = if packed_as(w.dtype(), format).is_none() {
            Weights::Float(w.dequantize(&Device::Cpu)?.t()?.contiguous()?)
        } else {
            Weights::Quantized(PackedWeight::from_qtensor(&w)?)
        };
        Ok(Self {
            weights,
            out_features,
            input,
        })
    }

    /// Projections of one input, stacked into one weight when they share a form.
    pub fn projections(
        parts: Vec<QTensor>,
        format: WeightFormat,
        input: Rounding,
    ) -> Result<Vec<Self>> {
        let layers: Vec<Self> = parts
            .into_iter()
            .map(|p| Self::rows_first(p, format, input))
            .collect::<Result<_>>()?;
        let out_features = layers.iter().map(|l| l.out_features).sum();
        let all_float = layers
            .iter()
            .all(|l| matches!(l.weights, Weights::Float(_)));
        let codes: Vec<_> = layers
            .iter()
            .filter_map(|l| match &l.weights {
                Weights::Quantized(w) => Some(w.codes),
                Weights::Float(_) => None,
            })
            .collect();
        let one_code_form = codes.len() == layers.len() && codes.windows(2).all(|c| c[0] == c[1]);
        let weights = if layers.len() > 1 && all_float {
            let ts: Vec<Tensor> = layers
                .into_iter()
                .map(|l| match l.weights {
                    Weights::Float(t) => t,
                    Weights::Quantized(_) => unreachable!("all float"),
                })
                .collect();
            Weights::Float(Tensor::cat(&ts, 1)?)
        } else if layers.len() > 1 && one_code_form {
            let ws = layers
                .into_iter()
                .map(|l| match l.weights {
                    Weights::Quantized(w) => w,
                    Weights::Float(_) => unreachable!("all quantized"),
                })
                .collect();
            Weights::Quantized(PackedWeight::stack(ws)?)
        } else {
            return Ok(layers.into_iter().map(Self::laid_out).collect());
        };
        Ok(vec![Self {
            weights,
            out_features,
            input,
        }
        .laid_out()])
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    pub fn input_rounding(&self) -> Rounding {
        self.input
    }

    /// Bytes the weights occupy.
    pub fn bytes(&self) -> usize {
        match &self.weights {
            Weights::Quantized(w) => w.bytes(),
            Weights::Float(t) => t.elem_count() * 4,
        }
    }

    /// `[rows, in_features]` -> `[rows, out_features]` into `out` (reused; it grows only
    /// past its capacity).
    pub fn forward(&self, input: &LinearInput, out: &mut Vec<f32>) -> Result<()> {
        out.resize(input.rows * self.out_features, 0.0);
        match &self.weights {
            Weights::Quantized(w) => matmul(w, input.q, out, Isa::detect()),
            Weights::Float(w) => {
                let cols = w.dim(0)?;
                let x = Tensor::from_slice(input.x, (input.rows, cols), &Device::Cpu)?;
                let y = x.matmul(w)?.flatten_all()?;
                out.copy_from_slice(
                    &y.to_vec1::<f32>()
                        .map_err(|e| anyhow!("matmul output: {e}"))?,
                );
            }
        }
        Ok(())
    }
}

/// Projections of one input (`parts`) laid side by side per row in `out`; `part` holds one
/// projection's output when they are not stacked into one weight.
pub fn project(
    parts: &[Linear],
    input: &LinearInput,
    out: &mut Vec<f32>,
    part: &mut Vec<f32>,
) -> Result<()> {
    if let [one] = parts {
        return one.forward(input, out);
    }
    let width: usize = parts.iter().map(Linear::out_features).sum();
    out.resize(input.rows * width, 0.0);
    let mut col = 0;
    for p in parts {
        p.forward(input, part)?;
        let n = p.out_features();
        for (dst, src) in out.chunks_mut(width).zip(part.chunks(n)) {
            dst[col..col + n].copy_from_slice(src);
        }
        col += n;
    }
    Ok(())
}
