//! Linear layers over candle's quantized matmul, with rows of several projections that read
//! the same input fused into one weight (Q|K|V, gate|up), so the input is quantized once.

use anyhow::{anyhow, bail, Result};
use candle_core::quantized::{QMatMul, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};

/// How weights are kept in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WeightFormat {
    /// `F32` when the dequantized weights stay under [`AUTO_F32_LIMIT_BYTES`], else `Native`.
    #[default]
    Auto,
    /// As stored in the file (quantized blocks), matmul through candle's quantized kernels.
    Native,
    /// Dequantized to f32 at load: exact weights, candle's f32 GEMM.
    F32,
}

/// Largest f32 weight set `Auto` picks: candle's f32 GEMM batches rows (prefill, batched
/// decode) far better than its quantized CPU kernels, at 4-8x the memory.
pub const AUTO_F32_LIMIT_BYTES: u64 = 4 << 30;

impl WeightFormat {
    /// Resolves `Auto` for a model of `params` weights.
    pub fn resolve(self, params: u64) -> Self {
        match self {
            WeightFormat::Auto if params * 4 <= AUTO_F32_LIMIT_BYTES => WeightFormat::F32,
            WeightFormat::Auto => WeightFormat::Native,
            f => f,
        }
    }
}

pub struct Linear {
    inner: QMatMul,
    out_features: usize,
    in_features: usize,
    bytes: usize,
}

impl Linear {
    pub fn new(w: QTensor, format: WeightFormat) -> Result<Self> {
        let (out_features, in_features) = w.shape().dims2()?;
        let inner = match format {
            WeightFormat::Native | WeightFormat::Auto => QMatMul::from_qtensor(w)?,
            WeightFormat::F32 => QMatMul::Tensor(w.dequantize(&Device::Cpu)?),
        };
        let bytes = match &inner {
            QMatMul::QTensor(q) => q.storage_size_in_bytes(),
            QMatMul::Tensor(t) | QMatMul::TensorF16(t) => {
                t.elem_count() * t.dtype().size_in_bytes()
            }
        };
        Ok(Self {
            inner,
            out_features,
            in_features,
            bytes,
        })
    }

    /// Stacks weights `[n_i, k]` of one dtype into `[sum n_i, k]`.
    pub fn fused(parts: Vec<QTensor>, format: WeightFormat) -> Result<Self> {
        let dtype = parts[0].dtype();
        let k = parts[0].shape().dims2()?.1;
        let mut bytes = Vec::new();
        let mut n = 0;
        for p in &parts {
            let (pn, pk) = p.shape().dims2()?;
            if p.dtype() != dtype || pk != k {
                bail!("cannot fuse weights of different types or widths");
            }
            bytes.extend_from_slice(&p.data()?);
            n += pn;
        }
        let storage = QStorage::from_data(bytes.into(), &Device::Cpu, dtype)?;
        Self::new(QTensor::new(storage, (n, k))?, format)
    }

    /// True when all parts share a dtype and can be fused.
    pub fn can_fuse(parts: &[&QTensor]) -> bool {
        parts.windows(2).all(|w| w[0].dtype() == w[1].dtype())
    }

    pub fn out_features(&self) -> usize {
        self.out_features
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// `x`: `[rows, in_features]` -> `[rows, out_features]`.
    pub fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>> {
        debug_assert_eq!(x.len(), rows * self.in_features);
        let t = Tensor::from_slice(x, (rows, self.in_features), &Device::Cpu)?;
        let y = self.inner.forward(&t)?;
        y.flatten_all()?
            .to_vec1::<f32>()
            .map_err(|e| anyhow!("matmul output: {e}"))
    }
}
