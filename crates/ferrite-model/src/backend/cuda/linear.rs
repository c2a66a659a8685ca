//! Weight matrices on the GPU: bf16 (cuBLAS and ferrite's small-row matmuls), or a GGUF
//! file's quantized blocks as they are (candle's quantized CUDA matmuls). Gate|up weights
//! have their rows interleaved (gate j, up j), so the small-row matmul's warp that makes
//! gate j makes up j next and writes `act(gate) * up` itself.

use crate::backend::Stack;
use anyhow::{bail, Result};
use candle_core::quantized::ggml_file::qtensor_from_ggml;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;

/// A weight matrix `[n, k]` as the matmuls read it.
pub enum Linear {
    /// bf16, through cuBLAS or ferrite's small-row matmuls.
    Dense(Tensor),
    /// GGUF blocks on the device, through candle's quantized CUDA matmuls.
    Quant(Arc<QTensor>),
}

impl Linear {
    pub fn dims(&self) -> Result<(usize, usize)> {
        Ok(match self {
            Linear::Dense(t) => t.dims2()?,
            Linear::Quant(q) => q.shape().dims2()?,
        })
    }

    pub fn bytes(&self) -> usize {
        match self {
            Linear::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
            Linear::Quant(q) => q.storage_size_in_bytes(),
        }
    }

    /// The bf16 matrix, for what only takes one (cuBLAS timings).
    pub fn dense(&self) -> Result<&Tensor> {
        match self {
            Linear::Dense(t) => Ok(t),
            Linear::Quant(q) => bail!("a {:?} matrix is not dense", q.dtype()),
        }
    }
}

/// Block types candle multiplies on the GPU without dequantizing (its MMVQ/MMQ kernels).
fn gpu_quantized(t: GgmlDType) -> bool {
    use GgmlDType::*;
    matches!(
        t,
        Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2K | Q3K | Q4K | Q5K | Q6K
    )
}

/// A host tensor as bf16 on `dev`.
pub fn bf16(t: &QTensor, dev: &Device) -> Result<Tensor> {
    Ok(t.dequantize(&Device::Cpu)?
        .to_dtype(DType::BF16)?
        .to_device(dev)?)
}

/// Gate `[I, h]` and up `[I, h]` as one `[2I, h]` matrix whose rows alternate gate, up.
pub fn interleave_gate_up(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let (i, h) = gate.dims2()?;
    Ok(Tensor::stack(&[gate, up], 1)?.reshape((2 * i, h))?)
}

/// Host matrices `parts` (same width) as one `Linear` stacked as `stack`: quantized when
/// `quantized` and every part has the same block type candle's kernels take, else bf16.
pub fn upload(parts: &[QTensor], stack: Stack, quantized: bool, dev: &Device) -> Result<Linear> {
    let interleave = stack == Stack::GateUp;
    if interleave && parts.len() != 2 {
        bail!("gate|up weights come in two parts, not {}", parts.len());
    }
    let dtype = parts[0].dtype();
    if !(quantized && gpu_quantized(dtype) && parts.iter().all(|p| p.dtype() == dtype)) {
        let dense = parts
            .iter()
            .map(|p| bf16(p, dev))
            .collect::<Result<Vec<_>>>()?;
        return Ok(Linear::Dense(if interleave {
            interleave_gate_up(&dense[0], &dense[1])?
        } else {
            Tensor::cat(&dense, 0)?
        }));
    }
    // Rows are whole runs of blocks: stacking or interleaving rows moves bytes only.
    let (_, k) = parts[0].shape().dims2()?;
    let row = k / dtype.block_size() * dtype.type_size();
    let data = parts
        .iter()
        .map(|p| p.data())
        .collect::<candle_core::Result<Vec<_>>>()?;
    let rows: usize = data.iter().map(|d| d.len() / row).sum();
    let bytes: Vec<u8> = if interleave {
        data[0]
            .chunks(row)
            .zip(data[1].chunks(row))
            .flat_map(|(g, u)| g.iter().chain(u))
            .copied()
            .collect()
    } else {
        data.concat()
    };
    Ok(Linear::Quant(Arc::new(qtensor_from_ggml(
        dtype,
        &bytes,
        vec![rows, k],
        dev,
    )?)))
}

/// A random bf16 `[rows, cols]` matrix drawn on the device, normal with std 0.02.
pub fn random(rows: usize, cols: usize, dev: &Device) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, 0.02, (rows, cols), dev)?.to_dtype(DType::BF16)?)
}
