//! Weight matrices on the GPU: GGUF blocks kept quantized where the kernels read their type
//! (blocks.rs), every other type as f16 (WGSL has no bf16), rows packed two to a word; a
//! matrix larger than one binding is split by rows into parts, each multiplied by its own
//! launch.

use super::blocks::{repack, Blocks, Format};
use super::device::Gpu;
use super::kernels::{launch, spread, Kernels, GEMV_ROWS};
use super::tensors::{f16_words, upload_words};
use anyhow::{bail, Result};
use candle_core::quantized::QTensor;
use candle_core::Device;
use rand::Rng;

/// Rows `first..first + rows` of a matrix in one format; a quantized part's block scales
/// from word `scales` on.
pub struct Part {
    pub buf: wgpu::Buffer,
    pub first: usize,
    pub rows: usize,
    pub scales: usize,
    pub format: Format,
}

/// A `[rows, cols]` matrix (projections of one input stacked by rows).
pub struct Linear {
    pub parts: Vec<Part>,
    pub rows: usize,
    pub cols: usize,
}

impl Linear {
    /// `parts` stacked by rows, each kept in its GGUF blocks where the kernels read its type
    /// (consecutive ones of one format in one part), else dequantized and stored as f16.
    pub fn upload(gpu: &Gpu, parts: &[QTensor]) -> Result<Self> {
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
        }
        let cols = cols.unwrap_or(0);
        let mut out = Self {
            parts: Vec::new(),
            rows: 0,
            cols,
        };
        for run in parts.chunk_by(|a, b| Format::of(a.dtype()) == Format::of(b.dtype())) {
            let format = Format::of(run[0].dtype());
            let mut blocks = Blocks {
                codes: Vec::new(),
                scales: Vec::new(),
            };
            for p in run {
                let b = match format {
                    Format::F16 => {
                        let values = p.dequantize(&Device::Cpu)?.flatten_all()?;
                        Blocks {
                            codes: f16_words(&values.to_vec1::<f32>()?, cols),
                            scales: Vec::new(),
                        }
                    }
                    _ => repack(format, p)?,
                };
                blocks.codes.extend(b.codes);
                blocks.scales.extend(b.scales);
            }
            out.push(gpu, &blocks, format)?;
        }
        Ok(out)
    }

    /// Random Q8_0 rows (`--load-format dummy`), stacked: a pool of random blocks tiled
    /// from a random start (a benchmark needs the bytes, not billions of fresh draws).
    pub fn random(gpu: &Gpu, rows: &[usize], cols: usize) -> Result<Self> {
        const POOL: usize = 1 << 16;
        let mut rng = rand::rng();
        // Codes uniform in -128..=127 (deviation ~74), scaled to a deviation of 0.02.
        let scale = half::f16::from_f32(0.02 / 73.9).to_bits() as u32;
        let pool: Vec<u32> = (0..POOL * 8).map(|_| rng.random()).collect();
        let blocks = rows.iter().sum::<usize>() * cols / 32;
        let start = rng.random_range(0..POOL);
        let codes = (0..blocks)
            .flat_map(|b| {
                let at = 8 * ((start + b) % POOL);
                pool[at..at + 8].iter().copied()
            })
            .collect();
        let blocks = Blocks {
            codes,
            scales: vec![scale; blocks],
        };
        let mut out = Self {
            parts: Vec::new(),
            rows: 0,
            cols,
        };
        out.push(gpu, &blocks, Format::Q8_0)?;
        Ok(out)
    }

    /// Rows in `format` stacked below the others, in parts that each fit one binding.
    fn push(&mut self, gpu: &Gpu, blocks: &Blocks, format: Format) -> Result<()> {
        let cols = self.cols;
        let row_words = format.row_words(cols);
        // Per row: its codes (f16 words for F16), and its blocks' scale words.
        let (code_row, scale_row) = match format {
            Format::F16 => (row_words, 0),
            _ => (
                cols / 32 * format.code_words(),
                cols / 32 * format.scale_words(),
            ),
        };
        let rows = blocks.codes.len() / code_row.max(1);
        // A 16-byte vector past each part for the padding.
        let limit = gpu.limits.max_storage_buffer_binding_size as usize - 16;
        let per_part = (limit / (4 * row_words.max(1))).min(rows.max(1));
        if per_part == 0 {
            bail!("a row of {cols} values does not fit one binding");
        }
        for first in (0..rows.max(1)).step_by(per_part) {
            let n = per_part.min(rows - first);
            let mut words = blocks.codes[first * code_row..][..n * code_row].to_vec();
            let scales = words.len();
            if scale_row > 0 {
                words.extend_from_slice(&blocks.scales[first * scale_row..][..n * scale_row]);
            }
            // Bound as 16-byte vectors.
            words.resize(words.len().next_multiple_of(4), 0);
            self.parts.push(Part {
                buf: upload_words(gpu, "weights", &words),
                first: self.rows + first,
                rows: n,
                scales,
                format,
            });
        }
        self.rows += rows;
        Ok(())
    }

    pub fn bytes(&self) -> usize {
        let part = |p: &Part| 4 * p.rows * p.format.row_words(self.cols);
        self.parts.iter().map(part).sum()
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
    /// Matrix-vector up to [`GEMV_ROWS`] rows, tiles on cooperative matrices past that (GPUs
    /// that have them).
    Coop,
    /// Matrix-vector [`GEMV_ROWS`] rows at a time whatever the count: a CPU driver
    /// (lavapipe) runs tiles through workgroup memory slowly.
    Cpu,
    /// Tiles always: a row's sums run in one order whatever its company (`--batch-invariant`).
    Tiled,
}

