//! Weight matrices on the GPU as f16 (WGSL has no bf16), rows packed two to a word; a matrix
//! larger than one binding is split by rows into parts, each multiplied by its own launch.

use super::device::Gpu;
use super::kernels::{launch, spread, Kernels, GEMV_ROWS};
use super::tensors::{f16_words, upload_words};
use anyhow::{bail, Result};
use candle_core::quantized::QTensor;
use candle_core::Device;

/// Rows `first..first + rows` of a matrix.
pub struct Part {
    pub buf: wgpu::Buffer,
    pub first: usize,
    pub rows: usize,
}

/// A `[rows, cols]` matrix (projections of one input stacked by rows).
pub struct Linear {
    pub parts: Vec<Part>,
    pub rows: usize,
    pub cols: usize,
}

impl Linear {
    /// `parts` stacked by rows, each dequantized and stored as f16.
    pub fn upload(gpu: &Gpu, parts: &[QTensor]) -> Result<Self> {
        let mut values = Vec::new();
        let mut cols = None;
        for p in parts {
            let (_, c) = p.shape().dims2()?;
            if cols.is_some_and(|w| w != c) {
                bail!(
                    "stacked projections of {} and {c} columns",
                    cols.unwrap_or(0)
                );
            }
            cols = Some(c);
            values.extend(
                p.dequantize(&Device::Cpu)?
                    .flatten_all()?
                    .to_vec1::<f32>()?,
            );
        }
        let cols = cols.unwrap_or(0);
        Self::from_f32(gpu, &values, cols)
    }

    pub fn from_f32(gpu: &Gpu, values: &[f32], cols: usize) -> Result<Self> {
        let rows = values.len() / cols.max(1);
        let words = f16_words(values, cols);
        let row_words = cols.div_ceil(2);
        let per_part = (gpu.limits.max_storage_buffer_binding_size as usize
            / (4 * row_words.max(1)))
        .min(rows.max(1));
        if per_part == 0 {
            bail!("a row of {cols} f16 values does not fit one binding");
        }
        let parts = (0..rows.max(1))
            .step_by(per_part)
            .map(|first| {
                let n = per_part.min(rows - first);
                Part {
                    buf: upload_words(gpu, "weights", &words[first * row_words..][..n * row_words]),
                    first,
                    rows: n,
                }
            })
            .collect();
        Ok(Self { parts, rows, cols })
    }

    pub fn bytes(&self) -> usize {
        self.rows * self.cols.div_ceil(2) * 4
    }
}

/// Where a matmul writes: `y[m, off + n]` in rows of `ldy`, stored or added.
pub struct Out<'a> {
    pub y: &'a wgpu::Buffer,
    pub ldy: usize,
    pub add: bool,
}

/// Which kernels a matmul takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pick {
    /// Matrix-vector up to [`GEMV_ROWS`] rows, tiles past that (GPUs).
    Gpu,
    /// Matrix-vector [`GEMV_ROWS`] rows at a time whatever the count: a CPU driver
    /// (lavapipe) runs tiles through workgroup memory slowly.
    Cpu,
    /// Tiles always: a row's sums run in one order whatever its company (`--batch-invariant`).
    Tiled,
}

/// `y (+)= x w^T` for `m` rows of `x`.
pub fn matmul(
    gpu: &Gpu,
    k: &Kernels,
    pass: &mut wgpu::ComputePass<'static>,
    (x, m): (&wgpu::Buffer, usize),
    w: &Linear,
    out: Out,
    pick: Pick,
) {
    let vectors = match pick {
        Pick::Gpu => m <= GEMV_ROWS,
        Pick::Cpu => true,
        Pick::Tiled => false,
    };
    for p in &w.parts {
        let params = |rows: usize, row0: usize| {
            [
                rows as u32,
                p.rows as u32,
                w.cols as u32,
                out.ldy as u32,
                p.first as u32,
                out.add as u32,
                row0 as u32,
            ]
        };
        let buffers = [x, &p.buf, out.y];
        if !vectors {
            let groups = [p.rows.div_ceil(64) as u32, m.div_ceil(32) as u32, 1];
            launch(
                &gpu.device,
                pass,
                &k.matmul,
                &buffers,
                &params(m, 0),
                groups,
            );
            continue;
        }
        for row0 in (0..m).step_by(GEMV_ROWS) {
            let rows = GEMV_ROWS.min(m - row0);
            let groups = spread(p.rows.div_ceil(16));
            launch(
                &gpu.device,
                pass,
                &k.gemv[rows - 1],
                &buffers,
                &params(rows, row0),
                groups,
            );
        }
    }
}