/// What the matrix-vector kernel does besides the product, where it takes the whole matmul
/// ([`fuses`]): a decode's norm and gated activation without launches of their own.
#[derive(Clone, Copy, Default)]
pub struct Fused<'a> {
    /// x's rows RMS-normalized first, with this weight and epsilon.
    pub norm: Option<(&'a wgpu::Buffer, f32)>,
    /// w is `[gate; up]`: y = act(gate) * up (1 SiLU, 2 GELU (tanh)).
    pub gated: u32,
}

/// Whether every part of `w` goes through the matrix-vector kernel for `m` rows of x.
fn by_vectors(w: &Linear, p: &Part, m: usize, pick: Pick) -> bool {
    // It reads f16 rows as whole 16-byte vectors.
    (p.format != Format::F16 || w.cols.is_multiple_of(8))
        && match pick {
            Pick::Gpu | Pick::Coop => m <= GEMV_ROWS,
            Pick::Cpu => true,
            Pick::Tiled => false,
        }
}

/// Whether the matmul of `m` rows through `w` can take [`Fused`] work: the matrix-vector
/// kernel takes every part (with `gated`, a single part whose subgroups take gate and up rows
/// together).
pub fn fuses(k: &Kernels, w: &Linear, m: usize, pick: Pick, gated: bool) -> bool {
    let whole = w.parts.iter().all(|p| by_vectors(w, p, m, pick));
    let pairs = (1..=m.min(GEMV_ROWS)).all(|rows| k.gemv_shape(rows).0 >= 2);
    whole && (!gated || (w.parts.len() == 1 && pairs))
}

/// `y (+)= x w^T` for `m` rows of `x`, with `fused` work where [`fuses`] said so.
pub fn matmul(
    gpu: &Gpu,
    k: &Kernels,
    pass: &mut wgpu::ComputePass<'static>,
    (x, m): (&wgpu::Buffer, usize),
    w: &Linear,
    (out, fused): (Out, Fused),
    pick: Pick,
) {
    let (gamma, eps) = fused.norm.unwrap_or((&k.empty, 0.0));
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
                p.scales as u32,
                0,
                fused.norm.is_some() as u32,
                eps.to_bits(),
                fused.gated,
            ]
        };
        if !by_vectors(w, p, m, pick) {
            let groups = [p.rows.div_ceil(64) as u32, m.div_ceil(64) as u32, 1];
            let tiles = match pick {
                Pick::Coop if !k.matmul_coop.is_empty() => &k.matmul_coop,
                _ => &k.matmul,
            };
            launch(
                gpu,
                pass,
                &tiles[p.format as usize],
                &[x, &p.buf, out.y],
                &params(m, 0),
                groups,
            );
            continue;
        }
        let buffers = [x, &p.buf, out.y, &k.empty, gamma];
        for row0 in (0..m).step_by(GEMV_ROWS) {
            let rows = GEMV_ROWS.min(m - row0);
            let (r, per_workgroup) = k.gemv_shape(rows);
            // Rows of y a workgroup writes.
            let outs = match fused.gated {
                0 => per_workgroup,
                _ => per_workgroup / 2,
            };
            let ys = match fused.gated {
                0 => p.rows,
                _ => p.rows / 2,
            };
            debug_assert!(fused.gated == 0 || r >= 2);
            let groups = spread(ys.div_ceil(outs));
            launch(
                gpu,
                pass,
                &k.gemv[p.format as usize][rows - 1],
                &buffers,
                &params(rows, row0),
                groups,
            );
        }
    }
}
